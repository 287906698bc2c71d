//! [`Envoy`]: the [`Proxy`] that runs the real Envoy binary, one process at a time.

use std::net::SocketAddr;
use std::path::PathBuf;

use nix::sys::signal::Signal;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::admin::{AdminClient, DrainListeners};
use crate::config::{AdminAddress, ProxyConfig};
use crate::process::{EnvoyProcess, signal_pid, wait_admin_file};
use crate::{Exit, Proxy, ProxyError};

/// The real Envoy. Cheap to share behind an `Arc`: `run` and `drain` may be called from
/// different tasks at once (that is how a SIGTERM drains a running Envoy).
#[derive(Debug)]
pub struct Envoy {
    config: ProxyConfig,
    admin: watch::Sender<Option<SocketAddr>>,
    pid: watch::Sender<Option<u32>>,
}

// === impl Envoy ===

impl Envoy {
    /// An Envoy that will run with `config`. Nothing starts until [`Proxy::run`].
    pub fn new(config: ProxyConfig) -> Self {
        let admin = match &config.admin {
            AdminAddress::Fixed(addr) => Some(*addr),
            AdminAddress::FromFile(_) => None,
        };
        Envoy {
            config,
            admin: watch::Sender::new(admin),
            pid: watch::Sender::new(None),
        }
    }

    /// The config Envoy runs with.
    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// The admin address once known (at once when fixed, after start when Envoy picks it).
    pub fn watch_admin_address(&self) -> watch::Receiver<Option<SocketAddr>> {
        self.admin.subscribe()
    }

    /// An admin client, when the address is known.
    pub fn admin(&self) -> Result<AdminClient, ProxyError> {
        let addr = (*self.admin.borrow()).ok_or(ProxyError::AdminUnknown)?;
        Ok(AdminClient::new(addr))
    }

    /// The running Envoy's pid, `None` when none runs.
    pub fn pid(&self) -> watch::Receiver<Option<u32>> {
        self.pid.subscribe()
    }

    /// Sends `signal` to the running Envoy (e.g. SIGUSR1 to reopen its access logs).
    pub fn signal(&self, signal: Signal) -> Result<(), ProxyError> {
        let pid = (*self.pid.borrow()).ok_or(ProxyError::NotRunning)?;
        signal_pid(pid, signal)
    }
}

impl Proxy for Envoy {
    async fn run(&self, epoch: u32, abort: CancellationToken) -> Result<Exit, ProxyError> {
        let admin_file = match &self.config.admin {
            AdminAddress::FromFile(path) => {
                // A stale file would hand out the previous Envoy's address.
                let _ = std::fs::remove_file(path);
                self.admin.send_replace(None);
                Some(path.clone())
            }
            AdminAddress::Fixed(_) => None,
        };
        let process = EnvoyProcess::spawn(&self.config, epoch).await?;
        self.pid.send_replace(Some(process.pid()));
        let watch_admin = async {
            if let Some(path) = admin_file {
                let addr = wait_admin_file(&path).await;
                tracing::info!(%addr, "envoy admin address");
                self.admin.send_replace(Some(addr));
            }
            // Never resolves: the select below ends with Envoy's exit.
            std::future::pending::<Result<Exit, ProxyError>>().await
        };
        let result = tokio::select! {
            result = process.run(abort) => result,
            result = watch_admin => result,
        };
        self.pid.send_replace(None);
        result
    }

    async fn drain(&self, skip_exit: bool) -> Result<(), ProxyError> {
        let options = DrainListeners {
            inbound_only: self.config.sidecar,
            graceful: true,
            skip_exit,
        };
        // A drain asked for while Envoy is still binding its admin port waits for it (the
        // caller bounds the whole drain) rather than failing and leaving Envoy undrained.
        let mut admin = self.admin.subscribe();
        let addr = tokio::time::timeout(
            crate::admin::DEFAULT_TIMEOUT,
            admin.wait_for(Option::is_some),
        )
        .await
        .ok()
        .and_then(|r| r.ok().and_then(|a| *a))
        .ok_or(ProxyError::AdminUnknown)?;
        AdminClient::new(addr).drain_listeners(options).await?;
        Ok(())
    }

    fn cleanup(&self) {
        if self.config.config_cleanup {
            remove_logged(&self.config.config_path);
        }
        if let AdminAddress::FromFile(path) = &self.config.admin {
            remove_logged(path);
        }
    }

    fn reopen_logs(&self) -> Result<(), ProxyError> {
        self.signal(Signal::SIGUSR1)
    }

    fn admin_address(&self) -> Option<SocketAddr> {
        *self.admin.borrow()
    }

    async fn update_config(&self, config: &[u8]) -> Result<(), ProxyError> {
        let path = self.config.config_path.clone();
        let bytes = config.to_vec();
        let result =
            tokio::task::spawn_blocking(move || crate::write_atomically(&path, &bytes)).await;
        let source = match result {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(join) => std::io::Error::other(join.to_string()),
        };
        Err(ProxyError::ConfigWrite {
            path: self.config.config_path.clone(),
            source,
        })
    }
}

fn remove_logged(path: &PathBuf) {
    match std::fs::remove_file(path) {
        Ok(()) => tracing::debug!(path = %path.display(), "removed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove"),
    }
}

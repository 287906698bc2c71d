//! The supervisor's seam to the world: spawning and signalling Envoy, its admin API, the
//! pre-flight checks, Envoy's shared memory and sockets, the readiness marker and the node's
//! state directory. [`RealHost`] does it for real; the unit tests use a fake, so that every
//! decision of the supervisor runs under paused time without a real Envoy.
//!
//! Calls that can take long (admin queries, pre-flight) return `'static` futures that the
//! supervisor runs beside its loop; the rest are quick and synchronous.

use std::any::Any;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use envoy_agent_proxy::admin::DrainListeners;
use envoy_agent_proxy::preflight::{self, PreflightError};
use envoy_agent_proxy::{
    AdminClient, AdminError, EnvoyProcess, Exit, ProxyConfig, ProxyError, ServerInfo, Signal,
};
use tokio::sync::{mpsc, oneshot};

use crate::node::{self, EpochLock, Heartbeat, Rejected};

/// A future the supervisor runs beside its loop.
pub type Task<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Something held while it lives (a lock, bound sockets); dropping it releases it.
pub type Guard = Box<dyn Any + Send>;

/// A started Envoy process.
#[derive(Debug)]
pub struct Spawned {
    /// Its pid.
    pub pid: u32,
    /// Signals for it, delivered only while it has not been reaped.
    pub signals: mpsc::UnboundedSender<Signal>,
    /// Its exit, once reaped.
    pub exit: oneshot::Receiver<Result<Exit, ProxyError>>,
}

/// What the stale-INITIALIZING repair found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// The flag was clear (or there is no segment): nothing to do.
    Clean,
    /// The flag was set and has been cleared.
    Cleared,
    /// The flag could not be checked or cleared; the segment was left untouched.
    Failed(String),
}

/// Everything the supervisor does outside its own memory.
pub trait Host: Send + Sync + 'static {
    /// Starts Envoy at `epoch`.
    fn spawn(&self, epoch: u32) -> impl Future<Output = Result<Spawned, ProxyError>> + Send;
    /// `/server_info` on the family's admin address, bounded.
    fn server_info(&self) -> Task<Result<ServerInfo, AdminError>>;
    /// `POST /drain_listeners` on the family's admin address, bounded.
    fn drain(&self, options: DrainListeners) -> Task<Result<(), AdminError>>;
    /// The binary's `--hot-restart-version`.
    fn hot_restart_version(&self) -> Task<Result<String, String>>;
    /// Pre-flight for a new epoch: the binary's hot-restart version must be `running` (when one
    /// runs) and Envoy must accept the config. `Err` holds the reason, in Envoy's words.
    fn preflight(&self, running: Option<String>) -> Task<Result<(), String>>;
    /// Clears a stale INITIALIZING flag. Only called when no Envoy of the family initializes.
    fn repair_initializing(&self, hot_restart_version: &str) -> Repair;
    /// Binds the hot-restart socket names of dead (or gone) `parent_epoch` and answers its
    /// child's requests. Fails while the parent still holds them.
    fn stand_in(&self, parent_epoch: u32) -> std::io::Result<Guard>;
    /// Creates (`true`) or removes the readiness marker.
    fn set_marker(&self, present: bool) -> std::io::Result<()>;
    /// Whether the node has a state directory (cross-pod handoffs).
    fn has_node(&self) -> bool;
    /// Every heartbeat in the node's state directory, and the files not trusted.
    fn read_heartbeats(&self) -> (Vec<Heartbeat>, Vec<Rejected>);
    /// Writes this supervisor's heartbeat.
    fn write_heartbeat(&self, heartbeat: &Heartbeat) -> std::io::Result<()>;
    /// Removes this supervisor's heartbeat (only its own).
    fn remove_heartbeat(&self, identity: &str);
    /// Takes the node's epoch lock if free.
    fn try_lock(&self) -> std::io::Result<Option<Guard>>;
    /// Now, in Unix milliseconds (heartbeat times).
    fn now_unix_ms(&self) -> u64;
}

/// The real world.
#[derive(Debug, Clone)]
pub struct RealHost {
    proxy: ProxyConfig,
    admin: AdminClient,
    base_id: u32,
    state_dir: Option<PathBuf>,
    marker: Option<PathBuf>,
}

impl RealHost {
    /// The host for a family of `proxy`, reached at `admin`.
    pub fn new(
        proxy: ProxyConfig,
        admin: AdminClient,
        base_id: u32,
        state_dir: Option<PathBuf>,
        marker: Option<PathBuf>,
    ) -> Self {
        RealHost {
            proxy,
            admin,
            base_id,
            state_dir,
            marker,
        }
    }
}

/// Bound on a drain call.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

impl Host for RealHost {
    async fn spawn(&self, epoch: u32) -> Result<Spawned, ProxyError> {
        let process = EnvoyProcess::spawn(&self.proxy, epoch).await?;
        let pid = process.pid();
        let (signals, receiver) = mpsc::unbounded_channel();
        let (report, exit) = oneshot::channel();
        tokio::spawn(async move {
            let _ = report.send(process.supervise(receiver).await);
        });
        Ok(Spawned { pid, signals, exit })
    }

    fn server_info(&self) -> Task<Result<ServerInfo, AdminError>> {
        let admin = self.admin.clone();
        Box::pin(async move { admin.server_info().await })
    }

    fn drain(&self, options: DrainListeners) -> Task<Result<(), AdminError>> {
        let admin = self.admin.clone().with_timeout(DRAIN_TIMEOUT);
        Box::pin(async move {
            tracing::info!(admin = %admin.addr(), endpoint = %options.endpoint(), "draining envoy listeners");
            admin.drain_listeners(options).await
        })
    }

    fn hot_restart_version(&self) -> Task<Result<String, String>> {
        let binary = self.proxy.binary_path.clone();
        Box::pin(async move {
            preflight::hot_restart_version(&binary)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn preflight(&self, running: Option<String>) -> Task<Result<(), String>> {
        let proxy = self.proxy.clone();
        Box::pin(async move {
            // Both exec the binary (~50 ms each): side by side, not one after the other.
            let (version, validated) = tokio::join!(
                preflight::hot_restart_version(&proxy.binary_path),
                preflight::validate(&proxy)
            );
            let version = version.map_err(|e| e.to_string())?;
            if let Some(running) = running.filter(|r| *r != version) {
                return Err(format!(
                    "{} has hot-restart version {version}, the running envoy {running}: \
                     they cannot hot-restart (a cold handover is needed)",
                    proxy.binary_path.display()
                ));
            }
            validated.map_err(|e| match e {
                PreflightError::Invalid { message, .. } => {
                    format!("envoy rejects {}: {message}", proxy.config_path.display())
                }
                other => other.to_string(),
            })
        })
    }

    fn repair_initializing(&self, hot_restart_version: &str) -> Repair {
        let path = crate::shm::path(self.base_id);
        if !path.exists() {
            return Repair::Clean;
        }
        match crate::shm::clear_initializing_at(&path, hot_restart_version) {
            Ok(true) => Repair::Cleared,
            Ok(false) => Repair::Clean,
            Err(e) => Repair::Failed(e.to_string()),
        }
    }

    fn stand_in(&self, parent_epoch: u32) -> std::io::Result<Guard> {
        crate::absorber::Absorber::bind(self.base_id, parent_epoch).map(|a| Box::new(a) as Guard)
    }

    fn set_marker(&self, present: bool) -> std::io::Result<()> {
        let Some(marker) = &self.marker else {
            return Ok(());
        };
        if present {
            envoy_agent_proxy::write_atomically(marker, b"ready\n")
        } else {
            match std::fs::remove_file(marker) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            }
        }
    }

    fn has_node(&self) -> bool {
        self.state_dir.is_some()
    }

    fn read_heartbeats(&self) -> (Vec<Heartbeat>, Vec<Rejected>) {
        match &self.state_dir {
            Some(dir) => node::read_all(dir),
            None => (Vec::new(), Vec::new()),
        }
    }

    fn write_heartbeat(&self, heartbeat: &Heartbeat) -> std::io::Result<()> {
        match &self.state_dir {
            Some(dir) => node::write(dir, heartbeat),
            None => Ok(()),
        }
    }

    fn remove_heartbeat(&self, identity: &str) {
        if let Some(dir) = &self.state_dir {
            node::remove(dir, identity);
        }
    }

    fn try_lock(&self) -> std::io::Result<Option<Guard>> {
        match &self.state_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                Ok(EpochLock::try_acquire(dir)?.map(|l| Box::new(l) as Guard))
            }
            None => Ok(Some(Box::new(()))),
        }
    }

    fn now_unix_ms(&self) -> u64 {
        node::unix_ms()
    }
}

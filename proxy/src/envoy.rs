//! [`Envoy`]: the [`Proxy`] that runs the real Envoy binary.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStderr, Command};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::admin::{AdminClient, DrainListeners};
use crate::args::envoy_args;
use crate::config::{AdminAddress, ProxyConfig};
use crate::{Exit, Proxy, ProxyError, spawner};

/// How much of Envoy's stderr is kept for error messages.
const STDERR_TAIL_BYTES: usize = 8 << 10;
/// How often the admin address file is looked for while Envoy starts.
const ADMIN_FILE_POLL: Duration = Duration::from_millis(20);
/// How long we wait for Envoy's stderr to reach end-of-file once it has exited.
const STDERR_FLUSH_WAIT: Duration = Duration::from_secs(1);

/// The last bytes Envoy wrote to stderr.
#[derive(Debug, Default)]
struct Tail(VecDeque<u8>);

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        self.0.extend(bytes);
        let excess = self.0.len().saturating_sub(STDERR_TAIL_BYTES);
        self.0.drain(..excess);
    }

    fn text(&self) -> String {
        let bytes: Vec<u8> = self.0.iter().copied().collect();
        let text = String::from_utf8_lossy(&bytes);
        // Start at a line boundary when we cut the front off.
        match (self.0.len() >= STDERR_TAIL_BYTES, text.find('\n')) {
            (true, Some(i)) => text[i + 1..].to_owned(),
            _ => text.into_owned(),
        }
    }
}

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
        kill(Pid::from_raw(pid as i32), signal).map_err(|errno| ProxyError::Signal {
            pid,
            signal,
            errno,
        })
    }

    fn command(&self, epoch: u32) -> Command {
        let built = envoy_args(&self.config, epoch);
        for warning in &built.warnings {
            tracing::warn!(%warning, "envoy command line");
        }
        let mut command = Command::new(&self.config.binary_path);
        command
            .args(&built.args)
            // Its own process group: a terminal's Ctrl-C reaches the agent, which decides.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped())
            // Last resort only: if the future running Envoy is dropped, do not leak Envoy.
            .kill_on_drop(true);
        // If the agent dies, so does Envoy (the spawner thread is the parent that counts).
        crate::sys::die_with_parent(&mut command, Signal::SIGTERM);
        if let (true, Some(run_as)) = (self.config.agent_is_root, self.config.run_as) {
            command.uid(run_as.uid).gid(run_as.gid);
        }
        tracing::info!(
            binary = %self.config.binary_path.display(),
            args = ?built.args,
            epoch,
            "starting envoy"
        );
        command
    }

    /// SIGTERM, then SIGKILL to the whole process group once `grace` has passed.
    async fn stop(&self, child: &mut Child, pid: u32) -> std::io::Result<ExitStatus> {
        let grace = self.config.stop_grace;
        if let Err(errno) = kill(Pid::from_raw(pid as i32), Signal::SIGTERM) {
            tracing::debug!(pid, %errno, "SIGTERM to envoy failed (already gone?)");
        }
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                tracing::warn!(pid, ?grace, "envoy ignored SIGTERM; sending SIGKILL");
                let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
                child.wait().await
            }
        }
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
        let mut child = spawner::spawn(self.command(epoch))
            .await
            .map_err(|source| ProxyError::Spawn {
                binary: self.config.binary_path.clone(),
                source,
            })?;
        let started = Instant::now();
        let pid = child.id().unwrap_or_default();
        self.pid.send_replace(Some(pid));
        tracing::info!(pid, epoch, "envoy started");

        let tail = Arc::new(Mutex::new(Tail::default()));
        let forwarder = child
            .stderr
            .take()
            .map(|stderr| tokio::spawn(forward_stderr(stderr, tail.clone())));

        let mut admin_poll = tokio::time::interval(ADMIN_FILE_POLL);
        let mut admin_pending = admin_file.is_some();
        let mut aborted = false;
        let status = loop {
            tokio::select! {
                status = child.wait() => break status,
                () = abort.cancelled(), if !aborted => {
                    aborted = true;
                    tracing::info!(pid, "stopping envoy");
                    break self.stop(&mut child, pid).await;
                }
                _ = admin_poll.tick(), if admin_pending => {
                    if let Some(addr) = admin_file.as_deref().and_then(read_admin_file) {
                        tracing::info!(%addr, "envoy admin address");
                        self.admin.send_replace(Some(addr));
                        admin_pending = false;
                    }
                }
            }
        };
        self.pid.send_replace(None);
        let status = status.map_err(|source| ProxyError::Wait { pid, source })?;
        if let Some(forwarder) = forwarder {
            // Envoy's last words arrive after its exit status; wait for them, boundedly (a
            // grandchild holding the pipe open must not hold us).
            let _ = tokio::time::timeout(STDERR_FLUSH_WAIT, forwarder).await;
        }
        let stderr_tail = tail.lock().map(|t| t.text()).unwrap_or_default();
        Ok(Exit {
            pid,
            epoch,
            status,
            aborted,
            ran_for: started.elapsed(),
            stderr_tail,
        })
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

fn read_admin_file(path: &std::path::Path) -> Option<SocketAddr> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Copies Envoy's stderr to ours as it comes and keeps the tail for error messages.
async fn forward_stderr(mut stderr: ChildStderr, tail: Arc<Mutex<Tail>>) {
    let mut out = tokio::io::stderr();
    let mut buf = vec![0u8; 8 << 10];
    loop {
        match stderr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let chunk = &buf[..n];
                if let Ok(mut t) = tail.lock() {
                    t.push(chunk);
                }
                // Our stderr failing (closed terminal) must not stop the draining of Envoy's.
                let _ = out.write_all(chunk).await;
            }
        }
    }
    let _ = out.flush().await;
}

/// The exit code a supervisor passes on for `status`: the code, or 128+N for signal N.
pub fn exit_code(status: &ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_bytes_from_a_line_start() {
        let mut tail = Tail::default();
        tail.push(b"first line\n");
        assert_eq!(tail.text(), "first line\n");
        for i in 0..2000 {
            tail.push(format!("line {i}\n").as_bytes());
        }
        let text = tail.text();
        assert!(text.len() <= STDERR_TAIL_BYTES);
        assert!(text.starts_with("line "), "{:?}", &text[..20]);
        assert!(text.ends_with("line 1999\n"));
    }

    #[test]
    fn exit_codes_pass_signals_as_128_plus_n() {
        assert_eq!(exit_code(&ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(&ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(&ExitStatus::from_raw(9)), 137);
        assert_eq!(exit_code(&ExitStatus::from_raw(15)), 143);
    }
}

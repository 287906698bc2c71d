//! [`EnvoyProcess`]: one Envoy process at one restart epoch, from spawn to reaped exit.
//!
//! [`crate::Envoy`] runs one of these at a time; the hot-restart supervisor runs several side
//! by side (a draining parent and its child). Spawning goes through the spawner thread
//! (`PR_SET_PDEATHSIG` follows it), into Envoy's own process group, with its stdout and stderr
//! always read and copied through [`crate::output`] (never waiting on our reader), and its
//! stderr's tail kept for error messages.

use std::collections::VecDeque;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::args::envoy_args;
use crate::config::ProxyConfig;
use crate::{Exit, ProxyError, spawner};

/// How much of Envoy's stderr is kept for error messages.
const STDERR_TAIL_BYTES: usize = 8 << 10;
/// How often an admin address file is looked for while Envoy starts.
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

/// One running Envoy process.
#[derive(Debug)]
pub struct EnvoyProcess {
    child: Child,
    pid: u32,
    epoch: u32,
    started: Instant,
    stop_grace: Duration,
    tail: Arc<Mutex<Tail>>,
    /// The tasks copying its stdout and stderr.
    forwarders: Vec<JoinHandle<()>>,
    /// The container's OOM-kill count when it started: a SIGKILL with the count risen is the
    /// OOM killer's.
    oom_kills: Option<u64>,
}

// === impl EnvoyProcess ===

impl EnvoyProcess {
    /// Starts Envoy for `config` at restart `epoch`.
    pub async fn spawn(config: &ProxyConfig, epoch: u32) -> Result<Self, ProxyError> {
        crate::drain_notice::prepare(config, epoch);
        let mut child = spawner::spawn(command(config, epoch))
            .await
            .map_err(|source| ProxyError::Spawn {
                binary: config.binary_path.clone(),
                source,
            })?;
        let pid = child.id().unwrap_or_default();
        let oom_kills = crate::cgroup::container().oom_kills();
        tracing::info!(event = "envoy_started", pid, epoch, "envoy started");
        let tail = Arc::new(Mutex::new(Tail::default()));
        let mut forwarders = Vec::with_capacity(2);
        if let Some(stdout) = child.stdout.take() {
            forwarders.push(tokio::spawn(
                forward(stdout, crate::output::stdout(), None).in_current_span(),
            ));
        }
        if let Some(stderr) = child.stderr.take() {
            let tail = Some(tail.clone());
            forwarders.push(tokio::spawn(
                forward(stderr, crate::output::stderr(), tail).in_current_span(),
            ));
        }
        Ok(EnvoyProcess {
            child,
            pid,
            epoch,
            started: Instant::now(),
            stop_grace: config.options.stop_grace,
            tail,
            forwarders,
            oom_kills,
        })
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its restart epoch.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Waits for Envoy to exit; cancelling `abort` stops it first (SIGTERM, then SIGKILL to
    /// its process group after the grace). Resolves once Envoy has been reaped.
    pub async fn run(self, abort: CancellationToken) -> Result<Exit, ProxyError> {
        self.run_or_kill(abort, std::future::pending()).await
    }

    /// [`EnvoyProcess::run`], and SIGKILL to Envoy's process group as soon as `kill` resolves:
    /// an Envoy judged wedged (silent) would not act on SIGTERM either (a stopped process
    /// keeps it pending; a stuck main thread never runs its handler). Resolves once Envoy has
    /// been reaped.
    pub async fn run_or_kill(
        mut self,
        abort: CancellationToken,
        kill: impl std::future::Future<Output = ()>,
    ) -> Result<Exit, ProxyError> {
        let (status, aborted) = tokio::select! {
            status = self.child.wait() => (status, false),
            () = abort.cancelled() => {
                tracing::info!(pid = self.pid, epoch = self.epoch, "stopping envoy");
                (self.stop().await, true)
            }
            () = kill => {
                tracing::info!(pid = self.pid, epoch = self.epoch, "killing envoy (SIGKILL)");
                // Not reaped yet: the pid is still Envoy's.
                let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
                (self.child.wait().await, true)
            }
        };
        self.finish(status, aborted).await
    }

    /// Waits for Envoy to exit, delivering each signal sent on `signals` while it runs. A
    /// signal is only ever sent before Envoy was reaped, so it cannot reach another process
    /// that got the pid since. SIGKILL goes to Envoy's whole process group. Resolves once Envoy
    /// has been reaped; [`Exit::aborted`] says whether a stopping signal of ours came first.
    pub async fn supervise(
        mut self,
        mut signals: mpsc::UnboundedReceiver<Signal>,
    ) -> Result<Exit, ProxyError> {
        let mut stopped = false;
        let mut open = true;
        let status = loop {
            tokio::select! {
                status = self.child.wait() => break status,
                signal = signals.recv(), if open => match signal {
                    None => open = false,
                    Some(signal) => {
                        stopped |= matches!(signal, Signal::SIGTERM | Signal::SIGKILL | Signal::SIGINT);
                        let pid = Pid::from_raw(self.pid as i32);
                        let sent = if signal == Signal::SIGKILL { killpg(pid, signal) } else { kill(pid, signal) };
                        match sent {
                            Ok(()) => tracing::debug!(pid = self.pid, epoch = self.epoch, %signal, "signalled envoy"),
                            Err(errno) => tracing::debug!(pid = self.pid, %signal, %errno, "cannot signal envoy"),
                        }
                    }
                },
            }
        };
        self.finish(status, stopped).await
    }

    async fn finish(
        mut self,
        status: std::io::Result<ExitStatus>,
        aborted: bool,
    ) -> Result<Exit, ProxyError> {
        let pid = self.pid;
        spawner::release(pid);
        let status = status.map_err(|source| ProxyError::Wait { pid, source })?;
        // Envoy's last words arrive after its exit status; wait for them, boundedly (a
        // grandchild holding a pipe open must not hold us).
        let forwarders = std::mem::take(&mut self.forwarders);
        let _ = tokio::time::timeout(STDERR_FLUSH_WAIT, async {
            for forwarder in forwarders {
                let _ = forwarder.await;
            }
        })
        .await;
        let stderr_tail = self.tail.lock().map(|t| t.text()).unwrap_or_default();
        let oom = oom_killed(&status, self.oom_kills);
        if let Some(oom) = &oom {
            tracing::warn!(
                event = "oom_killed",
                pid,
                epoch = self.epoch,
                limit_bytes = oom.limit,
                "envoy was OOM-killed: {oom}"
            );
        }
        Ok(Exit {
            pid,
            epoch: self.epoch,
            status,
            aborted,
            ran_for: self.started.elapsed(),
            stderr_tail,
            oom,
        })
    }

    async fn stop(&mut self) -> std::io::Result<ExitStatus> {
        let pid = self.pid;
        if let Err(errno) = kill(Pid::from_raw(pid as i32), Signal::SIGTERM) {
            tracing::debug!(pid, %errno, "SIGTERM to envoy failed (already gone?)");
        }
        match tokio::time::timeout(self.stop_grace, self.child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                tracing::warn!(pid, grace = ?self.stop_grace, "envoy ignored SIGTERM; sending SIGKILL");
                let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
                self.child.wait().await
            }
        }
    }
}

/// Sends `signal` to process `pid`.
pub fn signal_pid(pid: u32, signal: Signal) -> Result<(), ProxyError> {
    kill(Pid::from_raw(pid as i32), signal).map_err(|errno| ProxyError::Signal {
        pid,
        signal,
        errno,
    })
}

fn command(config: &ProxyConfig, epoch: u32) -> Command {
    let mut built = envoy_args(config, epoch);
    if crate::args::takes_over(config, epoch)
        && crate::control_plane::wait_for_config(&mut built.args, &config.config_path)
    {
        // Going LIVE without its config would make its parent stop serving.
        tracing::info!(
            event = "fetch_wait",
            epoch,
            "the new epoch waits for its control plane's config (initial_fetch_timeout 0s on lds and cds)"
        );
    }
    for warning in &built.warnings {
        tracing::warn!(%warning, "envoy command line");
    }
    let mut command = Command::new(&config.binary_path);
    command
        .args(&built.args)
        // Its own process group: a terminal's Ctrl-C reaches the agent, which decides.
        .process_group(0)
        .stdin(Stdio::null())
        // systemd's notification socket is the agent's, not Envoy's.
        .env_remove("NOTIFY_SOCKET")
        // Read by us, always: Envoy blocked on a full pipe (a log reader that stopped) would
        // stop serving.
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Last resort only: if the future running Envoy is dropped, do not leak Envoy.
        .kill_on_drop(true);
    // If the agent dies, so does Envoy (the spawner thread is the parent that counts).
    crate::sys::die_with_parent(&mut command, Signal::SIGTERM);
    if let (true, Some(run_as)) = (config.agent_is_root, config.options.run_as) {
        command.uid(run_as.uid).gid(run_as.gid);
    }
    tracing::info!(
        binary = %config.binary_path.display(),
        args = ?built.args,
        epoch,
        "starting envoy"
    );
    command
}

/// Reads an address Envoy wrote with `--admin-address-path` (`ip:port`, or a Unix socket's
/// path), if it is there yet.
pub fn read_admin_file(path: &Path) -> Option<crate::admin::Address> {
    crate::admin::Address::parse(&std::fs::read_to_string(path).ok()?)
}

/// Waits until Envoy has written its admin address to `path`.
pub async fn wait_admin_file(path: &Path) -> crate::admin::Address {
    let mut poll = tokio::time::interval(ADMIN_FILE_POLL);
    loop {
        poll.tick().await;
        if let Some(addr) = read_admin_file(path) {
            return addr;
        }
    }
}

/// Copies one of Envoy's outputs to ours as it comes, line by line, without ever waiting for
/// our reader (lines it does not take are dropped and counted); keeps the tail in `tail`.
async fn forward(
    mut from: impl AsyncRead + Unpin,
    to: &'static crate::output::Stream,
    tail: Option<Arc<Mutex<Tail>>>,
) {
    let mut lines = crate::output::Lines::new(to);
    let mut buf = vec![0u8; 8 << 10];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let chunk = &buf[..n];
                if let Some(Ok(mut t)) = tail.as_ref().map(|t| t.lock()) {
                    t.push(chunk);
                }
                lines.push(chunk);
            }
        }
    }
    lines.finish();
}

/// The exit code a supervisor passes on for `status`: the code, or 128+N for signal N.
pub fn exit_code(status: &ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    }
}

/// Whether a death by `status` was the OOM killer's: SIGKILL, and the container's OOM-kill count
/// risen since `before` (a `kill -9` leaves it as it was).
fn oom_killed(status: &ExitStatus, before: Option<u64>) -> Option<crate::OomKill> {
    use std::os::unix::process::ExitStatusExt;
    if status.signal() != Some(Signal::SIGKILL as i32) {
        return None;
    }
    let container = crate::cgroup::container();
    let after = container.oom_kills()?;
    (after > before?).then(|| crate::OomKill {
        limit: container.memory_limit(),
    })
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

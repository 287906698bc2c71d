//! [`Supervisor`]: one actor task owning the epochs, and [`SupervisorHandle`]s to steer it.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use envoy_agent_proxy::preflight::{self, PreflightError};
use envoy_agent_proxy::{
    AdminAddress, AdminClient, EnvoyProcess, Exit, ProxyConfig, ProxyError, ServerState, Signal,
    signal_pid,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::absorber::Absorber;
use crate::metrics::{ExitKind, SupervisorMetrics};
use crate::node::{self, EpochLock, Heartbeat};
use crate::shm;
use crate::state::{
    EpochInfo, EpochState, Handoff, HandoffResult, Outcome, Phase, SupervisorState, Wedge,
    WedgeReason,
};

/// Exit code after a wedge (`EX_TEMPFAIL`: restart me).
pub const EXIT_WEDGED: u8 = 75;

/// How often a starting epoch's admin is asked whether it is LIVE.
const LIVE_POLL: Duration = Duration::from_millis(10);
/// How often the serving epoch's admin is checked by the watchdog.
const WATCHDOG_POLL: Duration = Duration::from_secs(1);
/// Bound on one admin call of the supervisor.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(2);
/// Retries of a failed handoff whose parent lost its admin endpoint.
const MAX_RETRIES: u32 = 3;
/// Wedges kept in the published state.
const WEDGES_KEPT: usize = 16;

/// Why a config cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Hot restart settings are missing.
    #[error("hot restart needs a base id and a parent shutdown time")]
    NoHotRestart,
    /// Parent shutdown time must exceed drain time.
    #[error(
        "--parent-shutdown-time ({parent_shutdown:?}) must exceed --drain-time ({drain:?}): \
         the parent would be terminated before its connections drained"
    )]
    ParentShutdownTooShort {
        /// Drain time.
        drain: Duration,
        /// Parent shutdown time.
        parent_shutdown: Duration,
    },
    /// The admin port must be fixed.
    #[error(
        "hot restart needs a fixed admin port (every epoch binds the same one); \
         the bootstrap asks for port 0: set one or pass --admin-address"
    )]
    AdminPortZero,
}

/// The supervisor's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Envoy's settings; `hot_restart` must be set. Its drain duration is `--drain-time`.
    pub proxy: ProxyConfig,
    /// Hot-restart when the bootstrap changes.
    pub watch_config: bool,
    /// Debounce of the config watch.
    pub watch_debounce: Duration,
    /// The per-node state directory (shared between pods of a node): heartbeats and the
    /// epoch lock. Without it the supervisor cannot find a predecessor and starts at epoch 0.
    pub state_dir: Option<PathBuf>,
    /// This supervisor's name in the state directory (the pod name).
    pub identity: String,
    /// How often the heartbeat is rewritten.
    pub heartbeat_period: Duration,
    /// A file that exists exactly while the newest epoch is LIVE.
    pub ready_marker: Option<PathBuf>,
    /// How long a new epoch may take from trigger to LIVE.
    pub handoff_deadline: Duration,
    /// How long the serving epoch's admin may stay silent before the family is wedged.
    pub admin_unresponsive_deadline: Duration,
}

impl Config {
    /// A config with defaults around `proxy`.
    pub fn new(proxy: ProxyConfig) -> Self {
        Config {
            proxy,
            watch_config: false,
            watch_debounce: Duration::from_millis(200),
            state_dir: None,
            identity: format!("supervisor-{}", std::process::id()),
            heartbeat_period: Duration::from_millis(500),
            ready_marker: None,
            handoff_deadline: Duration::from_secs(60),
            admin_unresponsive_deadline: Duration::from_secs(30),
        }
    }

    /// Checks what the supervisor cannot work with.
    pub fn validate(&self) -> Result<(SocketAddr, u32), ConfigError> {
        let hot = self
            .proxy
            .hot_restart
            .as_ref()
            .ok_or(ConfigError::NoHotRestart)?;
        if hot.parent_shutdown_time <= self.proxy.drain_duration {
            return Err(ConfigError::ParentShutdownTooShort {
                drain: self.proxy.drain_duration,
                parent_shutdown: hot.parent_shutdown_time,
            });
        }
        match &self.proxy.admin {
            AdminAddress::Fixed(addr) if addr.port() != 0 => Ok((*addr, hot.base_id)),
            _ => Err(ConfigError::AdminPortZero),
        }
    }
}

/// How the supervisor ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SupervisorExit {
    /// Stopped on request; every epoch stopped.
    Stopped,
    /// Epoch 0 (the first) could not start.
    StartFailed {
        /// Its exit code, or 1 when it never ran.
        code: i32,
        /// Why (Envoy's words).
        message: String,
    },
    /// The newest LIVE epoch exited on its own.
    EpochExited {
        /// Which.
        epoch: u32,
        /// Its exit code (128+N for signal N).
        code: i32,
    },
    /// A watchdog judged the family wedged.
    Wedged {
        /// Why.
        reason: WedgeReason,
    },
}

impl SupervisorExit {
    /// The process exit code: 0 stopped; Envoy's code; 75 wedged.
    pub fn code(&self) -> u8 {
        match self {
            SupervisorExit::Stopped => 0,
            SupervisorExit::StartFailed { code, .. } => {
                u8::try_from(*code).ok().filter(|c| *c != 0).unwrap_or(1)
            }
            SupervisorExit::EpochExited { code, .. } => u8::try_from(*code).unwrap_or(1),
            SupervisorExit::Wedged { .. } => EXIT_WEDGED,
        }
    }
}

/// Why a hot restart did not happen.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RestartError {
    /// Rejected before anything started; the serving epoch keeps serving.
    #[error("hot restart rejected: {0}")]
    Rejected(String),
    /// The new epoch failed; the serving epoch keeps serving.
    #[error("hot restart failed: {0}")]
    Failed(String),
    /// The supervisor is stopping or gone.
    #[error("the supervisor is stopping")]
    Stopping,
}

enum Command {
    HotRestart {
        reason: String,
        reply: Option<oneshot::Sender<Result<u32, RestartError>>>,
    },
    ReopenLogs,
}

/// A cloneable handle to a running [`Supervisor`].
#[derive(Debug, Clone)]
pub struct SupervisorHandle {
    commands: mpsc::Sender<Command>,
    state: watch::Receiver<SupervisorState>,
}

impl SupervisorHandle {
    /// The supervisor's state, now and as it changes.
    pub fn state(&self) -> watch::Receiver<SupervisorState> {
        self.state.clone()
    }

    /// Hot-restarts and resolves with the new epoch once it is LIVE, or why not. Triggers
    /// during a handoff are coalesced: they share the outcome of the next restart.
    pub async fn hot_restart(&self, reason: impl Into<String>) -> Result<u32, RestartError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::HotRestart {
                reason: reason.into(),
                reply: Some(reply),
            })
            .await
            .map_err(|_| RestartError::Stopping)?;
        answer.await.map_err(|_| RestartError::Stopping)?
    }

    /// Triggers a hot restart without waiting for it (a signal).
    pub fn trigger(&self, reason: impl Into<String>) {
        let _ = self.commands.try_send(Command::HotRestart {
            reason: reason.into(),
            reply: None,
        });
    }

    /// Asks the newest epoch to reopen its logs (SIGUSR1).
    pub fn reopen_logs(&self) {
        let _ = self.commands.try_send(Command::ReopenLogs);
    }
}

type Pending<T> = Option<Pin<Box<dyn Future<Output = T> + Send>>>;

async fn settle<T>(slot: &mut Pending<T>) -> T {
    match slot {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

struct Child {
    epoch: u32,
    pid: u32,
    state: EpochState,
    started: SystemTime,
    since: SystemTime,
    abort: CancellationToken,
    /// Killed for missing the handoff deadline.
    timed_out: bool,
}

struct Attempt {
    epoch: u32,
    reason: String,
    triggered: Instant,
    deadline: Instant,
    waiters: Vec<oneshot::Sender<Result<u32, RestartError>>>,
    /// How long the pre-flight checks took.
    preflight_took: Duration,
    /// When the new epoch was spawned.
    spawned: Option<Instant>,
}

/// Triggers waiting for the current handoff (and the parent it leaves) to finish.
#[derive(Default)]
struct Queued {
    reasons: Vec<String>,
    waiters: Vec<oneshot::Sender<Result<u32, RestartError>>>,
    since: Option<Instant>,
}

/// The hot-restart supervisor. See the crate docs for its rules.
pub struct Supervisor {
    config: Config,
    admin: AdminClient,
    base_id: u32,
    commands: mpsc::Receiver<Command>,
    state: watch::Sender<SupervisorState>,
    exits: mpsc::UnboundedSender<(u32, Result<Exit, ProxyError>)>,
    exit_events: mpsc::UnboundedReceiver<(u32, Result<Exit, ProxyError>)>,
    children: Vec<Child>,
    /// The epoch this supervisor started at (a predecessor's + 1, or 0).
    first_epoch: u32,
    metrics: SupervisorMetrics,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Supervisor {
    /// A supervisor for `config` and a handle to it. Nothing starts until [`Supervisor::run`].
    pub fn new(
        config: Config,
        metrics: SupervisorMetrics,
    ) -> Result<(Supervisor, SupervisorHandle), ConfigError> {
        let (admin_addr, base_id) = config.validate()?;
        let (commands_tx, commands) = mpsc::channel(64);
        let state = watch::Sender::new(SupervisorState {
            phase: Phase::Starting,
            base_id,
            hot_restart_version: String::new(),
            epochs: Vec::new(),
            newest_live: None,
            handoff: None,
            last_handoff: None,
            wedges: Vec::new(),
            ready: false,
            handed_over_to: None,
        });
        let (exits, exit_events) = mpsc::unbounded_channel();
        let handle = SupervisorHandle {
            commands: commands_tx,
            state: state.subscribe(),
        };
        Ok((
            Supervisor {
                admin: AdminClient::new(admin_addr).with_timeout(ADMIN_TIMEOUT),
                config,
                base_id,
                commands,
                state,
                exits,
                exit_events,
                children: Vec::new(),
                first_epoch: 0,
                metrics,
            },
            handle,
        ))
    }

    fn publish(&self, update: impl FnOnce(&mut SupervisorState)) {
        self.state.send_modify(|s| {
            update(s);
            s.epochs = self
                .children
                .iter()
                .map(|c| EpochInfo {
                    epoch: c.epoch,
                    pid: c.pid,
                    state: c.state,
                    started: c.started,
                    since: c.since,
                })
                .collect();
        });
    }

    fn set_ready(&self, ready: bool) {
        if let Some(marker) = &self.config.ready_marker {
            let result = if ready {
                envoy_agent_proxy::write_atomically(marker, b"ready\n")
            } else {
                match std::fs::remove_file(marker) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                    other => other,
                }
            };
            if let Err(e) = result {
                tracing::error!(marker = %marker.display(), error = %e, "cannot update the readiness marker");
            }
        }
        if self.state.borrow().ready != ready {
            tracing::info!(ready, "readiness marker");
            self.publish(|s| s.ready = ready);
        }
    }

    async fn spawn(&mut self, epoch: u32) -> Result<(), ProxyError> {
        let process = EnvoyProcess::spawn(&self.config.proxy, epoch).await?;
        let abort = CancellationToken::new();
        let now = SystemTime::now();
        self.children.push(Child {
            epoch,
            pid: process.pid(),
            state: EpochState::Starting,
            started: now,
            since: now,
            abort: abort.clone(),
            timed_out: false,
        });
        let exits = self.exits.clone();
        tokio::spawn(async move {
            let _ = exits.send((epoch, process.run(abort).await));
        });
        tracing::info!(
            event = "epoch_starting",
            epoch,
            pid = self.children.last().map_or(0, |c| c.pid),
            "epoch starting"
        );
        self.publish(|_| {});
        Ok(())
    }

    fn child_mut(&mut self, epoch: u32) -> Option<&mut Child> {
        self.children.iter_mut().find(|c| c.epoch == epoch)
    }

    fn set_epoch_state(&mut self, epoch: u32, state: EpochState) {
        if let Some(c) = self.child_mut(epoch) {
            c.state = state;
            c.since = SystemTime::now();
            tracing::info!(event = "epoch_state", epoch, pid = c.pid, state = ?state, "epoch state");
        }
        self.publish(|_| {});
    }

    fn record_wedge(&self, reason: WedgeReason, message: String) {
        tracing::error!(%reason, %message, "hot restart wedge");
        self.metrics.wedge(reason.as_str());
        self.publish(|s| {
            s.wedges.push(Wedge {
                reason,
                at: SystemTime::now(),
                message,
            });
            let excess = s.wedges.len().saturating_sub(WEDGES_KEPT);
            s.wedges.drain(..excess);
        });
    }

    fn live_future(&self) -> Pending<Result<(ServerState, u32), String>> {
        let admin = self.admin.clone();
        Some(Box::pin(async move {
            admin
                .server_info()
                .await
                .map(|i| (i.state, i.restart_epoch))
                .map_err(|e| e.to_string())
        }))
    }

    fn preflight_future(&self, running_version: String) -> Pending<Result<(), String>> {
        let proxy = self.config.proxy.clone();
        Some(Box::pin(async move {
            // Both exec the binary (~50 ms each): side by side, not one after the other.
            let (version, validated) = tokio::join!(
                preflight::hot_restart_version(&proxy.binary_path),
                preflight::validate(&proxy)
            );
            let version = version.map_err(|e| e.to_string())?;
            if version != running_version {
                return Err(format!(
                    "{} has hot-restart version {version}, the running envoy {running_version}: \
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
        }))
    }

    /// Starts epoch 0, then supervises until `cancel` fires or the family cannot go on.
    pub async fn run(mut self, cancel: CancellationToken) -> SupervisorExit {
        let exit = self.supervise(cancel).await;
        self.set_ready(false);
        self.stop_all().await;
        if let Some(dir) = &self.config.state_dir {
            node::remove(dir, &self.config.identity);
        }
        self.publish(|s| {
            s.phase = Phase::Exited;
            s.handoff = None;
        });
        tracing::info!(?exit, code = exit.code(), "supervisor exiting");
        exit
    }

    async fn supervise(&mut self, cancel: CancellationToken) -> SupervisorExit {
        let version = match preflight::hot_restart_version(&self.config.proxy.binary_path).await {
            Ok(v) => v,
            Err(e) => {
                return SupervisorExit::StartFailed {
                    code: 1,
                    message: e.to_string(),
                };
            }
        };
        self.publish(|s| s.hot_restart_version = version.clone());

        // Cross-pod: under the node's epoch lock, find a live predecessor and start after it.
        let mut epoch_lock = None;
        let mut first_epoch = 0;
        if let Some(dir) = self.config.state_dir.clone() {
            if let Err(e) = std::fs::create_dir_all(&dir) {
                return SupervisorExit::StartFailed {
                    code: 1,
                    message: format!("cannot create state dir {}: {e}", dir.display()),
                };
            }
            let lock_wait = self.config.handoff_deadline
                + self.config.proxy.drain_duration.max(
                    self.config
                        .proxy
                        .hot_restart
                        .as_ref()
                        .map_or(Duration::ZERO, |h| h.parent_shutdown_time),
                );
            let lock = tokio::select! {
                () = cancel.cancelled() => return SupervisorExit::Stopped,
                lock = EpochLock::acquire(&dir, lock_wait) => lock,
            };
            match lock {
                Ok(lock) => epoch_lock = Some(lock),
                Err(e) => {
                    return SupervisorExit::StartFailed {
                        code: 1,
                        message: format!("epoch lock: {e}"),
                    };
                }
            }
            match self.find_predecessor(&dir, &version, &cancel).await {
                Some(epoch) => first_epoch = epoch,
                None => return SupervisorExit::Stopped,
            }
        }
        self.first_epoch = first_epoch;
        if let Err(e) = self.spawn(first_epoch).await {
            return SupervisorExit::StartFailed {
                code: 1,
                message: e.to_string(),
            };
        }
        self.write_heartbeat("starting", first_epoch, None);

        let mut watch = None;
        if self.config.watch_config {
            match crate::watch::ConfigWatch::start(
                &self.config.proxy.config_path,
                self.config.watch_debounce,
            ) {
                Ok(w) => watch = Some(w),
                Err(e) => tracing::error!(error = %e, "config watch disabled"),
            }
        }

        let mut newest_live: Option<u32> = None;
        let mut attempt: Option<Attempt> = None;
        let mut queued = Queued::default();
        let mut retries = 0u32;
        let mut preflight: Pending<Result<(), String>> = None;
        let mut preflight_for: Option<Attempt> = None;
        let mut live_check: Pending<Result<(ServerState, u32), String>> = None;
        let mut next_live_check = Some(Instant::now());
        let mut last_admin_ok = Instant::now();
        let mut next_watchdog: Option<Instant> = None;
        let mut absorber: Option<Absorber> = None;
        let start_deadline = Instant::now() + self.config.handoff_deadline;
        let mut next_heartbeat = Some(Instant::now() + self.config.heartbeat_period);
        // A predecessor's Envoy (another pod's) drains as our first epoch's parent until then.
        let mut foreign_parent_until: Option<Instant> = None;
        let mut handed_over = false;

        loop {
            // Start a queued restart once nothing else is in flight and no parent drains.
            let draining = self
                .children
                .iter()
                .any(|c| c.state == EpochState::Draining);
            let foreign_parent = foreign_parent_until.is_some_and(|t| Instant::now() < t);
            if attempt.is_none()
                && preflight_for.is_none()
                && !draining
                && !foreign_parent
                && !handed_over
                && newest_live.is_some()
                && !queued.reasons.is_empty()
            {
                let reason = queued.reasons.join(", ");
                queued.reasons.clear();
                let now = Instant::now();
                let next = newest_live.map_or(0, |e| e + 1);
                preflight_for = Some(Attempt {
                    epoch: next,
                    reason: reason.clone(),
                    triggered: queued.since.take().unwrap_or(now),
                    deadline: now + self.config.handoff_deadline,
                    waiters: std::mem::take(&mut queued.waiters),
                    preflight_took: Duration::ZERO,
                    spawned: None,
                });
                tracing::info!(epoch = next, %reason, "hot restart: pre-flight checks");
                self.publish(|s| {
                    s.handoff = Some(Handoff {
                        epoch: next,
                        reason,
                        since: SystemTime::now(),
                    })
                });
                let version = self.state.borrow().hot_restart_version.clone();
                preflight = self.preflight_future(version);
            }

            let deadline = attempt
                .as_ref()
                .map(|a| a.deadline)
                .or(if newest_live.is_none() {
                    Some(start_deadline)
                } else {
                    None
                });
            // Only timers whose action can run now: a due timer whose action waits for something
            // else (a check in flight, a killed epoch's exit) would wake the loop in a spin.
            let checking = live_check.is_some();
            let deadline = deadline.filter(|_| {
                attempt.as_ref().is_none_or(|a| {
                    self.children
                        .iter()
                        .any(|c| c.epoch == a.epoch && !c.timed_out)
                })
            });
            let wake = [
                next_live_check.filter(|_| !checking),
                next_watchdog.filter(|_| !checking && attempt.is_none()),
                deadline,
                next_heartbeat,
                foreign_parent_until.filter(|_| foreign_parent),
            ]
            .into_iter()
            .flatten()
            .min();

            tokio::select! {
                () = cancel.cancelled() => {
                    if handed_over || self.successor_starting(newest_live) {
                        // Our Envoy drains as a successor's parent: killing it would cut its
                        // connections and make the successor's Envoy abort. Wait until the
                        // successor terminates it (bounded), as the kubelet's grace allows.
                        self.set_ready(false);
                        self.write_heartbeat("stopping", newest_live.unwrap_or(first_epoch), None);
                        let bound = self.config.handoff_deadline + self.parent_shutdown_time() + Duration::from_secs(10);
                        tracing::info!(?bound, "stopping while a successor takes over: waiting for our envoy to be terminated by the successor's");
                        if !self.wait_children_exit(bound).await {
                            tracing::error!(?bound, "our envoy was not terminated by the successor in time; stopping it");
                        }
                    }
                    return SupervisorExit::Stopped;
                }

                Some((epoch, result)) = self.exit_events.recv() => {
                    let Some(index) = self.children.iter().position(|c| c.epoch == epoch) else {
                        continue;
                    };
                    let child = self.children.remove(index);
                    self.publish(|_| {});
                    let (code, tail) = match &result {
                        Ok(exit) => (exit.code(), exit.stderr_tail.clone()),
                        Err(e) => (1, e.to_string()),
                    };
                    self.metrics.exit(exit_kind(&result, child.state == EpochState::Draining));
                    match child.state {
                        EpochState::Draining => {
                            if code == 0 {
                                tracing::info!(epoch, "drained parent exited (terminated by its child)");
                            } else {
                                tracing::warn!(epoch, code, "draining parent died; its child keeps serving");
                                // Its child still talks to it: stand in for it.
                                match Absorber::bind(self.base_id, epoch) {
                                    Ok(a) => {
                                        tracing::info!(epoch, "standing in for the dead parent's hot-restart sockets");
                                        absorber = Some(a);
                                    }
                                    Err(e) => tracing::error!(epoch, error = %e, "cannot stand in for the dead parent"),
                                }
                            }
                        }
                        EpochState::Live if handed_over => {
                            tracing::info!(epoch, code, "our envoy exited after the handover");
                        }
                        EpochState::Live => {
                            tracing::error!(epoch, code, "the serving epoch exited\n{}", tail.trim_end());
                            return SupervisorExit::EpochExited { epoch, code };
                        }
                        EpochState::Starting if newest_live.is_none() => {
                            tracing::error!(epoch, code, "envoy failed to start\n{}", tail.trim_end());
                            return SupervisorExit::StartFailed { code, message: last_line(&tail) };
                        }
                        EpochState::Starting => {
                            let timed_out = child.timed_out;
                            let message = if timed_out {
                                format!("not LIVE within the handoff deadline ({:?})", self.config.handoff_deadline)
                            } else {
                                format!("exited with code {code}: {}", last_line(&tail))
                            };
                            if let Some(a) = attempt.take() {
                                self.finish(a, if timed_out { Outcome::TimedOut } else { Outcome::Failed }, message.clone());
                            }
                            live_check = None;
                            next_live_check = None;
                            self.recover_after_failed_start(epoch);
                            // The child may have shut the old epoch's admin before failing:
                            // then only a successful restart gives the family an admin back.
                            let parent_admin_ok = self.admin.server_info().await.is_ok();
                            if !parent_admin_ok && retries < MAX_RETRIES {
                                retries += 1;
                                tracing::warn!(epoch, retries, "the serving epoch lost its admin endpoint to the failed child; retrying the same epoch");
                                queued.reasons.push(format!("retry {retries} after failed epoch {epoch}"));
                                queued.since.get_or_insert(Instant::now());
                            }
                            next_watchdog = Some(Instant::now() + WATCHDOG_POLL);
                        }
                    }
                }

                command = self.commands.recv() => match command {
                    None => {}
                    Some(Command::ReopenLogs) => {
                        if let Some(c) = self.children.iter().max_by_key(|c| c.epoch) {
                            if let Err(e) = signal_pid(c.pid, Signal::SIGUSR1) {
                                tracing::warn!(error = %e, "cannot forward SIGUSR1");
                            }
                        }
                    }
                    Some(Command::HotRestart { reason, reply }) => {
                        tracing::info!(%reason, "hot restart requested");
                        queued.reasons.push(reason);
                        queued.since.get_or_insert(Instant::now());
                        queued.waiters.extend(reply);
                        if handed_over {
                            tracing::warn!("handed over to a successor: hot restarts are the successor's now");
                        } else if attempt.is_some() || preflight_for.is_some() {
                            tracing::info!("a handoff is under way: coalesced into the next restart");
                        }
                    }
                },

                changed = async { match watch.as_mut() { Some(w) => w.changed().await, None => std::future::pending().await } } => {
                    match changed {
                        Some(()) => {
                            tracing::info!(path = %self.config.proxy.config_path.display(), "config changed");
                            queued.reasons.push("config change".to_owned());
                            queued.since.get_or_insert(Instant::now());
                        }
                        None => {
                            tracing::error!("config watch ended");
                            watch = None;
                        }
                    }
                }

                result = settle(&mut preflight) => {
                    preflight = None;
                    let Some(mut a) = preflight_for.take() else { continue };
                    match result {
                        Err(message) => {
                            tracing::error!(epoch = a.epoch, %message, "hot restart rejected; the serving epoch keeps serving");
                            retries = 0;
                            self.finish(a, Outcome::Rejected, message);
                        }
                        Ok(()) => {
                            a.preflight_took = a.triggered.elapsed();
                            // Release a stand-in that holds names this epoch may reuse.
                            release(&mut absorber);
                            match self.spawn(a.epoch).await {
                                Ok(()) => {
                                    a.spawned = Some(Instant::now());
                                    a.deadline = Instant::now() + self.config.handoff_deadline;
                                    attempt = Some(a);
                                    next_live_check = Some(Instant::now());
                                    next_watchdog = None;
                                }
                                Err(e) => self.finish(a, Outcome::Failed, e.to_string()),
                            }
                        }
                    }
                }

                result = settle(&mut live_check) => {
                    live_check = None;
                    let target = attempt.as_ref().map_or(first_epoch, |a| a.epoch);
                    match result {
                        Ok((ServerState::Live, epoch)) if epoch == target
                            && self.children.iter().any(|c| c.epoch == epoch && c.state == EpochState::Starting) =>
                        {
                            last_admin_ok = Instant::now();
                            if let Some(parent) = newest_live {
                                self.set_epoch_state(parent, EpochState::Draining);
                            } else if epoch > 0 {
                                // Our first epoch took over from another pod's Envoy, which now
                                // drains until ours terminates it.
                                let until = Instant::now() + self.parent_shutdown_time() + Duration::from_secs(1);
                                foreign_parent_until = Some(until);
                                tracing::info!(epoch, "took over from the predecessor's envoy");
                            }
                            // Our first epoch is LIVE: the next successor may allocate.
                            if epoch_lock.take().is_some() {
                                tracing::debug!("released the epoch lock");
                            }
                            self.set_epoch_state(epoch, EpochState::Live);
                            newest_live = Some(epoch);
                            retries = 0;
                            self.metrics.epoch(epoch);
                            self.publish(|s| { s.newest_live = Some(epoch); s.phase = Phase::Serving; });
                            self.set_ready(true);
                            self.write_heartbeat("serving", epoch, foreign_parent_until);
                            // Last: whoever waits for this restart sees the new state at once.
                            if let Some(a) = attempt.take() {
                                self.finish(a, Outcome::Live, String::new());
                            }
                            // The previous stand-in's child is now a parent that terminates
                            // its own parent at once; nothing talks to the dead one anymore.
                            release(&mut absorber);
                            next_live_check = None;
                            next_watchdog = Some(Instant::now() + WATCHDOG_POLL);
                        }
                        Ok((ServerState::Live, epoch))
                            if attempt.is_none() && newest_live.is_some_and(|n| epoch > n) && !handed_over =>
                        {
                            // Another pod's Envoy took the admin port at a newer epoch: a
                            // successor took over. Ours drains until it is terminated.
                            handed_over = true;
                            let successor = self.successor_of(epoch);
                            tracing::info!(epoch, %successor, "handed over to {successor}");
                            if let Some(n) = newest_live {
                                self.set_epoch_state(n, EpochState::Draining);
                            }
                            self.set_ready(false);
                            self.publish(|s| s.handed_over_to = Some(successor));
                            self.write_heartbeat("handed_over", newest_live.unwrap_or(first_epoch), None);
                            next_watchdog = None;
                        }
                        Ok(_) => {
                            if attempt.is_none() && newest_live.is_some() {
                                // Watchdog check of the serving epoch.
                                last_admin_ok = Instant::now();
                                next_watchdog = Some(Instant::now() + WATCHDOG_POLL);
                            } else {
                                next_live_check = Some(Instant::now() + LIVE_POLL);
                            }
                        }
                        Err(e) => {
                            if attempt.is_none() && newest_live.is_some() {
                                tracing::warn!(error = %e, silent_for = ?last_admin_ok.elapsed(), "envoy admin not answering");
                                if last_admin_ok.elapsed() >= self.config.admin_unresponsive_deadline {
                                    self.set_ready(false);
                                    self.record_wedge(
                                        WedgeReason::AdminUnresponsive,
                                        format!("envoy admin {} silent for {:?}: {e}", self.admin.addr(), last_admin_ok.elapsed()),
                                    );
                                    return SupervisorExit::Wedged { reason: WedgeReason::AdminUnresponsive };
                                }
                                next_watchdog = Some(Instant::now() + WATCHDOG_POLL);
                            } else {
                                next_live_check = Some(Instant::now() + LIVE_POLL);
                            }
                        }
                    }
                }

                () = sleep_until(wake) => {
                    let now = Instant::now();
                    if next_heartbeat.is_some_and(|t| t <= now) {
                        next_heartbeat = Some(now + self.config.heartbeat_period);
                        let state = match (handed_over, newest_live) {
                            (true, _) => "handed_over",
                            (false, Some(_)) => "serving",
                            (false, None) => "starting",
                        };
                        self.write_heartbeat(state, newest_live.unwrap_or(first_epoch), foreign_parent_until);
                    }
                    if newest_live.is_none() && attempt.is_none() && now >= start_deadline {
                        let message = format!("epoch 0 not LIVE within {:?}", self.config.handoff_deadline);
                        self.record_wedge(WedgeReason::HandoffDeadline, message);
                        return SupervisorExit::Wedged { reason: WedgeReason::HandoffDeadline };
                    }
                    if let Some(a) = attempt.as_ref().filter(|a| now >= a.deadline) {
                        let epoch = a.epoch;
                        if let Some(c) = self.child_mut(epoch).filter(|c| !c.timed_out) {
                            c.timed_out = true;
                            // SIGKILL, not SIGTERM: Envoy's SIGTERM handler also terminates its
                            // parent, which is the epoch still serving (seen on 1.40).
                            if let Err(e) = signal_pid(c.pid, Signal::SIGKILL) {
                                tracing::warn!(epoch, error = %e, "cannot kill the stuck epoch");
                            }
                            let message = format!(
                                "epoch {epoch} not LIVE within the handoff deadline ({:?}); stopping it, the serving epoch keeps serving",
                                self.config.handoff_deadline
                            );
                            self.record_wedge(WedgeReason::HandoffDeadline, message);
                        }
                    }
                    if next_live_check.is_some_and(|t| t <= now) && live_check.is_none() {
                        next_live_check = None;
                        live_check = self.live_future();
                    }
                    if next_watchdog.is_some_and(|t| t <= now) && live_check.is_none() && attempt.is_none() {
                        next_watchdog = None;
                        live_check = self.live_future();
                    }
                }
            }
        }
    }

    fn parent_shutdown_time(&self) -> Duration {
        self.config
            .proxy
            .hot_restart
            .as_ref()
            .map_or(Duration::ZERO, |h| h.parent_shutdown_time)
    }

    fn write_heartbeat(&self, state: &str, newest_epoch: u32, parent_until: Option<Instant>) {
        let Some(dir) = &self.config.state_dir else {
            return;
        };
        let now = Instant::now();
        let parent_until = parent_until
            .filter(|t| *t > now)
            .map_or(0, |t| node::unix_ms() + (t - now).as_millis() as u64);
        let heartbeat = Heartbeat {
            format: node::FORMAT.to_owned(),
            identity: self.config.identity.clone(),
            pid: std::process::id(),
            base_id: self.base_id,
            hot_restart_version: self.state.borrow().hot_restart_version.clone(),
            newest_epoch,
            envoy_pid: self
                .children
                .iter()
                .find(|c| c.epoch == newest_epoch)
                .map_or(0, |c| c.pid),
            state: state.to_owned(),
            updated_unix_ms: node::unix_ms(),
            parent_draining_until_unix_ms: parent_until,
        };
        if let Err(e) = node::write(dir, &heartbeat) {
            tracing::error!(dir = %dir.display(), error = %e, "cannot write the heartbeat");
        }
    }

    fn fresh_heartbeats(&self, dir: &std::path::Path) -> Vec<Heartbeat> {
        let (heartbeats, rejected) = node::read_all(dir);
        for r in rejected {
            tracing::warn!(path = %r.path.display(), reason = %r.reason, "ignoring a heartbeat file");
        }
        heartbeats
            .into_iter()
            .filter(|h| h.identity != self.config.identity && h.base_id == self.base_id)
            .filter(|h| h.fresh(self.config.heartbeat_period * 4))
            .collect()
    }

    /// The epoch to start at: a live predecessor's newest + 1, or 0 when there is none.
    /// `None` when cancelled while waiting.
    async fn find_predecessor(
        &self,
        dir: &std::path::Path,
        version: &str,
        cancel: &CancellationToken,
    ) -> Option<u32> {
        let give_up = Instant::now() + self.config.handoff_deadline;
        loop {
            let candidates: Vec<Heartbeat> = self
                .fresh_heartbeats(dir)
                .into_iter()
                .filter(|h| h.state == "serving" || h.state == "starting")
                .collect();
            let Some(newest) = candidates.iter().max_by_key(|h| h.newest_epoch) else {
                tracing::info!("no live predecessor on this node: starting at epoch 0");
                return Some(0);
            };
            let wait = match self.admin.server_info().await {
                Ok(info)
                    if info.state == ServerState::Live
                        && info.base_id == u64::from(self.base_id) =>
                {
                    if info.hot_restart_version != version {
                        tracing::error!(
                            predecessor = %newest.identity,
                            theirs = %info.hot_restart_version,
                            ours = %version,
                            "the predecessor's envoy has another hot-restart version: it cannot be \
                             hot-restarted from; not starting until it is gone (see the runbook)"
                        );
                        true
                    } else if newest.state == "serving"
                        && newest.parent_draining_until_unix_ms <= node::unix_ms()
                    {
                        let epoch = info.restart_epoch + 1;
                        tracing::info!(predecessor = %newest.identity, epoch, "hot-restarting from the predecessor's envoy");
                        return Some(epoch);
                    } else {
                        tracing::info!(predecessor = %newest.identity, "the predecessor is still handing over: waiting");
                        true
                    }
                }
                Ok(info) => {
                    tracing::info!(state = ?info.state, "the node's envoy is not LIVE: waiting");
                    true
                }
                Err(e) => {
                    tracing::warn!(predecessor = %newest.identity, error = %e, "a fresh heartbeat but no admin answer: waiting");
                    Instant::now() < give_up
                }
            };
            if !wait {
                tracing::warn!("the predecessor's admin never answered: starting at epoch 0");
                return Some(0);
            }
            tokio::select! {
                () = cancel.cancelled() => return None,
                () = tokio::time::sleep(self.config.heartbeat_period) => {}
            }
        }
    }

    /// Whether another pod's supervisor is starting the epoch after `newest_live`.
    fn successor_starting(&self, newest_live: Option<u32>) -> bool {
        let (Some(dir), Some(newest)) = (&self.config.state_dir, newest_live) else {
            return false;
        };
        self.fresh_heartbeats(dir)
            .iter()
            .any(|h| h.state == "starting" && h.newest_epoch > newest)
    }

    /// The identity of the supervisor running `epoch`, as its heartbeat says.
    fn successor_of(&self, epoch: u32) -> String {
        self.config
            .state_dir
            .as_ref()
            .and_then(|dir| {
                self.fresh_heartbeats(dir)
                    .into_iter()
                    .find(|h| h.newest_epoch == epoch)
                    .map(|h| h.identity)
            })
            .unwrap_or_else(|| format!("the supervisor of epoch {epoch}"))
    }

    /// Waits for every child to exit on its own, up to `bound`; whether they all did.
    async fn wait_children_exit(&mut self, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        while !self.children.is_empty() {
            match tokio::time::timeout_at(deadline, self.exit_events.recv()).await {
                Ok(Some((epoch, result))) => {
                    self.children.retain(|c| c.epoch != epoch);
                    self.metrics.exit(exit_kind(&result, true));
                    let code = result.map(|e| e.code()).unwrap_or(1);
                    tracing::info!(epoch, code, "our envoy exited");
                }
                Ok(None) | Err(_) => return false,
            }
        }
        self.publish(|_| {});
        true
    }

    fn finish(&self, a: Attempt, outcome: Outcome, message: String) {
        let duration = a.triggered.elapsed();
        self.metrics.handoff(duration, outcome.as_str());
        if outcome == Outcome::Rejected {
            self.metrics.config_rejected();
        }
        match outcome {
            Outcome::Live => {
                tracing::info!(
                    epoch = a.epoch,
                    reason = %a.reason,
                    ?duration,
                    preflight = ?a.preflight_took,
                    start_to_live = ?a.spawned.map(|s| s.elapsed()),
                    "hot restart done: epoch LIVE"
                )
            }
            _ => {
                tracing::error!(epoch = a.epoch, reason = %a.reason, %outcome, %message, "hot restart did not happen; the serving epoch keeps serving")
            }
        }
        for waiter in a.waiters {
            let _ = waiter.send(match outcome {
                Outcome::Live => Ok(a.epoch),
                Outcome::Rejected => Err(RestartError::Rejected(message.clone())),
                Outcome::Failed | Outcome::TimedOut => Err(RestartError::Failed(message.clone())),
            });
        }
        self.publish(|s| {
            s.handoff = None;
            s.last_handoff = Some(HandoffResult {
                epoch: a.epoch,
                reason: a.reason,
                outcome,
                duration,
                at: SystemTime::now(),
                message,
            });
        });
    }

    /// After a new epoch died before LIVE: if it left Envoy's INITIALIZING flag set, every
    /// later hot restart would fail; no Envoy of the family is initializing now, so clear it.
    fn recover_after_failed_start(&self, epoch: u32) {
        let version = self.state.borrow().hot_restart_version.clone();
        if shm::initializing(self.base_id, &version) == Some(true) {
            let result = shm::clear_initializing(self.base_id, &version);
            let message = match &result {
                Ok(()) => format!(
                    "epoch {epoch} died while initializing and left the shared INITIALIZING flag set \
                     (\"previous envoy process is still initializing\"); cleared it: the serving epoch \
                     keeps serving and the next hot restart can proceed"
                ),
                Err(e) => format!(
                    "epoch {epoch} left the shared INITIALIZING flag set and it could not be cleared: {e}"
                ),
            };
            self.record_wedge(WedgeReason::StaleInitializing, message);
        }
    }

    /// Stops every epoch, newest first, each bounded by its stop grace.
    async fn stop_all(&mut self) {
        self.publish(|s| s.phase = Phase::Stopping);
        self.children.sort_by_key(|c| std::cmp::Reverse(c.epoch));
        for child in &self.children {
            child.abort.cancel();
        }
        // Each child's task escalates to SIGKILL after its grace; this bound is a backstop.
        let bound = self.config.proxy.stop_grace + Duration::from_secs(5);
        let deadline = Instant::now() + bound;
        while !self.children.is_empty() {
            match tokio::time::timeout_at(deadline, self.exit_events.recv()).await {
                Ok(Some((epoch, result))) => {
                    self.children.retain(|c| c.epoch != epoch);
                    self.metrics.exit(exit_kind(&result, false));
                    if let Ok(exit) = result {
                        tracing::info!(epoch, code = exit.code(), "epoch stopped");
                    }
                }
                Ok(None) | Err(_) => {
                    tracing::error!(left = self.children.len(), "epochs did not stop in time");
                    break;
                }
            }
        }
        self.publish(|_| {});
    }
}

/// How an Envoy ended, for the exit counter.
fn exit_kind(result: &Result<Exit, ProxyError>, draining: bool) -> ExitKind {
    use std::os::unix::process::ExitStatusExt;
    match result {
        Ok(exit) if exit.status.signal().is_some() => ExitKind::Signal,
        Ok(exit) if exit.code() == 0 && draining => ExitKind::DrainedParent,
        Ok(exit) if exit.code() == 0 => ExitKind::Clean,
        _ => ExitKind::Crash,
    }
}

fn release(absorber: &mut Option<Absorber>) {
    if let Some(a) = absorber.take() {
        tracing::info!(
            parent_epoch = a.parent_epoch,
            "released the dead parent's sockets"
        );
    }
}

fn last_line(text: &str) -> String {
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_owned()
}

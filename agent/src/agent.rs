//! [`Agent`]: runs one [`Proxy`] (a single Envoy, or a hot-restart family of Envoy epochs) and
//! decides when and how it stops.
//!
//! The agent is one actor task ([`Agent::run`]) that owns every decision, plus cloneable
//! [`AgentHandle`]s (the status server's, the gRPC service's) that send it commands and read
//! its [`Status`] from a `watch` channel: the agent's own [`AgentState`] beside the proxy's
//! typed state, one snapshot. Nothing else touches the proxy's lifecycle. Commands resolve
//! once the agent has acted on them.
//!
//! # Exit paths (both modes)
//!
//! | event | what happens | exit code |
//! |---|---|---|
//! | Envoy exits on its own | the agent exits | Envoy's (128+N for signal N) |
//! | same, with crash recovery ([`crate::crash`]), after it served | a fresh Envoy (family) after a back-off; the agent, its servers and its status stay up | — |
//! | same, the crash after the limit of restarts in a row | the agent exits | the crash's (never 0) |
//! | SIGTERM / SIGINT / `Stop` during a crash back-off | nothing runs: the agent exits at once | 0 |
//! | SIGTERM / SIGINT, no successor pod | [drain delay] → graceful drain of every epoch → wait the termination drain duration (less if Envoy exits) → stop | 0 |
//! | same, exit-on-zero | … → drain → wait the minimum drain duration → count active connections (or requests: [`Counting`]), stop at zero (and no parent epoch still draining); the termination drain duration is a hard deadline; N stats errors in a row end the wait | 0 |
//! | SIGTERM / SIGINT while a successor pod takes over | wait until the successor's Envoy has terminated ours (bounded), then exit | 0 |
//! | `/drain`, gRPC `Drain` | every epoch drains (with `skip_exit`: keeps accepting); the next SIGTERM stops at once | 0 |
//! | `/quitquitquit`, gRPC `QuitQuitQuit` | stop at once, no drain | 0 |
//! | a second SIGTERM/SIGINT during a drain or a handover wait | stop at once | 0 |
//!
//! "Stop" cancels the proxy's run: it stops every Envoy (SIGTERM, SIGKILL after its grace;
//! SIGKILL at once for an epoch that is not LIVE while its parent lives) and the agent waits
//! for them all to be reaped, so no Envoy outlives it.
//!
//! Exit-on-zero counts at the newest epoch's admin API, in both modes: a hot-restart parent
//! still draining holds its own connections and requests, which the newest epoch's stats may
//! not show, so a zero counts only once no parent drains.
//!
//! # Bounds
//!
//! Every call to the proxy that may take time (drain, the successor question, connection
//! counts) runs concurrently with the loop, so a hanging admin API never stalls a signal or a
//! command, and is dropped when the agent moves on. The drain deadline starts when the drain
//! does (after the optional delay) and covers the drain call itself.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

pub use envoy_agent_drain::Counting;
use envoy_agent_drain::{DrainError, Exclusions};
use envoy_agent_proxy::{
    AdminClient, ConfigApplied, DrainOptions, Ended, Proxy, ProxyError, ProxyPhase, ProxyState,
    RestartError, WedgeReason,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::crash::{Crash, CrashAction, CrashLoop, CrashRecovery, Crashes};
use crate::signal::{Intent, IntentSource};

/// `EX_SOFTWARE`: the proxy could not be run at all.
pub use crate::exit_code::SOFTWARE as EXIT_SOFTWARE;

/// Bound on asking the proxy whether a successor takes over (it asks the admin API).
const SUCCESSOR_TIMEOUT: Duration = Duration::from_secs(3);

/// How the agent drains and stops. [`Default`] gives Istio's defaults.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// How long a shutdown drain lasts before Envoy is stopped; in exit-on-zero mode, the hard
    /// deadline of the wait for zero.
    pub termination_drain_duration: Duration,
    /// In exit-on-zero mode, how long to wait after the drain starts before counting.
    pub minimum_drain_duration: Duration,
    /// Exit-on-zero: stop as soon as Envoy has no active downstream connections, or requests
    /// (after the minimum). None: drain for the termination drain duration.
    pub exit_on_zero: Option<Counting>,
    /// On SIGTERM, report not-ready for this long before draining, so load balancers and
    /// endpoint lists drop the pod first (Istio #36660).
    pub drain_delay: Duration,
    /// Listeners whose connections and requests do not count.
    pub exclusions: Exclusions,
    /// How often exit-on-zero counts.
    pub poll_interval: Duration,
    /// Bound on one stats call in exit-on-zero mode.
    pub stats_timeout: Duration,
    /// Consecutive stats failures that end the wait for zero.
    pub stats_error_budget: u32,
    /// How long a stopping agent waits for a successor pod's Envoy to terminate its own.
    pub handover_timeout: Duration,
    /// Crash recovery in place; `None`: a crash of the serving Envoy ends the agent.
    pub crash_recovery: Option<CrashRecovery>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            termination_drain_duration: Duration::from_secs(5),
            minimum_drain_duration: Duration::from_secs(5),
            exit_on_zero: None,
            drain_delay: Duration::ZERO,
            exclusions: Exclusions::with_ports([15021, 15090]),
            poll_interval: Duration::from_millis(50),
            stats_timeout: Duration::from_secs(2),
            stats_error_budget: 5,
            handover_timeout: Duration::from_secs(130),
            crash_recovery: None,
        }
    }
}

/// Where a request came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The status server (`POST /drain`, `POST /quitquitquit`).
    Http,
    /// The gRPC API.
    Grpc,
}

/// Why a drain started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainReason {
    /// A shutdown signal (or gRPC `Stop`, which takes the same path).
    Signal(Intent),
    /// A drain request (`POST /drain`, gRPC `Drain`): Envoy keeps running.
    Request(Via),
}

impl fmt::Display for DrainReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DrainReason::Signal(intent) => f.write_str(intent.signal_name()),
            DrainReason::Request(Via::Http) => f.write_str("POST /drain"),
            DrainReason::Request(Via::Grpc) => f.write_str("gRPC Drain"),
        }
    }
}

/// Where a drain is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainPhase {
    /// Asking the proxy whether a successor pod takes over (then there is no drain of ours).
    Deciding,
    /// Readiness is off; the drain starts when the delay ends.
    Delay,
    /// Envoy has been told to drain (or is being told).
    Draining,
}

/// Why the agent is exiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitPath {
    /// Envoy exited on its own, with this code.
    ProxyExited {
        /// Envoy's exit code (128+N for signal N).
        code: i32,
    },
    /// The serving Envoy exited while nothing else served and no successor took over.
    ProxyLost {
        /// Its exit code (never 0).
        code: u8,
    },
    /// The first Envoy never served.
    StartFailed {
        /// Its exit code (never 0).
        code: u8,
    },
    /// The hot-restart family was judged wedged.
    Wedged {
        /// Why.
        reason: WedgeReason,
    },
    /// The termination drain duration passed.
    DrainTimeElapsed,
    /// The shutdown's drain request never reached Envoy (refused, or the agent could not send
    /// it: its admin silent, the agent out of descriptors), asked again until the deadline:
    /// Envoy was stopped without a drain.
    DrainFailed,
    /// Exit-on-zero: nothing it counts was left active.
    ZeroActive(Counting),
    /// Exit-on-zero: connections (or requests) remained when the deadline passed.
    DrainDeadline(Counting),
    /// Exit-on-zero: the count could not be read, too often in a row.
    StatsUnavailable(Counting),
    /// `/quitquitquit` or gRPC `QuitQuitQuit`.
    QuitQuitQuit(Via),
    /// A second SIGTERM/SIGINT during a drain.
    SecondSignal,
    /// SIGTERM/SIGINT after a drain request (or with draining disabled).
    SignalAfterDrain,
    /// A successor pod's Envoy took over and terminated ours.
    HandedOver,
    /// A successor pod took over but did not terminate our Envoy in time: it was stopped.
    HandoverTimedOut,
    /// The proxy stopped on its own during the shutdown (its first Envoy never served).
    ProxyStopped,
    /// The proxy could not be run.
    ProxyFailed,
    /// Crash recovery: Envoy crashed once more after the limit of restarts in a row.
    CrashLoop {
        /// The last crash's code (never 0).
        code: u8,
    },
    /// SIGTERM/SIGINT (or `Stop`) during a crash back-off, while nothing ran.
    StoppedWhileRecovering,
}

impl fmt::Display for ExitPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitPath::ProxyExited { code } => write!(f, "envoy exited with code {code}"),
            ExitPath::ProxyLost { code } => {
                write!(f, "the serving envoy was lost (exit {code})")
            }
            ExitPath::StartFailed { code } => write!(f, "envoy failed to start (exit {code})"),
            ExitPath::Wedged { reason } => write!(f, "wedged ({reason})"),
            ExitPath::DrainTimeElapsed => f.write_str("termination drain duration elapsed"),
            ExitPath::DrainFailed => {
                f.write_str("envoy never accepted the drain request: stopped without a drain")
            }
            ExitPath::ZeroActive(what) => write!(f, "no active {what} left"),
            ExitPath::DrainDeadline(what) => {
                write!(
                    f,
                    "active {what} remained at the termination drain deadline"
                )
            }
            ExitPath::StatsUnavailable(what) => write!(f, "active {what} could not be counted"),
            ExitPath::QuitQuitQuit(Via::Http) => f.write_str("POST /quitquitquit"),
            ExitPath::QuitQuitQuit(Via::Grpc) => f.write_str("gRPC QuitQuitQuit"),
            ExitPath::SecondSignal => f.write_str("second signal during the drain"),
            ExitPath::SignalAfterDrain => f.write_str("signal after a drain request"),
            ExitPath::HandedOver => f.write_str("handed over to the successor pod"),
            ExitPath::HandoverTimedOut => {
                f.write_str("the successor did not terminate our envoy in time")
            }
            ExitPath::ProxyStopped => f.write_str("envoy stopped before it served"),
            ExitPath::ProxyFailed => f.write_str("envoy could not be run"),
            ExitPath::CrashLoop { code } => write!(
                f,
                "envoy kept crashing: the restart limit was reached (last crash: exit {code})"
            ),
            ExitPath::StoppedWhileRecovering => {
                f.write_str("stopped while recovering from a crash")
            }
        }
    }
}

impl ExitPath {
    /// The process exit code this path means.
    pub fn code(self) -> u8 {
        match self {
            ExitPath::ProxyExited { code } => u8::try_from(code).unwrap_or(1),
            ExitPath::ProxyLost { code }
            | ExitPath::StartFailed { code }
            | ExitPath::CrashLoop { code } => code,
            ExitPath::Wedged { .. } => envoy_agent_proxy::EXIT_WEDGED,
            ExitPath::ProxyFailed => EXIT_SOFTWARE,
            // Stopped as asked, but not gracefully: no success to report.
            ExitPath::DrainFailed => 1,
            _ => 0,
        }
    }

    /// A short name (`drain_time_elapsed`, `quitquitquit`, ...) for metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            ExitPath::ProxyExited { .. } => "proxy_exited",
            ExitPath::ProxyLost { .. } => "proxy_lost",
            ExitPath::StartFailed { .. } => "start_failed",
            ExitPath::Wedged { .. } => "wedged",
            ExitPath::DrainTimeElapsed => "drain_time_elapsed",
            ExitPath::DrainFailed => "drain_failed",
            ExitPath::ZeroActive(Counting::Connections) => "zero_connections",
            ExitPath::ZeroActive(Counting::Requests) => "zero_requests",
            ExitPath::DrainDeadline(_) => "drain_deadline",
            ExitPath::StatsUnavailable(_) => "stats_unavailable",
            ExitPath::QuitQuitQuit(_) => "quitquitquit",
            ExitPath::SecondSignal => "second_signal",
            ExitPath::SignalAfterDrain => "signal_after_drain",
            ExitPath::HandedOver => "handed_over",
            ExitPath::HandoverTimedOut => "handover_timed_out",
            ExitPath::ProxyStopped => "proxy_stopped",
            ExitPath::ProxyFailed => "proxy_failed",
            ExitPath::CrashLoop { .. } => "crash_loop",
            ExitPath::StoppedWhileRecovering => "stopped_while_recovering",
        }
    }

    /// What exit-on-zero counted, for its paths.
    pub fn counting(self) -> Option<Counting> {
        match self {
            ExitPath::ZeroActive(what)
            | ExitPath::DrainDeadline(what)
            | ExitPath::StatsUnavailable(what) => Some(what),
            _ => None,
        }
    }
}

/// The agent's state.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentState {
    /// Envoy is starting (not LIVE yet).
    Starting {
        /// Since when.
        since: SystemTime,
    },
    /// The newest Envoy is LIVE and nothing drains.
    Live {
        /// Since when.
        since: SystemTime,
    },
    /// Draining.
    Draining {
        /// Since when.
        since: SystemTime,
        /// Why.
        reason: DrainReason,
        /// Where.
        phase: DrainPhase,
    },
    /// A successor pod's Envoy took over from ours (ours drains until it terminates it).
    HandedOver {
        /// Since when.
        since: SystemTime,
        /// Who.
        successor: String,
    },
    /// Told to stop while a successor pod takes over: waiting for it to terminate our Envoy.
    HandingOver {
        /// Since when.
        since: SystemTime,
        /// Who.
        successor: String,
    },
    /// Stopping Envoy and exiting.
    Exiting {
        /// Since when.
        since: SystemTime,
        /// Why.
        path: ExitPath,
    },
    /// Crash recovery: the serving Envoy crashed; nothing runs until the back-off ends.
    Recovering {
        /// Since when.
        since: SystemTime,
        /// The restart to come, 1 for the first of a streak.
        attempt: u32,
        /// When it starts.
        restart_at: SystemTime,
    },
}

impl fmt::Display for AgentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentState::Starting { .. } | AgentState::Live { .. } => f.write_str(self.name()),
            AgentState::Draining {
                reason,
                phase: DrainPhase::Deciding,
                ..
            } => write!(f, "stopping ({reason}; is a successor taking over?)"),
            AgentState::Draining {
                reason,
                phase: DrainPhase::Delay,
                ..
            } => write!(f, "draining soon ({reason}; drain delay)"),
            AgentState::Draining { reason, .. } => write!(f, "draining ({reason})"),
            AgentState::HandedOver { successor, .. } => write!(f, "handed over to {successor}"),
            AgentState::HandingOver { successor, .. } => {
                write!(f, "handing over to {successor}")
            }
            AgentState::Exiting { path, .. } => write!(f, "exiting ({path})"),
            AgentState::Recovering {
                attempt,
                restart_at,
                ..
            } => {
                let wait = restart_at
                    .duration_since(SystemTime::now())
                    .unwrap_or_default();
                write!(
                    f,
                    "recovering from a crash (restart {attempt} in {:.1}s)",
                    wait.as_secs_f64()
                )
            }
        }
    }
}

impl AgentState {
    /// A short name: `starting`, `live`, `draining`, `handed_over`, `handing_over`, `exiting`,
    /// `recovering`.
    pub fn name(&self) -> &'static str {
        match self {
            AgentState::Starting { .. } => "starting",
            AgentState::Live { .. } => "live",
            AgentState::Draining { .. } => "draining",
            AgentState::HandedOver { .. } => "handed_over",
            AgentState::HandingOver { .. } => "handing_over",
            AgentState::Exiting { .. } => "exiting",
            AgentState::Recovering { .. } => "recovering",
        }
    }

    /// When this state began.
    pub fn since(&self) -> SystemTime {
        match self {
            AgentState::Starting { since }
            | AgentState::Live { since }
            | AgentState::Draining { since, .. }
            | AgentState::HandedOver { since, .. }
            | AgentState::HandingOver { since, .. }
            | AgentState::Exiting { since, .. }
            | AgentState::Recovering { since, .. } => *since,
        }
    }

    /// Whether the agent serves: the newest Envoy LIVE and nothing draining, handing over or
    /// stopping. What readiness and gRPC health report (a hot-restart handoff is not a drain:
    /// the serving epoch serves through it).
    pub fn serving(&self) -> bool {
        matches!(self, AgentState::Live { .. })
    }

    /// Whether Envoy drains (or is about to): a drain, a handover, an exit.
    pub fn draining(&self) -> bool {
        matches!(
            self,
            AgentState::Draining { .. }
                | AgentState::HandedOver { .. }
                | AgentState::HandingOver { .. }
        )
    }

    fn same_kind(&self, other: &AgentState) -> bool {
        match (self, other) {
            (AgentState::Starting { .. }, AgentState::Starting { .. })
            | (AgentState::Live { .. }, AgentState::Live { .. }) => true,
            (
                AgentState::Draining { reason, phase, .. },
                AgentState::Draining {
                    reason: r,
                    phase: p,
                    ..
                },
            ) => reason == r && phase == p,
            (
                AgentState::HandedOver { successor, .. },
                AgentState::HandedOver { successor: s, .. },
            )
            | (
                AgentState::HandingOver { successor, .. },
                AgentState::HandingOver { successor: s, .. },
            ) => successor == s,
            (AgentState::Exiting { path, .. }, AgentState::Exiting { path: p, .. }) => path == p,
            (AgentState::Recovering { attempt, .. }, AgentState::Recovering { attempt: a, .. }) => {
                attempt == a
            }
            _ => false,
        }
    }
}

/// What the agent publishes: its own state and the proxy's, taken together.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    /// The agent's state.
    pub agent: AgentState,
    /// The proxy's state (every epoch; hot restart's handoffs and cross-pod facts).
    pub proxy: ProxyState,
    /// The shutdown drain under way, if any.
    pub drain: Option<DrainProgress>,
    /// Crash recovery: its settings, the current streak and the last crashes.
    pub crashes: Crashes,
}

impl Status {
    /// Whether the agent is ready: it serves (see [`AgentState::serving`]) and the newest
    /// Envoy has its config (a dynamic bootstrap's, received from the control plane once).
    /// What readiness, gRPC health and systemd's `READY=1` report.
    pub fn ready(&self) -> bool {
        self.agent.serving() && self.proxy.ready().is_ok()
    }
}

/// A shutdown drain under way (SIGTERM, gRPC `Stop`), as a controller wants to see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainProgress {
    /// Why.
    pub reason: DrainReason,
    /// When the drain began (the signal; the drain call follows the drain delay).
    pub started: SystemTime,
    /// When Envoy is stopped at the latest; none in exit-on-zero mode without a deadline.
    pub deadline: Option<SystemTime>,
    /// Exit-on-zero: what it counts; none without exit-on-zero.
    pub counting: Option<Counting>,
    /// Exit-on-zero: the last count (of [`DrainProgress::counting`]), and when it was taken.
    pub last_count: Option<(u64, SystemTime)>,
}

/// How the agent's run ended; [`AgentExit::code`] is the process exit code.
#[derive(Debug)]
pub struct AgentExit {
    /// Why.
    pub path: ExitPath,
    /// How the proxy ended, when it ran.
    pub ended: Option<Ended>,
    /// Why the proxy could not be run, when it could not.
    pub error: Option<ProxyError>,
}

impl AgentExit {
    /// The process exit code (see [`ExitPath::code`]).
    pub fn code(&self) -> u8 {
        self.path.code()
    }
}

/// Why a command to the agent failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The agent has exited or is exiting.
    #[error("the agent is exiting")]
    Gone,
    /// Envoy refused or did not answer the drain; the agent still skips the drain on exit.
    #[error("drain failed: {0}")]
    DrainFailed(String),
    /// The hot restart did not happen.
    #[error(transparent)]
    Restart(#[from] RestartError),
    /// The config update did not happen (or its restart did not).
    #[error(transparent)]
    Config(ProxyError),
}

type Reply<T> = oneshot::Sender<Result<T, AgentError>>;

enum Command {
    Drain {
        options: DrainOptions,
        via: Via,
        reply: Reply<()>,
    },
    Quit {
        via: Via,
        reply: Reply<()>,
    },
    Stop {
        reply: Reply<()>,
    },
    DisableDraining {
        reply: Reply<()>,
    },
    HotRestart {
        reason: String,
        reply: Reply<u32>,
    },
    UpdateConfig {
        config: Vec<u8>,
        reason: String,
        reply: Reply<ConfigApplied>,
    },
    ReopenLogs {
        reply: Reply<usize>,
    },
}

/// A cloneable handle to a running [`Agent`]. Every method resolves once the agent has acted.
#[derive(Clone)]
pub struct AgentHandle {
    commands: mpsc::Sender<Command>,
    status: watch::Receiver<Status>,
    admin: Arc<dyn Fn() -> Option<std::net::SocketAddr> + Send + Sync>,
}

impl fmt::Debug for AgentHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentHandle")
            .field("state", &self.status.borrow().agent)
            .finish_non_exhaustive()
    }
}

// === impl AgentHandle ===

impl AgentHandle {
    /// The agent's and the proxy's state, now and as it changes.
    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// The agent's own state now.
    pub fn state(&self) -> AgentState {
        self.status.borrow().agent.clone()
    }

    /// Envoy's admin API, when its address is known.
    pub fn admin(&self) -> Option<AdminClient> {
        (self.admin)().map(AdminClient::new)
    }

    async fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, AgentError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(command(reply))
            .await
            .map_err(|_| AgentError::Gone)?;
        answer.await.map_err(|_| AgentError::Gone)?
    }

    /// `/drain`: drain with `skip_exit` (Envoy keeps running and accepting); the next SIGTERM
    /// then exits at once. Resolves when Envoy has accepted the drain.
    pub async fn drain_now(&self, via: Via) -> Result<(), AgentError> {
        self.drain(
            DrainOptions {
                inbound_only: None,
                skip_exit: true,
            },
            via,
        )
        .await
    }

    /// Drains every serving epoch and keeps Envoy running: the next SIGTERM exits at once.
    /// With `skip_exit` the listeners keep accepting; without, Envoy stops them when its drain
    /// time ends. Resolves when Envoy has accepted the drain.
    pub async fn drain(&self, options: DrainOptions, via: Via) -> Result<(), AgentError> {
        self.ask(|reply| Command::Drain {
            options,
            via,
            reply,
        })
        .await
    }

    /// `/quitquitquit`: stop Envoy at once, without draining, and exit. Resolves once the stop
    /// has begun.
    pub async fn quit(&self, via: Via) -> Result<(), AgentError> {
        self.ask(|reply| Command::Quit { via, reply }).await
    }

    /// The SIGTERM path: hand over to a successor pod, or drain gracefully, then stop.
    /// Resolves once the agent has taken the path.
    pub async fn stop(&self) -> Result<(), AgentError> {
        self.ask(|reply| Command::Stop { reply }).await
    }

    /// Skip the drain on the next SIGTERM (stop at once). Resolves once set.
    pub async fn disable_draining(&self) -> Result<(), AgentError> {
        self.ask(|reply| Command::DisableDraining { reply }).await
    }

    /// Hot-restarts; the new epoch once it is LIVE, or why not.
    pub async fn hot_restart(&self, reason: String) -> Result<u32, AgentError> {
        self.ask(|reply| Command::HotRestart { reason, reply })
            .await
    }

    /// Validates, writes and (with hot restart) restarts onto a new config.
    pub async fn update_config(
        &self,
        config: Vec<u8>,
        reason: String,
    ) -> Result<ConfigApplied, AgentError> {
        self.ask(|reply| Command::UpdateConfig {
            config,
            reason,
            reply,
        })
        .await
    }

    /// SIGUSR1 to every Envoy that can take it; how many were signalled.
    pub async fn reopen_logs(&self) -> Result<usize, AgentError> {
        self.ask(|reply| Command::ReopenLogs { reply }).await
    }
}

/// Runs a proxy until it exits or an intent or command stops it. See the module docs.
pub struct Agent<P> {
    proxy: Arc<P>,
    config: AgentConfig,
    metrics: crate::telemetry::AgentMetrics,
    commands: mpsc::Receiver<Command>,
    status: watch::Sender<Status>,
    /// Counts for exit-on-zero; the admin API unless replaced.
    counter: Option<Counter>,
}

/// Counts what exit-on-zero counts, once per call.
pub type Counter =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<u64, DrainError>> + Send>> + Send + Sync>;

impl<P> fmt::Debug for Agent<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

type Pending<T> = Option<Pin<Box<dyn Future<Output = T> + Send>>>;

/// Awaits the future in `slot`, or never when there is none.
async fn settle<T>(slot: &mut Pending<T>) -> T {
    match slot {
        Some(future) => future.await,
        None => std::future::pending().await,
    }
}

/// What the next SIGTERM does while the agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnSignal {
    /// Hand over or drain gracefully.
    Drain,
    /// Stop at once (draining was disabled).
    StopAtOnce,
}

/// A shutdown drain under way.
#[derive(Debug)]
struct Shutdown {
    reason: DrainReason,
    /// When the drain call goes out (after the delay).
    drain_at: Instant,
    drain: DrainAsk,
    /// Exit-on-zero: counting starts here.
    count_from: Instant,
    next_count: Instant,
    /// When Envoy is stopped at the latest; none in exit-on-zero mode when the termination
    /// drain duration is not longer than the minimum (Istio's: count until zero, no cap).
    deadline: Option<Instant>,
    stats_errors: u32,
    /// The last count, if one succeeded.
    last_count: Option<u64>,
    /// What the status says of this drain.
    progress: DrainProgress,
}

/// Where the shutdown's drain request to Envoy is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DrainAsk {
    /// It goes out at the shutdown's `drain_at`.
    Due,
    /// Out since `since`, not answered yet; `failed`: the last attempt's error, if this is
    /// a retry.
    InFlight {
        since: Instant,
        failed: Option<String>,
    },
    /// Envoy drains.
    Accepted,
    /// It failed (`error`): asked again at `retry_at`, until the deadline.
    Failed { error: String, retry_at: Instant },
}

/// The share of a core a drain's count from the kernel's socket table may take of the agent.
const KERNEL_COUNT_SHARE: u32 = 4;

/// How soon a failed drain request is sent again; and how long one may go unanswered before
/// the shutdown, ending meanwhile, reports that Envoy never accepted a drain.
const DRAIN_RETRY: Duration = Duration::from_secs(1);

impl DrainAsk {
    /// At the deadline, `now`: why Envoy is stopped without having accepted a drain, if it
    /// was asked and failed. A request just sent (a zero termination drain duration) is no
    /// failure: it is unanswered, not refused.
    fn failure(&self, now: Instant) -> Option<String> {
        match self {
            DrainAsk::Due | DrainAsk::Accepted => None,
            DrainAsk::Failed { error, .. }
            | DrainAsk::InFlight {
                failed: Some(error),
                ..
            } => Some(error.clone()),
            DrainAsk::InFlight {
                since,
                failed: None,
            } => (now.saturating_duration_since(*since) >= DRAIN_RETRY)
                .then(|| format!("no answer for {:?}", now.saturating_duration_since(*since))),
        }
    }
}

/// The agent's mode: one enum, never flags that must agree.
#[derive(Debug)]
enum Mode {
    /// Envoy runs (starting or LIVE).
    Running(OnSignal),
    /// A drain request was accepted: Envoy drains and keeps running; the next SIGTERM stops.
    Drained { reason: DrainReason },
    /// A stop is coming: asking the proxy whether a successor pod takes over.
    Deciding { intent: Intent },
    /// The graceful shutdown: delay, drain, wait.
    ShuttingDown(Shutdown),
    /// A successor pod takes over: waiting for it to terminate our Envoy.
    HandingOver { successor: String, until: Instant },
    /// The proxy was told to stop; waiting for it to end.
    Stopping(ExitPath),
    /// Crash recovery: the proxy's run ended in a crash; it runs again at `next_at`.
    Recovering {
        attempt: u32,
        next_at: Instant,
        /// `next_at` on the wall clock, for the status.
        restart_at: SystemTime,
        /// What a SIGTERM would have done once the proxy runs again.
        on_signal: OnSignal,
    },
}

// === impl Agent ===

impl<P: Proxy> Agent<P> {
    /// An agent for `proxy`, and a handle to it.
    pub fn new(proxy: Arc<P>, config: AgentConfig) -> (Self, AgentHandle) {
        let (commands_tx, commands) = mpsc::channel(16);
        let status = watch::Sender::new(Status {
            agent: AgentState::Starting {
                since: SystemTime::now(),
            },
            proxy: proxy.state().borrow().clone(),
            drain: None,
            crashes: Crashes {
                recovery: config.crash_recovery,
                ..Crashes::default()
            },
        });
        let admin = {
            let proxy = proxy.clone();
            Arc::new(move || proxy.admin_address())
        };
        let handle = AgentHandle {
            commands: commands_tx,
            status: status.subscribe(),
            admin,
        };
        (
            Agent {
                proxy,
                config,
                metrics: crate::telemetry::AgentMetrics::default(),
                commands,
                status,
                counter: None,
            },
            handle,
        )
    }

    /// Counts with `counter` instead of Envoy's admin API (tests).
    pub fn with_counter(mut self, counter: Counter) -> Self {
        self.counter = Some(counter);
        self
    }

    /// Records into `metrics` (drain duration and exit path).
    pub fn with_metrics(mut self, metrics: crate::telemetry::AgentMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Starts the proxy and returns once it has ended and every Envoy has been reaped.
    pub async fn run(mut self, mut intents: impl IntentSource) -> AgentExit {
        let abort = CancellationToken::new();
        // None only while recovering from a crash: nothing runs then.
        let mut run: Pending<Result<Ended, ProxyError>> = Some(self.run_future(&abort));
        let mut proxy_state = self.proxy.state();
        let mut crash_loop = CrashLoop::new(self.config.crash_recovery);
        let mut gave_up: Option<ExitPath> = None;

        let mut mode = Mode::Running(OnSignal::Drain);
        let mut intents_open = true;
        let mut commands_open = true;
        let mut successor_call: Pending<Option<String>> = None;
        let mut drain_call: Pending<Result<(), ProxyError>> = None;
        let mut drain_replies: Vec<Reply<()>> = Vec::new();
        let mut count_call: Pending<(Result<u64, DrainError>, Duration, u32)> = None;
        let mut drain_started: Option<Instant> = None;
        let mut quit_replies: Vec<Reply<()>> = Vec::new();
        let mut proxy_state_open = true;

        let result = loop {
            {
                let state = proxy_state.borrow_and_update();
                crash_loop.observe(state.serving(), Instant::now());
                self.publish(&mode, &state, crash_loop.crashes());
            }
            let wake = earliest(
                self.next_wake(&mode, count_call.is_some()),
                crash_loop.streak_ends_at(),
            );
            // Decisions taken in a branch; applied below, where `self` is free again.
            let mut stop_now: Option<ExitPath> = None;
            let mut shutdown_now: Option<DrainReason> = None;
            tokio::select! {
                result = settle(&mut run) => {
                    run = None;
                    // Only an end the agent did not ask for, while it ran the proxy.
                    let crash = match (&mode, &result) {
                        (Mode::Running(_), Ok(ended)) => crash_loop.on_end(ended, Instant::now()),
                        _ => None,
                    };
                    let Some(crash) = crash else { break result };
                    self.report_crash(&crash, crash_loop.crashes());
                    match (crash.action, &mode) {
                        (CrashAction::Restart { attempt, backoff }, Mode::Running(on_signal)) => {
                            mode = Mode::Recovering {
                                attempt,
                                next_at: Instant::now() + backoff,
                                restart_at: SystemTime::now() + backoff,
                                on_signal: *on_signal,
                            };
                        }
                        _ => {
                            gave_up = Some(ExitPath::CrashLoop { code: crash.code });
                            break result;
                        }
                    }
                }

                changed = proxy_state.changed(), if proxy_state_open => {
                    // Closed: the proxy is ending; only its run's end is left to see.
                    proxy_state_open = changed.is_ok();
                }

                intent = intents.next(), if intents_open => match intent {
                    None => intents_open = false,
                    Some(intent @ (Intent::Terminate | Intent::Interrupt)) => match &mode {
                        Mode::Stopping(_) => tracing::info!(signal = intent.signal_name(), "already stopping"),
                        Mode::Recovering { .. } => stop_now = Some(ExitPath::StoppedWhileRecovering),
                        Mode::ShuttingDown(_) | Mode::Deciding { .. } | Mode::HandingOver { .. } => {
                            stop_now = Some(ExitPath::SecondSignal);
                        }
                        Mode::Drained { .. } | Mode::Running(OnSignal::StopAtOnce) => {
                            stop_now = Some(ExitPath::SignalAfterDrain);
                        }
                        Mode::Running(OnSignal::Drain) => {
                            tracing::info!(signal = intent.signal_name(), "stopping: is a successor pod taking over?");
                            mode = Mode::Deciding { intent };
                            drain_started.get_or_insert_with(Instant::now);
                            // A drain request in flight is superseded by the shutdown.
                            drain_call = None;
                            successor_call = Some(self.successor_future());
                        }
                    },
                    Some(Intent::ReopenLogs) if matches!(mode, Mode::Recovering { .. }) => {
                        tracing::info!("SIGUSR1: no envoy runs (recovering from a crash)");
                    }
                    Some(Intent::ReopenLogs) => self.spawn_reply(None, |p| async move {
                        let n = p.reopen_logs().await;
                        match &n {
                            Ok(n) => tracing::info!(envoys = n, "SIGUSR1: asked envoy to reopen its logs"),
                            Err(e) => tracing::warn!(error = %e, "cannot forward SIGUSR1 to envoy"),
                        }
                        n.map_err(AgentError::Config)
                    }),
                    Some(Intent::Reload) => {
                        if matches!(mode, Mode::Running(_)) {
                            self.spawn_reply(None, |p| async move {
                                let r = p.hot_restart("SIGHUP".to_owned()).await;
                                if let Err(RestartError::Unsupported) = &r {
                                    tracing::warn!("SIGHUP ignored: hot restart is off");
                                }
                                r.map_err(AgentError::Restart)
                            });
                        } else if matches!(mode, Mode::Recovering { .. }) {
                            tracing::warn!("SIGHUP ignored: no envoy runs (recovering from a crash)");
                        } else {
                            tracing::warn!("SIGHUP ignored: the agent is draining or stopping");
                        }
                    }
                },

                command = self.commands.recv(), if commands_open => match command {
                    None => commands_open = false,
                    Some(Command::Quit { via, reply }) => {
                        if !matches!(mode, Mode::Stopping(_)) {
                            stop_now = Some(ExitPath::QuitQuitQuit(via));
                        }
                        // Answered below, once the stop has begun.
                        quit_replies.push(reply);
                    }
                    Some(Command::Stop { reply }) => {
                        match &mode {
                            Mode::Running(OnSignal::Drain) => {
                                mode = Mode::Deciding { intent: Intent::Terminate };
                                drain_started.get_or_insert_with(Instant::now);
                                drain_call = None;
                                successor_call = Some(self.successor_future());
                            }
                            Mode::Drained { .. } | Mode::Running(OnSignal::StopAtOnce) => {
                                stop_now = Some(ExitPath::SignalAfterDrain);
                            }
                            Mode::Recovering { .. } => stop_now = Some(ExitPath::StoppedWhileRecovering),
                            _ => {}
                        }
                        let _ = reply.send(Ok(()));
                    }
                    Some(Command::DisableDraining { reply }) => {
                        if let Mode::Running(on_signal) | Mode::Recovering { on_signal, .. } = &mut mode {
                            tracing::info!("draining disabled: the next SIGTERM stops envoy at once");
                            *on_signal = OnSignal::StopAtOnce;
                        }
                        let _ = reply.send(Ok(()));
                    }
                    Some(Command::Drain { options, via, reply }) => match &mode {
                        Mode::Running(_) | Mode::Drained { .. } => {
                            let reason = DrainReason::Request(via);
                            if matches!(mode, Mode::Running(_)) {
                                tracing::info!(%reason, skip_exit = options.skip_exit, "draining on request: envoy keeps running, the next SIGTERM stops it");
                                drain_started.get_or_insert_with(Instant::now);
                                mode = Mode::Drained { reason };
                            }
                            drain_call = Some(self.drain_future(options));
                            drain_replies.push(reply);
                        }
                        Mode::Recovering { .. } => {
                            let _ = reply.send(Err(AgentError::DrainFailed(RECOVERING.to_owned())));
                        }
                        // Already draining, handing over or stopping: nothing more to ask.
                        _ => {
                            let _ = reply.send(Ok(()));
                        }
                    },
                    Some(Command::HotRestart { reason, reply }) => {
                        // After a drain request the proxy refuses on its own (or has no hot
                        // restart at all); on the way out, the agent refuses.
                        if matches!(mode, Mode::Running(_) | Mode::Drained { .. }) {
                            self.spawn_reply(Some(reply), |p| async move {
                                p.hot_restart(reason).await.map_err(AgentError::Restart)
                            });
                        } else {
                            let _ = reply.send(Err(AgentError::Restart(refusal(&mode))));
                        }
                    }
                    Some(Command::UpdateConfig { config, reason, reply }) => {
                        if matches!(mode, Mode::Running(_)) {
                            self.spawn_reply(Some(reply), |p| async move {
                                p.update_config(config, reason).await.map_err(AgentError::Config)
                            });
                        } else {
                            let _ = reply.send(Err(AgentError::Restart(refusal(&mode))));
                        }
                    }
                    Some(Command::ReopenLogs { reply }) if matches!(mode, Mode::Recovering { .. }) => {
                        let _ = reply.send(Ok(0));
                    }
                    Some(Command::ReopenLogs { reply }) => self.spawn_reply(Some(reply), |p| async move {
                        p.reopen_logs().await.map_err(AgentError::Config)
                    }),
                },

                successor = settle(&mut successor_call) => {
                    successor_call = None;
                    if let Mode::Deciding { intent } = mode {
                        match successor {
                            Some(successor) => {
                                tracing::info!(event = "handing_over", %successor, bound = ?self.config.handover_timeout,
                                    "a successor pod takes over: waiting for its envoy to terminate ours");
                                mode = Mode::HandingOver {
                                    successor,
                                    until: Instant::now() + self.config.handover_timeout,
                                };
                            }
                            None => shutdown_now = Some(DrainReason::Signal(intent)),
                        }
                    }
                }

                () = sleep_until(wake) => {
                    let now = Instant::now();
                    match &mut mode {
                        Mode::Recovering { attempt, next_at, on_signal, .. } if *next_at <= now => {
                            tracing::info!(event = "envoy_restarting", attempt = *attempt, "recovering from a crash: starting envoy again");
                            mode = Mode::Running(*on_signal);
                            run = Some(self.run_future(&abort));
                        }
                        Mode::HandingOver { until, successor } if *until <= now => {
                            tracing::error!(%successor, bound = ?self.config.handover_timeout, "the successor did not terminate our envoy in time; stopping it");
                            stop_now = Some(ExitPath::HandoverTimedOut);
                        }
                        Mode::ShuttingDown(s) => {
                            let ask = match &s.drain {
                                DrainAsk::Due => s.drain_at <= now,
                                DrainAsk::Failed { retry_at, .. } => *retry_at <= now,
                                DrainAsk::InFlight { .. } | DrainAsk::Accepted => false,
                            };
                            if ask && drain_call.is_none() {
                                let failed = match &s.drain {
                                    DrainAsk::Failed { error, .. } => Some(error.clone()),
                                    _ => None,
                                };
                                s.drain = DrainAsk::InFlight { since: now, failed };
                                drain_call = Some(self.drain_future(DrainOptions::default()));
                            }
                            if s.deadline.is_some_and(|d| d <= now) {
                                // Never claim a drain that Envoy did not accept, nor that
                                // anything remained unless it was counted.
                                stop_now = Some(match (s.drain.failure(now), self.config.exit_on_zero, s.last_count) {
                                    (Some(error), ..) => {
                                        tracing::error!(event = "drain_failed", %error, "envoy never accepted the drain request: stopping it without a drain");
                                        ExitPath::DrainFailed
                                    }
                                    (None, Some(what), Some(n)) if n > 0 => ExitPath::DrainDeadline(what),
                                    _ => ExitPath::DrainTimeElapsed,
                                });
                            } else if self.config.exit_on_zero.is_some()
                                && s.drain != DrainAsk::Due
                                && s.count_from <= now
                                && s.next_count <= now
                                && count_call.is_none()
                            {
                                s.next_count = now + self.config.poll_interval;
                                let count = self.count_future();
                                // Whose time a count takes: Envoy's main thread (its stats: at
                                // most 1/20 of it), or the agent's own (the kernel's table: at
                                // most a quarter of a core).
                                let share = if self.counts_from_kernel() {
                                    KERNEL_COUNT_SHARE
                                } else {
                                    envoy_agent_proxy::admin::BUSY_SHARE
                                };
                                count_call = Some(Box::pin(async move {
                                    let asked = Instant::now();
                                    (count.await, asked.elapsed(), share)
                                }));
                            }
                        }
                        _ => {}
                    }
                }

                result = settle(&mut drain_call) => {
                    drain_call = None;
                    match &result {
                        Ok(()) => tracing::info!(event = "drain_accepted", "envoy is draining its listeners"),
                        Err(e) => tracing::warn!(event = "drain_request_failed", error = %e, "drain request failed"),
                    }
                    if let Mode::ShuttingDown(s) = &mut mode {
                        s.drain = match &result {
                            Ok(()) => DrainAsk::Accepted,
                            Err(e) => DrainAsk::Failed {
                                error: e.to_string(),
                                retry_at: Instant::now() + DRAIN_RETRY,
                            },
                        };
                    }
                    for reply in drain_replies.drain(..) {
                        let _ = reply.send(result.as_ref().map(|_| ()).map_err(|e| AgentError::DrainFailed(e.to_string())));
                    }
                }

                (count, took, share) = settle(&mut count_call) => {
                    count_call = None;
                    if let (Mode::ShuttingDown(s), Some(what)) = (&mut mode, self.config.exit_on_zero) {
                        // A count from Envoy's stats makes it visit every stat (most of a
                        // second on a large config): paced by what it took.
                        let asked = Instant::now().checked_sub(took).unwrap_or_else(Instant::now);
                        s.next_count = s.next_count.max(
                            asked + envoy_agent_proxy::admin::paced(self.config.poll_interval, took, share),
                        );
                        match count {
                            // A parent epoch still drains its own connections, which the count
                            // may not show: zero means zero only once it is gone.
                            Ok(0) if !proxy_state.borrow().parent_draining() => {
                                stop_now = Some(ExitPath::ZeroActive(what))
                            }
                            Ok(n) => {
                                s.stats_errors = 0;
                                s.last_count = Some(n);
                                s.progress.last_count = Some((n, SystemTime::now()));
                                match what {
                                    Counting::Connections => tracing::debug!(event = "active_connections", active_connections = n, "waiting for zero"),
                                    Counting::Requests => tracing::debug!(event = "active_requests", active_requests = n, "waiting for zero"),
                                }
                            }
                            Err(e) => {
                                s.stats_errors += 1;
                                tracing::warn!(
                                    error = %e,
                                    errors = s.stats_errors,
                                    budget = self.config.stats_error_budget,
                                    "cannot count active {what}"
                                );
                                if s.stats_errors >= self.config.stats_error_budget {
                                    stop_now = Some(ExitPath::StatsUnavailable(what));
                                }
                            }
                        }
                    }
                }
            }

            // A handover ends when our Envoy is gone, or falls back to our own drain when the
            // successor went away without taking over.
            if let (Mode::HandingOver { successor, .. }, None) = (&mode, stop_now) {
                let state = proxy_state.borrow();
                if state.phase == ProxyPhase::HandedOver && state.epochs.is_empty() {
                    tracing::info!(%successor, "our envoy was terminated by the successor's");
                    stop_now = Some(ExitPath::HandedOver);
                } else if state.phase == ProxyPhase::Serving
                    && state
                        .family
                        .as_ref()
                        .is_none_or(|f| f.successor_starting.is_none())
                {
                    tracing::warn!(%successor, "the successor is gone without taking over: draining our own envoy");
                    shutdown_now = Some(DrainReason::Signal(Intent::Terminate));
                }
            }
            if let (Some(reason), None) = (shutdown_now, stop_now) {
                if matches!(mode, Mode::Deciding { .. } | Mode::HandingOver { .. }) {
                    mode = Mode::ShuttingDown(self.begin_shutdown(reason));
                }
            }
            if let Some(path) = stop_now {
                if !matches!(mode, Mode::Stopping(_)) {
                    tracing::info!(
                        event = "stopping",
                        exit_path = path.name(),
                        counting = path.counting().map(Counting::name),
                        at_unix_ms = unix_ms(),
                        "stopping envoy: {path}"
                    );
                    mode = Mode::Stopping(path);
                    // In-flight calls are moot now; dropping them closes their connections.
                    successor_call = None;
                    drain_call = None;
                    count_call = None;
                    for reply in drain_replies.drain(..) {
                        let _ = reply.send(Ok(()));
                    }
                    abort.cancel();
                }
            }
            for reply in quit_replies.drain(..) {
                let _ = reply.send(Ok(()));
            }
            if matches!(mode, Mode::Stopping(_)) && run.is_none() {
                // Stopped during a crash back-off: nothing runs, nothing to wait for.
                break Ok(Ended::Stopped { last: None });
            }
        };
        self.proxy.cleanup();

        let stopping = match mode {
            Mode::Stopping(path) => Some(path),
            _ => None,
        };
        let (path, ended, error) = match result {
            Err(e) => {
                tracing::error!(error = %e, "envoy could not be run");
                (ExitPath::ProxyFailed, None, Some(e))
            }
            Ok(ended) => {
                let path = match (&ended, stopping.or(gave_up)) {
                    (_, Some(path @ ExitPath::CrashLoop { .. })) => path,
                    (Ended::Stopped { .. }, Some(path)) => path,
                    (Ended::Stopped { .. }, None) => ExitPath::ProxyStopped,
                    (Ended::Exited(exit), _) => ExitPath::ProxyExited { code: exit.code() },
                    (Ended::Lost { .. }, _) => ExitPath::ProxyLost { code: ended.code() },
                    (Ended::StartFailed { .. }, _) => ExitPath::StartFailed { code: ended.code() },
                    (Ended::Wedged { reason, .. }, _) => ExitPath::Wedged { reason: *reason },
                };
                log_ended(&ended);
                (path, Some(ended), None)
            }
        };
        let final_state = AgentState::Exiting {
            since: SystemTime::now(),
            path,
        };
        tracing::info!(event = "agent_state", state = %final_state, "agent state");
        self.status.send_modify(|s| {
            s.agent = final_state;
            s.proxy = self.proxy.state().borrow().clone();
            s.drain = None;
            s.crashes = crash_loop.crashes().clone();
        });
        self.metrics
            .exit(path.name(), drain_started.map(|t| t.elapsed()));
        AgentExit { path, ended, error }
    }

    /// Publishes the agent's state, derived from its mode and the proxy's state, when it
    /// changed.
    fn publish(&self, mode: &Mode, proxy: &ProxyState, crashes: &Crashes) {
        let now = SystemTime::now();
        let state = match mode {
            Mode::Recovering {
                attempt,
                restart_at,
                ..
            } => AgentState::Recovering {
                since: now,
                attempt: *attempt,
                restart_at: *restart_at,
            },
            Mode::Stopping(path) => AgentState::Exiting {
                since: now,
                path: *path,
            },
            Mode::ShuttingDown(s) => AgentState::Draining {
                since: now,
                reason: s.reason,
                phase: if s.drain != DrainAsk::Due || s.drain_at <= Instant::now() {
                    DrainPhase::Draining
                } else {
                    DrainPhase::Delay
                },
            },
            Mode::Deciding { intent } => AgentState::Draining {
                since: now,
                reason: DrainReason::Signal(*intent),
                phase: DrainPhase::Deciding,
            },
            Mode::HandingOver { successor, .. } => AgentState::HandingOver {
                since: now,
                successor: successor.clone(),
            },
            Mode::Drained { reason } => AgentState::Draining {
                since: now,
                reason: *reason,
                phase: DrainPhase::Draining,
            },
            Mode::Running(_) => match proxy.phase {
                ProxyPhase::Serving => AgentState::Live { since: now },
                ProxyPhase::HandedOver => AgentState::HandedOver {
                    since: now,
                    successor: proxy
                        .family
                        .as_ref()
                        .and_then(|f| f.handed_over_to.clone())
                        .unwrap_or_default(),
                },
                _ => AgentState::Starting { since: now },
            },
        };
        let drain = match mode {
            Mode::ShuttingDown(s) => Some(s.progress.clone()),
            _ => None,
        };
        self.status.send_if_modified(|s| {
            let mut changed = false;
            if !s.agent.same_kind(&state) {
                tracing::info!(event = "agent_state", state = %state, "agent state");
                s.agent = state;
                changed = true;
            }
            if s.proxy != *proxy {
                s.proxy = proxy.clone();
                changed = true;
            }
            if s.drain != drain {
                s.drain = drain;
                changed = true;
            }
            if s.crashes != *crashes {
                s.crashes = crashes.clone();
                changed = true;
            }
            changed
        });
    }

    /// How long after the drain starts Envoy is stopped at the latest. Exit-on-zero counts
    /// from the minimum drain duration until zero; the termination drain duration caps it only
    /// when it is longer than the minimum (else nothing would ever be counted).
    fn drain_deadline(&self) -> Option<Duration> {
        let c = &self.config;
        match c.exit_on_zero {
            None => Some(c.termination_drain_duration),
            Some(_) if c.termination_drain_duration > c.minimum_drain_duration => {
                Some(c.termination_drain_duration)
            }
            Some(_) => None,
        }
    }

    fn begin_shutdown(&self, reason: DrainReason) -> Shutdown {
        let now = Instant::now();
        let drain_at = now + self.config.drain_delay;
        tracing::info!(
            %reason,
            drain_delay = ?self.config.drain_delay,
            termination_drain_duration = ?self.config.termination_drain_duration,
            exit_on_zero = self.config.exit_on_zero.map(Counting::name),
            "shutting down: draining envoy"
        );
        Shutdown {
            reason,
            drain_at,
            drain: DrainAsk::Due,
            count_from: drain_at + self.config.minimum_drain_duration,
            next_count: drain_at + self.config.minimum_drain_duration,
            deadline: self.drain_deadline().map(|d| drain_at + d),
            stats_errors: 0,
            last_count: None,
            progress: DrainProgress {
                reason,
                started: SystemTime::now(),
                deadline: self
                    .drain_deadline()
                    .map(|d| SystemTime::now() + self.config.drain_delay + d),
                counting: self.config.exit_on_zero,
                last_count: None,
            },
        }
    }

    /// The next moment the loop has something to do on its own.
    fn next_wake(&self, mode: &Mode, counting: bool) -> Option<Instant> {
        match mode {
            Mode::HandingOver { until, .. } => Some(*until),
            Mode::Recovering { next_at, .. } => Some(*next_at),
            Mode::ShuttingDown(s) => {
                let mut wake = s.deadline;
                let mut consider = |t: Instant| wake = Some(wake.map_or(t, |w| w.min(t)));
                match &s.drain {
                    DrainAsk::Due => consider(s.drain_at),
                    DrainAsk::Failed { retry_at, .. } => consider(*retry_at),
                    DrainAsk::InFlight { .. } | DrainAsk::Accepted => {}
                }
                if self.config.exit_on_zero.is_some() && s.drain != DrainAsk::Due && !counting {
                    consider(s.next_count.max(s.count_from));
                }
                wake
            }
            _ => None,
        }
    }

    fn run_future(
        &self,
        abort: &CancellationToken,
    ) -> Pin<Box<dyn Future<Output = Result<Ended, ProxyError>> + Send>> {
        let (proxy, abort) = (self.proxy.clone(), abort.clone());
        Box::pin(async move { proxy.run(abort).await })
    }

    /// Logs and counts a crash and what the agent does about it.
    fn report_crash(&self, crash: &Crash, crashes: &Crashes) {
        let (epoch, pid) = crash.process.unzip();
        let limit = crashes.recovery.map_or(0, |r| r.limit);
        let what = match crash.action {
            CrashAction::Restart { attempt, backoff } => format!(
                "starting it again in {backoff:?} (restart {attempt} of at most {limit} in a row)"
            ),
            CrashAction::GiveUp => {
                format!("{limit} restarts in a row did not help: giving up")
            }
        };
        let (attempt, backoff_ms) = match crash.action {
            CrashAction::Restart { attempt, backoff } => {
                (Some(attempt), Some(backoff.as_millis() as u64))
            }
            CrashAction::GiveUp => (None, None),
        };
        tracing::error!(
            event = "envoy_crashed",
            kind = crash.kind.as_str(),
            code = crash.code,
            signal = crash.signal,
            epoch,
            pid,
            ran_for_ms = crash.ran_for.map(|d| d.as_millis() as u64),
            action = crash.action.as_str(),
            attempt,
            backoff_ms,
            consecutive = crashes.consecutive,
            limit,
            "envoy crashed (exit {}): {what}; the end of its stderr:\n{}",
            crash.code,
            crash.stderr_tail
        );
        self.metrics
            .crash(crash.kind.as_str(), crash.action.as_str());
    }

    fn successor_future(&self) -> Pin<Box<dyn Future<Output = Option<String>> + Send>> {
        let proxy = self.proxy.clone();
        Box::pin(async move {
            tokio::time::timeout(SUCCESSOR_TIMEOUT, proxy.successor())
                .await
                .unwrap_or_else(|_| {
                    tracing::warn!(bound = ?SUCCESSOR_TIMEOUT, "no answer whether a successor takes over: draining");
                    None
                })
        })
    }

    fn drain_future(
        &self,
        options: DrainOptions,
    ) -> Pin<Box<dyn Future<Output = Result<(), ProxyError>> + Send>> {
        let proxy = self.proxy.clone();
        Box::pin(async move { proxy.drain(options).await })
    }

    /// Whether exit-on-zero counts from the kernel's socket table (connections, excluded by
    /// port only) rather than Envoy's stats.
    fn counts_from_kernel(&self) -> bool {
        self.counter.is_none()
            && self.config.exit_on_zero == Some(Counting::Connections)
            && self.config.exclusions.by_port_only()
    }

    fn count_future(&self) -> Pin<Box<dyn Future<Output = Result<u64, DrainError>> + Send>> {
        if let Some(counter) = &self.counter {
            return counter();
        }
        let admin = self
            .proxy
            .admin_address()
            .map(|a| AdminClient::new(a).with_timeout(self.config.stats_timeout));
        let exclusions = self.config.exclusions.clone();
        let what = self.config.exit_on_zero.unwrap_or(Counting::Connections);
        // Connections from the kernel: nothing asked of Envoy's main thread.
        if self.counts_from_kernel() {
            let pids: Vec<u32> = self
                .proxy
                .state()
                .borrow()
                .epochs
                .iter()
                .map(|e| e.pid)
                .collect();
            let admin_port = admin.as_ref().map(|a| a.addr().port());
            return Box::pin(async move {
                envoy_agent_drain::active_connections_from_kernel(pids, admin_port, &exclusions)
                    .await
            });
        }
        Box::pin(async move {
            let admin = admin.ok_or(DrainError::AdminUnknown)?;
            envoy_agent_drain::active(&admin, what, &exclusions).await
        })
    }

    /// Runs a proxy call beside the loop and answers `reply` with its result.
    fn spawn_reply<T, F, Fut>(&self, reply: Option<Reply<T>>, call: F)
    where
        T: Send + 'static,
        F: FnOnce(Arc<P>) -> Fut,
        Fut: Future<Output = Result<T, AgentError>> + Send + 'static,
    {
        let future = call(self.proxy.clone());
        tokio::spawn(async move {
            let result = future.await;
            if let Some(reply) = reply {
                let _ = reply.send(result);
            }
        });
    }
}

/// Why nothing runs while the agent recovers from a crash.
const RECOVERING: &str = "no envoy runs: the agent is recovering from a crash";

/// Why a hot restart or config update is refused in `mode`.
fn refusal(mode: &Mode) -> RestartError {
    RestartError::Refused(match mode {
        Mode::Recovering { .. } => RECOVERING.to_owned(),
        _ => "the agent is draining or stopping".to_owned(),
    })
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn log_ended(ended: &Ended) {
    use std::os::unix::process::ExitStatusExt;
    match ended {
        Ended::Stopped { last: Some(exit) } => {
            tracing::info!(pid = exit.pid, code = exit.code(), ran_for = ?exit.ran_for, "envoy stopped");
        }
        Ended::Stopped { last: None } => tracing::info!("every envoy stopped"),
        Ended::Exited(exit) if exit.code() == 0 => {
            tracing::info!(pid = exit.pid, ran_for = ?exit.ran_for, "envoy exited");
        }
        Ended::Exited(exit) | Ended::Lost { exit, .. } => {
            let code = exit.code();
            let hint = match exit.status.signal() {
                Some(9) => " (SIGKILL: it may have been OOM-killed)",
                _ => "",
            };
            tracing::error!(
                pid = exit.pid,
                code,
                ran_for = ?exit.ran_for,
                "envoy exited with code {code}{hint}; the end of its stderr:\n{}",
                exit.stderr_tail.trim_end()
            );
        }
        Ended::StartFailed { code, message } => {
            tracing::error!(code, error = %message, "envoy failed to start");
        }
        Ended::Wedged { reason, message } => {
            tracing::error!(%reason, error = %message, "wedged");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Call, FakeProxy, epoch, exit};
    use envoy_agent_proxy::{EpochState, FamilyState};

    struct Harness {
        proxy: Arc<FakeProxy>,
        handle: AgentHandle,
        intents: mpsc::Sender<Intent>,
        task: tokio::task::JoinHandle<AgentExit>,
        started: Instant,
    }

    fn start(proxy: FakeProxy, config: AgentConfig) -> Harness {
        let proxy = Arc::new(proxy);
        let (agent, handle) = Agent::new(proxy.clone(), config);
        let (intents, source) = mpsc::channel(4);
        Harness {
            proxy,
            handle,
            intents,
            task: tokio::spawn(agent.run(source)),
            started: Instant::now(),
        }
    }

    impl Harness {
        async fn signal(&self, intent: Intent) {
            self.intents.send(intent).await.unwrap();
        }

        /// Waits (paused time: instantly) until the agent's state satisfies `check`.
        async fn state(&self, check: impl Fn(&AgentState) -> bool) {
            let mut status = self.handle.status();
            status.wait_for(|s| check(&s.agent)).await.unwrap();
        }

        async fn exit(self) -> (AgentExit, Arc<FakeProxy>, Instant) {
            let exit = self.task.await.unwrap();
            (exit, self.proxy, self.started)
        }
    }

    fn config() -> AgentConfig {
        AgentConfig::default()
    }

    fn without_successor(calls: Vec<Call>) -> Vec<Call> {
        calls
            .into_iter()
            .filter(|c| *c != Call::Successor)
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn live_follows_the_proxy_state() {
        let h = start(FakeProxy::default(), config());
        assert_eq!(h.handle.state().name(), "starting");
        h.proxy.go_live();
        h.state(AgentState::serving).await;
        h.handle.quit(Via::Http).await.unwrap();
        h.exit().await;
    }

    #[tokio::test(start_paused = true)]
    async fn sigterm_drains_then_stops_after_the_termination_drain_duration() {
        let h = start(FakeProxy::default(), config());
        h.proxy.go_live();
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
        assert_eq!(exit.code(), 0);
        assert_eq!(
            proxy.calls(),
            [
                Call::Successor,
                Call::Drain { skip_exit: false },
                Call::Stop
            ],
            "asked about a successor first, then drained and stopped"
        );
        let stopped = proxy.stopped_at().unwrap() - started;
        assert_eq!(stopped.as_secs(), 5, "stopped after {stopped:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn envoy_exiting_during_the_drain_ends_the_wait_with_its_code() {
        let h = start(FakeProxy::default(), config());
        h.signal(Intent::Terminate).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        h.proxy.exit_on_its_own(0);
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::ProxyExited { code: 0 });
        assert_eq!(
            without_successor(proxy.calls()),
            [Call::Drain { skip_exit: false }]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn envoy_exiting_on_its_own_passes_its_code_on() {
        let h = start(FakeProxy::default(), config());
        tokio::time::sleep(Duration::from_secs(3)).await;
        h.proxy.exit_on_its_own(3);
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::ProxyExited { code: 3 });
        assert_eq!(exit.code(), 3);
        assert!(proxy.calls().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_signal_during_the_drain_stops_at_once() {
        let h = start(FakeProxy::default(), config());
        h.signal(Intent::Terminate).await;
        h.state(|s| {
            matches!(
                s,
                AgentState::Draining {
                    phase: DrainPhase::Draining,
                    ..
                }
            )
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        h.signal(Intent::Interrupt).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::SecondSignal);
        assert_eq!(
            (proxy.stopped_at().unwrap() - started).as_millis(),
            500,
            "stopped when the second signal came"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn drain_request_keeps_running_and_the_next_sigterm_stops_at_once() {
        let h = start(FakeProxy::default(), config());
        h.proxy.go_live();
        h.handle.drain_now(Via::Http).await.unwrap();
        // Resolved once applied: the state says so already.
        assert!(matches!(
            h.handle.state(),
            AgentState::Draining {
                reason: DrainReason::Request(Via::Http),
                ..
            }
        ));
        // Draining "forever": an hour later Envoy still runs.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert_eq!(h.proxy.calls(), [Call::Drain { skip_exit: true }]);
        // After a drain request, the proxy answers hot restarts itself (a family refuses).
        let answer = h.handle.hot_restart("x".to_owned()).await.unwrap_err();
        assert!(
            matches!(answer, AgentError::Restart(RestartError::Unsupported)),
            "{answer}"
        );
        let before = Instant::now();
        h.signal(Intent::Terminate).await;
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::SignalAfterDrain);
        assert_eq!(proxy.calls(), [Call::Drain { skip_exit: true }, Call::Stop]);
        assert_eq!(proxy.stopped_at().unwrap(), before);
    }

    #[tokio::test(start_paused = true)]
    async fn quitquitquit_stops_without_draining_and_resolves_once_applied() {
        let h = start(FakeProxy::default(), config());
        h.handle.quit(Via::Grpc).await.unwrap();
        assert!(
            matches!(
                h.handle.state(),
                AgentState::Exiting {
                    path: ExitPath::QuitQuitQuit(Via::Grpc),
                    ..
                }
            ),
            "{:?}",
            h.handle.state()
        );
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::QuitQuitQuit(Via::Grpc));
        assert_eq!(exit.code(), 0);
        assert_eq!(proxy.calls(), [Call::Stop]);
    }

    #[tokio::test(start_paused = true)]
    async fn disable_draining_makes_sigterm_stop_at_once() {
        let h = start(FakeProxy::default(), config());
        h.handle.disable_draining().await.unwrap();
        h.signal(Intent::Terminate).await;
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::SignalAfterDrain);
        assert_eq!(proxy.calls(), [Call::Stop]);
    }

    #[tokio::test(start_paused = true)]
    async fn drain_delay_reports_not_ready_before_draining() {
        let mut c = config();
        c.drain_delay = Duration::from_secs(3);
        let h = start(FakeProxy::default(), c);
        h.proxy.go_live();
        h.signal(Intent::Terminate).await;
        h.state(|s| {
            matches!(
                s,
                AgentState::Draining {
                    phase: DrainPhase::Delay,
                    ..
                }
            )
        })
        .await;
        tokio::time::sleep(Duration::from_millis(2900)).await;
        assert_eq!(
            h.proxy.calls(),
            [Call::Successor],
            "no drain during the delay"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            without_successor(h.proxy.calls()),
            [Call::Drain { skip_exit: false }]
        );
        assert!(matches!(
            h.handle.state(),
            AgentState::Draining {
                phase: DrainPhase::Draining,
                ..
            }
        ));
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
        // Delay plus the termination drain duration.
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 8);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_drain_call_does_not_extend_the_deadline() {
        let proxy = FakeProxy {
            hang_drain: true,
            ..FakeProxy::default()
        };
        let h = start(proxy, config());
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        // Never answered, so never accepted: the exit says so rather than claim a drain.
        assert_eq!(exit.path, ExitPath::DrainFailed);
        assert_eq!(exit.path.code(), 1);
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
    }

    /// A zero termination drain duration stops Envoy as the drain request goes out: it is
    /// unanswered, not refused, and the exit says the drain time elapsed (code 0).
    #[tokio::test(start_paused = true)]
    async fn a_drain_request_just_sent_at_the_deadline_is_no_failure() {
        let mut c = config();
        c.termination_drain_duration = Duration::ZERO;
        let proxy = FakeProxy {
            hang_drain: true,
            ..FakeProxy::default()
        };
        let h = start(proxy, c);
        h.signal(Intent::Terminate).await;
        let (exit, _, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
        assert_eq!(exit.path.code(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_drain_request_is_sent_again_until_envoy_accepts_it() {
        let proxy = FakeProxy {
            drain_failures: std::sync::Mutex::new(2),
            ..FakeProxy::default()
        };
        let h = start(proxy, config());
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
        assert_eq!(exit.path.code(), 0);
        let drains = without_successor(proxy.calls())
            .iter()
            .filter(|c| matches!(c, Call::Drain { .. }))
            .count();
        assert_eq!(drains, 3, "{:?}", proxy.calls());
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_request_that_always_fails_is_reported_as_such() {
        let proxy = FakeProxy {
            drain_failures: std::sync::Mutex::new(u32::MAX),
            ..FakeProxy::default()
        };
        let h = start(proxy, config());
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainFailed);
        assert_eq!(exit.path.name(), "drain_failed");
        assert_eq!(exit.path.code(), 1);
        // Sent again each second until the deadline (5 s).
        let drains = without_successor(proxy.calls())
            .iter()
            .filter(|c| matches!(c, Call::Drain { .. }))
            .count();
        assert!(drains >= 4, "{:?}", proxy.calls());
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_gives_up_after_the_stats_error_budget() {
        // The fake has no admin API: every count fails.
        let mut c = config();
        c.exit_on_zero = Some(Counting::Connections);
        c.termination_drain_duration = Duration::from_secs(60);
        let h = start(FakeProxy::default(), c);
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::StatsUnavailable(Counting::Connections));
        let stopped = proxy.stopped_at().unwrap() - started;
        // Minimum drain (5s), then five failures 50ms apart.
        assert!(
            stopped >= Duration::from_secs(5) && stopped < Duration::from_secs(6),
            "{stopped:?}"
        );
    }

    /// A count that takes Envoy a second (its stats, on a large config) is asked at most every
    /// 20 s: 1/20 of its main thread.
    #[tokio::test(start_paused = true)]
    async fn a_costly_count_is_asked_less_often() {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = calls.clone();
        let counter: Counter = Arc::new(move || {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async {
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok(5)
            })
        });
        let mut c = config();
        c.exit_on_zero = Some(Counting::Connections);
        c.termination_drain_duration = Duration::from_secs(65);
        let proxy = Arc::new(FakeProxy::default());
        let (agent, handle) = Agent::new(proxy.clone(), c);
        let agent = agent.with_counter(counter);
        let (intents, source) = mpsc::channel(4);
        let h = Harness {
            proxy,
            handle,
            intents,
            task: tokio::spawn(agent.run(source)),
            started: Instant::now(),
        };
        h.signal(Intent::Terminate).await;
        let (exit, _, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainDeadline(Counting::Connections));
        // From the minimum drain (5 s) to the deadline (65 s): at 0, 20, 40 and 60 s.
        let n = calls.load(std::sync::atomic::Ordering::SeqCst);
        assert!((3..=4).contains(&n), "counted {n} times");
    }

    /// A counter answering from a script: one count per call, then the last one forever.
    fn counts(script: &[u64]) -> (Counter, Arc<std::sync::atomic::AtomicUsize>) {
        let script: Arc<Vec<u64>> = Arc::new(script.to_vec());
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = calls.clone();
        let counter: Counter = Arc::new(move || {
            let i = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let n = script[i.min(script.len() - 1)];
            Box::pin(async move { Ok(n) })
        });
        (counter, seen)
    }

    fn start_counting(
        config: AgentConfig,
        script: &[u64],
    ) -> (Harness, Arc<std::sync::atomic::AtomicUsize>) {
        let proxy = Arc::new(FakeProxy::default());
        let (counter, calls) = counts(script);
        let (agent, handle) = Agent::new(proxy.clone(), config);
        let agent = agent.with_counter(counter);
        let (intents, source) = mpsc::channel(4);
        (
            Harness {
                proxy,
                handle,
                intents,
                task: tokio::spawn(agent.run(source)),
                started: Instant::now(),
            },
            calls,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_at_its_defaults_counts_after_the_minimum_until_zero() {
        // Istio's defaults: 5s minimum, 5s termination drain duration. Nothing would ever be
        // counted if that were a deadline; it is not: counting goes on until zero.
        let mut c = config();
        c.exit_on_zero = Some(Counting::Connections);
        let (h, calls) = start_counting(c, &[3, 3, 2, 1, 1, 0]);
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::ZeroActive(Counting::Connections));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 6);
        let stopped = proxy.stopped_at().unwrap() - started;
        // The minimum, then five 50 ms polls.
        assert_eq!(stopped, Duration::from_millis(5250), "{stopped:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_with_no_connection_at_all_stops_at_the_minimum() {
        let mut c = config();
        c.exit_on_zero = Some(Counting::Connections);
        let (h, _) = start_counting(c, &[0]);
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(
            exit.path,
            ExitPath::ZeroActive(Counting::Connections),
            "not the deadline"
        );
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_longer_termination_drain_duration_is_a_hard_deadline_on_counted_connections() {
        let mut c = config();
        c.exit_on_zero = Some(Counting::Connections);
        c.minimum_drain_duration = Duration::from_secs(2);
        c.termination_drain_duration = Duration::from_secs(7);
        let (h, calls) = start_counting(c, &[4]);
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(
            exit.path,
            ExitPath::DrainDeadline(Counting::Connections),
            "connections were counted"
        );
        assert!(calls.load(std::sync::atomic::Ordering::SeqCst) > 50);
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 7);
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_requests_names_requests_in_its_progress_and_exit_paths() {
        let mut c = config();
        c.exit_on_zero = Some(Counting::Requests);
        c.minimum_drain_duration = Duration::from_secs(1);
        c.termination_drain_duration = Duration::from_secs(3);
        let (h, _) = start_counting(c.clone(), &[2, 2, 1, 0]);
        let mut status = h.handle.status();
        h.signal(Intent::Terminate).await;
        let progress = status
            .wait_for(|s| s.drain.as_ref().is_some_and(|d| d.last_count.is_some()))
            .await
            .unwrap()
            .drain
            .clone()
            .unwrap();
        assert_eq!(progress.counting, Some(Counting::Requests));
        assert_eq!(progress.last_count.map(|(n, _)| n), Some(2));
        let (exit, _, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::ZeroActive(Counting::Requests));
        assert_eq!(exit.path.name(), "zero_requests");

        let (h, _) = start_counting(c, &[1]);
        h.signal(Intent::Terminate).await;
        let (exit, _, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainDeadline(Counting::Requests));
        assert_eq!(exit.path.counting(), Some(Counting::Requests));
    }

    #[tokio::test(start_paused = true)]
    async fn without_exit_on_zero_the_drain_reports_no_count() {
        let h = start(FakeProxy::default(), config());
        let mut status = h.handle.status();
        h.signal(Intent::Terminate).await;
        let progress = status
            .wait_for(|s| s.drain.is_some())
            .await
            .unwrap()
            .drain
            .clone()
            .unwrap();
        assert_eq!((progress.counting, progress.last_count), (None, None));
        let (exit, _, _) = h.exit().await;
        assert_eq!(exit.path.counting(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_never_claims_uncounted_connections() {
        // Counts fail (no admin): the deadline ends the wait, and says the time elapsed.
        let mut c = config();
        c.exit_on_zero = Some(Counting::Connections);
        c.minimum_drain_duration = Duration::from_secs(1);
        c.termination_drain_duration = Duration::from_millis(1100);
        let h = start(FakeProxy::default(), c);
        h.signal(Intent::Terminate).await;
        let (exit, _, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    }

    #[tokio::test(start_paused = true)]
    async fn sigterm_with_a_successor_waits_for_it_to_terminate_our_envoy() {
        let proxy = FakeProxy::default();
        *proxy.successor.lock().unwrap() = Some("pod-b".to_owned());
        let family = FamilyState {
            successor_starting: Some("pod-b".to_owned()),
            ..FamilyState::default()
        };
        proxy.set(
            ProxyPhase::Serving,
            vec![epoch(3, EpochState::Live)],
            Some(family.clone()),
        );
        let h = start(proxy, config());
        h.signal(Intent::Terminate).await;
        h.state(|s| matches!(s, AgentState::HandingOver { successor, .. } if successor == "pod-b"))
            .await;
        // Well past the drain duration: no drain of ours, Envoy not stopped.
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(h.proxy.calls(), [Call::Successor]);
        // The successor took over and its Envoy terminated ours.
        h.proxy.set(
            ProxyPhase::HandedOver,
            vec![epoch(3, EpochState::Draining)],
            Some(family.clone()),
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(h.proxy.calls(), [Call::Successor], "ours still drains");
        h.proxy.set(ProxyPhase::HandedOver, vec![], Some(family));
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::HandedOver);
        assert_eq!(exit.code(), 0);
        assert_eq!(proxy.calls(), [Call::Successor, Call::Stop]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_successor_that_goes_away_falls_back_to_our_own_drain() {
        let proxy = FakeProxy::default();
        *proxy.successor.lock().unwrap() = Some("pod-b".to_owned());
        let starting = FamilyState {
            successor_starting: Some("pod-b".to_owned()),
            ..FamilyState::default()
        };
        proxy.set(
            ProxyPhase::Serving,
            vec![epoch(3, EpochState::Live)],
            Some(starting),
        );
        let h = start(proxy, config());
        h.signal(Intent::Terminate).await;
        h.state(|s| matches!(s, AgentState::HandingOver { .. }))
            .await;
        // The successor's pre-flight failed; its heartbeat is gone.
        h.proxy.set(
            ProxyPhase::Serving,
            vec![epoch(3, EpochState::Live)],
            Some(FamilyState::default()),
        );
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
        assert_eq!(
            proxy.calls(),
            [
                Call::Successor,
                Call::Drain { skip_exit: false },
                Call::Stop
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_handover_wait_is_bounded() {
        let proxy = FakeProxy::default();
        *proxy.successor.lock().unwrap() = Some("pod-b".to_owned());
        proxy.set(
            ProxyPhase::HandedOver,
            vec![epoch(3, EpochState::Draining)],
            Some(FamilyState::default()),
        );
        let mut c = config();
        c.handover_timeout = Duration::from_secs(40);
        let h = start(proxy, c);
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::HandoverTimedOut);
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 40);
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_waits_for_a_draining_parent() {
        // A count of zero while a hot-restart parent still drains its own connections is not
        // zero yet: the fake has no admin, so the counts fail; with the parent gone, the
        // budget ends the wait. Here the check is on the decision input: a parent draining.
        let state = ProxyState {
            epochs: vec![epoch(1, EpochState::Draining), epoch(2, EpochState::Live)],
            ..ProxyState::starting()
        };
        assert!(state.parent_draining());
        let state = ProxyState {
            epochs: vec![epoch(2, EpochState::Live)],
            ..ProxyState::starting()
        };
        assert!(!state.parent_draining());
    }

    fn recovering(limit: u32) -> AgentConfig {
        AgentConfig {
            crash_recovery: Some(CrashRecovery {
                limit,
                backoff: Duration::from_secs(1),
                backoff_max: Duration::from_secs(3),
                stable_after: Duration::from_secs(60),
            }),
            ..config()
        }
    }

    impl Harness {
        /// Waits until the proxy has been run `n` times, and returns when each run started.
        async fn runs(&self, n: usize) -> Vec<Instant> {
            while self.proxy.runs().len() < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            self.proxy.runs()
        }

        fn crashes(&self) -> Crashes {
            self.handle.status().borrow().crashes.clone()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_crash_loop_backs_off_exponentially_and_gives_up_at_the_limit() {
        let h = start(FakeProxy::default(), recovering(3));
        h.proxy.go_live();
        h.state(AgentState::serving).await;
        h.proxy.end_with(Ended::Exited(crate::testing::killed(9)));
        h.state(|s| matches!(s, AgentState::Recovering { attempt: 1, .. }))
            .await;
        assert!(!h.handle.status().borrow().agent.serving(), "not ready");
        let answer = h.handle.hot_restart("x".to_owned()).await.unwrap_err();
        assert!(
            matches!(&answer, AgentError::Restart(RestartError::Refused(m)) if m.contains("recovering")),
            "{answer}"
        );
        // Every restart fails to start.
        for n in 2..=4 {
            h.runs(n).await;
            h.proxy.end_with(Ended::StartFailed {
                code: 1,
                message: "bad config".to_owned(),
            });
        }
        let status = h.handle.status();
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::CrashLoop { code: 1 });
        assert_eq!(exit.code(), 1, "the last crash's code");
        let gaps: Vec<u64> = proxy
            .runs()
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs())
            .collect();
        assert_eq!(gaps, [1, 2, 3], "1 s doubling, capped at 3 s");
        assert_eq!(proxy.runs()[0], started);
        assert!(proxy.calls().is_empty(), "nothing was asked of envoy");
        let crashes = status.borrow().crashes.clone();
        assert_eq!((crashes.consecutive, crashes.total), (4, 4));
        let actions: Vec<&str> = crashes.recent.iter().map(|c| c.action.as_str()).collect();
        assert_eq!(actions, ["restart", "restart", "restart", "give_up"]);
        assert!(matches!(
            status.borrow().agent,
            AgentState::Exiting {
                path: ExitPath::CrashLoop { code: 1 },
                ..
            }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn each_crash_is_in_the_status_with_its_code_signal_and_stderr() {
        let h = start(FakeProxy::default(), recovering(1));
        h.proxy.go_live();
        h.state(AgentState::serving).await;
        h.proxy.end_with(Ended::Exited(crate::testing::killed(9)));
        h.runs(2).await;
        let crashes = h.crashes();
        assert_eq!((crashes.consecutive, crashes.total), (1, 1));
        let crash = &crashes.recent[0];
        assert_eq!((crash.code, crash.signal), (137, Some(9)));
        assert_eq!(crash.stderr_tail, "killed");
        assert_eq!(
            crash.action,
            CrashAction::Restart {
                attempt: 1,
                backoff: Duration::from_secs(1)
            }
        );
        h.proxy.go_live();
        h.state(AgentState::serving).await;
        h.handle.quit(Via::Http).await.unwrap();
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::QuitQuitQuit(Via::Http));
        assert_eq!(
            proxy.calls(),
            [Call::Stop],
            "the restarted proxy was stopped"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_restart_that_stays_live_ends_the_streak() {
        let h = start(FakeProxy::default(), recovering(1));
        h.proxy.go_live();
        h.proxy.end_with(Ended::Exited(exit(139, false)));
        h.runs(2).await;
        h.proxy.go_live();
        tokio::time::sleep(Duration::from_secs(61)).await;
        assert_eq!(h.crashes().consecutive, 0, "forgotten once stable");
        h.proxy.end_with(Ended::Exited(exit(139, false)));
        h.runs(3).await;
        assert_eq!(h.crashes().consecutive, 1);
        // Not stable this time: the next crash is over the limit.
        h.proxy.go_live();
        tokio::time::sleep(Duration::from_secs(59)).await;
        h.proxy.end_with(Ended::Exited(exit(139, false)));
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::CrashLoop { code: 139 });
        assert_eq!(proxy.runs().len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn what_the_agent_asked_for_or_a_first_envoy_that_never_served_is_no_crash() {
        // Envoy exiting during the agent's own drain ends the agent, as without the flag.
        let h = start(FakeProxy::default(), recovering(5));
        h.proxy.go_live();
        h.signal(Intent::Terminate).await;
        h.state(AgentState::draining).await;
        h.proxy.end_with(Ended::Exited(crate::testing::killed(9)));
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::ProxyExited { code: 137 });
        assert_eq!(proxy.runs().len(), 1);

        // A bad bootstrap at start fails fast.
        let h = start(FakeProxy::default(), recovering(5));
        h.proxy.exit_on_its_own(1);
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::ProxyExited { code: 1 });
        assert_eq!(proxy.runs().len(), 1);

        // Envoy's own clean exit (its /quitquitquit) is not a crash either.
        let h = start(FakeProxy::default(), recovering(5));
        h.proxy.go_live();
        h.state(AgentState::serving).await;
        h.proxy.exit_on_its_own(0);
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::ProxyExited { code: 0 });
        assert_eq!(proxy.runs().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_during_the_backoff_exits_at_once_and_starts_nothing() {
        let h = start(FakeProxy::default(), recovering(5));
        h.proxy.go_live();
        h.state(AgentState::serving).await;
        h.proxy.end_with(Ended::Lost {
            exit: exit(0, false),
            message: "terminated from outside".to_owned(),
        });
        h.state(|s| matches!(s, AgentState::Recovering { .. }))
            .await;
        let drain = h.handle.drain_now(Via::Http).await.unwrap_err();
        assert!(matches!(drain, AgentError::DrainFailed(_)), "{drain}");
        let before = Instant::now();
        h.signal(Intent::Terminate).await;
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::StoppedWhileRecovering);
        assert_eq!(exit.code(), 0);
        assert_eq!(Instant::now(), before, "at once");
        assert_eq!(proxy.runs().len(), 1);
        assert!(proxy.calls().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn state_goes_exiting_with_the_path() {
        let h = start(FakeProxy::default(), config());
        let mut status = h.handle.status();
        h.handle.quit(Via::Http).await.unwrap();
        let (exit, _, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::QuitQuitQuit(Via::Http));
        status.changed().await.ok();
        assert!(matches!(
            status.borrow().agent,
            AgentState::Exiting {
                path: ExitPath::QuitQuitQuit(Via::Http),
                ..
            }
        ));
    }
}

//! What the agent is and says: its configuration, its state and status, why a drain started,
//! why it exits (each path with its exit code). Plain data; the actor in [`super::actor`]
//! decides.

use std::fmt;
use std::time::{Duration, SystemTime};

use envoy_agent_drain::{Counting, Exclusions, ListenerActivity};
use envoy_agent_proxy::{DrainPlan, Ended, ProxyError, ProxyState, WedgeReason};

use crate::crash::{CrashRecovery, Crashes};
use crate::signal::Intent;

/// `EX_SOFTWARE`: the proxy could not be run at all.
pub use crate::exit_code::SOFTWARE as EXIT_SOFTWARE;

/// How the agent drains and stops: a view of [`crate::Settings`] (`agent_config`) for the
/// actor. [`Default`] is `envoy-agent run`'s defaults, from [`crate::config::defaults`].
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
    /// On SIGTERM, the drain starts this long after the signal, so load balancers and
    /// endpoint lists drop the pod first (Istio #36660).
    pub drain_delay: Duration,
    /// On SIGTERM, readiness goes off this long after the signal.
    pub not_ready_at: Duration,
    /// On SIGTERM, when Envoy fails its health checks.
    pub fail_health_checks_at: crate::config::timeline::HealthCheckFailAt,
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
    /// A sidecar's app rule (`--app-hold`): while the app holds connections to Envoy's
    /// outbound listeners, Envoy keeps serving them, for at most this long after the signal;
    /// none: off (a node proxy, `--app-hold off`).
    pub app_hold: Option<Duration>,
}

impl Default for AgentConfig {
    /// The defaults of `envoy-agent run` without flags (in sidecar mode).
    fn default() -> Self {
        use crate::config::defaults;
        AgentConfig {
            termination_drain_duration: defaults::TERMINATION_DRAIN_DURATION,
            minimum_drain_duration: defaults::MINIMUM_DRAIN_DURATION,
            exit_on_zero: None,
            drain_delay: Duration::ZERO,
            not_ready_at: Duration::ZERO,
            fail_health_checks_at: crate::config::timeline::HealthCheckFailAt::Drain,
            exclusions: Exclusions::with_ports(defaults::EXCLUDED_LISTENER_PORTS),
            poll_interval: defaults::DRAIN_POLL_INTERVAL,
            stats_timeout: defaults::STATS_TIMEOUT,
            stats_error_budget: defaults::STATS_ERROR_BUDGET,
            handover_timeout: defaults::handover_timeout(
                defaults::HANDOFF_DEADLINE,
                defaults::PARENT_SHUTDOWN_TIME,
            ),
            crash_recovery: None,
            app_hold: Some(defaults::APP_HOLD),
        }
    }
}

impl AgentConfig {
    /// How long after the drain starts (after the drain delay) Envoy is stopped at the
    /// latest. Exit-on-zero counts from the minimum drain duration until zero; the
    /// termination drain duration caps it only when it is longer than the minimum (else
    /// nothing would ever be counted): then there is no deadline (Istio's behaviour).
    pub fn drain_deadline(&self) -> Option<Duration> {
        crate::config::timeline::drain_deadline(
            self.exit_on_zero,
            self.termination_drain_duration,
            self.minimum_drain_duration,
        )
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
    /// A shutdown signal: SIGTERM or SIGINT.
    Signal(Intent),
    /// gRPC `Stop` (`envoy-agent stop`): the SIGTERM path, asked by a controller.
    Stop,
    /// A drain request (`POST /drain`, gRPC `Drain`): Envoy keeps running.
    Request(Via),
}

impl fmt::Display for DrainReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DrainReason::Signal(intent) => f.write_str(intent.signal_name()),
            DrainReason::Stop => f.write_str("gRPC Stop"),
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
    /// Envoy was OOM-killed: SIGKILL, and its container's OOM-kill count rose.
    OomKilled {
        /// The container's memory limit, when known.
        limit: Option<u64>,
    },
    /// A sidecar's app let go of Envoy's outbound listeners (it exited, or closed its
    /// connections): nothing Envoy serves is needed any more.
    AppDone,
    /// A sidecar's app still held connections to Envoy's outbound listeners when `--app-hold`
    /// ran out.
    AppHoldElapsed,
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
            ExitPath::AppDone => f.write_str("the app's outbound connections closed"),
            ExitPath::OomKilled { limit } => {
                write!(
                    f,
                    "envoy was {}",
                    envoy_agent_proxy::OomKill { limit: *limit }
                )
            }
            ExitPath::AppHoldElapsed => {
                f.write_str("the app still held outbound connections when --app-hold ran out")
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
            ExitPath::Wedged { .. } => crate::exit_code::WEDGED,
            // 128 + SIGKILL, as Envoy's own code would be.
            ExitPath::OomKilled { .. } => 137,
            ExitPath::ProxyFailed => crate::exit_code::SOFTWARE,
            // Stopped as asked, but not gracefully: no success to report.
            ExitPath::DrainFailed => crate::exit_code::FAILURE,
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
            ExitPath::AppDone => "app_done",
            ExitPath::OomKilled { .. } => "oom_killed",
            ExitPath::AppHoldElapsed => "app_hold_elapsed",
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
        /// Still ready: the shutdown's timeline turns readiness off later (`--not-ready-at`).
        ready: bool,
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
                phase,
                ready,
                ..
            } => {
                let still = if *ready { "; still ready" } else { "" };
                match phase {
                    DrainPhase::Deciding => {
                        write!(f, "stopping ({reason}; is a successor taking over?{still})")
                    }
                    DrainPhase::Delay => write!(f, "draining soon ({reason}; drain delay{still})"),
                    DrainPhase::Draining => write!(f, "draining ({reason}{still})"),
                }
            }
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
    /// stopping, or a shutdown whose timeline keeps readiness on for now (`--not-ready-at`).
    /// What readiness and gRPC health report (a hot-restart handoff is not a drain: the
    /// serving epoch serves through it).
    pub fn serving(&self) -> bool {
        matches!(
            self,
            AgentState::Live { .. } | AgentState::Draining { ready: true, .. }
        )
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

    pub(super) fn same_kind(&self, other: &AgentState) -> bool {
        match (self, other) {
            (AgentState::Starting { .. }, AgentState::Starting { .. })
            | (AgentState::Live { .. }, AgentState::Live { .. }) => true,
            (
                AgentState::Draining {
                    reason,
                    phase,
                    ready,
                    ..
                },
                AgentState::Draining {
                    reason: r,
                    phase: p,
                    ready: s,
                    ..
                },
            ) => reason == r && phase == p && ready == s,
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
    /// Exit-on-zero: what each counted listener still held at the last reading of Envoy's
    /// stats (paced by its cost), busiest first, and when it was read; none before the first.
    pub listeners: Option<(Vec<ListenerActivity>, SystemTime)>,
    /// What the drain reached, once Envoy accepted it: the listeners drained, by their
    /// configured names, and why those.
    pub drained: Option<DrainPlan>,
    /// A sidecar's app rule: whether the app still holds connections to Envoy's outbound
    /// listeners; none where the rule is off or has nothing to watch.
    pub app: Option<AppWatch>,
    /// Whether the timeline ends in a stop (a signal, gRPC `Stop`); a drain request's keeps
    /// Envoy serving until a signal continues it.
    pub stops: bool,
}

/// What a sidecar's app rule saw last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppWatch {
    /// Not known yet (Envoy's outbound listeners are being read, or not asked yet).
    Unknown,
    /// Not seen holding any connection to an outbound listener since the signal: nothing
    /// is held for it.
    NotSeen,
    /// It holds connections to Envoy's outbound listeners: Envoy keeps serving them, until
    /// the time given at the latest (`--app-hold`).
    Holding {
        /// When the hold ends at the latest.
        until: SystemTime,
    },
    /// It let go (it exited, or closed its connections): Envoy stops.
    LetGo,
}

impl AppWatch {
    /// `unknown`, `not_seen`, `holding`, `let_go`.
    pub fn name(self) -> &'static str {
        match self {
            AppWatch::Unknown => "unknown",
            AppWatch::NotSeen => "not_seen",
            AppWatch::Holding { .. } => "holding",
            AppWatch::LetGo => "let_go",
        }
    }
}

/// How the agent's run ended; [`AgentExit::code`] is the process exit code.
#[derive(Debug)]
pub struct AgentExit {
    /// Why.
    pub path: ExitPath,
    /// What started the shutdown, when one did.
    pub reason: Option<DrainReason>,
    /// From the shutdown's start (or the stop, when nothing drained first) until every Envoy
    /// was reaped; none when the agent was not asked to stop.
    pub took: Option<Duration>,
    /// Exit-on-zero: what each counted listener still held at the last reading before the
    /// stop; none when never read.
    pub still_open: Option<Vec<ListenerActivity>>,
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

    /// Envoy's own reason, when it ended by itself with an error: a failed start's message,
    /// or the last lines of a crashed Envoy's stderr.
    pub fn envoy_said(&self) -> Option<String> {
        let last_lines = |tail: &str| {
            let lines: Vec<&str> = tail.lines().filter(|l| !l.trim().is_empty()).collect();
            lines[lines.len().saturating_sub(2)..].join("\n")
        };
        match self.ended.as_ref()? {
            Ended::StartFailed { message, .. } | Ended::Wedged { message, .. } => {
                Some(message.clone())
            }
            Ended::Exited(exit) | Ended::Lost { exit, .. } if exit.code() != 0 => {
                Some(last_lines(&exit.stderr_tail))
            }
            _ => None,
        }
        .filter(|s| !s.trim().is_empty())
    }
}

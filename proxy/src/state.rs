//! What a [`crate::Proxy`] publishes about itself: one typed state, read by the agent (its
//! exit paths and readiness), the status server, gRPC and metrics alike.
//!
//! A single Envoy is a family of one epoch that never hot-restarts; a hot-restart family adds
//! [`FamilyState`] (handoffs, wedges, cross-pod facts). Nothing here is a string that callers
//! must parse: states and reasons are enums, times are `SystemTime`s.

use std::fmt;
use std::time::{Duration, SystemTime};

pub use crate::control_plane::ConfigStatus;

/// Where an Envoy process (one restart epoch) is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpochState {
    /// Started, not LIVE yet.
    Starting,
    /// LIVE and the newest: it serves.
    Live,
    /// A parent handing over to its child: it drains until the child terminates it.
    Draining,
}

impl EpochState {
    /// `starting`, `live`, `draining`.
    pub fn as_str(self) -> &'static str {
        match self {
            EpochState::Starting => "starting",
            EpochState::Live => "live",
            EpochState::Draining => "draining",
        }
    }
}

/// One Envoy process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochInfo {
    /// Its restart epoch (0 without hot restart).
    pub epoch: u32,
    /// Its pid, in the agent's PID namespace.
    pub pid: u32,
    /// Its state.
    pub state: EpochState,
    /// When it started.
    pub started: SystemTime,
    /// When it entered its state.
    pub since: SystemTime,
}

/// Whether the serving Envoy answers the agent's checks of its admin API (`/ready`, about once
/// a second; see [`crate::watchdog`]). What readiness follows once Envoy serves: an Envoy that
/// answers nothing (stopped, deadlocked, starved) serves nothing either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdminHealth {
    /// It answers, or nothing is asked of it (nothing serves yet).
    #[default]
    Answering,
    /// It has not answered for longer than [`crate::watchdog::stale_after`]: readiness is off
    /// until it answers again, and past the unresponsive deadline it is judged wedged.
    Silent {
        /// Its last answer (or when the checks began).
        since: SystemTime,
    },
}

impl AdminHealth {
    /// Since when the admin API has been silent, while it is.
    pub fn silent_since(self) -> Option<SystemTime> {
        match self {
            AdminHealth::Answering => None,
            AdminHealth::Silent { since } => Some(since),
        }
    }
}

/// The proxy's life as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyPhase {
    /// Nothing serves yet (the first Envoy is starting; with hot restart, perhaps waiting
    /// for a predecessor pod's handoff).
    Starting,
    /// The newest epoch is LIVE and serves.
    Serving,
    /// A successor pod's Envoy took over; ours drains until the successor terminates it.
    HandedOver,
    /// Stopping every Envoy.
    Stopping,
    /// Nothing runs anymore.
    Exited,
}

impl ProxyPhase {
    /// `starting`, `serving`, `handed_over`, `stopping`, `exited`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyPhase::Starting => "starting",
            ProxyPhase::Serving => "serving",
            ProxyPhase::HandedOver => "handed_over",
            ProxyPhase::Stopping => "stopping",
            ProxyPhase::Exited => "exited",
        }
    }
}

/// Everything a proxy publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyState {
    /// Its life.
    pub phase: ProxyPhase,
    /// Since when.
    pub since: SystemTime,
    /// Every running Envoy process, oldest first.
    pub epochs: Vec<EpochInfo>,
    /// The newest LIVE epoch, when one serves.
    pub newest_live: Option<u32>,
    /// Hot restart only: the family's handoffs, wedges and cross-pod facts.
    pub family: Option<FamilyState>,
    /// What the newest LIVE epoch has of its config (its control plane, when dynamic).
    pub config: ConfigStatus,
    /// Whether the newest LIVE epoch answers its admin API.
    pub admin: AdminHealth,
}

impl ProxyState {
    /// The state before anything started.
    pub fn starting() -> Self {
        ProxyState {
            phase: ProxyPhase::Starting,
            since: SystemTime::now(),
            epochs: Vec::new(),
            newest_live: None,
            family: None,
            config: ConfigStatus::Unknown,
            admin: AdminHealth::Answering,
        }
    }

    /// Whether the newest epoch serves.
    pub fn serving(&self) -> bool {
        self.phase == ProxyPhase::Serving
    }

    /// Whether the newest epoch serves with its config (a dynamic bootstrap's: received from
    /// the control plane once) and answers its admin API; why not otherwise. What readiness
    /// reports.
    pub fn ready(&self) -> Result<(), NotReady> {
        // First: it stays true while a silent Envoy is being stopped as wedged.
        if let AdminHealth::Silent { since } = self.admin {
            return Err(NotReady::AdminSilent {
                silent: since.elapsed().unwrap_or_default(),
            });
        }
        if !self.serving() {
            return Err(NotReady::NotServing { phase: self.phase });
        }
        Ok(self.config.ready()?)
    }

    /// Whether an older generation still drains connections of its own (a hot-restart parent,
    /// in this pod or, for a successor's first epoch, in the predecessor pod).
    pub fn parent_draining(&self) -> bool {
        self.epochs.iter().any(|e| e.state == EpochState::Draining)
            || self
                .family
                .as_ref()
                .is_some_and(|f| f.foreign_parent_until.is_some())
    }
}

/// Why the proxy is not ready, as readiness, the status and the gRPC API say it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// The serving epoch's admin API has not answered for `silent` (the watchdog's reading).
    #[error("envoy's admin API has not answered for {}s", .silent.as_secs())]
    AdminSilent {
        /// Since its last answer.
        silent: Duration,
    },
    /// Nothing serves (starting, stopping, handed over, ...).
    #[error("envoy is {}", .phase.as_str())]
    NotServing {
        /// What it does instead.
        phase: ProxyPhase,
    },
    /// It serves without its config.
    #[error(transparent)]
    Config(#[from] crate::control_plane::ConfigNotReady),
}

/// How a hot restart ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The new epoch is LIVE.
    Live,
    /// Refused before starting anything (validation, hot-restart version, draining).
    Rejected,
    /// The new epoch exited before it was LIVE.
    Failed,
    /// The new epoch was not LIVE within the handoff deadline and was stopped.
    TimedOut,
}

impl Outcome {
    /// `live`, `rejected`, `failed`, `timed_out`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Live => "live",
            Outcome::Rejected => "rejected",
            Outcome::Failed => "failed",
            Outcome::TimedOut => "timed_out",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a new Envoy took over from the serving one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum HandoffKind {
    /// Envoy's hot restart: the next epoch of the same family (same base id) takes the
    /// listen sockets from its parent.
    #[default]
    Hot,
    /// A cold handover: a new family (another base id) started beside the serving one, its
    /// listeners bound beside the old ones through `SO_REUSEPORT`; once it was LIVE the old
    /// family drained and stopped. Used when hot restart cannot work.
    Cold {
        /// Why hot restart could not (another hot-restart version, an unusable segment).
        why: String,
        /// The base id the old family ran under.
        from_base_id: u32,
        /// The new family's.
        to_base_id: u32,
    },
}

impl HandoffKind {
    /// `hot` or `cold`.
    pub fn as_str(&self) -> &'static str {
        match self {
            HandoffKind::Hot => "hot",
            HandoffKind::Cold { .. } => "cold",
        }
    }
}

/// Where a handoff under way is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffStage {
    /// Waiting for its turn: a parent still drains, or another pod holds the node's epoch lock.
    Queued,
    /// Pre-flight checks (validation, hot-restart version) run.
    PreFlight,
    /// The new epoch runs and is not LIVE yet.
    Starting,
}

impl HandoffStage {
    /// `queued`, `pre_flight`, `starting`.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffStage::Queued => "queued",
            HandoffStage::PreFlight => "pre_flight",
            HandoffStage::Starting => "starting",
        }
    }
}

/// A handoff under way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// The epoch being started (or that will be).
    pub epoch: u32,
    /// What triggered it (several coalesced triggers, comma-separated).
    pub reason: String,
    /// When it was triggered.
    pub since: SystemTime,
    /// Where it is.
    pub stage: HandoffStage,
    /// Why it waits, while queued.
    pub waiting_for: Option<String>,
    /// Hot restart or cold handover.
    pub kind: HandoffKind,
}

/// The result of a hot restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandoffResult {
    /// The epoch it started (or would have).
    pub epoch: u32,
    /// What triggered it.
    pub reason: String,
    /// How it ended.
    pub outcome: Outcome,
    /// Trigger to outcome.
    pub duration: Duration,
    /// Of which queued (waiting for a draining parent or the node lock).
    pub queued: Duration,
    /// Of which pre-flight.
    pub preflight: Duration,
    /// When it ended.
    pub at: SystemTime,
    /// Why, when it did not go LIVE (Envoy's own words where there are some).
    pub message: String,
    /// Hot restart or cold handover (and why).
    pub kind: HandoffKind,
    /// A family's first epoch with nothing to take over from (the agent's start, a fresh
    /// family after a crash): no handover, whatever its reason says.
    pub fresh_start: bool,
}

/// Why the supervisor judged the family stuck, or repaired it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WedgeReason {
    /// A new epoch was not LIVE within the handoff deadline.
    HandoffDeadline,
    /// The admin API did not answer for longer than its deadline.
    AdminUnresponsive,
    /// Envoy's shared INITIALIZING flag was left set by an epoch that died initializing.
    StaleInitializing,
    /// A draining parent outlived its parent-shutdown time (plus a grace) and was killed.
    ParentOverdue,
}

impl WedgeReason {
    /// `handoff_deadline`, `admin_unresponsive`, `stale_initializing`, `parent_overdue`.
    pub fn as_str(self) -> &'static str {
        match self {
            WedgeReason::HandoffDeadline => "handoff_deadline",
            WedgeReason::AdminUnresponsive => "admin_unresponsive",
            WedgeReason::StaleInitializing => "stale_initializing",
            WedgeReason::ParentOverdue => "parent_overdue",
        }
    }
}

impl fmt::Display for WedgeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A wedge the supervisor saw, and what it did about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wedge {
    /// Why.
    pub reason: WedgeReason,
    /// When.
    pub at: SystemTime,
    /// What happened and what the supervisor did.
    pub message: String,
}

/// A hot-restart family's own facts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FamilyState {
    /// `--base-id`.
    pub base_id: u32,
    /// The running Envoy's `--hot-restart-version` (e.g. `11.104`).
    pub hot_restart_version: String,
    /// This supervisor's unique name on the node.
    pub identity: String,
    /// The handoff under way.
    pub handoff: Option<Handoff>,
    /// How the last hot restart ended.
    pub last_handoff: Option<HandoffResult>,
    /// Wedges seen (the last few), oldest first.
    pub wedges: Vec<Wedge>,
    /// Cross-pod: the predecessor our first epoch took over from.
    pub predecessor: Option<String>,
    /// Cross-pod: until when the predecessor's Envoy drains as our first epoch's parent.
    pub foreign_parent_until: Option<SystemTime>,
    /// Cross-pod: a successor pod that is starting (its heartbeat says so).
    pub successor_starting: Option<String>,
    /// Cross-pod: the successor whose Envoy took over from ours.
    pub handed_over_to: Option<String>,
    /// The family was told to drain: no further hot restart starts.
    pub drained: bool,
    /// After a cold handover: the old family's Envoy processes, draining until they are
    /// stopped (another base id than `base_id`).
    pub retiring: Vec<EpochInfo>,
    /// The family's hot-restart channel (`--socket-path`; `@name` when abstract).
    pub socket_path: String,
    /// The last hot restarts (and first starts), oldest first, at most [`HISTORY_KEPT`].
    pub handoffs: Vec<HandoffResult>,
    /// How the family's Envoy processes ended, oldest first, at most [`HISTORY_KEPT`].
    pub exits: Vec<EpochExit>,
}

/// How many handoffs and epoch exits the state keeps.
pub const HISTORY_KEPT: usize = 16;

/// How an Envoy process of the family ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochExit {
    /// Its epoch.
    pub epoch: u32,
    /// Its pid.
    pub pid: u32,
    /// What it was doing when it ended.
    pub state: EpochState,
    /// Its exit code, when it exited.
    pub code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    /// How it ended, in words (`drained parent terminated by its child`, `killed: handoff
    /// deadline`, `crashed`, ...).
    pub how: String,
    /// When.
    pub at: SystemTime,
}

//! What the supervisor publishes on its `watch` channel.

use std::fmt;
use std::time::{Duration, SystemTime};

/// Where an epoch is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpochState {
    /// Started, not LIVE yet.
    Starting,
    /// The newest epoch, serving.
    Live,
    /// A parent handing over to its child: draining until the child terminates it.
    Draining,
}

/// One Envoy process of the family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochInfo {
    /// Its restart epoch.
    pub epoch: u32,
    /// Its pid.
    pub pid: u32,
    /// Its state.
    pub state: EpochState,
    /// When it started.
    pub started: SystemTime,
    /// When it entered its state.
    pub since: SystemTime,
}

/// How a hot restart ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The new epoch is LIVE.
    Live,
    /// Refused before starting anything (validation, hot-restart version).
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

/// A handoff under way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// The epoch being started.
    pub epoch: u32,
    /// What triggered it.
    pub reason: String,
    /// When it was triggered.
    pub since: SystemTime,
}

/// The result of the last hot restart.
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
    /// When it ended.
    pub at: SystemTime,
    /// Why, when it did not go LIVE (Envoy's own words where there are some).
    pub message: String,
}

/// Why the supervisor judged the family stuck.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WedgeReason {
    /// A new epoch was not LIVE within the handoff deadline.
    HandoffDeadline,
    /// The admin API did not answer for longer than its deadline.
    AdminUnresponsive,
    /// Envoy's shared INITIALIZING flag was left set by an epoch that died initializing.
    StaleInitializing,
}

impl WedgeReason {
    /// `handoff_deadline`, `admin_unresponsive`, `stale_initializing`.
    pub fn as_str(self) -> &'static str {
        match self {
            WedgeReason::HandoffDeadline => "handoff_deadline",
            WedgeReason::AdminUnresponsive => "admin_unresponsive",
            WedgeReason::StaleInitializing => "stale_initializing",
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

/// The supervisor's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Epoch 0 is starting.
    Starting,
    /// An epoch is LIVE.
    Serving,
    /// Stopping every epoch.
    Stopping,
    /// Done.
    Exited,
}

/// Everything the supervisor knows, as published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisorState {
    /// Its life.
    pub phase: Phase,
    /// The family's base id.
    pub base_id: u32,
    /// The running Envoy's hot-restart version.
    pub hot_restart_version: String,
    /// Every running epoch, oldest first.
    pub epochs: Vec<EpochInfo>,
    /// The newest LIVE epoch.
    pub newest_live: Option<u32>,
    /// The handoff under way.
    pub handoff: Option<Handoff>,
    /// How the last hot restart ended.
    pub last_handoff: Option<HandoffResult>,
    /// Wedges seen (the last few).
    pub wedges: Vec<Wedge>,
    /// Whether the readiness marker exists.
    pub ready: bool,
    /// The successor whose Envoy took over from this supervisor's (cross-pod handoff).
    pub handed_over_to: Option<String>,
}

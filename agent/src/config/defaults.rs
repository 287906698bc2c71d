//! The defaults of the agent's settings: the one table. The flags whose parser has a default of
//! its own (`--minimum-drain-duration=5s`, ...) are checked against it by a test
//! (`cli::tests::the_flags_defaults_are_the_settings_defaults`), and
//! [`crate::AgentConfig::default`] is built from it. The hot-restart and crash-recovery flags
//! have no parser default: they are `Option`s so that giving one without `--hot-restart` or
//! `--restart-on-crash` is refused instead of silently ignored.
//!
//! A module of its own, not part of settings.rs: the shutdown timeline's default reads one,
//! and settings.rs holds the timeline.

use std::time::Duration;

/// `--termination-drain-duration`, without `--shutdown-budget`.
pub const TERMINATION_DRAIN_DURATION: Duration = Duration::from_secs(5);
/// `--app-hold` (a sidecar's): Kubernetes' default grace period (30 s) less the stop grace
/// (5 s), so that Envoy is stopped by the agent, not killed with the pod.
pub const APP_HOLD: Duration = Duration::from_secs(25);
/// How long a sidecar's app must hold no connection to Envoy's outbound listeners before it is
/// taken to have let go (a pool that closes a connection and opens another is not done).
pub const APP_LET_GO: Duration = Duration::from_millis(500);
/// How often a sidecar's app rule asks the kernel whether the app holds connections.
pub const APP_PROBE_EVERY: Duration = Duration::from_millis(100);
/// `--minimum-drain-duration`.
pub const MINIMUM_DRAIN_DURATION: Duration = Duration::from_secs(5);
/// `--drain-poll-interval`.
pub const DRAIN_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// `--exclude-listener-ports`: Istio's status and Prometheus ports.
pub const EXCLUDED_LISTENER_PORTS: [u16; 2] = [15021, 15090];
/// Bound on one stats call while exit-on-zero counts (no flag).
pub const STATS_TIMEOUT: Duration = Duration::from_secs(2);
/// Consecutive stats failures that end the wait for zero (no flag).
pub const STATS_ERROR_BUDGET: u32 = 5;
/// `--parent-shutdown-time`.
pub const PARENT_SHUTDOWN_TIME: Duration = Duration::from_secs(60);
/// `--handoff-deadline`.
pub const HANDOFF_DEADLINE: Duration = Duration::from_secs(60);
/// `--crash-restart-limit`.
pub const CRASH_RESTART_LIMIT: u32 = 5;
/// `--crash-backoff-max`.
pub const CRASH_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A stopping agent waits for a successor pod's Envoy to terminate its own at most its
/// handoff deadline plus the parent shutdown time after it starts, and then this.
pub const HANDOVER_MARGIN: Duration = Duration::from_secs(10);

/// How long a stopping agent waits for a successor pod to terminate its Envoy, without
/// `--shutdown-budget`: a successor runs the same command line, so its deadlines are ours.
pub fn handover_timeout(handoff_deadline: Duration, parent_shutdown_time: Duration) -> Duration {
    handoff_deadline + parent_shutdown_time + HANDOVER_MARGIN
}

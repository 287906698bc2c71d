//! Defaults of the settings whose flags have none of their own: the hot-restart and
//! crash-recovery flags are `Option`s so that giving one without `--hot-restart` or
//! `--restart-on-crash` is refused instead of silently ignored.
//!
//! A module of its own, not part of settings.rs: the shutdown timeline's default reads one,
//! and settings.rs holds the timeline.

use std::time::Duration;

/// `--termination-drain-duration`, without `--shutdown-budget`.
pub const TERMINATION_DRAIN_DURATION: Duration = Duration::from_secs(5);
/// `--parent-shutdown-time`.
pub const PARENT_SHUTDOWN_TIME: Duration = Duration::from_secs(60);
/// `--handoff-deadline`.
pub const HANDOFF_DEADLINE: Duration = Duration::from_secs(60);
/// `--crash-restart-limit`.
pub const CRASH_RESTART_LIMIT: u32 = 5;
/// `--crash-backoff-max`.
pub const CRASH_BACKOFF_MAX: Duration = Duration::from_secs(30);

//! The watchdog of the serving epoch's admin API: when it is checked next, and whether it
//! answers.
//!
//! Readiness (the status's and the marker's) follows the admin answering: an Envoy that
//! answers nothing serves nothing either. Whether it answers and since when are one value
//! ([`Admin`]), so the status's `admin` and the silence a wedge is judged by cannot disagree.
//! The rules (stale after a few seconds, a wedge past the deadline by a check sent after it)
//! are `envoy_agent_proxy::watchdog`'s, shared with a sidecar's; what a refused check, a
//! successor's start or the agent's own lack of a resource mean is decided here.

use std::time::{Duration, SystemTime};

use envoy_agent_proxy::admin::AdminState;
use envoy_agent_proxy::watchdog::{self as rules, Silence};
use envoy_agent_proxy::{AdminError, AdminHealth, Ended, WedgeReason};
use tokio::time::Instant;

use super::{Probe, Supervisor, WATCHDOG_POLL, WATCHDOG_POLL_SUCCESSOR};
use crate::discovery;
use crate::host::Host;
use crate::probing::Probing;

/// Whether the serving epoch's admin API answers the watchdog.
#[derive(Debug, Clone, Copy)]
enum Admin {
    /// It answers, or nothing is asked of it. `last`: its last answer (or when the checks
    /// began, or its silence was explained).
    Answering { last: Instant },
    /// It has been silent long enough that readiness is off. `since`: `last` on the wall
    /// clock, as the status tells it.
    Silent { last: Instant, since: SystemTime },
}

/// The serving epoch's admin checks and what they found.
#[derive(Debug)]
pub(super) struct Watchdog {
    checks: Probing,
    admin: Admin,
}

impl Watchdog {
    /// Checks not scheduled yet; the admin taken as answering from `now`.
    pub(super) fn new(now: Instant) -> Self {
        Watchdog {
            checks: Probing::default(),
            admin: Admin::Answering { last: now },
        }
    }

    /// What the status tells of the admin.
    pub(super) fn health(&self) -> AdminHealth {
        match self.admin {
            Admin::Answering { .. } => AdminHealth::Answering,
            Admin::Silent { since, .. } => AdminHealth::Silent { since },
        }
    }

    pub(super) fn answering(&self) -> bool {
        matches!(self.admin, Admin::Answering { .. })
    }

    /// The admin's last answer.
    fn last_answer(&self) -> Instant {
        match self.admin {
            Admin::Answering { last } | Admin::Silent { last, .. } => last,
        }
    }

    /// It answered (or its silence is explained) at `now`; how long it had been silent if
    /// readiness was off.
    fn answered(&mut self, now: Instant) -> Option<Duration> {
        let was = std::mem::replace(&mut self.admin, Admin::Answering { last: now });
        match was {
            Admin::Silent { last, .. } => Some(now - last),
            Admin::Answering { .. } => None,
        }
    }

    /// It has been silent for `silent`: readiness is off.
    fn fell_silent(&mut self, silent: Duration) {
        let last = self.last_answer();
        let since = SystemTime::now().checked_sub(silent);
        self.admin = Admin::Silent {
            last,
            since: since.unwrap_or_else(SystemTime::now),
        };
    }

    /// A successor's Envoy serves now: ours is no longer checked, nor its silence told.
    pub(super) fn handed_over(&mut self) {
        self.checks = Probing::default();
        self.admin = Admin::Answering {
            last: self.last_answer(),
        };
    }

    /// No check until [`Self::start`].
    pub(super) fn stop(&mut self) {
        self.checks = Probing::default();
    }

    /// Checks (again) from `at` on, whatever was out (its answer is of an epoch that no longer
    /// serves).
    pub(super) fn start(&mut self, at: Instant) {
        self.checks = Probing {
            next: Some(at),
            in_flight: false,
        };
    }

    /// The next check at `at`, after the one out (if any) returns.
    pub(super) fn next_at(&mut self, at: Instant) {
        self.checks.next = Some(at);
    }

    /// A check now, unless one is out.
    pub(super) fn check_soon(&mut self, now: Instant) {
        if !self.checks.in_flight {
            self.checks.next = Some(now);
        }
    }

    pub(super) fn due(&self, now: Instant) -> bool {
        self.checks.due(now)
    }

    pub(super) fn wake(&self) -> Option<Instant> {
        self.checks.wake()
    }

    pub(super) fn sent(&mut self) {
        self.checks.in_flight = true;
    }

    pub(super) fn returned(&mut self) {
        self.checks.in_flight = false;
    }
}

impl<H: Host> Supervisor<H> {
    /// Probes the serving epoch when the watchdog is due (and validates a binary changed on
    /// disk ahead of the next restart); only while an epoch serves.
    pub(super) fn watchdog_timer(&mut self, now: Instant) {
        // Early too, to share the heartbeat's wake-up (only at its steady pace).
        let early = match self.pods.successor_starting() {
            None => WATCHDOG_POLL / 4,
            Some(_) => Duration::ZERO,
        };
        if self.watchdog.due(now + early) {
            if self.life.serving().is_some() {
                self.probe(Probe::Watchdog);
                // A release copied over the binary: validate it with the config before a
                // restart needs the answer.
                if self.host.binary_changed() && self.can_restart() && self.handoff.is_idle() {
                    tracing::info!(binary = %self.config.proxy.binary_path.display(), "the envoy binary changed on disk: validating it ahead of the next restart");
                    self.prevalidate(None);
                }
            } else {
                self.watchdog.stop();
            }
        }
    }

    pub(super) fn on_watchdog(
        &mut self,
        sent: Instant,
        result: Result<Option<AdminState>, AdminError>,
    ) {
        if self.life.serving().is_none() {
            return;
        }
        if let Some(successor) = self.takeover_seen(&result, self.life.live()) {
            self.hand_over(successor);
            return;
        }
        let now = Instant::now();
        let period = if self.pods.successor_starting().is_some() {
            WATCHDOG_POLL_SUCCESSOR
        } else {
            WATCHDOG_POLL
        };
        self.watchdog.next_at(now + period);
        match result {
            Ok(_) => self.admin_answered(now),
            Err(e) if self.pods.successor_starting().is_some() => {
                // Another pod's starting epoch may hold the admin listener: its handoff, not a
                // wedge of ours.
                tracing::debug!(error = %e, "admin silent while a successor starts");
                self.admin_answered(now);
            }
            Err(e) if discovery::refused(&e) && !self.serving_runs() => {
                // The serving Envoy closed its listener by dying: its exit, not reaped yet, is
                // its crash, reported when it arrives. A restart now would hide it (a crash
                // loop would never give up) behind a new epoch.
                tracing::debug!(error = %e, "admin refused by a serving envoy that no longer runs: waiting for its exit");
            }
            Err(e) if discovery::refused(&e) => {
                // Our Envoy runs but its admin listener is gone: only a child (ours or another
                // pod's) takes it, and that child has failed. Only a LIVE child gives it back.
                self.admin_answered(now);
                if self.handoff.is_idle() && self.queue.is_empty() && !self.orders.drained() {
                    tracing::warn!(event = "admin_listener_lost", error = %e, "the serving epoch's admin listener is gone (taken by a failed epoch?): hot-restarting to get it back");
                    self.queue
                        .push("recover the admin listener".to_owned(), None, now);
                }
            }
            Err(e) if e.is_local_resource() => {
                // The agent could not even try (no descriptor, no memory, no local port):
                // nothing is known of Envoy. Silence counts only from calls that reached it.
                tracing::error!(event = "agent_resources", error = %e, "the agent itself is out of a resource: cannot check envoy's admin (not counted as envoy being silent)");
            }
            Err(e) => self.admin_silent(sent, now, &e),
        }
    }

    /// Whether the serving epoch's process still runs (not exited, nor exiting, nor a zombie
    /// whose exit is yet to be seen).
    fn serving_runs(&self) -> bool {
        self.life
            .serving()
            .and_then(|epoch| self.epochs.get(epoch))
            .is_some_and(|c| self.host.still_runs(c.pid))
    }

    /// A check sent at `sent` reached Envoy and failed (`e`), at `now`: readiness goes off
    /// once the silence is more than brief, and the family stops as wedged past the deadline.
    fn admin_silent(&mut self, sent: Instant, now: Instant, e: &AdminError) {
        let last = self.watchdog.last_answer();
        let silent = now - last;
        let deadline = self.config.proxy.options.admin_unresponsive_deadline;
        tracing::warn!(error = %e, silent_for = ?silent, "envoy admin not answering");
        // The same rules as a sidecar's (see `watchdog`): stale after a few seconds; a wedge
        // only when a call sent once the deadline had passed failed too (one sent before it
        // and answered late, the agent stalled or starved, is not the fresh fact a wedge,
        // which stops the family, needs).
        let silence = rules::judge(last, sent, now, deadline);
        if silence != Silence::Brief && self.watchdog.answering() {
            tracing::warn!(
                event = "admin_silent",
                epoch = self.life.live(),
                silent_for_ms = silent.as_millis() as u64,
                deadline_ms = deadline.as_millis() as u64,
                error = %e,
                "envoy's admin API does not answer: not ready"
            );
            self.watchdog.fell_silent(silent);
            // The marker is a node proxy's readiness (an exec probe): it follows too.
            self.refresh_marker();
        }
        if silence == Silence::Wedged {
            let message = format!("envoy admin silent for {silent:?} (deadline {deadline:?}): {e}");
            self.record_wedge(WedgeReason::AdminUnresponsive, message.clone());
            self.begin_stop(
                Ended::Wedged {
                    reason: WedgeReason::AdminUnresponsive,
                    message,
                },
                "wedged",
            );
        }
    }

    /// The serving epoch answered (or its silence is explained) at `now`: readiness follows it
    /// again.
    pub(super) fn admin_answered(&mut self, now: Instant) {
        if let Some(silent) = self.watchdog.answered(now) {
            tracing::info!(
                event = "admin_answering",
                epoch = self.life.live(),
                silent_for_ms = silent.as_millis() as u64,
                "envoy's admin API answers again"
            );
            self.refresh_marker();
        }
    }
}

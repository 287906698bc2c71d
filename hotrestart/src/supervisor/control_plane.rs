//! The control plane (xDS): what the newest LIVE epoch has of its config, and why a new epoch
//! waits.
//!
//! - **Readiness.** The readiness marker (like the agent's readiness) waits until the newest
//!   LIVE epoch has received each dynamic type once ([`ConfigStatus`]); a static bootstrap is
//!   ready at LIVE. The reading of the previous epoch stands until the new one's comes, so a
//!   hot restart does not blink readiness.
//! - **A new epoch waits for its config.** An epoch beside a serving one starts with an
//!   unbounded initial fetch (`envoy_agent_proxy::control_plane`): while the control plane is
//!   down it stays INITIALIZING, its parent serving. The handoff deadline still ends it
//!   (SIGKILL, as any epoch that is not LIVE), but that is no wedge: the restart stays queued
//!   and is retried after a back-off that grows while the control plane stays away; a
//!   successor's first epoch goes back to discovery after the back-off (without a deadline)
//!   instead of giving up.

use envoy_agent_proxy::{ConfigStatus, XdsReading, XdsType};

use envoy_agent_proxy::{AdminError, Outcome};
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

use super::{Event, Life, Supervisor, Waiting};
use crate::handoff::{Attempt, Handoff, Parent, QueueWait, type_list};
use crate::host::Host;
use crate::probing::Probing;

/// How often the newest epoch's control plane is read while readiness waits for its config.
pub(crate) const XDS_POLL: Duration = Duration::from_millis(200);
/// ... and after it came (the status's counters and connection state). Each reading makes
/// Envoy visit every stat: rarely.
pub(crate) const XDS_POLL_STEADY: Duration = Duration::from_secs(10);
/// How often a starting epoch is asked what it waits for, from this long after its spawn.
pub(crate) const XDS_START_POLL: Duration = Duration::from_secs(1);
/// The first retry after an epoch waited for its control plane for the whole handoff deadline,
/// doubling up to [`CONFIG_WAIT_BACKOFF_MAX`].
pub(crate) const CONFIG_WAIT_BACKOFF: Duration = Duration::from_secs(2);
/// The longest back-off between those retries.
pub(crate) const CONFIG_WAIT_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The back-off after `waits` attempts in a row ended waiting for the control plane.
pub(crate) fn config_wait_backoff(waits: u32) -> Duration {
    CONFIG_WAIT_BACKOFF
        .saturating_mul(1 << waits.min(8))
        .min(CONFIG_WAIT_BACKOFF_MAX)
}

/// The readings of the control plane's stats, and what the newest LIVE epoch has of its
/// config.
#[derive(Debug, Default)]
pub(super) struct ControlPlane {
    /// When it is read next.
    reads: Probing,
    /// How long the last reading took: the next ones are paced by it.
    cost: Duration,
    /// What the newest LIVE epoch has of its config.
    status: ConfigStatus,
}

impl ControlPlane {
    pub(super) fn status(&self) -> &ConfigStatus {
        &self.status
    }

    /// A reading no later than `at`.
    fn want(&mut self, at: Instant) {
        self.reads.next = Some(self.reads.next.map_or(at, |n| n.min(at)));
    }

    pub(super) fn due(&self, now: Instant) -> bool {
        self.reads.due(now)
    }

    pub(super) fn wake(&self) -> Option<Instant> {
        self.reads.wake()
    }

    /// A reading is out; the next is scheduled once it is back.
    fn sent(&mut self) {
        self.reads = Probing {
            next: None,
            in_flight: true,
        };
    }

    /// The reading is back; it took `took`.
    fn returned(&mut self, took: Duration) {
        self.reads.in_flight = false;
        self.cost = took;
    }

    /// The newest LIVE epoch's `reading`; whether its config status changed (logged).
    fn observe(&mut self, epoch: u32, reading: &XdsReading) -> bool {
        let changed = self.status.observe(epoch, reading, SystemTime::now());
        if changed {
            self.status.log_change();
        }
        changed
    }
}

impl<H: Host> Supervisor<H> {
    /// Wants a reading of the control plane no later than `at`.
    pub(super) fn want_xds(&mut self, at: Instant) {
        self.control_plane.want(at);
    }

    /// Asks whoever answers on the admin address what it has of its control plane, beside the
    /// loop.
    pub(super) fn xds_check(&mut self) {
        self.control_plane.sent();
        let cold = match &self.handoff {
            Handoff::Cold { child, .. } => Some(child.base_id),
            _ => None,
        };
        let call = self.host.xds(cold);
        let asked = Instant::now();
        self.beside(call, move |result| Event::XdsRead {
            cold: cold.is_some(),
            took: asked.elapsed(),
            result,
        });
    }

    pub(super) fn on_xds(
        &mut self,
        cold: bool,
        took: Duration,
        result: Result<XdsReading, AdminError>,
    ) {
        self.control_plane.returned(took);
        let running = self.life.running();
        match result {
            Ok(reading) if cold => {
                if let Handoff::Cold { attempt, .. } = &mut self.handoff {
                    note_waiting(attempt, &reading);
                }
            }
            Ok(reading)
                if running && reading.epoch.is_some() && reading.epoch == self.life.live() =>
            {
                let epoch = reading.epoch.unwrap_or_default();
                if self.control_plane.observe(epoch, &reading) {
                    self.refresh_marker();
                }
            }
            Ok(reading)
                if reading.epoch.is_some() && reading.epoch == self.handoff.starting_epoch() =>
            {
                if let Handoff::Starting { attempt, .. } = &mut self.handoff {
                    note_waiting(attempt, &reading);
                }
            }
            // Another epoch answered: a handoff moves on.
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "cannot read the control plane's stats"),
        }
        self.schedule_xds(Instant::now());
    }

    /// The next reading: soon while readiness waits for the newest epoch's config, rarely
    /// after, never for a static one; every [`XDS_START_POLL`] while a new epoch starts.
    ///
    /// Each reading makes Envoy visit every stat (most of a second on a large config), so the
    /// pace also follows what the last one took: at most 1/20 of Envoy's main thread while
    /// something waits on the answer, 1/100 when only the status does.
    pub(super) fn schedule_xds(&mut self, now: Instant) {
        use envoy_agent_proxy::admin::{BUSY_SHARE, IDLE_SHARE, paced};
        let cost = self.control_plane.cost;
        if self.life.serving().is_some() {
            match &self.control_plane.status {
                ConfigStatus::Static => {}
                status if status.waiting() => {
                    self.want_xds(now + paced(XDS_POLL, cost, BUSY_SHARE));
                }
                _ => self.want_xds(now + paced(XDS_POLL_STEADY, cost, IDLE_SHARE)),
            }
        }
        // A static family's new epoch has nothing to wait for (and a large config's stats
        // are costly to read while it loads).
        let starting =
            self.handoff.starting_epoch().is_some() || matches!(self.handoff, Handoff::Cold { .. });
        if starting && self.control_plane.status != ConfigStatus::Static {
            self.want_xds(now + paced(XDS_START_POLL, cost, BUSY_SHARE));
        }
    }

    /// Epoch `epoch` waited for its control plane (`waiting`) for the whole handoff deadline
    /// and was stopped: the restart is queued again after a back-off (its callers are told),
    /// no wedge, the serving epoch serves on.
    pub(super) fn config_wait_ended(&mut self, attempt: Attempt, waiting: &[XdsType]) {
        let now = Instant::now();
        let backoff = config_wait_backoff(self.queue.config_waits);
        let first_of_streak = self.queue.config_waits == 0;
        self.queue.config_waits = self.queue.config_waits.saturating_add(1);
        let types = type_list(waiting);
        let message = format!(
            "epoch {} waited for its control plane ({types}) for the whole handoff deadline \
             ({:?}); the serving epoch keeps serving, and the restart is retried in {backoff:?}",
            attempt.epoch, self.config.options.handoff_deadline
        );
        if first_of_streak {
            tracing::warn!(event = "control_plane_wait", epoch = attempt.epoch, waiting_for = %types, retry_in = ?backoff, "{message}");
        } else {
            tracing::debug!(epoch = attempt.epoch, waiting_for = %types, retry_in = ?backoff, "{message}");
        }
        self.metrics.control_plane_wait();
        let reason = attempt.reason.clone();
        match &attempt.parent {
            Some(Parent::Foreign { .. }) if attempt.first => {
                self.finish(attempt, Outcome::TimedOut, message);
                // Discovery again, from fresh facts: the predecessor may have restarted
                // meanwhile (to get back the admin listener our epoch took), and only what
                // answers then says which epoch is next.
                self.life = Life::Discovering {
                    deadline: None,
                    look: Probing {
                        next: Some(now + backoff),
                        in_flight: false,
                    },
                    waiting: Some(Waiting::ControlPlane(waiting.to_vec())),
                    reported_incompatible: None,
                    lock: None,
                };
                self.write_heartbeat();
            }
            _ => {
                self.finish(attempt, Outcome::TimedOut, message);
                self.queue.push(reason, None, now);
                self.queue.not_before = Some(now + backoff);
                self.queue.waiting_for = Some(QueueWait::ControlPlane(waiting.to_vec()));
            }
        }
    }
}

/// What a starting epoch (or cold family) waits for, from its reading; logged when it changes.
fn note_waiting(attempt: &mut Attempt, reading: &XdsReading) {
    let waiting = reading.starting_waits();
    if attempt.waiting_for_config == waiting {
        return;
    }
    if !waiting.is_empty() {
        tracing::info!(
            event = "handoff_waiting",
            epoch = attempt.epoch,
            waiting_for = %type_list(&waiting),
            connected = ?reading.connected,
            "the new epoch waits for its control plane's config; the serving epoch serves on"
        );
    }
    attempt.waiting_for_config = waiting;
}

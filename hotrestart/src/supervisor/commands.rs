//! Commands from the handle: hot restarts (queued), drains, log reopening, the successor
//! question, expected config writes.
//!
//! Most commands are answered and forgotten; a drain and a health-check failure are standing
//! orders ([`Orders`]): they hold for every epoch that serves after them, so they are kept.

use envoy_agent_proxy::{
    DrainOptions, DrainPlan, Ended, EpochState, Outcome, RestartError, Signal,
};
use std::sync::Arc;
use tokio::time::Instant;
use tracing::Instrument;

use super::{
    Command, DrainReply, Event, FamilyError, HealthChecksReply, Life, Probe, Supervisor, kept,
};
use crate::answers::Deferred;
use crate::handoff::{Handoff, Waiter};
use crate::host::Host;

/// What the handle told the family that holds for the rest of its life.
#[derive(Debug, Default)]
pub(super) struct Orders {
    /// Told to drain: no further hot restart starts, the marker stays away.
    drained: bool,
    /// Envoy was told to fail its health checks: an epoch that serves after a handoff settles
    /// is told too (the failure is a process's own state, not handed over).
    health_checks_failed: bool,
}

impl Orders {
    pub(super) fn drained(&self) -> bool {
        self.drained
    }

    /// Told to drain; whether that is news.
    pub(super) fn drain(&mut self) -> bool {
        !std::mem::replace(&mut self.drained, true)
    }

    pub(super) fn health_checks_failed(&self) -> bool {
        self.health_checks_failed
    }

    pub(super) fn fail_health_checks(&mut self) {
        self.health_checks_failed = true;
    }
}

impl<H: Host> Supervisor<H> {
    pub(super) fn on_command(&mut self, command: Command) {
        match command {
            Command::HotRestart { reason, reply } => {
                tracing::info!(%reason, "hot restart requested");
                self.request_restart(reason, reply);
            }
            Command::Drain { options, reply } => self.drain(options, reply),
            Command::FailHealthChecks { reply } => self.fail_health_checks(reply),
            Command::ReopenLogs { reply } => {
                // Never a starting epoch: SIGUSR1's default action kills a process that has
                // not installed Envoy's handler yet. Draining parents write logs too.
                let targets: Vec<u32> = self
                    .epochs
                    .iter()
                    .filter(|c| c.state != EpochState::Starting)
                    .map(|c| c.epoch)
                    .collect();
                for epoch in &targets {
                    self.epochs.signal(*epoch, Signal::SIGUSR1, None);
                }
                tracing::info!(event = "logs_reopened", epochs = targets.len(), which = ?targets, "asked envoy to reopen its logs");
                let _ = reply.send(targets.len());
            }
            Command::Successor { reply } => {
                if let Life::HandedOver { successor } = &self.life {
                    let _ = reply.send(Some(successor.clone()));
                    return;
                }
                self.read_node();
                self.probe(Probe::Successor(reply));
            }
            Command::Expect { content, reply } => {
                if let Some(watch) = &mut self.watch {
                    watch.expect(&content);
                }
                let _ = reply.send(());
            }
        }
    }

    pub(super) fn request_restart(&mut self, reason: String, reply: Option<Waiter>) {
        let refused = match &self.life {
            Life::HandedOver { successor } => Some(format!(
                "handed over to {successor}: hot restarts are the successor's now"
            )),
            Life::Stopping { .. } => Some("stopping".to_owned()),
            _ if self.orders.drained() => {
                Some("draining: no new epoch starts after a drain".to_owned())
            }
            _ => None,
        };
        if let Some(why) = refused {
            tracing::warn!(%reason, %why, "hot restart refused");
            if let Some(reply) = reply {
                let _ = reply.send(Err(RestartError::Refused(why)));
            }
            return;
        }
        let waiting_for = match &self.handoff {
            Handoff::Idle => match &self.kept {
                kept::KeptParent::Draining { child, .. } => Some(format!(
                    "the parent kept through its child's crash (epoch {}) still drains",
                    child.epoch
                )),
                _ => None,
            },
            Handoff::ParentDraining { parent, .. } => {
                Some(format!("epoch {} still drains", parent.epoch()))
            }
            Handoff::PreFlight { .. } | Handoff::Starting { .. } | Handoff::Cold { .. } => {
                Some("a handoff is under way".to_owned())
            }
            Handoff::Retiring { .. } => {
                Some("the old family drains after a cold handover".to_owned())
            }
        };
        if let Some(why) = &waiting_for {
            tracing::info!(event = "restart_queued", %reason, waiting_for = %why, "hot restart queued: coalesced into the next restart");
        }
        self.queue.push(reason, reply, Instant::now());
    }

    pub(super) fn drain(&mut self, options: DrainOptions, reply: DrainReply) {
        match &self.life {
            Life::Stopping { .. } | Life::HandedOver { .. } => {
                // Ours already drain, or are going.
                let _ = reply.send(Ok(DrainPlan::not_serving(options.listeners)));
                return;
            }
            Life::Discovering { .. } | Life::Starting => {
                // Told to go away before our first epoch serves: nothing of ours to drain, and
                // a takeover now would only be undone. A starting epoch is killed (SIGKILL: its
                // parent may be the predecessor pod's serving Envoy).
                tracing::info!("told to drain before our first epoch serves: giving up the start");
                self.orders.drain();
                let _ = reply.send(Ok(DrainPlan::not_serving(options.listeners)));
                self.begin_stop(Ended::Stopped { last: None }, "drained before serving");
                return;
            }
            Life::Serving { .. } => {}
        }
        if self.orders.drain() {
            tracing::info!("draining: no new epoch starts from here on");
            self.queue
                .refuse(&RestartError::Refused("draining".to_owned()));
            self.set_marker(false);
        }
        match &mut self.handoff {
            Handoff::PreFlight { .. } => {
                // Nothing started: the restart is moot.
                if let Handoff::PreFlight { attempt, lock } =
                    std::mem::replace(&mut self.handoff, Handoff::Idle)
                {
                    drop(lock);
                    self.finish(
                        attempt,
                        Outcome::Rejected,
                        "cancelled: the family drains".to_owned(),
                    );
                }
                self.send_drain(options, vec![reply]);
            }
            Handoff::Starting { deferred, .. } | Handoff::Cold { deferred, .. } => {
                // The new epoch may hold the admin listener (or become the family): drain
                // whichever serves once the handoff has settled.
                tracing::info!("a handoff is under way: the drain follows once it settles");
                deferred.drains.push((options, reply));
            }
            Handoff::Idle | Handoff::ParentDraining { .. } | Handoff::Retiring { .. } => {
                self.send_drain(options, vec![reply]);
            }
        }
    }

    pub(super) fn send_drain(&mut self, options: DrainOptions, replies: Vec<DrainReply>) {
        let call = self.host.drain(options.listeners, options.skip_exit);
        // Every epoch of ours drains from here on (a parent already did, since its child
        // went LIVE): each is told, so its idle and streaming clients hear it.
        for epoch in self.epochs.iter().map(|c| c.epoch).collect::<Vec<_>>() {
            self.host.tell_drain(self.base_id, epoch);
        }
        self.beside(call, |result| Event::Drained {
            result: result.map_err(|e| FamilyError::Admin(Arc::new(e))),
            replies,
        });
    }

    /// Makes whichever Envoy serves fail its health checks, and every epoch that serves
    /// after it. During a handoff the new epoch may take the admin listener (or become the
    /// family): asked once it has settled.
    pub(super) fn fail_health_checks(&mut self, reply: HealthChecksReply) {
        self.orders.fail_health_checks();
        match &mut self.handoff {
            Handoff::Starting { deferred, .. } | Handoff::Cold { deferred, .. } => {
                tracing::info!("a handoff is under way: health checks fail once it settles");
                deferred.health_checks.push(reply);
            }
            _ => self.send_health_checks_fail(vec![reply]),
        }
    }

    fn send_health_checks_fail(&mut self, replies: Vec<HealthChecksReply>) {
        let call = self.host.fail_health_checks();
        tokio::spawn(
            async move {
                let result = call.await.map_err(|e| FamilyError::Admin(Arc::new(e)));
                if let Err(e) = &result {
                    tracing::warn!(error = %e, "cannot fail envoy's health checks");
                }
                for reply in replies {
                    let _ = reply.send(result.clone());
                }
            }
            .in_current_span(),
        );
    }

    /// Once a handoff has settled: the drains and health-check failures asked meanwhile go to
    /// whichever Envoy serves now (and an epoch that serves after a handoff is told to fail
    /// its health checks again: the failure is a process's own state, not handed over).
    pub(super) fn settled(&mut self, deferred: Deferred) {
        let Deferred {
            drains,
            health_checks,
        } = deferred;
        if self.orders.health_checks_failed() {
            self.send_health_checks_fail(health_checks);
        }
        let Some(&(options, _)) = drains.first() else {
            return;
        };
        let replies = drains.into_iter().map(|(_, r)| r).collect();
        self.send_drain(options, replies);
    }
}

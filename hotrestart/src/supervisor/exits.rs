//! Process exits and stopping: who died, what that means, stand-ins for dead parents, the
//! stale-INITIALIZING repair, and the stop of every epoch.

use envoy_agent_proxy::{
    Ended, EpochState, Exit, Outcome, ProxyError, RestartError, Signal, WedgeReason,
};
use std::time::SystemTime;
use tokio::time::Instant;

use super::{Life, Probe, STOP_BACKSTOP, StandIn, Supervisor, exit_kind};
use crate::epochs::{Epochs, Stop};
use crate::handoff::{DrainingParent, Handoff, OldFamily};
use crate::host::{Host, Repair};
use crate::metrics::ExitKind;

impl<H: Host> Supervisor<H> {
    pub(super) fn on_exit(&mut self, epoch: u32, pid: u32, result: Result<Exit, ProxyError>) {
        if matches!(&self.handoff, Handoff::Cold { child, .. } if child.pid == pid) {
            self.on_cold_exit(result);
            return;
        }
        if let Some((child, retired)) = self.take_retired(epoch, pid) {
            self.on_retired_exit(child, retired, result);
            return;
        }
        let Some(child) = self.epochs.remove(epoch, pid) else {
            return;
        };
        let (code, tail) = match &result {
            Ok(exit) => (exit.code(), exit.stderr_tail.clone()),
            Err(e) => (1, e.to_string()),
        };
        let kind = exit_kind(&result, child.state == EpochState::Draining);
        self.metrics.exit(kind);
        self.record_exit(&child, &result, kind);
        if let Some(exit) = self.history.last_exit() {
            tracing::info!(
                event = "epoch_exited",
                epoch,
                pid,
                code = exit.code,
                signal = exit.signal,
                how = %exit.how,
                "epoch exited"
            );
        }
        // A stand-in's child is gone: nothing talks to that dead parent's names anymore.
        self.release_stand_ins(|p| p + 1 == epoch, "its child exited");
        if child.state == EpochState::Starting {
            // No Envoy of the family initializes now: a flag it left set is stale. Expected of
            // one stopped while it waited for its control plane (no wedge, see
            // `control_plane`).
            let waited = matches!(child.stopped, Some((Stop::Deadline, _)))
                && self
                    .handoff
                    .attempt()
                    .is_some_and(|a| a.epoch == epoch && !a.waiting_for_config.is_empty());
            self.repair_initializing(epoch, waited);
        }
        match &self.life {
            Life::Stopping { .. } => {
                tracing::info!(epoch, code, "epoch stopped");
                return;
            }
            Life::HandedOver { .. } => {
                tracing::info!(epoch, code, "our envoy exited after the handover");
                self.write_heartbeat();
                return;
            }
            Life::Discovering { .. } | Life::Starting | Life::Serving { .. } => {}
        }
        match child.state {
            EpochState::Draining => self.on_draining_exit(&child, code),
            EpochState::Live => self.on_live_exit(epoch, code, result),
            EpochState::Starting => self.on_failed_start(child, code, &tail),
        }
    }

    /// A draining parent exited: terminated by its child as planned, or died (then a
    /// stand-in keeps its child's hot-restart channel answered).
    fn on_draining_exit(&mut self, child: &crate::epochs::Child, code: i32) {
        let epoch = child.epoch;
        if let Handoff::ParentDraining {
            parent: DrainingParent::Ours(p),
            ..
        } = &self.handoff
        {
            if *p == epoch {
                self.handoff = Handoff::Idle;
            }
        }
        if code == 0 && child.stopped.is_none() {
            tracing::info!(epoch, "drained parent exited (terminated by its child)");
        } else {
            tracing::warn!(epoch, code, "draining parent died; its child keeps serving");
            self.stand_in_for(epoch);
        }
        self.write_heartbeat();
    }

    /// The serving epoch exited: handed to its starting successor if there is one, else the
    /// question of who serves now goes to a probe.
    fn on_live_exit(&mut self, epoch: u32, code: i32, result: Result<Exit, ProxyError>) {
        self.life.live_exited();
        self.set_marker(false);
        let exit = match result {
            Ok(exit) => exit,
            Err(e) => {
                self.begin_stop(
                    Ended::StartFailed {
                        code: 1,
                        message: e.to_string(),
                    },
                    "cannot wait for envoy",
                );
                return;
            }
        };
        if let Some(starting) = self.handoff.starting_epoch() {
            // The serving epoch died while its successor starts: the successor still
            // talks to it, so stand in for its sockets at once and let the successor
            // finish (its deadline still applies).
            tracing::warn!(
                epoch,
                code,
                starting,
                "the serving epoch exited while epoch {starting} starts: standing in for it, the new epoch may still take over"
            );
            self.stand_in_for(epoch);
            if let Handoff::Starting {
                attempt,
                serving_exited,
                ..
            } = &mut self.handoff
            {
                attempt.parent = None;
                *serving_exited = Some(exit);
            }
            return;
        }
        // Who serves now? A successor pod's Envoy terminates ours with exit 0.
        self.probe(Probe::ServingExited(exit));
    }

    /// Keeps how `child` ended in the published history.
    pub(super) fn record_exit(
        &mut self,
        child: &crate::epochs::Child,
        result: &Result<Exit, ProxyError>,
        kind: ExitKind,
    ) {
        use std::os::unix::process::ExitStatusExt;
        let (code, signal) = match result {
            Ok(exit) => (exit.status.code(), exit.status.signal()),
            Err(_) => (None, None),
        };
        let how = match (child.stopped, kind) {
            (Some((Stop::Deadline, _)), _) => "killed: not LIVE by the handoff deadline".to_owned(),
            (Some((Stop::Overdue, _)), _) => {
                "killed: still draining past its parent-shutdown time".to_owned()
            }
            (Some((Stop::Shutdown, signal)), _) => format!("stopped ({signal})"),
            (None, ExitKind::DrainedParent) => "terminated by its child after draining".to_owned(),
            (None, ExitKind::Clean) => "exited 0".to_owned(),
            (None, ExitKind::Signal) => format!("killed by signal {}", signal.unwrap_or(0)),
            (None, ExitKind::Crash) => match result {
                Ok(exit) => format!("exited with code {}", exit.code()),
                Err(e) => e.to_string(),
            },
        };
        self.history.exit(envoy_agent_proxy::EpochExit {
            epoch: child.epoch,
            pid: child.pid,
            state: child.state,
            code,
            signal,
            how,
            at: SystemTime::now(),
        });
    }

    pub(super) fn stand_in_for(&mut self, parent_epoch: u32) {
        if self
            .stand_ins
            .iter()
            .any(|s| s.parent_epoch == parent_epoch)
        {
            return;
        }
        match self.host.stand_in(parent_epoch) {
            Ok(guard) => {
                tracing::info!(
                    event = "stand_in",
                    epoch = parent_epoch,
                    "standing in for the dead parent's hot-restart sockets"
                );
                self.stand_ins.push(StandIn {
                    parent_epoch,
                    _guard: guard,
                });
            }
            Err(e) => {
                tracing::error!(epoch = parent_epoch, error = %e, "cannot stand in for the dead parent")
            }
        }
    }

    /// Releases the stand-ins for the dead parents `which` selects.
    pub(super) fn release_stand_ins(&mut self, which: impl Fn(u32) -> bool, why: &str) {
        self.stand_ins.retain(|s| {
            let release = which(s.parent_epoch);
            if release {
                tracing::info!(
                    event = "stand_in_released",
                    parent_epoch = s.parent_epoch,
                    reason = why,
                    "released the dead parent's sockets"
                );
            }
            !release
        });
    }

    /// `expected`: the epoch was stopped while it initialized on purpose, so a flag it left
    /// is no wedge.
    pub(super) fn repair_initializing(&mut self, epoch: u32, expected: bool) {
        let Some(version) = self.version.known() else {
            // Only before our first epoch was LIVE: nothing serves, the family stops, and the
            // next epoch 0 makes a new segment.
            tracing::debug!(
                epoch,
                "hot-restart version unknown: shared memory left alone"
            );
            return;
        };
        match self.host.repair_initializing(version) {
            Repair::Clean => {}
            Repair::Cleared if expected => tracing::info!(
                event = "initializing_cleared",
                epoch,
                "cleared the shared INITIALIZING flag the stopped epoch left set"
            ),
            Repair::Cleared => self.record_wedge(
                WedgeReason::StaleInitializing,
                format!(
                    "epoch {epoch} died while initializing and left the shared INITIALIZING \
                     flag set (\"previous envoy process is still initializing\"); cleared it: \
                     the serving epoch keeps serving and the next hot restart can proceed"
                ),
            ),
            Repair::Failed(why) => self.record_wedge(
                WedgeReason::StaleInitializing,
                format!(
                    "epoch {epoch} died while initializing; the shared INITIALIZING flag could \
                     not be checked or cleared ({why}): a later hot restart may be refused by \
                     envoy until a cold start"
                ),
            ),
        }
    }

    pub(super) fn stopping_timers(&mut self, now: Instant, kill_at: Instant, give_up: Instant) {
        if now >= give_up {
            let left: Vec<u32> = self.epochs.iter().map(|c| c.pid).collect();
            tracing::error!(pids = ?left, "epochs did not stop in time; giving up on them");
            self.epochs = Epochs::default();
            self.forget_retired();
        } else if now >= kill_at {
            if let Life::Stopping { kill_at, .. } = &mut self.life {
                *kill_at = give_up;
            }
            let left: Vec<u32> = self.epochs.iter().map(|c| c.epoch).collect();
            for epoch in left {
                tracing::warn!(epoch, grace = ?self.config.proxy.options.stop_grace, "envoy ignored SIGTERM; sending SIGKILL");
                self.epochs
                    .signal(epoch, Signal::SIGKILL, Some(Stop::Shutdown));
            }
            self.stop_retired(Signal::SIGKILL);
        }
    }

    pub(super) fn begin_stop(&mut self, outcome: Ended, why: &str) {
        if matches!(self.life, Life::Stopping { .. }) {
            return;
        }
        tracing::info!(reason = why, "stopping every epoch");
        let now = Instant::now();
        self.set_marker(false);
        let error = RestartError::Refused("stopping".to_owned());
        self.queue.refuse(&error);
        let old = self.end_handoff_for_stop();
        self.watchdog.stop();
        self.signal_for_stop(&outcome);
        self.life = Life::Stopping {
            outcome,
            kill_at: now + self.config.proxy.options.stop_grace,
            give_up: now + self.config.proxy.options.stop_grace + STOP_BACKSTOP,
            live: self.life.live(),
            handed_over_to: self.life.handed_over_to().map(str::to_owned),
            old,
        };
        // Processes of ours outside the family: SIGTERM (none has a parent of ours to take
        // with it).
        self.stop_retired(Signal::SIGTERM);
        self.write_heartbeat();
    }

    /// The stop ends the handoff: what of ours runs outside the family, the stop takes over
    /// (returned); an attempt under way fails, and what was asked of it is answered.
    fn end_handoff_for_stop(&mut self) -> Epochs {
        let mut old = Epochs::default();
        let (attempt, deferred) = match std::mem::replace(&mut self.handoff, Handoff::Idle) {
            Handoff::PreFlight { attempt, .. } => (Some(attempt), None),
            Handoff::Starting {
                attempt, deferred, ..
            } => (Some(attempt), Some(deferred)),
            Handoff::Cold {
                attempt,
                child,
                deferred,
                ..
            } => {
                // Epoch 0 of its own family, no parent: SIGTERM stops it alone.
                old.add(0, child.pid, child.signals);
                (Some(attempt), Some(deferred))
            }
            Handoff::Retiring {
                old: OldFamily::Ours { epochs, .. },
                ..
            } => {
                old = epochs;
                (None, None)
            }
            _ => (None, None),
        };
        if let Some(attempt) = attempt {
            self.finish(
                attempt,
                Outcome::Failed,
                "the family is stopping".to_owned(),
            );
        }
        if let Some(deferred) = deferred {
            deferred.not_serving();
        }
        old
    }

    /// Signals every epoch of the family to stop (how hard depends on `outcome`).
    fn signal_for_stop(&mut self, outcome: &Ended) {
        // Newest first. An epoch that is not LIVE may have a living parent (here or in another
        // pod), which Envoy's SIGTERM handler would terminate too: it gets SIGKILL.
        let targets: Vec<(u32, EpochState)> = self
            .epochs
            .iter()
            .rev()
            .map(|c| (c.epoch, c.state))
            .collect();
        // A silent serving epoch would not act on SIGTERM either (a stopped one keeps it
        // pending, a stuck main thread never runs Envoy's handler): SIGKILL at once.
        let silent = match outcome {
            Ended::Wedged {
                reason: WedgeReason::AdminUnresponsive,
                ..
            } => self.life.live(),
            _ => None,
        };
        for (epoch, state) in targets {
            let signal = if (state == EpochState::Starting && epoch > 0) || silent == Some(epoch) {
                Signal::SIGKILL
            } else {
                Signal::SIGTERM
            };
            tracing::info!(epoch, %signal, "stopping epoch");
            self.epochs.signal(epoch, signal, Some(Stop::Shutdown));
        }
    }
}

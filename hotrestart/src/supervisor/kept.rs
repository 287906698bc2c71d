//! A draining parent kept through a crash of its child (issue 40).
//!
//! Seen on Envoy 1.40: when the serving epoch is killed while its parent drains, the parent
//! lives on. Its listeners were stopped at the child's LIVE (new connections are refused), its
//! admin listener was shut at the child's start, but its accepted connections keep being
//! served: an in-flight request completes. Nothing terminates it anymore (its child would
//! have, at `--parent-shutdown-time`). A fresh family (epoch 0) starts beside it under the
//! other base id (no shared memory or hot-restart socket in common; listeners through
//! `SO_REUSEPORT`, the configured admin address free) and serves at once.
//!
//! So, when the family ends because its serving epoch died and nothing else serves, with
//! [`Config::keep_draining_parent`](crate::Config) (`--restart-on-crash`: the family is run
//! again after the crash back-off):
//!
//! - **Keep**: the draining parent is taken out of the family's epochs before the stop, not
//!   signalled ([`KeptParent::Handed`]). The run ends as any crash does (the agent counts it
//!   and backs off); the parent goes on serving what it holds. The agent stands in for the
//!   dead child's hot-restart sockets until the parent is gone: a parent that forwards a QUIC
//!   packet to a child that is not there blocks its main thread for ever (the soak's eighth
//!   finding; see `absorber`), deaf to SIGTERM and to the drain notice.
//! - **Adopt**: the next run starts its family under the other base id, takes the parent into
//!   its own books ([`KeptParent::Draining`]); its exit, which its waiter sends to the old
//!   run's event channel, is passed on to the new run's.
//! - **Retire**: at the parent's own deadline (the parent-shutdown time after its child's
//!   LIVE, when that child would have terminated it) it gets SIGTERM (it has no living parent
//!   or child for the signal to reach), SIGKILL after `parent_overdue_grace`. A stop of the
//!   family meanwhile stops it with the rest.
//!
//! Without the flag the agent exits after the crash, and every Envoy must be gone first: the
//! parent is stopped with the family, as before. Without a cold base id
//! (`--no-cold-handover`) no fresh family can start beside it: it is stopped too.

use envoy_agent_proxy::Signal;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;

use super::{Event, Supervisor};
use crate::epochs::Stop;
use crate::handoff::{DrainingParent, Handoff, Moment};
use crate::host::{Guard, Host};

/// What becomes of a draining parent whose child (the serving epoch) died.
pub(crate) enum KeptParent {
    /// No parent is kept.
    None,
    /// This run ended and left the parent running: the next run adopts it under `base_id`'s
    /// other family.
    Handed {
        child: crate::epochs::Child,
        until: Moment,
        /// The base id the next run's family starts under.
        next_base_id: u32,
        /// The dead child's sockets, held while the parent lives (none if they could not be).
        stand_in: Option<Guard>,
    },
    /// This run adopted the parent; it goes at `until`.
    Draining {
        child: crate::epochs::Child,
        until: Instant,
        stage: Retire,
        stand_in: Option<Guard>,
    },
}

/// How far a kept parent's retirement went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retire {
    /// Before its deadline: it finishes its in-flight requests.
    Waiting,
    /// Sent SIGTERM at its deadline.
    Terminated,
    /// Sent SIGKILL: it ignored SIGTERM past the grace.
    Killed,
}

impl<H: Host> Supervisor<H> {
    /// The serving epoch died and nothing else serves (the family is about to stop): keep our
    /// draining parent running for the next run, when allowed and possible.
    pub(super) fn keep_draining_parent(&mut self) {
        if !self.config.keep_draining_parent {
            return;
        }
        let Handoff::ParentDraining {
            parent: DrainingParent::Ours(parent),
            until,
        } = &self.handoff
        else {
            return;
        };
        let (parent, until) = (*parent, *until);
        if self.epochs.get(parent).is_none_or(|c| c.stopped.is_some()) {
            return;
        }
        let Some(next_base_id) = self.base_id_beside() else {
            tracing::warn!(
                epoch = parent,
                "no other base id (cold handovers are off): the draining parent is stopped with the family"
            );
            return;
        };
        let Some(pid) = self.epochs.get(parent).map(|c| c.pid) else {
            return;
        };
        let Some(child) = self.epochs.remove(parent, pid) else {
            return;
        };
        self.handoff = Handoff::Idle;
        tracing::info!(
            event = "draining_parent_kept",
            epoch = parent,
            pid,
            until_ms = until
                .at
                .saturating_duration_since(Instant::now())
                .as_millis() as u64,
            next_base_id,
            "the serving epoch died while its parent drains: the parent keeps its in-flight requests until its deadline; the next family starts beside it"
        );
        let stand_in = self.stand_in_for_dead_child(parent + 1);
        self.kept = KeptParent::Handed {
            child,
            until,
            next_base_id,
            stand_in,
        };
    }

    /// Binds the dead `child_epoch`'s hot-restart sockets (the family's, before the next run
    /// moves to the other base id) so that its kept parent's sends go through.
    fn stand_in_for_dead_child(&mut self, child_epoch: u32) -> Option<Guard> {
        match self.host.stand_in_for_child(child_epoch) {
            Ok(guard) => {
                tracing::info!(
                    event = "stand_in",
                    epoch = child_epoch,
                    role = "child",
                    "standing in for the dead child's hot-restart sockets while its parent drains"
                );
                Some(guard)
            }
            Err(e) => {
                tracing::warn!(
                    event = "stand_in_failed",
                    epoch = child_epoch,
                    role = "child",
                    error = %e,
                    "cannot stand in for the dead child's hot-restart sockets: its parent may stop answering signals if it forwards a QUIC packet there"
                );
                None
            }
        }
    }

    /// The base id a family beside the running one takes (the families alternate between
    /// `--base-id` and `--cold-base-id`).
    fn base_id_beside(&self) -> Option<u32> {
        let cold = self.config.options.cold_base_id?;
        let configured = self.config.proxy.hot_restart.as_ref()?.base_id;
        Some(if self.base_id == cold {
            configured
        } else {
            cold
        })
    }

    /// At the start of a run: adopts the parent the last run kept, and starts under the base
    /// id beside it.
    pub(super) fn adopt_kept_parent(&mut self) {
        let KeptParent::Handed {
            child,
            until,
            next_base_id,
            stand_in,
        } = std::mem::replace(&mut self.kept, KeptParent::None)
        else {
            return;
        };
        self.set_base_id(next_base_id);
        self.host.switch_family(next_base_id, false);
        let (epoch, pid) = (child.epoch, child.pid);
        tracing::info!(
            event = "kept_parent_adopted",
            epoch,
            pid,
            base_id = next_base_id,
            "a draining parent of the crashed family still serves its in-flight requests; this family starts beside it"
        );
        self.kept = KeptParent::Draining {
            child,
            until: until.at,
            stage: Retire::Waiting,
            stand_in,
        };
    }

    /// When the kept parent's retirement needs the loop next.
    pub(super) fn kept_wake(&self) -> Option<Instant> {
        match &self.kept {
            KeptParent::Draining {
                until,
                stage: Retire::Waiting,
                ..
            } => Some(*until),
            KeptParent::Draining {
                until,
                stage: Retire::Terminated,
                ..
            } => Some(*until + self.config.parent_overdue_grace),
            _ => None,
        }
    }

    /// Terminates the kept parent at its deadline, kills it past the grace.
    pub(super) fn kept_timers(&mut self, now: Instant) {
        let grace = self.config.parent_overdue_grace;
        let KeptParent::Draining {
            child,
            until,
            stage,
            ..
        } = &mut self.kept
        else {
            return;
        };
        let signal = match *stage {
            Retire::Waiting if now >= *until => {
                *stage = Retire::Terminated;
                Signal::SIGTERM
            }
            Retire::Terminated if now >= *until + grace => {
                *stage = Retire::Killed;
                Signal::SIGKILL
            }
            _ => return,
        };
        tracing::info!(event = "kept_parent_retired", epoch = child.epoch, %signal, "the kept parent's deadline passed");
        child.signal(signal, Some(Stop::Overdue));
    }

    /// The kept parent exited: nothing is left of the old run.
    pub(super) fn kept_gone(&mut self, epoch: u32, stand_in: Option<Guard>) {
        if stand_in.is_some() {
            tracing::info!(
                event = "stand_in_released",
                epoch = epoch + 1,
                role = "child",
                "the kept parent is gone: its dead child's sockets are let go"
            );
        }
        drop(stand_in);
    }
}

/// The kept parent's waiter sends its exit to the run that kept it: its process exits are
/// passed on to the next run's channel (the rest, answers to the last run's questions, are
/// moot). The task ends once nothing of the last run can send anymore: the parent is gone.
pub(super) fn forward_exits(
    mut last_run: mpsc::UnboundedReceiver<Event>,
    next_run: mpsc::UnboundedSender<Event>,
) {
    tokio::spawn(
        async move {
            while let Some(event) = last_run.recv().await {
                if matches!(event, Event::Exited { .. }) && next_run.send(event).is_err() {
                    return;
                }
            }
        }
        .instrument(tracing::info_span!("kept_parent_exits")),
    );
}

//! The family's history: the last handoffs, process exits and wedges, as the status shows
//! them.
//!
//! History is what a fresh family inherits from the one before it (crash recovery in place,
//! see [`Supervisor::into_fresh`]): everything else of a run is its own. Each list keeps only
//! its last few entries, oldest first, so a long life costs no more than a short one. The
//! last handoff is the newest entry of the handoffs, not a second record of it.

use std::time::SystemTime;

use envoy_agent_proxy::{EpochExit, HandoffResult, Outcome, Wedge, WedgeReason};

use super::Supervisor;
use crate::host::Host;

/// Wedges kept in the published state.
const WEDGES_KEPT: usize = 16;

/// The family's last handoffs, exits and wedges.
#[derive(Debug, Default)]
pub(super) struct History {
    /// At most [`envoy_agent_proxy::HISTORY_KEPT`], oldest first.
    handoffs: Vec<HandoffResult>,
    /// At most [`envoy_agent_proxy::HISTORY_KEPT`], oldest first.
    exits: Vec<EpochExit>,
    /// At most [`WEDGES_KEPT`], oldest first.
    wedges: Vec<Wedge>,
}

impl History {
    pub(super) fn handoff(&mut self, result: HandoffResult) {
        push_bounded(&mut self.handoffs, result, envoy_agent_proxy::HISTORY_KEPT);
    }

    pub(super) fn exit(&mut self, exit: EpochExit) {
        push_bounded(&mut self.exits, exit, envoy_agent_proxy::HISTORY_KEPT);
    }

    pub(super) fn wedge(&mut self, wedge: Wedge) {
        push_bounded(&mut self.wedges, wedge, WEDGES_KEPT);
    }

    pub(super) fn handoffs(&self) -> &[HandoffResult] {
        &self.handoffs
    }

    pub(super) fn exits(&self) -> &[EpochExit] {
        &self.exits
    }

    pub(super) fn wedges(&self) -> &[Wedge] {
        &self.wedges
    }

    pub(super) fn last_handoff(&self) -> Option<&HandoffResult> {
        self.handoffs.last()
    }

    pub(super) fn last_exit(&self) -> Option<&EpochExit> {
        self.exits.last()
    }

    /// The last handoff that handed the family over to a new epoch or family (not a fresh
    /// start), as the heartbeat tells the node.
    pub(super) fn last_handover(&self) -> Option<&HandoffResult> {
        self.handoffs
            .iter()
            .rev()
            .find(|h| h.outcome == Outcome::Live)
            // Told by how it started, not by its reason: a user's restart may say `start`.
            .filter(|h| !h.fresh_start)
    }
}

/// Appends `item`, dropping the oldest beyond `kept`.
fn push_bounded<T>(list: &mut Vec<T>, item: T, kept: usize) {
    list.push(item);
    let excess = list.len().saturating_sub(kept);
    list.drain(..excess);
}

impl<H: Host> Supervisor<H> {
    /// Logs, counts and keeps a wedge.
    pub(super) fn record_wedge(&mut self, reason: WedgeReason, message: String) {
        tracing::error!(event = "wedge", reason = %reason, error = %message, "hot restart wedge");
        self.metrics.wedge(reason.as_str());
        self.history.wedge(Wedge {
            reason,
            at: SystemTime::now(),
            message,
        });
    }
}

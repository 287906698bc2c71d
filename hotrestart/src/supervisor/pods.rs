//! The node's other pods as this family knows them: the predecessor it took over from (or
//! started beside), how long that predecessor's Envoy still drains as our first epoch's parent,
//! and a successor that announces itself.
//!
//! These are facts learned from events (a discovery, a LIVE takeover, a heartbeat read), kept
//! for the status and for the pace of the watchdog: nothing here decides on its own. That a
//! successor took over is not kept here: it is the supervisor's life
//! (`Life::HandedOver`), which the status reads.

use std::time::SystemTime;

/// What this family knows of the node's other pods.
#[derive(Debug, Default)]
pub(super) struct Pods {
    /// The pod our first epoch took over from, or started a family beside.
    predecessor: Option<String>,
    /// Until when the predecessor's Envoy drains as our first epoch's parent. Told as it was
    /// planned at LIVE (a stop meanwhile does not take it back).
    foreign_parent_until: Option<SystemTime>,
    /// A successor pod that is starting (its heartbeat says so).
    successor_starting: Option<String>,
}

impl Pods {
    pub(super) fn predecessor(&self) -> Option<&str> {
        self.predecessor.as_deref()
    }

    /// Our first epoch takes over from `who`'s Envoy, or starts a family beside it.
    pub(super) fn predecessor_is(&mut self, who: String) {
        self.predecessor = Some(who);
    }

    pub(super) fn foreign_parent_until(&self) -> Option<SystemTime> {
        self.foreign_parent_until
    }

    /// Our first epoch went LIVE: the predecessor's Envoy drains until `until`.
    pub(super) fn foreign_parent_drains(&mut self, until: SystemTime) {
        self.foreign_parent_until = Some(until);
    }

    /// The predecessor's Envoy's drain time is over.
    pub(super) fn foreign_parent_gone(&mut self) {
        self.foreign_parent_until = None;
    }

    pub(super) fn successor_starting(&self) -> Option<&str> {
        self.successor_starting.as_deref()
    }

    /// What the node's heartbeats say of a successor now; whether that changed.
    pub(super) fn successor_seen(&mut self, successor: Option<String>) -> bool {
        let changed = successor != self.successor_starting;
        self.successor_starting = successor;
        changed
    }

    /// The successor took over: it is no longer starting (the life says who serves).
    pub(super) fn successor_took_over(&mut self) {
        self.successor_starting = None;
    }
}

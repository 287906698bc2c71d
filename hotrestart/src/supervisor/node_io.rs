//! The node and the pod: heartbeats (read and written), the readiness marker.
//!
//! The node's files are the only way pods of the node know of each other, and each write is
//! a syscall on every period: [`NodeFiles`] keeps what was written last, so an unchanged
//! heartbeat is only touched (readers take the file's modification time as its freshness),
//! a marker only changes when readiness does, and an untrusted file is reported once.

use envoy_agent_proxy::HandoffKind;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;
use tokio::time::Instant;

use super::{Life, Supervisor};
use crate::handoff::Handoff;
use crate::host::Host;
use crate::node;
use crate::node::{Heartbeat, NodeState};

/// What the supervisor wrote to the node and the pod, and what of the node's files it
/// already reported.
#[derive(Debug)]
pub(super) struct NodeFiles {
    /// When the node is read and our heartbeat written next.
    heartbeat_due: Instant,
    /// The heartbeat last written, and when: an unchanged one is rewritten only every other
    /// period (readers allow four).
    written: Option<(Heartbeat, Instant)>,
    /// Whether the readiness marker is present, as last set.
    marker: bool,
    /// Heartbeat files already reported as untrusted (each once).
    reported: BTreeSet<(PathBuf, String)>,
}

/// What writing a heartbeat takes, after the one last written.
pub(super) enum Write {
    /// It says the same and is fresh.
    Nothing,
    /// It says the same: touching the file makes it fresh.
    Touch,
    Whole,
}

impl NodeFiles {
    /// A heartbeat due at `now`, the marker absent.
    pub(super) fn new(now: Instant) -> Self {
        NodeFiles {
            heartbeat_due: now,
            written: None,
            marker: false,
            reported: BTreeSet::new(),
        }
    }

    pub(super) fn heartbeat_due(&self) -> Instant {
        self.heartbeat_due
    }

    /// Whether the heartbeat's turn came at `now` (early by half an `interval`, to share a
    /// wake-up); the next turn is then an `interval` away.
    fn heartbeat_turn(&mut self, now: Instant, interval: Duration) -> bool {
        let due = now + interval / 2 >= self.heartbeat_due;
        if due {
            self.heartbeat_due = now + interval;
        }
        due
    }

    /// What writing `heartbeat` at `now` takes (`period`: the heartbeat period).
    fn heartbeat_write(&self, heartbeat: &Heartbeat, now: Instant, period: Duration) -> Write {
        let Some((last, at)) = &self.written else {
            return Write::Whole;
        };
        let same = Heartbeat {
            updated_unix_ms: last.updated_unix_ms,
            ..heartbeat.clone()
        } == *last;
        match same {
            true if now < *at + period => Write::Nothing,
            true => Write::Touch,
            false => Write::Whole,
        }
    }

    fn heartbeat_touched(&mut self, now: Instant) {
        if let Some((_, at)) = &mut self.written {
            *at = now;
        }
    }

    fn heartbeat_written(&mut self, heartbeat: Heartbeat, now: Instant) {
        self.written = Some((heartbeat, now));
    }

    pub(super) fn marker(&self) -> bool {
        self.marker
    }

    /// The marker is `present` now; whether that changed.
    fn marker_set(&mut self, present: bool) -> bool {
        std::mem::replace(&mut self.marker, present) != present
    }

    /// Whether the untrusted file `path` is reported for `reason` for the first time.
    fn first_report(&mut self, path: PathBuf, reason: String) -> bool {
        self.reported.insert((path, reason))
    }
}

impl<H: Host> Supervisor<H> {
    /// The node's other fresh heartbeats of our family; notes a starting successor and reports
    /// each untrusted file once.
    pub(super) fn read_node(&mut self) -> Vec<Heartbeat> {
        if !self.host.has_node() {
            return Vec::new();
        }
        let (heartbeats, rejected) = self.host.read_heartbeats(&self.config.identity);
        for r in rejected {
            if self.files.first_report(r.path.clone(), r.reason.clone()) {
                tracing::warn!(event = "heartbeat_rejected", path = %r.path.display(), reason = %r.reason, "ignoring a heartbeat file");
            }
        }
        let now_ms = self.host.now_unix_ms();
        let max_age = self.config.heartbeat_period * 4;
        let skew = crate::node::CLOCK_SKEW.as_millis() as u64;
        let mut future = Vec::new();
        let others: Vec<Heartbeat> = heartbeats
            .into_iter()
            .filter(|h| h.identity != self.config.identity && self.ours(h.base_id))
            .filter(|h| {
                if h.updated_unix_ms > now_ms + skew {
                    future.push(h.identity.clone());
                }
                h.fresh(now_ms, max_age)
            })
            .collect();
        for identity in future {
            // Fresh forever if trusted: never.
            let reason = "stamped in the future: not trusted".to_owned();
            if self
                .files
                .first_report(std::path::PathBuf::from(&identity), reason.clone())
            {
                tracing::warn!(event = "heartbeat_rejected", %identity, %reason, "ignoring a heartbeat");
            }
        }
        if self.life.running() {
            // Our newest epoch, starting or not: a pod with a newer one is a successor (taking
            // over, or already serving), never a predecessor.
            let ours = [
                self.life.live(),
                self.epochs.newest().map(|c| c.epoch),
                self.handoff.attempt().map(|a| a.epoch),
            ]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(0);
            let successor = others
                .iter()
                .find(|h| {
                    matches!(h.state, NodeState::Starting | NodeState::Serving)
                        && h.newest_epoch > ours
                })
                .map(|h| h.identity.clone());
            if self.pods.successor_seen(successor) {
                if let Some(s) = self.pods.successor_starting() {
                    tracing::info!(successor = %s, "a successor pod is starting");
                    // See its takeover soon.
                    if self.life.live().is_some() {
                        self.watchdog.check_soon(Instant::now());
                    }
                }
            }
            let cold = others
                .iter()
                .find(|h| {
                    h.state == NodeState::Serving
                        && h.cold_takeover_of.as_deref() == Some(self.config.identity.as_str())
                })
                .map(|h| h.identity.clone());
            if let Some(successor) = cold {
                self.hand_over_cold(successor);
            }
        }
        others
    }

    /// The configured admin address, as a heartbeat says it
    /// ([`crate::node::Heartbeat::admin_address`]): every pod of the node must have the same.
    pub(super) fn admin_address(&self) -> String {
        self.config
            .proxy
            .admin
            .known()
            .map(|a| a.to_string())
            .unwrap_or_default()
    }

    /// Reads the node and writes our heartbeat when it is due.
    pub(super) fn heartbeat_timer(&mut self, now: Instant) {
        // Early rather than a wake-up of its own when something else woke us (each wake-up
        // costs more than the work); every other period while nothing happens (a heartbeat is
        // fresh for four).
        let steady = self.life.serving().is_some()
            && self.handoff.is_idle()
            && self.pods.successor_starting().is_none();
        let interval = self.config.heartbeat_period * if steady { 2 } else { 1 };
        if self.host.has_node() && self.files.heartbeat_turn(now, interval) {
            self.read_node();
            self.write_heartbeat();
        }
    }

    /// Writes our heartbeat, unless the one last written says the same and is fresh (an
    /// unchanged one is only touched, every period).
    pub(super) fn write_heartbeat(&mut self) {
        if !self.host.has_node() {
            return;
        }
        let now = Instant::now();
        let heartbeat = self.heartbeat(now);
        match self
            .files
            .heartbeat_write(&heartbeat, now, self.config.heartbeat_period)
        {
            Write::Nothing => return,
            // Unchanged: readers take the file's modification time as its freshness.
            Write::Touch if self.host.touch_heartbeat(&self.config.identity).is_ok() => {
                self.files.heartbeat_touched(now);
                return;
            }
            Write::Touch | Write::Whole => {}
        }
        match self.host.write_heartbeat(&heartbeat) {
            Ok(()) => self.files.heartbeat_written(heartbeat, now),
            Err(e) => tracing::error!(error = %e, "cannot write the heartbeat"),
        }
    }

    /// Our heartbeat as of `now`.
    fn heartbeat(&self, now: Instant) -> Heartbeat {
        let (state, newest) = self.node_state();
        let parent_until = match &self.handoff {
            Handoff::ParentDraining { until, .. } if until.at > now => until.unix_ms(),
            _ => 0,
        };
        Heartbeat {
            format: node::FORMAT.to_owned(),
            identity: self.config.identity.clone(),
            pid: std::process::id(),
            base_id: self.base_id,
            // The file says an unknown version with an empty one.
            hot_restart_version: self.version.known().unwrap_or_default().to_owned(),
            newest_epoch: newest,
            envoy_pid: self.epochs.get(newest).map_or(0, |c| c.pid),
            state,
            updated_unix_ms: self.host.now_unix_ms(),
            parent_draining_until_unix_ms: parent_until,
            restart_in_flight: self.life.live().is_some() && self.handoff.attempt().is_some(),
            cold_takeover_of: self.handoff.cold_takeover_of().map(str::to_owned),
            handover: self.history.last_handover().map(|h| node::Handover {
                kind: h.kind.as_str().to_owned(),
                why: match &h.kind {
                    HandoffKind::Cold { why, .. } => why.clone(),
                    HandoffKind::Hot => String::new(),
                },
            }),
            socket_path: self.host.socket_path().to_string(),
            admin_address: self.admin_address(),
            generation: self.config.options.generation,
        }
    }

    /// What our heartbeat tells of our life, and of which epoch.
    fn node_state(&self) -> (NodeState, u32) {
        let newest = || self.epochs.newest().map_or(0, |c| c.epoch);
        match &self.life {
            Life::Discovering { .. } => (NodeState::Waiting, 0),
            Life::Starting | Life::Serving { .. } => {
                match (self.life.live(), self.handoff.attempt()) {
                    (Some(n), _) => (NodeState::Serving, n),
                    (None, Some(a)) => (NodeState::Starting, a.epoch),
                    (None, None) => (NodeState::Starting, newest()),
                }
            }
            Life::HandedOver { .. } => (NodeState::HandedOver, newest()),
            Life::Stopping { .. } => (NodeState::Stopping, newest()),
        }
    }

    /// The readiness marker: our newest epoch LIVE with its config (the control plane's word),
    /// answering (the watchdog's), not drained (an order).
    pub(super) fn refresh_marker(&mut self) {
        let present = self.life.running()
            && self.life.live().is_some()
            && !self.orders.drained()
            && self.control_plane.status().ready().is_ok()
            && self.watchdog.answering();
        if present || self.files.marker() {
            self.set_marker(present);
        }
    }

    pub(super) fn set_marker(&mut self, present: bool) {
        if let Err(e) = self.host.set_marker(present) {
            tracing::error!(error = %e, "cannot update the readiness marker");
        }
        if self.files.marker_set(present) {
            tracing::info!(event = "ready_marker", ready = present, "readiness marker");
        }
    }
}

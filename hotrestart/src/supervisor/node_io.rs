//! The node and the pod: heartbeats (read and written), the readiness marker.

use envoy_agent_proxy::HandoffKind;
use tokio::time::Instant;

use super::{Life, Supervisor};
use crate::handoff::Handoff;
use crate::host::Host;
use crate::node;
use crate::node::{Heartbeat, NodeState};

impl<H: Host> Supervisor<H> {
    /// The node's other fresh heartbeats of our family; notes a starting successor and reports
    /// each untrusted file once.
    pub(super) fn read_node(&mut self) -> Vec<Heartbeat> {
        if !self.host.has_node() {
            return Vec::new();
        }
        let (heartbeats, rejected) = self.host.read_heartbeats(&self.config.identity);
        for r in rejected {
            if self.reported.insert((r.path.clone(), r.reason.clone())) {
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
                .reported
                .insert((std::path::PathBuf::from(&identity), reason.clone()))
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

    pub(super) fn write_heartbeat(&mut self) {
        if !self.host.has_node() {
            return;
        }
        let (state, newest) = match &self.life {
            Life::Discovering { .. } => (NodeState::Waiting, 0),
            Life::Starting | Life::Serving { .. } => {
                match (self.life.live(), self.handoff.attempt()) {
                    (Some(n), _) => (NodeState::Serving, n),
                    (None, Some(a)) => (NodeState::Starting, a.epoch),
                    (None, None) => (
                        NodeState::Starting,
                        self.epochs.newest().map_or(0, |c| c.epoch),
                    ),
                }
            }
            Life::HandedOver { .. } => (
                NodeState::HandedOver,
                self.epochs.newest().map_or(0, |c| c.epoch),
            ),
            Life::Stopping { .. } => (
                NodeState::Stopping,
                self.epochs.newest().map_or(0, |c| c.epoch),
            ),
        };
        let now = Instant::now();
        let now_ms = self.host.now_unix_ms();
        let parent_until = match &self.handoff {
            Handoff::ParentDraining { until, .. } if until.at > now => until.unix_ms(),
            _ => 0,
        };
        let heartbeat = Heartbeat {
            format: node::FORMAT.to_owned(),
            identity: self.config.identity.clone(),
            pid: std::process::id(),
            base_id: self.base_id,
            // The file says an unknown version with an empty one.
            hot_restart_version: self.version.known().unwrap_or_default().to_owned(),
            newest_epoch: newest,
            envoy_pid: self.epochs.get(newest).map_or(0, |c| c.pid),
            state,
            updated_unix_ms: now_ms,
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
            generation: self.config.generation,
        };
        if let Some((last, at)) = &mut self.heartbeat_written {
            let same = Heartbeat {
                updated_unix_ms: last.updated_unix_ms,
                ..heartbeat.clone()
            } == *last;
            if same && now < *at + self.config.heartbeat_period {
                return;
            }
            // Unchanged: readers take the file's modification time as its freshness.
            if same && self.host.touch_heartbeat(&self.config.identity).is_ok() {
                *at = now;
                return;
            }
        }
        match self.host.write_heartbeat(&heartbeat) {
            Ok(()) => self.heartbeat_written = Some((heartbeat, now)),
            Err(e) => tracing::error!(error = %e, "cannot write the heartbeat"),
        }
    }

    pub(super) fn set_marker(&mut self, present: bool) {
        if let Err(e) = self.host.set_marker(present) {
            tracing::error!(error = %e, "cannot update the readiness marker");
        }
        if self.marker != present {
            tracing::info!(event = "ready_marker", ready = present, "readiness marker");
            self.marker = present;
        }
    }
}

//! The family's Envoy processes, one per restart epoch, as the supervisor sees them.
//!
//! Plain data: the supervisor decides, this keeps the books. Signals go through each
//! process's own channel, which delivers them only while the process is unreaped, so a
//! signal can never reach a process that took over a recycled pid.

use std::time::SystemTime;

use envoy_agent_proxy::{EpochInfo, EpochState, Signal};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Why the supervisor stopped (or is stopping) a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// A new epoch that missed the handoff deadline (SIGKILL).
    Deadline,
    /// A draining parent past its parent-shutdown time and grace (SIGKILL).
    Overdue,
    /// Stopping the family.
    Shutdown,
}

/// One Envoy process.
#[derive(Debug)]
pub(crate) struct Child {
    pub(crate) epoch: u32,
    pub(crate) pid: u32,
    pub(crate) state: EpochState,
    pub(crate) started: SystemTime,
    pub(crate) started_at: Instant,
    pub(crate) since: SystemTime,
    signals: mpsc::UnboundedSender<Signal>,
    /// Set once the supervisor sent it a stopping signal.
    pub(crate) stopped: Option<(Stop, Signal)>,
}

impl Child {
    /// Sends `signal`, remembering why when it stops the process.
    pub(crate) fn signal(&mut self, signal: Signal, stop: Option<Stop>) {
        if let Some(why) = stop {
            self.stopped = Some((why, signal));
        }
        let _ = self.signals.send(signal);
    }

    pub(crate) fn info(&self) -> EpochInfo {
        EpochInfo {
            epoch: self.epoch,
            pid: self.pid,
            state: self.state,
            started: self.started,
            since: self.since,
        }
    }
}

/// Every process of the family that has not been reaped yet.
#[derive(Debug, Default)]
pub(crate) struct Epochs {
    children: Vec<Child>,
}

impl Epochs {
    pub(crate) fn add(&mut self, epoch: u32, pid: u32, signals: mpsc::UnboundedSender<Signal>) {
        let now = SystemTime::now();
        self.children.push(Child {
            epoch,
            pid,
            state: EpochState::Starting,
            started: now,
            started_at: Instant::now(),
            since: now,
            signals,
            stopped: None,
        });
        self.children.sort_by_key(|c| c.epoch);
    }

    pub(crate) fn remove(&mut self, epoch: u32, pid: u32) -> Option<Child> {
        let i = self
            .children
            .iter()
            .position(|c| c.epoch == epoch && c.pid == pid)?;
        Some(self.children.remove(i))
    }

    pub(crate) fn get(&self, epoch: u32) -> Option<&Child> {
        self.children.iter().find(|c| c.epoch == epoch)
    }

    pub(crate) fn get_mut(&mut self, epoch: u32) -> Option<&mut Child> {
        self.children.iter_mut().find(|c| c.epoch == epoch)
    }

    pub(crate) fn set_state(&mut self, epoch: u32, state: EpochState) {
        if let Some(c) = self.get_mut(epoch) {
            c.state = state;
            c.since = SystemTime::now();
            tracing::info!(
                event = "epoch_state",
                epoch,
                pid = c.pid,
                state = state.as_str(),
                "epoch state"
            );
        }
    }

    /// Sends `signal` to `epoch`'s process, remembering why when it stops it.
    pub(crate) fn signal(&mut self, epoch: u32, signal: Signal, stop: Option<Stop>) {
        if let Some(c) = self.get_mut(epoch) {
            c.signal(signal, stop);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.children.is_empty()
    }

    pub(crate) fn iter(&self) -> std::slice::Iter<'_, Child> {
        self.children.iter()
    }

    pub(crate) fn iter_mut(&mut self) -> std::slice::IterMut<'_, Child> {
        self.children.iter_mut()
    }

    /// The newest process.
    pub(crate) fn newest(&self) -> Option<&Child> {
        self.children.last()
    }

    pub(crate) fn infos(&self) -> Vec<EpochInfo> {
        self.children.iter().map(Child::info).collect()
    }
}

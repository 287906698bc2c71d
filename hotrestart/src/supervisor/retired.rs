//! Processes of ours outside the family, each held by the state it belongs to, read here as
//! one book:
//!
//! - the old family a cold handover retires: `Handoff::Retiring { old: OldFamily::Ours {
//!   epochs, .. }, .. }`, which ends when the last of them is gone;
//! - a draining parent kept through its child's crash: `KeptParent::Draining { child, .. }`,
//!   with its own deadline;
//! - once stopping, what the stop took over from the handoff (that old family, or a cold
//!   family that never became ours): `Life::Stopping { old, .. }`.
//!
//! What the status shows as `retiring`, whose exit an exit is, what the stop signals and
//! when the supervisor is done all read them through these functions.

use envoy_agent_proxy::{EpochInfo, Signal};

use super::kept::KeptParent;
use super::{Life, Supervisor};
use crate::epochs::{Child, Epochs, Stop};
use crate::handoff::{Handoff, OldFamily};
use crate::host::{Guard, Host};

/// Where a retired process that exited was held.
pub(super) enum Retired {
    /// The old family of a cold handover of ours.
    OldFamily,
    /// The kept parent, with the stand-in for its dead child's sockets (let go now).
    Kept { stand_in: Option<Guard> },
    /// Taken over by the stop.
    Stopping,
}

impl<H: Host> Supervisor<H> {
    /// The old family's processes while a cold handover of ours retires it.
    fn old_family_mut(&mut self) -> Option<&mut Epochs> {
        match &mut self.handoff {
            Handoff::Retiring {
                old: OldFamily::Ours { epochs, .. },
                ..
            } => Some(epochs),
            _ => None,
        }
    }

    fn stopping_mut(&mut self) -> Option<&mut Epochs> {
        match &mut self.life {
            Life::Stopping { old, .. } => Some(old),
            _ => None,
        }
    }

    /// Every retired process.
    pub(super) fn retired(&self) -> impl Iterator<Item = &Child> {
        let old = match &self.handoff {
            Handoff::Retiring {
                old: OldFamily::Ours { epochs, .. },
                ..
            } => Some(epochs),
            _ => None,
        };
        let kept = match &self.kept {
            KeptParent::Draining { child, .. } => Some(child),
            _ => None,
        };
        let stopping = match &self.life {
            Life::Stopping { old, .. } => Some(old),
            _ => None,
        };
        old.into_iter()
            .flat_map(Epochs::iter)
            .chain(kept)
            .chain(stopping.into_iter().flat_map(Epochs::iter))
    }

    /// What the status shows as retiring, by epoch.
    pub(super) fn retired_infos(&self) -> Vec<EpochInfo> {
        let mut infos: Vec<EpochInfo> = self.retired().map(Child::info).collect();
        infos.sort_by_key(|e| e.epoch);
        infos
    }

    /// The retired process `pid` (of `epoch`), taken out of its books when it exited.
    pub(super) fn take_retired(&mut self, epoch: u32, pid: u32) -> Option<(Child, Retired)> {
        if let Some(child) = self.old_family_mut().and_then(|e| e.remove(epoch, pid)) {
            return Some((child, Retired::OldFamily));
        }
        if matches!(&self.kept, KeptParent::Draining { child, .. } if child.epoch == epoch && child.pid == pid)
        {
            if let KeptParent::Draining {
                child, stand_in, ..
            } = std::mem::replace(&mut self.kept, KeptParent::None)
            {
                return Some((child, Retired::Kept { stand_in }));
            }
        }
        let child = self.stopping_mut()?.remove(epoch, pid)?;
        Some((child, Retired::Stopping))
    }

    /// Sends `signal` to every retired process: the family stops.
    pub(super) fn stop_retired(&mut self, signal: Signal) {
        if let Some(old) = self.old_family_mut() {
            for child in old.iter_mut() {
                tracing::info!(epoch = child.epoch, %signal, "stopping the old family's epoch");
                child.signal(signal, Some(Stop::Shutdown));
            }
        }
        if let KeptParent::Draining { child, .. } = &mut self.kept {
            tracing::info!(epoch = child.epoch, %signal, "stopping the kept parent");
            child.signal(signal, Some(Stop::Shutdown));
        }
        if let Some(old) = self.stopping_mut() {
            for child in old.iter_mut() {
                tracing::info!(epoch = child.epoch, %signal, "stopping the old family's epoch");
                child.signal(signal, Some(Stop::Shutdown));
            }
        }
    }

    /// Gives up waiting for every retired process (the stop's backstop passed).
    pub(super) fn forget_retired(&mut self) {
        if let Some(old) = self.old_family_mut() {
            *old = Epochs::default();
        }
        if let Some(old) = self.stopping_mut() {
            *old = Epochs::default();
        }
        self.kept = KeptParent::None;
    }
}

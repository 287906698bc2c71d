//! When the supervisor's next admin probe of a kind (the watchdog's, a control plane reading,
//! a starting epoch's LIVE check) is due: shared by the supervisor and the handoff's LIVE
//! checks, so that neither module needs the other for it.

use tokio::time::Instant;

/// When the next admin probe of a kind is due, and whether one is out.
#[derive(Debug, Default)]
pub(crate) struct Probing {
    pub(crate) next: Option<Instant>,
    pub(crate) in_flight: bool,
}

impl Probing {
    pub(crate) fn due(&self, now: Instant) -> bool {
        !self.in_flight && self.next.is_some_and(|t| t <= now)
    }

    pub(crate) fn wake(&self) -> Option<Instant> {
        self.next.filter(|_| !self.in_flight)
    }
}

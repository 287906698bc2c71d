//! The bound on a server's open connections (the status server's, TCP gRPC's): at most
//! [`MAX_CONNECTIONS`] at once, the oldest told to close to make room for a new one.
//!
//! Any process on the node reaches a loopback port (with hostNetwork, every pod's too). A
//! flood of idle connections must neither exhaust the agent's descriptors (it needs them for
//! Envoy's admin, files and children) nor keep a legitimate client out: refusing new
//! connections past a cap would let the flood keep the kubelet's probe out, closing the
//! oldest never does. A connection admitted here holds an [`Admitted`]; dropping it frees its
//! place.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio_util::sync::CancellationToken;

/// The most connections a server holds at once: far more than its clients (the kubelet's
/// probes, a scraper, an operator, a controller) and far fewer than the agent's open files (it
/// raises its soft limit to the hard one at start).
pub(crate) const MAX_CONNECTIONS: usize = 256;

/// A server's open connections, oldest first.
#[derive(Debug, Clone)]
pub(crate) struct Connections {
    server: &'static str,
    live: Arc<Mutex<Live>>,
}

#[derive(Debug, Default)]
struct Live {
    next: u64,
    open: std::collections::VecDeque<(u64, CancellationToken)>,
    /// Whether connections are being closed for room (logged once per burst).
    evicting: bool,
}

/// An admitted connection's place: `closing` fires when it must close for room (or when the
/// token it was made from fires); dropped, it leaves.
#[derive(Debug)]
pub(crate) struct Admitted {
    id: u64,
    pub(crate) closing: CancellationToken,
    live: Arc<Mutex<Live>>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let id = self.id;
        lock(&self.live).open.retain(|(i, _)| *i != id);
    }
}

impl Connections {
    /// The connections of the server named `server` (for its logs).
    pub(crate) fn new(server: &'static str) -> Self {
        Connections {
            server,
            live: Arc::default(),
        }
    }

    /// Admits a connection from `peer`, whose `closing` is a child of `parent`; the oldest is
    /// told to close when there is no room.
    pub(crate) fn admit(&self, parent: &CancellationToken, peer: Option<SocketAddr>) -> Admitted {
        let closing = parent.child_token();
        let mut live = lock(&self.live);
        if live.open.len() >= MAX_CONNECTIONS {
            if let Some((_, oldest)) = live.open.pop_front() {
                oldest.cancel();
            }
            if !live.evicting {
                let peer = peer.map(|p| p.to_string());
                tracing::warn!(
                    server = self.server,
                    peer,
                    limit = MAX_CONNECTIONS,
                    "too many connections: closing the oldest"
                );
                live.evicting = true;
            }
        } else {
            live.evicting = false;
        }
        live.next += 1;
        let id = live.next;
        live.open.push_back((id, closing.clone()));
        Admitted {
            id,
            closing,
            live: self.live.clone(),
        }
    }

    /// How many are open.
    #[cfg(test)]
    pub(crate) fn open(&self) -> usize {
        lock(&self.live).open.len()
    }
}

fn lock(live: &Mutex<Live>) -> MutexGuard<'_, Live> {
    live.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_closes_for_room_and_a_dropped_one_leaves() {
        let connections = Connections::new("test");
        let parent = CancellationToken::new();
        let mut held: Vec<Admitted> = (0..MAX_CONNECTIONS)
            .map(|_| connections.admit(&parent, None))
            .collect();
        assert_eq!(connections.open(), MAX_CONNECTIONS);
        assert!(held.iter().all(|a| !a.closing.is_cancelled()));
        let newest = connections.admit(&parent, None);
        assert!(
            held[0].closing.is_cancelled(),
            "the oldest is told to close"
        );
        assert!(!newest.closing.is_cancelled());
        assert_eq!(connections.open(), MAX_CONNECTIONS);
        held.remove(0);
        held.remove(0);
        assert_eq!(connections.open(), MAX_CONNECTIONS - 1);
        parent.cancel();
        assert!(
            newest.closing.is_cancelled(),
            "the server's end closes them all"
        );
    }
}

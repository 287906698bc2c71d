//! Who calls over loopback TCP: the owner (uid) of the peer's socket, from the kernel's socket
//! table of the agent's network namespace (`sock_diag` over netlink; `/proc/net/tcp{,6}` where
//! that cannot be had).
//!
//! Both ends of a loopback connection are in that table: the peer's end is the entry whose
//! local address is the peer's and whose remote address is ours. The kernel records which uid
//! created each socket, so the answer does not depend on anything the peer says. With
//! hostNetwork, every process of the node (and every hostNetwork pod) shares this loopback:
//! the address alone says nothing of who is calling.
//!
//! The table is read by [`socket_table`] (it can hold tens of thousands of sockets on a busy
//! node), on a blocking thread.

use std::net::SocketAddr;

use envoy_agent_proxy::socket_table;

/// Why the peer's owner is not known.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// A socket table could not be read.
    #[error("cannot read the kernel's socket table {path}: {source}")]
    Read {
        /// The table.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// No socket of this machine's namespace is the peer's end (it closed meanwhile).
    #[error("no socket {peer} -> {local} in the kernel's socket table (the peer closed?)")]
    NotFound {
        /// The peer's address.
        peer: SocketAddr,
        /// Ours.
        local: SocketAddr,
    },
}

/// Who may change the agent over loopback TCP, besides its own user and root.
#[derive(Debug, Clone, Default)]
pub struct Callers {
    /// The uids also allowed (`--control-allow-uid`).
    pub uids: Vec<u32>,
}

/// Why a loopback caller may not change anything.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Its socket belongs to another user.
    #[error(
        "{peer} belongs to uid {uid}: over TCP the agent takes changes only from its own user (uid {own}), root, or a --control-allow-uid"
    )]
    OtherUser {
        /// The caller's address.
        peer: SocketAddr,
        /// Its socket's owner.
        uid: u32,
        /// The agent's.
        own: u32,
    },
    /// Its owner could not be learnt.
    #[error("cannot tell who calls from {peer}: {source}")]
    Unknown {
        /// The caller's address.
        peer: SocketAddr,
        /// Why.
        source: PeerError,
    },
}

impl Refusal {
    /// The caller's uid, when known.
    pub fn uid(&self) -> Option<u32> {
        match self {
            Refusal::OtherUser { uid, .. } => Some(*uid),
            Refusal::Unknown { .. } => None,
        }
    }
}

impl Callers {
    /// Whether the loopback TCP peer at `peer`, connected to our `local`, may change the
    /// agent: its socket belongs to the agent's own user, root or an allowed uid.
    pub async fn check(&self, peer: SocketAddr, local: SocketAddr) -> Result<(), Refusal> {
        let owner = tokio::task::spawn_blocking(move || owner(peer, local))
            .await
            .unwrap_or_else(|e| {
                Err(PeerError::Read {
                    path: "/proc/net/tcp".to_owned(),
                    source: std::io::Error::other(e.to_string()),
                })
            });
        let own = nix::unistd::geteuid().as_raw();
        match owner {
            Ok(uid) if uid == own || uid == 0 || self.uids.contains(&uid) => Ok(()),
            Ok(uid) => Err(Refusal::OtherUser { peer, uid, own }),
            Err(source) => Err(Refusal::Unknown { peer, source }),
        }
    }
}

/// The uid that owns the socket at `peer` connected to `local` (ours), in the agent's own
/// network namespace.
pub fn owner(peer: SocketAddr, local: SocketAddr) -> Result<u32, PeerError> {
    let (peer, local) = (canonical(peer), canonical(local));
    let mut owner = None;
    socket_table::scan(None, |e| {
        if e.local == peer && e.remote == local {
            owner = Some(e.uid);
        }
        owner.is_none()
    })
    .map_err(|e| PeerError::Read {
        path: e.path.display().to_string(),
        source: e.source,
    })?;
    owner.ok_or(PeerError::NotFound { peer, local })
}

/// An IPv4-mapped IPv6 address as IPv4: a dual-stack socket's view of an IPv4 peer.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_end_of_a_real_loopback_connection_is_ours() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let local = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(local).unwrap();
        let (_server, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        let uid = owner(peer, local).unwrap();
        assert_eq!(uid, nix::unistd::geteuid().as_raw());
        drop(client);
    }

    #[test]
    fn a_socket_that_is_not_there_is_not_found() {
        let gone: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:2".parse().unwrap();
        assert!(matches!(
            owner(gone, local),
            Err(PeerError::NotFound { .. })
        ));
    }

    #[test]
    fn over_ipv6_loopback_too() {
        let Ok(listener) = std::net::TcpListener::bind("[::1]:0") else {
            // A host without IPv6 loopback has no such peer either.
            return;
        };
        let local = listener.local_addr().unwrap();
        let _client = std::net::TcpStream::connect(local).unwrap();
        let (_server, peer) = listener.accept().unwrap();
        assert_eq!(owner(peer, local).unwrap(), nix::unistd::geteuid().as_raw());
    }
}

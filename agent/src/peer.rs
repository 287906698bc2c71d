//! Who calls over loopback TCP: the owner (uid) of the peer's socket, from the kernel's socket
//! table of the agent's network namespace (`/proc/net/tcp` and `/proc/net/tcp6`).
//!
//! Both ends of a loopback connection are in that table: the peer's end is the entry whose
//! local address is the peer's and whose remote address is ours. The kernel records which uid
//! created each socket, so the answer does not depend on anything the peer says. With
//! hostNetwork, every process of the node (and every hostNetwork pod) shares this loopback:
//! the address alone says nothing of who is calling.
//!
//! The tables are read line by line (one can be megabytes on a busy node), on a blocking
//! thread: the caller runs it with `spawn_blocking`.

use std::io::BufRead;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

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
                    path: TABLES.join(", "),
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

/// The tables searched, IPv4's first.
const TABLES: [&str; 2] = ["/proc/net/tcp", "/proc/net/tcp6"];

/// The uid that owns the socket at `peer` connected to `local` (ours).
pub fn owner(peer: SocketAddr, local: SocketAddr) -> Result<u32, PeerError> {
    owner_in(&TABLES.map(Path::new), peer, local)
}

fn owner_in(tables: &[&Path], peer: SocketAddr, local: SocketAddr) -> Result<u32, PeerError> {
    let (peer, local) = (canonical(peer), canonical(local));
    for table in tables {
        let read = |source| PeerError::Read {
            path: table.display().to_string(),
            source,
        };
        let file = match std::fs::File::open(table) {
            Ok(f) => f,
            // A kernel without IPv6 has no tcp6 table.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(read(e)),
        };
        // Skips the header line.
        for line in std::io::BufReader::new(file).lines().skip(1) {
            let line = line.map_err(read)?;
            if let Some(uid) = entry_owner(&line, peer, local) {
                return Ok(uid);
            }
        }
    }
    Err(PeerError::NotFound { peer, local })
}

/// The uid of a table line whose local address is `peer` and remote address is `local`.
fn entry_owner(line: &str, peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
    let mut fields = line.split_whitespace();
    let ours = parse_address(fields.nth(1)?)?;
    let theirs = parse_address(fields.next()?)?;
    if ours != peer || theirs != local {
        return None;
    }
    fields.nth(4)?.parse().ok()
}

/// `0100007F:1F90` (IPv4) or 32 hex digits `:port` (IPv6): the address as the kernel prints
/// it, each 32-bit word in the machine's byte order, the port in hex.
fn parse_address(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // A word's bytes as they are in memory: the address's bytes, in order.
    let bytes = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(bytes(ip)?)),
        32 => {
            let mut octets = [0u8; 16];
            for (i, chunk) in octets.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&bytes(ip.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

/// An IPv4-mapped IPv6 address as IPv4: a dual-stack socket's view of an IPv4 peer.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_as_the_kernel_prints_them() {
        // As printed on little-endian x86_64.
        assert_eq!(
            parse_address("0100007F:1F90"),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(
            parse_address("00000000000000000000000001000000:0050"),
            Some("[::1]:80".parse().unwrap())
        );
        assert_eq!(
            parse_address("0000000000000000FFFF00000100007F:0050"),
            Some("127.0.0.1:80".parse().unwrap()),
            "IPv4-mapped"
        );
        assert_eq!(parse_address("0100007F"), None);
        assert_eq!(parse_address("zz00007F:0050"), None);
    }

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

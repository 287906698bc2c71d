//! Standing in for a dead parent Envoy.
//!
//! A child Envoy keeps talking to its parent over abstract Unix datagram sockets until it
//! terminates it (stats pulls, the final Terminate). If the parent dies first (OOM kill,
//! SIGKILL), the child's sends fail with ECONNREFUSED, it retries with its main thread blocked
//! (its admin stops answering) and aborts about 13 s later (Envoy #7468). Binding the dead
//! parent's socket names and reading what arrives keeps the child serving (seen on 1.40).
//!
//! Envoy names its sockets `@envoy_domain_socket_{parent,udp_parent}_<base_id*10 + epoch % 3>`
//! and pads them with NULs to the full 108-byte `sun_path`, so the abstract name is the text
//! plus NULs up to 107 bytes. The absorber must be dropped before an epoch that reuses the
//! names starts (three epochs later), which single-flight handoffs guarantee.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

use tokio::task::JoinHandle;

/// `sun_path` length on Linux, minus the leading NUL of an abstract name.
const ABSTRACT_NAME_LEN: usize = 107;

/// Reads and discards what a child sends to its dead parent; stops when dropped.
#[derive(Debug)]
pub struct Absorber {
    tasks: Vec<JoinHandle<()>>,
    /// The epoch whose sockets are held.
    pub parent_epoch: u32,
}

impl Drop for Absorber {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn name(base_id: u32, role: &str, epoch: u32) -> Vec<u8> {
    let id = u64::from(base_id) * 10 + u64::from(epoch % 3);
    let mut name = format!("envoy_domain_socket_{role}_{id}").into_bytes();
    name.resize(ABSTRACT_NAME_LEN, 0);
    name
}

impl Absorber {
    /// Binds the parent sockets of dead `parent_epoch` of family `base_id`.
    pub fn bind(base_id: u32, parent_epoch: u32) -> std::io::Result<Absorber> {
        let mut tasks = Vec::new();
        for role in ["parent", "udp_parent"] {
            let addr = SocketAddr::from_abstract_name(name(base_id, role, parent_epoch))?;
            let socket = UnixDatagram::bind_addr(&addr)?;
            socket.set_nonblocking(true)?;
            let socket = tokio::net::UnixDatagram::from_std(socket)?;
            tasks.push(tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                while socket.recv(&mut buf).await.is_ok() {}
            }));
        }
        Ok(Absorber {
            tasks,
            parent_epoch,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_padded_like_envoys() {
        let n = name(5, "parent", 4);
        assert_eq!(n.len(), 107);
        assert!(n.starts_with(b"envoy_domain_socket_parent_51\0"));
        assert!(n[29..].iter().all(|b| *b == 0));
    }

    #[tokio::test]
    async fn binds_and_absorbs() {
        let absorber = Absorber::bind(4_000_001, 2).unwrap();
        let sender = UnixDatagram::unbound().unwrap();
        let addr = SocketAddr::from_abstract_name(name(4_000_001, "parent", 2)).unwrap();
        sender.send_to_addr(b"hello", &addr).unwrap();
        // A second bind of the same names fails while the absorber holds them.
        assert!(Absorber::bind(4_000_001, 2).is_err());
        drop(absorber);
    }
}

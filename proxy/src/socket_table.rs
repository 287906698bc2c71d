//! The kernel's TCP socket table of a network namespace (`/proc/<pid>/net/tcp` and `tcp6`;
//! `/proc/net/...` for the agent's own), read line by line.
//!
//! What it is for: facts only the kernel has, at a cost that does not depend on Envoy's config
//! and never touches Envoy's main thread: who owns a loopback peer's socket (the agent's
//! gRPC and status servers), and how many downstream connections Envoy's processes hold (a
//! drain's count). A table can be megabytes on a busy node: callers read it on a blocking
//! thread, and only as often as they must.

use std::collections::BTreeSet;
use std::io::BufRead;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

/// One socket of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Its local address (IPv4-mapped addresses as IPv4).
    pub local: SocketAddr,
    /// Its remote address.
    pub remote: SocketAddr,
    /// The TCP state as the kernel numbers it (see [`LISTEN`]).
    pub state: u8,
    /// The uid that created it.
    pub uid: u32,
    /// Its inode: 0 once no process holds it (closed, orphaned, in `TIME_WAIT`).
    pub inode: u64,
}

/// The kernel's `TCP_LISTEN`.
pub const LISTEN: u8 = 0x0A;

/// Why a table could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the kernel's socket table {path}: {source}")]
pub struct TableError {
    /// The table.
    pub path: PathBuf,
    /// Why.
    pub source: std::io::Error,
}

/// The tables of the namespace `pid` is in (the agent's own: `None`), IPv4's first.
fn tables(pid: Option<u32>) -> [PathBuf; 2] {
    let base = match pid {
        Some(pid) => PathBuf::from(format!("/proc/{pid}/net")),
        None => PathBuf::from("/proc/net"),
    };
    [base.join("tcp"), base.join("tcp6")]
}

/// Calls `each` with every socket of the namespace `pid` is in (the agent's: `None`), until it
/// says `false`. A kernel without IPv6 has no `tcp6`: that table is skipped.
pub fn scan(pid: Option<u32>, mut each: impl FnMut(&Entry) -> bool) -> Result<(), TableError> {
    for table in tables(pid) {
        if !scan_file(&table, &mut each)? {
            return Ok(());
        }
    }
    Ok(())
}

fn scan_file(table: &Path, each: &mut impl FnMut(&Entry) -> bool) -> Result<bool, TableError> {
    let fail = |source| TableError {
        path: table.to_owned(),
        source,
    };
    let file = match std::fs::File::open(table) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(fail(e)),
    };
    let mut lines = std::io::BufReader::new(file);
    let mut line = String::new();
    // The header line.
    lines.read_line(&mut line).map_err(fail)?;
    loop {
        line.clear();
        if lines.read_line(&mut line).map_err(fail)? == 0 {
            return Ok(true);
        }
        if let Some(entry) = parse_line(&line) {
            if !each(&entry) {
                return Ok(false);
            }
        }
    }
}

/// `sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode`
fn parse_line(line: &str) -> Option<Entry> {
    let mut fields = line.split_whitespace();
    let local = parse_address(fields.nth(1)?)?;
    let remote = parse_address(fields.next()?)?;
    let state = u8::from_str_radix(fields.next()?, 16).ok()?;
    let uid = fields.nth(3)?.parse().ok()?;
    let inode = fields.nth(1)?.parse().ok()?;
    Some(Entry {
        local,
        remote,
        state,
        uid,
        inode,
    })
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
    Some(SocketAddr::new(ip.to_canonical(), port))
}

/// The inodes of the sockets process `pid` holds (its `/proc/<pid>/fd`); empty for a process
/// that is gone.
pub fn socket_inodes(pid: u32, into: &mut BTreeSet<u64>) {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return;
    };
    for fd in fds.flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        let inode = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse().ok());
        if let Some(inode) = inode {
            into.insert(inode);
        }
    }
}

/// How many connections the processes `pids` hold on their listening TCP ports, but for
/// the ports in `excluded`: their downstream connections, counted by the kernel. An
/// upstream connection's local port is an ephemeral one, not a listener's. The table read is
/// that of `pids[0]`'s namespace.
pub fn downstream_connections(pids: &[u32], excluded: &BTreeSet<u16>) -> Result<u64, TableError> {
    let Some(first) = pids.first() else {
        return Ok(0);
    };
    let mut inodes = BTreeSet::new();
    for pid in pids {
        socket_inodes(*pid, &mut inodes);
    }
    let mut listening = BTreeSet::new();
    let mut held: Vec<u16> = Vec::new();
    scan(Some(*first), |e| {
        if e.inode != 0 && inodes.contains(&e.inode) {
            if e.state == LISTEN {
                listening.insert(e.local.port());
            } else {
                held.push(e.local.port());
            }
        }
        true
    })?;
    Ok(held
        .iter()
        .filter(|port| listening.contains(port) && !excluded.contains(port))
        .count() as u64)
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
    fn a_line_parses_field_by_field() {
        let line = "   3: 0100007F:1F90 0100007F:A2C4 01 00000000:00000000 00:00000000 00000000  1000        0 123456 1 0000000000000000 20 4 30 10 -1";
        assert_eq!(
            parse_line(line),
            Some(Entry {
                local: "127.0.0.1:8080".parse().unwrap(),
                remote: "127.0.0.1:41668".parse().unwrap(),
                state: 1,
                uid: 1000,
                inode: 123456,
            })
        );
        assert_eq!(parse_line("  sl  local_address rem_address   st"), None);
    }

    #[test]
    fn this_process_s_connections_on_its_listener_are_counted() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let clients: Vec<_> = (0..3)
            .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        let accepted: Vec<_> = (0..3).map(|_| listener.accept().unwrap()).collect();
        let me = std::process::id();
        // Our clients' ends are ours too, but on ephemeral ports, not a listener's.
        assert_eq!(downstream_connections(&[me], &BTreeSet::new()).unwrap(), 3);
        assert_eq!(
            downstream_connections(&[me], &BTreeSet::from([port])).unwrap(),
            0,
            "an excluded port"
        );
        drop(accepted);
        drop(clients);
        assert_eq!(downstream_connections(&[me], &BTreeSet::new()).unwrap(), 0);
    }
}

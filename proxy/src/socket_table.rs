//! The kernel's TCP socket table of a network namespace: over netlink (`sock_diag`) for the
//! agent's own, which is its Envoy's; else the text tables (`/proc/<pid>/net/tcp` and `tcp6`),
//! read line by line.
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

/// A socket as the kernel's `sock_diag` names it (its address family, and its `struct
/// inet_diag_sockid`: the 4-tuple, the interface and the cookie): enough to ask about it again
/// with one exact request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketId {
    family: u8,
    id: [u8; 48],
}

/// How many connections [`any_on_ports`] remembers from a dump.
const KNOWN_KEPT: usize = 64;

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

/// Calls `each` with every socket a process holds (sockets in `TIME_WAIT` or orphaned, with
/// no inode, are left out) in the namespace `pid` is in (the agent's: `None`), until it says
/// `false`.
///
/// Asked of the kernel over netlink (`sock_diag`, as `ss` does) in the agent's own namespace,
/// which is its Envoy's: the kernel leaves out the `TIME_WAIT` sockets a busy node has tens of
/// thousands of, and answers in binary. Where that cannot be had (no `inet_diag` in the
/// kernel, a namespace of another process's), from the text tables in `/proc`. A kernel
/// without IPv6 has no `tcp6`: that table is skipped.
pub fn scan(pid: Option<u32>, mut each: impl FnMut(&Entry) -> bool) -> Result<(), TableError> {
    let own = pid.is_none_or(same_netns);
    if own {
        match diag::scan(&mut each) {
            Ok(()) => return Ok(()),
            Err(e) => tracing::debug!(error = %e, "sock_diag: reading /proc instead"),
        }
    }
    for table in tables(pid) {
        if !scan_file(&table, &mut |e: &Entry| e.inode == 0 || each(e))? {
            return Ok(());
        }
    }
    Ok(())
}

/// Whether process `pid` is in the agent's network namespace.
fn same_netns(pid: u32) -> bool {
    let ns = |path: String| std::fs::read_link(path).ok();
    let ours = ns("/proc/self/ns/net".to_owned());
    ours.is_some() && ours == ns(format!("/proc/{pid}/ns/net"))
}

/// The kernel's socket diagnostics over netlink (`NETLINK_SOCK_DIAG`, `inet_diag`): a dump of
/// the TCP sockets of one address family in the given states, one message per socket.
mod diag {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

    use nix::sys::socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto,
        socket,
    };

    use super::{Entry, SocketId};

    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLM_F_REQUEST: u16 = 0x1;
    const NLM_F_DUMP: u16 = 0x300;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    const IPPROTO_TCP: u8 = 6;
    const AF_INET: u8 = 2;
    const AF_INET6: u8 = 10;
    const TCP_TIME_WAIT: u32 = 6;
    const TCP_LISTEN: u32 = 10;
    const INET_DIAG_REQ_BYTECODE: u16 = 1;
    const BC_JMP: u8 = 1;
    const BC_S_EQ: u8 = 11;
    /// Every state but `TIME_WAIT` (no process holds such a socket).
    const STATES: u32 = 0xFFF & !(1 << TCP_TIME_WAIT);
    /// `struct nlmsghdr`.
    const HEADER: usize = 16;
    /// `struct inet_diag_msg`.
    const MESSAGE: usize = 72;

    pub(super) fn scan(each: &mut impl FnMut(&Entry) -> bool) -> std::io::Result<()> {
        scan_with(STATES, &[], &mut |e: &Entry, _: &SocketId| each(e))
    }

    /// The sockets, not listening, whose local port is one of `ports`: the kernel picks them
    /// (a filter on the ports and the states), so the dump costs what they cost, not what the
    /// namespace holds. `each` saying to stop ends the dump where it is.
    pub(super) fn scan_ports(
        ports: &std::collections::BTreeSet<u16>,
        each: &mut impl FnMut(&Entry, &SocketId) -> bool,
    ) -> std::io::Result<()> {
        if ports.is_empty() {
            return Ok(());
        }
        scan_with(STATES & !(1 << TCP_LISTEN), &port_filter(ports), each)
    }

    fn scan_with(
        states: u32,
        filter: &[u8],
        each: &mut impl FnMut(&Entry, &SocketId) -> bool,
    ) -> std::io::Result<()> {
        let fd = open()?;
        for family in [AF_INET, AF_INET6] {
            if !dump(&fd, family, states, filter, each)? {
                break;
            }
        }
        // Closing the socket ends a dump left unread.
        Ok(())
    }

    /// `inet_diag`'s bytecode (`INET_DIAG_REQ_BYTECODE`) for "the local port is one of
    /// `ports`", as `ss` compiles `sport = :a or sport = :b`: each test (`S_EQ`, its port in
    /// the next op) goes on to a jump to the end (accept) when it holds, else skips that jump
    /// to the next test; the last one's "no" jumps past the end (reject). The kernel audits
    /// that every jump lands on an op along the "yes" path.
    pub(super) fn port_filter(ports: &std::collections::BTreeSet<u16>) -> Vec<u8> {
        let op = |code: u8, yes: u8, no: u16| {
            let mut b = vec![code, yes];
            b.extend_from_slice(&no.to_ne_bytes());
            b
        };
        let mut code: Vec<u8> = Vec::new();
        for (i, port) in ports.iter().rev().enumerate() {
            let mut test = op(BC_S_EQ, 8, 12);
            test.extend(op(0, 0, *port));
            if i > 0 {
                // The jump to the end (accept) over what follows.
                test.extend(op(BC_JMP, 4, (code.len() + 4) as u16));
            }
            test.extend_from_slice(&code);
            code = test;
        }
        code
    }

    /// A `NETLINK_SOCK_DIAG` socket.
    fn open() -> std::io::Result<std::os::fd::OwnedFd> {
        Ok(socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )?)
    }

    /// A `struct nlmsghdr` and a `struct inet_diag_req_v2` for TCP sockets of `family` in
    /// `states` (`id`: one socket's, or zero for all), then `filter` as a `struct rtattr`, if
    /// any.
    fn request(flags: u16, family: u8, states: u32, id: &[u8; 48], filter: &[u8]) -> Vec<u8> {
        let attr = if filter.is_empty() {
            0
        } else {
            4 + filter.len()
        };
        let len = HEADER + 56 + attr;
        let mut request = Vec::with_capacity(len);
        request.extend_from_slice(&(len as u32).to_ne_bytes());
        request.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        request.extend_from_slice(&flags.to_ne_bytes());
        request.extend_from_slice(&1u32.to_ne_bytes());
        request.extend_from_slice(&0u32.to_ne_bytes());
        request.extend_from_slice(&[family, IPPROTO_TCP, 0, 0]);
        request.extend_from_slice(&states.to_ne_bytes());
        request.extend_from_slice(id);
        if attr > 0 {
            request.extend_from_slice(&(attr as u16).to_ne_bytes());
            request.extend_from_slice(&INET_DIAG_REQ_BYTECODE.to_ne_bytes());
            request.extend_from_slice(filter);
        }
        request
    }

    /// Sends `request` to the kernel.
    fn send(fd: &std::os::fd::OwnedFd, request: &[u8]) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        sendto(
            fd.as_raw_fd(),
            request,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )?;
        Ok(())
    }

    /// One family's dump; `false` once `each` said to stop.
    fn dump(
        fd: &std::os::fd::OwnedFd,
        family: u8,
        states: u32,
        filter: &[u8],
        each: &mut impl FnMut(&Entry, &SocketId) -> bool,
    ) -> std::io::Result<bool> {
        use std::os::fd::AsRawFd;
        // The socket id left zero: all.
        let flags = NLM_F_REQUEST | NLM_F_DUMP;
        send(fd, &request(flags, family, states, &[0u8; 48], filter))?;
        let mut buf = vec![0u8; 64 * 1024];
        let mut go_on = true;
        loop {
            let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
            if n == 0 {
                return Ok(go_on);
            }
            let mut at = 0;
            while at + HEADER <= n {
                let word = |i: usize| {
                    buf.get(i..i + 4)
                        .map_or(0, |b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                };
                let len = word(at) as usize;
                let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
                if len < HEADER || at + len > n {
                    return Err(std::io::Error::other("sock_diag: a truncated message"));
                }
                match kind {
                    NLMSG_DONE => return Ok(go_on),
                    NLMSG_ERROR => {
                        let errno = i32::from_ne_bytes(word(at + HEADER).to_ne_bytes());
                        return Err(std::io::Error::from_raw_os_error(-errno));
                    }
                    SOCK_DIAG_BY_FAMILY if go_on && len >= HEADER + MESSAGE => {
                        let message = &buf[at + HEADER..at + len];
                        if let (Some(entry), Some(id)) = (parse(message), SocketId::of(message)) {
                            if entry.inode != 0 {
                                go_on = each(&entry, &id);
                            }
                        }
                    }
                    _ => {}
                }
                // Messages are aligned to 4 bytes.
                at += (len + 3) & !3;
            }
            if !go_on {
                return Ok(false);
            }
        }
    }

    impl SocketId {
        /// The id of the socket a `struct inet_diag_msg` describes.
        fn of(m: &[u8]) -> Option<SocketId> {
            Some(SocketId {
                family: *m.first()?,
                id: m.get(4..52)?.try_into().ok()?,
            })
        }
    }

    /// The socket `id` names, if it is still there: one exact request (its 4-tuple in the
    /// kernel's hash, its cookie checked), whatever the namespace holds.
    pub(super) fn lookup(id: &SocketId) -> std::io::Result<Option<Entry>> {
        use std::os::fd::AsRawFd;
        let fd = open()?;
        send(&fd, &request(NLM_F_REQUEST, id.family, STATES, &id.id, &[]))?;
        let mut buf = vec![0u8; 8 * 1024];
        let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        if n < HEADER {
            return Err(std::io::Error::other("sock_diag: a truncated answer"));
        }
        match u16::from_ne_bytes([buf[4], buf[5]]) {
            SOCK_DIAG_BY_FAMILY if n >= HEADER + MESSAGE => Ok(parse(&buf[HEADER..n])),
            NLMSG_ERROR if n >= HEADER + 4 => {
                let errno = -i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
                match nix::errno::Errno::from_raw(errno) {
                    // Gone, or another socket on its 4-tuple since (the cookie differs).
                    nix::errno::Errno::ENOENT | nix::errno::Errno::ESTALE => Ok(None),
                    _ => Err(std::io::Error::from_raw_os_error(errno)),
                }
            }
            _ => Err(std::io::Error::other("sock_diag: an unexpected answer")),
        }
    }

    /// A `struct inet_diag_msg`.
    fn parse(m: &[u8]) -> Option<Entry> {
        let word = |i: usize| m.get(i..i + 4).map(|b| [b[0], b[1], b[2], b[3]]);
        let port = |i: usize| m.get(i..i + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
        let ip = |i: usize| -> Option<IpAddr> {
            match *m.first()? {
                AF_INET => Some(IpAddr::V4(Ipv4Addr::from(word(i)?))),
                AF_INET6 => {
                    let b: [u8; 16] = m.get(i..i + 16)?.try_into().ok()?;
                    Some(IpAddr::V6(Ipv6Addr::from(b)).to_canonical())
                }
                _ => None,
            }
        };
        Some(Entry {
            local: SocketAddr::new(ip(8)?, port(4)?),
            remote: SocketAddr::new(ip(24)?, port(6)?),
            state: *m.get(1)?,
            uid: u32::from_ne_bytes(word(64)?),
            inode: u64::from(u32::from_ne_bytes(word(68)?)),
        })
    }
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
pub fn parse_address(text: &str) -> Option<SocketAddr> {
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

/// The inodes of every socket the processes `pids` hold.
fn sockets_of(pids: &[u32]) -> BTreeSet<u64> {
    let mut inodes = BTreeSet::new();
    for pid in pids {
        socket_inodes(*pid, &mut inodes);
    }
    inodes
}

/// How many connections the processes `pids` hold on their listening TCP ports, but for
/// the ports in `excluded`: their downstream connections, counted by the kernel. An
/// upstream connection's local port is an ephemeral one, not a listener's. The table read is
/// that of `pids[0]`'s namespace.
pub fn downstream_connections(pids: &[u32], excluded: &BTreeSet<u16>) -> Result<u64, TableError> {
    let Some(first) = pids.first() else {
        return Ok(0);
    };
    let inodes = sockets_of(pids);
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

/// How many connections are held on a local port in `ports` (the drained listeners'),
/// listening sockets left out, in the namespace process `pid` is in; counted no further than
/// `limit` (1: whether there is any). Their downstream connections, also after Envoy closed its
/// listening sockets at the end of its drain time.
///
/// The kernel picks them (`sock_diag` with a filter on the ports and the states), so a count
/// costs what those connections cost, not what the node holds (a node proxy with host
/// networking sees every socket of the node), and a limit ends the dump early. No process's
/// descriptors are walked: a connection whose local port is a listener's is a downstream one
/// (the kernel hands out no ephemeral port a listener holds). Where the filter is refused (a
/// kernel without `S_EQ`, before 4.16) or the namespace is another's, the whole table is read
/// and filtered here.
pub fn connections_on_ports(
    pid: u32,
    ports: &BTreeSet<u16>,
    limit: u64,
) -> Result<u64, TableError> {
    if ports.is_empty() || limit == 0 {
        return Ok(0);
    }
    let count = |held: &mut u64, e: &Entry| {
        if e.inode != 0 && e.state != LISTEN && ports.contains(&e.local.port()) {
            *held += 1;
        }
        *held < limit
    };
    if same_netns(pid) {
        let mut held = 0u64;
        match diag::scan_ports(ports, &mut |e: &Entry, _: &SocketId| count(&mut held, e)) {
            Ok(()) => return Ok(held),
            Err(e) => {
                tracing::debug!(error = %e, "sock_diag with a filter: reading the whole table")
            }
        }
    }
    let mut held = 0u64;
    scan(Some(pid), |e| count(&mut held, e))?;
    Ok(held)
}

/// Whether any connection is held on a local port in `ports` (as [`connections_on_ports`]
/// counts them), in the namespace process `pid` is in: 0, or at least one.
///
/// `known` carries connections found by an earlier call: while one of them is still held, one
/// exact request answers (a cost that does not depend on the node, nor on how many
/// connections there are). Only when none is left does it ask for a dump with the kernel's
/// filter, which ends at the first batch and remembers a few of what it found for the next
/// calls. A zero is always a dump's answer.
pub fn any_on_ports(
    pid: u32,
    ports: &BTreeSet<u16>,
    known: &mut Vec<SocketId>,
) -> Result<u64, TableError> {
    if ports.is_empty() {
        return Ok(0);
    }
    if !same_netns(pid) {
        return connections_on_ports(pid, ports, 1);
    }
    let held = |e: &Entry| e.inode != 0 && e.state != LISTEN && ports.contains(&e.local.port());
    while let Some(id) = known.last() {
        match diag::lookup(id) {
            Ok(Some(e)) if held(&e) => return Ok(1),
            Ok(_) => {
                known.pop();
            }
            Err(e) => {
                tracing::debug!(error = %e, "sock_diag lookup: counting instead");
                known.clear();
                return connections_on_ports(pid, ports, 1);
            }
        }
    }
    let mut found = 0u64;
    let dumped = diag::scan_ports(ports, &mut |e: &Entry, id: &SocketId| {
        if held(e) {
            found += 1;
            known.push(*id);
        }
        known.len() < KNOWN_KEPT
    });
    match dumped {
        Ok(()) => Ok(found),
        Err(e) => {
            tracing::debug!(error = %e, "sock_diag with a filter: reading the whole table");
            known.clear();
            connections_on_ports(pid, ports, 1)
        }
    }
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

    /// Tests that open sockets of this process, one at a time (a count sees them all).
    static SOCKETS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn netlink_and_proc_see_the_same_sockets() {
        let _one = SOCKETS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = std::net::TcpStream::connect(addr).unwrap();
        let (_server, peer) = listener.accept().unwrap();
        let mut by_netlink = Vec::new();
        diag::scan(&mut |e: &Entry| {
            by_netlink.push(*e);
            true
        })
        .expect("sock_diag answers (inet_diag in the kernel)");
        let mut by_proc = Vec::new();
        for table in tables(None) {
            scan_file(&table, &mut |e: &Entry| {
                by_proc.push(*e);
                true
            })
            .unwrap();
        }
        for wanted in [(addr, None), (peer, Some(addr))] {
            let matching =
                |e: &&Entry| e.local == wanted.0 && wanted.1.is_none_or(|r| e.remote == r);
            let n = by_netlink.iter().find(matching).copied();
            assert!(n.is_some(), "{wanted:?} over netlink");
            assert_eq!(n, by_proc.iter().find(matching).copied(), "{wanted:?}");
        }
    }

    #[test]
    fn this_process_s_connections_on_its_listener_are_counted() {
        let _one = SOCKETS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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

    #[test]
    fn connections_on_a_closed_listener_s_port_are_still_counted() {
        let _one = SOCKETS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let me = std::process::id();
        let ports = BTreeSet::from([port]);
        assert_eq!(connections_on_ports(me, &ports, u64::MAX).unwrap(), 1);
        // As Envoy does at the end of its drain time: the listening socket closes, the
        // accepted connection stays.
        drop(listener);
        assert_eq!(
            downstream_connections(&[me], &BTreeSet::new()).unwrap(),
            0,
            "keyed on listening sockets, the count loses it"
        );
        assert_eq!(connections_on_ports(me, &ports, u64::MAX).unwrap(), 1);
        drop(accepted);
        drop(client);
        assert_eq!(connections_on_ports(me, &ports, u64::MAX).unwrap(), 0);
    }

    /// The kernel's filter picks exactly the connections on the ports asked (of several, and
    /// none of another port's), as the whole table read here does; a limit stops the count.
    #[test]
    fn the_kernel_s_port_filter_picks_what_the_whole_table_does() {
        let _one = SOCKETS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let listeners: Vec<_> = (0..3)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let port = |i: usize| listeners[i].local_addr().unwrap().port();
        let mut open = Vec::new();
        for (i, n) in [(0, 2), (1, 3), (2, 4)] {
            for _ in 0..n {
                open.push(std::net::TcpStream::connect(("127.0.0.1", port(i))).unwrap());
                open.push(listeners[i].accept().unwrap().0);
            }
        }
        let v6 = std::net::TcpListener::bind("[::1]:0").ok();
        let v6_port = v6.as_ref().map(|l| l.local_addr().unwrap().port());
        if let Some(l) = &v6 {
            open.push(std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap());
            open.push(l.accept().unwrap().0);
        }
        let by_table = |ports: &BTreeSet<u16>| {
            let mut held = 0u64;
            scan(None, |e| {
                if e.inode != 0 && e.state != LISTEN && ports.contains(&e.local.port()) {
                    held += 1;
                }
                true
            })
            .unwrap();
            held
        };
        let by_kernel = |ports: &BTreeSet<u16>, limit: u64| {
            let mut held = 0u64;
            diag::scan_ports(ports, &mut |e: &Entry, _: &SocketId| {
                assert!(ports.contains(&e.local.port()), "{e:?} is not on {ports:?}");
                assert_ne!(e.state, LISTEN, "{e:?}");
                held += 1;
                held < limit
            })
            .expect("the kernel takes the filter");
            held
        };
        let mut cases = vec![
            (BTreeSet::from([port(0)]), 2),
            (BTreeSet::from([port(1)]), 3),
            (BTreeSet::from([port(0), port(2)]), 6),
            (BTreeSet::from([port(0), port(1), port(2)]), 9),
            (BTreeSet::from([1]), 0),
        ];
        if let Some(p) = v6_port {
            cases.push((BTreeSet::from([p, port(1)]), 4));
        }
        for (ports, n) in cases {
            assert_eq!(by_kernel(&ports, u64::MAX), n, "{ports:?}");
            assert_eq!(by_table(&ports), n, "{ports:?}");
            let me = std::process::id();
            assert_eq!(connections_on_ports(me, &ports, u64::MAX).unwrap(), n);
            assert_eq!(connections_on_ports(me, &ports, 1).unwrap(), n.min(1));
        }
    }

    #[test]
    fn the_port_filter_is_as_ss_compiles_it() {
        let ne = |n: u16| n.to_ne_bytes();
        let one = diag::port_filter(&BTreeSet::from([80]));
        assert_eq!(one, [&[11, 8][..], &ne(12), &[0, 0], &ne(80)].concat());
        let two = diag::port_filter(&BTreeSet::from([80, 443]));
        assert_eq!(
            two,
            [
                &[11, 8][..],
                &ne(12),
                &[0, 0],
                &ne(80),
                &[1, 4],
                &ne(12),
                &[11, 8],
                &ne(12),
                &[0, 0],
                &ne(443),
            ]
            .concat()
        );
    }

    /// The quick question: a connection found once is asked about again by one exact request
    /// while it stays; once the last one goes, the answer is zero (a dump's).
    #[test]
    fn any_connection_is_told_from_those_found_before() {
        let _one = SOCKETS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let ports = BTreeSet::from([port]);
        let me = std::process::id();
        let mut known = Vec::new();
        assert_eq!(any_on_ports(me, &ports, &mut known).unwrap(), 0);
        let mut pairs = Vec::new();
        for _ in 0..3 {
            let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            pairs.push((c, listener.accept().unwrap().0));
        }
        assert_eq!(any_on_ports(me, &ports, &mut known).unwrap(), 3, "a dump");
        assert_eq!(known.len(), 3);
        for id in &known {
            let entry = diag::lookup(id).unwrap().expect("still there");
            assert_eq!(entry.local.port(), port);
        }
        // Asked again: an exact request for the last one found, which is still there.
        assert_eq!(any_on_ports(me, &ports, &mut known).unwrap(), 1);
        assert_eq!(known.len(), 3);
        // They go one by one; the gone are forgotten, the answer stays "some" until the last.
        while let Some((client, accepted)) = pairs.pop() {
            drop(accepted);
            drop(client);
            let left = pairs.len() as u64;
            assert_eq!(
                any_on_ports(me, &ports, &mut known).unwrap().min(1),
                left.min(1)
            );
        }
        assert!(known.is_empty());
        // A connection none was found of before: the dump finds it.
        let c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let _a = listener.accept().unwrap();
        assert_eq!(any_on_ports(me, &ports, &mut known).unwrap(), 1);
        drop(c);
    }
}

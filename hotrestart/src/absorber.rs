//! Standing in for a dead parent Envoy, or for a dead child.
//!
//! A child Envoy keeps talking to its parent over abstract Unix datagram sockets until it
//! terminates it (stats pulls, the final Terminate). If the parent dies first (OOM kill,
//! SIGKILL), the child's sends fail with ECONNREFUSED, it retries with its main thread blocked
//! (its admin stops answering) and aborts about 13 s later (Envoy #7468). Binding the dead
//! parent's socket names keeps the sends going through. Three requests block the child's main
//! thread until the parent replies, so the stand-in answers each as a parent with nothing left
//! to give would:
//!
//! - a stats pull: an empty stats reply (there are no parent stats left to merge);
//! - a listen socket asked for (`PassListenSocket`, while a child that started before its
//!   parent died creates its listeners): a reply without a socket (fd -1), so the child binds
//!   its own (the soak's ninth finding: unanswered, the child waited until the handoff
//!   deadline killed it, and nothing served meanwhile);
//! - the admin shut (`ShutdownAdmin`, at a child's start): the reply a parent sends, with now as
//!   the family's start time and port reuse on (Envoy's default), so the child goes on.
//!
//! Other requests (Terminate, DrainListeners) expect no reply and get none.
//!
//! Wire format (Envoy's `hot_restart.proto`): an 8-byte big-endian length, then a
//! `HotRestartMessage` whose `request` (field 1) or `reply` (field 2) holds a oneof; stats is
//! field 3 in both. So a stats request starts `0a <len> 1a`, and the empty stats reply is
//! `12 02 1a 00`: reply { stats {} }. The reply goes to the child's socket,
//! `<socket path>_child_<base_id*10 + (parent_epoch + 1) % 3>`.
//!
//! Envoy names its sockets `<socket path>_{parent,udp_parent}_<base_id*10 + epoch % 3>`
//! (`SocketPath::address`): by default abstract (`@envoy_domain_socket_...`, padded with NULs
//! to the full 108-byte `sun_path`), or files in a private directory. An abstract name is free
//! once its holder is gone; a file stays behind a killed process, so it is taken over only once
//! a connect to it is refused. The absorber must be dropped before an epoch that reuses the
//! names starts (three epochs later), which single-flight handoffs guarantee.
//!
//! The other way round (the soak's eighth finding, Envoy 1.40): a draining parent whose child
//! was SIGKILLed is kept to its deadline (`supervisor/kept.rs`), and while it drains it
//! forwards the QUIC packets of connections it does not know to its child over
//! `<socket path>_udp_child_<n>`. The child gone, every forward is refused, and Envoy retries
//! once a second for ever with its main thread blocked: its drain timers, its overload
//! actions (the drain notice) and its SIGTERM handler all stop, so at its deadline it ignores
//! SIGTERM and must be SIGKILLed, cutting what it still held. [`Absorber::bind_child`] binds the
//! dead child's names and drops what arrives: the forwarded packets are lost, as they would
//! be with no child, but the parent's main thread goes on.

use std::os::fd::AsFd;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use tracing::Instrument;

use envoy_agent_proxy::SocketPath;

use tokio::task::JoinHandle;

/// Reads and discards what an Envoy sends to its dead parent (or dead child); stops when
/// dropped.
#[derive(Debug)]
pub struct Absorber {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Absorber {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// `reply { stats {} }`, framed: length 4, then the message.
const EMPTY_STATS_REPLY: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 4, 0x12, 0x02, 0x1a, 0x00];

/// `reply { pass_listen_socket { fd: -1 } }`, framed: no socket (the child creates its own).
/// The fd must be said: a reply without one (and without a passed descriptor) reads as fd 0.
const NO_SOCKET_REPLY: [u8; 23] = [
    0, 0, 0, 0, 0, 0, 0, 15, // length
    0x12, 13, // reply
    0x0a, 11, // pass_listen_socket
    0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, // fd: -1 (int32 varint)
];

/// What a child asks its parent that the stand-in answers (`HotRestartMessage.request`'s
/// fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asked {
    /// `pass_listen_socket` (1).
    ListenSocket,
    /// `shutdown_admin` (2).
    ShutdownAdmin,
    /// `stats` (3).
    Stats,
}

/// Which request `datagram` (as a child sends it to its parent) is, among those the stand-in
/// answers; `None` for any other (Terminate, DrainListeners expect no reply) or for bytes that
/// are no request. Any bytes are safe to pass: they come from the network namespace.
pub fn asked(datagram: &[u8]) -> Option<Asked> {
    // 8-byte length, then field 1 (request, length-delimited), its length (one varint byte for
    // these small messages, or more), then the oneof's field, length-delimited.
    let message = datagram.get(8..)?;
    if message.first() != Some(&0x0a) {
        return None;
    }
    let mut i = 1;
    while message.get(i).is_some_and(|b| b & 0x80 != 0) {
        i += 1;
    }
    match message.get(i + 1)? {
        0x0a => Some(Asked::ListenSocket),
        0x12 => Some(Asked::ShutdownAdmin),
        0x1a => Some(Asked::Stats),
        _ => None,
    }
}

/// Whether `datagram` is a framed `HotRestartMessage { request { stats {...} } }`.
pub fn is_stats_request(datagram: &[u8]) -> bool {
    asked(datagram) == Some(Asked::Stats)
}

/// The stand-in's answer to `asked`, framed.
fn reply(asked: Asked) -> Vec<u8> {
    match asked {
        Asked::Stats => EMPTY_STATS_REPLY.to_vec(),
        Asked::ListenSocket => NO_SOCKET_REPLY.to_vec(),
        Asked::ShutdownAdmin => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            // shutdown_admin { original_start_time_unix_seconds: now (1),
            // enable_reuse_port_default: true (2) }
            let mut inner = vec![0x08];
            varint(now, &mut inner);
            inner.extend([0x10, 0x01]);
            let mut reply = vec![0x12];
            varint(inner.len() as u64, &mut reply);
            reply.extend(inner);
            let mut message = vec![0x12];
            varint(reply.len() as u64, &mut message);
            message.extend(reply);
            let mut framed = (message.len() as u64).to_be_bytes().to_vec();
            framed.extend(message);
            framed
        }
    }
}

fn varint(mut value: u64, out: &mut Vec<u8>) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn send_to(
    socket: &tokio::net::UnixDatagram,
    bytes: &[u8],
    to: &SocketAddr,
) -> std::io::Result<()> {
    let std = socket
        .as_fd()
        .try_clone_to_owned()
        .map(UnixDatagram::from)?;
    std.send_to_addr(bytes, to).map(|_| ())
}

fn address(path: &SocketPath, base_id: u32, role: &str, epoch: u32) -> std::io::Result<SocketAddr> {
    path.address(role, u64::from(base_id) * 10 + u64::from(epoch % 3))
}

/// Binds `addr`. A file socket that exists is taken over only once nobody answers at it: a
/// connect refused means its Envoy is gone (the file stays behind a killed process); one
/// that connects belongs to a living Envoy, and the bind fails as an abstract name's does.
fn bind(addr: &SocketAddr, owner: Option<u32>) -> std::io::Result<UnixDatagram> {
    if let Some(path) = addr.as_pathname() {
        if std::fs::symlink_metadata(path).is_ok() {
            let probe = UnixDatagram::unbound()?;
            match probe.connect(path) {
                Ok(()) => return Err(std::io::ErrorKind::AddrInUse.into()),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path)?;
                }
                Err(e) => return Err(e),
            }
        }
        let socket = UnixDatagram::bind_addr(addr)?;
        // As Envoy's own (`--socket-mode 600`): only the agent's user can send to it.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        if let Some(uid) = owner {
            // Envoy runs as another user: its child must be able to send to us.
            nix::unistd::chown(path, Some(nix::unistd::Uid::from_raw(uid)), None)?;
        }
        return Ok(socket);
    }
    UnixDatagram::bind_addr(addr)
}

impl Absorber {
    /// Binds the parent sockets of dead `parent_epoch` of family `base_id`, whose channel is
    /// at `path`; file sockets are given to `owner` (Envoy's uid, when it runs as another
    /// user).
    pub fn bind(
        path: &SocketPath,
        base_id: u32,
        parent_epoch: u32,
        owner: Option<u32>,
    ) -> std::io::Result<Absorber> {
        let mut tasks = Vec::new();
        for (role, child_role) in [("parent", "child"), ("udp_parent", "udp_child")] {
            let addr = address(path, base_id, role, parent_epoch)?;
            let child = address(path, base_id, child_role, parent_epoch + 1)?;
            tasks.push(absorb(&addr, owner, Some(child))?);
        }
        Ok(Absorber { tasks })
    }

    /// Binds the child sockets of dead `child_epoch` of family `base_id` (its parent, kept,
    /// still sends there) and drops what arrives; `path` and `owner` as [`Absorber::bind`].
    pub fn bind_child(
        path: &SocketPath,
        base_id: u32,
        child_epoch: u32,
        owner: Option<u32>,
    ) -> std::io::Result<Absorber> {
        let mut tasks = Vec::new();
        for role in ["child", "udp_child"] {
            let addr = address(path, base_id, role, child_epoch)?;
            tasks.push(absorb(&addr, owner, None)?);
        }
        Ok(Absorber { tasks })
    }
}

/// Binds `addr` and reads what arrives there until aborted; a request that blocks its sender
/// ([`asked`]) is answered at `reply_to` (a dead parent's stand-in answering its child),
/// anything else dropped.
fn absorb(
    addr: &SocketAddr,
    owner: Option<u32>,
    reply_to: Option<SocketAddr>,
) -> std::io::Result<JoinHandle<()>> {
    let socket = bind(addr, owner)?;
    socket.set_nonblocking(true)?;
    let socket = tokio::net::UnixDatagram::from_std(socket)?;
    Ok(tokio::spawn(
        async move {
            // A forwarded QUIC packet is at most 64 KiB; a longer datagram is cut, which is fine
            // for what is dropped.
            let mut buf = vec![0u8; 8192];
            while let Ok(n) = socket.recv(&mut buf).await {
                if let (Some(to), Some(asked)) = (&reply_to, asked(&buf[..n])) {
                    // Best effort: a child that is gone needs no answer.
                    let _ = send_to(&socket, &reply(asked), to);
                }
            }
        }
        // The stand-in's owner (the supervisor) names its family.
        .in_current_span(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_padded_like_envoys() {
        use std::os::linux::net::SocketAddrExt;
        let a = address(&SocketPath::envoy_default(), 5, "parent", 4).unwrap();
        let n = a.as_abstract_name().unwrap();
        assert_eq!(n.len(), 107);
        assert!(n.starts_with(b"envoy_domain_socket_parent_51\0"));
        assert!(n[29..].iter().all(|b| *b == 0));
        let a = address(&SocketPath::parse("/run/x/envoy"), 5, "udp_child", 5).unwrap();
        assert_eq!(
            a.as_pathname(),
            Some(std::path::Path::new("/run/x/envoy_udp_child_52"))
        );
    }

    #[test]
    fn recognizes_stats_requests() {
        assert!(is_stats_request(&[
            0, 0, 0, 0, 0, 0, 0, 4, 0x0a, 0x02, 0x1a, 0x00
        ]));
        // Terminate (another oneof field): no reply expected.
        assert!(!is_stats_request(&[
            0, 0, 0, 0, 0, 0, 0, 4, 0x0a, 0x02, 0x2a, 0x00
        ]));
        assert!(!is_stats_request(&[0, 0, 0]));
        assert!(!is_stats_request(&[0, 0, 0, 0, 0, 0, 0, 2, 0x18, 0x01]));
    }

    /// Envoy's `source/server/hot_restart.proto`, as much of it as the stand-in speaks.
    mod wire {
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct HotRestartMessage {
            #[prost(oneof = "RequestReply", tags = "1, 2")]
            pub(super) requestreply: Option<RequestReply>,
        }
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub(super) enum RequestReply {
            #[prost(message, tag = "1")]
            Request(Request),
            #[prost(message, tag = "2")]
            Reply(Reply),
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct Request {
            #[prost(oneof = "Asked", tags = "1, 2, 3, 4, 5")]
            pub(super) request: Option<Asked>,
        }
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub(super) enum Asked {
            #[prost(message, tag = "1")]
            PassListenSocket(PassListenSocket),
            #[prost(message, tag = "2")]
            ShutdownAdmin(Empty),
            #[prost(message, tag = "3")]
            Stats(Empty),
            #[prost(message, tag = "4")]
            DrainListeners(Empty),
            #[prost(message, tag = "5")]
            Terminate(Empty),
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct PassListenSocket {
            #[prost(string, tag = "1")]
            pub(super) address: String,
            #[prost(uint32, tag = "2")]
            pub(super) worker_index: u32,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct Empty {}
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct Reply {
            #[prost(oneof = "Answer", tags = "1, 2, 3")]
            pub(super) reply: Option<Answer>,
        }
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub(super) enum Answer {
            #[prost(message, tag = "1")]
            PassListenSocket(Fd),
            #[prost(message, tag = "2")]
            ShutdownAdmin(ShutdownAdmin),
            #[prost(message, tag = "3")]
            Stats(Empty),
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct Fd {
            #[prost(int32, tag = "1")]
            pub(super) fd: i32,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct ShutdownAdmin {
            #[prost(uint64, tag = "1")]
            pub(super) original_start_time_unix_seconds: u64,
            #[prost(bool, tag = "2")]
            pub(super) enable_reuse_port_default: bool,
        }
    }

    fn framed(asked: wire::Asked) -> Vec<u8> {
        use prost::Message as _;
        let message = wire::HotRestartMessage {
            requestreply: Some(wire::RequestReply::Request(wire::Request {
                request: Some(asked),
            })),
        }
        .encode_to_vec();
        let mut out = (message.len() as u64).to_be_bytes().to_vec();
        out.extend(message);
        out
    }

    fn answer(framed: &[u8]) -> wire::Answer {
        use prost::Message as _;
        let length = u64::from_be_bytes(framed[..8].try_into().unwrap()) as usize;
        assert_eq!(length, framed.len() - 8, "the frame's length");
        match wire::HotRestartMessage::decode(&framed[8..])
            .unwrap()
            .requestreply
        {
            Some(wire::RequestReply::Reply(wire::Reply { reply: Some(a) })) => a,
            other => panic!("not a reply: {other:?}"),
        }
    }

    /// The soak's ninth finding: a child whose parent died while it started asks the stand-in
    /// for its listen sockets (and, earlier, to shut the parent's admin) and waits for the
    /// answer on its main thread. Each request as Envoy encodes it is recognized, and each
    /// answer decodes as the reply Envoy expects: no socket (fd -1, not 0: stdin), the admin
    /// shut at a plausible start time, no stats.
    #[test]
    fn a_childs_blocking_requests_get_the_replies_envoy_expects() {
        let socket = framed(wire::Asked::PassListenSocket(wire::PassListenSocket {
            address: "tcp://127.0.0.1:10000".to_owned(),
            worker_index: 1,
        }));
        assert_eq!(asked(&socket), Some(Asked::ListenSocket));
        assert_eq!(
            answer(&reply(Asked::ListenSocket)),
            wire::Answer::PassListenSocket(wire::Fd { fd: -1 })
        );

        let admin = framed(wire::Asked::ShutdownAdmin(wire::Empty {}));
        assert_eq!(asked(&admin), Some(Asked::ShutdownAdmin));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        match answer(&reply(Asked::ShutdownAdmin)) {
            wire::Answer::ShutdownAdmin(a) => {
                assert!(
                    a.original_start_time_unix_seconds.abs_diff(now) < 60,
                    "{a:?}"
                );
                assert!(a.enable_reuse_port_default);
            }
            other => panic!("{other:?}"),
        }

        let stats = framed(wire::Asked::Stats(wire::Empty {}));
        assert_eq!(asked(&stats), Some(Asked::Stats));
        assert_eq!(
            answer(&reply(Asked::Stats)),
            wire::Answer::Stats(wire::Empty {})
        );

        for unanswered in [
            wire::Asked::DrainListeners(wire::Empty {}),
            wire::Asked::Terminate(wire::Empty {}),
        ] {
            assert_eq!(asked(&framed(unanswered)), None);
        }
    }

    #[tokio::test]
    async fn binds_and_absorbs() {
        let path = SocketPath::envoy_default();
        let absorber = Absorber::bind(&path, 4_000_001, 2, None).unwrap();
        let sender = UnixDatagram::unbound().unwrap();
        let addr = address(&path, 4_000_001, "parent", 2).unwrap();
        sender.send_to_addr(b"hello", &addr).unwrap();
        // A second bind of the same names fails while the absorber holds them.
        assert!(Absorber::bind(&path, 4_000_001, 2, None).is_err());
        drop(absorber);
    }

    #[tokio::test]
    async fn a_dead_childs_names_are_held_and_what_its_parent_sends_goes_through() {
        let dir = tempfile::tempdir().unwrap();
        let path = SocketPath::File(dir.path().join("envoy"));
        // Epoch 4 of family 7 died: its names are `_child_71` and `_udp_child_71` (4 % 3).
        let dead = UnixDatagram::bind(dir.path().join("envoy_udp_child_71")).unwrap();
        drop(dead);
        let parent = UnixDatagram::unbound().unwrap();
        let udp_child = dir.path().join("envoy_udp_child_71");
        assert_eq!(
            parent.send_to(b"packet", &udp_child).unwrap_err().kind(),
            std::io::ErrorKind::ConnectionRefused,
            "what Envoy's parent retries for ever"
        );
        let absorber = Absorber::bind_child(&path, 7, 4, None).unwrap();
        parent.set_nonblocking(true).unwrap();
        // More than a socket's queue holds: the stand-in reads them all.
        for _ in 0..2_000 {
            loop {
                match parent.send_to(&[0u8; 1200], &udp_child) {
                    Ok(_) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        tokio::task::yield_now().await
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
        parent
            .send_to(b"reply", dir.path().join("envoy_child_71"))
            .unwrap();
        // Held while it lives: a second stand-in is refused.
        assert!(Absorber::bind_child(&path, 7, 4, None).is_err());
        drop(absorber);
    }

    #[tokio::test]
    async fn a_file_channel_is_taken_over_only_from_a_dead_envoy() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = SocketPath::File(dir.path().join("envoy"));
        let parent = dir.path().join("envoy_parent_70");
        // A living Envoy's socket: left alone.
        let live = UnixDatagram::bind(&parent).unwrap();
        assert_eq!(
            Absorber::bind(&path, 7, 0, None).unwrap_err().kind(),
            std::io::ErrorKind::AddrInUse
        );
        // Its process is gone (the file stays): taken over, private.
        drop(live);
        let absorber = Absorber::bind(&path, 7, 0, None).unwrap();
        let mode = std::fs::metadata(&parent).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        UnixDatagram::unbound()
            .unwrap()
            .send_to(b"hello", &parent)
            .unwrap();
        drop(absorber);
    }
}

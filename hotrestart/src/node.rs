//! Per-node state shared by the supervisors of one node (`--state-dir`, a hostPath): one
//! heartbeat file per supervisor, and a lock that serializes epoch allocation.
//!
//! # Format (version 1)
//!
//! `<state-dir>/heartbeat-<identity>.json`, replaced atomically (write + rename) every
//! heartbeat period and on every state change:
//!
//! ```json
//! {"format":"envoy-agent.heartbeat.v1","identity":"envoy-node-abcde","pid":4242,
//!  "base_id":7,"hot_restart_version":"11.104","newest_epoch":3,"envoy_pid":51,
//!  "state":"serving","updated_unix_ms":1795971942063,"parent_draining_until_unix_ms":0}
//! ```
//!
//! `state` is `waiting` (looking for a predecessor it can take over from, or waiting for its
//! turn), `starting` (it decided to take over: its first epoch, `newest_epoch`, is in
//! pre-flight or starting), `serving`, `handed_over` (a successor's Envoy took over; this one's
//! Envoy drains) or `stopping`. `envoy_pid` is in the supervisor's own PID namespace.
//! `parent_draining_until_unix_ms` is when the previous generation (in this pod, or the
//! predecessor pod's Envoy for a successor's first epoch) will have been terminated;
//! `restart_in_flight` says the pod is hot-restarting on its own (optional, `false` when
//! absent). A successor takes over only from a `serving` pod with neither.
//!
//! Optional, absent when not set: `handover` says how the newest family came to serve when a
//! handover started it, `{"kind":"hot"}` or `{"kind":"cold","why":"..."}` (a cold handover: a
//! new family under the other base id beside the old one); `cold_takeover_of` names the
//! predecessor pod whose family this one's took over from cold, until that Envoy is gone: the
//! predecessor, reading it, drains and stops its own family.
//!
//! A heartbeat is fresh when `updated_unix_ms` (or the file's modification time, when newer: an
//! unchanged heartbeat is [`touch`]ed rather than rewritten) is at most a few periods old and
//! not more than [`CLOCK_SKEW`] in the future (a future stamp would otherwise stay fresh forever). Only
//! regular files are read (opened with `O_NOFOLLOW | O_NONBLOCK` and checked, so a symlink or
//! a FIFO named like a heartbeat cannot redirect or hang the reader), at most [`MAX_SIZE`]
//! bytes. A file that does not parse, has another `format`, or whose `identity` does not match
//! its name is reported and ignored: never trusted, never a crash.
//!
//! `<state-dir>/epoch.lock` is `flock`ed by a starting supervisor from the moment it reads the
//! heartbeats until its first epoch is LIVE (or failed), so two successors cannot pick the same
//! epoch: the second waits, then sees the first as its predecessor.

use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

/// The `format` of version 1.
pub const FORMAT: &str = "envoy-agent.heartbeat.v1";
/// The largest heartbeat file read (a real one is about 300 bytes).
pub const MAX_SIZE: u64 = 64 << 10;
/// How far in the future a heartbeat's time may be (clocks of one node agree; this covers
/// the write-to-read gap and coarse clocks).
pub const CLOCK_SKEW: Duration = Duration::from_secs(2);

/// What a supervisor says it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Looking for a predecessor, or waiting for its turn; not taking over (yet).
    Waiting,
    /// Taking over (or starting at epoch 0): its first epoch is in pre-flight or starting.
    Starting,
    /// Its newest epoch is LIVE.
    Serving,
    /// A successor's Envoy took over; its own drains.
    HandedOver,
    /// Stopping.
    Stopping,
    /// A state of a newer format revision: not understood, never trusted.
    #[serde(other)]
    Unknown,
}

/// A supervisor's heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// [`FORMAT`].
    pub format: String,
    /// Who writes it (pod name, or host name and pid).
    pub identity: String,
    /// The supervisor's pid (in its own PID namespace).
    pub pid: u32,
    /// The Envoy family's base id.
    pub base_id: u32,
    /// Envoy's hot-restart version.
    pub hot_restart_version: String,
    /// The newest epoch it runs (or is starting).
    pub newest_epoch: u32,
    /// That epoch's Envoy pid (in the supervisor's PID namespace), 0 if none.
    pub envoy_pid: u32,
    /// What it does.
    pub state: NodeState,
    /// When written, Unix milliseconds.
    pub updated_unix_ms: u64,
    /// Until when its previous generation may still drain (a successor must not start a
    /// third generation before), Unix milliseconds; 0 when none drains.
    pub parent_draining_until_unix_ms: u64,
    /// Whether it is hot-restarting on its own right now (pre-flight to LIVE).
    #[serde(default)]
    pub restart_in_flight: bool,
    /// A cold handover across pods: the identity of the predecessor whose Envoy family this
    /// supervisor's new family (LIVE now) takes over from. That predecessor drains its Envoy
    /// and stops it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_takeover_of: Option<String>,
    /// How its newest family came to serve, when a handover started it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover: Option<Handover>,
    /// Its family's hot-restart channel (Envoy's `--socket-path`: `@name` or a path); empty
    /// from agents that did not say (they used Envoy's default, `@envoy_domain_socket`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub socket_path: String,
    /// Where its family's Envoy answers admin calls (the configured admin address: `ip:port`,
    /// or `unix:<path>` for the agent's socket); empty from agents that did not say. Pods
    /// whose admin addresses differ cannot hand Envoy over to each other: a successor would
    /// look for its predecessor's Envoy where it is not, and the predecessor would see its
    /// admin API vanish under it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub admin_address: String,
    /// Its pod's generation (`--pod-generation`, else its agent's start time in Unix ms): a
    /// later pod of a rollout has a larger one. A recovering agent never takes over from, nor
    /// starts a family beside, a family whose owner is newer. 0 from agents that did not say.
    #[serde(default)]
    pub generation: u64,
}

/// How a family came to serve (in a heartbeat).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handover {
    /// `hot` or `cold`.
    pub kind: String,
    /// Why hot restart could not be used, for a cold one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub why: String,
}

impl Heartbeat {
    /// Whether, at `now_ms`, it was written within `max_age` and not in the future (beyond
    /// [`CLOCK_SKEW`]).
    pub fn fresh(&self, now_ms: u64, max_age: Duration) -> bool {
        self.updated_unix_ms <= now_ms + CLOCK_SKEW.as_millis() as u64
            && now_ms.saturating_sub(self.updated_unix_ms) <= max_age.as_millis() as u64
    }
}

/// Now, in Unix milliseconds.
pub fn unix_ms() -> u64 {
    to_unix_ms(SystemTime::now())
}

/// `t` in Unix milliseconds.
pub fn to_unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

/// A heartbeat file that was not trusted, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The file.
    pub path: PathBuf,
    /// Why.
    pub reason: String,
}

fn file_name(identity: &str) -> String {
    // Identities come from pod names; keep the file name tame whatever they hold.
    let safe: String = identity
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("heartbeat-{safe}.json")
}

/// Writes `heartbeat` atomically into `dir`.
pub fn write(dir: &Path, heartbeat: &Heartbeat) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(heartbeat).map_err(std::io::Error::other)?;
    let path = dir.join(file_name(&heartbeat.identity));
    // Atomic (readers see one whole heartbeat) but not synced: a heartbeat means something only
    // while this boot lasts, and two fsyncs every period cost more than a crash could lose.
    // 0600: what another user could read of it is none of its business.
    match envoy_agent_proxy::replace_privately(&path, &bytes) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)?;
            envoy_agent_proxy::replace_privately(&path, &bytes)
        }
        other => other,
    }
}

/// Marks `identity`'s heartbeat as written now without rewriting it (its modification time, a
/// heartbeat's freshness when newer than its stamp): a rename over a file costs the kernel a
/// data flush on ext4, a timestamp next to nothing.
pub fn touch(dir: &Path, identity: &str) -> std::io::Result<()> {
    OpenOptions::new()
        .write(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(dir.join(file_name(identity)))?
        .set_modified(std::time::SystemTime::now())
}

/// Removes `identity`'s heartbeat.
pub fn remove(dir: &Path, identity: &str) {
    let _ = std::fs::remove_file(dir.join(file_name(identity)));
}

/// Every heartbeat in `dir`, and the files that were not trusted.
pub fn read_all(dir: &Path) -> (Vec<Heartbeat>, Vec<Rejected>) {
    read(dir, None)
}

/// Every heartbeat in `dir` but `identity`'s own (not even opened: a supervisor reads the
/// node every second, and knows what it wrote), and the files that were not trusted.
pub fn read_others(dir: &Path, identity: &str) -> (Vec<Heartbeat>, Vec<Rejected>) {
    read(dir, Some(&file_name(identity)))
}

/// How long before a listing that found nobody else the state directory must have last
/// changed for the listing to stand while it does not change again. A directory's
/// modification time moves with every name added, removed or renamed in it, but in steps of
/// the kernel's coarse clock (a few ms): a change in the same step as the one before, after a
/// listing, would leave it where it was; a change after a listing this much later cannot.
const QUIET_MARGIN: Duration = Duration::from_secs(1);

/// A supervisor's memory of its last look at the node, for [`read_others_since`].
#[derive(Debug, Default)]
pub struct LastLook {
    /// The directory's modification time when a listing found no heartbeat but ours, and no
    /// file it could not trust, at least [`QUIET_MARGIN`] after that time.
    quiet: Option<SystemTime>,
    /// Listings made (the rest were answered from `quiet`).
    pub listings: u64,
}

/// [`read_others`], without listing the directory again while it is unchanged since a
/// listing that found nothing but our own heartbeat (one `stat` a second instead of an open,
/// two reads and a close, on a node where this pod is alone: most of the time).
pub fn read_others_since(
    dir: &Path,
    identity: &str,
    last: &mut LastLook,
) -> (Vec<Heartbeat>, Vec<Rejected>) {
    let changed = std::fs::metadata(dir).and_then(|m| m.modified()).ok();
    if changed.is_some() && changed == last.quiet {
        return (Vec::new(), Vec::new());
    }
    let started = SystemTime::now();
    let (heartbeats, rejected) = read_others(dir, identity);
    last.listings += 1;
    last.quiet = changed.filter(|&changed| {
        heartbeats.is_empty()
            && rejected.is_empty()
            && changed
                .checked_add(QUIET_MARGIN)
                .is_some_and(|settled| settled <= started)
    });
    (heartbeats, rejected)
}

fn read(dir: &Path, skip: Option<&str>) -> (Vec<Heartbeat>, Vec<Rejected>) {
    let mut heartbeats = Vec::new();
    let mut rejected = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (heartbeats, rejected);
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("heartbeat-") && name.ends_with(".json"))
            || skip == Some(name.as_str())
        {
            continue;
        }
        let path = entry.path();
        let read = read_regular(&path).and_then(|(bytes, modified)| {
            let heartbeat = parse_bytes(&bytes, &name).map_err(|e| e.to_string())?;
            Ok((heartbeat, modified))
        });
        match read {
            Ok((mut h, modified)) => {
                // Touched since written: as fresh as the touch.
                h.updated_unix_ms = h.updated_unix_ms.max(modified);
                heartbeats.push(h);
            }
            Err(reason) => rejected.push(Rejected { path, reason }),
        }
    }
    (heartbeats, rejected)
}

/// Reads a heartbeat file: a regular file of at most [`MAX_SIZE`] bytes, never through a
/// symlink, never blocking on a FIFO or device; with its modification time (Unix ms).
fn read_regular(path: &Path) -> Result<(Vec<u8>, u64), String> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(nix::libc::ELOOP) => "a symlink, not a regular file".to_owned(),
            _ => format!("unreadable: {e}"),
        })?;
    let meta = file.metadata().map_err(|e| format!("unreadable: {e}"))?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "a device"
        };
        return Err(format!("{what}, not a regular file"));
    }
    if meta.len() > MAX_SIZE {
        return Err(format!("{} bytes, more than {MAX_SIZE}", meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_SIZE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("unreadable: {e}"))?;
    if bytes.len() as u64 > MAX_SIZE {
        return Err(format!("more than {MAX_SIZE} bytes"));
    }
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    Ok((bytes, modified))
}

/// Why a heartbeat file was not trusted (its reason in the node's rejected files).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeartbeatError {
    /// Not the JSON of a heartbeat.
    #[error("not a heartbeat: {0}")]
    NotAHeartbeat(String),
    /// Another format than this agent's.
    #[error("unknown format {0:?} (expected {FORMAT})")]
    UnknownFormat(String),
    /// A state this agent does not know.
    #[error("unknown state")]
    UnknownState,
    /// Its identity is not the one its file is named after.
    #[error("identity {0:?} does not match the file name")]
    IdentityMismatch(String),
}

/// Parses a heartbeat file's bytes; `name` is its file name, which must match its identity.
pub fn parse_bytes(bytes: &[u8], name: &str) -> Result<Heartbeat, HeartbeatError> {
    let heartbeat: Heartbeat =
        serde_json::from_slice(bytes).map_err(|e| HeartbeatError::NotAHeartbeat(e.to_string()))?;
    if heartbeat.format != FORMAT {
        return Err(HeartbeatError::UnknownFormat(heartbeat.format));
    }
    if heartbeat.state == NodeState::Unknown {
        return Err(HeartbeatError::UnknownState);
    }
    if file_name(&heartbeat.identity) != name {
        return Err(HeartbeatError::IdentityMismatch(heartbeat.identity));
    }
    Ok(heartbeat)
}

/// The epoch-allocation lock, held while it lives.
#[derive(Debug)]
pub struct EpochLock {
    _lock: Flock<std::fs::File>,
}

impl EpochLock {
    /// Takes `<dir>/epoch.lock` if nobody holds it; `None` when another supervisor does.
    pub fn try_acquire(dir: &Path) -> std::io::Result<Option<EpochLock>> {
        let path = dir.join("epoch.lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            // Nobody else may open it: a lock another user can open, they can hold.
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(EpochLock { _lock: lock })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, errno)) => Err(std::io::Error::from(errno)),
        }
    }

    /// Takes `<dir>/epoch.lock`, waiting (polling) up to `timeout` for another holder.
    pub async fn acquire(dir: &Path, timeout: Duration) -> std::io::Result<EpochLock> {
        let path = dir.join("epoch.lock");
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .open(&path)?;
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) => return Ok(EpochLock { _lock: lock }),
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => {}
                Err((_, errno)) => return Err(std::io::Error::from(errno)),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("{} is held by another supervisor", path.display()),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heartbeat(identity: &str) -> Heartbeat {
        Heartbeat {
            format: FORMAT.to_owned(),
            identity: identity.to_owned(),
            pid: 1,
            base_id: 7,
            hot_restart_version: "11.104".to_owned(),
            newest_epoch: 3,
            envoy_pid: 12,
            state: NodeState::Serving,
            updated_unix_ms: unix_ms(),
            parent_draining_until_unix_ms: 0,
            restart_in_flight: false,
            cold_takeover_of: None,
            handover: None,
            socket_path: String::new(),
            admin_address: String::new(),
            generation: 0,
        }
    }

    #[test]
    fn round_trip_and_rejects() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &heartbeat("pod-a")).unwrap();
        write(dir.path(), &heartbeat("pod/b weird")).unwrap();
        std::fs::write(
            dir.path().join("heartbeat-corrupt.json"),
            "{\"format\": tru",
        )
        .unwrap();
        std::fs::write(dir.path().join("heartbeat-truncated.json"), "").unwrap();
        let mut foreign = heartbeat("foreign");
        foreign.format = "someone-else.v9".to_owned();
        std::fs::write(
            dir.path().join("heartbeat-foreign.json"),
            serde_json::to_vec(&foreign).unwrap(),
        )
        .unwrap();
        // A file claiming another identity than its name.
        std::fs::write(
            dir.path().join("heartbeat-liar.json"),
            serde_json::to_vec(&heartbeat("pod-a")).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.path().join("unrelated.txt"), "x").unwrap();

        let (mut good, rejected) = read_all(dir.path());
        good.sort_by(|a, b| a.identity.cmp(&b.identity));
        assert_eq!(good.len(), 2, "{good:?}");
        assert_eq!(good[0], heartbeat_with_time(&good[0], "pod-a"));
        assert_eq!(good[1].identity, "pod/b weird");
        assert_eq!(rejected.len(), 4, "{rejected:?}");
        assert!(rejected.iter().all(|r| !r.reason.is_empty()));
    }

    #[test]
    fn the_others_are_read_without_our_own_file() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &heartbeat("pod-a")).unwrap();
        write(dir.path(), &heartbeat("pod-b")).unwrap();
        let (others, rejected) = read_others(dir.path(), "pod-a");
        assert_eq!(others.len(), 1, "{others:?}");
        assert_eq!(others[0].identity, "pod-b");
        assert!(rejected.is_empty());
        // Not opened: even a file of ours that would be rejected is not looked at.
        std::fs::write(dir.path().join(file_name("pod-a")), "not json").unwrap();
        let (others, rejected) = read_others(dir.path(), "pod-a");
        assert_eq!((others.len(), rejected.len()), (1, 0), "{rejected:?}");
        assert_eq!(
            read_all(dir.path()).1.len(),
            1,
            "read_all still looks at it"
        );
    }

    #[test]
    fn a_quiet_node_is_not_listed_again_until_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &heartbeat("pod-a")).unwrap();
        let settle = |at: SystemTime| {
            std::fs::File::open(dir.path())
                .unwrap()
                .set_modified(at)
                .unwrap();
        };
        let mut last = LastLook::default();
        // Changed just now: a change in the same clock step could still come unseen.
        for _ in 0..2 {
            assert!(
                read_others_since(dir.path(), "pod-a", &mut last)
                    .0
                    .is_empty()
            );
        }
        assert_eq!(last.listings, 2, "listed each time while freshly changed");
        settle(SystemTime::now() - Duration::from_secs(10));
        for _ in 0..3 {
            assert!(
                read_others_since(dir.path(), "pod-a", &mut last)
                    .0
                    .is_empty()
            );
        }
        assert_eq!(last.listings, 3, "listed once since it settled");
        // Touching our own heartbeat changes no name: still quiet.
        touch(dir.path(), "pod-a").unwrap();
        read_others_since(dir.path(), "pod-a", &mut last);
        assert_eq!(last.listings, 3);

        // pod-b arrives (a name added): seen at once, and listed every time while it is there.
        write(dir.path(), &heartbeat("pod-b")).unwrap();
        settle(SystemTime::now() - Duration::from_secs(10));
        for listings in 4..6 {
            let (others, _) = read_others_since(dir.path(), "pod-a", &mut last);
            assert_eq!(others.len(), 1, "{others:?}");
            assert_eq!(last.listings, listings);
        }
        // A file not trusted is reported each look, as before.
        remove(dir.path(), "pod-b");
        std::fs::write(dir.path().join(file_name("pod-c")), "not json").unwrap();
        settle(SystemTime::now() - Duration::from_secs(10));
        for _ in 0..2 {
            let (others, rejected) = read_others_since(dir.path(), "pod-a", &mut last);
            assert_eq!((others.len(), rejected.len()), (0, 1));
        }
        assert_eq!(last.listings, 7);
    }

    #[test]
    fn a_touched_heartbeat_is_as_fresh_as_the_touch() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = heartbeat("pod-a");
        h.updated_unix_ms = unix_ms() - 60_000;
        write(dir.path(), &h).unwrap();
        // Written a minute ago, too.
        std::fs::File::options()
            .write(true)
            .open(dir.path().join(file_name("pod-a")))
            .unwrap()
            .set_modified(std::time::SystemTime::now() - Duration::from_secs(60))
            .unwrap();
        let (read, _) = read_all(dir.path());
        assert!(
            !read[0].fresh(unix_ms(), Duration::from_secs(2)),
            "a minute old"
        );
        touch(dir.path(), "pod-a").unwrap();
        let (read, _) = read_all(dir.path());
        assert!(read[0].fresh(unix_ms(), Duration::from_secs(2)), "{read:?}");
        assert_eq!(read[0].newest_epoch, h.newest_epoch, "the content is kept");
        assert!(
            touch(dir.path(), "pod-b").is_err(),
            "only an existing heartbeat"
        );
    }

    fn heartbeat_with_time(seen: &Heartbeat, identity: &str) -> Heartbeat {
        let mut h = heartbeat(identity);
        h.updated_unix_ms = seen.updated_unix_ms;
        h
    }

    #[test]
    fn freshness() {
        let now = unix_ms();
        let mut h = heartbeat("a");
        h.updated_unix_ms = now;
        assert!(h.fresh(now, Duration::from_secs(1)));
        h.updated_unix_ms = now - 5_000;
        assert!(!h.fresh(now, Duration::from_secs(1)), "old");
        h.updated_unix_ms = now + 1_000;
        assert!(h.fresh(now, Duration::from_secs(1)), "within the skew");
        h.updated_unix_ms = now + 3_600_000;
        assert!(
            !h.fresh(now, Duration::from_secs(1)),
            "stamped in the future: never fresh forever"
        );
    }

    #[test]
    fn only_small_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &heartbeat("real")).unwrap();
        // A FIFO would block a plain open; a symlink could point anywhere; a huge file would
        // exhaust memory.
        nix::unistd::mkfifo(
            &dir.path().join("heartbeat-fifo.json"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        std::os::unix::fs::symlink(
            dir.path().join("heartbeat-real.json"),
            dir.path().join("heartbeat-link.json"),
        )
        .unwrap();
        let big = std::fs::File::create(dir.path().join("heartbeat-big.json")).unwrap();
        big.set_len(1 << 30).unwrap();
        std::fs::create_dir(dir.path().join("heartbeat-dir.json")).unwrap();
        let (good, rejected) = read_all(dir.path());
        assert_eq!(good.len(), 1, "{good:?}");
        let reasons: Vec<String> = rejected.iter().map(|r| r.reason.clone()).collect();
        assert_eq!(rejected.len(), 4, "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("FIFO")), "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("symlink")), "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("bytes")), "{reasons:?}");
        assert!(
            reasons.iter().any(|r| r.contains("directory")),
            "{reasons:?}"
        );
    }

    #[test]
    fn unknown_states_and_fields() {
        let mut json = serde_json::to_value(heartbeat("x")).unwrap();
        json["future_field"] = serde_json::json!(1);
        assert!(parse_bytes(json.to_string().as_bytes(), "heartbeat-x.json").is_ok());
        json["state"] = serde_json::json!("levitating");
        let err = parse_bytes(json.to_string().as_bytes(), "heartbeat-x.json").unwrap_err();
        assert!(err.to_string().contains("unknown state"), "{err}");
        // Written before restart_in_flight existed.
        json["state"] = serde_json::json!("serving");
        json.as_object_mut().unwrap().remove("restart_in_flight");
        assert!(
            !parse_bytes(json.to_string().as_bytes(), "heartbeat-x.json")
                .unwrap()
                .restart_in_flight
        );
    }

    #[tokio::test]
    async fn the_lock_is_exclusive() {
        let dir = tempfile::tempdir().unwrap();
        let first = EpochLock::acquire(dir.path(), Duration::from_secs(1))
            .await
            .unwrap();
        let err = EpochLock::acquire(dir.path(), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        drop(first);
        EpochLock::acquire(dir.path(), Duration::from_secs(1))
            .await
            .unwrap();
    }
}

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
//! `state` is `starting` (its first epoch is not LIVE yet; `newest_epoch` is the epoch it is
//! starting), `serving`, `handed_over` (a successor's Envoy took over; this one's Envoy
//! drains) or `stopping`. `envoy_pid` is in the supervisor's own PID namespace. A heartbeat is
//! fresh when `updated_unix_ms` is recent (three periods). A file that does not parse, has
//! another `format`, or whose `identity` does not match its name is reported and ignored: never
//! trusted, never a crash.
//!
//! `<state-dir>/epoch.lock` is `flock`ed by a starting supervisor from the moment it reads the
//! heartbeats until its first epoch is LIVE (or failed), so two successors cannot pick the same
//! epoch: the second waits, then sees the first as its predecessor.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

/// The `format` of version 1.
pub const FORMAT: &str = "envoy-agent.heartbeat.v1";

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
    /// `starting`, `serving`, `handed_over`, `stopping`.
    pub state: String,
    /// When written, Unix milliseconds.
    pub updated_unix_ms: u64,
    /// Until when its previous generation may still drain (a successor must not start a
    /// third generation before), Unix milliseconds; 0 when none drains.
    pub parent_draining_until_unix_ms: u64,
}

impl Heartbeat {
    /// Whether it was written within `max_age`.
    pub fn fresh(&self, max_age: Duration) -> bool {
        unix_ms().saturating_sub(self.updated_unix_ms) <= max_age.as_millis() as u64
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
    envoy_agent_proxy::write_atomically(&dir.join(file_name(&heartbeat.identity)), &bytes)
}

/// Removes `identity`'s heartbeat.
pub fn remove(dir: &Path, identity: &str) {
    let _ = std::fs::remove_file(dir.join(file_name(identity)));
}

/// Every heartbeat in `dir`, and the files that were not trusted.
pub fn read_all(dir: &Path) -> (Vec<Heartbeat>, Vec<Rejected>) {
    let mut heartbeats = Vec::new();
    let mut rejected = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (heartbeats, rejected);
    };
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("heartbeat-") && name.ends_with(".json")) {
            continue;
        }
        let path = entry.path();
        match parse(&path, &name) {
            Ok(h) => heartbeats.push(h),
            Err(reason) => rejected.push(Rejected { path, reason }),
        }
    }
    (heartbeats, rejected)
}

fn parse(path: &Path, name: &str) -> Result<Heartbeat, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("unreadable: {e}"))?;
    let heartbeat: Heartbeat =
        serde_json::from_slice(&bytes).map_err(|e| format!("not a heartbeat: {e}"))?;
    if heartbeat.format != FORMAT {
        return Err(format!(
            "unknown format {:?} (expected {FORMAT})",
            heartbeat.format
        ));
    }
    if file_name(&heartbeat.identity) != name {
        return Err(format!(
            "identity {:?} does not match the file name",
            heartbeat.identity
        ));
    }
    Ok(heartbeat)
}

/// The epoch-allocation lock, held while it lives.
#[derive(Debug)]
pub struct EpochLock {
    _lock: Flock<std::fs::File>,
}

impl EpochLock {
    /// Takes `<dir>/epoch.lock`, waiting (polling) up to `timeout` for another holder.
    pub async fn acquire(dir: &Path, timeout: Duration) -> std::io::Result<EpochLock> {
        let path = dir.join("epoch.lock");
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
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
            state: "serving".to_owned(),
            updated_unix_ms: unix_ms(),
            parent_draining_until_unix_ms: 0,
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

    fn heartbeat_with_time(seen: &Heartbeat, identity: &str) -> Heartbeat {
        let mut h = heartbeat(identity);
        h.updated_unix_ms = seen.updated_unix_ms;
        h
    }

    #[test]
    fn freshness() {
        let mut h = heartbeat("a");
        assert!(h.fresh(Duration::from_secs(1)));
        h.updated_unix_ms -= 5_000;
        assert!(!h.fresh(Duration::from_secs(1)));
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

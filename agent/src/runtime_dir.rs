//! This run's private directory under the temporary directory
//! (`<temp dir>/envoy-agent-<pid>.<start>`: a sidecar's drain-notice file, the admin socket's
//! directory, Envoy's admin address file), and what earlier runs left of theirs.
//!
//! # Theory of operation
//!
//! - **Made, held, removed.** [`RuntimeDir::make`] creates the directory and holds a lock on a
//!   file in it (`.lock`, `flock`) for as long as the value lives; the run removes the
//!   directory at its end ([`RuntimeDir::remove`]). The kernel drops the lock when the process
//!   dies, however it dies.
//! - **What a killed run leaves is swept by the next.** An agent SIGKILLed (an OOM kill, a
//!   test kit's kill on drop, `kill -9`) cannot remove its directory; in a pod whose `/tmp` is
//!   an `emptyDir` it outlives the container's restart. [`sweep`] removes every directory of
//!   the same name pattern, owned by the same user, whose lock nobody holds: its run is over.
//!   A directory whose lock is held belongs to a live agent (another pod's, a second agent on
//!   the same paths, an agent in another PID namespace, where pids repeat), and one with no
//!   lock file is left alone: an older version's, or one being made.
//! - **No window.** The lock file is taken under a temporary name and renamed into place held,
//!   so a sweeper never finds a `.lock` that nobody holds yet.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

/// The lock file's name in a runtime directory.
const LOCK: &str = ".lock";
/// The runtime directories' prefix; `envoy-agent-<pid>.<start in hex>`.
const PREFIX: &str = "envoy-agent-";

/// A runtime directory this run made, and the lock that says it is in use.
#[derive(Debug)]
pub struct RuntimeDir {
    path: PathBuf,
    _lock: Flock<File>,
}

impl RuntimeDir {
    /// A unique path for this run under `temp_dir` (not made yet). Unique to this run, not
    /// only to this pid: every agent that is PID 1 of its container has pid 1, and two of them
    /// may share a /tmp (pods of a test, a shared volume). The `.` keeps it apart from the
    /// gRPC socket's `envoy-agent-<uid>` directory.
    pub fn path_in(temp_dir: &Path) -> PathBuf {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        temp_dir.join(format!("{PREFIX}{}.{started:x}", std::process::id()))
    }

    /// Creates `path` and takes its lock.
    pub fn make(path: &Path) -> std::io::Result<RuntimeDir> {
        fs::create_dir_all(path)?;
        let taking = path.join(".lock.taking");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&taking)?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, errno)| std::io::Error::from(errno))?;
        fs::rename(&taking, path.join(LOCK))?;
        Ok(RuntimeDir {
            path: path.to_owned(),
            _lock: lock,
        })
    }

    /// Removes the directory and all in it (the lock goes with the value).
    pub fn remove(self) {
        if let Err(e) = fs::remove_dir_all(&self.path) {
            tracing::debug!(dir = %self.path.display(), error = %e, "cannot remove runtime dir");
        }
    }
}

/// Removes the runtime directories under `temp_dir` that runs of `uid` left behind (their
/// lock free), except `own`; returns what was removed. Never fails: what cannot be read or
/// removed is left.
pub fn sweep(temp_dir: &Path, uid: u32, own: Option<&Path>) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(temp_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| Some(p.as_path()) != own)
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(is_runtime_name)
        })
        .filter(|p| {
            // Not through a symlink: a directory of ours, made by a run of ours.
            fs::symlink_metadata(p).is_ok_and(|m| m.is_dir() && m.uid() == uid)
        })
        .filter(|p| left_behind(p))
        .filter(|p| fs::remove_dir_all(p).is_ok())
        .collect()
}

/// `envoy-agent-<pid>.<hex>`.
fn is_runtime_name(name: &str) -> bool {
    let Some((pid, start)) = name.strip_prefix(PREFIX).and_then(|r| r.split_once('.')) else {
        return false;
    };
    !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit())
        && !start.is_empty()
        && start.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `dir`'s lock file is there and nobody holds it. Taken only to look: released at
/// once (the directory is removed next).
fn left_behind(dir: &Path) -> bool {
    let Ok(file) = OpenOptions::new()
        .write(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(dir.join(LOCK))
    else {
        return false;
    };
    Flock::lock(file, FlockArg::LockExclusiveNonblock).is_ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn uid() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn only_runtime_names_are_runtime_names() {
        assert!(is_runtime_name("envoy-agent-1.18eecd177d18eeff"));
        assert!(is_runtime_name("envoy-agent-25714.18eecd1e9c944716"));
        for other in [
            "envoy-agent-0",
            "envoy-agent-hr-0",
            "envoy-agent-test.DjuHL8",
            "envoy-agent-12.",
            "envoy-agent-.1a",
            "envoy-agent-12.xyz",
            "other-12.1a",
        ] {
            assert!(!is_runtime_name(other), "{other}");
        }
    }

    #[test]
    fn a_dead_runs_directory_is_swept_a_live_ones_and_others_are_not() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        // A run that was killed: its lock file there, nobody holding it.
        let dead = t.join("envoy-agent-41.1a");
        drop(RuntimeDir::make(&dead).unwrap());
        fs::write(dead.join("drain-0-0"), "1").unwrap();
        // A run that lives (another agent on the same /tmp).
        let live = RuntimeDir::make(&t.join("envoy-agent-42.2b")).unwrap();
        // Ours, made just now.
        let own_path = t.join("envoy-agent-43.3c");
        let own = RuntimeDir::make(&own_path).unwrap();
        // No lock file: an older version's, or one being made.
        let unlocked = t.join("envoy-agent-44.4d");
        fs::create_dir(&unlocked).unwrap();
        // Not a runtime directory, though dead-looking.
        let other = t.join("envoy-agent-hr-0");
        fs::create_dir(&other).unwrap();
        fs::write(other.join(LOCK), "").unwrap();
        // A symlink to a dead run's directory elsewhere.
        let elsewhere = tempfile::tempdir().unwrap();
        let target = elsewhere.path().join("envoy-agent-45.5e");
        drop(RuntimeDir::make(&target).unwrap());
        std::os::unix::fs::symlink(&target, t.join("envoy-agent-45.5e")).unwrap();

        assert_eq!(
            sweep(t, uid(), Some(&own_path)),
            std::slice::from_ref(&dead)
        );
        assert!(!dead.exists());
        for kept in [&live.path, &own_path, &unlocked, &other, &target] {
            assert!(kept.exists(), "{}", kept.display());
        }
        // Another user's dead run is not ours to remove.
        drop(live);
        assert_eq!(sweep(t, uid() + 1, Some(&own_path)), Vec::<PathBuf>::new());
        own.remove();
        assert!(!own_path.exists());
    }
}

//! The sign that a starting epoch is about to be LIVE: its admin address file.
//!
//! Envoy writes its admin address to `--admin-address-path` the moment its admin listener is
//! bound. A hot-restart child binds that listener only after its parent has given it up, and
//! on Envoy 1.40 that happens a few milliseconds before the child reaches LIVE (measured: the
//! parent's admin answers until ~3 ms before). So each epoch gets its own file in a private
//! directory, and an inotify watch on that directory tells the supervisor when to poll closely:
//! before the file appears every LIVE check would only reach the parent.
//!
//! One watch serves every epoch (a thread of `notify`'s, idle between events). An epoch is
//! [`AdminFiles::expect`]ed before it is spawned, so its file cannot be missed; a stale file of
//! the same name is removed first, and only a file *arriving* (created or written, never
//! removed) counts. Dropping [`AdminFiles`] removes the watch. If the watch cannot be set up,
//! the supervisor polls without the hint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::oneshot;

use envoy_agent_proxy::args::admin_address_file;

type Waiting = Arc<Mutex<HashMap<u32, oneshot::Sender<()>>>>;

/// A watch on the directory where each epoch writes its admin address.
pub(crate) struct AdminFiles {
    dir: PathBuf,
    waiting: Waiting,
    _watcher: RecommendedWatcher,
}

impl std::fmt::Debug for AdminFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminFiles")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn lock(waiting: &Waiting) -> MutexGuard<'_, HashMap<u32, oneshot::Sender<()>>> {
    waiting.lock().unwrap_or_else(|p| p.into_inner())
}

/// The epoch whose file `path` is, if it is one.
fn epoch_of(path: &Path) -> Option<u32> {
    path.file_name()?
        .to_str()?
        .strip_prefix("admin-address.")?
        .parse()
        .ok()
}

/// Why the admin address files cannot be watched (a starting epoch's LIVE checks then go by
/// their blind pace).
#[derive(Debug, thiserror::Error)]
pub(crate) enum WatchError {
    /// The directory cannot be made.
    #[error("cannot create {}: {error}", .dir.display())]
    Create { dir: PathBuf, error: std::io::Error },
    /// inotify refused (no watches left, ...).
    #[error("cannot watch {}: {error}", .dir.display())]
    Watch { dir: PathBuf, error: notify::Error },
}

impl AdminFiles {
    /// Watches `dir` (created if missing).
    pub(crate) fn watch(dir: &Path) -> Result<Self, WatchError> {
        std::fs::create_dir_all(dir).map_err(|error| WatchError::Create {
            dir: dir.to_owned(),
            error,
        })?;
        let unwatchable = |error| WatchError::Watch {
            dir: dir.to_owned(),
            error,
        };
        let waiting: Waiting = Arc::default();
        let seen = waiting.clone();
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                let Ok(event) = event else { return };
                // A removal (ours, of a stale file) says nothing about a listener.
                if !matches!(
                    event.kind,
                    EventKind::Create(_) | EventKind::Modify(_) | EventKind::Access(_)
                ) {
                    return;
                }
                for epoch in event.paths.iter().filter_map(|p| epoch_of(p)) {
                    if let Some(tx) = lock(&seen).remove(&epoch) {
                        let _ = tx.send(());
                    }
                }
            })
            .map_err(unwatchable)?;
        watcher
            .watch(dir, RecursiveMode::NonRecursive)
            .map_err(unwatchable)?;
        Ok(AdminFiles {
            dir: dir.to_path_buf(),
            waiting,
            _watcher: watcher,
        })
    }

    /// Resolves once `epoch` has written its admin address. Call it before spawning the epoch.
    /// The previous epoch's file goes too: it has served its purpose.
    pub(crate) fn expect(&self, epoch: u32) -> oneshot::Receiver<()> {
        for e in [epoch.checked_sub(1), Some(epoch)].into_iter().flatten() {
            let _ = std::fs::remove_file(admin_address_file(&self.dir, e));
        }
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(epoch, tx);
        rx
    }

    /// `epoch` will not start after all (its spawn failed).
    pub(crate) fn forget(&self, epoch: u32) {
        lock(&self.waiting).remove(&epoch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_file_written_for_an_expected_epoch_resolves_it_and_a_stale_one_does_not() {
        let dir = tempfile::tempdir().unwrap();
        // Stale, from an earlier run: removed by `expect`, and that removal is no sign.
        std::fs::write(admin_address_file(dir.path(), 3), "127.0.0.1:1").unwrap();
        let files = AdminFiles::watch(dir.path()).unwrap();
        let mut three = files.expect(3);
        let four = files.expect(4);
        assert!(!admin_address_file(dir.path(), 3).exists());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(three.try_recv().is_err(), "nothing was written yet");
        std::fs::write(admin_address_file(dir.path(), 4), "127.0.0.1:9901").unwrap();
        tokio::time::timeout(Duration::from_secs(10), four)
            .await
            .expect("seen within the bound")
            .expect("resolved");
        assert!(
            three.try_recv().is_err(),
            "another epoch's file is not ours"
        );
    }

    #[test]
    fn only_admin_address_files_name_an_epoch() {
        assert_eq!(epoch_of(Path::new("/x/admin-address.12")), Some(12));
        assert_eq!(epoch_of(Path::new("/x/admin-address")), None);
        assert_eq!(epoch_of(Path::new("/x/admin-address.12.tmp")), None);
    }
}

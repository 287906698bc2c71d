//! Watching the Envoy bootstrap for changes, one event per burst.
//!
//! # Theory of operation
//!
//! The watch is put on the bootstrap's *parent directory*, non-recursively, not on the file.
//! A watch on the file follows one inode, and the usual ways of updating a config replace the
//! inode: an editor or a tool writes a temporary file and renames it over the path, and a
//! Kubernetes ConfigMap volume swaps a `..data` symlink to a new timestamped directory, so the
//! content behind `bootstrap.yaml` changes without any event on that name at all. A directory
//! watch sees every one of those as some event in the directory (a modify, a rename, a create).
//!
//! Because the events carry names that need not be the bootstrap's (`..data`, a temporary file,
//! an unrelated file next to it), no event is trusted to say what changed. Any event is only a
//! reason to look: the file is read through its path, following symlinks as Envoy would, and its
//! fingerprint (length and hash) is compared with that of the content last reported, or read at
//! [`ConfigWatch::start`]. Only a different fingerprint is reported, so touching the file,
//! rewriting it unchanged, or writing other files in the directory restarts nothing. Access
//! events (opens and closes, including Envoy's and our own reads) are dropped before that, or
//! every check would cause the next one.
//!
//! Updates come in bursts (truncate then write, create then rename, several files of a
//! ConfigMap), and a reader in the middle of one can see a half-written file. So after the first
//! event the watch waits until no event has come for the debounce period, and then reads once.
//! A writer that never pauses would postpone that forever, so the wait ends anyway ten debounce
//! periods after the burst's first event.
//!
//! Validating a config takes Envoy about as long as starting, so the debounce is not wasted:
//! after the burst's first short lull (a tenth of the debounce, at most 20 ms) the watch takes
//! an early look, and if the content differs it hands it over ([`Change::Settling`]) for
//! validation while the debounce goes on. The restart that follows finds the verdict ready
//! (or joins the run in flight). A look that catches a half-written file costs one wasted
//! validation; the settled content is what restarts, and it is validated on its own.
//!
//! A file that cannot be read at check time (deleted, or caught between two renames) is logged
//! and not reported; the next event in the directory checks it again.
//!
//! notify delivers events on a thread of its own. Its callback only pokes a one-slot channel:
//! one pending poke says all that is needed ("look again"), and a full slot means a look is
//! already due, so nothing is queued while the supervisor is busy. Debouncing and comparing
//! happen in [`ConfigWatch::changed`], on the caller's task.
//!
//! Dropping the [`ConfigWatch`] drops the notify watcher, which removes the inotify watch and
//! ends its thread. If the watched directory itself is removed or moved away, no later event can
//! concern the path, so the watch ends itself: [`ConfigWatch::changed`] returns `None` from then
//! on, and the owner decides whether to start a new one.
//!
//! The watch sees only what happens in the directory of the path given, not in the directories
//! its symlinks lead to. A ConfigMap update is seen because the kubelet swaps `..data` in the
//! watched directory; an edit written through the symlink, which lands in the timestamped
//! directory, is not (the kubelet never does that). Likewise a path that is a symlink out to
//! another directory sees only the symlink itself being replaced.

use std::hash::{DefaultHasher, Hasher};
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::event::{EventKind, ModifyKind};
use notify::{RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How many debounce periods after a burst's first event the file is read even if events still
/// come: a continuous stream of writes must still be reported.
const MAX_DEBOUNCES: u32 = 10;

/// The longest lull before a burst's early look.
const EARLY_LULL: Duration = Duration::from_millis(20);

/// Why a config watch could not start.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The path has no file name or no directory to watch (such as `/`).
    #[error("cannot watch config {path}: it does not name a file in a directory")]
    NotAFile {
        /// The path given.
        path: PathBuf,
    },
    /// The directory of the path cannot be watched (it does not exist, or the inotify limits are
    /// reached).
    #[error("cannot watch the directory of config {path}: {source}")]
    Watch {
        /// The path given.
        path: PathBuf,
        /// The watcher's error.
        source: notify::Error,
    },
    /// The file cannot be read to take the content that later changes are compared with.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The path given.
        path: PathBuf,
        /// The read error.
        source: std::io::Error,
    },
}

/// What the watch saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A burst of changes is being debounced; the file holds this now. Good for validating
    /// early, not for restarting.
    Settling(Vec<u8>),
    /// The content changed and has settled: restart.
    Settled,
}

/// A running watch; dropping it stops the watch.
pub struct ConfigWatch {
    /// The file, as given; read through on every check.
    path: PathBuf,
    /// The quiet period that ends a burst.
    debounce: Duration,
    /// The content last reported, or read at start.
    last: Fingerprint,
    /// Pokes from notify's thread; closed when that thread ends or the watch is lost.
    events: mpsc::Receiver<()>,
    /// When the burst being debounced began. Kept here, not in `changed`'s locals, so that a
    /// `changed` dropped mid-debounce (as in `select!`) leaves the burst due for the next call
    /// instead of losing its poke.
    burst_started: Option<Instant>,
    /// Whether the current burst has had its early look.
    looked_early: bool,
    /// Held only to keep the inotify watch alive; dropping it ends the watch.
    _watcher: RecommendedWatcher,
}

impl ConfigWatch {
    /// Starts watching `path` (its directory), yielding at most once per burst, `debounce` apart.
    ///
    /// The file's content now is what the first change is measured against, so the file must be
    /// readable. The watch is set before that read, so a change racing with `start` is either
    /// in the baseline or seen as a change. Needs no runtime; [`ConfigWatch::changed`] does.
    pub fn start(path: &Path, debounce: Duration) -> Result<ConfigWatch, WatchError> {
        let dir = match (path.file_name(), path.parent()) {
            // A bare file name is in the working directory.
            (Some(_), Some(dir)) if dir.as_os_str().is_empty() => Path::new("."),
            (Some(_), Some(dir)) => dir,
            _ => {
                return Err(WatchError::NotAFile {
                    path: path.to_path_buf(),
                });
            }
        };
        let watch_error = |source: notify::Error| WatchError::Watch {
            path: path.to_path_buf(),
            source,
        };
        // notify names the watched directory in its events by the absolute path it was given;
        // make it absolute here so that the events about the directory itself can be recognised.
        let dir = std::path::absolute(dir)
            .map_err(|err| watch_error(notify::Error::io(err).add_path(dir.to_path_buf())))?;

        let (tx, events) = mpsc::channel(1);
        let mut watcher = notify::recommended_watcher(poker(tx, dir.clone(), path.to_path_buf()))
            .map_err(watch_error)?;
        watcher
            .watch(&dir, RecursiveMode::NonRecursive)
            .map_err(watch_error)?;

        let last = read(path).map_err(|source| WatchError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(ConfigWatch {
            path: path.to_path_buf(),
            debounce,
            last,
            events,
            burst_started: None,
            looked_early: false,
            _watcher: watcher,
        })
    }

    /// Resolves with [`Change::Settled`] when the file's content has changed since the last
    /// time that was reported (or since `start`), and before that, at most once per burst,
    /// with [`Change::Settling`] and the content as it looks early in the burst. `None` if the
    /// watch has failed for good (the watcher thread ended).
    ///
    /// Cancel-safe: dropped before it resolves, it forgets nothing, and the next call picks the
    /// pending burst up where this one left it.
    pub async fn changed(&mut self) -> Option<Change> {
        loop {
            let started = match self.burst_started {
                Some(started) => started,
                None => {
                    self.events.recv().await?;
                    self.looked_early = false;
                    *self.burst_started.insert(Instant::now())
                }
            };
            if !self.looked_early {
                let lull = (self.debounce / 10).min(EARLY_LULL);
                self.settle(started, lull).await;
                self.looked_early = true;
                if let Ok(bytes) = envoy_agent_proxy::read_config(&self.path) {
                    if Fingerprint::of(&bytes) != self.last {
                        return Some(Change::Settling(bytes));
                    }
                }
            }
            self.settle(started, self.debounce).await;
            self.burst_started = None;
            // No await from here to the return: the new content is taken and reported together,
            // so a cancelled call can never have taken a change without reporting it.
            match read(&self.path) {
                Ok(now) if now != self.last => {
                    self.last = now;
                    return Some(Change::Settled);
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(
                        path = %self.path.display(),
                        error = %err,
                        "cannot read the config to see whether it changed; \
                         will look again on the next change in its directory",
                    );
                }
            }
            // Nothing new: wait for the next burst. If the channel closed during the debounce,
            // the `recv` above returns `None` right away.
        }
    }

    /// Takes `content` as the config's current content, as if this watch had already reported
    /// it: the agent calls this just before it writes a config it applies itself, so that its
    /// own write does not come back as a change (and a second restart).
    pub fn expect(&mut self, content: &[u8]) {
        self.last = Fingerprint::of(content);
    }

    /// Waits until the burst that began at `started` has been quiet for `quiet`, or has lasted
    /// [`MAX_DEBOUNCES`] debounce periods, or the watch has ended.
    async fn settle(&mut self, started: Instant, quiet: Duration) {
        let longest = self.debounce.saturating_mul(MAX_DEBOUNCES);
        loop {
            let left = longest.saturating_sub(started.elapsed());
            if left.is_zero() {
                return;
            }
            // `timeout` takes durations too large for an instant as "never", so a huge debounce
            // cannot overflow here.
            match tokio::time::timeout(quiet.min(left), self.events.recv()).await {
                Ok(Some(())) => {}
                Ok(None) | Err(_) => return,
            }
        }
    }
}

/// The notify callback: pokes `tx` for every event that may mean a change in `dir`, and closes
/// it when `dir` itself is removed or moved, since no later event can concern `path` then.
fn poker(
    tx: mpsc::Sender<()>,
    dir: PathBuf,
    path: PathBuf,
) -> impl FnMut(notify::Result<notify::Event>) + Send + 'static {
    let mut tx = Some(tx);
    move |event| {
        let Some(sender) = &tx else {
            return;
        };
        match event {
            // Opens and closes change nothing, and our own reads cause them.
            Ok(event) if matches!(event.kind, EventKind::Access(_)) => {}
            Ok(event)
                if matches!(
                    event.kind,
                    EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
                ) && event.paths.contains(&dir) =>
            {
                tracing::warn!(
                    dir = %dir.display(),
                    path = %path.display(),
                    "the config's directory was removed or moved; \
                     changes to the config are no longer watched",
                );
                tx = None;
            }
            Ok(_) => {
                // A full slot already holds a poke, and a closed one has no reader left.
                let _ = sender.try_send(());
            }
            Err(err) => {
                // Events may have been lost with the error; looking again costs one read.
                tracing::warn!(path = %path.display(), error = %err, "config watch error");
                let _ = sender.try_send(());
            }
        }
    }
}

/// What is kept of a content to tell whether it changed: enough, with the length, that a
/// collision between two versions of a config is not a practical concern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    len: usize,
    hash: u64,
}

/// Reads `path`, following symlinks, into its fingerprint.
fn read(path: &Path) -> std::io::Result<Fingerprint> {
    envoy_agent_proxy::read_config(path).map(|bytes| Fingerprint::of(&bytes))
}

impl Fingerprint {
    fn of(bytes: &[u8]) -> Fingerprint {
        // `DefaultHasher::new` uses fixed keys, so fingerprints compare within the process.
        let mut hasher = DefaultHasher::new();
        hasher.write(bytes);
        Fingerprint {
            len: bytes.len(),
            hash: hasher.finish(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tempfile::TempDir;
    use tokio::time::timeout;

    use super::*;

    const DEBOUNCE: Duration = Duration::from_millis(100);
    /// Bound on waiting for an event that must come.
    const EVENT: Duration = Duration::from_secs(5);
    /// How long to wait to be fairly sure that no event comes.
    const QUIET: Duration = Duration::from_millis(600);

    /// A temp dir with `bootstrap.yaml` holding `content`, watched.
    fn watched(content: &str) -> (TempDir, PathBuf, ConfigWatch) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bootstrap.yaml");
        fs::write(&path, content).unwrap();
        let watch = ConfigWatch::start(&path, DEBOUNCE).unwrap();
        (dir, path, watch)
    }

    /// The next settled change, skipping early looks.
    async fn settled(watch: &mut ConfigWatch) -> Option<Change> {
        loop {
            match watch.changed().await {
                Some(Change::Settling(_)) => continue,
                other => return other,
            }
        }
    }

    async fn expect_change(watch: &mut ConfigWatch) {
        let got = timeout(EVENT, settled(watch)).await;
        assert_eq!(got.ok(), Some(Some(Change::Settled)), "expected one change");
    }

    async fn expect_quiet(watch: &mut ConfigWatch) {
        let got = timeout(QUIET, settled(watch)).await;
        assert!(got.is_err(), "expected no change, got {got:?}");
    }

    #[tokio::test]
    async fn rewrite_in_place_yields_once() {
        let (_dir, path, mut watch) = watched("version: 1\n");
        fs::write(&path, "version: 2\n").unwrap();
        expect_change(&mut watch).await;
        expect_quiet(&mut watch).await;
    }

    #[tokio::test]
    async fn own_reads_do_not_wake_the_watch() {
        let (_dir, path, mut watch) = watched("version: 1\n");
        fs::write(&path, "version: 2\n").unwrap();
        expect_change(&mut watch).await;
        // The check in `changed` opened the file; had that open been taken as an event, a poke
        // would be waiting by now, and every check would cause another.
        tokio::time::sleep(QUIET).await;
        assert!(watch.events.try_recv().is_err(), "a read woke the watch");
    }

    #[tokio::test]
    async fn cancelled_changed_keeps_the_burst() {
        let (_dir, path, mut watch) = watched("version: 1\n");
        fs::write(&path, "version: 2\n").unwrap();
        // Shorter than the debounce: dropped mid-debounce, having taken the poke.
        let early = timeout(DEBOUNCE / 2, settled(&mut watch)).await;
        assert!(early.is_err(), "resolved before the debounce: {early:?}");
        expect_change(&mut watch).await;
    }

    #[tokio::test]
    async fn the_new_content_is_handed_over_early_in_the_burst() {
        let debounce = Duration::from_secs(2);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bootstrap.yaml");
        fs::write(&path, "version: 1\n").unwrap();
        let mut watch = ConfigWatch::start(&path, debounce).unwrap();
        fs::write(&path, "version: 2\n").unwrap();
        // Well before the debounce ends: the content, to validate meanwhile.
        let early = timeout(debounce / 2, watch.changed()).await;
        assert_eq!(
            early.ok(),
            Some(Some(Change::Settling(b"version: 2\n".to_vec())))
        );
        // Then the settled change, once.
        let got = timeout(EVENT + debounce, watch.changed()).await;
        assert_eq!(got.ok(), Some(Some(Change::Settled)));
        expect_quiet(&mut watch).await;
    }

    #[tokio::test]
    async fn no_early_look_for_content_already_expected() {
        let (_dir, path, mut watch) = watched("version: 1\n");
        watch.expect(b"version: 2\n");
        fs::write(&path, "version: 2\n").unwrap();
        let got = timeout(QUIET, watch.changed()).await;
        assert!(got.is_err(), "the agent's own write came back: {got:?}");
    }

    #[tokio::test]
    async fn atomic_replace_yields_once() {
        let (dir, path, mut watch) = watched("version: 1\n");
        let tmp = dir.path().join(".bootstrap.yaml.tmp");
        fs::write(&tmp, "version: 2\n").unwrap();
        fs::rename(&tmp, &path).unwrap();
        expect_change(&mut watch).await;
        expect_quiet(&mut watch).await;
    }

    /// Publishes `content` the way the kubelet updates a ConfigMap volume: a new timestamped
    /// directory, a `..data_tmp` symlink to it renamed over `..data`, the old directory removed.
    fn publish(dir: &Path, stamp: &str, content: &str) {
        let data = dir.join(stamp);
        fs::create_dir(&data).unwrap();
        fs::write(data.join("bootstrap.yaml"), content).unwrap();
        let old = fs::read_link(dir.join("..data")).ok();
        symlink(stamp, dir.join("..data_tmp")).unwrap();
        fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
        if let Some(old) = old {
            fs::remove_dir_all(dir.join(old)).unwrap();
        }
    }

    #[tokio::test]
    async fn configmap_symlink_swap_yields_per_swap() {
        let dir = tempfile::tempdir().unwrap();
        publish(
            dir.path(),
            "..2026_11_29_10_00_00.000000001",
            "version: 1\n",
        );
        let path = dir.path().join("bootstrap.yaml");
        symlink("..data/bootstrap.yaml", &path).unwrap();
        let mut watch = ConfigWatch::start(&path, DEBOUNCE).unwrap();

        publish(
            dir.path(),
            "..2026_11_29_10_01_00.000000002",
            "version: 2\n",
        );
        expect_change(&mut watch).await;
        expect_quiet(&mut watch).await;

        publish(
            dir.path(),
            "..2026_11_29_10_02_00.000000003",
            "version: 3\n",
        );
        expect_change(&mut watch).await;
        expect_quiet(&mut watch).await;
    }

    #[tokio::test]
    async fn burst_of_writes_yields_once() {
        let (_dir, path, mut watch) = watched("version: 0\n");
        // From a thread of its own, so that the writes overlap the debounce as they would in
        // production, instead of all landing before `changed` is first polled.
        let writer = std::thread::spawn(move || {
            for i in 1..=10 {
                fs::write(&path, format!("version: {i}\n")).unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        expect_change(&mut watch).await;
        writer.join().unwrap();
        expect_quiet(&mut watch).await;
    }

    #[tokio::test]
    async fn continuous_writes_still_yield() {
        let (_dir, path, mut watch) = watched("version: 0\n");
        let stop = Arc::new(AtomicBool::new(false));
        let writer = std::thread::spawn({
            let stop = Arc::clone(&stop);
            move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    fs::write(&path, format!("version: {i}\n")).unwrap();
                    // Well inside the debounce, so the burst never goes quiet.
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        });
        // The cap is a second; the writer would go on for good.
        let got = timeout(EVENT, settled(&mut watch)).await;
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
        assert_eq!(
            got.ok(),
            Some(Some(Change::Settled)),
            "a continuous stream must yield"
        );
    }

    #[tokio::test]
    async fn unchanged_content_and_other_files_do_not_yield() {
        let (dir, path, mut watch) = watched("version: 1\n");
        fs::write(&path, "version: 1\n").unwrap();
        fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(std::time::SystemTime::now())
            .unwrap();
        fs::write(dir.path().join("other.yaml"), "unrelated\n").unwrap();
        expect_quiet(&mut watch).await;

        // Still watching: a real change after all that is seen.
        fs::write(&path, "version: 2\n").unwrap();
        expect_change(&mut watch).await;
    }

    #[tokio::test]
    async fn unreadable_file_does_not_yield_until_it_is_back() {
        let (_dir, path, mut watch) = watched("version: 1\n");
        fs::remove_file(&path).unwrap();
        expect_quiet(&mut watch).await;
        fs::write(&path, "version: 2\n").unwrap();
        expect_change(&mut watch).await;
    }

    #[tokio::test]
    async fn removing_the_directory_ends_the_watch() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("config");
        fs::create_dir(&dir).unwrap();
        let path = dir.join("bootstrap.yaml");
        fs::write(&path, "version: 1\n").unwrap();
        let mut watch = ConfigWatch::start(&path, DEBOUNCE).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        let got = timeout(EVENT, watch.changed()).await;
        assert_eq!(got.ok(), Some(None), "expected the watch to end");
    }

    #[tokio::test]
    async fn missing_directory_is_an_error_naming_the_path() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("absent").join("bootstrap.yaml");
        let err = match ConfigWatch::start(&path, DEBOUNCE) {
            Ok(_) => panic!("started a watch on a missing directory"),
            Err(err) => err,
        };
        assert!(matches!(err, WatchError::Watch { .. }), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains(&path.display().to_string()),
            "{message:?} does not name {}",
            path.display()
        );
    }

    #[tokio::test]
    async fn missing_file_is_an_error_naming_the_path() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("bootstrap.yaml");
        let err = match ConfigWatch::start(&path, DEBOUNCE) {
            Ok(_) => panic!("started a watch without a baseline"),
            Err(err) => err,
        };
        assert!(matches!(err, WatchError::Read { .. }), "{err:?}");
        assert!(err.to_string().contains(&path.display().to_string()));
    }

    #[test]
    fn root_is_not_a_file() {
        let err = ConfigWatch::start(Path::new("/"), DEBOUNCE).err();
        assert!(matches!(err, Some(WatchError::NotAFile { .. })), "{err:?}");
    }
}

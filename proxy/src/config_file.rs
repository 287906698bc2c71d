//! Writing a bootstrap so that a reader (Envoy, `--mode validate`, a file watcher) only ever
//! sees the old file or the new one, never a mix.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::ProxyError;

/// The largest config file the agent reads. Envoy's bootstraps are far smaller; a symlink to
/// `/dev/zero` must not grow the agent.
pub const MAX_CONFIG_SIZE: u64 = 64 << 20;

/// Reads a config file (following symlinks, as Envoy does): only a regular file of at most
/// [`MAX_CONFIG_SIZE`] bytes, opened without blocking, so that a FIFO or a device in its
/// place is refused, naming what it is, instead of hanging the agent.
pub fn read_config(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a file"
        };
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what}, not a regular file"),
        ));
    }
    let too_big = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("larger than {} MiB", MAX_CONFIG_SIZE >> 20),
        )
    };
    if meta.len() > MAX_CONFIG_SIZE {
        return Err(too_big());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or_default());
    file.take(MAX_CONFIG_SIZE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_CONFIG_SIZE {
        return Err(too_big());
    }
    Ok(bytes)
}

/// Replaces the config file at `path` with `bytes` atomically (off the async threads).
///
/// Through symlinks: the file written is the one `path` resolves to, so a ConfigMap's layout
/// (`bootstrap.yaml -> ..data/bootstrap.yaml`, `..data -> ..<timestamp>`) stays whole. Writing
/// over `path` itself would replace the first symlink with a plain file, and every later
/// ConfigMap update (the kubelet swaps `..data`) would never reach it.
pub async fn replace_config(path: &Path, bytes: Vec<u8>) -> Result<(), ProxyError> {
    let target = path.to_owned();
    let result = tokio::task::spawn_blocking(move || {
        let real = match fs::canonicalize(&target) {
            Ok(real) => real,
            Err(e) if e.kind() == io::ErrorKind::NotFound => target.clone(),
            Err(e) => return Err(e),
        };
        if real != target {
            tracing::info!(path = %target.display(), target = %real.display(), "the config is a symlink: writing the file it points to");
        }
        write_atomically(&real, &bytes)
    })
    .await;
    let source = match result {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(e)) => e,
        Err(join) => io::Error::other(join.to_string()),
    };
    Err(ProxyError::ConfigWrite {
        path: path.to_owned(),
        source,
    })
}

/// Replaces `path` with `contents` atomically: write a temp file in the same directory (so the
/// rename cannot cross filesystems), fsync it, rename it over `path`, fsync the directory.
/// On failure the temp file is removed and `path` is untouched. The new file keeps the old
/// file's permissions.
pub fn write_atomically(path: &Path, contents: &[u8]) -> io::Result<()> {
    replace(path, contents, true, 0o666)
}

/// Replaces `path` with `contents` as [`write_atomically`] does (readers see the old file or
/// the new one), without forcing either to disk: for small files that only mean something
/// while this boot lasts (a heartbeat, a readiness marker), rewritten often, where two
/// `fsync`s per write would cost more than a crash could lose.
pub fn replace_atomically(path: &Path, contents: &[u8]) -> io::Result<()> {
    replace(path, contents, false, 0o666)
}

/// [`replace_atomically`] for a file only the agent's user may read: created mode 0600 (an
/// existing file keeps its mode).
pub fn replace_privately(path: &Path, contents: &[u8]) -> io::Result<()> {
    replace(path, contents, false, 0o600)
}

fn replace(path: &Path, contents: &[u8], durable: bool, mode: u32) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "the path names no file"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = write_then_rename(&tmp, path, &dir, contents, durable, mode);
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn write_then_rename(
    tmp: &Path,
    path: &Path,
    dir: &Path,
    contents: &[u8],
    durable: bool,
    mode: u32,
) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(tmp)?;
    if let Ok(meta) = fs::metadata(path) {
        file.set_permissions(meta.permissions())?;
    }
    file.write_all(contents)?;
    if durable {
        file.sync_all()?;
        drop(file);
        fs::rename(tmp, path)?;
        return File::open(dir)?.sync_all();
    }
    drop(file);
    if exchange(tmp, path)? {
        // `tmp` now holds the old contents, which nobody reads.
        let _ = fs::remove_file(tmp);
        return Ok(());
    }
    fs::rename(tmp, path)
}

/// Swaps `tmp` and an existing regular file `path` (`RENAME_EXCHANGE`): readers see the old
/// file or the new one, as with a rename. Said `false` when it did not happen (no such file,
/// not a regular file, a filesystem without exchange): the caller renames.
///
/// Why not a rename: ext4 (with its default `auto_da_alloc`) starts writing the new file's data
/// out when a rename replaces an existing file, in the renaming thread: ~0.6 ms on this
/// project's machines, three times per hot restart (the heartbeat), in the supervisor's actor,
/// where the fsync this function's callers chose to skip would have cost about as much. An
/// exchange replaces nothing, so nothing is flushed; the unused old file is then removed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exchange(tmp: &Path, path: &Path) -> io::Result<bool> {
    use nix::errno::Errno;
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_file() => {}
        _ => return Ok(false),
    }
    match renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RenameFlags::RENAME_EXCHANGE) {
        Ok(()) => Ok(true),
        // Gone since it was looked at, or a filesystem (or kernel) without exchange.
        Err(Errno::ENOENT | Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => Ok(false),
        Err(errno) => Err(errno.into()),
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn exchange(_tmp: &Path, _path: &Path) -> io::Result<bool> {
    Ok(false)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::candidate::validate_candidate;

    type Writer = fn(&Path, &[u8]) -> io::Result<()>;
    /// Both ways of replacing a file: durable (rename) and not (exchange, else rename).
    const WRITERS: [(&str, Writer); 2] = [
        ("write_atomically", write_atomically),
        ("replace_atomically", replace_atomically),
    ];

    #[test]
    fn only_a_regular_config_file_of_bounded_size_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bootstrap.yaml");
        fs::write(&path, "admin: {}\n").unwrap();
        assert_eq!(read_config(&path).unwrap(), b"admin: {}\n");
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Without a writer: an open that blocked would hang this test.
        let e = read_config(&fifo).unwrap_err().to_string();
        assert!(e.contains("a FIFO"), "{e}");
        let e = read_config(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("a device"), "{e}");
        let e = read_config(dir.path()).unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let big = dir.path().join("big.yaml");
        fs::File::create(&big)
            .unwrap()
            .set_len(MAX_CONFIG_SIZE + 1)
            .unwrap();
        let e = read_config(&big).unwrap_err().to_string();
        assert!(e.contains("larger than"), "{e}");
    }

    #[test]
    fn a_private_file_is_created_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("heartbeat.json");
        replace_privately(&path, b"{}").unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    /// An "envoy" that records the mode of the config it is asked to validate, and accepts it.
    fn mode_recording_envoy(dir: &Path) -> (PathBuf, PathBuf) {
        let seen = dir.join("seen-mode");
        let bin = dir.join("envoy");
        fs::write(
            &bin,
            format!(
                "#!/bin/sh\nwhile [ \"$1\" != -c ]; do shift; done\nstat -c %a \"$2\" > {}\n",
                seen.display()
            ),
        )
        .unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
        (bin, seen)
    }

    #[tokio::test]
    async fn a_config_behind_configmap_symlinks_is_written_through_them() {
        use std::os::unix::fs::symlink;
        // The kubelet's layout: bootstrap.yaml -> ..data/bootstrap.yaml, ..data -> ..v1.
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir(d.join("..v1")).unwrap();
        fs::write(d.join("..v1/bootstrap.yaml"), "one\n").unwrap();
        symlink("..v1", d.join("..data")).unwrap();
        symlink("..data/bootstrap.yaml", d.join("bootstrap.yaml")).unwrap();
        let path = d.join("bootstrap.yaml");

        replace_config(&path, b"two\n".to_vec()).await.unwrap();
        assert!(
            fs::symlink_metadata(&path)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert!(
            fs::symlink_metadata(d.join("..data"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(fs::read_to_string(&path).unwrap(), "two\n");
        // The next ConfigMap update still reaches the path.
        fs::create_dir(d.join("..v2")).unwrap();
        fs::write(d.join("..v2/bootstrap.yaml"), "three\n").unwrap();
        symlink("..v2", d.join("..data_tmp")).unwrap();
        fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "three\n");
    }

    #[tokio::test]
    async fn a_validation_candidate_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let (bin, seen) = mode_recording_envoy(dir.path());
        let config_path = dir.path().join("bootstrap.yaml");
        fs::write(&config_path, "admin: {}\n").unwrap();
        let config = crate::ProxyConfig::new(
            bin,
            config_path,
            crate::AdminAddress::FromFile(dir.path().join("admin")),
        );
        validate_candidate(&config, b"secret: yes\n").await.unwrap();
        assert_eq!(fs::read_to_string(&seen).unwrap().trim(), "600");
    }

    #[tokio::test]
    async fn a_config_that_moves_the_admin_port_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (bin, _) = mode_recording_envoy(dir.path());
        let config_path = dir.path().join("bootstrap.yaml");
        let config = crate::ProxyConfig::new(
            bin,
            config_path,
            crate::AdminAddress::Fixed(std::net::SocketAddr::from(([127, 0, 0, 1], 9901)).into()),
        );
        let at = |port: u16| {
            format!(
                "admin: {{address: {{socket_address: {{address: 0.0.0.0, port_value: {port}}}}}}}\n"
            )
        };
        validate_candidate(&config, at(9901).as_bytes())
            .await
            .unwrap();
        let refused = validate_candidate(&config, at(9902).as_bytes())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains("moves Envoy's admin address to 127.0.0.1:9902")
                && refused.contains("127.0.0.1:9901"),
            "{refused}"
        );
    }

    #[test]
    fn replaces_content_and_keeps_permissions() {
        for (name, write) in WRITERS {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("bootstrap.yaml");
            write(&path, b"first").unwrap();
            assert_eq!(fs::read_to_string(&path).unwrap(), "first", "{name}");
            fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
            for round in 0..3 {
                let text = format!("new {round}");
                write(&path, text.as_bytes()).unwrap();
                assert_eq!(fs::read_to_string(&path).unwrap(), text, "{name}");
            }
            assert_eq!(
                fs::metadata(&path).unwrap().permissions().mode() & 0o777,
                0o640,
                "{name}"
            );
            let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
            assert_eq!(left.len(), 1, "{name}: no temp file left behind: {left:?}");
        }
    }

    #[test]
    fn a_symlink_is_replaced_and_its_target_left_alone() {
        // As a rename does: the name becomes the new file; what the link named is untouched.
        for (name, write) in WRITERS {
            let dir = tempfile::tempdir().unwrap();
            let target = dir.path().join("elsewhere");
            fs::write(&target, "theirs").unwrap();
            let path = dir.path().join("marker");
            std::os::unix::fs::symlink(&target, &path).unwrap();
            write(&path, b"ours").unwrap();
            assert!(fs::symlink_metadata(&path).unwrap().is_file(), "{name}");
            assert_eq!(fs::read_to_string(&path).unwrap(), "ours", "{name}");
            assert_eq!(fs::read_to_string(&target).unwrap(), "theirs", "{name}");
            let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
            assert_eq!(left.len(), 2, "{name}: no temp file left behind: {left:?}");
        }
    }

    #[test]
    fn a_reader_never_sees_a_partial_file() {
        for (_, write) in WRITERS {
            a_reader_never_sees_a_partial_file_of(write);
        }
    }

    fn a_reader_never_sees_a_partial_file_of(write: Writer) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bootstrap.yaml");
        // Large, distinct contents: a torn write would show a length or a byte of the other.
        let a = vec![b'a'; 3 << 20];
        let b = vec![b'b'; 1 << 20];
        write(&path, &a).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (path, stop, a, b) = (path.clone(), stop.clone(), a.clone(), b.clone());
            std::thread::spawn(move || {
                let mut reads = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let seen = fs::read(&path).unwrap();
                    assert!(
                        seen == a || seen == b,
                        "partial read of {} bytes",
                        seen.len()
                    );
                    reads += 1;
                }
                reads
            })
        };
        for i in 0..100 {
            write(&path, if i % 2 == 0 { &b } else { &a }).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let reads = reader.join().unwrap();
        assert!(reads > 0);
    }

    #[test]
    fn a_failed_write_leaves_the_target_and_no_temp_file() {
        for (name, write) in WRITERS {
            let dir = tempfile::tempdir().unwrap();
            // Renaming a file over a non-empty directory fails (and a directory is never
            // exchanged): the "old" target must survive.
            let path = dir.path().join("bootstrap.yaml");
            fs::create_dir(&path).unwrap();
            fs::write(path.join("keep"), "old").unwrap();
            let err = write(&path, b"new").unwrap_err();
            assert!(err.kind() != io::ErrorKind::NotFound, "{name}: {err}");
            assert!(fs::symlink_metadata(&path).unwrap().is_dir(), "{name}");
            assert_eq!(fs::read_to_string(path.join("keep")).unwrap(), "old");
            let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
            assert_eq!(left.len(), 1, "{name}: temp file removed: {left:?}");
        }
    }

    #[test]
    fn a_missing_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope/bootstrap.yaml");
        assert!(write_atomically(&path, b"x").is_err());
    }
}

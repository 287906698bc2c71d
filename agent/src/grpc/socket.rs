//! The gRPC Unix socket, made so that nobody else can take it, hijack it or steal it.
//!
//! - **The directory**: created mode 0700 when missing. An existing one must be a real
//!   directory (not a symlink), owned by the agent's user, and writable by nobody else, or
//!   another user could replace the socket with one of their own.
//! - **The path**: an existing socket is unlinked only once a connect to it has failed (a
//!   stale one from a crash); a live agent answering there is left alone and reported: a second
//!   agent on the same path must not silently take the first one's socket over. Anything else
//!   at the path (a file, a symlink) is reported, never removed.
//! - **The socket**: bound under a umask of 0177, so it is 0600 from the first instant (a
//!   chmod after bind would leave a window, and follow symlinks).

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use nix::sys::stat::{Mode, umask};

use crate::trusted_dir::{self, Untrusted};

/// Why the socket could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SocketError {
    /// The directory cannot be trusted or made.
    #[error("socket directory {dir}: {why}")]
    Directory {
        /// The directory.
        dir: PathBuf,
        /// Why.
        why: Untrusted,
    },
    /// Another agent serves on the path.
    #[error("another agent is serving on {path}: stop it, or give this one another --grpc-address")]
    InUse {
        /// The socket.
        path: PathBuf,
    },
    /// Something else than a socket is at the path.
    #[error("{path} exists and is {what}, not a socket: remove it or pick another --grpc-address")]
    NotASocket {
        /// The path.
        path: PathBuf,
        /// What it is.
        what: &'static str,
    },
    /// Binding failed.
    #[error("binding {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Binds a Unix socket at `path` that only the agent's user can connect to.
pub fn bind_private(path: &Path) -> Result<std::os::unix::net::UnixListener, SocketError> {
    // One call at a time: the umask below is the process's, and a second call's directory or
    // socket made inside the first one's window would get it (seen with parallel tests: a
    // directory of 0600, a socket of 0755).
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    private_dir(&dir)?;
    clear_stale(path)?;
    let bind = |path: &Path| {
        // 0177: the socket is created 0600. Process-wide, but only for this one call, made
        // before Envoy or any other file-creating task starts.
        let old = umask(Mode::from_bits_truncate(0o177));
        let bound = std::os::unix::net::UnixListener::bind(path);
        umask(old);
        bound
    };
    let listener = bind(path).map_err(|source| SocketError::Bind {
        path: path.to_owned(),
        source,
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| SocketError::Bind {
            path: path.to_owned(),
            source,
        })?;
    Ok(listener)
}

fn private_dir(dir: &Path) -> Result<(), SocketError> {
    trusted_dir::ensure(dir, 0o700, None, false).map_err(|why| SocketError::Directory {
        dir: dir.to_owned(),
        why,
    })
}

fn clear_stale(path: &Path) -> Result<(), SocketError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(SocketError::Bind {
                path: path.to_owned(),
                source,
            });
        }
    };
    let kind = meta.file_type();
    if !kind.is_socket() {
        let what = if kind.is_symlink() {
            "a symlink"
        } else if kind.is_dir() {
            "a directory"
        } else {
            "a file"
        };
        return Err(SocketError::NotASocket {
            path: path.to_owned(),
            what,
        });
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(SocketError::InUse {
            path: path.to_owned(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            tracing::info!(path = %path.display(), "removing a stale socket (nothing answers on it)");
            std::fs::remove_file(path).map_err(|source| SocketError::Bind {
                path: path.to_owned(),
                source,
            })
        }
        Err(source) => Err(SocketError::Bind {
            path: path.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn a_new_directory_and_socket_are_private() {
        let top = tempfile::tempdir().unwrap();
        let path = top.path().join("made/grpc.sock");
        let _listener = bind_private(&path).unwrap();
        let dir = std::fs::metadata(top.path().join("made")).unwrap();
        assert_eq!(dir.permissions().mode() & 0o777, 0o700);
        let sock = std::fs::symlink_metadata(&path).unwrap();
        assert!(sock.file_type().is_socket());
        assert_eq!(sock.permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn a_live_socket_is_never_taken_over_and_a_stale_one_is() {
        let top = tempfile::tempdir().unwrap();
        let path = top.path().join("grpc.sock");
        let first = bind_private(&path).unwrap();
        let err = bind_private(&path).unwrap_err();
        assert!(matches!(err, SocketError::InUse { .. }), "{err}");
        assert!(
            err.to_string().contains("another agent is serving on"),
            "{err}"
        );
        // The first one's socket still works.
        drop(std::os::unix::net::UnixStream::connect(&path).unwrap());
        drop(first);
        // Now nothing answers there: stale, replaced.
        bind_private(&path).unwrap();
    }

    #[test]
    fn untrusted_directories_and_paths_are_refused() {
        let top = tempfile::tempdir().unwrap();
        let open = top.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = bind_private(&open.join("grpc.sock")).unwrap_err();
        assert!(
            matches!(
                err,
                SocketError::Directory {
                    why: Untrusted::Writable { mode: 0o777 },
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("writable by others"), "{err}");

        let link = top.path().join("link");
        std::os::unix::fs::symlink(top.path(), &link).unwrap();
        let err = bind_private(&link.join("grpc.sock")).unwrap_err();
        assert!(
            matches!(
                err,
                SocketError::Directory {
                    why: Untrusted::Symlink,
                    ..
                }
            ),
            "{err}"
        );

        let file = top.path().join("grpc.sock");
        std::fs::write(&file, "not a socket").unwrap();
        let err = bind_private(&file).unwrap_err();
        assert!(matches!(err, SocketError::NotASocket { .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a socket");
    }
}

//! Directories the agent puts what others must not reach into (the gRPC socket's, the
//! hot-restart channel's, the state directory, a sidecar's admin socket's): a real directory,
//! not a symlink, owned by the agent's user (or Envoy's), writable by nobody else. Shared by the
//! servers (the gRPC socket) and the set-up (the node's directories), so neither reaches into
//! the other for it.

use std::path::Path;

/// Why a directory cannot be trusted (or made trustworthy). The words follow the directory's
/// path in the error that names it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Untrusted {
    /// It is missing and cannot be made.
    #[error("cannot create it: {error}")]
    Create {
        /// What the kernel said.
        error: std::io::Error,
    },
    /// It cannot be looked at.
    #[error("{error}")]
    Unreadable {
        /// What the kernel said.
        error: std::io::Error,
    },
    /// A symlink could lead anywhere.
    #[error("is a symlink (it could lead anywhere): use a real directory")]
    Symlink,
    /// Something else is at the path.
    #[error("is not a directory")]
    NotADirectory,
    /// Another user owns it.
    #[error(
        "is owned by uid {uid}, not by uid {expected}: only the user that runs the agent{} may own it",
        if *.envoys { " (Envoy's, --run-as-uid)" } else { "" }
    )]
    Owner {
        /// Its owner.
        uid: u32,
        /// Who must own it.
        expected: u32,
        /// Whether `expected` is Envoy's user (`--run-as-uid`) rather than the agent's.
        envoys: bool,
    },
    /// Others may write in a directory the operator provides.
    #[error("is writable by others (mode {mode:o}): make it 0700")]
    Writable {
        /// Its permission bits.
        mode: u32,
    },
    /// Others could write in a directory of the agent's before it was made private.
    #[error(
        "is writable by others (mode {mode:o}): anything in it may be planted; make it 0700 \
         (or remove it: the agent creates it)"
    )]
    Planted {
        /// Its permission bits.
        mode: u32,
    },
    /// It cannot be given to its owner.
    #[error("cannot give it to uid {uid}: {error}")]
    Chown {
        /// Who must own it.
        uid: u32,
        /// What the kernel said.
        error: nix::Error,
    },
    /// Its mode cannot be set.
    #[error("cannot make it {mode:o}: {error}")]
    Chmod {
        /// The mode it needs.
        mode: u32,
        /// What the kernel said.
        error: std::io::Error,
    },
}

/// Makes sure `dir` can be trusted: a real directory (not a symlink), owned by the agent's user
/// (or by `owner`, Envoy's), writable by nobody else. A missing one is made with `mode`; an
/// existing one of ours, when `ours`, is set to `mode` (a kubelet's hostPath is created 0755)
/// and given to `owner` (when the agent is root).
pub(crate) fn ensure(
    dir: &Path,
    mode: u32,
    owner: Option<u32>,
    ours: bool,
) -> Result<(), Untrusted> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let me = nix::unistd::geteuid().as_raw();
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(mode)
                .create(dir)
                .map_err(|error| Untrusted::Create { error })?;
            std::fs::symlink_metadata(dir).map_err(|error| Untrusted::Unreadable { error })?
        }
        Err(error) => return Err(Untrusted::Unreadable { error }),
    };
    if meta.file_type().is_symlink() {
        return Err(Untrusted::Symlink);
    }
    if !meta.is_dir() {
        return Err(Untrusted::NotADirectory);
    }
    let expected = owner.unwrap_or(me);
    let owned_by = |uid: u32| Untrusted::Owner {
        uid,
        expected,
        envoys: owner.is_some(),
    };
    let bits = meta.mode() & 0o7777;
    if !ours {
        if meta.uid() != expected {
            return Err(owned_by(meta.uid()));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(Untrusted::Writable { mode: bits });
        }
        return Ok(());
    }
    // Ours: made private, unless others could write it already (and plant what they like).
    if meta.mode() & 0o022 != 0 {
        return Err(Untrusted::Planted { mode: bits });
    }
    if meta.uid() != expected {
        if me != 0 {
            return Err(owned_by(meta.uid()));
        }
        nix::unistd::chown(dir, Some(nix::unistd::Uid::from_raw(expected)), None).map_err(
            |error| Untrusted::Chown {
                uid: expected,
                error,
            },
        )?;
    }
    if bits != mode {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
            .map_err(|error| Untrusted::Chmod { mode, error })?;
    }
    Ok(())
}

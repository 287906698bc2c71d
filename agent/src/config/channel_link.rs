//! The short name of a node proxy's private hot-restart channel.
//!
//! Envoy binds its hot-restart sockets at `<--socket-path>_parent_<n>`, `_child_<n>`,
//! `_udp_parent_<n>`... and a Unix socket address holds at most 107 bytes, so
//! `<state dir>/hot-restart/envoy` does not fit under a deep state dir (a kubelet volume's path
//! is ~140 bytes). And a child must use its parent's `--socket-path` string, which a successor
//! pod reads from its predecessor's `/server_info`: a path under the predecessor's mount of the
//! state dir means nothing when the successor's is mounted elsewhere.
//!
//! So the channel is always reached through a short name that depends only on what the pods
//! of a node share (the agent's uid, `--base-id`) and on the temp dir (`/tmp`, the same path in
//! every pod of a DaemonSet): `<temp dir>/envoy-agent-hr-<uid>/<base id>`, a symlink to
//! `<state dir>/hot-restart`, made by each agent at start. Envoy's `--socket-path` is
//! `<that>/envoy`; the kernel follows the symlink when Envoy binds or sends, so the sockets
//! live in the state dir's 0700 directory, as private as before. Each pod's link points at its
//! own mount of the same directory, so the predecessor's reported path works in the successor.
//!
//! Always, not only when the direct path is too long: a successor reaches its predecessor's
//! channel only if the predecessor used a name that means the same in both pods.
//!
//! The link's directory is the agent's (0700, or 0711 when Envoy runs as another user, who must
//! traverse it), so nobody else can plant or replace the name: a world-writable `/tmp` with its
//! sticky bit would let another user pre-create it. Whatever is found at the name is judged by
//! [`decide`]: only a symlink of the agent's own user is ever replaced. The link is never
//! removed: another agent of the family in the same temp dir (a successor, or a stand-in for a
//! dead parent) may be binding through it, and a stale one is harmless (a name of the agent's
//! own, pointing at a directory of its own) and re-pointed by the next agent.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The directory of the links, under the temp dir: one per uid.
pub fn link_dir(temp_dir: &Path, uid: u32) -> PathBuf {
    temp_dir.join(format!("envoy-agent-hr-{uid}"))
}

/// The link of the family on `base_id`, in [`link_dir`].
pub fn link_path(link_dir: &Path, base_id: u32) -> PathBuf {
    link_dir.join(base_id.to_string())
}

/// What is found at the link's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Nothing.
    Nothing,
    /// A symlink of `owner`'s; `ours_target`: it leads to the channel's directory (the same
    /// inode, whatever path it takes).
    Symlink {
        /// The symlink's owner.
        owner: u32,
        /// It resolves to the channel's directory.
        ours_target: bool,
    },
    /// Something else (a directory, a file...).
    Other(&'static str),
}

/// What to do with the link's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Make the link.
    Create,
    /// It already leads to the channel's directory (another agent of the family made it):
    /// leave it, so as not to race that agent.
    Keep,
    /// Our own link leads elsewhere (a state dir since moved or gone): point it at ours.
    Repoint,
    /// Refuse to start.
    Refuse(Refusal),
}

/// Why the link's name cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A symlink someone else made: it could lead anywhere they like.
    #[error(
        "is a symlink of uid {owner}, not of uid {me} (the agent's): it was not made by the \
         agent and is not followed; remove it"
    )]
    ForeignSymlink {
        /// Its owner.
        owner: u32,
        /// The agent's uid.
        me: u32,
    },
    /// Not a symlink.
    #[error("is {0}, not a symlink the agent made: remove it")]
    NotASymlink(&'static str),
}

/// What to do about what was found at the link's name, for an agent of uid `me`.
pub fn decide(found: Found, me: u32) -> Action {
    match found {
        Found::Nothing => Action::Create,
        Found::Symlink { owner, .. } if owner != me => {
            Action::Refuse(Refusal::ForeignSymlink { owner, me })
        }
        Found::Symlink {
            ours_target: true, ..
        } => Action::Keep,
        Found::Symlink {
            ours_target: false, ..
        } => Action::Repoint,
        Found::Other(what) => Action::Refuse(Refusal::NotASymlink(what)),
    }
}

/// Why the link could not be made.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Found something that must not be touched.
    #[error("hot-restart channel link {link}: {refusal}")]
    Refused {
        /// The link's path.
        link: PathBuf,
        /// Why.
        refusal: Refusal,
    },
    /// A filesystem call failed.
    #[error("hot-restart channel link {link}: {what}: {source}")]
    Io {
        /// The link's path.
        link: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

/// Makes `link` (in a directory already made private) a symlink to `target` (the channel's
/// directory, absolute), as [`decide`] says.
pub fn ensure(link: &Path, target: &Path) -> Result<(), LinkError> {
    let io = |what: &'static str| {
        move |source| LinkError::Io {
            link: link.to_owned(),
            what,
            source,
        }
    };
    let me = nix::unistd::geteuid().as_raw();
    let target_meta = std::fs::metadata(target).map_err(io("reading the channel directory"))?;
    // Twice at most: another agent of the family may make the link between our look and ours.
    for _ in 0..2 {
        let found = match std::fs::symlink_metadata(link) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Found::Nothing,
            Err(e) => return Err(io("looking at it")(e)),
            Ok(meta) if meta.file_type().is_symlink() => Found::Symlink {
                owner: meta.uid(),
                // A dangling link leads nowhere: not ours.
                ours_target: std::fs::metadata(link)
                    .is_ok_and(|m| (m.dev(), m.ino()) == (target_meta.dev(), target_meta.ino())),
            },
            Ok(meta) if meta.is_dir() => Found::Other("a directory"),
            Ok(_) => Found::Other("not a symlink"),
        };
        match decide(found, me) {
            Action::Keep => return Ok(()),
            Action::Refuse(refusal) => {
                return Err(LinkError::Refused {
                    link: link.to_owned(),
                    refusal,
                });
            }
            Action::Create => match std::os::unix::fs::symlink(target, link) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io("creating it")(e)),
            },
            Action::Repoint => {
                // A new link beside it, renamed over it: the name never leads nowhere.
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos();
                let mut name = link.as_os_str().to_owned();
                name.push(format!(".{}.{nanos:x}", std::process::id()));
                let fresh = PathBuf::from(name);
                std::os::unix::fs::symlink(target, &fresh).map_err(io("creating it"))?;
                if let Err(e) = std::fs::rename(&fresh, link) {
                    let _ = std::fs::remove_file(&fresh);
                    return Err(io("re-pointing it")(e));
                }
                return Ok(());
            }
        }
    }
    Err(LinkError::Io {
        link: link.to_owned(),
        what: "creating it",
        source: std::io::ErrorKind::AlreadyExists.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_name_depends_only_on_the_temp_dir_the_uid_and_the_base_id() {
        let dir = link_dir(Path::new("/tmp"), 101);
        assert_eq!(dir, Path::new("/tmp/envoy-agent-hr-101"));
        assert_eq!(
            link_path(&dir, 4_294_967_295),
            Path::new("/tmp/envoy-agent-hr-101/4294967295")
        );
    }

    #[test]
    fn only_a_symlink_of_our_own_is_kept_or_repointed() {
        let me = 101;
        assert_eq!(decide(Found::Nothing, me), Action::Create);
        assert_eq!(
            decide(
                Found::Symlink {
                    owner: me,
                    ours_target: true
                },
                me
            ),
            Action::Keep
        );
        assert_eq!(
            decide(
                Found::Symlink {
                    owner: me,
                    ours_target: false
                },
                me
            ),
            Action::Repoint
        );
        // Someone else's is never followed, not even when it leads to our directory.
        for ours_target in [true, false] {
            assert_eq!(
                decide(
                    Found::Symlink {
                        owner: 65534,
                        ours_target
                    },
                    me
                ),
                Action::Refuse(Refusal::ForeignSymlink { owner: 65534, me })
            );
        }
        assert_eq!(
            decide(Found::Other("a directory"), me),
            Action::Refuse(Refusal::NotASymlink("a directory"))
        );
    }

    #[test]
    fn ensure_creates_keeps_and_repoints() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let link = dir.path().join("7");
        ensure(&link, &a).unwrap();
        assert_eq!(std::fs::read_link(&link).unwrap(), a);
        // Another path to the same directory: kept as it is.
        let alias = dir.path().join("alias");
        std::os::unix::fs::symlink(&a, &alias).unwrap();
        ensure(&link, &alias).unwrap();
        assert_eq!(std::fs::read_link(&link).unwrap(), a);
        // Another directory: re-pointed, nothing left beside it.
        ensure(&link, &b).unwrap();
        assert_eq!(std::fs::read_link(&link).unwrap(), b);
        // Dangling: re-pointed.
        std::fs::remove_dir(&b).unwrap();
        ensure(&link, &a).unwrap();
        assert_eq!(std::fs::read_link(&link).unwrap(), a);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
        // A directory at the name is refused.
        let taken = dir.path().join("8");
        std::fs::create_dir(&taken).unwrap();
        assert!(matches!(
            ensure(&taken, &a),
            Err(LinkError::Refused {
                refusal: Refusal::NotASymlink(_),
                ..
            })
        ));
        // Another user's symlink, even one leading to our directory, is refused (only root
        // can give a symlink away).
        if nix::unistd::geteuid().is_root() {
            let planted = dir.path().join("9");
            std::os::unix::fs::symlink(&a, &planted).unwrap();
            std::os::unix::fs::lchown(&planted, Some(65534), Some(65534)).unwrap();
            assert!(matches!(
                ensure(&planted, &a),
                Err(LinkError::Refused {
                    refusal: Refusal::ForeignSymlink { owner: 65534, .. },
                    ..
                })
            ));
        }
    }
}

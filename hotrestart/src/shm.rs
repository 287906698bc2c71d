//! Envoy's hot-restart shared memory, as far as a supervisor needs it: whether a next epoch
//! can attach, and the INITIALIZING flag.
//!
//! `/dev/shm/envoy_shared_memory_<base_id*10>` holds Envoy's `SharedMemory` struct:
//!
//! ```text
//! u64 size_              sizeof(SharedMemory): 104 on x86-64, 120 on arm64 (glibc)
//! u64 version_           HOT_RESTART_VERSION: 11
//! pthread_mutex_t log_lock_, access_log_lock_     40 bytes each on x86-64, 48 on arm64
//! atomic<u64> flags_     bit 0: INITIALIZING
//! ```
//!
//! hence `--hot-restart-version` `11.104` (or `11.120`). The layout is found from the segment's
//! own header, not assumed: the flags word is the last eight bytes of a segment whose size
//! field equals its file length, whose version is one this module knows, and which matches the
//! running Envoy's `--hot-restart-version`. Anything else is refused, never written.
//!
//! Every Envoy sets the INITIALIZING bit while it initializes and clears it once its workers
//! start; one that dies in between leaves it set and every later hot restart fails with
//! "previous envoy process is still initializing" until a cold start (Envoy #33446). When the
//! supervisor knows that no Envoy of the family is initializing (its starting child has
//! exited), a set bit is stale, and clearing it is the least disruptive recovery: the serving
//! epoch keeps serving and the next hot restart works.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The `version_` field this module understands.
const KNOWN_VERSION: u64 = 11;
/// The INITIALIZING bit.
const INITIALIZING: u64 = 1;
/// Size, version, two mutexes of at least 24 bytes (the smallest `pthread_mutex_t` of a
/// 64-bit glibc target), flags.
const MIN_SIZE: u64 = 8 + 8 + 2 * 24 + 8;
/// Larger than any known layout by far: a segment claiming more is not Envoy's.
const MAX_SIZE: u64 = 4096;

/// The shared memory file of `base_id`.
pub fn path(base_id: u32) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/envoy_shared_memory_{}",
        u64::from(base_id) * 10
    ))
}

/// Why the segment could not be read or repaired.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// The file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The segment.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A next epoch could not attach to the segment (what [`usable`] finds).
    #[error("{path}: a next epoch could not attach to it ({why})")]
    Unusable {
        /// The segment.
        path: PathBuf,
        /// What did not match.
        why: String,
    },
    /// The header does not describe a layout this module knows; nothing was written.
    #[error("{path}: not a segment this supervisor can repair ({why}); left untouched")]
    Unrecognized {
        /// The segment.
        path: PathBuf,
        /// What did not match.
        why: LayoutError,
    },
}

/// Where the flags word is, after checking the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// `size_`, the file's length.
    pub size: u64,
    /// Offset of the flags word.
    pub flags_offset: u64,
}

/// Why a segment's header describes no layout this module knows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Another revision of Envoy's shared memory format.
    #[error("version field {0}, this supervisor knows {KNOWN_VERSION}")]
    Version(u64),
    /// The size field and the file's length differ.
    #[error("size field {size} but the file has {len} bytes")]
    Size {
        /// The size field.
        size: u64,
        /// The file's length.
        len: u64,
    },
    /// A size no Envoy writes.
    #[error("implausible size {0}")]
    Implausible(u64),
    /// Written by an Envoy of another hot-restart version than the running one.
    #[error("the segment says {segment}, the running envoy {running}")]
    OtherVersion {
        /// `<version>.<size>`, as the header says.
        segment: String,
        /// The running Envoy's.
        running: String,
    },
}

/// Checks a segment's header: `header` is its first 16 bytes, `len` its file length,
/// `hot_restart_version` the running Envoy's (e.g. `11.104`).
pub fn layout(
    header: [u8; 16],
    len: u64,
    hot_restart_version: &str,
) -> Result<Layout, LayoutError> {
    let mut word = [0u8; 8];
    word.copy_from_slice(&header[..8]);
    let size = u64::from_ne_bytes(word);
    word.copy_from_slice(&header[8..]);
    let version = u64::from_ne_bytes(word);
    if version != KNOWN_VERSION {
        return Err(LayoutError::Version(version));
    }
    if size != len {
        return Err(LayoutError::Size { size, len });
    }
    if !(MIN_SIZE..=MAX_SIZE).contains(&size) || size % 8 != 0 {
        return Err(LayoutError::Implausible(size));
    }
    let expected = format!("{version}.{size}");
    if hot_restart_version != expected {
        return Err(LayoutError::OtherVersion {
            segment: expected,
            running: hot_restart_version.to_owned(),
        });
    }
    Ok(Layout {
        size,
        flags_offset: size - 8,
    })
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ShmError + '_ {
    move |source| ShmError::Io {
        path: path.to_owned(),
        source,
    }
}

fn open_checked(
    path: &Path,
    hot_restart_version: &str,
    write: bool,
) -> Result<(std::fs::File, Layout), ShmError> {
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)
        .map_err(io(path))?;
    let len = file.metadata().map_err(io(path))?.len();
    let mut header = [0u8; 16];
    file.read_exact_at(&mut header, 0).map_err(io(path))?;
    let layout =
        layout(header, len, hot_restart_version).map_err(|why| ShmError::Unrecognized {
            path: path.to_owned(),
            why,
        })?;
    Ok((file, layout))
}

/// Whether a next epoch of `hot_restart_version` can attach to `segment`: it exists, and its
/// header names that version and the file's own size. Envoy's child aborts on anything else
/// ("Hot restart version mismatch"); the family can then only go on as a new family (a cold
/// handover). Unlike the repair, any format revision is accepted here: this only reads.
pub fn usable(segment: &Path, hot_restart_version: &str) -> Result<(), ShmError> {
    let file = std::fs::File::open(segment).map_err(io(segment))?;
    let len = file.metadata().map_err(io(segment))?.len();
    let mut header = [0u8; 16];
    file.read_exact_at(&mut header, 0).map_err(io(segment))?;
    let word = |range: std::ops::Range<usize>| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&header[range]);
        u64::from_ne_bytes(w)
    };
    let (size, version) = (word(0..8), word(8..16));
    let found = format!("{version}.{size}");
    if size != len || found != hot_restart_version {
        return Err(ShmError::Unusable {
            path: segment.to_owned(),
            why: format!(
                "its header says {found} for a file of {len} bytes, the running envoy \
                 {hot_restart_version}"
            ),
        });
    }
    Ok(())
}

/// Whether the INITIALIZING flag of `segment` is set.
pub fn initializing_at(segment: &Path, hot_restart_version: &str) -> Result<bool, ShmError> {
    let (file, layout) = open_checked(segment, hot_restart_version, false)?;
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, layout.flags_offset)
        .map_err(io(segment))?;
    Ok(u64::from_ne_bytes(word) & INITIALIZING != 0)
}

/// Clears a stale INITIALIZING flag of `segment`. Only call when no Envoy of the family is
/// initializing. Returns whether it was set.
pub fn clear_initializing_at(segment: &Path, hot_restart_version: &str) -> Result<bool, ShmError> {
    let (file, layout) = open_checked(segment, hot_restart_version, true)?;
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, layout.flags_offset)
        .map_err(io(segment))?;
    let flags = u64::from_ne_bytes(word);
    if flags & INITIALIZING == 0 {
        return Ok(false);
    }
    file.write_all_at(&(flags & !INITIALIZING).to_ne_bytes(), layout.flags_offset)
        .map_err(io(segment))?;
    Ok(true)
}

/// Removes the shared memory file (after the last Envoy of the family exited), so that a
/// stale segment cannot confuse a later cold start with another layout.
pub fn remove(base_id: u32) {
    let _ = std::fs::remove_file(path(base_id));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A segment as Envoy lays it out with mutexes of `mutex` bytes.
    fn segment(mutex: u64, flags: u64) -> Vec<u8> {
        let size = 8 + 8 + 2 * mutex + 8;
        let mut bytes = Vec::new();
        bytes.extend(size.to_ne_bytes());
        bytes.extend(11u64.to_ne_bytes());
        bytes.resize((size - 8) as usize, 0x90);
        bytes.extend(flags.to_ne_bytes());
        bytes
    }

    fn header(bytes: &[u8]) -> [u8; 16] {
        bytes[..16].try_into().unwrap()
    }

    #[test]
    fn x86_64_and_arm64_layouts_are_found_from_the_header() {
        let x86 = segment(40, 1);
        assert_eq!(
            layout(header(&x86), 104, "11.104"),
            Ok(Layout {
                size: 104,
                flags_offset: 96
            })
        );
        let arm = segment(48, 1);
        assert_eq!(
            layout(header(&arm), 120, "11.120"),
            Ok(Layout {
                size: 120,
                flags_offset: 112
            })
        );
    }

    #[test]
    fn unknown_segments_are_refused() {
        let x86 = segment(40, 1);
        // Another running version, a truncated file, another format revision.
        assert!(layout(header(&x86), 104, "11.120").is_err());
        assert!(layout(header(&x86), 64, "11.104").is_err());
        let mut other = x86.clone();
        other[8] = 12;
        let err = layout(header(&other), 104, "12.104").unwrap_err();
        assert!(err.to_string().contains("version field 12"), "{err}");
        let mut huge = x86.clone();
        huge[..8].copy_from_slice(&(1u64 << 40).to_ne_bytes());
        assert!(layout(header(&huge), 1 << 40, "11.1099511627776").is_err());
    }

    #[test]
    fn clears_the_flag_in_place_on_both_layouts_and_nothing_else() {
        for mutex in [40u64, 48] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("segment");
            let bytes = segment(mutex, 0b101);
            std::fs::write(&path, &bytes).unwrap();
            let version = format!("11.{}", bytes.len());
            assert!(initializing_at(&path, &version).unwrap());
            assert!(clear_initializing_at(&path, &version).unwrap());
            assert!(!initializing_at(&path, &version).unwrap());
            let after = std::fs::read(&path).unwrap();
            let mut expected = segment(mutex, 0b100);
            expected.truncate(after.len());
            assert_eq!(after, expected, "only bit 0 of the flags word changed");
            assert!(
                !clear_initializing_at(&path, &version).unwrap(),
                "already clear"
            );
        }
    }

    #[test]
    fn a_segment_is_usable_only_with_the_running_version_and_its_own_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("segment");
        assert!(usable(&path, "11.104").is_err(), "missing");
        let bytes = segment(40, 0);
        std::fs::write(&path, &bytes).unwrap();
        usable(&path, "11.104").unwrap();
        assert!(usable(&path, "11.120").is_err(), "another running version");
        let mut corrupt = bytes.clone();
        corrupt[8..16].copy_from_slice(&0xdead_beefu64.to_ne_bytes());
        std::fs::write(&path, &corrupt).unwrap();
        let err = usable(&path, "11.104").unwrap_err().to_string();
        assert!(err.contains("3735928559.104"), "{err}");
        std::fs::write(&path, &bytes[..64]).unwrap();
        assert!(usable(&path, "11.104").is_err(), "truncated");
    }

    #[test]
    fn an_unrecognized_segment_is_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("segment");
        let mut bytes = segment(40, 1);
        bytes[8] = 10;
        std::fs::write(&path, &bytes).unwrap();
        let err = clear_initializing_at(&path, "11.104").unwrap_err();
        assert!(matches!(err, ShmError::Unrecognized { .. }), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }
}

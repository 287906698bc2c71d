//! Envoy's hot-restart shared memory, as far as a supervisor needs it: the INITIALIZING flag.
//!
//! Layout of `/dev/shm/envoy_shared_memory_<base_id*10>` (hot-restart version 11, 104 bytes,
//! hence `11.104`): size (u64), version (u64), two `pthread_mutex_t` (40 bytes each), then the
//! flags word (u64 at offset 96) whose bit 0 is INITIALIZING. Every Envoy sets the bit while it
//! initializes and clears it once its workers start; one that dies in between leaves it set and
//! every later hot restart fails with "previous envoy process is still initializing" until a
//! cold start (Envoy #33446). When the supervisor knows that no Envoy of the family is
//! initializing (its starting child has exited), a set bit is stale, and clearing it is the
//! least disruptive recovery: the serving epoch keeps serving and the next hot restart works.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Offset of the flags word.
const FLAGS_OFFSET: u64 = 96;
/// The INITIALIZING bit.
const INITIALIZING: u64 = 1;
/// The size this layout describes (the part after the dot of `--hot-restart-version`).
const LAYOUT_SIZE: u64 = 104;

/// The shared memory file of `base_id`.
pub fn path(base_id: u32) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/envoy_shared_memory_{}",
        u64::from(base_id) * 10
    ))
}

/// Whether the file has the layout this module knows.
fn known_layout(hot_restart_version: &str) -> bool {
    hot_restart_version == format!("11.{LAYOUT_SIZE}")
}

/// Whether the INITIALIZING flag is set. `None` when the file or its layout is unknown.
pub fn initializing(base_id: u32, hot_restart_version: &str) -> Option<bool> {
    if !known_layout(hot_restart_version) {
        return None;
    }
    let file = std::fs::File::open(path(base_id)).ok()?;
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, FLAGS_OFFSET).ok()?;
    Some(u64::from_ne_bytes(word) & INITIALIZING != 0)
}

/// Clears a stale INITIALIZING flag. Only call when no Envoy of the family is initializing.
pub fn clear_initializing(base_id: u32, hot_restart_version: &str) -> std::io::Result<()> {
    if !known_layout(hot_restart_version) {
        return Err(std::io::Error::other(format!(
            "unknown shared memory layout for hot-restart version {hot_restart_version}"
        )));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path(base_id))?;
    let mut word = [0u8; 8];
    file.read_exact_at(&mut word, FLAGS_OFFSET)?;
    let flags = u64::from_ne_bytes(word) & !INITIALIZING;
    file.write_all_at(&flags.to_ne_bytes(), FLAGS_OFFSET)
}

/// Removes the shared memory file (after the last Envoy of the family exited), so that a
/// stale segment cannot confuse a later cold start with another layout.
pub fn remove(base_id: u32) {
    let _ = std::fs::remove_file(path(base_id));
}

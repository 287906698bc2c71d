//! The workspace's only `unsafe` code: what must run in the forked child before `exec`, and
//! one piece of advice to the kernel about the agent's own code pages.
//!
//! `unsafe_code` is denied everywhere else (`[workspace.lints]`); this module allows it for two
//! calls: `pre_exec`, whose closure runs between `fork` and `exec` and so may only do
//! async-signal-safe things (here a single `prctl`, no allocation, no locks), and `madvise`
//! with `MADV_RANDOM`, which changes how pages are read in, never their contents.
#![allow(unsafe_code)]

use std::os::unix::process::CommandExt as _;

use nix::sys::signal::Signal;

/// Makes the child get `signal` when the thread that forked it dies (`PR_SET_PDEATHSIG`).
///
/// Envoy sets this itself only when hot restart is on; with `--disable-hot-restart` it does
/// not (seen on 1.40), and an agent killed with SIGKILL would leave Envoy running, orphaned.
/// The forking thread is the spawner thread, which lives as long as the agent.
pub(crate) fn die_with_parent(command: &mut tokio::process::Command, signal: Signal) {
    let set = move || {
        nix::sys::prctl::set_pdeathsig(signal)
            .map_err(|errno| std::io::Error::from_raw_os_error(errno as i32))
    };
    // SAFETY: `set` calls only prctl(2), which is async-signal-safe, and captures a Copy value;
    // it allocates nothing and takes no lock, as required between fork and exec.
    unsafe {
        command.as_std_mut().pre_exec(set);
    }
}

/// Tells the kernel to map the agent's own code and read-only data page by page as it is used
/// (`MADV_RANDOM`), instead of 64 KiB around each page touched (fault-around, and readahead).
///
/// The binary's text is most of the agent's resident memory; a long-running supervisor uses a
/// small part of it (the steady-state loop, a handoff), scattered, so fault-around maps pages
/// it never runs. Best effort: a failure changes nothing but the footprint. Returns how many
/// bytes were advised.
pub fn map_own_code_on_demand() -> usize {
    use nix::sys::mman::{MmapAdvise, madvise};
    let Ok(exe) = std::fs::read_link("/proc/self/exe") else {
        return 0;
    };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return 0;
    };
    let mut advised = 0;
    for line in maps.lines() {
        // `start-end perms offset dev inode path`
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let path = fields.nth(3);
        // Only the executable's own file-backed mappings that are never written.
        if path != exe.to_str() || perms.contains('w') {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (
            usize::from_str_radix(start, 16),
            usize::from_str_radix(end, 16),
        ) else {
            continue;
        };
        let Some(addr) = std::ptr::NonNull::new(start as *mut std::ffi::c_void) else {
            continue;
        };
        // SAFETY: the range is one of this process's own mappings as the kernel lists it, and
        // MADV_RANDOM only changes how its pages are read in from the file: no page's contents,
        // protection or lifetime change, so no Rust reference into it can be invalidated.
        if unsafe { madvise(addr, end.saturating_sub(start), MmapAdvise::MADV_RANDOM) }.is_ok() {
            advised += end.saturating_sub(start);
        }
    }
    advised
}

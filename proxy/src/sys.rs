//! The workspace's only `unsafe` code: what must run in the forked child before `exec`.
//!
//! `unsafe_code` is denied everywhere else (`[workspace.lints]`); this module allows it for one
//! call, `pre_exec`, whose closure runs between `fork` and `exec` and so may only do
//! async-signal-safe things: here a single `prctl`, no allocation, no locks.
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

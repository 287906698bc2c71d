//! PID 1 duties: reaping zombies that are not ours to wait for.
//!
//! As a container's PID 1 (or a subreaper, see [`become_subreaper`]) the agent inherits every
//! orphan below it: a process Envoy forked and left, a hook's grandchild. Their zombies would
//! pile up, so [`reap_orphans`] waits for each zombie child that is *not* one the agent
//! spawned itself (those are reaped by their owners, which need the exit status). The check
//! and the `waitpid` happen under the lock the spawner holds while forking, so a child that
//! exits the instant it is born is never stolen from its owner.

use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// Makes this process the reaper of its orphaned descendants (`PR_SET_CHILD_SUBREAPER`), as a
/// PID 1 is. Harmless when already PID 1.
pub fn become_subreaper() -> nix::Result<()> {
    nix::sys::prctl::set_child_subreaper(true)
}

/// Reaps every zombie child of this process that the agent did not spawn itself. Returns what
/// was reaped, for logging.
pub fn reap_orphans() -> Vec<WaitStatus> {
    let owned = crate::spawner::owned();
    let mut reaped = Vec::new();
    for pid in zombie_children() {
        if owned.contains(&pid) {
            continue;
        }
        match waitpid(Pid::from_raw(pid as i32), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => {}
            Ok(status) => reaped.push(status),
        }
    }
    reaped
}

/// This process's children that are zombies, from `/proc`.
fn zombie_children() -> Vec<u32> {
    children(std::process::id())
        .into_iter()
        .filter(|pid| is_zombie(*pid))
        .collect()
}

/// The children of process `pid` (every thread's), from `/proc/<pid>/task/*/children`.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|s| s == "Z"))
        })
        .unwrap_or(false)
}

/// Reaps orphans whenever a child exits (SIGCHLD) until `cancel` fires. Run it as a task.
pub async fn run(cancel: tokio_util::sync::CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut sigchld = match signal(SignalKind::child()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGCHLD; orphans will not be reaped");
            return;
        }
    };
    loop {
        for status in reap_orphans() {
            tracing::debug!(?status, "reaped an orphan");
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = sigchld.recv() => {}
        }
    }
}

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

/// Whether this kernel lists a task's children (`/proc/<pid>/task/<tid>/children`, kernels
/// built with `CONFIG_PROC_CHILDREN`, as most are).
pub fn lists_children() -> bool {
    let pid = std::process::id();
    std::path::Path::new(&format!("/proc/{pid}/task/{pid}/children")).exists()
}

/// The children of process `pid` (every thread's), from `/proc/<pid>/task/*/children`, or,
/// on a kernel without those files, from every process's parent pid in `/proc/*/stat`.
pub fn children(pid: u32) -> Vec<u32> {
    if !lists_children() {
        return children_by_scan(pid);
    }
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

/// The processes whose parent is `pid`, by reading every `/proc/<n>/stat` (slower).
fn children_by_scan(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|stat| {
                    // The fields after the parenthesised command name: state, then ppid.
                    let rest = stat.rsplit_once(')')?.1;
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
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
    if !lists_children() {
        tracing::warn!(
            "this kernel does not list a process's children in /proc/<pid>/task/<tid>/children: \
             orphans are found by scanning /proc instead (slower on busy hosts)"
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scan_finds_the_same_children_as_the_kernel_list() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let me = std::process::id();
        let listed = children(me);
        let scanned = children_by_scan(me);
        let _ = child.kill();
        let _ = child.wait();
        assert!(listed.contains(&child.id()), "{listed:?}");
        assert!(scanned.contains(&child.id()), "{scanned:?}");
    }
}

//! The one thread that forks Envoy, and the registry of the children it forked.
//!
//! The agent sets `PR_SET_PDEATHSIG(SIGTERM)` for Envoy in every mode (an Envoy 1.40 started
//! with hot restart at epoch 0 was seen to outlive a SIGKILLed parent without it), and Linux
//! ties that to the *thread* that forked it, not the process: were
//! Envoy spawned from a tokio worker or a `spawn_blocking` thread, that thread retiring would
//! SIGTERM a healthy Envoy. So every spawn goes through this dedicated thread, started on
//! first use and alive until the process exits. If the agent itself dies, this thread dies
//! with it and Envoy gets its SIGTERM: no orphaned Envoys.
//!
//! The spawn happens inside the caller's tokio runtime context, so the returned
//! [`tokio::process::Child`] is reaped by that runtime and can be awaited as usual. Its pid is
//! recorded, under the same lock as the fork, in the set of children the agent reaps itself;
//! the [`crate::reaper`] reaps every other zombie and must never steal one of these.

use std::collections::BTreeSet;
use std::io;
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, OnceLock};

use tokio::process::{Child, Command};
use tokio::sync::oneshot;

struct SpawnRequest {
    command: Command,
    runtime: tokio::runtime::Handle,
    reply: oneshot::Sender<io::Result<Child>>,
}

static SPAWNER: OnceLock<Result<mpsc::Sender<SpawnRequest>, String>> = OnceLock::new();
static OWNED: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

/// The pids whose exit status belongs to their spawner, locked.
pub(crate) fn owned() -> MutexGuard<'static, BTreeSet<u32>> {
    OWNED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `pid` has been reaped by its owner.
pub(crate) fn release(pid: u32) {
    owned().remove(&pid);
}

fn spawner() -> io::Result<&'static mpsc::Sender<SpawnRequest>> {
    SPAWNER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<SpawnRequest>();
            std::thread::Builder::new()
                .name("envoy-spawner".to_owned())
                .spawn(move || {
                    // Ends only when the process does: the sender lives in a static.
                    while let Ok(request) = rx.recv() {
                        let _runtime = request.runtime.enter();
                        let mut command = request.command;
                        let mut owned = owned();
                        let spawned = command.spawn();
                        if let Some(pid) = spawned.as_ref().ok().and_then(Child::id) {
                            owned.insert(pid);
                        }
                        drop(owned);
                        let _ = request.reply.send(spawned);
                    }
                })
                .map(|_| tx)
                .map_err(|e| format!("cannot start the envoy-spawner thread: {e}"))
        })
        .as_ref()
        .map_err(|e| io::Error::other(e.clone()))
}

/// Spawns `command` from the long-lived spawner thread, in the current runtime's context. The
/// caller owns the child's exit status and must [`release`] the pid once it has reaped it.
pub(crate) async fn spawn(command: Command) -> io::Result<Child> {
    let (reply, answer) = oneshot::channel();
    spawner()?
        .send(SpawnRequest {
            command,
            runtime: tokio::runtime::Handle::current(),
            reply,
        })
        .map_err(|_| io::Error::other("the envoy-spawner thread is gone"))?;
    answer
        .await
        .map_err(|_| io::Error::other("the envoy-spawner thread dropped a request"))?
}

//! The one thread that forks Envoy.
//!
//! Envoy sets `PR_SET_PDEATHSIG(SIGTERM)` on itself, and Linux ties that to the *thread* that
//! forked it, not the process: were Envoy spawned from a tokio worker or a `spawn_blocking`
//! thread, that thread retiring would SIGTERM a healthy Envoy. So every spawn goes through this
//! dedicated thread, started on first use and alive until the process exits. If the agent
//! itself dies, this thread dies with it and Envoy gets its SIGTERM: no orphaned Envoys.
//!
//! The spawn happens inside the caller's tokio runtime context, so the returned
//! [`tokio::process::Child`] is reaped by that runtime and can be awaited as usual.

use std::io;
use std::sync::OnceLock;
use std::sync::mpsc;

use tokio::process::{Child, Command};
use tokio::sync::oneshot;

struct SpawnRequest {
    command: Command,
    runtime: tokio::runtime::Handle,
    reply: oneshot::Sender<io::Result<Child>>,
}

static SPAWNER: OnceLock<Result<mpsc::Sender<SpawnRequest>, String>> = OnceLock::new();

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
                        let _ = request.reply.send(command.spawn());
                    }
                })
                .map(|_| tx)
                .map_err(|e| format!("cannot start the envoy-spawner thread: {e}"))
        })
        .as_ref()
        .map_err(|e| io::Error::other(e.clone()))
}

/// Spawns `command` from the long-lived spawner thread, in the current runtime's context.
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

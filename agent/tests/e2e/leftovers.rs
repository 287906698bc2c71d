//! Leaves nothing behind, and says what happened (issue 51, items 1 and 2), end to end:
//!
//! - a node proxy stopped by SIGTERM removes its hot-restart channel's link
//!   (`<temp dir>/envoy-agent-hr-<uid>/<base id>`) and its family's shared memory
//!   (`/dev/shm/envoy_shared_memory_<base id × 10>`), and its runtime directory;
//! - a sidecar SIGKILLed cannot remove its runtime directory; the next agent on the same
//!   temporary directory removes it at its start, and never a live agent's;
//! - a first start that Envoy rejects (a `direct_response` status of 99) ends the same way in
//!   both modes (`start_failed`, exit 1), the termination message and the exit event give
//!   Envoy's reason, and a node proxy leaves neither link nor segment behind.

use std::path::PathBuf;

use nix::sys::signal::Signal;

use crate::exit_paths::{Mode, agent_in, both_modes};

/// What a node proxy of `base_id` could leave behind: the channel's link and the family's
/// shared memory.
fn leftovers(base_id: u32) -> Vec<PathBuf> {
    let uid = nix::unistd::geteuid().as_raw();
    [
        std::env::temp_dir()
            .join(format!("envoy-agent-hr-{uid}"))
            .join(base_id.to_string()),
        PathBuf::from(format!(
            "/dev/shm/envoy_shared_memory_{}",
            u64::from(base_id) * 10
        )),
    ]
    .into_iter()
    .filter(|p| std::fs::symlink_metadata(p).is_ok())
    .collect()
}

/// This agent's runtime directories (`<temp dir>/envoy-agent-<pid>.<start>`).
fn runtime_dirs(pid: u32) -> Vec<PathBuf> {
    runtime_dirs_in(&std::env::temp_dir(), pid)
}

/// ... under `temp_dir`.
fn runtime_dirs_in(temp_dir: &std::path::Path, pid: u32) -> Vec<PathBuf> {
    std::fs::read_dir(temp_dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("envoy-agent-{pid}.")))
        })
        .collect()
}

#[tokio::test]
async fn a_node_proxy_stopped_by_sigterm_leaves_nothing_behind() {
    let mut agent = agent_in(Mode::NodeProxy)
        .args(&["--termination-drain-duration", "1s"])
        .start()
        .await;
    let base_id = agent.ports.unwrap().base_id;
    let pid = agent.agent_pid();
    assert_eq!(
        leftovers(base_id).len(),
        2,
        "the link and the segment, while it runs"
    );
    assert!(!runtime_dirs(pid).is_empty());
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert_eq!(leftovers(base_id), Vec::<PathBuf>::new());
    assert_eq!(runtime_dirs(pid), Vec::<PathBuf>::new());
}

#[tokio::test]
async fn a_killed_agents_runtime_dir_is_removed_by_the_next_start_and_a_live_ones_is_kept() {
    // A temporary directory of this test's own: other tests' agents sweep the shared one.
    let tmp = envoy_agent_tests::TestDir::new();
    let tmp_arg = tmp.path().display().to_string();
    let in_tmp = || agent_in(Mode::Sidecar).env("TMPDIR", &tmp_arg);
    let mut live = in_tmp().start().await;
    let mut killed = in_tmp().start().await;
    let (live_pid, killed_pid) = (live.agent_pid(), killed.agent_pid());
    killed.signal_agent(Signal::SIGKILL);
    assert_eq!(killed.exit().await.code(), None, "killed");
    let left = runtime_dirs_in(tmp.path(), killed_pid);
    assert_eq!(
        left.len(),
        1,
        "a killed agent cannot remove its own: {left:?}"
    );

    let mut next = in_tmp().start().await;
    let removed = next
        .wait_event("runtime_dirs_removed", "level", "INFO")
        .await;
    assert_eq!(
        removed["removed"],
        format!("[{:?}]", left[0]),
        "the killed agent's, and no other: {removed}"
    );
    assert_eq!(
        runtime_dirs_in(tmp.path(), killed_pid),
        Vec::<PathBuf>::new()
    );
    assert_eq!(
        runtime_dirs_in(tmp.path(), live_pid).len(),
        1,
        "the live one's kept"
    );
    assert!(live.running());
    let next_pid = next.agent_pid();
    next.signal(Signal::SIGTERM);
    assert_eq!(next.exit().await.code(), Some(0));
    assert_eq!(runtime_dirs_in(tmp.path(), next_pid), Vec::<PathBuf>::new());
}

both_modes!(a_rejected_first_start_is_said_as_it_is_and_leaves_nothing_behind);

async fn a_rejected_first_start_is_said_as_it_is_and_leaves_nothing_behind(mode: Mode) {
    let builder = agent_in(mode);
    let message = builder.dir().join("termination-log");
    let message_arg = message.display().to_string();
    let bootstrap = r#"admin:
  address:
    socket_address: { address: 127.0.0.1, port_value: 0 }
static_resources:
  listeners:
  - name: bad
    address:
      socket_address: { address: 127.0.0.1, port_value: 0 }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bad
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                direct_response: { status: 99 }
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#;
    let mut agent = builder
        .bootstrap(bootstrap.to_owned())
        .args(&["--termination-message-path", &message_arg])
        // Envoy never gets as far as an admin address: nothing for the kit to find.
        .admin_at(envoy_agent_proxy::admin::Address::Tcp(
            "127.0.0.1:9".parse().unwrap(),
        ))
        .no_wait()
        .start()
        .await;
    let base_id = agent.ports.map(|p| p.base_id);
    assert_eq!(agent.exit().await.code(), Some(1), "{}", agent.stderr());
    let exit = agent.wait_event("exit", "exit_path", "start_failed").await;
    let said = exit["envoy_said"].as_str().unwrap_or_default();
    assert!(
        said.contains("Proto constraint validation failed")
            && said.contains("DirectResponseActionValidationError.Status"),
        "{exit}"
    );
    let message = std::fs::read_to_string(&message).unwrap();
    assert!(
        message.starts_with("envoy-agent exited 1: start_failed (envoy failed to start (exit 1))"),
        "{message}"
    );
    assert!(
        message.contains("envoy said: ")
            && message.contains("DirectResponseActionValidationError.Status"),
        "Envoy's reason:\n{message}"
    );
    assert!(!message.contains(": :"), "{message}");
    if let Some(base_id) = base_id {
        assert!(
            agent.events("handoff").iter().all(|e| e["message"]
                .as_str()
                .is_none_or(|m| !m.contains("keeps serving"))),
            "nothing served: not said to keep serving"
        );
        assert_eq!(leftovers(base_id), Vec::<PathBuf>::new());
    }
}

//! The private hot-restart channel under any state dir: a deep one (a kubelet volume's path is
//! ~140 bytes, past a Unix socket address's 107), and the same node directory mounted at
//! another path in the successor pod than in its predecessor.

use std::path::{Path, PathBuf};

use envoy_agent_proxy::{ServerState, SocketPath};
use envoy_agent_tests::{AgentProcess, Load, live_at};
use nix::sys::signal::Signal;

use crate::agent;
use crate::cross_pod::Node;
use crate::hot_restart::{FAST, listener, one_generation, restarts};

/// A directory path of exactly `len` bytes below `dir` (not made).
fn deep(dir: &Path, len: usize) -> PathBuf {
    let mut path = dir.to_path_buf();
    while path.as_os_str().len() + 11 < len {
        path.push("0123456789");
    }
    let pad = len - path.as_os_str().len() - 1;
    path.push("s".repeat(pad));
    assert_eq!(path.as_os_str().len(), len);
    path
}

/// The names Envoy bound in the state dir's channel directory.
fn bound_in(state: &Path) -> Vec<String> {
    std::fs::read_dir(state.join("hot-restart"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[tokio::test]
async fn a_node_proxy_on_a_150_byte_state_dir_serves_and_hot_restarts() {
    let builder = agent().hot_restart().args(FAST);
    let state = deep(builder.dir().path(), 150);
    let mut agent = builder
        .args(&["--state-dir", state.to_str().unwrap()])
        .start()
        .await;
    let load = Load::start(listener(&agent), "/", 4, 4);
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    one_generation(&agent).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(report.ok > 100, "{report:?}");
    assert_eq!(restarts(&agent, "live"), 1);
    // Envoy's sockets are in the state dir's private directory, reached by a short name.
    let info = agent.admin.server_info().await.unwrap();
    let SocketPath::File(prefix) = &info.socket_path else {
        panic!("a file channel: {:?}", info.socket_path);
    };
    assert!(!prefix.starts_with(&state), "{}", prefix.display());
    let names = bound_in(&state);
    assert!(
        names.iter().any(|n| n.starts_with("envoy_parent_")),
        "{names:?}"
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// A pod of `node` named `name` whose state dir is the node's, bind-mounted at `mounted` in
/// the pod's own mount namespace, and whose temp dir is a private one of its own mounted at
/// the node's `tmp` (the same path in every pod, as an emptyDir at /tmp in the DaemonSet).
async fn pod_at(node: &Node, name: &str, mounted: &Path) -> AgentProcess {
    let own_tmp = node.dir.join(&format!("{name}-tmp"));
    let tmp = node.dir.join("tmp");
    for dir in [&own_tmp, &tmp, &mounted.to_path_buf()] {
        std::fs::create_dir_all(dir).unwrap();
    }
    let script =
        "mount --bind \"$0\" \"$1\" && mount --bind \"$2\" \"$3\" && shift 3 && exec \"$@\"";
    let state = node.state_dir();
    let wrapper: Vec<&str> = envoy_agent_tests::POD
        .iter()
        .copied()
        .chain([
            "sh",
            "-c",
            script,
            state.to_str().unwrap(),
            mounted.to_str().unwrap(),
            own_tmp.to_str().unwrap(),
            tmp.to_str().unwrap(),
        ])
        .collect();
    agent()
        .hot_restart_on(node.ports)
        .bootstrap_path(node.dir.join("bootstrap.yaml"))
        .wrapper(&wrapper)
        .env("TMPDIR", tmp.to_str().unwrap())
        .admin_at(node.admin_socket())
        .args(&["--state-dir", mounted.to_str().unwrap()])
        .args(FAST)
        .args(&["--identity", name])
        .start()
        .await
}

#[tokio::test]
async fn a_successor_whose_state_dir_is_mounted_elsewhere_takes_over_its_predecessors_family() {
    let node = Node::new();
    // The old pod mounts the node's directory deep, the new one elsewhere.
    let mut a = pod_at(&node, "pod-a", &deep(&node.dir.join("pod-a"), 150)).await;
    live_at(&node.admin(), 0).await;
    let load = Load::start(node.listener(), "/", 4, 4);
    let mut b = pod_at(&node, "pod-b", &node.dir.join("pod-b").join("state")).await;
    live_at(&node.admin(), 1).await;
    b.wait_event("handoff", "outcome", "live").await;
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(report.ok > 100, "{report:?}");
    let info = node.admin().server_info().await.unwrap();
    assert_eq!((info.state, info.restart_epoch), (ServerState::Live, 1));
    // One name in both pods, leading in each to its own mount of the node's directory.
    let channel = |pod: &AgentProcess| {
        pod.events("hot_restart_channel")
            .first()
            .map(|e| e["socket_path"].clone())
    };
    assert_eq!(channel(&a), channel(&b));
    assert!(
        bound_in(&node.state_dir())
            .iter()
            .any(|n| n.starts_with("envoy_parent_"))
    );
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

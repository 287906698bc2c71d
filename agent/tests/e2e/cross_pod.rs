//! Cross-pod hot restart: each "pod" is an agent in a PID namespace of its own
//! (`unshare --pid --fork --mount-proc`), sharing the state dir, /dev/shm and the network with
//! the others, as the pods of a DaemonSet surge upgrade do on one node.

use std::path::{Path, PathBuf};
use std::time::Instant;

use envoy_agent_hotrestart::node::NodeState;
use envoy_agent_proxy::{AdminClient, ServerState};
use envoy_agent_tests::{
    AgentBuilder, AgentProcess, HotRestartPorts, Load, PATIENCE, TestDir, eventually,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::agent;
use envoy_agent_tests::live_at;

use envoy_agent_tests::POD;

/// One node: the shared state dir, bootstrap, ports and base id.
pub(crate) struct Node {
    pub(crate) dir: TestDir,
    pub(crate) ports: HotRestartPorts,
}

impl Drop for Node {
    fn drop(&mut self) {
        // ... and the one of a cold handover's family, under the next base id.
        for base_id in [self.ports.base_id, self.ports.base_id + 1] {
            let _ = std::fs::remove_file(format!(
                "/dev/shm/envoy_shared_memory_{}",
                u64::from(base_id) * 10
            ));
        }
    }
}

impl Node {
    pub(crate) fn new() -> Node {
        let ports = agent().hot_restart().ports().unwrap();
        let dir = TestDir::new();
        dir.write(
            "bootstrap.yaml",
            &envoy_agent_tests::bootstrap_yaml_on(ports.admin_port, ports.listener_port, "node"),
        );
        std::fs::create_dir_all(dir.join("state")).unwrap();
        Node { dir, ports }
    }

    pub(crate) fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// A pod of this node with no name of its own (no `--identity`, no `POD_NAME`): every
    /// such agent is PID 1 of its pod on the node's host name. No drain times set.
    pub(crate) fn pod_base(&self) -> AgentBuilder {
        let state = self.state_dir();
        agent()
            .hot_restart_on(self.ports)
            .bootstrap_path(self.dir.join("bootstrap.yaml"))
            .wrapper(POD)
            .args(&["--state-dir", state.to_str().unwrap()])
    }

    /// A pod of this node named `name`, with short drain and parent-shutdown times.
    pub(crate) fn pod(&self, name: &str) -> AgentBuilder {
        self.pod_base()
            .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
            .args(&["--identity", name])
    }

    /// Envoy's admin API: the node's admin socket where it is, in the state dir (each pod
    /// reaches it through a link in its own temp dir).
    pub(crate) fn admin(&self) -> AdminClient {
        AdminClient::new(self.admin_socket())
    }

    pub(crate) fn admin_socket(&self) -> envoy_agent_proxy::admin::Address {
        envoy_agent_tests::node_admin_socket_at(&self.state_dir(), self.ports.base_id)
    }

    pub(crate) fn listener(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.ports.listener_port).into()
    }

    fn heartbeat_state(&self, name: &str) -> Option<NodeState> {
        heartbeat(&self.state_dir(), name).map(|h| h.state)
    }
}

/// The heartbeat of the pod named `name` (its identity is the name plus a random suffix).
pub(crate) fn heartbeat(dir: &Path, name: &str) -> Option<envoy_agent_hotrestart::node::Heartbeat> {
    let (heartbeats, _) = envoy_agent_hotrestart::node::read_all(dir);
    let prefix = format!("{name}-");
    heartbeats
        .into_iter()
        .find(|h| h.identity.starts_with(&prefix))
}

/// What the node's family has on disk: its shared memory segment and the socket files in
/// `<state dir>/hot-restart` (Envoy's hot-restart channel and its admin).
fn family_files(node: &Node) -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let mut files: Vec<PathBuf> = std::fs::read_dir(node.state_dir().join("hot-restart"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .map(|e| e.path())
        .collect();
    let segment = envoy_agent_hotrestart::shm::path(node.ports.base_id);
    if segment.exists() {
        files.push(segment);
    }
    files.sort();
    files
}

async fn marker_gone(pod: &AgentProcess) {
    eventually("the predecessor's marker to go", PATIENCE, || async {
        (!pod.marker_present()).then_some(())
    })
    .await;
}

#[tokio::test]
async fn surge_upgrades_across_three_pods_lose_no_request() {
    let node = Node::new();
    let a = node.pod("pod-a").start().await;
    live_at(&node.admin(), 0).await;
    let load = Load::start(node.listener(), "/", 4, 4);

    let mut previous = a;
    for (epoch, name) in [(1, "pod-b"), (2, "pod-c")] {
        let started = Instant::now();
        // start() returns once the new pod's marker exists: LIVE at its epoch.
        let next = node.pod(name).start().await;
        let takeover = started.elapsed();
        live_at(&node.admin(), epoch).await;
        assert!(next.marker_present());
        marker_gone(&previous).await;
        assert_eq!(node.heartbeat_state(name), Some(NodeState::Serving));
        eventually(
            "the predecessor to report the handover",
            PATIENCE,
            || async {
                (previous
                    .stderr()
                    .contains(&format!("handed over to {name}")))
                .then_some(())
            },
        )
        .await;
        eprintln!("takeover by {name}: {takeover:?} from start to marker");

        // The kubelet deletes the old pod: it waits for its Envoy to be terminated by the
        // successor's, then exits 0.
        let sigterm = Instant::now();
        previous.signal_agent(Signal::SIGTERM);
        assert_eq!(previous.exit().await.code(), Some(0));
        eprintln!("predecessor SIGTERM to exit: {:?}", sigterm.elapsed());
        assert!(
            previous.stderr().contains("our envoy exited"),
            "{}",
            previous.stderr()
        );
        let info = node.admin().server_info().await.unwrap();
        assert_eq!((info.state, info.restart_epoch), (ServerState::Live, epoch));
        // The family is the successor's now: the old pod leaves its files alone.
        assert!(previous.events("family_files_removed").is_empty());
        assert!(
            family_files(&node).contains(&envoy_agent_hotrestart::shm::path(node.ports.base_id)),
            "{:?}",
            family_files(&node)
        );
        previous = next;
    }
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(report.ok > 100, "{report:?}");
    let mut last = previous;
    last.signal_agent(Signal::SIGTERM);
    assert_eq!(last.exit().await.code(), Some(0));
    // The last pod's family ended with it: nothing of it is left on the node (the soak's
    // third finding).
    let removed = last.events("family_files_removed");
    assert_eq!(removed.len(), 1, "{}", last.stderr());
    assert_eq!(family_files(&node), Vec::<PathBuf>::new());
}

#[tokio::test]
async fn sigterm_to_the_predecessor_during_the_handoff_loses_no_request() {
    let node = Node::new();
    let mut a = node.pod("pod-a").start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    let b = tokio::spawn(node.pod("pod-b").start());
    let state = node.state_dir();
    eventually("pod-b to start its handoff", PATIENCE, || async {
        (heartbeat(&state, "pod-b").map(|h| h.state) == Some(NodeState::Starting)).then_some(())
    })
    .await;
    a.signal_agent(Signal::SIGTERM);
    let mut b = b.await.unwrap();
    live_at(&node.admin(), 1).await;
    assert_eq!(a.exit().await.code(), Some(0));
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(b.marker_present());
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_dead_predecessor_leaves_a_stale_heartbeat_and_the_successor_starts_at_zero() {
    let node = Node::new();
    let mut a = node.pod("pod-a").start().await;
    a.signal_agent(Signal::SIGKILL);
    a.exit().await;
    assert!(
        heartbeat(&node.state_dir(), "pod-a").is_some(),
        "left behind"
    );
    let mut b = node.pod("pod-b").start().await;
    live_at(&node.admin(), 0).await;
    assert!(b.stderr().contains("no live predecessor"), "{}", b.stderr());
    assert_eq!(
        envoy_agent_tests::http_get(node.listener(), "/")
            .await
            .unwrap()
            .status,
        200
    );
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

#[tokio::test]
async fn two_successors_at_once_never_share_an_epoch() {
    let node = Node::new();
    // As a DaemonSet's pods say it: the two successors are of one rollout, one generation
    // (by their start times alone, one would be newer, and the other would stand by).
    let mut a = node
        .pod("pod-a")
        .args(&["--pod-generation", "1"])
        .start()
        .await;
    let load = Load::start(node.listener(), "/", 2, 2);
    let successor = |name| node.pod(name).args(&["--pod-generation", "2"]).start();
    let (b, c) = tokio::join!(successor("pod-b"), successor("pod-c"));
    let (mut b, mut c) = (b, c);
    // One took over from A at epoch 1, the other waited for the lock and then for that
    // handoff to finish, and took over at epoch 2.
    live_at(&node.admin(), 2).await;
    let epochs: Vec<u32> = ["pod-b", "pod-c"]
        .iter()
        .filter_map(|n| heartbeat(&node.state_dir(), n))
        .map(|h| h.newest_epoch)
        .collect();
    let mut sorted = epochs.clone();
    sorted.sort();
    assert_eq!(sorted, [1, 2], "no epoch used twice: {epochs:?}");
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    for pod in [&mut a, &mut b, &mut c] {
        pod.signal_agent(Signal::SIGTERM);
    }
    for pod in [&mut a, &mut b, &mut c] {
        assert_eq!(pod.exit().await.code(), Some(0));
    }
}

#[tokio::test]
async fn a_corrupt_heartbeat_is_reported_and_ignored() {
    let node = Node::new();
    std::fs::write(
        node.state_dir().join("heartbeat-garbage.json"),
        "{\"format\": \"envoy-agent.heartbeat.v1\", \"identity\": ",
    )
    .unwrap();
    std::fs::write(node.state_dir().join("heartbeat-truncated.json"), "").unwrap();
    let mut a = node.pod("pod-a").start().await;
    live_at(&node.admin(), 0).await;
    let stderr = a.stderr();
    assert!(stderr.contains("ignoring a heartbeat file"), "{stderr}");
    assert!(stderr.contains("heartbeat-garbage.json"), "{stderr}");
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
}

/// A surge successor runs the same command line on the same host network as its predecessor:
/// both want the default status port. The successor takes over anyway, serves its status port
/// only once the predecessor has released it, and never shares it.
#[tokio::test]
async fn surge_pods_take_the_default_status_port_in_turn() {
    // A node of the test's own: the default port, free of the other tests.
    let _netns = envoy_agent_tests::NetNs::enter();
    let node = Node::new();
    let status: std::net::SocketAddr = ([127, 0, 0, 1], 15020).into();
    let mut a = node.pod("pod-a").default_status_address().start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    eventually(
        "pod-a ready on the default status port",
        PATIENCE,
        || async {
            let r = envoy_agent_tests::http_get(status, "/healthz/ready")
                .await
                .ok()?;
            (r.status == 200).then_some(())
        },
    )
    .await;

    let mut b = node.pod("pod-b").default_status_address().start().await;
    b.wait_event("status_address", "state", "in_use").await;
    assert!(
        b.marker_present(),
        "the successor took over: its readiness is the marker"
    );
    // The port is still pod-a's, which says it handed over.
    let r = eventually("pod-a to report the handover", PATIENCE, || async {
        let r = envoy_agent_tests::http_get(status, "/healthz/ready")
            .await
            .ok()?;
        r.body.contains("handed over").then_some(r)
    })
    .await;
    assert_eq!(r.status, 503);
    assert!(r.body.contains("pod-b"), "{}", r.body);

    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    b.wait_event("status_address", "state", "bound").await;
    let r = eventually(
        "pod-b ready on the default status port",
        PATIENCE,
        || async {
            let r = envoy_agent_tests::http_get(status, "/healthz/ready")
                .await
                .ok()?;
            (r.status == 200).then_some(r)
        },
    )
    .await;
    assert_eq!(r.body, "ready\n");
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

/// The `older` pod stands by (its reason naming `why`), and for three seconds the `newer` one's
/// epoch 0 serves on: the older never ready, the newer always.
async fn older_stands_by(node: &Node, older: &AgentProcess, newer: &AgentProcess, why: &str) {
    let standing_by = eventually("the older pod to stand by", PATIENCE, || async {
        older.events("newer_pod_serves").into_iter().next()
    })
    .await;
    assert!(
        standing_by["reason"]
            .as_str()
            .is_some_and(|r| r.contains(why)),
        "{standing_by}"
    );
    let until = Instant::now() + std::time::Duration::from_secs(3);
    while Instant::now() < until {
        let info = node.admin().server_info().await.unwrap();
        assert_eq!(
            (info.state, info.restart_epoch),
            (ServerState::Live, 0),
            "the newer pod's family serves on"
        );
        assert!(newer.marker_present() && !older.marker_present());
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Issue 31: a rollout only goes forward. An older pod of the rollout (its container restarted,
/// or its agent back from a crash's back-off) that finds a newer pod's family serving the node
/// stands by: it neither hot-restarts from it (which would hand the node back to the old pod)
/// nor starts a family beside it. The newer pod serves on, losing no request.
#[tokio::test]
async fn an_older_pod_never_takes_over_from_a_newer_ones_family() {
    let node = Node::new();
    let b = node
        .pod("pod-b")
        .args(&["--pod-generation", "2"])
        .start()
        .await;
    live_at(&node.admin(), 0).await;
    let load = Load::start(node.listener(), "/", 2, 2);

    let mut a = node
        .pod("pod-a")
        .env("ENVOY_AGENT_POD_GENERATION", "1")
        .no_wait_live()
        .start()
        .await;
    older_stands_by(&node, &a, &b, "generation 2").await;
    assert!(a.events("epoch_starting").is_empty(), "no epoch of its own");
    assert_eq!(node.heartbeat_state("pod-b"), Some(NodeState::Serving));

    a.signal_agent(Signal::SIGTERM);
    a.exit().await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(b.marker_present(), "the newer pod still serves");
}

/// The serving Envoy of `pod` (the one child Envoy of its agent), once there is one other
/// than `not`.
async fn serving_envoy_of(pod: &AgentProcess, not: Option<u32>) -> u32 {
    eventually("the pod's envoy", PATIENCE, || async {
        let envoys = envoy_agent_tests::envoy_children_of(pod.agent_pid());
        match envoys.as_slice() {
            [one] if Some(*one) != not => Some(*one),
            _ => None,
        }
    })
    .await
}

/// Issue 31, the surge rollout's crash case: the predecessor's Envoy crashes (four times, so
/// that its back-off is long) and, while its
/// agent backs off (`--restart-on-crash`), a successor pod starts and serves with a family of
/// its own. When the back-off ends, the recovering predecessor finds the newer pod serving
/// and stands by: the rollout goes forward, losing no request after the crash's own. The
/// pods' order is their agents' start times (no `--pod-generation`: the default).
#[tokio::test]
async fn a_predecessor_recovering_from_a_crash_lets_the_rollout_go_forward() {
    let node = Node::new();
    let a = node
        .pod("pod-a")
        .args(&["--restart-on-crash"])
        .start()
        .await;
    live_at(&node.admin(), 0).await;
    // Four crashes: the fourth's back-off (8 s) leaves the successor room to start and serve
    // first, even on a shared 2-core machine (CI once took longer than the second's 2 s).
    let mut serving = None;
    for attempt in 1..=4 {
        let envoy = serving_envoy_of(&a, serving).await;
        live_at(&node.admin(), 0).await;
        kill(Pid::from_raw(envoy as i32), Signal::SIGKILL).unwrap();
        a.wait_event("envoy_crashed", "attempt", &attempt.to_string())
            .await;
        serving = Some(envoy);
    }

    let b = node.pod("pod-b").start().await;
    live_at(&node.admin(), 0).await;
    let b_envoy = serving_envoy_of(&b, None).await;
    assert!(
        a.events_with("envoy_restarting", "attempt", "4").is_empty(),
        "the successor served only after the predecessor's back-off ended: {}",
        a.stderr()
    );
    // From here on, nothing is the crash's.
    let load = Load::start(node.listener(), "/", 2, 2);
    a.wait_event("envoy_restarting", "attempt", "4").await;
    older_stands_by(&node, &a, &b, "pod-b").await;
    assert_eq!(
        envoy_agent_tests::envoy_children_of(b.agent_pid()),
        [b_envoy],
        "the successor's envoy was never replaced"
    );
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
}

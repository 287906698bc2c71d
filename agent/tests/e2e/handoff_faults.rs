//! Handoffs that are never worse than not restarting: each fault that once turned a surge
//! upgrade (or an in-pod restart) into an outage, reproduced with the real agent and Envoy,
//! pods in PID namespaces of their own sharing the network, /dev/shm, the state dir and the
//! base id. Every test runs continuous load and asserts zero failed requests (or, where the
//! fault kills a serving process, none after it), and that the serving Envoy survives a
//! [`WATCH`] window: long enough for a child blocked on a dead parent to abort (~13 s).

use std::path::Path;
use std::time::Duration;

use envoy_agent_hotrestart::node::{self, FORMAT, Heartbeat, NodeState};
use envoy_agent_proxy::{AdminClient, ServerState};
use envoy_agent_tests::{Load, LoadReport, PATIENCE, eventually, live_at, process_alive, unix_ms};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::cross_pod::Node;
use envoy_agent_tests::POD;

/// How long the serving Envoy must keep serving after the fault.
const WATCH: Duration = Duration::from_secs(16);
/// Short drain and parent-shutdown times.
const FAST: &[&str] = &["--drain-time", "1s", "--parent-shutdown-time", "2s"];

/// Asserts that the admin port answers LIVE at `epoch` all through `window`.
async fn serves_throughout(admin: &AdminClient, epoch: u32, window: Duration) {
    let end = tokio::time::Instant::now() + window;
    while tokio::time::Instant::now() < end {
        let info = admin.server_info().await;
        match &info {
            Ok(i) if i.state == ServerState::Live && i.restart_epoch == epoch => {}
            other => panic!("not serving at epoch {epoch} during the watch window: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The live Envoy processes of the family `base_id` on this host: (pid, epoch).
fn family_envoys(base_id: u32) -> Vec<(u32, u32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let base = base_id.to_string();
    let mut found = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let value = |flag: &[u8]| {
            args.iter()
                .position(|a| *a == flag)
                .and_then(|i| args.get(i + 1))
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        if value(b"--base-id").as_deref() != Some(base.as_str()) {
            continue;
        }
        if let Some(epoch) = value(b"--restart-epoch").and_then(|e| e.parse().ok()) {
            if process_alive(pid) {
                found.push((pid, epoch));
            }
        }
    }
    found
}

fn envoy_at(base_id: u32, epoch: u32) -> u32 {
    family_envoys(base_id)
        .into_iter()
        .find(|(_, e)| *e == epoch)
        .map(|(pid, _)| pid)
        .unwrap_or_else(|| panic!("no envoy of family {base_id} at epoch {epoch}"))
}

/// Asserts no request failed, except within a second of one of `kills` (the killed process's
/// own connections).
fn none_failed_but_at(report: &LoadReport, kills: &[u64]) {
    let outside: Vec<u64> = report
        .failure_times
        .iter()
        .copied()
        .filter(|t| !kills.iter().any(|k| *t >= *k && *t < k + 1_000))
        .collect();
    assert!(
        outside.is_empty(),
        "{} failed requests outside the killed process's own: {:?}",
        outside.len(),
        report.errors
    );
}

/// A bootstrap on the node's ports with a second listener on `port`.
fn with_listener_on(node: &Node, port: u16) -> String {
    let ports = node.ports;
    let main = envoy_agent_tests::bootstrap_yaml_on(ports.admin_port, ports.listener_port, "node");
    let extra = envoy_agent_tests::bootstrap_yaml_on(0, port, "held");
    let block = &extra
        [extra.find("  - name: hello").unwrap()..extra.find("  clusters").unwrap_or(extra.len())];
    let block = block.replacen("name: hello", "name: held", 1);
    main.replacen("  listeners:\n", &format!("  listeners:\n{block}"), 1)
}

/// 1. Agents with no name of their own (no `--identity`, no `POD_NAME`, PID 1 of pods on one
///    host name) are told apart: the successor takes over, neither touches the other's files.
#[tokio::test]
async fn agents_without_a_name_are_told_apart() {
    let node = Node::new();
    let mut a = node.pod_base().args(FAST).start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    let mut b = node.pod_base().args(FAST).start().await;
    live_at(&node.admin(), 1).await;
    let (heartbeats, _) = node::read_all(&node.state_dir());
    assert_eq!(heartbeats.len(), 2, "two heartbeats: {heartbeats:?}");
    assert_ne!(heartbeats[0].identity, heartbeats[1].identity);
    let b_identity = b.wait_event("handoff", "first", "true").await;
    assert_eq!(
        b_identity["epoch"], 1,
        "took over at epoch 1, not beside it at 0"
    );

    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    a.wait_event("exit", "exit_path", "handed_over").await;
    let (left, _) = node::read_all(&node.state_dir());
    assert_eq!(left.len(), 1, "a removed its own heartbeat only: {left:?}");
    serves_throughout(&node.admin(), 1, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

/// 2a. A successor's first epoch goes through pre-flight: a config Envoy rejects never starts.
#[tokio::test]
async fn a_successors_bad_config_is_refused_by_its_preflight() {
    let node = Node::new();
    let mut a = node.pod("pod-a").start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    let p = node.ports;
    let bad = node.dir.write(
        "bad.yaml",
        &envoy_agent_tests::bootstrap_yaml_on(p.admin_port, p.listener_port, "x").replace(
            "direct_response: { status: 200, body: { inline_string: \"x\" } }",
            "route: { cluster: no_such_cluster }",
        ),
    );
    let mut b = node
        .pod("pod-b")
        .bootstrap_path(bad)
        .no_wait()
        .start()
        .await;
    assert_eq!(b.exit().await.code(), Some(1), "the successor gives up");
    let rejected = b.wait_event("handoff", "outcome", "rejected").await;
    assert!(
        rejected["error"]
            .as_str()
            .unwrap()
            .contains("no_such_cluster"),
        "{rejected}"
    );
    assert!(b.events("epoch_starting").is_empty(), "nothing started");
    serves_throughout(&node.admin(), 0, WATCH).await;
    assert!(a.events("wedge").is_empty(), "{:?}", a.events("wedge"));
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
}

/// 2b. A successor's epoch that fails after taking the predecessor's admin listener (a port
///     held elsewhere: validation cannot see it): the predecessor gets its admin API back by a
///     validated hot restart of its own, and is never wedged for the silence.
#[tokio::test]
async fn a_predecessor_recovers_the_admin_listener_a_failed_successor_took() {
    let node = Node::new();
    let mut a = node.pod("pod-a").start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let path = node.dir.write("held.yaml", &with_listener_on(&node, port));
    let mut b = node
        .pod("pod-b")
        .bootstrap_path(path)
        .no_wait()
        .start()
        .await;
    assert_ne!(b.exit().await.code(), Some(0), "its envoy failed");
    b.wait_event("handoff", "outcome", "failed").await;
    // pod-a's own restart gives the family an admin API back.
    live_at(&node.admin(), 1).await;
    eventually("pod-a's own restart to epoch 1", PATIENCE, || async {
        a.events_with("handoff", "epoch", "1")
            .iter()
            .any(|e| e["outcome"] == "live")
            .then_some(())
    })
    .await;
    assert!(
        !a.events("admin_listener_lost").is_empty(),
        "the restart was for the lost listener"
    );
    assert!(
        a.events_with("wedge", "reason", "admin_unresponsive")
            .is_empty(),
        "never a wedge for another pod's handoff"
    );
    serves_throughout(&node.admin(), 1, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    drop(held);
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
}

/// 3. Stopping a successor whose Envoy still initializes (SIGTERM, or its handoff deadline)
///    kills that Envoy with SIGKILL: Envoy's SIGTERM would terminate its parent, the
///    predecessor's serving Envoy.
#[tokio::test]
async fn stopping_a_successor_that_is_still_starting_leaves_the_predecessor_serving() {
    let xds = envoy_agent_tests::silent_server().await;
    let node = Node::new();
    let mut a = node.pod("pod-a").start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    let p = node.ports;
    let stuck = node.dir.write(
        "stuck.yaml",
        &envoy_agent_tests::bootstrap_waiting_for_xds(p.admin_port, p.listener_port, "x", xds),
    );

    // SIGTERM while its Envoy initializes.
    let mut b = node
        .pod("pod-b")
        .bootstrap_path(stuck)
        .no_wait()
        .start()
        .await;
    b.wait_event("epoch_starting", "epoch", "1").await;
    // Its Envoy has taken the admin listener from pod-a's: nothing, or itself, answers there.
    let mut last = None;
    let taken = tokio::time::timeout(PATIENCE, async {
        loop {
            let info = node.admin().server_info().await;
            let taken =
                !matches!(&info, Ok(i) if i.state == ServerState::Live && i.restart_epoch == 0);
            last = Some(info);
            if taken {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        taken.is_ok(),
        "pod-b's envoy never took the admin listener; the admin port last said {last:?}"
    );
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
    assert!(a.running(), "the predecessor runs on");
    live_at(&node.admin(), 1).await;

    // Its handoff deadline, stuck for another reason than its control plane (a listener
    // whose routes never come; an epoch that waits for its LDS or CDS is retried instead:
    // `control_plane.rs`).
    let warming = node.dir.write(
        "warming.yaml",
        &envoy_agent_tests::bootstrap_waiting_for_rds(p.admin_port, p.listener_port, xds),
    );
    let mut c = node
        .pod("pod-c")
        .bootstrap_path(warming)
        .args(&["--handoff-deadline", "3s"])
        .no_wait()
        .start()
        .await;
    assert_ne!(c.exit().await.code(), Some(0));
    c.wait_event("wedge", "reason", "handoff_deadline").await;
    live_at(&node.admin(), 2).await;
    assert!(a.running());
    serves_throughout(&node.admin(), 2, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
}

/// 4. SIGTERM to the old pod right after the takeover (the kubelet acts as soon as the new
///    pod is ready): decided from fresh facts, the old pod waits for its Envoy to be
///    terminated by the successor's, never cutting the successor's parent.
#[tokio::test]
async fn sigterm_to_the_old_pod_right_after_the_takeover_waits_for_the_successor() {
    let node = Node::new();
    let mut previous = node.pod("pod-0").start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    for (epoch, delay_ms) in [(1u32, 0u64), (2, 30), (3, 300)] {
        // start() returns once the new pod's marker exists.
        let next = node.pod(&format!("pod-{epoch}")).start().await;
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        previous.signal_agent(Signal::SIGTERM);
        assert_eq!(previous.exit().await.code(), Some(0));
        previous
            .wait_event("exit", "exit_path", "handed_over")
            .await;
        assert!(
            previous.events("drain_accepted").is_empty(),
            "no drain of its own"
        );
        live_at(&node.admin(), epoch).await;
        previous = next;
    }
    serves_throughout(&node.admin(), 3, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    previous.signal_agent(Signal::SIGTERM);
    assert_eq!(previous.exit().await.code(), Some(0));
}

/// 5. A pod's own hot restart is advertised: a successor waits for the pod's draining parent
///    instead of starting a third generation.
#[tokio::test]
async fn a_successor_waits_for_the_pods_own_draining_parent() {
    let node = Node::new();
    let mut a = node
        .pod_base()
        .args(&["--drain-time", "3s", "--parent-shutdown-time", "5s"])
        .args(&["--identity", "pod-a"])
        .start()
        .await;
    let load = Load::start(node.listener(), "/", 4, 2);
    let base_id = node.ports.base_id;
    let generations = tokio::spawn(async move {
        let mut most = 0;
        for _ in 0..1500 {
            most = most.max(family_envoys(base_id).len());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        most
    });
    a.signal_agent(Signal::SIGHUP);
    live_at(&node.admin(), 1).await;
    // Epoch 0 drains for 5 s; the successor must not start epoch 2 meanwhile.
    let mut b = node.pod("pod-b").start().await;
    live_at(&node.admin(), 2).await;
    let most = generations.await.unwrap();
    assert!(most <= 2, "at most two generations at once, saw {most}");
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    serves_throughout(&node.admin(), 2, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

/// 6. A readiness marker left by a crashed container is removed at start-up, before anything
///    else: the kubelet must not take a waiting successor for ready.
#[tokio::test]
async fn a_stale_marker_is_removed_before_anything_else() {
    let node = Node::new();
    let mut a = node
        .pod_base()
        .args(&["--drain-time", "3s", "--parent-shutdown-time", "5s"])
        .args(&["--identity", "pod-a"])
        .start()
        .await;
    let load = Load::start(node.listener(), "/", 2, 2);
    a.signal_agent(Signal::SIGHUP);
    live_at(&node.admin(), 1).await;
    let builder = node.pod("pod-b");
    let marker = builder.dir().join("ready");
    std::fs::write(&marker, "ready\n").unwrap();
    let mut b = builder.no_wait().start().await;
    eventually("the stale marker gone", PATIENCE, || async {
        (!marker.exists()).then_some(())
    })
    .await;
    let info = node.admin().server_info().await.unwrap();
    assert_eq!(
        info.restart_epoch, 1,
        "gone while the successor still waits"
    );
    live_at(&node.admin(), 2).await;
    eventually("the marker once LIVE", PATIENCE, || async {
        marker.exists().then_some(())
    })
    .await;
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    serves_throughout(&node.admin(), 2, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

/// 7. A draining parent that never exits (stopped) is killed once past its parent-shutdown
///    time and a grace, stood in for, recorded as a wedge; the queued restart then runs, and
///    says why it waited.
#[tokio::test]
async fn a_draining_parent_that_never_exits_is_killed_and_the_queue_goes_on() {
    let node = Node::new();
    let mut a = node.pod("pod-a").start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    a.signal_agent(Signal::SIGHUP);
    live_at(&node.admin(), 1).await;
    // Past its 1 s drain, no client talks to the parent anymore; then it stops.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let parent = envoy_at(node.ports.base_id, 0);
    kill(Pid::from_raw(parent as i32), Signal::SIGSTOP).unwrap();
    a.signal_agent(Signal::SIGHUP);
    let queued = a.wait_event("restart_queued", "level", "INFO").await;
    assert!(
        queued["waiting_for"]
            .as_str()
            .unwrap()
            .contains("still drains"),
        "{queued}"
    );
    live_at(&node.admin(), 2).await;
    a.wait_event("wedge", "reason", "parent_overdue").await;
    assert!(!process_alive(parent), "the overdue parent was killed");
    serves_throughout(&node.admin(), 2, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
}

/// 8a. In one pod: a killed draining parent's stand-in is kept across the next restart (epoch
///     2 does not reuse epoch 0's socket names), so epoch 1, which still talks to it, lives on.
#[tokio::test]
async fn a_stand_in_outlives_the_next_restart_while_its_child_needs_it() {
    let node = Node::new();
    let mut a = node
        .pod_base()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "40s"])
        .args(&["--identity", "pod-a"])
        .start()
        .await;
    let load = Load::start(node.listener(), "/", 2, 2);
    a.signal_agent(Signal::SIGHUP);
    live_at(&node.admin(), 1).await;
    let parent = envoy_at(node.ports.base_id, 0);
    kill(Pid::from_raw(parent as i32), Signal::SIGKILL).unwrap();
    let killed = unix_ms();
    a.wait_event("stand_in", "epoch", "0").await;
    a.signal_agent(Signal::SIGHUP);
    live_at(&node.admin(), 2).await;
    let epoch1 = envoy_at(node.ports.base_id, 1);
    serves_throughout(&node.admin(), 2, WATCH).await;
    assert!(
        process_alive(epoch1),
        "epoch 1 (talking to its dead parent's stand-in) did not abort"
    );
    assert!(a.events("stand_in_released").is_empty());
    let report = load.stop().await;
    none_failed_but_at(&report, &[killed]);
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
}

/// 8b. Across pods: when the predecessor pod dies while its Envoy still drains as our first
///     epoch's parent, the successor binds the parent's socket names itself and answers.
#[tokio::test]
async fn a_successor_stands_in_for_a_predecessor_pod_that_died_early() {
    let node = Node::new();
    let long = ["--drain-time", "1s", "--parent-shutdown-time", "40s"];
    let mut a = node
        .pod_base()
        .args(&long)
        .args(&["--identity", "pod-a"])
        .start()
        .await;
    let load = Load::start(node.listener(), "/", 2, 2);
    let mut b = node
        .pod_base()
        .args(&long)
        .args(&["--identity", "pod-b"])
        .start()
        .await;
    live_at(&node.admin(), 1).await;
    // The whole pod dies (its PID namespace with it): its Envoy, our parent, too.
    a.signal(Signal::SIGKILL);
    a.exit().await;
    let killed = unix_ms();
    b.wait_event("stand_in", "epoch", "0").await;
    serves_throughout(&node.admin(), 1, WATCH).await;
    let report = load.stop().await;
    none_failed_but_at(&report, &[killed]);
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

fn heartbeat(identity: &str, base_id: u32, epoch: u32, updated_unix_ms: u64) -> Heartbeat {
    Heartbeat {
        format: FORMAT.to_owned(),
        identity: identity.to_owned(),
        pid: 1,
        base_id,
        hot_restart_version: "11.104".to_owned(),
        newest_epoch: epoch,
        envoy_pid: 1,
        state: NodeState::Serving,
        updated_unix_ms,
        parent_draining_until_unix_ms: 0,
        restart_in_flight: false,
        cold_takeover_of: None,
        handover: None,
        socket_path: String::new(),
        admin_address: String::new(),
        generation: 0,
    }
}

/// 9. Files named like heartbeats that are not (a FIFO, a huge file, a symlink) and a
///    heartbeat stamped in the future hang nothing and fool nothing, and are reported once.
#[tokio::test]
async fn heartbeat_files_that_are_not_heartbeats_hang_and_fool_nothing() {
    let node = Node::new();
    let mut a = node.pod("pod-a").start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    let state = node.state_dir();
    nix::unistd::mkfifo(
        &state.join("heartbeat-fifo.json"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    std::fs::File::create(state.join("heartbeat-huge.json"))
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    std::os::unix::fs::symlink("/dev/zero", state.join("heartbeat-link.json")).unwrap();
    // A pod claiming a far newer epoch, fresh forever if its time were trusted.
    node::write(
        &state,
        &heartbeat("ghost", node.ports.base_id, 99, unix_ms() + 3_600_000),
    )
    .unwrap();
    let mut b = node.pod("pod-b").start().await;
    live_at(&node.admin(), 1).await;
    let rejected = b.events("heartbeat_rejected");
    for name in [
        "heartbeat-fifo.json",
        "heartbeat-huge.json",
        "heartbeat-link.json",
    ] {
        let times = rejected
            .iter()
            .filter(|e| e["path"].as_str().is_some_and(|p| p.ends_with(name)))
            .count();
        assert_eq!(times, 1, "{name} reported once: {rejected:?}");
    }
    assert!(
        rejected.iter().any(|e| e["identity"] == "ghost"),
        "the future heartbeat is not trusted: {rejected:?}"
    );
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    serves_throughout(&node.admin(), 1, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

/// 10. In one pod: the serving epoch killed right after its child's LIVE, before the
///     supervisor has seen it (the supervisor is held stopped meanwhile, so that the race goes
///     the bad way every time), many times in a row: the child is stood in for at once and
///     serves on; the agent never stops.
#[tokio::test]
async fn the_serving_epoch_killed_right_after_its_childs_live_is_survived() {
    killed_right_after_live(&[], None).await;
}

/// The same with the user's own hot-restart channel (`-- --socket-path`, in a directory of
/// theirs only they can enter): the stand-ins bind its names.
#[tokio::test]
async fn the_serving_epoch_killed_right_after_its_childs_live_is_survived_on_a_socket_path_of_ones_own()
 {
    let dir = envoy_agent_tests::TestDir::new();
    let channel = dir.join("channel");
    std::fs::create_dir(&channel).unwrap();
    std::fs::set_permissions(
        &channel,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o700),
    )
    .unwrap();
    let prefix = channel.join("envoy");
    killed_right_after_live(&["--socket-path", prefix.to_str().unwrap()], Some(&channel)).await;
}

/// `channel`: the directory where the family's hot-restart sockets must be.
async fn killed_right_after_live(envoy_args: &[&str], channel: Option<&std::path::Path>) {
    let mut agent = crate::agent()
        .hot_restart()
        .wrapper(POD)
        .args(FAST)
        .envoy_args(envoy_args)
        .start()
        .await;
    if let Some(dir) = channel {
        let names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        assert!(
            names.iter().any(|n| n.starts_with("envoy_parent_")),
            "the family's sockets are in {}: {names:?}",
            dir.display()
        );
    }
    let base_id = agent.ports.unwrap().base_id;
    let listener = std::net::SocketAddr::from(([127, 0, 0, 1], agent.ports.unwrap().listener_port));
    let load = Load::start(listener, "/", 2, 2);
    let supervisor = Pid::from_raw(agent.agent_pid() as i32);
    let mut kills = Vec::new();
    for epoch in 1..=5u32 {
        let parent = envoy_at(base_id, epoch - 1);
        agent.signal_agent(Signal::SIGHUP);
        eventually(&format!("epoch {epoch} spawned"), PATIENCE, || async {
            family_envoys(base_id)
                .iter()
                .any(|(_, e)| *e == epoch)
                .then_some(())
        })
        .await;
        // The supervisor sees nothing from here until the parent is dead.
        kill(supervisor, Signal::SIGSTOP).unwrap();
        let live = tokio::time::timeout(PATIENCE, async {
            loop {
                if let Ok(i) = agent.admin.server_info().await {
                    if i.state == ServerState::Live && i.restart_epoch == epoch {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        kill(Pid::from_raw(parent as i32), Signal::SIGKILL).unwrap();
        kills.push(unix_ms());
        kill(supervisor, Signal::SIGCONT).unwrap();
        live.unwrap_or_else(|_| panic!("epoch {epoch} never LIVE"));
        eventually("one generation", PATIENCE, || async {
            (family_envoys(base_id).len() == 1).then_some(())
        })
        .await;
        live_at(&agent.admin, epoch).await;
        assert!(agent.running(), "the agent goes on after kill {epoch}");
    }
    serves_throughout(&agent.admin, 5, WATCH).await;
    assert!(agent.running());
    assert!(
        agent.events("stand_in").len() >= 5,
        "stood in for every killed parent: {:?}",
        agent.events("stand_in")
    );
    let report = load.stop().await;
    none_failed_but_at(&report, &kills);
    agent.signal_agent(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// 11. A shared-memory segment a next epoch could not attach to is never written and never
///     started into: with cold handovers off, the restart is refused before anything starts,
///     naming the segment and what is wrong with it; the serving epoch serves on, and once the
///     segment is sound again hot restarts go on. (With cold handovers on, the default, the
///     family moves to the other base id instead: `cold_handover.rs`.)
#[tokio::test]
async fn an_unusable_shared_memory_segment_is_refused_and_left_untouched_without_cold_handover() {
    let node = Node::new();
    let mut a = node
        .pod("pod-a")
        .args(&["--no-cold-handover"])
        .start()
        .await;
    let load = Load::start(node.listener(), "/", 2, 2);
    // Another layout than the running Envoy's (its version field changed): a next epoch would
    // refuse to attach to it and die initializing.
    let segment = envoy_agent_hotrestart::shm::path(node.ports.base_id);
    let header = tamper(&segment, 99);
    a.signal_agent(Signal::SIGHUP);
    let refused = a.wait_event("handoff", "outcome", "rejected").await;
    let message = refused["error"].as_str().unwrap();
    assert!(
        message.contains("shared memory is unusable")
            && message.contains(&segment.display().to_string())
            && message.contains("--no-cold-handover"),
        "{refused}"
    );
    assert_eq!(header_of(&segment)[8], 99, "the segment was not written");
    let info = node.admin().server_info().await.unwrap();
    assert_eq!((info.state, info.restart_epoch), (ServerState::Live, 0));
    restore(&segment, header);
    a.signal_agent(Signal::SIGHUP);
    live_at(&node.admin(), 1).await;
    serves_throughout(&node.admin(), 1, WATCH).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
}

/// Sets the segment's version field to `version`; returns the original header.
fn tamper(segment: &Path, version: u8) -> [u8; 16] {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(segment)
        .unwrap();
    let mut header = [0u8; 16];
    file.read_exact_at(&mut header, 0).unwrap();
    file.write_all_at(&[version], 8).unwrap();
    header
}

fn header_of(segment: &Path) -> [u8; 16] {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(segment).unwrap();
    let mut header = [0u8; 16];
    file.read_exact_at(&mut header, 0).unwrap();
    header
}

fn restore(segment: &Path, header: [u8; 16]) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(segment)
        .unwrap();
    file.write_all_at(&header, 0).unwrap();
}

/// 12. The soak's fifth finding (docs/soak.md): a config change that the old pod queued while
///     its own parent drained, and the successor waited for that drain holding the node's
///     epoch lock, ran the moment the successor's first epoch went LIVE and let the lock go,
///     before the old pod had seen the takeover: a second epoch of that number, started from
///     the old pod's, took the node back. The old pod defers it under the lock and hands over.
#[tokio::test]
async fn a_config_change_queued_behind_a_successors_takeover_never_takes_the_node_back() {
    let node = Node::new();
    let mut a = node
        .pod_base()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "4s"])
        .args(&["--watch-config", "--identity", "pod-a"])
        .start()
        .await;
    let load = Load::start(node.listener(), "/", 2, 2);
    a.signal_agent(Signal::SIGHUP);
    live_at(&node.admin(), 1).await;
    // pod-a's epoch 0 drains for 4 s; pod-b waits for it, holding the node's epoch lock.
    let mut b = node.pod("pod-b").no_wait().start().await;
    eventually("pod-b waiting for its turn", PATIENCE, || async {
        crate::cross_pod::heartbeat(&node.state_dir(), "pod-b")
            .filter(|h| h.state == NodeState::Waiting)
    })
    .await;
    // A config change for pod-a: queued behind its draining parent, then behind the lock.
    let bootstrap = node.dir.join("bootstrap.yaml");
    let changed = node.dir.join("bootstrap.yaml.new");
    std::fs::write(
        &changed,
        envoy_agent_tests::bootstrap_yaml_on(
            node.ports.admin_port,
            node.ports.listener_port,
            "changed",
        ),
    )
    .unwrap();
    std::fs::rename(&changed, &bootstrap).unwrap();
    a.wait_event("restart_queued", "reason", "config change")
        .await;
    live_at(&node.admin(), 2).await;
    let handed = eventually("pod-a to see the takeover", PATIENCE, || async {
        a.events("handed_over").into_iter().next()
    })
    .await;
    assert!(
        handed["successor"]
            .as_str()
            .is_some_and(|s| s.starts_with("pod-b-")),
        "{handed}"
    );
    serves_throughout(&node.admin(), 2, WATCH).await;
    assert_eq!(
        a.events_with("epoch_starting", "epoch", "2"),
        Vec::<serde_json::Value>::new(),
        "pod-a started no epoch beside pod-b's"
    );
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    a.wait_event("exit", "exit_path", "handed_over").await;
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

//! Cold handover in one pod: where hot restart cannot work, a second Envoy family starts
//! beside the serving one (`--base-id` + 1, its listeners bound beside the old ones through
//! `SO_REUSEPORT`), takes over once LIVE, and the old family drains and stops; a hot restart
//! of the new family then brings its admin back to the configured port. Under load, with the
//! failed requests counted.
//!
//! No two PyPI releases differ in `--hot-restart-version`, so "another version" is a wrapper
//! that reports one and runs the real Envoy for everything else; the unusable shared memory is
//! the real segment with its version field overwritten.

use std::path::{Path, PathBuf};

use envoy_agent_proxy::ServerState;
use envoy_agent_tests::{
    Load, PATIENCE, envoy_children_of, envoy_path, eventually, http_get, live_at, process_alive,
};
use nix::sys::signal::Signal;

use crate::agent;
use crate::cross_pod::Node;

/// Connections queued on the old family's listen sockets when they close move to the new
/// family's (Linux 5.14+): without it the kernel resets them, which the load would count.
/// Network-namespace wide; the tests set it as the runbook tells operators to.
fn tcp_migrate_req() {
    let path = "/proc/sys/net/ipv4/tcp_migrate_req";
    let now = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!("{path}: {e} (a cold handover without resets needs Linux 5.14 or newer)")
    });
    if now.trim() != "1" {
        std::fs::write(path, "1").unwrap_or_else(|e| {
            panic!("cannot set {path} to 1: {e} (run the tests as root, or set the sysctl)")
        });
    }
}

/// A binary that says it has another hot-restart version and is the real Envoy otherwise.
fn other_version_wrapper(dir: &Path) -> PathBuf {
    let path = dir.join("envoy-other-hot-restart-version");
    let script = format!(
        "#!/bin/sh\n\
         if [ \"$1\" = \"--hot-restart-version\" ]; then echo 11.999 >&2; exit 0; fi\n\
         exec {} \"$@\"\n",
        envoy_path().display()
    );
    std::fs::write(&path, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Points the symlink `path` at `target` in one step.
fn repoint(path: &Path, target: &Path) {
    let next = path.with_extension("next");
    let _ = std::fs::remove_file(&next);
    std::os::unix::fs::symlink(target, &next).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// Overwrites the version field of the family's shared memory segment (what a stray write or
/// a segment of another layout looks like to the next epoch).
fn corrupt_shared_memory(base_id: u32) {
    use std::os::unix::fs::FileExt;
    let path = format!("/dev/shm/envoy_shared_memory_{}", u64::from(base_id) * 10);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    file.write_all_at(&0xdead_beef_u64.to_ne_bytes(), 8)
        .unwrap();
}

/// Once the new family has served the load a while: stops it, prints the figure (`what`) and
/// asserts that no request failed.
async fn serves_on_then_reports(load: Load, what: &str) {
    let served = load.ok();
    eventually("the new family to serve the load", PATIENCE, || async {
        (load.ok() > served + 50).then_some(())
    })
    .await;
    let report = load.stop().await;
    eprintln!(
        "{what}: {} requests ok, {} failed",
        report.ok, report.failed
    );
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
}

#[derive(Clone, Copy, Debug)]
enum Why {
    /// The binary on the path reports another `--hot-restart-version`.
    OtherVersion,
    /// The family's shared memory segment cannot take another epoch.
    CorruptSharedMemory,
}

async fn cold_handover_in_one_pod(why: Why) {
    tcp_migrate_req();
    let builder = agent().hot_restart();
    let path = builder.dir().join("envoy");
    repoint(&path, &envoy_path());
    let wrapper = other_version_wrapper(&builder.dir().join(""));
    let mut agent = builder
        .envoy_path(path.clone())
        .args(&["--drain-time", "2s", "--parent-shutdown-time", "3s"])
        .start()
        .await;
    let ports = agent.ports.unwrap();
    let listener = std::net::SocketAddr::from(([127, 0, 0, 1], ports.listener_port));
    live_at(&agent.admin, 0).await;
    let old_envoy = agent.envoys()[0];
    let load = Load::start(listener, "/", 4, 4);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 50).then_some(())
    })
    .await;

    match why {
        Why::OtherVersion => repoint(&path, &wrapper),
        Why::CorruptSharedMemory => corrupt_shared_memory(ports.base_id),
    }
    agent.signal(Signal::SIGHUP);
    let starting = agent.wait_event("cold_handover", "stage", "starting").await;
    assert_eq!(starting["from_base_id"], ports.base_id, "{starting}");
    assert_eq!(starting["to_base_id"], ports.base_id + 1, "{starting}");
    let expected = match why {
        Why::OtherVersion => "11.999",
        Why::CorruptSharedMemory => "shared memory",
    };
    assert!(
        starting["why"].as_str().unwrap().contains(expected),
        "{starting}"
    );
    let live = agent.wait_event("cold_handover", "stage", "live").await;
    if let Why::OtherVersion = why {
        // A real release of another version says the same of itself before and after; the
        // wrapper runs the real Envoy, so the real binary is what the new family runs on, and
        // what the settling restart (after the drain time) must find. Not while the new
        // family's Envoy is being exec'd: a binary swapped under an exec is not a release.
        repoint(&path, &envoy_path());
    }
    assert_eq!(live["tcp_migrate_req"], true, "{live}");
    let handoff = agent
        .events_with("handoff", "kind", "cold")
        .pop()
        .expect("a cold handoff event");
    assert_eq!(handoff["outcome"], "live", "{handoff}");
    assert_eq!(handoff["epoch"], 0, "{handoff}");
    // Both families serve for the drain time: the old one drains. Ready throughout, and
    // readiness and the status say why two families run.
    assert!(
        process_alive(old_envoy),
        "the old family drains before it stops"
    );
    eventually(
        "readiness to tell of the cold handover",
        PATIENCE,
        || async {
            let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
            assert_eq!(ready.status, 200, "{}", ready.body);
            ready.body.starts_with("ready (cold handover").then_some(())
        },
    )
    .await;
    let (code, out, err) = crate::grpc::cli(&agent, &["status"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("cold handover:") && l.contains(expected)),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("retiring:")), "{out}");

    // The old family retires; a hot restart of the new one takes the configured admin port.
    agent.wait_event("cold_handover", "stage", "retired").await;
    assert!(!process_alive(old_envoy));
    live_at(&agent.admin, 1).await;
    let info = agent.admin.server_info().await.unwrap();
    assert_eq!(info.state, ServerState::Live);
    assert_eq!(info.base_id, u64::from(ports.base_id) + 1, "the new family");
    assert_eq!(info.hot_restart_version, "11.104");
    eventually(
        "one envoy left, the new family's epoch 1",
        PATIENCE,
        || async { (agent.envoys().len() == 1).then_some(()) },
    )
    .await;
    eventually("readiness plain again", PATIENCE, || async {
        let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
        assert_eq!(ready.status, 200, "{}", ready.body);
        (ready.body == "ready\n").then_some(())
    })
    .await;
    let settled = agent.events_with("handoff", "epoch", "1").pop().unwrap();
    assert_eq!(
        (&settled["outcome"], &settled["kind"]),
        (&"live".into(), &"hot".into()),
        "{settled}"
    );

    serves_on_then_reports(load, &format!("cold handover ({why:?}) in one pod")).await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_binary_of_another_hot_restart_version_is_handed_over_cold_losing_no_request() {
    cold_handover_in_one_pod(Why::OtherVersion).await;
}

#[tokio::test]
async fn corrupt_shared_memory_is_handed_over_cold_losing_no_request() {
    cold_handover_in_one_pod(Why::CorruptSharedMemory).await;
}

/// A successor pod that cannot hot-restart from the node's family (its Envoy has another
/// hot-restart version: a surge upgrade to an incompatible release; or the family's segment is
/// corrupt): its new family starts beside the predecessor's under the other base id; once it is
/// LIVE its heartbeat tells the predecessor, which drains its family, stops it and exits as
/// handed over; the successor then binds the configured admin port.
async fn cold_handover_across_pods(why: Why) {
    tcp_migrate_req();
    let node = Node::new();
    let mut a = node.pod("pod-a").start().await;
    live_at(&node.admin(), 0).await;
    let a_envoy = envoy_children_of(a.agent_pid())[0];
    let load = Load::start(node.listener(), "/", 4, 4);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 50).then_some(())
    })
    .await;

    // The successor's image: a binary of another hot-restart version at its Envoy path; or
    // its own release, and the node's segment corrupted.
    let path = node.dir.join("envoy-of-pod-b");
    match why {
        Why::OtherVersion => repoint(&path, &other_version_wrapper(&node.dir.join(""))),
        Why::CorruptSharedMemory => {
            repoint(&path, &envoy_path());
            corrupt_shared_memory(node.ports.base_id);
        }
    }
    // start() returns once its readiness marker exists: its new family is LIVE.
    let mut b = node.pod("pod-b").envoy_path(path.clone()).start().await;
    let starting = b.wait_event("cold_handover", "stage", "starting").await;
    assert_eq!(starting["from_base_id"], node.ports.base_id, "{starting}");
    assert_eq!(starting["to_base_id"], node.ports.base_id + 1, "{starting}");
    assert!(
        starting["predecessor"]
            .as_str()
            .is_some_and(|p| p.starts_with("pod-a-")),
        "{starting}"
    );
    let expected = match why {
        Why::OtherVersion => "11.999",
        Why::CorruptSharedMemory => "shared memory is unusable",
    };
    assert!(
        starting["why"].as_str().unwrap().contains(expected),
        "{starting}"
    );
    // As in one pod: what the new family runs is the real Envoy, which says so of itself.
    repoint(&path, &envoy_path());
    b.wait_event("cold_handover", "stage", "live").await;

    // The predecessor sees the takeover in b's heartbeat, drains and stops its Envoy; the
    // kubelet deletes the old pod, which exits as handed over once its Envoy is gone.
    let handed = a.wait_event("cold_handover", "stage", "handed_over").await;
    assert!(
        handed["successor"]
            .as_str()
            .is_some_and(|s| s.starts_with("pod-b-")),
        "{handed}"
    );
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    let exit = a.events("exit");
    assert!(
        exit.iter().any(|e| e["exit_path"] == "handed_over"),
        "{exit:?}"
    );
    assert!(!process_alive(a_envoy), "pod-a's envoy is gone");

    // Then the successor binds the configured admin port by a hot restart of its family.
    b.wait_event("cold_handover", "stage", "retired").await;
    live_at(&node.admin(), 1).await;
    let info = node.admin().server_info().await.unwrap();
    assert_eq!(
        info.base_id,
        u64::from(node.ports.base_id) + 1,
        "the new family"
    );
    eventually(
        "one envoy in pod-b: epoch 1 (epoch 0 drained)",
        PATIENCE,
        || async { (envoy_children_of(b.agent_pid()).len() == 1).then_some(()) },
    )
    .await;

    serves_on_then_reports(load, &format!("cold handover ({why:?}) across pods")).await;

    // A third pod of the same configuration takes over from the family under the other base
    // id by hot restart: it is still ours.
    let mut c = node.pod("pod-c").start().await;
    live_at(&node.admin(), 2).await;
    let handoff = &c.events_with("handoff", "epoch", "2")[0];
    assert_eq!(
        (&handoff["outcome"], &handoff["kind"]),
        (&"live".into(), &"hot".into()),
        "{handoff}"
    );
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
    c.signal_agent(Signal::SIGTERM);
    assert_eq!(c.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_successor_pod_of_another_hot_restart_version_takes_over_cold_losing_no_request() {
    cold_handover_across_pods(Why::OtherVersion).await;
}

#[tokio::test]
async fn a_successor_pod_takes_over_a_family_with_corrupt_shared_memory_cold_losing_no_request() {
    cold_handover_across_pods(Why::CorruptSharedMemory).await;
}

//! With a control plane: a bootstrap that takes its listeners and clusters from the test kit's
//! ADS server (Envoy's own xDS API), which the tests stop, restart and update. Envoy's default
//! `initial_fetch_timeout` (15 s) is kept unless a test says otherwise: the outages these tests
//! guard against live in the defaults.

use std::time::{Duration, Instant};

use envoy_agent_tests::control_plane::{ControlPlane, LISTENER, Snapshot, ads_bootstrap};
use envoy_agent_tests::{
    AgentProcess, HotRestartPorts, Load, PATIENCE, eventually, free_port, http_get,
};
use nix::sys::signal::Signal;

use crate::agent;
use crate::hot_restart::restarts;

/// Long enough for Envoy to go LIVE through both default initial-fetch timeouts (CDS, then
/// LDS: 30 s) and then some; only a broken test waits this long.
const XDS_PATIENCE: Duration = Duration::from_secs(90);

/// Drain 1s, parent shutdown 2s: a handoff is over (parent gone) about 2s after LIVE.
const FAST: &[&str] = &["--drain-time", "1s", "--parent-shutdown-time", "2s"];

/// A control plane on a fixed port (it is stopped and started again on it), serving one
/// listener `hello` on `listener_port` that answers `body`.
async fn control_plane(listener_port: u16, body: &str) -> ControlPlane {
    ControlPlane::start(
        free_port(),
        Snapshot::direct("1", "hello", listener_port, body),
    )
    .await
}

fn local(port: u16) -> std::net::SocketAddr {
    ([127, 0, 0, 1], port).into()
}

async fn readiness(agent: &AgentProcess) -> envoy_agent_tests::Response {
    http_get(agent.status(), "/healthz/ready").await.unwrap()
}

/// A node proxy on its own ports whose bootstrap names only the control plane `cp`.
async fn node_proxy(cp: &ControlPlane, ports: HotRestartPorts, extra: &[&str]) -> AgentProcess {
    agent()
        .hot_restart_on(ports)
        .bootstrap(ads_bootstrap(ports.admin_port, cp.addr(), None))
        .args(FAST)
        .args(extra)
        .start()
        .await
}

fn ports() -> HotRestartPorts {
    agent().hot_restart().ports().unwrap()
}

/// Waits until the agent has read Envoy's stats and logged that the control plane's config
/// has not been received.
pub(crate) async fn missing_config_seen(agent: &AgentProcess) {
    eventually("the agent to see the missing config", PATIENCE, || async {
        agent
            .events_with("control_plane", "received", "false")
            .into_iter()
            .next()
    })
    .await;
}

/// The control plane is down at start: Envoy goes LIVE through its fetch timeouts with no
/// listener, and readiness (every form of it) says not ready until the config came.
async fn readiness_waits_for_the_config(hot: bool) {
    let listener_port = free_port();
    let mut cp = control_plane(listener_port, "from xds").await;
    cp.stop().await;
    let builder = agent();
    let (builder, admin_port) = if hot {
        let b = builder.hot_restart();
        let port = b.ports().unwrap().admin_port;
        (b, port)
    } else {
        (builder, 0)
    };
    let mut agent = builder
        .bootstrap(ads_bootstrap(admin_port, cp.addr(), None))
        .no_wait_live()
        .start()
        .await;
    eventually(
        "envoy LIVE through its fetch timeouts",
        XDS_PATIENCE,
        || async {
            let info = agent.admin.server_info().await.ok()?;
            (info.state == envoy_agent_proxy::ServerState::Live).then_some(())
        },
    )
    .await;
    // The agent has read its stats: nothing received.
    missing_config_seen(&agent).await;
    let ready = readiness(&agent).await;
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert_eq!(
        ready.body.trim(),
        "not ready: config not received from the control plane (cds: waiting, lds: waiting)"
    );
    assert!(
        !agent.marker_present(),
        "no readiness marker without the config"
    );
    assert_eq!(crate::grpc::health_status(&agent).await, 2, "NOT_SERVING");
    let (code, out, err) = crate::grpc::cli(&agent, &["status"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("ready:              no"), "{out}");
    assert!(
        out.lines().any(|l| l.starts_with("control plane:")
            && l.contains("disconnected")
            && l.contains("waiting for its config")),
        "{out}"
    );
    assert!(
        http_get(local(listener_port), "/").await.is_err(),
        "no listener yet"
    );

    cp.restart().await;
    eventually("ready once the config came", PATIENCE, || async {
        (readiness(&agent).await.status == 200).then_some(())
    })
    .await;
    let answer = http_get(local(listener_port), "/").await.unwrap();
    assert_eq!((answer.status, answer.body.as_str()), (200, "from xds"));
    assert_eq!(crate::grpc::health_status(&agent).await, 1, "SERVING");
    if hot {
        eventually("the readiness marker", PATIENCE, || async {
            agent.marker_present().then_some(())
        })
        .await;
    }
    let (_, out, _) = crate::grpc::cli(&agent, &["status"]).await;
    assert!(out.contains("ready:              yes"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("control plane:") && l.contains("connected, config received")),
        "{out}"
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_sidecar_is_ready_only_once_its_control_plane_sent_its_config() {
    readiness_waits_for_the_config(false).await;
}

#[tokio::test]
async fn a_node_proxy_is_ready_only_once_its_control_plane_sent_its_config() {
    readiness_waits_for_the_config(true).await;
}

#[tokio::test]
async fn a_sighup_while_the_control_plane_is_down_takes_no_listener_away() {
    let ports = ports();
    let mut cp = control_plane(ports.listener_port, "from xds").await;
    let mut agent = node_proxy(&cp, ports, &[]).await;
    let load = Load::start(local(ports.listener_port), "/", 2, 2);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 20).then_some(())
    })
    .await;

    cp.stop().await;
    agent.signal(Signal::SIGHUP);
    agent.wait_event("handoff_waiting", "epoch", "1").await;
    // Longer than Envoy's default fetch timeouts (15 s + 15 s): the new epoch would have gone
    // LIVE with nothing by then, and its parent would have closed the listener.
    let until = Instant::now() + Duration::from_secs(40);
    while Instant::now() < until {
        let ready = readiness(&agent).await;
        assert_eq!(
            ready.status, 200,
            "the serving epoch stays ready: {}",
            ready.body
        );
        assert!(agent.marker_present());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        restarts(&agent, "live"),
        0,
        "no epoch LIVE without its config"
    );
    let (_, out, _) = crate::grpc::cli(&agent, &["status"]).await;
    assert!(
        out.contains("waiting for the control plane: cds, lds"),
        "the status says why: {out}"
    );

    cp.restart().await;
    eventually(
        "a later epoch LIVE with its config",
        XDS_PATIENCE,
        || async { (restarts(&agent, "live") == 1).then_some(()) },
    )
    .await;
    eventually("the parent to exit", PATIENCE, || async {
        (agent.envoys().len() == 1).then_some(())
    })
    .await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(report.ok > 100, "{report:?}");
    assert!(agent.events("wedge").is_empty(), "no wedge");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_restart_that_outlasts_the_handoff_deadline_is_retried_until_the_control_plane_answers() {
    let ports = ports();
    let mut cp = control_plane(ports.listener_port, "from xds").await;
    let mut agent = node_proxy(&cp, ports, &["--handoff-deadline", "6s"]).await;
    let load = Load::start(local(ports.listener_port), "/", 2, 2);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 20).then_some(())
    })
    .await;

    cp.stop().await;
    // A controller's HotRestart hears why it did not happen.
    let (code, _, err) = crate::grpc::cli(&agent, &["restart", "--reason", "test"]).await;
    assert_ne!(code, 0);
    assert!(
        err.contains("waited for its control plane (cds, lds)") && err.contains("retried in"),
        "{err}"
    );
    let wait = agent.wait_event("control_plane_wait", "epoch", "1").await;
    assert_eq!(wait["waiting_for"], "cds, lds", "{wait}");
    let ready = readiness(&agent).await;
    assert_eq!(ready.status, 200, "{}", ready.body);

    // Back only after the deadline: the queued retry converges.
    cp.restart().await;
    eventually("the retry LIVE", XDS_PATIENCE, || async {
        (restarts(&agent, "live") == 1).then_some(())
    })
    .await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(agent.events("wedge").is_empty(), "waiting is no wedge");
    let answer = http_get(local(ports.listener_port), "/").await.unwrap();
    assert_eq!(answer.status, 200);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn an_update_from_the_control_plane_reaches_the_serving_epoch_while_a_restart_waits() {
    let ports = ports();
    let cp = control_plane(ports.listener_port, "from xds").await;
    let mut agent = node_proxy(&cp, ports, &[]).await;
    let load = Load::start(local(ports.listener_port), "/", 2, 2);
    // New streams (the new epoch's) get nothing: it waits, while the serving epoch's stream
    // is served as before.
    cp.hold_new_streams(true);
    agent.signal(Signal::SIGHUP);
    agent.wait_event("handoff_waiting", "epoch", "1").await;

    let second = free_port();
    cp.update(
        Snapshot::direct("2", "hello", ports.listener_port, "from xds").with_direct_listener(
            "second",
            second,
            "second listener",
        ),
    );
    eventually("the serving epoch to take the update", PATIENCE, || async {
        let answer = http_get(local(second), "/").await.ok()?;
        (answer.status == 200 && answer.body == "second listener").then_some(())
    })
    .await;
    assert_eq!(cp.acked(LISTENER).as_deref(), Some("2"));
    assert_eq!(restarts(&agent, "live"), 0, "the restart still waits");

    cp.hold_new_streams(false);
    eventually(
        "the new epoch LIVE with both listeners",
        XDS_PATIENCE,
        || async { (restarts(&agent, "live") == 1).then_some(()) },
    )
    .await;
    eventually("the parent to exit", PATIENCE, || async {
        (agent.envoys().len() == 1).then_some(())
    })
    .await;
    let answer = http_get(local(second), "/").await.unwrap();
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (200, "second listener")
    );
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_successor_pod_never_takes_over_while_the_control_plane_is_down() {
    let node = crate::cross_pod::Node::new();
    let listener_port = node.ports.listener_port;
    let mut cp = control_plane(listener_port, "from xds").await;
    node.dir.write(
        "bootstrap.yaml",
        &ads_bootstrap(node.ports.admin_port, cp.addr(), None),
    );
    let mut a = node.pod("pod-a").start().await;
    let load = Load::start(node.listener(), "/", 2, 2);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 20).then_some(())
    })
    .await;

    cp.stop().await;
    // A short deadline: the successor's first epoch is ended and tried again meanwhile.
    let b = node
        .pod("pod-b")
        .args(&["--handoff-deadline", "6s"])
        .no_wait_live()
        .start()
        .await;
    b.wait_event("handoff_waiting", "epoch", "1").await;
    b.wait_event("control_plane_wait", "epoch", "1").await;
    let until = Instant::now() + Duration::from_secs(20);
    while Instant::now() < until {
        assert!(a.marker_present(), "the predecessor stays ready");
        assert!(!b.marker_present(), "the successor is not ready");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(b.events_with("handoff", "outcome", "live").is_empty());

    cp.restart().await;
    eventually("the successor's marker", XDS_PATIENCE, || async {
        b.marker_present().then_some(())
    })
    .await;
    // At the epoch after the predecessor's newest (it may have restarted meanwhile to get back
    // the admin listener the successor's stopped epoch had taken).
    let epoch = crate::cross_pod::heartbeat(&node.state_dir(), "pod-b")
        .unwrap()
        .newest_epoch;
    assert!(epoch >= 1);
    envoy_agent_tests::live_at(&node.admin(), epoch).await;
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    let mut b = b;
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

/// An agent stalled (SIGSTOP here; starvation or a blocked thread alike) past its handoff
/// deadline while the new epoch went LIVE and its parent exited: on waking, the late deadline
/// must not kill the epoch that now serves alone. It asks again first.
#[tokio::test]
async fn an_agent_stalled_past_the_handoff_deadline_asks_again_before_it_kills() {
    let ports = ports();
    let cp = control_plane(ports.listener_port, "from xds").await;
    let mut agent = node_proxy(&cp, ports, &["--handoff-deadline", "3s"]).await;
    let load = Load::start(local(ports.listener_port), "/", 2, 2);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 20).then_some(())
    })
    .await;
    // The new epoch waits for its config, so the agent can be stopped mid-handoff.
    cp.hold_new_streams(true);
    agent.signal(Signal::SIGHUP);
    agent.wait_event("handoff_waiting", "epoch", "1").await;
    let stopped = Instant::now();
    agent.signal(Signal::SIGSTOP);
    cp.hold_new_streams(false);
    eventually("epoch 1 LIVE (asked of Envoy)", PATIENCE, || async {
        let info = agent.admin.server_info().await.ok()?;
        (info.restart_epoch == 1 && info.state == envoy_agent_proxy::ServerState::Live)
            .then_some(())
    })
    .await;
    // What is waited for here is time itself: the deadline (3 s) and the parent's shutdown
    // (2 s after LIVE) both passed while the agent could not look.
    tokio::time::sleep_until((stopped + Duration::from_secs(6)).into()).await;
    agent.signal(Signal::SIGCONT);

    eventually("the restart LIVE", PATIENCE, || async {
        (restarts(&agent, "live") == 1).then_some(())
    })
    .await;
    assert_eq!(
        restarts(&agent, "timed_out"),
        0,
        "not killed at the late deadline"
    );
    assert!(agent.events("wedge").is_empty(), "no wedge");
    let answer = http_get(local(ports.listener_port), "/").await.unwrap();
    assert_eq!((answer.status, answer.body.as_str()), (200, "from xds"));
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// The soak's ninth finding: the serving epoch killed while its child still starts (here held
/// there by a control plane that is down). The agent stands in for the dead parent's
/// hot-restart sockets, and once the config comes the child asks that stand-in for its listen
/// sockets, waiting on its main thread for the answer: it used to get none and wait until the
/// handoff deadline killed it (60 s with nothing serving). Now it is told there is no socket,
/// binds its own, and serves.
#[tokio::test]
async fn the_serving_epoch_killed_while_its_child_waits_for_config_leaves_the_child_to_serve() {
    use nix::sys::signal::kill;
    use nix::unistd::Pid;
    let ports = ports();
    let mut cp = control_plane(ports.listener_port, "from xds").await;
    let mut agent = node_proxy(&cp, ports, &[]).await;
    let listener = local(ports.listener_port);
    eventually(
        "served from the control plane's config",
        PATIENCE,
        || async {
            let r = http_get(listener, "/").await.ok()?;
            (r.status == 200 && r.body == "from xds").then_some(())
        },
    )
    .await;
    let serving = agent.envoys();
    assert_eq!(serving.len(), 1, "{serving:?}");

    cp.stop().await;
    agent.signal(Signal::SIGHUP);
    agent.wait_event("handoff_waiting", "epoch", "1").await;
    kill(Pid::from_raw(serving[0] as i32), Signal::SIGKILL).unwrap();
    agent.wait_event("stand_in", "epoch", "0").await;

    cp.restart().await;
    eventually("epoch 1 LIVE with its config", XDS_PATIENCE, || async {
        (restarts(&agent, "live") == 1).then_some(())
    })
    .await;
    eventually("served again, by epoch 1", PATIENCE, || async {
        let r = http_get(listener, "/").await.ok()?;
        (r.status == 200 && r.body == "from xds").then_some(())
    })
    .await;
    assert!(
        agent.events("wedge").is_empty(),
        "no wedge: {}",
        agent.stderr()
    );
    assert!(
        agent.events("envoy_crashed").is_empty(),
        "the agent never lost its Envoy"
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

//! The agent's exit paths, each end to end and in both modes (one Envoy as a sidecar; a
//! hot-restart family as a node proxy): the signal or request, what Envoy does, the exit code,
//! the structured exit event, and that no Envoy is left behind.
//!
//! "At once" is shown without timing: the drain duration is set far beyond the test's
//! patience, so an exit within it can only be the immediate path.

use std::time::Duration;

use envoy_agent_tests::{
    AgentBuilder, KeepAlive, PATIENCE, eventually, http_get, http_request, process_alive,
    slow_request,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::agent;

/// Longer than any test waits: reaching it means the immediate path was not taken.
const FOREVER: &str = "1h";

/// Which kind of proxy the agent runs.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mode {
    /// One Envoy (hot restart off).
    Sidecar,
    /// A hot-restart family (`--hot-restart`), as a node proxy runs.
    NodeProxy,
}

/// A builder for the binary under test in `mode`.
pub(crate) fn agent_in(mode: Mode) -> AgentBuilder {
    match mode {
        Mode::Sidecar => agent(),
        Mode::NodeProxy => agent().hot_restart(),
    }
}

/// One test per mode: `name::sidecar` and `name::node_proxy` run `name(Mode)`.
macro_rules! both_modes {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test]
            async fn sidecar() {
                super::$name(super::Mode::Sidecar).await
            }
            #[tokio::test]
            async fn node_proxy() {
                super::$name(super::Mode::NodeProxy).await
            }
        }
    )*};
}
pub(crate) use both_modes;

both_modes!(
    sigterm_drains_gracefully_lets_a_slow_request_complete_then_stops,
    a_second_sigterm_during_the_drain_exits_at_once,
    drain_endpoint_keeps_envoy_serving_and_a_sigterm_continues_its_timeline,
    quitquitquit_exits_at_once_without_draining,
    exit_on_zero_waits_for_the_last_connection_then_exits,
    exit_on_zero_is_bounded_by_the_termination_drain_duration,
    exit_on_zero_requests_does_not_wait_for_an_idle_keep_alive_connection,
    exit_on_zero_requests_waits_for_a_slow_request_then_exits,
    an_unresponsive_envoy_admin_does_not_hold_the_exit,
);

/// Exit-on-zero counting requests, with a deadline far beyond the expected exit but within
/// the test's patience: held until the deadline, the agent would exit by `drain_deadline`.
const REQUESTS_WITH_A_DEADLINE: &[&str] = &[
    "--exit-on-zero",
    "requests",
    "--minimum-drain-duration",
    "200ms",
    "--termination-drain-duration",
    "20s",
];

/// Envoy's `hello` HCM gauges: (active connections, active requests).
async fn hello_gauges(agent: &envoy_agent_tests::AgentProcess) -> Option<(u64, u64)> {
    let stats = agent
        .admin
        .stats("^http\\.hello\\.downstream_(cx|rq)_active$", false)
        .await
        .ok()?;
    let gauge = |name: &str| {
        stats.lines().find_map(|l| {
            l.trim()
                .strip_prefix(name)?
                .strip_prefix(": ")?
                .parse()
                .ok()
        })
    };
    Some((
        gauge("http.hello.downstream_cx_active")?,
        gauge("http.hello.downstream_rq_active")?,
    ))
}

async fn sigterm_drains_gracefully_lets_a_slow_request_complete_then_stops(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--termination-drain-duration", "4s"])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let listener = agent.listener("hello").await;
    let mut client = KeepAlive::connect(listener).await.unwrap();
    assert!(!client.get("/").await.unwrap().connection_close());
    // In flight when the signal comes; answered two seconds later, inside the drain.
    let slow = slow_request(listener, Duration::from_secs(2));
    eventually("the slow request in flight", PATIENCE, || async {
        let stats = agent
            .admin
            .stats("http.hello.downstream_rq_active$", false)
            .await
            .ok()?;
        stats
            .lines()
            .any(|l| l.trim().ends_with(": 1"))
            .then_some(())
    })
    .await;

    agent.signal(Signal::SIGTERM);
    agent.wait_event("drain_accepted", "level", "INFO").await;
    // The status server stays up through the drain; readiness says why it is 503.
    let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
    assert_eq!(ready.status, 503);
    assert!(
        ready.body.starts_with("not ready: draining") && ready.body.contains("SIGTERM"),
        "{}",
        ready.body
    );
    // The drain reached Envoy: the keep-alive client is told to close.
    let response = client.get("/").await.unwrap();
    assert_eq!(response.status, 200);
    assert!(
        response.connection_close(),
        "drained: {:?}",
        response.headers
    );
    let slow = slow.await.unwrap().unwrap();
    assert_eq!(slow.status, 200, "the in-flight request completed");

    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy), "envoy was stopped and reaped");
    agent
        .wait_event("exit", "exit_path", "drain_time_elapsed")
        .await;
}

async fn a_second_sigterm_during_the_drain_exits_at_once(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--termination-drain-duration", FOREVER])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    agent.signal(Signal::SIGTERM);
    agent.wait_event("drain_accepted", "level", "INFO").await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    agent.wait_event("exit", "exit_path", "second_signal").await;
}

async fn drain_endpoint_keeps_envoy_serving_and_a_sigterm_continues_its_timeline(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--termination-drain-duration", "3s"])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let response = http_request(agent.status(), "POST", "/drain")
        .await
        .unwrap();
    assert_eq!((response.status, response.body.as_str()), (200, "OK\n"));

    // The listener still accepts new connections; answers tell clients to close. Past the
    // timeline's deadline (3 s) nothing stops Envoy: a drain request ends drained, serving.
    let listener = agent.listener("hello").await;
    let asked = std::time::Instant::now();
    while asked.elapsed() < Duration::from_secs(4) {
        let response = http_get(listener, "/").await.unwrap();
        assert_eq!(response.status, 200);
        assert!(response.connection_close(), "{:?}", response.headers);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(
        agent.running() && process_alive(envoy),
        "envoy keeps running"
    );

    // The signal continues the same timeline, whose deadline has passed: the stop is at once.
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    agent
        .wait_event("exit", "exit_path", "drain_time_elapsed")
        .await;
}

async fn quitquitquit_exits_at_once_without_draining(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--termination-drain-duration", FOREVER])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let mut client = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    client.get("/").await.unwrap();
    let response = http_request(agent.status(), "POST", "/quitquitquit")
        .await
        .unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    // No drain was asked of Envoy, and the agent never went through a draining state.
    assert!(agent.events("drain_accepted").is_empty(), "no drain");
    assert!(
        agent
            .events_with("agent_state", "state", "draining")
            .is_empty()
            && !agent.events("agent_state").iter().any(|e| e["state"]
                .as_str()
                .is_some_and(|s| s.starts_with("draining"))),
        "never draining: {:?}",
        agent.events("agent_state")
    );
    agent.wait_event("exit", "exit_path", "quitquitquit").await;
}

async fn exit_on_zero_waits_for_the_last_connection_then_exits(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&[
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "200ms",
            "--termination-drain-duration",
            FOREVER,
        ])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let mut client = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    client.get("/").await.unwrap();

    agent.signal(Signal::SIGTERM);
    // Well past the minimum drain, the idle keep-alive connection still holds the agent.
    let counted = agent
        .wait_event("active_connections", "active_connections", "1")
        .await;
    assert_eq!(counted["active_connections"], 1);
    assert!(agent.running(), "one open connection keeps envoy running");
    assert!(process_alive(envoy));

    drop(client);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    let exit = agent
        .wait_event("exit", "exit_path", "zero_connections")
        .await;
    assert_eq!(exit["counting"], "connections", "{exit}");
}

async fn exit_on_zero_is_bounded_by_the_termination_drain_duration(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&[
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "200ms",
            "--termination-drain-duration",
            "2s",
        ])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    // A connection that never closes (and never sends another request).
    let mut client = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    client.get("/").await.unwrap();

    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    agent
        .wait_event("exit", "exit_path", "drain_deadline")
        .await;
    assert!(
        !agent
            .events_with("active_connections", "active_connections", "1")
            .is_empty(),
        "the connection was counted before the deadline"
    );
    assert!(
        client.closed_by_peer(PATIENCE).await,
        "envoy is gone, so is the connection"
    );
}

async fn exit_on_zero_requests_does_not_wait_for_an_idle_keep_alive_connection(mode: Mode) {
    let mut agent = agent_in(mode).args(REQUESTS_WITH_A_DEADLINE).start().await;
    let envoy = agent.envoy_pid();
    // A pooled client: one connection, one request answered, then idle and kept open.
    let mut client = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    assert!(!client.get("/").await.unwrap().connection_close());
    eventually("an idle keep-alive connection", PATIENCE, || async {
        (hello_gauges(&agent).await? == (1, 0)).then_some(())
    })
    .await;

    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    let exit = agent.wait_event("exit", "exit_path", "zero_requests").await;
    assert_eq!(exit["counting"], "requests", "{exit}");
    assert!(
        agent.events("active_connections").is_empty(),
        "connections were never counted"
    );
    // The connection was open all along: Envoy stopping is what closes it.
    assert!(client.closed_by_peer(PATIENCE).await);
}

async fn exit_on_zero_requests_waits_for_a_slow_request_then_exits(mode: Mode) {
    let mut agent = agent_in(mode).args(REQUESTS_WITH_A_DEADLINE).start().await;
    let envoy = agent.envoy_pid();
    let listener = agent.listener("hello").await;
    // In flight when the signal comes; answered five seconds later, inside the drain.
    let slow = slow_request(listener, Duration::from_secs(5));
    eventually("the slow request in flight", PATIENCE, || async {
        (hello_gauges(&agent).await?.1 == 1).then_some(())
    })
    .await;

    agent.signal(Signal::SIGTERM);
    // Past the minimum drain, the request in flight holds the agent.
    let counted = agent
        .wait_event("active_requests", "active_requests", "1")
        .await;
    assert_eq!(counted["active_requests"], 1);
    assert!(agent.running(), "the request in flight keeps envoy running");
    // The status says what it counts, and the count.
    let addr: envoy_agent::grpc::GrpcAddress = agent.grpc.parse().unwrap();
    let mut grpc = envoy_agent::client::connect(&addr, PATIENCE).await.unwrap();
    let status = crate::grpc::get_status(&mut grpc).await;
    let settings = status.settings.as_ref().expect("settings");
    assert_eq!(
        settings.exit_on_zero(),
        envoy_agent_proto::pb::ExitOnZero::Requests
    );
    assert!(!settings.exit_on_zero_active_connections);
    let drain = status.drain.as_ref().expect("draining");
    assert_eq!(
        (drain.active_requests, drain.active_connections),
        (Some(1), None),
        "{drain:?}"
    );

    let slow = slow.await.unwrap().unwrap();
    assert_eq!(slow.status, 200, "the in-flight request completed");
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    let exit = agent.wait_event("exit", "exit_path", "zero_requests").await;
    assert_eq!(exit["counting"], "requests", "{exit}");
}

/// Connections on an excluded listener port (a health or metrics listener's) never hold the
/// drain open: the kernel's count leaves them out as the stats' did.
#[tokio::test]
async fn exit_on_zero_leaves_out_an_excluded_listener_port() {
    let builder = agent_in(Mode::NodeProxy);
    let port = builder.ports().unwrap().listener_port;
    let mut agent = builder
        .args(&[
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "200ms",
            "--termination-drain-duration",
            FOREVER,
            "--exclude-listener-ports",
            &port.to_string(),
        ])
        .start()
        .await;
    let mut client = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    client.get("/").await.unwrap();
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    agent
        .wait_event("exit", "exit_path", "zero_connections")
        .await;
    drop(client);
}

/// An Envoy whose admin never answers cannot be asked to drain: the agent asks again until
/// the deadline, then stops it, and reports the drain as failed (before, it reported
/// `drain_time_elapsed` and 0, a drain that never happened). Exit-on-zero connections needs
/// nothing of Envoy's admin to count (the kernel counts them): with none open it exits at
/// zero.
async fn an_unresponsive_envoy_admin_does_not_hold_the_exit(mode: Mode) {
    for (exit_on_zero, path, code) in [
        (&[][..], "drain_failed", 1),
        (
            &[
                "--exit-on-zero-active-connections",
                "--minimum-drain-duration",
                "0s",
            ][..],
            "zero_connections",
            0,
        ),
    ] {
        let mut agent = agent_in(mode)
            .args(&["--termination-drain-duration", "2s", "--stop-grace", "1s"])
            .args(exit_on_zero)
            .start()
            .await;
        let envoy = agent.envoy_pid();
        // A stopped Envoy accepts admin connections (the kernel does) but never answers.
        kill(Pid::from_raw(envoy as i32), Signal::SIGSTOP).unwrap();
        agent.signal(Signal::SIGTERM);
        assert_eq!(agent.exit().await.code(), Some(code), "{exit_on_zero:?}");
        let exit = agent.wait_event("exit", "exit_path", path).await;
        assert_eq!(exit["code"], code, "{exit}");
        if code == 1 {
            assert!(
                !agent.events("drain_failed").is_empty(),
                "the failed drain is logged"
            );
        }
        assert!(
            !process_alive(envoy),
            "{exit_on_zero:?}: the stopped envoy was killed"
        );
    }
}

/// In node-proxy mode, `envoy-agent drain` over gRPC goes through the agent and the family:
/// health NOT_SERVING, status draining, readiness 503, and no hot restart after it.
#[tokio::test]
async fn node_proxy_drain_over_grpc_is_seen_by_health_status_and_readiness() {
    let mut agent = agent_in(Mode::NodeProxy)
        .args(&["--termination-drain-duration", "1s"])
        .start()
        .await;
    let out = crate::grpc::cli(&agent, &["drain", "--skip-exit"]).await;
    assert_eq!(out.0, 0, "{out:?}");
    let (_, json, _) = crate::grpc::cli(&agent, &["status", "--json"]).await;
    let status: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(status["state"], "draining", "{status}");
    assert_eq!(status["draining"], true, "{status}");
    assert_eq!(status["ready"], false, "{status}");
    assert!(
        status["reason"].as_str().unwrap().contains("gRPC Drain"),
        "{status}"
    );
    let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(
        !agent.marker_present(),
        "the node's readiness marker goes too"
    );
    let health = crate::grpc::health_status(&agent).await;
    assert_eq!(
        health,
        tonic_health::pb::health_check_response::ServingStatus::NotServing as i32
    );
    // The draining listener tells clients to close.
    let response = http_get(agent.listener("hello").await, "/").await.unwrap();
    assert!(response.connection_close(), "{:?}", response.headers);
    let (code, _, err) = crate::grpc::cli(&agent, &["restart"]).await;
    assert_eq!(code, 1, "no hot restart after a drain: {err}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    agent
        .wait_event("exit", "exit_path", "drain_time_elapsed")
        .await;
}

/// In node-proxy mode, SIGTERM with no successor pod: requests under load keep succeeding
/// until the drain ends (the old supervisor SIGTERMed every Envoy at once).
#[tokio::test]
async fn node_proxy_sigterm_without_a_successor_fails_no_request_until_the_drain_ends() {
    let mut agent = agent_in(Mode::NodeProxy)
        .args(&["--termination-drain-duration", "3s"])
        .start()
        .await;
    let listener = agent.listener("hello").await;
    let load = envoy_agent_tests::Load::start(listener, "/", 4, 4);
    tokio::time::sleep(Duration::from_millis(300)).await;
    agent.signal(Signal::SIGTERM);
    agent.wait_event("drain_accepted", "level", "INFO").await;
    // Until the drain ends (the stop begins), every request is answered.
    let stopping = agent.wait_event("stopping", "level", "INFO").await;
    let report = load.stop().await;
    assert!(report.ok > 100, "the load ran: {report:?}");
    assert_eq!(stopping["exit_path"], "drain_time_elapsed");
    let failed_before_stop = report.failed_before(stopping["at_unix_ms"].as_u64().unwrap());
    assert_eq!(failed_before_stop, 0, "failed before the stop: {report:?}");
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn quitquitquit_during_a_drain_exits_at_once() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", FOREVER])
        .start()
        .await;
    agent.signal(Signal::SIGTERM);
    agent.wait_event("drain_accepted", "level", "INFO").await;
    let response = http_request(agent.status(), "POST", "/quitquitquit")
        .await
        .unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(agent.exit().await.code(), Some(0));
    agent.wait_event("exit", "exit_path", "quitquitquit").await;
}

#[tokio::test]
async fn readiness_stays_503_after_a_drain_request_in_both_modes() {
    for mode in [Mode::Sidecar, Mode::NodeProxy] {
        let mut agent = agent_in(mode)
            .args(&["--termination-drain-duration", "1s"])
            .start()
            .await;
        eventually("ready", PATIENCE, || async {
            let r = http_get(agent.status(), "/healthz/ready").await.ok()?;
            (r.status == 200 && r.body == "ready\n").then_some(())
        })
        .await;
        http_request(agent.status(), "POST", "/drain")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let r = http_get(agent.status(), "/healthz/ready").await.unwrap();
        assert_eq!(r.status, 503, "{mode:?}: {}", r.body);
        agent.signal(Signal::SIGTERM);
        assert_eq!(agent.exit().await.code(), Some(0));
    }
}

//! The status server end to end: readiness through Envoy's life, the mutating endpoints'
//! guards (also from a real non-loopback peer), and the merged Prometheus stats.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;

use envoy_agent_tests::{PATIENCE, eventually, http_get, http_request, process_alive};
use nix::sched::{CloneFlags, setns};
use nix::sys::signal::Signal;

use crate::agent;
use crate::exit_paths::{Mode, agent_in, both_modes};

both_modes!(
    readiness_is_503_until_envoy_is_live,
    readiness_is_200_when_live_and_503_while_draining_with_the_server_still_up,
    drain_delay_fails_readiness_before_the_drain_starts,
    mutating_endpoints_answer_405_to_get,
    prometheus_merges_agent_and_envoy_stats,
);

async fn readiness_is_503_until_envoy_is_live(mode: Mode) {
    let xds = envoy_agent_tests::silent_server().await;
    let builder = agent_in(mode);
    let (admin, listener) = builder
        .ports()
        .map_or((0, 0), |p| (p.admin_port, p.listener_port));
    let mut agent = builder
        // Clusters from an xDS server that never answers: Envoy stays initializing.
        .bootstrap(envoy_agent_tests::bootstrap_waiting_for_xds(
            admin, listener, "x", xds,
        ))
        .args(&["--termination-drain-duration", "0s"])
        .no_wait_live()
        .start()
        .await;
    let info = eventually("envoy's admin to answer", PATIENCE, || async {
        agent.admin.server_info().await.ok()
    })
    .await;
    assert_ne!(info.state, envoy_agent_proxy::ServerState::Live);
    let response = http_get(agent.status(), "/healthz/ready").await.unwrap();
    assert_eq!(response.status, 503);
    assert!(response.body.contains("starting"), "{}", response.body);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

async fn readiness_is_200_when_live_and_503_while_draining_with_the_server_still_up(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--termination-drain-duration", "1h"])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let response = eventually("readiness 200", PATIENCE, || async {
        http_get(agent.status(), "/healthz/ready")
            .await
            .ok()
            .filter(|r| r.status == 200)
    })
    .await;
    assert_eq!(response.body, "ready\n");

    agent.signal(Signal::SIGTERM);
    // With hot restart, the agent first asks whether a successor takes over (not ready
    // already, and saying so); then it drains.
    let before = std::sync::Mutex::new(Vec::new());
    let response = eventually("readiness 503 during the drain", PATIENCE, || async {
        let r = http_get(agent.status(), "/healthz/ready")
            .await
            .ok()
            .filter(|r| r.status == 503)?;
        if r.body.starts_with("not ready: draining") {
            return Some(r);
        }
        before.lock().unwrap().push(r.body);
        None
    })
    .await;
    for body in before.into_inner().unwrap() {
        assert!(
            body.starts_with("not ready: stopping") && body.contains("successor"),
            "{body}"
        );
    }
    assert!(response.body.contains("SIGTERM"), "{}", response.body);
    assert_eq!(response.body.lines().count(), 1);

    // Still serving through the drain: metrics and /quitquitquit.
    let metrics = http_get(agent.status(), "/stats/prometheus").await.unwrap();
    assert!(
        metrics.body.contains("envoy_agent_draining 1"),
        "{}",
        metrics.body
    );
    let response = http_request(agent.status(), "POST", "/quitquitquit")
        .await
        .unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
}

async fn drain_delay_fails_readiness_before_the_drain_starts(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--drain-delay", "1h", "--termination-drain-duration", "0s"])
        .start()
        .await;
    let listener = agent.listener("hello").await;
    agent.signal(Signal::SIGTERM);
    let response = eventually("readiness 503 during the delay", PATIENCE, || async {
        http_get(agent.status(), "/healthz/ready")
            .await
            .ok()
            .filter(|r| r.status == 503 && r.body.contains("about to drain"))
    })
    .await;
    assert!(
        response.body.contains("about to drain"),
        "{}",
        response.body
    );
    // Envoy is not draining yet: a keep-alive client is not told to close.
    let mut client = envoy_agent_tests::KeepAlive::connect(listener)
        .await
        .unwrap();
    let response = client.get("/").await.unwrap();
    assert!(!response.connection_close(), "{:?}", response.headers);
    // A second signal ends the delay at once.
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

async fn mutating_endpoints_answer_405_to_get(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--termination-drain-duration", "0s"])
        .start()
        .await;
    for path in ["/drain", "/quitquitquit"] {
        let response = http_get(agent.status(), path).await.unwrap();
        assert_eq!(response.status, 405, "GET {path}");
    }
    assert!(agent.running());
    // The GETs changed nothing: still ready, no drain, no stop.
    let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
    assert_eq!(
        (ready.status, ready.body.as_str()),
        (200, "ready\n"),
        "{ready:?}"
    );
    assert!(agent.events("drain_accepted").is_empty());
    assert!(agent.events("stopping").is_empty());
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

async fn prometheus_merges_agent_and_envoy_stats(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--termination-drain-duration", "0s"])
        .start()
        .await;
    let response = http_get(agent.status(), "/stats/prometheus").await.unwrap();
    assert_eq!(response.status, 200);
    assert!(
        response
            .body
            .contains("envoy_agent_state{state=\"live\"} 1"),
        "{}",
        response.body
    );
    assert!(response.body.contains("envoy_agent_envoy_stats_up 1"));
    assert!(
        response.body.contains("envoy_server_live"),
        "envoy's own stats follow"
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// A blocking HTTP/1.1 request from inside the network namespace of process `pid`.
fn request_in_netns(pid: u32, addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    std::thread::spawn(move || {
        // setns applies to this thread only: the test's other threads stay where they are.
        let netns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
        setns(netns.as_fd(), CloneFlags::CLONE_NEWNET).unwrap();
        let mut stream = TcpStream::connect_timeout(&addr, PATIENCE).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).unwrap();
        let status = raw
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap();
        let body = raw
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap();
        (status, body)
    })
    .join()
    .unwrap()
}

/// The agent, its status server on 0.0.0.0, in a network namespace of its own with a second,
/// non-loopback address (10.99.0.1 on a veth interface): a real non-loopback peer, on no
/// network but the test's own.
#[tokio::test]
async fn mutating_endpoints_refuse_a_non_loopback_peer() {
    let mut agent = agent()
        .wrapper(envoy_agent_tests::PRIVATE_NETNS)
        .args(&[
            "--status-address",
            "0.0.0.0:0",
            "--termination-drain-duration",
            "1h",
        ])
        .no_wait_live()
        .start()
        .await;
    let port = agent.status().port();
    let remote: SocketAddr = format!("{}:{port}", envoy_agent_tests::PRIVATE_NETNS_ADDR)
        .parse()
        .unwrap();
    let local: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let pid = agent.pid();

    for path in ["/drain", "/quitquitquit"] {
        let (status, body) =
            tokio::task::spawn_blocking(move || request_in_netns(pid, remote, "POST", path))
                .await
                .unwrap();
        assert_eq!(status, 403, "POST {path} from 10.99.0.1: {body}");
    }
    // Readiness is open to anyone.
    let (status, _) =
        tokio::task::spawn_blocking(move || request_in_netns(pid, remote, "GET", "/healthz/ready"))
            .await
            .unwrap();
    assert!(status == 200 || status == 503, "{status}");
    // Controls resolve once applied: a refused request that had acted would show already.
    assert!(agent.running(), "a refused /quitquitquit does nothing");
    assert!(agent.events("stopping").is_empty() && agent.events("drain_accepted").is_empty());
    let (_, body) =
        tokio::task::spawn_blocking(move || request_in_netns(pid, local, "GET", "/healthz/ready"))
            .await
            .unwrap();
    assert!(
        !body.contains("draining") && !body.contains("exiting"),
        "neither draining nor exiting: {body}"
    );

    // The same request from loopback is obeyed.
    let (status, _) =
        tokio::task::spawn_blocking(move || request_in_netns(pid, local, "POST", "/quitquitquit"))
            .await
            .unwrap();
    assert_eq!(status, 200);
    assert_eq!(agent.exit().await.code(), Some(0));
}

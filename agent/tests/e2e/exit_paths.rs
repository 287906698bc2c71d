//! The agent's exit paths, each end to end: the signal or POST, what Envoy does, the exit code,
//! and that no Envoy is left behind.
//!
//! "At once" is shown without timing: the drain duration is set far beyond the test's
//! patience, so an exit within it can only be the immediate path.

use std::time::Duration;

use envoy_agent_tests::{KeepAlive, PATIENCE, eventually, http_get, http_request, process_alive};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::agent;

/// Longer than any test waits: reaching it means the immediate path was not taken.
const FOREVER: &str = "1h";

#[tokio::test]
async fn sigterm_drains_waits_the_termination_drain_duration_then_stops() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", "2s"])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let mut client = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    assert!(!client.get("/").await.unwrap().connection_close());

    agent.signal(Signal::SIGTERM);
    eventually("envoy to accept the drain", PATIENCE, || async {
        agent
            .stderr()
            .contains("envoy is draining its listeners")
            .then_some(())
    })
    .await;
    // The drain reached Envoy: the keep-alive client is told to close.
    let response = client.get("/").await.unwrap();
    assert_eq!(response.status, 200);
    assert!(
        response.connection_close(),
        "drained: {:?}",
        response.headers
    );

    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy), "envoy was stopped and reaped");
    let stderr = agent.stderr();
    assert!(
        stderr.contains("termination drain duration elapsed"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_second_sigterm_during_the_drain_exits_at_once() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", FOREVER])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    agent.signal(Signal::SIGTERM);
    eventually("the drain to start", PATIENCE, || async {
        agent
            .stderr()
            .contains("envoy is draining its listeners")
            .then_some(())
    })
    .await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    agent.wait_event("exit", "exit_path", "second_signal").await;
}

#[tokio::test]
async fn drain_endpoint_keeps_envoy_serving_and_the_next_sigterm_exits_at_once() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", FOREVER])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let response = http_request(agent.status(), "POST", "/drain")
        .await
        .unwrap();
    assert_eq!((response.status, response.body.as_str()), (200, "OK\n"));

    // The listener still accepts new connections; answers tell clients to close.
    let listener = agent.listener("hello").await;
    for _ in 0..3 {
        let response = http_get(listener, "/").await.unwrap();
        assert_eq!(response.status, 200);
        assert!(response.connection_close(), "{:?}", response.headers);
    }
    assert!(
        agent.running() && process_alive(envoy),
        "envoy keeps running"
    );

    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    agent
        .wait_event("exit", "exit_path", "signal_after_drain")
        .await;
}

#[tokio::test]
async fn quitquitquit_exits_at_once_without_draining() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", FOREVER])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let response = http_request(agent.status(), "POST", "/quitquitquit")
        .await
        .unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    let stderr = agent.stderr();
    assert!(
        !stderr.contains("draining envoy listeners"),
        "no drain: {stderr}"
    );
}

#[tokio::test]
async fn exit_on_zero_waits_for_the_last_connection_then_exits() {
    let mut agent = agent()
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
    eventually("the agent to count a held connection", PATIENCE, || async {
        agent.stderr().contains("waiting for zero").then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(agent.running(), "one open connection keeps envoy running");
    assert!(process_alive(envoy));

    drop(client);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
    assert!(agent.stderr().contains("no active connections left"));
}

#[tokio::test]
async fn exit_on_zero_is_bounded_by_the_termination_drain_duration() {
    let mut agent = agent()
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
    let stderr = agent.stderr();
    assert!(
        stderr.contains("connections remained at the termination drain deadline"),
        "{stderr}"
    );
    assert!(
        client.closed_by_peer(PATIENCE).await,
        "envoy is gone, so is the connection"
    );
}

#[tokio::test]
async fn an_unresponsive_envoy_admin_does_not_hold_the_exit() {
    for mode in [
        &[][..],
        &[
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "0s",
        ][..],
    ] {
        let mut agent = agent()
            .args(&["--termination-drain-duration", "2s", "--stop-grace", "1s"])
            .args(mode)
            .start()
            .await;
        let envoy = agent.envoy_pid();
        // A stopped Envoy accepts admin connections (the kernel does) but never answers.
        kill(Pid::from_raw(envoy as i32), Signal::SIGSTOP).unwrap();
        agent.signal(Signal::SIGTERM);
        assert_eq!(agent.exit().await.code(), Some(0), "{mode:?}");
        assert!(
            !process_alive(envoy),
            "{mode:?}: the stopped envoy was killed"
        );
        let stderr = agent.stderr();
        assert!(
            stderr.contains("ignored SIGTERM; sending SIGKILL"),
            "{mode:?}: {stderr}"
        );
    }
}

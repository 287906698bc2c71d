//! The termination message (issue 38, item 6): at exit the agent writes how it ended to the
//! container's termination-message file, where `kubectl describe pod` shows it. End to end:
//! a path given is created and holds the exit path and code and the shutdown's cause. The
//! text, its 4096-byte cut and the default path's rule (written only if the kubelet created
//! it) are unit-tested in `agent/src/termination.rs`.

use envoy_agent_tests::{KeepAlive, PATIENCE, eventually};
use nix::sys::signal::Signal;

use crate::drain_status::status;
use crate::exit_paths::{Mode, agent_in, both_modes};

both_modes!(a_sigterm_drain_is_told_in_the_termination_message);

async fn a_sigterm_drain_is_told_in_the_termination_message(mode: Mode) {
    let builder = agent_in(mode);
    let path = builder.dir().join("termination-log");
    assert!(!path.exists());
    let path_arg = path.display().to_string();
    let mut agent = builder
        .args(&[
            "--termination-drain-duration",
            "1s",
            "--termination-message-path",
            &path_arg,
        ])
        .start()
        .await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    let message = std::fs::read_to_string(&path).expect("the termination message");
    let mut lines = message.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("envoy-agent exited 0: drain_time_elapsed "),
        "{message}"
    );
    let took = lines.next().unwrap();
    assert!(
        took.starts_with("shutdown took ") && took.ends_with(" from SIGTERM"),
        "{message}"
    );
    assert!(message.len() <= 4096);
}

both_modes!(a_stop_at_zero_connections_says_nothing_was_left);

/// At `zero_connections` the message says nothing was left, not the last reading of what each
/// listener held (a second old at best: at 19,000 connections it once said "still open:
/// ingress: 18551 connections" after every client had closed).
async fn a_stop_at_zero_connections_says_nothing_was_left(mode: Mode) {
    let builder = agent_in(mode);
    let path = builder.dir().join("termination-log");
    let path_arg = path.display().to_string();
    let mut agent = builder
        .args(&[
            "--exit-on-zero",
            "connections",
            "--minimum-drain-duration",
            "200ms",
            "--termination-drain-duration",
            "5m",
            "--termination-message-path",
            &path_arg,
        ])
        .start()
        .await;
    let mut client = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    client.get("/").await.unwrap();
    agent.signal(Signal::SIGTERM);
    // The status has read what the listener holds: the connection.
    eventually("the connection in the drain status", PATIENCE, || async {
        let drain = status(&agent).await.drain?;
        drain
            .listeners
            .iter()
            .any(|l| l.name == "hello" && l.active_connections == 1)
            .then_some(())
    })
    .await;
    drop(client);
    assert_eq!(agent.exit().await.code(), Some(0));
    let message = std::fs::read_to_string(&path).expect("the termination message");
    assert!(
        message.starts_with("envoy-agent exited 0: zero_connections "),
        "{message}"
    );
    assert!(message.contains("\nstill open: nothing\n"), "{message}");
}

both_modes!(a_drain_that_ends_at_its_deadline_names_what_was_still_open);

/// Issue 51: without exit-on-zero too, a drain that ends at its deadline names, per listener,
/// what was still open (here an idle keep-alive connection the drain could not close in time).
async fn a_drain_that_ends_at_its_deadline_names_what_was_still_open(mode: Mode) {
    let builder = agent_in(mode);
    let path = builder.dir().join("termination-log");
    let path_arg = path.display().to_string();
    let mut agent = builder
        .args(&[
            "--termination-drain-duration",
            "3s",
            "--termination-message-path",
            &path_arg,
        ])
        .start()
        .await;
    let mut client = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    assert_eq!(client.get("/").await.unwrap().status, 200);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    let stopping = agent
        .wait_event("stopping", "exit_path", "drain_time_elapsed")
        .await;
    let message = std::fs::read_to_string(&path).expect("the termination message");
    assert!(
        message.contains("still open: hello: 1 connections"),
        "{message}\n{stopping}"
    );
    drop(client);
}

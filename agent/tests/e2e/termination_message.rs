//! The termination message (issue 38, item 6): at exit the agent writes how it ended to the
//! container's termination-message file, where `kubectl describe pod` shows it. End to end:
//! a path given is created and holds the exit path and code and the shutdown's cause. The
//! text, its 4096-byte cut and the default path's rule (written only if the kubelet created
//! it) are unit-tested in `agent/src/termination.rs`.

use nix::sys::signal::Signal;

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

//! A JSON log line names the task it came from (issue 52, item 4), end to end: the span of the
//! long-lived task that logged it reaches the agent's log as `span`, with its fields.
//!
//! - a sidecar: the agent actor's lines carry `agent` (with the mode), and its Envoy's
//!   watcher's carry `envoy` with that Envoy's epoch and pid;
//! - a node proxy: the supervisor's lines carry `supervisor` with the family's base id.

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::exit_paths::{Mode, agent_in, both_modes};

/// The span a log line names: its task, and that task's fields.
fn span(line: &Value) -> &Value {
    line.get("span")
        .unwrap_or_else(|| panic!("no span on the line: {line}"))
}

both_modes!(a_json_log_line_names_its_task_and_epoch);

async fn a_json_log_line_names_its_task_and_epoch(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--termination-drain-duration", "1s"])
        .start()
        .await;
    let live = agent.wait_event("epoch_state", "state", "live").await;
    let pid = live["pid"].clone();
    match mode {
        Mode::Sidecar => {
            // The Envoy's own watcher saw it LIVE: its span names that Envoy.
            let envoy = span(&live);
            assert_eq!(envoy["name"], "envoy", "{live}");
            assert_eq!(envoy["pid"], pid, "{live}");
            assert_eq!(envoy["epoch"], 0, "{live}");
        }
        Mode::NodeProxy => {
            let base_id = agent.ports.unwrap().base_id;
            let supervisor = span(&live);
            assert_eq!(supervisor["name"], "supervisor", "{live}");
            assert_eq!(supervisor["base_id"], base_id, "{live}");
        }
    }
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    // The agent actor's own lines name it, in both modes.
    let states = agent.events("agent_state");
    assert!(!states.is_empty());
    let expected = match mode {
        Mode::Sidecar => "sidecar",
        Mode::NodeProxy => "node",
    };
    for state in &states {
        assert_eq!(span(state)["name"], "agent", "{state}");
        assert_eq!(span(state)["mode"], expected, "{state}");
    }
}

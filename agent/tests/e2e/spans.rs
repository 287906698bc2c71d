//! A JSON log line names the task it came from (issue 52, item 4), end to end: the spans the
//! agent's long-lived tasks run in reach its log as `span` (the innermost) and `spans` (the
//! whole path, outermost first).
//!
//! - a sidecar: the agent actor's lines carry `agent` (with the mode), and what is logged
//!   while its Envoy runs carries `envoy` with that Envoy's epoch and pid;
//! - a node proxy: the supervisor's lines carry `supervisor` with the family's base id.

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::exit_paths::{Mode, agent_in, both_modes};

/// The spans of a log line, outermost first.
fn spans(line: &Value) -> Vec<Value> {
    line.get("spans")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// The span named `name` on a log line's path, if any.
fn span(line: &Value, name: &str) -> Option<Value> {
    spans(line)
        .into_iter()
        .find(|s| s.get("name").and_then(Value::as_str) == Some(name))
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
            let envoy = span(&live, "envoy").unwrap_or_else(|| panic!("no envoy span: {live}"));
            assert_eq!(envoy["pid"], pid, "{live}");
            assert_eq!(envoy["epoch"], 0, "{live}");
            // The innermost span is the task that logged it; the agent's is around it.
            assert_eq!(live["span"]["name"], "envoy", "{live}");
            let outer = span(&live, "agent").unwrap_or_else(|| panic!("no agent span: {live}"));
            assert_eq!(outer["mode"], "sidecar", "{live}");
        }
        Mode::NodeProxy => {
            let base_id = agent.ports.unwrap().base_id;
            let supervisor =
                span(&live, "supervisor").unwrap_or_else(|| panic!("no supervisor span: {live}"));
            assert_eq!(supervisor["base_id"], base_id, "{live}");
        }
    }
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    // The agent actor's own lines name it, in both modes.
    let states = agent.events("agent_state");
    assert!(!states.is_empty());
    for state in &states {
        let outer = span(state, "agent").unwrap_or_else(|| panic!("no agent span: {state}"));
        let expected = match mode {
            Mode::Sidecar => "sidecar",
            Mode::NodeProxy => "node",
        };
        assert_eq!(outer["mode"], expected, "{state}");
    }
}

//! Heartbeat files in the node's shared state dir (`heartbeat-<identity>.json`, written by
//! other pods' supervisors, so outside input): `envoy_agent_hotrestart::node::parse_bytes`.
//! The reader caps a file at `node::MAX_SIZE` bytes before parsing; the fuzzer's inputs stay
//! far below it (`-max_len`).
//!
//! Besides "no panic": an accepted heartbeat re-serialized (as `node::write` does) parses back
//! to the same value.
#![no_main]

use envoy_agent_hotrestart::node::{self, FORMAT, NodeState};
use libfuzzer_sys::fuzz_target;

/// The name the seeds' identity (`envoy-node-abcde`) maps to.
const NAME: &str = "heartbeat-envoy-node-abcde.json";

fuzz_target!(|data: &[u8]| {
    if let Ok(heartbeat) = node::parse_bytes(data, NAME) {
        assert_eq!(heartbeat.format, FORMAT);
        assert_ne!(heartbeat.state, NodeState::Unknown);
        let bytes = serde_json::to_vec(&heartbeat).expect("a heartbeat serializes");
        assert_eq!(node::parse_bytes(&bytes, NAME), Ok(heartbeat));
    }
});

//! Datagrams a child Envoy sends to its dead parent's hot-restart socket, which the agent's
//! stand-in reads (any process in the network namespace can send them): an 8-byte big-endian
//! length, then a `HotRestartMessage`. `envoy_agent_hotrestart::absorber::is_stats_request`.
//!
//! Besides "no panic": a datagram taken for a stats request has the frame and a `request`
//! (field 1, length-delimited) first.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if envoy_agent_hotrestart::absorber::is_stats_request(data) {
        assert!(data.len() >= 10 && data[8] == 0x0a, "{data:02x?}");
    }
});

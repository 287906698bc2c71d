//! Envoy's admin answer to `GET /stats?filter=downstream_cx_active$&usedonly` (text), summed
//! by the exit-on-zero-active-connections wait: `envoy_agent_drain::sum_active_connections`,
//! with the status and Prometheus ports excluded as the agent does. The admin client turns the
//! body into a `String` with `String::from_utf8`, so only UTF-8 reaches the counter.
#![no_main]

use envoy_agent_drain::{Exclusions, sum_active_connections};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let exclusions = Exclusions::with_ports([15021, 15090]);
    let _ = sum_active_connections(text, &exclusions);
});

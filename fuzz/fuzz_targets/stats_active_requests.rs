//! Envoy's admin answer to `GET /stats?filter=<ACTIVE_REQUESTS_FILTER>` (text, not `usedonly`),
//! summed by exit-on-zero counting requests: `envoy_agent_drain::sum_active_requests`, with the
//! status and Prometheus ports excluded as the agent does. It splits `<listener>.http.<prefix>`
//! names where both may hold dots and subtracts gauges, so it has more to get wrong than the
//! connection count. The admin client turns the body into a `String` with
//! `String::from_utf8`, so only UTF-8 reaches the counter.
#![no_main]

use envoy_agent_drain::{Exclusions, sum_active_requests};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let exclusions = Exclusions::with_ports([15021, 15090]);
    let _ = sum_active_requests(text, &exclusions);
});

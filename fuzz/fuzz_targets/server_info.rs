//! Envoy's admin answer to `GET /server_info` (JSON; the admin address may be anything the
//! bootstrap or `--admin-address` names): `envoy_agent_proxy::ServerInfo::parse`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = envoy_agent_proxy::ServerInfo::parse(data);
});

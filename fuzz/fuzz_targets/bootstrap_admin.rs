//! The bootstrap's admin section, YAML or JSON (any file the operator points `-c` at):
//! `envoy_agent_proxy::bootstrap::admin_address_from_str` (serde_yaml over unsafe-libyaml).
//! The caller reads the file with `read_to_string`, so only UTF-8 reaches the parser.
//!
//! Besides "no panic": an accepted TCP address is never a wildcard (it is reached on
//! loopback); a pipe's path is never empty.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(address) =
        envoy_agent_proxy::bootstrap::admin_address_from_str(Path::new("fuzz.yaml"), text)
    {
        match &address {
            envoy_agent_proxy::admin::Address::Tcp(tcp) => {
                assert!(!tcp.ip().is_unspecified(), "{address} from {text:?}")
            }
            envoy_agent_proxy::admin::Address::Unix(path) => {
                assert!(!path.as_os_str().is_empty(), "{address} from {text:?}")
            }
        }
    }
});

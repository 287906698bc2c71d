//! The hot-restart supervisor (restart epochs, single-flight handoffs, watchdogs).
//!
//! Not built yet: it arrives with the hot-restart issue. Until then `envoy-agent run` starts
//! Envoy with `--disable-hot-restart`, and this crate holds nothing.

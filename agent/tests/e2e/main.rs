//! End-to-end: the real `envoy-agent` binary running the real Envoy, driven with real signals
//! and real HTTP. One test binary, a module per area.

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used)]

mod admin_view;
mod api;
mod app;
mod app_health;
mod channel;
mod clients;
mod cold_handover;
mod container;
mod control_plane;
mod crash_recovery;
mod cross_pod;
mod day_one;
mod drain_status;
mod exit_paths;
mod grpc;
mod handoff_faults;
mod hot_restart;
mod hung;
mod leftovers;
mod manifests;
mod merged_metrics;
mod outbound;
mod preflight_cache;
mod releases;
mod run;
mod scrape;
mod security;
mod shipped;
mod shutdown_budget;
mod shutdown_timeline;
mod spans;
mod stalled_log;
mod status;
mod systemd;
mod telemetry;
mod termination_message;
mod told;
mod upgrade;
mod wait;

use envoy_agent_tests::{AgentBuilder, AgentProcess};

/// The binary under test.
pub(crate) const AGENT: &str = env!("CARGO_BIN_EXE_envoy-agent");

/// A builder for the binary under test.
pub(crate) fn agent() -> AgentBuilder {
    AgentProcess::builder(AGENT)
}

//! The supervisor's instruments (OpenTelemetry API). Nil-safe: [`SupervisorMetrics::disabled`]
//! records nothing and costs a branch, so the supervisor runs unchanged without telemetry.
//!
//! They exist for post-mortems of wedged or crashed proxy pods: the epoch gauge and the handoff
//! histogram show how far a handoff got and how long it took, the wedge counter says why the
//! watchdog acted, and the exit counter tells expected drains from crashes.
//!
//! Attribute names follow the OpenTelemetry semantic conventions: namespaced under
//! `envoy_agent.`, or `error.type` where the value is a kind of failure. The histogram has
//! explicit bucket boundaries in its unit, seconds ([`HANDOFF_DURATION_BUCKETS`]).
//!
//! Each instrument, its unit, its attributes ([`HANDOFF_OUTCOME`], [`HANDOFF_KIND`],
//! [`WEDGE_REASON`], [`EXIT_KIND`]) with their values, and when it is recorded, is tabled once,
//! with the agent's own, in `docs/observability.md#metrics-otlp-push`.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter};

/// How an Envoy process ended, for the exit counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    /// A parent terminated by its child after a handoff (exit 0): expected.
    DrainedParent,
    /// Exited with a non-zero code.
    Crash,
    /// Killed by a signal.
    Signal,
    /// Exited 0 otherwise.
    Clean,
}

impl ExitKind {
    fn as_str(self) -> &'static str {
        match self {
            ExitKind::DrainedParent => "drained_parent",
            ExitKind::Crash => "crash",
            ExitKind::Signal => "signal",
            ExitKind::Clean => "clean",
        }
    }
}

/// Bucket boundaries of `envoy_agent.hot_restart.handoff.duration`, in seconds: a handoff
/// takes a few hundred milliseconds (pre-flight and spawn to LIVE); a queued one waits up to
/// the parent shutdown time (60 s by default); one that times out, the handoff deadline.
pub const HANDOFF_DURATION_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// The handoff histogram's outcome attribute.
pub const HANDOFF_OUTCOME: &str = "envoy_agent.handoff.outcome";
/// The handoff's kind: `hot` (hot restart) or `cold` (cold handover).
pub const HANDOFF_KIND: &str = "envoy_agent.handoff.kind";
/// The wedge counter's reason attribute: a kind of failure.
pub const WEDGE_REASON: &str = "error.type";
/// The Envoy exit counter's kind attribute (not all kinds are failures).
pub const EXIT_KIND: &str = "envoy_agent.envoy.exit_kind";

#[derive(Debug)]
struct Instruments {
    epoch: Gauge<u64>,
    handoff: Histogram<f64>,
    wedges: Counter<u64>,
    exits: Counter<u64>,
    rejected: Counter<u64>,
    control_plane_waits: Counter<u64>,
}

/// The supervisor's instruments, or none.
#[derive(Debug, Clone, Default)]
pub struct SupervisorMetrics {
    inner: Option<Arc<Instruments>>,
}

impl SupervisorMetrics {
    /// Records nothing.
    pub fn disabled() -> Self {
        SupervisorMetrics::default()
    }

    /// Registers the instruments on `meter`.
    pub fn new(meter: &Meter) -> Self {
        let instruments = Instruments {
            epoch: meter
                .u64_gauge("envoy_agent.hot_restart.epoch")
                .with_description("The newest LIVE restart epoch.")
                .with_unit("{epoch}")
                .build(),
            handoff: meter
                .f64_histogram("envoy_agent.hot_restart.handoff.duration")
                .with_description("Hot restart trigger to outcome.")
                .with_unit("s")
                .with_boundaries(HANDOFF_DURATION_BUCKETS.to_vec())
                .build(),
            wedges: meter
                .u64_counter("envoy_agent.hot_restart.wedges")
                .with_description("Wedges the watchdogs saw, by reason.")
                .with_unit("{wedge}")
                .build(),
            exits: meter
                .u64_counter("envoy_agent.envoy.exits")
                .with_description("Envoy process exits, by kind.")
                .with_unit("{exit}")
                .build(),
            rejected: meter
                .u64_counter("envoy_agent.config.rejected")
                .with_description("Hot restarts rejected by the pre-flight checks.")
                .with_unit("{config}")
                .build(),
            control_plane_waits: meter
                .u64_counter("envoy_agent.hot_restart.control_plane_waits")
                .with_description(
                    "New epochs stopped at the handoff deadline while they waited for their control plane (the restart is retried).",
                )
                .with_unit("{handoff}")
                .build(),
        };
        SupervisorMetrics {
            inner: Some(Arc::new(instruments)),
        }
    }

    /// The newest LIVE epoch.
    pub fn epoch(&self, epoch: u32) {
        if let Some(i) = &self.inner {
            i.epoch.record(u64::from(epoch), &[]);
        }
    }

    /// A hot restart ended with `outcome` after `duration`.
    pub fn handoff(&self, duration: Duration, outcome: &'static str, kind: &'static str) {
        if let Some(i) = &self.inner {
            i.handoff.record(
                duration.as_secs_f64(),
                &[
                    KeyValue::new(HANDOFF_OUTCOME, outcome),
                    KeyValue::new(HANDOFF_KIND, kind),
                ],
            );
        }
    }

    /// A wedge.
    pub fn wedge(&self, reason: &'static str) {
        if let Some(i) = &self.inner {
            i.wedges.add(1, &[KeyValue::new(WEDGE_REASON, reason)]);
        }
    }

    /// An Envoy process exited.
    pub fn exit(&self, kind: ExitKind) {
        if let Some(i) = &self.inner {
            i.exits.add(1, &[KeyValue::new(EXIT_KIND, kind.as_str())]);
        }
    }

    /// A new epoch waited for its control plane for the whole handoff deadline.
    pub fn control_plane_wait(&self) {
        if let Some(i) = &self.inner {
            i.control_plane_waits.add(1, &[]);
        }
    }

    /// A config was rejected before a hot restart.
    pub fn config_rejected(&self) {
        if let Some(i) = &self.inner {
            i.rejected.add(1, &[]);
        }
    }
}

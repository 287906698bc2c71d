//! Metrics pushed over OTLP/gRPC, and the agent's own instruments.
//!
//! # Pipeline
//!
//! Push only, no scrape endpoint: `--otlp-endpoint` (else `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`,
//! else `OTEL_EXPORTER_OTLP_ENDPOINT`) names a collector; without one nothing is built and every
//! instrument is a no-op. The SDK's periodic reader exports from its own thread with a bounded
//! timeout, so a collector that is down or slow never blocks the agent; its tonic client is
//! built inside the agent's runtime, which it needs. On exit, [`Telemetry::shutdown`] flushes
//! the last values, bounded, so a post-mortem has them.
//!
//! # Instruments
//!
//! The supervisor's are in `envoy_agent_hotrestart::metrics`. The agent's:
//!
//! | instrument | kind | unit | attributes |
//! |---|---|---|---|
//! | `envoy_agent.drain.duration` | histogram | `s` | `exit_path` |
//! | `envoy_agent.exits` | counter | `{exit}` | `exit_path` |

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, MeterProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};

/// Bound on one export.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on the final flush at exit.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The collector's endpoint: the flag, else the standard environment variables.
pub fn endpoint(flag: Option<&str>) -> Option<String> {
    flag.map(str::to_owned)
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT").ok())
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            if e.contains("://") {
                e
            } else {
                format!("http://{e}")
            }
        })
}

/// Why the pipeline could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot export metrics to {endpoint}: {message}")]
pub struct TelemetryError {
    /// The endpoint.
    pub endpoint: String,
    /// Why.
    pub message: String,
}

/// The metrics pipeline.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkMeterProvider,
    endpoint: String,
}

impl Telemetry {
    /// A pipeline pushing to `endpoint` every `interval`. Call inside the tokio runtime.
    pub fn new(endpoint: String, interval: Duration) -> Result<Telemetry, TelemetryError> {
        let fail = |e: &dyn std::fmt::Display| TelemetryError {
            endpoint: endpoint.clone(),
            message: e.to_string(),
        };
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| fail(&e))?;
        let reader = PeriodicReader::builder(exporter)
            .with_interval(interval)
            .build();
        let mut attributes = vec![KeyValue::new("service.version", env!("CARGO_PKG_VERSION"))];
        if let Ok(host) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
            attributes.push(KeyValue::new("host.name", host.trim().to_owned()));
        }
        for (var, key) in [
            ("POD_NAME", "k8s.pod.name"),
            ("POD_NAMESPACE", "k8s.namespace.name"),
            ("NODE_NAME", "k8s.node.name"),
        ] {
            if let Some(value) = std::env::var(var).ok().filter(|v| !v.is_empty()) {
                attributes.push(KeyValue::new(key, value));
            }
        }
        let resource = Resource::builder()
            .with_service_name("envoy-agent")
            .with_attributes(attributes)
            .build();
        let provider = SdkMeterProvider::builder()
            .with_reader(reader)
            .with_resource(resource)
            .build();
        tracing::info!(%endpoint, ?interval, "pushing metrics over OTLP");
        Ok(Telemetry { provider, endpoint })
    }

    /// The meter instruments are registered on.
    pub fn meter(&self) -> Meter {
        self.provider.meter("envoy-agent")
    }

    /// Flushes the last values and stops, within [`SHUTDOWN_TIMEOUT`].
    pub async fn shutdown(self) {
        let endpoint = self.endpoint.clone();
        let provider = self.provider;
        // The SDK's shutdown blocks (and exports): off the runtime's workers, and bounded.
        let flush =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT));
        match tokio::time::timeout(SHUTDOWN_TIMEOUT + Duration::from_secs(1), flush).await {
            Ok(Ok(Ok(()))) => tracing::debug!(%endpoint, "metrics flushed"),
            Ok(Ok(Err(e))) => tracing::warn!(%endpoint, error = %e, "final metrics not flushed"),
            _ => tracing::warn!(%endpoint, "final metrics flush timed out"),
        }
    }
}

#[derive(Debug)]
struct Instruments {
    drain: Histogram<f64>,
    exits: Counter<u64>,
}

/// The agent's instruments, or none (nil-safe).
#[derive(Debug, Clone, Default)]
pub struct AgentMetrics {
    inner: Option<Arc<Instruments>>,
}

impl AgentMetrics {
    /// Registers the instruments on `meter`.
    pub fn new(meter: &Meter) -> Self {
        AgentMetrics {
            inner: Some(Arc::new(Instruments {
                drain: meter
                    .f64_histogram("envoy_agent.drain.duration")
                    .with_description("Drain start to Envoy stopped, by exit path.")
                    .with_unit("s")
                    .build(),
                exits: meter
                    .u64_counter("envoy_agent.exits")
                    .with_description("How the agent ended, by exit path.")
                    .with_unit("{exit}")
                    .build(),
            })),
        }
    }

    /// The agent is exiting by `path`, after draining for `drained` if it drained.
    pub fn exit(&self, path: &str, drained: Option<Duration>) {
        if let Some(i) = &self.inner {
            let attrs = [KeyValue::new("exit_path", path.to_owned())];
            i.exits.add(1, &attrs);
            if let Some(d) = drained {
                i.drain.record(d.as_secs_f64(), &attrs);
            }
        }
    }
}

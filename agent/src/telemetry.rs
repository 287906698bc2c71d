//! Metrics pushed over OTLP/gRPC, and the agent's own instruments.
//!
//! # Pipeline
//!
//! Push only, no scrape endpoint. The OpenTelemetry SDK's standard environment configures it,
//! and a flag overrides a variable only when the flag is given; the settings, their variables
//! and defaults are tabled in `docs/observability.md#metrics-otlp-push`. Without a collector
//! nothing is built and every instrument is a no-op.
//!
//! An endpoint without a scheme is `http://` (plaintext); an `https://` one is verified with
//! the system's roots (rustls with ring; `SSL_CERT_FILE` / `SSL_CERT_DIR` name other roots).
//! The transport is OTLP/gRPC only: an `OTEL_EXPORTER_OTLP_PROTOCOL` asking for HTTP gets a
//! warning at start.
//!
//! The SDK's periodic reader exports from its own thread with a bounded timeout, so a
//! collector that is down or slow never blocks the agent; its tonic client is built inside the
//! agent's runtime, which it needs. On exit, [`Telemetry::shutdown`] flushes the last values,
//! bounded, so a post-mortem has them.
//!
//! # Instruments
//!
//! Attribute names follow the semantic conventions: namespaced under `envoy_agent.`, or
//! `error.type` for a kind of failure. Every histogram has explicit bucket boundaries in its
//! own unit (seconds), not the SDK's defaults (meant for milliseconds). The supervisor's
//! instruments are in `envoy_agent_hotrestart::metrics`; the agent's are
//! `envoy_agent.drain.duration` (buckets: [`DRAIN_DURATION_BUCKETS`]), `envoy_agent.exits`,
//! `envoy_agent.envoy.crashes` and `envoy_agent.log.dropped_lines`. Every instrument, with its attributes and their values, is
//! tabled once in `docs/observability.md#metrics-otlp-push`.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, MeterProvider as _};
use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::resource::TelemetryResourceDetector;

/// Bound on one export, unless `OTEL_EXPORTER_OTLP_(METRICS_)TIMEOUT` says otherwise.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);
/// How often metrics are pushed, unless the flag or `OTEL_METRIC_EXPORT_INTERVAL` says
/// otherwise (shorter than the SDK's 60 s: a crashing pod's post-mortem wants recent values).
pub const DEFAULT_EXPORT_INTERVAL: Duration = Duration::from_secs(10);
/// Bound on the final flush at exit.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// `service.name` unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` names one.
pub const SERVICE_NAME: &str = "envoy-agent";

/// Bucket boundaries of `envoy_agent.drain.duration`, in seconds: from a drain cut short at
/// once (`/quitquitquit`, a second signal) through the 5 s default and Envoy's 45 s drain time
/// to exit-on-zero waits of many minutes.
pub const DRAIN_DURATION_BUCKETS: [f64; 14] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
];

/// The environment as the pipeline reads it: a function, so that tests need not set the
/// process's own.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process's environment (empty values count as unset, as the SDK does).
pub fn process_env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

/// The collector, and where it was configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Its URL (`http://` added to a bare `host:port`).
    pub url: String,
    /// `--otlp-endpoint`, or the environment variable's name.
    pub source: &'static str,
}

/// The collector's endpoint: the flag, else `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`, else
/// `OTEL_EXPORTER_OTLP_ENDPOINT`; none means no telemetry at all.
pub fn endpoint(flag: Option<&str>) -> Option<Endpoint> {
    endpoint_in(flag, &process_env)
}

/// [`endpoint`] in the environment `env`.
pub fn endpoint_in(flag: Option<&str>, env: Env<'_>) -> Option<Endpoint> {
    let (value, source) = match flag.filter(|f| !f.trim().is_empty()) {
        Some(f) => (f.to_owned(), "--otlp-endpoint"),
        None => [
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .into_iter()
        .find_map(|var| env(var).map(|v| (v, var)))?,
    };
    let value = value.trim();
    let url = if value.contains("://") {
        value.to_owned()
    } else {
        format!("http://{value}")
    };
    Some(Endpoint { url, source })
}

/// The export interval: the flag, else `OTEL_METRIC_EXPORT_INTERVAL` (milliseconds), else
/// [`DEFAULT_EXPORT_INTERVAL`].
pub fn export_interval(flag: Option<Duration>, env: Env<'_>) -> Duration {
    if let Some(interval) = flag {
        return interval;
    }
    match env("OTEL_METRIC_EXPORT_INTERVAL") {
        Some(v) => match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms),
            _ => {
                tracing::warn!(value = %v, default = ?DEFAULT_EXPORT_INTERVAL, "OTEL_METRIC_EXPORT_INTERVAL is not a positive number of milliseconds: using the default");
                DEFAULT_EXPORT_INTERVAL
            }
        },
        None => DEFAULT_EXPORT_INTERVAL,
    }
}

/// The agent's own export timeout, unless the environment sets one (then `None`: the SDK
/// reads it).
fn export_timeout(env: Env<'_>) -> Option<Duration> {
    let set = [
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .into_iter()
    .any(|var| env(var).is_some());
    (!set).then_some(EXPORT_TIMEOUT)
}

/// The resource: the agent's defaults and what it detects, under what
/// `OTEL_RESOURCE_ATTRIBUTES` says, under `OTEL_SERVICE_NAME` (the specification's order).
pub fn resource(env: Env<'_>) -> Resource {
    let mut detected = vec![KeyValue::new("service.version", env!("CARGO_PKG_VERSION"))];
    if let Ok(host) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        detected.push(KeyValue::new("host.name", host.trim().to_owned()));
    }
    for (var, key) in [
        ("POD_NAME", "k8s.pod.name"),
        ("POD_NAMESPACE", "k8s.namespace.name"),
        ("NODE_NAME", "k8s.node.name"),
    ] {
        if let Some(value) = env(var) {
            detected.push(KeyValue::new(key, value));
        }
    }
    let mut builder = Resource::builder_empty()
        .with_service_name(SERVICE_NAME)
        .with_attributes(detected)
        .with_detector(Box::new(TelemetryResourceDetector));
    // Read through `env` (not the SDK's detector, which reads the process's environment), so
    // that every setting comes from one place.
    if let Some(attributes) = env("OTEL_RESOURCE_ATTRIBUTES") {
        builder = builder.with_attributes(parse_resource_attributes(&attributes));
    }
    if let Some(name) = env("OTEL_SERVICE_NAME") {
        builder = builder.with_service_name(name);
    }
    builder.build()
}

/// `key=value,key2=value2` (values percent-decoded), as `OTEL_RESOURCE_ATTRIBUTES` is written.
fn parse_resource_attributes(s: &str) -> Vec<KeyValue> {
    s.split(',')
        .filter_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            let value = percent_encoding::percent_decode_str(value.trim())
                .decode_utf8_lossy()
                .into_owned();
            Some(KeyValue::new(key.trim().to_owned(), value))
        })
        .collect()
}

/// Why the pipeline could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot export metrics to {endpoint} ({source_name}): {message}")]
pub struct TelemetryError {
    /// The endpoint.
    pub endpoint: String,
    /// Where it was configured.
    pub source_name: &'static str,
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
    /// A pipeline pushing to `endpoint` every `interval_flag` (when given; else see
    /// [`export_interval`]), configured by the process's environment as the module docs say.
    /// Call inside the tokio runtime.
    pub fn new(
        endpoint: Endpoint,
        interval_flag: Option<Duration>,
    ) -> Result<Telemetry, TelemetryError> {
        Self::new_in(endpoint, interval_flag, &process_env)
    }

    /// [`Telemetry::new`] in the environment `env`.
    pub fn new_in(
        endpoint: Endpoint,
        interval_flag: Option<Duration>,
        env: Env<'_>,
    ) -> Result<Telemetry, TelemetryError> {
        let fail = |e: &dyn std::fmt::Display| TelemetryError {
            endpoint: endpoint.url.clone(),
            source_name: endpoint.source,
            message: e.to_string(),
        };
        for var in [
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Some(protocol) = env(var).filter(|p| p.trim() != "grpc") {
                tracing::warn!(variable = var, %protocol, "the agent exports over OTLP/gRPC only: ignoring this protocol");
            }
        }
        let mut exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.url.clone());
        if let Some(timeout) = export_timeout(env) {
            exporter = exporter.with_timeout(timeout);
        }
        if endpoint.url.starts_with("https://") {
            // The SDK's own default for https has no roots: name the system's.
            exporter = exporter
                .with_tls_config(tonic::transport::ClientTlsConfig::new().with_enabled_roots());
        }
        let exporter = exporter.build().map_err(|e| fail(&e))?;
        let interval = export_interval(interval_flag, env);
        let reader = PeriodicReader::builder(exporter)
            .with_interval(interval)
            .build();
        let resource = resource(env);
        let service = resource
            .get(&opentelemetry::Key::new("service.name"))
            .map(|v| v.to_string())
            .unwrap_or_default();
        let provider = SdkMeterProvider::builder()
            .with_reader(reader)
            .with_resource(resource)
            .build();
        tracing::info!(
            event = "telemetry",
            endpoint = %endpoint.url,
            source = endpoint.source,
            ?interval,
            service_name = %service,
            "pushing metrics over OTLP"
        );
        Ok(Telemetry {
            provider,
            endpoint: endpoint.url,
        })
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
    crashes: Counter<u64>,
    /// Held so that its callback stays registered.
    #[allow(dead_code)]
    log_dropped: opentelemetry::metrics::ObservableCounter<u64>,
}

/// The exit path attribute (`drain_time_elapsed`, `quitquitquit`, ...: `ExitPath::name`).
pub const EXIT_PATH: &str = "envoy_agent.exit_path";
/// The crash counter's kind attribute (`CrashKind::as_str`).
pub const CRASH_KIND: &str = "envoy_agent.crash.kind";
/// The crash counter's action attribute (`CrashAction::as_str`).
pub const CRASH_ACTION: &str = "envoy_agent.crash.action";

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
                    .with_boundaries(DRAIN_DURATION_BUCKETS.to_vec())
                    .build(),
                exits: meter
                    .u64_counter("envoy_agent.exits")
                    .with_description("How the agent ended, by exit path.")
                    .with_unit("{exit}")
                    .build(),
                log_dropped: meter
                    .u64_observable_counter("envoy_agent.log.dropped_lines")
                    .with_description(
                        "Lines of the agent's stdout and stderr dropped because their reader did not take them.",
                    )
                    .with_unit("{line}")
                    .with_callback(|counter| {
                        counter.observe(envoy_agent_proxy::output::dropped_lines(), &[]);
                    })
                    .build(),
                crashes: meter
                    .u64_counter("envoy_agent.envoy.crashes")
                    .with_description(
                        "Crashes of the serving Envoy seen by crash recovery, by kind and action.",
                    )
                    .with_unit("{crash}")
                    .build(),
            })),
        }
    }

    /// The agent is exiting by `path`, after draining for `drained` if it drained.
    pub fn exit(&self, path: &str, drained: Option<Duration>) {
        if let Some(i) = &self.inner {
            let attrs = [KeyValue::new(EXIT_PATH, path.to_owned())];
            i.exits.add(1, &attrs);
            if let Some(d) = drained {
                i.drain.record(d.as_secs_f64(), &attrs);
            }
        }
    }

    /// Crash recovery saw a crash of `kind` and took `action`.
    pub fn crash(&self, kind: &'static str, action: &'static str) {
        if let Some(i) = &self.inner {
            i.crashes.add(
                1,
                &[
                    KeyValue::new(CRASH_KIND, kind),
                    KeyValue::new(CRASH_ACTION, action),
                ],
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |key| vars.get(key).cloned()
    }

    #[test]
    fn the_flag_wins_only_when_given() {
        let env = env_of(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317"),
            (
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                "https://metrics.example:4317",
            ),
            ("OTEL_METRIC_EXPORT_INTERVAL", "2500"),
        ]);
        let flag = endpoint_in(Some("10.0.0.1:4317"), &env).unwrap();
        assert_eq!(flag.url, "http://10.0.0.1:4317");
        assert_eq!(flag.source, "--otlp-endpoint");
        let from_env = endpoint_in(None, &env).unwrap();
        assert_eq!(from_env.url, "https://metrics.example:4317");
        assert_eq!(from_env.source, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT");
        let generic = endpoint_in(None, &env_of(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "c:4317")]));
        assert_eq!(generic.unwrap().url, "http://c:4317");
        assert_eq!(
            endpoint_in(None, &env_of(&[])),
            None,
            "no endpoint, no telemetry"
        );

        assert_eq!(export_interval(None, &env), Duration::from_millis(2500));
        assert_eq!(
            export_interval(Some(Duration::from_secs(1)), &env),
            Duration::from_secs(1)
        );
        assert_eq!(export_interval(None, &env_of(&[])), DEFAULT_EXPORT_INTERVAL);
        assert_eq!(
            export_interval(None, &env_of(&[("OTEL_METRIC_EXPORT_INTERVAL", "soon")])),
            DEFAULT_EXPORT_INTERVAL
        );

        assert_eq!(export_timeout(&env_of(&[])), Some(EXPORT_TIMEOUT));
        assert_eq!(
            export_timeout(&env_of(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "500")])),
            None,
            "the SDK reads it"
        );
    }

    fn attribute(resource: &Resource, key: &str) -> Option<String> {
        resource
            .get(&opentelemetry::Key::new(key.to_owned()))
            .map(|v| v.to_string())
    }

    #[test]
    fn the_resource_follows_the_specification_order() {
        let plain = resource(&env_of(&[("POD_NAME", "p-1")]));
        assert_eq!(
            attribute(&plain, "service.name").as_deref(),
            Some("envoy-agent")
        );
        assert_eq!(attribute(&plain, "k8s.pod.name").as_deref(), Some("p-1"));
        assert!(attribute(&plain, "telemetry.sdk.name").is_some());

        let attributes = resource(&env_of(&[
            ("POD_NAME", "p-1"),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "service.name=from-attributes,k8s.pod.name=override,deployment.environment.name=prod%20eu",
            ),
        ]));
        assert_eq!(
            attribute(&attributes, "service.name").as_deref(),
            Some("from-attributes")
        );
        assert_eq!(
            attribute(&attributes, "k8s.pod.name").as_deref(),
            Some("override")
        );
        assert_eq!(
            attribute(&attributes, "deployment.environment.name").as_deref(),
            Some("prod eu")
        );

        let named = resource(&env_of(&[
            ("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes"),
            ("OTEL_SERVICE_NAME", "edge-proxy"),
        ]));
        assert_eq!(
            attribute(&named, "service.name").as_deref(),
            Some("edge-proxy")
        );
    }
}

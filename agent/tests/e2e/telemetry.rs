//! OTLP metrics end to end: a real OTLP/gRPC receiver (a tonic server built from the official
//! OpenTelemetry protos) collecting what the agent pushes.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use envoy_agent_tests::{PATIENCE, eventually, live_at};
use nix::sys::signal::Signal;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::metrics::v1::number_data_point::Value as Number;

use crate::agent;

#[derive(Clone, Default)]
struct Receiver {
    requests: Arc<Mutex<Vec<ExportMetricsServiceRequest>>>,
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.requests.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

/// A receiver speaking TLS with `identity` (the certificate and key, PEM).
async fn tls_receiver(cert: &[u8], key: &[u8]) -> (SocketAddr, Receiver) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let receiver = Receiver::default();
    let service = MetricsServiceServer::new(receiver.clone());
    let tls = tonic::transport::ServerTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(cert, key));
    let server = tonic::transport::Server::builder()
        .tls_config(tls)
        .unwrap()
        .add_service(service);
    tokio::spawn(async move {
        server
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    (addr, receiver)
}

async fn receiver() -> (SocketAddr, Receiver) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let receiver = Receiver::default();
    let service = MetricsServiceServer::new(receiver.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });
    (addr, receiver)
}

fn attr(
    attributes: &[opentelemetry_proto::tonic::common::v1::KeyValue],
    key: &str,
) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(s) => Some(s.clone()),
            other => Some(format!("{other:?}")),
        }
    })
}

/// The newest data of metric `name` across what was received (cumulative temporality: the
/// last export holds the totals).
fn latest(requests: &[ExportMetricsServiceRequest], name: &str) -> Option<Data> {
    requests
        .iter()
        .rev()
        .flat_map(|r| &r.resource_metrics)
        .flat_map(|rm| &rm.scope_metrics)
        .flat_map(|sm| &sm.metrics)
        .find(|m| m.name == name)
        .and_then(|m| m.data.clone())
}

#[tokio::test]
async fn hot_restarts_and_a_rejection_reach_an_otlp_receiver() {
    let (addr, receiver) = receiver().await;
    let endpoint = format!("http://{addr}");
    let mut agent = agent()
        .hot_restart()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .args(&[
            "--otlp-endpoint",
            &endpoint,
            "--otlp-export-interval",
            "500ms",
        ])
        .start()
        .await;
    for epoch in 1..=2 {
        agent.signal(Signal::SIGHUP);
        live_at(&agent.admin, epoch).await;
        eventually("the parent to exit", PATIENCE, || async {
            (agent.envoys().len() == 1).then_some(())
        })
        .await;
    }
    std::fs::write(agent.dir.join("bootstrap.yaml"), "admin: [broken").unwrap();
    agent.signal(Signal::SIGHUP);
    agent.wait_event("handoff", "outcome", "rejected").await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));

    // The final flush at exit carries the totals.
    let requests = receiver.requests.lock().unwrap().clone();
    assert!(!requests.is_empty(), "metrics were pushed");
    let resource = requests.last().unwrap().resource_metrics[0]
        .resource
        .clone()
        .unwrap();
    assert_eq!(
        attr(&resource.attributes, "service.name").as_deref(),
        Some("envoy-agent")
    );
    assert!(attr(&resource.attributes, "service.version").is_some());

    let Some(Data::Gauge(epoch)) = latest(&requests, "envoy_agent.hot_restart.epoch") else {
        panic!("no epoch gauge");
    };
    assert_eq!(
        epoch.data_points.last().unwrap().value,
        Some(Number::AsInt(2))
    );

    let Some(Data::Histogram(handoffs)) =
        latest(&requests, "envoy_agent.hot_restart.handoff.duration")
    else {
        panic!("no handoff histogram");
    };
    let count = |outcome: &str| {
        handoffs
            .data_points
            .iter()
            .filter(|p| {
                attr(&p.attributes, "envoy_agent.handoff.outcome").as_deref() == Some(outcome)
            })
            .map(|p| p.count)
            .sum::<u64>()
    };
    assert_eq!(count("live"), 2);
    assert_eq!(count("rejected"), 1);
    // Buckets in seconds, as configured (the SDK's defaults are meant for milliseconds).
    for point in &handoffs.data_points {
        assert_eq!(
            point.explicit_bounds,
            envoy_agent_hotrestart::metrics::HANDOFF_DURATION_BUCKETS,
            "{point:?}"
        );
    }

    let Some(Data::Sum(rejected)) = latest(&requests, "envoy_agent.config.rejected") else {
        panic!("no rejection counter");
    };
    assert_eq!(
        rejected.data_points.last().unwrap().value,
        Some(Number::AsInt(1))
    );

    let Some(Data::Sum(exits)) = latest(&requests, "envoy_agent.envoy.exits") else {
        panic!("no exit counter");
    };
    let drained: i64 = exits
        .data_points
        .iter()
        .filter(|p| {
            attr(&p.attributes, "envoy_agent.envoy.exit_kind").as_deref() == Some("drained_parent")
        })
        .map(|p| match p.value {
            Some(Number::AsInt(n)) => n,
            _ => 0,
        })
        .sum();
    assert_eq!(drained, 2, "two parents drained away");
}

/// A crash that crash recovery restarts is counted, with its kind and what was done.
#[tokio::test]
async fn a_recovered_crash_reaches_an_otlp_receiver() {
    let (addr, receiver) = receiver().await;
    let endpoint = format!("http://{addr}");
    let mut agent = agent()
        .args(&["--restart-on-crash", "--otlp-endpoint", &endpoint])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(envoy as i32), Signal::SIGKILL).unwrap();
    agent.wait_event("envoy_restarting", "attempt", "1").await;
    eventually("ready again", PATIENCE, || async {
        let r = envoy_agent_tests::http_get(agent.status(), "/healthz/ready")
            .await
            .ok()?;
        (r.status == 200).then_some(())
    })
    .await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));

    let requests = receiver.requests.lock().unwrap().clone();
    let Some(Data::Sum(crashes)) = latest(&requests, "envoy_agent.envoy.crashes") else {
        panic!("no crash counter");
    };
    let point = crashes.data_points.last().unwrap();
    assert_eq!(
        (
            attr(&point.attributes, "envoy_agent.crash.kind").as_deref(),
            attr(&point.attributes, "envoy_agent.crash.action").as_deref(),
            point.value,
        ),
        (Some("exited"), Some("restart"), Some(Number::AsInt(1))),
        "{crashes:?}"
    );
}

/// SIGHUP to LIVE at the next epoch.
async fn handoff_time(agent: &envoy_agent_tests::AgentProcess, epoch: u32) -> std::time::Duration {
    let started = std::time::Instant::now();
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, epoch).await;
    started.elapsed()
}

#[tokio::test]
async fn a_collector_that_is_down_changes_nothing() {
    // The same hot restart without telemetry, for comparison.
    let mut plain = agent()
        .hot_restart()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .start()
        .await;
    let baseline = handoff_time(&plain, 1).await;
    plain.signal(Signal::SIGTERM);
    assert_eq!(plain.exit().await.code(), Some(0));

    // A collector that accepts connections and never answers: every export hangs until its
    // own timeout.
    let silent = envoy_agent_tests::silent_server().await;
    let endpoint = format!("http://{silent}");
    let mut agent = agent()
        .hot_restart()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .args(&["--termination-drain-duration", "0s"])
        .args(&[
            "--otlp-endpoint",
            &endpoint,
            "--otlp-export-interval",
            "200ms",
        ])
        .start()
        .await;
    let with_collector_down = handoff_time(&agent, 1).await;
    // A generous bound: the point is that exports failing on their own thread never sit in
    // the handoff's way, not how fast a handoff is.
    assert!(
        with_collector_down < baseline * 5 + std::time::Duration::from_secs(3),
        "{with_collector_down:?} against {baseline:?}"
    );
    let stopping = std::time::Instant::now();
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    // The final flush is bounded however the collector behaves: no drain here, so the exit
    // takes the flush's bound plus the stop, far less than the test kit's own patience.
    let bound = envoy_agent::telemetry::SHUTDOWN_TIMEOUT + std::time::Duration::from_secs(4);
    assert!(
        stopping.elapsed() < bound,
        "exit took {:?}, more than {bound:?}",
        stopping.elapsed()
    );
}

/// The OpenTelemetry SDK's standard environment alone configures the pipeline: no telemetry
/// flag, only `OTEL_EXPORTER_OTLP_ENDPOINT` (a bare host:port) and `OTEL_SERVICE_NAME`. The
/// metrics reach the receiver under that service name, and the drain histogram has the
/// configured buckets, in seconds.
#[tokio::test]
async fn the_standard_otel_environment_alone_configures_the_export() {
    let (addr, receiver) = receiver().await;
    let mut agent = agent()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &addr.to_string())
        .env("OTEL_SERVICE_NAME", "edge-proxy-7")
        .env(
            "OTEL_RESOURCE_ATTRIBUTES",
            "deployment.environment.name=staging",
        )
        .args(&["--termination-drain-duration", "300ms"])
        .start()
        .await;
    let telemetry = agent
        .wait_event("telemetry", "source", "OTEL_EXPORTER_OTLP_ENDPOINT")
        .await;
    assert_eq!(telemetry["service_name"], "edge-proxy-7", "{telemetry}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));

    // The final flush at exit carries the drain.
    let requests = receiver.requests.lock().unwrap().clone();
    assert!(!requests.is_empty(), "metrics were pushed");
    let resource = requests.last().unwrap().resource_metrics[0]
        .resource
        .clone()
        .unwrap();
    assert_eq!(
        attr(&resource.attributes, "service.name").as_deref(),
        Some("edge-proxy-7")
    );
    assert_eq!(
        attr(&resource.attributes, "deployment.environment.name").as_deref(),
        Some("staging")
    );
    let Some(Data::Histogram(drain)) = latest(&requests, "envoy_agent.drain.duration") else {
        panic!("no drain histogram");
    };
    let point = drain.data_points.last().unwrap();
    assert_eq!(
        attr(&point.attributes, "envoy_agent.exit_path").as_deref(),
        Some("drain_time_elapsed"),
        "{point:?}"
    );
    assert_eq!(point.count, 1);
    assert_eq!(
        point.explicit_bounds,
        envoy_agent::telemetry::DRAIN_DURATION_BUCKETS,
        "the configured buckets, in seconds"
    );
    let Some(Data::Sum(exits)) = latest(&requests, "envoy_agent.exits") else {
        panic!("no exit counter");
    };
    assert!(
        exits
            .data_points
            .iter()
            .any(|p| attr(&p.attributes, "envoy_agent.exit_path").as_deref()
                == Some("drain_time_elapsed")),
        "{exits:?}"
    );
}

/// A private CA and a certificate it signed for `localhost` and 127.0.0.1, made with the
/// openssl command: (CA certificate path, server certificate PEM, server key PEM).
fn certificates(dir: &std::path::Path) -> (std::path::PathBuf, Vec<u8>, Vec<u8>) {
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap_or_else(|e| panic!("openssl (Debian: apt-get install openssl): {e}"));
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=envoy-agent test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        "-out",
        "server.pem",
    ]);
    (
        dir.join("ca.pem"),
        std::fs::read(dir.join("server.pem")).unwrap(),
        std::fs::read(dir.join("server.key")).unwrap(),
    )
}

/// An `https://` collector is reached over TLS, verified with the system's roots: here a
/// private CA named by `SSL_CERT_FILE`, as an operator would name a cluster's. Without that CA
/// among the roots, the certificate is refused and nothing arrives.
#[tokio::test]
async fn an_https_collector_is_reached_over_tls_with_the_system_roots() {
    let dir = envoy_agent_tests::TestDir::new();
    let (ca, cert, key) = certificates(dir.path());
    let (addr, receiver) = tls_receiver(&cert, &key).await;
    let endpoint = format!("https://localhost:{}", addr.port());

    // Trusted: the metrics arrive.
    let mut trusted = agent()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("SSL_CERT_FILE", ca.to_str().unwrap())
        .args(&[
            "--otlp-export-interval",
            "200ms",
            "--termination-drain-duration",
            "0s",
        ])
        .start()
        .await;
    trusted.signal(Signal::SIGTERM);
    assert_eq!(trusted.exit().await.code(), Some(0));
    // A sidecar records at its exit: the final flush carries it, over TLS.
    assert!(
        !receiver.requests.lock().unwrap().is_empty(),
        "metrics over TLS"
    );

    // Not trusted (the real system roots, which do not have the test CA): refused.
    receiver.requests.lock().unwrap().clear();
    let mut untrusted = agent()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .env("SSL_CERT_FILE", "/nonexistent/ca.pem")
        .args(&[
            "--otlp-export-interval",
            "200ms",
            "--termination-drain-duration",
            "0s",
        ])
        .start()
        .await;
    untrusted.signal(Signal::SIGTERM);
    assert_eq!(untrusted.exit().await.code(), Some(0));
    assert!(
        receiver.requests.lock().unwrap().is_empty(),
        "an untrusted certificate must not be accepted"
    );
}

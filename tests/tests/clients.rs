//! The drain-test clients of the kit (`envoy_agent_tests::clients`) against the real Envoy, no
//! agent: each client reports what Envoy does. A graceful `drain_listeners` tells HTTP/1.1
//! `Connection: close` and HTTP/2 a GOAWAY; an overload manager's `disable_http_keepalive` and
//! `reduce_timeouts` (with and without `max_connection_duration`) are measured: every client's
//! view is printed (`--nocapture`) as a table row.

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use envoy_agent_proxy::admin::DrainListeners;
use envoy_agent_tests::clients::{
    ClientProcess, DrainBootstrap, EnvoyProcess, Event, GrpcStreamClient, GrpcUpstream, H1Client,
    H2Client, H3Client, HttpUpstream, Kind, Nghttp, QUIC_LISTENER, TCP_LISTENERS, TlsCert,
    overload_manager_yaml, set_pressure, validate,
};
use envoy_agent_tests::{TestDir, http_get};

/// How long the measurements watch the clients after the drain or the overload: past Envoy's
/// HTTP/2 drain sequence (the connection manager's `drain_timeout`, 5 s by default, between
/// the first GOAWAY and the last) and the 0.5 s the overload scales timers down to.
const WATCH: Duration = Duration::from_secs(8);

/// The overload's scaled-down timers.
const MIN_TIMEOUT: Duration = Duration::from_millis(500);

#[test]
fn the_bootstrap_is_valid_with_every_option() {
    let dir = TestDir::new();
    let upstream = SocketAddr::from(([127, 0, 0, 1], 1));
    let cert = TlsCert::generate(&dir);
    let plain = DrainBootstrap::new(upstream).yaml();
    validate(&dir, &plain).unwrap();
    let full = DrainBootstrap::new(upstream)
        .grpc(SocketAddr::from(([127, 0, 0, 1], 2)))
        .max_connection_duration(Duration::from_secs(86_400))
        .quic(&cert)
        .yaml()
        + &overload_manager_yaml(&dir.join("pressure"), MIN_TIMEOUT);
    validate(&dir, &full).unwrap_or_else(|e| panic!("{e}\n{full}"));
    for (name, direction) in TCP_LISTENERS {
        assert!(full.contains(&format!("name: {name}\n")));
        if let Some(direction) = direction {
            assert!(full.contains(&format!("traffic_direction: {direction}")));
        }
    }
    assert!(full.contains("codec_type: HTTP3"));
}

/// Upstreams, and Envoy on a [`DrainBootstrap`] with every listener.
struct Setup {
    dir: TestDir,
    _http: HttpUpstream,
    _grpc: GrpcUpstream,
    envoy: EnvoyProcess,
}

impl Setup {
    /// `overload`: with the overload manager (pressure file `pressure`, at 0 first).
    async fn start(max_connection_duration: Option<Duration>, overload: bool) -> Setup {
        let dir = TestDir::new();
        let http = HttpUpstream::start().await;
        let grpc = GrpcUpstream::start().await;
        let cert = TlsCert::generate(&dir);
        let mut bootstrap = DrainBootstrap::new(http.addr())
            .grpc(grpc.addr())
            .quic(&cert);
        if let Some(d) = max_connection_duration {
            bootstrap = bootstrap.max_connection_duration(d);
        }
        let path = dir.write("bootstrap.yaml", &bootstrap.yaml());
        let mut args = vec!["--drain-time-s".to_owned(), "60".to_owned()];
        if overload {
            set_pressure(&dir.join("pressure"), 0.0);
            args.push("--config-yaml".to_owned());
            args.push(overload_manager_yaml(&dir.join("pressure"), MIN_TIMEOUT));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let envoy = EnvoyProcess::start(&dir, &path, &args).await;
        Setup {
            dir,
            _http: http,
            _grpc: grpc,
            envoy,
        }
    }
}

/// Every kind of client, connected and past its first answer.
struct Clients {
    h1_requests: H1Client,
    h1_idle: H1Client,
    h2_idle: H2Client,
    h2_stream: H2Client,
    h2_requests: H2Client,
    grpc: GrpcStreamClient,
    nghttp: Nghttp,
    h3_idle: H3Client,
    h3_requests: H3Client,
}

impl Clients {
    /// Spread over the listeners: HTTP/1.1 on `inbound`, HTTP/2 on `outbound`, gRPC and nghttp
    /// on `plain`, HTTP/3 on `quic`.
    async fn connect(setup: &Setup) -> Clients {
        let inbound = setup.envoy.listener("inbound").await;
        let outbound = setup.envoy.listener("outbound").await;
        let plain = setup.envoy.listener("plain").await;
        let quic = setup.envoy.listener(QUIC_LISTENER).await;
        let routed = http_get(plain, "/stream?seconds=0").await.unwrap();
        assert_eq!(routed.status, 200, "{routed:?}");
        let interval = Duration::from_millis(200);
        let clients = Clients {
            h1_requests: H1Client::requests(inbound, interval),
            h1_idle: H1Client::idle(inbound),
            h2_idle: H2Client::idle(outbound),
            h2_stream: H2Client::stream(outbound, "/stream?seconds=60"),
            h2_requests: H2Client::requests(outbound, interval),
            grpc: GrpcStreamClient::start(plain, 60),
            nghttp: Nghttp::stream(plain, "/stream?seconds=60"),
            h3_idle: H3Client::idle(quic),
            h3_requests: H3Client::requests(quic, interval),
        };
        for (name, client) in clients.all() {
            client
                .wait_for(&format!("{name}: a first answer"), |e| match e.kind {
                    Kind::Response { status: 200, .. } | Kind::Message { .. } => Some(()),
                    _ => None,
                })
                .await;
        }
        for (name, client) in [
            ("h2 stream", &*clients.h2_stream),
            ("nghttp", &*clients.nghttp),
        ] {
            client
                .wait_for(&format!("{name}: data"), |e| {
                    matches!(e.kind, Kind::Data { bytes: 1.., .. }).then_some(())
                })
                .await;
        }
        clients
    }

    fn all(&self) -> [(&'static str, &ClientProcess); 9] {
        [
            ("h1 requests", &self.h1_requests),
            ("h1 idle", &self.h1_idle),
            ("h2 idle", &self.h2_idle),
            ("h2 stream", &self.h2_stream),
            ("h2 requests", &self.h2_requests),
            ("grpc stream", &self.grpc),
            ("nghttp stream", &self.nghttp),
            ("h3 idle", &self.h3_idle),
            ("h3 requests", &self.h3_requests),
        ]
    }

    /// What each client saw from `t0` (Unix seconds) on, one line each.
    fn report(&self, title: &str, t0: f64) -> String {
        let mut text = format!("=== {title}\n");
        for (name, client) in self.all() {
            text.push_str(&format!("{name:>14}: {}\n", summary(&client.events(), t0)));
        }
        text
    }
}

/// The events from `t0` on of the connection open at `t0` (or the first after it), in order,
/// each with its time after `t0`, runs of `data`, `response` and `message` events counted
/// rather than listed; then how many connections followed, with their GOAWAYs and failures.
fn summary(events: &[Event], t0: f64) -> String {
    let first = events
        .iter()
        .filter(|e| e.t < t0)
        .filter_map(|e| e.kind.conn())
        .max()
        .or_else(|| events.iter().find_map(|e| e.kind.conn()));
    let later = |e: &Event| matches!((e.kind.conn(), first), (Some(c), Some(f)) if c > f);
    let after: Vec<&Event> = events.iter().filter(|e| e.t >= t0).collect();
    let connections = after
        .iter()
        .filter(|e| later(e) && matches!(e.kind, Kind::Connected { .. }))
        .count();
    let goaways = after
        .iter()
        .filter(|e| later(e) && matches!(e.kind, Kind::Goaway { .. }))
        .count();
    let failures = after
        .iter()
        .filter(|e| matches!(e.kind, Kind::Failure { .. }))
        .count();
    let mut parts: Vec<String> = Vec::new();
    let mut run: Option<(&str, u32, f64)> = None;
    let flush = |run: &mut Option<(&str, u32, f64)>, parts: &mut Vec<String>| {
        if let Some((what, n, t)) = run.take() {
            parts.push(format!("{n} {what} from +{t:.1}s"));
        }
    };
    for event in after.iter().filter(|e| !later(e)) {
        let dt = event.t - t0;
        let counted = match &event.kind {
            Kind::Data { .. } => Some("data"),
            Kind::Message { .. } => Some("message"),
            Kind::Response {
                status: 200,
                connection: None,
                ..
            } => Some("200"),
            _ => None,
        };
        if let Some(what) = counted {
            match &mut run {
                Some((w, n, _)) if *w == what => *n += 1,
                _ => {
                    flush(&mut run, &mut parts);
                    run = Some((what, 1, dt));
                }
            }
            continue;
        }
        flush(&mut run, &mut parts);
        let text = match &event.kind {
            Kind::Response {
                conn,
                status,
                connection,
                ..
            } => format!(
                "response {status} conn {conn} connection: {}",
                connection.as_deref().unwrap_or("-")
            ),
            Kind::Goaway {
                conn,
                last_stream_id,
                error_code,
            } => format!(
                "GOAWAY conn {conn} last_stream_id {last_stream_id}{}",
                error_code
                    .map(|c| format!(" error {c}"))
                    .unwrap_or_default()
            ),
            Kind::Closed {
                conn,
                how,
                error_code,
                reason,
                no_error,
                ..
            } => format!(
                "closed conn {conn} ({how}{}{}{})",
                error_code
                    .map(|c| format!(", code {c:#x}"))
                    .unwrap_or_default(),
                no_error
                    .map(|n| if n { ", no error" } else { ", an error" })
                    .unwrap_or_default(),
                reason
                    .as_deref()
                    .filter(|r| !r.is_empty())
                    .map(|r| format!(", {r:?}"))
                    .unwrap_or_default()
            ),
            Kind::StreamEnd { .. } => "stream end".to_owned(),
            Kind::Reset { error_code, .. } => format!("reset {error_code}"),
            Kind::Status { code, clean, .. } => format!("status {code} clean={clean}"),
            Kind::Connected { conn, .. } => format!("connected conn {conn}"),
            Kind::Failure { reason, .. } => format!("FAILURE {reason}"),
            Kind::Done { .. } => "exit".to_owned(),
            other => format!("{other:?}"),
        };
        parts.push(format!("+{dt:.1}s {text}"));
    }
    flush(&mut run, &mut parts);
    if connections > 0 {
        parts.push(format!(
            "then {connections} new connections, {goaways} GOAWAYs on them"
        ));
    }
    if failures > 0 {
        parts.push(format!("{failures} failures in all"));
    }
    if parts.is_empty() {
        "nothing".to_owned()
    } else {
        parts.join("; ")
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Waits for an event after `t0` that `pick` accepts.
async fn after(client: &ClientProcess, t0: f64, what: &str, pick: impl Fn(&Kind) -> bool) -> f64 {
    client
        .wait_for(what, |e| (e.t >= t0 && pick(&e.kind)).then_some(e.t))
        .await
}

fn connection_close(kind: &Kind) -> bool {
    matches!(kind, Kind::Response { connection: Some(c), .. } if c.eq_ignore_ascii_case("close"))
}

fn goaway(kind: &Kind) -> bool {
    matches!(kind, Kind::Goaway { .. })
}

fn data(kind: &Kind) -> bool {
    matches!(kind, Kind::Data { bytes: 1.., .. } | Kind::Message { .. })
}

/// Sleeps until `WATCH` has passed since `t0`, then prints what every client saw.
async fn watch_and_report(clients: &Clients, title: &str, t0: f64) {
    let left = WATCH.as_secs_f64() - (unix_now() - t0);
    if left > 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(left)).await;
    }
    println!("{}", clients.report(title, t0));
}

#[tokio::test]
async fn every_client_sees_a_graceful_drain() {
    let setup = Setup::start(None, false).await;
    let clients = Clients::connect(&setup).await;
    let t0 = unix_now();
    setup
        .envoy
        .admin
        .drain_listeners(DrainListeners {
            graceful: true,
            ..DrainListeners::default()
        })
        .await
        .unwrap();
    // The next request of each `requests` client is told to go away.
    after(
        &clients.h1_requests,
        t0,
        "Connection: close",
        connection_close,
    )
    .await;
    after(&clients.h2_requests, t0, "a GOAWAY", goaway).await;
    after(&clients.h3_requests, t0, "an HTTP/3 GOAWAY", goaway).await;
    // Streams in flight go on.
    for (name, client) in [
        ("h2 stream", &*clients.h2_stream),
        ("nghttp", &*clients.nghttp),
        ("grpc", &*clients.grpc),
    ] {
        after(client, t0, &format!("{name}: data after the drain"), data).await;
    }
    watch_and_report(&clients, "graceful drain_listeners", t0).await;
}

async fn overload(max_connection_duration: Option<Duration>) {
    let setup = Setup::start(max_connection_duration, true).await;
    let clients = Clients::connect(&setup).await;
    let t0 = unix_now();
    set_pressure(&setup.dir.join("pressure"), 1.0);
    after(
        &clients.h1_requests,
        t0,
        "Connection: close",
        connection_close,
    )
    .await;
    after(&clients.h2_requests, t0, "a GOAWAY", goaway).await;
    // Idle connections: the idle timer, scaled down, drains them; HTTP/1.1 is closed.
    after(
        &clients.h1_idle,
        t0,
        "the close",
        |k| matches!(k, Kind::Closed { how, .. } if how == "eof"),
    )
    .await;
    after(&clients.h2_idle, t0, "a GOAWAY", goaway).await;
    after(
        &clients.h2_idle,
        t0,
        "the close",
        |k| matches!(k, Kind::Closed { how, .. } if how == "eof"),
    )
    .await;
    after(&clients.h3_idle, t0, "an HTTP/3 GOAWAY", goaway).await;
    after(
        &clients.h3_idle,
        t0,
        "a clean CONNECTION_CLOSE",
        |k| matches!(k, Kind::Closed { how, no_error: Some(true), .. } if how == "peer"),
    )
    .await;
    if max_connection_duration.is_some() {
        // The connection's life, scaled down, drains a connection with a stream in flight:
        // GOAWAY, and the stream keeps flowing.
        for (name, client) in [
            ("h2 stream", &*clients.h2_stream),
            ("nghttp", &*clients.nghttp),
        ] {
            let told = after(client, t0, &format!("{name}: a GOAWAY"), goaway).await;
            after(
                client,
                told,
                &format!("{name}: data after the GOAWAY"),
                data,
            )
            .await;
        }
    }
    let title = match max_connection_duration {
        Some(d) => format!("overload at 1.0, max_connection_duration {}s", d.as_secs()),
        None => "overload at 1.0, no max_connection_duration".to_owned(),
    };
    watch_and_report(&clients, &title, t0).await;
}
#[tokio::test]
async fn overload_without_max_connection_duration() {
    overload(None).await;
}

#[tokio::test]
async fn overload_with_max_connection_duration() {
    overload(Some(Duration::from_secs(86_400))).await;
}

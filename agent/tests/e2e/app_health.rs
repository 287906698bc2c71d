//! The app's own probes end to end (issue 41, item 2): the real agent, with the real Envoy,
//! runs the probes `--app-probers` names against apps the test starts, and answers the
//! kubelet's `GET /app-health/<container>/livez|readyz|startupz` on its status server: 200
//! when the probe passes, 500 with the reason when it fails (within the probe's timeout when
//! the app hangs), 404 for a path without a probe. A probe that hangs delays no other; bad
//! probes JSON exits 64 at start.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use envoy_agent_tests::clients::{ClientProcess, Kind, TlsCert};
use envoy_agent_tests::{PATIENCE, Response, TestDir, eventually, http_get};

use crate::{AGENT, agent};

/// How much longer than its timeout a failing probe's answer may take here: a bound on the
/// wait (the machine is shared), not a measurement.
const MARGIN: Duration = Duration::from_secs(10);

/// `tests/clients/probe_app.py KIND ARGS`, started, and its port.
async fn probe_app(kind: &str, args: &[OsString]) -> (ClientProcess, u16) {
    let mut all = vec![OsString::from(kind)];
    all.extend_from_slice(args);
    let app = ClientProcess::python("probe_app.py", &all);
    let port = app
        .wait_for("its port", |e| match e.kind {
            Kind::Listening { port } => Some(port),
            _ => None,
        })
        .await;
    (app, port)
}

/// How many requests the app has taken that it will never answer.
fn hanging(app: &ClientProcess) -> usize {
    app.kinds()
        .iter()
        .filter(|k| matches!(k, Kind::Serving { .. }))
        .count()
}

/// A TCP address that drops connection attempts, without root: a listener whose accept queue
/// (backlog 0) one connection, never accepted, fills; the kernel drops further SYNs.
struct SynDropper {
    _listener: tokio::net::TcpListener,
    _filler: std::net::TcpStream,
    port: u16,
}

impl SynDropper {
    fn new() -> SynDropper {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let port = listener.local_addr().unwrap().port();
        let filler = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        SynDropper {
            _listener: listener,
            _filler: filler,
            port,
        }
    }
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET path` on the status server, bounded by `within`.
async fn probe(status: SocketAddr, path: &str, within: Duration) -> Response {
    tokio::time::timeout(within, http_get(status, path))
        .await
        .unwrap_or_else(|_| panic!("{path}: no answer within {within:?}"))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Each kind healthy, failing and hanging: 200, then 500 naming what failed, then 500 "timed
/// out" within the probe's timeout (plus the margin); HTTPS without verifying the app's
/// self-signed certificate; 404 for a path without a probe.
#[tokio::test]
async fn each_probe_kind_passes_fails_and_times_out() {
    let dir = TestDir::new();
    let cert = TlsCert::generate(&dir);
    let (http, http_port) = probe_app("http", &[]).await;
    let (_https, https_port) = probe_app(
        "http",
        &[
            "--cert".into(),
            cert.cert.clone().into(),
            "--key".into(),
            cert.key.clone().into(),
        ],
    )
    .await;
    let (grpc, grpc_port) = probe_app("grpc", &[]).await;
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tcp_port = tcp.local_addr().unwrap().port();
    let closed = closed_port();
    let dropper = SynDropper::new();
    let probers = serde_json::json!({
        "/app-health/http/livez": {"httpGet": {"path": "/healthz", "port": http_port, "scheme": "HTTP"}, "timeoutSeconds": 1},
        "/app-health/http/readyz": {"httpGet": {"path": "/sick", "port": http_port}},
        "/app-health/http/startupz": {"httpGet": {"path": "/hang", "port": http_port}, "timeoutSeconds": 1},
        "/app-health/https/livez": {"httpGet": {"path": "/healthz", "port": https_port, "scheme": "HTTPS"}},
        "/app-health/tcp/livez": {"tcpSocket": {"port": tcp_port}},
        "/app-health/tcp/readyz": {"tcpSocket": {"port": closed}},
        "/app-health/tcp/startupz": {"tcpSocket": {"port": dropper.port}, "timeoutSeconds": 1},
        "/app-health/grpc/livez": {"grpc": {"port": grpc_port}},
        "/app-health/grpc/readyz": {"grpc": {"port": grpc_port, "service": "down"}},
        "/app-health/grpc/startupz": {"grpc": {"port": grpc_port, "service": "hang"}, "timeoutSeconds": 1},
    })
    .to_string();
    let agent = agent().args(&["--app-probers", &probers]).start().await;
    let status = agent.status();
    let timeout = Duration::from_secs(1);

    for (path, what) in [
        ("/app-health/http/livez", "answered 200"),
        ("/app-health/https/livez", "answered 200"),
        ("/app-health/tcp/livez", "connected"),
        ("/app-health/grpc/livez", "answered SERVING"),
    ] {
        let r = probe(status, path, PATIENCE).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        assert!(r.body.starts_with("probe passed: "), "{path}: {}", r.body);
        assert!(r.body.trim_end().ends_with(what), "{path}: {}", r.body);
    }
    assert!(
        probe(status, "/app-health/https/livez", PATIENCE)
            .await
            .body
            .contains(&format!("GET https://127.0.0.1:{https_port}/healthz")),
        "over TLS"
    );

    for (path, what) in [
        (
            "/app-health/http/readyz",
            format!("GET http://127.0.0.1:{http_port}/sick answered 503"),
        ),
        (
            "/app-health/tcp/readyz",
            format!("TCP connect to 127.0.0.1:{closed}: connect refused"),
        ),
        (
            "/app-health/grpc/readyz",
            format!("gRPC health check of \"down\" at 127.0.0.1:{grpc_port} answered NOT_SERVING"),
        ),
    ] {
        let r = probe(status, path, PATIENCE).await;
        assert_eq!(r.status, 500, "{path}: {}", r.body);
        assert_eq!(r.body, format!("probe failed: {what}\n"), "{path}");
    }

    for (path, app) in [
        ("/app-health/http/startupz", Some(&http)),
        ("/app-health/tcp/startupz", None),
        ("/app-health/grpc/startupz", Some(&grpc)),
    ] {
        let r = probe(status, path, timeout + MARGIN).await;
        assert_eq!(r.status, 500, "{path}: {}", r.body);
        assert!(r.body.starts_with("probe failed: "), "{path}: {}", r.body);
        assert!(
            r.body.trim_end().ends_with("timed out after 1s"),
            "{path}: {}",
            r.body
        );
        if let Some(app) = app {
            assert_eq!(hanging(app), 1, "{path}: the app took the request");
        }
    }

    for path in ["/app-health/web/livez", "/app-health/http/other"] {
        let r = probe(status, path, PATIENCE).await;
        assert_eq!(r.status, 404, "{path}: {}", r.body);
    }
    drop(tcp);
}

/// Two probes at once: while one hangs inside the app (its timeout is long), another answers
/// 200 and the first is still waiting.
#[tokio::test]
async fn a_hanging_probe_delays_no_other() {
    let (app, port) = probe_app("http", &[]).await;
    let probers = serde_json::json!({
        "/app-health/slow/livez": {"httpGet": {"path": "/hang", "port": port}, "timeoutSeconds": 60},
        "/app-health/app/livez": {"httpGet": {"path": "/healthz", "port": port}},
    })
    .to_string();
    let agent = agent().args(&["--app-probers", &probers]).start().await;
    let status = agent.status();
    let slow = tokio::spawn(http_get(status, "/app-health/slow/livez"));
    eventually("the slow probe inside the app", PATIENCE, || async {
        (hanging(&app) == 1).then_some(())
    })
    .await;
    for _ in 0..3 {
        let r = probe(status, "/app-health/app/livez", PATIENCE).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(!slow.is_finished(), "the slow probe still waits on the app");
    slow.abort();
}

/// What pilot-agent would refuse, and what the agent cannot run, stops it at start: exit 64,
/// one line naming the input and the problem. Istio's variable is read when the agent's own
/// is not set, and loses to it.
#[tokio::test]
async fn bad_probes_exit_64_naming_the_input() {
    let dir = TestDir::new();
    let bootstrap = dir.bootstrap("bootstrap.yaml", "x");
    let named = r#"{"/app-health/app/livez":{"httpGet":{"path":"/","port":"http"}}}"#;
    let exec = r#"{"/app-health/app/readyz":{"exec":{"command":["true"]}}}"#;
    let good = r#"{"/app-health/app/livez":{"tcpSocket":{"port":1}}}"#;
    for (env, says) in [
        (
            vec![("ENVOY_AGENT_APP_PROBERS", "{nope")],
            "--app-probers (ENVOY_AGENT_APP_PROBERS) is not a JSON object",
        ),
        (
            vec![("ENVOY_AGENT_APP_PROBERS", named)],
            r#"httpGet.port "http" is a named port"#,
        ),
        (
            vec![("ISTIO_KUBE_APP_PROBERS", exec)],
            "ISTIO_KUBE_APP_PROBERS: /app-health/app/readyz: no httpGet, tcpSocket or grpc",
        ),
        (
            vec![(
                "ISTIO_KUBE_APP_PROBERS",
                r#"{"/healthz/ready":{"tcpSocket":{"port":1}}}"#,
            )],
            r#"ISTIO_KUBE_APP_PROBERS: "/healthz/ready" is not a path"#,
        ),
        (
            vec![
                ("ISTIO_KUBE_APP_PROBERS", good),
                ("ENVOY_AGENT_APP_PROBERS", named),
            ],
            "--app-probers (ENVOY_AGENT_APP_PROBERS): /app-health/app/livez: httpGet.port",
        ),
    ] {
        let mut command = tokio::process::Command::new(AGENT);
        command
            .args(["run", "-c"])
            .arg(&bootstrap)
            .args(["--status-address", "127.0.0.1:0"])
            .env_remove("ENVOY_AGENT_APP_PROBERS")
            .env_remove("ISTIO_KUBE_APP_PROBERS")
            .stdin(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in &env {
            command.env(k, v);
        }
        let out = tokio::time::timeout(PATIENCE, command.output())
            .await
            .expect("the agent exits")
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{env:?}: {stderr}");
        let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{env:?}: one line: {stderr}");
        assert!(stderr.contains(says), "{env:?}: {stderr}");
    }
}

//! The pod's one scrape (issue 41): `--app-metrics-url` merges the app's metrics into the
//! status server's `/stats/prometheus` beside the agent's and Envoy's, read by a real
//! Prometheus (Debian's `prometheus`) and checked by its `promtool`; an app that is down, slow,
//! huge or garbled costs the scrape only its own families.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use envoy_agent_tests::{PATIENCE, TestDir, eventually, free_port, http_get, test_tool};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::agent;

/// What the app answers at `/metrics`: a counter, a gauge in Envoy's namespace (the merge
/// renames it), a histogram.
const APP_METRICS: &str = "# HELP app_requests_total Requests the app served.\n\
# TYPE app_requests_total counter\n\
app_requests_total{code=\"200\"} 42\n\
app_requests_total{code=\"503\"} 1\n\
# HELP envoy_fake_thing Named as if it were Envoy's.\n\
# TYPE envoy_fake_thing gauge\n\
envoy_fake_thing 7\n\
# TYPE app_latency_seconds histogram\n\
app_latency_seconds_bucket{le=\"0.1\"} 3\n\
app_latency_seconds_bucket{le=\"+Inf\"} 4\n\
app_latency_seconds_sum 0.9\n\
app_latency_seconds_count 4\n";

/// The app: `/metrics` as above, `/slow` never answers, `/huge` streams 64 MiB, `/garbled`
/// answers HTML. Runs until dropped.
struct App {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for App {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl App {
    async fn start() -> App {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(App::answer(stream));
            }
        });
        App { addr, task }
    }

    async fn answer(mut stream: tokio::net::TcpStream) {
        let mut request = Vec::new();
        let mut buf = [0u8; 2048];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => request.extend_from_slice(&buf[..n]),
            }
        }
        let request = String::from_utf8_lossy(&request);
        let path = request.split(' ').nth(1).unwrap_or("/");
        let head = |len: usize| {
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {len}\r\nconnection: close\r\n\r\n"
            )
        };
        match path {
            "/metrics" => {
                let _ = stream.write_all(head(APP_METRICS.len()).as_bytes()).await;
                let _ = stream.write_all(APP_METRICS.as_bytes()).await;
            }
            "/slow" => tokio::time::sleep(Duration::from_secs(3600)).await,
            "/huge" => {
                let chunk = "app_filler{n=\"0123456789\"} 1\n".repeat(1 << 10);
                let total = 64 << 20;
                let _ = stream.write_all(head(total).as_bytes()).await;
                let mut sent = 0;
                while sent < total {
                    let n = chunk.len().min(total - sent);
                    if stream.write_all(&chunk.as_bytes()[..n]).await.is_err() {
                        return;
                    }
                    sent += n;
                }
            }
            _ => {
                let html = "<html><body>metrics moved</body></html>\n";
                let _ = stream.write_all(head(html.len()).as_bytes()).await;
                let _ = stream.write_all(html.as_bytes()).await;
            }
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// `promtool check metrics` on `body`: its exit code and what it printed. It exits 1 on a
/// parse error and 3 on lint findings (Envoy's own counters lack `_total`, for one): only the
/// first is a broken scrape.
async fn promtool(body: &str) -> (Option<i32>, String) {
    let mut child = tokio::process::Command::new(test_tool("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let body = body.to_owned();
    let writer = tokio::spawn(async move {
        let _ = stdin.write_all(body.as_bytes()).await;
    });
    let out = tokio::time::timeout(PATIENCE, child.wait_with_output())
        .await
        .expect("promtool returned")
        .unwrap();
    writer.await.unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), said)
}

fn assert_parses(body: &str, said: (Option<i32>, String)) {
    let (code, said) = said;
    assert!(
        code != Some(1) && !said.contains("parsing error"),
        "promtool found the scrape broken ({code:?}): {said}\n{}",
        &body[..body.len().min(4000)]
    );
}

/// A real Prometheus scraping `target`'s `/stats/prometheus` every second.
struct Prometheus {
    addr: SocketAddr,
    _child: tokio::process::Child,
    _dir: TestDir,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Prometheus {
        let dir = TestDir::new();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global: {{scrape_interval: 1s, scrape_timeout: 1s}}\n\
                 scrape_configs:\n\
                 - job_name: pod\n  metrics_path: /stats/prometheus\n  static_configs: [{{targets: ['{target}']}}]\n"
            ),
        )
        .unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = tokio::process::Command::new(test_tool("prometheus"))
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Prometheus {
            addr,
            _child: child,
            _dir: dir,
        }
    }

    /// The value of the one series `query` selects, once Prometheus has one.
    async fn value(&self, query: &str) -> String {
        eventually(&format!("Prometheus has {query}"), PATIENCE, || async {
            let path = format!("/api/v1/query?query={query}");
            let answer = http_get(self.addr, &path).await.ok()?;
            let json: serde_json::Value = serde_json::from_str(&answer.body).ok()?;
            let result = json["data"]["result"].as_array()?;
            (result.len() == 1)
                .then(|| result[0]["value"][1].as_str().map(str::to_owned))
                .flatten()
        })
        .await
    }
}

#[tokio::test]
async fn a_real_prometheus_scrapes_the_app_envoy_and_the_agent_as_one_target() {
    let app = App::start().await;
    let agent = agent()
        .args(&["--app-metrics-url", &app.url("/metrics")])
        .start()
        .await;
    let prometheus = Prometheus::start(agent.status());
    // The scrape as a whole: Prometheus parsed it all.
    eventually("up 1", PATIENCE, || async {
        (prometheus.value("up").await == "1").then_some(())
    })
    .await;
    // The app's series, as the app wrote them, and the one in Envoy's namespace renamed.
    assert_eq!(
        prometheus
            .value("app_requests_total%7Bcode%3D%22200%22%7D")
            .await,
        "42"
    );
    assert_eq!(prometheus.value("app_envoy_fake_thing").await, "7");
    assert_eq!(prometheus.value("app_latency_seconds_count").await, "4");
    // Envoy's and the agent's beside them.
    assert_eq!(prometheus.value("envoy_server_live").await, "1");
    assert_eq!(
        prometheus
            .value("envoy_agent_state%7Bstate%3D%22live%22%7D")
            .await,
        "1"
    );
    assert_eq!(prometheus.value("envoy_agent_app_metrics_up").await, "1");
    assert_eq!(prometheus.value("envoy_agent_envoy_stats_up").await, "1");

    let scrape = http_get(agent.status(), "/stats/prometheus").await.unwrap();
    assert_eq!(scrape.status, 200);
    assert_eq!(
        scrape.body.matches("# TYPE app_requests_total ").count(),
        1,
        "each family once"
    );
    assert_parses(&scrape.body, promtool(&scrape.body).await);
}

#[tokio::test]
async fn an_app_that_is_down_slow_huge_or_garbled_leaves_the_scrape_fast_and_valid() {
    let app = App::start().await;
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    for (url, reason) in [
        (format!("http://{closed}/metrics"), "unreachable"),
        (app.url("/slow"), "timeout"),
        (app.url("/huge"), "too_large"),
        (app.url("/garbled"), "invalid"),
    ] {
        let agent = agent().args(&["--app-metrics-url", &url]).start().await;
        let started = Instant::now();
        let scrape = http_get(agent.status(), "/stats/prometheus").await.unwrap();
        let took = started.elapsed();
        assert_eq!(scrape.status, 200, "{reason}");
        // Bounded by the agent (2 s for the app); the margin is the machine's.
        assert!(
            took < Duration::from_secs(15),
            "{reason}: the scrape took {took:?}"
        );
        let body = &scrape.body;
        assert!(
            body.contains("envoy_agent_app_metrics_up 0"),
            "{reason}: {body:.2000}"
        );
        assert!(
            body.contains(&format!(
                "envoy_agent_app_metrics_failures_total{{reason=\"{reason}\"}} 1"
            )),
            "{reason}: {body:.2000}"
        );
        assert!(body.contains("envoy_agent_envoy_stats_up 1"), "{reason}");
        assert!(
            body.contains("\nenvoy_server_live"),
            "{reason}: Envoy's stats are there"
        );
        // None of the app's answer is passed on (the reason is, as a comment).
        assert!(
            !body
                .lines()
                .any(|l| !l.starts_with('#') && (l.contains("app_filler") || l.contains("<html>"))),
            "{reason}"
        );
        assert_parses(body, promtool(body).await);
        let logged = agent.wait_event("app_metrics", "reason", reason).await;
        assert_eq!(logged["state"], "down", "{logged}");
    }
}

/// An Istio-injected pod's description of the app's metrics (`ISTIO_PROMETHEUS_ANNOTATIONS`,
/// the pod's own `prometheus.io/*` annotations before the injector pointed them at the agent)
/// is taken as it is when `--app-metrics-url` is not given.
#[tokio::test]
async fn istios_annotations_alone_name_the_apps_metrics() {
    let app = App::start().await;
    let annotations = format!(
        r#"{{"scrape":"true","port":"{}","path":"/metrics"}}"#,
        app.addr.port()
    );
    let agent = agent()
        .env("ISTIO_PROMETHEUS_ANNOTATIONS", &annotations)
        .start()
        .await;
    let scrape = http_get(agent.status(), "/stats/prometheus").await.unwrap();
    assert!(
        scrape
            .body
            .contains("\napp_requests_total{code=\"200\"} 42\n"),
        "{:.2000}",
        scrape.body
    );
    assert!(scrape.body.contains("envoy_agent_app_metrics_up 1"));
}

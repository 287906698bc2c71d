//! The app's metrics in the pod's one scrape (`--app-metrics-url`), as pilot-agent's merged
//! metrics: the status server's `/stats/prometheus` answers the agent's families, then the
//! app's, then Envoy's, so that a pod keeps one scrape target when a NetworkPolicy or mTLS
//! hides the app's port.
//!
//! Theory of operation:
//!
//! - **One fetch for the scrapes that arrive together** ([`AppMetrics::scrape`]): the first
//!   starts a fetch in a task of its own; the others that come before it ends wait for its
//!   answer. A scrape that goes away leaves the fetch to the others (the task runs on to its
//!   bound); nothing is kept past a fetch's end, so no answer is older than its scrape.
//! - **Bounded**: the whole fetch (connect, head, body) by [`Limits::timeout`], the body by
//!   [`Limits::max_bytes`]. The app's answer is held whole (it is checked before it is merged,
//!   see [`crate::status::exposition`]), so the bound is the agent's memory's too.
//! - **An app that fails costs the scrape only its own families**: the scrape answers at once
//!   with the agent's and Envoy's, `envoy_agent_app_metrics_up 0`, and
//!   `envoy_agent_app_metrics_failures_total{reason}` counts why (`unreachable`, `timeout`,
//!   `status`, `too_large`, `invalid`); the first failure of a kind after a success is logged
//!   (`event="app_metrics"`), the rest at debug.
//! - **Content negotiation**: the app is asked for Prometheus' text format first and
//!   OpenMetrics second (`Accept`), as Prometheus asks; OpenMetrics is turned into text, the
//!   format Envoy's stats and so the whole answer are in.
//!
//! Only `http://` URLs: the app is on the pod's loopback, where the sidecar does not intercept.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use tokio::sync::watch;
use tracing::Instrument as _;

/// What `Accept` says to the app: Prometheus' text format first, OpenMetrics second.
const ACCEPT: &str =
    "text/plain;version=0.0.4;q=1,application/openmetrics-text;version=1.0.0;q=0.5,*/*;q=0.1";

/// The app's metrics endpoint, parsed from `--app-metrics-url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port`, for the connect and the `Host` header.
    authority: String,
    /// The path and query, `/` at least.
    path: String,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

/// Why `--app-metrics-url` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("app metrics URL {url:?}: {why}")]
pub struct TargetError {
    /// As given.
    pub url: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl std::str::FromStr for Target {
    type Err = TargetError;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let refuse = |why| TargetError {
            url: url.to_owned(),
            why,
        };
        if !url.contains("://") {
            return Err(refuse(
                "no scheme (for example http://127.0.0.1:8080/metrics)",
            ));
        }
        let uri: http::Uri = url
            .parse()
            .map_err(|_| refuse("not a URL (for example http://127.0.0.1:8080/metrics)"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(_) => {
                return Err(refuse(
                    "only http:// (the app on the pod's loopback, which the sidecar does not intercept)",
                ));
            }
            None => {
                return Err(refuse(
                    "no scheme (for example http://127.0.0.1:8080/metrics)",
                ));
            }
        }
        let authority = uri.authority().ok_or_else(|| refuse("no host"))?;
        if authority.as_str().contains('@') {
            return Err(refuse("credentials in the URL are not supported"));
        }
        let port = authority.port_u16().unwrap_or(80);
        let host = authority.host();
        if host.is_empty() {
            return Err(refuse("no host"));
        }
        Ok(Target {
            authority: format!("{host}:{port}"),
            path: uri
                .path_and_query()
                .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
        })
    }
}

/// Why `ISTIO_PROMETHEUS_ANNOTATIONS` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ISTIO_PROMETHEUS_ANNOTATIONS {json:?}: {why}")]
pub struct IstioAnnotationsError {
    /// As given.
    pub json: String,
    /// What is wrong with it.
    pub why: String,
}

/// The app's metrics as Istio's injector describes them in `ISTIO_PROMETHEUS_ANNOTATIONS`
/// (the pod's own `prometheus.io/*` annotations, before it pointed them at pilot-agent):
/// `{"scrape":"true","port":"8080","path":"/metrics"}` is `http://127.0.0.1:8080/metrics`
/// (the path defaults to `/metrics`, as Prometheus'); `None` when `scrape` is not `true` or
/// no port is named (pilot-agent merges nothing then either).
pub fn from_istio_annotations(json: &str) -> Result<Option<Target>, IstioAnnotationsError> {
    let refuse = |why: String| IstioAnnotationsError {
        json: json.to_owned(),
        why,
    };
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| refuse(format!("not JSON: {e}")))?;
    let field = |name: &str| value.get(name).and_then(serde_json::Value::as_str);
    if !value.is_object() {
        return Err(refuse("not a JSON object".to_owned()));
    }
    if field("scrape") != Some("true") {
        return Ok(None);
    }
    let Some(port) = field("port").filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let port: u16 = port
        .parse()
        .map_err(|_| refuse(format!("port {port:?} is not a port number")))?;
    let path = field("path")
        .filter(|p| !p.is_empty())
        .unwrap_or("/metrics");
    let path = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/{path}")
    };
    format!("http://127.0.0.1:{port}{path}")
        .parse()
        .map(Some)
        .map_err(|e: TargetError| refuse(e.why.to_owned()))
}

/// `--app-metrics-url` as given: empty means off, so that a pod whose annotation (read through
/// the downward API) is absent runs without it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag(pub Option<Target>);

impl std::str::FromStr for Flag {
    type Err = TargetError;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        if url.trim().is_empty() {
            return Ok(Flag(None));
        }
        url.parse().map(|t| Flag(Some(t)))
    }
}

/// The bounds of one fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The whole fetch: connect, head, body.
    pub timeout: Duration,
    /// The body.
    pub max_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // As the status server's calls to Envoy: a scrape is not held longer by the app.
            timeout: Duration::from_secs(2),
            max_bytes: 8 << 20,
        }
    }
}

/// Why the app's metrics were left out of a scrape (its failures counter's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// No connection, or it broke.
    Unreachable,
    /// Not within [`Limits::timeout`].
    Timeout,
    /// An answer other than 200.
    Status,
    /// A body over [`Limits::max_bytes`].
    TooLarge,
    /// A body that is not Prometheus' text format nor OpenMetrics.
    Invalid,
}

impl Reason {
    /// Every reason, in the counter's order.
    pub const ALL: [Reason; 5] = [
        Reason::Unreachable,
        Reason::Timeout,
        Reason::Status,
        Reason::TooLarge,
        Reason::Invalid,
    ];

    /// The counter's label.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Unreachable => "unreachable",
            Reason::Timeout => "timeout",
            Reason::Status => "status",
            Reason::TooLarge => "too_large",
            Reason::Invalid => "invalid",
        }
    }
}

/// A fetch that gave nothing to merge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the app's metrics at {url}: {detail}")]
pub struct FetchError {
    /// Why, as counted.
    pub reason: Reason,
    /// The URL asked.
    pub url: String,
    /// In words.
    pub detail: String,
}

type Answer = Arc<Result<String, FetchError>>;

/// The app's metrics endpoint, its fetch in flight and its failure counts.
#[derive(Debug)]
pub struct AppMetrics {
    target: Target,
    limits: Limits,
    /// The fetch in flight: its answer comes on the channel.
    flight: Mutex<Option<watch::Receiver<Option<Answer>>>>,
    failures: [AtomicU64; 5],
    /// Whether the last fetch failed (a failure after a success is logged at info).
    failing: AtomicBool,
    fetches: AtomicU64,
}

impl AppMetrics {
    /// The app's metrics at `target`, fetched within `limits`.
    pub fn new(target: Target, limits: Limits) -> Arc<Self> {
        Arc::new(AppMetrics {
            target,
            limits,
            flight: Mutex::new(None),
            failures: Default::default(),
            failing: AtomicBool::new(false),
            fetches: AtomicU64::new(0),
        })
    }

    /// The URL asked.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// How many fetches started so far (scrapes that shared one count once).
    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::Relaxed)
    }

    /// Failures so far by reason, in [`Reason::ALL`]'s order.
    pub fn failures(&self) -> [(Reason, u64); 5] {
        Reason::ALL.map(|r| (r, self.failures[r as usize].load(Ordering::Relaxed)))
    }

    /// The app's metrics as text-format lines ready to merge: from the fetch in flight, or
    /// from a new one.
    pub async fn scrape(self: &Arc<Self>) -> Answer {
        let mut answer = {
            let mut flight = self.flight.lock().unwrap_or_else(PoisonError::into_inner);
            match flight.as_ref() {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    *flight = Some(rx.clone());
                    self.fetches.fetch_add(1, Ordering::Relaxed);
                    let this = Arc::clone(self);
                    tokio::spawn(
                        async move {
                            let result = this.fetch().await;
                            this.record(&result);
                            // Scrapes from now on start the next fetch: no answer outlives its fetch.
                            *this.flight.lock().unwrap_or_else(PoisonError::into_inner) = None;
                            let _ = tx.send(Some(Arc::new(result)));
                        }
                        .in_current_span(),
                    );
                    rx
                }
            }
        };
        let ended = answer
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|a| a.clone());
        ended.unwrap_or_else(|| {
            Arc::new(Err(FetchError {
                reason: Reason::Unreachable,
                url: self.target.to_string(),
                detail: "the fetch ended without an answer (the agent is stopping?)".to_owned(),
            }))
        })
    }

    fn record(&self, result: &Result<String, FetchError>) {
        match result {
            Ok(_) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(event = "app_metrics", state = "up", url = %self.target, "the app's metrics answer again");
                }
            }
            Err(e) => {
                self.failures[e.reason as usize].fetch_add(1, Ordering::Relaxed);
                if self.failing.swap(true, Ordering::Relaxed) {
                    tracing::debug!(event = "app_metrics", state = "down", reason = e.reason.label(), error = %e, "the app's metrics are left out of the scrape");
                } else {
                    tracing::warn!(event = "app_metrics", state = "down", reason = e.reason.label(), error = %e, "the app's metrics are left out of the scrape");
                }
            }
        }
    }

    async fn fetch(&self) -> Result<String, FetchError> {
        let url = self.target.to_string();
        let fail = |reason, detail: String| FetchError {
            reason,
            url: url.clone(),
            detail,
        };
        match tokio::time::timeout(self.limits.timeout, self.fetch_unbounded()).await {
            Ok(Ok(text)) => Ok(text),
            Ok(Err((reason, detail))) => Err(fail(reason, detail)),
            Err(_) => Err(fail(
                Reason::Timeout,
                format!("no whole answer within {:?}", self.limits.timeout),
            )),
        }
    }

    async fn fetch_unbounded(&self) -> Result<String, (Reason, String)> {
        let unreachable = |e: &dyn fmt::Display| (Reason::Unreachable, e.to_string());
        let stream = tokio::net::TcpStream::connect(self.target.authority.as_str())
            .await
            .map_err(|e| unreachable(&e))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(&e))?;
        // Ends once the sender and the response are dropped (also when the timeout drops
        // this future).
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let request = http::Request::get(self.target.path.as_str())
            .header(http::header::HOST, self.target.authority.as_str())
            .header(http::header::ACCEPT, ACCEPT)
            .header(http::header::USER_AGENT, "envoy-agent")
            .body(Empty::<Bytes>::new())
            .map_err(|e| unreachable(&e))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| unreachable(&e))?;
        if response.status() != http::StatusCode::OK {
            return Err((Reason::Status, format!("answered {}", response.status())));
        }
        let openmetrics = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/openmetrics-text"));
        let max = self.limits.max_bytes;
        let body = Limited::new(response.into_body(), max)
            .collect()
            .await
            .map_err(|e| {
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    (Reason::TooLarge, format!("a body over {max} bytes"))
                } else {
                    (Reason::Unreachable, format!("reading the body: {e}"))
                }
            })?
            .to_bytes();
        let text =
            std::str::from_utf8(&body).map_err(|e| (Reason::Invalid, format!("not UTF-8: {e}")))?;
        crate::status::exposition::merge_ready(text, openmetrics)
            .map_err(|e| (Reason::Invalid, e.to_string()))
    }
}

/// The agent's families about the app's metrics for one scrape: whether they are in it, and
/// the failures so far.
pub fn families(app: &AppMetrics, up: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP envoy_agent_app_metrics_up Whether the app's metrics ({}) are in this scrape.\n\
         # TYPE envoy_agent_app_metrics_up gauge\nenvoy_agent_app_metrics_up {}",
        app.target(),
        u8::from(up)
    );
    out.push_str(
        "# HELP envoy_agent_app_metrics_failures_total Fetches of the app's metrics left out of a scrape, by reason.\n\
         # TYPE envoy_agent_app_metrics_failures_total counter\n",
    );
    for (reason, count) in app.failures() {
        let _ = writeln!(
            out,
            "envoy_agent_app_metrics_failures_total{{reason=\"{}\"}} {count}",
            reason.label()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn istios_annotations_name_the_apps_metrics() {
        let t = from_istio_annotations(r#"{"scrape":"true","port":"8080","path":"/stats"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(t.to_string(), "http://127.0.0.1:8080/stats");
        let t = from_istio_annotations(r#"{"scrape":"true","port":"9090"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(t.to_string(), "http://127.0.0.1:9090/metrics");
        for off in [
            r#"{"scrape":"false","port":"8080"}"#,
            r#"{"scrape":"true"}"#,
            "{}",
        ] {
            assert_eq!(from_istio_annotations(off).unwrap(), None, "{off}");
        }
        for (bad, why) in [
            ("scrape", "not JSON"),
            ("[1]", "not a JSON object"),
            (r#"{"scrape":"true","port":"http"}"#, "not a port number"),
        ] {
            let e = from_istio_annotations(bad).unwrap_err();
            assert!(e.why.contains(why), "{bad}: {e}");
            assert!(
                e.to_string().contains("ISTIO_PROMETHEUS_ANNOTATIONS"),
                "{e}"
            );
        }
    }

    #[test]
    fn an_empty_flag_is_off() {
        assert_eq!("".parse::<Flag>().unwrap(), Flag(None));
        assert!("http://127.0.0.1:1/m".parse::<Flag>().unwrap().0.is_some());
        assert!("ftp://x/".parse::<Flag>().is_err());
    }

    #[test]
    fn urls_are_checked_naming_the_input() {
        let t: Target = "http://127.0.0.1:9090/metrics?x=1".parse().unwrap();
        assert_eq!(t.to_string(), "http://127.0.0.1:9090/metrics?x=1");
        let t: Target = "http://localhost".parse().unwrap();
        assert_eq!(t.to_string(), "http://localhost:80/");
        for (url, why) in [
            ("https://127.0.0.1/metrics", "only http://"),
            ("127.0.0.1:8080/metrics", "no scheme"),
            ("http://user:pw@127.0.0.1/", "credentials"),
            ("http://a b/", "not a URL"),
        ] {
            let e = url.parse::<Target>().unwrap_err();
            assert!(e.why.contains(why), "{url}: {e}");
            assert!(e.to_string().contains(url), "{e}");
        }
    }

    /// A one-connection-at-a-time app answering `answer` after `delay`, counting requests.
    async fn app(
        answer: &'static [u8],
        delay: Duration,
    ) -> (Target, Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&count);
        let task = tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                seen.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    tokio::time::sleep(delay).await;
                    let _ = s.write_all(answer).await;
                });
            }
        });
        (
            format!("http://{addr}/metrics").parse().unwrap(),
            count,
            task,
        )
    }

    #[tokio::test]
    async fn scrapes_that_arrive_together_share_one_fetch() {
        let (target, requests, _app) = app(
            b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\nconnection: close\r\n\r\napp_ok 1",
            Duration::from_millis(300),
        )
        .await;
        let metrics = AppMetrics::new(target, Limits::default());
        let (a, b, c) = tokio::join!(metrics.scrape(), metrics.scrape(), metrics.scrape());
        for answer in [a, b, c] {
            assert_eq!(answer.as_ref().as_ref().unwrap(), "app_ok 1\n");
        }
        assert_eq!(requests.load(Ordering::Relaxed), 1, "one fetch for three");
        assert_eq!(metrics.fetches(), 1);
        // The next scrape fetches anew: nothing is kept.
        metrics.scrape().await;
        assert_eq!(requests.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn each_failure_is_bounded_and_counted_by_reason() {
        let limits = Limits {
            timeout: Duration::from_millis(300),
            max_bytes: 64,
        };
        let cases: [(&'static [u8], Duration, Reason); 4] = [
            (b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nok 1", Duration::from_secs(5), Reason::Timeout),
            (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n", Duration::ZERO, Reason::Status),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nbig 1111111111111111111111111111111111111111111111111111111111111111111111111111111111111111111", Duration::ZERO, Reason::TooLarge),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 13\r\n\r\n<html></html>", Duration::ZERO, Reason::Invalid),
        ];
        for (answer, delay, reason) in cases {
            let (target, _, _app) = app(answer, delay).await;
            let metrics = AppMetrics::new(target, limits);
            let started = tokio::time::Instant::now();
            let e = metrics.scrape().await.as_ref().clone().unwrap_err();
            assert_eq!(e.reason, reason, "{e}");
            assert!(started.elapsed() < Duration::from_secs(3), "bounded");
            let counted: Vec<_> = metrics
                .failures()
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .collect();
            assert_eq!(counted, [(reason, 1)]);
            let families = families(&metrics, false);
            assert!(
                families.contains("envoy_agent_app_metrics_up 0"),
                "{families}"
            );
            assert!(
                families.contains(&format!(
                    "envoy_agent_app_metrics_failures_total{{reason=\"{}\"}} 1",
                    reason.label()
                )),
                "{families}"
            );
        }
        // Nobody listening.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let metrics = AppMetrics::new(format!("http://{addr}/").parse().unwrap(), limits);
        let e = metrics.scrape().await.as_ref().clone().unwrap_err();
        assert_eq!(e.reason, Reason::Unreachable, "{e}");
    }

    #[tokio::test]
    async fn openmetrics_is_asked_second_and_turned_into_text() {
        let (target, _, _app) = app(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\ncontent-length: 43\r\n\r\n# TYPE jobs counter\njobs_total 3\n# EOF\n\n\n\n\n",
            Duration::ZERO,
        )
        .await;
        let metrics = AppMetrics::new(target, Limits::default());
        let answer = metrics.scrape().await;
        assert_eq!(
            answer.as_ref().as_ref().unwrap(),
            "# TYPE jobs_total counter\njobs_total 3\n"
        );
    }
}

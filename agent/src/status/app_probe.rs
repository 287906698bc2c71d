//! The app's own probes, run by the agent for the kubelet (issue 41): what pilot-agent does for
//! an Istio-injected pod at `/app-health/<container>/livez`, `/readyz` and `/startupz`.
//!
//! # Theory
//!
//! With an Envoy in front of the app, the kubelet's probes may not reach the app as written
//! (mTLS on the app's port, inbound redirection). Istio's injector therefore points each app
//! probe at the agent's status port and hands the original probes to the agent as JSON
//! (`ISTIO_KUBE_APP_PROBERS`: a map from the agent's path to the Kubernetes probe, pilot-agent's
//! `KubeAppProbers`). The kubelet calls the status server ([`crate::status`]); the status
//! server looks the path up in [`AppProbes`] and runs [`AppProbe::run`] from inside the pod,
//! against the app's loopback ([`DEFAULT_HOST`]) unless the probe names a host:
//!
//! - `httpGet`: one HTTP/1.1 GET with the probe's headers and `Connection: close`; a 2xx or
//!   3xx passes, as the kubelet's (redirects are not followed: a 3xx passes as it is).
//!   `scheme: HTTPS` does TLS without verifying the certificate, as the kubelet does.
//! - `tcpSocket`: a connection made passes; it is closed at once.
//! - `grpc`: `grpc.health.v1.Health/Check` with the probe's `service` over plaintext HTTP/2;
//!   `SERVING` passes, every other status (or a gRPC error: `UNIMPLEMENTED`, `NOT_FOUND`)
//!   fails.
//!
//! # Bounds
//!
//! The probe's `timeoutSeconds` (the kubelet's default, 1 s, when absent or 0) bounds the whole
//! probe: name resolution, connect, TLS, request and answer. Past it the probe is dropped (its
//! socket closed) and the answer is a failure, so a hung app never holds the status server's
//! request beyond it. Each request runs on its own (the status server serves each connection
//! in its own task): a hung probe delays no other probe, and nothing is shared between probes
//! but the read-only configuration. A status-server connection lives at most
//! [`crate::status::MAX_CONNECTION_AGE`], so a `timeoutSeconds` beyond it is cut there.
//!
//! # Answers
//!
//! The status server answers 200 when the probe passes and 500 when it fails, with one line
//! saying what was tried and what happened ([`ProbeFailure`]: `timed out after 1s`, `connect
//! refused`, `answered 503`, `NOT_SERVING`); 404 for a path with no probe configured.
//!
//! # Configuration
//!
//! [`AppProbes::parse`] takes pilot-agent's JSON as the injector writes it and refuses at start
//! (exit 64, naming the input) what would only fail later: bad JSON, a key that is not
//! `/app-health/<name>/livez|readyz|startupz`, a probe with none (or more than one) of
//! `httpGet`, `tcpSocket`, `grpc` (an `exec` probe), and a named port: the agent does not see
//! the pod spec, and Istio's injector writes the number. Other Kubernetes probe fields
//! (`periodSeconds`, `failureThreshold`, ...) are the kubelet's and are ignored, as
//! pilot-agent ignores them.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// The kubelet's default probe timeout, for a probe without `timeoutSeconds` (or 0).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// Where a probe goes when it names no host: the pod's loopback, which the app's container
/// shares with the agent's.
pub const DEFAULT_HOST: &str = "127.0.0.1";

/// Where the probes' JSON came from, to name it in a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// `--app-probers` or `ENVOY_AGENT_APP_PROBERS`.
    Flag,
    /// `ISTIO_KUBE_APP_PROBERS`, as Istio's injector sets it.
    Istio,
}

impl std::fmt::Display for Input {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Input::Flag => "--app-probers (ENVOY_AGENT_APP_PROBERS)",
            Input::Istio => "ISTIO_KUBE_APP_PROBERS",
        })
    }
}

/// The app probes by the status server's path (`/app-health/<container>/livez`, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppProbes {
    by_path: BTreeMap<String, AppProbe>,
}

/// One probe: what to do and how long it may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppProbe {
    /// What the probe does.
    pub action: Action,
    /// The bound on the whole probe (`timeoutSeconds`).
    pub timeout: Duration,
}

/// What a probe does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `httpGet`.
    Http(HttpGet),
    /// `tcpSocket`.
    Tcp(Target),
    /// `grpc`: the standard health check.
    Grpc(GrpcCheck),
}

/// Where a probe connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// An IP address or a name ([`DEFAULT_HOST`] when the probe gives none).
    pub host: String,
    /// The port.
    pub port: u16,
}

/// An `httpGet` probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpGet {
    /// Where.
    pub target: Target,
    /// `scheme: HTTPS`: TLS, the certificate not verified.
    pub https: bool,
    /// The path (and query) asked for.
    pub path: PathAndQuery,
    /// `httpHeaders`, in order; they replace the agent's own of the same name.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// A `grpc` probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcCheck {
    /// Where (the probe has no host: always [`DEFAULT_HOST`]).
    pub target: Target,
    /// The service asked about; empty: the server as a whole.
    pub service: String,
}

/// Why the probes' JSON cannot be used: the agent does not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Not JSON, or not an object.
    #[error("{input} is not a JSON object of probes by path (pilot-agent's format): {error}")]
    Json {
        /// Where it came from.
        input: Input,
        /// The parser's error.
        error: String,
    },
    /// A key the status server would not serve.
    #[error(
        "{input}: {path:?} is not a path the status server serves probes at: \
         /app-health/<container>/livez, /readyz or /startupz{hint}"
    )]
    Path {
        /// Where it came from.
        input: Input,
        /// The key.
        path: String,
        /// More about it, when there is more to say.
        hint: &'static str,
    },
    /// A probe that cannot be run.
    #[error("{input}: {path}: {why}")]
    Probe {
        /// Where it came from.
        input: Input,
        /// The probe's key.
        path: String,
        /// What is wrong with it.
        why: ProbeRefusal,
    },
}

/// What is wrong with one probe.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeRefusal {
    /// Not the shape of a Kubernetes probe.
    #[error("not a probe: {0}")]
    Malformed(String),
    /// None of the kinds pilot-agent runs (an `exec` probe, say).
    #[error("no httpGet, tcpSocket or grpc (the kinds the agent runs){found}")]
    NoKind {
        /// `"; found exec"` or empty.
        found: String,
    },
    /// More than one kind.
    #[error("{0} at once: a probe has one kind")]
    ManyKinds(String),
    /// A named port.
    #[error(
        "{kind}.port {name:?} is a named port: the agent does not see the pod spec to resolve it \
         (Istio's injector writes the number); give the container port's number"
    )]
    NamedPort {
        /// `httpGet` or `tcpSocket`.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// A port number out of range.
    #[error("{kind}.port {port} is not a TCP port (1-65535)")]
    Port {
        /// The kind.
        kind: &'static str,
        /// The number.
        port: i64,
    },
    /// A scheme other than HTTP or HTTPS.
    #[error("httpGet.scheme {0:?} is neither HTTP nor HTTPS")]
    Scheme(String),
    /// A path that is not an HTTP path.
    #[error("httpGet.path {0:?} is not an HTTP path")]
    HttpPath(String),
    /// A header that cannot be sent.
    #[error("httpGet.httpHeaders: {name:?}: {why}")]
    Header {
        /// The header's name.
        name: String,
        /// Why it cannot be sent.
        why: String,
    },
    /// A host that is neither an IP address nor a name.
    #[error("{kind}.host {host:?} is not an IP address or a host name")]
    Host {
        /// The kind.
        kind: &'static str,
        /// The host.
        host: String,
    },
    /// A negative timeout.
    #[error("timeoutSeconds {0} is negative")]
    Timeout(i64),
}

/// Why a probe failed: the status server's answer (500) says it in one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeFailure {
    /// The probe took longer than its timeout.
    #[error("{probe}: timed out after {after:?}")]
    TimedOut {
        /// What was tried.
        probe: String,
        /// The timeout.
        after: Duration,
    },
    /// Nothing listens there.
    #[error("{probe}: connect refused")]
    Refused {
        /// What was tried.
        probe: String,
    },
    /// The connection could not be made for another reason.
    #[error("{probe}: cannot connect: {source}")]
    Connect {
        /// What was tried.
        probe: String,
        /// Why.
        source: std::io::Error,
    },
    /// The TLS handshake failed (not the certificate: it is not verified).
    #[error("{probe}: TLS: {source}")]
    Tls {
        /// What was tried.
        probe: String,
        /// Why.
        source: std::io::Error,
    },
    /// The HTTP exchange failed (the app closed the connection, answered something else).
    #[error("{probe}: {source}")]
    Http {
        /// What was tried.
        probe: String,
        /// Why.
        source: hyper::Error,
    },
    /// The app answered a status that fails the probe.
    #[error("{probe} answered {status}")]
    Status {
        /// What was tried.
        probe: String,
        /// The status code.
        status: u16,
    },
    /// The gRPC call failed (`UNIMPLEMENTED`: no health service; `NOT_FOUND`: no such
    /// service; `UNAVAILABLE`: the connection).
    #[error("{probe}: gRPC {}: {}", .status.code(), .status.message())]
    Grpc {
        /// What was tried.
        probe: String,
        /// The call's status.
        status: tonic::Status,
    },
    /// The health service says the service is not serving.
    #[error("{probe} answered {status}")]
    NotServing {
        /// What was tried.
        probe: String,
        /// `NOT_SERVING`, `UNKNOWN`, `SERVICE_UNKNOWN`.
        status: &'static str,
    },
}

impl AppProbes {
    /// Parses pilot-agent's `KubeAppProbers` JSON; empty (or blank) is no probes, as for
    /// pilot-agent.
    pub fn parse(json: &str, input: Input) -> Result<Self, ConfigError> {
        if json.trim().is_empty() {
            return Ok(AppProbes::default());
        }
        let raw: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(json).map_err(|e| ConfigError::Json {
                input,
                error: e.to_string(),
            })?;
        let mut by_path = BTreeMap::new();
        for (path, value) in raw {
            check_path(&path).map_err(|hint| ConfigError::Path {
                input,
                path: path.clone(),
                hint,
            })?;
            let probe = AppProbe::from_json(value).map_err(|why| ConfigError::Probe {
                input,
                path: path.clone(),
                why,
            })?;
            by_path.insert(path, probe);
        }
        Ok(AppProbes { by_path })
    }

    /// The probe for a status-server path.
    pub fn get(&self, path: &str) -> Option<&AppProbe> {
        self.by_path.get(path)
    }

    /// The configured paths, sorted.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.by_path.keys().map(String::as_str)
    }

    /// Whether none is configured.
    pub fn is_empty(&self) -> bool {
        self.by_path.is_empty()
    }
}

/// `/app-health/<name>/(livez|readyz|startupz)`; else a hint for the refusal.
fn check_path(path: &str) -> Result<(), &'static str> {
    let mut parts = path.split('/');
    let shape = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    );
    match shape {
        (Some(""), Some("app-health"), Some(name), Some("livez" | "readyz" | "startupz"), None)
            if !name.is_empty() =>
        {
            Ok(())
        }
        (Some(""), Some("app-lifecycle"), ..) => Err(
            " (pilot-agent's lifecycle hooks, /app-lifecycle/..., are not served by envoy-agent: \
             leave the hook's httpGet on the app)",
        ),
        _ => Err(""),
    }
}

/// The serde shape of pilot-agent's `Prober` (Kubernetes' probe fields, camelCase).
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawProbe {
    http_get: Option<RawHttpGet>,
    tcp_socket: Option<RawTcpSocket>,
    grpc: Option<RawGrpc>,
    timeout_seconds: Option<i64>,
    #[serde(flatten)]
    other: BTreeMap<String, serde_json::Value>,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawHttpGet {
    path: Option<String>,
    port: RawPort,
    host: Option<String>,
    scheme: Option<String>,
    http_headers: Option<Vec<RawHeader>>,
}

#[derive(serde::Deserialize)]
struct RawHeader {
    name: String,
    value: String,
}

#[derive(serde::Deserialize)]
struct RawTcpSocket {
    port: RawPort,
    host: Option<String>,
}

#[derive(serde::Deserialize)]
struct RawGrpc {
    port: i64,
    service: Option<String>,
}

/// Kubernetes' `IntOrString`.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum RawPort {
    Number(i64),
    Name(String),
}

/// The probe fields that are the kubelet's business, not the agent's.
const KUBELET_FIELDS: &[&str] = &[
    "initialDelaySeconds",
    "periodSeconds",
    "successThreshold",
    "failureThreshold",
    "terminationGracePeriodSeconds",
];

impl AppProbe {
    fn from_json(value: serde_json::Value) -> Result<Self, ProbeRefusal> {
        let raw: RawProbe =
            serde_json::from_value(value).map_err(|e| ProbeRefusal::Malformed(e.to_string()))?;
        let timeout = match raw.timeout_seconds {
            None | Some(0) => DEFAULT_TIMEOUT,
            Some(s) if s < 0 => return Err(ProbeRefusal::Timeout(s)),
            Some(s) => Duration::from_secs(s.unsigned_abs()),
        };
        let kinds: Vec<&str> = [
            raw.http_get.is_some().then_some("httpGet"),
            raw.tcp_socket.is_some().then_some("tcpSocket"),
            raw.grpc.is_some().then_some("grpc"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if kinds.len() > 1 {
            return Err(ProbeRefusal::ManyKinds(kinds.join(" and ")));
        }
        let action = if let Some(get) = raw.http_get {
            Action::Http(http_get(get)?)
        } else if let Some(tcp) = raw.tcp_socket {
            Action::Tcp(Target {
                host: host("tcpSocket", tcp.host)?,
                port: port("tcpSocket", tcp.port)?,
            })
        } else if let Some(grpc) = raw.grpc {
            Action::Grpc(GrpcCheck {
                target: Target {
                    host: DEFAULT_HOST.to_owned(),
                    port: port("grpc", RawPort::Number(grpc.port))?,
                },
                service: grpc.service.unwrap_or_default(),
            })
        } else {
            let found: Vec<&str> = raw
                .other
                .keys()
                .map(String::as_str)
                .filter(|k| !KUBELET_FIELDS.contains(k))
                .collect();
            let found = if found.is_empty() {
                String::new()
            } else {
                format!("; found {}", found.join(", "))
            };
            return Err(ProbeRefusal::NoKind { found });
        };
        Ok(AppProbe { action, timeout })
    }
}

fn http_get(raw: RawHttpGet) -> Result<HttpGet, ProbeRefusal> {
    let https = match raw.scheme.as_deref() {
        None | Some("HTTP") => false,
        Some("HTTPS") => true,
        Some(other) => return Err(ProbeRefusal::Scheme(other.to_owned())),
    };
    // As the kubelet: a path without its leading slash gets one.
    let path = raw.path.unwrap_or_default();
    let slashed = if path.starts_with('/') {
        path.clone()
    } else {
        format!("/{path}")
    };
    let path = PathAndQuery::try_from(slashed).map_err(|_| ProbeRefusal::HttpPath(path))?;
    let mut headers = Vec::new();
    for h in raw.http_headers.unwrap_or_default() {
        let refuse = |why: String| ProbeRefusal::Header {
            name: h.name.clone(),
            why,
        };
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|e| refuse(e.to_string()))?;
        let value = HeaderValue::from_str(&h.value).map_err(|e| refuse(e.to_string()))?;
        headers.push((name, value));
    }
    Ok(HttpGet {
        target: Target {
            host: host("httpGet", raw.host)?,
            port: port("httpGet", raw.port)?,
        },
        https,
        path,
        headers,
    })
}

fn port(kind: &'static str, raw: RawPort) -> Result<u16, ProbeRefusal> {
    let number = match raw {
        RawPort::Number(n) => n,
        // `IntOrString` as a string of digits: the kubelet takes it as the number.
        RawPort::Name(s) => match s.parse::<i64>() {
            Ok(n) => n,
            Err(_) => return Err(ProbeRefusal::NamedPort { kind, name: s }),
        },
    };
    u16::try_from(number)
        .ok()
        .filter(|p| *p != 0)
        .ok_or(ProbeRefusal::Port { kind, port: number })
}

fn host(kind: &'static str, raw: Option<String>) -> Result<String, ProbeRefusal> {
    let host = match raw {
        None => return Ok(DEFAULT_HOST.to_owned()),
        Some(h) if h.is_empty() => return Ok(DEFAULT_HOST.to_owned()),
        Some(h) => h,
    };
    // Brackets are the URL's business, not the host's.
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<IpAddr>().is_ok() {
        return Ok(bare.to_owned());
    }
    let name_like = host
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
    if name_like {
        Ok(host)
    } else {
        Err(ProbeRefusal::Host { kind, host })
    }
}

impl Target {
    /// `host:port`, an IPv6 address in brackets.
    pub fn authority(&self) -> String {
        match self.host.parse::<IpAddr>() {
            Ok(IpAddr::V6(v6)) => format!("[{v6}]:{}", self.port),
            _ => format!("{}:{}", self.host, self.port),
        }
    }

    async fn connect(&self, probe: &str) -> Result<TcpStream, ProbeFailure> {
        let connected = match self.host.parse::<IpAddr>() {
            Ok(ip) => TcpStream::connect((ip, self.port)).await,
            Err(_) => TcpStream::connect((self.host.as_str(), self.port)).await,
        };
        connected.map_err(|source| {
            if source.kind() == std::io::ErrorKind::ConnectionRefused {
                ProbeFailure::Refused {
                    probe: probe.to_owned(),
                }
            } else {
                ProbeFailure::Connect {
                    probe: probe.to_owned(),
                    source,
                }
            }
        })
    }
}

impl Action {
    /// What the probe does, as its answer says it: `GET http://127.0.0.1:8080/healthz`.
    pub fn describe(&self) -> String {
        match self {
            Action::Http(get) => format!(
                "GET {}://{}{}",
                if get.https { "https" } else { "http" },
                get.target.authority(),
                get.path
            ),
            Action::Tcp(target) => format!("TCP connect to {}", target.authority()),
            Action::Grpc(check) => format!(
                "gRPC health check of {:?} at {}",
                check.service,
                check.target.authority()
            ),
        }
    }
}

impl AppProbe {
    /// Runs the probe, bounded by its timeout: `Ok` with what passed, or why it failed.
    /// `user_agent` is the caller's (the kubelet's `kube-probe/<version>`), passed on to an
    /// HTTP app as pilot-agent passes it.
    pub async fn run(&self, user_agent: Option<&HeaderValue>) -> Result<String, ProbeFailure> {
        let probe = self.action.describe();
        let attempt = async {
            match &self.action {
                Action::Http(get) => http(get, &probe, user_agent).await,
                Action::Tcp(target) => {
                    // Connected is passed; the stream is dropped (closed) at once.
                    target.connect(&probe).await?;
                    Ok(format!("{probe}: connected"))
                }
                Action::Grpc(check) => grpc(check, &probe).await,
            }
        };
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(outcome) => outcome,
            Err(_) => Err(ProbeFailure::TimedOut {
                probe,
                after: self.timeout,
            }),
        }
    }
}

/// Whether an HTTP status passes a probe: 2xx and 3xx, as the kubelet's.
pub fn http_passes(status: u16) -> bool {
    (200..400).contains(&status)
}

/// The status name a gRPC health answer fails with, `None` for `SERVING`.
pub fn grpc_failing_status(status: i32) -> Option<&'static str> {
    use tonic_health::pb::health_check_response::ServingStatus;
    match ServingStatus::try_from(status) {
        Ok(ServingStatus::Serving) => None,
        Ok(other) => Some(other.as_str_name()),
        Err(_) => Some("an unknown status"),
    }
}

async fn http(
    get: &HttpGet,
    probe: &str,
    user_agent: Option<&HeaderValue>,
) -> Result<String, ProbeFailure> {
    let stream = get.target.connect(probe).await?;
    let mut request = http::Request::get(get.path.as_str())
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| ProbeFailure::Connect {
            probe: probe.to_owned(),
            source: std::io::Error::other(e),
        })?;
    let headers = request.headers_mut();
    if let Ok(host) = HeaderValue::from_str(&get.target.authority()) {
        headers.insert(header::HOST, host);
    }
    headers.insert(
        header::USER_AGENT,
        user_agent
            .cloned()
            .unwrap_or(HeaderValue::from_static("envoy-agent")),
    );
    headers.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
    // As the kubelet: one request a connection, so an app's idle timeout never fails a probe.
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    let mut replaced = Vec::new();
    for (name, value) in &get.headers {
        if !replaced.contains(name) {
            headers.remove(name);
            replaced.push(name.clone());
        }
        headers.append(name.clone(), value.clone());
    }
    let status = if get.https {
        let tls = tls_connect(stream, &get.target.host, probe).await?;
        send(tls, request, probe).await?
    } else {
        send(stream, request, probe).await?
    };
    if http_passes(status) {
        Ok(format!("{probe} answered {status}"))
    } else {
        Err(ProbeFailure::Status {
            probe: probe.to_owned(),
            status,
        })
    }
}

/// Sends `request` on `io` and returns the answer's status; the body is not read.
async fn send<S>(
    io: S,
    request: http::Request<http_body_util::Empty<bytes::Bytes>>,
    probe: &str,
) -> Result<u16, ProbeFailure>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let failed = |source| ProbeFailure::Http {
        probe: probe.to_owned(),
        source,
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(failed)?;
    // The connection is driven beside the request and aborted with the probe (a timeout drops
    // this future): nothing of a probe outlives it.
    let driver = AbortOnDrop(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let response = sender.send_request(request).await.map_err(failed)?;
    drop(driver);
    Ok(response.status().as_u16())
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn tls_connect(
    stream: TcpStream,
    host: &str,
    probe: &str,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, ProbeFailure> {
    use tokio_rustls::rustls;
    let failed = |source: std::io::Error| ProbeFailure::Tls {
        probe: probe.to_owned(),
        source,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| failed(std::io::Error::other(e)))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| failed(std::io::Error::other(e)))?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, stream)
        .await
        .map_err(failed)
}

/// Takes any certificate, as the kubelet's HTTPS probes do (`InsecureSkipVerify`): a probe
/// asks whether the app answers, not who it is. Handshake signatures are still checked, so
/// the TLS itself is real.
#[derive(Debug)]
struct AnyCertificate(Arc<tokio_rustls::rustls::crypto::CryptoProvider>);

impl tokio_rustls::rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &tokio_rustls::rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[tokio_rustls::rustls::pki_types::CertificateDer<'_>],
        _server_name: &tokio_rustls::rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: tokio_rustls::rustls::pki_types::UnixTime,
    ) -> Result<tokio_rustls::rustls::client::danger::ServerCertVerified, tokio_rustls::rustls::Error>
    {
        Ok(tokio_rustls::rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &tokio_rustls::rustls::pki_types::CertificateDer<'_>,
        dss: &tokio_rustls::rustls::DigitallySignedStruct,
    ) -> Result<
        tokio_rustls::rustls::client::danger::HandshakeSignatureValid,
        tokio_rustls::rustls::Error,
    > {
        tokio_rustls::rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &tokio_rustls::rustls::pki_types::CertificateDer<'_>,
        dss: &tokio_rustls::rustls::DigitallySignedStruct,
    ) -> Result<
        tokio_rustls::rustls::client::danger::HandshakeSignatureValid,
        tokio_rustls::rustls::Error,
    > {
        tokio_rustls::rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<tokio_rustls::rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

async fn grpc(check: &GrpcCheck, probe: &str) -> Result<String, ProbeFailure> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    // The connection is made here, so that a refused one says so; the channel takes it.
    let stream = check.target.connect(probe).await?;
    let mut stream = Some(stream);
    let failed = |status| ProbeFailure::Grpc {
        probe: probe.to_owned(),
        status,
    };
    // No timeout of the channel's own: the probe's bounds the whole (two racing timers would
    // make a hang a cancelled call one time in two).
    let channel = tonic::transport::Endpoint::from_static("http://app")
        .connect_with_connector(tower::service_fn(move |_| {
            let taken = stream.take();
            async move {
                taken.map(TokioIo::new).ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        "a probe makes one connection",
                    )
                })
            }
        }))
        .await
        .map_err(|e| failed(tonic::Status::unavailable(e.to_string())))?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: check.service.clone(),
        })
        .await
        .map_err(failed)?
        .into_inner();
    match grpc_failing_status(answer.status) {
        None => Ok(format!("{probe} answered SERVING")),
        Some(status) => Err(ProbeFailure::NotServing {
            probe: probe.to_owned(),
            status,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<AppProbes, ConfigError> {
        AppProbes::parse(json, Input::Istio)
    }

    fn refusal(json: &str) -> String {
        parse(json).unwrap_err().to_string()
    }

    fn target(port: u16) -> Target {
        Target {
            host: DEFAULT_HOST.to_owned(),
            port,
        }
    }

    /// Istio's documentation (tasks/observability/health-checks): the liveness probe of the
    /// `liveness-http` container, as the injector wrote it into ISTIO_KUBE_APP_PROBERS.
    const ISTIO_DOCS: &str = r#"{"/app-health/liveness-http/livez":{"httpGet":{"path":"/foo","port":8001,"scheme":"HTTP"},"timeoutSeconds":1}}"#;

    #[test]
    fn istios_documented_example_is_one_http_probe() {
        let probes = parse(ISTIO_DOCS).unwrap();
        assert_eq!(
            probes.paths().collect::<Vec<_>>(),
            ["/app-health/liveness-http/livez"]
        );
        let probe = probes.get("/app-health/liveness-http/livez").unwrap();
        assert_eq!(probe.timeout, Duration::from_secs(1));
        assert_eq!(
            probe.action,
            Action::Http(HttpGet {
                target: target(8001),
                https: false,
                path: PathAndQuery::from_static("/foo"),
                headers: Vec::new(),
            })
        );
        assert_eq!(
            probe.action.describe(),
            "GET http://127.0.0.1:8001/foo",
            "what a failure's line names"
        );
    }

    /// Every kind the injector writes, with what it leaves in (Kubernetes' own fields) and
    /// without (no timeoutSeconds when it is 0: Go's omitempty).
    #[test]
    fn each_kind_as_the_injector_writes_it() {
        let json = r#"{
            "/app-health/web/readyz": {"httpGet": {"path": "healthz?full=1", "port": "8443",
                "scheme": "HTTPS", "host": "::1",
                "httpHeaders": [{"name": "X-Probe", "value": "a"}, {"name": "x-probe", "value": "b"}]},
                "timeoutSeconds": 5, "periodSeconds": 3, "failureThreshold": 1},
            "/app-health/db/livez": {"tcpSocket": {"port": 5432}},
            "/app-health/api/startupz": {"grpc": {"port": 9090, "service": "api.v1"}, "timeoutSeconds": 0}
        }"#;
        let probes = parse(json).unwrap();
        let web = probes.get("/app-health/web/readyz").unwrap();
        assert_eq!(web.timeout, Duration::from_secs(5));
        let Action::Http(get) = &web.action else {
            panic!("{web:?}")
        };
        assert!(get.https);
        assert_eq!(get.path.as_str(), "/healthz?full=1", "the slash added");
        assert_eq!(get.target.authority(), "[::1]:8443", "a digit string port");
        assert_eq!(get.headers.len(), 2, "both values, in order");
        assert_eq!(
            web.action.describe(),
            "GET https://[::1]:8443/healthz?full=1"
        );
        let db = probes.get("/app-health/db/livez").unwrap();
        assert_eq!(db.action, Action::Tcp(target(5432)));
        assert_eq!(db.timeout, DEFAULT_TIMEOUT, "the kubelet's default");
        let api = probes.get("/app-health/api/startupz").unwrap();
        assert_eq!(
            api.action,
            Action::Grpc(GrpcCheck {
                target: target(9090),
                service: "api.v1".to_owned()
            })
        );
        assert_eq!(api.timeout, DEFAULT_TIMEOUT, "0 is the default");
        assert!(probes.get("/app-health/api/livez").is_none());
    }

    #[test]
    fn nothing_is_no_probes() {
        for empty in ["", "  ", "{}"] {
            assert!(parse(empty).unwrap().is_empty(), "{empty:?}");
        }
    }

    #[test]
    fn refusals_name_the_input_the_path_and_the_problem() {
        for (json, says) in [
            ("{not json", "is not a JSON object"),
            ("[1]", "is not a JSON object"),
            (
                r#"{"/app-health/a/healthz": {"tcpSocket": {"port": 1}}}"#,
                r#""/app-health/a/healthz" is not a path"#,
            ),
            (
                r#"{"/app-health//livez": {"tcpSocket": {"port": 1}}}"#,
                "is not a path",
            ),
            (
                r#"{"/app-health/a/livez/x": {"tcpSocket": {"port": 1}}}"#,
                "is not a path",
            ),
            (
                r#"{"/app-lifecycle/a/prestopz": {"httpGet": {"port": 1}}}"#,
                "lifecycle hooks",
            ),
            (
                r#"{"/app-health/a/livez": {"exec": {"command": ["true"]}, "periodSeconds": 1}}"#,
                "/app-health/a/livez: no httpGet, tcpSocket or grpc (the kinds the agent runs); found exec",
            ),
            (
                r#"{"/app-health/a/livez": {"tcpSocket": {"port": 1}, "grpc": {"port": 2}}}"#,
                "tcpSocket and grpc at once",
            ),
            (
                r#"{"/app-health/a/livez": {"httpGet": {"port": "http"}}}"#,
                r#"httpGet.port "http" is a named port"#,
            ),
            (
                r#"{"/app-health/a/livez": {"tcpSocket": {"port": "db"}}}"#,
                r#"tcpSocket.port "db" is a named port"#,
            ),
            (
                r#"{"/app-health/a/livez": {"tcpSocket": {"port": 70000}}}"#,
                "tcpSocket.port 70000 is not a TCP port",
            ),
            (
                r#"{"/app-health/a/livez": {"grpc": {"port": 0}}}"#,
                "grpc.port 0 is not a TCP port",
            ),
            (
                r#"{"/app-health/a/livez": {"httpGet": {"port": 1, "scheme": "FTP"}}}"#,
                r#"httpGet.scheme "FTP""#,
            ),
            (
                r#"{"/app-health/a/livez": {"httpGet": {"port": 1, "httpHeaders": [{"name": "a b", "value": "x"}]}}}"#,
                r#"httpGet.httpHeaders: "a b""#,
            ),
            (
                r#"{"/app-health/a/livez": {"httpGet": {"port": 1, "host": "a/b"}}}"#,
                r#"httpGet.host "a/b""#,
            ),
            (
                r#"{"/app-health/a/livez": {"httpGet": {"path": "/"}}}"#,
                "not a probe: missing field `port`",
            ),
            (
                r#"{"/app-health/a/livez": {"tcpSocket": {"port": 1}, "timeoutSeconds": -1}}"#,
                "timeoutSeconds -1 is negative",
            ),
        ] {
            let message = refusal(json);
            assert!(
                message.starts_with("ISTIO_KUBE_APP_PROBERS"),
                "{json}: {message}"
            );
            assert!(message.contains(says), "{json}: {message}");
        }
        let flag = AppProbes::parse("{", Input::Flag).unwrap_err().to_string();
        assert!(
            flag.starts_with("--app-probers (ENVOY_AGENT_APP_PROBERS)"),
            "{flag}"
        );
    }

    #[test]
    fn http_2xx_and_3xx_pass() {
        for status in [200, 204, 301, 302, 399] {
            assert!(http_passes(status), "{status}");
        }
        for status in [100, 199, 400, 404, 500, 503] {
            assert!(!http_passes(status), "{status}");
        }
    }

    #[test]
    fn grpc_only_serving_passes() {
        assert_eq!(grpc_failing_status(1), None, "SERVING");
        assert_eq!(grpc_failing_status(2), Some("NOT_SERVING"));
        assert_eq!(grpc_failing_status(0), Some("UNKNOWN"));
        assert_eq!(grpc_failing_status(3), Some("SERVICE_UNKNOWN"));
        assert_eq!(grpc_failing_status(42), Some("an unknown status"));
    }

    /// An HTTP server on loopback answering every request with `status`, after reading the
    /// request head, which it hands back.
    async fn http_app(status: u16) -> (u16, tokio::sync::mpsc::Receiver<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (heads, rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = heads
                    .send(String::from_utf8_lossy(&head).into_owned())
                    .await;
                let answer = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n");
                let _ = stream.write_all(answer.as_bytes()).await;
            }
        });
        (port, rx)
    }

    fn http_probe(port: u16, headers: Vec<(HeaderName, HeaderValue)>) -> AppProbe {
        AppProbe {
            action: Action::Http(HttpGet {
                target: target(port),
                https: false,
                path: PathAndQuery::from_static("/healthz"),
                headers,
            }),
            timeout: Duration::from_secs(5),
        }
    }

    #[tokio::test]
    async fn an_http_probe_sends_its_headers_and_judges_the_status() {
        let (port, mut heads) = http_app(204).await;
        let probe = http_probe(
            port,
            vec![
                (
                    HeaderName::from_static("x-probe"),
                    HeaderValue::from_static("yes"),
                ),
                (header::HOST, HeaderValue::from_static("app.example")),
            ],
        );
        let passed = probe
            .run(Some(&HeaderValue::from_static("kube-probe/1.31")))
            .await
            .unwrap();
        assert_eq!(
            passed,
            format!("GET http://127.0.0.1:{port}/healthz answered 204")
        );
        let head = heads.recv().await.unwrap().to_ascii_lowercase();
        assert!(head.starts_with("get /healthz http/1.1\r\n"), "{head}");
        for line in [
            "x-probe: yes",
            "host: app.example",
            "user-agent: kube-probe/1.31",
            "connection: close",
        ] {
            assert!(head.contains(line), "{line}: {head}");
        }
        assert_eq!(head.matches("host:").count(), 1, "replaced: {head}");

        let (port, _heads) = http_app(503).await;
        let failed = http_probe(port, Vec::new()).run(None).await.unwrap_err();
        assert!(matches!(failed, ProbeFailure::Status { status: 503, .. }));
        assert_eq!(
            failed.to_string(),
            format!("GET http://127.0.0.1:{port}/healthz answered 503")
        );
    }

    #[tokio::test]
    async fn a_probe_nothing_listens_for_is_refused() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        for action in [
            Action::Tcp(target(port)),
            Action::Grpc(GrpcCheck {
                target: target(port),
                service: String::new(),
            }),
        ] {
            let probe = AppProbe {
                action,
                timeout: Duration::from_secs(5),
            };
            let failed = probe.run(None).await.unwrap_err();
            assert!(matches!(failed, ProbeFailure::Refused { .. }), "{failed}");
            assert!(
                failed.to_string().ends_with(": connect refused"),
                "{failed}"
            );
        }
        let failed = http_probe(port, Vec::new()).run(None).await.unwrap_err();
        assert_eq!(
            failed.to_string(),
            format!("GET http://127.0.0.1:{port}/healthz: connect refused")
        );
    }

    #[tokio::test]
    async fn a_probe_that_hangs_fails_at_its_timeout() {
        // Accepts (the backlog does) and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        for action in [
            Action::Http(HttpGet {
                target: target(port),
                https: false,
                path: PathAndQuery::from_static("/"),
                headers: Vec::new(),
            }),
            Action::Grpc(GrpcCheck {
                target: target(port),
                service: String::new(),
            }),
        ] {
            let probe = AppProbe {
                action,
                timeout: Duration::from_millis(200),
            };
            let failed = probe.run(None).await.unwrap_err();
            assert!(
                matches!(failed, ProbeFailure::TimedOut { after, .. } if after == Duration::from_millis(200)),
                "{failed}"
            );
            assert!(
                failed.to_string().ends_with("timed out after 200ms"),
                "{failed}"
            );
        }
        drop(listener);
    }
}

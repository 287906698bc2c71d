//! A small client for Envoy's admin API.
//!
//! Every call opens its own HTTP/1 connection and is bounded as a whole (connect, request,
//! body) by the client's timeout: a drain POST that hangs is how Istio lost pods (#50596).
//! Every call checks the status code, and every error names the address and the endpoint.
//! The exceptions are questions asked over and over of one process (the watchdog's every
//! second, [`AdminClient::state_kept`]; a starting epoch's LIVE checks,
//! [`AdminClient::live_state_kept`]), which may reuse a [`KeptConnection`].
//!
//! What the periodic questions ask costs Envoy the same on any config: `/ready` on a
//! connection whose process is known, `/server_info` when it must be learnt. Never
//! `/stats?filter=` there: Envoy visits every stat to answer one (0.4–0.9 s of its main thread
//! at ~570k stats, and the main thread also applies xDS and serves the admin API).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::{TcpStream, UnixStream};

/// The default bound on one admin call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest admin response we read (a full `/stats` of a big Envoy is a few MiB).
const MAX_BODY: usize = 64 << 20;

/// Where Envoy's admin API listens: a TCP address, or a Unix socket (`admin.address.pipe`),
/// which only those who may enter its directory can reach (`docs/security.md`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Address {
    /// `admin.address.socket_address`: anyone of the network namespace can connect.
    Tcp(SocketAddr),
    /// `admin.address.pipe`: a path, reached through the file system's permissions.
    Unix(PathBuf),
}

impl Address {
    /// As Envoy writes it to `--admin-address-path`: `ip:port`, or the socket's path.
    pub fn parse(text: &str) -> Option<Address> {
        let text = text.trim();
        if text.starts_with('/') {
            return Some(Address::Unix(PathBuf::from(text)));
        }
        if let Some(path) = text.strip_prefix("unix:") {
            return (!path.is_empty()).then(|| Address::Unix(PathBuf::from(path)));
        }
        text.parse().ok().map(Address::Tcp)
    }

    /// The TCP address, if it is one.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            Address::Tcp(addr) => Some(*addr),
            Address::Unix(_) => None,
        }
    }

    /// The socket's path, if it is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Address::Tcp(_) => None,
            Address::Unix(path) => Some(path),
        }
    }

    /// The `Host` header of a request to it.
    fn host(&self) -> String {
        match self {
            Address::Tcp(addr) => addr.to_string(),
            Address::Unix(_) => "localhost".to_owned(),
        }
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(addr) => write!(f, "{addr}"),
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

impl std::str::FromStr for Address {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Address::parse(text).ok_or_else(|| format!("{text:?} is neither ip:port nor a socket path"))
    }
}

impl From<SocketAddr> for Address {
    fn from(addr: SocketAddr) -> Self {
        Address::Tcp(addr)
    }
}

impl From<PathBuf> for Address {
    fn from(path: PathBuf) -> Self {
        Address::Unix(path)
    }
}

/// Why an admin call failed. Every variant names the admin address and the endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// Nothing accepted the connection.
    #[error("envoy admin {addr}{endpoint}: cannot connect: {source}")]
    Connect {
        /// Admin address.
        addr: Address,
        /// Path and query called.
        endpoint: String,
        /// The connect error.
        source: std::io::Error,
    },
    /// The call did not finish within the timeout.
    #[error("envoy admin {addr}{endpoint}: no answer within {timeout:?}")]
    Timeout {
        /// Admin address.
        addr: Address,
        /// Path and query called.
        endpoint: String,
        /// The bound that ran out.
        timeout: Duration,
    },
    /// The HTTP exchange failed.
    #[error("envoy admin {addr}{endpoint}: {message}")]
    Http {
        /// Admin address.
        addr: Address,
        /// Path and query called.
        endpoint: String,
        /// What went wrong.
        message: String,
    },
    /// Envoy answered with an unexpected status.
    #[error("envoy admin {addr}{endpoint}: HTTP {status}: {body}")]
    Status {
        /// Admin address.
        addr: Address,
        /// Path and query called.
        endpoint: String,
        /// The status code.
        status: StatusCode,
        /// The start of the response body.
        body: String,
    },
    /// The body was not what the endpoint documents.
    #[error("envoy admin {addr}{endpoint}: unexpected response: {message}")]
    Decode {
        /// Admin address.
        addr: Address,
        /// Path and query called.
        endpoint: String,
        /// What did not parse.
        message: String,
    },
}

impl AdminError {
    /// Whether nothing listens at the address: a TCP connection refused; for a Unix socket,
    /// also no socket at the path (none was bound yet, or the directory is gone).
    pub fn nothing_listens(&self) -> bool {
        let AdminError::Connect { addr, source, .. } = self else {
            return false;
        };
        match source.kind() {
            std::io::ErrorKind::ConnectionRefused => true,
            std::io::ErrorKind::NotFound => matches!(addr, Address::Unix(_)),
            _ => false,
        }
    }

    /// Whether the call failed for want of the agent's own resources (file descriptors,
    /// memory, local ports, buffer space) before anything reached Envoy: such an error says
    /// nothing of Envoy, and must never be taken for Envoy being silent.
    pub fn is_local_resource(&self) -> bool {
        use nix::errno::Errno;
        let AdminError::Connect { source, .. } = self else {
            return false;
        };
        source.raw_os_error().is_some_and(|code| {
            matches!(
                Errno::from_raw(code),
                Errno::EMFILE
                    | Errno::ENFILE
                    | Errno::ENOMEM
                    | Errno::ENOBUFS
                    | Errno::EADDRNOTAVAIL
            )
        })
    }
}

/// The pause before asking again a question whose answer took `took`, so that asking it
/// takes at most `1/share` of Envoy's main thread (on a large config a `/stats?filter=` takes
/// Envoy most of a second to answer: it visits every stat), and never less than `base`.
pub fn paced(base: Duration, took: Duration, share: u32) -> Duration {
    base.max(took.saturating_mul(share))
}

/// The share of Envoy's main thread a question asked while something waits on its answer
/// (a drain's count, readiness waiting for the control plane) may take at most: 1/20.
pub const BUSY_SHARE: u32 = 20;
/// ... and one asked only for the status: 1/100.
pub const IDLE_SHARE: u32 = 100;

/// Envoy's server state, from `/server_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ServerState {
    /// Before the config is loaded.
    PreInitializing,
    /// Loading config, warming clusters.
    Initializing,
    /// Serving.
    Live,
    /// Health checks failed (`/healthcheck/fail`).
    Draining,
    /// A state this client does not know.
    #[serde(other)]
    Unknown,
}

/// The parts of `/server_info` a supervisor needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// Envoy's build version string.
    pub version: String,
    /// Server state.
    pub state: ServerState,
    /// `--restart-epoch` of the answering process.
    pub restart_epoch: u32,
    /// `--base-id` of the answering process.
    pub base_id: u64,
    /// E.g. `11.104`, or `disabled` when hot restart is off.
    pub hot_restart_version: String,
    /// Uptime of this epoch as Envoy prints it (e.g. `12s`).
    pub uptime_current_epoch: String,
    /// Its hot-restart channel (`--socket-path`).
    pub socket_path: crate::SocketPath,
}

/// Why a `/server_info` body was not understood.
#[derive(Debug, thiserror::Error)]
pub enum ServerInfoError {
    /// Not the JSON Envoy answers.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// Its base id is not a number.
    #[error("base_id: {0}")]
    BaseId(#[from] std::num::ParseIntError),
}

impl ServerInfo {
    /// Parses a `/server_info` body (JSON).
    pub fn parse(body: &[u8]) -> Result<ServerInfo, ServerInfoError> {
        let raw: RawServerInfo = serde_json::from_slice(body)?;
        let base_id = if raw.command_line_options.base_id.is_empty() {
            0
        } else {
            raw.command_line_options.base_id.parse()?
        };
        Ok(ServerInfo {
            version: raw.version,
            state: raw.state,
            restart_epoch: raw.command_line_options.restart_epoch,
            base_id,
            hot_restart_version: raw.hot_restart_version,
            uptime_current_epoch: raw.uptime_current_epoch,
            socket_path: if raw.command_line_options.socket_path.is_empty() {
                crate::SocketPath::envoy_default()
            } else {
                crate::SocketPath::parse(&raw.command_line_options.socket_path)
            },
        })
    }
}

#[derive(Deserialize)]
struct RawServerInfo {
    version: String,
    state: ServerState,
    hot_restart_version: String,
    #[serde(default)]
    uptime_current_epoch: String,
    command_line_options: RawOptions,
}

#[derive(Deserialize)]
struct RawOptions {
    #[serde(default)]
    restart_epoch: u32,
    // uint64 is a JSON string in proto3's JSON mapping.
    #[serde(default)]
    base_id: String,
    #[serde(default)]
    socket_path: String,
}

impl ServerInfo {
    /// Which epoch this is, in which state, up how long.
    pub fn admin_state(&self) -> AdminState {
        AdminState {
            epoch: self.restart_epoch,
            state: self.state,
            uptime: parse_uptime(&self.uptime_current_epoch),
        }
    }
}

/// Envoy's uptime as `/server_info` prints it: a protobuf Duration in JSON (`12s`, `0.5s`).
fn parse_uptime(text: &str) -> Option<Duration> {
    let seconds: f64 = text.strip_suffix('s')?.parse().ok()?;
    Duration::try_from_secs_f64(seconds).ok()
}

/// Which epoch answers on an admin address, and its state.
///
/// Asked of Envoy only in ways whose cost does not grow with its config: `/server_info` (its
/// node section lists every extension, ~120 KiB, the same for any config) when the process
/// behind an address must be learnt, `/ready` (a word) on a connection whose process is known.
/// `/stats?filter=` is never asked for it: Envoy visits every stat to answer (0.4–0.9 s of its
/// main thread at ~570k stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdminState {
    /// The answering process's `--restart-epoch`.
    pub epoch: u32,
    /// Its state.
    pub state: ServerState,
    /// This process's own uptime (`uptime_current_epoch`), when it was asked.
    pub uptime: Option<Duration>,
}

impl ServerState {
    /// The state `/ready` names in its body.
    pub fn from_ready(text: &str) -> ServerState {
        match text.trim() {
            "LIVE" => ServerState::Live,
            "DRAINING" => ServerState::Draining,
            "PRE_INITIALIZING" => ServerState::PreInitializing,
            "INITIALIZING" => ServerState::Initializing,
            _ => ServerState::Unknown,
        }
    }
}

/// Answer of `/ready`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// 200: LIVE.
    Ready,
    /// 503, with the state Envoy named.
    NotReady(String),
}

/// Options of `POST /drain_listeners`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DrainListeners {
    /// Only inbound listeners (sidecars); all listeners otherwise (gateways).
    pub inbound_only: bool,
    /// Drain gracefully over `--drain-time-s` instead of closing listeners at once.
    pub graceful: bool,
    /// Never stop the listeners (Envoy keeps accepting; answers get `Connection: close`).
    pub skip_exit: bool,
}

impl DrainListeners {
    /// The path and query of this drain.
    pub fn endpoint(&self) -> String {
        let mut flags = Vec::new();
        if self.inbound_only {
            flags.push("inboundonly");
        }
        if self.graceful {
            flags.push("graceful");
        }
        if self.skip_exit {
            flags.push("skip_exit");
        }
        if flags.is_empty() {
            "/drain_listeners".to_owned()
        } else {
            format!("/drain_listeners?{}", flags.join("&"))
        }
    }
}

/// A listener and the address it is bound to, from `/listeners?format=json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerStatus {
    /// Listener name.
    pub name: String,
    /// Bound address, when it is a socket address.
    pub local_address: Option<SocketAddr>,
}

/// A client for one Envoy admin address.
#[derive(Debug, Clone)]
pub struct AdminClient {
    addr: Address,
    timeout: Duration,
}

// === impl AdminClient ===

impl AdminClient {
    /// A client with [`DEFAULT_TIMEOUT`].
    pub fn new(addr: impl Into<Address>) -> Self {
        AdminClient {
            addr: addr.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// A client with the same bound for another address.
    pub fn at(&self, addr: impl Into<Address>) -> Self {
        AdminClient {
            addr: addr.into(),
            timeout: self.timeout,
        }
    }

    /// The same client with another bound on each call.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The admin address.
    pub fn addr(&self) -> &Address {
        &self.addr
    }

    /// `GET /server_info`.
    pub async fn server_info(&self) -> Result<ServerInfo, AdminError> {
        let endpoint = "/server_info";
        let body = self.call_ok(Method::GET, endpoint).await?;
        ServerInfo::parse(&body).map_err(|e| self.decode(endpoint, e))
    }

    /// `GET /hot_restart_version`: the answering process's hot-restart version (e.g.
    /// `11.104`), in a few bytes where `/server_info` takes ~120 KB.
    pub async fn hot_restart_version(&self) -> Result<String, AdminError> {
        let endpoint = "/hot_restart_version";
        let body = self.call_ok(Method::GET, endpoint).await?;
        let version = String::from_utf8_lossy(&body).trim().to_owned();
        if version.is_empty() {
            return Err(self.decode(endpoint, "the answer names no hot-restart version"));
        }
        Ok(version)
    }

    /// `GET /ready`: 200 is ready, 503 is not (with the state), anything else is an error.
    pub async fn ready(&self) -> Result<Readiness, AdminError> {
        let endpoint = "/ready";
        let (status, body) = self.call(Method::GET, endpoint).await?;
        let text = String::from_utf8_lossy(&body).trim().to_owned();
        match status {
            StatusCode::OK => Ok(Readiness::Ready),
            StatusCode::SERVICE_UNAVAILABLE => Ok(Readiness::NotReady(text)),
            status => Err(self.status(endpoint, status, &body)),
        }
    }

    /// [`AdminClient::admin_state`] over `kept`'s connection when it has one to this address
    /// younger than `renew` (then a `/ready` on it: the process behind it was learnt when it
    /// was opened), else over a new one that `kept` then keeps. A kept connection that broke
    /// (Envoy closed it) is replaced within the call; one that does not answer is a timeout,
    /// as a new one would be, and is not kept.
    ///
    /// Why renew at all: a kept connection goes on reaching the process that accepted it.
    /// Tried with Envoy 1.40: after epoch 1 took the admin address over, a connection opened to
    /// epoch 0 before went on answering for epoch 0 (for 2 s, 40 requests) while every new
    /// connection reached epoch 1. So a takeover, or a listener lost while Envoy lives, is seen
    /// over a kept connection only once it is renewed.
    pub async fn state_kept(
        &self,
        kept: &mut KeptConnection,
        renew: Duration,
    ) -> Result<AdminState, AdminError> {
        let reusable = kept
            .connection
            .take()
            .filter(|k| k.connection.addr == self.addr && k.opened.elapsed() < renew);
        let exchange = async {
            if let Some(mut k) = reusable {
                if let Ok((status, body)) = k.connection.get("/ready").await {
                    let state = self.ready_state(status, &body)?;
                    let answer = AdminState {
                        epoch: k.epoch,
                        state,
                        uptime: None,
                    };
                    kept.connection = Some(k);
                    return Ok(answer);
                }
                // Closed by Envoy since (an idle timeout, a drain): not an answer.
            }
            let mut connection = self.connect("/server_info").await?;
            let answer = self.server_info_on(&mut connection).await?.admin_state();
            kept.connection = Some(Kept {
                connection,
                opened: std::time::Instant::now(),
                epoch: answer.epoch,
            });
            Ok(answer)
        };
        self.bounded("/ready", exchange).await
    }

    /// Which epoch answers, its state and uptime: `/server_info` on a new connection.
    pub async fn admin_state(&self) -> Result<AdminState, AdminError> {
        Ok(self.server_info().await?.admin_state())
    }

    /// Whether the admin answers LIVE, and then who: `/server_info` on a new connection (for
    /// an address whose process is not known; see [`AdminClient::live_state_kept`]).
    pub async fn live_state(&self) -> Result<Option<AdminState>, AdminError> {
        let state = self.admin_state().await?;
        Ok(Some(state).filter(|s| s.state == ServerState::Live))
    }

    /// [`AdminClient::ready`] over `kept`'s connection when it has one to this address
    /// (replaced within the call when Envoy closed it), else over a new one that `kept` then
    /// keeps: the watchdog's checks, a second apart, cost Envoy a question each, not a
    /// connection. One that does not answer is a timeout and is not kept.
    pub async fn ready_kept(&self, kept: &mut KeptConnection) -> Result<Readiness, AdminError> {
        let reusable = kept
            .connection
            .take()
            .filter(|k| k.connection.addr == self.addr);
        let exchange = async {
            let (k, (status, body)) = self.ready_over(reusable, 0).await?;
            let readiness = match status {
                StatusCode::OK => Readiness::Ready,
                StatusCode::SERVICE_UNAVAILABLE => {
                    Readiness::NotReady(String::from_utf8_lossy(&body).trim().to_owned())
                }
                status => return Err(self.status("/ready", status, &body)),
            };
            kept.connection = Some(k);
            Ok(readiness)
        };
        self.bounded("/ready", exchange).await
    }

    /// Whether `epoch`, known to hold this address (its admin listener was bound after its
    /// parent's was shut), answers LIVE: `/ready` over `kept`'s connection when it was opened to
    /// that epoch (replaced within the call if Envoy closed it), else over a new one that
    /// `kept` then keeps while the answer is "not LIVE". A question on an open connection costs
    /// a starting Envoy's main thread less than an accept, a connection and its teardown.
    pub async fn live_state_kept(
        &self,
        kept: &mut KeptConnection,
        epoch: u32,
    ) -> Result<Option<AdminState>, AdminError> {
        let reusable = kept
            .connection
            .take()
            .filter(|k| k.connection.addr == self.addr && k.epoch == epoch);
        let exchange = async {
            let (k, (status, body)) = self.ready_over(reusable, epoch).await?;
            match self.ready_state(status, &body)? {
                ServerState::Live => Ok(Some(AdminState {
                    epoch,
                    state: ServerState::Live,
                    uptime: None,
                })),
                _ => {
                    kept.connection = Some(k);
                    Ok(None)
                }
            }
        };
        self.bounded("/ready", exchange).await
    }

    /// `GET /ready` on `reusable` when there is one and it still answers (Envoy may have closed
    /// it since: an idle timeout, a drain), else on a new connection, kept as opened to
    /// `epoch`. Unbounded: the caller bounds the exchange.
    async fn ready_over(
        &self,
        reusable: Option<Kept>,
        epoch: u32,
    ) -> Result<(Kept, (StatusCode, Bytes)), AdminError> {
        if let Some(mut k) = reusable {
            if let Ok(answer) = k.connection.get("/ready").await {
                return Ok((k, answer));
            }
        }
        let mut connection = self.connect("/ready").await?;
        let answer = connection.get("/ready").await?;
        let k = Kept {
            connection,
            opened: std::time::Instant::now(),
            epoch,
        };
        Ok((k, answer))
    }

    /// `/server_info` on `connection`.
    async fn server_info_on(&self, connection: &mut Connection) -> Result<ServerInfo, AdminError> {
        let endpoint = "/server_info";
        let (status, body) = connection.get(endpoint).await?;
        if status != StatusCode::OK {
            return Err(self.status(endpoint, status, &body));
        }
        ServerInfo::parse(&body).map_err(|e| self.decode(endpoint, e))
    }

    /// The state a `/ready` answer says: 200 is LIVE, 503 names the state.
    fn ready_state(&self, status: StatusCode, body: &[u8]) -> Result<ServerState, AdminError> {
        match status {
            StatusCode::OK => Ok(ServerState::Live),
            StatusCode::SERVICE_UNAVAILABLE => Ok(ServerState::from_ready(
                String::from_utf8_lossy(body).trim(),
            )),
            status => Err(self.status("/ready", status, body)),
        }
    }

    /// `exchange`, bounded by the client's timeout.
    async fn bounded<T>(
        &self,
        endpoint: &str,
        exchange: impl std::future::Future<Output = Result<T, AdminError>>,
    ) -> Result<T, AdminError> {
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(AdminError::Timeout {
                addr: self.addr.clone(),
                endpoint: endpoint.to_owned(),
                timeout: self.timeout,
            }),
        }
    }

    /// `GET /stats?filter=<regex>` (plus `usedonly`), as Envoy's text format.
    pub async fn stats(&self, filter: &str, used_only: bool) -> Result<String, AdminError> {
        let mut endpoint = format!("/stats?filter={}", percent_encode(filter));
        if used_only {
            endpoint.push_str("&usedonly");
        }
        let body = self.call_ok(Method::GET, &endpoint).await?;
        String::from_utf8(body.to_vec()).map_err(|e| self.decode(&endpoint, e))
    }

    /// `GET /stats/prometheus`, as Envoy serves it.
    pub async fn prometheus_stats(&self) -> Result<Bytes, AdminError> {
        self.call_ok(Method::GET, "/stats/prometheus").await
    }

    /// `GET /stats/prometheus?<query>` (`query` already encoded; empty for none), its body
    /// passed on as it arrives (see [`AdminClient::get_stream`]).
    pub async fn prometheus_stream(&self, query: &str) -> Result<StreamedBody, AdminError> {
        let endpoint = if query.is_empty() {
            "/stats/prometheus".to_owned()
        } else {
            format!("/stats/prometheus?{query}")
        };
        self.get_stream(&endpoint).await
    }

    /// `GET <endpoint>` (path and query, already encoded), its body passed on as it arrives:
    /// a large config's `/stats` or `/config_dump` is tens of MiB, never to be held whole.
    /// The answer's head comes within the client's timeout; the body is the caller's to bound.
    /// An answer other than 200 (Envoy refusing the query: a regex it cannot compile) is an
    /// [`AdminError::Status`] with the start of Envoy's words.
    pub async fn get_stream(&self, endpoint: &str) -> Result<StreamedBody, AdminError> {
        let exchange = async {
            let mut connection = self.connect(endpoint).await?;
            let response = connection.send(Method::GET, endpoint).await?;
            if response.status() != StatusCode::OK {
                let status = response.status();
                let body = Limited::new(response.into_body(), 4096)
                    .collect()
                    .await
                    .map(http_body_util::Collected::to_bytes)
                    .unwrap_or_default();
                return Err(self.status(endpoint, status, &body));
            }
            Ok(StreamedBody {
                body: response.into_body(),
                _connection: connection,
            })
        };
        self.bounded(endpoint, exchange).await
    }

    /// Every logger's level, as Envoy lists them (`POST /logging` without a change: Envoy takes
    /// no `GET` there): `  upstream: debug` lines.
    pub async fn loggers(&self) -> Result<String, AdminError> {
        let body = self.call_ok(Method::POST, "/logging").await?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// `POST /logging?...` for each query of `change` ([`LogLevel::admin_queries`]), in order;
    /// the first refusal ends it (Envoy checks component names before it changes anything).
    ///
    /// [`LogLevel::admin_queries`]: crate::log_level::LogLevel::admin_queries
    pub async fn set_log_level(
        &self,
        change: &crate::log_level::LogLevel,
    ) -> Result<(), AdminError> {
        for query in change.admin_queries() {
            self.call_ok(Method::POST, &format!("/logging?{query}"))
                .await?;
        }
        Ok(())
    }

    /// `POST /drain_listeners?...`.
    pub async fn drain_listeners(&self, options: DrainListeners) -> Result<(), AdminError> {
        self.call_ok(Method::POST, &options.endpoint()).await?;
        Ok(())
    }

    /// `POST /healthcheck/fail`: Envoy fails its health checks and reports DRAINING.
    pub async fn healthcheck_fail(&self) -> Result<(), AdminError> {
        self.call_ok(Method::POST, "/healthcheck/fail").await?;
        Ok(())
    }

    /// `GET /config_dump?resource=<resource>&mask=<mask>` (no mask when empty), its body parsed
    /// by `parse`: Envoy serializes only the resources of that kind, and answers only the
    /// masked fields.
    pub async fn config_dump<T>(
        &self,
        resource: &str,
        mask: &str,
        parse: impl FnOnce(&[u8]) -> Result<T, serde_json::Error>,
    ) -> Result<T, AdminError> {
        let endpoint = match mask {
            "" => format!("/config_dump?resource={resource}"),
            mask => format!("/config_dump?resource={resource}&mask={mask}"),
        };
        let body = self.call_ok(Method::GET, &endpoint).await?;
        parse(&body).map_err(|e| self.decode(&endpoint, e))
    }

    /// `GET /listeners?format=json`: each listener and its bound address (finds port-0 binds).
    pub async fn listeners(&self) -> Result<Vec<ListenerStatus>, AdminError> {
        #[derive(Deserialize)]
        struct Raw {
            #[serde(default)]
            listener_statuses: Vec<RawListener>,
        }
        #[derive(Deserialize)]
        struct RawListener {
            name: String,
            local_address: Option<RawAddress>,
        }
        #[derive(Deserialize)]
        struct RawAddress {
            socket_address: Option<RawSocketAddress>,
        }
        #[derive(Deserialize)]
        struct RawSocketAddress {
            address: String,
            #[serde(default)]
            port_value: u16,
        }
        let endpoint = "/listeners?format=json";
        let body = self.call_ok(Method::GET, endpoint).await?;
        let raw: Raw = serde_json::from_slice(&body).map_err(|e| self.decode(endpoint, e))?;
        Ok(raw
            .listener_statuses
            .into_iter()
            .map(|l| ListenerStatus {
                name: l.name,
                local_address: l
                    .local_address
                    .and_then(|a| a.socket_address)
                    .and_then(|s| {
                        s.address
                            .parse::<std::net::IpAddr>()
                            .ok()
                            .map(|ip| SocketAddr::new(ip, s.port_value))
                    }),
            })
            .collect())
    }

    async fn call_ok(&self, method: Method, endpoint: &str) -> Result<Bytes, AdminError> {
        let (status, body) = self.call(method, endpoint).await?;
        if status != StatusCode::OK {
            return Err(self.status(endpoint, status, &body));
        }
        Ok(body)
    }

    /// One request on a fresh connection, bounded by the timeout as a whole.
    async fn call(
        &self,
        method: Method,
        endpoint: &str,
    ) -> Result<(StatusCode, Bytes), AdminError> {
        match tokio::time::timeout(self.timeout, self.exchange(method, endpoint)).await {
            Ok(result) => result,
            Err(_) => Err(AdminError::Timeout {
                addr: self.addr.clone(),
                endpoint: endpoint.to_owned(),
                timeout: self.timeout,
            }),
        }
    }

    async fn exchange(
        &self,
        method: Method,
        endpoint: &str,
    ) -> Result<(StatusCode, Bytes), AdminError> {
        self.connect(endpoint)
            .await?
            .request(method, endpoint)
            .await
    }

    /// A new HTTP/1.1 connection to the admin address (`endpoint`: for errors).
    async fn connect(&self, endpoint: &str) -> Result<Connection, AdminError> {
        let connect_error = |source| AdminError::Connect {
            addr: self.addr.clone(),
            endpoint: endpoint.to_owned(),
            source,
        };
        let handshake_error = |e: hyper::Error| AdminError::Http {
            addr: self.addr.clone(),
            endpoint: endpoint.to_owned(),
            message: format!("handshake: {e}"),
        };
        let sender = match &self.addr {
            Address::Tcp(addr) => {
                let stream = TcpStream::connect(addr).await.map_err(connect_error)?;
                handshake(stream).await.map_err(handshake_error)?
            }
            Address::Unix(path) => {
                let stream = UnixStream::connect(path).await.map_err(connect_error)?;
                handshake(stream).await.map_err(handshake_error)?
            }
        };
        Ok(Connection {
            addr: self.addr.clone(),
            sender,
        })
    }

    fn status(&self, endpoint: &str, status: StatusCode, body: &[u8]) -> AdminError {
        let text = String::from_utf8_lossy(body);
        AdminError::Status {
            addr: self.addr.clone(),
            endpoint: endpoint.to_owned(),
            status,
            body: text.trim().chars().take(200).collect(),
        }
    }

    fn decode(&self, endpoint: &str, e: impl std::fmt::Display) -> AdminError {
        AdminError::Decode {
            addr: self.addr.clone(),
            endpoint: endpoint.to_owned(),
            message: e.to_string(),
        }
    }
}

/// HTTP/1.1 over `stream`, TCP or Unix. The connection task ends once the sender is dropped
/// (with its `Connection`).
async fn handshake<S>(
    stream: S,
) -> Result<hyper::client::conn::http1::SendRequest<Empty<Bytes>>, hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// A connection to an admin address kept between calls of [`AdminClient::state_kept`] or
/// [`AdminClient::live_state_kept`] (none at first), with the epoch of the process behind it.
/// Dropping it closes the connection.
#[derive(Default)]
pub struct KeptConnection {
    connection: Option<Kept>,
}

struct Kept {
    connection: Connection,
    opened: std::time::Instant,
    /// The epoch of the process that accepted it.
    epoch: u32,
}

impl std::fmt::Debug for KeptConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self
            .connection
            .as_ref()
            .map(|k| (&k.connection.addr, k.opened, k.epoch));
        f.debug_struct("KeptConnection")
            .field("connection", &kept)
            .finish()
    }
}

/// An answer's body as it arrives from Envoy (see [`AdminClient::prometheus_stream`]),
/// holding its connection.
pub struct StreamedBody {
    body: hyper::body::Incoming,
    _connection: Connection,
}

impl std::fmt::Debug for StreamedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedBody").finish_non_exhaustive()
    }
}

impl hyper::body::Body for StreamedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }
}

/// One connection to the admin API, for one request after another.
struct Connection {
    addr: Address,
    sender: hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
}

impl Connection {
    async fn get(&mut self, endpoint: &str) -> Result<(StatusCode, Bytes), AdminError> {
        self.request(Method::GET, endpoint).await
    }

    /// Sends a request; the answer's head, its body still to come.
    async fn send(
        &mut self,
        method: Method,
        endpoint: &str,
    ) -> Result<http::Response<hyper::body::Incoming>, AdminError> {
        let http = |message: String| AdminError::Http {
            addr: self.addr.clone(),
            endpoint: endpoint.to_owned(),
            message,
        };
        self.sender
            .ready()
            .await
            .map_err(|e| http(format!("connection: {e}")))?;
        let request = Request::builder()
            .method(method)
            .uri(endpoint)
            .header(http::header::HOST, self.addr.host())
            .body(Empty::<Bytes>::new())
            .map_err(|e| http(format!("building request: {e}")))?;
        self.sender
            .send_request(request)
            .await
            .map_err(|e| http(format!("request: {e}")))
    }

    async fn request(
        &mut self,
        method: Method,
        endpoint: &str,
    ) -> Result<(StatusCode, Bytes), AdminError> {
        let response = self.send(method, endpoint).await?;
        let addr = &self.addr;
        let http = |message: String| AdminError::Http {
            addr: addr.clone(),
            endpoint: endpoint.to_owned(),
            message,
        };
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| http(format!("reading body: {e}")))?
            .to_bytes();
        Ok((status, body))
    }
}

/// What a query value keeps as is: RFC 3986's unreserved characters.
const QUERY_VALUE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Percent-encodes a query value: regexes carry `^`, `|`, `\` and friends.
fn percent_encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, QUERY_VALUE).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_endpoint_flags() {
        let d = DrainListeners {
            inbound_only: true,
            graceful: true,
            skip_exit: false,
        };
        assert_eq!(d.endpoint(), "/drain_listeners?inboundonly&graceful");
        let d = DrainListeners {
            inbound_only: false,
            graceful: true,
            skip_exit: true,
        };
        assert_eq!(d.endpoint(), "/drain_listeners?graceful&skip_exit");
        assert_eq!(DrainListeners::default().endpoint(), "/drain_listeners");
    }

    #[test]
    fn a_costly_question_is_asked_less_often() {
        let base = Duration::from_millis(50);
        assert_eq!(paced(base, Duration::from_millis(1), BUSY_SHARE), base);
        assert_eq!(
            paced(base, Duration::from_millis(800), BUSY_SHARE),
            Duration::from_secs(16)
        );
        assert_eq!(
            paced(
                Duration::from_secs(10),
                Duration::from_millis(800),
                IDLE_SHARE
            ),
            Duration::from_secs(80)
        );
    }

    #[test]
    fn server_info_uptime_parses_as_envoy_prints_it() {
        assert_eq!(parse_uptime("12s"), Some(Duration::from_secs(12)));
        assert_eq!(parse_uptime("0.500s"), Some(Duration::from_millis(500)));
        assert_eq!(parse_uptime(""), None);
        assert_eq!(parse_uptime("12"), None);
        assert_eq!(parse_uptime("-1s"), None);
    }

    /// What a fake admin was asked.
    #[derive(Default)]
    struct Asked {
        connections: std::sync::atomic::AtomicU32,
        /// `/stats` requests: never from the periodic questions.
        stats: std::sync::atomic::AtomicU32,
    }

    impl Asked {
        fn connections(&self) -> u32 {
            self.connections.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    /// A fake admin on port 0 answering `/ready` with `ready` (status, body) and
    /// `/server_info` as epoch `epoch` in that state, keeping connections alive.
    async fn fake_admin(ready: (u16, &'static str), epoch: u32) -> (SocketAddr, Arc<Asked>) {
        fake_admin_closing(ready, epoch, usize::MAX).await
    }

    /// [`fake_admin`] closing each connection after `answers` answers.
    async fn fake_admin_closing(
        ready: (u16, &'static str),
        epoch: u32,
        answers: usize,
    ) -> (SocketAddr, Arc<Asked>) {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let asked = Arc::new(Asked::default());
        let count = asked.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.connections.fetch_add(1, Ordering::SeqCst);
                let count = count.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    let mut answered = 0;
                    while answered < answers {
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            match stream.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                        buf.drain(..end + 4);
                        let (status, body) = if head.starts_with("GET /ready ") {
                            (ready.0, ready.1.to_owned())
                        } else if head.starts_with("GET /hot_restart_version ") {
                            (200, "11.104\n".to_owned())
                        } else if head.starts_with("GET /server_info ") {
                            let state = match ready.0 {
                                200 => "LIVE",
                                503 => ready.1.trim(),
                                _ => "",
                            };
                            (
                                if state.is_empty() { 500 } else { 200 },
                                format!(
                                    r#"{{"version":"x","state":"{state}","hot_restart_version":"11.104","uptime_current_epoch":"9s","command_line_options":{{"restart_epoch":{epoch},"base_id":"7"}}}}"#
                                ),
                            )
                        } else {
                            count.stats.fetch_add(1, Ordering::SeqCst);
                            (404, String::new())
                        };
                        let answer = format!(
                            "HTTP/1.1 {status} X\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if stream.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                        answered += 1;
                    }
                });
            }
        });
        (addr, asked)
    }

    use std::sync::Arc;

    #[tokio::test]
    async fn live_state_asks_server_info_once() {
        let (addr, asked) = fake_admin((200, "LIVE\n"), 3).await;
        let live = AdminClient::new(addr).live_state().await.unwrap();
        assert_eq!(
            live,
            Some(AdminState {
                epoch: 3,
                state: ServerState::Live,
                uptime: Some(Duration::from_secs(9)),
            })
        );
        assert_eq!(asked.connections(), 1, "one connection");

        let (addr, asked) = fake_admin((503, "INITIALIZING\n"), 4).await;
        assert_eq!(AdminClient::new(addr).live_state().await.unwrap(), None);
        assert_eq!(asked.connections(), 1);

        let (addr, _) = fake_admin((500, "boom"), 4).await;
        let err = AdminClient::new(addr).live_state().await.unwrap_err();
        assert!(err.to_string().contains("/server_info"), "{err}");
    }

    #[tokio::test]
    async fn the_watchdogs_question_keeps_its_connection_until_renewal() {
        use std::sync::atomic::Ordering;
        let hour = Duration::from_secs(3600);
        let (addr, asked) = fake_admin((200, "LIVE\n"), 3).await;
        let client = AdminClient::new(addr);
        let mut kept = KeptConnection::default();
        let first = client.state_kept(&mut kept, hour).await.unwrap();
        assert_eq!(
            first.uptime,
            Some(Duration::from_secs(9)),
            "from /server_info"
        );
        for _ in 0..3 {
            let state = client.state_kept(&mut kept, hour).await.unwrap();
            assert_eq!((state.epoch, state.state), (3, ServerState::Live));
            assert_eq!(state.uptime, None, "from /ready on the kept connection");
        }
        assert_eq!(asked.connections(), 1, "one connection, kept");
        // Due for renewal: a new connection each time.
        for _ in 0..2 {
            client.state_kept(&mut kept, Duration::ZERO).await.unwrap();
        }
        assert_eq!(asked.connections(), 3);
        assert_eq!(asked.stats.load(Ordering::SeqCst), 0, "no stat is visited");

        // Another address (a cold family's admin): never the connection kept for the first.
        let (other, other_asked) = fake_admin((200, "LIVE\n"), 7).await;
        let state = client.at(other).state_kept(&mut kept, hour).await.unwrap();
        assert_eq!(state.epoch, 7);
        assert_eq!(other_asked.connections(), 1);

        // A draining Envoy answers 503: still its epoch, in that state.
        let (addr, _) = fake_admin((503, "DRAINING\n"), 2).await;
        let client = AdminClient::new(addr);
        let mut kept = KeptConnection::default();
        for _ in 0..2 {
            let state = client.state_kept(&mut kept, hour).await.unwrap();
            assert_eq!((state.epoch, state.state), (2, ServerState::Draining));
        }

        // Envoy closes connections after one answer: each question still gets one.
        let (addr, asked) = fake_admin_closing((200, "LIVE\n"), 5, 1).await;
        let client = AdminClient::new(addr);
        let mut kept = KeptConnection::default();
        for _ in 0..3 {
            let state = client.state_kept(&mut kept, hour).await.unwrap();
            assert_eq!(state.epoch, 5);
        }
        assert_eq!(asked.connections(), 3);
    }

    #[tokio::test]
    async fn live_checks_keep_their_connection_until_live() {
        use std::sync::atomic::Ordering;
        let (addr, asked) = fake_admin((503, "INITIALIZING\n"), 4).await;
        let client = AdminClient::new(addr);
        let mut kept = KeptConnection::default();
        for _ in 0..3 {
            assert_eq!(client.live_state_kept(&mut kept, 4).await.unwrap(), None);
        }
        assert_eq!(asked.connections(), 1, "one connection, kept");
        // Kept for epoch 4: a check of epoch 5 (the next restart's) never reuses it.
        assert_eq!(client.live_state_kept(&mut kept, 5).await.unwrap(), None);
        assert_eq!(asked.connections(), 2);
        assert_eq!(asked.stats.load(Ordering::SeqCst), 0, "no stat is visited");

        // LIVE: answered, and the connection is not kept (the checks are over).
        let (addr, asked) = fake_admin((200, "LIVE\n"), 4).await;
        let client = AdminClient::new(addr);
        for _ in 0..2 {
            let live = client.live_state_kept(&mut kept, 4).await.unwrap();
            assert_eq!(live.map(|s| s.epoch), Some(4));
        }
        assert_eq!(asked.connections(), 2);

        // Envoy closing each connection after one answer: every check still answered.
        let (addr, asked) = fake_admin_closing((503, "INITIALIZING\n"), 4, 1).await;
        let client = AdminClient::new(addr);
        for _ in 0..3 {
            assert_eq!(client.live_state_kept(&mut kept, 4).await.unwrap(), None);
        }
        assert_eq!(asked.connections(), 3);
    }

    #[tokio::test]
    async fn hot_restart_version_is_the_trimmed_answer() {
        let (addr, _) = fake_admin((200, "LIVE\n"), 3).await;
        let version = AdminClient::new(addr).hot_restart_version().await.unwrap();
        assert_eq!(version, "11.104");
    }

    #[test]
    fn ready_names_the_state() {
        assert_eq!(ServerState::from_ready("LIVE\n"), ServerState::Live);
        assert_eq!(
            ServerState::from_ready("PRE_INITIALIZING"),
            ServerState::PreInitializing
        );
        assert_eq!(
            ServerState::from_ready("INITIALIZING"),
            ServerState::Initializing
        );
        assert_eq!(ServerState::from_ready("DRAINING"), ServerState::Draining);
        assert_eq!(ServerState::from_ready("what"), ServerState::Unknown);
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            percent_encode("^(server\\.state|a)$"),
            "%5E%28server%5C.state%7Ca%29%24"
        );
        assert_eq!(
            percent_encode("downstream_cx_active"),
            "downstream_cx_active"
        );
    }
}

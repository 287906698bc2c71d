//! The status HTTP server (default `127.0.0.1:15020`): readiness (`/healthz/ready`),
//! `POST /drain` (a drain with `skip_exit`: Envoy keeps running, the next SIGTERM exits at
//! once), `POST /quitquitquit`, `/stats/prometheus` and the app's own probes
//! (`/app-health/<container>/livez|readyz|startupz`, [`crate::status::app_probe`]). What each answers,
//! and to whom, is tabled in `docs/observability.md#status-server`.
//!
//! Mutating endpoints answer 405 to other methods and 403 to non-loopback peers, whatever
//! address the server binds. In node-proxy mode ([`StatusServer::check_callers`]) the
//! loopback is the node's (hostNetwork): they also answer 403 to a peer whose socket belongs
//! to another user than the agent's, root or a `--control-allow-uid` ([`crate::callers::peer`]). A
//! sidecar's loopback is its pod's, where an app container's `POST /quitquitquit` at the end
//! of a Job is the point. The server stays up through the drain (readiness answers 503,
//! `/quitquitquit` still works) and stops only when the agent has exited.
//!
//! Routes come from [`router`], so they are tested without a socket.

pub mod app_metrics;
pub mod app_probe;
pub mod exposition;
pub mod scrape;
pub mod stats_query;

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{ConnectInfo, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use envoy_agent_proxy::{ConfigStatus, HandoffKind, ProxyPhase};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::agent::{AgentHandle, AgentState, DrainPhase, Via};
use crate::status::app_metrics::AppMetrics;
use crate::status::app_probe::AppProbes;
use crate::status::scrape::{SharedBody, WalkFailure, WalkKey, Walks};
use crate::status::stats_query::StatsQuery;

/// Bound on the admin calls a status request makes to Envoy.
const ENVOY_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the status server could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot bind the status server to {addr}: {source}")]
pub struct BindError {
    /// The address.
    pub addr: SocketAddr,
    /// The bind error.
    pub source: std::io::Error,
}

impl BindError {
    /// Whether another process holds the address.
    pub fn in_use(&self) -> bool {
        self.source.kind() == std::io::ErrorKind::AddrInUse
    }
}

/// The routes, over `agent`, without app probes.
pub fn router(agent: AgentHandle) -> Router {
    router_with(agent, Arc::default(), None)
}

/// The routes, over `agent`, with the app's probes at `/app-health/...` and the app's metrics
/// merged into the scrape when given.
pub fn router_with(
    agent: AgentHandle,
    app_probes: Arc<AppProbes>,
    app_metrics: Option<Arc<AppMetrics>>,
) -> Router {
    Router::new()
        .route("/healthz/ready", get(ready))
        .route("/drain", post(drain))
        .route("/quitquitquit", post(quit))
        .route("/stats/prometheus", get(prometheus))
        .route("/app-health/{container}/{probe}", get(app_health))
        .layer(axum::Extension(Arc::new(Walks::default())))
        .layer(axum::Extension(app_metrics))
        .layer(axum::Extension(app_probes))
        .with_state(agent)
}

/// A bound status server.
#[derive(Debug)]
pub struct StatusServer {
    listener: TcpListener,
    addr: SocketAddr,
    callers: Option<crate::callers::peer::Callers>,
    app_metrics: Option<Arc<AppMetrics>>,
    app_probes: Arc<AppProbes>,
}

/// Who may call a connection's mutating endpoints beyond loopback: its local address (to find
/// the peer's socket) and the rule, when callers are checked.
#[derive(Debug, Clone)]
struct Guard {
    local: SocketAddr,
    callers: crate::callers::peer::Callers,
}

impl StatusServer {
    /// Binds `addr` (port 0 picks a free port; see [`StatusServer::local_addr`]).
    pub async fn bind(addr: SocketAddr) -> Result<Self, BindError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| BindError { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| BindError { addr, source })?;
        Ok(StatusServer {
            listener,
            addr,
            callers: None,
            app_metrics: None,
            app_probes: Arc::default(),
        })
    }

    /// Serves `probes` at `/app-health/...`.
    pub fn with_app_probes(mut self, probes: Arc<AppProbes>) -> Self {
        self.app_probes = probes;
        self
    }

    /// Mutating endpoints also check the owner of the caller's socket: only the agent's own
    /// user, root and `callers` may (a node proxy's loopback is every process of the node).
    pub fn check_callers(mut self, callers: crate::callers::peer::Callers) -> Self {
        self.callers = Some(callers);
        self
    }

    /// `/stats/prometheus` merges the app's metrics ([`crate::status::app_metrics`]).
    pub fn app_metrics(mut self, app: Arc<AppMetrics>) -> Self {
        self.app_metrics = Some(app);
        self
    }

    /// Binds `addr` once it is free, trying again every half second; `None` when `cancel`
    /// fires first. For a surge successor whose predecessor still holds the port.
    pub async fn bind_when_free(addr: SocketAddr, cancel: &CancellationToken) -> Option<Self> {
        loop {
            tokio::select! {
                () = cancel.cancelled() => return None,
                () = tokio::time::sleep(crate::grpc::BIND_RETRY) => {}
            }
            match Self::bind(addr).await {
                Ok(server) => {
                    tracing::info!(event = "status_address", state = "bound", %addr, "the status address is free now: bound it");
                    return Some(server);
                }
                Err(e) => tracing::debug!(%addr, error = %e, "the status address is still taken"),
            }
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until `cancel` fires, then finishes the requests in flight (bounded).
    ///
    /// Bounded against a neighbour on the node (every process reaches 127.0.0.1 with
    /// hostNetwork): at most [`MAX_CONNECTIONS`] at once, the oldest closed to make room for a
    /// new one (so a flood of idle connections, however many, never keeps the kubelet's probe
    /// out); a request's headers within [`HEADER_READ_TIMEOUT`]; a connection at most
    /// [`MAX_CONNECTION_AGE`] long; HTTP/1 with hyper's size limits. An accept error (no
    /// descriptors left, say) waits a moment: it never spins.
    pub async fn serve(self, agent: AgentHandle, cancel: CancellationToken) -> std::io::Result<()> {
        use hyper_util::rt::{TokioIo, TokioTimer};
        tracing::info!(addr = %self.addr, "status server listening");
        let app = router_with(agent, self.app_probes.clone(), self.app_metrics.clone());
        let connections = crate::callers::connections::Connections::new("status");
        let tracker = tokio_util::task::TaskTracker::new();
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT);
        loop {
            let accepted = tokio::select! {
                () = cancel.cancelled() => break,
                accepted = self.listener.accept() => accepted,
            };
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "status server: cannot accept");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            };
            let admitted = connections.admit(&cancel, Some(peer));
            let guard = self.callers.clone().map(|callers| Guard {
                local: stream.local_addr().unwrap_or(self.addr),
                callers,
            });
            let service = hyper_util::service::TowerToHyperService::new(
                app.clone()
                    .layer(axum::Extension(guard))
                    .layer(axum::Extension(ConnectInfo(peer))),
            );
            let connection = http.serve_connection(TokioIo::new(stream), service);
            tracker.spawn(
                async move {
                    let mut connection = std::pin::pin!(connection);
                    let ended = tokio::select! {
                        r = connection.as_mut() => Some(r),
                        () = admitted.closing.cancelled() => None,
                        () = tokio::time::sleep(MAX_CONNECTION_AGE) => None,
                    };
                    if ended.is_none() {
                        // Finish a request in flight, then close (bounded); an idle one closes now.
                        connection.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(HEADER_READ_TIMEOUT, connection).await;
                    }
                    drop(admitted);
                }
                .in_current_span(),
            );
        }
        tracker.close();
        let _ = tokio::time::timeout(HEADER_READ_TIMEOUT, tracker.wait()).await;
        Ok(())
    }
}

/// The most connections the status server holds at once: far more than its clients, far fewer
/// than the agent's open files; the oldest is closed to make room for a new one.
pub const MAX_CONNECTIONS: usize = crate::callers::connections::MAX_CONNECTIONS;
/// How long a client may take to send a request's headers (or, on a kept-alive connection,
/// the next request's).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection is kept, however busy.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);
/// The pause after a failed accept.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

fn text(status: StatusCode, body: impl Into<String>) -> Response {
    let mut body = body.into();
    body.push('\n');
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

/// `GET /app-health/<container>/livez|readyz|startupz`: runs the app's probe for the path
/// (bounded by its timeout) and answers 200 when it passes, 500 with the reason when it fails,
/// 404 when no probe is configured for the path. Open to any peer, as readiness is: the
/// kubelet calls from the node, and the probe's target is fixed by the configuration.
async fn app_health(
    axum::Extension(probes): axum::Extension<Arc<AppProbes>>,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
) -> Response {
    let path = uri.path();
    let Some(probe) = probes.get(path) else {
        return text(
            StatusCode::NOT_FOUND,
            format!("no app probe configured for {path} (--app-probers)"),
        );
    };
    match probe.run(headers.get(header::USER_AGENT)).await {
        Ok(passed) => text(StatusCode::OK, format!("probe passed: {passed}")),
        Err(failed) => {
            // Debug: the kubelet probes every few seconds and records the answer itself.
            tracing::debug!(event = "app_probe_failed", path, error = %failed, "an app probe failed");
            text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("probe failed: {failed}"),
            )
        }
    }
}

fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Why a mutating request is refused, if it is: a non-loopback peer, or a browser's
/// cross-site request (a web page on the node can POST to 127.0.0.1 without a preflight; a
/// browser says so with `Origin`, or `Sec-Fetch-Site` other than `none`/`same-origin`). curl,
/// the kubelet's exec probes and the agent's own client send neither.
async fn forbidden(
    peer: SocketAddr,
    guard: Option<axum::Extension<Option<Guard>>>,
    headers: &axum::http::HeaderMap,
) -> Option<Response> {
    if !is_loopback(peer.ip()) {
        tracing::warn!(%peer, "refused a mutating request from a non-loopback peer");
        return Some(text(
            StatusCode::FORBIDDEN,
            "forbidden: only loopback peers may do this",
        ));
    }
    if let Some(axum::Extension(Some(guard))) = guard {
        if let Err(refusal) = guard.callers.check(peer, guard.local).await {
            tracing::warn!(event = "status_refused", %peer, uid = refusal.uid(), error = %refusal, "refused a mutating request");
            return Some(text(StatusCode::FORBIDDEN, format!("forbidden: {refusal}")));
        }
    }
    let fetch_site = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .map(str::to_ascii_lowercase);
    let cross_site = headers.contains_key(header::ORIGIN)
        || fetch_site.is_some_and(|s| s != "none" && s != "same-origin");
    cross_site.then(|| {
        tracing::warn!(%peer, origin = ?headers.get(header::ORIGIN), "refused a mutating request sent by a web browser");
        text(
            StatusCode::FORBIDDEN,
            "forbidden: requests from web pages (Origin, Sec-Fetch-Site) may not do this",
        )
    })
}

fn ago(since: SystemTime) -> String {
    let elapsed = since.elapsed().unwrap_or_default();
    format!("{:.1}s ago", elapsed.as_secs_f64())
}

async fn ready(State(agent): State<AgentHandle>) -> Response {
    let state = agent.state();
    match state {
        // Live, or a shutdown whose timeline keeps readiness on for now.
        AgentState::Live { .. } | AgentState::Draining { ready: true, .. } => {}
        AgentState::HandedOver { successor, .. } | AgentState::HandingOver { successor, .. } => {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: handed over to {successor}"),
            );
        }
        AgentState::Starting { since } => {
            // The agent has not started to stop, but its proxy may be stopping on its own (a
            // wedged Envoy being killed): say what the proxy says then, not "starting".
            let proxy = agent.status().borrow().proxy.clone();
            let why = match proxy.ready() {
                Err(why) if proxy.phase != ProxyPhase::Starting => why.to_string(),
                _ => format!("envoy is starting (since {})", ago(since)),
            };
            return text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}"));
        }
        AgentState::Draining {
            since,
            reason,
            phase,
            ready: false,
        } => {
            let (what, asking) = match phase {
                DrainPhase::Deciding => ("stopping", "; is a successor taking over?"),
                DrainPhase::Delay => ("about to drain", ""),
                DrainPhase::Draining => ("draining", ""),
            };
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {what} since {} ({reason}{asking})", ago(since)),
            );
        }
        AgentState::Exiting { path, .. } => {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: exiting ({path})"),
            );
        }
        AgentState::Recovering { .. } => {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {state}"),
            );
        }
    }
    // From the agent's known state, not a question to Envoy per probe: while a new epoch
    // starts, the serving epoch has handed its admin listener to it (and one that waits for
    // its control plane may hold it for the whole handoff deadline), yet the serving epoch
    // serves. The watchdogs watch Envoy's admin; the kubelet's probes cost Envoy nothing.
    let status = agent.status().borrow().clone();
    if let Err(why) = status.proxy.ready() {
        return text(StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}"));
    }
    // Ready all through a cold handover; say so while the old family drains.
    let retiring =
        status
            .proxy
            .family
            .as_ref()
            .and_then(|f| match &f.last_handoff.as_ref()?.kind {
                HandoffKind::Cold {
                    from_base_id, why, ..
                } if !f.retiring.is_empty() => Some(format!(
                    "ready (cold handover: the old family, base id {from_base_id}, drains; {why})"
                )),
                _ => None,
            });
    text(
        StatusCode::OK,
        retiring.unwrap_or_else(|| "ready".to_owned()),
    )
}

async fn drain(
    State(agent): State<AgentHandle>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    guard: Option<axum::Extension<Option<Guard>>>,
    headers: axum::http::HeaderMap,
) -> Response {
    if let Some(response) = forbidden(peer, guard, &headers).await {
        return response;
    }
    tracing::info!(%peer, "POST /drain");
    match agent.drain_now(Via::Http).await {
        Ok(()) => text(StatusCode::OK, "OK"),
        Err(e) => text(StatusCode::BAD_GATEWAY, e.to_string()),
    }
}

async fn quit(
    State(agent): State<AgentHandle>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    guard: Option<axum::Extension<Option<Guard>>>,
    headers: axum::http::HeaderMap,
) -> Response {
    if let Some(response) = forbidden(peer, guard, &headers).await {
        return response;
    }
    tracing::info!(%peer, "POST /quitquitquit");
    match agent.quit(Via::Http).await {
        Ok(()) => text(StatusCode::OK, "OK"),
        // Already exiting: the request is satisfied.
        Err(_) => text(StatusCode::OK, "OK (already exiting)"),
    }
}

/// `/stats/prometheus[?query]`: the agent's own metrics, then Envoy's for `query` (see
/// [`crate::status::stats_query`]), passed on as they arrive; scrapes of one query that arrive together
/// share one walk of Envoy's stats ([`crate::status::scrape`]). A query Envoy does not take is refused
/// (400, naming the parameter) before Envoy is asked; one Envoy refuses (a bad regex) is
/// refused with Envoy's words. Envoy's `filter` and `usedonly` apply to Envoy's stats only:
/// the agent's own families are always there, so a scrape always says whether Envoy's stats
/// could be read (`envoy_agent_envoy_stats_up`).
async fn prometheus(
    State(agent): State<AgentHandle>,
    axum::Extension(walks): axum::Extension<Arc<Walks>>,
    axum::Extension(app): axum::Extension<Option<Arc<AppMetrics>>>,
    RawQuery(raw): RawQuery,
) -> Response {
    let query = match StatsQuery::parse(raw.as_deref().unwrap_or_default()) {
        Ok(query) => query,
        Err(e) => return text(StatusCode::BAD_REQUEST, e.to_string()),
    };
    // The app is asked while Envoy's walk starts: a scrape waits for the slower of the two.
    let app_scrape = app
        .clone()
        .map(|app| tokio::spawn(async move { app.scrape().await }));
    let envoy = match envoy_walk(&agent, &walks, &query).await {
        Ok(envoy) => envoy,
        Err(refused) => return refused,
    };
    let state = agent.state();
    let mut body = agent_metrics(&state);
    body.push_str(&config_metrics(&agent.status().borrow().proxy.config));
    let up = u8::from(envoy.is_ok());
    let _ = writeln!(
        body,
        "# HELP envoy_agent_envoy_stats_up Whether Envoy's stats could be read for this scrape.\n\
         # TYPE envoy_agent_envoy_stats_up gauge\nenvoy_agent_envoy_stats_up {up}"
    );
    if let (Some(app), Some(scrape)) = (&app, app_scrape) {
        app_lines(&mut body, app, scrape.await.ok());
    }
    let envoy = match envoy {
        Ok(stats) => Some(stats),
        Err(e) => {
            let _ = writeln!(body, "# envoy stats unavailable: {}", e.replace('\n', " "));
            None
        }
    };
    let scrape = Scrape {
        head: Some(body.into()),
        envoy,
    };
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        axum::body::Body::new(scrape),
    )
        .into_response()
}

/// Envoy's stats for `query`, from the walk scrapes of that query share: its body, or why
/// Envoy's stats cannot be read this time. A query Envoy refuses is the scrape's answer (400,
/// Envoy's words).
async fn envoy_walk(
    agent: &AgentHandle,
    walks: &Arc<Walks>,
    query: &StatsQuery,
) -> Result<Result<SharedBody, String>, Response> {
    let Some(admin) = agent.admin() else {
        return Ok(Err("envoy admin address unknown".to_owned()));
    };
    let query = query.to_query_string();
    let key = WalkKey {
        // After a hot restart the newest epoch answers: its walk is another.
        envoy: admin.addr().to_string(),
        query: query.clone(),
    };
    let mut share = walks.join(key, move || async move {
        admin
            .with_timeout(ENVOY_CALL_TIMEOUT)
            .prometheus_stream(&query)
            .await
            .map_err(WalkFailure::from)
    });
    match share.head().await {
        Ok(()) => Ok(Ok(share.into_body())),
        Err(WalkFailure::Refused(refusal)) => {
            Err(text(StatusCode::BAD_REQUEST, refusal.to_string()))
        }
        Err(e) => Ok(Err(e.to_string())),
    }
}

/// The app's metrics, merged into the scrape's `body` after their families' help; a scrape of
/// the app that failed is said in a comment.
fn app_lines(
    body: &mut String,
    app: &AppMetrics,
    answer: Option<Arc<Result<String, crate::status::app_metrics::FetchError>>>,
) {
    let merged = answer.as_deref().and_then(|a| a.as_ref().ok());
    body.push_str(&crate::status::app_metrics::families(app, merged.is_some()));
    match (merged, answer.as_deref()) {
        (Some(lines), _) => body.push_str(lines),
        (None, Some(Err(e))) => {
            let _ = writeln!(
                body,
                "# app metrics left out: {}",
                e.to_string().replace('\n', " ")
            );
        }
        (None, _) => {}
    }
}

/// A scrape's answer: the agent's own metrics, then Envoy's as its walk passes them on (on a
/// large config tens of MiB, never held whole by the agent; bounded in time by the walk).
struct Scrape {
    head: Option<axum::body::Bytes>,
    envoy: Option<SharedBody>,
}

impl hyper::body::Body for Scrape {
    type Data = axum::body::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<axum::body::Bytes>, std::io::Error>>>
    {
        use std::task::Poll;
        let this = self.get_mut();
        if let Some(head) = this.head.take() {
            return Poll::Ready(Some(Ok(hyper::body::Frame::data(head))));
        }
        match this.envoy.as_mut() {
            Some(envoy) => std::pin::Pin::new(envoy)
                .poll_frame(cx)
                .map_err(std::io::Error::other),
            None => Poll::Ready(None),
        }
    }
}

/// The agent's own metrics in Prometheus text format.
pub fn agent_metrics(state: &AgentState) -> String {
    let mut out = String::new();
    out.push_str(
        "# HELP envoy_agent_state The agent's state: 1 for the current one.\n\
         # TYPE envoy_agent_state gauge\n",
    );
    for name in [
        "starting",
        "live",
        "draining",
        "handed_over",
        "handing_over",
        "exiting",
        "recovering",
    ] {
        let _ = writeln!(
            out,
            "envoy_agent_state{{state=\"{name}\"}} {}",
            u8::from(state.name() == name)
        );
    }
    let draining_since = match state {
        AgentState::Draining { since, .. } => unix_seconds(*since),
        _ => 0.0,
    };
    let _ = writeln!(
        out,
        "# HELP envoy_agent_draining Whether the agent is draining Envoy.\n\
         # TYPE envoy_agent_draining gauge\nenvoy_agent_draining {}\n\
         # HELP envoy_agent_drain_start_time_seconds When the current drain started (Unix time; 0 when not draining).\n\
         # TYPE envoy_agent_drain_start_time_seconds gauge\nenvoy_agent_drain_start_time_seconds {draining_since:.3}\n\
         # HELP envoy_agent_state_start_time_seconds When the current state began (Unix time).\n\
         # TYPE envoy_agent_state_start_time_seconds gauge\nenvoy_agent_state_start_time_seconds {:.3}\n\
         # HELP envoy_agent_log_lines_dropped_total Lines of the agent's stdout and stderr (its log and Envoy's) dropped because their reader did not take them.\n\
         # TYPE envoy_agent_log_lines_dropped_total counter\nenvoy_agent_log_lines_dropped_total {}",
        u8::from(state.draining()),
        unix_seconds(state.since()),
        envoy_agent_proxy::output::dropped_lines(),
    );
    out
}

/// What the newest Envoy has of its config, in Prometheus text format: whether it has it
/// (`envoy_agent_config_ready`), and, for a bootstrap with dynamic resources, its control
/// plane's connection and how long it has been without it.
pub fn config_metrics(config: &ConfigStatus) -> String {
    let mut out = format!(
        "# HELP envoy_agent_config_ready Whether the newest Envoy has its config (from its control plane, when dynamic).\n\
         # TYPE envoy_agent_config_ready gauge\n\
         envoy_agent_config_ready {}\n",
        u8::from(config.ready().is_ok())
    );
    if let Some(cp) = config.control_plane() {
        let without = cp
            .disconnected_since
            .and_then(|t| t.elapsed().ok())
            .map_or(0.0, |d| d.as_secs_f64());
        let _ = writeln!(
            out,
            "# HELP envoy_agent_control_plane_connected Whether the newest Envoy's xDS stream is up (control_plane.connected_state).\n\
             # TYPE envoy_agent_control_plane_connected gauge\n\
             envoy_agent_control_plane_connected {}\n\
             # HELP envoy_agent_control_plane_disconnected_seconds How long the newest Envoy has been without its control plane (0 while connected).\n\
             # TYPE envoy_agent_control_plane_disconnected_seconds gauge\n\
             envoy_agent_control_plane_disconnected_seconds {without:.3}",
            u8::from(cp.connected.unwrap_or(false))
        );
    }
    out
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::body::Body;
    use axum::extract::connect_info::MockConnectInfo;
    use axum::http::{Method, Request};
    use http_body_util::BodyExt;
    use tokio::sync::mpsc;
    use tower::ServiceExt;

    use super::*;
    use crate::agent::{Agent, AgentConfig, AgentExit, ExitPath};
    use crate::signal::Intent;
    use crate::testing::{Call, FakeProxy};

    struct Fixture {
        proxy: Arc<FakeProxy>,
        handle: AgentHandle,
        intents: mpsc::Sender<Intent>,
        task: tokio::task::JoinHandle<AgentExit>,
    }

    fn fixture() -> Fixture {
        let proxy = Arc::new(FakeProxy::default());
        let (agent, handle) = Agent::new(proxy.clone(), AgentConfig::default());
        let (intents, source) = mpsc::channel(4);
        let task = tokio::spawn(agent.run(source));
        Fixture {
            proxy,
            handle,
            intents,
            task,
        }
    }

    async fn call(f: &Fixture, method: Method, path: &str, peer: &str) -> (StatusCode, String) {
        let peer: SocketAddr = peer.parse().unwrap();
        let app = router(f.handle.clone()).layer(MockConnectInfo(peer));
        let request = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        let status = response.status();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    const LOCAL: &str = "127.0.0.1:5000";
    const LOCAL6: &str = "[::1]:5000";
    const MAPPED: &str = "[::ffff:127.0.0.1]:5000";
    const REMOTE: &str = "192.0.2.7:5000";

    #[tokio::test(start_paused = true)]
    async fn readiness_is_503_with_a_reason_while_starting_and_draining() {
        let f = fixture();
        let (status, body) = call(&f, Method::GET, "/healthz/ready", REMOTE).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.starts_with("not ready: envoy is starting"), "{body}");
        assert_eq!(body.lines().count(), 1, "one line: {body:?}");

        f.intents.send(Intent::Terminate).await.unwrap();
        tokio::task::yield_now().await;
        let (status, body) = call(&f, Method::GET, "/healthz/ready", LOCAL).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body.contains("draining") && body.contains("SIGTERM"),
            "{body}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn mutating_endpoints_are_post_only() {
        let f = fixture();
        for path in ["/drain", "/quitquitquit"] {
            let (status, _) = call(&f, Method::GET, path, LOCAL).await;
            assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "GET {path}");
            let (status, _) = call(&f, Method::PUT, path, LOCAL).await;
            assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "PUT {path}");
        }
        assert!(f.proxy.calls().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn mutating_endpoints_refuse_non_loopback_peers() {
        let f = fixture();
        for path in ["/drain", "/quitquitquit"] {
            let (status, body) = call(&f, Method::POST, path, REMOTE).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "POST {path}: {body}");
        }
        assert!(f.proxy.calls().is_empty(), "nothing reached the proxy");
        assert_eq!(f.handle.state().name(), "starting");
    }

    async fn call_with(f: &Fixture, path: &str, header: (&str, &str)) -> StatusCode {
        let peer: SocketAddr = LOCAL.parse().unwrap();
        let app = router(f.handle.clone()).layer(MockConnectInfo(peer));
        let request = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(header.0, header.1)
            .body(Body::empty())
            .unwrap();
        app.oneshot(request).await.unwrap().status()
    }

    #[tokio::test(start_paused = true)]
    async fn mutating_endpoints_refuse_what_a_browser_sends_cross_site() {
        let f = fixture();
        for path in ["/drain", "/quitquitquit"] {
            for header in [
                ("origin", "https://evil.example"),
                ("origin", "null"),
                ("sec-fetch-site", "cross-site"),
                ("sec-fetch-site", "same-site"),
            ] {
                assert_eq!(
                    call_with(&f, path, header).await,
                    StatusCode::FORBIDDEN,
                    "{path} {header:?}"
                );
            }
        }
        assert!(f.proxy.calls().is_empty(), "nothing reached the proxy");
        // What a user typing the address sends is fine.
        assert_eq!(
            call_with(&f, "/drain", ("sec-fetch-site", "none")).await,
            StatusCode::OK
        );
    }

    #[tokio::test(start_paused = true)]
    async fn drain_from_loopback_drains_with_skip_exit() {
        for peer in [LOCAL, LOCAL6, MAPPED] {
            let f = fixture();
            let (status, body) = call(&f, Method::POST, "/drain", peer).await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "OK\n"), "{peer}");
            // On the shutdown's timeline: health checks fail with the drain (the default).
            let calls = f.proxy.calls();
            assert!(
                calls.contains(&Call::Drain { skip_exit: true }),
                "{calls:?}"
            );
            assert!(calls.contains(&Call::FailHealthChecks), "{calls:?}");
            // The server keeps answering during the drain.
            let (status, body) = call(&f, Method::GET, "/healthz/ready", peer).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert!(body.contains("POST /drain"), "{body}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn quitquitquit_from_loopback_stops_the_agent_without_draining() {
        let f = fixture();
        let (status, _) = call(&f, Method::POST, "/quitquitquit", LOCAL).await;
        assert_eq!(status, StatusCode::OK);
        let exit = f.task.await.unwrap();
        assert_eq!(exit.path, ExitPath::QuitQuitQuit(Via::Http));
        assert_eq!(f.proxy.calls(), [Call::Stop]);
    }

    #[tokio::test(start_paused = true)]
    async fn quitquitquit_works_during_a_drain() {
        let f = fixture();
        f.intents.send(Intent::Terminate).await.unwrap();
        tokio::task::yield_now().await;
        let (status, _) = call(&f, Method::POST, "/quitquitquit", LOCAL).await;
        assert_eq!(status, StatusCode::OK);
        let exit = f.task.await.unwrap();
        assert_eq!(exit.path, ExitPath::QuitQuitQuit(Via::Http));
    }

    #[tokio::test(start_paused = true)]
    async fn prometheus_has_the_agent_state_even_without_envoy_stats() {
        let f = fixture();
        let (status, body) = call(&f, Method::GET, "/stats/prometheus", REMOTE).await;
        assert_eq!(status, StatusCode::OK);
        assert!(
            body.contains("envoy_agent_state{state=\"starting\"} 1"),
            "{body}"
        );
        assert!(
            body.contains("envoy_agent_state{state=\"live\"} 0"),
            "{body}"
        );
        assert!(body.contains("envoy_agent_draining 0"), "{body}");
        assert!(body.contains("envoy_agent_envoy_stats_up 0"), "{body}");
    }

    #[tokio::test(start_paused = true)]
    async fn prometheus_refuses_a_query_envoy_does_not_take_naming_the_parameter() {
        let f = fixture();
        for (query, parameter) in [
            ("format=json", "format"),
            ("usedonly&filter=a&filter=b", "filter"),
            ("usedonly=false", "usedonly"),
        ] {
            let (status, body) = call(
                &f,
                Method::GET,
                &format!("/stats/prometheus?{query}"),
                REMOTE,
            )
            .await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{query}");
            assert!(body.contains(&format!("{parameter:?}")), "{query}: {body}");
        }
        assert!(f.proxy.calls().is_empty(), "nothing reached the proxy");
    }

    #[tokio::test]
    async fn app_health_runs_the_configured_probe_and_404s_the_rest() {
        let f = fixture();
        let listening = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let open = listening.local_addr().unwrap().port();
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let json = format!(
            r#"{{"/app-health/app/livez": {{"tcpSocket": {{"port": {open}}}}},
                "/app-health/app/readyz": {{"tcpSocket": {{"port": {closed}}}}}}}"#
        );
        let probes = AppProbes::parse(&json, crate::status::app_probe::Input::Flag).unwrap();
        let app = router_with(f.handle.clone(), Arc::new(probes), None)
            .layer(MockConnectInfo(REMOTE.parse::<SocketAddr>().unwrap()));
        let get = |path: &str| {
            let app = app.clone();
            let request = Request::get(path).body(Body::empty()).unwrap();
            async move {
                let response = app.oneshot(request).await.unwrap();
                let status = response.status();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (status, String::from_utf8_lossy(&body).into_owned())
            }
        };
        let (status, body) = get("/app-health/app/livez").await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(
            body,
            format!("probe passed: TCP connect to 127.0.0.1:{open}: connected\n")
        );
        let (status, body) = get("/app-health/app/readyz").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
        assert_eq!(
            body,
            format!("probe failed: TCP connect to 127.0.0.1:{closed}: connect refused\n")
        );
        for path in ["/app-health/app/startupz", "/app-health/other/livez"] {
            let (status, body) = get(path).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
            assert!(body.contains(path), "{body}");
        }
        // Without probes, the same: nothing is configured.
        let (status, _) = call(&f, Method::GET, "/app-health/app/livez", LOCAL).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(f.proxy.calls().is_empty(), "nothing reached the proxy");
        drop(listening);
    }

    #[test]
    fn metrics_while_draining() {
        let state = AgentState::Draining {
            since: UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            reason: crate::agent::DrainReason::Request(Via::Http),
            phase: DrainPhase::Draining,
            ready: false,
        };
        let text = agent_metrics(&state);
        assert!(
            text.contains("envoy_agent_state{state=\"draining\"} 1"),
            "{text}"
        );
        assert!(text.contains("envoy_agent_draining 1"), "{text}");
        assert!(
            text.contains("envoy_agent_drain_start_time_seconds 1700000000.000"),
            "{text}"
        );
    }

    #[test]
    fn metrics_of_the_control_plane() {
        let text = config_metrics(&ConfigStatus::Static);
        assert!(text.contains("envoy_agent_config_ready 1"), "{text}");
        assert!(!text.contains("control_plane"), "no control plane: {text}");
        let down = ConfigStatus::Dynamic(envoy_agent_proxy::ControlPlane {
            epoch: 0,
            types: Vec::new(),
            connected: Some(false),
            disconnected_since: Some(SystemTime::now() - Duration::from_secs(90)),
        });
        let text = config_metrics(&down);
        assert!(
            text.contains("envoy_agent_control_plane_connected 0"),
            "{text}"
        );
        let without: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("envoy_agent_control_plane_disconnected_seconds "))
            .unwrap()
            .parse()
            .unwrap();
        assert!((90.0..100.0).contains(&without), "{text}");
        let text = config_metrics(&ConfigStatus::Unknown);
        assert!(text.contains("envoy_agent_config_ready 0"), "{text}");
    }

    #[test]
    fn every_line_of_the_agents_metrics_starts_at_the_first_column() {
        let down = ConfigStatus::Dynamic(envoy_agent_proxy::ControlPlane {
            epoch: 0,
            types: Vec::new(),
            connected: Some(false),
            disconnected_since: None,
        });
        let text = agent_metrics(&AgentState::Starting {
            since: SystemTime::now(),
        }) + &config_metrics(&down);
        for line in text.lines() {
            assert!(
                !line.starts_with(char::is_whitespace) && !line.is_empty(),
                "{line:?}"
            );
        }
    }
}

//! The gRPC service for controllers (`envoyagent.v1.AgentService`), standard
//! `grpc.health.v1` (NOT_SERVING while draining) and server reflection, on a Unix socket
//! (`unix:/path`, mode 0600) or TCP (`host:port`).
//!
//! The service holds handles only: every decision stays with the agent or supervisor actor.
//! `WatchStatus` streams read the actor's `watch` channel, so a slow watcher skips to the latest
//! state and costs the actor nothing. Mutating RPCs from a non-loopback TCP peer are refused
//! (PERMISSION_DENIED) unless `--grpc-allow-remote`; a Unix socket is guarded by its mode.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::{SystemTime, UNIX_EPOCH};

use envoy_agent_hotrestart::{RestartError, SupervisorHandle, SupervisorState};
use envoy_agent_proto::pb;
use envoy_agent_proto::pb::agent_service_server::{AgentService, AgentServiceServer};
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::agent::{AgentHandle, AgentState, DrainPhase};

/// The service name, as health checks and reflection know it.
pub const SERVICE_NAME: &str = "envoyagent.v1.AgentService";

/// Where the gRPC server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrpcAddress {
    /// A Unix socket (created mode 0600).
    Unix(PathBuf),
    /// A TCP address.
    Tcp(SocketAddr),
}

impl std::str::FromStr for GrpcAddress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(format!("{s:?}: no socket path after unix:"));
            }
            return Ok(GrpcAddress::Unix(PathBuf::from(path)));
        }
        s.parse()
            .map(GrpcAddress::Tcp)
            .map_err(|_| format!("{s:?} is neither unix:/path nor host:port"))
    }
}

impl std::fmt::Display for GrpcAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GrpcAddress::Unix(p) => write!(f, "unix:{}", p.display()),
            GrpcAddress::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// What the service steers.
#[derive(Debug, Clone)]
pub enum Target {
    /// Hot restart off: the agent.
    Agent(AgentHandle),
    /// Hot restart on: the supervisor, and the token that stops it.
    Supervisor(SupervisorHandle, CancellationToken),
}

/// The `AgentService` implementation.
#[derive(Debug, Clone)]
pub struct Service {
    target: Target,
    allow_remote: bool,
    config_path: PathBuf,
    proxy: envoy_agent_proxy::ProxyConfig,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

/// The status of an agent. Ready means LIVE and not draining, as `/healthz/ready` says before
/// it asks Envoy's own `/ready`.
pub fn agent_status(state: &AgentState) -> pb::Status {
    let (reason, draining) = match state {
        AgentState::Draining { reason, phase, .. } => (
            match phase {
                DrainPhase::Delay => format!("{reason} (drain delay)"),
                DrainPhase::Draining => reason.to_string(),
            },
            true,
        ),
        AgentState::Exiting { path, .. } => (path.to_string(), false),
        _ => (String::new(), false),
    };
    pb::Status {
        mode: "agent".to_owned(),
        state: state.name().to_owned(),
        reason,
        state_since_unix_ms: unix_ms(state.since()),
        ready: matches!(state, AgentState::Live { .. }),
        draining,
        newest_live_epoch: -1,
        ..pb::Status::default()
    }
}

/// The status of a supervisor.
pub fn supervisor_status(s: &SupervisorState) -> pb::Status {
    use envoy_agent_hotrestart::{EpochState, Phase};
    pb::Status {
        mode: "supervisor".to_owned(),
        state: match s.phase {
            Phase::Starting => "starting",
            Phase::Serving => "serving",
            Phase::Stopping => "stopping",
            Phase::Exited => "exited",
        }
        .to_owned(),
        reason: s
            .handed_over_to
            .as_ref()
            .map(|to| format!("handed over to {to}"))
            .unwrap_or_default(),
        state_since_unix_ms: 0,
        ready: s.ready,
        draining: s.handoff.is_some(),
        epochs: s
            .epochs
            .iter()
            .map(|e| pb::Epoch {
                epoch: e.epoch,
                pid: e.pid,
                state: match e.state {
                    EpochState::Starting => "starting",
                    EpochState::Live => "live",
                    EpochState::Draining => "draining",
                }
                .to_owned(),
                started_unix_ms: unix_ms(e.started),
            })
            .collect(),
        newest_live_epoch: s.newest_live.map_or(-1, i64::from),
        base_id: s.base_id,
        hot_restart_version: s.hot_restart_version.clone(),
        handoff: s.handoff.as_ref().map(|h| pb::Handoff {
            epoch: h.epoch,
            reason: h.reason.clone(),
            since_unix_ms: unix_ms(h.since),
        }),
        last_handoff: s.last_handoff.as_ref().map(|h| pb::HandoffResult {
            epoch: h.epoch,
            reason: h.reason.clone(),
            outcome: h.outcome.as_str().to_owned(),
            duration_ms: h.duration.as_millis() as u64,
            message: h.message.clone(),
        }),
        wedges: s
            .wedges
            .iter()
            .map(|w| pb::Wedge {
                reason: w.reason.as_str().to_owned(),
                at_unix_ms: unix_ms(w.at),
                message: w.message.clone(),
            })
            .collect(),
        handed_over_to: s.handed_over_to.clone().unwrap_or_default(),
    }
}

impl Service {
    /// A service over `target`. `proxy` is Envoy's config (for validation of new configs).
    pub fn new(target: Target, proxy: envoy_agent_proxy::ProxyConfig, allow_remote: bool) -> Self {
        Service {
            target,
            allow_remote,
            config_path: proxy.config_path.clone(),
            proxy,
        }
    }

    fn status(&self) -> pb::Status {
        match &self.target {
            Target::Agent(h) => agent_status(&h.state().borrow()),
            Target::Supervisor(h, _) => supervisor_status(&h.state().borrow()),
        }
    }

    fn check_mutation<T>(&self, request: &Request<T>) -> Result<(), Status> {
        match request.remote_addr() {
            Some(peer) if !peer.ip().to_canonical().is_loopback() && !self.allow_remote => {
                tracing::warn!(%peer, "refused a mutating gRPC call from a non-loopback peer");
                Err(Status::permission_denied(format!(
                    "{peer} is not a loopback peer (the agent allows mutating calls from loopback only; see --grpc-allow-remote)"
                )))
            }
            _ => Ok(()),
        }
    }

    fn admin(&self) -> Result<envoy_agent_proxy::AdminClient, Status> {
        let addr = match &self.target {
            Target::Agent(h) => h.admin().map(|a| a.addr()),
            Target::Supervisor(..) => match &self.proxy.admin {
                envoy_agent_proxy::AdminAddress::Fixed(a) => Some(*a),
                envoy_agent_proxy::AdminAddress::FromFile(p) => {
                    envoy_agent_proxy::read_admin_file(p)
                }
            },
        };
        addr.map(envoy_agent_proxy::AdminClient::new)
            .ok_or_else(|| Status::unavailable("envoy's admin address is not known yet"))
    }
}

fn restart_status(e: RestartError) -> Status {
    match e {
        RestartError::Rejected(m) => Status::failed_precondition(m),
        RestartError::Failed(m) => Status::aborted(m),
        other => Status::unavailable(other.to_string()),
    }
}

type StatusStream = Pin<Box<dyn Stream<Item = Result<pb::Status, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for Service {
    async fn get_status(
        &self,
        _request: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::Status>, Status> {
        Ok(Response::new(self.status()))
    }

    type WatchStatusStream = StatusStream;

    async fn watch_status(
        &self,
        _request: Request<pb::WatchStatusRequest>,
    ) -> Result<Response<Self::WatchStatusStream>, Status> {
        let stream: StatusStream = match &self.target {
            Target::Agent(h) => Box::pin(
                tokio_stream::wrappers::WatchStream::new(h.state())
                    .map(|state| Ok(agent_status(&state))),
            ),
            Target::Supervisor(h, _) => Box::pin(
                tokio_stream::wrappers::WatchStream::new(h.state())
                    .map(|state| Ok(supervisor_status(&state))),
            ),
        };
        Ok(Response::new(stream))
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        self.check_mutation(&request)?;
        let r = request.into_inner();
        match &self.target {
            Target::Agent(h) => h
                .drain(Some(r.inbound_only), r.skip_exit)
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?,
            Target::Supervisor(..) => {
                let admin = self.admin()?;
                envoy_agent_drain::drain_listeners(&admin, r.inbound_only, r.skip_exit)
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?;
            }
        }
        Ok(Response::new(pb::DrainResponse {}))
    }

    async fn drain_now(
        &self,
        request: Request<pb::DrainNowRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        self.check_mutation(&request)?;
        match &self.target {
            Target::Agent(h) => h
                .drain_now()
                .await
                .map(|()| Response::new(pb::DrainResponse {}))
                .map_err(|e| Status::unavailable(e.to_string())),
            Target::Supervisor(..) => {
                let admin = self.admin()?;
                envoy_agent_drain::drain_listeners(&admin, false, true)
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?;
                Ok(Response::new(pb::DrainResponse {}))
            }
        }
    }

    async fn disable_draining(
        &self,
        request: Request<pb::DisableDrainingRequest>,
    ) -> Result<Response<pb::DisableDrainingResponse>, Status> {
        self.check_mutation(&request)?;
        match &self.target {
            Target::Agent(h) => h
                .disable_draining()
                .await
                .map(|()| Response::new(pb::DisableDrainingResponse {}))
                .map_err(|e| Status::unavailable(e.to_string())),
            Target::Supervisor(..) => Err(Status::failed_precondition(
                "the hot-restart supervisor does not drain on SIGTERM: nothing to disable",
            )),
        }
    }

    async fn quit_quit_quit(
        &self,
        request: Request<pb::QuitQuitQuitRequest>,
    ) -> Result<Response<pb::QuitQuitQuitResponse>, Status> {
        self.check_mutation(&request)?;
        match &self.target {
            Target::Agent(h) => {
                // Already exiting is fine: the request is satisfied.
                let _ = h.quit().await;
            }
            Target::Supervisor(_, stop) => stop.cancel(),
        }
        Ok(Response::new(pb::QuitQuitQuitResponse {}))
    }

    async fn hot_restart(
        &self,
        request: Request<pb::HotRestartRequest>,
    ) -> Result<Response<pb::HotRestartResponse>, Status> {
        self.check_mutation(&request)?;
        let reason = request.into_inner().reason;
        match &self.target {
            Target::Agent(_) => Err(Status::failed_precondition(
                "hot restart is off (run envoy-agent with --hot-restart)",
            )),
            Target::Supervisor(h, _) => h
                .hot_restart(format!("grpc: {reason}"))
                .await
                .map(|epoch| Response::new(pb::HotRestartResponse { epoch }))
                .map_err(restart_status),
        }
    }

    async fn update_config(
        &self,
        request: Request<pb::UpdateConfigRequest>,
    ) -> Result<Response<pb::UpdateConfigResponse>, Status> {
        self.check_mutation(&request)?;
        let r = request.into_inner();
        // Validate a copy beside the real file (same directory: relative paths resolve alike);
        // the real file is only replaced once Envoy accepts the copy.
        let candidate = sibling(&self.config_path, "candidate");
        envoy_agent_proxy::write_atomically(&candidate, &r.bootstrap)
            .map_err(|e| Status::internal(format!("writing {}: {e}", candidate.display())))?;
        let mut proxy = self.proxy.clone();
        proxy.config_path = candidate.clone();
        let validated = envoy_agent_proxy::preflight::validate(&proxy).await;
        let _ = std::fs::remove_file(&candidate);
        validated.map_err(|e| Status::invalid_argument(e.to_string()))?;
        envoy_agent_proxy::write_atomically(&self.config_path, &r.bootstrap).map_err(|e| {
            Status::internal(format!("writing {}: {e}", self.config_path.display()))
        })?;
        tracing::info!(path = %self.config_path.display(), reason = %r.reason, "config updated over gRPC");
        match &self.target {
            Target::Agent(_) => Ok(Response::new(pb::UpdateConfigResponse {
                restarted: false,
                epoch: 0,
            })),
            Target::Supervisor(h, _) => h
                .hot_restart(format!("grpc update config: {}", r.reason))
                .await
                .map(|epoch| {
                    Response::new(pb::UpdateConfigResponse {
                        restarted: true,
                        epoch,
                    })
                })
                .map_err(restart_status),
        }
    }
}

/// A hidden file beside `path` that keeps its extension: Envoy picks the config format (YAML,
/// JSON, proto) from it.
fn sibling(path: &Path, what: &str) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = path
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    path.with_file_name(format!(".{stem}.{what}.{}{ext}", std::process::id()))
}

/// Why the gRPC server could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot serve gRPC on {addr}: {message}")]
pub struct GrpcBindError {
    /// The address.
    pub addr: GrpcAddress,
    /// Why.
    pub message: String,
}

/// Binds `addr` and serves until `cancel` fires. Health reports NOT_SERVING while `draining`
/// says so.
pub async fn serve(
    addr: GrpcAddress,
    service: Service,
    cancel: CancellationToken,
) -> Result<impl std::future::Future<Output = ()>, GrpcBindError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(envoy_agent_proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| GrpcBindError {
            addr: addr.clone(),
            message: e.to_string(),
        })?;
    // Health follows the drain: NOT_SERVING from its start.
    let health_task = {
        let service = service.clone();
        let cancel = cancel.clone();
        async move {
            // One receiver for the task's life: a fresh clone per wait would see every past
            // change as new and spin.
            enum Changes {
                Agent(tokio::sync::watch::Receiver<AgentState>),
                Supervisor(tokio::sync::watch::Receiver<SupervisorState>),
            }
            let mut changes = match &service.target {
                Target::Agent(h) => Changes::Agent(h.state()),
                Target::Supervisor(h, _) => Changes::Supervisor(h.state()),
            };
            let mut last = None;
            loop {
                let status = service.status();
                let serving = !status.draining
                    && !matches!(status.state.as_str(), "exiting" | "stopping" | "exited");
                if last != Some(serving) {
                    let s = if serving {
                        tonic_health::ServingStatus::Serving
                    } else {
                        tonic_health::ServingStatus::NotServing
                    };
                    reporter.set_service_status(SERVICE_NAME, s).await;
                    reporter.set_service_status("", s).await;
                    last = Some(serving);
                }
                let changed = async {
                    match &mut changes {
                        Changes::Agent(rx) => rx.changed().await.is_ok(),
                        Changes::Supervisor(rx) => rx.changed().await.is_ok(),
                    }
                };
                tokio::select! {
                    () = cancel.cancelled() => return,
                    ok = changed => if !ok { return },
                }
            }
        }
    };
    let router = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(reflection)
        .add_service(AgentServiceServer::new(service));
    let fail = |message: String| GrpcBindError {
        addr: addr.clone(),
        message,
    };
    let served: Pin<
        Box<dyn std::future::Future<Output = Result<(), tonic::transport::Error>> + Send>,
    > = match &addr {
        GrpcAddress::Tcp(a) => {
            let listener = tokio::net::TcpListener::bind(a)
                .await
                .map_err(|e| fail(e.to_string()))?;
            tracing::info!(addr = %listener.local_addr().map_err(|e| fail(e.to_string()))?, "gRPC server listening");
            Box::pin(router.serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                cancel.clone().cancelled_owned(),
            ))
        }
        GrpcAddress::Unix(path) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| fail(format!("creating {}: {e}", dir.display())))?;
            }
            // A socket left by a previous run would make bind fail.
            let _ = std::fs::remove_file(path);
            let listener = tokio::net::UnixListener::bind(path).map_err(|e| fail(e.to_string()))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| fail(e.to_string()))?;
            tracing::info!(path = %path.display(), "gRPC server listening");
            Box::pin(router.serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                cancel.clone().cancelled_owned(),
            ))
        }
    };
    let unix_path = match &addr {
        GrpcAddress::Unix(p) => Some(p.clone()),
        GrpcAddress::Tcp(_) => None,
    };
    Ok(async move {
        let (result, ()) = tokio::join!(served, health_task);
        if let Err(e) = result {
            tracing::error!(error = %e, "gRPC server failed");
        }
        if let Some(path) = unix_path {
            let _ = std::fs::remove_file(path);
        }
    })
}

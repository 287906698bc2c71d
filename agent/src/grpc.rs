//! The gRPC service for controllers (`envoyagent.v1.AgentService`), standard
//! `grpc.health.v1` (NOT_SERVING while draining) and server reflection, on a Unix socket
//! (`unix:/path`, mode 0600) or TCP (`host:port`).
//!
//! The service holds handles only: every decision stays with the agent or supervisor actor.
//! `WatchStatus` streams read the actor's `watch` channel, so a slow watcher skips to the latest
//! state and costs the actor nothing. Mutating RPCs from a non-loopback TCP peer are refused
//! (PERMISSION_DENIED) unless `--grpc-allow-remote`; a Unix socket is guarded by its mode.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::{SystemTime, UNIX_EPOCH};

use envoy_agent_proto::pb;
use envoy_agent_proto::pb::agent_service_server::{AgentService, AgentServiceServer};
use envoy_agent_proxy::{DrainOptions, ProxyError, RestartError};
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::agent::{AgentError, AgentHandle, AgentState, DrainPhase, Status as AgentStatus, Via};

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

/// The `AgentService` implementation: a handle to the agent, nothing else. Every RPC goes
/// through the agent actor; no admin call or file write happens here.
#[derive(Debug, Clone)]
pub struct Service {
    agent: AgentHandle,
    allow_remote: bool,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

/// The status message for `status`: the agent's state, and the proxy's epochs (one Envoy
/// without hot restart; with it, every epoch plus the family's handoffs and wedges).
pub fn status_message(status: &AgentStatus) -> pb::Status {
    let agent = &status.agent;
    let reason = match agent {
        AgentState::Draining { reason, phase, .. } => match phase {
            DrainPhase::Deciding => format!("{reason} (is a successor taking over?)"),
            DrainPhase::Delay => format!("{reason} (drain delay)"),
            DrainPhase::Draining => reason.to_string(),
        },
        AgentState::HandedOver { successor, .. } => format!("handed over to {successor}"),
        AgentState::HandingOver { successor, .. } => format!("handing over to {successor}"),
        AgentState::Exiting { path, .. } => path.to_string(),
        AgentState::Starting { .. } | AgentState::Live { .. } => String::new(),
    };
    let proxy = &status.proxy;
    let family = proxy.family.as_ref();
    pb::Status {
        mode: if family.is_some() {
            "supervisor"
        } else {
            "agent"
        }
        .to_owned(),
        state: agent.name().to_owned(),
        reason,
        state_since_unix_ms: unix_ms(agent.since()),
        ready: agent.serving(),
        draining: agent.draining(),
        epochs: proxy
            .epochs
            .iter()
            .map(|e| pb::Epoch {
                epoch: e.epoch,
                pid: e.pid,
                state: e.state.as_str().to_owned(),
                started_unix_ms: unix_ms(e.started),
            })
            .collect(),
        newest_live_epoch: proxy.newest_live.map_or(-1, i64::from),
        base_id: family.map_or(0, |f| f.base_id),
        hot_restart_version: family
            .map(|f| f.hot_restart_version.clone())
            .unwrap_or_default(),
        handoff: family
            .and_then(|f| f.handoff.as_ref())
            .map(|h| pb::Handoff {
                epoch: h.epoch,
                reason: h.reason.clone(),
                since_unix_ms: unix_ms(h.since),
            }),
        last_handoff: family
            .and_then(|f| f.last_handoff.as_ref())
            .map(|h| pb::HandoffResult {
                epoch: h.epoch,
                reason: h.reason.clone(),
                outcome: h.outcome.as_str().to_owned(),
                duration_ms: h.duration.as_millis() as u64,
                message: h.message.clone(),
            }),
        wedges: family
            .map(|f| {
                f.wedges
                    .iter()
                    .map(|w| pb::Wedge {
                        reason: w.reason.as_str().to_owned(),
                        at_unix_ms: unix_ms(w.at),
                        message: w.message.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        handed_over_to: family
            .and_then(|f| f.handed_over_to.clone())
            .unwrap_or_default(),
    }
}

impl Service {
    /// A service over the agent behind `agent`.
    pub fn new(agent: AgentHandle, allow_remote: bool) -> Self {
        Service {
            agent,
            allow_remote,
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
}

fn agent_error(e: AgentError) -> Status {
    match e {
        AgentError::Restart(RestartError::Rejected(m)) => Status::failed_precondition(m),
        AgentError::Restart(RestartError::Unsupported) => {
            Status::failed_precondition("hot restart is off (run envoy-agent with --hot-restart)")
        }
        AgentError::Restart(RestartError::Refused(m)) => Status::failed_precondition(m),
        AgentError::Restart(RestartError::Failed(m)) => Status::aborted(m),
        AgentError::Config(ProxyError::ConfigRejected { path, message }) => {
            Status::invalid_argument(format!(
                "envoy rejects the config for {}: {message}",
                path.display()
            ))
        }
        AgentError::Config(ProxyError::Restart { source, .. }) => {
            agent_error(AgentError::Restart(source))
        }
        AgentError::Config(e) => Status::internal(e.to_string()),
        AgentError::DrainFailed(m) => Status::unavailable(m),
        AgentError::Gone => Status::unavailable("the agent is exiting"),
        other => Status::internal(other.to_string()),
    }
}

type StatusStream = Pin<Box<dyn Stream<Item = Result<pb::Status, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for Service {
    async fn get_status(
        &self,
        _request: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::Status>, Status> {
        Ok(Response::new(status_message(&self.agent.status().borrow())))
    }

    type WatchStatusStream = StatusStream;

    async fn watch_status(
        &self,
        _request: Request<pb::WatchStatusRequest>,
    ) -> Result<Response<Self::WatchStatusStream>, Status> {
        let stream: StatusStream = Box::pin(
            tokio_stream::wrappers::WatchStream::new(self.agent.status())
                .map(|status| Ok(status_message(&status))),
        );
        Ok(Response::new(stream))
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        self.check_mutation(&request)?;
        let r = request.into_inner();
        let options = DrainOptions {
            inbound_only: Some(r.inbound_only),
            skip_exit: r.skip_exit,
        };
        self.agent
            .drain(options, Via::Grpc)
            .await
            .map_err(agent_error)?;
        Ok(Response::new(pb::DrainResponse {}))
    }

    async fn drain_now(
        &self,
        request: Request<pb::DrainNowRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        self.check_mutation(&request)?;
        self.agent.drain_now(Via::Grpc).await.map_err(agent_error)?;
        Ok(Response::new(pb::DrainResponse {}))
    }

    async fn disable_draining(
        &self,
        request: Request<pb::DisableDrainingRequest>,
    ) -> Result<Response<pb::DisableDrainingResponse>, Status> {
        self.check_mutation(&request)?;
        self.agent.disable_draining().await.map_err(agent_error)?;
        Ok(Response::new(pb::DisableDrainingResponse {}))
    }

    async fn quit_quit_quit(
        &self,
        request: Request<pb::QuitQuitQuitRequest>,
    ) -> Result<Response<pb::QuitQuitQuitResponse>, Status> {
        self.check_mutation(&request)?;
        // Already exiting is fine: the request is satisfied.
        let _ = self.agent.quit(Via::Grpc).await;
        Ok(Response::new(pb::QuitQuitQuitResponse {}))
    }

    async fn hot_restart(
        &self,
        request: Request<pb::HotRestartRequest>,
    ) -> Result<Response<pb::HotRestartResponse>, Status> {
        self.check_mutation(&request)?;
        let reason = request.into_inner().reason;
        self.agent
            .hot_restart(format!("grpc: {reason}"))
            .await
            .map(|epoch| Response::new(pb::HotRestartResponse { epoch }))
            .map_err(agent_error)
    }

    async fn update_config(
        &self,
        request: Request<pb::UpdateConfigRequest>,
    ) -> Result<Response<pb::UpdateConfigResponse>, Status> {
        self.check_mutation(&request)?;
        let r = request.into_inner();
        let applied = self
            .agent
            .update_config(r.bootstrap, format!("grpc: {}", r.reason))
            .await
            .map_err(agent_error)?;
        Ok(Response::new(pb::UpdateConfigResponse {
            restarted: applied.restarted_epoch.is_some(),
            epoch: applied.restarted_epoch.unwrap_or_default(),
        }))
    }
}

/// Why the gRPC server could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot serve gRPC on {addr}: {message}")]
pub struct GrpcBindError {
    /// The address.
    pub addr: GrpcAddress,
    /// Why.
    pub message: String,
    /// Whether another process holds the address (may come free: exit 69, not 64).
    pub in_use: bool,
}

/// Binds `addr` and serves until `cancel` fires. Health says SERVING exactly while the agent
/// serves (the newest Envoy LIVE, nothing draining, handing over or stopping). `node_proxy`: a
/// TCP address taken (by a surge predecessor on the same host network) is bound once free.
pub async fn serve(
    addr: GrpcAddress,
    service: Service,
    cancel: CancellationToken,
    node_proxy: bool,
) -> Result<impl std::future::Future<Output = ()>, GrpcBindError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    // Reflection v1, and v1alpha for the clients that speak only that (grpcurl before 1.9,
    // many GUI clients).
    let reflection_error = |e: tonic_reflection::server::Error| GrpcBindError {
        addr: addr.clone(),
        message: e.to_string(),
        in_use: false,
    };
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(envoy_agent_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(reflection_error)?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(envoy_agent_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(reflection_error)?;
    let health_task = {
        // One receiver for the task's life: a fresh clone per wait would see every past
        // change as new and spin.
        let mut changes = service.agent.status();
        let cancel = cancel.clone();
        async move {
            let mut last = None;
            loop {
                let serving = changes.borrow_and_update().agent.serving();
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
                tokio::select! {
                    () = cancel.cancelled() => return,
                    changed = changes.changed() => if changed.is_err() { return },
                }
            }
        }
    };
    let router = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(AgentServiceServer::new(service));
    let fail = |message: String| GrpcBindError {
        addr: addr.clone(),
        message,
        in_use: false,
    };
    let served: Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>> = match &addr
    {
        GrpcAddress::Tcp(a) => {
            let listener = match tokio::net::TcpListener::bind(a).await {
                Ok(l) => Some(l),
                Err(e) if node_proxy && e.kind() == std::io::ErrorKind::AddrInUse => {
                    tracing::warn!(addr = %a, "the gRPC address is in use (by the predecessor pod's agent on this node?): binding it once it is free");
                    None
                }
                Err(e) => return Err(fail(e.to_string())),
            };
            let (a, cancel) = (*a, cancel.clone());
            Box::pin(async move {
                let listener = match listener {
                    Some(l) => l,
                    None => match bind_when_free(a, &cancel).await {
                        Some(l) => l,
                        None => return Ok(()),
                    },
                };
                tracing::info!(addr = %listener.local_addr().map_err(|e| e.to_string())?, "gRPC server listening");
                router
                    .serve_with_incoming_shutdown(
                        tokio_stream::wrappers::TcpListenerStream::new(listener),
                        cancel.cancelled_owned(),
                    )
                    .await
                    .map_err(|e| e.to_string())
            })
        }
        GrpcAddress::Unix(path) => {
            let listener = crate::socket::bind_private(path)
                .and_then(|l| {
                    tokio::net::UnixListener::from_std(l).map_err(|source| {
                        crate::socket::SocketError::Bind {
                            path: path.clone(),
                            source,
                        }
                    })
                })
                .map_err(|e| fail(e.to_string()))?;
            tracing::info!(path = %path.display(), "gRPC server listening");
            Box::pin(async move {
                router
                    .serve_with_incoming_shutdown(
                        tokio_stream::wrappers::UnixListenerStream::new(listener),
                        cancel.cancelled_owned(),
                    )
                    .await
                    .map_err(|e| e.to_string())
            })
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

/// How often a taken address is tried again.
pub(crate) const BIND_RETRY: std::time::Duration = std::time::Duration::from_millis(500);

/// Binds `addr` once it is free (retrying), or `None` when cancelled first.
async fn bind_when_free(
    addr: SocketAddr,
    cancel: &CancellationToken,
) -> Option<tokio::net::TcpListener> {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep(BIND_RETRY) => {}
        }
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => {
                tracing::info!(%addr, "the gRPC address is free now: bound it");
                return Some(l);
            }
            Err(e) => tracing::debug!(%addr, error = %e, "the gRPC address is still taken"),
        }
    }
}

//! The gRPC service for controllers (`envoyagent.v1.AgentService`), standard
//! `grpc.health.v1` (NOT_SERVING while draining) and server reflection (v1 and v1alpha), on a
//! Unix socket (`unix:/path`, mode 0600) or TCP (`host:port`).
//!
//! The service holds handles only: every decision stays with the agent or supervisor actor.
//! `Stop` is the agent's SIGTERM path ([`AgentHandle::stop`]), `ReopenLogs` its SIGUSR1
//! ([`AgentHandle::reopen_logs`]). `WatchStatus` streams read the actor's `watch` channel, so a
//! slow watcher skips to the latest state and costs the actor nothing. Over TCP, mutating RPCs
//! are taken only from a loopback peer whose socket the kernel says belongs to the agent's own
//! user, root or a `--control-allow-uid` ([`crate::callers::peer`]; with hostNetwork every process of the
//! node shares the loopback), else refused (PERMISSION_DENIED), unless `--grpc-allow-remote`; a
//! Unix socket is guarded by its mode (0600). Reading RPCs are open to any peer, except
//! `AdminGet`: Envoy's admin views carry its config and certificates, so they are served to the
//! callers mutating RPCs are ([`crate::grpc::admin_view`] decides which views there are).
//! `SetLogLevel` is a change ([`crate::log_level`] keeps the level in force). Reflection is
//! built at its first request (decoding its descriptor sets is most of the agent's heap, and
//! most agents are never asked).
//!
//! # The status message
//!
//! [`status_message`] maps the agent's typed status (its [`AgentState`], the proxy's
//! `ProxyState` and the shutdown drain's progress) onto the proto, enum to enum (every Rust enum
//! has a proto enum whose zero is `*_UNSPECIFIED`, "does not apply"), `SystemTime` to
//! `Timestamp`, `Duration` to `Duration`, `Option` to an absent field. The settings in force are
//! a snapshot taken at start ([`settings`], from the same [`Settings`] the agent was built from);
//! only Envoy's admin address (Envoy may pick it at start) and its log level (`SetLogLevel`
//! changes it) are filled in per call.

pub mod admin_view;
pub mod socket;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use envoy_agent_proto::pb;
use envoy_agent_proto::pb::agent_service_server::{AgentService, AgentServiceServer};
use envoy_agent_proxy::listeners::{Direction, Listener};
use envoy_agent_proxy::state::{EpochState, FamilyState, HandoffKind, HandoffStage, Outcome};
use envoy_agent_proxy::{
    DrainOptions, DrainPlan, PlanNote, ProxyConfig, ProxyError, ProxyPhase, RestartError, Scope,
    WedgeReason,
};
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::agent::{
    AgentConfig, AgentError, AgentHandle, AgentState, AppWatch, Counting, DrainPhase,
    DrainProgress, DrainReason, ExitPath, Status as AgentStatus, Via,
};
pub use crate::config::settings::GrpcAddress;
use crate::config::settings::{DrainStrategy, Settings};
use crate::crash::{CrashAction, CrashKind, Crashes};
use crate::grpc::admin_view::{Bounds, View, ViewError};
use crate::log_level::{EnvoyLogLevel, SetError};
use crate::signal::Intent;

/// The service name, as health checks and reflection know it.
pub const SERVICE_NAME: &str = "envoyagent.v1.AgentService";

/// The `AgentService` implementation: a handle to the agent and what it reports about itself
/// (its mode, the settings in force). Every RPC goes through the agent actor; no admin call or
/// file write happens here.
#[derive(Debug, Clone)]
pub struct Service {
    agent: AgentHandle,
    mode: pb::Mode,
    settings: pb::Settings,
    /// Envoy's log level in force, and how to change it.
    log_level: EnvoyLogLevel,
    /// `WatchStatus` streams open, at most [`MAX_WATCHERS`]: each holds a copy of the status
    /// and a stream's buffers, and a client with a zero window never reads them.
    watchers: Arc<tokio::sync::Semaphore>,
}

/// The most `WatchStatus` streams open at once, over every connection: controllers need a
/// few; a client opening them by the hundred thousand (with a zero window) grew the agent to
/// 2 GB.
pub const MAX_WATCHERS: usize = 256;
/// The most streams of one HTTP/2 connection at once.
const MAX_STREAMS_PER_CONNECTION: u32 = 32;
/// The pause after a failed accept (no descriptors left, say): an accept loop never spins.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

fn timestamp(t: SystemTime) -> Option<prost_types::Timestamp> {
    Some(prost_types::Timestamp::from(t))
}

fn duration(d: Duration) -> Option<prost_types::Duration> {
    prost_types::Duration::try_from(d).ok()
}

/// The settings in force: Envoy's from the config every Envoy is started with (after setup
/// and the container's fit: the binary found, the admin address resolved, the workers and the
/// drain notice as they are), the agent's from the configuration built from the command line.
/// What `GetStatus` reports under `settings`. The node-proxy fields are absent in sidecar mode.
pub fn settings(settings: &Settings, proxy: &ProxyConfig, config: &AgentConfig) -> pb::Settings {
    let (envoy, drain) = (&proxy.options, &settings.drain);
    let hot = settings.hot_restart.as_ref();
    let path = |p: &std::path::Path| p.display().to_string();
    pb::Settings {
        config_path: path(&proxy.config_path),
        envoy_path: path(&settings.envoy.envoy_path),
        envoy_binary: path(&proxy.binary_path),
        admin_address: settings.envoy.admin_address.map(|a| a.to_string()),
        status_address: settings.status_address.to_string(),
        grpc_address: settings.grpc_address.to_string(),
        drain_time: duration(envoy.drain_time),
        drain_strategy: match envoy.drain_strategy {
            DrainStrategy::Immediate => pb::DrainStrategy::Immediate,
            DrainStrategy::Gradual => pb::DrainStrategy::Gradual,
        }
        .into(),
        drain_all_listeners: envoy.drain_listeners == Scope::All,
        drain_listeners: match envoy.drain_listeners {
            Scope::Auto => pb::DrainScope::Auto,
            Scope::Inbound => pb::DrainScope::Inbound,
            Scope::All => pb::DrainScope::All,
        }
        .into(),
        drain_notice: proxy.drain_notice.is_some(),
        termination_drain_duration: duration(config.termination_drain_duration),
        minimum_drain_duration: duration(config.minimum_drain_duration),
        exit_on_zero_active_connections: config.exit_on_zero == Some(Counting::Connections),
        exit_on_zero: match config.exit_on_zero {
            None => pb::ExitOnZero::Unspecified,
            Some(Counting::Connections) => pb::ExitOnZero::Connections,
            Some(Counting::Requests) => pb::ExitOnZero::Requests,
        }
        .into(),
        drain_delay: duration(config.drain_delay),
        drain_poll_interval: duration(config.poll_interval),
        exclude_listener_ports: drain
            .exclude_listener_ports
            .iter()
            .map(|p| u32::from(*p))
            .collect(),
        exclude_listener_prefixes: drain.exclude_listener_prefixes.clone(),
        stop_grace: duration(envoy.stop_grace),
        parent_shutdown_time: proxy
            .hot_restart
            .as_ref()
            .and_then(|h| duration(h.parent_shutdown_time)),
        handoff_deadline: hot.and_then(|h| duration(h.options.handoff_deadline)),
        admin_unresponsive_deadline: duration(envoy.admin_unresponsive_deadline),
        handover_timeout: hot.and_then(|_| duration(config.handover_timeout)),
        base_id: hot.map(|h| h.base_id),
        state_dir: hot.map(|h| path(&h.state_dir)),
        ready_marker: hot
            .and_then(|h| h.options.ready_marker.as_deref())
            .map(path),
        watch_config: hot.is_some_and(|h| h.options.watch_config),
        grpc_allow_remote: settings.grpc_allow_remote,
        control_allow_uids: settings.control_allow_uids.clone(),
        shutdown_budget: settings
            .shutdown_budget
            .and_then(|split| duration(split.budget)),
        shutdown_timeline: Some(pb::ShutdownTimeline {
            not_ready: duration(drain.timeline.not_ready),
            fail_health_checks: drain.timeline.fail_health_checks.and_then(duration),
            drain: duration(drain.timeline.drain),
            stop_by: drain.timeline.stop_by.and_then(duration),
        }),
        proxy_log_level: envoy_agent_proxy::LogLevel::from_flags(
            &envoy.log_level,
            &envoy.component_log_level,
        )
        .to_string(),
        app_hold: config.app_hold.and_then(duration),
        container: None,
    }
}

/// How Envoy fits its container, as decided at start.
pub fn container(fit: &crate::config::container::Fit) -> pb::Container {
    pb::Container {
        memory_cgroup: fit.memory_cgroup.clone().unwrap_or_default(),
        memory_limit_bytes: fit.memory_limit,
        memory_guard_heap_bytes: fit.memory.on().map(|g| g.max_heap()),
        memory_guard_off: fit.memory.why_off().to_owned(),
        max_downstream_connections: fit.connections.on(),
        max_downstream_connections_off: fit.connections.why_off().to_owned(),
        open_file_limit: fit.nofile,
        cpu_quota: fit.cpu_quota,
        concurrency: fit.workers.concurrency,
        workers: fit.workers.why.clone(),
    }
}

fn drain_reason(reason: DrainReason) -> pb::DrainReason {
    match reason {
        DrainReason::Signal(Intent::Terminate) => pb::DrainReason::Sigterm,
        DrainReason::Signal(Intent::Interrupt) => pb::DrainReason::Sigint,
        DrainReason::Stop => pb::DrainReason::Stop,
        // Neither starts a drain; named for completeness, never seen.
        DrainReason::Signal(Intent::Reload | Intent::ReopenLogs) => pb::DrainReason::Unspecified,
        DrainReason::Request(Via::Http) => pb::DrainReason::HttpDrain,
        DrainReason::Request(Via::Grpc) => pb::DrainReason::GrpcDrain,
    }
}

fn drain_phase(phase: DrainPhase) -> pb::DrainPhase {
    match phase {
        DrainPhase::Deciding => pb::DrainPhase::Deciding,
        DrainPhase::Delay => pb::DrainPhase::Delay,
        DrainPhase::Draining => pb::DrainPhase::Draining,
    }
}

fn exit_path(path: ExitPath) -> pb::ExitPath {
    match path {
        ExitPath::ProxyExited { .. } => pb::ExitPath::ProxyExited,
        ExitPath::ProxyLost { .. } => pb::ExitPath::ProxyLost,
        ExitPath::StartFailed { .. } => pb::ExitPath::StartFailed,
        ExitPath::Wedged { .. } => pb::ExitPath::Wedged,
        ExitPath::DrainTimeElapsed => pb::ExitPath::DrainTimeElapsed,
        ExitPath::DrainFailed => pb::ExitPath::DrainFailed,
        ExitPath::ZeroActive(Counting::Connections) => pb::ExitPath::ZeroConnections,
        ExitPath::ZeroActive(Counting::Requests) => pb::ExitPath::ZeroRequests,
        ExitPath::DrainDeadline(_) => pb::ExitPath::DrainDeadline,
        ExitPath::StatsUnavailable(_) => pb::ExitPath::StatsUnavailable,
        ExitPath::QuitQuitQuit(_) => pb::ExitPath::Quitquitquit,
        ExitPath::SecondSignal => pb::ExitPath::SecondSignal,
        ExitPath::SignalAfterDrain => pb::ExitPath::SignalAfterDrain,
        ExitPath::HandedOver => pb::ExitPath::HandedOver,
        ExitPath::HandoverTimedOut => pb::ExitPath::HandoverTimedOut,
        ExitPath::ProxyStopped => pb::ExitPath::ProxyStopped,
        ExitPath::ProxyFailed => pb::ExitPath::ProxyFailed,
        ExitPath::CrashLoop { .. } => pb::ExitPath::CrashLoop,
        ExitPath::StoppedWhileRecovering => pb::ExitPath::StoppedWhileRecovering,
        ExitPath::AppDone => pb::ExitPath::AppDone,
        ExitPath::AppHoldElapsed => pb::ExitPath::AppHoldElapsed,
        ExitPath::OomKilled { .. } => pb::ExitPath::OomKilled,
    }
}

fn epoch_state(state: EpochState) -> pb::EpochState {
    match state {
        EpochState::Starting => pb::EpochState::Starting,
        EpochState::Live => pb::EpochState::Live,
        EpochState::Draining => pb::EpochState::Draining,
    }
}

fn outcome(outcome: Outcome) -> pb::HandoffOutcome {
    match outcome {
        Outcome::Live => pb::HandoffOutcome::Live,
        Outcome::Rejected => pb::HandoffOutcome::Rejected,
        Outcome::Failed => pb::HandoffOutcome::Failed,
        Outcome::TimedOut => pb::HandoffOutcome::TimedOut,
    }
}

fn stage(stage: HandoffStage) -> pb::HandoffStage {
    match stage {
        HandoffStage::Queued => pb::HandoffStage::Queued,
        HandoffStage::PreFlight => pb::HandoffStage::PreFlight,
        HandoffStage::Starting => pb::HandoffStage::Starting,
    }
}

fn wedge_reason(reason: WedgeReason) -> pb::WedgeReason {
    match reason {
        WedgeReason::HandoffDeadline => pb::WedgeReason::HandoffDeadline,
        WedgeReason::AdminUnresponsive => pb::WedgeReason::AdminUnresponsive,
        WedgeReason::StaleInitializing => pb::WedgeReason::StaleInitializing,
        WedgeReason::ParentOverdue => pb::WedgeReason::ParentOverdue,
    }
}

fn handoff_result(h: &envoy_agent_proxy::state::HandoffResult) -> pb::HandoffResult {
    pb::HandoffResult {
        epoch: h.epoch,
        reason: h.reason.clone(),
        outcome: outcome(h.outcome).into(),
        duration: duration(h.duration),
        queued: duration(h.queued),
        pre_flight: duration(h.preflight),
        end_time: timestamp(h.at),
        message: h.message.clone(),
        kind: handoff_kind(&h.kind).into(),
        cold: cold_handover(&h.kind),
    }
}

fn handoff_kind(kind: &HandoffKind) -> pb::HandoffKind {
    match kind {
        HandoffKind::Hot => pb::HandoffKind::Hot,
        HandoffKind::Cold { .. } => pb::HandoffKind::Cold,
    }
}

fn cold_handover(kind: &HandoffKind) -> Option<pb::ColdHandover> {
    match kind {
        HandoffKind::Hot => None,
        HandoffKind::Cold {
            why,
            from_base_id,
            to_base_id,
        } => Some(pb::ColdHandover {
            why: why.clone(),
            from_base_id: *from_base_id,
            to_base_id: *to_base_id,
        }),
    }
}

fn epoch_message(e: &envoy_agent_proxy::EpochInfo) -> pb::Epoch {
    pb::Epoch {
        epoch: e.epoch,
        pid: e.pid,
        state: epoch_state(e.state).into(),
        start_time: timestamp(e.started),
        state_since: timestamp(e.since),
    }
}

fn family_message(f: &FamilyState) -> pb::Family {
    pb::Family {
        base_id: f.base_id,
        hot_restart_version: f.hot_restart_version.clone(),
        identity: f.identity.clone(),
        socket_path: f.socket_path.clone(),
        handoff: f.handoff.as_ref().map(|h| pb::Handoff {
            epoch: h.epoch,
            reason: h.reason.clone(),
            start_time: timestamp(h.since),
            stage: stage(h.stage).into(),
            waiting_for: h.waiting_for.clone(),
            kind: handoff_kind(&h.kind).into(),
            cold: cold_handover(&h.kind),
        }),
        last_handoff: f.last_handoff.as_ref().map(handoff_result),
        handoffs: f.handoffs.iter().map(handoff_result).collect(),
        exits: f
            .exits
            .iter()
            .map(|e| pb::EpochExit {
                epoch: e.epoch,
                pid: e.pid,
                state: epoch_state(e.state).into(),
                exit_code: e.code,
                signal: e.signal,
                description: e.how.clone(),
                time: timestamp(e.at),
            })
            .collect(),
        wedges: f
            .wedges
            .iter()
            .map(|w| pb::Wedge {
                reason: wedge_reason(w.reason).into(),
                time: timestamp(w.at),
                message: w.message.clone(),
            })
            .collect(),
        predecessor: f.predecessor.clone(),
        predecessor_drains_until: f.foreign_parent_until.and_then(timestamp),
        successor_starting: f.successor_starting.clone(),
        handed_over_to: f.handed_over_to.clone(),
        drained: f.drained,
        retiring: f.retiring.iter().map(epoch_message).collect(),
    }
}

/// The status message: the agent's state, the proxy's epochs (one Envoy in sidecar mode;
/// with hot restart, every epoch plus the family's facts), the shutdown drain under way and
/// the settings in force. `admin`: Envoy's admin address as known now.
pub fn status_message(
    status: &AgentStatus,
    mode: pb::Mode,
    settings: &pb::Settings,
    admin: Option<&envoy_agent_proxy::admin::Address>,
) -> pb::Status {
    let agent = &status.agent;
    let facts = state_facts(agent);
    let proxy = &status.proxy;
    pb::Status {
        mode: mode.into(),
        state: facts.state.into(),
        reason: state_reason(status),
        state_since: timestamp(agent.since()),
        ready: status.ready(),
        draining: agent.draining(),
        drain_reason: facts
            .draining
            .map_or(pb::DrainReason::Unspecified, |w| w.0)
            .into(),
        drain_phase: facts
            .draining
            .map_or(pb::DrainPhase::Unspecified, |w| w.1)
            .into(),
        exit_path: facts
            .exiting
            .map_or(pb::ExitPath::Unspecified, exit_path)
            .into(),
        exit_code: facts.exiting.map(|p| u32::from(p.code())),
        successor: facts.successor.filter(|s| !s.is_empty()),
        epochs: proxy.epochs.iter().map(epoch_message).collect(),
        newest_live_epoch: proxy.newest_live,
        drain: status.drain.as_ref().map(drain_message),
        settings: Some(settings_in_force(settings, admin)),
        family: proxy.family.as_ref().map(family_message),
        crash_recovery: crash_recovery_message(&status.crashes, agent),
        control_plane: status
            .proxy
            .config
            .control_plane()
            .map(control_plane_message),
        admin_silent_since: proxy.admin.silent_since().and_then(timestamp),
        log_lines_dropped: envoy_agent_proxy::output::dropped_lines(),
    }
}

/// Why the proxy is not ready, in words; empty when it is.
fn not_ready(status: &AgentStatus) -> String {
    status
        .proxy
        .ready()
        .err()
        .map(|why| why.to_string())
        .unwrap_or_default()
}

/// The state's reason, for a person: why the agent drains, exits or is not ready.
fn state_reason(status: &AgentStatus) -> String {
    let agent = &status.agent;
    match agent {
        AgentState::Draining { reason, phase, .. } => match phase {
            DrainPhase::Deciding => format!("{reason} (is a successor taking over?)"),
            DrainPhase::Delay => format!("{reason} (drain delay)"),
            DrainPhase::Draining => reason.to_string(),
        },
        AgentState::HandedOver { successor, .. } => format!("handed over to {successor}"),
        AgentState::HandingOver { successor, .. } => format!("handing over to {successor}"),
        AgentState::Exiting { path, .. } => path.to_string(),
        AgentState::Recovering { .. } => agent.to_string(),
        AgentState::Live { .. } => not_ready(status),
        // Empty while Envoy starts; what the proxy says when it stops on its own (wedged).
        AgentState::Starting { .. } if status.proxy.phase != ProxyPhase::Starting => {
            not_ready(status)
        }
        AgentState::Starting { .. } => String::new(),
    }
}

/// The agent's state as the message's fields have it: each field set only in the states it
/// belongs to.
struct StateFacts {
    state: pb::AgentState,
    /// While draining: why, and how far.
    draining: Option<(pb::DrainReason, pb::DrainPhase)>,
    /// While exiting: the exit path.
    exiting: Option<ExitPath>,
    /// While handing over or handed over: the successor.
    successor: Option<String>,
}

fn state_facts(agent: &AgentState) -> StateFacts {
    let (state, draining, exiting, successor) = match agent {
        AgentState::Starting { .. } => (pb::AgentState::Starting, None, None, None),
        AgentState::Live { .. } => (pb::AgentState::Live, None, None, None),
        AgentState::Draining { reason, phase, .. } => (
            pb::AgentState::Draining,
            Some((drain_reason(*reason), drain_phase(*phase))),
            None,
            None,
        ),
        AgentState::HandedOver { successor, .. } => (
            pb::AgentState::HandedOver,
            None,
            None,
            Some(successor.clone()),
        ),
        AgentState::HandingOver { successor, .. } => (
            pb::AgentState::HandingOver,
            None,
            None,
            Some(successor.clone()),
        ),
        AgentState::Exiting { path, .. } => (pb::AgentState::Exiting, None, Some(*path), None),
        AgentState::Recovering { .. } => (pb::AgentState::Recovering, None, None, None),
    };
    StateFacts {
        state,
        draining,
        exiting,
        successor,
    }
}

/// The shutdown drain under way: its counts, its listeners and what it drained.
fn drain_message(d: &DrainProgress) -> pb::Drain {
    pb::Drain {
        reason: drain_reason(d.reason).into(),
        start_time: timestamp(d.started),
        deadline: d.deadline.and_then(timestamp),
        active_connections: d
            .last_count
            .filter(|_| d.counting == Some(Counting::Connections))
            .map(|(n, _)| n),
        active_requests: d
            .last_count
            .filter(|_| d.counting == Some(Counting::Requests))
            .map(|(n, _)| n),
        count_time: d.last_count.and_then(|(_, at)| timestamp(at)),
        listeners: d
            .listeners
            .iter()
            .flat_map(|(listeners, _)| listeners)
            .map(|l| pb::ListenerDrain {
                name: l.name.clone(),
                active_connections: l.connections,
                active_requests: l.requests,
                upgrades_active: l.upgrades,
            })
            .collect(),
        listeners_time: d.listeners.as_ref().and_then(|(_, at)| timestamp(*at)),
        drained: d
            .drained
            .iter()
            .flat_map(|p| &p.drained)
            .map(drained_listener)
            .collect(),
        drained_known: d
            .drained
            .as_ref()
            .is_some_and(|p| !matches!(p.note, PlanNote::Unknown(_) | PlanNote::NotServing)),
        inbound_only: d.drained.as_ref().is_some_and(|p| p.inbound_only),
        drained_note: d.drained.as_ref().map(drained_note).unwrap_or_default(),
        accepted: d.drained.is_some(),
        app: match d.app {
            None => pb::AppWatch::Unspecified,
            Some(AppWatch::Unknown) => pb::AppWatch::Unknown,
            Some(AppWatch::NotSeen) => pb::AppWatch::NotSeen,
            Some(AppWatch::Holding { .. }) => pb::AppWatch::Holding,
            Some(AppWatch::LetGo) => pb::AppWatch::LetGo,
        }
        .into(),
        app_hold_until: match d.app {
            Some(AppWatch::Holding { until }) => timestamp(until),
            _ => None,
        },
        stops: d.stops,
    }
}

/// The settings taken at start, with Envoy's admin address as known now (it may be learnt
/// only once Envoy runs).
fn settings_in_force(
    settings: &pb::Settings,
    admin: Option<&envoy_agent_proxy::admin::Address>,
) -> pb::Settings {
    let mut settings = settings.clone();
    if let Some(admin) = admin {
        settings.admin_address = Some(admin.to_string());
    }
    settings
}

fn control_plane_message(cp: &envoy_agent_proxy::ControlPlane) -> pb::ControlPlane {
    pb::ControlPlane {
        epoch: cp.epoch,
        received: cp.received(),
        connected: cp.connected,
        disconnected_since: cp.disconnected_since.and_then(timestamp),
        types: cp
            .types
            .iter()
            .map(|t| pb::XdsType {
                name: t.kind.as_str().to_owned(),
                update_success: t.update_success,
                update_rejected: t.update_rejected,
                init_fetch_timeout: t.init_fetch_timeout,
            })
            .collect(),
    }
}

fn crash_recovery_message(crashes: &Crashes, agent: &AgentState) -> Option<pb::CrashRecovery> {
    let recovery = crashes.recovery.as_ref()?;
    Some(pb::CrashRecovery {
        limit: recovery.limit,
        backoff: duration(recovery.backoff),
        backoff_max: duration(recovery.backoff_max),
        stable_after: duration(recovery.stable_after),
        consecutive_crashes: crashes.consecutive,
        total_crashes: crashes.total,
        next_restart_time: match agent {
            AgentState::Recovering { restart_at, .. } => timestamp(*restart_at),
            _ => None,
        },
        crashes: crashes
            .recent
            .iter()
            .map(|c| {
                let (action, attempt, backoff) = match c.action {
                    CrashAction::Restart { attempt, backoff } => {
                        (pb::CrashAction::Restart, attempt, duration(backoff))
                    }
                    CrashAction::GiveUp => (pb::CrashAction::GiveUp, 0, None),
                };
                pb::Crash {
                    time: timestamp(c.at),
                    kind: match c.kind {
                        CrashKind::Exited => pb::CrashKind::Exited,
                        CrashKind::Lost => pb::CrashKind::Lost,
                        CrashKind::StartFailed => pb::CrashKind::StartFailed,
                        CrashKind::Wedged => pb::CrashKind::Wedged,
                        CrashKind::OomKilled => pb::CrashKind::OomKilled,
                    }
                    .into(),
                    epoch: c.process.map(|(epoch, _)| epoch),
                    pid: c.process.map(|(_, pid)| pid),
                    exit_code: u32::from(c.code),
                    signal: c.signal,
                    ran_for: c.ran_for.and_then(duration),
                    stderr_tail: c.stderr_tail.clone(),
                    action: action.into(),
                    attempt,
                    backoff,
                }
            })
            .collect(),
    })
}

impl Service {
    /// A service over the agent behind `agent`, which runs in `mode` with `settings` (see
    /// [`settings`]; `grpc_allow_remote` there decides who may call mutating RPCs) and Envoy's
    /// log level `log_level`.
    pub fn new(
        agent: AgentHandle,
        mode: pb::Mode,
        settings: pb::Settings,
        log_level: EnvoyLogLevel,
    ) -> Self {
        Service {
            agent,
            mode,
            settings,
            log_level,
            watchers: Arc::new(tokio::sync::Semaphore::new(MAX_WATCHERS)),
        }
    }

    fn status_now(&self, status: &AgentStatus) -> pb::Status {
        let admin = self.agent.admin();
        let mut message = status_message(
            status,
            self.mode,
            &self.settings,
            admin.as_ref().map(|a| a.addr()),
        );
        if let Some(settings) = &mut message.settings {
            settings.proxy_log_level = self.log_level.in_force().to_string();
        }
        message
    }

    /// Whether the caller may change anything: [`Service::check_caller`] for a mutating call.
    async fn check_mutation<T>(&self, request: &Request<T>) -> Result<(), Status> {
        self.check_caller(request, "mutating calls").await
    }

    /// Whether the caller may make `calls` (mutating calls, Envoy's admin views). A Unix
    /// socket is guarded by its mode (0600). Over TCP: a loopback peer whose socket (per the
    /// kernel's socket table) belongs to the agent's own user, root or an allowed uid; anyone
    /// with `--grpc-allow-remote`.
    async fn check_caller<T>(&self, request: &Request<T>, calls: &str) -> Result<(), Status> {
        let (Some(peer), Some(local)) = (request.remote_addr(), request.local_addr()) else {
            return Ok(());
        };
        if self.settings.grpc_allow_remote {
            return Ok(());
        }
        if !peer.ip().to_canonical().is_loopback() {
            tracing::warn!(event = "grpc_refused", %peer, calls, "refused a gRPC call from a non-loopback peer");
            return Err(Status::permission_denied(format!(
                "{peer} is not a loopback peer (the agent allows {calls} from loopback only; see --grpc-allow-remote)"
            )));
        }
        let callers = crate::callers::peer::Callers {
            uids: self.settings.control_allow_uids.clone(),
        };
        callers.check(peer, local).await.map_err(|refusal| {
            tracing::warn!(event = "grpc_refused", %peer, uid = refusal.uid(), calls, error = %refusal, "refused a gRPC call");
            Status::permission_denied(format!("{calls}: {refusal}"))
        })
    }
}

/// A view's failure as the call's status: Envoy's refusal FAILED_PRECONDITION (its words), a
/// bound run out DEADLINE_EXCEEDED, Envoy not reachable UNAVAILABLE.
fn view_error(e: ViewError) -> Status {
    match &e {
        ViewError::Admin(envoy_agent_proxy::AdminError::Status { .. }) => {
            Status::failed_precondition(e.to_string())
        }
        ViewError::Admin(envoy_agent_proxy::AdminError::Timeout { .. })
        | ViewError::Timeout { .. } => Status::deadline_exceeded(e.to_string()),
        _ => Status::unavailable(e.to_string()),
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

type StatusStream = Pin<Box<dyn Stream<Item = Result<pb::WatchStatusResponse, Status>> + Send>>;
type ViewStream = Pin<Box<dyn Stream<Item = Result<pb::AdminGetResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for Service {
    async fn get_status(
        &self,
        _request: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let status = self.status_now(&self.agent.status().borrow());
        Ok(Response::new(pb::GetStatusResponse {
            status: Some(status),
        }))
    }

    type WatchStatusStream = StatusStream;

    async fn watch_status(
        &self,
        _request: Request<pb::WatchStatusRequest>,
    ) -> Result<Response<Self::WatchStatusStream>, Status> {
        let Ok(watching) = self.watchers.clone().try_acquire_owned() else {
            return Err(Status::resource_exhausted(format!(
                "{MAX_WATCHERS} WatchStatus streams are open already: close one, or use GetStatus"
            )));
        };
        let service = self.clone();
        let stream: StatusStream = Box::pin(
            tokio_stream::wrappers::WatchStream::new(self.agent.status()).map(move |status| {
                // Held while the stream lives: dropped with it.
                let _watching = &watching;
                Ok(pb::WatchStatusResponse {
                    status: Some(service.status_now(&status)),
                })
            }),
        );
        Ok(Response::new(stream))
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::DrainResponse>, Status> {
        self.check_mutation(&request).await?;
        let r = request.into_inner();
        let listeners = match r.listeners() {
            pb::DrainScope::Inbound => Scope::Inbound,
            pb::DrainScope::All => Scope::All,
            // The deprecated field: true asked for inbound listeners only; false is what an
            // unset bool reads as, so it means "the agent's setting".
            pb::DrainScope::Unspecified if r.inbound_only => Scope::Inbound,
            // The agent's setting (the proxy resolves it).
            pb::DrainScope::Unspecified | pb::DrainScope::Auto => Scope::Auto,
        };
        let options = DrainOptions {
            listeners,
            skip_exit: r.skip_exit,
            hold_notice: false,
        };
        let plan = self
            .agent
            .drain(options, Via::Grpc)
            .await
            .map_err(agent_error)?;
        Ok(Response::new(pb::DrainResponse {
            drained: plan
                .iter()
                .flat_map(|p| &p.drained)
                .map(drained_listener)
                .collect(),
            drained_note: plan.as_ref().map(drained_note).unwrap_or_default(),
        }))
    }

    async fn drain_now(
        &self,
        request: Request<pb::DrainNowRequest>,
    ) -> Result<Response<pb::DrainNowResponse>, Status> {
        self.check_mutation(&request).await?;
        self.agent.drain_now(Via::Grpc).await.map_err(agent_error)?;
        Ok(Response::new(pb::DrainNowResponse {}))
    }

    async fn disable_draining(
        &self,
        request: Request<pb::DisableDrainingRequest>,
    ) -> Result<Response<pb::DisableDrainingResponse>, Status> {
        self.check_mutation(&request).await?;
        self.agent.disable_draining().await.map_err(agent_error)?;
        Ok(Response::new(pb::DisableDrainingResponse {}))
    }

    async fn stop(
        &self,
        request: Request<pb::StopRequest>,
    ) -> Result<Response<pb::StopResponse>, Status> {
        self.check_mutation(&request).await?;
        // Already exiting is fine: the request is satisfied, as for QuitQuitQuit.
        let _ = self.agent.stop().await;
        Ok(Response::new(pb::StopResponse {}))
    }

    async fn quit_quit_quit(
        &self,
        request: Request<pb::QuitQuitQuitRequest>,
    ) -> Result<Response<pb::QuitQuitQuitResponse>, Status> {
        self.check_mutation(&request).await?;
        // Already exiting is fine: the request is satisfied.
        let _ = self.agent.quit(Via::Grpc).await;
        Ok(Response::new(pb::QuitQuitQuitResponse {}))
    }

    async fn reopen_logs(
        &self,
        request: Request<pb::ReopenLogsRequest>,
    ) -> Result<Response<pb::ReopenLogsResponse>, Status> {
        self.check_mutation(&request).await?;
        let signalled = self.agent.reopen_logs().await.map_err(agent_error)?;
        tracing::info!(
            event = "reopen_logs",
            envoys = signalled,
            "gRPC ReopenLogs: asked envoy to reopen its logs"
        );
        Ok(Response::new(pb::ReopenLogsResponse {
            envoys_signalled: u32::try_from(signalled).unwrap_or(u32::MAX),
        }))
    }

    async fn hot_restart(
        &self,
        request: Request<pb::HotRestartRequest>,
    ) -> Result<Response<pb::HotRestartResponse>, Status> {
        self.check_mutation(&request).await?;
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
        self.check_mutation(&request).await?;
        let r = request.into_inner();
        let applied = self
            .agent
            .update_config(r.bootstrap, format!("grpc: {}", r.reason))
            .await
            .map_err(agent_error)?;
        Ok(Response::new(pb::UpdateConfigResponse {
            restarted: applied.restarted_epoch.is_some(),
            epoch: applied.restarted_epoch,
        }))
    }

    type AdminGetStream = ViewStream;

    async fn admin_get(
        &self,
        request: Request<pb::AdminGetRequest>,
    ) -> Result<Response<Self::AdminGetStream>, Status> {
        self.check_caller(&request, "envoy's admin views").await?;
        let peer = request.remote_addr();
        let path = request.into_inner().path;
        let view = View::parse(&path).map_err(|refused| {
            tracing::info!(event = "admin_view", path, ?peer, refused = %refused, "refused an admin view");
            Status::invalid_argument(refused.to_string())
        })?;
        tracing::info!(
            event = "admin_view",
            endpoint = view.endpoint(),
            ?peer,
            "admin view"
        );
        let mut chunks =
            crate::grpc::admin_view::stream(self.agent.admin(), view, Bounds::default());
        // The first chunk decides the call's status: Envoy refusing or silent is an error of
        // the call (which a client reads as such), not an answer that ends oddly.
        let first = match chunks.next().await {
            None => None,
            Some(Ok(chunk)) => Some(chunk),
            Some(Err(e)) => return Err(view_error(e)),
        };
        let stream: ViewStream = Box::pin(tokio_stream::iter(first.map(Ok)).chain(chunks).map(
            |chunk| match chunk {
                Ok(chunk) => Ok(pb::AdminGetResponse {
                    chunk: chunk.to_vec(),
                }),
                Err(e) => Err(view_error(e)),
            },
        ));
        Ok(Response::new(stream))
    }

    async fn set_log_level(
        &self,
        request: Request<pb::SetLogLevelRequest>,
    ) -> Result<Response<pb::SetLogLevelResponse>, Status> {
        self.check_mutation(&request).await?;
        let level = request.into_inner().level;
        match self.log_level.set(&level, &self.agent).await {
            Ok(applied) => Ok(Response::new(pb::SetLogLevelResponse {
                level: applied.level.to_string(),
                envoys: applied.envoys,
            })),
            Err(e @ (SetError::Level(_) | SetError::Refused { .. })) => {
                Err(Status::invalid_argument(e.to_string()))
            }
            Err(e @ SetError::Unreachable { .. }) => Err(Status::unavailable(e.to_string())),
        }
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
    /// Whether another process holds the address (may come free: exit
    /// [`crate::exit_code::UNAVAILABLE`], not [`crate::exit_code::USAGE`]).
    pub in_use: bool,
}

/// Reflection of the agent's API and of health, before its version is picked.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(envoy_agent_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// Reflection v1.
fn reflection_v1() -> Result<
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    tonic_reflection::server::Error,
> {
    reflection().build_v1()
}

/// Reflection v1alpha.
fn reflection_v1alpha() -> Result<
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
    tonic_reflection::server::Error,
> {
    reflection().build_v1alpha()
}

/// A gRPC service built when its first request comes (then kept): for a service that costs
/// memory to build and is seldom asked. A build that fails answers each request `INTERNAL`
/// with the reason (the descriptor sets are compiled in, and a unit test builds them).
struct OnFirstCall<S, E> {
    built: Arc<OnceLock<Result<S, String>>>,
    build: fn() -> Result<S, E>,
}

impl<S, E> Clone for OnFirstCall<S, E> {
    fn clone(&self) -> Self {
        OnFirstCall {
            built: self.built.clone(),
            build: self.build,
        }
    }
}

impl<S, E> OnFirstCall<S, E> {
    fn new(build: fn() -> Result<S, E>) -> Self {
        OnFirstCall {
            built: Arc::default(),
            build,
        }
    }
}

impl<S: tonic::server::NamedService, E> tonic::server::NamedService for OnFirstCall<S, E> {
    const NAME: &'static str = S::NAME;
}

impl<S, E, B> tower::Service<tonic::codegen::http::Request<B>> for OnFirstCall<S, E>
where
    S: tower::Service<
            tonic::codegen::http::Request<B>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    E: std::fmt::Display,
    B: Send + 'static,
{
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: tonic::codegen::http::Request<B>) -> Self::Future {
        let build = self.build;
        match self
            .built
            .get_or_init(|| build().map_err(|e| e.to_string()))
        {
            Ok(service) => {
                let mut service = service.clone();
                Box::pin(async move {
                    std::future::poll_fn(|cx| service.poll_ready(cx)).await?;
                    service.call(request).await
                })
            }
            Err(e) => {
                let status = Status::internal(format!("cannot build the service: {e}"));
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
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
    // Built at the first reflection request: decoding the descriptor sets they serve kept
    // ~0.75 MiB of heap resident for the two, most of the agent's, and most agents are never
    // asked (docs/performance.md).
    let reflection = OnFirstCall::new(reflection_v1);
    let reflection_v1alpha = OnFirstCall::new(reflection_v1alpha);
    // One receiver for the task's life: a fresh clone per wait would see every past change as
    // new and spin.
    let health_task = report_health(reporter, service.agent.status(), cancel.clone());
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(AgentServiceServer::new(service));
    let fail = |message: String| GrpcBindError {
        addr: addr.clone(),
        message,
        in_use: false,
    };
    let served = match &addr {
        GrpcAddress::Tcp(a) => serve_tcp(*a, router, cancel, node_proxy)
            .await
            .map_err(|e| GrpcBindError {
                // May come free (another process's): retried by a supervisor, as the status
                // address is. A Unix socket another agent serves on is the operator's to fix.
                in_use: e.kind() == std::io::ErrorKind::AddrInUse,
                ..fail(e.to_string())
            })?,
        GrpcAddress::Unix(path) => {
            serve_unix(path, router, cancel).map_err(|e| fail(e.to_string()))?
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

/// A bound gRPC server, serving until cancelled.
type Served = Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>;

/// Keeps health's status of the agent's service (and of the server, `""`) in step with
/// whether the agent serves, until `cancel` fires or the agent is gone.
async fn report_health(
    reporter: tonic_health::server::HealthReporter,
    mut changes: tokio::sync::watch::Receiver<AgentStatus>,
    cancel: CancellationToken,
) {
    let mut last = None;
    loop {
        let serving = changes.borrow_and_update().ready();
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

/// Binds the TCP address `a` (once free, when a node proxy finds it taken) and serves on it.
async fn serve_tcp(
    a: SocketAddr,
    router: tonic::transport::server::Router,
    cancel: CancellationToken,
    node_proxy: bool,
) -> Result<Served, std::io::Error> {
    let listener = match tokio::net::TcpListener::bind(a).await {
        Ok(l) => Some(l),
        Err(e) if node_proxy && e.kind() == std::io::ErrorKind::AddrInUse => {
            tracing::warn!(addr = %a, "the gRPC address is in use (by the predecessor pod's agent on this node?): binding it once it is free");
            None
        }
        Err(e) => return Err(e),
    };
    Ok(Box::pin(async move {
        let listener = match listener {
            Some(l) => l,
            None => match bind_when_free(a, &cancel).await {
                Some(l) => l,
                None => return Ok(()),
            },
        };
        tracing::info!(addr = %listener.local_addr().map_err(|e| e.to_string())?, "gRPC server listening");
        let connections = crate::callers::connections::Connections::new("grpc");
        let held = cancel.clone();
        let incoming =
            paced(tokio_stream::wrappers::TcpListenerStream::new(listener)).map(move |accepted| {
                accepted.map(|io| {
                    let peer = io.peer_addr().ok();
                    Held::new(io, connections.admit(&held, peer))
                })
            });
        router
            .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
            .await
            .map_err(|e| e.to_string())
    }))
}

/// Binds the Unix socket `path` (private to the agent's user) and serves on it.
fn serve_unix(
    path: &std::path::Path,
    router: tonic::transport::server::Router,
    cancel: CancellationToken,
) -> Result<Served, crate::grpc::socket::SocketError> {
    let listener = crate::grpc::socket::bind_private(path).and_then(|l| {
        tokio::net::UnixListener::from_std(l).map_err(|source| {
            crate::grpc::socket::SocketError::Bind {
                path: path.to_owned(),
                source,
            }
        })
    })?;
    tracing::info!(path = %path.display(), "gRPC server listening");
    let connections = crate::callers::connections::Connections::new("grpc");
    let held = cancel.clone();
    Ok(Box::pin(async move {
        let incoming = paced(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .map(move |accepted| accepted.map(|io| Held::new(io, connections.admit(&held, None))));
        router
            .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
            .await
            .map_err(|e| e.to_string())
    }))
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

/// The accepted connections of `incoming`; a failed accept is logged and followed by a pause,
/// never handed on (a server that polls again at once spins while descriptors are out).
fn paced<S, T>(incoming: S) -> impl tokio_stream::Stream<Item = Result<T, std::io::Error>>
where
    S: tokio_stream::Stream<Item = Result<T, std::io::Error>>,
{
    incoming
        .then(|accepted| async move {
            if let Err(e) = &accepted {
                tracing::warn!(error = %e, "gRPC server: cannot accept");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
            accepted
        })
        .filter(Result::is_ok)
}

/// A gRPC connection that ends once its place is needed for a newer one
/// ([`crate::callers::connections`]): the server reads EOF, writes fail, and hyper drops it.
struct Held<T> {
    io: T,
    closed: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    _admitted: crate::callers::connections::Admitted,
}

impl<T> Held<T> {
    fn new(io: T, admitted: crate::callers::connections::Admitted) -> Self {
        Held {
            io,
            closed: Box::pin(admitted.closing.clone().cancelled_owned()),
            _admitted: admitted,
        }
    }

    fn is_closed(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        self.closed.as_mut().poll(cx).is_ready()
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Held<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.is_closed(cx) {
            // End of stream.
            return std::task::Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Held<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.is_closed(cx) {
            return std::task::Poll::Ready(Err(std::io::ErrorKind::ConnectionAborted.into()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Held<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

fn drained_listener(l: &Listener) -> pb::DrainedListener {
    pb::DrainedListener {
        name: l.name.clone(),
        direction: match l.direction {
            Direction::Inbound => pb::TrafficDirection::Inbound,
            Direction::Outbound => pb::TrafficDirection::Outbound,
            Direction::Unspecified => pb::TrafficDirection::Unspecified,
        }
        .into(),
        stat_name: l.stat_name.clone(),
    }
}

/// Why a drain reached what it reached, when not simply as asked (empty then).
fn drained_note(plan: &DrainPlan) -> String {
    match &plan.note {
        PlanNote::AsAsked | PlanNote::NotServing => String::new(),
        PlanNote::NoInbound => {
            "no listener is marked INBOUND: every listener was drained".to_owned()
        }
        PlanNote::NothingInbound => {
            "inbound listeners only were asked for, and none is marked INBOUND: none was drained"
                .to_owned()
        }
        PlanNote::Unknown(why) => format!(
            "envoy's listeners could not be read ({why}): {} by the mode's rule",
            if plan.inbound_only {
                "the INBOUND ones were drained"
            } else {
                "every listener was drained"
            }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn watch_streams_are_bounded() {
        let proxy = std::sync::Arc::new(crate::testing::FakeProxy::default());
        let (_agent, handle) =
            crate::agent::Agent::new(proxy, crate::agent::AgentConfig::default());
        let service = Service::new(
            handle,
            pb::Mode::Sidecar,
            pb::Settings::default(),
            EnvoyLogLevel::new("warning", "", envoy_agent_proxy::LogLevelCell::default()),
        );
        let mut open = Vec::new();
        for _ in 0..MAX_WATCHERS {
            let stream = service
                .watch_status(Request::new(pb::WatchStatusRequest {}))
                .await
                .unwrap();
            open.push(stream);
        }
        let refused = service
            .watch_status(Request::new(pb::WatchStatusRequest {}))
            .await
            .err()
            .expect("the stream past the cap is refused");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        open.pop();
        assert!(
            service
                .watch_status(Request::new(pb::WatchStatusRequest {}))
                .await
                .is_ok(),
            "a closed stream frees its place"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_accept_pauses_and_is_not_handed_on() {
        let incoming = tokio_stream::iter(vec![
            Err(std::io::Error::from_raw_os_error(24)),
            Ok(1),
            Err(std::io::Error::from_raw_os_error(24)),
            Ok(2),
        ]);
        let started = tokio::time::Instant::now();
        let accepted: Vec<u32> = paced(incoming).map(|r| r.unwrap()).collect().await;
        assert_eq!(accepted, [1, 2]);
        assert!(started.elapsed() >= ACCEPT_ERROR_PAUSE * 2);
    }

    /// The reflection services are built at their first request, not at start: their
    /// descriptor sets must build.
    #[test]
    fn both_reflection_services_build() {
        assert!(reflection_v1().is_ok());
        assert!(reflection_v1alpha().is_ok());
    }

    /// A service that cannot be built answers INTERNAL, naming why.
    #[tokio::test]
    async fn a_service_that_cannot_be_built_answers_internal() {
        fn broken() -> Result<
            tonic_reflection::server::v1::ServerReflectionServer<
                impl tonic_reflection::server::v1::ServerReflection,
            >,
            tonic_reflection::server::Error,
        > {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(b"\xff not a descriptor set")
                .build_v1()
        }
        let mut service = OnFirstCall::new(broken);
        let request = tonic::codegen::http::Request::new(tonic::body::Body::empty());
        let response = tower::Service::call(&mut service, request).await.unwrap();
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::Internal);
        assert!(status.message().contains("cannot build"), "{status:?}");
    }
}

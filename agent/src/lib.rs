//! envoy-agent: a process manager for the Envoy proxy.
//!
//! # Theory of operation
//!
//! `main` parses the command line ([`cli`]), starts tracing and calls [`run`]. [`run`] checks
//! its input first ([`setup`]: bootstrap, admin address, Envoy binary, status address) so that
//! bad input fails with one line and exit code 64 before anything starts. It then builds an
//! [`envoy_agent_proxy::Envoy`], an [`Agent`] over it and the [`status`] server, and runs them:
//!
//! 1. **Decide when**: the agent actor alone decides when Envoy stops, from [`Intent`]s
//!    (signals, from an injectable [`IntentSource`]), commands from its [`AgentHandle`]s
//!    (`/drain`, `/quitquitquit`) and Envoy's own exit. See [`agent`] for the exit paths.
//! 2. **Tell everyone**: once the agent has stopped and reaped Envoy, a `CancellationToken`
//!    tells the status server to stop. The server stays up through the whole drain.
//! 3. **Wait**: a `TaskTracker` waits for the server, bounded by [`SHUTDOWN_GRACE`].
//!
//! Nothing outlives [`run`]: Envoy is reaped before it returns, and dropping the future kills
//! Envoy (it was spawned with kill-on-drop) rather than leaking it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_agent_drain::Exclusions;
use envoy_agent_proxy::{AdminAddress, Envoy};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub mod agent;
pub mod cli;
pub mod client;
pub mod duration;
pub mod grpc;
pub mod setup;
pub mod signal;
pub mod status;
pub mod telemetry;
#[cfg(test)]
mod testing;

pub use agent::{Agent, AgentConfig, AgentExit, AgentHandle, AgentState, ExitPath};
pub use setup::{EXIT_USAGE, SetupError};
pub use signal::{Intent, IntentSource, UnixSignals};

/// How long the agent waits for its own tasks (the status server) once Envoy is gone.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The agent's drain settings from the command line.
pub fn agent_config(args: &cli::RunArgs) -> AgentConfig {
    let mut exclusions = Exclusions::with_ports(args.exclude_listener_ports.iter().copied());
    exclusions
        .name_prefixes
        .extend(args.exclude_listener_prefixes.iter().cloned());
    AgentConfig {
        termination_drain_duration: args.termination_drain_duration,
        minimum_drain_duration: args.minimum_drain_duration,
        exit_on_zero_active_connections: args.exit_on_zero_active_connections,
        drain_delay: args.drain_delay,
        exclusions,
        poll_interval: args.drain_poll_interval,
        ..AgentConfig::default()
    }
}

/// `envoy-agent run`: returns the process exit code. Errors of type [`SetupError`] mean bad
/// input (exit [`EXIT_USAGE`]); others are failures of the agent itself.
pub async fn run(
    args: cli::RunArgs,
    grpc: Option<grpc::GrpcAddress>,
    intents: impl IntentSource,
) -> anyhow::Result<u8> {
    let grpc = grpc.unwrap_or_else(client::default_address);
    let runtime_dir = std::env::temp_dir().join(format!("envoy-agent-{}", std::process::id()));
    // The bootstrap first: it is what the operator wrote, so its errors are the most telling.
    let (admin, extra_args) = setup::resolve_admin(
        &args.config_path,
        args.admin_address,
        &args.envoy_args,
        &runtime_dir,
    )?;
    let binary = setup::resolve_envoy(&args.envoy_path, std::env::var_os("PATH").as_deref())?;

    // PID 1 duties: orphans below us are ours to reap.
    if let Err(e) = envoy_agent_proxy::reaper::become_subreaper() {
        tracing::warn!(error = %e, "cannot become a subreaper; orphans may linger as zombies");
    }
    let reaper_stop = CancellationToken::new();
    let reaper = tokio::spawn(envoy_agent_proxy::reaper::run(reaper_stop.clone()));
    let telemetry = match telemetry::endpoint(args.otlp_endpoint.as_deref()) {
        Some(endpoint) => Some(telemetry::Telemetry::new(
            endpoint,
            args.otlp_export_interval,
        )?),
        None => None,
    };
    let meter = telemetry.as_ref().map(telemetry::Telemetry::meter);
    let proxy = setup::proxy_config(&args, binary, admin, extra_args);
    let code = if args.hot_restart {
        let metrics = meter
            .as_ref()
            .map(envoy_agent_hotrestart::metrics::SupervisorMetrics::new)
            .unwrap_or_default();
        run_hot_restart(&args, proxy, grpc, metrics, intents).await
    } else {
        let metrics = meter
            .as_ref()
            .map(telemetry::AgentMetrics::new)
            .unwrap_or_default();
        run_agent(&args, proxy, &runtime_dir, grpc, metrics, intents).await
    };
    if let Some(telemetry) = telemetry {
        telemetry.shutdown().await;
    }
    reaper_stop.cancel();
    let _ = reaper.await;
    code
}

/// Hot restart off: the [`Agent`] with its status server.
async fn run_agent(
    args: &cli::RunArgs,
    config: envoy_agent_proxy::ProxyConfig,
    runtime_dir: &Path,
    grpc_address: grpc::GrpcAddress,
    metrics: telemetry::AgentMetrics,
    intents: impl IntentSource,
) -> anyhow::Result<u8> {
    let status = status::StatusServer::bind(args.status_address)
        .await
        .map_err(SetupError::from)?;
    if let Some(path) = &args.status_address_file {
        envoy_agent_proxy::write_atomically(path, status.local_addr().to_string().as_bytes())
            .with_context(|| format!("writing --status-address-file {}", path.display()))?;
    }
    let own_runtime_dir =
        matches!(&config.admin, AdminAddress::FromFile(p) if p.starts_with(runtime_dir));
    if own_runtime_dir {
        std::fs::create_dir_all(runtime_dir)
            .with_context(|| format!("creating runtime dir {}", runtime_dir.display()))?;
    }

    let envoy = Arc::new(Envoy::new(config.clone()));
    let (agent, handle) = Agent::new(envoy, agent_config(args));
    let agent = agent.with_metrics(metrics);

    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let service = grpc::Service::new(
        grpc::Target::Agent(handle.clone()),
        config,
        args.grpc_allow_remote,
    );
    tracker.spawn(
        grpc::serve(grpc_address, service, cancel.clone())
            .await
            .map_err(SetupError::from)?,
    );
    tracker.spawn({
        let cancel = cancel.clone();
        async move {
            if let Err(e) = status.serve(handle, cancel).await {
                tracing::error!(error = %e, "status server failed");
            }
        }
    });
    tracker.close();

    let exit = agent.run(intents).await;

    cancel.cancel();
    if tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "status server did not stop in time; exiting anyway");
    }
    if own_runtime_dir {
        remove_dir(runtime_dir);
    }
    if let Some(path) = &args.status_address_file {
        remove_file(path);
    }
    tracing::info!(path = %exit.path, code = exit.code(), "envoy-agent exiting");
    match exit.error {
        Some(e) => Err(e).context("running envoy"),
        None => Ok(exit.code()),
    }
}

/// Hot restart on: the [`envoy_agent_hotrestart::Supervisor`]; signals become its commands.
async fn run_hot_restart(
    args: &cli::RunArgs,
    proxy: envoy_agent_proxy::ProxyConfig,
    grpc_address: grpc::GrpcAddress,
    metrics: envoy_agent_hotrestart::metrics::SupervisorMetrics,
    mut intents: impl IntentSource,
) -> anyhow::Result<u8> {
    use envoy_agent_hotrestart::{Config, Supervisor};
    let mut config = Config::new(proxy.clone());
    config.watch_config = args.watch_config;
    config.state_dir = Some(args.state_dir.clone().ok_or(SetupError::MissingStateDir)?);
    config.identity = args
        .identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        });
    config.ready_marker = args.ready_marker.clone();
    config.handoff_deadline = args.handoff_deadline;
    config.admin_unresponsive_deadline = args.admin_unresponsive_deadline;
    let (supervisor, handle) = Supervisor::new(config, metrics).map_err(SetupError::from)?;
    let cancel = CancellationToken::new();
    let server_stop = CancellationToken::new();
    let service = grpc::Service::new(
        grpc::Target::Supervisor(handle.clone(), cancel.clone()),
        proxy,
        args.grpc_allow_remote,
    );
    let server = tokio::spawn(
        grpc::serve(grpc_address, service, server_stop.clone())
            .await
            .map_err(SetupError::from)?,
    );
    let run = supervisor.run(cancel.clone());
    tokio::pin!(run);
    let mut intents_open = true;
    let exit = loop {
        tokio::select! {
            exit = &mut run => break exit,
            intent = intents.next(), if intents_open => match intent {
                None => intents_open = false,
                Some(Intent::Reload) => handle.trigger("SIGHUP"),
                Some(Intent::ReopenLogs) => handle.reopen_logs(),
                Some(intent @ (Intent::Terminate | Intent::Interrupt)) => {
                    tracing::info!(signal = intent.signal_name(), "stopping every epoch");
                    cancel.cancel();
                }
            },
        }
    };
    server_stop.cancel();
    if tokio::time::timeout(SHUTDOWN_GRACE, server).await.is_err() {
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "gRPC server did not stop in time; exiting anyway");
    }
    tracing::info!(?exit, code = exit.code(), "envoy-agent exiting");
    Ok(exit.code())
}

fn remove_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        tracing::debug!(dir = %dir.display(), error = %e, "cannot remove runtime dir");
    }
}

fn remove_file(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        tracing::debug!(path = %path.display(), error = %e, "cannot remove");
    }
}

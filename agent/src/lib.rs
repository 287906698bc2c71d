//! envoy-agent: a process manager for the Envoy proxy.
//!
//! # Theory of operation
//!
//! `main` parses the command line ([`cli`](config::cli)), starts tracing, turns `run`'s arguments into
//! [`Settings`] (refusing flags that cannot work together) and calls [`run`], which sees no
//! parser type. [`run`] checks the rest of its input first
//! ([`setup`](config::setup): bootstrap, admin address, Envoy binary) so that bad input fails with one line
//! and exit code [`exit_code::USAGE`] before anything starts. It then builds the proxy, one
//! Envoy ([`envoy_agent_proxy::Envoy`]) or a hot-restart family
//! ([`envoy_agent_hotrestart::EnvoyFamily`]), an [`Agent`] over it, the [`status`] server and
//! the [`grpc`] server, and runs them. Both modes take this one path:
//!
//! 1. **Decide when**: the agent actor alone decides when Envoy stops, from [`Intent`]s
//!    (signals, from an injectable [`IntentSource`]), commands from its [`AgentHandle`]s
//!    (status server, gRPC) and the proxy's own end. See [`agent`] for the exit paths.
//! 2. **Tell everyone**: once the agent has stopped and reaped every Envoy, a
//!    `CancellationToken` tells the servers to stop. They stay up through the whole drain.
//! 3. **Wait**: a `TaskTracker` waits for them, bounded by [`SHUTDOWN_GRACE`].
//!
//! A node proxy's surge successor runs the same command line on the same host network as its
//! predecessor, so it finds the status port (and a TCP gRPC port) taken: it serves without
//! them and binds each once the predecessor releases it. It never shares them: a request to
//! `/quitquitquit` reaches the agent it was meant for.
//!
//! Nothing outlives [`run`]: every Envoy is reaped before it returns, and dropping the future
//! kills Envoy (it was spawned with kill-on-drop) rather than leaking it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_agent_drain::Exclusions;
use envoy_agent_proxy::{AdminAddress, Envoy, Proxy, ProxyConfig};
use opentelemetry::metrics::Meter;
use runtime_dir::RuntimeDir;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

pub mod agent;
pub mod callers;
pub mod client;
pub mod config;
pub mod crash;
pub mod exit_code;
pub mod grpc;
pub mod log_level;
pub mod notify;
pub mod runtime_dir;
pub mod signal;
pub mod status;
pub mod telemetry;
pub mod termination;
#[cfg(test)]
mod testing;
pub mod trusted_dir;

pub use agent::{Agent, AgentConfig, AgentExit, AgentHandle, AgentState, ExitPath, Status};
pub use config::settings::Settings;
pub use config::setup::SetupError;
pub use signal::{Intent, IntentSource, UnixSignals};

/// How long the agent waits for its own tasks (the servers) once Envoy is gone.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The agent's drain settings: a view of `settings` (whose defaults and budget are applied
/// already, in [`config::cli::RunArgs::into_settings`]).
pub fn agent_config(settings: &Settings) -> AgentConfig {
    let drain = &settings.drain;
    let mut exclusions = Exclusions::with_ports(drain.exclude_listener_ports.iter().copied());
    exclusions
        .name_prefixes
        .extend(drain.exclude_listener_prefixes.iter().cloned());
    AgentConfig {
        termination_drain_duration: drain.termination_drain_duration,
        minimum_drain_duration: drain.minimum_drain_duration,
        exit_on_zero: drain.exit_on_zero,
        drain_delay: drain.drain_delay,
        not_ready_at: drain.timeline.not_ready,
        fail_health_checks_at: drain.timeline.fail_health_checks.map_or(
            config::timeline::HealthCheckFailAt::Off,
            config::timeline::HealthCheckFailAt::After,
        ),
        exclusions,
        poll_interval: drain.poll_interval,
        handover_timeout: drain.handover_timeout,
        crash_recovery: settings.crash_recovery,
        app_hold: drain.app_hold,
        ..AgentConfig::default()
    }
}

/// Says so at start when a flag combination does something an operator may not expect.
fn warn_about(settings: &Settings) {
    if let Some(split) = &settings.shutdown_budget {
        tracing::info!(
            event = "shutdown_budget",
            budget_ms = split.budget.as_millis() as u64,
            drain_delay_ms = split.drain_delay.as_millis() as u64,
            drain_ms = split.drain.as_millis() as u64,
            stop_grace_ms = split.stop_grace.as_millis() as u64,
            exit_ms = split.exit.as_millis() as u64,
            handover_ms = split.handover.map(|d| d.as_millis() as u64),
            "--shutdown-budget {:?}: drain delay {:?}, drain {:?}, stop grace {:?}, the agent's exit {:?}{}",
            split.budget,
            split.drain_delay,
            split.drain,
            split.stop_grace,
            split.exit,
            split
                .handover
                .map(|d| format!("; a handover waits at most {d:?}"))
                .unwrap_or_default()
        );
    }
    let timeline = &settings.drain.timeline;
    tracing::info!(
        event = "shutdown_timeline",
        not_ready_ms = timeline.not_ready.as_millis() as u64,
        fail_health_checks_ms = timeline.fail_health_checks.map(|d| d.as_millis() as u64),
        drain_ms = timeline.drain.as_millis() as u64,
        stop_by_ms = timeline.stop_by.map(|d| d.as_millis() as u64),
        order = %timeline
            .steps()
            .iter()
            .map(|(step, _)| step.name())
            .collect::<Vec<_>>()
            .join(","),
        "on SIGTERM: {timeline}"
    );
    let drain = &settings.drain;
    // The deadline rule is the agent's (AgentConfig::drain_deadline): said, not repeated.
    if agent_config(settings).drain_deadline().is_none() {
        tracing::warn!(
            event = "config_warning",
            termination_drain_duration = ?drain.termination_drain_duration,
            minimum_drain_duration = ?drain.minimum_drain_duration,
            "exit-on-zero: --termination-drain-duration is not longer than \
             --minimum-drain-duration, so it sets no deadline: after the minimum the agent counts \
             active connections (or requests) until there are none, as long as that takes \
             (Istio's behaviour); \
             set it longer than the minimum for a hard deadline"
        );
    }
}

/// The exit code of a failed run: bad input says which ([`SetupError`], the flags'
/// [`SettingsError`](config::cli::SettingsError)); a server's address in use, which may come
/// free, is [`exit_code::UNAVAILABLE`] (a supervisor, systemd or the kubelet, should retry);
/// anything else is the agent's failure.
pub fn exit_code_of(e: &anyhow::Error) -> u8 {
    let bind = |in_use: bool| match in_use {
        true => exit_code::UNAVAILABLE,
        false => exit_code::USAGE,
    };
    if let Some(setup) = e.downcast_ref::<SetupError>() {
        setup.exit_code()
    } else if let Some(flags) = e.downcast_ref::<config::cli::SettingsError>() {
        flags.exit_code()
    } else if let Some(status) = e.downcast_ref::<status::BindError>() {
        bind(status.in_use())
    } else if let Some(grpc) = e.downcast_ref::<grpc::GrpcBindError>() {
        bind(grpc.in_use)
    } else {
        exit_code::SOFTWARE
    }
}

/// `envoy-agent run`: returns the process exit code. Errors of type [`SetupError`] mean bad
/// input (exit [`SetupError::exit_code`]); others are failures of the agent itself.
pub async fn run(settings: &Settings, intents: impl IntentSource) -> anyhow::Result<u8> {
    // The bootstrap first: it is what the operator wrote, so its errors are the most telling.
    let envoy = &settings.envoy;
    let temp_dir = std::env::temp_dir();
    let runtime_dir = RuntimeDir::path_in(&temp_dir);
    let admin_socket = config::setup::admin_socket(settings, &runtime_dir, &temp_dir)?;
    let (admin, extra_args, replaced) = config::setup::resolve_admin(
        &envoy.config_path,
        envoy.admin_address,
        &envoy.extra_args,
        &runtime_dir,
        admin_socket,
    )?;
    config::setup::check_status_address(settings.status_address, &admin)?;
    let binary =
        config::setup::resolve_envoy(&envoy.envoy_path, std::env::var_os("PATH").as_deref())?;

    // PID 1 duties: orphans below us are ours to reap.
    if let Err(e) = envoy_agent_proxy::reaper::become_subreaper() {
        tracing::warn!(error = %e, "cannot become a subreaper; orphans may linger as zombies");
    }
    let reaper_stop = CancellationToken::new();
    let reaper = tokio::spawn(
        envoy_agent_proxy::reaper::run(reaper_stop.clone())
            .instrument(tracing::info_span!("reaper")),
    );
    let telemetry = start_telemetry(settings)?;
    let meter = telemetry.as_ref().map(telemetry::Telemetry::meter);
    let agent_metrics = meter
        .as_ref()
        .map(telemetry::AgentMetrics::new)
        .unwrap_or_default();
    let mut proxy = configure_proxy(settings, binary, admin, extra_args, &runtime_dir, &temp_dir)?;
    let fit = fit_container(settings, &mut proxy);
    // Shared with every clone of the proxy's config: a level set at run time reaches every
    // Envoy started later.
    let log_level = log_level::EnvoyLogLevel::new(
        &proxy.options.log_level,
        &proxy.options.component_log_level,
        proxy.log_level_set.clone(),
    );
    // What GetStatus reports as in force: Envoy's settings from the config every Envoy gets.
    let mut reported = grpc::settings(settings, &proxy, &agent_config(settings));
    reported.container = Some(grpc::container(&fit));
    config::setup::check_extra_args(&proxy)?;
    // Once the input is known good: a refusal is one line.
    warn_about(settings);
    config::setup::log_admin(
        &proxy.admin,
        replaced.as_ref(),
        settings.hot_restart.is_some(),
    );
    // Once the input is known good (a refusal is one line), before anything opens sockets.
    config::setup::raise_fd_limit();
    let own_runtime_dir = make_runtime_dir(settings, &proxy, &runtime_dir)?;
    sweep_runtime_dirs(&temp_dir, &runtime_dir);
    let code = match &settings.hot_restart {
        // A refusal ends the run as any ending does: what it made is removed below.
        Some(hot) => match family(settings, hot, proxy, meter.as_ref()) {
            Ok(family) => {
                serve(
                    settings,
                    Arc::new(family),
                    agent_metrics,
                    intents,
                    true,
                    log_level,
                    reported,
                )
                .await
            }
            Err(e) => Err(e.into()),
        },
        None => {
            serve(
                settings,
                Arc::new(Envoy::new(proxy)),
                agent_metrics,
                intents,
                false,
                log_level,
                reported,
            )
            .await
        }
    };
    if let Some(dir) = own_runtime_dir {
        dir.remove();
    }
    if let Some(telemetry) = telemetry {
        telemetry.shutdown().await;
    }
    reaper_stop.cancel();
    let _ = reaper.await;
    code
}

/// Fits Envoy into its container ([`container`](config::container)): decides from the cgroups and the open-file
/// limit, logs it, and puts it into the proxy's config.
fn fit_container(settings: &Settings, proxy: &mut ProxyConfig) -> config::container::Fit {
    let envoy = &settings.envoy;
    let asked = config::container::Asked {
        memory: envoy.memory_guard,
        shares: envoy.memory_guard_thresholds,
        connections: envoy.max_downstream_connections,
        concurrency: envoy.options.concurrency,
        extra_args: &proxy.extra_args,
        bootstrap: &envoy.config_path,
    };
    let fit = config::container::fit(
        &asked,
        envoy_agent_proxy::cgroup::container(),
        config::container::nofile(),
    );
    fit.log();
    proxy.memory_guard = fit.memory.on();
    proxy.max_downstream_connections = fit.connections.on();
    if let Some(n) = fit.workers.concurrency {
        proxy.options.concurrency = n;
    }
    fit
}

/// The proxy's config: [`config::setup::proxy_config`] with the hot-restart channel and the
/// drain-notice directory.
fn configure_proxy(
    settings: &Settings,
    binary: PathBuf,
    admin: AdminAddress,
    extra_args: Vec<String>,
    runtime_dir: &Path,
    temp_dir: &Path,
) -> Result<ProxyConfig, SetupError> {
    let (socket_path, extra_args) =
        config::setup::hot_restart_channel(settings, extra_args, temp_dir)?;
    if settings.hot_restart.is_some() {
        tracing::info!(
            event = "hot_restart_channel",
            socket_path = %socket_path,
            private = !socket_path.is_abstract(),
            "hot-restart channel"
        );
    }
    let mut proxy = config::setup::proxy_config(
        settings,
        binary,
        admin,
        extra_args,
        runtime_dir,
        socket_path,
    );
    proxy.drain_notice = config::setup::drain_notice_dir(settings, runtime_dir)?;
    Ok(proxy)
}

/// The OTLP export pipeline, when an endpoint is configured.
fn start_telemetry(
    settings: &Settings,
) -> Result<Option<telemetry::Telemetry>, telemetry::TelemetryError> {
    match telemetry::endpoint(settings.telemetry.otlp_endpoint.as_deref()) {
        Some(endpoint) => Ok(Some(telemetry::Telemetry::new(
            endpoint,
            settings.telemetry.export_interval,
        )?)),
        None => Ok(None),
    }
}

/// Makes the runtime directory when something of this run lives in it (and the admin
/// socket's directory under it); the directory made, held until the run removes it at its end.
fn make_runtime_dir(
    settings: &Settings,
    proxy: &ProxyConfig,
    runtime_dir: &Path,
) -> anyhow::Result<Option<RuntimeDir>> {
    let own_runtime_dir = settings.hot_restart.is_some()
        || matches!(&proxy.admin, AdminAddress::FromFile(p) | AdminAddress::Socket(p) if p.starts_with(runtime_dir))
        || proxy.drain_notice.as_deref() == Some(runtime_dir);
    let made = own_runtime_dir
        .then(|| RuntimeDir::make(runtime_dir))
        .transpose()
        .with_context(|| format!("creating runtime dir {}", runtime_dir.display()))?;
    if settings.hot_restart.is_none() && matches!(proxy.admin, AdminAddress::Socket(_)) {
        config::setup::make_admin_socket_dir(settings, runtime_dir)?;
    }
    Ok(made)
}

/// Removes what killed runs of this user left in the temporary directory ([`runtime_dir`]).
fn sweep_runtime_dirs(temp_dir: &Path, own: &Path) {
    let removed = runtime_dir::sweep(temp_dir, nix::unistd::geteuid().as_raw(), Some(own));
    if !removed.is_empty() {
        tracing::info!(
            event = "runtime_dirs_removed",
            removed = ?removed,
            "removed the runtime directories of agents that were killed"
        );
    }
}

/// The hot-restart family that serves in place of one Envoy.
fn family(
    settings: &Settings,
    hot: &config::settings::HotRestartSettings,
    proxy: ProxyConfig,
    meter: Option<&Meter>,
) -> Result<envoy_agent_hotrestart::EnvoyFamily, SetupError> {
    let metrics = meter
        .map(envoy_agent_hotrestart::metrics::SupervisorMetrics::new)
        .unwrap_or_default();
    let mut config = config::setup::family_config(hot, proxy);
    // Only a family that is restarted after a crash can hand a draining parent on.
    config.keep_draining_parent = settings.crash_recovery.is_some();
    tracing::info!(identity = %config.identity, "node identity");
    Ok(envoy_agent_hotrestart::EnvoyFamily::new(config, metrics)?)
}

/// Runs `proxy` under an [`Agent`] with the status and gRPC servers: the one path of both
/// modes. `node_proxy`: a surge successor may find its ports taken by its predecessor, and
/// waits for them instead of failing. `log_level`: Envoy's, as set in the proxy's config.
async fn serve<P: Proxy>(
    settings: &Settings,
    proxy: Arc<P>,
    metrics: telemetry::AgentMetrics,
    intents: impl IntentSource,
    node_proxy: bool,
    log_level: log_level::EnvoyLogLevel,
    reported: envoy_agent_proto::pb::Settings,
) -> anyhow::Result<u8> {
    let config = agent_config(settings);
    let (agent, handle) = Agent::new(proxy, config);
    let agent = agent.with_metrics(metrics);
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();

    let status = bind_status(settings, node_proxy).await?;
    // Each long-lived task runs in a span of its own: a JSON log line names the task it came
    // from (`span`, `spans`).
    tracker.spawn(
        status_server(settings, status, node_proxy, handle.clone(), cancel.clone())
            .instrument(tracing::info_span!("status_server")),
    );
    if notify::enabled() {
        tracker.spawn(
            notify::run(handle.status(), cancel.clone()).instrument(tracing::info_span!("notify")),
        );
    }
    tracker.spawn(
        log_level
            .clone()
            .follow(handle.clone(), cancel.clone())
            .instrument(tracing::info_span!("log_level")),
    );
    tracker.spawn(
        grpc_server(
            settings,
            handle.clone(),
            node_proxy,
            reported,
            log_level,
            cancel.clone(),
        )
        .await?
        .instrument(tracing::info_span!("grpc_server")),
    );
    tracker.close();

    let mode = if node_proxy { "node" } else { "sidecar" };
    let exit = agent
        .run(intents)
        .instrument(tracing::info_span!("agent", mode))
        .await;

    cancel.cancel();
    if tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "servers did not stop in time; exiting anyway");
    }
    if let Some(path) = &settings.status_address_file {
        remove_file(path);
    }
    end(settings, exit)
}

/// The status server bound to its address, or `None` for a node proxy whose predecessor still
/// holds it (the server's task binds it once free).
async fn bind_status(
    settings: &Settings,
    node_proxy: bool,
) -> Result<Option<status::StatusServer>, status::BindError> {
    match status::StatusServer::bind(settings.status_address).await {
        Ok(server) => Ok(Some(server)),
        Err(e) if node_proxy && e.in_use() => {
            tracing::warn!(
                event = "status_address",
                state = "in_use",
                addr = %settings.status_address,
                "the status address is in use (by the predecessor pod's agent on this node?): \
                 serving without it and binding it once it is free; readiness is the marker file"
            );
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The status server's task: binds the address if `bound` is `None`, writes
/// `--status-address-file`, and serves until `cancel` fires.
fn status_server(
    settings: &Settings,
    bound: Option<status::StatusServer>,
    node_proxy: bool,
    handle: AgentHandle,
    cancel: CancellationToken,
) -> impl std::future::Future<Output = ()> + use<> {
    let addr = settings.status_address;
    let status_file = settings.status_address_file.clone();
    let app_metrics = settings.app_metrics.clone();
    let app_probes = Arc::new(settings.app_probes.clone());
    // A node proxy's loopback is the node's (hostNetwork): its changes need the caller's uid.
    let callers = node_proxy.then(|| callers::peer::Callers {
        uids: settings.control_allow_uids.clone(),
    });
    async move {
        let server = match bound {
            Some(server) => server,
            None => match status::StatusServer::bind_when_free(addr, &cancel).await {
                Some(server) => server,
                None => return,
            },
        };
        let server = match callers {
            Some(callers) => server.check_callers(callers),
            None => server,
        };
        let server = match app_metrics {
            Some(target) => server.app_metrics(status::app_metrics::AppMetrics::new(
                target,
                Default::default(),
            )),
            None => server,
        };
        let server = server.with_app_probes(app_probes);
        if let Some(path) = &status_file {
            // Atomic, not synced: it names a port of this process, meaningless after a
            // crash, and two fsyncs here held up the first epoch's start by a millisecond.
            if let Err(e) = envoy_agent_proxy::replace_atomically(
                path,
                server.local_addr().to_string().as_bytes(),
            ) {
                tracing::error!(path = %path.display(), error = %e, "cannot write --status-address-file");
            }
        }
        if let Err(e) = server.serve(handle, cancel).await {
            tracing::error!(error = %e, "status server failed");
        }
    }
}

/// The gRPC server's task, its address bound (or, for a node proxy whose predecessor holds a
/// TCP one, bound by the task once free).
async fn grpc_server(
    settings: &Settings,
    handle: AgentHandle,
    node_proxy: bool,
    reported: envoy_agent_proto::pb::Settings,
    log_level: log_level::EnvoyLogLevel,
    cancel: CancellationToken,
) -> Result<impl std::future::Future<Output = ()> + use<>, grpc::GrpcBindError> {
    let mode = if node_proxy {
        envoy_agent_proto::pb::Mode::NodeProxy
    } else {
        envoy_agent_proto::pb::Mode::Sidecar
    };
    let service = grpc::Service::new(handle, mode, reported, log_level);
    grpc::serve(settings.grpc_address.clone(), service, cancel, node_proxy).await
}

/// The agent's end: logged, written to the termination message, and turned into the exit
/// code (or the error that ended it).
fn end(settings: &Settings, exit: AgentExit) -> anyhow::Result<u8> {
    let envoy_said = exit.envoy_said();
    tracing::info!(
        event = "exit",
        exit_path = exit.path.name(),
        counting = exit.path.counting().map(agent::Counting::name),
        code = exit.code(),
        envoy_said = envoy_said.as_deref(),
        "envoy-agent exiting: {}",
        exit.path
    );
    let summary = termination::Summary {
        path: exit.path,
        code: exit.code(),
        reason: exit.reason,
        took: exit.took,
        still_open: exit.still_open.as_deref(),
        envoy_said: envoy_said.as_deref(),
    };
    settings.termination_message.write(&summary.text());
    match exit.error {
        Some(e) => Err(e).context("running envoy"),
        None => Ok(exit.code()),
    }
}

fn remove_file(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        tracing::debug!(path = %path.display(), error = %e, "cannot remove");
    }
}

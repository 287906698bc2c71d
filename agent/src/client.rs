//! The client subcommands (`status`, `watch`, `drain`, `stop`, `quit`, `reopen-logs`,
//! `restart`, `update-config`, `admin`, `log-level`): one RPC each to a running agent's gRPC
//! service.
//!
//! `admin GET PATH` writes Envoy's answer to stdout as its chunks arrive (never held whole);
//! an error after the first chunk ends the output where it was, and says so on stderr.
//!
//! `status` and `watch` print a summary for people, or with `--json` the status message as one
//! JSON object per line (see [`status_json`] for its form).
//!
//! Exit codes: 0 the RPC succeeded; [`exit_code::FAILURE`] the agent refused or failed it (the
//! message says why); [`exit_code::UNAVAILABLE`] the agent is not reachable at the address;
//! [`exit_code::USAGE`] a file given cannot be read.

use std::time::{Duration, SystemTime};

use envoy_agent_proto::pb;
use envoy_agent_proto::pb::agent_service_client::AgentServiceClient;
use hyper_util::rt::TokioIo;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

use crate::config::settings::GrpcAddress;
use crate::exit_code;

/// What a client subcommand asks the agent: one RPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `GetStatus`, printed for people or (`json`) as one JSON object.
    Status {
        /// One JSON object.
        json: bool,
    },
    /// `WatchStatus`: the status, then every change, until the agent exits.
    Watch {
        /// One JSON object per line.
        json: bool,
    },
    /// `Drain`.
    Drain {
        /// Keep the listeners accepting; the next SIGTERM exits at once.
        skip_exit: bool,
        /// Which listeners; `None`: the agent's setting.
        listeners: Option<envoy_agent_proxy::Scope>,
    },
    /// `Stop`: the SIGTERM path.
    Stop,
    /// `QuitQuitQuit`: stop at once, no drain.
    Quit,
    /// `ReopenLogs`.
    ReopenLogs,
    /// `UpdateConfig` with the bootstrap in `file`.
    UpdateConfig {
        /// The new bootstrap.
        file: std::path::PathBuf,
        /// Why, for the agent's logs and status.
        reason: String,
    },
    /// `HotRestart`.
    Restart {
        /// Why, for the agent's logs and status.
        reason: String,
    },
    /// `AdminGet`: one of Envoy's read-only admin views, to stdout.
    Admin {
        /// Path and query.
        path: String,
    },
    /// `SetLogLevel`.
    LogLevel {
        /// Istio style: `debug`, `info,upstream:debug`.
        level: String,
    },
    /// `WatchStatus` until the agent says ready (`envoy-agent wait`).
    Wait,
}

/// How soon `wait` asks again after the agent could not be reached (not started yet) or its
/// status stream ended.
const WAIT_RETRY: Duration = Duration::from_millis(200);

/// `envoy-agent wait`: 0 once the agent says ready, 1 with the last thing it said (or why it
/// could not be asked) once `timeout` has passed, or at once when it is exiting. An agent that
/// does not answer yet (a `postStart` hook runs as the container starts) is asked again.
pub async fn wait_ready(addr: &GrpcAddress, timeout: Duration) -> u8 {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last = format!("the agent was not reached at {addr}");
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, watch_until_ready(addr, left, &mut last)).await {
            Ok(Some(code)) => return code,
            Ok(None) => {}
            Err(_) => break,
        }
        tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + WAIT_RETRY)).await;
    }
    eprintln!("envoy-agent wait: not ready within {timeout:?}: {last}");
    exit_code::FAILURE
}

/// One watch of the agent's status: `Some` with the exit code once it decides (ready, or
/// exiting), `None` when the agent could not be asked or its stream ended (`last` says why).
async fn watch_until_ready(addr: &GrpcAddress, left: Duration, last: &mut String) -> Option<u8> {
    let mut client = match connect(addr, left).await {
        Ok(c) => c,
        Err(unreachable) => {
            *last = unreachable.to_string();
            return None;
        }
    };
    let mut stream = match client.watch_status(pb::WatchStatusRequest {}).await {
        Ok(r) => r.into_inner(),
        Err(e) => {
            *last = format!("{}: {}", code_name(e.code()), e.message());
            return None;
        }
    };
    while let Some(item) = stream.next().await {
        let status = match item {
            Ok(r) => r.status.unwrap_or_default(),
            Err(e) => {
                *last = format!("{}: {}", code_name(e.code()), e.message());
                return None;
            }
        };
        let state = pb::AgentState::try_from(status.state);
        let mut said = short(state);
        if !status.reason.is_empty() {
            said.push_str(&format!(" ({})", status.reason));
        }
        if status.ready {
            println!("ready");
            return Some(0);
        }
        if state == Ok(pb::AgentState::Exiting) {
            eprintln!("envoy-agent wait: the agent is exiting: {said}");
            return Some(exit_code::FAILURE);
        }
        *last = format!("the agent is {said}");
    }
    *last = "the agent's status stream ended".to_owned();
    None
}

/// Where the agent's gRPC server listens by default: `$XDG_RUNTIME_DIR/envoy-agent/grpc.sock`,
/// else `/run/envoy-agent/grpc.sock` for root, else `/tmp/envoy-agent-<uid>/grpc.sock`.
pub fn default_address() -> GrpcAddress {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => std::path::PathBuf::from(d).join("envoy-agent"),
        None if nix::unistd::geteuid().is_root() => "/run/envoy-agent".into(),
        None => std::env::temp_dir().join(format!("envoy-agent-{}", nix::unistd::geteuid())),
    };
    GrpcAddress::Unix(dir.join("grpc.sock"))
}

/// The agent's gRPC API cannot be reached.
#[derive(Debug, thiserror::Error)]
#[error("the agent is not reachable at {addr}: {error}")]
pub struct Unreachable {
    /// Where it was asked.
    pub addr: GrpcAddress,
    /// What the transport said.
    pub error: tonic::transport::Error,
}

/// A client connected to `addr`.
pub async fn connect(
    addr: &GrpcAddress,
    timeout: Duration,
) -> Result<AgentServiceClient<Channel>, Unreachable> {
    let unreachable = |error: tonic::transport::Error| Unreachable {
        addr: addr.clone(),
        error,
    };
    let channel = match addr {
        GrpcAddress::Tcp(a) => Endpoint::from_shared(format!("http://{a}"))
            .map_err(unreachable)?
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect()
            .await
            .map_err(unreachable)?,
        GrpcAddress::Unix(path) => {
            let path = path.clone();
            // The URI is not used: every connection goes to the socket.
            Endpoint::from_static("http://localhost")
                .connect_timeout(timeout)
                .timeout(timeout)
                .connect_with_connector(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move {
                        tokio::net::UnixStream::connect(path)
                            .await
                            .map(TokioIo::new)
                    }
                }))
                .await
                .map_err(unreachable)?
        }
    };
    Ok(AgentServiceClient::new(channel))
}

/// A time as RFC 3339, and how long ago (or how far ahead) it is from `now`.
fn when(t: &Option<prost_types::Timestamp>, now: SystemTime) -> String {
    let Some(t) = t else {
        return "-".to_owned();
    };
    let Ok(at) = SystemTime::try_from(*t) else {
        return t.to_string();
    };
    let relative = match now.duration_since(at) {
        Ok(ago) => format!("{} ago", seconds(ago)),
        Err(ahead) => format!("in {}", seconds(ahead.duration())),
    };
    format!("{t} ({relative})")
}

/// `1.2s`, `45s`, `3m20s`: to a tenth of a second under a minute.
fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.1}s")
    } else {
        format!("{}m{:02}s", d.as_secs() / 60, d.as_secs() % 60)
    }
}

/// A configured duration as the flags take it: `45s`, `250ms`, `1.5s`, `0s`.
fn span(d: &Option<prost_types::Duration>) -> String {
    let Some(d) = d.as_ref().and_then(|d| Duration::try_from(*d).ok()) else {
        return "-".to_owned();
    };
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d < Duration::from_secs(1) && d.subsec_nanos() % 1_000_000 == 0 {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs_f64())
    }
}

/// An enum's value in the short form `--json` and people read: `AGENT_STATE_LIVE` → `live`.
fn short<E: std::fmt::Debug>(value: Result<E, prost::UnknownEnumValue>) -> String {
    match value {
        Ok(v) => snake(&format!("{v:?}")),
        Err(e) => format!("unknown({})", e.0),
    }
}

/// `HandedOver` → `handed_over`.
fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// How many of the family's last handoffs and exits the summary shows (`--json` has them all).
const SHOWN: usize = 3;

/// Prints `status` for people: what it is, whether it serves, every Envoy, the drain under
/// way, the node-proxy family's facts and history, and the settings in force.
pub fn print_status(status: &pb::Status) {
    print!("{}", status_text(status, SystemTime::now()));
}

/// The text [`print_status`] prints.
pub fn status_text(status: &pb::Status, now: SystemTime) -> String {
    let sections = [
        head_lines(status, now),
        status
            .control_plane
            .as_ref()
            .map_or_else(Vec::new, |cp| control_plane_lines(cp, now)),
        status
            .drain
            .as_ref()
            .map_or_else(Vec::new, |d| drain_lines(d, now)),
        status
            .crash_recovery
            .as_ref()
            .map_or_else(Vec::new, |r| crash_lines(r, now)),
        epoch_lines(&status.epochs, now),
        status
            .family
            .as_ref()
            .map_or_else(Vec::new, |f| family_lines(f, now)),
        status
            .settings
            .as_ref()
            .map_or_else(Vec::new, |s| settings_lines(s, status.family.is_some())),
    ];
    let mut out = String::new();
    for line in sections.iter().flatten() {
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// One line of the summary: the label in a column of 20, then the value.
fn row(label: &str, value: impl std::fmt::Display) -> String {
    format!("{label:<20}{value}")
}

/// What the agent is and does: mode, state, readiness, exit code, newest LIVE epoch.
fn head_lines(status: &pb::Status, now: SystemTime) -> Vec<String> {
    let mode = match status.mode() {
        pb::Mode::Sidecar => "sidecar (one envoy, hot restart off)",
        pb::Mode::NodeProxy => "node proxy (hot restart)",
        pb::Mode::Unspecified => "unknown",
    };
    let mut state = short(pb::AgentState::try_from(status.state));
    if !status.reason.is_empty() {
        state.push_str(&format!(" ({})", status.reason));
    }
    let mut lines = vec![
        row("mode:", mode),
        row("state:", state),
        row("since:", when(&status.state_since, now)),
        row("ready:", if status.ready { "yes" } else { "no" }),
    ];
    if status.admin_silent_since.is_some() {
        lines.push(row(
            "envoy admin:",
            format!(
                "not answering since {}",
                when(&status.admin_silent_since, now)
            ),
        ));
    }
    if status.log_lines_dropped > 0 {
        lines.push(row(
            "log lines dropped:",
            format!(
                "{} (their reader did not take them)",
                status.log_lines_dropped
            ),
        ));
    }
    if let Some(code) = status.exit_code {
        lines.push(row("exit code:", code));
    }
    lines.push(row(
        "newest LIVE epoch:",
        status
            .newest_live_epoch
            .map_or_else(|| "none".to_owned(), |e| e.to_string()),
    ));
    lines
}

fn control_plane_lines(cp: &pb::ControlPlane, now: SystemTime) -> Vec<String> {
    let connection = match cp.connected {
        Some(true) => "connected".to_owned(),
        Some(false) if cp.disconnected_since.is_some() => {
            format!("disconnected since {}", when(&cp.disconnected_since, now))
        }
        Some(false) => "disconnected".to_owned(),
        None => "no gRPC control plane".to_owned(),
    };
    let received = if cp.received {
        "config received"
    } else {
        "waiting for its config"
    };
    let mut lines = vec![row(
        "control plane:",
        format!("{connection}, {received} (epoch {})", cp.epoch),
    )];
    lines.extend(cp.types.iter().map(|t| {
        row(
            &format!("  {}:", t.name),
            format!(
                "{} updates accepted, {} rejected, {} initial fetches timed out",
                t.update_success, t.update_rejected, t.init_fetch_timeout
            ),
        )
    }));
    lines
}

fn drain_lines(d: &pb::Drain, now: SystemTime) -> Vec<String> {
    let mut lines = vec![
        row(
            "drain:",
            format!(
                "{} since {}",
                short(pb::DrainReason::try_from(d.reason)),
                when(&d.start_time, now)
            ),
        ),
        row(
            "  deadline:",
            if d.deadline.is_some() {
                when(&d.deadline, now)
            } else if !d.stops {
                "none: a drain request keeps envoy serving; a signal continues to the stop"
                    .to_owned()
            } else {
                "none (exit-on-zero counts until nothing is left)".to_owned()
            },
        ),
    ];
    match pb::AppWatch::try_from(d.app) {
        Ok(pb::AppWatch::Unknown) => lines.push(row("  the app:", "not known yet".to_owned())),
        Ok(pb::AppWatch::NotSeen) => lines.push(row(
            "  the app:",
            "holds no outbound connection: nothing held for it".to_owned(),
        )),
        Ok(pb::AppWatch::Holding) => lines.push(row(
            "  the app:",
            format!(
                "calls out through envoy: served until it lets go, {} at the latest",
                when(&d.app_hold_until, now)
            ),
        )),
        Ok(pb::AppWatch::LetGo) => lines.push(row("  the app:", "let go".to_owned())),
        Ok(pb::AppWatch::Unspecified) | Err(_) => {}
    }
    if d.accepted {
        lines.push(row("  drained:", drained(d)));
    }
    if let Some(n) = d.active_connections {
        lines.push(row(
            "  connections:",
            format!("{n} active, counted {}", when(&d.count_time, now)),
        ));
    }
    if let Some(n) = d.active_requests {
        lines.push(row(
            "  requests:",
            format!("{n} active, counted {}", when(&d.count_time, now)),
        ));
    }
    if !d.listeners.is_empty() {
        lines.push(row(
            "  holding it open:",
            format!("read {}", when(&d.listeners_time, now)),
        ));
    }
    lines.extend(d.listeners.iter().map(|l| {
        let mut held = format!("{} connections", l.active_connections);
        if let Some(n) = l.active_requests {
            held.push_str(&format!(", {n} requests"));
        }
        if let Some(n) = l.upgrades_active.filter(|n| *n > 0) {
            held.push_str(&format!(", {n} upgraded (WebSocket, CONNECT)"));
        }
        row(&format!("    {}:", l.name), held)
    }));
    lines
}

/// Which listeners an accepted drain drained, and how that is known.
fn drained(d: &pb::Drain) -> String {
    let mut drained = if d.drained_known {
        let names: Vec<&str> = d.drained.iter().map(|l| l.name.as_str()).collect();
        match names.is_empty() {
            true => "none".to_owned(),
            false => names.join(", "),
        }
    } else if d.inbound_only {
        "the INBOUND listeners (not read from envoy)".to_owned()
    } else {
        "every listener (not read from envoy)".to_owned()
    };
    if !d.drained_note.is_empty() {
        drained.push_str(&format!(" ({})", d.drained_note));
    }
    drained
}

fn crash_lines(r: &pb::CrashRecovery, now: SystemTime) -> Vec<String> {
    let mut crashes = format!(
        "{} since start, {} in a row (restart limit {})",
        r.total_crashes, r.consecutive_crashes, r.limit
    );
    if r.next_restart_time.is_some() {
        crashes.push_str(&format!(
            "; next restart {}",
            when(&r.next_restart_time, now)
        ));
    }
    let mut lines = vec![row("crashes:", crashes)];
    if let Some(c) = r.crashes.last() {
        let how = match c.signal {
            Some(signal) => format!("killed by signal {signal}"),
            None => format!("exit {}", c.exit_code),
        };
        lines.push(row(
            "  last crash:",
            format!("{how}, {}", when(&c.time, now)),
        ));
    }
    lines
}

fn epoch_lines(epochs: &[pb::Epoch], now: SystemTime) -> Vec<String> {
    if epochs.is_empty() {
        return Vec::new();
    }
    let mut lines = vec!["  EPOCH       PID  STATE     STARTED".to_owned()];
    lines.extend(epochs.iter().map(|e| {
        format!(
            "{:>7}  {:>8}  {:<8}  {}",
            e.epoch,
            e.pid,
            short(pb::EpochState::try_from(e.state)),
            when(&e.start_time, now)
        )
    }));
    lines
}

/// The node-proxy family: its facts, the handoff under way, and its recent history.
fn family_lines(f: &pb::Family, now: SystemTime) -> Vec<String> {
    let mut lines = vec![row(
        "family:",
        format!(
            "base id {}, hot-restart version {}, identity {}",
            f.base_id, f.hot_restart_version, f.identity
        ),
    )];
    if !f.socket_path.is_empty() {
        let reach = if f.socket_path.starts_with('@') {
            "abstract: any process on the node's network can reach it"
        } else {
            "private"
        };
        lines.push(row("channel:", format!("{} ({reach})", f.socket_path)));
    }
    for (label, value) in [
        ("predecessor:", &f.predecessor),
        ("successor:", &f.successor_starting),
        ("handed over to:", &f.handed_over_to),
    ] {
        if let Some(v) = value {
            lines.push(row(label, v));
        }
    }
    if let Some(h) = &f.handoff {
        lines.push(row(
            "handoff:",
            format!(
                "to epoch {} ({}), {}{}, since {}",
                h.epoch,
                h.reason,
                short(pb::HandoffStage::try_from(h.stage)),
                h.waiting_for
                    .as_ref()
                    .map(|w| format!(": waiting for {w}"))
                    .unwrap_or_default(),
                when(&h.start_time, now)
            ),
        ));
    }
    lines.extend(earlier(f.handoffs.len()));
    lines.extend(last(&f.handoffs).map(handoff_line));
    lines.extend(f.retiring.iter().map(|e| {
        row(
            "retiring:",
            format!(
                "epoch {} (pid {}) of the old family, {}",
                e.epoch,
                e.pid,
                short(pb::EpochState::try_from(e.state)),
            ),
        )
    }));
    lines.extend(earlier(f.exits.len()));
    lines.extend(last(&f.exits).map(|e| {
        row(
            "envoy exit:",
            format!(
                "epoch {} (pid {}) {}, {}",
                e.epoch,
                e.pid,
                e.description,
                when(&e.time, now)
            ),
        )
    }));
    lines.extend(f.wedges.iter().map(|w| {
        row(
            "wedge:",
            format!(
                "{}: {} ({})",
                short(pb::WedgeReason::try_from(w.reason)),
                w.message,
                when(&w.time, now)
            ),
        )
    }));
    lines
}

/// The last [`SHOWN`] of a history, oldest first.
fn last<T>(history: &[T]) -> impl Iterator<Item = &T> {
    history.iter().rev().take(SHOWN).rev()
}

/// The line that says how much of a history of `n` is left out, if any is.
fn earlier(n: usize) -> Option<String> {
    (n > SHOWN).then(|| row("", format!("{} earlier (see --json)", n - SHOWN)))
}

fn handoff_line(h: &pb::HandoffResult) -> String {
    let (label, cold) = match &h.cold {
        Some(c) => (
            "cold handover:",
            format!(
                "base id {} -> {} ({}): ",
                c.from_base_id, c.to_base_id, c.why
            ),
        ),
        None => ("hot restart:", String::new()),
    };
    row(
        label,
        format!(
            "{cold}epoch {} {} in {} ({}){}",
            h.epoch,
            short(pb::HandoffOutcome::try_from(h.outcome)),
            span(&h.duration),
            h.reason,
            if h.message.is_empty() {
                String::new()
            } else {
                format!(": {}", h.message)
            }
        ),
    )
}

/// The settings in force; the family's own (`family`) only in node-proxy mode.
fn settings_lines(s: &pb::Settings, family: bool) -> Vec<String> {
    let exit_on_zero = match (s.exit_on_zero(), s.exit_on_zero_active_connections) {
        (pb::ExitOnZero::Requests, _) => {
            format!("requests (minimum {})", span(&s.minimum_drain_duration))
        }
        // An older agent sets only the boolean.
        (pb::ExitOnZero::Connections, _) | (_, true) => {
            format!("connections (minimum {})", span(&s.minimum_drain_duration))
        }
        _ => "no".to_owned(),
    };
    let family = if family {
        format!(
            ", parent shutdown {}, handoff deadline {}",
            span(&s.parent_shutdown_time),
            span(&s.handoff_deadline)
        )
    } else {
        String::new()
    };
    let mut lines = vec![row(
        "settings:",
        format!(
            "drain time {}, termination drain {}, drain delay {}, exit on zero {exit_on_zero}{family}",
            span(&s.drain_time),
            span(&s.termination_drain_duration),
            span(&s.drain_delay),
        ),
    )];
    lines.extend(s.shutdown_timeline.as_ref().map(timeline_line));
    lines.push(row(
        "config:",
        format!(
            "{} (admin {})",
            s.config_path,
            s.admin_address.as_deref().unwrap_or("not known yet")
        ),
    ));
    if !s.envoy_binary.is_empty() {
        lines.push(row("envoy:", &s.envoy_binary));
    }
    if !s.proxy_log_level.is_empty() {
        lines.push(row("envoy log level:", &s.proxy_log_level));
    }
    if let Some(c) = &s.container {
        lines.extend(container_lines(c));
    }
    lines
}

/// How Envoy fits its container: the memory guard, the connections' bound, the workers.
fn container_lines(c: &pb::Container) -> Vec<String> {
    let mib = |b: u64| format!("{} MiB", b >> 20);
    let memory = match (c.memory_limit_bytes, c.memory_guard_heap_bytes) {
        (Some(limit), Some(heap)) => format!(
            "limit {}: envoy sheds load before it (heap {})",
            mib(limit),
            mib(heap)
        ),
        _ => format!("no guard: {}", c.memory_guard_off),
    };
    let connections = match c.max_downstream_connections {
        Some(n) => format!("at most {n} downstream"),
        None => format!(
            "unbounded by the agent: {}",
            c.max_downstream_connections_off
        ),
    };
    let workers = match c.concurrency {
        Some(n) => format!("{n} ({})", c.workers),
        None => c.workers.clone(),
    };
    vec![
        row("memory:", memory),
        row("connection bound:", connections),
        row("workers:", workers),
    ]
}

fn timeline_line(t: &pb::ShutdownTimeline) -> String {
    // In the order of the proto's fields, which is the agent's order at one instant.
    let mut steps = vec![("readiness off", span(&t.not_ready))];
    if t.fail_health_checks.is_some() {
        steps.push(("health checks fail", span(&t.fail_health_checks)));
    }
    steps.push(("drain", span(&t.drain)));
    row(
        "on SIGTERM:",
        format!(
            "{}, {}{}",
            steps
                .iter()
                .map(|(step, at)| format!("{step} at {at}"))
                .collect::<Vec<_>>()
                .join(", "),
            match &t.stop_by {
                Some(_) => format!("stop by {}", span(&t.stop_by)),
                None => "stop at zero (no deadline)".to_owned(),
            },
            if t.fail_health_checks.is_none() {
                "; health checks never fail"
            } else {
                ""
            }
        ),
    )
}

/// The API's descriptors, for the JSON form of its messages.
fn descriptors() -> Option<&'static prost_reflect::DescriptorPool> {
    static POOL: std::sync::OnceLock<Option<prost_reflect::DescriptorPool>> =
        std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        prost_reflect::DescriptorPool::decode(envoy_agent_proto::FILE_DESCRIPTOR_SET).ok()
    })
    .as_ref()
}

/// The status as one JSON object, for scripts: the message in the proto3 JSON mapping with the
/// `.proto` field names (`newest_live_epoch`, as grpcurl's `-format-json` with original names),
/// times in RFC 3339 (`Timestamp`) and seconds (`Duration`, `"5s"`), 64-bit counts as numbers,
/// and enum values in short form (`live` for `AGENT_STATE_LIVE`); a field that does not apply
/// (an `*_UNSPECIFIED` enum, an absent message or optional field) is left out.
pub fn status_json(status: &pb::Status) -> serde_json::Value {
    message_json(status, "envoyagent.v1.Status")
}

fn message_json(message: &impl prost::Message, name: &str) -> serde_json::Value {
    let Some(desc) = descriptors().and_then(|pool| pool.get_message_by_name(name)) else {
        return serde_json::Value::Null;
    };
    let Ok(dynamic) =
        prost_reflect::DynamicMessage::decode(desc.clone(), &*message.encode_to_vec())
    else {
        return serde_json::Value::Null;
    };
    let options = prost_reflect::SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(false)
        .stringify_64_bit_integers(false);
    let mut json = dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .unwrap_or(serde_json::Value::Null);
    shorten_enums(&mut json, &desc);
    json
}

/// Rewrites the enum values under `json` (a message of type `desc`) to their short form, and
/// drops those that are UNSPECIFIED.
fn shorten_enums(json: &mut serde_json::Value, desc: &prost_reflect::MessageDescriptor) {
    use prost_reflect::Kind;
    let Some(object) = json.as_object_mut() else {
        return;
    };
    let mut unspecified = Vec::new();
    for (key, value) in object.iter_mut() {
        let Some(field) = desc.get_field_by_name(key) else {
            continue;
        };
        match field.kind() {
            Kind::Enum(e) => {
                // Every value is PREFIX_NAME, PREFIX_UNSPECIFIED the zero (buf's STANDARD
                // rules, checked by a test of the proto crate).
                let prefix = e
                    .get_value(0)
                    .and_then(|v| v.name().strip_suffix("UNSPECIFIED").map(str::to_owned))
                    .unwrap_or_default();
                let rewrite = |v: &mut serde_json::Value| {
                    if let Some(name) = v.as_str() {
                        let short = name.strip_prefix(&prefix).unwrap_or(name);
                        *v = serde_json::Value::String(short.to_ascii_lowercase());
                    }
                };
                match value {
                    serde_json::Value::Array(items) => items.iter_mut().for_each(rewrite),
                    v => {
                        rewrite(v);
                        if v == "unspecified" {
                            unspecified.push(key.clone());
                        }
                    }
                }
            }
            Kind::Message(m) if !m.full_name().starts_with("google.protobuf.") => match value {
                serde_json::Value::Array(items) => {
                    items.iter_mut().for_each(|v| shorten_enums(v, &m));
                }
                v => shorten_enums(v, &m),
            },
            _ => {}
        }
    }
    for key in unspecified {
        object.remove(&key);
    }
}

fn failed(what: &str, status: &tonic::Status) -> u8 {
    eprintln!(
        "envoy-agent {what}: {}: {}",
        code_name(status.code()),
        status.message()
    );
    match status.code() {
        tonic::Code::Unavailable => exit_code::UNAVAILABLE,
        _ => exit_code::FAILURE,
    }
}

fn code_name(code: tonic::Code) -> String {
    format!("{code:?}")
}

/// Makes one call; returns the exit code.
pub async fn run(command: &Call, addr: &GrpcAddress, timeout: Duration) -> u8 {
    use Call as C;
    if let C::Wait = command {
        return wait_ready(addr, timeout).await;
    }
    // A watch lasts as long as the agent: no per-call timeout for it.
    let call_timeout = match command {
        C::Watch { .. } => Duration::from_secs(365 * 24 * 3600),
        _ => timeout,
    };
    let mut client = match connect(addr, call_timeout).await {
        Ok(c) => c,
        Err(unreachable) => {
            eprintln!("envoy-agent: {unreachable}");
            return exit_code::UNAVAILABLE;
        }
    };
    let client = &mut client;
    match command {
        C::Status { json } => status(client, *json).await,
        C::Watch { json } => watch(client, *json).await,
        C::Drain {
            skip_exit,
            listeners,
        } => drain(client, *skip_exit, *listeners).await,
        C::Quit => match client.quit_quit_quit(pb::QuitQuitQuitRequest {}).await {
            Ok(_) => {
                println!("quitting");
                0
            }
            Err(e) => failed("quit", &e),
        },
        C::Stop => match client.stop(pb::StopRequest {}).await {
            Ok(_) => {
                println!("stopping (the SIGTERM path: see `envoy-agent watch`)");
                0
            }
            Err(e) => failed("stop", &e),
        },
        C::ReopenLogs => match client.reopen_logs(pb::ReopenLogsRequest {}).await {
            Ok(r) => {
                println!(
                    "{} envoy process(es) told to reopen their logs",
                    r.into_inner().envoys_signalled
                );
                0
            }
            Err(e) => failed("reopen-logs", &e),
        },
        C::UpdateConfig { file, reason } => update_config(client, file, reason).await,
        C::Restart { reason } => {
            let request = pb::HotRestartRequest {
                reason: reason.clone(),
            };
            match client.hot_restart(request).await {
                Ok(r) => {
                    println!("epoch {} is LIVE", r.into_inner().epoch);
                    0
                }
                Err(e) => failed("restart", &e),
            }
        }
        // Answered above, before the one connection the other calls make.
        C::Wait => wait_ready(addr, timeout).await,
        C::Admin { path } => {
            let request = pb::AdminGetRequest { path: path.clone() };
            match client.admin_get(request).await {
                Ok(r) => print_view(r.into_inner()).await,
                Err(e) => failed("admin", &e),
            }
        }
        C::LogLevel { level } => log_level(client, level).await,
    }
}

async fn status(client: &mut AgentServiceClient<Channel>, json: bool) -> u8 {
    match client.get_status(pb::GetStatusRequest {}).await {
        Ok(r) => {
            let status = r.into_inner().status.unwrap_or_default();
            if json {
                println!("{}", status_json(&status));
            } else {
                print_status(&status);
            }
            0
        }
        Err(e) => failed("status", &e),
    }
}

async fn watch(client: &mut AgentServiceClient<Channel>, json: bool) -> u8 {
    match client.watch_status(pb::WatchStatusRequest {}).await {
        Ok(r) => {
            let mut stream = r.into_inner();
            while let Some(item) = stream.next().await {
                match item.map(|r| r.status.unwrap_or_default()) {
                    Ok(status) if json => println!("{}", status_json(&status)),
                    Ok(status) => {
                        print_status(&status);
                        println!();
                    }
                    Err(e) => return failed("watch", &e),
                }
            }
            0
        }
        Err(e) => failed("watch", &e),
    }
}

async fn drain(
    client: &mut AgentServiceClient<Channel>,
    skip_exit: bool,
    listeners: Option<envoy_agent_proxy::Scope>,
) -> u8 {
    use envoy_agent_proxy::Scope;
    let request = pb::DrainRequest {
        inbound_only: false,
        skip_exit,
        listeners: match listeners {
            None => pb::DrainScope::Unspecified,
            Some(Scope::Auto) => pb::DrainScope::Auto,
            Some(Scope::Inbound) => pb::DrainScope::Inbound,
            Some(Scope::All) => pb::DrainScope::All,
        }
        .into(),
    };
    match client.drain(request).await {
        Ok(answer) => {
            let answer = answer.into_inner();
            let names: Vec<&str> = answer.drained.iter().map(|l| l.name.as_str()).collect();
            match names.is_empty() {
                true => println!("draining"),
                false => println!("draining: {}", names.join(", ")),
            }
            if !answer.drained_note.is_empty() {
                println!("note: {}", answer.drained_note);
            }
            0
        }
        Err(e) => failed("drain", &e),
    }
}

async fn update_config(
    client: &mut AgentServiceClient<Channel>,
    file: &std::path::Path,
    reason: &str,
) -> u8 {
    let bootstrap = match envoy_agent_proxy::read_config(file) {
        Ok(b) => b,
        Err(e) => {
            eprintln!(
                "envoy-agent update-config: cannot read {}: {e}",
                file.display()
            );
            return exit_code::USAGE;
        }
    };
    let request = pb::UpdateConfigRequest {
        bootstrap,
        reason: reason.to_owned(),
    };
    match client.update_config(request).await {
        Ok(r) => {
            let r = r.into_inner();
            if let (true, Some(epoch)) = (r.restarted, r.epoch) {
                println!("config updated; epoch {epoch} is LIVE on it");
            } else {
                println!("config updated (hot restart is off: envoy reads it when next started)");
            }
            0
        }
        Err(e) => failed("update-config", &e),
    }
}

async fn log_level(client: &mut AgentServiceClient<Channel>, level: &str) -> u8 {
    let request = pb::SetLogLevelRequest {
        level: level.to_owned(),
    };
    match client.set_log_level(request).await {
        Ok(r) => {
            let r = r.into_inner();
            match r.envoys {
                0 => println!(
                    "envoy's log level is {} (no envoy serves now: the next one starts with it)",
                    r.level
                ),
                n => println!(
                    "envoy's log level is {} ({n} envoy process(es) took it)",
                    r.level
                ),
            }
            0
        }
        Err(e) => failed("log-level", &e),
    }
}

/// Writes each chunk of an admin view to stdout as it arrives; the exit code.
async fn print_view(mut stream: tonic::Streaming<pb::AdminGetResponse>) -> u8 {
    use std::io::Write as _;
    let stdout = std::io::stdout();
    while let Some(item) = stream.next().await {
        match item {
            Ok(r) => {
                let mut stdout = stdout.lock();
                // A reader that went away (`| head`) took what it wanted.
                if stdout
                    .write_all(&r.chunk)
                    .and_then(|()| stdout.flush())
                    .is_err()
                {
                    return 0;
                }
            }
            Err(e) => return failed("admin", &e),
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Option<prost_types::Timestamp> {
        Some(prost_types::Timestamp { seconds, nanos: 0 })
    }

    fn node_proxy_draining() -> pb::Status {
        let handoff = |epoch| pb::HandoffResult {
            epoch,
            reason: "SIGHUP".into(),
            outcome: pb::HandoffOutcome::Live.into(),
            duration: Some(prost_types::Duration {
                seconds: 0,
                nanos: 250_000_000,
            }),
            end_time: at(990),
            ..Default::default()
        };
        pb::Status {
            mode: pb::Mode::NodeProxy.into(),
            state: pb::AgentState::Draining.into(),
            reason: "SIGTERM".into(),
            state_since: at(995),
            drain_reason: pb::DrainReason::Sigterm.into(),
            drain_phase: pb::DrainPhase::Draining.into(),
            newest_live_epoch: Some(4),
            epochs: vec![pb::Epoch {
                epoch: 4,
                pid: 4242,
                state: pb::EpochState::Live.into(),
                start_time: at(900),
                state_since: at(901),
            }],
            drain: Some(pb::Drain {
                reason: pb::DrainReason::Sigterm.into(),
                start_time: at(995),
                deadline: at(1025),
                active_connections: None,
                active_requests: Some(3),
                count_time: at(999),
                listeners: vec![pb::ListenerDrain {
                    name: "0.0.0.0_8080".to_owned(),
                    active_connections: 2,
                    active_requests: Some(3),
                    upgrades_active: Some(1),
                }],
                listeners_time: at(998),
                drained: vec![pb::DrainedListener {
                    name: "ingress_http".to_owned(),
                    direction: pb::TrafficDirection::Unspecified.into(),
                    stat_name: "0.0.0.0_8080".to_owned(),
                }],
                drained_known: true,
                inbound_only: false,
                drained_note: String::new(),
                accepted: true,
                app: pb::AppWatch::Holding.into(),
                app_hold_until: at(1020),
                stops: true,
            }),
            settings: Some(pb::Settings {
                drain_time: Some(prost_types::Duration {
                    seconds: 45,
                    nanos: 0,
                }),
                drain_delay: Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 250_000_000,
                }),
                config_path: "/etc/envoy/envoy.yaml".into(),
                envoy_binary: "/usr/local/bin/envoy".into(),
                proxy_log_level: "warning,upstream:debug".into(),
                exit_on_zero: pb::ExitOnZero::Requests.into(),
                minimum_drain_duration: Some(prost_types::Duration {
                    seconds: 5,
                    nanos: 0,
                }),
                shutdown_timeline: Some(pb::ShutdownTimeline {
                    not_ready: Some(prost_types::Duration::default()),
                    fail_health_checks: Some(prost_types::Duration {
                        seconds: 10,
                        nanos: 0,
                    }),
                    drain: Some(prost_types::Duration {
                        seconds: 0,
                        nanos: 250_000_000,
                    }),
                    stop_by: Some(prost_types::Duration {
                        seconds: 30,
                        nanos: 250_000_000,
                    }),
                }),
                container: Some(pb::Container {
                    memory_limit_bytes: Some(160 << 20),
                    memory_guard_heap_bytes: Some(142_606_336),
                    max_downstream_connections_off: "--max-downstream-connections off".into(),
                    concurrency: Some(1),
                    workers: "the container's CPU quota (1.00 CPUs)".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            family: Some(pb::Family {
                base_id: 7,
                hot_restart_version: "11.104".into(),
                identity: "pod-b-1a2b".into(),
                predecessor: Some("pod-a-9f8e".into()),
                handoffs: (0..5).map(handoff).collect(),
                wedges: vec![pb::Wedge {
                    reason: pb::WedgeReason::StaleInitializing.into(),
                    time: at(950),
                    message: "cleared".into(),
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_summary_names_a_silent_envoy_and_since_when() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let silent = pb::Status {
            mode: pb::Mode::Sidecar.into(),
            state: pb::AgentState::Live.into(),
            reason: "envoy's admin API has not answered for 4s".into(),
            admin_silent_since: at(996),
            ..Default::default()
        };
        let text = status_text(&silent, now);
        let has = |needle: &str| assert!(text.contains(needle), "{needle:?} in\n{text}");
        has("state:              live (envoy's admin API has not answered for 4s)");
        has("ready:              no");
        has("envoy admin:        not answering since 1970-01-01T00:16:36Z (4.0s ago)");
        let json = status_json(&silent);
        assert_eq!(json["admin_silent_since"], "1970-01-01T00:16:36Z", "{json}");
        let text = status_text(&node_proxy_draining(), now);
        assert!(!text.contains("envoy admin:"), "answering: {text}");
    }

    #[test]
    fn the_summary_says_what_a_person_needs() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let text = status_text(&node_proxy_draining(), now);
        let has = |needle: &str| assert!(text.contains(needle), "{needle:?} in\n{text}");
        has("mode:               node proxy");
        has("state:              draining (SIGTERM)");
        has("ready:              no");
        has("newest LIVE epoch:  4");
        has("drain:              sigterm since 1970-01-01T00:16:35Z (5.0s ago)");
        has("deadline:         1970-01-01T00:17:05Z (in 25.0s)");
        has(
            "  the app:          calls out through envoy: served until it lets go, 1970-01-01T00:17:00Z (in 20.0s) at the latest",
        );
        has("  requests:         3 active, counted 1970-01-01T00:16:39Z (1.0s ago)");
        assert!(
            !text.contains("connections:"),
            "requests are counted: {text}"
        );
        has("      4      4242  live");
        has("identity pod-b-1a2b");
        has("predecessor:        pod-a-9f8e");
        has("2 earlier (see --json)");
        has("epoch 4 live in 250ms (SIGHUP)");
        has("  holding it open:  read 1970-01-01T00:16:38Z (2.0s ago)");
        has("    0.0.0.0_8080:   2 connections, 3 requests, 1 upgraded (WebSocket, CONNECT)");
        assert!(!text.contains("epoch 1 live"), "only the last 3: {text}");
        has("wedge:              stale_initializing: cleared");
        has("envoy log level:    warning,upstream:debug");
        has("envoy:              /usr/local/bin/envoy");
        has("memory:             limit 160 MiB: envoy sheds load before it (heap 136 MiB)");
        has("connection bound:   unbounded by the agent: --max-downstream-connections off");
        has("workers:            1 (the container's CPU quota (1.00 CPUs))");
        has(
            "drain time 45s, termination drain -, drain delay 250ms, exit on zero requests (minimum 5s)",
        );
        has(
            "on SIGTERM:         readiness off at 0s, health checks fail at 10s, drain at 250ms, stop by 30.25s",
        );
    }

    #[test]
    fn json_has_proto_names_short_enums_and_leaves_out_what_does_not_apply() {
        let json = status_json(&node_proxy_draining());
        assert_eq!(json["mode"], "node_proxy");
        assert_eq!(json["state"], "draining");
        assert_eq!(json["drain_reason"], "sigterm");
        assert_eq!(json["newest_live_epoch"], 4);
        assert!(json.get("exit_path").is_none(), "unspecified: {json}");
        assert!(json.get("exit_code").is_none(), "absent: {json}");
        assert_eq!(json["ready"], false, "defaults are shown: {json}");
        assert_eq!(json["drain"]["active_requests"], 3, "a number: {json}");
        assert!(json["drain"].get("active_connections").is_none(), "{json}");
        assert_eq!(json["settings"]["exit_on_zero"], "requests");
        assert_eq!(json["drain"]["deadline"], "1970-01-01T00:17:05Z");
        assert_eq!(json["settings"]["drain_delay"], "0.250s");
        assert_eq!(
            json["settings"]["shutdown_timeline"]["fail_health_checks"],
            "10s"
        );
        assert_eq!(json["family"]["handoffs"][4]["outcome"], "live");
        assert_eq!(json["family"]["wedges"][0]["reason"], "stale_initializing");
        assert_eq!(json["epochs"][0]["state"], "live");
        assert!(json["family"].get("handoff").is_none());
    }
}

//! What `envoy-agent run` runs with: its command line and environment variables, parsed and
//! checked once ([`crate::config::cli::RunArgs::into_settings`]) into domain types: durations, socket
//! addresses, enums of the crates that act on them. Everything below `main` takes these, never
//! the parser's types, so that what a flag means is decided in one place and a combination that
//! cannot work is refused before anything starts.
//!
//! Settings that apply in one mode only are grouped under an `Option` of that mode
//! ([`Settings::hot_restart`], [`Settings::crash_recovery`]): a node-proxy setting cannot be
//! read in sidecar mode by mistake, and its default is already filled in.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use envoy_agent_drain::Counting;
pub use envoy_agent_hotrestart::FamilyOptions;
pub use envoy_agent_proxy::{DrainStrategy, EnvoyOptions, RunAs, Scope};

use crate::crash::CrashRecovery;

/// The agent's gRPC address: where `run` listens and the client subcommands connect.
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

/// `envoy-agent run`'s settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// How Envoy is started and stopped.
    pub envoy: EnvoySettings,
    /// The agent's shutdown drain.
    pub drain: DrainSettings,
    /// The status server's address (`--status-address`).
    pub status_address: SocketAddr,
    /// The app's probes the status server runs at `/app-health/...` (`--app-probers`, else
    /// `ISTIO_KUBE_APP_PROBERS`).
    pub app_probes: crate::status::app_probe::AppProbes,
    /// Where to write the status server's bound address (`--status-address-file`).
    pub status_address_file: Option<PathBuf>,
    /// The app's metrics, merged into the status server's scrape (`--app-metrics-url`).
    pub app_metrics: Option<crate::status::app_metrics::Target>,
    /// The gRPC server's address (`--grpc-address`, else the user's default socket).
    pub grpc_address: GrpcAddress,
    /// Mutating gRPC calls from any TCP peer (`--grpc-allow-remote`).
    pub grpc_allow_remote: bool,
    /// Other uids whose loopback TCP peers may change things (`--control-allow-uid`).
    pub control_allow_uids: Vec<u32>,
    /// The OTLP metrics export.
    pub telemetry: TelemetrySettings,
    /// Hot restart (node-proxy mode, `--hot-restart`); `None`: one Envoy (sidecar mode).
    pub hot_restart: Option<HotRestartSettings>,
    /// Crash recovery in place (`--restart-on-crash`); `None`: a crash ends the agent.
    pub crash_recovery: Option<CrashRecovery>,
    /// `--shutdown-budget` as split over the shutdown's phases; `None`: not set.
    pub shutdown_budget: Option<crate::config::budget::Split>,
    /// Where the agent writes how it ended, for Kubernetes (`--termination-message-path`).
    pub termination_message: crate::termination::MessageFile,
}

/// Where Envoy's admin API listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyAdmin {
    /// On the agent's own Unix socket, whatever the bootstrap says: only the agent's user (and
    /// Envoy's) can reach it.
    Socket,
    /// Where the bootstrap (or `--admin-address`) says.
    Bootstrap,
}

impl EnvoyAdmin {
    /// As the flag takes it.
    pub fn as_str(self) -> &'static str {
        match self {
            EnvoyAdmin::Socket => "socket",
            EnvoyAdmin::Bootstrap => "bootstrap",
        }
    }
}

/// How Envoy is started and stopped: what becomes its command line and its process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoySettings {
    /// Envoy's bootstrap (`--config-path`).
    pub config_path: PathBuf,
    /// The Envoy binary as given: a path, or a name to look up on PATH (`--envoy-path`).
    pub envoy_path: PathBuf,
    /// Envoy's admin address when not the bootstrap's (`--admin-address`).
    pub admin_address: Option<SocketAddr>,
    /// Where Envoy's admin API listens (`--envoy-admin`, `auto` resolved).
    pub admin: EnvoyAdmin,
    /// How Envoy runs, each value under its flag's name, carried as it is into Envoy's
    /// config (`--proxy-log-level`, `--drain-time`, `--concurrency`, ...).
    pub options: EnvoyOptions,
    /// Which memory limit Envoy sheds load below (`--memory-guard`).
    pub memory_guard: crate::config::container::MemoryGuardArg,
    /// The memory guard's shares (`--memory-guard-thresholds`).
    pub memory_guard_thresholds: crate::config::container::GuardShares,
    /// The bound on Envoy's downstream connections (`--max-downstream-connections`).
    pub max_downstream_connections: crate::config::container::MaxConnectionsArg,
    /// Tell idle and streaming clients of a drain through Envoy's overload manager
    /// (`--drain-notice`); off in force when the bootstrap's overload manager has its parts.
    pub drain_notice: bool,
    /// Arguments passed to Envoy verbatim (after `--`).
    pub extra_args: Vec<String>,
}

/// The agent's shutdown drain (on SIGTERM, gRPC `Stop`) and what it counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainSettings {
    /// How long Envoy drains before it is stopped; with exit-on-zero, the hard deadline
    /// (`--termination-drain-duration`).
    pub termination_drain_duration: Duration,
    /// With exit-on-zero, how long to drain before counting (`--minimum-drain-duration`).
    pub minimum_drain_duration: Duration,
    /// What exit-on-zero counts; `None`: off (`--exit-on-zero`,
    /// `--exit-on-zero-active-connections`).
    pub exit_on_zero: Option<Counting>,
    /// How long readiness fails before the drain starts (`--drain-delay`).
    pub drain_delay: Duration,
    /// How often exit-on-zero counts (`--drain-poll-interval`).
    pub poll_interval: Duration,
    /// Listener ports that do not count (`--exclude-listener-ports`).
    pub exclude_listener_ports: Vec<u16>,
    /// Listener stat-name prefixes that do not count, besides the built-in ones
    /// (`--exclude-listener-prefixes`).
    pub exclude_listener_prefixes: Vec<String>,
    /// The shutdown's steps, as offsets from the signal (`--not-ready-at`,
    /// `--healthcheck-fail-at`, `--drain-delay`, the drain's deadline).
    pub timeline: crate::config::timeline::Timeline,
    /// How long a stopping agent waits for a successor pod's Envoy to terminate its own
    /// (`--shutdown-budget`'s share, else [`crate::config::defaults::handover_timeout`] of the mode's
    /// deadlines).
    pub handover_timeout: Duration,
    /// A sidecar's app rule: how long after the signal, at most, Envoy keeps serving an app
    /// that holds connections to its outbound listeners (`--app-hold`, bounded by
    /// `--shutdown-budget`); none: off, and always in a node proxy.
    pub app_hold: Option<Duration>,
}

/// The OTLP metrics export as the flags give it. What they leave out comes from the standard
/// `OTEL_*` variables, read by [`crate::telemetry`] where the export is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetrySettings {
    /// The collector (`--otlp-endpoint`).
    pub otlp_endpoint: Option<String>,
    /// How often metrics are pushed (`--otlp-export-interval`).
    pub export_interval: Option<Duration>,
}

/// Hot restart's settings (node-proxy mode), defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotRestartSettings {
    /// Envoy's `--base-id` (`--base-id`).
    pub base_id: u32,
    /// The family's own settings, carried whole into the hot-restart crate's config
    /// (`--watch-config`, `--ready-marker`, `--pod-generation`, `--handoff-deadline`,
    /// `--cold-base-id`: else `--base-id` + 1, none with `--no-cold-handover`).
    pub options: FamilyOptions,
    /// An abstract hot-restart channel is allowed (`--allow-abstract-hot-restart-socket`).
    pub allow_abstract_socket: bool,
    /// When a new epoch terminates its draining parent, whole seconds, longer than the drain
    /// time (`--parent-shutdown-time`).
    pub parent_shutdown_time: Duration,
    /// The per-node state directory (`--state-dir`).
    pub state_dir: PathBuf,
    /// This agent's name on the node as given (`--identity`); the agent adds `$POD_NAME` or the
    /// host name and a unique suffix when it starts.
    pub identity: Option<String>,
}

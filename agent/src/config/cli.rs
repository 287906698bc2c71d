//! The command line. Every flag that an operator may want to set from a pod spec also reads
//! an environment variable (shown in `--help`).
//!
//! The parser's types stay here: `run`'s arguments become [`Settings`] once
//! ([`RunArgs::into_settings`]), the client subcommands a [`client::Call`], and nothing below
//! `main` sees a clap type.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use envoy_agent_proxy::{EnvoyOptions, Scope};

use crate::client;
use crate::config::defaults;
use crate::config::duration::{
    parse_duration, parse_positive_duration, parse_positive_whole_seconds, parse_whole_seconds,
};
use crate::config::settings::{
    Counting, DrainSettings, DrainStrategy, EnvoyAdmin, EnvoySettings, FamilyOptions, GrpcAddress,
    HotRestartSettings, RunAs, Settings, TelemetrySettings,
};
use crate::config::timeline::{AppHold, HealthCheckFailAt};
use crate::crash::CrashRecovery;
use crate::exit_code;
use crate::status::app_probe::{self, AppProbes};

/// Process manager for the Envoy proxy: starts Envoy, keeps it healthy, drains it on shutdown.
#[derive(Debug, Parser)]
#[command(name = "envoy-agent", version, propagate_version = true)]
pub struct Cli {
    /// The agent's own log level or filter (e.g. `info`, `envoy_agent=debug`).
    #[arg(
        long,
        global = true,
        env = "ENVOY_AGENT_LOG_LEVEL",
        default_value = "info"
    )]
    pub log_level: String,

    /// The agent's log format: `text` for people, `json` (one object per line) for collectors.
    #[arg(
        long,
        global = true,
        env = "ENVOY_AGENT_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,

    /// Client settings (for the client subcommands).
    #[command(flatten)]
    pub client: ClientArgs,
}

/// How the agent writes its logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with every field (epoch, pid, ...) as a key.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run Envoy under the agent until it exits or the agent is told to stop.
    Run(Box<RunArgs>),
    /// Ask a running agent (over gRPC).
    #[command(flatten)]
    Client(ClientCommand),
    /// Print a shell completion script to stdout.
    ///
    /// For example `envoy-agent completions bash > /etc/bash_completion.d/envoy-agent`, or
    /// `envoy-agent completions zsh > "${fpath[1]}/_envoy-agent"`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// The agent's gRPC address, shared by `run` (where it listens) and the client subcommands
/// (where they connect).
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The agent's gRPC address: unix:/path (a 0600 socket) or host:port. `run` listens there, the
    /// client subcommands connect there. Default: grpc.sock in $XDG_RUNTIME_DIR/envoy-agent,
    /// /run/envoy-agent for root, else /tmp/envoy-agent-UID.
    #[arg(long, global = true, env = "ENVOY_AGENT_GRPC_ADDRESS")]
    pub grpc_address: Option<GrpcAddress>,

    /// Client subcommands: bound on the call (not on `watch`).
    #[arg(long, global = true, value_parser = parse_positive_duration, default_value = "70s")]
    pub timeout: Duration,
}

/// The client subcommands.
#[derive(Debug, Subcommand)]
pub enum ClientCommand {
    /// Show the agent's status.
    Status {
        /// One JSON object, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Show the status, then every change, until the agent exits.
    Watch {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Drain Envoy's listeners.
    Drain {
        /// Keep the listeners accepting (like POST /drain); the next SIGTERM exits at once.
        #[arg(long)]
        skip_exit: bool,
        /// Which listeners: the agent's setting (--drain-listeners) when not given.
        #[arg(long, value_enum)]
        listeners: Option<ScopeArg>,
        /// Drain every listener (`--listeners all`).
        #[arg(long, conflicts_with = "listeners")]
        all_listeners: bool,
    },
    /// Stop gracefully, as on SIGTERM: drain (or hand over to a successor pod), then exit.
    ///
    /// The agent hands over to a successor pod, or drains (after the drain delay, for the
    /// termination drain duration or until no connection is left), then stops Envoy and exits
    /// 0. Returns once the agent has taken that path; `envoy-agent watch` shows its progress.
    Stop,
    /// Stop Envoy at once, without draining, and exit (like POST /quitquitquit).
    Quit,
    /// Make every LIVE Envoy reopen its access logs (SIGUSR1), e.g. after log rotation.
    ReopenLogs,
    /// Replace Envoy's bootstrap with FILE: validated by the agent first (a rejected one changes
    /// nothing), written atomically, then hot-restarted onto (with --hot-restart).
    UpdateConfig {
        /// The new bootstrap (YAML or JSON, as Envoy reads it).
        file: PathBuf,
        /// Why, for the agent's logs and status.
        #[arg(long, default_value = "envoy-agent update-config")]
        reason: String,
    },
    /// Hot-restart Envoy (with --hot-restart); prints the new epoch once it is LIVE.
    Restart {
        /// Why, for the agent's logs and status.
        #[arg(long, default_value = "envoy-agent restart")]
        reason: String,
    },
    /// Read one of Envoy's admin views through the agent (`admin GET /config_dump`), printed
    /// as it streams.
    ///
    /// What `curl localhost:15000/...` was for, wherever Envoy's admin API listens (with
    /// --envoy-admin socket, only the agent reaches it). Read-only endpoints only: /stats,
    /// /stats/prometheus, /config_dump, /clusters, /listeners, /server_info, /certs, /ready,
    /// /memory, /runtime, /hot_restart_version, the query passed on as given (quote it for the
    /// shell). Endpoints that change Envoy are refused, naming the envoy-agent verb to use.
    Admin {
        /// The HTTP method: GET (nothing else is passed on).
        #[arg(value_parser = parse_get)]
        method: String,
        /// The endpoint and its query, percent-encoded as Envoy takes it (e.g.
        /// '/stats?filter=^http' or '/config_dump?resource=dynamic_listeners').
        path: String,
    },
    /// Set Envoy's log level through the agent, kept across hot restarts (LEVEL as
    /// --proxy-log-level: `debug`, or `info,upstream:debug`, or `upstream:debug`).
    ///
    /// Every Envoy whose admin API the agent reaches takes it (POST /logging), and every Envoy
    /// started later (a hot restart's next epoch, a crash recovery's) starts with it. A global
    /// level resets the component levels, as in Envoy. `envoy-agent status` shows the level in
    /// force.
    LogLevel {
        /// The level, Istio style.
        #[arg(value_parser = parse_log_level)]
        level: String,
    },
    /// Wait until the agent says ready (Envoy LIVE with its config), for at most --timeout.
    ///
    /// Exits 0 once ready, 1 at the timeout or when the agent is exiting, saying what it last
    /// said. An agent not up yet is asked again. For a classic (not native) sidecar: as the
    /// sidecar container's postStart hook, it holds the app's container until Envoy is ready,
    /// as `pilot-agent wait` does (`holdApplicationUntilProxyStarts`).
    Wait,
}

/// `GET`, the only method `envoy-agent admin` passes on.
fn parse_get(method: &str) -> Result<String, String> {
    if method.eq_ignore_ascii_case("GET") {
        Ok("GET".to_owned())
    } else {
        Err(
            "only GET is passed on to envoy's admin API; for a change use envoy-agent \
             stop|quit|drain|log-level|restart"
                .to_owned(),
        )
    }
}

/// A log level as `envoy-agent log-level` takes it (checked again by the agent).
fn parse_log_level(level: &str) -> Result<String, String> {
    envoy_agent_proxy::LogLevel::parse(level)
        .map(|_| level.to_owned())
        .map_err(|e| e.to_string())
}

impl From<ClientCommand> for client::Call {
    fn from(command: ClientCommand) -> Self {
        use client::Call;
        match command {
            ClientCommand::Status { json } => Call::Status { json },
            ClientCommand::Watch { json } => Call::Watch { json },
            ClientCommand::Drain {
                skip_exit,
                listeners,
                all_listeners,
            } => Call::Drain {
                skip_exit,
                listeners: match (all_listeners, listeners) {
                    (true, _) => Some(Scope::All),
                    (false, l) => l.map(ScopeArg::scope),
                },
            },
            ClientCommand::Stop => Call::Stop,
            ClientCommand::Quit => Call::Quit,
            ClientCommand::ReopenLogs => Call::ReopenLogs,
            ClientCommand::UpdateConfig { file, reason } => Call::UpdateConfig { file, reason },
            ClientCommand::Restart { reason } => Call::Restart { reason },
            ClientCommand::Admin { method: _, path } => Call::Admin { path },
            ClientCommand::LogLevel { level } => Call::LogLevel { level },
            ClientCommand::Wait => Call::Wait,
        }
    }
}

/// Which listeners a drain reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScopeArg {
    /// A node proxy drains every listener; a sidecar its `INBOUND` ones, or every listener
    /// where none is marked `INBOUND` (learnt from Envoy at each drain).
    Auto,
    /// Only listeners marked `traffic_direction: INBOUND`.
    Inbound,
    /// Every listener.
    All,
}

impl ScopeArg {
    fn scope(self) -> Scope {
        match self {
            ScopeArg::Auto => Scope::Auto,
            ScopeArg::Inbound => Scope::Inbound,
            ScopeArg::All => Scope::All,
        }
    }
}

/// Where Envoy's admin API listens (`--envoy-admin`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EnvoyAdminArg {
    /// `socket` for a node proxy unless --admin-address is given, `bootstrap` for a sidecar.
    Auto,
    /// The agent's own Unix socket.
    Socket,
    /// The bootstrap's address (or --admin-address).
    Bootstrap,
}

/// On or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

/// How connections are closed during a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DrainStrategyArg {
    /// Tell every connection to close when the drain starts.
    Immediate,
    /// Tell connections to close with a probability rising over the drain time.
    Gradual,
}

/// What exit-on-zero counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExitOnZeroArg {
    /// Active downstream connections (what --exit-on-zero-active-connections counts): an idle
    /// keep-alive connection holds the drain.
    Connections,
    /// Active downstream requests on HTTP listeners; a listener without HTTP (TCP proxy)
    /// counts its connections. Idle keep-alive connections do not hold the drain.
    Requests,
}

/// `envoy-agent run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Envoy's bootstrap (YAML or JSON). Its admin address is the agent's way into Envoy.
    #[arg(short = 'c', long = "config-path", env = "ENVOY_AGENT_CONFIG_PATH")]
    pub config_path: PathBuf,

    /// The Envoy binary: a path, or a name looked up on PATH.
    #[arg(long, env = "ENVOY_PATH", default_value = "envoy")]
    pub envoy_path: PathBuf,

    /// Envoy's admin address, when not the bootstrap's (e.g. 127.0.0.1:15000).
    #[arg(long, env = "ENVOY_AGENT_ADMIN_ADDRESS")]
    pub admin_address: Option<SocketAddr>,

    /// Where Envoy's admin API listens. `socket`: on a Unix socket (mode 0600) in a directory
    /// only the agent's user (and Envoy's) can enter, whatever the bootstrap says: no other
    /// process can stop or steer Envoy (`envoy-agent admin GET /stats` reads it through the
    /// agent). `bootstrap`: where the bootstrap (or --admin-address) says; a TCP address there
    /// is open to every process that reaches it. `auto`: `socket` for a node proxy
    /// (--hot-restart) unless --admin-address is given, `bootstrap` for a sidecar.
    #[arg(
        long,
        env = "ENVOY_AGENT_ENVOY_ADMIN",
        value_enum,
        default_value = "auto"
    )]
    pub envoy_admin: EnvoyAdminArg,

    /// Envoy's log level, Istio style: `warning` or `info,upstream:debug` (component levels).
    #[arg(long, env = "ENVOY_AGENT_PROXY_LOG_LEVEL", default_value = "warning")]
    pub proxy_log_level: String,

    /// Envoy's component log levels (`a:b,c:d`), used when --proxy-log-level names none.
    #[arg(
        long,
        env = "ENVOY_AGENT_PROXY_COMPONENT_LOG_LEVEL",
        default_value = ""
    )]
    pub proxy_component_log_level: String,

    /// Envoy logs as JSON lines.
    #[arg(long, env = "ENVOY_AGENT_PROXY_LOG_AS_JSON")]
    pub proxy_log_as_json: bool,

    /// The node's IPs; Envoy binds upstream connections to IPv6 only when all are IPv6.
    #[arg(long = "node-ip", env = "ENVOY_AGENT_NODE_IPS", value_delimiter = ',')]
    pub node_ips: Vec<String>,

    /// Envoy's worker threads (`--concurrency`); 0: from the container's CPU quota (the floor,
    /// at least 1), or Envoy's choice without one. Keep it constant.
    #[arg(long, env = "ENVOY_AGENT_CONCURRENCY", default_value_t = 0)]
    pub concurrency: u32,

    /// Envoy sheds load before this memory limit instead of being OOM-killed: `auto` (the
    /// container's: its cgroup's, v1 or v2), a size (`512Mi`), or `off`. Its heap is taken as
    /// full at a share of it, and it returns free memory, answers new requests 503 and refuses
    /// new connections as it fills (--memory-guard-thresholds). No limit found: nothing is
    /// added. A bootstrap whose overload manager has the same parts keeps its own.
    #[arg(
        long,
        env = "ENVOY_AGENT_MEMORY_GUARD",
        default_value = "auto",
        value_name = "auto|off|SIZE"
    )]
    pub memory_guard: crate::config::container::MemoryGuardArg,

    /// The memory guard's shares: `heap` of the limit (Envoy's heap is about 80% of what the
    /// cgroup counts), then of that heap `shrink_heap`, `stop_accepting_requests` and
    /// `reject_connections` (tcp_listener_accept); any subset, the rest as by default.
    #[arg(
        long,
        env = "ENVOY_AGENT_MEMORY_GUARD_THRESHOLDS",
        default_value = "heap=0.85,shrink_heap=0.8,stop_accepting_requests=0.9,reject_connections=0.95",
        value_name = "NAME=SHARE,..."
    )]
    pub memory_guard_thresholds: crate::config::container::GuardShares,

    /// A bound on Envoy's downstream connections (global_downstream_max_connections), so that
    /// a connection past it is refused cleanly instead of accept failing once descriptors run
    /// out: `auto` (half of the open-file limit Envoy runs with, less a quarter of it, at most
    /// 1024, kept: 384 under 1024), a count, or
    /// `off`. A bootstrap with its own bound keeps it.
    #[arg(
        long,
        env = "ENVOY_AGENT_MAX_DOWNSTREAM_CONNECTIONS",
        default_value = "auto",
        value_name = "auto|off|N"
    )]
    pub max_downstream_connections: crate::config::container::MaxConnectionsArg,

    /// How long Envoy drains (`--drain-time-s`: whole seconds; anything else is refused).
    #[arg(long, env = "ENVOY_AGENT_DRAIN_TIME", value_parser = parse_whole_seconds, default_value = "45s")]
    pub drain_time: Duration,

    /// How Envoy closes connections during a drain.
    #[arg(
        long,
        env = "ENVOY_AGENT_DRAIN_STRATEGY",
        value_enum,
        default_value = "immediate"
    )]
    pub drain_strategy: DrainStrategyArg,

    /// Which listeners a drain reaches (each listener's traffic_direction is learnt from Envoy
    /// at drain time): `auto` drains every listener of a node proxy, and a sidecar's INBOUND
    /// listeners (every listener where none is INBOUND).
    #[arg(
        long,
        env = "ENVOY_AGENT_DRAIN_LISTENERS",
        value_enum,
        default_value = "auto"
    )]
    pub drain_listeners: ScopeArg,

    /// Drain every listener (`--drain-listeners all`; kept for existing command lines).
    #[arg(long, env = "ENVOY_AGENT_DRAIN_ALL_LISTENERS")]
    pub drain_all_listeners: bool,

    /// Tell idle and streaming clients that a drain began, through an overload action the
    /// agent adds to Envoy's bootstrap (`--config-yaml`): GOAWAY to HTTP/2 and HTTP/3
    /// connections, `Connection: close` or a close to HTTP/1.1 ones, on HTTP connection
    /// managers with an idle timeout or a max_connection_duration.
    #[arg(
        long,
        env = "ENVOY_AGENT_DRAIN_NOTICE",
        value_enum,
        default_value = "on"
    )]
    pub drain_notice: Switch,

    /// Write Envoy's outlier-detection events to this file.
    #[arg(long, env = "ENVOY_AGENT_OUTLIER_LOG_PATH")]
    pub outlier_log_path: Option<PathBuf>,

    /// Envoy's access-log flush interval (`--file-flush-interval-msec`).
    #[arg(long, env = "ENVOY_AGENT_FILE_FLUSH_INTERVAL", value_parser = parse_duration, default_value = "1s")]
    pub file_flush_interval: Duration,

    /// Delete the bootstrap once Envoy has exited (for generated bootstraps).
    #[arg(long, env = "ENVOY_AGENT_CONFIG_CLEANUP")]
    pub config_cleanup: bool,

    /// When the agent runs as root, run Envoy as this uid (with --run-as-gid).
    #[arg(long, env = "ENVOY_AGENT_RUN_AS_UID", requires = "run_as_gid")]
    pub run_as_uid: Option<u32>,

    /// When the agent runs as root, run Envoy as this gid (with --run-as-uid).
    #[arg(long, env = "ENVOY_AGENT_RUN_AS_GID", requires = "run_as_uid")]
    pub run_as_gid: Option<u32>,

    /// How long a stopping Envoy gets between SIGTERM and SIGKILL.
    #[arg(long, env = "ENVOY_AGENT_STOP_GRACE", value_parser = parse_duration, default_value = "5s")]
    pub stop_grace: Duration,

    /// How long the serving Envoy's admin API may stay silent (the agent asks it /ready about
    /// once a second) before the agent judges it wedged: it is killed (SIGKILL) and the agent
    /// exits 75 (with --restart-on-crash, a fresh Envoy starts after the back-off). Both modes.
    /// Readiness turns 503 sooner: after 3s of silence (half this deadline when shorter).
    #[arg(long, env = "ENVOY_AGENT_ADMIN_UNRESPONSIVE_DEADLINE", value_parser = parse_positive_duration, default_value = "30s")]
    pub admin_unresponsive_deadline: Duration,

    /// On SIGTERM: how long Envoy drains before it is stopped. With exit-on-zero, the hard
    /// deadline of the wait for zero when longer than --minimum-drain-duration. [default: 5s;
    /// with --shutdown-budget, what the budget leaves]
    #[arg(long, env = "ENVOY_AGENT_TERMINATION_DRAIN_DURATION", value_parser = parse_duration)]
    pub termination_drain_duration: Option<Duration>,

    /// The one deadline from SIGTERM to the agent's exit (set it to the pod's
    /// terminationGracePeriodSeconds). The drain gets what --drain-delay, --stop-grace and
    /// the agent's own exit (2s) leave, unless --termination-drain-duration is given; a phase
    /// that cannot fit is refused at start.
    #[arg(long, env = "ENVOY_AGENT_SHUTDOWN_BUDGET", value_parser = parse_positive_duration)]
    pub shutdown_budget: Option<Duration>,

    /// With exit-on-zero: how long to drain before counting.
    #[arg(long, env = "ENVOY_AGENT_MINIMUM_DRAIN_DURATION", value_parser = parse_duration, default_value = "5s")]
    pub minimum_drain_duration: Duration,

    /// On SIGTERM, stop Envoy as soon as it has no active downstream connections (after the
    /// minimum drain duration, at the latest at the termination drain duration).
    #[arg(long, env = "ENVOY_AGENT_EXIT_ON_ZERO_ACTIVE_CONNECTIONS")]
    pub exit_on_zero_active_connections: bool,

    /// On SIGTERM, stop Envoy as soon as nothing of this is active (after the minimum drain
    /// duration, at the latest at the termination drain duration): `connections` is
    /// --exit-on-zero-active-connections; `requests` lets idle keep-alive connections go
    /// uncounted.
    #[arg(long, env = "ENVOY_AGENT_EXIT_ON_ZERO", value_enum)]
    pub exit_on_zero: Option<ExitOnZeroArg>,

    /// On SIGTERM, report not-ready for this long before draining (endpoint removal
    /// propagates first).
    #[arg(long, env = "ENVOY_AGENT_DRAIN_DELAY", value_parser = parse_duration, default_value = "0s")]
    pub drain_delay: Duration,

    /// On SIGTERM (SIGINT, gRPC Stop): when readiness (and gRPC health) goes off, after the
    /// signal. Later than --drain-delay keeps the pod ready while it already drains (until
    /// the endpoint removal has propagated); it must come before Envoy's latest stop.
    #[arg(long, env = "ENVOY_AGENT_NOT_READY_AT", value_parser = parse_duration, default_value = "0s")]
    pub not_ready_at: Duration,

    /// On SIGTERM (SIGINT, gRPC Stop): when Envoy is told to fail its health checks (POST
    /// /healthcheck/fail), after the signal: a duration, `drain` (when the drain starts,
    /// --drain-delay after the signal) or `off`. An HTTP health_check filter then answers 503,
    /// so load balancers that check through Envoy take it out; Envoy also starts draining every
    /// listener whose drain_type is DEFAULT (inbound or outbound, new connections still
    /// accepted). It must come before Envoy's latest stop.
    #[arg(
        long,
        env = "ENVOY_AGENT_HEALTHCHECK_FAIL_AT",
        default_value = "drain",
        value_name = "DURATION|drain|off"
    )]
    pub healthcheck_fail_at: HealthCheckFailAt,

    /// Sidecar: after SIGTERM (SIGINT, gRPC Stop), while the app still holds connections to
    /// Envoy's OUTBOUND listeners (it is shutting down and calls out), Envoy keeps serving
    /// them, however the drain goes, for at most this long after the signal; once the app lets
    /// go (it exited, or closed them), Envoy stops within about a second. Meanwhile the failed
    /// health checks and the drain notice, which would tell the app's connections to close,
    /// wait. `off`: Envoy stops on the drain's clock. A node proxy has no app: refused with
    /// --hot-restart. [default: 25s, bounded by --shutdown-budget]
    #[arg(long, env = "ENVOY_AGENT_APP_HOLD", value_name = "DURATION|off")]
    pub app_hold: Option<AppHold>,

    /// Where the agent writes, as it exits, how it ended (the exit path and code, how long the
    /// shutdown took, what each listener still held), for `kubectl describe pod`; at most 4096
    /// bytes, as Kubernetes keeps. The default is written only if it exists (the kubelet
    /// creates it); a path given is created. A failure to write is a warning. [default:
    /// /dev/termination-log]
    #[arg(long, env = "ENVOY_AGENT_TERMINATION_MESSAGE_PATH")]
    pub termination_message_path: Option<PathBuf>,

    /// How often exit-on-zero counts while waiting for zero.
    #[arg(long, env = "ENVOY_AGENT_DRAIN_POLL_INTERVAL", value_parser = parse_positive_duration, default_value = "50ms")]
    pub drain_poll_interval: Duration,

    /// Listener ports whose connections and requests do not count as active (health, metrics
    /// listeners), on any address.
    #[arg(
        long,
        env = "ENVOY_AGENT_EXCLUDE_LISTENER_PORTS",
        value_delimiter = ',',
        default_value = "15021,15090"
    )]
    pub exclude_listener_ports: Vec<u16>,

    /// Listener stat-name prefixes whose connections and requests do not count as active,
    /// besides `admin` and `envoy_internal_`.
    #[arg(
        long,
        env = "ENVOY_AGENT_EXCLUDE_LISTENER_PREFIXES",
        value_delimiter = ','
    )]
    pub exclude_listener_prefixes: Vec<String>,

    /// The status server's address (readiness, /drain, /quitquitquit, /stats/prometheus), in both
    /// modes. With --hot-restart, a surge successor that finds it taken by its predecessor on
    /// the node binds it once it is free. Envoy's admin port (on the same or a wildcard address)
    /// is refused at start.
    #[arg(
        long,
        env = "ENVOY_AGENT_STATUS_ADDRESS",
        default_value = "127.0.0.1:15020"
    )]
    pub status_address: SocketAddr,

    /// The app's own probes, which the status server runs from inside the pod at
    /// /app-health/CONTAINER/livez, /readyz and /startupz (where the app's probes then
    /// point): a JSON object mapping each such path to a Kubernetes probe (httpGet, tcpSocket
    /// or grpc; timeoutSeconds, default 1), pilot-agent's format. When not given:
    /// ISTIO_KUBE_APP_PROBERS, as Istio's injector sets it. A probe answers 200 when it
    /// passes, 500 with the reason when it fails; bad JSON, a named port or another path is
    /// refused at start.
    #[arg(long, env = "ENVOY_AGENT_APP_PROBERS", value_name = "JSON")]
    pub app_probers: Option<String>,

    /// Istio's name for --app-probers, read from the environment only (hidden as a flag); the
    /// agent's own wins when both are set.
    #[arg(
        long = "istio-kube-app-probers",
        env = "ISTIO_KUBE_APP_PROBERS",
        value_name = "JSON",
        hide = true
    )]
    pub istio_kube_app_probers: Option<String>,

    /// Push metrics over OTLP/gRPC to this collector (host:port, http://host:port, or
    /// https://host:port verified with the system's roots). When not given:
    /// OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT; none of them, no
    /// metrics. The other standard OTEL_* variables apply too (service name, resource
    /// attributes, headers, timeout).
    #[arg(long, env = "ENVOY_AGENT_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// How often metrics are pushed. When not given: OTEL_METRIC_EXPORT_INTERVAL
    /// (milliseconds), else 10s.
    #[arg(long, env = "ENVOY_AGENT_OTLP_EXPORT_INTERVAL", value_parser = parse_positive_duration)]
    pub otlp_export_interval: Option<Duration>,

    /// Accept mutating gRPC calls from any TCP peer: other hosts, and every user of this
    /// machine. Without it, over TCP only a loopback peer whose socket belongs to the agent's
    /// own user, root or a --control-allow-uid may call them (with hostNetwork, every process
    /// of the node shares the loopback).
    #[arg(long, env = "ENVOY_AGENT_GRPC_ALLOW_REMOTE")]
    pub grpc_allow_remote: bool,

    /// Also accept changes from loopback TCP peers whose socket belongs to this uid (a
    /// controller running as another user): mutating gRPC calls, and with --hot-restart the
    /// status server's POST /drain and /quitquitquit. The agent's own user and root always
    /// may. Repeat, or separate with commas.
    #[arg(
        long = "control-allow-uid",
        env = "ENVOY_AGENT_CONTROL_ALLOW_UIDS",
        value_delimiter = ',',
        value_name = "UID"
    )]
    pub control_allow_uids: Vec<u32>,

    /// Write the status server's bound address to this file (useful with port 0).
    #[arg(long, env = "ENVOY_AGENT_STATUS_ADDRESS_FILE")]
    pub status_address_file: Option<PathBuf>,

    /// The app's Prometheus metrics (an http:// URL on the pod's loopback, for example from
    /// the pod's prometheus.io/port and prometheus.io/path annotations), merged into the
    /// status server's /stats/prometheus: one scrape target for the pod. Fetched once for the
    /// scrapes that arrive together, within 2s and 8 MiB; an app that fails or answers what
    /// Prometheus would refuse is left out of that scrape (envoy_agent_app_metrics_up 0), the
    /// rest answered. The app's names that begin with envoy_ get an app_ prefix. Empty: off.
    #[arg(long, env = "ENVOY_AGENT_APP_METRICS_URL", value_name = "URL")]
    pub app_metrics_url: Option<crate::status::app_metrics::Flag>,

    /// Istio's description of the app's metrics (ISTIO_PROMETHEUS_ANNOTATIONS, as its
    /// injector sets it: {"scrape":"true","port":"8080","path":"/metrics"}), read from the
    /// environment only (hidden as a flag); --app-metrics-url wins when both are set.
    #[arg(
        long = "istio-prometheus-annotations",
        env = "ISTIO_PROMETHEUS_ANNOTATIONS",
        value_name = "JSON",
        hide = true
    )]
    pub istio_prometheus_annotations: Option<String>,

    /// Hot restart: run Envoy with restart epochs under the hot-restart supervisor (SIGHUP or a
    /// config change starts the next epoch). Without it Envoy runs with --disable-hot-restart.
    /// Every other flag means the same in both modes.
    #[arg(long, env = "ENVOY_AGENT_HOT_RESTART", requires_all = ["base_id", "state_dir"])]
    pub hot_restart: bool,

    /// With --hot-restart (required): Envoy's --base-id, which names the shared memory and
    /// sockets of the Envoy family. Keep it stable for the node; different families on one host
    /// need different ids.
    #[arg(long, env = "ENVOY_AGENT_BASE_ID", requires = "hot_restart")]
    pub base_id: Option<u32>,

    /// With --hot-restart: the base id of the second Envoy family that a cold handover starts
    /// beside the serving one when hot restart cannot work (a binary with another
    /// --hot-restart-version, shared memory a new epoch cannot attach to). Families alternate
    /// between --base-id and this one: reserve both for this agent. [default: --base-id + 1]
    #[arg(long, env = "ENVOY_AGENT_COLD_BASE_ID", requires = "hot_restart")]
    pub cold_base_id: Option<u32>,

    /// With --hot-restart: refuse a restart that hot restart cannot do (the serving Envoy keeps
    /// serving) instead of a cold handover.
    #[arg(
        long,
        env = "ENVOY_AGENT_NO_COLD_HANDOVER",
        requires = "hot_restart",
        conflicts_with = "cold_base_id"
    )]
    pub no_cold_handover: bool,

    /// With --hot-restart: allow an abstract hot-restart channel (`-- --socket-path @name`,
    /// Envoy's own default). Abstract sockets have no permissions: every process in the network
    /// namespace (with hostNetwork, the node) can take Envoy's listeners or stop it through
    /// them. Without this flag the agent puts the channel in a private directory under
    /// --state-dir and refuses an abstract one.
    #[arg(
        long,
        env = "ENVOY_AGENT_ALLOW_ABSTRACT_HOT_RESTART_SOCKET",
        requires = "hot_restart"
    )]
    pub allow_abstract_hot_restart_socket: bool,

    /// With --hot-restart: when a new epoch terminates its draining parent
    /// (--parent-shutdown-time-s: whole seconds). Must exceed --drain-time. [default: 60s]
    #[arg(long, env = "ENVOY_AGENT_PARENT_SHUTDOWN_TIME", value_parser = parse_positive_whole_seconds, requires = "hot_restart")]
    pub parent_shutdown_time: Option<Duration>,

    /// With --hot-restart: hot-restart when the bootstrap changes (ConfigMap updates included).
    #[arg(long, env = "ENVOY_AGENT_WATCH_CONFIG", requires = "hot_restart")]
    pub watch_config: bool,

    /// With --hot-restart: a file that exists exactly while the newest epoch is LIVE (for an exec
    /// readiness probe).
    #[arg(long, env = "ENVOY_AGENT_READY_MARKER", requires = "hot_restart")]
    pub ready_marker: Option<PathBuf>,

    /// With --hot-restart (required): the per-node state directory, shared by the agents of a
    /// node (a hostPath): heartbeats and the epoch lock, for hot restarts across pods.
    #[arg(long, env = "ENVOY_AGENT_STATE_DIR", requires = "hot_restart")]
    pub state_dir: Option<PathBuf>,

    /// With --hot-restart: this agent's name on the node (default: $POD_NAME, else the host
    /// name). A random suffix made at start is always added, so that no two agents share one.
    #[arg(long, env = "ENVOY_AGENT_IDENTITY", requires = "hot_restart")]
    pub identity: Option<String>,

    /// With --hot-restart: this pod's place in a rollout, larger for a later pod (a DaemonSet's
    /// `pod-template-generation` label, through the downward API). An agent never takes over
    /// from, nor starts a family beside, a family run by a newer pod, so a rollout only goes
    /// forward (a crash-recovering predecessor stands by). [default: the agent's start time in
    /// Unix ms; set it on every pod of the node or on none]
    #[arg(long, env = "ENVOY_AGENT_POD_GENERATION", requires = "hot_restart")]
    pub pod_generation: Option<u64>,

    /// With --hot-restart: how long a new epoch may take from spawn to LIVE before it is killed
    /// (the serving epoch keeps serving). [default: 60s]
    #[arg(long, env = "ENVOY_AGENT_HANDOFF_DEADLINE", value_parser = parse_positive_duration, requires = "hot_restart")]
    pub handoff_deadline: Option<Duration>,

    /// Crash recovery in place: when the serving Envoy dies without the agent asking (exits
    /// non-zero, is killed; with --hot-restart, dies with nothing else serving) after it has
    /// served, start a fresh Envoy (with --hot-restart a fresh family) after a back-off
    /// instead of exiting; the agent, its status server and gRPC stay up, readiness answers
    /// 503 meanwhile, and each crash is reported in the status, the logs
    /// (event="envoy_crashed") and the metrics. Off: a crash ends the agent with its code.
    #[arg(long, env = "ENVOY_AGENT_RESTART_ON_CRASH")]
    pub restart_on_crash: bool,

    /// With --restart-on-crash: restarts in a row before the agent gives up and exits with
    /// the last crash's code (a restarted Envoy that stays LIVE for a minute ends the streak).
    /// [default: 5]
    #[arg(long, env = "ENVOY_AGENT_CRASH_RESTART_LIMIT", value_parser = clap::value_parser!(u32).range(1..), requires = "restart_on_crash")]
    pub crash_restart_limit: Option<u32>,

    /// With --restart-on-crash: the longest wait between a crash and the restart (the first
    /// wait is 1s, or this if shorter; each next one doubles). [default: 30s]
    #[arg(long, env = "ENVOY_AGENT_CRASH_BACKOFF_MAX", value_parser = parse_positive_duration, requires = "restart_on_crash")]
    pub crash_backoff_max: Option<Duration>,

    /// Extra arguments passed to Envoy verbatim, after `--`.
    #[arg(last = true)]
    pub envoy_args: Vec<String>,
}

impl RunArgs {
    /// The settings these arguments (and the gRPC address, a global flag) give: the defaults
    /// of the mode's flags filled in, the combinations checked, before any file is looked at.
    /// The hot-restart flags are read only with `--hot-restart`, which each of them requires.
    pub fn into_settings(
        self,
        grpc_address: Option<GrpcAddress>,
    ) -> Result<Settings, SettingsError> {
        let hot_restart = self.hot_restart()?;
        let exit_on_zero = self.exit_on_zero()?;
        if let Some(hot) = &hot_restart {
            self.check_hot_restart(hot)?;
        }
        let crash_recovery = self.crash_recovery();
        let app_probes = self.app_probes()?;
        let app_metrics = self.app_metrics()?;
        let shutdown = self.shutdown(hot_restart.as_ref(), exit_on_zero)?;
        Ok(Settings {
            envoy: self.envoy_settings(hot_restart.is_some()),
            drain: DrainSettings {
                termination_drain_duration: shutdown.termination_drain_duration,
                minimum_drain_duration: self.minimum_drain_duration,
                exit_on_zero,
                drain_delay: self.drain_delay,
                poll_interval: self.drain_poll_interval,
                exclude_listener_ports: self.exclude_listener_ports,
                exclude_listener_prefixes: self.exclude_listener_prefixes,
                timeline: shutdown.timeline,
                handover_timeout: shutdown.handover_timeout,
                app_hold: shutdown.app_hold,
            },
            status_address: self.status_address,
            app_probes,
            status_address_file: self.status_address_file,
            app_metrics,
            grpc_address: grpc_address.unwrap_or_else(client::default_address),
            grpc_allow_remote: self.grpc_allow_remote,
            control_allow_uids: self.control_allow_uids,
            telemetry: TelemetrySettings {
                otlp_endpoint: self.otlp_endpoint,
                export_interval: self.otlp_export_interval,
            },
            hot_restart,
            crash_recovery,
            shutdown_budget: shutdown.budget,
            termination_message: crate::termination::MessageFile::from_flag(
                self.termination_message_path,
            ),
        })
    }

    /// Refuses what the family could not run with before anything is made on disk: the
    /// hot-restart crate's check ([`envoy_agent_hotrestart::check`]).
    fn check_hot_restart(&self, hot: &HotRestartSettings) -> Result<(), SettingsError> {
        Ok(envoy_agent_hotrestart::check(
            self.drain_time,
            hot.parent_shutdown_time,
            hot.base_id,
            hot.options.cold_base_id,
        )?)
    }

    /// The shutdown's shape: `--shutdown-budget` split among its phases (when given), the
    /// drain and handover times that follow from it or from their flags, and the timeline
    /// fitted to them.
    fn shutdown(
        &self,
        hot_restart: Option<&HotRestartSettings>,
        exit_on_zero: Option<Counting>,
    ) -> Result<Shutdown, SettingsError> {
        let budget = match self.shutdown_budget {
            Some(budget) => Some(crate::config::budget::split(
                budget,
                crate::config::budget::Phases {
                    drain_delay: self.drain_delay,
                    termination_drain_duration: self.termination_drain_duration,
                    exit_on_zero_minimum: exit_on_zero.map(|_| self.minimum_drain_duration),
                    stop_grace: self.stop_grace,
                    exit: crate::SHUTDOWN_GRACE,
                    handover: hot_restart.map(|h| h.parent_shutdown_time),
                },
            )?),
            None => None,
        };
        // A successor pod runs the same command line, so its handoff deadline and parent
        // shutdown time are ours (in sidecar mode, which has no successor pod, their defaults).
        let handover_timeout = match budget.as_ref().and_then(|split| split.handover) {
            Some(share) => share,
            None => {
                let (handoff, parent_shutdown) = match hot_restart {
                    Some(hot) => (hot.options.handoff_deadline, hot.parent_shutdown_time),
                    None => (
                        crate::config::defaults::HANDOFF_DEADLINE,
                        crate::config::defaults::PARENT_SHUTDOWN_TIME,
                    ),
                };
                crate::config::defaults::handover_timeout(handoff, parent_shutdown)
            }
        };
        let termination_drain_duration = match &budget {
            Some(split) => split.drain,
            None => self
                .termination_drain_duration
                .unwrap_or(defaults::TERMINATION_DRAIN_DURATION),
        };
        let app_hold = match (self.app_hold, hot_restart) {
            (Some(AppHold::For(_)), Some(_)) => return Err(SettingsError::AppHoldNodeProxy),
            (_, Some(_)) | (Some(AppHold::Off), None) => None,
            (Some(AppHold::For(d)), None) => Some(d),
            (None, None) => Some(defaults::APP_HOLD),
        };
        // The budget bounds the hold as it bounds the drain: Envoy is stopped by then.
        let app_hold = match (&budget, app_hold) {
            (Some(split), Some(hold)) => Some(hold.min(split.drain_delay + split.drain)),
            (_, hold) => hold,
        };
        let timeline = crate::config::timeline::fit(crate::config::timeline::Steps {
            not_ready: self.not_ready_at,
            fail_health_checks: self.healthcheck_fail_at,
            drain: self.drain_delay,
            drain_deadline: crate::config::timeline::drain_deadline(
                exit_on_zero,
                termination_drain_duration,
                self.minimum_drain_duration,
            ),
            budget: self.shutdown_budget,
        })?;
        Ok(Shutdown {
            budget,
            handover_timeout,
            termination_drain_duration,
            timeline,
            app_hold,
        })
    }

    /// Envoy's settings: how it is started, run and stopped.
    fn envoy_settings(&self, hot_restart: bool) -> EnvoySettings {
        EnvoySettings {
            config_path: self.config_path.clone(),
            envoy_path: self.envoy_path.clone(),
            admin_address: self.admin_address,
            admin: match self.envoy_admin {
                EnvoyAdminArg::Socket => EnvoyAdmin::Socket,
                EnvoyAdminArg::Bootstrap => EnvoyAdmin::Bootstrap,
                EnvoyAdminArg::Auto if hot_restart && self.admin_address.is_none() => {
                    EnvoyAdmin::Socket
                }
                EnvoyAdminArg::Auto => EnvoyAdmin::Bootstrap,
            },
            options: EnvoyOptions {
                log_level: self.proxy_log_level.clone(),
                component_log_level: self.proxy_component_log_level.clone(),
                log_as_json: self.proxy_log_as_json,
                node_ips: self.node_ips.clone(),
                concurrency: self.concurrency,
                drain_time: self.drain_time,
                drain_strategy: match self.drain_strategy {
                    DrainStrategyArg::Immediate => DrainStrategy::Immediate,
                    DrainStrategyArg::Gradual => DrainStrategy::Gradual,
                },
                drain_listeners: if self.drain_all_listeners {
                    Scope::All
                } else {
                    self.drain_listeners.scope()
                },
                outlier_log_path: self.outlier_log_path.clone(),
                file_flush_interval: self.file_flush_interval,
                config_cleanup: self.config_cleanup,
                // The parser requires each of the two with the other.
                run_as: self
                    .run_as_uid
                    .zip(self.run_as_gid)
                    .map(|(uid, gid)| RunAs { uid, gid }),
                stop_grace: self.stop_grace,
                admin_unresponsive_deadline: self.admin_unresponsive_deadline,
            },
            memory_guard: self.memory_guard,
            memory_guard_thresholds: self.memory_guard_thresholds,
            max_downstream_connections: self.max_downstream_connections,
            drain_notice: self.drain_notice == Switch::On,
            extra_args: self.envoy_args.clone(),
        }
    }

    /// The app probes: `--app-probers` (or its variable) wins over Istio's variable.
    /// The app's metrics: `--app-metrics-url` (empty: off), else Istio's annotations.
    fn app_metrics(&self) -> Result<Option<crate::status::app_metrics::Target>, SettingsError> {
        match (&self.app_metrics_url, &self.istio_prometheus_annotations) {
            (Some(flag), _) => Ok(flag.0.clone()),
            (None, Some(json)) => Ok(crate::status::app_metrics::from_istio_annotations(json)?),
            (None, None) => Ok(None),
        }
    }

    fn app_probes(&self) -> Result<AppProbes, SettingsError> {
        let (json, input) = match (&self.app_probers, &self.istio_kube_app_probers) {
            (Some(json), _) => (json, app_probe::Input::Flag),
            (None, Some(json)) => (json, app_probe::Input::Istio),
            (None, None) => return Ok(AppProbes::default()),
        };
        Ok(AppProbes::parse(json, input)?)
    }

    /// Hot restart's settings, `None` without `--hot-restart`.
    fn hot_restart(&self) -> Result<Option<HotRestartSettings>, SettingsError> {
        if !self.hot_restart {
            return Ok(None);
        }
        let state_dir = self
            .state_dir
            .clone()
            .ok_or(SettingsError::MissingStateDir)?;
        let base_id = self.base_id.ok_or(SettingsError::MissingBaseId)?;
        Ok(Some(HotRestartSettings {
            base_id,
            options: FamilyOptions {
                watch_config: self.watch_config,
                ready_marker: self.ready_marker.clone(),
                // A later agent starts later: the fallback order when the pods do not say.
                generation: self.pod_generation.unwrap_or_else(|| {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_millis() as u64)
                }),
                handoff_deadline: self.handoff_deadline.unwrap_or(defaults::HANDOFF_DEADLINE),
                cold_base_id: match (self.no_cold_handover, self.cold_base_id) {
                    (true, _) => None,
                    (false, Some(cold)) => Some(cold),
                    // The last base id has no next one: no cold handover then.
                    (false, None) => base_id.checked_add(1),
                },
            },
            allow_abstract_socket: self.allow_abstract_hot_restart_socket,
            parent_shutdown_time: self
                .parent_shutdown_time
                .unwrap_or(defaults::PARENT_SHUTDOWN_TIME),
            state_dir,
            identity: self.identity.clone(),
        }))
    }

    /// Crash recovery's settings, `None` without `--restart-on-crash`.
    fn crash_recovery(&self) -> Option<CrashRecovery> {
        self.restart_on_crash.then(|| CrashRecovery {
            limit: self
                .crash_restart_limit
                .unwrap_or(defaults::CRASH_RESTART_LIMIT),
            backoff_max: self
                .crash_backoff_max
                .unwrap_or(defaults::CRASH_BACKOFF_MAX),
            ..CrashRecovery::default()
        })
    }

    /// What exit-on-zero counts, from --exit-on-zero and --exit-on-zero-active-connections
    /// (the same as `--exit-on-zero connections`); none when off. Err when they disagree.
    pub fn exit_on_zero(&self) -> Result<Option<Counting>, ExitOnZeroConflict> {
        match (self.exit_on_zero, self.exit_on_zero_active_connections) {
            (Some(ExitOnZeroArg::Requests), true) => Err(ExitOnZeroConflict),
            (Some(ExitOnZeroArg::Requests), false) => Ok(Some(Counting::Requests)),
            (Some(ExitOnZeroArg::Connections), _) | (None, true) => Ok(Some(Counting::Connections)),
            (None, false) => Ok(None),
        }
    }
}

/// The shutdown's shape that the flags give, for [`RunArgs::into_settings`].
struct Shutdown {
    /// `--shutdown-budget` split among the phases, when given.
    budget: Option<crate::config::budget::Split>,
    /// How long a stopping agent waits for a successor pod's Envoy to terminate its own.
    handover_timeout: Duration,
    /// How long the drain may last: the budget's share, else the flag or its default.
    termination_drain_duration: Duration,
    /// When each step of the shutdown happens.
    timeline: crate::config::timeline::Timeline,
    /// A sidecar's app rule's bound; none: off.
    app_hold: Option<Duration>,
}

/// `run`'s flags that parse one by one but cannot work together: refused before anything
/// starts, naming the flags.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// Exit-on-zero was asked to count two different things.
    #[error(transparent)]
    ExitOnZero(#[from] ExitOnZeroConflict),
    /// Hot restart needs the per-node state directory.
    #[error(
        "--hot-restart needs --state-dir (the per-node directory shared by the agents of a node)"
    )]
    MissingStateDir,
    /// Hot restart needs the family's base id.
    #[error("--hot-restart needs --base-id (Envoy's --base-id, which names the family)")]
    MissingBaseId,
    /// The hot-restart settings cannot work (a parent-shutdown time not past the drain time).
    #[error(transparent)]
    HotRestart(#[from] envoy_agent_hotrestart::ConfigError),
    /// A configured phase of the shutdown does not fit `--shutdown-budget`.
    #[error(transparent)]
    Budget(#[from] crate::config::budget::BudgetError),
    /// A step of the shutdown's timeline comes after Envoy's latest stop.
    #[error(transparent)]
    Timeline(#[from] crate::config::timeline::TimelineError),
    /// `--app-hold` with `--hot-restart`: a node proxy has no app beside it.
    #[error(
        "--app-hold is a sidecar's (the app beside Envoy): a node proxy (--hot-restart) has none"
    )]
    AppHoldNodeProxy,
    /// The app probes' JSON cannot be used.
    #[error(transparent)]
    AppProbes(#[from] app_probe::ConfigError),
    /// `ISTIO_PROMETHEUS_ANNOTATIONS` that names no app metrics endpoint.
    #[error(transparent)]
    AppMetrics(#[from] crate::status::app_metrics::IstioAnnotationsError),
}

impl SettingsError {
    /// The exit code: [`exit_code::USAGE`], since only another command line (or environment)
    /// gets past it.
    pub fn exit_code(&self) -> u8 {
        exit_code::USAGE
    }
}

/// `--exit-on-zero requests` with `--exit-on-zero-active-connections`: two different counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "--exit-on-zero requests and --exit-on-zero-active-connections (or their environment \
     variables) ask for different counts: keep one"
)]
pub struct ExitOnZeroConflict;

/// The flag reference of every subcommand as Markdown, generated from the CLI definition
/// itself so it cannot drift (`docs/flags.md` is this text; a test keeps it current).
pub fn flag_reference() -> String {
    use clap::CommandFactory;
    let cli = Cli::command();
    let mut out = String::from(
        "# Flag reference\n\nGenerated from `envoy-agent`'s own CLI definition; do not edit \
         (`UPDATE_FLAG_DOCS=1 cargo test -p envoy-agent --test e2e flag_reference` rewrites it). \
         Every flag can also be set with the environment variable shown.\n",
    );
    let mut commands: Vec<&clap::Command> = vec![&cli];
    commands.extend(cli.get_subcommands());
    for command in commands {
        let name = if command.get_name() == cli.get_name() {
            "envoy-agent (every subcommand)".to_owned()
        } else {
            format!("envoy-agent {}", command.get_name())
        };
        out.push_str(&format!("\n## {name}\n\n"));
        if let Some(about) = command.get_about() {
            out.push_str(&format!("{about}\n\n"));
        }
        let args: Vec<&clap::Arg> = command
            .get_arguments()
            .filter(|a| a.get_long().is_some() && !a.is_hide_set())
            .filter(|a| command.get_name() == cli.get_name() || !a.is_global_set())
            .collect();
        if args.is_empty() {
            out.push_str("No flags of its own.\n");
            continue;
        }
        out.push_str("| flag | environment | default | meaning |\n|---|---|---|---|\n");
        for arg in args {
            let long = arg.get_long().unwrap_or_default();
            let env = arg
                .get_env()
                .map(|e| format!("`{}`", e.to_string_lossy()))
                .unwrap_or_default();
            let default = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(",");
            let default = if default.is_empty() {
                String::new()
            } else {
                format!("`{default}`")
            };
            let help = arg
                .get_long_help()
                .or(arg.get_help())
                .map(|h| h.to_string().replace('\n', " ").replace('|', "\\|"))
                .unwrap_or_default();
            let flag = match arg.get_short() {
                Some(short) => format!("`-{short}`, `--{long}`"),
                None => format!("`--{long}`"),
            };
            out.push_str(&format!("| {flag} | {env} | {default} | {help} |\n"));
        }
    }
    out
}

/// The shell completion script for `shell`.
pub fn completions(shell: clap_complete::Shell) -> Vec<u8> {
    use clap::CommandFactory;
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "envoy-agent", &mut out);
    out
}

/// The man page (`docs/envoy-agent.1`, roff), generated from the CLI definition like
/// [`flag_reference`]: the global options, the list of subcommands, then one section per
/// subcommand with its synopsis, description and own options (one page: `man envoy-agent`).
pub fn man_page() -> Result<Vec<u8>, std::io::Error> {
    use clap::CommandFactory;
    let mut cli = Cli::command();
    // Built: subcommands get their global options and their full names ("envoy-agent run").
    cli.build();
    let subcommands: Vec<&clap::Command> = cli
        .get_subcommands()
        .filter(|s| s.get_name() != "help")
        .collect();
    let man = clap_mangen::Man::new(cli.clone());
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    man.render_options_section(&mut out)?;
    // clap_mangen's own list points at a page per subcommand; they are sections of this one.
    out.extend_from_slice(b".SH SUBCOMMANDS\n");
    for sub in &subcommands {
        let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
        out.extend_from_slice(
            format!(
                ".TP\n\\fBenvoy\\-agent {}\\fR\n{}\n",
                roff_escape(sub.get_name()),
                roff_escape(&about)
            )
            .as_bytes(),
        );
    }
    let globals: Vec<clap::Id> = cli
        .get_arguments()
        .filter(|a| a.is_global_set())
        .map(|a| a.get_id().clone())
        .collect();
    for sub in subcommands {
        // Shown once, in the main OPTIONS section.
        let sub = globals
            .iter()
            .fold(sub.clone(), |c, id| c.mut_arg(id.clone(), |a| a.hide(true)));
        out.extend_from_slice(
            format!(".SH \"ENVOY-AGENT {}\"\n", sub.get_name().to_uppercase()).as_bytes(),
        );
        let man = clap_mangen::Man::new(sub.clone());
        let mut section = Vec::new();
        man.render_synopsis_section(&mut section)?;
        man.render_description_section(&mut section)?;
        if sub.get_arguments().any(|a| !a.is_hide_set()) {
            man.render_options_section(&mut section)?;
        }
        // Each part comes with its own .SH heading: a paragraph break under this section's.
        let mut first = true;
        for line in String::from_utf8_lossy(&section).lines() {
            if line.starts_with(".SH ") {
                if !std::mem::take(&mut first) {
                    out.extend_from_slice(b".PP\n");
                }
                continue;
            }
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
        }
    }
    man.render_version_section(&mut out)?;
    Ok(out)
}

/// Text as roff reads it literally: backslashes and hyphens escaped, no control line.
fn roff_escape(text: &str) -> String {
    let escaped = text.replace('\\', "\\e").replace('-', "\\-");
    if escaped.starts_with('.') || escaped.starts_with('\'') {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn completions_and_the_man_page_cover_the_subcommands() {
        let bash = String::from_utf8(completions(clap_complete::Shell::Bash)).unwrap();
        for sub in ["run", "status", "stop", "reopen-logs", "completions"] {
            assert!(bash.contains(sub), "bash completions lack {sub}");
        }
        assert!(bash.contains("--termination-drain-duration"));
        let man = String::from_utf8(man_page().unwrap()).unwrap();
        assert!(man.contains("\n.TH envoy-agent 1 "), "{}", &man[..80]);
        assert!(man.contains(".SH \"ENVOY-AGENT RUN\""), "{man}");
        assert!(man.contains("termination\\-drain\\-duration"), "{man}");
        assert!(man.contains(".SH \"ENVOY-AGENT REOPEN-LOGS\""), "{man}");
    }

    #[test]
    fn run_parses_extra_envoy_args() {
        let cli = Cli::try_parse_from([
            "envoy-agent",
            "run",
            "-c",
            "b.yaml",
            "--",
            "--service-cluster",
            "x",
        ])
        .unwrap();
        let Command::Run(run) = cli.command else {
            panic!("run expected");
        };
        assert_eq!(run.config_path, PathBuf::from("b.yaml"));
        assert_eq!(run.envoy_args, ["--service-cluster", "x"]);
    }

    fn run_args(args: &[&str]) -> RunArgs {
        let cli =
            Cli::try_parse_from(["envoy-agent", "run", "-c", "b.yaml"].iter().chain(args)).unwrap();
        let Command::Run(run) = cli.command else {
            panic!("run expected");
        };
        *run
    }

    #[test]
    fn exit_on_zero_counts_connections_by_either_flag_and_requests_by_one() {
        let counting = |args: &[&str]| run_args(args).exit_on_zero();
        assert_eq!(counting(&[]), Ok(None));
        let connections = Ok(Some(Counting::Connections));
        assert_eq!(
            counting(&["--exit-on-zero-active-connections"]),
            connections
        );
        assert_eq!(counting(&["--exit-on-zero", "connections"]), connections);
        assert_eq!(
            counting(&[
                "--exit-on-zero=connections",
                "--exit-on-zero-active-connections"
            ]),
            connections
        );
        assert_eq!(
            counting(&["--exit-on-zero=requests"]),
            Ok(Some(Counting::Requests))
        );
        assert_eq!(
            counting(&[
                "--exit-on-zero=requests",
                "--exit-on-zero-active-connections"
            ]),
            Err(ExitOnZeroConflict)
        );
    }

    #[test]
    fn client_subcommands_become_calls() {
        let call = |args: &[&str]| {
            let cli = Cli::try_parse_from(["envoy-agent"].iter().chain(args)).unwrap();
            let Command::Client(command) = cli.command else {
                panic!("a client subcommand expected");
            };
            client::Call::from(command)
        };
        assert_eq!(
            call(&["drain", "--all-listeners"]),
            client::Call::Drain {
                skip_exit: false,
                listeners: Some(Scope::All)
            }
        );
        assert_eq!(
            call(&["update-config", "new.yaml"]),
            client::Call::UpdateConfig {
                file: PathBuf::from("new.yaml"),
                reason: "envoy-agent update-config".to_owned()
            }
        );
        assert_eq!(
            call(&["status", "--json"]),
            client::Call::Status { json: true }
        );
        assert_eq!(
            call(&["admin", "get", "/stats?filter=%5Ehttp"]),
            client::Call::Admin {
                path: "/stats?filter=%5Ehttp".to_owned()
            }
        );
        assert_eq!(
            call(&["log-level", "info,upstream:debug"]),
            client::Call::LogLevel {
                level: "info,upstream:debug".to_owned()
            }
        );
        for refused in [
            &["admin", "POST", "/quitquitquit"][..],
            &["log-level", "loud"],
            &["log-level", "a:b:c"],
        ] {
            let err = Cli::try_parse_from(["envoy-agent"].iter().chain(refused)).unwrap_err();
            assert!(err.use_stderr(), "{refused:?}: a usage error (exit 64)");
        }
    }

    fn settings(args: &[&str]) -> Result<Settings, SettingsError> {
        let grpc = "unix:/run/test/grpc.sock".parse().ok();
        run_args(args).into_settings(grpc)
    }

    const HOT: [&str; 5] = ["--hot-restart", "--base-id", "7", "--state-dir", "/st"];

    #[test]
    fn settings_take_the_flags_and_the_defaults_of_their_mode() {
        let sidecar = settings(&[
            "--drain-strategy",
            "gradual",
            "--run-as-uid",
            "1",
            "--run-as-gid",
            "2",
        ])
        .unwrap();
        assert_eq!(sidecar.envoy.config_path, PathBuf::from("b.yaml"));
        assert_eq!(sidecar.envoy.options.drain_strategy, DrainStrategy::Gradual);
        assert_eq!(sidecar.envoy.options.run_as, Some(RunAs { uid: 1, gid: 2 }));
        assert_eq!(
            sidecar.grpc_address,
            "unix:/run/test/grpc.sock".parse().unwrap()
        );
        assert_eq!(sidecar.drain.exit_on_zero, None);
        assert_eq!(sidecar.hot_restart, None);
        assert_eq!(sidecar.crash_recovery, None);
        assert_eq!(
            sidecar.envoy.options.admin_unresponsive_deadline,
            Duration::from_secs(30),
            "the wedge watchdog runs in both modes"
        );

        let hot = settings(&HOT).unwrap().hot_restart.unwrap();
        assert_eq!(hot.base_id, 7);
        assert_eq!(hot.options.cold_base_id, Some(8));
        assert_eq!(hot.state_dir, PathBuf::from("/st"));
        assert_eq!(hot.parent_shutdown_time, defaults::PARENT_SHUTDOWN_TIME);
        assert_eq!(hot.options.handoff_deadline, defaults::HANDOFF_DEADLINE);

        let cold = |extra: &[&str]| {
            let args: Vec<&str> = HOT.iter().chain(extra).copied().collect();
            settings(&args)
                .unwrap()
                .hot_restart
                .unwrap()
                .options
                .cold_base_id
        };
        assert_eq!(cold(&["--cold-base-id", "100"]), Some(100));
        assert_eq!(cold(&["--no-cold-handover"]), None);
        let last = [
            "--hot-restart",
            "--base-id",
            "4294967295",
            "--state-dir",
            "/st",
        ];
        assert_eq!(
            settings(&last)
                .unwrap()
                .hot_restart
                .unwrap()
                .options
                .cold_base_id,
            None
        );

        let crash = settings(&["--restart-on-crash", "--crash-restart-limit", "2"]).unwrap();
        let crash = crash.crash_recovery.unwrap();
        assert_eq!(
            (crash.limit, crash.backoff_max),
            (2, defaults::CRASH_BACKOFF_MAX)
        );
    }

    #[test]
    fn the_flags_defaults_are_the_settings_defaults() {
        use crate::config::defaults;
        // One table: what a run without flags gets is `defaults`, and the agent's
        // view of it is `AgentConfig::default()`.
        let none = settings(&[]).unwrap();
        assert_eq!(
            none.drain.termination_drain_duration,
            defaults::TERMINATION_DRAIN_DURATION
        );
        assert_eq!(
            none.drain.minimum_drain_duration,
            defaults::MINIMUM_DRAIN_DURATION
        );
        assert_eq!(none.drain.poll_interval, defaults::DRAIN_POLL_INTERVAL);
        assert_eq!(
            none.drain.exclude_listener_ports,
            defaults::EXCLUDED_LISTENER_PORTS
        );
        assert_eq!(
            none.drain.handover_timeout,
            defaults::handover_timeout(defaults::HANDOFF_DEADLINE, defaults::PARENT_SHUTDOWN_TIME)
        );
        // `--healthcheck-fail-at drain` comes resolved by the timeline: the drain's offset
        // (the drain delay, none by default).
        let expected = crate::AgentConfig {
            fail_health_checks_at: crate::config::timeline::HealthCheckFailAt::After(
                Duration::ZERO,
            ),
            ..crate::AgentConfig::default()
        };
        assert_eq!(
            format!("{:?}", crate::agent_config(&none)),
            format!("{expected:?}"),
            "AgentConfig is a view of the settings"
        );
        // The budget is applied once, in the settings: the agent's view only copies it.
        let budgeted = settings(&[
            "--shutdown-budget",
            "90s",
            "--hot-restart",
            "--base-id",
            "3",
            "--state-dir",
            "/tmp/x",
        ])
        .unwrap();
        let split = budgeted.shutdown_budget.unwrap();
        assert_eq!(Some(budgeted.drain.handover_timeout), split.handover);
        assert_eq!(
            crate::agent_config(&budgeted).handover_timeout,
            budgeted.drain.handover_timeout
        );
        assert_eq!(
            crate::agent_config(&budgeted).termination_drain_duration,
            split.drain
        );
    }

    #[test]
    fn the_timeline_and_the_termination_message_take_their_flags() {
        use crate::config::timeline::Timeline;
        let defaults = settings(&[]).unwrap();
        assert_eq!(defaults.drain.timeline, Timeline::default());
        assert!(
            !defaults.termination_message.creates(),
            "the kubelet's file"
        );
        let given = settings(&[
            "--drain-delay",
            "2s",
            "--not-ready-at",
            "4s",
            "--healthcheck-fail-at",
            "off",
            "--termination-message-path",
            "/tmp/message",
        ])
        .unwrap();
        assert_eq!(
            given.drain.timeline,
            Timeline {
                not_ready: Duration::from_secs(4),
                fail_health_checks: None,
                drain: Duration::from_secs(2),
                stop_by: Some(Duration::from_secs(7)),
            }
        );
        assert!(given.termination_message.creates());
        let err = settings(&["--healthcheck-fail-at", "6s"]).unwrap_err();
        assert!(matches!(err, SettingsError::Timeline(_)), "{err}");
        assert_eq!(err.exit_code(), exit_code::USAGE);
    }

    #[test]
    fn flags_that_cannot_work_together_are_refused_naming_them() {
        let err = settings(&[
            "--exit-on-zero=requests",
            "--exit-on-zero-active-connections",
        ])
        .unwrap_err();
        assert!(matches!(err, SettingsError::ExitOnZero(_)), "{err}");
        // Whole seconds, as Envoy gets them; the default parent-shutdown time counts too.
        for drain in ["2s", "60s"] {
            let mut args = HOT.to_vec();
            args.extend(["--drain-time", drain]);
            if drain == "2s" {
                args.extend(["--parent-shutdown-time", "2s"]);
            }
            let err = settings(&args).unwrap_err();
            assert!(
                err.to_string().contains("must exceed --drain-time"),
                "{err}"
            );
            assert_eq!(err.exit_code(), exit_code::USAGE);
        }
        let mut args = HOT.to_vec();
        args.extend(["--drain-time", "59s"]);
        assert!(settings(&args).is_ok());
        // Refused here, before anything is made on disk (it was refused only once the
        // runtime and state directories were made, and left them behind).
        let base_id = settings(&HOT)
            .unwrap()
            .hot_restart
            .unwrap()
            .base_id
            .to_string();
        let mut args = HOT.to_vec();
        args.extend(["--cold-base-id", &base_id]);
        let err = settings(&args).unwrap_err();
        assert!(
            matches!(
                err,
                SettingsError::HotRestart(envoy_agent_hotrestart::ConfigError::ColdBaseIdSame(_))
            ),
            "{err}"
        );
        assert_eq!(err.exit_code(), exit_code::USAGE);
    }
}

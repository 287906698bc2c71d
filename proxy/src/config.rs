//! What the agent knows about the Envoy it runs: Istio's `ProxyConfig` plus the hot-restart
//! fields. Plain data; [`crate::args::envoy_args`] turns it into a command line.

use std::path::PathBuf;
use std::time::Duration;

use crate::socket_path::SocketPath;

/// How Envoy closes connections once a drain starts (`--drain-strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DrainStrategy {
    /// Every connection is told to close at drain start. Istio's fixed choice.
    #[default]
    Immediate,
    /// Connections are told to close with a probability rising over the drain time.
    Gradual,
}

impl DrainStrategy {
    /// The value Envoy's `--drain-strategy` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            DrainStrategy::Immediate => "immediate",
            DrainStrategy::Gradual => "gradual",
        }
    }
}

/// Hot-restart settings. `None` in [`ProxyConfig::hot_restart`] means hot restart is off and
/// Envoy runs with `--disable-hot-restart` (no shared memory, no domain sockets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotRestart {
    /// `--base-id`: names the shared memory and domain sockets of one Envoy family. Must stay
    /// the same across epochs and differ between families on one host.
    pub base_id: u32,
    /// `--parent-shutdown-time-s`: when a new epoch terminates its parent. Must exceed the drain
    /// duration, or connections are cut before they drain.
    pub parent_shutdown_time: Duration,
    /// A private directory where each epoch writes its admin address (`--admin-address-path`,
    /// `admin-address.<epoch>`) the moment its admin listener is bound: a child binds it only
    /// after its parent gave it up, a few milliseconds before LIVE, so the file's arrival tells
    /// the supervisor when to look closely. `None`: no such hint (the supervisor polls on).
    pub admin_address_dir: Option<PathBuf>,
    /// A cold handover's new family, started while the old one still holds the configured
    /// admin port: its admin listens on an ephemeral port of the configured address (an
    /// overlay) and Envoy writes the address it bound to this file. `None`: the configured
    /// address (every hot-restart epoch, which takes the admin port over from its parent).
    pub ephemeral_admin: Option<PathBuf>,
    /// Where the family's hot-restart channel lives (`--socket-path`).
    pub socket_path: SocketPath,
}

/// A uid/gid Envoy runs as when the agent itself runs as root (Istio runs Envoy as 1337).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    /// User id for Envoy.
    pub uid: u32,
    /// Group id for Envoy.
    pub gid: u32,
}

/// Where the agent reaches Envoy's admin API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminAddress {
    /// A fixed address, known before Envoy starts (the bootstrap's, or `--admin-address`).
    Fixed(crate::admin::Address),
    /// The bootstrap asks for port 0: Envoy writes the bound address to this file
    /// (`--admin-address-path`) and the agent reads it once Envoy has started.
    FromFile(PathBuf),
    /// The agent's own Unix socket (`--envoy-admin socket`): every Envoy it starts gets its
    /// admin here, whatever the bootstrap says (an overlay, `admin.address.pipe` with mode
    /// 0600), in a directory only the agent's user (and Envoy's) can enter.
    Socket(PathBuf),
}

impl AdminAddress {
    /// The address, when it is known before Envoy starts.
    pub fn known(&self) -> Option<crate::admin::Address> {
        match self {
            AdminAddress::Fixed(addr) => Some(addr.clone()),
            AdminAddress::Socket(path) => Some(crate::admin::Address::Unix(path.clone())),
            AdminAddress::FromFile(_) => None,
        }
    }
}

/// Where a cold handover's new family, on `base_id`, puts its admin socket while the old family
/// still holds `configured`: beside it, `<configured>.<base id>`. Each family of a node has its
/// own base id, so no two families share it.
pub fn ephemeral_socket(configured: &std::path::Path, base_id: u32) -> PathBuf {
    let mut path = configured.as_os_str().to_owned();
    path.push(format!(".{base_id}"));
    PathBuf::from(path)
}

/// What the operator says of how Envoy runs: each value under its flag's name, built once from
/// the command line (the agent's `RunArgs::into_settings`) and carried as it is into every
/// [`ProxyConfig`]. What only the machine can say (the binary found on `PATH`, the admin address
/// the bootstrap gives, the hot-restart channel, the container's limits) is [`ProxyConfig`]'s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyOptions {
    /// `--proxy-log-level`: Envoy's log level string, Istio style: `info`, or
    /// `warning,upstream:debug,http:trace`. A token without `:` is the global level (last
    /// wins); `component:level` tokens become `--component-log-level`.
    pub log_level: String,
    /// `--proxy-component-log-level`: component levels (`a:b,c:d`) used when `log_level` names none
    /// (Istio's deprecated flag).
    pub component_log_level: String,
    /// `--proxy-log-as-json`: Envoy's own log lines as JSON (`--log-format`).
    pub log_as_json: bool,
    /// `--node-ip`: the node's IP addresses: Envoy gets `--local-address-ip-version v6` only
    /// when every parseable one is IPv6.
    pub node_ips: Vec<String>,
    /// `--concurrency`, when above 0 (at start, the container's CPU quota may set it). Keep it
    /// constant across hot restarts.
    pub concurrency: u32,
    /// `--drain-time` (Envoy's `--drain-time-s`): how long a drain (shutdown or hot-restart
    /// parent) lasts.
    pub drain_time: Duration,
    /// `--drain-strategy`: how connections are closed during a drain.
    pub drain_strategy: DrainStrategy,
    /// `--drain-listeners`: which listeners a drain reaches when the caller does not say.
    pub drain_listeners: crate::listeners::Scope,
    /// `--outlier-log-path`: the outlier-detection event log file, passed as a bootstrap
    /// overlay (`--config-yaml`).
    pub outlier_log_path: Option<PathBuf>,
    /// `--file-flush-interval` (Envoy's `--file-flush-interval-msec`; Istio's default 1s,
    /// Envoy's own 10s).
    pub file_flush_interval: Duration,
    /// `--config-cleanup`: delete the bootstrap file when Envoy has exited (for generated
    /// bootstraps).
    pub config_cleanup: bool,
    /// `--run-as-uid`, `--run-as-gid`: the uid/gid Envoy runs as when the agent is root.
    pub run_as: Option<RunAs>,
    /// `--stop-grace`: how long a stopping Envoy gets between SIGTERM and SIGKILL.
    pub stop_grace: Duration,
    /// `--admin-unresponsive-deadline`: how long the serving Envoy's admin API may stay silent
    /// before it is judged wedged (and killed); readiness turns off sooner (see
    /// [`crate::watchdog`]).
    pub admin_unresponsive_deadline: Duration,
}

impl Default for EnvoyOptions {
    /// Istio's defaults.
    fn default() -> Self {
        EnvoyOptions {
            log_level: "warning".to_owned(),
            component_log_level: String::new(),
            log_as_json: false,
            node_ips: Vec::new(),
            concurrency: 0,
            drain_time: Duration::from_secs(45),
            drain_strategy: DrainStrategy::Immediate,
            drain_listeners: crate::listeners::Scope::Auto,
            outlier_log_path: None,
            file_flush_interval: Duration::from_secs(1),
            config_cleanup: false,
            run_as: None,
            stop_grace: Duration::from_secs(5),
            admin_unresponsive_deadline: Duration::from_secs(30),
        }
    }
}

/// Everything needed to start Envoy: the operator's [`EnvoyOptions`] and what the agent found
/// out before the start. Mirrors Istio's `ProxyConfig`, plus the restart-epoch machinery Istio
/// removed.
#[derive(Debug, Clone, PartialEq)]
pub struct ProxyConfig {
    /// What the operator said of how Envoy runs.
    pub options: EnvoyOptions,
    /// The level set at run time (`envoy-agent log-level`), shared by every clone of this
    /// config: when set, every Envoy started from then on gets it instead of the options'.
    pub log_level_set: crate::log_level::LogLevelCell,
    /// A sidecar (one Envoy): its drains reach its inbound listeners by default; a node
    /// proxy's reach every listener (see [`crate::listeners::plan`]).
    pub sidecar: bool,
    /// Where each Envoy's drain-notice file lives ([`crate::drain_notice`]); `None`: no
    /// notice through Envoy's overload manager.
    pub drain_notice: Option<PathBuf>,
    /// The Envoy binary.
    pub binary_path: PathBuf,
    /// The bootstrap file (`-c`).
    pub config_path: PathBuf,
    /// Envoy's admin API.
    pub admin: AdminAddress,
    /// `--file-flush-min-size-kb`, when above 0.
    pub file_flush_min_size_kb: u32,
    /// `--skip-deprecated-logs`.
    pub skip_deprecated_logs: bool,
    /// `--enable-core-dump`.
    pub enable_core_dump: bool,
    /// Whether the agent runs as root; `options.run_as` applies only then.
    pub agent_is_root: bool,
    /// Hot restart, or `None` for `--disable-hot-restart`.
    pub hot_restart: Option<HotRestart>,
    /// Appended verbatim after everything else.
    pub extra_args: Vec<String>,
    /// Envoy sheds load before its container's memory limit ([`crate::overload`]); none: off,
    /// no limit found, or the bootstrap's overload manager already has its parts.
    pub memory_guard: Option<crate::overload::MemoryGuard>,
    /// The bound on Envoy's downstream connections ([`crate::overload::connections_for`]);
    /// none: off, or the operator's own.
    pub max_downstream_connections: Option<u64>,
}

impl ProxyConfig {
    /// A config with Istio's defaults for everything but the two paths and the admin address.
    pub fn new(binary_path: PathBuf, config_path: PathBuf, admin: AdminAddress) -> Self {
        ProxyConfig {
            options: EnvoyOptions::default(),
            log_level_set: crate::log_level::LogLevelCell::default(),
            sidecar: true,
            drain_notice: None,
            binary_path,
            config_path,
            admin,
            file_flush_min_size_kb: 0,
            skip_deprecated_logs: true,
            enable_core_dump: false,
            agent_is_root: false,
            hot_restart: None,
            extra_args: Vec::new(),
            memory_guard: None,
            max_downstream_connections: None,
        }
    }
}

//! The proxy an agent runs: the [`Proxy`] trait and [`Envoy`], its implementation for one
//! real Envoy process, plus what it takes to talk to Envoy ([`AdminClient`]), to start it
//! ([`envoy_args`], [`EnvoyProcess`]) and to change its config ([`validate_candidate`],
//! [`write_atomically`]). The hot-restart family of epochs is the other implementation (in the
//! `hotrestart` crate); both publish the same typed [`ProxyState`].
//!
//! # Theory of operation
//!
//! - **Starting.** [`Proxy::run`] builds Envoy's command line with the pure function
//!   [`envoy_args`] and hands the command to one dedicated, never-ending thread that forks it
//!   (Envoy's `PR_SET_PDEATHSIG` follows the forking *thread*; see `spawner`). Envoy gets its
//!   own process group, so a terminal's Ctrl-C reaches the agent only and the agent decides
//!   what Envoy gets. Envoy's stdout and stderr are pipes the agent always reads and copies
//!   to its own through [`output`], which drops lines rather than wait for a reader that
//!   stopped (an Envoy blocked on a full pipe stops serving); the last few KiB of its stderr
//!   are kept, so an Envoy that refuses its config explains why in [`Exit`].
//! - **Running.** `run` resolves when the proxy cannot serve anymore, and says how
//!   ([`Ended`]). Meanwhile [`Proxy::state`] publishes its phase and epochs: `Starting` until
//!   the admin API says LIVE, `Serving`, then `Exited`. When the bootstrap asks for admin port
//!   0, Envoy writes the bound address to a file and `run` picks it up as soon as it appears.
//! - **Stopping.** Cancelling the `abort` token stops Envoy gracefully: SIGTERM (Envoy
//!   flushes its logs and exits at once, no drain), then SIGKILL to its process group once
//!   [`EnvoyOptions::stop_grace`] has passed. `run` still waits for the exit status, so no
//!   zombie is left. Dropping the `run` future SIGKILLs Envoy (a safety net, not a way to stop
//!   it). [`EnvoyProcess::supervise`] delivers signals only while the process is unreaped, so
//!   a signal never reaches a process that got its pid since.
//! - **Draining** is an admin call ([`Proxy::drain`]); Envoy keeps running. Which listeners it
//!   reaches is decided at each drain from what Envoy reports of them ([`listeners`]), and
//!   idle and streaming clients are told through Envoy's overload manager ([`drain_notice`]).
//!   The policy around it (how long to wait, when to stop) is the agent's.
//! - **Config updates** are validated on a private candidate file first ([`validate_candidate`])
//!   and replace the bootstrap atomically: readers see the old file or the new one, never a
//!   mix, and a rejected config or a failed write leaves the old file in place. Each check
//!   ([`preflight`], [`Candidate`]) runs Envoy and keeps nothing: keeping its verdicts for a
//!   hot restart's pre-flight is the `hotrestart` crate's.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub mod admin;
pub mod args;
pub mod bootstrap;
mod candidate;
pub mod cgroup;
mod config;
mod config_file;
pub mod control_plane;
pub mod drain_notice;
mod envoy;
pub mod listeners;
pub mod log_level;
pub mod output;
pub mod overload;
pub mod preflight;
mod process;
pub mod reaper;
mod socket_path;
pub mod socket_table;
mod spawner;
pub mod state;
mod sys;
pub mod watchdog;

pub use admin::{AdminClient, AdminError, KeptConnection, ServerInfo, ServerState};
pub use args::{EnvoyArgs, RefusedArg, envoy_args, refused_extra_arg};
pub use candidate::{Candidate, validate_candidate};
pub use config::{
    AdminAddress, DrainStrategy, EnvoyOptions, HotRestart, ProxyConfig, RunAs, ephemeral_socket,
};
pub use config_file::{
    MAX_CONFIG_SIZE, read_config, replace_atomically, replace_config, replace_privately,
    write_atomically,
};
pub use control_plane::{
    ConfigNotReady, ConfigStatus, ControlPlane, XdsCounts, XdsReading, XdsType,
};
pub use envoy::Envoy;
pub use listeners::{DrainPlan, PlanNote, Scope};
pub use log_level::{LogLevel, LogLevelCell, LogLevelError};
pub use nix::sys::signal::Signal;
pub use process::{EnvoyProcess, exit_code, read_admin_file, signal_pid, wait_admin_file};
pub use socket_path::SocketPath;
pub use state::{
    AdminHealth, EpochExit, EpochInfo, EpochState, FamilyState, HISTORY_KEPT, Handoff, HandoffKind,
    HandoffResult, HandoffStage, NotReady, Outcome, ProxyPhase, ProxyState, Wedge, WedgeReason,
};

/// Exit code of a proxy that gave up because it was wedged (`EX_TEMPFAIL`: restart me).
pub const EXIT_WEDGED: u8 = 75;

/// What an agent runs: one Envoy, or a hot-restart family of Envoy epochs. Mirrors Istio's
/// `pkg/envoy.Proxy` (run, drain, cleanup, config update), grown where a family needs it: a
/// typed state stream, hot restarts answered with the new epoch or why not, log reopening,
/// and the cross-pod question "is a successor taking over?".
///
/// Every method may be called from any task while [`Proxy::run`] runs; methods that steer the
/// proxy resolve once it has acted on them.
pub trait Proxy: Send + Sync + 'static {
    /// Starts the proxy and resolves when it cannot serve anymore: the serving Envoy exited,
    /// the family gave up, or `abort` was cancelled (then everything is stopped first).
    ///
    /// Once it has resolved it may be called again (never twice at once): a fresh start, as
    /// the first (the agent's crash recovery). State, drain and restart calls apply to the run
    /// under way; between runs nothing serves.
    fn run(
        &self,
        abort: CancellationToken,
    ) -> impl Future<Output = Result<Ended, ProxyError>> + Send;

    /// The proxy's state, now and as it changes.
    fn state(&self) -> watch::Receiver<ProxyState>;

    /// Drains every serving epoch's listeners gracefully; resolves once Envoy accepted it,
    /// with what the drain reached ([`listeners::plan`] decides which listeners).
    /// With `skip_exit` the listeners keep accepting (answers carry `Connection: close`).
    /// A hot-restart family starts no new epoch after a drain.
    fn drain(
        &self,
        options: DrainOptions,
    ) -> impl Future<Output = Result<DrainPlan, ProxyError>> + Send;

    /// Makes every serving Envoy fail its health checks (`POST /healthcheck/fail`): an HTTP
    /// `health_check` filter answers 503 from then on, so a load balancer that checks through
    /// Envoy takes it out. Envoy also starts draining every listener whose `drain_type` is
    /// `DEFAULT` (its listening sockets stay open). Resolves once Envoy accepted it; a
    /// hot-restart family also fails the health checks of an epoch that starts serving later.
    fn fail_health_checks(&self) -> impl Future<Output = Result<(), ProxyError>> + Send;

    /// Tells the serving Envoy's drain notice now, after a drain that left it out
    /// ([`DrainOptions::hold_notice`]). A proxy that never leaves it out has nothing to do.
    fn tell_drain_notice(&self) {}

    /// Hot-restarts; resolves with the new epoch once it is LIVE, or why not.
    fn hot_restart(&self, reason: String)
    -> impl Future<Output = Result<u32, RestartError>> + Send;

    /// Validates `config`, replaces the config file atomically with it and, with hot restart,
    /// restarts onto it. A rejected config changes nothing on disk.
    fn update_config(
        &self,
        config: Vec<u8>,
        reason: String,
    ) -> impl Future<Output = Result<ConfigApplied, ProxyError>> + Send;

    /// Asks every Envoy that can take it to reopen its log files (SIGUSR1); resolves with how
    /// many were signalled.
    fn reopen_logs(&self) -> impl Future<Output = Result<usize, ProxyError>> + Send;

    /// Cross-pod: whether a successor pod is taking over (or took over) from this proxy,
    /// decided from fresh facts; its name if so. A stopping agent then waits to be terminated
    /// by the successor's Envoy instead of draining and stopping its own.
    fn successor(&self) -> impl Future<Output = Option<String>> + Send {
        std::future::ready(None)
    }

    /// Envoy's admin API address, when known (Envoy may pick it at start).
    fn admin_address(&self) -> Option<crate::admin::Address>;

    /// Removes what the proxy left behind once it has exited (generated bootstrap, files).
    fn cleanup(&self);
}

/// Options of a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DrainOptions {
    /// Which listeners: the mode's rule ([`Scope::Auto`]), inbound ones, or all.
    pub listeners: Scope,
    /// Keep the listeners accepting for as long as Envoy runs.
    pub skip_exit: bool,
    /// Leave out the drain notice (`drain_notice`): it reaches every connection manager
    /// Envoy-wide, and a sidecar's app still calls out through its outbound listeners. A proxy
    /// that never serves a sidecar (hot restart) tells it all the same.
    pub hold_notice: bool,
}

/// What an accepted config update did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigApplied {
    /// The new epoch, LIVE on the new config, when the proxy hot-restarted onto it.
    pub restarted_epoch: Option<u32>,
}

/// How [`Proxy::run`] ended.
#[derive(Debug, Clone)]
pub enum Ended {
    /// `abort` was cancelled and everything was stopped (`last`: how the serving Envoy ended).
    Stopped {
        /// The serving Envoy's exit, when it ran.
        last: Option<Exit>,
    },
    /// The serving Envoy exited on its own (crash, kill, Envoy's own `/quitquitquit`).
    Exited(Exit),
    /// With hot restart: the serving Envoy exited while no other epoch serves and no successor
    /// took over (e.g. terminated by another pod's failed epoch). Never a success.
    Lost {
        /// Its exit.
        exit: Exit,
        /// What happened.
        message: String,
    },
    /// The first Envoy never served.
    StartFailed {
        /// Its exit code (1 when it never ran).
        code: i32,
        /// Why, in Envoy's words where there are some.
        message: String,
    },
    /// A watchdog judged the family wedged and stopped it.
    Wedged {
        /// Why.
        reason: WedgeReason,
        /// What happened.
        message: String,
    },
}

impl Ended {
    /// The process exit code: 0 stopped; Envoy's (128+N for signal N); never 0 when lost or
    /// failed to start; [`EXIT_WEDGED`] when wedged.
    pub fn code(&self) -> u8 {
        let nonzero = |code: i32| u8::try_from(code).ok().filter(|c| *c != 0).unwrap_or(1);
        match self {
            Ended::Stopped { .. } => 0,
            Ended::Exited(exit) => u8::try_from(exit.code()).unwrap_or(1),
            Ended::Lost { exit, .. } => nonzero(exit.code()),
            Ended::StartFailed { code, .. } => nonzero(*code),
            Ended::Wedged { .. } => EXIT_WEDGED,
        }
    }
}

/// Why a hot restart did not happen.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum RestartError {
    /// Hot restart is off.
    #[error("hot restart is off (run envoy-agent with --hot-restart)")]
    Unsupported,
    /// Rejected before anything started; the serving epoch keeps serving.
    #[error("hot restart rejected: {0}")]
    Rejected(String),
    /// The new epoch failed; the serving epoch keeps serving.
    #[error("hot restart failed: {0}")]
    Failed(String),
    /// Not now: the proxy is draining, handed over or stopping.
    #[error("hot restart refused: {0}")]
    Refused(String),
}

/// How a proxy process ended.
#[derive(Debug, Clone)]
pub struct Exit {
    /// Its pid.
    pub pid: u32,
    /// The epoch it ran at.
    pub epoch: u32,
    /// Its exit status.
    pub status: ExitStatus,
    /// Whether the supervisor stopped it (a signal it sent) rather than it exiting on its own.
    pub aborted: bool,
    /// How long it ran.
    pub ran_for: Duration,
    /// The last lines it wrote to stderr.
    pub stderr_tail: String,
    /// It was OOM-killed (SIGKILL, and its container's OOM-kill count rose).
    pub oom: Option<OomKill>,
}

/// The kernel's OOM killer ended an Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OomKill {
    /// The container's memory limit, when known.
    pub limit: Option<u64>,
}

impl std::fmt::Display for OomKill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.limit {
            Some(limit) => write!(
                f,
                "OOM-killed at the container's memory limit ({} MiB)",
                limit >> 20
            ),
            None => f.write_str("OOM-killed"),
        }
    }
}

impl Exit {
    /// The code a supervisor exits with: the proxy's, or 128+N for death by signal N.
    pub fn code(&self) -> i32 {
        exit_code(&self.status)
    }
}

/// Why a proxy operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// The binary could not be started.
    #[error("cannot start envoy binary {binary}: {source}")]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// The exec error.
        source: std::io::Error,
    },
    /// Waiting for the process failed.
    #[error("cannot wait for envoy (pid {pid}): {source}")]
    Wait {
        /// Envoy's pid.
        pid: u32,
        /// The wait error.
        source: std::io::Error,
    },
    /// Sending a signal failed.
    #[error("cannot send {signal} to envoy (pid {pid}): {errno}")]
    Signal {
        /// Envoy's pid.
        pid: u32,
        /// The signal.
        signal: Signal,
        /// Why.
        errno: nix::errno::Errno,
    },
    /// No Envoy runs.
    #[error("envoy is not running")]
    NotRunning,
    /// The admin address is not known yet (Envoy has not written it).
    #[error("envoy's admin address is not known yet (envoy has not bound it)")]
    AdminUnknown,
    /// An admin call failed.
    #[error(transparent)]
    Admin(#[from] AdminError),
    /// Envoy rejects the new config; nothing changed on disk.
    #[error("envoy rejects the new config for {path}: {message}")]
    ConfigRejected {
        /// The config file.
        path: PathBuf,
        /// Envoy's reason.
        message: String,
    },
    /// The config was written but the hot restart onto it did not happen.
    #[error("config {path} written, but {source}")]
    Restart {
        /// The config file.
        path: PathBuf,
        /// Why the restart did not happen.
        source: RestartError,
    },
    /// The proxy is stopping or gone.
    #[error("the proxy is stopping")]
    Stopping,
    /// What was asked cannot work with this setup (a cold handover: why not).
    #[error("no cold handover possible: {0}")]
    Unsupported(String),
    /// A drain was not accepted.
    #[error("drain failed: {message}")]
    DrainFailed {
        /// Why.
        message: String,
    },
    /// Envoy was not told to fail its health checks.
    #[error("cannot fail envoy's health checks: {message}")]
    HealthChecksNotFailed {
        /// Why.
        message: String,
    },
    /// The config file could not be replaced; the old one is intact.
    #[error("cannot write envoy config {path} (the old file is unchanged): {source}")]
    ConfigWrite {
        /// The config file.
        path: PathBuf,
        /// The write error.
        source: std::io::Error,
    },
}

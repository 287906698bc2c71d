//! The proxy a supervisor runs: the [`Proxy`] trait and [`Envoy`], its implementation for the
//! real Envoy binary, plus what it takes to talk to Envoy ([`AdminClient`]), to start it
//! ([`envoy_args`]) and to change its config ([`write_atomically`]).
//!
//! # Theory of operation
//!
//! - **Starting.** [`Proxy::run`] builds Envoy's command line with the pure function
//!   [`envoy_args`] and hands the command to one dedicated, never-ending thread that forks it
//!   (Envoy's `PR_SET_PDEATHSIG` follows the forking *thread*; see `spawner`). Envoy gets its
//!   own process group, so a terminal's Ctrl-C reaches the agent only and the agent decides
//!   what Envoy gets. Envoy's stdout is inherited; its stderr is copied through to ours and the
//!   last few KiB are kept, so an Envoy that refuses its config explains why in [`Exit`].
//! - **Running.** `run` resolves when Envoy exits, whatever the reason, and reports how.
//!   When the bootstrap asks for admin port 0, Envoy writes the bound address to a file and
//!   `run` publishes it on [`Envoy::watch_admin_address`] as soon as it appears.
//! - **Stopping.** Cancelling the `abort` token stops Envoy gracefully: SIGTERM (Envoy
//!   flushes its logs and exits at once, no drain), then SIGKILL to its process group once
//!   [`ProxyConfig::stop_grace`] has passed. `run` still waits for the exit status, so no
//!   zombie is left and the caller learns how Envoy ended. Dropping the `run` future SIGKILLs
//!   Envoy (a safety net, not a way to stop it).
//! - **Draining** is an admin call ([`Proxy::drain`]); Envoy keeps running. The policy around
//!   it (how long to wait, when to stop) lives in the `drain` crate and the agent.
//! - **Config updates** replace the bootstrap atomically: readers see the old file or the new
//!   one, never a mix, and a failed write leaves the old file in place.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

pub mod admin;
pub mod args;
pub mod bootstrap;
mod config;
mod config_file;
mod envoy;
pub mod preflight;
mod process;
pub mod reaper;
mod spawner;
mod sys;

pub use admin::{AdminClient, AdminError, ServerInfo, ServerState};
pub use args::{EnvoyArgs, envoy_args};
pub use config::{AdminAddress, DrainStrategy, HotRestart, ProxyConfig, RunAs};
pub use config_file::write_atomically;
pub use envoy::Envoy;
pub use nix::sys::signal::Signal;
pub use process::{EnvoyProcess, exit_code, read_admin_file, signal_pid, wait_admin_file};

/// A proxy process a supervisor runs, drains and reconfigures. Mirrors Istio's
/// `pkg/envoy.Proxy`, with the restart epoch `run` starts at.
pub trait Proxy: Send + Sync + 'static {
    /// Starts the proxy at restart `epoch` and resolves when it has exited, on its own or
    /// because `abort` was cancelled (then it is stopped gracefully first).
    fn run(
        &self,
        epoch: u32,
        abort: CancellationToken,
    ) -> impl Future<Output = Result<Exit, ProxyError>> + Send;

    /// Starts draining the listeners. With `skip_exit` the listeners never stop (the proxy
    /// keeps accepting, answering with `Connection: close`).
    fn drain(&self, skip_exit: bool) -> impl Future<Output = Result<(), ProxyError>> + Send;

    /// Removes what the proxy left behind once it has exited (generated bootstrap, files).
    fn cleanup(&self);

    /// Replaces the proxy's config file atomically with `config`.
    fn update_config(&self, config: &[u8]) -> impl Future<Output = Result<(), ProxyError>> + Send;

    /// The proxy's admin API address, when known (Envoy may pick it at start).
    fn admin_address(&self) -> Option<std::net::SocketAddr> {
        None
    }

    /// Asks the proxy to reopen its log files (after rotation). Envoy: SIGUSR1.
    fn reopen_logs(&self) -> Result<(), ProxyError> {
        Ok(())
    }
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
    /// Whether it was stopped through the abort token rather than exiting on its own.
    pub aborted: bool,
    /// How long it ran.
    pub ran_for: Duration,
    /// The last lines it wrote to stderr.
    pub stderr_tail: String,
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
    /// The config file could not be replaced; the old one is intact.
    #[error("cannot write envoy config {path} (the old file is unchanged): {source}")]
    ConfigWrite {
        /// The config file.
        path: PathBuf,
        /// The write error.
        source: std::io::Error,
    },
}

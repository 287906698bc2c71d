//! envoy-agent: a process manager for the Envoy proxy.
//!
//! # Theory of operation
//!
//! `main` parses the command line ([`cli`]), starts tracing and calls [`run`]. [`run`] checks
//! its input first ([`setup`]: bootstrap, admin address, Envoy binary) so that bad input fails
//! with one line and exit code 64 before anything starts. It then builds an
//! [`envoy_agent_proxy::Envoy`] and hands it to an [`Agent`], which starts Envoy and reacts to
//! [`Intent`]s (signals, turned into an enum by an injectable [`IntentSource`]) until Envoy has
//! exited and been reaped. The exit code says how it ended ([`AgentExit::code`]).
//!
//! Nothing outlives [`run`]: Envoy is reaped before it returns, and dropping the future kills
//! Envoy (it was spawned with kill-on-drop) rather than leaking it.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use envoy_agent_proxy::{AdminAddress, Envoy};

pub mod agent;
pub mod cli;
pub mod duration;
pub mod setup;
pub mod signal;

pub use agent::{Agent, AgentExit};
pub use setup::{EXIT_USAGE, SetupError};
pub use signal::{Intent, IntentSource, UnixSignals};

/// `envoy-agent run`: returns the process exit code. Errors of type [`SetupError`] mean bad
/// input (exit [`EXIT_USAGE`]); others are failures of the agent itself.
pub async fn run(args: cli::RunArgs, intents: impl IntentSource) -> anyhow::Result<u8> {
    let runtime_dir = std::env::temp_dir().join(format!("envoy-agent-{}", std::process::id()));
    // The bootstrap first: it is what the operator wrote, so its errors are the most telling.
    let (admin, extra_args) = setup::resolve_admin(
        &args.config_path,
        args.admin_address,
        &args.envoy_args,
        &runtime_dir,
    )?;
    let binary = setup::resolve_envoy(&args.envoy_path, std::env::var_os("PATH").as_deref())?;
    let own_runtime_dir =
        matches!(&admin, AdminAddress::FromFile(p) if p.starts_with(&runtime_dir));
    if own_runtime_dir {
        std::fs::create_dir_all(&runtime_dir)
            .with_context(|| format!("creating runtime dir {}", runtime_dir.display()))?;
    }
    let config = setup::proxy_config(&args, binary, admin, extra_args);
    let envoy = Arc::new(Envoy::new(config));
    let exit = Agent::new(envoy).run(intents).await;
    if own_runtime_dir {
        remove_dir(&runtime_dir);
    }
    match exit {
        AgentExit::ProxyFailed(e) => Err(e).context("running envoy"),
        exit => Ok(exit.code()),
    }
}

fn remove_dir(dir: &PathBuf) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        tracing::debug!(dir = %dir.display(), error = %e, "cannot remove runtime dir");
    }
}

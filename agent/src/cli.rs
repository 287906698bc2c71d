//! The command line. Every flag that an operator may want to set from a pod spec also reads
//! an environment variable (shown in `--help`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::duration::parse_duration;

/// Process manager for the Envoy proxy: starts Envoy, keeps it healthy, drains it on shutdown.
#[derive(Debug, Parser)]
#[command(name = "envoy-agent", version, propagate_version = true)]
pub struct Cli {
    /// The agent's own log level or filter (e.g. `info`, `envoy_agent=debug`).
    #[arg(long, global = true, env = "ENVOY_AGENT_LOG", default_value = "info")]
    pub log_level: String,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run Envoy under the agent until it exits or the agent is told to stop.
    Run(Box<RunArgs>),
}

/// How connections are closed during a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DrainStrategyArg {
    /// Tell every connection to close when the drain starts.
    Immediate,
    /// Tell connections to close with a probability rising over the drain time.
    Gradual,
}

/// `envoy-agent run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Envoy's bootstrap (YAML or JSON). Its admin address is the agent's way into Envoy.
    #[arg(short = 'c', long = "config-path", env = "ENVOY_CONFIG_PATH")]
    pub config_path: PathBuf,

    /// The Envoy binary: a path, or a name looked up on PATH.
    #[arg(long, env = "ENVOY_PATH", default_value = "envoy")]
    pub envoy_path: PathBuf,

    /// Envoy's admin address, when not the bootstrap's (e.g. 127.0.0.1:15000).
    #[arg(long, env = "ENVOY_ADMIN_ADDRESS")]
    pub admin_address: Option<SocketAddr>,

    /// Envoy's log level, Istio style: `warning` or `info,upstream:debug` (component levels).
    #[arg(long, env = "PROXY_LOG_LEVEL", default_value = "warning")]
    pub proxy_log_level: String,

    /// Envoy's component log levels (`a:b,c:d`), used when --proxy-log-level names none.
    #[arg(long, env = "PROXY_COMPONENT_LOG_LEVEL", default_value = "")]
    pub proxy_component_log_level: String,

    /// Envoy logs as JSON lines.
    #[arg(long, env = "PROXY_LOG_AS_JSON")]
    pub proxy_log_as_json: bool,

    /// The node's IPs; Envoy binds upstream connections to IPv6 only when all are IPv6.
    #[arg(long = "node-ip", env = "INSTANCE_IPS", value_delimiter = ',')]
    pub node_ips: Vec<String>,

    /// Envoy's worker threads (`--concurrency`); 0 lets Envoy choose. Keep it constant.
    #[arg(long, env = "ENVOY_CONCURRENCY", default_value_t = 0)]
    pub concurrency: u32,

    /// How long Envoy drains (`--drain-time-s`, whole seconds).
    #[arg(long, env = "ENVOY_DRAIN_TIME", value_parser = parse_duration, default_value = "45s")]
    pub drain_time: Duration,

    /// How Envoy closes connections during a drain.
    #[arg(long, value_enum, default_value = "immediate")]
    pub drain_strategy: DrainStrategyArg,

    /// Drain all listeners on shutdown, not only inbound ones (gateways).
    #[arg(long, env = "DRAIN_ALL_LISTENERS")]
    pub drain_all_listeners: bool,

    /// Write Envoy's outlier-detection events to this file.
    #[arg(long, env = "OUTLIER_LOG_PATH")]
    pub outlier_log_path: Option<PathBuf>,

    /// Envoy's access-log flush interval (`--file-flush-interval-msec`).
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub file_flush_interval: Duration,

    /// Delete the bootstrap once Envoy has exited (for generated bootstraps).
    #[arg(long)]
    pub config_cleanup: bool,

    /// When the agent runs as root, run Envoy as this uid (with --run-as-gid).
    #[arg(long, requires = "run_as_gid")]
    pub run_as_uid: Option<u32>,

    /// When the agent runs as root, run Envoy as this gid (with --run-as-uid).
    #[arg(long, requires = "run_as_uid")]
    pub run_as_gid: Option<u32>,

    /// How long a stopping Envoy gets between SIGTERM and SIGKILL.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub stop_grace: Duration,

    /// Extra arguments passed to Envoy verbatim, after `--`.
    #[arg(last = true)]
    pub envoy_args: Vec<String>,
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
        let Command::Run(run) = cli.command;
        assert_eq!(run.config_path, PathBuf::from("b.yaml"));
        assert_eq!(run.envoy_args, ["--service-cluster", "x"]);
    }
}

//! The `envoy-agent` binary: parse, start tracing, run, pick the exit code.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use envoy_agent::cli::{Cli, Command, LogFormat};
use envoy_agent::{EXIT_USAGE, SetupError, UnixSignals};
use tracing_subscriber::EnvFilter;

/// The agent itself failed (`EX_SOFTWARE`).
const EXIT_FAILURE: u8 = envoy_agent::agent::EXIT_SOFTWARE;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            // Help and version are not errors; a bad flag or value is a usage error.
            return if e.use_stderr() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let filter = EnvFilter::try_from_env("RUST_LOG")
        .or_else(|_| EnvFilter::try_new(&cli.log_level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("envoy-agent: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let code = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => {
                let signals = UnixSignals::install()
                    .map_err(|e| anyhow::anyhow!(e).context("installing signal handlers"))?;
                envoy_agent::run(*args, cli.client.grpc_address, signals).await
            }
            Command::Client(command) => {
                let addr = cli
                    .client
                    .grpc_address
                    .unwrap_or_else(envoy_agent::client::default_address);
                Ok(envoy_agent::client::run(&command, &addr, cli.client.timeout).await)
            }
        }
    });
    match code {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("envoy-agent: {}", one_line(&e));
            if e.downcast_ref::<SetupError>().is_some() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::from(EXIT_FAILURE)
            }
        }
    }
}

/// The error and its causes on one line, each cause once: our errors already name their source
/// in their own message, which a plain `{:#}` would repeat.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !line.contains(&cause) {
            line.push_str(": ");
            line.push_str(&cause);
        }
    }
    line
}

//! The `envoy-agent` binary: parse (into settings, or a client call), start tracing, run, pick
//! the exit code.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{CommandFactory, FromArgMatches};
use envoy_agent::UnixSignals;
use envoy_agent::config::cli::{Cli, Command, LogFormat};
use envoy_agent::exit_code;
use envoy_agent_proxy::output;
use tracing_subscriber::EnvFilter;

/// How long the exit waits for its last log lines to be taken, at most.
const OUTPUT_FLUSH: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    let (cli, matches) = match parse() {
        Ok(parsed) => parsed,
        Err(code) => return code,
    };
    if let Command::Completions { shell } = &cli.command {
        return completions(*shell);
    }
    start_tracing(&cli, &matches);
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            let said = format!("envoy-agent: {}\n", one_line(&e));
            output::stderr().write_lines(said.as_bytes());
            envoy_agent::exit_code_of(&e)
        }
    };
    // The last lines (the exit's) are worth a moment, not a hang on a reader that stopped.
    output::flush(OUTPUT_FLUSH);
    ExitCode::from(code)
}

/// The command line, or the exit code of one that says no more (help, version, a usage error).
fn parse() -> Result<(Cli, clap::ArgMatches), ExitCode> {
    let parsed = Cli::command()
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    parsed.map_err(|e| {
        let _ = e.print();
        // Help and version are not errors; a bad flag or value is a usage error.
        if e.use_stderr() {
            ExitCode::from(exit_code::USAGE)
        } else {
            ExitCode::SUCCESS
        }
    })
}

/// `envoy-agent completions SHELL`: the script on stdout.
fn completions(shell: clap_complete::Shell) -> ExitCode {
    use std::io::Write as _;
    let script = envoy_agent::config::cli::completions(shell);
    match std::io::stdout().write_all(&script) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("envoy-agent completions: cannot write: {e}");
            ExitCode::from(exit_code::SOFTWARE)
        }
    }
}

/// The agent's log, at the level and in the format asked.
fn start_tracing(cli: &Cli, matches: &clap::ArgMatches) {
    // An explicit --log-level (or ENVOY_AGENT_LOG_LEVEL) wins; RUST_LOG beats the default.
    let explicit = given(matches, "log_level");
    let filter = if explicit {
        EnvFilter::try_new(&cli.log_level)
    } else {
        EnvFilter::try_from_env("RUST_LOG").or_else(|_| EnvFilter::try_new(&cli.log_level))
    }
    .unwrap_or_else(|_| EnvFilter::new("info"));
    // Written by a thread of its own, dropped rather than waited for: a log reader that stops
    // reading must not stop the agent (envoy_agent_proxy::output).
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(output::stderr);
    match cli.log_format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        // Each line names the task that wrote it (its innermost span, with the span's fields);
        // the path of spans around it would double every line's size for little.
        LogFormat::Json => logs
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}

/// Runs the command on the agent's runtime: the exit code, or why the run failed.
fn run(cli: Cli) -> anyhow::Result<u8> {
    // One thread: the agent waits on Envoy, timers and a few sockets, never on its own CPU,
    // and every wakeup that stays on its thread saves two context switches (idle CPU, and
    // the latency between Envoy's LIVE and the supervisor acting on it).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        match cli.command {
            Command::Run(args) => {
                let settings = args.into_settings(cli.client.grpc_address)?;
                let signals = UnixSignals::install()
                    .map_err(|e| anyhow::anyhow!(e).context("installing signal handlers"))?;
                envoy_agent::run(&settings, signals).await
            }
            Command::Client(command) => {
                let addr = cli
                    .client
                    .grpc_address
                    .unwrap_or_else(envoy_agent::client::default_address);
                let call = envoy_agent::client::Call::from(command);
                Ok(envoy_agent::client::run(&call, &addr, cli.client.timeout).await)
            }
            // Answered before the runtime.
            Command::Completions { .. } => Ok(0),
        }
    })
}

/// Whether argument `id` was given (command line or its environment variable), here or in the
/// subcommand (global arguments may come after it).
fn given(matches: &clap::ArgMatches, id: &str) -> bool {
    use clap::parser::ValueSource;
    let here = matches!(
        matches.value_source(id),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    );
    here || matches.subcommand().is_some_and(|(_, sub)| given(sub, id))
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

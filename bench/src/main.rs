//! `envoy-agent-bench`: runs the benchmarks and prints a table and the JSON report.
//!
//! ```sh
//! scripts/bench.sh            # release builds; 10 restarts of each kind
//! envoy-agent-bench --restarts 1 --load-ms 1000 --json report.json --svg timeline.svg
//! ```
//!
//! `--help` lists the flags. A bad command line exits 64 (`EX_USAGE`, as `envoy-agent` does),
//! not clap's 2.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use envoy_agent_bench::{BenchConfig, run, table};

/// A bad command line (`EX_USAGE`), as `envoy-agent` exits for one.
const EXIT_USAGE: u8 = 64;

/// Benchmarks envoy-agent against the real Envoy on 127.0.0.1: zero-loss handoffs, overhead,
/// footprint. Prints a table, then the JSON report (unless --json). Takes minutes: run it on a
/// quiet machine (`scripts/bench.sh` builds both binaries in release first).
#[derive(Debug, Parser)]
#[command(
    name = "envoy-agent-bench",
    // scripts/bench.sh passes its own --json and --svg before the caller's arguments, which
    // may name them again: the last one wins.
    args_override_self = true,
    // So that `--restarts -1` is refused as a bad value of --restarts, not as an unknown flag -1.
    allow_negative_numbers = true,
    after_help = "Envoy: $ENVOY_PATH, else the one scripts/install-envoy.sh installs.\n\
                  Exit status: 0 done; 64 a bad command line (as envoy-agent); 70 the runtime \
                  could not start; 74 a report file not written. A step that fails panics."
)]
struct Cli {
    /// The envoy-agent binary to measure. Default: `envoy-agent` next to this binary (where
    /// cargo builds both), else the one on PATH.
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,

    /// Hot restarts of each kind: Envoy's own (half before the agent's, half after), and the
    /// agent's handoffs with the same config (pre-flight cache hits), then with a changed one
    /// (misses).
    #[arg(long, value_name = "N", default_value_t = 10)]
    restarts: u32,

    /// Milliseconds of load from one restart to the next, at least.
    #[arg(long, value_name = "MS", default_value_t = 4000)]
    load_ms: u64,

    /// Load workers of each kind: keep-alive connections, and a new connection per request.
    #[arg(long, value_name = "N", default_value_t = 4)]
    workers: usize,

    /// gRPC GetStatus calls to the agent, for their latency and rate.
    #[arg(long, value_name = "N", default_value_t = 2000)]
    grpc_calls: u32,

    /// Samples of Envoy's own cold start, of its `--mode validate` and of the agent's startup.
    #[arg(long, value_name = "N", default_value_t = 10)]
    samples: u32,

    /// Write the JSON report to FILE instead of printing it after the table.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Write the timeline of the agent's handoffs under load (an SVG) to FILE. Without it, none.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

impl Cli {
    fn config(&self) -> BenchConfig {
        BenchConfig {
            agent: self.agent.clone().unwrap_or_else(default_agent),
            restarts: self.restarts,
            load_per_restart: Duration::from_millis(self.load_ms),
            workers: self.workers,
            grpc_calls: self.grpc_calls,
            samples: self.samples,
        }
    }
}

fn default_agent() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("envoy-agent")))
        .unwrap_or_else(|| PathBuf::from("envoy-agent"))
}

/// --help is not an error; a bad flag or value is, with the agent's usage code rather than
/// clap's 2.
fn parse_error_exit_code(e: &clap::Error) -> u8 {
    if e.use_stderr() { EXIT_USAGE } else { 0 }
}

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return std::process::ExitCode::from(parse_error_exit_code(&e));
        }
    };
    let config = cli.config();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("envoy-agent-bench: {e}");
            return std::process::ExitCode::from(70);
        }
    };
    let report = runtime.block_on(run(&config));
    println!("{}", table(&report.json));
    if let Some(path) = cli.svg {
        if let Err(e) = std::fs::write(&path, &report.svg) {
            eprintln!("envoy-agent-bench: cannot write {}: {e}", path.display());
            return std::process::ExitCode::from(74);
        }
    }
    let text = serde_json::to_string_pretty(&report.json).unwrap_or_default();
    match cli.json {
        Some(path) => {
            if let Err(e) = std::fs::write(&path, &text) {
                eprintln!("envoy-agent-bench: cannot write {}: {e}", path.display());
                return std::process::ExitCode::from(74);
            }
        }
        None => println!("\n{text}"),
    }
    std::process::ExitCode::SUCCESS
}


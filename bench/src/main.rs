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

#[cfg(test)]
mod tests {
    use clap::CommandFactory;
    use clap::error::ErrorKind;

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("envoy-agent-bench").chain(args.iter().copied()))
    }

    #[test]
    fn the_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_arguments_give_the_defaults() {
        let cli = parse(&[]).unwrap();
        assert_eq!(cli.json, None);
        assert_eq!(cli.svg, None);
        let config = cli.config();
        assert_eq!(config.agent, default_agent());
        assert!(config.agent.ends_with("envoy-agent"), "{config:?}");
        assert_eq!(config.restarts, 10);
        assert_eq!(config.load_per_restart, Duration::from_secs(4));
        assert_eq!(config.workers, 4);
        assert_eq!(config.grpc_calls, 2000);
        assert_eq!(config.samples, 10);
    }

    #[test]
    fn every_flag_is_read() {
        let cli = parse(&[
            "--agent",
            "/opt/envoy-agent",
            "--restarts",
            "1",
            "--load-ms",
            "1500",
            "--workers",
            "2",
            "--grpc-calls",
            "50",
            "--samples",
            "3",
            "--json",
            "r.json",
            "--svg",
            "t.svg",
        ])
        .unwrap();
        assert_eq!(cli.json, Some(PathBuf::from("r.json")));
        assert_eq!(cli.svg, Some(PathBuf::from("t.svg")));
        let config = cli.config();
        assert_eq!(config.agent, PathBuf::from("/opt/envoy-agent"));
        assert_eq!(config.restarts, 1);
        assert_eq!(config.load_per_restart, Duration::from_millis(1500));
        assert_eq!(config.workers, 2);
        assert_eq!(config.grpc_calls, 50);
        assert_eq!(config.samples, 3);
    }

    #[test]
    fn each_flag_alone_changes_only_itself() {
        let defaults = parse(&[]).unwrap().config();
        let changed = |args: &[&str]| parse(args).unwrap().config();
        let c = changed(&["--restarts", "3"]);
        assert_eq!((c.restarts, c.samples), (3, defaults.samples));
        let c = changed(&["--load-ms", "0"]);
        assert_eq!(c.load_per_restart, Duration::ZERO);
        assert_eq!(c.restarts, defaults.restarts);
        let c = changed(&["--workers", "8"]);
        assert_eq!((c.workers, c.grpc_calls), (8, defaults.grpc_calls));
        let c = changed(&["--grpc-calls", "7"]);
        assert_eq!((c.grpc_calls, c.workers), (7, defaults.workers));
        let c = changed(&["--samples", "1"]);
        assert_eq!((c.samples, c.restarts), (1, defaults.restarts));
        let c = changed(&["--agent", "envoy-agent"]);
        assert_eq!(c.agent, PathBuf::from("envoy-agent"));
        assert_eq!(c.load_per_restart, defaults.load_per_restart);
        let cli = parse(&["--json", "r.json"]).unwrap();
        assert_eq!((cli.json, cli.svg), (Some(PathBuf::from("r.json")), None));
        let cli = parse(&["--svg", "t.svg"]).unwrap();
        assert_eq!((cli.json, cli.svg), (None, Some(PathBuf::from("t.svg"))));
    }

    #[test]
    fn the_last_of_a_repeated_flag_wins() {
        // As scripts/bench.sh calls it, with the caller's own --json.
        let cli = parse(&[
            "--json",
            "target/bench/report.json",
            "--svg",
            "target/bench/timeline.svg",
            "--restarts",
            "5",
            "--json",
            "/tmp/r.json",
        ])
        .unwrap();
        assert_eq!(cli.json, Some(PathBuf::from("/tmp/r.json")));
        assert_eq!(cli.svg, Some(PathBuf::from("target/bench/timeline.svg")));
        assert_eq!(cli.restarts, 5);
        assert_eq!(
            parse(&["--restarts", "1", "--restarts", "2"])
                .unwrap()
                .restarts,
            2
        );
    }

    #[test]
    fn a_bad_value_is_refused_naming_the_flag() {
        for (flag, value) in [
            ("--restarts", "x"),
            ("--restarts", "-1"),
            ("--load-ms", "1s"),
            ("--workers", "many"),
            ("--grpc-calls", "1e3"),
            ("--samples", ""),
        ] {
            let e = parse(&[flag, value]).unwrap_err();
            assert_eq!(
                e.kind(),
                ErrorKind::ValueValidation,
                "{flag} {value:?}: {e}"
            );
            assert!(e.to_string().contains(flag), "{flag} {value:?}: {e}");
            assert_eq!(parse_error_exit_code(&e), EXIT_USAGE);
        }
    }

    #[test]
    fn a_missing_value_is_refused_naming_the_flag() {
        let e = parse(&["--restarts"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidValue, "{e}");
        assert!(e.to_string().contains("--restarts"), "{e}");
        assert_eq!(parse_error_exit_code(&e), EXIT_USAGE);
    }

    #[test]
    fn an_unknown_flag_is_refused_naming_it() {
        let e = parse(&["--restart", "3"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownArgument, "{e}");
        assert!(e.to_string().contains("--restart"), "{e}");
        assert_eq!(parse_error_exit_code(&e), EXIT_USAGE);
        let e = parse(&["3"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownArgument, "{e}");
    }

    #[test]
    fn help_is_displayed_and_exits_0() {
        for flag in ["--help", "-h"] {
            let e = parse(&[flag]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::DisplayHelp, "{e}");
            assert_eq!(parse_error_exit_code(&e), 0);
            let help = e.to_string();
            for documented in [
                "--agent",
                "--restarts",
                "--load-ms",
                "--workers",
                "--grpc-calls",
                "--samples",
                "--json",
                "--svg",
                "64",
            ] {
                assert!(help.contains(documented), "{documented}: {help}");
            }
        }
    }
}

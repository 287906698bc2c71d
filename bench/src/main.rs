//! `envoy-agent-bench`: runs the benchmarks and prints a table and the JSON report.
//!
//! ```sh
//! scripts/bench.sh            # release builds; 10 restarts of each kind
//! envoy-agent-bench --restarts 1 --load-ms 1000 --json report.json --svg timeline.svg
//! ```

use std::path::PathBuf;
use std::time::Duration;

use envoy_agent_bench::{BenchConfig, run, table};

fn main() -> std::process::ExitCode {
    let mut config = BenchConfig {
        agent: std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("envoy-agent")))
            .unwrap_or_else(|| PathBuf::from("envoy-agent")),
        restarts: 10,
        load_per_restart: Duration::from_secs(4),
        workers: 4,
        grpc_calls: 2000,
        samples: 10,
    };
    let mut json_out = None;
    let mut svg_out = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_default();
        match arg.as_str() {
            "--agent" => config.agent = PathBuf::from(value()),
            "--restarts" => config.restarts = value().parse().unwrap_or(config.restarts),
            "--load-ms" => {
                config.load_per_restart = Duration::from_millis(value().parse().unwrap_or(3000))
            }
            "--workers" => config.workers = value().parse().unwrap_or(config.workers),
            "--grpc-calls" => config.grpc_calls = value().parse().unwrap_or(config.grpc_calls),
            "--samples" => config.samples = value().parse().unwrap_or(config.samples),
            "--json" => json_out = Some(PathBuf::from(value())),
            "--svg" => svg_out = Some(PathBuf::from(value())),
            other => {
                eprintln!("envoy-agent-bench: unknown argument {other:?}");
                return std::process::ExitCode::from(64);
            }
        }
    }
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
    if let Some(path) = svg_out {
        if let Err(e) = std::fs::write(&path, &report.svg) {
            eprintln!("envoy-agent-bench: cannot write {}: {e}", path.display());
            return std::process::ExitCode::from(74);
        }
    }
    let text = serde_json::to_string_pretty(&report.json).unwrap_or_default();
    match json_out {
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

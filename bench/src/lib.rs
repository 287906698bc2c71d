//! Benchmarks of envoy-agent, run against the real binary and the real Envoy, on 127.0.0.1
//! only, bounded in time. One [`run`] measures:
//!
//! - failed requests across K hot restarts under load, per load kind (keep-alive workers, and
//!   one new connection per request);
//! - handoff time (SIGHUP → LIVE at the new epoch on the admin port), next to Envoy's own
//!   exec → LIVE on the same bootstrap in the same run, and `envoy --mode validate` alone;
//! - the supervisor's RSS and CPU seconds over the restarts (Envoy not counted);
//! - SIGTERM → exit of the supervisor; in exit-on-zero mode (hot restart off), last connection
//!   closed → exit;
//! - gRPC `GetStatus` latency p50/p99 and requests per second.
//!
//! Timings are numbers to read, never pass/fail: machines are shared and noisy.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::{AgentProcess, KeepAlive, Load, PATIENCE, TestDir, envoy_path, live_at};
use nix::sys::signal::Signal;
use serde_json::json;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The `envoy-agent` binary.
    pub agent: PathBuf,
    /// Hot restarts under load.
    pub restarts: u32,
    /// Load duration around each restart's handoff, at least.
    pub load_per_restart: Duration,
    /// Load workers of each kind.
    pub workers: usize,
    /// gRPC GetStatus calls.
    pub grpc_calls: u32,
    /// Samples of Envoy's own start and of validation.
    pub samples: u32,
}

/// min / median / max of durations, in milliseconds.
fn spread(mut v: Vec<Duration>) -> serde_json::Value {
    v.sort();
    let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
    match (v.first(), v.last()) {
        (Some(min), Some(max)) => json!({
            "min_ms": ms(min), "median_ms": ms(&v[v.len() / 2]), "max_ms": ms(max), "n": v.len()
        }),
        _ => json!(null),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

fn cpu_seconds(pid: u32) -> f64 {
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let f: Vec<u64> = s
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|x| x.parse().ok())
                .collect();
            Some(f.iter().sum::<u64>() as f64 / ticks)
        })
        .unwrap_or(0.0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Envoy alone: exec → LIVE, `samples` times, on a bootstrap like the benchmark's.
async fn envoy_alone(samples: u32) -> (Vec<Duration>, Vec<Duration>) {
    let dir = TestDir::new();
    let admin_port = envoy_agent_tests::free_port();
    let bootstrap = dir.write(
        "b.yaml",
        &envoy_agent_tests::bootstrap_yaml_on(admin_port, envoy_agent_tests::free_port(), "x"),
    );
    let admin = envoy_agent_proxy::AdminClient::new(([127, 0, 0, 1], admin_port).into());
    let mut starts = Vec::new();
    let mut validations = Vec::new();
    for _ in 0..samples {
        let started = Instant::now();
        let mut child = tokio::process::Command::new(envoy_path())
            .arg("-c")
            .arg(&bootstrap)
            .args(["--disable-hot-restart", "-l", "error", "--concurrency", "1"])
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start envoy: {e}"));
        envoy_agent_tests::eventually("envoy LIVE", PATIENCE, || async {
            matches!(admin.server_info().await, Ok(i) if i.state == envoy_agent_proxy::ServerState::Live)
                .then_some(())
        })
        .await;
        starts.push(started.elapsed());
        let _ = child.kill().await;

        let started = Instant::now();
        let _ = tokio::process::Command::new(envoy_path())
            .args(["--mode", "validate", "-l", "error", "-c"])
            .arg(&bootstrap)
            .output()
            .await;
        validations.push(started.elapsed());
    }
    (starts, validations)
}

/// Runs every measurement and returns the report as JSON.
pub async fn run(config: &BenchConfig) -> serde_json::Value {
    let (envoy_starts, validations) = envoy_alone(config.samples).await;

    // Hot restarts under load.
    let mut agent = AgentProcess::builder(&config.agent)
        .hot_restart()
        .args(&[
            "--drain-time",
            "1s",
            "--parent-shutdown-time",
            "2s",
            "--log-level",
            "warn",
        ])
        .start()
        .await;
    let ports = agent.ports.unwrap_or_else(|| panic!("hot restart ports"));
    let listener = ([127, 0, 0, 1], ports.listener_port).into();
    let supervisor = agent.pid();
    let keep_alive = Load::start(listener, "/", config.workers, 0);
    let per_request = Load::start(listener, "/", 0, config.workers);
    let cpu_before = cpu_seconds(supervisor);
    let mut handoffs = Vec::new();
    for epoch in 1..=config.restarts {
        let started = Instant::now();
        agent.signal(Signal::SIGHUP);
        live_at(&agent.admin, epoch).await;
        handoffs.push(started.elapsed());
        // Let the load run and the parent drain away before the next one.
        let until = started + config.load_per_restart;
        while agent.envoys().len() > 1 || Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let cpu = cpu_seconds(supervisor) - cpu_before;
    let keep_alive = keep_alive.stop().await;
    let per_request = per_request.stop().await;

    // gRPC GetStatus.
    let addr: GrpcAddress = agent
        .grpc
        .parse()
        .unwrap_or_else(|e| panic!("grpc address: {e}"));
    let mut client = envoy_agent::client::connect(&addr, PATIENCE)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut latencies = Vec::new();
    let grpc_started = Instant::now();
    for _ in 0..config.grpc_calls {
        let t = Instant::now();
        client
            .get_status(pb::GetStatusRequest {})
            .await
            .unwrap_or_else(|e| panic!("GetStatus: {e}"));
        latencies.push(t.elapsed());
    }
    let grpc_elapsed = grpc_started.elapsed();
    latencies.sort();
    let rss = rss_kib(supervisor);

    let stopping = Instant::now();
    agent.signal(Signal::SIGTERM);
    let code = agent.exit().await.code();
    let sigterm_to_exit = stopping.elapsed();

    // Exit-on-zero, hot restart off: last connection closed → exit.
    let mut zero = AgentProcess::builder(&config.agent)
        .args(&[
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "200ms",
            "--termination-drain-duration",
            "60s",
            "--log-level",
            "warn",
        ])
        .start()
        .await;
    let mut held = KeepAlive::connect(zero.listener("hello").await)
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let _ = held.get("/").await;
    zero.signal(Signal::SIGTERM);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let closed = Instant::now();
    drop(held);
    zero.exit().await;
    let close_to_exit = closed.elapsed();

    json!({
        "restarts": config.restarts,
        "failed_requests": {
            "keep_alive": { "ok": keep_alive.ok, "failed": keep_alive.failed, "errors": keep_alive.errors },
            "new_connection_per_request": { "ok": per_request.ok, "failed": per_request.failed, "errors": per_request.errors },
        },
        "handoff_sighup_to_live": spread(handoffs),
        "envoy_alone_exec_to_live": spread(envoy_starts),
        "envoy_validate": spread(validations),
        "supervisor": { "cpu_seconds": cpu, "max_rss_kib": rss, "exit_code": code },
        "sigterm_to_exit_ms": sigterm_to_exit.as_secs_f64() * 1000.0,
        "exit_on_zero_close_to_exit_ms": close_to_exit.as_secs_f64() * 1000.0,
        "grpc_get_status": {
            "calls": config.grpc_calls,
            "p50_ms": percentile(&latencies, 0.5),
            "p99_ms": percentile(&latencies, 0.99),
            "per_second": f64::from(config.grpc_calls) / grpc_elapsed.as_secs_f64().max(1e-9),
        },
    })
}

/// The report as a table for people.
pub fn table(report: &serde_json::Value) -> String {
    let ms = |v: &serde_json::Value| {
        format!(
            "{:.1} / {:.1} / {:.1}",
            v["min_ms"].as_f64().unwrap_or(0.0),
            v["median_ms"].as_f64().unwrap_or(0.0),
            v["max_ms"].as_f64().unwrap_or(0.0)
        )
    };
    let f = &report["failed_requests"];
    let g = &report["grpc_get_status"];
    let s = &report["supervisor"];
    [
        "| measure | value |\n|---|---|".to_owned(),
        format!("| hot restarts under load | {} |", report["restarts"]),
        format!(
            "| failed requests, keep-alive | {} of {} |",
            f["keep_alive"]["failed"],
            f["keep_alive"]["ok"].as_u64().unwrap_or(0)
                + f["keep_alive"]["failed"].as_u64().unwrap_or(0)
        ),
        format!(
            "| failed requests, new connection per request | {} of {} |",
            f["new_connection_per_request"]["failed"],
            f["new_connection_per_request"]["ok"].as_u64().unwrap_or(0)
                + f["new_connection_per_request"]["failed"]
                    .as_u64()
                    .unwrap_or(0)
        ),
        format!(
            "| handoff SIGHUP → LIVE, min / median / max ms | {} |",
            ms(&report["handoff_sighup_to_live"])
        ),
        format!(
            "| Envoy alone exec → LIVE, min / median / max ms | {} |",
            ms(&report["envoy_alone_exec_to_live"])
        ),
        format!(
            "| `envoy --mode validate`, min / median / max ms | {} |",
            ms(&report["envoy_validate"])
        ),
        format!(
            "| supervisor CPU over the restarts | {:.3} s |",
            s["cpu_seconds"].as_f64().unwrap_or(0.0)
        ),
        format!(
            "| supervisor peak RSS | {:.1} MiB |",
            s["max_rss_kib"].as_f64().unwrap_or(0.0) / 1024.0
        ),
        format!(
            "| SIGTERM → exit (supervisor) | {:.1} ms |",
            report["sigterm_to_exit_ms"].as_f64().unwrap_or(0.0)
        ),
        format!(
            "| exit-on-zero: last connection closed → exit | {:.1} ms |",
            report["exit_on_zero_close_to_exit_ms"]
                .as_f64()
                .unwrap_or(0.0)
        ),
        format!(
            "| gRPC GetStatus p50 / p99 | {:.2} / {:.2} ms ({:.0}/s) |",
            g["p50_ms"].as_f64().unwrap_or(0.0),
            g["p99_ms"].as_f64().unwrap_or(0.0),
            g["per_second"].as_f64().unwrap_or(0.0)
        ),
    ]
    .join("\n")
}

//! Benchmarks of envoy-agent, run against the real binary and the real Envoy, on 127.0.0.1
//! only, bounded in time. One [`run`] measures, in this order:
//!
//! 1. **Envoy alone**, idle: exec → LIVE of a cold start, and `envoy --mode validate`.
//! 2. **Startup**: agent start → the supervisor's readiness marker (hot restart, as on a node),
//!    and agent start → its `/healthz/ready` (one Envoy, as a sidecar); with each, SIGTERM →
//!    exit (`--termination-drain-duration 0s`). Steps 1 and 2 take their samples in turns,
//!    one of each at a time, so that the machine's drift weighs on both alike.
//! 3. **Envoy's own hot restart** under load, as `hot-restarter.py` does it (exec the next
//!    epoch, nothing else): exec → LIVE, and failed requests. The baseline of a handoff: half
//!    of its restarts run before step 4 and half after it, pooled, so that the machine's
//!    drift over the run weighs on both sides of the comparison.
//! 4. **The agent's handoffs** under the same load: K with the same binary and config (a plain
//!    SIGHUP: a pre-flight cache hit), then K with a changed config (a miss: it is validated).
//!    Each is timed from SIGHUP to the new epoch answering LIVE, and the agent's own `handoff`
//!    event adds its split (pre-flight, Envoy's start, how late LIVE was seen). The supervisor's
//!    CPU (over the K hits) and peak RSS, gRPC `GetStatus` latency, and a timeline of requests
//!    and failures per 100 ms with every restart marked (an SVG).
//! 5. **Exit-on-zero** (hot restart off): last connection closed → exit.
//!
//! LIVE is watched every millisecond (`/ready`, then the epoch from two gauges), the same way
//! for Envoy alone and for the agent. Timings are numbers to read, never pass/fail: machines
//! are shared and noisy. The report's `targets` compare them with issue 14's targets.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_proxy::admin::Readiness;
use envoy_agent_proxy::{AdminClient, ServerState};
use envoy_agent_tests::{
    AgentProcess, KeepAlive, Load, LoadReport, PATIENCE, TestDir, envoy_path, free_port,
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

pub mod svg;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The `envoy-agent` binary.
    pub agent: PathBuf,
    /// Hot restarts of each kind (Envoy alone, cache hits, cache misses).
    pub restarts: u32,
    /// Time from one restart to the next, at least.
    pub load_per_restart: Duration,
    /// Load workers of each kind.
    pub workers: usize,
    /// gRPC GetStatus calls.
    pub grpc_calls: u32,
    /// Samples of Envoy's own start, of validation and of the agent's startup.
    pub samples: u32,
}

/// The report (JSON) and the timeline (SVG).
#[derive(Debug, Clone)]
pub struct Report {
    /// Every number.
    pub json: Value,
    /// The agent's handoffs under load, as a picture.
    pub svg: String,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// min / median / max of durations, in milliseconds.
fn spread(mut v: Vec<Duration>) -> Value {
    v.sort();
    match (v.first(), v.last()) {
        (Some(min), Some(max)) => json!({
            "min_ms": ms(*min), "median_ms": ms(v[v.len() / 2]), "max_ms": ms(*max), "n": v.len()
        }),
        _ => Value::Null,
    }
}

/// min / median / max of differences in milliseconds (which may be negative).
fn spread_signed_ms(mut v: Vec<f64>) -> Value {
    v.sort_by(f64::total_cmp);
    match (v.first(), v.last()) {
        (Some(min), Some(max)) => json!({
            "min_ms": min, "median_ms": v[v.len() / 2], "max_ms": max, "n": v.len()
        }),
        _ => Value::Null,
    }
}

/// min / median / max of milliseconds.
fn spread_ms(v: Vec<f64>) -> Value {
    spread(
        v.into_iter()
            .map(|m| Duration::from_secs_f64(m / 1000.0))
            .collect(),
    )
}

fn median_ms(v: &Value) -> f64 {
    v["median_ms"].as_f64().unwrap_or(f64::NAN)
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    ms(sorted[i])
}

/// CPU time of `pid` so far, in seconds: the larger of the kernel's per-process total (whole
/// clock ticks, threads that exited included) and the sum of its threads' scheduler time
/// (nanoseconds, threads alive now).
fn cpu_seconds(pid: u32) -> (f64, f64) {
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
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
        .unwrap_or(0.0);
    let sched: u64 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(Result::ok)
                .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
                .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    (stat, sched as f64 / 1e9)
}

fn cpu_between(before: (f64, f64), after: (f64, f64)) -> Value {
    let ticks = after.0 - before.0;
    let precise = after.1 - before.1;
    json!({ "seconds": ticks.max(precise), "clock_ticks_s": ticks, "scheduler_s": precise })
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

/// Polls the admin every millisecond until `epoch` (any, when `None`) answers LIVE; when.
async fn live_at(admin: &AdminClient, epoch: Option<u32>) -> Instant {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(Readiness::Ready) = admin.ready().await {
            match epoch {
                None => return Instant::now(),
                Some(epoch) => {
                    let seen = Instant::now();
                    if let Ok(s) = admin.admin_state().await {
                        if s.epoch == epoch && s.state == ServerState::Live {
                            return seen;
                        }
                    }
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "epoch {epoch:?} not LIVE within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Polls every millisecond until `check`; when.
async fn when(what: &str, check: impl Fn() -> bool) -> Instant {
    let deadline = Instant::now() + PATIENCE;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Instant::now()
}

/// The command line the agent gives Envoy, for Envoy alone.
fn envoy_command(bootstrap: &std::path::Path) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(envoy_path());
    c.arg("-c")
        .arg(bootstrap)
        .args(["-l", "error", "--concurrency", "1", "--drain-time-s", "1"])
        .args([
            "--drain-strategy",
            "immediate",
            "--parent-shutdown-time-s",
            "2",
        ])
        .kill_on_drop(true);
    c
}

/// Samples of steps 1 and 2, taken in turns (one of each, then the next), so that the
/// machine's drift weighs on Envoy alone and on the agent's startup alike.
#[derive(Default)]
struct Idle {
    starts: Vec<Duration>,
    validations: Vec<Duration>,
    node: (Vec<Duration>, Vec<Duration>, Vec<f64>),
    sidecar: (Vec<Duration>, Vec<Duration>),
}

async fn idle_samples(config: &BenchConfig) -> Idle {
    let mut idle = Idle::default();
    for _ in 0..config.samples {
        envoy_alone(&mut idle).await;
        startup(config, &mut idle).await;
    }
    idle
}

/// Step 1, Envoy alone, idle: exec → LIVE of a cold start, and `--mode validate` (one sample).
async fn envoy_alone(idle: &mut Idle) {
    let dir = TestDir::new();
    let admin_port = free_port();
    let bootstrap = dir.write(
        "b.yaml",
        &envoy_agent_tests::bootstrap_yaml_on(admin_port, free_port(), "x"),
    );
    let admin = AdminClient::new(std::net::SocketAddr::from(([127, 0, 0, 1], admin_port)));
    let (starts, validations) = (&mut idle.starts, &mut idle.validations);
    {
        let started = Instant::now();
        let mut child = envoy_command(&bootstrap)
            .arg("--disable-hot-restart")
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start envoy: {e}"));
        starts.push(live_at(&admin, None).await - started);
        let _ = child.kill().await;

        let started = Instant::now();
        let _ = tokio::process::Command::new(envoy_path())
            .args(["--mode", "validate", "-l", "error", "-c"])
            .arg(&bootstrap)
            .output()
            .await;
        validations.push(started.elapsed());
    }
}

/// Step 2, startup and SIGTERM → exit, with hot restart (marker) and without (readiness):
/// one sample of each.
async fn startup(config: &BenchConfig, idle: &mut Idle) {
    let quick_exit = ["--termination-drain-duration", "0s", "--log-level", "info"];
    let (node, sidecar) = (&mut idle.node, &mut idle.sidecar);
    {
        let started = Instant::now();
        let mut agent = AgentProcess::builder(&config.agent)
            .hot_restart()
            .no_wait_live()
            .args(&quick_exit)
            .start()
            .await;
        let ready = when("the readiness marker", || agent.marker_present()).await;
        node.0.push(ready - started);
        if let Some(live) = agent.events("handoff").first() {
            node.2
                .push(live["start_to_live_ms"].as_f64().unwrap_or(f64::NAN));
        }
        let stopping = Instant::now();
        agent.signal(Signal::SIGTERM);
        agent.exit().await;
        node.1.push(stopping.elapsed());

        let started = Instant::now();
        let mut agent = AgentProcess::builder(&config.agent)
            .no_wait_live()
            .args(&quick_exit)
            .start()
            .await;
        let status = agent.status();
        let deadline = Instant::now() + PATIENCE;
        loop {
            let ready = envoy_agent_tests::http_get(status, "/healthz/ready").await;
            if ready.is_ok_and(|r| r.status == 200) {
                break;
            }
            assert!(Instant::now() < deadline, "the sidecar agent never ready");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        sidecar.0.push(started.elapsed());
        let stopping = Instant::now();
        agent.signal(Signal::SIGTERM);
        agent.exit().await;
        sidecar.1.push(stopping.elapsed());
    }
}

/// Step 2's part of the report.
fn startup_report(idle: Idle) -> Value {
    let (node, sidecar) = (idle.node, idle.sidecar);
    json!({
        "hot_restart_start_to_ready": spread(node.0),
        "hot_restart_envoy_start_to_live": spread_ms(node.2),
        "hot_restart_sigterm_to_exit": spread(node.1),
        "sidecar_start_to_ready": spread(sidecar.0),
        "sidecar_sigterm_to_exit": spread(sidecar.1),
    })
}

/// Both kinds of load against `listener`.
struct Loads {
    keep_alive: Load,
    per_request: Load,
}

impl Loads {
    fn start(listener: std::net::SocketAddr, workers: usize) -> Loads {
        Loads {
            keep_alive: Load::start(listener, "/", workers, 0),
            per_request: Load::start(listener, "/", 0, workers),
        }
    }

    async fn stop(self) -> (LoadReport, LoadReport) {
        (self.keep_alive.stop().await, self.per_request.stop().await)
    }
}

fn failures(keep_alive: &LoadReport, per_request: &LoadReport) -> Value {
    json!({
        "keep_alive": { "ok": keep_alive.ok, "failed": keep_alive.failed, "errors": keep_alive.errors },
        "new_connection_per_request": { "ok": per_request.ok, "failed": per_request.failed, "errors": per_request.errors },
    })
}

/// Envoy's own hot restarts of one batch: exec → LIVE of each, and the load through them.
struct BareBatch {
    starts: Vec<Duration>,
    keep_alive: LoadReport,
    per_request: LoadReport,
}

/// Step 3, Envoy's own hot restarts under load, as `hot-restarter.py` does them: half before
/// the agent's handoffs, half after, so that a drift of the machine's load over the run weighs
/// on both sides of the comparison alike.
fn bare_report(batches: [BareBatch; 2]) -> Value {
    let [mut first, second] = batches;
    first.starts.extend(second.starts);
    let add = |a: &mut LoadReport, b: LoadReport| {
        a.ok += b.ok;
        a.failed += b.failed;
        a.errors.extend(b.errors);
    };
    add(&mut first.keep_alive, second.keep_alive);
    add(&mut first.per_request, second.per_request);
    json!({
        "exec_to_live": spread(first.starts),
        "failed_requests": failures(&first.keep_alive, &first.per_request),
    })
}

/// One batch of `restarts` of Envoy's own hot restarts, from a fresh epoch 0.
async fn bare_hot_restarts(config: &BenchConfig, restarts: u32) -> BareBatch {
    if restarts == 0 {
        return BareBatch {
            starts: Vec::new(),
            keep_alive: LoadReport::default(),
            per_request: LoadReport::default(),
        };
    }
    let dir = TestDir::new();
    let (admin_port, listener_port) = (free_port(), free_port());
    let base_id = envoy_agent_tests::unique_base_id();
    let bootstrap = dir.write(
        "b.yaml",
        &envoy_agent_tests::bootstrap_yaml_on(admin_port, listener_port, "hello"),
    );
    let admin = AdminClient::new(std::net::SocketAddr::from(([127, 0, 0, 1], admin_port)));
    let spawn = |epoch: u32| {
        envoy_command(&bootstrap)
            .args(["--base-id", &base_id.to_string()])
            .args(["--restart-epoch", &epoch.to_string()])
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start envoy: {e}"))
    };
    let mut parent = spawn(0);
    live_at(&admin, Some(0)).await;
    let loads = Loads::start(([127, 0, 0, 1], listener_port).into(), config.workers);
    let mut starts = Vec::new();
    for epoch in 1..=restarts {
        let started = Instant::now();
        let child = spawn(epoch);
        starts.push(live_at(&admin, Some(epoch)).await - started);
        // The child terminates its parent after the parent-shutdown time.
        let _ = tokio::time::timeout(PATIENCE, parent.wait()).await;
        tokio::time::sleep_until((started + config.load_per_restart).into()).await;
        parent = child;
    }
    let (keep_alive, per_request) = loads.stop().await;
    let _ = parent.kill().await;
    let _ = std::fs::remove_file(format!(
        "/dev/shm/envoy_shared_memory_{}",
        u64::from(base_id) * 10
    ));
    BareBatch {
        starts,
        keep_alive,
        per_request,
    }
}

/// The agent's `handoff` event of `epoch`.
fn handoff_event(agent: &AgentProcess, epoch: u32) -> Value {
    agent
        .events_with("handoff", "epoch", &epoch.to_string())
        .pop()
        .unwrap_or(Value::Null)
}

/// One kind of handoff: (SIGHUP → LIVE, per-handoff events).
#[derive(Default)]
struct Handoffs {
    sighup_to_live: Vec<Duration>,
    events: Vec<Value>,
}

impl Handoffs {
    fn report(&self) -> Value {
        let field = |name: &str| {
            spread_ms(
                self.events
                    .iter()
                    .filter_map(|e| e[name].as_f64())
                    .collect(),
            )
        };
        let caches: Vec<&str> = self
            .events
            .iter()
            .map(|e| e["preflight_cache"].as_str().unwrap_or("?"))
            .collect();
        // The agent's LIVE (its `handoff` event, from the SIGHUP it received) against this
        // harness's own LIVE (polling `/ready` every millisecond, from the SIGHUP it sent), per
        // restart: how much later the supervisor acted than an independent poller saw LIVE.
        let acted_after: Vec<f64> = self
            .events
            .iter()
            .zip(&self.sighup_to_live)
            .filter_map(|(e, seen)| Some(e["duration_ms"].as_f64()? - seen.as_secs_f64() * 1e3))
            .collect();
        json!({
            "sighup_to_live": spread(self.sighup_to_live.clone()),
            "agent_live_after_independent_poller": spread_signed_ms(acted_after),
            "agent_handoff": field("duration_ms"),
            "agent_preflight": field("preflight_ms"),
            "envoy_start_to_live": field("start_to_live_ms"),
            "live_seen_within": field("live_seen_within_ms"),
            "preflight_cache": caches,
        })
    }
}

/// 4. The agent's handoffs under load, hits then misses; CPU, RSS, gRPC, the timeline.
async fn agent_handoffs(config: &BenchConfig) -> (Value, String) {
    let mut agent = AgentProcess::builder(&config.agent)
        .hot_restart()
        .args(&[
            "--drain-time",
            "1s",
            "--parent-shutdown-time",
            "2s",
            "--termination-drain-duration",
            "0s",
            "--log-level",
            "info",
        ])
        .start()
        .await;
    let ports = agent.ports.unwrap_or_else(|| panic!("hot restart ports"));
    let supervisor = agent.pid();
    let loads = Loads::start(([127, 0, 0, 1], ports.listener_port).into(), config.workers);
    let origin = loads.keep_alive.started();
    let mut marks = Vec::new();
    let mut mark = |at: Instant, kind| {
        marks.push(svg::Mark {
            at_s: (at - origin).as_secs_f64(),
            kind,
        })
    };
    let cpu_before = cpu_seconds(supervisor);
    let mut hits = Handoffs::default();
    let mut misses = Handoffs::default();
    let mut cpu_hits = Value::Null;
    let bootstrap = agent.dir.join("bootstrap.yaml");
    for epoch in 1..=config.restarts * 2 {
        let miss = epoch > config.restarts;
        if miss {
            // Same listener and admin, another body: another config.
            let yaml = envoy_agent_tests::bootstrap_yaml_on(
                ports.admin_port,
                ports.listener_port,
                &format!("hello {epoch}"),
            );
            std::fs::write(&bootstrap, yaml)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", bootstrap.display()));
        }
        let envoys = agent.envoys().len();
        let started = Instant::now();
        agent.signal(Signal::SIGHUP);
        mark(started, svg::MarkKind::Trigger);
        let live = live_at(&agent.admin, Some(epoch)).await;
        mark(live, svg::MarkKind::Live);
        let kind = if miss { &mut misses } else { &mut hits };
        kind.sighup_to_live.push(live - started);
        let exited = when("the previous epoch's exit", || {
            agent.envoys().len() < envoys + 1
        })
        .await;
        mark(exited, svg::MarkKind::ParentExit);
        tokio::time::sleep_until((started + config.load_per_restart).into()).await;
        if epoch == config.restarts {
            cpu_hits = cpu_between(cpu_before, cpu_seconds(supervisor));
        }
    }
    let (keep_alive, per_request) = loads.stop().await;
    for epoch in 1..=config.restarts * 2 {
        let kind = if epoch > config.restarts {
            &mut misses
        } else {
            &mut hits
        };
        kind.events.push(handoff_event(&agent, epoch));
    }
    let validations: Vec<f64> = agent
        .events("validate")
        .iter()
        .filter_map(|e| e["duration_ms"].as_f64())
        .collect();

    let grpc = grpc_get_status(&agent.grpc, config.grpc_calls).await;
    let rss = rss_kib(supervisor);
    let cpu_all = cpu_between(cpu_before, cpu_seconds(supervisor));
    let stopping = Instant::now();
    agent.signal(Signal::SIGTERM);
    let code = agent.exit().await.code();
    let sigterm_to_exit = stopping.elapsed();

    let svg = handoffs_timeline(config, &keep_alive, &per_request, &marks);
    let json = json!({
        "failed_requests": failures(&keep_alive, &per_request),
        "hits": hits.report(),
        "misses": misses.report(),
        "validate_in_run": spread_ms(validations),
        "supervisor": {
            "cpu_over_hits": cpu_hits,
            "cpu_over_run": cpu_all,
            "max_rss_kib": rss,
            "exit_code": code,
        },
        "sigterm_to_exit_ms": ms(sigterm_to_exit),
        "grpc_get_status": grpc,
    });
    (json, svg)
}

/// `calls` sequential gRPC GetStatus calls over the agent's socket: their latency and rate.
async fn grpc_get_status(grpc: &str, calls: u32) -> Value {
    let addr: GrpcAddress = grpc.parse().unwrap_or_else(|e| panic!("grpc address: {e}"));
    let mut client = envoy_agent::client::connect(&addr, PATIENCE)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut latencies = Vec::new();
    let started = Instant::now();
    for _ in 0..calls {
        let t = Instant::now();
        client
            .get_status(pb::GetStatusRequest {})
            .await
            .unwrap_or_else(|e| panic!("GetStatus: {e}"));
        latencies.push(t.elapsed());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    json!({
        "calls": calls,
        "p50_ms": percentile(&latencies, 0.5),
        "p99_ms": percentile(&latencies, 0.99),
        "per_second": f64::from(calls) / elapsed.as_secs_f64().max(1e-9),
    })
}

/// The timeline of the agent's handoffs under load, as an SVG.
fn handoffs_timeline(
    config: &BenchConfig,
    keep_alive: &LoadReport,
    per_request: &LoadReport,
    marks: &[svg::Mark],
) -> String {
    svg::timeline(
        &format!(
            "envoy-agent: {} hot restarts under load ({} with the same config, {} with a changed one)",
            config.restarts * 2,
            config.restarts,
            config.restarts
        ),
        &[
            svg::Panel {
                name: format!("keep-alive, {} connections", config.workers),
                buckets: keep_alive.timeline.clone(),
            },
            svg::Panel {
                name: format!("a new connection per request, {} workers", config.workers),
                buckets: per_request.timeline.clone(),
            },
        ],
        marks,
    )
}

/// 5. Exit-on-zero, hot restart off: last connection closed → exit.
async fn exit_on_zero(config: &BenchConfig) -> Duration {
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
    closed.elapsed()
}

/// Runs every measurement.
pub async fn run(config: &BenchConfig) -> Report {
    let mut idle = idle_samples(config).await;
    let (envoy_starts, validations) = (
        std::mem::take(&mut idle.starts),
        std::mem::take(&mut idle.validations),
    );
    let startup = startup_report(idle);
    let before = bare_hot_restarts(config, config.restarts.div_ceil(2)).await;
    let (agent, svg) = agent_handoffs(config).await;
    let after = bare_hot_restarts(config, config.restarts / 2).await;
    let bare = bare_report([before, after]);
    let close_to_exit = exit_on_zero(config).await;

    let envoy_alone = json!({
        "exec_to_live": spread(envoy_starts),
        "validate": spread(validations),
    });
    // Issue 14's targets, from this run.
    let envoy_live = median_ms(&envoy_alone["exec_to_live"]);
    let bare_live = median_ms(&bare["exec_to_live"]);
    let validate = median_ms(&agent["validate_in_run"]);
    let hit = median_ms(&agent["hits"]["sighup_to_live"]);
    let miss = median_ms(&agent["misses"]["sighup_to_live"]);
    let start = median_ms(&startup["hot_restart_start_to_ready"]);
    let failed = agent["failed_requests"]["keep_alive"]["failed"]
        .as_u64()
        .unwrap_or(u64::MAX)
        .saturating_add(
            agent["failed_requests"]["new_connection_per_request"]["failed"]
                .as_u64()
                .unwrap_or(u64::MAX),
        );
    let rss = agent["supervisor"]["max_rss_kib"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let cpu = agent["supervisor"]["cpu_over_hits"]["seconds"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let acted = median_ms(&agent["hits"]["agent_live_after_independent_poller"]);
    let targets = json!({
        "live_acted_on_within_2ms": { "value_ms": acted, "met": acted <= 2.0 },
        "hit_handoff_le_envoy_hot_restart_plus_10ms": { "value_ms": hit, "bound_ms": bare_live + 10.0, "met": hit <= bare_live + 10.0 },
        "miss_handoff_le_validate_plus_envoy_hot_restart_plus_10ms": { "value_ms": miss, "bound_ms": validate + bare_live + 10.0, "met": miss <= validate + bare_live + 10.0 },
        "startup_le_envoy_alone_plus_10ms": { "value_ms": start, "bound_ms": envoy_live + 10.0, "met": start <= envoy_live + 10.0 },
        "no_failed_requests": { "value": failed, "met": failed == 0 },
        "peak_rss_le_8_mib": { "value_mib": rss / 1024.0, "met": rss <= 8.0 * 1024.0 },
        "cpu_over_hits_le_0_05_s": { "value_s": cpu, "restarts": config.restarts, "met": cpu <= 0.05 },
    });
    let json = json!({
        "restarts_per_kind": config.restarts,
        "load_workers_per_kind": config.workers,
        "envoy_alone": envoy_alone,
        "startup": startup,
        "envoy_hot_restart": bare,
        "agent": agent,
        "exit_on_zero_close_to_exit_ms": ms(close_to_exit),
        "targets": targets,
    });
    Report { json, svg }
}

/// A distribution as "min / median / max" milliseconds.
fn spread_cell(v: &Value) -> String {
    if v.is_null() {
        return "n/a".to_owned();
    }
    format!(
        "{:.1} / {:.1} / {:.1}",
        v["min_ms"].as_f64().unwrap_or(f64::NAN),
        v["median_ms"].as_f64().unwrap_or(f64::NAN),
        v["max_ms"].as_f64().unwrap_or(f64::NAN)
    )
}

/// Failed requests as "N of total".
fn failed_cell(f: &Value) -> String {
    format!(
        "{} of {}",
        f["failed"],
        f["ok"].as_u64().unwrap_or(0) + f["failed"].as_u64().unwrap_or(0)
    )
}

/// The report as a table for people: the measures, then the targets.
pub fn table(report: &Value) -> String {
    let a = &report["agent"];
    let b = &report["envoy_hot_restart"];
    let s = &report["startup"];
    let e = &report["envoy_alone"];
    let g = &a["grpc_get_status"];
    let caches = |kind: &str| {
        let list = a[kind]["preflight_cache"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let hits = list.iter().filter(|c| c.as_str() == Some("hit")).count();
        format!("{hits} of {} hits", list.len())
    };
    let mut rows = vec![
        "| measure (min / median / max ms unless said) | value |\n|---|---|".to_owned(),
        format!(
            "| Envoy alone, cold start exec → LIVE (idle) | {} |",
            spread_cell(&e["exec_to_live"])
        ),
        format!(
            "| Envoy alone, `--mode validate` (idle) | {} |",
            spread_cell(&e["validate"])
        ),
        format!(
            "| Envoy's own hot restart exec → LIVE, under load (`hot-restarter.py`'s way) | {} |",
            spread_cell(&b["exec_to_live"])
        ),
        format!(
            "| agent handoff SIGHUP → LIVE, same config ({}) | {} |",
            caches("hits"),
            spread_cell(&a["hits"]["sighup_to_live"])
        ),
        format!(
            "| … of which pre-flight (the agent's `handoff` event) | {} |",
            spread_cell(&a["hits"]["agent_preflight"])
        ),
        format!(
            "| … of which Envoy's start, spawn → LIVE | {} |",
            spread_cell(&a["hits"]["envoy_start_to_live"])
        ),
        format!(
            "| … the supervisor's LIVE after a 1 ms poller's (negative: before) | {} |",
            spread_cell(&a["hits"]["agent_live_after_independent_poller"])
        ),
        format!(
            "| agent handoff SIGHUP → LIVE, changed config ({}) | {} |",
            caches("misses"),
            spread_cell(&a["misses"]["sighup_to_live"])
        ),
        format!(
            "| … of which pre-flight | {} |",
            spread_cell(&a["misses"]["agent_preflight"])
        ),
        format!(
            "| `--mode validate` in the same run, under load | {} |",
            spread_cell(&a["validate_in_run"])
        ),
        format!(
            "| agent start → ready, hot restart (marker) | {} |",
            spread_cell(&s["hot_restart_start_to_ready"])
        ),
        format!(
            "| agent start → ready, one Envoy (`/healthz/ready`) | {} |",
            spread_cell(&s["sidecar_start_to_ready"])
        ),
        format!(
            "| SIGTERM → exit, hot restart / one Envoy (`--termination-drain-duration 0s`) | {} / {} |",
            spread_cell(&s["hot_restart_sigterm_to_exit"]),
            spread_cell(&s["sidecar_sigterm_to_exit"])
        ),
        format!(
            "| failed requests, Envoy alone: keep-alive / new connection | {} / {} |",
            failed_cell(&b["failed_requests"]["keep_alive"]),
            failed_cell(&b["failed_requests"]["new_connection_per_request"])
        ),
        format!(
            "| failed requests, agent: keep-alive / new connection | {} / {} |",
            failed_cell(&a["failed_requests"]["keep_alive"]),
            failed_cell(&a["failed_requests"]["new_connection_per_request"])
        ),
        format!(
            "| supervisor CPU over the {} same-config restarts / the whole run | {:.3} s / {:.3} s |",
            report["restarts_per_kind"],
            a["supervisor"]["cpu_over_hits"]["seconds"]
                .as_f64()
                .unwrap_or(f64::NAN),
            a["supervisor"]["cpu_over_run"]["seconds"]
                .as_f64()
                .unwrap_or(f64::NAN)
        ),
        format!(
            "| supervisor peak RSS | {:.1} MiB |",
            a["supervisor"]["max_rss_kib"].as_f64().unwrap_or(f64::NAN) / 1024.0
        ),
        format!(
            "| exit-on-zero: last connection closed → exit | {:.1} ms |",
            report["exit_on_zero_close_to_exit_ms"]
                .as_f64()
                .unwrap_or(f64::NAN)
        ),
        format!(
            "| gRPC GetStatus p50 / p99 | {:.2} / {:.2} ms ({:.0}/s) |",
            g["p50_ms"].as_f64().unwrap_or(f64::NAN),
            g["p99_ms"].as_f64().unwrap_or(f64::NAN),
            g["per_second"].as_f64().unwrap_or(f64::NAN)
        ),
    ];
    rows.push(String::new());
    rows.extend(target_rows(report));
    rows.join("\n")
}

/// The targets' table: each target's value, bound and whether it was met.
fn target_rows(report: &Value) -> Vec<String> {
    let mut rows =
        vec!["| target (issue 14) | value | bound | met |\n|---|---|---|---|".to_owned()];
    if let Some(targets) = report["targets"].as_object() {
        for (name, t) in targets {
            let value = ["value_ms", "value_s", "value_mib", "value"]
                .iter()
                .find_map(|k| t.get(*k))
                .map(|v| match v.as_f64() {
                    Some(f) => format!("{f:.3}"),
                    None => v.to_string(),
                })
                .unwrap_or_default();
            let bound = t
                .get("bound_ms")
                .and_then(Value::as_f64)
                .map(|b| format!("{b:.1} ms"))
                .unwrap_or_default();
            rows.push(format!(
                "| {name} | {value} | {bound} | {} |",
                if t["met"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "**no**"
                }
            ));
        }
    }
    rows
}

//! The benchmark with tiny settings (one restart, one second of load), so that it keeps working.

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use envoy_agent_bench::{BenchConfig, run, table};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmark_runs_with_tiny_settings() {
    // `cargo test --workspace` builds the agent binary next to the test binaries' directory.
    let exe = std::env::current_exe().unwrap();
    let agent = exe.parent().unwrap().parent().unwrap().join("envoy-agent");
    assert!(
        agent.exists(),
        "{} is missing: run the workspace's tests (`scripts/test.sh`) or `cargo build -p envoy-agent` first",
        agent.display()
    );
    let report = run(&BenchConfig {
        agent,
        restarts: 1,
        load_per_restart: Duration::from_secs(1),
        workers: 2,
        grpc_calls: 50,
        samples: 1,
    })
    .await;
    let json = &report.json;
    let agent = &json["agent"];
    let failed = &agent["failed_requests"];
    assert_eq!(failed["keep_alive"]["failed"], 0, "{json}");
    assert_eq!(failed["new_connection_per_request"]["failed"], 0, "{json}");
    assert!(failed["keep_alive"]["ok"].as_u64().unwrap() > 0);
    // One restart of each kind, and the cache saw them for what they are.
    assert_eq!(agent["hits"]["sighup_to_live"]["n"], 1, "{json}");
    assert_eq!(agent["misses"]["sighup_to_live"]["n"], 1, "{json}");
    assert_eq!(agent["hits"]["preflight_cache"][0], "hit", "{json}");
    assert_eq!(agent["misses"]["preflight_cache"][0], "miss", "{json}");
    assert_eq!(json["envoy_hot_restart"]["exec_to_live"]["n"], 1, "{json}");
    assert_eq!(
        json["startup"]["hot_restart_start_to_ready"]["n"], 1,
        "{json}"
    );
    assert_eq!(agent["supervisor"]["exit_code"], 0);
    assert!(agent["grpc_get_status"]["per_second"].as_f64().unwrap() > 0.0);
    assert!(
        json["targets"]["no_failed_requests"]["met"]
            .as_bool()
            .unwrap()
    );
    let table = table(json);
    assert!(table.contains("agent handoff SIGHUP → LIVE"), "{table}");
    // The timeline: both loads, and the three marks of each of the two restarts.
    let svg = &report.svg;
    assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");
    // (Marks are the only 1-wide dashed lines: the legend's are 2 wide, grid lines plain, and
    // how many grid lines there are depends on the load's rate.)
    assert_eq!(
        svg.matches(r#"stroke-width="1" stroke-dasharray="#).count(),
        2 * 2 * 3,
        "{svg}"
    );
}

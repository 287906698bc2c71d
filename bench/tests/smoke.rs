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
    let failed = &report["failed_requests"];
    assert_eq!(failed["keep_alive"]["failed"], 0, "{report}");
    assert_eq!(
        failed["new_connection_per_request"]["failed"], 0,
        "{report}"
    );
    assert!(failed["keep_alive"]["ok"].as_u64().unwrap() > 0);
    assert_eq!(report["handoff_sighup_to_live"]["n"], 1);
    assert_eq!(report["supervisor"]["exit_code"], 0);
    assert!(report["grpc_get_status"]["per_second"].as_f64().unwrap() > 0.0);
    let table = table(&report);
    assert!(table.contains("handoff SIGHUP → LIVE"), "{table}");
}

//! Envoy fits the container it runs in (issue 50), with the real Envoy in real cgroups made by
//! the test (v1 on these machines, v2 where mounted), the agent and its Envoy moved into them:
//!
//! - a buffering listener and uploads held open (memory grows by 16 MiB/s) under a 160 MiB
//!   limit: without the memory guard Envoy is OOM-killed and the exit says so (exit 137,
//!   `oom_killed`, the limit in the termination message); with it (the default) Envoy turns
//!   the excess away with 503s, stays up, and serves again once the pressure passes, also when
//!   the agent sees its cgroup through a namespace of its own (`unshare --cgroup`);
//! - a plain SIGKILL is not called an OOM kill;
//! - a 1-CPU quota gives Envoy one worker, also where Envoy's own detection fails (a cgroup
//!   namespace over the host's mounts: "Cgroup path / is outside mount root"); Envoy starts
//!   without its warning that downstream connections are unbounded.

use std::time::Duration;

use envoy_agent_proto::pb;
use envoy_agent_tests::cgroup::TestCgroup;
use envoy_agent_tests::clients::{Kind, Uploads};
use envoy_agent_tests::{PATIENCE, eventually, http_get};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::agent;
use crate::drain_status::status;

const LIMIT: u64 = 160 << 20;

fn buffering_bootstrap() -> String {
    r#"admin:
  address:
    socket_address: { address: 127.0.0.1, port_value: 0 }
static_resources:
  listeners:
  - name: buffered
    address:
      socket_address: { address: 127.0.0.1, port_value: 0 }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: buffered
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                direct_response: { status: 200, body: { inline_string: "ok" } }
          http_filters:
          - name: envoy.filters.http.buffer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: 16777216
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    .to_owned()
}

/// The issue's load: 50 uploads of 4 MiB, one each 250 ms, held open.
fn load(addr: std::net::SocketAddr) -> Uploads {
    Uploads::start(addr, 50, 4 << 20, Duration::from_millis(250))
}

/// The uploads' statuses (200s, 503s) and failures, once all have ended.
async fn outcome(uploads: &Uploads) -> (usize, usize, usize) {
    let events = uploads.finished(Duration::from_secs(60)).await;
    let statuses = |s: u16| {
        events
            .iter()
            .filter(|e| matches!(e.kind, Kind::Response { status, .. } if status == s))
            .count()
    };
    let failures = events
        .iter()
        .filter(|e| matches!(e.kind, Kind::Failure { .. }))
        .count();
    (statuses(200), statuses(503), failures)
}

#[tokio::test]
async fn without_the_memory_guard_the_load_oom_kills_envoy_and_the_exit_names_it() {
    let cgroup = TestCgroup::new("oom", Some(LIMIT), None);
    let builder = agent().bootstrap(buffering_bootstrap());
    let message = builder.dir().join("termination-log");
    let message_arg = message.display().to_string();
    let wrapper = cgroup.wrapper();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut agent = builder
        .wrapper(&wrapper)
        .args(&[
            "--memory-guard",
            "off",
            "--termination-message-path",
            &message_arg,
        ])
        .start()
        .await;
    let uploads = load(agent.listener("buffered").await);
    let status = tokio::time::timeout(Duration::from_secs(60), agent.exit())
        .await
        .expect("envoy is OOM-killed under the load");
    assert_eq!(status.code(), Some(137));
    assert!(cgroup.oom_kills() >= 1, "the kernel's OOM killer acted");
    let exit = agent.wait_event("exit", "exit_path", "oom_killed").await;
    assert_eq!(exit["code"], 137, "{exit}");
    agent
        .wait_event("oom_killed", "limit_bytes", &LIMIT.to_string())
        .await;
    let message = std::fs::read_to_string(&message).unwrap();
    assert!(
        message.starts_with(
            "envoy-agent exited 137: oom_killed (envoy was OOM-killed at the container's memory limit (160 MiB))"
        ),
        "{message}"
    );
    let (ok, _, _) = outcome(&uploads).await;
    assert!(ok < 50, "the OOM kill cut the uploads");
}

#[tokio::test]
async fn with_the_memory_guard_envoy_turns_the_excess_away_and_serves_again() {
    guarded(false).await;
}

#[tokio::test]
async fn the_memory_guard_finds_the_limit_through_a_cgroup_namespace() {
    guarded(true).await;
}

/// The load under the default memory guard; `namespaced`: the agent in a cgroup namespace of
/// its own, the host's cgroup mounts visible (Envoy's own reader fails there).
async fn guarded(namespaced: bool) {
    let cgroup = TestCgroup::new("guard", Some(LIMIT), None);
    let mut wrapper = cgroup.wrapper();
    if namespaced {
        let exec = wrapper[2].replace("exec \"$@\"", "exec unshare --cgroup \"$@\"");
        wrapper[2] = exec;
    }
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut agent = agent()
        .bootstrap(buffering_bootstrap())
        .wrapper(&wrapper)
        .start()
        .await;
    let container = status(&agent).await.settings.unwrap().container.unwrap();
    assert_eq!(container.memory_limit_bytes, Some(LIMIT), "{container:?}");
    assert_eq!(
        container.memory_guard_heap_bytes,
        Some((LIMIT as f64 * 0.85) as u64)
    );
    assert!(
        container
            .memory_cgroup
            .ends_with(&*cgroup.memory_dir().to_string_lossy()),
        "{container:?}"
    );
    let envoy = agent.envoy_pid();
    let addr = agent.listener("buffered").await;
    let uploads = load(addr);
    let (ok, refused, failures) = outcome(&uploads).await;
    assert!(
        agent.running(),
        "the agent and envoy are up:\n{}",
        agent.stderr()
    );
    assert_eq!(agent.envoy_pid(), envoy, "the same envoy serves");
    assert_eq!(cgroup.oom_kills(), 0, "no OOM kill");
    assert!(
        ok >= 20 && refused >= 1,
        "{ok} answered, {refused} turned away"
    );
    assert_eq!(
        failures,
        0,
        "every upload was answered:\n{}",
        uploads.describe()
    );
    // The pressure is gone: served again within the overload manager's refresh.
    eventually("served again after the load", PATIENCE, || async {
        let r = http_get(addr, "/").await.ok()?;
        (r.status == 200).then_some(())
    })
    .await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_plain_sigkill_is_not_called_an_oom_kill() {
    let cgroup = TestCgroup::new("kill", Some(LIMIT), None);
    let builder = agent().bootstrap(buffering_bootstrap());
    let message = builder.dir().join("termination-log");
    let message_arg = message.display().to_string();
    let wrapper = cgroup.wrapper();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut agent = builder
        .wrapper(&wrapper)
        .args(&["--termination-message-path", &message_arg])
        .start()
        .await;
    kill(Pid::from_raw(agent.envoy_pid() as i32), Signal::SIGKILL).unwrap();
    assert_eq!(agent.exit().await.code(), Some(137));
    agent.wait_event("exit", "exit_path", "proxy_exited").await;
    assert!(agent.events("oom_killed").is_empty());
    let message = std::fs::read_to_string(&message).unwrap();
    assert!(!message.contains("OOM"), "{message}");
}

#[tokio::test]
async fn a_one_cpu_quota_gives_one_worker_and_connections_are_bounded() {
    let cgroup = TestCgroup::new("cpu", None, Some(1.0));
    let mut wrapper = cgroup.wrapper();
    wrapper[2] = wrapper[2].replace("exec \"$@\"", "exec unshare --cgroup \"$@\"");
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let mut agent = agent().wrapper(&wrapper).agents_workers().start().await;
    let container: pb::Container = status(&agent).await.settings.unwrap().container.unwrap();
    assert_eq!(container.cpu_quota, Some(1.0), "{container:?}");
    assert_eq!(container.concurrency, Some(1), "{container:?}");
    assert!(container.workers.contains("CPU quota"), "{container:?}");
    assert!(
        container.max_downstream_connections.is_some(),
        "{container:?}"
    );
    let (code, stats, err) = crate::grpc::cli(
        &agent,
        &["admin", "GET", "/stats?filter=^server.concurrency$"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        stats.trim(),
        "server.concurrency: 1",
        "envoy runs one worker"
    );
    assert_eq!(
        agent.count_in_stderr(
            "no configured limit to the number of allowed active downstream connections"
        ),
        0,
        "envoy knows its bound:\n{}",
        agent.stderr()
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

//! The shutdown's timeline (issue 38, item 5): readiness off, Envoy's health checks failing
//! (`POST /healthcheck/fail`), the drain and the stop, each at its offset from the signal.
//! End to end in both modes, with the real Envoy and a bootstrap whose listener has an HTTP
//! `health_check` filter (`/hc`): after SIGTERM `/hc` answers 200 until the health-check step
//! and 503 after it, while other requests still succeed; the steps are logged in the
//! configured order; a timeline that cannot fit is refused at start. The fits and refusals
//! are unit-tested in `agent/src/config/timeline.rs`, the clock in `agent/src/agent/shutdown.rs`.

use envoy_agent::client::connect;
use envoy_agent::grpc::GrpcAddress;
use envoy_agent_tests::{AgentProcess, PATIENCE, bootstrap_yaml, bootstrap_yaml_on, eventually};
use nix::sys::signal::Signal;

use crate::exit_paths::{Mode, agent_in, both_modes};
use crate::grpc::get_status;

/// The kit's bootstrap (on the mode's ports) with a `health_check` filter answering `/hc`
/// itself (not passed through): 200 until Envoy's health checks fail, 503 after.
fn with_health_check(yaml: String) -> String {
    let filter = r#"          http_filters:
          - name: envoy.filters.http.health_check
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.health_check.v3.HealthCheck
              pass_through_mode: false
              headers:
              - name: ":path"
                string_match: { exact: "/hc" }
"#;
    assert!(yaml.contains("          http_filters:\n"), "{yaml}");
    yaml.replacen("          http_filters:\n", filter, 1)
}

async fn start(mode: Mode, args: &[&str]) -> AgentProcess {
    let builder = agent_in(mode);
    let yaml = match builder.ports() {
        Some(p) => bootstrap_yaml_on(p.admin_port, p.listener_port, "hello"),
        None => bootstrap_yaml("hello"),
    };
    builder
        .bootstrap(with_health_check(yaml))
        .args(args)
        .start()
        .await
}

/// The status code of `GET path` on a fresh connection, read as soon as the response's head
/// is in: a draining Envoy may keep the connection open for a while after the answer, which
/// reading to its end would wait out.
async fn code(addr: std::net::SocketAddr, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(head)
    };
    let head = tokio::time::timeout(PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| panic!("GET {path}: no answer"))
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let head = String::from_utf8_lossy(&head);
    head.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("GET {path}: not an HTTP response: {head:?}"))
}

both_modes!(health_checks_fail_at_their_offset_while_requests_still_succeed);

/// Drain at once, readiness kept until 3 s, health checks failing at 5 s, the stop by 8 s.
async fn health_checks_fail_at_their_offset_while_requests_still_succeed(mode: Mode) {
    let mut agent = start(
        mode,
        &[
            "--drain-delay",
            "0s",
            "--not-ready-at",
            "3s",
            "--healthcheck-fail-at",
            "5s",
            "--termination-drain-duration",
            "8s",
        ],
    )
    .await;
    let timeline = agent
        .wait_event("shutdown_timeline", "fail_health_checks_ms", "5000")
        .await;
    assert_eq!(
        timeline["order"], "drain,not_ready,fail_health_checks,stop",
        "{timeline}"
    );
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    let mut client = connect(&addr, PATIENCE).await.unwrap();
    let settings = get_status(&mut client).await.settings.unwrap();
    let t = settings.shutdown_timeline.unwrap();
    assert_eq!(t.fail_health_checks.unwrap().seconds, 5);
    assert_eq!(t.not_ready.unwrap().seconds, 3);
    assert_eq!(t.stop_by.unwrap().seconds, 8);

    let listener = agent.listener("hello").await;
    let status = agent.status();
    assert_eq!(code(listener, "/hc").await, 200, "passing while serving");

    agent.signal(Signal::SIGTERM);
    agent.wait_event("shutdown_step", "step", "drain").await;
    // Before --not-ready-at and --healthcheck-fail-at: draining, still ready, still healthy.
    assert_eq!(code(status, "/healthz/ready").await, 200, "ready until 3 s");
    assert_eq!(code(listener, "/hc").await, 200, "healthy until 5 s");
    assert_eq!(code(listener, "/").await, 200);

    agent.wait_event("shutdown_step", "step", "not_ready").await;
    eventually("readiness off", PATIENCE, || async {
        (code(status, "/healthz/ready").await == 503).then_some(())
    })
    .await;

    agent
        .wait_event("shutdown_step", "step", "fail_health_checks")
        .await;
    agent
        .wait_event("healthcheck_fail_accepted", "level", "INFO")
        .await;
    assert_eq!(code(listener, "/hc").await, 503, "failing after 5 s");
    assert_eq!(code(listener, "/").await, 200, "requests still succeed");

    assert_eq!(agent.exit().await.code(), Some(0));
    agent
        .wait_event("exit", "exit_path", "drain_time_elapsed")
        .await;
    let steps: Vec<String> = agent
        .events("shutdown_step")
        .iter()
        .map(|e| e["step"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(steps, ["drain", "not_ready", "fail_health_checks", "stop"]);
    assert!(
        agent.events("healthcheck_fail_request_failed").is_empty(),
        "{}",
        agent.stderr()
    );
}

both_modes!(by_default_health_checks_fail_with_the_drain);

/// Today's order: readiness off, then (at the same instant) health checks failing and the
/// drain after --drain-delay.
async fn by_default_health_checks_fail_with_the_drain(mode: Mode) {
    let mut agent = start(
        mode,
        &["--drain-delay", "1s", "--termination-drain-duration", "2s"],
    )
    .await;
    let listener = agent.listener("hello").await;
    agent.signal(Signal::SIGTERM);
    agent
        .wait_event("healthcheck_fail_accepted", "level", "INFO")
        .await;
    assert_eq!(code(listener, "/hc").await, 503);
    assert_eq!(code(listener, "/").await, 200);
    assert_eq!(agent.exit().await.code(), Some(0));
    let steps: Vec<String> = agent
        .events("shutdown_step")
        .iter()
        .map(|e| e["step"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(steps, ["not_ready", "fail_health_checks", "drain", "stop"]);
}

/// Each case: the arguments, the environment, what the refusal must name. (As a node proxy:
/// the kit's sidecar waits for Envoy's admin address, which a refused start never writes; the
/// fit is the same code in both modes.)
#[tokio::test]
async fn a_timeline_that_cannot_fit_is_refused_at_start_naming_the_flags() {
    type Case = (
        &'static [&'static str],
        &'static [(&'static str, &'static str)],
        &'static [&'static str],
    );
    let cases: [Case; 3] = [
        (
            &[
                "--healthcheck-fail-at",
                "20s",
                "--termination-drain-duration",
                "5s",
            ],
            &[],
            &[
                "--healthcheck-fail-at",
                "--termination-drain-duration",
                "--drain-delay",
            ],
        ),
        (
            // 90 s less the stop grace and the agent's exit: a stop by 83 s.
            &["--not-ready-at", "100s", "--drain-delay", "2s"],
            &[("ENVOY_AGENT_SHUTDOWN_BUDGET", "90s")],
            &["--not-ready-at", "--shutdown-budget", "--drain-delay"],
        ),
        (
            &[],
            &[
                ("ENVOY_AGENT_HEALTHCHECK_FAIL_AT", "6s"),
                ("ENVOY_AGENT_TERMINATION_DRAIN_DURATION", "5s"),
            ],
            &["--healthcheck-fail-at", "--termination-drain-duration"],
        ),
    ];
    for (args, env, named) in cases {
        crate::shutdown_budget::refused_at_start(Mode::NodeProxy, args, env, named).await;
    }
}

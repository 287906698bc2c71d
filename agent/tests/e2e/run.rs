//! `envoy-agent run` basics: serving, exit codes, bad input, signals to Envoy.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use envoy_agent_proxy::ServerState;
use envoy_agent_tests::{
    PATIENCE, TestDir, admin_request, envoy_path, eventually, http_get, process_alive,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::{AGENT, agent};

#[tokio::test]
async fn run_serves_traffic_and_passes_on_sigkill_as_137() {
    let mut agent = agent()
        .bootstrap(envoy_agent_tests::bootstrap_yaml("hello through the agent"))
        .start()
        .await;
    let info = agent.admin.server_info().await.unwrap();
    assert_eq!(info.state, ServerState::Live);

    let response = http_get(agent.listener("hello").await, "/").await.unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(response.body, "hello through the agent");

    let envoy = agent.envoy_pid();
    kill(Pid::from_raw(envoy as i32), Signal::SIGKILL).unwrap();
    let status = agent.exit().await;
    assert_eq!(status.code(), Some(137), "death by SIGKILL is 128+9");
    // Not an OOM kill, and said so (issue 50): the machine's memory cgroup counts them.
    assert!(
        agent.stderr().contains("(SIGKILL, not by the OOM killer)"),
        "{}",
        agent.stderr()
    );
}

#[tokio::test]
async fn envoy_exiting_zero_makes_the_agent_exit_zero() {
    let mut agent = agent().start().await;
    // Envoy's own /quitquitquit: it exits 0 by itself.
    let response = admin_request(agent.admin.addr(), "POST", "/quitquitquit")
        .await
        .unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn envoy_in_its_own_process_group_gets_no_terminal_sigint() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", "100ms"])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    let agent_group = nix::unistd::getpgid(Some(Pid::from_raw(agent.pid() as i32))).unwrap();
    let envoy_group = nix::unistd::getpgid(Some(Pid::from_raw(envoy as i32))).unwrap();
    assert_ne!(
        agent_group, envoy_group,
        "a Ctrl-C to the agent's group misses envoy"
    );
    assert_eq!(
        envoy_group.as_raw() as u32,
        envoy,
        "envoy leads its own group"
    );
    agent.signal(Signal::SIGINT);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!process_alive(envoy));
}

#[tokio::test]
async fn config_cleanup_removes_the_bootstrap_after_exit() {
    let mut agent = agent()
        .args(&["--config-cleanup", "--termination-drain-duration", "0s"])
        .start()
        .await;
    let bootstrap = agent.dir.join("bootstrap.yaml");
    assert!(bootstrap.exists());
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!bootstrap.exists(), "bootstrap removed");
}

#[tokio::test]
async fn sigusr1_is_forwarded_to_envoy_which_keeps_serving() {
    let mut agent = agent()
        .args(&[
            "--proxy-log-level",
            "info",
            "--termination-drain-duration",
            "0s",
        ])
        .start()
        .await;
    agent.signal(Signal::SIGUSR1);
    eventually("envoy to log the SIGUSR1 it got", PATIENCE, || async {
        agent
            .stderr()
            .contains("caught SIGUSR1. Reopening access logs.")
            .then_some(())
    })
    .await;
    assert_eq!(
        agent.admin.server_info().await.unwrap().state,
        ServerState::Live
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// Runs the agent to completion with `args`, returning its exit code and stderr.
async fn run_to_exit(args: &[&OsStr]) -> (Option<i32>, String) {
    let output = tokio::time::timeout(
        PATIENCE,
        tokio::process::Command::new(AGENT)
            .args(args)
            .env_remove("ENVOY_PATH")
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .output(),
    )
    .await
    .expect("the agent exits")
    .expect("run the agent");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn os(s: &(impl AsRef<OsStr> + ?Sized)) -> &OsStr {
    s.as_ref()
}

#[tokio::test]
async fn bad_input_exits_64_naming_the_input() {
    let dir = TestDir::new();
    let envoy = envoy_path();
    let good = dir.bootstrap("good.yaml", "x");
    let no_admin = dir.write("no-admin.yaml", "static_resources: {}\n");
    let not_yaml = dir.write("not-yaml.yaml", "admin: [unclosed\n");
    let missing = dir.join("missing.yaml");
    let unreadable = dir.join("a-directory.yaml");
    std::fs::create_dir(&unreadable).unwrap();
    let no_envoy = dir.join("no-envoy-binary");

    // (bootstrap, envoy binary, what the message must name)
    let cases: Vec<(&Path, &Path, &Path)> = vec![
        (&missing, &envoy, &missing),
        (&unreadable, &envoy, &unreadable),
        (&not_yaml, &envoy, &not_yaml),
        (&no_admin, &envoy, &no_admin),
        (&good, &no_envoy, &no_envoy),
    ];
    for (bootstrap, binary, named) in cases {
        let full = [
            os("run"),
            os("-c"),
            bootstrap.as_os_str(),
            os("--envoy-path"),
            binary.as_os_str(),
            os("--status-address"),
            os("127.0.0.1:0"),
        ];
        let (code, stderr) = run_to_exit(&full).await;
        assert_eq!(code, Some(64), "{full:?} exits 64: {stderr}");
        let lines: Vec<_> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "one clear line: {stderr}");
        assert!(
            stderr.contains(&named.display().to_string()),
            "{full:?}: the message names {}: {stderr}",
            named.display()
        );
    }

    // A bare binary name not on PATH.
    let (code, stderr) = run_to_exit(&[
        os("run"),
        os("-c"),
        good.as_os_str(),
        os("--envoy-path"),
        os("surely-no-envoy-named-like-this"),
    ])
    .await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(
        stderr.contains("surely-no-envoy-named-like-this"),
        "{stderr}"
    );
    assert!(
        stderr.contains("install-envoy.sh"),
        "says how to fix it: {stderr}"
    );
}

#[tokio::test]
async fn bad_flag_values_exit_64_naming_the_flag() {
    let dir = TestDir::new();
    let good = dir.bootstrap("good.yaml", "x");
    for (flag, value) in [
        ("--termination-drain-duration", "5 parsecs"),
        ("--drain-delay", "soon"),
        ("--status-address", "not-an-address"),
        ("--exclude-listener-ports", "http"),
    ] {
        let (code, stderr) =
            run_to_exit(&[os("run"), os("-c"), good.as_os_str(), os(flag), os(value)]).await;
        assert_eq!(code, Some(64), "{flag} {value}: {stderr}");
        assert!(stderr.contains(flag), "names {flag}: {stderr}");
    }
    // The same through the environment.
    let output = tokio::process::Command::new(AGENT)
        .args([os("run"), os("-c"), good.as_os_str()])
        .env("ENVOY_AGENT_MINIMUM_DRAIN_DURATION", "1 fortnight")
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(64), "{stderr}");
    assert!(stderr.contains("--minimum-drain-duration"), "{stderr}");
}

#[tokio::test]
async fn a_status_address_on_envoys_admin_port_is_refused() {
    let dir = TestDir::new();
    let admin = envoy_agent_tests::free_port();
    let bootstrap = dir.write(
        "fixed.yaml",
        &envoy_agent_tests::bootstrap_yaml_on(admin, envoy_agent_tests::free_port(), "x"),
    );
    for status in [format!("127.0.0.1:{admin}"), format!("0.0.0.0:{admin}")] {
        let (code, stderr) = run_to_exit(&[
            os("run"),
            os("-c"),
            bootstrap.as_os_str(),
            os("--status-address"),
            os(&status),
        ])
        .await;
        assert_eq!(code, Some(64), "{status}: {stderr}");
        assert!(
            stderr.contains("--status-address") && stderr.contains(&status),
            "names the flag and the address: {stderr}"
        );
    }
}

#[tokio::test]
async fn hot_restart_flags_without_hot_restart_are_refused_not_ignored() {
    let dir = TestDir::new();
    let good = dir.bootstrap("good.yaml", "x");
    for (flag, value) in [
        ("--base-id", Some("7")),
        ("--parent-shutdown-time", Some("30s")),
        ("--handoff-deadline", Some("10s")),
        ("--watch-config", None),
        ("--ready-marker", Some("/tmp/ready")),
        ("--state-dir", Some("/tmp/state")),
        ("--identity", Some("pod-a")),
    ] {
        let mut args = vec![os("run"), os("-c"), good.as_os_str(), os(flag)];
        args.extend(value.map(os));
        let (code, stderr) = run_to_exit(&args).await;
        assert_eq!(code, Some(64), "{flag}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains("--hot-restart"),
            "names {flag} and what it needs: {stderr}"
        );
    }
    // --hot-restart without what it needs.
    let (code, stderr) = run_to_exit(&[
        os("run"),
        os("-c"),
        good.as_os_str(),
        os("--hot-restart"),
        os("--base-id"),
        os("7"),
    ])
    .await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("--state-dir"), "{stderr}");
}

#[tokio::test]
async fn a_status_address_in_use_exits_69_naming_it() {
    address_in_use_exits_69("--status-address").await;
}

#[tokio::test]
async fn a_grpc_address_in_use_exits_69_naming_it() {
    address_in_use_exits_69("--grpc-address").await;
}

/// `flag` (a server's TCP address) given a port another process holds: the agent exits 69
/// naming it. A busy port may come free: EX_UNAVAILABLE, which supervisors retry (64 is not
/// retried).
async fn address_in_use_exits_69(flag: &str) {
    let dir = TestDir::new();
    let good = dir.bootstrap("good.yaml", "x");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let envoy = envoy_path();
    let mut args = vec![
        os("run"),
        os("-c"),
        good.as_os_str(),
        os("--envoy-path"),
        envoy.as_os_str(),
        os(flag),
        os(&addr),
    ];
    if flag != "--status-address" {
        // The other server out of the way.
        args.extend([os("--status-address"), os("127.0.0.1:0")]);
    }
    let (code, stderr) = run_to_exit(&args).await;
    assert_eq!(code, Some(69), "{stderr}");
    assert!(stderr.contains(&addr), "{stderr}");
}

#[tokio::test]
async fn a_config_envoy_rejects_passes_envoys_code_and_reason_on() {
    let dir = TestDir::new();
    let bad = dir.write(
        "rejected.yaml",
        "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}\n\
         static_resources: {listeners: [{name: no_address_here}]}\n",
    );
    let envoy = envoy_path();
    let (code, stderr) = run_to_exit(&[
        os("run"),
        os("-c"),
        bad.as_os_str(),
        os("--envoy-path"),
        envoy.as_os_str(),
        os("--status-address"),
        os("127.0.0.1:0"),
    ])
    .await;
    assert_eq!(code, Some(1), "envoy's own exit code: {stderr}");
    assert!(
        stderr.contains("error adding listener named 'no_address_here'"),
        "envoy's reason is shown: {stderr}"
    );
    // A start that failed, said as such (issue 51), in both modes.
    assert!(
        stderr.contains("envoy failed to start (exit 1)"),
        "{stderr}"
    );
}

#[tokio::test]
async fn envoy_does_not_outlive_a_killed_agent() {
    let mut agent = agent().start().await;
    let envoy = agent.envoy_pid();
    agent.signal(Signal::SIGKILL);
    assert_eq!(agent.exit().await.code(), None, "killed");
    eventually("envoy to exit with its agent", PATIENCE, || async {
        (!process_alive(envoy)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn json_logs_are_one_object_per_line_with_fields() {
    let mut agent = agent()
        .args(&["--log-format", "json", "--termination-drain-duration", "0s"])
        .start()
        .await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    let stderr = agent.stderr();
    // Envoy's own lines pass through as Envoy wrote them; the agent's are JSON.
    let ours: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(ours.len() >= 5, "{stderr}");
    assert!(
        ours.iter()
            .all(|l| l["level"].is_string() && l["message"].is_string())
    );
    let started = ours
        .iter()
        .find(|l| l["message"] == "envoy started")
        .expect("an envoy started event");
    assert_eq!(started["epoch"], 0);
    assert_eq!(started["event"], "envoy_started");
    assert!(
        ours.iter()
            .any(|l| l["event"] == "agent_state" && l["state"] == "live"),
        "every state change is an event: {stderr}"
    );
    assert!(started["pid"].as_u64().unwrap() > 0);
    assert!(
        !stderr
            .lines()
            .any(|l| l.starts_with("20") && l.contains(" INFO ")),
        "no text lines"
    );
}

/// CPU time (user + system) of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<u64> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|f| f.parse().unwrap())
        .collect();
    fields.iter().sum()
}

/// An idle agent waits on events: it does not spin. A spinning task burns a whole core (about
/// 200 ticks in two seconds); the bound is a tenth of that core, far above an idle agent's ~0.
#[tokio::test]
async fn an_idle_agent_does_not_spin() {
    for hot_restart in [false, true] {
        let builder = if hot_restart {
            agent().hot_restart()
        } else {
            agent()
        };
        let mut agent = builder
            .args(&["--termination-drain-duration", "0s"])
            .start()
            .await;
        let before = cpu_ticks(agent.pid());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let used = cpu_ticks(agent.pid()) - before;
        assert!(
            used < 20,
            "hot restart {hot_restart}: {used} ticks of CPU in 2s idle"
        );
        agent.signal(Signal::SIGTERM);
        assert_eq!(agent.exit().await.code(), Some(0));
    }
}

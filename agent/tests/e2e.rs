//! End-to-end: the real `envoy-agent` binary running the real Envoy, driven with real signals.

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};

use envoy_agent_proxy::{AdminClient, ServerState};
use envoy_agent_tests::{
    PATIENCE, TestDir, admin_address_from_file, children_of, envoy_path, eventually, http_get,
    http_request, process_alive,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const AGENT: &str = env!("CARGO_BIN_EXE_envoy-agent");

/// The agent running Envoy on a port-0 bootstrap, with its admin address known.
struct Agent {
    child: Child,
    admin: AdminClient,
    dir: TestDir,
    /// Everything the agent (and Envoy through it) wrote to stderr so far.
    stderr: Arc<Mutex<String>>,
}

impl Agent {
    async fn start(extra: &[&str]) -> Agent {
        let dir = TestDir::new();
        let bootstrap = dir.bootstrap("bootstrap.yaml", "hello through the agent");
        let admin_file = dir.join("admin-address");
        let mut command = agent();
        command
            .arg("run")
            .arg("-c")
            .arg(&bootstrap)
            .arg("--envoy-path")
            .arg(envoy_path())
            .args(["--status-address", "127.0.0.1:0", "--status-address-file"])
            .arg(dir.join("status-address"))
            .args(extra)
            .args(["--", "--concurrency", "1", "--admin-address-path"])
            .arg(&admin_file)
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("start envoy-agent");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = BufReader::new(child.stderr.take().expect("piped")).lines();
        tokio::spawn({
            let stderr = stderr.clone();
            async move {
                while let Ok(Some(line)) = pipe.next_line().await {
                    eprintln!("{line}");
                    let mut s = stderr.lock().unwrap();
                    s.push_str(&line);
                    s.push('\n');
                }
            }
        });
        let admin = AdminClient::new(admin_address_from_file(&admin_file).await);
        eventually("envoy to be LIVE", PATIENCE, || async {
            matches!(admin.server_info().await, Ok(i) if i.state == ServerState::Live).then_some(())
        })
        .await;
        Agent {
            child,
            admin,
            dir,
            stderr,
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn pid(&self) -> u32 {
        self.child.id().expect("agent running")
    }

    fn envoy_pid(&self) -> u32 {
        let children = children_of(self.pid());
        assert_eq!(
            children.len(),
            1,
            "the agent has one child, envoy: {children:?}"
        );
        children[0]
    }

    async fn exit(mut self) -> ExitStatus {
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the agent exits")
            .expect("wait")
    }
}

fn agent() -> Command {
    let mut command = Command::new(AGENT);
    command
        .env_remove("ENVOY_PATH")
        .env("ENVOY_AGENT_LOG", "debug")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    command
}

async fn hello_listener(admin: &AdminClient) -> std::net::SocketAddr {
    admin
        .listeners()
        .await
        .expect("listeners")
        .into_iter()
        .find(|l| l.name == "hello")
        .and_then(|l| l.local_address)
        .expect("hello listener bound")
}

#[tokio::test]
async fn run_serves_traffic_and_passes_on_sigkill_as_137() {
    let agent = Agent::start(&[]).await;
    let info = agent.admin.server_info().await.unwrap();
    assert_eq!(info.state, ServerState::Live);

    let response = http_get(hello_listener(&agent.admin).await, "/")
        .await
        .unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(response.body, "hello through the agent");

    let envoy = agent.envoy_pid();
    kill(Pid::from_raw(envoy as i32), Signal::SIGKILL).unwrap();
    let status = agent.exit().await;
    assert_eq!(status.code(), Some(137), "death by SIGKILL is 128+9");
}

#[tokio::test]
async fn envoy_exiting_zero_makes_the_agent_exit_zero() {
    let agent = Agent::start(&[]).await;
    // Envoy's own /quitquitquit: it exits 0 by itself.
    let response = http_request(agent.admin.addr(), "POST", "/quitquitquit")
        .await
        .unwrap();
    assert_eq!(response.status, 200);
    let status = agent.exit().await;
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn sigterm_stops_envoy_and_exits_zero() {
    let agent = Agent::start(&["--stop-grace", "10s"]).await;
    let envoy = agent.envoy_pid();
    kill(Pid::from_raw(agent.pid() as i32), Signal::SIGTERM).unwrap();
    let status = agent.exit().await;
    assert_eq!(status.code(), Some(0));
    assert!(
        !process_alive(envoy),
        "envoy {envoy} was stopped and reaped"
    );
}

#[tokio::test]
async fn envoy_in_its_own_process_group_gets_no_terminal_sigint() {
    let agent = Agent::start(&[]).await;
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
    kill(Pid::from_raw(agent.pid() as i32), Signal::SIGINT).unwrap();
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn config_cleanup_removes_the_bootstrap_after_exit() {
    let agent = Agent::start(&["--config-cleanup"]).await;
    let bootstrap = agent.dir.join("bootstrap.yaml");
    assert!(bootstrap.exists());
    kill(Pid::from_raw(agent.pid() as i32), Signal::SIGTERM).unwrap();
    let Agent { mut child, dir, .. } = agent;
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(!bootstrap.exists(), "bootstrap removed");
    drop(dir);
}

/// Runs the agent to completion with `args`, returning its exit code and stderr.
async fn run_to_exit(args: &[&std::ffi::OsStr]) -> (Option<i32>, String) {
    let output = tokio::time::timeout(PATIENCE, agent().args(args).stderr(Stdio::piped()).output())
        .await
        .expect("the agent exits")
        .expect("run the agent");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn os(s: &(impl AsRef<std::ffi::OsStr> + ?Sized)) -> &std::ffi::OsStr {
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
    ])
    .await;
    assert_eq!(code, Some(1), "envoy's own exit code: {stderr}");
    assert!(
        stderr.contains("error adding listener named 'no_address_here'"),
        "envoy's reason is shown: {stderr}"
    );
    assert!(stderr.contains("envoy exited with code 1"), "{stderr}");
}

#[tokio::test]
async fn sigusr1_is_forwarded_to_envoy_which_keeps_serving() {
    let agent = Agent::start(&["--proxy-log-level", "info"]).await;
    kill(Pid::from_raw(agent.pid() as i32), Signal::SIGUSR1).unwrap();
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
    kill(Pid::from_raw(agent.pid() as i32), Signal::SIGTERM).unwrap();
    assert_eq!(agent.exit().await.code(), Some(0));
}

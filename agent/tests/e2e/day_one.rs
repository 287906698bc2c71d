//! What operators hit on day one, each tried as a new user would, with the real binary and
//! the real Envoy: flags at their defaults, extra Envoy arguments, config updates, sockets,
//! browsers, exit codes, signals and logs.

use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::process::Stdio;

use envoy_agent_tests::{PATIENCE, TestDir, envoy_path, eventually, http_get, live_at, serves};
use nix::sys::signal::Signal;

use crate::{AGENT, agent};

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

/// 1. Exit-on-zero at its defaults (5 s minimum, 5 s termination drain duration) counts, and
///    with no connection at all it exits because there is none, not at a deadline.
#[tokio::test]
async fn exit_on_zero_at_its_defaults_exits_on_zero_connections() {
    let mut agent = agent()
        .args(&["--exit-on-zero-active-connections"])
        .start()
        .await;
    agent.wait_event("config_warning", "level", "WARN").await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    agent
        .wait_event("exit", "exit_path", "zero_connections")
        .await;
    assert!(
        !agent
            .events_with("active_connections", "active_connections", "0")
            .is_empty()
            || agent.events("active_connections").is_empty(),
        "counted"
    );
}

/// 2. Extra Envoy arguments that repeat a flag the agent passes win (Envoy refuses a flag
///    given twice); those that would break a guarantee are refused, naming what to use.
#[tokio::test]
async fn extra_envoy_args_win_or_are_refused_naming_the_agent_flag() {
    let mut agent = agent()
        .args(&["--", "-l", "debug", "--drain-strategy", "gradual"])
        .start()
        .await;
    let pid = agent.envoy_pid();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert_eq!(args.iter().filter(|a| *a == "-l").count(), 1, "{args:?}");
    let l = args.iter().position(|a| a == "-l").unwrap();
    assert_eq!(args[l + 1], "debug", "{args:?}");
    assert_eq!(
        args.iter().filter(|a| *a == "--drain-strategy").count(),
        1,
        "{args:?}"
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));

    let dir = TestDir::new();
    let good = dir.bootstrap("good.yaml", "x");
    let envoy = envoy_path();
    for extra in [
        &["-c", "/etc/other.yaml"][..],
        &["--restart-epoch", "2"][..],
        &["--base-id", "3"][..],
    ] {
        let mut args = vec![
            os("run"),
            os("-c"),
            good.as_os_str(),
            os("--envoy-path"),
            envoy.as_os_str(),
            os("--"),
        ];
        args.extend(extra.iter().map(os));
        let (code, stderr) = run_to_exit(&args).await;
        assert_eq!(code, Some(64), "{extra:?}: {stderr}");
        assert!(stderr.contains(extra[0]), "names it: {stderr}");
    }
}

/// 3. UpdateConfig: one at a time, each validating its own bytes; with --watch-config, an
///    accepted update restarts once, not twice. Also from the `update-config` subcommand.
#[tokio::test]
async fn config_updates_are_serialised_and_restart_once() {
    let mut agent = agent()
        .hot_restart()
        .args(&[
            "--drain-time",
            "1s",
            "--parent-shutdown-time",
            "2s",
            "--watch-config",
        ])
        .start()
        .await;
    let p = agent.ports.unwrap();
    let path = agent.dir.join("bootstrap.yaml");
    let good = envoy_agent_tests::bootstrap_yaml_on(p.admin_port, p.listener_port, "updated");
    let bad = good.replace("direct_response", "no_such_field");
    let good_file = agent.dir.write("good-update.yaml", &good);
    let bad_file = agent.dir.write("bad-update.yaml", &bad);
    // Both at once, many times: the rejected one never reaches the file.
    let good_args = ["update-config", good_file.to_str().unwrap()];
    let bad_args = ["update-config", bad_file.to_str().unwrap()];
    for round in 0..3 {
        let (a, b) = tokio::join!(
            crate::grpc::cli(&agent, &good_args),
            crate::grpc::cli(&agent, &bad_args),
        );
        assert_eq!(a.0, 0, "round {round}: the good one: {a:?}");
        assert_eq!(b.0, 1, "round {round}: the bad one: {b:?}");
        assert!(b.2.contains("no_such_field"), "envoy's reason: {b:?}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), good);
        // Each accepted update restarts onto it, once.
        assert!(
            a.1.contains(&format!("epoch {} is LIVE", round + 1)),
            "round {round}: {a:?}"
        );
    }
    live_at(&agent.admin, 3).await;
    // A sentinel write by hand: had the agent's own writes come back through the watch, this
    // would land later than epoch 4.
    let sentinel = envoy_agent_tests::bootstrap_yaml_on(p.admin_port, p.listener_port, "sentinel");
    envoy_agent_proxy::write_atomically(&path, sentinel.as_bytes()).unwrap();
    live_at(&agent.admin, 4).await;
    let hello = std::net::SocketAddr::from(([127, 0, 0, 1], p.listener_port));
    serves(hello, "sentinel").await;
    let candidates: Vec<String> = std::fs::read_dir(agent.dir.path())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("candidate"))
        .collect();
    assert!(candidates.is_empty(), "no candidate left: {candidates:?}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// 4, 5. Durations Envoy takes in whole seconds are refused unless whole; zero deadlines too.
#[tokio::test]
async fn sub_second_and_zero_durations_are_refused_naming_the_flag() {
    let dir = TestDir::new();
    let good = dir.bootstrap("good.yaml", "x");
    for (args, flag) in [
        (&["--drain-time", "500ms"][..], "--drain-time"),
        (
            &[
                "--hot-restart",
                "--base-id",
                "1",
                "--state-dir",
                "/tmp/x",
                "--drain-time",
                "2s",
                "--parent-shutdown-time",
                "2900ms",
            ][..],
            "--parent-shutdown-time",
        ),
        (
            &[
                "--hot-restart",
                "--base-id",
                "1",
                "--state-dir",
                "/tmp/x",
                "--handoff-deadline",
                "0s",
            ][..],
            "--handoff-deadline",
        ),
        (
            &["--admin-unresponsive-deadline", "0s"][..],
            "--admin-unresponsive-deadline",
        ),
        (
            &["--drain-poll-interval", "0s"][..],
            "--drain-poll-interval",
        ),
    ] {
        let mut all = vec![os("run"), os("-c"), good.as_os_str()];
        all.extend(args.iter().map(os));
        let (code, stderr) = run_to_exit(&all).await;
        assert_eq!(code, Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "names {flag}: {stderr}");
    }
    // The ordering rule holds on what Envoy gets: 2s and 2s are refused.
    let mut all = vec![os("run"), os("-c"), good.as_os_str()];
    all.extend(
        [
            "--hot-restart",
            "--base-id",
            "1",
            "--state-dir",
            "/tmp/x",
            "--drain-time",
            "2s",
            "--parent-shutdown-time",
            "2s",
        ]
        .iter()
        .map(os),
    );
    let (code, stderr) = run_to_exit(&all).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("must exceed --drain-time"), "{stderr}");
}

/// 6. A second agent on the same gRPC socket does not take the first one's over; a web page
///    cannot POST /quitquitquit to the status server.
#[tokio::test]
async fn a_second_agent_never_steals_the_socket_and_browsers_cannot_quit() {
    let mut first = agent().start().await;
    let (code, stderr) = run_to_exit(&[
        os("--grpc-address"),
        os(&first.grpc),
        os("run"),
        os("-c"),
        first.dir.join("bootstrap.yaml").as_os_str(),
        os("--envoy-path"),
        envoy_path().as_os_str(),
        os("--status-address"),
        os("127.0.0.1:0"),
    ])
    .await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("another agent is serving on"), "{stderr}");
    let (code, out, _) = crate::grpc::cli(&first, &["status", "--json"]).await;
    assert_eq!(code, 0, "the first agent keeps its socket: {out}");

    let response = envoy_agent_tests::http_request_with(
        first.status(),
        "POST",
        "/quitquitquit",
        &[
            ("Origin", "https://evil.example"),
            ("Sec-Fetch-Site", "cross-site"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(response.status, 403, "{response:?}");
    assert!(first.running());
    let response = envoy_agent_tests::http_request(first.status(), "POST", "/quitquitquit")
        .await
        .unwrap();
    assert_eq!(response.status, 200, "curl-like clients still can");
    assert_eq!(first.exit().await.code(), Some(0));
}

/// 8. An Envoy binary this user may not execute, and a script whose interpreter is missing,
///    exit 64 with the real cause.
#[tokio::test]
async fn unusable_envoy_binaries_exit_64_with_the_real_cause() {
    let dir = TestDir::new();
    let good = dir.bootstrap("good.yaml", "x");
    let no_exec = dir.write("envoy-no-exec", "#!/bin/sh\n");
    std::fs::set_permissions(&no_exec, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, stderr) = run_to_exit(&[
        os("run"),
        os("-c"),
        good.as_os_str(),
        os("--envoy-path"),
        no_exec.as_os_str(),
    ])
    .await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("may not execute"), "{stderr}");

    let script = dir.write("envoy-script", "#!/no/such/interpreter\n");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (code, stderr) = run_to_exit(&[
        os("run"),
        os("-c"),
        good.as_os_str(),
        os("--envoy-path"),
        script.as_os_str(),
    ])
    .await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("/no/such/interpreter"), "{stderr}");
}

/// 9. SIGUSR1 reaches every epoch that has reached LIVE, the draining parent too: both reopen
///    their access log after it was rotated (moved away).
#[tokio::test]
async fn sigusr1_makes_every_live_epoch_reopen_its_logs() {
    let builder = agent().hot_restart();
    let p = builder.ports().unwrap();
    let log = builder.dir().join("access.log");
    let bootstrap = envoy_agent_tests::bootstrap_yaml_on(p.admin_port, p.listener_port, "x")
        .replace(
            "          stat_prefix: hello\n",
            &format!(
                "          stat_prefix: hello\n          access_log:\n          - name: envoy.access_loggers.file\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n              path: {}\n",
                log.display()
            ),
        );
    let mut agent = builder
        .bootstrap(bootstrap)
        .args(&["--drain-time", "30s", "--parent-shutdown-time", "40s"])
        .start()
        .await;
    let hello = std::net::SocketAddr::from(([127, 0, 0, 1], p.listener_port));
    // A client of epoch 0's, which keeps it writing to its access log while it drains (Envoy
    // reopens a rotated log on its next write).
    let mut old_client = envoy_agent_tests::KeepAlive::connect(hello).await.unwrap();
    old_client.get("/").await.unwrap();
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    eventually("the supervisor to see epoch 1 LIVE", PATIENCE, || async {
        agent
            .events_with("epoch_state", "epoch", "1")
            .iter()
            .any(|e| e["state"] == "live")
            .then_some(())
    })
    .await;
    let envoys = agent.envoys();
    assert_eq!(envoys.len(), 2, "a draining parent and its child");
    std::fs::rename(&log, agent.dir.join("access.log.1")).unwrap();
    let writes_to = |pid: u32, name: &str| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|fds| {
                fds.filter_map(Result::ok)
                    .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                    .any(|target| target.file_name().is_some_and(|n| n == name))
            })
            .unwrap_or(false)
    };
    for pid in &envoys {
        assert!(
            writes_to(*pid, "access.log.1"),
            "{pid} has the rotated file"
        );
    }
    agent.signal(Signal::SIGUSR1);
    agent.wait_event("logs_reopened", "epochs", "2").await;
    // One request for each: the draining parent on its old connection, the child on a new one.
    old_client.get("/").await.unwrap();
    http_get(hello, "/").await.unwrap();
    for pid in envoys {
        eventually(
            &format!("envoy {pid} to reopen its access log"),
            PATIENCE,
            || async { writes_to(pid, "access.log").then_some(()) },
        )
        .await;
    }
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// 10. An explicit --log-level beats RUST_LOG.
#[tokio::test]
async fn an_explicit_log_level_beats_rust_log() {
    let dir = TestDir::new();
    let good = dir.bootstrap("good.yaml", "x");
    // An "Envoy" that exits 0 at once: the agent logs its start and its exit at INFO.
    let envoy = dir.write("envoy", "#!/bin/sh\nexit 0\n");
    std::fs::set_permissions(&envoy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let run = |level: Option<&'static str>| {
        let mut command = tokio::process::Command::new(AGENT);
        if let Some(level) = level {
            command.args(["--log-level", level]);
        }
        command
            .args([
                os("run"),
                os("-c"),
                good.as_os_str(),
                os("--envoy-path"),
                envoy.as_os_str(),
                os("--status-address"),
                os("127.0.0.1:0"),
                os("--grpc-address"),
            ])
            .arg(format!("unix:{}", dir.join("grpc.sock").display()))
            .env("RUST_LOG", "debug")
            .env_remove("ENVOY_AGENT_LOG_LEVEL")
            .stderr(Stdio::piped());
        async move {
            let output = tokio::time::timeout(PATIENCE, command.output())
                .await
                .unwrap()
                .unwrap();
            String::from_utf8_lossy(&output.stderr).into_owned()
        }
    };
    let with_rust_log = run(None).await;
    assert!(
        with_rust_log.contains("INFO"),
        "the run logs at INFO: {with_rust_log}"
    );
    let explicit = run(Some("error")).await;
    assert!(
        !explicit.contains("INFO") && !explicit.contains("DEBUG"),
        "--log-level error wins over RUST_LOG=debug: {explicit}"
    );
}

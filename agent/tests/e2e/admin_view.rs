//! What operators used Envoy's admin port for, through the agent: `envoy-agent admin GET`
//! (read-only views; an endpoint that changes Envoy refused, naming the agent's verb) and
//! `envoy-agent log-level` (kept across a hot restart), in both modes, and over TCP only for
//! the agent's own user (the views carry config and certificates).

use std::os::unix::fs::PermissionsExt;

use envoy_agent_tests::AgentProcess;
use nix::sys::signal::Signal;

use crate::agent;
use crate::grpc::cli;

/// Every logger's level line of `agent`'s serving Envoy (`  name: level`), asked of its admin
/// API directly.
async fn logger(agent: &AgentProcess, name: &str) -> String {
    let listing = agent.admin.loggers().await.unwrap();
    listing
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no logger {name} in {listing}"))
        .to_owned()
}

/// `admin GET /server_info` is Envoy's JSON; `/quitquitquit` is refused naming `envoy-agent
/// quit`, and Envoy serves on; the query is passed on with its encoding.
async fn views_of(mut agent: AgentProcess) {
    let envoy = agent.envoy_pid();
    let (code, out, err) = cli(&agent, &["admin", "GET", "/server_info"]).await;
    assert_eq!(code, 0, "{err}");
    let info: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(info["state"], "LIVE", "{info}");

    let (code, out, err) = cli(
        &agent,
        &["admin", "GET", "/stats?filter=%5Eserver%5C.live%24"],
    )
    .await;
    assert_eq!((code, out.trim()), (0, "server.live: 1"), "{err}");

    let (code, out, err) = cli(&agent, &["admin", "GET", "/quitquitquit"]).await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("InvalidArgument")
            && err.contains("/quitquitquit")
            && err.contains("envoy-agent quit"),
        "{err}"
    );
    let (code, _, err) = cli(&agent, &["admin", "GET", "/logging?level=debug"]).await;
    assert!(code == 1 && err.contains("envoy-agent log-level"), "{err}");
    let (code, _, err) = cli(&agent, &["admin", "POST", "/quitquitquit"]).await;
    assert_eq!(code, 64, "only GET: {err}");

    // A large view, whole and in order through its chunks.
    let (code, out, err) = cli(&agent, &["admin", "GET", "/config_dump?include_eds"]).await;
    assert_eq!(code, 0, "{err}");
    let dump: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        dump["configs"].as_array().is_some_and(|c| !c.is_empty()),
        "{out}"
    );

    assert!(agent.running(), "envoy serves on");
    assert_eq!(agent.envoy_pid(), envoy, "the same envoy");
    let (code, out, _) = cli(&agent, &["admin", "GET", "/ready"]).await;
    assert_eq!((code, out.trim()), (0, "LIVE"));
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_sidecars_admin_views_through_the_agent() {
    views_of(agent().start().await).await;
}

#[tokio::test]
async fn a_node_proxys_admin_views_through_the_agent_on_its_socket() {
    let agent = agent().hot_restart().start().await;
    assert!(
        agent.admin.addr().path().is_some(),
        "envoy's admin is the agent's socket"
    );
    views_of(agent).await;
}

/// `log-level debug` changes the serving Envoy's level, the status reports it, and the next
/// epoch of a hot restart starts with it; a component Envoy has no logger for changes nothing.
#[tokio::test]
async fn the_log_level_set_through_the_agent_survives_a_hot_restart() {
    let mut agent = agent().hot_restart().start().await;
    assert_eq!(logger(&agent, "upstream").await, "upstream: warning");
    let (code, out, err) = cli(&agent, &["log-level", "debug"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("log level is debug"), "{out}");
    assert_eq!(logger(&agent, "upstream").await, "upstream: debug");
    agent.wait_event("log_level", "log_level", "debug").await;

    let (code, _, err) = cli(&agent, &["log-level", "nosuch:trace"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("InvalidArgument") && err.contains("unknown logger name"),
        "{err}"
    );

    let (code, out, err) = cli(&agent, &["restart"]).await;
    assert_eq!((code, out.trim()), (0, "epoch 1 is LIVE"), "{err}");
    assert_eq!(
        logger(&agent, "upstream").await,
        "upstream: debug",
        "the new epoch started at the level set"
    );
    let (_, out, _) = cli(&agent, &["admin", "GET", "/server_info"]).await;
    let info: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(info["command_line_options"]["restart_epoch"], 1, "{info}");

    let (code, out, err) = cli(&agent, &["log-level", "upstream:trace"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("debug,upstream:trace"), "{out}");
    let (_, status, _) = cli(&agent, &["status", "--json"]).await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["settings"]["proxy_log_level"],
        "debug,upstream:trace"
    );
    assert_eq!(logger(&agent, "upstream").await, "upstream: trace");
    assert_eq!(logger(&agent, "http").await, "http: debug");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// A sidecar's Envoy takes the level too, and the status says what is in force.
#[tokio::test]
async fn a_sidecars_log_level_through_the_agent() {
    let mut agent = agent()
        .args(&["--proxy-log-level", "info,upstream:error"])
        .start()
        .await;
    let (_, status, _) = cli(&agent, &["status", "--json"]).await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["settings"]["proxy_log_level"], "info,upstream:error");
    let (code, out, err) = cli(&agent, &["log-level", "warning,http:debug"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(logger(&agent, "upstream").await, "upstream: warning");
    assert_eq!(logger(&agent, "http").await, "http: debug");
    let (code, _, err) = cli(&agent, &["log-level", "loud"]).await;
    assert_eq!(code, 64, "refused before the call: {err}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// Over TCP the views carry config and certificates: another user (uid 65534) on the same
/// loopback is refused them, and the log level too; the agent's own user is not.
#[tokio::test]
async fn over_tcp_a_neighbour_is_refused_the_views_and_the_log_level() {
    let grpc = format!("127.0.0.1:{}", envoy_agent_tests::free_port());
    let builder = agent();
    let dir = builder.dir().path().to_owned();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut agent = builder.args(&["--grpc-address", &grpc]).start().await;
    // The binary where uid 65534 can run it (the repository may sit in a private home).
    let binary = dir.join("envoy-agent");
    std::fs::copy(crate::AGENT, &binary).unwrap();
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = |args: &[&str]| crate::security::client_as_nobody(&binary, &grpc, args);
    for args in [
        &["admin", "GET", "/config_dump"][..],
        &["admin", "GET", "/certs"],
        &["log-level", "debug"],
    ] {
        let denied = as_nobody(args).await;
        let err = String::from_utf8_lossy(&denied.stderr);
        assert_eq!(denied.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("PermissionDenied") && err.contains("uid 65534"),
            "{args:?}: {err}"
        );
        assert!(denied.stdout.is_empty(), "nothing of envoy's: {args:?}");
    }
    agent.wait_event("grpc_refused", "uid", "65534").await;
    assert_eq!(logger(&agent, "upstream").await, "upstream: warning");
    let status = as_nobody(&["status"]).await;
    assert!(status.status.success(), "the status stays open");

    let (code, out, err) = cli(&agent, &["admin", "GET", "/server_info"]).await;
    assert_eq!(code, 0, "the agent's own user may: {err}");
    assert!(out.contains("\"LIVE\""), "{out}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

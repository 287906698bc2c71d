//! The controller API end to end (issue 17): GetStatus's typed fields in each mode over both
//! transports, checked against the flags given; WatchStatus through a drain with its deadline
//! and connection counts; Stop's graceful drain; ReopenLogs after a log rotation; and the
//! generated man page kept current.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::{
    AgentProcess, KeepAlive, PATIENCE, eventually, free_port, http_get, repo_root, slow_request,
};
use tokio_stream::StreamExt;

use crate::agent;
use crate::grpc::{cli, get_status};

type Client = pb::agent_service_client::AgentServiceClient<tonic::transport::Channel>;

async fn client(agent: &AgentProcess) -> Client {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    envoy_agent::client::connect(&addr, PATIENCE).await.unwrap()
}

fn time(t: &Option<prost_types::Timestamp>) -> SystemTime {
    SystemTime::try_from(t.expect("a time")).unwrap()
}

fn span(d: &Option<prost_types::Duration>) -> Duration {
    Duration::try_from(d.expect("a duration")).unwrap()
}

/// A bare `--envoy-path` is looked up on PATH: `GetStatus` says both what was given and the
/// binary that runs.
#[tokio::test]
async fn get_status_names_the_envoy_binary_found_on_path() {
    let envoy = envoy_agent_tests::envoy_path();
    let name = envoy.file_name().unwrap().to_str().unwrap().to_owned();
    let search = format!(
        "{}:{}",
        envoy.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let agent = agent()
        .envoy_path(std::path::PathBuf::from(&name))
        .env("PATH", &search)
        .start()
        .await;
    let s = get_status(&mut client(&agent).await)
        .await
        .settings
        .expect("settings");
    assert_eq!(s.envoy_path, name, "as given");
    assert_eq!(std::path::PathBuf::from(&s.envoy_binary), envoy, "as found");
}

/// `docs/envoy-agent.1` is the man page generated from the CLI; the filter `flag_reference`
/// runs this test with the flag reference's, and `UPDATE_FLAG_DOCS=1` rewrites both.
#[test]
fn flag_reference_man_page_is_current() {
    let path = repo_root().join("docs/envoy-agent.1");
    let generated = envoy_agent::config::cli::man_page().unwrap();
    if std::env::var_os("UPDATE_FLAG_DOCS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let on_disk = std::fs::read(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "docs/envoy-agent.1 is out of date: run `UPDATE_FLAG_DOCS=1 cargo test -p envoy-agent --test e2e flag_reference`"
    );
}

/// Which transport a test uses.
#[derive(Debug, Clone, Copy)]
enum Transport {
    Unix,
    Tcp,
}

/// The flags whose values GetStatus must report, beside their defaults' replacements.
const SETTINGS: &[&str] = &[
    "--drain-time",
    "7s",
    "--drain-strategy",
    "gradual",
    "--termination-drain-duration",
    "9s",
    "--minimum-drain-duration",
    "3s",
    "--exit-on-zero-active-connections",
    "--drain-delay",
    "250ms",
    "--drain-poll-interval",
    "75ms",
    "--exclude-listener-ports",
    "15021,7777",
    "--exclude-listener-prefixes",
    "metrics_,probe_",
    "--stop-grace",
    "4s",
];

/// GetStatus in `mode` over `transport`: the typed fields, checked against the flags given,
/// the Envoy processes the agent runs and what the test kit knows of the agent; the CLI's
/// `status --json` says the same.
async fn get_status_reports_typed_fields(node_proxy: bool, transport: Transport) {
    let mut builder = agent().args(SETTINGS);
    if node_proxy {
        builder = builder.hot_restart().args(&[
            "--parent-shutdown-time",
            "11s",
            "--handoff-deadline",
            "13s",
            "--admin-unresponsive-deadline",
            "17s",
            "--identity",
            "pod-typed",
        ]);
    }
    let grpc_address = match transport {
        Transport::Unix => None,
        Transport::Tcp => Some(format!("127.0.0.1:{}", free_port())),
    };
    if let Some(address) = &grpc_address {
        builder = builder.args(&["--grpc-address", address]);
    }
    let ports = builder.ports();
    let started = SystemTime::now();
    let mut agent = builder.start().await;
    match transport {
        Transport::Unix => assert!(agent.grpc.starts_with("unix:"), "{}", agent.grpc),
        Transport::Tcp => assert!(!agent.grpc.starts_with("unix:"), "{}", agent.grpc),
    }
    let mut c = client(&agent).await;
    // The newest epoch is LIVE for the test kit; the agent's status follows its own poll.
    let status = eventually("the agent live", PATIENCE, || {
        let mut c = c.clone();
        async move {
            let s = get_status(&mut c).await;
            (s.state() == pb::AgentState::Live).then_some(s)
        }
    })
    .await;
    let envoy = agent.envoy_pid();

    assert_eq!(
        status.mode(),
        if node_proxy {
            pb::Mode::NodeProxy
        } else {
            pb::Mode::Sidecar
        }
    );
    assert!(status.ready && !status.draining, "{status:?}");
    assert_eq!(status.reason, "");
    assert_eq!(status.drain_reason(), pb::DrainReason::Unspecified);
    assert_eq!(status.exit_path(), pb::ExitPath::Unspecified);
    assert_eq!(status.exit_code, None);
    assert!(status.drain.is_none(), "no drain: {status:?}");
    let since = time(&status.state_since);
    assert!(since >= started && since <= SystemTime::now(), "{since:?}");
    assert_eq!(status.newest_live_epoch, Some(0));
    assert_eq!(status.epochs.len(), 1, "{:?}", status.epochs);
    let epoch = &status.epochs[0];
    assert_eq!(
        (epoch.epoch, epoch.pid, epoch.state()),
        (0, envoy, pb::EpochState::Live)
    );
    let start = time(&epoch.start_time);
    assert!(start >= started && start <= since, "{start:?} {since:?}");
    assert!(time(&epoch.state_since) >= start);

    let s = status.settings.clone().expect("settings");
    assert_eq!(span(&s.drain_time), Duration::from_secs(7));
    assert_eq!(s.drain_strategy(), pb::DrainStrategy::Gradual);
    assert!(!s.drain_all_listeners);
    assert_eq!(span(&s.termination_drain_duration), Duration::from_secs(9));
    assert_eq!(span(&s.minimum_drain_duration), Duration::from_secs(3));
    assert!(s.exit_on_zero_active_connections);
    assert_eq!(s.exit_on_zero(), pb::ExitOnZero::Connections);
    assert_eq!(span(&s.drain_delay), Duration::from_millis(250));
    assert_eq!(span(&s.drain_poll_interval), Duration::from_millis(75));
    assert_eq!(s.exclude_listener_ports, [15021, 7777]);
    assert_eq!(s.exclude_listener_prefixes, ["metrics_", "probe_"]);
    assert_eq!(span(&s.stop_grace), Duration::from_secs(4));
    assert_eq!(
        std::path::PathBuf::from(&s.config_path),
        agent.dir.join("bootstrap.yaml")
    );
    assert_eq!(
        std::path::PathBuf::from(&s.envoy_path),
        envoy_agent_tests::envoy_path()
    );
    assert_eq!(s.envoy_binary, s.envoy_path, "a path is run as given");
    assert_eq!(s.admin_address, Some(agent.admin.addr().to_string()));
    assert_eq!(s.status_address, "127.0.0.1:0", "as configured");
    assert_eq!(s.grpc_address, agent.grpc);
    assert!(!s.grpc_allow_remote);

    if let Some(p) = ports {
        assert_eq!(span(&s.parent_shutdown_time), Duration::from_secs(11));
        assert_eq!(span(&s.handoff_deadline), Duration::from_secs(13));
        assert_eq!(
            span(&s.admin_unresponsive_deadline),
            Duration::from_secs(17)
        );
        // The handoff deadline plus the parent shutdown time plus a margin of 10 s.
        assert_eq!(span(&s.handover_timeout), Duration::from_secs(34));
        assert_eq!(s.base_id, Some(p.base_id));
        assert_eq!(
            s.state_dir.as_deref().map(std::path::PathBuf::from),
            Some(agent.dir.join("state"))
        );
        assert_eq!(
            s.ready_marker.as_deref().map(std::path::PathBuf::from),
            Some(agent.dir.join("ready"))
        );
        let family = status
            .family
            .clone()
            .expect("the family, in node-proxy mode");
        assert_eq!(family.base_id, p.base_id);
        assert!(
            family.hot_restart_version.starts_with("11."),
            "{}",
            family.hot_restart_version
        );
        assert!(
            family.identity.starts_with("pod-typed"),
            "{}",
            family.identity
        );
        assert_eq!(family.predecessor, None, "the node's first pod");
        assert_eq!(family.handed_over_to, None);
        assert_eq!(family.successor_starting, None);
        assert!(family.handoff.is_none() && family.wedges.is_empty() && !family.drained);
    } else {
        assert!(status.family.is_none(), "sidecar mode has no family");
        for unset in [
            &s.parent_shutdown_time,
            &s.handoff_deadline,
            &s.handover_timeout,
        ] {
            assert!(unset.is_none(), "node-proxy settings only there: {s:?}");
        }
        assert_eq!(
            span(&s.admin_unresponsive_deadline),
            Duration::from_secs(30),
            "both modes: the default"
        );
        assert_eq!((s.base_id, s.state_dir.as_ref()), (None, None));
    }

    // The CLI: the same status as JSON (proto field names, short enum values, RFC 3339 and
    // "9s"), and a summary for people.
    let (code, out, err) = cli(&agent, &["status", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        json["mode"],
        if node_proxy { "node_proxy" } else { "sidecar" },
        "{json}"
    );
    assert_eq!(json["state"], "live", "{json}");
    assert_eq!(json["ready"], true, "{json}");
    assert_eq!(json["newest_live_epoch"], 0, "{json}");
    assert!(
        json.get("drain_reason").is_none(),
        "unspecified is left out: {json}"
    );
    assert_eq!(json["epochs"][0]["pid"], envoy, "{json}");
    assert_eq!(json["epochs"][0]["state"], "live", "{json}");
    assert!(
        json["state_since"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{json}"
    );
    assert_eq!(
        json["settings"]["termination_drain_duration"], "9s",
        "{json}"
    );
    assert_eq!(json["settings"]["drain_strategy"], "gradual", "{json}");
    assert_eq!(
        json["settings"]["exclude_listener_ports"],
        serde_json::json!([15021, 7777])
    );
    if node_proxy {
        assert_eq!(json["family"]["base_id"], ports.unwrap().base_id, "{json}");
    }
    let (code, out, err) = cli(&agent, &["status"]).await;
    assert_eq!(code, 0, "{err}");
    let mode_line = if node_proxy { "node proxy" } else { "sidecar" };
    assert!(
        out.lines()
            .any(|l| l.starts_with("mode:") && l.contains(mode_line)),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.trim_start().starts_with("0 ") && l.contains(&envoy.to_string())),
        "the epoch line: {out}"
    );

    c.quit_quit_quit(pb::QuitQuitQuitRequest {}).await.unwrap();
    assert_eq!(agent.exit().await.code(), Some(0));
}

mod get_status_reports_typed_fields {
    use super::Transport;

    #[tokio::test]
    async fn sidecar_unix() {
        super::get_status_reports_typed_fields(false, Transport::Unix).await;
    }

    #[tokio::test]
    async fn sidecar_tcp() {
        super::get_status_reports_typed_fields(false, Transport::Tcp).await;
    }

    #[tokio::test]
    async fn node_proxy_unix() {
        super::get_status_reports_typed_fields(true, Transport::Unix).await;
    }

    #[tokio::test]
    async fn node_proxy_tcp() {
        super::get_status_reports_typed_fields(true, Transport::Tcp).await;
    }
}

/// WatchStatus through an exit-on-zero drain started by `Stop`: the drain with its reason,
/// start and deadline (start + the termination drain duration), then the connection count
/// of a held keep-alive connection and when it was taken; once the connection closes, the
/// exit by zero connections with its exit code.
#[tokio::test]
async fn watch_status_shows_a_drain_with_its_deadline_and_counts() {
    let mut agent = agent()
        .args(&[
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "300ms",
            "--termination-drain-duration",
            "30s",
        ])
        .start()
        .await;
    let mut keep = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    keep.get("/").await.unwrap();
    let mut c = client(&agent).await;
    let mut watch = c
        .watch_status(pb::WatchStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = watch.next().await.unwrap().unwrap().status.unwrap();
    assert_eq!(
        first.state(),
        pb::AgentState::Live,
        "the status when the watch began"
    );

    let asked = SystemTime::now();
    c.stop(pb::StopRequest {}).await.unwrap();
    let counted = tokio::time::timeout(PATIENCE, async {
        loop {
            let s = watch.next().await.unwrap().unwrap().status.unwrap();
            if s.drain
                .as_ref()
                .is_some_and(|d| d.active_connections.is_some())
            {
                return s;
            }
        }
    })
    .await
    .expect("a counted drain within the test's patience");
    assert_eq!(counted.state(), pb::AgentState::Draining);
    assert_eq!(
        counted.drain_reason(),
        pb::DrainReason::Stop,
        "Stop takes the SIGTERM path, under its own name (issue 31)"
    );
    assert_eq!(counted.drain_phase(), pb::DrainPhase::Draining);
    assert!(!counted.ready && counted.draining);
    let drain = counted.drain.unwrap();
    assert_eq!(drain.reason(), pb::DrainReason::Stop);
    assert_eq!(drain.active_connections, Some(1), "the held connection");
    let start = time(&drain.start_time);
    assert!(
        start >= asked - Duration::from_millis(5),
        "{start:?} {asked:?}"
    );
    let deadline = time(&drain.deadline);
    let window = deadline.duration_since(start).unwrap();
    assert!(
        window >= Duration::from_secs(30) && window < Duration::from_secs(31),
        "deadline {window:?} after the start"
    );
    let count_time = time(&drain.count_time);
    assert!(
        count_time >= start + Duration::from_millis(300),
        "counted after the minimum drain duration: {:?}",
        count_time.duration_since(start)
    );

    // The count is what the CLI's JSON shows too.
    let (_, out, _) = cli(&agent, &["status", "--json"]).await;
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(json["drain"]["active_connections"], 1, "{json}");
    assert_eq!(json["drain"]["reason"], "stop", "{json}");
    assert!(json["drain"]["deadline"].is_string(), "{json}");

    drop(keep);
    let exiting = tokio::time::timeout(PATIENCE, async {
        while let Some(Ok(r)) = watch.next().await {
            let s = r.status.unwrap();
            if s.state() == pb::AgentState::Exiting {
                return Some(s);
            }
        }
        None
    })
    .await
    .unwrap()
    .expect("the exit in the stream");
    assert_eq!(exiting.exit_path(), pb::ExitPath::ZeroConnections);
    assert_eq!(exiting.exit_code, Some(0));
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// `Stop` is the SIGTERM path: readiness goes, Envoy drains gracefully, a slow request in
/// flight completes, then Envoy is stopped at the termination drain duration and the agent
/// exits 0. Sidecar mode through the RPC, node-proxy mode through `envoy-agent stop`.
async fn stop_drains_gracefully(node_proxy: bool) {
    let mut builder = agent().args(&["--termination-drain-duration", "4s"]);
    if node_proxy {
        builder = builder.hot_restart();
    }
    let mut agent = builder.start().await;
    let envoy = agent.envoy_pid();
    let listener: SocketAddr = agent.listener("hello").await;
    let mut keep = KeepAlive::connect(listener).await.unwrap();
    assert!(!keep.get("/").await.unwrap().connection_close());
    // In flight when Stop comes; answered two seconds later, inside the drain.
    let slow = slow_request(listener, Duration::from_secs(2));
    eventually("the slow request in flight", PATIENCE, || async {
        let stats = agent
            .admin
            .stats("http.hello.downstream_rq_active$", false)
            .await
            .ok()?;
        stats
            .lines()
            .any(|l| l.trim().ends_with(": 1"))
            .then_some(())
    })
    .await;

    let stopped_at = std::time::Instant::now();
    if node_proxy {
        let (code, out, err) = cli(&agent, &["stop"]).await;
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.starts_with("stopping"), "{out}");
    } else {
        let mut c = client(&agent).await;
        c.stop(pb::StopRequest {}).await.unwrap();
    }
    agent.wait_event("drain_accepted", "level", "INFO").await;
    let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(agent.running(), "draining, not stopped");
    // The drain reached Envoy: the keep-alive client is told to close.
    assert!(keep.get("/").await.unwrap().connection_close());
    let slow = slow.await.unwrap().unwrap();
    assert_eq!(slow.status, 200, "the in-flight request completed");

    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(
        stopped_at.elapsed() >= Duration::from_secs(4),
        "the whole termination drain duration: {:?}",
        stopped_at.elapsed()
    );
    assert!(!envoy_agent_tests::process_alive(envoy));
    agent
        .wait_event("exit", "exit_path", "drain_time_elapsed")
        .await;
}

#[tokio::test]
async fn stop_drains_gracefully_sidecar() {
    stop_drains_gracefully(false).await;
}

#[tokio::test]
async fn stop_drains_gracefully_node_proxy() {
    stop_drains_gracefully(true).await;
}

/// `ReopenLogs` (the RPC, then `envoy-agent reopen-logs`) makes Envoy reopen its access log:
/// the file is rotated (moved away), and after the call Envoy writes the next request to a new
/// file at the configured path.
#[tokio::test]
async fn reopen_logs_makes_envoy_reopen_its_access_log() {
    let builder = agent();
    let log = builder.dir().join("access.log");
    let bootstrap = envoy_agent_tests::bootstrap_yaml("x").replace(
        "          stat_prefix: hello\n",
        &format!(
            "          stat_prefix: hello\n          access_log:\n          - name: envoy.access_loggers.file\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n              path: {}\n              log_format: {{ text_format_source: {{ inline_string: \"%REQ(:PATH)%\\n\" }} }}\n",
            log.display()
        ),
    );
    let mut agent = builder
        .bootstrap(bootstrap)
        .args(&["--file-flush-interval", "100ms"])
        .start()
        .await;
    let hello = agent.listener("hello").await;
    let read = |path: &std::path::Path| std::fs::read_to_string(path).unwrap_or_default();
    http_get(hello, "/before").await.unwrap();
    eventually("the first request logged", PATIENCE, || async {
        read(&log).contains("/before").then_some(())
    })
    .await;

    // Rotation by the RPC.
    let rotated = agent.dir.join("access.log.1");
    std::fs::rename(&log, &rotated).unwrap();
    let mut c = client(&agent).await;
    let reopened = c
        .reopen_logs(pb::ReopenLogsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reopened.envoys_signalled, 1, "the one LIVE envoy");
    http_get(hello, "/after-rpc").await.unwrap();
    eventually("the new access log written", PATIENCE, || async {
        read(&log).contains("/after-rpc").then_some(())
    })
    .await;
    assert!(
        !read(&rotated).contains("/after-rpc"),
        "not in the rotated file"
    );

    // Rotation by the CLI.
    let rotated = agent.dir.join("access.log.2");
    std::fs::rename(&log, &rotated).unwrap();
    let (code, out, err) = cli(&agent, &["reopen-logs"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("1 envoy"), "{out}");
    http_get(hello, "/after-cli").await.unwrap();
    eventually("the next access log written", PATIENCE, || async {
        read(&log).contains("/after-cli").then_some(())
    })
    .await;
    assert!(!read(&rotated).contains("/after-cli"));

    c.quit_quit_quit(pb::QuitQuitQuitRequest {}).await.unwrap();
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// The example collector config is well-formed: every pipeline component is defined, the OTLP
/// receiver listens for gRPC on `0.0.0.0:4317` (OTLP/gRPC's default port, the one of the
/// example endpoint in the file's header comment), and the file names
/// `OTEL_EXPORTER_OTLP_ENDPOINT`.
#[test]
fn the_example_collector_config_is_consistent() {
    let text = std::fs::read_to_string(repo_root().join("docs/otel-collector.yaml")).unwrap();
    let config: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    let pipeline = &config["service"]["pipelines"]["metrics"];
    for (kind, section) in [
        ("receivers", "receivers"),
        ("processors", "processors"),
        ("exporters", "exporters"),
    ] {
        let names = pipeline[kind].as_sequence().unwrap();
        assert!(!names.is_empty(), "{kind}");
        for name in names {
            let name = name.as_str().unwrap();
            assert!(
                config[section].get(name).is_some(),
                "{kind}: {name} is not defined under {section}"
            );
        }
    }
    assert_eq!(
        config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"],
        "0.0.0.0:4317"
    );
    assert!(text.contains("OTEL_EXPORTER_OTLP_ENDPOINT"));
}

/// `envoy-agent completions <shell>` prints a script the shell accepts, naming every
/// subcommand; an unknown shell is a usage error.
#[tokio::test]
async fn completions_for_each_shell() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = tokio::process::Command::new(crate::AGENT)
            .args(["completions", shell])
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout).unwrap();
        for sub in ["run", "status", "stop", "reopen-logs", "update-config"] {
            assert!(script.contains(sub), "{shell} completions lack {sub}");
        }
        if shell == "bash" {
            let dir = envoy_agent_tests::TestDir::new();
            let path = dir.write("envoy-agent.bash", &script);
            let check = std::process::Command::new("bash")
                .arg("-n")
                .arg(&path)
                .output()
                .unwrap();
            assert!(check.status.success(), "bash -n: {check:?}");
        }
    }
    let out = tokio::process::Command::new(crate::AGENT)
        .args(["completions", "tcsh"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{out:?}");
}

/// The cross-pod facts over gRPC (node proxy, two pods of one node in PID namespaces of their
/// own): the successor names its predecessor and its first handoff; the predecessor is handed
/// over to the successor, not ready, and once the successor's Envoy has terminated its own,
/// has no epoch left and the exit in its history.
#[tokio::test]
async fn cross_pod_facts_name_predecessor_and_successor() {
    let node = crate::cross_pod::Node::new();
    let mut a = node.pod("pod-a").start().await;
    let mut b = node.pod("pod-b").start().await;
    envoy_agent_tests::live_at(&node.admin(), 1).await;

    let cb = client(&b).await;
    let status_b = eventually("pod-b live at epoch 1", PATIENCE, || {
        let mut cb = cb.clone();
        async move {
            let s = get_status(&mut cb).await;
            (s.state() == pb::AgentState::Live && s.newest_live_epoch == Some(1)).then_some(s)
        }
    })
    .await;
    let family_b = status_b.family.unwrap();
    assert!(family_b.identity.starts_with("pod-b-"), "{family_b:?}");
    let predecessor = family_b.predecessor.clone().expect("a predecessor");
    assert!(predecessor.starts_with("pod-a-"), "{predecessor}");
    let first = family_b
        .last_handoff
        .clone()
        .expect("the takeover's handoff");
    assert_eq!(
        (first.epoch, first.outcome()),
        (1, pb::HandoffOutcome::Live)
    );

    let ca = client(&a).await;
    let status_a = eventually("pod-a handed over", PATIENCE, || {
        let mut ca = ca.clone();
        async move {
            let s = get_status(&mut ca).await;
            (s.state() == pb::AgentState::HandedOver).then_some(s)
        }
    })
    .await;
    assert_eq!(status_a.successor, Some(family_b.identity.clone()));
    assert!(!status_a.ready && status_a.draining, "{status_a:?}");
    let family_a = status_a.family.unwrap();
    assert_eq!(family_a.identity, predecessor);
    assert_eq!(family_a.handed_over_to, Some(family_b.identity.clone()));

    // pod-b's Envoy terminates pod-a's after the parent shutdown time (2s).
    let gone = eventually("pod-a's envoy terminated by pod-b's", PATIENCE, || {
        let mut ca = ca.clone();
        async move {
            let s = get_status(&mut ca).await;
            let exits = &s.family.as_ref()?.exits;
            (s.epochs.is_empty() && !exits.is_empty()).then_some(s)
        }
    })
    .await;
    let exit = gone.family.unwrap().exits.last().cloned().unwrap();
    assert_eq!(exit.epoch, 0, "{exit:?}");
    assert!(
        exit.time.is_some() && !exit.description.is_empty(),
        "{exit:?}"
    );
    let (_, out, _) = cli(&a, &["status"]).await;
    assert!(out.contains("handed over to"), "{out}");
    assert!(out.contains("envoy exit:"), "{out}");

    a.signal_agent(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    b.signal_agent(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

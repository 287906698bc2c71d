//! In-process tests of the proxy and drain crates against the real Envoy (and, where a real
//! Envoy cannot misbehave on purpose, against a fake).

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_agent_drain::{Exclusions, active_connections, drain_listeners};
use envoy_agent_proxy::admin::Readiness;
use envoy_agent_proxy::{
    AdminAddress, AdminClient, AdminError, DrainOptions, Ended, Envoy, EpochState, Exit, Proxy,
    ProxyConfig, ProxyError, ProxyPhase, Scope, ServerState,
};
use envoy_agent_tests::{PATIENCE, TestDir, envoy_path, eventually, http_get, silent_server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A real Envoy running in the background of a test.
struct Running {
    envoy: Arc<Envoy>,
    abort: CancellationToken,
    task: JoinHandle<Result<Ended, ProxyError>>,
    admin: AdminClient,
    _dir: TestDir,
}

impl Running {
    async fn start(body: &str) -> Running {
        let dir = TestDir::new();
        let bootstrap = dir.bootstrap("bootstrap.yaml", body);
        let mut config = ProxyConfig::new(
            envoy_path(),
            bootstrap,
            AdminAddress::FromFile(dir.join("admin-address")),
        );
        config.options.concurrency = 1;
        config.options.drain_time = Duration::from_secs(2);
        Self::start_with(dir, config).await
    }

    async fn start_with(dir: TestDir, config: ProxyConfig) -> Running {
        let envoy = Arc::new(Envoy::new(config));
        let abort = CancellationToken::new();
        let task = tokio::spawn({
            let (envoy, abort) = (envoy.clone(), abort.clone());
            async move { envoy.run(abort).await }
        });
        let mut addr = envoy.watch_admin_address();
        let addr = tokio::time::timeout(PATIENCE, addr.wait_for(Option::is_some))
            .await
            .expect("envoy publishes its admin address")
            .expect("envoy is running")
            .clone()
            .expect("address");
        let admin = AdminClient::new(addr);
        eventually("envoy to be LIVE", PATIENCE, || async {
            matches!(admin.server_info().await, Ok(i) if i.state == ServerState::Live).then_some(())
        })
        .await;
        Running {
            envoy,
            abort,
            task,
            admin,
            _dir: dir,
        }
    }

    async fn listener(&self) -> SocketAddr {
        let listeners = self.admin.listeners().await.expect("listeners");
        listeners
            .iter()
            .find(|l| l.name == "hello")
            .and_then(|l| l.local_address)
            .expect("the hello listener is bound")
    }

    async fn stop(self) -> Exit {
        self.abort.cancel();
        let ended = tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("envoy stops")
            .expect("run task")
            .expect("run");
        match ended {
            Ended::Stopped { last: Some(exit) } => exit,
            other => panic!("stopped, not {other:?}"),
        }
    }
}

#[tokio::test]
async fn envoy_serves_and_admin_reads_server_info() {
    let envoy = Running::start("hello").await;
    let info = envoy.admin.server_info().await.unwrap();
    assert_eq!(info.state, ServerState::Live);
    assert_eq!(info.restart_epoch, 0);
    assert_eq!(info.hot_restart_version, "disabled");
    assert!(info.version.contains("/1.40."), "{}", info.version);
    assert_eq!(envoy.admin.ready().await.unwrap(), Readiness::Ready);

    let response = http_get(envoy.listener().await, "/").await.unwrap();
    assert_eq!((response.status, response.body.as_str()), (200, "hello"));

    let pid = (*envoy.envoy.pid().borrow()).expect("pid while running");
    let exit = envoy.stop().await;
    assert!(exit.aborted);
    assert_eq!(exit.pid, pid);
    assert_eq!(
        exit.code(),
        0,
        "SIGTERM makes envoy exit 0: {}",
        exit.stderr_tail
    );
}

#[tokio::test]
async fn stats_filter_and_active_connections_count_an_open_connection() {
    let envoy = Running::start("hi").await;
    let listener = envoy.listener().await;
    // One keep-alive connection stays open through the count.
    let mut conn = tokio::net::TcpStream::connect(listener).await.unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = conn.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));

    let stats = envoy
        .admin
        .stats("downstream_cx_active$", true)
        .await
        .unwrap();
    assert!(
        stats.contains("listener.127.0.0.1_"),
        "filtered stats name the listener: {stats}"
    );
    assert!(
        stats.lines().all(|l| l.contains("downstream_cx_active")),
        "{stats}"
    );

    let count = active_connections(&envoy.admin, &Exclusions::default())
        .await
        .unwrap();
    assert_eq!(count, 1, "{stats}");
    // Envoy names a listener's stats after its *configured* address: port 0 here, not the
    // port it bound. Exclusions match the configured port.
    assert!(
        stats.contains("listener.127.0.0.1_0.downstream_cx_active"),
        "{stats}"
    );
    let excluded = Exclusions::with_ports([0]);
    assert_eq!(
        active_connections(&envoy.admin, &excluded).await.unwrap(),
        0
    );

    drop(conn);
    eventually("the closed connection to be gone", PATIENCE, || async {
        (active_connections(&envoy.admin, &Exclusions::default())
            .await
            .ok()?
            == 0)
            .then_some(())
    })
    .await;
    envoy.stop().await;
}

#[tokio::test]
async fn drain_with_skip_exit_keeps_accepting_and_closes_connections() {
    let envoy = Running::start("draining").await;
    let listener = envoy.listener().await;
    drain_listeners(&envoy.admin, false, true).await.unwrap();
    // Still serving, but telling clients to go away.
    let response = eventually("a drain-marked response", PATIENCE, || async {
        let r = http_get(listener, "/").await.ok()?;
        r.headers
            .iter()
            .any(|(k, v)| k == "connection" && v.eq_ignore_ascii_case("close"))
            .then_some(r)
    })
    .await;
    assert_eq!(response.status, 200);
    // A second drain is accepted too (Envoy answers 200 to a duplicate drain).
    let plan = envoy
        .envoy
        .drain(DrainOptions {
            listeners: Scope::All,
            skip_exit: true,
            hold_notice: false,
        })
        .await
        .unwrap();
    assert!(!plan.inbound_only);
    let drained: Vec<&str> = plan.drained.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(drained, ["hello"], "named as configured");
    envoy.stop().await;
}

#[tokio::test]
async fn healthcheck_fail_makes_envoy_not_ready() {
    let envoy = Running::start("hc").await;
    envoy.admin.healthcheck_fail().await.unwrap();
    let info = envoy.admin.server_info().await.unwrap();
    assert_eq!(info.state, ServerState::Draining);
    match envoy.admin.ready().await.unwrap() {
        Readiness::NotReady(state) => assert_eq!(state, "DRAINING"),
        Readiness::Ready => panic!("ready after /healthcheck/fail"),
    }
    envoy.stop().await;
}

#[tokio::test]
async fn the_state_stream_follows_envoy_from_start_to_exit() {
    let envoy = Running::start("s").await;
    let mut state = envoy.envoy.state();
    let serving = tokio::time::timeout(PATIENCE, state.wait_for(|s| s.serving()))
        .await
        .expect("serving")
        .expect("state")
        .clone();
    assert_eq!(serving.newest_live, Some(0));
    assert_eq!(serving.epochs.len(), 1);
    assert_eq!(serving.epochs[0].state, EpochState::Live);
    assert!(serving.family.is_none(), "one envoy, no family");
    let pid = serving.epochs[0].pid;
    let exit = envoy.stop().await;
    assert_eq!(exit.pid, pid);
    assert_eq!(state.borrow().phase, ProxyPhase::Exited);
    assert!(state.borrow().epochs.is_empty());
}

#[tokio::test]
async fn update_config_validates_then_replaces_the_bootstrap_atomically() {
    let envoy = Running::start("v1").await;
    let path = envoy.envoy.config().config_path.clone();
    let new = envoy_agent_tests::bootstrap_yaml("v2");
    let applied = envoy
        .envoy
        .update_config(new.clone().into_bytes(), "test".to_owned())
        .await
        .unwrap();
    assert_eq!(
        applied.restarted_epoch, None,
        "no hot restart: nothing restarts"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), new);

    let bad = new.replace("direct_response", "no_such_field");
    let err = envoy
        .envoy
        .update_config(bad.into_bytes(), "test".to_owned())
        .await
        .unwrap_err();
    assert!(matches!(err, ProxyError::ConfigRejected { .. }), "{err}");
    assert!(
        err.to_string().contains("no_such_field"),
        "envoy's reason: {err}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), new, "unchanged");
    let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("candidate"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "no candidate file left: {leftovers:?}"
    );
    envoy.stop().await;
}

#[tokio::test]
async fn a_rejected_config_exits_with_envoys_reason_in_the_stderr_tail() {
    let dir = TestDir::new();
    let bootstrap = dir.write(
        "bad.yaml",
        "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}\n\
         static_resources: {listeners: [{name: x, no_such_field: 1}]}\n",
    );
    let config = ProxyConfig::new(
        envoy_path(),
        bootstrap,
        AdminAddress::FromFile(dir.join("admin")),
    );
    let envoy = Envoy::new(config);
    let ended = tokio::time::timeout(PATIENCE, envoy.run(CancellationToken::new()))
        .await
        .expect("envoy exits")
        .expect("envoy ran");
    // Never LIVE: a start that failed (issue 51), with Envoy's reason.
    let Ended::StartFailed { code, message } = ended else {
        panic!("a failed start: {ended:?}");
    };
    assert_ne!(code, 0);
    assert!(
        message.contains("error adding listener named 'x'"),
        "Envoy's reason: {message}"
    );
}

#[tokio::test]
async fn a_missing_binary_is_a_spawn_error_naming_it() {
    let dir = TestDir::new();
    let config = ProxyConfig::new(
        dir.join("no-envoy-here"),
        dir.bootstrap("b.yaml", "x"),
        AdminAddress::FromFile(dir.join("admin")),
    );
    let err = Envoy::new(config)
        .run(CancellationToken::new())
        .await
        .unwrap_err();
    assert!(matches!(err, ProxyError::Spawn { .. }), "{err}");
    assert!(err.to_string().contains("no-envoy-here"), "{err}");
}

#[tokio::test]
async fn admin_call_to_a_silent_server_fails_within_its_timeout() {
    let addr = silent_server().await;
    let client = AdminClient::new(addr).with_timeout(Duration::from_millis(300));
    let started = Instant::now();
    let err = client.server_info().await.unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, AdminError::Timeout { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains(&addr.to_string()),
        "names the address: {message}"
    );
    assert!(
        message.contains("/server_info"),
        "names the endpoint: {message}"
    );
    // Generous upper bound: the point is that it returns at all, not how fast.
    assert!(took < PATIENCE, "took {took:?}");

    let err = client
        .drain_listeners(Default::default())
        .await
        .unwrap_err();
    assert!(matches!(err, AdminError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("/drain_listeners"), "{err}");
}

#[tokio::test]
async fn admin_call_to_a_closed_port_is_a_connect_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let err = AdminClient::new(addr).ready().await.unwrap_err();
    assert!(matches!(err, AdminError::Connect { .. }), "{err}");
    assert!(err.to_string().contains("/ready"), "{err}");
}

#[tokio::test]
async fn a_non_200_answer_is_a_status_error() {
    let envoy = Running::start("x").await;
    // A drain flag Envoy does not know is refused with an HTTP error.
    let err = envoy.admin.stats("(", false).await.unwrap_err();
    assert!(matches!(err, AdminError::Status { .. }), "{err}");
    envoy.stop().await;
}

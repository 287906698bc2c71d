//! The gRPC API end to end: a tonic client and the client subcommands, over a Unix socket and
//! TCP, against the agent and the hot-restart supervisor running the real Envoy.

use std::process::Stdio;

use envoy_agent::client::connect;
use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::{
    AgentProcess, KeepAlive, PATIENCE, eventually, free_port, http_get, serves,
};
use nix::sys::signal::Signal;
use tokio_stream::StreamExt;

use crate::{AGENT, agent};

async fn client(
    agent: &AgentProcess,
) -> pb::agent_service_client::AgentServiceClient<tonic::transport::Channel> {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    connect(&addr, PATIENCE).await.unwrap()
}

/// GetStatus's status.
pub(crate) async fn get_status(
    c: &mut pb::agent_service_client::AgentServiceClient<tonic::transport::Channel>,
) -> pb::Status {
    c.get_status(pb::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner()
        .status
        .expect("GetStatus carries a status")
}

/// Runs `envoy-agent <args>` against `agent`, returning exit code and stdout+stderr.
pub(crate) async fn cli(agent: &AgentProcess, args: &[&str]) -> (i32, String, String) {
    let output = tokio::time::timeout(
        PATIENCE,
        tokio::process::Command::new(AGENT)
            .args(["--grpc-address", &agent.grpc])
            .args(args)
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The agent's gRPC health status for its service, over its own address.
pub(crate) async fn health_status(agent: &AgentProcess) -> i32 {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    let channel = match addr {
        GrpcAddress::Unix(socket) => tonic::transport::Endpoint::from_static("http://localhost")
            .connect_with_connector(tower::service_fn(move |_| {
                let socket = socket.clone();
                async move {
                    tokio::net::UnixStream::connect(socket)
                        .await
                        .map(hyper_util::rt::TokioIo::new)
                }
            }))
            .await
            .unwrap(),
        GrpcAddress::Tcp(a) => tonic::transport::Endpoint::from_shared(format!("http://{a}"))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    };
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: envoy_agent::grpc::SERVICE_NAME.to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

#[tokio::test]
async fn agent_over_a_unix_socket_status_drain_health_reflection_and_quit() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", "1h"])
        .start()
        .await;
    assert!(agent.grpc.starts_with("unix:"));
    let socket = agent.grpc.trim_start_matches("unix:").to_owned();
    let mode = std::fs::metadata(&socket).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600
    );

    let mut c = client(&agent).await;
    let status = get_status(&mut c).await;
    assert_eq!(
        (status.mode(), status.state(), status.ready),
        (pb::Mode::Sidecar, pb::AgentState::Live, true)
    );

    let (code, out, _) = cli(&agent, &["status", "--json"]).await;
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(json["state"], "live");
    assert_eq!(json["mode"], "sidecar");

    // Health: SERVING, then NOT_SERVING once draining.
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                tokio::net::UnixStream::connect(socket)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let check = || tonic_health::pb::HealthCheckRequest {
        service: envoy_agent::grpc::SERVICE_NAME.to_owned(),
    };
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    assert_eq!(
        health.check(check()).await.unwrap().into_inner().status,
        serving
    );

    // Reflection lists the service.
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel);
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let mut replies = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let reply = replies.next().await.unwrap().unwrap();
    let listed = format!("{:?}", reply.message_response);
    assert!(listed.contains(envoy_agent::grpc::SERVICE_NAME), "{listed}");

    let (code, out, err) = cli(&agent, &["drain", "--skip-exit"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let mut keep = KeepAlive::connect(agent.listener("hello").await)
        .await
        .unwrap();
    assert!(keep.get("/").await.unwrap().connection_close(), "draining");
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    eventually("health NOT_SERVING", PATIENCE, || {
        let mut health = health.clone();
        async move {
            (health.check(check()).await.ok()?.into_inner().status == not_serving).then_some(())
        }
    })
    .await;
    let status = get_status(&mut c).await;
    assert_eq!(
        (status.state(), status.draining, status.drain_reason()),
        (pb::AgentState::Draining, true, pb::DrainReason::GrpcDrain)
    );

    // Hot restart is off here: refused, and the CLI says so with exit 1.
    let err = c
        .hot_restart(pb::HotRestartRequest { reason: "x".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    let (code, _, err) = cli(&agent, &["restart"]).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("hot restart is off"), "{err}");

    let (code, _, _) = cli(&agent, &["quit"]).await;
    assert_eq!(code, 0);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn agent_over_tcp_and_an_unreachable_agent() {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut agent = agent()
        .args(&[
            "--grpc-address",
            &addr,
            "--termination-drain-duration",
            "1h",
        ])
        .start()
        .await;
    let mut c = client(&agent).await;
    let status = get_status(&mut c).await;
    assert_eq!(status.state(), pb::AgentState::Live);
    // DisableDraining: the next SIGTERM stops at once (the drain would last an hour).
    c.disable_draining(pb::DisableDrainingRequest {})
        .await
        .unwrap();
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    agent
        .wait_event("exit", "exit_path", "signal_after_drain")
        .await;

    // DrainNow and QuitQuitQuit over TCP.
    let mut agent = super::agent()
        .args(&[
            "--grpc-address",
            &addr,
            "--termination-drain-duration",
            "1h",
        ])
        .start()
        .await;
    let mut c = client(&agent).await;
    c.drain_now(pb::DrainNowRequest {}).await.unwrap();
    let status = get_status(&mut c).await;
    assert_eq!(status.state(), pb::AgentState::Draining);
    c.quit_quit_quit(pb::QuitQuitQuitRequest {}).await.unwrap();
    assert_eq!(agent.exit().await.code(), Some(0));

    // Nothing listens there now: a clear message and exit 69.
    let (code, _, err) = cli(&agent, &["status"]).await;
    assert_eq!(code, 69, "{err}");
    assert!(
        err.contains("not reachable") && err.contains(&addr),
        "{err}"
    );
}

#[tokio::test]
async fn supervisor_hot_restart_update_config_and_watch() {
    let mut agent = agent()
        .hot_restart()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .start()
        .await;
    let p = agent.ports.unwrap();
    let listener = std::net::SocketAddr::from(([127, 0, 0, 1], p.listener_port));
    let mut c = client(&agent).await;

    // Watch from the start: LIVE at 0, a handoff (not a drain: still live and ready), LIVE at
    // 1, ..., exiting.
    let mut watch = client(&agent)
        .await
        .watch_status(pb::WatchStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let seen = tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Some(Ok(r)) = watch.next().await {
            let s = r.status.unwrap();
            seen.push((
                s.state(),
                s.newest_live_epoch,
                s.family.as_ref().unwrap().handoff.is_some(),
                s.ready,
            ));
        }
        seen
    });

    let epoch = c
        .hot_restart(pb::HotRestartRequest {
            reason: "test".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .epoch;
    assert_eq!(epoch, 1);
    let status = get_status(&mut c).await;
    assert_eq!(status.newest_live_epoch, Some(1));
    let family = status.family.unwrap();
    let last = family.last_handoff.unwrap();
    assert_eq!(
        (last.epoch, last.outcome(), last.reason.as_str()),
        (1, pb::HandoffOutcome::Live, "grpc: test")
    );
    assert!(
        last.duration.is_some() && last.end_time.is_some(),
        "{last:?}"
    );
    assert_eq!(
        family.handoffs.last(),
        Some(&last),
        "the history ends with the last handoff"
    );

    // The CLI: waits for the parent to drain away, then restarts.
    let (code, out, err) = cli(&agent, &["restart", "--reason", "from the cli"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), "epoch 2 is LIVE");

    // A good config: validated, written, hot-restarted onto.
    let good = envoy_agent_tests::bootstrap_yaml_on(p.admin_port, p.listener_port, "updated");
    let r = c
        .update_config(pb::UpdateConfigRequest {
            bootstrap: good.clone().into_bytes(),
            reason: "t".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.restarted);
    assert_eq!(r.epoch, Some(3));
    serves(listener, "updated").await;
    let path = agent.dir.join("bootstrap.yaml");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), good);

    // A bad one: refused with Envoy's reason; nothing changes on disk or in Envoy.
    let err = c
        .update_config(pb::UpdateConfigRequest {
            bootstrap: b"admin: [not, a".to_vec(),
            reason: "bad".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        good,
        "the file is unchanged"
    );
    let status = get_status(&mut c).await;
    assert_eq!(
        status.newest_live_epoch,
        Some(3),
        "the old epoch keeps serving"
    );
    assert_eq!(http_get(listener, "/").await.unwrap().body, "updated");

    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    let seen = tokio::time::timeout(PATIENCE, seen).await.unwrap().unwrap();
    let live0 = seen
        .iter()
        .position(|s| s.0 == pb::AgentState::Live && s.1 == Some(0))
        .expect("LIVE at 0");
    let handoff = seen.iter().position(|s| s.2).expect("a handoff");
    assert_eq!(
        (seen[handoff].0, seen[handoff].3),
        (pb::AgentState::Live, true),
        "a handoff is not a drain: the serving epoch serves, readiness stays: {seen:?}"
    );
    let live1 = seen.iter().position(|s| s.1 == Some(1)).expect("LIVE at 1");
    let stopping = seen
        .iter()
        .position(|s| matches!(s.0, pb::AgentState::Draining | pb::AgentState::Exiting))
        .expect("stopping");
    assert!(
        live0 < handoff && handoff < live1 && live1 < stopping,
        "{seen:?}"
    );
}

#[tokio::test]
async fn many_slow_watchers_do_not_hold_the_supervisor_back() {
    let mut agent = agent()
        .hot_restart()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .start()
        .await;
    // A hundred watchers that never read: each keeps only the latest state.
    let mut idle = Vec::new();
    for _ in 0..100 {
        let mut c = client(&agent).await;
        idle.push(
            c.watch_status(pb::WatchStatusRequest {})
                .await
                .unwrap()
                .into_inner(),
        );
    }
    let mut c = client(&agent).await;
    for epoch in 1..=2 {
        let r = c
            .hot_restart(pb::HotRestartRequest {
                reason: "busy".into(),
            })
            .await
            .unwrap();
        assert_eq!(r.into_inner().epoch, epoch);
    }
    // A lagging watcher catches up with the latest state. (What it has not read is bounded by
    // HTTP/2 flow control; past that the server skips to the latest state.)
    let now = get_status(&mut c).await;
    let mut read = 0;
    loop {
        let status = idle[0].next().await.unwrap().unwrap().status.unwrap();
        read += 1;
        if status.newest_live_epoch == now.newest_live_epoch {
            break;
        }
    }
    assert!(read >= 1);
    drop(idle);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// A tonic call from inside the network namespace of process `pid`.
fn call_in_netns(pid: u32, addr: String, quit: bool) -> Result<(), tonic::Status> {
    use std::os::fd::AsFd;
    std::thread::spawn(move || {
        let netns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
        nix::sched::setns(netns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let mut c = connect(&addr.parse().unwrap(), PATIENCE)
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
            c.get_status(pb::GetStatusRequest {}).await?;
            if quit {
                c.quit_quit_quit(pb::QuitQuitQuitRequest {}).await?;
            }
            Ok(())
        })
    })
    .join()
    .unwrap()
}

/// As in the status-server test: the agent in a network namespace of its own with a veth
/// address (10.99.0.1), its gRPC server on 0.0.0.0.
#[tokio::test]
async fn mutating_rpcs_refuse_a_non_loopback_peer() {
    let port = free_port();
    let mut agent = agent()
        .wrapper(envoy_agent_tests::PRIVATE_NETNS)
        .args(&[
            "--grpc-address",
            &format!("0.0.0.0:{port}"),
            "--termination-drain-duration",
            "1h",
        ])
        .no_wait_live()
        .start()
        .await;
    let pid = agent.pid();
    let remote = format!("{}:{port}", envoy_agent_tests::PRIVATE_NETNS_ADDR);
    let local = format!("127.0.0.1:{port}");
    let err = eventually("the gRPC server to refuse", PATIENCE, || {
        let remote = remote.clone();
        async move {
            tokio::task::spawn_blocking(move || call_in_netns(pid, remote, true))
                .await
                .unwrap()
                .err()
                .filter(|e| e.code() != tonic::Code::Unavailable)
        }
    })
    .await;
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
    assert!(agent.running(), "a refused QuitQuitQuit does nothing");
    tokio::task::spawn_blocking(move || call_in_netns(pid, local, true))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(agent.exit().await.code(), Some(0));
}

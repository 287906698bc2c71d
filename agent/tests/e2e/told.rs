//! Every client is told to go (issue 38): end to end with the real agent, the real Envoy and
//! real clients of every protocol (HTTP/1.1 keep-alive, HTTP/2 idle and with a long-lived
//! stream, nghttp's stream, HTTP/3 over QUIC), on listeners of every traffic direction, in
//! every exit path: SIGTERM, `POST /drain`, gRPC `Drain`, and a hot restart's draining parent.
//!
//! "Told" is what the protocol offers: `Connection: close` on an HTTP/1.1 response (or a close
//! of an idle connection by Envoy's drain sequence), a GOAWAY on HTTP/2 and HTTP/3. Each
//! client must hear it before Envoy stops (the agent's `stopping` event), and no request of a
//! client that keeps asking fails. The long-lived streams are told only where the connection
//! manager has a `max_connection_duration` (see docs/shutdown.md): the bootstrap here sets
//! one, as the repository's own bootstraps do.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_agent::client::connect;
use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::clients::{
    ClientProcess, DrainBootstrap, Event, H1Client, H2Client, H3Client, HttpUpstream, Kind, Nghttp,
    QUIC_LISTENER, TlsCert,
};
use envoy_agent_tests::{AgentProcess, KeepAlive, PATIENCE, TestDir, eventually};
use nix::sys::signal::Signal;

use crate::exit_paths::{Mode, agent_in, both_modes};
use crate::grpc::get_status;

/// Long enough that nothing a test waits for is cut by the deadline.
const DRAIN: &str = "--termination-drain-duration=25s";

/// A running agent on a [`DrainBootstrap`] with every listener, its upstream, and where each
/// listener is.
struct Rig {
    agent: AgentProcess,
    _upstream: HttpUpstream,
    _dir: TestDir,
}

impl Rig {
    async fn start(mode: Mode, args: &[&str]) -> Rig {
        Rig::start_with(agent_in(mode), args).await
    }

    async fn start_with(builder: envoy_agent_tests::AgentBuilder, args: &[&str]) -> Rig {
        let dir = TestDir::new();
        let upstream = HttpUpstream::start().await;
        let cert = TlsCert::generate(&dir);
        let mut bootstrap = DrainBootstrap::new(upstream.addr())
            .max_connection_duration(Duration::from_secs(86_400))
            .quic(&cert);
        if let Some(ports) = builder.ports() {
            bootstrap = bootstrap.fixed_ports(ports.admin_port);
        }
        let agent = builder.bootstrap(bootstrap.yaml()).args(args).start().await;
        Rig {
            agent,
            _upstream: upstream,
            _dir: dir,
        }
    }

    async fn at(&self, listener: &str) -> SocketAddr {
        self.agent.listener(listener).await
    }

    async fn status(&self) -> pb::Status {
        let addr: GrpcAddress = self.agent.grpc.parse().unwrap();
        let mut client = connect(&addr, PATIENCE).await.unwrap();
        get_status(&mut client).await
    }

    /// The names of the listeners the accepted drain reached, as the status says.
    async fn drained(&self) -> Vec<String> {
        let drain = eventually("the drain accepted in the status", PATIENCE, || async {
            self.status().await.drain.filter(|d| d.accepted)
        })
        .await;
        let mut names: Vec<String> = drain.drained.into_iter().map(|l| l.name).collect();
        names.sort();
        names
    }

    /// When the agent began stopping Envoy (Unix seconds), once it has.
    async fn stopped_at(&self) -> f64 {
        let stopping = eventually("the agent's stopping event", PATIENCE, || async {
            self.agent.events("stopping").into_iter().next()
        })
        .await;
        stopping["at_unix_ms"].as_f64().unwrap() / 1000.0
    }
}

/// The first event `pick` selects, waited for (bounded).
async fn heard(client: &ClientProcess, what: &str, pick: impl FnMut(&Event) -> bool) -> f64 {
    let mut pick = pick;
    client.wait_for(what, |e| pick(e).then_some(e.t)).await
}

fn goaway(e: &Event) -> bool {
    matches!(e.kind, Kind::Goaway { .. })
}

fn close_header(e: &Event) -> bool {
    matches!(&e.kind, Kind::Response { connection: Some(c), .. } if c.eq_ignore_ascii_case("close"))
}

fn data(e: &Event) -> bool {
    matches!(e.kind, Kind::Data { .. })
}

/// The clients a drain must reach, on one listener: HTTP/1.1 asking and idle, HTTP/2 idle and
/// with a long-lived stream.
struct Clients {
    h1: H1Client,
    h1_idle: H1Client,
    h2_idle: H2Client,
    h2_stream: H2Client,
}

impl Clients {
    async fn on(addr: SocketAddr) -> Clients {
        let c = Clients {
            h1: H1Client::keeps_asking(addr),
            h1_idle: H1Client::idle(addr),
            h2_idle: H2Client::idle(addr),
            h2_stream: H2Client::stream(addr, "/stream?seconds=120"),
        };
        // Each is connected and served before the drain.
        heard(&c.h1, "an HTTP/1.1 answer", |e| {
            matches!(e.kind, Kind::Response { status: 200, .. })
        })
        .await;
        heard(&c.h1_idle, "the idle HTTP/1.1 client's answer", |e| {
            matches!(e.kind, Kind::Response { status: 200, .. })
        })
        .await;
        heard(&c.h2_idle, "the idle HTTP/2 client's answer", |e| {
            matches!(e.kind, Kind::Response { status: 200, .. })
        })
        .await;
        heard(&c.h2_stream, "the stream's first data", data).await;
        c
    }

    /// Each was told before `stopped` (Unix seconds), and the asking one never failed.
    async fn told_before(&self, listener: &str, stopped: f64) {
        let close = heard(
            &self.h1,
            &format!("{listener}: Connection: close"),
            close_header,
        )
        .await;
        assert!(close <= stopped, "{listener}: h1 told after the stop");
        // An idle HTTP/1.1 connection hears nothing but its close, by Envoy's drain sequence.
        let idle_closed = heard(
            &self.h1_idle,
            &format!("{listener}: idle h1 closed"),
            |e| matches!(&e.kind, Kind::Closed { how, .. } if how == "eof"),
        )
        .await;
        assert!(
            idle_closed <= stopped,
            "{listener}: idle h1 closed by the stop, not told"
        );
        let idle = heard(
            &self.h2_idle,
            &format!("{listener}: idle h2 GOAWAY"),
            goaway,
        )
        .await;
        assert!(idle <= stopped, "{listener}: idle h2 told after the stop");
        let stream = heard(
            &self.h2_stream,
            &format!("{listener}: stream GOAWAY"),
            goaway,
        )
        .await;
        assert!(stream <= stopped, "{listener}: stream told after the stop");
        // The stream carried on after it was told.
        let after = self
            .h2_stream
            .find(|e| (data(e) && e.t > stream).then_some(()));
        assert!(
            after.is_some() || stream >= stopped - 1.0,
            "{listener}: the stream stopped at its GOAWAY: {}",
            self.h2_stream.describe()
        );
        // Until Envoy is stopped: the client keeps asking, and once Envoy is gone its next
        // connection is refused, as it must be.
        assert!(
            self.h1.failures().iter().all(|e| e.t >= stopped),
            "{listener}: a request failed before the stop: {}",
            self.h1.describe()
        );
    }
}

both_modes!(sigterm_tells_every_client_of_every_drained_listener);

/// SIGTERM with the defaults: a node proxy drains every listener (INBOUND, OUTBOUND, none),
/// a sidecar its INBOUND one; each client of a drained listener is told before Envoy stops,
/// over HTTP/1.1, HTTP/2 (idle, and with a stream) and HTTP/3.
async fn sigterm_tells_every_client_of_every_drained_listener(mode: Mode) {
    let rig = Rig::start(mode, &[DRAIN]).await;
    let drained_listeners: &[&str] = match mode {
        Mode::NodeProxy => &["inbound", "outbound", "plain"],
        Mode::Sidecar => &["inbound"],
    };
    let mut clients = Vec::new();
    for name in drained_listeners {
        clients.push((name, Clients::on(rig.at(name).await).await));
    }
    let quic = rig.at(QUIC_LISTENER).await;
    let h3 = H3Client::idle(quic);
    heard(&h3, "the HTTP/3 answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. })
    })
    .await;
    let nghttp = Nghttp::stream(rig.at("inbound").await, "/stream?seconds=120");
    heard(&nghttp, "nghttp's stream data", data).await;

    rig.agent.signal_agent(Signal::SIGTERM);
    let mut expected: Vec<String> = drained_listeners.iter().map(|s| s.to_string()).collect();
    if matches!(mode, Mode::NodeProxy) {
        expected.push(QUIC_LISTENER.to_owned());
    }
    expected.sort();
    assert_eq!(
        rig.drained().await,
        expected,
        "what the status says was drained"
    );
    let accepted = rig
        .agent
        .wait_event("drain_accepted", "scope", "auto")
        .await;
    assert_eq!(
        accepted["inbound_only"],
        matches!(mode, Mode::Sidecar),
        "{accepted}"
    );
    // Told, each of them, while Envoy still runs: wait for each, then for the stop.
    for (name, c) in &clients {
        c.told_before(name, f64::MAX).await;
    }
    heard(&h3, "the HTTP/3 GOAWAY", goaway).await;
    heard(&nghttp, "nghttp's GOAWAY", goaway).await;
    rig.agent.signal_agent(Signal::SIGTERM);
    let stopped = rig.stopped_at().await;
    for (name, c) in &clients {
        c.told_before(name, stopped).await;
    }
    assert!(heard(&h3, "the HTTP/3 GOAWAY", goaway).await <= stopped);
    assert!(heard(&nghttp, "nghttp's GOAWAY", goaway).await <= stopped);
    let mut agent = rig.agent;
    assert!(agent.exit().await.success());
}

both_modes!(a_drain_request_reaches_the_listeners_the_mode_drains);

/// `POST /drain` and gRPC `Drain` (`envoy-agent drain`) take the same road as SIGTERM: the
/// listeners the mode drains, learnt from Envoy, named in the answer and the status; a
/// client of a listener without traffic_direction is told on a node proxy.
async fn a_drain_request_reaches_the_listeners_the_mode_drains(mode: Mode) {
    let rig = Rig::start(mode, &[DRAIN]).await;
    let plain = H1Client::keeps_asking(rig.at("plain").await);
    heard(&plain, "an answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. })
    })
    .await;
    let out = std::process::Command::new(crate::AGENT)
        .args(["drain", "--skip-exit", "--grpc-address", &rig.agent.grpc])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    match mode {
        Mode::NodeProxy => {
            assert!(
                said.starts_with("draining: ")
                    && said.contains("plain")
                    && said.contains("outbound"),
                "{said}"
            );
            heard(
                &plain,
                "Connection: close on the plain listener",
                close_header,
            )
            .await;
        }
        Mode::Sidecar => assert_eq!(said.trim(), "draining: inbound", "{said}"),
    }
    assert!(plain.failures().is_empty(), "{}", plain.describe());
    assert!(rig.drained().await.contains(&"inbound".to_owned()));
}

#[tokio::test]
async fn a_sidecar_without_inbound_listeners_drains_them_all_and_says_so() {
    let upstream = HttpUpstream::start().await;
    let bootstrap = DrainBootstrap::new(upstream.addr()).only(&["outbound", "plain"]);
    let agent = crate::agent()
        .bootstrap(bootstrap.yaml())
        .args(&[DRAIN])
        .start()
        .await;
    let plain = H1Client::keeps_asking(agent.listener("plain").await);
    heard(&plain, "an answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. })
    })
    .await;
    agent.signal_agent(Signal::SIGTERM);
    let accepted = agent.wait_event("drain_accepted", "scope", "auto").await;
    assert_eq!(accepted["inbound_only"], false, "{accepted}");
    assert!(
        accepted["note"]
            .as_str()
            .is_some_and(|n| n.contains("INBOUND")),
        "{accepted}"
    );
    heard(&plain, "Connection: close", close_header).await;
    let rig_status = {
        let addr: GrpcAddress = agent.grpc.parse().unwrap();
        let mut client = connect(&addr, PATIENCE).await.unwrap();
        get_status(&mut client).await
    };
    let drain = rig_status.drain.unwrap();
    assert!(drain.drained_known && !drain.inbound_only);
    assert!(drain.drained_note.contains("INBOUND"), "{drain:?}");
    assert!(plain.failures().is_empty(), "{}", plain.describe());
}

#[tokio::test]
async fn a_draining_parent_tells_its_streams_while_its_child_serves() {
    let rig = Rig::start(
        Mode::NodeProxy,
        &["--drain-time=20s", "--parent-shutdown-time=25s"],
    )
    .await;
    let plain = rig.at("plain").await;
    let stream = H2Client::stream(plain, "/stream?seconds=120");
    heard(&stream, "the stream's data", data).await;
    let idle = H2Client::idle(plain);
    heard(&idle, "the idle client's answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. })
    })
    .await;
    rig.agent.signal_agent(Signal::SIGHUP);
    rig.agent.wait_event("drain_notice", "epoch", "0").await;
    let told = heard(&stream, "the parent's GOAWAY on the stream", goaway).await;
    heard(&idle, "the parent's GOAWAY on the idle connection", goaway).await;
    // Told while the parent still runs (it drains for 20 s): the stream goes on after it.
    heard(&stream, "data after the GOAWAY", |e| data(e) && e.t > told).await;
    let status = rig.status().await;
    assert!(
        status
            .epochs
            .iter()
            .any(|e| e.epoch == 0 && e.state() == pb::EpochState::Draining),
        "the parent still drains: {:?}",
        status.epochs
    );
    // A new connection goes to the child.
    let fresh = H1Client::keeps_asking(plain);
    heard(&fresh, "the child's answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. })
    })
    .await;
}

both_modes!(exit_on_zero_waits_for_a_connection_past_envoy_s_listener_close);

/// Exit-on-zero after Envoy's drain time: Envoy has closed its listening sockets, the
/// connection it accepted is still open; the agent keeps waiting for it (the kernel count
/// keyed on the drained listeners' ports, not on listening sockets), and stops Envoy once it
/// is closed. The drain notice is off, so that only the client closes it.
async fn exit_on_zero_waits_for_a_connection_past_envoy_s_listener_close(mode: Mode) {
    let rig = Rig::start(
        mode,
        &[
            "--exit-on-zero=connections",
            "--drain-time=1s",
            "--minimum-drain-duration=0s",
            "--termination-drain-duration=60s",
            "--drain-notice=off",
        ],
    )
    .await;
    let inbound = rig.at("inbound").await;
    let mut held = KeepAlive::connect(inbound).await.unwrap();
    assert_eq!(held.get("/").await.unwrap().status, 200);
    rig.agent.signal_agent(Signal::SIGTERM);
    // Envoy's drain time ends: it closes its listening sockets.
    eventually("envoy's listener to close", PATIENCE, || async {
        tokio::net::TcpStream::connect(inbound)
            .await
            .is_err()
            .then_some(())
    })
    .await;
    // The count still sees the held connection after that.
    eventually("a count of the held connection", PATIENCE, || async {
        let drain = rig.status().await.drain?;
        (drain.active_connections == Some(1)).then_some(())
    })
    .await;
    let counted_after_close = rig.status().await.drain.unwrap().count_time;
    eventually("a later count", PATIENCE, || async {
        let drain = rig.status().await.drain?;
        (drain.count_time != counted_after_close && drain.active_connections == Some(1))
            .then_some(())
    })
    .await;
    assert!(
        rig.agent.events("stopping").is_empty(),
        "stopped with the connection open: {:?}",
        rig.agent.events("stopping")
    );
    drop(held);
    let stopping = rig
        .agent
        .wait_event("stopping", "exit_path", "zero_connections")
        .await;
    assert!(stopping["still_open"].is_null(), "{stopping}");
    let mut agent = rig.agent;
    assert!(agent.exit().await.success());
}

/// A bootstrap with an overload manager of its own: Envoy merges the agent's notice into it
/// (lists are appended), and the notice still tells an idle HTTP/2 client.
#[tokio::test]
async fn the_notice_merges_with_the_bootstrap_s_own_overload_manager() {
    let upstream = HttpUpstream::start().await;
    let yaml = DrainBootstrap::new(upstream.addr())
        .only(&["inbound"])
        .yaml()
        + r#"overload_manager:
  resource_monitors:
  - name: envoy.resource_monitors.global_downstream_max_connections
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig
      max_active_downstream_connections: 10000
"#;
    let agent = crate::agent().bootstrap(yaml).args(&[DRAIN]).start().await;
    assert!(agent.events("drain_notice_off").is_empty());
    let idle = H2Client::idle(agent.listener("inbound").await);
    heard(&idle, "the answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. })
    })
    .await;
    agent.signal_agent(Signal::SIGTERM);
    agent.wait_event("drain_notice", "epoch", "0").await;
    heard(&idle, "a GOAWAY", goaway).await;
}

/// A bootstrap whose overload manager already has what the notice adds (Envoy would refuse
/// the duplicate): the agent leaves the notice out, says why, and Envoy runs.
#[tokio::test]
async fn a_bootstrap_that_already_uses_the_notice_s_names_runs_without_it() {
    let dir = TestDir::new();
    let upstream = HttpUpstream::start().await;
    let theirs = dir.write("pressure", "0");
    let yaml = DrainBootstrap::new(upstream.addr())
        .only(&["inbound"])
        .yaml()
        + &format!(
            r#"overload_manager:
  resource_monitors:
  - name: envoy.resource_monitors.injected_resource
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.resource_monitors.injected_resource.v3.InjectedResourceConfig
      filename: {}
"#,
            theirs.display()
        );
    let agent = crate::agent().bootstrap(yaml).args(&[DRAIN]).start().await;
    let off = agent.wait_event("drain_notice_off", "level", "WARN").await;
    assert!(
        off["reason"]
            .as_str()
            .is_some_and(|r| r.contains("envoy.resource_monitors.injected_resource")),
        "{off}"
    );
    let h1 = H1Client::keeps_asking(agent.listener("inbound").await);
    heard(&h1, "an answer", |e| {
        matches!(e.kind, Kind::Response { status: 200, .. })
    })
    .await;
    let status = rig_settings(&agent).await;
    assert!(!status.drain_notice, "GetStatus says the notice is off");
}

async fn rig_settings(agent: &AgentProcess) -> pb::Settings {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    let mut client = connect(&addr, PATIENCE).await.unwrap();
    get_status(&mut client).await.settings.unwrap()
}

both_modes!(as_pid_1_a_sigterm_still_tells_every_client);

/// As PID 1 of its own PID namespace (every pod's agent is), with the defaults: SIGTERM tells
/// an HTTP/1.1 client and an idle HTTP/2 one of the drained listener before Envoy stops.
async fn as_pid_1_a_sigterm_still_tells_every_client(mode: Mode) {
    let builder = agent_in(mode).wrapper(envoy_agent_tests::POD);
    let rig = Rig::start_with(builder, &[DRAIN]).await;
    let inbound = rig.at("inbound").await;
    let h1 = H1Client::keeps_asking(inbound);
    let h2 = H2Client::idle(inbound);
    for c in [&*h1, &*h2] {
        heard(c, "an answer", |e| {
            matches!(e.kind, Kind::Response { status: 200, .. })
        })
        .await;
    }
    rig.agent.signal_agent(Signal::SIGTERM);
    heard(&h1, "Connection: close", close_header).await;
    heard(&h2, "a GOAWAY", goaway).await;
    assert!(
        rig.agent.events("stopping").is_empty(),
        "told before the stop"
    );
    assert!(h1.failures().is_empty(), "{}", h1.describe());
}

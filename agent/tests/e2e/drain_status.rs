//! What holds a drain open (issue 31): during an exit-on-zero drain the status lists, per
//! counted listener, its active connections and requests and how many are upgraded; when the
//! deadline ends the wait, the stop names what was still open. End to end with the real
//! Envoy and a WebSocket held open through it to an upstream that switched protocols.

use std::net::SocketAddr;

use envoy_agent::client::connect;
use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::{AgentProcess, PATIENCE, eventually};
use nix::sys::signal::Signal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::exit_paths::{Mode, agent_in, both_modes};
use crate::grpc::get_status;

pub(crate) async fn status(agent: &AgentProcess) -> pb::Status {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    let mut client = connect(&addr, PATIENCE).await.unwrap();
    get_status(&mut client).await
}

/// An upstream that answers every upgrade request with `101 Switching Protocols` and then
/// holds the connection open (until the test ends).
async fn upgrading_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                read_head(&mut conn).await;
                let _ = conn
                    .write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\
                          Connection: Upgrade\r\n\r\n",
                    )
                    .await;
                // Held: echo whatever comes, until the peer closes.
                let mut buf = [0u8; 1024];
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 || conn.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// Reads an HTTP head (up to the blank line); returns it.
async fn read_head(conn: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match conn.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// A listener `ws` whose HTTP connection manager upgrades WebSockets to `upstream`; the admin
/// and the listener on the given ports (0: any).
fn websocket_bootstrap(upstream: SocketAddr, admin_port: u16, listener_port: u16) -> String {
    format!(
        r#"admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
static_resources:
  listeners:
  - name: ws
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {listener_port} }}
    traffic_direction: INBOUND
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ws
          upgrade_configs:
          - upgrade_type: websocket
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: upstream, timeout: 0s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: {ip}, port_value: {port} }}
"#,
        ip = upstream.ip(),
        port = upstream.port(),
    )
}

both_modes!(a_websocket_held_open_is_named_in_the_drain_status_and_at_the_deadline);

async fn a_websocket_held_open_is_named_in_the_drain_status_and_at_the_deadline(mode: Mode) {
    let upstream = upgrading_upstream().await;
    let builder = agent_in(mode);
    // A node proxy's listener is on a fixed port (handed over by hot restarts); a sidecar's
    // on any.
    let (admin_port, listener_port) = builder
        .ports()
        .map_or((0, 0), |p| (p.admin_port, p.listener_port));
    let mut agent = builder
        .bootstrap(websocket_bootstrap(upstream, admin_port, listener_port))
        .args(&[
            "--exit-on-zero-active-connections",
            "--minimum-drain-duration",
            "200ms",
            "--termination-drain-duration",
            "4s",
        ])
        .start()
        .await;
    let listener = agent.listener("ws").await;
    let mut ws = TcpStream::connect(listener).await.unwrap();
    ws.write_all(
        b"GET /chat HTTP/1.1\r\nHost: ws\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .await
    .unwrap();
    let head = read_head(&mut ws).await;
    assert!(head.starts_with("HTTP/1.1 101"), "upgraded: {head}");

    agent.signal(Signal::SIGTERM);
    // Named as configured (issue 38), not by its stats name: Envoy names a listener's stats
    // after its configured address (`127.0.0.1_0` for the sidecar's port 0).
    let name = "ws".to_owned();
    let held = eventually("the WebSocket in the drain status", PATIENCE, || async {
        let drain = status(&agent).await.drain?;
        drain
            .listeners
            .iter()
            .find(|l| l.name == name && l.upgrades_active == Some(1))
            .cloned()
            .map(|l| (l, drain.listeners_time.is_some()))
    })
    .await;
    let (held, read_at) = held;
    assert!(read_at, "when the listeners were read");
    assert_eq!(held.active_connections, 1, "{held:?}");
    assert_eq!(
        held.active_requests,
        Some(1),
        "the upgraded stream: {held:?}"
    );

    // The deadline ends the wait; the stop names what was still open.
    assert_eq!(agent.exit().await.code(), Some(0));
    let stopping = agent
        .wait_event("stopping", "exit_path", "drain_deadline")
        .await;
    let still_open = stopping["still_open"].as_str().unwrap_or_default();
    assert!(
        still_open.contains(&name) && still_open.contains("1 upgraded"),
        "{stopping}"
    );
    drop(ws);
}

//! A sidecar's drain and outbound connections without the app rule (`--app-hold off`; with it,
//! the default, see `app.rs`): the failed health checks drain every `drain_type: DEFAULT`
//! listener, and the drain notice reaches every connection manager Envoy-wide, so an outbound
//! listener's keep-alive clients are told to close too. An outbound listener with
//! `drain_type: MODIFY_ONLY` and `bypass_overload_manager: true` (Envoy 1.31+) is left alone
//! by both, while the inbound one's clients are told. End to end, HTTP/1.1 keep-alive clients.

use std::time::{Duration, Instant};

use envoy_agent_tests::KeepAlive;
use nix::sys::signal::Signal;

use crate::agent;

pub(crate) fn listener(name: &str, direction: &str, extra: &str) -> String {
    format!(
        r#"  - name: {name}
    address:
      socket_address: {{ address: 127.0.0.1, port_value: 0 }}
    traffic_direction: {direction}
{extra}    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                direct_response: {{ status: 200, body: {{ inline_string: "ok" }} }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    )
}

/// When a keep-alive client asking every 50 ms was first told to close, after `from`; none if
/// never before `until`.
pub(crate) async fn told_after(
    mut client: KeepAlive,
    from: Instant,
    until: Instant,
) -> Option<Duration> {
    while Instant::now() < until {
        match client.get("/").await {
            Ok(r) if r.status == 200 && !r.connection_close() => {}
            _ => return Some(from.elapsed()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test]
async fn an_outbound_listener_marked_modify_only_and_bypassing_the_overload_manager_is_left_alone()
{
    let bootstrap = format!(
        "admin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: 0 }}\n\
         static_resources:\n  listeners:\n{}{}{}",
        listener("inbound", "INBOUND", ""),
        listener("outbound", "OUTBOUND", ""),
        listener(
            "outbound_kept",
            "OUTBOUND",
            "    drain_type: MODIFY_ONLY\n    bypass_overload_manager: true\n"
        ),
    );
    let mut agent = agent()
        .bootstrap(bootstrap)
        .args(&[
            "--drain-delay",
            "1s",
            "--termination-drain-duration",
            "5s",
            "--app-hold",
            "off",
        ])
        .start()
        .await;
    let mut clients = Vec::new();
    for name in ["inbound", "outbound", "outbound_kept"] {
        let mut client = KeepAlive::connect(agent.listener(name).await)
            .await
            .unwrap();
        assert_eq!(client.get("/").await.unwrap().status, 200);
        clients.push(client);
    }
    let signalled = Instant::now();
    agent.signal(Signal::SIGTERM);
    // The drain starts at 1 s and Envoy stops at 6 s: watch until 5 s.
    let until = signalled + Duration::from_secs(5);
    let mut told = Vec::new();
    for client in clients {
        told.push(tokio::spawn(told_after(client, signalled, until)));
    }
    let mut told_at = Vec::new();
    for t in told {
        told_at.push(t.await.unwrap());
    }
    let [inbound, outbound, kept] = told_at[..] else {
        panic!("{told_at:?}")
    };
    assert!(inbound.is_some(), "the inbound client is told: {told_at:?}");
    assert!(
        outbound.is_some(),
        "a plain outbound listener's client is told too: {told_at:?}"
    );
    assert_eq!(
        kept, None,
        "the marked outbound listener's client is left alone"
    );
    assert_eq!(agent.exit().await.code(), Some(0));
}

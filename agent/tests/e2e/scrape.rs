//! `/stats/prometheus` end to end with the real Envoy: Envoy's query parameters reach Envoy
//! (the body changes as Envoy's does), the agent's own families stay whatever the query, and
//! queries Envoy does not take are refused, by the agent naming the parameter or by Envoy in
//! its own words.

use std::collections::BTreeSet;

use envoy_agent_tests::{admin_request, http_get};
use nix::sys::signal::Signal;

use crate::agent;

/// The metric families (`# TYPE` lines) of a Prometheus text body: Envoy's, and the agent's
/// own (`envoy_agent_*`).
fn families(body: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    body.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .partition(|name| !name.starts_with("envoy_agent_"))
}

/// The families Envoy itself answers for `query`, asked directly.
async fn envoy_families(
    admin: &envoy_agent_proxy::admin::Address,
    query: &str,
) -> BTreeSet<String> {
    let response = admin_request(admin, "GET", &format!("/stats/prometheus?{query}"))
        .await
        .unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
    families(&response.body).0
}

/// The agent's families for `query`, checked to be all there, and Envoy's.
async fn scrape(agent: std::net::SocketAddr, query: &str) -> BTreeSet<String> {
    let response = http_get(agent, &format!("/stats/prometheus?{query}"))
        .await
        .unwrap();
    assert_eq!(response.status, 200, "{query}: {}", response.body);
    let (envoy, own) = families(&response.body);
    // The agent's own families whatever the query: a filter or usedonly is Envoy's.
    for family in [
        "envoy_agent_state",
        "envoy_agent_draining",
        "envoy_agent_envoy_stats_up",
        "envoy_agent_config_ready",
    ] {
        assert!(own.contains(family), "{query}: {family} in {own:?}");
    }
    assert!(
        response.body.contains("\nenvoy_agent_envoy_stats_up 1\n"),
        "{query}: {}",
        response.body
    );
    envoy
}

#[tokio::test]
async fn usedonly_and_filter_reach_envoy_and_the_agents_own_families_stay() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", "0s"])
        .start()
        .await;
    let admin = agent.admin.addr().clone();
    let all = scrape(agent.status(), "").await;
    assert!(all.len() > 50, "{all:?}");

    // A filter on Envoy's stat names (`server.live`, not `envoy_server_live`), URL-encoded.
    let server = scrape(agent.status(), "filter=%5Eserver%5C.").await;
    assert!(!server.is_empty());
    assert!(
        server.iter().all(|f| f.starts_with("envoy_server_")),
        "{server:?}"
    );
    assert_eq!(server, envoy_families(&admin, "filter=%5Eserver%5C.").await);
    let inverted = scrape(agent.status(), "filter=%5Eserver%5C.&invert_filter").await;
    assert!(inverted.is_disjoint(&server), "{inverted:?}");

    // usedonly: what Envoy says is used, which only grows between two looks.
    let before = envoy_families(&admin, "usedonly").await;
    let used = scrape(agent.status(), "usedonly").await;
    let after = envoy_families(&admin, "usedonly").await;
    assert!(before.is_subset(&used), "{before:?} ⊄ {used:?}");
    assert!(used.is_subset(&after), "{used:?} ⊄ {after:?}");
    assert!(
        used.len() < all.len(),
        "usedonly: {} of {}",
        used.len(),
        all.len()
    );

    // Envoy's other parameters pass too.
    scrape(agent.status(), "text_readouts&histogram_buckets=summary").await;

    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn queries_envoy_does_not_take_are_refused_naming_the_parameter() {
    let mut agent = agent()
        .args(&["--termination-drain-duration", "0s"])
        .start()
        .await;
    for (query, named) in [
        // Refused by the agent, before Envoy is asked.
        ("format=json", "\"format\""),
        ("filter=a&filter=b", "\"filter\""),
        ("usedonly=false", "\"usedonly\""),
        // Refused by Envoy: its words are passed on.
        ("filter=%28", "regex"),
        ("histogram_buckets=detailed", "histogram bucket"),
    ] {
        let response = http_get(agent.status(), &format!("/stats/prometheus?{query}"))
            .await
            .unwrap();
        assert_eq!(response.status, 400, "{query}: {}", response.body);
        assert!(response.body.contains(named), "{query}: {}", response.body);
    }
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

//! `/stats/prometheus` end to end with the real Envoy: Envoy's query parameters reach Envoy
//! (the body changes as Envoy's does), the agent's own families stay whatever the query, and
//! queries Envoy does not take are refused, by the agent naming the parameter or by Envoy in
//! its own words. Scrapes of one query that arrive together are one walk of Envoy's stats:
//! counted by Envoy itself (its admin access log) and by the agent's `scrape_walk` events.

use std::collections::BTreeSet;
use std::time::Duration;

use envoy_agent_tests::{AgentProcess, PATIENCE, admin_request, eventually, http_get};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::AsyncWriteExt;

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

/// An agent whose Envoy logs every admin request's path to `admin-access.log` in its test
/// directory (flushed every 50 ms): Envoy's own count of the walks it was asked for.
async fn agent_with_admin_access_log() -> (AgentProcess, std::path::PathBuf) {
    let builder = agent();
    let log = builder.dir().join("admin-access.log");
    let bootstrap = envoy_agent_tests::bootstrap_yaml("hello").replacen(
        "admin:\n",
        &format!(
            "admin:\n  access_log:\n  - name: envoy.access_loggers.file\n    typed_config:\n      \
             \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n      \
             path: {}\n      log_format: {{ text_format_source: {{ inline_string: \"%REQ(:PATH)%\\n\" }} }}\n",
            log.display()
        ),
        1,
    );
    let agent = builder
        .bootstrap(bootstrap)
        .args(&["--termination-drain-duration", "0s"])
        .envoy_args(&["--file-flush-interval-msec", "50"])
        .start()
        .await;
    (agent, log)
}

/// The walks Envoy was asked for, by query string (its admin access log).
fn envoys_walks(log: &std::path::Path, query: &str) -> usize {
    let path = format!("/stats/prometheus?{query}");
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|line| *line == path)
        .count()
}

/// Scrapes `paths` of the agent at once while Envoy is stopped, so that every one reaches the
/// agent before Envoy answers any; the answers, in order.
async fn scrape_together(
    agent: &AgentProcess,
    paths: &[&str],
    queries: &[&str],
) -> Vec<envoy_agent_tests::Response> {
    let envoy = Pid::from_raw(agent.envoy_pid() as i32);
    kill(envoy, Signal::SIGSTOP).unwrap();
    let status = agent.status();
    let scrapes: Vec<_> = paths
        .iter()
        .map(|path| {
            let path = path.to_string();
            tokio::spawn(async move { http_get(status, &path).await })
        })
        .collect();
    // Every scrape has reached the agent (its `scrape` event), within the bound of Envoy's
    // answer's head (2 s) and without failing the test here: an agent that logs no such
    // event is counted below, by Envoy.
    let _ = tokio::time::timeout(Duration::from_millis(1500), async {
        while queries
            .iter()
            .map(|q| agent.events_with("scrape", "query", q).len())
            .sum::<usize>()
            < paths.len()
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    kill(envoy, Signal::SIGCONT).unwrap();
    let mut answers = Vec::new();
    for scrape in scrapes {
        let answer = scrape.await.unwrap().unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert!(
            answer.body.contains("\nenvoy_agent_envoy_stats_up 1\n"),
            "{}",
            answer.body
        );
        answers.push(answer);
    }
    answers
}

/// Envoy's part of a scrape's answer.
fn envoys_part(body: &str) -> Vec<&str> {
    body.lines()
        .filter(|l| !l.contains("envoy_agent_"))
        .collect()
}

/// Checks that Envoy was asked for `walks` walks of `query` (its access log, first: it holds
/// whatever the agent logs), then returns the agent's `scrape_walk` events for `query`.
async fn walks_of(
    agent: &AgentProcess,
    log: &std::path::Path,
    query: &str,
    walks: usize,
) -> Vec<serde_json::Value> {
    eventually("Envoy to log the walks", PATIENCE, || async {
        (envoys_walks(log, query) >= walks).then_some(())
    })
    .await;
    // Every request Envoy served is in its log within a flush (50 ms) of its end: a walk more
    // than `walks` would be there by now.
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(envoys_walks(log, query), walks, "Envoy's walks of {query}");
    eventually("the agent to log its walks", PATIENCE, || async {
        let events = agent.events_with("scrape_walk", "query", query);
        (events.len() >= walks).then_some(events)
    })
    .await
}

#[tokio::test]
async fn concurrent_scrapes_of_one_query_are_one_walk_of_envoys_stats() {
    let (mut agent, log) = agent_with_admin_access_log().await;
    let query = "filter=%5Eserver%5C.";
    // Spelled differently: the same question.
    let answers = scrape_together(
        &agent,
        &[
            "/stats/prometheus?filter=%5Eserver%5C.",
            "/stats/prometheus?filter=^server%5C.",
        ],
        &[query],
    )
    .await;
    assert!(!envoys_part(&answers[0].body).is_empty());
    assert_eq!(
        envoys_part(&answers[0].body),
        envoys_part(&answers[1].body),
        "the same bytes"
    );
    let walks = walks_of(&agent, &log, query, 1).await;
    assert_eq!(walks.len(), 1, "{walks:?}");
    assert_eq!(walks[0]["subscribers"], 2, "{walks:?}");
    assert_eq!(walks[0]["outcome"], "complete", "{walks:?}");

    // Nothing kept past the walk: a later scrape walks again.
    scrape(agent.status(), query).await;
    walks_of(&agent, &log, query, 2).await;

    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn concurrent_scrapes_of_two_queries_are_two_walks() {
    let (mut agent, log) = agent_with_admin_access_log().await;
    let (server, used) = ("filter=%5Eserver%5C.", "usedonly");
    let answers = scrape_together(
        &agent,
        &[
            &format!("/stats/prometheus?{server}"),
            &format!("/stats/prometheus?{used}"),
        ],
        &[server, used],
    )
    .await;
    assert_ne!(envoys_part(&answers[0].body), envoys_part(&answers[1].body));
    for query in [server, used] {
        let walks = walks_of(&agent, &log, query, 1).await;
        assert_eq!(walks.len(), 1, "{query}: {walks:?}");
        assert_eq!(walks[0]["subscribers"], 1, "{query}: {walks:?}");
    }
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_scrape_that_goes_away_leaves_the_walk_to_the_other() {
    let (mut agent, log) = agent_with_admin_access_log().await;
    let query = "filter=%5Eserver%5C.";
    let envoy = Pid::from_raw(agent.envoy_pid() as i32);
    kill(envoy, Signal::SIGSTOP).unwrap();
    // The first asks, then hangs up before Envoy answers.
    let mut first = tokio::net::TcpStream::connect(agent.status())
        .await
        .unwrap();
    first
        .write_all(format!("GET /stats/prometheus?{query} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let second = tokio::spawn(http_get(
        agent.status(),
        "/stats/prometheus?filter=%5Eserver%5C.",
    ));
    eventually("both scrapes to reach the agent", PATIENCE, || async {
        (agent.events_with("scrape", "query", query).len() == 2).then_some(())
    })
    .await;
    drop(first);
    kill(envoy, Signal::SIGCONT).unwrap();
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.status, 200);
    assert!(
        second.body.contains("\nenvoy_agent_envoy_stats_up 1\n"),
        "{}",
        second.body
    );
    assert!(second.body.contains("envoy_server_live"), "{}", second.body);
    let walks = walks_of(&agent, &log, query, 1).await;
    assert_eq!(walks.len(), 1, "{walks:?}");
    assert_eq!(walks[0]["subscribers"], 2, "{walks:?}");
    assert_eq!(walks[0]["outcome"], "complete", "{walks:?}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

//! The pre-flight cache end to end (issue 14): a (binary, config) pair is validated once. Each
//! `envoy --mode validate` the agent runs is one structured `validate` event, and each
//! handoff says whether its pre-flight found the verdict ready (`preflight_cache`).

use envoy_agent_tests::{
    AgentProcess, Load, PATIENCE, bootstrap_yaml_on, eventually, http_get, live_at, serves,
};
use nix::sys::signal::Signal;

use crate::agent;

const FAST: &[&str] = &["--drain-time", "1s", "--parent-shutdown-time", "2s"];

fn listener(agent: &AgentProcess) -> std::net::SocketAddr {
    let port = agent.ports.map(|p| p.listener_port).unwrap_or_default();
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

fn write_bootstrap(agent: &AgentProcess, body: &str) {
    let p = agent.ports.unwrap();
    envoy_agent_proxy::write_atomically(
        &agent.dir.join("bootstrap.yaml"),
        bootstrap_yaml_on(p.admin_port, p.listener_port, body).as_bytes(),
    )
    .unwrap();
}

async fn one_generation(agent: &AgentProcess) {
    eventually("the parent to exit", PATIENCE, || async {
        (agent.envoys().len() == 1).then_some(())
    })
    .await;
}

/// The hot restarts that reached LIVE, in order.
fn handoffs(agent: &AgentProcess) -> Vec<serde_json::Value> {
    agent
        .events_with("handoff", "outcome", "live")
        .into_iter()
        .filter(|e| e["first"] == false)
        .collect()
}

#[tokio::test]
async fn sighup_with_an_unchanged_config_runs_no_validation() {
    let mut agent = agent().hot_restart().args(FAST).start().await;
    // The first epoch started without a pre-flight (nothing served to protect); its LIVE
    // proved the pair good.
    let validations = agent.events("validate").len();
    let load = Load::start(listener(&agent), "/", 2, 2);
    for epoch in 1..=3 {
        agent.signal(Signal::SIGHUP);
        live_at(&agent.admin, epoch).await;
        one_generation(&agent).await;
    }
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    let handoffs = handoffs(&agent);
    assert_eq!(handoffs.len(), 3, "{handoffs:?}");
    for h in &handoffs {
        assert_eq!(h["preflight_cache"], "hit", "{h}");
    }
    assert_eq!(
        agent.events("validate").len(),
        validations,
        "no `envoy --mode validate` for an unchanged config: {:?}",
        agent.events("validate")
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_changed_config_is_validated_once_with_the_watch_and_a_sighup_racing() {
    let mut agent = agent()
        .hot_restart()
        .args(FAST)
        .args(&["--watch-config"])
        .start()
        .await;
    let before = agent.events("validate").len();
    let load = Load::start(listener(&agent), "/", 2, 2);

    // The watch sees the change (and validates it while it settles) and a SIGHUP asks for
    // the same restart at once.
    write_bootstrap(&agent, "changed");
    agent.signal(Signal::SIGHUP);
    // Both asks are answered: the watch's restart is the last one, whether it ran on its own
    // or was coalesced with the SIGHUP's.
    eventually("the watch's restart", PATIENCE, || async {
        handoffs(&agent)
            .iter()
            .any(|h| h["reason"].as_str().unwrap_or("").contains("config change"))
            .then_some(())
    })
    .await;
    one_generation(&agent).await;
    assert_eq!(
        http_get(listener(&agent), "/").await.unwrap().body,
        "changed"
    );
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);

    let validations: Vec<_> = agent.events("validate").split_off(before);
    assert_eq!(
        validations.len(),
        1,
        "the new pair is validated exactly once: {validations:?}"
    );
    assert_eq!(
        validations[0]["outcome"], "accepted",
        "{:?}",
        validations[0]
    );
    let handoffs = handoffs(&agent);
    let misses = handoffs
        .iter()
        .filter(|h| h["preflight_cache"] == "miss")
        .count();
    assert!(
        misses <= 1,
        "at most one restart waited for it: {handoffs:?}"
    );
    assert!(
        handoffs
            .iter()
            .all(|h| h["preflight_cache"] == "hit" || h["preflight_cache"] == "miss"),
        "every restart was pre-flighted: {handoffs:?}"
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn an_invalid_config_is_rejected_again_without_an_exec_and_the_serving_epoch_untouched() {
    let mut agent = agent().hot_restart().args(FAST).start().await;
    let p = agent.ports.unwrap();
    let load = Load::start(listener(&agent), "/", 2, 2);
    // Valid YAML, refused by Envoy: a route to a cluster that does not exist.
    let bad = bootstrap_yaml_on(p.admin_port, p.listener_port, "x").replace(
        "direct_response: { status: 200, body: { inline_string: \"x\" } }",
        "route: { cluster: no_such_cluster }",
    );
    assert!(bad.contains("no_such_cluster"));
    let before = agent.events("validate").len();
    std::fs::write(agent.dir.join("bootstrap.yaml"), bad).unwrap();
    for attempt in 1..=2 {
        agent.signal(Signal::SIGHUP);
        eventually("the restart to be rejected", PATIENCE, || async {
            (agent.events_with("handoff", "outcome", "rejected").len() == attempt).then_some(())
        })
        .await;
        let info = agent.admin.server_info().await.unwrap();
        assert_eq!(info.restart_epoch, 0, "the serving epoch is untouched");
        assert_eq!(agent.envoys().len(), 1, "nothing was started");
    }
    let rejected = agent.events_with("handoff", "outcome", "rejected");
    // The first restart ran Envoy, or found the verdict of a validation ahead of it (the
    // agent warms its cache in the background after the first LIVE); the second never does.
    assert_ne!(rejected[0]["preflight_cache"], "none", "{}", rejected[0]);
    assert_eq!(rejected[1]["preflight_cache"], "hit", "{}", rejected[1]);
    for r in &rejected {
        let reason = r["error"].as_str().unwrap_or("");
        assert!(reason.contains("no_such_cluster"), "reported again: {r}");
    }
    let validations: Vec<_> = agent.events("validate").split_off(before);
    assert_eq!(
        validations.len(),
        1,
        "one exec for the pair: {validations:?}"
    );
    assert_eq!(validations[0]["outcome"], "rejected");

    // Changed again (fixed): validated anew, and the restart goes ahead.
    write_bootstrap(&agent, "fixed");
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    serves(listener(&agent), "fixed").await;
    assert_eq!(agent.events("validate").len(), before + 2);
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

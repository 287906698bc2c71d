//! Envoy upgrades by hot restart, with two real releases: the older one
//! ([`envoy_agent_tests::UPGRADE_FROM_VERSION`], `ENVOY_UPGRADE_FROM_PATH`) and the current one
//! (`ENVOY_PATH`). Both share a hot-restart version, so the new release takes the sockets from
//! the old one and no request fails.

use std::path::{Path, PathBuf};

use envoy_agent_proxy::ServerState;
use envoy_agent_tests::{
    Load, PATIENCE, envoy_children_of, envoy_path, envoy_release, eventually, live_at,
    process_alive, release_of, upgrade_from_envoy_path,
};
use nix::sys::signal::Signal;

use crate::agent;
use crate::cross_pod::Node;

/// The two releases, checked to be two: an "upgrade" to the same release proves nothing.
fn releases() -> ((PathBuf, String), (PathBuf, String)) {
    let old = upgrade_from_envoy_path();
    let new = envoy_path();
    let (old_release, new_release) = (release_of(&old), release_of(&new));
    assert_ne!(
        old_release,
        new_release,
        "ENVOY_UPGRADE_FROM_PATH ({}) and ENVOY_PATH ({}) are the same release",
        old.display(),
        new.display()
    );
    ((old, old_release), (new, new_release))
}

/// How the new release lands on the path the agent runs.
#[derive(Clone, Copy)]
enum Replace {
    /// A symlink repointed, as an alternatives system or a versioned install does (a new link
    /// renamed over the old one).
    Symlink,
    /// A new file renamed over the old one, as a package manager does: the running Envoy's
    /// file is unlinked.
    Rename,
}

/// How the operator asks for the restart.
#[derive(Clone, Copy)]
enum Trigger {
    Sighup,
    /// `envoy-agent restart` (gRPC `HotRestart`), which answers once the new epoch is LIVE.
    Grpc,
}

/// Puts `release` at `path` the way `how` says, in one step.
fn install(how: Replace, release: &Path, path: &Path) {
    let next = path.with_extension("next");
    let _ = std::fs::remove_file(&next);
    match how {
        Replace::Symlink => std::os::unix::fs::symlink(release, &next).unwrap(),
        // A hard link is a new name for the same 100 MB: a copy only across file systems.
        Replace::Rename => {
            if std::fs::hard_link(release, &next).is_err() {
                std::fs::copy(release, &next).unwrap();
            }
        }
    }
    std::fs::rename(&next, path).unwrap();
}

/// The release the LIVE Envoy on the family's admin port runs, at `epoch`.
async fn live_release(admin: &envoy_agent_proxy::AdminClient, epoch: u32) -> String {
    let info = admin.server_info().await.unwrap();
    assert_eq!((info.state, info.restart_epoch), (ServerState::Live, epoch));
    envoy_release(&info.version)
        .unwrap_or_else(|| panic!("no release in {:?}", info.version))
        .to_owned()
}

/// The (device, inode) of a file, or of the file a running process was started from (even
/// once unlinked).
fn file_id(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).unwrap();
    (meta.dev(), meta.ino())
}

fn exe_of(pid: u32) -> (u64, u64) {
    file_id(Path::new(&format!("/proc/{pid}/exe")))
}

/// Whether one of `events` (the agent's `validate` events) is an accepted `--mode validate`
/// of what `path` leads to now.
fn validated_with(events: &[serde_json::Value], path: &Path) -> bool {
    let resolved = std::fs::canonicalize(path).unwrap();
    events.iter().any(|e| {
        e["outcome"] == "accepted" && e["resolved"].as_str() == Some(resolved.to_str().unwrap())
    })
}

/// One pod upgraded in place: the agent runs the old release from a path that never changes,
/// the new release is put there under load, and a restart is asked for: at once, or once the
/// agent has noticed the new binary and validated it ahead (`ahead`).
async fn upgrade_in_one_pod(how: Replace, trigger: Trigger, ahead: bool) {
    let ((old, old_release), (new, new_release)) = releases();
    let builder = agent().hot_restart();
    let path = builder.dir().join("envoy");
    install(how, &old, &path);
    let mut agent = builder
        .envoy_path(path.clone())
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .start()
        .await;
    let listener = std::net::SocketAddr::from((
        [127, 0, 0, 1],
        agent.ports.map(|p| p.listener_port).unwrap(),
    ));
    assert_eq!(live_release(&agent.admin, 0).await, old_release);
    let old_envoy = agent.envoys()[0];
    assert_eq!(exe_of(old_envoy), file_id(&path));
    let load = Load::start(listener, "/", 4, 4);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 50).then_some(())
    })
    .await;

    let validated_before = agent.events("validate").len();
    install(how, &new, &path);
    if ahead {
        // A fraction of a second after the first epoch's LIVE: the change must still be seen.
        // (A refusal ahead has no `cache`; the running binary's own pair is prevalidated too,
        // once its version is known: the event names the binary's inode.)
        let inode = file_id(&path).1;
        eventually("the new release validated ahead", PATIENCE, || async {
            agent
                .events_with("prevalidated", "cache", "miss")
                .into_iter()
                .find(|e| e["binary_inode"] == inode)
        })
        .await;
    }
    match trigger {
        Trigger::Sighup => agent.signal(Signal::SIGHUP),
        Trigger::Grpc => {
            let (code, out, err) =
                crate::grpc::cli(&agent, &["restart", "--reason", "envoy upgrade"]).await;
            assert_eq!((code, out.trim()), (0, "epoch 1 is LIVE"), "{err}");
        }
    }
    live_at(&agent.admin, 1).await;
    assert_eq!(live_release(&agent.admin, 1).await, new_release);
    // The old release drains and is terminated by the new one: one Envoy, the new release.
    eventually("the old epoch to exit", PATIENCE, || async {
        (!process_alive(old_envoy) && agent.envoys().len() == 1).then_some(())
    })
    .await;
    assert_eq!(exe_of(agent.envoys()[0]), file_id(&path));

    let handoff = &agent.events_with("handoff", "epoch", "1")[0];
    assert_eq!(handoff["outcome"], "live", "{handoff}");
    assert_eq!(handoff["first"], false, "{handoff}");
    // Checked by an exec of its own, or found checked ahead: never let through unchecked.
    let cache = handoff["preflight_cache"].as_str();
    if ahead {
        assert_eq!(cache, Some("hit"), "{handoff}");
    } else {
        // The agent may have noticed the new binary between the swap and the trigger.
        assert!(matches!(cache, Some("miss" | "hit")), "{handoff}");
    }
    let validated = agent.events("validate");
    assert!(
        validated_with(&validated[validated_before..], &path),
        "no accepted `--mode validate` of the new release at {}: {validated:?}",
        path.display()
    );

    // Served by the new release for a while, then stopped.
    let served = load.ok();
    eventually("the new release to serve the load", PATIENCE, || async {
        (load.ok() > served + 50).then_some(())
    })
    .await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    eprintln!(
        "upgrade {old_release} -> {new_release} in one pod: {} requests ok, {} failed",
        report.ok, report.failed
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn an_upgrade_in_one_pod_by_repointing_a_symlink_and_sighup_loses_no_request() {
    upgrade_in_one_pod(Replace::Symlink, Trigger::Sighup, false).await;
}

#[tokio::test]
async fn an_upgrade_in_one_pod_by_renaming_a_release_over_the_binary_validated_ahead_and_grpc() {
    upgrade_in_one_pod(Replace::Rename, Trigger::Grpc, true).await;
}

/// The test bootstrap with an HTTP filter that only the new release has
/// (`envoy.filters.http.body_size_limit`, new in 1.40): the old release rejects it.
fn bootstrap_for_the_new_release(agent: &envoy_agent_tests::AgentProcess) -> String {
    let p = agent.ports.unwrap();
    let yaml = envoy_agent_tests::bootstrap_yaml_on(p.admin_port, p.listener_port, "new only");
    let filters = "          http_filters:\n";
    assert!(yaml.contains(filters));
    yaml.replacen(
        filters,
        &format!(
            "{filters}          - name: envoy.filters.http.body_size_limit\n            \
             typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.\
             filters.http.body_size_limit.v3.BodySizeLimit\n"
        ),
        1,
    )
}

/// Whether `envoy --mode validate` of `binary` accepts `bootstrap`.
fn accepts(binary: &Path, bootstrap: &Path) -> bool {
    std::process::Command::new(binary)
        .args(["--mode", "validate", "-l", "error", "-c"])
        .arg(bootstrap)
        .output()
        .unwrap()
        .status
        .success()
}

#[tokio::test]
async fn a_config_only_the_new_release_runs_is_judged_by_the_new_release_and_a_rollback_refused() {
    let ((old, old_release), (new, new_release)) = releases();
    let builder = agent().hot_restart();
    let path = builder.dir().join("envoy");
    install(Replace::Symlink, &old, &path);
    let mut agent = builder
        .envoy_path(path.clone())
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .start()
        .await;
    let listener = std::net::SocketAddr::from((
        [127, 0, 0, 1],
        agent.ports.map(|p| p.listener_port).unwrap(),
    ));
    let load = Load::start(listener, "/", 2, 2);

    // The release and the config that needs it, in one step.
    let bootstrap = agent.dir.join("bootstrap.yaml");
    envoy_agent_proxy::write_atomically(
        &bootstrap,
        bootstrap_for_the_new_release(&agent).as_bytes(),
    )
    .unwrap();
    assert!(
        !accepts(&old, &bootstrap) && accepts(&new, &bootstrap),
        "the premise: {old_release} rejects the config, {new_release} accepts it"
    );
    install(Replace::Symlink, &new, &path);
    agent.signal(Signal::SIGHUP);
    // Judged by the old release, the restart would have been refused.
    live_at(&agent.admin, 1).await;
    assert_eq!(live_release(&agent.admin, 1).await, new_release);
    eventually("the old epoch to exit", PATIENCE, || async {
        (agent.envoys().len() == 1).then_some(())
    })
    .await;
    assert_eq!(
        envoy_agent_tests::http_get(listener, "/")
            .await
            .unwrap()
            .body,
        "new only"
    );

    // A rollback to a release that cannot run the config: refused, the new release serves on.
    install(Replace::Symlink, &old, &path);
    agent.signal(Signal::SIGHUP);
    let rejected = agent.wait_event("handoff", "outcome", "rejected").await;
    assert_eq!(rejected["epoch"], 2, "{rejected}");
    let reason = rejected["error"].as_str().unwrap();
    assert!(
        reason.contains("body_size_limit"),
        "Envoy's reason: {reason}"
    );
    assert_eq!(live_release(&agent.admin, 1).await, new_release);
    assert_eq!(agent.envoys().len(), 1, "nothing was started");

    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(report.ok > 0, "{report:?}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn an_upgrade_across_pods_to_a_successor_with_the_new_release_loses_no_request() {
    let ((old, old_release), (new, new_release)) = releases();
    let node = Node::new();
    let mut a = node.pod("pod-a").envoy_path(old.clone()).start().await;
    assert_eq!(live_release(&node.admin(), 0).await, old_release);
    let a_envoys = envoy_children_of(a.agent_pid());
    assert_eq!(a_envoys.len(), 1, "{a_envoys:?}");
    let a_envoy = a_envoys[0];
    assert_eq!(exe_of(a_envoy), file_id(&old));
    let load = Load::start(node.listener(), "/", 4, 4);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 50).then_some(())
    })
    .await;

    // The successor pod's image carries the new release. start() returns once its marker
    // exists: its epoch is LIVE.
    let mut b = node.pod("pod-b").envoy_path(new.clone()).start().await;
    live_at(&node.admin(), 1).await;
    assert_eq!(live_release(&node.admin(), 1).await, new_release);
    let b_envoys = envoy_children_of(b.agent_pid());
    assert_eq!(b_envoys.len(), 1, "{b_envoys:?}");
    assert_eq!(exe_of(b_envoys[0]), file_id(&new));
    let handoff = &b.events_with("handoff", "epoch", "1")[0];
    assert_eq!(handoff["outcome"], "live", "{handoff}");
    // A successor's first epoch takes over a serving one: validated first, by its own binary.
    assert_eq!(handoff["preflight_cache"], "miss", "{handoff}");
    assert!(
        validated_with(&b.events("validate"), &new),
        "no accepted `--mode validate` of {}: {:?}",
        new.display(),
        b.events("validate")
    );
    eventually("pod-a to report the handover", PATIENCE, || async {
        a.events("handed_over")
            .iter()
            .any(|e| {
                e["successor"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("pod-b-"))
            })
            .then_some(())
    })
    .await;

    // The kubelet deletes the old pod: its Envoy is terminated by the successor's, then it
    // exits 0.
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    assert!(!process_alive(a_envoy), "pod-a's envoy is gone");
    assert_eq!(live_release(&node.admin(), 1).await, new_release);

    let served = load.ok();
    eventually("the new release to serve the load", PATIENCE, || async {
        (load.ok() > served + 50).then_some(())
    })
    .await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    eprintln!(
        "upgrade {old_release} -> {new_release} across pods: {} requests ok, {} failed",
        report.ok, report.failed
    );
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

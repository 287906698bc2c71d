//! Hot restart end to end: the supervisor, the real Envoy, real load.
//!
//! Each test has its own base id and fixed ports (a port-0 listener is not handed over by
//! Envoy), and short drain and parent-shutdown times so that handoffs follow each other fast.

use std::time::Duration;

use envoy_agent_proxy::ServerState;
use envoy_agent_tests::{
    AgentProcess, Load, PATIENCE, bootstrap_yaml_on, eventually, http_get, process_alive, serves,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::agent;
use envoy_agent_tests::live_at;

/// Drain 1s, parent shutdown 2s: a handoff is over (parent gone) about 2s after LIVE.
pub(crate) const FAST: &[&str] = &["--drain-time", "1s", "--parent-shutdown-time", "2s"];

/// How many hot restarts (not first starts) ended with `outcome`.
pub(crate) fn restarts(agent: &AgentProcess, outcome: &str) -> usize {
    agent
        .events_with("handoff", "outcome", outcome)
        .iter()
        .filter(|e| e["first"] == false)
        .count()
}

async fn start(extra: &[&str]) -> AgentProcess {
    agent().hot_restart().args(FAST).args(extra).start().await
}

/// Waits until the agent runs exactly one Envoy (the previous parent has exited).
pub(crate) async fn one_generation(agent: &AgentProcess) {
    eventually("the parent to exit", PATIENCE, || async {
        (agent.envoys().len() == 1).then_some(())
    })
    .await;
}

pub(crate) fn listener(agent: &AgentProcess) -> std::net::SocketAddr {
    let port = agent.ports.map(|p| p.listener_port).unwrap_or_default();
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

fn write_bootstrap(agent: &AgentProcess, body: &str) {
    let p = agent.ports.unwrap();
    let path = agent.dir.join("bootstrap.yaml");
    envoy_agent_proxy::write_atomically(
        &path,
        bootstrap_yaml_on(p.admin_port, p.listener_port, body).as_bytes(),
    )
    .unwrap();
}

#[tokio::test]
async fn twenty_hot_restarts_under_load_lose_no_request() {
    let mut agent = start(&[]).await;
    let load = Load::start(listener(&agent), "/", 4, 4);
    for epoch in 1..=20 {
        agent.signal(Signal::SIGHUP);
        live_at(&agent.admin, epoch).await;
        one_generation(&agent).await;
    }
    let served_before_stop = load.ok();
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(served_before_stop > 100, "the load ran: {report:?}");
    assert_eq!(restarts(&agent, "live"), 20);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn config_changes_trigger_one_restart_each_and_bursts_one() {
    let mut agent = start(&["--watch-config"]).await;
    let hello = listener(&agent);
    write_bootstrap(&agent, "v1");
    live_at(&agent.admin, 1).await;
    assert_eq!(http_get(hello, "/").await.unwrap().body, "v1");
    one_generation(&agent).await;

    // A burst of ten writes: one restart.
    for i in 0..10 {
        write_bootstrap(&agent, &format!("burst {i}"));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    live_at(&agent.admin, 2).await;
    serves(hello, "burst 9").await;
    one_generation(&agent).await;
    // A sentinel change: had the burst caused another restart, it would have come first and
    // the sentinel would land at epoch 4.
    write_bootstrap(&agent, "sentinel");
    live_at(&agent.admin, 3).await;
    serves(hello, "sentinel").await;
    assert_eq!(restarts(&agent, "live"), 3);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_configmap_symlink_swap_triggers_a_restart() {
    // The kubelet's layout: config/bootstrap.yaml -> ..data/bootstrap.yaml, ..data -> ..v1.
    let builder = agent().hot_restart();
    let p = builder.ports().unwrap();
    let config = builder.dir().join("config");
    std::fs::create_dir_all(config.join("..v1")).unwrap();
    std::fs::write(
        config.join("..v1/bootstrap.yaml"),
        bootstrap_yaml_on(p.admin_port, p.listener_port, "one"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..v1", config.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/bootstrap.yaml", config.join("bootstrap.yaml")).unwrap();
    let mut agent = builder
        .bootstrap_path(config.join("bootstrap.yaml"))
        .args(FAST)
        .args(&["--watch-config"])
        .start()
        .await;

    std::fs::create_dir_all(config.join("..v2")).unwrap();
    std::fs::write(
        config.join("..v2/bootstrap.yaml"),
        bootstrap_yaml_on(p.admin_port, p.listener_port, "two"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..v2", config.join("..data_tmp")).unwrap();
    std::fs::rename(config.join("..data_tmp"), config.join("..data")).unwrap();
    std::fs::remove_dir_all(config.join("..v1")).unwrap();

    live_at(&agent.admin, 1).await;
    serves(listener(&agent), "two").await;
    one_generation(&agent).await;
    // A sentinel swap: had the first swap caused two restarts, this one would land at 3.
    std::fs::create_dir_all(config.join("..v3")).unwrap();
    std::fs::write(
        config.join("..v3/bootstrap.yaml"),
        bootstrap_yaml_on(p.admin_port, p.listener_port, "three"),
    )
    .unwrap();
    std::os::unix::fs::symlink("..v3", config.join("..data_tmp")).unwrap();
    std::fs::rename(config.join("..data_tmp"), config.join("..data")).unwrap();
    live_at(&agent.admin, 2).await;
    serves(listener(&agent), "three").await;
    assert_eq!(restarts(&agent, "live"), 2);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// `UpdateConfig` on a bootstrap behind a ConfigMap's symlinks writes the file they point to:
/// the layout stays, and the ConfigMap's next update (a `..data` swap) still applies.
#[tokio::test]
async fn update_config_keeps_a_configmaps_symlinks_and_its_next_update_applies() {
    let builder = agent().hot_restart();
    let p = builder.ports().unwrap();
    let config = builder.dir().join("config");
    let version = |name: &str, body: &str| {
        std::fs::create_dir_all(config.join(name)).unwrap();
        std::fs::write(
            config.join(name).join("bootstrap.yaml"),
            bootstrap_yaml_on(p.admin_port, p.listener_port, body),
        )
        .unwrap();
    };
    version("..v1", "one");
    std::os::unix::fs::symlink("..v1", config.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/bootstrap.yaml", config.join("bootstrap.yaml")).unwrap();
    let mut agent = builder
        .bootstrap_path(config.join("bootstrap.yaml"))
        .args(FAST)
        .args(&["--watch-config"])
        .start()
        .await;

    let update = agent.dir.join("update.yaml");
    std::fs::write(
        &update,
        bootstrap_yaml_on(p.admin_port, p.listener_port, "two"),
    )
    .unwrap();
    let (code, out, err) =
        crate::grpc::cli(&agent, &["update-config", update.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{out}{err}");
    live_at(&agent.admin, 1).await;
    serves(listener(&agent), "two").await;
    let link = std::fs::symlink_metadata(config.join("bootstrap.yaml")).unwrap();
    assert!(link.file_type().is_symlink(), "the layout stays");
    one_generation(&agent).await;

    version("..v2", "three");
    std::os::unix::fs::symlink("..v2", config.join("..data_tmp")).unwrap();
    std::fs::rename(config.join("..data_tmp"), config.join("..data")).unwrap();
    live_at(&agent.admin, 2).await;
    serves(listener(&agent), "three").await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_bad_config_is_rejected_and_the_old_epoch_keeps_serving() {
    let mut agent = start(&[]).await;
    let p = agent.ports.unwrap();
    let path = agent.dir.join("bootstrap.yaml");
    let load = Load::start(listener(&agent), "/", 2, 2);

    // A parse error, then a route to a cluster that does not exist.
    let unknown_cluster = bootstrap_yaml_on(p.admin_port, p.listener_port, "x").replace(
        "direct_response: { status: 200, body: { inline_string: \"x\" } }",
        "route: { cluster: no_such_cluster }",
    );
    assert!(unknown_cluster.contains("no_such_cluster"));
    for (i, bad) in [
        "admin: [this is not, a bootstrap".to_owned(),
        unknown_cluster,
    ]
    .iter()
    .enumerate()
    {
        std::fs::write(&path, bad).unwrap();
        agent.signal(Signal::SIGHUP);
        eventually("the restart to be rejected", PATIENCE, || async {
            (restarts(&agent, "rejected") == i + 1).then_some(())
        })
        .await;
        let info = agent.admin.server_info().await.unwrap();
        assert_eq!(
            (info.state, info.restart_epoch),
            (ServerState::Live, 0),
            "old epoch, admin intact"
        );
        assert_eq!(agent.envoys().len(), 1, "nothing was started");
    }
    let rejected = agent.events_with("handoff", "outcome", "rejected");
    let reason = rejected[1]["error"].as_str().unwrap();
    assert!(
        reason.contains("no_such_cluster"),
        "envoy's reason: {reason}"
    );

    // A good config afterwards hot-restarts as usual, to the next epoch.
    write_bootstrap(&agent, "good again");
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert_eq!(
        http_get(listener(&agent), "/").await.unwrap().body,
        "good again"
    );
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// A config Envoy accepts that moves the admin port: a new epoch there would serve where the
/// agent does not look (and be killed at the handoff deadline, its parent gone). Refused
/// before anything starts, saying why; the serving epoch serves on.
#[tokio::test]
async fn a_config_that_moves_the_admin_port_is_refused_and_the_old_epoch_keeps_serving() {
    // The bootstrap's TCP admin, which the agent reaches Envoy at.
    let mut agent = start(&["--watch-config", "--envoy-admin", "bootstrap"]).await;
    let p = agent.ports.unwrap();
    let path = agent.dir.join("bootstrap.yaml");
    let load = Load::start(listener(&agent), "/", 2, 2);
    let elsewhere = envoy_agent_tests::free_port();
    envoy_agent_proxy::write_atomically(
        &path,
        bootstrap_yaml_on(elsewhere, p.listener_port, "moved").as_bytes(),
    )
    .unwrap();
    let rejected = agent.wait_event("handoff", "outcome", "rejected").await;
    let reason = rejected["error"].as_str().unwrap();
    assert!(
        reason.contains("moves Envoy's admin address") && reason.contains(&elsewhere.to_string()),
        "{reason}"
    );
    let info = agent.admin.server_info().await.unwrap();
    assert_eq!((info.state, info.restart_epoch), (ServerState::Live, 0));
    assert_eq!(agent.envoys().len(), 1, "nothing was started");
    assert!(agent.running());
    write_bootstrap(&agent, "back");
    live_at(&agent.admin, 1).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// On the agent's admin socket (a node proxy's default), the bootstrap's own admin address is
/// not where the agent reaches Envoy: a config that moves it is applied, and the new epoch's
/// admin is on the socket, not on the bootstrap's port.
#[tokio::test]
async fn with_the_agents_admin_socket_a_config_that_moves_the_bootstraps_admin_port_applies() {
    let mut agent = start(&["--watch-config"]).await;
    let p = agent.ports.unwrap();
    assert_eq!(agent.admin.addr(), &p.admin());
    let path = agent.dir.join("bootstrap.yaml");
    let elsewhere = envoy_agent_tests::free_port();
    envoy_agent_proxy::write_atomically(
        &path,
        bootstrap_yaml_on(elsewhere, p.listener_port, "moved").as_bytes(),
    )
    .unwrap();
    live_at(&agent.admin, 1).await;
    for port in [p.admin_port, elsewhere] {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "nothing listens on the bootstrap's admin port {port}"
        );
    }
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// A FIFO or a device in the bootstrap's place (a mistake, or a neighbour's trick): the
/// restart is refused naming what it is, nothing blocks or grows, and the agent stays
/// responsive (readiness, a later restart, SIGTERM).
#[tokio::test]
async fn a_fifo_or_a_device_in_place_of_the_bootstrap_is_refused_without_hanging_the_agent() {
    let mut agent = start(&[]).await;
    let path = agent.dir.join("bootstrap.yaml");
    let load = Load::start(listener(&agent), "/", 2, 2);
    let fifo = agent.dir.join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    for (i, (what, target)) in [
        ("a FIFO", fifo.as_path()),
        ("a device", std::path::Path::new("/dev/zero")),
    ]
    .into_iter()
    .enumerate()
    {
        let _ = std::fs::remove_file(&path);
        std::os::unix::fs::symlink(target, &path).unwrap();
        agent.signal(Signal::SIGHUP);
        eventually("the restart to be refused", PATIENCE, || async {
            (restarts(&agent, "rejected") == i + 1).then_some(())
        })
        .await;
        let refused = agent
            .events_with("handoff", "outcome", "rejected")
            .pop()
            .unwrap();
        let reason = refused["error"].as_str().unwrap();
        assert!(
            reason.contains(what) && reason.contains("bootstrap.yaml"),
            "{reason}"
        );
        let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
        assert_eq!(ready.status, 200, "{}", ready.body);
    }
    let _ = std::fs::remove_file(&path);
    write_bootstrap(&agent, "regular again");
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_sighup_storm_is_coalesced_without_a_third_generation() {
    let mut agent = start(&[]).await;
    let load = Load::start(listener(&agent), "/", 2, 2);
    let pid = agent.pid();
    let watcher = {
        // Count generations throughout.
        tokio::spawn(async move {
            let mut most = 0;
            for _ in 0..400 {
                most = most.max(envoy_agent_tests::envoy_children_of(pid).len());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            most
        })
    };
    for _ in 0..50 {
        agent.signal(Signal::SIGHUP);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The first SIGHUP restarts at once; the other 49 are coalesced into one more restart
    // after the first handoff's parent has exited.
    live_at(&agent.admin, 2).await;
    one_generation(&agent).await;
    // Every SIGHUP was queued long before: nothing is left queued or under way.
    let (_, json, _) = crate::grpc::cli(&agent, &["status", "--json"]).await;
    let status: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(
        status["family"]["handoff"].is_null(),
        "no restart pending: {status}"
    );
    assert!(status["family"].is_object(), "{status}");
    assert_eq!(status["newest_live_epoch"], 2, "{status}");
    let most = watcher.await.unwrap();
    assert!(most <= 2, "at most two generations at once, saw {most}");
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_killed_draining_parent_does_not_take_the_child_down() {
    // A long parent shutdown: the parent is still draining when it is killed.
    let mut agent = agent()
        .hot_restart()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "60s"])
        .start()
        .await;
    let parent = agent.envoy_pid();
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    let load = Load::start(listener(&agent), "/", 2, 2);
    tokio::time::sleep(Duration::from_millis(200)).await;
    kill(Pid::from_raw(parent as i32), Signal::SIGKILL).unwrap();
    // Without a stand-in, the child aborts about 13s after its parent died (Envoy #7468).
    tokio::time::sleep(Duration::from_secs(16)).await;
    assert!(agent.running(), "the supervisor keeps running");
    let info = agent.admin.server_info().await.unwrap();
    assert_eq!((info.state, info.restart_epoch), (ServerState::Live, 1));
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.wait_event("stand_in", "epoch", "0").await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// The soak's fourth finding (docs/soak.md, `freeze-agent`): the agent itself stopped past its
/// draining parent's deadline. The parent ended on time (its child terminated it), but the
/// agent, continued, judged it overdue before it had reaped it: a `parent_overdue` wedge, a
/// SIGKILL to a zombie, a stand-in. Fresh facts first: none of that, and nothing fails.
#[tokio::test]
async fn an_agent_stopped_past_its_parents_deadline_judges_nothing_from_its_own_stall() {
    let mut agent = agent()
        .hot_restart()
        .args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"])
        .start()
        .await;
    let load = Load::start(listener(&agent), "/", 2, 2);
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    agent.signal(Signal::SIGSTOP);
    // Past the parent-shutdown time (2 s) and the overdue grace (5 s): the parent has exited,
    // unreaped, by the time the agent runs again.
    tokio::time::sleep(Duration::from_secs(9)).await;
    agent.signal(Signal::SIGCONT);
    let exited = agent.wait_event("epoch_exited", "epoch", "0").await;
    // A misjudgment comes before the exit is seen.
    assert!(
        !exited["how"]
            .as_str()
            .unwrap_or_default()
            .contains("killed"),
        "{exited}"
    );
    assert_eq!(agent.events("wedge"), Vec::<serde_json::Value>::new());
    assert_eq!(agent.events("stand_in"), Vec::<serde_json::Value>::new());
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn a_killed_serving_epoch_ends_the_supervisor_with_its_code() {
    let mut agent = start(&[]).await;
    let envoy = agent.envoy_pid();
    kill(Pid::from_raw(envoy as i32), Signal::SIGKILL).unwrap();
    assert_eq!(agent.exit().await.code(), Some(137));
    assert!(!process_alive(envoy));
    agent.wait_event("exit", "exit_path", "proxy_exited").await;
}

#[tokio::test]
async fn a_stopped_envoy_trips_the_admin_watchdog() {
    let mut agent = start(&["--admin-unresponsive-deadline", "2s", "--stop-grace", "1s"]).await;
    let envoy = agent.envoy_pid();
    kill(Pid::from_raw(envoy as i32), Signal::SIGSTOP).unwrap();
    assert_eq!(agent.exit().await.code(), Some(75), "the wedge exit code");
    let stderr = agent.stderr();
    assert!(stderr.contains("admin_unresponsive"), "{stderr}");
    assert!(!process_alive(envoy), "the stopped envoy was killed");
}

#[tokio::test]
async fn the_readiness_marker_follows_the_newest_live_epoch() {
    let builder = agent().hot_restart();
    let marker = builder.dir().join("ready");
    let mut agent = builder
        .args(FAST)
        .args(&["--ready-marker", marker.to_str().unwrap()])
        .start()
        .await;
    eventually("the marker", PATIENCE, || async {
        marker.exists().then_some(())
    })
    .await;
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    assert!(marker.exists());
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
    assert!(!marker.exists(), "removed on stop");
}

/// Zombie children of `pid`, from the host's /proc.
fn zombies_of(pid: u32) -> Vec<u32> {
    envoy_agent_tests::children_of(pid)
        .into_iter()
        .filter(|c| {
            std::fs::read_to_string(format!("/proc/{c}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, rest)| rest.trim_start().starts_with('Z'))
                })
                .unwrap_or(false)
        })
        .collect()
}

#[tokio::test]
async fn as_pid_1_of_its_own_pid_namespace_it_reaps_orphans_and_handles_sigterm() {
    // An "envoy" that leaves an orphan behind each time it runs (pre-flight runs included):
    // the orphan is reparented to the agent, PID 1 of the namespace, and must be reaped.
    let builder = agent().hot_restart();
    let wrapper = builder.dir().join("envoy-with-orphans");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n( sleep 0.2 & )\nexec {} \"$@\"\n",
            envoy_agent_tests::envoy_path().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut agent = builder
        .envoy_path(wrapper)
        // --kill-child: if the test dies, so does the namespace.
        .wrapper(envoy_agent_tests::POD)
        .args(FAST)
        .start()
        .await;
    // `unshare --fork` is the test's child; the agent is its child, PID 1 inside.
    let inner = envoy_agent_tests::children_of(agent.pid());
    assert_eq!(inner.len(), 1, "{inner:?}");
    let supervisor = inner[0];
    let status = std::fs::read_to_string(format!("/proc/{supervisor}/status")).unwrap();
    let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
    assert!(nspid.trim_end().ends_with("\t1"), "PID 1 inside: {nspid}");

    // More orphans, from the pre-flight runs and epoch 1.
    kill(Pid::from_raw(supervisor as i32), Signal::SIGHUP).unwrap();
    live_at(&agent.admin, 1).await;
    // The orphans exit 0.2s after they are born; none may stay a zombie: wait until no
    // orphan is left below PID 1, alive or not (a zombie would stay forever).
    eventually("every orphan exited and reaped", PATIENCE, || async {
        let orphans: Vec<u32> = envoy_agent_tests::children_of(supervisor)
            .into_iter()
            .filter(|c| {
                std::fs::read_to_string(format!("/proc/{c}/comm"))
                    .is_ok_and(|comm| comm.trim() == "sleep")
            })
            .collect();
        orphans.is_empty().then_some(())
    })
    .await;
    assert_eq!(
        zombies_of(supervisor),
        Vec::<u32>::new(),
        "zombies under PID 1"
    );

    kill(Pid::from_raw(supervisor as i32), Signal::SIGTERM).unwrap();
    assert_eq!(
        agent.exit().await.code(),
        Some(0),
        "SIGTERM handled by PID 1"
    );
    assert!(!process_alive(supervisor));
}

#[tokio::test]
async fn a_new_epoch_stuck_initializing_is_stopped_and_its_wedge_cleared() {
    let xds = envoy_agent_tests::silent_server().await;
    let mut agent = start(&["--handoff-deadline", "3s"]).await;
    let p = agent.ports.unwrap();
    let path = agent.dir.join("bootstrap.yaml");
    let load = Load::start(listener(&agent), "/", 2, 2);

    std::fs::write(
        &path,
        envoy_agent_tests::bootstrap_waiting_for_xds(p.admin_port, p.listener_port, "stuck", xds),
    )
    .unwrap();
    agent.signal(Signal::SIGHUP);
    // Epoch 1 has loaded the stuck config once it has taken the admin port from epoch 0 (and
    // then answers nothing: its admin is not up before it initializes).
    eventually("epoch 1 to hang initializing", PATIENCE, || async {
        let info = agent.admin.server_info().await;
        let starting = !agent.events_with("epoch_starting", "epoch", "1").is_empty();
        (starting && info.is_err()).then_some(())
    })
    .await;
    // While epoch 1 hangs, the operator fixes the config; no new trigger is sent.
    write_bootstrap(&agent, "fixed");
    // The deadline stops epoch 1; its INITIALIZING flag is cleared; the old epoch lost its
    // admin to epoch 1, so the same epoch is retried, now on the fixed config.
    live_at(&agent.admin, 1).await;
    serves(listener(&agent), "fixed").await;
    let stderr = agent.stderr();
    assert!(
        stderr.contains("handoff_deadline"),
        "the deadline is a wedge: {stderr}"
    );
    assert!(
        stderr.contains("stale_initializing"),
        "the stale flag was found: {stderr}"
    );
    // Envoy's own refusal (a bare line on its stderr) never happened.
    assert!(
        !stderr
            .lines()
            .any(|l| l.trim() == "previous envoy process is still initializing"),
        "{stderr}"
    );
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// With cold handovers off (by default such a binary is handed over cold:
/// `cold_handover.rs`).
#[tokio::test]
async fn with_no_cold_handover_a_binary_with_another_hot_restart_version_is_rejected() {
    // An "envoy" that says the hot-restart version the test wants, and otherwise runs the real
    // one. Replaced on disk the way a release is (a new file renamed over the path), so the
    // agent sees another binary each time.
    let builder = agent().hot_restart();
    let wrapper = builder.dir().join("envoy-with-version");
    let install = |version: Option<&str>| {
        let fake = match version {
            Some(v) => {
                format!("if [ \"$1\" = --hot-restart-version ]; then echo {v} >&2; exit 0; fi\n")
            }
            None => String::new(),
        };
        let next = wrapper.with_extension("new");
        std::fs::write(
            &next,
            format!(
                "#!/bin/sh\n{fake}exec {envoy} \"$@\"\n",
                envoy = envoy_agent_tests::envoy_path().display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&next, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        std::fs::rename(&next, &wrapper).unwrap();
    };
    install(None);
    let mut agent = builder
        .envoy_path(wrapper.clone())
        .args(FAST)
        .args(&["--no-cold-handover"])
        .start()
        .await;

    // An upgrade of the binary on disk to an incompatible Envoy.
    install(Some("12.999"));
    agent.signal(Signal::SIGHUP);
    eventually("the restart to be rejected", PATIENCE, || async {
        (restarts(&agent, "rejected") == 1).then_some(())
    })
    .await;
    let rejected = &agent.events_with("handoff", "outcome", "rejected")[0];
    let message = rejected["error"].as_str().unwrap();
    assert!(
        message.contains("12.999")
            && message.contains("cannot hot-restart")
            && message.contains("--no-cold-handover"),
        "{message}"
    );
    assert!(agent.events("cold_handover").is_empty());
    let info = agent.admin.server_info().await.unwrap();
    assert_eq!((info.state, info.restart_epoch), (ServerState::Live, 0));
    assert_eq!(agent.envoys().len(), 1, "nothing was started");

    // The same binary again: the same answer, without asking it again.
    agent.signal(Signal::SIGHUP);
    eventually("the second rejection", PATIENCE, || async {
        (restarts(&agent, "rejected") == 2).then_some(())
    })
    .await;
    let second = &agent.events_with("handoff", "outcome", "rejected")[1];
    assert_eq!(second["error"], rejected["error"]);
    assert_eq!(second["preflight_cache"], "hit", "{second}");

    // Back to a compatible binary: hot restart works again.
    install(None);
    agent.signal(Signal::SIGHUP);
    live_at(&agent.admin, 1).await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

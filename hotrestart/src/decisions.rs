//! The supervisor's decisions, each driven through the fake host under paused time: what it
//! spawns, signals, stands in for, records and answers, event by event.

use std::sync::Arc;
use std::time::Duration;

use envoy_agent_proxy::{
    AdminAddress, DrainOptions, Ended, EpochState, HotRestart, Outcome, Proxy, ProxyConfig,
    ProxyError, ProxyPhase, ProxyState, RestartError, Scope, ServerState, Signal, WedgeReason,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::family::{EnvoyFamily, SupervisorHandle};
use crate::handoff::{LIVE_POLL, LIVE_POLL_BLIND, LIVE_POLL_FAST, LIVE_POLL_UNBOUND};
use crate::host::Refusal;
use crate::metrics::SupervisorMetrics;
use crate::node::{FORMAT, Heartbeat, NodeState};
use crate::testing::{Admin, FakeHost, code, killed};

/// Longer than anything here takes; with paused time it costs nothing.
const BOUND: Duration = Duration::from_secs(600);

fn config() -> Config {
    let mut proxy = ProxyConfig::new(
        "/fake/envoy".into(),
        "/fake/bootstrap.yaml".into(),
        AdminAddress::Fixed(std::net::SocketAddr::from(([127, 0, 0, 1], 9901)).into()),
    );
    proxy.options.drain_time = Duration::from_secs(1);
    proxy.options.stop_grace = Duration::from_secs(5);
    proxy.hot_restart = Some(HotRestart {
        base_id: 7,
        parent_shutdown_time: Duration::from_secs(2),
        admin_address_dir: None,
        ephemeral_admin: None,
        socket_path: envoy_agent_proxy::SocketPath::envoy_default(),
    });
    let mut c = Config::new(proxy);
    c.identity = "pod-a-0000aaaa".to_owned();
    c.options.handoff_deadline = Duration::from_secs(10);
    c.proxy.options.admin_unresponsive_deadline = Duration::from_secs(5);
    c.options.cold_base_id = Some(8);
    c
}

struct Family {
    host: FakeHost,
    family: Arc<EnvoyFamily<FakeHost>>,
    handle: SupervisorHandle,
    abort: CancellationToken,
    task: JoinHandle<Result<Ended, ProxyError>>,
}

fn start(host: FakeHost, config: Config) -> Family {
    // The supervisor's log, shown with a failing test's output.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("debug")
        .try_init();
    let family = Arc::new(
        EnvoyFamily::with_host(config, Arc::new(host.clone()), SupervisorMetrics::default())
            .unwrap(),
    );
    let handle = family.handle();
    let abort = CancellationToken::new();
    let task = tokio::spawn({
        let (family, abort) = (family.clone(), abort.clone());
        async move { family.run(abort).await }
    });
    Family {
        host,
        family,
        handle,
        abort,
        task,
    }
}

impl Family {
    async fn until(&self, what: &str, check: impl Fn(&ProxyState) -> bool) -> ProxyState {
        let mut state = self.handle.state();
        tokio::time::timeout(BOUND, state.wait_for(|s| check(s)))
            .await
            .unwrap_or_else(|_| panic!("never: {what}; state {:?}", self.handle.state().borrow()))
            .unwrap()
            .clone()
    }

    async fn serving_at(&self, epoch: u32) -> ProxyState {
        self.until(&format!("serving at {epoch}"), |s| {
            s.phase == ProxyPhase::Serving && s.newest_live == Some(epoch)
        })
        .await
    }

    async fn spawned(&self, spawns: &[u32]) {
        tokio::time::timeout(BOUND, async {
            while self.host.world().spawns != spawns {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("spawns {:?}, expected {spawns:?}", self.host.world().spawns));
    }

    /// Until a cold handover's new family was spawned.
    async fn cold_spawned(&self) {
        tokio::time::timeout(BOUND, async {
            while self.host.world().cold_spawns.is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no cold handover started"));
    }

    /// A hot restart asked for in the background; its outcome on the handle.
    fn restart(&self, reason: &str) -> JoinHandle<Result<u32, RestartError>> {
        let (handle, reason) = (self.handle.clone(), reason.to_owned());
        tokio::spawn(async move { handle.hot_restart(reason).await })
    }

    /// A drain of the listeners the agent picks (`Scope::Auto`), asked beside the test.
    fn drain(&self) -> JoinHandle<Result<envoy_agent_proxy::DrainPlan, crate::FamilyError>> {
        let handle = self.handle.clone();
        tokio::spawn(async move {
            handle
                .drain(DrainOptions {
                    listeners: Scope::Auto,
                    skip_exit: false,
                    hold_notice: false,
                })
                .await
        })
    }

    async fn ended(self) -> (Ended, FakeHost) {
        let ended = tokio::time::timeout(BOUND, self.task)
            .await
            .expect("the family ends")
            .unwrap()
            .unwrap();
        (ended, self.host)
    }

    async fn stop(self) -> (Ended, FakeHost) {
        self.abort.cancel();
        self.ended().await
    }

    /// Stops the family, then cleans up as the agent does before it exits: how often the
    /// family's files were removed.
    async fn stop_and_clean_up(self) -> u32 {
        let family = self.family.clone();
        let (_, host) = self.stop().await;
        family.cleanup();
        host.world().family_files_removed
    }
}

fn heartbeat(identity: &str, state: NodeState, epoch: u32, host: &FakeHost) -> Heartbeat {
    Heartbeat {
        format: FORMAT.to_owned(),
        identity: identity.to_owned(),
        pid: 1,
        base_id: 7,
        hot_restart_version: "11.104".to_owned(),
        newest_epoch: epoch,
        envoy_pid: 50,
        state,
        updated_unix_ms: crate::host::Host::now_unix_ms(host),
        parent_draining_until_unix_ms: 0,
        restart_in_flight: false,
        cold_takeover_of: None,
        handover: None,
        socket_path: String::new(),
        admin_address: String::new(),
        generation: 0,
    }
}

#[tokio::test(start_paused = true)]
async fn a_stale_marker_goes_first_and_comes_back_with_the_first_live_epoch() {
    let host = FakeHost::default();
    assert!(host.world().marker, "left by a crashed container");
    let f = start(host, config());
    f.serving_at(0).await;
    let writes = f.host.world().marker_writes.clone();
    assert_eq!(writes.first(), Some(&false), "removed before anything else");
    assert!(f.host.world().marker);
    let (ended, host) = f.stop().await;
    assert!(matches!(ended, Ended::Stopped { .. }), "{ended:?}");
    assert!(!host.world().marker, "removed on stop");
    assert_eq!(host.world().signals_to(0), [Signal::SIGTERM]);
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_triggers_coalesces_into_one_restart_after_the_parent_exits() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    let first = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    let burst: Vec<_> = (0..5).map(|i| f.restart(&format!("burst {i}"))).collect();
    let s = f.serving_at(1).await;
    assert_eq!(first.await.unwrap(), Ok(1));
    assert_eq!(s.epochs[0].state, EpochState::Draining, "{s:?}");
    // The parent drains: nothing starts, however long it takes.
    let queued = f
        .until("the coalesced restart queued", |s| {
            s.family
                .as_ref()
                .and_then(|f| f.handoff.as_ref())
                .is_some_and(|h| h.waiting_for.is_some())
        })
        .await;
    let waiting = queued.family.unwrap().handoff.unwrap().waiting_for.unwrap();
    assert!(waiting.contains("epoch 0 still drains"), "{waiting}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(f.host.world().spawns, [0, 1], "never a third generation");
    // Its child terminates it after the parent-shutdown time.
    f.host.world().exit(0, code(0));
    f.serving_at(2).await;
    for waiter in burst {
        assert_eq!(
            waiter.await.unwrap(),
            Ok(2),
            "every trigger shares one outcome"
        );
    }
    assert_eq!(f.host.world().spawns, [0, 1, 2]);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_child_that_took_the_admin_listener_is_retried_at_the_same_epoch() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().live_after = None;
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    {
        // The child shut its parent's admin listener, then failed (a port held elsewhere).
        let mut w = f.host.world();
        w.admin = Admin::Refused;
        w.initializing = true;
        w.live_after = Some(Duration::from_millis(50));
        w.exit(1, code(1));
    }
    let answer = restart.await.unwrap();
    assert!(matches!(answer, Err(RestartError::Failed(_))), "{answer:?}");
    let s = f.serving_at(1).await;
    assert_eq!(f.host.world().spawns, [0, 1, 1], "the same epoch again");
    let family = s.family.unwrap();
    assert!(
        family
            .wedges
            .iter()
            .any(|w| w.reason == WedgeReason::StaleInitializing),
        "the stale flag was repaired: {:?}",
        family.wedges
    );
    assert_eq!(f.host.world().signals_to(0), Vec::<Signal>::new());
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_child_not_live_by_the_deadline_is_killed_with_sigkill_and_the_old_epoch_serves_on() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().live_after = None;
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    let answer = restart.await.unwrap();
    assert!(matches!(answer, Err(RestartError::Failed(_))), "{answer:?}");
    {
        let w = f.host.world();
        // SIGTERM would have made Envoy terminate its parent, the serving epoch.
        assert_eq!(w.signals_to(1), [Signal::SIGKILL]);
        assert!(w.alive(0), "the old epoch serves on");
        assert!(w.repairs >= 1, "the shared flag was checked");
    }
    let s = f.handle.state().borrow().clone();
    assert_eq!(s.newest_live, Some(0));
    let family = s.family.unwrap();
    assert_eq!(family.last_handoff.unwrap().outcome, Outcome::TimedOut);
    assert!(
        family
            .wedges
            .iter()
            .any(|w| w.reason == WedgeReason::HandoffDeadline)
    );
    f.stop().await;
}

/// An agent that stalls (SIGSTOP, starvation) sees its deadline late, with only answers asked
/// before it: the epoch may have gone LIVE meanwhile. Here every LIVE check takes 8 s to come
/// back (what the admin said when asked), the epoch goes LIVE at 9 s, the deadline is 10 s.
#[tokio::test(start_paused = true)]
async fn a_deadline_kills_only_after_a_live_check_sent_after_it_says_not_live() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    {
        let mut w = f.host.world();
        w.live_after = None;
        w.live_check_delay = Duration::from_secs(8);
    }
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    let spawned = tokio::time::Instant::now();
    tokio::time::sleep_until(spawned + Duration::from_secs(9)).await;
    f.host.world().live(1);
    assert_eq!(restart.await.unwrap(), Ok(1), "LIVE, not killed");
    {
        let w = f.host.world();
        assert!(w.signals_to(1).is_empty(), "{:?}", w.signals_to(1));
        assert!(
            w.live_checks_sent
                .iter()
                .any(|(at, _)| *at >= spawned + Duration::from_secs(10)),
            "a check was sent after the deadline: {:?}",
            w.live_checks_sent
        );
    }
    let family = f.handle.state().borrow().family.clone().unwrap();
    assert!(family.wedges.is_empty(), "{:?}", family.wedges);
    f.stop().await;
}

/// Past the deadline, a LIVE check the agent could not even send (out of descriptors) is no
/// "not LIVE": the epoch is not killed on no facts, and is taken once it answers LIVE.
#[tokio::test(start_paused = true)]
async fn a_deadline_never_kills_on_a_check_the_agent_could_not_send() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().live_after = None;
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    f.host.world().admin = Admin::AgentOutOfFiles;
    // Twice the handoff deadline.
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(f.host.world().signals_to(1).is_empty());
    f.host.world().live(1);
    assert_eq!(restart.await.unwrap(), Ok(1));
    f.stop().await;
}

/// The agent out of descriptors (a neighbour's connection flood) cannot ask Envoy anything:
/// that says nothing of Envoy, and is no wedge however long it lasts. Envoy's own silence is
/// still seen once the agent can ask again.
#[tokio::test(start_paused = true)]
async fn the_agent_out_of_descriptors_is_never_taken_for_a_silent_envoy() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().admin = Admin::AgentOutOfFiles;
    // Six times the unresponsive deadline.
    tokio::time::sleep(Duration::from_secs(30)).await;
    {
        let s = f.handle.state().borrow().clone();
        assert_eq!(s.phase, ProxyPhase::Serving);
        assert!(s.family.unwrap().wedges.is_empty());
        assert!(f.host.world().alive(0));
    }
    f.host.world().admin = Admin::Silent;
    let (ended, _) = f.ended().await;
    assert!(
        matches!(
            ended,
            Ended::Wedged {
                reason: WedgeReason::AdminUnresponsive,
                ..
            }
        ),
        "{ended:?}"
    );
}

/// A watchdog answer that arrives late (asked before the deadline, failed after it: what a
/// stalled agent sees on waking) is not the fresh fact a wedge needs.
#[tokio::test(start_paused = true)]
async fn a_late_failure_of_a_check_sent_before_the_deadline_is_no_wedge() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    // The unresponsive deadline is 5 s: this check fails 8 s after it was sent.
    f.host.world().admin = Admin::SilentFor(Duration::from_secs(8));
    tokio::time::sleep(Duration::from_secs(6)).await;
    f.host.world().live(0);
    tokio::time::sleep(Duration::from_secs(20)).await;
    let s = f.handle.state().borrow().clone();
    assert_eq!(s.phase, ProxyPhase::Serving);
    assert!(s.family.unwrap().wedges.is_empty());
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_admin_that_stops_answering_is_a_wedge_that_stops_the_family() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    let silent_from = tokio::time::Instant::now();
    f.host.world().admin = Admin::Silent;
    let (ended, host) = f.ended().await;
    assert!(
        matches!(
            ended,
            Ended::Wedged {
                reason: WedgeReason::AdminUnresponsive,
                ..
            }
        ),
        "{ended:?}"
    );
    assert_eq!(ended.code(), 75);
    assert!(
        silent_from.elapsed() >= Duration::from_secs(5),
        "not before its deadline"
    );
    assert!(!host.world().alive(0), "stopped");
    assert_eq!(
        host.world().signals_to(0),
        [Signal::SIGKILL],
        "a silent envoy would not act on SIGTERM"
    );
    assert!(!host.world().marker);
}

/// Readiness follows fresh answers: an admin silent for a few seconds (well before the wedge
/// deadline, 5 s here) makes the state not ready and says why; answers coming back make it ready
/// again, and nothing was stopped.
#[tokio::test(start_paused = true)]
async fn a_silent_admin_turns_readiness_off_and_answers_turn_it_back_on() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    assert!(f.handle.state().borrow().ready().is_ok());
    let silent_from = tokio::time::Instant::now();
    f.host.world().admin = Admin::Silent;
    let stale = f
        .until("the admin silent", |s| s.admin.silent_since().is_some())
        .await;
    assert!(
        silent_from.elapsed() < Duration::from_secs(5),
        "before the wedge deadline: {:?}",
        silent_from.elapsed()
    );
    assert_eq!(
        stale.phase,
        ProxyPhase::Serving,
        "still serving: not wedged"
    );
    let why = stale.ready().unwrap_err();
    assert!(
        matches!(why, envoy_agent_proxy::NotReady::AdminSilent { .. }),
        "{why}"
    );
    assert!(!f.host.world().marker, "the marker follows readiness");
    f.host.world().live(0);
    let back = f
        .until("answering again", |s| s.admin.silent_since().is_none())
        .await;
    assert!(back.ready().is_ok());
    assert!(f.host.world().marker, "the marker is back");
    assert!(back.family.unwrap().wedges.is_empty());
    assert!(f.host.world().alive(0));
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_refused_admin_is_a_lost_listener_recovered_by_a_restart_not_a_wedge() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    // Another pod's failed epoch shut our admin listener.
    f.host.world().admin = Admin::Refused;
    f.serving_at(1).await;
    let s = f.handle.state().borrow().clone();
    assert!(s.family.unwrap().wedges.is_empty(), "not a wedge");
    assert!(
        f.host.world().alive(0),
        "the serving envoy was never stopped"
    );
    f.stop().await;
}

/// CI's crash streak: the serving Envoy was SIGKILLed, and a watchdog check reached its
/// admin socket after the process had closed it but before its exit was reaped. The refusal
/// was taken for a listener lost to a failed epoch and answered with a hot restart: the new
/// epoch took over, and the crash was never reported (nor counted toward the give-up). An
/// epoch that no longer runs has lost nothing: its exit is waited for.
#[tokio::test(start_paused = true)]
async fn a_refused_admin_of_a_serving_envoy_that_died_is_its_crash_not_a_lost_listener() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    let serving = f.host.world().pid_of(0).unwrap();
    {
        let mut w = f.host.world();
        w.unreaped.insert(serving);
        w.admin = Admin::Refused;
    }
    // Several watchdog periods with the exit not yet seen.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        f.host.world().spawns,
        [0],
        "no epoch 1 for a listener that was not lost"
    );
    f.host.world().exit(0, killed(9));
    let (ended, host) = f.ended().await;
    assert_eq!(ended.code(), 137, "the crash ends the family: {ended:?}");
    assert_eq!(host.world().spawns, [0]);
}

#[tokio::test(start_paused = true)]
async fn stopping_kills_a_starting_epoch_and_terminates_the_serving_one() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().live_after = None;
    let _restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    let (ended, host) = f.stop().await;
    assert!(matches!(ended, Ended::Stopped { .. }), "{ended:?}");
    let w = host.world();
    assert_eq!(
        w.signals_to(1),
        [Signal::SIGKILL],
        "never SIGTERM before LIVE"
    );
    assert_eq!(w.signals_to(0), [Signal::SIGTERM]);
    assert!(w.repairs >= 1, "the killed epoch's flag was checked");
}

/// The soak's finding: a node proxy's clean exit left its family's shared memory and
/// hot-restart sockets behind. A family that served and was not handed over is cleaned up.
#[tokio::test(start_paused = true)]
async fn a_family_that_served_has_its_files_removed_at_the_end() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    assert_eq!(f.stop_and_clean_up().await, 1);
}

/// ... and after hot restarts too (the files are the family's, whatever its newest epoch).
#[tokio::test(start_paused = true)]
async fn a_family_that_hot_restarted_has_its_files_removed_at_the_end() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    assert_eq!(f.stop_and_clean_up().await, 1);
}

/// Issue 51: a family whose epoch 0 was ours removes what that epoch made, also when it never
/// served (a bootstrap Envoy rejects left its shared memory behind). Whether another pod's
/// family still uses the base id is the host's to judge at removal (its admin answers, the
/// node's lock is held: nothing is removed).
#[tokio::test(start_paused = true)]
async fn a_first_epoch_that_never_served_removes_what_it_made() {
    let host = FakeHost::default();
    host.world().live_after = None;
    let f = start(host, config());
    f.spawned(&[0]).await;
    assert_eq!(f.stop_and_clean_up().await, 1);
}

/// A family handed over to a successor pod is the successor's: nothing of it is removed.
#[tokio::test(start_paused = true)]
async fn a_family_handed_over_removes_nothing() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    let b = heartbeat("pod-b-2222", NodeState::Starting, 1, &f.host);
    f.host.world().others = vec![b];
    f.host.world().live(1);
    f.until("handed over", |s| s.phase == ProxyPhase::HandedOver)
        .await;
    assert_eq!(f.stop_and_clean_up().await, 0);
}

#[tokio::test(start_paused = true)]
async fn the_serving_epoch_dying_while_its_successor_starts_is_stood_in_for() {
    let host = FakeHost::default();
    let f = start(host, config());
    f.serving_at(0).await;
    f.host.world().live_after = Some(Duration::from_secs(1));
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    f.host.world().exit(0, killed(9));
    f.until("standing in", |_| true).await;
    assert_eq!(
        restart.await.unwrap(),
        Ok(1),
        "the new epoch still took over"
    );
    assert_eq!(f.host.world().stand_ins, [0]);
    f.serving_at(1).await;
    assert!(!f.task.is_finished(), "the family goes on");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_serving_envoy_terminated_from_outside_is_never_a_success() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().exit(0, code(0));
    let (ended, _) = f.ended().await;
    assert!(matches!(ended, Ended::Lost { .. }), "{ended:?}");
    assert_ne!(ended.code(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_crashed_serving_envoy_ends_the_family_with_its_code() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().exit(0, killed(9));
    let (ended, _) = f.ended().await;
    assert_eq!(ended.code(), 137, "{ended:?}");
}

/// The soak's fourth finding: the agent itself stopped (SIGSTOP) past a draining parent's
/// deadline. The parent had exited in time, but its exit was not reaped yet when the overdue
/// check ran first: the agent recorded a `parent_overdue` wedge, SIGKILLed the zombie and stood
/// in for it. A parent that no longer runs is not overdue: its exit is waited for.
#[tokio::test(start_paused = true)]
async fn a_parent_that_exited_but_is_not_reaped_yet_is_not_judged_overdue() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    assert_eq!(f.restart("first").await.unwrap(), Ok(1));
    let parent = f.host.world().pid_of(0).unwrap();
    f.host.world().unreaped.insert(parent);
    // Past the parent-shutdown time (2 s) and the grace (5 s).
    tokio::time::sleep(Duration::from_secs(10)).await;
    {
        let w = f.host.world();
        assert!(w.signals_to(0).is_empty(), "{:?}", w.signals_to(0));
        assert!(w.stand_ins.is_empty());
    }
    // The exit arrives: the queue goes on, and no wedge was recorded.
    f.host.world().exit(0, code(0));
    assert_eq!(f.restart("second").await.unwrap(), Ok(2));
    let family = f.handle.state().borrow().clone().family.unwrap();
    assert!(family.wedges.is_empty(), "{:?}", family.wedges);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_overdue_draining_parent_is_killed_stood_in_for_and_the_queue_goes_on() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    assert_eq!(f.restart("first").await.unwrap(), Ok(1));
    // The parent never exits (stopped); the next restart waits for it, then not forever.
    let next = f.restart("second");
    assert_eq!(next.await.unwrap(), Ok(2));
    {
        let w = f.host.world();
        assert_eq!(w.signals_to(0), [Signal::SIGKILL]);
        assert_eq!(w.stand_ins, [0]);
        assert!(
            w.released.is_empty(),
            "epoch 2 does not reuse epoch 0's names"
        );
    }
    let s = f.handle.state().borrow().clone();
    let family = s.family.unwrap();
    assert!(
        family
            .wedges
            .iter()
            .any(|w| w.reason == WedgeReason::ParentOverdue),
        "{:?}",
        family.wedges
    );
    let last = family.last_handoff.unwrap();
    assert!(
        last.queued >= Duration::from_secs(7),
        "queue time: {last:?}"
    );
    assert!(
        last.preflight < Duration::from_secs(1),
        "queue time is not pre-flight: {last:?}"
    );
    // The stand-in's child (epoch 1) exits: nothing talks to epoch 0's names anymore.
    f.host.world().exit(1, code(0));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(f.host.world().released, [0]);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_stand_in_is_released_only_for_an_epoch_that_reuses_its_names() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    assert_eq!(f.restart("1").await.unwrap(), Ok(1));
    f.host.world().exit(0, killed(9));
    f.until("stood in for 0", |_| true).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(f.host.world().stand_ins, [0]);
    assert_eq!(f.restart("2").await.unwrap(), Ok(2));
    assert!(
        f.host.world().released.is_empty(),
        "epoch 1 still talks to 0"
    );
    f.host.world().exit(1, code(0));
    assert_eq!(f.restart("3").await.unwrap(), Ok(3));
    assert_eq!(f.host.world().released, [0]);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn never_epoch_zero_while_something_answers_on_the_admin_port() {
    let host = FakeHost::default();
    host.world().node = true;
    host.world().admin = Admin::Silent;
    let f = start(host, config());
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(f.host.world().spawns.is_empty());
    assert_eq!(f.handle.state().borrow().phase, ProxyPhase::Starting);
    f.host.world().admin = Admin::Refused;
    f.serving_at(0).await;
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_successor_waits_for_the_predecessors_draining_parent_then_takes_over() {
    let host = FakeHost::default();
    {
        let mut w = host.world();
        w.node = true;
        w.live(3);
        w.foreign_alive = vec![3];
    }
    let mut a = heartbeat("pod-a-1111", NodeState::Serving, 3, &host);
    a.parent_draining_until_unix_ms = a.updated_unix_ms + 4_000;
    host.world().others = vec![a.clone()];
    let f = start(host, config());
    // Keep pod-a's heartbeat fresh while it drains.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = crate::host::Host::now_unix_ms(&f.host);
        let mut w = f.host.world();
        w.others[0].updated_unix_ms = now;
        if now < a.parent_draining_until_unix_ms {
            assert!(w.spawns.is_empty(), "no third generation");
        }
    }
    let s = f.serving_at(4).await;
    assert_eq!(f.host.world().spawns, [4], "predecessor's epoch + 1");
    let family = s.family.unwrap();
    assert_eq!(family.predecessor.as_deref(), Some("pod-a-1111"));
    assert!(family.foreign_parent_until.is_some());
    let ours = f.host.world().ours.clone().unwrap();
    assert_eq!((ours.state, ours.newest_epoch), (NodeState::Serving, 4));
    assert!(ours.parent_draining_until_unix_ms > 0, "advertised");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_unchanged_heartbeat_is_touched_not_rewritten_and_stays_fresh() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let writes = f.host.world().heartbeat_writes;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = crate::host::Host::now_unix_ms(&f.host);
        let ours = f.host.world().ours.clone().unwrap();
        assert!(ours.fresh(now, Duration::from_secs(2)), "{ours:?} at {now}");
    }
    let (rewrites, touches) = {
        let w = f.host.world();
        (w.heartbeat_writes, w.touches)
    };
    assert_eq!(rewrites, writes, "nothing changed: no rewrite");
    assert!(touches >= 4, "{touches} touches");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_draining_parent_leaves_the_heartbeat_unchanged_while_the_clocks_disagree() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    let (writes, until) = {
        let w = f.host.world();
        let ours = w.ours.clone().unwrap();
        (w.heartbeat_writes, ours.parent_draining_until_unix_ms)
    };
    assert!(until > 0, "the parent's drain is advertised");
    // The parent drains for 2 s; the wall clock steps a millisecond now and then meanwhile.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        f.host.world().wall_clock_step_ms += 1;
    }
    let (ours, rewrites, touches) = {
        let w = f.host.world();
        (w.ours.clone().unwrap(), w.heartbeat_writes, w.touches)
    };
    assert_eq!(
        ours.parent_draining_until_unix_ms, until,
        "one moment, said once"
    );
    assert_eq!(rewrites, writes, "nothing changed: no rewrite");
    assert!(touches > 0, "kept fresh");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_starting_epoch_publishes_no_new_state_at_each_live_check() {
    let host = FakeHost::default();
    host.world().live_after = Some(Duration::from_millis(800));
    let f = start(host, config());
    f.serving_at(0).await;
    let restart = f.restart("SIGHUP");
    f.until("epoch 1 starting", |s| {
        s.family
            .as_ref()
            .and_then(|f| f.handoff.as_ref())
            .is_some_and(|h| h.stage == envoy_agent_proxy::HandoffStage::Starting)
    })
    .await;
    let mut state = f.handle.state();
    state.mark_unchanged();
    let checks = f.host.world().admin_calls.2;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let checked = f.host.world().admin_calls.2 - checks;
    assert!(checked >= 3, "{checked} LIVE checks meanwhile");
    assert!(
        !state.has_changed().unwrap(),
        "{checked} LIVE checks that found nothing new changed the state: {:?}",
        state
            .borrow()
            .family
            .as_ref()
            .and_then(|f| f.handoff.as_ref())
    );
    assert_eq!(restart.await.unwrap(), Ok(1));
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_watchdog_asks_the_state_only_of_a_newer_epoch() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    let (stats, states) = {
        let w = f.host.world();
        (w.admin_calls.1, w.state_asks)
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (stats, states) = {
        let w = f.host.world();
        (w.admin_calls.1 - stats, w.state_asks - states)
    };
    assert!(stats >= 9, "{stats} watchdog checks in 10 s");
    assert_eq!(
        states, 0,
        "our own epoch answers: its readiness decides nothing"
    );
    // Another pod's epoch 1 holds the admin address (no heartbeat: seen by the watchdog).
    f.host.world().live(1);
    let s = f
        .until("handed over", |s| s.phase == ProxyPhase::HandedOver)
        .await;
    assert!(
        f.host.world().state_asks >= 1,
        "a newer epoch's state is asked"
    );
    assert_eq!(s.newest_live, None);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_watchdog_keeps_its_connection_but_while_a_successor_starts() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    let asks = || {
        let w = f.host.world();
        (w.admin_calls.1, w.kept_asks)
    };
    let (stats, kept) = asks();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (steady, steady_kept) = {
        let (s, k) = asks();
        (s - stats, k - kept)
    };
    assert!(steady >= 9, "{steady} watchdog checks in 10 s");
    assert_eq!(
        steady_kept, steady,
        "every steady check over the kept connection"
    );
    // pod-b starts to take over: its Envoy will answer on new connections only.
    let b = heartbeat("pod-b-2222", NodeState::Starting, 1, &f.host);
    f.host.world().others = vec![b];
    assert_eq!(f.handle.successor().await.as_deref(), Some("pod-b-2222"));
    let (stats, kept) = asks();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (s, k) = asks();
    assert!(
        s - stats >= 5,
        "{} checks in 1 s while pod-b starts",
        s - stats
    );
    assert_eq!(
        k - kept,
        0,
        "no kept connection while a takeover is expected"
    );
    f.host.world().live(1);
    f.until("handed over", |s| s.phase == ProxyPhase::HandedOver)
        .await;
    f.stop().await;
}

/// The soak's fifth finding: a config change queued while a successor pod held the node's
/// epoch lock ran the moment the successor's epoch went LIVE and let the lock go, before the
/// takeover was seen: a second epoch of that number, started from our old one, took the node
/// back. Under the lock, a successor with a newer epoch defers the restart, and the handover
/// refuses it.
#[tokio::test(start_paused = true)]
async fn a_queued_restart_never_takes_the_node_back_from_a_successor_that_just_took_over() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    f.host.world().lock_taken_by_other = true;
    let restart = f.restart("config change");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(f.host.world().spawns, [0], "queued behind the lock");
    // The successor took over at epoch 1 and let the lock go, all since our last look.
    let b = heartbeat("pod-b-2222", NodeState::Serving, 1, &f.host);
    {
        let mut w = f.host.world();
        w.others = vec![b];
        w.live(1);
        w.lock_taken_by_other = false;
    }
    f.until("handed over", |s| s.phase == ProxyPhase::HandedOver)
        .await;
    let refused = restart.await.unwrap();
    assert!(
        matches!(refused, Err(RestartError::Refused(_))),
        "{refused:?}"
    );
    assert_eq!(f.host.world().spawns, [0], "no epoch of ours beside theirs");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_takeover_by_a_successor_is_seen_and_handed_over() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    assert_eq!(f.handle.successor().await, None, "nobody is taking over");
    let b = heartbeat("pod-b-2222", NodeState::Starting, 1, &f.host);
    f.host.world().others = vec![b];
    assert_eq!(
        f.handle.successor().await.as_deref(),
        Some("pod-b-2222"),
        "decided from fresh facts"
    );
    // pod-b's epoch 1 is LIVE on the shared admin port.
    f.host.world().live(1);
    let s = f
        .until("handed over", |s| s.phase == ProxyPhase::HandedOver)
        .await;
    assert_eq!(
        s.family.unwrap().handed_over_to.as_deref(),
        Some("pod-b-2222")
    );
    assert!(!f.host.world().marker, "marker gone at once");
    assert_eq!(s.epochs[0].state, EpochState::Draining);
    let refused = f.handle.hot_restart("x").await;
    assert!(
        matches!(refused, Err(RestartError::Refused(_))),
        "{refused:?}"
    );
    // The successor's Envoy terminates ours: still no end, the agent decides.
    f.host.world().exit(0, code(0));
    f.until("our envoy gone", |s| s.epochs.is_empty()).await;
    assert!(!f.task.is_finished());
    let (ended, _) = f.stop().await;
    assert!(matches!(ended, Ended::Stopped { .. }));
}

#[tokio::test(start_paused = true)]
async fn failing_health_checks_during_a_handoff_waits_for_it_and_follows_new_epochs() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().live_after = Some(Duration::from_secs(2));
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    let failed = {
        let handle = f.handle.clone();
        tokio::spawn(async move { handle.fail_health_checks().await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        f.host.world().health_checks_failed,
        0,
        "not while the new epoch may take the admin listener"
    );
    assert_eq!(restart.await.unwrap(), Ok(1));
    failed.await.unwrap().unwrap();
    assert_eq!(f.host.world().health_checks_failed, 1, "epoch 1, once LIVE");
    // A process's own state: an epoch that serves later is told too.
    f.host.world().live_after = Some(Duration::from_millis(50));
    assert_eq!(f.restart("config change").await.unwrap(), Ok(2));
    for _ in 0..100 {
        if f.host.world().health_checks_failed == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(f.host.world().health_checks_failed, 2, "epoch 2 told too");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_drain_during_a_handoff_waits_for_it_and_ends_hot_restarts() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().live_after = Some(Duration::from_secs(2));
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    let drain = f.drain();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        f.host.world().drains.is_empty(),
        "not while the handoff settles"
    );
    assert_eq!(restart.await.unwrap(), Ok(1));
    drain.await.unwrap().unwrap();
    assert_eq!(f.host.world().drains.len(), 1);
    assert!(!f.host.world().marker, "not ready while draining");
    let refused = f.handle.hot_restart("after").await;
    assert!(
        matches!(refused, Err(RestartError::Refused(_))),
        "{refused:?}"
    );
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn sigusr1_reaches_running_epochs_never_a_starting_one() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().live_after = None;
    let _restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    assert_eq!(f.handle.reopen_logs().await, 1);
    tokio::time::sleep(Duration::from_millis(10)).await;
    {
        let w = f.host.world();
        assert_eq!(w.signals_to(0), [Signal::SIGUSR1]);
        assert!(
            w.signals_to(1).is_empty(),
            "its handler may not be installed yet"
        );
    }
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_rejected_first_epoch_never_starts() {
    let host = FakeHost::default();
    host.world().preflights.push_back(Err(Refusal::Rejected(
        "envoy rejects bootstrap.yaml: bad".to_owned(),
    )));
    let f = start(host, config());
    let (ended, host) = f.ended().await;
    assert!(matches!(ended, Ended::StartFailed { .. }), "{ended:?}");
    assert!(host.world().spawns.is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_older_envoy_on_the_admin_port_never_counts_as_our_first_epoch() {
    let host = FakeHost::default();
    host.world().live_after = None;
    let f = start(host, config());
    f.spawned(&[0]).await;
    // An orphan of an earlier container (or another family), up for an hour.
    host_answers(&f, 0, Duration::from_secs(3600));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(f.handle.state().borrow().phase, ProxyPhase::Starting);
    host_answers(&f, 0, Duration::ZERO);
    f.serving_at(0).await;
    f.stop().await;
}

fn host_answers(f: &Family, epoch: u32, uptime: Duration) {
    f.host.world().admin = Admin::Answers {
        epoch,
        state: ServerState::Live,
        base_id: 7,
        version: "11.104".to_owned(),
        uptime,
    };
}

#[tokio::test(start_paused = true)]
async fn only_an_epoch_beside_a_serving_one_is_validated_first() {
    let host = FakeHost::default();
    let f = start(host, config());
    f.serving_at(0).await;
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    {
        let w = f.host.world();
        assert_eq!(
            w.preflight_calls,
            [(None, false), (Some("11.104".to_owned()), true)],
            "the first epoch: nothing to compare or protect; the restart: both checks"
        );
        assert_eq!(w.passed_live, 2, "each LIVE epoch proves its pair");
        assert_eq!(w.version_asks, 0, "the running envoy named its version");
        assert_eq!(
            w.prevalidations,
            [None],
            "the binary's own version was asked ahead of the first restart"
        );
    }
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_restart_right_after_the_start_waits_for_the_running_version() {
    let host = FakeHost::default();
    host.world().server_info_delay = Duration::from_millis(50);
    let f = start(host, config());
    f.serving_at(0).await;
    // The running envoy is still being asked (the fake takes 50 ms): the restart waits.
    assert!(
        f.handle
            .state()
            .borrow()
            .family
            .as_ref()
            .unwrap()
            .hot_restart_version
            .is_empty()
    );
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    assert_eq!(
        f.host.world().preflight_calls[1].0.as_deref(),
        Some("11.104")
    );
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_unknown_running_version_refuses_restarts_and_says_why() {
    let host = FakeHost::default();
    host.world().admin_version = String::new();
    let f = start(host, config());
    f.serving_at(0).await;
    match f.restart("SIGHUP").await.unwrap() {
        Err(RestartError::Rejected(m)) => {
            assert!(m.contains("names no hot-restart version"), "{m}")
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(f.host.world().spawns, [0], "nothing started");
    assert_eq!(
        f.handle.state().borrow().newest_live,
        Some(0),
        "still serving"
    );
    f.stop().await;
}

/// Three SIGHUPs to epochs that are LIVE `start_time` after their spawn: for each, how long
/// after the spawn the restart was answered (LIVE seen), and how many LIVE checks it took.
async fn live_seen_over_three_restarts(
    host: FakeHost,
    start_time: Duration,
) -> Vec<(Duration, u32)> {
    host.world().live_after = Some(start_time);
    let f = start(host, config());
    f.serving_at(0).await;
    let mut seen = Vec::new();
    for epoch in 1..=3u32 {
        let checks_before = f.host.world().admin_calls.2;
        let restart = f.restart("SIGHUP");
        f.spawned(&(0..=epoch).collect::<Vec<_>>()).await;
        let spawned = tokio::time::Instant::now();
        assert_eq!(restart.await.unwrap(), Ok(epoch));
        seen.push((
            spawned.elapsed(),
            f.host.world().admin_calls.2 - checks_before,
        ));
        // Let the parent go.
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    f.stop().await;
    seen
}

#[tokio::test(start_paused = true)]
async fn without_a_sign_to_go_by_live_is_seen_within_the_sparse_poll() {
    // No admin address file can be watched: the checks may reach the parent's admin, so they
    // stay sparse.
    let start_time = Duration::from_millis(133);
    for (seen, checks) in live_seen_over_three_restarts(FakeHost::default(), start_time).await {
        assert!(
            seen <= start_time + LIVE_POLL_BLIND,
            "LIVE at {start_time:?}, seen after {seen:?}"
        );
        assert!(checks <= 4, "{checks} LIVE checks");
    }
}

#[tokio::test(start_paused = true)]
async fn with_the_admin_listener_as_the_sign_live_is_seen_within_two_milliseconds_in_a_few_checks()
{
    let host = FakeHost::default();
    // As measured on Envoy 1.40: the child binds its admin listener ~3 ms before LIVE.
    host.world().admin_bound_before_live = Some(Duration::from_millis(3));
    let start_time = Duration::from_millis(133);
    for (seen, checks) in live_seen_over_three_restarts(host, start_time).await {
        assert!(
            seen <= start_time + Duration::from_millis(2),
            "LIVE at {start_time:?}, seen after {seen:?}"
        );
        // None until the sign (the first would come at LIVE_POLL_UNBOUND), then one per
        // millisecond: 3 + 1.
        assert!(checks <= 5, "{checks} LIVE checks");
    }
}

#[tokio::test(start_paused = true)]
async fn after_the_sign_its_own_admin_is_asked_every_millisecond_over_one_connection() {
    let host = FakeHost::default();
    host.world().admin_bound_before_live = Some(Duration::from_millis(30));
    // A busy Envoy: each answer comes 5 ms after the question.
    host.world().live_check_delay = Duration::from_millis(5);
    host.world().live_after = Some(Duration::from_millis(133));
    let f = start(host, config());
    f.serving_at(0).await;
    let sent_before = f.host.world().live_checks_sent.len();
    let restart = f.restart("SIGHUP");
    assert_eq!(restart.await.unwrap(), Ok(1));
    let checks = f.host.world().live_checks_sent[sent_before..].to_vec();
    // Before the sign (103 ms after the spawn) no check: the first would come at
    // LIVE_POLL_UNBOUND, and would ask the parent. After it: one in flight at a time, the next
    // 1 ms after each answer, over the connection kept.
    assert!(checks.iter().all(|(_, kept)| *kept), "{checks:?}");
    let kept: Vec<_> = checks
        .iter()
        .skip_while(|(_, kept)| !kept)
        .map(|(at, kept)| (*at, *kept))
        .collect();
    assert!(
        kept.len() >= 4 && kept.iter().all(|(_, kept)| *kept),
        "{checks:?}"
    );
    let gaps: Vec<Duration> = kept.windows(2).map(|w| w[1].0 - w[0].0).collect();
    assert!(
        gaps.iter().all(|gap| *gap == Duration::from_millis(6)),
        "{gaps:?}"
    );
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_large_config_is_seen_live_within_milliseconds_of_a_long_start() {
    // 5000 clusters: LIVE 2.5 s after the admin listener is bound, each answer late.
    let host = FakeHost::default();
    host.world().admin_bound_before_live = Some(Duration::from_millis(2500));
    host.world().live_check_delay = Duration::from_millis(2);
    let start_time = Duration::from_millis(2600);
    for (seen, _) in live_seen_over_three_restarts(host, start_time).await {
        // At worst a check just missed it: its answer (2 ms), the gap (1 ms), the next one's
        // answer (2 ms).
        assert!(
            seen <= start_time + Duration::from_millis(5),
            "LIVE at {start_time:?}, seen after {seen:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_epoch_long_past_its_sign_is_asked_less_often() {
    let host = FakeHost::default();
    // LIVE 6 s after the sign (a config from a slow control plane): past LIVE_NEAR_BOUND the
    // checks come every LIVE_POLL.
    host.world().admin_bound_before_live = Some(Duration::from_secs(6));
    host.world().live_after = Some(Duration::from_millis(6100));
    let f = start(host, config());
    f.serving_at(0).await;
    let sent_before = f.host.world().live_checks_sent.len();
    let restart = f.restart("SIGHUP");
    assert_eq!(restart.await.unwrap(), Ok(1));
    let sent = f.host.world().live_checks_sent[sent_before..].to_vec();
    let gaps: Vec<Duration> = sent.windows(2).map(|w| w[1].0 - w[0].0).collect();
    let fast = gaps.iter().filter(|gap| **gap == LIVE_POLL_FAST).count();
    let slow = gaps.iter().filter(|gap| **gap == LIVE_POLL).count();
    // ~5000 fast ones in the 5 s after the sign, ~100 in the second after that.
    assert!((4900..=5001).contains(&fast), "{fast} checks 1 ms apart");
    assert!((90..=101).contains(&slow), "{slow} checks 10 ms apart");
    assert!(
        gaps.iter().rev().take(50).all(|gap| *gap == LIVE_POLL),
        "{:?}",
        &gaps[gaps.len() - 50..]
    );
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn without_the_sign_coming_live_is_still_seen() {
    let host = FakeHost::default();
    host.world().live_after = Some(Duration::from_millis(133));
    // The sign is expected but never comes (Envoy could not write the file).
    host.world().admin_bound_before_live = Some(Duration::from_secs(3600));
    let f = start(host, config());
    f.serving_at(0).await;
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    let spawned = tokio::time::Instant::now();
    assert_eq!(restart.await.unwrap(), Ok(1));
    assert!(
        spawned.elapsed() <= Duration::from_millis(133) + LIVE_POLL_UNBOUND,
        "{:?}",
        spawned.elapsed()
    );
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_node_agent_with_nobody_to_take_over_from_starts_without_waiting_for_its_version() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    let started = tokio::time::Instant::now();
    f.spawned(&[0]).await;
    // The fake takes 50 ms to answer the version.
    assert!(
        started.elapsed() < Duration::from_millis(50),
        "{:?}",
        started.elapsed()
    );
    f.serving_at(0).await;
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_node_agent_waits_for_its_version_before_judging_a_predecessor() {
    let host = FakeHost::default();
    host.world().node = true;
    host.world().live(3);
    host.world().foreign_alive.push(3);
    host.world().version = Ok("12.104".to_owned());
    let f = start(host, config());
    // Once known, the version differs from the predecessor's: never a hot takeover (a cold
    // handover instead: a family of its own beside it).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(f.host.world().spawns.is_empty());
    assert_eq!(f.host.world().cold_spawns, [8]);
    assert_eq!(f.host.world().version_asks, 1);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_new_binary_on_disk_is_validated_before_anyone_asks() {
    let host = FakeHost::default();
    let f = start(host, config());
    f.serving_at(0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Ahead of the first restart, once.
    assert_eq!(f.host.world().prevalidations, [None]);
    f.host.world().binary_changed = true;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(f.host.world().prevalidations, [None, None]);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_successor_told_to_drain_while_taking_over_kills_its_child_and_leaves() {
    let host = FakeHost::default();
    {
        let mut w = host.world();
        w.node = true;
        w.live(3);
        w.foreign_alive = vec![3];
        // Our first epoch hangs initializing.
        w.live_after = None;
    }
    let a = heartbeat("pod-a-1111", NodeState::Serving, 3, &host);
    host.world().others = vec![a];
    let f = start(host, config());
    f.spawned(&[4]).await;
    // pod-a's heartbeat is a predecessor's, not a successor's.
    assert_eq!(f.handle.successor().await, None);
    f.handle
        .drain(DrainOptions {
            listeners: Scope::Auto,
            skip_exit: false,
            hold_notice: false,
        })
        .await
        .unwrap();
    let (ended, host) = f.ended().await;
    assert!(matches!(ended, Ended::Stopped { .. }), "{ended:?}");
    let w = host.world();
    assert_eq!(
        w.signals_to(4),
        [Signal::SIGKILL],
        "SIGTERM would take the predecessor's envoy down"
    );
    assert!(w.drains.is_empty(), "nothing of ours served: no drain");
    assert!(w.repairs >= 1);
}

#[tokio::test(start_paused = true)]
async fn a_newer_serving_heartbeat_is_a_successor_before_the_admin_shows_it() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    let b = heartbeat("pod-b-2222", NodeState::Serving, 1, &f.host);
    f.host.world().others = vec![b];
    assert_eq!(f.handle.successor().await.as_deref(), Some("pod-b-2222"));
    let waiting = heartbeat("pod-c-3333", NodeState::Waiting, 0, &f.host);
    f.host.world().others = vec![waiting];
    assert_eq!(
        f.handle.successor().await,
        None,
        "a pod waiting for its turn is no successor"
    );
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_family_that_ended_on_a_crash_runs_again_as_a_fresh_family_at_epoch_zero() {
    // The agent's crash recovery runs the same family again once its run has ended.
    let host = FakeHost::default();
    host.world().node = true;
    let family = Arc::new(
        EnvoyFamily::with_host(
            config(),
            Arc::new(host.clone()),
            SupervisorMetrics::default(),
        )
        .unwrap(),
    );
    let handle = family.handle();
    let run = |abort: CancellationToken| {
        let family = family.clone();
        tokio::spawn(async move { family.run(abort).await })
    };
    let f = Family {
        host: host.clone(),
        family: family.clone(),
        handle: handle.clone(),
        abort: CancellationToken::new(),
        task: run(CancellationToken::new()),
    };
    f.serving_at(0).await;
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    // Terminated by its child; then the serving epoch is SIGKILLed with no parent left.
    host.world().exit(0, code(0));
    f.until("the parent gone", |s| s.epochs.len() == 1).await;
    host.world().exit(1, killed(9));
    let (ended, host) = f.ended().await;
    assert_eq!(ended.code(), 137, "{ended:?}");
    {
        let w = host.world();
        assert!(!w.marker, "not ready while nothing serves");
        assert!(w.ours.is_none(), "no heartbeat while nothing runs");
    }

    let abort = CancellationToken::new();
    let again = Family {
        host: host.clone(),
        family: family.clone(),
        handle,
        abort: abort.clone(),
        task: run(abort),
    };
    let s = again.serving_at(0).await;
    assert_eq!(host.world().spawns, [0, 1, 0], "a cold start at epoch 0");
    assert!(host.world().marker);
    let family_state = s.family.unwrap();
    assert!(
        family_state
            .exits
            .iter()
            .any(|e| e.epoch == 1 && e.signal == Some(9)),
        "the crash stays in the history: {:?}",
        family_state.exits
    );
    // The fresh family hot-restarts as the first did.
    assert_eq!(again.restart("SIGHUP").await.unwrap(), Ok(1));
    let (ended, _) = again.stop().await;
    assert!(matches!(ended, Ended::Stopped { .. }), "{ended:?}");
}

impl crate::testing::World {
    /// The next restart finds a binary of another hot-restart version, and nothing spawned
    /// from now on becomes LIVE by itself.
    fn incompatible_never_live(&mut self) {
        self.preflights.push_back(Err(incompatible()));
        self.live_after = None;
    }
}

fn incompatible() -> Refusal {
    Refusal::Incompatible {
        version: "12.104".to_owned(),
        message: "/fake/envoy has hot-restart version 12.104, the running envoy 11.104".to_owned(),
    }
}

#[tokio::test(start_paused = true)]
async fn an_incompatible_binary_is_handed_over_cold_and_the_old_family_retires() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    {
        let mut w = f.host.world();
        w.preflights.push_back(Err(incompatible()));
        // What the new family's Envoy says of itself.
        w.admin_version = "12.104".to_owned();
    }
    let writes_before = f.host.world().marker_writes.len();
    let answer = f.restart("SIGHUP").await.unwrap();
    assert_eq!(answer, Ok(0), "epoch 0 of the new family");
    {
        let w = f.host.world();
        assert_eq!(w.cold_spawns, [8], "the other base id");
        assert_eq!(w.switches, [8]);
        assert_eq!(w.drains.len(), 1, "the old family drains");
        let drain = &w.drains[0];
        assert!(*drain == (Scope::All, false), "{drain:?}");
        assert!(w.alive_in(7, 0), "the old family drains before it stops");
    }
    let s = f
        .until("the new family's version learnt", |s| {
            s.family
                .as_ref()
                .is_some_and(|f| f.hot_restart_version == "12.104")
        })
        .await;
    let family = s.family.clone().unwrap();
    assert_eq!(family.base_id, 8);
    assert_eq!(family.retiring.len(), 1, "{family:?}");
    assert_eq!(family.retiring[0].state, EpochState::Draining);
    let last = family.last_handoff.unwrap();
    assert_eq!(last.outcome, Outcome::Live);
    assert!(
        matches!(&last.kind, envoy_agent_proxy::HandoffKind::Cold { from_base_id: 7, to_base_id: 8, why } if why.contains("12.104")),
        "{:?}",
        last.kind
    );
    assert_eq!(s.phase, ProxyPhase::Serving);
    // The drain time (1 s) and a margin later, the old family is terminated; then a hot
    // restart of the new family binds the configured admin address again.
    let s = f.serving_at(1).await;
    {
        let w = f.host.world();
        assert!(!w.alive_in(7, 0), "the old family is gone");
        assert_eq!(
            w.family_signals
                .iter()
                .filter(|(family, ..)| *family == 7)
                .map(|(_, epoch, signal)| (*epoch, *signal))
                .collect::<Vec<_>>(),
            [(0, Signal::SIGTERM)]
        );
        assert_eq!(w.spawns, [0, 1], "epoch 1 of the new family");
        assert!(
            !w.marker_writes[writes_before..].contains(&false),
            "ready throughout: {:?}",
            w.marker_writes
        );
    }
    let family = s.family.unwrap();
    assert!(family.retiring.is_empty());
    assert_eq!(
        family.last_handoff.unwrap().kind,
        envoy_agent_proxy::HandoffKind::Hot
    );
    let (ended, host) = f.stop().await;
    assert!(matches!(ended, Ended::Stopped { .. }), "{ended:?}");
    assert!(!host.world().alive_in(8, 1));
}

#[tokio::test(start_paused = true)]
async fn handed_over_while_an_older_family_retires_our_family_still_stops_when_that_one_is_gone() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    {
        let mut w = f.host.world();
        w.preflights.push_back(Err(incompatible()));
        w.admin_version = "12.104".to_owned();
    }
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(0));
    assert!(f.host.world().alive_in(7, 0), "the old family retires");
    // A successor pod takes our new family over cold while the old one still drains.
    // (Under the base id beside ours: the one our old family still holds.)
    let b = heartbeat("pod-b-2222", NodeState::Serving, 0, &f.host);
    let b = Heartbeat {
        cold_takeover_of: Some("pod-a-0000aaaa".to_owned()),
        ..b
    };
    f.host.world().others = vec![b];
    f.until("handed over", |s| s.phase == ProxyPhase::HandedOver)
        .await;
    assert!(f.host.world().alive_in(7, 0), "the old family still drains");
    // The old family goes before its time (it crashed, or someone killed it): our family's
    // retirement is still the handover's, not over.
    f.host.world().exit_in(7, 0, code(0));
    f.until("our family stopped after the drain time", |s| {
        s.epochs.is_empty()
    })
    .await;
    assert_eq!(
        f.host
            .world()
            .family_signals
            .iter()
            .filter(|(family, ..)| *family == 8)
            .map(|(_, epoch, signal)| (*epoch, *signal))
            .collect::<Vec<_>>(),
        [(0, Signal::SIGTERM)]
    );
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_new_family_that_fails_leaves_the_old_one_serving_untouched() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().incompatible_never_live();
    let restart = f.restart("SIGHUP");
    f.cold_spawned().await;
    f.host.world().exit_in(8, 0, code(1));
    let answer = restart.await.unwrap();
    assert!(
        matches!(&answer, Err(RestartError::Failed(m)) if m.contains("new family")),
        "{answer:?}"
    );
    let s = f.serving_at(0).await;
    let family = s.family.unwrap();
    assert_eq!(family.base_id, 7, "still the old family");
    assert_eq!(family.last_handoff.unwrap().kind.as_str(), "cold");
    let w = f.host.world();
    assert!(w.alive_in(7, 0));
    assert!(w.drains.is_empty() && w.switches.is_empty());
    assert!(w.signals_to(0).is_empty(), "never signalled");
}

#[tokio::test(start_paused = true)]
async fn a_new_family_not_live_by_the_deadline_is_killed_and_the_old_one_serves_on() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().incompatible_never_live();
    let answer = f.restart("SIGHUP").await.unwrap();
    assert!(matches!(answer, Err(RestartError::Failed(_))), "{answer:?}");
    let w = f.host.world();
    assert!(w.family_signals.contains(&(8, 0, Signal::SIGKILL)));
    assert!(w.alive_in(7, 0) && !w.alive_in(8, 0));
    drop(w);
    let s = f.handle.state().borrow().clone();
    assert_eq!(
        s.family.unwrap().last_handoff.unwrap().outcome,
        Outcome::TimedOut
    );
}

#[tokio::test(start_paused = true)]
async fn unusable_shared_memory_is_handed_over_cold_with_the_same_version() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().shm = Err("its header says 3735928559.104".to_owned());
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(0));
    let s = f.handle.state().borrow().clone();
    let family = s.family.unwrap();
    assert_eq!(family.base_id, 8);
    assert_eq!(family.hot_restart_version, "11.104", "the same binary");
    assert!(
        matches!(&family.last_handoff.unwrap().kind, envoy_agent_proxy::HandoffKind::Cold { why, .. } if why.contains("shared memory")),
    );
    assert_eq!(
        f.host.world().spawns,
        [0],
        "no hot restart into the broken segment"
    );
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn without_cold_handovers_an_incompatible_binary_is_refused() {
    let mut c = config();
    c.options.cold_base_id = None;
    let f = start(FakeHost::default(), c);
    f.serving_at(0).await;
    f.host.world().preflights.push_back(Err(incompatible()));
    let answer = f.restart("SIGHUP").await.unwrap();
    assert!(
        matches!(&answer, Err(RestartError::Rejected(m)) if m.contains("12.104") && m.contains("--no-cold-handover")),
        "{answer:?}"
    );
    assert!(f.host.world().cold_spawns.is_empty());
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn stopping_during_a_cold_handover_stops_both_families() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().incompatible_never_live();
    let _restart = f.restart("SIGHUP");
    f.cold_spawned().await;
    let (ended, host) = f.stop().await;
    assert!(matches!(ended, Ended::Stopped { .. }), "{ended:?}");
    let w = host.world();
    assert!(
        !w.alive_in(7, 0) && !w.alive_in(8, 0),
        "nothing left running"
    );
}

#[tokio::test(start_paused = true)]
async fn the_restart_after_a_cold_handover_never_hands_over_cold_again() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    {
        let mut w = f.host.world();
        w.preflights.push_back(Err(incompatible()));
        // The settling restart finds the binary incompatible again (a binary that lies).
        w.preflights.push_back(Err(incompatible()));
    }
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(0));
    let s = f
        .until("the settling restart refused", |s| {
            s.family.as_ref().is_some_and(|f| {
                f.retiring.is_empty()
                    && f.last_handoff
                        .as_ref()
                        .is_some_and(|h| h.outcome == Outcome::Rejected)
            })
        })
        .await;
    let message = s.family.unwrap().last_handoff.unwrap().message;
    assert!(
        message.contains("does not hand over cold again"),
        "{message}"
    );
    assert_eq!(
        f.host.world().cold_spawns,
        [8],
        "one cold handover, not a loop"
    );
    f.serving_at(0).await;
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_successor_that_cannot_hot_restart_from_the_node_family_takes_over_cold() {
    let host = FakeHost::default();
    {
        let mut w = host.world();
        w.node = true;
        // pod-a's Envoy, of another hot-restart version, answers on the admin port.
        w.admin_version = "12.104".to_owned();
        w.live(3);
        w.admin_version = "11.104".to_owned();
    }
    let mut a = heartbeat("pod-a-1111", NodeState::Serving, 3, &host);
    a.hot_restart_version = "12.104".to_owned();
    host.world().others = vec![a];
    let f = start(host, config());
    let s = f.serving_at(0).await;
    {
        let w = f.host.world();
        assert_eq!(
            w.cold_spawns,
            [8],
            "beside pod-a's family, under the other base id"
        );
        assert!(
            w.spawns.is_empty(),
            "no hot restart from an incompatible envoy"
        );
        assert!(w.drains.is_empty(), "pod-a drains its own family");
        let ours = w.ours.clone().unwrap();
        assert_eq!(ours.base_id, 8);
        assert_eq!(ours.state, NodeState::Serving);
        assert_eq!(
            ours.cold_takeover_of.as_deref(),
            Some("pod-a-1111"),
            "{ours:?}"
        );
        let handover = ours.handover.unwrap();
        assert_eq!(handover.kind, "cold");
        assert!(handover.why.contains("12.104"), "{handover:?}");
    }
    let family = s.family.unwrap();
    assert_eq!(family.predecessor.as_deref(), Some("pod-a-1111"));
    assert_eq!(family.last_handoff.unwrap().kind.as_str(), "cold");
    // pod-a's Envoy still holds the configured admin port: nothing else happens.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(f.host.world().spawns.is_empty());
    // It is gone: our family takes the configured admin port by a hot restart.
    f.host.world().admin = Admin::Refused;
    f.serving_at(1).await;
    {
        let w = f.host.world();
        assert_eq!(w.spawns, [1]);
        assert_eq!(w.ours.clone().unwrap().cold_takeover_of, None);
    }
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_predecessor_told_of_a_cold_takeover_drains_and_stops_its_family() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    let mut b = heartbeat("pod-b-2222", NodeState::Serving, 0, &f.host);
    b.base_id = 8;
    b.cold_takeover_of = Some("pod-a-0000aaaa".to_owned());
    f.host.world().others = vec![b];
    let s = f
        .until("handed over", |s| s.phase == ProxyPhase::HandedOver)
        .await;
    assert_eq!(
        s.family.unwrap().handed_over_to.as_deref(),
        Some("pod-b-2222")
    );
    {
        let w = f.host.world();
        assert!(!w.marker, "not ready once handed over");
        assert_eq!(w.drains.len(), 1, "our family drains every listener");
        assert_eq!(w.drains[0], (Scope::All, false));
        assert!(w.alive(0), "drains before it stops");
    }
    // After the drain time (1 s) and a margin: SIGTERM, and the family is gone.
    f.until("our envoy gone", |s| s.epochs.is_empty()).await;
    assert_eq!(f.host.world().signals_to(0), [Signal::SIGTERM]);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_drain_held_by_a_handoff_a_successors_takeover_made_moot_goes_to_our_family() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    f.host.world().live_after = Some(Duration::from_secs(30));
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    let drain = f.drain();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        f.host.world().drains.is_empty(),
        "held while epoch 1 starts"
    );
    let mut b = heartbeat("pod-b-2222", NodeState::Serving, 0, &f.host);
    b.base_id = 8;
    b.cold_takeover_of = Some("pod-a-0000aaaa".to_owned());
    f.host.world().others = vec![b];
    f.until("handed over", |s| s.phase == ProxyPhase::HandedOver)
        .await;
    // Answered by our family's Envoy, which still serves while it drains: not left for the
    // stop to answer as "not serving".
    let answered = tokio::time::timeout(Duration::from_secs(1), drain)
        .await
        .expect("answered once the takeover made the handoff moot")
        .unwrap();
    assert!(answered.is_ok(), "{answered:?}");
    let drains = f.host.world().drains.clone();
    assert_eq!(drains, [(Scope::All, false), (Scope::Auto, false)]);
    drop(restart);
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_successor_finding_the_node_family_segment_unusable_takes_over_cold() {
    let host = FakeHost::default();
    {
        let mut w = host.world();
        w.node = true;
        w.live(3);
        w.shm = Err("its header says 3735928559.104".to_owned());
    }
    let a = heartbeat("pod-a-1111", NodeState::Serving, 3, &host);
    host.world().others = vec![a];
    let f = start(host, config());
    let s = f.serving_at(0).await;
    {
        let w = f.host.world();
        assert_eq!(w.cold_spawns, [8]);
        assert!(
            w.spawns.is_empty(),
            "no epoch 4 into a segment it could not attach to"
        );
        assert_eq!(
            w.ours.clone().unwrap().cold_takeover_of.as_deref(),
            Some("pod-a-1111")
        );
    }
    let kind = s.family.unwrap().last_handoff.unwrap().kind;
    assert!(
        matches!(&kind, envoy_agent_proxy::HandoffKind::Cold { why, from_base_id: 7, .. } if why.contains("shared memory")),
        "{kind:?}"
    );
    f.stop().await;
}

/// What the fake Envoy's stats say of its control plane (see `World::xds`): down, nothing
/// received yet; and up, both types received.
const XDS_WAITING: &str = "cluster_manager.cds.update_success: 0\n\
    listener_manager.lds.update_success: 0\n\
    control_plane.connected_state: 0\n";
const XDS_RECEIVED: &str = "cluster_manager.cds.update_success: 1\n\
    listener_manager.lds.update_success: 1\n\
    control_plane.connected_state: 1\n";

#[tokio::test(start_paused = true)]
async fn the_marker_waits_until_the_first_epoch_has_its_config_from_the_control_plane() {
    let host = FakeHost::default();
    host.world().xds = XDS_WAITING.to_owned();
    let f = start(host, config());
    // LIVE (as Envoy is once its initial fetches time out), but with no config.
    f.serving_at(0).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!f.host.world().marker, "not ready without its config");
    assert_eq!(
        f.handle.state().borrow().ready().unwrap_err(),
        envoy_agent_proxy::NotReady::Config(envoy_agent_proxy::ConfigNotReady::Awaited {
            summary: "cds: waiting, lds: waiting".to_owned()
        })
    );
    f.host.world().xds = XDS_RECEIVED.to_owned();
    f.until("ready", |s| s.ready().is_ok()).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(f.host.world().marker, "the marker follows the config");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_static_bootstrap_is_ready_at_live_and_its_stats_are_read_once() {
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.until("ready", |s| s.ready().is_ok()).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        f.host.world().xds_asks,
        1,
        "a static config is not asked again"
    );
    f.stop().await;
}

/// On a large config a reading takes Envoy most of a second (it visits every stat): the
/// steady readings (for the status) then take at most 1/100 of its main thread.
#[tokio::test(start_paused = true)]
async fn a_costly_control_plane_reading_is_asked_less_often() {
    let host = FakeHost::default();
    {
        let mut w = host.world();
        w.xds = XDS_RECEIVED.to_owned();
        w.xds_delay = Duration::from_secs(1);
    }
    let f = start(host, config());
    f.serving_at(0).await;
    f.until("ready", |s| s.ready().is_ok()).await;
    let before = f.host.world().xds_asks;
    tokio::time::sleep(Duration::from_secs(1000)).await;
    let asked = f.host.world().xds_asks - before;
    // Every 10 s at a cost of nothing; every 100 s (plus the 1 s it takes) at 1 s.
    assert!((9..=11).contains(&asked), "asked {asked} times in 1000 s");
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_new_epoch_waiting_for_its_control_plane_is_no_wedge_and_its_restart_is_retried() {
    let host = FakeHost::default();
    host.world().xds = XDS_RECEIVED.to_owned();
    let f = start(host, config());
    f.serving_at(0).await;
    f.until("ready", |s| s.ready().is_ok()).await;
    // The control plane goes away; then a restart.
    {
        let mut w = f.host.world();
        w.live_after = None;
        w.xds = XDS_WAITING.to_owned();
    }
    let restart = f.restart("SIGHUP");
    f.spawned(&[0, 1]).await;
    {
        // The child took the admin listener and initializes, waiting for its config.
        let mut w = f.host.world();
        w.admin = Admin::Answers {
            epoch: 1,
            state: ServerState::PreInitializing,
            base_id: 7,
            version: w.admin_version.clone(),
            uptime: Duration::ZERO,
        };
    }
    let waiting = f
        .until("the handoff says why it waits", |s| {
            s.family
                .as_ref()
                .and_then(|f| f.handoff.as_ref())
                .and_then(|h| h.waiting_for.as_deref())
                == Some("the control plane: cds, lds")
        })
        .await;
    assert!(waiting.ready().is_ok(), "the serving epoch stays ready");
    let answer = restart.await.unwrap();
    let Err(RestartError::Failed(why)) = &answer else {
        panic!("{answer:?}")
    };
    assert!(
        why.contains("waited for its control plane (cds, lds)"),
        "{why}"
    );
    {
        let w = f.host.world();
        assert_eq!(w.signals_to(1), [Signal::SIGKILL]);
        assert!(
            w.signals_to(0).is_empty(),
            "the serving epoch is left alone"
        );
        assert!(w.alive(0));
        assert!(w.marker, "still ready");
    }
    let s = f.handle.state().borrow().clone();
    let family = s.family.clone().unwrap();
    assert!(family.wedges.is_empty(), "no wedge: {:?}", family.wedges);
    assert_eq!(
        family.handoff.map(|h| h.stage),
        Some(envoy_agent_proxy::HandoffStage::Queued),
        "the restart stays queued"
    );
    assert!(s.ready().is_ok());
    // Still down at the first retry: it waits again, and is retried again.
    f.spawned(&[0, 1, 1]).await;
    {
        let mut w = f.host.world();
        w.admin = Admin::Answers {
            epoch: 1,
            state: ServerState::PreInitializing,
            base_id: 7,
            version: w.admin_version.clone(),
            uptime: Duration::ZERO,
        };
    }
    f.until("the second wait", |s| {
        s.family
            .as_ref()
            .and_then(|f| f.last_handoff.as_ref())
            .is_some_and(|h| h.outcome == Outcome::TimedOut && h.message.contains("retried in 4s"))
    })
    .await;
    // The control plane answers: the next retry goes LIVE with its config.
    {
        let mut w = f.host.world();
        w.admin = Admin::Refused;
        w.live_after = Some(Duration::from_millis(50));
        w.xds = XDS_RECEIVED.to_owned();
    }
    f.serving_at(1).await;
    {
        let w = f.host.world();
        assert_eq!(w.spawns, [0, 1, 1, 1]);
        assert!(
            w.signals_to(0).is_empty(),
            "the old epoch was never signalled"
        );
    }
    f.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_cold_family_waiting_for_its_control_plane_is_no_wedge_and_the_handover_is_retried() {
    let host = FakeHost::default();
    host.world().xds = XDS_RECEIVED.to_owned();
    let f = start(host, config());
    f.serving_at(0).await;
    f.until("ready", |s| s.ready().is_ok()).await;
    {
        let mut w = f.host.world();
        w.incompatible_never_live();
        w.xds = XDS_WAITING.to_owned();
        // The new family's admin answers (its own port), initializing.
        w.cold_admin = Admin::Answers {
            epoch: 0,
            state: ServerState::Initializing,
            base_id: 8,
            version: "12.104".to_owned(),
            uptime: Duration::ZERO,
        };
    }
    let answer = f.restart("SIGHUP").await.unwrap();
    let Err(RestartError::Failed(why)) = &answer else {
        panic!("{answer:?}")
    };
    assert!(why.contains("waited for its control plane"), "{why}");
    let s = f.handle.state().borrow().clone();
    let family = s.family.unwrap();
    assert!(family.wedges.is_empty(), "no wedge: {:?}", family.wedges);
    assert_eq!(
        family.handoff.map(|h| h.stage),
        Some(envoy_agent_proxy::HandoffStage::Queued),
        "the handover stays queued"
    );
    {
        let w = f.host.world();
        assert!(w.alive_in(7, 0), "the old family serves on");
        assert!(w.marker);
    }
    f.stop().await;
}

/// A family that its crash recovery runs again, with `config`: the first run's [`Family`],
/// and what starts the next run.
fn rerunnable(host: &FakeHost, config: Config) -> (Family, impl Fn() -> Family + use<>) {
    let family = Arc::new(
        EnvoyFamily::with_host(config, Arc::new(host.clone()), SupervisorMetrics::default())
            .unwrap(),
    );
    let (host, handle) = (host.clone(), family.handle());
    let run = move || {
        let abort = CancellationToken::new();
        let task = tokio::spawn({
            let (family, abort) = (family.clone(), abort.clone());
            async move { family.run(abort).await }
        });
        Family {
            host: host.clone(),
            family: family.clone(),
            handle: handle.clone(),
            abort,
            task,
        }
    };
    (run(), run)
}

/// Issue 40: the serving epoch killed while its parent drains, with crash recovery on
/// (`keep_draining_parent`). The family ends on the crash as before (the agent counts it and
/// backs off), but the parent is not signalled: it keeps its in-flight requests. The next run
/// starts epoch 0 beside it under the cold base id (the parent holds the configured one's
/// shared memory and socket names), and terminates it at its own deadline, the parent-shutdown
/// time after its child's LIVE.
#[tokio::test(start_paused = true)]
async fn a_draining_parent_outlives_its_crashed_child_until_its_own_deadline() {
    let host = FakeHost::default();
    let mut config = config();
    config.keep_draining_parent = true;
    let parent_shutdown = config.parent_shutdown_time();
    let (f, run_again) = rerunnable(&host, config);
    f.serving_at(0).await;
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    let child_live = tokio::time::Instant::now();
    host.world().exit(1, killed(9));
    let (ended, host) = f.ended().await;
    assert_eq!(ended.code(), 137, "a crash, as before: {ended:?}");
    {
        let w = host.world();
        assert!(w.alive_in(7, 0), "the draining parent still runs");
        assert!(w.signals_to(0).is_empty(), "and was never signalled");
    }

    let again = run_again();
    let s = again.serving_at(0).await;
    {
        let w = host.world();
        assert_eq!(w.spawns, [0, 1, 0]);
        assert_eq!(w.base_id, 8, "the fresh family is under the cold base id");
        assert!(w.alive_in(8, 0) && w.alive_in(7, 0), "beside the parent");
    }
    let family = s.family.unwrap();
    assert_eq!(family.base_id, 8);
    assert_eq!(
        family.retiring.iter().map(|e| e.epoch).collect::<Vec<_>>(),
        [0],
        "the kept parent is shown as retiring"
    );
    again
        .until("the kept parent gone", |s| {
            s.family.as_ref().is_some_and(|f| f.retiring.is_empty())
        })
        .await;
    let gone = tokio::time::Instant::now();
    assert!(
        gone >= child_live + parent_shutdown,
        "not before its own deadline: {:?} after the child's LIVE",
        gone - child_live
    );
    assert!(gone < child_live + parent_shutdown + Duration::from_secs(1));
    assert_eq!(
        host.world().family_signals,
        [(7, 0, Signal::SIGTERM)],
        "SIGTERM at its deadline, the only signal; the new family untouched"
    );
    assert!(again.handle.state().borrow().phase == ProxyPhase::Serving);
    again.stop().await;
}

/// Issue 42: the heartbeat says how the newest family came to serve (`handover`). The first
/// start was told by its reason, `start`, so a user's restart with that reason read as no
/// handover at all; it is told by how the epoch started now.
#[tokio::test(start_paused = true)]
async fn a_restart_whose_reason_is_start_is_still_a_handover_in_the_heartbeat() {
    let host = FakeHost::default();
    host.world().node = true;
    let f = start(host, config());
    f.serving_at(0).await;
    let ours = f.host.world().ours.clone().unwrap();
    assert_eq!(ours.handover, None, "the first start is no handover");
    assert_eq!(f.restart("start").await.unwrap(), Ok(1));
    f.serving_at(1).await;
    // The heartbeat is rewritten once the restart is recorded.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ours = f.host.world().ours.clone().unwrap();
    assert_eq!(ours.newest_epoch, 1);
    assert_eq!(
        ours.handover.map(|h| h.kind),
        Some("hot".to_owned()),
        "a restart, whatever its reason says"
    );
    f.stop().await;
}

/// The soak's eighth finding: the kept parent forwards QUIC packets it does not know to its
/// child's socket; the child dead, Envoy retries each for ever on its main thread and turns
/// deaf to SIGTERM. The agent holds the dead child's names from the crash until the parent is
/// gone, in the parent's family (not the fresh one's).
#[tokio::test(start_paused = true)]
async fn a_kept_parents_dead_child_is_stood_in_for_until_the_parent_is_gone() {
    let host = FakeHost::default();
    let mut config = config();
    config.keep_draining_parent = true;
    let (f, run_again) = rerunnable(&host, config);
    f.serving_at(0).await;
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    assert!(host.world().child_stand_ins.is_empty());
    host.world().exit(1, killed(9));
    let (_, host) = f.ended().await;
    assert_eq!(
        host.world().child_stand_ins,
        [(7, 1)],
        "held from the crash, through the back-off"
    );

    let again = run_again();
    again.serving_at(0).await;
    assert_eq!(
        host.world().child_stand_ins,
        [(7, 1)],
        "the fresh family (base id 8) does not take its place"
    );
    again
        .until("the kept parent gone", |s| {
            s.family.as_ref().is_some_and(|f| f.retiring.is_empty())
        })
        .await;
    assert!(
        host.world().child_stand_ins.is_empty(),
        "let go with the parent"
    );
    again.stop().await;
}

/// The soak's seventh finding: a restart asked while the kept parent still drains (a config
/// change right after a crash recovery) started the fresh family's epoch 1 beside it: three
/// generations. It waits for the kept parent to go, then runs.
#[tokio::test(start_paused = true)]
async fn a_restart_waits_for_the_kept_parent_never_three_generations() {
    let host = FakeHost::default();
    let mut config = config();
    config.keep_draining_parent = true;
    let (f, run_again) = rerunnable(&host, config);
    f.serving_at(0).await;
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    host.world().exit(1, killed(9));
    let (_, host) = f.ended().await;
    let again = run_again();
    again.serving_at(0).await;
    assert!(host.world().alive_in(7, 0), "the kept parent drains");
    let restart = again.restart("config change");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        host.world().spawns,
        [0, 1, 0],
        "no epoch 1 beside the kept parent"
    );
    assert_eq!(restart.await.unwrap(), Ok(1), "once it is gone");
    {
        let w = host.world();
        assert!(!w.alive_in(7, 0), "the kept parent went first");
        assert_eq!(w.spawns, [0, 1, 0, 1]);
    }
    again.stop().await;
}

/// Without crash recovery the agent exits after the crash, so every Envoy must be gone: the
/// draining parent is stopped with its crashed child, as before.
#[tokio::test(start_paused = true)]
async fn without_crash_recovery_a_draining_parent_stops_with_its_crashed_child() {
    let host = FakeHost::default();
    let (f, _) = rerunnable(&host, config());
    f.serving_at(0).await;
    assert_eq!(f.restart("SIGHUP").await.unwrap(), Ok(1));
    host.world().exit(1, killed(9));
    let (ended, host) = f.ended().await;
    assert_eq!(ended.code(), 137, "{ended:?}");
    assert_eq!(host.world().signals_to(0), [Signal::SIGTERM]);
    assert!(!host.world().alive_in(7, 0));
}

/// A writer the test reads back: the log lines as JSON.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Captures this thread's log lines as JSON (the test runtime runs every task on it),
    /// with the list of spans when `span_list`, until the guard is dropped.
    fn json(span_list: bool) -> (Captured, tracing::subscriber::DefaultGuard) {
        use tracing_subscriber::layer::SubscriberExt;
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .json()
                .with_span_list(span_list)
                .with_writer(move || writer.clone()),
        );
        (captured, tracing::subscriber::set_default(subscriber))
    }
}

#[tokio::test(start_paused = true)]
async fn a_log_line_names_the_supervisor_and_its_family() {
    let (captured, _default) = Captured::json(true);
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.abort.cancel();
    f.task.await.unwrap().unwrap();
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("\"epoch_starting\""))
        .unwrap_or_else(|| panic!("no epoch_starting line in {text}"));
    let json: serde_json::Value = serde_json::from_str(line).unwrap();
    let spans = json["spans"].as_array().unwrap();
    assert!(
        spans.iter().any(|s| s["name"] == "supervisor"
            && s["base_id"] == 7
            && s["identity"] == "pod-a-0000aaaa"),
        "{line}"
    );
}

/// The supervisor's span follows the family across a cold handover: the lines of the new
/// family's restarts carry its base id, not the one the supervisor started with.
#[tokio::test(start_paused = true)]
async fn after_a_cold_handover_the_log_lines_carry_the_new_familys_base_id() {
    let (captured, _default) = Captured::json(false);
    let f = start(FakeHost::default(), config());
    f.serving_at(0).await;
    f.host.world().shm = Err("its header says 3735928559.104".to_owned());
    assert_eq!(
        f.restart("SIGHUP").await.unwrap(),
        Ok(0),
        "cold, to base id 8"
    );
    f.host.world().shm = Ok(());
    assert_eq!(f.restart("again").await.unwrap(), Ok(1), "hot, within 8");
    f.stop().await;
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let starting: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.contains("\"epoch_starting\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let base_ids: Vec<_> = starting
        .iter()
        .map(|j| (j["fields"]["epoch"].clone(), j["span"]["base_id"].clone()))
        .collect();
    assert_eq!(
        base_ids.last(),
        Some(&(serde_json::json!(1), serde_json::json!(8))),
        "{base_ids:?}"
    );
    assert_eq!(
        base_ids.first(),
        Some(&(serde_json::json!(0), serde_json::json!(7))),
        "{base_ids:?}"
    );
}

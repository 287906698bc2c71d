//! The actor's decisions through a fake proxy, in paused time.

use super::*;
use std::time::Duration;

use envoy_agent_proxy::{Ended, ProxyPhase, ProxyState, RestartError};
use tokio::time::Instant;

use crate::config::timeline::HealthCheckFailAt;
use crate::crash::{CrashAction, CrashRecovery};
use crate::signal::Intent;
use crate::testing::{Call, FakeProxy, epoch, exit};
use envoy_agent_proxy::{EpochState, FamilyState};

struct Harness {
    proxy: Arc<FakeProxy>,
    handle: AgentHandle,
    intents: mpsc::Sender<Intent>,
    task: tokio::task::JoinHandle<AgentExit>,
    started: Instant,
}

fn start(proxy: FakeProxy, config: AgentConfig) -> Harness {
    let proxy = Arc::new(proxy);
    let (agent, handle) = Agent::new(proxy.clone(), config);
    let (intents, source) = mpsc::channel(4);
    Harness {
        proxy,
        handle,
        intents,
        task: tokio::spawn(agent.run(source)),
        started: Instant::now(),
    }
}

impl Harness {
    async fn signal(&self, intent: Intent) {
        self.intents.send(intent).await.unwrap();
    }

    /// Waits (paused time: instantly) until the agent's state satisfies `check`.
    async fn state(&self, check: impl Fn(&AgentState) -> bool) {
        let mut status = self.handle.status();
        status.wait_for(|s| check(&s.agent)).await.unwrap();
    }

    async fn exit(self) -> (AgentExit, Arc<FakeProxy>, Instant) {
        let exit = self.task.await.unwrap();
        (exit, self.proxy, self.started)
    }
}

/// The defaults, health checks left alone: the tests of the timeline's steps turn them on.
fn config() -> AgentConfig {
    AgentConfig {
        fail_health_checks_at: HealthCheckFailAt::Off,
        ..AgentConfig::default()
    }
}

fn without_successor(calls: Vec<Call>) -> Vec<Call> {
    calls
        .into_iter()
        .filter(|c| *c != Call::Successor)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn live_follows_the_proxy_state() {
    let h = start(FakeProxy::default(), config());
    assert_eq!(h.handle.state().name(), "starting");
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.handle.quit(Via::Http).await.unwrap();
    h.exit().await;
}

#[tokio::test(start_paused = true)]
async fn sigterm_drains_then_stops_after_the_termination_drain_duration() {
    let h = start(FakeProxy::default(), config());
    h.proxy.go_live();
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    assert_eq!(exit.code(), 0);
    assert_eq!(
        proxy.calls(),
        [
            Call::Successor,
            Call::Drain { skip_exit: false },
            Call::Stop
        ],
        "asked about a successor first, then drained and stopped"
    );
    let stopped = proxy.stopped_at().unwrap() - started;
    assert_eq!(stopped.as_secs(), 5, "stopped after {stopped:?}");
}

#[tokio::test(start_paused = true)]
async fn the_timeline_keeps_readiness_fails_health_checks_and_drains_at_their_offsets() {
    let secs = Duration::from_secs;
    let c = AgentConfig {
        not_ready_at: secs(2),
        fail_health_checks_at: HealthCheckFailAt::After(secs(1)),
        drain_delay: secs(3),
        ..AgentConfig::default()
    };
    let h = start(FakeProxy::default(), c);
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.signal(Intent::Terminate).await;
    h.state(|s| {
        matches!(
            s,
            AgentState::Draining {
                phase: DrainPhase::Delay,
                ready: true,
                ..
            }
        )
    })
    .await;
    assert!(h.handle.state().serving(), "ready until --not-ready-at");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(without_successor(h.proxy.calls()), [Call::FailHealthChecks]);
    assert!(h.handle.state().serving());
    tokio::time::sleep(secs(1)).await;
    assert!(!h.handle.state().serving(), "not ready after 2 s");
    tokio::time::sleep(secs(1)).await;
    assert_eq!(
        without_successor(h.proxy.calls()),
        [Call::FailHealthChecks, Call::Drain { skip_exit: false }]
    );
    let (exit, _, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    assert_eq!(exit.reason, Some(DrainReason::Signal(Intent::Terminate)));
    assert!(exit.took.is_some());
}

#[tokio::test(start_paused = true)]
async fn by_default_health_checks_fail_when_the_drain_starts() {
    let c = AgentConfig {
        drain_delay: Duration::from_secs(3),
        ..AgentConfig::default()
    };
    let h = start(FakeProxy::default(), c);
    h.proxy.go_live();
    h.signal(Intent::Terminate).await;
    tokio::time::sleep(Duration::from_millis(2900)).await;
    assert_eq!(without_successor(h.proxy.calls()), []);
    assert!(!h.handle.state().serving(), "not ready at the signal");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut calls = without_successor(h.proxy.calls());
    calls.sort_by_key(|c| format!("{c:?}"));
    assert_eq!(
        calls,
        [Call::Drain { skip_exit: false }, Call::FailHealthChecks]
    );
    h.exit().await;
}

#[tokio::test(start_paused = true)]
async fn envoy_exiting_during_the_drain_ends_the_wait_with_its_code() {
    let h = start(FakeProxy::default(), config());
    h.signal(Intent::Terminate).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    h.proxy.exit_on_its_own(0);
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::ProxyExited { code: 0 });
    assert_eq!(
        without_successor(proxy.calls()),
        [Call::Drain { skip_exit: false }]
    );
}

#[tokio::test(start_paused = true)]
async fn envoy_exiting_on_its_own_passes_its_code_on() {
    let h = start(FakeProxy::default(), config());
    tokio::time::sleep(Duration::from_secs(3)).await;
    h.proxy.exit_on_its_own(3);
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::ProxyExited { code: 3 });
    assert_eq!(exit.code(), 3);
    assert!(proxy.calls().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_second_signal_during_the_drain_stops_at_once() {
    let h = start(FakeProxy::default(), config());
    h.signal(Intent::Terminate).await;
    h.state(|s| {
        matches!(
            s,
            AgentState::Draining {
                phase: DrainPhase::Draining,
                ..
            }
        )
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    h.signal(Intent::Interrupt).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::SecondSignal);
    assert_eq!(
        (proxy.stopped_at().unwrap() - started).as_millis(),
        500,
        "stopped when the second signal came"
    );
}

#[tokio::test(start_paused = true)]
async fn drain_request_keeps_running_and_a_sigterm_continues_its_timeline_to_the_stop() {
    let h = start(FakeProxy::default(), config());
    h.proxy.go_live();
    h.handle.drain_now(Via::Http).await.unwrap();
    // Resolved once applied: the state says so already.
    assert!(matches!(
        h.handle.state(),
        AgentState::Draining {
            reason: DrainReason::Request(Via::Http),
            ..
        }
    ));
    // Draining "forever": an hour later Envoy still runs.
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(h.proxy.calls(), [Call::Drain { skip_exit: true }]);
    // After a drain request, the proxy answers hot restarts itself (a family refuses).
    let answer = h.handle.hot_restart("x".to_owned()).await.unwrap_err();
    assert!(
        matches!(answer, AgentError::Restart(RestartError::Unsupported)),
        "{answer}"
    );
    // The timeline's deadline (5 s after the drain) passed long ago: the stop is at once.
    let before = Instant::now();
    h.signal(Intent::Terminate).await;
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    assert_eq!(exit.reason, Some(DrainReason::Request(Via::Http)));
    assert_eq!(proxy.calls(), [Call::Drain { skip_exit: true }, Call::Stop]);
    assert_eq!(proxy.stopped_at().unwrap(), before);
}

#[tokio::test(start_paused = true)]
async fn a_drain_request_keeps_the_timeline_and_a_sigterm_within_it_stops_at_its_deadline() {
    let h = start(
        FakeProxy::default(),
        AgentConfig {
            drain_delay: Duration::from_secs(3),
            ..config()
        },
    );
    h.proxy.go_live();
    let handle = h.handle.clone();
    let asked = Instant::now();
    let drained = tokio::spawn(async move { handle.drain_now(Via::Http).await });
    // Readiness off at once (--not-ready-at 0s), the drain only after the delay.
    h.state(|s| {
        matches!(
            s,
            AgentState::Draining {
                phase: DrainPhase::Delay,
                ready: false,
                ..
            }
        )
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(h.proxy.calls().is_empty(), "nothing asked of envoy yet");
    // A SIGTERM now continues the same timeline: no second one, no stop at once.
    h.signal(Intent::Terminate).await;
    drained.await.unwrap().unwrap();
    assert_eq!(
        asked.elapsed(),
        Duration::from_secs(3),
        "resolved once envoy drains"
    );
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    assert_eq!(proxy.calls(), [Call::Drain { skip_exit: true }, Call::Stop]);
    assert_eq!(
        proxy.stopped_at().unwrap() - started,
        Duration::from_secs(8),
        "the delay and the termination drain duration, from the request"
    );
}

#[tokio::test(start_paused = true)]
async fn quitquitquit_stops_without_draining_and_resolves_once_applied() {
    let h = start(FakeProxy::default(), config());
    h.handle.quit(Via::Grpc).await.unwrap();
    assert!(
        matches!(
            h.handle.state(),
            AgentState::Exiting {
                path: ExitPath::QuitQuitQuit(Via::Grpc),
                ..
            }
        ),
        "{:?}",
        h.handle.state()
    );
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::QuitQuitQuit(Via::Grpc));
    assert_eq!(exit.code(), 0);
    assert_eq!(proxy.calls(), [Call::Stop]);
}

#[tokio::test(start_paused = true)]
async fn disable_draining_makes_sigterm_stop_at_once() {
    let h = start(FakeProxy::default(), config());
    h.handle.disable_draining().await.unwrap();
    h.signal(Intent::Terminate).await;
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::SignalAfterDrain);
    assert_eq!(proxy.calls(), [Call::Stop]);
}

#[tokio::test(start_paused = true)]
async fn drain_delay_reports_not_ready_before_draining() {
    let mut c = config();
    c.drain_delay = Duration::from_secs(3);
    let h = start(FakeProxy::default(), c);
    h.proxy.go_live();
    h.signal(Intent::Terminate).await;
    h.state(|s| {
        matches!(
            s,
            AgentState::Draining {
                phase: DrainPhase::Delay,
                ..
            }
        )
    })
    .await;
    tokio::time::sleep(Duration::from_millis(2900)).await;
    assert_eq!(
        h.proxy.calls(),
        [Call::Successor],
        "no drain during the delay"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        without_successor(h.proxy.calls()),
        [Call::Drain { skip_exit: false }]
    );
    assert!(matches!(
        h.handle.state(),
        AgentState::Draining {
            phase: DrainPhase::Draining,
            ..
        }
    ));
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    // Delay plus the termination drain duration.
    assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 8);
}

#[tokio::test(start_paused = true)]
async fn a_hanging_drain_call_does_not_extend_the_deadline() {
    let proxy = FakeProxy {
        hang_drain: true,
        ..FakeProxy::default()
    };
    let h = start(proxy, config());
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    // Never answered, so never accepted: the exit says so rather than claim a drain.
    assert_eq!(exit.path, ExitPath::DrainFailed);
    assert_eq!(exit.path.code(), 1);
    assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
}

/// A zero termination drain duration stops Envoy as the drain request goes out: it is
/// unanswered, not refused, and the exit says the drain time elapsed (code 0).
#[tokio::test(start_paused = true)]
async fn a_drain_request_just_sent_at_the_deadline_is_no_failure() {
    let mut c = config();
    c.termination_drain_duration = Duration::ZERO;
    let proxy = FakeProxy {
        hang_drain: true,
        ..FakeProxy::default()
    };
    let h = start(proxy, c);
    h.signal(Intent::Terminate).await;
    let (exit, _, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    assert_eq!(exit.path.code(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_failed_drain_request_is_sent_again_until_envoy_accepts_it() {
    let proxy = FakeProxy {
        drain_failures: std::sync::Mutex::new(2),
        ..FakeProxy::default()
    };
    let h = start(proxy, config());
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    assert_eq!(exit.path.code(), 0);
    let drains = without_successor(proxy.calls())
        .iter()
        .filter(|c| matches!(c, Call::Drain { .. }))
        .count();
    assert_eq!(drains, 3, "{:?}", proxy.calls());
    assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
}

#[tokio::test(start_paused = true)]
async fn a_drain_request_that_always_fails_is_reported_as_such() {
    let proxy = FakeProxy {
        drain_failures: std::sync::Mutex::new(u32::MAX),
        ..FakeProxy::default()
    };
    let h = start(proxy, config());
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainFailed);
    assert_eq!(exit.path.name(), "drain_failed");
    assert_eq!(exit.path.code(), 1);
    // Sent again each second until the deadline (5 s).
    let drains = without_successor(proxy.calls())
        .iter()
        .filter(|c| matches!(c, Call::Drain { .. }))
        .count();
    assert!(drains >= 4, "{:?}", proxy.calls());
    assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
}

#[tokio::test(start_paused = true)]
async fn exit_on_zero_gives_up_after_the_stats_error_budget() {
    // The fake has no admin API: every count fails.
    let mut c = config();
    c.exit_on_zero = Some(Counting::Connections);
    c.termination_drain_duration = Duration::from_secs(60);
    let h = start(FakeProxy::default(), c);
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::StatsUnavailable(Counting::Connections));
    let stopped = proxy.stopped_at().unwrap() - started;
    // Minimum drain (5s), then five failures 50ms apart.
    assert!(
        stopped >= Duration::from_secs(5) && stopped < Duration::from_secs(6),
        "{stopped:?}"
    );
}

/// A count that takes Envoy a second (its stats, on a large config) is asked at most every
/// 20 s: 1/20 of its main thread.
#[tokio::test(start_paused = true)]
async fn a_costly_count_is_asked_less_often() {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = calls.clone();
    let counter: Counter = Arc::new(move || {
        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok(5)
        })
    });
    let mut c = config();
    c.exit_on_zero = Some(Counting::Connections);
    c.termination_drain_duration = Duration::from_secs(65);
    let proxy = Arc::new(FakeProxy::default());
    let (agent, handle) = Agent::new(proxy.clone(), c);
    let agent = agent.with_counter(counter);
    let (intents, source) = mpsc::channel(4);
    let h = Harness {
        proxy,
        handle,
        intents,
        task: tokio::spawn(agent.run(source)),
        started: Instant::now(),
    };
    h.signal(Intent::Terminate).await;
    let (exit, _, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainDeadline(Counting::Connections));
    // From the minimum drain (5 s) to the deadline (65 s): at 0, 20, 40 and 60 s.
    let n = calls.load(std::sync::atomic::Ordering::SeqCst);
    assert!((3..=4).contains(&n), "counted {n} times");
}

/// A counter answering from a script: one count per call, then the last one forever.
fn counts(script: &[u64]) -> (Counter, Arc<std::sync::atomic::AtomicUsize>) {
    let script: Arc<Vec<u64>> = Arc::new(script.to_vec());
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = calls.clone();
    let counter: Counter = Arc::new(move || {
        let i = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let n = script[i.min(script.len() - 1)];
        Box::pin(async move { Ok(n) })
    });
    (counter, seen)
}

fn start_counting(
    config: AgentConfig,
    script: &[u64],
) -> (Harness, Arc<std::sync::atomic::AtomicUsize>) {
    let proxy = Arc::new(FakeProxy::default());
    let (counter, calls) = counts(script);
    let (agent, handle) = Agent::new(proxy.clone(), config);
    let agent = agent.with_counter(counter);
    let (intents, source) = mpsc::channel(4);
    (
        Harness {
            proxy,
            handle,
            intents,
            task: tokio::spawn(agent.run(source)),
            started: Instant::now(),
        },
        calls,
    )
}

#[tokio::test(start_paused = true)]
async fn exit_on_zero_at_its_defaults_counts_after_the_minimum_until_zero() {
    // Istio's defaults: 5s minimum, 5s termination drain duration. Nothing would ever be
    // counted if that were a deadline; it is not: counting goes on until zero.
    let mut c = config();
    c.exit_on_zero = Some(Counting::Connections);
    let (h, calls) = start_counting(c, &[3, 3, 2, 1, 1, 0]);
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::ZeroActive(Counting::Connections));
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 6);
    let stopped = proxy.stopped_at().unwrap() - started;
    // The minimum, then five 50 ms polls.
    assert_eq!(stopped, Duration::from_millis(5250), "{stopped:?}");
}

#[tokio::test(start_paused = true)]
async fn exit_on_zero_with_no_connection_at_all_stops_at_the_minimum() {
    let mut c = config();
    c.exit_on_zero = Some(Counting::Connections);
    let (h, _) = start_counting(c, &[0]);
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(
        exit.path,
        ExitPath::ZeroActive(Counting::Connections),
        "not the deadline"
    );
    assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
}

#[tokio::test(start_paused = true)]
async fn a_longer_termination_drain_duration_is_a_hard_deadline_on_counted_connections() {
    let mut c = config();
    c.exit_on_zero = Some(Counting::Connections);
    c.minimum_drain_duration = Duration::from_secs(2);
    c.termination_drain_duration = Duration::from_secs(7);
    let (h, calls) = start_counting(c, &[4]);
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(
        exit.path,
        ExitPath::DrainDeadline(Counting::Connections),
        "connections were counted"
    );
    assert!(calls.load(std::sync::atomic::Ordering::SeqCst) > 50);
    assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 7);
}

#[tokio::test(start_paused = true)]
async fn exit_on_zero_requests_names_requests_in_its_progress_and_exit_paths() {
    let mut c = config();
    c.exit_on_zero = Some(Counting::Requests);
    c.minimum_drain_duration = Duration::from_secs(1);
    c.termination_drain_duration = Duration::from_secs(3);
    let (h, _) = start_counting(c.clone(), &[2, 2, 1, 0]);
    let mut status = h.handle.status();
    h.signal(Intent::Terminate).await;
    let progress = status
        .wait_for(|s| s.drain.as_ref().is_some_and(|d| d.last_count.is_some()))
        .await
        .unwrap()
        .drain
        .clone()
        .unwrap();
    assert_eq!(progress.counting, Some(Counting::Requests));
    assert_eq!(progress.last_count.map(|(n, _)| n), Some(2));
    let (exit, _, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::ZeroActive(Counting::Requests));
    assert_eq!(exit.path.name(), "zero_requests");

    let (h, _) = start_counting(c, &[1]);
    h.signal(Intent::Terminate).await;
    let (exit, _, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainDeadline(Counting::Requests));
    assert_eq!(exit.path.counting(), Some(Counting::Requests));
}

#[tokio::test(start_paused = true)]
async fn without_exit_on_zero_the_drain_reports_no_count() {
    let h = start(FakeProxy::default(), config());
    let mut status = h.handle.status();
    h.signal(Intent::Terminate).await;
    let progress = status
        .wait_for(|s| s.drain.is_some())
        .await
        .unwrap()
        .drain
        .clone()
        .unwrap();
    assert_eq!((progress.counting, progress.last_count), (None, None));
    let (exit, _, _) = h.exit().await;
    assert_eq!(exit.path.counting(), None);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_never_claims_uncounted_connections() {
    // Counts fail (no admin): the deadline ends the wait, and says the time elapsed.
    let mut c = config();
    c.exit_on_zero = Some(Counting::Connections);
    c.minimum_drain_duration = Duration::from_secs(1);
    c.termination_drain_duration = Duration::from_millis(1100);
    let h = start(FakeProxy::default(), c);
    h.signal(Intent::Terminate).await;
    let (exit, _, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
}

#[tokio::test(start_paused = true)]
async fn sigterm_with_a_successor_waits_for_it_to_terminate_our_envoy() {
    let proxy = FakeProxy::default();
    *proxy.successor.lock().unwrap() = Some("pod-b".to_owned());
    let family = FamilyState {
        successor_starting: Some("pod-b".to_owned()),
        ..FamilyState::default()
    };
    proxy.set(
        ProxyPhase::Serving,
        vec![epoch(3, EpochState::Live)],
        Some(family.clone()),
    );
    let h = start(proxy, config());
    h.signal(Intent::Terminate).await;
    h.state(|s| matches!(s, AgentState::HandingOver { successor, .. } if successor == "pod-b"))
        .await;
    // Well past the drain duration: no drain of ours, Envoy not stopped.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(h.proxy.calls(), [Call::Successor]);
    // The successor took over and its Envoy terminated ours.
    h.proxy.set(
        ProxyPhase::HandedOver,
        vec![epoch(3, EpochState::Draining)],
        Some(family.clone()),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(h.proxy.calls(), [Call::Successor], "ours still drains");
    h.proxy.set(ProxyPhase::HandedOver, vec![], Some(family));
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::HandedOver);
    assert_eq!(exit.code(), 0);
    assert_eq!(proxy.calls(), [Call::Successor, Call::Stop]);
}

#[tokio::test(start_paused = true)]
async fn a_successor_that_goes_away_falls_back_to_our_own_drain() {
    let proxy = FakeProxy::default();
    *proxy.successor.lock().unwrap() = Some("pod-b".to_owned());
    let starting = FamilyState {
        successor_starting: Some("pod-b".to_owned()),
        ..FamilyState::default()
    };
    proxy.set(
        ProxyPhase::Serving,
        vec![epoch(3, EpochState::Live)],
        Some(starting),
    );
    let h = start(proxy, config());
    h.signal(Intent::Terminate).await;
    h.state(|s| matches!(s, AgentState::HandingOver { .. }))
        .await;
    // The successor's pre-flight failed; its heartbeat is gone.
    h.proxy.set(
        ProxyPhase::Serving,
        vec![epoch(3, EpochState::Live)],
        Some(FamilyState::default()),
    );
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
    assert_eq!(
        proxy.calls(),
        [
            Call::Successor,
            Call::Drain { skip_exit: false },
            Call::Stop
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_handover_wait_is_bounded() {
    let proxy = FakeProxy::default();
    *proxy.successor.lock().unwrap() = Some("pod-b".to_owned());
    proxy.set(
        ProxyPhase::HandedOver,
        vec![epoch(3, EpochState::Draining)],
        Some(FamilyState::default()),
    );
    let mut c = config();
    c.handover_timeout = Duration::from_secs(40);
    let h = start(proxy, c);
    h.signal(Intent::Terminate).await;
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::HandoverTimedOut);
    assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 40);
}

#[tokio::test(start_paused = true)]
async fn exit_on_zero_waits_for_a_draining_parent() {
    // A count of zero while a hot-restart parent still drains its own connections is not
    // zero yet: the fake has no admin, so the counts fail; with the parent gone, the
    // budget ends the wait. Here the check is on the decision input: a parent draining.
    let state = ProxyState {
        epochs: vec![epoch(1, EpochState::Draining), epoch(2, EpochState::Live)],
        ..ProxyState::starting()
    };
    assert!(state.parent_draining());
    let state = ProxyState {
        epochs: vec![epoch(2, EpochState::Live)],
        ..ProxyState::starting()
    };
    assert!(!state.parent_draining());
}

fn recovering(limit: u32) -> AgentConfig {
    AgentConfig {
        crash_recovery: Some(CrashRecovery {
            limit,
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(3),
            stable_after: Duration::from_secs(60),
        }),
        ..config()
    }
}

impl Harness {
    /// Waits until the proxy has been run `n` times, and returns when each run started.
    async fn runs(&self, n: usize) -> Vec<Instant> {
        while self.proxy.runs().len() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.proxy.runs()
    }

    fn crashes(&self) -> Crashes {
        self.handle.status().borrow().crashes.clone()
    }
}

#[tokio::test(start_paused = true)]
async fn a_crash_loop_backs_off_exponentially_and_gives_up_at_the_limit() {
    let h = start(FakeProxy::default(), recovering(3));
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.proxy.end_with(Ended::Exited(crate::testing::killed(9)));
    h.state(|s| matches!(s, AgentState::Recovering { attempt: 1, .. }))
        .await;
    assert!(!h.handle.status().borrow().agent.serving(), "not ready");
    let answer = h.handle.hot_restart("x".to_owned()).await.unwrap_err();
    assert!(
        matches!(&answer, AgentError::Restart(RestartError::Refused(m)) if m.contains("recovering")),
        "{answer}"
    );
    // Every restart fails to start.
    for n in 2..=4 {
        h.runs(n).await;
        h.proxy.end_with(Ended::StartFailed {
            code: 1,
            message: "bad config".to_owned(),
        });
    }
    let status = h.handle.status();
    let (exit, proxy, started) = h.exit().await;
    assert_eq!(exit.path, ExitPath::CrashLoop { code: 1 });
    assert_eq!(exit.code(), 1, "the last crash's code");
    let gaps: Vec<u64> = proxy
        .runs()
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs())
        .collect();
    assert_eq!(gaps, [1, 2, 3], "1 s doubling, capped at 3 s");
    assert_eq!(proxy.runs()[0], started);
    assert!(proxy.calls().is_empty(), "nothing was asked of envoy");
    let crashes = status.borrow().crashes.clone();
    assert_eq!((crashes.consecutive, crashes.total), (4, 4));
    let actions: Vec<&str> = crashes.recent.iter().map(|c| c.action.as_str()).collect();
    assert_eq!(actions, ["restart", "restart", "restart", "give_up"]);
    assert!(matches!(
        status.borrow().agent,
        AgentState::Exiting {
            path: ExitPath::CrashLoop { code: 1 },
            ..
        }
    ));
}

#[tokio::test(start_paused = true)]
async fn each_crash_is_in_the_status_with_its_code_signal_and_stderr() {
    let h = start(FakeProxy::default(), recovering(1));
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.proxy.end_with(Ended::Exited(crate::testing::killed(9)));
    h.runs(2).await;
    let crashes = h.crashes();
    assert_eq!((crashes.consecutive, crashes.total), (1, 1));
    let crash = &crashes.recent[0];
    assert_eq!((crash.code, crash.signal), (137, Some(9)));
    assert_eq!(crash.stderr_tail, "killed");
    assert_eq!(
        crash.action,
        CrashAction::Restart {
            attempt: 1,
            backoff: Duration::from_secs(1)
        }
    );
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.handle.quit(Via::Http).await.unwrap();
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::QuitQuitQuit(Via::Http));
    assert_eq!(
        proxy.calls(),
        [Call::Stop],
        "the restarted proxy was stopped"
    );
}

#[tokio::test(start_paused = true)]
async fn a_restart_that_stays_live_ends_the_streak() {
    let h = start(FakeProxy::default(), recovering(1));
    h.proxy.go_live();
    h.proxy.end_with(Ended::Exited(exit(139, false)));
    h.runs(2).await;
    h.proxy.go_live();
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert_eq!(h.crashes().consecutive, 0, "forgotten once stable");
    h.proxy.end_with(Ended::Exited(exit(139, false)));
    h.runs(3).await;
    assert_eq!(h.crashes().consecutive, 1);
    // Not stable this time: the next crash is over the limit.
    h.proxy.go_live();
    tokio::time::sleep(Duration::from_secs(59)).await;
    h.proxy.end_with(Ended::Exited(exit(139, false)));
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::CrashLoop { code: 139 });
    assert_eq!(proxy.runs().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn what_the_agent_asked_for_or_a_first_envoy_that_never_served_is_no_crash() {
    // Envoy exiting during the agent's own drain ends the agent, as without the flag.
    let h = start(FakeProxy::default(), recovering(5));
    h.proxy.go_live();
    h.signal(Intent::Terminate).await;
    h.state(AgentState::draining).await;
    h.proxy.end_with(Ended::Exited(crate::testing::killed(9)));
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::ProxyExited { code: 137 });
    assert_eq!(proxy.runs().len(), 1);

    // A bad bootstrap at start fails fast.
    let h = start(FakeProxy::default(), recovering(5));
    h.proxy.exit_on_its_own(1);
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::ProxyExited { code: 1 });
    assert_eq!(proxy.runs().len(), 1);

    // Envoy's own clean exit (its /quitquitquit) is not a crash either.
    let h = start(FakeProxy::default(), recovering(5));
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.proxy.exit_on_its_own(0);
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::ProxyExited { code: 0 });
    assert_eq!(proxy.runs().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_stop_during_the_backoff_exits_at_once_and_starts_nothing() {
    let h = start(FakeProxy::default(), recovering(5));
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.proxy.end_with(Ended::Lost {
        exit: exit(0, false),
        message: "terminated from outside".to_owned(),
    });
    h.state(|s| matches!(s, AgentState::Recovering { .. }))
        .await;
    let drain = h.handle.drain_now(Via::Http).await.unwrap_err();
    assert!(matches!(drain, AgentError::DrainFailed(_)), "{drain}");
    let before = Instant::now();
    h.signal(Intent::Terminate).await;
    let (exit, proxy, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::StoppedWhileRecovering);
    assert_eq!(exit.code(), 0);
    assert_eq!(Instant::now(), before, "at once");
    assert_eq!(proxy.runs().len(), 1);
    assert!(proxy.calls().is_empty());
}

#[tokio::test(start_paused = true)]
async fn state_goes_exiting_with_the_path() {
    let h = start(FakeProxy::default(), config());
    let mut status = h.handle.status();
    h.handle.quit(Via::Http).await.unwrap();
    let (exit, _, _) = h.exit().await;
    assert_eq!(exit.path, ExitPath::QuitQuitQuit(Via::Http));
    status.changed().await.ok();
    assert!(matches!(
        status.borrow().agent,
        AgentState::Exiting {
            path: ExitPath::QuitQuitQuit(Via::Http),
            ..
        }
    ));
}

/// Readiness follows the serving Envoy's answers, whichever proxy publishes them: a silent one
/// is not ready and says why, while the agent stays live (nothing is decided yet); its answers
/// make it ready again.
#[tokio::test(start_paused = true)]
async fn a_silent_serving_envoy_is_not_ready_until_it_answers_again() {
    use envoy_agent_proxy::AdminHealth;
    let h = start(FakeProxy::default(), config());
    h.proxy.go_live();
    h.proxy
        .state
        .send_modify(|s| s.config = envoy_agent_proxy::ConfigStatus::Static);
    let mut status = h.handle.status();
    status.wait_for(Status::ready).await.unwrap();
    let since = std::time::SystemTime::now() - Duration::from_secs(4);
    h.proxy
        .state
        .send_modify(|s| s.admin = AdminHealth::Silent { since });
    let silent = status.wait_for(|s| !s.ready()).await.unwrap().clone();
    assert!(silent.agent.serving(), "still live: {:?}", silent.agent);
    let why = silent.proxy.ready().unwrap_err().to_string();
    assert_eq!(why, "envoy's admin API has not answered for 4s");
    h.proxy
        .state
        .send_modify(|s| s.admin = AdminHealth::Answering);
    status.wait_for(Status::ready).await.unwrap();
    h.signal(Intent::Terminate).await;
    let (exit, ..) = h.exit().await;
    assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
}

/// A wedge ends an agent the same way whichever proxy judged it (a sidecar's Envoy or a
/// family): exit 75 with exit path `wedged`; with crash recovery, after it served, a restart
/// recorded as a crash of kind `wedged`.
#[tokio::test(start_paused = true)]
async fn a_wedge_exits_75_or_is_recovered_as_a_crash_of_kind_wedged() {
    let wedged = || Ended::Wedged {
        reason: envoy_agent_proxy::WedgeReason::AdminUnresponsive,
        message: "envoy admin silent for 4.1s (deadline 4s)".to_owned(),
    };
    let h = start(FakeProxy::default(), config());
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.proxy.end_with(wedged());
    let (exit, ..) = h.exit().await;
    assert_eq!(exit.path.name(), "wedged");
    assert_eq!(exit.code(), 75);

    let h = start(FakeProxy::default(), recovering(3));
    h.proxy.go_live();
    h.state(AgentState::serving).await;
    h.proxy.end_with(wedged());
    h.runs(2).await;
    let crashes = h.crashes();
    let crash = &crashes.recent[0];
    assert_eq!((crash.kind.as_str(), crash.code), ("wedged", 75));
    assert_eq!(crash.action.as_str(), "restart");
    h.signal(Intent::Terminate).await;
    h.exit().await;
}

//! The watchdog of the serving Envoy's admin API, one set of rules for both modes: readiness
//! follows fresh answers, and an Envoy silent past the unresponsive deadline is wedged.
//!
//! A stopped, deadlocked or starved Envoy accepts connections (the kernel does) and answers
//! nothing, on its admin API as on its listeners. Without a question now and then the agent
//! would go on reporting it ready. So the serving Envoy is asked `/ready` about once a second
//! ([`CHECK_POLL`], paced by what an answer costs, on a kept connection: a question, not a
//! connection, a second):
//!
//! - silent for [`stale_after`] (3 s, half the deadline when that is shorter): readiness turns
//!   503 and names the silence, until an answer comes back;
//! - a check sent once the deadline had passed and unanswered too: wedged ([`judge`]). Only a
//!   check sent after the deadline decides: one sent before it and answered late (the agent
//!   itself stalled) is not the fresh fact that stopping Envoy needs.
//!
//! [`crate::Envoy`] runs `watch` (below); the hot-restart supervisor runs its own loop (its
//! checks also look for a successor pod's takeover) and judges with the same [`judge`].

use std::future::Future;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::admin::{AdminError, IDLE_SHARE, paced};
use crate::state::AdminHealth;

/// How long the serving Envoy's admin API may stay silent before readiness turns 503: a few
/// missed checks, well under the unresponsive deadline (30 s by default), so that a load
/// balancer stops sending to a hung Envoy long before it is stopped.
pub const STALE_AFTER: Duration = Duration::from_secs(3);
/// How often the serving Envoy is asked while it answers (at least; see [`paced`]).
pub const CHECK_POLL: Duration = Duration::from_secs(1);
/// Bound on one check. `/ready` is a few bytes whatever the config's size: an Envoy that has
/// not answered it in this long is not answering.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a silence makes readiness stale under `deadline`: [`STALE_AFTER`], or half the
/// deadline when that is shorter (so that the staleness is seen before the wedge).
pub fn stale_after(deadline: Duration) -> Duration {
    STALE_AFTER.min(deadline / 2)
}

/// What an unanswered check means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Silence {
    /// Too short to mean anything yet.
    Brief,
    /// Longer than [`stale_after`]: not ready.
    Stale,
    /// A check sent once the deadline had passed went unanswered too: wedged.
    Wedged,
}

/// What a check sent at `sent` and unanswered at `now` (failed, or timed out) means, when the
/// admin API last answered at `last_answer` and may stay silent for `deadline`.
pub fn judge(last_answer: Instant, sent: Instant, now: Instant, deadline: Duration) -> Silence {
    if sent.saturating_duration_since(last_answer) >= deadline {
        Silence::Wedged
    } else if now.saturating_duration_since(last_answer) >= stale_after(deadline) {
        Silence::Stale
    } else {
        Silence::Brief
    }
}

/// The pause after an answer that took `took`: paced by what answers cost, but never past
/// half the deadline, so that a wedge is still seen within it. An answer that took long may
/// not have cost Envoy anything: the agent itself was stopped or starved while it waited
/// (the soak stopped a sidecar's agent for 7 s: paced alone, its watchdog then paused 700 s
/// and never saw the wedge that followed).
fn pause_after(took: Duration, deadline: Duration) -> Duration {
    paced(CHECK_POLL, took, IDLE_SHARE).min((deadline / 2).max(CHECK_POLL))
}

/// Asks the serving Envoy (`check`: one `/ready`) until it is judged wedged, then resolves with
/// what happened; `publish` gets its [`AdminHealth`] each time it changes. Starts right after
/// an answer (LIVE).
pub(crate) async fn watch<F, Fut>(
    mut check: F,
    deadline: Duration,
    mut publish: impl FnMut(AdminHealth),
) -> String
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), AdminError>>,
{
    let mut last_answer = (Instant::now(), SystemTime::now());
    let mut health = AdminHealth::Answering;
    loop {
        let sent = Instant::now();
        let error = match tokio::time::timeout(CHECK_TIMEOUT, check()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) if e.is_local_resource() => {
                // Nothing reached Envoy: nothing is known of it, so it does not count.
                tracing::error!(event = "agent_resources", error = %e, "the agent itself is out of a resource: cannot check envoy's admin (not counted as envoy being silent)");
                tokio::time::sleep_until(sent + CHECK_POLL).await;
                continue;
            }
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer to /ready within {CHECK_TIMEOUT:?}")),
        };
        let now = Instant::now();
        let Some(error) = error else {
            if let AdminHealth::Silent { .. } = health {
                tracing::info!(
                    event = "admin_answering",
                    silent_for_ms = (now - last_answer.0).as_millis() as u64,
                    "envoy's admin API answers again"
                );
                health = AdminHealth::Answering;
                publish(health);
            }
            last_answer = (now, SystemTime::now());
            tokio::time::sleep_until(sent + pause_after(now - sent, deadline)).await;
            continue;
        };
        let silent = now - last_answer.0;
        match judge(last_answer.0, sent, now, deadline) {
            Silence::Wedged => {
                return format!(
                    "envoy admin silent for {silent:?} (deadline {deadline:?}): {error}"
                );
            }
            Silence::Stale if health == AdminHealth::Answering => {
                tracing::warn!(
                    event = "admin_silent",
                    silent_for_ms = silent.as_millis() as u64,
                    deadline_ms = deadline.as_millis() as u64,
                    error = %error,
                    "envoy's admin API does not answer: not ready"
                );
                health = AdminHealth::Silent {
                    since: last_answer.1,
                };
                publish(health);
            }
            Silence::Stale | Silence::Brief => {
                tracing::debug!(error = %error, silent_for = ?silent, "envoy admin not answering");
            }
        }
        // A silence is followed closely: the next check goes out a poll after this one was
        // sent, or at once when it took longer.
        tokio::time::sleep_until((sent + CHECK_POLL).max(now)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use super::*;

    const DEADLINE: Duration = Duration::from_secs(10);

    #[test]
    fn judge_stale_after_a_few_seconds_and_wedged_only_by_a_check_sent_after_the_deadline() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let judged = |sent: u64, now: u64| judge(t0, t0 + s(sent), t0 + s(now), DEADLINE);
        assert_eq!(judged(1, 2), Silence::Brief);
        assert_eq!(judged(2, 3), Silence::Stale, "3 s without an answer");
        assert_eq!(
            judged(9, 20),
            Silence::Stale,
            "sent before the deadline, unanswered long after it: the agent may have stalled"
        );
        assert_eq!(judged(10, 11), Silence::Wedged);
        // A short deadline: staleness at half of it, before the wedge.
        assert_eq!(stale_after(Duration::from_secs(4)), s(2));
        assert_eq!(stale_after(Duration::from_secs(30)), STALE_AFTER);
        assert_eq!(judge(t0, t0 + s(1), t0 + s(2), s(4)), Silence::Stale);
    }

    /// A fake Envoy whose admin answers at once while `answering`, never otherwise.
    fn fake(answering: &Arc<AtomicBool>) -> impl FnMut() -> BoxedCheck {
        let answering = answering.clone();
        move || {
            let now = answering.load(Ordering::SeqCst);
            Box::pin(async move {
                if now {
                    Ok(())
                } else {
                    std::future::pending().await
                }
            })
        }
    }

    type BoxedCheck = std::pin::Pin<Box<dyn Future<Output = Result<(), AdminError>> + Send>>;

    /// What was published, with when (from the start).
    type Published = Arc<Mutex<Vec<(Duration, AdminHealth)>>>;

    fn recorder(start: Instant) -> (Published, impl FnMut(AdminHealth)) {
        let published: Published = Arc::default();
        let sink = published.clone();
        (published, move |h| {
            sink.lock().unwrap().push((start.elapsed(), h));
        })
    }

    #[tokio::test(start_paused = true)]
    async fn an_answering_envoy_stays_ready_and_is_never_wedged() {
        let answering = Arc::new(AtomicBool::new(true));
        let (published, publish) = recorder(Instant::now());
        let watching = watch(fake(&answering), DEADLINE, publish);
        assert!(
            tokio::time::timeout(Duration::from_secs(600), watching)
                .await
                .is_err()
        );
        assert!(published.lock().unwrap().is_empty());
    }

    /// An answer that came after the agent's own stall (its clock jumped while the check
    /// waited) does not pause the watchdog past half the deadline: the wedge that follows is
    /// seen within it.
    #[tokio::test(start_paused = true)]
    async fn an_answer_after_the_agents_own_stall_does_not_blind_the_watchdog() {
        let start = Instant::now();
        let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let check = {
            let calls = calls.clone();
            move || -> BoxedCheck {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                Box::pin(async move {
                    match n {
                        // The agent stopped for 7 s with this check in flight; it answers.
                        0 => {
                            tokio::time::advance(Duration::from_secs(7)).await;
                            Ok(())
                        }
                        // Then Envoy is wedged.
                        _ => std::future::pending().await,
                    }
                })
            }
        };
        let (_, publish) = recorder(start);
        let message =
            tokio::time::timeout(Duration::from_secs(600), watch(check, DEADLINE, publish))
                .await
                .expect("the wedge is seen, not 700 s later");
        assert!(message.contains("admin silent"), "{message}");
        // The answer at 7 s, a pause of at most half the deadline, then the deadline.
        let wedged_at = start.elapsed();
        assert!(
            wedged_at <= Duration::from_secs(7) + DEADLINE / 2 + DEADLINE + CHECK_TIMEOUT,
            "{wedged_at:?}"
        );
        assert_eq!(pause_after(Duration::from_millis(5), DEADLINE), CHECK_POLL);
        assert_eq!(pause_after(Duration::from_secs(7), DEADLINE), DEADLINE / 2);
        assert_eq!(
            pause_after(Duration::from_secs(7), Duration::from_secs(1)),
            CHECK_POLL
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_envoy_turns_stale_then_wedged() {
        let start = Instant::now();
        let answering = Arc::new(AtomicBool::new(true));
        let (published, publish) = recorder(start);
        let stop = answering.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(20)).await;
            stop.store(false, Ordering::SeqCst);
        });
        let message = watch(fake(&answering), DEADLINE, publish).await;
        let wedged_at = start.elapsed();
        assert!(message.contains("admin silent"), "{message}");
        // Silent from ~20 s: wedged by the first check sent 10 s after its last answer.
        assert!(
            wedged_at >= Duration::from_secs(30) && wedged_at <= Duration::from_secs(32),
            "{wedged_at:?}"
        );
        let published = published.lock().unwrap().clone();
        assert_eq!(published.len(), 1, "{published:?}");
        let (at, health) = published[0];
        assert!(matches!(health, AdminHealth::Silent { .. }), "{health:?}");
        assert!(
            at >= Duration::from_secs(22) && at <= Duration::from_secs(24),
            "stale within a few seconds: {at:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_envoy_that_answers_again_is_ready_again_and_not_wedged() {
        let start = Instant::now();
        let answering = Arc::new(AtomicBool::new(false));
        let (published, publish) = recorder(start);
        let back = answering.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(6)).await;
            back.store(true, Ordering::SeqCst);
        });
        let watching = watch(fake(&answering), DEADLINE, publish);
        assert!(
            tokio::time::timeout(Duration::from_secs(120), watching)
                .await
                .is_err(),
            "not wedged"
        );
        let published: Vec<AdminHealth> =
            published.lock().unwrap().iter().map(|(_, h)| *h).collect();
        assert_eq!(published.len(), 2, "{published:?}");
        assert!(matches!(published[0], AdminHealth::Silent { .. }));
        assert_eq!(published[1], AdminHealth::Answering);
    }
}

//! Crash recovery in place (`--restart-on-crash`): when the serving Envoy dies without the
//! agent asking, the agent starts a fresh one after a back-off instead of exiting and leaving
//! the restart to the kubelet's (or systemd's) back-off, so its status server, gRPC API and
//! metrics stay up and the crash is reported where it happened.
//!
//! # Theory of operation
//!
//! - **What a crash is.** The proxy's run ended on its own while the agent ran it (not
//!   draining, handing over or stopping: those ends are the agent's own doing) after it had
//!   served at least once: an Envoy that exited non-zero or was killed by a signal
//!   ([`Ended::Exited`]), a hot-restart family whose serving epoch died with nothing else
//!   serving ([`Ended::Lost`], exit 0 included: something outside terminated it), or a
//!   restart that failed to start ([`Ended::StartFailed`]), or a family the watchdog judged
//!   wedged and stopped ([`Ended::Wedged`]: without the flag, exit 75 for a restart from
//!   outside; with it, recovered in place like a crash, its reason kept as the crash's
//!   message). Not a crash: a single Envoy's clean exit 0 (its own `/quitquitquit`: someone
//!   asked it), a first Envoy (family) that never served (a bad bootstrap fails the agent at
//!   once, as without the flag; a first family wedged before it served exits 75).
//! - **What a restart is.** The proxy's `run` again: one fresh Envoy, or a fresh hot-restart
//!   family (discovery on the node, then a cold epoch 0, which recreates the shared memory
//!   the crashed one left; under the other base id when the crashed family's draining parent
//!   was kept to finish its in-flight requests, see the hot-restart crate's
//!   `supervisor::kept`). Nothing new runs during the back-off: readiness answers 503, gRPC
//!   health is NOT_SERVING, a node proxy's readiness marker and heartbeat are gone.
//! - **Back-off and limit.** The n-th crash in a row waits `backoff * 2^(n-1)`, at most
//!   `backoff_max`. The crash after `limit` restarts in a row ends the agent with that crash's
//!   code ([`CrashAction::GiveUp`]; exit path `crash_loop`), so an orchestrator still sees a
//!   crash loop. A restarted Envoy that stays LIVE for `stable_after` ends the streak.
//! - **Reports.** Each crash (exit code, signal, the end of Envoy's stderr, what the agent
//!   does about it) is kept in the status (the last [`CRASHES_KEPT`]), logged as
//!   `event="envoy_crashed"` and counted (`envoy_agent.envoy.crashes`).
//!
//! The decisions are the pure [`decide`] and [`crash_of`]; the agent keeps their inputs (the
//! streak, whether and since when the proxy served) between crashes.

use std::time::{Duration, SystemTime};

use envoy_agent_proxy::Ended;
use tokio::time::Instant;

/// Crashes kept in the status.
pub const CRASHES_KEPT: usize = 16;
/// The end of an Envoy's stderr kept with a crash, at most.
pub const STDERR_TAIL_KEPT: usize = 2048;

/// Crash recovery's settings ([`Default`]: the flags' defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CrashRecovery {
    /// Restarts in a row before the agent gives up (`--crash-restart-limit`).
    pub limit: u32,
    /// The first back-off; each next one doubles.
    pub backoff: Duration,
    /// The longest back-off (`--crash-backoff-max`).
    pub backoff_max: Duration,
    /// How long a restarted Envoy must stay LIVE for its crashes to be forgotten.
    pub stable_after: Duration,
}

impl Default for CrashRecovery {
    fn default() -> Self {
        CrashRecovery {
            limit: 5,
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
            stable_after: Duration::from_secs(60),
        }
    }
}

impl CrashRecovery {
    /// The back-off before restart number `attempt` (1 for the first).
    pub fn backoff_for(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.backoff
            .checked_mul(1 << doublings)
            .unwrap_or(self.backoff_max)
            .min(self.backoff_max)
    }
}

/// How the proxy's run ended when it crashed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashKind {
    /// The serving Envoy exited non-zero or was killed by a signal.
    Exited,
    /// Hot restart: the serving epoch died with nothing else serving.
    Lost,
    /// A restart never served.
    StartFailed,
    /// Hot restart: the family was judged wedged (its admin silent past its deadline, a
    /// stale INITIALIZING flag) and stopped; the agent would exit 75.
    Wedged,
    /// The serving Envoy was OOM-killed (SIGKILL, its container's OOM-kill count risen).
    OomKilled,
}

impl CrashKind {
    /// `exited`, `lost`, `start_failed`, `wedged`.
    pub fn as_str(self) -> &'static str {
        match self {
            CrashKind::Exited => "exited",
            CrashKind::Lost => "lost",
            CrashKind::StartFailed => "start_failed",
            CrashKind::Wedged => "wedged",
            CrashKind::OomKilled => "oom_killed",
        }
    }
}

/// What the agent did about a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashAction {
    /// Restart number `attempt` in a row, after `backoff`.
    Restart {
        /// 1 for the first restart of a streak.
        attempt: u32,
        /// How long nothing runs before it.
        backoff: Duration,
    },
    /// The limit was reached: the agent exits with the crash's code.
    GiveUp,
}

impl CrashAction {
    /// `restart`, `give_up` (the metric's attribute).
    pub fn as_str(self) -> &'static str {
        match self {
            CrashAction::Restart { .. } => "restart",
            CrashAction::GiveUp => "give_up",
        }
    }
}

/// One crash, as the status reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crash {
    /// When the agent saw it.
    pub at: SystemTime,
    /// How the run ended.
    pub kind: CrashKind,
    /// The crashed Envoy's restart epoch and pid, when one ran.
    pub process: Option<(u32, u32)>,
    /// The code the agent would exit with (Envoy's, 128+N for signal N; never 0).
    pub code: u8,
    /// The signal that killed Envoy, when one did.
    pub signal: Option<i32>,
    /// How long it ran, when known.
    pub ran_for: Option<Duration>,
    /// The end of its stderr (or the failed start's reason), at most [`STDERR_TAIL_KEPT`].
    pub stderr_tail: String,
    /// What the agent did.
    pub action: CrashAction,
}

/// Crash recovery as the status shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Crashes {
    /// Its settings; `None`: off (a crash ends the agent).
    pub recovery: Option<CrashRecovery>,
    /// Crashes in the current streak (0 once a restarted Envoy stayed LIVE long enough).
    pub consecutive: u32,
    /// Crashes since the agent started.
    pub total: u64,
    /// The last [`CRASHES_KEPT`], oldest first.
    pub recent: Vec<Crash>,
}

/// A crash, if the run's end is one, for an agent that ran the proxy (not stopping it).
/// `served`: whether the proxy has served since the agent started. The action is filled in
/// by [`decide`].
pub fn crash_of(ended: &Ended, served: bool) -> Option<Crash> {
    use std::os::unix::process::ExitStatusExt;
    if !served {
        return None;
    }
    let (kind, exit) = match ended {
        Ended::Exited(exit) | Ended::Lost { exit, .. } if exit.oom.is_some() => {
            (CrashKind::OomKilled, exit)
        }
        Ended::Exited(exit) if exit.code() != 0 => (CrashKind::Exited, exit),
        Ended::Lost { exit, .. } => (CrashKind::Lost, exit),
        Ended::StartFailed { message, .. } | Ended::Wedged { message, .. } => {
            return Some(Crash {
                at: SystemTime::now(),
                kind: match ended {
                    Ended::Wedged { .. } => CrashKind::Wedged,
                    _ => CrashKind::StartFailed,
                },
                process: None,
                code: ended.code(),
                signal: None,
                ran_for: None,
                stderr_tail: tail(message),
                action: CrashAction::GiveUp,
            });
        }
        _ => return None,
    };
    Some(Crash {
        at: SystemTime::now(),
        kind,
        process: Some((exit.epoch, exit.pid)),
        code: ended.code(),
        signal: exit.status.signal(),
        ran_for: Some(exit.ran_for),
        stderr_tail: tail(&exit.stderr_tail),
        action: CrashAction::GiveUp,
    })
}

/// The decision on a crash: the streak's new length and what to do. `consecutive`: crashes
/// in the streak before this one; `live_for`: how long the proxy had been LIVE when it
/// crashed (a stable run ends the streak first).
pub fn decide(
    recovery: &CrashRecovery,
    consecutive: u32,
    live_for: Option<Duration>,
) -> (u32, CrashAction) {
    let before = match live_for {
        Some(d) if d >= recovery.stable_after => 0,
        _ => consecutive,
    };
    let attempt = before.saturating_add(1);
    if attempt > recovery.limit {
        return (attempt, CrashAction::GiveUp);
    }
    (
        attempt,
        CrashAction::Restart {
            attempt,
            backoff: recovery.backoff_for(attempt),
        },
    )
}

/// The end of `text`, at most [`STDERR_TAIL_KEPT`] bytes, cut at a line (or char) boundary.
fn tail(text: &str) -> String {
    let text = text.trim_end();
    if text.len() <= STDERR_TAIL_KEPT {
        return text.to_owned();
    }
    let mut start = text.len() - STDERR_TAIL_KEPT;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let cut = &text[start..];
    match cut.find('\n') {
        Some(i) if i + 1 < cut.len() => cut[i + 1..].to_owned(),
        _ => cut.to_owned(),
    }
}

/// What crash recovery remembers between crashes: whether the proxy ever served, the
/// streak, and since when the proxy has been LIVE.
#[derive(Debug, Default)]
pub(crate) struct CrashLoop {
    served: bool,
    live_since: Option<Instant>,
    shown: Crashes,
}

impl CrashLoop {
    pub(crate) fn new(recovery: Option<CrashRecovery>) -> Self {
        CrashLoop {
            shown: Crashes {
                recovery,
                ..Crashes::default()
            },
            ..CrashLoop::default()
        }
    }

    /// What the status shows.
    pub(crate) fn crashes(&self) -> &Crashes {
        &self.shown
    }

    /// The proxy serves (or not) at `now`. A streak ends once a restart has served for
    /// `stable_after`.
    pub(crate) fn observe(&mut self, serving: bool, now: Instant) {
        if !serving {
            self.live_since = None;
            return;
        }
        self.served = true;
        let since = *self.live_since.get_or_insert(now);
        if let Some(r) = &self.shown.recovery {
            if self.shown.consecutive > 0 && now - since >= r.stable_after {
                tracing::info!(
                    event = "crash_streak_ended",
                    crashes = self.shown.consecutive,
                    stable_for = ?r.stable_after,
                    "envoy has stayed LIVE: its earlier crashes no longer count toward the limit"
                );
                self.shown.consecutive = 0;
            }
        }
    }

    /// When the streak ends if the proxy stays LIVE (a wake-up for [`CrashLoop::observe`]).
    pub(crate) fn streak_ends_at(&self) -> Option<Instant> {
        let r = self.shown.recovery.as_ref()?;
        (self.shown.consecutive > 0)
            .then_some(self.live_since)
            .flatten()
            .map(|t| t + r.stable_after)
    }

    /// The run ended with `ended` at `now` while the agent ran the proxy: the crash and its
    /// decision, recorded, if it is one and recovery is on.
    pub(crate) fn on_end(&mut self, ended: &Ended, now: Instant) -> Option<Crash> {
        let recovery = self.shown.recovery?;
        let mut crash = crash_of(ended, self.served)?;
        let live_for = self.live_since.take().map(|t| now - t);
        let (consecutive, action) = decide(&recovery, self.shown.consecutive, live_for);
        crash.action = action;
        self.shown.consecutive = consecutive;
        self.shown.total += 1;
        self.shown.recent.push(crash.clone());
        let excess = self.shown.recent.len().saturating_sub(CRASHES_KEPT);
        self.shown.recent.drain(..excess);
        Some(crash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::exit;

    fn recovery() -> CrashRecovery {
        CrashRecovery {
            limit: 4,
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(5),
            stable_after: Duration::from_secs(60),
        }
    }

    #[test]
    fn the_backoff_doubles_up_to_its_cap_and_the_limit_gives_up() {
        let r = recovery();
        let mut consecutive = 0;
        let mut actions = Vec::new();
        for _ in 0..5 {
            let (n, action) = decide(&r, consecutive, Some(Duration::from_secs(1)));
            consecutive = n;
            actions.push(action);
        }
        let secs = |attempt, s| CrashAction::Restart {
            attempt,
            backoff: Duration::from_secs(s),
        };
        assert_eq!(
            actions,
            [
                secs(1, 1),
                secs(2, 2),
                secs(3, 4),
                secs(4, 5),
                CrashAction::GiveUp
            ]
        );
        assert_eq!(r.backoff_for(40), r.backoff_max, "no overflow");
    }

    #[test]
    fn a_stable_run_starts_the_streak_over() {
        let r = recovery();
        let (n, action) = decide(&r, 4, Some(Duration::from_secs(60)));
        assert_eq!((n, action.as_str()), (1, "restart"));
        let (n, action) = decide(&r, 4, Some(Duration::from_secs(59)));
        assert_eq!((n, action), (5, CrashAction::GiveUp));
        let (_, action) = decide(&r, 4, None);
        assert_eq!(action, CrashAction::GiveUp, "never LIVE: still the streak");
    }

    #[test]
    fn only_unasked_ends_after_serving_are_crashes() {
        let crashed = Ended::Exited(exit(139, false));
        assert!(
            crash_of(&crashed, false).is_none(),
            "never served: as today"
        );
        let crash = crash_of(&crashed, true).unwrap();
        assert_eq!((crash.kind, crash.code), (CrashKind::Exited, 139));
        // Issue 50: a SIGKILL the OOM killer sent is named as one; a plain one is not.
        let killed = crate::testing::killed(9);
        let oom = envoy_agent_proxy::Exit {
            oom: Some(envoy_agent_proxy::OomKill {
                limit: Some(160 << 20),
            }),
            ..killed.clone()
        };
        let crash = crash_of(&Ended::Exited(oom), true).unwrap();
        assert_eq!((crash.kind.as_str(), crash.code), ("oom_killed", 137));
        let crash = crash_of(&Ended::Exited(killed), true).unwrap();
        assert_eq!((crash.kind.as_str(), crash.code), ("exited", 137));
        assert!(crash_of(&Ended::Exited(exit(0, false)), true).is_none());
        assert!(crash_of(&Ended::Stopped { last: None }, true).is_none());
        let wedged = Ended::Wedged {
            reason: envoy_agent_proxy::WedgeReason::AdminUnresponsive,
            message: String::new(),
        };
        assert!(crash_of(&wedged, false).is_none(), "never served: exit 75");
        // Issue 31: a family that served and was judged wedged is recovered like a crash.
        let crash = crash_of(&wedged, true).unwrap();
        assert_eq!((crash.kind, crash.code), (CrashKind::Wedged, 75));
        let lost = Ended::Lost {
            exit: exit(0, false),
            message: String::new(),
        };
        assert_eq!(crash_of(&lost, true).map(|c| c.code), Some(1));
        let failed = Ended::StartFailed {
            code: 1,
            message: "bad config".to_owned(),
        };
        let crash = crash_of(&failed, true).unwrap();
        assert_eq!(
            (crash.kind, crash.stderr_tail.as_str()),
            (CrashKind::StartFailed, "bad config")
        );
    }

    #[test]
    fn the_stderr_tail_is_bounded_at_a_line() {
        let long = format!("{}\nlast words\n", "x".repeat(5000));
        assert_eq!(tail(&long), "last words");
        let lines: String = (0..1000).map(|i| format!("line {i}\n")).collect();
        let t = tail(&lines);
        assert!(t.len() <= STDERR_TAIL_KEPT && t.starts_with("line ") && t.ends_with("line 999"));
    }
}

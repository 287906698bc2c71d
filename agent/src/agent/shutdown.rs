//! The shutdown drain's clock: one [`Shutdown`] per graceful shutdown (SIGTERM, SIGINT, gRPC
//! `Stop` with no successor pod taking over), holding the whole deadline rule and the calls it
//! has out.
//!
//! Its life, from the signal, on the timeline the operator set ([`crate::config::timeline`]):
//! readiness off (`--not-ready-at`); Envoy's health checks failing (`--healthcheck-fail-at`),
//! asked again each [`DRAIN_RETRY`] until Envoy accepts, never holding up anything else; the
//! drain request after the drain delay, sent again each [`DRAIN_RETRY`] until Envoy accepts
//! it; in exit-on-zero mode, counts from the minimum drain duration on, paced by their cost:
//! a whole count at most each [`WHOLE_COUNT_EVERY`] (the status's number), quick ones between
//! that only tell zero from not zero (the kernel's asks about one connection it found before);
//! the stop, at zero, at the deadline, or when counting fails too often. [`Shutdown::poll`]
//! says what is due at an instant; the actor makes the calls and reports them back
//! ([`Shutdown::drain_sent`], [`Shutdown::count_sent`], ...) and their answers
//! ([`Shutdown::drain_answered`], [`Shutdown::counted`], ...). Dropping a `Shutdown` drops its
//! calls (their connections close).

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use envoy_agent_drain::{Counting, DrainError, ListenerActivity, Pace, Tally};
use envoy_agent_proxy::listeners::{Direction, Listener};
use envoy_agent_proxy::{DrainOptions, DrainPlan, ProxyError};
use tokio::time::Instant;

use crate::config::defaults::{APP_LET_GO, APP_PROBE_EVERY};
use crate::config::timeline::HealthCheckFailAt;

use super::handle::{AgentError, Reply};
use super::state::{AgentConfig, AppWatch, DrainPhase, DrainProgress, DrainReason, ExitPath};

/// A call beside the loop, if one is out.
pub(super) type Pending<T> = Option<Pin<Box<dyn Future<Output = T> + Send>>>;

/// Awaits the future in `slot` and empties it, or never when there is none.
pub(super) async fn settle<T>(slot: &mut Pending<T>) -> T {
    let value = match slot {
        Some(future) => future.await,
        None => std::future::pending().await,
    };
    *slot = None;
    value
}

/// How long, at most, the failed health checks and the drain notice wait for a sidecar's app
/// rule to say whether the app holds outbound connections (it takes milliseconds: three admin calls
/// and one question to the kernel).
pub(super) const APP_DECIDE_WITHIN: Duration = Duration::from_millis(250);

/// How soon a failed drain request is sent again; and how long one may go unanswered before
/// the shutdown, ending meanwhile, reports that Envoy never accepted a drain.
pub(super) const DRAIN_RETRY: Duration = Duration::from_secs(1);

/// A count's answer: the count, how long it took, and how it paces the counts after it.
pub(super) struct Counted {
    pub(super) count: Result<u64, DrainError>,
    pub(super) took: Duration,
    pub(super) pace: Pace,
}

/// How often, at most, a whole count is taken while the quick ones tell zero from not zero
/// (the status's number is refreshed this often); its cost stretches it further, to
/// [`WHOLE_COUNT_SHARE`](envoy_agent_drain::count::WHOLE_COUNT_SHARE).
pub(super) const WHOLE_COUNT_EVERY: Duration = Duration::from_secs(2);

/// How often, at most, exit-on-zero reads what each listener holds (for the status; Envoy
/// visits every stat to answer, so the reading is also paced by its cost).
pub(super) const LISTENERS_POLL: Duration = Duration::from_secs(1);

/// A reading of what each counted listener holds: the listeners (or why not), how long it
/// took.
pub(super) struct ListenersRead {
    pub(super) listeners: Result<Vec<ListenerActivity>, DrainError>,
    pub(super) took: Duration,
}

/// What each listener holds, by the names the operator wrote and of the drained listeners
/// only, where the drain's plan knows them (a listener's stats are named by its stat prefix or
/// its address).
fn named(listeners: Vec<ListenerActivity>, plan: Option<&DrainPlan>) -> Vec<ListenerActivity> {
    let Some(plan) = plan.filter(|p| !p.listeners.is_empty()) else {
        return listeners;
    };
    listeners
        .into_iter()
        .filter(|l| plan.drained.iter().any(|d| d.stat_name == l.name))
        .map(|mut l| {
            if let Some(name) = plan.name_of(&l.name) {
                l.name = name.to_owned();
            }
            l
        })
        .collect()
}

/// What is due at an instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// Readiness goes off now (it is a function of time; this says so once).
    NotReady,
    /// Tell Envoy to fail its health checks.
    FailHealthChecks,
    /// Send the drain request.
    SendDrain,
    /// Count what exit-on-zero counts, as much as this says.
    Count(Tally),
    /// Read what each counted listener holds (exit-on-zero, for the status).
    ReadListeners,
    /// Read Envoy's listeners, for the outbound ones a sidecar's app calls out through.
    ReadOutbound,
    /// Ask the kernel whether the app holds a connection to an outbound listener's port.
    ProbeApp,
    /// Tell the drain notice, held while the app called out (a drain request's timeline,
    /// which does not stop when the app lets go).
    TellNotice,
    /// Stop Envoy: the drain is over, by this path.
    Stop(ExitPath),
    /// Nothing before this instant (none: before an answer comes).
    Wait(Option<Instant>),
}

/// An answer to one of the shutdown's calls.
pub(super) enum Answer {
    Drain(Result<DrainPlan, ProxyError>),
    HealthChecks(Result<(), ProxyError>),
    Count(Counted),
    Listeners(ListenersRead),
    /// Envoy's listeners (or why they could not be read).
    Outbound(Result<Vec<Listener>, String>),
    /// Whether the app holds a connection to an outbound listener.
    App(Result<bool, DrainError>),
}

/// How a timeline ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// Envoy is stopped (a signal, gRPC `Stop`).
    Stop,
    /// Envoy keeps serving, drained (a drain request: `/drain`, gRPC `Drain`); a signal that
    /// follows continues the timeline to the stop ([`Shutdown::continue_to_stop`]).
    KeepServing,
}

/// A sidecar's app rule (`--app-hold`): the app beside Envoy, as Envoy's outbound listeners
/// see it. The app calls out through them; while it holds a connection to one it is still at
/// work (it is shutting down), and Envoy keeps serving it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum App {
    /// Not watched: a node proxy, `--app-hold off`, no outbound listener, or they could not
    /// be read.
    Off,
    /// Envoy's listeners are to be read (`sent`: the reading is out).
    Reading { sent: bool },
    /// Watching the outbound listeners' `ports`.
    Watched {
        ports: BTreeSet<u16>,
        reaches: Reaches,
        seen: Seen,
    },
}

/// Which of the timeline's Envoy-wide steps would tell an outbound listener's clients to
/// close (measured on 1.40; docs/shutdown.md has the table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reaches {
    /// Failed health checks drain every `drain_type: DEFAULT` listener.
    health_checks: bool,
    /// The drain notice reaches every listener but those that bypass the overload manager.
    notice: bool,
}

/// What the app rule's probes saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Nothing asked yet: the Envoy-wide steps wait for the first answer.
    Unprobed,
    /// Never seen holding a connection: nothing is held for it.
    Never,
    /// Holding at the last probe.
    Holding,
    /// It held, and has held none since `since`.
    LetGo { since: Instant },
}

/// Where the shutdown's drain request to Envoy is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DrainAsk {
    /// It goes out at the shutdown's `drain_at`.
    Due,
    /// Out since `since`, not answered yet; `failed`: the last attempt's error, if this is
    /// a retry.
    InFlight {
        since: Instant,
        failed: Option<String>,
    },
    /// Envoy drains.
    Accepted,
    /// It failed (`error`): asked again at `retry_at`, until the deadline.
    Failed { error: String, retry_at: Instant },
}

impl DrainAsk {
    /// At the deadline, `now`: why Envoy is stopped without having accepted a drain, if it
    /// was asked and failed. A request just sent (a zero termination drain duration) is no
    /// failure: it is unanswered, not refused.
    fn failure(&self, now: Instant) -> Option<String> {
        match self {
            DrainAsk::Due | DrainAsk::Accepted => None,
            DrainAsk::Failed { error, .. }
            | DrainAsk::InFlight {
                failed: Some(error),
                ..
            } => Some(error.clone()),
            DrainAsk::InFlight {
                since,
                failed: None,
            } => (now.saturating_duration_since(*since) >= DRAIN_RETRY)
                .then(|| format!("no answer for {:?}", now.saturating_duration_since(*since))),
        }
    }
}

/// Where the shutdown's request that Envoy fail its health checks is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HealthAsk {
    /// It goes out at `at`.
    Due { at: Instant },
    /// Out, not answered yet.
    InFlight,
    /// Envoy fails its health checks.
    Accepted,
    /// It failed: asked again at `retry_at`.
    Failed { retry_at: Instant },
}

/// A shutdown drain under way.
pub(super) struct Shutdown {
    reason: DrainReason,
    /// The signal: the timeline's offsets count from here.
    began: Instant,
    /// Readiness is off from here on.
    not_ready_at: Instant,
    /// Whether [`Step::NotReady`] was given.
    not_ready_said: bool,
    /// Envoy's health checks; none: they never fail.
    health: Option<HealthAsk>,
    health_call: Pending<Result<(), ProxyError>>,
    /// When the drain request goes out (after the delay).
    drain_at: Instant,
    drain: DrainAsk,
    /// Exit-on-zero: what it counts; none without.
    counting: Option<Counting>,
    /// Exit-on-zero: counting starts here (the minimum drain duration after `drain_at`).
    count_from: Instant,
    next_count: Instant,
    /// When the next count is a whole one.
    next_whole: Instant,
    /// Exit-on-zero reached zero while the app still held Envoy: the stop waits for it.
    zero: Option<Counting>,
    /// What ends the timeline.
    ending: Ending,
    /// What the drain request asks.
    options: DrainOptions,
    /// A drain request's callers, answered once Envoy accepts the drain.
    replies: Vec<Reply<Option<DrainPlan>>>,
    /// A sidecar's app rule.
    app: App,
    /// The app rule holds nothing from here on (`--app-hold` after the signal).
    app_until: Instant,
    app_call: Pending<Result<bool, DrainError>>,
    outbound_call: Pending<Result<Vec<Listener>, String>>,
    next_probe: Instant,
    /// The connections the app's probes found, asked about again by the next.
    app_known: envoy_agent_drain::Known,
    /// The drain went without its notice (the app held Envoy): told once it lets go.
    notice_held: bool,
    app_errors: u32,
    /// The connections the quick counts found, asked about again by the next.
    known: envoy_agent_drain::Known,
    poll_interval: Duration,
    /// When Envoy is stopped at the latest; none in exit-on-zero mode when the termination
    /// drain duration is not longer than the minimum (Istio's: count until zero, no cap).
    deadline: Option<Instant>,
    stats_errors: u32,
    stats_error_budget: u32,
    /// The last count, if one succeeded.
    last_count: Option<u64>,
    /// What the status says of this drain.
    progress: DrainProgress,
    drain_call: Pending<Result<DrainPlan, ProxyError>>,
    count_call: Pending<Counted>,
    /// When the listeners are read next, and the reading out, if one is.
    next_listeners: Instant,
    listeners_call: Pending<ListenersRead>,
}

impl Shutdown {
    /// A shutdown for `reason`, begun at `now` (`wall`: the same on the wall clock).
    pub(super) fn begin(
        config: &AgentConfig,
        reason: DrainReason,
        now: Instant,
        wall: SystemTime,
    ) -> Shutdown {
        Shutdown::timeline(
            config,
            reason,
            Ending::Stop,
            DrainOptions::default(),
            now,
            wall,
        )
    }

    /// A drain request's timeline (`/drain`, gRPC `Drain`): the same steps as a shutdown's,
    /// ending with Envoy drained and serving; `reply` hears once Envoy accepts the drain.
    pub(super) fn begin_request(
        config: &AgentConfig,
        reason: DrainReason,
        options: DrainOptions,
        reply: Reply<Option<DrainPlan>>,
        now: Instant,
        wall: SystemTime,
    ) -> Shutdown {
        let mut s = Shutdown::timeline(config, reason, Ending::KeepServing, options, now, wall);
        s.replies.push(reply);
        s
    }

    fn timeline(
        config: &AgentConfig,
        reason: DrainReason,
        ending: Ending,
        options: DrainOptions,
        now: Instant,
        wall: SystemTime,
    ) -> Shutdown {
        let drain_at = now + config.drain_delay;
        let count_from = drain_at + config.minimum_drain_duration;
        let stops = ending == Ending::Stop;
        let deadline = config.drain_deadline().filter(|_| stops);
        let counting = config.exit_on_zero.filter(|_| stops);
        Shutdown {
            reason,
            began: now,
            not_ready_at: now + config.not_ready_at,
            not_ready_said: false,
            health: match config.fail_health_checks_at {
                HealthCheckFailAt::Off => None,
                HealthCheckFailAt::Drain => Some(HealthAsk::Due { at: drain_at }),
                HealthCheckFailAt::After(at) => Some(HealthAsk::Due { at: now + at }),
            },
            health_call: None,
            drain_at,
            drain: DrainAsk::Due,
            counting,
            count_from,
            next_count: count_from,
            next_whole: count_from,
            zero: None,
            ending,
            options,
            replies: Vec::new(),
            app: match config.app_hold {
                Some(_) => App::Reading { sent: false },
                None => App::Off,
            },
            app_until: now + config.app_hold.unwrap_or_default(),
            app_call: None,
            outbound_call: None,
            next_probe: now,
            app_known: envoy_agent_drain::Known::default(),
            notice_held: false,
            app_errors: 0,
            known: envoy_agent_drain::Known::default(),
            poll_interval: config.poll_interval,
            deadline: deadline.map(|d| drain_at + d),
            stats_errors: 0,
            stats_error_budget: config.stats_error_budget,
            last_count: None,
            progress: DrainProgress {
                reason,
                started: wall,
                deadline: deadline.map(|d| wall + config.drain_delay + d),
                counting,
                last_count: None,
                listeners: None,
                drained: None,
                app: config.app_hold.map(|_| AppWatch::Unknown),
                stops,
            },
            drain_call: None,
            count_call: None,
            // With exit-on-zero, from its first count; else from the drain.
            next_listeners: match counting {
                Some(_) => count_from,
                None => drain_at,
            },
            listeners_call: None,
        }
    }

    pub(super) fn reason(&self) -> DrainReason {
        self.reason
    }

    pub(super) fn progress(&self) -> &DrainProgress {
        &self.progress
    }

    /// How long after the signal `now` is.
    pub(super) fn offset(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.began)
    }

    /// Whether readiness is still on at `now` (`--not-ready-at` not reached).
    pub(super) fn ready(&self, now: Instant) -> bool {
        now < self.not_ready_at
    }

    /// Where the drain is at `now`: still in its delay until the request goes out.
    pub(super) fn phase(&self, now: Instant) -> DrainPhase {
        if self.drain != DrainAsk::Due || self.drain_at <= now {
            DrainPhase::Draining
        } else {
            DrainPhase::Delay
        }
    }

    /// What is due at `now`. The drain request goes out before a deadline at the same
    /// instant is judged, so that a zero termination drain duration stops on a request just
    /// sent (unanswered, not failed). A sidecar's Envoy-wide steps wait for the app rule's
    /// first answer, and those that would tell the app's outbound connections to close wait
    /// while it holds them.
    pub(super) fn poll(&self, now: Instant) -> Step {
        if !self.not_ready_said && self.not_ready_at <= now {
            return Step::NotReady;
        }
        if self.app == (App::Reading { sent: false }) {
            return Step::ReadOutbound;
        }
        // The app let go, or its hold ran out with the drain over: what was held for it is
        // not worth doing now.
        if self.app_seen() {
            if let Some(path) = self.due_stop(now) {
                return Step::Stop(path);
            }
        }
        // The first probe first: it decides what waits for the app (it costs one question to
        // the kernel).
        if self.first_probe_due(now) {
            return Step::ProbeApp;
        }
        let health_due = self.health_call.is_none()
            && !self.health_held(now)
            && match self.health {
                Some(HealthAsk::Due { at }) => at <= now,
                Some(HealthAsk::Failed { retry_at }) => retry_at <= now,
                Some(HealthAsk::InFlight | HealthAsk::Accepted) | None => false,
            };
        if health_due {
            return Step::FailHealthChecks;
        }
        // The drain itself never waits for the app rule (it is inbound-only); its notice does.
        let drain_due = self.drain_call.is_none()
            && match &self.drain {
                DrainAsk::Due => self.drain_at <= now,
                DrainAsk::Failed { retry_at, .. } => *retry_at <= now,
                DrainAsk::InFlight { .. } | DrainAsk::Accepted => false,
            };
        if drain_due {
            return Step::SendDrain;
        }
        if self.notice_held
            && self.drain == DrainAsk::Accepted
            && !self.app_undecided(now)
            && !self.app_holds(now)
        {
            return Step::TellNotice;
        }
        if let Some(path) = self.due_stop(now) {
            return Step::Stop(path);
        }
        if self.probe_due(now) {
            return Step::ProbeApp;
        }
        if self.count_due(now) {
            return Step::Count(if self.next_whole <= now {
                Tally::Whole
            } else {
                Tally::Any
            });
        }
        if self.listeners_due(now) {
            return Step::ReadListeners;
        }
        Step::Wait(self.next_wake(now))
    }

    /// Whether the timeline has come to the stop at `now`, and by which path. The app
    /// letting go ends it at once; the drain's own end (zero, the deadline) waits while the
    /// app holds Envoy, until `--app-hold` runs out.
    fn due_stop(&self, now: Instant) -> Option<ExitPath> {
        if self.ending != Ending::Stop {
            return None;
        }
        if self.app_let_go(now) {
            return Some(ExitPath::AppDone);
        }
        let over = match (self.zero, self.deadline) {
            (Some(what), _) => ExitPath::ZeroActive(what),
            (None, Some(d)) if d <= now => {
                // Never claim a drain that Envoy did not accept, nor that anything remained
                // unless it was counted.
                match (self.drain.failure(now), self.counting, self.last_count) {
                    (Some(_), ..) => ExitPath::DrainFailed,
                    (None, Some(what), Some(n)) if n > 0 => ExitPath::DrainDeadline(what),
                    _ => ExitPath::DrainTimeElapsed,
                }
            }
            _ => return None,
        };
        if self.app_holds(now) {
            return None;
        }
        if self.app_seen() && self.app_until <= now {
            return Some(ExitPath::AppHoldElapsed);
        }
        Some(over)
    }

    fn count_due(&self, now: Instant) -> bool {
        self.counting.is_some()
            && self.zero.is_none()
            && self.drain != DrainAsk::Due
            && self.count_call.is_none()
            && self.count_from.max(self.next_count) <= now
    }

    /// The app rule has not answered yet: the health checks and the drain notice wait for it,
    /// for [`APP_DECIDE_WITHIN`] at most (an admin API that does not answer must not hold
    /// them).
    fn app_undecided(&self, now: Instant) -> bool {
        now < self.app_until
            && now < self.began + APP_DECIDE_WITHIN
            && matches!(
                self.app,
                App::Reading { .. }
                    | App::Watched {
                        seen: Seen::Unprobed,
                        ..
                    }
            )
    }

    /// The app holds Envoy at `now`: seen holding a connection to an outbound listener (or
    /// letting go, not for long enough yet), before `--app-hold` runs out.
    fn app_holds(&self, now: Instant) -> bool {
        now < self.app_until
            && matches!(
                self.app,
                App::Watched {
                    seen: Seen::Holding | Seen::LetGo { .. },
                    ..
                }
            )
            && !self.app_let_go(now)
    }

    /// The app held a connection since the signal, and none for [`APP_LET_GO`].
    fn app_let_go(&self, now: Instant) -> bool {
        matches!(self.app, App::Watched { seen: Seen::LetGo { since }, .. } if since + APP_LET_GO <= now)
    }

    /// The app was seen holding a connection since the signal.
    fn app_seen(&self) -> bool {
        matches!(
            self.app,
            App::Watched {
                seen: Seen::Holding | Seen::LetGo { .. },
                ..
            }
        )
    }

    /// The health checks wait: failing them would drain the outbound listeners the app still
    /// calls out through (or may: the first answer has not come).
    fn health_held(&self, now: Instant) -> bool {
        let reaches = match &self.app {
            App::Reading { .. } => true,
            App::Watched { reaches, .. } => reaches.health_checks,
            App::Off => false,
        };
        reaches && (self.app_undecided(now) || self.app_holds(now))
    }

    fn first_probe_due(&self, now: Instant) -> bool {
        matches!(
            self.app,
            App::Watched {
                seen: Seen::Unprobed,
                ..
            }
        ) && self.probe_due(now)
    }

    fn probe_due(&self, now: Instant) -> bool {
        matches!(self.app, App::Watched { .. })
            && self.app_call.is_none()
            && now < self.app_until
            && self.next_probe <= now
    }

    /// What the drain request asks at `now`: the notice left out while the app holds Envoy (or
    /// may: the rule has not answered yet) and the notice would reach its outbound
    /// connections. A notice left out is told once the app lets go ([`Step::TellNotice`]).
    pub(super) fn drain_options(&self, now: Instant) -> DrainOptions {
        let notice_reaches = match &self.app {
            App::Off => false,
            App::Reading { .. } => true,
            App::Watched { reaches, .. } => reaches.notice,
        };
        DrainOptions {
            hold_notice: notice_reaches && (self.app_undecided(now) || self.app_holds(now)),
            ..self.options
        }
    }

    /// The held drain notice was told.
    pub(super) fn notice_told(&mut self) {
        self.notice_held = false;
    }

    /// Why Envoy never accepted a drain, as judged at `now` (for [`ExitPath::DrainFailed`]).
    pub(super) fn drain_failure(&self, now: Instant) -> Option<String> {
        self.drain.failure(now)
    }

    /// The next instant something is due on its own (none: only an answer moves it on).
    /// What is held (by the app rule) waits for the rule's answers, not for its instant.
    pub(super) fn next_wake(&self, now: Instant) -> Option<Instant> {
        let mut wake = None;
        let mut consider = |t: Instant| wake = Some(wake.map_or(t, |w: Instant| w.min(t)));
        if let Some(d) = self.deadline.filter(|_| !self.app_holds(now)) {
            consider(d);
        }
        if !self.not_ready_said {
            consider(self.not_ready_at);
        }
        if self.app == (App::Reading { sent: false }) {
            consider(self.began);
        }
        if self.app_undecided(now) {
            consider(self.began + APP_DECIDE_WITHIN);
        }
        if !self.health_held(now) {
            match self.health {
                Some(HealthAsk::Due { at }) => consider(at),
                Some(HealthAsk::Failed { retry_at }) => consider(retry_at),
                Some(HealthAsk::InFlight | HealthAsk::Accepted) | None => {}
            }
        }
        match &self.drain {
            DrainAsk::Due => consider(self.drain_at),
            DrainAsk::Failed { retry_at, .. } => consider(*retry_at),
            DrainAsk::InFlight { .. } | DrainAsk::Accepted => {}
        }
        if self.counting.is_some()
            && self.zero.is_none()
            && self.drain != DrainAsk::Due
            && self.count_call.is_none()
        {
            consider(self.next_count.max(self.count_from));
        }
        if self.ending == Ending::Stop
            && self.drain != DrainAsk::Due
            && self.listeners_call.is_none()
        {
            consider(self.next_listeners);
        }
        if let App::Watched { seen, .. } = &self.app {
            if self.app_call.is_none() && now < self.app_until {
                consider(self.next_probe);
            }
            if let Seen::LetGo { since } = seen {
                consider(*since + APP_LET_GO);
            }
            if self.app_seen() && now < self.app_until {
                consider(self.app_until);
            }
            if matches!(seen, Seen::Unprobed) && now < self.app_until {
                consider(self.app_until);
            }
        }
        wake
    }

    /// What each drained listener holds is read in every drain that ends in a stop, so that
    /// the stop can say what was still open whatever ended it (exit-on-zero or not).
    fn listeners_due(&self, now: Instant) -> bool {
        self.ending == Ending::Stop
            && self.drain != DrainAsk::Due
            && self.listeners_call.is_none()
            && self.next_listeners <= now
    }

    /// A reading of the listeners went out at `now` as `call`.
    pub(super) fn listeners_sent(
        &mut self,
        now: Instant,
        call: Pin<Box<dyn Future<Output = ListenersRead> + Send>>,
    ) {
        self.next_listeners = now + LISTENERS_POLL;
        self.listeners_call = Some(call);
    }

    /// A reading of the listeners came back at `now`. A failed one keeps the last; it is
    /// no count and no reason to stop.
    pub(super) fn listeners_read(&mut self, read: ListenersRead, now: Instant) {
        let asked = now.checked_sub(read.took).unwrap_or(now);
        self.next_listeners = self.next_listeners.max(
            asked
                + envoy_agent_proxy::admin::paced(
                    LISTENERS_POLL,
                    read.took,
                    envoy_agent_proxy::admin::BUSY_SHARE,
                ),
        );
        match read.listeners {
            Ok(listeners) => {
                let listeners = named(listeners, self.progress.drained.as_ref());
                self.progress.listeners = Some((listeners, SystemTime::now()));
            }
            Err(e) => tracing::debug!(error = %e, "cannot read what each listener holds"),
        }
    }

    /// What the counted listeners still held at the last reading, for the exit's log: none
    /// before a reading, or when nothing was held.
    pub(super) fn still_open(&self) -> Option<String> {
        let parts: Vec<String> = self.listeners()?.iter().map(describe_listener).collect();
        (!parts.is_empty()).then(|| parts.join("; "))
    }

    /// What the counted listeners held at the last reading; none before one.
    pub(super) fn listeners(&self) -> Option<&[ListenerActivity]> {
        self.progress.listeners.as_ref().map(|(l, _)| l.as_slice())
    }

    /// Whether the drain request has gone out (at least once).
    pub(super) fn drain_asked(&self) -> bool {
        self.drain != DrainAsk::Due
    }

    /// Readiness went off ([`Step::NotReady`] was taken).
    pub(super) fn not_ready_said(&mut self) {
        self.not_ready_said = true;
    }

    /// The request that Envoy fail its health checks went out as `call`; whether it is the
    /// first (not a retry).
    pub(super) fn health_checks_sent(
        &mut self,
        call: Pin<Box<dyn Future<Output = Result<(), ProxyError>> + Send>>,
    ) -> bool {
        let first = matches!(self.health, Some(HealthAsk::Due { .. }));
        self.health = Some(HealthAsk::InFlight);
        self.health_call = Some(call);
        first
    }

    /// Envoy answered the request that it fail its health checks at `now`.
    pub(super) fn health_checks_answered(&mut self, result: &Result<(), ProxyError>, now: Instant) {
        self.health = Some(match result {
            Ok(()) => HealthAsk::Accepted,
            Err(_) => HealthAsk::Failed {
                retry_at: now + DRAIN_RETRY,
            },
        });
    }

    /// The drain request went out at `now` as `call`, `holding` the notice or not.
    pub(super) fn drain_sent(
        &mut self,
        now: Instant,
        holding: bool,
        call: Pin<Box<dyn Future<Output = Result<DrainPlan, ProxyError>> + Send>>,
    ) {
        self.notice_held = holding;
        let failed = match &self.drain {
            DrainAsk::Failed { error, .. } => Some(error.clone()),
            _ => None,
        };
        self.drain = DrainAsk::InFlight { since: now, failed };
        self.drain_call = Some(call);
    }

    /// The connections the quick counts found, for the next.
    pub(super) fn known(&self) -> envoy_agent_drain::Known {
        self.known.clone()
    }

    /// A count of `tally` went out at `now` as `call`.
    pub(super) fn count_sent(
        &mut self,
        now: Instant,
        tally: Tally,
        call: Pin<Box<dyn Future<Output = Counted> + Send>>,
    ) {
        self.next_count = now + self.poll_interval;
        if tally == Tally::Whole {
            self.next_whole = now + WHOLE_COUNT_EVERY;
        }
        self.count_call = Some(call);
    }

    /// The next answer to a call that is out; never when none is.
    pub(super) async fn answer(&mut self) -> Answer {
        tokio::select! {
            result = settle(&mut self.drain_call) => Answer::Drain(result),
            result = settle(&mut self.health_call) => Answer::HealthChecks(result),
            counted = settle(&mut self.count_call) => Answer::Count(counted),
            read = settle(&mut self.listeners_call) => Answer::Listeners(read),
            read = settle(&mut self.outbound_call) => Answer::Outbound(read),
            held = settle(&mut self.app_call) => Answer::App(held),
        }
    }

    /// What ends the timeline.
    pub(super) fn ending(&self) -> Ending {
        self.ending
    }

    /// A drain request's timeline continues to the stop (a signal, gRPC `Stop`): the
    /// deadline and exit-on-zero of a shutdown begun when the request was, so that the
    /// signal does not start another timeline (a deadline already past stops at once).
    pub(super) fn continue_to_stop(&mut self, config: &AgentConfig) {
        if self.ending == Ending::Stop {
            return;
        }
        self.ending = Ending::Stop;
        let deadline = config.drain_deadline();
        self.deadline = deadline.map(|d| self.drain_at + d);
        self.counting = config.exit_on_zero;
        self.progress.deadline = deadline.map(|d| self.progress.started + config.drain_delay + d);
        self.progress.counting = config.exit_on_zero;
        self.progress.stops = true;
    }

    /// Another drain request: answered now when Envoy already accepted the drain, else
    /// with the first answer.
    pub(super) fn add_reply(&mut self, reply: Reply<Option<DrainPlan>>) {
        match (&self.drain, &self.progress.drained) {
            (DrainAsk::Accepted, Some(plan)) => {
                let _ = reply.send(Ok(Some(plan.clone())));
            }
            _ => self.replies.push(reply),
        }
    }

    /// The drain request's callers, for the stop to answer (nothing more is asked of Envoy).
    pub(super) fn take_replies(&mut self) -> Vec<Reply<Option<DrainPlan>>> {
        std::mem::take(&mut self.replies)
    }

    /// The reading of Envoy's listeners for the app rule went out as `call`.
    pub(super) fn outbound_sent(
        &mut self,
        call: Pin<Box<dyn Future<Output = Result<Vec<Listener>, String>> + Send>>,
    ) {
        self.app = App::Reading { sent: true };
        self.outbound_call = Some(call);
    }

    /// Envoy's listeners, for the app rule: it watches the outbound TCP ones that count
    /// (`counts`: not excluded), or nothing when there are none or they could not be read.
    pub(super) fn outbound_read(
        &mut self,
        read: Result<Vec<Listener>, String>,
        counts: impl Fn(u16) -> bool,
        now: Instant,
    ) {
        let listeners = match read {
            Ok(l) => l,
            Err(why) => {
                tracing::warn!(event = "app_rule_off", error = %why, "cannot read envoy's listeners: envoy is stopped on the drain's clock, whatever the app still does");
                self.set_app(App::Off);
                return;
            }
        };
        let outbound: Vec<&Listener> = listeners
            .iter()
            .filter(|l| l.direction == Direction::Outbound && !l.udp)
            .filter(|l| l.port.is_some_and(&counts))
            .collect();
        if outbound.is_empty() {
            tracing::info!(
                event = "app_rule_off",
                "no outbound listener: nothing of the app's to wait for"
            );
            self.set_app(App::Off);
            return;
        }
        let reaches = Reaches {
            health_checks: outbound.iter().any(|l| !l.modify_only),
            notice: outbound.iter().any(|l| !l.bypasses_overload_manager),
        };
        let ports = outbound.iter().filter_map(|l| l.port).collect();
        self.next_probe = now;
        self.set_app(App::Watched {
            ports,
            reaches,
            seen: Seen::Unprobed,
        });
    }

    /// What the app rule's next probe asks about: the outbound listeners' ports, and the
    /// connections found before.
    pub(super) fn probe(&self) -> Option<(BTreeSet<u16>, envoy_agent_drain::Known)> {
        match &self.app {
            App::Watched { ports, .. } => Some((ports.clone(), self.app_known.clone())),
            _ => None,
        }
    }

    /// A probe went out at `now` as `call`.
    pub(super) fn probe_sent(
        &mut self,
        now: Instant,
        call: Pin<Box<dyn Future<Output = Result<bool, DrainError>> + Send>>,
    ) {
        self.next_probe = now + APP_PROBE_EVERY;
        self.app_call = Some(call);
    }

    /// A probe's answer at `now`: whether the app holds a connection to an outbound
    /// listener. Failures, too many in a row, turn the rule off.
    pub(super) fn probed(&mut self, held: Result<bool, DrainError>, now: Instant) {
        let App::Watched { seen, .. } = &self.app else {
            return;
        };
        let seen = *seen;
        let next = match held {
            Ok(true) => {
                self.app_errors = 0;
                if !matches!(seen, Seen::Holding | Seen::LetGo { .. }) {
                    tracing::info!(
                        event = "app_holding",
                        "the app calls out through envoy's outbound listeners: envoy serves it until it lets go"
                    );
                }
                Seen::Holding
            }
            Ok(false) => {
                self.app_errors = 0;
                match seen {
                    Seen::Unprobed => Seen::Never,
                    Seen::Holding => Seen::LetGo { since: now },
                    other => other,
                }
            }
            Err(e) => {
                self.app_errors += 1;
                tracing::debug!(error = %e, errors = self.app_errors, "cannot tell whether the app holds connections");
                if self.app_errors >= self.stats_error_budget {
                    tracing::warn!(event = "app_rule_off", error = %e, "cannot tell whether the app holds connections: envoy is stopped on the drain's clock");
                    self.set_app(App::Off);
                    return;
                }
                seen
            }
        };
        if let App::Watched { seen, .. } = &mut self.app {
            *seen = next;
        }
        self.progress.app = Some(self.app_watch(now));
    }

    fn set_app(&mut self, app: App) {
        self.app = app;
        self.progress.app = match self.app {
            App::Off => None,
            _ => Some(self.app_watch(self.began)),
        };
    }

    /// What the status says of the app rule.
    fn app_watch(&self, now: Instant) -> AppWatch {
        match &self.app {
            App::Off | App::Reading { .. } => AppWatch::Unknown,
            App::Watched { seen, .. } => match seen {
                Seen::Unprobed => AppWatch::Unknown,
                Seen::Never => AppWatch::NotSeen,
                _ if self.app_let_go(now) => AppWatch::LetGo,
                Seen::Holding | Seen::LetGo { .. } => AppWatch::Holding {
                    until: self.progress.started
                        + self.app_until.saturating_duration_since(self.began),
                },
            },
        }
    }

    /// Envoy answered the drain request at `now`.
    pub(super) fn drain_answered(&mut self, result: &Result<DrainPlan, ProxyError>, now: Instant) {
        for reply in self.replies.drain(..) {
            let _ = reply.send(
                result
                    .as_ref()
                    .map(|plan| Some(plan.clone()))
                    .map_err(|e| AgentError::DrainFailed(e.to_string())),
            );
        }
        self.drain = match result {
            Ok(plan) => {
                self.progress.drained = Some(plan.clone());
                // What is counted changed (the drained listeners' ports, the kernel's quick
                // counts): the next count goes at once, not at the pace of one before it.
                self.next_count = self.next_count.min(now);
                self.next_whole = self.next_whole.min(now);
                DrainAsk::Accepted
            }
            Err(e) => DrainAsk::Failed {
                error: e.to_string(),
                retry_at: now + DRAIN_RETRY,
            },
        };
    }

    /// A count came back at `now`; `parent_draining`: a hot-restart parent still drains its
    /// own connections, which the count may not show (zero means zero only once it is gone).
    /// The exit path when the wait is over.
    pub(super) fn counted(
        &mut self,
        counted: Counted,
        parent_draining: bool,
        now: Instant,
    ) -> Option<ExitPath> {
        let what = self.counting?;
        // A count from Envoy's stats makes it visit every stat (most of a second on a large
        // config): paced by what it took.
        let asked = now.checked_sub(counted.took).unwrap_or(now);
        let paced = |base: Duration, share: u32| {
            asked + envoy_agent_proxy::admin::paced(base, counted.took, share)
        };
        match counted.pace {
            Pace::Every(share) => {
                self.next_count = self.next_count.max(paced(self.poll_interval, share));
                self.next_whole = self.next_whole.max(self.next_count);
            }
            Pace::Quick(share) => {
                self.next_count = self.next_count.max(paced(self.poll_interval, share));
            }
            Pace::Whole(share) => {
                self.next_whole = self.next_whole.max(paced(WHOLE_COUNT_EVERY, share));
            }
        }
        match counted.count {
            Ok(0) if !parent_draining => {
                // Nothing more to count: the stop is now, or when the app lets go.
                self.zero = Some(what);
                self.due_stop(now)
            }
            // Not zero, and no number for the status: the last whole count stands.
            Ok(n)
                if matches!(counted.pace, Pace::Quick(_)) && n > 0 && self.last_count.is_some() =>
            {
                self.stats_errors = 0;
                None
            }
            Ok(n) => {
                self.stats_errors = 0;
                self.last_count = Some(n);
                self.progress.last_count = Some((n, SystemTime::now()));
                match what {
                    Counting::Connections => tracing::debug!(
                        event = "active_connections",
                        active_connections = n,
                        "waiting for zero"
                    ),
                    Counting::Requests => tracing::debug!(
                        event = "active_requests",
                        active_requests = n,
                        "waiting for zero"
                    ),
                }
                None
            }
            Err(e) => {
                self.stats_errors += 1;
                tracing::warn!(
                    error = %e,
                    errors = self.stats_errors,
                    budget = self.stats_error_budget,
                    "cannot count active {what}"
                );
                (self.stats_errors >= self.stats_error_budget)
                    .then_some(ExitPath::StatsUnavailable(what))
            }
        }
    }
}

/// One listener: its name and what it held.
pub fn describe_listener(l: &ListenerActivity) -> String {
    let mut part = format!("{}: {} connections", l.name, l.connections);
    if let Some(n) = l.requests {
        part.push_str(&format!(", {n} requests"));
    }
    if let Some(n) = l.upgrades.filter(|n| *n > 0) {
        part.push_str(&format!(", {n} upgraded (WebSocket, CONNECT)"));
    }
    part
}

#[cfg(test)]
mod tests {
    use envoy_agent_drain::count::WHOLE_COUNT_SHARE;

    use super::*;
    use crate::signal::Intent;

    const SIGTERM: DrainReason = DrainReason::Signal(Intent::Terminate);

    /// The defaults without the app rule (a node proxy's, or a sidecar's with `--app-hold
    /// off`): the timeline alone. The rule's own tests turn it on.
    fn config() -> AgentConfig {
        AgentConfig {
            app_hold: None,
            ..AgentConfig::default()
        }
    }

    /// A shutdown begun now, its steps at the signal taken (readiness off, health checks
    /// failed) when they are due then.
    fn begin(config: &AgentConfig) -> (Shutdown, Instant) {
        let now = Instant::now();
        let mut s = Shutdown::begin(config, SIGTERM, now, SystemTime::now());
        loop {
            match s.poll(now) {
                Step::NotReady => s.not_ready_said(),
                Step::FailHealthChecks => {
                    s.health_checks_sent(never());
                    s.health_call = None;
                    s.health_checks_answered(&Ok(()), now);
                }
                _ => return (s, now),
            }
        }
    }

    fn never<T: Send + 'static>() -> Pin<Box<dyn Future<Output = T> + Send>> {
        Box::pin(std::future::pending())
    }

    /// What Envoy answers a drain that it accepts.
    fn accepted() -> DrainPlan {
        envoy_agent_proxy::listeners::plan(envoy_agent_proxy::Scope::Auto, true, Ok(Vec::new()))
    }

    /// The drain request goes out at `now` and Envoy answers `result`.
    async fn drain(s: &mut Shutdown, now: Instant, result: Result<DrainPlan, ProxyError>) {
        s.drain_sent(now, false, Box::pin(std::future::ready(result)));
        let Answer::Drain(result) = s.answer().await else {
            panic!("not the drain answered")
        };
        s.drain_answered(&result, now);
    }

    /// [`drain`], with the listeners' readings (every stopping drain takes them) out of the way:
    /// one is out for good.
    async fn drain_unread(s: &mut Shutdown, now: Instant, result: Result<DrainPlan, ProxyError>) {
        drain(s, now, result).await;
        s.listeners_sent(now, never());
    }

    fn counted(count: Result<u64, DrainError>) -> Counted {
        Counted {
            count,
            took: Duration::ZERO,
            pace: Pace::Every(20),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_drain_goes_out_after_the_delay_and_the_deadline_follows_the_termination_drain() {
        let config = AgentConfig {
            drain_delay: Duration::from_secs(3),
            ..config()
        };
        let (mut s, t0) = begin(&config);
        assert_eq!(s.poll(t0), Step::Wait(Some(t0 + Duration::from_secs(3))));
        assert_eq!(s.phase(t0), DrainPhase::Delay);
        let at = t0 + Duration::from_secs(3);
        // Health checks fail when the drain starts (the default), just before it.
        assert_eq!(s.poll(at), Step::FailHealthChecks);
        s.health_checks_sent(never());
        assert_eq!(s.poll(at), Step::SendDrain);
        drain_unread(&mut s, at, Ok(accepted())).await;
        assert_eq!(s.phase(at), DrainPhase::Draining);
        // The deadline: the delay plus the termination drain duration.
        assert_eq!(s.poll(at), Step::Wait(Some(at + Duration::from_secs(5))));
        assert_eq!(
            s.poll(at + Duration::from_secs(5)),
            Step::Stop(ExitPath::DrainTimeElapsed)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn by_default_readiness_health_checks_and_the_drain_go_at_the_signal_in_that_order() {
        let now = Instant::now();
        let mut s = Shutdown::begin(&config(), SIGTERM, now, SystemTime::now());
        assert!(!s.ready(now));
        assert_eq!(s.poll(now), Step::NotReady);
        s.not_ready_said();
        assert_eq!(s.poll(now), Step::FailHealthChecks);
        assert!(s.health_checks_sent(never()), "the first");
        assert_eq!(s.poll(now), Step::SendDrain);
    }

    #[tokio::test(start_paused = true)]
    async fn each_step_comes_at_its_offset_and_a_failing_health_check_request_never_holds_the_stop()
    {
        let secs = Duration::from_secs;
        // Drain at once, readiness kept until endpoints propagate, health checks failing later.
        let config = AgentConfig {
            not_ready_at: secs(10),
            fail_health_checks_at: HealthCheckFailAt::After(secs(15)),
            termination_drain_duration: secs(30),
            ..config()
        };
        let t0 = Instant::now();
        let mut s = Shutdown::begin(&config, SIGTERM, t0, SystemTime::now());
        assert_eq!(s.poll(t0), Step::SendDrain);
        drain_unread(&mut s, t0, Ok(accepted())).await;
        assert!(s.ready(t0), "ready while it drains");
        assert_eq!(s.poll(t0), Step::Wait(Some(t0 + secs(10))));
        assert_eq!(s.poll(t0 + secs(10)), Step::NotReady);
        s.not_ready_said();
        assert!(!s.ready(t0 + secs(10)));
        assert_eq!(s.poll(t0 + secs(10)), Step::Wait(Some(t0 + secs(15))));
        let at = t0 + secs(15);
        assert_eq!(s.poll(at), Step::FailHealthChecks);
        assert!(s.health_checks_sent(never()));
        s.health_call = None;
        s.health_checks_answered(&Err(ProxyError::NotRunning), at);
        assert_eq!(
            s.poll(at),
            Step::Wait(Some(at + DRAIN_RETRY)),
            "asked again"
        );
        assert_eq!(s.poll(at + DRAIN_RETRY), Step::FailHealthChecks);
        assert!(!s.health_checks_sent(never()), "a retry");
        // Still unanswered at the deadline: the stop is not held up.
        assert_eq!(
            s.poll(t0 + secs(30)),
            Step::Stop(ExitPath::DrainTimeElapsed)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn health_checks_off_are_never_asked_to_fail() {
        let config = AgentConfig {
            fail_health_checks_at: HealthCheckFailAt::Off,
            ..config()
        };
        let (mut s, t0) = begin(&config);
        assert_eq!(s.poll(t0), Step::SendDrain);
        drain(&mut s, t0, Ok(accepted())).await;
        assert_eq!(
            s.poll(t0 + Duration::from_secs(5)),
            Step::Stop(ExitPath::DrainTimeElapsed)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_without_a_longer_termination_drain_has_no_deadline() {
        let config = AgentConfig {
            exit_on_zero: Some(Counting::Connections),
            ..config()
        };
        assert_eq!(config.drain_deadline(), None);
        let (mut s, t0) = begin(&config);
        drain(&mut s, t0, Ok(accepted())).await;
        // Counting starts at the minimum drain duration, and nothing else ever comes.
        let from = t0 + config.minimum_drain_duration;
        assert_eq!(s.poll(t0), Step::Wait(Some(from)));
        let late = from + Duration::from_secs(3600);
        assert_eq!(s.poll(late), Step::Count(Tally::Whole));
        s.count_sent(late, Tally::Whole, never());
        assert_eq!(s.poll(late), Step::ReadListeners);
        s.listeners_sent(late, never());
        assert_eq!(s.poll(late), Step::Wait(None));
    }

    /// Between whole counts (the status's number, each 2 s at most, and at most 1/400 of
    /// a core), quick ones at the poll interval tell zero from not zero; a quick one that
    /// finds some leaves the last number standing.
    #[tokio::test(start_paused = true)]
    async fn quick_counts_between_whole_ones_tell_zero_and_leave_the_number_standing() {
        let config = AgentConfig {
            exit_on_zero: Some(Counting::Connections),
            termination_drain_duration: Duration::from_secs(600),
            ..config()
        };
        let (mut s, t0) = begin(&config);
        drain(&mut s, t0, Ok(accepted())).await;
        let mut now = t0 + config.minimum_drain_duration;
        let answer = |n: u64, pace: Pace, took: Duration| Counted {
            count: Ok(n),
            took,
            pace,
        };
        assert_eq!(s.poll(now), Step::Count(Tally::Whole), "the first is whole");
        s.count_sent(now, Tally::Whole, never());
        s.count_call = None;
        // A whole count of 15,000 that took 20 ms: the next whole one after 8 s (1/400).
        let took = Duration::from_millis(20);
        assert_eq!(
            s.counted(
                answer(15_000, Pace::Whole(WHOLE_COUNT_SHARE), took),
                false,
                now + took
            ),
            None
        );
        let whole_again = now + took * WHOLE_COUNT_SHARE;
        let mut quick = 0;
        loop {
            now = match s.poll(now) {
                Step::Count(tally) => {
                    s.count_sent(now, tally, never());
                    s.count_call = None;
                    if tally == Tally::Whole {
                        break;
                    }
                    quick += 1;
                    assert_eq!(
                        s.counted(answer(1, Pace::Quick(100), Duration::ZERO), false, now),
                        None
                    );
                    assert_eq!(s.progress().last_count.map(|(n, _)| n), Some(15_000));
                    now
                }
                Step::ReadListeners => {
                    s.listeners_sent(now, never());
                    now
                }
                Step::Wait(Some(at)) => at,
                other => panic!("{other:?}"),
            };
        }
        assert_eq!(now, whole_again);
        let polls = (took * WHOLE_COUNT_SHARE - config.poll_interval).as_millis()
            / config.poll_interval.as_millis();
        assert_eq!(quick as u128, polls, "quick counts at the poll interval");
        // The last client leaves: the next quick count stops the wait.
        assert_eq!(
            s.counted(answer(0, Pace::Quick(100), Duration::ZERO), false, now),
            Some(ExitPath::ZeroActive(Counting::Connections))
        );
    }

    /// A count taken before Envoy answered the drain (the old, whole way: no ports yet), however
    /// slow, does not hold back the counts once the drain's answer names what to count.
    #[tokio::test(start_paused = true)]
    async fn the_drain_s_answer_brings_the_next_count_forward() {
        let config = AgentConfig {
            exit_on_zero: Some(Counting::Connections),
            minimum_drain_duration: Duration::ZERO,
            termination_drain_duration: Duration::from_secs(600),
            ..config()
        };
        let (mut s, t0) = begin(&config);
        assert_eq!(s.poll(t0), Step::SendDrain);
        s.drain_sent(t0, false, never());
        assert_eq!(s.poll(t0), Step::Count(Tally::Whole), "counting already");
        s.count_sent(t0, Tally::Whole, never());
        s.count_call = None;
        let took = Duration::from_millis(100);
        let slow = Counted {
            count: Ok(15_000),
            took,
            pace: Pace::Every(20),
        };
        assert_eq!(s.counted(slow, false, t0 + took), None);
        assert!(
            !matches!(s.poll(t0 + took), Step::Count(_)),
            "paced by its cost"
        );
        s.drain_call = None;
        s.drain_answered(&Ok(accepted()), t0 + took);
        assert_eq!(s.poll(t0 + took), Step::Count(Tally::Whole));
    }

    #[tokio::test(start_paused = true)]
    async fn a_count_of_zero_stops_only_once_no_parent_drains() {
        let config = AgentConfig {
            exit_on_zero: Some(Counting::Requests),
            termination_drain_duration: Duration::from_secs(60),
            ..config()
        };
        let (mut s, t0) = begin(&config);
        assert_eq!(s.counted(counted(Ok(0)), true, t0), None);
        assert_eq!(
            s.counted(counted(Ok(0)), false, t0),
            Some(ExitPath::ZeroActive(Counting::Requests))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_names_what_was_counted_and_a_drain_never_accepted() {
        let config = AgentConfig {
            exit_on_zero: Some(Counting::Connections),
            termination_drain_duration: Duration::from_secs(60),
            ..config()
        };
        let end = Duration::from_secs(60);
        let (mut s, t0) = begin(&config);
        drain(&mut s, t0, Ok(accepted())).await;
        assert_eq!(
            s.poll(t0 + end),
            Step::Stop(ExitPath::DrainTimeElapsed),
            "nothing counted: no claim of what remained"
        );
        assert_eq!(s.counted(counted(Ok(3)), false, t0), None);
        assert_eq!(
            s.poll(t0 + end),
            Step::Stop(ExitPath::DrainDeadline(Counting::Connections))
        );

        let (mut s, t0) = begin(&config);
        drain(&mut s, t0, Err(ProxyError::NotRunning)).await;
        assert_eq!(s.poll(t0 + DRAIN_RETRY), Step::SendDrain, "asked again");
        assert_eq!(s.poll(t0 + end), Step::SendDrain);
        s.drain_sent(t0 + end, false, never());
        assert_eq!(s.poll(t0 + end), Step::Stop(ExitPath::DrainFailed));
        assert!(s.drain_failure(t0 + end).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn what_each_listener_holds_is_read_paced_by_its_cost_and_named_at_the_stop() {
        let config = AgentConfig {
            exit_on_zero: Some(Counting::Connections),
            termination_drain_duration: Duration::from_secs(600),
            ..config()
        };
        let (mut s, t0) = begin(&config);
        drain(&mut s, t0, Ok(accepted())).await;
        let from = t0 + config.minimum_drain_duration;
        s.count_sent(from, Tally::Whole, never());
        assert_eq!(s.poll(from), Step::ReadListeners);
        let held = ListenerActivity {
            name: "0.0.0.0_8080".to_owned(),
            connections: 2,
            requests: Some(1),
            upgrades: Some(1),
        };
        // A reading that took 2 s of Envoy's main thread: the next one waits for its share.
        let took = Duration::from_secs(2);
        s.listeners_sent(from, never());
        s.listeners_call = None;
        s.listeners_read(
            ListenersRead {
                listeners: Ok(vec![held]),
                took,
            },
            from + took,
        );
        let next = from
            + envoy_agent_proxy::admin::paced(
                LISTENERS_POLL,
                took,
                envoy_agent_proxy::admin::BUSY_SHARE,
            );
        assert!(next > from + took + LISTENERS_POLL);
        assert_ne!(s.poll(next - Duration::from_millis(1)), Step::ReadListeners);
        assert_eq!(s.poll(next), Step::ReadListeners);
        assert_eq!(
            s.still_open().as_deref(),
            Some("0.0.0.0_8080: 2 connections, 1 requests, 1 upgraded (WebSocket, CONNECT)")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn counting_fails_the_wait_after_the_error_budget() {
        let config = AgentConfig {
            exit_on_zero: Some(Counting::Connections),
            stats_error_budget: 2,
            ..config()
        };
        let (mut s, t0) = begin(&config);
        assert_eq!(
            s.counted(counted(Err(DrainError::AdminUnknown)), false, t0),
            None
        );
        assert_eq!(
            s.counted(counted(Err(DrainError::AdminUnknown)), false, t0),
            Some(ExitPath::StatsUnavailable(Counting::Connections))
        );
    }

    // A sidecar's app rule (issue 49).

    fn sidecar() -> AgentConfig {
        AgentConfig {
            app_hold: Some(Duration::from_secs(25)),
            ..config()
        }
    }

    fn envoy_listener(name: &str, direction: Direction, port: u16, marked: bool) -> Listener {
        Listener {
            name: name.to_owned(),
            direction,
            stat_name: name.to_owned(),
            port: Some(port),
            udp: false,
            modify_only: marked,
            bypasses_overload_manager: marked,
        }
    }

    /// A sidecar's shutdown at `t0`, its outbound listener read (`marked`: MODIFY_ONLY and
    /// bypassing the overload manager) and the app's first probe answered `held`.
    fn sidecar_shutdown(config: &AgentConfig, marked: bool, held: bool) -> (Shutdown, Instant) {
        let t0 = Instant::now();
        let mut s = Shutdown::begin(config, SIGTERM, t0, SystemTime::now());
        assert_eq!(s.poll(t0), Step::NotReady);
        s.not_ready_said();
        assert_eq!(s.poll(t0), Step::ReadOutbound, "the app rule reads first");
        s.outbound_sent(never());
        s.outbound_call = None;
        // The drain (inbound-only) does not wait for the rule; its notice will.
        assert_eq!(s.poll(t0), Step::SendDrain);
        assert!(s.drain_options(t0).hold_notice);
        s.outbound_read(
            Ok(vec![
                envoy_listener("in", Direction::Inbound, 8080, false),
                envoy_listener("out", Direction::Outbound, 15001, marked),
            ]),
            |_| true,
            t0,
        );
        assert_eq!(s.poll(t0), Step::ProbeApp, "the first probe first");
        assert_eq!(s.probe().unwrap().0, BTreeSet::from([15001]));
        s.probe_sent(t0, never());
        s.app_call = None;
        match marked {
            // Nothing of the app's to hold them for.
            true => assert_eq!(s.poll(t0), Step::FailHealthChecks),
            // The health checks wait for the first answer; the drain does not.
            false => assert_eq!(s.poll(t0), Step::SendDrain),
        }
        s.probed(Ok(held), t0);
        (s, t0)
    }

    /// The app's probe at `at` answers `held`.
    fn probe(s: &mut Shutdown, at: Instant, held: bool) {
        assert_eq!(s.poll(at), Step::ProbeApp);
        s.probe_sent(at, never());
        s.app_call = None;
        s.probed(Ok(held), at);
    }

    #[tokio::test(start_paused = true)]
    async fn a_sidecar_serves_an_app_that_holds_outbound_connections_until_it_lets_go() {
        let config = AgentConfig {
            fail_health_checks_at: HealthCheckFailAt::Drain,
            ..sidecar()
        };
        let (mut s, t0) = sidecar_shutdown(&config, false, true);
        // Health checks would drain the outbound listener: they wait. The drain goes, its
        // notice left out.
        assert_eq!(s.poll(t0), Step::SendDrain);
        assert!(s.drain_options(t0).hold_notice);
        drain_unread(&mut s, t0, Ok(accepted())).await;
        assert_eq!(s.progress().app.map(AppWatch::name), Some("holding"));
        // Past the drain's deadline (5 s) the app still calls out: Envoy serves it.
        let mut at = t0;
        while at < t0 + Duration::from_secs(12) {
            at += APP_PROBE_EVERY;
            probe(&mut s, at, true);
            assert!(matches!(s.poll(at), Step::Wait(_)), "{:?}", s.poll(at));
        }
        // It exits: the stop follows once it has let go for long enough.
        at += APP_PROBE_EVERY;
        probe(&mut s, at, false);
        let gone = at;
        while at < gone + APP_LET_GO {
            assert!(matches!(s.poll(at), Step::Wait(_)));
            at += APP_PROBE_EVERY;
            if at < gone + APP_LET_GO {
                probe(&mut s, at, false);
            }
        }
        assert_eq!(s.poll(gone + APP_LET_GO), Step::Stop(ExitPath::AppDone));
    }

    #[tokio::test(start_paused = true)]
    async fn a_sidecar_whose_app_is_gone_stops_as_the_timeline_says() {
        let config = AgentConfig {
            fail_health_checks_at: HealthCheckFailAt::Drain,
            ..sidecar()
        };
        let (mut s, t0) = sidecar_shutdown(&config, false, false);
        assert_eq!(s.poll(t0), Step::FailHealthChecks);
        s.health_checks_sent(never());
        s.health_call = None;
        assert_eq!(s.poll(t0), Step::SendDrain);
        assert!(
            !s.drain_options(t0).hold_notice,
            "the notice goes with the drain"
        );
        drain(&mut s, t0, Ok(accepted())).await;
        assert_eq!(s.progress().app.map(AppWatch::name), Some("not_seen"));
        let deadline = t0 + Duration::from_secs(5);
        assert_eq!(s.poll(deadline), Step::Stop(ExitPath::DrainTimeElapsed));
    }

    #[tokio::test(start_paused = true)]
    async fn outbound_listeners_marked_to_be_left_alone_hold_nothing_back() {
        let config = AgentConfig {
            fail_health_checks_at: HealthCheckFailAt::Drain,
            ..sidecar()
        };
        let (mut s, t0) = sidecar_shutdown(&config, true, true);
        assert_eq!(s.poll(t0), Step::FailHealthChecks);
        s.health_checks_sent(never());
        s.health_call = None;
        assert_eq!(s.poll(t0), Step::SendDrain);
        assert!(!s.drain_options(t0).hold_notice);
    }

    #[tokio::test(start_paused = true)]
    async fn the_hold_ends_at_app_hold_and_a_zero_waits_for_the_app() {
        let config = AgentConfig {
            exit_on_zero: Some(Counting::Requests),
            minimum_drain_duration: Duration::from_secs(1),
            app_hold: Some(Duration::from_secs(3)),
            ..config()
        };
        let (mut s, t0) = sidecar_shutdown(&config, false, true);
        drain(&mut s, t0, Ok(accepted())).await;
        let at = t0 + Duration::from_secs(1);
        probe(&mut s, at, true);
        assert_eq!(s.poll(at), Step::Count(Tally::Whole));
        // The inbound side is done; the app is not.
        assert_eq!(s.counted(counted(Ok(0)), false, at), None);
        let end = t0 + Duration::from_secs(3);
        assert!(!matches!(
            s.poll(end - Duration::from_millis(1)),
            Step::Stop(_)
        ));
        assert_eq!(s.poll(end), Step::Stop(ExitPath::AppHoldElapsed));
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_request_keeps_serving_and_a_signal_continues_it() {
        let (reply, _answer) = tokio::sync::oneshot::channel();
        let t0 = Instant::now();
        let config = AgentConfig {
            drain_delay: Duration::from_secs(3),
            fail_health_checks_at: HealthCheckFailAt::Off,
            ..config()
        };
        let mut s = Shutdown::begin_request(
            &config,
            DrainReason::Request(super::super::state::Via::Http),
            DrainOptions {
                skip_exit: true,
                ..DrainOptions::default()
            },
            reply,
            t0,
            SystemTime::now(),
        );
        assert_eq!(s.poll(t0), Step::NotReady);
        s.not_ready_said();
        assert_eq!(s.poll(t0), Step::Wait(Some(t0 + Duration::from_secs(3))));
        let at = t0 + Duration::from_secs(3);
        assert_eq!(s.poll(at), Step::SendDrain);
        assert!(s.drain_options(at).skip_exit);
        drain(&mut s, at, Ok(accepted())).await;
        // No deadline, no stop: Envoy serves, drained.
        assert_eq!(s.poll(at + Duration::from_secs(3600)), Step::Wait(None));
        s.continue_to_stop(&config);
        assert_eq!(
            s.poll(at + Duration::from_secs(5)),
            Step::Stop(ExitPath::DrainTimeElapsed),
            "the deadline counts from the request's drain"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_app_rule_without_an_answer_holds_the_health_checks_and_notice_a_moment_only() {
        let config = AgentConfig {
            fail_health_checks_at: HealthCheckFailAt::Drain,
            ..sidecar()
        };
        let t0 = Instant::now();
        let mut s = Shutdown::begin(&config, SIGTERM, t0, SystemTime::now());
        s.not_ready_said();
        assert_eq!(s.poll(t0), Step::ReadOutbound);
        s.outbound_sent(never());
        // Envoy's admin API does not answer the reading: the drain goes at once, its notice
        // held; the health checks wait.
        assert_eq!(s.poll(t0), Step::SendDrain);
        let options = s.drain_options(t0);
        assert!(options.hold_notice);
        s.drain_sent(
            t0,
            options.hold_notice,
            Box::pin(std::future::ready(Ok(accepted()))),
        );
        let Answer::Drain(result) = s.answer().await else {
            panic!("not the drain answered")
        };
        s.drain_answered(&result, t0);
        s.listeners_sent(t0, never());
        assert_eq!(s.poll(t0), Step::Wait(Some(t0 + APP_DECIDE_WITHIN)));
        let at = t0 + APP_DECIDE_WITHIN;
        assert_eq!(s.poll(at), Step::FailHealthChecks);
        s.health_checks_sent(never());
        assert_eq!(s.poll(at), Step::TellNotice);
        s.notice_told();
        assert!(matches!(s.poll(at), Step::Wait(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn without_exit_on_zero_the_listeners_are_read_for_the_stop_to_name_what_was_open() {
        let (mut s, t0) = begin(&config());
        assert_eq!(s.poll(t0), Step::SendDrain);
        drain(&mut s, t0, Ok(accepted())).await;
        assert_eq!(s.poll(t0), Step::ReadListeners, "from the drain on");
        s.listeners_sent(t0, never());
        s.listeners_call = None;
        s.listeners_read(
            ListenersRead {
                listeners: Ok(vec![ListenerActivity {
                    name: "ingress".to_owned(),
                    connections: 1,
                    requests: Some(1),
                    upgrades: None,
                }]),
                took: Duration::ZERO,
            },
            t0,
        );
        assert_eq!(
            s.still_open().as_deref(),
            Some("ingress: 1 connections, 1 requests")
        );
        assert_eq!(
            s.poll(t0 + Duration::from_secs(1)),
            Step::ReadListeners,
            "each second"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_requests_held_notice_is_told_once_the_app_lets_go() {
        let (reply, _answer) = tokio::sync::oneshot::channel();
        let config = AgentConfig {
            fail_health_checks_at: HealthCheckFailAt::Off,
            ..sidecar()
        };
        let t0 = Instant::now();
        let mut s = Shutdown::begin_request(
            &config,
            DrainReason::Request(super::super::state::Via::Http),
            DrainOptions::default(),
            reply,
            t0,
            SystemTime::now(),
        );
        s.not_ready_said();
        assert_eq!(s.poll(t0), Step::ReadOutbound);
        s.outbound_sent(never());
        s.outbound_call = None;
        s.outbound_read(
            Ok(vec![envoy_listener(
                "out",
                Direction::Outbound,
                15001,
                false,
            )]),
            |_| true,
            t0,
        );
        probe(&mut s, t0, true);
        assert_eq!(s.poll(t0), Step::SendDrain);
        let options = s.drain_options(t0);
        assert!(options.hold_notice);
        s.drain_sent(
            t0,
            options.hold_notice,
            Box::pin(std::future::ready(Ok(accepted()))),
        );
        let Answer::Drain(result) = s.answer().await else {
            panic!("not the drain answered")
        };
        s.drain_answered(&result, t0);
        let at = t0 + APP_PROBE_EVERY;
        probe(&mut s, at, false);
        assert!(
            !matches!(s.poll(at), Step::TellNotice),
            "not before it has let go"
        );
        let gone = at + APP_LET_GO;
        assert_eq!(
            s.poll(gone),
            Step::TellNotice,
            "a request's timeline does not stop"
        );
        s.notice_told();
        assert!(!matches!(s.poll(gone), Step::TellNotice));
    }
}

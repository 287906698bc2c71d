//! The handoff: one hot restart at a time, as an explicit state machine.
//!
//! ```text
//!            trigger, turn comes          pre-flight passed         new epoch LIVE
//!   Idle ───────────────────────▶ PreFlight ─────────────────▶ Starting ───────────────▶ ParentDraining
//!    ▲  ◀── rejected ────────────────┘    ◀── exited / deadline ───┘                        │
//!    └──────────────────────────────────────────────── parent exited (or overdue, killed) ◀┘
//! ```
//!
//! When hot restart cannot work (the binary has another hot-restart version, or the family's
//! shared memory cannot take a next epoch), pre-flight leads to a cold handover instead:
//!
//! ```text
//!   PreFlight ── incompatible ──▶ Cold ── new family LIVE ──▶ Retiring ── old family gone ──▶ Idle
//!                                  └── exited / deadline ──▶ Idle (the old family serves on)
//! ```
//!
//! `Cold` runs epoch 0 of a new family (the other base id) beside the serving one, its
//! listeners bound beside the old ones (`SO_REUSEPORT`); `Retiring` drains the old family and
//! then stops it. A hot restart of the new family follows, to bind the configured admin port
//! again.
//!
//! Each state holds what only it needs: from pre-flight until its Envoy is LIVE or failed, a
//! handoff holds the node's epoch lock; once that Envoy runs, its LIVE checks; a starting
//! epoch whose serving parent died, that exit (the family's outcome if it fails too); a
//! predecessor pod's draining Envoy, when its sockets are looked at next.
//!
//! Triggers that arrive meanwhile wait in the queue and are coalesced into the one restart
//! that starts when the state is `Idle` again, so no third generation can ever exist. The
//! first epoch of a supervisor goes through the same states (with no parent of its own, or a
//! predecessor pod's Envoy as a foreign parent).

use std::time::{Duration, SystemTime};

use envoy_agent_proxy::{Exit, RestartError, XdsType};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::answers::Deferred;
use crate::epochs::Epochs;
use crate::host::Guard;
use crate::probing::Probing;

// The pace of a starting epoch's LIVE checks: `LiveChecks::gap` decides it.

/// How often a starting epoch is asked whether it is LIVE before its admin listener is bound
/// (the sign): the address may still be its parent's, and LIVE does not come before the sign.
/// This only covers a sign that never comes (a file Envoy failed to write).
pub(crate) const LIVE_POLL_UNBOUND: Duration = Duration::from_secs(1);
/// ... and when no sign can come at all (Envoy runs as another user; no watch).
pub(crate) const LIVE_POLL_BLIND: Duration = Duration::from_millis(50);
/// After the sign: the starting epoch's own admin is asked this often (one question in flight
/// at a time, `/ready` on a kept connection: the same cost at any config size) ...
pub(crate) const LIVE_POLL_FAST: Duration = Duration::from_millis(1);
/// ... for this long after the sign (a static config of 5000 clusters is LIVE ~2.5 s after it) ...
pub(crate) const LIVE_NEAR_BOUND: Duration = Duration::from_secs(5);
/// ... then this often (an epoch waiting for its control plane); also how soon discovery looks
/// again once the running version is known.
pub(crate) const LIVE_POLL: Duration = Duration::from_millis(10);

/// Someone waiting for a hot restart's outcome.
pub(crate) type Waiter = oneshot::Sender<Result<u32, RestartError>>;

/// Who an epoch's parent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Parent {
    /// One of ours.
    Ours(u32),
    /// Another pod's Envoy (a successor's first epoch took over from it).
    Foreign {
        /// Its epoch.
        epoch: u32,
        /// The predecessor pod's identity.
        identity: String,
    },
}

/// The generation a LIVE epoch took over from, while it drains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DrainingParent {
    /// One of ours.
    Ours(u32),
    /// A predecessor pod's Envoy. It may be gone before its child terminates it (its pod
    /// stopped), while the child still talks to it: its socket names are looked at from
    /// `look_at` on, every `FOREIGN_PARENT_CHECK`, and held by a stand-in once free.
    Foreign {
        /// Its epoch.
        epoch: u32,
        /// The predecessor pod's identity.
        identity: String,
        look_at: Instant,
    },
}

impl DrainingParent {
    pub(crate) fn epoch(&self) -> u32 {
        match self {
            DrainingParent::Ours(e) | DrainingParent::Foreign { epoch: e, .. } => *e,
        }
    }
}

/// A moment on both clocks, read together once: the monotonic one for durations and deadlines,
/// the wall one for the status and the heartbeat. A wall time computed again at each look
/// (`now - elapsed`) differs from call to call, and what is published would change with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Moment {
    pub(crate) at: Instant,
    pub(crate) wall: SystemTime,
}

impl Moment {
    /// `at` (a recent instant), with the wall time it was.
    pub(crate) fn of(at: Instant) -> Self {
        Moment {
            at,
            wall: SystemTime::now() - at.elapsed(),
        }
    }

    /// `after` from now, where now on the wall clock is `now_unix_ms`.
    pub(crate) fn after(after: Duration, now_unix_ms: u64) -> Self {
        Moment {
            at: Instant::now() + after,
            wall: SystemTime::UNIX_EPOCH + Duration::from_millis(now_unix_ms) + after,
        }
    }

    /// Its wall time in Unix milliseconds.
    pub(crate) fn unix_ms(&self) -> u64 {
        crate::node::to_unix_ms(self.wall)
    }
}

/// One hot restart (or a supervisor's first start), from trigger to outcome.
#[derive(Debug)]
pub(crate) struct Attempt {
    /// The epoch it starts.
    pub(crate) epoch: u32,
    /// Its parent, if any.
    pub(crate) parent: Option<Parent>,
    /// What triggered it.
    pub(crate) reason: String,
    /// When it was triggered (the first of its coalesced triggers).
    pub(crate) triggered: Moment,
    /// When its turn came (pre-flight started).
    pub(crate) began: Instant,
    /// How long pre-flight took.
    pub(crate) preflight: Duration,
    /// What pre-flight found (the pair to mark good at LIVE; whether it execed anything).
    pub(crate) checked: crate::host::Checked,
    /// When its epoch was spawned.
    pub(crate) spawned: Option<Instant>,
    /// How late LIVE was seen at most: since the last check that found the epoch not LIVE.
    pub(crate) live_seen_within: Option<Duration>,
    /// Who waits for its outcome.
    pub(crate) waiters: Vec<Waiter>,
    /// Same-epoch retries so far (a failed child took its parent's admin listener).
    pub(crate) retries: u32,
    /// The supervisor's first epoch (a start, or a cross-pod takeover), not a hot restart of
    /// its own.
    pub(crate) first: bool,
    /// Hot restart, or (decided at pre-flight) cold handover.
    pub(crate) kind: envoy_agent_proxy::HandoffKind,
    /// A cold handover across pods, planned at discovery: the predecessor's family (its base
    /// id) and who runs it.
    pub(crate) cold_from: Option<(u32, String)>,
    /// It settles a cold handover (binds the configured admin address again): it must not
    /// become another cold handover, or two inconsistent binaries would alternate forever.
    pub(crate) settles: bool,
    /// The dynamic types its epoch was last seen waiting for (its control plane's config):
    /// empty while none is known to be missing.
    pub(crate) waiting_for_config: Vec<envoy_agent_proxy::XdsType>,
}

/// A cold handover's new Envoy: epoch 0 of another family, not in the family's books until it
/// is LIVE (its epoch number says nothing beside the old family's).
#[derive(Debug)]
pub(crate) struct ColdChild {
    pub(crate) pid: u32,
    pub(crate) base_id: u32,
    pub(crate) signals: tokio::sync::mpsc::UnboundedSender<envoy_agent_proxy::Signal>,
    pub(crate) started_at: Instant,
}

impl Attempt {
    pub(crate) fn queued(&self) -> Duration {
        self.began - self.triggered.at
    }
}

/// When a starting epoch (or a cold handover's new family) is given up. The deadline passing
/// is not enough to kill it: a LIVE check sent after it must also find it not LIVE. An agent
/// that stalled (stopped, starved, a long page fault) sees its timer fire late, when the epoch
/// may have been LIVE and serving for seconds; the answers it had were asked before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deadline {
    /// Given up at this instant unless LIVE first.
    At(Instant),
    /// It passed; the last LIVE check goes out at or after this instant, and its "not LIVE"
    /// (or no answer within the admin client's timeout) gives the epoch up.
    Passed(Instant),
    /// Given up: killed (SIGKILL).
    Killed,
}

impl Deadline {
    /// When the deadline needs the loop next: only while it has not passed.
    pub(crate) fn wake(self) -> Option<Instant> {
        match self {
            Deadline::At(at) => Some(at),
            Deadline::Passed(_) | Deadline::Killed => None,
        }
    }

    /// What an answer that did not find the epoch LIVE, to a check sent at `sent`, means:
    /// `unknown` when the agent could not even ask (its own descriptors, memory), which says
    /// nothing of the epoch either way.
    pub(crate) fn after_not_live(self, sent: Instant, unknown: bool) -> NotLive {
        match self {
            Deadline::Passed(from) if sent >= from && !unknown => NotLive::GiveUp,
            Deadline::Passed(_) if unknown => NotLive::AskAgainIn(LIVE_POLL_BLIND),
            // Asked before the deadline passed: ask again, now.
            Deadline::Passed(_) => NotLive::AskAgainIn(Duration::ZERO),
            Deadline::At(_) | Deadline::Killed => NotLive::Poll,
        }
    }
}

/// Whose admin a new Envoy's LIVE checks reach, which sets their pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LiveSign {
    /// No sign can come (Envoy cannot write the admin address file: another user, or the
    /// directory cannot be watched): the checks are the only way to see LIVE.
    Blind,
    /// Its admin listener is not known to be bound yet: the configured address may still be
    /// the parent's, and LIVE does not come before the sign.
    Awaited,
    /// Its own admin answers since then (a hot restart's child bound the listener; a cold
    /// family's checks go to its own address from its spawn): LIVE is near.
    Seen(Instant),
}

/// The LIVE checks of a starting epoch, or of a cold handover's new family.
#[derive(Debug)]
pub(crate) struct LiveChecks {
    pub(crate) probing: Probing,
    /// What paces them.
    pub(crate) sign: LiveSign,
    /// When the latest answer that did not find it LIVE yet came: Envoy became LIVE after
    /// it was given, so it bounds how late the supervisor saw LIVE.
    pub(crate) missed: Option<Instant>,
}

impl LiveChecks {
    /// The checks of an Envoy spawned at `now`: the first after one gap.
    pub(crate) fn new(now: Instant, sign: LiveSign) -> Self {
        let mut checks = LiveChecks {
            probing: Probing::default(),
            sign,
            missed: None,
        };
        checks.probing.next = Some(now + checks.gap());
        checks
    }

    /// How long from a "not LIVE" answer to the next check: without a sign to go by, every
    /// [`LIVE_POLL_BLIND`]; while the sign is awaited, rarely (each such check asks the
    /// parent, busy handing its sockets to the child: at 50 ms a small config's child started
    /// ~6 ms slower); after it, every millisecond while LIVE is near, and every [`LIVE_POLL`]
    /// after that (a config to fetch from a control plane).
    pub(crate) fn gap(&self) -> Duration {
        match self.sign {
            LiveSign::Blind => LIVE_POLL_BLIND,
            LiveSign::Awaited => LIVE_POLL_UNBOUND,
            LiveSign::Seen(at) if at.elapsed() < LIVE_NEAR_BOUND => LIVE_POLL_FAST,
            LiveSign::Seen(_) => LIVE_POLL,
        }
    }

    /// An answer that came at `now`, before the deadline passed, did not find it LIVE: the
    /// next check at the usual pace.
    pub(crate) fn not_live_yet(&mut self, now: Instant) {
        self.missed = Some(now);
        self.probing.next = Some(now + self.gap());
    }
}

/// What to do after a LIVE check that did not find the starting epoch LIVE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotLive {
    /// The deadline passed before the check was sent: kill it.
    GiveUp,
    /// The deadline passed: the last check is asked again after this long.
    AskAgainIn(Duration),
    /// Before the deadline: the usual pace of LIVE checks.
    Poll,
}

/// Where the handoff is.
#[derive(Debug)]
pub(crate) enum Handoff {
    /// Nothing in flight.
    Idle,
    /// Pre-flight checks run for the attempt.
    PreFlight {
        attempt: Attempt,
        /// The node's epoch lock, held from the handoff's start until its epoch is LIVE or
        /// failed, so that no successor pod allocates an epoch meanwhile. None without a node,
        /// or when the lock could not be had and the restart goes on without it.
        lock: Option<Guard>,
    },
    /// The attempt's epoch runs and is not LIVE yet.
    Starting {
        attempt: Attempt,
        /// When it is given up (SIGKILL).
        deadline: Deadline,
        /// Still held (see `PreFlight`).
        lock: Option<Guard>,
        live: LiveChecks,
        /// Its parent, the serving epoch, exited meanwhile (a stand-in answers for it): the
        /// family's outcome if this epoch fails too.
        serving_exited: Option<Exit>,
        /// Drains and health-check failures asked meanwhile: the new epoch may take the
        /// admin listener, so they go to whichever Envoy serves once this settles.
        deferred: Deferred,
    },
    /// The previous generation drains until its child terminates it; no new epoch may start.
    ParentDraining {
        parent: DrainingParent,
        /// When the child terminates it (parent-shutdown time after LIVE); the heartbeat says
        /// its wall time, fixed once (computed again at each heartbeat it moved by a
        /// millisecond now and then, and rewrote an unchanged heartbeat).
        until: Moment,
    },
    /// A cold handover's new family starts beside the serving one.
    Cold {
        attempt: Attempt,
        deadline: Deadline,
        child: ColdChild,
        /// Still held (see `PreFlight`).
        lock: Option<Guard>,
        live: LiveChecks,
        /// As `Starting`'s: the new family may become the family.
        deferred: Deferred,
    },
    /// After a cold handover: the old family drains until `until`; what happens then depends
    /// on whose it is.
    Retiring { until: Instant, old: OldFamily },
}

/// The family that a cold handover retires.
#[derive(Debug)]
pub(crate) enum OldFamily {
    /// Ours: the old family's processes (`epochs`), retired once the last is gone; or, once
    /// a successor pod took ours over cold, our whole family (the supervisor's epochs) with
    /// whatever was left of an older one. SIGTERM at `until`, SIGKILL at `kill_at` (and again
    /// every backstop period while anything is left).
    Ours {
        kill_at: Option<Instant>,
        epochs: Epochs,
    },
    /// The predecessor pod's, whose agent drains and stops it: from `until` on, the configured
    /// admin address is looked at (at `look_at`, once one look found it still held) until it
    /// is free. Our heartbeat names the predecessor meanwhile, which tells it to retire.
    Foreign {
        predecessor: String,
        look_at: Option<Instant>,
    },
}

impl Handoff {
    /// The predecessor pod that our family took over from by a cold handover, until its Envoy
    /// is gone.
    pub(crate) fn cold_takeover_of(&self) -> Option<&str> {
        match self {
            Handoff::Retiring {
                old: OldFamily::Foreign { predecessor, .. },
                ..
            } => Some(predecessor),
            _ => None,
        }
    }

    /// The attempt in flight, if any.
    pub(crate) fn attempt(&self) -> Option<&Attempt> {
        match self {
            Handoff::PreFlight { attempt: a, .. } | Handoff::Starting { attempt: a, .. } => Some(a),
            _ => None,
        }
    }

    pub(crate) fn is_idle(&self) -> bool {
        matches!(self, Handoff::Idle)
    }

    /// The LIVE checks of the Envoy starting (an epoch, or a cold handover's new family).
    pub(crate) fn live_checks(&self) -> Option<&LiveChecks> {
        match self {
            Handoff::Starting { live, .. } | Handoff::Cold { live, .. } => Some(live),
            _ => None,
        }
    }

    pub(crate) fn live_checks_mut(&mut self) -> Option<&mut LiveChecks> {
        match self {
            Handoff::Starting { live, .. } | Handoff::Cold { live, .. } => Some(live),
            _ => None,
        }
    }

    /// The epoch starting, if any.
    pub(crate) fn starting_epoch(&self) -> Option<u32> {
        match self {
            Handoff::Starting { attempt, .. } => Some(attempt.epoch),
            _ => None,
        }
    }
}

/// Triggers waiting for their turn, coalesced.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    pub(crate) reasons: Vec<String>,
    pub(crate) waiters: Vec<Waiter>,
    pub(crate) since: Option<Moment>,
    /// Same-epoch retries carried over from a failed attempt.
    pub(crate) retries: u32,
    /// Why the queue waits, as last logged (logged once per change).
    pub(crate) waiting_for: Option<QueueWait>,
    /// One of the triggers settles a cold handover.
    pub(crate) settles: bool,
    /// Not to start before then: the back-off after an epoch waited for its control plane
    /// for the whole handoff deadline.
    pub(crate) not_before: Option<Instant>,
    /// Attempts in a row that ended waiting for the control plane (the back-off grows with
    /// them); reset when an epoch goes LIVE.
    pub(crate) config_waits: u32,
}

/// Why queued triggers wait, besides a handoff under way. Its words are the status's; when the
/// queue is tried again depends on the kind alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum QueueWait {
    /// Another pod holds the node's epoch lock (a successor is starting?): it is tried again at
    /// `retry_at`.
    Lock { retry_at: Instant },
    /// A successor pod has an epoch newer than ours (starting or serving): the restart would
    /// take the node back. Its handover refuses the queue; if it goes away instead, the
    /// restart is tried again at `retry_at`.
    Successor { identity: String, retry_at: Instant },
    /// The last attempt's epoch waited for these types of its control plane for the whole
    /// handoff deadline (the queue's `not_before` is the back-off).
    ControlPlane(Vec<XdsType>),
}

impl std::fmt::Display for QueueWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QueueWait::Lock { .. } => {
                f.write_str("another pod holds the node's epoch lock (a successor is starting?)")
            }
            QueueWait::Successor { identity, .. } => write!(
                f,
                "the successor pod {identity}, which has a newer epoch, to take over"
            ),
            QueueWait::ControlPlane(types) => write!(f, "the control plane: {}", type_list(types)),
        }
    }
}

/// `lds, cds`.
pub(crate) fn type_list(types: &[XdsType]) -> String {
    types
        .iter()
        .map(|t| t.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Queue {
    pub(crate) fn push(&mut self, reason: String, waiter: Option<Waiter>, now: Instant) {
        self.reasons.push(reason);
        self.waiters.extend(waiter);
        self.since.get_or_insert_with(|| Moment::of(now));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.reasons.is_empty()
    }

    /// Empties the queue into an attempt at `epoch`.
    pub(crate) fn take(&mut self, epoch: u32, parent: Option<Parent>, now: Instant) -> Attempt {
        let mut reasons = std::mem::take(&mut self.reasons);
        reasons.dedup();
        let attempt = Attempt {
            epoch,
            parent,
            reason: reasons.join(", "),
            triggered: self.since.take().unwrap_or_else(|| Moment::of(now)),
            began: now,
            preflight: Duration::ZERO,
            checked: crate::host::Checked::default(),
            spawned: None,
            live_seen_within: None,
            waiters: std::mem::take(&mut self.waiters),
            retries: std::mem::take(&mut self.retries),
            first: false,
            kind: envoy_agent_proxy::HandoffKind::Hot,
            settles: std::mem::take(&mut self.settles),
            cold_from: None,
            waiting_for_config: Vec::new(),
        };
        self.waiting_for = None;
        self.not_before = None;
        attempt
    }

    /// Answers every waiter with `error` and empties the queue.
    pub(crate) fn refuse(&mut self, error: &RestartError) {
        for waiter in self.waiters.drain(..) {
            let _ = waiter.send(Err(error.clone()));
        }
        self.reasons.clear();
        self.since = None;
        self.retries = 0;
        self.waiting_for = None;
        self.settles = false;
        self.not_before = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_queue_coalesces_triggers_into_one_attempt() {
        let mut q = Queue::default();
        let t0 = Instant::now();
        let (w1, r1) = oneshot::channel();
        q.push("SIGHUP".into(), Some(w1), t0);
        tokio::time::advance(Duration::from_millis(5)).await;
        q.push("SIGHUP".into(), None, Instant::now());
        q.push("config change".into(), None, Instant::now());
        let a = q.take(4, Some(Parent::Ours(3)), Instant::now());
        assert_eq!(a.reason, "SIGHUP, config change");
        assert_eq!(a.triggered.at, t0, "the first trigger's time");
        assert_eq!(a.queued(), Duration::from_millis(5));
        assert_eq!(a.waiters.len(), 1);
        assert!(q.is_empty());
        drop(a);
        assert!(r1.await.is_err(), "dropped with the attempt");
    }

    #[test]
    fn refusing_answers_every_waiter() {
        let mut q = Queue::default();
        let (w, mut r) = oneshot::channel();
        q.push("x".into(), Some(w), Instant::now());
        q.refuse(&RestartError::Refused("draining".into()));
        assert_eq!(
            r.try_recv().unwrap(),
            Err(RestartError::Refused("draining".into()))
        );
        assert!(q.is_empty());
    }
}

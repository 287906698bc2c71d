//! The handoff, step by step: the first epoch, the queue's turn, pre-flight, spawn, LIVE,
//! failure, and the timers of a handoff in flight (deadline, overdue parent, foreign parent).

use envoy_agent_proxy::{
    Ended, EpochState, Exit, HandoffKind, HandoffResult, Outcome, ProxyError, RestartError, Signal,
    WedgeReason,
};
use std::time::{Duration, SystemTime};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use super::{
    Event, FOREIGN_PARENT_CHECK, LOCK_RETRY, Life, Probe, StandIn, Supervisor, WATCHDOG_POLL, kept,
    last_line,
};
use crate::answers::Deferred;
use crate::epochs::Stop;
use crate::handoff::{
    Attempt, Deadline, DrainingParent, Handoff, LiveChecks, LiveSign, Moment, Parent, Queue,
    QueueWait,
};
use crate::host::{Checked, Guard, Host, Refusal};

impl<H: Host> Supervisor<H> {
    /// Our first epoch starts a new family beside the predecessor's (`from`, run by
    /// `identity`), which hot restart cannot take over (`why`): a cold handover across pods.
    pub(super) fn begin_first_cold(&mut self, from: u32, identity: String, why: String) {
        let now = Instant::now();
        let mut queue = Queue::default();
        queue.push(why, None, now);
        let mut attempt = queue.take(0, None, now);
        attempt.first = true;
        attempt.cold_from = Some((from, identity));
        let lock = self.end_discovery();
        self.start_preflight(attempt, lock);
    }

    pub(super) fn begin_first(&mut self, epoch: u32, parent: Option<Parent>, reason: String) {
        let now = Instant::now();
        let mut queue = Queue::default();
        queue.push(reason, None, now);
        let mut attempt = queue.take(epoch, parent, now);
        attempt.first = true;
        let lock = self.end_discovery();
        self.start_preflight(attempt, lock);
    }

    /// Our first epoch's turn came: the node's epoch lock that discovery took (if any) goes
    /// to its handoff.
    fn end_discovery(&mut self) -> Option<Guard> {
        match std::mem::replace(&mut self.life, Life::Starting) {
            Life::Discovering { lock, .. } => lock,
            other => {
                self.life = other;
                None
            }
        }
    }

    pub(super) fn start_preflight(&mut self, mut attempt: Attempt, lock: Option<Guard>) {
        attempt.began = Instant::now();
        tracing::info!(
            epoch = attempt.epoch,
            reason = %attempt.reason,
            queued = ?attempt.queued(),
            "hot restart: pre-flight checks"
        );
        // Beside our serving epoch, or a successor's first epoch beside the predecessor, which
        // runs our version (discovery checked).
        let beside = self.life.live().is_some() || attempt.parent.is_some();
        let running = self.version.known().filter(|_| beside).map(str::to_owned);
        // A first epoch with nothing to take over from risks nothing that Envoy's own start
        // would not say as well (and as fast): only an epoch beside a serving one is
        // validated first.
        let validate =
            attempt.parent.is_some() || self.life.live().is_some() || attempt.cold_from.is_some();
        let check = self.host.preflight(running, validate);
        let epoch = attempt.epoch;
        self.beside(check, move |(checked, result)| Event::PreFlight {
            epoch,
            checked,
            result,
        });
        self.handoff = Handoff::PreFlight { attempt, lock };
        self.write_heartbeat();
    }

    pub(super) async fn on_preflight(
        &mut self,
        epoch: u32,
        checked: Checked,
        result: Result<(), Refusal>,
    ) {
        let Handoff::PreFlight { attempt, .. } = &self.handoff else {
            return; // cancelled meanwhile
        };
        if attempt.epoch != epoch {
            return;
        }
        let Handoff::PreFlight { mut attempt, lock } =
            std::mem::replace(&mut self.handoff, Handoff::Idle)
        else {
            return;
        };
        attempt.preflight = attempt.began.elapsed();
        attempt.checked = checked;
        // Hot restart cannot work beside our own serving epoch: a cold handover can.
        let beside_ours = matches!(attempt.parent, Some(Parent::Ours(_)));
        if let (Some((from, _)), Ok(())) = (&attempt.cold_from, &result) {
            let (from, why) = (*from, attempt.reason.clone());
            self.start_cold(attempt, lock, why, from).await;
            return;
        }
        let result = match result {
            Err(Refusal::Incompatible { message, .. }) if beside_ours => {
                let from = self.base_id;
                self.start_cold(attempt, lock, message, from).await;
                return;
            }
            Err(refusal) => Err(refusal.message().to_owned()),
            Ok(()) if beside_ours => match self.shm_usable() {
                Ok(()) => Ok(()),
                Err(why) => {
                    let why = format!("the family's shared memory is unusable: {why}");
                    let from = self.base_id;
                    self.start_cold(attempt, lock, why, from).await;
                    return;
                }
            },
            Ok(()) => Ok(()),
        };
        match result {
            Ok(()) => self.spawn_epoch(attempt, lock, epoch).await,
            Err(message) => self.reject(attempt, lock, epoch, message),
        }
    }

    /// Pre-flight refused the new epoch: the attempt ends there, and the family with it when
    /// nothing serves.
    fn reject(&mut self, attempt: Attempt, lock: Option<Guard>, epoch: u32, message: String) {
        drop(lock);
        if self.life.live().is_none() {
            tracing::error!(epoch, error = %message, "pre-flight rejects the first epoch");
            self.finish(attempt, Outcome::Rejected, message.clone());
            self.begin_stop(Ended::StartFailed { code: 1, message }, "pre-flight failed");
        } else {
            self.finish(attempt, Outcome::Rejected, message);
        }
    }

    /// Pre-flight passed: spawns the new epoch, which has the handoff deadline to become LIVE
    /// (one that cannot be spawned ends the attempt, and the family with it when nothing
    /// serves).
    async fn spawn_epoch(&mut self, mut attempt: Attempt, lock: Option<Guard>, epoch: u32) {
        // Only a stand-in holding the socket names this epoch will bind must go (Envoy names
        // them after the epoch modulo 3); the others' children may still talk to them.
        self.release_stand_ins(
            |p| p % 3 == epoch % 3,
            "the next epoch reuses its socket names",
        );
        match self.host.spawn(epoch).await {
            Ok(spawned) => {
                self.files_ours |= epoch == 0;
                self.epochs.add(epoch, spawned.pid, spawned.signals);
                let sign = match spawned.admin_bound {
                    Some(bound) => {
                        let events = self.events_tx.clone();
                        tokio::spawn(
                            async move {
                                if bound.await.is_ok() {
                                    let _ = events.send(Event::AdminBound(epoch));
                                }
                            }
                            .instrument(tracing::info_span!(
                                "epoch",
                                epoch,
                                pid = spawned.pid
                            )),
                        );
                        LiveSign::Awaited
                    }
                    None => LiveSign::Blind,
                };
                let pid = spawned.pid;
                self.watch_exit(epoch, pid, spawned.exit);
                tracing::info!(event = "epoch_starting", epoch, pid, "epoch starting");
                let now = Instant::now();
                attempt.spawned = Some(now);
                self.handoff = Handoff::Starting {
                    attempt,
                    deadline: Deadline::At(now + self.config.options.handoff_deadline),
                    lock,
                    live: LiveChecks::new(now, sign),
                    serving_exited: None,
                    deferred: Deferred::default(),
                };
                // The node hears of each spawn.
                self.write_heartbeat();
                self.schedule_xds(now);
            }
            Err(e) => {
                drop(lock);
                let message = e.to_string();
                if self.life.live().is_none() {
                    self.finish(attempt, Outcome::Failed, message.clone());
                    self.begin_stop(
                        Ended::StartFailed { code: 1, message },
                        "cannot start envoy",
                    );
                } else {
                    self.finish(attempt, Outcome::Failed, message);
                }
            }
        }
    }

    /// Reports the exit of `epoch`'s process `pid` as an event, once it comes (a task of the
    /// epoch's own span).
    pub(super) fn watch_exit(
        &self,
        epoch: u32,
        pid: u32,
        exit: oneshot::Receiver<Result<Exit, ProxyError>>,
    ) {
        let events = self.events_tx.clone();
        tokio::spawn(
            async move {
                let result = exit.await.unwrap_or(Err(ProxyError::NotRunning));
                let _ = events.send(Event::Exited { epoch, pid, result });
            }
            .instrument(tracing::info_span!("epoch", epoch, pid)),
        );
    }

    /// The starting epoch's admin listener is bound: LIVE is near, look now and closely.
    pub(super) fn on_admin_bound(&mut self, epoch: u32) {
        let Handoff::Starting { attempt, live, .. } = &mut self.handoff else {
            return;
        };
        if attempt.epoch != epoch || live.sign != LiveSign::Awaited {
            return;
        }
        let now = Instant::now();
        tracing::debug!(
            epoch,
            since_spawn = ?attempt.spawned.map(|s| s.elapsed()),
            "the starting epoch's admin listener is bound: LIVE is near"
        );
        live.sign = LiveSign::Seen(now);
        if !live.probing.in_flight {
            live.probing.next = Some(now);
        }
    }

    pub(super) fn go_live(&mut self, epoch: u32) {
        let seen = Instant::now();
        let Handoff::Starting {
            mut attempt,
            lock,
            live,
            deferred,
            ..
        } = std::mem::replace(&mut self.handoff, Handoff::Idle)
        else {
            return;
        };
        attempt.live_seen_within = live.missed.map(|t| t.elapsed());
        self.host.passed_live(&attempt.checked);
        // Its admin is on the configured address (after a cold family's ephemeral one).
        self.host.switch_family(self.base_id, false);
        self.admin_answered(Instant::now());
        self.epochs.set_state(epoch, EpochState::Live);
        let now = Instant::now();
        self.handoff = match &attempt.parent {
            Some(Parent::Ours(p)) if self.epochs.get(*p).is_some() => {
                self.epochs.set_state(*p, EpochState::Draining);
                // Its child drains it now (Envoy's hot restart): its idle and streaming
                // clients are told to go while the child serves.
                self.host.tell_drain(self.base_id, *p);
                Handoff::ParentDraining {
                    parent: DrainingParent::Ours(*p),
                    until: Moment::after(
                        self.config.parent_shutdown_time(),
                        self.host.now_unix_ms(),
                    ),
                }
            }
            Some(Parent::Foreign { epoch, identity }) => {
                tracing::info!(epoch = attempt.epoch, predecessor = %identity, "took over from the predecessor's envoy");
                // The predecessor pod's notice file is in the node's state dir too.
                self.host.tell_drain(self.base_id, *epoch);
                // Until the child terminates it; a second of margin for its own timer.
                let drains = self.config.parent_shutdown_time() + Duration::from_secs(1);
                self.pods.foreign_parent_drains(SystemTime::now() + drains);
                Handoff::ParentDraining {
                    parent: DrainingParent::Foreign {
                        epoch: *epoch,
                        identity: identity.clone(),
                        look_at: now + FOREIGN_PARENT_CHECK,
                    },
                    until: Moment::after(drains, self.host.now_unix_ms()),
                }
            }
            _ => Handoff::Idle,
        };
        self.life.went_live(epoch);
        self.files_ours = true;
        // Our epoch is LIVE: the next successor (or restart) may allocate.
        drop(lock);
        self.metrics.epoch(epoch);
        self.queue.config_waits = 0;
        self.refresh_marker();
        // What it has of its config: readiness waits for it (the previous epoch's reading
        // stands meanwhile).
        self.want_xds(now);
        self.watchdog.start(now + WATCHDOG_POLL);
        // Whoever waits for this restart sees the new state at once; the files follow.
        self.publish();
        self.finish_at(attempt, Outcome::Live, String::new(), seen);
        self.write_heartbeat();
        self.settled(deferred);
        if self.version.is_unknown() {
            self.ask_version();
        }
    }

    pub(super) fn on_failed_start(&mut self, child: crate::epochs::Child, code: i32, tail: &str) {
        let epoch = child.epoch;
        let timed_out = matches!(child.stopped, Some((Stop::Deadline, _)));
        let message = if timed_out {
            format!(
                "not LIVE within the handoff deadline ({:?})",
                self.config.options.handoff_deadline
            )
        } else {
            format!("exited with code {code}: {}", last_line(tail))
        };
        let Handoff::Starting {
            attempt,
            lock,
            serving_exited,
            deferred,
            ..
        } = std::mem::replace(&mut self.handoff, Handoff::Idle)
        else {
            tracing::warn!(epoch, code, "an epoch exited while starting");
            return;
        };
        drop(lock);
        let foreign_first = attempt.first && matches!(attempt.parent, Some(Parent::Foreign { .. }));
        if timed_out
            && !attempt.waiting_for_config.is_empty()
            && (self.life.live().is_some() || foreign_first)
            && serving_exited.is_none()
        {
            // It waited for its control plane: no failure of the serving epoch's, and
            // nothing to recover but the restart itself (its parent's admin listener comes
            // back with the LIVE retry).
            let waiting = attempt.waiting_for_config.clone();
            self.config_wait_ended(attempt, &waiting);
            self.settled(deferred);
            self.watchdog.next_at(Instant::now() + WATCHDOG_POLL);
            return;
        }
        let outcome = if timed_out {
            Outcome::TimedOut
        } else {
            Outcome::Failed
        };
        if self.life.live().is_none() {
            tracing::error!(epoch, code, "envoy failed to start\n{}", tail.trim_end());
            self.finish(attempt, outcome, message.clone());
            // Nothing of ours serves: the first epoch failed, or the serving one died while
            // this one started.
            let ended = match serving_exited {
                Some(exit) => Ended::Lost {
                    message: format!(
                        "the serving epoch {} exited while epoch {epoch} started, and epoch {epoch} failed: {message}",
                        exit.epoch
                    ),
                    exit,
                },
                None => Ended::StartFailed { code, message },
            };
            deferred.not_serving();
            self.begin_stop(ended, "nothing serves");
            return;
        }
        let retries = attempt.retries;
        self.finish(attempt, outcome, message);
        self.settled(deferred);
        // The child may have shut the serving epoch's admin listener before it failed.
        self.probe(Probe::FailedChild { epoch, retries });
        self.watchdog.next_at(Instant::now() + WATCHDOG_POLL);
    }

    /// The starting epoch was not LIVE by the deadline, confirmed by a LIVE check sent after
    /// it: killed.
    pub(super) fn give_up_starting(&mut self) {
        let Handoff::Starting {
            attempt, deadline, ..
        } = &mut self.handoff
        else {
            return;
        };
        let epoch = attempt.epoch;
        *deadline = Deadline::Killed;
        let waiting = !attempt.waiting_for_config.is_empty();
        // SIGKILL, not SIGTERM: Envoy's SIGTERM handler also terminates its parent, which is
        // the epoch still serving (seen on 1.40).
        self.epochs
            .signal(epoch, Signal::SIGKILL, Some(Stop::Deadline));
        if !waiting {
            let message = format!(
                "epoch {epoch} not LIVE within the handoff deadline ({:?}); killed it \
                 (SIGKILL), the serving epoch keeps serving",
                self.config.options.handoff_deadline
            );
            self.record_wedge(WedgeReason::HandoffDeadline, message);
        }
    }

    pub(super) fn queue_retry_at(&self) -> Instant {
        // Immediately the first time; then at the lock's retry pace; never within a back-off.
        let at = match &self.queue.waiting_for {
            Some(QueueWait::Lock { retry_at } | QueueWait::Successor { retry_at, .. }) => *retry_at,
            None | Some(QueueWait::ControlPlane(_)) => Instant::now(),
        };
        self.queue.not_before.map_or(at, |t| t.max(at))
    }

    pub(super) fn can_restart(&self) -> bool {
        self.life.running()
            && self.life.live().is_some()
            && !self.orders.drained()
            // What the next binary must match.
            && self.version.known().is_some()
            // A parent kept through its child's crash still runs beside the fresh family: a
            // restart now would make three generations (the soak's seventh finding). Its exit,
            // or its deadline, lets the queue go on.
            && !matches!(self.kept, kept::KeptParent::Draining { .. })
    }

    /// The timers of a handoff in flight: the starting epoch's deadline, an overdue parent,
    /// the predecessor's Envoy draining as our first epoch's parent.
    pub(super) fn handoff_timers(&mut self, now: Instant) {
        match &self.handoff {
            Handoff::Starting {
                attempt,
                deadline: Deadline::At(at),
                ..
            } if now >= *at => {
                let epoch = attempt.epoch;
                if self.epochs.get(epoch).is_some_and(|c| c.stopped.is_none()) {
                    // Fresh facts first (see `Deadline`): a check in flight was sent before.
                    let Handoff::Starting { deadline, live, .. } = &mut self.handoff else {
                        return;
                    };
                    *deadline = Deadline::Passed(now);
                    if !live.probing.in_flight {
                        self.live_check();
                    }
                }
            }
            Handoff::ParentDraining {
                parent: DrainingParent::Ours(p),
                until,
            } if now >= until.at + self.config.parent_overdue_grace => {
                let p = *p;
                self.parent_overdue(p);
            }
            Handoff::ParentDraining {
                parent: DrainingParent::Foreign { .. },
                ..
            } => self.foreign_parent_timer(now),
            _ => {}
        }
    }

    /// Our draining parent `p` outlived its parent-shutdown time by the grace: killed, unless
    /// it has exited already.
    fn parent_overdue(&mut self, p: u32) {
        let running = self.epochs.get(p).filter(|c| c.stopped.is_none());
        // Fresh facts first: judged late (the agent stopped or starved past the deadline), a
        // parent that exited in time is a zombie whose exit is on its way.
        if running.is_some_and(|c| !self.host.still_runs(c.pid)) {
            tracing::debug!(
                epoch = p,
                "the overdue parent has exited; its exit is on its way"
            );
        } else if running.is_some() {
            let message = format!(
                "draining parent epoch {p} still runs {:?} after its parent-shutdown \
                 time: killed it (SIGKILL); a stand-in answers its child, and queued \
                 restarts go on",
                self.config.parent_overdue_grace
            );
            self.epochs.signal(p, Signal::SIGKILL, Some(Stop::Overdue));
            self.record_wedge(WedgeReason::ParentOverdue, message);
        }
    }

    /// While the predecessor's Envoy drains as our first epoch's parent: stands in for its
    /// sockets once it is gone, and ends the handoff at its drain time.
    fn foreign_parent_timer(&mut self, now: Instant) {
        let Handoff::ParentDraining {
            parent:
                DrainingParent::Foreign {
                    epoch,
                    identity,
                    look_at,
                },
            until,
        } = &mut self.handoff
        else {
            return;
        };
        let (epoch, until) = (*epoch, until.at);
        if now >= *look_at {
            *look_at = now + FOREIGN_PARENT_CHECK;
            let identity = identity.clone();
            // The names come free only once the predecessor's Envoy is gone: then our child
            // would abort on its next message to it. Hold them and answer.
            if !self.stand_ins.iter().any(|s| s.parent_epoch == epoch) {
                if let Ok(guard) = self.host.stand_in(epoch) {
                    if now < until {
                        tracing::warn!(event = "stand_in", epoch, predecessor = %identity, "the predecessor's envoy is gone before its time: standing in for its sockets");
                    }
                    self.stand_ins.push(StandIn {
                        parent_epoch: epoch,
                        _guard: guard,
                    });
                }
            }
        }
        if now >= until {
            self.handoff = Handoff::Idle;
            self.pods.foreign_parent_gone();
            self.write_heartbeat();
        }
    }

    pub(super) fn try_start_queued(&mut self, now: Instant) {
        let Some(newest) = self.life.live() else {
            return;
        };
        let lock = match self.host.try_lock() {
            Ok(Some(lock)) => Some(lock),
            Ok(None) => {
                let busy = QueueWait::Lock {
                    retry_at: now + LOCK_RETRY,
                };
                if !matches!(self.queue.waiting_for, Some(QueueWait::Lock { .. })) {
                    tracing::info!(reason = busy.to_string().as_str(), "hot restart queued");
                }
                self.queue.waiting_for = Some(busy);
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot take the node's epoch lock; restarting without it");
                None
            }
        };
        // Fresh facts under the lock: a successor pod that held it until its epoch (newer than
        // ours) went LIVE has taken the family over, and we may not have seen that yet. Our
        // restart would start a second epoch of that number from our old one and take the node
        // back (the soak saw it: a queued config change right after a successor's takeover).
        // The handover, once seen, refuses the queue; a successor that goes away lets it run.
        self.read_node();
        if let Some(successor) = self.pods.successor_starting().map(str::to_owned) {
            drop(lock);
            if !matches!(self.queue.waiting_for, Some(QueueWait::Successor { .. })) {
                tracing::info!(event = "restart_deferred", %successor, "a successor pod has a newer epoch: the queued restart waits (its handover refuses it)");
            }
            self.queue.waiting_for = Some(QueueWait::Successor {
                identity: successor,
                retry_at: now + LOCK_RETRY,
            });
            return;
        }
        let attempt = self.queue.take(newest + 1, Some(Parent::Ours(newest)), now);
        self.start_preflight(attempt, lock);
    }

    pub(super) fn finish(&mut self, attempt: Attempt, outcome: Outcome, message: String) {
        self.finish_at(attempt, outcome, message, Instant::now());
    }

    /// [`Self::finish`] of an attempt that ended at `ended` (LIVE: when the answer came, not
    /// after the marker and the state that follow it).
    pub(super) fn finish_at(
        &mut self,
        attempt: Attempt,
        outcome: Outcome,
        message: String,
        ended: Instant,
    ) {
        let duration = ended.saturating_duration_since(attempt.triggered.at);
        if !attempt.first {
            self.metrics
                .handoff(duration, outcome.as_str(), attempt.kind.as_str());
        }
        if outcome == Outcome::Rejected {
            self.metrics.config_rejected();
        }
        let spawn_to_live = attempt.spawned.map(|s| ended.saturating_duration_since(s));
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        match outcome {
            Outcome::Live => tracing::info!(
                event = "handoff",
                outcome = outcome.as_str(),
                kind = attempt.kind.as_str(),
                first = attempt.first,
                epoch = attempt.epoch,
                reason = %attempt.reason,
                duration_ms = ms(duration),
                queued_ms = ms(attempt.queued()),
                preflight_ms = ms(attempt.preflight),
                preflight_cache = attempt.checked.cache(),
                start_to_live_ms = spawn_to_live.map(ms),
                live_seen_within_ms = attempt.live_seen_within.map(ms),
                "{}",
                match (&attempt.kind, attempt.first) {
                    (HandoffKind::Cold { .. }, _) => "cold handover done: the new family is LIVE",
                    (HandoffKind::Hot, true) => "first epoch LIVE",
                    (HandoffKind::Hot, false) => "hot restart done: epoch LIVE",
                }
            ),
            _ => tracing::error!(
                event = "handoff",
                outcome = outcome.as_str(),
                kind = attempt.kind.as_str(),
                first = attempt.first,
                epoch = attempt.epoch,
                reason = %attempt.reason,
                preflight_cache = attempt.checked.cache(),
                error = %message,
                "{}",
                if attempt.first && self.life.serving().is_none() {
                    "the first epoch did not start: nothing serves"
                } else {
                    "hot restart did not happen; the serving epoch keeps serving"
                }
            ),
        }
        for waiter in attempt.waiters {
            let _ = waiter.send(match outcome {
                Outcome::Live => Ok(attempt.epoch),
                Outcome::Rejected => Err(RestartError::Rejected(message.clone())),
                Outcome::Failed | Outcome::TimedOut => Err(RestartError::Failed(message.clone())),
            });
        }
        let fresh_start = attempt.first && attempt.parent.is_none() && attempt.cold_from.is_none();
        let result = HandoffResult {
            epoch: attempt.epoch,
            reason: attempt.reason,
            outcome,
            duration,
            queued: attempt.began - attempt.triggered.at,
            preflight: attempt.preflight,
            at: SystemTime::now(),
            message,
            kind: attempt.kind,
            fresh_start,
        };
        self.history.handoff(result);
    }
}

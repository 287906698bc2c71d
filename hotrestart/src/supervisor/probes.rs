//! Admin probes and what their answers decide: discovery of a predecessor, LIVE, takeover by
//! a successor, the stop-time successor question (the watchdog's answers: `watchdog`).

use envoy_agent_proxy::admin::AdminState;
use envoy_agent_proxy::{
    AdminError, Ended, EpochState, Exit, RestartError, ServerInfo, ServerState,
};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{
    DISCOVERY_POLL, Event, INCOMPATIBLE_REPORT, LOCK_RETRY, Life, MAX_RETRIES, Probe, START_REASON,
    Supervisor, Waiting,
};
use crate::discovery;
use crate::discovery::Discovery;
use crate::handoff::{Handoff, LIVE_POLL, LiveSign, NotLive, Parent};
use crate::host::Host;
use crate::probing::Probing;

impl<H: Host> Supervisor<H> {
    pub(super) fn on_discovery(&mut self, result: Result<ServerInfo, AdminError>) {
        if result.is_ok() && self.wait_for_version() {
            return;
        }
        let now_ms = self.host.now_unix_ms();
        let others = self.read_node();
        let (waiting, reported_incompatible) = match &mut self.life {
            Life::Discovering {
                waiting,
                look,
                reported_incompatible,
                ..
            } => {
                *look = Probing {
                    next: Some(Instant::now() + DISCOVERY_POLL),
                    in_flight: false,
                };
                (waiting.clone(), *reported_incompatible)
            }
            // A late answer: the start was given up meanwhile.
            _ => return,
        };
        // Only an answer is weighed against our version, and an answer waits for it (above).
        let ours = self.version.known().unwrap_or_default().to_owned();
        let decision = discovery::decide(
            &others,
            &result,
            &self.admin_address(),
            &self.base_ids(),
            &ours,
            self.config.options.generation,
            now_ms,
        );
        self.follow_discovery(
            decision,
            result.as_ref().ok(),
            ours,
            waiting.as_ref(),
            reported_incompatible,
        );
    }

    /// Someone answers on the admin address and our version is not known: only our own
    /// version tells whether we can take over. Asks it, and looks again once it is known;
    /// whether discovery waits for it.
    fn wait_for_version(&mut self) -> bool {
        let Life::Discovering { look, .. } = &mut self.life else {
            return false;
        };
        if self.version.known().is_some() {
            return false;
        }
        *look = Probing {
            next: Some(Instant::now() + LIVE_POLL),
            in_flight: false,
        };
        if self.version.is_unknown() {
            self.ask_version();
        }
        true
    }

    /// Acts on discovery's `decision`. `answer`: what answered on the admin address; `ours`:
    /// our version; `waiting`, `reported_incompatible`: why discovery waited until now, and
    /// when an incompatible Envoy was last reported.
    fn follow_discovery(
        &mut self,
        decision: Discovery,
        answer: Option<&ServerInfo>,
        ours: String,
        waiting: Option<&Waiting>,
        reported_incompatible: Option<Instant>,
    ) {
        match decision {
            Discovery::Fresh => self.start_fresh(),
            Discovery::TakeOver {
                epoch,
                base_id,
                identity,
            } => self.take_over(epoch, base_id, identity, answer),
            Discovery::Incompatible {
                theirs,
                base_id,
                identity,
            } if self.other_base_id(base_id).is_some() => {
                let who = identity
                    .unwrap_or_else(|| "an envoy of the family without a heartbeat".to_owned());
                let why = format!(
                    "the node's envoy ({who}) has hot-restart version {theirs}, ours {ours}"
                );
                self.pods.predecessor_is(who.clone());
                self.begin_first_cold(base_id, who, why);
            }
            Discovery::Incompatible {
                theirs, identity, ..
            } => self.wait_beside_incompatible(theirs, identity, ours, reported_incompatible),
            Discovery::Newer { identity, theirs } => {
                let why = Waiting::NewerPod {
                    identity,
                    theirs,
                    ours: self.config.options.generation,
                };
                if waiting != Some(&why) {
                    tracing::warn!(event = "newer_pod_serves", reason = %why, "not taking over");
                }
                self.set_waiting(why, reported_incompatible);
            }
            Discovery::Wait(why) => {
                let why = Waiting::Node(why);
                if waiting != Some(&why) {
                    tracing::info!(reason = %why, "waiting to take over");
                }
                self.set_waiting(why, reported_incompatible);
            }
        }
    }

    /// No Envoy of the family runs on the node: a family of our own, at epoch 0.
    fn start_fresh(&mut self) {
        tracing::info!("no live predecessor on this node: starting at epoch 0");
        // A family of our own: our channel (not one a crashed family took over).
        if let Some(hot) = &self.config.proxy.hot_restart {
            self.host.use_socket_path(hot.socket_path.clone());
        }
        self.begin_first(0, None, START_REASON.to_owned());
    }

    /// The node's Envoy cannot be hot-restarted from and no cold handover can start beside
    /// it: wait, saying so at most every [`INCOMPATIBLE_REPORT`].
    fn wait_beside_incompatible(
        &mut self,
        theirs: String,
        identity: Option<String>,
        ours: String,
        reported: Option<Instant>,
    ) {
        let mut reported = reported;
        if reported.is_none_or(|t| t.elapsed() >= INCOMPATIBLE_REPORT) {
            reported = Some(Instant::now());
            tracing::error!(
                predecessor = identity.as_deref().unwrap_or("unknown"),
                theirs = %theirs,
                ours = %ours,
                "the node's envoy has another hot-restart version: it cannot be \
                 hot-restarted from; not starting until it is gone (see the runbook)"
            );
        }
        self.set_waiting(Waiting::Incompatible { theirs, ours }, reported);
    }

    /// Why discovery waits, while it still does (the start may have been given up).
    fn set_waiting(&mut self, why: Waiting, reported: Option<Instant>) {
        if let Life::Discovering {
            waiting,
            reported_incompatible,
            ..
        } = &mut self.life
        {
            *waiting = Some(why);
            *reported_incompatible = reported;
        }
    }

    /// Starts our first epoch as the child of the predecessor's LIVE Envoy at `epoch`, of the
    /// family under `base_id`; `answer`: what that Envoy said of itself.
    fn take_over(
        &mut self,
        epoch: u32,
        base_id: u32,
        identity: Option<String>,
        answer: Option<&ServerInfo>,
    ) {
        let who =
            identity.unwrap_or_else(|| "an envoy of the family without a heartbeat".to_owned());
        if base_id != self.base_id {
            // The family went on under our other base id (a cold handover).
            self.set_base_id(base_id);
            self.host.switch_family(base_id, false);
        }
        if let Err(why) = self.shm_usable() {
            // Our epoch could not attach to the family's segment: a family of our own
            // beside it instead.
            self.pods.predecessor_is(who.clone());
            let why = format!("the node family's shared memory is unusable: {why}");
            self.begin_first_cold(base_id, who, why);
            return;
        }
        if let Some(info) = answer {
            self.use_parents_channel(info);
        }
        tracing::info!(predecessor = %who, epoch = epoch + 1, "hot-restarting from the predecessor's envoy");
        self.pods.predecessor_is(who.clone());
        self.begin_first(
            epoch + 1,
            Some(Parent::Foreign {
                epoch,
                identity: who.clone(),
            }),
            format!("take over from {who}"),
        );
    }

    /// A child must use its parent's channel: the predecessor's (an older agent's family may
    /// use Envoy's abstract default).
    fn use_parents_channel(&mut self, info: &ServerInfo) {
        if info.socket_path == self.host.socket_path() {
            return;
        }
        if info.socket_path.is_abstract() {
            tracing::warn!(
                event = "hot_restart_channel",
                socket_path = %info.socket_path,
                private = false,
                "the predecessor's family uses abstract hot-restart sockets, which every process on the node can reach: this family keeps them (a child must use its parent's) until its next cold handover"
            );
        } else {
            tracing::info!(event = "hot_restart_channel", socket_path = %info.socket_path, private = true, "the predecessor's hot-restart channel");
        }
        self.host.use_socket_path(info.socket_path.clone());
    }

    /// Asks whether a newer epoch than ours answers on the admin address, beside the loop.
    pub(super) fn probe(&mut self, probe: Probe) {
        if matches!(probe, Probe::Watchdog) {
            self.watchdog.sent();
        }
        // The epoch each probe's answer is weighed against (see `takeover_seen`): only a newer
        // one's state matters.
        let ours = match &probe {
            Probe::Watchdog => self.life.live(),
            Probe::Successor(_) => self.life.live().or(self.epochs.newest().map(|c| c.epoch)),
            Probe::ServingExited(exit) => Some(exit.epoch),
            Probe::FailedChild { .. } => None,
        };
        // The watchdog's steady checks keep their connection; not while a successor starts
        // (its takeover is expected: a kept connection would go on reaching ours).
        let kept = matches!(probe, Probe::Watchdog) && self.pods.successor_starting().is_none();
        let call = self.host.newer_epoch(ours, kept);
        let sent = Instant::now();
        self.beside(call, move |result| Event::Probed {
            probe,
            sent,
            result,
        });
    }

    /// Asks who answers on the admin address, in full (discovery), beside the loop.
    fn discover_probe(&mut self) {
        if let Life::Discovering { look, .. } = &mut self.life {
            look.in_flight = true;
        }
        let call = self.host.server_info();
        self.beside(call, Event::Discovered);
    }

    /// Asks whether the starting epoch is LIVE, beside the loop.
    pub(super) fn live_check(&mut self) {
        let Handoff::Starting { attempt, live, .. } = &mut self.handoff else {
            return;
        };
        live.probing.in_flight = true;
        let epoch = attempt.epoch;
        // Once its admin listener is bound the address is the starting epoch's: its checks
        // can share a connection.
        let call = self
            .host
            .live_check(matches!(live.sign, LiveSign::Seen(_)).then_some(epoch));
        let sent = Instant::now();
        self.beside(call, move |result| Event::LiveChecked {
            epoch,
            sent,
            result,
        });
    }

    pub(super) fn on_probe(
        &mut self,
        probe: Probe,
        sent: Instant,
        result: Result<Option<AdminState>, AdminError>,
    ) {
        match probe {
            Probe::Watchdog => {
                self.watchdog.returned();
                self.on_watchdog(sent, result);
            }
            Probe::Successor(reply) => self.answer_successor(reply, &result),
            Probe::ServingExited(exit) => self.on_serving_exited(exit, &result),
            Probe::FailedChild { epoch, retries } => {
                // Only a LIVE child gives the family an admin endpoint back once a failed one
                // shut the serving epoch's.
                if result.is_err() && self.life.running() && !self.orders.drained() {
                    self.retry_for_admin(epoch, retries + 1);
                }
            }
        }
    }

    /// A stop is coming: tells the asker whether a successor takes over, from the probe's
    /// `result` (a takeover it shows is a handover now).
    fn answer_successor(
        &mut self,
        reply: oneshot::Sender<Option<String>>,
        result: &Result<Option<AdminState>, AdminError>,
    ) {
        let ours = self.life.live().or(self.epochs.newest().map(|c| c.epoch));
        if let Some(successor) = self.takeover_seen(result, ours) {
            self.hand_over(successor);
        }
        let answer = match &self.life {
            Life::HandedOver { successor } => Some(successor.clone()),
            _ => self.pods.successor_starting().map(str::to_owned),
        };
        tracing::info!(successor = ?answer, "asked whether a successor takes over");
        // The asker reads the state next: publish first.
        self.publish();
        let _ = reply.send(answer);
    }

    /// Our serving epoch exited and the probe's `result` says who serves now: a successor
    /// (handed over), or nobody (the family stops).
    fn on_serving_exited(&mut self, exit: Exit, result: &Result<Option<AdminState>, AdminError>) {
        if let Some(successor) = self.takeover_seen(result, Some(exit.epoch)) {
            tracing::info!(epoch = exit.epoch, %successor, "our envoy was terminated by the successor's");
            self.hand_over(successor);
            return;
        }
        if matches!(self.life, Life::Stopping { .. } | Life::HandedOver { .. }) {
            return;
        }
        // Nothing serves: the family stops. A draining parent may keep its in-flight
        // requests through the crash (then it is not stopped with the rest).
        self.keep_draining_parent();
        let code = exit.code();
        if code == 0 {
            let message = format!(
                "the serving envoy (epoch {}) exited with code 0 while no other epoch \
                 serves and no successor took over: it was terminated from outside \
                 (e.g. by another pod's failed epoch)",
                exit.epoch
            );
            tracing::error!(%message);
            self.begin_stop(Ended::Lost { exit, message }, "nothing serves");
        } else {
            tracing::error!(
                epoch = exit.epoch,
                code,
                "the serving epoch exited\n{}",
                exit.stderr_tail.trim_end()
            );
            self.begin_stop(Ended::Exited(exit), "the serving epoch exited");
        }
    }

    /// The serving epoch lost its admin endpoint to failed epoch `epoch`: the same epoch is
    /// tried again (this is retry `retries`), up to [`MAX_RETRIES`].
    fn retry_for_admin(&mut self, epoch: u32, retries: u32) {
        if retries <= MAX_RETRIES {
            tracing::warn!(
                epoch,
                retries,
                "the serving epoch lost its admin endpoint to the failed child; retrying the same epoch"
            );
            self.queue.retries = self.queue.retries.max(retries);
            self.queue.push(
                format!("retry {retries} after failed epoch {epoch}"),
                None,
                Instant::now(),
            );
        } else {
            tracing::error!(
                epoch,
                "the serving epoch has no admin endpoint and the retries are used up"
            );
        }
    }

    /// Whether the admin answer shows a newer epoch of the family that is not ours: a
    /// successor pod's Envoy took over. Its supervisor's name if so.
    ///
    /// Only a hot-restart child of our Envoy (so of our base id) can take its admin address
    /// over, so a newer epoch there that is not ours is a successor's.
    pub(super) fn takeover_seen(
        &mut self,
        result: &Result<Option<AdminState>, AdminError>,
        ours: Option<u32>,
    ) -> Option<String> {
        let info = result.as_ref().ok()?.as_ref()?;
        let ours = ours?;
        if info.state != ServerState::Live
            || info.epoch <= ours
            || self.epochs.get(info.epoch).is_some()
        {
            return None;
        }
        let others = self.read_node();
        Some(
            others
                .iter()
                .find(|h| h.newest_epoch == info.epoch)
                .map(|h| h.identity.clone())
                .unwrap_or_else(|| format!("the supervisor of epoch {}", info.epoch)),
        )
    }

    pub(super) fn hand_over(&mut self, successor: String) {
        if !self.life.running() {
            return;
        }
        tracing::info!(event = "handed_over", %successor, "handed over to {successor}");
        if let Some(n) = self.life.live() {
            self.epochs.set_state(n, EpochState::Draining);
        }
        self.life = Life::HandedOver {
            successor: successor.clone(),
        };
        self.pods.successor_took_over();
        self.set_marker(false);
        self.queue.refuse(&RestartError::Refused(format!(
            "handed over to {successor}"
        )));
        // The successor's Envoy serves now: ours is no longer asked.
        self.watchdog.handed_over();
        self.write_heartbeat();
    }

    /// The answer of a LIVE check sent at `sent`. The answering Envoy is ours when it is LIVE
    /// at our starting epoch while our process of that epoch runs: two Envoys of one base id
    /// cannot both hold an epoch's hot-restart sockets, so no other process of the family can
    /// be that epoch. A fresh epoch 0 also proves it is not an older Envoy squatting on the
    /// admin port (an orphan of an earlier container, another family): it has not been up
    /// longer than ours. (A child's `server.uptime` counts from its chain's first epoch.)
    pub(super) fn on_live_check(
        &mut self,
        epoch: u32,
        sent: Instant,
        result: Result<Option<AdminState>, AdminError>,
    ) {
        let Some(attempt) = self.handoff.attempt().filter(|a| a.epoch == epoch) else {
            return;
        };
        let fresh = attempt.parent.is_none() && self.life.live().is_none();
        let ours = match (&result, self.epochs.get(epoch)) {
            (Ok(Some(live)), Some(child)) => {
                live.epoch == epoch
                    && child.state == EpochState::Starting
                    && child.stopped.is_none()
                    && (!fresh
                        || live.uptime.is_none_or(|up| {
                            up <= child.started_at.elapsed() + Duration::from_secs(2)
                        }))
            }
            _ => false,
        };
        let deadline = match &self.handoff {
            Handoff::Starting { deadline, .. } => *deadline,
            _ => return,
        };
        // No answer for want of the agent's own descriptors says nothing of the epoch.
        let unknown = matches!(&result, Err(e) if e.is_local_resource());
        if ours {
            self.go_live(epoch);
            return;
        }
        let Handoff::Starting { live: checks, .. } = &mut self.handoff else {
            return;
        };
        match deadline.after_not_live(sent, unknown) {
            NotLive::GiveUp => self.give_up_starting(),
            NotLive::AskAgainIn(gap) => checks.probing.next = Some(Instant::now() + gap),
            // Envoy answered "not LIVE" before this moment (and after `sent`).
            NotLive::Poll => checks.not_live_yet(Instant::now()),
        }
    }

    /// Discovery's next step: the node's epoch lock, then a look at the node.
    pub(super) fn discover(&mut self, now: Instant) {
        let Life::Discovering {
            lock,
            look,
            waiting,
            ..
        } = &mut self.life
        else {
            return;
        };
        if lock.is_none() {
            match self.host.try_lock() {
                Ok(Some(taken)) => *lock = Some(taken),
                Ok(None) => {
                    if *waiting != Some(Waiting::Lock) {
                        tracing::info!(reason = %Waiting::Lock, "waiting to take over");
                    }
                    look.next = Some(now + LOCK_RETRY);
                    *waiting = Some(Waiting::Lock);
                    return;
                }
                Err(e) => {
                    let message = format!("cannot take the node's epoch lock: {e}");
                    tracing::error!(%message);
                    self.begin_stop(Ended::StartFailed { code: 1, message }, "no epoch lock");
                    return;
                }
            }
        }
        self.discover_probe();
    }
}

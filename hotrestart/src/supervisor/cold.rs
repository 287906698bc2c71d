//! The cold handover: where hot restart cannot work (another hot-restart version, a shared
//! memory segment a next epoch cannot attach to), a new family starts beside the serving one
//! and takes over once LIVE.
//!
//! - **Start**: epoch 0 under the other base id (families alternate between `--base-id` and
//!   `--cold-base-id`), admin on an ephemeral port (the old family holds the configured one),
//!   listeners bound beside the old family's through `SO_REUSEPORT` (Envoy's default on
//!   Linux). The serving family is not touched: a new family that fails or misses the handoff
//!   deadline is stopped and the old one serves on, as after a failed hot restart.
//! - **Switch** (the new family is LIVE): the old family is told to drain gracefully (every
//!   listener: the new family serves them all), its processes move into the retiring state
//!   (`OldFamily::Ours`), the new Envoy becomes epoch 0 of the family, and the host reaches its
//!   admin from now on.
//!   The readiness marker stays: something of ours was LIVE throughout.
//! - **Retire**: after the drain time the old family is terminated (SIGTERM, SIGKILL after
//!   the stop grace). Connections still queued on its listen sockets when they close are reset
//!   by the kernel unless `net.ipv4.tcp_migrate_req` is 1 (Linux 5.14+: they move to the new
//!   family's sockets of the same `SO_REUSEPORT` group); the handover event says which.
//! - **Settle**: a hot restart of the new family follows, so that its admin listens on the
//!   configured address again.

use envoy_agent_proxy::{HandoffKind, Scope};

use envoy_agent_proxy::{AdminError, Ended, EpochState, Exit};

use envoy_agent_proxy::admin::AdminState;
use envoy_agent_proxy::{Outcome, ProxyError, Signal, WedgeReason};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use super::retired::Retired;
use super::{
    Event, FOREIGN_PARENT_CHECK, FamilyError, Life, STOP_BACKSTOP, Supervisor, WATCHDOG_POLL,
    exit_kind, last_line,
};
use crate::answers::Deferred;
use crate::discovery;
use crate::epochs::{Epochs, Stop};
use crate::handoff::{
    Attempt, ColdChild, Deadline, Handoff, LiveChecks, LiveSign, NotLive, OldFamily,
};
use crate::host::{Guard, Host};

/// Where the kernel says whether a closing listener's queued connections migrate.
const TCP_MIGRATE_REQ: &str = "/proc/sys/net/ipv4/tcp_migrate_req";

impl<H: Host> Supervisor<H> {
    /// The base ids a family of ours runs under: `--base-id`, and `--cold-base-id` once a
    /// cold handover started one there.
    pub(super) fn base_ids(&self) -> Vec<u32> {
        let configured = self.config.proxy.hot_restart.as_ref().map(|h| h.base_id);
        configured
            .into_iter()
            .chain(self.config.options.cold_base_id)
            .chain(std::iter::once(self.base_id))
            .fold(Vec::new(), |mut ids, id| {
                if !ids.contains(&id) {
                    ids.push(id);
                }
                ids
            })
    }

    /// Whether a family under `base_id` is one of ours (this agent's, or a predecessor's of
    /// the same configuration).
    pub(super) fn ours(&self, base_id: u32) -> bool {
        self.base_ids().contains(&base_id)
    }

    /// The base id a cold handover from a family under `from` starts the new family under,
    /// when cold handovers are on and possible here.
    pub(super) fn other_base_id(&self, from: u32) -> Option<u32> {
        let cold = self.config.options.cold_base_id?;
        if !self.host.cold_possible() {
            return None;
        }
        let configured = self.config.proxy.hot_restart.as_ref()?.base_id;
        Some(if from == cold { configured } else { cold })
    }

    /// Hot restart cannot work (`why`): starts the new family for a cold handover, or refuses
    /// the restart when cold handovers are off.
    pub(super) async fn start_cold(
        &mut self,
        mut attempt: Attempt,
        lock: Option<Guard>,
        why: String,
        from_base_id: u32,
    ) {
        let base_id = self
            .other_base_id(from_base_id)
            .filter(|_| !attempt.settles);
        let Some(base_id) = base_id else {
            drop(lock);
            let off = if attempt.settles {
                "the restart after a cold handover does not hand over cold again; the admin \
                 stays on its ephemeral port until a restart works"
            } else if self.config.options.cold_base_id.is_none() {
                "--no-cold-handover"
            } else {
                "envoy runs as another user and cannot tell the agent its admin address"
            };
            let message = format!("{why}; a cold handover would be needed and is off ({off})");
            self.finish(attempt, Outcome::Rejected, message);
            return;
        };
        attempt.epoch = 0;
        attempt.kind = HandoffKind::Cold {
            why: why.clone(),
            from_base_id,
            to_base_id: base_id,
        };
        tracing::warn!(
            event = "cold_handover",
            stage = "starting",
            from_base_id,
            to_base_id = base_id,
            predecessor = attempt.cold_from.as_ref().map(|(_, who)| who.as_str()),
            %why,
            "hot restart cannot work: starting a new envoy family beside the serving one"
        );
        match self.host.spawn_cold(base_id).await {
            Ok(spawned) => {
                let pid = spawned.pid;
                // Epoch 0 of the new family, once it is ours; until then its pid tells it from
                // the old family's epoch 0.
                self.watch_exit(0, pid, spawned.exit);
                tracing::info!(
                    event = "epoch_starting",
                    epoch = 0,
                    pid,
                    base_id,
                    "new family's epoch 0 starting (cold handover)"
                );
                let now = Instant::now();
                attempt.spawned = Some(now);
                self.handoff = Handoff::Cold {
                    attempt,
                    deadline: Deadline::At(now + self.config.options.handoff_deadline),
                    lock,
                    child: ColdChild {
                        pid,
                        base_id,
                        signals: spawned.signals,
                        started_at: now,
                    },
                    // Its checks go to its own address (from its file): no parent to spare.
                    live: LiveChecks::new(now, LiveSign::Seen(now)),
                    deferred: Deferred::default(),
                };
                // The node hears of each spawn.
                self.write_heartbeat();
            }
            Err(e) => {
                drop(lock);
                self.finish(attempt, Outcome::Failed, e.to_string());
            }
        }
    }

    /// Asks whether the cold handover's new family is LIVE, beside the loop.
    pub(super) fn cold_live_check(&mut self) {
        let Handoff::Cold { child, live, .. } = &mut self.handoff else {
            return;
        };
        live.probing.in_flight = true;
        let pid = child.pid;
        let call = self.host.cold_live_check(child.base_id);
        let sent = Instant::now();
        self.beside(call, move |result| Event::ColdLiveChecked {
            pid,
            sent,
            result,
        });
    }

    pub(super) fn on_cold_live_check(
        &mut self,
        pid: u32,
        sent: Instant,
        result: Result<Option<AdminState>, AdminError>,
    ) {
        let Handoff::Cold {
            child, deadline, ..
        } = &self.handoff
        else {
            return;
        };
        if child.pid != pid || *deadline == Deadline::Killed {
            return;
        }
        let deadline = *deadline;
        let live = match &result {
            // Epoch 0 of a process no older than the one we started (a stale address file
            // could name another).
            Ok(Some(state)) => {
                state.epoch == 0
                    && state
                        .uptime
                        .is_none_or(|up| up <= child.started_at.elapsed() + Duration::from_secs(2))
            }
            _ => false,
        };
        let unknown = matches!(&result, Err(e) if e.is_local_resource());
        if live {
            self.go_cold_live();
            return;
        }
        let Handoff::Cold { live: checks, .. } = &mut self.handoff else {
            return;
        };
        match deadline.after_not_live(sent, unknown) {
            NotLive::GiveUp => self.give_up_cold(),
            NotLive::AskAgainIn(gap) => checks.probing.next = Some(Instant::now() + gap),
            NotLive::Poll => checks.not_live_yet(Instant::now()),
        }
    }

    /// The new family is LIVE: it becomes the family, the old one drains and retires.
    fn go_cold_live(&mut self) {
        let seen = Instant::now();
        let Handoff::Cold {
            mut attempt,
            child,
            lock,
            live,
            deferred,
            ..
        } = std::mem::replace(&mut self.handoff, Handoff::Idle)
        else {
            return;
        };
        attempt.live_seen_within = live.missed.map(|t| t.elapsed());
        let foreign = attempt.cold_from.as_ref().map(|(_, who)| who.clone());
        if foreign.is_none() {
            // Told while the host still reaches the old family's admin.
            self.drain_for_retirement();
        }
        self.host.switch_family(child.base_id, true);
        self.host.passed_live(&attempt.checked);
        let from_base_id = match &attempt.kind {
            HandoffKind::Cold { from_base_id, .. } => *from_base_id,
            HandoffKind::Hot => self.base_id,
        };
        let mut old = std::mem::take(&mut self.epochs);
        let epochs: Vec<u32> = old.iter().map(|c| c.epoch).collect();
        for epoch in epochs {
            old.set_state(epoch, EpochState::Draining);
        }
        self.epochs.add(0, child.pid, child.signals);
        self.epochs.set_state(0, EpochState::Live);
        self.set_base_id(child.base_id);
        self.life.went_live(0);
        self.files_ours = true;
        // What the new family's Envoy says of itself (now that it is LIVE and ours) is what
        // the next epoch must match, not the old family's: its binary may be another by now.
        self.ask_version();
        // Our family is LIVE again: the next successor (or restart) may allocate.
        drop(lock);
        self.metrics.epoch(0);
        self.refresh_marker();
        let now = Instant::now();
        self.want_xds(now);
        self.admin_answered(now);
        self.watchdog.start(now + WATCHDOG_POLL);
        // The old family's listeners close when its drain time ends; a little later it goes.
        // Across pods its agent does that: from then on, look whether it is gone.
        let until = now + self.config.proxy.options.drain_time + RETIRE_MARGIN;
        self.handoff = Handoff::Retiring {
            until,
            old: match foreign {
                Some(predecessor) => OldFamily::Foreign {
                    predecessor,
                    look_at: None,
                },
                None => OldFamily::Ours {
                    kill_at: None,
                    epochs: old,
                },
            },
        };
        self.log_cold_live(from_base_id);
        self.publish();
        self.finish_at(attempt, Outcome::Live, String::new(), seen);
        self.write_heartbeat();
        self.settled(deferred);
    }

    /// Tells that the new family is LIVE, and what becomes of the connections still queued on
    /// the old family's listen sockets.
    fn log_cold_live(&self, from_base_id: u32) {
        let migrate = std::fs::read_to_string(TCP_MIGRATE_REQ)
            .map(|v| v.trim() == "1")
            .unwrap_or(false);
        tracing::info!(
            event = "cold_handover",
            stage = "live",
            from_base_id,
            to_base_id = self.base_id,
            tcp_migrate_req = migrate,
            "the new family is LIVE: the old one drains for {:?}, then stops",
            self.config.proxy.options.drain_time
        );
        if !migrate {
            tracing::warn!(
                event = "cold_handover",
                stage = "tcp_migrate_req",
                "net.ipv4.tcp_migrate_req is not 1: connections still queued on the old family's \
                 listen sockets when they close will be reset (set it to 1 to move them to the new family's)"
            );
        }
    }

    /// The new family's Envoy exited before it was LIVE: the old family serves on.
    pub(super) fn on_cold_exit(&mut self, result: Result<Exit, ProxyError>) {
        let Handoff::Cold {
            attempt,
            deadline,
            lock,
            deferred,
            ..
        } = std::mem::replace(&mut self.handoff, Handoff::Idle)
        else {
            return;
        };
        drop(lock);
        let killed = deadline == Deadline::Killed;
        if killed && !attempt.waiting_for_config.is_empty() && !attempt.first {
            let waiting = attempt.waiting_for_config.clone();
            self.config_wait_ended(attempt, &waiting);
            self.settled(deferred);
            return;
        }
        let (outcome, message) = if killed {
            (
                Outcome::TimedOut,
                format!(
                    "the new family was not LIVE within the handoff deadline ({:?})",
                    self.config.options.handoff_deadline
                ),
            )
        } else {
            let message = match &result {
                Ok(exit) => format!(
                    "the new family's envoy exited with code {}: {}",
                    exit.code(),
                    last_line(&exit.stderr_tail)
                ),
                Err(e) => e.to_string(),
            };
            (Outcome::Failed, message)
        };
        let first = attempt.first;
        self.finish(attempt, outcome, message.clone());
        if first {
            // A successor pod's start: nothing of ours serves (the predecessor does, untouched).
            deferred.not_serving();
            self.begin_stop(
                Ended::StartFailed { code: 1, message },
                "the cold handover's new family failed",
            );
            return;
        }
        self.settled(deferred);
        self.watchdog.next_at(Instant::now() + WATCHDOG_POLL);
    }

    /// One of the old family's processes, the kept parent, or (when stopping) the new family
    /// that never became ours exited.
    pub(super) fn on_retired_exit(
        &mut self,
        child: crate::epochs::Child,
        retired: Retired,
        result: Result<Exit, ProxyError>,
    ) {
        let kind = exit_kind(&result, false);
        self.metrics.exit(kind);
        self.record_exit(&child, &result, kind);
        let last = self.history.last_exit();
        tracing::info!(
            event = "epoch_exited",
            epoch = child.epoch,
            pid = child.pid,
            retired = true,
            code = last.and_then(|e| e.code),
            signal = last.and_then(|e| e.signal),
            how = last.map(|e| e.how.to_string()),
            "an envoy of the old family exited"
        );
        match retired {
            Retired::Kept { stand_in } => self.kept_gone(child.epoch, stand_in),
            Retired::OldFamily => {
                let gone = matches!(
                    &self.handoff,
                    Handoff::Retiring {
                        old: OldFamily::Ours { epochs, .. },
                        ..
                    } if epochs.is_empty() && !matches!(self.life, Life::HandedOver { .. })
                );
                if gone {
                    self.handoff = Handoff::Idle;
                    tracing::info!(
                        event = "cold_handover",
                        stage = "retired",
                        base_id = self.base_id,
                        "the old family is gone; a hot restart binds the configured admin address again"
                    );
                    self.queue_settling_restart();
                }
            }
            Retired::Stopping => {}
        }
    }

    /// The old family is gone: a hot restart of ours takes the configured admin address.
    fn queue_settling_restart(&mut self) {
        if !self.orders.drained() {
            self.queue.push(
                "after a cold handover: the configured admin address".to_owned(),
                None,
                Instant::now(),
            );
            self.queue.settles = true;
        }
        self.write_heartbeat();
    }

    /// Tells our family's Envoy to drain every listener gracefully (a new family serves them
    /// all), before it is stopped.
    fn drain_for_retirement(&mut self) {
        let drain = self.host.drain(Scope::All, false);
        for epoch in self.epochs.iter().map(|c| c.epoch).collect::<Vec<_>>() {
            self.host.tell_drain(self.base_id, epoch);
        }
        self.beside(drain, |result| Event::Drained {
            result: result.map_err(|e| FamilyError::Admin(Arc::new(e))),
            replies: Vec::new(),
        });
    }

    /// A successor pod's new family is LIVE beside ours and says it took over from us (a cold
    /// handover across pods): ours drains, then stops; the agent exits as handed over.
    pub(super) fn hand_over_cold(&mut self, successor: String) {
        if self.life.serving().is_none() {
            return;
        }
        tracing::info!(
            event = "cold_handover",
            stage = "handed_over",
            %successor,
            "a successor's new family took over: draining ours for {:?}, then stopping it",
            self.config.proxy.options.drain_time
        );
        self.drain_for_retirement();
        self.hand_over(successor);
        // Whatever handoff of ours was under way is moot: the whole family retires, with
        // what is left of an older family we retired ourselves.
        let until = Instant::now() + self.config.proxy.options.drain_time + RETIRE_MARGIN;
        let moot = std::mem::replace(&mut self.handoff, Handoff::Idle);
        let older = match moot {
            Handoff::Retiring {
                old: OldFamily::Ours { epochs, .. },
                ..
            } => epochs,
            Handoff::Starting { deferred, .. } | Handoff::Cold { deferred, .. } => {
                // What was asked of it goes to our family, which still serves while it
                // drains (as a drain asked a moment later would).
                self.settled(deferred);
                Epochs::default()
            }
            _ => Epochs::default(),
        };
        self.handoff = Handoff::Retiring {
            until,
            old: OldFamily::Ours {
                kill_at: None,
                epochs: older,
            },
        };
    }

    /// The configured admin port after a cold handover across pods: free once the
    /// predecessor's Envoy is gone; then our family binds it by a hot restart.
    pub(super) fn on_foreign_admin(&mut self, result: Result<Option<AdminState>, AdminError>) {
        let Handoff::Retiring {
            old:
                OldFamily::Foreign {
                    predecessor,
                    look_at,
                },
            ..
        } = &mut self.handoff
        else {
            return;
        };
        let gone = matches!(&result, Err(e) if discovery::refused(e));
        if !gone {
            *look_at = Some(Instant::now() + FOREIGN_PARENT_CHECK);
            tracing::debug!(%predecessor, "the predecessor's envoy still holds the admin address");
            return;
        }
        tracing::info!(
            event = "cold_handover",
            stage = "retired",
            base_id = self.base_id,
            %predecessor,
            "the predecessor's envoy is gone; a hot restart binds the configured admin address again"
        );
        self.handoff = Handoff::Idle;
        self.queue_settling_restart();
    }

    /// The cold handover's timers: the new family's deadline, the old family's retirement.
    pub(super) fn cold_timers(&mut self, now: Instant) {
        let grace = self.config.proxy.options.stop_grace;
        if let Handoff::Retiring {
            until,
            old: OldFamily::Foreign { look_at, .. },
        } = &mut self.handoff
        {
            let due = look_at.unwrap_or(*until);
            if now >= due {
                // Asked beside the loop; the answer sets the next look.
                *look_at = Some(now + STOP_BACKSTOP);
                // `live_check` asks the configured address.
                let call = self.host.live_check(None);
                self.beside(call, Event::ForeignAdmin);
            }
            return;
        }
        let signal = match &mut self.handoff {
            Handoff::Cold { deadline, live, .. } => {
                if let Deadline::At(at) = *deadline {
                    if now >= at {
                        // Fresh facts first (see `Deadline`).
                        *deadline = Deadline::Passed(now);
                        if !live.probing.in_flight {
                            self.cold_live_check();
                        }
                    }
                }
                return;
            }
            Handoff::Retiring {
                until,
                old: OldFamily::Ours { kill_at, epochs },
            } => {
                let signal = match kill_at {
                    None if now >= *until => {
                        *kill_at = Some(now + grace);
                        Signal::SIGTERM
                    }
                    Some(at) if now >= *at => {
                        *kill_at = Some(now + STOP_BACKSTOP);
                        Signal::SIGKILL
                    }
                    _ => return,
                };
                for child in epochs.iter_mut() {
                    tracing::info!(epoch = child.epoch, %signal, "stopping the old family's epoch");
                    child.signal(signal, Some(Stop::Shutdown));
                }
                signal
            }
            _ => return,
        };
        if matches!(self.life, Life::HandedOver { .. }) {
            // Our whole family retires (handed over cold to a successor pod).
            let epochs: Vec<u32> = self.epochs.iter().map(|c| c.epoch).collect();
            for epoch in epochs {
                tracing::info!(epoch, %signal, "stopping our epoch after a cold handover");
                self.epochs.signal(epoch, signal, Some(Stop::Shutdown));
            }
        }
    }

    /// When the cold handover's timers are due next.
    pub(super) fn cold_wake(&self) -> Option<Instant> {
        match &self.handoff {
            Handoff::Cold { deadline, .. } => deadline.wake(),
            Handoff::Retiring {
                until,
                old: OldFamily::Ours { kill_at: at, .. } | OldFamily::Foreign { look_at: at, .. },
            } => Some(at.unwrap_or(*until)),
            _ => None,
        }
    }
}

impl<H: Host> Supervisor<H> {
    /// The new family was not LIVE by the deadline, confirmed by a LIVE check sent after it:
    /// killed (SIGKILL); the old family serves on.
    fn give_up_cold(&mut self) {
        let deadline = self.config.options.handoff_deadline;
        let Handoff::Cold {
            deadline: state,
            child,
            attempt,
            ..
        } = &mut self.handoff
        else {
            return;
        };
        *state = Deadline::Killed;
        let _ = child.signals.send(Signal::SIGKILL);
        // Waiting for its control plane is no wedge (see `control_plane`).
        if attempt.waiting_for_config.is_empty() {
            let message = format!(
                "the new family (base id {}) was not LIVE within the handoff deadline \
                 ({deadline:?}); killed it, the serving family keeps serving",
                child.base_id
            );
            self.record_wedge(WedgeReason::HandoffDeadline, message);
        }
    }
}

/// After the drain time: Envoy stops the drained listeners itself at its end.
const RETIRE_MARGIN: Duration = Duration::from_secs(1);

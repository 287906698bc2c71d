//! [`Supervisor`]: the actor that owns the family's epochs and takes every decision.
//!
//! One loop takes one [`Event`] at a time (a command, a process exit, the answer of an admin
//! probe or of a pre-flight, a config change, a timer) and acts on it. Nothing slow runs on
//! the loop: admin queries and pre-flight run as tasks beside it and come back as events, so a
//! hanging admin API never delays a signal, a deadline or another event. See the crate docs
//! for the rules the decisions follow.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use envoy_agent_proxy::admin::DrainListeners;
use envoy_agent_proxy::{
    AdminError, DrainOptions, Ended, EpochState, Exit, FamilyState, HandoffResult, HandoffStage,
    Outcome, ProxyError, ProxyPhase, ProxyState, RestartError, ServerInfo, ServerState, Signal,
    Wedge, WedgeReason,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::discovery::{self, Discovery};
use crate::epochs::{Epochs, Stop};
use crate::handoff::{Attempt, Handoff, Parent, Queue, Waiter};
use crate::host::{Guard, Host, Repair};
use crate::metrics::{ExitKind, SupervisorMetrics};
use crate::node::{self, Heartbeat, NodeState};

/// How often a starting epoch's admin is asked whether it is LIVE.
pub(crate) const LIVE_POLL: Duration = Duration::from_millis(10);
/// How often the serving epoch's admin is checked by the watchdog.
pub(crate) const WATCHDOG_POLL: Duration = Duration::from_secs(1);
/// ... while a successor pod is starting (its takeover is seen that much sooner).
pub(crate) const WATCHDOG_POLL_SUCCESSOR: Duration = Duration::from_millis(100);
/// How often a starting supervisor looks at the node again while it waits to take over.
pub(crate) const DISCOVERY_POLL: Duration = Duration::from_millis(100);
/// How often a busy node lock is tried again.
pub(crate) const LOCK_RETRY: Duration = Duration::from_millis(100);
/// How often a successor checks whether its predecessor's Envoy is gone (its socket names free).
pub(crate) const FOREIGN_PARENT_CHECK: Duration = Duration::from_millis(500);
/// Retries of a failed handoff whose parent lost its admin endpoint.
pub(crate) const MAX_RETRIES: u32 = 3;
/// Wedges kept in the published state.
const WEDGES_KEPT: usize = 16;
/// Beyond the stop grace: how long stopping may take before the supervisor gives up waiting.
const STOP_BACKSTOP: Duration = Duration::from_secs(5);
/// An incompatible predecessor is reported again after this long.
const INCOMPATIBLE_REPORT: Duration = Duration::from_secs(60);

/// What steers the supervisor.
#[derive(Debug)]
pub(crate) enum Command {
    HotRestart {
        reason: String,
        reply: Option<Waiter>,
    },
    Drain {
        options: DrainOptions,
        reply: oneshot::Sender<Result<(), String>>,
    },
    ReopenLogs {
        reply: oneshot::Sender<usize>,
    },
    Successor {
        reply: oneshot::Sender<Option<String>>,
    },
    /// The agent is about to write this config itself (after validating it): the watch must
    /// not take the write for an outside change.
    Expect {
        content: Vec<u8>,
        reply: oneshot::Sender<()>,
    },
}

/// Why an admin probe was sent.
#[derive(Debug)]
enum Probe {
    /// Where does our first epoch start?
    Discover,
    /// Is the starting epoch LIVE?
    Live { epoch: u32 },
    /// Is the serving epoch's admin alive (and is it still ours)?
    Watchdog,
    /// A stop is coming: is a successor taking over?
    Successor(oneshot::Sender<Option<String>>),
    /// Our serving epoch exited: who serves now?
    ServingExited(Exit),
    /// A new epoch failed: does the serving one still have its admin listener?
    FailedChild { epoch: u32, retries: u32 },
}

#[derive(Debug)]
enum Event {
    Abort,
    Command(Command),
    Exited {
        epoch: u32,
        pid: u32,
        result: Result<Exit, ProxyError>,
    },
    Probed {
        probe: Probe,
        result: Result<ServerInfo, AdminError>,
    },
    PreFlight {
        epoch: u32,
        result: Result<(), String>,
    },
    Drained {
        result: Result<(), String>,
        replies: Vec<oneshot::Sender<Result<(), String>>>,
    },
    ConfigChanged,
    Tick,
}

/// The supervisor's life.
enum Life {
    /// Taking the node's epoch lock and looking for a predecessor to take over from.
    Discovering {
        /// When waiting is given up (none while an incompatible predecessor serves: the
        /// rollout stays there and says why).
        deadline: Instant,
        next: Instant,
        probing: bool,
        /// Why it waits, as last logged.
        waiting: Option<String>,
        reported_incompatible: Option<Instant>,
    },
    /// Our epochs run (the first may not be LIVE yet).
    Running,
    /// A successor pod's Envoy took over; ours drain until it terminates them.
    HandedOver { successor: String },
    /// Stopping every epoch; `outcome` is reported once they are gone.
    Stopping {
        outcome: Ended,
        kill_at: Instant,
        give_up: Instant,
    },
}

/// A bound stand-in for a dead parent's sockets.
struct StandIn {
    parent_epoch: u32,
    _guard: Guard,
}

/// When the next admin probe of a kind is due, and whether one is out.
#[derive(Default)]
struct Probing {
    next: Option<Instant>,
    in_flight: bool,
}

impl Probing {
    fn due(&self, now: Instant) -> bool {
        !self.in_flight && self.next.is_some_and(|t| t <= now)
    }

    fn wake(&self) -> Option<Instant> {
        self.next.filter(|_| !self.in_flight)
    }
}

/// The hot-restart supervisor. See the crate docs for its rules.
pub(crate) struct Supervisor<H: Host> {
    config: Config,
    host: Arc<H>,
    base_id: u32,
    commands: mpsc::Receiver<Command>,
    events_tx: mpsc::UnboundedSender<Event>,
    events: mpsc::UnboundedReceiver<Event>,
    state: watch::Sender<ProxyState>,
    metrics: SupervisorMetrics,

    life: Life,
    epochs: Epochs,
    handoff: Handoff,
    queue: Queue,
    /// The running Envoy's hot-restart version.
    version: String,
    newest_live: Option<u32>,
    /// The node's epoch lock, held from a handoff's start until its epoch is LIVE or failed.
    lock: Option<Guard>,
    stand_in: Option<StandIn>,
    live: Probing,
    watchdog: Probing,
    admin_ok: Instant,
    /// Drains asked for while a handoff settles; applied once it has.
    pending_drains: Vec<(DrainOptions, oneshot::Sender<Result<(), String>>)>,
    heartbeat_due: Instant,
    foreign_check: Option<Instant>,
    family: FamilyState,
    phase_since: (ProxyPhase, SystemTime),
    /// Heartbeat files already reported as untrusted (each once).
    reported: BTreeSet<(std::path::PathBuf, String)>,
    watch: Option<crate::watch::ConfigWatch>,
    aborted: bool,
    /// Whether the readiness marker is present, as last set.
    marker: bool,
    /// When a busy node lock is tried again for a queued restart.
    lock_retry_at: Instant,
    /// The serving epoch that exited while its successor started: the outcome if that fails.
    pending_serving_exit: Option<Exit>,
}

impl<H: Host> std::fmt::Debug for Supervisor<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<H: Host> Supervisor<H> {
    pub(crate) fn new(
        config: Config,
        base_id: u32,
        host: Arc<H>,
        commands: mpsc::Receiver<Command>,
        state: watch::Sender<ProxyState>,
        metrics: SupervisorMetrics,
    ) -> Self {
        let (events_tx, events) = mpsc::unbounded_channel();
        let now = Instant::now();
        let family = FamilyState {
            base_id,
            identity: config.identity.clone(),
            ..FamilyState::default()
        };
        Supervisor {
            life: Life::Running,
            config,
            host,
            base_id,
            commands,
            events_tx,
            events,
            state,
            metrics,
            epochs: Epochs::default(),
            handoff: Handoff::Idle,
            queue: Queue::default(),
            version: String::new(),
            newest_live: None,
            lock: None,
            stand_in: None,
            live: Probing::default(),
            watchdog: Probing::default(),
            admin_ok: now,
            pending_drains: Vec::new(),
            heartbeat_due: now,
            foreign_check: None,
            family,
            phase_since: (ProxyPhase::Starting, SystemTime::now()),
            reported: BTreeSet::new(),
            watch: None,
            aborted: false,
            marker: false,
            lock_retry_at: now,
            pending_serving_exit: None,
        }
    }

    /// Starts the first epoch and supervises until the family cannot serve anymore or `abort`
    /// is cancelled; every epoch has been stopped and reaped when it returns.
    pub(crate) async fn run(mut self, abort: CancellationToken) -> Ended {
        // The marker means "our newest epoch is LIVE": whatever a crashed predecessor in this
        // container left there is wrong now, before anything else happens.
        if let Err(e) = self.host.set_marker(false) {
            tracing::error!(error = %e, "cannot remove the readiness marker");
        }
        let ended = match self.host.hot_restart_version().await {
            Ok(version) => {
                self.version = version;
                self.family.hot_restart_version = self.version.clone();
                self.supervise(abort).await
            }
            Err(message) => Ended::StartFailed { code: 1, message },
        };
        self.host.remove_heartbeat(&self.config.identity);
        self.lock = None;
        self.stand_in = None;
        self.publish();
        tracing::info!(outcome = ?ended, code = ended.code(), "supervisor done");
        ended
    }

    async fn supervise(&mut self, abort: CancellationToken) -> Ended {
        let now = Instant::now();
        if self.host.has_node() {
            self.life = Life::Discovering {
                deadline: now + self.discovery_bound(),
                next: now,
                probing: false,
                waiting: None,
                reported_incompatible: None,
            };
        } else {
            self.begin_first(0, None, "start".to_owned());
        }
        if self.config.watch_config {
            match crate::watch::ConfigWatch::start(
                &self.config.proxy.config_path,
                self.config.watch_debounce,
            ) {
                Ok(w) => self.watch = Some(w),
                Err(e) => tracing::error!(error = %e, "config watch disabled"),
            }
        }
        self.publish();
        loop {
            if let Some(ended) = self.finished() {
                return ended;
            }
            let wake = self.next_wake();
            let event = tokio::select! {
                biased;
                () = abort.cancelled(), if !self.aborted => Event::Abort,
                Some(event) = self.events.recv() => event,
                Some(command) = self.commands.recv() => Event::Command(command),
                changed = watch_changed(&mut self.watch) => match changed {
                    Some(()) => Event::ConfigChanged,
                    None => {
                        tracing::error!("config watch ended");
                        self.watch = None;
                        continue;
                    }
                },
                () = sleep_until(wake) => Event::Tick,
            };
            self.handle(event).await;
            self.publish();
        }
    }

    /// How long a starting supervisor may wait for its turn before it gives up.
    fn discovery_bound(&self) -> Duration {
        self.config.handoff_deadline
            + self
                .config
                .parent_shutdown_time()
                .max(self.config.proxy.drain_duration)
    }

    /// Whether the supervisor is done: stopping with nothing left running.
    fn finished(&mut self) -> Option<Ended> {
        match &self.life {
            Life::Stopping { outcome, .. } if self.epochs.is_empty() => Some(outcome.clone()),
            _ => None,
        }
    }

    async fn handle(&mut self, event: Event) {
        match event {
            Event::Abort => {
                self.aborted = true;
                self.begin_stop(Ended::Stopped { last: None }, "asked to stop");
            }
            Event::Command(command) => self.on_command(command),
            Event::Exited { epoch, pid, result } => self.on_exit(epoch, pid, result),
            Event::Probed { probe, result } => self.on_probe(probe, result),
            Event::PreFlight { epoch, result } => self.on_preflight(epoch, result).await,
            Event::Drained { result, replies } => {
                match &result {
                    Ok(()) => tracing::info!("envoy is draining its listeners"),
                    Err(e) => tracing::warn!(error = %e, "drain request failed"),
                }
                for reply in replies {
                    let _ = reply.send(result.clone());
                }
            }
            Event::ConfigChanged => {
                tracing::info!(path = %self.config.proxy.config_path.display(), "config changed");
                self.request_restart("config change".to_owned(), None);
            }
            Event::Tick => self.on_tick().await,
        }
    }

    // --- commands ---------------------------------------------------------------------------

    fn on_command(&mut self, command: Command) {
        match command {
            Command::HotRestart { reason, reply } => {
                tracing::info!(%reason, "hot restart requested");
                self.request_restart(reason, reply);
            }
            Command::Drain { options, reply } => self.drain(options, reply),
            Command::ReopenLogs { reply } => {
                // Never a starting epoch: SIGUSR1's default action kills a process that has
                // not installed Envoy's handler yet. Draining parents write logs too.
                let targets: Vec<u32> = self
                    .epochs
                    .iter()
                    .filter(|c| c.state != EpochState::Starting)
                    .map(|c| c.epoch)
                    .collect();
                for epoch in &targets {
                    self.epochs.signal(*epoch, Signal::SIGUSR1, None);
                }
                tracing::info!(epochs = ?targets, "asked envoy to reopen its logs");
                let _ = reply.send(targets.len());
            }
            Command::Successor { reply } => {
                if let Life::HandedOver { successor } = &self.life {
                    let _ = reply.send(Some(successor.clone()));
                    return;
                }
                self.read_node();
                self.probe(Probe::Successor(reply));
            }
            Command::Expect { content, reply } => {
                if let Some(watch) = &mut self.watch {
                    watch.expect(&content);
                }
                let _ = reply.send(());
            }
        }
    }

    fn request_restart(&mut self, reason: String, reply: Option<Waiter>) {
        let refused = match &self.life {
            Life::HandedOver { successor } => Some(format!(
                "handed over to {successor}: hot restarts are the successor's now"
            )),
            Life::Stopping { .. } => Some("stopping".to_owned()),
            _ if self.family.drained => {
                Some("draining: no new epoch starts after a drain".to_owned())
            }
            _ => None,
        };
        if let Some(why) = refused {
            tracing::warn!(%reason, %why, "hot restart refused");
            if let Some(reply) = reply {
                let _ = reply.send(Err(RestartError::Refused(why)));
            }
            return;
        }
        if !self.handoff.is_idle() {
            tracing::info!(%reason, "a handoff is under way: coalesced into the next restart");
        }
        self.queue.push(reason, reply, Instant::now());
    }

    fn drain(&mut self, options: DrainOptions, reply: oneshot::Sender<Result<(), String>>) {
        match &self.life {
            Life::Stopping { .. } | Life::HandedOver { .. } => {
                // Ours already drain, or are going.
                let _ = reply.send(Ok(()));
                return;
            }
            Life::Discovering { .. } => {
                let _ = reply.send(Err("no envoy of ours runs yet".to_owned()));
                return;
            }
            Life::Running => {}
        }
        if !self.family.drained {
            tracing::info!("draining: no new epoch starts from here on");
            self.family.drained = true;
            self.queue
                .refuse(&RestartError::Refused("draining".to_owned()));
            self.set_marker(false);
        }
        match &self.handoff {
            Handoff::PreFlight(_) => {
                // Nothing started: the restart is moot.
                if let Handoff::PreFlight(attempt) =
                    std::mem::replace(&mut self.handoff, Handoff::Idle)
                {
                    self.lock = None;
                    self.finish(
                        attempt,
                        Outcome::Rejected,
                        "cancelled: the family drains".to_owned(),
                    );
                }
                self.send_drain(options, vec![reply]);
            }
            Handoff::Starting { .. } => {
                // The new epoch may hold the admin listener: drain whichever serves once the
                // handoff has settled.
                tracing::info!("a handoff is under way: the drain follows once it settles");
                self.pending_drains.push((options, reply));
            }
            Handoff::Idle | Handoff::ParentDraining { .. } => {
                self.send_drain(options, vec![reply]);
            }
        }
    }

    fn send_drain(
        &mut self,
        options: DrainOptions,
        replies: Vec<oneshot::Sender<Result<(), String>>>,
    ) {
        let listeners = DrainListeners {
            inbound_only: options.inbound_only.unwrap_or(self.config.proxy.sidecar),
            graceful: true,
            skip_exit: options.skip_exit,
        };
        let call = self.host.drain(listeners);
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let result = call.await.map_err(|e| e.to_string());
            let _ = events.send(Event::Drained { result, replies });
        });
    }

    fn flush_pending_drains(&mut self) {
        if self.pending_drains.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending_drains);
        let options = pending[0].0;
        let replies = pending.into_iter().map(|(_, r)| r).collect();
        self.send_drain(options, replies);
    }

    // --- the first epoch ----------------------------------------------------------------------

    fn begin_first(&mut self, epoch: u32, parent: Option<Parent>, reason: String) {
        let now = Instant::now();
        let mut queue = Queue::default();
        queue.push(reason, None, now);
        let mut attempt = queue.take(epoch, parent, now);
        attempt.first = true;
        self.start_preflight(attempt);
    }

    fn on_discovery(&mut self, result: Result<ServerInfo, AdminError>) {
        let now_ms = self.host.now_unix_ms();
        let others = self.read_node();
        let decision = discovery::decide(&others, &result, self.base_id, &self.version, now_ms);
        let (waiting, reported_incompatible) = match &mut self.life {
            Life::Discovering {
                waiting,
                next,
                probing,
                reported_incompatible,
                ..
            } => {
                *probing = false;
                *next = Instant::now() + DISCOVERY_POLL;
                (waiting.clone(), *reported_incompatible)
            }
            _ => return,
        };
        let set_waiting = |life: &mut Life, why: String, reported: Option<Instant>| {
            if let Life::Discovering {
                waiting,
                reported_incompatible,
                ..
            } = life
            {
                *waiting = Some(why);
                *reported_incompatible = reported;
            }
        };
        match decision {
            Discovery::Fresh => {
                tracing::info!("no live predecessor on this node: starting at epoch 0");
                self.begin_first(0, None, "start".to_owned());
            }
            Discovery::TakeOver { epoch, identity } => {
                let who = identity
                    .unwrap_or_else(|| "an envoy of the family without a heartbeat".to_owned());
                tracing::info!(predecessor = %who, epoch = epoch + 1, "hot-restarting from the predecessor's envoy");
                self.family.predecessor = Some(who.clone());
                self.begin_first(
                    epoch + 1,
                    Some(Parent::Foreign {
                        epoch,
                        identity: who.clone(),
                    }),
                    format!("take over from {who}"),
                );
            }
            Discovery::Incompatible { theirs, identity } => {
                let mut reported = reported_incompatible;
                if reported.is_none_or(|t| t.elapsed() >= INCOMPATIBLE_REPORT) {
                    reported = Some(Instant::now());
                    tracing::error!(
                        predecessor = identity.as_deref().unwrap_or("unknown"),
                        theirs = %theirs,
                        ours = %self.version,
                        "the node's envoy has another hot-restart version: it cannot be \
                         hot-restarted from; not starting until it is gone (see the runbook)"
                    );
                }
                let why = format!(
                    "the node's envoy has hot-restart version {theirs}, ours {}",
                    self.version
                );
                set_waiting(&mut self.life, why, reported);
            }
            Discovery::Wait(why) => {
                if waiting.as_deref() != Some(why.as_str()) {
                    tracing::info!(reason = %why, "waiting to take over");
                }
                set_waiting(&mut self.life, why, reported_incompatible);
            }
        }
    }

    // --- pre-flight and spawn -----------------------------------------------------------------

    fn start_preflight(&mut self, mut attempt: Attempt) {
        attempt.began = Instant::now();
        self.life = match std::mem::replace(&mut self.life, Life::Running) {
            Life::Discovering { .. } => Life::Running,
            other => other,
        };
        tracing::info!(
            epoch = attempt.epoch,
            reason = %attempt.reason,
            queued = ?attempt.queued(),
            "hot restart: pre-flight checks"
        );
        let running = self.newest_live.map(|_| self.version.clone()).or_else(|| {
            // A successor's first epoch: the predecessor runs our version (discovery checked).
            attempt.parent.as_ref().map(|_| self.version.clone())
        });
        let check = self.host.preflight(running);
        let events = self.events_tx.clone();
        let epoch = attempt.epoch;
        tokio::spawn(async move {
            let result = check.await;
            let _ = events.send(Event::PreFlight { epoch, result });
        });
        self.handoff = Handoff::PreFlight(attempt);
        self.write_heartbeat();
    }

    async fn on_preflight(&mut self, epoch: u32, result: Result<(), String>) {
        let Handoff::PreFlight(attempt) = &self.handoff else {
            return; // cancelled meanwhile
        };
        if attempt.epoch != epoch {
            return;
        }
        let Handoff::PreFlight(mut attempt) = std::mem::replace(&mut self.handoff, Handoff::Idle)
        else {
            return;
        };
        attempt.preflight = attempt.began.elapsed();
        if let Err(message) = result {
            self.lock = None;
            if self.newest_live.is_none() {
                tracing::error!(epoch, %message, "pre-flight rejects the first epoch");
                self.finish(attempt, Outcome::Rejected, message.clone());
                self.begin_stop(Ended::StartFailed { code: 1, message }, "pre-flight failed");
            } else {
                self.finish(attempt, Outcome::Rejected, message);
            }
            return;
        }
        // A stand-in holds the socket names of an epoch that this one shares them with.
        if self
            .stand_in
            .as_ref()
            .is_some_and(|s| s.parent_epoch % 3 == epoch % 3)
        {
            self.release_stand_in("the next epoch reuses its socket names");
        }
        match self.host.spawn(epoch).await {
            Ok(spawned) => {
                self.epochs.add(epoch, spawned.pid, spawned.signals);
                let events = self.events_tx.clone();
                let pid = spawned.pid;
                let exit = spawned.exit;
                tokio::spawn(async move {
                    let result = exit.await.unwrap_or(Err(ProxyError::NotRunning));
                    let _ = events.send(Event::Exited { epoch, pid, result });
                });
                tracing::info!(event = "epoch_starting", epoch, pid, "epoch starting");
                let now = Instant::now();
                attempt.spawned = Some(now);
                self.handoff = Handoff::Starting {
                    attempt,
                    deadline: now + self.config.handoff_deadline,
                };
                self.live = Probing {
                    next: Some(now + LIVE_POLL),
                    in_flight: false,
                };
                self.write_heartbeat();
            }
            Err(e) => {
                self.lock = None;
                let message = e.to_string();
                if self.newest_live.is_none() {
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

    // --- probes -----------------------------------------------------------------------------

    fn probe(&mut self, probe: Probe) {
        match &probe {
            Probe::Live { .. } => self.live.in_flight = true,
            Probe::Watchdog => self.watchdog.in_flight = true,
            Probe::Discover => {
                if let Life::Discovering { probing, .. } = &mut self.life {
                    *probing = true;
                }
            }
            _ => {}
        }
        let call = self.host.server_info();
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let result = call.await;
            let _ = events.send(Event::Probed { probe, result });
        });
    }

    fn on_probe(&mut self, probe: Probe, result: Result<ServerInfo, AdminError>) {
        match probe {
            Probe::Discover => self.on_discovery(result),
            Probe::Live { epoch } => {
                self.live.in_flight = false;
                self.on_live_probe(epoch, result);
            }
            Probe::Watchdog => {
                self.watchdog.in_flight = false;
                self.on_watchdog(result);
            }
            Probe::Successor(reply) => {
                let ours = self.newest_live.or(self.epochs.newest().map(|c| c.epoch));
                if let Some(successor) = self.takeover_seen(&result, ours) {
                    self.hand_over(successor);
                }
                let answer = match &self.life {
                    Life::HandedOver { successor } => Some(successor.clone()),
                    _ => self.family.successor_starting.clone(),
                };
                tracing::info!(successor = ?answer, "asked whether a successor takes over");
                // The asker reads the state next: publish first.
                self.publish();
                let _ = reply.send(answer);
            }
            Probe::ServingExited(exit) => {
                if let Some(successor) = self.takeover_seen(&result, Some(exit.epoch)) {
                    tracing::info!(epoch = exit.epoch, %successor, "our envoy was terminated by the successor's");
                    self.hand_over(successor);
                    return;
                }
                if matches!(self.life, Life::Stopping { .. } | Life::HandedOver { .. }) {
                    return;
                }
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
            Probe::FailedChild { epoch, retries } => {
                if !matches!(self.life, Life::Running) || self.family.drained {
                    return;
                }
                // Only a LIVE child gives the family an admin endpoint back once a failed one
                // shut the serving epoch's.
                if result.is_err() {
                    let retries = retries + 1;
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
            }
        }
    }

    /// Whether the admin answer shows a newer epoch of the family that is not ours: a
    /// successor pod's Envoy took over. Its supervisor's name if so.
    fn takeover_seen(
        &mut self,
        result: &Result<ServerInfo, AdminError>,
        ours: Option<u32>,
    ) -> Option<String> {
        let info = result.as_ref().ok()?;
        let ours = ours?;
        if info.state != ServerState::Live
            || info.base_id != u64::from(self.base_id)
            || info.restart_epoch <= ours
            || self.epochs.get(info.restart_epoch).is_some()
        {
            return None;
        }
        let others = self.read_node();
        Some(
            others
                .iter()
                .find(|h| h.newest_epoch == info.restart_epoch)
                .map(|h| h.identity.clone())
                .unwrap_or_else(|| format!("the supervisor of epoch {}", info.restart_epoch)),
        )
    }

    fn hand_over(&mut self, successor: String) {
        if !matches!(self.life, Life::Running) {
            return;
        }
        tracing::info!(event = "handed_over", %successor, "handed over to {successor}");
        if let Some(n) = self.newest_live {
            self.epochs.set_state(n, EpochState::Draining);
        }
        self.newest_live = None;
        self.life = Life::HandedOver {
            successor: successor.clone(),
        };
        self.family.handed_over_to = Some(successor.clone());
        self.family.successor_starting = None;
        self.set_marker(false);
        self.queue.refuse(&RestartError::Refused(format!(
            "handed over to {successor}"
        )));
        self.watchdog = Probing::default();
        self.write_heartbeat();
    }

    fn on_live_probe(&mut self, epoch: u32, result: Result<ServerInfo, AdminError>) {
        if self.handoff.starting_epoch() != Some(epoch) {
            return;
        }
        let ours = match (&result, self.epochs.get(epoch)) {
            (Ok(info), Some(child)) => {
                info.state == ServerState::Live
                    && info.restart_epoch == epoch
                    && info.base_id == u64::from(self.base_id)
                    && child.state == EpochState::Starting
                    && child.stopped.is_none()
                    // Proof that the answering Envoy is the process we started: it has not
                    // been up longer than ours.
                    && uptime(&info.uptime_current_epoch)
                        .is_none_or(|up| up <= child.started_at.elapsed() + Duration::from_secs(2))
            }
            _ => false,
        };
        if ours {
            self.go_live(epoch);
        } else {
            self.live.next = Some(Instant::now() + LIVE_POLL);
        }
    }

    fn go_live(&mut self, epoch: u32) {
        let Handoff::Starting { attempt, .. } = std::mem::replace(&mut self.handoff, Handoff::Idle)
        else {
            return;
        };
        self.live = Probing::default();
        self.admin_ok = Instant::now();
        self.epochs.set_state(epoch, EpochState::Live);
        let now = Instant::now();
        self.handoff = match &attempt.parent {
            Some(Parent::Ours(p)) if self.epochs.get(*p).is_some() => {
                self.epochs.set_state(*p, EpochState::Draining);
                Handoff::ParentDraining {
                    parent: Parent::Ours(*p),
                    until: now + self.config.parent_shutdown_time(),
                }
            }
            Some(Parent::Foreign { epoch, identity }) => {
                tracing::info!(epoch = attempt.epoch, predecessor = %identity, "took over from the predecessor's envoy");
                // Until the child terminates it; a second of margin for its own timer.
                let drains = self.config.parent_shutdown_time() + Duration::from_secs(1);
                self.family.foreign_parent_until = Some(SystemTime::now() + drains);
                self.foreign_check = Some(now + FOREIGN_PARENT_CHECK);
                Handoff::ParentDraining {
                    parent: Parent::Foreign {
                        epoch: *epoch,
                        identity: identity.clone(),
                    },
                    until: now + drains,
                }
            }
            _ => Handoff::Idle,
        };
        self.newest_live = Some(epoch);
        self.pending_serving_exit = None;
        // Our epoch is LIVE: the next successor (or restart) may allocate.
        self.lock = None;
        self.metrics.epoch(epoch);
        if !self.family.drained {
            self.set_marker(true);
        }
        self.watchdog = Probing {
            next: Some(now + WATCHDOG_POLL),
            in_flight: false,
        };
        self.write_heartbeat();
        // Last: whoever waits for this restart sees the new state at once.
        self.publish();
        self.finish(attempt, Outcome::Live, String::new());
        self.flush_pending_drains();
    }

    fn on_watchdog(&mut self, result: Result<ServerInfo, AdminError>) {
        if !matches!(self.life, Life::Running) || self.newest_live.is_none() {
            return;
        }
        if let Some(successor) = self.takeover_seen(&result, self.newest_live) {
            self.hand_over(successor);
            return;
        }
        let now = Instant::now();
        let period = if self.family.successor_starting.is_some() {
            WATCHDOG_POLL_SUCCESSOR
        } else {
            WATCHDOG_POLL
        };
        self.watchdog.next = Some(now + period);
        match result {
            Ok(_) => self.admin_ok = now,
            Err(e) if self.family.successor_starting.is_some() => {
                // Another pod's starting epoch may hold the admin listener: its handoff, not a
                // wedge of ours.
                tracing::debug!(error = %e, "admin silent while a successor starts");
                self.admin_ok = now;
            }
            Err(e) if discovery::refused(&e) => {
                // Our Envoy runs but its admin listener is gone: only a child (ours or another
                // pod's) takes it, and that child has failed. Only a LIVE child gives it back.
                self.admin_ok = now;
                if self.handoff.is_idle() && self.queue.is_empty() && !self.family.drained {
                    tracing::warn!(error = %e, "the serving epoch's admin listener is gone (taken by a failed epoch?): hot-restarting to get it back");
                    self.queue
                        .push("recover the admin listener".to_owned(), None, now);
                }
            }
            Err(e) => {
                let silent = now - self.admin_ok;
                tracing::warn!(error = %e, silent_for = ?silent, "envoy admin not answering");
                if silent >= self.config.admin_unresponsive_deadline {
                    let message = format!(
                        "envoy admin silent for {silent:?} (deadline {:?}): {e}",
                        self.config.admin_unresponsive_deadline
                    );
                    self.record_wedge(WedgeReason::AdminUnresponsive, message.clone());
                    self.begin_stop(
                        Ended::Wedged {
                            reason: WedgeReason::AdminUnresponsive,
                            message,
                        },
                        "wedged",
                    );
                }
            }
        }
    }

    // --- exits ------------------------------------------------------------------------------

    fn on_exit(&mut self, epoch: u32, pid: u32, result: Result<Exit, ProxyError>) {
        let Some(child) = self.epochs.remove(epoch, pid) else {
            return;
        };
        let (code, tail) = match &result {
            Ok(exit) => (exit.code(), exit.stderr_tail.clone()),
            Err(e) => (1, e.to_string()),
        };
        self.metrics
            .exit(exit_kind(&result, child.state == EpochState::Draining));
        // The stand-in's child is gone: nothing talks to the dead parent's names anymore.
        if self
            .stand_in
            .as_ref()
            .is_some_and(|s| s.parent_epoch + 1 == epoch)
        {
            self.release_stand_in("its child exited");
        }
        if child.state == EpochState::Starting {
            // No Envoy of the family initializes now: a flag it left set is stale.
            self.repair_initializing(epoch);
        }
        match &self.life {
            Life::Stopping { .. } => {
                tracing::info!(epoch, code, "epoch stopped");
                return;
            }
            Life::HandedOver { .. } => {
                tracing::info!(epoch, code, "our envoy exited after the handover");
                self.write_heartbeat();
                return;
            }
            Life::Discovering { .. } | Life::Running => {}
        }
        match child.state {
            EpochState::Draining => {
                if let Handoff::ParentDraining {
                    parent: Parent::Ours(p),
                    ..
                } = &self.handoff
                {
                    if *p == epoch {
                        self.handoff = Handoff::Idle;
                    }
                }
                if code == 0 && child.stopped.is_none() {
                    tracing::info!(epoch, "drained parent exited (terminated by its child)");
                } else {
                    tracing::warn!(epoch, code, "draining parent died; its child keeps serving");
                    self.stand_in_for(epoch);
                }
                self.write_heartbeat();
            }
            EpochState::Live => {
                self.newest_live = None;
                self.set_marker(false);
                let exit = match result {
                    Ok(exit) => exit,
                    Err(e) => {
                        self.begin_stop(
                            Ended::StartFailed {
                                code: 1,
                                message: e.to_string(),
                            },
                            "cannot wait for envoy",
                        );
                        return;
                    }
                };
                if let Some(starting) = self.handoff.starting_epoch() {
                    // The serving epoch died while its successor starts: the successor still
                    // talks to it, so stand in for its sockets at once and let the successor
                    // finish (its deadline still applies).
                    tracing::warn!(
                        epoch,
                        code,
                        starting,
                        "the serving epoch exited while epoch {starting} starts: standing in for it, the new epoch may still take over"
                    );
                    self.stand_in_for(epoch);
                    if let Handoff::Starting { attempt, .. } = &mut self.handoff {
                        attempt.parent = None;
                    }
                    self.pending_serving_exit = Some(exit);
                    return;
                }
                // Who serves now? A successor pod's Envoy terminates ours with exit 0.
                self.probe(Probe::ServingExited(exit));
            }
            EpochState::Starting => self.on_failed_start(child, code, &tail),
        }
    }

    fn on_failed_start(&mut self, child: crate::epochs::Child, code: i32, tail: &str) {
        let epoch = child.epoch;
        let timed_out = matches!(child.stopped, Some((Stop::Deadline, _)));
        let message = if timed_out {
            format!(
                "not LIVE within the handoff deadline ({:?})",
                self.config.handoff_deadline
            )
        } else {
            format!("exited with code {code}: {}", last_line(tail))
        };
        let Handoff::Starting { attempt, .. } = std::mem::replace(&mut self.handoff, Handoff::Idle)
        else {
            tracing::warn!(epoch, code, "an epoch exited while starting");
            return;
        };
        self.live = Probing::default();
        self.lock = None;
        let outcome = if timed_out {
            Outcome::TimedOut
        } else {
            Outcome::Failed
        };
        if self.newest_live.is_none() {
            tracing::error!(epoch, code, "envoy failed to start\n{}", tail.trim_end());
            self.finish(attempt, outcome, message.clone());
            // Nothing of ours serves: the first epoch failed, or the serving one died while
            // this one started.
            let ended = match self.pending_serving_exit.take() {
                Some(exit) => Ended::Lost {
                    message: format!(
                        "the serving epoch {} exited while epoch {epoch} started, and epoch {epoch} failed: {message}",
                        exit.epoch
                    ),
                    exit,
                },
                None => Ended::StartFailed { code, message },
            };
            self.begin_stop(ended, "nothing serves");
            return;
        }
        let retries = attempt.retries;
        self.finish(attempt, outcome, message);
        self.flush_pending_drains();
        // The child may have shut the serving epoch's admin listener before it failed.
        self.probe(Probe::FailedChild { epoch, retries });
        self.watchdog.next = Some(Instant::now() + WATCHDOG_POLL);
    }

    fn stand_in_for(&mut self, parent_epoch: u32) {
        if self
            .stand_in
            .as_ref()
            .is_some_and(|s| s.parent_epoch == parent_epoch)
        {
            return;
        }
        match self.host.stand_in(parent_epoch) {
            Ok(guard) => {
                tracing::info!(
                    event = "stand_in",
                    epoch = parent_epoch,
                    "standing in for the dead parent's hot-restart sockets"
                );
                self.stand_in = Some(StandIn {
                    parent_epoch,
                    _guard: guard,
                });
            }
            Err(e) => {
                tracing::error!(epoch = parent_epoch, error = %e, "cannot stand in for the dead parent")
            }
        }
    }

    fn release_stand_in(&mut self, why: &str) {
        if let Some(s) = self.stand_in.take() {
            tracing::info!(
                parent_epoch = s.parent_epoch,
                reason = why,
                "released the dead parent's sockets"
            );
        }
    }

    fn repair_initializing(&mut self, epoch: u32) {
        match self.host.repair_initializing(&self.version) {
            Repair::Clean => {}
            Repair::Cleared => self.record_wedge(
                WedgeReason::StaleInitializing,
                format!(
                    "epoch {epoch} died while initializing and left the shared INITIALIZING \
                     flag set (\"previous envoy process is still initializing\"); cleared it: \
                     the serving epoch keeps serving and the next hot restart can proceed"
                ),
            ),
            Repair::Failed(why) => self.record_wedge(
                WedgeReason::StaleInitializing,
                format!(
                    "epoch {epoch} died while initializing; the shared INITIALIZING flag could \
                     not be checked or cleared ({why}): a later hot restart may be refused by \
                     envoy until a cold start"
                ),
            ),
        }
    }

    // --- timers -----------------------------------------------------------------------------

    fn next_wake(&self) -> Option<Instant> {
        let mut wake: Option<Instant> = None;
        let mut consider = |t: Option<Instant>| {
            if let Some(t) = t {
                wake = Some(wake.map_or(t, |w| w.min(t)));
            }
        };
        match &self.life {
            Life::Discovering {
                deadline,
                next,
                probing,
                waiting,
                ..
            } => {
                if !probing {
                    consider(Some(*next));
                }
                if !waiting
                    .as_deref()
                    .is_some_and(|w| w.contains("hot-restart version"))
                {
                    consider(Some(*deadline));
                }
            }
            Life::Stopping {
                kill_at, give_up, ..
            } => {
                consider(Some(*kill_at));
                consider(Some(*give_up));
                return wake;
            }
            Life::Running | Life::HandedOver { .. } => {}
        }
        consider(self.live.wake());
        consider(self.watchdog.wake());
        match &self.handoff {
            Handoff::Starting {
                attempt, deadline, ..
            } => {
                let killed = self
                    .epochs
                    .get(attempt.epoch)
                    .is_none_or(|c| c.stopped.is_some());
                if !killed {
                    consider(Some(*deadline));
                }
            }
            Handoff::ParentDraining {
                parent: Parent::Ours(p),
                until,
            } => {
                let killed = self.epochs.get(*p).is_none_or(|c| c.stopped.is_some());
                if !killed {
                    consider(Some(*until + self.config.parent_overdue_grace));
                }
            }
            Handoff::ParentDraining {
                parent: Parent::Foreign { .. },
                until,
            } => {
                consider(Some(*until));
                consider(self.foreign_check);
            }
            _ => {}
        }
        if self.handoff.is_idle() && !self.queue.is_empty() && self.can_restart() {
            consider(Some(self.queue_retry_at()));
        }
        if self.host.has_node() {
            consider(Some(self.heartbeat_due));
        }
        wake
    }

    fn queue_retry_at(&self) -> Instant {
        // Immediately the first time; then at the lock's retry pace.
        match self.queue.waiting_for {
            None => Instant::now(),
            Some(_) => self.lock_retry_at,
        }
    }

    fn can_restart(&self) -> bool {
        matches!(self.life, Life::Running) && self.newest_live.is_some() && !self.family.drained
    }

    async fn on_tick(&mut self) {
        let now = Instant::now();
        if self.host.has_node() && now >= self.heartbeat_due {
            self.heartbeat_due = now + self.config.heartbeat_period;
            self.read_node();
            self.write_heartbeat();
        }
        match &self.life {
            Life::Stopping {
                kill_at, give_up, ..
            } => {
                let (kill_at, give_up) = (*kill_at, *give_up);
                self.stopping_timers(now, kill_at, give_up);
                return;
            }
            Life::Discovering {
                deadline,
                next,
                probing,
                waiting,
                ..
            } => {
                let incompatible = waiting
                    .as_deref()
                    .is_some_and(|w| w.contains("hot-restart version"));
                let (deadline, next, probing, waiting) =
                    (*deadline, *next, *probing, waiting.clone());
                if now >= deadline && !incompatible {
                    let why =
                        waiting.unwrap_or_else(|| "the node's epoch lock stayed taken".to_owned());
                    let message = format!(
                        "could not take over within {:?}: {why}",
                        self.discovery_bound()
                    );
                    tracing::error!(%message);
                    self.begin_stop(Ended::StartFailed { code: 1, message }, "no turn to start");
                } else if !probing && now >= next {
                    self.discover(now, waiting);
                }
                return;
            }
            Life::Running | Life::HandedOver { .. } => {}
        }

        if self.live.due(now) {
            if let Some(epoch) = self.handoff.starting_epoch() {
                self.probe(Probe::Live { epoch });
            } else {
                self.live = Probing::default();
            }
        }
        if self.watchdog.due(now) {
            if matches!(self.life, Life::Running) && self.newest_live.is_some() {
                self.probe(Probe::Watchdog);
            } else {
                self.watchdog = Probing::default();
            }
        }
        self.handoff_timers(now);
        if self.handoff.is_idle() && !self.queue.is_empty() && self.can_restart() {
            self.try_start_queued(now);
        }
    }

    /// Discovery's next step: the node's epoch lock, then a look at the node.
    fn discover(&mut self, now: Instant, waiting: Option<String>) {
        if self.lock.is_none() {
            match self.host.try_lock() {
                Ok(Some(lock)) => self.lock = Some(lock),
                Ok(None) => {
                    let why = "another agent holds the node's epoch lock".to_owned();
                    if waiting.as_deref() != Some(why.as_str()) {
                        tracing::info!(reason = %why, "waiting to take over");
                    }
                    if let Life::Discovering { next, waiting, .. } = &mut self.life {
                        *next = now + LOCK_RETRY;
                        *waiting = Some(why);
                    }
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
        self.probe(Probe::Discover);
    }

    fn stopping_timers(&mut self, now: Instant, kill_at: Instant, give_up: Instant) {
        if now >= give_up {
            let left: Vec<u32> = self.epochs.iter().map(|c| c.pid).collect();
            tracing::error!(pids = ?left, "epochs did not stop in time; giving up on them");
            self.epochs = Epochs::default();
        } else if now >= kill_at {
            if let Life::Stopping { kill_at, .. } = &mut self.life {
                *kill_at = give_up;
            }
            let left: Vec<u32> = self.epochs.iter().map(|c| c.epoch).collect();
            for epoch in left {
                tracing::warn!(epoch, grace = ?self.config.proxy.stop_grace, "envoy ignored SIGTERM; sending SIGKILL");
                self.epochs
                    .signal(epoch, Signal::SIGKILL, Some(Stop::Shutdown));
            }
        }
    }

    fn handoff_timers(&mut self, now: Instant) {
        match &self.handoff {
            Handoff::Starting {
                attempt, deadline, ..
            } if now >= *deadline => {
                let epoch = attempt.epoch;
                if self.epochs.get(epoch).is_some_and(|c| c.stopped.is_none()) {
                    // SIGKILL, not SIGTERM: Envoy's SIGTERM handler also terminates its
                    // parent, which is the epoch still serving (seen on 1.40).
                    self.epochs
                        .signal(epoch, Signal::SIGKILL, Some(Stop::Deadline));
                    let message = format!(
                        "epoch {epoch} not LIVE within the handoff deadline ({:?}); killed it \
                         (SIGKILL), the serving epoch keeps serving",
                        self.config.handoff_deadline
                    );
                    self.record_wedge(WedgeReason::HandoffDeadline, message);
                }
            }
            Handoff::ParentDraining {
                parent: Parent::Ours(p),
                until,
            } if now >= *until + self.config.parent_overdue_grace => {
                let p = *p;
                if self.epochs.get(p).is_some_and(|c| c.stopped.is_none()) {
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
            Handoff::ParentDraining {
                parent: Parent::Foreign { epoch, identity },
                until,
            } => {
                let (epoch, identity, until) = (*epoch, identity.clone(), *until);
                if self.foreign_check.is_some_and(|t| now >= t) {
                    self.foreign_check = Some(now + FOREIGN_PARENT_CHECK);
                    // The names come free only once the predecessor's Envoy is gone: then our
                    // child would abort on its next message to it. Hold them and answer.
                    if self.stand_in.is_none() {
                        if let Ok(guard) = self.host.stand_in(epoch) {
                            if now < until {
                                tracing::warn!(event = "stand_in", epoch, predecessor = %identity, "the predecessor's envoy is gone before its time: standing in for its sockets");
                            }
                            self.stand_in = Some(StandIn {
                                parent_epoch: epoch,
                                _guard: guard,
                            });
                        }
                    }
                }
                if now >= until {
                    self.handoff = Handoff::Idle;
                    self.foreign_check = None;
                    self.family.foreign_parent_until = None;
                    self.write_heartbeat();
                }
            }
            _ => {}
        }
    }

    fn try_start_queued(&mut self, now: Instant) {
        if self.lock.is_none() {
            match self.host.try_lock() {
                Ok(Some(lock)) => self.lock = Some(lock),
                Ok(None) => {
                    self.lock_retry_at = now + LOCK_RETRY;
                    let why = "another pod holds the node's epoch lock (a successor is starting?)";
                    if self.queue.waiting_for.as_deref() != Some(why) {
                        tracing::info!(reason = why, "hot restart queued");
                        self.queue.waiting_for = Some(why.to_owned());
                    }
                    return;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot take the node's epoch lock; restarting without it");
                }
            }
        }
        let Some(newest) = self.newest_live else {
            return;
        };
        let attempt = self.queue.take(newest + 1, Some(Parent::Ours(newest)), now);
        self.start_preflight(attempt);
    }

    // --- stopping ---------------------------------------------------------------------------

    fn begin_stop(&mut self, outcome: Ended, why: &str) {
        if matches!(self.life, Life::Stopping { .. }) {
            return;
        }
        tracing::info!(reason = why, "stopping every epoch");
        let now = Instant::now();
        self.set_marker(false);
        let error = RestartError::Refused("stopping".to_owned());
        self.queue.refuse(&error);
        match std::mem::replace(&mut self.handoff, Handoff::Idle) {
            Handoff::PreFlight(attempt) | Handoff::Starting { attempt, .. } => {
                self.finish(
                    attempt,
                    Outcome::Failed,
                    "the family is stopping".to_owned(),
                );
            }
            _ => {}
        }
        for (_, reply) in self.pending_drains.drain(..) {
            let _ = reply.send(Ok(()));
        }
        self.lock = None;
        self.live = Probing::default();
        self.watchdog = Probing::default();
        // Newest first. An epoch that is not LIVE may have a living parent (here or in another
        // pod), which Envoy's SIGTERM handler would terminate too: it gets SIGKILL.
        let targets: Vec<(u32, EpochState)> = self
            .epochs
            .iter()
            .rev()
            .map(|c| (c.epoch, c.state))
            .collect();
        for (epoch, state) in targets {
            let signal = if state == EpochState::Starting && epoch > 0 {
                Signal::SIGKILL
            } else {
                Signal::SIGTERM
            };
            tracing::info!(epoch, %signal, "stopping epoch");
            self.epochs.signal(epoch, signal, Some(Stop::Shutdown));
        }
        self.life = Life::Stopping {
            outcome,
            kill_at: now + self.config.proxy.stop_grace,
            give_up: now + self.config.proxy.stop_grace + STOP_BACKSTOP,
        };
        self.write_heartbeat();
    }

    // --- node, marker, publishing -------------------------------------------------------------

    /// The node's other fresh heartbeats of our family; notes a starting successor and reports
    /// each untrusted file once.
    fn read_node(&mut self) -> Vec<Heartbeat> {
        if !self.host.has_node() {
            return Vec::new();
        }
        let (heartbeats, rejected) = self.host.read_heartbeats();
        for r in rejected {
            if self.reported.insert((r.path.clone(), r.reason.clone())) {
                tracing::warn!(path = %r.path.display(), reason = %r.reason, "ignoring a heartbeat file");
            }
        }
        let now_ms = self.host.now_unix_ms();
        let max_age = self.config.heartbeat_period * 4;
        let others: Vec<Heartbeat> = heartbeats
            .into_iter()
            .filter(|h| h.identity != self.config.identity && h.base_id == self.base_id)
            .filter(|h| h.fresh(now_ms, max_age))
            .collect();
        if matches!(self.life, Life::Running) {
            let ours = self.newest_live.unwrap_or(0);
            let successor = others
                .iter()
                .find(|h| h.state == NodeState::Starting && h.newest_epoch > ours)
                .map(|h| h.identity.clone());
            if successor != self.family.successor_starting {
                if let Some(s) = &successor {
                    tracing::info!(successor = %s, "a successor pod is starting");
                    // See its takeover soon.
                    if self.newest_live.is_some() && !self.watchdog.in_flight {
                        self.watchdog.next = Some(Instant::now());
                    }
                }
                self.family.successor_starting = successor;
            }
        }
        others
    }

    fn write_heartbeat(&mut self) {
        if !self.host.has_node() {
            return;
        }
        let (state, newest) = match &self.life {
            Life::Discovering { .. } => (NodeState::Waiting, 0),
            Life::Running => match (self.newest_live, self.handoff.attempt()) {
                (Some(n), _) => (NodeState::Serving, n),
                (None, Some(a)) => (NodeState::Starting, a.epoch),
                (None, None) => (
                    NodeState::Starting,
                    self.epochs.newest().map_or(0, |c| c.epoch),
                ),
            },
            Life::HandedOver { .. } => (
                NodeState::HandedOver,
                self.epochs.newest().map_or(0, |c| c.epoch),
            ),
            Life::Stopping { .. } => (
                NodeState::Stopping,
                self.epochs.newest().map_or(0, |c| c.epoch),
            ),
        };
        let now = Instant::now();
        let now_ms = self.host.now_unix_ms();
        let parent_until = match &self.handoff {
            Handoff::ParentDraining { until, .. } if *until > now => {
                now_ms + (*until - now).as_millis() as u64
            }
            _ => 0,
        };
        let heartbeat = Heartbeat {
            format: node::FORMAT.to_owned(),
            identity: self.config.identity.clone(),
            pid: std::process::id(),
            base_id: self.base_id,
            hot_restart_version: self.version.clone(),
            newest_epoch: newest,
            envoy_pid: self.epochs.get(newest).map_or(0, |c| c.pid),
            state,
            updated_unix_ms: now_ms,
            parent_draining_until_unix_ms: parent_until,
            restart_in_flight: self.newest_live.is_some() && self.handoff.attempt().is_some(),
        };
        if let Err(e) = self.host.write_heartbeat(&heartbeat) {
            tracing::error!(error = %e, "cannot write the heartbeat");
        }
    }

    fn set_marker(&mut self, present: bool) {
        if let Err(e) = self.host.set_marker(present) {
            tracing::error!(error = %e, "cannot update the readiness marker");
        }
        if self.marker != present {
            tracing::info!(event = "ready_marker", ready = present, "readiness marker");
            self.marker = present;
        }
    }

    fn record_wedge(&mut self, reason: WedgeReason, message: String) {
        tracing::error!(event = "wedge", reason = %reason, %message, "hot restart wedge");
        self.metrics.wedge(reason.as_str());
        self.family.wedges.push(Wedge {
            reason,
            at: SystemTime::now(),
            message,
        });
        let excess = self.family.wedges.len().saturating_sub(WEDGES_KEPT);
        self.family.wedges.drain(..excess);
    }

    fn finish(&mut self, attempt: Attempt, outcome: Outcome, message: String) {
        let duration = attempt.triggered.elapsed();
        if !attempt.first {
            self.metrics.handoff(duration, outcome.as_str());
        }
        if outcome == Outcome::Rejected {
            self.metrics.config_rejected();
        }
        let spawn_to_live = attempt.spawned.map(|s| s.elapsed());
        match outcome {
            Outcome::Live if attempt.first => tracing::info!(
                event = "handoff",
                outcome = outcome.as_str(),
                first = true,
                epoch = attempt.epoch,
                reason = %attempt.reason,
                ?duration,
                preflight = ?attempt.preflight,
                start_to_live = ?spawn_to_live,
                "first epoch LIVE"
            ),
            Outcome::Live => tracing::info!(
                event = "handoff",
                outcome = outcome.as_str(),
                first = false,
                epoch = attempt.epoch,
                reason = %attempt.reason,
                ?duration,
                queued = ?attempt.queued(),
                preflight = ?attempt.preflight,
                start_to_live = ?spawn_to_live,
                "hot restart done: epoch LIVE"
            ),
            _ => tracing::error!(
                event = "handoff",
                outcome = outcome.as_str(),
                first = attempt.first,
                epoch = attempt.epoch,
                reason = %attempt.reason,
                %message,
                "hot restart did not happen; the serving epoch keeps serving"
            ),
        }
        for waiter in attempt.waiters {
            let _ = waiter.send(match outcome {
                Outcome::Live => Ok(attempt.epoch),
                Outcome::Rejected => Err(RestartError::Rejected(message.clone())),
                Outcome::Failed | Outcome::TimedOut => Err(RestartError::Failed(message.clone())),
            });
        }
        self.family.last_handoff = Some(HandoffResult {
            epoch: attempt.epoch,
            reason: attempt.reason,
            outcome,
            duration,
            queued: attempt.began - attempt.triggered,
            preflight: attempt.preflight,
            at: SystemTime::now(),
            message,
        });
    }

    fn publish(&mut self) {
        let phase = match &self.life {
            Life::Discovering { .. } => ProxyPhase::Starting,
            Life::Running if self.newest_live.is_some() => ProxyPhase::Serving,
            Life::Running => ProxyPhase::Starting,
            Life::HandedOver { .. } => ProxyPhase::HandedOver,
            Life::Stopping { .. } if self.epochs.is_empty() => ProxyPhase::Exited,
            Life::Stopping { .. } => ProxyPhase::Stopping,
        };
        if self.phase_since.0 != phase {
            self.phase_since = (phase, SystemTime::now());
        }
        self.family.handoff = self.handoff_info();
        let state = ProxyState {
            phase,
            since: self.phase_since.1,
            epochs: self.epochs.infos(),
            newest_live: self.newest_live,
            family: Some(self.family.clone()),
        };
        self.state.send_if_modified(|s| {
            if *s == state {
                false
            } else {
                *s = state;
                true
            }
        });
    }

    fn handoff_info(&self) -> Option<envoy_agent_proxy::Handoff> {
        let since = |t: Instant| SystemTime::now() - t.elapsed();
        match &self.handoff {
            Handoff::PreFlight(a) | Handoff::Starting { attempt: a, .. } => {
                Some(envoy_agent_proxy::Handoff {
                    epoch: a.epoch,
                    reason: a.reason.clone(),
                    since: since(a.triggered),
                    stage: if matches!(self.handoff, Handoff::PreFlight(_)) {
                        HandoffStage::PreFlight
                    } else {
                        HandoffStage::Starting
                    },
                    waiting_for: None,
                })
            }
            _ if !self.queue.is_empty() => Some(envoy_agent_proxy::Handoff {
                epoch: self.newest_live.map_or(0, |n| n + 1),
                reason: self.queue.reasons.join(", "),
                since: self.queue.since.map_or_else(SystemTime::now, since),
                stage: HandoffStage::Queued,
                waiting_for: self
                    .queue
                    .waiting_for
                    .clone()
                    .or_else(|| match &self.handoff {
                        Handoff::ParentDraining { parent, .. } => {
                            Some(format!("epoch {} still drains", parent.epoch()))
                        }
                        _ => None,
                    }),
            }),
            _ => None,
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn watch_changed(watch: &mut Option<crate::watch::ConfigWatch>) -> Option<()> {
    match watch {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

/// How an Envoy ended, for the exit counter.
fn exit_kind(result: &Result<Exit, ProxyError>, draining: bool) -> ExitKind {
    use std::os::unix::process::ExitStatusExt;
    match result {
        Ok(exit) if exit.status.signal().is_some() => ExitKind::Signal,
        Ok(exit) if exit.code() == 0 && draining => ExitKind::DrainedParent,
        Ok(exit) if exit.code() == 0 => ExitKind::Clean,
        _ => ExitKind::Crash,
    }
}

fn last_line(text: &str) -> String {
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_owned()
}

/// Envoy's `uptime_current_epoch` (`"12s"`).
fn uptime(text: &str) -> Option<Duration> {
    text.strip_suffix('s')?
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

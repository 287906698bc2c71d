//! [`Supervisor`]: the actor that owns the family's epochs and takes every decision.
//!
//! One loop takes one [`Event`] at a time (a command, a process exit, the answer of an admin
//! probe or of a pre-flight, a config change, a timer) and acts on it. Nothing slow runs on
//! the loop: admin queries and pre-flight run as tasks beside it and come back as events, so a
//! hanging admin API never delays a signal, a deadline or another event. See the crate docs
//! for the rules the decisions follow.
//!
//! Its state is parts that own their data, each beside the decisions about it: the life
//! ([`Life`], here) and the handoff (`crate::handoff`), enums whose variants hold what each
//! state has; the watchdog's checks and whether the admin answers (`watchdog`); what it wrote
//! to the node and the pod (`node_io`); the control plane's readings (`control_plane`); the
//! other pods' facts (`pods`); the standing orders, a drain and a health-check failure
//! (`commands`); the history a fresh family inherits (`history`); a parent kept through its
//! child's crash (`kept`). The published [`ProxyState`] is built from them at each turn
//! (`publish`, `family_state`): nothing is a stored copy of what it shows.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use envoy_agent_proxy::admin::AdminState;
use envoy_agent_proxy::{
    AdminError, DrainOptions, DrainPlan, Ended, Exit, FamilyState, HandoffKind, HandoffStage,
    ProxyError, ProxyPhase, ProxyState, RestartError, ServerInfo,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::answers::{DrainReply, FamilyError, HealthChecksReply};
use crate::config::Config;
use crate::epochs::Epochs;
use crate::handoff::{DrainingParent, Handoff, Queue, Waiter, type_list};
use crate::host::{Checked, Guard, Host, Refusal};
use crate::metrics::{ExitKind, SupervisorMetrics};
use crate::probing::Probing;

mod cold;
mod commands;
mod control_plane;
mod exits;
mod handoffs;
mod history;
mod kept;
mod node_io;
mod pods;
mod probes;
mod retired;
mod watchdog;

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
/// Beyond the stop grace: how long stopping may take before the supervisor gives up waiting.
const STOP_BACKSTOP: Duration = Duration::from_secs(5);
/// The reason of a first epoch started from nothing (not a handover).
pub(crate) const START_REASON: &str = "start";
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
        reply: DrainReply,
    },
    FailHealthChecks {
        reply: HealthChecksReply,
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

/// Why an admin probe (of [`AdminState`]) was sent.
#[derive(Debug)]
enum Probe {
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
    /// A probe's answer: `Some` when an epoch newer than the probe's own answers.
    Probed {
        probe: Probe,
        /// When it was sent: an answer is a fact of that moment, not of when it arrived.
        sent: Instant,
        result: Result<Option<AdminState>, AdminError>,
    },
    /// Where does our first epoch start?
    Discovered(Result<ServerInfo, AdminError>),
    /// Is the starting epoch LIVE? (`Some`: the admin answers LIVE, as this epoch.)
    LiveChecked {
        epoch: u32,
        sent: Instant,
        result: Result<Option<AdminState>, AdminError>,
    },
    /// The binary's hot-restart version.
    Version(Result<String, String>),
    /// What whoever answers on the admin address has of its control plane.
    /// `cold`: of a cold handover's new family.
    XdsRead {
        cold: bool,
        /// How long it took to answer (Envoy visits every stat).
        took: Duration,
        result: Result<envoy_agent_proxy::XdsReading, AdminError>,
    },
    /// Epoch `epoch`'s admin listener is bound.
    AdminBound(u32),
    /// After a cold handover across pods: does the predecessor's Envoy still hold the
    /// configured admin port?
    ForeignAdmin(Result<Option<AdminState>, AdminError>),
    /// Is a cold handover's new family (its Envoy `pid`) LIVE?
    ColdLiveChecked {
        pid: u32,
        sent: Instant,
        result: Result<Option<AdminState>, AdminError>,
    },
    PreFlight {
        epoch: u32,
        checked: Checked,
        result: Result<(), Refusal>,
    },
    Drained {
        result: Result<DrainPlan, FamilyError>,
        replies: Vec<DrainReply>,
    },
    ConfigChanged,
    /// The config is being changed (the watch's debounce runs): its content as it looks now.
    ConfigSettling(Vec<u8>),
    Tick,
}

/// The supervisor's life.
enum Life {
    /// Taking the node's epoch lock and looking for a predecessor to take over from.
    Discovering {
        /// When waiting is given up. Not while an incompatible predecessor serves (the
        /// rollout stays there and says why); none at all once our first epoch waited for its
        /// control plane and was stopped: discovery starts again (fresh facts: the predecessor
        /// may have restarted meanwhile), and it is no failure of the start that the control
        /// plane stays away.
        deadline: Option<Instant>,
        /// The next look at the node (the lock, then who answers on the admin address).
        look: Probing,
        /// Why it waits, as last logged.
        waiting: Option<Waiting>,
        reported_incompatible: Option<Instant>,
        /// The node's epoch lock once taken: kept while waiting (no successor pod allocates
        /// meanwhile), and handed to the first epoch's handoff.
        lock: Option<Guard>,
    },
    /// Our epochs run and none of them is LIVE: the first starts, or the serving one exited
    /// and its starting child (or a probe of the admin address) says who serves now.
    Starting,
    /// Our epoch `live` serves (a restart may be under way beside it).
    Serving { live: u32 },
    /// A successor pod's Envoy took over; ours drain until it terminates them.
    HandedOver { successor: String },
    /// Stopping every epoch; `outcome` is reported once they are gone.
    Stopping {
        outcome: Ended,
        kill_at: Instant,
        give_up: Instant,
        /// The epoch that served when the stop began, until it exits.
        live: Option<u32>,
        /// The successor the family was handed over to before the stop, if it was: the
        /// family's files are the successor's.
        handed_over_to: Option<String>,
        /// Processes of ours outside the family that the stop took over from the handoff:
        /// a retiring old family, a cold family that never became ours (see `retired`).
        old: Epochs,
    },
}

impl Life {
    /// Our epoch that serves: while serving, and while stopping until it exits.
    fn live(&self) -> Option<u32> {
        match self {
            Life::Serving { live } => Some(*live),
            Life::Stopping { live, .. } => *live,
            Life::Discovering { .. } | Life::Starting | Life::HandedOver { .. } => None,
        }
    }

    /// The successor pod whose Envoy took over from ours, also once ours are being stopped.
    fn handed_over_to(&self) -> Option<&str> {
        match self {
            Life::HandedOver { successor } => Some(successor),
            Life::Stopping { handed_over_to, .. } => handed_over_to.as_deref(),
            Life::Discovering { .. } | Life::Starting | Life::Serving { .. } => None,
        }
    }

    /// Our epoch that serves while nothing ends the family (not handed over, not stopping).
    fn serving(&self) -> Option<u32> {
        match self {
            Life::Serving { live } => Some(*live),
            _ => None,
        }
    }

    /// Our epochs run and nothing ends the family: restarts, drains and takeovers apply.
    fn running(&self) -> bool {
        matches!(self, Life::Starting | Life::Serving { .. })
    }

    /// `epoch` of ours went LIVE. A stop under way stays one (it stops this epoch too); a
    /// family handed over serves through its successor, not through ours.
    fn went_live(&mut self, epoch: u32) {
        match self {
            Life::Discovering { .. } | Life::Starting | Life::Serving { .. } => {
                *self = Life::Serving { live: epoch };
            }
            Life::Stopping { live, .. } => *live = Some(epoch),
            Life::HandedOver { .. } => {}
        }
    }

    /// The serving epoch exited.
    fn live_exited(&mut self) {
        match self {
            Life::Serving { .. } => *self = Life::Starting,
            Life::Stopping { live, .. } => *live = None,
            Life::Discovering { .. } | Life::Starting | Life::HandedOver { .. } => {}
        }
    }
}

/// Why a starting supervisor waits for its turn. Its words are the log's and the start
/// failure's; what it does depends on the kind alone.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Waiting {
    /// Another agent holds the node's epoch lock.
    Lock,
    /// What discovery says of the node (a predecessor mid-handoff, an admin port that does
    /// not answer, ...).
    Node(String),
    /// The node's Envoy has another hot-restart version and no cold handover can start
    /// beside it: waiting does not time out (the rollout stays there and says why).
    Incompatible { theirs: String, ours: String },
    /// Our first epoch waited for these types of its control plane and was stopped.
    ControlPlane(Vec<envoy_agent_proxy::XdsType>),
    /// A newer pod's family serves the node: this older one stands by, not ready, until the
    /// rollout deletes it (waiting does not time out; taking over would reverse the rollout).
    NewerPod {
        identity: String,
        theirs: u64,
        ours: u64,
    },
}

impl std::fmt::Display for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Waiting::Lock => f.write_str("another agent holds the node's epoch lock"),
            Waiting::Node(why) => f.write_str(why),
            Waiting::Incompatible { theirs, ours } => write!(
                f,
                "the node's envoy has hot-restart version {theirs}, ours {ours}"
            ),
            Waiting::ControlPlane(types) => {
                write!(f, "the control plane: {}", type_list(types))
            }
            Waiting::NewerPod {
                identity,
                theirs,
                ours,
            } => write!(
                f,
                "a newer pod ({identity}, generation {theirs}; ours {ours}) serves the node: \
                 standing by until this pod is deleted"
            ),
        }
    }
}

/// The running family's hot-restart version, as far as the supervisor knows it.
///
/// `before`: the version known before it was asked again (a cold handover's new family is
/// asked anew), which the status shows until the answer; never one to decide on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Version {
    /// Not asked yet, or the last ask failed.
    Unknown {
        before: Option<String>,
    },
    /// It is being asked (of our LIVE epoch, else of the binary).
    Asking {
        before: Option<String>,
    },
    Known(String),
}

impl Version {
    fn known(&self) -> Option<&str> {
        match self {
            Version::Known(v) => Some(v),
            Version::Unknown { .. } | Version::Asking { .. } => None,
        }
    }

    fn is_unknown(&self) -> bool {
        matches!(self, Version::Unknown { .. })
    }

    /// What the status shows: the version known, else the last one known, else nothing.
    fn shown(&self) -> &str {
        match self {
            Version::Known(v) => v,
            Version::Unknown { before } | Version::Asking { before } => {
                before.as_deref().unwrap_or_default()
            }
        }
    }

    /// It is being asked (again).
    fn ask(&mut self) {
        let before = match std::mem::replace(self, Version::Unknown { before: None }) {
            Version::Known(v) => Some(v),
            Version::Unknown { before } | Version::Asking { before } => before,
        };
        *self = Version::Asking { before };
    }

    /// The ask under way failed.
    fn ask_failed(&mut self) {
        if let Version::Asking { before } = self {
            *self = Version::Unknown {
                before: before.take(),
            };
        }
    }
}

/// A bound stand-in for a dead parent's sockets.
struct StandIn {
    parent_epoch: u32,
    _guard: Guard,
}

/// How soon an exited process whose exit has not arrived yet is looked at again.
const EXIT_ON_ITS_WAY: Duration = Duration::from_millis(50);

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
    /// The running Envoy's hot-restart version, which the next binary must match (the first
    /// epoch starts without waiting for it, except where discovery needs it).
    version: Version,
    /// Stand-ins for dead parents, one per dead parent whose child may still talk to it.
    stand_ins: Vec<StandIn>,
    /// The serving epoch's admin checks, and whether it answers (readiness follows it).
    watchdog: watchdog::Watchdog,
    /// What the handle told the family for the rest of its life (drain, fail health checks).
    orders: commands::Orders,
    /// What the family knows of the node's other pods.
    pods: pods::Pods,
    /// What the supervisor wrote to the node and the pod (heartbeat, readiness marker), and
    /// the node's files it already reported as untrusted.
    files: node_io::NodeFiles,
    /// What a fresh family inherits of this one.
    history: history::History,
    phase_since: (ProxyPhase, SystemTime),
    watch: Option<crate::watch::ConfigWatch>,
    /// The control plane's readings: when the next is due, and what the newest LIVE epoch has
    /// of its config (readiness and the marker wait for it).
    control_plane: control_plane::ControlPlane,
    /// A draining parent kept through its child's crash (see `kept`).
    kept: kept::KeptParent,
    /// The family's files (shared memory, sockets) are ours to remove once it is gone, unless
    /// a successor took it over: an epoch of ours served, or our epoch 0 started (its epoch 0
    /// made the shared memory, also when that epoch never served: a bootstrap Envoy rejects).
    files_ours: bool,
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
        Supervisor {
            life: Life::Starting,
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
            version: Version::Unknown { before: None },
            stand_ins: Vec::new(),
            watchdog: watchdog::Watchdog::new(now),
            orders: commands::Orders::default(),
            pods: pods::Pods::default(),
            files: node_io::NodeFiles::new(now),
            history: history::History::default(),
            phase_since: (ProxyPhase::Starting, SystemTime::now()),
            watch: None,
            control_plane: control_plane::ControlPlane::default(),
            kept: kept::KeptParent::None,
            files_ours: false,
        }
    }

    /// Starts the first epoch and supervises until the family cannot serve anymore or `abort`
    /// is cancelled; every epoch has been stopped and reaped when it returns. Then
    /// [`Supervisor::into_fresh`] makes the supervisor of a fresh family.
    ///
    /// It runs in a `supervisor` span (its base id, kept current across a cold handover, and
    /// identity), which every task it spawns carries too: a log line names its family.
    pub(crate) async fn run(&mut self, abort: CancellationToken) -> Ended {
        let span = tracing::info_span!(
            "supervisor",
            base_id = self.base_id,
            identity = %self.config.identity
        );
        self.run_in_span(abort).instrument(span).await
    }

    async fn run_in_span(&mut self, abort: CancellationToken) -> Ended {
        // The marker means "our newest epoch is LIVE": whatever a crashed predecessor in this
        // container left there is wrong now, before anything else happens.
        if let Err(e) = self.host.set_marker(false) {
            tracing::error!(error = %e, "cannot remove the readiness marker");
        }
        // Discovery asks for it only when something answers on the admin port (to compare it
        // with a predecessor's): a fresh start does not exec the binary beside its Envoy's
        // start, competing for the CPU; it is asked of the LIVE epoch instead.
        let ended = self.supervise(abort).await;
        self.host.remove_heartbeat(&self.config.identity);
        self.stand_ins.clear();
        self.publish();
        // Asked of a family that is gone: each asker hears so (its reply is dropped) rather
        // than waiting for the next family.
        while self.commands.try_recv().is_ok() {}
        tracing::info!(outcome = ?ended, code = ended.code(), "supervisor done");
        ended
    }

    /// Whether the family that ended was ours to the end: an epoch of ours served and no
    /// successor took it over. Its files are then left to nobody but us.
    pub(crate) fn family_files_ours(&self) -> bool {
        self.files_ours && self.life.handed_over_to().is_none()
    }

    /// The supervisor of a fresh family after this one ended (crash recovery in place): the
    /// same host, handles, state channel and metrics, nothing of the old family's running
    /// state (its epochs are reaped, its lock and stand-ins released), only its history. It
    /// starts as any first start does: discovery on the node, then epoch 0 (Envoy's epoch 0
    /// unlinks and recreates the shared memory a crashed family left behind) or a takeover
    /// from whatever LIVE family answers on the admin port.
    pub(crate) fn into_fresh(self) -> Self {
        let mut fresh = Supervisor::new(
            self.config,
            self.base_id,
            self.host,
            self.commands,
            self.state,
            self.metrics,
        );
        fresh.history = self.history;
        if let kept::KeptParent::Handed { .. } = self.kept {
            fresh.kept = self.kept;
            kept::forward_exits(self.events, fresh.events_tx.clone());
        }
        fresh
    }

    async fn supervise(&mut self, abort: CancellationToken) -> Ended {
        let now = Instant::now();
        self.adopt_kept_parent();
        if self.host.has_node() {
            self.life = Life::Discovering {
                deadline: Some(now + self.discovery_bound()),
                look: Probing {
                    next: Some(now),
                    in_flight: false,
                },
                waiting: None,
                reported_incompatible: None,
                lock: None,
            };
        } else {
            self.begin_first(0, None, START_REASON.to_owned());
        }
        if self.config.options.watch_config {
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
            // Work an event made due at once waits for the timer's next millisecond: a tick
            // run without sleeping (tried) starves the runtime when a tick leaves its own wake
            // in the past, and the millisecond is not felt against a handoff.
            let wake = self.next_wake();
            // Once stopping, for whatever reason, an abort has nothing left to do (and the
            // cancelled token would be ready at every turn).
            let stopping = matches!(self.life, Life::Stopping { .. });
            let event = tokio::select! {
                biased;
                () = abort.cancelled(), if !stopping => Event::Abort,
                Some(event) = self.events.recv() => event,
                Some(command) = self.commands.recv() => Event::Command(command),
                changed = watch_changed(&mut self.watch) => match changed {
                    Some(crate::watch::Change::Settled) => Event::ConfigChanged,
                    Some(crate::watch::Change::Settling(content)) => Event::ConfigSettling(content),
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

    /// The family runs under `base_id` from now on (its log lines say so).
    fn set_base_id(&mut self, base_id: u32) {
        self.base_id = base_id;
        // The supervisor's span, while the loop handles an event.
        tracing::Span::current().record("base_id", base_id);
    }

    /// How long a starting supervisor may wait for its turn before it gives up.
    fn discovery_bound(&self) -> Duration {
        self.config.options.handoff_deadline
            + self
                .config
                .parent_shutdown_time()
                .max(self.config.proxy.options.drain_time)
    }

    /// Whether the supervisor is done: stopping with nothing left running.
    fn finished(&mut self) -> Option<Ended> {
        match &self.life {
            Life::Stopping { outcome, .. }
                if self.epochs.is_empty()
                    && self.retired().next().is_none()
                    && !matches!(self.handoff, Handoff::Cold { .. }) =>
            {
                Some(outcome.clone())
            }
            _ => None,
        }
    }

    async fn handle(&mut self, event: Event) {
        match event {
            Event::Abort => self.begin_stop(Ended::Stopped { last: None }, "asked to stop"),
            Event::Command(command) => self.on_command(command),
            Event::Exited { epoch, pid, result } => self.on_exit(epoch, pid, result),
            Event::Probed {
                probe,
                sent,
                result,
            } => self.on_probe(probe, sent, result),
            Event::Discovered(result) => self.on_discovery(result),
            Event::LiveChecked {
                epoch,
                sent,
                result,
            } => {
                if let Some(live) = self.handoff.live_checks_mut() {
                    live.probing.in_flight = false;
                }
                self.on_live_check(epoch, sent, result);
            }
            Event::Version(result) => self.on_version(result),
            Event::XdsRead { cold, took, result } => self.on_xds(cold, took, result),
            Event::AdminBound(epoch) => self.on_admin_bound(epoch),
            Event::ForeignAdmin(result) => self.on_foreign_admin(result),
            Event::ColdLiveChecked { pid, sent, result } => {
                if let Some(live) = self.handoff.live_checks_mut() {
                    live.probing.in_flight = false;
                }
                self.on_cold_live_check(pid, sent, result);
            }
            Event::PreFlight {
                epoch,
                checked,
                result,
            } => self.on_preflight(epoch, checked, result).await,
            Event::Drained { result, replies } => {
                match &result {
                    Ok(plan) => {
                        tracing::info!(drained = %plan.drained_names(), "envoy is draining its listeners")
                    }
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
            Event::ConfigSettling(content) => {
                if self.can_restart() {
                    tracing::debug!("config changing: validating it while the watch settles");
                    self.prevalidate(Some(content));
                }
            }
            Event::Tick => self.on_tick().await,
        }
    }

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
                look,
                waiting,
                ..
            } => {
                consider(look.wake());
                if !matches!(
                    waiting,
                    Some(Waiting::Incompatible { .. } | Waiting::NewerPod { .. })
                ) {
                    consider(*deadline);
                }
            }
            Life::Stopping {
                kill_at, give_up, ..
            } => {
                consider(Some(*kill_at));
                consider(Some(*give_up));
                return wake;
            }
            Life::Starting | Life::Serving { .. } | Life::HandedOver { .. } => {}
        }
        consider(self.handoff.live_checks().and_then(|l| l.probing.wake()));
        consider(self.watchdog.wake());
        consider(self.control_plane.wake());
        match &self.handoff {
            Handoff::Starting {
                attempt, deadline, ..
            } => {
                let stopped = self
                    .epochs
                    .get(attempt.epoch)
                    .is_none_or(|c| c.stopped.is_some());
                if !stopped {
                    consider(deadline.wake());
                }
            }
            Handoff::ParentDraining {
                parent: DrainingParent::Ours(p),
                until,
            } => {
                let overdue_at = until.at + self.config.parent_overdue_grace;
                match self.epochs.get(*p).filter(|c| c.stopped.is_none()) {
                    // Exited but not reaped yet (see `handoff_timers`): looked at again in a
                    // moment rather than at once, over and over.
                    Some(c) if Instant::now() >= overdue_at && !self.host.still_runs(c.pid) => {
                        consider(Some(Instant::now() + EXIT_ON_ITS_WAY));
                    }
                    Some(_) => consider(Some(overdue_at)),
                    None => {}
                }
            }
            Handoff::ParentDraining {
                parent: DrainingParent::Foreign { look_at, .. },
                until,
            } => {
                consider(Some(until.at));
                consider(Some(*look_at));
            }
            _ => {}
        }
        consider(self.cold_wake());
        consider(self.kept_wake());
        if self.handoff.is_idle() && !self.queue.is_empty() && self.can_restart() {
            consider(Some(self.queue_retry_at()));
        }
        if self.host.has_node() {
            consider(Some(self.files.heartbeat_due()));
        }
        wake
    }

    async fn on_tick(&mut self) {
        let now = Instant::now();
        self.heartbeat_timer(now);
        // Before the life's own timers: a kept parent retires at its deadline also while the
        // family discovers or stops.
        self.kept_timers(now);
        match &self.life {
            Life::Stopping {
                kill_at, give_up, ..
            } => {
                let (kill_at, give_up) = (*kill_at, *give_up);
                self.stopping_timers(now, kill_at, give_up);
                return;
            }
            Life::Discovering { .. } => {
                self.discovery_timers(now);
                return;
            }
            Life::Starting | Life::Serving { .. } | Life::HandedOver { .. } => {}
        }

        if self
            .handoff
            .live_checks()
            .is_some_and(|l| l.probing.due(now))
        {
            match self.handoff {
                Handoff::Starting { .. } => self.live_check(),
                Handoff::Cold { .. } => self.cold_live_check(),
                _ => {}
            }
        }
        self.watchdog_timer(now);
        if self.version.is_unknown() && !self.queue.is_empty() && self.life.running() {
            // A restart waits for the running version; the last ask failed.
            self.ask_version();
        }
        if self.control_plane.due(now) {
            self.xds_check();
        }
        self.handoff_timers(now);
        self.cold_timers(now);
        if self.handoff.is_idle()
            && !self.queue.is_empty()
            && self.can_restart()
            && self.queue.not_before.is_none_or(|t| now >= t)
        {
            self.try_start_queued(now);
        }
    }

    /// While the family discovers where to start: gives up past the discovery bound (except
    /// beside an incompatible Envoy or a newer pod's family, whose waits do not time out),
    /// else looks again when due.
    fn discovery_timers(&mut self, now: Instant) {
        let Life::Discovering {
            deadline,
            look,
            waiting,
            ..
        } = &self.life
        else {
            return;
        };
        let over = deadline.is_some_and(|d| now >= d)
            && !matches!(
                waiting,
                Some(Waiting::Incompatible { .. } | Waiting::NewerPod { .. })
            );
        if over {
            let why = waiting.as_ref().map_or_else(
                || "the node's epoch lock stayed taken".to_owned(),
                ToString::to_string,
            );
            let message = format!(
                "could not take over within {:?}: {why}",
                self.discovery_bound()
            );
            tracing::error!(%message);
            self.begin_stop(Ended::StartFailed { code: 1, message }, "no turn to start");
        } else if look.due(now) {
            self.discover(now);
        }
    }

    fn publish(&mut self) {
        let phase = match &self.life {
            Life::Discovering { .. } => ProxyPhase::Starting,
            Life::Serving { .. } => ProxyPhase::Serving,
            Life::Starting => ProxyPhase::Starting,
            Life::HandedOver { .. } => ProxyPhase::HandedOver,
            Life::Stopping { .. } if self.epochs.is_empty() => ProxyPhase::Exited,
            Life::Stopping { .. } => ProxyPhase::Stopping,
        };
        if self.phase_since.0 != phase {
            self.phase_since = (phase, SystemTime::now());
        }
        let state = ProxyState {
            phase,
            since: self.phase_since.1,
            epochs: self.epochs.infos(),
            newest_live: self.life.live(),
            family: Some(self.family_state()),
            config: self.control_plane.status().clone(),
            admin: self.watchdog.health(),
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

    /// The family's facts as the status shows them, all from the supervisor's own state:
    /// what only events told (history, the other pods, standing orders) from the parts that
    /// keep them, the rest derived here.
    fn family_state(&self) -> FamilyState {
        FamilyState {
            base_id: self.base_id,
            hot_restart_version: self.version.shown().to_owned(),
            identity: self.config.identity.clone(),
            handoff: self.handoff_info(),
            last_handoff: self.history.last_handoff().cloned(),
            wedges: self.history.wedges().to_vec(),
            predecessor: self.pods.predecessor().map(str::to_owned),
            foreign_parent_until: self.pods.foreign_parent_until(),
            successor_starting: self.pods.successor_starting().map(str::to_owned),
            handed_over_to: self.life.handed_over_to().map(str::to_owned),
            drained: self.orders.drained(),
            retiring: self.retired_infos(),
            socket_path: self.host.socket_path().to_string(),
            handoffs: self.history.handoffs().to_vec(),
            exits: self.history.exits().to_vec(),
        }
    }

    fn handoff_info(&self) -> Option<envoy_agent_proxy::Handoff> {
        match &self.handoff {
            Handoff::PreFlight { attempt: a, .. } | Handoff::Starting { attempt: a, .. } => {
                Some(envoy_agent_proxy::Handoff {
                    epoch: a.epoch,
                    reason: a.reason.clone(),
                    since: a.triggered.wall,
                    stage: if matches!(self.handoff, Handoff::PreFlight { .. }) {
                        HandoffStage::PreFlight
                    } else {
                        HandoffStage::Starting
                    },
                    waiting_for: (!a.waiting_for_config.is_empty()).then(|| {
                        format!("the control plane: {}", type_list(&a.waiting_for_config))
                    }),
                    kind: a.kind.clone(),
                })
            }
            Handoff::Cold { attempt: a, .. } => Some(envoy_agent_proxy::Handoff {
                epoch: a.epoch,
                reason: a.reason.clone(),
                since: a.triggered.wall,
                stage: HandoffStage::Starting,
                waiting_for: None,
                kind: a.kind.clone(),
            }),
            _ if !self.queue.is_empty() => Some(envoy_agent_proxy::Handoff {
                epoch: self.life.live().map_or(0, |n| n + 1),
                reason: self.queue.reasons.join(", "),
                since: self.queue.since.map_or_else(SystemTime::now, |m| m.wall),
                stage: HandoffStage::Queued,
                waiting_for: self
                    .queue
                    .waiting_for
                    .as_ref()
                    .map(ToString::to_string)
                    .or_else(|| match &self.handoff {
                        Handoff::ParentDraining { parent, .. } => {
                            Some(format!("epoch {} still drains", parent.epoch()))
                        }
                        Handoff::Retiring { .. } => {
                            Some("the old family drains after a cold handover".to_owned())
                        }
                        _ => None,
                    }),
                kind: HandoffKind::Hot,
            }),
            _ => None,
        }
    }
}

impl<H: Host> Supervisor<H> {
    /// Asks the running family's hot-restart version beside the loop: of our LIVE epoch when
    /// there is one (the binary on disk may be a newer one already), else of the binary.
    fn ask_version(&mut self) {
        self.version.ask();
        if self.life.live().is_some() {
            let ask = self.host.serving_version();
            self.beside(ask, |v| Event::Version(v.map_err(|e| e.to_string())));
        } else {
            let ask = self.host.hot_restart_version();
            self.beside(ask, |v| Event::Version(v.map_err(|e| e.to_string())));
        }
    }

    /// Runs `call` beside the loop (in the current span) and sends the loop what `event`
    /// makes of its answer. The loop never waits on Envoy, the node or a process: it hears
    /// back. Dropped with the supervisor's channel, an answer goes nowhere.
    fn beside<T: Send + 'static>(
        &self,
        call: impl Future<Output = T> + Send + 'static,
        event: impl FnOnce(T) -> Event + Send + 'static,
    ) {
        let events = self.events_tx.clone();
        tokio::spawn(
            async move {
                let answer = call.await;
                let _ = events.send(event(answer));
            }
            .in_current_span(),
        );
    }

    fn on_version(&mut self, result: Result<String, String>) {
        match result {
            Ok(version) => {
                if self.version.known().is_none() {
                    self.version = Version::Known(version);
                    self.write_heartbeat();
                    if self.can_restart() {
                        // The binary's own version (and the pair, already proven LIVE), so that
                        // the first restart execs nothing.
                        self.prevalidate(None);
                    }
                }
            }
            Err(message) => {
                self.version.ask_failed();
                tracing::error!(error = %message, "cannot learn the binary's hot-restart version");
                match self.life {
                    Life::Discovering { .. } => self.begin_stop(
                        Ended::StartFailed { code: 1, message },
                        "no hot-restart version",
                    ),
                    _ => self.queue.refuse(&RestartError::Rejected(format!(
                        "the running envoy's hot-restart version is unknown: {message}"
                    ))),
                }
            }
        }
    }

    /// Whether the family's shared memory can take another epoch of the running version.
    fn shm_usable(&self) -> Result<(), String> {
        match self.version.known() {
            Some(version) => self.host.shm_usable(version).map_err(|e| e.to_string()),
            None => Err("the running envoy's hot-restart version is unknown".to_owned()),
        }
    }

    /// Validates ahead of a restart, beside the loop (the restart's pre-flight joins it).
    fn prevalidate(&mut self, content: Option<Vec<u8>>) {
        let running = self.version.known().map(str::to_owned);
        tokio::spawn(self.host.prevalidate(content, running).in_current_span());
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn watch_changed(
    watch: &mut Option<crate::watch::ConfigWatch>,
) -> Option<crate::watch::Change> {
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
        // Envoy's rejection ends with a line that continues the one before it (": Proto
        // constraint validation failed ..."): not a second colon after ours.
        .trim_start_matches([':', ' '])
        .trim()
        .to_owned()
}

#[cfg(test)]
mod life_tests {
    use super::*;

    fn stopping(live: Option<u32>) -> Life {
        let now = Instant::now();
        Life::Stopping {
            outcome: Ended::Stopped { last: None },
            kill_at: now,
            give_up: now,
            live,
            handed_over_to: None,
            old: Epochs::default(),
        }
    }

    #[test]
    fn the_live_epoch_is_part_of_the_state_it_serves_in() {
        let mut life = Life::Starting;
        assert_eq!(
            (life.live(), life.serving(), life.running()),
            (None, None, true)
        );
        life.went_live(0);
        assert!(matches!(life, Life::Serving { live: 0 }));
        life.went_live(1);
        assert_eq!((life.live(), life.serving()), (Some(1), Some(1)));
        life.live_exited();
        assert!(matches!(life, Life::Starting));
    }

    #[test]
    fn a_stop_stays_a_stop_whatever_goes_live_or_exits() {
        let mut life = stopping(Some(2));
        assert_eq!(
            (life.live(), life.serving(), life.running()),
            (Some(2), None, false)
        );
        life.live_exited();
        assert!(matches!(life, Life::Stopping { live: None, .. }));
        life.went_live(3);
        assert!(matches!(life, Life::Stopping { live: Some(3), .. }));
    }

    #[test]
    fn a_family_handed_over_serves_through_its_successor() {
        let mut life = Life::HandedOver {
            successor: "pod-b".to_owned(),
        };
        life.went_live(4);
        assert!(matches!(life, Life::HandedOver { .. }));
        assert_eq!((life.live(), life.running()), (None, false));
    }
}

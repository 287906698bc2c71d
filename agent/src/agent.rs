//! [`Agent`]: runs one proxy and decides when and how it stops.
//!
//! The agent is one actor task ([`Agent::run`]) that owns every decision, plus cloneable
//! [`AgentHandle`]s (the status server's, later the gRPC service's) that send it commands and
//! read its [`AgentState`] from a `watch` channel. Nothing else touches the proxy's lifecycle.
//!
//! # Exit paths
//!
//! | event | what happens | exit code |
//! |---|---|---|
//! | Envoy exits on its own | the agent exits | Envoy's (128+N for signal N) |
//! | SIGTERM / SIGINT | [drain delay] → `drain_listeners?graceful` → wait the termination drain duration (less if Envoy exits) → stop Envoy | 0 |
//! | same, exit-on-zero | … → drain → wait the minimum drain duration → poll active connections, stop at zero; the termination drain duration is a hard deadline; N stats errors in a row end the wait | 0 |
//! | `POST /drain` | drain with `skip_exit`, Envoy keeps running; the next SIGTERM stops at once | 0 |
//! | `POST /quitquitquit` | stop Envoy at once, no drain | 0 |
//! | a second SIGTERM/SIGINT during a drain | stop Envoy at once | 0 |
//!
//! "Stop Envoy" is SIGTERM, then SIGKILL to its process group after the proxy's grace; the
//! agent always waits for Envoy's exit status, so no Envoy outlives it.
//!
//! # Bounds
//!
//! Every admin call runs concurrently with the loop (a hanging admin never stalls a signal or
//! a command) and is dropped when the agent moves on. The drain deadline starts when the
//! drain does (after the optional delay) and covers the drain call itself: an Envoy whose
//! admin API hangs is stopped when the deadline passes, not later.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use envoy_agent_drain::{DrainError, Exclusions, active_connections};
use envoy_agent_proxy::{AdminClient, Exit, Proxy, ProxyError, ServerState};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::signal::{Intent, IntentSource};

/// `EX_SOFTWARE`: the proxy could not be run at all.
pub const EXIT_SOFTWARE: u8 = 70;

/// How the agent drains and stops. [`Default`] gives Istio's defaults.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// How long a shutdown drain lasts before Envoy is stopped; in exit-on-zero mode, the hard
    /// deadline of the wait for zero connections.
    pub termination_drain_duration: Duration,
    /// In exit-on-zero mode, how long to wait after the drain starts before counting.
    pub minimum_drain_duration: Duration,
    /// Stop as soon as Envoy has no active downstream connections (after the minimum).
    pub exit_on_zero_active_connections: bool,
    /// On SIGTERM, report not-ready for this long before draining, so load balancers and
    /// endpoint lists drop the pod first (Istio #36660).
    pub drain_delay: Duration,
    /// Listeners that do not count as active connections.
    pub exclusions: Exclusions,
    /// How often active connections are counted in exit-on-zero mode.
    pub poll_interval: Duration,
    /// Bound on one stats call in exit-on-zero mode.
    pub stats_timeout: Duration,
    /// Consecutive stats failures that end the wait for zero connections.
    pub stats_error_budget: u32,
    /// How often Envoy's state is read while it starts.
    pub live_poll_interval: Duration,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            termination_drain_duration: Duration::from_secs(5),
            minimum_drain_duration: Duration::from_secs(5),
            exit_on_zero_active_connections: false,
            drain_delay: Duration::ZERO,
            exclusions: Exclusions::with_ports([15021, 15090]),
            poll_interval: Duration::from_millis(50),
            stats_timeout: Duration::from_secs(2),
            stats_error_budget: 5,
            live_poll_interval: Duration::from_millis(100),
        }
    }
}

/// Why a drain started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainReason {
    /// A shutdown signal.
    Signal(Intent),
    /// `POST /drain` (native sidecars' preStop): drain with `skip_exit`, keep running.
    DrainEndpoint,
}

impl fmt::Display for DrainReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DrainReason::Signal(intent) => f.write_str(intent.signal_name()),
            DrainReason::DrainEndpoint => f.write_str("POST /drain"),
        }
    }
}

/// Where a drain is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainPhase {
    /// Readiness is off; the drain starts when the delay ends.
    Delay,
    /// Envoy has been told to drain (or is being told).
    Draining,
}

/// Why the agent is exiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitPath {
    /// Envoy exited on its own, with this code.
    ProxyExited {
        /// Envoy's exit code (128+N for signal N).
        code: i32,
    },
    /// The termination drain duration passed.
    DrainTimeElapsed,
    /// Exit-on-zero: no active connections were left.
    ZeroConnections,
    /// Exit-on-zero: connections remained when the deadline passed.
    DrainDeadline,
    /// Exit-on-zero: the connection count could not be read, too often in a row.
    StatsUnavailable,
    /// `POST /quitquitquit`.
    QuitQuitQuit,
    /// A second SIGTERM/SIGINT during a drain.
    SecondSignal,
    /// SIGTERM/SIGINT after `POST /drain` (or with draining disabled).
    SignalAfterDrain,
    /// The proxy could not be run.
    ProxyFailed,
}

impl fmt::Display for ExitPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitPath::ProxyExited { code } => write!(f, "envoy exited with code {code}"),
            ExitPath::DrainTimeElapsed => f.write_str("termination drain duration elapsed"),
            ExitPath::ZeroConnections => f.write_str("no active connections left"),
            ExitPath::DrainDeadline => {
                f.write_str("connections remained at the termination drain deadline")
            }
            ExitPath::StatsUnavailable => f.write_str("active connections could not be counted"),
            ExitPath::QuitQuitQuit => f.write_str("POST /quitquitquit"),
            ExitPath::SecondSignal => f.write_str("second signal during the drain"),
            ExitPath::SignalAfterDrain => f.write_str("signal after POST /drain"),
            ExitPath::ProxyFailed => f.write_str("envoy could not be run"),
        }
    }
}

/// The agent's state, published on a `watch` channel.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentState {
    /// Envoy is starting (not LIVE yet).
    Starting {
        /// Since when.
        since: SystemTime,
    },
    /// Envoy reported LIVE.
    Live {
        /// Since when.
        since: SystemTime,
    },
    /// Draining.
    Draining {
        /// Since when.
        since: SystemTime,
        /// Why.
        reason: DrainReason,
        /// Where.
        phase: DrainPhase,
    },
    /// Stopping Envoy and exiting.
    Exiting {
        /// Since when.
        since: SystemTime,
        /// Why.
        path: ExitPath,
    },
}

impl fmt::Display for AgentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentState::Starting { .. } | AgentState::Live { .. } => f.write_str(self.name()),
            AgentState::Draining {
                reason,
                phase: DrainPhase::Delay,
                ..
            } => write!(f, "draining soon ({reason}; drain delay)"),
            AgentState::Draining { reason, .. } => write!(f, "draining ({reason})"),
            AgentState::Exiting { path, .. } => write!(f, "exiting ({path})"),
        }
    }
}

impl AgentState {
    /// A short name: `starting`, `live`, `draining`, `exiting`.
    pub fn name(&self) -> &'static str {
        match self {
            AgentState::Starting { .. } => "starting",
            AgentState::Live { .. } => "live",
            AgentState::Draining { .. } => "draining",
            AgentState::Exiting { .. } => "exiting",
        }
    }

    /// When this state began.
    pub fn since(&self) -> SystemTime {
        match self {
            AgentState::Starting { since }
            | AgentState::Live { since }
            | AgentState::Draining { since, .. }
            | AgentState::Exiting { since, .. } => *since,
        }
    }
}

/// How the agent's run ended; [`AgentExit::code`] is the process exit code.
#[derive(Debug)]
pub struct AgentExit {
    /// Why.
    pub path: ExitPath,
    /// How Envoy ended, when it ran.
    pub exit: Option<Exit>,
    /// Why Envoy could not be run, when it could not.
    pub error: Option<ProxyError>,
}

impl AgentExit {
    /// Envoy's own code when it exited on its own, 70 when it could not be run, else 0.
    pub fn code(&self) -> u8 {
        match self.path {
            ExitPath::ProxyExited { code } => u8::try_from(code).unwrap_or(1),
            ExitPath::ProxyFailed => EXIT_SOFTWARE,
            _ => 0,
        }
    }
}

/// Why a command to the agent failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The agent has exited or is exiting.
    #[error("the agent is exiting")]
    Gone,
    /// Envoy refused or did not answer the drain; the agent still skips the drain on exit.
    #[error("drain failed: {0}")]
    DrainFailed(String),
}

enum Command {
    Drain {
        /// `None`: the proxy's own choice (inbound only for sidecars).
        inbound_only: Option<bool>,
        skip_exit: bool,
        reply: oneshot::Sender<Result<(), String>>,
    },
    Quit,
    DisableDraining,
}

/// A cloneable handle to a running [`Agent`].
#[derive(Clone)]
pub struct AgentHandle {
    commands: mpsc::Sender<Command>,
    state: watch::Receiver<AgentState>,
    admin: Arc<dyn Fn() -> Option<SocketAddr> + Send + Sync>,
}

impl fmt::Debug for AgentHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentHandle")
            .field("state", &*self.state.borrow())
            .finish_non_exhaustive()
    }
}

// === impl AgentHandle ===

impl AgentHandle {
    /// The agent's state, now and as it changes.
    pub fn state(&self) -> watch::Receiver<AgentState> {
        self.state.clone()
    }

    /// Envoy's admin API, when its address is known.
    pub fn admin(&self) -> Option<AdminClient> {
        (self.admin)().map(AdminClient::new)
    }

    /// `/drain`: drain with `skip_exit` (Envoy keeps running and accepting); the next
    /// SIGTERM then exits at once. Resolves when Envoy has accepted the drain.
    pub async fn drain_now(&self) -> Result<(), AgentError> {
        self.drain(None, true).await
    }

    /// Drains Envoy's listeners (inbound only, or all; `None`: the proxy's own choice) and
    /// keeps Envoy running: the next SIGTERM exits at once. With `skip_exit` the listeners keep
    /// accepting; without, Envoy stops them when its drain time ends.
    pub async fn drain(
        &self,
        inbound_only: Option<bool>,
        skip_exit: bool,
    ) -> Result<(), AgentError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Drain {
                inbound_only,
                skip_exit,
                reply,
            })
            .await
            .map_err(|_| AgentError::Gone)?;
        answer
            .await
            .map_err(|_| AgentError::Gone)?
            .map_err(AgentError::DrainFailed)
    }

    /// `/quitquitquit`: stop Envoy at once, without draining, and exit.
    pub async fn quit(&self) -> Result<(), AgentError> {
        self.commands
            .send(Command::Quit)
            .await
            .map_err(|_| AgentError::Gone)
    }

    /// Skip the drain on the next SIGTERM (stop at once).
    pub async fn disable_draining(&self) -> Result<(), AgentError> {
        self.commands
            .send(Command::DisableDraining)
            .await
            .map_err(|_| AgentError::Gone)
    }
}

/// Runs a proxy until it exits or an intent or command stops it. See the module docs.
pub struct Agent<P> {
    proxy: Arc<P>,
    config: AgentConfig,
    metrics: crate::telemetry::AgentMetrics,
    commands: mpsc::Receiver<Command>,
    state: watch::Sender<AgentState>,
}

impl<P> fmt::Debug for Agent<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

type Pending<T> = Option<Pin<Box<dyn Future<Output = T> + Send>>>;

/// Awaits the future in `slot`, or never when there is none.
async fn settle<T>(slot: &mut Pending<T>) -> T {
    match slot {
        Some(future) => future.await,
        None => std::future::pending().await,
    }
}

/// A shutdown drain under way.
#[derive(Debug)]
struct Shutdown {
    reason: DrainReason,
    /// When the drain call goes out (after the delay).
    drain_at: Instant,
    drain_sent: bool,
    /// Exit-on-zero: counting starts here.
    count_from: Instant,
    next_count: Instant,
    deadline: Instant,
    stats_errors: u32,
}

// === impl Agent ===

impl<P: Proxy> Agent<P> {
    /// An agent for `proxy`, and a handle to it.
    pub fn new(proxy: Arc<P>, config: AgentConfig) -> (Self, AgentHandle) {
        let (commands_tx, commands) = mpsc::channel(16);
        let state = watch::Sender::new(AgentState::Starting {
            since: SystemTime::now(),
        });
        let admin = {
            let proxy = proxy.clone();
            Arc::new(move || proxy.admin_address())
        };
        let handle = AgentHandle {
            commands: commands_tx,
            state: state.subscribe(),
            admin,
        };
        (
            Agent {
                proxy,
                config,
                metrics: crate::telemetry::AgentMetrics::default(),
                commands,
                state,
            },
            handle,
        )
    }

    /// Records into `metrics` (drain duration and exit path).
    pub fn with_metrics(mut self, metrics: crate::telemetry::AgentMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    fn publish(&self, state: AgentState) {
        tracing::info!(event = "agent_state", state = %state, "agent state");
        self.state.send_replace(state);
    }

    /// Starts the proxy at epoch 0 and returns once it has exited and been reaped.
    pub async fn run(mut self, mut intents: impl IntentSource) -> AgentExit {
        let abort = CancellationToken::new();
        let run = {
            let (proxy, abort) = (self.proxy.clone(), abort.clone());
            async move { proxy.run(0, abort).await }
        };
        tokio::pin!(run);

        let mut intents_open = true;
        let mut commands_open = true;
        let mut skip_drain = false;
        let mut stopping: Option<ExitPath> = None;
        let mut shutdown: Option<Shutdown> = None;
        let mut live = false;
        let mut next_live_check = Some(Instant::now());
        let mut live_check: Pending<Result<ServerState, String>> = None;
        let mut drain_call: Pending<Result<(), ProxyError>> = None;
        let mut drain_reply: Option<oneshot::Sender<Result<(), String>>> = None;
        let mut count_call: Pending<Result<u64, DrainError>> = None;
        let mut drain_started: Option<Instant> = None;

        let result = loop {
            let wake = self.next_wake(
                stopping.is_some(),
                shutdown.as_ref(),
                next_live_check,
                count_call.is_some(),
            );
            // Decisions taken in a branch; applied below, where `self` is free again.
            let mut stop_now: Option<ExitPath> = None;
            tokio::select! {
                result = &mut run => break result,

                intent = intents.next(), if intents_open => match intent {
                    None => intents_open = false,
                    Some(intent @ (Intent::Terminate | Intent::Interrupt)) => {
                        if stopping.is_some() {
                            tracing::info!(signal = intent.signal_name(), "already stopping");
                        } else if shutdown.is_some() {
                            stop_now = Some(ExitPath::SecondSignal);
                        } else if skip_drain {
                            stop_now = Some(ExitPath::SignalAfterDrain);
                        } else {
                            let s = self.begin_shutdown(DrainReason::Signal(intent));
                            drain_started.get_or_insert_with(Instant::now);
                            shutdown = Some(s);
                            // A /drain call in flight is superseded by the shutdown drain.
                            drain_call = None;
                        }
                    }
                    Some(Intent::ReopenLogs) => {
                        if let Err(e) = self.proxy.reopen_logs() {
                            tracing::warn!(error = %e, "cannot forward SIGUSR1 to envoy");
                        }
                    }
                    Some(Intent::Reload) => {
                        tracing::warn!("SIGHUP ignored: hot restart is off");
                    }
                },

                command = self.commands.recv(), if commands_open => match command {
                    None => commands_open = false,
                    Some(Command::Quit) => {
                        if stopping.is_none() {
                            stop_now = Some(ExitPath::QuitQuitQuit);
                        }
                    }
                    Some(Command::DisableDraining) => {
                        tracing::info!("draining disabled: the next SIGTERM stops envoy at once");
                        skip_drain = true;
                    }
                    Some(Command::Drain { inbound_only, skip_exit, reply }) => {
                        if stopping.is_some() || shutdown.is_some() {
                            // Already draining for shutdown: nothing more to ask of Envoy.
                            let _ = reply.send(Ok(()));
                        } else {
                            skip_drain = true;
                            drain_started.get_or_insert_with(Instant::now);
                            self.publish(AgentState::Draining {
                                since: SystemTime::now(),
                                reason: DrainReason::DrainEndpoint,
                                phase: DrainPhase::Draining,
                            });
                            drain_call = Some(match inbound_only {
                                None => self.drain_future(skip_exit),
                                Some(inbound_only) => self.admin_drain_future(inbound_only, skip_exit),
                            });
                            // A newer caller replaces an older one, which learns the outcome
                            // of the same drain through its dropped channel only.
                            drain_reply = Some(reply);
                        }
                    }
                },

                () = sleep_until(wake) => {
                    let now = Instant::now();
                    if next_live_check.is_some_and(|t| t <= now) && live_check.is_none() {
                        next_live_check = None;
                        live_check = self.live_future();
                        if live_check.is_none() {
                            // Admin address not known yet: look again shortly.
                            next_live_check = Some(now + self.config.live_poll_interval);
                        }
                    }
                    if let Some(s) = shutdown.as_mut().filter(|_| stopping.is_none()) {
                        if !s.drain_sent && s.drain_at <= now {
                            s.drain_sent = true;
                            if !self.config.drain_delay.is_zero() {
                                self.publish(AgentState::Draining {
                                    since: SystemTime::now(),
                                    reason: s.reason,
                                    phase: DrainPhase::Draining,
                                });
                            }
                            drain_call = Some(self.drain_future(false));
                        }
                        if s.deadline <= now {
                            stop_now = Some(if self.config.exit_on_zero_active_connections {
                                ExitPath::DrainDeadline
                            } else {
                                ExitPath::DrainTimeElapsed
                            });
                        } else if self.config.exit_on_zero_active_connections
                            && s.drain_sent
                            && s.count_from <= now
                            && s.next_count <= now
                            && count_call.is_none()
                        {
                            s.next_count = now + self.config.poll_interval;
                            count_call = self.count_future();
                        }
                    }
                }

                state = settle(&mut live_check) => {
                    live_check = None;
                    match state {
                        Ok(ServerState::Live) if !live && shutdown.is_none() && !skip_drain => {
                            live = true;
                            self.publish(AgentState::Live { since: SystemTime::now() });
                        }
                        Ok(ServerState::Live) => live = true,
                        Ok(other) => {
                            tracing::debug!(state = ?other, "envoy not LIVE yet");
                            next_live_check = Some(Instant::now() + self.config.live_poll_interval);
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "envoy state unknown yet");
                            next_live_check = Some(Instant::now() + self.config.live_poll_interval);
                        }
                    }
                }

                result = settle(&mut drain_call) => {
                    drain_call = None;
                    match &result {
                        Ok(()) => tracing::info!("envoy is draining its listeners"),
                        Err(e) => tracing::warn!(error = %e, "drain request failed"),
                    }
                    if let Some(reply) = drain_reply.take() {
                        let _ = reply.send(result.map_err(|e| e.to_string()));
                    }
                }

                count = settle(&mut count_call) => {
                    count_call = None;
                    if let Some(s) = shutdown.as_mut() {
                        match count {
                            Ok(0) => stop_now = Some(ExitPath::ZeroConnections),
                            Ok(n) => {
                                s.stats_errors = 0;
                                tracing::debug!(active_connections = n, "waiting for zero");
                            }
                            Err(e) => {
                                s.stats_errors += 1;
                                tracing::warn!(
                                    error = %e,
                                    errors = s.stats_errors,
                                    budget = self.config.stats_error_budget,
                                    "cannot count active connections"
                                );
                                if s.stats_errors >= self.config.stats_error_budget {
                                    stop_now = Some(ExitPath::StatsUnavailable);
                                }
                            }
                        }
                    }
                }
            }

            if let (Some(path), None) = (stop_now, stopping) {
                stopping = Some(path);
                tracing::info!(%path, "stopping envoy");
                self.publish(AgentState::Exiting {
                    since: SystemTime::now(),
                    path,
                });
                // In-flight admin calls are moot now; dropping them closes their connections.
                live_check = None;
                drain_call = None;
                count_call = None;
                abort.cancel();
            }
        };
        self.proxy.cleanup();

        let (path, exit, error) = match result {
            Err(e) => {
                tracing::error!(error = %e, "envoy could not be run");
                (ExitPath::ProxyFailed, None, Some(e))
            }
            Ok(exit) => {
                log_exit(&exit);
                let path = stopping.unwrap_or(ExitPath::ProxyExited { code: exit.code() });
                (path, Some(exit), None)
            }
        };
        self.publish(AgentState::Exiting {
            since: SystemTime::now(),
            path,
        });
        self.metrics
            .exit(&path.to_string(), drain_started.map(|t| t.elapsed()));
        AgentExit { path, exit, error }
    }

    fn begin_shutdown(&self, reason: DrainReason) -> Shutdown {
        let now = Instant::now();
        let drain_at = now + self.config.drain_delay;
        tracing::info!(
            %reason,
            drain_delay = ?self.config.drain_delay,
            termination_drain_duration = ?self.config.termination_drain_duration,
            exit_on_zero = self.config.exit_on_zero_active_connections,
            "shutting down: draining envoy"
        );
        let phase = if self.config.drain_delay.is_zero() {
            DrainPhase::Draining
        } else {
            DrainPhase::Delay
        };
        self.publish(AgentState::Draining {
            since: SystemTime::now(),
            reason,
            phase,
        });
        Shutdown {
            reason,
            drain_at,
            drain_sent: false,
            count_from: drain_at + self.config.minimum_drain_duration,
            next_count: drain_at + self.config.minimum_drain_duration,
            deadline: drain_at + self.config.termination_drain_duration,
            stats_errors: 0,
        }
    }

    /// The next moment the loop has something to do on its own.
    fn next_wake(
        &self,
        stopping: bool,
        shutdown: Option<&Shutdown>,
        next_live_check: Option<Instant>,
        counting: bool,
    ) -> Option<Instant> {
        if stopping {
            return None;
        }
        let mut wake = next_live_check;
        let mut consider = |t: Instant| wake = Some(wake.map_or(t, |w| w.min(t)));
        if let Some(s) = shutdown {
            if !s.drain_sent {
                consider(s.drain_at);
            }
            consider(s.deadline);
            if self.config.exit_on_zero_active_connections && s.drain_sent && !counting {
                consider(s.next_count.max(s.count_from));
            }
        }
        wake
    }

    fn drain_future(
        &self,
        skip_exit: bool,
    ) -> Pin<Box<dyn Future<Output = Result<(), ProxyError>> + Send>> {
        let proxy = self.proxy.clone();
        Box::pin(async move { proxy.drain(skip_exit).await })
    }

    /// A drain with explicit options, straight to the admin API.
    fn admin_drain_future(
        &self,
        inbound_only: bool,
        skip_exit: bool,
    ) -> Pin<Box<dyn Future<Output = Result<(), ProxyError>> + Send>> {
        let admin = self.proxy.admin_address().map(AdminClient::new);
        Box::pin(async move {
            let admin = admin.ok_or(ProxyError::AdminUnknown)?;
            envoy_agent_drain::drain_listeners(&admin, inbound_only, skip_exit)
                .await
                .map_err(|e| match e {
                    DrainError::Admin(e) => ProxyError::Admin(e),
                    _ => ProxyError::AdminUnknown,
                })
        })
    }

    fn live_future(&self) -> Pending<Result<ServerState, String>> {
        let admin =
            AdminClient::new(self.proxy.admin_address()?).with_timeout(self.config.stats_timeout);
        Some(Box::pin(async move {
            admin
                .server_info()
                .await
                .map(|info| info.state)
                .map_err(|e| e.to_string())
        }))
    }

    fn count_future(&self) -> Pending<Result<u64, DrainError>> {
        let Some(addr) = self.proxy.admin_address() else {
            return Some(Box::pin(async { Err(DrainError::AdminUnknown) }));
        };
        let admin = AdminClient::new(addr).with_timeout(self.config.stats_timeout);
        let exclusions = self.config.exclusions.clone();
        Some(Box::pin(async move {
            active_connections(&admin, &exclusions).await
        }))
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn log_exit(exit: &Exit) {
    use std::os::unix::process::ExitStatusExt;
    let code = exit.code();
    if exit.aborted {
        tracing::info!(pid = exit.pid, code, ran_for = ?exit.ran_for, "envoy stopped");
    } else if code == 0 {
        tracing::info!(pid = exit.pid, ran_for = ?exit.ran_for, "envoy exited");
    } else {
        let hint = match exit.status.signal() {
            Some(9) => " (SIGKILL: it may have been OOM-killed)",
            _ => "",
        };
        tracing::error!(
            pid = exit.pid,
            code,
            ran_for = ?exit.ran_for,
            "envoy exited with code {code}{hint}; the end of its stderr:\n{}",
            exit.stderr_tail.trim_end()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Call, FakeProxy};

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
            // Let the agent act on it before the test moves time on.
            tokio::task::yield_now().await;
        }

        async fn exit(self) -> (AgentExit, Arc<FakeProxy>, Instant) {
            let exit = self.task.await.unwrap();
            (exit, self.proxy, self.started)
        }
    }

    fn config() -> AgentConfig {
        AgentConfig::default()
    }

    #[tokio::test(start_paused = true)]
    async fn sigterm_drains_then_stops_after_the_termination_drain_duration() {
        let h = start(FakeProxy::default(), config());
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
        assert_eq!(exit.code(), 0);
        assert_eq!(
            proxy.calls(),
            [Call::Drain { skip_exit: false }, Call::Stop]
        );
        let stopped = proxy.stopped_at().unwrap() - started;
        assert_eq!(stopped.as_secs(), 5, "stopped after {stopped:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn envoy_exiting_during_the_drain_ends_the_wait_with_its_code() {
        let h = start(FakeProxy::default(), config());
        h.signal(Intent::Terminate).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        h.proxy.exit_on_its_own(0);
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::ProxyExited { code: 0 });
        assert_eq!(proxy.calls(), [Call::Drain { skip_exit: false }]);
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
    async fn drain_endpoint_keeps_running_and_the_next_sigterm_stops_at_once() {
        let h = start(FakeProxy::default(), config());
        h.handle.drain_now().await.unwrap();
        assert!(matches!(
            *h.handle.state().borrow(),
            AgentState::Draining {
                reason: DrainReason::DrainEndpoint,
                ..
            }
        ));
        // Draining "forever": an hour later Envoy still runs.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert_eq!(h.proxy.calls(), [Call::Drain { skip_exit: true }]);
        let before = Instant::now();
        h.signal(Intent::Terminate).await;
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::SignalAfterDrain);
        assert_eq!(proxy.calls(), [Call::Drain { skip_exit: true }, Call::Stop]);
        assert_eq!(proxy.stopped_at().unwrap(), before);
    }

    #[tokio::test(start_paused = true)]
    async fn quitquitquit_stops_without_draining() {
        let h = start(FakeProxy::default(), config());
        h.handle.quit().await.unwrap();
        let (exit, proxy, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::QuitQuitQuit);
        assert_eq!(exit.code(), 0);
        assert_eq!(proxy.calls(), [Call::Stop]);
    }

    #[tokio::test(start_paused = true)]
    async fn disable_draining_makes_sigterm_stop_at_once() {
        let h = start(FakeProxy::default(), config());
        h.handle.disable_draining().await.unwrap();
        tokio::task::yield_now().await;
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
        h.signal(Intent::Terminate).await;
        assert!(matches!(
            *h.handle.state().borrow(),
            AgentState::Draining {
                phase: DrainPhase::Delay,
                ..
            }
        ));
        tokio::time::sleep(Duration::from_millis(2900)).await;
        assert!(h.proxy.calls().is_empty(), "no drain during the delay");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(h.proxy.calls(), [Call::Drain { skip_exit: false }]);
        assert!(matches!(
            *h.handle.state().borrow(),
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
        assert_eq!(exit.path, ExitPath::DrainTimeElapsed);
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_gives_up_after_the_stats_error_budget() {
        // The fake has no admin API: every count fails.
        let mut c = config();
        c.exit_on_zero_active_connections = true;
        c.termination_drain_duration = Duration::from_secs(60);
        let h = start(FakeProxy::default(), c);
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::StatsUnavailable);
        let stopped = proxy.stopped_at().unwrap() - started;
        // Minimum drain (5s), then five failures 50ms apart.
        assert!(
            stopped >= Duration::from_secs(5) && stopped < Duration::from_secs(6),
            "{stopped:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn exit_on_zero_is_bounded_by_the_termination_drain_duration() {
        let mut c = config();
        c.exit_on_zero_active_connections = true;
        c.minimum_drain_duration = Duration::from_secs(10);
        c.termination_drain_duration = Duration::from_secs(7);
        let h = start(FakeProxy::default(), c);
        h.signal(Intent::Terminate).await;
        let (exit, proxy, started) = h.exit().await;
        assert_eq!(exit.path, ExitPath::DrainDeadline);
        assert_eq!((proxy.stopped_at().unwrap() - started).as_secs(), 7);
    }

    #[tokio::test(start_paused = true)]
    async fn state_goes_exiting_with_the_path() {
        let h = start(FakeProxy::default(), config());
        let mut state = h.handle.state();
        h.handle.quit().await.unwrap();
        let (exit, _, _) = h.exit().await;
        assert_eq!(exit.path, ExitPath::QuitQuitQuit);
        state.changed().await.ok();
        assert!(matches!(
            *state.borrow(),
            AgentState::Exiting {
                path: ExitPath::QuitQuitQuit,
                ..
            }
        ));
    }
}

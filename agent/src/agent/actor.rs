//! The agent's actor: one task that owns the [`Mode`] and turns every [`Event`] into a
//! transition.
//!
//! Each turn of the loop publishes the status, waits for the next event (the proxy's run
//! ending, its state changing, an intent, a command, an answer to a call the mode has out, or
//! the mode's own timer) and handles it. A mode owns its in-flight work (the successor
//! question while deciding, the shutdown's drain and counts, a drain request's call and its
//! waiting replies), so leaving a mode drops that work, closing its connections. How a
//! request to stop (SIGTERM, SIGINT, gRPC `Stop`, quit) maps to a transition in each mode is
//! one function, [`on_stop`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use envoy_agent_drain::{Count, Counting, DrainError, Pace, Tally};
use envoy_agent_proxy::{
    AdminClient, DrainOptions, DrainPlan, Ended, PlanNote, Proxy, ProxyError, ProxyPhase,
    ProxyState, RestartError,
};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::Agent;
use super::handle::{AgentError, Command, Reply};
use super::shutdown::{Answer, Counted, Ending, ListenersRead, Shutdown, Step};
use super::state::{AgentConfig, AgentExit, AgentState, DrainPhase, DrainReason, ExitPath, Via};
use crate::config::timeline::Step as TimelineStep;
use crate::crash::{Crash, CrashAction, CrashLoop, Crashes};
use crate::signal::{Intent, IntentSource};

/// Bound on asking the proxy whether a successor takes over (it asks the admin API).
const SUCCESSOR_TIMEOUT: Duration = Duration::from_secs(3);

/// Why nothing runs while the agent recovers from a crash.
const RECOVERING: &str = "no envoy runs: the agent is recovering from a crash";

type Call<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What the next SIGTERM does while the agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OnSignal {
    /// Hand over or drain gracefully.
    Drain,
    /// Stop at once (draining was disabled).
    StopAtOnce,
}

/// The agent's mode: one enum, never flags that must agree. Each variant owns the work it
/// has out.
pub(super) enum Mode {
    /// Envoy runs (starting or LIVE).
    Running(OnSignal),
    /// A stop is coming (for `reason`): asking the proxy whether a successor pod takes over.
    Deciding {
        reason: DrainReason,
        successor: Call<Option<String>>,
    },
    /// The graceful shutdown's timeline: delay, drain, wait, stop; or a drain request's,
    /// which ends with Envoy drained and serving (until a signal continues it to the stop).
    ShuttingDown(Box<Shutdown>),
    /// A successor pod takes over: waiting for it to terminate our Envoy (or, should it go
    /// away, to drain our own for `reason`).
    HandingOver {
        successor: String,
        until: Instant,
        reason: DrainReason,
    },
    /// The proxy was told to stop; waiting for it to end.
    Stopping(ExitPath),
    /// Crash recovery: the proxy's run ended in a crash; it runs again at `next_at`.
    Recovering {
        attempt: u32,
        next_at: Instant,
        /// `next_at` on the wall clock, for the status.
        restart_at: SystemTime,
        /// What a SIGTERM would have done once the proxy runs again.
        on_signal: OnSignal,
    },
}

/// A request to stop, from wherever it came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StopAsk {
    /// SIGTERM or SIGINT.
    Signal(Intent),
    /// gRPC `Stop`: the SIGTERM path, for a controller.
    Stop,
    /// `/quitquitquit`, gRPC `QuitQuitQuit`: no drain.
    Quit(Via),
}

/// What a [`StopAsk`] does in a mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Transition {
    /// Ask whether a successor pod takes over, then hand over or drain (for this reason).
    Decide(DrainReason),
    /// Stop Envoy now, by this path.
    StopNow(ExitPath),
    /// A drain request's timeline goes on to the stop.
    Continue,
    /// Nothing changes (why, for the log).
    Stay(&'static str),
}

/// How a request to stop maps to a transition in `mode`. A second SIGTERM or SIGINT during a
/// drain, a decision or a handover stops at once: that is how an operator (or the kubelet,
/// at its grace period) insists. A second gRPC `Stop` does not: a controller that repeats a
/// call it saw time out must not cut the drain it started; it is answered, and nothing
/// changes.
pub(super) fn on_stop(mode: &Mode, ask: StopAsk) -> Transition {
    match (ask, mode) {
        (_, Mode::Stopping(_)) => Transition::Stay("already stopping"),
        (StopAsk::Quit(via), _) => Transition::StopNow(ExitPath::QuitQuitQuit(via)),
        (_, Mode::Recovering { .. }) => Transition::StopNow(ExitPath::StoppedWhileRecovering),
        (_, Mode::ShuttingDown(s)) if s.ending() == Ending::KeepServing => Transition::Continue,
        (
            StopAsk::Signal(_),
            Mode::ShuttingDown(_) | Mode::Deciding { .. } | Mode::HandingOver { .. },
        ) => Transition::StopNow(ExitPath::SecondSignal),
        (
            StopAsk::Stop,
            Mode::ShuttingDown(_) | Mode::Deciding { .. } | Mode::HandingOver { .. },
        ) => Transition::Stay("already on the way out"),
        (_, Mode::Running(OnSignal::StopAtOnce)) => Transition::StopNow(ExitPath::SignalAfterDrain),
        (StopAsk::Signal(intent), Mode::Running(OnSignal::Drain)) => {
            Transition::Decide(DrainReason::Signal(intent))
        }
        (StopAsk::Stop, Mode::Running(OnSignal::Drain)) => Transition::Decide(DrainReason::Stop),
    }
}

/// What happened, one at a time.
enum Event {
    /// The proxy's run ended (by itself, or as asked).
    RunEnded(Result<Ended, ProxyError>),
    /// The proxy's state changed; `open: false`: it is ending.
    ProxyChanged { open: bool },
    /// A signal's intent; none: the source is closed.
    Intent(Option<Intent>),
    /// A handle's command; none: every handle is gone.
    Command(Option<Command>),
    /// The proxy's answer whether a successor pod takes over.
    Successor(Option<String>),
    /// Envoy's answer to a drain request.
    DrainAnswered(Result<DrainPlan, ProxyError>),
    /// Envoy's answer to the request that it fail its health checks.
    HealthChecksAnswered(Result<(), ProxyError>),
    /// An exit-on-zero count.
    Counted(Counted),
    /// A reading of what each counted listener holds.
    ListenersRead(ListenersRead),
    /// Envoy's listeners, for a sidecar's app rule.
    OutboundRead(Result<Vec<envoy_agent_proxy::listeners::Listener>, String>),
    /// Whether the app holds a connection to an outbound listener.
    AppProbed(Result<bool, DrainError>),
    /// The mode's timer.
    Tick,
}

/// How the loop ended: the proxy's run, and the crash-loop's verdict if it gave up.
struct End {
    result: Result<Ended, ProxyError>,
    gave_up: Option<ExitPath>,
}

/// Which inputs still deliver (a closed one is no longer listened to).
struct Open {
    intents: bool,
    commands: bool,
    proxy_state: bool,
}

pub(super) struct Actor<P, I> {
    agent: Agent<P>,
    intents: I,
    /// Cancelled once the agent decides to stop: the proxy stops every Envoy.
    abort: CancellationToken,
    proxy_state: watch::Receiver<ProxyState>,
    crash_loop: CrashLoop,
    /// When the first drain (or stop) began, for the exit's metric.
    drain_started: Option<Instant>,
    /// What started the first drain, for the termination message.
    drain_reason: Option<DrainReason>,
    /// When the agent decided to stop Envoy.
    stop_began: Option<Instant>,
    /// What the counted listeners held at the last reading before the stop.
    still_open: Option<Vec<envoy_agent_drain::ListenerActivity>>,
    open: Open,
    /// The proxy's run; while recovering from a crash, a stand-in that ends only when the
    /// agent stops.
    run: Call<Result<Ended, ProxyError>>,
    mode: Mode,
}

impl<P: Proxy, I: IntentSource> Actor<P, I> {
    pub(super) fn new(agent: Agent<P>, intents: I) -> Self {
        let abort = CancellationToken::new();
        let run = proxy_run(&agent.proxy, &abort);
        Actor {
            proxy_state: agent.proxy.state(),
            crash_loop: CrashLoop::new(agent.config.crash_recovery),
            agent,
            intents,
            abort,
            drain_started: None,
            drain_reason: None,
            stop_began: None,
            still_open: None,
            open: Open {
                intents: true,
                commands: true,
                proxy_state: true,
            },
            run,
            mode: Mode::Running(OnSignal::Drain),
        }
    }

    /// Runs until the proxy has ended and every Envoy has been reaped.
    pub(super) async fn run(mut self) -> AgentExit {
        let end = loop {
            self.publish();
            let event = self.next_event().await;
            if let Some(end) = self.handle(event) {
                break end;
            }
        };
        self.finish(end)
    }

    async fn next_event(&mut self) -> Event {
        let wake = self.next_wake();
        tokio::select! {
            result = &mut self.run => Event::RunEnded(result),
            changed = self.proxy_state.changed(), if self.open.proxy_state => {
                Event::ProxyChanged { open: changed.is_ok() }
            }
            intent = self.intents.next(), if self.open.intents => Event::Intent(intent),
            command = self.agent.commands.recv(), if self.open.commands => Event::Command(command),
            event = mode_work(&mut self.mode) => event,
            () = sleep_until(wake) => Event::Tick,
        }
    }

    /// The next moment the mode (or the crash streak) has something to do on its own.
    fn next_wake(&self) -> Option<Instant> {
        let mode = match &self.mode {
            Mode::HandingOver { until, .. } => Some(*until),
            Mode::Recovering { next_at, .. } => Some(*next_at),
            Mode::ShuttingDown(s) => s.next_wake(Instant::now()),
            _ => None,
        };
        earliest(mode, self.crash_loop.streak_ends_at())
    }

    /// Applies `event`; the end of the loop when the proxy's run is over for good.
    fn handle(&mut self, event: Event) -> Option<End> {
        match event {
            Event::RunEnded(result) => return self.on_run_ended(result),
            // Closed: the proxy is ending; only its run's end is left to see.
            Event::ProxyChanged { open } => self.open.proxy_state = open,
            Event::Intent(None) => self.open.intents = false,
            Event::Intent(Some(intent @ (Intent::Terminate | Intent::Interrupt))) => {
                self.ask_to_stop(StopAsk::Signal(intent));
            }
            Event::Intent(Some(Intent::ReopenLogs)) => self.on_sigusr1(),
            Event::Intent(Some(Intent::Reload)) => self.on_sighup(),
            Event::Command(None) => self.open.commands = false,
            Event::Command(Some(command)) => self.on_command(command),
            Event::Successor(successor) => self.on_successor(successor),
            Event::DrainAnswered(result) => self.on_drain_answered(result),
            Event::HealthChecksAnswered(result) => self.on_health_checks_answered(result),
            Event::Counted(counted) => self.on_counted(counted),
            Event::ListenersRead(read) => {
                if let Mode::ShuttingDown(s) = &mut self.mode {
                    s.listeners_read(read, Instant::now());
                }
            }
            Event::OutboundRead(read) => {
                let exclusions = &self.agent.config.exclusions;
                if let Mode::ShuttingDown(s) = &mut self.mode {
                    s.outbound_read(read, |p| exclusions.counts_port(p), Instant::now());
                }
                self.on_tick();
            }
            Event::AppProbed(held) => {
                if let Mode::ShuttingDown(s) = &mut self.mode {
                    s.probed(held, Instant::now());
                }
                self.on_tick();
            }
            Event::Tick => self.on_tick(),
        }
        self.follow_handover();
        None
    }

    fn on_run_ended(&mut self, result: Result<Ended, ProxyError>) -> Option<End> {
        // Only an end the agent did not ask for, while it ran the proxy.
        let crash = match (&self.mode, &result) {
            (Mode::Running(_), Ok(ended)) => self.crash_loop.on_end(ended, Instant::now()),
            _ => None,
        };
        let Some(crash) = crash else {
            return Some(End {
                result,
                gave_up: None,
            });
        };
        self.report_crash(&crash);
        match (crash.action, &self.mode) {
            (CrashAction::Restart { attempt, backoff }, Mode::Running(on_signal)) => {
                self.mode = Mode::Recovering {
                    attempt,
                    next_at: Instant::now() + backoff,
                    restart_at: SystemTime::now() + backoff,
                    on_signal: *on_signal,
                };
                self.run = stopped_run(&self.abort);
                None
            }
            _ => Some(End {
                result,
                gave_up: Some(ExitPath::CrashLoop { code: crash.code }),
            }),
        }
    }

    /// Applies what a request to stop does in the current mode.
    fn ask_to_stop(&mut self, ask: StopAsk) {
        match on_stop(&self.mode, ask) {
            Transition::Stay(why) => tracing::info!(?ask, "{why}"),
            Transition::StopNow(path) => self.stop(path),
            Transition::Continue => {
                tracing::info!(
                    ?ask,
                    "stopping: the drain request's timeline goes on to the stop"
                );
                if let Mode::ShuttingDown(s) = &mut self.mode {
                    s.continue_to_stop(&self.agent.config);
                }
                self.on_tick();
            }
            Transition::Decide(reason) => {
                tracing::info!(%reason, "stopping: is a successor pod taking over?");
                self.drain_started.get_or_insert_with(Instant::now);
                self.drain_reason.get_or_insert(reason);
                self.mode = Mode::Deciding {
                    reason,
                    successor: self.successor_call(),
                };
            }
        }
    }

    /// Stops Envoy by `path`: in-flight calls are moot (dropping them closes their
    /// connections); a drain request's callers hear that it is done with.
    fn stop(&mut self, path: ExitPath) {
        if matches!(self.mode, Mode::Stopping(_)) {
            return;
        }
        // What a drain's deadline left open, as last read (the operator's next question).
        let still_open = match &self.mode {
            Mode::ShuttingDown(s) => {
                let now = Instant::now();
                step_taken(TimelineStep::Stop, s.offset(now).as_millis() as u64);
                // At zero nothing is open, whatever the last (older) reading said: the count
                // is fresher than the listeners' reading, and the stop says what it saw.
                let zero = matches!(path, ExitPath::ZeroActive(_));
                self.still_open = match zero {
                    true => s.listeners().map(|_| Vec::new()),
                    false => s.listeners().map(<[_]>::to_vec),
                };
                (!zero).then(|| s.still_open()).flatten()
            }
            _ => None,
        };
        self.stop_began = Some(Instant::now());
        let drained = match &self.mode {
            Mode::ShuttingDown(s) => s.progress().drained.as_ref(),
            _ => None,
        }
        .map(DrainPlan::drained_names);
        tracing::info!(
            event = "stopping",
            exit_path = path.name(),
            drained = drained.as_deref(),
            counting = path.counting().map(Counting::name),
            still_open = still_open.as_deref(),
            at_unix_ms = unix_ms(),
            "stopping envoy: {path}{}",
            still_open
                .as_deref()
                .map(|open| format!(" (still open: {open})"))
                .unwrap_or_default()
        );
        if let Mode::ShuttingDown(mut s) = std::mem::replace(&mut self.mode, Mode::Stopping(path)) {
            for reply in s.take_replies() {
                let _ = reply.send(Ok(None));
            }
        }
        self.abort.cancel();
    }

    /// Begins the shutdown drain. Its timeline counts from here: once no successor takes
    /// over (a sidecar knows at once; a node proxy asks, bounded by [`SUCCESSOR_TIMEOUT`]), so
    /// that the drain keeps its whole time after a slow answer.
    fn begin_shutdown(&mut self, reason: DrainReason) {
        let config = &self.agent.config;
        tracing::info!(
            %reason,
            drain_delay = ?config.drain_delay,
            termination_drain_duration = ?config.termination_drain_duration,
            exit_on_zero = config.exit_on_zero.map(Counting::name),
            "shutting down: draining envoy"
        );
        self.mode = Mode::ShuttingDown(Box::new(Shutdown::begin(
            config,
            reason,
            Instant::now(),
            SystemTime::now(),
        )));
    }

    fn on_sigusr1(&mut self) {
        if matches!(self.mode, Mode::Recovering { .. }) {
            tracing::info!("SIGUSR1: no envoy runs (recovering from a crash)");
            return;
        }
        self.spawn_reply(None, |p| async move {
            let n = p.reopen_logs().await;
            match &n {
                Ok(n) => tracing::info!(envoys = n, "SIGUSR1: asked envoy to reopen its logs"),
                Err(e) => tracing::warn!(error = %e, "cannot forward SIGUSR1 to envoy"),
            }
            n.map_err(AgentError::Config)
        });
    }

    fn on_sighup(&mut self) {
        match self.mode {
            Mode::Running(_) => self.spawn_reply(None, |p| async move {
                let r = p.hot_restart("SIGHUP".to_owned()).await;
                if let Err(RestartError::Unsupported) = &r {
                    tracing::warn!("SIGHUP ignored: hot restart is off");
                }
                r.map_err(AgentError::Restart)
            }),
            Mode::Recovering { .. } => {
                tracing::warn!("SIGHUP ignored: no envoy runs (recovering from a crash)");
            }
            _ => tracing::warn!("SIGHUP ignored: the agent is draining or stopping"),
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Quit { via, reply } => {
                self.ask_to_stop(StopAsk::Quit(via));
                // Once the stop has begun.
                let _ = reply.send(Ok(()));
            }
            Command::Stop { reply } => {
                self.ask_to_stop(StopAsk::Stop);
                let _ = reply.send(Ok(()));
            }
            Command::DisableDraining { reply } => {
                if let Mode::Running(on_signal) | Mode::Recovering { on_signal, .. } =
                    &mut self.mode
                {
                    tracing::info!("draining disabled: the next SIGTERM stops envoy at once");
                    *on_signal = OnSignal::StopAtOnce;
                }
                let _ = reply.send(Ok(()));
            }
            Command::Drain {
                options,
                via,
                reply,
            } => self.on_drain_request(options, via, reply),
            Command::HotRestart { reason, reply } => {
                // After a drain request the proxy refuses on its own (or has no hot restart
                // at all); on the way out, the agent refuses.
                let drained = matches!(&self.mode, Mode::ShuttingDown(s) if s.ending() == Ending::KeepServing);
                if matches!(self.mode, Mode::Running(_)) || drained {
                    self.spawn_reply(Some(reply), |p| async move {
                        p.hot_restart(reason).await.map_err(AgentError::Restart)
                    });
                } else {
                    let _ = reply.send(Err(AgentError::Restart(refusal(&self.mode))));
                }
            }
            Command::UpdateConfig {
                config,
                reason,
                reply,
            } => {
                if matches!(self.mode, Mode::Running(_)) {
                    self.spawn_reply(Some(reply), |p| async move {
                        p.update_config(config, reason)
                            .await
                            .map_err(AgentError::Config)
                    });
                } else {
                    let _ = reply.send(Err(AgentError::Restart(refusal(&self.mode))));
                }
            }
            Command::ReopenLogs { reply } => {
                if matches!(self.mode, Mode::Recovering { .. }) {
                    let _ = reply.send(Ok(0));
                } else {
                    self.spawn_reply(Some(reply), |p| async move {
                        p.reopen_logs().await.map_err(AgentError::Config)
                    });
                }
            }
        }
    }

    fn on_drain_request(
        &mut self,
        options: DrainOptions,
        via: Via,
        reply: Reply<Option<DrainPlan>>,
    ) {
        match &mut self.mode {
            Mode::Running(_) => {
                let reason = DrainReason::Request(via);
                let config = &self.agent.config;
                tracing::info!(
                    %reason,
                    skip_exit = options.skip_exit,
                    drain_delay = ?config.drain_delay,
                    "draining on request, on the shutdown's timeline: envoy keeps running, a signal continues to the stop"
                );
                self.drain_started.get_or_insert_with(Instant::now);
                self.drain_reason.get_or_insert(reason);
                self.mode = Mode::ShuttingDown(Box::new(Shutdown::begin_request(
                    config,
                    reason,
                    options,
                    reply,
                    Instant::now(),
                    SystemTime::now(),
                )));
                self.on_tick();
            }
            // Asked again: answered with the drain's answer.
            Mode::ShuttingDown(s) if s.ending() == Ending::KeepServing => s.add_reply(reply),
            Mode::Recovering { .. } => {
                let _ = reply.send(Err(AgentError::DrainFailed(RECOVERING.to_owned())));
            }
            // Already draining, handing over or stopping: nothing more to ask.
            _ => {
                let _ = reply.send(Ok(None));
            }
        }
    }

    fn on_successor(&mut self, successor: Option<String>) {
        let Mode::Deciding { reason, .. } = self.mode else {
            return;
        };
        match successor {
            Some(successor) => {
                let bound = self.agent.config.handover_timeout;
                tracing::info!(event = "handing_over", %successor, ?bound,
                    "a successor pod takes over: waiting for its envoy to terminate ours");
                self.mode = Mode::HandingOver {
                    successor,
                    until: Instant::now() + bound,
                    reason,
                };
            }
            None => self.begin_shutdown(reason),
        }
    }

    fn on_health_checks_answered(&mut self, result: Result<(), ProxyError>) {
        match &result {
            Ok(()) => tracing::info!(
                event = "healthcheck_fail_accepted",
                "envoy fails its health checks"
            ),
            Err(e) => tracing::warn!(
                event = "healthcheck_fail_request_failed",
                error = %e,
                "cannot fail envoy's health checks: asking again"
            ),
        }
        if let Mode::ShuttingDown(s) = &mut self.mode {
            s.health_checks_answered(&result, Instant::now());
        }
    }

    fn on_drain_answered(&mut self, result: Result<DrainPlan, ProxyError>) {
        match &result {
            Ok(plan) => tracing::info!(
                event = "drain_accepted",
                drained = %plan.drained_names(),
                scope = plan.asked.name(),
                inbound_only = plan.inbound_only,
                note = plan_note(plan),
                "envoy is draining its listeners"
            ),
            Err(e) => {
                tracing::warn!(event = "drain_request_failed", error = %e, "drain request failed")
            }
        }
        if let Mode::ShuttingDown(s) = &mut self.mode {
            s.drain_answered(&result, Instant::now());
        }
    }

    fn on_counted(&mut self, counted: Counted) {
        let parent_draining = self.proxy_state.borrow().parent_draining();
        let Mode::ShuttingDown(s) = &mut self.mode else {
            return;
        };
        tracing::trace!(
            event = "counted",
            pace = ?counted.pace,
            took_us = counted.took.as_micros() as u64,
            count = counted.count.as_ref().ok(),
            "a count came back"
        );
        if let Some(path) = s.counted(counted, parent_draining, Instant::now()) {
            self.stop(path);
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        match &self.mode {
            Mode::Recovering {
                attempt,
                next_at,
                on_signal,
                ..
            } if *next_at <= now => {
                tracing::info!(
                    event = "envoy_restarting",
                    attempt = *attempt,
                    "recovering from a crash: starting envoy again"
                );
                self.mode = Mode::Running(*on_signal);
                self.run = proxy_run(&self.agent.proxy, &self.abort);
            }
            Mode::HandingOver {
                until, successor, ..
            } if *until <= now => {
                tracing::error!(%successor, bound = ?self.agent.config.handover_timeout, "the successor did not terminate our envoy in time; stopping it");
                self.stop(ExitPath::HandoverTimedOut);
            }
            Mode::ShuttingDown(_) => self.drive_shutdown(now),
            _ => {}
        }
    }

    /// Does what the shutdown's clock says is due at `now`.
    fn drive_shutdown(&mut self, now: Instant) {
        loop {
            let Mode::ShuttingDown(s) = &self.mode else {
                return;
            };
            let offset_ms = s.offset(now).as_millis() as u64;
            match s.poll(now) {
                Step::Wait(_) => return,
                Step::NotReady => {
                    step_taken(TimelineStep::NotReady, offset_ms);
                    if let Mode::ShuttingDown(s) = &mut self.mode {
                        s.not_ready_said();
                    }
                }
                Step::FailHealthChecks => self.fail_health_checks(offset_ms),
                Step::SendDrain => {
                    let first = !s.drain_asked();
                    let options = s.drain_options(now);
                    let call = drain_call(&self.agent.proxy, options);
                    if first {
                        step_taken(TimelineStep::Drain, offset_ms);
                    }
                    if let Mode::ShuttingDown(s) = &mut self.mode {
                        s.drain_sent(now, options.hold_notice, call);
                    }
                }
                Step::Count(tally) => {
                    let call = self.count_call(tally);
                    if let Mode::ShuttingDown(s) = &mut self.mode {
                        s.count_sent(now, tally, call);
                    }
                }
                Step::ReadListeners => {
                    let call = self.listeners_call();
                    if let Mode::ShuttingDown(s) = &mut self.mode {
                        s.listeners_sent(now, call);
                    }
                }
                Step::TellNotice => self.tell_notice(),
                Step::ReadOutbound => {
                    let call = self.outbound_call();
                    if let Mode::ShuttingDown(s) = &mut self.mode {
                        s.outbound_sent(call);
                    }
                }
                Step::ProbeApp => {
                    let Some((ports, known)) = s.probe() else {
                        return;
                    };
                    let call = self.probe_call(ports, known);
                    if let Mode::ShuttingDown(s) = &mut self.mode {
                        s.probe_sent(now, call);
                    }
                }
                Step::Stop(path) => {
                    if path == ExitPath::DrainFailed {
                        let error = s.drain_failure(now).unwrap_or_default();
                        tracing::error!(event = "drain_failed", %error, "envoy never accepted the drain request: stopping it without a drain");
                    }
                    self.stop(path);
                    return;
                }
            }
        }
    }

    /// Tells Envoy to fail its health checks (the timeline's step, said the first time).
    fn fail_health_checks(&mut self, offset_ms: u64) {
        let proxy = self.agent.proxy.clone();
        let call: Call<Result<(), ProxyError>> =
            Box::pin(async move { proxy.fail_health_checks().await });
        let first = match &mut self.mode {
            Mode::ShuttingDown(s) => s.health_checks_sent(call),
            _ => false,
        };
        if first {
            step_taken(TimelineStep::FailHealthChecks, offset_ms);
        }
    }

    /// The app rule let go: the drain notice held back for it is told now.
    fn tell_notice(&mut self) {
        tracing::info!(
            event = "drain_notice_released",
            "the app let go of envoy's outbound listeners: telling the drain notice"
        );
        self.agent.proxy.tell_drain_notice();
        if let Mode::ShuttingDown(s) = &mut self.mode {
            s.notice_told();
        }
    }

    /// One reading of Envoy's listeners, for the app rule (which are outbound).
    fn outbound_call(&self) -> Call<Result<Vec<envoy_agent_proxy::listeners::Listener>, String>> {
        let admin = self.agent.proxy.admin_address().map(AdminClient::new);
        Box::pin(async move {
            match admin {
                Some(admin) => envoy_agent_proxy::listeners::read(&admin)
                    .await
                    .map_err(|e| e.to_string()),
                None => Err("envoy's admin address is not known".to_owned()),
            }
        })
    }

    /// The kernel's question of the app rule: does Envoy hold a connection on these ports.
    fn probe_call(
        &self,
        ports: std::collections::BTreeSet<u16>,
        known: envoy_agent_drain::Known,
    ) -> Call<Result<bool, DrainError>> {
        let pid = self.proxy_state.borrow().epochs.first().map(|e| e.pid);
        Box::pin(async move {
            match pid {
                Some(pid) => envoy_agent_drain::any_held(pid, ports, known).await,
                None => Err(DrainError::NoProcess),
            }
        })
    }

    /// A handover ends when our Envoy is gone, or falls back to our own drain when the
    /// successor went away without taking over.
    fn follow_handover(&mut self) {
        let Mode::HandingOver {
            successor, reason, ..
        } = &self.mode
        else {
            return;
        };
        let reason = *reason;
        let (gone, abandoned) = {
            let state = self.proxy_state.borrow();
            (
                state.phase == ProxyPhase::HandedOver && state.epochs.is_empty(),
                state.phase == ProxyPhase::Serving
                    && state
                        .family
                        .as_ref()
                        .is_none_or(|f| f.successor_starting.is_none()),
            )
        };
        if gone {
            tracing::info!(%successor, "our envoy was terminated by the successor's");
            self.stop(ExitPath::HandedOver);
        } else if abandoned {
            tracing::warn!(%successor, "the successor is gone without taking over: draining our own envoy");
            self.begin_shutdown(reason);
        }
    }

    /// Publishes the agent's state, derived from its mode and the proxy's state, when it
    /// changed.
    fn publish(&mut self) {
        let proxy = self.proxy_state.borrow_and_update();
        self.crash_loop.observe(proxy.serving(), Instant::now());
        let now = SystemTime::now();
        let state = match &self.mode {
            Mode::Recovering {
                attempt,
                restart_at,
                ..
            } => AgentState::Recovering {
                since: now,
                attempt: *attempt,
                restart_at: *restart_at,
            },
            Mode::Stopping(path) => AgentState::Exiting {
                since: now,
                path: *path,
            },
            Mode::ShuttingDown(s) => AgentState::Draining {
                since: now,
                reason: s.reason(),
                phase: s.phase(Instant::now()),
                ready: s.ready(Instant::now()),
            },
            // The timeline begins once decided: ready meanwhile if its first step is not.
            Mode::Deciding { reason, .. } => AgentState::Draining {
                since: now,
                reason: *reason,
                phase: DrainPhase::Deciding,
                ready: !self.agent.config.not_ready_at.is_zero(),
            },
            Mode::HandingOver { successor, .. } => AgentState::HandingOver {
                since: now,
                successor: successor.clone(),
            },
            Mode::Running(_) => match proxy.phase {
                ProxyPhase::Serving => AgentState::Live { since: now },
                ProxyPhase::HandedOver => AgentState::HandedOver {
                    since: now,
                    successor: proxy
                        .family
                        .as_ref()
                        .and_then(|f| f.handed_over_to.clone())
                        .unwrap_or_default(),
                },
                _ => AgentState::Starting { since: now },
            },
        };
        let drain = match &self.mode {
            Mode::ShuttingDown(s) => Some(s.progress().clone()),
            _ => None,
        };
        let crashes = self.crash_loop.crashes();
        self.agent.status.send_if_modified(|s| {
            let mut changed = false;
            if !s.agent.same_kind(&state) {
                tracing::info!(event = "agent_state", state = %state, "agent state");
                s.agent = state;
                changed = true;
            }
            if s.proxy != *proxy {
                s.proxy = proxy.clone();
                changed = true;
            }
            if s.drain != drain {
                s.drain = drain;
                changed = true;
            }
            if s.crashes != *crashes {
                s.crashes = crashes.clone();
                changed = true;
            }
            changed
        });
    }

    /// The exit, once the proxy's run is over and every Envoy reaped.
    fn finish(self, end: End) -> AgentExit {
        let agent = &self.agent;
        agent.proxy.cleanup();
        let stopping = match self.mode {
            Mode::Stopping(path) => Some(path),
            _ => None,
        };
        let (path, ended, error) = match end.result {
            Err(e) => {
                tracing::error!(error = %e, "envoy could not be run");
                (ExitPath::ProxyFailed, None, Some(e))
            }
            Ok(ended) => {
                let path = match (&ended, stopping.or(end.gave_up)) {
                    (_, Some(path @ ExitPath::CrashLoop { .. })) => path,
                    (Ended::Stopped { .. }, Some(path)) => path,
                    (Ended::Stopped { .. }, None) => ExitPath::ProxyStopped,
                    (Ended::Exited(exit) | Ended::Lost { exit, .. }, _) if exit.oom.is_some() => {
                        ExitPath::OomKilled {
                            limit: exit.oom.and_then(|o| o.limit),
                        }
                    }
                    (Ended::Exited(exit), _) => ExitPath::ProxyExited { code: exit.code() },
                    (Ended::Lost { .. }, _) => ExitPath::ProxyLost { code: ended.code() },
                    (Ended::StartFailed { .. }, _) => ExitPath::StartFailed { code: ended.code() },
                    (Ended::Wedged { reason, .. }, _) => ExitPath::Wedged { reason: *reason },
                };
                log_ended(&ended);
                (path, Some(ended), None)
            }
        };
        let final_state = AgentState::Exiting {
            since: SystemTime::now(),
            path,
        };
        tracing::info!(event = "agent_state", state = %final_state, "agent state");
        agent.status.send_modify(|s| {
            s.agent = final_state;
            s.proxy = agent.proxy.state().borrow().clone();
            s.drain = None;
            s.crashes = self.crash_loop.crashes().clone();
        });
        agent
            .metrics
            .exit(path.name(), self.drain_started.map(|t| t.elapsed()));
        // Only a stop the agent was asked for (or decided) has a shutdown to tell of.
        let took = stopping
            .and(self.drain_started.or(self.stop_began))
            .map(|since| since.elapsed());
        AgentExit {
            path,
            reason: self.drain_reason,
            took,
            still_open: self.still_open,
            ended,
            error,
        }
    }

    /// Logs and counts a crash and what the agent does about it.
    fn report_crash(&self, crash: &Crash) {
        let crashes: &Crashes = self.crash_loop.crashes();
        let (epoch, pid) = crash.process.unzip();
        let limit = crashes.recovery.map_or(0, |r| r.limit);
        let what = match crash.action {
            CrashAction::Restart { attempt, backoff } => format!(
                "starting it again in {backoff:?} (restart {attempt} of at most {limit} in a row)"
            ),
            CrashAction::GiveUp => {
                format!("{limit} restarts in a row did not help: giving up")
            }
        };
        let (attempt, backoff_ms) = match crash.action {
            CrashAction::Restart { attempt, backoff } => {
                (Some(attempt), Some(backoff.as_millis() as u64))
            }
            CrashAction::GiveUp => (None, None),
        };
        tracing::error!(
            event = "envoy_crashed",
            kind = crash.kind.as_str(),
            code = crash.code,
            signal = crash.signal,
            epoch,
            pid,
            ran_for_ms = crash.ran_for.map(|d| d.as_millis() as u64),
            action = crash.action.as_str(),
            attempt,
            backoff_ms,
            consecutive = crashes.consecutive,
            limit,
            "envoy crashed (exit {}): {what}; the end of its stderr:\n{}",
            crash.code,
            crash.stderr_tail
        );
        self.agent
            .metrics
            .crash(crash.kind.as_str(), crash.action.as_str());
    }

    fn successor_call(&self) -> Call<Option<String>> {
        let proxy = self.agent.proxy.clone();
        Box::pin(async move {
            tokio::time::timeout(SUCCESSOR_TIMEOUT, proxy.successor())
                .await
                .unwrap_or_else(|_| {
                    tracing::warn!(bound = ?SUCCESSOR_TIMEOUT, "no answer whether a successor takes over: draining");
                    None
                })
        })
    }

    /// Whether exit-on-zero counts from the kernel's socket table (connections, excluded by
    /// port only) rather than Envoy's stats.
    fn counts_from_kernel(&self) -> bool {
        let config = &self.agent.config;
        self.agent.counter.is_none()
            && config.exit_on_zero.is_some_and(|c| {
                envoy_agent_drain::count::counts_from_kernel(c, &config.exclusions)
            })
    }

    /// One exit-on-zero count, with what it took and how it paces the next: Envoy's main
    /// thread for a count from its stats (at most 1/20 of it), the agent's own for one from
    /// the kernel (quick ones 1/100 of a core, whole ones 1/400; a kernel count of zero is
    /// confirmed from the stats, and paced as one).
    fn count_call(&self, tally: Tally) -> Call<Counted> {
        let count = self.count_future(tally);
        Box::pin(async move {
            let asked = Instant::now();
            let (count, pace) = count.await;
            Counted {
                count,
                took: asked.elapsed(),
                pace,
            }
        })
    }

    /// One reading of what each counted listener holds, from Envoy's stats.
    fn listeners_call(&self) -> Call<ListenersRead> {
        let config: &AgentConfig = &self.agent.config;
        let admin = self
            .agent
            .proxy
            .admin_address()
            .map(|a| AdminClient::new(a).with_timeout(config.stats_timeout));
        let exclusions = config.exclusions.clone();
        Box::pin(async move {
            let asked = Instant::now();
            let listeners = match admin {
                Some(admin) => envoy_agent_drain::listener_activity_of(&admin, &exclusions).await,
                None => Err(DrainError::AdminUnknown),
            };
            ListenersRead {
                listeners,
                took: asked.elapsed(),
            }
        })
    }

    /// What the drain reached, once Envoy accepted it (none before, or when the listeners
    /// could not be read): exit-on-zero counts those listeners only.
    fn drained(&self) -> Option<DrainPlan> {
        match &self.mode {
            Mode::ShuttingDown(s) => s
                .progress()
                .drained
                .clone()
                .filter(|p| !p.listeners.is_empty()),
            _ => None,
        }
    }

    /// A count as `tally` asks where the kernel counts (Envoy's stats count whole); answers
    /// the count and how it paces the next (the policy: `envoy_agent_drain::count`).
    fn count_future(&self, tally: Tally) -> Call<(Result<u64, DrainError>, Pace)> {
        if let Some(counter) = &self.agent.counter {
            let count = counter();
            return Box::pin(async move { (count.await, Pace::STATS) });
        }
        let config: &AgentConfig = &self.agent.config;
        let count = Count {
            admin: self
                .agent
                .proxy
                .admin_address()
                .map(|a| AdminClient::new(a).with_timeout(config.stats_timeout)),
            exclusions: config.exclusions.clone(),
            drained: self.drained(),
            pids: self
                .agent
                .proxy
                .state()
                .borrow()
                .epochs
                .iter()
                .map(|e| e.pid)
                .collect(),
            counting: config.exit_on_zero.unwrap_or(Counting::Connections),
            tally,
            known: match &self.mode {
                Mode::ShuttingDown(s) => Some(s.known()),
                _ => None,
            },
            kernel: self.counts_from_kernel(),
        };
        Box::pin(count.take())
    }

    /// Runs a proxy call beside the loop and answers `reply` with its result.
    fn spawn_reply<T, F, Fut>(&self, reply: Option<Reply<T>>, call: F)
    where
        T: Send + 'static,
        F: FnOnce(Arc<P>) -> Fut,
        Fut: Future<Output = Result<T, AgentError>> + Send + 'static,
    {
        let future = call(self.agent.proxy.clone());
        tokio::spawn(
            async move {
                let result = future.await;
                if let Some(reply) = reply {
                    let _ = reply.send(result);
                }
            }
            .in_current_span(),
        );
    }
}

/// The work `mode` has out: its next answer; never when it has none.
async fn mode_work(mode: &mut Mode) -> Event {
    match mode {
        Mode::Deciding { successor, .. } => Event::Successor(successor.await),
        Mode::ShuttingDown(s) => match s.answer().await {
            Answer::Drain(result) => Event::DrainAnswered(result),
            Answer::HealthChecks(result) => Event::HealthChecksAnswered(result),
            Answer::Count(counted) => Event::Counted(counted),
            Answer::Listeners(read) => Event::ListenersRead(read),
            Answer::Outbound(read) => Event::OutboundRead(read),
            Answer::App(held) => Event::AppProbed(held),
        },
        _ => std::future::pending().await,
    }
}

fn proxy_run<P: Proxy>(
    proxy: &Arc<P>,
    abort: &CancellationToken,
) -> Call<Result<Ended, ProxyError>> {
    let (proxy, abort) = (proxy.clone(), abort.clone());
    Box::pin(async move { proxy.run(abort).await })
}

/// While nothing runs (a crash back-off): ends as a stopped run once the agent stops.
fn stopped_run(abort: &CancellationToken) -> Call<Result<Ended, ProxyError>> {
    let abort = abort.clone();
    Box::pin(async move {
        abort.cancelled().await;
        Ok(Ended::Stopped { last: None })
    })
}

/// Logs a step of the shutdown's timeline as it is taken, `offset_ms` after its start.
fn step_taken(step: TimelineStep, offset_ms: u64) {
    let what = match step {
        TimelineStep::NotReady => "readiness off",
        TimelineStep::FailHealthChecks => "failing envoy's health checks",
        TimelineStep::Drain => "draining envoy",
        TimelineStep::Stop => "stopping envoy",
    };
    tracing::info!(
        event = "shutdown_step",
        step = step.name(),
        offset_ms,
        "shutdown: {what}"
    );
}

/// A plan's note, for logs: none when it drains as asked.
fn plan_note(plan: &DrainPlan) -> Option<String> {
    match &plan.note {
        PlanNote::AsAsked | PlanNote::NotServing => None,
        PlanNote::NoInbound => {
            Some("no listener is marked INBOUND: every listener was drained".to_owned())
        }
        PlanNote::NothingInbound => {
            Some("no listener is marked INBOUND: envoy drained none".to_owned())
        }
        PlanNote::Unknown(why) => Some(format!("listeners unknown ({why})")),
    }
}

fn drain_call<P: Proxy>(
    proxy: &Arc<P>,
    options: DrainOptions,
) -> Call<Result<DrainPlan, ProxyError>> {
    let proxy = proxy.clone();
    Box::pin(async move { proxy.drain(options).await })
}

/// Why a hot restart or config update is refused in `mode`.
fn refusal(mode: &Mode) -> RestartError {
    RestartError::Refused(match mode {
        Mode::Recovering { .. } => RECOVERING.to_owned(),
        _ => "the agent is draining or stopping".to_owned(),
    })
}

fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn log_ended(ended: &Ended) {
    use std::os::unix::process::ExitStatusExt;
    match ended {
        Ended::Stopped { last: Some(exit) } => {
            tracing::info!(pid = exit.pid, code = exit.code(), ran_for = ?exit.ran_for, "envoy stopped");
        }
        Ended::Stopped { last: None } => tracing::info!("every envoy stopped"),
        Ended::Exited(exit) if exit.code() == 0 => {
            tracing::info!(pid = exit.pid, ran_for = ?exit.ran_for, "envoy exited");
        }
        Ended::Exited(exit) | Ended::Lost { exit, .. } => {
            let code = exit.code();
            let hint = match (exit.oom, exit.status.signal()) {
                (Some(oom), _) => format!(" ({oom})"),
                // Only a container that counts its OOM kills can tell them from a `kill -9`.
                (None, Some(9)) if envoy_agent_proxy::cgroup::container().oom_kills().is_some() => {
                    " (SIGKILL, not by the OOM killer)".to_owned()
                }
                (None, Some(9)) => {
                    " (SIGKILL: no memory cgroup counts OOM kills here to tell one)".to_owned()
                }
                _ => String::new(),
            };
            tracing::error!(
                pid = exit.pid,
                code,
                ran_for = ?exit.ran_for,
                "envoy exited with code {code}{hint}; the end of its stderr:\n{}",
                exit.stderr_tail.trim_end()
            );
        }
        Ended::StartFailed { code, message } => {
            tracing::error!(code, error = %message, "envoy failed to start");
        }
        Ended::Wedged { reason, message } => {
            tracing::error!(%reason, error = %message, "wedged");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deciding() -> Mode {
        Mode::Deciding {
            reason: DrainReason::Signal(Intent::Terminate),
            successor: Box::pin(std::future::pending()),
        }
    }

    fn modes() -> Vec<(&'static str, Mode)> {
        let now = Instant::now();
        vec![
            ("running", Mode::Running(OnSignal::Drain)),
            ("running, no drain", Mode::Running(OnSignal::StopAtOnce)),
            (
                "drained",
                Mode::ShuttingDown(Box::new(Shutdown::begin_request(
                    &AgentConfig::default(),
                    DrainReason::Request(Via::Grpc),
                    DrainOptions::default(),
                    tokio::sync::oneshot::channel().0,
                    now,
                    SystemTime::now(),
                ))),
            ),
            ("deciding", deciding()),
            (
                "shutting down",
                Mode::ShuttingDown(Box::new(Shutdown::begin(
                    &AgentConfig::default(),
                    DrainReason::Signal(Intent::Terminate),
                    now,
                    SystemTime::now(),
                ))),
            ),
            (
                "handing over",
                Mode::HandingOver {
                    successor: "pod-b".to_owned(),
                    until: now,
                    reason: DrainReason::Stop,
                },
            ),
            ("stopping", Mode::Stopping(ExitPath::SecondSignal)),
            (
                "recovering",
                Mode::Recovering {
                    attempt: 1,
                    next_at: now,
                    restart_at: SystemTime::now(),
                    on_signal: OnSignal::Drain,
                },
            ),
        ]
    }

    /// The whole table: each request to stop in each mode.
    #[tokio::test(start_paused = true)]
    async fn each_request_to_stop_in_each_mode() {
        use ExitPath::*;
        use Transition::*;
        let sigterm = StopAsk::Signal(Intent::Terminate);
        let sigint = StopAsk::Signal(Intent::Interrupt);
        let quit = StopAsk::Quit(Via::Http);
        let expected: Vec<(&str, [Transition; 4])> = vec![
            (
                "running",
                [
                    Decide(DrainReason::Signal(Intent::Terminate)),
                    Decide(DrainReason::Signal(Intent::Interrupt)),
                    Decide(DrainReason::Stop),
                    StopNow(QuitQuitQuit(Via::Http)),
                ],
            ),
            (
                "running, no drain",
                [
                    StopNow(SignalAfterDrain),
                    StopNow(SignalAfterDrain),
                    StopNow(SignalAfterDrain),
                    StopNow(QuitQuitQuit(Via::Http)),
                ],
            ),
            (
                "drained",
                [
                    Continue,
                    Continue,
                    Continue,
                    StopNow(QuitQuitQuit(Via::Http)),
                ],
            ),
            (
                "deciding",
                [
                    StopNow(SecondSignal),
                    StopNow(SecondSignal),
                    Stay("already on the way out"),
                    StopNow(QuitQuitQuit(Via::Http)),
                ],
            ),
            (
                "shutting down",
                [
                    StopNow(SecondSignal),
                    StopNow(SecondSignal),
                    Stay("already on the way out"),
                    StopNow(QuitQuitQuit(Via::Http)),
                ],
            ),
            (
                "handing over",
                [
                    StopNow(SecondSignal),
                    StopNow(SecondSignal),
                    Stay("already on the way out"),
                    StopNow(QuitQuitQuit(Via::Http)),
                ],
            ),
            ("stopping", [Stay("already stopping"); 4]),
            (
                "recovering",
                [
                    StopNow(StoppedWhileRecovering),
                    StopNow(StoppedWhileRecovering),
                    StopNow(StoppedWhileRecovering),
                    StopNow(QuitQuitQuit(Via::Http)),
                ],
            ),
        ];
        let modes = modes();
        assert_eq!(modes.len(), expected.len());
        for ((name, mode), (expected_name, transitions)) in modes.iter().zip(expected) {
            assert_eq!(*name, expected_name);
            for (ask, want) in [sigterm, sigint, StopAsk::Stop, quit]
                .into_iter()
                .zip(transitions)
            {
                assert_eq!(on_stop(mode, ask), want, "{ask:?} while {name}");
            }
        }
    }
}

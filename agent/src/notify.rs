//! systemd's readiness protocol (`Type=notify`): the agent tells its service manager when
//! Envoy serves, when a reload (hot restart) begins and ends, how it went, and that it is
//! stopping; and pets the watchdog when `WatchdogSec=` is set.
//!
//! Driven by the agent's [`Status`] alone (a `watch` channel), so it sees exactly what gRPC and
//! the status server see:
//!
//! | the agent | systemd gets |
//! |---|---|
//! | the newest Envoy LIVE, the first time | `READY=1`, `STATUS=serving: epoch N (pid P)` |
//! | a hot restart begins (pre-flight) | `RELOADING=1`, `MONOTONIC_USEC=…`, `STATUS=hot restart to epoch N: …` |
//! | it ends | `READY=1`, and `STATUS=serving: epoch N` or `STATUS=hot restart rejected (…), epoch M keeps serving` |
//! | draining, handing over, exiting | `STOPPING=1`, `STATUS=…` |
//! | any other change of what it does | `STATUS=…` |
//!
//! Without `NOTIFY_SOCKET` in the environment nothing is sent and no task runs. The unit that
//! uses it, and what an operator sees of it (`systemctl status`, `Type=notify-reload`):
//! `docs/deploy.md#systemd`.

use std::time::Duration;

use envoy_agent_proxy::{HandoffStage, Outcome};
use sd_notify::NotifyState;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::agent::{AgentState, Status};

/// Whether a service manager listens (`NOTIFY_SOCKET` is set).
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some_and(|s| !s.is_empty())
}

fn send(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!(error = %e, "cannot notify the service manager");
    }
}

/// What was last told.
#[derive(Debug, Default)]
struct Told {
    ready: bool,
    reloading: bool,
    stopping: bool,
    status: String,
}

/// Tells the service manager about `status` as it changes, until `cancel` fires.
pub async fn run(mut status: watch::Receiver<Status>, cancel: CancellationToken) {
    let mut usec = 0;
    let watchdog = sd_notify::watchdog_enabled(false, &mut usec)
        .then(|| Duration::from_micros(usec / 2).max(Duration::from_millis(100)));
    let mut told = Told::default();
    loop {
        let now = status.borrow_and_update().clone();
        tell(&now, &mut told);
        let pet = async {
            match watchdog {
                Some(period) => tokio::time::sleep(period).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = status.changed() => if changed.is_err() { return },
            () = pet => send(&[NotifyState::Watchdog]),
        }
    }
}

fn tell(s: &Status, told: &mut Told) {
    if matches!(
        s.agent,
        AgentState::Draining { .. }
            | AgentState::HandingOver { .. }
            | AgentState::HandedOver { .. }
            | AgentState::Exiting { .. }
    ) {
        tell_stopping(&s.agent, told);
        return;
    }
    if let AgentState::Recovering { attempt, .. } = &s.agent {
        // Not STOPPING: the agent stays up and starts Envoy again after the back-off.
        let line = format!("recovering from a crash (restart {attempt} after a back-off)");
        tell_status(line, told);
        return;
    }
    if !told.ready {
        tell_starting(s, told);
        return;
    }
    tell_reloads(s, told);
}

/// STATUS, when it says something new.
fn tell_status(line: String, told: &mut Told) {
    if told.status != line {
        send(&[NotifyState::Status(&line)]);
        told.status = line;
    }
}

/// STOPPING once, then each change of what the stopping agent does.
fn tell_stopping(agent: &AgentState, told: &mut Told) {
    let line = agent.to_string();
    if !told.stopping {
        told.stopping = true;
        send(&[NotifyState::Stopping, NotifyState::Status(&line)]);
        told.status = line;
    } else {
        tell_status(line, told);
    }
}

/// Until the first READY: what the start waits for, then READY.
fn tell_starting(s: &Status, told: &mut Told) {
    if s.ready() {
        told.ready = true;
        let line = serving(s);
        send(&[NotifyState::Ready, NotifyState::Status(&line)]);
        told.status = line;
    } else {
        // Serving without its config yet says what it waits for.
        let line = match s.proxy.ready() {
            Err(why) if s.agent.serving() => format!("starting: {why}"),
            _ => "starting".to_owned(),
        };
        tell_status(line, told);
    }
}

/// Once serving: RELOADING when a hot restart begins, READY when it ends (saying how it
/// went), and the serving epoch as it changes.
fn tell_reloads(s: &Status, told: &mut Told) {
    let family = s.proxy.family.as_ref();
    let restarting = family
        .and_then(|f| f.handoff.as_ref())
        .filter(|h| h.stage != HandoffStage::Queued);
    match (restarting, told.reloading) {
        (Some(h), false) => {
            told.reloading = true;
            let line = format!("hot restart to epoch {}: {}", h.epoch, h.reason);
            let mut states = vec![NotifyState::Reloading];
            if let Ok(now) = NotifyState::monotonic_usec_now() {
                states.push(now);
            }
            states.push(NotifyState::Status(&line));
            send(&states);
            told.status = line;
        }
        (None, true) => {
            told.reloading = false;
            let line = match family.and_then(|f| f.last_handoff.as_ref()) {
                Some(h) if h.outcome != Outcome::Live => format!(
                    "hot restart {} ({}); {} keeps serving",
                    h.outcome,
                    h.message,
                    serving(s)
                ),
                _ => serving(s),
            };
            send(&[NotifyState::Ready, NotifyState::Status(&line)]);
            told.status = line;
        }
        _ => {
            let line = if told.reloading {
                told.status.clone()
            } else {
                serving(s)
            };
            tell_status(line, told);
        }
    }
}

/// The serving epoch and its pid, for STATUS.
fn serving(s: &Status) -> String {
    match s.proxy.newest_live {
        Some(epoch) => {
            let pid = s
                .proxy
                .epochs
                .iter()
                .find(|e| e.epoch == epoch)
                .map_or(0, |e| e.pid);
            format!("serving: epoch {epoch} (pid {pid})")
        }
        None => "serving".to_owned(),
    }
}

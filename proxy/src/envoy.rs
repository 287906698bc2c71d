//! [`Envoy`]: the [`Proxy`] that runs one real Envoy process (hot restart off).
//!
//! `run` spawns Envoy at epoch 0 and publishes its state: `Starting` until its admin API says
//! LIVE (polled every 50 ms while it starts), `Serving` after, `Exited` once reaped. Once LIVE,
//! the [`crate::watchdog`] asks it `/ready` about once a second: silent for a few seconds, it is
//! published as such (readiness off); silent past the unresponsive deadline, it is killed and
//! `run` ends [`Ended::Wedged`]. Everything else (drain, config update, log reopening) is a call
//! beside `run`.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::admin::Address;
use crate::admin::{AdminClient, KeptConnection, Readiness};
use crate::config::{AdminAddress, ProxyConfig};
use crate::process::{EnvoyProcess, signal_pid, wait_admin_file};
use crate::state::{AdminHealth, EpochInfo, EpochState, ProxyPhase, ProxyState, WedgeReason};
use crate::{ConfigApplied, DrainOptions, DrainPlan, Ended, Exit, Proxy, ProxyError, RestartError};

/// How often a starting Envoy's admin API is asked whether it is LIVE.
const LIVE_POLL: Duration = Duration::from_millis(50);
/// Bound on one of those calls.
const LIVE_CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a LIVE Envoy's control plane is read while readiness waits for its config.
pub(crate) const CONFIG_POLL: Duration = Duration::from_millis(200);
/// ... and after (the status's counters and connection state): each reading makes Envoy visit
/// every stat, so rarely.
pub(crate) const CONFIG_POLL_STEADY: Duration = Duration::from_secs(10);

/// The real Envoy, one process. Cheap to share behind an `Arc`: `run` and the other calls may
/// come from different tasks at once (that is how a SIGTERM drains a running Envoy).
#[derive(Debug)]
pub struct Envoy {
    config: ProxyConfig,
    admin: watch::Sender<Option<Address>>,
    pid: watch::Sender<Option<u32>>,
    state: watch::Sender<ProxyState>,
    /// One config update at a time.
    updates: tokio::sync::Mutex<()>,
}

// === impl Envoy ===

impl Envoy {
    /// An Envoy that will run with `config`. Nothing starts until [`Proxy::run`].
    pub fn new(config: ProxyConfig) -> Self {
        let admin = config.admin.known();
        Envoy {
            config,
            admin: watch::Sender::new(admin),
            pid: watch::Sender::new(None),
            state: watch::Sender::new(ProxyState::starting()),
            updates: tokio::sync::Mutex::new(()),
        }
    }

    /// The config Envoy runs with.
    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// The admin address once known (at once when fixed, after start when Envoy picks it).
    pub fn watch_admin_address(&self) -> watch::Receiver<Option<Address>> {
        self.admin.subscribe()
    }

    /// The running Envoy's pid, `None` when none runs.
    pub fn pid(&self) -> watch::Receiver<Option<u32>> {
        self.pid.subscribe()
    }

    /// Sends `signal` to the running Envoy (e.g. SIGUSR1 to reopen its access logs).
    pub fn signal(&self, signal: Signal) -> Result<(), ProxyError> {
        let pid = (*self.pid.borrow()).ok_or(ProxyError::NotRunning)?;
        signal_pid(pid, signal)
    }

    fn publish(&self, phase: ProxyPhase, epoch: Option<EpochInfo>) {
        self.state.send_modify(|s| {
            if s.phase != phase {
                s.since = SystemTime::now();
            }
            s.phase = phase;
            s.newest_live = epoch
                .as_ref()
                .filter(|e| e.state == EpochState::Live)
                .map(|e| e.epoch);
            s.epochs = epoch.into_iter().collect();
        });
    }

    /// Reads Envoy's control plane now and then (often while readiness waits for its config,
    /// rarely after; never again for a static bootstrap), publishing what changed. Never
    /// resolves.
    async fn watch_config(&self, client: AdminClient) {
        use crate::admin::{BUSY_SHARE, IDLE_SHARE, paced};
        loop {
            let asked = std::time::Instant::now();
            let answer = client.xds().await;
            // Envoy visits every stat to answer: on a large config, less often.
            let took = asked.elapsed();
            let wait = match answer {
                Ok(reading) => {
                    let mut next = Some(CONFIG_POLL);
                    self.state.send_if_modified(|s| {
                        let changed = s.config.observe(0, &reading, SystemTime::now());
                        next = match &s.config {
                            crate::ConfigStatus::Static => None,
                            c if c.waiting() => Some(paced(CONFIG_POLL, took, BUSY_SHARE)),
                            _ => Some(paced(CONFIG_POLL_STEADY, took, IDLE_SHARE)),
                        };
                        if changed {
                            s.config.log_change();
                        }
                        changed
                    });
                    match next {
                        Some(wait) => wait,
                        None => return std::future::pending().await,
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read envoy's control plane stats");
                    paced(CONFIG_POLL, took, BUSY_SHARE)
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Asks the serving Envoy whether it answers (see [`crate::watchdog`]), publishing its
    /// health as it changes; resolves once it is judged wedged, with what happened.
    async fn watch_health(&self, addr: Address) -> String {
        let client = AdminClient::new(addr).with_timeout(crate::watchdog::CHECK_TIMEOUT);
        // One check at a time: the connection is lent to it.
        let kept = std::sync::Mutex::new(KeptConnection::default());
        let check = || async {
            let mut connection =
                std::mem::take(&mut *kept.lock().unwrap_or_else(|p| p.into_inner()));
            let answer = client.ready_kept(&mut connection).await;
            *kept.lock().unwrap_or_else(|p| p.into_inner()) = connection;
            answer.map(|_| ())
        };
        let publish = |health: AdminHealth| {
            self.state.send_modify(|s| s.admin = health);
        };
        crate::watchdog::watch(
            check,
            self.config.options.admin_unresponsive_deadline,
            publish,
        )
        .await
    }

    /// Resolves once Envoy, having reported LIVE (published), is judged wedged, with what
    /// happened; never if it is not.
    async fn watch_live(&self, mut info: EpochInfo) -> String {
        let mut admin = self.admin.subscribe();
        let Ok(addr) = admin.wait_for(Option::is_some).await.map(|a| a.clone()) else {
            return std::future::pending().await;
        };
        let Some(addr) = addr else {
            return std::future::pending().await;
        };
        let client = AdminClient::new(addr.clone()).with_timeout(LIVE_CALL_TIMEOUT);
        // `/ready`, not `/server_info`: the same state in a few bytes (Envoy 1.40's server
        // info is ~120 KB, read, buffered and parsed at every poll of a start).
        loop {
            match client.ready().await {
                Ok(Readiness::Ready) => break,
                Ok(Readiness::NotReady(state)) => tracing::debug!(%state, "envoy not LIVE yet"),
                Err(e) => tracing::debug!(error = %e, "envoy state unknown yet"),
            }
            tokio::time::sleep(LIVE_POLL).await;
        }
        info.state = EpochState::Live;
        info.since = SystemTime::now();
        tracing::info!(
            event = "epoch_state",
            epoch = 0,
            pid = info.pid,
            state = "live",
            "envoy is LIVE"
        );
        self.publish(ProxyPhase::Serving, Some(info));
        tokio::select! {
            () = self.watch_config(client) => std::future::pending().await,
            wedged = self.watch_health(addr) => wedged,
        }
    }
}

impl Envoy {
    /// Spawns Envoy (epoch 0) and publishes it as starting: its process, its epoch's facts and
    /// the file its admin address will be written to (a bootstrap asking for port 0).
    async fn start(&self) -> Result<(EnvoyProcess, EpochInfo, Option<PathBuf>), ProxyError> {
        let admin_file = match &self.config.admin {
            AdminAddress::FromFile(path) => {
                // A stale file would hand out the previous Envoy's address.
                let _ = std::fs::remove_file(path);
                self.admin.send_replace(None);
                Some(path.clone())
            }
            AdminAddress::Fixed(_) | AdminAddress::Socket(_) => None,
        };
        let process = match EnvoyProcess::spawn(&self.config, 0).await {
            Ok(p) => p,
            Err(e) => {
                self.publish(ProxyPhase::Exited, None);
                return Err(e);
            }
        };
        self.pid.send_replace(Some(process.pid()));
        let now = SystemTime::now();
        let info = EpochInfo {
            epoch: 0,
            pid: process.pid(),
            state: EpochState::Starting,
            started: now,
            since: now,
        };
        // A fresh Envoy has received nothing yet, and nothing is known of its silence (a run
        // after a crash).
        self.state.send_modify(|s| {
            s.config = crate::ConfigStatus::Unknown;
            s.admin = AdminHealth::Answering;
        });
        self.publish(ProxyPhase::Starting, Some(info.clone()));
        Ok((process, info, admin_file))
    }

    /// Learns Envoy's admin address (from `admin_file`, when it is written there), then
    /// watches it until it is wedged: says why on `wedged` and kills it through `kill`. Never
    /// resolves: Envoy's exit ends the run.
    async fn watch_admin(
        &self,
        admin_file: Option<PathBuf>,
        info: EpochInfo,
        wedged: tokio::sync::oneshot::Sender<String>,
        kill: &CancellationToken,
    ) -> Result<Exit, ProxyError> {
        if let Some(path) = admin_file {
            let addr = wait_admin_file(&path).await;
            tracing::info!(%addr, "envoy admin address");
            self.admin.send_replace(Some(addr));
        }
        let pid = info.pid;
        let message = self.watch_live(info).await;
        tracing::error!(
            event = "wedge",
            reason = %WedgeReason::AdminUnresponsive,
            pid,
            error = %message,
            "envoy is wedged: killing it"
        );
        let _ = wedged.send(message);
        kill.cancel();
        // Never resolves: the run ends with Envoy's exit.
        std::future::pending().await
    }
}

/// How a run that was not wedged ended, from Envoy's exit.
fn ended(exit: Exit, served: bool) -> Ended {
    if exit.aborted {
        Ended::Stopped { last: Some(exit) }
    } else if !served && exit.oom.is_none() {
        // Never LIVE: a start that failed (a bootstrap Envoy rejects), as a node proxy's
        // first epoch says it, with Envoy's reason.
        Ended::StartFailed {
            code: exit.code(),
            message: start_failure(&exit.stderr_tail),
        }
    } else {
        Ended::Exited(exit)
    }
}

impl Proxy for Envoy {
    async fn run(&self, abort: CancellationToken) -> Result<Ended, ProxyError> {
        let (process, info, admin_file) = self.start().await?;
        let pid = info.pid;
        let (wedged_tx, wedged_rx) = tokio::sync::oneshot::channel::<String>();
        let kill = CancellationToken::new();
        // Every line logged while this Envoy runs (its watchers', its exit's) names it.
        let result = async {
            tokio::select! {
                result = process.run_or_kill(abort, kill.cancelled()) => result,
                result = self.watch_admin(admin_file, info, wedged_tx, &kill) => result,
            }
        }
        .instrument(tracing::info_span!("envoy", epoch = 0, pid))
        .await;
        self.pid.send_replace(None);
        let served = self.state.borrow().phase == ProxyPhase::Serving;
        self.publish(ProxyPhase::Exited, None);
        let exit = result?;
        if let Ok(message) = wedged_rx.await {
            return Ok(Ended::Wedged {
                reason: WedgeReason::AdminUnresponsive,
                message,
            });
        }
        Ok(ended(exit, served))
    }

    fn state(&self) -> watch::Receiver<ProxyState> {
        self.state.subscribe()
    }

    async fn drain(&self, options: DrainOptions) -> Result<DrainPlan, ProxyError> {
        // A drain asked for while Envoy is still binding its admin port waits for it (the
        // caller bounds the whole drain) rather than failing and leaving Envoy undrained.
        let mut admin = self.admin.subscribe();
        let addr = tokio::time::timeout(
            crate::admin::DEFAULT_TIMEOUT,
            admin.wait_for(Option::is_some),
        )
        .await
        .ok()
        .and_then(|r| r.ok().and_then(|a| a.clone()))
        .ok_or(ProxyError::AdminUnknown)?;
        let scope = match options.listeners {
            crate::Scope::Auto => self.config.options.drain_listeners,
            asked => asked,
        };
        let plan = crate::listeners::drain(
            &AdminClient::new(addr),
            scope,
            self.config.sidecar,
            options.skip_exit,
        )
        .await?;
        if options.hold_notice {
            tracing::info!(
                event = "drain_notice_held",
                "no drain notice: the app still calls out through envoy's outbound listeners"
            );
        } else {
            crate::drain_notice::tell(&self.config, 0);
        }
        Ok(plan)
    }

    fn tell_drain_notice(&self) {
        crate::drain_notice::tell(&self.config, 0);
    }

    async fn fail_health_checks(&self) -> Result<(), ProxyError> {
        let addr = self
            .admin
            .borrow()
            .clone()
            .ok_or(ProxyError::AdminUnknown)?;
        tracing::info!(admin = %addr, "failing envoy's health checks");
        AdminClient::new(addr).healthcheck_fail().await?;
        Ok(())
    }

    async fn hot_restart(&self, _reason: String) -> Result<u32, RestartError> {
        Err(RestartError::Unsupported)
    }

    async fn update_config(
        &self,
        config: Vec<u8>,
        reason: String,
    ) -> Result<ConfigApplied, ProxyError> {
        let _one_at_a_time = self.updates.lock().await;
        crate::validate_candidate(&self.config, &config).await?;
        crate::replace_config(&self.config.config_path, config).await?;
        tracing::info!(path = %self.config.config_path.display(), %reason, "config updated (hot restart is off: envoy reads it when next started)");
        Ok(ConfigApplied {
            restarted_epoch: None,
        })
    }

    async fn reopen_logs(&self) -> Result<usize, ProxyError> {
        // SIGUSR1's default action kills a process that has not installed Envoy's handler
        // yet: only an Envoy that has reached LIVE gets it.
        if !self.state.borrow().serving() {
            return Ok(0);
        }
        self.signal(Signal::SIGUSR1).map(|()| 1)
    }

    fn admin_address(&self) -> Option<Address> {
        self.admin.borrow().clone()
    }

    fn cleanup(&self) {
        if self.config.options.config_cleanup {
            remove_logged(&self.config.config_path);
        }
        if let AdminAddress::FromFile(path) = &self.config.admin {
            remove_logged(path);
        }
        crate::drain_notice::remove(&self.config, 0);
    }
}

fn remove_logged(path: &PathBuf) {
    match std::fs::remove_file(path) {
        Ok(()) => tracing::debug!(path = %path.display(), "removed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove"),
    }
}
/// Why an Envoy that never served stopped, in its words: the end of its stderr, its last
/// lines joined (its rejection spans a line or two), at most [`START_FAILURE_KEPT`] bytes.
fn start_failure(tail: &str) -> String {
    let lines: Vec<&str> = tail.lines().filter(|l| !l.trim().is_empty()).collect();
    let text = lines[lines.len().saturating_sub(2)..].join(" ");
    let text = text.trim();
    if text.len() <= START_FAILURE_KEPT {
        return text.to_owned();
    }
    let mut cut = text.len() - START_FAILURE_KEPT;
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    format!("...{}", &text[cut..])
}

/// How much of a failed start's stderr the reason keeps.
const START_FAILURE_KEPT: usize = 1024;

//! [`EnvoyFamily`]: a hot-restart family of Envoy epochs as a [`Proxy`], so that the agent
//! drives it exactly as it drives a single Envoy; and [`SupervisorHandle`], the cloneable
//! handle that sends the supervisor actor its commands.
//!
//! Every call resolves once the supervisor has acted on it: a hot restart when the new epoch
//! is LIVE (or why not), a drain when Envoy accepted it, a log reopening when the epochs were
//! signalled. Config updates are serialised here: one at a time, validate a private candidate,
//! tell the supervisor to expect the content (so its config watch does not restart a second
//! time), write atomically, then hot-restart, all under one lock.

use envoy_agent_proxy::admin::Address;
use std::sync::{Arc, Mutex};

use envoy_agent_proxy::{
    AdminClient, ConfigApplied, DrainOptions, DrainPlan, Ended, Proxy, ProxyError, ProxyState,
    RestartError,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::answers::FamilyError;
use crate::config::{Config, ConfigError};
use crate::host::{Host, RealHost};
use crate::metrics::SupervisorMetrics;
use crate::preflight_cache::{PreflightCache, validate_candidate_cached};
use crate::supervisor::{Command, Supervisor};

/// Bound on one admin call of the supervisor.
const ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A cloneable handle to a running supervisor.
#[derive(Debug, Clone)]
pub struct SupervisorHandle {
    commands: mpsc::Sender<Command>,
    state: watch::Receiver<ProxyState>,
}

impl SupervisorHandle {
    /// The family's state, now and as it changes.
    pub fn state(&self) -> watch::Receiver<ProxyState> {
        self.state.clone()
    }

    async fn ask<T>(&self, command: impl FnOnce(oneshot::Sender<T>) -> Command) -> Option<T> {
        let (reply, answer) = oneshot::channel();
        self.commands.send(command(reply)).await.ok()?;
        answer.await.ok()
    }

    /// Hot-restarts and resolves with the new epoch once it is LIVE, or why not. Triggers
    /// during a handoff are coalesced: they share the outcome of the next restart.
    pub async fn hot_restart(&self, reason: impl Into<String>) -> Result<u32, RestartError> {
        let reason = reason.into();
        self.ask(|reply| Command::HotRestart {
            reason,
            reply: Some(reply),
        })
        .await
        .unwrap_or_else(|| Err(RestartError::Refused("the supervisor is gone".to_owned())))
    }

    /// Drains every serving epoch; no new epoch starts afterwards.
    pub async fn drain(&self, options: DrainOptions) -> Result<DrainPlan, FamilyError> {
        self.ask(|reply| Command::Drain { options, reply })
            .await
            .unwrap_or(Err(FamilyError::Gone))
    }

    /// Makes the serving epoch fail its health checks, and every epoch that serves after it.
    pub async fn fail_health_checks(&self) -> Result<(), FamilyError> {
        self.ask(|reply| Command::FailHealthChecks { reply })
            .await
            .unwrap_or(Err(FamilyError::Gone))
    }

    /// SIGUSR1 to every epoch that has its handler; how many were signalled.
    pub async fn reopen_logs(&self) -> usize {
        self.ask(|reply| Command::ReopenLogs { reply })
            .await
            .unwrap_or(0)
    }

    /// Whether a successor pod is taking (or took) over, from fresh facts.
    pub async fn successor(&self) -> Option<String> {
        self.ask(|reply| Command::Successor { reply })
            .await
            .flatten()
    }

    async fn expect(&self, content: Vec<u8>) {
        let _ = self.ask(|reply| Command::Expect { content, reply }).await;
    }
}

/// A hot-restart family of Envoy epochs, run by its supervisor actor.
pub struct EnvoyFamily<H: Host = RealHost> {
    config: Config,
    admin: Address,
    host: Arc<H>,
    handle: SupervisorHandle,
    supervisor: Mutex<Option<Supervisor<H>>>,
    /// One config update at a time.
    updates: tokio::sync::Mutex<()>,
    /// Pre-flight verdicts, shared with the real host's restarts.
    cache: PreflightCache,
    /// The last run's family was ours to the end: [`Proxy::cleanup`] removes its files.
    files_ours: std::sync::atomic::AtomicBool,
}

impl<H: Host> std::fmt::Debug for EnvoyFamily<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvoyFamily")
            .field("identity", &self.config.identity)
            .field("admin", &self.admin)
            .finish_non_exhaustive()
    }
}

impl EnvoyFamily<RealHost> {
    /// A family for `config`, on the real host. Nothing starts until [`Proxy::run`].
    pub fn new(config: Config, metrics: SupervisorMetrics) -> Result<Self, ConfigError> {
        let (admin, base_id) = config.validate()?;
        let cache = PreflightCache::new();
        let host = RealHost::new(
            config.proxy.clone(),
            AdminClient::new(admin).with_timeout(ADMIN_TIMEOUT),
            base_id,
            config.state_dir.clone(),
            config.options.ready_marker.clone(),
            cache.clone(),
        );
        let mut family = Self::with_host(config, Arc::new(host), metrics)?;
        family.cache = cache;
        Ok(family)
    }
}

impl<H: Host> EnvoyFamily<H> {
    /// A family for `config` on `host` (the tests' fake, or the real one).
    pub fn with_host(
        config: Config,
        host: Arc<H>,
        metrics: SupervisorMetrics,
    ) -> Result<Self, ConfigError> {
        let (admin, base_id) = config.validate()?;
        let (commands_tx, commands) = mpsc::channel(64);
        let state = watch::Sender::new(ProxyState::starting());
        let handle = SupervisorHandle {
            commands: commands_tx,
            state: state.subscribe(),
        };
        let supervisor = Supervisor::new(
            config.clone(),
            base_id,
            host.clone(),
            commands,
            state,
            metrics,
        );
        Ok(EnvoyFamily {
            config,
            admin,
            host,
            handle,
            supervisor: Mutex::new(Some(supervisor)),
            updates: tokio::sync::Mutex::new(()),
            cache: PreflightCache::new(),
            files_ours: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// A handle to the family's supervisor.
    pub fn handle(&self) -> SupervisorHandle {
        self.handle.clone()
    }

    /// The supervisor's settings.
    pub fn config(&self) -> &Config {
        &self.config
    }
}

impl<H: Host> Proxy for EnvoyFamily<H> {
    async fn run(&self, abort: CancellationToken) -> Result<Ended, ProxyError> {
        // Taken while it runs: a second concurrent run finds none.
        let mut supervisor = self
            .supervisor
            .lock()
            .map_err(|_| ProxyError::NotRunning)?
            .take()
            .ok_or(ProxyError::NotRunning)?;
        let ended = supervisor.run(abort).await;
        self.files_ours.store(
            supervisor.family_files_ours(),
            std::sync::atomic::Ordering::Relaxed,
        );
        if let Ok(mut slot) = self.supervisor.lock() {
            *slot = Some(supervisor.into_fresh());
        }
        Ok(ended)
    }

    fn state(&self) -> watch::Receiver<ProxyState> {
        self.handle.state()
    }

    async fn drain(&self, options: DrainOptions) -> Result<DrainPlan, ProxyError> {
        self.handle
            .drain(options)
            .await
            .map_err(|e| ProxyError::DrainFailed {
                message: e.to_string(),
            })
    }

    async fn fail_health_checks(&self) -> Result<(), ProxyError> {
        self.handle
            .fail_health_checks()
            .await
            .map_err(|e| ProxyError::HealthChecksNotFailed {
                message: e.to_string(),
            })
    }

    async fn hot_restart(&self, reason: String) -> Result<u32, RestartError> {
        self.handle.hot_restart(reason).await
    }

    async fn update_config(
        &self,
        config: Vec<u8>,
        reason: String,
    ) -> Result<ConfigApplied, ProxyError> {
        let _one_at_a_time = self.updates.lock().await;
        let path = self.config.proxy.config_path.clone();
        // Through the cache: the restart below then finds these bytes validated.
        validate_candidate_cached(&self.config.proxy, &config, &self.cache).await?;
        self.handle.expect(config.clone()).await;
        envoy_agent_proxy::replace_config(&path, config).await?;
        tracing::info!(path = %path.display(), %reason, "config updated; hot-restarting onto it");
        let epoch = self
            .handle
            .hot_restart(format!("config update: {reason}"))
            .await
            .map_err(|source| ProxyError::Restart {
                path: path.clone(),
                source,
            })?;
        Ok(ConfigApplied {
            restarted_epoch: Some(epoch),
        })
    }

    async fn reopen_logs(&self) -> Result<usize, ProxyError> {
        Ok(self.handle.reopen_logs().await)
    }

    async fn successor(&self) -> Option<String> {
        self.handle.successor().await
    }

    fn admin_address(&self) -> Option<Address> {
        // After a cold handover, until the next hot restart: the new family's ephemeral one.
        self.host.admin_address().or(Some(self.admin.clone()))
    }

    fn cleanup(&self) {
        if self.config.proxy.options.config_cleanup {
            let _ = std::fs::remove_file(&self.config.proxy.config_path);
        }
        // Envoy removes neither its shared memory nor its hot-restart sockets. A family handed
        // over to a successor pod is the successor's; one that never served was someone
        // else's (or nothing).
        if !self.files_ours.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let mut base_ids: Vec<u32> = self
            .config
            .proxy
            .hot_restart
            .iter()
            .map(|h| h.base_id)
            .collect();
        base_ids.extend(self.config.options.cold_base_id);
        match self.host.remove_family_files(&base_ids) {
            Ok(removed) => tracing::info!(
                event = "family_files_removed",
                removed = ?removed,
                "removed what the family's Envoys left behind"
            ),
            Err(why) => tracing::info!(
                event = "family_files_kept",
                %why,
                "left the family's shared memory and sockets in place"
            ),
        }
    }
}

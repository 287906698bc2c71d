//! Envoy's log level, changed through the agent (`SetLogLevel`, `envoy-agent log-level`):
//! what operators did with `curl -X POST localhost:15000/logging?level=debug`, kept so that
//! the agent always knows what was done to its Envoy, and so that a restart does not undo it.
//!
//! # Theory of operation
//!
//! [`EnvoyLogLevel`] holds the level in force: the command line's (`--proxy-log-level`) until
//! a change, then each change applied over it ([`LogLevel::then`]). A change is checked
//! ([`LogLevel::parse`]), sent to the serving Envoy's admin API (`POST /logging`; a hot-restart
//! family's newest LIVE epoch, the only one whose admin API answers: a draining parent gave its
//! own to its child), and only once Envoy took it, kept in the [`LogLevelCell`] every
//! [`envoy_agent_proxy::ProxyConfig`] clone shares: each Envoy started from then on (a hot
//! restart's next epoch, a crash recovery's fresh Envoy) gets it on its command line. One
//! change at a time.
//!
//! An epoch spawned before the change that becomes the newest LIVE one after it (a hot restart
//! under way) started with the old level: [`EnvoyLogLevel::follow`] watches the status and
//! sends the level in force to each newest LIVE Envoy started before the last change.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use envoy_agent_proxy::{AdminError, LogLevel, LogLevelCell, LogLevelError};
use tokio_util::sync::CancellationToken;

use crate::agent::AgentHandle;

/// The level in force and how to change it; clones share it.
#[derive(Debug, Clone)]
pub struct EnvoyLogLevel {
    /// What each Envoy started from now on gets, once a level was set.
    cell: LogLevelCell,
    /// The command line's level.
    base: LogLevel,
    /// When the level was last set; epochs started before then may have started without it.
    set_at: Arc<Mutex<Option<SystemTime>>>,
    /// One change at a time: two at once could keep one level and leave Envoy at the other.
    changing: Arc<tokio::sync::Mutex<()>>,
}

/// A change applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The level in force now.
    pub level: LogLevel,
    /// How many running Envoy processes took it (0: none serves; the next one starts with it).
    pub envoys: u32,
}

/// Why a change was not made (nothing changed).
#[derive(Debug, thiserror::Error)]
pub enum SetError {
    /// Not a level.
    #[error(transparent)]
    Level(#[from] LogLevelError),
    /// Envoy refused it (a component it has no logger for).
    #[error("envoy refuses log level {level}: {source}")]
    Refused {
        /// The change.
        level: LogLevel,
        /// Envoy's answer.
        source: AdminError,
    },
    /// Envoy's admin API did not take it (silent, gone).
    #[error("cannot set envoy's log level to {level}: {source}")]
    Unreachable {
        /// The change.
        level: LogLevel,
        /// What failed.
        source: AdminError,
    },
}

impl EnvoyLogLevel {
    /// The command line's level (`--proxy-log-level`, `--proxy-component-log-level`), changed
    /// through `cell` (the one in the proxy's config).
    pub fn new(log_level: &str, component_log_level: &str, cell: LogLevelCell) -> Self {
        EnvoyLogLevel {
            cell,
            base: LogLevel::from_flags(log_level, component_log_level),
            set_at: Arc::default(),
            changing: Arc::default(),
        }
    }

    /// The level in force, Istio style.
    pub fn in_force(&self) -> LogLevel {
        self.cell.get().unwrap_or_else(|| self.base.clone())
    }

    /// Applies `change` (Istio style) to the serving Envoy, then keeps it for every later one.
    pub async fn set(&self, change: &str, agent: &AgentHandle) -> Result<Applied, SetError> {
        let change = LogLevel::parse(change)?;
        let _one = self.changing.lock().await;
        let serving = agent.status().borrow().proxy.newest_live.is_some();
        let admin = agent.admin().filter(|_| serving);
        let envoys = match admin {
            Some(admin) => match admin.set_log_level(&change).await {
                Ok(()) => 1,
                Err(source @ AdminError::Status { status, .. }) if status.is_client_error() => {
                    return Err(SetError::Refused {
                        level: change,
                        source,
                    });
                }
                Err(source) => {
                    return Err(SetError::Unreachable {
                        level: change,
                        source,
                    });
                }
            },
            None => 0,
        };
        let level = self.in_force().then(&change);
        self.cell.set(level.clone());
        // After the cell: an epoch started from here on has the level on its command line.
        *self.set_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(SystemTime::now());
        tracing::info!(
            event = "log_level",
            change = %change,
            log_level = %level,
            envoys,
            "envoy's log level set"
        );
        Ok(Applied { level, envoys })
    }

    /// Until `cancel`: sends the level in force to each Envoy that becomes the newest LIVE one
    /// having started before the last change (see the module's docs).
    pub async fn follow(self, agent: AgentHandle, cancel: CancellationToken) {
        let mut status = agent.status();
        let mut last = None;
        loop {
            let newest = {
                let s = status.borrow_and_update();
                s.proxy.newest_live.and_then(|epoch| {
                    s.proxy
                        .epochs
                        .iter()
                        .find(|e| e.epoch == epoch)
                        .map(|e| (e.epoch, e.pid, e.started))
                })
            };
            if let Some((epoch, pid, started)) = newest {
                if last != Some((epoch, pid)) {
                    last = Some((epoch, pid));
                    // Behind a change under way: it may have reached the parent just now.
                    let _one = self.changing.lock().await;
                    let set_at = *self.set_at.lock().unwrap_or_else(|p| p.into_inner());
                    if set_at.is_some_and(|at| started < at) {
                        self.reapply(&agent, epoch, pid).await;
                    }
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                changed = status.changed() => if changed.is_err() { return },
            }
        }
    }

    /// Sends the level in force to the newest LIVE Envoy (`epoch`, `pid`); the caller holds
    /// `changing`.
    async fn reapply(&self, agent: &AgentHandle, epoch: u32, pid: u32) {
        let level = self.in_force();
        let Some(admin) = agent.admin() else { return };
        match admin.set_log_level(&level).await {
            Ok(()) => tracing::info!(
                event = "log_level",
                epoch,
                pid,
                log_level = %level,
                "envoy's log level set on an epoch that started before it was changed"
            ),
            Err(e) => tracing::warn!(
                event = "log_level",
                epoch,
                pid,
                log_level = %level,
                error = %e,
                "cannot set envoy's log level on an epoch that started before it was changed"
            ),
        }
    }
}

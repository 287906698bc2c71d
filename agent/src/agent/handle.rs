//! [`AgentHandle`]: what the status server, the gRPC service and tests hold to steer the agent
//! and read its status. Each method sends a [`Command`] to the actor and resolves with its
//! reply, once the actor has acted on it; a gone actor is [`AgentError::Gone`].

use std::fmt;
use std::sync::Arc;

use envoy_agent_proxy::{
    AdminClient, ConfigApplied, DrainOptions, DrainPlan, ProxyError, RestartError, Scope,
};
use tokio::sync::{mpsc, oneshot, watch};

use super::state::{AgentState, Status, Via};

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
    /// The hot restart did not happen.
    #[error(transparent)]
    Restart(#[from] RestartError),
    /// The config update did not happen (or its restart did not).
    #[error(transparent)]
    Config(ProxyError),
}

pub(super) type Reply<T> = oneshot::Sender<Result<T, AgentError>>;

/// What a handle asks of the actor; each carries the reply the actor answers once it acted.
pub(super) enum Command {
    Drain {
        options: DrainOptions,
        via: Via,
        reply: Reply<Option<DrainPlan>>,
    },
    Quit {
        via: Via,
        reply: Reply<()>,
    },
    Stop {
        reply: Reply<()>,
    },
    DisableDraining {
        reply: Reply<()>,
    },
    HotRestart {
        reason: String,
        reply: Reply<u32>,
    },
    UpdateConfig {
        config: Vec<u8>,
        reason: String,
        reply: Reply<ConfigApplied>,
    },
    ReopenLogs {
        reply: Reply<usize>,
    },
}

/// A cloneable handle to a running [`Agent`](super::Agent). Every method resolves once the agent has acted.
#[derive(Clone)]
pub struct AgentHandle {
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) status: watch::Receiver<Status>,
    pub(super) admin: Arc<dyn Fn() -> Option<envoy_agent_proxy::admin::Address> + Send + Sync>,
}

impl fmt::Debug for AgentHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentHandle")
            .field("state", &self.status.borrow().agent)
            .finish_non_exhaustive()
    }
}

// === impl AgentHandle ===

impl AgentHandle {
    /// The agent's and the proxy's state, now and as it changes.
    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// The agent's own state now.
    pub fn state(&self) -> AgentState {
        self.status.borrow().agent.clone()
    }

    /// Envoy's admin API, when its address is known.
    pub fn admin(&self) -> Option<AdminClient> {
        (self.admin)().map(AdminClient::new)
    }

    async fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, AgentError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(command(reply))
            .await
            .map_err(|_| AgentError::Gone)?;
        answer.await.map_err(|_| AgentError::Gone)?
    }

    /// `/drain`: drain with `skip_exit` (Envoy keeps running and accepting); the next SIGTERM
    /// then exits at once. Resolves when Envoy has accepted the drain.
    pub async fn drain_now(&self, via: Via) -> Result<(), AgentError> {
        self.drain(
            DrainOptions {
                listeners: Scope::Auto,
                skip_exit: true,
                hold_notice: false,
            },
            via,
        )
        .await
        .map(|_| ())
    }

    /// Drains every serving epoch and keeps Envoy running: the next SIGTERM exits at once.
    /// With `skip_exit` the listeners keep accepting; without, Envoy stops them when its drain
    /// time ends. Resolves when Envoy has accepted the drain, with what it reached (none when
    /// the agent was already draining or stopping: nothing more was asked of Envoy).
    pub async fn drain(
        &self,
        options: DrainOptions,
        via: Via,
    ) -> Result<Option<DrainPlan>, AgentError> {
        self.ask(|reply| Command::Drain {
            options,
            via,
            reply,
        })
        .await
    }

    /// `/quitquitquit`: stop Envoy at once, without draining, and exit. Resolves once the stop
    /// has begun.
    pub async fn quit(&self, via: Via) -> Result<(), AgentError> {
        self.ask(|reply| Command::Quit { via, reply }).await
    }

    /// The SIGTERM path: hand over to a successor pod, or drain gracefully, then stop.
    /// Resolves once the agent has taken the path.
    pub async fn stop(&self) -> Result<(), AgentError> {
        self.ask(|reply| Command::Stop { reply }).await
    }

    /// Skip the drain on the next SIGTERM (stop at once). Resolves once set.
    pub async fn disable_draining(&self) -> Result<(), AgentError> {
        self.ask(|reply| Command::DisableDraining { reply }).await
    }

    /// Hot-restarts; the new epoch once it is LIVE, or why not.
    pub async fn hot_restart(&self, reason: String) -> Result<u32, AgentError> {
        self.ask(|reply| Command::HotRestart { reason, reply })
            .await
    }

    /// Validates, writes and (with hot restart) restarts onto a new config.
    pub async fn update_config(
        &self,
        config: Vec<u8>,
        reason: String,
    ) -> Result<ConfigApplied, AgentError> {
        self.ask(|reply| Command::UpdateConfig {
            config,
            reason,
            reply,
        })
        .await
    }

    /// SIGUSR1 to every Envoy that can take it; how many were signalled.
    pub async fn reopen_logs(&self) -> Result<usize, AgentError> {
        self.ask(|reply| Command::ReopenLogs { reply }).await
    }
}

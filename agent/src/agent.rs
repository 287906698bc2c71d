//! [`Agent`]: runs one [`Proxy`] (a single Envoy, or a hot-restart family of Envoy epochs) and
//! decides when and how it stops.
//!
//! The agent is one actor task ([`Agent::run`], in `actor`) that owns every decision, plus
//! cloneable [`AgentHandle`]s (the status server's, the gRPC service's) that send it commands
//! and read its [`Status`] from a `watch` channel: the agent's own [`AgentState`] beside the
//! proxy's typed state, one snapshot. Nothing else touches the proxy's lifecycle. Commands
//! resolve once the agent has acted on them.
//!
//! - `state`: the data it publishes and ends with ([`AgentState`], [`Status`],
//!   [`ExitPath`] and its exit code; the exit paths are tabled in `docs/shutdown.md`).
//! - `handle`: [`AgentHandle`] and its commands.
//! - `actor`: the mode (an enum whose variants own their in-flight calls), the events, and
//!   the one function that maps a request to stop (SIGTERM, SIGINT, gRPC `Stop`, quit) in a
//!   mode to a transition.
//! - `shutdown`: the graceful shutdown's clock (drain delay, drain request and its retries,
//!   exit-on-zero counts and their pacing, the deadline, a sidecar's app rule), which says
//!   what is due at an instant. A drain request (`/drain`, gRPC `Drain`) runs the same
//!   timeline to a drained, serving Envoy; a signal that follows continues it to the stop.
//!
//! # Ordering, cancellation, drop
//!
//! "Stop" cancels the proxy's run (a `CancellationToken`): it stops every Envoy (SIGTERM,
//! SIGKILL after its grace; SIGKILL at once for an epoch that is not LIVE while its parent
//! lives) and the agent waits for them all to be reaped, so no Envoy outlives it. The run
//! ends only after that; the exit path is the mode's (`Stopping(path)`), or Envoy's own end.
//!
//! Every call to the proxy that may take time (drain, the successor question, connection
//! counts) runs concurrently with the loop, so a hanging admin API never stalls a signal or a
//! command; it belongs to the mode that made it and is dropped when the agent leaves that
//! mode. The drain deadline starts when the drain does (after the optional delay) and covers
//! the drain call itself.
//!
//! Exit-on-zero counts in both modes at the newest epoch's admin API, or from the kernel's
//! socket table: a hot-restart parent still draining holds its own connections and requests,
//! which the newest epoch's stats may not show, so a zero counts only once no parent drains.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub use envoy_agent_drain::Counting;
use envoy_agent_drain::DrainError;
use envoy_agent_proxy::Proxy;
use tokio::sync::{mpsc, watch};

use crate::crash::Crashes;
use crate::signal::IntentSource;

mod actor;
mod handle;
mod shutdown;
mod state;

pub use handle::{AgentError, AgentHandle};
pub use shutdown::describe_listener;
pub use state::{
    AgentConfig, AgentExit, AgentState, AppWatch, DrainPhase, DrainProgress, DrainReason,
    EXIT_SOFTWARE, ExitPath, Status, Via,
};

/// Runs a proxy until it exits or an intent or command stops it. See the module docs.
pub struct Agent<P> {
    proxy: Arc<P>,
    config: AgentConfig,
    metrics: crate::telemetry::AgentMetrics,
    commands: mpsc::Receiver<handle::Command>,
    status: watch::Sender<Status>,
    /// Counts for exit-on-zero; the admin API unless replaced.
    counter: Option<Counter>,
}

/// Counts what exit-on-zero counts, once per call.
pub type Counter =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<u64, DrainError>> + Send>> + Send + Sync>;

impl<P> fmt::Debug for Agent<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Agent")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

// === impl Agent ===

impl<P: Proxy> Agent<P> {
    /// An agent for `proxy`, and a handle to it.
    pub fn new(proxy: Arc<P>, config: AgentConfig) -> (Self, AgentHandle) {
        let (commands_tx, commands) = mpsc::channel(16);
        let status = watch::Sender::new(Status {
            agent: AgentState::Starting {
                since: std::time::SystemTime::now(),
            },
            proxy: proxy.state().borrow().clone(),
            drain: None,
            crashes: Crashes {
                recovery: config.crash_recovery,
                ..Crashes::default()
            },
        });
        let admin = {
            let proxy = proxy.clone();
            Arc::new(move || proxy.admin_address())
        };
        let handle = AgentHandle {
            commands: commands_tx,
            status: status.subscribe(),
            admin,
        };
        (
            Agent {
                proxy,
                config,
                metrics: crate::telemetry::AgentMetrics::default(),
                commands,
                status,
                counter: None,
            },
            handle,
        )
    }

    /// Counts with `counter` instead of Envoy's admin API (tests).
    pub fn with_counter(mut self, counter: Counter) -> Self {
        self.counter = Some(counter);
        self
    }

    /// Records into `metrics` (drain duration and exit path).
    pub fn with_metrics(mut self, metrics: crate::telemetry::AgentMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Starts the proxy and returns once it has ended and every Envoy has been reaped.
    pub async fn run(self, intents: impl IntentSource) -> AgentExit {
        actor::Actor::new(self, intents).run().await
    }
}

#[cfg(test)]
mod tests;

//! [`Agent`]: runs one proxy and turns intents into what happens to it.

use std::sync::Arc;

use envoy_agent_proxy::{Exit, Proxy, ProxyError};
use tokio_util::sync::CancellationToken;

use crate::signal::{Intent, IntentSource};

/// How the agent's run ended; [`AgentExit::code`] is the process exit code.
#[derive(Debug)]
pub enum AgentExit {
    /// The proxy exited on its own; the agent passes its code on (128+N for signal N).
    ProxyExited(Exit),
    /// The agent stopped the proxy because it was told to.
    Stopped {
        /// What told it.
        intent: Intent,
        /// How the proxy ended.
        exit: Exit,
    },
    /// The proxy could not be run at all.
    ProxyFailed(ProxyError),
}

impl AgentExit {
    /// Exit code: the proxy's own when it exited on its own, 0 after a requested stop, 70
    /// (`EX_SOFTWARE`) when the proxy could not be run.
    pub fn code(&self) -> u8 {
        match self {
            AgentExit::ProxyExited(exit) => u8::try_from(exit.code()).unwrap_or(1),
            AgentExit::Stopped { .. } => 0,
            AgentExit::ProxyFailed(_) => 70,
        }
    }
}

/// Runs a proxy until it exits or an intent stops it.
#[derive(Debug)]
pub struct Agent<P> {
    proxy: Arc<P>,
}

// === impl Agent ===

impl<P: Proxy> Agent<P> {
    /// An agent for `proxy`.
    pub fn new(proxy: Arc<P>) -> Self {
        Agent { proxy }
    }

    /// Starts the proxy at epoch 0 and returns once it has exited, reaped.
    ///
    /// - The proxy exits on its own: its code is passed on.
    /// - SIGTERM/SIGINT: the proxy is stopped (SIGTERM, SIGKILL after its grace); exit 0.
    /// - SIGUSR1: the proxy reopens its logs.
    /// - SIGHUP: logged and ignored (hot restart is off).
    pub async fn run(self, mut intents: impl IntentSource) -> AgentExit {
        let abort = CancellationToken::new();
        let proxy = self.proxy.clone();
        let run = {
            let abort = abort.clone();
            async move { proxy.run(0, abort).await }
        };
        tokio::pin!(run);
        let mut stop_intent = None;
        let mut intents_open = true;
        let result = loop {
            tokio::select! {
                result = &mut run => break result,
                intent = intents.next(), if intents_open => match intent {
                    None => intents_open = false,
                    Some(intent @ (Intent::Terminate | Intent::Interrupt)) => {
                        if stop_intent.is_none() {
                            tracing::info!(signal = intent.signal_name(), "stopping envoy");
                            stop_intent = Some(intent);
                            abort.cancel();
                        }
                    }
                    Some(Intent::ReopenLogs) => {
                        if let Err(e) = self.proxy.reopen_logs() {
                            tracing::warn!(error = %e, "cannot forward SIGUSR1 to envoy");
                        }
                    }
                    Some(Intent::Reload) => {
                        tracing::warn!("SIGHUP ignored: hot restart is off (see --hot-restart)");
                    }
                },
            }
        };
        self.proxy.cleanup();
        match result {
            Err(e) => AgentExit::ProxyFailed(e),
            Ok(exit) => {
                log_exit(&exit);
                match stop_intent {
                    Some(intent) => AgentExit::Stopped { intent, exit },
                    None => AgentExit::ProxyExited(exit),
                }
            }
        }
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
            stderr_tail = %exit.stderr_tail.trim_end(),
            "envoy exited with code {code}{hint}"
        );
    }
}

//! Signals become [`Intent`]s, delivered by an injectable [`IntentSource`].
//!
//! The agent reacts to intents, never to raw signals, so in-process tests drive it through a
//! channel ([`tokio::sync::mpsc::Receiver<Intent>`] is a source) and only the end-to-end tests
//! send real signals to the real binary.

use std::future::Future;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

/// What a signal asks the agent to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Intent {
    /// SIGTERM: shut down gracefully (the kubelet stopping the pod).
    Terminate,
    /// SIGINT: the same from a terminal's Ctrl-C.
    Interrupt,
    /// SIGHUP: reload, i.e. hot restart when it is on.
    Reload,
    /// SIGUSR1: Envoy reopens its access logs (log rotation).
    ReopenLogs,
}

impl Intent {
    /// The signal's name, for logs.
    pub fn signal_name(self) -> &'static str {
        match self {
            Intent::Terminate => "SIGTERM",
            Intent::Interrupt => "SIGINT",
            Intent::Reload => "SIGHUP",
            Intent::ReopenLogs => "SIGUSR1",
        }
    }
}

/// Where intents come from.
pub trait IntentSource: Send + 'static {
    /// The next intent; `None` when the source is closed (no more will come).
    fn next(&mut self) -> impl Future<Output = Option<Intent>> + Send;
}

impl IntentSource for mpsc::Receiver<Intent> {
    async fn next(&mut self) -> Option<Intent> {
        self.recv().await
    }
}

/// The process's real signals.
#[derive(Debug)]
pub struct UnixSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

impl UnixSignals {
    /// Installs the handlers. From here on these signals no longer kill the process.
    pub fn install() -> std::io::Result<Self> {
        Ok(UnixSignals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
            usr1: signal(SignalKind::user_defined1())?,
        })
    }
}

impl IntentSource for UnixSignals {
    async fn next(&mut self) -> Option<Intent> {
        tokio::select! {
            Some(()) = self.term.recv() => Some(Intent::Terminate),
            Some(()) = self.int.recv() => Some(Intent::Interrupt),
            Some(()) = self.hup.recv() => Some(Intent::Reload),
            Some(()) = self.usr1.recv() => Some(Intent::ReopenLogs),
            else => None,
        }
    }
}

//! A fake proxy for the agent's unit tests: runs until aborted or told to exit, records what
//! it is asked, with the (paused) time it was asked.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Mutex;
use std::time::Duration;

use envoy_agent_proxy::{Exit, Proxy, ProxyError};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What the fake saw, with the (paused) time it saw it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Call {
    Drain { skip_exit: bool },
    Stop,
}

/// A proxy that runs until aborted or told to exit, and records what it is asked.
#[derive(Default)]
pub(crate) struct FakeProxy {
    pub(crate) calls: Mutex<Vec<(Call, Instant)>>,
    pub(crate) exit_code: Mutex<Option<i32>>,
    pub(crate) exit_now: Notify,
    pub(crate) hang_drain: bool,
}

impl FakeProxy {
    pub(crate) fn record(&self, call: Call) {
        self.calls.lock().unwrap().push((call, Instant::now()));
    }

    pub(crate) fn calls(&self) -> Vec<Call> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .map(|(c, _)| c.clone())
            .collect()
    }

    pub(crate) fn stopped_at(&self) -> Option<Instant> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .find(|(c, _)| *c == Call::Stop)
            .map(|(_, t)| *t)
    }

    pub(crate) fn exit_on_its_own(&self, code: i32) {
        *self.exit_code.lock().unwrap() = Some(code);
        self.exit_now.notify_one();
    }
}

pub(crate) fn exit(code: i32, aborted: bool) -> Exit {
    Exit {
        pid: 1,
        epoch: 0,
        status: ExitStatus::from_raw(code << 8),
        aborted,
        ran_for: Duration::ZERO,
        stderr_tail: String::new(),
    }
}

impl Proxy for FakeProxy {
    async fn run(&self, _epoch: u32, abort: CancellationToken) -> Result<Exit, ProxyError> {
        tokio::select! {
            () = abort.cancelled() => {
                self.record(Call::Stop);
                Ok(exit(0, true))
            }
            () = self.exit_now.notified() => {
                let code = self.exit_code.lock().unwrap().unwrap_or(0);
                Ok(exit(code, false))
            }
        }
    }

    async fn drain(&self, skip_exit: bool) -> Result<(), ProxyError> {
        self.record(Call::Drain { skip_exit });
        if self.hang_drain {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    fn cleanup(&self) {}

    async fn update_config(&self, _config: &[u8]) -> Result<(), ProxyError> {
        Ok(())
    }
}

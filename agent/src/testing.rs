//! A fake proxy for the agent's unit tests: runs until aborted or told to exit, records what
//! it is asked, with the (paused) time it was asked, and publishes whatever state the test
//! gives it.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use envoy_agent_proxy::{
    ConfigApplied, DrainOptions, DrainPlan, Ended, EpochInfo, EpochState, Exit, FamilyState, Proxy,
    ProxyError, ProxyPhase, ProxyState, RestartError,
};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What the fake saw, with the (paused) time it saw it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Call {
    Drain { skip_exit: bool },
    FailHealthChecks,
    Stop,
    Successor,
}

/// A proxy that runs until aborted or told to exit, and records what it is asked.
pub(crate) struct FakeProxy {
    pub(crate) calls: Mutex<Vec<(Call, Instant)>>,
    pub(crate) exit_code: Mutex<Option<i32>>,
    pub(crate) exit_now: Notify,
    pub(crate) hang_drain: bool,
    /// How many drain requests fail (as an admin call the agent could not make) before one
    /// is accepted.
    pub(crate) drain_failures: Mutex<u32>,
    /// What `successor` answers.
    pub(crate) successor: Mutex<Option<String>>,
    pub(crate) state: watch::Sender<ProxyState>,
    /// When each run started.
    pub(crate) runs: Mutex<Vec<Instant>>,
    /// How the next runs end when told to exit (else: `Exited` with `exit_code`).
    pub(crate) ends: Mutex<std::collections::VecDeque<Ended>>,
}

impl Default for FakeProxy {
    fn default() -> Self {
        FakeProxy {
            calls: Mutex::default(),
            exit_code: Mutex::default(),
            exit_now: Notify::new(),
            hang_drain: false,
            drain_failures: Mutex::default(),
            successor: Mutex::default(),
            state: watch::Sender::new(ProxyState::starting()),
            runs: Mutex::default(),
            ends: Mutex::default(),
        }
    }
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

    /// Ends the run under way with `ended`, as the proxy would on its own.
    pub(crate) fn end_with(&self, ended: Ended) {
        self.ends.lock().unwrap().push_back(ended);
        self.exit_now.notify_one();
    }

    /// When each run started.
    pub(crate) fn runs(&self) -> Vec<Instant> {
        self.runs.lock().unwrap().clone()
    }

    /// Publishes one LIVE epoch.
    pub(crate) fn go_live(&self) {
        self.set(ProxyPhase::Serving, vec![epoch(0, EpochState::Live)], None);
    }

    /// Publishes a family state.
    pub(crate) fn set(
        &self,
        phase: ProxyPhase,
        epochs: Vec<EpochInfo>,
        family: Option<FamilyState>,
    ) {
        self.state.send_modify(|s| {
            s.phase = phase;
            s.newest_live = epochs
                .iter()
                .filter(|e| e.state == EpochState::Live)
                .map(|e| e.epoch)
                .max();
            s.epochs = epochs;
            s.family = family;
        });
    }
}

pub(crate) fn epoch(epoch: u32, state: EpochState) -> EpochInfo {
    EpochInfo {
        epoch,
        pid: 100 + epoch,
        state,
        started: SystemTime::UNIX_EPOCH,
        since: SystemTime::UNIX_EPOCH,
    }
}

/// An Envoy killed by `signal`.
pub(crate) fn killed(signal: i32) -> Exit {
    Exit {
        status: ExitStatus::from_raw(signal),
        stderr_tail: "killed\n".to_owned(),
        oom: None,
        ..exit(0, false)
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
        oom: None,
    }
}

impl Proxy for FakeProxy {
    async fn run(&self, abort: CancellationToken) -> Result<Ended, ProxyError> {
        let again = {
            let mut runs = self.runs.lock().unwrap();
            runs.push(Instant::now());
            runs.len() > 1
        };
        if again {
            // A fresh start, as a real proxy publishes it.
            self.set(ProxyPhase::Starting, vec![], None);
        }
        tokio::select! {
            () = abort.cancelled() => {
                self.record(Call::Stop);
                Ok(Ended::Stopped { last: Some(exit(0, true)) })
            }
            () = self.exit_now.notified() => {
                let ended = self.ends.lock().unwrap().pop_front();
                let ended = ended.unwrap_or_else(|| {
                    let code = self.exit_code.lock().unwrap().unwrap_or(0);
                    Ended::Exited(exit(code, false))
                });
                self.set(ProxyPhase::Exited, vec![], None);
                Ok(ended)
            }
        }
    }

    fn state(&self) -> watch::Receiver<ProxyState> {
        self.state.subscribe()
    }

    async fn drain(&self, options: DrainOptions) -> Result<DrainPlan, ProxyError> {
        self.record(Call::Drain {
            skip_exit: options.skip_exit,
        });
        if self.hang_drain {
            std::future::pending::<()>().await;
        }
        let mut failures = self.drain_failures.lock().unwrap();
        if *failures > 0 {
            *failures -= 1;
            return Err(ProxyError::NotRunning);
        }
        Ok(envoy_agent_proxy::listeners::plan(
            options.listeners,
            true,
            Ok(Vec::new()),
        ))
    }

    async fn fail_health_checks(&self) -> Result<(), ProxyError> {
        self.record(Call::FailHealthChecks);
        Ok(())
    }

    async fn hot_restart(&self, _reason: String) -> Result<u32, RestartError> {
        Err(RestartError::Unsupported)
    }

    async fn update_config(
        &self,
        _config: Vec<u8>,
        _reason: String,
    ) -> Result<ConfigApplied, ProxyError> {
        Ok(ConfigApplied {
            restarted_epoch: None,
        })
    }

    async fn reopen_logs(&self) -> Result<usize, ProxyError> {
        Ok(0)
    }

    async fn successor(&self) -> Option<String> {
        self.record(Call::Successor);
        self.successor.lock().unwrap().clone()
    }

    fn admin_address(&self) -> Option<envoy_agent_proxy::admin::Address> {
        None
    }

    fn cleanup(&self) {}
}

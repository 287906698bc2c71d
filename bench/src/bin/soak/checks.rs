//! The invariants the soak checks while it runs, and the shared record they are checked
//! against: the events so far, the failure windows the faults opened, and which agent is
//! watched (a successor pod replaces it).
//!
//! The checker is one task that looks every [`TICK`]: readiness and `envoy-agent status`
//! answer within their bounds; readiness says 200 only while a request to the listener is
//! answered; no more Envoy processes of the family than a hot restart may have; every failed
//! request (from the load and the HTTP/2 client) lies in a window a fault opened; the agent's
//! memory and open files stay within a bound of what they were after a warm-up. A broken
//! invariant is recorded once, with its name, the time and the last events; the run stops at
//! the next step.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use envoy_agent_tests::clients::{ClientProcess, Kind as ClientKind};
use envoy_agent_tests::{Load, unix_ms};

/// How often the checker looks.
const TICK: Duration = Duration::from_millis(250);
/// Bound on `/healthz/ready`'s answer (the status server runs beside the agent's loop: a slow
/// answer is a finding, not load).
pub(crate) const READY_BOUND: Duration = Duration::from_secs(2);
/// Bound on `envoy-agent status`, a process started for each look: its own start-up counts.
const STATUS_BOUND: Duration = Duration::from_secs(5);
/// How often `envoy-agent status` is run.
const STATUS_EVERY: Duration = Duration::from_secs(3);
/// Bound on the checker's request to the listener when readiness says 200: generous, as the
/// load keeps both cores busy; a slow answer is not "not serving", a refused one is.
const SERVE_BOUND: Duration = Duration::from_secs(5);
/// How long after a failure window closed a failure still counts in it: a request cut by the
/// fault may be reported a moment after something serves again.
const WINDOW_GRACE_MS: u64 = 2000;
/// The agent's memory and open files are sampled this often...
const RESOURCES_EVERY: Duration = Duration::from_secs(2);
/// ... and their baseline is the highest sample of this warm-up (the first handoffs, the
/// first crash recovery allocate what the agent keeps).
const WARM_UP: Duration = Duration::from_secs(30);
/// Growth allowed over the baseline: RSS (KiB, or half the baseline if larger) and fds. A
/// status flood's 300 connections raise the agent's RSS once by about 8 MiB (8 to 16 MiB,
/// measured: a plateau over nine floods, the allocator keeping what it once needed), so a
/// flood after the warm-up must fit; a leak grows past it in a long run.
const RSS_GROWTH_KIB: u64 = 16 * 1024;
const FD_GROWTH: usize = 64;
/// The Python clients' bound on one request (their `--timeout` default).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long after the agent is continued its answers are not judged yet.
const AFTER_FREEZE: Duration = Duration::from_secs(3);
/// Events kept for a failure's report.
const LAST_EVENTS: usize = 20;

/// A window in which failed requests are unavoidable: opened by a fault just before it is
/// inflicted, closed once something serves again.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    /// The fault.
    pub(crate) what: String,
    /// Unix ms.
    pub(crate) opened: u64,
    /// Unix ms; `None` while open.
    pub(crate) closed: Option<u64>,
    /// Failed requests counted in it.
    pub(crate) failures: u64,
    /// Only the failures of this client (its name's start) are unavoidable in it.
    pub(crate) only: Option<&'static str>,
}

/// The agent being watched.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The process running envoy-agent (past `unshare`).
    pub(crate) pid: u32,
    /// Its status server.
    pub(crate) status: SocketAddr,
    /// Its gRPC address.
    pub(crate) grpc: String,
    /// When it became the target.
    pub(crate) since: Instant,
}

/// What the checker and the events share.
#[derive(Debug)]
pub(crate) struct State {
    log: VecDeque<String>,
    /// Every window so far.
    pub(crate) windows: Vec<Window>,
    /// Faults under way that make "ready but not serving" expected (a frozen Envoy answers
    /// nothing until the agent notices), and the instant the last one ended.
    pub(crate) serve_check_off: u32,
    serve_check_off_until: Option<Instant>,
    /// Counts events started, so that a look that spans one is not judged.
    pub(crate) events_started: u64,
    /// The watched agent.
    pub(crate) target: Target,
    /// RSS (KiB) and fds: the baseline, the highest seen, the last.
    pub(crate) resources: Resources,
    /// The first broken invariant.
    pub(crate) violation: Option<String>,
    /// The run is ending: the checker stops.
    pub(crate) ending: bool,
    /// A status flood holds connections to the agent: its open files are the flood's.
    pub(crate) flooding: bool,
    /// Freezes of the agent so far (a `freeze-agent` event), whether it is frozen now, and
    /// when it was last continued: its status server cannot answer meanwhile.
    freezes: u64,
    agent_frozen: bool,
    agent_back_at: Option<Instant>,
}

/// The agent's footprint over the run.
#[derive(Debug, Clone, Default)]
pub(crate) struct Resources {
    /// Highest RSS (KiB) and fds in the warm-up.
    pub(crate) base: (u64, usize),
    /// Highest after it.
    pub(crate) max: (u64, usize),
    /// The last sample.
    pub(crate) last: (u64, usize),
}

/// The shared record, and the clock of the run.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    started: Instant,
}

impl Shared {
    pub(crate) fn new(target: Target) -> Arc<Shared> {
        Arc::new(Shared {
            state: Mutex::new(State {
                log: VecDeque::new(),
                windows: Vec::new(),
                serve_check_off: 0,
                serve_check_off_until: None,
                events_started: 0,
                target,
                resources: Resources::default(),
                violation: None,
                ending: false,
                flooding: false,
                freezes: 0,
                agent_frozen: false,
                agent_back_at: None,
            }),
            started: Instant::now(),
        })
    }

    /// The state; a poisoned lock (a panicked task) is taken as it is.
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stamp(&self) -> String {
        format!("+{:.3}s", self.started.elapsed().as_secs_f64())
    }

    /// Logs a line of the run (printed, and kept for a failure's report).
    pub(crate) fn log(&self, text: &str) {
        let line = format!("[soak {}] {text}", self.stamp());
        println!("{line}");
        let mut state = self.state();
        state.log.push_back(line);
        while state.log.len() > LAST_EVENTS {
            state.log.pop_front();
        }
    }

    /// Logs the start of an event (the checker does not judge a look that spans it).
    pub(crate) fn event(&self, text: &str) {
        self.state().events_started += 1;
        self.log(text);
    }

    /// Records a broken invariant (the first one only) and prints its report.
    pub(crate) fn fail(&self, name: &str, details: &str) {
        let report = {
            let mut state = self.state();
            if state.violation.is_some() {
                return;
            }
            let report = format!(
                "INVARIANT BROKEN: {name} at {} (unix ms {}): {details}\nthe last events:\n  {}",
                self.stamp(),
                unix_ms(),
                state.log.iter().cloned().collect::<Vec<_>>().join("\n  ")
            );
            state.violation = Some(report.clone());
            report
        };
        println!("{report}");
    }

    /// Whether an invariant broke.
    pub(crate) fn failed(&self) -> bool {
        self.state().violation.is_some()
    }

    /// Opens a failure window; returns its index.
    pub(crate) fn open_window(&self, what: &str) -> usize {
        self.open_window_of(what, None)
    }

    /// Opens a failure window for the failures of client `only` (its name's start) or every
    /// client's; returns its index.
    pub(crate) fn open_window_of(&self, what: &str, only: Option<&'static str>) -> usize {
        let mut state = self.state();
        state.windows.push(Window {
            what: what.to_owned(),
            opened: unix_ms(),
            closed: None,
            failures: 0,
            only,
        });
        state.windows.len() - 1
    }

    /// Closes window `i` now; returns its length.
    pub(crate) fn close_window(&self, i: usize) -> Duration {
        let now = unix_ms();
        let mut state = self.state();
        match state.windows.get_mut(i) {
            Some(w) => {
                w.closed = Some(now);
                Duration::from_millis(now.saturating_sub(w.opened))
            }
            None => Duration::ZERO,
        }
    }

    /// Turns the "ready only while serving" check off until [`Shared::serve_check_on`].
    pub(crate) fn serve_check_off(&self) {
        self.state().serve_check_off += 1;
    }

    /// Turns it back on, `after` from now (readiness follows a fault with a delay of its own).
    pub(crate) fn serve_check_on(&self, after: Duration) {
        let mut state = self.state();
        state.serve_check_off = state.serve_check_off.saturating_sub(1);
        state.serve_check_off_until = Some(Instant::now() + after);
    }

    /// The agent is stopped (`true`) or continued: its answers are not judged meanwhile, nor
    /// for a moment after (the looks it owes are answered late).
    pub(crate) fn agent_frozen(&self, frozen: bool) {
        let mut state = self.state();
        if frozen {
            state.freezes += 1;
        } else {
            state.agent_back_at = Some(Instant::now());
        }
        state.agent_frozen = frozen;
    }

    /// Freezes so far: a look of the agent is judged only if no freeze started or lasted
    /// through it ([`Shared::agent_judgeable`]).
    pub(crate) fn freezes(&self) -> u64 {
        self.state().freezes
    }

    /// Whether a look of the agent that began when [`Shared::freezes`] said `before` may be
    /// judged: the agent was not frozen during it, nor continued a moment ago.
    pub(crate) fn agent_judgeable(&self, before: u64) -> bool {
        let state = self.state();
        state.freezes == before
            && !state.agent_frozen
            && state
                .agent_back_at
                .is_none_or(|t| t.elapsed() >= AFTER_FREEZE)
    }

    /// Watches another agent (a successor pod), with a new resource baseline.
    pub(crate) fn retarget(&self, target: Target) {
        let mut state = self.state();
        state.target = target;
        state.resources = Resources::default();
    }

    /// The watched agent.
    pub(crate) fn target(&self) -> Target {
        self.state().target.clone()
    }
}

/// What the checker looks at besides the shared record.
pub(crate) struct Checker {
    pub(crate) shared: Arc<Shared>,
    /// Every listener that must answer while readiness says 200: the static one and the
    /// control plane's.
    pub(crate) listeners: Vec<SocketAddr>,
    pub(crate) load: Arc<Load>,
    /// The clients beside the load, by name: each failure they report is judged.
    pub(crate) clients: Vec<(&'static str, Arc<ClientProcess>)>,
    /// What every Envoy of the run has on its command line (the run's dir).
    pub(crate) marker: String,
    /// Envoy processes allowed at once (a node proxy: a serving epoch and its draining parent).
    pub(crate) generations: usize,
    pub(crate) agent_binary: PathBuf,
}

/// How long before a client reported a failure its request (or handshake) began: a request
/// or a QUIC handshake that timed out began a client timeout earlier. Over UDP nothing says
/// that an Envoy went: a QUIC request or Initial sent to a frozen or killed Envoy hears
/// nothing, and the client's retransmissions back off (0.2 s doubling), so a handshake begun
/// in a fault's window may time out seconds after something serves again.
fn began_before(reason: &str) -> Duration {
    if reason.starts_with("timeout") || reason.starts_with("connect: TimeoutError") {
        CLIENT_TIMEOUT
    } else {
        Duration::ZERO
    }
}

impl Checker {
    /// Looks every [`TICK`] until the run ends or an invariant breaks.
    pub(crate) async fn run(self) {
        let mut load_seen = 0usize;
        let mut clients_seen = vec![0usize; self.clients.len()];
        let mut last_status = Instant::now();
        let mut last_resources = Instant::now() - RESOURCES_EVERY;
        loop {
            tokio::time::sleep(TICK).await;
            if self.shared.state().ending || self.shared.failed() {
                return;
            }
            let target = self.shared.target();
            // Before anything that would only say "no answer": an agent gone is named as such
            // (e.g. `crash_loop` with --crash-restart-limit 5: its exit event is in the log).
            if !envoy_agent_tests::process_alive(target.pid) {
                if self.shared.target().pid == target.pid && !self.shared.state().ending {
                    self.shared.fail(
                        "agent_runs",
                        &format!(
                            "the agent (pid {}) exited before the end: its `exit` event in the \
                             agents' log says how",
                            target.pid
                        ),
                    );
                }
                return;
            }
            self.generations();
            load_seen = self.load_failures(load_seen);
            for (i, seen) in clients_seen.iter_mut().enumerate() {
                *seen = self.client_failures(i, *seen);
            }
            self.readiness(&target).await;
            if last_status.elapsed() >= STATUS_EVERY {
                last_status = Instant::now();
                self.status(&target).await;
            }
            if last_resources.elapsed() >= RESOURCES_EVERY {
                last_resources = Instant::now();
                self.resources(&target);
            }
        }
    }

    /// Never three generations (a sidecar: never two Envoys).
    fn generations(&self) {
        let envoys = envoys(&self.marker);
        if envoys.len() > self.generations {
            self.shared.fail(
                "too_many_generations",
                &format!(
                    "{} Envoy processes at once (at most {}): {envoys:?}",
                    envoys.len(),
                    self.generations
                ),
            );
        }
    }

    fn load_failures(&self, seen: usize) -> usize {
        let (times, errors) = self.load.failures_so_far();
        for t in times.iter().skip(seen) {
            self.judge_failure(*t, &format!("HTTP/1.1 load (first errors: {errors:?})"));
        }
        times.len()
    }

    /// Client `i`'s failures after the first `seen` are judged; a client that exited before
    /// the end breaks `clients_run`. Returns how many it reported.
    fn client_failures(&self, i: usize, seen: usize) -> usize {
        let (name, client) = &self.clients[i];
        let failures: Vec<(f64, String)> = client
            .events()
            .into_iter()
            .filter_map(|e| match e.kind {
                ClientKind::Failure { reason, .. } => Some((e.t, reason)),
                _ => None,
            })
            .collect();
        for (t, reason) in failures.iter().skip(seen) {
            let sent = t - began_before(reason).as_secs_f64();
            self.judge_failure((sent * 1000.0) as u64, &format!("{name}: {reason}"));
        }
        if client.ended() && !self.shared.state().ending {
            self.shared.fail(
                "clients_run",
                &format!(
                    "the {name} client exited before the end: {}",
                    client.describe()
                ),
            );
        }
        failures.len()
    }

    /// A failure at `t` (Unix ms) must lie in a window a fault opened.
    fn judge_failure(&self, t: u64, what: &str) {
        let inside = {
            let mut state = self.shared.state();
            let window = state.windows.iter_mut().find(|w| {
                w.opened <= t
                    && w.closed.is_none_or(|c| t <= c + WINDOW_GRACE_MS)
                    && w.only.is_none_or(|client| what.starts_with(client))
            });
            match window {
                Some(w) => {
                    w.failures += 1;
                    true
                }
                None => false,
            }
        };
        if !inside {
            self.shared.fail(
                "failed_request",
                &format!("a request failed at unix ms {t}, outside every fault's window: {what}"),
            );
        }
    }

    /// Readiness answers within its bound, and says 200 only while the listener serves.
    async fn readiness(&self, target: &Target) {
        let before = self.shared.state().events_started;
        let freezes = self.shared.freezes();
        let ready = tokio::time::timeout(
            READY_BOUND,
            envoy_agent_tests::http_get(target.status, "/healthz/ready"),
        )
        .await;
        if !self.shared.agent_judgeable(freezes) {
            return;
        }
        let status = match ready {
            Err(_) => {
                // The target may just have changed (a successor pod), or the run be ending.
                if self.shared.target().pid == target.pid && !self.shared.state().ending {
                    self.shared.fail(
                        "readiness_answers",
                        &format!("/healthz/ready did not answer within {READY_BOUND:?}"),
                    );
                }
                return;
            }
            Ok(Err(e)) => {
                if self.shared.target().pid == target.pid && !self.shared.state().ending {
                    self.shared
                        .fail("readiness_answers", &format!("/healthz/ready: {e}"));
                }
                return;
            }
            Ok(Ok(r)) => r.status,
        };
        if status != 200 {
            return;
        }
        let mut answer = Ok(());
        for listener in &self.listeners {
            answer = answer.and(self::answer(*listener, SERVE_BOUND).await);
        }
        let state = self.shared.state();
        let judged = state.events_started == before
            && state.serve_check_off == 0
            && state
                .serve_check_off_until
                .is_none_or(|u| Instant::now() >= u)
            && state.windows.iter().all(|w| w.closed.is_some())
            && !state.ending
            && state.target.pid == target.pid;
        drop(state);
        if let (true, Err(e)) = (judged, answer) {
            self.shared.fail(
                "ready_but_not_serving",
                &format!("/healthz/ready said 200 but a request to the listener failed: {e}"),
            );
        }
    }

    /// `envoy-agent status` answers within its bound.
    async fn status(&self, target: &Target) {
        let freezes = self.shared.freezes();
        let run = tokio::process::Command::new(&self.agent_binary)
            .args(["--grpc-address", &target.grpc, "status"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .output();
        let outcome = tokio::time::timeout(STATUS_BOUND, run).await;
        if self.shared.target().pid != target.pid
            || self.shared.state().ending
            || !self.shared.agent_judgeable(freezes)
        {
            return;
        }
        match outcome {
            Err(_) => self.shared.fail(
                "status_answers",
                &format!("`envoy-agent status` did not answer within {STATUS_BOUND:?}"),
            ),
            Ok(Err(e)) => self
                .shared
                .fail("status_answers", &format!("`envoy-agent status`: {e}")),
            Ok(Ok(out)) if !out.status.success() => self.shared.fail(
                "status_answers",
                &format!(
                    "`envoy-agent status` failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ),
            Ok(Ok(_)) => {}
        }
    }

    /// The agent's RSS and open files stay within a bound of the warm-up's.
    fn resources(&self, target: &Target) {
        let Some(sample) = footprint(target.pid) else {
            return;
        };
        let warm = target.since.elapsed() < WARM_UP;
        let broken = {
            let mut state = self.shared.state();
            if state.target.pid != target.pid || state.flooding {
                return;
            }
            let r = &mut state.resources;
            r.last = sample;
            if warm {
                r.base = (r.base.0.max(sample.0), r.base.1.max(sample.1));
                None
            } else {
                r.max = (r.max.0.max(sample.0), r.max.1.max(sample.1));
                let rss_bound = r.base.0 + RSS_GROWTH_KIB.max(r.base.0 / 2);
                let fd_bound = r.base.1 + FD_GROWTH;
                (sample.0 > rss_bound || sample.1 > fd_bound).then(|| {
                    format!(
                        "RSS {} KiB (bound {rss_bound}), open files {} (bound {fd_bound}); \
                         after the warm-up: RSS {} KiB, {} files",
                        sample.0, sample.1, r.base.0, r.base.1
                    )
                })
            }
        };
        if let Some(details) = broken {
            self.shared.fail("footprint_flat", &details);
        }
    }
}

/// Whether a request to the listener is answered 200 within a second (polled while waiting
/// for a fault's window to close).
pub(crate) async fn serves(listener: SocketAddr) -> bool {
    answer(listener, Duration::from_secs(1)).await.is_ok()
}

/// A request to the listener, answered 200 within `bound`, or why not.
async fn answer(listener: SocketAddr, bound: Duration) -> Result<(), String> {
    match tokio::time::timeout(bound, envoy_agent_tests::http_get(listener, "/")).await {
        Ok(Ok(r)) if r.status == 200 => Ok(()),
        Ok(Ok(r)) => Err(format!("answered {}", r.status)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {bound:?}")),
    }
}

/// Whether readiness says 200 within a second.
pub(crate) async fn ready(status: SocketAddr) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(1),
            envoy_agent_tests::http_get(status, "/healthz/ready")
        )
        .await,
        Ok(Ok(r)) if r.status == 200
    )
}

/// An Envoy process of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EnvoyProc {
    pub(crate) pid: u32,
    /// Its `--restart-epoch` (0 without hot restart).
    pub(crate) epoch: u32,
}

/// Every running Envoy whose command line mentions `marker` (the run's dir), oldest epoch
/// first: pre-flight runs (`--mode validate`, `--hot-restart-version`) are not Envoys that
/// serve, and zombies are gone already.
pub(crate) fn envoys(marker: &str) -> Vec<EnvoyProc> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() != "envoy" {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let ours = args.iter().any(|a| a.contains(marker));
        let preflight = args
            .iter()
            .any(|a| a == "validate" || a == "--hot-restart-version");
        if !ours || preflight || !envoy_agent_tests::process_alive(pid) {
            continue;
        }
        let epoch = args
            .iter()
            .position(|a| a == "--restart-epoch")
            .and_then(|i| args.get(i + 1))
            .and_then(|e| e.parse().ok())
            .unwrap_or(0);
        found.push(EnvoyProc { pid, epoch });
    }
    found.sort_by_key(|e| (e.epoch, e.pid));
    found
}

/// A process's RSS (KiB) and open files.
pub(crate) fn footprint(pid: u32) -> Option<(u64, usize)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    Some((rss, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_out_request_or_handshake_is_judged_when_it_began() {
        // As h3_client.py words them.
        assert_eq!(began_before("timeout None"), CLIENT_TIMEOUT);
        assert_eq!(began_before("connect: TimeoutError "), CLIENT_TIMEOUT);
        assert_eq!(
            began_before("connect: ConnectionRefusedError [Errno 111]"),
            Duration::ZERO
        );
        assert_eq!(began_before("stream reset 258"), Duration::ZERO);
    }
}

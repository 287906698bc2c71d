//! A fake [`Host`] for the supervisor's unit tests: a small world of fake Envoy processes, a
//! shared admin port, a node directory and a lock, all under the test's control and paused
//! time. It behaves as Envoy does where the supervisor's decisions depend on it: SIGKILL kills
//! one process, SIGTERM exits 0 and also terminates a living parent (Envoy's handler does),
//! a process's exit frees the admin port if it held it, and a stand-in cannot bind the names of
//! a process that still lives.

use std::collections::{BTreeMap, VecDeque};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use envoy_agent_proxy::admin::AdminState;
use envoy_agent_proxy::preflight::PreflightError;
use envoy_agent_proxy::{
    AdminError, DrainPlan, Exit, ProxyError, Scope, ServerInfo, ServerState, Signal,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::host::{
    Checked, CleanupError, Guard, Host, Refusal, Repair, Spawned, Task, VersionError,
};
use crate::node::{Heartbeat, Rejected};
use crate::shm::ShmError;

/// What answers on the family's admin port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admin {
    /// Nothing listens.
    Refused,
    /// Something accepts and never answers (a stopped Envoy).
    Silent,
    /// ... and the caller gives up after this long (an answer that comes late).
    SilentFor(Duration),
    /// The agent cannot even open a connection: it is out of descriptors (EMFILE).
    AgentOutOfFiles,
    /// An Envoy at this epoch and state, of this base id, up this long.
    Answers {
        epoch: u32,
        state: ServerState,
        base_id: u64,
        version: String,
        uptime: Duration,
    },
}

#[derive(Debug)]
struct Process {
    /// The base id it runs under.
    family: u64,
    epoch: u32,
    alive: bool,
    control: mpsc::UnboundedSender<ExitStatus>,
}

/// Everything the fake world knows; tests read and steer it.
#[derive(Debug)]
pub(crate) struct World {
    pub(crate) base_id: u64,
    next_pid: u32,
    processes: BTreeMap<u32, Process>,
    pub(crate) admin: Admin,
    /// A spawned process answers LIVE on the admin port this long after it starts (if alive
    /// and the port is free or held by its parent); `None`: only when the test says so.
    pub(crate) live_after: Option<Duration>,
    /// A spawned process's admin listener is bound this long before it is LIVE (and the
    /// supervisor is told); `None`: no such sign.
    pub(crate) admin_bound_before_live: Option<Duration>,
    /// What the answering Envoy has of its control plane, as Envoy's stats text without the
    /// epoch line (the answering epoch's is added); empty: a static bootstrap.
    pub(crate) xds: String,
    /// How often [`Host::xds`] was asked.
    pub(crate) xds_asks: u32,
    /// How long a reading takes (Envoy visits every stat: long on a large config).
    pub(crate) xds_delay: Duration,
    /// The family's hot-restart channel.
    pub(crate) socket_path: envoy_agent_proxy::SocketPath,
    /// How long a LIVE check takes to answer (an Envoy busy initializing): the answer is
    /// what the admin port said when asked.
    pub(crate) live_check_delay: Duration,
    /// When each LIVE check was sent, and whether over a kept connection.
    pub(crate) live_checks_sent: Vec<(Instant, bool)>,
    /// Whether pre-flights are answered from the cache (no exec, no time), as the real host's
    /// are for a binary and config it has seen.
    pub(crate) preflight_cached: bool,
    /// Answers of the next pre-flights (default: pass).
    pub(crate) preflights: VecDeque<Result<(), Refusal>>,
    /// What the family's shared memory check answers.
    pub(crate) shm: Result<(), String>,
    /// Whether a cold handover could learn the new family's admin address.
    pub(crate) cold_possible: bool,
    /// The admin of a cold handover's new family (its own ephemeral port).
    pub(crate) cold_admin: Admin,
    /// Whether the host reaches the family's admin at the cold family's port (after a cold
    /// handover, until a hot restart takes the configured one).
    pub(crate) target_cold: bool,
    /// Cold families spawned: their base ids.
    pub(crate) cold_spawns: Vec<u32>,
    /// Families switched to.
    pub(crate) switches: Vec<u32>,
    /// Each pre-flight's running version and whether it asked for validation, in order.
    pub(crate) preflight_calls: Vec<(Option<String>, bool)>,
    /// The hot-restart version a LIVE fake Envoy names on its admin.
    pub(crate) admin_version: String,
    /// How long `/server_info` takes to answer.
    pub(crate) server_info_delay: Duration,
    /// The binary's `--hot-restart-version` answer, and how often it was asked.
    pub(crate) version: Result<String, String>,
    pub(crate) version_asks: u32,
    /// Ahead-of-time validations asked: the content given, if any.
    pub(crate) prevalidations: Vec<Option<Vec<u8>>>,
    /// Whether the binary on disk changed (taken by the next look).
    pub(crate) binary_changed: bool,
    /// How many epochs were reported LIVE to the cache.
    pub(crate) passed_live: u32,
    /// Admin calls made: (`/server_info`, epoch stats, LIVE checks).
    pub(crate) admin_calls: (u32, u32, u32),
    /// How often a probe also asked the answering epoch's state (`/ready`).
    pub(crate) state_asks: u32,
    /// [`Host::newer_epoch`] calls over a kept connection.
    pub(crate) kept_asks: u32,
    pub(crate) spawns: Vec<u32>,
    /// When each of [`World::spawns`] was spawned.
    pub(crate) spawned_at: Vec<Instant>,
    /// Every signal the supervisor sent: (epoch, signal).
    pub(crate) signals: Vec<(u32, Signal)>,
    /// ... with the base id of the family it went to: (base id, epoch, signal).
    pub(crate) family_signals: Vec<(u64, u32, Signal)>,
    pub(crate) marker: bool,
    pub(crate) marker_writes: Vec<bool>,
    /// How often the family's files were removed ([`Host::remove_family_files`]).
    pub(crate) family_files_removed: u32,
    /// Processes that have exited but whose exit the supervisor has not been told of yet (the
    /// agent stopped or starved: a zombie not reaped yet).
    pub(crate) unreaped: std::collections::BTreeSet<u32>,
    pub(crate) node: bool,
    /// Other supervisors' heartbeats on the node.
    pub(crate) others: Vec<Heartbeat>,
    pub(crate) ours: Option<Heartbeat>,
    /// How often our unchanged heartbeat was touched instead of rewritten.
    pub(crate) touches: u32,
    pub(crate) heartbeat_writes: u32,
    pub(crate) lock_taken_by_other: bool,
    pub(crate) our_lock: bool,
    /// Epochs of another pod's Envoys that live (their socket names are taken).
    pub(crate) foreign_alive: Vec<u32>,
    pub(crate) stand_ins: Vec<u32>,
    /// Dead children stood in for, `(base id, epoch)`, while held.
    pub(crate) child_stand_ins: Vec<(u64, u32)>,
    pub(crate) released: Vec<u32>,
    pub(crate) initializing: bool,
    pub(crate) repairs: u32,
    /// The drains asked for: scope, skip_exit.
    pub(crate) drains: Vec<(Scope, bool)>,
    /// The drain notices given: family, epoch.
    pub(crate) told: Vec<(u32, u32)>,
    /// How many times the family's Envoy was told to fail its health checks.
    pub(crate) health_checks_failed: u32,
    /// Added to the wall clock: real wall and monotonic clocks disagree by a millisecond here
    /// and there (rounding, NTP slewing).
    pub(crate) wall_clock_step_ms: u64,
    start: Instant,
}

impl Default for World {
    fn default() -> Self {
        World {
            base_id: 7,
            next_pid: 100,
            processes: BTreeMap::new(),
            admin: Admin::Refused,
            live_after: Some(Duration::from_millis(50)),
            admin_bound_before_live: None,
            xds: String::new(),
            xds_asks: 0,
            xds_delay: Duration::ZERO,
            socket_path: envoy_agent_proxy::SocketPath::envoy_default(),
            live_check_delay: Duration::ZERO,
            live_checks_sent: Vec::new(),
            preflight_cached: false,
            preflights: VecDeque::new(),
            shm: Ok(()),
            cold_possible: true,
            cold_admin: Admin::Refused,
            target_cold: false,
            cold_spawns: Vec::new(),
            switches: Vec::new(),
            preflight_calls: Vec::new(),
            admin_version: "11.104".to_owned(),
            server_info_delay: Duration::ZERO,
            version: Ok("11.104".to_owned()),
            version_asks: 0,
            prevalidations: Vec::new(),
            binary_changed: false,
            passed_live: 0,
            admin_calls: (0, 0, 0),
            state_asks: 0,
            kept_asks: 0,
            spawns: Vec::new(),
            spawned_at: Vec::new(),
            signals: Vec::new(),
            family_signals: Vec::new(),
            marker: true,
            marker_writes: Vec::new(),
            family_files_removed: 0,
            unreaped: std::collections::BTreeSet::new(),
            node: false,
            others: Vec::new(),
            ours: None,
            touches: 0,
            heartbeat_writes: 0,
            lock_taken_by_other: false,
            our_lock: false,
            foreign_alive: Vec::new(),
            stand_ins: Vec::new(),
            child_stand_ins: Vec::new(),
            released: Vec::new(),
            initializing: false,
            repairs: 0,
            wall_clock_step_ms: 0,
            drains: Vec::new(),
            told: Vec::new(),
            health_checks_failed: 0,
            start: Instant::now(),
        }
    }
}

impl World {
    /// The admin port answers LIVE at `epoch` (of the family's base id and version).
    pub(crate) fn live(&mut self, epoch: u32) {
        self.admin = Admin::Answers {
            epoch,
            state: ServerState::Live,
            base_id: self.base_id,
            version: self.admin_version.clone(),
            uptime: Duration::ZERO,
        };
    }

    /// The admin the host reaches the family at.
    fn target(&self) -> &Admin {
        if self.target_cold {
            &self.cold_admin
        } else {
            &self.admin
        }
    }

    fn admin_epoch(&self) -> Option<u32> {
        match &self.admin {
            Admin::Answers { epoch, .. } => Some(*epoch),
            _ => None,
        }
    }

    /// The pid of our process at `epoch` (of the family the host serves now), if it lives.
    pub(crate) fn pid_of(&self, epoch: u32) -> Option<u32> {
        self.processes
            .iter()
            .find(|(_, p)| p.family == self.base_id && p.epoch == epoch && p.alive)
            .map(|(pid, _)| *pid)
    }

    /// Whether our process at `epoch` lives (of the family the host serves now).
    pub(crate) fn alive(&self, epoch: u32) -> bool {
        self.alive_in(self.base_id, epoch)
    }

    /// Whether the process at `epoch` of the family under `base_id` lives.
    pub(crate) fn alive_in(&self, base_id: u64, epoch: u32) -> bool {
        self.processes
            .values()
            .any(|p| p.family == base_id && p.epoch == epoch && p.alive)
    }

    /// Makes our process at `epoch` exit with `status` (a crash, a kill from outside).
    pub(crate) fn exit(&mut self, epoch: u32, status: ExitStatus) {
        self.exit_in(self.base_id, epoch, status);
    }

    /// Makes the process at `epoch` of the family under `base_id` exit with `status`.
    pub(crate) fn exit_in(&mut self, base_id: u64, epoch: u32, status: ExitStatus) {
        if let Some(p) = self
            .processes
            .values()
            .find(|p| p.family == base_id && p.epoch == epoch && p.alive)
        {
            let _ = p.control.send(status);
        }
    }

    /// Signals sent to `epoch`.
    pub(crate) fn signals_to(&self, epoch: u32) -> Vec<Signal> {
        self.signals
            .iter()
            .filter(|(e, _)| *e == epoch)
            .map(|(_, s)| *s)
            .collect()
    }

    fn died(&mut self, pid: u32) {
        let Some(p) = self.processes.get_mut(&pid) else {
            return;
        };
        p.alive = false;
        let (epoch, family) = (p.epoch, p.family);
        let holds = |admin: &Admin| matches!(admin, Admin::Answers { epoch: e, base_id, .. } if *e == epoch && *base_id == family);
        if holds(&self.admin) {
            self.admin = Admin::Refused;
        }
        if holds(&self.cold_admin) {
            self.cold_admin = Admin::Refused;
        }
    }
}

/// The fake host; clones share one world.
#[derive(Debug, Clone, Default)]
pub(crate) struct FakeHost {
    world: Arc<Mutex<World>>,
}

impl FakeHost {
    pub(crate) fn world(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the fake admin port answers: (epoch, state, base id, version, uptime), or the error.
async fn answer(
    admin: Admin,
    endpoint: &str,
) -> Result<(u32, ServerState, u64, String, Duration), AdminError> {
    let addr =
        envoy_agent_proxy::admin::Address::Tcp(std::net::SocketAddr::from(([127, 0, 0, 1], 9901)));
    match admin {
        Admin::Refused => Err(AdminError::Connect {
            addr: addr.clone(),
            endpoint: endpoint.to_owned(),
            source: std::io::ErrorKind::ConnectionRefused.into(),
        }),
        Admin::Silent => {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Err(AdminError::Timeout {
                addr: addr.clone(),
                endpoint: endpoint.to_owned(),
                timeout: Duration::from_secs(2),
            })
        }
        Admin::SilentFor(timeout) => {
            tokio::time::sleep(timeout).await;
            Err(AdminError::Timeout {
                addr: addr.clone(),
                endpoint: endpoint.to_owned(),
                timeout,
            })
        }
        Admin::AgentOutOfFiles => Err(AdminError::Connect {
            addr,
            endpoint: endpoint.to_owned(),
            source: std::io::Error::from_raw_os_error(nix::libc::EMFILE),
        }),
        Admin::Answers {
            epoch,
            state,
            base_id,
            version,
            uptime,
        } => Ok((epoch, state, base_id, version, uptime)),
    }
}

/// What a LIVE check of `admin` answers: who, when it is LIVE.
async fn live_answer(admin: Admin) -> Result<Option<AdminState>, AdminError> {
    answer(admin, "/ready")
        .await
        .map(|(epoch, state, _, _, uptime)| {
            (state == ServerState::Live).then_some(AdminState {
                epoch,
                state,
                uptime: Some(uptime),
            })
        })
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

pub(crate) fn code(code: i32) -> ExitStatus {
    ExitStatus::from_raw(code << 8)
}

pub(crate) fn killed(signal: i32) -> ExitStatus {
    ExitStatus::from_raw(signal)
}

struct LockGuard(Arc<Mutex<World>>);

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Ok(mut w) = self.0.lock() {
            w.our_lock = false;
        }
    }
}

struct StandInGuard(Arc<Mutex<World>>, u32);

impl Drop for StandInGuard {
    fn drop(&mut self) {
        if let Ok(mut w) = self.0.lock() {
            w.released.push(self.1);
        }
    }
}

/// Held while a dead child is stood in for: dropped, it leaves `child_stand_ins`.
struct ChildStandInGuard(Arc<Mutex<World>>, (u64, u32));

impl Drop for ChildStandInGuard {
    fn drop(&mut self) {
        if let Ok(mut w) = self.0.lock() {
            w.child_stand_ins.retain(|held| *held != self.1);
        }
    }
}

impl FakeHost {
    /// An info call (`/server_info`, `/hot_restart_version`): counted, after the world's
    /// `server_info_delay`, answered as the world's admin target says.
    fn info_call(
        &self,
        endpoint: &'static str,
    ) -> impl Future<Output = Result<(u32, ServerState, u64, String, Duration), AdminError>> + use<>
    {
        let (admin, delay) = {
            let mut w = self.world();
            w.admin_calls.0 += 1;
            (w.target().clone(), w.server_info_delay)
        };
        async move {
            tokio::time::sleep(delay).await;
            answer(admin, endpoint).await
        }
    }

    /// A fake Envoy at `epoch`, of the family the host serves or (`cold`) of a new family
    /// under that base id.
    fn start(&self, epoch: u32, cold: Option<u32>) -> Spawned {
        let (signals, mut signal_rx) = mpsc::unbounded_channel::<Signal>();
        let (control, mut control_rx) = mpsc::unbounded_channel::<ExitStatus>();
        let (report, exit) = oneshot::channel();
        let pid = {
            let mut w = self.world();
            let pid = w.next_pid;
            w.next_pid += 1;
            match cold {
                Some(base_id) => w.cold_spawns.push(base_id),
                None => {
                    w.spawns.push(epoch);
                    w.spawned_at.push(Instant::now());
                }
            }
            let family = cold.map_or(w.base_id, u64::from);
            w.processes.insert(
                pid,
                Process {
                    family,
                    epoch,
                    alive: true,
                    control,
                },
            );
            pid
        };
        let family = cold.map_or(self.world().base_id, u64::from);
        let world = self.world.clone();
        let started = Instant::now();
        let live_after = self.world().live_after;
        let admin_bound = match (live_after, self.world().admin_bound_before_live) {
            _ if cold.is_some() => None,
            (Some(live), Some(lead)) if lead > live => {
                // A sign that never comes.
                let (_, rx) = oneshot::channel();
                Some(rx)
            }
            (Some(live), Some(lead)) => {
                let (tx, rx) = oneshot::channel();
                let world = self.world.clone();
                tokio::spawn(async move {
                    tokio::time::sleep_until(started + live.saturating_sub(lead)).await;
                    // As Envoy does: the child shuts its parent's admin listener and binds its
                    // own, which answers "not LIVE" until it is.
                    let mut w = world.lock().unwrap_or_else(|p| p.into_inner());
                    if w.admin_epoch().is_some_and(|e| e + 1 == epoch) {
                        w.live(epoch);
                        if let Admin::Answers { state, .. } = &mut w.admin {
                            *state = ServerState::Initializing;
                        }
                    }
                    let _ = tx.send(());
                });
                Some(rx)
            }
            _ => None,
        };
        tokio::spawn(async move {
            let mut live_at = live_after.map(|d| started + d);
            let status = loop {
                tokio::select! {
                    Some(status) = control_rx.recv() => break status,
                    Some(signal) = signal_rx.recv() => {
                        let mut w = world.lock().unwrap_or_else(|p| p.into_inner());
                        w.signals.push((epoch, signal));
                        w.family_signals.push((family, epoch, signal));
                        match signal {
                            Signal::SIGKILL => break killed(9),
                            Signal::SIGTERM | Signal::SIGINT => {
                                // Envoy's handler also terminates a living parent.
                                if epoch > 0 {
                                    w.exit_in(family, epoch - 1, code(0));
                                }
                                break code(0);
                            }
                            _ => {}
                        }
                    }
                    () = sleep_until(live_at) => {
                        live_at = None;
                        let mut w = world.lock().unwrap_or_else(|p| p.into_inner());
                        if cold.is_some() {
                            // Its own admin port: nothing stands in its way.
                            w.cold_admin = Admin::Answers {
                                epoch,
                                state: ServerState::Live,
                                base_id: family,
                                version: w.admin_version.clone(),
                                uptime: Duration::ZERO,
                            };
                            continue;
                        }
                        // LIVE once its parent's admin listener is ours (or none runs).
                        let free = match w.admin_epoch() {
                            None => matches!(w.admin, Admin::Refused),
                            // Its parent's, or already its own (bound before LIVE).
                            Some(e) => e + 1 == epoch || e == epoch,
                        };
                        if free {
                            w.live(epoch);
                        }
                    }
                }
            };
            world.lock().unwrap_or_else(|p| p.into_inner()).died(pid);
            let _ = report.send(Ok(Exit {
                pid,
                epoch,
                status,
                aborted: false,
                ran_for: started.elapsed(),
                stderr_tail: format!("fake envoy {epoch} ended\n"),
                oom: None,
            }));
        });
        Spawned {
            pid,
            signals,
            exit,
            admin_bound,
        }
    }
}

impl Host for FakeHost {
    async fn spawn(&self, epoch: u32) -> Result<Spawned, ProxyError> {
        Ok(self.start(epoch, None))
    }

    async fn spawn_cold(&self, base_id: u32) -> Result<Spawned, ProxyError> {
        Ok(self.start(0, Some(base_id)))
    }

    fn cold_live_check(&self, _base_id: u32) -> Task<Result<Option<AdminState>, AdminError>> {
        Box::pin(live_answer(self.world().cold_admin.clone()))
    }

    fn switch_family(&self, base_id: u32, cold: bool) {
        let mut w = self.world();
        if cold {
            w.switches.push(base_id);
        }
        w.base_id = u64::from(base_id);
        w.target_cold = cold;
    }

    fn cold_possible(&self) -> bool {
        self.world().cold_possible
    }

    fn admin_address(&self) -> Option<envoy_agent_proxy::admin::Address> {
        Some(std::net::SocketAddr::from(([127, 0, 0, 1], 9901)).into())
    }

    fn shm_usable(&self, _hot_restart_version: &str) -> Result<(), ShmError> {
        let w = self.world();
        w.shm.clone().map_err(|why| ShmError::Unusable {
            path: crate::shm::path(w.base_id as u32),
            why,
        })
    }

    fn server_info(&self) -> Task<Result<ServerInfo, AdminError>> {
        let ask = self.info_call("/server_info");
        Box::pin(async move {
            ask.await
                .map(|(epoch, state, base_id, version, _)| ServerInfo {
                    version: "fake".to_owned(),
                    state,
                    restart_epoch: epoch,
                    base_id,
                    hot_restart_version: version,
                    uptime_current_epoch: "0s".to_owned(),
                    socket_path: envoy_agent_proxy::SocketPath::envoy_default(),
                })
        })
    }

    fn serving_version(&self) -> Task<Result<String, AdminError>> {
        let ask = self.info_call("/hot_restart_version");
        Box::pin(async move {
            let (_, _, _, version, _) = ask.await?;
            if version.is_empty() {
                return Err(AdminError::Decode {
                    addr: std::net::SocketAddr::from(([127, 0, 0, 1], 9901)).into(),
                    endpoint: "/hot_restart_version".to_owned(),
                    message: "the answer names no hot-restart version".to_owned(),
                });
            }
            Ok(version)
        })
    }

    fn newer_epoch(
        &self,
        ours: Option<u32>,
        kept: bool,
    ) -> Task<Result<Option<AdminState>, AdminError>> {
        let (admin, world) = {
            let mut w = self.world();
            w.admin_calls.1 += 1;
            w.kept_asks += u32::from(kept);
            (w.target().clone(), self.world.clone())
        };
        Box::pin(async move {
            let (epoch, state, _, _, uptime) = answer(admin, "/stats").await?;
            if ours.is_some_and(|ours| epoch <= ours) {
                return Ok(None);
            }
            world.lock().unwrap_or_else(|p| p.into_inner()).state_asks += 1;
            Ok(Some(AdminState {
                epoch,
                state,
                uptime: Some(uptime),
            }))
        })
    }

    fn live_check(&self, bound: Option<u32>) -> Task<Result<Option<AdminState>, AdminError>> {
        let (admin, delay) = {
            let mut w = self.world();
            w.admin_calls.2 += 1;
            w.live_checks_sent.push((Instant::now(), bound.is_some()));
            (w.admin.clone(), w.live_check_delay)
        };
        Box::pin(async move {
            let answer = live_answer(admin).await;
            tokio::time::sleep(delay).await;
            answer
        })
    }

    fn xds(&self, cold: Option<u32>) -> Task<Result<envoy_agent_proxy::XdsReading, AdminError>> {
        let (admin, xds, delay) = {
            let mut w = self.world();
            w.xds_asks += 1;
            let admin = match cold {
                Some(_) => w.cold_admin.clone(),
                None => w.target().clone(),
            };
            (admin, w.xds.clone(), w.xds_delay)
        };
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            let (epoch, state, _, _, _) = answer(admin, "/stats").await?;
            let mut reading = envoy_agent_proxy::XdsReading::parse(&format!(
                "{xds}\nserver.hot_restart_epoch: {epoch}\n"
            ));
            reading.state = Some(state);
            Ok(reading)
        })
    }

    fn socket_path(&self) -> envoy_agent_proxy::SocketPath {
        self.world().socket_path.clone()
    }

    fn use_socket_path(&self, path: envoy_agent_proxy::SocketPath) {
        self.world().socket_path = path;
    }

    fn drain(&self, scope: Scope, skip_exit: bool) -> Task<Result<DrainPlan, AdminError>> {
        self.world().drains.push((scope, skip_exit));
        let plan = envoy_agent_proxy::listeners::plan(scope, false, Ok(Vec::new()));
        Box::pin(async move { Ok(plan) })
    }

    fn tell_drain(&self, base_id: u32, epoch: u32) {
        self.world().told.push((base_id, epoch));
    }

    fn fail_health_checks(&self) -> Task<Result<(), AdminError>> {
        self.world().health_checks_failed += 1;
        Box::pin(async { Ok(()) })
    }

    fn hot_restart_version(&self) -> Task<Result<String, VersionError>> {
        let answer = {
            let mut w = self.world();
            w.version_asks += 1;
            w.version.clone().map_err(|message| {
                VersionError::Preflight(PreflightError::Run {
                    binary: "envoy".into(),
                    what: "--hot-restart-version",
                    message,
                })
            })
        };
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            answer
        })
    }

    fn preflight(
        &self,
        running: Option<String>,
        validate: bool,
    ) -> Task<(Checked, Result<(), Refusal>)> {
        // Only a check that would exec the binary takes time.
        let mut execs = validate || running.is_some();
        let answer = {
            let mut w = self.world();
            execs &= !w.preflight_cached;
            w.preflight_calls.push((running, validate));
            w.preflights.pop_front().unwrap_or(Ok(()))
        };
        Box::pin(async move {
            if execs {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let checked = Checked {
                key: None,
                lookup: validate.then_some(crate::preflight_cache::Lookup::Miss),
            };
            (checked, answer)
        })
    }

    fn prevalidate(&self, content: Option<Vec<u8>>, _running: Option<String>) -> Task<()> {
        self.world().prevalidations.push(content);
        Box::pin(async {})
    }

    fn passed_live(&self, _checked: &Checked) {
        self.world().passed_live += 1;
    }

    fn binary_changed(&self) -> bool {
        std::mem::take(&mut self.world().binary_changed)
    }

    fn repair_initializing(&self, _version: &str) -> Repair {
        let mut w = self.world();
        w.repairs += 1;
        if std::mem::take(&mut w.initializing) {
            Repair::Cleared
        } else {
            Repair::Clean
        }
    }

    fn still_runs(&self, pid: u32) -> bool {
        let w = self.world();
        w.processes.get(&pid).is_some_and(|p| p.alive) && !w.unreaped.contains(&pid)
    }

    fn stand_in(&self, parent_epoch: u32) -> std::io::Result<Guard> {
        let mut w = self.world();
        if w.alive(parent_epoch) || w.foreign_alive.contains(&parent_epoch) {
            return Err(std::io::ErrorKind::AddrInUse.into());
        }
        w.stand_ins.push(parent_epoch);
        Ok(Box::new(StandInGuard(self.world.clone(), parent_epoch)))
    }

    fn stand_in_for_child(&self, child_epoch: u32) -> std::io::Result<Guard> {
        let mut w = self.world();
        if w.alive(child_epoch) {
            return Err(std::io::ErrorKind::AddrInUse.into());
        }
        let held = (w.base_id, child_epoch);
        w.child_stand_ins.push(held);
        Ok(Box::new(ChildStandInGuard(self.world.clone(), held)))
    }

    fn set_marker(&self, present: bool) -> std::io::Result<()> {
        let mut w = self.world();
        w.marker = present;
        w.marker_writes.push(present);
        Ok(())
    }

    fn has_node(&self) -> bool {
        self.world().node
    }

    fn read_heartbeats(&self, identity: &str) -> (Vec<Heartbeat>, Vec<Rejected>) {
        let w = self.world();
        let mut all = w.others.clone();
        all.extend(w.ours.clone());
        all.retain(|h| h.identity != identity);
        (all, Vec::new())
    }

    fn write_heartbeat(&self, heartbeat: &Heartbeat) -> std::io::Result<()> {
        let mut w = self.world();
        w.heartbeat_writes += 1;
        w.ours = Some(heartbeat.clone());
        Ok(())
    }

    fn touch_heartbeat(&self, _identity: &str) -> std::io::Result<()> {
        let now = self.now_unix_ms();
        let mut w = self.world();
        w.touches += 1;
        match &mut w.ours {
            Some(ours) => {
                ours.updated_unix_ms = now;
                Ok(())
            }
            None => Err(std::io::ErrorKind::NotFound.into()),
        }
    }

    fn remove_heartbeat(&self, _identity: &str) {
        self.world().ours = None;
    }

    fn try_lock(&self) -> std::io::Result<Option<Guard>> {
        let mut w = self.world();
        if w.lock_taken_by_other || w.our_lock {
            return Ok(None);
        }
        w.our_lock = true;
        Ok(Some(Box::new(LockGuard(self.world.clone()))))
    }

    fn remove_family_files(
        &self,
        _base_ids: &[u32],
    ) -> Result<Vec<std::path::PathBuf>, CleanupError> {
        let mut w = self.world();
        w.family_files_removed += 1;
        Ok(Vec::new())
    }

    fn now_unix_ms(&self) -> u64 {
        let w = self.world();
        1_000_000_000 + w.start.elapsed().as_millis() as u64 + w.wall_clock_step_ms
    }
}

//! The supervisor's seam to the world: spawning and signalling Envoy, its admin API, the
//! pre-flight checks, Envoy's shared memory and sockets, the readiness marker and the node's
//! state directory. [`RealHost`] does it for real; the unit tests use a fake, so that every
//! decision of the supervisor runs under paused time without a real Envoy.
//!
//! Calls that can take long (admin queries, pre-flight) return `'static` futures that the
//! supervisor runs beside its loop; the rest are quick and synchronous.
//!
//! The real host keeps pre-flight verdicts in a [`PreflightCache`] shared with the family's
//! config updates: a (binary, config) pair is validated once, and an epoch that reached LIVE
//! proves its pair good (see [`crate::preflight_cache`]).

use std::any::Any;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_agent_proxy::admin::AdminState;
use envoy_agent_proxy::preflight::{self, PreflightError};
use envoy_agent_proxy::{
    AdminClient, AdminError, DrainPlan, EnvoyProcess, Exit, KeptConnection, ProxyConfig,
    ProxyError, Scope, ServerInfo, Signal, SocketPath, XdsReading,
};
use tokio::sync::{mpsc, oneshot};

use crate::admin_files::AdminFiles;
use crate::node::{self, EpochLock, Heartbeat, Rejected};
use crate::preflight_cache::{FileId, Lookup, PairKey, PreflightCache};
use crate::shm::ShmError;

/// A future the supervisor runs beside its loop.
pub type Task<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Something held while it lives (a lock, bound sockets); dropping it releases it.
pub type Guard = Box<dyn Any + Send>;

/// A started Envoy process.
#[derive(Debug)]
pub struct Spawned {
    /// Its pid.
    pub pid: u32,
    /// Signals for it, delivered only while it has not been reaped.
    pub signals: mpsc::UnboundedSender<Signal>,
    /// Its exit, once reaped.
    pub exit: oneshot::Receiver<Result<Exit, ProxyError>>,
    /// Resolves once its admin listener is bound (LIVE is near); `None`: no such sign.
    pub admin_bound: Option<oneshot::Receiver<()>>,
}

/// What the stale-INITIALIZING repair found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// The flag was clear (or there is no segment): nothing to do.
    Clean,
    /// The flag was set and has been cleared.
    Cleared,
    /// The flag could not be checked or cleared; the segment was left untouched.
    Failed(String),
}

/// Why the binary's hot-restart version is not known ([`Host::hot_restart_version`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VersionError {
    /// The binary could not be looked at (to key the cache).
    #[error("cannot look at {}: {source}", binary.display())]
    Look {
        /// The binary.
        binary: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `--hot-restart-version` failed (its error names the binary and, where Envoy said why,
    /// Envoy's words).
    #[error(transparent)]
    Preflight(#[from] PreflightError),
}

/// Why the family's files were left in place ([`Host::remove_family_files`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CleanupError {
    /// Another agent holds the node's epoch lock (a starting successor pod, about to use them).
    #[error("another agent holds the node's epoch lock")]
    LockHeld,
    /// The node's epoch lock could not be taken.
    #[error("cannot take the node's epoch lock: {source}")]
    Lock {
        /// Why.
        source: std::io::Error,
    },
    /// An Envoy still answers on the family's admin address.
    #[error("something answers on the admin address {admin}")]
    AdminAnswers {
        /// The address.
        admin: envoy_agent_proxy::admin::Address,
    },
}

/// Why a pre-flight refuses a hot restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Envoy rejects the config, or it cannot be checked: nothing may start from it.
    Rejected(String),
    /// The config is good, but the binary cannot hot-restart from the running Envoy: it has
    /// another `--hot-restart-version` (`version`). Only a cold handover can switch to it.
    Incompatible {
        /// The binary's hot-restart version.
        version: String,
        /// In words, naming the binary and both versions.
        message: String,
    },
}

impl Refusal {
    /// The reason, in words.
    pub fn message(&self) -> &str {
        match self {
            Refusal::Rejected(m) | Refusal::Incompatible { message: m, .. } => m,
        }
    }
}

/// What a pre-flight did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checked {
    /// The (binary, config) pair the epoch starts with, when the files could be read: marked
    /// good once the epoch is LIVE.
    pub key: Option<PairKey>,
    /// Whether a check had to exec the binary; `None` when nothing needed checking.
    pub lookup: Option<Lookup>,
}

impl Checked {
    /// `hit`, `miss` or `none`, as in the `handoff` event.
    pub fn cache(&self) -> &'static str {
        self.lookup.map_or("none", Lookup::as_str)
    }
}

/// Everything the supervisor does outside its own memory.
pub trait Host: Send + Sync + 'static {
    /// Starts Envoy at `epoch`.
    fn spawn(&self, epoch: u32) -> impl Future<Output = Result<Spawned, ProxyError>> + Send;
    /// `/server_info` on the family's admin address, bounded (discovery: it alone names the
    /// base id and the hot-restart version of whoever answers).
    fn server_info(&self) -> Task<Result<ServerInfo, AdminError>>;
    /// The hot-restart version of whoever answers on the family's admin address, bounded
    /// (`/hot_restart_version`: the serving epoch's, in a few bytes).
    fn serving_version(&self) -> Task<Result<String, AdminError>>;
    /// Whether an epoch newer than `ours` answers on the family's admin address, and then its
    /// state; bounded and cheap (the watchdog asks every second, and other probes of a running
    /// family). `Ok(None)`: epoch `ours` or an older one answers, and its readiness decides
    /// nothing, so it is not asked (one request, not two). `ours` `None`: any epoch is newer.
    ///
    /// `kept`: asked over the connection the last such call kept while epoch `ours` answered
    /// it (`/ready` only: its process is known), renewed every [`KEPT_CONNECTION_RENEWAL`]
    /// (`/server_info` on a new one: who answers now). The watchdog's steady checks: a TCP
    /// handshake and teardown a second cost more than the question, and neither question
    /// costs Envoy more on a large config. A kept connection reaches the process that accepted
    /// it, so a takeover is seen over it only once it is renewed: no `kept` while a takeover
    /// is expected.
    fn newer_epoch(
        &self,
        ours: Option<u32>,
        kept: bool,
    ) -> Task<Result<Option<AdminState>, AdminError>>;
    /// Whether the admin address answers LIVE, and who: `None` while it is not LIVE. Asked
    /// every few milliseconds while an epoch starts. `bound`: this epoch is known to hold the
    /// address (its admin listener was bound after its parent's was shut), so `/ready` alone
    /// answers, over the connection of the previous such check of that epoch, kept while the
    /// answer was "not LIVE". Otherwise `/server_info` says who answers, in which state.
    fn live_check(&self, bound: Option<u32>) -> Task<Result<Option<AdminState>, AdminError>>;
    /// What whoever answers on the family's admin address has of its control plane (its epoch
    /// and xDS counters), bounded. Envoy visits every stat to answer: asked while readiness
    /// waits for a config, while a new epoch's start is long, and rarely otherwise.
    /// `cold`: of a cold handover's new family under that base id (at its own admin address;
    /// an empty reading until it is known).
    fn xds(&self, cold: Option<u32>) -> Task<Result<XdsReading, AdminError>>;
    /// `POST /drain_listeners` on the family's admin address, bounded: drains the serving
    /// epoch's listeners (`scope`, else the configured scope; which ones
    /// Envoy reports decides, see `envoy_agent_proxy::listeners::plan`).
    fn drain(&self, scope: Scope, skip_exit: bool) -> Task<Result<DrainPlan, AdminError>>;
    /// Tells the Envoy of epoch `epoch` of the family `base_id` that its drain began, through
    /// its drain-notice file (`envoy_agent_proxy::drain_notice`), where the notice is on.
    fn tell_drain(&self, base_id: u32, epoch: u32);
    /// `POST /healthcheck/fail` on the family's admin address, bounded.
    fn fail_health_checks(&self) -> Task<Result<(), AdminError>>;
    /// The binary's `--hot-restart-version` (known per binary identity once asked).
    fn hot_restart_version(&self) -> Task<Result<String, VersionError>>;
    /// Pre-flight for a new epoch: the binary's hot-restart version must be `running` (when one
    /// runs), and when `validate`, Envoy must accept the config. `Err` holds the reason, in
    /// Envoy's words; a config that is good for a binary of another hot-restart version is
    /// [`Refusal::Incompatible`]. Pairs already judged are answered without an exec.
    fn preflight(
        &self,
        running: Option<String>,
        validate: bool,
    ) -> Task<(Checked, Result<(), Refusal>)>;
    /// Whether the family's shared memory can take another epoch of `hot_restart_version`
    /// (present, with a header of that version); `Err` says why not.
    fn shm_usable(&self, hot_restart_version: &str) -> Result<(), ShmError>;
    /// Where a cold handover's new family could learn its admin address; `None`: no cold
    /// handover is possible (Envoy runs as another user and cannot write the agent's files).
    fn cold_possible(&self) -> bool;
    /// Starts epoch 0 of a new family under `base_id` beside the serving one (a cold
    /// handover): the same binary and config, its admin on an ephemeral port.
    fn spawn_cold(&self, base_id: u32) -> impl Future<Output = Result<Spawned, ProxyError>> + Send;
    /// [`Host::live_check`] of the cold family under `base_id` (not LIVE while its admin
    /// address is not known yet).
    fn cold_live_check(&self, base_id: u32) -> Task<Result<Option<AdminState>, AdminError>>;
    /// The family under `base_id` is the family from now on: it names the shared memory and
    /// sockets of the next epochs. `cold`: a cold handover's new family, whose admin is reached
    /// at its ephemeral address; else the configured address (a hot-restart epoch took it
    /// over).
    fn switch_family(&self, base_id: u32, cold: bool);
    /// Where the family's admin answers now (the configured address, but for a cold family's
    /// first epoch).
    fn admin_address(&self) -> Option<envoy_agent_proxy::admin::Address>;
    /// Validates ahead of a restart (a config still settling, given as `content`, or a new
    /// binary on disk), so that the restart finds the verdict ready. Errors are only logged.
    fn prevalidate(&self, content: Option<Vec<u8>>, running: Option<String>) -> Task<()>;
    /// An epoch reached LIVE after `checked`: its pair is good.
    fn passed_live(&self, checked: &Checked);
    /// Whether the binary on disk is another one than when last asked, or, the first time,
    /// than when the family was created (a release put over it): worth validating before
    /// anyone asks for a restart.
    fn binary_changed(&self) -> bool;
    /// Clears a stale INITIALIZING flag. Only called when no Envoy of the family initializes.
    fn repair_initializing(&self, hot_restart_version: &str) -> Repair;
    /// Whether process `pid` still runs: `false` once it is exiting or has exited, even before
    /// it is reaped (a zombie), so that a deadline judged late (the agent itself was stopped or
    /// starved) or a listener refusing does not blame a process whose exit is on its way.
    fn still_runs(&self, pid: u32) -> bool;
    /// Binds the hot-restart socket names of dead (or gone) `parent_epoch` and answers its
    /// child's requests. Fails while the parent still holds them.
    fn stand_in(&self, parent_epoch: u32) -> std::io::Result<Guard>;
    /// Binds the hot-restart socket names of dead `child_epoch` and drops what its parent
    /// (kept, draining) still sends there: the QUIC packets it forwards would otherwise block
    /// its main thread (see `absorber`). Fails while a living Envoy holds them.
    fn stand_in_for_child(&self, child_epoch: u32) -> std::io::Result<Guard>;
    /// Where the family's hot-restart channel is (a child must use its parent's).
    fn socket_path(&self) -> SocketPath;
    /// The family's channel is at `path` from now on: the predecessor's, taken over.
    fn use_socket_path(&self, path: SocketPath);
    /// Creates (`true`) or removes the readiness marker.
    fn set_marker(&self, present: bool) -> std::io::Result<()>;
    /// Whether the node has a state directory (cross-pod handoffs).
    fn has_node(&self) -> bool;
    /// Every heartbeat in the node's state directory but `identity`'s (this supervisor's
    /// own), and the files not trusted.
    fn read_heartbeats(&self, identity: &str) -> (Vec<Heartbeat>, Vec<Rejected>);
    /// Writes this supervisor's heartbeat.
    fn write_heartbeat(&self, heartbeat: &Heartbeat) -> std::io::Result<()>;
    /// Marks this supervisor's unchanged heartbeat as written now.
    fn touch_heartbeat(&self, identity: &str) -> std::io::Result<()>;
    /// Removes this supervisor's heartbeat (only its own).
    fn remove_heartbeat(&self, identity: &str);
    /// Takes the node's epoch lock if free.
    fn try_lock(&self) -> std::io::Result<Option<Guard>>;
    /// Removes what the families under `base_ids` (the configured one and the cold one: a
    /// crash recovery or a cold handover moves the family between them) leave behind once
    /// every Envoy is gone: the shared memory segments, the hot-restart channel's socket files
    /// and the admin socket. Under the node's epoch lock (a starting successor pod that holds
    /// it is about to use them) and only while nothing answers on the admin address. Returns
    /// what was removed, or why nothing was.
    fn remove_family_files(&self, base_ids: &[u32]) -> Result<Vec<PathBuf>, CleanupError>;
    /// Now, in Unix milliseconds (heartbeat times).
    fn now_unix_ms(&self) -> u64;
}

/// Which family the host serves, where its admin answers (a cold handover switches both) and
/// where its hot-restart channel is.
#[derive(Debug, Clone)]
struct Target {
    base_id: u32,
    admin: AdminClient,
    socket_path: SocketPath,
}

/// The real world.
#[derive(Debug, Clone)]
pub struct RealHost {
    proxy: ProxyConfig,
    /// The configured admin address's client.
    admin: AdminClient,
    target: Arc<Mutex<Target>>,
    state_dir: Option<PathBuf>,
    marker: Option<PathBuf>,
    cache: PreflightCache,
    /// The binary's identity when last looked at (first: when the host was made, before the
    /// first epoch starts from it).
    binary_seen: Arc<Mutex<Option<FileId>>>,
    /// The watch on the epochs' admin address files, set up at the first spawn.
    admin_files: Arc<std::sync::OnceLock<Option<AdminFiles>>>,
    /// The watchdog's admin connection, and the epoch that answered on it.
    kept: Arc<Mutex<(u32, KeptConnection)>>,
    /// The starting epoch's LIVE checks' admin connection (dropped at each spawn).
    live_kept: Arc<Mutex<KeptConnection>>,
    /// What the last look at the node's state directory found.
    last_look: Arc<Mutex<node::LastLook>>,
    /// The channel's short name (`<temp dir>/envoy-agent-hr-<uid>/<base id>`, a symlink of
    /// the agent's to the state dir's channel directory) and where it leads: removed with the
    /// family's files, made again before a spawn that finds it gone.
    channel_link: Option<(PathBuf, PathBuf)>,
}

impl RealHost {
    /// Envoy's uid when it runs as another user (the agent is root): a stand-in's file
    /// sockets are given to it, so that its Envoys can send there.
    fn envoy_owner(&self) -> Option<u32> {
        self.proxy
            .options
            .run_as
            .filter(|_| self.proxy.agent_is_root)
            .map(|r| r.uid)
    }

    /// The host for a family of `proxy`, reached at `admin`, keeping verdicts in `cache`.
    pub fn new(
        proxy: ProxyConfig,
        admin: AdminClient,
        base_id: u32,
        state_dir: Option<PathBuf>,
        marker: Option<PathBuf>,
        cache: PreflightCache,
    ) -> Self {
        // Not on the first watchdog tick, a second or more after the first epoch's LIVE: a
        // release put over the binary before then would become the baseline and never be
        // validated ahead of the restart.
        let binary_seen = FileId::of(&proxy.binary_path).ok();
        let channel_link = match configured_socket_path(&proxy) {
            SocketPath::File(prefix) => prefix.parent().and_then(|link| {
                let meta = std::fs::symlink_metadata(link).ok()?;
                let ours = meta.file_type().is_symlink()
                    && std::os::unix::fs::MetadataExt::uid(&meta)
                        == nix::unistd::geteuid().as_raw();
                let target = std::fs::read_link(link).ok()?;
                ours.then(|| (link.to_path_buf(), target))
            }),
            SocketPath::Abstract(_) => None,
        };
        RealHost {
            channel_link,
            target: Arc::new(Mutex::new(Target {
                base_id,
                admin: admin.clone(),
                socket_path: configured_socket_path(&proxy),
            })),
            proxy,
            admin,
            state_dir,
            marker,
            cache,
            binary_seen: Arc::new(Mutex::new(binary_seen)),
            admin_files: Arc::default(),
            kept: Arc::default(),
            live_kept: Arc::default(),
            last_look: Arc::default(),
        }
    }

    fn target(&self) -> Target {
        self.target
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn base_id(&self) -> u32 {
        self.target().base_id
    }

    /// The agent's private directory where Envoy writes its admin addresses, if it can.
    fn admin_address_dir(&self) -> Option<&std::path::Path> {
        self.proxy
            .hot_restart
            .as_ref()?
            .admin_address_dir
            .as_deref()
    }

    /// The file where the cold family under `base_id` writes its admin address.
    fn cold_admin_file(&self, base_id: u32) -> Option<PathBuf> {
        Some(
            self.admin_address_dir()?
                .join(format!("cold-admin-address.{base_id}")),
        )
    }

    /// The cold family's admin, once it wrote its address.
    fn cold_admin(&self, base_id: u32) -> Option<AdminClient> {
        let addr = envoy_agent_proxy::read_admin_file(&self.cold_admin_file(base_id)?)?;
        Some(self.admin.at(addr))
    }

    fn admin_files(&self) -> Option<&AdminFiles> {
        self.admin_files
            .get_or_init(|| {
                AdminFiles::watch(self.admin_address_dir()?)
                    .inspect_err(|e| {
                        tracing::warn!(error = %e, "no admin address hint: a starting epoch is asked whether it is LIVE every 50 ms");
                    })
                    .ok()
            })
            .as_ref()
    }
}

/// `binary`'s `--hot-restart-version` through `cache`.
async fn version_of(
    cache: &PreflightCache,
    binary: &std::path::Path,
    id: FileId,
) -> (Result<String, PreflightError>, Lookup) {
    cache
        .hot_restart_version(id, || preflight::hot_restart_version(binary))
        .await
}

/// The pre-flight behind [`Host::preflight`] and [`Host::prevalidate`]: `content`, when given,
/// stands for the bootstrap's bytes.
async fn check(
    proxy: &ProxyConfig,
    cache: &PreflightCache,
    content: Option<&[u8]>,
    running: Option<String>,
    validate: bool,
    warm: bool,
) -> (Checked, Result<(), Refusal>) {
    let key = match PairKey::of(proxy, content) {
        Ok(key) => key,
        Err(e) => return (Checked::default(), Err(Refusal::Rejected(e.to_string()))),
    };
    let versions = async {
        if running.is_none() && !warm {
            return (None, Ok(()));
        }
        let (version, lookup) = version_of(cache, &proxy.binary_path, key.binary).await;
        let result = match (version, &running) {
            (Err(e), _) => Err(Refusal::Rejected(e.to_string())),
            (Ok(version), Some(running)) if version != *running => Err(Refusal::Incompatible {
                message: format!(
                    "{} has hot-restart version {version}, the running envoy {running}: \
                     they cannot hot-restart",
                    proxy.binary_path.display()
                ),
                version,
            }),
            (Ok(_), _) => Ok(()),
        };
        (Some(lookup), result)
    };
    let validation = async {
        if !validate {
            return (None, Ok(()));
        }
        let (lookup, result) = match content {
            Some(bytes) => {
                match crate::preflight_cache::validate_candidate_cached(proxy, bytes, cache).await {
                    Ok(lookup) => (lookup, Ok(())),
                    Err(e) => (Lookup::Miss, Err(e.to_string())),
                }
            }
            None => {
                let (result, lookup) = cache
                    .validate(key, &proxy.config_path, || preflight::validate(proxy))
                    .await;
                let result = result.map_err(|e| match e {
                    PreflightError::Invalid { message, .. } => {
                        format!("envoy rejects {}: {message}", proxy.config_path.display())
                    }
                    other => other.to_string(),
                });
                (lookup, result)
            }
        };
        (Some(lookup), result)
    };
    // Both may exec the binary (~50-100 ms each): side by side, not one after the other.
    let ((version_lookup, version), (validate_lookup, validated)) =
        tokio::join!(versions, validation);
    let lookup = match (version_lookup, validate_lookup) {
        (Some(a), Some(b)) => Some(a.and(b)),
        (a, b) => a.or(b),
    };
    let checked = Checked {
        key: Some(key),
        lookup,
    };
    // A rejected config is the answer whatever the versions: it would not start either way.
    let result = match (version, validated) {
        (_, Err(rejected)) => Err(Refusal::Rejected(rejected)),
        (version, Ok(())) => version,
    };
    (checked, result)
}

/// A started Envoy, supervised (signals in, its exit out) by a task of its own.
/// Whether a process runs, by its `/proc/<pid>/stat`: `pid (comm) state ppid pgrp session
/// tty_nr tpgid flags ...` (the comm may hold spaces and parentheses). Not a zombie or dead,
/// nor on its way out (PF_EXITING: its descriptors closing, its listeners refusing, before it
/// is a zombie).
fn runs_by_stat(stat: &str) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next();
    let exiting = fields
        .nth(5)
        .and_then(|f| f.parse::<u64>().ok())
        .is_some_and(|flags| flags & PF_EXITING != 0);
    !exiting && !matches!(state, Some("Z" | "X" | "x") | None)
}

fn supervised(process: EnvoyProcess, admin_bound: Option<oneshot::Receiver<()>>) -> Spawned {
    let pid = process.pid();
    let (signals, receiver) = mpsc::unbounded_channel();
    let (report, exit) = oneshot::channel();
    tokio::spawn(async move {
        let _ = report.send(process.supervise(receiver).await);
    });
    Spawned {
        pid,
        signals,
        exit,
        admin_bound,
    }
}

/// Whether `admin` answers LIVE, and who (it may still be the parent's admin, or another
/// pod's): `/server_info`, one connection.
async fn live(admin: &AdminClient) -> Result<Option<AdminState>, AdminError> {
    admin.live_state().await
}

/// The readiness marker's contents.
const MARKER: &[u8] = b"ready\n";

/// How long the watchdog's kept admin connection is used before a new one is opened: the
/// longest a takeover nobody announced (no heartbeat: not an agent), or a serving epoch's
/// admin listener lost while it runs, can go unseen by the watchdog.
pub const KEPT_CONNECTION_RENEWAL: Duration = Duration::from_secs(5);

/// Bound on a drain call.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The channel a new family of `proxy` gets (Envoy's default without hot restart settings).
fn configured_socket_path(proxy: &ProxyConfig) -> SocketPath {
    proxy
        .hot_restart
        .as_ref()
        .map_or_else(SocketPath::envoy_default, |h| h.socket_path.clone())
}

impl Host for RealHost {
    async fn spawn(&self, epoch: u32) -> Result<Spawned, ProxyError> {
        // The family's files were removed when another run of it ended (its link with them):
        // the link is ours to make again, in the agent's own directory.
        if let Some((link, target)) = &self.channel_link
            && std::fs::symlink_metadata(link).is_err()
        {
            match std::os::unix::fs::symlink(target, link) {
                Ok(()) => {
                    tracing::info!(link = %link.display(), "made the hot-restart channel's link again")
                }
                Err(e) => {
                    tracing::warn!(link = %link.display(), error = %e, "cannot make the hot-restart channel's link again")
                }
            }
        }
        let mut proxy = self.proxy.clone();
        if let Some(hot) = &mut proxy.hot_restart {
            let target = self.target();
            hot.base_id = target.base_id;
            hot.socket_path = target.socket_path;
        }
        let admin_bound = self.admin_files().map(|files| files.expect(epoch));
        // The next LIVE checks are of this epoch, never over a connection to another.
        drop(std::mem::take(
            &mut *self.live_kept.lock().unwrap_or_else(|p| p.into_inner()),
        ));
        let process = match EnvoyProcess::spawn(&proxy, epoch).await {
            Ok(process) => process,
            Err(e) => {
                if let Some(files) = self.admin_files() {
                    files.forget(epoch);
                }
                return Err(e);
            }
        };
        Ok(supervised(process, admin_bound))
    }

    async fn spawn_cold(&self, base_id: u32) -> Result<Spawned, ProxyError> {
        let path = self
            .cold_admin_file(base_id)
            .ok_or_else(|| ProxyError::Unsupported("envoy runs as another user and cannot write its admin address where the agent reads it".to_owned()))?;
        if envoy_agent_proxy::args::sets(&self.proxy.extra_args, &["--config-yaml"]) {
            return Err(ProxyError::Unsupported("a --config-yaml of your own: envoy takes one overlay, and the new family needs one for its admin address".to_owned()));
        }
        // A previous cold family's address must not pass for this one's (its LIVE check
        // also wants an Envoy younger than this spawn).
        let _ = std::fs::remove_file(&path);
        let mut proxy = self.proxy.clone();
        if let Some(hot) = &mut proxy.hot_restart {
            hot.base_id = base_id;
            hot.ephemeral_admin = Some(path);
        }
        let process = EnvoyProcess::spawn(&proxy, 0).await?;
        Ok(supervised(process, None))
    }

    fn cold_live_check(&self, base_id: u32) -> Task<Result<Option<AdminState>, AdminError>> {
        let admin = self.cold_admin(base_id);
        Box::pin(async move {
            match admin {
                Some(admin) => live(&admin).await,
                None => Ok(None),
            }
        })
    }

    fn switch_family(&self, base_id: u32, cold: bool) {
        let admin = match cold {
            true => self.cold_admin(base_id),
            false => None,
        };
        let mut target = self.target.lock().unwrap_or_else(|p| p.into_inner());
        if target.base_id != base_id {
            // Another family: the configured channel (a cold family is started on it).
            target.socket_path = configured_socket_path(&self.proxy);
        }
        target.base_id = base_id;
        target.admin = admin.unwrap_or_else(|| self.admin.clone());
    }

    fn socket_path(&self) -> SocketPath {
        self.target().socket_path
    }

    fn use_socket_path(&self, path: SocketPath) {
        self.target
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .socket_path = path;
    }

    fn cold_possible(&self) -> bool {
        self.cold_admin_file(0).is_some()
    }

    fn admin_address(&self) -> Option<envoy_agent_proxy::admin::Address> {
        Some(self.target().admin.addr().clone())
    }

    fn shm_usable(&self, hot_restart_version: &str) -> Result<(), ShmError> {
        crate::shm::usable(&crate::shm::path(self.base_id()), hot_restart_version)
    }

    fn server_info(&self) -> Task<Result<ServerInfo, AdminError>> {
        let admin = self.target().admin;
        Box::pin(async move { admin.server_info().await })
    }

    fn serving_version(&self) -> Task<Result<String, AdminError>> {
        let admin = self.target().admin;
        Box::pin(async move { admin.hot_restart_version().await })
    }

    fn xds(&self, cold: Option<u32>) -> Task<Result<XdsReading, AdminError>> {
        let admin = match cold {
            None => Some(self.target().admin),
            Some(base_id) => self.cold_admin(base_id),
        };
        Box::pin(async move {
            match admin {
                Some(admin) => admin.xds().await,
                None => Ok(XdsReading::default()),
            }
        })
    }

    fn drain(&self, scope: Scope, skip_exit: bool) -> Task<Result<DrainPlan, AdminError>> {
        let admin = self.target().admin.with_timeout(DRAIN_TIMEOUT);
        let scope = match scope {
            Scope::Auto => self.proxy.options.drain_listeners,
            asked => asked,
        };
        let sidecar = self.proxy.sidecar;
        Box::pin(async move {
            envoy_agent_proxy::listeners::drain(&admin, scope, sidecar, skip_exit).await
        })
    }

    fn tell_drain(&self, base_id: u32, epoch: u32) {
        if let Some(dir) = &self.proxy.drain_notice {
            envoy_agent_proxy::drain_notice::tell_file(
                &envoy_agent_proxy::drain_notice::file_in(dir, base_id, epoch),
                epoch,
            );
        }
    }

    fn fail_health_checks(&self) -> Task<Result<(), AdminError>> {
        let admin = self.target().admin.with_timeout(DRAIN_TIMEOUT);
        Box::pin(async move {
            tracing::info!(admin = %admin.addr(), "failing envoy's health checks");
            admin.healthcheck_fail().await
        })
    }

    fn newer_epoch(
        &self,
        ours: Option<u32>,
        kept: bool,
    ) -> Task<Result<Option<AdminState>, AdminError>> {
        let admin = self.target().admin;
        let slot = self.kept.clone();
        Box::pin(async move {
            let state = match ours {
                Some(ours) if kept => {
                    // Taken out for the call (at most one watchdog check is in flight); put
                    // back only while our epoch answers on it.
                    let (epoch, mut connection) =
                        std::mem::take(&mut *slot.lock().unwrap_or_else(|p| p.into_inner()));
                    if epoch != ours {
                        connection = KeptConnection::default();
                    }
                    let state = admin
                        .state_kept(&mut connection, KEPT_CONNECTION_RENEWAL)
                        .await?;
                    if state.epoch == ours {
                        *slot.lock().unwrap_or_else(|p| p.into_inner()) = (ours, connection);
                    }
                    state
                }
                _ => admin.admin_state().await?,
            };
            Ok(Some(state).filter(|s| ours.is_none_or(|ours| s.epoch > ours)))
        })
    }

    fn live_check(&self, bound: Option<u32>) -> Task<Result<Option<AdminState>, AdminError>> {
        // A hot-restart epoch binds the configured address, also after a cold family's first
        // epoch answered on an ephemeral one.
        let admin = self.admin.clone();
        let Some(epoch) = bound else {
            return Box::pin(async move { live(&admin).await });
        };
        let slot = self.live_kept.clone();
        Box::pin(async move {
            // Taken out for the call (one LIVE check is in flight at a time); it comes back
            // holding a connection only after a "not LIVE".
            let mut connection =
                std::mem::take(&mut *slot.lock().unwrap_or_else(|p| p.into_inner()));
            let answer = admin.live_state_kept(&mut connection, epoch).await;
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = connection;
            answer
        })
    }

    fn hot_restart_version(&self) -> Task<Result<String, VersionError>> {
        let binary = self.proxy.binary_path.clone();
        let cache = self.cache.clone();
        Box::pin(async move {
            let id = match FileId::of(&binary) {
                Ok(id) => id,
                Err(source) => return Err(VersionError::Look { binary, source }),
            };
            Ok(version_of(&cache, &binary, id).await.0?)
        })
    }

    fn preflight(
        &self,
        running: Option<String>,
        validate: bool,
    ) -> Task<(Checked, Result<(), Refusal>)> {
        let proxy = self.proxy.clone();
        let cache = self.cache.clone();
        Box::pin(async move { check(&proxy, &cache, None, running, validate, false).await })
    }

    fn prevalidate(&self, content: Option<Vec<u8>>, running: Option<String>) -> Task<()> {
        let proxy = self.proxy.clone();
        let cache = self.cache.clone();
        Box::pin(async move {
            let started = std::time::Instant::now();
            let result = check(&proxy, &cache, content.as_deref(), running, true, true).await;
            match result {
                (checked, Ok(())) => tracing::info!(
                    event = "prevalidated",
                    cache = checked.cache(),
                    binary_inode = checked.key.map(|k| k.binary.inode()),
                    took = ?started.elapsed(),
                    "validated ahead of the restart"
                ),
                (checked, Err(refusal)) => tracing::warn!(
                    event = "prevalidated",
                    binary_inode = checked.key.map(|k| k.binary.inode()),
                    error = refusal.message(),
                    "validated ahead of the restart: the restart would be refused"
                ),
            }
        })
    }

    fn passed_live(&self, checked: &Checked) {
        if let Some(key) = checked.key {
            self.cache.mark_live(key);
        }
    }

    fn binary_changed(&self) -> bool {
        let Ok(now) = FileId::of(&self.proxy.binary_path) else {
            // Gone or mid-copy: the next look (or the restart's pre-flight) says more.
            return false;
        };
        let mut seen = self.binary_seen.lock().unwrap_or_else(|p| p.into_inner());
        let changed = seen.is_some_and(|s| s != now);
        *seen = Some(now);
        changed
    }

    fn repair_initializing(&self, hot_restart_version: &str) -> Repair {
        let path = crate::shm::path(self.base_id());
        if !path.exists() {
            return Repair::Clean;
        }
        match crate::shm::clear_initializing_at(&path, hot_restart_version) {
            Ok(true) => Repair::Cleared,
            Ok(false) => Repair::Clean,
            Err(e) => Repair::Failed(e.to_string()),
        }
    }

    fn still_runs(&self, pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| runs_by_stat(&stat))
    }

    fn stand_in(&self, parent_epoch: u32) -> std::io::Result<Guard> {
        let target = self.target();
        let owner = self.envoy_owner();
        crate::absorber::Absorber::bind(&target.socket_path, target.base_id, parent_epoch, owner)
            .map(|a| Box::new(a) as Guard)
    }

    fn stand_in_for_child(&self, child_epoch: u32) -> std::io::Result<Guard> {
        let target = self.target();
        crate::absorber::Absorber::bind_child(
            &target.socket_path,
            target.base_id,
            child_epoch,
            self.envoy_owner(),
        )
        .map(|a| Box::new(a) as Guard)
    }

    fn set_marker(&self, present: bool) -> std::io::Result<()> {
        let Some(marker) = &self.marker else {
            return Ok(());
        };
        if present {
            // Set again at every LIVE epoch: a marker already in place is left alone (a rename
            // over it costs the file system a new inode), one removed from outside is put back.
            let in_place = std::fs::symlink_metadata(marker)
                .is_ok_and(|m| m.is_file() && m.len() == MARKER.len() as u64);
            if in_place {
                return Ok(());
            }
            envoy_agent_proxy::replace_atomically(marker, MARKER)
        } else {
            match std::fs::remove_file(marker) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            }
        }
    }

    fn has_node(&self) -> bool {
        self.state_dir.is_some()
    }

    fn read_heartbeats(&self, identity: &str) -> (Vec<Heartbeat>, Vec<Rejected>) {
        match &self.state_dir {
            Some(dir) => {
                let mut last = self.last_look.lock().unwrap_or_else(|p| p.into_inner());
                node::read_others_since(dir, identity, &mut last)
            }
            None => (Vec::new(), Vec::new()),
        }
    }

    fn write_heartbeat(&self, heartbeat: &Heartbeat) -> std::io::Result<()> {
        match &self.state_dir {
            Some(dir) => node::write(dir, heartbeat),
            None => Ok(()),
        }
    }

    fn touch_heartbeat(&self, identity: &str) -> std::io::Result<()> {
        match &self.state_dir {
            Some(dir) => node::touch(dir, identity),
            None => Ok(()),
        }
    }

    fn remove_heartbeat(&self, identity: &str) {
        if let Some(dir) = &self.state_dir {
            node::remove(dir, identity);
        }
    }

    fn try_lock(&self) -> std::io::Result<Option<Guard>> {
        match &self.state_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                Ok(EpochLock::try_acquire(dir)?.map(|l| Box::new(l) as Guard))
            }
            None => Ok(Some(Box::new(()))),
        }
    }

    fn now_unix_ms(&self) -> u64 {
        node::unix_ms()
    }

    fn remove_family_files(&self, base_ids: &[u32]) -> Result<Vec<PathBuf>, CleanupError> {
        let _lock = match self.try_lock() {
            Ok(Some(lock)) => lock,
            Ok(None) => return Err(CleanupError::LockHeld),
            Err(source) => return Err(CleanupError::Lock { source }),
        };
        let target = self.target();
        let admin = target.admin.addr().clone();
        if answers(&admin) {
            return Err(CleanupError::AdminAnswers { admin });
        }
        let mut removed = Vec::new();
        let mut remove = |path: PathBuf| {
            if std::fs::remove_file(&path).is_ok() {
                removed.push(path);
            }
        };
        if let envoy_agent_proxy::admin::Address::Unix(path) = &admin
            && is_socket(path)
        {
            remove(path.clone());
        }
        let mut prefixes = vec![target.socket_path.clone()];
        let configured = configured_socket_path(&self.proxy);
        if !prefixes.contains(&configured) {
            prefixes.push(configured);
        }
        for base_id in base_ids {
            for prefix in &prefixes {
                let SocketPath::File(prefix) = prefix else {
                    continue;
                };
                // Every epoch's id is `base_id * 10 + epoch % 3`.
                for n in 0..3 {
                    let id = u64::from(*base_id) * 10 + n;
                    for role in ["parent", "child", "udp_parent", "udp_child"] {
                        let mut path = prefix.clone().into_os_string();
                        path.push(format!("_{role}_{id}"));
                        let path = PathBuf::from(path);
                        if is_socket(&path) {
                            remove(path);
                        }
                    }
                }
            }
            let segment = crate::shm::path(*base_id);
            if segment.is_file() {
                remove(segment);
            }
        }
        // The channel's short name, still leading to our channel directory (another agent of
        // the family would have re-pointed it): nothing of the family is left to bind through it.
        if let Some((link, target)) = &self.channel_link
            && std::fs::read_link(link).is_ok_and(|t| t == *target)
        {
            remove(link.clone());
        }
        Ok(removed)
    }
}

/// Whether `path` is a Unix socket (never follows a link: a link is not ours to remove).
fn is_socket(path: &std::path::Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// Whether something accepts a connection on `admin` (bounded: a loopback or local socket).
fn answers(admin: &envoy_agent_proxy::admin::Address) -> bool {
    match admin {
        envoy_agent_proxy::admin::Address::Tcp(addr) => {
            std::net::TcpStream::connect_timeout(addr, Duration::from_millis(500)).is_ok()
        }
        envoy_agent_proxy::admin::Address::Unix(path) => {
            std::os::unix::net::UnixStream::connect(path).is_ok()
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The stat line's state and flags: running, sleeping; a zombie, dead, or exiting (its
    /// listeners already refusing) does not run.
    #[test]
    fn a_process_runs_unless_its_stat_says_dead_zombie_or_exiting() {
        let stat = |state: &str, flags: u64| {
            format!("42 (envoy (main) x) {state} 1 42 42 0 -1 {flags} 100 0 0 0 5 3 0 0 20 0 8")
        };
        assert!(runs_by_stat(&stat("S", 0x400100)));
        assert!(runs_by_stat(&stat("R", 0x400040)));
        assert!(!runs_by_stat(&stat("R", 0x400044)), "PF_EXITING");
        assert!(!runs_by_stat(&stat("D", 0x4)), "PF_EXITING");
        assert!(!runs_by_stat(&stat("Z", 0x400104)));
        assert!(!runs_by_stat(&stat("X", 0)));
        assert!(!runs_by_stat(""));
    }

    /// A zombie (exited, not reaped) no longer runs; a running child does; a gone pid not.
    #[test]
    fn a_process_that_exited_unreaped_does_not_run() {
        let dir = std::env::temp_dir();
        let host = host_for(&dir.join("envoy"));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        assert!(host.still_runs(child.id()));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        // Not reaped: a zombie until `wait`.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while host.still_runs(child.id()) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!host.still_runs(child.id()), "a zombie is not running");
        assert!(std::path::Path::new(&format!("/proc/{}", child.id())).exists());
        child.wait().unwrap();
        assert!(!host.still_runs(child.id()));
    }

    fn host_for(binary: &std::path::Path) -> RealHost {
        let proxy = ProxyConfig::new(
            binary.to_owned(),
            binary.with_file_name("bootstrap.yaml"),
            envoy_agent_proxy::AdminAddress::Fixed(
                std::net::SocketAddr::from(([127, 0, 0, 1], 1)).into(),
            ),
        );
        RealHost::new(
            proxy,
            AdminClient::new(std::net::SocketAddr::from(([127, 0, 0, 1], 1))),
            1,
            None,
            None,
            PreflightCache::new(),
        )
    }

    /// Puts a new file at `path` the way a release is installed: renamed over it.
    fn release(path: &std::path::Path, contents: &str) {
        let next = path.with_extension("next");
        std::fs::write(&next, contents).unwrap();
        std::fs::rename(&next, path).unwrap();
    }

    #[test]
    fn a_binary_replaced_before_the_first_look_is_a_change() {
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("envoy");
        release(&binary, "old");
        let host = host_for(&binary);
        // Replaced right after the first epoch started, before anything looked again.
        release(&binary, "new release");
        assert!(host.binary_changed());
        assert!(!host.binary_changed(), "seen now");
        release(&binary, "newer release");
        assert!(host.binary_changed());
    }

    #[test]
    fn a_marker_in_place_is_left_alone_and_one_removed_is_put_back() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("envoy");
        release(&binary, "old");
        let marker = dir.path().join("ready");
        let host = RealHost {
            marker: Some(marker.clone()),
            ..host_for(&binary)
        };
        host.set_marker(true).unwrap();
        let inode = std::fs::metadata(&marker).unwrap().ino();
        host.set_marker(true).unwrap();
        assert_eq!(
            std::fs::metadata(&marker).unwrap().ino(),
            inode,
            "not rewritten"
        );
        std::fs::remove_file(&marker).unwrap();
        host.set_marker(true).unwrap();
        assert_eq!(std::fs::read(&marker).unwrap(), MARKER, "put back");
        // Truncated from outside: rewritten whole.
        std::fs::write(&marker, "").unwrap();
        host.set_marker(true).unwrap();
        assert_eq!(std::fs::read(&marker).unwrap(), MARKER);
        host.set_marker(false).unwrap();
        assert!(!marker.exists());
        host.set_marker(false).unwrap();
    }

    #[test]
    fn an_unchanged_binary_is_no_change() {
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("envoy");
        release(&binary, "old");
        let host = host_for(&binary);
        assert!(!host.binary_changed());
        assert!(!host.binary_changed());
    }
}

//! Turning `envoy-agent run`'s [`Settings`] into a [`ProxyConfig`], refusing bad input early
//! with one clear line (exit code [`exit_code::USAGE`]) instead of a failed Envoy start later:
//! the files and addresses the settings name (the flags themselves were checked when the
//! settings were made).

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use envoy_agent_proxy::admin::Address;
use envoy_agent_proxy::bootstrap::{self, BootstrapError};
use envoy_agent_proxy::{AdminAddress, ProxyConfig, SocketPath};

use crate::config::settings::{EnvoyAdmin, HotRestartSettings, Settings};
use crate::exit_code;

/// Input the agent cannot start with. Each maps to an exit code: see [`SetupError::exit_code`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// The bootstrap is missing, unreadable, not YAML/JSON, or has no admin address.
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    /// The Envoy binary is not there.
    #[error(
        "envoy binary {path:?} not found{where_}: install it with scripts/install-envoy.sh \
         and pass --envoy-path or set ENVOY_PATH"
    )]
    EnvoyNotFound {
        /// What was asked for.
        path: PathBuf,
        /// Where it was looked for.
        where_: String,
    },
    /// The Envoy path exists but cannot be executed.
    #[error("envoy binary {path} is not an executable file{why}")]
    EnvoyNotExecutable {
        /// The path.
        path: PathBuf,
        /// Why, when known (permissions for this user, a missing interpreter).
        why: String,
    },
    /// The status server would take Envoy's admin port: the first would answer for the second
    /// (a successor would wait to take over from it) or Envoy could not start.
    #[error(
        "--status-address {status} is Envoy's admin address {admin} (from --admin-address or \
         the bootstrap): give the agent's status server another port"
    )]
    StatusOnAdmin {
        /// The status server's address.
        status: SocketAddr,
        /// Envoy's admin address.
        admin: SocketAddr,
    },
    /// The metrics pipeline cannot be built.
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::TelemetryError),
    /// The hot-restart settings cannot work.
    #[error(transparent)]
    HotRestart(#[from] envoy_agent_hotrestart::ConfigError),
    /// An extra Envoy argument conflicts with what the agent manages.
    #[error("envoy argument {arg} needs a value")]
    MissingArgValue {
        /// The flag.
        arg: String,
    },
    /// An abstract hot-restart channel, not allowed.
    #[error(
        "--socket-path {path} (after --) is an abstract socket: any process on the node's \
         network could take Envoy's listeners or stop it through it. Leave it out (the agent \
         uses a private directory under --state-dir), give a file path in a directory only \
         this user can enter, or pass --allow-abstract-hot-restart-socket"
    )]
    AbstractChannel {
        /// What was given.
        path: String,
    },
    /// The hot-restart channel's (or the state) directory cannot be trusted or made.
    #[error("{what} {dir}: {why}")]
    PrivateDir {
        /// Which directory.
        what: &'static str,
        /// The directory.
        dir: PathBuf,
        /// Why.
        why: crate::trusted_dir::Untrusted,
    },
    /// The channel's socket names would not fit a Unix socket address.
    #[error(
        "hot-restart socket path {path} is too long: Envoy's names below it ({longest}) must fit \
         in 107 bytes; {fix}"
    )]
    ChannelTooLong {
        /// The prefix.
        path: PathBuf,
        /// Its longest name.
        longest: String,
        /// What to shorten.
        fix: &'static str,
    },
    /// Envoy's admin socket's path, or the one a cold handover's family uses beside it, would
    /// not fit a Unix socket address.
    #[error(
        "envoy's admin socket {longest} is {len} bytes, longer than a Unix socket address \
         takes (107): use a shorter temp dir (TMPDIR)"
    )]
    AdminSocketTooLong {
        /// The longest path.
        longest: String,
        /// Its length.
        len: usize,
    },
    /// The short link to the channel's directory cannot be made (`crate::config::channel_link`).
    #[error(transparent)]
    ChannelLink(#[from] crate::config::channel_link::LinkError),
    /// An extra Envoy argument would break what the agent guarantees.
    #[error("envoy argument {arg} (after --) cannot be passed through: {instead}")]
    RefusedArg {
        /// The flag.
        arg: String,
        /// Why, and what to use instead.
        instead: &'static str,
    },
}

/// Refuses extra Envoy arguments that would break a guarantee of the agent's.
pub fn check_extra_args(config: &ProxyConfig) -> Result<(), SetupError> {
    match envoy_agent_proxy::refused_extra_arg(config) {
        Some(refused) => Err(SetupError::RefusedArg {
            arg: refused.flag,
            instead: refused.instead,
        }),
        None => Ok(()),
    }
}

/// The hot-restart supervisor's settings: `hot` around `proxy`, and this agent's unique name
/// on the node.
pub fn family_config(
    hot: &HotRestartSettings,
    proxy: ProxyConfig,
) -> envoy_agent_hotrestart::Config {
    let mut config = envoy_agent_hotrestart::Config::new(proxy);
    config.options = hot.options.clone();
    config.state_dir = Some(hot.state_dir.clone());
    let name = hot
        .identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .filter(|s| !s.trim().is_empty());
    config.identity = envoy_agent_hotrestart::unique_identity(name.as_deref());
    config
}

impl SetupError {
    /// The exit code this error means: [`exit_code::USAGE`], what the user can fix in the
    /// command line or files. (A server's address that is busy, which may come free, is the
    /// server's own error: see [`crate::exit_code_of`].)
    pub fn exit_code(&self) -> u8 {
        exit_code::USAGE
    }
}

/// Finds the Envoy binary: a path with a `/` is taken as is, a bare name is looked up on PATH.
pub fn resolve_envoy(path: &Path, search_path: Option<&OsStr>) -> Result<PathBuf, SetupError> {
    if path.components().count() > 1 || path.is_absolute() {
        return check_executable(path)
            .map(|()| path.to_owned())
            .map_err(|problem| match problem {
                Problem::Missing => SetupError::EnvoyNotFound {
                    path: path.to_owned(),
                    where_: String::new(),
                },
                Problem::NotExecutable(why) => SetupError::EnvoyNotExecutable {
                    path: path.to_owned(),
                    why,
                },
            });
    }
    let dirs = search_path.map(std::env::split_paths).into_iter().flatten();
    for dir in dirs {
        let candidate = dir.join(path);
        if check_executable(&candidate).is_ok() {
            return Ok(candidate);
        }
    }
    Err(SetupError::EnvoyNotFound {
        path: path.to_owned(),
        where_: " on PATH".to_owned(),
    })
}

enum Problem {
    Missing,
    NotExecutable(String),
}

/// Whether this user can execute `path`: the kernel's answer (`access(X_OK)`, which knows
/// the user, the groups and the mount options), not the mode bits; and a script's
/// interpreter must exist, or exec fails with a "No such file" that names the script.
fn check_executable(path: &Path) -> Result<(), Problem> {
    let meta = std::fs::metadata(path).map_err(|_| Problem::Missing)?;
    if !meta.is_file() {
        return Err(Problem::NotExecutable(": not a regular file".to_owned()));
    }
    if let Err(errno) = nix::unistd::access(path, nix::unistd::AccessFlags::X_OK) {
        let user = nix::unistd::geteuid();
        return Err(Problem::NotExecutable(format!(
            ": uid {user} may not execute it ({errno}; mode {:o})",
            meta.permissions().mode() & 0o7777
        )));
    }
    if let Some(interpreter) = interpreter(path) {
        if !interpreter.exists() {
            return Err(Problem::NotExecutable(format!(
                ": it is a script whose interpreter {} does not exist",
                interpreter.display()
            )));
        }
    }
    Ok(())
}

/// The interpreter a `#!` script names, if `path` is one.
fn interpreter(path: &Path) -> Option<PathBuf> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(path).ok()?.read(&mut head).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let line = &line[..line.iter().position(|b| *b == b'\n').unwrap_or(line.len())];
    let text = String::from_utf8_lossy(line);
    text.split_whitespace().next().map(PathBuf::from)
}

/// Where the agent reaches Envoy's admin API, and the extra args with any
/// `--admin-address-path` taken out (the agent passes it itself, exactly once). With `socket`
/// (`--envoy-admin socket`), the agent's socket, whatever the bootstrap says (which may then
/// have no admin at all); the bootstrap's address it replaces comes back too, for the log.
pub fn resolve_admin(
    config_path: &Path,
    flag: Option<SocketAddr>,
    extra_args: &[String],
    runtime_dir: &Path,
    socket: Option<PathBuf>,
) -> Result<(AdminAddress, Vec<String>, Option<Address>), SetupError> {
    // The bootstrap must be readable whatever the flag says: Envoy needs it.
    let from_bootstrap = match bootstrap::admin_address(config_path) {
        Ok(addr) => Some(addr),
        Err(BootstrapError::NoAdmin { .. }) if flag.is_some() || socket.is_some() => None,
        Err(e) => return Err(e.into()),
    };
    let (user_path, rest) = take_admin_address_path(extra_args)?;
    if let Some(path) = socket {
        return Ok((AdminAddress::Socket(path), rest, from_bootstrap));
    }
    let addr = flag.map(Address::Tcp).or(from_bootstrap);
    let admin = match (addr, user_path) {
        (Some(addr), None) if addr.tcp().is_none_or(|a| a.port() != 0) => AdminAddress::Fixed(addr),
        (_, Some(path)) => AdminAddress::FromFile(path),
        (_, None) => AdminAddress::FromFile(runtime_dir.join("admin-address")),
    };
    Ok((admin, rest, None))
}

/// Where Envoy's admin socket goes with `--envoy-admin socket`: a node proxy's
/// `<temp dir>/envoy-agent-hr-<uid>/<base id>/envoy_admin_<base id>`, through the agent's link
/// to `<state dir>/hot-restart` (the channel's private directory; [`crate::config::channel_link`] says
/// why a link), so that every epoch, a cold handover's family and a successor pod reach the
/// same socket whatever path their state dir is mounted at; a sidecar's
/// `<runtime dir>/admin/envoy.sock` ([`admin_socket_dir`]). `None` without it. Refused when the
/// path (or the one a cold handover's family takes beside it) would not fit a socket address.
pub fn admin_socket(
    settings: &Settings,
    runtime_dir: &Path,
    temp_dir: &Path,
) -> Result<Option<PathBuf>, SetupError> {
    if settings.envoy.admin == EnvoyAdmin::Bootstrap {
        return Ok(None);
    }
    let (path, cold) = match &settings.hot_restart {
        Some(hot) => {
            let links =
                crate::config::channel_link::link_dir(temp_dir, nix::unistd::geteuid().as_raw());
            let link = crate::config::channel_link::link_path(&links, hot.base_id);
            let path = link.join(format!("envoy_admin_{}", hot.base_id));
            (path, hot.options.cold_base_id)
        }
        None => (admin_socket_dir(runtime_dir).join("envoy.sock"), None),
    };
    let longest = match cold {
        Some(base_id) => envoy_agent_proxy::ephemeral_socket(&path, base_id),
        None => path.clone(),
    };
    let len = longest.as_os_str().len();
    if len > 107 {
        return Err(SetupError::AdminSocketTooLong {
            longest: longest.display().to_string(),
            len,
        });
    }
    Ok(Some(path))
}

/// A sidecar's admin socket directory, in the agent's runtime directory: made by
/// [`make_admin_socket_dir`].
pub fn admin_socket_dir(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("admin")
}

/// Makes a sidecar's admin socket directory (its runtime directory must exist): 0700, Envoy's
/// when the agent is root and runs Envoy as another user (Envoy binds the socket there).
pub fn make_admin_socket_dir(settings: &Settings, runtime_dir: &Path) -> Result<(), SetupError> {
    let envoy_user = settings
        .envoy
        .options
        .run_as
        .map(|run_as| run_as.uid)
        .filter(|_| nix::unistd::geteuid().is_root());
    private_dir(
        "envoy admin socket directory",
        &admin_socket_dir(runtime_dir),
        0o700,
        envoy_user,
        true,
    )
}

/// Says at start who can reach Envoy's admin API: the agent's socket, or (a warning) a TCP
/// address any process of the network namespace can use to stop or steer Envoy.
pub fn log_admin(admin: &AdminAddress, replaced: Option<&Address>, node_proxy: bool) {
    let who = if node_proxy {
        "every process of the node's network namespace (with hostNetwork: every process on the node)"
    } else {
        "every process of the pod's network namespace (every container of the pod)"
    };
    match admin {
        AdminAddress::Socket(path) => tracing::info!(
            event = "envoy_admin",
            placement = "socket",
            path = %path.display(),
            replaced = replaced.map(tracing::field::display),
            "envoy's admin API is on the agent's socket: only the agent's user (and envoy's) can reach it"
        ),
        AdminAddress::Fixed(Address::Unix(path)) => tracing::info!(
            event = "envoy_admin",
            placement = "bootstrap",
            path = %path.display(),
            "envoy's admin API is on the bootstrap's socket: who can reach it is whom its directory and mode let in"
        ),
        AdminAddress::Fixed(Address::Tcp(addr)) => tracing::warn!(
            event = "envoy_admin_open",
            address = %addr,
            reachable_by = who,
            "envoy's admin API listens on TCP: {who} can stop or steer envoy through it (POST /quitquitquit, /drain_listeners, /healthcheck/fail); --envoy-admin socket puts it where only the agent reaches it"
        ),
        AdminAddress::FromFile(_) => tracing::warn!(
            event = "envoy_admin_open",
            address = "port 0 (envoy picks)",
            reachable_by = who,
            "envoy's admin API listens on TCP: {who} can stop or steer envoy through it (POST /quitquitquit, /drain_listeners, /healthcheck/fail); --envoy-admin socket puts it where only the agent reaches it"
        ),
    }
}

/// Refuses a status address on Envoy's admin port (the same address, or a wildcard on either
/// side). An admin address read from a file is only known once Envoy binds it.
pub fn check_status_address(status: SocketAddr, admin: &AdminAddress) -> Result<(), SetupError> {
    let AdminAddress::Fixed(Address::Tcp(admin)) = admin else {
        return Ok(());
    };
    let overlap =
        status.ip() == admin.ip() || status.ip().is_unspecified() || admin.ip().is_unspecified();
    if status.port() == admin.port() && overlap {
        return Err(SetupError::StatusOnAdmin {
            status,
            admin: *admin,
        });
    }
    Ok(())
}

fn take_admin_address_path(args: &[String]) -> Result<(Option<PathBuf>, Vec<String>), SetupError> {
    let (value, rest) = take_flag(args, "--admin-address-path")?;
    Ok((value.map(PathBuf::from), rest))
}

/// `flag`'s value among Envoy's extra arguments (`--flag V` or `--flag=V`; the last wins), and
/// the arguments without it.
fn take_flag(args: &[String], flag: &str) -> Result<(Option<String>, Vec<String>), SetupError> {
    let mut value = None;
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.iter();
    let prefix = format!("{flag}=");
    while let Some(arg) = it.next() {
        if arg == flag {
            let v = it.next().ok_or_else(|| SetupError::MissingArgValue {
                arg: flag.to_owned(),
            })?;
            value = Some(v.clone());
        } else if let Some(v) = arg.strip_prefix(&prefix) {
            value = Some(v.to_owned());
        } else {
            rest.push(arg.clone());
        }
    }
    Ok((value, rest))
}

/// Below this many descriptors the hard limit is worth a warning: a node proxy's clients, its
/// Envoy's and the agent's own connections share it.
const LOW_FD_LIMIT: u64 = 16_384;

/// Raises the soft limit on open files to the hard one (as Go's runtime does at start): 1024,
/// a common container default, is a limit a neighbour's idle connections can exhaust, after
/// which the agent cannot open a socket to Envoy or a file. Envoy inherits it. Logged, with a
/// warning when the hard limit is low; a failure only costs the raise.
pub fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    let raised = if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map(|()| hard)
    } else {
        Ok(soft)
    };
    match raised {
        Ok(limit) if limit < LOW_FD_LIMIT => tracing::warn!(
            event = "fd_limit",
            soft = limit,
            hard,
            was = soft,
            "the hard limit on open files is low ({hard}): raise it (LimitNOFILE=, the container runtime's nofile ulimit)"
        ),
        Ok(limit) if limit != soft => tracing::info!(
            event = "fd_limit",
            soft = limit,
            hard,
            was = soft,
            "raised the open-file limit"
        ),
        Ok(limit) => tracing::debug!(event = "fd_limit", soft = limit, hard, "open-file limit"),
        Err(e) => {
            tracing::warn!(event = "fd_limit", soft, hard, error = %e, "cannot raise the open-file limit")
        }
    }
}

/// The name of the hot-restart channel's directory under the state directory.
pub const CHANNEL_DIR: &str = "hot-restart";

/// The node proxy's hot-restart channel (who can reach it, and what it lets them do:
/// `docs/security.md#security-who-can-reach-what`): a user's own
/// `--socket-path` (taken out of `extra_args`: the agent passes it to every epoch, and its
/// stand-ins bind its names), else `<temp dir>/envoy-agent-hr-<uid>/<base id>/envoy`, through
/// the agent's symlink to `<state dir>/hot-restart` (why: [`crate::config::channel_link`]): files of
/// mode 600 in a directory only the agent's user (or, when the agent is root and runs Envoy as
/// another user, Envoy's) can enter. An abstract one only with
/// `--allow-abstract-hot-restart-socket`. Makes the state directory private too. Without hot
/// restart: Envoy's default, untouched.
pub fn hot_restart_channel(
    settings: &Settings,
    extra_args: Vec<String>,
    temp_dir: &Path,
) -> Result<(SocketPath, Vec<String>), SetupError> {
    let Some(hot) = &settings.hot_restart else {
        return Ok((SocketPath::envoy_default(), extra_args));
    };
    let state_dir = hot.state_dir.as_path();
    let envoy_user = settings
        .envoy
        .options
        .run_as
        .map(|run_as| run_as.uid)
        .filter(|_| nix::unistd::geteuid().is_root());
    // Envoy running as another user must traverse it to reach its channel's directory.
    let state_mode = if envoy_user.is_some() { 0o711 } else { 0o700 };
    private_dir("state directory", state_dir, state_mode, None, true)?;
    let (given, rest) = take_flag(&extra_args, "--socket-path")?;
    // Made whatever the channel's path: Envoy's admin socket lives there too
    // ([`admin_socket`]).
    let channel_dir = state_dir.join(CHANNEL_DIR);
    private_dir(
        "hot-restart socket directory",
        &channel_dir,
        0o700,
        envoy_user,
        true,
    )?;
    // Absolute and free of symlinks: the link is followed from another directory.
    let target = std::fs::canonicalize(&channel_dir).map_err(|error| SetupError::PrivateDir {
        what: "hot-restart socket directory",
        dir: channel_dir.clone(),
        why: crate::trusted_dir::Untrusted::Unreadable { error },
    })?;
    let links = crate::config::channel_link::link_dir(temp_dir, nix::unistd::geteuid().as_raw());
    // Ours alone, so that nobody else can plant the link's name; Envoy running as another user
    // must traverse it.
    private_dir("hot-restart link directory", &links, state_mode, None, true)?;
    let link = crate::config::channel_link::link_path(&links, hot.base_id);
    crate::config::channel_link::ensure(&link, &target)?;
    let path = match &given {
        Some(text) => SocketPath::parse(text),
        None => SocketPath::File(link.join("envoy")),
    };
    check_channel(&path, given.is_some(), hot, envoy_user)?;
    Ok((path, rest))
}

/// Refuses a hot-restart channel the family could not use: an abstract one unless allowed, a
/// directory of the user's (`given`) that others can enter, names too long for a socket.
fn check_channel(
    path: &SocketPath,
    given: bool,
    hot: &HotRestartSettings,
    envoy_user: Option<u32>,
) -> Result<(), SetupError> {
    match path {
        SocketPath::Abstract(_) if !hot.allow_abstract_socket => {
            return Err(SetupError::AbstractChannel {
                path: path.to_string(),
            });
        }
        SocketPath::Abstract(_) => {}
        SocketPath::File(prefix) => {
            if given {
                let dir = match prefix.parent() {
                    Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
                    _ => PathBuf::from("."),
                };
                // A directory of the user's is only checked.
                private_dir(
                    "hot-restart socket directory",
                    &dir,
                    0o700,
                    envoy_user,
                    false,
                )?;
            }
            let base_ids = [Some(hot.base_id), hot.options.cold_base_id];
            if let Some(longest) = too_long(prefix, base_ids.into_iter().flatten()) {
                return Err(SetupError::ChannelTooLong {
                    path: prefix.clone(),
                    longest,
                    fix: if given {
                        "use a shorter --socket-path"
                    } else {
                        "use a shorter temp dir (TMPDIR)"
                    },
                });
            }
        }
    }
    Ok(())
}

/// The longest socket name Envoy binds below `prefix` for families on `base_ids`
/// (`<prefix>_udp_parent_<base id × 10 + 2>`), when it does not fit a Unix socket address
/// (107 bytes and the NUL).
fn too_long(prefix: &Path, base_ids: impl Iterator<Item = u32>) -> Option<String> {
    let highest = base_ids.max().map_or(0, |id| u64::from(id) * 10 + 2);
    let longest = format!("{}_udp_parent_{highest}", prefix.display());
    (longest.len() > 107).then_some(longest)
}

/// Where the drain-notice files live (`envoy_agent_proxy::drain_notice`), when the notice is
/// on: a node proxy's in the node's state directory (a successor pod tells its predecessor's
/// draining Envoy there), a sidecar's in the agent's runtime directory. Off when
/// `--drain-notice off`, or when the bootstrap's own overload manager already uses what the
/// notice adds (Envoy would refuse the duplicate): then a warning says so.
pub fn drain_notice_dir(
    settings: &Settings,
    runtime_dir: &Path,
) -> Result<Option<PathBuf>, SetupError> {
    if !settings.envoy.drain_notice {
        return Ok(None);
    }
    let path = &settings.envoy.config_path;
    if let Some(why) = envoy_agent_proxy::drain_notice::conflict_in(path) {
        tracing::warn!(
            event = "drain_notice_off",
            bootstrap = %path.display(),
            reason = %why,
            "no drain notice through envoy's overload manager: idle and streaming clients are told only when envoy stops"
        );
        return Ok(None);
    }
    let Some(hot) = &settings.hot_restart else {
        return Ok(Some(runtime_dir.to_owned()));
    };
    let dir = hot.state_dir.join(DRAIN_NOTICE_DIR);
    let envoy_user = settings
        .envoy
        .options
        .run_as
        .map(|run_as| run_as.uid)
        .filter(|_| nix::unistd::geteuid().is_root());
    private_dir("drain-notice directory", &dir, 0o700, envoy_user, true)?;
    Ok(Some(dir))
}

/// The drain-notice files' directory in a node proxy's state directory.
pub const DRAIN_NOTICE_DIR: &str = "drain-notice";

/// [`crate::trusted_dir::ensure`], as a setup error naming `what` the directory is.
fn private_dir(
    what: &'static str,
    dir: &Path,
    mode: u32,
    owner: Option<u32>,
    ours: bool,
) -> Result<(), SetupError> {
    crate::trusted_dir::ensure(dir, mode, owner, ours).map_err(|why| SetupError::PrivateDir {
        what,
        dir: dir.to_owned(),
        why,
    })
}

/// The proxy config for `settings`, with the binary, admin address and extra arguments setup
/// resolved.
pub fn proxy_config(
    settings: &Settings,
    binary: PathBuf,
    admin: AdminAddress,
    extra_args: Vec<String>,
    runtime_dir: &Path,
    socket_path: SocketPath,
) -> ProxyConfig {
    let envoy = &settings.envoy;
    let mut config = ProxyConfig::new(binary, envoy.config_path.clone(), admin);
    config.options = envoy.options.clone();
    config.sidecar = settings.hot_restart.is_none();
    config.agent_is_root = nix::unistd::geteuid().is_root();
    config.hot_restart = settings
        .hot_restart
        .as_ref()
        .map(|hot| envoy_agent_proxy::HotRestart {
            base_id: hot.base_id,
            parent_shutdown_time: hot.parent_shutdown_time,
            // Envoy running as another user could not write into our private directory: the
            // supervisor then polls for LIVE without the hint.
            admin_address_dir: match config.options.run_as {
                Some(_) if config.agent_is_root => None,
                _ => Some(runtime_dir.to_path_buf()),
            },
            ephemeral_admin: None,
            socket_path,
        });
    config.extra_args = extra_args;
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_name_is_looked_up_on_path() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("envoy");
        std::fs::write(&bin, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = std::env::join_paths(["/nonexistent", dir.path().to_str().unwrap()]).unwrap();
        assert_eq!(resolve_envoy(Path::new("envoy"), Some(&path)).unwrap(), bin);
        let err = resolve_envoy(Path::new("envoy"), Some(OsStr::new("/nonexistent"))).unwrap_err();
        assert!(err.to_string().contains("on PATH"), "{err}");
    }

    #[test]
    fn a_path_must_be_an_executable_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = resolve_envoy(&dir.path().join("missing"), None).unwrap_err();
        assert!(matches!(err, SetupError::EnvoyNotFound { .. }), "{err}");
        let err = resolve_envoy(dir.path(), None).unwrap_err();
        assert!(
            matches!(err, SetupError::EnvoyNotExecutable { .. }),
            "{err}"
        );
        let file = dir.path().join("envoy");
        std::fs::write(&file, "").unwrap();
        let err = resolve_envoy(&file, None).unwrap_err();
        assert!(
            matches!(err, SetupError::EnvoyNotExecutable { .. }),
            "{err}"
        );
        assert_eq!(err.exit_code(), exit_code::USAGE);
    }

    #[test]
    fn a_script_with_a_missing_interpreter_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("envoy");
        std::fs::write(&script, "#!/no/such/interpreter -x\nexec envoy\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = resolve_envoy(&script, None).unwrap_err();
        assert!(
            err.to_string().contains("interpreter /no/such/interpreter"),
            "{err}"
        );
        std::fs::write(&script, "#!/bin/sh\nexec envoy\n").unwrap();
        assert_eq!(resolve_envoy(&script, None).unwrap(), script);
    }

    fn bootstrap(dir: &Path, yaml: &str) -> PathBuf {
        let path = dir.join("bootstrap.yaml");
        std::fs::write(&path, yaml).unwrap();
        path
    }

    #[test]
    fn admin_from_bootstrap_flag_or_file() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let fixed = bootstrap(
            dir.path(),
            "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 9901}}}",
        );
        let (admin, _, _) = resolve_admin(&fixed, None, &[], &run, None).unwrap();
        assert_eq!(
            admin,
            AdminAddress::Fixed("127.0.0.1:9901".parse().unwrap())
        );

        let flag = Some("127.0.0.1:15000".parse().unwrap());
        let (admin, _, _) = resolve_admin(&fixed, flag, &[], &run, None).unwrap();
        assert_eq!(
            admin,
            AdminAddress::Fixed("127.0.0.1:15000".parse().unwrap())
        );

        let zero = bootstrap(
            dir.path(),
            "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}",
        );
        let (admin, _, _) = resolve_admin(&zero, None, &[], &run, None).unwrap();
        assert_eq!(admin, AdminAddress::FromFile(run.join("admin-address")));

        let extra = [
            "--admin-address-path".to_owned(),
            "/x/a".to_owned(),
            "-l".to_owned(),
        ];
        let (admin, rest, _) = resolve_admin(&zero, None, &extra, &run, None).unwrap();
        assert_eq!(admin, AdminAddress::FromFile(PathBuf::from("/x/a")));
        assert_eq!(rest, ["-l"]);
        let extra = ["--admin-address-path=/y".to_owned()];
        let (admin, rest, _) = resolve_admin(&zero, None, &extra, &run, None).unwrap();
        assert_eq!(admin, AdminAddress::FromFile(PathBuf::from("/y")));
        assert!(rest.is_empty());
    }

    #[test]
    fn the_status_server_cannot_take_the_admin_port() {
        let admin = AdminAddress::Fixed("127.0.0.1:15000".parse().unwrap());
        for status in ["127.0.0.1:15000", "0.0.0.0:15000"] {
            let err = check_status_address(status.parse().unwrap(), &admin).unwrap_err();
            assert!(
                matches!(err, SetupError::StatusOnAdmin { .. }),
                "{status}: {err}"
            );
            assert!(err.to_string().contains(status), "{err}");
        }
        for status in ["127.0.0.1:15020", "127.0.0.1:0", "10.0.0.5:15000"] {
            assert!(
                check_status_address(status.parse().unwrap(), &admin).is_ok(),
                "{status}"
            );
        }
        let from_file = AdminAddress::FromFile(PathBuf::from("/run/admin"));
        assert!(check_status_address("127.0.0.1:15000".parse().unwrap(), &from_file).is_ok());
    }

    #[test]
    fn no_admin_is_fine_with_the_flag_but_not_without() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let none = bootstrap(dir.path(), "static_resources: {}");
        let err = resolve_admin(&none, None, &[], &run, None).unwrap_err();
        assert!(err.to_string().contains("no admin address"), "{err}");
        let flag = Some("127.0.0.1:15000".parse().unwrap());
        assert!(resolve_admin(&none, flag, &[], &run, None).is_ok());
        // A missing bootstrap is an error even with the flag.
        let err = resolve_admin(&dir.path().join("nope.yaml"), flag, &[], &run, None).unwrap_err();
        assert!(err.to_string().contains("nope.yaml"), "{err}");
    }

    #[test]
    fn the_agents_socket_replaces_the_bootstraps_admin_or_stands_in_for_none() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let socket = PathBuf::from("/tmp/envoy-agent-hr-0/7/envoy_admin_7");
        let tcp = bootstrap(
            dir.path(),
            "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 9901}}}",
        );
        let extra = ["--admin-address-path=/y".to_owned()];
        let (admin, rest, replaced) =
            resolve_admin(&tcp, None, &extra, &run, Some(socket.clone())).unwrap();
        assert_eq!(admin, AdminAddress::Socket(socket.clone()));
        assert!(
            rest.is_empty(),
            "the agent passes --admin-address-path itself"
        );
        assert_eq!(
            replaced,
            Some(Address::Tcp("127.0.0.1:9901".parse().unwrap()))
        );
        let none = bootstrap(dir.path(), "static_resources: {}");
        let (admin, _, replaced) =
            resolve_admin(&none, None, &[], &run, Some(socket.clone())).unwrap();
        assert_eq!(admin, AdminAddress::Socket(socket.clone()));
        assert_eq!(replaced, None);
        // A broken bootstrap is still named.
        std::fs::write(&none, "admin: [").unwrap();
        let err = resolve_admin(&none, None, &[], &run, Some(socket)).unwrap_err();
        assert!(err.to_string().contains("bootstrap.yaml"), "{err}");
    }

    #[test]
    fn a_pipe_in_the_bootstrap_is_a_fixed_unix_address() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let pipe = bootstrap(
            dir.path(),
            "admin: {address: {pipe: {path: /run/e/admin.sock}}}",
        );
        let (admin, _, _) = resolve_admin(&pipe, None, &[], &run, None).unwrap();
        assert_eq!(
            admin,
            AdminAddress::Fixed(Address::Unix(PathBuf::from("/run/e/admin.sock")))
        );
        // The status server's port check has nothing to compare with.
        assert!(check_status_address("127.0.0.1:15000".parse().unwrap(), &admin).is_ok());
    }

    fn node_settings(state_dir: &Path, envoy_args: &[&str]) -> Settings {
        use clap::Parser;
        let mut args = vec!["envoy-agent", "run", "-c", "b.yaml", "--hot-restart"];
        args.extend([
            "--base-id",
            "4000000",
            "--state-dir",
            state_dir.to_str().unwrap(),
        ]);
        args.push("--");
        args.extend(envoy_args);
        let cli = crate::config::cli::Cli::try_parse_from(args).unwrap();
        let crate::config::cli::Command::Run(run) = cli.command else {
            panic!("run expected");
        };
        run.into_settings("unix:/run/test/grpc.sock".parse().ok())
            .unwrap()
    }

    /// A path of exactly `len` bytes below `dir`.
    fn deep(dir: &Path, len: usize) -> PathBuf {
        let mut path = dir.to_path_buf();
        while path.as_os_str().len() + 11 < len {
            path.push("0123456789");
        }
        let pad = len - path.as_os_str().len() - 1;
        path.push("s".repeat(pad));
        assert_eq!(path.as_os_str().len(), len);
        path
    }

    #[test]
    fn the_channel_of_a_deep_state_dir_is_reached_through_a_short_link() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        let state = deep(dir.path(), 150);
        let (path, rest) = hot_restart_channel(&node_settings(&state, &[]), vec![], &tmp).unwrap();
        assert!(rest.is_empty());
        let me = nix::unistd::geteuid().as_raw();
        let link = tmp.join(format!("envoy-agent-hr-{me}")).join("4000000");
        assert_eq!(path, SocketPath::File(link.join("envoy")));
        assert_eq!(
            std::fs::canonicalize(&link).unwrap(),
            std::fs::canonicalize(state.join(CHANNEL_DIR)).unwrap()
        );
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&state.join(CHANNEL_DIR)), 0o700);
        assert_eq!(mode(link.parent().unwrap()), 0o700);
        // The same state dir at another path (here through a symlink to its parent; a state
        // dir that is itself a symlink is refused): the link is kept.
        let alias = dir.path().join("alias");
        std::os::unix::fs::symlink(state.parent().unwrap(), &alias).unwrap();
        let other = alias.join(state.file_name().unwrap());
        let (again, _) = hot_restart_channel(&node_settings(&other, &[]), vec![], &tmp).unwrap();
        assert_eq!(again, path);
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            std::fs::canonicalize(state.join(CHANNEL_DIR)).unwrap()
        );
    }

    #[test]
    fn a_channel_whose_names_cannot_fit_is_refused_naming_what_to_shorten() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        // The user's own path is taken as given.
        let own = deep(dir.path(), 90).join("envoy");
        std::fs::create_dir_all(own.parent().unwrap()).unwrap();
        std::fs::set_permissions(
            own.parent().unwrap(),
            std::fs::Permissions::from_mode(0o700),
        )
        .unwrap();
        let settings = node_settings(&state, &[]);
        let args = vec!["--socket-path".to_owned(), own.display().to_string()];
        let err = hot_restart_channel(&settings, args, dir.path()).unwrap_err();
        assert!(
            matches!(err, SetupError::ChannelTooLong { fix, .. } if fix.contains("--socket-path")),
            "{err}"
        );
        assert_eq!(err.exit_code(), exit_code::USAGE);
        // The agent's link: only a temp dir that long can make it too long.
        let tmp = deep(dir.path(), 80);
        std::fs::create_dir_all(&tmp).unwrap();
        let err = hot_restart_channel(&settings, vec![], &tmp).unwrap_err();
        assert!(
            matches!(err, SetupError::ChannelTooLong { fix, .. } if fix.contains("TMPDIR")),
            "{err}"
        );
        assert_eq!(
            too_long(
                Path::new("/tmp/envoy-agent-hr-0/4294967295/envoy"),
                [u32::MAX].into_iter()
            ),
            None,
            "the longest link and names fit"
        );
    }

    #[test]
    fn something_else_at_the_links_name_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let me = nix::unistd::geteuid().as_raw();
        let planted = dir
            .path()
            .join(format!("envoy-agent-hr-{me}"))
            .join("4000000");
        std::fs::create_dir_all(&planted).unwrap();
        let err = hot_restart_channel(&node_settings(&state, &[]), vec![], dir.path()).unwrap_err();
        assert!(matches!(err, SetupError::ChannelLink(_)), "{err}");
        assert_eq!(err.exit_code(), exit_code::USAGE);
        // Nothing was followed or removed.
        assert!(planted.is_dir());
    }
}

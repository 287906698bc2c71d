//! The supervisor's settings, and what it refuses to run with.

use std::path::PathBuf;
use std::time::Duration;

use envoy_agent_proxy::ProxyConfig;
use envoy_agent_proxy::admin::Address;

/// Why a config cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Hot restart settings are missing.
    #[error("hot restart needs a base id and a parent shutdown time")]
    NoHotRestart,
    /// Parent shutdown time must exceed drain time.
    #[error(
        "--parent-shutdown-time ({parent_shutdown:?}) must exceed --drain-time ({drain:?}): \
         the parent would be terminated before its connections drained"
    )]
    ParentShutdownTooShort {
        /// Drain time.
        drain: Duration,
        /// Parent shutdown time.
        parent_shutdown: Duration,
    },
    /// The cold handover's base id must name another family.
    #[error(
        "--cold-base-id {0} equals --base-id: a cold handover starts a second family beside \
         the serving one, under another base id"
    )]
    ColdBaseIdSame(u32),
    /// The admin port must be fixed.
    #[error(
        "hot restart needs a fixed admin port (every epoch binds the same one); \
         the bootstrap asks for port 0: set one, pass --admin-address, or use --envoy-admin socket"
    )]
    AdminPortZero,
}

/// What the operator says of the family: each value under its flag's name, built once from the
/// command line (the agent's `RunArgs::into_settings`) and carried whole into [`Config`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyOptions {
    /// `--watch-config`: hot-restart when the bootstrap changes.
    pub watch_config: bool,
    /// `--ready-marker`: a file that exists exactly while this supervisor's newest epoch is
    /// LIVE.
    pub ready_marker: Option<PathBuf>,
    /// `--pod-generation`: its pod's place in a rollout, a later pod's is larger (the
    /// DaemonSet's `pod-template-generation`, else the agent's start time in Unix ms). It never
    /// takes over from, nor starts a family beside, a family run by a newer pod.
    pub generation: u64,
    /// `--handoff-deadline`: how long a new epoch may take from spawn to LIVE.
    pub handoff_deadline: Duration,
    /// `--cold-base-id`: the base id a cold handover's new family takes when the family runs
    /// under the configured one (and the configured one when it runs under this): families
    /// alternate between the two. `None` (`--no-cold-handover`): no cold handover; a restart
    /// hot restart cannot do is refused.
    pub cold_base_id: Option<u32>,
}

impl Default for FamilyOptions {
    fn default() -> Self {
        FamilyOptions {
            watch_config: false,
            ready_marker: None,
            generation: 0,
            handoff_deadline: Duration::from_secs(60),
            cold_base_id: None,
        }
    }
}

/// The supervisor's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Envoy's settings; `hot_restart` must be set. Its drain duration is `--drain-time`.
    pub proxy: ProxyConfig,
    /// What the operator said of the family.
    pub options: FamilyOptions,
    /// Debounce of the config watch.
    pub watch_debounce: Duration,
    /// The per-node state directory (shared between pods of a node): heartbeats and the
    /// epoch lock. Without it the supervisor cannot find a predecessor and starts at epoch 0.
    pub state_dir: Option<PathBuf>,
    /// This supervisor's name on the node, unique per agent instance (see [`unique_identity`]).
    pub identity: String,
    /// How often the heartbeat is rewritten (and the node's other heartbeats read).
    pub heartbeat_period: Duration,
    /// How long after its parent-shutdown time a draining parent may still run before it is
    /// killed as overdue.
    pub parent_overdue_grace: Duration,
    /// When the serving epoch dies while its parent drains and the family ends (a crash),
    /// leave that parent running, to finish its in-flight requests by its own deadline, and
    /// hand it to the next run, which starts beside it under the other base id. Only for a
    /// family that is run again after a crash (`--restart-on-crash`); `false`: the parent is
    /// stopped with the family.
    pub keep_draining_parent: bool,
}

impl Config {
    /// A config with defaults around `proxy`.
    pub fn new(proxy: ProxyConfig) -> Self {
        Config {
            proxy,
            options: FamilyOptions::default(),
            watch_debounce: Duration::from_millis(200),
            state_dir: None,
            identity: unique_identity(None),
            heartbeat_period: Duration::from_millis(500),
            parent_overdue_grace: Duration::from_secs(5),
            keep_draining_parent: false,
        }
    }

    /// Checks what the supervisor cannot work with; the admin address and base id.
    pub fn validate(&self) -> Result<(Address, u32), ConfigError> {
        let hot = self
            .proxy
            .hot_restart
            .as_ref()
            .ok_or(ConfigError::NoHotRestart)?;
        check(
            self.proxy.options.drain_time,
            hot.parent_shutdown_time,
            hot.base_id,
            self.options.cold_base_id,
        )?;
        match self.proxy.admin.known() {
            Some(addr) if addr.tcp().is_none_or(|a| a.port() != 0) => Ok((addr, hot.base_id)),
            _ => Err(ConfigError::AdminPortZero),
        }
    }

    /// `--parent-shutdown-time`.
    pub fn parent_shutdown_time(&self) -> Duration {
        self.proxy
            .hot_restart
            .as_ref()
            .map_or(Duration::ZERO, |h| h.parent_shutdown_time)
    }
}

/// A name for this agent instance that no other agent on the node has: `name` (the pod name,
/// else the host name) plus a random suffix made now. With `hostNetwork` every pod of a node
/// has the node's host name and every agent is PID 1 of its container, so neither alone tells
/// two agents apart.
pub fn unique_identity(name: Option<&str>) -> String {
    let base = name
        .map(str::to_owned)
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "envoy-agent".to_owned())
        });
    format!("{base}-{}", random_suffix())
}

/// Eight random hex digits, from the kernel's generator (a fresh UUID per read).
fn random_suffix() -> String {
    let uuid = std::fs::read_to_string("/proc/sys/kernel/random/uuid").unwrap_or_default();
    let hex: String = uuid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(8)
        .collect();
    if hex.len() == 8 {
        return hex;
    }
    // No /proc (unusual): the hasher's per-process random keys, the time and the pid.
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.write_u32(std::process::id());
    format!("{:08x}", h.finish() as u32)
}

/// Refuses what a family could not run with: a parent-shutdown time that does not outlast the
/// drain (the parent would be terminated before its drain could end), a cold base id that is
/// the base id (a cold family would share the serving one's shared memory and sockets). The
/// one check of these, called by the command line before anything is made on disk and by
/// [`Config::validate`].
pub fn check(
    drain_time: Duration,
    parent_shutdown_time: Duration,
    base_id: u32,
    cold_base_id: Option<u32>,
) -> Result<(), ConfigError> {
    if cold_base_id == Some(base_id) {
        return Err(ConfigError::ColdBaseIdSame(base_id));
    }
    // Compared as Envoy gets them: whole seconds.
    if parent_shutdown_time.as_secs() <= drain_time.as_secs() {
        return Err(ConfigError::ParentShutdownTooShort {
            drain: drain_time,
            parent_shutdown: parent_shutdown_time,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_unique_per_instance_and_keep_the_name() {
        let a = unique_identity(Some("pod-a"));
        let b = unique_identity(Some("pod-a"));
        assert!(
            a.starts_with("pod-a-") && b.starts_with("pod-a-"),
            "{a} {b}"
        );
        assert_ne!(a, b, "two agents with the same pod or host name differ");
        assert_eq!(a.len(), "pod-a-".len() + 8);
        let host = unique_identity(None);
        assert!(!host.starts_with('-'), "{host}");
        assert_ne!(unique_identity(Some("")), unique_identity(Some("")));
    }
}

//! Telling idle and streaming clients that a drain began, through Envoy's overload manager.
//!
//! Envoy's drain (`/drain_listeners`, a hot-restart parent's drain) tells a connection only when
//! it writes a response on it: `Connection: close` on HTTP/1.1, GOAWAY on HTTP/2 and HTTP/3. An
//! idle keep-alive connection and a long-lived stream hear nothing until Envoy exits and closes
//! them bare (seen on 1.40). Envoy's overload manager can do better, and the agent uses it
//! without touching the operator's bootstrap: every Envoy it starts gets, through
//! `--config-yaml` (which Envoy merges into the bootstrap), an `injected_resource` monitor that
//! reads a file of the agent's (one per Envoy: [`file()`]) and two actions triggered when it reads
//! 1:
//!
//! - `envoy.overload_actions.disable_http_keepalive`: every response carries `Connection: close`
//!   (HTTP/1.1) or a GOAWAY (HTTP/2, HTTP/3), as a drain does;
//! - `envoy.overload_actions.reduce_timeouts`, scaling the HCM's connection idle timeout
//!   (`HTTP_DOWNSTREAM_CONNECTION_IDLE`) and its maximum connection duration
//!   (`HTTP_DOWNSTREAM_CONNECTION_MAX`) down to [`NOTICE_TIMEOUT`]: when they fire, the HCM
//!   starts its own drain sequence on that connection, which sends a GOAWAY to an HTTP/2 or
//!   HTTP/3 connection whether it is idle or carries a stream (the stream goes on; the
//!   connection closes after the HCM's `drain_timeout` once its streams are done) and closes
//!   an idle HTTP/1.1 connection.
//!
//! The timers are scaled, not made: only a connection manager that has them is told that way.
//! `max_connection_duration` has no default, so an HCM without it tells its idle and streaming
//! connections nothing until they write a response (docs/shutdown.md has the measurements).
//!
//! The agent writes 1 ([`tell`]) when it drains an Envoy (every drain path) and when an epoch
//! becomes a hot-restart parent that drains; the file is written atomically (the monitor
//! watches for a rename) and never goes back to 0: a drain is one-way. Envoy reads the file at
//! each overload-manager refresh (1 s by default).
//!
//! A bootstrap with an overload manager of its own is merged with the agent's (Envoy appends
//! lists); one that already uses the `injected_resource` monitor or one of the two actions would
//! be refused by Envoy as a duplicate, so the agent leaves the notice out then and says so at
//! start ([`conflict`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::ProxyConfig;

/// How soon, once told, an HCM's scaled timers fire.
pub const NOTICE_TIMEOUT: Duration = Duration::from_millis(500);

const MONITOR: &str = "envoy.resource_monitors.injected_resource";
const KEEPALIVE: &str = "envoy.overload_actions.disable_http_keepalive";
const TIMEOUTS: &str = "envoy.overload_actions.reduce_timeouts";

/// The file the Envoy of `epoch` reads, when the notice is on: one per family and epoch, so
/// that a draining parent is told while its child serves untold.
pub fn file(config: &ProxyConfig, epoch: u32) -> Option<PathBuf> {
    let dir = config.drain_notice.as_ref()?;
    let base = config.hot_restart.as_ref().map_or(0, |h| h.base_id);
    Some(file_in(dir, base, epoch))
}

/// The file of epoch `epoch` of the family `base_id` under `dir`.
pub fn file_in(dir: &Path, base_id: u32, epoch: u32) -> PathBuf {
    dir.join(format!("drain-{base_id}-{epoch}"))
}

/// The bootstrap overlay (merged by Envoy through `--config-yaml`) for an Envoy reading `file`.
pub fn overlay(file: &Path) -> serde_json::Value {
    let trigger = serde_json::json!([{ "name": MONITOR, "threshold": { "value": 0.9 } }]);
    let min = format!("{}s", NOTICE_TIMEOUT.as_secs_f64());
    serde_json::json!({
        "resource_monitors": [{
            "name": MONITOR,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.injected_resource.v3.InjectedResourceConfig",
                "filename": file.display().to_string(),
            }
        }],
        "actions": [
            { "name": KEEPALIVE, "triggers": trigger },
            {
                "name": TIMEOUTS,
                "triggers": trigger,
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.overload.v3.ScaleTimersOverloadActionConfig",
                    "timer_scale_factors": [
                        { "timer": "HTTP_DOWNSTREAM_CONNECTION_IDLE", "min_timeout": min },
                        { "timer": "HTTP_DOWNSTREAM_CONNECTION_MAX", "min_timeout": min },
                    ]
                }
            }
        ]
    })
}

/// Why a bootstrap's own overload manager leaves no room for the notice (Envoy refuses a
/// duplicate monitor or action), if it does not.
pub fn conflict(bootstrap: &serde_yaml::Value) -> Option<String> {
    crate::overload::ManagerNames::of(bootstrap).taken(&[MONITOR], &[KEEPALIVE, TIMEOUTS], &[])
}

/// [`conflict`] of the bootstrap file at `path` (YAML or JSON); none when it cannot be read
/// (setup has checked it already). The file is parsed only when it names one of the notice's
/// monitor or actions at all: a large bootstrap parsed whole costs the agent tens of MiB
/// (a 1.9 MB one: 18 MiB more resident for good), and almost none has them.
pub fn conflict_in(path: &Path) -> Option<String> {
    conflict(&crate::overload::bootstrap_naming(
        path,
        &[MONITOR, KEEPALIVE, TIMEOUTS],
    )?)
}

/// Before the Envoy of `epoch` starts: its file reads 0 (a stale 1 would make it start told).
pub fn prepare(config: &ProxyConfig, epoch: u32) {
    if let Some(path) = file(config, epoch) {
        write(&path, "0");
    }
}

/// The Envoy of `epoch` drains: its file reads 1. Failures are logged (the drain goes on,
/// untold).
pub fn tell(config: &ProxyConfig, epoch: u32) {
    if let Some(path) = file(config, epoch) {
        tell_file(&path, epoch);
    }
}

/// [`tell`] by path (a family's other epochs, a predecessor pod's).
pub fn tell_file(path: &Path, epoch: u32) {
    if write(path, "1") {
        tracing::info!(
            event = "drain_notice",
            epoch,
            path = %path.display(),
            "told envoy's overload manager that the drain began: idle and streaming clients are told to go"
        );
    }
}

/// Removes the file of an Envoy that has exited.
pub fn remove(config: &ProxyConfig, epoch: u32) {
    if let Some(path) = file(config, epoch) {
        let _ = std::fs::remove_file(path);
    }
}

/// Writes `value` to `path` atomically (Envoy's monitor watches for the rename).
fn write(path: &Path, value: &str) -> bool {
    let tmp = path.with_extension("tmp");
    let result = std::fs::write(&tmp, value).and_then(|()| std::fs::rename(&tmp, path));
    match result {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the drain notice");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bootstrap_that_already_uses_our_names_conflicts() {
        let yaml = |s: &str| serde_yaml::from_str::<serde_yaml::Value>(s).unwrap();
        assert_eq!(conflict(&yaml("static_resources: {}")), None);
        let theirs = yaml(
            "overload_manager:\n  resource_monitors:\n  - name: envoy.resource_monitors.global_downstream_max_connections\n  actions:\n  - name: envoy.overload_actions.stop_accepting_requests\n",
        );
        assert_eq!(conflict(&theirs), None, "other names merge");
        let clash = yaml(
            "overload_manager:\n  resource_monitors:\n  - name: envoy.resource_monitors.injected_resource\n  actions:\n  - name: envoy.overload_actions.disable_http_keepalive\n",
        );
        let why = conflict(&clash).unwrap();
        assert!(why.contains(MONITOR) && why.contains(KEEPALIVE), "{why}");
    }

    #[test]
    fn a_bootstrap_file_is_parsed_only_when_it_names_the_notice_s_parts() {
        let dir = std::env::temp_dir().join(format!("drain-notice-c-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = dir.join("plain.yaml");
        // Not YAML at all: a file that never names the parts is not parsed.
        std::fs::write(&plain, "{{{ not yaml").unwrap();
        assert_eq!(conflict_in(&plain), None);
        let clash = dir.join("clash.yaml");
        std::fs::write(
            &clash,
            "overload_manager:\n  actions:\n  - name: envoy.overload_actions.reduce_timeouts\n",
        )
        .unwrap();
        assert!(conflict_in(&clash).is_some_and(|why| why.contains(TIMEOUTS)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_overlay_reads_the_epoch_s_own_file() {
        let o = overlay(Path::new("/run/x/drain-7-2"));
        assert_eq!(
            o["resource_monitors"][0]["typed_config"]["filename"],
            "/run/x/drain-7-2"
        );
        assert_eq!(o["actions"].as_array().unwrap().len(), 2);
        assert_eq!(
            file_in(Path::new("/d"), 7, 2),
            PathBuf::from("/d/drain-7-2")
        );
    }

    #[test]
    fn telling_is_an_atomic_write_of_one() {
        let dir = std::env::temp_dir().join(format!("drain-notice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = file_in(&dir, 1, 0);
        write(&path, "0");
        tell_file(&path, 0);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "1");
        assert!(!path.with_extension("tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

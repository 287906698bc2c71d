//! What an Envoy has of its control plane (xDS), and what readiness makes of it.
//!
//! A bootstrap with `dynamic_resources` starts with no listeners or clusters: they come from a
//! control plane. Envoy reports LIVE once each config source's initial fetch is done *or timed
//! out* (`initial_fetch_timeout`, 15 s by default), so LIVE alone does not say that Envoy has
//! its config (`docs/node-proxy.md#with-a-control-plane-xds`). Like Istio's pilot-agent, the
//! agent calls an Envoy ready only once it has accepted each dynamic type it subscribes to at
//! least once (`cluster_manager.cds.update_success`, `listener_manager.lds.update_success`).
//!
//! Which types are dynamic is read from Envoy itself: it creates the `cds`/`lds` stats only
//! for a configured source (seen on 1.40), so a static bootstrap has none and is ready as
//! before. One filtered `/stats` request ([`XDS_STATS_FILTER`]) answers everything, including
//! the answering process's epoch, so a reading is never taken for another epoch's.
//!
//! The second half is [`fetch_wait_overlay`]: an epoch that takes over from a serving one (a
//! hot restart, a surge successor's first epoch, a cold handover's new family) gets
//! `initial_fetch_timeout: 0s` on the bootstrap's LDS and CDS sources, so it waits for its
//! config instead of going LIVE without it, which would make its parent stop serving.

use std::path::Path;
use std::time::SystemTime;

use crate::admin::{AdminClient, AdminError, Readiness, ServerState};

/// The stats one reading asks for (Envoy visits every stat to match it: ask rarely).
pub const XDS_STATS_FILTER: &str = r"^(cluster_manager\.cds|listener_manager\.lds)\.(update_success|update_rejected|init_fetch_timeout)$|^control_plane\.connected_state$|^server\.hot_restart_epoch$";

// Here, not in admin.rs: the admin client knows Envoy's endpoints, this module what a reading
// of the control plane is.
impl AdminClient {
    /// What the answering Envoy has of its control plane: its state (`/ready`), then one
    /// `/stats` request ([`XDS_STATS_FILTER`]), which Envoy visits every stat to answer.
    pub async fn xds(&self) -> Result<XdsReading, AdminError> {
        let state = match self.ready().await? {
            Readiness::Ready => ServerState::Live,
            Readiness::NotReady(state) => ServerState::from_ready(&state),
        };
        let text = self.stats(XDS_STATS_FILTER, false).await?;
        let mut reading = XdsReading::parse(&text);
        reading.state = Some(state);
        Ok(reading)
    }
}

/// A dynamic resource type whose first update readiness waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum XdsType {
    /// Clusters (CDS).
    Cds,
    /// Listeners (LDS).
    Lds,
}

impl XdsType {
    /// `cds`, `lds`.
    pub fn as_str(self) -> &'static str {
        match self {
            XdsType::Cds => "cds",
            XdsType::Lds => "lds",
        }
    }

    fn of_stat(prefix: &str) -> Option<XdsType> {
        match prefix {
            "cluster_manager.cds" => Some(XdsType::Cds),
            "listener_manager.lds" => Some(XdsType::Lds),
            _ => None,
        }
    }
}

impl std::fmt::Display for XdsType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One dynamic type's update counters, as Envoy counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XdsCounts {
    /// Which type.
    pub kind: XdsType,
    /// Updates accepted.
    pub update_success: u64,
    /// Updates rejected (the control plane sent a config Envoy refused).
    pub update_rejected: u64,
    /// Initial fetches that timed out (Envoy went on without this type's config).
    pub init_fetch_timeout: u64,
}

impl XdsCounts {
    /// Whether an update of this type was accepted at least once.
    pub fn received(&self) -> bool {
        self.update_success > 0
    }
}

/// One reading of an Envoy's xDS stats ([`XDS_STATS_FILTER`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XdsReading {
    /// The answering process's restart epoch.
    pub epoch: Option<u32>,
    /// Each dynamic type it subscribes to, in [`XdsType`] order; empty for a static bootstrap.
    pub types: Vec<XdsCounts>,
    /// `control_plane.connected_state`: whether its xDS stream is up; `None` when it has no
    /// gRPC control plane.
    pub connected: Option<bool>,
    /// Its server state, from `/ready` (asked just before the stats; its `server.state`
    /// gauge is only updated at each stats flush).
    pub state: Option<ServerState>,
}

impl XdsReading {
    /// Parses Envoy's text stats format (`name: value` lines); other lines are ignored.
    pub fn parse(text: &str) -> XdsReading {
        let mut reading = XdsReading::default();
        for line in text.lines() {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<u64>() else {
                continue;
            };
            let name = name.trim();
            match name {
                "server.hot_restart_epoch" => reading.epoch = u32::try_from(value).ok(),
                "control_plane.connected_state" => reading.connected = Some(value > 0),
                _ => {
                    let Some((prefix, counter)) = name.rsplit_once('.') else {
                        continue;
                    };
                    let Some(kind) = XdsType::of_stat(prefix) else {
                        continue;
                    };
                    let counts = match reading.types.iter_mut().find(|c| c.kind == kind) {
                        Some(c) => c,
                        None => {
                            reading.types.push(XdsCounts {
                                kind,
                                update_success: 0,
                                update_rejected: 0,
                                init_fetch_timeout: 0,
                            });
                            reading.types.sort_by_key(|c| c.kind);
                            reading
                                .types
                                .iter_mut()
                                .find(|c| c.kind == kind)
                                .expect("just pushed")
                        }
                    };
                    match counter {
                        "update_success" => counts.update_success = value,
                        "update_rejected" => counts.update_rejected = value,
                        "init_fetch_timeout" => counts.init_fetch_timeout = value,
                        _ => {}
                    }
                }
            }
        }
        reading
    }

    /// What a new epoch that started with an unbounded initial fetch (see
    /// [`fetch_wait_overlay`]) still waits for, from its server state: Envoy fetches clusters
    /// while PRE_INITIALIZING and listeners while INITIALIZING. Not from its counters: a hot
    /// restart's child adds its parent's counters to its own (only some gauges, such as
    /// `control_plane.connected_state`, are its own), so they say "received" before it
    /// received anything.
    pub fn starting_waits(&self) -> Vec<XdsType> {
        let has = |t: XdsType| self.types.iter().any(|c| c.kind == t);
        match self.state {
            Some(ServerState::PreInitializing) => self.types.iter().map(|c| c.kind).collect(),
            Some(ServerState::Initializing) if has(XdsType::Lds) => vec![XdsType::Lds],
            _ => Vec::new(),
        }
    }

    /// The dynamic types not received yet, by the counters (see [`Self::starting_waits`] for
    /// a hot restart's new epoch).
    pub fn waiting(&self) -> Vec<XdsType> {
        self.types
            .iter()
            .filter(|c| !c.received())
            .map(|c| c.kind)
            .collect()
    }
}

/// The newest LIVE epoch's control plane, when its bootstrap has dynamic resources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPlane {
    /// The epoch these facts are of.
    pub epoch: u32,
    /// Each dynamic type's counters.
    pub types: Vec<XdsCounts>,
    /// Whether its xDS stream is up (`None`: no gRPC control plane, e.g. files).
    pub connected: Option<bool>,
    /// Since when it has been without its control plane (none while connected).
    pub disconnected_since: Option<SystemTime>,
}

impl ControlPlane {
    /// Whether every dynamic type was received at least once.
    pub fn received(&self) -> bool {
        self.types.iter().all(XdsCounts::received)
    }

    /// `cds: received, lds: waiting`.
    pub fn summary(&self) -> String {
        self.types
            .iter()
            .map(|c| {
                let state = if c.received() { "received" } else { "waiting" };
                format!("{}: {state}", c.kind)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Why the newest LIVE epoch's config does not make it ready.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigNotReady {
    /// Its control plane has not sent every type it subscribes to (`summary`: each type and
    /// whether it came).
    #[error("config not received from the control plane ({summary})")]
    Awaited {
        /// Each type and whether it came (`cds: received, lds: waiting`).
        summary: String,
    },
    /// Not read yet: nothing LIVE so far, or its first reading has not come.
    #[error("envoy's config is not checked yet")]
    Unchecked,
}

/// What the newest LIVE epoch has of its config, as readiness sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ConfigStatus {
    /// Not read yet: nothing LIVE so far, or its first reading has not come.
    #[default]
    Unknown,
    /// A static bootstrap: Envoy has its whole config when it is LIVE.
    Static,
    /// Config from a control plane.
    Dynamic(ControlPlane),
}

impl ConfigStatus {
    /// Ready as far as config goes; otherwise why not
    /// (`config not received from the control plane (cds: received, lds: waiting)`).
    pub fn ready(&self) -> Result<(), ConfigNotReady> {
        match self {
            ConfigStatus::Static => Ok(()),
            ConfigStatus::Dynamic(cp) if cp.received() => Ok(()),
            ConfigStatus::Dynamic(cp) => Err(ConfigNotReady::Awaited {
                summary: cp.summary(),
            }),
            ConfigStatus::Unknown => Err(ConfigNotReady::Unchecked),
        }
    }

    /// The control plane's facts, when the config is dynamic.
    pub fn control_plane(&self) -> Option<&ControlPlane> {
        match self {
            ConfigStatus::Dynamic(cp) => Some(cp),
            _ => None,
        }
    }

    /// Takes in a reading of `epoch` made at `now`; whether anything changed.
    pub fn observe(&mut self, epoch: u32, reading: &XdsReading, now: SystemTime) -> bool {
        let next = if reading.types.is_empty() {
            ConfigStatus::Static
        } else {
            let before = self.control_plane().filter(|cp| cp.epoch == epoch);
            // A new epoch takes over its predecessor's time without a control plane when it
            // has none either: the outage goes on.
            let lost_at = self.control_plane().and_then(|cp| cp.disconnected_since);
            let disconnected_since = match reading.connected {
                Some(false) => Some(
                    before
                        .and_then(|cp| cp.disconnected_since)
                        .or(lost_at)
                        .unwrap_or(now),
                ),
                _ => None,
            };
            ConfigStatus::Dynamic(ControlPlane {
                epoch,
                types: reading.types.clone(),
                connected: reading.connected,
                disconnected_since,
            })
        };
        if *self == next {
            false
        } else {
            *self = next;
            true
        }
    }

    /// Logs what changed (the first reading, the config received, the control plane lost or
    /// back), as the `control_plane` event.
    pub fn log_change(&self) {
        match self {
            ConfigStatus::Dynamic(cp) => tracing::info!(
                event = "control_plane",
                epoch = cp.epoch,
                received = cp.received(),
                connected = ?cp.connected,
                types = %cp.summary(),
                "control plane"
            ),
            ConfigStatus::Static => tracing::debug!("static bootstrap: nothing to wait for"),
            ConfigStatus::Unknown => {}
        }
    }

    /// Whether another reading is wanted soon: not received yet (readiness waits for it).
    pub fn waiting(&self) -> bool {
        match self {
            ConfigStatus::Unknown => true,
            ConfigStatus::Static => false,
            ConfigStatus::Dynamic(cp) => !cp.received(),
        }
    }
}

/// The dynamic config sources that [`fetch_wait_overlay`] can make wait.
const WAITING_SOURCES: [&str; 2] = ["lds_config", "cds_config"];

/// An overlay that gives the bootstrap's LDS and CDS sources `initial_fetch_timeout: 0s`
/// (wait for the control plane as long as it takes; the agent's handoff deadline bounds it),
/// merged into `user_overlay` (the user's own `--config-yaml`, kept whole: Envoy takes one).
/// `None` when the bootstrap (with that overlay) has neither source, or cannot be read as YAML
/// or JSON (a binary bootstrap: the epoch then keeps its own timeouts); Envoy itself reports
/// what is wrong with a bootstrap.
///
/// Only sources that exist are named: an overlay that created one would leave it without a
/// `config_source_specifier`, which Envoy refuses.
pub fn fetch_wait_overlay(
    bootstrap: &Path,
    user_overlay: Option<&str>,
) -> Option<serde_json::Value> {
    let mut overlay: serde_json::Value = match user_overlay {
        Some(text) => serde_yaml::from_str(text).ok()?,
        None => serde_json::Value::Object(serde_json::Map::new()),
    };
    let present = |doc: &serde_json::Value, source: &str| {
        doc.get("dynamic_resources")
            .and_then(|d| d.get(source))
            .is_some_and(|s| !s.is_null())
    };
    let text = read_bounded(bootstrap)?;
    // Most bootstraps are static: no parse of a large file on a handoff's critical path.
    let dynamic = text.contains("dynamic_resources")
        || user_overlay.is_some_and(|o| o.contains("dynamic_resources"));
    if !dynamic {
        return None;
    }
    let doc: serde_json::Value = serde_yaml::from_str(&text).ok()?;
    let sources: Vec<&str> = WAITING_SOURCES
        .into_iter()
        .filter(|s| present(&doc, s) || present(&overlay, s))
        .collect();
    if sources.is_empty() {
        return None;
    }
    let root = overlay.as_object_mut()?;
    let dynamic = root
        .entry("dynamic_resources")
        .or_insert_with(|| serde_json::json!({}))
        .as_object_mut()?;
    for source in sources {
        dynamic
            .entry(source)
            .or_insert_with(|| serde_json::json!({}))
            .as_object_mut()?
            .insert("initial_fetch_timeout".to_owned(), "0s".into());
    }
    Some(overlay)
}

/// Makes an epoch's command line wait for its control plane: `args` (Envoy's, with at most one
/// `--config-yaml`, the agent's or the user's) get [`fetch_wait_overlay`] as their overlay.
/// Whether they did (a bootstrap with LDS or CDS).
pub fn wait_for_config(args: &mut Vec<String>, bootstrap: &Path) -> bool {
    let at = args
        .iter()
        .position(|a| a == "--config-yaml" || a.starts_with("--config-yaml="));
    let user = at.and_then(|i| match args[i].strip_prefix("--config-yaml=") {
        Some(v) => Some(v.to_owned()),
        None => args.get(i + 1).cloned(),
    });
    let Some(overlay) = fetch_wait_overlay(bootstrap, user.as_deref()) else {
        return false;
    };
    let overlay = overlay.to_string();
    match at {
        Some(i) if args[i] == "--config-yaml" && i + 1 < args.len() => args[i + 1] = overlay,
        Some(i) => args[i] = format!("--config-yaml={overlay}"),
        None => args.extend(["--config-yaml".to_owned(), overlay]),
    }
    true
}

fn read_bounded(path: &Path) -> Option<String> {
    String::from_utf8(crate::read_config(path).ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOWN: &str = "cluster_manager.cds.init_fetch_timeout: 0\n\
        cluster_manager.cds.update_rejected: 0\n\
        cluster_manager.cds.update_success: 0\n\
        control_plane.connected_state: 0\n\
        listener_manager.lds.init_fetch_timeout: 0\n\
        listener_manager.lds.update_rejected: 0\n\
        listener_manager.lds.update_success: 0\n\
        server.hot_restart_epoch: 2\n";

    #[test]
    fn a_reading_names_each_dynamic_type_and_the_epoch() {
        let r = XdsReading::parse(DOWN);
        assert_eq!(r.epoch, Some(2));
        assert_eq!(r.connected, Some(false));
        assert_eq!(
            r.types.iter().map(|c| c.kind).collect::<Vec<_>>(),
            [XdsType::Cds, XdsType::Lds]
        );
        assert_eq!(r.waiting(), [XdsType::Cds, XdsType::Lds]);
        let r = XdsReading::parse(&DOWN.replace("cds.update_success: 0", "cds.update_success: 3"));
        assert_eq!(r.waiting(), [XdsType::Lds]);
    }

    #[test]
    fn a_starting_epoch_waits_by_its_state_not_by_its_parents_counters() {
        // A hot restart's child shows its parent's counters as its own.
        let merged = XdsReading::parse(&DOWN.replace("update_success: 0", "update_success: 1"));
        let in_state = |reading: &XdsReading, state| XdsReading {
            state: Some(state),
            ..reading.clone()
        };
        let r = in_state(&merged, ServerState::PreInitializing);
        assert_eq!(r.starting_waits(), [XdsType::Cds, XdsType::Lds]);
        let r = in_state(&merged, ServerState::Initializing);
        assert_eq!(r.starting_waits(), [XdsType::Lds]);
        let r = in_state(&merged, ServerState::Live);
        assert!(r.starting_waits().is_empty(), "LIVE waits for nothing");
        let r = in_state(
            &XdsReading::parse("server.hot_restart_epoch: 1\n"),
            ServerState::PreInitializing,
        );
        assert!(
            r.starting_waits().is_empty(),
            "a static bootstrap waits for no control plane"
        );
    }

    #[test]
    fn a_static_bootstrap_is_ready_and_a_dynamic_one_once_each_type_came() {
        let now = SystemTime::now();
        let mut s = ConfigStatus::default();
        assert!(s.ready().is_err(), "unknown is not ready");
        s.observe(0, &XdsReading::parse("server.hot_restart_epoch: 0\n"), now);
        assert_eq!(s, ConfigStatus::Static);
        assert!(s.ready().is_ok());

        let mut s = ConfigStatus::default();
        s.observe(
            0,
            &XdsReading::parse(&DOWN.replace("cds.update_success: 0", "cds.update_success: 1")),
            now,
        );
        assert_eq!(
            s.ready().unwrap_err().to_string(),
            "config not received from the control plane (cds: received, lds: waiting)"
        );
        let up = DOWN
            .replace("update_success: 0", "update_success: 1")
            .replace("connected_state: 0", "connected_state: 1");
        assert!(s.observe(0, &XdsReading::parse(&up), now));
        assert!(s.ready().is_ok());
        assert!(!s.observe(0, &XdsReading::parse(&up), now), "no change");
        // The control plane goes away: still ready (Envoy serves what it received).
        let down = up.replace("connected_state: 1", "connected_state: 0");
        let later = now + std::time::Duration::from_secs(5);
        s.observe(0, &XdsReading::parse(&down), later);
        assert!(s.ready().is_ok());
        assert_eq!(s.control_plane().unwrap().disconnected_since, Some(later));
        // Kept across readings, and across a new epoch that has none either.
        s.observe(
            1,
            &XdsReading::parse(&down),
            later + std::time::Duration::from_secs(1),
        );
        assert_eq!(s.control_plane().unwrap().epoch, 1);
        assert_eq!(s.control_plane().unwrap().disconnected_since, Some(later));
        s.observe(1, &XdsReading::parse(&up), later);
        assert_eq!(s.control_plane().unwrap().disconnected_since, None);
    }

    fn overlay_of(bootstrap: &str, user: Option<&str>) -> Option<serde_json::Value> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.yaml");
        std::fs::write(&path, bootstrap).unwrap();
        fetch_wait_overlay(&path, user)
    }

    #[test]
    fn the_overlay_names_only_the_sources_the_bootstrap_has() {
        assert_eq!(overlay_of("static_resources: {}\n", None), None);
        let ads = "dynamic_resources:\n  ads_config: {api_type: GRPC}\n  lds_config: {ads: {}}\n  cds_config: {ads: {}}\n";
        assert_eq!(
            overlay_of(ads, None).unwrap(),
            serde_json::json!({"dynamic_resources": {
                "lds_config": {"initial_fetch_timeout": "0s"},
                "cds_config": {"initial_fetch_timeout": "0s"},
            }})
        );
        let cds_only = "dynamic_resources:\n  cds_config: {ads: {}}\n";
        assert_eq!(
            overlay_of(cds_only, None).unwrap(),
            serde_json::json!({"dynamic_resources": {"cds_config": {"initial_fetch_timeout": "0s"}}})
        );
        assert_eq!(overlay_of("{not yaml", None), None);
    }

    #[test]
    fn an_epochs_arguments_get_the_overlay_merged_into_theirs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.yaml");
        std::fs::write(&path, "dynamic_resources: {lds_config: {ads: {}}}\n").unwrap();
        let mut args: Vec<String> = vec!["-c".into(), "b.yaml".into()];
        assert!(wait_for_config(&mut args, &path));
        assert_eq!(args[2], "--config-yaml");
        let overlay: serde_json::Value = serde_json::from_str(&args[3]).unwrap();
        assert_eq!(
            overlay["dynamic_resources"]["lds_config"]["initial_fetch_timeout"],
            "0s"
        );

        let mut args: Vec<String> = vec!["--config-yaml=admin: {profile_path: /p}".into()];
        assert!(wait_for_config(&mut args, &path));
        assert_eq!(args.len(), 1, "one overlay: envoy refuses a second");
        let overlay: serde_json::Value =
            serde_json::from_str(args[0].strip_prefix("--config-yaml=").unwrap()).unwrap();
        assert_eq!(overlay["admin"]["profile_path"], "/p");
        assert_eq!(
            overlay["dynamic_resources"]["lds_config"]["initial_fetch_timeout"],
            "0s"
        );

        std::fs::write(&path, "static_resources: {}\n").unwrap();
        let mut args: Vec<String> = vec!["--config-yaml".into(), "{}".into()];
        assert!(!wait_for_config(&mut args, &path));
        assert_eq!(
            args,
            ["--config-yaml", "{}"],
            "a static bootstrap's untouched"
        );
    }

    #[test]
    fn the_overlay_keeps_the_users_own_and_its_sources() {
        let user = "dynamic_resources: {lds_config: {ads: {}}}\nlayered_runtime: {layers: [{name: a, static_layer: {}}]}\n";
        let got = overlay_of("static_resources: {}\n", Some(user)).unwrap();
        assert_eq!(
            got,
            serde_json::json!({
                "dynamic_resources": {"lds_config": {"ads": {}, "initial_fetch_timeout": "0s"}},
                "layered_runtime": {"layers": [{"name": "a", "static_layer": {}}]},
            })
        );
    }
}

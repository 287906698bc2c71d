//! What the agent adds to Envoy's overload manager so that Envoy fits its container: shedding
//! load before the container's memory limit (instead of an OOM kill that drops every
//! connection at once), and a bound on downstream connections below the open-file limit.
//!
//! Both go into the `--config-yaml` overlay beside the drain notice's monitor and actions
//! ([`crate::drain_notice`]): Envoy appends the overlay's lists to the bootstrap's, so an
//! operator's overload manager is kept; one that already has a monitor or action of the same
//! name would be refused as a duplicate, so the agent leaves its own out then and says why
//! ([`conflicts`]).
//!
//! **Memory** (measured on Envoy 1.40, issue 50: a 160 MiB limit, a buffering listener, 50
//! uploads of 4 MiB held open): Envoy's `fixed_heap` monitor, sized at a share of the limit
//! ([`MemoryGuard::heap_share`], 0.85: Envoy's heap is about 80% of what the cgroup counts),
//! with `shrink_heap` at 0.80 of it, `stop_accepting_requests` at 0.90 and the
//! `tcp_listener_accept` load-shed point at 0.95, kept Envoy alive 3 runs of 3; at the limit
//! itself it was OOM-killed 2 runs of 3. Envoy's own `cgroup_memory` monitor is not used: it
//! reads a fixed path, which outside a cgroup namespace is the machine's, and it counts what
//! tcmalloc keeps after the load (it shed for 15-20 s after the pressure had passed); the heap
//! monitor drops as soon as the bodies are freed, so Envoy serves again at once.
//!
//! **Connections**: `global_downstream_max_connections` at a bound derived from the open-file
//! limit Envoy runs with ([`connections_for`]): Envoy then starts without its warning that
//! downstream connections are unbounded, and refuses a connection past the bound cleanly
//! instead of failing `accept` once descriptors run out.

/// The heap monitor.
pub const FIXED_HEAP: &str = "envoy.resource_monitors.fixed_heap";
/// The downstream-connections monitor.
pub const DOWNSTREAM_CONNECTIONS: &str =
    "envoy.resource_monitors.global_downstream_max_connections";
const SHRINK_HEAP: &str = "envoy.overload_actions.shrink_heap";
const STOP_ACCEPTING_REQUESTS: &str = "envoy.overload_actions.stop_accepting_requests";
const LISTENER_ACCEPT: &str = "envoy.load_shed_points.tcp_listener_accept";
/// The runtime key that bounds downstream connections the older way.
const RUNTIME_BOUND: &str = "overload.global_downstream_max_connections";

/// Envoy sheds load before its container's memory limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryGuard {
    /// The container's memory limit (or the operator's), in bytes.
    pub limit: u64,
    /// Envoy's heap is taken as full at this share of the limit.
    pub heap_share: f64,
    /// Shares of that heap at which Envoy returns free memory to the system, answers new
    /// requests 503, and refuses new connections.
    pub thresholds: Thresholds,
}

/// When each action starts, as a share of the heap [`MemoryGuard::heap_share`] allows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// `shrink_heap`: tcmalloc returns free memory to the system.
    pub shrink_heap: f64,
    /// `stop_accepting_requests`: new requests are answered 503.
    pub stop_accepting_requests: f64,
    /// `tcp_listener_accept`: new connections are refused.
    pub reject_connections: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            shrink_heap: 0.80,
            stop_accepting_requests: 0.90,
            reject_connections: 0.95,
        }
    }
}

/// The heap share of the limit by default.
pub const HEAP_SHARE: f64 = 0.85;

impl MemoryGuard {
    /// The heap Envoy is given: the share of the limit.
    pub fn max_heap(&self) -> u64 {
        (self.limit as f64 * self.heap_share) as u64
    }
}

/// Descriptors kept for Envoy's own files, listeners, admin and upstream connections beyond
/// one per downstream, when the connections' bound is derived from the open-file limit: a
/// quarter of the limit, at most this many.
pub const DESCRIPTORS_KEPT: u64 = 1024;

/// The bound on downstream connections for an open-file limit of `nofile`: each downstream
/// connection may take an upstream one too, and some descriptors are kept for the rest (a
/// quarter of a small limit: 1024 gives 384).
pub fn connections_for(nofile: u64) -> u64 {
    let kept = DESCRIPTORS_KEPT.min(nofile / 4);
    (nofile.saturating_sub(kept) / 2).max(1)
}

/// The overload manager's parts the agent adds: monitors, actions, load-shed points.
#[derive(Debug, Default)]
pub struct Parts {
    pub(crate) monitors: Vec<serde_json::Value>,
    pub(crate) actions: Vec<serde_json::Value>,
    pub(crate) loadshed_points: Vec<serde_json::Value>,
}

impl Parts {
    /// Whether there is nothing to add.
    pub fn is_empty(&self) -> bool {
        self.monitors.is_empty() && self.actions.is_empty() && self.loadshed_points.is_empty()
    }

    /// Adds the memory guard's monitor and actions.
    pub fn memory(&mut self, guard: &MemoryGuard) {
        self.monitors.push(serde_json::json!({
            "name": FIXED_HEAP,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                "max_heap_size_bytes": guard.max_heap(),
            }
        }));
        let at = |value: f64| serde_json::json!([{ "name": FIXED_HEAP, "threshold": { "value": value } }]);
        let t = guard.thresholds;
        self.actions
            .push(serde_json::json!({ "name": SHRINK_HEAP, "triggers": at(t.shrink_heap) }));
        self.actions.push(serde_json::json!({ "name": STOP_ACCEPTING_REQUESTS, "triggers": at(t.stop_accepting_requests) }));
        self.loadshed_points.push(
            serde_json::json!({ "name": LISTENER_ACCEPT, "triggers": at(t.reject_connections) }),
        );
    }

    /// Adds the bound on downstream connections.
    pub fn connections(&mut self, max: u64) {
        self.monitors.push(serde_json::json!({
            "name": DOWNSTREAM_CONNECTIONS,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": max,
            }
        }));
    }

    /// Appends `other`'s parts (the drain notice's).
    pub fn extend(&mut self, other: serde_json::Value) {
        let take = |key: &str, into: &mut Vec<serde_json::Value>| {
            if let Some(items) = other.get(key).and_then(serde_json::Value::as_array) {
                into.extend(items.iter().cloned());
            }
        };
        take("resource_monitors", &mut self.monitors);
        take("actions", &mut self.actions);
        take("loadshed_points", &mut self.loadshed_points);
    }

    /// The overlay's `overload_manager`.
    pub fn into_json(self) -> serde_json::Value {
        let mut manager = serde_json::Map::new();
        manager.insert("resource_monitors".into(), self.monitors.into());
        if !self.actions.is_empty() {
            manager.insert("actions".into(), self.actions.into());
        }
        if !self.loadshed_points.is_empty() {
            manager.insert("loadshed_points".into(), self.loadshed_points.into());
        }
        serde_json::Value::Object(manager)
    }
}

/// What of the agent's memory guard and connections' bound the bootstrap already has (Envoy
/// would refuse a duplicate), each with why it is left out; none: both fit.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Conflicts {
    /// Why the memory guard is left out.
    pub memory: Option<String>,
    /// Why the connections' bound is left out (the operator's own wins).
    pub connections: Option<String>,
}

/// The names a bootstrap's `overload_manager` already uses, by list: Envoy refuses a second
/// monitor, action or load-shed point of a name, so every part the agent merges into the
/// overlay (the drain notice, the memory guard, the connections' bound) is checked against
/// these.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ManagerNames {
    /// `resource_monitors`' names.
    pub monitors: Vec<String>,
    /// `actions`' names.
    pub actions: Vec<String>,
    /// `loadshed_points`' names.
    pub loadshed_points: Vec<String>,
}

impl ManagerNames {
    /// The names of `bootstrap`'s overload manager (none without one).
    pub fn of(bootstrap: &serde_yaml::Value) -> Self {
        let manager = bootstrap.get("overload_manager");
        let names = |list: &str| -> Vec<String> {
            manager
                .and_then(|m| m.get(list))
                .and_then(serde_yaml::Value::as_sequence)
                .map(|items| {
                    items
                        .iter()
                        .filter_map(|i| i.get("name").and_then(serde_yaml::Value::as_str))
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default()
        };
        ManagerNames {
            monitors: names("resource_monitors"),
            actions: names("actions"),
            loadshed_points: names("loadshed_points"),
        }
    }

    /// Which of `monitors`, `actions` and `loadshed_points` the bootstrap already has, in that
    /// order; with why the part is left out when any.
    pub fn taken(
        &self,
        monitors: &[&str],
        actions: &[&str],
        loadshed_points: &[&str],
    ) -> Option<String> {
        let of = |have: &[String], ours: &[&str]| -> Vec<String> {
            have.iter()
                .filter(|n| ours.contains(&n.as_str()))
                .cloned()
                .collect()
        };
        let taken: Vec<String> = [
            of(&self.monitors, monitors),
            of(&self.actions, actions),
            of(&self.loadshed_points, loadshed_points),
        ]
        .concat();
        (!taken.is_empty()).then(|| {
            format!(
                "the bootstrap's overload_manager already has {}",
                taken.join(", ")
            )
        })
    }
}

/// The bootstrap file at `path` (YAML or JSON), parsed only when it names one of `names` at
/// all: a large bootstrap parsed whole costs the agent tens of MiB (a 1.9 MB one: 18 MiB more
/// resident for good), and almost none has them. None when it cannot be read (setup has
/// checked it already) or names none.
pub fn bootstrap_naming(path: &std::path::Path, names: &[&str]) -> Option<serde_yaml::Value> {
    let bytes = std::fs::read(path).ok()?;
    let mentions = |name: &str| bytes.windows(name.len()).any(|w| w == name.as_bytes());
    if !names.iter().any(|n| mentions(n)) {
        return None;
    }
    serde_yaml::from_slice(&bytes).ok()
}

/// [`Conflicts`] of a bootstrap: its overload manager's names, and a runtime layer's
/// `overload.global_downstream_max_connections` (the older way to bound connections).
pub fn conflicts(bootstrap: &serde_yaml::Value) -> Conflicts {
    let names = ManagerNames::of(bootstrap);
    let runtime_bound = serde_yaml::to_string(
        bootstrap
            .get("layered_runtime")
            .unwrap_or(&serde_yaml::Value::Null),
    )
    .is_ok_and(|text| text.contains(RUNTIME_BOUND));
    Conflicts {
        memory: names.taken(
            &[FIXED_HEAP],
            &[SHRINK_HEAP, STOP_ACCEPTING_REQUESTS],
            &[LISTENER_ACCEPT],
        ),
        connections: if names.monitors.iter().any(|n| n == DOWNSTREAM_CONNECTIONS) {
            Some(format!(
                "the bootstrap's overload_manager has its own {DOWNSTREAM_CONNECTIONS}"
            ))
        } else if runtime_bound {
            Some(format!("the bootstrap's runtime sets {RUNTIME_BOUND}"))
        } else {
            None
        },
    }
}

/// [`conflicts`] of the bootstrap file at `path` ([`bootstrap_naming`] the monitors, actions
/// and the runtime key).
pub fn conflicts_in(path: &std::path::Path) -> Conflicts {
    let names = [
        FIXED_HEAP,
        SHRINK_HEAP,
        STOP_ACCEPTING_REQUESTS,
        LISTENER_ACCEPT,
        DOWNSTREAM_CONNECTIONS,
        RUNTIME_BOUND,
    ];
    bootstrap_naming(path, &names)
        .map(|b| conflicts(&b))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_guard_sizes_the_heap_below_the_limit_with_the_measured_thresholds() {
        let guard = MemoryGuard {
            limit: 160 << 20,
            heap_share: HEAP_SHARE,
            thresholds: Thresholds::default(),
        };
        assert_eq!(guard.max_heap(), 142_606_336);
        let mut parts = Parts::default();
        parts.memory(&guard);
        parts.connections(connections_for(1 << 20));
        let json = parts.into_json();
        assert_eq!(
            json["resource_monitors"][0]["typed_config"]["max_heap_size_bytes"],
            142_606_336
        );
        assert_eq!(json["actions"][1]["name"], STOP_ACCEPTING_REQUESTS);
        assert_eq!(json["actions"][1]["triggers"][0]["threshold"]["value"], 0.9);
        assert_eq!(
            json["loadshed_points"][0]["triggers"][0]["threshold"]["value"],
            0.95
        );
        assert_eq!(
            json["resource_monitors"][1]["typed_config"]["max_active_downstream_connections"],
            523_776
        );
        assert_eq!(connections_for(1024), 384, "a container's common default");
        assert_eq!(connections_for(20_000), 9_488);
        assert_eq!(connections_for(2), 1);
    }

    #[test]
    fn an_operators_own_names_leave_ours_out() {
        let yaml = |s: &str| serde_yaml::from_str::<serde_yaml::Value>(s).unwrap();
        assert_eq!(
            conflicts(&yaml("static_resources: {}")),
            Conflicts::default()
        );
        let theirs = yaml(
            "overload_manager:\n  resource_monitors:\n  - name: envoy.resource_monitors.global_downstream_max_connections\n  actions:\n  - name: envoy.overload_actions.stop_accepting_requests\n",
        );
        let c = conflicts(&theirs);
        assert!(c.memory.unwrap().contains(STOP_ACCEPTING_REQUESTS));
        assert!(c.connections.unwrap().contains(DOWNSTREAM_CONNECTIONS));
        let runtime = yaml(
            "layered_runtime:\n  layers:\n  - name: static\n    static_layer:\n      overload.global_downstream_max_connections: 100\n",
        );
        let c = conflicts(&runtime);
        assert_eq!(c.memory, None);
        assert!(c.connections.unwrap().contains("runtime"));
    }
}

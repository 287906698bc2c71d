//! Which of Envoy's listeners a drain reaches, learnt from Envoy at drain time.
//!
//! Envoy's `POST /drain_listeners?inboundonly` drains only the listeners whose
//! `traffic_direction` is `INBOUND` (envoyproxy/envoy#37873): a listener with no direction (most
//! gateways, every node proxy) is never drained by it, and nothing says so. So the agent does
//! not send `inboundonly` blind. At each drain it asks Envoy what its listeners are (static and
//! LDS alike: [`read`]), decides with the pure function [`plan`], drains, and returns the
//! [`DrainPlan`] so that the status and the stop event can name what was drained:
//!
//! | asked ([`Scope`]) | node proxy | sidecar |
//! |---|---|---|
//! | `Auto` (the default) | every listener | the inbound ones; every listener where none is inbound (said in the plan's [`PlanNote::NoInbound`]) |
//! | `Inbound` | the inbound ones | the inbound ones |
//! | `All` | every listener | every listener |
//!
//! A sidecar drains inbound listeners only (pilot-agent's semantics: the app keeps its outbound
//! traffic while its pod terminates). Where Envoy cannot say what its listeners are (the reading
//! failed), the plan falls back to the mode's own rule without the check and says why
//! ([`PlanNote::Unknown`]).
//!
//! The reading is three admin calls at each drain: `/listeners?format=json` (each listener's
//! name and bound address, which finds port-0 binds) and `/config_dump` of the static and of
//! the dynamic listeners (their active state), so a large config costs Envoy a serialization
//! of its listeners, not of its clusters.

use std::net::SocketAddr;

use serde::Deserialize;

use crate::admin::{AdminClient, AdminError, DrainListeners};

/// A listener's `traffic_direction`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// `INBOUND`.
    Inbound,
    /// `OUTBOUND`.
    Outbound,
    /// None given (`UNSPECIFIED`).
    Unspecified,
}

impl Direction {
    /// As Envoy's config spells it.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Inbound => "INBOUND",
            Direction::Outbound => "OUTBOUND",
            Direction::Unspecified => "UNSPECIFIED",
        }
    }

    fn parse(text: Option<&str>) -> Direction {
        match text {
            Some("INBOUND") => Direction::Inbound,
            Some("OUTBOUND") => Direction::Outbound,
            _ => Direction::Unspecified,
        }
    }
}

/// One of Envoy's listeners, as a drain needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    /// Its name in the config (`ingress_http`).
    pub name: String,
    /// Its traffic direction.
    pub direction: Direction,
    /// The name of its stats (`listener.<stat_name>.downstream_cx_active`): its `stat_prefix`,
    /// else its configured address with `:` as `_` (`0.0.0.0_8080`, `[__]_8080`; port 0 as
    /// configured, whatever port it bound).
    pub stat_name: String,
    /// The port it is bound to (a pipe or an internal listener has none).
    pub port: Option<u16>,
    /// A UDP (QUIC) listener: the kernel's TCP table does not see its connections.
    pub udp: bool,
    /// `drain_type: MODIFY_ONLY`: Envoy's failed health checks (`/healthcheck/fail`) do not
    /// drain it (they drain every `DEFAULT` one).
    pub modify_only: bool,
    /// `bypass_overload_manager: true` (Envoy 1.31+): the overload manager's actions, the
    /// agent's drain notice among them, do not reach its connections.
    pub bypasses_overload_manager: bool,
}

/// How many drained listeners a log line names.
pub const LOGGED_NAMES: usize = 20;

/// Which listeners a drain is asked to reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Scope {
    /// The mode's rule: every listener for a node proxy; a sidecar's inbound listeners, or
    /// every listener where none is inbound.
    #[default]
    Auto,
    /// The listeners marked `INBOUND` only (Envoy's `inboundonly`).
    Inbound,
    /// Every listener.
    All,
}

impl Scope {
    /// `auto`, `inbound` or `all`.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Auto => "auto",
            Scope::Inbound => "inbound",
            Scope::All => "all",
        }
    }
}

/// Why a plan drains what it drains, beyond what was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanNote {
    /// As asked, with the listeners known.
    AsAsked,
    /// A sidecar asked for its default (inbound listeners) but has no inbound listener: every
    /// listener is drained instead, so that the drain reaches its clients.
    NoInbound,
    /// Asked for inbound listeners only, and none is inbound: Envoy drains nothing.
    NothingInbound,
    /// Envoy could not say what its listeners are: the mode's rule without the check.
    Unknown(String),
    /// No Envoy of ours serves (it stops, or was handed over): nothing to drain.
    NotServing,
}

/// What a drain reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainPlan {
    /// What was asked.
    pub asked: Scope,
    /// Whether Envoy was asked to drain its inbound listeners only.
    pub inbound_only: bool,
    /// The listeners drained (empty when they are not known: see the note).
    pub drained: Vec<Listener>,
    /// Every listener Envoy reported, drained or not.
    pub listeners: Vec<Listener>,
    /// Why it drains what it drains.
    pub note: PlanNote,
}

impl DrainPlan {
    /// The answer to a drain when no Envoy of ours serves.
    pub fn not_serving(asked: Scope) -> Self {
        DrainPlan {
            asked,
            inbound_only: false,
            drained: Vec::new(),
            listeners: Vec::new(),
            note: PlanNote::NotServing,
        }
    }

    /// The drained listeners' names, comma-separated, for logs: the first [`LOGGED_NAMES`].
    pub fn drained_names(&self) -> String {
        if self.drained.is_empty() {
            return match &self.note {
                PlanNote::Unknown(_) if self.inbound_only => "the inbound ones (unknown)".into(),
                PlanNote::Unknown(_) => "all (unknown)".into(),
                _ => "none".into(),
            };
        }
        // A log line, not the list: a large config drains hundreds (the status has them all).
        let mut names = self
            .drained
            .iter()
            .take(LOGGED_NAMES)
            .map(|l| l.name.as_str())
            .collect::<Vec<_>>()
            .join(",");
        if self.drained.len() > LOGGED_NAMES {
            names.push_str(&format!(" and {} more", self.drained.len() - LOGGED_NAMES));
        }
        names
    }

    /// The configured name of the listener whose stats are named `stat_name`, if known.
    pub fn name_of(&self, stat_name: &str) -> Option<&str> {
        self.listeners
            .iter()
            .find(|l| l.stat_name == stat_name)
            .map(|l| l.name.as_str())
    }
}

/// Decides which listeners a drain reaches: `scope` as asked, `sidecar` the mode, `listeners`
/// what Envoy reported (or why it could not).
pub fn plan(scope: Scope, sidecar: bool, listeners: Result<Vec<Listener>, String>) -> DrainPlan {
    let listeners = match listeners {
        Ok(l) => l,
        Err(why) => {
            return DrainPlan {
                asked: scope,
                inbound_only: match scope {
                    Scope::Auto => sidecar,
                    Scope::Inbound => true,
                    Scope::All => false,
                },
                drained: Vec::new(),
                listeners: Vec::new(),
                note: PlanNote::Unknown(why),
            };
        }
    };
    let has_inbound = listeners.iter().any(|l| l.direction == Direction::Inbound);
    let (inbound_only, note) = match scope {
        Scope::All => (false, PlanNote::AsAsked),
        Scope::Auto if !sidecar => (false, PlanNote::AsAsked),
        Scope::Auto if has_inbound => (true, PlanNote::AsAsked),
        Scope::Auto => (false, PlanNote::NoInbound),
        Scope::Inbound if has_inbound => (true, PlanNote::AsAsked),
        Scope::Inbound => (true, PlanNote::NothingInbound),
    };
    let drained = listeners
        .iter()
        .filter(|l| !inbound_only || l.direction == Direction::Inbound)
        .cloned()
        .collect();
    DrainPlan {
        asked: scope,
        inbound_only,
        drained,
        listeners,
        note,
    }
}

/// Reads Envoy's listeners: three admin calls, each bounded by the client's timeout.
pub async fn read(admin: &AdminClient) -> Result<Vec<Listener>, AdminError> {
    let bound = admin.listeners().await?;
    // Envoy cannot mask fields inside a listener packed in a dynamic listener's state, nor
    // take a whole packed listener as a mask (400, "could not be successfully used"; seen on
    // 1.40): whole static listeners, and the active state of the LDS ones.
    let mut configured = admin
        .config_dump("static_listeners", "", parse_dump)
        .await?;
    configured.extend(
        admin
            .config_dump(
                "dynamic_listeners",
                "name,active_state.listener",
                parse_dump,
            )
            .await?,
    );
    Ok(bound
        .into_iter()
        .map(|status| {
            let config = configured.iter().find(|c| c.name == status.name);
            Listener {
                direction: config.map_or(Direction::Unspecified, |c| c.direction),
                stat_name: config.map_or_else(
                    || status.local_address.map(stat_name_of).unwrap_or_default(),
                    |c| c.stat_name.clone(),
                ),
                port: status.local_address.map(|a| a.port()),
                udp: config.is_some_and(|c| c.udp),
                modify_only: config.is_some_and(|c| c.modify_only),
                bypasses_overload_manager: config.is_some_and(|c| c.bypasses_overload_manager),
                name: status.name,
            }
        })
        .collect())
}

/// Reads the listeners, decides and drains: the plan Envoy accepted. A failed reading is no
/// failed drain: the plan says the listeners are unknown and the mode's rule applies.
pub async fn drain(
    admin: &AdminClient,
    scope: Scope,
    sidecar: bool,
    skip_exit: bool,
) -> Result<DrainPlan, AdminError> {
    let listeners = read(admin).await.map_err(|e| e.to_string());
    let plan = plan(scope, sidecar, listeners);
    let options = DrainListeners {
        inbound_only: plan.inbound_only,
        graceful: true,
        skip_exit,
    };
    match &plan.note {
        PlanNote::AsAsked => tracing::info!(
            admin = %admin.addr(), endpoint = %options.endpoint(), drained = %plan.drained_names(),
            "draining envoy listeners"
        ),
        PlanNote::NoInbound => tracing::warn!(
            admin = %admin.addr(), endpoint = %options.endpoint(), drained = %plan.drained_names(),
            "no listener is marked traffic_direction INBOUND: draining every listener"
        ),
        PlanNote::NothingInbound => tracing::warn!(
            admin = %admin.addr(), endpoint = %options.endpoint(),
            "inbound listeners only were asked for, and no listener is marked INBOUND: envoy drains none"
        ),
        PlanNote::NotServing => {}
        PlanNote::Unknown(why) => tracing::warn!(
            admin = %admin.addr(), endpoint = %options.endpoint(), error = %why,
            "envoy's listeners are unknown: draining by the mode's rule"
        ),
    }
    admin.drain_listeners(options).await?;
    Ok(plan)
}

/// A listener's stats name from its address (`127.0.0.1:80` → `127.0.0.1_80`,
/// `[::]:80` → `[__]_80`), as Envoy makes it when no `stat_prefix` is given.
pub fn stat_name_of(addr: SocketAddr) -> String {
    addr.to_string().replace(':', "_")
}

struct Configured {
    name: String,
    direction: Direction,
    stat_name: String,
    udp: bool,
    modify_only: bool,
    bypasses_overload_manager: bool,
}

#[derive(Deserialize)]
struct Dump {
    #[serde(default)]
    configs: Vec<DumpEntry>,
}

#[derive(Deserialize)]
struct DumpEntry {
    /// A static listener's.
    listener: Option<RawListener>,
    /// A dynamic listener's.
    active_state: Option<ActiveState>,
}

#[derive(Deserialize)]
struct ActiveState {
    listener: Option<RawListener>,
}

#[derive(Deserialize)]
struct RawListener {
    #[serde(default)]
    name: String,
    traffic_direction: Option<String>,
    #[serde(default)]
    stat_prefix: String,
    address: Option<RawAddress>,
    drain_type: Option<String>,
    #[serde(default)]
    bypass_overload_manager: bool,
}

#[derive(Deserialize)]
struct RawAddress {
    socket_address: Option<RawSocketAddress>,
}

#[derive(Deserialize)]
struct RawSocketAddress {
    #[serde(default)]
    address: String,
    #[serde(default)]
    port_value: u16,
    protocol: Option<String>,
}

fn parse_dump(body: &[u8]) -> Result<Vec<Configured>, serde_json::Error> {
    // Envoy answers `{}` when there is nothing of the kind.
    let dump: Dump = serde_json::from_slice(body)?;
    Ok(dump
        .configs
        .into_iter()
        .filter_map(|e| e.listener.or(e.active_state.and_then(|a| a.listener)))
        .map(|l| {
            let socket = l.address.and_then(|a| a.socket_address);
            let udp = socket
                .as_ref()
                .is_some_and(|s| s.protocol.as_deref() == Some("UDP"));
            let stat_name = if !l.stat_prefix.is_empty() {
                l.stat_prefix
            } else {
                socket
                    .and_then(|s| {
                        s.address
                            .parse::<std::net::IpAddr>()
                            .ok()
                            .map(|ip| stat_name_of(SocketAddr::new(ip, s.port_value)))
                    })
                    .unwrap_or_default()
            };
            Configured {
                name: l.name,
                direction: Direction::parse(l.traffic_direction.as_deref()),
                stat_name,
                udp,
                modify_only: l.drain_type.as_deref() == Some("MODIFY_ONLY"),
                bypasses_overload_manager: l.bypass_overload_manager,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener(name: &str, direction: Direction) -> Listener {
        Listener {
            name: name.to_owned(),
            direction,
            stat_name: format!("{name}_stats"),
            port: Some(1),
            udp: false,
            modify_only: false,
            bypasses_overload_manager: false,
        }
    }

    fn names(plan: &DrainPlan) -> Vec<&str> {
        plan.drained.iter().map(|l| l.name.as_str()).collect()
    }

    #[test]
    fn the_plan_for_each_mode_scope_and_config() {
        use Direction::*;
        let mixed = vec![
            listener("in", Inbound),
            listener("out", Outbound),
            listener("none", Unspecified),
        ];
        let no_inbound = vec![listener("out", Outbound), listener("none", Unspecified)];
        // (scope, sidecar, listeners) -> (inbound_only, drained, note)
        type Case<'a> = (Scope, bool, &'a Vec<Listener>, bool, Vec<&'a str>, PlanNote);
        let table: Vec<Case<'_>> = vec![
            (
                Scope::Auto,
                false,
                &mixed,
                false,
                vec!["in", "out", "none"],
                PlanNote::AsAsked,
            ),
            (
                Scope::Auto,
                false,
                &no_inbound,
                false,
                vec!["out", "none"],
                PlanNote::AsAsked,
            ),
            (
                Scope::Auto,
                true,
                &mixed,
                true,
                vec!["in"],
                PlanNote::AsAsked,
            ),
            (
                Scope::Auto,
                true,
                &no_inbound,
                false,
                vec!["out", "none"],
                PlanNote::NoInbound,
            ),
            (
                Scope::Inbound,
                false,
                &mixed,
                true,
                vec!["in"],
                PlanNote::AsAsked,
            ),
            (
                Scope::Inbound,
                true,
                &no_inbound,
                true,
                vec![],
                PlanNote::NothingInbound,
            ),
            (
                Scope::All,
                true,
                &mixed,
                false,
                vec!["in", "out", "none"],
                PlanNote::AsAsked,
            ),
        ];
        for (scope, sidecar, listeners, inbound_only, drained, note) in table {
            let p = plan(scope, sidecar, Ok(listeners.clone()));
            let case = format!("{scope:?} sidecar={sidecar} {:?}", names(&p));
            assert_eq!(p.inbound_only, inbound_only, "{case}");
            assert_eq!(names(&p), drained, "{case}");
            assert_eq!(p.note, note, "{case}");
            assert_eq!(p.listeners.len(), listeners.len(), "{case}");
        }
    }

    #[test]
    fn unknown_listeners_fall_back_to_the_mode_s_rule_and_say_so() {
        let p = plan(Scope::Auto, true, Err("timed out".into()));
        assert!(p.inbound_only);
        assert_eq!(p.note, PlanNote::Unknown("timed out".into()));
        assert_eq!(p.drained_names(), "the inbound ones (unknown)");
        let p = plan(Scope::Auto, false, Err("timed out".into()));
        assert!(!p.inbound_only);
        assert_eq!(p.drained_names(), "all (unknown)");
        assert!(plan(Scope::Inbound, false, Err(String::new())).inbound_only);
    }

    #[test]
    fn a_log_line_names_the_first_listeners_of_a_large_drain() {
        let many: Vec<Listener> = (0..25)
            .map(|i| listener(&format!("l{i}"), Direction::Unspecified))
            .collect();
        let names = plan(Scope::All, false, Ok(many)).drained_names();
        assert!(
            names.starts_with("l0,l1,") && names.ends_with(",l19 and 5 more"),
            "{names}"
        );
        assert!(!plan(Scope::All, true, Err(String::new())).inbound_only);
    }

    #[test]
    fn dumps_parse_as_envoy_writes_them() {
        // As Envoy 1.40 answers the masked `/config_dump?resource=static_listeners`.
        let statics = br#"{"configs":[
          {"@type":"type.googleapis.com/envoy.admin.v3.ListenersConfigDump.StaticListener",
           "listener":{"@type":"type.googleapis.com/envoy.config.listener.v3.Listener","name":"in_l",
             "address":{"socket_address":{"address":"127.0.0.1","port_value":19001}},
             "traffic_direction":"INBOUND"}},
          {"@type":"type.googleapis.com/envoy.admin.v3.ListenersConfigDump.StaticListener",
           "listener":{"@type":"type.googleapis.com/envoy.config.listener.v3.Listener","name":"none_l",
             "address":{"socket_address":{"address":"::","port_value":80}}}},
          {"listener":{"name":"quic","stat_prefix":"h3",
             "address":{"socket_address":{"protocol":"UDP","address":"0.0.0.0","port_value":443}}}}
        ]}"#;
        let parsed = parse_dump(statics).unwrap();
        let got: Vec<(&str, Direction, &str, bool)> = parsed
            .iter()
            .map(|c| (c.name.as_str(), c.direction, c.stat_name.as_str(), c.udp))
            .collect();
        assert_eq!(
            got,
            vec![
                ("in_l", Direction::Inbound, "127.0.0.1_19001", false),
                ("none_l", Direction::Unspecified, "[__]_80", false),
                ("quic", Direction::Unspecified, "h3", true),
            ]
        );
        let dynamics = br#"{"configs":[{"name":"lds_out","active_state":{"listener":{
            "name":"lds_out","traffic_direction":"OUTBOUND","drain_type":"MODIFY_ONLY",
            "bypass_overload_manager":true,
            "address":{"socket_address":{"address":"0.0.0.0","port_value":15001}}}}},
            {"name":"warming_only"}]}"#;
        let parsed = parse_dump(dynamics).unwrap();
        assert_eq!(
            parsed.len(),
            1,
            "a listener with no active state is not serving"
        );
        assert_eq!(parsed[0].direction, Direction::Outbound);
        assert_eq!(parsed[0].stat_name, "0.0.0.0_15001");
        // What a sidecar's app rule asks of an outbound listener (issue 49).
        assert!(parsed[0].modify_only && parsed[0].bypasses_overload_manager);
        let statics = parse_dump(statics).unwrap();
        assert!(
            statics
                .iter()
                .all(|c| !c.modify_only && !c.bypasses_overload_manager)
        );
        assert!(parse_dump(b"{}").unwrap().is_empty());
    }
}

//! Where a supervisor's first epoch starts: a pure decision from what the node's heartbeats
//! and the shared admin port say, taken under the node's epoch lock.
//!
//! - Nothing answers on the admin port and no other supervisor of the family claims to serve:
//!   start at epoch 0.
//! - A LIVE Envoy of the family answers, with our hot-restart version, and the supervisor that
//!   runs it (if any) is neither restarting nor still draining a parent of its own: take over,
//!   at its epoch + 1 (never a third generation).
//! - Anything else: wait and look again (something answers that is not ours to start beside;
//!   a predecessor is mid-handoff; an admin port that accepts but does not answer). Epoch 0 is
//!   never started while something answers on the admin port.

use envoy_agent_proxy::{AdminError, ServerInfo, ServerState};

use crate::node::{Heartbeat, NodeState};

/// What to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Discovery {
    /// No Envoy of the family runs on the node: start at epoch 0.
    Fresh,
    /// Take over from the LIVE Envoy at `epoch`: start at `epoch + 1`.
    TakeOver {
        /// The predecessor's epoch.
        epoch: u32,
        /// The base id its family runs under (ours, or our cold handovers' other one).
        base_id: u32,
        /// Who runs it (its heartbeat's identity), if anyone says so.
        identity: Option<String>,
    },
    /// The LIVE Envoy has another hot-restart version: it cannot be hot-restarted from.
    Incompatible {
        /// Its version.
        theirs: String,
        /// The base id its family runs under.
        base_id: u32,
        /// Who runs it.
        identity: Option<String>,
    },
    /// Not now; the reason.
    Wait(String),
    /// The node's LIVE family is run by a newer pod (a later generation of the rollout): an
    /// older agent (one recovering from a crash, say) must not take it back, nor start a
    /// family beside it.
    Newer {
        /// Who runs it.
        identity: String,
        /// Its generation.
        theirs: u64,
    },
}

/// Whether an admin error means nothing listens on the port.
pub(crate) fn refused(error: &AdminError) -> bool {
    error.nothing_listens()
}

/// Decides, from the other supervisors' fresh heartbeats of our base ids, the admin port's
/// answer and our own hot-restart version, at `now_ms`. A family runs under either of
/// `base_ids` (`--base-id`, and `--cold-base-id` after a cold handover).
pub(crate) fn decide(
    others: &[Heartbeat],
    admin: &Result<ServerInfo, AdminError>,
    our_admin: &str,
    base_ids: &[u32],
    version: &str,
    generation: u64,
    now_ms: u64,
) -> Discovery {
    // A family whose Envoy answers elsewhere cannot be found, nor handed over: not ours.
    if let Some(h) = others
        .iter()
        .filter(|h| claims_to_serve(h))
        .find(|h| !h.admin_address.is_empty() && h.admin_address != our_admin)
    {
        return Discovery::Wait(format!(
            "{}'s envoy answers admin calls at {}, ours at {our_admin}: pods with different \
             admin addresses cannot hand envoy over (give this pod the same --envoy-admin and \
             bootstrap admin, or restart the node's pods instead of a surge rollout)",
            h.identity, h.admin_address
        ));
    }
    match admin {
        Err(e) if refused(e) => when_nothing_answers(others, our_admin),
        Err(e) => Discovery::Wait(format!("the admin address does not answer: {e}")),
        Ok(info) if !base_ids.iter().any(|b| u64::from(*b) == info.base_id) => {
            Discovery::Wait(format!(
                "the admin address answers for another Envoy family (base id {}, ours {base_ids:?})",
                info.base_id
            ))
        }
        // DRAINING is a LIVE Envoy whose health checks were failed (its pod shuts down): a
        // successor still takes it over, so that the node keeps serving.
        Ok(info) if !matches!(info.state, ServerState::Live | ServerState::Draining) => {
            Discovery::Wait(format!("the node's Envoy is {:?}, not LIVE", info.state))
        }
        Ok(info) => when_ours_answers(others, info, version, generation, now_ms),
    }
}

/// Whether a heartbeat says its supervisor runs (or is about to run, or ran until a
/// handover) the family's Envoy.
fn claims_to_serve(h: &Heartbeat) -> bool {
    matches!(
        h.state,
        NodeState::Serving | NodeState::Starting | NodeState::HandedOver
    )
}

/// Nothing listens on the admin port: a fresh start, unless a supervisor says it serves.
fn when_nothing_answers(others: &[Heartbeat], our_admin: &str) -> Discovery {
    match others.iter().find(|h| claims_to_serve(h)) {
        None => Discovery::Fresh,
        Some(h) if h.admin_address.is_empty() => Discovery::Wait(format!(
            "{} says it runs epoch {} but nothing answers at the admin address {our_admin} \
             (a starting epoch may hold it; or it is an agent of an earlier release whose \
             envoy answers elsewhere, a TCP admin port: then give this pod the same admin, \
             --envoy-admin bootstrap)",
            h.identity, h.newest_epoch
        )),
        Some(h) => Discovery::Wait(format!(
            "{} says it runs epoch {} but nothing answers at the admin address (a starting \
             epoch may hold it)",
            h.identity, h.newest_epoch
        )),
    }
}

/// A LIVE (or DRAINING) Envoy of one of our families answers: take it over, hot or cold,
/// unless its supervisor is newer or not done with a restart of its own.
fn when_ours_answers(
    others: &[Heartbeat],
    info: &ServerInfo,
    version: &str,
    generation: u64,
    now_ms: u64,
) -> Discovery {
    // Checked by the caller: one of ours.
    let base_id = u32::try_from(info.base_id).unwrap_or_default();
    // The supervisor of the answering epoch, else the newest claimant.
    let others: Vec<&Heartbeat> = others.iter().filter(|h| h.base_id == base_id).collect();
    let others = others.as_slice();
    let owner = others
        .iter()
        .copied()
        .filter(|h| claims_to_serve(h))
        .find(|h| h.newest_epoch == info.restart_epoch)
        .or_else(|| {
            others
                .iter()
                .copied()
                .filter(|h| claims_to_serve(h))
                .max_by_key(|h| h.newest_epoch)
        });
    let identity = owner.map(|h| h.identity.clone());
    // Rollouts go one way: before any takeover, hot or cold.
    if let Some(h) = owner.filter(|h| h.generation > generation) {
        return Discovery::Newer {
            identity: h.identity.clone(),
            theirs: h.generation,
        };
    }
    if info.hot_restart_version != version {
        return Discovery::Incompatible {
            theirs: info.hot_restart_version.clone(),
            base_id,
            identity,
        };
    }
    match owner {
        Some(h) if h.state == NodeState::Starting || h.restart_in_flight => {
            Discovery::Wait(format!("{} is restarting", h.identity))
        }
        Some(h) if h.parent_draining_until_unix_ms > now_ms => Discovery::Wait(format!(
            "{}'s previous generation still drains (until Unix ms {})",
            h.identity, h.parent_draining_until_unix_ms
        )),
        Some(h) if h.newest_epoch > info.restart_epoch => Discovery::Wait(format!(
            "{} runs epoch {}, newer than the answering {}",
            h.identity, h.newest_epoch, info.restart_epoch
        )),
        _ => Discovery::TakeOver {
            epoch: info.restart_epoch,
            base_id,
            identity,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::node::FORMAT;

    const NOW: u64 = 1_000_000;
    const OURS: &str = "unix:/tmp/envoy-agent-hr-0/7/envoy_admin_7";

    fn hb(identity: &str, state: NodeState, epoch: u32) -> Heartbeat {
        Heartbeat {
            format: FORMAT.to_owned(),
            identity: identity.to_owned(),
            pid: 1,
            base_id: 7,
            hot_restart_version: "11.104".to_owned(),
            newest_epoch: epoch,
            envoy_pid: 9,
            state,
            updated_unix_ms: NOW,
            parent_draining_until_unix_ms: 0,
            restart_in_flight: false,
            cold_takeover_of: None,
            handover: None,
            socket_path: String::new(),
            admin_address: String::new(),
            generation: 0,
        }
    }

    fn live(epoch: u32) -> Result<ServerInfo, AdminError> {
        Ok(ServerInfo {
            version: "x".to_owned(),
            state: ServerState::Live,
            restart_epoch: epoch,
            base_id: 7,
            hot_restart_version: "11.104".to_owned(),
            uptime_current_epoch: "1s".to_owned(),
            socket_path: envoy_agent_proxy::SocketPath::envoy_default(),
        })
    }

    fn refused_admin() -> Result<ServerInfo, AdminError> {
        Err(AdminError::Connect {
            addr: SocketAddr::from(([127, 0, 0, 1], 1)).into(),
            endpoint: "/server_info".to_owned(),
            source: std::io::ErrorKind::ConnectionRefused.into(),
        })
    }

    fn decide_now(others: &[Heartbeat], admin: &Result<ServerInfo, AdminError>) -> Discovery {
        decide(others, admin, OURS, &[7], "11.104", 5, NOW)
    }

    #[test]
    fn nothing_on_the_node_starts_at_zero() {
        assert_eq!(decide_now(&[], &refused_admin()), Discovery::Fresh);
        // A pod that is only waiting serves nothing.
        let waiting = hb("c", NodeState::Waiting, 0);
        assert_eq!(decide_now(&[waiting], &refused_admin()), Discovery::Fresh);
    }

    #[test]
    fn a_predecessor_whose_health_checks_failed_is_taken_over_a_starting_one_is_not() {
        let a = hb("a", NodeState::Serving, 3);
        let mut draining = live(3);
        if let Ok(i) = &mut draining {
            i.state = ServerState::Draining;
        }
        assert!(matches!(
            decide_now(std::slice::from_ref(&a), &draining),
            Discovery::TakeOver { epoch: 3, .. }
        ));
        let mut starting = live(3);
        if let Ok(i) = &mut starting {
            i.state = ServerState::Initializing;
        }
        assert!(matches!(decide_now(&[a], &starting), Discovery::Wait(_)));
    }

    #[test]
    fn never_epoch_zero_while_something_answers() {
        let mut other = live(0);
        if let Ok(i) = &mut other {
            i.base_id = 8;
        }
        assert!(matches!(decide_now(&[], &other), Discovery::Wait(_)));
        let timeout = Err(AdminError::Timeout {
            addr: SocketAddr::from(([127, 0, 0, 1], 1)).into(),
            endpoint: "/server_info".to_owned(),
            timeout: std::time::Duration::from_secs(2),
        });
        assert!(matches!(decide_now(&[], &timeout), Discovery::Wait(_)));
        // A serving claimant whose admin listener is gone: not epoch 0 either.
        let a = hb("a", NodeState::Serving, 3);
        assert!(matches!(
            decide_now(&[a], &refused_admin()),
            Discovery::Wait(_)
        ));
    }

    /// A predecessor whose Envoy answers admin calls elsewhere (another --envoy-admin, another
    /// bootstrap admin) is never taken over, nor started beside: whatever answers at ours.
    #[test]
    fn a_predecessor_on_another_admin_address_is_waited_for_naming_both() {
        let mut a = hb("a", NodeState::Serving, 3);
        a.admin_address = "127.0.0.1:15000".to_owned();
        for admin in [refused_admin(), live(3)] {
            let Discovery::Wait(why) = decide_now(std::slice::from_ref(&a), &admin) else {
                panic!("not a wait");
            };
            assert!(
                why.contains("127.0.0.1:15000") && why.contains(OURS),
                "{why}"
            );
        }
        // The same address: taken over as ever.
        a.admin_address = OURS.to_owned();
        assert!(matches!(
            decide_now(std::slice::from_ref(&a), &live(3)),
            Discovery::TakeOver { epoch: 3, .. }
        ));
        // An agent of an earlier release says nothing: a wait that says what may be the cause.
        a.admin_address = String::new();
        let Discovery::Wait(why) = decide_now(&[a], &refused_admin()) else {
            panic!("not a wait");
        };
        assert!(why.contains("--envoy-admin bootstrap"), "{why}");
    }

    /// Issue 31: an older agent (ours is generation 5) never takes over from a newer pod's
    /// LIVE family, nor from one of another hot-restart version (a cold family beside it);
    /// an older or equal one it does.
    #[test]
    fn never_takes_over_from_a_newer_pod() {
        let mut newer = hb("b", NodeState::Serving, 0);
        newer.generation = 6;
        assert_eq!(
            decide_now(std::slice::from_ref(&newer), &live(0)),
            Discovery::Newer {
                identity: "b".to_owned(),
                theirs: 6
            }
        );
        let mut incompatible = live(0);
        if let Ok(i) = &mut incompatible {
            i.hot_restart_version = "11.120".to_owned();
        }
        assert!(matches!(
            decide_now(std::slice::from_ref(&newer), &incompatible),
            Discovery::Newer { .. }
        ));
        for older in [0, 4, 5] {
            newer.generation = older;
            assert!(
                matches!(
                    decide_now(std::slice::from_ref(&newer), &live(0)),
                    Discovery::TakeOver { .. }
                ),
                "generation {older}"
            );
        }
    }

    #[test]
    fn takes_over_from_a_live_serving_predecessor() {
        let a = hb("a", NodeState::Serving, 3);
        assert_eq!(
            decide_now(&[a], &live(3)),
            Discovery::TakeOver {
                epoch: 3,
                base_id: 7,
                identity: Some("a".to_owned())
            }
        );
        // A live family without any heartbeat (its supervisor's file is gone): ours to take.
        assert_eq!(
            decide_now(&[], &live(5)),
            Discovery::TakeOver {
                epoch: 5,
                base_id: 7,
                identity: None
            }
        );
    }

    #[test]
    fn waits_for_a_predecessor_mid_handoff() {
        let mut a = hb("a", NodeState::Serving, 3);
        a.parent_draining_until_unix_ms = NOW + 500;
        assert!(matches!(
            decide_now(std::slice::from_ref(&a), &live(3)),
            Discovery::Wait(_)
        ));
        a.parent_draining_until_unix_ms = NOW - 1;
        a.restart_in_flight = true;
        assert!(matches!(decide_now(&[a], &live(3)), Discovery::Wait(_)));
        let starting = hb("b", NodeState::Starting, 4);
        assert!(matches!(
            decide_now(&[starting], &live(3)),
            Discovery::Wait(_)
        ));
    }

    #[test]
    fn another_hot_restart_version_cannot_be_taken_over() {
        let mut info = live(2);
        if let Ok(i) = &mut info {
            i.hot_restart_version = "12.104".to_owned();
        }
        assert_eq!(
            decide_now(&[hb("a", NodeState::Serving, 2)], &info),
            Discovery::Incompatible {
                theirs: "12.104".to_owned(),
                base_id: 7,
                identity: Some("a".to_owned())
            }
        );
    }

    #[test]
    fn a_family_under_our_other_base_id_is_ours_to_take_over() {
        let mut info = live(4);
        if let Ok(i) = &mut info {
            i.base_id = 8;
        }
        let mut a = hb("a", NodeState::Serving, 4);
        a.base_id = 8;
        // A heartbeat of the other base id does not speak for the family that answers.
        let stale = hb("z", NodeState::Serving, 9);
        assert_eq!(
            decide(&[stale, a], &info, OURS, &[7, 8], "11.104", 5, NOW),
            Discovery::TakeOver {
                epoch: 4,
                base_id: 8,
                identity: Some("a".to_owned())
            }
        );
        assert!(matches!(
            decide(&[], &info, OURS, &[7], "11.104", 5, NOW),
            Discovery::Wait(_)
        ));
    }
}

//! Draining Envoy's listeners and knowing when the drain is done.
//!
//! # Theory of operation
//!
//! A drain is one admin call, [`drain_listeners`]: Envoy starts telling clients to go away
//! (`Connection: close`, HTTP/2 GOAWAY) and, unless `skip_exit`, stops its listeners when its
//! `--drain-time-s` ends. Envoy does not exit because of a drain: the supervisor decides when
//! to stop it, either after a fixed time or once [`active_connections`] reaches zero.
//!
//! Counting is Istio's rule, fixed where it was wrong: sum the `listener.*downstream_cx_active`
//! gauges, but not per-worker duplicates (`worker_N`), the admin listener, Envoy-internal
//! listeners, or listeners on excluded ports (the agent's own status and metrics ports, whose
//! probe and scrape connections would otherwise keep the count above zero forever). Ports are
//! matched whatever the listener address, so IPv6 (`[__]_15021`) and loopback-bound
//! (`127.0.0.1_15090`) listeners are excluded too (Istio hard-codes `0.0.0.0_`). Envoy names
//! a listener's stats after its *configured* address, so a listener configured with port 0
//! is `listener.127.0.0.1_0` whatever port it bound (seen on 1.40).
//!
//! Nothing here holds state or spawns tasks: cancelling a call drops its connection.

use std::collections::BTreeSet;

use envoy_agent_proxy::admin::DrainListeners;
use envoy_agent_proxy::{AdminClient, AdminError};

/// The stats filter that selects the active-connection gauges.
pub const ACTIVE_CONNECTIONS_FILTER: &str = "downstream_cx_active$";

/// Why a drain step failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DrainError {
    /// The admin call failed (the error names address and endpoint).
    #[error(transparent)]
    Admin(#[from] AdminError),
    /// Envoy's admin address is not known (Envoy has not bound it yet).
    #[error("envoy's admin address is not known")]
    AdminUnknown,
}

/// Starts a graceful drain of Envoy's listeners: inbound only (sidecars) or all (gateways);
/// with `skip_exit` the listeners keep accepting for as long as Envoy runs.
pub async fn drain_listeners(
    admin: &AdminClient,
    inbound_only: bool,
    skip_exit: bool,
) -> Result<(), DrainError> {
    let options = DrainListeners {
        inbound_only,
        graceful: true,
        skip_exit,
    };
    tracing::info!(admin = %admin.addr(), endpoint = %options.endpoint(), "draining envoy listeners");
    admin.drain_listeners(options).await?;
    Ok(())
}

/// Which listeners do not count as carrying traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exclusions {
    /// Listeners on these ports, on any address.
    pub ports: BTreeSet<u16>,
    /// Listener stat names (the part after `listener.`) starting with any of these.
    pub name_prefixes: Vec<String>,
    /// Listener stat names excluded exactly (with their per-thread lines).
    pub names: Vec<String>,
}

impl Default for Exclusions {
    /// The admin listener (by its exact name: `admin_api` is a listener of the user's) and
    /// Envoy-internal listeners (ambient HBONE, Istio PR #60731).
    fn default() -> Self {
        Exclusions {
            ports: BTreeSet::new(),
            name_prefixes: vec!["envoy_internal_".to_owned()],
            names: vec!["admin".to_owned()],
        }
    }
}

impl Exclusions {
    /// The defaults plus listeners on `ports` (status, health, Prometheus ports).
    pub fn with_ports(ports: impl IntoIterator<Item = u16>) -> Self {
        let mut e = Exclusions::default();
        e.ports.extend(ports);
        e
    }

    fn excludes(&self, listener: &str) -> bool {
        if self
            .name_prefixes
            .iter()
            .any(|p| listener.starts_with(p.as_str()))
            || self.names.iter().any(|n| {
                listener == n
                    || listener
                        .strip_prefix(n.as_str())
                        .is_some_and(|rest| rest.starts_with('.'))
            })
        {
            return true;
        }
        listener
            .rsplit_once('_')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .is_some_and(|port| self.ports.contains(&port))
    }
}

/// Sums the listeners' active connections in an Envoy `/stats` text body.
/// Lines that are not `listener.<name>.downstream_cx_active: <n>` are ignored. The sum
/// saturates: a gauge gone wrong (a huge value) reads as "connections open", never wraps
/// around to zero.
pub fn sum_active_connections(stats: &str, exclusions: &Exclusions) -> u64 {
    stats
        .lines()
        .filter_map(|line| {
            let (name, value) = line.split_once(':')?;
            let listener = name
                .trim()
                .strip_prefix("listener.")?
                .strip_suffix(".downstream_cx_active")?;
            // Per-worker duplicates of a listener's gauge: `<listener>.worker_3` (a listener
            // whose own name starts with `worker_` counts).
            let per_worker = listener.rsplit_once('.').is_some_and(|(_, last)| {
                last.strip_prefix("worker_")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            });
            if per_worker || exclusions.excludes(listener) {
                return None;
            }
            value.trim().parse::<u64>().ok()
        })
        .fold(0u64, u64::saturating_add)
}

/// Envoy's active downstream connections, exclusions applied. One admin call, bounded by the
/// client's timeout.
pub async fn active_connections(
    admin: &AdminClient,
    exclusions: &Exclusions,
) -> Result<u64, DrainError> {
    let stats = admin.stats(ACTIVE_CONNECTIONS_FILTER, true).await?;
    Ok(sum_active_connections(&stats, exclusions))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATS: &str = "\
http.admin.downstream_cx_active: 2
http.inbound_0.0.0.0_8080.downstream_cx_active: 9
listener.0.0.0.0_15001.downstream_cx_active: 3
listener.0.0.0.0_15001.worker_0.downstream_cx_active: 1
listener.0.0.0.0_15001.worker_1.downstream_cx_active: 2
listener.0.0.0.0_15006.downstream_cx_active: 16
listener.0.0.0.0_15006.worker_0.downstream_cx_active: 16
listener.0.0.0.0_15021.downstream_cx_active: 4
listener.0.0.0.0_15090.downstream_cx_active: 5
listener.admin.downstream_cx_active: 2
listener.admin.main_thread.downstream_cx_active: 2
listener.envoy_internal_connect_originate.downstream_cx_active: 7
listener.[__]_15021.downstream_cx_active: 4
listener.127.0.0.1_15090.downstream_cx_active: 6
listener.[__1]_15020.downstream_cx_active: 1
garbage line
listener.weird.downstream_cx_active: not-a-number
";

    #[test]
    fn sums_listeners_without_workers_admin_internal_and_excluded_ports() {
        let exclusions = Exclusions::with_ports([15020, 15021, 15090]);
        assert_eq!(sum_active_connections(STATS, &exclusions), 19);
    }

    #[test]
    fn excluded_ports_match_ipv4_ipv6_and_loopback_names() {
        let only_excluded = "\
listener.0.0.0.0_15021.downstream_cx_active: 1
listener.[__]_15021.downstream_cx_active: 1
listener.[__1]_15021.downstream_cx_active: 1
listener.127.0.0.1_15090.downstream_cx_active: 1
listener.[fd00__1]_15090.downstream_cx_active: 1
listener.admin.downstream_cx_active: 1
listener.envoy_internal_x.downstream_cx_active: 1
";
        let exclusions = Exclusions::with_ports([15021, 15090]);
        assert_eq!(sum_active_connections(only_excluded, &exclusions), 0);
    }

    #[test]
    fn without_port_exclusions_everything_but_admin_and_internal_counts() {
        assert_eq!(
            sum_active_connections(STATS, &Exclusions::default()),
            3 + 16 + 4 + 5 + 4 + 6 + 1
        );
    }

    #[test]
    fn named_listeners_are_counted_and_prefixes_are_configurable() {
        let stats = "listener.ingress_https.downstream_cx_active: 3\n\
                     listener.probe_listener.downstream_cx_active: 2\n";
        assert_eq!(sum_active_connections(stats, &Exclusions::default()), 5);
        let mut exclusions = Exclusions::default();
        exclusions.name_prefixes.push("probe_".to_owned());
        assert_eq!(sum_active_connections(stats, &exclusions), 3);
    }

    #[test]
    fn listeners_named_like_workers_or_admin_count() {
        // Found by fuzzing and checked with Envoy 1.40 (`stat_prefix: worker_pool`).
        let stats = "listener.worker_pool.downstream_cx_active: 1\n\
                     listener.worker_pool.worker_0.downstream_cx_active: 1\n\
                     listener.admin_api.downstream_cx_active: 2\n\
                     listener.administration.downstream_cx_active: 3\n\
                     listener.admin.downstream_cx_active: 4\n\
                     listener.admin.main_thread.downstream_cx_active: 4\n\
                     listener.x.worker_.downstream_cx_active: 5\n";
        assert_eq!(
            sum_active_connections(stats, &Exclusions::default()),
            1 + 2 + 3 + 5
        );
    }

    #[test]
    fn a_sum_too_large_saturates_instead_of_wrapping_to_zero() {
        // The fuzzer's minimized input: a gauge gone below zero (as u64) plus one connection.
        let stats = "listener.0.downstream_cx_active: 18446744073709551615\n\
                     listener.min.downstream_cx_active: 1\n";
        assert_eq!(
            sum_active_connections(stats, &Exclusions::default()),
            u64::MAX
        );
    }

    #[test]
    fn empty_body_is_zero() {
        assert_eq!(sum_active_connections("", &Exclusions::default()), 0);
    }
}

//! Draining Envoy's listeners and knowing when the drain is done.
//!
//! # Theory of operation
//!
//! A drain is one admin call, [`drain_listeners`]: Envoy starts telling clients to go away
//! (`Connection: close`, HTTP/2 GOAWAY) and, unless `skip_exit`, stops its listeners when its
//! `--drain-time-s` ends. Envoy does not exit because of a drain: the supervisor decides when
//! to stop it, either after a fixed time or once [`active`] reaches zero: Envoy's active
//! downstream connections ([`Counting::Connections`], Istio's rule) or its active requests
//! ([`Counting::Requests`], so that idle keep-alive connections do not hold a drain open).
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
//! Only the listeners a drain reached count ([`Exclusions::only`], by their stat names, and
//! the drained listeners' ports for the kernel): a sidecar that drains its inbound listeners is
//! not held open by its app's outbound connections.
//!
//! Connections are counted by the kernel where it can ([`active_connections_from_kernel`]:
//! the connections on the drained listeners' ports, excluded ports and the admin's left out,
//! picked by the kernel itself), so that a count asks nothing of Envoy's main thread whatever
//! the config's size, and costs the agent what those connections cost, whatever the node
//! holds; by the stats where only Envoy knows (exclusions by listener name, requests).
//! The ports are the drained listeners', not the listening sockets found at the count: once
//! Envoy's drain time ends it closes its listening sockets, and the connections it accepted
//! stay open until they end or Envoy exits. A count from the stats makes Envoy visit every
//! stat: the agent asks it at most for 1/20 of Envoy's main thread.
//!
//! # Counting requests
//!
//! Active requests are an HTTP connection manager's gauge, `http.<stat_prefix>.downstream_rq_active`,
//! per HCM stat prefix, not per listener, and a stat prefix is not a listener's name. The link
//! is in Envoy's per-listener HCM stats: every (listener, HCM) pair has
//! `listener.<listener>.http.<stat_prefix>.downstream_rq_completed` from the moment the
//! listener is configured (in `/stats` without `usedonly`; seen on 1.40). With it, the count of
//! the counted listeners is their connections, less the connections their HCMs hold, plus the
//! requests those HCMs have in flight:
//!
//! - a listener with no HCM (TCP proxy) counts its connections: a proxied TCP stream has no
//!   requests to count, and it may carry one (an idle one cannot be told from a busy one);
//! - a listener mixing HTTP and TCP filter chains counts both its requests and its non-HTTP
//!   connections;
//! - an HCM stat prefix shared with an excluded listener (or whose gauges are missing, e.g.
//!   rejected by a `stats_matcher`) is not trusted: its listeners' connections count, as in
//!   connection mode. Missing stats never make a count smaller than the connections would.
//!
//! The connection part is a difference of gauges read one after another; it saturates at zero
//! (a connection closing between the two reads).
//!
//! How one exit-on-zero count is taken (which of the two sources, how much it asks, whether
//! its zero is believed) and how it paces the next is the [`count`] module's policy; when
//! counts are due is the caller's (the agent's shutdown clock).
//!
//! Nothing here holds state between calls (the quick counts' [`Known`] connections are the
//! caller's) or spawns tasks that outlive a call, with one exception by necessity: the
//! kernel's socket table is read with blocking calls (`sock_diag`, `/proc`) on a blocking
//! thread (`spawn_blocking`). Cancelling a call drops its admin connection at once; a table
//! read already under way runs to its end on that thread (milliseconds, filtered to the ports
//! asked) and its answer is dropped.

use std::collections::{BTreeMap, BTreeSet};

use envoy_agent_proxy::admin::DrainListeners;
use envoy_agent_proxy::{AdminClient, AdminError};

pub mod count;

pub use count::{Count, Pace, Tally};

/// The stats filter that selects the active-connection gauges.
pub const ACTIVE_CONNECTIONS_FILTER: &str = "downstream_cx_active$";

/// The stats filter that selects what [`sum_active_requests`] reads: the listeners' and HCMs'
/// active connections, the HCMs' active requests and the per-listener HCM counters that tie
/// an HCM to its listeners.
pub const ACTIVE_REQUESTS_FILTER: &str =
    r"downstream_(cx|rq)_active$|^listener\..*\.http\..*\.downstream_rq_completed$";

/// What exit-on-zero counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counting {
    /// Active downstream connections (Istio's `EXIT_ON_ZERO_ACTIVE_CONNECTIONS`): an idle
    /// keep-alive connection counts.
    Connections,
    /// Active downstream requests; a listener without HTTP counts its connections (see the
    /// module docs).
    Requests,
}

impl Counting {
    /// `connections` or `requests`, for logs and messages.
    pub fn name(self) -> &'static str {
        match self {
            Counting::Connections => "connections",
            Counting::Requests => "requests",
        }
    }
}

impl std::fmt::Display for Counting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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
    /// No Envoy process is known to count the connections of.
    #[error("no envoy process is known")]
    NoProcess,
    /// The kernel's socket table could not be read.
    #[error(transparent)]
    SocketTable(#[from] envoy_agent_proxy::socket_table::TableError),
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
    /// When set, only the listeners of these stat names count (the ones a drain reached); the
    /// others are excluded too.
    pub only: Option<BTreeSet<String>>,
}

impl Default for Exclusions {
    /// The admin listener (by its exact name: `admin_api` is a listener of the user's) and
    /// Envoy-internal listeners (ambient HBONE, Istio PR #60731).
    fn default() -> Self {
        Exclusions {
            ports: BTreeSet::new(),
            name_prefixes: vec!["envoy_internal_".to_owned()],
            names: vec!["admin".to_owned()],
            only: None,
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

    /// Whether only ports (and the defaults: the admin listener, Envoy-internal listeners,
    /// which hold no socket of their own) are excluded: then the kernel can count.
    pub fn by_port_only(&self) -> bool {
        let defaults = Exclusions::default();
        self.name_prefixes == defaults.name_prefixes && self.names == defaults.names
    }

    /// Whether the listener on `port` counts by port (the admin's, the excluded ports' do not).
    pub fn counts_port(&self, port: u16) -> bool {
        !self.ports.contains(&port)
    }

    /// These exclusions, counting only the listeners of `stat_names` besides.
    pub fn only(&self, stat_names: impl IntoIterator<Item = String>) -> Self {
        Exclusions {
            only: Some(stat_names.into_iter().collect()),
            ..self.clone()
        }
    }

    fn excludes(&self, listener: &str) -> bool {
        if self
            .only
            .as_ref()
            .is_some_and(|only| !only.contains(listener))
        {
            return true;
        }
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
            if per_worker(listener) || exclusions.excludes(listener) {
                return None;
            }
            value.trim().parse::<u64>().ok()
        })
        .fold(0u64, u64::saturating_add)
}

/// A `/stats` text line as (name, value); none for a line that is not `name: <u64>`.
fn stat_line(line: &str) -> Option<(&str, u64)> {
    let (name, value) = line.split_once(':')?;
    Some((name.trim(), value.trim().parse().ok()?))
}

/// Whether a listener stat name is a per-worker line (`<listener>.worker_3`).
fn per_worker(listener: &str) -> bool {
    listener.rsplit_once('.').is_some_and(|(_, last)| {
        last.strip_prefix("worker_")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// What one HTTP connection manager's stats say, each when seen.
#[derive(Default)]
struct Hcm {
    connections: Option<u64>,
    requests: Option<u64>,
    upgrades: Option<u64>,
}

/// The listener and HCM stats of a `/stats` text body, and which listeners each HCM serves.
struct HttpReading<'a> {
    /// Listener -> active connections (aggregate lines only).
    listeners: BTreeMap<&'a str, u64>,
    /// HCM stat prefix -> its gauges.
    hcms: BTreeMap<&'a str, Hcm>,
    /// HCM stat prefix -> the listeners it serves.
    served: BTreeMap<&'a str, BTreeSet<&'a str>>,
}

impl<'a> HttpReading<'a> {
    fn parse(stats: &'a str) -> Self {
        let mut listeners: BTreeMap<&str, u64> = BTreeMap::new();
        let mut hcms: BTreeMap<&str, Hcm> = BTreeMap::new();
        // `<listener>.http.<prefix>`: split once the listeners are known (both may contain
        // dots).
        let mut links: Vec<&str> = Vec::new();
        for (name, value) in stats.lines().filter_map(stat_line) {
            if let Some(rest) = name.strip_prefix("listener.") {
                if let Some(link) = rest.strip_suffix(".downstream_rq_completed") {
                    links.push(link);
                } else if let Some(listener) = rest.strip_suffix(".downstream_cx_active") {
                    if !per_worker(listener) {
                        listeners.insert(listener, value);
                    }
                }
            } else if let Some(rest) = name.strip_prefix("http.") {
                if let Some(prefix) = rest.strip_suffix(".downstream_cx_active") {
                    hcms.entry(prefix).or_default().connections = Some(value);
                } else if let Some(prefix) = rest.strip_suffix(".downstream_rq_active") {
                    hcms.entry(prefix).or_default().requests = Some(value);
                } else if let Some(prefix) = rest.strip_suffix(".downstream_cx_upgrades_active") {
                    hcms.entry(prefix).or_default().upgrades = Some(value);
                }
            }
        }
        let mut served: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for link in links {
            let splits = || {
                link.match_indices(".http.")
                    .map(|(at, sep)| (&link[..at], &link[at + sep.len()..]))
                    .filter(|(_, prefix)| hcms.contains_key(prefix))
            };
            // A listener whose gauge is missing still takes its HCM out of the trusted ones.
            let split = splits()
                .find(|(listener, _)| listeners.contains_key(listener))
                .or_else(|| splits().next());
            if let Some((listener, prefix)) = split {
                served.entry(prefix).or_default().insert(listener);
            }
        }
        HttpReading {
            listeners,
            hcms,
            served,
        }
    }
}

/// Sums the counted listeners' active requests in an Envoy `/stats` text body (without
/// `usedonly`, filtered by [`ACTIVE_REQUESTS_FILTER`]): see the module docs for the rule.
/// Unknown lines are ignored; sums saturate.
pub fn sum_active_requests(stats: &str, exclusions: &Exclusions) -> u64 {
    let HttpReading {
        listeners,
        hcms,
        served,
    } = HttpReading::parse(stats);
    let counted =
        |listener: &str| listeners.contains_key(listener) && !exclusions.excludes(listener);
    let connections = listeners
        .iter()
        .filter(|(listener, _)| counted(listener))
        .map(|(_, n)| *n)
        .fold(0u64, u64::saturating_add);
    let (held, requests) = served
        .iter()
        .filter(|(_, on)| on.iter().all(|listener| counted(listener)))
        .filter_map(|(prefix, _)| match hcms.get(prefix) {
            Some(Hcm {
                connections: Some(cx),
                requests: Some(rq),
                ..
            }) => Some((*cx, *rq)),
            _ => None,
        })
        .fold((0u64, 0u64), |(cx, rq), (c, r)| {
            (cx.saturating_add(c), rq.saturating_add(r))
        });
    connections.saturating_sub(held).saturating_add(requests)
}

/// The stats filter that selects what [`listener_activity`] reads: [`ACTIVE_REQUESTS_FILTER`]'s
/// lines and the HCMs' upgraded connections (WebSocket, CONNECT).
pub const LISTENER_ACTIVITY_FILTER: &str =
    r"downstream_(cx|rq|cx_upgrades)_active$|^listener\..*\.http\..*\.downstream_rq_completed$";

/// What one counted listener still holds during a drain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerActivity {
    /// The listener's stat name: its `stat_prefix`, else its configured address
    /// (`0.0.0.0_8080`). (The agent names it as configured, where the drain knows it.)
    pub name: String,
    /// Its active downstream connections.
    pub connections: u64,
    /// Its active requests, where Envoy counts them for it alone: the HTTP connection
    /// managers that serve only this listener; none for a listener without HTTP or one whose
    /// HCM also serves another listener.
    pub requests: Option<u64>,
    /// Of its connections, how many were upgraded (WebSocket, CONNECT: Envoy's
    /// `downstream_cx_upgrades_active`), on the same terms as `requests`.
    pub upgrades: Option<u64>,
}

/// Per counted listener (exclusions applied), what it still holds, from an Envoy `/stats`
/// text body filtered by [`LISTENER_ACTIVITY_FILTER`]: the listeners that hold anything,
/// busiest first. The same reading of the HCM-to-listener links as
/// [`sum_active_requests`].
pub fn listener_activity(stats: &str, exclusions: &Exclusions) -> Vec<ListenerActivity> {
    let HttpReading {
        listeners,
        hcms,
        served,
    } = HttpReading::parse(stats);
    let mut out: Vec<ListenerActivity> = listeners
        .iter()
        .filter(|(listener, _)| !exclusions.excludes(listener))
        .map(|(listener, connections)| {
            // Only HCMs that serve this listener alone say something of it.
            let own = served
                .iter()
                .filter(|(_, on)| on.len() == 1 && on.contains(listener))
                .filter_map(|(prefix, _)| hcms.get(prefix));
            let (mut requests, mut upgrades) = (None::<u64>, None::<u64>);
            for hcm in own {
                if let Some(rq) = hcm.requests {
                    requests = Some(requests.unwrap_or(0).saturating_add(rq));
                }
                if let Some(up) = hcm.upgrades {
                    upgrades = Some(upgrades.unwrap_or(0).saturating_add(up));
                }
            }
            ListenerActivity {
                name: (*listener).to_owned(),
                connections: *connections,
                requests,
                upgrades,
            }
        })
        .filter(|a| a.connections > 0 || a.requests.is_some_and(|n| n > 0))
        .collect();
    out.sort_by(|a, b| b.connections.cmp(&a.connections).then(a.name.cmp(&b.name)));
    out
}

/// [`listener_activity`] from Envoy's admin: one `/stats` call (Envoy visits every stat: the
/// caller paces it by its cost), bounded by the client's timeout.
pub async fn listener_activity_of(
    admin: &AdminClient,
    exclusions: &Exclusions,
) -> Result<Vec<ListenerActivity>, DrainError> {
    let stats = admin.stats(LISTENER_ACTIVITY_FILTER, false).await?;
    Ok(listener_activity(&stats, exclusions))
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

/// Envoy's active downstream requests (see the module docs), exclusions applied. One admin
/// call, bounded by the client's timeout. Not `usedonly`: an HCM's link to its listener is a
/// counter that reads zero until the listener's first request completes.
pub async fn active_requests(
    admin: &AdminClient,
    exclusions: &Exclusions,
) -> Result<u64, DrainError> {
    let stats = admin.stats(ACTIVE_REQUESTS_FILTER, false).await?;
    Ok(sum_active_requests(&stats, exclusions))
}

/// Envoy's active downstream connections from the kernel: the connections Envoy's processes
/// (`pids`: every epoch, a draining parent's too) hold on their listening ports, but for the
/// excluded ports and the admin's. Nothing is asked of Envoy, so the count costs it nothing
/// whatever its config (a `/stats?filter=` makes it visit every stat: most of a second on a
/// large one). Read on a blocking thread. TCP listeners only: a QUIC (UDP) listener's
/// connections are not seen; the caller uses the stats for exclusions by name
/// ([`Exclusions::by_port_only`]).
///
/// `ports`: the drained listeners' ports, where the drain knows them. Then every connection
/// Envoy holds on one of them counts, whether or not the listening socket is still open: once
/// Envoy's drain time ends it closes its listening sockets, and the connections it accepted
/// stay open until they end or Envoy exits. Without them, the listening sockets found now
/// say which ports are downstream ones (and a count after they closed finds nothing: the
/// caller confirms a zero with the stats).
///
/// With the ports, the kernel picks the connections on them (a filter on the ports and
/// states), so a count costs what those connections cost, not what the node holds; no Envoy's
/// descriptors are walked. With `quick` (the connections found by earlier quick counts) the
/// answer only tells zero from not zero, by one exact question about a connection found before
/// while there is one ([`envoy_agent_proxy::socket_table::any_on_ports`]). Without the ports
/// the count is whole and walks Envoy's descriptors to find its listening sockets.
pub async fn active_connections_from_kernel(
    pids: Vec<u32>,
    admin_port: Option<u16>,
    exclusions: &Exclusions,
    ports: Option<BTreeSet<u16>>,
    quick: Option<Known>,
) -> Result<u64, DrainError> {
    if pids.is_empty() {
        // Nothing to count is not zero.
        return Err(DrainError::NoProcess);
    }
    let mut excluded = exclusions.ports.clone();
    excluded.extend(admin_port);
    let ports = ports.map(|p| {
        p.into_iter()
            .filter(|port| exclusions.counts_port(*port) && Some(*port) != admin_port)
            .collect::<BTreeSet<u16>>()
    });
    let counted = tokio::task::spawn_blocking(move || match ports {
        Some(ports) => match quick {
            Some(known) => {
                let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
                envoy_agent_proxy::socket_table::any_on_ports(pids[0], &ports, &mut known)
            }
            None => {
                envoy_agent_proxy::socket_table::connections_on_ports(pids[0], &ports, u64::MAX)
            }
        },
        None => envoy_agent_proxy::socket_table::downstream_connections(&pids, &excluded),
    })
    .await
    .map_err(|e| envoy_agent_proxy::socket_table::TableError {
        path: "/proc".into(),
        source: std::io::Error::other(e.to_string()),
    })??;
    Ok(counted)
}

/// Whether process `pid` (a sidecar's Envoy) holds any connection on `ports` (its outbound
/// listeners'): whether the app beside it still calls out through it. Asked of the kernel as
/// exit-on-zero's quick counts are (one exact question about a connection found before, a
/// filtered dump only when none is left), on a blocking thread; nothing is asked of Envoy.
pub async fn any_held(pid: u32, ports: BTreeSet<u16>, known: Known) -> Result<bool, DrainError> {
    let held = tokio::task::spawn_blocking(move || {
        let mut known = known.lock().unwrap_or_else(|p| p.into_inner());
        envoy_agent_proxy::socket_table::any_on_ports(pid, &ports, &mut known)
    })
    .await
    .map_err(|e| envoy_agent_proxy::socket_table::TableError {
        path: "/proc".into(),
        source: std::io::Error::other(e.to_string()),
    })??;
    Ok(held > 0)
}

/// The connections quick counts found, to ask about again (shared with the blocking thread
/// that counts).
pub type Known = std::sync::Arc<std::sync::Mutex<Vec<envoy_agent_proxy::socket_table::SocketId>>>;

/// What `counting` counts: [`active_connections`] or [`active_requests`].
pub async fn active(
    admin: &AdminClient,
    counting: Counting,
    exclusions: &Exclusions,
) -> Result<u64, DrainError> {
    match counting {
        Counting::Connections => active_connections(admin, exclusions).await,
        Counting::Requests => active_requests(admin, exclusions).await,
    }
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
        assert_eq!(sum_active_requests("", &Exclusions::default()), 0);
    }

    /// Envoy 1.40's answer to [`ACTIVE_REQUESTS_FILTER`] (two workers): an HTTP listener
    /// (`hello`) holding one connection with `{hello_rq}` requests in flight, a TCP proxy
    /// listener with `{tcp}` connections, a probe listener (HCM `agent`) on port 19921 with
    /// `{probe}` connections, and the admin API answering this very call.
    fn requests_stats(hello_rq: u64, tcp: u64, probe: u64) -> String {
        format!(
            "\
http.admin.downstream_cx_active: 1
http.admin.downstream_rq_active: 1
http.agent.downstream_cx_active: {probe}
http.agent.downstream_rq_active: 0
http.hello.downstream_cx_active: 1
http.hello.downstream_rq_active: {hello_rq}
listener.127.0.0.1_19901.downstream_cx_active: 1
listener.127.0.0.1_19901.http.hello.downstream_rq_completed: 4
listener.127.0.0.1_19901.worker_0.downstream_cx_active: 0
listener.127.0.0.1_19901.worker_1.downstream_cx_active: 1
listener.127.0.0.1_19902.downstream_cx_active: {tcp}
listener.127.0.0.1_19902.worker_0.downstream_cx_active: {tcp}
listener.127.0.0.1_19902.worker_1.downstream_cx_active: 0
listener.127.0.0.1_19921.downstream_cx_active: {probe}
listener.127.0.0.1_19921.http.agent.downstream_rq_completed: 0
listener.127.0.0.1_19921.worker_0.downstream_cx_active: {probe}
listener.127.0.0.1_19921.worker_1.downstream_cx_active: 0
listener.admin.downstream_cx_active: 1
listener.admin.http.admin.downstream_rq_completed: 9
listener.admin.main_thread.downstream_cx_active: 1
"
        )
    }

    #[test]
    fn each_counted_listener_says_what_it_holds() {
        let none = Exclusions::default();
        // `hello` with 2 requests and one upgraded connection (a WebSocket), the TCP proxy
        // with 3 connections, the probe listener idle.
        let stats = requests_stats(2, 3, 0) + "http.hello.downstream_cx_upgrades_active: 1\n";
        let activity = listener_activity(&stats, &none);
        assert_eq!(
            activity,
            [
                ListenerActivity {
                    name: "127.0.0.1_19902".to_owned(),
                    connections: 3,
                    requests: None,
                    upgrades: None,
                },
                ListenerActivity {
                    name: "127.0.0.1_19901".to_owned(),
                    connections: 1,
                    requests: Some(2),
                    upgrades: Some(1),
                },
            ],
            "busiest first; the admin listener and the idle probe left out"
        );
        let probe_excluded = Exclusions::with_ports([19902]);
        assert_eq!(
            listener_activity(&stats, &probe_excluded)
                .iter()
                .map(|a| a.name.as_str())
                .collect::<Vec<_>>(),
            ["127.0.0.1_19901"]
        );
    }

    #[test]
    fn an_idle_keep_alive_connection_is_no_request() {
        let none = Exclusions::default();
        assert_eq!(sum_active_requests(&requests_stats(0, 0, 0), &none), 0);
        assert_eq!(
            sum_active_connections(&requests_stats(0, 0, 0), &none),
            1,
            "what connection counting sees"
        );
    }

    #[test]
    fn a_request_in_flight_counts_and_the_admin_call_does_not() {
        let none = Exclusions::default();
        assert_eq!(sum_active_requests(&requests_stats(1, 0, 0), &none), 1);
        assert_eq!(sum_active_requests(&requests_stats(3, 0, 0), &none), 3);
    }

    #[test]
    fn a_tcp_proxy_listener_counts_its_connections() {
        let none = Exclusions::default();
        assert_eq!(sum_active_requests(&requests_stats(0, 2, 0), &none), 2);
        assert_eq!(sum_active_requests(&requests_stats(1, 2, 0), &none), 3);
    }

    #[test]
    fn an_excluded_listener_counts_neither_requests_nor_connections() {
        let stats = requests_stats(0, 0, 4);
        assert_eq!(sum_active_requests(&stats, &Exclusions::default()), 0);
        let probe = Exclusions::with_ports([19921]);
        assert_eq!(sum_active_requests(&stats, &probe), 0);
        // A request in flight on the probe listener.
        let stats = stats.replace(
            "http.agent.downstream_rq_active: 0",
            "http.agent.downstream_rq_active: 1",
        );
        assert_eq!(sum_active_requests(&stats, &Exclusions::default()), 1);
        assert_eq!(sum_active_requests(&stats, &probe), 0);
    }

    #[test]
    fn a_listener_mixing_http_and_tcp_counts_requests_and_tcp_connections() {
        // Istio's inbound listener: one HCM per HTTP port, TCP proxy chains beside them.
        let stats = "\
http.inbound_0.0.0.0_8080.downstream_cx_active: 3
http.inbound_0.0.0.0_8080.downstream_rq_active: 1
http.inbound_0.0.0.0_9090.downstream_cx_active: 2
http.inbound_0.0.0.0_9090.downstream_rq_active: 0
listener.0.0.0.0_15006.downstream_cx_active: 7
listener.0.0.0.0_15006.worker_0.downstream_cx_active: 7
listener.0.0.0.0_15006.http.inbound_0.0.0.0_8080.downstream_rq_completed: 10
listener.0.0.0.0_15006.http.inbound_0.0.0.0_9090.downstream_rq_completed: 0
";
        // 7 connections, 5 of them HTTP (1 request in flight), 2 TCP.
        assert_eq!(sum_active_requests(stats, &Exclusions::default()), 1 + 2);
    }

    #[test]
    fn an_hcm_shared_with_an_excluded_listener_is_not_trusted() {
        // `shared` serves both listeners; its connections cannot be told apart, so the
        // counted listener's connections count as they are.
        let stats = "\
http.shared.downstream_cx_active: 3
http.shared.downstream_rq_active: 0
listener.0.0.0.0_8080.downstream_cx_active: 1
listener.0.0.0.0_8080.http.shared.downstream_rq_completed: 1
listener.0.0.0.0_15021.downstream_cx_active: 2
listener.0.0.0.0_15021.http.shared.downstream_rq_completed: 1
";
        assert_eq!(
            sum_active_requests(stats, &Exclusions::with_ports([15021])),
            1
        );
        assert_eq!(sum_active_requests(stats, &Exclusions::default()), 0);
    }

    #[test]
    fn missing_hcm_stats_fall_back_to_connections() {
        // A stats_matcher that rejects the request gauge or the per-listener counters: the
        // listener counts its connections, never fewer.
        let full = requests_stats(0, 0, 0);
        let no_rq = full.replace("http.hello.downstream_rq_active: 0\n", "");
        assert_eq!(sum_active_requests(&no_rq, &Exclusions::default()), 1);
        let no_link = full.replace(
            "listener.127.0.0.1_19901.http.hello.downstream_rq_completed: 4\n",
            "",
        );
        assert_eq!(sum_active_requests(&no_link, &Exclusions::default()), 1);
        let no_listener = full
            .replace("listener.admin.downstream_cx_active: 1\n", "")
            .replace(
                "listener.admin.http.admin.downstream_rq_completed: 9",
                "listener.admin.http.hello.downstream_rq_completed: 9",
            );
        assert_eq!(
            sum_active_requests(&no_listener, &Exclusions::default()),
            1,
            "an HCM also on a listener without a gauge is not trusted"
        );
    }

    #[test]
    fn dotted_listener_and_hcm_names_are_split_where_both_exist() {
        let stats = "\
http.b.http.c.downstream_cx_active: 1
http.b.http.c.downstream_rq_active: 1
listener.a.http.b.downstream_cx_active: 1
listener.a.http.b.http.b.http.c.downstream_rq_completed: 0
";
        // Listener `a.http.b`, HCM `b.http.c`: one connection, one request.
        assert_eq!(sum_active_requests(stats, &Exclusions::default()), 1);
    }

    #[test]
    fn the_connection_part_saturates_at_zero_and_sums_do_not_wrap() {
        // An HCM gauge read just after a connection closed on the listener's.
        let stats = "\
http.h.downstream_cx_active: 2
http.h.downstream_rq_active: 0
listener.l.downstream_cx_active: 1
listener.l.http.h.downstream_rq_completed: 0
";
        assert_eq!(sum_active_requests(stats, &Exclusions::default()), 0);
        let huge = "\
http.h.downstream_cx_active: 0
http.h.downstream_rq_active: 18446744073709551615
listener.l.downstream_cx_active: 1
listener.l.http.h.downstream_rq_completed: 0
listener.t.downstream_cx_active: 1
";
        assert_eq!(sum_active_requests(huge, &Exclusions::default()), u64::MAX);
    }
}

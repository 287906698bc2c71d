//! One exit-on-zero count ([`Count`]): where it is taken, how much it asks, whether its zero
//! is believed, and how it paces the next count. The caller (the agent's shutdown clock)
//! decides when a count is due and what it asks ([`Tally`]); it gathers the inputs, calls
//! [`Count::take`] and paces the next count as the answer's [`Pace`] says.
//!
//! # Theory of operation
//!
//! - **Source.** Connections are counted by the kernel where the exclusions are by port only
//!   ([`counts_from_kernel`]): nothing is asked of Envoy's main thread. Requests, and
//!   exclusions by listener name, only Envoy's stats know; a count from them is whole and
//!   makes Envoy visit every stat, so it is paced at [`BUSY_SHARE`] of Envoy's main thread
//!   ([`Pace::STATS`]).
//! - **What is counted.** Once Envoy answered the drain, its plan says which listeners it
//!   reached: only those count (by their stat names for the stats, by their TCP ports for the
//!   kernel; a QUIC listener's connections only the stats see). Before, or when Envoy never
//!   answers it (a silent admin API), the kernel counts the old way: a whole count that finds
//!   Envoy's listening sockets first, at a busy share (the exit on zero depends on it alone).
//! - **How much a kernel count asks.** [`Tally::Any`] with the drained ports is a quick
//!   count: one exact question about a connection found before while there is one
//!   ([`Known`]), paced at [`KERNEL_PROBE_SHARE`] of the agent's core; [`Tally::Whole`] is a
//!   filtered dump (the status's number), paced at [`WHOLE_COUNT_SHARE`].
//! - **A zero is confirmed.** Zero stops Envoy: with a drain plan, a kernel zero is asked
//!   again of the stats (a QUIC connection, a listener the kernel cannot tie to a port). Where
//!   they disagree the larger count is trusted (the `count_disagreement` event); where they
//!   cannot answer, the kernel's zero stands for TCP (a stopped Envoy's silent admin API must
//!   not hold the exit). Either way the count is paced as one from the stats.
//!
//! The decisions are pure ([`Count::method`], [`confirmed`]); [`Count::take`] does the
//! asking around them.

use std::collections::BTreeSet;

use envoy_agent_proxy::admin::BUSY_SHARE;
use envoy_agent_proxy::{AdminClient, DrainPlan};

use crate::{Counting, DrainError, Exclusions, Known};

/// The share of a core a drain's quick counts from the kernel (is any connection left?) may
/// take of the agent: 1/100. Each asks about one connection found before (a dump only when
/// none is left), so at the poll interval they cost far less; the whole counts take 1/400 at
/// most ([`WHOLE_COUNT_SHARE`]): the wait costs at most 1.25% of a core.
pub const KERNEL_PROBE_SHARE: u32 = 100;

/// Whole counts take at most 1/400 of a core. Whatever it finds, a dump walks the kernel's
/// whole table of connections (on a node of 262,144 buckets and ~40,000 sockets, ~4 ms a
/// family): only its answer is filtered.
pub const WHOLE_COUNT_SHARE: u32 = 400;

/// What a count asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tally {
    /// How many: for the status, and the first count.
    Whole,
    /// Whether any is left: the kernel's asks about a connection it found before, and looks
    /// further only when none of those is left.
    Any,
}

/// What kind of count answered, and the share of a core (its `1/n`) such counts may take:
/// the cadence of their kind is stretched to keep to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Every count of its source is whole (Envoy's stats): the next count waits.
    Every(u32),
    /// A quick count (whether any is left): a zero is a whole answer, anything else says
    /// "at least this many". The next quick count waits.
    Quick(u32),
    /// A whole count between quick ones: the next whole count waits; quick ones go on.
    Whole(u32),
}

impl Pace {
    /// A count from Envoy's stats: whole, at most [`BUSY_SHARE`] of Envoy's main thread.
    pub const STATS: Pace = Pace::Every(BUSY_SHARE);
}

/// Whether `counting`, with `exclusions`, can be counted by the kernel's socket table
/// (connections, excluded by port only) rather than Envoy's stats.
pub fn counts_from_kernel(counting: Counting, exclusions: &Exclusions) -> bool {
    counting == Counting::Connections && exclusions.by_port_only()
}

/// How a count is taken, decided before anything is asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    /// From Envoy's stats, paced as [`Pace::STATS`].
    Stats,
    /// From the kernel's socket table.
    Kernel {
        /// The drained TCP listeners' ports; `None` before Envoy answered the drain (the
        /// count is whole: it finds Envoy's listening sockets first).
        ports: Option<BTreeSet<u16>>,
        /// Only whether any is left, by the connections quick counts found before.
        quick: bool,
        /// A zero is confirmed from the stats (there is a drain plan to confirm against).
        confirm: bool,
        /// How it paces the next count, unless a zero's confirmation paces it.
        pace: Pace,
    },
}

/// One exit-on-zero count's inputs, gathered by the caller from its state.
#[derive(Debug, Clone)]
pub struct Count {
    /// Envoy's admin API (with the caller's bound on a stats call), when its address is known.
    pub admin: Option<AdminClient>,
    /// The configured exclusions; the count narrows them to the drained listeners.
    pub exclusions: Exclusions,
    /// What the drain reached, once Envoy accepted it (and its listeners were read).
    pub drained: Option<DrainPlan>,
    /// Envoy's processes (every epoch's), for a count from the kernel.
    pub pids: Vec<u32>,
    /// What is counted.
    pub counting: Counting,
    /// How much is asked.
    pub tally: Tally,
    /// The connections earlier quick counts found, to ask about again.
    pub known: Option<Known>,
    /// Whether the kernel counts ([`counts_from_kernel`], unless the caller counts otherwise).
    pub kernel: bool,
}

impl Count {
    /// How this count is taken (pure).
    pub fn method(&self) -> Method {
        if !self.kernel {
            return Method::Stats;
        }
        // The drained TCP listeners' ports; a QUIC listener's connections only the stats see.
        let ports: Option<BTreeSet<u16>> = self.drained.as_ref().map(|plan| {
            plan.drained
                .iter()
                .filter(|l| !l.udp)
                .filter_map(|l| l.port)
                .collect()
        });
        let (quick, pace) = match (self.tally, &ports) {
            (Tally::Any, Some(_)) => (true, Pace::Quick(KERNEL_PROBE_SHARE)),
            (_, Some(_)) => (false, Pace::Whole(WHOLE_COUNT_SHARE)),
            // Before Envoy answered the drain, or never (a silent admin API): the old way, at
            // a busy share (the exit on zero depends on it alone).
            (_, None) => (false, Pace::Every(BUSY_SHARE)),
        };
        Method::Kernel {
            ports,
            quick,
            confirm: self.drained.is_some(),
            pace,
        }
    }

    /// The exclusions this count applies: the configured ones, counting only the drained
    /// listeners once the drain's plan names them.
    pub fn exclusions(&self) -> Exclusions {
        match &self.drained {
            Some(plan) => self
                .exclusions
                .only(plan.drained.iter().map(|l| l.stat_name.clone())),
            None => self.exclusions.clone(),
        }
    }

    /// Takes the count: the count (or why not) and how it paces the next.
    pub async fn take(self) -> (Result<u64, DrainError>, Pace) {
        let exclusions = self.exclusions();
        let (ports, quick, confirm, pace) = match self.method() {
            Method::Stats => {
                let count = match &self.admin {
                    Some(admin) => crate::active(admin, self.counting, &exclusions).await,
                    None => Err(DrainError::AdminUnknown),
                };
                return (count, Pace::STATS);
            }
            Method::Kernel {
                ports,
                quick,
                confirm,
                pace,
            } => (ports, quick, confirm, pace),
        };
        // Connections from the kernel: nothing asked of Envoy's main thread, but for a zero.
        // A Unix admin socket holds no TCP connection to leave out of the count.
        let admin_port = self
            .admin
            .as_ref()
            .and_then(|a| a.addr().tcp())
            .map(|a| a.port());
        let known = self.known.filter(|_| quick);
        let kernel =
            crate::active_connections_from_kernel(self.pids, admin_port, &exclusions, ports, known)
                .await;
        // Without a plan (Envoy has not answered the drain: its admin API may be silent)
        // there is nothing to confirm against, and the kernel's zero stands.
        if !matches!(kernel, Ok(0)) || !confirm {
            return (kernel, pace);
        }
        let Some(admin) = self.admin else {
            return (kernel, pace);
        };
        let stats = crate::active_connections(&admin, &exclusions).await;
        match &stats {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                event = "count_disagreement",
                kernel = 0,
                stats = *n,
                "the kernel sees no connection on the drained listeners, envoy's stats see some: trusting the stats"
            ),
            Err(e) => {
                tracing::debug!(error = %e, "cannot confirm a zero count from envoy's stats: the kernel's stands");
            }
        }
        (Ok(confirmed(&stats)), Pace::STATS)
    }
}

/// What a kernel's zero stands for once the stats were asked (pure): the stats' count where
/// they see connections (the larger count is trusted), zero where they agree or cannot answer
/// (the kernel's zero stands for TCP: a silent admin API must not hold the exit).
pub fn confirmed(stats: &Result<u64, DrainError>) -> u64 {
    match stats {
        Ok(n) => *n,
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use envoy_agent_proxy::listeners::{Direction, Listener, PlanNote};
    use envoy_agent_proxy::{DrainPlan, Scope};

    use super::*;

    fn listener(stat_name: &str, port: Option<u16>, udp: bool) -> Listener {
        Listener {
            name: stat_name.to_owned(),
            direction: Direction::Inbound,
            stat_name: stat_name.to_owned(),
            port,
            udp,
            modify_only: false,
            bypasses_overload_manager: false,
        }
    }

    fn plan(drained: Vec<Listener>) -> DrainPlan {
        DrainPlan {
            asked: Scope::Auto,
            inbound_only: false,
            listeners: drained.clone(),
            drained,
            note: PlanNote::NotServing,
        }
    }

    fn count(kernel: bool, tally: Tally, drained: Option<DrainPlan>) -> Count {
        Count {
            admin: None,
            exclusions: Exclusions::with_ports([15021]),
            drained,
            pids: Vec::new(),
            counting: Counting::Connections,
            tally,
            known: None,
            kernel,
        }
    }

    fn drained() -> DrainPlan {
        plan(vec![
            listener("0.0.0.0_8080", Some(8080), false),
            listener("quic", Some(8443), true),
            listener("pipe", None, false),
        ])
    }

    #[test]
    fn the_kernel_counts_connections_excluded_by_port_only() {
        let by_port = Exclusions::with_ports([15021]);
        assert!(counts_from_kernel(Counting::Connections, &by_port));
        assert!(!counts_from_kernel(Counting::Requests, &by_port));
        let mut by_name = by_port.clone();
        by_name.names.push("ingress".to_owned());
        assert!(!counts_from_kernel(Counting::Connections, &by_name));
    }

    #[test]
    fn the_stats_count_whole_whatever_is_asked() {
        for tally in [Tally::Whole, Tally::Any] {
            assert_eq!(count(false, tally, Some(drained())).method(), Method::Stats);
            assert_eq!(count(false, tally, None).method(), Method::Stats);
        }
    }

    #[test]
    fn the_kernel_counts_the_drained_tcp_ports_quick_or_whole_and_confirms_a_zero() {
        let tcp = BTreeSet::from([8080]);
        assert_eq!(
            count(true, Tally::Any, Some(drained())).method(),
            Method::Kernel {
                ports: Some(tcp.clone()),
                quick: true,
                confirm: true,
                pace: Pace::Quick(KERNEL_PROBE_SHARE),
            }
        );
        assert_eq!(
            count(true, Tally::Whole, Some(drained())).method(),
            Method::Kernel {
                ports: Some(tcp),
                quick: false,
                confirm: true,
                pace: Pace::Whole(WHOLE_COUNT_SHARE),
            }
        );
    }

    #[test]
    fn before_the_drain_is_answered_the_kernel_counts_whole_at_a_busy_share_unconfirmed() {
        for tally in [Tally::Whole, Tally::Any] {
            assert_eq!(
                count(true, tally, None).method(),
                Method::Kernel {
                    ports: None,
                    quick: false,
                    confirm: false,
                    pace: Pace::Every(BUSY_SHARE),
                }
            );
        }
    }

    #[test]
    fn only_the_drained_listeners_count() {
        let c = count(true, Tally::Whole, Some(drained()));
        let only = c
            .exclusions()
            .only
            .expect("narrowed to the drained listeners");
        assert_eq!(
            only,
            BTreeSet::from([
                "0.0.0.0_8080".to_owned(),
                "quic".to_owned(),
                "pipe".to_owned()
            ])
        );
        assert_eq!(c.exclusions().ports, BTreeSet::from([15021]));
        assert_eq!(count(true, Tally::Whole, None).exclusions().only, None);
    }

    #[test]
    fn a_kernel_zero_stands_unless_the_stats_see_more() {
        assert_eq!(confirmed(&Ok(0)), 0);
        assert_eq!(confirmed(&Ok(3)), 3, "the larger count is trusted");
        assert_eq!(confirmed(&Err(DrainError::AdminUnknown)), 0);
    }

    #[tokio::test]
    async fn a_count_that_cannot_ask_says_why_and_paces_as_its_source() {
        // The stats, with no admin address known.
        let (count_, pace) = count(false, Tally::Whole, None).take().await;
        assert!(
            matches!(count_, Err(DrainError::AdminUnknown)),
            "{count_:?}"
        );
        assert_eq!(pace, Pace::STATS);
        // The kernel, with no Envoy process known: nothing to count is not zero.
        let (count_, pace) = count(true, Tally::Any, Some(drained())).take().await;
        assert!(matches!(count_, Err(DrainError::NoProcess)), "{count_:?}");
        assert_eq!(pace, Pace::Quick(KERNEL_PROBE_SHARE));
    }
}

//! The schedule of a soak run: which faults it draws, with what weights, in what order and
//! with what pauses, and how the run ends. Everything here comes from the seed alone, never
//! from the clock or the machine, so that a seed replays the same sequence of faults (how many
//! of them fit into `--duration` depends on how long each took: the sequence is the same, its
//! cut may move by an event).

use std::fmt;
use std::time::Duration;

/// Which kind of proxy the agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// A node proxy: `--hot-restart`, a family of epochs, successor pods on the state dir.
    Node,
    /// A sidecar: one Envoy, hot restart off.
    Sidecar,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Node => "node",
            Mode::Sidecar => "sidecar",
        })
    }
}

/// A fault (or a control) the soak inflicts while the load runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Kind {
    /// SIGHUP to the agent (a hot restart; a sidecar logs and ignores it).
    Sighup,
    /// `envoy-agent restart`.
    Restart,
    /// The bootstrap rewritten on disk (atomically), for `--watch-config`.
    WatchConfig,
    /// `envoy-agent update-config` with a config Envoy accepts.
    UpdateConfig,
    /// `envoy-agent update-config` with a config Envoy rejects: refused, nothing changes.
    UpdateConfigRejected,
    /// A config Envoy rejects written over the bootstrap (the watch pre-flights and refuses
    /// it), then a valid one.
    RejectedOnDisk,
    /// SIGUSR1 to the agent (forwarded to every LIVE Envoy).
    Sigusr1,
    /// The newest Envoy stopped (SIGSTOP) for less than the wedge deadline, then continued.
    FreezeShort,
    /// The newest Envoy stopped past the wedge deadline: the agent kills it and recovers.
    FreezeLong,
    /// SIGKILL to the newest Envoy (`--restart-on-crash` recovers).
    KillServing,
    /// A hot restart, then SIGKILL to the draining parent once the child is LIVE.
    KillDrainingParent,
    /// A successor agent (a surge pod) on the same state dir takes over; the old one is told
    /// to stop and must hand over.
    SuccessorPod,
    /// Uid 65534 holds a few hundred connections to the status server.
    StatusFlood,
    /// The control plane (the kit's ADS server) stopped for a while, in the background: the
    /// next events run while it is down.
    ControlPlane,
    /// The agent itself stopped (SIGSTOP) past the wedge deadline, then continued: Envoy
    /// serves throughout, and the agent, once back, judges nothing from its own stall.
    FreezeAgent,
}

impl Kind {
    /// Every kind, in the order weights are drawn from (changing it changes every schedule).
    pub(crate) const ALL: [Kind; 15] = [
        Kind::Sighup,
        Kind::Restart,
        Kind::WatchConfig,
        Kind::UpdateConfig,
        Kind::UpdateConfigRejected,
        Kind::RejectedOnDisk,
        Kind::Sigusr1,
        Kind::FreezeShort,
        Kind::FreezeLong,
        Kind::KillServing,
        Kind::KillDrainingParent,
        Kind::SuccessorPod,
        Kind::StatusFlood,
        Kind::ControlPlane,
        Kind::FreezeAgent,
    ];

    /// The name in `--events` and in the log.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Sighup => "sighup",
            Kind::Restart => "restart",
            Kind::WatchConfig => "watch-config",
            Kind::UpdateConfig => "update-config",
            Kind::UpdateConfigRejected => "update-config-rejected",
            Kind::RejectedOnDisk => "rejected-on-disk",
            Kind::Sigusr1 => "sigusr1",
            Kind::FreezeShort => "freeze-short",
            Kind::FreezeLong => "freeze-long",
            Kind::KillServing => "kill-serving",
            Kind::KillDrainingParent => "kill-draining-parent",
            Kind::SuccessorPod => "successor-pod",
            Kind::StatusFlood => "status-flood",
            Kind::ControlPlane => "control-plane",
            Kind::FreezeAgent => "freeze-agent",
        }
    }

    /// The default weight in `mode`; 0 where the event does not apply (a sidecar has no hot
    /// restart: no `restart`, no watch, no draining parent, no successor pod).
    pub(crate) fn default_weight(self, mode: Mode) -> u32 {
        let node = mode == Mode::Node;
        match self {
            Kind::Sighup => {
                if node {
                    6
                } else {
                    2
                }
            }
            Kind::Restart | Kind::WatchConfig if node => 4,
            Kind::UpdateConfig => 3,
            Kind::UpdateConfigRejected => 2,
            Kind::RejectedOnDisk if node => 2,
            Kind::Sigusr1 => 3,
            Kind::FreezeShort => 2,
            Kind::FreezeLong => 1,
            Kind::KillServing => 2,
            Kind::KillDrainingParent if node => 2,
            Kind::SuccessorPod if node => 1,
            Kind::StatusFlood => 2,
            Kind::ControlPlane => 2,
            Kind::FreezeAgent => 1,
            _ => 0,
        }
    }

    /// Whether the event means anything in `mode` (an override cannot turn on one that does
    /// not).
    pub(crate) fn applies(self, mode: Mode) -> bool {
        self.default_weight(mode) > 0
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the run ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// `envoy-agent drain`, then SIGTERM (which then stops Envoy at once).
    Drain,
    /// SIGTERM: the graceful shutdown.
    Sigterm,
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            End::Drain => "drain then SIGTERM",
            End::Sigterm => "SIGTERM",
        })
    }
}

/// The weights of a run: the mode's defaults with `--events` applied.
pub(crate) type Weights = Vec<(Kind, u32)>;

/// The mode's default weights, overridden by `spec`: `name=weight` pairs separated by
/// commas; `*=W` sets every applicable event first (so `*=0,kill-serving=1` runs one kind).
pub(crate) fn weights(mode: Mode, spec: Option<&str>) -> Result<Weights, String> {
    let mut weights: Weights = Kind::ALL
        .iter()
        .map(|k| (*k, k.default_weight(mode)))
        .collect();
    for pair in spec
        .unwrap_or_default()
        .split(',')
        .filter(|p| !p.is_empty())
    {
        let (name, weight) = pair
            .split_once('=')
            .ok_or_else(|| format!("`{pair}`: expected name=weight"))?;
        let weight: u32 = weight
            .trim()
            .parse()
            .map_err(|_| format!("`{pair}`: the weight is not a whole number"))?;
        let name = name.trim();
        if name == "*" {
            for (kind, w) in &mut weights {
                if kind.applies(mode) {
                    *w = weight;
                }
            }
            continue;
        }
        let kind = Kind::ALL
            .iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| format!("`{name}`: no such event ({})", names()))?;
        if weight > 0 && !kind.applies(mode) {
            return Err(format!("`{name}` does not apply to a {mode}"));
        }
        for (k, w) in &mut weights {
            if k == kind {
                *w = weight;
            }
        }
    }
    if weights.iter().all(|(_, w)| *w == 0) {
        return Err("every event has weight 0".to_owned());
    }
    Ok(weights)
}

/// Every event's name, for messages.
pub(crate) fn names() -> String {
    Kind::ALL
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `--events` as it applies, for the replay command: `name=weight` for every kind.
pub(crate) fn spec(weights: &Weights) -> String {
    weights
        .iter()
        .map(|(k, w)| format!("{}={w}", k.name()))
        .collect::<Vec<_>>()
        .join(",")
}

/// The shortest and longest pause between the end of one event and the start of the next.
const GAP: (u64, u64) = (300, 3000);

/// The seeded draw: the end first (so that it does not depend on how many events fit), then
/// one event after another, each after a pause.
#[derive(Debug)]
pub(crate) struct Schedule {
    rng: fastrand::Rng,
    weights: Weights,
    /// How the run ends, drawn from the seed.
    pub(crate) end: End,
}

impl Schedule {
    /// The schedule of `seed` with `weights`.
    pub(crate) fn new(seed: u64, weights: Weights) -> Schedule {
        let mut rng = fastrand::Rng::with_seed(seed);
        let end = if rng.bool() { End::Drain } else { End::Sigterm };
        Schedule { rng, weights, end }
    }

    /// The next pause and event.
    pub(crate) fn next_event(&mut self) -> (Duration, Kind) {
        let gap = Duration::from_millis(self.rng.u64(GAP.0..=GAP.1));
        let total: u32 = self.weights.iter().map(|(_, w)| w).sum();
        let mut pick = self.rng.u32(0..total.max(1));
        let mut kind = Kind::Sighup;
        for (k, w) in &self.weights {
            if pick < *w {
                kind = *k;
                break;
            }
            pick -= w;
        }
        (gap, kind)
    }
}

/// Parses `90s`, `5m`, `1h`, `1500ms` (or bare seconds).
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{text}`: expected a number and a unit (90s, 5m, 1h)"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "" | "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("`{text}`: unknown unit `{unit}` (ms, s, m, h)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(seed: u64, mode: Mode, spec: Option<&str>, n: usize) -> (End, Vec<(Duration, Kind)>) {
        let mut s = Schedule::new(seed, weights(mode, spec).unwrap());
        let events = (0..n).map(|_| s.next_event()).collect();
        (s.end, events)
    }

    #[test]
    fn a_seed_replays_the_same_schedule() {
        assert_eq!(
            draw(42, Mode::Node, None, 200),
            draw(42, Mode::Node, None, 200)
        );
        assert_ne!(
            draw(42, Mode::Node, None, 200).1,
            draw(43, Mode::Node, None, 200).1
        );
    }

    #[test]
    fn a_sidecar_draws_only_what_applies_to_it() {
        let (_, events) = draw(7, Mode::Sidecar, None, 2000);
        for (_, kind) in &events {
            assert!(kind.applies(Mode::Sidecar), "{kind}");
        }
        assert!(events.iter().any(|(_, k)| *k == Kind::KillServing));
        assert!(
            !events
                .iter()
                .any(|(_, k)| *k == Kind::Restart || *k == Kind::SuccessorPod)
        );
    }

    #[test]
    fn overrides_reduce_a_schedule_to_the_events_that_matter() {
        let (_, events) = draw(9, Mode::Node, Some("*=0,kill-serving=1,sighup=2"), 500);
        assert!(
            events
                .iter()
                .all(|(_, k)| *k == Kind::KillServing || *k == Kind::Sighup)
        );
        let gaps = events.iter().map(|(g, _)| g.as_millis() as u64);
        assert!(gaps.clone().all(|g| (GAP.0..=GAP.1).contains(&g)));
        assert!(weights(Mode::Sidecar, Some("restart=1")).is_err());
        assert!(weights(Mode::Node, Some("nope=1")).is_err());
        assert!(weights(Mode::Node, Some("*=0")).is_err());
        assert!(weights(Mode::Node, Some("sighup")).is_err());
    }

    #[test]
    fn durations_parse_with_their_units() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("12"), Ok(Duration::from_secs(12)));
        assert!(parse_duration("5 minutes").is_err());
        assert!(parse_duration("m").is_err());
    }
}

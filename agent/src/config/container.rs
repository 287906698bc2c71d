//! Envoy fits the container it runs in (issue 50): from what the cgroups say
//! ([`envoy_agent_proxy::cgroup`]) and the open-file limit, the agent decides at start, once,
//! what every Envoy it starts gets: a memory guard below the container's memory limit (load
//! shed before the OOM killer acts), a bound on downstream connections, and its worker count.
//! Each decision says why, for the start's log (`event="container"`), `status` and `GetStatus`.
//! An operator's own setting always wins: an overload manager of the bootstrap's with the same
//! parts, a `--concurrency` given.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use envoy_agent_proxy::cgroup::Container;
use envoy_agent_proxy::overload::{self, MemoryGuard, Thresholds};

/// `--memory-guard`: which memory limit Envoy sheds load below.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryGuardArg {
    /// The container's (its cgroup's) memory limit, when it has one.
    Auto,
    /// No memory guard.
    Off,
    /// This many bytes.
    Limit(u64),
}

impl FromStr for MemoryGuardArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(MemoryGuardArg::Auto),
            "off" => Ok(MemoryGuardArg::Off),
            other => parse_size(other).map(MemoryGuardArg::Limit).ok_or_else(|| {
                format!(
                    "{other:?} is not a size (bytes, or with Ki, Mi, Gi: 512Mi), `auto` or `off`"
                )
            }),
        }
    }
}

impl fmt::Display for MemoryGuardArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryGuardArg::Auto => f.write_str("auto"),
            MemoryGuardArg::Off => f.write_str("off"),
            MemoryGuardArg::Limit(n) => write!(f, "{n}"),
        }
    }
}

/// A size as Kubernetes writes one: bytes, or with `Ki`, `Mi`, `Gi` (or `K`, `M`, `G`).
fn parse_size(s: &str) -> Option<u64> {
    let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = digits.parse().ok()?;
    let scale: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(scale).filter(|n| *n > 0)
}

/// `--memory-guard-thresholds`: shares, in thousandths (kept whole so that settings compare).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuardShares {
    /// The heap Envoy is given, of the limit.
    pub heap: u16,
    /// `shrink_heap`, of that heap.
    pub shrink_heap: u16,
    /// `stop_accepting_requests`, of that heap.
    pub stop_accepting_requests: u16,
    /// `tcp_listener_accept` (new connections refused), of that heap.
    pub reject_connections: u16,
}

impl Default for GuardShares {
    fn default() -> Self {
        let t = Thresholds::default();
        let m = |v: f64| (v * 1000.0).round() as u16;
        GuardShares {
            heap: m(overload::HEAP_SHARE),
            shrink_heap: m(t.shrink_heap),
            stop_accepting_requests: m(t.stop_accepting_requests),
            reject_connections: m(t.reject_connections),
        }
    }
}

impl FromStr for GuardShares {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut shares = GuardShares::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: NAME=SHARE, e.g. heap=0.85"))?;
            let value: f64 = value
                .trim()
                .parse()
                .map_err(|_| format!("{part:?}: the share is a number, e.g. 0.85"))?;
            if !(value > 0.0 && value <= 1.0) {
                return Err(format!("{part:?}: a share is above 0 and at most 1"));
            }
            let value = (value * 1000.0).round() as u16;
            match name.trim() {
                "heap" => shares.heap = value,
                "shrink_heap" => shares.shrink_heap = value,
                "stop_accepting_requests" => shares.stop_accepting_requests = value,
                "reject_connections" => shares.reject_connections = value,
                other => {
                    return Err(format!(
                        "{other:?}: one of heap, shrink_heap, stop_accepting_requests, reject_connections"
                    ));
                }
            }
        }
        Ok(shares)
    }
}

impl fmt::Display for GuardShares {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = |v: u16| f64::from(v) / 1000.0;
        write!(
            f,
            "heap={},shrink_heap={},stop_accepting_requests={},reject_connections={}",
            s(self.heap),
            s(self.shrink_heap),
            s(self.stop_accepting_requests),
            s(self.reject_connections)
        )
    }
}

impl GuardShares {
    fn guard(&self, limit: u64) -> MemoryGuard {
        let s = |v: u16| f64::from(v) / 1000.0;
        MemoryGuard {
            limit,
            heap_share: s(self.heap),
            thresholds: Thresholds {
                shrink_heap: s(self.shrink_heap),
                stop_accepting_requests: s(self.stop_accepting_requests),
                reject_connections: s(self.reject_connections),
            },
        }
    }
}

/// `--max-downstream-connections`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxConnectionsArg {
    /// From the open-file limit Envoy runs with.
    Auto,
    /// No bound from the agent.
    Off,
    /// This many.
    Max(u64),
}

impl FromStr for MaxConnectionsArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(MaxConnectionsArg::Auto),
            "off" => Ok(MaxConnectionsArg::Off),
            other => other
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .map(MaxConnectionsArg::Max)
                .ok_or_else(|| format!("{other:?} is not a count above 0, `auto` or `off`")),
        }
    }
}

impl fmt::Display for MaxConnectionsArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaxConnectionsArg::Auto => f.write_str("auto"),
            MaxConnectionsArg::Off => f.write_str("off"),
            MaxConnectionsArg::Max(n) => write!(f, "{n}"),
        }
    }
}

/// A decision: what is in force, or why nothing is.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision<T> {
    /// In force.
    On(T),
    /// Not, and why.
    Off(String),
}

impl<T: Copy> Decision<T> {
    /// What is in force, if anything.
    pub fn on(&self) -> Option<T> {
        match self {
            Decision::On(t) => Some(*t),
            Decision::Off(_) => None,
        }
    }

    /// Why nothing is in force (empty when something is).
    pub fn why_off(&self) -> &str {
        match self {
            Decision::On(_) => "",
            Decision::Off(why) => why,
        }
    }
}

/// Envoy's worker threads and why that many.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workers {
    /// The count passed as `--concurrency`; none: Envoy chooses (one per CPU it sees).
    pub concurrency: Option<u32>,
    /// Why.
    pub why: String,
}

/// What the agent decided at start to fit Envoy into its container.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// Where the memory cgroup was read (`v1 /sys/fs/cgroup/memory/…`), when found.
    pub memory_cgroup: Option<String>,
    /// The memory limit in force for the guard: the container's, or the operator's.
    pub memory_limit: Option<u64>,
    /// The memory guard.
    pub memory: Decision<MemoryGuard>,
    /// The CPU quota, in CPUs, when there is one.
    pub cpu_quota: Option<f64>,
    /// The bound on downstream connections.
    pub connections: Decision<u64>,
    /// The open-file limit Envoy runs with, when known.
    pub nofile: Option<u64>,
    /// The workers.
    pub workers: Workers,
}

/// What the operator asked for, as far as the fit goes.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    /// `--memory-guard`.
    pub memory: MemoryGuardArg,
    /// `--memory-guard-thresholds`.
    pub shares: GuardShares,
    /// `--max-downstream-connections`.
    pub connections: MaxConnectionsArg,
    /// `--concurrency` (0: not given).
    pub concurrency: u32,
    /// Arguments passed to Envoy verbatim (a `--concurrency` there is the operator's).
    pub extra_args: &'a [String],
    /// Envoy's bootstrap (its own overload manager wins).
    pub bootstrap: &'a Path,
}

/// Decides the fit from what was asked, the container and the open-file limit (`nofile`, as
/// Envoy will have it).
pub fn fit(asked: &Asked<'_>, container: &Container, nofile: Option<u64>) -> Fit {
    let conflicts = overload::conflicts_in(asked.bootstrap);
    let found = container.memory_limit();
    let memory_limit = match asked.memory {
        MemoryGuardArg::Limit(n) => Some(n),
        MemoryGuardArg::Auto => found,
        MemoryGuardArg::Off => None,
    };
    let memory = match (asked.memory, memory_limit, conflicts.memory) {
        (MemoryGuardArg::Off, ..) => Decision::Off("--memory-guard off".to_owned()),
        (_, _, Some(why)) => Decision::Off(why),
        (_, Some(limit), None) => Decision::On(asked.shares.guard(limit)),
        (_, None, None) => Decision::Off(match &container.memory {
            Some(_) => "the container has no memory limit".to_owned(),
            None => "no memory cgroup found".to_owned(),
        }),
    };
    let connections = match (asked.connections, conflicts.connections, nofile) {
        (MaxConnectionsArg::Off, ..) => {
            Decision::Off("--max-downstream-connections off".to_owned())
        }
        (_, Some(why), _) => Decision::Off(why),
        (MaxConnectionsArg::Max(n), None, _) => Decision::On(n),
        (MaxConnectionsArg::Auto, None, Some(nofile)) => {
            Decision::On(overload::connections_for(nofile))
        }
        (MaxConnectionsArg::Auto, None, None) => {
            Decision::Off("the open-file limit is unknown".to_owned())
        }
    };
    let cpu_quota = container.cpu_quota();
    let theirs = asked
        .extra_args
        .iter()
        .any(|a| a == "--concurrency" || a.starts_with("--concurrency="));
    let workers = match (asked.concurrency, theirs, cpu_quota) {
        (_, true, _) => Workers {
            concurrency: None,
            why: "yours: --concurrency among envoy's arguments".to_owned(),
        },
        (n, false, _) if n > 0 => Workers {
            concurrency: Some(n),
            why: format!("yours: --concurrency {n}"),
        },
        (_, false, Some(quota)) => {
            let n = (quota.floor() as u32).max(1);
            Workers {
                concurrency: Some(n),
                why: format!("the container's CPU quota ({quota:.2} CPUs)"),
            }
        }
        (_, false, None) => Workers {
            concurrency: None,
            why: format!(
                "no CPU quota: envoy's own, one per CPU ({})",
                std::thread::available_parallelism().map_or(0, |n| n.get())
            ),
        },
    };
    Fit {
        memory_cgroup: container
            .memory
            .as_ref()
            .map(|h| format!("{} {}", h.version.name(), h.dir().display())),
        memory_limit,
        memory,
        cpu_quota,
        connections,
        nofile,
        workers,
    }
}

impl Fit {
    /// Logs the decisions (`event="container"`).
    pub fn log(&self) {
        tracing::info!(
            event = "container",
            memory_cgroup = self.memory_cgroup.as_deref(),
            memory_limit_bytes = self.memory_limit,
            memory_guard_heap_bytes = self.memory.on().map(|g| g.max_heap()),
            memory_guard_off = (!self.memory.why_off().is_empty()).then_some(self.memory.why_off()),
            max_downstream_connections = self.connections.on(),
            connections_off = (!self.connections.why_off().is_empty()).then_some(self.connections.why_off()),
            nofile = self.nofile,
            cpu_quota = self.cpu_quota,
            concurrency = self.workers.concurrency,
            workers = %self.workers.why,
            "envoy fits its container"
        );
    }
}

/// The open-file limit Envoy will run with: the hard limit, to which the agent raises its
/// soft one at start (`setup::raise_fd_limit`), else the soft one.
pub fn nofile() -> Option<u64> {
    use nix::sys::resource::{Resource, getrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    // RLIM_INFINITY is no bound Envoy could count to.
    (hard < (1 << 40)).then_some(hard)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(bootstrap: &Path) -> Asked<'_> {
        Asked {
            memory: MemoryGuardArg::Auto,
            shares: GuardShares::default(),
            connections: MaxConnectionsArg::Auto,
            concurrency: 0,
            extra_args: &[],
            bootstrap,
        }
    }

    fn container_with(files: &[(&str, &str)]) -> (tempfile::TempDir, Container) {
        let dir = tempfile::tempdir().unwrap();
        for (path, content) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, content).unwrap();
        }
        let c = Container::from_proc(
            "4:memory:/pod\n3:cpu:/pod\n",
            "35 31 0:32 / /m rw - cgroup cgroup rw,memory\n32 31 0:29 / /c rw - cgroup cgroup rw,cpu\n",
            dir.path(),
            7,
        );
        (dir, c)
    }

    #[test]
    fn the_container_decides_unless_the_operator_did() {
        let (dir, c) = container_with(&[
            ("m/pod/memory.limit_in_bytes", "167772160"),
            ("c/pod/cpu.cfs_quota_us", "150000"),
            ("c/pod/cpu.cfs_period_us", "100000"),
        ]);
        let bootstrap = dir.path().join("b.yaml");
        std::fs::write(&bootstrap, "static_resources: {}\n").unwrap();
        let f = fit(&asked(&bootstrap), &c, Some(65_536));
        assert_eq!(f.memory_limit, Some(160 << 20));
        assert_eq!(f.memory.on().unwrap().max_heap(), 142_606_336);
        assert_eq!(f.connections.on(), Some(32_256));
        assert_eq!(f.workers.concurrency, Some(1), "{}", f.workers.why);
        assert!(f.workers.why.contains("1.50 CPUs"), "{}", f.workers.why);

        let extra = vec!["--concurrency".to_owned(), "3".to_owned()];
        let theirs = Asked {
            memory: MemoryGuardArg::Limit(1 << 30),
            connections: MaxConnectionsArg::Off,
            extra_args: &extra,
            ..asked(&bootstrap)
        };
        let f = fit(&theirs, &c, Some(65_536));
        assert_eq!(f.memory_limit, Some(1 << 30));
        assert_eq!(f.connections.on(), None);
        assert_eq!(f.workers.concurrency, None, "envoy's arguments carry it");
        let f = fit(
            &Asked {
                concurrency: 4,
                ..asked(&bootstrap)
            },
            &c,
            None,
        );
        assert_eq!(f.workers.concurrency, Some(4));
        assert_eq!(f.connections.why_off(), "the open-file limit is unknown");

        std::fs::write(
            &bootstrap,
            "overload_manager:\n  resource_monitors:\n  - name: envoy.resource_monitors.fixed_heap\n",
        )
        .unwrap();
        let f = fit(&asked(&bootstrap), &c, Some(65_536));
        assert!(f.memory.why_off().contains("fixed_heap"), "{:?}", f.memory);
    }

    #[test]
    fn no_limit_no_guard_and_it_says_why() {
        let (dir, c) = container_with(&[("m/pod/memory.limit_in_bytes", "9223372036854771712")]);
        let f = fit(&asked(&dir.path().join("none.yaml")), &c, Some(1024));
        assert_eq!(f.memory.why_off(), "the container has no memory limit");
        assert_eq!(f.workers.concurrency, None, "no quota: envoy's own");
        let f = fit(
            &asked(&dir.path().join("none.yaml")),
            &Container::default(),
            None,
        );
        assert_eq!(f.memory.why_off(), "no memory cgroup found");
    }

    #[test]
    fn the_flags_parse_as_operators_write_them() {
        assert_eq!("160Mi".parse(), Ok(MemoryGuardArg::Limit(160 << 20)));
        assert_eq!("auto".parse(), Ok(MemoryGuardArg::Auto));
        assert!(
            "12X"
                .parse::<MemoryGuardArg>()
                .unwrap_err()
                .contains("512Mi")
        );
        let s: GuardShares = "heap=0.8, reject_connections=0.97".parse().unwrap();
        assert_eq!(
            (s.heap, s.reject_connections, s.shrink_heap),
            (800, 970, 800)
        );
        assert!("heap=2".parse::<GuardShares>().is_err());
        assert!("cpu=0.5".parse::<GuardShares>().is_err());
        assert_eq!(
            GuardShares::default().to_string(),
            "heap=0.85,shrink_heap=0.8,stop_accepting_requests=0.9,reject_connections=0.95"
        );
        assert_eq!("off".parse(), Ok(MaxConnectionsArg::Off));
        assert!("0".parse::<MaxConnectionsArg>().is_err());
    }
}

//! The container around Envoy, as its cgroups say: the memory limit, how many processes the
//! kernel's OOM killer ended in it, and the CPU quota. Read-only.
//!
//! A process finds its cgroup in `/proc/self/cgroup` (a v1 line per hierarchy, `N:memory:/path`;
//! v2's one line, `0::/path`) and the hierarchy's mount in `/proc/self/mountinfo` (its root
//! and mount point). The directory is the mount point plus the path below the mount's root.
//! Three layouts need care, and Envoy's own reader gets the last two wrong (issue 50):
//!
//! - the host's view: `/proc/self/cgroup` says `/kubepods/pod…/ctr`, the mount's root is `/`;
//! - a container without a cgroup namespace: the path is the host's, and the mount's root is
//!   that same path (Docker mounts the container's own cgroup at `/sys/fs/cgroup/memory`);
//! - a container with a cgroup namespace but the host's mounts visible: the path is `/` (the
//!   namespace's root), and the mount's root shows as `/..` (it is above the namespace's):
//!   the process's cgroup is then found by its pid, the directory under the mount point whose
//!   `cgroup.procs` lists it.
//!
//! A limit is the smallest on the way up from the process's cgroup to the mount's root (a
//! pod's limit sits on the pod's cgroup, a container's on its own). "No limit" is v2's `max`,
//! v1's `-1` or its page-rounded `i64::MAX`. The v2 hierarchy is used where its memory (or
//! cpu) controller is enabled for the process's cgroup, else v1's.
//!
//! Why no crate: `sysinfo` reads a memory limit but neither the OOM-kill count nor the CPU
//! quota, nor the per-level walk; `cgroups-rs` manages cgroups (writes, creates) and reads only
//! what it is pointed at. What is needed here is ~200 lines of parsing, unit-tested on files.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A cgroup hierarchy's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// cgroup v1 (one hierarchy per controller).
    V1,
    /// cgroup v2 (the unified hierarchy).
    V2,
}

impl Version {
    /// `v1`, `v2`.
    pub fn name(self) -> &'static str {
        match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        }
    }
}

/// One controller's cgroup: its directories, the process's own first, up to the mount's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    /// v1 or v2.
    pub version: Version,
    /// The process's cgroup directory, then each parent up to the mount point.
    pub dirs: Vec<PathBuf>,
}

impl Hierarchy {
    /// The process's own cgroup directory.
    pub fn dir(&self) -> &Path {
        &self.dirs[0]
    }

    /// The smallest value `read` finds on the way up (none where a level has none).
    fn smallest<T: PartialOrd + Copy>(&self, read: impl Fn(&Path) -> Option<T>) -> Option<T> {
        self.dirs
            .iter()
            .filter_map(|d| read(d))
            .fold(None, |min, v| match min {
                Some(m) if m <= v => Some(m),
                _ => Some(v),
            })
    }
}

/// The container as its cgroups say.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Container {
    /// The memory controller's cgroup, when found.
    pub memory: Option<Hierarchy>,
    /// The cpu controller's cgroup, when found.
    pub cpu: Option<Hierarchy>,
}

/// The agent's own container, read once (Envoy runs in the agent's cgroup: a child inherits
/// it).
pub fn container() -> &'static Container {
    static CONTAINER: OnceLock<Container> = OnceLock::new();
    CONTAINER.get_or_init(|| {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        Container::from_proc(
            &read("/proc/self/cgroup"),
            &read("/proc/self/mountinfo"),
            Path::new("/"),
            std::process::id(),
        )
    })
}

impl Container {
    /// The container from `/proc/self/cgroup`'s and `/proc/self/mountinfo`'s text, with the
    /// mount points under `root` (`/`; a test's directory in tests), for process `pid` (the
    /// reader).
    pub fn from_proc(cgroup: &str, mountinfo: &str, root: &Path, pid: u32) -> Container {
        let mounts = parse_mountinfo(mountinfo);
        let lines = parse_cgroup(cgroup);
        let find = |controller: &str, v2_file: &str| {
            let v2 = lines
                .iter()
                .find(|l| l.controllers.is_empty() && l.hierarchy == "0")
                .and_then(|l| {
                    hierarchy(Version::V2, &l.path, &mounts, root, pid, |m| {
                        m.fstype == "cgroup2"
                    })
                })
                .filter(|h| h.dir().join(v2_file).exists());
            v2.or_else(|| {
                lines
                    .iter()
                    .find(|l| l.controllers.iter().any(|c| c == controller))
                    .and_then(|l| {
                        hierarchy(Version::V1, &l.path, &mounts, root, pid, |m| {
                            m.fstype == "cgroup" && m.options.iter().any(|o| o == controller)
                        })
                    })
            })
        };
        Container {
            memory: find("memory", "memory.max"),
            cpu: find("cpu", "cpu.max"),
        }
    }

    /// The memory limit in bytes, the smallest on the way up; none without one.
    pub fn memory_limit(&self) -> Option<u64> {
        let memory = self.memory.as_ref()?;
        memory.smallest(|dir| match memory.version {
            Version::V2 => read_limit(&dir.join("memory.max")),
            Version::V1 => read_limit(&dir.join("memory.limit_in_bytes")),
        })
    }

    /// How many processes the OOM killer ended in the container's cgroups, summed over the
    /// levels (a pod's limit is counted at the pod's level): a number to compare, before and
    /// after a death. None where the kernel does not count them.
    pub fn oom_kills(&self) -> Option<u64> {
        let memory = self.memory.as_ref()?;
        let file = match memory.version {
            Version::V2 => "memory.events",
            Version::V1 => "memory.oom_control",
        };
        let counts: Vec<u64> = memory
            .dirs
            .iter()
            .filter_map(|d| std::fs::read_to_string(d.join(file)).ok())
            .filter_map(|text| field(&text, "oom_kill"))
            .collect();
        (!counts.is_empty()).then(|| counts.iter().sum())
    }

    /// The CPU quota in CPUs (quota over period), the smallest on the way up; none without.
    pub fn cpu_quota(&self) -> Option<f64> {
        let cpu = self.cpu.as_ref()?;
        cpu.smallest(|dir| match cpu.version {
            Version::V2 => {
                let text = std::fs::read_to_string(dir.join("cpu.max")).ok()?;
                let mut parts = text.split_whitespace();
                let quota = parts.next()?.parse::<f64>().ok()?;
                let period = parts.next()?.parse::<f64>().ok()?;
                (quota > 0.0 && period > 0.0).then(|| quota / period)
            }
            Version::V1 => {
                let quota = read_i64(&dir.join("cpu.cfs_quota_us"))?;
                let period = read_i64(&dir.join("cpu.cfs_period_us"))?;
                (quota > 0 && period > 0).then(|| quota as f64 / period as f64)
            }
        })
    }
}

/// A line of `/proc/self/cgroup`.
#[derive(Debug)]
struct CgroupLine {
    hierarchy: String,
    controllers: Vec<String>,
    path: String,
}

fn parse_cgroup(text: &str) -> Vec<CgroupLine> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let hierarchy = parts.next()?.to_owned();
            let controllers = parts
                .next()?
                .split(',')
                .filter(|c| !c.is_empty())
                .map(str::to_owned)
                .collect();
            let path = parts.next()?.to_owned();
            Some(CgroupLine {
                hierarchy,
                controllers,
                path,
            })
        })
        .collect()
}

/// A line of `/proc/self/mountinfo`, what matters of it.
#[derive(Debug)]
struct Mount {
    root: String,
    point: String,
    fstype: String,
    options: Vec<String>,
}

fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let fields: Vec<&str> = before.split(' ').collect();
            let mut after = after.split(' ');
            let fstype = after.next()?.to_owned();
            let _source = after.next();
            let options = after
                .next()
                .unwrap_or_default()
                .split(',')
                .map(str::to_owned)
                .collect();
            Some(Mount {
                root: unescape(fields.get(3)?),
                point: unescape(fields.get(4)?),
                fstype,
                options,
            })
        })
        .collect()
}

/// mountinfo escapes spaces and the like as octal (`\040`).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            if let Ok(n) = u8::from_str_radix(&field[i + 1..i + 4], 8) {
                out.push(n);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The directories of the cgroup at `path` in the hierarchy whose mount `pick` chooses.
fn hierarchy(
    version: Version,
    path: &str,
    mounts: &[Mount],
    root: &Path,
    pid: u32,
    pick: impl Fn(&Mount) -> bool,
) -> Option<Hierarchy> {
    let candidates: Vec<&Mount> = mounts.iter().filter(|m| pick(m)).collect();
    // The mount whose root holds the path, the deepest; else (a cgroup namespace over the
    // host's mounts) the first, its root taken as the namespace's.
    let under = |m: &Mount| {
        if m.root.starts_with("/..") {
            return false;
        }
        let r = m.root.trim_end_matches('/');
        path == m.root || r.is_empty() || path.starts_with(&format!("{r}/"))
    };
    let (mount, rel) = match candidates
        .iter()
        .filter(|m| under(m))
        .max_by_key(|m| m.root.len())
    {
        Some(m) => {
            let r = m.root.trim_end_matches('/');
            (*m, path.strip_prefix(r).unwrap_or(path).to_owned())
        }
        None => (*candidates.first()?, path.to_owned()),
    };
    let point = root.join(mount.point.trim_start_matches('/'));
    let mut dir = point.join(rel.trim_start_matches('/'));
    if mount.root.starts_with("/..") || !dir.is_dir() {
        // The path cannot be followed (a namespace's path on the host's mount): the cgroup
        // whose `cgroup.procs` lists the process, else the mount's own.
        dir = find_pid(&point, pid).unwrap_or_else(|| point.clone());
    }
    if !dir.is_dir() {
        return None;
    }
    let mut dirs = vec![dir.clone()];
    let mut up = dir.as_path();
    while up != point {
        match up.parent() {
            Some(parent) if parent.starts_with(&point) => {
                dirs.push(parent.to_path_buf());
                up = parent;
            }
            _ => break,
        }
    }
    Some(Hierarchy { version, dirs })
}

/// The directory under `point` whose `cgroup.procs` lists `pid`, breadth first, looking at
/// [`SEARCHED`] directories at most (a node has thousands of cgroups).
fn find_pid(point: &Path, pid: u32) -> Option<PathBuf> {
    let pid = pid.to_string();
    let mut queue = std::collections::VecDeque::from([point.to_path_buf()]);
    let mut seen = 0;
    while let Some(dir) = queue.pop_front() {
        seen += 1;
        if seen > SEARCHED {
            return None;
        }
        let listed = std::fs::read_to_string(dir.join("cgroup.procs"))
            .is_ok_and(|procs| procs.lines().any(|l| l.trim() == pid));
        if listed {
            return Some(dir);
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            queue.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    None
}

/// How many cgroup directories [`find_pid`] looks at, at most.
const SEARCHED: usize = 20_000;

/// A limit file: bytes, or none for `max`, `-1` and v1's page-rounded `i64::MAX`.
fn read_limit(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    if text == "max" {
        return None;
    }
    let value = text.parse::<i64>().ok()?;
    // v1 writes "no limit" as i64::MAX rounded down to a page.
    (value > 0 && value < (1i64 << 62)).then_some(value as u64)
}

fn read_i64(path: &Path) -> Option<i64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `name N` in a flat-keyed file (`memory.events`, `memory.oom_control`).
fn field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Makes `files` (path → content) under a fresh directory.
    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, content) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, content).unwrap();
        }
        dir
    }

    const V1_MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn v1_from_the_hosts_view_takes_the_smallest_limit_on_the_way_up() {
        let t = tree(&[
            (
                "sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            (
                "sys/fs/cgroup/memory/kubepods/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            (
                "sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes",
                "167772160\n",
            ),
            (
                "sys/fs/cgroup/memory/kubepods/pod1/ctr/memory.limit_in_bytes",
                "268435456\n",
            ),
            (
                "sys/fs/cgroup/memory/kubepods/pod1/ctr/memory.oom_control",
                "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
            ),
            (
                "sys/fs/cgroup/memory/kubepods/pod1/memory.oom_control",
                "oom_kill 1\n",
            ),
            (
                "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/ctr/cpu.cfs_quota_us",
                "150000\n",
            ),
            (
                "sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/ctr/cpu.cfs_period_us",
                "100000\n",
            ),
            ("sys/fs/cgroup/unified/kubepods/pod1/ctr/cgroup.procs", ""),
        ]);
        let c = Container::from_proc(
            "12:memory:/kubepods/pod1/ctr\n3:cpu,cpuacct:/kubepods/pod1/ctr\n0::/kubepods/pod1/ctr\n",
            V1_MOUNTS,
            t.path(),
            7,
        );
        let memory = c.memory.as_ref().unwrap();
        assert_eq!(
            memory.version,
            Version::V1,
            "v2 has no memory controller here"
        );
        assert_eq!(
            memory.dir(),
            t.path().join("sys/fs/cgroup/memory/kubepods/pod1/ctr")
        );
        assert_eq!(memory.dirs.len(), 4, "{:?}", memory.dirs);
        assert_eq!(
            c.memory_limit(),
            Some(160 << 20),
            "the pod's limit is the smaller"
        );
        assert_eq!(c.oom_kills(), Some(3));
        assert_eq!(c.cpu_quota(), Some(1.5));
    }

    #[test]
    fn v1_inside_a_container_without_a_cgroup_namespace_is_the_mounts_own_cgroup() {
        // Docker: the path is the host's, and the mount's root is that same cgroup.
        let t = tree(&[("sys/fs/cgroup/memory/memory.limit_in_bytes", "104857600\n")]);
        let c = Container::from_proc(
            "9:memory:/docker/abc\n",
            "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n",
            t.path(),
            7,
        );
        assert_eq!(
            c.memory.as_ref().unwrap().dir(),
            t.path().join("sys/fs/cgroup/memory")
        );
        assert_eq!(c.memory_limit(), Some(100 << 20));
        assert_eq!(c.cpu_quota(), None, "no cpu hierarchy");
    }

    #[test]
    fn a_cgroup_namespace_over_the_hosts_mounts_reads_the_namespaces_root() {
        // `unshare --cgroup`: /proc/self/cgroup says `/`, the mount's root is the host's `/`
        // (Envoy: "Cgroup path / is outside mount root"); or a mount whose root the path is
        // outside of.
        let t = tree(&[
            ("sys/fs/cgroup/memory/memory.limit_in_bytes", "-1\n"),
            (
                "sys/fs/cgroup/memory/sub/memory.limit_in_bytes",
                "52428800\n",
            ),
        ]);
        let c = Container::from_proc(
            "4:memory:/sub\n",
            "35 31 0:32 /test/ns /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
            t.path(),
            7,
        );
        assert_eq!(c.memory_limit(), Some(50 << 20));
        // `unshare --cgroup` over the host's mounts: the mount's root shows as `/..`; the
        // process is found by its pid.
        let t2 = tree(&[
            (
                "sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            ("sys/fs/cgroup/memory/other/cgroup.procs", "3\n"),
            (
                "sys/fs/cgroup/memory/other/memory.limit_in_bytes",
                "1048576\n",
            ),
            ("sys/fs/cgroup/memory/ctr/cgroup.procs", "5\n7\n"),
            (
                "sys/fs/cgroup/memory/ctr/memory.limit_in_bytes",
                "314572800\n",
            ),
        ]);
        let c = Container::from_proc(
            "4:memory:/\n",
            "35 31 0:32 /.. /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
            t2.path(),
            7,
        );
        assert_eq!(
            c.memory.as_ref().unwrap().dir(),
            t2.path().join("sys/fs/cgroup/memory/ctr")
        );
        assert_eq!(c.memory_limit(), Some(300 << 20));
        let c = Container::from_proc("4:memory:/\n", V1_MOUNTS, t.path(), 7);
        assert_eq!(
            c.memory.as_ref().unwrap().dir(),
            t.path().join("sys/fs/cgroup/memory")
        );
        assert_eq!(c.memory_limit(), None, "-1 is none");
    }

    #[test]
    fn v2_nested_with_max_meaning_none() {
        let t = tree(&[
            ("sys/fs/cgroup/memory.max", "max\n"),
            ("sys/fs/cgroup/kubepods.slice/memory.max", "max\n"),
            (
                "sys/fs/cgroup/kubepods.slice/pod.slice/memory.max",
                "209715200\n",
            ),
            (
                "sys/fs/cgroup/kubepods.slice/pod.slice/ctr.scope/memory.max",
                "max\n",
            ),
            (
                "sys/fs/cgroup/kubepods.slice/pod.slice/ctr.scope/memory.events",
                "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n",
            ),
            (
                "sys/fs/cgroup/kubepods.slice/pod.slice/ctr.scope/cpu.max",
                "max 100000\n",
            ),
            (
                "sys/fs/cgroup/kubepods.slice/pod.slice/cpu.max",
                "100000 100000\n",
            ),
        ]);
        let c = Container::from_proc(
            "0::/kubepods.slice/pod.slice/ctr.scope\n",
            "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n",
            t.path(),
            7,
        );
        assert_eq!(c.memory.as_ref().unwrap().version, Version::V2);
        assert_eq!(c.memory_limit(), Some(200 << 20));
        assert_eq!(c.oom_kills(), Some(1));
        assert_eq!(c.cpu_quota(), Some(1.0));
        // Inside the container's own namespace: `0::/` and its own mount.
        let t = tree(&[("sys/fs/cgroup/memory.max", "max\n")]);
        let c = Container::from_proc(
            "0::/\n",
            "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
            t.path(),
            7,
        );
        assert_eq!(c.memory_limit(), None);
        assert_eq!(c.oom_kills(), None, "no memory.events");
    }

    #[test]
    fn nothing_to_read_is_no_container() {
        let t = tree(&[]);
        assert_eq!(
            Container::from_proc("", "", t.path(), 7),
            Container::default()
        );
        assert_eq!(Container::default().memory_limit(), None);
        assert_eq!(unescape(r"/a\040b"), "/a b");
    }
}

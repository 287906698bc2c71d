//! A cgroup of the test's own, to run an agent (and the Envoy it starts) in a container's
//! limits: a memory limit, a CPU quota. cgroup v1 where the machine mounts its memory and cpu
//! controllers there (these machines), else v2 (`/sys/fs/cgroup`, its controllers enabled for
//! children). Needs root: a test that cannot make one fails, saying so. Removed on drop (the
//! processes in it are killed first).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// A cgroup (one directory per controller in v1, one in v2) of the test's own.
#[derive(Debug)]
pub struct TestCgroup {
    dirs: Vec<PathBuf>,
    v2: bool,
}

fn unique(name: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "envoy-agent-test-{name}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

fn write(path: &Path, value: &str) {
    std::fs::write(path, value)
        .unwrap_or_else(|e| panic!("cannot write {value:?} to {} (root?): {e}", path.display()));
}

impl TestCgroup {
    /// A cgroup with a memory limit of `limit` bytes and, when given, a CPU quota of
    /// `cpus` CPUs.
    pub fn new(name: &str, limit: Option<u64>, cpus: Option<f64>) -> TestCgroup {
        let name = unique(name);
        let v1 = Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists();
        if v1 {
            let memory = Path::new("/sys/fs/cgroup/memory").join(&name);
            let cpu = ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"]
                .iter()
                .map(Path::new)
                .find(|p| p.join("cpu.cfs_quota_us").exists())
                .expect("a v1 cpu hierarchy")
                .join(&name);
            for dir in [&memory, &cpu] {
                std::fs::create_dir(dir).unwrap_or_else(|e| {
                    panic!(
                        "cannot make cgroup {} (the test needs root): {e}",
                        dir.display()
                    )
                });
            }
            if let Some(limit) = limit {
                write(&memory.join("memory.limit_in_bytes"), &limit.to_string());
            }
            if let Some(cpus) = cpus {
                write(&cpu.join("cpu.cfs_period_us"), "100000");
                write(
                    &cpu.join("cpu.cfs_quota_us"),
                    &((cpus * 100_000.0) as u64).to_string(),
                );
            }
            return TestCgroup {
                dirs: vec![memory, cpu],
                v2: false,
            };
        }
        let root = Path::new("/sys/fs/cgroup");
        assert!(
            root.join("cgroup.controllers").exists(),
            "neither cgroup v1 memory nor cgroup v2 is mounted at /sys/fs/cgroup"
        );
        let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory +cpu");
        let dir = root.join(&name);
        std::fs::create_dir(&dir).unwrap_or_else(|e| {
            panic!(
                "cannot make cgroup {} (the test needs root): {e}",
                dir.display()
            )
        });
        if let Some(limit) = limit {
            write(&dir.join("memory.max"), &limit.to_string());
            let _ = std::fs::write(dir.join("memory.swap.max"), "0");
        }
        if let Some(cpus) = cpus {
            write(
                &dir.join("cpu.max"),
                &format!("{} 100000", (cpus * 100_000.0) as u64),
            );
        }
        TestCgroup {
            dirs: vec![dir],
            v2: true,
        }
    }

    /// A wrapper (for `AgentBuilder::wrapper`) that moves itself into the cgroup and execs the
    /// agent: the agent and the Envoy it starts run in it.
    pub fn wrapper(&self) -> Vec<String> {
        let joins: Vec<String> = self
            .dirs
            .iter()
            .map(|d| format!("echo $$ > {}/cgroup.procs", d.display()))
            .collect();
        vec![
            "sh".into(),
            "-c".into(),
            format!("{} && exec \"$@\"", joins.join(" && ")),
            "sh".into(),
        ]
    }

    /// How many processes the OOM killer ended in it so far.
    pub fn oom_kills(&self) -> u64 {
        let (file, dir) = match self.v2 {
            true => ("memory.events", &self.dirs[0]),
            false => ("memory.oom_control", &self.dirs[0]),
        };
        let text = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The memory cgroup's directory.
    pub fn memory_dir(&self) -> &Path {
        &self.dirs[0]
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for dir in &self.dirs {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|p| p.trim().parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        for dir in &self.dirs {
            for _ in 0..50 {
                if std::fs::remove_dir(dir).is_ok() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

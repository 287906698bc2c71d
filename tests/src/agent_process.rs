//! The real `envoy-agent` binary running the real Envoy, for end-to-end tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_agent_proxy::{AdminClient, ServerState};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::{PATIENCE, TestDir, children_of, envoy_path, eventually};

/// The fixed ports and base id of a hot-restart test.
#[derive(Debug, Clone, Copy)]
pub struct HotRestartPorts {
    /// Envoy's `--base-id`.
    pub base_id: u32,
    /// The admin port every epoch binds.
    pub admin_port: u16,
    /// The `hello` listener's port.
    pub listener_port: u16,
}

impl HotRestartPorts {
    /// Where the agent reaches Envoy's admin API by default: its own socket
    /// ([`crate::node_admin_socket`]); `admin_port` is the bootstrap's, used only with
    /// `--envoy-admin bootstrap`.
    pub fn admin(&self) -> envoy_agent_proxy::admin::Address {
        crate::node_admin_socket(self.base_id)
    }

    /// The bootstrap's TCP admin address (`--envoy-admin bootstrap`).
    pub fn admin_tcp(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.admin_port))
    }
}

/// Builds an [`AgentProcess`].
#[derive(Debug)]
pub struct AgentBuilder {
    binary: PathBuf,
    dir: TestDir,
    bootstrap: Option<String>,
    bootstrap_path: Option<PathBuf>,
    args: Vec<String>,
    wait_live: bool,
    admin_at: Option<envoy_agent_proxy::admin::Address>,
    wrapper: Vec<String>,
    /// Envoy gets `--concurrency 1` from the kit (tests run in parallel on small machines).
    kit_workers: bool,
    envoy_path: Option<PathBuf>,
    hot_restart: Option<HotRestartPorts>,
    /// Whether this agent owns the family's shared memory (removes it when dropped).
    owns_shm: bool,
    /// Leave `--status-address` at its default (127.0.0.1:15020): the caller isolates the
    /// network (a private network namespace).
    default_status_address: bool,
    /// Return as soon as the agent runs.
    wait_nothing: bool,
    /// Extra environment variables for the agent.
    env: Vec<(String, String)>,
    /// Envoy arguments after the agent's `--`.
    envoy_args: Vec<String>,
    /// Where the agent's stdout and stderr go instead of the kit's reader (then no event is
    /// seen by the kit).
    output: Option<std::fs::File>,
}

impl AgentBuilder {
    /// The bootstrap YAML (default: [`crate::bootstrap_yaml`] answering `hello`).
    pub fn bootstrap(mut self, yaml: String) -> Self {
        self.bootstrap = Some(yaml);
        self
    }

    /// Where the test reaches Envoy's admin API, when the kit cannot tell (an agent in a mount
    /// namespace of its own, whose temp dir the test does not see).
    pub fn admin_at(mut self, addr: envoy_agent_proxy::admin::Address) -> Self {
        self.admin_at = Some(addr);
        self
    }

    /// Runs on this bootstrap file (e.g. a symlink the test swaps) instead of writing one.
    pub fn bootstrap_path(mut self, path: PathBuf) -> Self {
        self.bootstrap_path = Some(path);
        self
    }

    /// Runs this "Envoy" (e.g. a wrapper script that execs the real one).
    pub fn envoy_path(mut self, path: PathBuf) -> Self {
        self.envoy_path = Some(path);
        self
    }

    /// The test's temp dir.
    pub fn dir(&self) -> &TestDir {
        &self.dir
    }

    /// Extra `envoy-agent run` arguments (before `--`).
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Do not wait for Envoy to be LIVE (e.g. it is meant to stay initializing).
    pub fn no_wait_live(mut self) -> Self {
        self.wait_live = false;
        self
    }

    /// Sets an environment variable of the agent.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Wait for nothing: `start` returns once the agent runs (it may exit at once, or its
    /// readiness marker may be stale). The status server's address is then unknown.
    pub fn no_wait(mut self) -> Self {
        self.wait_live = false;
        self.wait_nothing = true;
        self
    }

    /// Adds Envoy arguments (after the agent's `--`).
    pub fn envoy_args(mut self, args: &[&str]) -> Self {
        self.envoy_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Runs the agent through a wrapper command (e.g. `unshare --net ...`), which must exec
    /// its arguments.
    pub fn wrapper(mut self, wrapper: &[&str]) -> Self {
        self.wrapper = wrapper.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Leaves Envoy's workers to the agent (no `--concurrency 1` from the kit).
    pub fn agents_workers(mut self) -> Self {
        self.kit_workers = false;
        self
    }

    /// Runs with `--hot-restart` on fixed ports and a base id of the test's own, with the
    /// default bootstrap on those ports unless one is given.
    pub fn hot_restart(mut self) -> Self {
        self.hot_restart = Some(HotRestartPorts {
            base_id: crate::unique_base_id(),
            admin_port: crate::free_port(),
            listener_port: crate::free_port(),
        });
        self.owns_shm = true;
        self
    }

    /// Runs with `--hot-restart` on another agent's ports and base id (the next "pod" of the
    /// same node).
    pub fn hot_restart_on(mut self, ports: HotRestartPorts) -> Self {
        self.hot_restart = Some(ports);
        // The node's other agents share it; whoever picked the ports cleans up.
        self.owns_shm = false;
        self
    }

    /// Keeps the status server on its default address (for tests in a private network
    /// namespace); `start` then does not wait for it.
    pub fn default_status_address(mut self) -> Self {
        self.default_status_address = true;
        self
    }

    /// The ports and base id [`AgentBuilder::hot_restart`] picked.
    pub fn ports(&self) -> Option<HotRestartPorts> {
        self.hot_restart
    }

    /// The agent's stdout and stderr into `file` (a FIFO nobody reads, say) instead of the
    /// kit's reader: [`AgentProcess::events`] and its kin then see nothing.
    pub fn output(mut self, file: std::fs::File) -> Self {
        self.output = Some(file);
        self
    }

    /// Starts the agent; waits for Envoy's admin address (and the status server, without hot
    /// restart), and for Envoy to be LIVE unless told not to.
    pub async fn start(mut self) -> AgentProcess {
        let dir = self.dir;
        let default_bootstrap = match self.hot_restart {
            Some(p) => crate::bootstrap_yaml_on(p.admin_port, p.listener_port, "hello"),
            None => crate::bootstrap_yaml("hello"),
        };
        let bootstrap = match self.bootstrap_path.take() {
            Some(path) => path,
            None => dir.write(
                "bootstrap.yaml",
                &self.bootstrap.take().unwrap_or(default_bootstrap),
            ),
        };
        let admin_file = dir.join("admin-address");
        let status_file = dir.join("status-address");
        let mut command = match self.wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(&self.binary);
                c
            }
            None => Command::new(&self.binary),
        };
        // A gRPC socket of the test's own, unless the test picks the address.
        let grpc = match self.args.iter().position(|a| a == "--grpc-address") {
            Some(i) => self.args.get(i + 1).cloned().unwrap_or_default(),
            None => {
                let grpc = format!("unix:{}", dir.join("grpc.sock").display());
                command.arg("--grpc-address").arg(&grpc);
                grpc
            }
        };
        command
            .arg("run")
            .arg("-c")
            .arg(&bootstrap)
            .arg("--envoy-path")
            .arg(self.envoy_path.take().unwrap_or_else(envoy_path));
        // In hot-restart mode the marker says when the supervisor itself has seen LIVE.
        let marker = match self.args.iter().position(|a| a == "--ready-marker") {
            Some(i) => self.args.get(i + 1).map(PathBuf::from),
            None if self.hot_restart.is_some() => {
                let marker = dir.join("ready");
                command.arg("--ready-marker").arg(&marker);
                Some(marker)
            }
            None => None,
        };
        // Port 0 unless the test picks the address: tests run in parallel.
        let own_status =
            !self.default_status_address && !self.args.iter().any(|a| a == "--status-address");
        if own_status {
            command.args(["--status-address", "127.0.0.1:0"]);
        }
        command.arg("--status-address-file").arg(&status_file);
        match self.hot_restart {
            Some(p) => {
                if !self.args.iter().any(|a| a == "--state-dir") {
                    command.arg("--state-dir").arg(dir.join("state"));
                }
                command
                    .args(["--hot-restart", "--base-id", &p.base_id.to_string()])
                    .args(&self.args)
                    .arg("--")
                    .args(
                        self.kit_workers
                            .then_some(["--concurrency", "1"])
                            .iter()
                            .flatten(),
                    )
                    .args(&self.envoy_args);
            }
            None => {
                command
                    .args(&self.args)
                    .arg("--")
                    .args(
                        self.kit_workers
                            .then_some(["--concurrency", "1"])
                            .iter()
                            .flatten(),
                    )
                    .arg("--admin-address-path")
                    .arg(&admin_file)
                    .args(&self.envoy_args);
            }
        }
        command
            .env_remove("ENVOY_PATH")
            .env_remove("RUST_LOG")
            .env("ENVOY_AGENT_LOG_LEVEL", "debug")
            // Structured logs: tests assert on `event` fields, not on prose.
            .env("ENVOY_AGENT_LOG_FORMAT", "json")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .kill_on_drop(true);
        match self.output.take() {
            Some(file) => {
                let copy = file
                    .try_clone()
                    .unwrap_or_else(|e| panic!("the agent's output: {e}"));
                command.stdout(copy).stderr(file);
            }
            None => {
                command.stderr(Stdio::piped());
            }
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.binary.display()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut stderr_reader = None;
        if let Some(pipe) = child.stderr.take() {
            let stderr = stderr.clone();
            stderr_reader = Some(tokio::spawn(async move {
                // Bytes, not `lines()`: a line that is not UTF-8 (Envoy's stderr shares the
                // pipe) would end `lines()`, and the agent would block on a full pipe.
                let mut pipe = BufReader::new(pipe);
                let mut raw = Vec::new();
                loop {
                    raw.clear();
                    match pipe.read_until(b'\n', &mut raw).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                    let text = String::from_utf8_lossy(&raw);
                    let line = text.trim_end_matches(['\n', '\r']);
                    // Shown with the test's output when it fails.
                    eprintln!("{line}");
                    if let Ok(mut s) = stderr.lock() {
                        s.push_str(line);
                        s.push('\n');
                    }
                }
            }));
        }
        let status = if self.default_status_address || self.wait_nothing {
            None
        } else {
            Some(crate::admin_address_from_file(&status_file).await)
        };
        // Where the agent puts it: its own socket for a node proxy, unless the test says.
        let bootstrap_admin = self
            .args
            .windows(2)
            .any(|w| w[0] == "--envoy-admin" && w[1] == "bootstrap")
            || self.args.iter().any(|a| a == "--envoy-admin=bootstrap")
            || self.args.iter().any(|a| a.starts_with("--admin-address"));
        let socket_admin = self
            .args
            .windows(2)
            .any(|w| w[0] == "--envoy-admin" && w[1] == "socket")
            || self.args.iter().any(|a| a == "--envoy-admin=socket");
        // The agent's temp dir: the test's, unless it gives the agent another.
        let temp_dir = self
            .env
            .iter()
            .find(|(k, _)| k == "TMPDIR")
            .map_or_else(std::env::temp_dir, |(_, v)| PathBuf::from(v));
        let admin = match (self.hot_restart, self.admin_at.take()) {
            (_, Some(addr)) => AdminClient::new(addr),
            (Some(p), None) if bootstrap_admin => AdminClient::new(p.admin_tcp()),
            (Some(p), None) => AdminClient::new(crate::node_admin_socket_in(&temp_dir, p.base_id)),
            (None, None) if socket_admin => AdminClient::new(
                eventually(
                    "the agent to name envoy's admin socket",
                    PATIENCE,
                    || async {
                        let text = stderr.lock().ok()?.clone();
                        crate::admin_socket_in_log(&text)
                    },
                )
                .await,
            ),
            (None, None) => AdminClient::new(crate::admin_address_from_file(&admin_file).await),
        };
        if self.wait_live {
            eventually("envoy to be LIVE", PATIENCE, || async {
                matches!(admin.server_info().await, Ok(i) if i.state == ServerState::Live)
                    .then_some(())
            })
            .await;
            // The agent has seen it too: its readiness says so.
            if let (Some(marker), Some(_)) = (&marker, self.hot_restart) {
                eventually("the supervisor's readiness marker", PATIENCE, || async {
                    marker.exists().then_some(())
                })
                .await;
            }
            if let Some(status) = status {
                eventually("the agent to report ready", PATIENCE, || async {
                    let r = crate::http_get(status, "/healthz/ready").await.ok()?;
                    (r.status == 200).then_some(())
                })
                .await;
            }
        }
        AgentProcess {
            child,
            admin,
            status,
            dir,
            stderr,
            stderr_reader,
            ports: self.hot_restart.filter(|_| self.owns_shm),
            grpc,
        }
    }
}

/// A running `envoy-agent run`.
#[derive(Debug)]
pub struct AgentProcess {
    child: Child,
    /// Envoy's admin API.
    pub admin: AdminClient,
    status: Option<SocketAddr>,
    /// The test's temp dir (bootstrap, address files).
    pub dir: TestDir,
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<tokio::task::JoinHandle<()>>,
    /// Hot restart's ports and base id, when on.
    pub ports: Option<HotRestartPorts>,
    /// The agent's gRPC address (`unix:/path` or `host:port`).
    pub grpc: String,
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        // The agent is killed on drop (kill_on_drop) and Envoy follows it; Envoy's shared
        // memory would stay in /dev/shm.
        if let Some(p) = self.ports {
            // ... and its cold handover's second family's, under the next base id.
            for base_id in [p.base_id, p.base_id + 1] {
                let _ = std::fs::remove_file(format!(
                    "/dev/shm/envoy_shared_memory_{}",
                    u64::from(base_id) * 10
                ));
            }
        }
    }
}

impl AgentProcess {
    /// A builder for the agent binary at `binary` (`env!("CARGO_BIN_EXE_envoy-agent")`).
    pub fn builder(binary: impl AsRef<Path>) -> AgentBuilder {
        AgentBuilder {
            binary: binary.as_ref().to_owned(),
            dir: TestDir::new(),
            bootstrap: None,
            bootstrap_path: None,
            args: Vec::new(),
            wait_live: true,
            admin_at: None,
            wrapper: Vec::new(),
            kit_workers: true,
            envoy_path: None,
            hot_restart: None,
            owns_shm: false,
            default_status_address: false,
            wait_nothing: false,
            env: Vec::new(),
            envoy_args: Vec::new(),
            output: None,
        }
    }

    /// The agent's status server.
    pub fn status(&self) -> SocketAddr {
        self.status
            .unwrap_or_else(|| panic!("the status server's address is not known to the test"))
    }

    /// The agent's structured log events named `event` so far (its JSON log lines whose
    /// `event` field is `event`), oldest first. Panics at a JSON line with a key twice (any
    /// line so far, of any event): log pipelines read those differently.
    pub fn events(&self, event: &str) -> Vec<serde_json::Value> {
        self.stderr()
            .lines()
            // Envoy's own lines, forwarded, are not JSON.
            .filter(|line| line.starts_with('{'))
            .filter_map(|line| match crate::json::parse_strict(line) {
                Ok(value) => Some(value),
                // Valid JSON all the same: a key twice.
                Err(e) if serde_json::from_str::<serde_json::Value>(line).is_ok() => {
                    panic!("the agent logged a JSON line with {e}: {line}")
                }
                Err(_) => None,
            })
            .filter(|v| v.get("event").and_then(|e| e.as_str()) == Some(event))
            .collect()
    }

    /// The events named `event` whose field `key` is `value` (as a string or a number).
    pub fn events_with(&self, event: &str, key: &str, value: &str) -> Vec<serde_json::Value> {
        self.events(event)
            .into_iter()
            .filter(|v| match v.get(key) {
                Some(serde_json::Value::String(s)) => s == value,
                Some(other) => value
                    .parse::<serde_json::Value>()
                    .is_ok_and(|v| v == *other),
                None => false,
            })
            .collect()
    }

    /// Waits (bounded) until an event named `event` with `key` = `value` has been logged.
    pub async fn wait_event(&self, event: &str, key: &str, value: &str) -> serde_json::Value {
        eventually(
            &format!("a {event} event with {key}={value}"),
            PATIENCE,
            || async { self.events_with(event, key, value).into_iter().next() },
        )
        .await
    }

    /// The agent's pid (the wrapper's, when one execs it, is the same).
    pub fn pid(&self) -> u32 {
        self.child
            .id()
            .unwrap_or_else(|| panic!("the agent has exited"))
    }

    /// The process running envoy-agent: the agent's pid, or, under a wrapper that forks
    /// (`unshare --fork`), the wrapper's one child.
    pub fn agent_pid(&self) -> u32 {
        let pid = self.pid();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        if exe.file_name().is_some_and(|n| n == "unshare") {
            let children = children_of(pid);
            assert_eq!(children.len(), 1, "unshare has one child: {children:?}");
            children[0]
        } else {
            pid
        }
    }

    /// Sends `signal` to the process running envoy-agent (past a forking wrapper).
    pub fn signal_agent(&self, signal: Signal) {
        kill(Pid::from_raw(self.agent_pid() as i32), signal)
            .unwrap_or_else(|e| panic!("cannot send {signal} to the agent: {e}"));
    }

    /// Whether the readiness marker (hot restart) exists.
    pub fn marker_present(&self) -> bool {
        self.dir.join("ready").exists()
    }

    /// The agent's children (Envoy epochs).
    pub fn children(&self) -> Vec<u32> {
        children_of(self.agent_pid())
    }

    /// Envoy's pid: the agent's one child that runs Envoy. A pre-flight (`--mode validate`,
    /// `--hot-restart-version`, run ahead of a restart) or a fork not yet exec'd may be there
    /// beside it for a moment: those are waited out (bounded).
    pub fn envoy_pid(&self) -> u32 {
        let agent_exe = std::fs::read_link(format!("/proc/{}/exe", self.agent_pid())).ok();
        let serving = |child: &u32| {
            let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            let preflight = cmdline
                .split(|b| *b == 0)
                .any(|arg| arg == b"validate" || arg == b"--hot-restart-version");
            let exe = std::fs::read_link(format!("/proc/{child}/exe")).ok();
            !preflight && exe.is_some() && exe != agent_exe
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let children = self.children();
            let envoys: Vec<u32> = children.iter().copied().filter(serving).collect();
            if envoys.len() == 1 && children.len() == 1 {
                return envoys[0];
            }
            assert!(
                Instant::now() < deadline,
                "the agent has one child, envoy: {children:?} (envoys: {envoys:?})"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to the agent.
    pub fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.pid() as i32), signal)
            .unwrap_or_else(|e| panic!("cannot send {signal} to the agent: {e}"));
    }

    /// Everything the agent and Envoy wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// How many times `needle` appears in the agent's stderr so far.
    pub fn count_in_stderr(&self, needle: &str) -> usize {
        self.stderr().matches(needle).count()
    }

    /// The bound address of Envoy's listener `name`.
    pub async fn listener(&self, name: &str) -> SocketAddr {
        self.admin
            .listeners()
            .await
            .unwrap_or_else(|e| panic!("listeners: {e}"))
            .into_iter()
            .find(|l| l.name == name)
            .and_then(|l| l.local_address)
            .unwrap_or_else(|| panic!("listener {name} is not bound"))
    }

    /// Whether the agent is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits (bounded by [`PATIENCE`]) for the agent to exit, and for the last of its stderr.
    pub async fn exit(&mut self) -> ExitStatus {
        let status = tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("the agent did not exit within {PATIENCE:?}"))
            .unwrap_or_else(|e| panic!("waiting for the agent: {e}"));
        if let Some(reader) = self.stderr_reader.take() {
            // Ends at EOF; an orphan holding the pipe must not hang the test.
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), reader).await;
        }
        status
    }

    /// The Envoy processes (children started with `--restart-epoch`) of the agent.
    pub fn envoys(&self) -> Vec<u32> {
        crate::envoy_children_of(self.pid())
    }
}

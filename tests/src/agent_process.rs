//! The real `envoy-agent` binary running the real Envoy, for end-to-end tests.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};

use envoy_agent_proxy::{AdminClient, ServerState};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::{PATIENCE, TestDir, children_of, envoy_path, eventually};

/// Builds an [`AgentProcess`].
#[derive(Debug)]
pub struct AgentBuilder {
    binary: PathBuf,
    dir: TestDir,
    bootstrap: Option<String>,
    args: Vec<String>,
    wait_live: bool,
    wrapper: Vec<String>,
}

impl AgentBuilder {
    /// The bootstrap YAML (default: [`crate::bootstrap_yaml`] answering `hello`).
    pub fn bootstrap(mut self, yaml: String) -> Self {
        self.bootstrap = Some(yaml);
        self
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

    /// Runs the agent through a wrapper command (e.g. `unshare --net ...`), which must exec
    /// its arguments.
    pub fn wrapper(mut self, wrapper: &[&str]) -> Self {
        self.wrapper = wrapper.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Starts the agent; waits for the status server and Envoy's admin address (and LIVE,
    /// unless told not to).
    pub async fn start(mut self) -> AgentProcess {
        let dir = self.dir;
        let bootstrap = dir.write(
            "bootstrap.yaml",
            &self
                .bootstrap
                .unwrap_or_else(|| crate::bootstrap_yaml("hello")),
        );
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
        // Port 0 unless the test picks the address: tests run in parallel.
        if !self.args.iter().any(|a| a == "--status-address") {
            self.args
                .extend(["--status-address".to_owned(), "127.0.0.1:0".to_owned()]);
        }
        command
            .arg("run")
            .arg("-c")
            .arg(&bootstrap)
            .arg("--envoy-path")
            .arg(envoy_path())
            .arg("--status-address-file")
            .arg(&status_file)
            .args(&self.args)
            .args(["--", "--concurrency", "1", "--admin-address-path"])
            .arg(&admin_file)
            .env_remove("ENVOY_PATH")
            .env("ENVOY_AGENT_LOG_LEVEL", "debug")
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.binary.display()));
        let stderr = Arc::new(Mutex::new(String::new()));
        if let Some(pipe) = child.stderr.take() {
            let stderr = stderr.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(pipe).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    // Shown with the test's output when it fails.
                    eprintln!("{line}");
                    if let Ok(mut s) = stderr.lock() {
                        s.push_str(&line);
                        s.push('\n');
                    }
                }
            });
        }
        let status = crate::admin_address_from_file(&status_file).await;
        let admin = AdminClient::new(crate::admin_address_from_file(&admin_file).await);
        if self.wait_live {
            eventually("envoy to be LIVE", PATIENCE, || async {
                matches!(admin.server_info().await, Ok(i) if i.state == ServerState::Live)
                    .then_some(())
            })
            .await;
            // The agent has seen it too: its readiness says so.
            eventually("the agent to report ready", PATIENCE, || async {
                let r = crate::http_get(status, "/healthz/ready").await.ok()?;
                (r.status == 200).then_some(())
            })
            .await;
        }
        AgentProcess {
            child,
            admin,
            status,
            dir,
            stderr,
        }
    }
}

/// A running `envoy-agent run`.
#[derive(Debug)]
pub struct AgentProcess {
    child: Child,
    /// Envoy's admin API.
    pub admin: AdminClient,
    /// The agent's status server.
    pub status: SocketAddr,
    /// The test's temp dir (bootstrap, address files).
    pub dir: TestDir,
    stderr: Arc<Mutex<String>>,
}

impl AgentProcess {
    /// A builder for the agent binary at `binary` (`env!("CARGO_BIN_EXE_envoy-agent")`).
    pub fn builder(binary: impl AsRef<Path>) -> AgentBuilder {
        AgentBuilder {
            binary: binary.as_ref().to_owned(),
            dir: TestDir::new(),
            bootstrap: None,
            args: Vec::new(),
            wait_live: true,
            wrapper: Vec::new(),
        }
    }

    /// The agent's pid (the wrapper's, when one execs it, is the same).
    pub fn pid(&self) -> u32 {
        self.child
            .id()
            .unwrap_or_else(|| panic!("the agent has exited"))
    }

    /// Envoy's pid: the agent's one child.
    pub fn envoy_pid(&self) -> u32 {
        let children = children_of(self.pid());
        assert_eq!(
            children.len(),
            1,
            "the agent has one child, envoy: {children:?}"
        );
        children[0]
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

    /// Waits (bounded by [`PATIENCE`]) for the agent to exit.
    pub async fn exit(&mut self) -> ExitStatus {
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("the agent did not exit within {PATIENCE:?}"))
            .unwrap_or_else(|e| panic!("waiting for the agent: {e}"))
    }
}

//! The repository's own manifests as shipped, run end to end (issue 38, item 7): the
//! node-proxy DaemonSet's args and bootstrap, and the sidecar example's args, bootstrap and
//! preStop hook, with the real Envoy and real clients, each in a network namespace of its own
//! (their ports are fixed: 15000, 10000, 15006, 15020, as in a pod). Only what cannot be the
//! same outside a pod is changed: file paths (bootstrap, Envoy, state dir, marker, gRPC socket)
//! point into the test's directory. The drain each ships must tell its clients.

use std::path::PathBuf;
use std::process::Stdio;

use envoy_agent_tests::clients::{Event, H1Client, H2Client, Kind};
use envoy_agent_tests::{NetNs, PATIENCE, TestDir, envoy_path, eventually};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::manifests::{
    Kustomization, NODE_PROXY, SIDECAR_EXAMPLE, agent_containers, args_of, env_var, pod_spec, repo,
    strings,
};

/// The agent started with a manifest's args, its JSON log in a file.
struct Shipped {
    child: tokio::process::Child,
    log: PathBuf,
    grpc: String,
    _dir: TestDir,
    /// Held by a node proxy as shipped for as long as it runs: see [`SHIPPED_NODE`].
    _node: Option<std::sync::MutexGuard<'static, ()>>,
}

/// The DaemonSet's `--base-id` (7) is the node's, not a test's: every node proxy as shipped
/// names the same shared memory segment (`/dev/shm` is not in the test's network namespace)
/// and the same hot-restart channel link (`/tmp/envoy-agent-hr-<uid>/7`). Two at once would
/// share them (and the one that exits first removes its family's files, since issue 40), so
/// they run one at a time.
static SHIPPED_NODE: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Shipped {
    /// The agent container of `workload` in `kustomization`, with its paths in `dir`.
    fn start(kustomization: &str, workload: &str) -> Shipped {
        // Before anything of its own exists (a failed test poisons the lock: taken all the same).
        let node = (kustomization == NODE_PROXY)
            .then(|| SHIPPED_NODE.lock().unwrap_or_else(|e| e.into_inner()));
        let dir = TestDir::new();
        let k = Kustomization::load(kustomization);
        let annotations = k.object(workload)["spec"]["template"]["metadata"]["annotations"].clone();
        let pod = pod_spec(k.object(workload));
        let container = *agent_containers(pod)
            .iter()
            .find(|c| c["args"].as_sequence().is_some_and(|a| a[0] == "run"))
            .expect("the agent's run container");
        std::fs::create_dir_all(dir.join("pod")).unwrap();
        let bootstrap = dir.join("bootstrap.yaml");
        std::fs::copy(
            repo().join(kustomization).join("bootstrap.yaml"),
            &bootstrap,
        )
        .unwrap();
        let args: Vec<String> = args_of(container)
            .into_iter()
            .map(|arg| match arg.split_once('=') {
                Some(("--config-path", _)) => format!("--config-path={}", bootstrap.display()),
                Some(("--envoy-path", _)) => format!("--envoy-path={}", envoy_path().display()),
                Some(("--state-dir", _)) => format!("--state-dir={}", dir.join("state").display()),
                Some(("--ready-marker", _)) => {
                    format!("--ready-marker={}", dir.join("pod/ready").display())
                }
                _ => arg,
            })
            .collect();
        // The manifest's socket, moved into the test's directory.
        let shipped_grpc = env_var(container, "ENVOY_AGENT_GRPC_ADDRESS")
            .and_then(|e| e["value"].as_str())
            .expect("the manifest sets the gRPC address");
        assert!(shipped_grpc.starts_with("unix:/"), "{shipped_grpc}");
        let grpc = format!("unix:{}", dir.join("pod/grpc/grpc.sock").display());
        let log = dir.join("agent.log");
        let mut command = tokio::process::Command::new(crate::AGENT);
        command
            .args(&args)
            .env("ENVOY_AGENT_GRPC_ADDRESS", &grpc)
            .env_remove("RUST_LOG")
            .env("ENVOY_AGENT_LOG_FORMAT", "json");
        // The app's probes, as the manifest gives them.
        if let Some(probers) =
            env_var(container, "ENVOY_AGENT_APP_PROBERS").and_then(|e| e["value"].as_str())
        {
            command.env("ENVOY_AGENT_APP_PROBERS", probers);
        }
        // The pod's annotations the manifest reads through the downward API, as the kubelet
        // gives them (the app's metrics URL).
        for env in container["env"].as_sequence().into_iter().flatten() {
            let field = env["valueFrom"]["fieldRef"]["fieldPath"]
                .as_str()
                .unwrap_or_default();
            if let Some(key) = field
                .strip_prefix("metadata.annotations['")
                .and_then(|k| k.strip_suffix("']"))
            {
                let value = annotations[key].as_str().unwrap_or_else(|| {
                    panic!("{workload}: {field} names no annotation of the pod template")
                });
                command.env(env["name"].as_str().unwrap(), value);
            }
        }
        // What the downward API gives a pod, where the manifest asks for it.
        for (name, value) in [
            ("POD_NAME", "shipped-0"),
            ("ENVOY_AGENT_POD_GENERATION", "1"),
        ] {
            if env_var(container, name).is_some() {
                command.env(name, value);
            }
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Shipped {
            child,
            log,
            grpc,
            _dir: dir,
            _node: node,
        }
    }

    /// Waits until `addr` answers, or fails with the agent's log.
    async fn serving(&mut self, addr: std::net::SocketAddr) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            if envoy_agent_tests::http_get(addr, "/").await.is_ok() {
                return;
            }
            let exited = self.child.try_wait().unwrap();
            if exited.is_some() || tokio::time::Instant::now() > deadline {
                panic!(
                    "nothing serves on {addr} (agent: {exited:?}); its log:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    fn events(&self, event: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == event)
            .collect()
    }

    async fn event(&self, event: &str) -> serde_json::Value {
        eventually(&format!("the agent's {event} event"), PATIENCE, || async {
            self.events(event).into_iter().next()
        })
        .await
    }

    /// The Envoys the agent runs (not its pre-flight runs of the binary).
    fn envoys(&self) -> Vec<u32> {
        let envoy = std::fs::canonicalize(envoy_path()).unwrap();
        envoy_agent_tests::children_of(self.child.id().unwrap())
            .into_iter()
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe == envoy)
                    && std::fs::read(format!("/proc/{pid}/cmdline"))
                        .is_ok_and(|c| !c.windows(6).any(|w| w == b"--mode"))
            })
            .collect()
    }

    fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id().unwrap() as i32), signal).unwrap();
    }

    /// The agent's exit code, after a second SIGTERM (stop at once).
    async fn stop(mut self) -> Option<i32> {
        self.signal(Signal::SIGTERM);
        let status = tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the agent exits")
            .unwrap();
        // A node proxy as shipped leaves nothing of its family on the node (checked before
        // the next one may start).
        if self._node.is_some() && status.success() {
            let segment = envoy_agent_hotrestart::shm::path(7);
            assert!(!segment.exists(), "{} left behind", segment.display());
        }
        status.code()
    }
}

/// An HTTP/1.1 client that keeps asking and an idle HTTP/2 one, both served.
struct Clients {
    h1: H1Client,
    h2: H2Client,
}

impl Clients {
    async fn on(addr: std::net::SocketAddr) -> Clients {
        let ok = |e: &Event| matches!(e.kind, Kind::Response { status: 200, .. }).then_some(());
        let c = Clients {
            h1: H1Client::keeps_asking(addr),
            h2: H2Client::idle(addr),
        };
        c.h1.wait_for("an HTTP/1.1 answer", ok).await;
        c.h2.wait_for("the idle HTTP/2 answer", ok).await;
        c
    }

    /// Both told: `Connection: close`, a GOAWAY; no request failed.
    async fn told(&self) {
        self.h1
            .wait_for("Connection: close", |e| {
                matches!(&e.kind, Kind::Response { connection: Some(c), .. } if c == "close")
                    .then_some(())
            })
            .await;
        self.h2
            .wait_for("a GOAWAY to the idle HTTP/2 client", |e| {
                matches!(e.kind, Kind::Goaway { .. }).then_some(())
            })
            .await;
        assert!(self.h1.failures().is_empty(), "{}", self.h1.describe());
    }
}

#[tokio::test]
async fn the_daemonset_as_shipped_keeps_envoys_admin_from_a_neighbour() {
    let _netns = NetNs::enter();
    let mut agent = Shipped::start(NODE_PROXY, "DaemonSet");
    let serving = "127.0.0.1:10000".parse().unwrap();
    agent.serving(serving).await;
    a_neighbour_cannot_reach_envoys_admin(&mut agent, serving).await;
    agent.signal(Signal::SIGTERM);
    agent.event("drain_accepted").await;
    assert_eq!(agent.stop().await, Some(0));
}

#[tokio::test]
async fn the_sidecar_example_as_shipped_keeps_envoys_admin_from_the_pods_other_containers() {
    let _netns = NetNs::enter();
    app_on_8080().await;
    let mut agent = Shipped::start(SIDECAR_EXAMPLE, "Deployment");
    let inbound = "127.0.0.1:15006".parse().unwrap();
    agent.serving(inbound).await;
    a_neighbour_cannot_reach_envoys_admin(&mut agent, inbound).await;
    agent.signal(Signal::SIGTERM);
    agent.event("drain_accepted").await;
    assert_eq!(agent.stop().await, Some(0));
}

#[tokio::test]
async fn the_daemonset_as_shipped_tells_its_clients_on_sigterm() {
    let _netns = NetNs::enter();
    let mut agent = Shipped::start(NODE_PROXY, "DaemonSet");
    let serving = "127.0.0.1:10000".parse().unwrap();
    agent.serving(serving).await;
    let clients = Clients::on(serving).await;

    agent.signal(Signal::SIGTERM);
    // The shipped listener has no traffic_direction: a node proxy drains it all the same.
    let accepted = agent.event("drain_accepted").await;
    assert_eq!(accepted["drained"], "node_http", "{accepted}");
    assert_eq!(accepted["inbound_only"], false, "{accepted}");
    clients.told().await;
    assert!(agent.events("stopping").is_empty(), "told before the stop");
    assert_eq!(agent.stop().await, Some(0));
}

/// Envoy's admin API as shipped: on the agent's socket, where a neighbour (uid 65534, in the
/// same network namespace) can reach none of it. Every TCP port and Unix socket the agent's
/// Envoys listen on, but the configured listeners (`served`), is tried with `/quitquitquit`,
/// `/drain_listeners` and `/healthcheck/fail`; each is refused, and Envoy serves on, LIVE.
async fn a_neighbour_cannot_reach_envoys_admin(agent: &mut Shipped, served: std::net::SocketAddr) {
    use envoy_agent_tests::Listening;
    let admin = agent.event("envoy_admin").await;
    assert_eq!(admin["placement"], "socket", "{admin}");
    let socket = PathBuf::from(admin["path"].as_str().unwrap());
    let envoys = agent.envoys();
    assert!(!envoys.is_empty());
    let mut targets: Vec<Listening> = envoys
        .iter()
        .flat_map(|pid| envoy_agent_tests::listening_sockets(*pid))
        .filter(|l| !matches!(l, Listening::Tcp(a) if a.port() == served.port()))
        .map(|l| match l {
            // A wildcard is reached on loopback.
            Listening::Tcp(a) if a.ip().is_unspecified() => {
                Listening::Tcp(([127, 0, 0, 1], a.port()).into())
            }
            l => l,
        })
        .collect();
    assert_eq!(
        targets,
        [Listening::Unix(socket.clone())],
        "envoy listens on its admin socket and its listener, nothing else"
    );
    // Also where the link leads: the socket's own directory.
    targets.push(Listening::Unix(std::fs::canonicalize(&socket).unwrap()));

    let shared = tempfile::Builder::new()
        .prefix("neighbour")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(
        shared.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let script = shared.path().join("admin_neighbour.py");
    std::fs::copy(repo().join("tests/admin_neighbour.py"), &script).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let output = tokio::time::timeout(
        PATIENCE,
        tokio::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg("/usr/bin/python3")
            .arg(&script)
            .args(targets.iter().map(ToString::to_string))
            .output(),
    )
    .await
    .expect("the neighbour ends")
    .expect("setpriv and /usr/bin/python3 run (util-linux, Debian's python3)");
    assert!(output.status.success(), "{output:?}");
    let tried: Vec<serde_json::Value> = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(tried.last().unwrap()["uid"], 65534);
    let tries = &tried[..tried.len() - 1];
    assert_eq!(tries.len(), targets.len() * 3, "{tried:?}");
    for t in tries {
        let outcome = t["outcome"].as_str().unwrap();
        assert!(
            outcome.starts_with("error "),
            "the neighbour got through: {t}"
        );
    }

    // Envoy serves on: the same processes, LIVE (not draining, not failing health checks).
    let info = envoy_agent_proxy::AdminClient::new(socket)
        .server_info()
        .await
        .unwrap();
    assert_eq!(info.state, envoy_agent_proxy::ServerState::Live);
    assert_eq!(agent.envoys(), envoys);
    agent.serving(served).await;
}

/// The sidecar example's app: 200 `app` to every request, keep-alive.
async fn app_on_8080() {
    let listener = TcpListener::bind("127.0.0.1:8080").await.unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut seen = Vec::new();
                loop {
                    let Ok(n) = conn.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                        seen.drain(..end + 4);
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\napp\n";
                        if conn.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
}

/// The kubelet's probes of `workload`'s app container, as the manifest writes them (through
/// the agent's status port): each passes, the agent having probed the app.
async fn app_probes_pass(workload: &str) {
    let k = Kustomization::load(SIDECAR_EXAMPLE);
    let pod = pod_spec(k.object(workload));
    let app = crate::manifests::container(pod, "app");
    let mut probes = 0;
    for kind in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let get = &app[kind]["httpGet"];
        if get.is_null() {
            continue;
        }
        let port = get["port"].as_u64().unwrap();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).unwrap()));
        let path = get["path"].as_str().unwrap();
        let answer = envoy_agent_tests::http_get(addr, path).await.unwrap();
        assert_eq!(
            answer.status, 200,
            "{workload}: {kind} {path}: {}",
            answer.body
        );
        assert!(
            answer
                .body
                .starts_with("probe passed: GET http://127.0.0.1:8080/"),
            "{workload}: {kind}: {}",
            answer.body
        );
        probes += 1;
    }
    assert!(probes >= 2, "{workload}: the app's liveness and readiness");
}

/// The classic-sidecar example as shipped: the kubelet runs its postStart hook, the
/// manifest's own `envoy-agent wait`, as the agent's container starts, and starts the app only
/// once it returns: it returns 0 with Envoy serving. SIGTERM (no preStop) then drains, and the
/// agent exits 0.
#[tokio::test]
async fn the_classic_sidecar_example_as_shipped_holds_the_app_until_envoy_serves() {
    let _netns = NetNs::enter();
    app_on_8080().await;
    let workload = "Deployment/web-classic";
    let k = Kustomization::load(SIDECAR_EXAMPLE);
    let container = pod_spec(k.object(workload))["containers"][0].clone();
    let command = strings(&container["lifecycle"]["postStart"]["exec"]["command"]);
    assert!(command[0].ends_with("envoy-agent"), "{command:?}");
    let agent = Shipped::start(SIDECAR_EXAMPLE, workload);
    let out = tokio::time::timeout(
        PATIENCE,
        tokio::process::Command::new(crate::AGENT)
            .args(&command[1..])
            .env("ENVOY_AGENT_GRPC_ADDRESS", &agent.grpc)
            .output(),
    )
    .await
    .expect("the postStart hook returned")
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ready");
    // The app starts now, and Envoy already serves it.
    let inbound: std::net::SocketAddr = "127.0.0.1:15006".parse().unwrap();
    let answer = envoy_agent_tests::http_get(inbound, "/").await.unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    app_probes_pass(workload).await;
    agent.signal(Signal::SIGTERM);
    agent.event("drain_accepted").await;
    assert_eq!(agent.stop().await, Some(0));
}

#[tokio::test]
async fn the_sidecar_example_as_shipped_drains_on_its_prestop_and_stops_at_sigterm() {
    let _netns = NetNs::enter();
    app_on_8080().await;
    let mut agent = Shipped::start(SIDECAR_EXAMPLE, "Deployment");
    let inbound = "127.0.0.1:15006".parse().unwrap();
    agent.serving(inbound).await;
    app_probes_pass("Deployment/web").await;
    let clients = Clients::on(inbound).await;

    // The kubelet runs the preStop hook: the manifest's own command.
    let k = Kustomization::load(SIDECAR_EXAMPLE);
    let pod = pod_spec(k.object("Deployment"));
    let container = agent_containers(pod)
        .into_iter()
        .find(|c| !c["lifecycle"]["preStop"].is_null())
        .expect("the sidecar's preStop");
    let command = strings(&container["lifecycle"]["preStop"]["exec"]["command"]);
    assert!(command[0].ends_with("envoy-agent"), "{command:?}");
    let out = tokio::process::Command::new(crate::AGENT)
        .args(&command[1..])
        .env("ENVOY_AGENT_GRPC_ADDRESS", &agent.grpc)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "draining: inbound_http"
    );
    clients.told().await;
    // Then SIGTERM: the preStop drained, so the agent stops Envoy at once and exits 0.
    agent.signal(Signal::SIGTERM);
    let stopping = agent.event("stopping").await;
    assert_eq!(stopping["drained"], "inbound_http", "{stopping}");
    let status = tokio::time::timeout(PATIENCE, agent.child.wait())
        .await
        .expect("the agent exits")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

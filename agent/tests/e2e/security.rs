//! Only the agent may use its Envoy's hot-restart channel: another user's process in the
//! agent's network namespace (with hostNetwork, anything on the node) can neither take Envoy's
//! listening sockets, nor stop it, nor hold the node's epoch lock (the threat model:
//! `docs/security.md#security-who-can-reach-what`).
//! The neighbour is `tests/intruder.py`, run as uid 65534.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use envoy_agent_tests::{AgentProcess, HotRestartPorts, Load, PATIENCE, eventually, process_alive};
use nix::sys::signal::Signal;

use crate::agent;

/// Drain 1s, parent shutdown 2s.
const FAST: &[&str] = &["--drain-time", "1s", "--parent-shutdown-time", "2s"];

/// Runs the intruder as uid 65534 against the family of the agent in `dir` (see
/// [`node_proxy`]); what it managed, as JSON. `hold_lock`: how long it holds the epoch lock if
/// it gets it.
async fn intruder(dir: PathBuf, ports: HotRestartPorts, hold_lock: Duration) -> serde_json::Value {
    let output = tokio::time::timeout(
        PATIENCE,
        as_nobody(&dir.join("intruder.py"))
            .arg(ports.base_id.to_string())
            .arg(ports.listener_port.to_string())
            .arg(dir.join("state"))
            .arg(hold_lock.as_secs_f64().to_string())
            .output(),
    )
    .await
    .expect("the intruder ends")
    .expect("setpriv and /usr/bin/python3 run (util-linux, Debian's python3)");
    assert!(
        output.status.success(),
        "intruder: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "intruder output {e}: {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// The Python script at `script`, run as uid 65534 (`setpriv`; Debian's python3, which any
/// user can run).
fn as_nobody(script: &Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new("setpriv");
    command
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg("/usr/bin/python3")
        .arg(script);
    command
}

/// Copies the kit's script `name` where uid 65534 can read it (the repository may sit in a
/// private home).
fn share_script(dir: &Path, name: &str) -> PathBuf {
    let script = dir.join(name);
    std::fs::copy(
        envoy_agent_tests::repo_root().join("tests").join(name),
        &script,
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    script
}

/// A node proxy at its defaults, whose temp dir (private to root) is opened up as a node's
/// /var/run is: only the agent's own files and directories stand in the neighbour's way.
async fn node_proxy() -> AgentProcess {
    let builder = agent().hot_restart();
    open_up(builder.dir().path());
    share_script(builder.dir().path(), "intruder.py");
    builder.args(FAST).start().await
}

fn open_up(dir: &Path) {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn listener(agent: &AgentProcess) -> std::net::SocketAddr {
    ([127, 0, 0, 1], agent.ports.unwrap().listener_port).into()
}

#[tokio::test]
async fn a_neighbour_gets_no_listener_and_cannot_stop_envoy_or_hold_the_epoch_lock() {
    let mut agent = node_proxy().await;
    let envoy = agent.envoys()[0];
    let load = Load::start(listener(&agent), "/", 2, 2);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 20).then_some(())
    })
    .await;

    let (dir, ports) = (agent.dir.path().to_owned(), agent.ports.unwrap());
    let tried = intruder(dir.clone(), ports, Duration::ZERO).await;
    assert_eq!(tried["uid"], 65534, "{tried}");
    assert_eq!(tried["got_listener"], false, "no listening socket: {tried}");
    assert_eq!(
        tried["terminate_sent"], false,
        "no Terminate reached Envoy: {tried}"
    );
    assert!(
        tried["lock"].as_str().unwrap().starts_with("open:"),
        "the epoch lock cannot even be opened: {tried}"
    );
    // The short name stops the neighbour at its directory, which only the agent can enter.
    assert_eq!(
        tried["hijack"][format!("link:{}", u64::from(ports.base_id) * 10)],
        "bind child: EACCES",
        "{tried}"
    );
    // A Terminate that got through would stop Envoy within milliseconds: watch a while.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert!(process_alive(envoy), "envoy runs on");
        assert!(agent.running(), "the agent runs on");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A hot restart while the neighbour tries to hold the lock.
    let neighbour = tokio::spawn(intruder(dir, ports, Duration::from_secs(10)));
    agent.signal(Signal::SIGHUP);
    eventually("the hot restart", PATIENCE, || async {
        agent
            .events_with("handoff", "outcome", "live")
            .iter()
            .any(|e| e["first"] == false)
            .then_some(())
    })
    .await;
    let tried = neighbour.await.unwrap();
    assert_ne!(tried["lock"], "HELD", "{tried}");
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    assert!(report.ok > 100, "{report:?}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

#[tokio::test]
async fn the_state_dir_and_the_channel_are_private_and_an_abstract_channel_is_refused() {
    let mut node = node_proxy().await;
    let state = node.dir.join("state");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&state.join("hot-restart")), 0o700);
    assert_eq!(mode(&state.join("epoch.lock")), 0o600);
    let heartbeats: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("heartbeat-"))
        .collect();
    assert!(!heartbeats.is_empty());
    for h in heartbeats {
        assert_eq!(mode(&h.path()), 0o600, "{}", h.path().display());
    }
    let started = node
        .events("hot_restart_channel")
        .pop()
        .expect("the channel is logged at start");
    assert_eq!(started["private"], true, "{started}");
    // What a successor reads to find the family's channel: a short name that leads to the
    // state dir's private directory, in a directory of the agent's alone.
    let info = node.admin.server_info().await.unwrap();
    let envoy_agent_proxy::SocketPath::File(prefix) = &info.socket_path else {
        panic!("a file channel: {:?}", info.socket_path);
    };
    let link = prefix.parent().unwrap();
    assert!(
        std::fs::symlink_metadata(link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(
        std::fs::canonicalize(link).unwrap(),
        std::fs::canonicalize(state.join("hot-restart")).unwrap()
    );
    assert_eq!(mode(link.parent().unwrap()), 0o700);
    node.signal(Signal::SIGTERM);
    assert_eq!(node.exit().await.code(), Some(0));

    // Abstract names only on request.
    let mut refused = agent()
        .hot_restart()
        .envoy_args(&["--socket-path", "@envoy_domain_socket"])
        .no_wait()
        .start()
        .await;
    assert_eq!(refused.exit().await.code(), Some(64));
    assert!(
        refused
            .stderr()
            .contains("--allow-abstract-hot-restart-socket"),
        "{}",
        refused.stderr()
    );
    // A state dir others can write is refused too.
    let builder = agent().hot_restart();
    let state = builder.dir().join("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut loose = builder.no_wait().start().await;
    assert_eq!(loose.exit().await.code(), Some(64));
    assert!(
        loose.stderr().contains("state directory"),
        "{}",
        loose.stderr()
    );
}

/// An upgrade from a family on Envoy's abstract names (a pod of an earlier release): the
/// successor at its defaults takes over on the predecessor's names (a child must use its
/// parent's), says so, and no request fails.
#[tokio::test]
async fn a_successor_takes_over_a_family_on_abstract_names_losing_no_request() {
    let node = crate::cross_pod::Node::new();
    let mut a = node
        .pod("pod-a")
        .args(&["--allow-abstract-hot-restart-socket"])
        .envoy_args(&["--socket-path", "@envoy_domain_socket"])
        .start()
        .await;
    let load = Load::start(node.listener(), "/", 2, 2);
    eventually("the load to be served", PATIENCE, || async {
        (load.ok() > 20).then_some(())
    })
    .await;
    let mut b = node.pod("pod-b").start().await;
    envoy_agent_tests::live_at(&node.admin(), 1).await;
    let info = node.admin().server_info().await.unwrap();
    assert_eq!(
        info.socket_path,
        envoy_agent_proxy::SocketPath::envoy_default(),
        "the child uses its parent's names"
    );
    let inherited = b
        .events_with("hot_restart_channel", "private", "false")
        .pop()
        .expect("the successor says it took over abstract names");
    assert_eq!(
        inherited["socket_path"], "@envoy_domain_socket",
        "{inherited}"
    );
    let heartbeat = crate::cross_pod::heartbeat(&node.state_dir(), "pod-b").unwrap();
    assert_eq!(heartbeat.socket_path, "@envoy_domain_socket");
    a.signal_agent(Signal::SIGTERM);
    assert_eq!(a.exit().await.code(), Some(0));
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    b.signal_agent(Signal::SIGTERM);
    assert_eq!(b.exit().await.code(), Some(0));
}

/// A soft limit of 1024 open files (a common container default) is raised to the hard one at
/// start, for the agent and the Envoy it starts: a neighbour's idle connections then need far
/// more to exhaust it.
#[tokio::test]
async fn the_open_file_limit_is_raised_to_the_hard_limit() {
    // (soft, hard) open-file limits of `pid`.
    let limits = |pid: &str| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap()
            .to_owned();
        let words: Vec<&str> = line.split_whitespace().collect();
        (words[3].to_owned(), words[4].to_owned())
    };
    let (_, hard) = limits("self");
    assert!(
        hard.parse::<u64>().is_ok_and(|h| h > 1024),
        "the test needs a hard limit above 1024, has {hard}"
    );
    let nofile = format!("--nofile=1024:{hard}");
    let mut agent = agent()
        .wrapper(&["prlimit", nofile.as_str(), "--"])
        .start()
        .await;
    assert_eq!(limits(&agent.agent_pid().to_string()).0, hard);
    assert_eq!(
        limits(&agent.envoy_pid().to_string()).0,
        hard,
        "envoy inherits it"
    );
    let event = agent.events("fd_limit").pop().expect("the limit is logged");
    assert_eq!(event["was"], 1024, "{event}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// A neighbour holding 1100 connections to the status server (idle, or half a request's
/// headers) with the agent's open files at 1024: the agent holds at most a few hundred of
/// them, closes the oldest for room and slow headers after their timeout; readiness keeps
/// answering (ready), a hot restart works, nothing fails, the agent exits only when told.
#[tokio::test]
async fn a_connection_flood_to_the_status_server_is_held_off_and_the_node_proxy_serves_on() {
    let builder = agent().hot_restart();
    open_up(builder.dir().path());
    let script = share_script(builder.dir().path(), "flood.py");
    let mut agent = builder
        .wrapper(&["prlimit", "--nofile=1024:1024", "--"])
        .args(FAST)
        .start()
        .await;
    let load = Load::start(listener(&agent), "/", 2, 2);
    let status = agent.status();
    let flood = as_nobody(&script)
        .arg(status.ip().to_string())
        .arg(status.port().to_string())
        .args(["1100", "12"])
        .output();
    let flood = tokio::spawn(flood);
    // While it holds them: the probe is answered, and ready.
    let until = Instant::now() + Duration::from_secs(8);
    let mut answered = 0;
    while Instant::now() < until {
        let ready = tokio::time::timeout(
            Duration::from_secs(2),
            envoy_agent_tests::http_get(status, "/healthz/ready"),
        )
        .await;
        if let Ok(Ok(r)) = ready {
            assert_eq!(r.status, 200, "{}", r.body);
            answered += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        answered >= 20,
        "readiness answered {answered} times in 8 s of flood"
    );
    agent.signal(Signal::SIGHUP);
    eventually("the hot restart", PATIENCE, || async {
        agent
            .events_with("handoff", "outcome", "live")
            .iter()
            .any(|e| e["first"] == false)
            .then_some(())
    })
    .await;
    let flooded = flood.await.unwrap().unwrap();
    let result: serde_json::Value = serde_json::from_slice(&flooded.stdout)
        .unwrap_or_else(|e| panic!("flood: {e}: {}", String::from_utf8_lossy(&flooded.stderr)));
    assert!(result["opened"].as_u64().unwrap() > 1000, "{result}");
    assert!(
        result["closed_by_server"].as_u64().unwrap() > 800,
        "the agent let go of them: {result}"
    );
    assert!(agent.running());
    assert!(
        !agent.stderr().contains("Too many open files"),
        "the agent never ran out of descriptors"
    );
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// The same flood against TCP gRPC: the agent holds at most its bound of connections (the
/// oldest closed for room), never runs out of descriptors, and keeps answering.
#[tokio::test]
async fn a_connection_flood_to_tcp_grpc_is_held_off_and_the_node_proxy_serves_on() {
    let port = envoy_agent_tests::free_port();
    let builder = agent().hot_restart();
    open_up(builder.dir().path());
    let script = share_script(builder.dir().path(), "flood.py");
    let mut agent = builder
        .wrapper(&["prlimit", "--nofile=1024:1024", "--"])
        .args(FAST)
        .args(&["--grpc-address", &format!("127.0.0.1:{port}")])
        .start()
        .await;
    let load = Load::start(listener(&agent), "/", 2, 2);
    let flood = as_nobody(&script)
        .arg("127.0.0.1")
        .arg(port.to_string())
        .args(["1100", "12"])
        .output();
    let flood = tokio::spawn(flood);
    // While it holds them: GetStatus is answered.
    let until = Instant::now() + Duration::from_secs(8);
    let mut answered = 0;
    while Instant::now() < until {
        let (code, out, _) = crate::grpc::cli(&agent, &["status", "--json"]).await;
        if code == 0 && out.contains("\"newest_live_epoch\"") {
            answered += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        answered >= 10,
        "GetStatus answered {answered} times in 8 s of flood"
    );
    agent.signal(Signal::SIGHUP);
    eventually("the hot restart", PATIENCE, || async {
        (crate::hot_restart::restarts(&agent, "live") == 1).then_some(())
    })
    .await;
    let flooded = flood.await.unwrap().unwrap();
    let result: serde_json::Value = serde_json::from_slice(&flooded.stdout)
        .unwrap_or_else(|e| panic!("flood: {e}: {}", String::from_utf8_lossy(&flooded.stderr)));
    assert!(result["opened"].as_u64().unwrap() > 1000, "{result}");
    assert!(
        result["closed_by_server"].as_u64().unwrap() > 800,
        "the agent let go of them: {result}"
    );
    assert!(agent.running());
    assert!(
        !agent.stderr().contains("Too many open files"),
        "the agent never ran out of descriptors"
    );
    let report = load.stop().await;
    assert_eq!(report.failed, 0, "failed requests: {:?}", report.errors);
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// TCP gRPC on loopback is every process of the node (with hostNetwork, every pod's too):
/// another user's `update-config` (which could serve any file Envoy can read) is refused, its
/// `status` answered; the agent's own user (root here) may change the config.
#[tokio::test]
async fn over_loopback_tcp_only_the_agents_own_user_may_change_anything() {
    let port = envoy_agent_tests::free_port();
    let builder = agent().hot_restart();
    open_up(builder.dir().path());
    let dir = builder.dir().path().to_owned();
    let grpc = format!("127.0.0.1:{port}");
    let mut agent = builder
        .args(FAST)
        .args(&["--grpc-address", &grpc])
        .start()
        .await;
    // The binary and a valid bootstrap where uid 65534 can read them.
    let binary = dir.join("envoy-agent");
    std::fs::copy(crate::AGENT, &binary).unwrap();
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
    let candidate = dir.join("candidate.yaml");
    std::fs::copy(dir.join("bootstrap.yaml"), &candidate).unwrap();
    std::fs::set_permissions(&candidate, std::fs::Permissions::from_mode(0o644)).unwrap();
    let candidate = candidate.to_str().unwrap().to_owned();
    let as_nobody = |args: &[&str]| client_as_nobody(&binary, &grpc, args);

    let denied = as_nobody(&["update-config", &candidate]).await;
    let err = String::from_utf8_lossy(&denied.stderr);
    assert_eq!(denied.status.code(), Some(1), "{err}");
    assert!(
        err.contains("PermissionDenied") && err.contains("uid 65534"),
        "{err}"
    );
    let refused = agent.wait_event("grpc_refused", "uid", "65534").await;
    assert_eq!(refused["uid"], 65534, "{refused}");
    assert_eq!(
        crate::hot_restart::restarts(&agent, "live"),
        0,
        "nothing restarted"
    );

    let status = as_nobody(&["status"]).await;
    assert!(
        status.status.success(),
        "reading is open: {}",
        String::from_utf8_lossy(&status.stderr)
    );

    // The status server's changes alike: a node proxy's loopback is the node's.
    for path in ["/drain", "/quitquitquit"] {
        assert_eq!(post_as_nobody(agent.status(), path).await, 403, "{path}");
    }
    agent.wait_event("status_refused", "uid", "65534").await;
    assert!(agent.running(), "refused: nothing happened");

    let (code, out, err) = crate::grpc::cli(&agent, &["update-config", &candidate]).await;
    assert_eq!(code, 0, "the agent's own user may: {out}{err}");
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// A sidecar's loopback is its pod's: an app container of another user ending a Job with
/// `POST /quitquitquit` is what that endpoint is for (Istio's pattern), and it still works.
#[tokio::test]
async fn a_sidecars_quitquitquit_is_open_to_its_pods_other_users() {
    let builder = agent();
    open_up(builder.dir().path());
    let mut agent = builder.start().await;
    assert_eq!(post_as_nobody(agent.status(), "/quitquitquit").await, 200);
    assert_eq!(agent.exit().await.code(), Some(0));
    agent.wait_event("exit", "exit_path", "quitquitquit").await;
}

/// The agent's client subcommand `args`, run as uid 65534 from `binary` (a copy of the agent it
/// can run) against the agent's gRPC address `grpc`; its output.
pub(crate) fn client_as_nobody(
    binary: &Path,
    grpc: &str,
    args: &[&str],
) -> impl std::future::Future<Output = std::process::Output> + use<> {
    let mut command = tokio::process::Command::new("setpriv");
    command
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(binary)
        .args(["--grpc-address", grpc])
        .args(args)
        .stdin(std::process::Stdio::null());
    async move {
        tokio::time::timeout(PATIENCE, command.output())
            .await
            .expect("the client ends")
            .expect("setpriv runs (util-linux)")
    }
}

/// `POST http://addr/path` from uid 65534 (Debian's python3); the HTTP status.
async fn post_as_nobody(addr: std::net::SocketAddr, path: &str) -> u16 {
    let script = format!(
        "import urllib.request, urllib.error\n\
         try:\n    r = urllib.request.urlopen(urllib.request.Request('http://{addr}{path}', method='POST'), timeout=20)\n    print(r.status)\n\
         except urllib.error.HTTPError as e:\n    print(e.code)\n"
    );
    let output = tokio::time::timeout(
        PATIENCE,
        tokio::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .args(["/usr/bin/python3", "-c", &script])
            .output(),
    )
    .await
    .expect("the request ends")
    .expect("setpriv and /usr/bin/python3 run");
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no status: {}", String::from_utf8_lossy(&output.stderr)))
}

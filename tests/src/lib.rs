//! Test kit shared by the in-process tests (in this crate's `tests/`) and the end-to-end
//! tests of the real binary (in `agent/tests/`).
//!
//! - [`envoy_path`] finds the real Envoy (`ENVOY_PATH`, or `scripts/install-envoy.sh`'s
//!   install) and fails the test with install instructions when there is none: a missing
//!   Envoy is never a silent skip. [`upgrade_from_envoy_path`] finds the older release the
//!   upgrade tests start from the same way (`ENVOY_UPGRADE_FROM_PATH`).
//! - [`TestDir`] owns a temp dir and writes bootstraps whose admin and listener ports are 0,
//!   so every test gets its own ports and tests run in parallel.
//! - [`eventually`] bounds every wait; [`http_get`] is a plain HTTP/1.1 client.
//! - [`clients`]: real clients of every protocol (HTTP/1.1, HTTP/2, HTTP/3, gRPC, nghttp)
//!   reporting what they were told and when, streaming upstreams, and a multi-listener
//!   bootstrap for drain tests.
//! - [`silent_server`] fakes what a real Envoy will not do on purpose: accept a connection and
//!   never answer.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod agent_process;
pub mod cgroup;
pub mod clients;
pub mod control_plane;
pub mod json;
mod load;

pub use agent_process::{AgentBuilder, AgentProcess, HotRestartPorts};
pub use control_plane::{ControlPlane, Snapshot, Upstream, ads_bootstrap};
pub use load::{BUCKET, Bucket, Load, LoadReport, unix_ms};

/// How long a test waits for something that should happen in well under a second. Generous:
/// machines are shared and slow; a test that needs it is broken, not flaky.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// The real Envoy binary. Panics, saying how to install it, when there is none.
pub fn envoy_path() -> PathBuf {
    if let Some(path) = std::env::var_os("ENVOY_PATH") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "ENVOY_PATH={} is not a file. Install Envoy with `scripts/install-envoy.sh` \
             (it prints the path) or unset ENVOY_PATH.",
            path.display()
        );
        return path;
    }
    let installed = repo_root().join(".envoy/1.40.0/envoy/_bin/envoy");
    assert!(
        installed.is_file(),
        "No Envoy found: these tests run the real Envoy. Install it with \
         `scripts/install-envoy.sh` (puts Envoy 1.40 under .envoy/) or set ENVOY_PATH to an \
         Envoy 1.40 binary. Looked for {}.",
        installed.display()
    );
    installed
}

/// The older Envoy release the upgrade tests start from: the newest release before the one
/// [`envoy_path`] installs. `scripts/test.sh` installs the same one.
pub const UPGRADE_FROM_VERSION: &str = "1.39.3";

/// The older Envoy an upgrade starts from: `ENVOY_UPGRADE_FROM_PATH`, or
/// `scripts/install-envoy.sh`'s install of [`UPGRADE_FROM_VERSION`]. Panics, saying how to
/// install it, when there is none: like a missing Envoy, never a silent skip.
pub fn upgrade_from_envoy_path() -> PathBuf {
    if let Some(path) = std::env::var_os("ENVOY_UPGRADE_FROM_PATH") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "ENVOY_UPGRADE_FROM_PATH={} is not a file. Install the older Envoy with \
             `ENVOY_VERSION={UPGRADE_FROM_VERSION} scripts/install-envoy.sh` (it prints the \
             path) or unset ENVOY_UPGRADE_FROM_PATH.",
            path.display()
        );
        return path;
    }
    let installed = repo_root().join(format!(".envoy/{UPGRADE_FROM_VERSION}/envoy/_bin/envoy"));
    assert!(
        installed.is_file(),
        "No older Envoy to upgrade from: the upgrade tests hot-restart from Envoy \
         {UPGRADE_FROM_VERSION} to the current one. Install it with \
         `ENVOY_VERSION={UPGRADE_FROM_VERSION} scripts/install-envoy.sh` (`scripts/test.sh` \
         does this for you) or set ENVOY_UPGRADE_FROM_PATH to an older Envoy binary. Looked \
         for {}.",
        installed.display()
    );
    installed
}

/// The release of an Envoy build version string (`/server_info`'s `version`, or what
/// `envoy --version` prints): `9e5580.../1.40.0/Clean/RELEASE/BoringSSL` is `1.40.0`.
pub fn envoy_release(version: &str) -> Option<&str> {
    version
        .split_whitespace()
        .last()
        .and_then(|v| v.split('/').nth(1))
        .filter(|r| !r.is_empty())
}

/// The release of the Envoy `binary` (`envoy --version`). Panics when it does not say.
pub fn release_of(binary: &Path) -> String {
    let output = std::process::Command::new(binary)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} --version: {e}", binary.display()));
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    text.lines()
        .find_map(|l| {
            l.split_once("version: ")
                .and_then(|(_, v)| envoy_release(v))
        })
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("{} --version names no release: {text}", binary.display()))
}

/// A program of the test tools (`python`, `grpcurl`, `nghttp`): `ENVOY_AGENT_TEST_TOOLS`, or
/// `scripts/install-test-tools.sh`'s install. Panics, saying how to install them, when missing.
pub fn test_tool(name: &str) -> PathBuf {
    let dir = std::env::var_os("ENVOY_AGENT_TEST_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".test-tools"));
    let tool = dir.join("venv/bin").join(name);
    assert!(
        tool.is_file(),
        "{} is missing: these tests use second-language clients (Python's grpcio, h2 and \
         aioquic, grpcurl, Debian's nghttp, prometheus and promtool). Install them with `scripts/install-test-tools.sh` (a virtualenv under .test-tools/), or set \
         ENVOY_AGENT_TEST_TOOLS to its directory. `scripts/test.sh` does this for you.",
        tool.display()
    );
    tool
}

/// The workspace root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A temp dir owned by one test, removed when dropped.
#[derive(Debug)]
pub struct TestDir {
    dir: tempfile::TempDir,
}

impl TestDir {
    /// A fresh temp dir.
    pub fn new() -> Self {
        TestDir {
            dir: tempfile::Builder::new()
                .prefix("envoy-agent-test.")
                .tempdir()
                .unwrap_or_else(|e| panic!("cannot create a temp dir: {e}")),
        }
    }

    /// The dir.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `name` inside the dir.
    pub fn join(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `contents` to `name` and returns the path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.join(name);
        std::fs::write(&path, contents)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        path
    }

    /// Writes a bootstrap (admin and one listener, both on port 0) that answers every request
    /// with `body`, and returns its path.
    pub fn bootstrap(&self, name: &str, body: &str) -> PathBuf {
        self.write(name, &bootstrap_yaml(body))
    }
}

impl Default for TestDir {
    fn default() -> Self {
        Self::new()
    }
}

/// A bootstrap with the admin API and one inbound HTTP listener (named `hello`, as a
/// sidecar's inbound listener), both on 127.0.0.1 port 0, answering every request with 200
/// and `body`.
pub fn bootstrap_yaml(body: &str) -> String {
    bootstrap_yaml_on(0, 0, body)
}

/// [`bootstrap_yaml`] with the admin API and the listener on the given ports (hot restart
/// needs fixed ports: a port-0 listener is not handed over, the child binds a new port).
pub fn bootstrap_yaml_on(admin_port: u16, listener_port: u16, body: &str) -> String {
    format!(
        r#"admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
static_resources:
  listeners:
  - name: hello
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {listener_port} }}
    traffic_direction: INBOUND
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: hello
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                direct_response: {{ status: 200, body: {{ inline_string: "{body}" }} }}
          http_filters:
          # A request with `x-envoy-fault-delay-request: <ms>` is answered that much later:
          # a slow in-flight request for drain tests (see `slow_request`).
          - name: envoy.filters.http.fault
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault
              delay:
                header_delay: {{}}
                percentage: {{ numerator: 100, denominator: HUNDRED }}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    )
}

/// [`bootstrap_yaml_on`] plus clusters from the xDS server at `xds`, with no initial-fetch
/// timeout: pointed at a server that never answers, Envoy stays initializing.
pub fn bootstrap_waiting_for_xds(
    admin_port: u16,
    listener_port: u16,
    body: &str,
    xds: SocketAddr,
) -> String {
    let mut yaml = bootstrap_yaml_on(admin_port, listener_port, body);
    yaml.push_str(&xds_cluster(xds));
    yaml.push_str(
        r#"node: { id: test, cluster: test }
dynamic_resources:
  cds_config:
    resource_api_version: V3
    initial_fetch_timeout: 3600s
    api_config_source:
      api_type: GRPC
      transport_api_version: V3
      grpc_services: [{ envoy_grpc: { cluster_name: xds } }]
"#,
    );
    yaml
}

/// The static cluster `xds` (HTTP/2 to `xds`), as the last part of `static_resources`.
fn xds_cluster(xds: SocketAddr) -> String {
    format!(
        r#"  clusters:
  - name: xds
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: xds
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: {ip}, port_value: {port} }} }} }}
"#,
        ip = xds.ip(),
        port = xds.port()
    )
}

/// A static bootstrap whose listener (`hello` on `listener_port`, as [`bootstrap_yaml_on`]'s)
/// takes its routes by RDS from the server at `xds`, with no initial-fetch timeout: pointed at
/// a server that never answers, Envoy stays INITIALIZING (the listener warms forever). It has
/// no `dynamic_resources`: a start stuck for another reason than a control plane's LDS or CDS.
pub fn bootstrap_waiting_for_rds(admin_port: u16, listener_port: u16, xds: SocketAddr) -> String {
    format!(
        r#"admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
node: {{ id: test, cluster: test }}
static_resources:
  listeners:
  - name: hello
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {listener_port} }}
    traffic_direction: INBOUND
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: hello
          rds:
            route_config_name: hello
            config_source:
              resource_api_version: V3
              initial_fetch_timeout: 3600s
              api_config_source:
                api_type: GRPC
                transport_api_version: V3
                grpc_services: [{{ envoy_grpc: {{ cluster_name: xds }} }}]
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
{}"#,
        xds_cluster(xds)
    )
}

/// The wrapper that runs a command as PID 1 of a PID namespace of its own, with its own
/// `/proc`, as every pod's first process is (`unshare --pid --fork --mount-proc`); `--kill-child`:
/// if the test dies, so does the namespace. Needs root.
pub const POD: &[&str] = &[
    "unshare",
    "--pid",
    "--fork",
    "--mount-proc",
    "--kill-child",
    "--",
];

/// A port for a fixed address (hot-restart tests need them: every epoch binds the same
/// ports), free when picked. It lies outside the kernel's ephemeral range, so that no port-0
/// bind or outgoing connection of another test, or of this test's next agent (its status
/// server binds port 0), is handed it once its Envoy is gone: a second agent found its own
/// status server on the admin port of a killed predecessor and waited to take over from it.
/// Tests of one process get different ports (a counter from a per-process start); the race
/// with an unrelated process taking the port is accepted.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let Some((start, len)) = fixed_port_range() else {
        return ephemeral_port();
    };
    let first = std::process::id().wrapping_mul(7919);
    for _ in 0..len {
        let offset = first.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % len;
        let Ok(port) = u16::try_from(start + offset) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {start}..{}", start + len)
}

/// 10,000 ports just below the ephemeral range (or just above it), `None` when neither fits.
fn fixed_port_range() -> Option<(u32, u32)> {
    const LEN: u32 = 10_000;
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok();
    let mut bounds = range
        .as_deref()
        .unwrap_or("32768 60999")
        .split_whitespace()
        .filter_map(|n| n.parse::<u32>().ok());
    let (low, high) = (bounds.next()?, bounds.next()?);
    if low >= 1024 + LEN {
        Some((low - LEN, LEN))
    } else if high + LEN <= 65_535 {
        Some((high + 1, LEN))
    } else {
        None
    }
}

/// A port that was free a moment ago, from the ephemeral range (bind port 0, release it).
fn ephemeral_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("cannot find a free port: {e}"))
}

/// A base id no other test uses: derived from the test process's pid and a counter, so test
/// binaries running at once do not share Envoy's shared memory or sockets.
pub fn unique_base_id() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Pairs: the agent's cold handover starts its second family under `--base-id` + 1.
    (std::process::id() % 20_000) * 200 + NEXT.fetch_add(2, Ordering::Relaxed) % 200 + 2
}

/// Polls `check` every 20 ms until it returns `Some`, for at most `within`; panics naming
/// `what` when time runs out.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the admin API at `admin` reports LIVE at `epoch`.
pub async fn live_at(admin: &envoy_agent_proxy::AdminClient, epoch: u32) {
    eventually(&format!("epoch {epoch} LIVE"), PATIENCE, || async {
        let info = admin.server_info().await.ok()?;
        (info.state == envoy_agent_proxy::ServerState::Live && info.restart_epoch == epoch)
            .then_some(())
    })
    .await;
}

/// The non-loopback address the agent has inside [`PRIVATE_NETNS`].
pub const PRIVATE_NETNS_ADDR: &str = "10.99.0.1";

/// A wrapper (for [`AgentBuilder::wrapper`]) that runs the agent in a network namespace of its
/// own, with loopback and a veth interface holding [`PRIVATE_NETNS_ADDR`]: a real non-loopback
/// peer on no network but the test's own. Clients join it with `setns` (needs root).
pub const PRIVATE_NETNS: &[&str] = &[
    "unshare",
    "--net",
    "--",
    "sh",
    "-c",
    "ip link set lo up && ip link add v0 type veth peer name v1 && \
     ip addr add 10.99.0.1/24 dev v0 && ip link set v0 up && ip link set v1 up && exec \"$@\"",
    "sh",
];

/// A network namespace of the test's own (`ip netns add`, loopback up), which the calling
/// thread joins: every socket the test opens from then on, and every process it starts, is in
/// it. For tests that need fixed, well-known ports (defaults such as 127.0.0.1:15020) without
/// colliding with tests running beside them. `#[tokio::test]` runs a test on one thread, so
/// the whole test is inside. Removed when dropped (needs root).
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates the namespace and moves the calling thread into it.
    pub fn enter() -> NetNs {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "envoy-agent-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let run = |args: &[&str]| {
            let status = std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap_or_else(|e| panic!("ip {args:?}: {e} (iproute2 is needed, and root)"));
            assert!(status.success(), "ip {args:?} failed");
        };
        run(&["netns", "add", &name]);
        let ns = NetNs { name };
        run(&["netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"]);
        let file = std::fs::File::open(format!("/var/run/netns/{}", ns.name))
            .unwrap_or_else(|e| panic!("opening netns {}: {e}", ns.name));
        nix::sched::setns(
            std::os::fd::AsFd::as_fd(&file),
            nix::sched::CloneFlags::CLONE_NEWNET,
        )
        .unwrap_or_else(|e| panic!("joining netns {}: {e}", ns.name));
        ns
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Reads the address Envoy wrote to its `--admin-address-path` file, waiting for it.
pub async fn admin_address_from_file(path: &Path) -> SocketAddr {
    eventually("envoy to write its admin address", PATIENCE, || async {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    })
    .await
}

/// A minimal HTTP response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: String,
}

/// Waits (within [`PATIENCE`]) until a fresh connection to `addr` gets `body` for `GET /`:
/// after a hot restart's LIVE. Envoy says LIVE a moment before the new epoch asks its parent to
/// stop accepting (the parent takes that on its own main thread), so a connection made in those
/// milliseconds may still be the parent's, on the old config; every later one is the new one's.
pub async fn serves(addr: SocketAddr, body: &str) {
    eventually(&format!("{addr} serves {body:?}"), PATIENCE, || async {
        (http_get(addr, "/").await.ok()?.body == body).then_some(())
    })
    .await;
}

/// `GET path` on a fresh connection with `Connection: close`, bounded by [`PATIENCE`].
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<Response> {
    http_request(addr, "GET", path).await
}

/// `method path` on a fresh connection with `Connection: close`, bounded by [`PATIENCE`].
pub async fn http_request(addr: SocketAddr, method: &str, path: &str) -> std::io::Result<Response> {
    http_request_with(addr, method, path, &[]).await
}

/// A request that Envoy (the test bootstrap's fault filter) answers only after `delay`: an
/// in-flight request that a graceful drain must let complete. Starts at once; resolves with
/// the response.
pub fn slow_request(
    addr: SocketAddr,
    delay: Duration,
) -> tokio::task::JoinHandle<std::io::Result<Response>> {
    let ms = delay.as_millis().to_string();
    tokio::spawn(async move {
        http_request_with(
            addr,
            "GET",
            "/slow",
            &[("x-envoy-fault-delay-request", ms.as_str())],
        )
        .await
    })
}

/// `method path` with extra `headers`, on a fresh connection with `Connection: close`,
/// bounded by [`PATIENCE`].
pub async fn http_request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> std::io::Result<Response> {
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let exchange = async { exchange(TcpStream::connect(addr).await?, &request).await };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .map_err(|_| std::io::Error::other(format!("{method} {addr}{path}: no answer")))?
}

/// Sends `request` on `stream` and reads the response to its end (`Connection: close`).
async fn exchange<S>(mut stream: S, request: &str) -> std::io::Result<Response>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    parse_response(&raw)
}

/// `method path` to Envoy's admin API at `addr` (TCP, or a Unix socket), on a fresh
/// connection with `Connection: close`, bounded by [`PATIENCE`].
pub async fn admin_request(
    addr: &envoy_agent_proxy::admin::Address,
    method: &str,
    path: &str,
) -> std::io::Result<Response> {
    use envoy_agent_proxy::admin::Address;
    let unix = match addr {
        Address::Tcp(tcp) => return http_request(*tcp, method, path).await,
        Address::Unix(unix) => unix,
    };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let exchange = async { exchange(tokio::net::UnixStream::connect(unix).await?, &request).await };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .map_err(|_| std::io::Error::other(format!("{method} {addr}{path}: no answer")))?
}

/// The admin socket an agent's JSON log names (its `envoy_admin` event's `path`), if logged yet.
pub fn admin_socket_in_log(log: &str) -> Option<envoy_agent_proxy::admin::Address> {
    log.lines()
        .filter(|line| line.starts_with('{'))
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|v| v.get("event").and_then(|e| e.as_str()) == Some("envoy_admin"))
        .find_map(|v| v.get("path")?.as_str().map(PathBuf::from))
        .map(envoy_agent_proxy::admin::Address::Unix)
}

/// Where a node proxy's agent (`--hot-restart`, `--envoy-admin` left at `auto`) puts Envoy's
/// admin socket for `base_id`, with the test process's temp dir and user.
pub fn node_admin_socket(base_id: u32) -> envoy_agent_proxy::admin::Address {
    node_admin_socket_in(&std::env::temp_dir(), base_id)
}

/// [`node_admin_socket`] for an agent whose temp dir is `temp_dir`.
pub fn node_admin_socket_in(temp_dir: &Path, base_id: u32) -> envoy_agent_proxy::admin::Address {
    let uid = nix::unistd::geteuid().as_raw();
    envoy_agent_proxy::admin::Address::Unix(
        temp_dir
            .join(format!("envoy-agent-hr-{uid}"))
            .join(base_id.to_string())
            .join(format!("envoy_admin_{base_id}")),
    )
}

/// The node proxy's admin socket where it really is: in `<state dir>/hot-restart`, whatever
/// link the agents reach it through (for a test that does not share the agents' temp dir).
pub fn node_admin_socket_at(state_dir: &Path, base_id: u32) -> envoy_agent_proxy::admin::Address {
    envoy_agent_proxy::admin::Address::Unix(
        state_dir
            .join("hot-restart")
            .join(format!("envoy_admin_{base_id}")),
    )
}

fn parse_response(raw: &[u8]) -> std::io::Result<Response> {
    let text = String::from_utf8_lossy(raw);
    let bad = || std::io::Error::other(format!("not an HTTP response: {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(bad)?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let body = if chunked {
        dechunk(body).ok_or_else(|| {
            std::io::Error::other(format!("a chunked body that does not parse: {body:.200?}"))
        })?
    } else {
        body.to_owned()
    };
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// A chunked body's content (`None` when it is not one).
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::with_capacity(body.len());
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// A TCP server on 127.0.0.1 port 0 that accepts connections, reads what comes and never
/// answers: an admin API that hangs. Runs until the runtime ends.
pub async fn silent_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("cannot bind a silent server: {e}"));
    let addr = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("silent server address: {e}"));
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = stream.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// The pids of `pid`'s children.
pub fn children_of(pid: u32) -> Vec<u32> {
    envoy_agent_proxy::reaper::children(pid)
}

/// A socket a process listens on.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Listening {
    /// A TCP port (any local address).
    Tcp(SocketAddr),
    /// A Unix stream socket bound to a path (as the process bound it: through any symlink).
    Unix(PathBuf),
}

impl std::fmt::Display for Listening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listening::Tcp(addr) => write!(f, "tcp:{addr}"),
            Listening::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// Every TCP and Unix stream socket `pid` listens on: its open sockets (`/proc/<pid>/fd`) that
/// its network namespace's tables (`/proc/<pid>/net/{tcp,tcp6,unix}`) list as listening.
/// Read as root; `[]` for a process that is gone.
pub fn listening_sockets(pid: u32) -> Vec<Listening> {
    let inodes: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let mut found = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address st ... inode: fields 1, 3 and 9; 0A is LISTEN.
            let listening = f.len() > 9 && f[3] == "0A" && inodes.contains(f[9]);
            if let Some(addr) = f
                .get(1)
                .filter(|_| listening)
                .and_then(|a| envoy_agent_proxy::socket_table::parse_address(a))
            {
                found.push(Listening::Tcp(addr));
            }
        }
    }
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // Num RefCount Protocol Flags Type St Inode Path: a listening stream socket has
        // __SO_ACCEPTCON (00010000) in its flags, type 0001 and state 01.
        if f.len() > 7 && f[3] == "00010000" && f[4] == "0001" && inodes.contains(f[6]) {
            found.push(Listening::Unix(PathBuf::from(f[7])));
        }
    }
    found.sort();
    found.dedup();
    found
}

/// The children of `pid` that are hot-restart Envoys (their command line has
/// `--restart-epoch`), not pre-flight runs of the binary.
pub fn envoy_children_of(pid: u32) -> Vec<u32> {
    children_of(pid)
        .into_iter()
        .filter(|child| {
            std::fs::read(format!("/proc/{child}/cmdline"))
                .map(|c| c.split(|b| *b == 0).any(|arg| arg == b"--restart-epoch"))
                .unwrap_or(false)
        })
        .filter(|child| process_alive(*child))
        .collect()
}

/// Whether a process with `pid` exists (and is not a zombie).
pub fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            // The state follows the parenthesised command name.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

/// One HTTP/1.1 keep-alive connection making requests one after another.
#[derive(Debug)]
pub struct KeepAlive {
    stream: tokio::io::BufReader<TcpStream>,
    addr: SocketAddr,
}

impl KeepAlive {
    /// Connects to `addr`.
    pub async fn connect(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        Ok(KeepAlive {
            stream: tokio::io::BufReader::new(stream),
            addr,
        })
    }

    /// `GET path` on this connection (bounded by [`PATIENCE`]).
    pub async fn get(&mut self, path: &str) -> std::io::Result<Response> {
        let addr = self.addr;
        tokio::time::timeout(PATIENCE, self.exchange(path))
            .await
            .map_err(|_| std::io::Error::other(format!("GET {addr}{path}: no answer")))?
    }

    async fn exchange(&mut self, path: &str) -> std::io::Result<Response> {
        use tokio::io::AsyncBufReadExt;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n", self.addr);
        self.stream.get_mut().write_all(request.as_bytes()).await?;
        let mut head = Vec::new();
        loop {
            let mut line = String::new();
            if self.stream.read_line(&mut line).await? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed before a response",
                ));
            }
            if line == "\r\n" {
                break;
            }
            head.push(line);
        }
        let mut response = parse_response(format!("{}\r\n", head.concat()).as_bytes())?;
        let length: usize = response
            .headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0u8; length];
        self.stream.read_exact(&mut body).await?;
        response.body = String::from_utf8_lossy(&body).into_owned();
        Ok(response)
    }

    /// Whether the peer has closed the connection (reads EOF within `within`).
    pub async fn closed_by_peer(&mut self, within: Duration) -> bool {
        let mut buf = [0u8; 1];
        matches!(
            tokio::time::timeout(within, self.stream.read(&mut buf)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }
}

impl Response {
    /// Whether the response asks the client to close the connection (a draining Envoy).
    pub fn connection_close(&self) -> bool {
        self.headers
            .iter()
            .any(|(k, v)| k == "connection" && v.eq_ignore_ascii_case("close"))
    }
}

#[cfg(test)]
mod tests {
    use super::envoy_release;

    #[test]
    fn the_release_is_read_from_either_version_string() {
        let info = "9e5580933739775e8bce696a57a2e1bc99368f23/1.40.0/Clean/RELEASE/BoringSSL";
        assert_eq!(envoy_release(info), Some("1.40.0"));
        let cli = format!("\n/usr/bin/envoy  version: {info}\n");
        assert_eq!(envoy_release(cli.trim()), Some("1.40.0"));
        assert_eq!(envoy_release("garbage"), None);
        assert_eq!(envoy_release(""), None);
    }
}

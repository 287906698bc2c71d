//! The test kit's control plane against the real Envoy: what it serves over ADS is what Envoy
//! runs, updates reach Envoy, and Envoy sees it go away and come back.

// Test code: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::process::Stdio;

use envoy_agent_proxy::{AdminClient, ServerState};
use envoy_agent_tests::control_plane::{CLUSTER, ENDPOINT, LISTENER, ROUTE};
use envoy_agent_tests::{
    ControlPlane, KeepAlive, PATIENCE, Snapshot, TestDir, Upstream, ads_bootstrap, envoy_path,
    eventually, free_port, unique_base_id,
};
use tokio::process::{Child, Command};

/// A real Envoy taking its listeners and clusters from a control plane.
struct Envoy {
    _child: Child,
    admin: AdminClient,
    dir: TestDir,
}

impl Envoy {
    /// Starts Envoy on [`ads_bootstrap`] and waits until it is LIVE: with Envoy's default
    /// initial-fetch timeout (`None`) once LDS and CDS have been answered, with `"0s"` at once.
    async fn start(xds: SocketAddr, initial_fetch_timeout: Option<&str>) -> Envoy {
        let dir = TestDir::new();
        let admin_port = free_port();
        let bootstrap = dir.write(
            "bootstrap.yaml",
            &ads_bootstrap(admin_port, xds, initial_fetch_timeout),
        );
        let log = std::fs::File::create(dir.join("envoy.log")).unwrap();
        let child = Command::new(envoy_path())
            .arg("--disable-hot-restart")
            .arg("-c")
            .arg(&bootstrap)
            .args(["-l", "warning", "--concurrency", "1", "--base-id"])
            .arg(unique_base_id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let admin = AdminClient::new(SocketAddr::from(([127, 0, 0, 1], admin_port)));
        let envoy = Envoy {
            _child: child,
            admin,
            dir,
        };
        eventually("envoy to be LIVE", PATIENCE, || async {
            matches!(envoy.admin.server_info().await, Ok(i) if i.state == ServerState::Live)
                .then_some(())
        })
        .await;
        envoy
    }

    /// The value of the stat `name`, if Envoy has it.
    async fn stat(&self, name: &str) -> Option<u64> {
        let text = self.admin.stats(&format!("^{name}$"), false).await.ok()?;
        text.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(": ")?
                .trim()
                .parse()
                .ok()
        })
    }

    /// Waits until the stat `name` is `value`.
    async fn stat_becomes(&self, name: &str, value: u64) {
        eventually(&format!("{name} to be {value}"), PATIENCE, || async {
            (self.stat(name).await? == value).then_some(())
        })
        .await;
    }
}

impl Drop for Envoy {
    /// A failing test shows what Envoy said (its warnings and errors).
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default();
            eprintln!("envoy's log:\n{log}");
        }
    }
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Waits until 127.0.0.1:`port` answers `/` with 200 and `body`. On a keep-alive connection,
/// not [`envoy_agent_tests::http_get`]'s `Connection: close`: Envoy closes a connection after
/// a direct response only at its delayed-close timeout (1 s), so each of those takes a second.
async fn answers(port: u16, body: &str) {
    eventually(
        &format!("port {port} to answer {body:?}"),
        PATIENCE,
        || async {
            let mut connection = KeepAlive::connect(local(port)).await.ok()?;
            let response = connection.get("/").await.ok()?;
            (response.status == 200 && response.body == body).then_some(())
        },
    )
    .await;
}

/// Waits until the control plane has seen `version` of `type_url` ACKed, saying what Envoy
/// rejected if it did.
async fn acked(control_plane: &ControlPlane, type_url: &str, version: &str) {
    eventually(
        &format!("envoy to ACK version {version} of {type_url}"),
        PATIENCE,
        || async {
            if let Some(error) = control_plane.nacked(type_url) {
                panic!("envoy rejected {type_url}: {error}");
            }
            (control_plane.acked(type_url).as_deref() == Some(version)).then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn envoy_routes_to_the_upstream_it_was_given_over_ads() {
    let upstream = Upstream::start("from the upstream").await;
    let port = free_port();
    let snapshot = Snapshot::routed("1", "ingress", port, upstream.addr());
    let control_plane = ControlPlane::start(0, snapshot).await;
    let envoy = Envoy::start(control_plane.addr(), None).await;

    answers(port, "from the upstream").await;
    for type_url in [LISTENER, ROUTE, CLUSTER, ENDPOINT] {
        acked(&control_plane, type_url, "1").await;
    }
    for stat in [
        "cluster_manager.cds.update_success",
        "listener_manager.lds.update_success",
    ] {
        let value = envoy.stat(stat).await;
        assert!(value >= Some(1), "{stat}: {value:?}");
    }
    assert_eq!(envoy.stat("control_plane.connected_state").await, Some(1));
    assert_eq!(control_plane.streams(), 1, "one ADS stream for every type");
    assert!(
        control_plane.requests() >= 8,
        "a request and an ACK per type"
    );
}

#[tokio::test]
async fn an_update_adds_a_listener() {
    let (first, second) = (free_port(), free_port());
    let control_plane = ControlPlane::start(0, Snapshot::direct("1", "first", first, "one")).await;
    // LIVE before it has any listener: the listener is waited for below.
    let envoy = Envoy::start(control_plane.addr(), Some("0s")).await;
    answers(first, "one").await;
    acked(&control_plane, LISTENER, "1").await;

    control_plane.update(
        Snapshot::direct("2", "first", first, "one").with_direct_listener("second", second, "two"),
    );
    answers(second, "two").await;
    acked(&control_plane, LISTENER, "2").await;
    // The new listener's route configuration came by a new RDS subscription on the same stream.
    acked(&control_plane, ROUTE, "2").await;
    answers(first, "one").await;
    let updates = envoy.stat("listener_manager.lds.update_success").await;
    assert!(updates >= Some(2), "{updates:?}");
    assert_eq!(
        envoy.stat("listener_manager.total_listeners_active").await,
        Some(2)
    );
    assert_eq!(control_plane.streams(), 1);
}

#[tokio::test]
async fn envoy_keeps_serving_without_its_control_plane_and_reconnects() {
    let (port, later) = (free_port(), free_port());
    // A fixed port outside the ephemeral range: no other socket takes it while stopped.
    let mut control_plane =
        ControlPlane::start(free_port(), Snapshot::direct("1", "hello", port, "cached")).await;
    let envoy = Envoy::start(control_plane.addr(), None).await;
    answers(port, "cached").await;
    envoy.stat_becomes("control_plane.connected_state", 1).await;

    control_plane.stop().await;
    assert!(
        tokio::net::TcpStream::connect(control_plane.addr())
            .await
            .is_err(),
        "a stopped control plane refuses connections"
    );
    envoy.stat_becomes("control_plane.connected_state", 0).await;
    // What Envoy has, it keeps.
    answers(port, "cached").await;

    control_plane.restart().await;
    envoy.stat_becomes("control_plane.connected_state", 1).await;
    assert!(control_plane.streams() >= 2, "envoy opened a new stream");
    control_plane.update(
        Snapshot::direct("2", "hello", port, "cached").with_direct_listener(
            "later",
            later,
            "after the restart",
        ),
    );
    answers(later, "after the restart").await;
    acked(&control_plane, LISTENER, "2").await;
    answers(port, "cached").await;
}

/// A drain learns the direction of LDS listeners as of static ones: the agent's drain plan
/// reads `/config_dump?resource=dynamic_listeners` (masked), and a listener the control plane
/// marks INBOUND is drained by a sidecar.
#[tokio::test]
async fn a_drain_plan_knows_the_direction_of_lds_listeners() {
    use envoy_agent_proxy::listeners::{self, Direction};
    use envoy_agent_proxy::{PlanNote, Scope};
    let (port, other) = (free_port(), free_port());
    let snapshot = Snapshot::direct("1", "from_lds", port, "lds")
        .with_direct_listener("also_lds", other, "also");
    let control_plane = ControlPlane::start(0, snapshot).await;
    let envoy = Envoy::start(control_plane.addr(), None).await;
    answers(port, "lds").await;
    let read = listeners::read(&envoy.admin).await.unwrap();
    let mut got: Vec<(&str, Direction, Option<u16>, String)> = read
        .iter()
        .map(|l| (l.name.as_str(), l.direction, l.port, l.stat_name.clone()))
        .collect();
    got.sort();
    // No listener stat_prefix: a listener's stats are named after its configured address.
    assert_eq!(
        got,
        [
            (
                "also_lds",
                Direction::Inbound,
                Some(other),
                format!("127.0.0.1_{other}")
            ),
            (
                "from_lds",
                Direction::Inbound,
                Some(port),
                format!("127.0.0.1_{port}")
            ),
        ]
    );
    let plan = listeners::plan(Scope::Auto, true, Ok(read));
    assert!(plan.inbound_only && plan.note == PlanNote::AsAsked);
    assert_eq!(plan.drained.len(), 2);
}

//! A real xDS control plane for tests: an ADS server (Envoy's Aggregated Discovery Service,
//! state of the world) on the project's gRPC stack, speaking Envoy's own API types
//! (`envoy-types`), so that tests can give a real Envoy listeners, routes, clusters and
//! endpoints, change them, and take the control plane away and bring it back.
//!
//! - [`Snapshot`] is one version of every resource; [`ControlPlane::update`] serves a new one
//!   to every open stream.
//! - [`ControlPlane::stop`] and [`ControlPlane::restart`] take the server away (the port
//!   refuses connections, open streams end) and bring it back on the same port.
//! - [`ads_bootstrap`] is an Envoy bootstrap that takes LDS and CDS (and so RDS and EDS) from it.
//! - [`Upstream`] is a tiny HTTP/1.1 server for the clusters to point at.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, ConfigSource, DataSource, SocketAddress,
    TrafficDirection, address, config_source, data_source, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain, Listener, filter};
use envoy_types::pb::envoy::config::route::v3::{
    DirectResponseAction, Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route,
    route_action, route_match,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds, http_connection_manager, http_filter,
};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::{Any, Duration as ProtoDuration};
use envoy_types::util::pack_any;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::PATIENCE;

/// The type URL of listeners (LDS).
pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
/// The type URL of route configurations (RDS).
pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
/// The type URL of clusters (CDS).
pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
/// The type URL of cluster load assignments (EDS).
pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// The name of the one cluster every snapshot has (so CDS is never empty).
pub const UPSTREAM_CLUSTER: &str = "upstream";

/// What the control plane serves: one version of every resource.
#[derive(Clone, Debug)]
pub struct Snapshot {
    version: String,
    listeners: Vec<Listener>,
    routes: Vec<RouteConfiguration>,
    clusters: Vec<Cluster>,
    endpoints: Vec<ClusterLoadAssignment>,
}

impl Snapshot {
    /// One HTTP listener `name` on 127.0.0.1:`listener_port` (inbound), whose connection
    /// manager (stat prefix `name`) takes its routes by RDS over ADS (route configuration
    /// `<name>-routes`), routing every request to the cluster [`UPSTREAM_CLUSTER`]: an EDS
    /// cluster (over ADS) whose one endpoint is `upstream`, an HTTP/1.1 server.
    pub fn routed(version: &str, name: &str, listener_port: u16, upstream: SocketAddr) -> Snapshot {
        let action = route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                UPSTREAM_CLUSTER.to_owned(),
            )),
            ..Default::default()
        });
        Snapshot {
            version: version.to_owned(),
            listeners: vec![http_listener(name, listener_port)],
            routes: vec![route_configuration(name, action)],
            clusters: vec![eds_cluster(UPSTREAM_CLUSTER)],
            endpoints: vec![load_assignment(UPSTREAM_CLUSTER, Some(upstream))],
        }
    }

    /// The same listener as [`Snapshot::routed`]'s, but its route answers every request
    /// itself with 200 and `body`. CDS still holds the EDS cluster [`UPSTREAM_CLUSTER`] (with
    /// no endpoints), so that no resource type is empty.
    pub fn direct(version: &str, name: &str, listener_port: u16, body: &str) -> Snapshot {
        Snapshot {
            version: version.to_owned(),
            listeners: Vec::new(),
            routes: Vec::new(),
            clusters: vec![eds_cluster(UPSTREAM_CLUSTER)],
            endpoints: vec![load_assignment(UPSTREAM_CLUSTER, None)],
        }
        .with_direct_listener(name, listener_port, body)
    }

    /// Adds another listener like [`Snapshot::direct`]'s: `name` on 127.0.0.1:`listener_port`,
    /// answering every request with 200 and `body` (through its own RDS route configuration).
    pub fn with_direct_listener(mut self, name: &str, listener_port: u16, body: &str) -> Snapshot {
        let action = route::Action::DirectResponse(DirectResponseAction {
            status: 200,
            body: Some(DataSource {
                specifier: Some(data_source::Specifier::InlineString(body.to_owned())),
                ..Default::default()
            }),
            ..Default::default()
        });
        self.listeners.push(http_listener(name, listener_port));
        self.routes.push(route_configuration(name, action));
        self
    }

    /// The same resources under another version: what an update that changes nothing but
    /// the version sends.
    pub fn with_version(mut self, version: &str) -> Snapshot {
        self.version = version.to_owned();
        self
    }

    /// The version.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The resources of `type_url`, packed: every listener and cluster (Envoy subscribes to
    /// them by wildcard), and the route configurations and load assignments named in `names`
    /// (all of them when `names` is empty).
    fn resources(&self, type_url: &str, names: &BTreeSet<String>) -> Vec<Any> {
        let wanted = |name: &str| names.is_empty() || names.contains(name);
        match type_url {
            LISTENER => self.listeners.iter().cloned().map(pack_any).collect(),
            CLUSTER => self.clusters.iter().cloned().map(pack_any).collect(),
            ROUTE => self
                .routes
                .iter()
                .filter(|r| wanted(&r.name))
                .cloned()
                .map(pack_any)
                .collect(),
            ENDPOINT => self
                .endpoints
                .iter()
                .filter(|e| wanted(&e.cluster_name))
                .cloned()
                .map(pack_any)
                .collect(),
            _ => Vec::new(),
        }
    }
}

fn socket_address(ip: &str, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_owned(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(port))),
            ..Default::default()
        })),
    }
}

/// Resources of this type come over the ADS stream.
fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3.into(),
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(
            AggregatedConfigSource {},
        )),
        ..Default::default()
    }
}

fn http_listener(name: &str, port: u16) -> Listener {
    let manager = HttpConnectionManager {
        stat_prefix: name.to_owned(),
        route_specifier: Some(http_connection_manager::RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: format!("{name}-routes"),
        })),
        http_filters: vec![HttpFilter {
            name: "envoy.filters.http.router".to_owned(),
            config_type: Some(http_filter::ConfigType::TypedConfig(pack_any(
                Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    };
    Listener {
        name: name.to_owned(),
        address: Some(socket_address("127.0.0.1", port)),
        traffic_direction: TrafficDirection::Inbound.into(),
        filter_chains: vec![FilterChain {
            filters: vec![Filter {
                name: "envoy.filters.network.http_connection_manager".to_owned(),
                config_type: Some(filter::ConfigType::TypedConfig(pack_any(manager))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn route_configuration(listener: &str, action: route::Action) -> RouteConfiguration {
    RouteConfiguration {
        name: format!("{listener}-routes"),
        virtual_hosts: vec![VirtualHost {
            name: "all".to_owned(),
            domains: vec!["*".to_owned()],
            routes: vec![Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix("/".to_owned())),
                    ..Default::default()
                }),
                action: Some(action),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn eds_cluster(name: &str) -> Cluster {
    Cluster {
        name: name.to_owned(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds.into(),
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: String::new(),
        }),
        connect_timeout: Some(ProtoDuration {
            seconds: 1,
            nanos: 0,
        }),
        ..Default::default()
    }
}

fn load_assignment(cluster: &str, endpoint: Option<SocketAddr>) -> ClusterLoadAssignment {
    let lb_endpoints = endpoint
        .map(|addr| LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(socket_address(&addr.ip().to_string(), addr.port())),
                ..Default::default()
            })),
            ..Default::default()
        })
        .into_iter()
        .collect();
    ClusterLoadAssignment {
        cluster_name: cluster.to_owned(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// What the server and its streams share with the test.
#[derive(Debug)]
struct Shared {
    snapshot: watch::Sender<Snapshot>,
    requests: AtomicU64,
    streams: AtomicU64,
    /// The newest version ACKed, by type URL.
    acked: Mutex<HashMap<String, String>>,
    /// The error of a NACK not yet followed by an ACK, by type URL.
    nacked: Mutex<HashMap<String, String>>,
    /// Whether streams opened now are held (see [`ControlPlane::hold_new_streams`]).
    hold: watch::Sender<bool>,
}

/// A running ADS server that a test can stop, restart on the same port, and update.
#[derive(Debug)]
pub struct ControlPlane {
    addr: SocketAddr,
    shared: Arc<Shared>,
    running: Option<Serving>,
}

/// One start of the server: cancelling `stop` closes the listening socket and ends every
/// stream; `accept` and `server` end then.
#[derive(Debug)]
struct Serving {
    stop: CancellationToken,
    accept: JoinHandle<()>,
    server: JoinHandle<()>,
}

impl ControlPlane {
    /// Starts serving `snapshot` on 127.0.0.1:`port` (0: any free port).
    pub async fn start(port: u16, snapshot: Snapshot) -> ControlPlane {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap_or_else(|e| panic!("cannot bind the control plane to port {port}: {e}"));
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let shared = Arc::new(Shared {
            snapshot: watch::Sender::new(snapshot),
            requests: AtomicU64::new(0),
            streams: AtomicU64::new(0),
            acked: Mutex::default(),
            nacked: Mutex::default(),
            hold: watch::Sender::new(false),
        });
        let running = Some(serve(listener, shared.clone()));
        ControlPlane {
            addr,
            shared,
            running,
        }
    }

    /// Where it listens (the same across [`stop`](Self::stop) and
    /// [`restart`](Self::restart)).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops: the listening socket is closed and every open stream ends at once (with
    /// UNAVAILABLE), then every connection, so that Envoy sees its control plane go away and
    /// its reconnects are refused. Returns once the port is free. Does nothing when stopped.
    pub async fn stop(&mut self) {
        let Some(serving) = self.running.take() else {
            return;
        };
        serving.stop.cancel();
        tokio::time::timeout(PATIENCE, async {
            serving.accept.await.expect("the accept task ends");
            serving.server.await.expect("the server task ends");
        })
        .await
        .expect("the control plane's connections end once its streams do");
    }

    /// Starts again on the same port, serving the latest snapshot. The port was freed by
    /// [`stop`](Self::stop); a bind that finds it still in use is retried for 5 s. Does
    /// nothing when running.
    pub async fn restart(&mut self) {
        if self.running.is_some() {
            return;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(listener) => break listener,
                Err(e)
                    if e.kind() == std::io::ErrorKind::AddrInUse
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("cannot bind the control plane to {} again: {e}", self.addr),
            }
        };
        self.running = Some(serve(listener, self.shared.clone()));
    }

    /// Serves `snapshot` from now on: every open stream is sent the new version of every
    /// type it subscribed to; streams opened later get it on their first requests.
    pub fn update(&self, snapshot: Snapshot) {
        self.shared.snapshot.send_replace(snapshot);
    }

    /// While `hold`, a stream opened from now on gets no response (its requests wait) until
    /// `hold_new_streams(false)`; streams already open are served as before. A new Envoy
    /// epoch then waits for its config while the serving epoch takes updates.
    pub fn hold_new_streams(&self, hold: bool) {
        self.shared.hold.send_replace(hold);
    }

    /// The snapshot being served.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.snapshot.borrow().clone()
    }

    /// How many discovery requests (of any type, on any stream) it has received.
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::Relaxed)
    }

    /// How many ADS streams were ever opened.
    pub fn streams(&self) -> u64 {
        self.shared.streams.load(Ordering::Relaxed)
    }

    /// The newest version Envoy ACKed for `type_url` (the version of a request answering the
    /// last response of that type, with no error), if any.
    pub fn acked(&self, type_url: &str) -> Option<String> {
        lock(&self.shared.acked).get(type_url).cloned()
    }

    /// Why Envoy rejected the last response of `type_url` (the error of a NACK that no ACK
    /// has followed yet), if it did: a test's snapshot that Envoy does not take says why here.
    pub fn nacked(&self, type_url: &str) -> Option<String> {
        lock(&self.shared.nacked).get(type_url).cloned()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(serving) = &self.running {
            serving.stop.cancel();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves ADS on `listener` until the returned `stop` is cancelled. The accept loop is ours,
/// not tonic's: tonic keeps its incoming stream (and so the listening socket) until every
/// connection has closed, and a stopped control plane must refuse connections at once.
fn serve(listener: TcpListener, shared: Arc<Shared>) -> Serving {
    let stop = CancellationToken::new();
    let (connections, incoming) = mpsc::channel::<std::io::Result<TcpStream>>(16);
    let accept = tokio::spawn({
        let stop = stop.clone();
        async move {
            loop {
                let accepted = tokio::select! {
                    () = stop.cancelled() => break,
                    accepted = listener.accept() => accepted,
                };
                match accepted {
                    Ok((stream, _)) => {
                        // gRPC's small frames must not wait for Nagle.
                        let _ = stream.set_nodelay(true);
                        if connections.send(Ok(stream)).await.is_err() {
                            break;
                        }
                    }
                    // Out of file descriptors, say: try again shortly.
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
            // `listener` is dropped here: the port refuses connections.
        }
    });
    let server = tokio::spawn({
        let ads = Ads {
            shared,
            stop: stop.clone(),
        };
        let stop = stop.clone();
        async move {
            let served = tonic::transport::Server::builder()
                .add_service(AggregatedDiscoveryServiceServer::new(ads))
                .serve_with_incoming_shutdown(ReceiverStream::new(incoming), stop.cancelled_owned())
                .await;
            if let Err(e) = served {
                eprintln!("the test control plane failed: {e}");
            }
        }
    });
    Serving {
        stop,
        accept,
        server,
    }
}

/// The ADS service of one start of the server.
struct Ads {
    shared: Arc<Shared>,
    stop: CancellationToken,
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        self.shared.streams.fetch_add(1, Ordering::Relaxed);
        let (responses, stream) = mpsc::channel(16);
        let ads_stream = AdsStream {
            shared: self.shared.clone(),
            snapshot: self.shared.snapshot.subscribe(),
            subscriptions: HashMap::new(),
            nonces: 0,
            responses,
            stop: self.stop.clone(),
        };
        let held = *self.shared.hold.borrow();
        tokio::spawn(ads_stream.run(request.into_inner(), held));
        Ok(Response::new(ReceiverStream::new(stream)))
    }

    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn delta_aggregated_resources(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented(
            "the test control plane serves the state-of-the-world protocol only",
        ))
    }
}

/// What a stream has subscribed to of one type, and the last response of that type.
struct Subscription {
    names: BTreeSet<String>,
    nonce: String,
}

/// One ADS stream (state of the world).
struct AdsStream {
    shared: Arc<Shared>,
    snapshot: watch::Receiver<Snapshot>,
    /// By type URL.
    subscriptions: HashMap<String, Subscription>,
    nonces: u64,
    responses: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    stop: CancellationToken,
}

impl AdsStream {
    /// Answers requests and sends updates until the client goes or the server stops.
    async fn run(mut self, mut requests: Streaming<DiscoveryRequest>, held: bool) {
        let stop = self.stop.clone();
        if held {
            let mut hold = self.shared.hold.subscribe();
            tokio::select! {
                () = stop.cancelled() => return,
                released = hold.wait_for(|h| !h) => if released.is_err() { return },
            }
        }
        loop {
            tokio::select! {
                () = stop.cancelled() => {
                    // Not waiting for room: stopping must not wait for the client. Without
                    // room the stream still ends (with OK), when the sender is dropped here.
                    let _ = self
                        .responses
                        .try_send(Err(Status::unavailable("the test control plane stopped")));
                    return;
                }
                request = requests.message() => {
                    let Ok(Some(request)) = request else { return };
                    if !self.on_request(request).await {
                        return;
                    }
                }
                changed = self.snapshot.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let snapshot = self.snapshot.borrow_and_update().clone();
                    let types: Vec<String> = self.subscriptions.keys().cloned().collect();
                    for type_url in types {
                        if !self.respond(&snapshot, &type_url).await {
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Handles one request; false when the client is gone.
    async fn on_request(&mut self, request: DiscoveryRequest) -> bool {
        self.shared.requests.fetch_add(1, Ordering::Relaxed);
        let names: BTreeSet<String> = request.resource_names.into_iter().collect();
        let type_url = request.type_url;
        let respond = match self.subscriptions.get_mut(&type_url) {
            // The first request of a type gets what there is.
            None => {
                self.subscriptions.insert(
                    type_url.clone(),
                    Subscription {
                        names,
                        nonce: String::new(),
                    },
                );
                true
            }
            Some(subscription) => {
                let answers_last = request.response_nonce == subscription.nonce;
                let resubscribed = subscription.names != names;
                subscription.names = names;
                match request.error_detail {
                    // A NACK: nothing until the next update.
                    Some(error) => {
                        lock(&self.shared.nacked).insert(type_url.clone(), error.message);
                        false
                    }
                    None => {
                        if answers_last {
                            lock(&self.shared.nacked).remove(&type_url);
                            lock(&self.shared.acked).insert(type_url.clone(), request.version_info);
                        }
                        // An ACK gets nothing; a new set of names (a new route configuration
                        // or cluster to warm) gets those resources.
                        resubscribed
                    }
                }
            }
        };
        if !respond {
            return true;
        }
        // Not `borrow_and_update`: an update not yet sent to the other types must still be.
        let snapshot = self.snapshot.borrow().clone();
        self.respond(&snapshot, &type_url).await
    }

    /// Sends `type_url`'s resources of `snapshot` under a new nonce; false when the client is
    /// gone or the server stops (the stream ends then).
    async fn respond(&mut self, snapshot: &Snapshot, type_url: &str) -> bool {
        let Some(subscription) = self.subscriptions.get_mut(type_url) else {
            return true;
        };
        self.nonces += 1;
        subscription.nonce = self.nonces.to_string();
        let response = DiscoveryResponse {
            version_info: snapshot.version.clone(),
            resources: snapshot.resources(type_url, &subscription.names),
            type_url: type_url.to_owned(),
            nonce: subscription.nonce.clone(),
            ..Default::default()
        };
        tokio::select! {
            sent = self.responses.send(Ok(response)) => sent.is_ok(),
            () = self.stop.cancelled() => false,
        }
    }
}

/// An Envoy bootstrap that takes LDS and CDS (and through them RDS and EDS) from the ADS
/// server at `xds`: admin on 127.0.0.1:`admin_port`, node `test` of cluster `test`, a static
/// HTTP/2 cluster `xds` to `xds`. `initial_fetch_timeout` is set on LDS and CDS when `Some`
/// (e.g. `"0s"`: do not wait for them to initialize); `None` leaves Envoy's default (15 s).
pub fn ads_bootstrap(
    admin_port: u16,
    xds: SocketAddr,
    initial_fetch_timeout: Option<&str>,
) -> String {
    let timeout = initial_fetch_timeout
        .map(|t| format!(", initial_fetch_timeout: {t}"))
        .unwrap_or_default();
    format!(
        r#"admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
node: {{ id: test, cluster: test }}
static_resources:
  clusters:
  - name: xds
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: xds
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: {ip}, port_value: {port} }} }} }}
dynamic_resources:
  ads_config:
    api_type: GRPC
    transport_api_version: V3
    grpc_services: [{{ envoy_grpc: {{ cluster_name: xds }} }}]
  lds_config: {{ ads: {{}}, resource_api_version: V3{timeout} }}
  cds_config: {{ ads: {{}}, resource_api_version: V3{timeout} }}
"#,
        ip = xds.ip(),
        port = xds.port()
    )
}

/// A tiny HTTP/1.1 server on 127.0.0.1 (port 0) answering every request with 200 and its
/// body, on keep-alive connections: the endpoint of a cluster. Request bodies are read by
/// `content-length` (a chunked one is not understood). Runs until dropped.
#[derive(Debug)]
pub struct Upstream {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Upstream {
    /// Starts answering every request with 200 and `body`.
    pub async fn start(body: &str) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("cannot bind an upstream: {e}"));
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let body: Arc<str> = body.into();
        let task = tokio::spawn(async move {
            // Owned here, so that dropping the upstream (aborting this task) ends them too.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => {
                            connections.spawn(answer(stream, body.clone()));
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    },
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        Upstream { addr, task }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Answers the requests of one connection until the client closes it (or asks to).
async fn answer(stream: TcpStream, body: Arc<str>) {
    let _ = stream.set_nodelay(true);
    let mut stream = BufReader::new(stream);
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    loop {
        let mut length = 0usize;
        let mut close = false;
        let mut first = true;
        loop {
            let mut line = String::new();
            match stream.read_line(&mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line == "\r\n" || line == "\n" {
                if first {
                    // A stray empty line between requests.
                    continue;
                }
                break;
            }
            first = false;
            if let Some((name, value)) = line.split_once(':') {
                let (name, value) = (name.trim(), value.trim());
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.parse().unwrap_or(0);
                } else if name.eq_ignore_ascii_case("connection") {
                    close = value.eq_ignore_ascii_case("close");
                }
            }
        }
        let mut request_body = vec![0u8; length];
        if stream.read_exact(&mut request_body).await.is_err() {
            return;
        }
        if stream
            .get_mut()
            .write_all(response.as_bytes())
            .await
            .is_err()
            || close
        {
            return;
        }
    }
}

//! Real clients of every protocol, and upstreams that stream, for end-to-end drain tests: what
//! a client was told (a `Connection: close`, an HTTP/2 or HTTP/3 GOAWAY, a QUIC
//! CONNECTION_CLOSE, a gRPC status) and when.
//!
//! Each client or upstream is a child process (killed when dropped) that prints one JSON object
//! per line for each fact: the Python programs under `tests/clients/` (run with the test
//! tools' Python: h2, aioquic, grpcio), and Debian's `nghttp -v`, whose frame log [`Nghttp`]
//! turns into the same [`Event`]s. A [`ClientProcess`] gathers them as they come into a list a
//! test reads ([`ClientProcess::events`]) or waits on ([`ClientProcess::wait_for`], bounded by
//! [`PATIENCE`] through [`eventually`]).
//!
//! [`DrainBootstrap`] writes the Envoy config they run against: listeners of each
//! `traffic_direction` (and optionally an HTTP/3 one) routing `/stream` to a
//! [`HttpUpstream`], `/grpc` to a [`GrpcUpstream`] and `/` to a direct answer;
//! [`EnvoyProcess`] runs it.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

use crate::{PATIENCE, TestDir, envoy_path, eventually, repo_root, test_tool, unique_base_id};

/// How long a client runs unless told otherwise (`--duration`): past any wait of a test.
pub const CLIENT_DURATION: Duration = Duration::from_secs(90);

/// One fact a client or upstream reported, with when it was seen.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Event {
    /// When, Unix seconds (the reporting process's clock: this machine's).
    pub t: f64,
    /// What.
    #[serde(flatten)]
    pub kind: Kind,
}

/// What a client or upstream reported: each variant's fields are the JSON object's (the
/// programs' `--help` tells them). `conn` counts a client's connections from 1; HTTP/1.1 and
/// gRPC have no `stream_id`.
#[allow(missing_docs)] // the fields: in each variant's doc and the programs' `--help`
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Kind {
    /// A connection is up (for HTTP/3, its handshake is done; `alpn` is `h3`).
    Connected {
        #[serde(default)]
        conn: u32,
        #[serde(default)]
        alpn: Option<String>,
    },
    /// A response's head. `connection` is HTTP/1.1's `Connection` header, if any.
    Response {
        #[serde(default)]
        conn: u32,
        #[serde(default)]
        stream_id: Option<u64>,
        status: u16,
        #[serde(default)]
        connection: Option<String>,
    },
    /// Body bytes of a stream.
    Data {
        #[serde(default)]
        conn: u32,
        #[serde(default)]
        stream_id: Option<u64>,
        bytes: u64,
    },
    /// A stream ended cleanly (END_STREAM, or HTTP/3's FIN).
    StreamEnd {
        #[serde(default)]
        conn: u32,
        #[serde(default)]
        stream_id: Option<u64>,
    },
    /// A stream was reset by the server (RST_STREAM, or QUIC's RESET_STREAM).
    Reset {
        #[serde(default)]
        conn: u32,
        #[serde(default)]
        stream_id: Option<u64>,
        error_code: u64,
    },
    /// A GOAWAY frame: HTTP/2's (with an error code) or HTTP/3's (none; `last_stream_id` is
    /// the frame's stream id).
    Goaway {
        #[serde(default)]
        conn: u32,
        last_stream_id: u64,
        #[serde(default)]
        error_code: Option<u64>,
    },
    /// A connection ended. `how`: `eof` or `reset` (TCP, by the server), `client` (the client
    /// closed it, after `Connection: close` or at its end), `peer` (QUIC: the server's
    /// CONNECTION_CLOSE), `idle_timeout` (QUIC), `exit` (nghttp ended). QUIC gives the close's
    /// `error_code`, `frame_type` and `reason`, and `no_error` (the code is QUIC's NO_ERROR or
    /// HTTP/3's H3_NO_ERROR); `pending` (HTTP/1.1) and `open_streams` say whether requests
    /// were in flight.
    Closed {
        #[serde(default)]
        conn: u32,
        how: String,
        #[serde(default)]
        pending: Option<bool>,
        #[serde(default)]
        open_streams: Option<u64>,
        #[serde(default)]
        error_code: Option<u64>,
        #[serde(default)]
        frame_type: Option<u64>,
        #[serde(default)]
        reason: Option<String>,
        #[serde(default)]
        no_error: Option<bool>,
    },
    /// A request without a complete 200 answer (or a connection that could not be made).
    Failure {
        #[serde(default)]
        conn: u32,
        reason: String,
    },
    /// A gRPC stream's message.
    Message { n: u64, value: String },
    /// A gRPC call's final status. `clean`: OK, with every message asked for.
    Status {
        code: String,
        details: String,
        clean: bool,
        messages: u64,
    },
    /// The client's last word, with its counts (those it keeps).
    Done {
        #[serde(default)]
        responses: Option<u64>,
        #[serde(default)]
        failures: Option<u64>,
        #[serde(default)]
        connections: Option<u64>,
        #[serde(default)]
        goaways: Option<u64>,
        #[serde(default)]
        messages: Option<u64>,
        #[serde(default)]
        code: Option<String>,
    },
    /// An upstream is listening on 127.0.0.1:`port`.
    Listening { port: u16 },
    /// An upstream started a streaming answer of `count` chunks or messages.
    Serving { count: u64 },
    /// An upstream sent all of a streaming answer.
    Served { count: u64 },
    /// An upstream's streaming answer ended early: the downstream went away.
    Aborted { count: u64, error: String },
    /// The app (`tests/clients/app.py`) got SIGTERM and is finishing its work.
    Stopping,
    /// `tests/clients/certs.py` wrote a certificate and its key.
    Certs { cert: PathBuf, key: PathBuf },
    /// A line that is none of the above (kept for the failure message).
    #[serde(skip)]
    Unparsed { line: String },
}

impl Kind {
    /// The client connection the event is about (from 1), if it is about one.
    pub fn conn(&self) -> Option<u32> {
        match self {
            Kind::Connected { conn, .. }
            | Kind::Response { conn, .. }
            | Kind::Data { conn, .. }
            | Kind::StreamEnd { conn, .. }
            | Kind::Reset { conn, .. }
            | Kind::Goaway { conn, .. }
            | Kind::Closed { conn, .. }
            | Kind::Failure { conn, .. } => Some(*conn),
            _ => None,
        }
    }
}

/// Now, Unix seconds.
fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// Turns one line of a child's stdout into events.
type LineParser = Box<dyn FnMut(&str) -> Vec<Event> + Send>;

/// A JSON-lines parser: one event a line.
fn json_lines() -> LineParser {
    Box::new(|line: &str| {
        if line.is_empty() {
            return Vec::new();
        }
        let event = serde_json::from_str::<Event>(line).unwrap_or_else(|_| Event {
            t: now(),
            kind: Kind::Unparsed {
                line: line.to_owned(),
            },
        });
        vec![event]
    })
}

/// A client or upstream running as a child process (killed when dropped), its events gathered
/// as they come.
#[derive(Debug)]
pub struct ClientProcess {
    name: String,
    _child: Child,
    events: Arc<Mutex<Vec<Event>>>,
    stderr: Arc<Mutex<String>>,
    ended: Arc<AtomicBool>,
}

impl ClientProcess {
    /// Runs `program` with `args`, reading its stdout with `parse` (on the current tokio
    /// runtime). Panics when it cannot start.
    fn spawn(name: &str, program: &Path, args: &[OsString], mut parse: LineParser) -> Self {
        let mut child = Command::new(program)
            .args(args)
            // No __pycache__ in the source tree.
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({}): {e}", program.display()));
        let events = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let ended = Arc::new(AtomicBool::new(false));
        if let Some(out) = child.stdout.take() {
            let (events, ended) = (events.clone(), ended.clone());
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let new = parse(&line);
                    if let Ok(mut events) = events.lock() {
                        events.extend(new);
                    }
                }
                let last = parse("");
                if let Ok(mut events) = events.lock() {
                    events.extend(last);
                }
                ended.store(true, Ordering::SeqCst);
            });
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(collect(err, stderr.clone()));
        }
        ClientProcess {
            name: name.to_owned(),
            _child: child,
            events,
            stderr,
            ended,
        }
    }

    /// Runs `tests/clients/<script>` with the test tools' Python.
    pub fn python(script: &str, args: &[OsString]) -> Self {
        let path = clients_dir().join(script);
        let mut all = vec![path.into_os_string()];
        all.extend_from_slice(args);
        Self::spawn(script, &test_tool("python"), &all, json_lines())
    }

    /// The process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self._child.id()
    }

    /// Every event so far.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// Every event's kind so far.
    pub fn kinds(&self) -> Vec<Kind> {
        self.events().into_iter().map(|e| e.kind).collect()
    }

    /// The first event (so far) for which `pick` says something.
    pub fn find<T>(&self, mut pick: impl FnMut(&Event) -> Option<T>) -> Option<T> {
        self.events
            .lock()
            .ok()
            .and_then(|events| events.iter().find_map(&mut pick))
    }

    /// Waits (bounded by [`PATIENCE`]) for the first event for which `pick` says something.
    /// Panics naming `what` and telling everything the process said when none comes.
    pub async fn wait_for<T>(&self, what: &str, mut pick: impl FnMut(&Event) -> Option<T>) -> T {
        let found = eventually(&format!("{}: {what}", self.name), PATIENCE, || {
            let found = self.find(&mut pick).map(Ok);
            let found = found.or_else(|| self.ended().then_some(Err(())));
            async move { found }
        })
        .await;
        match found {
            Ok(value) => value,
            Err(()) => self.find(&mut pick).unwrap_or_else(|| {
                panic!("{} ended without {what}:\n{}", self.name, self.describe())
            }),
        }
    }

    /// Whether the process has ended (its stdout closed).
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// Waits (bounded by `within`) until the process has ended, and returns every event.
    pub async fn finished(&self, within: Duration) -> Vec<Event> {
        eventually(&format!("{} to end", self.name), within, || async {
            self.ended().then_some(())
        })
        .await;
        self.events()
    }

    /// The GOAWAY frames seen so far.
    pub fn goaways(&self) -> Vec<Event> {
        self.events()
            .into_iter()
            .filter(|e| matches!(e.kind, Kind::Goaway { .. }))
            .collect()
    }

    /// Whether a GOAWAY came.
    pub fn saw_goaway(&self) -> bool {
        !self.goaways().is_empty()
    }

    /// The responses seen so far.
    pub fn responses(&self) -> Vec<Event> {
        self.events()
            .into_iter()
            .filter(|e| matches!(e.kind, Kind::Response { .. }))
            .collect()
    }

    /// Whether a response said `Connection: close` (HTTP/1.1).
    pub fn saw_connection_close(&self) -> bool {
        self.find(|e| match &e.kind {
            Kind::Response {
                connection: Some(c),
                ..
            } => c.eq_ignore_ascii_case("close").then_some(()),
            _ => None,
        })
        .is_some()
    }

    /// The first connection end seen, if any.
    pub fn closed(&self) -> Option<Event> {
        self.find(|e| matches!(e.kind, Kind::Closed { .. }).then(|| e.clone()))
    }

    /// The failures seen so far.
    pub fn failures(&self) -> Vec<Event> {
        self.events()
            .into_iter()
            .filter(|e| matches!(e.kind, Kind::Failure { .. }))
            .collect()
    }

    /// Body bytes received so far (all streams).
    pub fn data_bytes(&self) -> u64 {
        self.events()
            .iter()
            .map(|e| match e.kind {
                Kind::Data { bytes, .. } => bytes,
                _ => 0,
            })
            .sum()
    }

    /// What the process printed on stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Every event and the stderr, for a failure message.
    pub fn describe(&self) -> String {
        let mut text = String::new();
        for event in self.events() {
            let _ = writeln!(text, "  {:.3} {:?}", event.t, event.kind);
        }
        let stderr = self.stderr();
        if !stderr.is_empty() {
            let _ = write!(text, "  stderr:\n{stderr}");
        }
        text
    }
}

async fn collect(stream: impl AsyncRead + Unpin, into: Arc<Mutex<String>>) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Ok(mut text) = into.lock() {
            text.push_str(&line);
            text.push('\n');
        }
    }
}

/// `tests/clients/`, where the Python clients and upstreams live.
pub fn clients_dir() -> PathBuf {
    repo_root().join("tests/clients")
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// How a client runs, beyond its mode.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The request path (`None`: the client's default: `/`, or `/stream?seconds=60` for
    /// [`H2Client::stream`]).
    pub path: Option<String>,
    /// Between requests, in the `requests` modes.
    pub interval: Duration,
    /// The client exits by itself after this long.
    pub duration: Duration,
    /// HTTP/1.1: a new connection after one ends (the `requests` mode goes on).
    pub reconnect: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            path: None,
            interval: Duration::from_millis(200),
            duration: CLIENT_DURATION,
            reconnect: false,
        }
    }
}

impl ClientOptions {
    fn args(&self) -> Vec<OsString> {
        let mut args = os(&[
            "--interval-ms",
            &self.interval.as_millis().to_string(),
            "--duration",
            &self.duration.as_secs_f64().to_string(),
        ]);
        if let Some(path) = &self.path {
            args.extend(os(&["--path", path]));
        }
        args
    }
}

fn host_port(addr: SocketAddr) -> Vec<OsString> {
    os(&[&addr.ip().to_string(), &addr.port().to_string()])
}

macro_rules! client_newtype {
    ($name:ident) => {
        impl std::ops::Deref for $name {
            type Target = ClientProcess;
            fn deref(&self) -> &ClientProcess {
                &self.0
            }
        }
    };
}

/// `tests/clients/h1_keepalive.py`: one HTTP/1.1 keep-alive connection. Events: `Connected`,
/// `Response` (with its `connection` header), `Closed` (`eof`, `reset`, or `client` after a
/// `Connection: close`), `Failure`, `Done`.
#[derive(Debug)]
pub struct H1Client(pub ClientProcess);
client_newtype!(H1Client);

impl H1Client {
    /// A `GET /` every `interval` on one connection, stopping when it ends.
    pub fn requests(addr: SocketAddr, interval: Duration) -> H1Client {
        Self::start(
            addr,
            false,
            &ClientOptions {
                interval,
                ..ClientOptions::default()
            },
        )
    }

    /// A request every 200 ms, on a new connection (after that interval) whenever the server
    /// closes one or says `Connection: close`: a client that keeps asking through a drain.
    pub fn keeps_asking(addr: SocketAddr) -> H1Client {
        H1Client::start(
            addr,
            false,
            &ClientOptions {
                reconnect: true,
                ..ClientOptions::default()
            },
        )
    }

    /// One `GET /`, then only waiting for the server to close the connection.
    pub fn idle(addr: SocketAddr) -> H1Client {
        Self::start(addr, true, &ClientOptions::default())
    }

    /// The client with `options`; `idle` for the idle mode.
    pub fn start(addr: SocketAddr, idle: bool, options: &ClientOptions) -> H1Client {
        let mut args = host_port(addr);
        args.extend(options.args());
        if idle {
            args.push("--idle".into());
        }
        if options.reconnect {
            args.push("--reconnect".into());
        }
        H1Client(ClientProcess::python("h1_keepalive.py", &args))
    }
}

/// `tests/clients/app.py`: the app beside a sidecar. It calls out through Envoy's outbound
/// listener over one HTTP/1.1 keep-alive connection (a new one only when Envoy closes it or
/// says `Connection: close`) and, on SIGTERM, goes on calling for its shutdown time, then
/// exits. Events: `Connected`, `Response`, `Failure`, `Stopping`, `Done`.
#[derive(Debug)]
pub struct App(pub ClientProcess);
client_newtype!(App);

impl App {
    /// Calls to `addr` every `interval`; `shutdown`: how long it goes on after SIGTERM.
    pub fn start(addr: SocketAddr, interval: Duration, shutdown: Duration) -> App {
        let mut args = host_port(addr);
        args.extend(os(&[
            "--interval-ms",
            &interval.as_millis().to_string(),
            "--shutdown",
            &shutdown.as_secs_f64().to_string(),
        ]));
        App(ClientProcess::python("app.py", &args))
    }

    /// SIGTERM, as the kubelet sends it.
    pub fn terminate(&self) {
        let pid = self.pid().expect("the app runs");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("SIGTERM to the app");
    }
}

/// `tests/clients/uploads.py`: uploads held open, the load that fills a buffering Envoy's
/// memory. Every `every` a POST of `size` bytes starts, sends all but its last byte and holds
/// it; once the last has started (and a second more), each finishes and reads its answer.
/// Events: a `Response` (its status) or a `Failure` per upload, then `Done`.
#[derive(Debug)]
pub struct Uploads(pub ClientProcess);
client_newtype!(Uploads);

impl Uploads {
    /// `count` uploads of `size` bytes to `addr`, one each `every`.
    pub fn start(addr: SocketAddr, count: u32, size: u64, every: Duration) -> Uploads {
        let mut args = host_port(addr);
        args.extend(os(&[
            "--count",
            &count.to_string(),
            "--size",
            &size.to_string(),
            "--every-ms",
            &every.as_millis().to_string(),
        ]));
        Uploads(ClientProcess::python("uploads.py", &args))
    }
}

/// The modes of [`H2Client`] and [`H3Client`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One request, then the connection held open.
    Idle,
    /// One long request to a streaming path (HTTP/2 only).
    Stream,
    /// A long-lived stream at all times (HTTP/2 only): a long request to a streaming path,
    /// the next one at once on a new connection after a GOAWAY; a stream cut without a GOAWAY
    /// first is a `Failure`.
    Streams,
    /// A request every interval; a new connection after a GOAWAY.
    Requests,
}

impl Mode {
    fn as_str(self) -> &'static str {
        match self {
            Mode::Idle => "idle",
            Mode::Stream => "stream",
            Mode::Streams => "streams",
            Mode::Requests => "requests",
        }
    }
}

/// `tests/clients/h2_client.py`: HTTP/2 (Python's h2) over cleartext TCP with prior
/// knowledge. Events: `Connected`, `Response`, `Data`, `StreamEnd`, `Reset`, `Goaway` (with
/// `error_code`), `Closed` (`eof`, `reset`, `client`; `open_streams`), `Failure`, `Done`.
#[derive(Debug)]
pub struct H2Client(pub ClientProcess);
client_newtype!(H2Client);

impl H2Client {
    /// One `GET /`, then the connection held open.
    pub fn idle(addr: SocketAddr) -> H2Client {
        Self::start(Mode::Idle, addr, &ClientOptions::default())
    }

    /// One long `GET path` (e.g. `/stream?seconds=60`), reporting each chunk.
    pub fn stream(addr: SocketAddr, path: &str) -> H2Client {
        let options = ClientOptions {
            path: Some(path.to_owned()),
            ..ClientOptions::default()
        };
        Self::start(Mode::Stream, addr, &options)
    }

    /// A `GET /` every `interval`; after a GOAWAY, the next on a new connection.
    pub fn requests(addr: SocketAddr, interval: Duration) -> H2Client {
        let options = ClientOptions {
            interval,
            ..ClientOptions::default()
        };
        Self::start(Mode::Requests, addr, &options)
    }

    /// The client in `mode` with `options`.
    pub fn start(mode: Mode, addr: SocketAddr, options: &ClientOptions) -> H2Client {
        let mut args = vec![OsString::from(mode.as_str())];
        args.extend(host_port(addr));
        args.extend(options.args());
        H2Client(ClientProcess::python("h2_client.py", &args))
    }
}

/// `tests/clients/h3_client.py`: HTTP/3 (aioquic) to a QUIC listener, not verifying its
/// certificate. Events: `Connected` (`alpn`), `Response`, `Data`, `StreamEnd`, `Reset`,
/// `Goaway` (HTTP/3's: no error code), `Closed` (`peer`, `idle_timeout`, `client`; with the
/// CONNECTION_CLOSE's `error_code`, `frame_type`, `reason` and `no_error`), `Failure`, `Done`.
#[derive(Debug)]
pub struct H3Client(pub ClientProcess);
client_newtype!(H3Client);

impl H3Client {
    /// One `GET /`, then the connection held open.
    pub fn idle(addr: SocketAddr) -> H3Client {
        Self::start(Mode::Idle, addr, &ClientOptions::default())
    }

    /// A `GET /` every `interval`; after a GOAWAY or a close, the next on a new connection.
    pub fn requests(addr: SocketAddr, interval: Duration) -> H3Client {
        let options = ClientOptions {
            interval,
            ..ClientOptions::default()
        };
        Self::start(Mode::Requests, addr, &options)
    }

    /// The client in `mode` ([`Mode::Stream`] and [`Mode::Streams`] are not HTTP/3's: they
    /// run as `idle` on `options.path`) with `options`.
    pub fn start(mode: Mode, addr: SocketAddr, options: &ClientOptions) -> H3Client {
        let mode = if matches!(mode, Mode::Stream | Mode::Streams) {
            Mode::Idle
        } else {
            mode
        };
        let mut args = vec![OsString::from(mode.as_str())];
        args.extend(host_port(addr));
        args.extend(options.args());
        H3Client(ClientProcess::python("h3_client.py", &args))
    }
}

/// `tests/clients/grpc_stream.py`: a grpcio client of the server-streaming
/// `/grpc.test.Streamer/Count` ([`GrpcUpstream`]). grpcio does not surface GOAWAY frames.
/// Events: `Message`, `Status` (the final status; `clean`: OK with every message), `Done`.
#[derive(Debug)]
pub struct GrpcStreamClient(pub ClientProcess);
client_newtype!(GrpcStreamClient);

impl GrpcStreamClient {
    /// Asks `addr` (Envoy's listener) for `messages` messages, one a second.
    pub fn start(addr: SocketAddr, messages: u32) -> GrpcStreamClient {
        let mut args = host_port(addr);
        args.extend(os(&[
            "--messages",
            &messages.to_string(),
            "--duration",
            &CLIENT_DURATION.as_secs().to_string(),
        ]));
        GrpcStreamClient(ClientProcess::python("grpc_stream.py", &args))
    }

    /// The call's final status, once it came.
    pub fn status(&self) -> Option<Event> {
        self.find(|e| matches!(e.kind, Kind::Status { .. }).then(|| e.clone()))
    }

    /// The messages received so far.
    pub fn messages(&self) -> usize {
        self.events()
            .iter()
            .filter(|e| matches!(e.kind, Kind::Message { .. }))
            .count()
    }
}

/// Debian's `nghttp -v` (nghttp2-client, from the test tools) on one long HTTP/2 request
/// (cleartext, prior knowledge), its frame log turned into events: `Response` (`:status`),
/// `Data` (each DATA frame's length), `StreamEnd` (END_STREAM), `Reset` (RST_STREAM),
/// `Goaway` (`last_stream_id`, `error_code`), and `Closed` with `how: "exit"` when nghttp
/// ends. Bounded by [`CLIENT_DURATION`] (`timeout`).
#[derive(Debug)]
pub struct Nghttp(pub ClientProcess);
client_newtype!(Nghttp);

impl Nghttp {
    /// `GET http://addr{path}`, body discarded.
    pub fn stream(addr: SocketAddr, path: &str) -> Nghttp {
        let nghttp = test_tool("nghttp");
        let args = vec![
            OsString::from(format!("{}s", CLIENT_DURATION.as_secs())),
            nghttp.into_os_string(),
            "-v".into(),
            "-n".into(),
            "--no-dep".into(),
            format!("http://{addr}{path}").into(),
        ];
        Nghttp(ClientProcess::spawn(
            "nghttp",
            Path::new("timeout"),
            &args,
            nghttp_parser(),
        ))
    }
}

/// Parses `nghttp -v` output: a frame line (`[  0.001] recv GOAWAY frame <length=8,
/// flags=0x00, stream_id=0>`) and, for GOAWAY and RST_STREAM, the detail line after it
/// (`(last_stream_id=13, error_code=NO_ERROR(0x00), ...)`). An empty line is the end.
fn nghttp_parser() -> LineParser {
    // The frame waiting for its detail line: (type, stream_id).
    let mut pending: Option<(String, u64)> = None;
    Box::new(move |line: &str| {
        let t = now();
        let event = |kind| vec![Event { t, kind }];
        if line.is_empty() {
            return event(Kind::Closed {
                conn: 1,
                how: "exit".to_owned(),
                pending: None,
                open_streams: None,
                error_code: None,
                frame_type: None,
                reason: None,
                no_error: None,
            });
        }
        let body = line.trim();
        let body = match body.strip_prefix('[') {
            Some(rest) => rest.split_once(']').map_or(body, |(_, r)| r.trim()),
            None => body,
        };
        if let Some((frame, stream_id)) = pending.take()
            && body.starts_with('(')
        {
            let error_code = field(body, "error_code=").and_then(|v| {
                let hex = v.split_once("(0x")?.1.trim_end_matches(')');
                u64::from_str_radix(hex, 16).ok()
            });
            return match frame.as_str() {
                "GOAWAY" => event(Kind::Goaway {
                    conn: 1,
                    last_stream_id: field(body, "last_stream_id=")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or_default(),
                    error_code,
                }),
                _ => event(Kind::Reset {
                    conn: 1,
                    stream_id: Some(stream_id),
                    error_code: error_code.unwrap_or_default(),
                }),
            };
        }
        if let Some(rest) = body.strip_prefix("recv (stream_id=") {
            // `recv (stream_id=13) :status: 200`
            let (id, header) = rest.split_once(')').unwrap_or(("", ""));
            if let Some(status) = header.trim().strip_prefix(":status: ") {
                return event(Kind::Response {
                    conn: 1,
                    stream_id: id.parse().ok(),
                    status: status.trim().parse().unwrap_or_default(),
                    connection: None,
                });
            }
            return Vec::new();
        }
        let Some(rest) = body.strip_prefix("recv ") else {
            return Vec::new();
        };
        let Some((frame, attrs)) = rest.split_once(" frame <") else {
            return Vec::new();
        };
        let number = |name: &str| field(attrs, name).and_then(|v| v.parse::<u64>().ok());
        let flags = field(attrs, "flags=0x")
            .and_then(|v| u64::from_str_radix(v, 16).ok())
            .unwrap_or_default();
        let stream_id = number("stream_id=").unwrap_or_default();
        let end_stream = flags & 0x1 != 0;
        let mut events = Vec::new();
        match frame {
            "DATA" => {
                events.push(Event {
                    t,
                    kind: Kind::Data {
                        conn: 1,
                        stream_id: Some(stream_id),
                        bytes: number("length=").unwrap_or_default(),
                    },
                });
            }
            "GOAWAY" | "RST_STREAM" => pending = Some((frame.to_owned(), stream_id)),
            _ => {}
        }
        if end_stream && matches!(frame, "DATA" | "HEADERS") {
            events.push(Event {
                t,
                kind: Kind::StreamEnd {
                    conn: 1,
                    stream_id: Some(stream_id),
                },
            });
        }
        events
    })
}

/// The value of `name` (e.g. `length=`) in `text`: up to the next `,`, `>`, `)` or space.
fn field<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let start = text.find(name)? + name.len();
    let rest = &text[start..];
    let end = rest
        .char_indices()
        .find(|(i, c)| matches!(c, ',' | '>' | ' ') || (*c == ')' && !rest[..*i].contains('(')))
        .map_or(rest.len(), |(i, _)| i);
    Some(&rest[..end])
}

/// `tests/clients/http_upstream.py`: an HTTP/1.1 server on 127.0.0.1 port 0 answering
/// `/stream?seconds=N` with one chunk a second (chunked) and anything else with 200
/// `upstream`. Events: `Listening`, then `Serving`, `Served` or `Aborted` for each stream.
#[derive(Debug)]
pub struct HttpUpstream(pub ClientProcess, SocketAddr);
client_newtype!(HttpUpstream);

impl HttpUpstream {
    /// Starts it and waits for its port.
    pub async fn start() -> HttpUpstream {
        HttpUpstream::start_for(Duration::from_secs(900)).await
    }

    /// Starts it, to exit by itself after `duration`, and waits for its port.
    pub async fn start_for(duration: Duration) -> HttpUpstream {
        let duration = duration.as_secs().to_string();
        let process = ClientProcess::python("http_upstream.py", &os(&["--duration", &duration]));
        let addr = listening(&process).await;
        HttpUpstream(process, addr)
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.1
    }
}

/// `tests/clients/grpc_upstream.py`: a grpcio server on 127.0.0.1 port 0 with the
/// server-streaming `/grpc.test.Streamer/Count` (one message a second) and the standard
/// health service. Events: `Listening`, then `Serving`, `Served` or `Aborted` for each call.
#[derive(Debug)]
pub struct GrpcUpstream(pub ClientProcess, SocketAddr);
client_newtype!(GrpcUpstream);

impl GrpcUpstream {
    /// Starts it and waits for its port.
    pub async fn start() -> GrpcUpstream {
        let process = ClientProcess::python("grpc_upstream.py", &os(&["--duration", "900"]));
        let addr = listening(&process).await;
        GrpcUpstream(process, addr)
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.1
    }
}

async fn listening(process: &ClientProcess) -> SocketAddr {
    let port = process
        .wait_for("its port", |e| match e.kind {
            Kind::Listening { port } => Some(port),
            _ => None,
        })
        .await;
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A self-signed certificate (EC P-256, for `localhost` and 127.0.0.1) and its key, for the
/// QUIC listener: written by `tests/clients/certs.py` (Python's `cryptography`, from the test
/// tools) into a test's dir.
#[derive(Debug, Clone)]
pub struct TlsCert {
    /// The certificate, PEM.
    pub cert: PathBuf,
    /// Its private key, PEM.
    pub key: PathBuf,
}

impl TlsCert {
    /// Writes `cert.pem` and `key.pem` into `dir`.
    pub fn generate(dir: &TestDir) -> TlsCert {
        let output = std::process::Command::new(test_tool("python"))
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .arg(clients_dir().join("certs.py"))
            .arg(dir.path())
            .output()
            .unwrap_or_else(|e| panic!("cannot run certs.py: {e}"));
        assert!(
            output.status.success(),
            "certs.py failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        TlsCert {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }
    }
}

/// The listeners of [`DrainBootstrap`], by name, and their `traffic_direction`.
pub const TCP_LISTENERS: [(&str, Option<&str>); 3] = [
    ("inbound", Some("INBOUND")),
    ("outbound", Some("OUTBOUND")),
    ("plain", None),
];

/// The name of [`DrainBootstrap`]'s HTTP/3 listener (UDP, no `traffic_direction`).
pub const QUIC_LISTENER: &str = "quic";

/// An Envoy config for drain tests: admin and every listener on 127.0.0.1 port 0 (find them
/// with [`EnvoyProcess::listener`]); the TCP listeners [`TCP_LISTENERS`] (one per
/// `traffic_direction`: INBOUND, OUTBOUND, none), each an HTTP connection manager with
/// `codec_type: AUTO` (HTTP/1.1 and prior-knowledge h2c), and optionally [`QUIC_LISTENER`]
/// (HTTP/3). Every connection manager routes `/stream` to the [`HttpUpstream`] (HTTP/1.1),
/// `/grpc` to the [`GrpcUpstream`] (HTTP/2) when there is one, both without a route timeout,
/// and anything else to a direct 200 `direct`.
#[derive(Debug, Clone)]
pub struct DrainBootstrap {
    http_upstream: SocketAddr,
    grpc_upstream: Option<SocketAddr>,
    max_connection_duration: Option<Duration>,
    quic: Option<TlsCert>,
    /// Fixed ports: the admin's and each listener's (hot restart needs them).
    fixed: Option<(u16, Vec<u16>)>,
    /// The TCP listeners, by name and direction.
    listeners: Vec<(&'static str, Option<&'static str>)>,
    /// The direct answer's body.
    body: String,
    /// Listeners and clusters also from the ADS server there.
    ads: Option<SocketAddr>,
}

impl DrainBootstrap {
    /// Routing `/stream` to `http_upstream`.
    pub fn new(http_upstream: SocketAddr) -> Self {
        DrainBootstrap {
            http_upstream,
            grpc_upstream: None,
            max_connection_duration: None,
            quic: None,
            fixed: None,
            listeners: TCP_LISTENERS.to_vec(),
            body: "direct\n".to_owned(),
            ads: None,
        }
    }

    /// The body of the direct 200 (default `direct\n`): a config change that changes nothing
    /// else. Plain text, no quotes or backslashes.
    pub fn body(mut self, body: &str) -> Self {
        self.body = body.to_owned();
        self
    }

    /// Also takes listeners and clusters (LDS and CDS over ADS, Envoy's default initial-fetch
    /// timeout) from the ADS server at `xds` (the static cluster `xds`, HTTP/2).
    pub fn ads(mut self, xds: SocketAddr) -> Self {
        self.ads = Some(xds);
        self
    }

    /// With [`DrainBootstrap::fixed_ports`]: where the listener `name` (a TCP one, or
    /// [`QUIC_LISTENER`]) is.
    pub fn listener_addr(&self, name: &str) -> Option<SocketAddr> {
        let (_, ports) = self.fixed.as_ref()?;
        let i = match name {
            QUIC_LISTENER => self.quic.as_ref().map(|_| self.listeners.len())?,
            _ => self.listeners.iter().position(|(n, _)| *n == name)?,
        };
        ports.get(i).map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
    }

    /// Fixed ports (for hot restart, whose epochs hand listeners over by their configured
    /// address): the admin on `admin_port`, each listener on a free port.
    pub fn fixed_ports(mut self, admin_port: u16) -> Self {
        let ports = (0..self.listeners.len() + 1)
            .map(|_| crate::free_port())
            .collect();
        self.fixed = Some((admin_port, ports));
        self
    }

    /// Only the TCP listeners named here (of [`TCP_LISTENERS`]).
    pub fn only(mut self, names: &[&str]) -> Self {
        self.listeners.retain(|(name, _)| names.contains(name));
        self
    }

    /// Routes `/grpc` (gRPC services whose package starts with `grpc`, as the health service
    /// and [`GrpcUpstream`]'s) to `addr` over HTTP/2.
    pub fn grpc(mut self, addr: SocketAddr) -> Self {
        self.grpc_upstream = Some(addr);
        self
    }

    /// Sets `common_http_protocol_options.max_connection_duration` on every connection
    /// manager.
    pub fn max_connection_duration(mut self, duration: Duration) -> Self {
        self.max_connection_duration = Some(duration);
        self
    }

    /// Adds the HTTP/3 listener [`QUIC_LISTENER`], serving `cert`.
    pub fn quic(mut self, cert: &TlsCert) -> Self {
        self.quic = Some(cert.clone());
        self
    }

    /// The config, YAML.
    pub fn yaml(&self) -> String {
        let admin_port = self.fixed.as_ref().map_or(0, |(admin, _)| *admin);
        let port = |i: usize| {
            self.fixed
                .as_ref()
                .and_then(|(_, ports)| ports.get(i).copied())
                .unwrap_or(0)
        };
        let mut yaml = format!(
            "admin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}\n\
             static_resources:\n  listeners:\n",
        );
        for (i, (name, direction)) in self.listeners.iter().enumerate() {
            let direction = direction
                .map(|d| format!("    traffic_direction: {d}\n"))
                .unwrap_or_default();
            let _ = write!(
                yaml,
                "  - name: {name}\n    address:\n      socket_address: {{ address: 127.0.0.1, port_value: {} }}\n\
                 {direction}    filter_chains:\n    - filters:\n{}",
                port(i),
                self.hcm(name, "AUTO")
            );
        }
        if let Some(cert) = &self.quic {
            let _ = write!(
                yaml,
                r#"  - name: {QUIC_LISTENER}
    address:
      socket_address: {{ protocol: UDP, address: 127.0.0.1, port_value: {quic_port} }}
    udp_listener_config:
      quic_options: {{}}
      downstream_socket_config: {{ prefer_gro: true }}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.quic
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.quic.v3.QuicDownstreamTransport
          downstream_tls_context:
            common_tls_context:
              tls_certificates:
              - certificate_chain: {{ filename: "{}" }}
                private_key: {{ filename: "{}" }}
      filters:
{}"#,
                cert.cert.display(),
                cert.key.display(),
                self.hcm(QUIC_LISTENER, "HTTP3"),
                quic_port = port(self.listeners.len()),
            );
        }
        yaml.push_str("  clusters:\n");
        yaml.push_str(&cluster("http_upstream", self.http_upstream, false));
        if let Some(grpc) = self.grpc_upstream {
            yaml.push_str(&cluster("grpc_upstream", grpc, true));
        }
        if let Some(xds) = self.ads {
            yaml.push_str(&cluster("xds", xds, true));
            yaml.push_str(
                r#"node: { id: test, cluster: test }
dynamic_resources:
  ads_config:
    api_type: GRPC
    transport_api_version: V3
    grpc_services: [{ envoy_grpc: { cluster_name: xds } }]
  lds_config: { ads: {}, resource_api_version: V3 }
  cds_config: { ads: {}, resource_api_version: V3 }
"#,
            );
        }
        yaml
    }

    /// The HTTP connection manager of the listener `name`, as an item of `filters:`.
    fn hcm(&self, name: &str, codec: &str) -> String {
        let body = &self.body;
        let mut options = String::new();
        if let Some(d) = self.max_connection_duration {
            let _ = writeln!(
                options,
                "          common_http_protocol_options: {{ max_connection_duration: {}s }}",
                d.as_secs_f64()
            );
        }
        if codec == "HTTP3" {
            options.push_str("          http3_protocol_options: {}\n");
        }
        let grpc_route = if self.grpc_upstream.is_some() {
            "              - match: { prefix: \"/grpc\" }\n                \
             route: { cluster: grpc_upstream, timeout: 0s }\n"
        } else {
            ""
        };
        format!(
            r#"      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          codec_type: {codec}
{options}          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/stream" }}
                route: {{ cluster: http_upstream, timeout: 0s }}
{grpc_route}              - match: {{ prefix: "/" }}
                direct_response: {{ status: 200, body: {{ inline_string: "{body}" }} }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
        )
    }
}

/// A static cluster `name` with the one endpoint `addr`; HTTP/2 when `http2`.
fn cluster(name: &str, addr: SocketAddr, http2: bool) -> String {
    let protocol = if http2 {
        "    typed_extension_protocol_options:\n      \
         envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \
         \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        \
         explicit_http_config: { http2_protocol_options: {} }\n"
    } else {
        ""
    };
    format!(
        r#"  - name: {name}
    type: STATIC
{protocol}    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: {ip}, port_value: {port} }} }} }}
"#,
        ip = addr.ip(),
        port = addr.port()
    )
}

/// An Envoy overload manager (for `--config-yaml`) with one `injected_resource` monitor reading
/// `pressure_file`, and, both triggered at 0.9: `disable_http_keepalive`, and `reduce_timeouts`
/// scaling `HTTP_DOWNSTREAM_CONNECTION_IDLE` and `HTTP_DOWNSTREAM_CONNECTION_MAX` down to
/// `min_timeout`. Envoy reads the file when it is moved into place: write it with
/// [`set_pressure`].
pub fn overload_manager_yaml(pressure_file: &Path, min_timeout: Duration) -> String {
    let min = min_timeout.as_secs_f64();
    format!(
        r#"overload_manager:
  refresh_interval: 0.1s
  resource_monitors:
  - name: envoy.resource_monitors.injected_resource
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.resource_monitors.injected_resource.v3.InjectedResourceConfig
      filename: "{file}"
  actions:
  - name: envoy.overload_actions.disable_http_keepalive
    triggers:
    - name: envoy.resource_monitors.injected_resource
      threshold: {{ value: 0.9 }}
  - name: envoy.overload_actions.reduce_timeouts
    triggers:
    - name: envoy.resource_monitors.injected_resource
      threshold: {{ value: 0.9 }}
    typed_config:
      "@type": type.googleapis.com/envoy.config.overload.v3.ScaleTimersOverloadActionConfig
      timer_scale_factors:
      - timer: HTTP_DOWNSTREAM_CONNECTION_IDLE
        min_timeout: {min}s
      - timer: HTTP_DOWNSTREAM_CONNECTION_MAX
        min_timeout: {min}s
"#,
        file = pressure_file.display()
    )
}

/// Writes `pressure` (e.g. `1.0`) to the injected resource's file by an atomic rename, as
/// Envoy's watch on it expects.
pub fn set_pressure(pressure_file: &Path, pressure: f64) {
    let tmp = pressure_file.with_extension("tmp");
    std::fs::write(&tmp, format!("{pressure}"))
        .and_then(|()| std::fs::rename(&tmp, pressure_file))
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", pressure_file.display()));
}

/// Envoy run directly on a bootstrap (no agent), killed when dropped: admin on the bootstrap's
/// address (port 0 is found through `--admin-address-path`), hot restart off, one worker,
/// `--drain-strategy immediate`, logs to `envoy.log` in the test's dir.
#[derive(Debug)]
pub struct EnvoyProcess {
    _child: Child,
    /// Its admin API.
    pub admin: envoy_agent_proxy::AdminClient,
    log: PathBuf,
}

impl EnvoyProcess {
    /// Starts Envoy on `bootstrap` with `extra_args` (e.g. `--config-yaml`, `--drain-time-s`)
    /// and waits until it is LIVE.
    pub async fn start(dir: &TestDir, bootstrap: &Path, extra_args: &[&str]) -> EnvoyProcess {
        let admin_file = dir.join("admin-address");
        let _ = std::fs::remove_file(&admin_file);
        let log = dir.join("envoy.log");
        let log_file = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let child = Command::new(envoy_path())
            .arg("--disable-hot-restart")
            .arg("-c")
            .arg(bootstrap)
            .arg("--admin-address-path")
            .arg(&admin_file)
            .args(["-l", "warning", "--concurrency", "1"])
            .args(["--drain-strategy", "immediate", "--base-id"])
            .arg(unique_base_id().to_string())
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start envoy: {e}"));
        let addr = crate::admin_address_from_file(&admin_file).await;
        let admin = envoy_agent_proxy::AdminClient::new(addr);
        let envoy = EnvoyProcess {
            _child: child,
            admin,
            log,
        };
        eventually("envoy to be LIVE", PATIENCE, || async {
            matches!(envoy.admin.server_info().await,
                Ok(i) if i.state == envoy_agent_proxy::ServerState::Live)
            .then_some(())
        })
        .await;
        envoy
    }

    /// The address the listener `name` is bound to (port 0 resolved).
    pub async fn listener(&self, name: &str) -> SocketAddr {
        eventually(&format!("listener {name} bound"), PATIENCE, || async {
            self.admin
                .listeners()
                .await
                .ok()?
                .into_iter()
                .find(|l| l.name == name)?
                .local_address
        })
        .await
    }

    /// What Envoy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Checks `yaml` with `envoy --mode validate`; the error names Envoy's complaint.
pub fn validate(dir: &TestDir, yaml: &str) -> Result<(), String> {
    let path = dir.write("validate.yaml", yaml);
    let output = std::process::Command::new(envoy_path())
        .args(["--mode", "validate", "-l", "error", "-c"])
        .arg(&path)
        .output()
        .map_err(|e| format!("cannot run envoy: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(lines: &[&str]) -> Vec<Kind> {
        let mut parser = nghttp_parser();
        lines
            .iter()
            .flat_map(|l| parser(l))
            .map(|e| e.kind)
            .collect()
    }

    #[test]
    fn nghttp_frames_become_events() {
        let kinds = parse(&[
            "[  0.002] recv (stream_id=1) :status: 200",
            "[  0.002] recv HEADERS frame <length=60, flags=0x04, stream_id=1>",
            "[  0.003] recv DATA frame <length=8, flags=0x00, stream_id=1>",
            "[  1.004] recv GOAWAY frame <length=8, flags=0x00, stream_id=0>",
            "          (last_stream_id=2147483647, error_code=NO_ERROR(0x00), opaque_data(0)=[])",
            "[  2.004] recv RST_STREAM frame <length=4, flags=0x00, stream_id=1>",
            "          (error_code=REFUSED_STREAM(0x07))",
            "[  2.005] recv DATA frame <length=0, flags=0x01, stream_id=3>",
            "",
        ]);
        assert_eq!(
            kinds[..4],
            [
                Kind::Response {
                    conn: 1,
                    stream_id: Some(1),
                    status: 200,
                    connection: None
                },
                Kind::Data {
                    conn: 1,
                    stream_id: Some(1),
                    bytes: 8
                },
                Kind::Goaway {
                    conn: 1,
                    last_stream_id: 2_147_483_647,
                    error_code: Some(0)
                },
                Kind::Reset {
                    conn: 1,
                    stream_id: Some(1),
                    error_code: 7
                },
            ]
        );
        assert!(matches!(kinds[5], Kind::StreamEnd { .. }));
        assert!(matches!(&kinds[6], Kind::Closed { how, .. } if how == "exit"));
    }

    #[test]
    fn json_events_are_typed() {
        let mut parse = json_lines();
        let events =
            parse(r#"{"event":"goaway","conn":2,"last_stream_id":1,"error_code":0,"t":1.5}"#);
        assert_eq!(
            events,
            [Event {
                t: 1.5,
                kind: Kind::Goaway {
                    conn: 2,
                    last_stream_id: 1,
                    error_code: Some(0)
                }
            }]
        );
        assert!(matches!(parse("garbage")[0].kind, Kind::Unparsed { .. }));
        assert!(parse("").is_empty(), "the end of the output is no event");
    }
}

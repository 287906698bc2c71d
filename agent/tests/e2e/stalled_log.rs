//! A log reader that stops reading (a stalled log collector; here a FIFO held open and not
//! read) stops neither the agent nor Envoy, in both modes, with Envoy at its default level and
//! at debug: readiness answers within a second, requests flow, a hot restart answers, and
//! SIGTERM drains and exits in time, while lines are dropped and counted; once the reader
//! reads again, the agent says how many it dropped.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use envoy_agent::client::connect;
use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::Load;
use envoy_agent_tests::{AgentProcess, PATIENCE, bootstrap_yaml_on, eventually, http_get};
use nix::sys::signal::Signal;

use crate::exit_paths::{Mode, agent_in, both_modes};
use crate::grpc::{cli, get_status};

both_modes!(
    a_stalled_log_reader_stops_neither_the_agent_nor_envoy,
    a_stalled_log_reader_stops_neither_the_agent_nor_envoy_at_debug,
);

/// The termination drain: the exit is due this long after SIGTERM.
const DRAIN: Duration = Duration::from_secs(2);

/// A FIFO held open for reading (so the agent's writes do not fail) that nobody reads until
/// [`Fifo::read_until_dropped_lines_reported`].
struct Fifo {
    path: PathBuf,
    held: File,
}

impl Fifo {
    fn new(agent: &envoy_agent_tests::AgentBuilder) -> Fifo {
        let path = agent.dir().join("log.fifo");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // Read and write: the open does not wait for a writer, and the pipe has a reader.
        let held = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        Fifo { path, held }
    }

    /// The end the agent writes to.
    fn writer(&self) -> File {
        OpenOptions::new().write(true).open(&self.path).unwrap()
    }

    /// Reads the agent's output until its `log_lines_dropped` event, then stops reading again;
    /// the event.
    async fn read_until_dropped_lines_reported(&self) -> serde_json::Value {
        let (tx, rx) = mpsc::channel();
        let reader = self.held.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(reader);
            let mut line = Vec::new();
            loop {
                line.clear();
                if lines.read_until(b'\n', &mut line).unwrap_or(0) == 0 {
                    return;
                }
                let Ok(json) = serde_json::from_slice::<serde_json::Value>(&line) else {
                    continue;
                };
                if json["event"] == "log_lines_dropped" {
                    let _ = tx.send(json);
                    return;
                }
            }
        });
        tokio::task::spawn_blocking(move || rx.recv_timeout(PATIENCE))
            .await
            .unwrap()
            .unwrap_or_else(|_| panic!("no log_lines_dropped event within {PATIENCE:?}"))
    }
}

async fn status(agent: &AgentProcess) -> pb::Status {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    let mut client = connect(&addr, PATIENCE).await.unwrap();
    get_status(&mut client).await
}

/// Waits (bounded) until the agent has dropped more than `than` lines; the count.
async fn dropped_more_than(agent: &AgentProcess, than: u64) -> u64 {
    eventually("lines dropped", PATIENCE, || async {
        let n = status(agent).await.log_lines_dropped;
        (n > than).then_some(n)
    })
    .await
}

/// What must keep working while the reader stalls: readiness answers within a second and
/// says ready, requests flow, the status answers; a node proxy hot-restarts.
async fn works_on(agent: &AgentProcess, mode: Mode, load: &Load, epoch: &mut u32) {
    let ready = tokio::time::timeout(
        Duration::from_secs(1),
        http_get(agent.status(), "/healthz/ready"),
    )
    .await
    .expect("readiness answered within 1 s with the log pipe full")
    .unwrap();
    assert_eq!(ready.status, 200, "{}", ready.body);
    let before = load.ok();
    eventually("requests answered", PATIENCE, || async {
        (load.ok() > before + 100).then_some(())
    })
    .await;
    assert_eq!(status(agent).await.state(), pb::AgentState::Live);
    if matches!(mode, Mode::NodeProxy) {
        *epoch += 1;
        let (code, out, err) = cli(agent, &["restart"]).await;
        assert_eq!(
            (code, out.trim()),
            (0, format!("epoch {epoch} is LIVE").as_str()),
            "{err}"
        );
    }
}

async fn a_stalled_log_reader_stops_neither_the_agent_nor_envoy(mode: Mode) {
    stalled(mode, None).await;
}

async fn a_stalled_log_reader_stops_neither_the_agent_nor_envoy_at_debug(mode: Mode) {
    stalled(mode, Some("debug")).await;
}

async fn stalled(mode: Mode, envoy_level: Option<&str>) {
    let builder = agent_in(mode);
    let (admin_port, listener_port) = builder
        .ports()
        .map_or((0, 0), |p| (p.admin_port, p.listener_port));
    // Every request is a line on Envoy's stdout (its access log); at debug level, more on its
    // stderr; the agent logs at debug (the kit's default) on its stderr.
    let bootstrap = bootstrap_yaml_on(admin_port, listener_port, "hello").replace(
        "          stat_prefix: hello\n",
        "          stat_prefix: hello\n          access_log:\n          - name: envoy.access_loggers.stdout\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog\n",
    );
    let fifo = Fifo::new(&builder);
    let drain = format!("{}s", DRAIN.as_secs());
    let mut builder = builder
        .bootstrap(bootstrap)
        .output(fifo.writer())
        .args(&["--termination-drain-duration", &drain]);
    if matches!(mode, Mode::NodeProxy) {
        // Each hot restart's parent gone soon: the next restart does not wait for it.
        builder = builder.args(&["--drain-time", "1s", "--parent-shutdown-time", "2s"]);
    }
    if let Some(level) = envoy_level {
        builder = builder.args(&["--proxy-log-level", level]);
    }
    let mut agent = builder.start().await;
    let listener = agent.listener("hello").await;
    let load = Load::start(listener, "/", 4, 0);

    // The pipe fills, and lines are dropped: the agent and Envoy work on.
    let dropped = dropped_more_than(&agent, 0).await;
    let mut epoch = 0;
    works_on(&agent, mode, &load, &mut epoch).await;
    assert!(status(&agent).await.log_lines_dropped >= dropped);

    // The reader comes back: the agent says how many lines it dropped, in one event.
    let said = fifo.read_until_dropped_lines_reported().await;
    assert!(said["dropped"].as_u64().unwrap_or(0) > 0, "{said}");
    assert!(said["total"].as_u64() >= said["dropped"].as_u64(), "{said}");

    // ... and stops again; SIGTERM with the pipe full drains and exits in time.
    let dropped = dropped_more_than(&agent, dropped).await;
    works_on(&agent, mode, &load, &mut epoch).await;
    let signalled = Instant::now();
    agent.signal(Signal::SIGTERM);
    let exit = agent.exit().await;
    let took = signalled.elapsed();
    assert_eq!(exit.code(), Some(0), "{exit:?}");
    // The drain, the stop, and a generous margin for a loaded machine: a frozen agent would
    // wait for its reader (for ever here).
    assert!(
        took < DRAIN + Duration::from_secs(15),
        "SIGTERM took {took:?}"
    );
    let report = load.stop().await;
    assert!(report.ok > 0);
    assert!(dropped > 0);
}

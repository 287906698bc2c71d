//! `envoy-agent-soak`: runs the release agent with the real Envoy under load from several
//! clients, inflicts a random schedule of real faults drawn from a seed, and checks invariants
//! all the time. `scripts/soak.sh` builds it and runs it; `docs/soak.md` says what each event
//! and invariant is and how to replay a seed.
//!
//! Theory of operation:
//!
//! - **The schedule** ([`schedule`]) comes from the seed alone: the end (a drain or SIGTERM),
//!   then an endless sequence of (pause, event) drawn with the weights. The run takes events
//!   from it one after another until `--duration` has passed, then ends the agent at that
//!   instant, whatever the last event left under way (a draining parent, a crash back-off).
//! - **Events** run one at a time. Each is logged with its time and details. A fault that
//!   makes failed requests unavoidable (a killed or wedged serving Envoy, a killed draining
//!   parent) opens a *window* before it is inflicted, and the event closes it once a request
//!   to the listener is answered and readiness says 200 again; each window's length is
//!   reported. Everything else must lose nothing.
//! - **The checker** ([`checks`]) is a task of its own that looks four times a second at the
//!   invariants; the first broken one is recorded with its name, time and the last events,
//!   and the run stops, prints the command that replays it, and exits 1.
//! - **The end** is judged from the agent's own facts: its JSON log's `exit` event (path and
//!   code) against the process's exit status and what ended the run, then the leftovers:
//!   Envoy processes, shared memory, sockets.
//!
//! Waits are bounded and generous (a shared 2-core machine): a bound is reached only when
//! something is really wrong, and then it is named. Pauses between events are part of the
//! schedule, never assertions.

mod checks;
mod schedule;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use envoy_agent_tests::clients::{
    ClientOptions, ClientProcess, DrainBootstrap, H2Client, H3Client, HttpUpstream,
    Mode as ClientMode, QUIC_LISTENER, TlsCert,
};
use envoy_agent_tests::{
    AgentBuilder, AgentProcess, ControlPlane, HotRestartPorts, Load, Snapshot, TestDir,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use checks::{Checker, EnvoyProc, Shared, Target, envoys, ready, serves};
use schedule::{End, Kind, Mode, Schedule};

/// A bad command line (`EX_USAGE`), as `envoy-agent` exits for one.
const EXIT_USAGE: u8 = 64;
/// The agent's wedge deadline in the soak: short, so that a long freeze is judged quickly.
const WEDGE_DEADLINE: Duration = Duration::from_secs(4);
/// Bound on "something serves again" after a fault: the crash back-off (at most
/// `--crash-backoff-max`), a fresh Envoy's start and a pre-flight fit many times over.
const SERVES_AGAIN_BOUND: Duration = Duration::from_secs(60);
/// How long a `control-plane` event keeps the control plane down: longer than a hot
/// restart's start, shorter than Envoy's 15 s initial-fetch timeout.
const CONTROL_PLANE_DOWN: Duration = Duration::from_secs(5);
/// Bound on a client subcommand (`restart` waits for the new epoch's LIVE).
const CLI_BOUND: Duration = Duration::from_secs(90);
/// The HTTP/3 client's name (the start of its failures' descriptions).
const H3_CLIENT: &str = "HTTP/3 requests";
/// The long-lived HTTP/2 stream client's name.
const STREAMS_CLIENT: &str = "HTTP/2 long-lived streams";
/// The agent's own flags for the soak: short drains, so that parents drain often while other
/// faults land, and a crash policy that recovers (see docs/soak.md for the defaults' trade).
const NODE_ARGS: &[&str] = &["--drain-time", "2s", "--parent-shutdown-time", "4s"];
/// The `unshare` wrapper that makes the agent PID 1 of its own PID namespace (a pod).
use envoy_agent_tests::POD;

/// Soaks envoy-agent: a random schedule of real faults, drawn from a seed, against the real
/// Envoy under load, with invariants checked all the time. Prints the seed first; a failing
/// run prints the command that replays it and exits 1.
#[derive(Debug, Parser)]
#[command(
    name = "envoy-agent-soak",
    after_help = "Events (--events name=weight,...; `*=W` sets all first): sighup, restart, \
                  watch-config, update-config, update-config-rejected, rejected-on-disk, \
                  sigusr1, freeze-short, freeze-long, kill-serving, kill-draining-parent, \
                  successor-pod, status-flood. docs/soak.md explains each, and the invariants.\n\
                  Envoy: $ENVOY_PATH, else the one scripts/install-envoy.sh installs; the \
                  HTTP/2 client needs the test tools ($ENVOY_AGENT_TEST_TOOLS).\n\
                  Exit status: 0 every invariant held; 1 one broke; 64 a bad command line; \
                  70 the run could not be set up."
)]
struct Cli {
    /// How long to inflict faults before the end (e.g. 90s, 10m, 1h).
    #[arg(long, default_value = "120s", value_parser = schedule::parse_duration)]
    duration: Duration,

    /// The seed of the schedule. Default: a random one (printed).
    #[arg(long)]
    seed: Option<u64>,

    /// The kind of proxy: a node proxy (hot restart) or a sidecar.
    #[arg(long, value_enum, default_value_t = Mode::Node)]
    mode: Mode,

    /// Run each agent as PID 1 of its own PID namespace (`unshare --pid --fork --mount-proc`).
    #[arg(long)]
    pid1: bool,

    /// Event weights over the mode's defaults: `name=weight,...`; `*=0,kill-serving=1` runs
    /// only kills.
    #[arg(long, value_name = "SPEC")]
    events: Option<String>,

    /// The agent's --crash-restart-limit. High by default, so that the soak's kills do not
    /// end the agent (`crash_loop`): set 5 to soak the agent's default policy.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    crash_restart_limit: u32,

    /// The agent's --crash-backoff-max (seconds).
    #[arg(long, value_name = "SECONDS", default_value_t = 2)]
    crash_backoff_max: u64,

    /// The envoy-agent binary. Default: `envoy-agent` next to this binary.
    #[arg(long, value_name = "PATH")]
    agent: Option<PathBuf>,
}

impl Cli {
    /// The command that replays this run.
    fn replay(&self, seed: u64) -> String {
        let mut command = format!(
            "scripts/soak.sh --seed {seed} --duration {}s --mode {}",
            self.duration.as_secs(),
            self.mode
        );
        if self.pid1 {
            command.push_str(" --pid1");
        }
        if let Some(events) = &self.events {
            command.push_str(&format!(" --events '{events}'"));
        }
        if self.crash_restart_limit != 1000 {
            command.push_str(&format!(
                " --crash-restart-limit {}",
                self.crash_restart_limit
            ));
        }
        if self.crash_backoff_max != 2 {
            command.push_str(&format!(" --crash-backoff-max {}", self.crash_backoff_max));
        }
        command
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE } else { 0 });
        }
    };
    let seed = cli.seed.unwrap_or_else(|| fastrand::Rng::new().u64(..));
    // First, always: a run that dies in any way can still be replayed.
    println!(
        "soak: seed {seed} ({}; replay: {})",
        cli.mode,
        cli.replay(seed)
    );
    let weights = match schedule::weights(cli.mode, cli.events.as_deref()) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("envoy-agent-soak: --events: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    println!("soak: weights {}", schedule::spec(&weights));
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("envoy-agent-soak: {e}");
            return ExitCode::from(70);
        }
    };
    match runtime.block_on(soak(&cli, seed, weights)) {
        Ok(true) => {
            println!("soak: PASSED (seed {seed})");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("soak: FAILED (seed {seed}); replay: {}", cli.replay(seed));
            ExitCode::from(1)
        }
        Err(e) => {
            println!(
                "soak: could not run: {e:#} (seed {seed}; replay: {})",
                cli.replay(seed)
            );
            ExitCode::from(70)
        }
    }
}

/// The run's fixed facts.
struct Setup {
    mode: Mode,
    pid1: bool,
    agent_binary: PathBuf,
    /// The run's own dir: bootstrap, state dir, configs for update-config, the flood script.
    dir: TestDir,
    bootstrap: PathBuf,
    ports: HotRestartPorts,
    /// The bootstrap's listeners of every traffic direction and its HTTP/3 listener, on fixed
    /// ports, routing `/stream` to the streaming upstream, with the control plane's listeners
    /// beside them (its body changes with each config).
    template: DrainBootstrap,
    /// The listener without a `traffic_direction` (as the DaemonSet's): the load's.
    listener: SocketAddr,
    /// The control plane's listener (LDS over ADS).
    xds_listener: SocketAddr,
    crash_args: Vec<String>,
}

impl Setup {
    fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// Where the agent `identity` writes its termination message (the drain's summary).
    fn termination_message(&self, identity: &str) -> PathBuf {
        self.dir.join(&format!("termination-{identity}"))
    }

    fn marker(&self) -> String {
        self.dir.path().display().to_string()
    }

    /// A valid bootstrap answering `body` on the run's fixed ports, with the control plane's
    /// listeners and clusters beside its static listeners.
    fn valid_config(&self, body: &str) -> String {
        self.template.clone().body(body).yaml()
    }

    /// Where the template's listener `name` is.
    fn at(&self, name: &str) -> anyhow::Result<SocketAddr> {
        self.template
            .listener_addr(name)
            .with_context(|| format!("the bootstrap has no listener {name}"))
    }

    /// A bootstrap Envoy rejects (an HTTP filter of a type that does not exist), valid YAML.
    fn rejected_config(&self) -> String {
        self.valid_config("rejected").replace(
            "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "type.googleapis.com/envoy.extensions.filters.http.does_not_exist.v3.Nothing",
        )
    }

    /// An agent (a pod, in node mode) on the run's bootstrap, ports and state dir.
    fn agent(&self, identity: &str) -> AgentBuilder {
        let mut builder = AgentProcess::builder(&self.agent_binary)
            // The soak reads the agent's events at info; debug would be most of its CPU.
            .env("ENVOY_AGENT_LOG_LEVEL", "info")
            .bootstrap_path(self.bootstrap.clone())
            .args(&[
                "--restart-on-crash",
                "--admin-unresponsive-deadline",
                &format!("{}s", WEDGE_DEADLINE.as_secs()),
                "--termination-message-path",
                &self.termination_message(identity).display().to_string(),
            ])
            .args(
                &self
                    .crash_args
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>(),
            );
        if self.mode == Mode::Node {
            let state = self.state_dir().display().to_string();
            builder = builder
                // Nobody owns the shared memory in the kit's sense: the agents must remove it,
                // and the end checks they did.
                .hot_restart_on(self.ports)
                .admin_at(envoy_agent_tests::node_admin_socket_at(
                    &self.state_dir(),
                    self.ports.base_id,
                ))
                .args(&[
                    "--state-dir",
                    &state,
                    "--watch-config",
                    "--identity",
                    identity,
                ])
                .args(NODE_ARGS);
        } else {
            // The soak's long-lived streams client on the OUTBOUND listener is a client whose
            // drain the end checks (every client told), not an app beside the sidecar: the app
            // rule, which would serve it untold until --app-hold, is e2e `app`'s to test.
            builder = builder.args(&["--app-hold", "off"]);
        }
        if self.pid1 {
            builder = builder.wrapper(POD);
        }
        builder
    }
}

/// The run: set-up, load, events until the duration, the end. `Ok(false)`: an invariant broke.
async fn soak(cli: &Cli, seed: u64, weights: schedule::Weights) -> anyhow::Result<bool> {
    let agent_binary = cli.agent.clone().unwrap_or_else(default_agent);
    if !agent_binary.is_file() {
        bail!("no agent binary at {}", agent_binary.display());
    }
    let dir = TestDir::new();
    // The control plane: the static listeners serve without it, the `xds` listener comes from
    // it (and readiness waits for it).
    let xds_port = envoy_agent_tests::free_port();
    let control_plane = ControlPlane::start(
        0,
        Snapshot::direct("v1", "xds", xds_port, "from the control plane"),
    )
    .await;
    // The upstream of the long-lived streams, for the whole run.
    let upstream = HttpUpstream::start_for(cli.duration + Duration::from_secs(600)).await;
    let cert = TlsCert::generate(&dir);
    let admin_port = envoy_agent_tests::free_port();
    let template = DrainBootstrap::new(upstream.addr())
        .fixed_ports(admin_port)
        // As the repository's own bootstraps: what tells a long-lived stream to go at a drain.
        .max_connection_duration(Duration::from_secs(86_400))
        .quic(&cert)
        .ads(control_plane.addr());
    let listener = template
        .listener_addr("plain")
        .context("the bootstrap has no listener plain")?;
    let ports = HotRestartPorts {
        base_id: envoy_agent_tests::unique_base_id(),
        admin_port,
        listener_port: listener.port(),
    };
    let mut setup = Setup {
        mode: cli.mode,
        pid1: cli.pid1,
        agent_binary,
        bootstrap: dir.join("bootstrap.yaml"),
        dir,
        ports,
        template,
        listener,
        xds_listener: SocketAddr::from(([127, 0, 0, 1], xds_port)),
        crash_args: vec![
            "--crash-restart-limit".into(),
            cli.crash_restart_limit.to_string(),
            "--crash-backoff-max".into(),
            format!("{}s", cli.crash_backoff_max),
        ],
    };
    std::fs::create_dir_all(setup.state_dir()).context("creating the state dir")?;
    write_atomically(&setup.bootstrap, &setup.valid_config("soak-0"))?;
    let flood_script = share_flood_script(&setup)?;

    let agent = setup.agent("pod-0").start().await;
    let target = target_of(&agent);
    println!(
        "soak: agent pid {} (status {}, grpc {}), listener {}, base id {}, dir {}",
        target.pid,
        target.status,
        target.grpc,
        setup.listener,
        ports.base_id,
        setup.marker()
    );
    if envoys(&setup.marker()).is_empty() {
        bail!("no Envoy process names the run's dir: the soak cannot count generations");
    }
    let shared = Shared::new(target);

    let load = Arc::new(Load::start(setup.listener, "/", 2, 2));
    let clients = start_clients(cli, &setup)?;
    let checker = tokio::spawn(
        Checker {
            shared: shared.clone(),
            listeners: vec![setup.listener, setup.xds_listener],
            load: load.clone(),
            clients: clients.clone(),
            marker: setup.marker(),
            generations: if cli.mode == Mode::Node { 2 } else { 1 },
            agent_binary: setup.agent_binary.clone(),
        }
        .run(),
    );

    let mut world = World {
        setup: &mut setup,
        shared: shared.clone(),
        agent,
        flood_script,
        configs: 0,
        pods: 0,
        counts: Vec::new(),
        control_plane: Arc::new(tokio::sync::Mutex::new(control_plane)),
        control_plane_down: Arc::new(std::sync::atomic::AtomicBool::new(false)),
    };
    let mut schedule = Schedule::new(seed, weights);
    inflict_until(&mut world, &mut schedule, cli.duration).await?;

    // The end: the checker stops first (a drain makes readiness 503 and cuts requests).
    shared.state().ending = true;
    let _ = checker.await;
    let load = Arc::try_unwrap(load).map_err(|_| anyhow::anyhow!("the load is still shared"))?;
    let report = load.stop().await;
    print_client_counts(&clients);
    drop(clients);
    let passed_so_far = !shared.failed();
    let end = schedule.end;
    let ended_well = if passed_so_far {
        world.end(end).await?
    } else {
        false
    };
    world.summary(&report);
    // A broken run kills the agent (dropped: SIGKILL, and Envoy follows it); anything of the run
    // still running then (a stopped Envoy does not act on SIGTERM) must not outlive it.
    drop(world);
    leave_nothing_behind(&setup, ports);
    Ok(passed_so_far && ended_well && !shared.failed())
}

/// The clients beside the load, each on a listener of its own (every traffic direction): HTTP/2
/// requests, a long-lived HTTP/2 stream through the upstream, HTTP/3 requests.
fn start_clients(
    cli: &Cli,
    setup: &Setup,
) -> anyhow::Result<Vec<(&'static str, Arc<ClientProcess>)>> {
    let lasting = |interval: u64, path: Option<&str>| ClientOptions {
        interval: Duration::from_millis(interval),
        duration: cli.duration + Duration::from_secs(300),
        path: path.map(str::to_owned),
        ..ClientOptions::default()
    };
    Ok(vec![
        (
            "HTTP/2 requests",
            Arc::new(
                H2Client::start(
                    ClientMode::Requests,
                    setup.at("inbound")?,
                    &lasting(200, None),
                )
                .0,
            ),
        ),
        (
            STREAMS_CLIENT,
            Arc::new(
                H2Client::start(
                    ClientMode::Streams,
                    setup.at("outbound")?,
                    &lasting(200, Some("/stream?seconds=20")),
                )
                .0,
            ),
        ),
        (
            H3_CLIENT,
            Arc::new(
                H3Client::start(
                    ClientMode::Requests,
                    setup.at(QUIC_LISTENER)?,
                    &lasting(200, None),
                )
                .0,
            ),
        ),
    ])
}

/// What each client saw, one line each.
fn print_client_counts(clients: &[(&'static str, Arc<ClientProcess>)]) {
    for (name, client) in clients {
        let events = client.events();
        let count = |pick: fn(&envoy_agent_tests::clients::Kind) -> bool| {
            events.iter().filter(|e| pick(&e.kind)).count()
        };
        use envoy_agent_tests::clients::Kind as K;
        println!(
            "soak: {name}: {} responses, {} streams served whole, {} failures, {} GOAWAYs, {} \
             connections{}",
            count(|k| matches!(k, K::Response { .. })),
            count(|k| matches!(k, K::StreamEnd { .. })),
            count(|k| matches!(k, K::Failure { .. })),
            count(|k| matches!(k, K::Goaway { .. })),
            count(|k| matches!(k, K::Connected { .. })),
            if client.ended() {
                " (it ended early)"
            } else {
                ""
            }
        );
    }
}

/// Anything of the run still running (a stopped Envoy does not act on SIGTERM) is killed, and
/// no shared memory is left behind for the next run on this machine.
fn leave_nothing_behind(setup: &Setup, ports: HotRestartPorts) {
    let marker = setup.marker();
    for envoy in envoys(&marker) {
        let _ = kill(Pid::from_raw(envoy.pid as i32), Signal::SIGKILL);
        let _ = kill(Pid::from_raw(envoy.pid as i32), Signal::SIGCONT);
    }
    for base_id in [ports.base_id, ports.base_id + 1] {
        let _ = std::fs::remove_file(shm(base_id));
    }
}

/// Draws the schedule's events and inflicts each until the duration ends or an invariant
/// broke.
async fn inflict_until(
    world: &mut World<'_>,
    schedule: &mut Schedule,
    duration: Duration,
) -> anyhow::Result<()> {
    let shared = world.shared.clone();
    let started = Instant::now();
    shared.log(&format!(
        "schedule: ends with {} at {:?}",
        schedule.end, duration
    ));
    loop {
        let (gap, kind) = schedule.next_event();
        let left = duration.saturating_sub(started.elapsed());
        if gap >= left {
            tokio::time::sleep(left).await;
            return Ok(());
        }
        tokio::time::sleep(gap).await;
        if shared.failed() {
            return Ok(());
        }
        world.inflict(kind).await?;
        if shared.failed() {
            return Ok(());
        }
    }
}

fn default_agent() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("envoy-agent")))
        .unwrap_or_else(|| PathBuf::from("envoy-agent"))
}

fn shm(base_id: u32) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/envoy_shared_memory_{}",
        u64::from(base_id) * 10
    ))
}

fn target_of(agent: &AgentProcess) -> Target {
    Target {
        pid: agent.agent_pid(),
        status: agent.status(),
        grpc: agent.grpc.clone(),
        since: Instant::now(),
    }
}

/// Writes `contents` to `path` by a rename, as a ConfigMap update does: the watch never sees
/// half a file.
fn write_atomically(path: &Path, contents: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming onto {}", path.display()))
}

/// Copies the kit's flood script where uid 65534 can read it (the run's dir is private).
fn share_flood_script(setup: &Setup) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let shared = setup.dir.join("nobody");
    std::fs::create_dir_all(&shared)?;
    let script = shared.join("flood.py");
    std::fs::copy(
        envoy_agent_tests::repo_root().join("tests/flood.py"),
        &script,
    )
    .context("copying tests/flood.py")?;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644))?;
    for dir in [setup.dir.path(), shared.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(script)
}

/// The run while it runs: the agent watched, and what the events need.
struct World<'a> {
    setup: &'a mut Setup,
    shared: Arc<Shared>,
    agent: AgentProcess,
    flood_script: PathBuf,
    /// Configs written so far (each has a body of its own).
    configs: u32,
    /// Successor pods started so far.
    pods: u32,
    /// Events run, by kind.
    counts: Vec<(Kind, u32)>,
    control_plane: Arc<tokio::sync::Mutex<ControlPlane>>,
    /// The control plane is down (a `control-plane` event brings it back by itself).
    control_plane_down: Arc<std::sync::atomic::AtomicBool>,
}

impl World<'_> {
    fn signal(&self, signal: Signal) {
        let pid = self.shared.target().pid;
        // A failure to signal is the agent gone: the checker names that.
        let _ = kill(Pid::from_raw(pid as i32), signal);
    }

    fn next_body(&mut self) -> String {
        self.configs += 1;
        format!("soak-{}", self.configs)
    }

    /// Runs `envoy-agent <args>` against the watched agent; its exit code and first line.
    async fn cli(&self, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
        let grpc = self.shared.target().grpc;
        let run = tokio::process::Command::new(&self.setup.agent_binary)
            .args(["--grpc-address", &grpc])
            .args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let Ok(out) = tokio::time::timeout(CLI_BOUND, run).await else {
            self.shared.fail(
                "cli_answers",
                &format!(
                    "`envoy-agent {}` did not answer within {CLI_BOUND:?}",
                    args.join(" ")
                ),
            );
            return Ok((None, String::new()));
        };
        let out = out.context("running envoy-agent")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        // The first line says it; Envoy's reasons run long.
        let first: String = text
            .lines()
            .next()
            .unwrap_or_default()
            .chars()
            .take(240)
            .collect();
        Ok((out.status.code(), first))
    }

    async fn inflict(&mut self, kind: Kind) -> anyhow::Result<()> {
        match self.counts.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => self.counts.push((kind, 1)),
        }
        let envoys_now = envoys(&self.setup.marker());
        let newest = envoys_now.last().copied();
        match kind {
            Kind::Sighup => {
                self.shared.event("sighup: SIGHUP to the agent");
                self.signal(Signal::SIGHUP);
            }
            Kind::Sigusr1 => {
                self.shared.event("sigusr1: SIGUSR1 to the agent");
                self.signal(Signal::SIGUSR1);
            }
            Kind::Restart => {
                self.shared.event("restart: `envoy-agent restart`");
                let (code, line) = self.cli(&["restart", "--reason", "soak"]).await?;
                self.shared
                    .log(&format!("restart: answered {code:?}: {line}"));
            }
            Kind::WatchConfig => {
                let body = self.next_body();
                self.shared.event(&format!(
                    "watch-config: the bootstrap rewritten (body {body})"
                ));
                write_atomically(&self.setup.bootstrap, &self.setup.valid_config(&body))?;
            }
            Kind::UpdateConfig => {
                let body = self.next_body();
                let file = self.setup.dir.join(&format!("update-{body}.yaml"));
                std::fs::write(&file, self.setup.valid_config(&body))?;
                self.shared
                    .event(&format!("update-config: a valid config (body {body})"));
                let path = file.display().to_string();
                let (code, line) = self.cli(&["update-config", &path]).await?;
                self.shared
                    .log(&format!("update-config: answered {code:?}: {line}"));
            }
            Kind::UpdateConfigRejected => self.update_config_rejected().await?,
            Kind::RejectedOnDisk => self.rejected_on_disk().await?,
            Kind::FreezeShort => self.freeze_short(newest).await,
            Kind::FreezeLong => self.freeze_long().await,
            Kind::KillServing => self.kill_serving(newest, &envoys_now).await,
            Kind::ControlPlane => self.control_plane_down().await,
            Kind::FreezeAgent => self.freeze_agent().await,
            Kind::KillDrainingParent => self.kill_draining_parent().await?,
            Kind::SuccessorPod => self.successor_pod().await?,
            Kind::StatusFlood => self.status_flood().await?,
        }
        Ok(())
    }

    /// update-config with a config Envoy rejects: refused, and the bootstrap on disk untouched.
    async fn update_config_rejected(&mut self) -> anyhow::Result<()> {
        let file = self.setup.dir.join("rejected.yaml");
        std::fs::write(&file, self.setup.rejected_config())?;
        let before = std::fs::read_to_string(&self.setup.bootstrap)?;
        self.shared
            .event("update-config-rejected: a config Envoy rejects");
        let path = file.display().to_string();
        let (code, line) = self.cli(&["update-config", &path]).await?;
        self.shared.log(&format!(
            "update-config-rejected: answered {code:?}: {line}"
        ));
        if code == Some(0) {
            self.shared.fail(
                "rejected_config_refused",
                &format!("update-config accepted a config Envoy rejects: {line}"),
            );
        }
        if std::fs::read_to_string(&self.setup.bootstrap)? != before {
            self.shared.fail(
                "rejected_config_refused",
                "a refused update-config changed the bootstrap on disk",
            );
        }
        Ok(())
    }

    /// A config Envoy rejects written over the bootstrap, then a valid one again.
    async fn rejected_on_disk(&mut self) -> anyhow::Result<()> {
        self.shared
            .event("rejected-on-disk: a config Envoy rejects written over the bootstrap");
        write_atomically(&self.setup.bootstrap, &self.setup.rejected_config())?;
        // Long enough for the watch to see it and its pre-flight to refuse it; what
        // must hold meanwhile (the serving epoch serves) the checker checks.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let body = self.next_body();
        self.shared.log(&format!(
            "rejected-on-disk: a valid bootstrap again (body {body})"
        ));
        write_atomically(&self.setup.bootstrap, &self.setup.valid_config(&body))?;
        Ok(())
    }

    /// The newest Envoy stopped for half the wedge deadline: no wedge.
    async fn freeze_short(&mut self, newest: Option<EnvoyProc>) {
        let Some(envoy) = newest else {
            self.shared.event("freeze-short: skipped, no Envoy runs");
            return;
        };
        let freeze = WEDGE_DEADLINE / 2;
        self.shared.event(&format!(
            "freeze-short: SIGSTOP Envoy pid {} (epoch {}) for {freeze:?}",
            envoy.pid, envoy.epoch
        ));
        // Readiness may rightly say 200 for a moment while Envoy cannot answer.
        self.shared.serve_check_off();
        let _ = kill(Pid::from_raw(envoy.pid as i32), Signal::SIGSTOP);
        tokio::time::sleep(freeze).await;
        let _ = kill(Pid::from_raw(envoy.pid as i32), Signal::SIGCONT);
        self.shared.serve_check_on(Duration::from_secs(2));
        self.shared.log("freeze-short: SIGCONT");
    }

    /// The serving Envoy stopped past the wedge deadline: killed, and served again.
    async fn freeze_long(&mut self) {
        // The serving Envoy: the admin watchdog judges a LIVE one. A node's newest epoch
        // may still be starting (its parent serving): frozen, only the handoff deadline
        // (60 s) gives it up, which is not what this event checks.
        let Some(envoy) = self.serving_envoy().await else {
            self.shared
                .event("freeze-long: skipped, no Envoy LIVE in 30s");
            return;
        };
        self.shared.event(&format!(
            "freeze-long: SIGSTOP Envoy pid {} (epoch {}) past the {WEDGE_DEADLINE:?} \
             deadline",
            envoy.pid, envoy.epoch
        ));
        self.shared.serve_check_off();
        let window = self.shared.open_window("freeze-long");
        let _ = kill(Pid::from_raw(envoy.pid as i32), Signal::SIGSTOP);
        let killed = self
            .wait_gone(envoy.pid, WEDGE_DEADLINE + Duration::from_secs(20))
            .await;
        // Continue it in any case: a stopped Envoy left behind would hang the end.
        let _ = kill(Pid::from_raw(envoy.pid as i32), Signal::SIGCONT);
        if !killed {
            self.shared.fail(
                "wedge_killed",
                &format!(
                    "Envoy pid {} stayed stopped past the deadline and was not killed",
                    envoy.pid
                ),
            );
        }
        self.serves_again(window, "freeze-long").await;
        self.shared.serve_check_on(Duration::from_secs(2));
    }

    /// SIGKILL to the newest Envoy: served again (a parent that drains is kept).
    async fn kill_serving(&mut self, newest: Option<EnvoyProc>, envoys_now: &[EnvoyProc]) {
        let Some(envoy) = newest else {
            self.shared.event("kill-serving: skipped, no Envoy runs");
            return;
        };
        self.shared.event(&format!(
            "kill-serving: SIGKILL Envoy pid {} (epoch {}; {} Envoys run)",
            envoy.pid,
            envoy.epoch,
            envoys_now.len()
        ));
        // Two Envoys: the newest is LIVE (its parent drains: known finding 1) or still
        // starting (its parent serves); the admin socket answers for the LIVE one.
        let what = if envoys_now.len() < 2 {
            "kill-serving"
        } else if self.agent.admin.server_info().await.is_ok_and(|i| {
            i.state == envoy_agent_proxy::ServerState::Live && i.restart_epoch == envoy.epoch
        }) {
            "kill-serving (a parent drains)"
        } else {
            "kill-serving (the child starts)"
        };
        let parent = (what == "kill-serving (a parent drains)")
            .then(|| envoys_now.first().copied())
            .flatten();
        let window = self.shared.open_window(what);
        let _ = kill(Pid::from_raw(envoy.pid as i32), Signal::SIGKILL);
        self.wait_gone(envoy.pid, Duration::from_secs(10)).await;
        match parent {
            // The kept parent (finding 1's fix) drops the QUIC packets that reach it
            // for connections it does not hold (its child is dead; finding 8's fix
            // stands in for it): an HTTP/3 client whose connection hashes to its
            // socket hears nothing until it is gone. Only that client's failures are
            // unavoidable that long; a cut stream, say, is a finding.
            Some(parent) => {
                let kept = self
                    .shared
                    .open_window_of("kill-serving (the kept parent's QUIC)", Some(H3_CLIENT));
                self.serves_again(window, what).await;
                self.wait_gone(parent.pid, Duration::from_secs(30)).await;
                let length = self.shared.close_window(kept);
                self.shared
                    .log(&format!("{what}: the kept parent gone after {length:?}"));
            }
            None => self.serves_again(window, what).await,
        }
    }

    /// A neighbour (uid 65534) holds 300 connections to the status server for 4 s.
    async fn status_flood(&mut self) -> anyhow::Result<()> {
        let status = self.shared.target().status;
        self.shared.event(&format!(
            "status-flood: uid 65534 holds 300 connections to the status server {status} \
             for 4s"
        ));
        let out = tokio::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg("/usr/bin/python3")
            .arg(&self.flood_script)
            .args([
                &status.ip().to_string(),
                &status.port().to_string(),
                "300",
                "4",
            ])
            .kill_on_drop(true)
            .output();
        self.shared.state().flooding = true;
        let out = tokio::time::timeout(Duration::from_secs(30), out).await;
        // The flood's sockets close as it exits; the agent's side a moment later.
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.shared.state().flooding = false;
        match out {
            Ok(Ok(out)) => self.shared.log(&format!(
                "status-flood: {}",
                String::from_utf8_lossy(&out.stdout).trim()
            )),
            Ok(Err(e)) => bail!("cannot run the flood (setpriv, python3): {e}"),
            Err(_) => self
                .shared
                .log("status-flood: the flood did not end in 30s"),
        }
        Ok(())
    }

    /// Stops the control plane for [`CONTROL_PLANE_DOWN`] in the background: the events drawn
    /// next run while it is down.
    async fn control_plane_down(&self) {
        use std::sync::atomic::Ordering;
        if self.control_plane_down.swap(true, Ordering::SeqCst) {
            self.shared
                .event("control-plane: skipped, it is down already");
            return;
        }
        self.shared.event(&format!(
            "control-plane: stopped for {CONTROL_PLANE_DOWN:?} (its listener serves on from \
             what Envoy has)"
        ));
        self.control_plane.lock().await.stop().await;
        let (control_plane, down, shared) = (
            self.control_plane.clone(),
            self.control_plane_down.clone(),
            self.shared.clone(),
        );
        tokio::spawn(async move {
            tokio::time::sleep(CONTROL_PLANE_DOWN).await;
            control_plane.lock().await.restart().await;
            down.store(false, Ordering::SeqCst);
            shared.log("control-plane: serving again");
        });
    }

    /// Waits (bounded) for a control plane that is down to come back: a successor pod never
    /// takes over while it is down (by design), and its start is bounded.
    async fn control_plane_up(&self) {
        let deadline = Instant::now() + CONTROL_PLANE_DOWN + Duration::from_secs(10);
        while self
            .control_plane_down
            .load(std::sync::atomic::Ordering::SeqCst)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGSTOP to the agent past the wedge deadline, then SIGCONT. Envoy serves throughout
    /// (no window: a failed request fails the run), and the agent judges nothing from its own
    /// stall: no wedge, no Envoy stopped.
    async fn freeze_agent(&self) {
        let pid = self.shared.target().pid;
        let freeze = WEDGE_DEADLINE + Duration::from_secs(3);
        let misjudged = |agent: &AgentProcess| {
            // A wedge, or an epoch the agent killed (overdue, wedged): what a stall may make it
            // decide wrongly. A parent terminated by its child, a restart's, is no misjudgment.
            agent.events("wedge").len()
                + agent
                    .events("epoch_exited")
                    .iter()
                    .filter(|e| e["how"].as_str().is_some_and(|h| h.contains("killed")))
                    .count()
        };
        let before = misjudged(&self.agent);
        self.shared.event(&format!(
            "freeze-agent: SIGSTOP the agent (pid {pid}) for {freeze:?}, past the \
             {WEDGE_DEADLINE:?} wedge deadline"
        ));
        // Known finding 10 (docs/soak.md): a hot restart the agent started runs on in Envoy
        // while the agent is stopped; a parent that drains and is terminated by its child
        // within the stall (the soak's parent-shutdown time is 4 s) never got the drain notice
        // the agent gives, so a long-lived stream on it is cut untold. Only that client's
        // failures are unavoidable while the agent is stopped.
        let untold = (self.setup.mode == Mode::Node).then(|| {
            self.shared.open_window_of(
                "freeze-agent (a draining parent's long-lived streams untold)",
                Some(STREAMS_CLIENT),
            )
        });
        self.shared.agent_frozen(true);
        self.signal(Signal::SIGSTOP);
        tokio::time::sleep(freeze).await;
        self.signal(Signal::SIGCONT);
        self.shared.agent_frozen(false);
        self.shared.log("freeze-agent: SIGCONT");
        if let Some(window) = untold {
            self.shared.close_window(window);
        }
        // What the agent does once back: a misjudged wedge shows within a few watchdog polls.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let after = misjudged(&self.agent);
        if after > before {
            self.shared.fail(
                "agent_freeze_harmless",
                &format!(
                    "after the agent's own stall: {} new wedges or Envoys it killed",
                    after - before
                ),
            );
        }
    }

    /// The newest Envoy once it serves: LIVE on the admin address at its epoch (a sidecar's
    /// one Envoy: once ready). Waits for it (bounded).
    async fn serving_envoy(&self) -> Option<checks::EnvoyProc> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(newest) = envoys(&self.setup.marker()).last().copied() {
                let live = match self.setup.mode {
                    Mode::Node => self.agent.admin.server_info().await.is_ok_and(|i| {
                        i.state == envoy_agent_proxy::ServerState::Live
                            && i.restart_epoch == newest.epoch
                    }),
                    Mode::Sidecar => ready(self.shared.target().status).await,
                };
                if live {
                    return Some(newest);
                }
            }
            if Instant::now() >= deadline || self.shared.failed() {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A hot restart, then SIGKILL to the draining parent once the child is LIVE.
    async fn kill_draining_parent(&mut self) -> anyhow::Result<()> {
        let marker = self.setup.marker();
        if envoys(&marker).len() < 2 {
            self.shared
                .event("kill-draining-parent: SIGHUP first, for a parent that drains");
            self.signal(Signal::SIGHUP);
        }
        // The child LIVE beside its parent: the admin socket answers at the newest epoch.
        let deadline = Instant::now() + Duration::from_secs(30);
        let pair = loop {
            let now = envoys(&marker);
            if now.len() == 2 {
                let info = self.agent.admin.server_info().await.ok();
                if info.is_some_and(|i| {
                    i.state == envoy_agent_proxy::ServerState::Live
                        && Some(i.restart_epoch) == now.last().map(|e| e.epoch)
                }) {
                    break Some((now[0], now[1]));
                }
            }
            if Instant::now() >= deadline || self.shared.failed() {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let Some((parent, child)) = pair else {
            self.shared
                .event("kill-draining-parent: skipped, no LIVE child beside a parent in 30s");
            return Ok(());
        };
        self.shared.event(&format!(
            "kill-draining-parent: SIGKILL parent pid {} (epoch {}); child epoch {} serves",
            parent.pid, parent.epoch, child.epoch
        ));
        let window = self.shared.open_window("kill-draining-parent");
        let _ = kill(Pid::from_raw(parent.pid as i32), Signal::SIGKILL);
        self.wait_gone(parent.pid, Duration::from_secs(10)).await;
        self.serves_again(window, "kill-draining-parent").await;
        Ok(())
    }

    /// A successor pod takes over; the old one is told to stop and must hand over.
    async fn successor_pod(&mut self) -> anyhow::Result<()> {
        self.control_plane_up().await;
        self.pods += 1;
        let name = format!("pod-{}", self.pods);
        self.shared
            .event(&format!("successor-pod: {name} starts on the state dir"));
        // start() returns once the new pod's Envoy is LIVE and its marker exists.
        let next = self.setup.agent(&name).start().await;
        let old = std::mem::replace(&mut self.agent, next);
        self.shared.retarget(target_of(&self.agent));
        self.shared.log(&format!(
            "successor-pod: {name} serves (agent pid {}); SIGTERM to its predecessor",
            self.shared.target().pid
        ));
        let mut old = old;
        old.signal_agent(Signal::SIGTERM);
        let status = old.exit().await;
        let exit = old.events("exit").pop();
        let path = exit
            .as_ref()
            .and_then(|e| e.get("exit_path")?.as_str().map(str::to_owned));
        self.shared.log(&format!(
            "successor-pod: the predecessor exited {:?}, path {path:?}",
            status.code()
        ));
        let summary = std::fs::read_to_string(
            self.setup
                .termination_message(&format!("pod-{}", self.pods - 1)),
        )
        .unwrap_or_default();
        if !summary.starts_with("envoy-agent exited 0: handed_over (") {
            self.shared.fail(
                "summary_true",
                &format!("the predecessor of {name}'s termination message: {summary:?}"),
            );
        }
        if status.code() != Some(0) || path.as_deref() != Some("handed_over") {
            self.shared.fail(
                "handover_exit",
                &format!(
                    "the predecessor of {name} exited {:?} by {path:?}, not 0 by handed_over",
                    status.code()
                ),
            );
        }
        Ok(())
    }

    /// Waits (bounded) until process `pid` is gone; whether it is.
    async fn wait_gone(&self, pid: u32, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        while envoy_agent_tests::process_alive(pid) {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Waits (bounded) until the listener answers and readiness says 200, then closes the
    /// window and reports its length.
    async fn serves_again(&self, window: usize, what: &str) {
        let deadline = Instant::now() + SERVES_AGAIN_BOUND;
        loop {
            let status = self.shared.target().status;
            if serves(self.setup.listener).await
                && serves(self.setup.xds_listener).await
                && ready(status).await
            {
                let length = self.shared.close_window(window);
                self.shared
                    .log(&format!("{what}: serving again after {length:?}"));
                return;
            }
            // Another invariant broke meanwhile (the agent gone, say): nothing to wait for.
            if self.shared.failed() {
                self.shared.close_window(window);
                return;
            }
            if Instant::now() >= deadline {
                self.shared.close_window(window);
                self.shared.fail(
                    "serves_again",
                    &format!("{what}: nothing served within {SERVES_AGAIN_BOUND:?}"),
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The watched agent's identity.
    fn identity(&self) -> String {
        format!("pod-{}", self.pods)
    }

    /// The termination message (the drain's summary) in `file` says what happened: the exit
    /// code and path, a shutdown from `reason` that took no longer than `took` (as measured
    /// here, from before the end began, so a little longer). `Err`: what is untrue.
    fn summary_true(
        &self,
        file: &Path,
        code: Option<i32>,
        path: Option<&str>,
        reason: &str,
        took: Duration,
    ) -> Result<(), String> {
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("no termination message at {}: {e}", file.display()))?;
        self.shared
            .log(&format!("end: the termination message: {text:?}"));
        let first = text.lines().next().unwrap_or_default();
        let (Some(code), Some(path)) = (code, path) else {
            return Err(format!("no exit code or path to hold {first:?} against"));
        };
        let said = format!("envoy-agent exited {code}: {path} (");
        if !first.starts_with(&said) {
            return Err(format!("it says {first:?}, not {said:?}..."));
        }
        let Some(shutdown) = text.lines().find_map(|l| l.strip_prefix("shutdown took ")) else {
            return Err(format!("it says nothing of the shutdown: {text:?}"));
        };
        let (seconds, from) = shutdown
            .split_once("s from ")
            .ok_or_else(|| format!("unreadable: {shutdown:?}"))?;
        let seconds: f64 = seconds
            .parse()
            .map_err(|_| format!("unreadable: {shutdown:?}"))?;
        // Its tenths are rounded.
        if seconds > took.as_secs_f64() + 0.1 {
            return Err(format!(
                "the shutdown took {seconds}s by it, but the whole end took {took:?}"
            ));
        }
        if from != reason {
            return Err(format!(
                "the shutdown came from {from:?} by it, not {reason:?}"
            ));
        }
        Ok(())
    }

    /// Ends the run as drawn; judges the exit and what is left. Whether all held.
    async fn end(&mut self, end: End) -> anyhow::Result<bool> {
        let began = Instant::now();
        let envoys_at_end = envoys(&self.setup.marker()).len();
        self.shared
            .event(&format!("end: {end} ({envoys_at_end} Envoys run)"));
        let expected: &[&str] = match end {
            End::Drain => {
                let (code, line) = self.cli(&["drain"]).await?;
                self.shared
                    .log(&format!("end: drain answered {code:?}: {line}"));
                // The drain under way before the signal: what an operator's preStop does. The
                // signal continues the drain's timeline to its deadline (issue 49).
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.signal(Signal::SIGTERM);
                &["drain_time_elapsed", "stopped_while_recovering"]
            }
            End::Sigterm => {
                self.signal(Signal::SIGTERM);
                &["drain_time_elapsed", "stopped_while_recovering"]
            }
        };
        let status = self.agent.exit().await;
        let exit = self.agent.events("exit").pop();
        let path = exit
            .as_ref()
            .and_then(|e| e.get("exit_path")?.as_str().map(str::to_owned));
        let logged_code = exit.as_ref().and_then(|e| e.get("code")?.as_i64());
        self.shared.log(&format!(
            "end: the agent exited {:?}; its exit event: path {path:?}, code {logged_code:?}",
            status.code()
        ));
        let mut held = true;
        if status.code() != Some(0)
            || logged_code != Some(0)
            || !path.as_deref().is_some_and(|p| expected.contains(&p))
        {
            self.shared.fail(
                "exit_matches_end",
                &format!(
                    "after {end}: exit status {:?}, exit event path {path:?} code \
                     {logged_code:?}; expected code 0 by one of {expected:?}",
                    status.code()
                ),
            );
            held = false;
        }
        if let Err(why) = self.summary_true(
            &self.setup.termination_message(&self.identity()),
            status.code(),
            path.as_deref(),
            match end {
                End::Drain => "gRPC Drain",
                End::Sigterm => "SIGTERM",
            },
            began.elapsed(),
        ) {
            self.shared.fail("summary_true", &why);
            held = false;
        }
        // Every Envoy reaped: the agent waited for them before it exited; a moment for the
        // kernel to tear down what PID 1's namespace held.
        let deadline = Instant::now() + Duration::from_secs(10);
        let left = loop {
            let left = envoys(&self.setup.marker());
            if left.is_empty() || Instant::now() >= deadline {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if !left.is_empty() {
            self.shared.fail(
                "envoys_reaped",
                &format!("Envoys left after the agent: {left:?}"),
            );
            held = false;
        }
        let mut leftovers = Vec::new();
        if self.setup.mode == Mode::Node {
            for base_id in [self.setup.ports.base_id, self.setup.ports.base_id + 1] {
                if shm(base_id).exists() {
                    leftovers.push(shm(base_id).display().to_string());
                }
            }
        }
        leftovers.extend(sockets_under(self.setup.dir.path()));
        leftovers.extend(sockets_under(self.agent.dir.path()));
        // The third finding (docs/soak.md), fixed: the family's shared memory segment and
        // Envoy's hot-restart and admin sockets in <state dir>/hot-restart are removed by the
        // last agent, so a clean end leaves nothing.
        if !leftovers.is_empty() {
            self.shared.fail(
                "nothing_left_behind",
                &format!("left behind: {leftovers:?}"),
            );
            held = false;
        }
        if let Some(why) = lock_held(&self.setup.state_dir().join("epoch.lock")) {
            self.shared.fail("nothing_left_behind", &why);
            held = false;
        }
        Ok(held)
    }

    fn summary(&self, load: &envoy_agent_tests::LoadReport) {
        // How the watched agent ended, in its own words, when it did (an early exit included).
        if let Some(exit) = self.agent.events("exit").pop() {
            println!("soak: the agent's exit event: {exit}");
        }
        let state = self.shared.state();
        println!(
            "soak: load {} answered, {} failed (first errors: {:?})",
            load.ok,
            load.failed,
            load.errors.iter().take(3).collect::<Vec<_>>()
        );
        let counts: Vec<String> = self
            .counts
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect();
        println!("soak: events run: {}", counts.join(" "));
        for w in &state.windows {
            let length = w
                .closed
                .map(|c| format!("{}ms", c.saturating_sub(w.opened)))
                .unwrap_or_else(|| "never closed".to_owned());
            println!(
                "soak: window {}: {length}, {} failed requests",
                w.what, w.failures
            );
        }
        let r = &state.resources;
        // A successor pod watched for less than the warm-up has no "after" yet.
        let after = if r.max == (0, 0) {
            "no sample after it".to_owned()
        } else {
            format!("at most {} KiB and {} files after it", r.max.0, r.max.1)
        };
        println!(
            "soak: the last agent's footprint: RSS {} KiB and {} files in the warm-up, {after}, \
             {} KiB and {} files last",
            r.base.0, r.base.1, r.last.0, r.last.1
        );
    }
}

/// Why the node's epoch lock is still held after every agent exited, if it is (the file
/// itself stays: a lock file is taken, not created, by each agent).
fn lock_held(path: &Path) -> Option<String> {
    use nix::fcntl::{Flock, FlockArg};
    let file = std::fs::File::open(path).ok()?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(_) => None,
        Err((_, e)) => Some(format!("{} is still locked ({e})", path.display())),
    }
}

/// Unix sockets left under `dir` (the agents' gRPC sockets, Envoy's hot-restart channel and
/// admin socket in the state dir).
fn sockets_under(dir: &Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(ft) = entry.file_type() else { continue };
            if ft.is_dir() {
                stack.push(entry.path());
            } else if ft.is_socket() {
                found.push(entry.path().display().to_string());
            }
        }
    }
    found
}

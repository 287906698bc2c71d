//! `--shutdown-budget` (issue 31): the one deadline from SIGTERM to exit, split over the
//! shutdown's phases at start. End to end with the real Envoy: the split is logged, the drain
//! gets what the other phases leave (its deadline in the status), and a configured phase that
//! cannot fit is refused at start with exit 64, naming the flags, from a flag or the
//! environment. The split's arithmetic is unit-tested in `agent/src/config/budget.rs`.

use envoy_agent::client::connect;
use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::{AgentProcess, PATIENCE, eventually, process_alive};
use nix::sys::signal::Signal;

use crate::exit_paths::{Mode, agent_in};
use crate::grpc::get_status;

async fn status(agent: &AgentProcess) -> pb::Status {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    let mut client = connect(&addr, PATIENCE).await.unwrap();
    get_status(&mut client).await
}

fn seconds(d: &Option<prost_types::Duration>) -> f64 {
    let d = d.as_ref().unwrap();
    d.seconds as f64 + f64::from(d.nanos) / 1e9
}

#[tokio::test]
async fn the_drain_gets_what_the_budget_leaves_and_the_split_is_said_at_start() {
    let mut agent = agent_in(Mode::Sidecar)
        .args(&["--shutdown-budget", "6s", "--stop-grace", "1s"])
        .start()
        .await;
    let envoy = agent.envoy_pid();
    // 6 s less the stop grace (1 s) and the agent's own exit (2 s): 3 s to drain.
    let split = agent
        .wait_event("shutdown_budget", "budget_ms", "6000")
        .await;
    assert_eq!(split["drain_ms"], 3000, "{split}");
    assert_eq!(split["stop_grace_ms"], 1000, "{split}");
    assert_eq!(split["exit_ms"], 2000, "{split}");
    assert_eq!(split["drain_delay_ms"], 0, "{split}");
    let settings = status(&agent).await.settings.unwrap();
    assert_eq!(seconds(&settings.shutdown_budget), 6.0);
    assert_eq!(seconds(&settings.termination_drain_duration), 3.0);

    agent.signal(Signal::SIGTERM);
    let drain = eventually("the drain in the status", PATIENCE, || async {
        status(&agent).await.drain
    })
    .await;
    let (start, deadline) = (drain.start_time.unwrap(), drain.deadline.unwrap());
    let window =
        (deadline.seconds - start.seconds) as f64 + f64::from(deadline.nanos - start.nanos) / 1e9;
    assert!(
        (window - 3.0).abs() < 0.001,
        "the drain's deadline: {window} s"
    );
    assert_eq!(agent.exit().await.code(), Some(0));
    agent
        .wait_event("exit", "exit_path", "drain_time_elapsed")
        .await;
    assert!(!process_alive(envoy));
}

/// A refusal: the mode, the arguments, the environment, what the message must name.
type Case = (
    Mode,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    &'static [&'static str],
);

/// Each case: the arguments, the environment, what the refusal must name. (As a node proxy:
/// the kit's sidecar waits for Envoy's admin address, which a refused start never writes;
/// the split is the same code in both modes.)
#[tokio::test]
async fn a_phase_that_cannot_fit_is_refused_at_start_naming_it() {
    let cases: [Case; 4] = [
        (
            Mode::NodeProxy,
            &[
                "--shutdown-budget",
                "10s",
                "--termination-drain-duration",
                "20s",
            ],
            &[],
            &["--termination-drain-duration", "--shutdown-budget"],
        ),
        (
            Mode::NodeProxy,
            &["--drain-delay", "5s"],
            &[("ENVOY_AGENT_SHUTDOWN_BUDGET", "8s")],
            &["--shutdown-budget", "--drain-delay", "--stop-grace"],
        ),
        (
            Mode::NodeProxy,
            &[
                "--shutdown-budget",
                "12s",
                "--exit-on-zero-active-connections",
                "--minimum-drain-duration",
                "6s",
            ],
            &[],
            &["--minimum-drain-duration", "--shutdown-budget"],
        ),
        // The default --parent-shutdown-time (60s) does not fit 30s.
        (
            Mode::NodeProxy,
            &["--shutdown-budget", "30s"],
            &[],
            &["--parent-shutdown-time", "--shutdown-budget"],
        ),
    ];
    for (mode, args, env, named) in cases {
        refused_at_start(mode, args, env, named).await;
    }
    // Allowed with room to spare, for contrast: the same node proxy with a budget that fits.
    let mut agent = agent_in(Mode::NodeProxy)
        .args(&["--shutdown-budget", "90s"])
        .start()
        .await;
    let split = agent
        .wait_event("shutdown_budget", "budget_ms", "90000")
        .await;
    assert_eq!(split["handover_ms"], 83000, "{split}");
    // It would drain for the 83 s: a second SIGTERM stops it at once.
    agent.signal(Signal::SIGTERM);
    eventually("the drain", PATIENCE, || async {
        (status(&agent).await.state() == pb::AgentState::Draining).then_some(())
    })
    .await;
    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

/// The agent in `mode` with `args` and `env` exits 64 at start, naming each of `named`, and
/// starts no Envoy.
pub(crate) async fn refused_at_start(
    mode: Mode,
    args: &[&str],
    env: &[(&str, &str)],
    named: &[&str],
) {
    let mut builder = agent_in(mode).args(args).no_wait();
    for (key, value) in env {
        builder = builder.env(key, value);
    }
    let mut agent = builder.start().await;
    let code = tokio::time::timeout(PATIENCE, agent.exit())
        .await
        .expect("refused at start")
        .code();
    let stderr = agent.stderr();
    assert_eq!(code, Some(64), "{args:?} {env:?}: {stderr}");
    for name in named {
        assert!(
            stderr.contains(name),
            "{args:?} {env:?} names {name}: {stderr}"
        );
    }
    assert!(
        agent.events("epoch_starting").is_empty(),
        "no envoy started: {stderr}"
    );
}

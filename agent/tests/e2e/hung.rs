//! A hung Envoy (SIGSTOP here: the kernel still accepts its connections, it answers none) is
//! caught the same way in both modes: readiness turns 503 within a few seconds and says why,
//! the status names the silence and since when, and past `--admin-unresponsive-deadline` the
//! agent kills it (SIGKILL: a stopped Envoy keeps a SIGTERM pending) and exits 75 with exit path
//! `wedged`; with `--restart-on-crash` a fresh Envoy serves instead.

use envoy_agent::client::connect;
use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::{AgentProcess, PATIENCE, eventually, http_get, process_alive};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::exit_paths::{Mode, agent_in, both_modes};
use crate::grpc::{cli, get_status};

both_modes!(a_hung_envoy_turns_readiness_off_then_is_judged_wedged);

/// Past this much silence the agent judges Envoy wedged; readiness turns off after 3 s, which
/// leaves the test seconds to read the status in between.
const DEADLINE: &str = "8s";
/// A stopped Envoy ignores SIGTERM: were it sent one, the agent would wait this long before
/// its SIGKILL, past the test's patience. Only a SIGKILL at once lets the agent exit in time.
const LONG_GRACE: &str = "1m";

/// SIGSTOPs an Envoy, and on drop wakes and kills it if it still runs (a failed test must not
/// leave a stopped Envoy behind).
struct Stopped(u32);

impl Stopped {
    fn envoy(pid: u32) -> Stopped {
        kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", self.0)).unwrap_or_default();
        // Still our Envoy (not a process that got its pid since).
        if comm.trim() == "envoy" {
            let pid = Pid::from_raw(self.0 as i32);
            let _ = kill(pid, Signal::SIGCONT);
            let _ = kill(pid, Signal::SIGKILL);
        }
    }
}

async fn status(agent: &AgentProcess) -> pb::Status {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    let mut client = connect(&addr, PATIENCE).await.unwrap();
    get_status(&mut client).await
}

/// The pid of the one LIVE Envoy the agent reports (not `not`), once it is ready.
async fn ready_envoy(agent: &AgentProcess, not: Option<u32>) -> pb::Status {
    eventually("a ready, LIVE envoy in the status", PATIENCE, || async {
        let s = status(agent).await;
        let live = s.ready
            && s.epochs.len() == 1
            && s.epochs[0].state() == pb::EpochState::Live
            && Some(s.epochs[0].pid) != not;
        live.then_some(s)
    })
    .await
}

/// Readiness, once it is 503 naming Envoy's silence.
async fn silent_readiness(agent: &AgentProcess) -> String {
    eventually("readiness 503 naming the silence", PATIENCE, || async {
        http_get(agent.status(), "/healthz/ready")
            .await
            .ok()
            .filter(|r| r.status == 503 && r.body.contains("admin API has not answered"))
            .map(|r| r.body)
    })
    .await
}

async fn a_hung_envoy_turns_readiness_off_then_is_judged_wedged(mode: Mode) {
    let mut agent = agent_in(mode)
        .args(&["--admin-unresponsive-deadline", DEADLINE])
        .args(&["--stop-grace", LONG_GRACE])
        .start()
        .await;
    let envoy = ready_envoy(&agent, None).await.epochs[0].pid;
    let _stopped = Stopped::envoy(envoy);

    let body = silent_readiness(&agent).await;
    assert!(
        body.starts_with("not ready: envoy's admin API has not answered for "),
        "{body}"
    );
    // Logged as readiness turns: the kit reads the agent's stderr beside the test, so wait
    // for the line rather than assume it was read first.
    let silent = eventually("the admin_silent event", PATIENCE, || async {
        Some(agent.events("admin_silent")).filter(|e| !e.is_empty())
    })
    .await;
    assert_eq!(silent.len(), 1, "logged once: {silent:?}");
    if matches!(mode, Mode::NodeProxy) {
        // A node proxy's readiness is its marker file (an exec probe): it follows.
        eventually("the readiness marker removed", PATIENCE, || async {
            (!agent.marker_present()).then_some(())
        })
        .await;
    }
    // The status names it, well before the deadline (3 s of silence make it stale, 8 s a
    // wedge): still live, not ready, silent since its last answer.
    let (code, json, _) = cli(&agent, &["status", "--json"]).await;
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(json["state"], "live", "{json}");
    assert_eq!(json["ready"], false, "{json}");
    assert!(json["admin_silent_since"].is_string(), "{json}");
    let reason = json["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("admin API has not answered"), "{json}");
    let (_, text, _) = cli(&agent, &["status"]).await;
    assert!(
        text.contains("envoy admin:        not answering since"),
        "{text}"
    );

    assert_eq!(agent.exit().await.code(), Some(75), "the wedge exit code");
    let wedge = agent
        .wait_event("wedge", "reason", "admin_unresponsive")
        .await;
    assert!(
        wedge["error"]
            .as_str()
            .unwrap_or_default()
            .contains("admin silent"),
        "{wedge}"
    );
    let exit = agent.wait_event("exit", "exit_path", "wedged").await;
    assert_eq!(exit["code"], 75, "{exit}");
    assert!(!process_alive(envoy), "the stopped envoy was killed");
}

/// In sidecar mode too, `--restart-on-crash` recovers a wedge in place: the hung Envoy is
/// killed, a fresh one serves after the back-off, the crash is recorded as `wedged`, and the
/// same agent keeps running (the node-proxy case: `crash_recovery::a_wedge_is_recovered_in_
/// place_with_restart_on_crash`).
#[tokio::test]
async fn a_hung_sidecar_envoy_is_recovered_in_place_with_restart_on_crash() {
    let mut agent = agent_in(Mode::Sidecar)
        .args(&["--restart-on-crash"])
        .args(&["--admin-unresponsive-deadline", DEADLINE])
        .args(&["--stop-grace", LONG_GRACE])
        .start()
        .await;
    let agent_pid = agent.pid();
    let envoy = ready_envoy(&agent, None).await.epochs[0].pid;
    let _stopped = Stopped::envoy(envoy);

    silent_readiness(&agent).await;
    agent
        .wait_event("wedge", "reason", "admin_unresponsive")
        .await;
    let crashed = agent.wait_event("envoy_crashed", "kind", "wedged").await;
    assert_eq!(crashed["code"], 75, "{crashed}");
    assert_eq!(crashed["action"], "restart", "{crashed}");

    let after = ready_envoy(&agent, Some(envoy)).await;
    assert!(!process_alive(envoy), "the hung envoy was killed");
    assert_eq!(agent.pid(), agent_pid, "the same agent");
    assert!(agent.running(), "the agent kept running");
    assert_eq!(after.admin_silent_since, None, "the fresh envoy answers");
    let crash = &after.crash_recovery.expect("crash recovery is on").crashes[0];
    assert_eq!(crash.kind(), pb::CrashKind::Wedged);
    assert_eq!(crash.exit_code, 75);
    let ready = http_get(agent.status(), "/healthz/ready").await.unwrap();
    assert_eq!((ready.status, ready.body.trim()), (200, "ready"));

    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

//! The client subcommands (`status`, `watch`, `drain`, `quit`, `restart`, `update-config`): one
//! RPC each to a running agent's gRPC service.
//!
//! Exit codes: 0 the RPC succeeded; 1 the agent refused or failed it (the message says why);
//! 69 (`EX_UNAVAILABLE`) the agent is not reachable at the address.

use std::time::Duration;

use envoy_agent_proto::pb;
use envoy_agent_proto::pb::agent_service_client::AgentServiceClient;
use hyper_util::rt::TokioIo;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

use crate::grpc::GrpcAddress;

/// `EX_UNAVAILABLE`: nothing answers at the address.
pub const EXIT_UNREACHABLE: u8 = 69;

/// Where the agent's gRPC server listens by default: `$XDG_RUNTIME_DIR/envoy-agent/grpc.sock`,
/// else `/run/envoy-agent/grpc.sock` for root, else `/tmp/envoy-agent-<uid>/grpc.sock`.
pub fn default_address() -> GrpcAddress {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => std::path::PathBuf::from(d).join("envoy-agent"),
        None if nix::unistd::geteuid().is_root() => "/run/envoy-agent".into(),
        None => std::env::temp_dir().join(format!("envoy-agent-{}", nix::unistd::geteuid())),
    };
    GrpcAddress::Unix(dir.join("grpc.sock"))
}

/// A client connected to `addr`.
pub async fn connect(
    addr: &GrpcAddress,
    timeout: Duration,
) -> Result<AgentServiceClient<Channel>, String> {
    let unreachable =
        |e: &dyn std::fmt::Display| format!("the agent is not reachable at {addr}: {e}");
    let channel = match addr {
        GrpcAddress::Tcp(a) => Endpoint::from_shared(format!("http://{a}"))
            .map_err(|e| unreachable(&e))?
            .connect_timeout(timeout)
            .timeout(timeout)
            .connect()
            .await
            .map_err(|e| unreachable(&e))?,
        GrpcAddress::Unix(path) => {
            let path = path.clone();
            // The URI is not used: every connection goes to the socket.
            Endpoint::from_static("http://localhost")
                .connect_timeout(timeout)
                .timeout(timeout)
                .connect_with_connector(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move {
                        tokio::net::UnixStream::connect(path)
                            .await
                            .map(TokioIo::new)
                    }
                }))
                .await
                .map_err(|e| unreachable(&e))?
        }
    };
    Ok(AgentServiceClient::new(channel))
}

/// Prints `status` for people.
pub fn print_status(status: &pb::Status) {
    println!("mode:      {}", status.mode);
    println!(
        "state:     {}{}",
        status.state,
        if status.reason.is_empty() {
            String::new()
        } else {
            format!(" ({})", status.reason)
        }
    );
    println!("ready:     {}", if status.ready { "yes" } else { "no" });
    if status.mode == "supervisor" {
        println!("base id:   {}", status.base_id);
        println!("hot-restart version: {}", status.hot_restart_version);
        println!(
            "newest LIVE epoch: {}",
            if status.newest_live_epoch < 0 {
                "none".to_owned()
            } else {
                status.newest_live_epoch.to_string()
            }
        );
        if let Some(h) = &status.handoff {
            println!("handoff:   to epoch {} ({})", h.epoch, h.reason);
        }
        if let Some(h) = &status.last_handoff {
            println!(
                "last hot restart: epoch {} {} in {} ms ({}){}",
                h.epoch,
                h.outcome,
                h.duration_ms,
                h.reason,
                if h.message.is_empty() {
                    String::new()
                } else {
                    format!(": {}", h.message)
                }
            );
        }
        for w in &status.wedges {
            println!("wedge:     {}: {}", w.reason, w.message);
        }
        if !status.epochs.is_empty() {
            println!("  EPOCH       PID  STATE");
            for e in &status.epochs {
                println!("{:>7}  {:>8}  {}", e.epoch, e.pid, e.state);
            }
        }
    }
}

/// Status as one JSON object (for scripts).
pub fn status_json(status: &pb::Status) -> serde_json::Value {
    serde_json::json!({
        "mode": status.mode,
        "state": status.state,
        "reason": status.reason,
        "ready": status.ready,
        "draining": status.draining,
        "newest_live_epoch": status.newest_live_epoch,
        "base_id": status.base_id,
        "hot_restart_version": status.hot_restart_version,
        "handed_over_to": status.handed_over_to,
        "epochs": status.epochs.iter().map(|e| serde_json::json!({
            "epoch": e.epoch, "pid": e.pid, "state": e.state, "started_unix_ms": e.started_unix_ms,
        })).collect::<Vec<_>>(),
        "last_handoff": status.last_handoff.as_ref().map(|h| serde_json::json!({
            "epoch": h.epoch, "reason": h.reason, "outcome": h.outcome,
            "duration_ms": h.duration_ms, "message": h.message,
        })),
        "wedges": status.wedges.iter().map(|w| serde_json::json!({
            "reason": w.reason, "at_unix_ms": w.at_unix_ms, "message": w.message,
        })).collect::<Vec<_>>(),
    })
}

fn failed(what: &str, status: &tonic::Status) -> u8 {
    eprintln!(
        "envoy-agent {what}: {}: {}",
        code_name(status.code()),
        status.message()
    );
    match status.code() {
        tonic::Code::Unavailable => EXIT_UNREACHABLE,
        _ => 1,
    }
}

fn code_name(code: tonic::Code) -> String {
    format!("{code:?}")
}

/// Runs one client subcommand; returns the exit code.
pub async fn run(command: &crate::cli::ClientCommand, addr: &GrpcAddress, timeout: Duration) -> u8 {
    use crate::cli::ClientCommand as C;
    // A watch lasts as long as the agent: no per-call timeout for it.
    let call_timeout = match command {
        C::Watch { .. } => Duration::from_secs(365 * 24 * 3600),
        _ => timeout,
    };
    let mut client = match connect(addr, call_timeout).await {
        Ok(c) => c,
        Err(message) => {
            eprintln!("envoy-agent: {message}");
            return EXIT_UNREACHABLE;
        }
    };
    match command {
        C::Status { json } => match client.get_status(pb::GetStatusRequest {}).await {
            Ok(r) => {
                let status = r.into_inner();
                if *json {
                    println!("{}", status_json(&status));
                } else {
                    print_status(&status);
                }
                0
            }
            Err(e) => failed("status", &e),
        },
        C::Watch { json } => match client.watch_status(pb::WatchStatusRequest {}).await {
            Ok(r) => {
                let mut stream = r.into_inner();
                while let Some(item) = stream.next().await {
                    match item {
                        Ok(status) if *json => println!("{}", status_json(&status)),
                        Ok(status) => {
                            print_status(&status);
                            println!();
                        }
                        Err(e) => return failed("watch", &e),
                    }
                }
                0
            }
            Err(e) => failed("watch", &e),
        },
        C::Drain {
            skip_exit,
            all_listeners,
        } => {
            let request = pb::DrainRequest {
                inbound_only: !all_listeners,
                skip_exit: *skip_exit,
            };
            match client.drain(request).await {
                Ok(_) => {
                    println!("draining");
                    0
                }
                Err(e) => failed("drain", &e),
            }
        }
        C::Quit => match client.quit_quit_quit(pb::QuitQuitQuitRequest {}).await {
            Ok(_) => {
                println!("quitting");
                0
            }
            Err(e) => failed("quit", &e),
        },
        C::UpdateConfig { file, reason } => {
            let bootstrap = match std::fs::read(file) {
                Ok(b) => b,
                Err(e) => {
                    eprintln!(
                        "envoy-agent update-config: cannot read {}: {e}",
                        file.display()
                    );
                    return crate::setup::EXIT_USAGE;
                }
            };
            let request = pb::UpdateConfigRequest {
                bootstrap,
                reason: reason.clone(),
            };
            match client.update_config(request).await {
                Ok(r) => {
                    let r = r.into_inner();
                    if r.restarted {
                        println!("config updated; epoch {} is LIVE on it", r.epoch);
                    } else {
                        println!(
                            "config updated (hot restart is off: envoy reads it when next started)"
                        );
                    }
                    0
                }
                Err(e) => failed("update-config", &e),
            }
        }
        C::Restart { reason } => {
            let request = pb::HotRestartRequest {
                reason: reason.clone(),
            };
            match client.hot_restart(request).await {
                Ok(r) => {
                    println!("epoch {} is LIVE", r.into_inner().epoch);
                    0
                }
                Err(e) => failed("restart", &e),
            }
        }
    }
}

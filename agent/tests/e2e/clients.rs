//! Any gRPC client works over the agent's Unix socket, as it comes: Python's grpcio (which
//! sends the socket path, percent-encoded, as `:authority`) and grpcurl 1.8.6 (grpc-go, which
//! sends it verbatim, and speaks reflection v1alpha only), with no client-side override, for
//! health, reflection (`list`, `describe`) and GetStatus.

use std::process::Stdio;

use envoy_agent_tests::{PATIENCE, test_tool};
use nix::sys::signal::Signal;

use crate::agent;

/// The client, in Python with grpcio: health, the reflection service list (v1alpha, which
/// grpcio-reflection's descriptor database speaks), and GetStatus through descriptors fetched
/// by reflection. Prints one line per answer.
const PYTHON_CLIENT: &str = r#"
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf import message_factory, json_format

with grpc.insecure_channel(sys.argv[1]) as channel:
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="envoyagent.v1.AgentService"), timeout=10)
    print("health", health_pb2.HealthCheckResponse.ServingStatus.Name(health.status))
    db = ProtoReflectionDescriptorDatabase(channel)
    print("services", ",".join(sorted(db.get_services())))
    method = DescriptorPool(db).FindServiceByName("envoyagent.v1.AgentService").FindMethodByName("GetStatus")
    request = message_factory.GetMessageClass(method.input_type)
    response = message_factory.GetMessageClass(method.output_type)
    get_status = channel.unary_unary("/envoyagent.v1.AgentService/GetStatus",
        request_serializer=request.SerializeToString, response_deserializer=response.FromString)
    print("status", json_format.MessageToJson(get_status(request(), timeout=10), indent=None))
"#;

async fn run(program: &std::path::Path, args: &[&str]) -> (bool, String) {
    let output = tokio::time::timeout(
        PATIENCE,
        tokio::process::Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{} {args:?} did not finish", program.display()))
    .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

#[tokio::test]
async fn python_grpcio_and_grpcurl_work_over_the_unix_socket_as_they_come() {
    let mut agent = agent().start().await;
    let socket = agent.grpc.strip_prefix("unix:").unwrap().to_owned();

    let script = agent.dir.write("client.py", PYTHON_CLIENT);
    let (ok, out) = run(
        &test_tool("python"),
        &[script.to_str().unwrap(), &format!("unix:{socket}")],
    )
    .await;
    assert!(ok, "grpcio over the socket: {out}");
    assert!(out.contains("health SERVING"), "{out}");
    assert!(out.contains("envoyagent.v1.AgentService"), "{out}");
    assert!(out.contains("grpc.health.v1.Health"), "{out}");
    let status = out
        .lines()
        .find_map(|l| l.strip_prefix("status "))
        .unwrap_or_else(|| panic!("{out}"));
    let status: serde_json::Value = serde_json::from_str(status).unwrap();
    // The proto3 JSON mapping: enum names, RFC 3339 times (the well-known types resolved
    // through reflection too).
    assert_eq!(status["status"]["state"], "AGENT_STATE_LIVE", "{status}");
    assert_eq!(status["status"]["mode"], "MODE_SIDECAR", "{status}");
    assert!(
        status["status"]["stateSince"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z') && t.contains('T')),
        "{status}"
    );

    let grpcurl = test_tool("grpcurl");
    let (ok, out) = run(&grpcurl, &["-plaintext", "-unix", &socket, "list"]).await;
    assert!(ok, "grpcurl list: {out}");
    assert!(out.contains("envoyagent.v1.AgentService"), "{out}");
    let (ok, out) = run(
        &grpcurl,
        &[
            "-plaintext",
            "-unix",
            &socket,
            "describe",
            "envoyagent.v1.AgentService",
        ],
    )
    .await;
    assert!(
        ok && out.contains("rpc GetStatus"),
        "grpcurl describe: {out}"
    );
    let (ok, out) = run(
        &grpcurl,
        &[
            "-plaintext",
            "-unix",
            "-d",
            r#"{"service":"envoyagent.v1.AgentService"}"#,
            &socket,
            "grpc.health.v1.Health/Check",
        ],
    )
    .await;
    assert!(ok && out.contains("SERVING"), "grpcurl health: {out}");
    let (ok, out) = run(
        &grpcurl,
        &[
            "-plaintext",
            "-unix",
            &socket,
            "envoyagent.v1.AgentService/GetStatus",
        ],
    )
    .await;
    assert!(ok, "grpcurl GetStatus: {out}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let status = &status["status"];
    assert_eq!(status["state"], "AGENT_STATE_LIVE", "{status}");
    assert_eq!(status["newestLiveEpoch"], 0, "{status}");
    assert!(
        status["settings"]["terminationDrainDuration"] == "5s",
        "a Duration: {status}"
    );
    assert!(
        status["epochs"][0]["startTime"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "a Timestamp in RFC 3339: {status}"
    );
    // ReopenLogs through reflection, as in docs/api.md's grpcurl examples.
    let (ok, out) = run(
        &grpcurl,
        &[
            "-plaintext",
            "-unix",
            &socket,
            "envoyagent.v1.AgentService/ReopenLogs",
        ],
    )
    .await;
    assert!(ok, "grpcurl ReopenLogs: {out}");
    let reopened: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(reopened["envoysSignalled"], 1, "{reopened}");

    agent.signal(Signal::SIGTERM);
    assert_eq!(agent.exit().await.code(), Some(0));
}

//! The controller API end to end (issue 17): GetStatus's typed fields in each mode over both
//! transports, checked against the flags given; WatchStatus through a drain with its deadline
//! and connection counts; Stop's graceful drain; ReopenLogs after a log rotation; and the
//! generated man page kept current.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use envoy_agent::grpc::GrpcAddress;
use envoy_agent_proto::pb;
use envoy_agent_tests::{
    AgentProcess, KeepAlive, PATIENCE, eventually, free_port, http_get, repo_root, slow_request,
};
use nix::sys::signal::Signal;
use tokio_stream::StreamExt;

use crate::agent;
use crate::grpc::{cli, get_status};

type Client = pb::agent_service_client::AgentServiceClient<tonic::transport::Channel>;

async fn client(agent: &AgentProcess) -> Client {
    let addr: GrpcAddress = agent.grpc.parse().unwrap();
    envoy_agent::client::connect(&addr, PATIENCE).await.unwrap()
}

fn time(t: &Option<prost_types::Timestamp>) -> SystemTime {
    SystemTime::try_from(t.expect("a time")).unwrap()
}

fn span(d: &Option<prost_types::Duration>) -> Duration {
    Duration::try_from(d.expect("a duration")).unwrap()
}

/// `docs/envoy-agent.1` is the man page generated from the CLI; the filter `flag_reference`
/// runs this test with the flag reference's, and `UPDATE_FLAG_DOCS=1` rewrites both.
#[test]
fn flag_reference_man_page_is_current() {
    let path = repo_root().join("docs/envoy-agent.1");
    let generated = envoy_agent::cli::man_page().unwrap();
    if std::env::var_os("UPDATE_FLAG_DOCS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let on_disk = std::fs::read(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "docs/envoy-agent.1 is out of date: run `UPDATE_FLAG_DOCS=1 cargo test -p envoy-agent --test e2e flag_reference`"
    );
}

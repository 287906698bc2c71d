//! Read-only views of Envoy's admin API, through the agent (`AdminGet`, `envoy-agent admin GET
//! /config_dump`): what operators used `curl localhost:15000/...` for, once Envoy's admin API
//! listens where only the agent's user reaches it (`--envoy-admin socket`).
//!
//! # Theory of operation
//!
//! [`View::parse`] decides what may be asked: a `GET` of an endpoint on [`ALLOWED`], those of
//! Envoy's endpoints that only read. The path must be one of them exactly (no percent-encoding
//! in the path, no trailing `/`: Envoy's admin matches paths exactly, and so does the list, so
//! nothing else can slip through); the query is passed on as given, its percent-encoding
//! kept, once it is a valid URI query. An endpoint that changes Envoy is refused naming the
//! agent's verb that does it ([`MUTATING`]): the agent must always know what was done to its
//! Envoy (a `/quitquitquit` behind its back would look like a crash).
//!
//! [`stream`] then passes Envoy's answer on as it arrives, in chunks of at most [`CHUNK`]
//! bytes, so a large `/config_dump` or `/stats` is never held whole; the answer's head, each
//! chunk and the whole view are bounded ([`Bounds`]), so a silent Envoy never holds a caller
//! (or the agent's memory) for long. The stream is pulled by the gRPC response: a slow reader
//! slows the read from Envoy, nothing is buffered beyond a chunk.
//!
//! Who may ask is the gRPC service's decision (`crate::grpc`): the views carry config and
//! certificates, so over TCP they are served only to the callers mutating RPCs are.

use std::time::Duration;

use bytes::Bytes;
use envoy_agent_proxy::{AdminClient, AdminError};
use http_body_util::BodyExt;
use tracing::Instrument as _;

/// Envoy's admin endpoints that only read, which a view may `GET`.
pub const ALLOWED: [&str; 11] = [
    "/stats",
    "/stats/prometheus",
    "/config_dump",
    "/clusters",
    "/listeners",
    "/server_info",
    "/certs",
    "/ready",
    "/memory",
    "/runtime",
    "/hot_restart_version",
];

/// Envoy's endpoints that change it, and the agent's verb that does it instead.
pub const MUTATING: [(&str, &str); 9] = [
    (
        "/quitquitquit",
        "envoy-agent quit (or stop, to drain first)",
    ),
    ("/drain_listeners", "envoy-agent drain"),
    ("/healthcheck/fail", "envoy-agent drain (or stop)"),
    ("/healthcheck/ok", "envoy-agent restart"),
    ("/logging", "envoy-agent log-level"),
    ("/runtime_modify", "envoy-agent update-config (or restart)"),
    ("/reset_counters", "envoy-agent restart"),
    ("/cpuprofiler", "envoy-agent restart"),
    ("/heapprofiler", "envoy-agent restart"),
];

/// The most bytes in one chunk of a view: well under gRPC's 4 MiB message limit, small
/// enough that a chunk costs little to hold.
pub const CHUNK: usize = 64 << 10;

/// A view that may be asked: `GET` of this path and query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    endpoint: String,
}

/// Why a view is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// An endpoint that changes Envoy.
    #[error("{endpoint} changes envoy: the agent passes only read-only views on; use `{instead}`")]
    Mutating {
        /// The endpoint asked for.
        endpoint: String,
        /// The agent's verb to use.
        instead: &'static str,
    },
    /// An endpoint not on the list.
    #[error(
        "{endpoint} is not one of the admin views the agent passes on ({})",
        ALLOWED.join(", ")
    )]
    NotAllowed {
        /// The endpoint asked for.
        endpoint: String,
    },
    /// Not a path and query.
    #[error("{path:?} is not an admin path (/endpoint?query): {why}")]
    Malformed {
        /// What was given.
        path: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl View {
    /// The view of `path` (`/endpoint` or `/endpoint?query`), if one of [`ALLOWED`].
    pub fn parse(path: &str) -> Result<View, Refused> {
        let malformed = |why| Refused::Malformed {
            path: path.to_owned(),
            why,
        };
        if !path.starts_with('/') {
            return Err(malformed("it must start with /"));
        }
        // What Envoy will be sent must be a valid request target as given: its encoding kept.
        let parsed = path
            .parse::<http::uri::PathAndQuery>()
            .map_err(|_| malformed("not a valid URI path and query"))?;
        if parsed.as_str() != path || path.contains('#') {
            return Err(malformed("not a valid URI path and query"));
        }
        let endpoint = parsed.path();
        if let Some((_, instead)) = MUTATING.iter().find(|(m, _)| *m == endpoint) {
            return Err(Refused::Mutating {
                endpoint: endpoint.to_owned(),
                instead,
            });
        }
        if !ALLOWED.contains(&endpoint) {
            return Err(Refused::NotAllowed {
                endpoint: endpoint.to_owned(),
            });
        }
        Ok(View {
            endpoint: path.to_owned(),
        })
    }

    /// Path and query, as Envoy is sent them.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

/// How long a view may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// From the call to the end of Envoy's answer.
    pub whole: Duration,
    /// Between two chunks of the answer (and to its head).
    pub chunk: Duration,
}

impl Default for Bounds {
    /// A whole minute (under the client's 70 s default), 15 s to each chunk: Envoy builds a
    /// large `/config_dump` whole before its first byte, which takes seconds on a big config.
    fn default() -> Self {
        Bounds {
            whole: Duration::from_secs(60),
            chunk: Duration::from_secs(15),
        }
    }
}

/// Why a view ended before its answer did.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// Envoy's admin API refused it, did not answer or could not be reached.
    #[error(transparent)]
    Admin(#[from] AdminError),
    /// No Envoy's admin address is known now (none serves, or it has not bound it yet).
    #[error("envoy's admin address is not known now (no envoy serves, or it has not bound it yet)")]
    NoAdmin,
    /// Reading Envoy's answer failed midway.
    #[error("envoy admin {endpoint}: reading the answer: {message}")]
    Read {
        /// The view.
        endpoint: String,
        /// Why.
        message: String,
    },
    /// A bound ran out.
    #[error("envoy admin {endpoint}: {what} took longer than {bound:?}")]
    Timeout {
        /// The view.
        endpoint: String,
        /// The whole view, or a chunk.
        what: &'static str,
        /// The bound.
        bound: Duration,
    },
}

/// Envoy's answer to `view`, in chunks of at most [`CHUNK`] bytes as it arrives, within
/// `bounds`. The stream ends after the answer, or with one error.
///
/// A task reads Envoy's answer into a channel of one chunk, so the reader's pace is the read's;
/// once the stream is dropped (the caller went away) the task ends and the connection to Envoy
/// closes.
pub fn stream(
    admin: Option<AdminClient>,
    view: View,
    bounds: Bounds,
) -> tokio_stream::wrappers::ReceiverStream<Result<Bytes, ViewError>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(
        async move {
            tokio::select! {
                () = read(admin, view.endpoint, bounds, &tx) => {}
                () = tx.closed() => {}
            }
        }
        .in_current_span(),
    );
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Reads the answer to `endpoint` into `tx`, ending with an error if one comes.
async fn read(
    admin: Option<AdminClient>,
    endpoint: String,
    bounds: Bounds,
    tx: &tokio::sync::mpsc::Sender<Result<Bytes, ViewError>>,
) {
    let Some(admin) = admin else {
        let _ = tx.send(Err(ViewError::NoAdmin)).await;
        return;
    };
    let timeout = |what, bound| ViewError::Timeout {
        endpoint: endpoint.clone(),
        what,
        bound,
    };
    let whole = async {
        let mut body = admin
            .with_timeout(bounds.chunk)
            .get_stream(&endpoint)
            .await?;
        loop {
            let frame = match tokio::time::timeout(bounds.chunk, body.frame()).await {
                Ok(None) => return Ok(()),
                Ok(Some(Ok(frame))) => frame,
                Ok(Some(Err(e))) => {
                    return Err(ViewError::Read {
                        endpoint: endpoint.clone(),
                        message: e.to_string(),
                    });
                }
                Err(_) => return Err(timeout("a chunk", bounds.chunk)),
            };
            // Trailers, which Envoy's admin does not send, carry no body.
            let mut data = frame.into_data().unwrap_or_default();
            while !data.is_empty() {
                let chunk = data.split_to(data.len().min(CHUNK));
                if tx.send(Ok(chunk)).await.is_err() {
                    return Ok(());
                }
            }
        }
    };
    let ended = match tokio::time::timeout(bounds.whole, whole).await {
        Ok(ended) => ended,
        Err(_) => Err(timeout("the whole view", bounds.whole)),
    };
    if let Err(e) = ended {
        let _ = tx.send(Err(e)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_reading_endpoints_pass_with_their_query_as_given() {
        for path in [
            "/server_info",
            "/stats",
            "/stats/prometheus?usedonly",
            "/stats?filter=%5Ehttp%5C.&format=json",
            "/config_dump?resource=dynamic_listeners&include_eds",
            "/clusters?format=json",
            "/hot_restart_version",
        ] {
            assert_eq!(View::parse(path).unwrap().endpoint(), path, "{path}");
        }
    }

    #[test]
    fn a_mutating_endpoint_is_refused_naming_the_agents_verb() {
        let refused = View::parse("/quitquitquit").unwrap_err();
        assert!(
            refused.to_string().contains("envoy-agent quit"),
            "{refused}"
        );
        for (endpoint, verb) in [
            ("/drain_listeners?inboundonly", "envoy-agent drain"),
            ("/logging?level=debug", "envoy-agent log-level"),
            ("/healthcheck/fail", "envoy-agent drain"),
            ("/healthcheck/ok", "envoy-agent restart"),
            ("/runtime_modify?a=b", "envoy-agent"),
            ("/reset_counters", "envoy-agent restart"),
            ("/cpuprofiler?enable=y", "envoy-agent"),
            ("/heapprofiler", "envoy-agent"),
        ] {
            let refused = View::parse(endpoint).unwrap_err();
            assert!(
                matches!(&refused, Refused::Mutating { instead, .. } if instead.contains(verb)),
                "{endpoint}: {refused}"
            );
            assert!(
                refused
                    .to_string()
                    .contains(endpoint.split('?').next().unwrap())
            );
        }
    }

    #[test]
    fn anything_else_is_refused_naming_it() {
        for (path, endpoint) in [
            ("/", "/"),
            ("/stats/", "/stats/"),
            ("/tap", "/tap"),
            ("/init_dump", "/init_dump"),
            ("/stats/recentlookups/enable", "/stats/recentlookups/enable"),
            ("/quitquit%71uit", "/quitquit%71uit"),
            ("//quitquitquit", "//quitquitquit"),
            ("/stats/../quitquitquit", "/stats/../quitquitquit"),
        ] {
            assert_eq!(
                View::parse(path),
                Err(Refused::NotAllowed {
                    endpoint: endpoint.to_owned()
                }),
                "{path}"
            );
        }
        for path in ["stats", "", "/stats?filter=a b", "/stats#x", "/stats\n"] {
            assert!(
                matches!(View::parse(path), Err(Refused::Malformed { .. })),
                "{path:?}"
            );
        }
    }
}

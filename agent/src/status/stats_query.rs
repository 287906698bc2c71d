//! What a scrape of the status server's `/stats/prometheus` asks of Envoy's: the query
//! parameters Envoy takes, normalized ([`StatsQuery`]) and passed on; anything else refused
//! before Envoy is asked ([`QueryError`]); and Envoy's own refusal of a query it cannot take
//! (a regex it cannot compile) told apart from Envoy being unavailable ([`EnvoyRefusal`]).

use envoy_agent_proxy::admin::AdminError;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};

/// The query parameters Envoy 1.40 takes on `/stats/prometheus` (its `/help`), in the order
/// the agent asks them.
pub const PARAMETERS: [&str; 5] = [
    "usedonly",
    "text_readouts",
    "filter",
    "invert_filter",
    "histogram_buckets",
];

/// What a scrape asks of Envoy's `/stats/prometheus`, normalized: the same question however
/// it was spelled (order, percent-encoding, a flag's value) is the same `StatsQuery`, and is
/// asked of Envoy as the same query string.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct StatsQuery {
    /// `usedonly`: only the stats written to since Envoy started.
    pub usedonly: bool,
    /// `text_readouts`: text readouts as gauges.
    pub text_readouts: bool,
    /// `filter`: an RE2 regex on Envoy's own stat names (`server.live`, not
    /// `envoy_server_live`), decoded.
    pub filter: Option<String>,
    /// `invert_filter`: the stats the filter does not match.
    pub invert_filter: bool,
    /// `histogram_buckets`: `cumulative` or `summary` (Envoy checks the value).
    pub histogram_buckets: Option<String>,
}

/// Why a scrape's query is refused (400), before anything reaches Envoy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    /// A parameter Envoy's `/stats/prometheus` does not take (Envoy would ignore it).
    #[error(
        "unknown parameter {0:?}: /stats/prometheus takes usedonly, text_readouts, filter, invert_filter, histogram_buckets"
    )]
    Unknown(String),
    /// A parameter given twice: which one Envoy would take is not the caller's to guess.
    #[error("parameter {0:?} is given more than once")]
    Repeated(String),
    /// A flag given a value that says no: Envoy turns a flag on whenever it is present,
    /// whatever its value, so `usedonly=false` would mean the opposite of what it says.
    #[error(
        "parameter {name:?} is on whenever present (Envoy ignores its value): leave it out instead of {name}={value}"
    )]
    FlagOff {
        /// The flag.
        name: String,
        /// The value that says no.
        value: String,
    },
    /// A name or value that is not UTF-8 once percent-decoded.
    #[error("parameter {0:?} is not UTF-8 once percent-decoded")]
    Encoding(String),
}

/// What Envoy's query string encodes: everything but the unreserved characters (RFC 3986).
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

impl StatsQuery {
    /// Parses a scrape's raw query string (after `?`; empty for none). Names and values are
    /// percent-decoded and a `+` stays a `+`, as Envoy reads them (a `+` is common in a regex).
    pub fn parse(raw: &str) -> Result<Self, QueryError> {
        let mut query = StatsQuery::default();
        let mut seen: Vec<String> = Vec::new();
        for pair in raw.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decode = |s: &str| {
                percent_decode_str(s)
                    .decode_utf8()
                    .map(|s| s.into_owned())
                    .map_err(|_| QueryError::Encoding(name.to_owned()))
            };
            let name = decode(name)?;
            let value = decode(value)?;
            if !PARAMETERS.contains(&name.as_str()) {
                return Err(QueryError::Unknown(name));
            }
            if seen.contains(&name) {
                return Err(QueryError::Repeated(name));
            }
            let flag = || {
                if matches!(
                    value.to_ascii_lowercase().as_str(),
                    "false" | "0" | "no" | "off"
                ) {
                    Err(QueryError::FlagOff {
                        name: name.clone(),
                        value: value.clone(),
                    })
                } else {
                    Ok(true)
                }
            };
            match name.as_str() {
                "usedonly" => query.usedonly = flag()?,
                "text_readouts" => query.text_readouts = flag()?,
                "invert_filter" => query.invert_filter = flag()?,
                "filter" => query.filter = Some(value),
                // Whatever remains of PARAMETERS.
                _ => query.histogram_buckets = Some(value),
            }
            seen.push(name);
        }
        Ok(query)
    }

    /// The query string Envoy is asked (empty for none): the parameters in the order of
    /// [`PARAMETERS`], values percent-encoded. Equal queries give equal strings.
    pub fn to_query_string(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        let value = |name: &str, v: &str| format!("{name}={}", utf8_percent_encode(v, QUERY_VALUE));
        if self.usedonly {
            parts.push("usedonly".to_owned());
        }
        if self.text_readouts {
            parts.push("text_readouts".to_owned());
        }
        if let Some(filter) = &self.filter {
            parts.push(value("filter", filter));
        }
        if self.invert_filter {
            parts.push("invert_filter".to_owned());
        }
        if let Some(buckets) = &self.histogram_buckets {
            parts.push(value("histogram_buckets", buckets));
        }
        parts.join("&")
    }
}

/// Envoy refused the query (a 4xx: a regex it cannot compile, a bucket mode it does not
/// know): the scrape is refused (400) with Envoy's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("envoy refused the query (HTTP {status}): {message}")]
pub struct EnvoyRefusal {
    /// Envoy's status code.
    pub status: u16,
    /// Envoy's answer (its start).
    pub message: String,
}

impl EnvoyRefusal {
    /// Whether `error` (from `AdminClient::prometheus_stream`) is Envoy refusing the query;
    /// `None` for anything else (no answer, a 5xx): Envoy's stats are then unavailable.
    pub fn from_admin_error(error: &AdminError) -> Option<Self> {
        match error {
            AdminError::Status { status, body, .. } if status.is_client_error() => {
                Some(EnvoyRefusal {
                    status: status.as_u16(),
                    message: body.trim().to_owned(),
                })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use axum::http::StatusCode;

    use super::*;

    #[test]
    fn the_same_question_however_spelled_is_the_same_query() {
        let a = StatsQuery::parse("filter=%5Ecluster%5C..%2B&usedonly").unwrap();
        let b = StatsQuery::parse("usedonly=true&filter=^cluster\\..+").unwrap();
        let c = StatsQuery::parse("usedonly=&filter=^cluster%5C..+").unwrap();
        assert_eq!(a, b);
        assert_eq!(a, c);
        assert_eq!(a.to_query_string(), b.to_query_string());
        assert_eq!(
            a,
            StatsQuery {
                usedonly: true,
                filter: Some("^cluster\\..+".to_owned()),
                ..StatsQuery::default()
            }
        );
        // Envoy's order, every reserved character encoded.
        assert_eq!(a.to_query_string(), "usedonly&filter=%5Ecluster%5C..%2B");
        // A percent-encoded name is the name.
        assert_eq!(
            StatsQuery::parse("%75sedonly").unwrap(),
            StatsQuery::parse("usedonly").unwrap()
        );
    }

    #[test]
    fn no_query_asks_for_everything() {
        for raw in ["", "&", "&&"] {
            let q = StatsQuery::parse(raw).unwrap();
            assert_eq!(q, StatsQuery::default());
            assert_eq!(q.to_query_string(), "");
        }
    }

    #[test]
    fn every_parameter_envoy_takes_is_passed_on() {
        let q = StatsQuery::parse(
            "histogram_buckets=summary&invert_filter&filter=a b&text_readouts=1&usedonly",
        )
        .unwrap();
        assert_eq!(
            q,
            StatsQuery {
                usedonly: true,
                text_readouts: true,
                filter: Some("a b".to_owned()),
                invert_filter: true,
                histogram_buckets: Some("summary".to_owned()),
            }
        );
        assert_eq!(
            q.to_query_string(),
            "usedonly&text_readouts&filter=a%20b&invert_filter&histogram_buckets=summary"
        );
    }

    #[test]
    fn refusals_name_the_parameter() {
        assert_eq!(
            StatsQuery::parse("usedonly&format=json"),
            Err(QueryError::Unknown("format".to_owned()))
        );
        assert_eq!(
            StatsQuery::parse("filter=a&filter=b"),
            Err(QueryError::Repeated("filter".to_owned()))
        );
        assert_eq!(
            StatsQuery::parse("usedonly&usedonly"),
            Err(QueryError::Repeated("usedonly".to_owned()))
        );
        for value in ["false", "0", "No", "off"] {
            assert_eq!(
                StatsQuery::parse(&format!("usedonly={value}")),
                Err(QueryError::FlagOff {
                    name: "usedonly".to_owned(),
                    value: value.to_owned()
                })
            );
        }
        assert_eq!(
            StatsQuery::parse("filter=%FF"),
            Err(QueryError::Encoding("filter".to_owned()))
        );
    }

    fn status_error(status: StatusCode, body: &str) -> AdminError {
        AdminError::Status {
            addr: SocketAddr::from(([127, 0, 0, 1], 9901)).into(),
            endpoint: "/stats/prometheus?filter=%28".to_owned(),
            status,
            body: body.to_owned(),
        }
    }

    #[test]
    fn envoys_4xx_is_a_refusal_in_its_words_and_anything_else_is_not() {
        assert_eq!(
            EnvoyRefusal::from_admin_error(&status_error(
                StatusCode::BAD_REQUEST,
                "Invalid re2 regex\n"
            )),
            Some(EnvoyRefusal {
                status: 400,
                message: "Invalid re2 regex".to_owned(),
            })
        );
        assert_eq!(
            EnvoyRefusal::from_admin_error(&status_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "no healthy upstream"
            )),
            None
        );
    }
}

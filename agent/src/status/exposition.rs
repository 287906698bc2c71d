//! The app's metrics made safe to merge into the agent's `/stats/prometheus` answer.
//!
//! Prometheus fails a whole scrape on one line it cannot parse, or on a metric family declared
//! twice. The merged answer carries the agent's families, the app's and Envoy's, so one bad line
//! of the app's would cost the pod every series, Envoy's included. So the app's answer is
//! checked line by line before it is merged ([`merge_ready`]): a body that does not parse as
//! Prometheus' text format (0.0.4) or OpenMetrics, or that declares a family twice, is left out
//! whole (the scrape says so in `envoy_agent_app_metrics_up` and the failures counter), never
//! passed on in part.
//!
//! What is changed on the way:
//!
//! - **Names**: the agent's families and Envoy's all begin with `envoy_` (Envoy prefixes every
//!   stat so; the agent's are `envoy_agent_*`). An app family whose name begins with `envoy_`
//!   would collide with one of theirs, so it is emitted as `app_<name>`. Every other name is the
//!   app's own. (A Wasm extension's custom stat namespace is the one way Envoy emits a name
//!   without `envoy_`; it is not checked against the app's.)
//! - **OpenMetrics** (an app that answers `application/openmetrics-text` although asked for
//!   text first) is turned into the text format the rest of the answer is in: `# EOF` and
//!   `# UNIT` lines dropped, a counter family `foo` declared as `foo_total` (its samples' name),
//!   `_created` samples dropped, exemplars and timestamps (seconds in OpenMetrics, milliseconds
//!   in text) dropped, the types the text format lacks (`info`, `stateset`, `gaugehistogram`,
//!   `unknown`) declared `untyped`.
//!
//! Everything here is pure and bounded by the body's length (the fetch bounds that).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

/// Why the app's body was left out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {why}")]
pub struct Invalid {
    /// 1-based.
    pub line: usize,
    /// What is wrong with it.
    pub why: String,
}

fn invalid(line: usize, why: impl Into<String>) -> Invalid {
    Invalid {
        line,
        why: why.into(),
    }
}

/// The app's `body` (OpenMetrics when `openmetrics`, else the text format) as text-format
/// lines ready to follow the agent's own families: checked, renamed, converted. Ends with a
/// newline unless empty.
pub fn merge_ready(body: &str, openmetrics: bool) -> Result<String, Invalid> {
    let mut merge = Merge {
        out: String::with_capacity(body.len() + body.len() / 16),
        typed: HashSet::new(),
        helped: HashSet::new(),
        openmetrics,
        // One pass ahead: a HELP may come before its TYPE.
        om_types: if openmetrics {
            body.lines()
                .filter_map(|l| l.strip_prefix("# TYPE "))
                .filter_map(|d| d.trim_end_matches('\r').split_once(' '))
                .map(|(name, kind)| (name, kind.trim()))
                .collect()
        } else {
            HashMap::new()
        },
        ended: false,
    };
    for (i, raw) in body.lines().enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        merge.line(line).map_err(|why| invalid(i + 1, why))?;
    }
    if openmetrics && !merge.ended {
        return Err(invalid(
            body.lines().count(),
            "OpenMetrics without # EOF (cut off?)",
        ));
    }
    Ok(merge.out)
}

/// The merge of one body, line by line.
struct Merge<'a> {
    out: String,
    /// Families declared (TYPE) and described (HELP) so far, by their names as emitted.
    typed: HashSet<String>,
    helped: HashSet<String>,
    openmetrics: bool,
    /// OpenMetrics: family name -> its type, to name counters' and infos' declarations by
    /// their samples.
    om_types: HashMap<&'a str, &'a str>,
    /// OpenMetrics' `# EOF` was seen.
    ended: bool,
}

impl Merge<'_> {
    fn line(&mut self, line: &str) -> Result<(), String> {
        if self.ended {
            return match line.trim().is_empty() {
                true => Ok(()),
                false => Err("content after # EOF".to_owned()),
            };
        }
        if line.trim().is_empty() {
            return Ok(());
        }
        match line.strip_prefix('#') {
            Some(comment) => self.comment(comment.trim_start()),
            None => self.sample(line),
        }
    }

    fn comment(&mut self, comment: &str) -> Result<(), String> {
        let mut parts = comment.splitn(3, ' ');
        let keyword = parts.next().unwrap_or_default();
        let name = parts.next().unwrap_or_default();
        let rest = parts.next().unwrap_or_default();
        match keyword {
            "HELP" | "TYPE" | "UNIT" if !valid_name(name) => {
                Err(format!("{keyword} names no valid metric: {name:?}"))
            }
            "UNIT" if !self.openmetrics => Err("# UNIT outside OpenMetrics".to_owned()),
            "UNIT" => Ok(()),
            "TYPE" => self.declare(name, rest.trim()),
            "HELP" => {
                let declared = self
                    .om_types
                    .get(name)
                    .and_then(|kind| openmetrics_declaration(name, kind))
                    .map_or_else(|| name.to_owned(), |(d, _)| d);
                let declared = renamed(&declared);
                if !self.helped.insert(declared.clone()) {
                    return Err(format!("{declared} has two HELP lines"));
                }
                let _ = writeln!(self.out, "# HELP {declared} {rest}");
                Ok(())
            }
            "EOF" if self.openmetrics && comment.trim() == "EOF" => {
                self.ended = true;
                Ok(())
            }
            // Any other comment: Prometheus ignores it, so does the merge.
            _ => Ok(()),
        }
    }

    fn declare(&mut self, name: &str, kind: &str) -> Result<(), String> {
        let (declared, kind) = if self.openmetrics {
            openmetrics_declaration(name, kind).ok_or_else(|| format!("unknown type {kind:?}"))?
        } else {
            if !matches!(
                kind,
                "counter" | "gauge" | "histogram" | "summary" | "untyped"
            ) {
                return Err(format!("unknown type {kind:?}"));
            }
            (name.to_owned(), kind)
        };
        let declared = renamed(&declared);
        if !self.typed.insert(declared.clone()) {
            return Err(format!("{declared} is declared twice"));
        }
        let _ = writeln!(self.out, "# TYPE {declared} {kind}");
        Ok(())
    }

    fn sample(&mut self, line: &str) -> Result<(), String> {
        let sample = parse_sample(line)?;
        if let Some(family) = sample.name.strip_suffix("_created") {
            let counted = self
                .om_types
                .get(family)
                .is_some_and(|k| matches!(*k, "counter" | "histogram" | "summary"));
            if self.openmetrics && counted {
                return Ok(());
            }
        }
        let out = &mut self.out;
        let _ = write!(out, "{}", renamed(sample.name));
        if let Some(labels) = sample.labels {
            let _ = write!(out, "{{{labels}}}");
        }
        let _ = write!(out, " {}", sample.value);
        // Text-format timestamps are milliseconds, OpenMetrics' seconds: those are dropped.
        if let (Some(ts), false) = (sample.timestamp, self.openmetrics) {
            let _ = write!(out, " {ts}");
        }
        out.push('\n');
        Ok(())
    }
}

/// How an OpenMetrics family `name` of type `kind` is declared in the text format: the name
/// its samples carry, and a type the text format has.
fn openmetrics_declaration<'a>(name: &str, kind: &'a str) -> Option<(String, &'a str)> {
    Some(match kind {
        "counter" => (format!("{name}_total"), "counter"),
        "info" => (format!("{name}_info"), "untyped"),
        "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
        "stateset" | "gaugehistogram" | "unknown" => (name.to_owned(), "untyped"),
        _ => return None,
    })
}

/// The app's name as merged: out of the `envoy_` namespace.
fn renamed(name: &str) -> String {
    if name.starts_with("envoy_") {
        format!("app_{name}")
    } else {
        name.to_owned()
    }
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// One sample line, its parts borrowed.
#[derive(Debug, PartialEq)]
struct Sample<'a> {
    name: &'a str,
    /// Between the braces, as written (checked).
    labels: Option<&'a str>,
    value: &'a str,
    timestamp: Option<&'a str>,
}

/// `name{labels} value [timestamp] [# exemplar]`.
fn parse_sample(line: &str) -> Result<Sample<'_>, String> {
    let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let name = &line[..name_end];
    if !valid_name(name) {
        return Err(format!("not a metric name: {name:?}"));
    }
    let mut rest = &line[name_end..];
    let mut labels = None;
    if let Some(inner) = rest.strip_prefix('{') {
        let end = labels_end(inner)?;
        labels = Some(&inner[..end]).filter(|l| !l.trim().is_empty());
        rest = &inner[end + 1..];
    }
    // An exemplar (OpenMetrics) follows ` # `; the value and timestamp come before it.
    let rest = match rest.find(" # ") {
        Some(i) => &rest[..i],
        None => rest,
    };
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("a sample without a value")?;
    if !valid_value(value) {
        return Err(format!("not a sample value: {value:?}"));
    }
    let timestamp = fields.next();
    if let Some(ts) = timestamp {
        if ts.parse::<f64>().is_err() {
            return Err(format!("not a timestamp: {ts:?}"));
        }
    }
    if fields.next().is_some() {
        return Err("more than a value and a timestamp".to_owned());
    }
    Ok(Sample {
        name,
        labels,
        value,
        timestamp,
    })
}

/// Where the label set that `inner` begins (past `{`) ends: the index of its `}`. Checks each
/// `name="value"` pair (escapes `\\`, `\"`, `\n`), commas between, one trailing comma allowed.
fn labels_end(inner: &str) -> Result<usize, String> {
    let bytes = inner.as_bytes();
    let mut i = 0;
    loop {
        while bytes.get(i).is_some_and(|b| *b == b' ') {
            i += 1;
        }
        match bytes.get(i) {
            Some(b'}') => return Ok(i),
            None => return Err("labels not closed".to_owned()),
            _ => {}
        }
        let start = i;
        while bytes.get(i).is_some_and(|b| *b != b'=' && *b != b'}') {
            i += 1;
        }
        let label = inner[start..i].trim();
        if !valid_label_name(label) {
            return Err(format!("not a label name: {label:?}"));
        }
        if bytes.get(i) != Some(&b'=') || bytes.get(i + 1) != Some(&b'"') {
            return Err(format!("label {label} has no quoted value"));
        }
        i += 2;
        loop {
            match bytes.get(i) {
                None => return Err(format!("label {label}'s value is not closed")),
                Some(b'\\') => {
                    if !matches!(bytes.get(i + 1), Some(b'\\' | b'"' | b'n')) {
                        return Err(format!("label {label}'s value has a bad escape"));
                    }
                    i += 2;
                }
                Some(b'"') => {
                    i += 1;
                    break;
                }
                Some(_) => i += 1,
            }
        }
        while bytes.get(i).is_some_and(|b| *b == b' ') {
            i += 1;
        }
        match bytes.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => return Ok(i),
            _ => return Err("labels not separated by commas".to_owned()),
        }
    }
}

fn valid_value(value: &str) -> bool {
    matches!(value, "NaN" | "+Inf" | "-Inf" | "Inf") || value.parse::<f64>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_passes_through_checked() {
        let body = "# HELP http_requests_total Requests.\n\
                    # TYPE http_requests_total counter\n\
                    http_requests_total{method=\"post\",code=\"200\"} 1027 1395066363000\n\
                    http_requests_total{method=\"get\",path=\"/a\\\"b\\\\c\"} 3\n\
                    \n\
                    # A comment Prometheus ignores\n\
                    rpc_duration_seconds{quantile=\"0.5\",} 4773\n\
                    up_since NaN\n\
                    temp -Inf\n";
        let out = merge_ready(body, false).unwrap();
        assert_eq!(
            out,
            "# HELP http_requests_total Requests.\n\
             # TYPE http_requests_total counter\n\
             http_requests_total{method=\"post\",code=\"200\"} 1027 1395066363000\n\
             http_requests_total{method=\"get\",path=\"/a\\\"b\\\\c\"} 3\n\
             rpc_duration_seconds{quantile=\"0.5\",} 4773\n\
             up_since NaN\n\
             temp -Inf\n"
        );
    }

    #[test]
    fn names_in_envoys_namespace_are_prefixed() {
        let body = "# HELP envoy_agent_state Not the agent's.\n\
                    # TYPE envoy_agent_state gauge\n\
                    envoy_agent_state{state=\"live\"} 7\n\
                    envoy_cluster_upstream_rq 2\n\
                    app_ok 1\n";
        let out = merge_ready(body, false).unwrap();
        assert_eq!(
            out,
            "# HELP app_envoy_agent_state Not the agent's.\n\
             # TYPE app_envoy_agent_state gauge\n\
             app_envoy_agent_state{state=\"live\"} 7\n\
             app_envoy_cluster_upstream_rq 2\n\
             app_ok 1\n"
        );
    }

    #[test]
    fn openmetrics_becomes_text() {
        let body = "# TYPE acme_http_router_request_seconds summary\n\
                    # UNIT acme_http_router_request_seconds seconds\n\
                    # HELP acme_http_router_request_seconds Latency though all of ACME's HTTP request router.\n\
                    acme_http_router_request_seconds_sum{path=\"/api/v1\",method=\"GET\"} 9036.32\n\
                    acme_http_router_request_seconds_count{path=\"/api/v1\",method=\"GET\"} 807283.0\n\
                    acme_http_router_request_seconds_created{path=\"/api/v1\",method=\"GET\"} 1605281325.0\n\
                    # HELP go_goroutines Goroutines.\n\
                    # TYPE go_goroutines counter\n\
                    go_goroutines_total 69 1520879607.789\n\
                    go_goroutines_created 1520872607.123\n\
                    # TYPE foo histogram\n\
                    foo_bucket{le=\"+Inf\"} 17 # {trace_id=\"KOO5S4vxi0o\"} 0.67\n\
                    # TYPE build info\n\
                    build_info{version=\"1.2\"} 1\n\
                    # EOF\n";
        let out = merge_ready(body, true).unwrap();
        assert_eq!(
            out,
            "# TYPE acme_http_router_request_seconds summary\n\
             # HELP acme_http_router_request_seconds Latency though all of ACME's HTTP request router.\n\
             acme_http_router_request_seconds_sum{path=\"/api/v1\",method=\"GET\"} 9036.32\n\
             acme_http_router_request_seconds_count{path=\"/api/v1\",method=\"GET\"} 807283.0\n\
             # HELP go_goroutines_total Goroutines.\n\
             # TYPE go_goroutines_total counter\n\
             go_goroutines_total 69\n\
             # TYPE foo histogram\n\
             foo_bucket{le=\"+Inf\"} 17\n\
             # TYPE build_info untyped\n\
             build_info{version=\"1.2\"} 1\n"
        );
    }

    #[test]
    fn a_body_prometheus_would_refuse_is_left_out_whole_naming_the_line() {
        for (body, openmetrics, line, why) in [
            ("ok 1\nnot a metric\n", false, 2, "not a sample value"),
            ("ok 1\n0bad 1\n", false, 2, "not a metric name"),
            ("a{b=c} 1\n", false, 1, "no quoted value"),
            ("a{b=\"c} 1\n", false, 1, "not closed"),
            ("a{b=\"c\" d=\"e\"} 1\n", false, 1, "commas"),
            ("a 1 2 3\n", false, 1, "more than"),
            ("a one\n", false, 1, "not a sample value"),
            (
                "# TYPE a gauge\na 1\n# TYPE a gauge\n",
                false,
                3,
                "declared twice",
            ),
            ("# TYPE a histogramm\n", false, 1, "unknown type"),
            ("<html>oops</html>\n", false, 1, "not a metric name"),
            ("a 1\n", true, 1, "without # EOF"),
            ("a 1\n# EOF\nb 2\n", true, 3, "after # EOF"),
            ("# UNIT a seconds\n", false, 1, "UNIT outside"),
        ] {
            let e = merge_ready(body, openmetrics).unwrap_err();
            assert_eq!(e.line, line, "{body:?}: {e}");
            assert!(e.why.contains(why), "{body:?}: {e}");
        }
    }

    #[test]
    fn two_declarations_colliding_after_the_prefix_are_refused() {
        // The app declares both `envoy_x` and `app_envoy_x`: renamed, the first is the second.
        let body = "# TYPE app_envoy_x gauge\napp_envoy_x 1\n# TYPE envoy_x gauge\nenvoy_x 2\n";
        let e = merge_ready(body, false).unwrap_err();
        assert!(e.why.contains("declared twice"), "{e}");
    }
}

//! The termination message: a few lines the agent writes as it exits, saying how it ended,
//! where Kubernetes shows them (`kubectl describe pod`: the container's last state, from its
//! `terminationMessagePath`, `/dev/termination-log` by default).
//!
//! The kubelet creates that file in each container; on a plain host it does not exist, and an
//! agent running as root must not create files under `/dev`. So the default path is written
//! only when it exists, and a path the operator gave is created. Kubernetes keeps at most
//! 4096 bytes of it: the message is kept under that, the listeners still open cut with
//! "and N more". Failing to write it is a warning; the exit code is the exit path's.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use envoy_agent_drain::ListenerActivity;

use crate::agent::{DrainReason, ExitPath, describe_listener};

/// Where Kubernetes reads a container's termination message unless told otherwise.
pub const DEFAULT_PATH: &str = "/dev/termination-log";

/// The most Kubernetes keeps of a termination message, in bytes.
pub const LIMIT: usize = 4096;

/// Room kept for "; and N more" when the listeners are cut.
const MORE_ROOM: usize = 32;

/// Where the termination message goes, and whether the agent may create the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageFile {
    /// The file.
    pub path: PathBuf,
    /// The operator named it (`--termination-message-path` or its variable): created when
    /// missing. The default is only written when it exists.
    pub given: bool,
}

impl MessageFile {
    /// From `--termination-message-path`: the path given, else the default.
    pub fn from_flag(path: Option<PathBuf>) -> MessageFile {
        match path {
            Some(path) => MessageFile { path, given: true },
            None => MessageFile {
                path: PathBuf::from(DEFAULT_PATH),
                given: false,
            },
        }
    }

    /// Whether writing may create the file: only a path the operator gave (the kubelet
    /// creates the default one; on a plain host it must stay absent).
    pub fn creates(&self) -> bool {
        self.given
    }

    /// Writes `message` (replacing what the file held). A missing default file means no
    /// kubelet: nothing is written, and that is no failure. Any other failure is a warning.
    pub fn write(&self, message: &str) {
        match write_to(&self.path, self.creates(), message) {
            Ok(()) => tracing::debug!(path = %self.path.display(), "termination message written"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !self.creates() => {
                tracing::debug!(path = %self.path.display(), "no termination-message file: not written");
            }
            Err(e) => tracing::warn!(
                event = "termination_message_failed",
                path = %self.path.display(),
                error = %e,
                "cannot write the termination message"
            ),
        }
    }
}

fn write_to(path: &Path, create: bool, message: &str) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .create(create)
        .open(path)?;
    file.write_all(message.as_bytes())
}

/// What the termination message says.
#[derive(Debug, Clone)]
pub struct Summary<'a> {
    /// How the agent ended.
    pub path: ExitPath,
    /// The exit code.
    pub code: u8,
    /// What started the shutdown, when one did (a signal, gRPC `Stop`, a drain request).
    pub reason: Option<DrainReason>,
    /// From the shutdown's start (or the stop, when nothing drained first) to the exit; none
    /// when the agent was not asked to stop (Envoy ended on its own).
    pub took: Option<Duration>,
    /// Exit-on-zero: what each counted listener still held at the last reading before the
    /// stop; none when never read.
    pub still_open: Option<&'a [ListenerActivity]>,
    /// Envoy's own reason, when it ended by itself with an error (a start it failed, a crash):
    /// the end of its stderr.
    pub envoy_said: Option<&'a str>,
}

impl Summary<'_> {
    /// The message: at most [`LIMIT`] bytes.
    pub fn text(&self) -> String {
        let mut out = format!(
            "envoy-agent exited {}: {} ({})\n",
            self.code,
            self.path.name(),
            self.path
        );
        if let Some(took) = self.took {
            let from = self
                .reason
                .map(|r| format!(" from {r}"))
                .unwrap_or_default();
            out.push_str(&format!("shutdown took {:.1}s{from}\n", took.as_secs_f64()));
        }
        if let Some(listeners) = self.still_open {
            out.push_str("still open: ");
            if listeners.is_empty() {
                out.push_str("nothing");
            } else {
                let room = LIMIT.saturating_sub(out.len() + MORE_ROOM + 1);
                out.push_str(&listeners_within(listeners, room));
            }
            out.push('\n');
        }
        if let Some(said) = self.envoy_said.map(str::trim).filter(|s| !s.is_empty()) {
            // Its end, which says why, where the whole does not fit.
            let room = LIMIT.saturating_sub(out.len() + "envoy said: \n".len());
            let mut start = said.len().saturating_sub(room);
            while !said.is_char_boundary(start) {
                start += 1;
            }
            out.push_str(&format!("envoy said: {}\n", &said[start..]));
        }
        truncate(&mut out, LIMIT);
        out
    }
}

/// What each listener held, as many as fit in `room` bytes, then "and N more".
fn listeners_within(listeners: &[ListenerActivity], room: usize) -> String {
    let mut out = String::new();
    let mut shown = 0;
    for listener in listeners {
        let part = describe_listener(listener);
        let sep = if shown == 0 { "" } else { "; " };
        if out.len() + sep.len() + part.len() > room {
            break;
        }
        out.push_str(sep);
        out.push_str(&part);
        shown += 1;
    }
    let more = listeners.len() - shown;
    if more > 0 {
        let sep = if shown == 0 { "" } else { "; " };
        out.push_str(&format!("{sep}and {more} more"));
    }
    out
}

/// Cuts `text` to at most `limit` bytes, on a character boundary.
fn truncate(text: &mut String, limit: usize) {
    if text.len() <= limit {
        return;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signal::Intent;
    use envoy_agent_drain::Counting;

    fn listener(name: &str, connections: u64) -> ListenerActivity {
        ListenerActivity {
            name: name.to_owned(),
            connections,
            requests: Some(1),
            upgrades: Some(0),
        }
    }

    #[test]
    fn a_failed_start_gives_envoys_reason_its_end_where_it_does_not_fit() {
        let reason = "error initializing configuration 'b.yaml': Proto constraint validation failed (HttpStatusValidationError.Code: value must be greater than or equal to 100)";
        let summary = Summary {
            path: ExitPath::StartFailed { code: 1 },
            code: 1,
            reason: None,
            took: None,
            still_open: None,
            envoy_said: Some(reason),
        };
        let text = summary.text();
        assert_eq!(
            text,
            format!(
                "envoy-agent exited 1: start_failed (envoy failed to start (exit 1))\nenvoy said: {reason}\n"
            )
        );
        let long = format!("{}{reason}", "x".repeat(10_000));
        let text = Summary {
            envoy_said: Some(&long),
            ..summary
        }
        .text();
        assert!(text.len() <= LIMIT, "{}", text.len());
        assert!(
            text.trim_end().ends_with("greater than or equal to 100)"),
            "the end says why"
        );
    }

    #[test]
    fn the_message_says_the_exit_path_the_code_the_time_and_what_was_open() {
        let open = [listener("ingress_http", 3), listener("ingress_tcp", 1)];
        let text = Summary {
            path: ExitPath::DrainDeadline(Counting::Connections),
            code: 0,
            reason: Some(DrainReason::Signal(Intent::Terminate)),
            took: Some(Duration::from_millis(30_250)),
            envoy_said: None,
            still_open: Some(&open),
        }
        .text();
        assert_eq!(
            text,
            "envoy-agent exited 0: drain_deadline (active connections remained at the \
             termination drain deadline)\n\
             shutdown took 30.2s from SIGTERM\n\
             still open: ingress_http: 3 connections, 1 requests; ingress_tcp: 1 connections, \
             1 requests\n"
        );
    }

    #[test]
    fn an_end_not_asked_for_has_no_shutdown_and_nothing_read_is_not_claimed() {
        let text = Summary {
            path: ExitPath::ProxyExited { code: 1 },
            code: 1,
            reason: None,
            took: None,
            still_open: None,
            envoy_said: None,
        }
        .text();
        assert_eq!(
            text,
            "envoy-agent exited 1: proxy_exited (envoy exited with code 1)\n"
        );
        let nothing = Summary {
            path: ExitPath::ZeroActive(Counting::Requests),
            code: 0,
            reason: Some(DrainReason::Stop),
            took: Some(Duration::from_secs(6)),
            envoy_said: None,
            still_open: Some(&[]),
        }
        .text();
        assert!(
            nothing.ends_with("from gRPC Stop\nstill open: nothing\n"),
            "{nothing}"
        );
    }

    #[test]
    fn many_listeners_are_cut_under_kubernetes_limit_with_how_many_more() {
        let open: Vec<ListenerActivity> = (0..500)
            .map(|i| listener(&format!("listener_with_a_rather_long_name_{i:04}"), i))
            .collect();
        let text = Summary {
            path: ExitPath::DrainDeadline(Counting::Requests),
            code: 0,
            reason: Some(DrainReason::Signal(Intent::Terminate)),
            took: Some(Duration::from_secs(45)),
            envoy_said: None,
            still_open: Some(&open),
        }
        .text();
        assert!(text.len() <= LIMIT, "{}", text.len());
        let line = text.lines().last().unwrap();
        let shown = line.matches("connections").count();
        assert!(shown > 10, "{line}");
        assert!(
            line.ends_with(&format!("; and {} more", 500 - shown)),
            "{line}"
        );
        // One name longer than the limit: only the count.
        let huge = [listener(&"x".repeat(5000), 1)];
        let text = Summary {
            envoy_said: None,
            still_open: Some(&huge),
            ..Summary {
                path: ExitPath::DrainTimeElapsed,
                code: 0,
                reason: None,
                took: Some(Duration::from_secs(1)),
                still_open: None,
                envoy_said: None,
            }
        }
        .text();
        assert!(text.ends_with("still open: and 1 more\n"), "{text}");
    }

    #[test]
    fn the_default_file_is_written_only_if_it_exists_a_given_one_is_created() {
        assert!(!MessageFile::from_flag(None).creates());
        assert_eq!(
            MessageFile::from_flag(None).path,
            PathBuf::from(DEFAULT_PATH)
        );
        assert!(MessageFile::from_flag(Some(PathBuf::from("/tmp/x"))).creates());

        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("termination-log");
        // As the default behaves (not created), at a path of the test's own.
        let default_like = MessageFile {
            path: missing.clone(),
            given: false,
        };
        default_like.write("gone");
        assert!(!missing.exists());
        std::fs::write(&missing, "an older, longer message").unwrap();
        default_like.write("ended");
        assert_eq!(std::fs::read_to_string(&missing).unwrap(), "ended");

        let given = dir.path().join("given");
        MessageFile::from_flag(Some(given.clone())).write("ended");
        assert_eq!(std::fs::read_to_string(&given).unwrap(), "ended");
    }
}

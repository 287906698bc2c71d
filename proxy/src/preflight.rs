//! Checks before a hot restart, run with the binary that would start: does Envoy accept the
//! config (`--mode validate`, touches no shared memory or sockets), and can it hot-restart
//! from the running Envoy (`--hot-restart-version`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use crate::admin::Address;
use crate::config::ProxyConfig;
use crate::spawner;

/// Bound on one pre-flight command (`--mode validate` takes ~50 ms; a broken binary may hang).
pub const PREFLIGHT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long its output is still read once it has exited: what it wrote is in the pipe by
/// then; only a process it left behind (a wrapper's child) keeps the pipe open longer.
const OUTPUT_GRACE: Duration = Duration::from_millis(200);
/// The most of its output kept (the end of it: Envoy's reason comes last).
const OUTPUT_KEPT: usize = 64 * 1024;

/// Why a pre-flight check failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PreflightError {
    /// Envoy rejects the config.
    #[error("envoy rejects config {path}: {message}")]
    Invalid {
        /// The config.
        path: PathBuf,
        /// Envoy's own explanation (the end of its output).
        message: String,
    },
    /// The config cannot be read.
    #[error("cannot read config {path}: {message}")]
    Read {
        /// The config.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The check itself could not run.
    #[error("cannot run {binary} {what}: {message}")]
    Run {
        /// The binary.
        binary: PathBuf,
        /// Which check.
        what: &'static str,
        /// Why.
        message: String,
    },
}

impl PreflightError {
    /// A config update's error for a candidate of `config_path` that failed this check:
    /// [`ProxyError::ConfigRejected`](crate::ProxyError::ConfigRejected), in Envoy's own words
    /// where it gave some. Public for the hot-restart crate's cached check, which answers
    /// config updates as [`validate_candidate`](crate::validate_candidate) does.
    pub fn rejecting(self, config_path: &Path) -> crate::ProxyError {
        let message = match self {
            PreflightError::Invalid { message, .. } => message,
            other => other.to_string(),
        };
        crate::ProxyError::ConfigRejected {
            path: config_path.to_owned(),
            message,
        }
    }
}

struct Output {
    success: bool,
    text: String,
}

async fn run(binary: &Path, args: &[String], what: &'static str) -> Result<Output, PreflightError> {
    let fail = |message: String| PreflightError::Run {
        binary: binary.to_owned(),
        what,
        message,
    };
    let mut command = Command::new(binary);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = spawner::spawn(command)
        .await
        .map_err(|e| fail(e.to_string()))?;
    let pid = child.id().unwrap_or_default();
    // Read beside the wait, and the wait decides: the pipes' end may come much later than
    // the exit (a wrapper whose child inherited them), and the answer is the exit's.
    let stdout = Tail::read(child.stdout.take());
    let stderr = Tail::read(child.stderr.take());
    let status = tokio::time::timeout(PREFLIGHT_TIMEOUT, child.wait()).await;
    spawner::release(pid);
    let status = status
        .map_err(|_| fail(format!("no answer within {PREFLIGHT_TIMEOUT:?}")))?
        .map_err(|e| fail(e.to_string()))?;
    let mut text = stdout.take().await;
    text.push_str(&stderr.take().await);
    Ok(Output {
        success: status.success(),
        text,
    })
}

/// The end of what a pipe carries, read by a task of its own.
struct Tail {
    kept: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    reader: Option<tokio::task::JoinHandle<()>>,
}

impl Tail {
    fn read(pipe: Option<impl tokio::io::AsyncRead + Unpin + Send + 'static>) -> Self {
        let kept = std::sync::Arc::<std::sync::Mutex<Vec<u8>>>::default();
        let reader = pipe.map(|mut pipe| {
            let kept = kept.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut buf = [0u8; 8192];
                while let Ok(n @ 1..) = pipe.read(&mut buf).await {
                    let mut kept = kept
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    kept.extend_from_slice(&buf[..n]);
                    let excess = kept.len().saturating_sub(OUTPUT_KEPT);
                    kept.drain(..excess);
                }
            })
        });
        Tail { kept, reader }
    }

    /// What was read by the end of the pipe, or by [`OUTPUT_GRACE`] from now.
    async fn take(self) -> String {
        if let Some(mut reader) = self.reader {
            if tokio::time::timeout(OUTPUT_GRACE, &mut reader)
                .await
                .is_err()
            {
                reader.abort();
            }
        }
        let kept = self
            .kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        String::from_utf8_lossy(&kept).into_owned()
    }
}

/// `envoy --mode validate` on `config`'s bootstrap, with its extra arguments (they may shape
/// the config, e.g. `--config-yaml`).
pub async fn validate(config: &ProxyConfig) -> Result<(), PreflightError> {
    let mut args = vec![
        "--mode".to_owned(),
        "validate".to_owned(),
        "-c".to_owned(),
        config.config_path.display().to_string(),
    ];
    // Envoy refuses a flag given twice: the user's log level wins here too.
    if !crate::args::sets(&config.extra_args, &["-l", "--log-level"]) {
        args.extend(["-l".to_owned(), "error".to_owned()]);
    }
    args.extend(config.extra_args.iter().cloned());
    // During an upgrade the binary's path often stays while what it leads to changes (a
    // symlink repointed): the event names the file that was judged.
    let resolved = std::fs::canonicalize(&config.binary_path).ok();
    let started = std::time::Instant::now();
    let output = run(&config.binary_path, &args, "--mode validate").await;
    let took = started.elapsed();
    // One event per exec, so that a test (or an operator) can count them.
    let (outcome, result) = match output {
        Ok(output) if output.success => ("accepted", Ok(())),
        Ok(output) => (
            "rejected",
            Err(PreflightError::Invalid {
                path: config.config_path.clone(),
                message: last_lines(&output.text, 6),
            }),
        ),
        Err(e) => ("error", Err(e)),
    };
    tracing::info!(
        event = "validate",
        binary = %config.binary_path.display(),
        resolved = resolved.as_ref().map(|t| tracing::field::display(t.display())),
        config = %config.config_path.display(),
        outcome,
        duration_ms = took.as_secs_f64() * 1000.0,
        "envoy --mode validate ran"
    );
    result.and_then(|()| admin_unchanged(config))
}

/// A config Envoy accepts may still move its admin port, which the agent (and, with hot
/// restart, its watchdogs and a successor pod) reach Envoy at: a new epoch there would serve
/// unseen, and be killed at the handoff deadline. Refused before anything starts. An address
/// Envoy picks (port 0) or one that cannot be read here is left to Envoy.
fn admin_unchanged(config: &ProxyConfig) -> Result<(), PreflightError> {
    // The agent's own socket is put in place whatever the bootstrap says.
    let crate::AdminAddress::Fixed(running) = &config.admin else {
        return Ok(());
    };
    let Ok(new) = crate::bootstrap::admin_address(&config.config_path) else {
        return Ok(());
    };
    let moved = match (&new, running) {
        (Address::Tcp(new), Address::Tcp(old)) => new.port() != old.port() && new.port() != 0,
        (new, old) => new != old && new.tcp().is_none_or(|n| n.port() != 0),
    };
    if !moved {
        return Ok(());
    }
    Err(PreflightError::Invalid {
        path: config.config_path.clone(),
        message: format!(
            "it moves Envoy's admin address to {new}, but the agent reaches Envoy at \
             {running} (as does every epoch's successor): restart the agent to move it"
        ),
    })
}

/// `envoy --hot-restart-version` of `binary` (Envoy prints it on stderr), e.g. `11.104`.
pub async fn hot_restart_version(binary: &Path) -> Result<String, PreflightError> {
    let output = run(
        binary,
        &["--hot-restart-version".to_owned()],
        "--hot-restart-version",
    )
    .await?;
    let version = output.text.trim().to_owned();
    if !output.success || version.is_empty() || version.contains(char::is_whitespace) {
        return Err(PreflightError::Run {
            binary: binary.to_owned(),
            what: "--hot-restart-version",
            message: format!("unexpected output {version:?}"),
        });
    }
    Ok(version)
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// An "envoy" (a wrapper script, as some images ship) that answers, exits, and leaves a
    /// child holding its output pipes open for longer than the pre-flight's bound.
    #[tokio::test]
    async fn a_check_is_answered_at_the_exit_not_when_the_pipes_close() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("envoy");
        std::fs::write(&bin, "#!/bin/sh\necho 11.104 >&2\nsleep 60 &\nexit 0\n").unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let version = tokio::time::timeout(Duration::from_secs(10), hot_restart_version(&bin))
            .await
            .expect("answered once the script exited, not at the pre-flight's bound");
        assert_eq!(version.unwrap(), "11.104");
    }

    #[tokio::test]
    async fn only_the_end_of_a_long_output_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("envoy");
        std::fs::write(
            &bin,
            "#!/bin/sh\nhead -c 300000 /dev/zero | tr '\\0' x\necho\necho the reason >&2\nexit 1\n",
        )
        .unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let output = run(&bin, &[], "test").await.unwrap();
        assert!(!output.success);
        assert!(
            output.text.len() <= 2 * OUTPUT_KEPT,
            "{}",
            output.text.len()
        );
        assert!(
            output.text.ends_with("the reason\n"),
            "{}",
            &output.text[output.text.len() - 40..]
        );
    }
}

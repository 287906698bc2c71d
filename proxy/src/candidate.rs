//! A bootstrap checked before it is written: `envoy --mode validate` on a private candidate
//! file beside the real one. Apart from config_file.rs, which the pre-flight checks read
//! configs with: this module runs them.
//!
//! [`validate_candidate`] is the whole check. Its two steps, [`Candidate::write`] and
//! [`Candidate::validate`], are public too, for a check that keeps Envoy's verdicts (the
//! hot-restart crate's pre-flight cache): it decides whether the check runs at all, and must
//! tell a candidate that could not be written (no verdict) from a config Envoy rejects.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::preflight::PreflightError;
use crate::{ProxyConfig, ProxyError};

/// Validates `bytes` as the bootstrap of `config` with `envoy --mode validate`, on a candidate
/// file of this call's own beside the real one (same directory, so relative paths in the
/// bootstrap resolve alike; same extension, since Envoy picks the format from it). The
/// candidate is created exclusively and removed afterwards: concurrent calls never validate
/// each other's bytes. Nothing else on disk changes.
pub async fn validate_candidate(config: &ProxyConfig, bytes: &[u8]) -> Result<(), ProxyError> {
    Candidate::write(config, bytes)?
        .validate()
        .await
        .map_err(|e| e.rejecting(&config.config_path))
}

/// A bootstrap written to a candidate file of its own beside `config`'s (see
/// [`validate_candidate`]), not checked yet. Public for checks that go through a cache of
/// Envoy's verdicts (the hot-restart crate's), which write a candidate only when no verdict is
/// known. [`Candidate::validate`] removes the file; a `Candidate` dropped unchecked leaves it.
#[derive(Debug)]
pub struct Candidate {
    /// `config` with the candidate as its bootstrap.
    check: ProxyConfig,
}

impl Candidate {
    /// Writes `bytes` to a new candidate file beside `config`'s bootstrap, 0600. A write that
    /// fails removes what it wrote and is [`ProxyError::ConfigWrite`] naming the candidate.
    pub fn write(config: &ProxyConfig, bytes: &[u8]) -> Result<Candidate, ProxyError> {
        let candidate = candidate_path(&config.config_path);
        let write = (|| {
            use std::os::unix::fs::OpenOptionsExt;
            // 0600: the config may hold secrets, and a candidate is nobody else's business.
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&candidate)?;
            file.write_all(bytes)?;
            file.sync_all()
        })();
        if let Err(source) = write {
            let _ = fs::remove_file(&candidate);
            return Err(ProxyError::ConfigWrite {
                path: candidate,
                source,
            });
        }
        let mut check = config.clone();
        check.config_path = candidate;
        Ok(Candidate { check })
    }

    /// `envoy --mode validate` on the candidate ([`crate::preflight::validate`]), then removes
    /// it. A rejection names the candidate file.
    pub async fn validate(self) -> Result<(), PreflightError> {
        let validated = crate::preflight::validate(&self.check).await;
        let _ = fs::remove_file(&self.check.config_path);
        validated
    }
}

/// `.<stem>.candidate.<pid>.<n><.ext>` beside `path`: hidden, unique per call, same extension.
fn candidate_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let stem = path
        .file_stem()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = path
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    path.with_file_name(format!(
        ".{stem}.candidate.{}.{}{ext}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

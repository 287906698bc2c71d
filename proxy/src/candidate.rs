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
/// known. The file goes with the `Candidate`: after [`Candidate::validate`], or when it is
/// dropped unchecked, or with a validation cancelled mid-run (a restart given up, a stop).
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
        crate::preflight::validate(&self.check).await
    }
}

impl Drop for Candidate {
    fn drop(&mut self) {
        // Envoy's validation (killed on drop) is done with it by now, or gone.
        let _ = fs::remove_file(&self.check.config_path);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    use super::*;

    /// The candidate files beside `dir`'s bootstrap.
    fn candidates(dir: &Path) -> Vec<PathBuf> {
        fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.to_string_lossy().contains(".candidate."))
            .collect()
    }

    /// A config whose "Envoy" validates for as long as `seconds`.
    fn config_validating_for(dir: &Path, seconds: u32) -> ProxyConfig {
        let bin = dir.join("envoy");
        fs::write(&bin, format!("#!/bin/sh\nsleep {seconds}\n")).unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
        ProxyConfig::new(
            bin,
            dir.join("bootstrap.yaml"),
            crate::AdminAddress::FromFile(dir.join("admin")),
        )
    }

    #[tokio::test]
    async fn a_validation_cancelled_mid_run_leaves_no_candidate() {
        let dir = tempfile::tempdir().unwrap();
        let config = config_validating_for(dir.path(), 30);
        let cancelled = tokio::time::timeout(
            Duration::from_millis(200),
            validate_candidate(&config, b"admin: {}\n"),
        )
        .await;
        assert!(cancelled.is_err(), "still validating when cancelled");
        assert_eq!(candidates(dir.path()), Vec::<PathBuf>::new());
    }

    #[tokio::test]
    async fn a_candidate_dropped_unchecked_or_validated_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let config = config_validating_for(dir.path(), 0);
        let candidate = Candidate::write(&config, b"admin: {}\n").unwrap();
        assert_eq!(candidates(dir.path()).len(), 1, "written");
        drop(candidate);
        assert_eq!(candidates(dir.path()), Vec::<PathBuf>::new());
        Candidate::write(&config, b"admin: {}\n")
            .unwrap()
            .validate()
            .await
            .unwrap();
        assert_eq!(candidates(dir.path()), Vec::<PathBuf>::new());
    }
}

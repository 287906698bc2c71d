//! A bootstrap checked before it is written: `envoy --mode validate` on a private candidate
//! file beside the real one. Apart from config_file.rs, which the pre-flight checks read
//! configs with: this module runs them.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::preflight::PreflightError;
use crate::preflight::cache::{Lookup, PairKey, PreflightCache};
use crate::{ProxyConfig, ProxyError};

/// Validates `bytes` as the bootstrap of `config` with `envoy --mode validate`, on a candidate
/// file of this call's own beside the real one (same directory, so relative paths in the
/// bootstrap resolve alike; same extension, since Envoy picks the format from it). The
/// candidate is created exclusively and removed afterwards: concurrent calls never validate
/// each other's bytes. Nothing else on disk changes.
pub async fn validate_candidate(config: &ProxyConfig, bytes: &[u8]) -> Result<(), ProxyError> {
    let mut unwritten = None;
    let validated = validate_bytes(config, bytes, &mut unwritten).await;
    match unwritten {
        Some(e) => Err(e),
        None => validated.map_err(|e| rejected(config, e)),
    }
}

/// [`validate_candidate`] through `cache`: bytes already judged with this binary (and these
/// named files and arguments) are answered without an exec, and concurrent calls on the same
/// bytes share one. Keyed by content, so the hot restart that follows writing them finds the
/// verdict ready. Says whether it ran `--mode validate`.
pub async fn validate_candidate_cached(
    config: &ProxyConfig,
    bytes: &[u8],
    cache: &PreflightCache,
) -> Result<Lookup, ProxyError> {
    let key = PairKey::of(config, Some(bytes)).map_err(|e| rejected(config, e))?;
    let mut unwritten = None;
    let (validated, lookup) = cache
        .validate(key, &config.config_path, || {
            validate_bytes(config, bytes, &mut unwritten)
        })
        .await;
    match unwritten {
        Some(e) => Err(e),
        None => validated.map(|()| lookup).map_err(|e| rejected(config, e)),
    }
}

fn rejected(config: &ProxyConfig, e: PreflightError) -> ProxyError {
    let message = match e {
        PreflightError::Invalid { message, .. } => message,
        other => other.to_string(),
    };
    ProxyError::ConfigRejected {
        path: config.config_path.clone(),
        message,
    }
}

/// `--mode validate` on `bytes` written to a candidate file. A candidate that cannot be written
/// goes to `unwritten` (and the check counts as not run).
async fn validate_bytes(
    config: &ProxyConfig,
    bytes: &[u8],
    unwritten: &mut Option<ProxyError>,
) -> Result<(), PreflightError> {
    let path = &config.config_path;
    let candidate = candidate_path(path);
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
        let message = source.to_string();
        *unwritten = Some(ProxyError::ConfigWrite {
            path: candidate,
            source,
        });
        return Err(PreflightError::Run {
            binary: config.binary_path.clone(),
            what: "--mode validate",
            message: format!("cannot write the candidate config: {message}"),
        });
    }
    let mut check = config.clone();
    check.config_path = candidate.clone();
    let validated = crate::preflight::validate(&check).await;
    let _ = fs::remove_file(&candidate);
    validated
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

//! What Envoy already said about a (binary, config) pair, so that a hot restart with a binary
//! and a config that already passed (or already serve) execs nothing before Envoy itself.
//!
//! # Theory of operation
//!
//! - **Keys.** A binary is known by its identity on disk ([`FileId`]: device, inode, size,
//!   modification time), never by its path: a new release copied over the same path is another
//!   binary. A config is known by a SHA-256 digest ([`ConfigDigest`]) of everything
//!   `--mode validate` reads: the bootstrap's bytes and extension (Envoy picks the format from
//!   it), the identity of every local file the bootstrap or an overlay names in a `filename`
//!   field (certificates, keys, Lua sources; a missing file counts as missing), and the extra
//!   arguments (`--config-yaml` overlays included). Whatever changes any of these is another
//!   pair and is validated again. Outside the key: the environment, DNS, and files named in
//!   other fields (a runtime directory, a file-based xDS `path`); such a change is seen when
//!   Envoy starts, exactly as without the cache. The bootstrap's part of the digest (its
//!   bytes' digest and the names it names) is kept from the last parse while the file's
//!   identity stays the same: a restart with nothing changed reads and walks nothing (on a
//!   large bootstrap, most of a hit's time), and still looks at every named file. The names are
//!   found by a scan of the text (no parse of the document: bounded memory at any size).
//! - **Verdicts.** A pair is *good* when `--mode validate` accepted it or an epoch reached LIVE
//!   with it (the stronger proof: it replaces a rejection). It is *rejected* when Envoy refused
//!   it; the rejection is answered again, with Envoy's words, without another exec, until the
//!   pair changes. A check that could not run (a timeout, a binary that cannot be executed) is
//!   not a verdict and is never kept: the next call runs it again.
//! - **One check per pair at a time.** Each pair has one cell; every caller awaits the same
//!   run, so a watch's early validation, a SIGHUP and an `UpdateConfig` racing on the same
//!   bytes exec `--mode validate` once. `--hot-restart-version` is kept the same way, per
//!   binary. A caller dropped mid-run (its task aborted) leaves the cell empty for the next.
//! - **Config updates.** A new config's bytes are keyed before they are written anywhere, and
//!   checked on a candidate file ([`validate_candidate_cached`], on the `proxy` crate's
//!   [`Candidate`]) only when no verdict is known: the hot restart that follows writing them
//!   finds the verdict ready.
//! - **Bounded.** At most [`PAIRS_KEPT`] pairs and [`BINARIES_KEPT`] binaries; the oldest go
//!   first. The cache lives in memory, one per family: a new agent validates once.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::sync::OnceCell;

use envoy_agent_proxy::preflight::PreflightError;
use envoy_agent_proxy::{Candidate, ProxyConfig, ProxyError};

/// Pairs whose verdicts are kept.
pub const PAIRS_KEPT: usize = 64;
/// Binaries whose `--hot-restart-version` is kept.
pub const BINARIES_KEPT: usize = 8;

/// A file's identity on disk, following symlinks: what changes when it is replaced or written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

impl FileId {
    /// The inode number (which file, on its device: what logs name).
    pub fn inode(&self) -> u64 {
        self.ino
    }

    /// The identity of whatever `path` leads to now.
    pub fn of(path: &Path) -> std::io::Result<FileId> {
        let meta = std::fs::metadata(path)?;
        Ok(FileId {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        })
    }

    fn digest_into(&self, ctx: &mut ring::digest::Context) {
        ctx.update(&self.dev.to_le_bytes());
        ctx.update(&self.ino.to_le_bytes());
        ctx.update(&self.size.to_le_bytes());
        ctx.update(&self.mtime_ns.to_le_bytes());
    }
}

/// SHA-256 of what `--mode validate` reads besides the binary.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConfigDigest([u8; 32]);

impl std::fmt::Debug for ConfigDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

impl std::fmt::Display for ConfigDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Enough to tell configs apart in a log line.
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl ConfigDigest {
    /// The digest of a bootstrap: its `extension` (Envoy's format choice), `bytes`, the
    /// identity of each file named in a `filename` field of the bootstrap or of a
    /// `--config-yaml` overlay in `extra_args` (as `identity` finds it; `None` = missing), and
    /// `extra_args` themselves.
    pub fn of(
        extension: &str,
        bytes: &[u8],
        extra_args: &[String],
        identity: impl Fn(&Path) -> Option<FileId>,
    ) -> ConfigDigest {
        Parsed::of(extension, bytes, extra_args).digest(identity)
    }
}

/// What a config's digest takes from its bytes: their own digest and the files they name.
/// The costly part (on a large bootstrap, reading and walking megabytes), kept from the last
/// parse while the bootstrap file's identity stays the same ([`PairKey::of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Parsed {
    /// SHA-256 of the extension, the bytes and the extra arguments.
    base: [u8; 32],
    /// The files named in `filename` fields, sorted, without repeats.
    named: Vec<PathBuf>,
}

impl Parsed {
    fn of(extension: &str, bytes: &[u8], extra_args: &[String]) -> Parsed {
        use ring::digest::{Context, SHA256};
        let mut ctx = Context::new(&SHA256);
        // Lengths before variable parts: no two different inputs run together alike.
        let part = |ctx: &mut Context, bytes: &[u8]| {
            ctx.update(&(bytes.len() as u64).to_le_bytes());
            ctx.update(bytes);
        };
        part(&mut ctx, extension.as_bytes());
        part(&mut ctx, bytes);
        ctx.update(&(extra_args.len() as u64).to_le_bytes());
        for arg in extra_args {
            part(&mut ctx, arg.as_bytes());
        }
        let mut named = Vec::new();
        filenames_in(bytes, &mut named);
        let mut args = extra_args.iter();
        while let Some(arg) = args.next() {
            let overlay = match arg.strip_prefix("--config-yaml=") {
                Some(inline) => Some(inline),
                None if arg == "--config-yaml" => args.next().map(String::as_str),
                None => None,
            };
            if let Some(overlay) = overlay {
                filenames_in(overlay.as_bytes(), &mut named);
            }
        }
        named.sort();
        named.dedup();
        let mut base = [0; 32];
        base.copy_from_slice(ctx.finish().as_ref());
        Parsed { base, named }
    }

    /// The digest, with the named files' identities as `identity` finds them now.
    fn digest(&self, identity: impl Fn(&Path) -> Option<FileId>) -> ConfigDigest {
        use ring::digest::{Context, SHA256};
        let mut ctx = Context::new(&SHA256);
        ctx.update(&self.base);
        ctx.update(&(self.named.len() as u64).to_le_bytes());
        for name in &self.named {
            let bytes = name.as_os_str().as_encoded_bytes();
            ctx.update(&(bytes.len() as u64).to_le_bytes());
            ctx.update(bytes);
            match identity(name) {
                Some(id) => {
                    ctx.update(&[1]);
                    id.digest_into(&mut ctx);
                }
                None => ctx.update(&[0]),
            }
        }
        let mut out = [0; 32];
        out.copy_from_slice(ctx.finish().as_ref());
        ConfigDigest(out)
    }
}

/// Every value of a `filename` key anywhere in a YAML (or JSON) document: a quoted string, or
/// in YAML a plain one. Found by a scan of the text, in one pass and no memory beyond the
/// names: a YAML parser holds a document's every event (tens of MiB for a bootstrap of
/// thousands of clusters). What the scan does not resolve (a `filename: *alias`) names a file
/// that is not there: a stable part of the key, as a missing file is.
fn filenames_in(document: &[u8], out: &mut Vec<PathBuf>) {
    const KEY: &[u8] = b"filename";
    let json = document.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let mut at = 0;
    while let Some(found) = find(&document[at..], KEY) {
        let start = at + found;
        at = start + KEY.len();
        // A key of its own: not the end of `my_filename`, nor the start of `filenames`.
        let before = start.checked_sub(1).map(|i| document[i]);
        if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            continue;
        }
        let mut rest = &document[at..];
        if let Some(r) = rest.strip_prefix(b"\"").or_else(|| rest.strip_prefix(b"'")) {
            rest = r;
        }
        let rest = trim_start(rest);
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let rest = trim_start(rest);
        let value = match rest.first() {
            Some(q @ (b'"' | b'\'')) => rest[1..]
                .iter()
                .position(|b| b == q || *b == b'\n')
                .filter(|end| rest[1 + end] == *q)
                .map(|end| &rest[1..1 + end]),
            // A plain YAML scalar, to the end of its line or flow item.
            Some(b) if !json && !b"[{&*!|>#,\n".contains(b) => {
                let end = rest
                    .iter()
                    .position(|b| b"\n,}]#".contains(b))
                    .unwrap_or(rest.len());
                Some(trim_end(&rest[..end]))
            }
            _ => None,
        };
        if let Some(name) = value.filter(|v| !v.is_empty()) {
            out.push(PathBuf::from(String::from_utf8_lossy(name).into_owned()));
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn trim_start(bytes: &[u8]) -> &[u8] {
    let skip = bytes
        .iter()
        .position(|b| *b != b' ' && *b != b'\t')
        .unwrap_or(bytes.len());
    &bytes[skip..]
}

fn trim_end(bytes: &[u8]) -> &[u8] {
    let keep = bytes
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |i| i + 1);
    &bytes[..keep]
}

/// The last parse of the bootstrap file, kept while the file's identity, its extension and the
/// extra arguments stay the same: a restart with nothing changed then reads and walks nothing
/// (on a large bootstrap that was most of a cache hit's time, and of the agent's memory).
struct Memo {
    path: PathBuf,
    file: FileId,
    extra_args: Vec<String>,
    parsed: Parsed,
}

static MEMO: Mutex<Option<Memo>> = Mutex::new(None);

/// A (binary, config) pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PairKey {
    /// The binary's identity.
    pub binary: FileId,
    /// The config's digest.
    pub config: ConfigDigest,
}

impl PairKey {
    /// The pair `config` names as the disk holds it now; `bootstrap`, when given, stands for
    /// the bootstrap file's bytes (a candidate not written yet).
    pub fn of(config: &ProxyConfig, bootstrap: Option<&[u8]>) -> Result<PairKey, PreflightError> {
        let binary = FileId::of(&config.binary_path).map_err(|e| PreflightError::Run {
            binary: config.binary_path.clone(),
            what: "a look at the binary",
            message: e.to_string(),
        })?;
        let extension = config
            .config_path
            .extension()
            .map(|e| e.to_string_lossy().into_owned())
            .unwrap_or_default();
        let identity = |p: &Path| FileId::of(p).ok();
        if let Some(bytes) = bootstrap {
            let config = Parsed::of(&extension, bytes, &config.extra_args).digest(identity);
            return Ok(PairKey { binary, config });
        }
        let read = |e: std::io::Error| PreflightError::Read {
            path: config.config_path.clone(),
            message: e.to_string(),
        };
        let file = FileId::of(&config.config_path).map_err(read)?;
        let mut memo = MEMO
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let known = memo.as_ref().filter(|m| {
            m.file == file && m.path == config.config_path && m.extra_args == config.extra_args
        });
        let parsed = match known {
            Some(m) => m.parsed.clone(),
            None => {
                let bytes = envoy_agent_proxy::read_config(&config.config_path).map_err(read)?;
                let parsed = Parsed::of(&extension, &bytes, &config.extra_args);
                // The identity read before the bytes: a write in between changes it again,
                // and the next look parses anew.
                *memo = Some(Memo {
                    path: config.config_path.clone(),
                    file,
                    extra_args: config.extra_args.clone(),
                    parsed: parsed.clone(),
                });
                parsed
            }
        };
        drop(memo);
        Ok(PairKey {
            binary,
            config: parsed.digest(identity),
        })
    }
}

/// Whether a check ran or its answer was known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Known already (or another caller's run was joined): nothing was executed for this call.
    Hit,
    /// This call executed the binary.
    Miss,
}

impl Lookup {
    /// `hit` or `miss`, as in the logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Lookup::Hit => "hit",
            Lookup::Miss => "miss",
        }
    }

    /// A miss if either is one.
    pub fn and(self, other: Lookup) -> Lookup {
        if self == Lookup::Miss || other == Lookup::Miss {
            Lookup::Miss
        } else {
            Lookup::Hit
        }
    }
}

/// Envoy's verdict on a pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// `--mode validate` accepted it, or an epoch reached LIVE with it.
    Good,
    /// Envoy refused it, in these words.
    Rejected(String),
}

type Cell<T> = Arc<OnceCell<T>>;

#[derive(Debug, Default)]
struct Inner {
    verdicts: HashMap<PairKey, Cell<Verdict>>,
    pair_order: VecDeque<PairKey>,
    versions: HashMap<FileId, Cell<String>>,
    binary_order: VecDeque<FileId>,
}

/// Bounded map with insertion order: the cell for `key`, created (and the oldest evicted) if new.
fn cell<K: Copy + Eq + std::hash::Hash, T>(
    map: &mut HashMap<K, Cell<T>>,
    order: &mut VecDeque<K>,
    key: K,
    kept: usize,
) -> Cell<T> {
    if let Some(cell) = map.get(&key) {
        return cell.clone();
    }
    while order.len() >= kept {
        match order.pop_front() {
            Some(old) => {
                map.remove(&old);
            }
            None => break,
        }
    }
    order.push_back(key);
    map.entry(key).or_default().clone()
}

/// Pre-flight verdicts and hot-restart versions, shared by a family's supervisor and its
/// config updates. Cheap to clone (one shared map).
#[derive(Debug, Clone, Default)]
pub struct PreflightCache {
    inner: Arc<Mutex<Inner>>,
}

impl PreflightCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    fn verdict_cell(&self, key: PairKey) -> Cell<Verdict> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Inner {
            verdicts,
            pair_order,
            ..
        } = &mut *inner;
        cell(verdicts, pair_order, key, PAIRS_KEPT)
    }

    /// The verdict on `key`, if one is known.
    pub fn verdict(&self, key: &PairKey) -> Option<Verdict> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.verdicts.get(key).and_then(|c| c.get().cloned())
    }

    /// Validates `key` with `run` (`--mode validate` on those bytes) unless its verdict is known
    /// or being found by another caller. A rejection comes back as [`PreflightError::Invalid`]
    /// naming `path`, every time until the pair changes.
    pub async fn validate<F, Fut>(
        &self,
        key: PairKey,
        path: &Path,
        run: F,
    ) -> (Result<(), PreflightError>, Lookup)
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), PreflightError>>,
    {
        let cell = self.verdict_cell(key);
        let mut lookup = Lookup::Hit;
        let result = cell
            .get_or_try_init(|| {
                lookup = Lookup::Miss;
                async move {
                    match run().await {
                        Ok(()) => Ok(Verdict::Good),
                        Err(PreflightError::Invalid { message, .. }) => {
                            Ok(Verdict::Rejected(message))
                        }
                        Err(other) => Err(other),
                    }
                }
            })
            .await;
        let result = match result {
            Ok(Verdict::Good) => Ok(()),
            Ok(Verdict::Rejected(message)) => Err(PreflightError::Invalid {
                path: path.to_owned(),
                message: message.clone(),
            }),
            Err(e) => Err(e),
        };
        (result, lookup)
    }

    /// Records that an epoch reached LIVE with `key`: good, whatever was known before.
    pub fn mark_live(&self, key: PairKey) {
        let cell = self.verdict_cell(key);
        if cell.get() == Some(&Verdict::Good) {
            return;
        }
        if cell.set(Verdict::Good).is_err() {
            // A rejection (or a run in flight): LIVE is the stronger proof, so it replaces it.
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            inner
                .verdicts
                .insert(key, Arc::new(OnceCell::new_with(Some(Verdict::Good))));
        }
    }

    /// `binary`'s `--hot-restart-version`, found with `run` unless known.
    pub async fn hot_restart_version<F, Fut>(
        &self,
        binary: FileId,
        run: F,
    ) -> (Result<String, PreflightError>, Lookup)
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<String, PreflightError>>,
    {
        let cell = {
            let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let Inner {
                versions,
                binary_order,
                ..
            } = &mut *inner;
            cell(versions, binary_order, binary, BINARIES_KEPT)
        };
        let mut lookup = Lookup::Hit;
        let result = cell
            .get_or_try_init(|| {
                lookup = Lookup::Miss;
                run()
            })
            .await
            .cloned();
        (result, lookup)
    }

    /// Records `binary`'s hot-restart version as a running Envoy of it reported it.
    pub fn learn_version(&self, binary: FileId, version: String) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Inner {
            versions,
            binary_order,
            ..
        } = &mut *inner;
        let _ = cell(versions, binary_order, binary, BINARIES_KEPT).set(version);
    }
}

/// [`envoy_agent_proxy::validate_candidate`] through `cache`: bytes already judged with this
/// binary (and these named files and arguments) are answered without an exec, and concurrent
/// calls on the same bytes share one. Keyed by content, so the hot restart that follows writing
/// them finds the verdict ready. Says whether it ran `--mode validate`.
pub async fn validate_candidate_cached(
    config: &ProxyConfig,
    bytes: &[u8],
    cache: &PreflightCache,
) -> Result<Lookup, ProxyError> {
    let rejected = |e: PreflightError| e.rejecting(&config.config_path);
    let key = PairKey::of(config, Some(bytes)).map_err(rejected)?;
    // A candidate that cannot be written is answered with the write's error; to the cache it
    // is a check that could not run, which it does not keep.
    let mut unwritten = None;
    let slot = &mut unwritten;
    let (validated, lookup) = cache
        .validate(key, &config.config_path, move || async move {
            match Candidate::write(config, bytes) {
                Ok(candidate) => candidate.validate().await,
                Err(e) => {
                    let message = match &e {
                        ProxyError::ConfigWrite { source, .. } => source.to_string(),
                        other => other.to_string(),
                    };
                    *slot = Some(e);
                    Err(PreflightError::Run {
                        binary: config.binary_path.clone(),
                        what: "--mode validate",
                        message: format!("cannot write the candidate config: {message}"),
                    })
                }
            }
        })
        .await;
    match unwritten {
        Some(e) => Err(e),
        None => validated.map(|()| lookup).map_err(rejected),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn id(n: u64) -> FileId {
        FileId {
            dev: 1,
            ino: n,
            size: 100,
            mtime_ns: 5,
        }
    }

    fn digest(bytes: &str, args: &[&str]) -> ConfigDigest {
        let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
        ConfigDigest::of("yaml", bytes.as_bytes(), &args, |_| Some(id(9)))
    }

    fn key(binary: u64, config: &str) -> PairKey {
        PairKey {
            binary: id(binary),
            config: digest(config, &[]),
        }
    }

    #[test]
    fn the_config_digest_follows_bytes_overlays_args_and_format() {
        let base = digest("a: 1", &[]);
        assert_eq!(base, digest("a: 1", &[]));
        assert_ne!(base, digest("a: 2", &[]));
        assert_ne!(base, digest("a: 1", &["--config-yaml", "b: 2"]));
        assert_ne!(
            digest("a: 1", &["--config-yaml", "b: 2"]),
            digest("a: 1", &["--config-yaml", "b: 3"])
        );
        assert_ne!(base, digest("a: 1", &["--concurrency", "2"]));
        // Arguments do not run together: ["ab"] is not ["a", "b"].
        assert_ne!(digest("x", &["ab"]), digest("x", &["a", "b"]));
        assert_ne!(
            base,
            ConfigDigest::of("json", b"a: 1", &[], |_| None),
            "the extension picks envoy's format"
        );
    }

    #[test]
    fn the_config_digest_follows_named_files() {
        let doc = "static_resources:\n  secrets:\n  - tls_certificate:\n      certificate_chain: {filename: /certs/a.pem}\n      private_key: {filename: \"/certs/key.pem\"}\n";
        let with = |a: Option<FileId>| {
            ConfigDigest::of("yaml", doc.as_bytes(), &[], |p| {
                if p == Path::new("/certs/a.pem") {
                    a
                } else {
                    Some(id(7))
                }
            })
        };
        assert_eq!(with(Some(id(1))), with(Some(id(1))));
        assert_ne!(
            with(Some(id(1))),
            with(Some(id(2))),
            "a replaced certificate"
        );
        assert_ne!(with(Some(id(1))), with(None), "a removed certificate");

        // A file an overlay names counts too.
        let overlay = |n: u64| {
            ConfigDigest::of(
                "yaml",
                b"a: 1",
                &["--config-yaml=lua: {filename: /x.lua}".to_owned()],
                |_| Some(id(n)),
            )
        };
        assert_ne!(overlay(1), overlay(2));
    }

    #[test]
    fn filenames_are_found_anywhere() {
        let mut out = Vec::new();
        filenames_in(
            b"{\"a\": [{\"filename\": \"/x\"}, {\"b\": {\"filename\": \"rel/y\"}}], \"filename\": 3}",
            &mut out,
        );
        assert_eq!(out, [PathBuf::from("/x"), PathBuf::from("rel/y")]);
        let mut none = Vec::new();
        filenames_in(b"{ not yaml: [", &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn filenames_are_found_in_yaml_with_tags_anchors_and_many_documents() {
        let mut out = Vec::new();
        filenames_in(
            b"a: &cert {filename: /certs/a.pem}\nb: *cert\nc: !tagged {filename: /t}\nd:\n  - filename: ''\n  - {filename: [1, 2]}\n---\nfilename: /second\n",
            &mut out,
        );
        out.sort();
        out.dedup();
        assert_eq!(
            out,
            [
                PathBuf::from("/certs/a.pem"),
                PathBuf::from("/second"),
                PathBuf::from("/t")
            ]
        );
    }

    #[test]
    fn the_key_of_an_unchanged_bootstrap_is_kept_and_still_follows_named_files() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("cert.pem");
        std::fs::write(&cert, "one").unwrap();
        let bootstrap = dir.path().join("bootstrap.yaml");
        let doc = |n: u32| format!("n: {n}\nsecret: {{filename: {}}}\n", cert.display());
        std::fs::write(&bootstrap, doc(1)).unwrap();
        let config = ProxyConfig::new(
            dir.path().join("envoy"),
            bootstrap.clone(),
            envoy_agent_proxy::AdminAddress::FromFile(dir.path().join("admin")),
        );
        std::fs::write(dir.path().join("envoy"), "").unwrap();
        let first = PairKey::of(&config, None).unwrap();
        assert_eq!(first, PairKey::of(&config, None).unwrap());
        assert_eq!(
            first,
            PairKey::of(&config, Some(doc(1).as_bytes())).unwrap(),
            "the same as from the bytes"
        );
        // A named file replaced: another key, though the bootstrap is the same file.
        std::fs::write(dir.path().join("cert.new"), "two").unwrap();
        std::fs::rename(dir.path().join("cert.new"), &cert).unwrap();
        let replaced = PairKey::of(&config, None).unwrap();
        assert_ne!(first, replaced);
        // The bootstrap rewritten: another key.
        std::fs::write(&bootstrap, doc(2)).unwrap();
        assert_ne!(replaced, PairKey::of(&config, None).unwrap());
    }

    #[test]
    fn file_identity_changes_when_the_file_is_replaced_or_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("envoy");
        std::fs::write(&path, b"one").unwrap();
        let first = FileId::of(&path).unwrap();
        assert_eq!(first, FileId::of(&path).unwrap());
        std::fs::write(&path, b"other").unwrap();
        assert_ne!(first, FileId::of(&path).unwrap(), "rewritten in place");
        let next = dir.path().join("envoy.new");
        std::fs::write(&next, b"other").unwrap();
        let before = FileId::of(&path).unwrap();
        std::fs::rename(&next, &path).unwrap();
        assert_ne!(before, FileId::of(&path).unwrap(), "replaced by rename");
    }

    async fn check(
        cache: &PreflightCache,
        key: PairKey,
        answer: Result<(), &str>,
        runs: &AtomicUsize,
    ) -> (Result<(), PreflightError>, Lookup) {
        cache
            .validate(key, Path::new("/b.yaml"), || async {
                runs.fetch_add(1, Ordering::SeqCst);
                answer.map_err(|m| PreflightError::Invalid {
                    path: PathBuf::from("/candidate.yaml"),
                    message: m.to_owned(),
                })
            })
            .await
    }

    #[tokio::test]
    async fn a_good_pair_is_validated_once() {
        let cache = PreflightCache::new();
        let runs = AtomicUsize::new(0);
        let (r, l) = check(&cache, key(1, "a"), Ok(()), &runs).await;
        assert!(r.is_ok());
        assert_eq!(l, Lookup::Miss);
        let (r, l) = check(&cache, key(1, "a"), Err("never asked"), &runs).await;
        assert!(r.is_ok());
        assert_eq!(l, Lookup::Hit);
        assert_eq!(runs.load(Ordering::SeqCst), 1);

        // Another binary or another config is another pair.
        assert_eq!(
            check(&cache, key(2, "a"), Ok(()), &runs).await.1,
            Lookup::Miss
        );
        assert_eq!(
            check(&cache, key(1, "b"), Ok(()), &runs).await.1,
            Lookup::Miss
        );
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_rejected_pair_is_rejected_again_without_exec_until_it_changes() {
        let cache = PreflightCache::new();
        let runs = AtomicUsize::new(0);
        let (r, l) = check(&cache, key(1, "bad"), Err("unknown field"), &runs).await;
        assert_eq!(l, Lookup::Miss);
        let again = check(&cache, key(1, "bad"), Ok(()), &runs).await;
        assert_eq!(again.1, Lookup::Hit);
        for result in [r, again.0] {
            match result {
                Err(PreflightError::Invalid { path, message }) => {
                    assert_eq!(path, Path::new("/b.yaml"), "named as the caller's config");
                    assert_eq!(message, "unknown field");
                }
                other => panic!("expected the rejection, got {other:?}"),
            }
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Fixed: validated again, once.
        let (r, l) = check(&cache, key(1, "good"), Ok(()), &runs).await;
        assert!(r.is_ok());
        assert_eq!(l, Lookup::Miss);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_check_that_could_not_run_is_not_kept() {
        let cache = PreflightCache::new();
        let (r, l) = cache
            .validate(key(1, "a"), Path::new("/b.yaml"), || async {
                Err(PreflightError::Run {
                    binary: PathBuf::from("/envoy"),
                    what: "--mode validate",
                    message: "no answer".to_owned(),
                })
            })
            .await;
        assert!(matches!(r, Err(PreflightError::Run { .. })));
        assert_eq!(l, Lookup::Miss);
        assert_eq!(cache.verdict(&key(1, "a")), None);
        let runs = AtomicUsize::new(0);
        assert!(check(&cache, key(1, "a"), Ok(()), &runs).await.0.is_ok());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_live_epoch_marks_its_pair_good() {
        let cache = PreflightCache::new();
        let runs = AtomicUsize::new(0);
        cache.mark_live(key(1, "a"));
        assert_eq!(cache.verdict(&key(1, "a")), Some(Verdict::Good));
        assert_eq!(
            check(&cache, key(1, "a"), Err("x"), &runs).await.1,
            Lookup::Hit
        );
        // Even over an earlier rejection.
        let _ = check(&cache, key(1, "b"), Err("strict"), &runs).await;
        cache.mark_live(key(1, "b"));
        assert!(check(&cache, key(1, "b"), Err("x"), &runs).await.0.is_ok());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn racing_callers_share_one_run() {
        let cache = PreflightCache::new();
        let runs = AtomicUsize::new(0);
        let (gate_tx, gate_rx) = tokio::sync::watch::channel(false);
        let slow = |cache: PreflightCache,
                    runs: &'static AtomicUsize,
                    mut gate: tokio::sync::watch::Receiver<bool>| async move {
            cache
                .validate(key(1, "a"), Path::new("/b.yaml"), || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let _ = gate.wait_for(|open| *open).await;
                    Ok(())
                })
                .await
        };
        let runs: &'static AtomicUsize = Box::leak(Box::new(runs));
        let a = tokio::spawn(slow(cache.clone(), runs, gate_rx.clone()));
        let b = tokio::spawn(slow(cache.clone(), runs, gate_rx.clone()));
        tokio::task::yield_now().await;
        let _ = gate_tx.send(true);
        let (a, b) = (a.await.unwrap(), b.await.unwrap());
        assert!(a.0.is_ok() && b.0.is_ok());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let mut lookups = [a.1, b.1];
        lookups.sort_by_key(|l| l.as_str());
        assert_eq!(lookups, [Lookup::Hit, Lookup::Miss]);
    }

    #[tokio::test]
    async fn versions_are_kept_per_binary() {
        let cache = PreflightCache::new();
        let runs = AtomicUsize::new(0);
        let ask = |n: u64| {
            let cache = cache.clone();
            let runs = &runs;
            async move {
                cache
                    .hot_restart_version(id(n), || async {
                        runs.fetch_add(1, Ordering::SeqCst);
                        Ok("11.104".to_owned())
                    })
                    .await
            }
        };
        assert_eq!(ask(1).await.1, Lookup::Miss);
        assert_eq!(ask(1).await.1, Lookup::Hit);
        assert_eq!(ask(2).await.1, Lookup::Miss);
        cache.learn_version(id(3), "11.120".to_owned());
        let (v, l) = ask(3).await;
        assert_eq!((v.unwrap().as_str(), l), ("11.120", Lookup::Hit));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn the_cache_is_bounded() {
        let cache = PreflightCache::new();
        for n in 0..(PAIRS_KEPT as u64 + 10) {
            cache.mark_live(key(n, "a"));
        }
        let inner = cache.inner.lock().unwrap();
        assert_eq!(inner.verdicts.len(), PAIRS_KEPT);
        assert!(
            !inner.verdicts.contains_key(&key(0, "a")),
            "the oldest went first"
        );
    }
}

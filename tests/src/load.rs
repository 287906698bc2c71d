//! A load generator for zero-downtime checks: real HTTP/1.1 requests on 127.0.0.1, from a
//! fixed number of workers, until stopped. Two kinds of worker:
//!
//! - **keep-alive**: one connection, requests back to back; when the server says
//!   `Connection: close` (a draining Envoy) the worker reconnects. Not a failure.
//! - **new connection per request**: connect, one request, close.
//!
//! A failure is any request that does not get a complete `200` response: refused or reset
//! connections, an early EOF, a timeout, another status. Every failure is kept (the first few
//! with their error) so a test can say what went wrong.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use crate::KeepAlive;

/// Bound on one request of the load.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Failures kept with their error text.
const ERRORS_KEPT: usize = 20;
/// The width of one bucket of [`LoadReport::timeline`].
pub const BUCKET: Duration = Duration::from_millis(100);

/// What the load saw.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    /// Requests answered 200.
    pub ok: u64,
    /// Requests that failed.
    pub failed: u64,
    /// The first failures, with their error.
    pub errors: Vec<String>,
    /// When each failure was seen, Unix milliseconds.
    pub failure_times: Vec<u64>,
    /// Requests answered and failed in each [`BUCKET`] since [`Load::started`].
    pub timeline: Vec<Bucket>,
}

/// Requests finished within one [`BUCKET`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bucket {
    /// Answered 200.
    pub ok: u64,
    /// Failed.
    pub failed: u64,
}

impl LoadReport {
    /// How many requests failed before `unix_ms` (e.g. an event's `at_unix_ms`).
    pub fn failed_before(&self, unix_ms: u64) -> usize {
        self.failure_times.iter().filter(|t| **t < unix_ms).count()
    }
}

/// Now, in Unix milliseconds.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

struct Counters {
    started: Instant,
    ok: AtomicU64,
    failed: AtomicU64,
    errors: std::sync::Mutex<Vec<String>>,
    failure_times: std::sync::Mutex<Vec<u64>>,
    timeline: std::sync::Mutex<Vec<Bucket>>,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            started: Instant::now(),
            ok: AtomicU64::default(),
            failed: AtomicU64::default(),
            errors: std::sync::Mutex::default(),
            failure_times: std::sync::Mutex::default(),
            timeline: std::sync::Mutex::default(),
        }
    }
}

impl Counters {
    fn bucket(&self, f: impl FnOnce(&mut Bucket)) {
        let i = (self.started.elapsed().as_millis() / BUCKET.as_millis()) as usize;
        if let Ok(mut timeline) = self.timeline.lock() {
            if timeline.len() <= i {
                timeline.resize(i + 1, Bucket::default());
            }
            f(&mut timeline[i]);
        }
    }

    fn succeed(&self) {
        self.ok.fetch_add(1, Ordering::Relaxed);
        self.bucket(|b| b.ok += 1);
    }

    fn fail(&self, kind: &str, error: String) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        self.bucket(|b| b.failed += 1);
        if let Ok(mut times) = self.failure_times.lock() {
            times.push(unix_ms());
        }
        if let Ok(mut errors) = self.errors.lock()
            && errors.len() < ERRORS_KEPT
        {
            errors.push(format!("{kind}: {error}"));
        }
    }
}

/// Load running in the background until [`Load::stop`].
#[derive(Debug)]
pub struct Load {
    stop: Arc<AtomicBool>,
    counters: Arc<CountersHandle>,
    workers: Vec<JoinHandle<()>>,
}

#[derive(Default)]
struct CountersHandle(Counters);

impl std::fmt::Debug for CountersHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters")
            .field("ok", &self.0.ok.load(Ordering::Relaxed))
            .field("failed", &self.0.failed.load(Ordering::Relaxed))
            .finish()
    }
}

impl Load {
    /// Starts `keep_alive` keep-alive workers and `per_request` new-connection workers
    /// against `addr`, each sending `GET path` in a loop.
    pub fn start(addr: SocketAddr, path: &str, keep_alive: usize, per_request: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(CountersHandle::default());
        let mut workers = Vec::new();
        for _ in 0..keep_alive {
            let (stop, counters, path) = (stop.clone(), counters.clone(), path.to_owned());
            workers.push(tokio::spawn(async move {
                let mut conn: Option<KeepAlive> = None;
                while !stop.load(Ordering::Relaxed) {
                    if conn.is_none() {
                        match KeepAlive::connect(addr).await {
                            Ok(c) => conn = Some(c),
                            Err(e) => {
                                counters.0.fail("keep-alive connect", e.to_string());
                                tokio::time::sleep(Duration::from_millis(10)).await;
                                continue;
                            }
                        }
                    }
                    let Some(c) = conn.as_mut() else { continue };
                    match tokio::time::timeout(REQUEST_TIMEOUT, c.get(&path)).await {
                        Ok(Ok(r)) if r.status == 200 => {
                            counters.0.succeed();
                            if r.connection_close() {
                                conn = None;
                            }
                        }
                        Ok(Ok(r)) => {
                            counters
                                .0
                                .fail("keep-alive", format!("status {}", r.status));
                            conn = None;
                        }
                        Ok(Err(e)) => {
                            counters.0.fail("keep-alive", e.to_string());
                            conn = None;
                        }
                        Err(_) => {
                            counters.0.fail("keep-alive", "timed out".to_owned());
                            conn = None;
                        }
                    }
                }
            }));
        }
        for _ in 0..per_request {
            let (stop, counters, path) = (stop.clone(), counters.clone(), path.to_owned());
            workers.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let request = async {
                        let mut c = KeepAlive::connect(addr).await?;
                        c.get(&path).await
                    };
                    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
                        Ok(Ok(r)) if r.status == 200 => counters.0.succeed(),
                        Ok(Ok(r)) => counters
                            .0
                            .fail("new-connection", format!("status {}", r.status)),
                        Ok(Err(e)) => {
                            counters.0.fail("new-connection", e.to_string());
                            // A refused connect fails at once: without a pause the worker
                            // spins (75k failures a second while Envoy is down), starving
                            // the test's own task and, on 2 cores, the other tests.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        Err(_) => counters.0.fail("new-connection", "timed out".to_owned()),
                    }
                }
            }));
        }
        Load {
            stop,
            counters,
            workers,
        }
    }

    /// When the load started: the origin of [`LoadReport::timeline`].
    pub fn started(&self) -> Instant {
        self.counters.0.started
    }

    /// Requests answered so far.
    pub fn ok(&self) -> u64 {
        self.counters.0.ok.load(Ordering::Relaxed)
    }

    /// Requests failed so far.
    pub fn failed(&self) -> u64 {
        self.counters.0.failed.load(Ordering::Relaxed)
    }

    /// When each failure so far was seen (Unix milliseconds), oldest first, with the first
    /// failures' errors: for a harness that checks failures while the load runs (the soak).
    pub fn failures_so_far(&self) -> (Vec<u64>, Vec<String>) {
        let times = self
            .counters
            .0
            .failure_times
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default();
        let errors = self
            .counters
            .0
            .errors
            .lock()
            .map(|e| e.clone())
            .unwrap_or_default();
        (times, errors)
    }

    /// Stops the workers (each finishes its request in flight) and reports.
    pub async fn stop(self) -> LoadReport {
        self.stop.store(true, Ordering::Relaxed);
        for worker in self.workers {
            let _ = worker.await;
        }
        LoadReport {
            ok: self.counters.0.ok.load(Ordering::Relaxed),
            failed: self.counters.0.failed.load(Ordering::Relaxed),
            errors: self
                .counters
                .0
                .errors
                .lock()
                .map(|e| e.clone())
                .unwrap_or_default(),
            failure_times: self
                .counters
                .0
                .failure_times
                .lock()
                .map(|e| e.clone())
                .unwrap_or_default(),
            timeline: self
                .counters
                .0
                .timeline
                .lock()
                .map(|t| t.clone())
                .unwrap_or_default(),
        }
    }
}

//! The agent's standard output and error, written by a thread of their own: nothing the agent
//! or Envoy does ever waits on the reader of its logs.
//!
//! # Why
//!
//! A log reader that stops reading (a stalled log collector, a container runtime's log pipe
//! under disk pressure) leaves a pipe that takes 64 KiB and then blocks every `write`. Written
//! from the agent's loop, that froze the agent (readiness, gRPC, signals, timers, watchdogs);
//! copied from Envoy's stderr with a blocking write, it filled Envoy's own stderr pipe and
//! blocked every Envoy thread that logs, traffic included.
//!
//! # Theory of operation
//!
//! Each [`Stream`] (the process's [`stdout`] and [`stderr`]) is a bounded queue of whole lines
//! (at most [`QUEUE_BYTES`]) and one thread, started with the first line, that writes them to
//! the descriptor in order with blocking writes. [`Stream::write_lines`] never blocks: when a
//! line does not fit, it is dropped and counted. Once a write goes through again after a
//! drop, the thread says how many lines were dropped in one `log_lines_dropped` event (the
//! agent's log, so in its format): the reader is taking lines again. [`dropped_lines`] is the
//! total, for the status, `GetStatus` and the metrics.
//!
//! Lines are kept whole: a writer hands over complete lines (tracing's formatter writes one
//! event at a time; Envoy's output goes through [`Lines`], which holds a partial line back
//! until its end arrives), so a drop never splices two lines together, and one queue per
//! descriptor keeps the agent's lines and Envoy's from interleaving mid-line.
//!
//! The writing thread writes with `write(2)` on the raw descriptor, not through
//! `std::io::Stderr`, whose lock it would hold while blocked (a panic message would then
//! wait too). It is never joined: [`Stream::flush`] waits for the queue to empty, bounded, and
//! a thread blocked on a stalled reader ends with the process.
//!
//! This is tracing-appender's non-blocking writer, in lossy mode, grown where the agent needs
//! more than it gives: a byte stream of someone else's (Envoy's) cut at line ends, one queue
//! shared by the agent's lines and Envoy's, a bound in bytes rather than lines (Envoy's debug
//! lines are long), and knowing when the reader takes lines again, which is when the drop is
//! worth saying (tracing-appender only counts).

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// How many bytes of lines a stream holds for a reader that is behind: a few seconds of
/// Envoy at debug level.
pub const QUEUE_BYTES: usize = 1 << 20;
/// A partial line longer than this is handed on as it is (a line end may never come).
const LONGEST_LINE: usize = 64 << 10;
/// How long [`Stream::flush`] waits without the reader taking a line.
const FLUSH_STALL: Duration = Duration::from_millis(300);

/// What a stream says once its reader takes lines again after `dropped` were dropped
/// (`total` since the start).
type Report = Box<dyn Fn(&'static str, u64, u64) + Send + Sync>;

/// One descriptor written by a thread of its own.
pub struct Stream {
    inner: Arc<Inner>,
}

struct Inner {
    name: &'static str,
    target: Target,
    queue: Mutex<Queue>,
    /// Signalled when a line is queued (the writer waits on it) and when one was written or
    /// the queue emptied (flushers wait on it).
    changed: Condvar,
    /// Lines dropped since the start.
    dropped_total: AtomicU64,
    report: Report,
}

enum Target {
    Stdout,
    Stderr,
    Fd(OwnedFd),
}

#[derive(Default)]
struct Queue {
    lines: VecDeque<Vec<u8>>,
    bytes: usize,
    /// Lines dropped since the last report.
    unreported: u64,
    /// A line is being written (taken off the queue, not done).
    writing: bool,
    /// How many writes have completed (flushers see progress by it).
    written: u64,
    /// The writing thread runs.
    started: bool,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("name", &self.inner.name)
            .field("dropped", &self.dropped())
            .finish_non_exhaustive()
    }
}

/// The process's standard output.
pub fn stdout() -> &'static Stream {
    static STDOUT: OnceLock<Stream> = OnceLock::new();
    STDOUT.get_or_init(|| Stream::with_target("stdout", Target::Stdout, Box::new(log_report)))
}

/// The process's standard error: the agent's own log, and Envoy's.
pub fn stderr() -> &'static Stream {
    static STDERR: OnceLock<Stream> = OnceLock::new();
    STDERR.get_or_init(|| Stream::with_target("stderr", Target::Stderr, Box::new(log_report)))
}

/// Lines dropped since the start on stdout and stderr together, because their reader did not
/// take them.
pub fn dropped_lines() -> u64 {
    stdout().dropped() + stderr().dropped()
}

/// Waits until both streams have written what they hold, at most `within` in all, and no
/// longer than a moment once the reader stops taking lines.
pub fn flush(within: Duration) {
    let deadline = Instant::now() + within;
    stderr().flush_until(deadline);
    stdout().flush_until(deadline);
}

fn log_report(stream: &'static str, dropped: u64, total: u64) {
    tracing::warn!(
        event = "log_lines_dropped",
        stream,
        dropped,
        total,
        "{dropped} lines were dropped from {stream} while its reader was not reading"
    );
}

// === impl Stream ===

impl Stream {
    /// A stream writing to `fd`; `report` is called on its writing thread once the reader
    /// takes lines again after some were dropped.
    pub fn new(
        name: &'static str,
        fd: OwnedFd,
        report: impl Fn(&'static str, u64, u64) + Send + Sync + 'static,
    ) -> Stream {
        Stream::with_target(name, Target::Fd(fd), Box::new(report))
    }

    fn with_target(name: &'static str, target: Target, report: Report) -> Stream {
        Stream {
            inner: Arc::new(Inner {
                name,
                target,
                queue: Mutex::new(Queue::default()),
                changed: Condvar::new(),
                dropped_total: AtomicU64::new(0),
                report,
            }),
        }
    }

    /// Queues `lines` (whole lines, or a last partial one) to be written; never blocks. When
    /// they do not fit they are dropped and counted, and the answer is `false`.
    pub fn write_lines(&self, lines: &[u8]) -> bool {
        if lines.is_empty() {
            return true;
        }
        let mut queue = self.inner.lock();
        if queue.bytes + lines.len() > QUEUE_BYTES {
            let n = line_count(lines);
            queue.unreported += n;
            self.inner.dropped_total.fetch_add(n, Ordering::Relaxed);
            return false;
        }
        queue.bytes += lines.len();
        queue.lines.push_back(lines.to_vec());
        if !queue.started {
            queue.started = true;
            let inner = self.inner.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{}-writer", self.inner.name))
                .spawn(move || inner.write_forever());
            if spawned.is_err() {
                // No thread, no writes: try again with the next line.
                queue.started = false;
            }
        }
        drop(queue);
        self.inner.changed.notify_all();
        true
    }

    /// Lines dropped since the start.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped_total.load(Ordering::Relaxed)
    }

    /// Waits until everything queued is written, at most `within`.
    pub fn flush(&self, within: Duration) -> bool {
        self.flush_until(Instant::now() + within)
    }

    fn flush_until(&self, deadline: Instant) -> bool {
        let mut queue = self.inner.lock();
        let mut progress = (queue.written, Instant::now());
        loop {
            if queue.lines.is_empty() && !queue.writing {
                return true;
            }
            if queue.written != progress.0 {
                progress = (queue.written, Instant::now());
            }
            let now = Instant::now();
            let until = deadline.min(progress.1 + FLUSH_STALL);
            if now >= until {
                return false;
            }
            queue = match self.inner.changed.wait_timeout(queue, until - now) {
                Ok((queue, _)) => queue,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }
}

/// Each write is whole lines (tracing's formatter writes one event at a time).
impl std::io::Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_lines(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// === impl Inner ===

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding the lock leaves a queue that is still consistent.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write_once(&self, bytes: &[u8]) -> nix::Result<usize> {
        match &self.target {
            Target::Stdout => nix::unistd::write(std::io::stdout(), bytes),
            Target::Stderr => nix::unistd::write(std::io::stderr(), bytes),
            Target::Fd(fd) => nix::unistd::write(fd, bytes),
        }
    }

    fn write_forever(&self) {
        loop {
            let line = {
                let mut queue = self.lock();
                loop {
                    if let Some(line) = queue.lines.pop_front() {
                        queue.bytes -= line.len();
                        queue.writing = true;
                        break line;
                    }
                    queue.writing = false;
                    self.changed.notify_all();
                    queue = self.changed.wait(queue).unwrap_or_else(|p| p.into_inner());
                }
            };
            let wrote = self.write_all(&line);
            let report = {
                let mut queue = self.lock();
                queue.written += 1;
                if !wrote {
                    // A reader that is gone (EPIPE) or a descriptor that is: the line is lost.
                    let n = line_count(&line);
                    queue.unreported += n;
                    self.dropped_total.fetch_add(n, Ordering::Relaxed);
                }
                let report = (wrote && queue.unreported > 0).then(|| {
                    let n = queue.unreported;
                    queue.unreported = 0;
                    n
                });
                self.changed.notify_all();
                report
            };
            if let Some(dropped) = report {
                (self.report)(
                    self.name,
                    dropped,
                    self.dropped_total.load(Ordering::Relaxed),
                );
            }
        }
    }

    /// Writes `bytes` whole, waiting as long as the reader takes; whether it went through.
    fn write_all(&self, mut bytes: &[u8]) -> bool {
        while !bytes.is_empty() {
            match self.write_once(bytes) {
                Ok(0) => return false,
                Ok(n) => bytes = &bytes[n..],
                Err(nix::errno::Errno::EINTR) => {}
                // A descriptor someone made non-blocking: wait for room, as a blocking one would.
                Err(nix::errno::Errno::EAGAIN) => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => return false,
            }
        }
        true
    }
}

/// The lines in `bytes`; a partial one counts.
fn line_count(bytes: &[u8]) -> u64 {
    let ends = bytes.iter().filter(|b| **b == b'\n').count() as u64;
    if bytes.last() == Some(&b'\n') {
        ends
    } else {
        ends + 1
    }
}

/// Cuts someone else's byte stream (Envoy's stdout or stderr) at line ends for a [`Stream`],
/// holding a partial line back until its end arrives.
#[derive(Debug)]
pub struct Lines {
    stream: &'static Stream,
    partial: Vec<u8>,
}

impl Lines {
    /// Lines for `stream`.
    pub fn new(stream: &'static Stream) -> Lines {
        Lines {
            stream,
            partial: Vec::new(),
        }
    }

    /// Hands on the complete lines of what came so far.
    pub fn push(&mut self, mut bytes: &[u8]) {
        if let Some(end) = bytes.iter().rposition(|b| *b == b'\n') {
            let (whole, rest) = bytes.split_at(end + 1);
            if self.partial.is_empty() {
                self.stream.write_lines(whole);
            } else {
                self.partial.extend_from_slice(whole);
                self.stream.write_lines(&self.partial);
                self.partial.clear();
            }
            bytes = rest;
        }
        self.partial.extend_from_slice(bytes);
        if self.partial.len() > LONGEST_LINE {
            self.stream.write_lines(&self.partial);
            self.partial.clear();
        }
    }

    /// Hands on what is left (the stream ended).
    pub fn finish(&mut self) {
        if !self.partial.is_empty() {
            self.stream.write_lines(&self.partial);
            self.partial.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::sync::mpsc;

    use super::*;

    /// A stream into a pipe nobody reads yet, its reports on a channel.
    fn piped() -> (&'static Stream, std::fs::File, mpsc::Receiver<(u64, u64)>) {
        let (read, write) = nix::unistd::pipe().unwrap();
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let stream = Stream::new("test", write, move |_, dropped, total| {
            let _ = tx.lock().unwrap().send((dropped, total));
        });
        (Box::leak(Box::new(stream)), std::fs::File::from(read), rx)
    }

    #[test]
    fn a_reader_that_stops_never_blocks_a_writer_and_the_drop_is_said_once_it_reads_again() {
        let (stream, mut reader, reports) = piped();
        let line = [b'x'; 1023]
            .iter()
            .chain(b"\n")
            .copied()
            .collect::<Vec<u8>>();
        // The pipe fills (its 64 KiB and a line), and the writer waits on it.
        let before = (128 << 10) / line.len();
        for _ in 0..before {
            assert!(stream.write_lines(&line));
        }
        assert!(!stream.flush(Duration::from_secs(5)));
        // The queue's 1 MiB and as much again: the excess dropped, nothing waits.
        let started = Instant::now();
        let mut refused = 0;
        let flood = 2 * QUEUE_BYTES / line.len();
        for _ in 0..flood {
            if !stream.write_lines(&line) {
                refused += 1;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "writes waited on the reader"
        );
        assert!(refused >= QUEUE_BYTES / line.len() - 1, "{refused}");
        assert_eq!(stream.dropped(), refused as u64);
        assert!(
            reports.try_recv().is_err(),
            "said before the reader came back"
        );

        // The reader comes back: every line queued arrives whole, and the drop is said once.
        let accepted = before + flood - refused;
        let mut buf = vec![0u8; 1 << 16];
        let mut got = Vec::new();
        while got.len() < accepted * line.len() {
            let n = reader.read(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        assert!(stream.flush(Duration::from_secs(10)));
        assert_eq!(got.len(), accepted * line.len());
        assert!(got.chunks(line.len()).all(|l| l == line.as_slice()));
        let (dropped, total) = reports.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!((dropped, total), (refused as u64, refused as u64));
        assert!(reports.try_recv().is_err(), "said twice");
    }

    #[test]
    fn a_flush_waits_for_the_reader_but_not_for_one_that_stalls() {
        let (stream, mut reader, _reports) = piped();
        assert!(stream.write_lines(b"one\ntwo\n"));
        assert!(stream.flush(Duration::from_secs(10)));
        let mut buf = [0u8; 8];
        assert_eq!(reader.read(&mut buf).unwrap(), 8);
        assert_eq!(&buf, b"one\ntwo\n");
        // Nobody reads now: the flush gives up once nothing moves, long before its bound.
        let big = vec![b'y'; 200 << 10];
        stream.write_lines(&big);
        let started = Instant::now();
        assert!(!stream.flush(Duration::from_secs(60)));
        assert!(started.elapsed() < Duration::from_secs(30));
    }

    #[test]
    fn lines_are_handed_on_whole() {
        let (stream, mut reader, _reports) = piped();
        let mut lines = Lines::new(stream);
        lines.push(b"first ha");
        lines.push(b"lf\nsecond\nthi");
        assert!(stream.flush(Duration::from_secs(10)));
        let mut buf = [0u8; 64];
        let n = reader.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"first half\nsecond\n");
        lines.finish();
        assert!(stream.flush(Duration::from_secs(10)));
        let n = reader.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"thi");
    }

    #[test]
    fn lines_are_counted_as_a_reader_sees_them() {
        assert_eq!(line_count(b"a\n"), 1);
        assert_eq!(line_count(b"a\nb\n"), 2);
        assert_eq!(line_count(b"a\nb"), 2);
        assert_eq!(line_count(b"partial"), 1);
    }
}

//! One walk of Envoy's stats shared by the scrapes of one query that arrive together, with the
//! agent's memory flat ([`Walks`]).
//!
//! Why share: Envoy answers `/stats/prometheus` by visiting every stat on its main thread (the
//! thread that also applies xDS and serves the admin API): 0.4–0.9 s of it and ~65 MB of text on
//! a config of ~570k stats. Two Prometheus servers and a debug `curl` arriving together would be
//! three walks; shared, they are one.
//!
//! Why not simply keep the answer for whoever comes: it is tens of MiB, and the agent passes it
//! on as it arrives so that its own memory stays a few MiB whatever the config (holding one
//! answer took the agent from 8 to 78 MiB). So a walk is shared only from its start, and only
//! while it is young:
//!
//! - **A scrape joins the walk of its query** (the same [`WalkKey`]: the same Envoy, the same
//!   normalized query) **while that walk has passed on no more than [`Limits::join_prefix`]
//!   bytes** (256 KiB: Envoy's first chunks). The walk keeps that prefix, copied (so that it
//!   pins none of the HTTP client's buffers), and a scrape that joins gets it first, then the
//!   rest with the others. A walk waiting for Envoy's first bytes is always joinable.
//! - **Past its prefix, a walk takes no one.** A scrape arriving then starts the *next* walk of
//!   its query, which waits for the one in flight to end (Envoy's main thread would serve the
//!   two one after the other anyway), at most [`Limits::wait`]; scrapes arriving meanwhile join
//!   the next walk. So however many scrapes of a query come, Envoy walks it at most once at a
//!   time (past that bound, twice), and no answer is older than its scrape: nothing is kept past
//!   a walk's end.
//! - **Backpressure is bounded.** Each scrape has a channel of [`CHANNEL_CAPACITY`] chunk; the
//!   walk reads Envoy's next chunk once every scrape took the last one, so the agent holds a few
//!   chunks however large the answer, and Envoy is paced by its readers as it would be by one. A
//!   scrape that holds the others back for more than [`Limits::lag`] (a stalled client) is
//!   dropped: its answer ends with an error, and `event="scrape_dropped"` is logged. One that
//!   holds no one back (it is alone, or all are as slow) is waited for, to the walk's bound.
//! - **A scrape that goes away** (its client disconnected) leaves the walk to the others; once
//!   no scrape is left, the walk ends, and dropping Envoy's answer closes its connection.
//! - **Every wait is bounded**: Envoy's answer's head by the admin client's timeout (the walk's
//!   start, [`Walks::join`]'s `start`), the whole walk by [`Limits::walk`], waiting for the walk
//!   in flight by [`Limits::wait`], a scrape holding others back by [`Limits::lag`].
//!
//! Each walk logs one event when it ends: `event="scrape_walk"` (debug), with the `envoy`, the
//! `query` asked, how many `subscribers` it had (scrapes answered from it), how many were
//! `dropped`, the `bytes` read, `waited_ms` (for the walk before it), `took_ms` and its
//! `outcome`. Each scrape logs `event="scrape"` (debug) with its `walk` and whether it
//! `started`, `joined` or `waits` for it.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_agent_proxy::admin::AdminError;
use hyper::body::{Body, Bytes, Frame};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, PollSender};
use tracing::Instrument as _;

use crate::status::stats_query::EnvoyRefusal;

/// How many chunks a scrape's channel holds: the walk reads Envoy's next chunk once each
/// scrape has taken the last one.
pub const CHANNEL_CAPACITY: usize = 1;

/// The bounds of sharing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A walk takes new scrapes while it has passed on no more than this (and keeps that
    /// much, for them).
    pub join_prefix: usize,
    /// How long a scrape may hold back the others sharing its walk before it is dropped.
    pub lag: Duration,
    /// How long the next walk of a query waits for the one in flight to end.
    pub wait: Duration,
    /// A walk, whole: Envoy's answer, head to end, and its delivery.
    pub walk: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            join_prefix: 256 << 10,
            // The admin calls' bound: what a status request waits for Envoy.
            lag: Duration::from_secs(2),
            wait: Duration::from_secs(2),
            walk: Duration::from_secs(30),
        }
    }
}

/// What a walk asks: of which Envoy (its admin address), which query (normalized, as
/// [`crate::status::stats_query::StatsQuery::to_query_string`] gives it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WalkKey {
    /// Envoy's admin address: after a hot restart, the newest epoch is asked.
    pub envoy: String,
    /// The query string Envoy is asked (empty for none).
    pub query: String,
}

/// Why a walk gave no stats; every scrape of the walk gets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WalkFailure {
    /// Envoy refused the query (a regex it cannot compile): the scrape is refused too.
    #[error(transparent)]
    Refused(EnvoyRefusal),
    /// No answer from Envoy, or an error of its own.
    #[error("envoy's stats are unavailable: {0}")]
    Unavailable(String),
}

impl From<AdminError> for WalkFailure {
    fn from(e: AdminError) -> Self {
        match EnvoyRefusal::from_admin_error(&e) {
            Some(refusal) => WalkFailure::Refused(refusal),
            None => WalkFailure::Unavailable(e.to_string()),
        }
    }
}

/// Why a scrape's copy of Envoy's stats ended before its end (its answer is then cut off).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShareError {
    /// Envoy's answer broke off.
    #[error("envoy's stats broke off: {0}")]
    BrokeOff(String),
    /// The walk ran out of time.
    #[error("envoy's stats did not arrive within {0:?}")]
    TimedOut(Duration),
    /// This scrape held back the others sharing its walk for too long.
    #[error(
        "the scrape fell behind the others sharing its walk of envoy's stats by more than {0:?} and was dropped"
    )]
    FellBehind(Duration),
    /// The walk ended without saying how (the agent is stopping).
    #[error("the walk of envoy's stats ended early")]
    Ended,
}

/// How a scrape came to its walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// It started a walk.
    Started,
    /// It joined a walk within its prefix.
    Joined,
    /// It waits for the walk in flight to end, and starts the next (with whoever joins it).
    Waits,
}

impl Share {
    fn as_str(self) -> &'static str {
        match self {
            Share::Started => "started",
            Share::Joined => "joined",
            Share::Waits => "waits",
        }
    }
}

/// What a walk sends each scrape, in order.
#[derive(Debug, Clone)]
enum Piece {
    /// Whether Envoy answered the query.
    Head(Result<(), WalkFailure>),
    /// The next bytes of Envoy's answer.
    Chunk(Bytes),
    /// The end: whole, or why not.
    End(Result<(), ShareError>),
}

/// The walks of Envoy's stats in flight, by [`WalkKey`].
#[derive(Debug, Default)]
pub struct Walks {
    limits: Limits,
    flights: Mutex<HashMap<WalkKey, Entry>>,
    next_id: AtomicU64,
}

/// A query's walks in flight.
#[derive(Debug, Default)]
struct Entry {
    /// The walk a scrape joins: within its prefix, or waiting to start.
    open: Option<Arc<Flight>>,
    /// The walk past its prefix, still reading Envoy: the next one waits for its end.
    closed: Option<Arc<Flight>>,
}

/// One walk, as its scrapes and its task share it.
#[derive(Debug)]
struct Flight {
    key: WalkKey,
    id: u64,
    state: Mutex<FlightState>,
    /// Told when the last scrape goes away.
    gone: Notify,
    /// Cancelled once Envoy's answer has ended (or the walk has failed): the next may start.
    ended: CancellationToken,
}

#[derive(Debug)]
struct FlightState {
    /// Whether a scrape arriving now may join.
    joinable: bool,
    /// Envoy's answer's head, once known.
    head: Option<Result<(), WalkFailure>>,
    /// The answer's start, for scrapes that join (while joinable).
    prefix: Vec<Bytes>,
    prefix_bytes: usize,
    /// Scrapes joined since the walk last looked.
    joined: Vec<Subscriber>,
    /// Scrapes not gone yet.
    live: usize,
    /// Scrapes joined in all.
    subscribers: usize,
}

/// The walk's end of a scrape's channel.
#[derive(Debug)]
struct Subscriber {
    tx: PollSender<Piece>,
    /// Why the channel was closed early, when the walk closes it without an end.
    reason: Arc<OnceLock<ShareError>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these locks; a poisoned one is as good as any.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Walks {
    /// Walks shared within `limits`.
    pub fn new(limits: Limits) -> Self {
        Walks {
            limits,
            ..Walks::default()
        }
    }

    /// A scrape of `key`: joins the walk of `key` that takes scrapes now, or starts one, which
    /// first waits (bounded) for the walk of `key` in flight to end. `start` asks Envoy (its
    /// answer's head within the admin client's timeout, then the body); it is called only for
    /// a new walk, from its task.
    pub fn join<S, F, B>(self: &Arc<Self>, key: WalkKey, start: S) -> Subscription
    where
        S: FnOnce() -> F + Send + 'static,
        F: Future<Output = Result<B, WalkFailure>> + Send + 'static,
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: fmt::Display + Send,
    {
        let mut flights = lock(&self.flights);
        let entry = flights.entry(key.clone()).or_default();
        if let Some(open) = entry.open.clone() {
            let mut state = lock(&open.state);
            if state.joinable {
                let subscription = subscribe(&open, &mut state, self.limits, Share::Joined);
                drop(state);
                log_share(&open, Share::Joined);
                return subscription;
            }
        }
        let after = entry
            .closed
            .as_ref()
            .filter(|f| !f.ended.is_cancelled())
            .map(|f| f.ended.clone());
        let flight = Arc::new(Flight {
            key,
            id: self.next_id.fetch_add(1, Ordering::Relaxed) + 1,
            state: Mutex::new(FlightState {
                joinable: true,
                head: None,
                prefix: Vec::new(),
                prefix_bytes: 0,
                joined: Vec::new(),
                live: 0,
                subscribers: 0,
            }),
            gone: Notify::new(),
            ended: CancellationToken::new(),
        });
        let share = if after.is_some() {
            Share::Waits
        } else {
            Share::Started
        };
        let subscription = subscribe(&flight, &mut lock(&flight.state), self.limits, share);
        entry.open = Some(flight.clone());
        drop(flights);
        log_share(&flight, share);
        let walk = Walk {
            walks: Arc::downgrade(self),
            flight,
            limits: self.limits,
            subscribers: Vec::new(),
            bytes: 0,
            dropped: 0,
        };
        tokio::spawn(walk.run(after, start).in_current_span());
        subscription
    }

    /// How many queries have a walk in flight (for tests: nothing is kept past a walk).
    pub fn in_flight(&self) -> usize {
        lock(&self.flights).len()
    }
}

fn log_share(flight: &Flight, share: Share) {
    tracing::debug!(
        event = "scrape",
        walk = flight.id,
        envoy = %flight.key.envoy,
        query = %flight.key.query,
        share = share.as_str(),
        "a scrape of envoy's stats"
    );
}

/// Adds a scrape to `flight` (whose state is `state`): it gets what the walk has so far, then
/// the rest from the walk's task.
fn subscribe(
    flight: &Arc<Flight>,
    state: &mut FlightState,
    limits: Limits,
    share: Share,
) -> Subscription {
    let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
    let reason = Arc::new(OnceLock::new());
    let mut replay = VecDeque::new();
    if let Some(head) = &state.head {
        replay.push_back(Piece::Head(head.clone()));
        replay.extend(state.prefix.iter().cloned().map(Piece::Chunk));
    }
    state.joined.push(Subscriber {
        tx: PollSender::new(tx),
        reason: reason.clone(),
    });
    state.live += 1;
    state.subscribers += 1;
    Subscription {
        flight: flight.clone(),
        replay,
        rx,
        reason,
        limits,
        share,
    }
}

/// How a walk ended, for its event.
#[derive(Debug)]
enum Outcome {
    Complete,
    Failed(WalkFailure),
    BrokeOff(String),
    TimedOut,
    Abandoned,
}

impl Outcome {
    fn as_str(&self) -> &'static str {
        match self {
            Outcome::Complete => "complete",
            Outcome::Failed(WalkFailure::Refused(_)) => "refused",
            Outcome::Failed(WalkFailure::Unavailable(_)) => "unavailable",
            Outcome::BrokeOff(_) => "broke_off",
            Outcome::TimedOut => "timed_out",
            Outcome::Abandoned => "abandoned",
        }
    }
}

/// A walk's task: its flight, and the scrapes it delivers to.
struct Walk {
    walks: Weak<Walks>,
    flight: Arc<Flight>,
    limits: Limits,
    subscribers: Vec<Subscriber>,
    bytes: usize,
    dropped: usize,
}

impl Walk {
    async fn run<S, F, B>(mut self, after: Option<CancellationToken>, start: S)
    where
        S: FnOnce() -> F,
        F: Future<Output = Result<B, WalkFailure>>,
        B: Body<Data = Bytes> + Unpin,
        B::Error: fmt::Display + Send,
    {
        let t0 = Instant::now();
        if let Some(after) = after {
            tokio::select! {
                () = after.cancelled() => {}
                () = tokio::time::sleep(self.limits.wait) => {}
                () = self.gone() => {
                    self.close();
                    self.log(Outcome::Abandoned, t0, t0);
                    return;
                }
            }
        }
        let started = Instant::now();
        let deadline = started + self.limits.walk;
        let outcome = match tokio::time::timeout_at(deadline, self.stream(start)).await {
            Ok(outcome) => outcome,
            Err(_) => Outcome::TimedOut,
        };
        // Whatever happened, no scrape joins any more, and the next walk may start.
        self.close();
        let end = match &outcome {
            Outcome::Complete => None,
            Outcome::Failed(_) | Outcome::Abandoned => Some(ShareError::Ended),
            Outcome::BrokeOff(e) => Some(ShareError::BrokeOff(e.clone())),
            Outcome::TimedOut => Some(ShareError::TimedOut(self.limits.walk)),
        };
        if let Some(e) = end {
            // Never waited for: a scrape with no room for it sees its channel close early.
            for subscriber in self.subscribers.drain(..) {
                let _ = subscriber.reason.set(e.clone());
                if let Some(tx) = subscriber.tx.get_ref() {
                    let _ = tx.try_send(Piece::End(Err(e.clone())));
                }
            }
        }
        self.log(outcome, t0, started);
    }

    /// Asks Envoy, then passes its answer on; the walk's end is delivered too when it is whole.
    async fn stream<S, F, B>(&mut self, start: S) -> Outcome
    where
        S: FnOnce() -> F,
        F: Future<Output = Result<B, WalkFailure>>,
        B: Body<Data = Bytes> + Unpin,
        B::Error: fmt::Display + Send,
    {
        let answer = tokio::select! {
            answer = start() => answer,
            () = self.gone() => return Outcome::Abandoned,
        };
        let head = answer.as_ref().map(|_| ()).map_err(Clone::clone);
        {
            let mut state = lock(&self.flight.state);
            state.head = Some(head.clone());
            self.subscribers.append(&mut state.joined);
        }
        self.deliver(Piece::Head(head)).await;
        let mut body = match answer {
            Ok(body) => body,
            Err(failure) => return Outcome::Failed(failure),
        };
        loop {
            let frame = tokio::select! {
                frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)) => frame,
                () = self.gone() => return Outcome::Abandoned,
            };
            let data = match frame {
                None => break,
                Some(Err(e)) => return Outcome::BrokeOff(e.to_string()),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => data,
                    // Trailers: nothing a scrape needs.
                    Err(_) => continue,
                },
            };
            self.bytes += data.len();
            self.take_in(&data);
            self.deliver(Piece::Chunk(data)).await;
            if self.subscribers.is_empty() && self.gone_now() {
                return Outcome::Abandoned;
            }
        }
        // Whole: no one joins now, and the next walk may start while the end is delivered.
        self.close();
        self.deliver(Piece::End(Ok(()))).await;
        Outcome::Complete
    }

    /// Takes in the scrapes that joined, and keeps `data` for those still to come while the
    /// walk is within its prefix; past it, the walk takes no one (atomically with the keeping:
    /// a scrape joins either before this chunk, and gets it from the walk, or after, and gets
    /// it from the prefix).
    fn take_in(&mut self, data: &Bytes) {
        let walks = self.walks.upgrade();
        let mut flights = walks.as_ref().map(|w| lock(&w.flights));
        let mut state = lock(&self.flight.state);
        self.subscribers.append(&mut state.joined);
        if !state.joinable {
            return;
        }
        if state.prefix_bytes + data.len() <= self.limits.join_prefix {
            // A copy: a slice would pin the whole of the HTTP client's read buffer.
            state.prefix.push(Bytes::copy_from_slice(data));
            state.prefix_bytes += data.len();
            return;
        }
        state.joinable = false;
        state.prefix = Vec::new();
        if let Some(entry) = flights.as_mut().and_then(|f| f.get_mut(&self.flight.key)) {
            if entry
                .open
                .as_ref()
                .is_some_and(|f| Arc::ptr_eq(f, &self.flight))
            {
                entry.closed = entry.open.take();
            }
        }
    }

    /// No scrape joins any more; the walk is forgotten (a scrape arriving now starts the next
    /// walk at once) and its successor, if any, may start. Takes in the last scrapes joined.
    fn close(&mut self) {
        let walks = self.walks.upgrade();
        let mut flights = walks.as_ref().map(|w| lock(&w.flights));
        let mut state = lock(&self.flight.state);
        state.joinable = false;
        state.prefix = Vec::new();
        self.subscribers.append(&mut state.joined);
        if let Some(flights) = flights.as_mut() {
            let key = &self.flight.key;
            if let Some(entry) = flights.get_mut(key) {
                for slot in [&mut entry.open, &mut entry.closed] {
                    if slot.as_ref().is_some_and(|f| Arc::ptr_eq(f, &self.flight)) {
                        *slot = None;
                    }
                }
                if entry.open.is_none() && entry.closed.is_none() {
                    flights.remove(key);
                }
            }
        }
        self.flight.ended.cancel();
    }

    /// Whether no scrape is left; if so, none may join any more.
    fn gone_now(&mut self) -> bool {
        let walks = self.walks.upgrade();
        let _flights = walks.as_ref().map(|w| lock(&w.flights));
        let mut state = lock(&self.flight.state);
        if state.live > 0 {
            return false;
        }
        state.joinable = false;
        true
    }

    /// Resolves once no scrape is left (none joins after that).
    async fn gone(&self) {
        loop {
            {
                let walks = self.walks.upgrade();
                let _flights = walks.as_ref().map(|w| lock(&w.flights));
                let mut state = lock(&self.flight.state);
                if state.live == 0 {
                    state.joinable = false;
                    return;
                }
            }
            // A scrape going away since the check left a permit: no wake-up is lost.
            self.flight.gone.notified().await;
        }
    }

    /// Sends `piece` to every scrape. A scrape that went away is forgotten. One that has no
    /// room is waited for; once another has taken the piece, for [`Limits::lag`] at most,
    /// after which it is dropped (its channel closes with [`ShareError::FellBehind`]).
    async fn deliver(&mut self, piece: Piece) {
        #[derive(Clone, Copy, PartialEq)]
        enum Sent {
            Waiting,
            Taken,
            Gone,
        }
        let mut sent = vec![Sent::Waiting; self.subscribers.len()];
        let mut held: Option<Pin<Box<tokio::time::Sleep>>> = None;
        let lag = self.limits.lag;
        let subscribers = &mut self.subscribers;
        std::future::poll_fn(|cx| {
            for (subscriber, sent) in subscribers.iter_mut().zip(sent.iter_mut()) {
                if *sent != Sent::Waiting {
                    continue;
                }
                match subscriber.tx.poll_reserve(cx) {
                    Poll::Ready(Ok(())) => {
                        *sent = match subscriber.tx.send_item(piece.clone()) {
                            Ok(()) => Sent::Taken,
                            Err(_) => Sent::Gone,
                        };
                    }
                    Poll::Ready(Err(_)) => *sent = Sent::Gone,
                    Poll::Pending => {}
                }
            }
            if !sent.contains(&Sent::Waiting) {
                return Poll::Ready(());
            }
            // The ones still waiting hold back those that took it: for `lag` at most.
            if held.is_none() && sent.contains(&Sent::Taken) {
                held = Some(Box::pin(tokio::time::sleep(lag)));
            }
            match held.as_mut() {
                Some(held) => held.as_mut().poll(cx),
                None => Poll::Pending,
            }
        })
        .await;
        let mut i = 0;
        self.subscribers.retain(|subscriber| {
            let keep = match sent[i] {
                Sent::Taken => true,
                Sent::Gone => false,
                Sent::Waiting => {
                    let _ = subscriber.reason.set(ShareError::FellBehind(lag));
                    false
                }
            };
            i += 1;
            keep
        });
        let fell_behind = sent.iter().filter(|s| **s == Sent::Waiting).count();
        if fell_behind > 0 {
            self.dropped += fell_behind;
            tracing::warn!(
                event = "scrape_dropped",
                walk = self.flight.id,
                envoy = %self.flight.key.envoy,
                query = %self.flight.key.query,
                scrapes = fell_behind,
                lag_ms = lag.as_millis() as u64,
                "dropped a scrape that held back the others sharing its walk of envoy's stats"
            );
        }
    }

    fn log(&self, outcome: Outcome, t0: Instant, started: Instant) {
        let subscribers = lock(&self.flight.state).subscribers;
        let error = match &outcome {
            Outcome::Failed(e) => Some(e.to_string()),
            Outcome::BrokeOff(e) => Some(e.clone()),
            _ => None,
        };
        tracing::debug!(
            event = "scrape_walk",
            walk = self.flight.id,
            envoy = %self.flight.key.envoy,
            query = %self.flight.key.query,
            subscribers,
            dropped = self.dropped,
            bytes = self.bytes,
            waited_ms = (started - t0).as_millis() as u64,
            took_ms = started.elapsed().as_millis() as u64,
            outcome = outcome.as_str(),
            error,
            "a walk of envoy's stats ended"
        );
    }
}

/// A scrape's share of a walk: whether Envoy answered ([`Subscription::head`]), then the body
/// ([`Subscription::into_body`]). Dropping it leaves the walk to the others.
#[derive(Debug)]
pub struct Subscription {
    flight: Arc<Flight>,
    replay: VecDeque<Piece>,
    rx: mpsc::Receiver<Piece>,
    reason: Arc<OnceLock<ShareError>>,
    limits: Limits,
    share: Share,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut state = lock(&self.flight.state);
        state.live = state.live.saturating_sub(1);
        if state.live == 0 {
            self.flight.gone.notify_one();
        }
    }
}

impl Subscription {
    fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<Piece>> {
        match self.replay.pop_front() {
            Some(piece) => Poll::Ready(Some(piece)),
            None => self.rx.poll_recv(cx),
        }
    }

    /// How this scrape came to its walk.
    pub fn share(&self) -> Share {
        self.share
    }

    /// Whether Envoy answered the query. Bounded: by the walk before (its wait), the walk's
    /// own bound, and the head's (the admin client's timeout, within the walk's).
    pub async fn head(&mut self) -> Result<(), WalkFailure> {
        let bound = self.limits.wait + self.limits.walk;
        let wait = async {
            match std::future::poll_fn(|cx| self.poll_piece(cx)).await {
                Some(Piece::Head(head)) => head,
                // A walk sends its head first; anything else is its end.
                _ => Err(WalkFailure::Unavailable(
                    "the walk ended before envoy answered".to_owned(),
                )),
            }
        };
        tokio::time::timeout(bound, wait).await.unwrap_or_else(|_| {
            Err(WalkFailure::Unavailable(format!(
                "envoy did not answer within {bound:?}"
            )))
        })
    }

    /// Envoy's answer from its start, as the walk passes it on.
    pub fn into_body(self) -> SharedBody {
        SharedBody {
            subscription: Some(self),
        }
    }
}

/// A scrape's copy of a walk's answer (after its head), as a response body.
#[derive(Debug)]
pub struct SharedBody {
    subscription: Option<Subscription>,
}

impl Body for SharedBody {
    type Data = Bytes;
    type Error = ShareError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ShareError>>> {
        let this = self.get_mut();
        loop {
            let Some(subscription) = this.subscription.as_mut() else {
                return Poll::Ready(None);
            };
            let end = match subscription.poll_piece(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Piece::Chunk(data))) => {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                // Already taken by `head`; never sent twice.
                Poll::Ready(Some(Piece::Head(_))) => continue,
                Poll::Ready(Some(Piece::End(end))) => end,
                Poll::Ready(None) => Err(subscription
                    .reason
                    .get()
                    .cloned()
                    .unwrap_or(ShareError::Ended)),
            };
            // Let go of the walk as soon as this scrape has it all.
            this.subscription = None;
            return Poll::Ready(end.err().map(Err));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use http_body_util::BodyExt;
    use tokio::sync::oneshot;

    use super::*;

    /// A fake Envoy answer: the test sends its chunks (or an error); dropping the sender ends
    /// it. Counts the chunks the walk read.
    struct FakeBody {
        rx: mpsc::UnboundedReceiver<Result<Bytes, String>>,
        read: Arc<AtomicUsize>,
    }

    impl Body for FakeBody {
        type Data = Bytes;
        type Error = String;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, String>>> {
            self.rx.poll_recv(cx).map(|chunk| {
                chunk.map(|chunk| {
                    self.read.fetch_add(1, Ordering::SeqCst);
                    chunk.map(Frame::data)
                })
            })
        }
    }

    /// One walk the fake Envoy was asked for.
    struct FakeWalk {
        query: String,
        head: Option<oneshot::Sender<Result<(), WalkFailure>>>,
        body: mpsc::UnboundedSender<Result<Bytes, String>>,
        read: Arc<AtomicUsize>,
    }

    /// A fake Envoy: every walk started, whose answers the test gives.
    #[derive(Default)]
    struct Envoy {
        walks: Mutex<Vec<FakeWalk>>,
    }

    fn key(query: &str) -> WalkKey {
        WalkKey {
            envoy: "127.0.0.1:9901".to_owned(),
            query: query.to_owned(),
        }
    }

    impl Envoy {
        fn scrape(self: &Arc<Self>, walks: &Arc<Walks>, query: &str) -> Subscription {
            let envoy = self.clone();
            let asked = query.to_owned();
            walks.join(key(query), move || {
                let (head, answered) = oneshot::channel();
                let (body, rx) = mpsc::unbounded_channel();
                let read = Arc::new(AtomicUsize::new(0));
                lock(&envoy.walks).push(FakeWalk {
                    query: asked,
                    head: Some(head),
                    body,
                    read: read.clone(),
                });
                async move {
                    answered
                        .await
                        .unwrap_or_else(|_| Err(WalkFailure::Unavailable("gone".to_owned())))?;
                    Ok(FakeBody { rx, read })
                }
            })
        }

        fn started(&self) -> usize {
            lock(&self.walks).len()
        }

        fn query(&self, i: usize) -> String {
            lock(&self.walks)[i].query.clone()
        }

        /// Walk `i`'s head: `Ok` for an answer.
        fn answer(&self, i: usize, head: Result<(), WalkFailure>) {
            let sender = lock(&self.walks)[i].head.take().unwrap();
            sender.send(head).unwrap();
        }

        fn send(&self, i: usize, chunk: &str) {
            let chunk = Bytes::copy_from_slice(chunk.as_bytes());
            lock(&self.walks)[i].body.send(Ok(chunk)).unwrap();
        }

        fn break_off(&self, i: usize) {
            let walks = lock(&self.walks);
            walks[i].body.send(Err("reset".to_owned())).unwrap();
        }

        /// Ends walk `i`'s answer.
        fn end(&self, i: usize) {
            let (closed, _) = mpsc::unbounded_channel();
            drop(std::mem::replace(&mut lock(&self.walks)[i].body, closed));
        }

        /// Whether walk `i` was dropped by the agent (its question or its answer).
        fn abandoned(&self, i: usize) -> bool {
            let walks = lock(&self.walks);
            match &walks[i].head {
                Some(head) => head.is_closed(),
                None => walks[i].body.is_closed(),
            }
        }

        /// How many chunks the agent has read of walk `i`.
        fn read(&self, i: usize) -> usize {
            lock(&self.walks)[i].read.load(Ordering::SeqCst)
        }
    }

    async fn read(mut subscription: Subscription) -> Result<String, ShareError> {
        subscription.head().await.unwrap();
        let bytes = subscription.into_body().collect().await?.to_bytes();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Lets the spawned walks and readers run until they wait.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    fn walks(join_prefix: usize) -> Arc<Walks> {
        Arc::new(Walks::new(Limits {
            join_prefix,
            ..Limits::default()
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn scrapes_before_envoys_first_bytes_share_one_walk_and_get_the_same_bytes() {
        let walks = walks(0);
        let envoy = Arc::new(Envoy::default());
        let a = envoy.scrape(&walks, "");
        let b = envoy.scrape(&walks, "");
        assert_eq!((a.share(), b.share()), (Share::Started, Share::Joined));
        let (a, b) = (tokio::spawn(read(a)), tokio::spawn(read(b)));
        settle().await;
        // Joinable until Envoy's first bytes, even with no prefix kept.
        let c = envoy.scrape(&walks, "");
        assert_eq!(c.share(), Share::Joined);
        let c = tokio::spawn(read(c));
        envoy.answer(0, Ok(()));
        envoy.send(0, "a 1\n");
        envoy.send(0, "b 2\n");
        envoy.end(0);
        for scrape in [a, b, c] {
            assert_eq!(scrape.await.unwrap().unwrap(), "a 1\nb 2\n");
        }
        assert_eq!(envoy.started(), 1);
        assert_eq!(walks.in_flight(), 0, "nothing kept past the walk");
    }

    #[tokio::test(start_paused = true)]
    async fn a_scrape_within_the_prefix_joins_from_the_start_and_past_it_waits_for_the_next() {
        let walks = walks(8);
        let envoy = Arc::new(Envoy::default());
        let a = tokio::spawn(read(envoy.scrape(&walks, "")));
        settle().await;
        envoy.answer(0, Ok(()));
        envoy.send(0, "1234");
        settle().await;
        let b = envoy.scrape(&walks, "");
        assert_eq!(b.share(), Share::Joined);
        let b = tokio::spawn(read(b));
        envoy.send(0, "5678");
        settle().await;
        // 8 bytes passed on: the prefix is full, still joinable.
        let c = envoy.scrape(&walks, "");
        assert_eq!(c.share(), Share::Joined);
        let c = tokio::spawn(read(c));
        settle().await;
        envoy.send(0, "9");
        settle().await;
        // Past the prefix: the next walk, which waits for this one to end.
        let d = envoy.scrape(&walks, "");
        assert_eq!(d.share(), Share::Waits);
        let e = envoy.scrape(&walks, "");
        assert_eq!(e.share(), Share::Joined, "joins the next walk");
        let (d, e) = (tokio::spawn(read(d)), tokio::spawn(read(e)));
        settle().await;
        assert_eq!(envoy.started(), 1, "the next walk waits");
        envoy.end(0);
        for scrape in [a, b, c] {
            assert_eq!(scrape.await.unwrap().unwrap(), "123456789");
        }
        settle().await;
        assert_eq!(
            envoy.started(),
            2,
            "the next walk starts once the last ended"
        );
        envoy.answer(1, Ok(()));
        envoy.send(1, "fresh");
        envoy.end(1);
        assert_eq!(d.await.unwrap().unwrap(), "fresh");
        assert_eq!(e.await.unwrap().unwrap(), "fresh");
        assert_eq!(walks.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_next_walk_waits_for_the_one_in_flight_for_a_bounded_time() {
        let walks = walks(0);
        let envoy = Arc::new(Envoy::default());
        let a = tokio::spawn(read(envoy.scrape(&walks, "")));
        settle().await;
        envoy.answer(0, Ok(()));
        envoy.send(0, "slow walk");
        settle().await;
        let b = envoy.scrape(&walks, "");
        assert_eq!(b.share(), Share::Waits);
        let b = tokio::spawn(read(b));
        tokio::time::sleep(Limits::default().wait - Duration::from_millis(1)).await;
        assert_eq!(envoy.started(), 1);
        tokio::time::sleep(Duration::from_millis(2)).await;
        settle().await;
        assert_eq!(envoy.started(), 2, "started without waiting any longer");
        envoy.answer(1, Ok(()));
        envoy.end(1);
        envoy.end(0);
        assert_eq!(a.await.unwrap().unwrap(), "slow walk");
        assert_eq!(b.await.unwrap().unwrap(), "");
    }

    #[tokio::test(start_paused = true)]
    async fn another_query_or_another_envoy_is_another_walk() {
        let walks = walks(1 << 10);
        let envoy = Arc::new(Envoy::default());
        let a = envoy.scrape(&walks, "");
        let b = envoy.scrape(&walks, "usedonly");
        let other = walks.join(
            WalkKey {
                envoy: "127.0.0.1:9902".to_owned(),
                query: String::new(),
            },
            || async { Err::<FakeBody, _>(WalkFailure::Unavailable("no".to_owned())) },
        );
        assert_eq!(
            (a.share(), b.share(), other.share()),
            (Share::Started, Share::Started, Share::Started)
        );
        settle().await;
        assert_eq!(envoy.started(), 2);
        assert_eq!(
            (envoy.query(0), envoy.query(1)),
            ("".into(), "usedonly".into())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_scrape_that_holds_the_others_back_is_dropped_and_they_go_on() {
        let walks = walks(0);
        let envoy = Arc::new(Envoy::default());
        let mut stalled = envoy.scrape(&walks, "");
        let fast = envoy.scrape(&walks, "");
        settle().await;
        envoy.answer(0, Ok(()));
        stalled.head().await.unwrap();
        let fast = tokio::spawn(read(fast));
        // The stalled client reads nothing more: its channel fills with "a".
        let stalled = stalled.into_body();
        envoy.send(0, "a");
        envoy.send(0, "b");
        settle().await;
        tokio::time::sleep(Limits::default().lag - Duration::from_millis(1)).await;
        assert!(!fast.is_finished());
        assert!(
            envoy.read(0) <= 2,
            "waits for the stalled one: {}",
            envoy.read(0)
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
        envoy.send(0, "c");
        envoy.end(0);
        assert_eq!(fast.await.unwrap().unwrap(), "abc");
        let mut stalled = stalled;
        let first = stalled.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "a");
        assert_eq!(
            stalled.frame().await.unwrap().unwrap_err(),
            ShareError::FellBehind(Limits::default().lag)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_scrape_alone_is_waited_for_with_a_bounded_buffer_to_the_walks_bound() {
        let walks = walks(0);
        let envoy = Arc::new(Envoy::default());
        let mut alone = envoy.scrape(&walks, "");
        settle().await;
        envoy.answer(0, Ok(()));
        alone.head().await.unwrap();
        let mut body = alone.into_body();
        for chunk in ["a", "b", "c", "d", "e"] {
            envoy.send(0, chunk);
        }
        envoy.end(0);
        tokio::time::sleep(Duration::from_secs(10)).await;
        // One chunk in its channel, one the walk waits to send: Envoy's answer is read no
        // further ahead of the reader, however long it takes.
        assert_eq!(envoy.read(0), 1 + CHANNEL_CAPACITY);
        let mut got = String::new();
        while let Some(frame) = body.frame().await {
            got.push_str(std::str::from_utf8(&frame.unwrap().into_data().unwrap()).unwrap());
        }
        assert_eq!(got, "abcde");

        // A walk that never ends: cut off at its bound.
        let stuck = envoy.scrape(&walks, "");
        settle().await;
        envoy.answer(1, Ok(()));
        let started = Instant::now();
        assert_eq!(
            read(stuck).await,
            Err(ShareError::TimedOut(Limits::default().walk))
        );
        assert_eq!(started.elapsed(), Limits::default().walk);
        assert_eq!(walks.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_scrape_that_goes_away_leaves_the_walk_to_the_others_and_the_last_ends_it() {
        let walks = walks(0);
        let envoy = Arc::new(Envoy::default());
        let first = envoy.scrape(&walks, "");
        let second = tokio::spawn(read(envoy.scrape(&walks, "")));
        settle().await;
        drop(first);
        envoy.answer(0, Ok(()));
        envoy.send(0, "a");
        settle().await;
        assert!(!envoy.abandoned(0));
        envoy.send(0, "b");
        envoy.end(0);
        assert_eq!(second.await.unwrap().unwrap(), "ab");
        assert_eq!(envoy.started(), 1);

        // The last one gone while Envoy has not answered: the question is dropped.
        let only = envoy.scrape(&walks, "");
        settle().await;
        drop(only);
        settle().await;
        assert!(envoy.abandoned(1));
        assert_eq!(walks.in_flight(), 0);

        // ... or midway through the answer.
        let only = tokio::spawn(read(envoy.scrape(&walks, "")));
        settle().await;
        envoy.answer(2, Ok(()));
        envoy.send(2, "a");
        settle().await;
        only.abort();
        settle().await;
        assert!(envoy.abandoned(2));
        assert_eq!(walks.in_flight(), 0);
        // A new scrape starts a new walk.
        let _again = envoy.scrape(&walks, "");
        settle().await;
        assert_eq!(envoy.started(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_next_walk_whose_scrapes_all_went_away_never_starts() {
        let walks = walks(0);
        let envoy = Arc::new(Envoy::default());
        let a = tokio::spawn(read(envoy.scrape(&walks, "")));
        settle().await;
        envoy.answer(0, Ok(()));
        envoy.send(0, "a");
        settle().await;
        let next = envoy.scrape(&walks, "");
        assert_eq!(next.share(), Share::Waits);
        settle().await;
        drop(next);
        settle().await;
        envoy.end(0);
        assert_eq!(a.await.unwrap().unwrap(), "a");
        tokio::time::sleep(Limits::default().wait * 2).await;
        assert_eq!(envoy.started(), 1, "Envoy was not asked for no one");
        assert_eq!(walks.in_flight(), 0, "nothing left behind");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_is_every_scrapes_and_is_not_kept() {
        let walks = walks(0);
        let envoy = Arc::new(Envoy::default());
        let mut a = envoy.scrape(&walks, "filter=%28");
        let mut b = envoy.scrape(&walks, "filter=%28");
        let refused = WalkFailure::Refused(EnvoyRefusal {
            status: 400,
            message: "Invalid re2 regex".to_owned(),
        });
        settle().await;
        envoy.answer(0, Err(refused.clone()));
        assert_eq!(a.head().await, Err(refused.clone()));
        assert_eq!(b.head().await, Err(refused));
        assert_eq!(envoy.started(), 1);
        assert_eq!(walks.in_flight(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_that_breaks_off_ends_every_scrape_with_an_error() {
        let walks = walks(0);
        let envoy = Arc::new(Envoy::default());
        let a = tokio::spawn(read(envoy.scrape(&walks, "")));
        let b = tokio::spawn(read(envoy.scrape(&walks, "")));
        settle().await;
        envoy.answer(0, Ok(()));
        envoy.send(0, "a");
        envoy.break_off(0);
        let broke = Err(ShareError::BrokeOff("reset".to_owned()));
        assert_eq!(a.await.unwrap(), broke);
        assert_eq!(b.await.unwrap(), broke);
    }

    #[tokio::test(start_paused = true)]
    async fn the_prefix_kept_is_bounded_and_let_go_once_past_it() {
        let walks = walks(8);
        let envoy = Arc::new(Envoy::default());
        let a = tokio::spawn(read(envoy.scrape(&walks, "")));
        settle().await;
        envoy.answer(0, Ok(()));
        envoy.send(0, "12345");
        settle().await;
        let flight = lock(&walks.flights)[&key("")].open.clone().unwrap();
        assert_eq!(lock(&flight.state).prefix_bytes, 5);
        envoy.send(0, "6789");
        settle().await;
        {
            let state = lock(&flight.state);
            assert!(!state.joinable);
            assert!(state.prefix.is_empty());
        }
        envoy.end(0);
        assert_eq!(a.await.unwrap().unwrap(), "123456789");
    }
}

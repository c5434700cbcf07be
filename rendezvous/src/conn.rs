//! The service's connection layer: the open connections and what each is doing, which one to
//! close to admit a new one at the bound, and the deadline on a request's body.
//!
//! A connection is idle (no request in progress: kept alive, or still sending its headers),
//! receiving a body (headers in, body not yet), or busy (its handler runs). At the bound an idle
//! one is closed first (the oldest), else the one whose body has been arriving the longest, else
//! the oldest watch long-poll (its client asks again, and "no change" is what it would have
//! heard); other busy handlers (a heartbeat, a join being decided) are never closed, and when
//! every connection is one of those the new one is. One peer address (loopback excepted: a
//! proxy on this host) holds at most a sixteenth of the bound, its own oldest evictable
//! connection closed to admit another. So neither idle clients, slowly sent bodies nor watches
//! from a few addresses keep `/healthz` and the agents' heartbeats out.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use tokio::sync::Notify;

/// What one connection is doing, shared by its task and the requests on it.
#[derive(Default)]
pub(crate) struct ConnState {
    /// Requests in progress (HTTP/1.1 serves one at a time; 0 or 1).
    requests: AtomicUsize,
    /// When the body being received started to arrive, as [`Connections::now`]; 0: none.
    body_since: AtomicU64,
    /// When the watch long-poll in progress started, as [`Connections::now`]; 0: none.
    long_poll_since: AtomicU64,
}

impl ConnState {
    /// The request in progress is a watch long-poll (closed, if need be, to admit another).
    pub(crate) fn long_poll(&self, since: u64) {
        self.long_poll_since.store(since, Ordering::Relaxed);
    }
}

/// One open connection: its state, its peer, and how to close it.
struct Conn {
    state: Arc<ConnState>,
    peer: std::net::IpAddr,
    close: Arc<Notify>,
}

/// The open connections, by accept order, and how many each peer address holds (kept with
/// them, so an accept counts nothing).
#[derive(Default)]
struct Open {
    conns: BTreeMap<u64, Conn>,
    per_peer: HashMap<std::net::IpAddr, usize>,
}

impl Open {
    fn insert(&mut self, id: u64, conn: Conn) {
        *self.per_peer.entry(conn.peer).or_default() += 1;
        self.conns.insert(id, conn);
    }

    fn remove(&mut self, id: u64) -> Option<Conn> {
        let conn = self.conns.remove(&id)?;
        if let std::collections::hash_map::Entry::Occupied(mut n) = self.per_peer.entry(conn.peer) {
            *n.get_mut() -= 1;
            if *n.get() == 0 {
                n.remove();
            }
        }
        Some(conn)
    }
}

/// The open connections.
pub(crate) struct Connections {
    open: Mutex<Open>,
    next_id: AtomicU64,
    epoch: Instant,
}

/// A connection as the choice of which to close sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    pub id: u64,
    pub requests: usize,
    /// Since when its request's body has been arriving (0: no body pending).
    pub body_since: u64,
    /// Since when its watch long-poll has been waiting (0: not one).
    pub long_poll_since: u64,
}

/// Which connection to close to make room: the oldest idle one, else the one whose body has
/// been arriving the longest, else the longest-waiting watch, else none (every connection is
/// serving a request that must not be cut).
pub(crate) fn victim(open: impl Iterator<Item = Seen>) -> Option<u64> {
    let (mut slowest, mut watch): (Option<Seen>, Option<Seen>) = (None, None);
    for c in open {
        if c.requests == 0 {
            return Some(c.id);
        }
        if c.body_since != 0 && !matches!(slowest, Some(s) if s.body_since <= c.body_since) {
            slowest = Some(c);
        }
        if c.long_poll_since != 0 && !matches!(watch, Some(w) if w.long_poll_since <= c.long_poll_since) {
            watch = Some(c);
        }
    }
    slowest.or(watch).map(|c| c.id)
}

/// Most connections one peer address may hold: a sixteenth of the bound (at least 16).
pub(crate) fn per_peer(max: usize) -> usize {
    (max / 16).max(16)
}

impl Connections {
    pub(crate) fn new() -> Self {
        Connections { open: Mutex::new(Open::default()), next_id: AtomicU64::new(0), epoch: Instant::now() }
    }

    /// Milliseconds since this set was made, at least 1 (0 means "none" in [`ConnState`]).
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX).max(1)
    }

    /// Makes room for one more connection from `peer` within `max`: closes an idle, slow or
    /// watching one if needed ([`victim`]), of `peer`'s own when it holds [`per_peer`]. False
    /// when none may be closed.
    pub(crate) fn make_room(&self, max: usize, peer: std::net::IpAddr) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let crowded = !peer.is_loopback() && open.per_peer.get(&peer).copied().unwrap_or(0) >= per_peer(max);
        if open.conns.len() < max && !crowded {
            return true;
        }
        let seen = open.conns.iter().filter(|(_, c)| !crowded || c.peer == peer).map(|(id, c)| Seen {
            id: *id,
            requests: c.state.requests.load(Ordering::Relaxed),
            body_since: c.state.body_since.load(Ordering::Relaxed),
            long_poll_since: c.state.long_poll_since.load(Ordering::Relaxed),
        });
        match victim(seen).and_then(|id| open.remove(id)) {
            Some(Conn { close, .. }) => {
                // Out of the count at once; the connection closes when its task next runs.
                close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Counts a new connection in; its id (for [`Connections::remove`]), state and close signal.
    pub(crate) fn add(&self, peer: std::net::IpAddr) -> (u64, Arc<ConnState>, Arc<Notify>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (state, close) = (Arc::new(ConnState::default()), Arc::new(Notify::new()));
        let conn = Conn { state: state.clone(), peer, close: close.clone() };
        self.open.lock().unwrap_or_else(|p| p.into_inner()).insert(id, conn);
        (id, state, close)
    }

    pub(crate) fn remove(&self, id: u64) {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }

    /// A request has come in on a connection (its headers are read): counted in progress until
    /// the guard drops, its body (if any) pending until received. The body comes back bounded
    /// by `body_timeout`.
    pub(crate) fn request(
        self: &Arc<Self>,
        state: &Arc<ConnState>,
        body: Incoming,
        body_timeout: Duration,
        long_poll: bool,
    ) -> (InProgress, DeadlineBody) {
        state.requests.fetch_add(1, Ordering::Relaxed);
        if long_poll {
            state.long_poll(self.now());
        }
        if !body.is_end_stream() {
            state.body_since.store(self.now(), Ordering::Relaxed);
        }
        let deadline = Box::pin(tokio::time::sleep(body_timeout));
        let body = DeadlineBody { inner: body, deadline, timeout: body_timeout, state: state.clone(), done: false };
        (InProgress(state.clone()), body)
    }
}

/// A request in progress on its connection, for as long as it lives.
pub(crate) struct InProgress(Arc<ConnState>);

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.body_since.store(0, Ordering::Relaxed);
        self.0.long_poll(0);
        self.0.requests.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The body did not arrive in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyTimeout(pub Duration);

/// A request body that must arrive in full before its deadline; marks its connection's body
/// received when it has.
pub(crate) struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
    state: Arc<ConnState>,
    done: bool,
}

impl DeadlineBody {
    fn finish(&mut self) {
        if !self.done {
            self.done = true;
            self.state.body_since.store(0, Ordering::Relaxed);
        }
    }
}

impl Body for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if this.inner.is_end_stream() {
                    this.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.finish();
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                this.finish();
                Poll::Ready(None)
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.finish();
                    Poll::Ready(Some(Err(BodyTimeout(this.timeout).into())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(id: u64, requests: usize, body_since: u64) -> Seen {
        Seen { id, requests, body_since, long_poll_since: 0 }
    }

    fn watching(id: u64, since: u64) -> Seen {
        Seen { id, requests: 1, body_since: 0, long_poll_since: since }
    }

    #[test]
    fn closes_the_oldest_idle_connection_first() {
        let open = [seen(1, 1, 0), seen(2, 1, 5), seen(3, 0, 0), seen(4, 0, 0)];
        assert_eq!(victim(open.into_iter()), Some(3));
    }

    #[test]
    fn with_none_idle_closes_the_longest_arriving_body_and_never_a_busy_handler() {
        let open = [seen(1, 1, 0), seen(2, 1, 900), seen(3, 1, 40), seen(4, 1, 0)];
        assert_eq!(victim(open.into_iter()), Some(3));
        assert_eq!(victim([seen(1, 1, 0), seen(2, 1, 0)].into_iter()), None);
        assert_eq!(victim(std::iter::empty()), None);
    }

    #[test]
    fn with_none_idle_or_slow_closes_the_longest_waiting_watch_never_another_handler() {
        let open = [seen(1, 1, 0), watching(2, 900), watching(3, 40), seen(4, 1, 0)];
        assert_eq!(victim(open.into_iter()), Some(3));
        // A slow body still goes first, an idle connection before both.
        assert_eq!(victim([watching(2, 10), seen(5, 1, 500)].into_iter()), Some(5));
        assert_eq!(victim([watching(2, 10), seen(6, 0, 0)].into_iter()), Some(6));
    }

    #[test]
    fn a_peer_holding_its_share_loses_its_own_oldest_closable_connection() {
        let c = Connections::new();
        let (attacker, agent): (std::net::IpAddr, std::net::IpAddr) =
            ("10.0.0.66".parse().unwrap(), "10.0.0.5".parse().unwrap());
        let max = 64; // a share of 16
        let (agent_id, agent_state, _) = c.add(agent);
        agent_state.requests.fetch_add(1, Ordering::Relaxed); // a heartbeat in progress
        let mut ids = Vec::new();
        for _ in 0..per_peer(max) {
            assert!(c.make_room(max, attacker));
            let (id, state, _) = c.add(attacker);
            state.requests.fetch_add(1, Ordering::Relaxed);
            state.long_poll(1 + id);
            ids.push(id);
        }
        // Its 17th: one of its own watches goes (the oldest), not the agent's heartbeat.
        assert!(c.make_room(max, attacker));
        let open = c.open.lock().unwrap();
        assert!(
            !open.conns.contains_key(&ids[0]) && open.conns.contains_key(&agent_id),
            "{:?}",
            open.conns.keys().collect::<Vec<_>>()
        );
        assert_eq!(open.per_peer[&attacker], per_peer(max) - 1, "the closed one is out of its count");
        drop(open);
        // Loopback (a proxy on this host) is not limited.
        let local: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        for _ in 0..per_peer(max) + 4 {
            assert!(c.make_room(max, local));
            c.add(local);
        }
        assert!(c.open.lock().unwrap().conns.len() > per_peer(max) * 2);
        // Removed connections leave no count behind.
        for id in ids {
            c.remove(id);
        }
        c.remove(agent_id);
        assert!(!c.open.lock().unwrap().per_peer.contains_key(&attacker));
    }
}

//! The store's data and its waiters, as a pure state machine: no I/O, no async, no clock.
//!
//! Each mutating operation returns the waiters it satisfied (`Wake`s); the server delivers
//! them. A waiter is a condition over keys (all present, or a counter reaching a target) and
//! is re-evaluated only when one of its keys changes, so waits wake exactly on their keys.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

/// Identifies a client connection.
pub type ConnId = u64;
/// Identifies one pending wait.
pub type WaiterId = u64;

/// A satisfied wait: the server must send `STOP_WAITING` on `conn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wake {
    pub conn: ConnId,
    pub waiter: WaiterId,
}

/// Outcome of registering a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The condition already holds: reply at once.
    Ready,
    /// The condition does not hold yet: a `Wake` for this waiter will come later.
    Registered(WaiterId),
}

/// A request the state cannot apply; the store is left unchanged.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StateError {
    #[error("value of key {key:?} is not an integer")]
    NotAnInteger { key: String },
    #[error("adding {delta} to key {key:?} overflows a 64-bit integer")]
    Overflow { key: String, delta: i64 },
}

#[derive(Debug)]
enum Cond {
    /// Every key is set (or names a non-empty queue).
    AllPresent(Vec<Vec<u8>>),
    /// The integer value of `key` is at least `target` (a barrier).
    CounterAtLeast { key: Vec<u8>, target: i64 },
}

impl Cond {
    fn keys(&self) -> &[Vec<u8>] {
        match self {
            Cond::AllPresent(keys) => keys,
            Cond::CounterAtLeast { key, .. } => std::slice::from_ref(key),
        }
    }
}

#[derive(Debug)]
struct Waiter {
    conn: ConnId,
    cond: Cond,
}

/// Keys, values, queues and pending waits of one store.
#[derive(Debug, Default)]
pub struct StoreState {
    kv: HashMap<Vec<u8>, Arc<Vec<u8>>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    waiters: HashMap<WaiterId, Waiter>,
    by_key: HashMap<Vec<u8>, BTreeSet<WaiterId>>,
    by_conn: HashMap<ConnId, BTreeSet<WaiterId>>,
    next_waiter: WaiterId,
    /// Bytes of keys and values held (queues too), for the store's cap.
    bytes: usize,
}

/// Parses a stored counter the way torch's `std::stoll` does: leading whitespace, an optional
/// sign, then digits; anything after the digits is ignored.
pub fn parse_counter(value: &[u8]) -> Option<i64> {
    let start = value.iter().position(|b| !b.is_ascii_whitespace())?;
    let rest = &value[start..];
    let sign_len = usize::from(matches!(rest.first(), Some(b'+' | b'-')));
    let digits = rest[sign_len..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    let text = std::str::from_utf8(&rest[..sign_len + digits]).ok()?;
    text.parse().ok()
}

fn lossy(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

impl StoreState {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn get(&self, key: &[u8]) -> Option<Arc<Vec<u8>>> {
        self.kv.get(key).cloned()
    }

    /// Bytes of keys and values held now (queued values and their keys included).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// What storing `value_len` bytes at `key` would add to [`StoreState::bytes`] (0 when it
    /// shrinks or keeps the size).
    pub fn growth_of_set(&self, key: &[u8], value_len: usize) -> usize {
        match self.kv.get(key) {
            Some(old) => value_len.saturating_sub(old.len()),
            None => key.len() + value_len,
        }
    }

    /// The same for appending `value_len` bytes to the value at `key`.
    pub fn growth_of_append(&self, key: &[u8], value_len: usize) -> usize {
        if self.kv.contains_key(key) {
            value_len
        } else {
            key.len() + value_len
        }
    }

    /// The same for pushing `value_len` bytes on the queue at `key`. Values and queues are
    /// counted apart: a key that has both is held (and counted) twice.
    pub fn growth_of_push(&self, key: &[u8], value_len: usize) -> usize {
        if self.queues.contains_key(key) {
            value_len
        } else {
            key.len() + value_len
        }
    }

    fn account(&mut self, added: usize, removed: usize) {
        self.bytes = (self.bytes + added).saturating_sub(removed);
    }

    pub fn set(&mut self, key: Vec<u8>, value: Vec<u8>) -> Vec<Wake> {
        let mut wakes = Vec::new();
        self.store(key, Arc::new(value), &mut wakes);
        wakes
    }

    /// Stores a value and releases the waiters it satisfies (the key is cloned only when
    /// someone waits on it).
    fn store(&mut self, key: Vec<u8>, value: Arc<Vec<u8>>, wakes: &mut Vec<Wake>) {
        let (key_len, value_len) = (key.len(), value.len());
        let old = if self.by_key.contains_key(&key) {
            let old = self.kv.insert(key.clone(), value);
            self.wake_key(&key, false, wakes);
            old
        } else {
            self.kv.insert(key, value)
        };
        match old {
            Some(old) => self.account(value_len, old.len()),
            None => self.account(key_len + value_len, 0),
        }
    }

    /// torch semantics: a missing key is created only when `expected` is empty; the reply is
    /// the value now stored, or `expected` itself when the key is missing and `expected` is not
    /// empty.
    pub fn compare_set(&mut self, key: Vec<u8>, expected: Vec<u8>, desired: Vec<u8>) -> (Arc<Vec<u8>>, Vec<Wake>) {
        let mut wakes = Vec::new();
        let reply = match self.kv.get_mut(&key) {
            None if expected.is_empty() => {
                let value = Arc::new(desired);
                self.bytes += key.len() + value.len();
                self.kv.insert(key.clone(), value.clone());
                value
            }
            None => Arc::new(expected),
            Some(current) => {
                if current.as_slice() == expected.as_slice() {
                    let (added, removed) = (desired.len(), current.len());
                    *current = Arc::new(desired);
                    self.bytes = (self.bytes + added).saturating_sub(removed);
                }
                current.clone()
            }
        };
        self.wake_key(&key, false, &mut wakes);
        (reply, wakes)
    }

    /// Adds `delta` to the decimal integer stored at `key` (missing = 0) and stores the sum.
    pub fn add(&mut self, key: Vec<u8>, delta: i64) -> Result<(i64, Vec<Wake>), StateError> {
        let current = match self.kv.get(&key) {
            None => 0,
            Some(v) => parse_counter(v).ok_or_else(|| StateError::NotAnInteger { key: lossy(&key) })?,
        };
        let sum = current.checked_add(delta).ok_or_else(|| StateError::Overflow { key: lossy(&key), delta })?;
        let mut wakes = Vec::new();
        self.store(key, Arc::new(sum.to_string().into_bytes()), &mut wakes);
        Ok((sum, wakes))
    }

    fn present(&self, key: &[u8]) -> bool {
        self.kv.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Whether every key is set (a non-empty queue counts, as in torch).
    pub fn check(&self, keys: &[Vec<u8>]) -> bool {
        keys.iter().all(|k| self.present(k))
    }

    fn holds(&self, cond: &Cond) -> bool {
        match cond {
            Cond::AllPresent(keys) => self.check(keys),
            Cond::CounterAtLeast { key, target } => {
                self.kv.get(key).and_then(|v| parse_counter(v)).is_some_and(|count| count >= *target)
            }
        }
    }

    fn register(&mut self, conn: ConnId, cond: Cond) -> WaiterId {
        let id = self.next_waiter;
        self.next_waiter += 1;
        for key in cond.keys() {
            self.by_key.entry(key.clone()).or_default().insert(id);
        }
        self.by_conn.entry(conn).or_default().insert(id);
        self.waiters.insert(id, Waiter { conn, cond });
        id
    }

    fn unregister(&mut self, id: WaiterId) -> Option<Waiter> {
        let waiter = self.waiters.remove(&id)?;
        for key in waiter.cond.keys() {
            if let Some(set) = self.by_key.get_mut(key.as_slice()) {
                set.remove(&id);
                if set.is_empty() {
                    self.by_key.remove(key.as_slice());
                }
            }
        }
        if let Some(set) = self.by_conn.get_mut(&waiter.conn) {
            set.remove(&id);
            if set.is_empty() {
                self.by_conn.remove(&waiter.conn);
            }
        }
        Some(waiter)
    }

    /// Re-evaluates the waiters of `key` (oldest first) and releases those whose condition now
    /// holds; with `only_one`, at most one (a queue push feeds one popper, as in torch).
    fn wake_key(&mut self, key: &[u8], only_one: bool, wakes: &mut Vec<Wake>) {
        let Some(ids) = self.by_key.get(key) else {
            return;
        };
        let ready: Vec<WaiterId> = ids
            .iter()
            .copied()
            .filter(|id| self.waiters.get(id).is_some_and(|w| self.holds(&w.cond)))
            .take(if only_one { 1 } else { usize::MAX })
            .collect();
        for id in ready {
            if let Some(waiter) = self.unregister(id) {
                wakes.push(Wake { conn: waiter.conn, waiter: id });
            }
        }
    }

    /// Waits until every key is present.
    pub fn wait(&mut self, conn: ConnId, keys: Vec<Vec<u8>>) -> WaitOutcome {
        if self.check(&keys) {
            return WaitOutcome::Ready;
        }
        WaitOutcome::Registered(self.register(conn, Cond::AllPresent(keys)))
    }

    /// Drops every pending wait of `conn` (cancel-wait, or the connection went away) and says
    /// how many there were.
    pub fn cancel_waits(&mut self, conn: ConnId) -> usize {
        let ids: Vec<WaiterId> = self.by_conn.get(&conn).map(|set| set.iter().copied().collect()).unwrap_or_default();
        ids.into_iter().filter_map(|id| self.unregister(id)).count()
    }

    pub fn num_keys(&self) -> i64 {
        self.kv.len() as i64
    }

    pub fn delete_key(&mut self, key: &[u8]) -> bool {
        match self.kv.remove(key) {
            Some(old) => {
                self.account(0, key.len() + old.len());
                true
            }
            None => false,
        }
    }

    pub fn append(&mut self, key: Vec<u8>, value: &[u8]) -> Vec<Wake> {
        let mut wakes = Vec::new();
        match self.kv.get_mut(&key) {
            Some(current) => {
                Arc::make_mut(current).extend_from_slice(value);
                self.bytes += value.len();
            }
            None => {
                self.bytes += key.len() + value.len();
                self.kv.insert(key.clone(), Arc::new(value.to_vec()));
            }
        }
        self.wake_key(&key, false, &mut wakes);
        wakes
    }

    /// Values of the keys, in order; a missing key reads as empty (torch clients wait first).
    pub fn multi_get(&self, keys: &[Vec<u8>]) -> Vec<Arc<Vec<u8>>> {
        keys.iter().map(|k| self.get(k).unwrap_or_default()).collect()
    }

    pub fn multi_set(&mut self, kvs: Vec<(Vec<u8>, Vec<u8>)>) -> Vec<Wake> {
        let mut wakes = Vec::new();
        for (key, value) in kvs {
            self.store(key, Arc::new(value), &mut wakes);
        }
        wakes
    }

    pub fn queue_push(&mut self, key: Vec<u8>, value: Vec<u8>) -> Vec<Wake> {
        let mut wakes = Vec::new();
        let added = self.growth_of_push(&key, value.len());
        self.account(added, 0);
        self.queues.entry(key.clone()).or_default().push_back(value);
        self.wake_key(&key, true, &mut wakes);
        wakes
    }

    /// Returns the queue length before the pop, and the popped value when there was one.
    pub fn queue_pop(&mut self, key: &[u8]) -> (i64, Option<Vec<u8>>) {
        let Some(queue) = self.queues.get_mut(key) else {
            return (0, None);
        };
        let len = queue.len() as i64;
        let value = queue.pop_front();
        let mut removed = value.as_ref().map_or(0, Vec::len);
        if queue.is_empty() {
            self.queues.remove(key);
            removed += key.len();
        }
        self.account(0, removed);
        (len, value)
    }

    pub fn queue_len(&self, key: &[u8]) -> i64 {
        self.queues.get(key).map_or(0, |q| q.len() as i64)
    }

    pub fn list_keys(&self) -> Vec<Vec<u8>> {
        self.kv.keys().cloned().collect()
    }

    /// Counts this arrival at the barrier `key` and waits until `world_size` have arrived.
    pub fn barrier(
        &mut self,
        conn: ConnId,
        key: Vec<u8>,
        world_size: i64,
    ) -> Result<(WaitOutcome, Vec<Wake>), StateError> {
        let (count, wakes) = self.add(key.clone(), 1)?;
        if count >= world_size {
            return Ok((WaitOutcome::Ready, wakes));
        }
        let id = self.register(conn, Cond::CounterAtLeast { key, target: world_size });
        Ok((WaitOutcome::Registered(id), wakes))
    }

    /// Removes every key and queue (a fresh store for a new attempt); pending waits stay and
    /// are released by the new attempt's keys. Returns how many keys were removed.
    pub fn clear(&mut self) -> usize {
        let removed = self.kv.len();
        self.kv.clear();
        self.queues.clear();
        self.bytes = 0;
        removed
    }

    /// Number of pending waits, for tests and metrics.
    pub fn pending_waits(&self) -> usize {
        self.waiters.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    #[test]
    fn parses_counters_like_stoll() {
        assert_eq!(parse_counter(b"42"), Some(42));
        assert_eq!(parse_counter(b"  -7"), Some(-7));
        assert_eq!(parse_counter(b"+3xyz"), Some(3));
        assert_eq!(parse_counter(b"abc"), None);
        assert_eq!(parse_counter(b""), None);
        assert_eq!(parse_counter(b"-"), None);
        assert_eq!(parse_counter(b"99999999999999999999"), None);
    }

    #[test]
    fn add_creates_accumulates_and_stores_decimal_text() {
        let mut s = StoreState::new();
        assert_eq!(s.add(k("n"), 5).expect("add").0, 5);
        assert_eq!(s.add(k("n"), -7).expect("add").0, -2);
        assert_eq!(s.get(b"n").expect("set").as_slice(), b"-2");
    }

    #[test]
    fn add_to_non_integer_or_overflowing_value_leaves_the_value_alone() {
        let mut s = StoreState::new();
        s.set(k("t"), k("text"));
        assert!(matches!(s.add(k("t"), 1), Err(StateError::NotAnInteger { .. })));
        assert_eq!(s.get(b"t").expect("kept").as_slice(), b"text");
        s.set(k("big"), i64::MAX.to_string().into_bytes());
        assert!(matches!(s.add(k("big"), 1), Err(StateError::Overflow { .. })));
        assert_eq!(s.get(b"big").expect("kept").as_slice(), i64::MAX.to_string().as_bytes());
    }

    #[test]
    fn compare_set_follows_torch_semantics() {
        let mut s = StoreState::new();
        // Missing key, non-empty expected: nothing stored, `expected` echoed.
        assert_eq!(s.compare_set(k("c"), k("x"), k("y")).0.as_slice(), b"x");
        assert!(s.get(b"c").is_none());
        // Missing key, empty expected: created.
        assert_eq!(s.compare_set(k("c"), k(""), k("first")).0.as_slice(), b"first");
        // Mismatch: current value returned, unchanged.
        assert_eq!(s.compare_set(k("c"), k("nope"), k("z")).0.as_slice(), b"first");
        // Match: swapped.
        assert_eq!(s.compare_set(k("c"), k("first"), k("second")).0.as_slice(), b"second");
    }

    #[test]
    fn wait_wakes_only_when_all_its_keys_are_set() {
        let mut s = StoreState::new();
        let WaitOutcome::Registered(id) = s.wait(7, vec![k("a"), k("b")]) else { panic!("nothing is set yet") };
        assert!(s.set(k("unrelated"), k("1")).is_empty());
        assert!(s.set(k("a"), k("1")).is_empty());
        assert_eq!(s.set(k("b"), k("2")), vec![Wake { conn: 7, waiter: id }]);
        assert_eq!(s.pending_waits(), 0);
        assert_eq!(s.wait(7, vec![k("a"), k("b")]), WaitOutcome::Ready);
    }

    #[test]
    fn wait_re_evaluates_after_a_delete() {
        let mut s = StoreState::new();
        s.set(k("a"), k("1"));
        let WaitOutcome::Registered(_) = s.wait(1, vec![k("a"), k("b")]) else { panic!() };
        s.delete_key(b"a");
        assert!(s.set(k("b"), k("1")).is_empty(), "a was deleted, the wait must go on");
        assert_eq!(s.set(k("a"), k("1")).len(), 1);
    }

    #[test]
    fn add_append_multi_set_and_compare_set_wake_waiters() {
        let mut s = StoreState::new();
        for key in ["w1", "w2", "w3", "w4"] {
            s.wait(1, vec![k(key)]);
        }
        assert_eq!(s.add(k("w1"), 1).expect("add").1.len(), 1);
        assert_eq!(s.append(k("w2"), b"x").len(), 1);
        assert_eq!(s.multi_set(vec![(k("w3"), k("v")), (k("zz"), k("v"))]).len(), 1);
        assert_eq!(s.compare_set(k("w4"), k(""), k("v")).1.len(), 1);
        assert_eq!(s.pending_waits(), 0);
    }

    #[test]
    fn cancel_waits_removes_every_wait_of_that_connection_only() {
        let mut s = StoreState::new();
        s.wait(1, vec![k("a")]);
        s.wait(1, vec![k("b")]);
        s.wait(2, vec![k("a")]);
        assert_eq!(s.cancel_waits(1), 2);
        assert_eq!(s.cancel_waits(1), 0);
        let wakes = s.set(k("a"), k("v"));
        assert_eq!(wakes.len(), 1);
        assert_eq!(wakes[0].conn, 2);
        assert!(s.by_key.is_empty() && s.by_conn.is_empty(), "no index entries leak");
    }

    #[test]
    fn queue_push_wakes_one_waiter_and_pop_reports_length_before() {
        let mut s = StoreState::new();
        s.wait(1, vec![k("q")]);
        s.wait(2, vec![k("q")]);
        let wakes = s.queue_push(k("q"), k("x"));
        assert_eq!(wakes, vec![Wake { conn: 1, waiter: 0 }]);
        assert_eq!(s.queue_len(b"q"), 1);
        assert_eq!(s.queue_pop(b"q"), (1, Some(k("x"))));
        assert_eq!(s.queue_pop(b"q"), (0, None));
        assert_eq!(s.queue_push(k("q"), k("y")), vec![Wake { conn: 2, waiter: 1 }]);
        assert_eq!(s.num_keys(), 0, "queues are not keys");
    }

    #[test]
    fn barrier_releases_everyone_when_the_last_arrives() {
        let mut s = StoreState::new();
        let (first, wakes) = s.barrier(1, k("b"), 3).expect("barrier");
        assert!(matches!(first, WaitOutcome::Registered(_)) && wakes.is_empty());
        let (second, wakes) = s.barrier(2, k("b"), 3).expect("barrier");
        assert!(matches!(second, WaitOutcome::Registered(_)) && wakes.is_empty());
        let (third, wakes) = s.barrier(3, k("b"), 3).expect("barrier");
        assert_eq!(third, WaitOutcome::Ready);
        let mut conns: Vec<ConnId> = wakes.iter().map(|w| w.conn).collect();
        conns.sort();
        assert_eq!(conns, vec![1, 2]);
    }

    #[test]
    fn clear_empties_keys_and_queues_but_keeps_waiters() {
        let mut s = StoreState::new();
        s.set(k("a"), k("1"));
        s.queue_push(k("q"), k("x"));
        s.wait(1, vec![k("b")]);
        assert_eq!(s.clear(), 1);
        assert_eq!((s.num_keys(), s.queue_len(b"q"), s.pending_waits()), (0, 0, 1));
        assert_eq!(s.set(k("b"), k("1")).len(), 1);
    }

    #[test]
    fn list_and_count_keys() {
        let mut s = StoreState::new();
        s.multi_set(vec![(k("a"), k("1")), (k("b"), k("2"))]);
        let mut keys = s.list_keys();
        keys.sort();
        assert_eq!(keys, vec![k("a"), k("b")]);
        assert_eq!(s.num_keys(), 2);
        assert!(s.delete_key(b"a"));
        assert!(!s.delete_key(b"a"));
        assert_eq!(s.multi_get(&[k("b"), k("a")]), vec![Arc::new(k("2")), Arc::new(Vec::new())]);
    }

    #[test]
    fn bytes_stay_exact_when_a_key_is_both_a_value_and_a_queue() {
        let mut st = StoreState::new();
        let key = k("/both");
        // set, push, delete, pop: nothing left, nothing counted.
        st.set(key.clone(), vec![0; 100]);
        st.queue_push(key.clone(), vec![0; 50]);
        assert!(st.delete_key(&key));
        st.queue_pop(&key);
        assert_eq!(st.bytes(), 0);
        // push, set, pop, delete: the same.
        st.queue_push(key.clone(), vec![0; 50]);
        st.set(key.clone(), vec![0; 100]);
        st.queue_pop(&key);
        assert!(st.delete_key(&key));
        assert_eq!(st.bytes(), 0);
        // compare_set, append and add keep the count.
        st.compare_set(key.clone(), Vec::new(), vec![1; 10]);
        st.append(key.clone(), &[2; 5]);
        assert_eq!(st.bytes(), key.len() + 15);
        st.add(k("/n"), 7).unwrap();
        assert_eq!(st.bytes(), key.len() + 15 + 2 + 1);
        st.clear();
        assert_eq!(st.bytes(), 0);
    }
}

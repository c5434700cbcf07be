//! What one process knows of the alive keys it holds: pure bookkeeping, every decision a function
//! of this state, an event and the time (the etcd requests around it are in the parent module).
//!
//! A node's alive key sits on a lease of the process that hears from it (one lease per TTL). A
//! heartbeat is answered from memory only for a key this process *verified* it holds, on a lease
//! etcd confirmed recently. Anything that may have changed the key behind this process's back (a
//! watch that missed events, a later event than our own write, a delete whose outcome is unknown)
//! makes the entry unverified: the next heartbeat reads etcd.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::round::liveness;

/// The lease keep-alive period: at most every half second, so a heartbeat answered from memory
/// vouches for a lease confirmed within about a second (an agent cut off from etcd learns it as
/// fast as when each heartbeat was a keep-alive).
pub(super) fn renew_every(ttl_s: i64) -> Duration {
    Duration::from_millis(u64::try_from(ttl_s).unwrap_or(1).saturating_mul(250)).min(Duration::from_millis(500))
}

/// A heartbeat is answered from memory only while the lease was confirmed this recently.
pub(super) fn renewed_within(ttl_s: i64) -> Duration {
    renew_every(ttl_s) + Duration::from_millis(500)
}

/// A confirmation of a lease on fresh connections that did not succeed (failed, or abandoned by
/// its caller): when it began, and how many in a row.
#[derive(Clone, Copy, Debug)]
pub(super) struct ConfirmTry {
    pub(super) at: Instant,
    pub(super) failures: u32,
}

/// Idle leases (no key held) are revoked after this long, so TTLs that nobody uses any more (or
/// refused joins) leave no lease behind.
pub(super) const LEASE_IDLE: Duration = Duration::from_secs(2);

/// How long a watch event on an alive key this process does not hold is remembered: longer than
/// any request of ours may take (a write that committed before the event must not be noted as
/// held after it).
const EVENT_MEMORY: Duration = Duration::from_secs(30);

pub(super) fn ttl_seconds(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000)).unwrap_or(i64::MAX).max(1)
}

#[derive(Default)]
pub(super) struct Leases {
    pub(super) by_ttl: HashMap<i64, SharedLease>,
    /// Alive keys on this process's leases.
    pub(super) held: HashMap<String, Held>,
    /// The newest watch event seen on each alive key lately (mod revision, when seen).
    events: HashMap<String, (i64, Instant)>,
}

pub(super) struct SharedLease {
    pub(super) id: i64,
    /// When etcd last confirmed the lease (a heartbeat answered from memory needs a recent one).
    pub(super) renewed: Instant,
    /// When a key was last put on it: a lease that holds no key for a while is revoked.
    pub(super) used: Instant,
    pub(super) keeper: Option<JoinHandle<()>>,
}

#[derive(Clone, Debug)]
pub(super) struct Held {
    pub(super) lease: i64,
    pub(super) ttl: Duration,
    /// The key's mod revision as our write (or read) left it.
    pub(super) revision: i64,
    pub(super) heard: Instant,
    /// Whether the key is known to be as `revision` says; else the next heartbeat reads etcd.
    pub(super) verified: bool,
}

/// What [`Leases::touch`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Touch {
    /// Held, verified, on a lease confirmed recently: the heartbeat is recorded.
    Answered,
    /// Held on the current lease, but etcd has not confirmed it lately (unreachable?).
    Unconfirmed,
    /// Not held, or not known to be: etcd must be read.
    Read,
}

impl Leases {
    /// The current lease for `ttl_s`, marked used.
    pub(super) fn current(&mut self, ttl_s: i64, now: Instant) -> Option<i64> {
        self.by_ttl.get_mut(&ttl_s).map(|l| {
            l.used = now;
            l.id
        })
    }

    fn is_current(&self, lease: i64, ttl: Duration) -> bool {
        self.by_ttl.get(&ttl_seconds(ttl)).is_some_and(|l| l.id == lease)
    }

    /// A heartbeat for `key`.
    pub(super) fn touch(&mut self, key: &str, now: Instant) -> Touch {
        let Some(h) = self.held.get(key) else { return Touch::Read };
        let ttl_s = ttl_seconds(h.ttl);
        let Some(lease) = self.by_ttl.get(&ttl_s).filter(|l| l.id == h.lease) else {
            // The lease was revoked or lapsed: the key went with it.
            self.held.remove(key);
            return Touch::Read;
        };
        if !h.verified {
            return Touch::Read;
        }
        let confirmed = now.saturating_duration_since(lease.renewed) < renewed_within(ttl_s);
        // The node spoke: it is not silent, whatever etcd's state (the sweeper must not delete
        // the key of a node that beats while etcd is slow to confirm the lease).
        if let Some(h) = self.held.get_mut(key) {
            h.heard = now;
        }
        if confirmed {
            Touch::Answered
        } else {
            Touch::Unconfirmed
        }
    }

    /// The lease `key` is held on and its TTL in seconds, while the key is held, verified, on the
    /// current lease for its TTL: what a confirmation of that lease ([`Touch::Unconfirmed`]) renews.
    pub(super) fn lease_of(&self, key: &str) -> Option<(i64, i64)> {
        let h = self.held.get(key).filter(|h| h.verified)?;
        let ttl_s = ttl_seconds(h.ttl);
        self.by_ttl.get(&ttl_s).filter(|l| l.id == h.lease).map(|l| (l.id, ttl_s))
    }

    /// etcd confirmed lease `id` (for `ttl_s`), by a keep-alive answered at `now`; false when it is
    /// no longer this process's lease for that TTL.
    pub(super) fn confirmed(&mut self, ttl_s: i64, id: i64, now: Instant) -> bool {
        match self.by_ttl.get_mut(&ttl_s) {
            Some(l) if l.id == id => {
                l.renewed = l.renewed.max(now);
                true
            }
            _ => false,
        }
    }

    /// When this process last heard from the nodes whose alive keys under `prefix` it holds, by
    /// node id.
    pub(super) fn heard_under(&self, prefix: &str) -> std::collections::HashMap<String, Instant> {
        self.held.iter().filter_map(|(k, h)| Some((k.strip_prefix(prefix)?.to_owned(), h.heard))).collect()
    }

    /// Notes that our write (or read) left `key` at `revision` on `lease`. Refused (false) when
    /// the lease is no longer this process's current one, or the watch already saw a later change
    /// of the key: the caller must look again.
    pub(super) fn note_held(&mut self, key: &str, lease: i64, ttl: Duration, revision: i64, now: Instant) -> bool {
        if !self.is_current(lease, ttl) || self.events.get(key).is_some_and(|(r, _)| *r > revision) {
            return false;
        }
        self.held.insert(key.to_owned(), Held { lease, ttl, revision, heard: now, verified: true });
        true
    }

    /// A watch event on an alive key: a delete, or a put on another lease, after our write means
    /// the key is no longer ours.
    pub(super) fn on_event(&mut self, key: &str, mod_revision: i64, lease: i64, deleted: bool, now: Instant) {
        if let Some(h) = self.held.get(key) {
            if mod_revision > h.revision && (deleted || lease != h.lease) {
                self.held.remove(key);
            }
        }
        let e = self.events.entry(key.to_owned()).or_insert((mod_revision, now));
        if mod_revision >= e.0 {
            *e = (mod_revision, now);
        }
    }

    /// The watch (re)started. Not resumed from where it stopped (compacted, or never started):
    /// events may have been missed, so every held key is read again at its next heartbeat.
    pub(super) fn on_watch_start(&mut self, resumed: bool) {
        if !resumed {
            for h in self.held.values_mut() {
                h.verified = false;
            }
        }
    }

    /// Keys silent past their TTL ([`liveness::stale`]; removed: the caller deletes them in etcd),
    /// and leases without keys for [`LEASE_IDLE`] (removed: the caller revokes them). Old events
    /// are forgotten.
    pub(super) fn sweep(&mut self, now: Instant) -> (Vec<(String, Held)>, Vec<i64>) {
        let stale: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| liveness::stale(now.saturating_duration_since(h.heard), h.ttl))
            .map(|(k, _)| k.clone())
            .collect();
        let stale: Vec<(String, Held)> =
            stale.into_iter().filter_map(|k| self.held.remove(&k).map(|h| (k, h))).collect();
        let in_use: HashSet<i64> = self.held.values().map(|h| h.lease).collect();
        let mut idle = Vec::new();
        self.by_ttl.retain(|_, l| {
            let unused = !in_use.contains(&l.id) && now.saturating_duration_since(l.used) > LEASE_IDLE;
            if unused {
                if let Some(k) = l.keeper.take() {
                    k.abort();
                }
                idle.push(l.id);
            }
            !unused
        });
        self.events.retain(|_, (_, seen)| now.saturating_duration_since(*seen) < EVENT_MEMORY);
        (stale, idle)
    }

    /// A silent node's key whose delete may not have happened (etcd did not answer): kept, still
    /// silent (the next sweep tries again), and unverified (a heartbeat meanwhile reads etcd) -
    /// unless the watch saw it change since.
    pub(super) fn retry_delete(&mut self, key: String, mut held: Held) {
        if self.events.get(&key).is_some_and(|(r, _)| *r > held.revision) || !self.is_current(held.lease, held.ttl) {
            return;
        }
        held.verified = false;
        self.held.entry(key).or_insert(held);
    }

    /// Forgets a lease etcd no longer has, and the keys held on it; returns how many keys.
    pub(super) fn drop_lease(&mut self, id: i64) -> usize {
        let before = self.held.len();
        self.held.retain(|_, h| h.lease != id);
        self.by_ttl.retain(|_, l| {
            if l.id == id {
                if let Some(k) = l.keeper.take() {
                    k.abort();
                }
            }
            l.id != id
        });
        before - self.held.len()
    }
}

/// How long after a confirmation that did not succeed the next may begin: 0.25 s after the first,
/// doubling with each failure in a row up to 4 s (heartbeats meanwhile are answered
/// "unconfirmed" at once: 10,000 of them waiting on one must not each try in turn, and an etcd
/// that is down is not dialled ever faster).
pub(super) fn confirm_wait(failures: u32) -> Duration {
    Duration::from_millis(250) * 2u32.pow(failures.saturating_sub(1).min(4))
}

/// Whether a lease whose keep-alive stream has not been answered lately is confirmed on fresh
/// connections now, after `last` (the last try that did not succeed, if any).
pub(super) fn may_confirm(last: Option<ConfirmTry>, now: Instant) -> bool {
    last.is_none_or(|t| now.saturating_duration_since(t.at) >= confirm_wait(t.failures))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(3);

    fn with_lease(id: i64, t0: Instant) -> Leases {
        let mut l = Leases::default();
        l.by_ttl.insert(3, SharedLease { id, renewed: t0, used: t0, keeper: None });
        l
    }

    #[test]
    fn a_verified_key_on_a_confirmed_lease_is_answered_from_memory() {
        let t0 = Instant::now();
        let mut l = with_lease(7, t0);
        assert_eq!(l.touch("k", t0), Touch::Read, "not held");
        assert!(l.note_held("k", 7, TTL, 10, t0));
        assert_eq!(l.touch("k", t0 + Duration::from_millis(500)), Touch::Answered);
        // etcd silent on the lease for longer than the keep-alive period allows: not answered,
        // but the node is not silent either (the sweeper leaves its key).
        let late = t0 + Duration::from_secs(2);
        assert_eq!(l.touch("k", late), Touch::Unconfirmed);
        assert!(l.sweep(late + TTL - Duration::from_millis(1)).0.is_empty());
    }

    #[test]
    fn an_unconfirmed_lease_confirmed_anew_answers_again_and_a_failed_try_waits_before_the_next() {
        let t0 = Instant::now();
        let mut l = with_lease(7, t0);
        assert_eq!(l.lease_of("k"), None, "not held");
        assert!(l.note_held("k", 7, TTL, 10, t0));
        let late = t0 + Duration::from_secs(2);
        assert_eq!(l.touch("k", late), Touch::Unconfirmed);
        assert_eq!(l.lease_of("k"), Some((7, 3)));
        // A keep-alive on a fresh connection answered: heartbeats are answered from memory again.
        assert!(l.confirmed(3, 7, late));
        assert_eq!(l.touch("k", late + Duration::from_millis(100)), Touch::Answered);
        // A stale confirmation never moves the lease's renewal back, and one of another lease
        // (replaced meanwhile) confirms nothing.
        assert!(l.confirmed(3, 7, t0));
        assert_eq!(l.touch("k", late + Duration::from_millis(200)), Touch::Answered);
        assert!(!l.confirmed(3, 8, late));
        // An unverified key is read from etcd, not confirmed.
        l.on_watch_start(false);
        assert_eq!(l.lease_of("k"), None);
        // After a try that did not succeed, the next waits a while (the heartbeats meanwhile fail
        // at once), longer after each failure in a row, never more than 4 s.
        assert!(may_confirm(None, t0));
        let ms = Duration::from_millis;
        let after = |failures| Some(ConfirmTry { at: t0, failures });
        assert!(!may_confirm(after(1), t0 + ms(249)));
        assert!(may_confirm(after(1), t0 + ms(250)));
        assert!(!may_confirm(after(2), t0 + ms(499)));
        assert!(may_confirm(after(3), t0 + ms(1000)));
        assert!(!may_confirm(after(40), t0 + ms(3999)));
        assert!(may_confirm(after(u32::MAX), t0 + ms(4000)));
    }

    #[test]
    fn a_write_older_than_an_event_already_seen_is_not_held() {
        let t0 = Instant::now();
        let mut l = with_lease(7, t0);
        // Another replica took the key over at revision 12 before our answer (revision 11) came.
        l.on_event("k", 12, 8, false, t0);
        assert!(!l.note_held("k", 7, TTL, 11, t0));
        assert_eq!(l.touch("k", t0), Touch::Read);
        // A read at 12 or later is fine.
        assert!(l.note_held("k", 7, TTL, 13, t0));
    }

    #[test]
    fn a_delete_or_a_foreign_put_after_ours_drops_the_key_but_our_own_echo_does_not() {
        let t0 = Instant::now();
        let mut l = with_lease(7, t0);
        assert!(l.note_held("k", 7, TTL, 10, t0));
        l.on_event("k", 10, 7, false, t0);
        assert_eq!(l.touch("k", t0), Touch::Answered, "our own put's event");
        l.on_event("k", 11, 7, true, t0);
        assert_eq!(l.touch("k", t0), Touch::Read, "deleted");
        assert!(l.note_held("k", 7, TTL, 12, t0));
        l.on_event("k", 13, 9, false, t0);
        assert_eq!(l.touch("k", t0), Touch::Read, "put on another lease");
    }

    #[test]
    fn a_watch_that_missed_events_makes_every_key_read_again() {
        let t0 = Instant::now();
        let mut l = with_lease(7, t0);
        assert!(l.note_held("a", 7, TTL, 10, t0));
        assert!(l.note_held("b", 7, TTL, 11, t0));
        l.on_watch_start(true);
        assert_eq!(l.touch("a", t0), Touch::Answered, "resumed: nothing missed");
        l.on_watch_start(false);
        assert_eq!((l.touch("a", t0), l.touch("b", t0)), (Touch::Read, Touch::Read));
        // Still swept when silent, though.
        let (stale, _) = l.sweep(t0 + TTL + Duration::from_millis(1));
        assert_eq!(stale.len(), 2);
    }

    #[test]
    fn a_key_on_a_lease_that_is_gone_is_not_answered() {
        let t0 = Instant::now();
        let mut l = with_lease(7, t0);
        assert!(l.note_held("k", 7, TTL, 10, t0));
        // Revoked as idle (or lapsed) and replaced by a new lease for the same TTL.
        l.by_ttl.insert(3, SharedLease { id: 8, renewed: t0, used: t0, keeper: None });
        assert_eq!(l.touch("k", t0), Touch::Read);
        assert!(!l.held.contains_key("k"));
        assert!(!l.note_held("k", 7, TTL, 11, t0), "a write on the old lease is not held");
    }

    #[test]
    fn a_delete_without_an_answer_is_retried_and_the_key_is_read_at_the_next_heartbeat() {
        let t0 = Instant::now();
        let mut l = with_lease(7, t0);
        assert!(l.note_held("k", 7, TTL, 10, t0));
        let late = t0 + TTL + Duration::from_millis(1);
        // Other nodes joined lately: the lease stays.
        assert_eq!(l.current(3, late), Some(7));
        let (stale, idle) = l.sweep(late);
        assert_eq!((stale.len(), idle.len()), (1, 0));
        let (key, held) = stale.into_iter().next().unwrap();
        l.retry_delete(key.clone(), held.clone());
        // A heartbeat now must not resurrect the node from memory.
        assert_eq!(l.touch("k", late), Touch::Read);
        assert_eq!(l.sweep(late).0.len(), 1, "tried again");
        // The delete did commit after all: the watch saw it, no retry.
        l.on_event("k", 11, 0, true, late);
        l.retry_delete(key, held);
        assert!(l.held.is_empty());
    }

    #[test]
    fn a_lease_without_keys_is_revoked_after_a_while() {
        let t0 = Instant::now();
        let mut l = with_lease(7, t0);
        assert!(l.note_held("k", 7, TTL, 10, t0));
        assert!(l.sweep(t0 + Duration::from_millis(2500)).1.is_empty(), "holds a key (silent for less than its TTL)");
        l.held.clear();
        assert!(l.sweep(t0 + Duration::from_secs(1)).1.is_empty(), "used a second ago");
        assert_eq!(l.sweep(t0 + LEASE_IDLE * 2).1, vec![7]);
        assert!(l.by_ttl.is_empty());
    }
}

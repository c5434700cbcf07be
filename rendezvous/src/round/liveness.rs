//! Liveness where the store keeps no heartbeat times (etcd), decided here, pure: what one read of
//! a job's liveness records makes of the job, how a node that fell silent is dated, and when a
//! record is stale. State, events and times (`now`, how long ago) come in; nothing is read.
//!
//! The memory store needs none of this: every heartbeat goes through the machine, which sets the
//! node's `last_seen` and clears its suspicion ([`Health::arrived`](crate::detector::Health)).
//! On etcd a heartbeat only keeps the node's `alive` key on a lease, so the job read from etcd has
//! no heartbeat times; [`observe`] gives it the fields the machine reads (`last_seen`, `vouched`,
//! `lapsed_heard`) and clears the suspicions a sign of life refuted. From there both stores run
//! the same rules: the tick declares a node lost ([`Job::lapsed`], through the detector's verdict)
//! and the round it tears down is dated at the node's last sign of life ([`last_heard`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use super::job::Job;
use super::settings::{JobSettings, Millis};
use crate::detector::Suspicion;

/// What one read of a job's liveness records found.
#[derive(Debug, Clone, Copy)]
pub struct Signs<'a> {
    /// Nodes whose liveness record exists (etcd: an `alive` key, on whichever process's lease).
    pub alive: &'a [String],
    /// When this process last heard from the nodes whose records it holds itself (Unix ms).
    pub heard: &'a HashMap<String, Millis>,
    /// Nodes whose records a process let lapse for silence, and when that process last heard
    /// from each (Unix ms).
    pub lapsed: &'a [(String, Millis)],
}

/// The job with liveness from `signs` at `now`, replacing what it had:
/// - a node with a record counts as heard from ([`last_seen`]); one without is silent;
/// - a node whose record another process holds is that process's to judge ([`vouched`]: seen as
///   just heard, its suspicion left as it is);
/// - a suspicion of a node this process holds and heard from is cleared when that refutes it
///   ([`refuted`]); any other suspicion is left as it is;
/// - a lapsed node is dated as the process that let it lapse last heard from it
///   (`lapsed_heard`, read by [`last_heard`]).
pub fn observe(mut job: Job, signs: &Signs<'_>, now: Millis) -> Job {
    job.last_seen = last_seen(signs.alive, signs.heard, now);
    job.vouched = vouched(signs.alive, signs.heard);
    for (id, at) in signs.heard.iter().filter(|(id, _)| job.last_seen.contains_key(*id)) {
        if let Some(h) = job.health.get_mut(id) {
            if h.suspicion.as_ref().is_some_and(|s| refuted(s, *at, now)) {
                h.suspicion = None;
            }
        }
    }
    job.lapsed_heard = signs.lapsed.iter().cloned().collect();
    job
}

/// When each node with a record was last heard from: as this process last heard it where it holds
/// the record (never after `now`: a clock gone back does not date a beat in the future), else
/// `now` (another process holds it, and vouches that the node is alive).
pub fn last_seen(alive: &[String], heard: &HashMap<String, Millis>, now: Millis) -> BTreeMap<String, Millis> {
    alive.iter().map(|id| (id.clone(), heard.get(id).copied().unwrap_or(now).min(now))).collect()
}

/// The nodes with a record this process does not hold: another process hears from them.
pub fn vouched(alive: &[String], heard: &HashMap<String, Millis>) -> BTreeSet<String> {
    alive.iter().filter(|id| !heard.contains_key(*id)).cloned().collect()
}

/// Whether a node heard from at `heard` is no longer suspected for `suspicion` at `now`: it was
/// heard after the suspicion began (at the same millisecond it may have been the beat whose
/// silence started it), or the suspicion began after `now` (on a clock that has since gone back,
/// so nothing dates it).
pub fn refuted(suspicion: &Suspicion, heard: Millis, now: Millis) -> bool {
    heard > suspicion.since || suspicion.since > now
}

/// When a node was last heard from, given that it was `ago` before `now`: its last sign of life,
/// not when its silence was noticed (a sweep that runs late must not date the loss late).
pub fn heard_at(now: Millis, ago: Duration) -> Millis {
    now.saturating_sub(u64::try_from(ago.as_millis()).unwrap_or(u64::MAX))
}

/// Whether a record whose node has been silent for `silence` is stale, to be removed: silent for
/// longer than the node's TTL (a node heard exactly a TTL ago still holds its record).
pub fn stale(silence: Duration, ttl: Duration) -> bool {
    silence > ttl
}

/// When the earliest of `nodes` was last heard from, on either store: its last heartbeat held in
/// the job (`last_seen`) or, if later, when one of its watchers last heard it, else when the process that let its record lapse last heard from it
/// (`lapsed_heard`, etcd), else one TTL before `now` (a node is suspected a TTL into its silence
/// at the latest).
pub fn last_heard(job: &Job, nodes: &[String], now: Millis) -> Millis {
    let ttl = JobSettings::ms(job.settings.node_ttl);
    nodes
        .iter()
        .filter_map(|id| {
            let heard = job.last_seen.get(id).or_else(|| job.lapsed_heard.get(id)).copied();
            // A watcher that heard the node after the rendezvous did knows better.
            let peer = job.health.get(id).and_then(|h| h.last_peer_sign());
            heard.max(peer.filter(|p| *p <= now))
        })
        .min()
        .unwrap_or(now.saturating_sub(ttl))
}

#[cfg(test)]
mod tests;

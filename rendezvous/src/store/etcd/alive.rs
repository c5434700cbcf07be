//! The alive keys: a node's key put on this process's lease when it joins (or taken over from
//! another replica's, or put back after it lapsed while the job still counts the node), kept by
//! the lease's keep-alive, and deleted by the sweeper once the node is silent past its TTL, with
//! a note of when it was last heard. Which keys are stale and how their nodes are dated is
//! [`liveness`]'s to say; this file does the requests.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp};
use tokio::time::Instant;
use tracing::{debug, warn};

use super::layout::{alive_key, lapsed_key_of, state_key};
use super::leases::{may_confirm, renew_every, renewed_within, ttl_seconds, ConfirmTry, SharedLease, Touch};
use super::{EtcdStore, Inner, OP_TIMEOUT};
use crate::error::RdzvError;
use crate::round::liveness;
use crate::round::{Action, Decision};

/// How long the notes of silent nodes' last heartbeats stay at least (a lease of their own,
/// three TTLs and 10 s when that is longer): the machine acts on a loss well within it.
const LAPSED_TTL_S: i64 = 30;

/// How long a confirmation of a lease on fresh connections may take: a heartbeat waits for it.
const CONFIRM_WITHIN: Duration = Duration::from_secs(1);

/// Attempts at putting a node's alive key back, and at holding one, before giving up on a key
/// that keeps changing under them (`RdzvError::Contention`).
const RENEW_ATTEMPTS: u32 = 3;
const HOLD_ATTEMPTS: u32 = 4;

/// Whether a request failed because its lease is gone (revoked or expired).
fn lease_gone(e: &RdzvError) -> bool {
    matches!(e, RdzvError::Etcd { source, .. } if source.to_string().contains("lease not found"))
}

/// Whether opening a keep-alive failed because etcd answered the lease's TTL as 0 (it lapsed or
/// was revoked): etcd-client reads the first answer and says so with this error.
fn lapsed(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::LeaseKeepAliveError(m) if m.contains("lease not found"))
}

/// Forgets lease `id`, which etcd says lapsed (or was revoked), and the keys held on it.
fn forget_lapsed(inner: &Inner, id: i64) {
    let keys = inner.leases.lock().unwrap_or_else(|p| p.into_inner()).drop_lease(id);
    warn!(lease = id, keys, "this replica's etcd lease lapsed; its nodes take new keys with their next heartbeat");
}

/// Keeps `id` alive for as long as the store lives and the lease is in use; when etcd says it is
/// gone, forgets it and every key held on it (those keys went with it).
async fn keep_lease(inner: std::sync::Weak<Inner>, ttl_s: i64, id: i64) {
    let every = renew_every(ttl_s);
    // An attempt that takes longer than a confirmation may be old moves on to the next member.
    let patience = renewed_within(ttl_s).min(OP_TIMEOUT);
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut member = 0usize;
    loop {
        tokio::time::sleep(every).await;
        let Some(inner) = inner.upgrade() else { return };
        if stream.is_none() {
            let mut client = inner.clients[member % inner.clients.len()].clone();
            match tokio::time::timeout(patience, client.lease_keep_alive(id)).await {
                Ok(Ok(s)) => stream = Some(s),
                // (etcd-client reads the first answer: a TTL of 0 is this error.)
                Ok(Err(error)) if lapsed(&error) => {
                    forget_lapsed(&inner, id);
                    return;
                }
                Ok(Err(error)) => {
                    debug!(lease = id, error = %error, "could not open a keep-alive stream; next member");
                    member += 1;
                    continue;
                }
                Err(_) => {
                    member += 1;
                    continue;
                }
            }
        }
        let (keeper, answers) = stream.as_mut().expect("opened just above");
        let answer = tokio::time::timeout(patience, async {
            keeper.keep_alive().await?;
            answers.message().await
        })
        .await;
        match answer {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                let mut leases = inner.leases.lock().unwrap_or_else(|p| p.into_inner());
                match leases.by_ttl.get_mut(&ttl_s) {
                    Some(lease) if lease.id == id => lease.renewed = Instant::now(),
                    // Revoked as idle, or replaced.
                    _ => return,
                }
            }
            Ok(Ok(Some(_))) => {
                forget_lapsed(&inner, id);
                return;
            }
            Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                debug!(lease = id, "keep-alive stream broke; reopening on the next member");
                stream = None;
                member += 1;
            }
        }
    }
}

/// Deletes the alive keys of nodes this process held but has not heard from for their TTL, and
/// revokes leases left without keys; every 100 ms for as long as the store lives.
pub(super) async fn sweep(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(inner) = inner.upgrade() else { return };
        let store = EtcdStore { inner };
        store.sweep_once().await;
    }
}

impl EtcdStore {
    /// Makes sure a node about to join has an alive key, without letting a caller that may not
    /// speak for it keep a dead node alive: a node the keys last read do not name (or any, before
    /// the job was read) gets its key only if it has none (the join's own update then checks
    /// it, atomically, and a refused join deletes the key), with no read of the whole job
    /// (10,000 joins would each read 10,000 keys); a key that exists, or a node the job names,
    /// is taken only after the caller's secret is checked. Returns whether this call created the
    /// key.
    pub(crate) async fn register_join(
        &self,
        run_id: &str,
        node_id: &str,
        secret: Option<&str>,
        ttl: Duration,
    ) -> Result<bool, RdzvError> {
        let known = {
            let keys = self.inner.keys.lock().unwrap_or_else(|p| p.into_inner());
            keys.get(run_id).map(|k| k.contains_key(node_id))
        };
        // Not named (or the job not read yet: 10,000 first joins must not each read it).
        if known != Some(true) {
            match self.hold(run_id, node_id, ttl, true, false).await? {
                Hold::Created => return Ok(true),
                Hold::Held => return Ok(false),
                Hold::Absent | Hold::Elsewhere => {}
            }
        }
        match self.authorize(run_id, node_id, secret).await {
            Ok(()) | Err(RdzvError::UnknownJob { .. }) => {}
            Err(e) => return Err(e),
        }
        Ok(self.hold(run_id, node_id, ttl, true, true).await? == Hold::Created)
    }

    /// Puts `node_id`'s alive key back on this process's lease if the job still counts it,
    /// atomically with the job's state as read: a loss committed meanwhile wins (and the key is
    /// not written).
    pub(super) async fn renew_if_tracked(&self, run_id: &str, node_id: &str) -> Result<bool, RdzvError> {
        let key = alive_key(run_id, node_id);
        for _ in 0..RENEW_ATTEMPTS {
            let snap = self.read(run_id).await?;
            let Some(job) = snap.job.as_ref().filter(|j| j.tracks(node_id)) else { return Ok(false) };
            let ttl = job.settings.node_ttl;
            let lease = self.lease_for(ttl_seconds(ttl)).await?;
            let txn = Txn::new()
                .when([Compare::mod_revision(state_key(run_id), CompareOp::Equal, snap.mod_revision)])
                .and_then([TxnOp::put(
                    key.clone(),
                    node_id.as_bytes().to_vec(),
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            match self.txn("renew alive key", txn).await {
                Ok(resp) if resp.succeeded() => {
                    if self.note_held(&key, lease, ttl, resp.header().map_or(0, |h| h.revision())) {
                        debug!(run_id, node_id, lease, "lapsed alive key renewed");
                        return Ok(true);
                    }
                }
                Ok(_) => {}
                Err(e) if lease_gone(&e) => self.drop_lease(lease),
                Err(e) => return Err(e),
            }
        }
        // Every attempt met a newer key (another lease, a node's new registration).
        Err(RdzvError::Contention { run_id: run_id.to_owned(), attempts: RENEW_ATTEMPTS })
    }

    /// This process's lease for keys with a TTL of `ttl_s` seconds, granted on first use.
    async fn lease_for(&self, ttl_s: i64) -> Result<i64, RdzvError> {
        let current =
            |s: &Self| s.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).current(ttl_s, Instant::now());
        if let Some(id) = current(self) {
            return Ok(id);
        }
        let _one = self.inner.granting.lock().await;
        if let Some(id) = current(self) {
            return Ok(id);
        }
        let id = self.run("lease grant", |mut c| async move { c.lease_grant(ttl_s, None).await }).await?.id();
        let keeper = tokio::spawn(keep_lease(Arc::downgrade(&self.inner), ttl_s, id));
        let now = Instant::now();
        let mut leases = self.inner.leases.lock().unwrap_or_else(|p| p.into_inner());
        leases.by_ttl.insert(ttl_s, SharedLease { id, renewed: now, used: now, keeper: Some(keeper) });
        debug!(lease = id, ttl_s, "replica lease granted");
        Ok(id)
    }

    /// Forgets a lease etcd no longer has, and the keys held on it.
    fn drop_lease(&self, id: i64) {
        self.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).drop_lease(id);
    }

    fn note_held(&self, key: &str, lease: i64, ttl: Duration, revision: i64) -> bool {
        let mut leases = self.inner.leases.lock().unwrap_or_else(|p| p.into_inner());
        leases.note_held(key, lease, ttl, revision, Instant::now())
    }

    fn touch(&self, key: &str) -> Touch {
        self.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).touch(key, Instant::now())
    }

    /// Keeps node `node_id` alive: from memory when this process holds its key; else the key
    /// is read and, when another replica holds it, taken over (a transaction on its revision).
    /// Unknown node: no key.
    pub async fn keep_alive(&self, run_id: &str, node_id: &str) -> Result<Decision, RdzvError> {
        let key = alive_key(run_id, node_id);
        let recorded = || Decision { action: Action::HeartbeatRecorded, reason: format!("{node_id} heard from") };
        match self.touch(&key) {
            Touch::Answered => return Ok(recorded()),
            Touch::Unconfirmed => match self.confirm_lease(&key).await {
                Touch::Answered => return Ok(recorded()),
                Touch::Unconfirmed => {
                    return Err(RdzvError::Store {
                        message: "this replica's etcd lease was not confirmed recently (etcd unreachable?)".to_owned(),
                    })
                }
                // The key went meanwhile (its lease lapsed, a watch event): read as below.
                Touch::Read => {}
            },
            Touch::Read => {}
        }
        let Some(ttl) = self.view(run_id, None, |job| job.settings.node_ttl).await? else {
            return Err(RdzvError::UnknownJob { run_id: run_id.to_owned() });
        };
        match self.hold(run_id, node_id, ttl, false, true).await? {
            Hold::Absent | Hold::Elsewhere => Err(RdzvError::UnknownNode { node_id: node_id.to_owned() }),
            Hold::Created | Hold::Held => Ok(recorded()),
        }
    }

    /// Confirms the lease `key` is held on when its keep-alive stream has not been answered
    /// lately: that stream rides one HTTP/2 connection per member, and a connection in TCP
    /// back-off (a lossy link) holds every request on it for seconds (until the connection's own
    /// keep-alive replaces it, about 3 s) while a new connection would get through. So a
    /// keep-alive goes on a fresh connection to every member at once, within [`CONFIRM_WITHIN`];
    /// the first answer renews the lease here, dated from before the tries began. Then the key is
    /// looked at again ([`Touch`]: it may have gone meanwhile). One confirmation at a time:
    /// heartbeats that come meanwhile wait for its outcome; after a failed (or abandoned) one the
    /// next waits [`super::leases::confirm_wait`] (0.25 s, doubling to 4 s), the heartbeats meanwhile
    /// answered "unconfirmed" at once.
    async fn confirm_lease(&self, key: &str) -> Touch {
        let mut tried = self.inner.confirming.lock().await;
        let touch = self.touch(key);
        if touch != Touch::Unconfirmed {
            return touch;
        }
        let lease = self.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).lease_of(key);
        let Some((id, ttl_s)) = lease else { return Touch::Read };
        let started = Instant::now();
        if !may_confirm(*tried, started) {
            return Touch::Unconfirmed;
        }
        // Counted as failed until it succeeds: a heartbeat dropped mid-try abandons it.
        *tried = Some(ConfirmTry { at: started, failures: tried.map_or(1, |t| t.failures.saturating_add(1)) });
        let mut tries = tokio::task::JoinSet::new();
        for endpoint in &self.inner.endpoints {
            let (endpoint, options) = (endpoint.clone(), self.inner.options.clone());
            tries.spawn(async move {
                let mut client = etcd_client::Client::connect([endpoint], Some(options)).await?;
                // Answered with a TTL above 0, or the "lease not found" error.
                client.lease_keep_alive(id).await.map(|_| ())
            });
        }
        let lapsed_seen = tokio::time::timeout(CONFIRM_WITHIN, async {
            while let Some(joined) = tries.join_next().await {
                match joined {
                    Ok(Ok(())) => return Ok(()),
                    Ok(Err(error)) if lapsed(&error) => return Err(true),
                    Ok(Err(error)) => debug!(lease = id, %error, "a keep-alive on a fresh connection failed"),
                    Err(_) => {}
                }
            }
            Err(false)
        })
        .await
        .unwrap_or(Err(false));
        // (Dropping the set ends the tries still under way, and their connections.)
        drop(tries);
        match lapsed_seen {
            Ok(()) => {
                let confirmed =
                    self.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).confirmed(ttl_s, id, started);
                if confirmed {
                    *tried = None;
                    debug!(lease = id, "lease confirmed on a fresh connection (its keep-alive stream is stuck)");
                }
                self.touch(key)
            }
            Err(true) => {
                forget_lapsed(&self.inner, id);
                *tried = None;
                Touch::Read
            }
            Err(false) => Touch::Unconfirmed,
        }
    }

    /// Puts `node_id`'s alive key on this process's lease: (`take_over`) when it exists on another
    /// lease (a transaction on its revision), or (`create`) when it does not exist.
    async fn hold(
        &self,
        run_id: &str,
        node_id: &str,
        ttl: Duration,
        create: bool,
        take_over: bool,
    ) -> Result<Hold, RdzvError> {
        let key = alive_key(run_id, node_id);
        for _ in 0..HOLD_ATTEMPTS {
            let lease = self.lease_for(ttl_seconds(ttl)).await?;
            let put = TxnOp::put(key.clone(), node_id.as_bytes().to_vec(), Some(PutOptions::new().with_lease(lease)));
            // Absent: created when asked (else nothing). Present: read, then taken over.
            let absent = Txn::new().when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)]);
            let txn =
                if create { absent.and_then([put.clone()]) } else { absent }.or_else([TxnOp::get(key.clone(), None)]);
            let resp = match self.txn("hold alive key", txn).await {
                Ok(resp) => resp,
                Err(e) if lease_gone(&e) => {
                    self.drop_lease(lease);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let revision = resp.header().map_or(0, |h| h.revision());
            if resp.succeeded() {
                if !create {
                    return Ok(Hold::Absent);
                }
                if self.note_held(&key, lease, ttl, revision) {
                    return Ok(Hold::Created);
                }
                // Changed since (or the lease went): look again.
                continue;
            }
            let existing = resp.op_responses().into_iter().find_map(|op| match op {
                etcd_client::TxnOpResponse::Get(g) => g.kvs().first().map(|kv| (kv.lease(), kv.mod_revision())),
                _ => None,
            });
            let Some((on, mod_revision)) = existing else { return Ok(Hold::Absent) };
            if on == lease {
                if self.note_held(&key, lease, ttl, mod_revision) {
                    return Ok(Hold::Held);
                }
                continue;
            }
            if !take_over {
                return Ok(Hold::Elsewhere);
            }
            let take =
                Txn::new().when([Compare::mod_revision(key.clone(), CompareOp::Equal, mod_revision)]).and_then([put]);
            match self.txn("take over alive key", take).await {
                Ok(resp) if resp.succeeded() => {
                    if self.note_held(&key, lease, ttl, resp.header().map_or(0, |h| h.revision())) {
                        debug!(run_id, node_id, lease, "alive key taken over from another lease");
                        return Ok(Hold::Held);
                    }
                }
                Ok(_) => {}
                Err(e) if lease_gone(&e) => self.drop_lease(lease),
                Err(e) => return Err(e),
            }
        }
        Err(RdzvError::Contention { run_id: run_id.to_owned(), attempts: HOLD_ATTEMPTS })
    }

    /// Deletes the node's alive key (only the key: the lease is this process's, shared).
    pub async fn forget_node(&self, run_id: &str, node_id: &str) -> Result<(), RdzvError> {
        let key = alive_key(run_id, node_id);
        let held = self.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).held.remove(&key);
        let deleted = self
            .run("delete alive key", |mut c| {
                let key = key.clone();
                async move { c.delete(key, None).await }
            })
            .await;
        if let (Err(_), Some(mut held)) = (&deleted, held) {
            // The key may still be on our lease, which stays alive: the sweeper deletes it.
            held.heard = Instant::now().checked_sub(held.ttl * 2).unwrap_or(held.heard);
            self.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).retry_delete(key, held);
        }
        deleted.map(|_| ())
    }

    /// One pass of the sweeper: keys of nodes silent for their TTL deleted (if still as our
    /// write left them), leases without keys for a while revoked.
    async fn sweep_once(&self) {
        let (stale, idle) = self.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).sweep(Instant::now());
        // The notes of when each was last heard share one lease per pass, long enough for any
        // verdict (a node reached by probes is lost within 3 TTLs), so it goes by itself after.
        let lapsed_lease = match stale.iter().map(|(_, h)| ttl_seconds(h.ttl)).max() {
            Some(ttl_s) => {
                let ttl = LAPSED_TTL_S.max(ttl_s.saturating_mul(3).saturating_add(10));
                match self.run("lease grant", |mut c| async move { c.lease_grant(ttl, None).await }).await {
                    Ok(l) => Some(l.id()),
                    Err(error) => {
                        debug!(%error, "no lease for the notes of silent nodes: their losses are dated one TTL back");
                        None
                    }
                }
            }
            None => None,
        };
        // At once: a rack gone silent must not wait on one request after another.
        let mut deletes = tokio::task::JoinSet::new();
        for (key, held) in stale {
            let store = self.clone();
            deletes.spawn(async move {
                // When this process last heard from the node goes with the deletion, on the same
                // lease: whichever replica decides the loss dates the fault with it.
                let heard = liveness::heard_at(crate::clock::now_ms(), held.heard.elapsed());
                let mut ops = vec![TxnOp::delete(key.clone(), None)];
                if let (Some(lapsed), Some(lease)) = (lapsed_key_of(&key), lapsed_lease) {
                    let on_lease = PutOptions::new().with_lease(lease);
                    ops.push(TxnOp::put(lapsed, heard.to_string(), Some(on_lease)));
                }
                let txn = Txn::new()
                    .when([
                        Compare::mod_revision(key.clone(), CompareOp::Equal, held.revision),
                        Compare::lease(key.clone(), CompareOp::Equal, held.lease),
                    ])
                    .and_then(ops);
                match store.txn("delete a silent node's alive key", txn).await {
                    Ok(resp) if resp.succeeded() => debug!(key, "silent node's alive key deleted"),
                    Ok(_) => debug!(key, "silent node's alive key changed since (another replica holds it)"),
                    Err(error) => {
                        // The lease is shared and stays alive: the key would outlive the node. The
                        // next pass tries again (a delete that did commit makes the compare fail).
                        warn!(key, %error, "could not delete a silent node's alive key; trying again");
                        store.inner.leases.lock().unwrap_or_else(|p| p.into_inner()).retry_delete(key, held);
                    }
                }
            });
        }
        while deletes.join_next().await.is_some() {}
        for id in idle {
            if let Err(error) = self.run("lease revoke", |mut c| async move { c.lease_revoke(id).await }).await {
                debug!(lease = id, %error, "idle lease not revoked (it lapses anyway)");
            }
        }
    }
}

/// What [`EtcdStore::hold`] found.
#[derive(Debug, PartialEq, Eq)]
enum Hold {
    Created,
    /// It exists, and is on this process's lease now.
    Held,
    /// It exists on another lease, and was left there.
    Elsewhere,
    Absent,
}

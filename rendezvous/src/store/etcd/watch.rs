//! The watch on the whole prefix, one task per store for as long as it lives: a `state` change
//! wakes long-polls and notes the job's version (and, while some node is suspected, the probes
//! each node owes); an `alive` key deleted (lease expiry, revoke) nudges the ticker so a loss is
//! acted on at once.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, EventType, WatchOptions};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tracing::debug;

use super::layout::PREFIX;
use super::leases::Leases;
use crate::detector::ProbeRequest;
use crate::round::Job;

/// Probes owed, by job and prober.
pub(super) type Owed = HashMap<String, HashMap<String, Vec<ProbeRequest>>>;

/// Records the probes `job` (None: none suspected) asks of each of its nodes.
pub(super) fn note_probing(probing: &std::sync::Mutex<Owed>, run_id: &str, job: Option<&Job>) {
    let owed: HashMap<String, Vec<ProbeRequest>> = job
        .filter(|j| !j.suspects.is_empty())
        .map(|j| {
            let probers: HashSet<&String> = j
                .suspects
                .iter()
                .filter_map(|id| j.health.get(id)?.suspicion.as_ref())
                .flat_map(|s| s.asked.iter())
                .collect();
            probers.into_iter().map(|p| (p.clone(), j.probes_for(p))).filter(|(_, v)| !v.is_empty()).collect()
        })
        .unwrap_or_default();
    let mut probing = probing.lock().unwrap_or_else(|p| p.into_inner());
    if owed.is_empty() {
        probing.remove(run_id);
    } else {
        probing.insert(run_id.to_owned(), owed);
    }
}

/// Watches the whole prefix for as long as the store lives; reconnects after errors.
pub(super) async fn watch_loop(
    clients: Vec<Client>,
    changes: watch::Sender<u64>,
    expired: Arc<Notify>,
    versions: Arc<std::sync::Mutex<HashMap<String, u64>>>,
    probing: Arc<std::sync::Mutex<Owed>>,
    leases: Arc<std::sync::Mutex<Leases>>,
) {
    let mut next_revision: i64 = 0;
    let mut member = 0usize;
    loop {
        // After any failure, the next attempt goes to the next member.
        member = (member + 1) % clients.len();
        let mut client = clients[member].clone();
        let mut opts = WatchOptions::new().with_prefix();
        if next_revision > 0 {
            opts = opts.with_start_revision(next_revision);
        }
        let mut stream = match client.watch(PREFIX, Some(opts)).await {
            Ok(stream) => stream,
            Err(error) => {
                debug!(error = %error, "etcd watch failed to start; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        // Whatever happened while the watch was down, waiters must re-read; keys we hold are
        // read again unless the watch resumed where it stopped.
        leases.lock().unwrap_or_else(|p| p.into_inner()).on_watch_start(next_revision > 0);
        changes.send_modify(|v| *v += 1);
        loop {
            match stream.message().await {
                Ok(Some(resp)) => {
                    if resp.canceled() {
                        // Compacted past our revision: start again from now.
                        next_revision = 0;
                        break;
                    }
                    // An answer without events (created, progress) vouches for everything up
                    // to its header's revision; one with events, for its events only.
                    if resp.events().is_empty() {
                        if let Some(h) = resp.header() {
                            next_revision = next_revision.max(h.revision() + 1);
                        }
                    }
                    let mut any = false;
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        next_revision = next_revision.max(kv.mod_revision() + 1);
                        any = true;
                        let deleted = ev.event_type() == EventType::Delete;
                        if kv.key().windows(7).any(|w| w == b"/alive/") {
                            // A key deleted, or put on another replica's lease, after our put is
                            // no longer ours to answer heartbeats for from memory.
                            let key = String::from_utf8_lossy(kv.key());
                            let mut leases = leases.lock().unwrap_or_else(|p| p.into_inner());
                            leases.on_event(&key, kv.mod_revision(), kv.lease(), deleted, Instant::now());
                            if deleted {
                                expired.notify_one();
                            }
                        }
                        if ev.event_type() == EventType::Put {
                            note_watched_version(&versions, &probing, kv.key(), kv.value());
                        }
                    }
                    if any {
                        changes.send_modify(|v| *v += 1);
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    debug!(error = %error, "etcd watch stream broke; reconnecting");
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Records the version of a job state seen in a watch event.
fn note_watched_version(
    versions: &std::sync::Mutex<HashMap<String, u64>>,
    probing: &std::sync::Mutex<Owed>,
    key: &[u8],
    value: &[u8],
) {
    #[derive(serde::Deserialize)]
    struct VersionOnly {
        version: u64,
        #[serde(default)]
        suspects: Vec<serde::de::IgnoredAny>,
    }
    let key = String::from_utf8_lossy(key);
    let Some(run_id) = key.strip_prefix(PREFIX).and_then(|k| k.strip_suffix("/state")) else { return };
    let Ok(VersionOnly { version, suspects }) = serde_json::from_slice(value) else { return };
    // The whole job is parsed only while some node is suspected; a job written in parts has
    // only its header here, and its probes are noted by the next read (the ticker's, at most a
    // tick away).
    if suspects.is_empty() {
        note_probing(probing, run_id, None);
    } else if let Ok(job) = serde_json::from_slice::<Job>(value) {
        note_probing(probing, run_id, Some(&job));
    }
    let mut versions = versions.lock().unwrap_or_else(|p| p.into_inner());
    let v = versions.entry(run_id.to_owned()).or_insert(version);
    *v = (*v).max(version);
}

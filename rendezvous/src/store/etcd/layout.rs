//! Where a job lives under [`PREFIX`]: its `state` key (the job as JSON, or a header naming the
//! generation of the parts a large state was written in), its `part/` and `alive/` keys; and
//! what of a job is stored ([`stored`]: no heartbeat times).

use crate::error::RdzvError;
use crate::round::Job;

pub(super) const PREFIX: &str = "/rlaunch/jobs/";

/// Largest value written in one request: etcd refuses requests over 1.5 MiB by default, so a
/// larger job state is written as parts of this size first, each its own request, under a new
/// generation; then the transaction that commits the update puts a small header naming that
/// generation in `state` (and deletes the previous generation's parts). Readers see either the
/// old header with the old parts or the new header with the new parts.
pub(super) const PART_BYTES: usize = 512 * 1024;
/// Most parts of one state: 50 MiB of state, a job of about 200,000 nodes.
pub(super) const MAX_PARTS: usize = 100;

/// The `state` value of a job written in parts: what the watch needs (version, suspects), the
/// generation and how many parts it has under `part/{gen}/`.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct PartsHeader {
    version: u64,
    /// The first suspected node, if any: the watch only asks whether any is (a list of
    /// thousands would make the header as large as what it stands for).
    #[serde(default)]
    suspects: Vec<String>,
    parts: usize,
    generation: String,
}

/// Past this size a `state` value is a whole job, never a header.
const HEADER_BYTES: usize = 64 * 1024;

impl PartsHeader {
    pub(super) fn of(job: &Job, parts: usize, generation: String) -> Self {
        PartsHeader {
            version: job.version,
            suspects: job.suspects.iter().take(1).cloned().collect(),
            parts,
            generation,
        }
    }
}

pub(super) fn part_prefix(run_id: &str, generation: &str) -> String {
    format!("{PREFIX}{run_id}/part/{generation}/")
}

/// Where every generation's parts of job `run_id` are.
pub(super) fn parts_prefix(run_id: &str) -> String {
    format!("{PREFIX}{run_id}/part/")
}

pub(super) fn part_key(run_id: &str, generation: &str, i: usize) -> String {
    format!("{PREFIX}{run_id}/part/{generation}/{i:04}")
}

/// A job's state from its `state` value and the part keys read with it: the value itself, or
/// the parts of the generation its header names (and that generation).
pub(super) fn assemble(
    run_id: &str,
    state: &etcd_client::KeyValue,
    parts: &[&etcd_client::KeyValue],
) -> Result<(Job, Option<String>), RdzvError> {
    let corrupt = |source| RdzvError::Corrupt { run_id: run_id.to_owned(), source };
    // A header is small; a whole state (not one) is not mistaken for it, as it has no `parts`.
    let header =
        (state.value().len() < HEADER_BYTES).then(|| serde_json::from_slice::<PartsHeader>(state.value()).ok());
    let header = match header {
        Some(Some(header)) => header,
        _ => match serde_json::from_slice(state.value()) {
            Ok(job) => return Ok((job, None)),
            // A large header (written by an older version, with every suspect in it).
            Err(e) => serde_json::from_slice::<PartsHeader>(state.value()).map_err(|_| corrupt(e))?,
        },
    };
    let prefix = part_prefix(run_id, &header.generation);
    let mine: Vec<&&etcd_client::KeyValue> =
        parts.iter().filter(|kv| kv.key().starts_with(prefix.as_bytes())).collect();
    if mine.len() != header.parts {
        return Err(RdzvError::Store {
            message: format!("job `{run_id}`: {} of its {} state parts found", mine.len(), header.parts),
        });
    }
    let mut bytes = Vec::with_capacity(header.parts * PART_BYTES);
    for kv in mine {
        bytes.extend_from_slice(kv.value());
    }
    serde_json::from_slice(&bytes).map(|job| (job, Some(header.generation))).map_err(corrupt)
}

/// The first key after every key that starts with `prefix`.
pub(super) fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

pub(super) fn state_key(run_id: &str) -> String {
    format!("{PREFIX}{run_id}/state")
}

pub(super) fn alive_prefix(run_id: &str) -> String {
    format!("{PREFIX}{run_id}/alive/")
}

pub(super) fn alive_key(run_id: &str, node_id: &str) -> String {
    format!("{PREFIX}{run_id}/alive/{node_id}")
}

pub(super) fn lapsed_prefix(run_id: &str) -> String {
    format!("{PREFIX}{run_id}/lapsed/")
}

/// Where the replica that deleted a silent node's `alive` key notes when it last heard from the
/// node (Unix ms), on a short lease of its own: the loss is dated with it
/// ([`Job::lapsed_heard`]).
pub(super) fn lapsed_key_of(alive_key: &str) -> Option<String> {
    let (job, node) = alive_key.rsplit_once("/alive/")?;
    Some(format!("{job}/lapsed/{node}"))
}

/// The job as stored: heartbeat times are derived from leases, never persisted.
pub(super) fn stored(job: &Job) -> Job {
    let mut j = job.clone();
    j.last_seen.clear();
    j.lapsed_heard.clear();
    j.vouched.clear();
    for h in j.health.values_mut() {
        h.arrivals.clear();
    }
    // Only what the detector must remember across processes: suspicions, probe counts and the
    // watchers' fresh reports.
    j.health.retain(|_, h| h.suspicion.is_some() || h.probes_reached + h.probes_missed > 0 || !h.peers.is_empty());
    j
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::round::JobSettings;

    #[test]
    fn a_parts_header_stays_small_however_many_nodes_are_suspected() {
        let settings = JobSettings {
            min_nodes: 1,
            max_nodes: 20_000,
            join_timeout: Duration::from_secs(60),
            last_call_timeout: Duration::from_secs(1),
            heartbeat_interval: Duration::from_secs(5),
            node_ttl: Duration::from_secs(30),
            probe_timeout: Duration::from_secs(10),
            peer_interval: Duration::from_millis(100),
            stall_bound: Duration::from_millis(500),
            max_restarts: 0,
            stop_grace: Duration::ZERO,
            hang_timeout: None,
            fingerprint: None,
        };
        let mut job = Job::new(settings, 0);
        job.suspects = (0..10_000).map(|i| format!("node-{i:05}-of-a-large-job")).collect();
        let header = serde_json::to_vec(&PartsHeader::of(&job, 3, "0123456789abcdef".to_owned())).unwrap();
        assert!(header.len() < HEADER_BYTES / 16, "{} bytes", header.len());
        let read: PartsHeader = serde_json::from_slice(&header).unwrap();
        assert_eq!(read.suspects, ["node-00000-of-a-large-job"], "the watch still sees that some are suspected");
    }
}

//! A job's settings: [`JobSettings`] (fixed by the job's first join, validated so that its
//! timeouts nest), the machine's clock unit and the bounds on a job.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Milliseconds: the machine's clock unit (wall-clock millis since the Unix epoch at the edges).
pub type Millis = u64;

/// Most nodes a job may have: with [`MAX_LOCAL_WORLD_SIZE`], every rank (and the world size)
/// fits a `u32` with room to spare.
pub const MAX_NODES: u32 = 1 << 20;
/// Most workers one node may run.
pub const MAX_LOCAL_WORLD_SIZE: u32 = 4096;
/// Longest any timeout of a job may be: a forming job that never expires holds the service's
/// memory for good.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// How many node TTLs a node waiting beside a running round below MAX must keep heartbeating
/// before the round is torn down for it (a scale-up): see
/// [`Job::scale_up_candidate`](crate::round::Job::scale_up_candidate).
pub const SCALE_UP_TTLS: u32 = 2;
/// Shortest heartbeat interval: faster ones only load the service.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(10);

/// How a job's rendezvous behaves; fixed when the job is created by its first join.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSettings {
    /// Fewest nodes a round may close with (`--nnodes MIN:MAX`).
    pub min_nodes: u32,
    /// Most nodes a round may close with.
    pub max_nodes: u32,
    /// How long a forming round waits for MIN nodes before the job fails.
    #[serde(rename = "join_timeout_ms", with = "duration_ms")]
    pub join_timeout: Duration,
    /// How long a round with at least MIN nodes waits for more. Skipped when every surviving
    /// member of the previous round is back, or at MAX nodes once none of them is still
    /// expected (returning members keep their places over standbys).
    #[serde(rename = "last_call_timeout_ms", with = "duration_ms")]
    pub last_call_timeout: Duration,
    /// How often agents send heartbeats.
    #[serde(rename = "heartbeat_interval_ms", with = "duration_ms")]
    pub heartbeat_interval: Duration,
    /// A node not heard from for this long is suspected at the latest (sooner when its heartbeats
    /// are late by much more than their usual jitter) and probed by other members; on etcd, the
    /// lease TTL, rounded up to whole seconds. See [`crate::detector`].
    #[serde(rename = "node_ttl_ms", with = "duration_ms")]
    pub node_ttl: Duration,
    /// How long the probes of a suspected node may take: a node no member reached within it is
    /// lost. Detection of a dead node therefore takes at most TTL + this.
    #[serde(rename = "probe_timeout_ms", with = "duration_ms", default = "default_probe_timeout")]
    pub probe_timeout: Duration,
    /// How often each agent pings the few members it watches during a round (UDP, at their
    /// probe endpoints), so that a silent node is noticed within about a second and an agent
    /// that died on a live host within a ping (see [`crate::detector`]'s peer watching).
    /// Zero: no peer watching (the heartbeats and probes alone, about 2.3 s).
    #[serde(rename = "peer_interval_ms", with = "duration_ms", default = "default_peer_interval")]
    pub peer_interval: Duration,
    /// A node silent for less than this, to its watchers and to the rendezvous alike, is never
    /// lost through peer watching: the longest pause (a stopped agent, a saturated CPU, a long
    /// GC) a node may take without being replaced. Its watchers report it silent only after
    /// this plus a ping interval, and later under loss.
    #[serde(rename = "stall_bound_ms", with = "duration_ms", default = "default_stall_bound")]
    pub stall_bound: Duration,
    /// Global restart budget: how many reported failures the job survives.
    pub max_restarts: u32,
    /// How long an agent may take to stop its workers (`--shutdown-timeout`). A forming round
    /// waits up to this long past its last call for surviving members of the previous round
    /// that are alive but still stopping their workers, so a slow stop does not leave a node
    /// out (and its old workers running beside the new round). Zero: no such wait.
    #[serde(rename = "stop_grace_ms", with = "duration_ms", default)]
    pub stop_grace: Duration,
    /// `--hang-timeout` for the whole job: the first that a node gives ([`JobSettings::adopt`]);
    /// every node takes it from its round, a node that gives another is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_timeout: Option<rlaunch::contract::HangTimeout>,
    /// `--fingerprint`: how nodes that differ are treated (log them, or refuse them); adopted
    /// like the hang timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<rlaunch::fingerprint::Policy>,
}

fn default_probe_timeout() -> Duration {
    Duration::from_secs(1)
}

/// Peer watching on: a ping every 0.1 s to each watched member.
fn default_peer_interval() -> Duration {
    Duration::from_millis(100)
}

fn default_stall_bound() -> Duration {
    Duration::from_millis(500)
}

impl Default for JobSettings {
    /// A dead node is lost within 3 s of its last heartbeat (suspected after about 1.3 s on a
    /// clean link, at the latest at the 2 s TTL, then 1 s of probes): heartbeat 0.5 s, TTL 2 s,
    /// probe timeout 1 s.
    fn default() -> Self {
        Self {
            min_nodes: 1,
            max_nodes: 1,
            join_timeout: Duration::from_secs(600),
            last_call_timeout: Duration::from_secs(1),
            heartbeat_interval: Duration::from_millis(500),
            node_ttl: Duration::from_secs(2),
            probe_timeout: default_probe_timeout(),
            peer_interval: default_peer_interval(),
            stall_bound: default_stall_bound(),
            max_restarts: 0,
            stop_grace: Duration::ZERO,
            hang_timeout: None,
            fingerprint: None,
        }
    }
}

/// Settings that cannot work together, rejected before any job exists.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    #[error("min nodes must be at least 1 (got {min})")]
    MinNodesZero { min: u32 },
    #[error("min nodes ({min}) must not exceed max nodes ({max})")]
    MinAboveMax { min: u32, max: u32 },
    #[error("max nodes ({max}) is over the bound of {bound} nodes per job (rlaunch-rendezvous --max-nodes, at most 1048576)")]
    TooManyNodes { max: u32, bound: u32 },
    #[error("{name} ({value:?}) must be {bound}")]
    OutOfRange { name: &'static str, value: Duration, bound: &'static str },
    #[error("{name} must be greater than zero")]
    Zero { name: &'static str },
    #[error("timeouts must nest: {smaller} ({smaller_value:?}) must be less than {larger} ({larger_value:?})")]
    NotNested { smaller: &'static str, smaller_value: Duration, larger: &'static str, larger_value: Duration },
}

/// Checks that each timeout in `chain` is strictly less than the next one. The launcher passes
/// its whole chain (heartbeat interval < node TTL < collective timeout < stop grace < join
/// timeout); [`JobSettings::validate`] checks the part the rendezvous knows about.
pub fn check_nesting(chain: &[(&'static str, Duration)]) -> Result<(), SettingsError> {
    for pair in chain.windows(2) {
        let ((smaller, smaller_value), (larger, larger_value)) = (pair[0], pair[1]);
        if smaller_value >= larger_value {
            return Err(SettingsError::NotNested { smaller, smaller_value, larger, larger_value });
        }
    }
    Ok(())
}

impl JobSettings {
    /// Rejects settings that cannot work: MIN of 0, MIN > MAX, zero intervals, and timeouts that
    /// do not nest (heartbeat interval < node TTL < join timeout, last call < join timeout).
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.min_nodes == 0 {
            return Err(SettingsError::MinNodesZero { min: self.min_nodes });
        }
        if self.min_nodes > self.max_nodes {
            return Err(SettingsError::MinAboveMax { min: self.min_nodes, max: self.max_nodes });
        }
        if self.max_nodes > MAX_NODES {
            return Err(SettingsError::TooManyNodes { max: self.max_nodes, bound: MAX_NODES });
        }
        if self.heartbeat_interval.is_zero() {
            return Err(SettingsError::Zero { name: "heartbeat_interval" });
        }
        if self.heartbeat_interval < MIN_HEARTBEAT {
            return Err(SettingsError::OutOfRange {
                name: "heartbeat_interval",
                value: self.heartbeat_interval,
                bound: "at least 10 ms",
            });
        }
        for (name, value) in [
            ("join_timeout", self.join_timeout),
            ("last_call_timeout", self.last_call_timeout),
            ("node_ttl", self.node_ttl),
            ("probe_timeout", self.probe_timeout),
            ("shutdown timeout", self.stop_grace),
        ] {
            if value > MAX_TIMEOUT {
                return Err(SettingsError::OutOfRange { name, value, bound: "at most 7 days" });
            }
        }
        if self.probe_timeout.is_zero() {
            return Err(SettingsError::Zero { name: "probe_timeout" });
        }
        check_nesting(&[
            ("heartbeat_interval", self.heartbeat_interval),
            ("node_ttl", self.node_ttl),
            ("join_timeout", self.join_timeout),
        ])?;
        // Probers learn of a suspicion from the answer to their next heartbeat, up to an
        // interval later, and need time to probe and report before the verdict.
        check_nesting(&[
            ("2 x heartbeat_interval", self.heartbeat_interval.saturating_mul(2)),
            ("probe_timeout", self.probe_timeout + Duration::from_millis(1)),
            ("join_timeout", self.join_timeout),
        ])?;
        if !self.stop_grace.is_zero() {
            // A node stopping its workers keeps heartbeating, but the rendezvous must not wait
            // on a stop for longer than a join may take.
            check_nesting(&[
                ("node_ttl", self.node_ttl),
                ("--shutdown-timeout", self.stop_grace),
                ("join_timeout", self.join_timeout),
            ])?;
        }
        if !self.peer_interval.is_zero() {
            // Pings of at least 10 ms; a stall bound of at least two pings (one late echo is not
            // a silence) and below the TTL (the heartbeats' own verdict comes after it).
            if self.peer_interval < MIN_HEARTBEAT {
                return Err(SettingsError::OutOfRange {
                    name: "peer_interval",
                    value: self.peer_interval,
                    bound: "0 (off) or at least 10 ms",
                });
            }
            check_nesting(&[
                ("2 x peer_interval", self.peer_interval.saturating_mul(2)),
                ("stall_bound", self.stall_bound + Duration::from_millis(1)),
                ("node_ttl", self.node_ttl + Duration::from_millis(1)),
            ])?;
        }
        check_nesting(&[("last_call_timeout", self.last_call_timeout), ("join_timeout", self.join_timeout)])
    }

    /// Whether a node with `other` belongs to a job created with `self`: the same settings,
    /// except the shutdown timeout, which each node may choose (the job waits by the first
    /// node's), and a hang timeout or fingerprint policy given by one side only.
    pub fn same_job(&self, other: &JobSettings) -> bool {
        let common = |s: &JobSettings| JobSettings {
            stop_grace: Duration::ZERO,
            hang_timeout: None,
            fingerprint: None,
            ..s.clone()
        };
        fn agree<T: PartialEq>(a: Option<T>, b: Option<T>) -> bool {
            a.zip(b).is_none_or(|(a, b)| a == b)
        }
        common(self) == common(other)
            && agree(self.hang_timeout, other.hang_timeout)
            && agree(self.fingerprint, other.fingerprint)
    }

    /// The job's settings once a node with `other` has joined: the first hang timeout a node
    /// gives becomes the job's (nodes started without the flag take it from their round).
    pub fn adopt(&mut self, other: &JobSettings) {
        if self.hang_timeout.is_none() {
            self.hang_timeout = other.hang_timeout;
        }
        if self.fingerprint.is_none() {
            self.fingerprint = other.fingerprint;
        }
    }

    pub(super) fn ms(d: Duration) -> Millis {
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
    }
}

/// `Duration` as whole milliseconds in JSON.
mod duration_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

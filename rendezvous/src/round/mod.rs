//! The rendezvous round state machine: a pure function `apply(job, event, now) -> (job, decision)`.
//!
//! No I/O, no async, no clock reads: the caller passes `now` in milliseconds (wall-clock millis
//! since the Unix epoch at the edges, so that several server replicas on one etcd agree; made-up
//! numbers in tests). Every store (memory, etcd) and every edge (HTTP, in-process) runs this one
//! machine, so the behaviour is defined here and only here.
//!
//! Life of a job: nodes join a *forming* round (`Waiting` below MIN, `LastCall` once MIN are in)
//! → the round closes (`Running`) with contiguous, deterministic group ranks → a member's
//! heartbeat lapses, a failure is reported, a member leaves, or a node waits to join below MAX
//! → the round number goes up and a new round forms with the survivors → … until every member
//! of a round reports success (`Finished`), the restart budget is spent or too few nodes come
//! back within the join timeout (`Failed`).
//!
//! Round numbers go up when a round is *opened* (torn down for a new one), so a watcher of round
//! N learns "stop your workers and rejoin" as soon as N+1 exists, not when N+1 closes.
//!
//! # Files
//!
//! - `settings`: [`JobSettings`] and their validation, [`Millis`], the bounds on a job.
//! - `recovery`: what each recovery cost and the job's goodput, [`Accounting`].
//! - `job`: the state, [`Job`] (plain data, persisted as JSON), and what is read from it: members,
//!   ranks, the failure detector's bookkeeping.
//! - `event`: the machine's input and output: [`Event`], [`Decision`] ([`Action`], [`Rejection`]).
//! - `node`: the checks on a node's details (id, workers, advertised addresses, fingerprint).
//! - `liveness`: liveness where the store keeps no heartbeat times (etcd): what a read of the
//!   nodes' liveness records makes of a job (`observe`), which suspicions a sign of life refutes,
//!   how a silent node is dated, when a record is stale; and the date of a loss on every store
//!   (`last_heard`).
//! - `machine`: the transitions, [`apply`] and [`apply_in_place`].
//! - `guard`: who may speak for which node: [`Guard`], [`authorize`], [`apply_guarded`],
//!   [`apply_joining`].
//! - `status`: the operators' views, [`JobStatus`] and [`NodeStatus`].
//!
//! Each imports only from those listed before it, never back; `settings` imports nothing of the
//! crate (the detector and the stragglers take [`Millis`] from it).

mod event;
mod guard;
mod job;
pub(crate) mod liveness;
mod machine;
mod node;
pub mod recovery;
pub(crate) mod settings;
mod status;

pub use event::{Action, Decision, Event, Rejection, RoundCause};
pub use guard::{apply_guarded, apply_joining, authorize, secret_after_join, Guard};
pub use job::{Earlier, FailureKind, Job, MemberIndex, NodeIds, Pending, PendingList, Phase};
pub use machine::{apply, apply_in_place, credible_snapshots};
pub use node::{
    advertised, canonical_ip, check_advertised, fingerprint_digest, fingerprint_summary, pin_advertised_names,
    validate_node, FINGERPRINT_MORE, MAX_FINGERPRINTS, MAX_FINGERPRINT_BYTES,
};
pub use recovery::{Accounting, Mark, MarkKind, Phases, Recovery};
pub use rlaunch::contract::{HostPort, Member, NodeInfo, RootCause, RoundInfo};
pub use settings::{
    check_nesting, JobSettings, Millis, SettingsError, MAX_LOCAL_WORLD_SIZE, MAX_NODES, MAX_TIMEOUT, MIN_HEARTBEAT,
    SCALE_UP_TTLS,
};
pub use status::{JobStatus, NodeHealth, NodeStatus, RecoveryStatus, RecoveryView};

#[cfg(test)]
mod tests;

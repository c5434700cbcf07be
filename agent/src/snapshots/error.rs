//! Why the snapshot store refused something: one typed error for every refusal the core
//! decides and the few failures the I/O around it meets. A worker sees its `Display` text;
//! [`SnapError::not_snapshotted`] says which refusals leave training going (the client returns
//! `False` and says it once) instead of failing the program.

use std::fmt;
use std::ops::Range;

use super::NodeId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapError {
    /// A step is saved once: that part is held already.
    AlreadyHeld { rank: u32, step: u64 },
    /// A rank (or the node whose copies these are) far ahead of its commits.
    TooManyOpen { rank: u32, open: usize, most: usize },
    /// The part does not fit under `--snapshot-memory`.
    NoRoom { rank: u32, step: u64, len: u64, cap: u64, kept: u64 },
    /// This round's nodes cannot agree on a step: snapshots are off in it.
    CannotAgree { most_nodes: usize },
    /// Another request is writing that part now.
    BeingSaved { rank: u32, step: u64 },
    /// No round began on this node within the wait the core allows.
    NoRound,
    /// A save of a rank this node does not run, or of another world.
    NotThisNodesRank { rank: u32, world: u32, ranks: Range<u32>, round_world: u32 },
    /// A commit of a part this writer never reserved in this round.
    NotReserved { rank: u32, step: u64 },
    /// The round ended while the part was written, copied or fetched.
    RoundEnded,
    /// A load that names no rank, in a round that restores a step.
    NoRankNamed,
    /// The plan's part is not on this node, and this node has no peers to fetch it from.
    NotHere { rank: u32, step: u64 },
    /// The member that holds the plan's part cannot hold snapshots (no address or key).
    Unreachable { node: NodeId, rank: u32, step: u64 },
    /// A fetched part of a world other than the plan's.
    OtherWorld { node: NodeId, world: u32, want: u32 },
    /// A member's request about a round this node does not run.
    OtherRound { tag: u64 },
    /// A copy from a member whose buddy this node is not.
    NotBuddy { node: NodeId },
    /// A copy of a rank the sending member does not run.
    NotTheirRank { rank: u32, node: NodeId },
    /// A copy for a world other than the round's.
    WorldMismatch { world: u32, round: u64, round_world: u32 },
    /// A part asked for that is not held here, whole.
    NotHeld { rank: u32, step: u64, tag: u64 },
    /// A buffer could not be made or sized (the I/O's own failure).
    Buffer(String),
    /// A part could not be lent (sealed, or copied sealed) to the worker.
    Lend(String),
    /// The store answered a request with an action of another request (a defect).
    OutOfTurn,
    /// Fetching the plan's part from the member that holds it failed.
    Fetch { rank: u32, step: u64, node: NodeId, addr: String, error: String },
    /// Bytes that are no request of the snapshot wire.
    NotARequest(String),
}

/// How a refusal that leaves training going starts.
pub const NOT_SNAPSHOTTED: &str = "not snapshotted: ";

fn mib(b: u64) -> u64 {
    b.div_ceil(1 << 20)
}

impl SnapError {
    /// A refusal that leaves training going: the step is not snapshotted, the last committed
    /// one stays (the client's `False`).
    pub fn not_snapshotted(&self) -> bool {
        matches!(
            self,
            SnapError::AlreadyHeld { .. }
                | SnapError::TooManyOpen { .. }
                | SnapError::NoRoom { .. }
                | SnapError::CannotAgree { .. }
        )
    }
}

impl fmt::Display for SnapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.not_snapshotted() {
            f.write_str(NOT_SNAPSHOTTED)?;
        }
        match self {
            SnapError::AlreadyHeld { rank, step } => {
                write!(f, "rank {rank}'s part of step {step} is already held (a step is saved once)")
            }
            SnapError::TooManyOpen { rank, open, most } => write!(
                f,
                "rank {rank} already has {open} steps saved and not yet committed (at most {most}: their \
                 copies are not acknowledged); the last committed step stays"
            ),
            SnapError::NoRoom { rank, step, len, cap, kept } => write!(
                f,
                "rank {rank}'s part of step {step} ({} MiB) does not fit in this node's snapshot memory \
                 (--snapshot-memory {} MiB, {} MiB of it holding the last committed step and the steps in \
                 progress); the last committed step stays",
                mib(*len),
                mib(*cap),
                mib(*kept)
            ),
            SnapError::CannotAgree { most_nodes } => write!(
                f,
                "this round's nodes cannot agree on a step (a static job of several nodes, a round of \
                 more than {most_nodes} nodes, or a rendezvous that answers no member list): snapshots are off"
            ),
            SnapError::BeingSaved { rank, step } => {
                write!(f, "rank {rank}'s part of step {step} is being saved by another request")
            }
            SnapError::NoRound => {
                f.write_str("no round is running on this node (the workers are being stopped or started)")
            }
            SnapError::NotThisNodesRank { rank, world, ranks, round_world } => write!(
                f,
                "rank {rank} of a world of {world}: this node runs ranks {}..{} of {round_world} in this round",
                ranks.start, ranks.end
            ),
            SnapError::NotReserved { rank, step } => {
                write!(f, "rank {rank}'s part of step {step} was never reserved in this round")
            }
            SnapError::RoundEnded => f.write_str("the round ended while the part was written, copied or fetched"),
            SnapError::NoRankNamed => f.write_str("a load names the rank whose part it wants"),
            SnapError::NotHere { rank, step } => write!(f, "rank {rank}'s part of step {step} is not here"),
            SnapError::Unreachable { node, rank, step } => {
                write!(f, "node {node}, which holds rank {rank}'s part of step {step}, cannot be reached")
            }
            SnapError::OtherWorld { node, world, want } => {
                write!(f, "node {node} holds that part for a world of {world}, not {want}")
            }
            SnapError::OtherRound { tag } => write!(f, "round {tag} is not the one this node runs"),
            SnapError::NotBuddy { node } => write!(f, "this node is not node {node}'s buddy"),
            SnapError::NotTheirRank { rank, node } => write!(f, "rank {rank} is not node {node}'s"),
            SnapError::WorldMismatch { world, round, round_world } => {
                write!(f, "a world of {world}: round {round} has {round_world} ranks")
            }
            SnapError::NotHeld { rank, step, tag } => {
                write!(f, "rank {rank}'s part of step {step} (round {tag}) is not held here")
            }
            SnapError::Buffer(e) => write!(f, "cannot make a buffer for the snapshot: {e}"),
            SnapError::Lend(e) => write!(f, "cannot lend the snapshot part to the worker: {e}"),
            SnapError::OutOfTurn => f.write_str("the snapshot store answered out of turn (a defect of rlaunch)"),
            SnapError::Fetch { rank, step, node, addr, error } => {
                write!(f, "fetching rank {rank}'s part of step {step} from node {node} ({addr}): {error}")
            }
            SnapError::NotARequest(e) => write!(f, "not a snapshot request: {e}"),
        }
    }
}

impl std::error::Error for SnapError {}

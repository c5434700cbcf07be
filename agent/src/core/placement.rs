//! Where this node's workers run in a round or attempt.

use rlaunch::contract::{HangTimeout, HostPort, RoundInfo};

/// Where this node's workers run in the current round or attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The rendezvous round (fixed membership: the attempt, counted from 1).
    pub round: u64,
    pub group_rank: u32,
    pub group_world_size: u32,
    /// Global rank of this node's local rank 0 (prefix sum of earlier nodes' workers).
    pub rank_offset: u32,
    pub world_size: u32,
    /// The workers' store (`MASTER_ADDR:MASTER_PORT`); `None`: this agent serves it, on a
    /// fresh address the driver picks for the attempt.
    pub master: Option<HostPort>,
    pub restart_count: u32,
    /// The job's `--hang-timeout` (elastic: the rendezvous' for the whole job; fixed: this
    /// agent's own).
    pub hang_timeout: Option<HangTimeout>,
    /// How the round's nodes differ in their fingerprints (elastic; empty when they do not).
    pub fingerprint_diff: Vec<String>,
    /// The round's members (elastic, when the join asked for them: snapshots).
    pub members: Vec<rlaunch::contract::Member>,
    /// The members this node watches while the round runs (elastic).
    pub watch: Option<rlaunch::contract::PeerWatch>,
}

impl Placement {
    /// A fixed membership's placement (standalone, static): node `group_rank` of `nnodes`, each
    /// with `nproc` workers, the store at `master` (`None`: this agent serves it).
    pub fn fixed(
        group_rank: u32,
        nnodes: u32,
        nproc: u32,
        master: Option<HostPort>,
        hang_timeout: Option<HangTimeout>,
    ) -> Placement {
        Placement {
            round: 1,
            group_rank,
            group_world_size: nnodes,
            rank_offset: group_rank.saturating_mul(nproc),
            world_size: nnodes.saturating_mul(nproc),
            master,
            restart_count: 0,
            hang_timeout,
            fingerprint_diff: Vec::new(),
            members: Vec::new(),
            watch: None,
        }
    }

    /// The placement a closed round gives this node.
    pub fn from_round(r: &RoundInfo) -> Placement {
        Placement {
            round: r.round,
            group_rank: r.group_rank,
            group_world_size: r.group_world_size,
            rank_offset: r.rank_offset,
            world_size: r.world_size,
            master: Some(r.master_store_addr.clone()),
            restart_count: r.restart_count,
            hang_timeout: r.hang_timeout,
            fingerprint_diff: r.fingerprint_diff.clone(),
            members: r.members.clone(),
            watch: r.watch.clone(),
        }
    }
}

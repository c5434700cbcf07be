//! rlaunch's rendezvous: the pure round state machine, its stores (memory, etcd v3), the HTTP
//! service (`rlaunch-rendezvous`) and the client agents use.
//!
//! # Code map
//!
//! - [`round`]: `apply(&Job, Event, now_ms) -> (Job, Decision)`, pure. Settings
//!   ([`JobSettings`], validated so timeouts nest), rounds, ranks, the global restart budget.
//! - [`store`]: [`Store::Memory`] (this process) or [`Store::Etcd`] (state key updated by
//!   transactions on its mod revision, one lease per node, a watch on the prefix).
//! - [`detector`]: the failure detector (phi-accrual suspicion, indirect probes), pure.
//! - [`service`]: [`Rendezvous`], the operations over a store: long-polls, the ticker that drives
//!   timers, metrics. Shared by the HTTP API and the in-process / etcd-direct client.
//! - [`api`]: axum routes (`router(state)`, `serve(listener, state, shutdown)`).
//! - [`conn`]: the connection layer under `serve`: which connection to close at the bound, the
//!   deadline on a request body.
//! - [`page`]: the status page `/` (embedded HTML, script, style) over the `/v1` API.
//! - [`client`]: [`RendezvousClient`] over a [`Backend`].
//! - [`clock`]: the shared wall clock (`now_ms`), read by the service and the etcd store alike.
//! - [`tls`]: the service's certificate and key, a client's CA bundle, cleartext endpoints.
//! - [`endpoint`]: a service's or etcd's endpoint, parsed once (scheme, host, port).
//!
//! # The client API (what the agent uses)
//!
//! ```text
//! pub enum Backend {
//!     Http { endpoints: Vec<String>, token: Option<String> }, // fails over between endpoints
//!     Etcd { endpoints: Vec<String> },                        // this process runs the machine on etcd
//!     InProcess(Arc<Rendezvous>),                             // --standalone, agent-hosted server
//! }
//! impl RendezvousClient {
//!     pub async fn connect(backend: Backend, run_id: &str, settings: JobSettings) -> Result<Self, RdzvError>;
//!     // resolves when a round including this node closes; heartbeats for the node meanwhile;
//!     // Err(JobFailed | JoinTimeout | JobFinished) when the job is over
//!     pub async fn join(&self, node: NodeInfo /* node_id, local_world_size, store_addr */) -> Result<RoundInfo, RdzvError>;
//!     // every heartbeat interval, several in flight; answers the probes this node owes;
//!     // Err(UnknownNode): declared lost, rejoin
//!     pub async fn heartbeat(&self, node_id: &str, beat: Beat /* sent: {seq, slow}, probes */) -> Result<HeartbeatAnswer, RdzvError>;
//!     pub async fn watch(&self, after_round: u64) -> Result<WatchEvent, RdzvError>; // NewRound(n) | Finished | Failed(reason) | NoChange (≤ 5 s)
//!     pub async fn report_failure(&self, node_id: &str, round: u64, root_cause: serde_json::Value) -> Result<(), RdzvError>;
//!     pub async fn report_success(&self, node_id: &str, round: u64) -> Result<(), RdzvError>;
//!     pub async fn leave(&self, node_id: &str) -> Result<(), RdzvError>;
//!     pub async fn status(&self) -> Result<JobStatus, RdzvError>;
//! }
//! pub struct RoundInfo { round, group_rank, group_world_size, members: Vec<Member>, master_store_addr,
//!                        restart_count, max_restarts, world_size, rank_offset, local_world_size }
//! ```
//!
//! The agent's loop: `join` → start workers with `RoundInfo` → in parallel `heartbeat` every
//! interval and `watch(round)`; on `NewRound` stop workers and `join` again; on a worker failure
//! `report_failure(round, root_cause)` then `join`; when all local workers succeed
//! `report_success(round)` and keep watching until `Finished` (a `NewRound` after success means
//! the others restarted: rejoin, workers resume from their checkpoint).
//!
//! # Rounds
//!
//! Round numbers go up when a round is torn down (node loss, failure, scale-up, a member leaving),
//! so watchers of round N learn to stop as soon as N+1 exists; `join` returns round N+1 once it
//! closes. Group ranks: surviving members of the previous round first, in their old order, then
//! new nodes by join time; `rank_offset` is the prefix sum of local world sizes. The restart
//! budget counts reported failures only, once per round, for the whole job.
//!
//! # Default timings ([`JobSettings::default`])
//!
//! heartbeat every 0.5 s, node TTL 2 s, probe timeout 1 s (see [`detector`]: a node is suspected
//! when its heartbeats are late by much more than their jitter, at the latest after the TTL, and
//! lost when no other member reaches it within the probe timeout: ≤ 3 s after its last heartbeat;
//! etcd: a lease of 2 s, kept alive every TTL/3 by etcd-direct agents, by each heartbeat through a
//! server, whose lapse starts the suspicion), last call 1 s, join timeout 600 s,
//! restart budget 0 (torchrun's `--max-restarts` default). Long-polls answer within 5 s (client)
//! or 10 s (server default, 60 s cap). Timeouts must nest: heartbeat < TTL < join timeout and
//! last call < join timeout ([`check_nesting`] takes the launcher's longer chain).
//!
//! # HTTP
//!
//! Routes and error codes are listed in [`api`]; `rlaunch-rendezvous --listen 0.0.0.0:29400
//! --store memory|etcd --etcd-endpoints URL,URL --token T` (env `RLAUNCH_RDZV_LISTEN`,
//! `RLAUNCH_RDZV_STORE`, `RLAUNCH_RDZV_ETCD_ENDPOINTS`, `RLAUNCH_RDZV_TOKEN`,
//! `RLAUNCH_RDZV_BODY_LIMIT`, `RLAUNCH_RDZV_SHUTDOWN_GRACE_MS`).
//!
//! # Invariants
//!
//! - `round` has no I/O, no async and no clock reads; everything else calls it.
//! - On etcd there is no truth in memory: any replica (or agent) can serve any job.
//! - A rejected event never changes stored state.

pub mod api;
pub mod client;
pub mod clock;
pub mod conn;
pub mod detector;
pub mod endpoint;
pub mod error;
pub mod identity;
pub mod page;
pub mod round;
pub mod service;
pub mod store;
pub mod stragglers;
pub mod tls;

pub use client::{Backend, ClientTls, RendezvousClient};
pub use endpoint::Endpoint;
pub use error::RdzvError;
pub use round::{apply, check_nesting, Job, JobSettings, JobStatus, Member, NodeInfo, RoundInfo, SettingsError};
pub use service::{Beat, HeartbeatAnswer, JoinAnswer, Rendezvous, WatchEvent};
pub use store::Store;

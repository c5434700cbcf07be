//! rlaunch's worker-side runtime: the worker environment contract, the TCPStore protocol,
//! process groups and collectives, and data-parallel training helpers.

pub mod checkpoint;
pub mod comm;
pub mod contract;
pub mod cut;
pub mod ddp;
pub mod env;
pub mod fingerprint;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod heartbeat;
pub mod model;
pub mod resilient;
pub mod sampler;
pub mod snapshot;
pub mod stacks;
pub mod store;
pub mod terminal;
pub mod worker;

//! rlaunch's worker-side runtime: the worker environment contract, the TCPStore protocol,
//! process groups and collectives, and data-parallel training helpers.

pub mod env;
pub mod comm;
pub mod worker;
pub mod checkpoint;
pub mod ddp;
pub mod model;
pub mod sampler;
pub mod store;
#[cfg(feature = "cuda")]
pub mod gpu;

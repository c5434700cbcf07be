//! The wall clock every replica and agent shares, read in one place: the service's operations
//! and the etcd store date what they hear with it, and the pure round machine is handed it. A
//! leaf: it imports nothing of the crate (its milliseconds are `round::Millis`, a `u64`).

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock milliseconds since the Unix epoch (0 for a clock before it).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

//! The wall clock every replica and agent shares, read in one place: the service's operations
//! and the etcd store date what they hear with it, and the pure round machine is handed it.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::round::Millis;

/// Wall-clock milliseconds since the Unix epoch (0 for a clock before it).
pub fn now_ms() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as Millis).unwrap_or(0)
}

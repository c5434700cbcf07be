//! rlaunch's rendezvous: the pure round state machine, its stores, the HTTP service and client.
pub mod round;

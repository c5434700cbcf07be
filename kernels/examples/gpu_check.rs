//! GPU checks (filled in below).
fn main() {}

//! Random bits for names that must not collide or be guessed (node ids, directories): read
//! from the kernel, with the pid as the fallback where `/dev/urandom` cannot be read. A module
//! of its own so that whoever needs it imports nothing else of the agent.

pub(crate) fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b)).is_err() {
        return std::process::id() ^ 0x9e37_79b9;
    }
    u32::from_le_bytes(b)
}

/// A tiny deterministic generator for the simulated worlds of the pure cores' tests
/// (`supervisor`, `snapshots`): a run is reproducible from its seed.
#[cfg(test)]
pub(crate) struct XorShift(pub u64);

#[cfg(test)]
impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

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

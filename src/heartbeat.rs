//! The explicit heartbeat hang detection counts as progress (`rlaunch --hang-timeout`): the
//! agent names a file in `RLAUNCH_HEARTBEAT_FILE`, and touching it is a beat. [`crate::ddp::Ddp`]
//! beats once per step; a Python script does the same in one line,
//! `os.utime(os.environ["RLAUNCH_HEARTBEAT_FILE"])`.

use std::fs::File;
use std::time::{Duration, Instant, SystemTime};

/// The variable the agent sets (only with `--hang-timeout`).
pub const HEARTBEAT_ENV: &str = "RLAUNCH_HEARTBEAT_FILE";

/// Beats more often than this are dropped: the agent samples once a second.
const MIN_GAP: Duration = Duration::from_millis(100);

/// A worker's heartbeat; does nothing when the agent named no file.
#[derive(Debug, Default)]
pub struct Heartbeat {
    file: Option<File>,
    last: Option<Instant>,
}

impl Heartbeat {
    pub fn from_env() -> Heartbeat {
        let file = std::env::var_os(HEARTBEAT_ENV).and_then(|p| File::options().write(true).open(p).ok());
        Heartbeat { file, last: None }
    }

    /// One beat (one `futimens`, at most ten a second); errors are ignored (a beat is a hint).
    pub fn beat(&mut self) {
        let Some(f) = &self.file else { return };
        if self.last.is_some_and(|t| t.elapsed() < MIN_GAP) {
            return;
        }
        self.last = Some(Instant::now());
        let _ = f.set_modified(SystemTime::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_moves_the_files_time_and_beats_are_rate_limited() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("heartbeat");
        File::create(&path).unwrap();
        let old = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        File::options().write(true).open(&path).unwrap().set_modified(old).unwrap();
        let mut hb = Heartbeat { file: Some(File::options().write(true).open(&path).unwrap()), last: None };
        hb.beat();
        let first = std::fs::metadata(&path).unwrap().modified().unwrap();
        assert!(first > old);
        File::options().write(true).open(&path).unwrap().set_modified(old).unwrap();
        hb.beat();
        assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), old, "within 100 ms: dropped");
        Heartbeat::default().beat();
    }
}

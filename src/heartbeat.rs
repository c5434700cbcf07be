//! The explicit heartbeat hang detection counts as progress (`rlaunch --hang-timeout`): the
//! agent names a file in `RLAUNCH_HEARTBEAT_FILE`, and touching it is a beat. [`crate::ddp::Ddp`]
//! beats once per step; a Python script does the same in one line,
//! `os.utime(os.environ["RLAUNCH_HEARTBEAT_FILE"])`.
//!
//! `Ddp`'s beat also writes its [`StepStats`] into the file (one fixed-width line at offset 0):
//! how long this rank waited in its buckets' all-reduces per step, over a window of steps. The
//! rank that waits least is the one the others wait for (the straggler); waits need no clock
//! agreement between hosts.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant, SystemTime};

/// The variable the agent sets for every worker.
pub const HEARTBEAT_ENV: &str = "RLAUNCH_HEARTBEAT_FILE";

/// Steps a rank's mean wait is taken over.
pub const STATS_WINDOW: usize = 20;

/// A rank's time in collectives: the mean over the last `window` steps of the time it spent
/// waiting in its buckets' all-reduces per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepStats {
    pub steps: u64,
    pub window: u32,
    pub mean_wait_us: u64,
}

impl StepStats {
    /// The file's line: fixed width, so a shorter write never leaves a longer one's tail.
    pub fn line(&self) -> String {
        format!("rlaunch-steps {:020} {:06} {:020}\n", self.steps, self.window, self.mean_wait_us)
    }

    /// The stats in a heartbeat file's content, if a `Ddp` wrote them.
    pub fn parse(content: &str) -> Option<StepStats> {
        let mut it = content.lines().next()?.strip_prefix("rlaunch-steps ")?.split(' ');
        let steps = it.next()?.parse().ok()?;
        let window = it.next()?.parse().ok()?;
        let mean_wait_us = it.next()?.parse().ok()?;
        Some(StepStats { steps, window, mean_wait_us })
    }
}

/// Beats more often than this are dropped: the agent samples once a second.
const MIN_GAP: Duration = Duration::from_millis(100);

/// A worker's heartbeat; does nothing when the agent named no file.
#[derive(Debug, Default)]
pub struct Heartbeat {
    file: Option<File>,
    last: Option<Instant>,
}

impl Heartbeat {
    /// The file the agent named in `RLAUNCH_HEARTBEAT_FILE` (with `--hang-timeout`), else the
    /// `heartbeat` file the agent made beside the worker's error file (`TORCHELASTIC_ERROR_FILE`),
    /// which keeps the worker's environment exactly torchrun's; none under another launcher.
    pub fn from_env() -> Heartbeat {
        let named = std::env::var_os(HEARTBEAT_ENV).map(std::path::PathBuf::from).or_else(|| {
            let error_file = std::path::PathBuf::from(std::env::var_os("TORCHELASTIC_ERROR_FILE")?);
            Some(error_file.parent()?.join("heartbeat"))
        });
        // Opened for writing only if it exists: nothing is created where no agent made it.
        let file = named.and_then(|p| File::options().write(true).open(p).ok());
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

    /// A beat that also says how long this rank waits in collectives (a write moves the
    /// file's time too).
    pub fn beat_with(&mut self, stats: StepStats) {
        let Some(f) = &self.file else { return };
        if self.last.is_some_and(|t| t.elapsed() < MIN_GAP) {
            return;
        }
        self.last = Some(Instant::now());
        if f.write_all_at(stats.line().as_bytes(), 0).is_err() {
            let _ = f.set_modified(SystemTime::now());
        }
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

    #[test]
    fn step_stats_round_trip_through_the_file_and_other_content_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("heartbeat");
        File::create(&path).unwrap();
        let mut hb = Heartbeat { file: Some(File::options().write(true).open(&path).unwrap()), last: None };
        let big = StepStats { steps: 123_456, window: 20, mean_wait_us: 45_000 };
        hb.beat_with(big);
        std::thread::sleep(MIN_GAP);
        let small = StepStats { steps: 7, window: 3, mean_wait_us: 5 };
        hb.beat_with(small);
        assert_eq!(StepStats::parse(&std::fs::read_to_string(&path).unwrap()), Some(small));
        assert_eq!(StepStats::parse(""), None);
        assert_eq!(StepStats::parse("rlaunch-steps x 1 2"), None);
    }
}

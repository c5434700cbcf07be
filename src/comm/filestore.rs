//! A store in a directory, one file per key: enough for ranks of one host to bootstrap without
//! a server (tests, benchmarks, local runs with `RLAUNCH_FILE_STORE=/some/dir`).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{CommError, Rendezvous};

/// Keys are files under `dir` (`/` in keys becomes `%`); `set` is atomic by rename and `add`
/// serialises on an `flock`ed lock file.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
}

impl FileStore {
    /// Uses (and creates) `dir`.
    pub fn new(dir: impl AsRef<Path>) -> Result<Self, CommError> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| CommError::Store {
            what: "create dir",
            key: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        Ok(Self { dir })
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(key.replace('/', "%"))
    }
}

fn store_err(what: &'static str, key: &str, e: impl std::fmt::Display) -> CommError {
    CommError::Store { what, key: key.to_string(), reason: e.to_string() }
}

impl Rendezvous for FileStore {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let path = self.path(key);
        let tmp = self.dir.join(format!(".tmp.{}.{}", std::process::id(), key.replace('/', "%")));
        let mut f = fs::File::create(&tmp).map_err(|e| store_err("set", key, e))?;
        f.write_all(value).map_err(|e| store_err("set", key, e))?;
        fs::rename(&tmp, &path).map_err(|e| store_err("set", key, e))
    }

    fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        let path = self.path(key);
        let deadline = Instant::now() + timeout;
        let mut sleep = Duration::from_micros(200);
        loop {
            match fs::read(&path) {
                Ok(v) => return Ok(v),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(store_err("get", key, e)),
            }
            if Instant::now() >= deadline {
                return Err(store_err("get", key, format!("key not set within {timeout:?}")));
            }
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(Duration::from_millis(20));
        }
    }

    fn add(&mut self, key: &str, delta: i64) -> Result<i64, CommError> {
        let lock_path = self.dir.join(".lock");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| store_err("add", key, e))?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&lock);
        // SAFETY: flock on a file descriptor we own; released when `lock` is closed.
        if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
            return Err(store_err("add", key, std::io::Error::last_os_error()));
        }
        let path = self.path(key);
        let cur = match fs::read_to_string(&path) {
            Ok(s) => s.trim().parse::<i64>().map_err(|e| store_err("add", key, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(store_err("add", key, e)),
        };
        let new = cur + delta;
        self.set(key, new.to_string().as_bytes())?;
        drop(lock);
        Ok(new)
    }
}

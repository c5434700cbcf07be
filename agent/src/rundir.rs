//! Where the agent makes its private runtime directories: the snapshot store's socket and the
//! Python package put first on the workers' `PYTHONPATH`, the warm workers' bootstrap, and the
//! default log directory.
//!
//! Each is opened again by path (an interpreter imports from it, a worker connects to it), so a
//! directory above it that another user may rename entries of would let that user swap it for
//! their own and have the agent's workers (root's, often) run their code. The base is therefore
//! the first of `$TMPDIR`, `/tmp` whose every directory, as given and resolved, is owned by root
//! or by this agent's user and writable by no one else unless sticky ([`distrust_for`]); an
//! untrusted `$TMPDIR` is passed over, said once. Each directory is made new (mode 0700, a
//! random name) and holds a lock for the agent's life, so that a later agent removes the
//! directories of agents that were killed ([`sweep`]) and never those of one still running,
//! in whatever PID namespace.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::logdir::{Distrust, LogDirError, LogRoot};

/// Longest path a Unix socket may be bound at (`sun_path` less its final NUL).
pub(crate) const MAX_SOCKET_PATH: usize = 107;
const LOCK_FILE: &str = ".lock";

/// Whether an agent running as `euid` may make directories that it opens again by path below a
/// directory of owner `uid` and `mode` (`st_mode`): owned by root or by `euid`, and writable by
/// no one else unless sticky (others may add entries then, never rename this user's). Pure.
pub fn distrust_for(euid: u32, uid: u32, mode: u32) -> Option<Distrust> {
    if uid != 0 && uid != euid {
        return Some(Distrust::Owner { uid });
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Some(Distrust::Writable { mode: mode & 0o7777 });
    }
    None
}

/// Why `dir` cannot hold this agent's runtime directories, if it cannot: every directory from
/// `/` down to it, as given (a link's target judged where it points) and resolved.
pub fn untrusted(dir: &Path, euid: u32) -> Option<String> {
    let judge = |d: &Path, m: &std::fs::Metadata| {
        if !m.is_dir() {
            return Some(format!("{} is not a directory", d.display()));
        }
        distrust_for(euid, m.uid(), m.mode()).map(|why| match why {
            Distrust::Owner { uid } => format!("{} belongs to uid {uid}", d.display()),
            Distrust::Writable { mode } => {
                format!("{} may be written by others (mode {mode:o}) without the sticky bit", d.display())
            }
        })
    };
    let absolute = match std::path::absolute(dir) {
        Ok(a) => a,
        Err(e) => return Some(format!("{}: {e}", dir.display())),
    };
    for d in absolute.ancestors() {
        // A link on the way is judged itself too: whoever owns it may point it elsewhere later.
        if let Ok(link) = std::fs::symlink_metadata(d) {
            if link.file_type().is_symlink() && link.uid() != 0 && link.uid() != euid {
                return Some(format!("{} is a link that uid {} may point elsewhere", d.display(), link.uid()));
            }
        }
        match std::fs::metadata(d) {
            Ok(m) => {
                if let Some(why) = judge(d, &m) {
                    return Some(why);
                }
            }
            Err(e) => return Some(format!("{}: {e}", d.display())),
        }
    }
    let real = match std::fs::canonicalize(&absolute) {
        Ok(r) => r,
        Err(e) => return Some(format!("{}: {e}", dir.display())),
    };
    for d in real.ancestors() {
        match std::fs::symlink_metadata(d) {
            Ok(m) => {
                if let Some(why) = judge(d, &m) {
                    return Some(why);
                }
            }
            Err(e) => return Some(format!("{}: {e}", d.display())),
        }
    }
    None
}

/// The directories runtime directories may be made in, best first: `$TMPDIR` (as the standard
/// library reads it), then `/tmp`, each only where [`untrusted`] finds nothing. Decided once.
pub fn bases() -> &'static [PathBuf] {
    static BASES: OnceLock<Vec<PathBuf>> = OnceLock::new();
    BASES.get_or_init(|| {
        let euid = crate::logdir::euid();
        let mut out = Vec::new();
        for candidate in [std::env::temp_dir(), PathBuf::from("/tmp")] {
            if out.contains(&candidate) {
                continue;
            }
            match untrusted(&candidate, euid) {
                // Resolved: what the workers are given never goes through a link again.
                None => out.push(std::fs::canonicalize(&candidate).unwrap_or(candidate)),
                Some(why) => tracing::warn!(
                    dir = %candidate.display(),
                    "not making this agent's runtime directories (snapshot socket, Python package, warm bootstrap, \
                     default logs) here: {why}; another user could swap them"
                ),
            }
        }
        out
    })
}

/// One runtime directory, locked for the agent's life; removed when dropped.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    /// Held with an exclusive `flock`: a directory whose lock can be taken belongs to no agent.
    _lock: File,
}

impl RunDir {
    /// Makes `{base}/{prefix}-{pid}-{random}` (mode 0700) in the first trusted base where a path
    /// `longest` bytes longer still fits a Unix socket (0: no socket). Stale directories of the
    /// same prefix are swept first.
    pub fn create(prefix: &str, longest: usize) -> io::Result<RunDir> {
        let bases = bases();
        if bases.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "neither $TMPDIR nor /tmp is a directory only root and this user may rename entries of",
            ));
        }
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "every runtime directory's path is too long");
        for base in bases {
            sweep(base, prefix);
            let path = base.join(format!("{prefix}-{}-{:08x}", std::process::id(), crate::random::rand_u32()));
            if longest > 0 && path.as_os_str().len() + 1 + longest > MAX_SOCKET_PATH {
                continue;
            }
            match Self::make(path) {
                Ok(d) => return Ok(d),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Made under a name [`sweep`] passes over (a leading dot), locked, then renamed into
    /// place: another agent's sweep never sees it between its making and its lock (it would
    /// take the lock and remove a live agent's directory).
    fn make(path: PathBuf) -> io::Result<RunDir> {
        let name = path.file_name().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
        let making = path.with_file_name(format!(".{}", name.to_string_lossy()));
        std::fs::DirBuilder::new().mode(0o700).create(&making)?;
        let locked = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(making.join(LOCK_FILE))
            .and_then(|lock| {
                // SAFETY: flock on a descriptor the File keeps open.
                if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                    return Err(io::Error::last_os_error());
                }
                std::fs::rename(&making, &path)?;
                Ok(lock)
            });
        match locked {
            Ok(lock) => Ok(RunDir { path, _lock: lock }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&making);
                Err(e)
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A directory still under its making name this long belongs to an agent killed while making
/// it (making takes microseconds).
const MAKING_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes `{base}/{prefix}-*` directories of this user that no running agent holds (their
/// lock can be taken): those of agents killed before they could clean up; and `.{prefix}-*`
/// ones (still under their making name) older than [`MAKING_WITHIN`], of agents killed while
/// making them.
pub fn sweep(base: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    let euid = crate::logdir::euid();
    let start = format!("{prefix}-");
    let making = format!(".{prefix}-");
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let half_made = name.starts_with(&making);
        if !name.starts_with(&start) && !half_made {
            continue;
        }
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else { continue };
        if !m.is_dir() || m.uid() != euid {
            continue;
        }
        if half_made {
            let old = m.modified().ok().and_then(|t| t.elapsed().ok()).is_some_and(|age| age >= MAKING_WITHIN);
            if !old {
                continue;
            }
        }
        let lock = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path.join(LOCK_FILE));
        let lock = match lock {
            Ok(lock) => lock,
            // Killed between making the directory and its lock file.
            Err(e) if half_made && e.kind() == io::ErrorKind::NotFound => {
                let _ = std::fs::remove_dir_all(&path);
                continue;
            }
            Err(_) => continue,
        };
        // SAFETY: flock on a descriptor the File keeps open.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            tracing::debug!(dir = %path.display(), "removing a killed agent's runtime directory");
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// `--log-dir/{run_id}_{pid}`, or a private temporary directory removed after a successful run.
/// Either is created here, exclusively, and held open: an existing directory or a planted
/// symlink is never used, and a later rename of it changes nothing (see [`crate::logdir`]). The
/// temporary one is `{base}/rlaunch_{run_id}_{pid}_{64 random bits}`, mode 0700, in the first
/// of `$TMPDIR` and `/tmp` that no other user may rename entries of ([`bases`]).
pub fn log_root(log_dir: Option<&Path>, run_id: &str) -> Result<(LogRoot, bool), LogDirError> {
    let name = format!("{}_{}", sanitize(run_id), std::process::id());
    match log_dir {
        Some(d) => Ok((LogRoot::create_in(d, &name)?, false)),
        None => {
            let mut tries = 0;
            loop {
                let random = (u64::from(crate::random::rand_u32()) << 32) | u64::from(crate::random::rand_u32());
                let base = bases().first().ok_or_else(|| LogDirError::Io {
                    path: std::env::temp_dir(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        "neither $TMPDIR nor /tmp is a directory only root and this user may rename entries of: \
                             give --log-dir",
                    ),
                })?;
                let root = base.join(format!("rlaunch_{name}_{random:016x}"));
                match LogRoot::create_private(&root, 0o700) {
                    Ok(r) => return Ok((r, true)),
                    Err(LogDirError::Io { source, .. })
                        if source.kind() == std::io::ErrorKind::AlreadyExists && tries < 16 =>
                    {
                        tries += 1
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
}

fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtime_base_must_be_owned_by_root_or_this_user_and_renamable_by_no_one_else() {
        let dir = libc::S_IFDIR;
        assert_eq!(distrust_for(1000, 0, dir | 0o755), None);
        assert_eq!(distrust_for(1000, 1000, dir | 0o700), None, "this user's own");
        assert_eq!(distrust_for(1000, 0, dir | 0o1777), None, "sticky, as /tmp");
        assert_eq!(distrust_for(0, 1000, dir | 0o700), Some(Distrust::Owner { uid: 1000 }), "root in a user's $TMPDIR");
        assert_eq!(distrust_for(1000, 1001, dir | 0o755), Some(Distrust::Owner { uid: 1001 }));
        assert_eq!(distrust_for(0, 0, dir | 0o777), Some(Distrust::Writable { mode: 0o777 }));
        assert_eq!(distrust_for(0, 0, dir | 0o2775), Some(Distrust::Writable { mode: 0o2775 }));
    }

    #[test]
    fn a_directory_another_user_owns_or_may_write_is_untrusted_as_given_and_resolved() {
        let root = tempfile::tempdir().unwrap();
        let euid = crate::logdir::euid();
        let own = root.path().join("own");
        std::fs::DirBuilder::new().mode(0o700).create(&own).unwrap();
        assert_eq!(untrusted(&own, euid), None, "{own:?}");
        let open = root.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        assert!(untrusted(&open, euid).is_some_and(|w| w.contains("without the sticky bit")));
        // Below it, and through a link to it: untrusted too.
        let below = open.join("below");
        std::fs::DirBuilder::new().mode(0o700).create(&below).unwrap();
        assert!(untrusted(&below, euid).is_some());
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&below, &link).unwrap();
        assert!(untrusted(&link, euid).is_some());
        // Another user's directory.
        if euid == 0 {
            let theirs = root.path().join("theirs");
            std::fs::DirBuilder::new().mode(0o700).create(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(4242), None).unwrap();
            assert!(untrusted(&theirs, euid).is_some_and(|w| w.contains("uid 4242")));
            // A link another user owns, pointing somewhere trusted today: they may re-point it.
            let planted = root.path().join("planted");
            std::os::unix::fs::symlink(&own, &planted).unwrap();
            std::os::unix::fs::lchown(&planted, Some(4242), None).unwrap();
            assert!(untrusted(&planted, euid).is_some_and(|w| w.contains("a link that uid 4242")));
        }
    }

    #[test]
    fn a_sweep_running_while_another_agent_makes_its_directory_never_removes_it() {
        // Issue 34 (Low): a directory was visible to other agents' sweeps between its making and
        // its lock, and a sweep in that window took the lock and removed a live agent's directory.
        let base = tempfile::tempdir().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sweeper = {
            let (base, stop) = (base.path().to_owned(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    sweep(&base, "rlaunch-race");
                }
            })
        };
        let mut lost = 0;
        for i in 0..3000 {
            let d = RunDir::make(base.path().join(format!("rlaunch-race-1-{i:08x}"))).unwrap();
            std::thread::yield_now();
            if !d.path().join(LOCK_FILE).exists() {
                lost += 1;
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        sweeper.join().unwrap();
        assert_eq!(lost, 0, "live directories removed by a concurrent sweep");
    }

    #[test]
    fn a_killed_agents_directories_are_swept_and_a_running_ones_never() {
        let base = tempfile::tempdir().unwrap();
        let live = RunDir::make(base.path().join("rlaunch-test-1-aa")).unwrap();
        // What a killed agent leaves: its directory and lock file, the lock gone with it.
        let dead_path = base.path().join("rlaunch-test-2-bb");
        std::fs::create_dir(&dead_path).unwrap();
        std::fs::write(dead_path.join(LOCK_FILE), b"").unwrap();
        let other = base.path().join("something-else");
        std::fs::create_dir(&other).unwrap();
        // Killed while making: a directory under its making name, with or without its lock
        // file, old; and one being made now, which stays.
        let old = std::time::SystemTime::now() - MAKING_WITHIN - std::time::Duration::from_secs(1);
        let half_locked = base.path().join(".rlaunch-test-3-cc");
        std::fs::create_dir(&half_locked).unwrap();
        std::fs::write(half_locked.join(LOCK_FILE), b"").unwrap();
        let half_bare = base.path().join(".rlaunch-test-4-dd");
        std::fs::create_dir(&half_bare).unwrap();
        for d in [&half_locked, &half_bare] {
            std::fs::File::open(d).unwrap().set_modified(old).unwrap();
        }
        let being_made = base.path().join(".rlaunch-test-5-ee");
        std::fs::create_dir(&being_made).unwrap();
        sweep(base.path(), "rlaunch-test");
        assert!(live.path().exists(), "a running agent's directory stays");
        assert!(!dead_path.exists(), "a killed agent's directory goes");
        assert!(other.exists(), "what is not the agent's stays");
        assert!(!half_locked.exists() && !half_bare.exists(), "half-made directories of killed agents go");
        assert!(being_made.exists(), "a directory being made now stays");
    }
}

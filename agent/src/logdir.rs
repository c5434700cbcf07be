//! The run's log directory (`--log-dir/{run_id}_{pid}` or a private temporary one): created
//! exclusively, then held open, and every directory and file under it made through that handle
//! without following a symlink.
//!
//! Why: an agent often runs as root while `--log-dir` belongs to someone else. Whoever may
//! rename entries of `--log-dir` could swap the run directory for a symlink while the agent
//! waits in the rendezvous; path-based creates would then make or truncate files wherever the
//! link points. Holding the run directory as a descriptor makes a rename harmless (the agent
//! keeps writing into the directory it created), `O_NOFOLLOW` on every component refuses a link
//! planted below it, and the files workers write there (error files, heartbeats) are read through
//! it too, never following a link nor waiting on a FIFO.
//!
//! A root agent also refuses a `--log-dir` below any directory (as given and resolved) that
//! another user owns or that a group or others may write without the sticky bit: whoever may
//! rename entries there could replace the tree the workers (root too) are given paths into. A
//! non-root agent takes any directory, as torchrun does: only its own files are at stake.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// Mode of the directories the agent makes under the run directory.
const DIR_MODE: libc::mode_t = 0o755;
/// Mode of the files it makes there.
const FILE_MODE: libc::mode_t = 0o644;

/// Why a log directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LogDirError {
    #[error("cannot create or open log directory {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("refusing log directory {path}: {}", distrust_message(path, dir, why))]
    Untrusted { path: PathBuf, dir: PathBuf, why: Distrust },
    #[error("the run directory {path} was replaced while it was being created")]
    Replaced { path: PathBuf },
    #[error("a thousand log directories of this run id and pid exist in {path}")]
    Exhausted { path: PathBuf },
}

/// Why a root agent does not trust a directory at or above `--log-dir`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distrust {
    /// Another user owns it: they may rename any entry.
    Owner { uid: u32 },
    /// Its group or others may write it and it is not sticky: they may rename any entry.
    Writable { mode: u32 },
}

/// Whether a root agent may create below a directory of owner `uid` and `mode` (st_mode): owned
/// by root, and writable by no one else unless sticky (as `/tmp`: others may add entries there
/// but not rename root's). Pure.
pub fn distrust(uid: u32, mode: u32) -> Option<Distrust> {
    if uid != 0 {
        return Some(Distrust::Owner { uid });
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Some(Distrust::Writable { mode: mode & 0o7777 });
    }
    None
}

fn distrust_message(path: &Path, dir: &Path, why: &Distrust) -> String {
    let what = if dir == path { "it".to_string() } else { dir.display().to_string() };
    match *why {
        Distrust::Owner { uid } => format!(
            "{what} belongs to uid {uid}, who could rename what this agent, running as root, makes below it and \
             put their own files there; use a directory owned by root, as is every directory above it"
        ),
        Distrust::Writable { mode } => {
            let by = match (mode & 0o020 != 0, mode & 0o002 != 0) {
                (true, true) => "its group and others",
                (true, false) => "its group",
                _ => "others",
            };
            format!(
                "{what} is writable by {by} (mode {mode:o}) without the sticky bit, so they could rename what this \
                 agent, running as root, makes below it and put their own files there; run `chmod +t {}` (as \
                 /tmp: they may then add entries but not rename root's) or use a subdirectory owned by root and \
                 writable only by it",
                dir.display()
            )
        }
    }
}

/// How a file under the run directory is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Open {
    /// Created, or emptied when it exists (a heartbeat file).
    Truncate,
    /// Created, or appended to when it exists (logs, filtered logs).
    Append,
    /// Created; an existing entry of that name is an error.
    New,
}

/// The run directory, held open.
#[derive(Debug)]
pub struct LogRoot {
    path: PathBuf,
    dir: OwnedFd,
}

impl LogRoot {
    /// Makes `{log_dir}/{name}` (then `{name}_1`, `{name}_2`, … where it exists) and holds it.
    /// `log_dir` and the directories above it may exist; as root, any of them (as given and
    /// resolved) another user could rename entries of is refused, before anything is made.
    pub fn create_in(log_dir: &Path, name: &str) -> Result<LogRoot, LogDirError> {
        Self::create_in_as(log_dir, name, euid() == 0)
    }

    /// [`LogRoot::create_in`], checking the directories as a root agent must when `as_root`.
    pub fn create_in_as(log_dir: &Path, name: &str, as_root: bool) -> Result<LogRoot, LogDirError> {
        let io_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| LogDirError::Io { path, source }
        };
        let parent = if as_root {
            trusted_dir_all(log_dir)?
        } else {
            std::fs::create_dir_all(log_dir).map_err(io_err(log_dir))?;
            // The invoker named `log_dir`: following a link there is theirs to decide.
            open_dir(libc::AT_FDCWD, log_dir, true).map_err(io_err(log_dir))?
        };
        // A restarted container has the same pid and run id: `_1`, `_2`, … then, never the
        // existing directory (nor a symlink planted there).
        for n in 0..1000 {
            let leaf = if n == 0 { name.to_owned() } else { format!("{name}_{n}") };
            match mkdir_at(&parent, Path::new(&leaf), DIR_MODE) {
                Ok(()) => return Self::hold(&parent, log_dir.join(&leaf), &leaf),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(&log_dir.join(&leaf))(e)),
            }
        }
        Err(LogDirError::Exhausted { path: log_dir.to_path_buf() })
    }

    /// Makes `path` (whose parent is a directory only this user may write, such as a sticky
    /// `$TMPDIR`) with `mode` and holds it; `AlreadyExists` when it exists.
    pub fn create_private(path: &Path, mode: libc::mode_t) -> Result<LogRoot, LogDirError> {
        let io_err = |source| LogDirError::Io { path: path.to_path_buf(), source };
        let (parent, leaf) = split(path).map_err(io_err)?;
        let parent = open_dir(libc::AT_FDCWD, parent, true).map_err(io_err)?;
        mkdir_at(&parent, leaf, mode).map_err(io_err)?;
        Self::hold(&parent, path.to_path_buf(), leaf)
    }

    /// Opens the directory just made and checks it is still the one made: a real directory of
    /// this user (a rename between the two calls leaves something else, or nothing, there).
    fn hold(parent: &OwnedFd, path: PathBuf, leaf: impl AsRef<Path>) -> Result<LogRoot, LogDirError> {
        let dir = match open_dir(parent.as_raw_fd(), leaf.as_ref(), false) {
            Ok(d) => d,
            Err(_) => return Err(LogDirError::Replaced { path }),
        };
        let st = fstat(&dir).map_err(|source| LogDirError::Io { path: path.clone(), source })?;
        if st.st_uid != euid() {
            return Err(LogDirError::Replaced { path });
        }
        Ok(LogRoot { path, dir })
    }

    /// The run directory's path, as made (for messages and for the workers' environment).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes every directory of `path` (a path under [`LogRoot::path`]) that does not exist,
    /// never following a symlink; returns the last one, open.
    pub fn create_dirs(&self, path: &Path) -> io::Result<OwnedFd> {
        let rel = self.relative(path)?;
        self.walk(&rel, true)
    }

    /// Opens the file `path` (under [`LogRoot::path`]) for writing, without following a symlink
    /// anywhere below the run directory; its directories must exist.
    pub fn open(&self, path: &Path, how: Open) -> io::Result<File> {
        let rel = self.relative(path)?;
        let (dir, leaf) = split(&rel)?;
        let dir = self.walk(dir, false)?;
        open_file_at(&dir, leaf, how)
    }

    /// Writes `bytes` to `path` (under [`LogRoot::path`]) whole or not at all (see
    /// [`write_atomically_at`]).
    pub fn write_atomically(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let rel = self.relative(path)?;
        let (dir, leaf) = split(&rel)?;
        let dir = self.walk(dir, false)?;
        write_atomically_at(&dir, leaf, bytes)
    }

    /// Reads the file `path` (under [`LogRoot::path`]), at most `cap` bytes, without following a
    /// symlink anywhere below the run directory and without waiting on a FIFO: what is there is
    /// a worker's to put, so anything but a regular file is an error.
    pub fn read(&self, path: &Path, cap: usize) -> io::Result<Vec<u8>> {
        use std::io::Read as _;
        let file = self.open_regular(path)?;
        let mut buf = Vec::new();
        file.take(cap as u64).read_to_end(&mut buf)?;
        Ok(buf)
    }

    /// The modification time of the regular file `path` (under [`LogRoot::path`]), found as
    /// [`LogRoot::read`] finds it.
    pub fn modified(&self, path: &Path) -> io::Result<std::time::SystemTime> {
        self.open_regular(path)?.metadata()?.modified()
    }

    fn open_regular(&self, path: &Path) -> io::Result<File> {
        let rel = self.relative(path)?;
        let (dir, leaf) = split(&rel)?;
        let dir = self.walk(dir, false)?;
        let c = cstr(leaf)?;
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
        // SAFETY: `dir` is an open descriptor and `c` NUL-terminated, both alive for the call.
        let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: openat just returned this descriptor and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        if fstat(&fd)?.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a regular file", leaf.display()),
            ));
        }
        // A regular file never blocks a read; O_NONBLOCK stays, harmless.
        Ok(File::from(fd))
    }

    fn relative(&self, path: &Path) -> io::Result<PathBuf> {
        let rel = path.strip_prefix(&self.path).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not under {}", path.display(), self.path.display()),
            )
        })?;
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} leaves the log directory", path.display()),
            ));
        }
        Ok(rel.to_path_buf())
    }

    /// Opens `rel`'s directories one by one below the held one, making the missing ones when
    /// `make`.
    fn walk(&self, rel: &Path, make: bool) -> io::Result<OwnedFd> {
        let mut cur = dup(&self.dir)?;
        for c in rel.components() {
            let Component::Normal(name) = c else { continue };
            let name = Path::new(name);
            if make {
                match mkdir_at(&cur, name, DIR_MODE) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(e),
                }
            }
            cur = open_dir(cur.as_raw_fd(), name, false)?;
        }
        Ok(cur)
    }
}

/// A root agent's `--log-dir`, made where missing and opened, every directory of it and above it
/// judged by [`distrust`] first: those of the path as given (a symlink's target included), then,
/// opened one by one from `/` without following a link, those of the path resolved. Nothing is
/// made below a directory that fails.
fn trusted_dir_all(log_dir: &Path) -> Result<OwnedFd, LogDirError> {
    let io_err = |source| LogDirError::Io { path: log_dir.to_path_buf(), source };
    let untrusted = |dir: &Path, uid: u32, mode: u32| {
        distrust(uid, mode).map(|why| LogDirError::Untrusted {
            path: log_dir.to_path_buf(),
            dir: dir.to_path_buf(),
            why,
        })
    };
    let absolute = std::path::absolute(log_dir).map_err(io_err)?;
    // As given: every existing directory on the way, a link's target judged where it points.
    for dir in absolute.ancestors().collect::<Vec<_>>().into_iter().rev() {
        match std::fs::metadata(dir) {
            Ok(m) => {
                use std::os::unix::fs::MetadataExt as _;
                if let Some(e) = untrusted(dir, m.uid(), m.mode()) {
                    return Err(e);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => break,
            Err(e) => return Err(io_err(e)),
        }
    }
    // Resolved: the deepest existing directory's real path, then what is still to be made.
    let existing = absolute.ancestors().find(|d| d.exists()).unwrap_or(Path::new("/"));
    let real = std::fs::canonicalize(existing).map_err(io_err)?;
    let rest = absolute.strip_prefix(existing).map_err(|_| io_err(io::ErrorKind::InvalidInput.into()))?;
    if rest.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(io_err(io::Error::new(io::ErrorKind::InvalidInput, "`..` below a directory not made yet")));
    }
    let mut at = PathBuf::from("/");
    let mut cur = open_dir(libc::AT_FDCWD, &at, false).map_err(io_err)?;
    let st = fstat(&cur).map_err(io_err)?;
    if let Some(e) = untrusted(&at, st.st_uid, st.st_mode) {
        return Err(e);
    }
    let made = real.components().filter(|c| matches!(c, Component::Normal(_))).count();
    for (i, c) in real.components().chain(rest.components()).filter(|c| matches!(c, Component::Normal(_))).enumerate() {
        let name = Path::new(c.as_os_str());
        at.push(name);
        if i >= made {
            match mkdir_at(&cur, name, DIR_MODE) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(LogDirError::Io { path: at, source: e }),
            }
        }
        cur = open_dir(cur.as_raw_fd(), name, false).map_err(|source| LogDirError::Io { path: at.clone(), source })?;
        let st = fstat(&cur).map_err(io_err)?;
        if let Some(e) = untrusted(&at, st.st_uid, st.st_mode) {
            return Err(e);
        }
    }
    Ok(cur)
}

/// Writes `bytes` to `dir/leaf` through a temporary file and a rename, so a reader never sees
/// half: the temporary file is made new (a stale one is removed first, never followed), its data
/// fsync'd before the rename, the directory after it.
pub fn write_atomically_at(dir: &OwnedFd, leaf: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write as _;
    let mut tmp_name = leaf.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = Path::new(&tmp_name);
    let ctmp = cstr(tmp)?;
    // SAFETY: `dir` is an open descriptor and `ctmp` a NUL-terminated string, both alive for
    // the call; unlinkat never follows a link (it removes the link itself).
    let _ = unsafe { libc::unlinkat(dir.as_raw_fd(), ctmp.as_ptr(), 0) };
    let mut f = open_file_at(dir, tmp, Open::New)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    let cleaf = cstr(leaf)?;
    // SAFETY: as above; renameat replaces `leaf` (even a symlink) without following it.
    if unsafe { libc::renameat(dir.as_raw_fd(), ctmp.as_ptr(), dir.as_raw_fd(), cleaf.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    File::from(dup(dir)?).sync_all()
}

/// Opens the directory `path` relative to `at`, following a final symlink only when `follow`.
pub fn open_dir(at: libc::c_int, path: &Path, follow: bool) -> io::Result<OwnedFd> {
    let c = cstr(path)?;
    let nofollow = if follow { 0 } else { libc::O_NOFOLLOW };
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | nofollow;
    // SAFETY: `c` is NUL-terminated and alive for the call; `at` is AT_FDCWD or a descriptor the
    // caller holds open.
    let fd = unsafe { libc::openat(at, c.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat just returned this descriptor and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_file_at(dir: &OwnedFd, leaf: &Path, how: Open) -> io::Result<File> {
    let c = cstr(leaf)?;
    let mode = match how {
        Open::Truncate => libc::O_CREAT | libc::O_TRUNC,
        Open::Append => libc::O_CREAT | libc::O_APPEND,
        Open::New => libc::O_CREAT | libc::O_EXCL,
    };
    let flags = libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | mode;
    // SAFETY: `dir` is an open descriptor and `c` NUL-terminated, both alive for the call.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, FILE_MODE as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat just returned this descriptor and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // O_NONBLOCK only so that opening a FIFO planted there never blocks; a non-regular file is
    // refused (a device, a FIFO), and writes to the regular one block as usual.
    let st = fstat(&fd)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not a regular file", leaf.display())));
    }
    // SAFETY: `fd` is open; F_SETFL only changes its status flags.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, mode & libc::O_APPEND) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(File::from(fd))
}

fn mkdir_at(dir: &OwnedFd, name: &Path, mode: libc::mode_t) -> io::Result<()> {
    let c = cstr(name)?;
    // SAFETY: `dir` is an open descriptor and `c` NUL-terminated, both alive for the call;
    // mkdirat never follows a link at the new name (an existing one is EEXIST).
    if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), mode) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn fstat(fd: &OwnedFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` a valid, writable `stat`.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn dup(fd: &OwnedFd) -> io::Result<OwnedFd> {
    fd.try_clone()
}

/// This process's effective uid.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn split(path: &Path) -> io::Result<(&Path, &Path)> {
    let leaf = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{} names no file", path.display())))?;
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Ok((parent, Path::new(leaf)))
}

fn cstr(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in a path"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The attack of issue 26: the run directory's parent belongs to someone who renames the
    /// run directory and puts a symlink to a victim directory in its place.
    #[test]
    fn a_run_directory_swapped_for_a_symlink_is_never_followed() {
        let base = tempfile::tempdir().unwrap();
        let logs = base.path().join("logs");
        let victim = base.path().join("victim");
        std::fs::create_dir_all(&victim).unwrap();
        std::fs::write(victim.join("precious"), b"keep me").unwrap();
        let root = LogRoot::create_in(&logs, "run_1").unwrap();
        let moved = base.path().join("moved");
        std::fs::rename(root.path(), &moved).unwrap();
        std::os::unix::fs::symlink(&victim, root.path()).unwrap();

        let worker = root.path().join("attempt_1").join("0");
        root.create_dirs(&worker).unwrap();
        root.open(&worker.join("heartbeat"), Open::Truncate).unwrap();
        root.open(&worker.join("stdout.log"), Open::Append).unwrap();
        root.write_atomically(&root.path().join("error.json"), b"{}").unwrap();
        // A link planted below the run directory is not followed either.
        std::os::unix::fs::symlink(victim.join("precious"), moved.join("attempt_1/0/precious")).unwrap();
        assert!(root.open(&worker.join("precious"), Open::Truncate).is_err());
        std::os::unix::fs::symlink(victim.join("precious"), moved.join("error.json.tmp")).unwrap();
        root.write_atomically(&root.path().join("error.json"), b"{}").unwrap();

        let mut in_victim: Vec<_> =
            std::fs::read_dir(&victim).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        in_victim.sort();
        assert_eq!(in_victim, ["precious"], "nothing made in the victim directory");
        assert_eq!(std::fs::read(victim.join("precious")).unwrap(), b"keep me");
        assert!(moved.join("attempt_1/0/heartbeat").is_file());
        assert!(moved.join("attempt_1/0/stdout.log").is_file());
        assert_eq!(std::fs::read(moved.join("error.json")).unwrap(), b"{}");
    }

    /// A root agent's rule for every directory at and above `--log-dir`.
    #[test]
    fn a_root_agent_distrusts_a_directory_others_own_or_may_rename_entries_of() {
        assert_eq!(distrust(0, libc::S_IFDIR | 0o755), None);
        assert_eq!(distrust(0, libc::S_IFDIR | 0o1777), None, "sticky, as /tmp");
        assert_eq!(distrust(0, libc::S_IFDIR | 0o3775), None, "a sticky setgid team directory");
        assert_eq!(distrust(0, libc::S_IFDIR | 0o2775), Some(Distrust::Writable { mode: 0o2775 }));
        assert_eq!(distrust(0, libc::S_IFDIR | 0o777), Some(Distrust::Writable { mode: 0o777 }));
        assert_eq!(distrust(0, libc::S_IFDIR | 0o757), Some(Distrust::Writable { mode: 0o757 }));
        assert_eq!(distrust(1000, libc::S_IFDIR | 0o755), Some(Distrust::Owner { uid: 1000 }));
        assert_eq!(distrust(1000, libc::S_IFDIR | 0o1777), Some(Distrust::Owner { uid: 1000 }));
    }

    /// The refusal says what is wrong with which directory and what to do about it.
    #[test]
    fn a_refusal_says_the_reason_and_the_remedy() {
        let team = PathBuf::from("/tmp/rv2/team");
        let msg =
            |path: &Path, why| LogDirError::Untrusted { path: path.to_path_buf(), dir: team.clone(), why }.to_string();
        assert_eq!(
            msg(&team, Distrust::Writable { mode: 0o2775 }),
            "refusing log directory /tmp/rv2/team: it is writable by its group (mode 2775) without the sticky bit, so \
             they could rename what this agent, running as root, makes below it and put their own files there; run \
             `chmod +t /tmp/rv2/team` (as /tmp: they may then add entries but not rename root's) or use a \
             subdirectory owned by root and writable only by it"
        );
        let below = team.join("logs");
        let m = msg(&below, Distrust::Writable { mode: 0o777 });
        assert!(m.starts_with("refusing log directory /tmp/rv2/team/logs: /tmp/rv2/team is writable by its group and others (mode 777)"), "{m}");
        assert!(m.contains("`chmod +t /tmp/rv2/team`"), "{m}");
        let m = msg(&below, Distrust::Writable { mode: 0o1757 & 0o757 });
        assert!(m.contains("writable by others (mode 757)"), "{m}");
        let m = msg(&below, Distrust::Owner { uid: 1000 });
        assert!(
            m.starts_with("refusing log directory /tmp/rv2/team/logs: /tmp/rv2/team belongs to uid 1000, who could"),
            "{m}"
        );
        assert!(m.contains("use a directory owned by root"), "{m}");
        assert!(!m.contains("uid 0"), "{m}");
    }

    /// A non-root agent takes what torchrun takes (a setgid team directory, an emptyDir): only
    /// its own files are at stake. A root agent does not take them.
    #[test]
    fn only_a_root_agent_refuses_a_directory_others_may_write() {
        let base = tempfile::tempdir().unwrap();
        for mode in [0o2775, 0o777] {
            let logs = base.path().join(format!("logs{mode:o}"));
            std::fs::create_dir(&logs).unwrap();
            std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(mode)).unwrap();
            LogRoot::create_in_as(&logs, "run", false).unwrap();
            LogRoot::create_in_as(&logs.join("below"), "run", false).unwrap();
            let err = LogRoot::create_in_as(&logs.join("new"), "run", true).unwrap_err();
            assert!(matches!(err, LogDirError::Untrusted { .. }), "{err}");
            assert!(!logs.join("new").exists(), "nothing made below it");
        }
    }

    #[test]
    fn a_fifo_or_a_path_outside_the_run_directory_is_refused() {
        let base = tempfile::tempdir().unwrap();
        let root = LogRoot::create_in(base.path(), "run").unwrap();
        let fifo = root.path().join("fifo");
        let c = cstr(&fifo).unwrap();
        // SAFETY: `c` is NUL-terminated and alive for the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(root.open(&fifo, Open::Append).is_err(), "opening a FIFO neither blocks nor succeeds");
        assert!(root.open(&base.path().join("elsewhere"), Open::Truncate).is_err());
        assert!(root.open(&root.path().join("../elsewhere"), Open::Truncate).is_err());
        assert!(!base.path().join("elsewhere").exists());
    }
}

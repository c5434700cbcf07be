//! Starting worker processes so that none outlives its agent, and signalling their process
//! groups. One of the agent's four modules with `unsafe` (ARCHITECTURE.md lists each block).

use std::ffi::CString;
use std::io;

use rlaunch::contract::Exit;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Stdio;

/// A worker process held through a pidfd: it is reaped here (never by anyone else), and its
/// process group is signalled only while it is not reaped — while the leader is at most a
/// zombie its pid, which is the group's id, cannot name another process or group.
pub struct WorkerProc {
    pid: u32,
    exited: Exited,
    reaped: std::sync::Mutex<bool>,
}

/// How the agent learns that a worker exited, before reaping it itself.
enum Exited {
    /// A pidfd becomes readable (Linux 5.3 and later).
    Pidfd(tokio::io::unix::AsyncFd<OwnedFd>),
    /// Older kernels, or a seccomp profile without pidfd_open: a thread waits with `WNOWAIT`
    /// (which does not reap) and says so.
    Thread(tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>),
}

/// How a worker's standard streams are connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Terminal {
    /// stdout (and stderr) on pseudo-terminals of their own, so the worker sees a terminal:
    /// colours, progress bars, prompts. Otherwise pipes.
    pub stdout: bool,
    pub stderr: bool,
    /// stdin from the stdout terminal (the agent forwards its own stdin there); otherwise
    /// /dev/null, unless `inherit_stdin`.
    pub stdin: bool,
    /// stdin is the agent's own (a pipe or a file: `echo cfg | rlaunch ...` as under torchrun).
    pub inherit_stdin: bool,
    /// The terminal's size as the worker sees it (the agent's less the prefix).
    pub size: Option<(u16, u16)>,
}

/// What else a worker gets before it runs: its cgroup, its CPUs.
#[derive(Default)]
pub struct Placement {
    /// A cgroup's `cgroup.procs`: the worker moves itself there before it runs anything, so
    /// every process it ever starts is in it too.
    pub cgroup_procs: Option<CString>,
    /// CPUs the worker and its threads may run on (`--numa-binding`).
    pub cpus: Option<libc::cpu_set_t>,
    /// The one descriptor above stderr the worker keeps (a warm worker's order pipe). Every
    /// other one the agent inherited without close-on-exec is closed at exec, as torchrun's
    /// workers have only stdin, stdout and stderr.
    pub keep_fd: Option<libc::c_int>,
}

/// A started worker: the process, its output streams, and where its stdin can be written.
pub struct Spawned {
    pub proc: WorkerProc,
    pub stdout: Reader,
    pub stderr: Reader,
    /// The worker's terminal, for its input (when [`Terminal::stdin`]).
    pub stdin: Option<std::fs::File>,
}

/// Spawns `cmd` in a new process group of its own (a session of its own, with its terminal as
/// the controlling one, when it gets a terminal) with `PR_SET_PDEATHSIG(SIGKILL)`; stdin from
/// /dev/null, stdout and stderr piped, unless `terminal` says otherwise.
///
/// The parent-death signal fires when the *thread* that forked exits, so this must be called
/// from a thread that lives as long as the agent (a tokio worker thread, not a blocking-pool
/// thread).
pub fn spawn_worker(cmd: std::process::Command, place: Placement, terminal: Terminal) -> io::Result<Spawned> {
    spawn_worker_with(cmd, place, terminal, true)
}

/// [`spawn_worker`], with `pidfd: false` taking the older kernels' way (for its tests).
fn spawn_worker_with(
    mut cmd: std::process::Command,
    place: Placement,
    terminal: Terminal,
    pidfd: bool,
) -> io::Result<Spawned> {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid is async-signal-safe and has no preconditions.
    let agent_pid = unsafe { libc::getpid() };
    // Without pseudo-terminals (no /dev/ptmx in a container, none left), pipes as elsewhere.
    let open_pty = |wanted: bool| -> Option<Pty> {
        if !wanted {
            return None;
        }
        Pty::open(terminal.size)
            .map_err(|e| tracing::warn!(error = %e, "no pseudo-terminal for a worker; it gets a pipe"))
            .ok()
    };
    let out_pty = open_pty(terminal.stdout);
    let err_pty = open_pty(terminal.stderr);
    let mut stdin_master = None;
    match &out_pty {
        Some(p) if terminal.stdin => {
            cmd.stdin(Stdio::from(p.slave.try_clone()?));
            stdin_master = Some(std::fs::File::from(p.master.try_clone()?));
        }
        _ if terminal.inherit_stdin => {
            cmd.stdin(Stdio::inherit());
        }
        _ => {
            cmd.stdin(Stdio::null());
        }
    }
    match &out_pty {
        Some(p) => cmd.stdout(Stdio::from(p.slave.try_clone()?)),
        None => cmd.stdout(Stdio::piped()),
    };
    match &err_pty {
        Some(p) => cmd.stderr(Stdio::from(p.slave.try_clone()?)),
        None => cmd.stderr(Stdio::piped()),
    };
    // The rank that gets typed input has its terminal as its controlling one (`/dev/tty`, as
    // getpass opens); the others keep none, so a prompt there fails at once instead of waiting
    // for input that never comes.
    let session = stdin_master.is_some();
    let ctty_fd = libc::STDOUT_FILENO;
    if !session {
        cmd.process_group(0);
    }
    let Placement { cgroup_procs, cpus, keep_fd } = place;
    // SAFETY: the closure runs between fork and exec and only calls async-signal-safe functions
    // (setsid, ioctl, signal, sched_setaffinity, prctl, getppid, open, write, close) on memory
    // prepared before the fork; it allocates nothing and touches no locks.
    unsafe {
        cmd.pre_exec(move || {
            if session {
                // A session of its own makes it a process group leader too (the group the
                // agent signals), and its terminal its controlling one (`/dev/tty`).
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::ioctl(ctty_fd, libc::TIOCSCTTY, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            close_at_exec_from(3, keep_fd)?;
            // The agent ignores SIGTTIN while it forwards a terminal's input; the worker must not
            // inherit that.
            libc::signal(libc::SIGTTIN, libc::SIG_DFL);
            if let Some(set) = &cpus {
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(procs) = &cgroup_procs {
                move_self_into(procs)?;
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The agent may have died between fork and prctl: then no signal will ever come.
            if libc::getppid() != agent_pid {
                return Err(io::Error::other("agent exited while the worker was starting"));
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    // The worker's ends of its terminals live on in the worker only: once it and its children
    // are gone, reading the master ends.
    drop(cmd);
    let pid = child.id();
    // The child is not reaped yet (nobody waits on it but us, later): its pid is still its own.
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let raw =
        if pidfd { unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0 as libc::c_uint) } } else { -1 };
    let exited = if raw >= 0 {
        // SAFETY: the descriptor was just returned by pidfd_open and is owned by nobody else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(raw as libc::c_int) };
        // SAFETY: an OwnedFd is a valid open descriptor that stays open and the same for as long
        // as the AsyncFd owns it.
        Exited::Pidfd(unsafe { tokio::io::unix::AsyncFd::register(pidfd) }.map_err(io::Error::from)?)
    } else {
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new().name("rlaunch-wait".into()).spawn(move || {
            loop {
                // SAFETY: a zeroed siginfo_t is a valid out-parameter; WNOWAIT leaves the child
                // unreaped, so its pid stays ours until the agent reaps it.
                let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
                let r =
                    unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOWAIT) };
                if r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                    break;
                }
            }
            let _ = tx.send(());
        })?;
        Exited::Thread(tokio::sync::Mutex::new(Some(rx)))
    };
    let stdout = output_reader(child.stdout.take(), out_pty)?;
    let stderr = output_reader(child.stderr.take(), err_pty)?;
    // Dropping std's `Child` neither waits nor kills: the pidfd is how the worker is awaited.
    drop(child);
    let proc = WorkerProc { pid, exited, reaped: std::sync::Mutex::new(false) };
    Ok(Spawned { proc, stdout, stderr, stdin: stdin_master })
}

type Reader = Box<dyn tokio::io::AsyncRead + Unpin + Send>;

/// The agent's end of one output stream of a worker: its terminal's master, else its pipe.
fn output_reader(pipe: Option<impl Into<OwnedFd>>, pty: Option<Pty>) -> io::Result<Reader> {
    Ok(match (pipe, pty) {
        (_, Some(pty)) => Box::new(PtyReader::new(pty.master)?),
        (Some(p), None) => Box::new(tokio::net::unix::pipe::Receiver::from_owned_fd(p.into())?),
        (None, None) => unreachable!("a stream is either piped or on a terminal"),
    })
}

/// A pseudo-terminal pair: the agent keeps the master, the worker gets the slave.
struct Pty {
    master: OwnedFd,
    slave: OwnedFd,
}

impl Pty {
    /// A new pseudo-terminal that passes the worker's bytes as written (no `\n` to `\r\n`) and
    /// does not echo input (the agent's own terminal echoed it already), of `size` (rows,
    /// columns).
    fn open(size: Option<(u16, u16)>) -> io::Result<Pty> {
        // SAFETY: posix_openpt returns a new descriptor or -1.
        let m = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
        if m < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: m was just returned by posix_openpt and is owned by nobody else.
        let master = unsafe { OwnedFd::from_raw_fd(m) };
        let mut name = [0 as libc::c_char; 128];
        // SAFETY: grantpt/unlockpt/ptsname_r on a valid master descriptor; ptsname_r writes at
        // most `name.len()` bytes, NUL-terminated.
        unsafe {
            if libc::grantpt(m) != 0 || libc::unlockpt(m) != 0 {
                return Err(io::Error::last_os_error());
            }
            let r = libc::ptsname_r(m, name.as_mut_ptr(), name.len());
            if r != 0 {
                return Err(io::Error::from_raw_os_error(r));
            }
        }
        // SAFETY: `name` is NUL-terminated by ptsname_r.
        let s = unsafe { libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
        if s < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: s was just returned by open and is owned by nobody else.
        let slave = unsafe { OwnedFd::from_raw_fd(s) };
        // SAFETY: a zeroed termios is a valid out-parameter; tcgetattr/tcsetattr/ioctl on the
        // descriptors just opened.
        unsafe {
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(s, &mut t) != 0 {
                return Err(io::Error::last_os_error());
            }
            t.c_oflag &= !libc::OPOST;
            t.c_lflag &= !(libc::ECHO | libc::ECHONL);
            if libc::tcsetattr(s, libc::TCSANOW, &t) != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some((rows, cols)) = size {
                let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
                libc::ioctl(m, libc::TIOCSWINSZ, &ws);
            }
        }
        Ok(Pty { master, slave })
    }
}

/// The size (rows, columns) of the terminal on `fd`, if it is one.
pub fn terminal_size(fd: libc::c_int) -> Option<(u16, u16)> {
    // SAFETY: a zeroed winsize is a valid out-parameter for TIOCGWINSZ.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes a winsize into the pointer it is given.
    let r = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_col > 0).then_some((ws.ws_row, ws.ws_col))
}

/// Reads a pseudo-terminal's master without blocking a thread; EIO (every holder of the slave
/// gone) is the end of the stream.
struct PtyReader {
    fd: tokio::io::unix::AsyncFd<OwnedFd>,
}

impl PtyReader {
    fn new(master: OwnedFd) -> io::Result<PtyReader> {
        use std::os::fd::AsRawFd;
        // SAFETY: fcntl on a valid descriptor we own.
        unsafe {
            let flags = libc::fcntl(master.as_raw_fd(), libc::F_GETFL);
            if flags < 0 || libc::fcntl(master.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // SAFETY: an OwnedFd is a valid open descriptor that stays open and the same for as long
        // as the AsyncFd owns it.
        Ok(PtyReader { fd: unsafe { tokio::io::unix::AsyncFd::register(master) }.map_err(io::Error::from)? })
    }
}

impl tokio::io::AsyncRead for PtyReader {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        use std::os::fd::AsRawFd;
        use std::task::Poll;
        loop {
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            let unfilled = buf.initialize_unfilled();
            // SAFETY: read into the initialized, unfilled part of the buffer, at most its length.
            let n = unsafe { libc::read(guard.get_inner().as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len()) };
            if n >= 0 {
                buf.advance(n as usize);
                return Poll::Ready(Ok(()));
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => guard.clear_ready(),
                Some(libc::EINTR) => {}
                // The worker's side is closed for good: end of stream.
                Some(libc::EIO) => return Poll::Ready(Ok(())),
                _ => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl WorkerProc {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the worker to end and reaps it.
    pub async fn wait(&self) -> io::Result<Exit> {
        loop {
            match &self.exited {
                Exited::Pidfd(fd) => {
                    let mut ready = fd.readable().await?;
                    match self.try_reap()? {
                        Some(exit) => return Ok(exit),
                        // Readiness may be spurious.
                        None => ready.clear_ready(),
                    }
                }
                Exited::Thread(rx) => {
                    if let Some(rx) = rx.lock().await.take() {
                        let _ = rx.await;
                    }
                    if let Some(exit) = self.try_reap()? {
                        return Ok(exit);
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            }
        }
    }

    /// Reaps the worker if it has exited, under the lock that signalling takes.
    fn try_reap(&self) -> io::Result<Option<Exit>> {
        let mut reaped = self.reaped.lock().unwrap_or_else(|p| p.into_inner());
        if *reaped {
            return Err(io::Error::other("the worker was already reaped"));
        }
        // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own unreaped child (its pid is still its own) with a valid
        // siginfo pointer; WNOHANG because it may not have exited yet.
        let r = unsafe { libc::waitid(libc::P_PID, self.pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG) };
        if r != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ECHILD) {
                // Reaped by someone else: its number is not ours any more either way.
                *reaped = true;
            }
            return Err(e);
        }
        // SAFETY: after waitid, si_pid (0 when nothing has exited yet) and si_status are set.
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        if pid == 0 {
            return Ok(None);
        }
        *reaped = true;
        Ok(Some(match info.si_code {
            libc::CLD_EXITED => Exit::Code(status),
            _ => Exit::Signal(status),
        }))
    }

    /// Sends `signal` to the worker's process group while the worker is not reaped; after that
    /// its number is not ours any more and nothing is sent.
    pub fn signal_group(&self, signal: i32) -> io::Result<()> {
        let reaped = self.reaped.lock().unwrap_or_else(|p| p.into_inner());
        if *reaped {
            return Ok(());
        }
        signal_group(self.pid, signal)
    }

    /// Whether the worker has exited (it is left unreaped: its waiter reaps it).
    pub fn has_exited(&self) -> bool {
        if self.is_reaped() {
            return true;
        }
        // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own unreaped child with a valid siginfo pointer; WNOWAIT leaves
        // it unreaped, WNOHANG returns at once.
        let r = unsafe {
            libc::waitid(libc::P_PID, self.pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT)
        };
        // SAFETY: after a successful waitid, si_pid is set (0 when nothing has exited yet).
        r != 0 || unsafe { info.si_pid() } != 0
    }

    /// Kills the worker's process group and reaps it, blocking for at most `within` (for a
    /// drop, where nothing can be awaited). Whether it was reaped.
    pub fn kill_and_reap(&self, within: std::time::Duration) -> bool {
        let _ = self.signal_group(libc::SIGKILL);
        let until = std::time::Instant::now() + within;
        loop {
            match self.try_reap() {
                Ok(Some(_)) | Err(_) => return true,
                Ok(None) if std::time::Instant::now() >= until => return false,
                Ok(None) => std::thread::sleep(std::time::Duration::from_millis(1)),
            }
        }
    }

    pub fn is_reaped(&self) -> bool {
        *self.reaped.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Marks every descriptor from `first` up close-on-exec but `keep`, which is made to stay open
/// (`close_range`, Linux 5.11; an older kernel leaves them as they are). Only async-signal-safe
/// calls: it runs between fork and exec.
fn close_at_exec_from(first: libc::c_uint, keep: Option<libc::c_int>) -> io::Result<()> {
    let range = |lo: libc::c_uint, hi: libc::c_uint| {
        // SAFETY: close_range takes two descriptor numbers and flags; with CLOEXEC it closes
        // nothing now.
        unsafe { libc::syscall(libc::SYS_close_range, lo, hi, libc::CLOSE_RANGE_CLOEXEC) }
    };
    match keep.and_then(|k| libc::c_uint::try_from(k).ok()).filter(|k| *k >= first) {
        Some(k) => {
            if k > first {
                range(first, k - 1);
            }
            range(k + 1, libc::c_uint::MAX);
            // SAFETY: fcntl on a descriptor number; the worker keeps it across exec.
            if unsafe { libc::fcntl(k as libc::c_int, libc::F_SETFD, 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        None => {
            range(first, libc::c_uint::MAX);
        }
    }
    Ok(())
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is `procs` ("0" names the
/// writer). Only async-signal-safe calls: it runs between fork and exec.
fn move_self_into(procs: &CString) -> io::Result<()> {
    // SAFETY: open, write and close of a NUL-terminated path prepared before the fork.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let wrote = libc::write(fd, b"0".as_ptr().cast(), 1);
        libc::close(fd);
        if wrote != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether a child can move itself into the cgroup whose `cgroup.procs` is `procs` (creating
/// a cgroup may be allowed where moving processes into it is not): a short-lived `/bin/true`
/// tries.
pub fn probe_cgroup(procs: CString) -> io::Result<()> {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("/bin/true");
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    // SAFETY: the closure runs between fork and exec and only calls `move_self_into`
    // (async-signal-safe) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || move_self_into(&procs));
    }
    let status = cmd.status()?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!("the probe exited with {status}")))
    }
}

/// What a watchdog does once the agent is gone: SIGKILL every process group the agent told it
/// of ([`watchdog_record`]), write `1` to each `kill` file (`cgroup.kill`), wait (bounded)
/// until `events` (`cgroup.events`) says the cgroup is empty, then remove `rmdir` in order.
#[derive(Clone)]
pub struct WatchdogPlan {
    pub kill: Vec<CString>,
    pub events: Option<CString>,
    pub rmdir: Vec<CString>,
}

/// Process groups one watchdog remembers at most (the rest are not killed on the agent's death).
pub const WATCHDOG_GROUPS: usize = 4096;

/// What the agent writes on a watchdog's pipe: `pgid` to have that group killed when the agent
/// dies, `-pgid` to forget it (the group was stopped).
pub fn watchdog_record(pgid: i32, watch: bool) -> [u8; 4] {
    if watch {
        pgid.to_le_bytes()
    } else {
        pgid.wrapping_neg().to_le_bytes()
    }
}

/// Forks a watchdog that outlives the agent's death (even by SIGKILL) just long enough to carry
/// out `plan`: it waits for end-of-file on a pipe only the agent holds open. It runs in a session
/// of its own (a signal to the agent's process group does not reach it), holds no other
/// descriptor of the agent's, and runs only async-signal-safe system calls (the agent has
/// threads). Dropping the returned descriptor (or the agent dying) sets it off; the pid is the
/// watchdog's.
///
/// Every signal that can be ignored is (SIGTERM and SIGQUIT too: a worker, or a scheduler
/// signalling the whole job, must not end it without the agent's death; acting on SIGTERM
/// instead would kill the workers before the agent's own stop gives them their grace). Only
/// SIGKILL and SIGSTOP reach it: the agent watches for both ([`watchdog_state`]) and starts a
/// new one or resumes it. Not `PR_SET_PDEATHSIG`: it fires when the forking *thread* ends (a
/// runtime's blocking thread may), and the pipe already says when the whole agent is gone.
pub fn spawn_watchdog(plan: &WatchdogPlan) -> io::Result<(OwnedFd, libc::pid_t)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (read_end, write_end) = (fds[0], fds[1]);
    let devnull = c"/dev/null";
    // SAFETY: after fork the child only makes async-signal-safe system calls on memory prepared
    // before the fork (`plan`, `devnull`), never returns into Rust code of the parent's, and
    // leaves with `_exit`. The parent only closes its copy of the read end.
    match unsafe { libc::fork() } {
        -1 => {
            let e = io::Error::last_os_error();
            // SAFETY: both descriptors were just created and are owned here.
            unsafe {
                libc::close(read_end);
                libc::close(write_end);
            }
            Err(e)
        }
        0 => unsafe {
            libc::setsid();
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
            // A scheduler that signals every process of a job (Slurm's warning to a whole step
            // under proctrack/cgroup) must not end the watchdog by the way.
            libc::signal(libc::SIGUSR1, libc::SIG_IGN);
            libc::signal(libc::SIGUSR2, libc::SIG_IGN);
            for sig in [
                libc::SIGTERM,
                libc::SIGQUIT,
                libc::SIGALRM,
                libc::SIGVTALRM,
                libc::SIGPROF,
                libc::SIGTSTP,
                libc::SIGTTIN,
                libc::SIGTTOU,
                libc::SIGXCPU,
                libc::SIGXFSZ,
                libc::SIGIO,
                libc::SIGPWR,
                libc::SIGSTKFLT,
            ] {
                libc::signal(sig, libc::SIG_IGN);
            }
            // Hold nothing of the agent's (its console pipes, sockets, the store) — above all not
            // the pipe's write end, or the end-of-file would never come: only the read end, moved
            // to 10 or above, and /dev/null as 0, 1, 2.
            libc::close(write_end);
            let r = libc::fcntl(read_end, libc::F_DUPFD, 10);
            let r = if r < 0 { read_end } else { r };
            let null = libc::open(devnull.as_ptr(), libc::O_RDWR);
            for fd in 0..3 {
                if null >= 0 {
                    libc::dup2(null, fd);
                }
            }
            for (from, to) in [(3, r - 1), (r + 1, libc::c_int::MAX)] {
                if from > to {
                    continue;
                }
                let closed =
                    libc::syscall(libc::SYS_close_range, from as libc::c_uint, to as libc::c_uint, 0 as libc::c_uint);
                if closed != 0 {
                    // close_range refused (an old kernel or seccomp profile): one by one.
                    for fd in from..=to.min(65_535) {
                        libc::close(fd);
                    }
                }
            }
            // The agent's records ([`watchdog_record`]) until end-of-file: on the stack, no
            // allocation after the fork.
            let mut groups = [0i32; WATCHDOG_GROUPS];
            let mut count = 0usize;
            let mut buf = [0u8; 256];
            let mut have = 0usize;
            loop {
                let n = libc::read(r, buf[have..].as_mut_ptr().cast(), buf.len() - have);
                if n == 0 || (n < 0 && *libc::__errno_location() != libc::EINTR) {
                    break;
                }
                have += usize::try_from(n).unwrap_or(0);
                let whole = have - have % 4;
                for rec in buf[..whole].chunks_exact(4) {
                    let v = i32::from_le_bytes([rec[0], rec[1], rec[2], rec[3]]);
                    if v > 0 && count < WATCHDOG_GROUPS && !groups[..count].contains(&v) {
                        groups[count] = v;
                        count += 1;
                    } else if v < 0 {
                        if let Some(i) = groups[..count].iter().position(|g| *g == v.wrapping_neg()) {
                            groups[i] = groups[count - 1];
                            count -= 1;
                        }
                    }
                }
                buf.copy_within(whole..have, 0);
                have -= whole;
            }
            for g in &groups[..count] {
                libc::kill(-*g, libc::SIGKILL);
            }
            for k in &plan.kill {
                let fd = libc::open(k.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    libc::write(fd, b"1".as_ptr().cast(), 1);
                    libc::close(fd);
                }
            }
            // Up to 5 s for the kernel to finish the killing ("populated 0").
            for _ in 0..250 {
                let Some(events) = &plan.events else { break };
                let fd = libc::open(events.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    break;
                }
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                libc::close(fd);
                let n = usize::try_from(n).unwrap_or(0);
                if buf[..n].windows(11).any(|w| w == b"populated 0") {
                    break;
                }
                let pause = libc::timespec { tv_sec: 0, tv_nsec: 20_000_000 };
                libc::nanosleep(&pause, std::ptr::null_mut());
            }
            for d in &plan.rmdir {
                libc::rmdir(d.as_ptr());
            }
            libc::_exit(0)
        },
        child => {
            // SAFETY: the parent's copy of the read end is owned here and used no more;
            // the write end becomes an OwnedFd that closes it exactly once. Non-blocking: a
            // stopped watchdog's full pipe must never stall the agent (a record is then lost).
            unsafe {
                libc::close(read_end);
                libc::fcntl(write_end, libc::F_SETFL, libc::O_NONBLOCK);
                Ok((OwnedFd::from_raw_fd(write_end), child))
            }
        }
    }
}

/// What became of a watchdog (a child of this process).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchdogState {
    Running,
    /// Stopped by a signal (SIGSTOP, which it cannot ignore): resume it with [`resume`].
    Stopped,
    /// Dead, and reaped by this call: its pid may name another process from now on.
    Gone,
}

/// Whether the watchdog `pid` still runs; reaps it when it died. Never blocks.
pub fn watchdog_state(pid: libc::pid_t) -> WatchdogState {
    let mut status = 0;
    // SAFETY: waitpid on this process's own, unreaped child with a valid status pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG | libc::WUNTRACED) };
    if r == pid {
        if libc::WIFSTOPPED(status) {
            return WatchdogState::Stopped;
        }
        return WatchdogState::Gone;
    }
    if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
        return WatchdogState::Gone;
    }
    // A stop already reported once is not reported again: read the state as well.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    match stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()) {
        Some('T' | 't') => WatchdogState::Stopped,
        _ => WatchdogState::Running,
    }
}

/// Lets a stopped watchdog run again.
pub fn resume(pid: libc::pid_t) {
    // SAFETY: kill(2) on this process's own, unreaped child; no memory is involved.
    unsafe { libc::kill(pid, libc::SIGCONT) };
}

/// Lets every process of a worker's group run again (SIGCONT): after a stack reader that stopped
/// it was killed before it could detach cleanly.
pub fn resume_group(pgid: u32) {
    let _ = signal_group(pgid, libc::SIGCONT);
}

/// Sends `signal` to every process in the group led by `pgid`. A group that is already gone is
/// not an error.
fn signal_group(pgid: u32, signal: i32) -> io::Result<()> {
    let pgid = i32::try_from(pgid).map_err(|_| io::Error::other("process group id out of range"))?;
    // SAFETY: kill with a negative pid signals a process group; no memory is involved.
    if unsafe { libc::kill(-pgid, signal) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ESRCH) {
        Ok(())
    } else {
        Err(err)
    }
}

pub use rlaunch::contract::signal_name;

/// Makes this process the reaper of its orphaned descendants (instead of init), so that what a
/// worker leaves behind can be found among this process's children.
pub fn become_subreaper() {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes a plain integer argument.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
}

/// Children of the agent that are no orphans and no workers yet (warm workers waiting), which
/// [`kill_orphans`] must leave alone. Held while such a child is spawned and registered, so a
/// sweep never sees it unregistered.
pub fn spared() -> std::sync::MutexGuard<'static, std::collections::BTreeSet<u32>> {
    static SPARED: std::sync::Mutex<std::collections::BTreeSet<u32>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    SPARED.lock().unwrap_or_else(|p| p.into_inner())
}

/// Kills and reaps every child of this process: once a worker group is over, the only children
/// left are descendants orphaned to this subreaper.
/// Children in `keep` (workers not reaped yet) are left alone: their reaping is their waiter's.
/// Children in [`spared`] (warm workers waiting) are left too; none is added during a pass.
pub fn kill_orphans(keep: &[u32]) {
    // A killed orphan's own children become this process's next: a few passes.
    for _ in 0..8 {
        let any = {
            let spared = spared();
            let keep: Vec<u32> = keep.iter().copied().chain(spared.iter().copied()).collect();
            kill_children_once(|p| !keep.iter().any(|k| i64::from(*k) == i64::from(p)))
        };
        if !any {
            return;
        }
    }
}

/// Kills and reaps the children of this process in process group `pgid`: what a worker (the
/// group's leader, dead and reaped) left running and was orphaned to this subreaper (a data
/// loader's processes), while the group's other workers and their own children go on.
pub fn kill_orphans_in_group(pgid: u32) {
    for _ in 0..8 {
        let any = {
            // Never a warm worker or a new group's leader that got the old leader's number.
            let spared = spared();
            kill_children_once(|p| {
                i64::from(p) != i64::from(pgid)
                    && !spared.iter().any(|s| i64::from(*s) == i64::from(p))
                    && process_group_of(p) == Some(pgid)
            })
        };
        if !any {
            return;
        }
    }
}

/// The process group of `pid`, from `/proc/PID/stat`.
fn process_group_of(pid: i32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command's closing parenthesis: state, parent, process group.
    stat.rsplit_once(')')?.1.split_whitespace().nth(2)?.parse().ok()
}

/// One pass of [`kill_orphans`]: kills and reaps this process's children that `chosen` picks;
/// whether there was any.
fn kill_children_once(chosen: impl Fn(i32) -> bool) -> bool {
    let mut children = Vec::new();
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            if let Ok(list) = std::fs::read_to_string(t.path().join("children")) {
                children.extend(list.split_whitespace().filter_map(|p| p.parse::<i32>().ok()).filter(|p| chosen(*p)));
            }
        }
    }
    for &pid in &children {
        // SAFETY: these are this process's own children, not yet reaped: their pids cannot have
        // been reused.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let any = !children.is_empty();
    // Reaped as they die, looking again after 0.5 ms doubling to 10 ms, for at most 1 s.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    let mut pause = std::time::Duration::from_micros(500);
    while !children.is_empty() && std::time::Instant::now() < deadline {
        children.retain(|pid| {
            // SAFETY: waitpid on an own child with a valid status pointer.
            let mut status = 0;
            unsafe { libc::waitpid(*pid, &mut status, libc::WNOHANG) == 0 }
        });
        if !children.is_empty() {
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(10));
        }
    }
    any
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_watchdog_outlives_the_signals_a_scheduler_sends_a_whole_job_and_acts_when_set_off() {
        let dir = tempfile::tempdir().unwrap();
        let kill = dir.path().join("cgroup.kill");
        let events = dir.path().join("cgroup.events");
        std::fs::write(&kill, "").unwrap();
        std::fs::write(&events, "populated 0\n").unwrap();
        let c = |p: &std::path::Path| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        let plan = WatchdogPlan { kill: vec![c(&kill)], events: Some(c(&events)), rmdir: Vec::new() };
        let (fd, pid) = spawn_watchdog(&plan).unwrap();
        let state = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
        };
        // Its dispositions are set just after the fork: wait until they are (bounded).
        let ignored = || -> u64 {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:")).unwrap_or("0").trim().to_owned();
            u64::from_str_radix(&mask, 16).unwrap_or(0)
        };
        let sent = [libc::SIGUSR1, libc::SIGUSR2, libc::SIGINT, libc::SIGHUP, libc::SIGTERM, libc::SIGQUIT];
        let want = sent.iter().fold(0u64, |m, s| m | 1 << (s - 1));
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while ignored() & want != want {
            assert!(
                std::time::Instant::now() < until,
                "the watchdog ignores USR1, USR2, INT, HUP, TERM, QUIT: SigIgn {:x}",
                ignored()
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for sig in sent {
            // SAFETY: kill(2) on our own child.
            assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(
            matches!(state(), Some('S' | 'R')),
            "the watchdog is alive after USR1/USR2/INT/HUP/TERM/QUIT: {:?}",
            state()
        );
        assert_eq!(watchdog_state(pid), WatchdogState::Running);
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while watchdog_state(pid) != WatchdogState::Stopped {
            assert!(std::time::Instant::now() < until, "a SIGSTOP is seen");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        resume(pid);
        while watchdog_state(pid) != WatchdogState::Running {
            assert!(std::time::Instant::now() < until, "resumed");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(std::fs::read_to_string(&kill).unwrap(), "", "not set off yet");
        drop(fd);
        let mut status = 0;
        // SAFETY: waitpid on our own child, with a valid status pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status}");
        assert_eq!(std::fs::read_to_string(&kill).unwrap(), "1", "set off: it wrote cgroup.kill");
    }

    use super::*;

    #[tokio::test]
    async fn workers_are_awaited_and_reaped_with_and_without_pidfds() {
        for pidfd in [true, false] {
            let mut cmd = std::process::Command::new("/bin/sh");
            cmd.args(["-c", "exit 3"]);
            let proc = spawn_worker_with(cmd, Placement::default(), Terminal::default(), pidfd).expect("spawn").proc;
            let exit = tokio::time::timeout(std::time::Duration::from_secs(10), proc.wait()).await.expect("in time");
            assert_eq!(exit.expect("reaped"), Exit::Code(3), "pidfd: {pidfd}");
            assert!(proc.is_reaped());
            proc.signal_group(libc::SIGKILL).expect("a reaped worker's group is never signalled: no error");
            let mut cmd = std::process::Command::new("/bin/sh");
            cmd.args(["-c", "kill -9 $$"]);
            let proc = spawn_worker_with(cmd, Placement::default(), Terminal::default(), pidfd).expect("spawn").proc;
            let exit = tokio::time::timeout(std::time::Duration::from_secs(10), proc.wait()).await.expect("in time");
            assert_eq!(exit.expect("reaped"), Exit::Signal(libc::SIGKILL), "pidfd: {pidfd}");
        }
    }
}

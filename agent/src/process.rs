//! Starting worker processes so that none outlives its agent, and signalling their process
//! groups. The only module of the agent with `unsafe`.

use std::ffi::CString;
use std::io;

use rlaunch::contract::Exit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Stdio;

/// A worker process held through a pidfd: it is reaped here (never by anyone else), and its
/// process group is signalled only while it is not reaped — while the leader is at most a
/// zombie its pid, which is the group's id, cannot name another process or group.
pub struct WorkerProc {
    pid: u32,
    pidfd: tokio::io::unix::AsyncFd<OwnedFd>,
    reaped: std::sync::Mutex<bool>,
}

/// Spawns `cmd` in a new process group of its own with `PR_SET_PDEATHSIG(SIGKILL)`, stdin from
/// /dev/null, stdout and stderr piped (returned as async readers).
///
/// The parent-death signal fires when the *thread* that forked exits, so this must be called
/// from a thread that lives as long as the agent (a tokio worker thread, not a blocking-pool
/// thread).
///
/// With `cgroup_procs` (a cgroup's `cgroup.procs` file), the worker moves itself into that
/// cgroup before it runs anything, so every process it ever starts is in it too.
pub fn spawn_worker(
    mut cmd: std::process::Command,
    cgroup_procs: Option<CString>,
) -> io::Result<(WorkerProc, tokio::net::unix::pipe::Receiver, tokio::net::unix::pipe::Receiver)> {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid is async-signal-safe and has no preconditions.
    let agent_pid = unsafe { libc::getpid() };
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    // SAFETY: the closure runs between fork and exec and only calls async-signal-safe functions
    // (prctl, getppid, open, write, close) on memory prepared before the fork; it allocates
    // nothing and touches no locks.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(procs) = &cgroup_procs {
                // "0" moves the writing process.
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
    let pid = child.id();
    // The child is not reaped yet (nobody waits on it but us, later): its pid is still its own.
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0 as libc::c_uint) };
    if raw < 0 {
        let e = io::Error::last_os_error();
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    // SAFETY: the descriptor was just returned by pidfd_open and is owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as libc::c_int) };
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    // Dropping std's `Child` neither waits nor kills: the pidfd is how the worker is awaited.
    drop(child);
    let out = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(stdout))?;
    let err = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(stderr))?;
    // SAFETY: an OwnedFd is a valid open descriptor that stays open and the same for as long as
    // the AsyncFd owns it.
    let pidfd = unsafe { tokio::io::unix::AsyncFd::register(pidfd) }.map_err(io::Error::from)?;
    let proc = WorkerProc { pid, pidfd, reaped: std::sync::Mutex::new(false) };
    Ok((proc, out, err))
}

impl WorkerProc {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for the worker to end and reaps it.
    pub async fn wait(&self) -> io::Result<Exit> {
        loop {
            let mut ready = self.pidfd.readable().await?;
            let mut reaped = self.reaped.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waitid on our own pidfd (P_PIDFD = 3) with a valid siginfo pointer; WNOHANG
            // because readiness may be spurious.
            let r = unsafe {
                libc::waitid(
                    3 as libc::idtype_t,
                    self.pidfd.get_ref().as_raw_fd() as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOHANG,
                )
            };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: after waitid, si_pid (0 when nothing has exited yet) and si_status are set.
            let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
            if pid == 0 {
                ready.clear_ready();
                continue;
            }
            *reaped = true;
            return Ok(match info.si_code {
                libc::CLD_EXITED => Exit::Code(status),
                _ => Exit::Signal(status),
            });
        }
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

    pub fn is_reaped(&self) -> bool {
        *self.reaped.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What a watchdog does once the agent is gone: write `1` to each `kill` file (`cgroup.kill`),
/// wait (bounded) until `events` (`cgroup.events`) says the cgroup is empty, then remove `rmdir`
/// in order.
pub struct WatchdogPlan {
    pub kill: Vec<CString>,
    pub events: CString,
    pub rmdir: Vec<CString>,
}

/// Forks a watchdog that outlives the agent's death (even by SIGKILL) just long enough to carry
/// out `plan`: it waits for end-of-file on a pipe only the agent holds open. It runs in a session
/// of its own (a signal to the agent's process group does not reach it), holds no other
/// descriptor of the agent's, and runs only async-signal-safe system calls (the agent has
/// threads). Dropping the returned descriptor (or the agent dying) sets it off.
pub fn spawn_watchdog(plan: &WatchdogPlan) -> io::Result<OwnedFd> {
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
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            // Hold nothing of the agent's (its console pipes, sockets, the store): only the read
            // end, moved to 3, and /dev/null as 0, 1, 2.
            let null = libc::open(devnull.as_ptr(), libc::O_RDWR);
            if read_end != 3 {
                libc::dup2(read_end, 3);
            }
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            libc::syscall(libc::SYS_close_range, 4 as libc::c_uint, libc::c_uint::MAX, 0 as libc::c_uint);
            let mut byte = 0u8;
            loop {
                let n = libc::read(3, (&mut byte as *mut u8).cast(), 1);
                if n == 0 || (n < 0 && *libc::__errno_location() != libc::EINTR) {
                    break;
                }
            }
            for k in &plan.kill {
                let fd = libc::open(k.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    libc::write(fd, b"1".as_ptr().cast(), 1);
                    libc::close(fd);
                }
            }
            // Up to 5 s for the kernel to finish the killing ("populated 0").
            let mut buf = [0u8; 256];
            for _ in 0..250 {
                let fd = libc::open(plan.events.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
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
        _child => {
            // SAFETY: the parent's copy of the read end is owned here and used no more;
            // the write end becomes an OwnedFd that closes it exactly once.
            unsafe {
                libc::close(read_end);
                Ok(OwnedFd::from_raw_fd(write_end))
            }
        }
    }
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

/// Kills and reaps every child of this process: once a worker group is over, the only children
/// left are descendants orphaned to this subreaper.
pub fn kill_orphans() {
    // A killed orphan's own children become this process's next: a few passes.
    for _ in 0..8 {
        if !kill_children_once() {
            return;
        }
    }
}

/// One pass of [`kill_orphans`]; whether there was any child.
fn kill_children_once() -> bool {
    let mut children = Vec::new();
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            if let Ok(list) = std::fs::read_to_string(t.path().join("children")) {
                children.extend(list.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
            }
        }
    }
    for &pid in &children {
        // SAFETY: these are this process's own children, not yet reaped: their pids cannot have
        // been reused.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let any = !children.is_empty();
    for pid in children {
        for _ in 0..100 {
            // SAFETY: waitpid on an own child with a valid status pointer.
            let mut status = 0;
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r != 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    any
}

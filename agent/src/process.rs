//! Starting worker processes so that none outlives its agent, and signalling their process
//! groups. The only module of the agent with `unsafe`.

use std::io;
use std::process::Stdio;

use tokio::process::{Child, Command};

/// Spawns `cmd` in a new process group of its own with `PR_SET_PDEATHSIG(SIGKILL)`, stdout and
/// stderr piped.
///
/// The parent-death signal fires when the *thread* that forked exits, so this must be called
/// from a thread that lives as long as the agent (a tokio worker thread, not a blocking-pool
/// thread).
pub fn spawn_worker(mut cmd: Command) -> io::Result<Child> {
    // SAFETY: getpid is async-signal-safe and has no preconditions.
    let agent_pid = unsafe { libc::getpid() };
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0).kill_on_drop(false);
    // SAFETY: the closure runs between fork and exec and only calls async-signal-safe functions
    // (prctl, getppid); it allocates nothing and touches no locks.
    unsafe {
        cmd.pre_exec(move || {
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
    cmd.spawn()
}

/// Sends `signal` to every process in the group led by `pgid`. A group that is already gone is
/// not an error.
pub fn signal_group(pgid: u32, signal: i32) -> io::Result<()> {
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

/// Whether any process of the group led by `pgid` is still alive (zombies included until reaped).
pub fn group_alive(pgid: u32) -> bool {
    let Ok(pgid) = i32::try_from(pgid) else { return false };
    // SAFETY: signal 0 only checks for existence and permission.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

pub use rlaunch::contract::signal_name;

//! Containment of each worker's whole process tree: what it starts — a child in its process
//! group, one that called `setsid`, a double-forked daemon, a DataLoader pool — ends with it.
//!
//! The strongest mechanism the node allows, chosen once at start and logged:
//! - **cgroup v2** (root, or a delegated subtree under systemd or in a container): a cgroup per
//!   job under the agent's own, one per local rank inside it. A worker moves itself into its
//!   rank's cgroup before it runs anything, so all it ever starts is there too; every stop ends
//!   with `cgroup.kill` on it. A watchdog process, forked at start in a session of its own, kills
//!   the job's cgroup if the agent dies, even by SIGKILL. It ignores every signal it can; the
//!   agent checks it every [`WATCHDOG_CHECK`] and starts a new one if it was killed, or resumes
//!   it if it was stopped, so a worker must kill both within that time to escape (docs/src/host.md
//!   says so: a worker of the agent's user can always signal both).
//! - **process groups** otherwise: each worker leads its own group, signalled as a whole; the
//!   agent is a child subreaper, so orphaned descendants become its children and are killed at
//!   every stop. A watchdog of the same kind is told each worker's group and kills those groups
//!   if the agent dies. After a SIGKILL of the agent, descendants that left the worker's process
//!   group (setsid) may survive: docs/src/host.md says so.

use std::ffi::CString;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{info, warn};

use crate::process::{spawn_watchdog, watchdog_state, WatchdogPlan, WatchdogState};

/// How often the agent checks its watchdog is alive and running.
pub const WATCHDOG_CHECK: Duration = Duration::from_millis(50);

/// `RLAUNCH_CONTAINMENT=process-group` forces the weaker mechanism (for tests and for nodes
/// where the operator wants no cgroups touched).
pub const CONTAINMENT_ENV: &str = "RLAUNCH_CONTAINMENT";

/// How this agent contains its workers.
pub enum Containment {
    Cgroup(CgroupJob),
    /// With the watchdog that kills the workers' groups if the agent dies (none if it could
    /// not be started).
    ProcessGroups(Option<Guard>),
}

/// A cgroup v2 directory per job, one per local rank inside it, and the watchdog.
pub struct CgroupJob {
    dir: PathBuf,
    ranks: u32,
    guard: Option<Guard>,
}

/// A watchdog kept running: started again when killed, resumed when stopped, told the process
/// groups to kill. Dropping it sets the watchdog off.
pub struct Guard {
    /// Shared with the checker, which replaces it.
    watchdog: Arc<Mutex<Watchdog>>,
    /// Dropped to stop the checker: it wakes at once (a job's end never waits out a period).
    stop_checking: Option<std::sync::mpsc::Sender<()>>,
    checker: Option<std::thread::JoinHandle<()>>,
}

/// The running watchdog: its pipe's write end (closing it sets it off), its pid, and the groups
/// it was told of (told again to a replacement).
struct Watchdog {
    pipe: std::fs::File,
    pid: libc::pid_t,
    groups: Vec<i32>,
}

impl Guard {
    fn start(plan: WatchdogPlan) -> std::io::Result<Guard> {
        let (pipe, pid) = spawn_watchdog(&plan)?;
        let watchdog = Arc::new(Mutex::new(Watchdog { pipe: pipe.into(), pid, groups: Vec::new() }));
        let (stop_checking, stop) = std::sync::mpsc::channel();
        let checker = {
            let watchdog = watchdog.clone();
            std::thread::Builder::new()
                .name("rlaunch-watchdog-check".into())
                .spawn(move || check_watchdog(&watchdog, &stop, &plan))?
        };
        Ok(Guard { watchdog, stop_checking: Some(stop_checking), checker: Some(checker) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Watchdog> {
        self.watchdog.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The watchdog's pid now.
    pub fn pid(&self) -> u32 {
        self.lock().pid.unsigned_abs()
    }

    /// Has the process group `pgid` killed if the agent dies (`watch`), or no longer.
    pub fn tell(&self, pgid: u32, watch: bool) {
        let Ok(pgid) = i32::try_from(pgid) else { return };
        let mut w = self.lock();
        if watch {
            w.groups.push(pgid);
        } else {
            w.groups.retain(|g| *g != pgid);
        }
        if let Err(e) = w.pipe.write_all(&crate::process::watchdog_record(pgid, watch)) {
            warn!(pgid, error = %e, "cannot tell the containment watchdog of a worker's group");
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        drop(self.stop_checking.take());
        if let Some(t) = self.checker.take() {
            let _ = t.join();
        }
        // The last holder of the watchdog is gone with this: its pipe closes, it acts.
    }
}

impl Containment {
    /// Picks the strongest mechanism available for a job of `ranks` workers per node.
    pub fn detect(ranks: u32, agent_env_choice: Option<&str>) -> Containment {
        if agent_env_choice == Some("process-group") {
            info!(mechanism = "process groups and a child subreaper (asked for)", "containment");
            return Containment::process_groups();
        }
        match CgroupJob::create(ranks) {
            Ok(job) => {
                info!(mechanism = "cgroup v2", cgroup = %job.dir.display(), "containment: every worker's process tree is killed with its cgroup");
                Containment::Cgroup(job)
            }
            Err(why) => {
                warn!(
                    reason = %why,
                    "containment: process groups and a child subreaper (no writable cgroup v2); descendants that call setsid may outlive a SIGKILL of the agent"
                );
                Containment::process_groups()
            }
        }
    }

    fn process_groups() -> Containment {
        crate::process::become_subreaper();
        let plan = WatchdogPlan { kill: Vec::new(), events: None, rmdir: Vec::new() };
        match Guard::start(plan) {
            Ok(g) => Containment::ProcessGroups(Some(g)),
            Err(e) => {
                warn!(error = %e, "containment: no watchdog; a SIGKILL of the agent leaves its workers' children");
                Containment::ProcessGroups(None)
            }
        }
    }

    /// Has worker group `pgid` killed if the agent dies (`watch`), or no longer (it was
    /// stopped: its number may be reused once the group is empty). Only process groups need
    /// it: a cgroup holds the whole tree.
    pub fn watch_group(&self, pgid: u32, watch: bool) {
        if let Containment::ProcessGroups(Some(g)) = self {
            g.tell(pgid, watch);
        }
    }

    pub fn describe(&self) -> &'static str {
        match self {
            Containment::Cgroup(_) => "cgroup v2",
            Containment::ProcessGroups(_) => "process groups",
        }
    }

    /// The `cgroup.procs` file a worker of `local_rank` moves itself into.
    pub fn procs_file(&self, local_rank: u32) -> Option<CString> {
        match self {
            Containment::Cgroup(job) => cstring(&job.rank_dir(local_rank).join("cgroup.procs")),
            Containment::ProcessGroups(_) => None,
        }
    }

    /// The `cgroup.procs` file a warm worker of `local_rank` starts in: beside the rank's, so a
    /// stop of the rank's workers leaves it, and the job's end or the agent's death ends it.
    pub fn warm_procs_file(&self, local_rank: u32) -> Option<CString> {
        match self {
            Containment::Cgroup(job) => cstring(&job.warm_dir(local_rank).join("cgroup.procs")),
            Containment::ProcessGroups(_) => None,
        }
    }

    /// Moves `local_rank`'s warm worker, with whatever it started as it imported, into the
    /// rank's cgroup as it becomes that rank's worker. Nothing to do with process groups: it
    /// leads its own.
    pub fn adopt(&self, local_rank: u32) -> std::io::Result<()> {
        let Containment::Cgroup(job) = self else { return Ok(()) };
        let procs = std::fs::read_to_string(job.warm_dir(local_rank).join("cgroup.procs"))?;
        let into = job.rank_dir(local_rank).join("cgroup.procs");
        for pid in procs.split_whitespace() {
            match std::fs::write(&into, pid) {
                Ok(()) => {}
                // Gone meanwhile.
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Kills every process left of these ranks' trees and waits (bounded) until none is left.
    /// Process groups: whatever was orphaned to this agent is killed instead, but for `keep`
    /// (workers not reaped yet).
    pub async fn kill_rest(&self, local_ranks: &[u32], keep: &[u32]) {
        match self {
            Containment::Cgroup(job) => job.kill(local_ranks).await,
            Containment::ProcessGroups(guard) => {
                // The watchdog is a child of the agent too: never one of the orphans.
                let mut keep = keep.to_vec();
                keep.extend(guard.as_ref().map(Guard::pid));
                let _ = tokio::task::spawn_blocking(move || crate::process::kill_orphans(&keep)).await;
            }
        }
    }
}

impl CgroupJob {
    fn create(ranks: u32) -> Result<CgroupJob, String> {
        let own = own_cgroup_dir().ok_or("no cgroup v2 hierarchy holds this process")?;
        let dir = own.join(format!("rlaunch-{}-{:08x}", std::process::id(), crate::random::rand_u32()));
        std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let remove_all = |upto: u32| {
            for r in 0..upto {
                let _ = std::fs::remove_dir(dir.join(format!("rank{r}")));
                let _ = std::fs::remove_dir(dir.join(format!("warm{r}")));
            }
            let _ = std::fs::remove_dir(&dir);
        };
        if !dir.join("cgroup.kill").exists() {
            remove_all(0);
            return Err("the kernel has no cgroup.kill (before 5.14)".into());
        }
        for r in 0..ranks {
            let made = std::fs::create_dir(dir.join(format!("rank{r}")))
                .and_then(|()| std::fs::create_dir(dir.join(format!("warm{r}"))));
            if let Err(e) = made {
                remove_all(r + 1);
                return Err(format!("cannot create a cgroup per rank: {e}"));
            }
        }
        let probe = cstring(&dir.join("rank0/cgroup.procs")).ok_or("cgroup path with a NUL byte")?;
        if let Err(e) = crate::process::probe_cgroup(probe) {
            remove_all(ranks);
            return Err(format!("cannot move processes into {}: {e}", dir.display()));
        }
        let plan = WatchdogPlan {
            kill: vec![cstring(&dir.join("cgroup.kill")).ok_or("cgroup path with a NUL byte")?],
            events: Some(cstring(&dir.join("cgroup.events")).ok_or("cgroup path with a NUL byte")?),
            rmdir: (0..ranks)
                .flat_map(|r| [dir.join(format!("rank{r}")), dir.join(format!("warm{r}"))])
                .chain(std::iter::once(dir.clone()))
                .map(|p| cstring(&p).ok_or("cgroup path with a NUL byte"))
                .collect::<Result<_, _>>()?,
        };
        let guard = Guard::start(plan).map_err(|e| {
            remove_all(ranks);
            format!("cannot start the watchdog: {e}")
        })?;
        Ok(CgroupJob { dir, ranks, guard: Some(guard) })
    }

    fn rank_dir(&self, local_rank: u32) -> PathBuf {
        self.dir.join(format!("rank{local_rank}"))
    }

    fn warm_dir(&self, local_rank: u32) -> PathBuf {
        self.dir.join(format!("warm{local_rank}"))
    }

    /// Kills these ranks' cgroups all at once, then waits (bounded) until every one is empty,
    /// looking again after 0.5 ms, doubling to 10 ms (a cgroup empties a few ms after its kill:
    /// a fixed 10 ms step cost every restart that much per rank).
    async fn kill(&self, local_ranks: &[u32]) {
        let mut left: Vec<PathBuf> = Vec::new();
        for r in local_ranks {
            let dir = self.rank_dir(*r);
            if !populated(&dir) {
                continue;
            }
            match std::fs::write(dir.join("cgroup.kill"), "1") {
                Ok(()) => left.push(dir),
                Err(e) => warn!(cgroup = %dir.display(), error = %e, "cannot kill the worker's cgroup"),
            }
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let mut pause = Duration::from_micros(500);
        loop {
            left.retain(|d| populated(d));
            if left.is_empty() {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                for d in &left {
                    warn!(cgroup = %d.display(), "processes of a killed cgroup are still there after 5 s");
                }
                return;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }
}

/// Until `stop`: every [`WATCHDOG_CHECK`], resumes a stopped watchdog and replaces a dead one
/// (a worker of the agent's user may signal it; SIGKILL and SIGSTOP cannot be ignored).
fn check_watchdog(watchdog: &Mutex<Watchdog>, stop: &std::sync::mpsc::Receiver<()>, plan: &WatchdogPlan) {
    // Every period until the guard goes (its sender dropped: the wait ends at once).
    while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(WATCHDOG_CHECK) {
        let mut w = watchdog.lock().unwrap_or_else(|p| p.into_inner());
        match watchdog_state(w.pid) {
            WatchdogState::Running => {}
            WatchdogState::Stopped => {
                warn!(pid = w.pid, "the containment watchdog was stopped; resuming it");
                crate::process::resume(w.pid);
            }
            WatchdogState::Gone => match spawn_watchdog(plan) {
                Ok((pipe, pid)) => {
                    warn!(old = w.pid, new = pid, "the containment watchdog was killed; started a new one");
                    w.pid = pid;
                    w.pipe = pipe.into();
                    let records: Vec<u8> =
                        w.groups.iter().flat_map(|g| crate::process::watchdog_record(*g, true)).collect();
                    if let Err(e) = w.pipe.write_all(&records) {
                        warn!(error = %e, "cannot tell the new containment watchdog of the workers' groups");
                    }
                }
                Err(e) => warn!(error = %e, "the containment watchdog was killed and cannot be started again"),
            },
        }
    }
}

impl Drop for CgroupJob {
    fn drop(&mut self) {
        // No replacement watchdog from here on; this one is set off at the end.
        let _guard = self.guard.take();
        // The workers are gone by now; kill whatever may be left, then remove the cgroups. The
        // watchdog, its pipe closed with this drop, finds nothing more to do.
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        for _ in 0..100 {
            if !populated(&self.dir) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for r in 0..self.ranks {
            let _ = std::fs::remove_dir(self.rank_dir(r));
            let _ = std::fs::remove_dir(self.warm_dir(r));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.events")).map(|e| e.lines().any(|l| l == "populated 1")).unwrap_or(false)
}

fn cstring(p: &Path) -> Option<CString> {
    CString::new(p.as_os_str().as_encoded_bytes()).ok()
}

/// The directory of this process's cgroup in the cgroup v2 hierarchy, if one is mounted.
fn own_cgroup_dir() -> Option<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?.trim().trim_start_matches('/').to_owned();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // `id parent major:minor root mountpoint options … - fstype source options`
    let mount = mounts.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        left.split_whitespace().nth(4).map(PathBuf::from)
    })?;
    Some(if rel.is_empty() { mount } else { mount.join(rel) })
}

//! rlaunch under a real Slurm: each test brings up its own cluster inside a temporary directory —
//! munged, slurmctld in the root namespace on the bridge address, one slurmd per
//! network-namespace host (see `integration_tests::netns`) — and submits
//! `examples/slurm/train.sbatch` with `sbatch`, its `srun rlaunch` line pointed at the built
//! `rlaunch` and a looping worker, with no rendezvous flag: endpoint, run id and node count come
//! from Slurm. Tested: a 2-node job forms, re-forms when a node's link is cut and completes;
//! `scancel --signal=USR1` (the delivery of `#SBATCH --signal=USR1@N`) is relayed to every worker
//! and the job goes on, or stops it with `--signals-to-handle …,SIGUSR1`; `scancel` and the time
//! limit stop the job gracefully (rlaunch exits 143) with nothing of it left on any host.
//!
//! Slurm signals a step's process group (`ProctrackType=proctrack/pgid`): rlaunch, not its
//! workers, which run in sessions of their own, so what the workers get is what rlaunch relays.
//!
//! Needs root, iproute2, util-linux (`nsenter`, `unshare`) and Slurm (tested with 22.05) with munge
//! (`slurmctld`, `slurmd`, `sbatch`, `srun`, `scontrol`, `scancel`, `sinfo`, `munged`), which
//! `scripts/install-deps.sh` installs. Run after `cargo build --workspace --bins --examples`:
//! `cargo test -p integration-tests --test slurm`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use integration_tests::netns::{formed, now_unix_f64, starts, write_script, Cluster, Host, Proc, Start};
use integration_tests::{
    bin, complete_text, pid_alive, repo_root, run_deadline, stderr_of, stdout_of, tempdir, wait_until, which,
};

/// Heartbeats every 0.5 s, a node is lost after 2 s without one (as in multinode.rs).
const TTL_S: f64 = 2.0;
const CONF: &str = "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=30";
/// Node loss must be noticed and the survivors running again within the TTL plus this.
const RECOVERY_SLACK_S: f64 = 5.0;
const FORM: Duration = Duration::from_secs(30);
/// Slurm's grace between a job's SIGTERM and its SIGKILL (`KillWait`). A stopped job must be
/// gone well before it, so that it was rlaunch, not Slurm's SIGKILL, that ended it.
const KILL_WAIT_S: u64 = 30;
const GONE: Duration = Duration::from_secs(10);
const CLIENT_DEADLINE: Duration = Duration::from_secs(20);

/// A program this test runs, by absolute path (the daemons live in /usr/sbin, which a user's PATH
/// may lack); a loud failure when it is not installed.
fn program(name: &str) -> PathBuf {
    which(name)
        .or_else(|| ["/usr/sbin", "/sbin"].iter().map(|d| Path::new(d).join(name)).find(|p| p.is_file()))
        .unwrap_or_else(|| {
            panic!(
                "`{name}` is not installed: scripts/install-deps.sh installs it (Slurm's slurmctld, slurmd and \
                 slurm-client, munge, iproute2)"
            )
        })
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// `s` as one word for the shell.
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `cmd` with `hosts` bind-mounted on /etc/hosts and `hostname` as its host name, in a mount and
/// UTS namespace of its own (the machine's /etc/hosts and host name are untouched); in network
/// namespace `netns` if given. `nsenter` rather than `ip netns exec`, which mounts a /sys of its
/// own and so hides the cgroup hierarchy that slurmd insists on finding.
fn isolated(netns: Option<&str>, hostname: &str, hosts: &Path, cmd: &[&str]) -> Command {
    let mut c = match netns {
        Some(ns) => {
            let mut c = Command::new(program("nsenter"));
            c.arg(format!("--net=/run/netns/{ns}")).arg(program("unshare"));
            c
        }
        None => Command::new(program("unshare")),
    };
    c.args(["--uts", "--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(r#"mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@""#)
        .arg(hosts)
        .arg(hostname)
        .args(cmd);
    c
}

/// A daemon: started by `cmd`, SIGKILLed by the kernel should the test's thread end without
/// dropping it (the test process killed), so that none outlives the test.
fn daemon(mut cmd: Command, name: &str, log: &Path) -> Proc {
    use std::os::unix::process::CommandExt;
    // SAFETY: only prctl, which is async-signal-safe, runs between fork and exec; the setting is
    // kept across the execs of nsenter, unshare and sh (none is set-user-ID).
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Proc::spawn(cmd, name, log)
}

/// A Slurm cluster on the hosts of a [`Cluster`]: munged, slurmctld (root namespace, host name
/// `ctl`), one slurmd per host, each host's name resolving everywhere. Dropping it (also when the
/// test panics) kills the daemons, then every process left in the hosts, then removes the
/// directory; a failing test prints the daemons' logs, the jobs' output and rlaunch's logs.
struct Slurm {
    /// Everything of this cluster and its jobs: slurm.conf, munge key, state, spool, logs, the
    /// batch scripts and the workers' event log.
    dir: PathBuf,
    conf: PathBuf,
    daemons: Vec<Proc>,
    cluster: Cluster,
    _tmp: tempfile::TempDir,
}

impl Slurm {
    fn start(nodes: usize) -> Slurm {
        for p in ["munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo"] {
            program(p);
        }
        let cluster = Cluster::new(nodes);
        let tmp = tempdir();
        let dir = tmp.path().to_path_buf();
        let conf = dir.join("slurm.conf");
        let mut slurm = Slurm { dir, conf, daemons: Vec::new(), cluster, _tmp: tmp };
        slurm.write_config();
        slurm.start_munged();
        slurm.start_slurmctld();
        slurm.start_slurmds();
        slurm
    }

    fn host(&self, i: usize) -> &Host {
        self.cluster.host(i)
    }

    fn node_names(&self) -> Vec<String> {
        self.cluster.hosts().iter().map(|h| h.name.clone()).collect()
    }

    fn write_config(&self) {
        let d = &self.dir;
        for sub in ["state", "spool"] {
            std::fs::create_dir(d.join(sub)).expect("create a Slurm directory");
        }
        let mut hosts = format!("127.0.0.1 localhost\n{} ctl\n", self.cluster.root_ip());
        let mut nodes = String::new();
        for h in self.cluster.hosts() {
            std::fs::create_dir(d.join("spool").join(&h.name)).expect("create a slurmd spool directory");
            hosts += &format!("{} {}\n", h.ip, h.name);
            nodes += &format!("NodeName={} NodeAddr={} CPUs=1 State=UNKNOWN\n", h.name, h.ip);
        }
        std::fs::write(d.join("hosts"), hosts).expect("write the hosts file");
        let key_path = d.join("munge.key");
        std::fs::write(&key_path, random_bytes(1024)).expect("write the munge key");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o400)).expect("chmod the munge key");
        let dir = path_str(d);
        let conf = format!(
            "ClusterName=rltest\n\
             SlurmctldHost=ctl({root_ip})\n\
             SlurmctldPort={ctl_port}\n\
             SlurmdPort=6818\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             AuthType=auth/munge\n\
             CredType=cred/munge\n\
             AuthInfo=socket={dir}/munge.sock\n\
             StateSaveLocation={dir}/state\n\
             SlurmdSpoolDir={dir}/spool/%n\n\
             SlurmctldPidFile={dir}/slurmctld.pid\n\
             SlurmdPidFile={dir}/slurmd-%n.pid\n\
             SlurmdLogFile={dir}/slurmd-%n.log\n\
             SlurmctldDebug=info\n\
             SlurmdDebug=verbose\n\
             MailProg=/bin/true\n\
             ProctrackType=proctrack/pgid\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             JobCompType=jobcomp/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\n\
             MpiDefault=none\n\
             SwitchType=switch/none\n\
             ReturnToService=2\n\
             SlurmdTimeout=300\n\
             KillWait={KILL_WAIT_S}\n\
             InactiveLimit=0\n\
             MinJobAge=600\n\
             {nodes}\
             PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP\n",
            root_ip = self.cluster.root_ip(),
            ctl_port = self.cluster.free_root_port(),
            names = self.node_names().join(","),
        );
        std::fs::write(&self.conf, conf).expect("write slurm.conf");
    }

    fn start_munged(&mut self) {
        let d = &self.dir;
        let mut cmd = Command::new(program("munged"));
        cmd.arg("--foreground")
            .arg("--force")
            .arg(format!("--key-file={}", d.join("munge.key").display()))
            .arg(format!("--socket={}", d.join("munge.sock").display()))
            .arg(format!("--pid-file={}", d.join("munged.pid").display()))
            .arg(format!("--seed-file={}", d.join("munged.seed").display()))
            .arg(format!("--log-file={}", d.join("munged.log").display()));
        self.daemons.push(daemon(cmd, "munged", &d.join("munged.out")));
        let socket = d.join("munge.sock");
        self.wait_up("munged to answer", Duration::from_secs(10), |_| {
            let mut munge = Command::new(program("munge"));
            munge.arg("--socket").arg(&socket).arg("--no-input");
            socket.exists() && run_deadline(&mut munge, Duration::from_secs(5)).status.success()
        });
    }

    fn start_slurmctld(&mut self) {
        let slurmctld = program("slurmctld");
        let cmd = isolated(
            None,
            "ctl",
            &self.dir.join("hosts"),
            &[path_str(&slurmctld), "-D", "-i", "-f", path_str(&self.conf)],
        );
        self.daemons.push(daemon(cmd, "slurmctld", &self.dir.join("slurmctld.out")));
        self.wait_up("slurmctld to answer `scontrol ping`", Duration::from_secs(20), |s| {
            stdout_of(&s.client_output("scontrol", &["ping"])).contains("is UP")
        });
    }

    fn start_slurmds(&mut self) {
        let slurmd = program("slurmd");
        for h in self.cluster.hosts() {
            let cmd = isolated(
                Some(&h.ns),
                &h.name,
                &self.dir.join("hosts"),
                &[path_str(&slurmd), "-D", "-N", &h.name, "-f", path_str(&self.conf)],
            );
            let log = self.dir.join(format!("slurmd-{}.out", h.name));
            self.daemons.push(daemon(cmd, &format!("slurmd on host {}", h.name), &log));
        }
        let names = self.node_names();
        self.wait_up("every slurmd to register (its node idle)", Duration::from_secs(30), |s| {
            let out = stdout_of(&s.client_output("sinfo", &["--noheader", "--Node", "--format=%N %T"]));
            names.iter().all(|n| out.lines().any(|l| l.trim() == format!("{n} idle")))
        });
    }

    /// Polls `cond` until it holds; panics if a daemon exits meanwhile or after `deadline` (the
    /// daemons' logs are printed as they are dropped).
    fn wait_up(&mut self, what: &str, deadline: Duration, cond: impl Fn(&Slurm) -> bool) {
        let start = Instant::now();
        loop {
            if cond(self) {
                return;
            }
            for d in &mut self.daemons {
                if let Some(status) = d.try_status() {
                    panic!("{} exited ({status}) while waiting for {what}", d.name);
                }
            }
            assert!(start.elapsed() < deadline, "timed out after {deadline:?} waiting for {what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A Slurm client command on this cluster (from the root namespace), with none of the
    /// caller's own Slurm or rlaunch variables.
    fn client(&self, name: &str) -> Command {
        let mut c = Command::new(program(name));
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if ["SLURM_", "SBATCH_", "SRUN_", "PET_", "RLAUNCH_"].iter().any(|p| k.starts_with(p)) {
                c.env_remove(&*k);
            }
        }
        c.env("SLURM_CONF", &self.conf);
        c
    }

    fn client_output(&self, name: &str, args: &[&str]) -> Output {
        run_deadline(self.client(name).args(args), CLIENT_DEADLINE)
    }

    /// Runs a client command that must succeed; its stdout.
    fn client_ok(&self, name: &str, args: &[&str]) -> String {
        let out = self.client_output(name, args);
        assert!(out.status.success(), "`{name} {}` failed ({}): {}", args.join(" "), out.status, stderr_of(&out));
        stdout_of(&out)
    }

    /// `examples/slurm/train.sbatch` with its `srun rlaunch … train.py` line pointed at the built
    /// rlaunch (its output in `rlaunch-<node>.log`), `rlaunch_flags` added, and `program` (else
    /// the looping worker) in place of train.py.
    fn batch_script(&self, rlaunch_flags: &[&str], program: Option<&[&str]>) -> PathBuf {
        let example = std::fs::read_to_string(repo_root().join("examples/slurm/train.sbatch"))
            .expect("read examples/slurm/train.sbatch");
        let sruns: Vec<&str> = example.lines().filter(|l| l.starts_with("srun ")).collect();
        assert_eq!(sruns.len(), 1, "the example has one srun line: {sruns:?}");
        let (srun, flags) = sruns[0]
            .split_once(" rlaunch ")
            .and_then(|(srun, rest)| Some((srun, rest.strip_suffix(" train.py")?)))
            .unwrap_or_else(|| {
                panic!("the example's srun line is `srun [OPTIONS] rlaunch FLAGS train.py`: {}", sruns[0])
            });
        assert!(!flags.contains("--rdzv"), "the example gives no rendezvous flag: {flags}");
        let dir = quoted(path_str(&self.dir));
        let worker = match program {
            Some(p) => p.iter().map(|a| quoted(a)).collect::<Vec<_>>().join(" "),
            None => format!("{} {dir}", quoted(path_str(&worker_script(&self.dir)))),
        };
        let line = format!(
            "{srun} --output={dir}/rlaunch-%N.log {rlaunch} {flags} {extra} {worker}",
            rlaunch = quoted(path_str(&bin("rlaunch"))),
            extra = rlaunch_flags.iter().map(|f| quoted(f)).collect::<Vec<_>>().join(" "),
        );
        let path = self.dir.join("job.sbatch");
        std::fs::write(&path, example.replace(sruns[0], &line)).expect("write the batch script");
        path
    }

    /// `sbatch` with the test's rlaunch flags (`--nproc-per-node 1`, the short TTL, a 3 s
    /// shutdown grace, then `rlaunch_flags`) and `sbatch_args`; the job id.
    fn submit(&self, rlaunch_flags: &[&str], sbatch_args: &[&str]) -> String {
        self.submit_program(rlaunch_flags, sbatch_args, None)
    }

    /// [`Slurm::submit`] with `program` in place of the looping worker.
    fn submit_program(&self, rlaunch_flags: &[&str], sbatch_args: &[&str], program: Option<&[&str]>) -> String {
        let mut flags = vec!["--nproc-per-node", "1", "--rdzv-conf", CONF, "--shutdown-timeout", "3"];
        flags.extend(rlaunch_flags);
        let script = self.batch_script(&flags, program);
        let output = format!("--output={}/job-%j.out", path_str(&self.dir));
        let mut cmd = self.client("sbatch");
        cmd.args(["--parsable", &output, "--chdir", path_str(&self.dir)])
            .args(sbatch_args)
            .arg(&script)
            .env("RLAUNCH_LOG", "info")
            // rlaunch's default log directories, under the job's temporary directory.
            .env("TMPDIR", &self.dir)
            // The hosts see the machine's cgroups (for slurmd): no job may make any there.
            .env("RLAUNCH_CONTAINMENT", "process-group");
        let out = run_deadline(&mut cmd, CLIENT_DEADLINE);
        assert!(out.status.success(), "sbatch failed ({}): {}", out.status, stderr_of(&out));
        let job = stdout_of(&out).trim().split(';').next().unwrap_or_default().to_string();
        assert!(job.parse::<u32>().is_ok(), "sbatch --parsable printed a job id: {:?}", stdout_of(&out));
        eprintln!("submitted job {job}");
        job
    }

    /// `scontrol show job`'s fields of `job`.
    fn job(&self, job: &str) -> HashMap<String, String> {
        let out = self.client_ok("scontrol", &["show", "job", "--oneliner", job]);
        out.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn job_state(&self, job: &str) -> String {
        self.job(job).get("JobState").cloned().unwrap_or_default()
    }

    /// Waits until `job` has ended (and is no longer completing); its final state.
    fn wait_job_end(&self, job: &str, deadline: Duration) -> String {
        let start = Instant::now();
        loop {
            let state = self.job_state(job);
            if ended(&state) {
                return state;
            }
            assert!(start.elapsed() < deadline, "job {job} still {state} after {deadline:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until `hosts` run one consistent group of one worker each (`netns::formed`); panics
    /// early if the job ends meanwhile.
    fn wait_formed(&self, job: &str, hosts: &[&str], deadline: Duration) -> Vec<Start> {
        let start = Instant::now();
        let mut checked = Instant::now();
        loop {
            if let Some(group) = formed(&self.dir, hosts, 1) {
                return group;
            }
            // scontrol (a munge credential each time) at most once a second.
            let state = if checked.elapsed() >= Duration::from_secs(1) {
                checked = Instant::now();
                self.job_state(job)
            } else {
                String::new()
            };
            assert!(
                !ended(&state),
                "job {job} ended ({state}) before hosts {hosts:?} formed one group; worker starts:\n{:#?}",
                starts(&self.dir)
            );
            assert!(
                start.elapsed() < deadline,
                "hosts {hosts:?} did not form one group within {deadline:?}; worker starts so far:\n{:#?}",
                starts(&self.dir)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn rlaunch_log(&self, host: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("rlaunch-{host}.log"))).unwrap_or_default()
    }

    /// The exit of step `job`.0's task on `host` (rlaunch) as slurmstepd logged it.
    fn task_exit(&self, host: &str, job: &str) -> Option<String> {
        // Whole lines only: `exit code 14` is what a half-written `exit code 143` reads as.
        let log = complete_text(&self.dir.join(format!("slurmd-{host}.log")));
        let prefix = format!("[{job}.0] task ");
        log.lines()
            .filter_map(|l| l.split_once(&prefix).map(|(_, rest)| rest))
            .find_map(|rest| rest.split_once(") exited").map(|(_, how)| how.trim().trim_end_matches('.').to_string()))
    }

    /// Waits until rlaunch's task on every host has exited with `code`.
    fn assert_rlaunch_exited(&self, job: &str, code: i32) {
        let want = format!("with exit code {code}");
        for host in self.node_names() {
            let mut exit = None;
            wait_until(&format!("slurmstepd on {host} to log how rlaunch exited"), Duration::from_secs(10), || {
                exit = self.task_exit(&host, job);
                exit.is_some()
            });
            assert_eq!(exit.as_deref(), Some(want.as_str()), "rlaunch on host {host} exited {want}");
        }
    }

    /// Processes on `host` other than slurmd: what is left of a job.
    fn job_processes(host: &Host) -> Vec<String> {
        host.pids()
            .into_iter()
            .filter_map(|p| {
                let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).ok()?;
                let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
                (comm.trim() != "slurmd")
                    .then(|| format!("{p} {}", String::from_utf8_lossy(&cmdline).replace('\0', " ")))
            })
            .collect()
    }

    /// Waits until no process but slurmd is left on any host, and none of `pids` (workers and
    /// their rlaunch) anywhere.
    fn assert_nothing_left(&self, pids: &[i32], deadline: Duration) {
        let start = Instant::now();
        loop {
            let left: Vec<String> = self.cluster.hosts().iter().flat_map(Slurm::job_processes).collect();
            let alive: Vec<i32> = pids.iter().copied().filter(|p| pid_alive(*p)).collect();
            if left.is_empty() && alive.is_empty() {
                return;
            }
            assert!(
                start.elapsed() < deadline,
                "still running after {deadline:?}: {left:#?}, job pids {alive:?} (Slurm's SIGKILL comes {KILL_WAIT_S} s \
                 after its SIGTERM: all of it must be gone before that, by rlaunch)"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut files: Vec<PathBuf> =
                std::fs::read_dir(&self.dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
            files.retain(|p| {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                name.starts_with("job-") || name.starts_with("rlaunch-") || name.ends_with(".log")
            });
            files.sort();
            for f in files {
                let text = std::fs::read_to_string(&f).unwrap_or_default();
                let start = text.floor_char_boundary(text.len().saturating_sub(4000));
                eprintln!("----- {} ends:\n{}", f.display(), &text[start..]);
            }
        }
    }
}

/// A job state after which nothing of the job runs any more.
fn ended(state: &str) -> bool {
    !state.is_empty() && !["PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"].contains(&state)
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    use std::io::Read;
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).expect("read /dev/urandom");
    b
}

/// Writes the worker into `dir`: `WORKER OUT` appends a `start` line to `OUT/events.log` (the
/// fields of `netns::loop_worker`'s, host from its host name, plus its rlaunch's pid and the run
/// id), a `usr1` or `term` line for each SIGUSR1 (and goes on) or SIGTERM (and exits 143), and
/// loops until `OUT/stop` exists (exit 0).
fn worker_script(dir: &Path) -> PathBuf {
    let path = dir.join("worker.sh");
    let script = r#"#!/bin/sh
out="$1"
host=$(hostname)
trap 'echo "usr1 host=$host rank=$RANK pid=$$" >> "$out/events.log"' USR1
trap 'echo "term host=$host rank=$RANK pid=$$" >> "$out/events.log"; exit 143' TERM
echo "start t=$(date +%s.%N) host=$host local_rank=$LOCAL_RANK rank=$RANK group_rank=$GROUP_RANK world_size=$WORLD_SIZE group_world_size=$GROUP_WORLD_SIZE restart=$TORCHELASTIC_RESTART_COUNT master=$MASTER_ADDR:$MASTER_PORT pid=$$ agent=$PPID run_id=$TORCHELASTIC_RUN_ID" >> "$out/events.log"
while [ ! -e "$out/stop" ]; do
  sleep 0.1
done
"#;
    write_script(&path, script);
    path
}

/// The `kind` lines of the workers' event log, each as its fields (whole lines only: one being
/// appended could read with its pid cut short).
fn events(dir: &Path, kind: &str) -> Vec<HashMap<String, String>> {
    let text = complete_text(&dir.join("events.log"));
    text.lines()
        .filter_map(|l| l.strip_prefix(kind).and_then(|rest| rest.strip_prefix(' ')))
        .map(|rest| {
            rest.split_whitespace().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect()
        })
        .collect()
}

/// The pid of the rlaunch that started each worker of `group`, as the workers logged it.
fn agents_of(dir: &Path, group: &[Start]) -> Vec<i32> {
    let starts = events(dir, "start");
    group
        .iter()
        .map(|s| {
            starts
                .iter()
                .find(|e| e.get("pid") == Some(&s.pid.to_string()))
                .and_then(|e| e.get("agent")?.parse().ok())
                .expect("a worker's start line names its rlaunch")
        })
        .collect()
}

/// Waits until every worker of `group` has logged a `kind` (`usr1`, `term`) line.
fn wait_every_worker_logged(dir: &Path, group: &[Start], kind: &str, deadline: Duration) {
    wait_until(&format!("every worker to log {kind}"), deadline, || {
        let got = events(dir, kind);
        group.iter().all(|s| got.iter().any(|e| e.get("pid") == Some(&s.pid.to_string())))
    });
}

/// What every worker of a freshly formed job shows: rlaunch's environment with Slurm's run id,
/// and the endpoint taken from the first node of the job (host a's rlaunch hosts it).
fn assert_formed_under_slurm(slurm: &Slurm, job: &str, group: &[Start]) {
    let run_ids: Vec<String> = events(&slurm.dir, "start")
        .into_iter()
        .filter(|e| group.iter().any(|s| e.get("pid") == Some(&s.pid.to_string())))
        .filter_map(|e| e.get("run_id").cloned())
        .collect();
    assert_eq!(run_ids.len(), group.len(), "every worker logged its run id");
    // Under srun, SLURM_STEP_ID is set: the id is the step's.
    assert!(run_ids.iter().all(|r| *r == format!("slurm-{job}.0")), "run id slurm-{job}.0 everywhere: {run_ids:?}");
    // The endpoint: host a (the first of the job's nodes) on the step's port, the same on both.
    let port_of = |log: &str| -> Option<u16> {
        let (_, rest) = log.split_once(r#"endpoints=["a:"#)?;
        rest.split('"').next()?.parse().ok()
    };
    let a = slurm.rlaunch_log("a");
    let port = port_of(&a).unwrap_or_else(|| panic!("host a's rlaunch took host a from Slurm:\n{a}"));
    assert!((20_000..29_000).contains(&port), "a port of the step's, not 29400: {port}");
    let b = slurm.rlaunch_log("b");
    assert_eq!(port_of(&b), Some(port), "host b's rlaunch took the same endpoint:\n{b}");
    assert!(
        a.contains(&format!("this agent hosts one (memory store) addr={}:{port}", slurm.host(0).ip)),
        "host a's rlaunch hosts the rendezvous:\n{a}"
    );
}

/// Submits the example with `rlaunch_flags` and waits until both hosts formed one group under
/// Slurm's environment (as [`assert_formed_under_slurm`] checks); the job id and the group.
fn submit_formed(slurm: &Slurm, rlaunch_flags: &[&str]) -> (String, Vec<Start>) {
    let job = slurm.submit(rlaunch_flags, &[]);
    let group = slurm.wait_formed(&job, &["a", "b"], FORM);
    assert_formed_under_slurm(slurm, &job, &group);
    (job, group)
}

#[test]
fn a_two_node_sbatch_job_forms_from_slurm_reforms_when_a_link_is_cut_and_completes() {
    let slurm = Slurm::start(2);
    let (job, before) = submit_formed(&slurm, &[]);
    assert!(before.iter().all(|s| s.world_size == 2), "{before:#?}");

    // Host b's link (not a's: a hosts the rendezvous) goes down: a's workers re-form alone.
    let t0 = now_unix_f64();
    slurm.host(1).cut_link();
    let after = slurm.wait_formed(&job, &["a"], Duration::from_secs_f64(TTL_S + 10.0));
    let took = after.iter().map(|s| s.t).fold(f64::MIN, f64::max) - t0;
    eprintln!("link cut: host a running again with WORLD_SIZE 1 after {took:.2} s");
    assert!(
        took < TTL_S + RECOVERY_SLACK_S,
        "recovery took {took:.2} s, more than the TTL ({TTL_S} s) + {RECOVERY_SLACK_S} s"
    );
    for s in before.iter().filter(|s| s.host == "a") {
        assert!(!pid_alive(s.pid), "host a's worker from before the cut ({}) was stopped", s.pid);
    }
    assert_eq!(slurm.job_state(&job), "RUNNING");

    let restored = now_unix_f64();
    slurm.host(1).restore_link();
    let again = slurm.wait_formed(&job, &["a", "b"], FORM);
    eprintln!("link restored: both hosts running again with WORLD_SIZE 2");
    for s in &again {
        assert!(
            s.t >= restored && !before.iter().any(|b| b.pid == s.pid),
            "a new worker after the link came back: {s:?}"
        );
    }

    std::fs::write(slurm.dir.join("stop"), b"").expect("touch stop");
    let state = slurm.wait_job_end(&job, Duration::from_secs(30));
    let fields = slurm.job(&job);
    assert_eq!((state.as_str(), fields["ExitCode"].as_str()), ("COMPLETED", "0:0"), "{fields:#?}");
    slurm.assert_rlaunch_exited(&job, 0);
    let pids: Vec<i32> = again.iter().map(|s| s.pid).chain(agents_of(&slurm.dir, &again)).collect();
    slurm.assert_nothing_left(&pids, GONE);
}

#[test]
fn the_example_trains_a_model_on_two_slurm_nodes() {
    // The Rust DDP runtime's real training step across the two hosts, bootstrapped from Slurm's
    // environment alone: rank 0 on host a, rank 1 on host b, gradients all-reduced over TCP.
    let train = bin("examples/train");
    assert!(train.exists(), "{} is not built: cargo build --workspace --examples", train.display());
    let slurm = Slurm::start(2);
    let train = path_str(&train).to_owned();
    let program = [train.as_str(), "--steps", "60", "--no-checkpoint", "--log-every", "20"];
    let job = slurm.submit_program(&[], &[], Some(&program));
    let state = slurm.wait_job_end(&job, Duration::from_secs(120));
    let fields = slurm.job(&job);
    let (a, b) = (slurm.rlaunch_log("a"), slurm.rlaunch_log("b"));
    assert_eq!((state.as_str(), fields["ExitCode"].as_str()), ("COMPLETED", "0:0"), "{fields:#?}\n{a}\n{b}");
    // Group ranks go by join order (as under torchrun's c10d rendezvous), so rank 0 is on
    // whichever host joined first; the other host's agent started rank 1.
    let (zero, one) = if a.contains("group_rank=0") { (&a, &b) } else { (&b, &a) };
    assert!(zero.contains("group_rank=0") && one.contains("group_rank=1"), "one host each rank:\n{a}\n{b}");
    assert!(zero.contains("train: world 2"), "rank 0 trained in a world of 2:\n{zero}");
    assert!(zero.contains("[default0]:done: 60 steps"), "rank 0 finished training:\n{zero}");
    assert!(b.contains(&format!("run_id=slurm-{job}.0")), "host b joined Slurm's run id:\n{b}");
    slurm.assert_rlaunch_exited(&job, 0);
    slurm.assert_nothing_left(&[], GONE);

    // What rlaunch takes from Slurm with no flag at all (the example gives --nnodes): the node
    // count from the step, the endpoint from its first node, as --print-config says on each node.
    let dir = path_str(&slurm.dir).to_owned();
    let wrap = format!(
        "srun --output={dir}/print-%N.log {} --print-config {}",
        quoted(path_str(&bin("rlaunch"))),
        quoted(&train)
    );
    let out = slurm.client_ok(
        "sbatch",
        &["--parsable", "-N2", "--ntasks-per-node=1", &format!("--output={dir}/print-job.out"), "--wrap", &wrap],
    );
    let print_job = out.trim().split(';').next().unwrap_or_default().to_owned();
    assert_eq!(slurm.wait_job_end(&print_job, Duration::from_secs(60)), "COMPLETED");
    for host in slurm.node_names() {
        let text = std::fs::read_to_string(slurm.dir.join(format!("print-{host}.log"))).unwrap_or_default();
        let line =
            |name: &str| text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_default().to_owned();
        let nnodes = line("nnodes");
        assert!(
            nnodes.contains(" 2 ") && nnodes.contains("Slurm (SLURM_STEP_NUM_NODES)"),
            "host {host}: {nnodes}\n{text}"
        );
        let endpoint = line("rdzv-endpoint");
        assert!(
            endpoint.contains(" a:") && endpoint.contains("first host of SLURM_STEP_NODELIST"),
            "host {host}: {endpoint}"
        );
    }
}

#[test]
fn scancel_usr1_is_relayed_to_every_worker_and_scancel_stops_the_job_leaving_nothing() {
    let slurm = Slurm::start(2);
    let (job, group) = submit_formed(&slurm, &[]);

    // Slurm's warning (`--signal=USR1@N` takes this path): every worker gets it and goes on.
    slurm.client_ok("scancel", &["--signal=USR1", &job]);
    wait_every_worker_logged(&slurm.dir, &group, "usr1", Duration::from_secs(10));
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(starts(&slurm.dir).len(), group.len(), "no worker was restarted: {:#?}", starts(&slurm.dir));
    assert!(group.iter().all(|s| pid_alive(s.pid)), "every worker goes on after SIGUSR1");
    assert_eq!(slurm.job_state(&job), "RUNNING");
    for host in slurm.node_names() {
        let log = slurm.rlaunch_log(&host);
        assert!(log.contains("relaying signal to workers signal=SIGUSR1"), "host {host}:\n{log}");
    }

    // `scancel`: SIGTERM to the step; rlaunch stops its workers (SIGTERM first) and exits 143.
    let t0 = Instant::now();
    slurm.client_ok("scancel", &[&job]);
    let pids: Vec<i32> = group.iter().map(|s| s.pid).chain(agents_of(&slurm.dir, &group)).collect();
    slurm.assert_nothing_left(&pids, GONE);
    eprintln!("scancel: nothing of the job left on any host after {:.2} s", t0.elapsed().as_secs_f64());
    wait_every_worker_logged(&slurm.dir, &group, "term", Duration::from_secs(1));
    slurm.assert_rlaunch_exited(&job, 143);
    assert_eq!(slurm.wait_job_end(&job, Duration::from_secs(20)), "CANCELLED");
}

#[test]
fn with_sigusr1_in_signals_to_handle_slurms_warning_stops_the_job() {
    let slurm = Slurm::start(2);
    let (job, group) = submit_formed(&slurm, &["--signals-to-handle", "SIGTERM,SIGUSR1"]);

    slurm.client_ok("scancel", &["--signal=USR1", &job]);
    let pids: Vec<i32> = group.iter().map(|s| s.pid).chain(agents_of(&slurm.dir, &group)).collect();
    slurm.assert_nothing_left(&pids, GONE);
    // The workers get SIGUSR1 first (they go on), then SIGTERM after half the shutdown grace.
    wait_every_worker_logged(&slurm.dir, &group, "usr1", Duration::from_secs(1));
    wait_every_worker_logged(&slurm.dir, &group, "term", Duration::from_secs(1));
    slurm.assert_rlaunch_exited(&job, 128 + libc::SIGUSR1);
    let state = slurm.wait_job_end(&job, Duration::from_secs(20));
    let fields = slurm.job(&job);
    assert_eq!(
        (state.as_str(), fields["ExitCode"].as_str()),
        ("FAILED", "138:0"),
        "srun's exit, the script's: {fields:#?}"
    );
    assert_eq!(starts(&slurm.dir).len(), group.len(), "nothing was restarted: {:#?}", starts(&slurm.dir));
}

#[test]
fn at_the_time_limit_the_warning_reaches_the_workers_then_the_job_stops_leaving_nothing() {
    // `--time=1 --signal=USR1@10` on the command line (over the example's). slurmctld checks time
    // limits every 30 s and sends the warning at the first check that is at most its time plus
    // 30 s before the limit: 20 to 50 s in; the limit comes 60 to 90 s in.
    let slurm = Slurm::start(2);
    let submitted = Instant::now();
    let until = |s: u64| Duration::from_secs(s).saturating_sub(submitted.elapsed());
    let job = slurm.submit(&[], &["--time=1", "--signal=USR1@10"]);
    let group = slurm.wait_formed(&job, &["a", "b"], FORM);

    wait_every_worker_logged(&slurm.dir, &group, "usr1", until(70));
    eprintln!("time limit: SIGUSR1 reached every worker {:.0} s after submission", submitted.elapsed().as_secs_f64());
    assert!(group.iter().all(|s| pid_alive(s.pid)), "every worker goes on after Slurm's warning");
    assert!(events(&slurm.dir, "term").is_empty(), "no worker was stopped by the warning");
    assert_eq!(slurm.job_state(&job), "RUNNING");

    let pids: Vec<i32> = group.iter().map(|s| s.pid).chain(agents_of(&slurm.dir, &group)).collect();
    wait_until("the time limit to stop the workers", until(110), || group.iter().all(|s| !pid_alive(s.pid)));
    eprintln!("time limit: the workers stopped {:.0} s after submission", submitted.elapsed().as_secs_f64());
    slurm.assert_nothing_left(&pids, GONE);
    wait_every_worker_logged(&slurm.dir, &group, "term", Duration::from_secs(1));
    slurm.assert_rlaunch_exited(&job, 143);
    assert_eq!(slurm.wait_job_end(&job, Duration::from_secs(20)), "TIMEOUT");
}

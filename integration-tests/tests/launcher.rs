//! The real `rlaunch` binary on one node, with misbehaving helper workers: the environment of
//! every rank, restarts, exit codes, reports, signals, orphans, output and bad arguments.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use integration_tests::*;

const DEADLINE: Duration = Duration::from_secs(60);

fn read_env(dir: &Path, rank: u32, attempt: u32) -> BTreeMap<String, String> {
    let p = dir.join(format!("env_rank{rank}_attempt{attempt}.json"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("env json")
}

fn launch(args: &[&str], worker_args: &[&str], out: &Path) -> std::process::Output {
    let mut cmd = rlaunch();
    cmd.args(args).arg(worker()).arg("--out").arg(out).args(worker_args);
    run_deadline(&mut cmd, DEADLINE)
}

#[test]
fn every_rank_gets_torchruns_environment() {
    let dir = tempdir();
    let o = launch(&["--standalone", "--nproc-per-node", "4", "--max-restarts", "2"], &["dump-env"], dir.path());
    assert!(o.status.success(), "{}", stderr_of(&o));
    let mut ports = Vec::new();
    for rank in 0..4 {
        let env = read_env(dir.path(), rank, 0);
        let r = rank.to_string();
        for (k, v) in [
            ("RANK", r.as_str()),
            ("LOCAL_RANK", r.as_str()),
            ("ROLE_RANK", r.as_str()),
            ("GROUP_RANK", "0"),
            ("ROLE_NAME", "default"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("WORLD_SIZE", "4"),
            ("GROUP_WORLD_SIZE", "1"),
            ("ROLE_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "2"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("OMP_NUM_THREADS", "1"),
        ] {
            assert_eq!(env.get(k).map(String::as_str), Some(v), "rank {rank}: {k}");
        }
        assert!(env["TORCHELASTIC_ERROR_FILE"].ends_with(&format!("attempt_0/{rank}/error.json")));
        assert_eq!(env["TORCHELASTIC_RUN_ID"].len(), 36, "standalone run ids are random UUIDs");
        assert_eq!(env["TORCHELASTIC_SIGNALS_TO_HANDLE"], "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
        ports.push(env["MASTER_PORT"].parse::<u16>().expect("port"));
    }
    assert!(ports.iter().all(|p| *p == ports[0] && *p != 0), "{ports:?}");
}

#[test]
fn user_set_omp_threads_is_kept() {
    let dir = tempdir();
    let mut cmd = rlaunch();
    cmd.env("OMP_NUM_THREADS", "3").args(["--standalone", "--nproc-per-node", "2"]);
    cmd.arg(worker()).arg("--out").arg(dir.path()).arg("dump-env");
    let o = run_deadline(&mut cmd, DEADLINE);
    assert!(o.status.success());
    assert_eq!(read_env(dir.path(), 1, 0)["OMP_NUM_THREADS"], "3");
}

#[test]
fn restarts_the_whole_group_and_counts_attempts() {
    let dir = tempdir();
    let o = launch(
        &["--standalone", "--nproc-per-node", "3", "--max-restarts", "3"],
        &["dump-env", "sleep", "1", "fail-until-attempt", "2", "5"],
        dir.path(),
    );
    assert!(o.status.success(), "{}", stderr_of(&o));
    for attempt in 0..3 {
        for rank in 0..3 {
            let env = read_env(dir.path(), rank, attempt);
            assert_eq!(env["TORCHELASTIC_RESTART_COUNT"], attempt.to_string());
        }
    }
    assert!(!dir.path().join("env_rank0_attempt3.json").exists());
}

#[test]
fn exits_with_the_failing_workers_code_when_the_budget_is_spent() {
    let dir = tempdir();
    let o = launch(
        &["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"],
        &["dump-env", "fail-rank", "1", "7", "hang"],
        dir.path(),
    );
    assert_eq!(o.status.code(), Some(7), "{}", stderr_of(&o));
    let err = stderr_of(&o);
    assert!(err.contains("Root Cause"), "{err}");
    assert!(err.contains("rank        : 1 (local_rank: 1)"), "{err}");
    assert!(err.contains("exit code 7"), "{err}");
    assert!(err.contains("rank 1 failing with 7"), "stderr tail in the report: {err}");
    // Rank 1 dumps its environment before failing; rank 0 may be stopped before it does.
    assert!(dir.path().join("env_rank1_attempt1.json").exists(), "one restart happened");
    assert!(!dir.path().join("env_rank1_attempt2.json").exists(), "no second restart");
}

#[test]
fn a_worker_killed_by_a_signal_exits_128_plus_signal() {
    let dir = tempdir();
    let o = launch(&["--standalone", "--nproc-per-node", "1"], &["segv"], dir.path());
    assert_eq!(o.status.code(), Some(128 + 11), "{}", stderr_of(&o));
    assert!(stderr_of(&o).contains("SIGSEGV"));
}

#[test]
fn error_file_message_and_traceback_reach_the_report_and_agent_error_file() {
    let dir = tempdir();
    let logs = tempdir();
    let agent_err = dir.path().join("agent_error.json");
    let mut cmd = rlaunch();
    cmd.env("TORCHELASTIC_ERROR_FILE", &agent_err);
    cmd.args(["--standalone", "--nproc-per-node", "2", "--log-dir"]).arg(logs.path());
    cmd.arg(worker()).arg("--out").arg(dir.path()).args([
        "fail-rank",
        "0",
        "0",
        "error-file",
        "ValueError: planted failure",
    ]);
    let o = run_deadline(&mut cmd, DEADLINE);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr_of(&o);
    assert!(err.contains("message     : ValueError: planted failure"), "{err}");
    assert!(err.contains("File \"worker.py\", line 7"), "traceback shown: {err}");
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&agent_err).unwrap()).unwrap();
    assert_eq!(written["message"]["message"], "ValueError: planted failure");
    assert_eq!(written["message"]["extraInfo"]["rank"], 1);
    let run_dir = std::fs::read_dir(logs.path()).unwrap().next().unwrap().unwrap().path();
    assert!(run_dir.join("error.json").exists());
    assert!(run_dir.join("attempt_0/1/error.json").exists());
}

#[test]
fn a_hostile_root_cause_reaches_the_console_with_its_escapes_shown_not_obeyed() {
    let dir = tempdir();
    let mut cmd = rlaunch();
    cmd.args(["--standalone", "--nproc-per-node", "1"]).arg(worker()).arg("--out").arg(dir.path());
    // An OSC 52 clipboard write, a screen clear and a one-character CSI (C1, 0x9b).
    cmd.args(["error-file", "evil\x1b]52;c;ZXZpbA==\x07\x1b[2J\u{9b}31m done"]);
    let o = run_deadline(&mut cmd, DEADLINE);
    assert_eq!(o.status.code(), Some(1), "{}", stderr_of(&o));
    let err = stderr_of(&o);
    assert!(err.contains("message     : evil\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\x9b31m done"), "{err:?}");
    assert!(!err.contains('\x1b') && !err.contains('\u{9b}') && !err.contains('\x07'), "{err:?}");
}

#[test]
fn killing_the_agent_with_sigkill_leaves_no_worker_alive() {
    let dir = tempdir();
    let mut cmd = rlaunch();
    cmd.args(["--standalone", "--nproc-per-node", "3"])
        .arg(worker())
        .arg("--out")
        .arg(dir.path())
        .args(["pidfile", "hang"]);
    let mut agent = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    // A pid file may exist before it holds the pid (issue 34: read empty once): wait for the pid.
    let pids = worker_pids(dir.path(), 3);
    assert!(pids.iter().all(|p| pid_alive(*p)));
    agent.kill().unwrap();
    agent.wait().unwrap();
    wait_until("every worker to die with its agent", Duration::from_secs(5), || pids.iter().all(|p| !pid_alive(*p)));
}

/// The pids of attempt 0's `n` workers (`pidfile`), each waited for until its file holds it.
fn worker_pids(dir: &Path, n: u32) -> Vec<i32> {
    (0..n).map(|r| wait_for_pid(&dir.join(format!("pid_rank{r}_attempt0")), Duration::from_secs(20))).collect()
}

/// Starts the agent and waits until its `n` workers wrote their pids; answers the agent and them.
fn spawn_and_wait_for_workers(
    args: &[&str],
    worker_args: &[&str],
    dir: &Path,
    n: u32,
) -> (std::process::Child, Vec<i32>) {
    let mut cmd = rlaunch();
    cmd.args(args).arg(worker()).arg("--out").arg(dir).args(worker_args);
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pids = worker_pids(dir, n);
    (child, pids)
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: signalling a child process we spawned.
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0);
}

#[test]
fn sigterm_stops_the_workers_gracefully_and_exits_143() {
    let dir = tempdir();
    let (agent, _) = spawn_and_wait_for_workers(
        &["--standalone", "--nproc-per-node", "2"],
        &["record-signals", "pidfile", "hang"],
        dir.path(),
        2,
    );
    kill(agent.id(), libc::SIGTERM);
    let o = wait_deadline(agent, Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(143), "{}", stderr_of(&o));
    for r in 0..2 {
        let s = std::fs::read_to_string(dir.path().join(format!("signals_rank{r}.txt"))).unwrap_or_default();
        assert!(s.contains("SIGTERM"), "rank {r} saw SIGTERM: {s:?}");
    }
}

#[test]
fn a_worker_ignoring_sigterm_is_killed_after_the_grace() {
    let dir = tempdir();
    let (agent, pids) = spawn_and_wait_for_workers(
        &["--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "0.5"],
        &["ignore-term", "pidfile", "hang"],
        dir.path(),
        2,
    );
    // SIGTERM (a SIGINT would reach them as SIGINT first, which they do not ignore).
    kill(agent.id(), libc::SIGTERM);
    let o = wait_deadline(agent, Duration::from_secs(15));
    assert_eq!(o.status.code(), Some(128 + libc::SIGTERM));
    assert!(stderr_of(&o).contains("SIGKILL"), "{}", stderr_of(&o));
    assert!(pids.iter().all(|p| !pid_alive(*p)));
}

#[test]
fn sigterm_to_every_process_of_the_job_stops_it_without_a_restart() {
    // Slurm under proctrack/cgroup, systemd's control-group kill: the workers get SIGTERM a
    // moment before the agent. The agent must not restart them in between.
    for delay_ms in [20, 200] {
        let dir = tempdir();
        let (agent, pids) = spawn_and_wait_for_workers(
            &["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"],
            &["pidfile", "hang"],
            dir.path(),
            2,
        );
        for pid in pids {
            kill(pid as u32, libc::SIGTERM);
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        kill(agent.id(), libc::SIGTERM);
        let o = wait_deadline(agent, Duration::from_secs(15));
        assert_eq!(o.status.code(), Some(143), "{}", stderr_of(&o));
        assert!(!dir.path().join("pid_rank0_attempt1").exists(), "no restart was started: {}", stderr_of(&o));
        assert!(stderr_of(&o).contains("did not send"), "{}", stderr_of(&o));
    }
}

#[test]
fn sigusr1_and_sigusr2_are_relayed_to_every_worker() {
    let dir = tempdir();
    let (agent, _) = spawn_and_wait_for_workers(
        &["--standalone", "--nproc-per-node", "2"],
        &["record-signals", "pidfile", "hang"],
        dir.path(),
        2,
    );
    let file = |r: u32| std::fs::read_to_string(dir.path().join(format!("signals_rank{r}.txt"))).unwrap_or_default();
    kill(agent.id(), libc::SIGUSR1);
    wait_until("SIGUSR1 at every worker", Duration::from_secs(10), || (0..2).all(|r| file(r).contains("SIGUSR1")));
    kill(agent.id(), libc::SIGUSR2);
    wait_until("SIGUSR2 at every worker", Duration::from_secs(10), || (0..2).all(|r| file(r).contains("SIGUSR2")));
    kill(agent.id(), libc::SIGTERM);
    let o = wait_deadline(agent, Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(143));
}

#[test]
fn output_lines_are_prefixed_and_never_interleaved() {
    let dir = tempdir();
    let o = launch(&["--standalone", "--nproc-per-node", "4"], &["spam", "3000"], dir.path());
    assert!(o.status.success());
    let out = stdout_of(&o);
    let mut counts = [0usize; 4];
    for line in out.lines() {
        let rest = line.strip_prefix("[default").unwrap_or_else(|| panic!("unprefixed line: {line:?}"));
        let (rank, body) = rest.split_once("]:").expect("prefix closes");
        let rank: usize = rank.parse().expect("rank");
        let expected_body = format!("rank{rank}-").repeat(50);
        assert!(body.starts_with("OUT ") && body.ends_with(&format!("{expected_body} END")), "mangled line: {line:?}");
        counts[rank] += 1;
    }
    assert_eq!(counts, [3000; 4]);
    let err = stderr_of(&o);
    assert_eq!(err.lines().filter(|l| l.starts_with("[default") && l.ends_with(" END")).count(), 12000);
}

#[test]
fn log_dir_keeps_per_attempt_per_rank_files() {
    let dir = tempdir();
    let logs = tempdir();
    let mut cmd = rlaunch();
    cmd.args(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir"]).arg(logs.path());
    cmd.arg(worker()).arg("--out").arg(dir.path()).args([
        "print",
        "hello-out",
        "eprint",
        "hello-err",
        "sleep",
        "1",
        "fail-until-attempt",
        "1",
        "4",
    ]);
    let o = run_deadline(&mut cmd, DEADLINE);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let run_dir = std::fs::read_dir(logs.path()).unwrap().next().unwrap().unwrap().path();
    for attempt in 0..2 {
        for rank in 0..2 {
            let d = run_dir.join(format!("attempt_{attempt}/{rank}"));
            assert_eq!(std::fs::read_to_string(d.join("stdout.log")).unwrap(), "hello-out\n");
            let err = std::fs::read_to_string(d.join("stderr.log")).unwrap();
            assert!(err.starts_with("hello-err\n"), "{err}");
        }
    }
    assert!(stdout_of(&o).contains("[default1]:hello-out"));
}

#[test]
fn redirects_tee_and_rank_filter_route_streams_like_torchrun() {
    let dir = tempdir();
    let logs = tempdir();
    // Local rank 0: stdout redirected (file only); local rank 1: stderr teed. Console shows rank 1 only.
    let mut cmd = rlaunch();
    cmd.args([
        "--standalone",
        "--nproc-per-node",
        "3",
        "-r",
        "0:1",
        "-t",
        "1:2",
        "--local-ranks-filter",
        "1,2",
        "--log-dir",
    ])
    .arg(logs.path());
    cmd.arg(worker()).arg("--out").arg(dir.path()).args(["print", "out-line", "eprint", "err-line"]);
    let o = run_deadline(&mut cmd, DEADLINE);
    assert!(o.status.success());
    let (out, err) = (stdout_of(&o), stderr_of(&o));
    assert!(!out.contains("[default0]:"), "rank 0 filtered out and redirected: {out}");
    assert!(out.contains("[default1]:out-line") && out.contains("[default2]:out-line"), "{out}");
    assert!(err.contains("[default1]:err-line") && !err.contains("[default0]:err-line"), "{err}");
    let run_dir = std::fs::read_dir(logs.path()).unwrap().next().unwrap().unwrap().path();
    assert_eq!(std::fs::read_to_string(run_dir.join("attempt_0/0/stdout.log")).unwrap(), "out-line\n");

    // Without --log-dir, a redirected stream goes to a file only, never to the console.
    let o = launch(&["--standalone", "--nproc-per-node", "2", "--redirects", "3"], &["print", "hidden"], dir.path());
    assert!(o.status.success());
    assert!(!stdout_of(&o).contains("hidden"));
}

#[test]
fn grandchildren_do_not_outlive_the_job() {
    let dir = tempdir();
    let o = launch(&["--standalone", "--nproc-per-node", "1"], &["spawn-grandchild"], dir.path());
    assert!(o.status.success());
    let pid = wait_for_pid(&dir.path().join("grandchild_rank0.pid"), Duration::from_secs(5));
    wait_until("the grandchild to be killed", Duration::from_secs(5), || !pid_alive(pid));
}

#[test]
fn a_missing_program_exits_127_with_a_clear_message() {
    let mut cmd = rlaunch();
    cmd.args(["--standalone", "./definitely-not-here"]);
    let o = run_deadline(&mut cmd, DEADLINE);
    assert_eq!(o.status.code(), Some(127));
    assert!(stderr_of(&o).contains("failed to spawn local rank 0 (`./definitely-not-here`)"), "{}", stderr_of(&o));
}

#[test]
fn python_scripts_run_under_python3_unbuffered() {
    let dir = tempdir();
    let script = dir.path().join("hello.py");
    std::fs::write(
        &script,
        "import os, sys\nprint('py', os.environ['RANK'], 'unbuffered' if '-u' in sys.orig_argv else 'buffered')\n",
    )
    .unwrap();
    let mut cmd = rlaunch();
    // Only the launcher's `-u` may make the worker unbuffered here.
    cmd.env_remove("PYTHONUNBUFFERED").args(["--standalone", "--nproc-per-node", "2"]).arg(&script);
    let o = run_deadline(&mut cmd, DEADLINE);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let out = stdout_of(&o);
    assert!(out.contains("[default0]:py 0 unbuffered") && out.contains("[default1]:py 1 unbuffered"), "{out}");
}

#[test]
fn pet_environment_variables_are_fallbacks_and_flags_win() {
    let dir = tempdir();
    let mut cmd = rlaunch();
    cmd.env("PET_NPROC_PER_NODE", "3").env("PET_MAX_RESTARTS", "4").args(["--standalone"]);
    cmd.arg(worker()).arg("--out").arg(dir.path()).arg("dump-env");
    let o = run_deadline(&mut cmd, DEADLINE);
    assert!(o.status.success());
    assert_eq!(read_env(dir.path(), 2, 0)["TORCHELASTIC_MAX_RESTARTS"], "4");
    let dir = tempdir();
    let mut cmd = rlaunch();
    cmd.env("PET_NPROC_PER_NODE", "3").args(["--standalone", "--nproc_per_node", "1"]);
    cmd.arg(worker()).arg("--out").arg(dir.path()).arg("dump-env");
    assert!(run_deadline(&mut cmd, DEADLINE).status.success());
    assert!(!dir.path().join("env_rank1_attempt0.json").exists());
}

#[test]
fn bad_arguments_exit_2_with_a_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["--nproc-per-node", "0", "x"], "--nproc-per-node 0"),
        (&["--nproc-per-node", "many", "x"], "--nproc-per-node many"),
        (&["--nnodes", "3:1", "x"], "MIN (3) is larger than MAX (1)"),
        (&["--nnodes", "abc", "x"], "--nnodes abc"),
        (&["--start-method", "bogus", "x"], "bogus"),
        (&["--nproc-per-node", "-1", "x"], "--nproc-per-node -1"),
        (&["--standalone", "--nnodes", "2", "x"], "--standalone runs a single node"),
        (&["--max-restarts", "-1", "x"], "-1"),
        (&["--monitor-interval", "0", "x"], "--monitor-interval 0"),
        (&["--redirects", "7", "x"], "--redirects 7"),
        (&["--tee", "0:9", "x"], "--tee 0:9"),
        (&["--local-ranks-filter", "5", "--nproc-per-node", "2", "x"], "local rank 5 does not exist"),
        (&["--rdzv-backend", "zookeeper", "x"], "--rdzv-backend zookeeper"),
        (&["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:1", "x"], "etcd v2 API was removed"),
        (&["--rdzv-backend", "rlaunch", "x"], "needs --rdzv-endpoint"),
        (&["--rdzv-backend", "rlaunch", "--rdzv-endpoint", "nohostport", "x"], "expected host:port"),
        (
            &["--rdzv-conf", "node_ttl=5,heartbeat_interval=9", "x"],
            "heartbeat_interval (9s) must be less than node_ttl (5s)",
        ),
        (&["--rdzv-conf", "nonsense", "x"], "is not key=value"),
        (
            &[
                "--rdzv-backend",
                "rlaunch",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-conf",
                "node_ttl=3",
                "--shutdown-timeout",
                "2",
                "x",
            ],
            "node_ttl (3s) must be less than --shutdown-timeout (2s)",
        ),
        (
            &[
                "--rdzv-backend",
                "rlaunch",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-conf",
                "join_timeout=5",
                "--shutdown-timeout",
                "6",
                "x",
            ],
            "--shutdown-timeout (6s) must be less than join_timeout (5s)",
        ),
        (&["--nnodes", "2", "x"], "needs --master-port"),
        (&["--nnodes", "2", "--node-rank", "2", "--master-port", "1", "x"], "--node-rank 2 must be below --nnodes 2"),
        (&["-m", "--no-python", "x"], "don't use both --no-python and -m"),
        (&["--unknown-flag", "x"], "--unknown-flag"),
        (&["--standalone"], "PROGRAM"),
    ];
    for (args, needle) in cases {
        let o = run_deadline(rlaunch().args(*args), Duration::from_secs(10));
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr_of(&o));
        assert!(stderr_of(&o).contains(needle), "{args:?}: expected {needle:?} in {}", stderr_of(&o));
        assert!(!stderr_of(&o).contains("panicked"), "{args:?}");
    }
}

#[test]
fn help_lists_the_exit_codes() {
    let o = run_deadline(rlaunch().arg("--help"), Duration::from_secs(10));
    assert!(o.status.success());
    assert!(stdout_of(&o).contains("128+S"));
}

//! Survivors that keep their process (issue 37), the part that ends a collective: a gloo
//! all_reduce waiting on a frozen peer (stopped, its connections open, as after a link cut: no
//! reset ever comes) is ended from another thread of the same process by shutting down its
//! connections (`rlaunch.interrupt`), and the process then makes a new process group and
//! reduces again.

use std::process::Command;
use std::time::Duration;

use integration_tests::{repo_root, run_deadline, stderr_of, stdout_of, venv_python};

#[test]
fn a_gloo_collective_waiting_on_a_frozen_peer_ends_at_the_interrupt_and_a_new_group_works_in_the_same_process() {
    let script = repo_root().join("integration-tests/py/interrupt_gloo.py");
    let o = run_deadline(
        Command::new(venv_python()).arg(&script).env("PYTHONPATH", repo_root().join("python")),
        Duration::from_secs(120),
    );
    let out = stdout_of(&o);
    assert!(o.status.success(), "{out}\n{}", stderr_of(&o));
    let value = |key: &str| -> f64 {
        let line = out.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("no {key} in {out}"));
        line.trim().parse().unwrap()
    };
    assert!(value("shut_down=") >= 1.0, "{out}");
    // The collective's own timeout is 60 s: it ended because of the interrupt, not by itself.
    assert!(value("ended_after=") < 5.0, "{out}");
    assert!(out.contains("raised: ") && out.contains("new_group_ok"), "{out}");
}

/// Heartbeats every 0.5 s, a node lost after 2 s without one.
const CONF: &str = "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=30";

/// The environment a worker recorded at its `entry`-th run of the function.
fn entry_env(dir: &std::path::Path, host: &str, entry: u32) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join(format!("env.{host}.0.{entry}.json"))).ok()?;
    serde_json::from_str(&text).ok()
}

/// The agents of hosts a (hosting the rendezvous) and b, gloo on their links.
fn start_two_hosts(
    cluster: &integration_tests::netns::Cluster,
    out: &std::path::Path,
    args: &[String],
    endpoint: &str,
) -> Vec<integration_tests::netns::Proc> {
    let agent = |i: usize| {
        let h = cluster.host(i);
        let mut c = h.command(integration_tests::bin("rlaunch"));
        c.args(args).env("RLAUNCH_LOG", "info").env("RL_HOST", &h.name).env("GLOO_SOCKET_IFNAME", "eth0");
        integration_tests::netns::Proc::spawn(
            c,
            &format!("rlaunch on host {}", h.name),
            &out.join(format!("rlaunch-{}.log", h.name)),
        )
    };
    let mut agents = vec![agent(0)];
    integration_tests::wait_until("host a to host the rendezvous server", Duration::from_secs(10), || {
        integration_tests::netns::listening(endpoint)
    });
    agents.push(agent(1));
    agents
}

/// A formed two-host job of the resilient loop, one rank per host: its hosts, files, agents
/// and first workers.
struct Job {
    /// The hosts: dropping it takes their namespaces down (bind it for the whole test).
    cluster: integration_tests::netns::Cluster,
    dir: tempfile::TempDir,
    endpoint: String,
    agents: Vec<integration_tests::netns::Proc>,
    before: Vec<integration_tests::netns::Start>,
}

impl Job {
    /// `--nnodes nnodes`, `--max-restarts max_restarts`; waits until both hosts run.
    fn start(nnodes: &str, run_id: &str, max_restarts: u32) -> Job {
        let cluster = integration_tests::netns::Cluster::new(2);
        let dir = integration_tests::tempdir();
        let out = dir.path();
        let endpoint = format!("{}:29400", cluster.host(0).ip);
        let (python, script) = (venv_python(), repo_root().join("integration-tests/py/resilient_loop.py"));
        let budget = max_restarts.to_string();
        let program = [
            "--max-restarts",
            budget.as_str(),
            python.to_str().unwrap(),
            script.to_str().unwrap(),
            out.to_str().unwrap(),
        ];
        let args = integration_tests::netns::rdzv_args(nnodes, 1, &endpoint, run_id, CONF, "3", &program);
        let mut agents = start_two_hosts(&cluster, out, &args, &endpoint);
        let before = integration_tests::netns::wait_formed(out, &["a", "b"], 1, &mut agents, Duration::from_secs(60));
        Job { cluster, dir, endpoint, agents, before }
    }

    fn out(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The pid of `host`'s worker among `starts`.
    fn pid(starts: &[integration_tests::netns::Start], host: &str) -> i32 {
        starts.iter().find(|s| s.host == host).map(|s| s.pid).expect("the host's worker")
    }
}

/// A worker failing on host b: host b's worker is started again (its own rank failed: not
/// resumed), host a's keeps its process and runs the function again in the next round, with
/// the restart counted once.
#[test]
fn a_worker_failing_on_another_host_is_restarted_there_and_the_survivor_keeps_its_process() {
    use integration_tests::netns::{finish, wait_formed};

    let Job { mut agents, before, dir, cluster: _hosts, .. } = Job::start("2", "resilient-crash", 3);
    let (out, pid) = (dir.path(), Job::pid);
    std::fs::write(out.join("crash_b"), b"").unwrap();
    integration_tests::wait_until("the group to re-form after the crash", Duration::from_secs(60), || {
        integration_tests::netns::formed(out, &["a", "b"], 1).is_some_and(|g| g.iter().all(|s| s.restart == 1))
    });
    let after = wait_formed(out, &["a", "b"], 1, &mut agents, Duration::from_secs(5));
    assert_eq!(pid(&after, "a"), pid(&before, "a"), "host a's worker kept its process: {before:?} -> {after:?}");
    assert_ne!(pid(&after, "b"), pid(&before, "b"), "host b's failed worker was started again: {after:?}");
    let second = entry_env(out, "a", 2).expect("host a's function ran again");
    assert_eq!(second["env"]["TORCHELASTIC_RESTART_COUNT"], "1", "the restart is counted: {second:#}");
    finish(out, &mut agents);
}

/// Two hosts, one gloo rank each, the function under `@rlaunch.resilient`; host b's link is cut,
/// then its processes killed. Host a's worker keeps its process (same pid, its imports and
/// state), runs the function again alone, with the environment of the new round, and resumes
/// from its snapshot.
#[test]
fn a_survivor_keeps_its_process_when_the_other_host_is_killed_and_runs_on_with_the_new_round_s_environment() {
    use integration_tests::netns::{self, finish, wait_formed};

    let mut job = Job::start("1:2", "resilient", 3);
    let (before, out) = (job.before.clone(), job.out().to_path_buf());
    let (out, agents, cluster, endpoint) = (out.as_path(), &mut job.agents, &job.cluster, &job.endpoint);
    let a0 = before.iter().find(|s| s.host == "a").expect("host a's worker").clone();
    // Some steps saved first, so that there is a step to resume from.
    integration_tests::wait_until("host a to save step 5", Duration::from_secs(30), || {
        std::fs::read_to_string(out.join("saved.a"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .is_some_and(|s| s >= 5)
    });

    // As a partition would: host b's link goes down first (no reset reaches host a: its
    // collective is ended by the agent's word), its processes die 0.3 s later.
    let t0 = netns::now_unix_f64();
    cluster.host(1).cut_link();
    std::thread::sleep(Duration::from_millis(300));
    cluster.host(1).kill_all();
    let after = wait_formed(out, &["a"], 1, &mut agents[..1], Duration::from_secs(30));
    eprintln!("host b cut off: host a's worker ran the function again after {:.2} s, same process", after[0].t - t0);
    assert_eq!(after[0].pid, a0.pid, "host a's worker kept its process: {before:?} -> {after:?}");

    let first = entry_env(out, "a", 1).expect("host a's first entry");
    let second = entry_env(out, "a", 2).expect("host a's second entry: the function ran again");
    assert_eq!(first["pid"], second["pid"]);
    let (e1, e2) = (&first["env"], &second["env"]);
    // The new round's placement, as a fresh worker of it gets it.
    for (key, want) in [
        ("WORLD_SIZE", "1"),
        ("GROUP_WORLD_SIZE", "1"),
        ("ROLE_WORLD_SIZE", "1"),
        ("RANK", "0"),
        ("GROUP_RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "1"),
    ] {
        assert_eq!(e2[key], want, "{key} after the re-entry: {e2:#}");
    }
    // A node loss spends no restart; the round's store is a new one; the run is the same.
    assert_eq!(e2["TORCHELASTIC_RESTART_COUNT"], e1["TORCHELASTIC_RESTART_COUNT"]);
    assert_eq!(e2["TORCHELASTIC_RUN_ID"], e1["TORCHELASTIC_RUN_ID"]);
    assert_eq!(e2["TORCHELASTIC_MAX_RESTARTS"], e1["TORCHELASTIC_MAX_RESTARTS"]);
    assert_ne!(e2["MASTER_PORT"], e1["MASTER_PORT"], "the new round's store: {e1:#} -> {e2:#}");
    // The new round's error file, under its attempt's directory; the control socket kept.
    assert!(e2["TORCHELASTIC_ERROR_FILE"].as_str().unwrap().ends_with("attempt_0/0/error.json"), "{e2:#}");
    assert_eq!(e2["RLAUNCH_CONTROL"], e1["RLAUNCH_CONTROL"]);
    // The data loader's worker process made before the function lives on through the recovery.
    let loader = first["loader_pids"].as_array().cloned().unwrap_or_default();
    assert_eq!(loader.len(), 1, "{first:#}");
    assert_eq!(second["loader_pids"], first["loader_pids"], "the data loader's worker kept: {second:#}");
    // State came back from the snapshot: the function resumed past step 0.
    assert!(second["resumed_at_step"].as_u64().unwrap() > 0, "{second:#}");
    let log = std::fs::read_to_string(out.join("rlaunch-a.log")).unwrap_or_default();
    assert!(log.contains("the workers keep their processes"), "host a's agent log:\n{log}");
    // The rendezvous' account of the recovery names the rank that kept its process.
    let kept = || {
        let status = netns::rdzv_status("rlaunch", endpoint, "resilient");
        let last = status["recovery"]["recoveries"].as_array().and_then(|r| r.last().cloned());
        last.map(|r| r["phases"]["ranks_kept"].clone()).unwrap_or_default()
    };
    integration_tests::wait_until("the recovery's account to count the kept rank", Duration::from_secs(15), || {
        kept() == 1
    });
    finish(out, &mut agents[..1]);
}

/// Twenty recoveries in a row (host b's worker fails each round after three steps): host a's
/// worker keeps one process through all of them, and its descriptors, threads and memory do
/// not grow with each recovery.
#[test]
fn twenty_recoveries_in_one_process_leak_no_descriptor_thread_or_memory() {
    use integration_tests::netns::finish;

    const RECOVERIES: u32 = 20;
    let Job { mut agents, dir, cluster: _hosts, .. } = Job::start("2", "resilient-leak", RECOVERIES + 1);
    let out = dir.path();
    std::fs::write(out.join("crash_every_b"), RECOVERIES.to_string()).unwrap();
    integration_tests::wait_until("twenty recoveries", Duration::from_secs(240), || {
        integration_tests::netns::formed(out, &["a", "b"], 1).is_some_and(|g| g.iter().all(|s| s.restart == RECOVERIES))
    });
    let entries: Vec<serde_json::Value> = (1..).map_while(|n| entry_env(out, "a", n)).collect();
    assert!(entries.len() as u32 > RECOVERIES, "host a's function ran {} times", entries.len());
    let pid = &entries[0]["pid"];
    assert!(entries.iter().all(|e| &e["pid"] == pid), "one process throughout");
    let num = |e: &serde_json::Value, k: &str| e[k].as_u64().unwrap_or_else(|| panic!("{k} in {e}"));
    // The first recoveries make what is made once, lazily (the control thread, the snapshot
    // connection, the first groups' helpers: 19, 27, 30 descriptors, then 30 through the
    // twentieth, on 2026-11-28): from the fifth entry on nothing grows from one recovery to the next.
    let (second, last) = (&entries[4], &entries[entries.len() - 1]);
    let series = |k: &str| entries.iter().map(|e| num(e, k)).collect::<Vec<_>>();
    assert!(num(last, "fds") <= num(second, "fds") + 2, "descriptors grew: {:?}", series("fds"));
    assert!(num(last, "threads") <= num(second, "threads") + 2, "threads grew: {:?}", series("threads"));
    assert!(
        num(last, "rss_kib") <= num(second, "rss_kib") + 64 * 1024,
        "memory grew by more than 64 MiB over {RECOVERIES} recoveries: {:?}",
        series("rss_kib")
    );
    eprintln!("over {} entries: fds {:?}, threads {:?}", entries.len(), series("fds"), series("threads"));
    finish(out, &mut agents);
}

/// A worker that opted in but does not come back when its round ends (a minute of work with no
/// collective to end): after `PARK_WITHIN` it is stopped and started as without the decorator,
/// and the job goes on.
#[test]
fn a_survivor_that_does_not_park_in_time_is_stopped_and_started_as_before() {
    use integration_tests::netns::{self, finish, wait_formed};

    let Job { cluster, mut agents, before, dir, .. } = Job::start("1:2", "resilient-stubborn", 3);
    let out = dir.path();
    let a0 = Job::pid(&before, "a");
    std::fs::write(out.join("stubborn_a"), b"").unwrap();
    std::thread::sleep(Duration::from_millis(500)); // into its sleep
    let t0 = netns::now_unix_f64();
    cluster.host(1).kill_all();
    std::fs::remove_file(out.join("stubborn_a")).unwrap(); // the next process works normally
    let after = wait_formed(out, &["a"], 1, &mut agents[..1], Duration::from_secs(40));
    eprintln!("a survivor that did not park: started again after {:.2} s", after[0].t - t0);
    assert_ne!(after[0].pid, a0, "stopped and started again");
    let log = std::fs::read_to_string(out.join("rlaunch-a.log")).unwrap_or_default();
    assert!(log.contains("not every worker ended its round"), "host a's agent log:\n{log}");
    finish(out, &mut agents[..1]);
}

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
        Job::start_with(nnodes, 1, run_id, max_restarts)
    }

    /// [`Job::start`] with `nproc` ranks per host.
    fn start_with(nnodes: &str, nproc: u32, run_id: &str, max_restarts: u32) -> Job {
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
        let args = integration_tests::netns::rdzv_args(nnodes, nproc, &endpoint, run_id, CONF, "3", &program);
        let mut agents = start_two_hosts(&cluster, out, &args, &endpoint);
        let before =
            integration_tests::netns::wait_formed(out, &["a", "b"], nproc, &mut agents, Duration::from_secs(60));
        Job { cluster, dir, endpoint, agents, before }
    }

    fn out(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The pid of `host`'s worker among `starts`.
    fn pid(starts: &[integration_tests::netns::Start], host: &str) -> i32 {
        Job::pid_at(starts, host, 0)
    }

    /// The pid of `host`'s local rank `local` among `starts`.
    fn pid_at(starts: &[integration_tests::netns::Start], host: &str, local: u32) -> i32 {
        let found = starts.iter().find(|s| s.host == host && s.local_rank == local);
        found.map(|s| s.pid).unwrap_or_else(|| panic!("host {host}'s local rank {local} among {starts:#?}"))
    }

    /// A job of two ranks per host re-formed at restart count `restart`: host b's local rank 1
    /// alone has a new process, the three others the ones they had in `before`. The group.
    fn reformed_around_b1(&mut self, restart: u32, within: Duration) -> Vec<integration_tests::netns::Start> {
        let out = self.dir.path();
        integration_tests::wait_until("the group to re-form around host b's local rank 1", within, || {
            integration_tests::netns::formed(out, &["a", "b"], 2)
                .is_some_and(|g| g.iter().all(|s| s.restart == restart))
        });
        let after =
            integration_tests::netns::wait_formed(out, &["a", "b"], 2, &mut self.agents, Duration::from_secs(5));
        let before = &self.before;
        for (host, local) in [("a", 0), ("a", 1), ("b", 0)] {
            assert_eq!(
                Job::pid_at(&after, host, local),
                Job::pid_at(before, host, local),
                "host {host}'s local rank {local} kept its process: {before:#?} -> {after:#?}"
            );
        }
        assert_ne!(Job::pid_at(&after, "b", 1), Job::pid_at(before, "b", 1), "the failed worker was started anew");
        after
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
    // Field by field, host a's environment after the re-entry is what the round's fresh worker
    // on host b got (written by the new process, over the old one's file), but for what names
    // the rank and the host's own agent.
    let fresh = entry_env(out, "b", 1).expect("host b's new worker's environment");
    assert_eq!(fresh["pid"].as_i64(), Some(pid(&after, "b") as i64), "{fresh:#}");
    let (resumed, fresh) = (second["env"].as_object().unwrap(), fresh["env"].as_object().unwrap());
    let keys = |m: &serde_json::Map<String, serde_json::Value>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(resumed), keys(fresh), "the same variables");
    // The rank's own, and the node's agent's own (its sockets, its snapshot package on the
    // Python path, the test's host name): the latter as host a's worker had them before.
    const THE_RANK_S: [&str; 4] = ["RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_ERROR_FILE"];
    const THE_AGENT_S: [&str; 4] = ["RL_HOST", "RLAUNCH_CONTROL", "RLAUNCH_SNAPSHOT", "PYTHONPATH"];
    let differ: Vec<&String> = resumed.keys().filter(|k| resumed[*k] != fresh[*k]).collect();
    assert!(
        differ.iter().all(|k| THE_RANK_S.contains(&k.as_str()) || THE_AGENT_S.contains(&k.as_str())),
        "host a's resumed environment differs from the round's fresh worker's in {differ:?}:\n{resumed:#?}\n{fresh:#?}"
    );
    let first = entry_env(out, "a", 1).expect("host a's first entry");
    for key in THE_AGENT_S {
        assert_eq!(resumed.get(key), first["env"].get(key), "{key}: host a's agent's own, as before");
    }
    assert_ne!(resumed["RANK"], fresh["RANK"]);
    finish(out, &mut agents);
}

/// Two hosts of two ranks each; host b's local rank 1 fails. It alone is started anew; host b's
/// local rank 0 and both of host a's keep their processes and run the function again in the
/// next round, which counts the restart once. What the failed worker left running (its data
/// loader's worker process) is gone.
#[test]
fn a_worker_whose_own_rank_failed_is_started_anew_and_every_other_rank_keeps_its_process() {
    let mut job = Job::start_with("2", 2, "resilient-rank", 3);
    let out = job.out().to_path_buf();
    let b1: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("env.b.1.1.json")).unwrap()).unwrap();
    let loader_of_b1 = b1["loader_pids"][0].as_i64().expect("host b's local rank 1 has a data loader worker");
    std::fs::write(out.join("crash_b.1"), b"").unwrap();
    job.reformed_around_b1(1, Duration::from_secs(60));
    // The kept ones ran the function a second time; the new one its first.
    let b0 = std::fs::read_to_string(out.join("env.b.0.2.json")).expect("host b's local rank 0 ran again");
    let b0: serde_json::Value = serde_json::from_str(&b0).unwrap();
    assert_eq!(b0["env"]["TORCHELASTIC_RESTART_COUNT"], "1", "{b0:#}");
    assert!(b0["resumed_at_step"].as_u64().unwrap() > 0, "resumed from its snapshot: {b0:#}");
    // The failed worker's data loader process went with it (killed by the agent as the others
    // parked, not by torch's own watchdog, which looks every 5 s).
    let state = std::fs::read_to_string(format!("/proc/{loader_of_b1}/stat")).unwrap_or_default();
    let running = state.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'));
    assert!(!running, "the failed worker's data loader process {loader_of_b1} still runs: {state}");
    let log = std::fs::read_to_string(out.join("rlaunch-b.log")).unwrap();
    assert!(log.contains("this node's other workers keep their processes"), "{log}");
    integration_tests::netns::finish(&out, &mut job.agents);
}

/// Host b's local rank 1 fails, and its replacement fails again as it starts: each failure costs
/// the other three ranks nothing (each counts against the budget), and the third worker of that
/// rank trains with them.
#[test]
fn a_replacement_that_fails_as_it_starts_is_started_anew_again_and_the_others_still_keep_their_processes() {
    let mut job = Job::start_with("2", 2, "resilient-rank-again", 3);
    let out = job.out().to_path_buf();
    std::fs::write(out.join("crash_at_start_b.1"), b"2").unwrap();
    std::fs::write(out.join("crash_b.1"), b"").unwrap();
    job.reformed_around_b1(2, Duration::from_secs(90));
    let log = std::fs::read_to_string(out.join("rlaunch-b.log")).unwrap();
    assert_eq!(log.matches("this node's other workers keep their processes").count(), 2, "{log}");
    integration_tests::netns::finish(&out, &mut job.agents);
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

/// The step a worker recorded in `OUT/held_HOST` when it was held in a phase.
fn held_step(out: &std::path::Path, host: &str) -> u64 {
    let path = out.join(format!("held_{host}"));
    let mut step = None;
    integration_tests::wait_until(&format!("host {host} to be held"), Duration::from_secs(60), || {
        // Written in place: read until it parses.
        step = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse().ok());
        step.is_some()
    });
    step.expect("the held step")
}

/// Host b is lost (its link cut, its processes killed 0.3 s later) while host `holder`'s worker
/// is held in `phase` of a step (the other worker then waits in that step's next collective):
/// host a's worker keeps its process, resumes at the step in flight or the one after (at most
/// that step computed again, none skipped), with a state that matches the step it resumed at,
/// and trains on.
fn node_lost_while_a_worker_is_in(phase: &str, holder: &str) {
    use integration_tests::netns::{self, finish, wait_formed};

    let job = Job::start("1:2", &format!("resilient-{phase}"), 3);
    let Job { cluster, mut agents, before, dir, .. } = job;
    let out = dir.path();
    std::fs::write(out.join(format!("hold_{holder}")), phase).unwrap();
    let in_flight = held_step(out, holder);
    let t0 = netns::now_unix_f64();
    cluster.host(1).cut_link();
    std::thread::sleep(Duration::from_millis(300));
    cluster.host(1).kill_all();
    let after = wait_formed(out, &["a"], 1, &mut agents[..1], Duration::from_secs(40));
    assert_eq!(after[0].pid, Job::pid(&before, "a"), "host a's worker kept its process");
    let second = entry_env(out, "a", 2).expect("host a's function ran again");
    let resumed = second["resumed_at_step"].as_u64().unwrap();
    eprintln!(
        "host b lost while host {holder} was in {phase} of step {in_flight}: host a ran again after {:.2} s, at step {resumed}",
        after[0].t - t0
    );
    assert!(
        (in_flight..=in_flight + 1).contains(&resumed),
        "the fault came in {phase} of step {in_flight}; host a resumed at step {resumed}"
    );
    // The counter adds 1 each step: a state restored for step s-1 holds s. A half-made step's
    // state (one whose optimizer step ran, its snapshot not committed) would not.
    assert_eq!(second["counter"].as_f64(), Some(resumed as f64), "the state matches its step: {second:#}");
    integration_tests::wait_until("host a to train on", Duration::from_secs(30), || {
        std::fs::read_to_string(out.join("saved.a"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .is_some_and(|s| s >= resumed + 3)
    });
    finish(out, &mut agents[..1]);
}

/// The agent's word comes while host a's worker computes its forward pass (no collective in
/// flight): its next collective, the gradients' all-reduce, fails at once and it parks.
#[test]
fn a_node_lost_during_the_survivor_s_forward_pass_costs_it_no_process() {
    node_lost_while_a_worker_is_in("forward", "a");
}

/// Host b held before its backward: host a waits in the gradients' all-reduce (DDP's bucket)
/// on a peer that then vanishes.
#[test]
fn a_node_lost_during_the_survivor_s_gradient_all_reduce_costs_it_no_process() {
    node_lost_while_a_worker_is_in("backward", "b");
}

/// The word comes between the gradients' all-reduce and the optimizer step: the step is taken
/// locally, its snapshot refused (the round ended), and the state comes back from the step before.
#[test]
fn a_node_lost_during_the_survivor_s_optimizer_step_costs_it_no_process() {
    node_lost_while_a_worker_is_in("optimizer", "a");
}

/// The word comes while host a's worker is inside `rlaunch.snapshot.save`, its state half
/// written: never half a step restored.
#[test]
fn a_node_lost_while_the_survivor_saves_costs_it_no_process_and_no_half_step() {
    node_lost_while_a_worker_is_in("save", "a");
}

/// A fault during the recovery: host b's worker fails, and its replacement fails again as soon
/// as it starts, twice, while host a's worker is making the new round's process group (waiting
/// on its store for a peer that never comes). Host a's worker keeps one process through the
/// three rounds and trains on with the third.
#[test]
fn faults_during_the_recovery_itself_cost_the_survivor_no_process() {
    use integration_tests::netns::{finish, wait_formed};

    let Job { mut agents, before, dir, cluster: _hosts, .. } = Job::start("2", "resilient-again", 5);
    let out = dir.path();
    std::fs::write(out.join("crash_at_start_b"), b"3").unwrap();
    std::fs::write(out.join("crash_b"), b"").unwrap();
    integration_tests::wait_until("the group to form with restart 3", Duration::from_secs(90), || {
        integration_tests::netns::formed(out, &["a", "b"], 1).is_some_and(|g| g.iter().all(|s| s.restart == 3))
    });
    let after = wait_formed(out, &["a", "b"], 1, &mut agents, Duration::from_secs(5));
    assert_eq!(Job::pid(&after, "a"), Job::pid(&before, "a"), "host a's worker kept its process");
    let entries = std::fs::read_to_string(out.join("entries.a")).unwrap();
    let restarts: Vec<&str> = entries.lines().filter_map(|l| l.split("restart=").nth(1)).collect();
    eprintln!("host a's entries:\n{entries}");
    assert_eq!(restarts, ["0", "1", "2", "3"], "an entry in every round, each made anew: {entries}");
    let pids: std::collections::BTreeSet<&str> = entries.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(pids.len(), 1, "one process: {entries}");
    let log = std::fs::read_to_string(out.join("rlaunch-a.log")).unwrap_or_default();
    assert!(!log.contains("not every worker ended its round"), "host a's worker parked each time:\n{log}");
    finish(out, &mut agents);
}

/// The Rust runtime's side: `examples/train` (its rounds under `rlaunch::resilient::run`) on two
/// hosts, one rank each, a snapshot every step. Host b's link is cut, then its processes killed:
/// host a's rank keeps its process, which joins a group of one (the TCP ring's transfer that
/// waited on host b ended by the agent's word) and resumes from the agents' snapshot. Then host b
/// comes back and joins: the same process makes a group of two with host b's fresh worker, and
/// the run finishes.
#[test]
fn a_rust_survivor_keeps_its_process_through_a_loss_and_a_join() {
    use integration_tests::netns::{self, Cluster, Proc};

    let cluster = Cluster::new(2);
    let dir = integration_tests::tempdir();
    let endpoint = format!("{}:29400", cluster.host(0).ip);
    let train = integration_tests::bin("examples/train");
    let program = [
        train.to_str().unwrap(),
        "--steps",
        "300",
        "--epochs",
        "100",
        "--no-checkpoint",
        "--log-every",
        "20",
        "--slow-rank",
        "0",
        "--slow-ms",
        "40",
    ];
    let args = netns::rdzv_args("1:2", 1, &endpoint, "resilient-rust", CONF, "3", &program);
    let agent = |i: usize, log: &str| {
        let h = cluster.host(i);
        let mut c = h.command(integration_tests::bin("rlaunch"));
        c.args(&args).env("RLAUNCH_LOG", "info");
        Proc::spawn(c, &format!("rlaunch on host {}", h.name), &dir.path().join(log))
    };
    let mut a = agent(0, "rlaunch-a.log");
    // Host a joins first, so its worker is rank 0 (the one that logs steps): started as soon as
    // host a's server listened, host b once joined before host a itself did.
    integration_tests::wait_until("host a to host the rendezvous server and join it", Duration::from_secs(10), || {
        netns::listening(&endpoint) && a.output().contains("joined forming round 1")
    });
    let _b = agent(1, "rlaunch-b.log");
    let rounds = |out: &str| -> Vec<String> {
        out.lines().filter(|l| l.contains("[default0]:train: world")).map(str::to_owned).collect()
    };
    integration_tests::wait_until("the two hosts to train together", Duration::from_secs(60), || {
        a.output().contains("train: world 2") && a.output().contains("[default0]:step     60 ")
    });
    let t0 = netns::now_unix_f64();
    cluster.host(1).cut_link();
    std::thread::sleep(Duration::from_millis(300));
    cluster.host(1).kill_all();
    integration_tests::wait_until("host a to train alone", Duration::from_secs(30), || rounds(&a.output()).len() >= 2);
    eprintln!("host a alone {:.2} s after the cut", netns::now_unix_f64() - t0);
    cluster.host(1).restore_link();
    let mut b = agent(1, "rlaunch-b-again.log");
    // (A step takes 0.1 to 0.4 s in a debug build on a busy two-core machine.)
    let status = a.wait(Duration::from_secs(240));
    let out = a.output();
    assert!(status.success(), "host a's job failed ({status}):\n{}", a.log_tail(4000));
    assert!(b.wait(Duration::from_secs(30)).success(), "host b's second agent:\n{}", b.log_tail(4000));
    let rounds = rounds(&out);
    eprintln!("host a's rounds:\n{}", rounds.join("\n"));
    assert_eq!(rounds.len(), 3, "with host b, alone, with host b again:\n{out}");
    for (i, (line, world)) in rounds.iter().zip(["world 2", "world 1", "world 2"]).enumerate() {
        assert!(line.contains(world) && line.ends_with(&format!("round {}", i + 1)), "{line}");
    }
    assert!(rounds[1].contains("from the agents' snapshot"), "resumed from memory: {}", rounds[1]);
    assert!(rounds[2].contains("from the agents' snapshot"), "resumed from memory: {}", rounds[2]);
    let pid = |l: &str| l.split(" pid ").nth(1).and_then(|p| p.split_whitespace().next()).map(str::to_owned);
    assert!(rounds.iter().all(|l| pid(l) == pid(&rounds[0])), "the same process ran every round");
    assert!(out.contains("[default0]:done: 300 steps"), "{out}");
    assert!(out.contains("the workers keep their processes"), "host a's agent log:\n{out}");
}

/// The decorator's side of an end that comes right behind a resume, against a scripted agent:
/// the function does not run on in the round that ended (`integration-tests/py/resilient_protocol.py`).
#[test]
fn an_end_right_behind_a_resume_never_lets_the_python_function_run_on_in_that_round() {
    let script = repo_root().join("integration-tests/py/resilient_protocol.py");
    let o = run_deadline(Command::new(venv_python()).arg(&script), Duration::from_secs(60));
    let out = stdout_of(&o);
    assert!(o.status.success(), "{out}\n{}", stderr_of(&o));
    assert!(out.starts_with("ok "), "{out}");
}

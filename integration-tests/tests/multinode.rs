//! Multi-node jobs across network namespaces (one per host, see `integration_tests::netns`): the
//! agent-hosted rendezvous server and a standalone `rlaunch-rendezvous` (memory store); ranks,
//! node loss (every process of a host killed), partition (a host's link cut: no TCP reset),
//! scale-up, and worker crashes restarting every host with the budget counted once.
//!
//! Run as root, after `cargo build --workspace --bins --examples`:
//! `cargo test -p integration-tests --test multinode -- --test-threads 1`.

use std::path::Path;
use std::time::{Duration, Instant};

use integration_tests::netns::{
    self, finish, formed, listening, loop_worker, now_unix_f64, rdzv_status, starts, status_members, Cluster, Proc,
    Start,
};
use integration_tests::{bin, pid_alive, target_dir, tempdir, wait_until, worker};

const NPROC: u32 = 2;
/// Heartbeats every 0.5 s, a node is lost after 2 s without one.
const TTL_S: f64 = 2.0;
const CONF: &str = "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=30";
/// Each host's agent hosts-or-joins the rendezvous on this port of host a (every namespace has
/// its own port space, so a fixed port is fine).
const RDZV_PORT: u16 = 29400;
const FORM: Duration = Duration::from_secs(20);
/// Node loss must be noticed and the survivors running again within the TTL plus this.
const RECOVERY_SLACK_S: f64 = 5.0;

/// The agent's command line: `--nproc-per-node 2`, short timeouts, `--shutdown-timeout 3`, then
/// `extra`, then the program and its arguments.
fn agent_args(nnodes: &str, endpoint: &str, run_id: &str, extra: &[&str], program: &[&str]) -> Vec<String> {
    let rest: Vec<&str> = extra.iter().chain(program).copied().collect();
    netns::rdzv_args(nnodes, NPROC, endpoint, run_id, CONF, "3", &rest)
}

/// Waits until `hosts` run one consistent group (see `netns::formed`); panics early if an
/// agent exits meanwhile.
fn wait_formed(dir: &Path, hosts: &[&str], agents: &mut [Proc], deadline: Duration) -> Vec<Start> {
    netns::wait_formed(dir, hosts, NPROC, agents, deadline)
}

fn touch(path: &Path) {
    std::fs::write(path, b"").expect("touch a marker file");
}

/// The looping worker as the program: `sh SCRIPT OUT`.
fn loop_program(dir: &Path) -> Vec<String> {
    vec![loop_worker(dir).display().to_string(), dir.display().to_string()]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `n` hosts with fixed `--nnodes n` run `test_worker dump-env` on the agent-hosted server:
/// every worker sees a consistent, torchrun-shaped placement.
/// With `standalone_server`, on an `rlaunch-rendezvous` (memory store) in the root namespace
/// instead of the server hosted by host a's agent.
fn ranks_are_consistent_across_hosts(n: usize, standalone_server: bool) {
    let cluster = Cluster::new(n);
    let dir = tempdir();
    let mut _server = None;
    let endpoint = if standalone_server {
        let listen = format!("{}:{}", cluster.root_ip(), cluster.free_root_port());
        let mut cmd = std::process::Command::new(bin("rlaunch-rendezvous"));
        cmd.args(["--listen", &listen, "--store", "memory"]).env("RLAUNCH_LOG", "info");
        _server = Some(Proc::spawn(cmd, "rlaunch-rendezvous", &dir.path().join("server.log")));
        listen
    } else {
        format!("{}:{RDZV_PORT}", cluster.host(0).ip)
    };
    let w = worker().display().to_string();
    let program = [w.as_str(), "--out", dir.path().to_str().expect("utf-8 temp dir"), "dump-env"];
    let args = agent_args(&n.to_string(), &endpoint, "ranks", &[], &program);
    let mut agents = vec![cluster.host(0).rlaunch(dir.path(), &args)];
    wait_until("the rendezvous server to listen", Duration::from_secs(10), || listening(&endpoint));
    for h in &cluster.hosts()[1..] {
        agents.push(h.rlaunch(dir.path(), &args));
    }
    for a in &mut agents {
        let status = a.wait(Duration::from_secs(25));
        assert!(status.success(), "{} failed ({status}):\n{}", a.name, a.log_tail(3000));
    }
    let world = n as u32 * NPROC;
    let host_ips: Vec<&str> = cluster.hosts().iter().map(|h| h.ip.as_str()).collect();
    let mut masters = std::collections::BTreeSet::new();
    let mut group_rank_of_host = std::collections::BTreeMap::new();
    for rank in 0..world {
        let path = dir.path().join(format!("env_rank{rank}_attempt0.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("rank {rank} wrote no env ({e})"));
        let env: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).expect("env json");
        let get = |k: &str| {
            env.get(k).and_then(|v| v.as_str()).unwrap_or_else(|| panic!("rank {rank}: {k} unset")).to_string()
        };
        let num = |k: &str| get(k).parse::<u32>().unwrap_or_else(|_| panic!("rank {rank}: {k} not a number"));
        assert_eq!(num("RANK"), rank);
        assert_eq!(num("WORLD_SIZE"), world, "rank {rank}");
        assert_eq!(num("GROUP_WORLD_SIZE"), n as u32, "rank {rank}");
        assert_eq!(num("LOCAL_WORLD_SIZE"), NPROC, "rank {rank}");
        assert_eq!(num("ROLE_WORLD_SIZE"), world, "rank {rank}");
        assert_eq!(num("ROLE_RANK"), rank, "rank {rank}");
        assert_eq!(num("GROUP_RANK") * NPROC + num("LOCAL_RANK"), rank, "ranks are prefix sums in group-rank order");
        assert_eq!(num("TORCHELASTIC_RESTART_COUNT"), 0);
        assert_eq!(get("TORCHELASTIC_RUN_ID"), "ranks");
        let host = get("RL_HOST");
        let prev = group_rank_of_host.insert(host.clone(), num("GROUP_RANK"));
        assert!(prev.is_none() || prev == Some(num("GROUP_RANK")), "host {host} has two group ranks");
        masters.insert((get("MASTER_ADDR"), get("MASTER_PORT")));
    }
    assert_eq!(group_rank_of_host.len(), n, "every host ran workers: {group_rank_of_host:?}");
    assert_eq!(masters.len(), 1, "one master store for the whole job: {masters:?}");
    let (addr, _) = masters.into_iter().next().expect("one master");
    assert!(host_ips.contains(&addr.as_str()), "MASTER_ADDR {addr} is a host's address ({host_ips:?}), never loopback");
    // The master store is hosted by the group-rank-0 agent.
    let rank0_host = group_rank_of_host.iter().find(|(_, g)| **g == 0).map(|(h, _)| h.clone()).expect("a group rank 0");
    let rank0_ip = &cluster.hosts().iter().find(|h| h.name == rank0_host).expect("known host").ip;
    assert_eq!(&addr, rank0_ip, "MASTER_ADDR is the group rank 0 host");
}

#[test]
fn two_hosts_get_contiguous_ranks_and_one_master_on_the_agent_hosted_server() {
    ranks_are_consistent_across_hosts(2, false);
}

#[test]
fn three_hosts_get_contiguous_ranks_and_one_master_on_the_agent_hosted_server() {
    ranks_are_consistent_across_hosts(3, false);
}

#[test]
fn three_hosts_get_contiguous_ranks_and_one_master_on_a_standalone_server() {
    ranks_are_consistent_across_hosts(3, true);
}

/// Starts `hosts` of `cluster` running the looping worker under `nnodes` on the agent-hosted
/// server (host a first, the others once it listens).
fn start_loop_job(
    cluster: &Cluster,
    dir: &Path,
    nnodes: &str,
    run_id: &str,
    hosts: &[usize],
    extra: &[&str],
) -> Vec<Proc> {
    let endpoint = format!("{}:{RDZV_PORT}", cluster.host(0).ip);
    let args = agent_args(nnodes, &endpoint, run_id, extra, &strs(&loop_program(dir)));
    let mut agents = Vec::new();
    for &i in hosts {
        agents.push(cluster.host(i).rlaunch(dir, &args));
        if i == 0 {
            wait_until("host a to host the rendezvous server", Duration::from_secs(10), || listening(&endpoint));
        }
    }
    agents
}

/// Seconds from `t0` until the last of `group`'s workers started.
fn recovery_s(group: &[Start], t0: f64) -> f64 {
    group.iter().map(|s| s.t).fold(f64::MIN, f64::max) - t0
}

fn assert_stopped(before: &[Start], hosts: &[&str]) {
    for s in before.iter().filter(|s| hosts.contains(&s.host.as_str())) {
        assert!(!pid_alive(s.pid), "the old worker {} (rank {}) on host {} was not stopped", s.pid, s.rank, s.host);
    }
}

#[test]
fn killing_every_process_of_a_host_reforms_the_survivors_within_the_ttl() {
    let cluster = Cluster::new(3);
    let dir = tempdir();
    let mut agents = start_loop_job(&cluster, dir.path(), "1:3", "kill", &[0, 1, 2], &[]);
    let before = wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);

    let t0 = now_unix_f64();
    cluster.host(2).kill_all();
    let after = wait_formed(dir.path(), &["a", "b"], &mut agents[..2], Duration::from_secs_f64(TTL_S + 10.0));
    let took = recovery_s(&after, t0);
    eprintln!("node loss (kill): survivors running again with WORLD_SIZE 4 after {took:.2} s");
    assert_stopped(&before, &["a", "b"]);
    assert!(cluster.host(2).pids().is_empty(), "host c has no process left");
    assert!(
        took < TTL_S + RECOVERY_SLACK_S,
        "recovery took {took:.2} s, more than the TTL ({TTL_S} s) + {RECOVERY_SLACK_S} s"
    );
    assert!(
        after.iter().all(|s| s.restart == before[0].restart),
        "a node loss does not spend the restart budget: {after:?}"
    );
    finish(dir.path(), &mut agents[..2]);
}

#[test]
fn cutting_a_hosts_link_reforms_the_survivors_and_the_host_rejoins_when_restored() {
    let cluster = Cluster::new(3);
    let dir = tempdir();
    let mut agents = start_loop_job(&cluster, dir.path(), "1:3", "cut", &[0, 1, 2], &[]);
    let before = wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);

    let t0 = now_unix_f64();
    cluster.host(2).cut_link();
    let after = wait_formed(dir.path(), &["a", "b"], &mut agents[..2], Duration::from_secs_f64(TTL_S + 10.0));
    let took = recovery_s(&after, t0);
    eprintln!("partition (link cut): survivors running again with WORLD_SIZE 4 after {took:.2} s");
    assert_stopped(&before, &["a", "b"]);
    assert!(
        took < TTL_S + RECOVERY_SLACK_S,
        "recovery took {took:.2} s, more than the TTL ({TTL_S} s) + {RECOVERY_SLACK_S} s"
    );
    assert!(agents[2].try_status().is_none(), "the cut-off agent keeps running (it may come back)");
    let fenced = before.iter().filter(|s| s.host == "c").all(|s| !pid_alive(s.pid));
    eprintln!(
        "partition: host c's workers from before the cut are {} once the survivors re-formed",
        if fenced { "stopped" } else { "STILL RUNNING" }
    );

    cluster.host(2).restore_link();
    wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);
    finish(dir.path(), &mut agents);
    for h in cluster.hosts() {
        wait_until(&format!("host {} to have no process left", h.name), Duration::from_secs(5), || h.pids().is_empty());
    }
}

#[test]
fn a_host_joining_a_running_job_scales_it_up_to_three_nodes() {
    let cluster = Cluster::new(3);
    let dir = tempdir();
    let mut agents = start_loop_job(&cluster, dir.path(), "2:3", "scale", &[0, 1], &[]);
    {
        let before = wait_formed(dir.path(), &["a", "b"], &mut agents[..2], FORM);
        assert!(before.iter().all(|s| s.world_size == 4));
    }
    let endpoint = format!("{}:{RDZV_PORT}", cluster.host(0).ip);
    let args = agent_args("2:3", &endpoint, "scale", &[], &strs(&loop_program(dir.path())));
    agents.push(cluster.host(2).rlaunch(dir.path(), &args));
    let t0 = now_unix_f64();
    let after = wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);
    eprintln!(
        "scale-up: 3 nodes running with WORLD_SIZE 6 {:.2} s after the third agent started",
        recovery_s(&after, t0)
    );
    finish(dir.path(), &mut agents);
}

#[test]
fn a_worker_crash_restarts_every_host_and_spends_the_budget_once() {
    let cluster = Cluster::new(2);
    let dir = tempdir();
    // Attempt 0: every worker on both hosts crashes as it starts, so both agents report a
    // failure of the same round (unless the first report stops the other host's workers first).
    // That is one failure of the job: one restart, within a budget of 1.
    touch(&dir.path().join("crash_all_0"));
    let mut agents = start_loop_job(&cluster, dir.path(), "2", "crash", &[0, 1], &["--max-restarts", "1"]);
    let group = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    assert!(group.iter().all(|s| s.restart == 1), "TORCHELASTIC_RESTART_COUNT is 1 on every worker: {group:#?}");
    let reporters = agents.iter().filter(|a| a.output().contains("worker failed; reporting to the rendezvous")).count();
    eprintln!("attempt 0: {reporters} of 2 agents reported a failure; restarted once");
    // Stay up a little: no second restart follows from the other host's report.
    std::thread::sleep(Duration::from_secs(1));
    assert!(starts(dir.path()).iter().all(|s| s.restart <= 1), "no host restarted twice: {:#?}", starts(dir.path()));
    assert!(formed(dir.path(), &["a", "b"], NPROC).is_some(), "the job still runs: {:#?}", starts(dir.path()));
    let status = rdzv_status("rlaunch", &format!("{}:{RDZV_PORT}", cluster.host(0).ip), "crash");
    assert_eq!(status["restart_count"], 1, "the rendezvous counted one restart: {status:#}");
    assert_eq!(status["max_restarts"], 1, "{status:#}");
    assert_eq!(status["last_root_cause"]["exit"]["code"], 7, "the root cause is kept in the rendezvous: {status:#}");
    assert_eq!(status_members(&status).len(), 2, "{status:#}");

    // The budget (1) is spent: the next crash fails the job on every host with its root cause.
    let crashing = group.iter().find(|s| s.host == "b" && s.local_rank == 0).expect("b's local rank 0").clone();
    touch(&dir.path().join("crash_b_0_1"));
    for a in &mut agents {
        let status = a.wait(Duration::from_secs(20));
        assert_eq!(status.code(), Some(7), "{} exits with the failing worker's code:\n{}", a.name, a.log_tail(3000));
        let log = a.output();
        assert!(log.contains("Root Cause"), "{} prints the root cause:\n{}", a.name, a.log_tail(3000));
        assert!(log.contains("exit        : exit code 7"), "{}:\n{}", a.name, a.log_tail(3000));
        assert!(
            log.contains(&format!("rank        : {} (local_rank: 0)", crashing.rank)),
            "{} names the failing rank {}:\n{}",
            a.name,
            crashing.rank,
            a.log_tail(3000)
        );
        assert!(log.contains("host        : b"), "{} names the failing host:\n{}", a.name, a.log_tail(3000));
    }
    assert!(starts(dir.path()).iter().all(|s| s.restart <= 1), "no third attempt: {:#?}", starts(dir.path()));
}

#[test]
fn two_hosts_on_a_standalone_rendezvous_server_reform_after_a_node_loss() {
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let listen = format!("{}:{}", cluster.root_ip(), cluster.free_root_port());
    let mut server_cmd = std::process::Command::new(bin("rlaunch-rendezvous"));
    server_cmd.args(["--listen", &listen, "--store", "memory"]).env("RLAUNCH_LOG", "info");
    let _server = Proc::spawn(server_cmd, "rlaunch-rendezvous", &dir.path().join("server.log"));
    wait_until("the rendezvous server to listen", Duration::from_secs(10), || listening(&listen));

    let args = agent_args("1:2", &listen, "standalone", &[], &strs(&loop_program(dir.path())));
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    let before = wait_formed(dir.path(), &["a", "b"], &mut agents[..2], FORM);
    assert!(
        before.iter().all(|s| cluster.hosts().iter().any(|h| s.master.starts_with(&format!("{}:", h.ip)))),
        "the workers' store is on a host, not on the rendezvous server: {before:?}"
    );

    let t0 = now_unix_f64();
    cluster.host(1).kill_all();
    let after = wait_formed(dir.path(), &["a"], &mut agents[..1], Duration::from_secs_f64(TTL_S + 10.0));
    let took = recovery_s(&after, t0);
    eprintln!("standalone server, node loss: host a running alone after {took:.2} s");
    assert!(took < TTL_S + RECOVERY_SLACK_S, "recovery took {took:.2} s");
    assert_stopped(&before, &["a"]);
    // `rlaunch status` shows the re-formed job: host a alone, no restart spent.
    let status = rdzv_status("rlaunch", &listen, "standalone");
    let members = status_members(&status);
    assert!(members.len() == 1 && members[0].starts_with("a-"), "members are host a's agent only: {status:#}");
    assert_eq!(status["world_size"], 2, "{status:#}");
    assert_eq!(status["restart_count"], 0, "a node loss spends no restart: {status:#}");
    assert!(status["round"].as_u64().is_some_and(|r| r >= 2), "a new round: {status:#}");
    finish(dir.path(), &mut agents[..1]);
}

#[test]
fn a_host_started_before_the_hosting_host_waits_for_its_server() {
    // All nodes of a job start at about the same time; the one whose address is the endpoint
    // may come up last. The others must wait for its server, as torchrun's c10d agents do.
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let endpoint = format!("{}:{RDZV_PORT}", cluster.host(0).ip);
    let args = agent_args("2", &endpoint, "order", &[], &strs(&loop_program(dir.path())));
    let b = cluster.host(1).rlaunch(dir.path(), &args);
    std::thread::sleep(Duration::from_millis(1500));
    let a = cluster.host(0).rlaunch(dir.path(), &args);
    let mut agents = [a, b];
    wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    finish(dir.path(), &mut agents);
}

#[test]
fn losing_the_host_of_the_agent_hosted_server_ends_the_job_on_the_others() {
    // The agent-hosted server is a single point of failure by design (use rlaunch-rendezvous on
    // etcd to have none); what is asked here is that the survivors do not hang forever.
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let endpoint = format!("{}:{RDZV_PORT}", cluster.host(0).ip);
    let conf = "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=5";
    let mut args = agent_args("1:2", &endpoint, "spof", &[], &strs(&loop_program(dir.path())));
    let i = args.iter().position(|a| a == CONF).expect("conf in args");
    args[i] = conf.to_string();
    let a = cluster.host(0).rlaunch(dir.path(), &args);
    wait_until("host a to host the rendezvous server", Duration::from_secs(10), || listening(&endpoint));
    let b = cluster.host(1).rlaunch(dir.path(), &args);
    let mut agents = [a, b];
    let before = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    let t0 = Instant::now();
    cluster.host(0).kill_all();
    // It fences itself after the TTL, then gives up once the join timeout (5 s) has passed
    // without the rendezvous (today after about twice that: see the report on the double count).
    let status = agents[1].wait(Duration::from_secs(30));
    eprintln!("host b's agent exited {status} {:.1} s after host a was lost", t0.elapsed().as_secs_f64());
    assert!(!status.success(), "the job did not succeed");
    assert!(
        agents[1].output().contains("unreachable"),
        "host b says the rendezvous is unreachable:\n{}",
        agents[1].log_tail(2000)
    );
    assert_stopped(&before, &["b"]);
    assert!(cluster.host(1).pids().is_empty(), "nothing is left running on host b");
}

#[test]
fn a_cut_off_host_stops_its_own_workers_once_its_ttl_has_lapsed() {
    // Once its heartbeats have lapsed for a TTL, the rendezvous has given this node's ranks to
    // others: its workers must stop (a second rank 0 writing checkpoints is split brain).
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let mut agents = start_loop_job(&cluster, dir.path(), "1:2", "fence", &[0, 1], &[]);
    let before = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    cluster.host(1).cut_link();
    wait_formed(dir.path(), &["a"], &mut agents[..1], Duration::from_secs_f64(TTL_S + 10.0));
    let old_b: Vec<i32> = before.iter().filter(|s| s.host == "b").map(|s| s.pid).collect();
    wait_until("the cut-off host's workers to stop", Duration::from_secs_f64(TTL_S + RECOVERY_SLACK_S), || {
        old_b.iter().all(|p| !pid_alive(*p))
    });
    cluster.host(1).restore_link();
    wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    finish(dir.path(), &mut agents);
}

#[test]
fn the_hosting_host_finishing_first_does_not_end_the_job_for_the_others() {
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let mut agents = start_loop_job(&cluster, dir.path(), "2", "finish", &[0, 1], &[]);
    let group = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    touch(&dir.path().join("stop_a"));
    let a_pids: Vec<i32> = group.iter().filter(|s| s.host == "a").map(|s| s.pid).collect();
    wait_until("host a's workers to finish", Duration::from_secs(5), || a_pids.iter().all(|p| !pid_alive(*p)));
    // Host b goes on: same workers, no new round, and host a's agent keeps serving.
    let n = starts(dir.path()).len();
    let until = Instant::now() + Duration::from_secs_f64(TTL_S * 1.5);
    while Instant::now() < until {
        for s in group.iter().filter(|s| s.host == "b") {
            assert!(pid_alive(s.pid), "host b's worker rank {} was stopped when host a finished", s.rank);
        }
        assert!(agents[0].try_status().is_none(), "host a's agent (the rendezvous server) left before the job ended");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(starts(dir.path()).len(), n, "no worker was restarted: {:#?}", starts(dir.path()));
    touch(&dir.path().join("stop_b"));
    for a in &mut agents {
        let status = a.wait(Duration::from_secs(20));
        assert!(status.success(), "{} did not succeed ({status}):\n{}", a.name, a.log_tail(3000));
    }
}

#[test]
fn a_host_beyond_max_waits_and_takes_the_place_of_a_lost_one() {
    let cluster = Cluster::new(4);
    let dir = tempdir();
    let mut agents = start_loop_job(&cluster, dir.path(), "2:3", "beyond-max", &[0, 1, 2], &[]);
    let group = wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);
    let endpoint = format!("{}:{RDZV_PORT}", cluster.host(0).ip);
    let args = agent_args("2:3", &endpoint, "beyond-max", &[], &strs(&loop_program(dir.path())));
    agents.push(cluster.host(3).rlaunch(dir.path(), &args));
    // MAX (3) nodes run: host d waits, and nobody is disturbed.
    let n = starts(dir.path()).len();
    let until = Instant::now() + Duration::from_secs_f64(TTL_S * 1.5);
    while Instant::now() < until {
        assert!(group.iter().all(|s| pid_alive(s.pid)), "a running worker was stopped by a fourth host joining");
        assert!(agents[3].try_status().is_none(), "host d's agent gave up waiting");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(starts(dir.path()).len(), n, "no worker was (re)started: {:#?}", starts(dir.path()));
    // Host c is lost: d takes its place.
    cluster.host(2).kill_all();
    let mut live: Vec<Proc> = agents.drain(..).enumerate().filter(|(i, _)| *i != 2).map(|(_, p)| p).collect();
    wait_formed(dir.path(), &["a", "b", "d"], &mut live, Duration::from_secs_f64(TTL_S + 10.0));
    finish(dir.path(), &mut live);
}

#[test]
fn static_rendezvous_runs_two_hosts_with_fixed_ranks_and_node_0s_store() {
    // torch.distributed.launch style: no rendezvous, `--node-rank` fixes the ranks and node 0's
    // agent serves the workers' store on `--master-port`; a PyTorch-free check that the workers
    // of both hosts reach that store is the Rust runtime's bootstrap through it.
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let master = cluster.host(0).ip.clone();
    let w = worker().display().to_string();
    let agents: Vec<Proc> = (0..2)
        .map(|node_rank| {
            let args: Vec<String> = [
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                &node_rank.to_string(),
                "--master-addr",
                &master,
                "--master-port",
                "29511",
                "--rdzv-id",
                "static-job",
                &w,
                "--out",
                dir.path().to_str().expect("utf-8"),
                "dump-env",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            cluster.host(node_rank).rlaunch(dir.path(), &args)
        })
        .collect();
    for mut a in agents {
        let status = a.wait(Duration::from_secs(30));
        assert!(status.success(), "{} failed ({status}):\n{}", a.name, a.log_tail(3000));
    }
    for rank in 0..4u32 {
        let text =
            std::fs::read_to_string(dir.path().join(format!("env_rank{rank}_attempt0.json"))).expect("env written");
        let env: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).expect("env json");
        let get = |k: &str| env.get(k).and_then(|v| v.as_str()).unwrap_or_default().to_string();
        assert_eq!(get("WORLD_SIZE"), "4");
        assert_eq!(get("GROUP_RANK"), (rank / 2).to_string());
        assert_eq!(get("RL_HOST"), if rank < 2 { "a" } else { "b" });
        assert_eq!((get("MASTER_ADDR"), get("MASTER_PORT")), (master.clone(), "29511".to_string()));
        assert_eq!(get("TORCHELASTIC_RUN_ID"), "static-job");
    }
}

#[test]
fn train_runs_across_two_hosts_with_hierarchical_collectives() {
    // The Rust runtime's real distributed step across hosts: two namespaces with two ranks
    // each, bootstrapped through the agent-hosted store of group rank 0.
    let train = target_dir().join("examples/train");
    assert!(train.exists(), "{} is not built: cargo build --workspace --examples", train.display());
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let endpoint = format!("{}:{RDZV_PORT}", cluster.host(0).ip);
    let t = train.display().to_string();
    let ckpt = dir.path().join("ckpt");
    let program = [t.as_str(), "--steps", "60", "--no-checkpoint", "--log-every", "20"];
    let args = agent_args("2", &endpoint, "train2", &[], &program);
    let mut agents = vec![cluster.host(0).rlaunch(dir.path(), &args)];
    wait_until("the rendezvous server to listen", Duration::from_secs(10), || listening(&endpoint));
    agents.push(cluster.host(1).rlaunch(dir.path(), &args));
    for a in &mut agents {
        let status = a.wait(Duration::from_secs(90));
        assert!(status.success(), "{} failed ({status}):\n{}", a.name, a.log_tail(3000));
    }
    let out = agents[0].output() + &agents[1].output();
    assert!(out.contains("[default0]:done: 60 steps"), "rank 0 finished training:\n{}", agents[0].log_tail(3000));
    assert!(!ckpt.exists());
}

/// `rlaunch ARGS` on `host` with one NCCL variable set to `nccl` (what differs between nodes).
fn rlaunch_with_nccl(host: &netns::Host, dir: &Path, args: &[String], nccl: &str) -> Proc {
    let mut c = host.command(bin("rlaunch"));
    c.args(args).env("RLAUNCH_LOG", "info").env("RL_HOST", &host.name).env("NCCL_SOCKET_NTHREADS", nccl);
    host.spawn(c, &dir.join(format!("rlaunch-{}.log", host.name)))
}

#[test]
fn a_node_with_another_nccl_variable_is_named_when_the_round_closes() {
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let endpoint = format!("{}:{RDZV_PORT}", cluster.host(0).ip);
    let w = worker().display().to_string();
    let program = [w.as_str(), "--out", dir.path().to_str().expect("utf-8 temp dir"), "dump-env"];
    let args = agent_args("2", &endpoint, "fp-log", &[], &program);
    let mut agents = vec![rlaunch_with_nccl(cluster.host(0), dir.path(), &args, "4")];
    wait_until("the rendezvous server to listen", Duration::from_secs(10), || listening(&endpoint));
    agents.push(rlaunch_with_nccl(cluster.host(1), dir.path(), &args, "2"));
    for a in &mut agents {
        let status = a.wait(Duration::from_secs(30));
        assert!(status.success(), "a difference is logged, not refused: {}", a.log_tail(3000));
    }
    for a in &agents {
        let log = a.output();
        assert!(log.contains("fingerprint: "), "each agent reads its fingerprint: {log}");
        assert!(log.contains("the nodes of this round differ"), "{log}");
        assert!(
            log.contains("env NCCL_SOCKET_NTHREADS=2 (4 there)")
                || log.contains("env NCCL_SOCKET_NTHREADS=4 (2 there)"),
            "the diff names the variable and both values: {log}"
        );
    }
}

#[test]
fn fingerprint_strict_refuses_a_node_with_another_nccl_variable() {
    let cluster = Cluster::new(2);
    let dir = tempdir();
    let endpoint = format!("{}:{RDZV_PORT}", cluster.host(0).ip);
    let program = loop_program(dir.path());
    let args = agent_args("2", &endpoint, "fp-strict", &["--fingerprint", "strict"], &strs(&program));
    let mut first = rlaunch_with_nccl(cluster.host(0), dir.path(), &args, "4");
    wait_until("host a to join", Duration::from_secs(20), || first.output().contains("joined forming round 1"));
    // b gives no --fingerprint: the job's policy (strict, from a) applies to it.
    let b_args = agent_args("2", &endpoint, "fp-strict", &[], &strs(&program));
    let mut second = rlaunch_with_nccl(cluster.host(1), dir.path(), &b_args, "2");
    let status = second.wait(Duration::from_secs(30));
    let log = second.output();
    assert!(!status.success(), "{log}");
    assert!(log.contains("--fingerprint strict"), "{log}");
    assert!(log.contains("env NCCL_SOCKET_NTHREADS=2 (4 there)"), "{log}");
    assert!(first.try_status().is_none(), "the job's first node waits on: {}", first.log_tail(2000));
}

#[test]
fn a_node_loss_with_hang_detection_reforms_without_reading_the_survivors_stacks() {
    // Stacks are read for a round that ended by a failure; a node lost is no failure, and the
    // survivors' workers are not paused (py-spy) before they are stopped.
    let cluster = Cluster::new(3);
    let dir = tempdir();
    let mut agents = start_loop_job(&cluster, dir.path(), "1:3", "kill-hang", &[0, 1, 2], &["--hang-timeout", "600"]);
    wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);
    cluster.host(2).kill_all();
    wait_formed(dir.path(), &["a", "b"], &mut agents[..2], Duration::from_secs_f64(TTL_S + 10.0));
    for a in &agents[..2] {
        let log = a.output();
        // (The looping worker is a shell script: kernel wait channels, no py-spy.)
        assert!(log.contains("hang detection (--hang-timeout)") || log.contains("py-spy not found"), "{log}");
        assert!(!log.contains("where this node's ranks stood"), "no stacks for a node loss: {log}");
    }
    finish(dir.path(), &mut agents[..2]);
}

/// A join sent from host `from` to the job's service, advertising `store` and `probe`; the
/// HTTP status and body (python3's urllib inside the host's network namespace).
fn join_from_host(cluster: &Cluster, from: usize, run_id: &str, store: &str, probe: &str) -> (u16, String) {
    let url = format!("http://{}:{RDZV_PORT}/v1/jobs/{run_id}/join", cluster.host(0).ip);
    let body = format!(
        r#"{{"settings": {{"min_nodes": 2, "max_nodes": 3, "join_timeout_ms": 30000, "last_call_timeout_ms": 1000,
            "heartbeat_interval_ms": 500, "node_ttl_ms": 2000, "max_restarts": 0, "stop_grace_ms": 3000}},
            "node": {{"node_id": "intruder", "local_world_size": 1, "store_addr": "{store}", "probe_addr": "{probe}"}},
            "wait_ms": 0}}"#
    );
    let script = r#"
import sys, urllib.request, urllib.error
req = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), headers={"content-type": "application/json"})
try:
    r = urllib.request.urlopen(req, timeout=10); print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
"#;
    let out = cluster.host(from).run("python3", &["-c", script, &url, &body], Duration::from_secs(20));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (code, rest) = text.split_once('\n').unwrap_or((text.as_str(), ""));
    (
        code.trim()
            .parse()
            .unwrap_or_else(|_| panic!("no status from the join: {text} {}", String::from_utf8_lossy(&out.stderr))),
        rest.to_owned(),
    )
}

#[test]
fn a_join_from_another_host_may_advertise_only_that_hosts_address_on_a_live_service() {
    let cluster = Cluster::new(3);
    let dir = tempdir();
    let mut agents = start_loop_job(&cluster, dir.path(), "2:3", "advertise", &[0, 1], &[]);
    let before = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    // From host c: the probes and store connections of the job's members pointed at a's
    // loopback, then at host b. Both refused (400) by the service the agent on a hosts.
    let (c, b) = (cluster.host(2).ip.clone(), cluster.host(1).ip.clone());
    for (store, probe) in
        [(format!("{c}:29500"), "127.0.0.1:39999".to_owned()), (format!("{b}:29500"), format!("{b}:29401"))]
    {
        let (code, body) = join_from_host(&cluster, 2, "advertise", &store, &probe);
        assert_eq!(code, 400, "{store} {probe}: {body}");
        assert!(body.contains("not the address this join came from"), "{body}");
    }
    // Its own address is taken (the node then waits to be let in; it never heartbeats).
    let (code, body) = join_from_host(&cluster, 2, "advertise", &format!("{c}:29500"), &format!("{c}:29401"));
    assert_eq!(code, 200, "{body}");
    // Nothing of it disturbed the running job: the same workers, no restart.
    std::thread::sleep(Duration::from_secs(3));
    let now = formed(dir.path(), &["a", "b"], NPROC).expect("the job still runs");
    assert_eq!(
        now.iter().map(|s| s.pid).collect::<Vec<_>>(),
        before.iter().map(|s| s.pid).collect::<Vec<_>>(),
        "no worker restarted: {:#?}",
        starts(dir.path())
    );
    finish(dir.path(), &mut agents);
}

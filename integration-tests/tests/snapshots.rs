//! Snapshots in the agents' memory (`rlaunch.snapshot`), with real PyTorch DDP (gloo, CPU):
//! `py/snapshot_train.py` saves every step and resumes from what `load` answers. One node
//! (`--standalone`): a worker that exits, one killed inside `save`, the memory cap, a program
//! outside rlaunch. Several nodes (network namespaces, `rlaunch-rendezvous` on a real etcd): a
//! node lost (link cut, then every process killed) with a spare waiting and with a replacement
//! started later, the world size changed, a node lost with its buddy. Each checks the step
//! resumed from and the state's bytes: the losses after the resume equal an uninterrupted run's
//! bit for bit.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use integration_tests::netns::{Cluster, Proc};
use integration_tests::{bin, run_deadline, stderr_of, tempdir, venv_python, wait_until};

use crate::etcd_multinode::{http_get, Etcd};

const STEPS: u32 = 40;
const CONF: &str = "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=60";

fn script() -> String {
    integration_tests::repo_root().join("integration-tests/py/snapshot_train.py").display().to_string()
}

/// Per rank, its log's lines.
type Logs = BTreeMap<u32, Vec<String>>;

/// What the ranks wrote: per rank, its log's whole lines (read while ranks append to them, a
/// last line half-written would parse as a step without its value, or a shorter number).
fn logs(out: &Path) -> Logs {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(out).expect("the output dir") {
        let name = e.expect("an entry").file_name().to_string_lossy().into_owned();
        if let Some(rank) = name.strip_prefix('r').and_then(|n| n.strip_suffix(".log")).and_then(|n| n.parse().ok()) {
            let text = integration_tests::complete_text(&out.join(&name));
            m.insert(rank, text.lines().map(str::to_owned).collect());
        }
    }
    m
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// Each `resume` line of a rank: (step, the whole line).
fn resumes(lines: &[String]) -> Vec<(u32, String)> {
    lines
        .iter()
        .filter(|l| l.starts_with("resume "))
        .map(|l| (field(l, "step").and_then(|s| s.parse().ok()).expect("a step"), l.clone()))
        .collect()
}

/// The loss of each step, as last logged (a step computed again is logged twice).
fn losses(lines: &[String]) -> BTreeMap<u32, String> {
    per_step(lines, "value")
}

/// The model's digest after each step, as last logged.
fn digests(lines: &[String]) -> BTreeMap<u32, String> {
    per_step(lines, "digest")
}

fn per_step(lines: &[String], key: &str) -> BTreeMap<u32, String> {
    lines
        .iter()
        .filter(|l| l.starts_with("loss "))
        .map(|l| {
            (field(l, "step").and_then(|s| s.parse().ok()).expect("a step"), field(l, key).expect("a value").to_owned())
        })
        .collect()
}

/// Steps a rank computed again after its last resume from `resumed`: those logged before it
/// past `resumed`.
fn computed_again(lines: &[String]) -> u32 {
    let Some(at) = lines.iter().rposition(|l| l.starts_with("resume ")) else { return 0 };
    let resumed: u32 = field(&lines[at], "step").and_then(|s| s.parse().ok()).expect("a step");
    let before =
        lines[..at].iter().filter(|l| l.starts_with("loss ")).filter_map(|l| field(l, "step")?.parse::<u32>().ok());
    before.max().map_or(0, |last| last.saturating_sub(resumed))
}

fn standalone(
    program: &str,
    out: &Path,
    nproc: u32,
    rlaunch_flags: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    let mut cmd = Command::new(bin("rlaunch"));
    cmd.args(["--standalone", "--nproc-per-node", &nproc.to_string()])
        .args(rlaunch_flags)
        .arg(venv_python())
        .args([program.to_owned(), out.display().to_string(), STEPS.to_string()])
        .env("RLAUNCH_LOG", "info");
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_deadline(&mut cmd, Duration::from_secs(180))
}

/// An uninterrupted run of `world` ranks on one node: per rank, the loss and the model's digest
/// after each step.
struct Reference {
    losses: BTreeMap<u32, BTreeMap<u32, String>>,
    digests: BTreeMap<u32, String>,
}

fn reference(program: &str, world: u32) -> Reference {
    let out = tempdir();
    let o = standalone(program, out.path(), world, &[], &[]);
    assert!(o.status.success(), "the reference run failed:\n{}", stderr_of(&o));
    let logs = logs(out.path());
    Reference { losses: logs.iter().map(|(r, l)| (*r, losses(l))).collect(), digests: digests(&logs[&0]) }
}

/// Every rank resumed once from the same step, with the model's bytes the uninterrupted run had
/// after that step, computed at most one step again, and then logged the uninterrupted run's
/// losses: bit for bit with two ranks; with four, within 1e-5 (relative): in a new process
/// group the four-way sums may differ in their last bit after some steps, while the restored
/// bytes, checked here, are exact.
fn assert_resumed_as_reference(out: &Path, world: u32, reference: &Reference) -> u32 {
    let logs = logs(out);
    assert_eq!(logs.len() as u32, world, "every rank logged: {:?}", logs.keys());
    let mut steps = std::collections::BTreeSet::new();
    for (rank, lines) in &logs {
        let r = resumes(lines);
        assert!(!r.is_empty(), "rank {rank} never resumed from a snapshot:\n{}", lines.join("\n"));
        steps.insert(r.last().expect("one").0);
        assert!(
            computed_again(lines) <= 1,
            "rank {rank} computed {} steps again:\n{}",
            computed_again(lines),
            lines.join("\n")
        );
        let (step, line) = r.last().expect("one");
        assert_eq!(
            field(line, "digest"),
            reference.digests.get(step).map(String::as_str),
            "rank {rank}'s restored model: {line}"
        );
        let same = |a: &str, b: &str| {
            let (a, b): (f64, f64) = (a.parse().expect("a loss"), b.parse().expect("a loss"));
            if world <= 2 {
                a == b
            } else {
                (a - b).abs() <= 1e-5 * b.abs()
            }
        };
        let want = &reference.losses[rank];
        let differ: Vec<String> = losses(lines)
            .iter()
            .filter(|(s, v)| !want.get(s).is_some_and(|w| same(v, w)))
            .map(|(s, v)| format!("step {s}: {v} (uninterrupted: {:?})", want.get(s)))
            .collect();
        assert!(
            differ.is_empty(),
            "rank {rank} after {line}: the losses differ from the uninterrupted run's: {differ:?}"
        );
        assert!(lines.last().is_some_and(|l| l.starts_with("final ")), "rank {rank} finished");
    }
    assert_eq!(steps.len(), 1, "every rank resumed from the same step: {steps:?}");
    steps.into_iter().next().expect("one step")
}

/// Two ranks on one node with a fault (`env`) and one restart: the step they resumed from, after
/// checking that they resumed as the uninterrupted run (`assert_resumed_as_reference`). Answers
/// the run's stderr too.
fn resumed_after_a_fault(program: &str, env: &[(&str, &str)]) -> (u32, String) {
    let reference = reference(program, 2);
    let out = tempdir();
    let o = standalone(program, out.path(), 2, &["--max-restarts", "1"], env);
    assert!(o.status.success(), "{}", stderr_of(&o));
    (assert_resumed_as_reference(out.path(), 2, &reference), stderr_of(&o))
}

/// A save past the node's snapshot memory (1 MiB) is refused and said once, training goes on,
/// and step 0, the last committed, is what the restart loads on both ranks.
fn assert_over_the_cap_step_0_stays(env: &[(&str, &str)]) {
    let out = tempdir();
    let o = standalone(&script(), out.path(), 2, &["--max-restarts", "1", "--snapshot-memory", "1"], env);
    let err = stderr_of(&o);
    assert!(o.status.success(), "a full snapshot memory never stops training:\n{err}");
    assert!(err.contains("does not fit in this node's snapshot memory (--snapshot-memory 1 MiB"), "{err}");
    let logs = logs(out.path());
    assert!(logs.values().all(|l| l.last().is_some_and(|x| x.starts_with("final "))), "both ranks finished");
    for (rank, lines) in &logs {
        assert_eq!(
            resumes(lines).iter().map(|x| x.0).collect::<Vec<_>>(),
            vec![0],
            "rank {rank}:\n{}",
            lines.join("\n")
        );
    }
}

#[test]
fn a_worker_that_exits_resumes_from_the_last_step_with_the_same_state() {
    let (step, _) = resumed_after_a_fault(&script(), &[("SNAP_EXIT_AT", "1:12")]);
    assert_eq!(step, 11, "rank 1 exited before saving step 12: step 11 is the last whole one");
}

#[test]
fn a_worker_killed_inside_save_leaves_the_previous_step_never_half_of_one() {
    let (step, err) = resumed_after_a_fault(&script(), &[("SNAP_DIE_IN_SAVE", "0:9")]);
    assert_eq!(step, 8, "rank 0's part of step 9 was never whole: step 8 is restored");
    assert!(err.contains("a worker went while saving its snapshot"), "{err}");
}

#[test]
fn a_part_over_the_memory_cap_is_refused_and_the_last_committed_step_stays() {
    // About 0.45 MiB per rank and step: step 0 of both ranks fits in 1 MiB, and no later step
    // fits beside it.
    assert_over_the_cap_step_0_stays(&[("SNAP_EXIT_AT", "0:20"), ("SNAP_PAD_MB", "0.3")]);
}

#[test]
fn outside_rlaunch_save_and_load_do_nothing_and_say_so_once_and_snapshots_can_be_off() {
    let o = run_deadline(
        Command::new(venv_python()).args([
            "-c",
            "import rlaunch\nassert rlaunch.snapshot.save(1, {'x': 1}) is False\nassert rlaunch.snapshot.save(2, {}) is False\nassert rlaunch.snapshot.load() is None\nprint('ok')",
        ])
        .env("PYTHONPATH", integration_tests::repo_root().join("python"))
        .env_remove("RLAUNCH_SNAPSHOT"),
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert_eq!(stderr_of(&o).matches("not started by rlaunch").count(), 1, "said once: {}", stderr_of(&o));
    // `--snapshot-memory 0`: the workers get no socket and the program runs as outside.
    let out = tempdir();
    let o = standalone(&script(), out.path(), 1, &["--snapshot-memory", "0"], &[]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(stderr_of(&o).contains("not started by rlaunch"), "{}", stderr_of(&o));
    // A program that never saves runs under rlaunch as before, with the package importable.
    let o = run_deadline(
        Command::new(bin("rlaunch"))
            .args(["--standalone", "--nproc-per-node", "1"])
            .arg(venv_python())
            .args(["-c", "import os, rlaunch; print('sock', bool(os.environ.get('RLAUNCH_SNAPSHOT')))"]),
        Duration::from_secs(60),
    );
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("sock True"), "{}", stderr_of(&o));
}

/// Hosts on one bridge, an etcd and an `rlaunch-rendezvous` on it in the root namespace.
struct Job {
    cluster: Cluster,
    _etcd: Etcd,
    _rdzv: Proc,
    endpoint: String,
}

impl Job {
    fn new(hosts: usize, dir: &Path) -> Job {
        let cluster = Cluster::new(hosts);
        let etcd = Etcd::start(&cluster, 1);
        let urls: Vec<String> = etcd.clients.iter().map(|c| format!("http://{c}")).collect();
        let endpoint = format!("{}:{}", cluster.root_ip(), cluster.free_root_port());
        let mut cmd = Command::new(bin("rlaunch-rendezvous"));
        cmd.args(["--listen", &endpoint, "--store", "etcd", "--etcd-endpoints", &urls.join(",")])
            .env("RLAUNCH_LOG", "info");
        let rdzv = Proc::spawn(cmd, "rendezvous", &dir.join("rendezvous.log"));
        wait_until("the rendezvous to answer", Duration::from_secs(15), || http_get(&endpoint, "/healthz").is_some());
        Job { cluster, _etcd: etcd, _rdzv: rdzv, endpoint }
    }

    fn agent(&self, host: usize, nnodes: &str, run_id: &str, out: &Path, env: &[(&str, &str)]) -> Proc {
        self.agent_running(&script(), host, nnodes, run_id, out, env)
    }

    /// An agent on `host` running `program` (a Python script given OUT and the step count).
    fn agent_running(
        &self,
        program: &str,
        host: usize,
        nnodes: &str,
        run_id: &str,
        out: &Path,
        env: &[(&str, &str)],
    ) -> Proc {
        let args: Vec<String> = [
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "rlaunch",
            "--rdzv-endpoint",
            &self.endpoint,
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            CONF,
            "--max-restarts",
            "3",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([venv_python().display().to_string(), program.to_owned(), out.display().to_string(), STEPS.to_string()])
        .collect();
        let h = self.cluster.host(host);
        let mut c = h.command(bin("rlaunch"));
        c.args(&args)
            .env("RLAUNCH_LOG", "info")
            .env("RL_HOST", &h.name)
            .env("SNAP_SLEEP", "0.1")
            .env("GLOO_SOCKET_IFNAME", "eth0");
        for (k, v) in env {
            c.env(k, v);
        }
        Proc::spawn(c, &format!("rlaunch on host {}", h.name), &out.join(format!("agent-{}.log", h.name)))
    }

    /// Waits until every rank of the first round logged step `step`.
    fn wait_step(&self, out: &Path, world: u32, step: u32) {
        wait_until(&format!("every rank at step {step}"), Duration::from_secs(90), || {
            let l = logs(out);
            l.len() as u32 == world && l.values().all(|lines| losses(lines).keys().any(|s| *s >= step))
        });
    }

    /// Node loss as a partition first: the host's link cut, then every process in it killed.
    /// Answers when the link was cut (Unix ms).
    fn lose(&self, host: usize) -> u64 {
        let h = self.cluster.host(host);
        let cut = (integration_tests::netns::now_unix_f64() * 1000.0) as u64;
        h.cut_link();
        std::thread::sleep(Duration::from_millis(300));
        h.kill_all();
        cut
    }

    /// The last recovery of `run_id` as the service accounts it, against what the ranks logged
    /// with their own timestamps (one machine, one clock): the fault at the lost node's last
    /// heartbeat before the cut, every member restored when its ranks' `load` returned, the
    /// first step when their `save` of it did, the steps computed again.
    fn check_accounting(&self, run_id: &str, out: &Path, cut_ms: u64) {
        let body = http_get(&self.endpoint, &format!("/v1/jobs/{run_id}")).expect("the job's status");
        let status: serde_json::Value = serde_json::from_str(&body).expect("status JSON");
        let rec = &status["recovery"];
        let r = rec["recoveries"].as_array().and_then(|l| l.last()).expect("a recovery");
        eprintln!("recovery: {r}");
        let ms = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("a number of ms: {v} in {r}"));
        assert_eq!(r["kind"], "node_lost", "{rec}");
        // Dated at the lost node's last heartbeat, as the replica that deleted its alive key in
        // etcd had heard it: before the cut, within one interval (0.5 s) and a heartbeat's trip.
        let fault = ms(&r["fault_at"]);
        assert!(fault <= cut_ms + 100 && fault + 1000 >= cut_ms, "fault at {fault}, link cut at {cut_ms}");
        eprintln!("noticed {} ms after the cut", ms(&r["noticed_at"]).saturating_sub(cut_ms));
        let secs = |l: &str| field(l, "t").and_then(|t| t.parse::<f64>().ok()).map(|t| (t * 1000.0) as u64);
        let logs = logs(out);
        let last_resume =
            logs.values().filter_map(|l| l.iter().rfind(|l| l.starts_with("resume "))).collect::<Vec<_>>();
        let loaded = last_resume.iter().filter_map(|l| secs(l)).max().expect("resume times");
        let step: u64 = field(last_resume[0], "step").and_then(|s| s.parse().ok()).expect("a step");
        let p = &r["progress"];
        assert_eq!(p["restored_step"].as_u64(), Some(step), "{r}");
        let restored = ms(&p["restored_at"]);
        assert!(restored.abs_diff(loaded) <= 500, "restored at {restored}, the last rank's load returned at {loaded}");
        // The first step saved after the resume, by the last rank to save it.
        let first = logs
            .values()
            .filter_map(|l| {
                let at = l.iter().rposition(|l| l.starts_with("resume "))?;
                l[at..].iter().find(|l| l.starts_with("saved ")).and_then(|l| secs(l))
            })
            .max()
            .expect("saves after the resume");
        let first_at = ms(&p["first_step_at"]);
        assert!(first_at.abs_diff(first) <= 500, "first step at {first_at}, saved by the last rank at {first}");
        let again = logs.values().map(|l| computed_again(l)).max().unwrap_or(0) as u64;
        let redone = r["phases"]["steps_redone"].as_u64().expect("steps redone");
        assert!(redone <= again.max(1), "{redone} steps redone, the ranks computed {again} again");
        let phases = &r["phases"];
        for phase in ["noticing_ms", "reforming_ms", "starting_ms", "restoring_ms", "computing_again_ms"] {
            assert!(phases[phase].is_u64(), "{phase} is known: {r}");
        }
        let goodput = rec["goodput"].as_f64().expect("goodput");
        assert!(goodput > 0.0 && goodput < 1.0, "{goodput}");
    }
}

/// Four ranks on two hosts (`program`, `env`), host b lost once every rank logged step 12 (6
/// with FSDP's slower steps): the logs, and the last resume of each of the two ranks left,
/// checked to be at world 2 from a saved world of 4.
fn resumed_on_two_of_four(
    run_id: &str,
    program: &str,
    env: &[(&str, &str)],
    step: u32,
    out: &Path,
) -> (Logs, Vec<(u32, String)>) {
    let job = Job::new(2, out);
    let mut a = job.agent_running(program, 0, "1:2", run_id, out, env);
    let _b = job.agent_running(program, 1, "1:2", run_id, out, env);
    job.wait_step(out, 4, step);
    job.lose(1);
    wait_ok(&mut [&mut a]);
    let logs = logs(out);
    let resumed = [0, 1]
        .map(|rank| {
            let lines = &logs[&rank];
            let (step, line) =
                resumes(lines).pop().unwrap_or_else(|| panic!("rank {rank} resumed:\n{}", lines.join("\n")));
            assert!(line.contains("world=2 saved_world=4"), "{line}");
            (step, line)
        })
        .to_vec();
    (logs, resumed)
}

fn wait_ok(agents: &mut [&mut Proc]) {
    for a in agents.iter_mut() {
        let s = a.wait(Duration::from_secs(150));
        assert!(s.success(), "{} failed ({s}):\n{}", a.name, a.log_tail(4000));
    }
}

/// Two hosts of two ranks running `program` and a third waiting as a spare; host b lost (link
/// cut, then killed) once every rank logged step 12: the spare takes its place and every rank
/// resumes as the uninterrupted run of four (`assert_resumed_as_reference`), and the service's
/// account of the recovery agrees with the ranks' logs.
fn a_spare_takes_over(program: &str, run_id: &str) {
    let reference = reference(program, 4);
    let out = tempdir();
    let job = Job::new(3, out.path());
    let mut a = job.agent_running(program, 0, "2", run_id, out.path(), &[]);
    let _b = job.agent_running(program, 1, "2", run_id, out.path(), &[]);
    job.wait_step(out.path(), 4, 3);
    // The spare waits as a standby of a round at its maximum.
    let mut c = job.agent_running(program, 2, "2", run_id, out.path(), &[]);
    job.wait_step(out.path(), 4, 12);
    let cut = job.lose(1);
    wait_ok(&mut [&mut a, &mut c]);
    assert_resumed_as_reference(out.path(), 4, &reference);
    job.check_accounting(run_id, out.path(), cut);
}

#[test]
fn a_node_lost_with_a_spare_waiting_resumes_every_rank_from_the_last_step() {
    a_spare_takes_over(&script(), "spare");
}

#[test]
fn a_replacement_started_after_the_loss_fetches_the_lost_nodes_parts_from_its_buddy() {
    let reference = reference(&script(), 4);
    let out = tempdir();
    let job = Job::new(3, out.path());
    let mut a = job.agent(0, "2", "replace", out.path(), &[]);
    let _b = job.agent(1, "2", "replace", out.path(), &[]);
    job.wait_step(out.path(), 4, 12);
    job.lose(1);
    std::thread::sleep(Duration::from_secs(3));
    let mut c = job.agent(2, "2", "replace", out.path(), &[]);
    wait_ok(&mut [&mut a, &mut c]);
    assert_resumed_as_reference(out.path(), 4, &reference);
    let c_log = std::fs::read_to_string(out.path().join("agent-c.log")).expect("c's log");
    assert!(c_log.contains("fetched a snapshot part from another node"), "c restored from a's copies:\n{c_log}");
}

#[test]
fn a_smaller_world_reads_every_saved_ranks_part_to_reshard() {
    let out = tempdir();
    let (logs, resumed) = resumed_on_two_of_four("reshard", &script(), &[("SNAP_RESHARD", "1")], 12, out.path());
    for (rank, (step, _)) in [0u32, 1].into_iter().zip(resumed) {
        let reshard = logs[&rank].iter().rev().find(|l| l.starts_with("reshard ")).expect("a reshard line");
        assert_eq!(
            reshard,
            &format!("reshard parts=4 steps={step} ranks=0,1,2,3"),
            "every old rank's part, of one step"
        );
    }
}

#[test]
fn a_node_lost_with_its_buddy_restores_nothing_rather_than_half_a_step() {
    let out = tempdir();
    let job = Job::new(3, out.path());
    let mut a = job.agent(0, "1:3", "pair", out.path(), &[]);
    let _b = job.agent(1, "1:3", "pair", out.path(), &[]);
    let _c = job.agent(2, "1:3", "pair", out.path(), &[]);
    job.wait_step(out.path(), 6, 10);
    // In a ring of three, any two nodes are a node and its buddy.
    job.lose(1);
    job.lose(2);
    wait_ok(&mut [&mut a]);
    let logs = logs(out.path());
    let a_log = std::fs::read_to_string(out.path().join("agent-a.log")).expect("a's log");
    assert!(!a_log.contains("this round restores"), "nothing whole survived, nothing restored:\n{a_log}");
    for rank in [0, 1] {
        assert!(resumes(&logs[&rank]).is_empty(), "rank {rank} started afresh: {:?}", logs[&rank]);
        assert!(logs[&rank].last().is_some_and(|l| l.starts_with("final ")), "rank {rank} finished");
    }
}

#[test]
fn a_save_interrupted_half_way_never_lets_a_later_save_read_its_answer() {
    // The reserve's answer is cut short by an exception (a signal turned into
    // KeyboardInterrupt): the next save must get its own answer and buffer, and the step it
    // saves must be what is restored.
    let program = "import os, torch, rlaunch.snapshot as s\n\
        if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n\
        \x20   assert s.save(0, {'x': torch.full((1000,), 0.0)})\n\
        \x20   real = s._recv_exact\n\
        \x20   def cut(sock, n):\n\
        \x20       raise KeyboardInterrupt\n\
        \x20   s._recv_exact = cut\n\
        \x20   try:\n\
        \x20       s.save(1, {'x': torch.full((1000,), 1.0)})\n\
        \x20   except KeyboardInterrupt:\n\
        \x20       pass\n\
        \x20   s._recv_exact = real\n\
        \x20   assert s.save(2, {'x': torch.full((1000,), 2.0)})\n\
        \x20   os._exit(1)\n\
        step, state = s.load()\n\
        print('restored', step, float(state['x'].sum()))\n";
    let o = run_deadline(
        Command::new(bin("rlaunch"))
            .args(["--standalone", "--nproc-per-node", "1", "--max-restarts", "1"])
            .arg(venv_python())
            .args(["-c", program]),
        Duration::from_secs(120),
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", stderr_of(&o));
    assert!(out.contains("restored 2 2000.0"), "the last save, whole: {out}");
}

#[test]
fn load_runs_no_code_from_a_part_and_builds_other_classes_only_when_allowed_by_name() {
    // `py/snapshot_untrusted.py`: rank 2 saves a part whose pickle calls os.system; every rank's
    // load of it is refused, naming the global, before anything of it runs (no marker file),
    // even with `allow=[os.system]`; rank 0's own class loads only once allowed by name; state
    // dicts, tensors, numpy arrays and scalars, containers and Python scalars round-trip, and
    // without torch (rank 1) too.
    let out = tempdir();
    let o = run_deadline(
        Command::new(bin("rlaunch"))
            .args(["--standalone", "--nproc-per-node", "3", "--max-restarts", "1"])
            .arg(venv_python())
            .arg(integration_tests::repo_root().join("integration-tests/py/snapshot_untrusted.py"))
            .arg(out.path()),
        Duration::from_secs(180),
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    let err = stderr_of(&o);
    assert!(!out.path().join("pwned").exists(), "a part's bytes ran code:\n{stdout}{err}");
    assert!(o.status.success(), "{stdout}{err}");
    for rank in 0..3 {
        assert!(stdout.contains(&format!("ok {rank}")), "rank {rank} finished:\n{stdout}{err}");
        assert!(
            stdout
                .contains(&format!("rank {rank}: rank 2's part refused: rank 2's part of step 0 needs `posix.system`")),
            "rank {rank} was refused rank 2's part, naming the global:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("rank 0's part of step 0 needs `__main__.Point`, which load does not allow")
            && stdout.contains("load(allow=['__main__.Point'])"),
        "a class of the program's own is refused until allowed, and the error says how:\n{stdout}"
    );
}

/// `py/compiled_handover.py` in `mode` (`on`: `save`/`load` with `compiled=True`): what each rank
/// of the restarted attempts printed, and how many C++ compiles each of the three attempts ran.
fn compiled_handover(mode: &str) -> (String, [usize; 3]) {
    let out = tempdir();
    let o = run_deadline(
        Command::new(bin("rlaunch"))
            .args(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"])
            .arg(venv_python())
            .arg(integration_tests::repo_root().join("integration-tests/py/compiled_handover.py"))
            .arg(out.path())
            .arg(mode),
        Duration::from_secs(300),
    );
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{stdout}{}", stderr_of(&o));
    let compiles = |attempt: u32| {
        std::fs::read_to_string(out.path().join(format!("compiles.{attempt}"))).map(|s| s.lines().count()).unwrap_or(0)
    };
    (stdout, [compiles(0), compiles(1), compiles(2)])
}

#[test]
fn a_restarted_worker_with_a_cold_cache_loads_the_compiled_code_saved_with_the_step() {
    // Every attempt compiles into a cache and a temporary directory of its own, as a new host
    // would. With the compiled code handed over, the restarted ranks' first step hits inductor's
    // and AOTAutograd's caches and runs no C++ compile at all (the kernels and the CPU probes came
    // with the part); a second restart gets the same from the first restart's part (what a
    // replacement was handed, it hands on). Without the hand-over, each restart compiles again.
    let (with, compiles) = compiled_handover("on");
    assert!(compiles[0] > 0, "the first attempt compiled C++ kernels: {with}");
    assert_eq!(compiles[1..], [0, 0], "the restarted attempts compiled nothing:\n{with}");
    for attempt in 1..3 {
        for rank in 0..2 {
            assert!(
                with.contains(&format!("attempt {attempt} rank {rank} hits=2 misses=0 aot_hits=1 installed=True")),
                "attempt {attempt}, rank {rank} loaded its graphs from the handed-over code:\n{with}"
            );
        }
    }
    let (without, compiles) = compiled_handover("off");
    assert!(compiles[1] > 0 && compiles[2] > 0, "without the hand-over each restart compiles again:\n{without}");
    for rank in 0..2 {
        assert!(
            without.contains(&format!("attempt 1 rank {rank} hits=0 misses=2 aot_hits=0 installed=False")),
            "rank {rank} compiled cold:\n{without}"
        );
    }
}

#[test]
fn compiled_code_from_a_part_is_checked_before_anything_of_it_is_written() {
    // `py/compiled_untrusted.py`: file names that escape the cache, a header that lies about the
    // length, is not JSON or nests too deep, another torch's code, a host that differs (a CPU
    // feature, the compiler, features unknown here), kernels for other vector instructions,
    // artifacts torch cannot read, an unwritable cache: each refused with nothing written and no
    // exception; a link at a kernel's name is not followed; a second blob in a process that
    // installed one is not installed.
    let dir = tempdir();
    let o = run_deadline(
        Command::new(venv_python())
            .arg(integration_tests::repo_root().join("integration-tests/py/compiled_untrusted.py"))
            .arg(dir.path())
            .env("PYTHONPATH", integration_tests::repo_root().join("python")),
        Duration::from_secs(180),
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    let err = stderr_of(&o);
    assert!(o.status.success() && stdout.trim_end().ends_with("ok"), "{stdout}{err}");
    let refused = [
        "traversal",
        "absolute",
        "newline",
        "wrong_dir",
        "short",
        "cache_name",
        "not_json",
        "deep",
        "version",
        "cpu",
        "compiler",
        "native",
        "machine",
        "unknown",
        "isa",
        "no_isa",
        "artifacts",
        "unwritable",
        "once",
    ];
    for case in refused {
        assert!(stdout.contains(&format!("case {case}: installed=False")), "{case} refused:\n{stdout}{err}");
    }
    for case in ["link", "good", "same_and_other"] {
        assert!(stdout.contains(&format!("case {case}: installed=True")), "{case} installed:\n{stdout}{err}");
    }
    for said in [
        "it names a file '../../escaped.so' that is not a kernel of inductor's cache",
        "it is torch 0.0.1's",
        "it was compiled on a host that differs from this one in cpu",
        "its graphs are for VecNONE9000 vector instructions",
        "torch could not read its cache artifacts",
        "FileExistsError",
    ] {
        assert!(err.contains(said), "said: {said}\n{err}");
    }
}

/// Issue 36: `torch.distributed.checkpoint` into the agents' memory (`rlaunch.dcp.Writer` and
/// `Reader`, `SNAP_DCP=1` in `py/snapshot_train.py`: the model's and optimizer's state from
/// `torch.distributed.checkpoint.state_dict`). A worker that exits resumes from the last step DCP
/// saved, with the uninterrupted run's bytes and losses.
#[test]
fn dcp_saves_in_the_agents_memory_and_a_worker_that_exits_resumes_from_the_last_step() {
    let (step, _) = resumed_after_a_fault(&script(), &[("SNAP_DCP", "1"), ("SNAP_EXIT_AT", "1:12")]);
    assert_eq!(step, 11, "rank 1 exited before saving step 12: step 11 is the last whole one");
}

/// The same with `dcp.async_save` (the state staged to the CPU, then written from DCP's thread).
#[test]
fn dcp_async_save_keeps_steps_alike_and_a_worker_that_exits_resumes_from_the_last_one() {
    let (step, _) = resumed_after_a_fault(&script(), &[("SNAP_DCP", "async"), ("SNAP_EXIT_AT", "0:7")]);
    assert_eq!(step, 6, "rank 0 exited before saving step 7: step 6 is the last whole one");
}

/// The coordinator (rank 0) killed while its part of step 9 (DCP's metadata with it) is half
/// written: rank 1's part of step 9 is held, but the step is not whole, so step 8 is restored.
#[test]
fn dcp_a_coordinator_killed_inside_its_save_leaves_the_previous_step_never_half_of_one() {
    let (step, _) = resumed_after_a_fault(&script(), &[("SNAP_DCP", "1"), ("SNAP_DIE_IN_SAVE", "0:9")]);
    assert_eq!(step, 8, "rank 0's part of step 9 was never whole: step 8 is restored");
}

/// A DCP save past the node's snapshot memory is refused (`Writer.saved` False, said once),
/// training goes on, and the last committed step is what a restart loads.
#[test]
fn dcp_a_save_over_the_memory_cap_is_refused_and_the_last_committed_step_stays() {
    // DCP writes a replicated tensor once (from one rank): 0.6 MiB of padding and the model's
    // state, about 0.75 MiB a step in all, so step 0 fits in 1 MiB and no later step beside it.
    assert_over_the_cap_step_0_stays(&[("SNAP_DCP", "1"), ("SNAP_EXIT_AT", "0:20"), ("SNAP_PAD_MB", "0.6")]);
}

/// Outside rlaunch, `Writer` saves nothing (`saved` False, said once by `rlaunch.snapshot`),
/// `restored_step` is None and `Reader` says why it has nothing to read.
#[test]
fn dcp_outside_rlaunch_saves_nothing_and_says_so_once() {
    let program = "import torch, torch.distributed.checkpoint as dcp, rlaunch.dcp\n\
        w = rlaunch.dcp.Writer(1)\n\
        dcp.save({'x': torch.ones(3)}, storage_writer=w)\n\
        assert w.saved is False\n\
        dcp.save({'x': torch.ones(3)}, storage_writer=rlaunch.dcp.Writer(2))\n\
        assert rlaunch.dcp.restored_step() is None\n\
        try:\n    dcp.load({'x': torch.zeros(3)}, storage_reader=rlaunch.dcp.Reader())\nexcept BaseException as e:  # DCP raises CheckpointException, a BaseException\n    assert 'no step to load' in str(e), e\nelse:\n    raise SystemExit('loaded outside rlaunch')\n\
        print('ok')";
    let o = run_deadline(
        Command::new(venv_python())
            .args(["-c", program])
            .env("PYTHONPATH", integration_tests::repo_root().join("python"))
            .env_remove("RLAUNCH_SNAPSHOT"),
        Duration::from_secs(120),
    );
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("ok"), "{}", stderr_of(&o));
    assert_eq!(stderr_of(&o).matches("not started by rlaunch").count(), 1, "said once: {}", stderr_of(&o));
}

/// A world of another size loads a DCP step saved by four ranks on two: DCP's planner wrote each
/// replicated tensor once (from one rank's part), so each new rank reads the items of every
/// saved rank's part that holds what it needs, and its model is the saved one, byte for byte.
#[test]
fn dcp_a_smaller_world_loads_what_every_saved_rank_wrote() {
    two_of_four_restore_the_model_saved("dcp-reshard", &script(), &[("SNAP_DCP", "1")]);
}

/// `resumed_on_two_of_four`, then each of the two ranks left restored the model rank 0 logged
/// after that step in the first round (rank 0's log holds both rounds) and finished.
fn two_of_four_restore_the_model_saved(run_id: &str, program: &str, env: &[(&str, &str)]) {
    let out = tempdir();
    let (logs, resumed) = resumed_on_two_of_four(run_id, program, env, 12, out.path());
    let saved = per_step(&logs[&0], "digest");
    for (rank, (step, line)) in [0u32, 1].into_iter().zip(resumed) {
        assert_eq!(
            field(&line, "digest"),
            saved.get(&step).map(String::as_str),
            "rank {rank}'s restored model: {line}"
        );
        assert!(logs[&rank].last().is_some_and(|l| l.starts_with("final ")), "rank {rank} finished");
    }
}

/// A saved object that names a function (its unpickling would run a shell command) is refused
/// by `Reader` before DCP's planner unpickles it, and nothing of it runs; a `Writer` serves one
/// save only (a second, as an `async_save` still writing the first would, is refused).
#[test]
fn dcp_a_saved_object_that_would_run_code_is_refused_and_a_writer_serves_one_save() {
    let out = tempdir();
    let script = integration_tests::repo_root().join("integration-tests/py/dcp_untrusted.py");
    let o = run_deadline(
        Command::new(bin("rlaunch"))
            .args(["--standalone", "--nproc-per-node", "1", "--max-restarts", "1"])
            .arg(venv_python())
            .arg(&script)
            .arg(out.path()),
        Duration::from_secs(180),
    );
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{stdout}\n{}", stderr_of(&o));
    assert!(stdout.contains("reuse refused"), "{stdout}");
    assert!(stdout.contains("refused ran=False"), "{stdout}\n{}", stderr_of(&o));
    assert!(!out.path().join("ran").exists(), "the object's command ran");
}

/// FSDP2 (CPU, gloo): four ranks on two hosts shard the model and the optimizer's state and save
/// each step through DCP into the agents' memory (and, the same state, to DCP's files on disk).
/// Host b lost, the two ranks left load the last step from memory at world 2 (DCP reshards: each
/// of their shards is narrowed from the four saved ranks' chunks): the whole state is the one
/// saved, and the one DCP loads from its own files.
#[test]
fn dcp_an_fsdp2_job_of_four_ranks_resumes_on_two_from_memory_as_dcp_from_its_files() {
    let out = tempdir();
    let program = integration_tests::repo_root().join("integration-tests/py/dcp_fsdp.py").display().to_string();
    let (logs, resumed) = resumed_on_two_of_four("dcp-fsdp", &program, &[], 6, out.path());
    let saved = per_step(&logs[&0], "digest");
    for (rank, (step, line)) in [0u32, 1].into_iter().zip(resumed) {
        assert_eq!(
            field(&line, "mem"),
            saved.get(&step).map(String::as_str),
            "rank {rank}: the state saved at step {step}: {line}"
        );
        assert_eq!(field(&line, "mem"), field(&line, "disk"), "rank {rank}: as DCP loads it from its files: {line}");
        assert!(logs[&rank].last().is_some_and(|l| l == "final"), "rank {rank} finished:\n{}", logs[&rank].join("\n"));
    }
}

fn py(name: &str) -> String {
    integration_tests::repo_root().join("integration-tests/py").join(name).display().to_string()
}

/// Issue 36: a Lightning job (`py/lightning_train.py`: DDP, gloo, `rlaunch.lightning.Snapshots`
/// and `ckpt_path=rlaunch.lightning.ckpt_path()`, a resumable data loader) whose worker exits
/// resumes through Lightning's own restore from the last step in memory, past an epoch's end,
/// with the uninterrupted run's bytes and losses.
#[test]
fn lightning_a_worker_that_exits_resumes_from_the_last_step_with_the_same_losses() {
    let (step, _) = resumed_after_a_fault(&py("lightning_train.py"), &[("SNAP_EXIT_AT", "1:25")]);
    assert_eq!(step, 24, "rank 1 exited before computing step 25: step 24 is the last whole one");
}

/// A module whose hparams hold a class of the program's: the class named in
/// `Snapshots(allow=[...])` is what every load of the resume builds, `ckpt_path()`'s too (rank 0
/// loads its whole checkpoint there), so the job resumes rather than failing at each restart.
#[test]
fn lightning_classes_allowed_to_snapshots_are_allowed_to_every_load_of_the_resume() {
    let (step, _) = resumed_after_a_fault(&py("lightning_train.py"), &[("SNAP_EXIT_AT", "1:9"), ("LT_HPARAMS", "1")]);
    assert_eq!(step, 8, "rank 1 exited before computing step 9: step 8 is the last whole one");
}

/// The Lightning goal: 2 hosts of 2 ranks, one lost with a spare waiting: at most one
/// step computed again, the losses after the resume those of an uninterrupted run.
#[test]
fn lightning_a_node_lost_with_a_spare_waiting_resumes_every_rank_from_the_last_step() {
    a_spare_takes_over(&py("lightning_train.py"), "lightning-spare");
}

/// The scale change for Lightning: four ranks on two hosts, host b lost and no spare: the
/// two left resume at world 2 from the step all four saved (rank 0's checkpoint, read by both),
/// with the model saved at that step, and finish.
#[test]
fn lightning_a_smaller_world_resumes_from_the_step_four_ranks_saved() {
    two_of_four_restore_the_model_saved("lightning-shrink", &py("lightning_train.py"), &[]);
}

/// Issue 36: a Hugging Face Trainer job (`py/hf_train.py`: DDP, gloo, `rlaunch.hf.Snapshots` and
/// `resume_from_checkpoint=rlaunch.hf.checkpoint()`) whose worker exits resumes through the
/// Trainer's own resume (it skips the epoch's batches already trained) from the last step in
/// memory, past an epoch's end, with the uninterrupted run's bytes and losses; the checkpoint
/// directory written for it is gone afterwards.
#[test]
fn hf_a_worker_that_exits_resumes_from_the_last_step_with_the_same_losses() {
    let shm = |_: ()| -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                    .filter(|n| n.starts_with("rlaunch-hf-"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let before = shm(());
    let (step, _) = resumed_after_a_fault(&py("hf_train.py"), &[("SNAP_EXIT_AT", "1:25")]);
    assert_eq!(step, 24, "rank 1 exited before computing step 25: step 24 is the last whole one");
    let left: Vec<String> = shm(()).into_iter().filter(|n| !before.contains(n)).collect();
    assert!(left.is_empty(), "the resumed checkpoint directories were removed: {left:?}");
}

/// The Hugging Face goal: 2 hosts of 2 ranks, one lost with a spare waiting: at most one
/// step computed again, the losses after the resume those of an uninterrupted run.
#[test]
fn hf_a_node_lost_with_a_spare_waiting_resumes_every_rank_from_the_last_step() {
    a_spare_takes_over(&py("hf_train.py"), "hf-spare");
}

/// The scale change for the Hugging Face Trainer, as for Lightning above.
#[test]
fn hf_a_smaller_world_resumes_from_the_step_four_ranks_saved() {
    two_of_four_restore_the_model_saved("hf-shrink", &py("hf_train.py"), &[]);
}

/// The runnable examples (`examples/lightning_snapshots.py`, `examples/hf_snapshots.py`) as their
/// docstrings say to try them: under rlaunch with two workers, one killed while it trains; the
/// workers restart and resume from the step last saved, not from the start.
#[test]
fn the_lightning_and_hf_examples_resume_after_a_worker_is_killed() {
    for example in ["lightning_snapshots.py", "hf_snapshots.py"] {
        let out = tempdir();
        let path = integration_tests::repo_root().join("examples").join(example);
        let mut cmd = Command::new(bin("rlaunch"));
        cmd.args(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"])
            .arg(venv_python())
            .arg(&path)
            .env("STEPS", "150");
        let mut job = Proc::spawn(cmd, example, &out.path().join("job.log"));
        wait_until(&format!("{example} at step 40"), Duration::from_secs(150), || {
            job.output().contains("[default0]:step 40")
        });
        // A training worker: the oldest Python process running the example (the younger ones are
        // the agent's warm interpreters, waiting for a restart).
        let listed = Command::new("pgrep").args(["-f", &path.display().to_string()]).output().expect("pgrep");
        let worker = String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter_map(|l| l.trim().parse::<u32>().ok())
            .filter(|pid| {
                let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                argv.split(|b| *b == 0).next().is_some_and(|a0| a0.ends_with(b"python"))
            })
            .min()
            .unwrap_or_else(|| panic!("a worker of {example} runs"));
        let killed = Command::new("kill").args(["-KILL", &worker.to_string()]).status();
        assert!(killed.is_ok_and(|s| s.success()), "worker {worker} of {example} killed");
        let s = job.wait(Duration::from_secs(150));
        let log = job.output();
        assert!(s.success(), "{example} finished after its restart:\n{}", job.log_tail(4000));
        let resumed: u32 = log
            .lines()
            .find_map(|l| l.strip_prefix("[default0]:resumed at step ")?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{example} resumed from a snapshot:\n{}", job.log_tail(4000)));
        assert!(resumed >= 40, "{example} resumed at step {resumed}, after step 40 was reached");
    }
}

/// `rlaunch.lightning` and `rlaunch.hf` outside rlaunch: nothing saved, the resume paths None
/// (said once, by `rlaunch.snapshot`), a Lightning fit trains as without them; FSDP (Lightning's
/// strategy, the Trainer's `fsdp` argument) refused with the way that works named; a bad
/// `every_n_steps` refused (`py/trainers_outside.py`).
#[test]
fn lightning_and_hf_outside_rlaunch_save_nothing_and_refuse_what_they_cannot_hold() {
    let dir = tempdir();
    let o = run_deadline(
        Command::new(venv_python())
            .arg(py("trainers_outside.py"))
            .current_dir(dir.path())
            .env("PYTHONPATH", integration_tests::repo_root().join("python"))
            .env_remove("RLAUNCH_SNAPSHOT"),
        Duration::from_secs(180),
    );
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{stdout}\n{}", stderr_of(&o));
    for said in ["fsdp refused", "hf fsdp refused", "ok"] {
        assert!(stdout.lines().any(|l| l == said), "{said}:\n{stdout}");
    }
    assert_eq!(stderr_of(&o).matches("not started by rlaunch").count(), 1, "said once: {}", stderr_of(&o));
}

//! Multi-node jobs across network namespaces on etcd (Debian's `etcd-server`, started here in the
//! root namespace on the bridge address, one member or three): agents running the rendezvous
//! directly on etcd, two `rlaunch-rendezvous --store etcd` replicas with one killed mid-job (and
//! then a node lost, found by its watcher's report through the other replica), and one etcd
//! member of three killed mid-job. A missing `etcd` binary fails these tests loudly.
//!
//! Run as root, after `cargo build --workspace --bins --examples`:
//! `cargo test -p integration-tests --test etcd_multinode -- --test-threads 1`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use integration_tests::netns::{
    self, finish, latest_per_worker, loop_worker, now_unix_f64, rdzv_status, starts, status_members, Cluster, Proc,
    Start,
};
use integration_tests::{bin, pid_alive, tempdir, wait_until, which};

const NPROC: u32 = 2;
const TTL_S: f64 = 2.0;
const CONF: &str = "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=30";
const FORM: Duration = Duration::from_secs(20);
const RECOVERY_SLACK_S: f64 = 5.0;

/// `GET path` on `addr` (plain HTTP/1.0); the response body, or None if nothing answered.
pub(crate) fn http_get(addr: &str, path: &str) -> Option<String> {
    let addr: SocketAddr = addr.parse().ok()?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(300)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    resp.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// `POST path` with a JSON body on `addr`; the response body.
fn http_post(addr: &str, path: &str, body: &str) -> Option<String> {
    let addr: SocketAddr = addr.parse().ok()?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(300)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let req = format!(
        "POST {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    resp.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// An etcd cluster of `n` members on `ip` (distinct ports, temporary data dirs); each member is
/// a [`Proc`], so it is killed when dropped.
pub(crate) struct Etcd {
    members: Vec<Proc>,
    /// `ip:port` client addresses, member by member.
    pub(crate) clients: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Etcd {
    pub(crate) fn start(cluster: &Cluster, n: usize) -> Etcd {
        let etcd = which("etcd").unwrap_or_else(|| {
            panic!("`etcd` is not on PATH: install Debian's etcd-server (scripts/install-deps.sh); these tests need a real etcd")
        });
        let ip = cluster.root_ip();
        let dir = tempfile::Builder::new().prefix("rlaunch-it-etcd-").tempdir().expect("temp dir");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (cluster.free_root_port(), cluster.free_root_port())).collect();
        let initial: Vec<String> =
            ports.iter().enumerate().map(|(i, (_, p))| format!("m{i}=http://{ip}:{p}")).collect();
        let mut members = Vec::new();
        let mut clients = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let client_url = format!("http://{ip}:{client}");
            let peer_url = format!("http://{ip}:{peer}");
            let mut cmd = Command::new(&etcd);
            cmd.args(["--name", &format!("m{i}"), "--data-dir"])
                .arg(dir.path().join(format!("data-m{i}")))
                .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", &format!("rlaunch-it-{}", std::process::id())]);
            members.push(Proc::spawn(cmd, &format!("etcd member m{i}"), &dir.path().join(format!("etcd-m{i}.log"))));
            clients.push(format!("{ip}:{client}"));
        }
        let e = Etcd { members, clients, _dir: dir };
        for c in &e.clients {
            wait_until(&format!("etcd at {c} to be healthy (with a leader)"), Duration::from_secs(20), || {
                http_get(c, "/health").is_some_and(|b| b.contains("\"health\":\"true\""))
            });
        }
        e
    }

    /// Which member is the raft leader now (through the v3 JSON gateway's maintenance status).
    fn leader(&self) -> usize {
        for (i, c) in self.clients.iter().enumerate() {
            let Some(body) = http_post(c, "/v3/maintenance/status", "{}") else { continue };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else { continue };
            let me = v.pointer("/header/member_id").and_then(|x| x.as_str());
            let leader = v.get("leader").and_then(|x| x.as_str());
            if me.is_some() && me == leader {
                return i;
            }
        }
        panic!("no etcd member says it is the leader");
    }

    pub(crate) fn endpoints(&self) -> String {
        self.clients.join(",")
    }
}

/// The agent's command line for `backend` at `endpoints`, running the looping worker.
fn agent_args(backend: &str, nnodes: &str, endpoints: &str, run_id: &str, dir: &Path) -> Vec<String> {
    let worker = loop_worker(dir);
    [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        &NPROC.to_string(),
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoints,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        CONF,
        "--shutdown-timeout",
        "3",
        worker.to_str().expect("utf-8 path"),
        dir.to_str().expect("utf-8 path"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn wait_formed(dir: &Path, hosts: &[&str], agents: &mut [Proc], deadline: Duration) -> Vec<Start> {
    netns::wait_formed(dir, hosts, NPROC, agents, deadline)
}

/// For `for_s` seconds, the same workers keep running: no worker stopped, none started.
fn assert_undisturbed(dir: &Path, group: &[Start], agents: &mut [Proc], for_s: f64, why: &str) {
    let n = starts(dir).len();
    let until = Instant::now() + Duration::from_secs_f64(for_s);
    while Instant::now() < until {
        for s in group {
            assert!(pid_alive(s.pid), "{why}: worker rank {} on host {} stopped", s.rank, s.host);
        }
        assert_eq!(starts(dir).len(), n, "{why}: workers were restarted: {:#?}", latest_per_worker(&starts(dir)));
        for a in agents.iter_mut() {
            assert!(a.try_status().is_none(), "{why}: {} exited", a.name);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Kills every process of host `lost`, then expects `survivors` to run one group again within
/// the TTL plus some slack; returns the seconds that took.
fn lose_host(cluster: &Cluster, lost: usize, dir: &Path, survivors: &[&str], agents: &mut [Proc]) -> f64 {
    let t0 = now_unix_f64();
    cluster.host(lost).kill_all();
    let after = wait_formed(dir, survivors, agents, Duration::from_secs_f64(TTL_S + 10.0));
    let took = after.iter().map(|s| s.t).fold(f64::MIN, f64::max) - t0;
    assert!(
        took < TTL_S + RECOVERY_SLACK_S,
        "recovery took {took:.2} s, more than the TTL ({TTL_S} s) + {RECOVERY_SLACK_S} s"
    );
    took
}

#[test]
fn three_hosts_on_etcd_form_one_group_and_reform_after_a_node_loss() {
    let cluster = Cluster::new(3);
    let etcd = Etcd::start(&cluster, 1);
    let dir = tempdir();
    let args = agent_args("etcd", "1:3", &etcd.endpoints(), "etcd3", dir.path());
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    let before = wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);
    let took = lose_host(&cluster, 2, dir.path(), &["a", "b"], &mut agents[..2]);
    eprintln!("etcd backend, node loss: survivors running again after {took:.2} s");
    let status = rdzv_status("etcd", &etcd.endpoints(), "etcd3");
    let members = status_members(&status);
    assert!(
        members.len() == 2 && members[0].starts_with("a-") && members[1].starts_with("b-"),
        "rlaunch status on etcd shows hosts a and b: {status:#}"
    );
    assert_eq!(status["world_size"], 4, "{status:#}");
    for s in before.iter().filter(|s| s.host != "c") {
        assert!(!pid_alive(s.pid), "old worker rank {} on {} was stopped", s.rank, s.host);
    }
    finish(dir.path(), &mut agents[..2]);
}

#[test]
fn cutting_a_hosts_link_on_etcd_reforms_the_survivors_and_the_host_rejoins_when_restored() {
    let cluster = Cluster::new(3);
    let etcd = Etcd::start(&cluster, 1);
    let dir = tempdir();
    let args = agent_args("etcd", "1:3", &etcd.endpoints(), "etcd-cut", dir.path());
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    let before = wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);

    // Host c's etcd lease can no longer be kept alive; it expires after the TTL.
    let t0 = now_unix_f64();
    cluster.host(2).cut_link();
    let after = wait_formed(dir.path(), &["a", "b"], &mut agents[..2], Duration::from_secs_f64(TTL_S + 10.0));
    let took = after.iter().map(|s| s.t).fold(f64::MIN, f64::max) - t0;
    eprintln!("etcd backend, link cut: survivors running again after {took:.2} s");
    // etcd lease TTLs are whole seconds and expiry is checked every 500 ms: one more second.
    assert!(took < TTL_S + RECOVERY_SLACK_S + 1.0, "recovery took {took:.2} s");
    for s in before.iter().filter(|s| s.host != "c") {
        assert!(!pid_alive(s.pid), "old worker rank {} on {} was stopped", s.rank, s.host);
    }
    assert!(agents[2].try_status().is_none(), "the cut-off agent keeps running (it may come back)");

    cluster.host(2).restore_link();
    wait_formed(dir.path(), &["a", "b", "c"], &mut agents, FORM);
    finish(dir.path(), &mut agents);
    for h in cluster.hosts() {
        wait_until(&format!("host {} to have no process left", h.name), Duration::from_secs(5), || h.pids().is_empty());
    }
}

#[test]
fn two_hosts_on_etcd_run_and_finish() {
    let cluster = Cluster::new(2);
    let etcd = Etcd::start(&cluster, 1);
    let dir = tempdir();
    let args = agent_args("etcd", "2", &etcd.endpoints(), "etcd2", dir.path());
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    let group = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    let ips: Vec<&str> = cluster.hosts().iter().map(|h| h.ip.as_str()).collect();
    let master = group[0].master.rsplit_once(':').expect("host:port").0.to_string();
    assert!(ips.contains(&master.as_str()), "MASTER_ADDR {master} is a host's address: {ips:?}");
    finish(dir.path(), &mut agents);
}

#[test]
fn the_job_carries_on_through_the_other_server_replica_when_one_is_killed() {
    let cluster = Cluster::new(2);
    let etcd = Etcd::start(&cluster, 1);
    let dir = tempdir();
    let etcd_urls: Vec<String> = etcd.clients.iter().map(|c| format!("http://{c}")).collect();
    let mut replicas = Vec::new();
    let mut listens = Vec::new();
    for i in 0..2 {
        let listen = format!("{}:{}", cluster.root_ip(), cluster.free_root_port());
        let mut cmd = Command::new(bin("rlaunch-rendezvous"));
        cmd.args(["--listen", &listen, "--store", "etcd", "--etcd-endpoints", &etcd_urls.join(",")])
            .env("RLAUNCH_LOG", "info");
        replicas.push(Proc::spawn(
            cmd,
            &format!("rendezvous replica {i}"),
            &dir.path().join(format!("replica{i}.log")),
        ));
        listens.push(listen);
    }
    for l in &listens {
        wait_until(&format!("replica {l} to answer /healthz"), Duration::from_secs(10), || {
            http_get(l, "/healthz").is_some()
        });
    }
    let mut args = agent_args("rlaunch", "1:2", &listens.join(","), "replicas", dir.path());
    // Peer watching on (the default; said here so that the test does not depend on it).
    let at = args.iter().position(|a| a == CONF).expect("the conf argument");
    args[at] = format!("{CONF},peer_interval=0.1");
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    let group = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);

    // The first endpoint is the one agents use first: kill it.
    replicas[0].kill();
    assert_undisturbed(dir.path(), &group, &mut agents, TTL_S * 2.0, "after a replica was killed");
    // The job is still elastic through the other replica: a node loss is handled.
    let took = lose_host(&cluster, 1, dir.path(), &["a"], &mut agents[..1]);
    eprintln!("replica killed, then node loss: host a running alone after {took:.2} s");
    // Found by peer watching through the etcd-backed replica: host a, b's watcher, reported b's
    // agent gone (its host refused the ping), and the replica, refused there too, believed it.
    let log = std::fs::read_to_string(dir.path().join("replica1.log")).unwrap_or_default();
    assert!(
        log.contains("its watchers: a-") && log.contains("its agent gone"),
        "the surviving replica names the watcher's report:\n{}",
        &log[log.len().saturating_sub(3000)..]
    );
    finish(dir.path(), &mut agents[..1]);
}

#[test]
fn the_job_carries_on_when_one_of_three_etcd_members_is_killed() {
    let cluster = Cluster::new(2);
    let mut etcd = Etcd::start(&cluster, 3);
    let dir = tempdir();
    let args = agent_args("etcd", "1:2", &etcd.endpoints(), "etcd-members", dir.path());
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    let group = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);

    // The first endpoint is the member agents talk to first.
    etcd.members[0].kill();
    assert_undisturbed(dir.path(), &group, &mut agents, TTL_S * 2.5, "after an etcd member was killed");
    let took = lose_host(&cluster, 1, dir.path(), &["a"], &mut agents[..1]);
    eprintln!("etcd member killed, then node loss: host a running alone after {took:.2} s");
    finish(dir.path(), &mut agents[..1]);
}

#[test]
fn the_job_carries_on_when_the_etcd_leader_is_killed() {
    let cluster = Cluster::new(2);
    let mut etcd = Etcd::start(&cluster, 3);
    let dir = tempdir();
    let args = agent_args("etcd", "1:2", &etcd.endpoints(), "etcd-leader", dir.path());
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    let group = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);

    // A new leader is elected (election timeout 1 s); leases must outlive the election.
    let leader = etcd.leader();
    eprintln!("killing etcd member m{leader}, the leader");
    etcd.members[leader].kill();
    assert_undisturbed(dir.path(), &group, &mut agents, TTL_S * 2.5, "after the etcd leader was killed");
    let took = lose_host(&cluster, 1, dir.path(), &["a"], &mut agents[..1]);
    eprintln!("etcd leader killed, then node loss: host a running alone after {took:.2} s");
    finish(dir.path(), &mut agents[..1]);
}

#[test]
fn on_etcd_a_lossy_link_and_a_short_blackout_lose_no_node() {
    let cluster = Cluster::new(2);
    let etcd = Etcd::start(&cluster, 1);
    let dir = tempdir();
    let conf = format!("{CONF},probe_timeout=1");
    let mut args = agent_args("etcd", "1:2", &etcd.endpoints(), "etcd-loss", dir.path());
    let at = args.iter().position(|a| a == CONF).expect("the conf argument");
    args[at] = conf;
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    let group = wait_formed(dir.path(), &["a", "b"], &mut agents, FORM);
    let seconds = std::env::var("RL_LOSS_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60.0);
    // 15 % of host b's packets dropped each way, to etcd and to host a alike.
    cluster.host(1).set_loss(15, None);
    assert_undisturbed(dir.path(), &group, &mut agents, seconds, "15 % loss on host b's link (etcd)");
    cluster.host(1).clear_loss();
    // Nothing between b and etcd for 2.7 s (b fences itself after 4 s without an answer): its
    // 2 s lease may lapse; a reaches b directly, so b is kept and takes a new lease when etcd
    // answers again (the same, step by step: rendezvous/tests/etcd.rs).
    std::thread::sleep(Duration::from_secs(2));
    cluster.host(1).set_loss(100, Some(&cluster.root_ip()));
    std::thread::sleep(Duration::from_millis(2700));
    cluster.host(1).clear_loss();
    assert_undisturbed(dir.path(), &group, &mut agents, 8.0, "a 2.7 s blackout between etcd and host b");
    let log = agents[0].output();
    eprintln!(
        "etcd: b suspected {} time(s), reached by a's probes {} time(s), over the lossy minute and the blackout",
        log.matches("suspected (").count(),
        log.matches("reached suspected node").count()
    );
    finish(dir.path(), &mut agents);
}

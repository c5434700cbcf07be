//! The etcd store against a real etcd (Debian's `etcd-server`) started here on loopback, and the
//! `rlaunch-rendezvous` binary: replicas on one etcd, lease expiry as node loss, shutdown.
//!
//! A missing `etcd` binary fails these tests loudly (run `scripts/install-deps.sh`).

use std::future::Future;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rlaunch::contract::RootCause;
use rlaunch_rendezvous::round::{JobSettings, NodeInfo};
use rlaunch_rendezvous::{Backend, RdzvError, RendezvousClient, WatchEvent};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The `rlaunch-rendezvous` binary (built by the launcher package: `cargo build -p
/// rlaunch-launcher --bins`, which `scripts/test.sh` does before the tests).
fn service_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/<test> → target/<profile>/rlaunch-rendezvous
    let bin = exe.parent().and_then(|d| d.parent()).expect("target/<profile>").join("rlaunch-rendezvous");
    assert!(bin.exists(), "{} is missing: cargo build -p rlaunch-launcher --bins", bin.display());
    bin
}

fn rc(message: impl ToString) -> Box<RootCause> {
    Box::new(RootCause::from_message(message.to_string()))
}

const DEADLINE: Duration = Duration::from_secs(30);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {DEADLINE:?}"),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free loopback port").port()
}

/// An etcd cluster (1 or 3 members) on loopback with temporary data dirs; killed when dropped.
struct Etcd {
    members: Vec<Option<Child>>,
    endpoints: Vec<String>,
    /// The first member's client URL (single-member tests).
    endpoint: String,
    dir: tempfile::TempDir,
}

impl Etcd {
    async fn start() -> Etcd {
        Self::cluster(1).await
    }

    async fn cluster(n: usize) -> Etcd {
        let bin = which("etcd").unwrap_or_else(|| {
            panic!("`etcd` is not on PATH: install Debian's etcd-server (scripts/install-deps.sh); these tests need a real etcd")
        });
        let dir = tempfile::tempdir().expect("temp dir");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> =
            ports.iter().enumerate().map(|(i, (_, p))| format!("m{i}=http://127.0.0.1:{p}")).collect();
        let mut members = Vec::new();
        let mut endpoints = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let endpoint = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = std::fs::File::create(dir.path().join(format!("etcd-m{i}.log"))).expect("etcd log file");
            let child = Command::new(&bin)
                .args(["--name", &format!("m{i}"), "--data-dir"])
                .arg(dir.path().join(format!("data-m{i}")))
                .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
                .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", "new"])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("etcd starts");
            members.push(Some(child));
            endpoints.push(endpoint);
        }
        let etcd = Etcd { members, endpoint: endpoints[0].clone(), endpoints, dir };
        let ready = async {
            for e in &etcd.endpoints {
                loop {
                    if let Ok(mut c) = etcd_client::Client::connect([e.as_str()], None).await {
                        if c.status().await.is_ok_and(|s| s.leader() != 0) {
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        // Generous: a three-member election on a loaded two-core machine can take a while.
        if tokio::time::timeout(Duration::from_secs(45), ready).await.is_err() {
            let mut logs = String::new();
            for i in 0..n {
                let log = std::fs::read_to_string(etcd.dir.path().join(format!("etcd-m{i}.log"))).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                logs.push_str(&format!(
                    "--- member {i}, last lines:\n{}\n",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ));
            }
            panic!("etcd did not become ready:\n{logs}");
        }
        etcd
    }

    /// SIGKILLs member `i`.
    fn kill_member(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
    }
}

fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| std::path::Path::new(d).join(name)).find(|p| p.is_file())
}

/// An `rlaunch-rendezvous` process on etcd; killed (SIGKILL) when dropped.
struct Replica {
    child: Child,
    endpoint: String,
}

impl Replica {
    async fn start(etcd: &Etcd) -> Replica {
        let port = free_port();
        let child = Command::new(service_bin())
            .args(["--listen", &format!("127.0.0.1:{port}"), "--store", "etcd"])
            .args(["--etcd-endpoints", &etcd.endpoint])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("rlaunch-rendezvous starts");
        let endpoint = format!("127.0.0.1:{port}");
        let http = reqwest::Client::builder().no_proxy().build().expect("http client");
        let url = format!("http://{endpoint}/healthz");
        let ready = async {
            loop {
                if http.get(&url).send().await.is_ok_and(|r| r.status().is_success()) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(15), ready).await.expect("replica answers /healthz");
        Replica { child, endpoint }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn settings(min: u32, max: u32) -> JobSettings {
    JobSettings {
        min_nodes: min,
        max_nodes: max,
        join_timeout: Duration::from_secs(30),
        last_call_timeout: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(300),
        node_ttl: Duration::from_secs(2),
        probe_timeout: Duration::from_secs(1),
        peer_interval: Duration::from_millis(100),
        stall_bound: Duration::from_millis(500),
        max_restarts: 3,
        stop_grace: Duration::ZERO,
        hang_timeout: None,
        fingerprint: None,
    }
}

fn node(id: &str) -> NodeInfo {
    NodeInfo {
        node_id: id.to_owned(),
        local_world_size: 1,
        store_addr: format!("127.0.0.1:{}", 30000 + id.len()).parse().unwrap(),
        probe_addr: None,
        snapshot_addr: None,
        snapshot_key: None,
        snapshots: Vec::new(),
        fingerprint: None,
    }
}

/// What an agent does between rounds: heartbeat every interval.
fn beat(c: &RendezvousClient, id: &str) -> JoinHandle<()> {
    let (c, id) = (c.clone(), id.to_owned());
    tokio::spawn(async move {
        loop {
            let _ = c.heartbeat(&id, Default::default()).await;
            tokio::time::sleep(c.settings().heartbeat_interval).await;
        }
    })
}

/// Watches until something other than `NoChange` happens.
async fn next_event(c: &RendezvousClient, round: u64) -> WatchEvent {
    within("watch", async {
        loop {
            match c.watch(None, round).await {
                Ok(WatchEvent::NoChange) => {}
                Ok(ev) => return ev,
                Err(e) => panic!("watch failed: {e}"),
            }
        }
    })
    .await
}

async fn etcd_client(etcd: &Etcd, run_id: &str, s: JobSettings) -> RendezvousClient {
    RendezvousClient::connect(Backend::Etcd { endpoints: vec![etcd.endpoint.parse().expect("an endpoint")] }, run_id, s)
        .await
        .expect("client connects to etcd")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_lease_expiry_is_seen_as_node_loss() {
    let etcd = Etcd::start().await;
    let a = etcd_client(&etcd, "lease", settings(1, 2)).await;
    let b = etcd_client(&etcd, "lease", settings(1, 2)).await;
    let (ra, rb) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let (ra, rb) = (ra.expect("a joins"), rb.expect("b joins"));
    assert_eq!((ra.round, ra.group_world_size), (1, 2));
    assert!(!ra.members_digest.is_empty() && ra.members.is_empty(), "{ra:?}");
    assert_eq!(ra.members_digest, rb.members_digest);
    let beats = beat(&a, "a");
    // b's process dies: its client, its keep-alive task and its copy of the machine go with it.
    drop(b);
    let lost_at = Instant::now();
    assert_eq!(next_event(&a, ra.round).await, WatchEvent::NewRound(ra.round + 1));
    let took = lost_at.elapsed();
    eprintln!("etcd-direct: node loss noticed {took:?} after the node died");
    // TTL 2 s (etcd checks expiry every 0.5 s), then the probe timeout (1 s: a, the only
    // member to ask, does not answer probes here), plus a tick (0.25 s) and a loaded machine.
    assert!(took < Duration::from_millis(4500), "node loss noticed after {took:?}");
    let again = within("rejoin", a.join(node("a"))).await.expect("survivor rejoins");
    assert_eq!((again.round, again.group_world_size, again.restart_count), (2, 1, 0));
    let st = a.status().await.expect("status");
    assert_eq!(st.members.len(), 1);
    beats.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_backend_counts_a_failure_once_and_finishes_when_all_succeed() {
    let etcd = Etcd::start().await;
    let a = etcd_client(&etcd, "fail", settings(2, 2)).await;
    let b = etcd_client(&etcd, "fail", settings(2, 2)).await;
    let (ra, _) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let r = ra.expect("a joins").round;
    let (fa, fb) = tokio::join!(
        a.report_failure("a", r, rc(json!({"exit_code": 1}))),
        b.report_failure("bb", r, rc(json!({"exit_code": 2})))
    );
    fa.expect("report a");
    fb.expect("report b");
    assert_eq!(next_event(&b, r).await, WatchEvent::NewRound(r + 1));
    let (ra, rb) = within("rejoins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let (ra, rb) = (ra.expect("a"), rb.expect("b"));
    assert_eq!((ra.round, ra.restart_count, rb.restart_count), (r + 1, 1, 1));
    assert_ne!(ra.group_rank, rb.group_rank);
    a.report_success("a", ra.round).await.expect("success a");
    assert_eq!(b.status().await.expect("status").state, "running");
    b.report_success("bb", rb.round).await.expect("success b");
    assert_eq!(next_event(&a, ra.round).await, WatchEvent::Finished);
    assert!(matches!(a.join(node("a")).await, Err(RdzvError::JobFinished)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_server_replicas_on_one_etcd_serve_the_same_job_and_survive_a_kill() {
    let etcd = Etcd::start().await;
    let r1 = Replica::start(&etcd).await;
    let r2 = Replica::start(&etcd).await;
    let http = |endpoints: Vec<String>| async move {
        RendezvousClient::connect(
            Backend::Http {
                endpoints: endpoints.iter().map(|e| e.parse().expect("an endpoint")).collect(),
                token: None,
            },
            "repl",
            settings(2, 2),
        )
        .await
        .expect("client")
    };
    // a talks to r1 first, b to r2 first: the job is shared through etcd.
    let a = http(vec![r1.endpoint.clone(), r2.endpoint.clone()]).await;
    let b = http(vec![r2.endpoint.clone(), r1.endpoint.clone()]).await;
    let (ra, rb) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let (ra, rb) = (ra.expect("a joins via r1"), rb.expect("b joins via r2"));
    assert!(!ra.members_digest.is_empty() && ra.members.is_empty(), "{ra:?}");
    assert_eq!(ra.members_digest, rb.members_digest);
    let (ba, bb) = (beat(&a, "a"), beat(&b, "bb"));

    r1.kill();
    // For longer than the TTL, nobody is declared lost: a's heartbeats fail over to r2.
    let quiet_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < quiet_until {
        match within("watch", a.watch(None, ra.round)).await.expect("watch through r2") {
            WatchEvent::NoChange => {}
            other => panic!("the job was disturbed by losing a replica: {other:?}"),
        }
    }
    let st = b.status().await.expect("status via r2");
    assert_eq!((st.state.as_str(), st.round, st.members.len()), ("running", ra.round, 2));

    // The job still restarts through the surviving replica.
    a.report_failure("a", ra.round, rc(json!({"exit_code": 7}))).await.expect("report via r2");
    assert_eq!(next_event(&b, ra.round).await, WatchEvent::NewRound(ra.round + 1));
    let (ra2, rb2) = within("rejoins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    assert_eq!(ra2.expect("a rejoins").round, ra.round + 1);
    assert_eq!(rb2.expect("b rejoins").restart_count, 1);

    // A fresh replica sees the same job: the state was never in a replica's memory.
    let r3 = Replica::start(&etcd).await;
    let c = http(vec![r3.endpoint.clone()]).await;
    let st = c.status().await.expect("status via r3");
    assert_eq!((st.round, st.restart_count), (ra.round + 1, 1));
    assert_eq!(st.last_root_cause, Some(*rc(json!({"exit_code": 7}))));
    ba.abort();
    bb.abort();
    drop((r2, r3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_lost_behind_a_replica_is_detected_by_its_lease() {
    let etcd = Etcd::start().await;
    let r1 = Replica::start(&etcd).await;
    let http = |endpoints: Vec<String>| async move {
        RendezvousClient::connect(
            Backend::Http {
                endpoints: endpoints.iter().map(|e| e.parse().expect("an endpoint")).collect(),
                token: None,
            },
            "hlease",
            settings(1, 2),
        )
        .await
        .expect("client")
    };
    let a = http(vec![r1.endpoint.clone()]).await;
    let b = http(vec![r1.endpoint.clone()]).await;
    let (ra, _) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let ra = ra.expect("a joins");
    let beats = beat(&a, "a");
    let silent_since = Instant::now();
    assert_eq!(next_event(&a, ra.round).await, WatchEvent::NewRound(ra.round + 1));
    let took = silent_since.elapsed();
    eprintln!("replica on etcd: node loss noticed {took:?} after the node went silent");
    // The lease (2 s, expiry checked every 0.5 s), the probe timeout (1 s), a tick, some load.
    assert!(took < Duration::from_millis(4500), "node loss noticed after {took:?}");
    beats.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_binary_stops_gracefully_on_sigterm() {
    let port = free_port();
    let mut child = Command::new(service_bin())
        .env("RLAUNCH_RDZV_LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("starts");
    let http = reqwest::Client::builder().no_proxy().build().expect("http client");
    let url = format!("http://127.0.0.1:{port}/healthz");
    within("healthz", async {
        while !http.get(&url).send().await.is_ok_and(|r| r.status().is_success()) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let pid = i32::try_from(child.id()).expect("pid fits");
    // SAFETY: sending a signal to a child we spawned and have not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = within("exit", async {
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_carries_on_when_one_of_three_etcd_members_is_killed() {
    let mut etcd = Etcd::cluster(3).await;
    let connect = |endpoints: Vec<String>| async move {
        RendezvousClient::connect(
            Backend::Etcd { endpoints: endpoints.iter().map(|e| e.parse().expect("an endpoint")).collect() },
            "three",
            settings(2, 2),
        )
        .await
        .expect("client")
    };
    let a = connect(etcd.endpoints.clone()).await;
    let b = connect(etcd.endpoints.iter().rev().cloned().collect()).await;
    let (ra, rb) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let (ra, _) = (ra.expect("a joins"), rb.expect("b joins"));
    let (ba, bb) = (beat(&a, "a"), beat(&b, "bb"));

    etcd.kill_member(0);
    let quiet_until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < quiet_until {
        match within("watch", a.watch(None, ra.round)).await {
            Ok(WatchEvent::NoChange) => {}
            // A request caught on the dying member may fail once; the next goes elsewhere.
            Err(e) => eprintln!("watch error while a member died: {e}"),
            Ok(other) => panic!("the job was disturbed by losing an etcd member: {other:?}"),
        }
    }
    a.report_failure("a", ra.round, rc(json!("crash"))).await.expect("report on the surviving members");
    assert_eq!(next_event(&b, ra.round).await, WatchEvent::NewRound(ra.round + 1));
    let (ra2, rb2) = within("rejoins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    assert_eq!(ra2.expect("a rejoins").round, ra.round + 1);
    assert_eq!(rb2.expect("b rejoins").restart_count, 1);
    ba.abort();
    bb.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_etcd_is_gone_answers_a_generic_500() {
    let mut etcd = Etcd::start().await;
    let r = Replica::start(&etcd).await;
    let c = RendezvousClient::connect(
        Backend::Http { endpoints: vec![r.endpoint.parse().expect("an endpoint")], token: None },
        "gone",
        settings(1, 1),
    )
    .await
    .expect("client");
    within("join", c.join(node("a"))).await.expect("join");
    etcd.kill_member(0);
    let http = reqwest::Client::builder().no_proxy().build().expect("http client");
    let resp = within("status", http.get(format!("http://{}/v1/jobs/gone", r.endpoint)).send()).await.expect("answer");
    assert_eq!(resp.status().as_u16(), 500);
    let body: serde_json::Value = within("body", resp.json()).await.expect("json body");
    assert_eq!(body, json!({"error": "internal", "message": "internal error"}));
    // The client sees the service as unavailable (a transient error), not as a refusal.
    let err = within("status via client", c.status()).await.expect_err("no etcd");
    assert!(err.is_transient(), "{err}");
}

/// What the agent's heartbeat task does with probe requests: reach each node's store directly.
async fn probe_all(
    reqs: &[rlaunch_rendezvous::detector::ProbeRequest],
) -> Vec<rlaunch_rendezvous::detector::ProbeReport> {
    let mut out = Vec::new();
    for r in reqs {
        let reached = rlaunch::store::probe(&r.addr.to_string(), 7, Duration::from_millis(500)).await.is_ok();
        out.push(rlaunch_rendezvous::detector::ProbeReport { node_id: r.node_id.clone(), reached });
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_lease_is_a_suspicion_that_a_reachable_node_survives_and_then_takes_a_new_lease() {
    use rlaunch_rendezvous::Beat;
    let etcd = Etcd::start().await;
    // b's agent serves its store; the rendezvous probes that.
    let b_store = rlaunch::store::StoreServer::start("127.0.0.1:0".parse().unwrap()).await.expect("b's store");
    let mut b_node = node("bb");
    b_node.store_addr = b_store.local_addr().to_string().parse().unwrap();
    let a = etcd_client(&etcd, "lapse", settings(1, 2)).await;
    // b's agent runs the machine itself, heartbeating only when this test says (its process
    // keeps its secret across the silence).
    let b = etcd_service(&etcd).await;
    let s = settings(1, 2);
    let (ra, rb) = within("joins", async {
        tokio::join!(a.join(node("a")), b.join("lapse", &s, b_node.clone(), None, false, Duration::from_secs(10)))
    })
    .await;
    let (ra, b_secret) = (ra.expect("a joins"), rb.expect("b joins").secret);
    // a does what its agent's heartbeat task does: heartbeat, probe what it is asked to, report.
    let reports = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let prober = tokio::spawn({
        let (a, reports) = (a.clone(), reports.clone());
        async move {
            loop {
                if let Ok(answer) = a.heartbeat("a", Beat::default()).await {
                    if !answer.probe.is_empty() {
                        let probes = probe_all(&answer.probe).await;
                        reports.lock().unwrap().extend(probes.clone());
                        let _ = a.heartbeat("a", Beat { sent: None, probes, ..Default::default() }).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    // b's link to etcd goes quiet (no keep-alives) while its agent still answers probes.
    let silent_at = Instant::now();
    within("b suspected, probed by a, reached", async {
        while !reports.lock().unwrap().iter().any(|r| r.node_id == "bb" && r.reached) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    eprintln!("b's lease lapsed and a reached it {:?} after b fell silent", silent_at.elapsed());
    // Past the probe timeout, twice, the job has not lost b: a member keeps reaching it.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let st = a.status().await.expect("status");
    let b_status = st.members.iter().find(|m| m.node_id == "bb").expect("b is still a member");
    assert!(b_status.health.suspected_for_ms.is_some(), "b is suspected: {b_status:?}");
    assert_eq!(b_status.health.reached_by.as_deref(), Some("a"), "{b_status:?}");
    assert_eq!(st.round, ra.round, "no new round: {}", st.last_reason);
    // b's agent reaches etcd again: its lease lapsed, but the job still counts it, so it takes a
    // new one, and the next tick clears the suspicion.
    b.heartbeat("lapse", "bb", Some(&b_secret), Beat::default()).await.expect("b's heartbeat renews its lease");
    within("b no longer suspected", async {
        loop {
            let st = a.status().await.expect("status");
            if st.members.iter().any(|m| m.node_id == "bb" && m.health.suspected_for_ms.is_none()) {
                assert_eq!(st.round, ra.round, "{}", st.last_reason);
                return;
            }
            let _ = b.heartbeat("lapse", "bb", Some(&b_secret), Beat::default()).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    // Had nobody reached it, it would have been lost: b's agent goes away, its lease lapses
    // again, and a's probes find nothing.
    b_store.shutdown().await.expect("b's store stops");
    drop(b);
    assert_eq!(next_event(&a, ra.round).await, WatchEvent::NewRound(ra.round + 1));
    assert!(reports.lock().unwrap().iter().any(|r| r.node_id == "bb" && !r.reached), "a's probe missed");
    prober.abort();
}

/// A rendezvous service (what a replica runs) over this etcd.
async fn etcd_service(etcd: &Etcd) -> std::sync::Arc<rlaunch_rendezvous::Rendezvous> {
    use rlaunch_rendezvous::store::etcd::EtcdStore;
    let store = EtcdStore::connect(&[etcd.endpoint.parse().expect("an endpoint")]).await.expect("store connects");
    rlaunch_rendezvous::Rendezvous::new(rlaunch_rendezvous::Store::Etcd(store))
}

/// Every lease etcd holds, and every key under `prefix`.
async fn leases_and_keys(etcd: &Etcd, prefix: &str) -> (Vec<i64>, Vec<String>) {
    let mut c = etcd_client::Client::connect([etcd.endpoint.as_str()], None).await.expect("etcd client");
    let mut leases: Vec<i64> = c.leases().await.expect("lease list").leases().iter().map(|l| l.id()).collect();
    leases.sort_unstable();
    let keys = c
        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix().with_keys_only()))
        .await
        .expect("get")
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect();
    (leases, keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_forged_calls_are_refused_and_keep_no_dead_node_alive() {
    let etcd = Etcd::start().await;
    let rdzv = etcd_service(&etcd).await;
    let s = settings(1, 2);
    let a = within("a joins", rdzv.join("forge", &s, node("a"), None, false, Duration::ZERO)).await.expect("a");
    let b =
        within("b joins", rdzv.join("forge", &s, node("bb"), None, false, Duration::from_secs(5))).await.expect("b");
    let round = match &b.answer {
        rlaunch_rendezvous::JoinAnswer::Round(info) => info.round,
        other => panic!("b did not get a round: {other:?}"),
    };
    let mut hijack = node("a");
    hijack.store_addr = "6.6.6.6:6666".parse().unwrap();
    let forbidden = |r: Result<(), RdzvError>, what: &str| match r {
        Err(RdzvError::Forbidden { .. }) => {}
        other => panic!("{what}: {other:?}"),
    };
    let joined = rdzv.join("forge", &s, hijack, Some(&b.secret), false, Duration::ZERO).await.map(|_| ());
    forbidden(joined, "forged re-join");
    forbidden(rdzv.report_failure("forge", "a", None, round, rc("forged")).await, "forged failure");
    forbidden(rdzv.leave("forge", "a", Some(&b.secret)).await, "forged leave");
    // a is dead; a forger keeps beating for it, b beats for itself: a is still lost.
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < Duration::from_secs(8), "a was never declared lost");
        rdzv.heartbeat("forge", "bb", Some(&b.secret), Default::default()).await.expect("b beats");
        let forged = rdzv.heartbeat("forge", "a", None, Default::default()).await.map(|_| ());
        assert!(matches!(forged, Err(RdzvError::Forbidden { .. }) | Err(RdzvError::UnknownNode { .. })), "{forged:?}");
        if rdzv.status("forge").await.expect("status").round > round {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let st = rdzv.status("forge").await.expect("status");
    assert!(st.last_reason.contains("node(s) a ("), "{}", st.last_reason);
    assert_eq!(st.restart_count, 0, "no forged failure was counted");
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_refused_join_leaves_no_lease_and_no_key() {
    let etcd = Etcd::start().await;
    let rdzv = etcd_service(&etcd).await;
    let s = settings(1, 2);
    let a = within("a joins", rdzv.join("kept", &s, node("a"), None, false, Duration::ZERO)).await.expect("a");
    let before = leases_and_keys(&etcd, "/rlaunch/").await;
    // Another job's settings, a node no job may hold, a forged re-join, a job over the bound.
    let mut other = s.clone();
    other.max_restarts += 1;
    let refused = rdzv.join("kept", &other, node("z"), None, false, Duration::ZERO).await;
    assert!(matches!(refused, Err(RdzvError::SettingsMismatch { .. })), "{refused:?}");
    let mut bad = node("y");
    bad.local_world_size = 0;
    let refused = rdzv.join("fresh", &s, bad, None, false, Duration::ZERO).await;
    assert!(matches!(refused, Err(RdzvError::BadRequest { .. })), "{refused:?}");
    let refused = rdzv.join("kept", &s, node("a"), None, false, Duration::ZERO).await;
    assert!(matches!(refused, Err(RdzvError::Forbidden { .. })), "{refused:?}");
    let mut huge = s.clone();
    huge.max_nodes = 1 << 20;
    let refused = rdzv.join("huge", &huge, node("x"), None, false, Duration::ZERO).await;
    assert!(matches!(refused, Err(RdzvError::InvalidSettings(_))), "{refused:?}");
    let after = leases_and_keys(&etcd, "/rlaunch/").await;
    assert_eq!(after, before, "a refused join wrote nothing");
    // Refused by the job (another TTL than it was created with): the node's key is put on a
    // lease for that TTL first, as for any join, then deleted; the lease, holding no key, is
    // revoked within a few seconds.
    let mut ttl = s.clone();
    ttl.node_ttl = Duration::from_secs(7);
    let refused = rdzv.join("kept", &ttl, node("w"), None, false, Duration::ZERO).await;
    assert!(matches!(refused, Err(RdzvError::SettingsMismatch { .. })), "{refused:?}");
    assert_eq!(leases_and_keys(&etcd, "/rlaunch/").await.1, before.1, "no key left");
    let started = Instant::now();
    while leases_and_keys(&etcd, "/rlaunch/").await != before {
        // a stays alive meanwhile (its key would otherwise go after its TTL).
        rdzv.heartbeat("kept", "a", Some(&a.secret), Default::default()).await.expect("a beats");
        assert!(started.elapsed() < Duration::from_secs(6), "the refused join's lease was never revoked");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(a);
}

/// Liveness through a replica's own lease: a node heard by another replica moves its key there,
/// and the first replica, no longer hearing from it, must not delete the key (it is on the other
/// lease now); a replica that goes away leaves its nodes to the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_node_moving_between_replicas_keeps_its_liveness() {
    use rlaunch_rendezvous::store::etcd::EtcdStore;
    let etcd = Etcd::start().await;
    let store2 = EtcdStore::connect(&[etcd.endpoint.parse().expect("an endpoint")]).await.expect("store connects");
    let r1 = etcd_service(&etcd).await;
    let r2 = rlaunch_rendezvous::Rendezvous::new(rlaunch_rendezvous::Store::Etcd(store2.clone()));
    let s = settings(2, 2);
    let (a, b) = within("joins through the first replica", async {
        tokio::join!(
            r1.join("move", &s, node("a"), None, false, Duration::from_secs(10)),
            r1.join("move", &s, node("bb"), None, false, Duration::from_secs(10))
        )
    })
    .await;
    let (a, b) = (a.expect("a joins"), b.expect("b joins"));
    assert!(matches!(a.answer, rlaunch_rendezvous::JoinAnswer::Round(_)), "{:?}", a.answer);
    let (_, keys) = leases_and_keys(&etcd, "/rlaunch/jobs/move/alive/").await;
    assert_eq!(keys.len(), 2, "{keys:?}");
    let lease_of = |etcd: &Etcd| {
        let endpoint = etcd.endpoint.clone();
        async move {
            let mut c = etcd_client::Client::connect([endpoint.as_str()], None).await.expect("etcd client");
            let resp = c
                .get("/rlaunch/jobs/move/alive/", Some(etcd_client::GetOptions::new().with_prefix()))
                .await
                .expect("get");
            resp.kvs().iter().map(|kv| kv.lease()).collect::<Vec<i64>>()
        }
    };
    let first = lease_of(&etcd).await;
    assert_eq!(first[0], first[1], "one lease for both nodes, the replica's: {first:?}");
    // The second replica takes a's key over at a's first heartbeat there (not by the fallback
    // for a key that lapsed, which reads the whole job).
    let taken = store2.keep_alive("move", "a").await.expect("a's key taken over by the second replica");
    assert!(taken.reason.ends_with("heard from"), "{}", taken.reason);
    let after = lease_of(&etcd).await;
    assert!(after.contains(&first[0]) && after.iter().any(|l| *l != first[0]), "a's key moved: {after:?}");
    // Both now beat only through the second replica, for three TTLs: the first stops hearing
    // from them after one.
    let started = Instant::now();
    while started.elapsed() < s.node_ttl * 3 {
        for (id, j) in [("a", &a), ("bb", &b)] {
            r2.heartbeat("move", id, Some(&j.secret), Default::default()).await.expect("beat through r2");
        }
        tokio::time::sleep(s.heartbeat_interval).await;
    }
    let moved = lease_of(&etcd).await;
    assert_eq!(moved.len(), 2, "both keys are still there: {moved:?}");
    assert!(moved.iter().all(|l| *l == moved[0] && *l != first[0]), "on the second replica's lease: {moved:?}");
    let st = r2.status("move").await.expect("status");
    assert_eq!((st.round, st.members.len(), st.restart_count), (1, 2, 0), "{}", st.last_reason);
    // The first replica goes away (its lease is not revoked): nothing changes for the job.
    drop(r1);
    for _ in 0..4 {
        for (id, j) in [("a", &a), ("bb", &b)] {
            r2.heartbeat("move", id, Some(&j.secret), Default::default()).await.expect("beat through r2");
        }
        tokio::time::sleep(s.heartbeat_interval).await;
    }
    assert_eq!(r2.status("move").await.expect("status").round, 1);
    // Only a beats from now on: bb's key is deleted after its TTL and bb is lost.
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < Duration::from_secs(10), "bb was never declared lost");
        r2.heartbeat("move", "a", Some(&a.secret), Default::default()).await.expect("a beats");
        let st = r2.status("move").await.expect("status");
        if st.round > 1 {
            assert!(st.last_reason.contains("node(s) bb ("), "{}", st.last_reason);
            break;
        }
        tokio::time::sleep(s.heartbeat_interval).await;
    }
    eprintln!("bb lost {:?} after its last heartbeat", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_4_mib_of_job_state_a_victim_job_still_loses_its_silent_node() {
    use rlaunch_rendezvous::round::{apply, Event, Job, Phase};
    let etcd = Etcd::start().await;
    // 36 finished jobs of 1,000 nodes each: about 6 MB of state under the prefix, more than one
    // etcd answer may carry (4 MiB).
    let mut filler = Job::new(settings(1, 1000), 0);
    for i in 0..1000 {
        let mut n = node(&format!("filler-node-{i:04}-{}", "x".repeat(40)));
        n.local_world_size = 8;
        filler = apply(&filler, Event::Join(n), 1).0;
    }
    filler.phase = Phase::Finished { at: rlaunch_rendezvous::service::now_ms() };
    let value = serde_json::to_vec(&filler).expect("encode");
    let mut c = etcd_client::Client::connect([etcd.endpoint.as_str()], None).await.expect("etcd client");
    for i in 0..36 {
        c.put(format!("/rlaunch/jobs/filler-{i:02}/state"), value.clone(), None).await.expect("put filler");
    }
    assert!(value.len() * 36 > 4 << 20, "{} bytes of state", value.len() * 36);
    let rdzv = etcd_service(&etcd).await;
    let s = settings(1, 2);
    let a = within("a joins", rdzv.join("victim", &s, node("a"), None, false, Duration::ZERO)).await.expect("a");
    let b =
        within("b joins", rdzv.join("victim", &s, node("bb"), None, false, Duration::from_secs(5))).await.expect("b");
    let round = match &b.answer {
        rlaunch_rendezvous::JoinAnswer::Round(info) => info.round,
        other => panic!("b did not get a round: {other:?}"),
    };
    // a falls silent now; b keeps beating.
    let silent_at = Instant::now();
    loop {
        let took = silent_at.elapsed();
        // TTL 2 s + probe timeout 1 s + expiry check and ticks, on a loaded machine.
        assert!(took < Duration::from_millis(5000), "a not lost after {took:?}");
        rdzv.heartbeat("victim", "bb", Some(&b.secret), Default::default()).await.expect("b beats");
        if rdzv.status("victim").await.expect("status").round > round {
            eprintln!("victim job lost its silent node {took:?} after it fell silent");
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(rdzv.list().await.expect("every job listed").len(), 37);
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_state_past_etcds_request_limit_is_written_in_parts() {
    use rlaunch_rendezvous::round::{Event, Guard};
    use rlaunch_rendezvous::store::etcd::EtcdStore;
    let etcd = Etcd::start().await;
    let store = EtcdStore::connect(&[etcd.endpoint.parse().expect("an endpoint")]).await.expect("store");
    // 6,000 nodes with long ids wait to join: about 2.5 MB of state, over etcd's 1.5 MiB limit
    // on one request.
    let mut s = settings(1, 20_000);
    s.min_nodes = 20_000;
    let long = |i: usize| {
        let mut n = node(&format!("{i:05}-{}", "n".repeat(200)));
        n.local_world_size = 8;
        n
    };
    let mut joins = tokio::task::JoinSet::new();
    for i in 0..6000 {
        let (store, s, n) = (store.clone(), s.clone(), long(i));
        joins.spawn(async move {
            store.apply("big", Some(&s), Event::Join(n), Guard::default(), rlaunch_rendezvous::service::now_ms()).await
        });
    }
    within("6,000 joins", async {
        while let Some(r) = joins.join_next().await {
            r.expect("join task").expect("join applied");
        }
    })
    .await;
    let job = store.load("big", 0).await.expect("load").expect("the job");
    assert_eq!(job.pending.len(), 6000);
    let (_, keys) = leases_and_keys(&etcd, "/rlaunch/jobs/big/part/").await;
    assert!(keys.len() >= 3, "written in parts (over 1.5 MiB): {keys:?}");
    // Every node leaves: the state is small again and the parts are gone.
    let mut leaves = tokio::task::JoinSet::new();
    for i in 0..6000 {
        let (store, id) = (store.clone(), long(i).node_id);
        leaves.spawn(async move {
            store
                .apply(
                    "big",
                    None,
                    Event::Leave { node_id: id },
                    Guard::default(),
                    rlaunch_rendezvous::service::now_ms(),
                )
                .await
        });
    }
    within("6,000 leaves", async {
        while let Some(r) = leaves.join_next().await {
            r.expect("leave task").expect("leave applied");
        }
    })
    .await;
    let job = store.load("big", 0).await.expect("load").expect("the job");
    assert!(job.pending.is_empty());
    let (_, keys) = leases_and_keys(&etcd, "/rlaunch/jobs/big/part/").await;
    assert!(keys.is_empty(), "stale parts left: {}", keys.len());
    assert_eq!(store.jobs(0).await.expect("list").len(), 1, "the ticker's listing reads a job in parts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_other_nodes_stacks_join_the_root_cause_and_the_job_takes_the_first_hang_timeout() {
    use rlaunch::contract::HangTimeout;
    let etcd = Etcd::start().await;
    let hang = Some(HangTimeout::Fixed(Duration::from_secs(300)));
    // a has a shutdown timeout of its own and no hang timeout; b gives one.
    let a = etcd_client(&etcd, "stk", JobSettings { stop_grace: Duration::from_secs(5), ..settings(2, 2) }).await;
    let b = etcd_client(&etcd, "stk", JobSettings { hang_timeout: hang, ..settings(2, 2) }).await;
    let (ra, rb) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let (ra, rb) = (ra.expect("a joins"), rb.expect("b joins"));
    assert_eq!((ra.hang_timeout, rb.hang_timeout), (hang, hang), "every member runs the job's hang timeout");
    // Each node speaks for its own rank (one worker each), whichever group rank it got.
    let (rank_a, rank_b) = (ra.rank_offset, rb.rank_offset);
    let mut cause = rc("hang");
    cause.stacks = vec![format!("rank {rank_b}: stuck_here (x.py:4)"), format!("rank {rank_a}: lie (x.py:1)")];
    b.report_failure("bb", ra.round, cause).await.expect("b reports the hang");
    a.report_stacks("a", ra.round, vec![format!("rank {rank_a}: all_reduce (c10d.py:9)")]).await.expect("a's stacks");
    let st = a.status().await.expect("status");
    let stacks = st.last_root_cause.expect("root cause").stacks;
    assert_eq!(
        stacks,
        [format!("rank {rank_b}: stuck_here (x.py:4)"), format!("rank {rank_a}: all_reduce (c10d.py:9)")]
    );
}

/// Parts of a job's state under generations no header names (a replica killed in the middle of
/// a large write) are deleted by the job's next write, small or in parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_that_no_header_names_are_collected_by_the_jobs_next_write() {
    use rlaunch_rendezvous::round::{Event, Guard};
    use rlaunch_rendezvous::service::now_ms;
    use rlaunch_rendezvous::store::etcd::EtcdStore;
    let etcd = Etcd::start().await;
    let store = EtcdStore::connect(&[etcd.endpoint.parse().expect("an endpoint")]).await.expect("store");
    let mut s = settings(1, 5000);
    s.min_nodes = 5000;
    let join = |n: NodeInfo| {
        let (store, s) = (store.clone(), s.clone());
        async move { store.apply("orph", Some(&s), Event::Join(n), Guard::default(), now_ms()).await }
    };
    within("first join", join(node("a"))).await.expect("join applied");
    let mut c = etcd_client::Client::connect([etcd.endpoint.as_str()], None).await.expect("etcd client");
    let orphans = ["0000000000000000", "ffffffffffffffff"];
    let plant = || {
        let mut c = c.clone();
        async move {
            for generation in orphans {
                for i in 0..2 {
                    let key = format!("/rlaunch/jobs/orph/part/{generation}/{i:04}");
                    c.put(key, vec![b'x'; 1024], None).await.expect("put an orphan part");
                }
            }
        }
    };
    within("orphans", plant()).await;
    let (_, keys) = leases_and_keys(&etcd, "/rlaunch/jobs/orph/part/").await;
    assert_eq!(keys.len(), 4, "{keys:?}");
    within("second join", join(node("b"))).await.expect("join applied");
    let (_, keys) = leases_and_keys(&etcd, "/rlaunch/jobs/orph/part/").await;
    assert!(keys.is_empty(), "orphan parts left after a small write: {keys:?}");

    // Around a state written in parts: only the generation its header names is left.
    within("orphans", plant()).await;
    let long = |i: usize| node(&format!("{i:05}-{}", "n".repeat(200)));
    let mut joins = tokio::task::JoinSet::new();
    for i in 0..2500 {
        joins.spawn(join(long(i)));
    }
    within("2,500 joins", async {
        while let Some(r) = joins.join_next().await {
            r.expect("join task").expect("join applied");
        }
    })
    .await;
    let (_, keys) = leases_and_keys(&etcd, "/rlaunch/jobs/orph/part/").await;
    let generations: std::collections::BTreeSet<&str> = keys.iter().filter_map(|k| k.split('/').nth(5)).collect();
    assert_eq!(generations.len(), 1, "written in parts, one generation: {generations:?}");
    assert!(orphans.iter().all(|o| !generations.contains(o)), "{generations:?}");
    let job = store.load("orph", 0).await.expect("load").expect("the job");
    assert_eq!(job.pending.len(), 2502, "the state reads back whole");
    c.delete("/rlaunch/", Some(etcd_client::DeleteOptions::new().with_prefix())).await.expect("clean up");
}

/// Issue 34 (item 7): the service never compacted etcd, whose history (every state write is a
/// revision) grew its database until etcd's quota made every write fail. Now each replica
/// compacts the history older than `keep`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_history_older_than_the_kept_window_is_compacted() {
    use rlaunch_rendezvous::store::etcd::{Compaction, EtcdStore};
    let etcd = Etcd::start().await;
    let store = EtcdStore::connect(&[etcd.endpoint.parse().expect("an endpoint")]).await.expect("store connects");
    store.set_compaction(Compaction { keep: Duration::from_millis(500), every: Duration::from_millis(200) });
    let rdzv = rlaunch_rendezvous::Rendezvous::new(rlaunch_rendezvous::Store::Etcd(store));
    let mut c = etcd_client::Client::connect([etcd.endpoint.as_str()], None).await.expect("etcd client");
    let old = c.put("/other/key", "v0", None).await.expect("put").header().expect("header").revision();
    // The service writes a job's state meanwhile, as a job would.
    rdzv.join("compacted", &settings(1, 1), node("a"), None, false, Duration::ZERO).await.expect("joins");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let at_old = c.get("/other/key", Some(etcd_client::GetOptions::new().with_revision(old))).await;
        match at_old {
            Err(e) if e.to_string().contains("compacted") => break,
            other => assert!(Instant::now() < deadline, "revision {old} never compacted: {other:?}"),
        }
        c.put("/other/key", "v1", None).await.expect("put");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The service goes on over the compacted history.
    let st = rdzv.status("compacted").await.expect("status");
    assert_eq!(st.round, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_etcd_a_watchers_report_of_a_gone_agent_is_checked_then_ends_the_round_before_the_lease_lapses() {
    use rlaunch_rendezvous::detector::PeerReport;
    use rlaunch_rendezvous::Beat;
    let etcd = Etcd::start().await;
    // b's agent answers at its store while it lives; a and b each run the machine on etcd in a
    // process of their own, as two replicas would.
    let b_store = rlaunch::store::StoreServer::start("127.0.0.1:0".parse().unwrap()).await.expect("b's store");
    let mut b_node = node("bb");
    b_node.store_addr = b_store.local_addr().to_string().parse().unwrap();
    let a = etcd_client(&etcd, "peers", settings(2, 2)).await;
    let b = etcd_client(&etcd, "peers", settings(2, 2)).await;
    let (ra, rb) = within("joins", async { tokio::join!(a.join(node("a")), b.join(b_node.clone())) }).await;
    let (ra, _rb) = (ra.expect("a joins"), rb.expect("b joins"));
    let watch = ra.watch.clone().expect("the round gives a someone to watch");
    assert_eq!(watch.targets.iter().map(|t| t.node_id.as_str()).collect::<Vec<_>>(), ["bb"]);
    assert_eq!(watch.targets[0].addr, b_node.store_addr, "b's endpoint (no probe endpoint: its store)");
    let b_beats = beat(&b, "bb");
    let gone =
        || Beat { peers: vec![PeerReport { node_id: "bb".into(), silent_ms: 50, gone: true }], ..Default::default() };
    // A report that b's agent is gone while it answers (a watcher that lies or is mistaken):
    // the service reaches b itself and drops the report; so is a silence its heartbeats refute.
    for _ in 0..5 {
        a.heartbeat("a", gone()).await.expect("a's heartbeat");
        let silent = vec![PeerReport { node_id: "bb".into(), silent_ms: 3000, gone: false }];
        a.heartbeat("a", Beat { peers: silent, ..Default::default() }).await.expect("a's heartbeat");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let st = a.status().await.expect("status");
    assert_eq!((st.round, st.members.len()), (ra.round, 2), "nobody lost: {}", st.last_reason);
    // b's agent dies: no heartbeats, nothing listens at its address. a reports it at once.
    b_beats.abort();
    drop(b_store);
    let died = Instant::now();
    a.heartbeat("a", gone()).await.expect("a's heartbeat");
    let ev = next_event(&a, ra.round).await;
    assert!(matches!(ev, WatchEvent::NewRound(r) if r > ra.round), "{ev:?}");
    let took = died.elapsed();
    let st = a.status().await.expect("status");
    assert!(st.last_reason.contains("its watchers: a: its agent gone"), "{}", st.last_reason);
    // The lease (TTL 2 s) had not lapsed: the watcher's report decided.
    assert!(took < Duration::from_secs(2), "the round ended {took:?} after b died");
}

/// A TCP proxy to etcd that can freeze every connection it has accepted so far (bytes stop
/// flowing both ways, the sockets stay open: a connection in long TCP back-off on a lossy link)
/// while it forwards connections made afterwards.
struct FreezingProxy {
    addr: std::net::SocketAddr,
    /// Connections numbered below this are frozen.
    frozen_below: std::sync::Arc<std::sync::atomic::AtomicU64>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: JoinHandle<()>,
}

impl FreezingProxy {
    async fn start(upstream: &str) -> FreezingProxy {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        let upstream = upstream.trim_start_matches("http://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("proxy listens");
        let addr = listener.local_addr().expect("proxy address");
        let (frozen_below, accepted) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let task = tokio::spawn({
            let (frozen_below, accepted) = (frozen_below.clone(), accepted.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let n = accepted.fetch_add(1, Ordering::SeqCst);
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else { continue };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    for (mut from, mut to) in [(cr, sw), (sr, cw)] {
                        let frozen_below = frozen_below.clone();
                        tokio::spawn(async move {
                            use tokio::io::{AsyncReadExt, AsyncWriteExt};
                            let mut buf = vec![0u8; 64 * 1024];
                            loop {
                                let Ok(got) = from.read(&mut buf).await else { return };
                                if got == 0 {
                                    return;
                                }
                                if n < frozen_below.load(Ordering::SeqCst) {
                                    // Frozen: nothing more gets through, nothing is closed.
                                    std::future::pending::<()>().await;
                                }
                                if to.write_all(&buf[..got]).await.is_err() {
                                    return;
                                }
                            }
                        });
                    }
                }
            }
        });
        FreezingProxy { addr, frozen_below, accepted, task }
    }

    /// Freezes every connection accepted so far.
    fn freeze(&self) {
        use std::sync::atomic::Ordering;
        self.frozen_below.store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Issue 35: under a lossy link to etcd, the connection that carries a replica's lease keep-alive
/// stalls in TCP back-off, and every heartbeat answered "lease not confirmed" for the fencing time
/// made an etcd-direct agent fence its own node (seen once under 15 % loss). Now an unconfirmed
/// lease is confirmed on fresh connections: with every connection the store had frozen (until its
/// HTTP/2 keep-alive replaces them), each heartbeat is answered, and the node's alive key is
/// still in etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_keep_alive_connection_stalls_is_confirmed_on_a_fresh_one_and_no_heartbeat_fails() {
    let etcd = Etcd::start().await;
    let proxy = FreezingProxy::start(&etcd.endpoint).await;
    let endpoint = format!("http://{}", proxy.addr);
    let s = settings(1, 1);
    let a = RendezvousClient::connect(
        Backend::Etcd { endpoints: vec![endpoint.parse().expect("an endpoint")] },
        "stall",
        s.clone(),
    )
    .await
    .expect("client connects to etcd through the proxy");
    let ra = within("join", a.join(node("a"))).await.expect("a joins");
    assert_eq!(ra.round, 1);
    for _ in 0..3 {
        a.heartbeat("a", Default::default()).await.expect("a heartbeat before the stall");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    proxy.freeze();
    let frozen_at = Instant::now();
    let connections = || proxy.accepted.load(std::sync::atomic::Ordering::SeqCst);
    let before = connections();
    // The store's own HTTP/2 keep-alive (1 s, answered within 2 s) replaces a frozen connection
    // after about 3 s: connections made before that are the confirmations'.
    let mut early = None;
    let mut failed = Vec::new();
    while frozen_at.elapsed() < s.node_ttl * 2 + Duration::from_secs(1) {
        let sent = frozen_at.elapsed();
        if let Err(e) = within("a heartbeat", a.heartbeat("a", Default::default())).await {
            failed.push(format!("{sent:?}: {e}"));
        }
        if early.is_none() && frozen_at.elapsed() > Duration::from_millis(2500) {
            early = Some(connections() - before);
        }
        tokio::time::sleep(s.heartbeat_interval).await;
    }
    assert!(failed.is_empty(), "heartbeats failed while the store's connections were stalled:\n{}", failed.join("\n"));
    assert!(early.is_some_and(|n| n > 0), "the lease was confirmed on fresh connections (none made: {early:?})");
    let mut c = etcd_client::Client::connect([etcd.endpoint.as_str()], None).await.expect("etcd client");
    let alive = c
        .get("/rlaunch/jobs/stall/alive/", Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .expect("read alive keys");
    assert_eq!(alive.kvs().len(), 1, "a's alive key is still there (its lease was renewed)");
}

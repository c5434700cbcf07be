//! Soak: `--jobs` jobs at a time (default 200) forming, failing, losing nodes, losing members
//! that leave, and finishing, for `--minutes` (default 10) against an `rlaunch-rendezvous`
//! service in a process of its own (memory store, or etcd with `--etcd URL`). Every job's final
//! state is checked against what its script did; the service's memory, the jobs it holds and
//! (etcd) the keys under `/rlaunch/` are sampled every second, through the load and after it until
//! finished jobs are forgotten (the service runs with `--terminal-retention-s 5`).
//!
//! `cargo build --release -p rlaunch-launcher --bins && cargo build --release -p rlaunch-rendezvous --examples &&
//!  target/release/examples/rdzv_soak --minutes 10 [--etcd URL] [--csv FILE]`
//! (`bench/rendezvous/soak_plot.py` draws the CSVs.)

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlaunch::contract::RootCause;
use rlaunch_rendezvous::round::{JobSettings, NodeInfo};
use rlaunch_rendezvous::{Backend, RendezvousClient, WatchEvent};
use tokio::task::JoinHandle;

const RETENTION_S: u64 = 5;

fn settings(min: u32, max: u32, max_restarts: u32) -> JobSettings {
    JobSettings {
        min_nodes: min,
        max_nodes: max,
        join_timeout: Duration::from_secs(60),
        last_call_timeout: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(500),
        node_ttl: Duration::from_secs(2),
        probe_timeout: Duration::from_secs(1),
        peer_interval: Duration::from_millis(100),
        stall_bound: Duration::from_millis(500),
        max_restarts,
        stop_grace: Duration::ZERO,
        hang_timeout: None,
        fingerprint: None,
    }
}

fn service_binary() -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe.parent().and_then(|d| d.parent()).context("example path")?.join("rlaunch-rendezvous");
    if !bin.exists() {
        bail!("{} is missing: cargo build --release -p rlaunch-launcher --bins", bin.display());
    }
    Ok(bin)
}

struct Service {
    child: Child,
    endpoint: String,
}

impl Service {
    fn start(etcd: Option<&str>) -> Result<Service> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let endpoint = format!("127.0.0.1:{port}");
        let mut cmd = Command::new(service_binary()?);
        cmd.args(["--listen", &endpoint, "--terminal-retention-s", &RETENTION_S.to_string()]);
        if let Some(url) = etcd {
            cmd.args(["--store", "etcd", "--etcd-endpoints", url]);
        }
        let log = std::fs::File::create(std::env::temp_dir().join("rdzv_soak_service.log"))?;
        let child = cmd.env("RUST_LOG", "error").stderr(Stdio::from(log)).spawn().context("start the service")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&endpoint).is_err() {
            if Instant::now() > deadline {
                bail!("the service did not listen on {endpoint}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Service { child, endpoint })
    }

    fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(0.0, |kib| kib / 1024.0)
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a job's script does, and the final state that must follow.
#[derive(Clone, Copy, Debug)]
enum Script {
    /// Two nodes train, then both succeed: finished, round 1.
    Finish,
    /// Two nodes; a worker fails in round 1 (restart) and again in round 2 (budget of 1
    /// spent): failed.
    Fail,
    /// Three nodes; one goes silent (its agent died): the two others form round 2 and finish.
    Lose,
    /// Three nodes; one leaves: the two others form round 2 and finish.
    Leave,
}

const SCRIPTS: [Script; 4] = [Script::Finish, Script::Fail, Script::Lose, Script::Leave];

fn node(job: &str, i: u32) -> NodeInfo {
    NodeInfo {
        node_id: format!("{job}-n{i}"),
        local_world_size: 8,
        store_addr: format!("10.1.{}.{}:29500", i / 250, i % 250 + 1).parse().expect("a valid address"),
        probe_addr: None,
        snapshot_addr: None,
        snapshot_key: None,
        snapshots: Vec::new(),
        fingerprint: None,
    }
}

fn beat(c: &RendezvousClient, id: &str) -> JoinHandle<()> {
    let (c, id) = (c.clone(), id.to_owned());
    tokio::spawn(async move {
        loop {
            let _ = c.heartbeat(&id, Default::default()).await;
            tokio::time::sleep(c.settings().heartbeat_interval).await;
        }
    })
}

async fn join_all(c: &RendezvousClient, nodes: &[NodeInfo]) -> Result<u64> {
    let joins: Vec<_> = nodes
        .iter()
        .map(|n| {
            let (c, n) = (c.clone(), n.clone());
            async move { c.join(n).await }
        })
        .collect();
    let infos = futures_join_all(joins).await;
    let mut round = None;
    for info in infos {
        let info = info.context("join")?;
        if round.is_some_and(|r| r != info.round) {
            bail!("nodes were given different rounds");
        }
        round = Some(info.round);
    }
    round.context("no node")
}

/// `join_all` without a futures dependency: each future on its own task.
async fn futures_join_all<T: Send + 'static>(
    futs: Vec<impl std::future::Future<Output = T> + Send + 'static>,
) -> Vec<T> {
    let tasks: Vec<JoinHandle<T>> = futs.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("join task"));
    }
    out
}

async fn wait_new_round(c: &RendezvousClient, id: &str, round: u64) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.watch(Some(id), round).await.context("watch")? {
            WatchEvent::NewRound(r) => return Ok(r),
            WatchEvent::NoChange if Instant::now() < deadline => {}
            other => bail!("expected a new round after {round}, got {other:?}"),
        }
    }
}

/// Runs one job by its script; Ok when its final state is the one the script must lead to.
async fn one_job(endpoint: &str, run_id: &str, script: Script, train: Duration) -> Result<()> {
    let backend = Backend::Http { endpoints: vec![endpoint.parse().expect("an endpoint")], token: None };
    let (n, min, restarts) = match script {
        Script::Finish => (2, 2, 0),
        Script::Fail => (2, 2, 1),
        Script::Lose | Script::Leave => (3, 2, 0),
    };
    let c = RendezvousClient::connect(backend, run_id, settings(min, n, restarts)).await.context("client")?;
    let nodes: Vec<NodeInfo> = (0..n).map(|i| node(run_id, i)).collect();
    let r1 = join_all(&c, &nodes).await?;
    let mut beats: Vec<JoinHandle<()>> = nodes.iter().map(|n| beat(&c, &n.node_id)).collect();
    tokio::time::sleep(train).await;
    let outcome = async {
        let (want_state, want_round) = match script {
            Script::Finish => {
                for nd in &nodes {
                    c.report_success(&nd.node_id, r1).await.context("success")?;
                }
                ("finished", r1)
            }
            Script::Fail => {
                let rc = |m: &str| Box::new(RootCause::from_message(m.to_owned()));
                c.report_failure(&nodes[0].node_id, r1, rc("exit code 1")).await.context("failure")?;
                wait_new_round(&c, &nodes[1].node_id, r1).await?;
                let r2 = join_all(&c, &nodes).await?;
                c.report_failure(&nodes[1].node_id, r2, rc("exit code 2")).await.context("failure")?;
                ("failed", r2)
            }
            Script::Lose | Script::Leave => {
                if matches!(script, Script::Lose) {
                    beats.pop().expect("three beats").abort();
                } else {
                    beats.pop().expect("three beats").abort();
                    c.leave(&nodes[2].node_id).await.context("leave")?;
                }
                wait_new_round(&c, &nodes[0].node_id, r1).await?;
                let r2 = join_all(&c, &nodes[..2]).await?;
                for nd in &nodes[..2] {
                    c.report_success(&nd.node_id, r2).await.context("success")?;
                }
                ("finished", r2)
            }
        };
        let st = c.status().await.context("status")?;
        if st.state != want_state || st.round != want_round {
            bail!(
                "{script:?}: ended {} in round {} (want {want_state} in round {want_round}): {}",
                st.state,
                st.round,
                st.last_reason
            );
        }
        if matches!(script, Script::Lose | Script::Leave) && st.members.len() != 2 {
            bail!("{script:?}: {} members in the last round", st.members.len());
        }
        Ok(())
    }
    .await;
    for b in beats {
        b.abort();
    }
    outcome
}

#[derive(Default)]
struct Tally {
    jobs: AtomicU64,
    right: AtomicU64,
    wrong: AtomicU64,
}

/// Keys under `/rlaunch/` in etcd.
async fn etcd_keys(client: &mut Option<etcd_client::Client>) -> Option<i64> {
    let c = client.as_mut()?;
    let opts = etcd_client::GetOptions::new().with_prefix().with_count_only();
    c.get("/rlaunch/", Some(opts)).await.ok().map(|r| r.count())
}

/// Jobs the service holds, from `/metrics`.
async fn service_jobs(http: &reqwest::Client, endpoint: &str) -> Option<u64> {
    let text = http.get(format!("http://{endpoint}/metrics")).send().await.ok()?.text().await.ok()?;
    Some(
        text.lines()
            .filter(|l| l.starts_with("rlaunch_rdzv_jobs{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum(),
    )
}

#[tokio::main]
async fn main() -> Result<()> {
    let (mut minutes, mut jobs, mut etcd, mut csv) = (10.0f64, 200usize, None::<String>, None::<String>);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--minutes" => minutes = value()?.parse()?,
            "--jobs" => jobs = value()?.parse()?,
            "--etcd" => etcd = Some(value()?),
            "--csv" => csv = Some(value()?),
            other => bail!("unknown argument {other}"),
        }
    }
    rlaunch::store::raise_open_files().context("raising the open-file limit")?;
    let store = if etcd.is_some() { "etcd" } else { "memory" };
    let service = Arc::new(Service::start(etcd.as_deref())?);
    let mut etcd_client = match &etcd {
        Some(url) => Some(etcd_client::Client::connect([url.as_str()], None).await.context("etcd")?),
        None => None,
    };
    let http = reqwest::Client::new();
    let started = Instant::now();
    let load_for = Duration::from_secs_f64(minutes * 60.0);
    let tally = Arc::new(Tally::default());
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis();
    let slots: Vec<JoinHandle<()>> = (0..jobs)
        .map(|slot| {
            let (endpoint, tally) = (service.endpoint.clone(), tally.clone());
            tokio::spawn(async move {
                let mut iter = 0usize;
                // Slots start spread over the first 5 s.
                tokio::time::sleep(Duration::from_millis((slot as u64 * 5000) / jobs.max(1) as u64)).await;
                while started.elapsed() < load_for {
                    let script = SCRIPTS[(slot + iter) % SCRIPTS.len()];
                    let run_id = format!("soak-{stamp}-{slot}-{iter}");
                    let train = Duration::from_millis(500 + ((slot * 7919 + iter * 104_729) % 3000) as u64);
                    tally.jobs.fetch_add(1, Ordering::Relaxed);
                    match tokio::time::timeout(Duration::from_secs(120), one_job(&endpoint, &run_id, script, train))
                        .await
                    {
                        Ok(Ok(())) => {
                            tally.right.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(Err(e)) => {
                            tally.wrong.fetch_add(1, Ordering::Relaxed);
                            eprintln!("{run_id}: {e:#}");
                        }
                        Err(_) => {
                            tally.wrong.fetch_add(1, Ordering::Relaxed);
                            eprintln!("{run_id}: {script:?} did not end within 120 s");
                        }
                    }
                    iter += 1;
                }
            })
        })
        .collect();
    let mut rows =
        vec!["store,t_s,phase,service_rss_mib,service_jobs,etcd_keys,jobs_run,jobs_right,jobs_wrong".to_owned()];
    let baseline = (service.rss_mib(), etcd_keys(&mut etcd_client).await);
    let mut drained_at: Option<Instant> = None;
    loop {
        let phase = if slots.iter().all(JoinHandle::is_finished) {
            drained_at.get_or_insert_with(Instant::now);
            "drain"
        } else {
            "load"
        };
        let (rss, held, keys) =
            (service.rss_mib(), service_jobs(&http, &service.endpoint).await, etcd_keys(&mut etcd_client).await);
        rows.push(format!(
            "{store},{:.1},{phase},{rss:.1},{},{},{},{},{}",
            started.elapsed().as_secs_f64(),
            held.map_or(String::new(), |v| v.to_string()),
            keys.map_or(String::new(), |v| v.to_string()),
            tally.jobs.load(Ordering::Relaxed),
            tally.right.load(Ordering::Relaxed),
            tally.wrong.load(Ordering::Relaxed),
        ));
        // Past the retention (and a few ticks) after the last job ended, everything is forgotten;
        // the service gives freed memory back every 30 s.
        if drained_at.is_some_and(|t| t.elapsed() > Duration::from_secs(RETENTION_S + 40)) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let end = (service.rss_mib(), service_jobs(&http, &service.endpoint).await, etcd_keys(&mut etcd_client).await);
    let peak = rows.iter().skip(1).filter_map(|r| r.split(',').nth(3)?.parse::<f64>().ok()).fold(0.0f64, f64::max);
    if let Some(path) = &csv {
        std::fs::write(path, rows.join("\n") + "\n").with_context(|| format!("writing {path}"))?;
    }
    println!("store\tminutes\tjobs_at_once\tjobs_run\tright\twrong\trss_start_mib\trss_peak_mib\trss_end_mib\tjobs_held_end\tetcd_keys_start\tetcd_keys_end");
    println!(
        "{store}\t{minutes}\t{jobs}\t{}\t{}\t{}\t{:.1}\t{peak:.1}\t{:.1}\t{}\t{}\t{}",
        tally.jobs.load(Ordering::Relaxed),
        tally.right.load(Ordering::Relaxed),
        tally.wrong.load(Ordering::Relaxed),
        baseline.0,
        end.0,
        end.1.map_or("?".to_owned(), |v| v.to_string()),
        baseline.1.map_or("-".to_owned(), |v| v.to_string()),
        end.2.map_or("-".to_owned(), |v| v.to_string()),
    );
    if tally.wrong.load(Ordering::Relaxed) > 0 || end.1 != Some(0) || end.2.is_some_and(|k| k != 0) {
        bail!("the soak ended with wrong jobs or state left behind");
    }
    Ok(())
}

//! Benchmark: time from the last join to every agent holding the closed round, for N simulated
//! agents talking HTTP to one `rlaunch-rendezvous` service (memory store, and etcd when
//! `--etcd http://host:2379` is given).
//!
//! `cargo run --release -p rlaunch-rendezvous --example rdzv_bench -- --agents 10,100,1000 [--etcd URL]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlaunch_rendezvous::api::{self, AppState};
use rlaunch_rendezvous::round::{JobSettings, NodeInfo};
use rlaunch_rendezvous::store::etcd::EtcdStore;
use rlaunch_rendezvous::{Backend, Rendezvous, RendezvousClient, Store};

fn settings(n: u32) -> JobSettings {
    JobSettings {
        min_nodes: n,
        max_nodes: n,
        join_timeout: Duration::from_secs(300),
        last_call_timeout: Duration::from_secs(1),
        heartbeat_interval: Duration::from_millis(500),
        node_ttl: Duration::from_secs(30),
        probe_timeout: Duration::from_secs(1),
        max_restarts: 0,
        stop_grace: Duration::ZERO,
    }
}

async fn one(rdzv: Arc<Rendezvous>, n: u32, run_id: &str) -> Result<Duration> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = listener.local_addr()?.to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(api::serve(listener, AppState::new(rdzv.clone(), None), async move {
        let _ = stopped.await;
    }));
    let client =
        RendezvousClient::connect(Backend::Http { endpoints: vec![endpoint], token: None }, run_id, settings(n))
            .await
            .context("client")?;
    let node = |i: u32| NodeInfo {
        node_id: format!("agent-{i:05}"),
        local_world_size: 8,
        store_addr: format!("10.0.0.1:{}", 20000 + i).parse().expect("a valid address"),
        probe_addr: None,
    };
    let mut joins: Vec<tokio::task::JoinHandle<Result<_, rlaunch_rendezvous::RdzvError>>> = Vec::new();
    for i in 0..n - 1 {
        let c = client.clone();
        joins.push(tokio::spawn(async move { c.join(node(i)).await }));
    }
    // Wait until the first n-1 are all pending.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(st) = rdzv.status(run_id).await {
            if st.pending.len() as u32 == n - 1 {
                break;
            }
        }
        if Instant::now() > deadline {
            let pending = rdzv.status(run_id).await.map(|s| s.pending.len()).unwrap_or(0);
            let mut failed = Vec::new();
            for j in joins.iter_mut().filter(|j| j.is_finished()) {
                if let Ok(Err(e)) = j.await {
                    failed.push(format!("{e:#}"));
                }
            }
            eprintln!("first errors: {:?}", &failed[..failed.len().min(3)]);
            bail!(
                "the first {} agents did not all join in time ({pending} pending, {} join tasks ended)",
                n - 1,
                failed.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t0 = Instant::now();
    let last = client.join(node(n - 1)).await.context("last join")?;
    for j in joins {
        let info = j.await.context("join task")?.context("join")?;
        assert_eq!(info.round, last.round);
    }
    let took = t0.elapsed();
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    Ok(took)
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut agents = vec![10u32, 100, 1000];
    let mut etcd: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--agents" => {
                agents = args.next().context("--agents N,N")?.split(',').map(str::parse).collect::<Result<_, _>>()?
            }
            "--etcd" => etcd = Some(args.next().context("--etcd URL")?),
            other => bail!("unknown argument {other}"),
        }
    }
    println!("store\tagents\tlast_join_to_all_closed_ms");
    for &n in &agents {
        let took = one(Rendezvous::in_memory(), n, &format!("bench-mem-{n}")).await?;
        println!("memory\t{n}\t{:.1}", took.as_secs_f64() * 1e3);
    }
    if let Some(url) = etcd {
        let store = EtcdStore::connect(&[url]).await?;
        let rdzv = Rendezvous::new(Store::Etcd(store));
        let stamp = rlaunch_rendezvous::service::now_ms();
        for &n in &agents {
            let took = one(rdzv.clone(), n, &format!("bench-etcd-{n}-{stamp}")).await?;
            println!("etcd\t{n}\t{:.1}", took.as_secs_f64() * 1e3);
        }
    }
    Ok(())
}

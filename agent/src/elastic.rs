//! The elastic edges of the agent: where the rendezvous runs (a server, etcd, or one this agent
//! hosts), this node's identity and address, and heartbeats on a task of their own. The
//! decisions are the core's (`core.rs`); the loop is the driver's (`driver.rs`).

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use rlaunch::contract::{HostPort, NodeInfo};
use rlaunch_rendezvous::api::{serve as serve_api, AppState};
use rlaunch_rendezvous::{Backend, Rendezvous, RendezvousClient};

use crate::core::Event;
use crate::driver::call_error;
use crate::{AgentConfig, AgentError, DynamicBackend, DynamicRendezvous};

/// Aborts a background task when dropped (heartbeats, an agent-hosted server).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A connected elastic node: its client, identity and background tasks.
pub(crate) struct ElasticSetup {
    pub client: RendezvousClient,
    /// This node as it joins; the store address changes with every round.
    pub node: NodeInfo,
    /// The address other nodes reach this one at.
    pub advertise: String,
    heartbeat_interval: Duration,
    _heartbeats: AbortOnDrop,
    hosted: Option<AbortOnDrop>,
}

impl ElasticSetup {
    /// Ends the background work. An agent hosting the rendezvous lingers a little first: the
    /// others learn that the job ended from this process, so their long-polls get time to see it.
    pub async fn finish(self) {
        if self.hosted.is_some() {
            tokio::time::sleep(self.heartbeat_interval * 2 + Duration::from_secs(1)).await;
        }
    }
}

/// Finds (or hosts) the rendezvous, picks this node's id and address, and starts heartbeats
/// that report to the core through `events`.
pub(crate) async fn setup(
    config: &AgentConfig,
    d: &DynamicRendezvous,
    host: &str,
    events: UnboundedSender<Event>,
) -> Result<ElasticSetup, AgentError> {
    // `[v6]` as given on the command line is the bare address inside.
    let advertise = advertise_addr(config, d).trim_start_matches('[').trim_end_matches(']').to_owned();
    let (backend, hosted) = backend(d).await?;
    let client = RendezvousClient::connect(backend, &config.run_id, d.settings.clone()).await.map_err(|e| {
        AgentError::Rendezvous { message: "cannot connect to the rendezvous".into(), source: Some(Box::new(e)) }
    })?;
    let node = NodeInfo {
        node_id: format!("{host}-{}-{:08x}", std::process::id(), rand_u32()),
        local_world_size: config.nproc_per_node,
        // Replaced by the first round's store before the first join.
        store_addr: HostPort::new(advertise.clone(), 0).map_err(|e| AgentError::Store {
            addr: advertise.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        })?,
    };
    info!(node_id = %node.node_id, endpoints = ?d.endpoints, min = d.settings.min_nodes, max = d.settings.max_nodes, "elastic rendezvous");
    let heartbeats = AbortOnDrop(tokio::spawn(heartbeat_loop(
        client.clone(),
        node.node_id.clone(),
        d.settings.heartbeat_interval,
        events,
    )));
    Ok(ElasticSetup {
        client,
        node,
        advertise,
        heartbeat_interval: d.settings.heartbeat_interval,
        _heartbeats: heartbeats,
        hosted,
    })
}

async fn heartbeat_loop(client: RendezvousClient, node_id: String, every: Duration, events: UnboundedSender<Event>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = client.heartbeat(&node_id).await;
        if let Err(e) = &result {
            tracing::debug!(error = %e, "heartbeat failed");
        }
        if events.send(Event::Heartbeat(result.map_err(|e| call_error(&e)))).is_err() {
            return;
        }
    }
}

/// Where the rendezvous runs. For `--rdzv-backend rlaunch`, if no server answers and the first
/// endpoint is an address of this host, this agent hosts one (as torchrun's c10d does).
async fn backend(d: &DynamicRendezvous) -> Result<(Backend, Option<AbortOnDrop>), AgentError> {
    if d.backend == DynamicBackend::Etcd {
        return Ok((Backend::Etcd { endpoints: d.endpoints.clone() }, None));
    }
    let http = Backend::Http { endpoints: d.endpoints.clone(), token: d.token.clone() };
    let first = strip_scheme(&d.endpoints[0]).to_string();
    // The server may come up after this agent (the hosting agent starting later, a service
    // restarting): wait for it as long as a join may wait, as torchrun's agents do.
    let deadline = tokio::time::Instant::now() + d.settings.join_timeout;
    let mut announced = false;
    loop {
        for e in &d.endpoints {
            if answers(e).await {
                return Ok((http, None));
            }
        }
        let addr = tokio::net::lookup_host(first.as_str()).await.ok().and_then(|mut a| a.next());
        if let Some(addr) = addr {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => {
                    info!(%addr, "no rendezvous server answered; this agent hosts one (memory store)");
                    let rdzv = Rendezvous::in_memory();
                    let state = AppState::new(rdzv.clone(), d.token.clone());
                    let task = tokio::spawn(async move {
                        if let Err(e) = serve_api(listener, state, std::future::pending()).await {
                            warn!(error = %e, "agent-hosted rendezvous server stopped");
                        }
                    });
                    return Ok((Backend::InProcess(rdzv), Some(AbortOnDrop(task))));
                }
                // Another agent of this host won the race to host it, or the address belongs to
                // another host: wait for that server to answer.
                Err(e) => {
                    if !announced {
                        info!(endpoint = %first, reason = %e, "waiting for the rendezvous server to answer");
                        announced = true;
                    }
                }
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(AgentError::Rendezvous {
                message: format!(
                    "no rendezvous server answered at {} within the join timeout ({:?}), and it is not an address of this host to serve one on",
                    d.endpoints.join(","),
                    d.settings.join_timeout
                ),
                source: None,
            });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn answers(endpoint: &str) -> bool {
    let e = strip_scheme(endpoint).to_string();
    matches!(tokio::time::timeout(Duration::from_millis(700), tokio::net::TcpStream::connect(e)).await, Ok(Ok(_)))
}

fn strip_scheme(e: &str) -> &str {
    e.strip_prefix("http://").unwrap_or(e)
}

/// The address other nodes reach this one at: `--local-addr`, else the source address this host
/// uses towards the first rendezvous endpoint (never loopback unless the endpoint is).
fn advertise_addr(config: &AgentConfig, d: &DynamicRendezvous) -> String {
    if let Some(a) = &config.local_addr {
        return a.clone();
    }
    let target: Option<SocketAddr> = strip_scheme(&d.endpoints[0]).to_socket_addrs().ok().and_then(|mut a| a.next());
    if let Some(t) = target {
        let bind = if t.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        if let Ok(sock) = UdpSocket::bind(bind) {
            // connect() on UDP sends nothing; it only picks the route and source address.
            if sock.connect(t).is_ok() {
                if let Ok(local) = sock.local_addr() {
                    return local.ip().to_string();
                }
            }
        }
    }
    "127.0.0.1".into()
}

pub(crate) fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b)).is_err() {
        return std::process::id() ^ 0x9e37_79b9;
    }
    u32::from_le_bytes(b)
}

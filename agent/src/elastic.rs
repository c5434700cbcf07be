//! The elastic edges of the agent: where the rendezvous runs (a server, etcd, or one this agent
//! hosts), this node's identity and address, and heartbeats on a task of their own. The
//! decisions are the core's (`core.rs`); the loop is the driver's (`driver.rs`).

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use std::collections::{HashMap, HashSet};

use tokio::sync::mpsc::UnboundedSender;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{info, warn};

use rlaunch::contract::{HostPort, NodeInfo};
use rlaunch_rendezvous::api::{serve as serve_api, AppState};
use rlaunch_rendezvous::detector::{ProbeReport, ProbeRequest, Sent};
use rlaunch_rendezvous::{Backend, Beat, HeartbeatAnswer, RdzvError, Rendezvous, RendezvousClient};

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
    /// The probe endpoint (TCP and UDP), served while this node takes part.
    _probe: (rlaunch::store::StoreHandle, Option<AbortOnDrop>),
    hosted: Option<AbortOnDrop>,
    /// Each local rank's wait in all-reduces, as the supervisor last read it; every heartbeat
    /// carries it (stragglers).
    pub steps: StepsShared,
}

/// What the supervisor shares with the heartbeat task.
pub(crate) type StepsShared = std::sync::Arc<std::sync::Mutex<Vec<rlaunch_rendezvous::stragglers::RankWait>>>;

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
    let tls = rlaunch_rendezvous::ClientTls { ca_file: d.tls_ca.clone() };
    let client =
        RendezvousClient::connect_with(backend, &config.run_id, d.settings.clone(), &tls).await.map_err(|e| {
            AgentError::Rendezvous { message: "cannot connect to the rendezvous".into(), source: Some(Box::new(e)) }
        })?;
    // Other members probe this agent here while it lives (the round's store comes and goes):
    // a store of its own that holds nothing and only answers pings.
    let probe = crate::start_store(&crate::driver::store_bind(config, &advertise), PROBE_STORE_BYTES).await?;
    let probe_addr = HostPort::new(advertise.clone(), probe.local_addr().port()).ok();
    // And a UDP echo on the same port, which loss delays far less than a TCP handshake.
    let udp = match tokio::net::UdpSocket::bind(probe.local_addr()).await {
        Ok(socket) => Some(AbortOnDrop(tokio::spawn(rlaunch::store::serve_udp_probes(socket)))),
        Err(e) => {
            warn!(error = %e, port = probe.local_addr().port(), "no UDP probe endpoint (probes use TCP only)");
            None
        }
    };
    let node = NodeInfo {
        node_id: format!("{host}-{}-{:08x}", std::process::id(), crate::random::rand_u32()),
        local_world_size: config.nproc_per_node,
        // Replaced by the first round's store before the first join.
        store_addr: HostPort::new(advertise.clone(), 0).map_err(|e| AgentError::Store {
            addr: advertise.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        })?,
        probe_addr,
        fingerprint: Some(crate::fingerprint::collect(&config.program).await),
    };
    if let Some(fp) = &node.fingerprint {
        let short: Vec<String> = ["python", "torch", "cuda", "nccl", "gpu", "driver"]
            .iter()
            .filter_map(|k| fp.0.get(*k).map(|v| format!("{k} {v}")))
            .collect();
        info!(
            entries = fp.0.len(),
            "fingerprint: {}",
            if short.is_empty() { "no Python or GPU".to_owned() } else { short.join(", ") }
        );
    }
    info!(node_id = %node.node_id, endpoints = ?d.endpoints, min = d.settings.min_nodes, max = d.settings.max_nodes, "elastic rendezvous");
    // A prober learns of a suspicion from its next heartbeat's answer (up to an interval after
    // it began), and its outcome must reach the rendezvous before the probe timeout.
    let probe_within = d
        .settings
        .probe_timeout
        .saturating_sub(d.settings.heartbeat_interval)
        .mul_f64(0.8)
        .max(Duration::from_millis(200));
    let steps = StepsShared::default();
    let heartbeats = AbortOnDrop(tokio::spawn(heartbeat_loop(
        client.clone(),
        node.node_id.clone(),
        d.settings.heartbeat_interval,
        probe_within,
        events,
        steps.clone(),
    )));
    Ok(ElasticSetup {
        client,
        node,
        advertise,
        heartbeat_interval: d.settings.heartbeat_interval,
        _heartbeats: heartbeats,
        _probe: (probe, udp),
        hosted,
        steps,
    })
}

/// The probe endpoint's store holds nothing: a set beyond this closes the connection.
const PROBE_STORE_BYTES: usize = 1024;
/// Most probes under way at once: a mass suspicion must not exhaust this agent's descriptors.
const MAX_PROBES: usize = 16;
/// Most heartbeats in flight at once: a heartbeat held up by a retransmission does not hold up
/// the next (each takes its own kept-alive connection), yet a rendezvous that answers nothing
/// is not sent an unbounded pile.
const MAX_IN_FLIGHT: usize = 6;
/// TCP probe attempts per probed node, started this far apart (a lost SYN costs a second; a
/// second attempt on another connection does not wait for it), beside UDP datagrams sent every
/// `PROBE_UDP_EVERY`.
const PROBE_ATTEMPTS: u32 = 3;
const PROBE_STAGGER: Duration = Duration::from_millis(150);
const PROBE_UDP_EVERY: Duration = Duration::from_millis(40);

/// A heartbeat answered this much over the fastest recent round trip was held up by a
/// retransmission (Linux waits at least 200 ms before resending a lost segment).
const SLOW_MARGIN: Duration = Duration::from_millis(150);
/// Round trips remembered to find the fastest.
const RTT_WINDOW: usize = 64;

enum Done {
    /// A heartbeat's answer and round trip, with the probe outcomes it carried (kept for the
    /// next one when this one did not get through).
    Beat(Result<HeartbeatAnswer, RdzvError>, Duration, Vec<ProbeReport>),
    Probe(ProbeReport),
}

/// Which heartbeat answers were late: the node's own view of its link, sent along so the
/// rendezvous can show each node's loss (over TCP a lost packet is a late answer, not a gap).
#[derive(Default)]
struct RoundTrips {
    recent: std::collections::VecDeque<Duration>,
    slow: u64,
}

impl RoundTrips {
    fn answered(&mut self, rtt: Duration) {
        let fastest = self.recent.iter().min().copied();
        if fastest.is_some_and(|f| rtt > f + SLOW_MARGIN) {
            self.slow += 1;
        }
        if self.recent.len() == RTT_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(rtt);
    }
}

/// Sends a heartbeat every `every` without waiting for the previous answer, makes the probes
/// the rendezvous asks for (and sends their outcomes at once), and tells the core of each
/// answer. Every task it starts ends with it.
async fn heartbeat_loop(
    client: RendezvousClient,
    node_id: String,
    every: Duration,
    probe_within: Duration,
    events: UnboundedSender<Event>,
    steps: StepsShared,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks: JoinSet<Done> = JoinSet::new();
    // What each task is, so that one that panicked still frees its slot.
    let mut kinds: HashMap<tokio::task::Id, Option<String>> = HashMap::new();
    let (mut seq, mut nonce, mut in_flight) = (0u64, 0u32, 0usize);
    let mut rtts = RoundTrips::default();
    // The latest outcome per probed node, to go with the next heartbeat.
    let mut reports: HashMap<String, bool> = HashMap::new();
    let mut probing: HashSet<String> = HashSet::new();
    loop {
        let send_now = tokio::select! {
            _ = tick.tick() => true,
            Some(done) = tasks.join_next_with_id() => {
                let kind = kinds.remove(&match &done { Ok((id, _)) => *id, Err(e) => e.id() }).flatten();
                match done {
                    Ok((_, Done::Beat(result, rtt, carried))) => {
                        in_flight -= 1;
                        match &result {
                            Ok(answer) => {
                                rtts.answered(rtt);
                                for req in &answer.probe {
                                    if probing.len() < MAX_PROBES && probing.insert(req.node_id.clone()) {
                                        nonce = nonce.wrapping_add(PROBE_ATTEMPTS + 1);
                                        let task = tasks.spawn(probe_node(req.clone(), nonce, probe_within));
                                        kinds.insert(task.id(), Some(req.node_id.clone()));
                                    }
                                }
                            }
                            Err(e) => {
                                tracing::debug!(error = %e, "heartbeat failed");
                                if e.is_transient() {
                                    // Sent again, unless a newer outcome came meanwhile.
                                    for r in carried {
                                        reports.entry(r.node_id).or_insert(r.reached);
                                    }
                                }
                            }
                        }
                        if events.send(Event::Heartbeat(result.map(|_| ()).map_err(|e| call_error(&e)))).is_err() {
                            return;
                        }
                        false
                    }
                    Ok((_, Done::Probe(report))) => {
                        probing.remove(&report.node_id);
                        if !report.reached {
                            info!(node = %report.node_id, "probe: could not reach the suspected node");
                        }
                        reports.insert(report.node_id, report.reached);
                        true
                    }
                    Err(e) => {
                        warn!(error = %e, "a heartbeat or probe task failed");
                        match kind {
                            Some(node) => {
                                probing.remove(&node);
                            }
                            None => in_flight -= 1,
                        }
                        false
                    }
                }
            }
        };
        if send_now && in_flight < MAX_IN_FLIGHT {
            seq += 1;
            let probes = reports.drain().map(|(node_id, reached)| ProbeReport { node_id, reached }).collect();
            let steps = steps.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let beat = Beat { sent: Some(Sent { seq, slow: rtts.slow }), probes, steps };
            let (client, node_id) = (client.clone(), node_id.clone());
            in_flight += 1;
            let task = tasks.spawn(async move {
                let carried = beat.probes.clone();
                let started = tokio::time::Instant::now();
                let result = client.heartbeat(&node_id, beat).await;
                Done::Beat(result, started.elapsed(), carried)
            });
            kinds.insert(task.id(), None);
        }
    }
}

/// Reaches a suspected node's store directly: a few attempts, staggered, the first answer wins;
/// none within `within` is a miss.
async fn probe_node(req: ProbeRequest, nonce: u32, within: Duration) -> Done {
    let addr = req.addr.to_string();
    let mut attempts = JoinSet::new();
    {
        let addr = addr.clone();
        attempts.spawn(async move { rlaunch::store::probe_udp(&addr, nonce, PROBE_UDP_EVERY, within).await });
    }
    for i in 0..PROBE_ATTEMPTS {
        let (addr, delay) = (addr.clone(), PROBE_STAGGER * i);
        let Some(left) = within.checked_sub(delay) else { break };
        attempts.spawn(async move {
            tokio::time::sleep(delay).await;
            rlaunch::store::probe(&addr, nonce.wrapping_add(i + 1), left).await
        });
    }
    let mut reached = false;
    while let Some(r) = attempts.join_next().await {
        if matches!(r, Ok(Ok(_))) {
            reached = true;
            break;
        }
    }
    Done::Probe(ProbeReport { node_id: req.node_id, reached })
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
        // An agent-hosted server speaks plain HTTP: never in place of an https:// endpoint.
        if let Some(addr) = addr.filter(|_| !d.endpoints[0].starts_with("https://")) {
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
                        let why = if e.kind() == std::io::ErrorKind::AddrNotAvailable {
                            "another host's address: its agent hosts the server".to_owned()
                        } else {
                            format!("this host's address, but it cannot serve there: {e}")
                        };
                        info!(endpoint = %first, %why, "waiting for the rendezvous server to answer");
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
    e.strip_prefix("http://").or_else(|| e.strip_prefix("https://")).unwrap_or(e)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_well_over_the_fastest_round_trip_count_as_slow() {
        let mut r = RoundTrips::default();
        for ms in [3, 2, 4, 2, 210, 3, 2, 420, 150] {
            r.answered(Duration::from_millis(ms));
        }
        // 210 and 420 waited for a retransmission; 150 is within the margin of 2 ms + 150 ms.
        assert_eq!(r.slow, 2);
        let mut first = RoundTrips::default();
        first.answered(Duration::from_millis(900));
        assert_eq!(first.slow, 0, "nothing to compare the first answer with");
    }
}

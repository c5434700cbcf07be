//! The elastic edges of the agent: where the rendezvous runs (a server, etcd, or one this agent
//! hosts), this node's identity and address, and heartbeats on a task of their own. The
//! decisions are the core's (`core.rs`) and, for heartbeats and probes, `beats.rs`'s; the loop
//! is the driver's (`driver.rs`).

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use std::collections::HashMap;

use tokio::sync::mpsc::UnboundedSender;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{info, warn};

use rlaunch::contract::{Host, HostPort, NodeInfo, PeerWatch};
use rlaunch_rendezvous::api::{serve_with, AppState, ServeLimits};
use rlaunch_rendezvous::detector::{PeerReport, ProbeReport, ProbeRequest};
use rlaunch_rendezvous::{Backend, Beat, HeartbeatAnswer, RdzvError, Rendezvous, RendezvousClient};

use crate::beats::{self, Beats, PROBE_ATTEMPTS};
use crate::config::{AgentConfig, DynamicBackend, DynamicRendezvous};
use crate::core::{CallError, Cause, Event};
use crate::error::AgentError;
use crate::node::start_store;
use crate::peers::{self, Peers};

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
    pub advertise: Host,
    heartbeat_interval: Duration,
    _heartbeats: AbortOnDrop,
    /// The probe endpoint (TCP and UDP), served while this node takes part.
    _probe: (rlaunch::store::StoreHandle, Option<AbortOnDrop>),
    hosted: Option<AbortOnDrop>,
    /// Each local rank's wait in all-reduces, as the supervisor last read it; every heartbeat
    /// carries it (stragglers).
    pub steps: StepsShared,
    /// The members this node watches in the running round (`None` between rounds).
    pub watch: tokio::sync::watch::Sender<Option<PeerWatch>>,
    _peers: AbortOnDrop,
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
    snapshots: Option<&crate::snapstore::SnapStore>,
    events: UnboundedSender<Event>,
) -> Result<ElasticSetup, AgentError> {
    let advertise = advertise_addr(config, d);
    let (backend, hosted) = backend(d, config.job.join_timeout).await?;
    let tls = rlaunch_rendezvous::ClientTls { ca_file: d.tls_ca.clone() };
    let client = RendezvousClient::connect_with(backend, &config.run_id, config.job.clone(), &tls)
        .await
        .map_err(|e| AgentError::Rendezvous {
            message: "cannot connect to the rendezvous".into(),
            source: Some(std::sync::Arc::new(e)),
        })?
        // Snapshots need every member's ranks, address and parts.
        .asking_members(snapshots.is_some());
    // Other members probe this agent here while it lives (the round's store comes and goes):
    // a store of its own that holds nothing and only answers pings.
    let probe = start_store(&store_bind(config, &advertise), PROBE_STORE_BYTES).await?;
    let probe_addr = Some(advertise.with_port(probe.local_addr().port()));
    // And a UDP echo on the same port, which loss delays far less than a TCP handshake.
    let udp = match tokio::net::UdpSocket::bind(probe.local_addr()).await {
        Ok(socket) => Some(AbortOnDrop(tokio::spawn(rlaunch::store::serve_udp_probes(socket)))),
        Err(e) => {
            warn!(error = %e, port = probe.local_addr().port(), "no UDP probe endpoint (probes use TCP only)");
            None
        }
    };
    // The other members' agents reach this one here for snapshot copies and fetches.
    let snapshot_addr = match snapshots.map(|s| s.serve_peers(&store_bind(config, &advertise))) {
        Some(Ok(port)) => Some(advertise.with_port(port)),
        Some(Err(e)) => {
            warn!(error = %e, "cannot serve snapshots to other nodes: snapshots stay on this node");
            None
        }
        None => None,
    };
    let node = NodeInfo {
        snapshot_key: snapshot_addr.as_ref().and(snapshots).and_then(|s| s.public_key().ok()),
        snapshot_addr,
        snapshots: Vec::new(),
        node_id: format!("{host}-{}-{:08x}", std::process::id(), crate::random::rand_u32()),
        local_world_size: config.nproc_per_node,
        // Replaced by the first round's store before the first join.
        store_addr: advertise.with_port(0),
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
    let job = &config.job;
    // As written, quoted (`endpoints=["a:29400"]`): scripts and tests read it off the log.
    let written: Vec<String> = d.endpoints.iter().map(ToString::to_string).collect();
    info!(node_id = %node.node_id, endpoints = ?written, min = job.min_nodes, max = job.max_nodes, "elastic rendezvous");
    // A prober learns of a suspicion from its next heartbeat's answer (up to an interval after
    // it began), and its outcome must reach the rendezvous before the probe timeout.
    let probe_within =
        job.probe_timeout.saturating_sub(job.heartbeat_interval).mul_f64(0.8).max(Duration::from_millis(200));
    let steps = StepsShared::default();
    let (watch, watch_rx) = tokio::sync::watch::channel(None);
    let reports = PeersShared::default();
    let (urgent, urgent_rx) = tokio::sync::mpsc::unbounded_channel();
    let peers = AbortOnDrop(tokio::spawn(peer_loop(watch_rx, reports.clone(), urgent)));
    let heartbeats = AbortOnDrop(tokio::spawn(heartbeat_loop(
        client.clone(),
        node.node_id.clone(),
        job.heartbeat_interval,
        probe_within,
        events,
        steps.clone(),
        (reports, urgent_rx),
    )));
    Ok(ElasticSetup {
        client,
        node,
        advertise,
        heartbeat_interval: job.heartbeat_interval,
        _heartbeats: heartbeats,
        _probe: (probe, udp),
        hosted,
        steps,
        watch,
        _peers: peers,
    })
}

/// What this node's peer watching reports now, for every heartbeat to carry.
type PeersShared = std::sync::Arc<std::sync::Mutex<Vec<PeerReport>>>;

/// Carries out [`Peers`]' watching: pings each watched member's probe endpoint over UDP every
/// interval from a socket of its own (connected, so that a host's "port unreachable" comes
/// back as a refusal), feeds answers, refusals and ticks to the core, keeps `shared` current and
/// asks for a heartbeat at once when what it reports changes.
async fn peer_loop(
    mut watch: tokio::sync::watch::Receiver<Option<PeerWatch>>,
    shared: PeersShared,
    urgent: tokio::sync::mpsc::UnboundedSender<()>,
) {
    let clock = tokio::time::Instant::now();
    let now = move || u64::try_from(clock.elapsed().as_millis()).unwrap_or(u64::MAX);
    let mut peers = Peers::default();
    let (mut heard_tx, mut heard) = tokio::sync::mpsc::unbounded_channel::<peers::Event>();
    let mut sockets: Vec<(String, std::sync::Arc<tokio::net::UdpSocket>)> = Vec::new();
    let mut receivers: JoinSet<()> = JoinSet::new();
    let mut tick = tokio::time::interval(Duration::from_secs(3600));
    let mut nonce: u32 = crate::random::rand_u32();
    loop {
        let event = tokio::select! {
            changed = watch.changed() => {
                if changed.is_err() {
                    return;
                }
                let w = watch.borrow_and_update().clone();
                // The last watch's sockets, receivers and whatever they queued go: a refusal
                // heard for the last round's target says nothing of this round's.
                receivers.shutdown().await;
                sockets.clear();
                (heard_tx, heard) = tokio::sync::mpsc::unbounded_channel();
                if let Some(w) = &w {
                    tick = tokio::time::interval(Duration::from_millis(w.interval_ms.max(10)));
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    for t in &w.targets {
                        match rlaunch::store::connect_udp(&t.addr.to_string()).await {
                            Ok(socket) => {
                                let socket = std::sync::Arc::new(socket);
                                receivers.spawn(receive_echoes(t.node_id.clone(), socket.clone(), heard_tx.clone()));
                                sockets.push((t.node_id.clone(), socket));
                            }
                            Err(e) => warn!(node = %t.node_id, addr = %t.addr, error = %e, "peer watching: cannot ping this member"),
                        }
                    }
                }
                peers::Event::Watch(w)
            }
            _ = tick.tick(), if !sockets.is_empty() => {
                nonce = nonce.wrapping_add(1);
                let mut datagram = rlaunch::store::PROBE_DATAGRAM.to_vec();
                datagram.extend_from_slice(&nonce.to_le_bytes());
                for (id, socket) in &sockets {
                    if let Err(e) = socket.try_send(&datagram) {
                        if e.kind() == std::io::ErrorKind::ConnectionRefused {
                            let _ = heard_tx.send(peers::Event::Refused { node_id: id.clone() });
                        }
                    }
                }
                peers::Event::Tick
            }
            Some(event) = heard.recv() => event,
        };
        let t = now();
        let actions = peers.step(event, t);
        *shared.lock().unwrap_or_else(|p| p.into_inner()) = peers.reports(t);
        for a in actions {
            match a {
                peers::Action::Urgent => {
                    let _ = urgent.send(());
                }
                peers::Action::Info(m) => info!("{m}"),
            }
        }
    }
}

/// Tells of every echo from `node_id`'s endpoint, and of every refusal (ICMP port unreachable
/// surfaces as an error of the next receive on a connected socket).
async fn receive_echoes(
    node_id: String,
    socket: std::sync::Arc<tokio::net::UdpSocket>,
    heard: tokio::sync::mpsc::UnboundedSender<peers::Event>,
) {
    let mut buf = [0u8; 64];
    loop {
        let event = match socket.recv(&mut buf).await {
            Ok(n)
                if n == rlaunch::store::PROBE_DATAGRAM.len() + 4 && buf.starts_with(rlaunch::store::PROBE_DATAGRAM) =>
            {
                peers::Event::Answered { node_id: node_id.clone() }
            }
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                peers::Event::Refused { node_id: node_id.clone() }
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if heard.send(event).is_err() {
            return;
        }
    }
}

/// The probe endpoint's store holds nothing: a set beyond this closes the connection.
const PROBE_STORE_BYTES: usize = 1024;
/// A probe's TCP attempts ([`PROBE_ATTEMPTS`]) start this far apart (a lost SYN costs a second;
/// a second attempt on another connection does not wait for it), beside UDP datagrams sent
/// every `PROBE_UDP_EVERY`.
const PROBE_STAGGER: Duration = Duration::from_millis(150);
const PROBE_UDP_EVERY: Duration = Duration::from_millis(40);

enum Done {
    /// Heartbeat `seq`'s answer and round trip.
    Beat(u64, Result<HeartbeatAnswer, RdzvError>, Duration),
    Probe(ProbeReport),
}

/// Carries out the heartbeat decisions of [`Beats`]: sends a heartbeat every `every` without
/// waiting for the previous answer, makes the probes the rendezvous asks for, and tells the
/// core of each answer. Every task it starts ends with it.
async fn heartbeat_loop(
    client: RendezvousClient,
    node_id: String,
    every: Duration,
    probe_within: Duration,
    events: UnboundedSender<Event>,
    steps: StepsShared,
    (peer_reports, mut urgent): (PeersShared, tokio::sync::mpsc::UnboundedReceiver<()>),
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks: JoinSet<Done> = JoinSet::new();
    // What each task is, so that one that panicked still frees its slot.
    let mut kinds: HashMap<tokio::task::Id, Result<u64, String>> = HashMap::new();
    let mut beats = Beats::default();
    // The error of the answer being stepped, for the core's view of it.
    let mut last_error: Option<RdzvError> = None;
    loop {
        let event = tokio::select! {
            _ = tick.tick() => beats::Event::Tick,
            Some(()) = urgent.recv() => beats::Event::Urgent,
            Some(done) = tasks.join_next_with_id() => {
                let kind = kinds.remove(&match &done { Ok((id, _)) => *id, Err(e) => e.id() });
                match (done, kind) {
                    (Ok((_, Done::Beat(seq, result, rtt))), _) => {
                        let result = result.map(|a| a.probe).map_err(|e| {
                            tracing::debug!(error = %e, "heartbeat failed");
                            let transient = e.is_transient();
                            last_error = Some(e);
                            beats::Failed { transient }
                        });
                        beats::Event::Answered { seq, result, rtt }
                    }
                    (Ok((_, Done::Probe(report))), _) => beats::Event::Probed(report),
                    (Err(e), kind) => {
                        warn!(error = %e, "a heartbeat or probe task failed");
                        match kind {
                            Some(Ok(seq)) => beats::Event::BeatLost { seq },
                            Some(Err(node_id)) => beats::Event::ProbeLost { node_id },
                            None => continue,
                        }
                    }
                }
            }
        };
        for action in beats.step(event) {
            match action {
                beats::Action::Send { sent, probes } => {
                    let steps = steps.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    let seq = sent.seq;
                    let peers = peer_reports.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    let beat = Beat { sent: Some(sent), probes, steps, peers };
                    let (client, node_id) = (client.clone(), node_id.clone());
                    let task = tasks.spawn(async move {
                        let started = tokio::time::Instant::now();
                        let result = client.heartbeat(&node_id, beat).await;
                        Done::Beat(seq, result, started.elapsed())
                    });
                    kinds.insert(task.id(), Ok(seq));
                }
                beats::Action::Probe { req, nonce } => {
                    let node = req.node_id.clone();
                    let task = tasks.spawn(probe_node(req, nonce, probe_within));
                    kinds.insert(task.id(), Err(node));
                }
                beats::Action::Heard(result) => {
                    // The error of the answer just stepped (an `Answered` gives one `Heard`).
                    let heard = match (result, last_error.take()) {
                        (Ok(()), _) => Ok(()),
                        (Err(_), Some(e)) => Err(call_error(e)),
                        (Err(_), None) => continue,
                    };
                    if events.send(Event::Heartbeat(heard)).is_err() {
                        return;
                    }
                }
                beats::Action::Info(m) => info!("{m}"),
            }
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
async fn backend(d: &DynamicRendezvous, join_timeout: Duration) -> Result<(Backend, Option<AbortOnDrop>), AgentError> {
    let endpoints: Vec<rlaunch_rendezvous::Endpoint> = d.endpoints.iter().map(Into::into).collect();
    if d.backend == DynamicBackend::Etcd {
        return Ok((Backend::Etcd { endpoints }, None));
    }
    let http = Backend::Http { endpoints, token: d.token.clone() };
    let first = d.endpoints[0].addr.to_string();
    // The server may come up after this agent (the hosting agent starting later, a service
    // restarting): wait for it as long as a join may wait, as torchrun's agents do.
    let deadline = tokio::time::Instant::now() + join_timeout;
    let mut announced = false;
    loop {
        for e in &d.endpoints {
            if answers(&e.addr).await {
                return Ok((http, None));
            }
        }
        let addr = tokio::net::lookup_host(first.as_str()).await.ok().and_then(|mut a| a.next());
        // An agent-hosted server speaks plain HTTP: never in place of an https:// endpoint.
        if let Some(addr) = addr.filter(|_| !d.endpoints[0].is_tls()) {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => {
                    info!(%addr, "no rendezvous server answered; this agent hosts one (memory store)");
                    let rdzv = Rendezvous::in_memory();
                    let state = AppState::new(rdzv.clone(), d.token.clone());
                    // Its connections within this process's open files, as the workers' store's
                    // and the probe store's are: idle connections against one never take the
                    // descriptors the agent needs for its own work (the next round's store,
                    // workers' pipes, logs).
                    let limits = ServeLimits {
                        max_connections: rlaunch::store::default_max_connections(),
                        ..ServeLimits::default()
                    };
                    let task = tokio::spawn(async move {
                        if let Err(e) = serve_with(listener, state, limits, std::future::pending()).await {
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
                    endpoint_list(d),
                    join_timeout
                ),
                source: None,
            });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn answers(addr: &HostPort) -> bool {
    let e = addr.to_string();
    matches!(tokio::time::timeout(Duration::from_millis(700), tokio::net::TcpStream::connect(e)).await, Ok(Ok(_)))
}

fn endpoint_list(d: &DynamicRendezvous) -> String {
    d.endpoints.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

/// The address other nodes reach this one at: `--local-addr`, else the source address this host
/// uses towards the first rendezvous endpoint (never loopback unless the endpoint is).
fn advertise_addr(config: &AgentConfig, d: &DynamicRendezvous) -> Host {
    if let Some(a) = &config.local_addr {
        return a.clone();
    }
    let target: Option<SocketAddr> = d.endpoints[0].addr.to_string().to_socket_addrs().ok().and_then(|mut a| a.next());
    if let Some(t) = target {
        let bind = if t.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        if let Ok(sock) = UdpSocket::bind(bind) {
            // connect() on UDP sends nothing; it only picks the route and source address.
            if sock.connect(t).is_ok() {
                if let Ok(local) = sock.local_addr() {
                    return local.ip().to_string().parse().expect("an address literal is a host");
                }
            }
        }
    }
    "127.0.0.1".parse().expect("an address literal is a host")
}

/// How the core sees a rendezvous error (the error itself goes along, as the cause of what
/// it may end in).
pub(crate) fn call_error(e: RdzvError) -> CallError {
    match e {
        // A rendezvous that lost the job (a memory store restarted) knows this node no more:
        // rejoining creates the job again. A node whose id another agent now holds (forbidden)
        // is no member either: it stops its workers and joins again.
        RdzvError::UnknownNode { .. }
        | RdzvError::NotMember { .. }
        | RdzvError::UnknownJob { .. }
        | RdzvError::Forbidden { .. } => CallError::NotMember,
        RdzvError::JobFinished => CallError::JobFinished,
        RdzvError::JobFailed { reason } | RdzvError::JoinTimeout { reason } => CallError::JobFailed(reason),
        e if e.is_transient() => CallError::Transient(Cause::new(e)),
        e => CallError::Refused(Cause::new(e)),
    }
}

/// Where this node's stores (and its probe endpoint) listen: where they are advertised
/// (`--store-bind` for setups that need more). A host name may resolve here to another address
/// than other nodes see (Debian's 127.0.1.1 in /etc/hosts): then every address, as an address
/// literal cannot mislead.
pub(crate) fn store_bind(config: &AgentConfig, advertise: &Host) -> HostPort {
    let host = match (&config.store_bind, advertise.ip()) {
        (Some(bind), _) => bind.clone(),
        (None, Some(_)) => advertise.clone(),
        (None, None) => "0.0.0.0".parse().expect("an address literal is a host"),
    };
    host.with_port(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_errors_reach_the_core_as_what_they_mean_for_this_node() {
        let node = || "n".to_string();
        assert_eq!(call_error(RdzvError::UnknownNode { node_id: node() }), CallError::NotMember);
        assert_eq!(call_error(RdzvError::NotMember { node_id: node(), round: 3 }), CallError::NotMember);
        assert_eq!(call_error(RdzvError::UnknownJob { run_id: "j".into() }), CallError::NotMember);
        assert_eq!(call_error(RdzvError::Forbidden { node_id: node() }), CallError::NotMember);
        assert_eq!(call_error(RdzvError::JobFinished), CallError::JobFinished);
        assert_eq!(call_error(RdzvError::JobFailed { reason: "r".into() }), CallError::JobFailed("r".into()));
        assert_eq!(call_error(RdzvError::JoinTimeout { reason: "t".into() }), CallError::JobFailed("t".into()));
        assert!(matches!(call_error(RdzvError::Busy { message: "m".into() }), CallError::Transient(_)));
        assert!(matches!(call_error(RdzvError::BadRequest { message: "m".into() }), CallError::Refused(_)));
    }

    #[test]
    fn stores_listen_where_the_node_is_advertised_unless_told_otherwise() {
        let mut config = AgentConfig::standalone(vec!["train".into()], 1);
        let ip: Host = "10.1.2.3".parse().unwrap();
        let name: Host = "node7.cluster".parse().unwrap();
        assert_eq!(store_bind(&config, &ip), ip.with_port(0));
        // A name may resolve here to another address than others see: every address.
        assert_eq!(store_bind(&config, &name), "0.0.0.0".parse::<Host>().unwrap().with_port(0));
        config.store_bind = Some("192.168.0.9".parse().unwrap());
        assert_eq!(store_bind(&config, &ip), "192.168.0.9".parse::<Host>().unwrap().with_port(0));
    }
}

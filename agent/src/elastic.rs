//! The elastic agent loop: join a rendezvous round, run this node's workers with the round's
//! ranks, heartbeat on a task of its own, and react to the rendezvous — a new round (node lost,
//! node joined, a failure elsewhere) stops the workers and rejoins; the job finishing or failing
//! ends the run.

use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::{info, info_span, warn, Instrument};

use rlaunch_rendezvous::api::{serve as serve_api, AppState};
use rlaunch_rendezvous::{
    Backend, JobSettings, NodeInfo, RdzvError, Rendezvous, RendezvousClient, RoundInfo, WatchEvent,
};

use crate::report::RootCause;
use crate::workers::{GroupOutcome, WorkerGroup};
use crate::{
    process, start_store, worker_specs, AgentConfig, AgentError, Ctx, DynamicBackend, DynamicRendezvous, Placement,
    RunOutcome, SignalEvent, Signals,
};

/// Extra silence tolerated past the node TTL before a node fences itself: an etcd leader
/// election (or a rendezvous replica failing over) stalls every request for a second or two
/// while leases survive it, and a healthy node must not stop its workers for that. A node that
/// is really cut off stops its workers this much later than the rendezvous replaces it.
const ELECTION_ALLOWANCE: Duration = Duration::from_secs(2);

/// How long a node whose workers all succeeded keeps trying to reach a vanished rendezvous.
const UNREACHABLE_AFTER_SUCCESS: Duration = Duration::from_secs(10);

/// When this agent last heard from the rendezvous (any successful call), to fence itself when
/// it has been cut off for longer than the node TTL.
#[derive(Clone)]
struct Contact {
    start: tokio::time::Instant,
    last_ms: Arc<AtomicU64>,
}

impl Contact {
    fn new() -> Contact {
        Contact { start: tokio::time::Instant::now(), last_ms: Arc::new(AtomicU64::new(0)) }
    }

    fn heard(&self) {
        self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn silent_for(&self) -> Duration {
        let now = self.start.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// Errors after which the same call may well succeed later (a server restarting, a network
/// cut healing, an etcd election).
fn transient(e: &RdzvError) -> bool {
    match e {
        RdzvError::Unavailable { .. } | RdzvError::Etcd { .. } | RdzvError::Contention { .. } => true,
        RdzvError::Server { status, .. } => *status >= 500,
        _ => false,
    }
}

/// Aborts a background task when dropped (heartbeats, an agent-hosted server).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn rdzv_err(e: RdzvError) -> AgentError {
    AgentError::Rendezvous(e.to_string())
}

/// Runs this node's part of an elastic job until it finishes, fails, or the agent is stopped.
pub(crate) async fn run(
    config: &AgentConfig,
    d: &DynamicRendezvous,
    ctx: &Ctx<'_>,
    signals: &mut Signals,
) -> Result<RunOutcome, AgentError> {
    let advertise = advertise_addr(config, d);
    // Every agent hosts a store; the round's group rank 0 is the one the workers use.
    let store = start_store(&format!("{}:0", bind_any(&advertise))).await?;
    let store_addr = join_host_port(&advertise, store.local_addr().port());
    let (backend, hosted) = backend(d).await?;
    let settings = JobSettings {
        min_nodes: d.min_nodes,
        max_nodes: d.max_nodes,
        join_timeout: d.join_timeout,
        last_call_timeout: d.last_call_timeout,
        heartbeat_interval: d.heartbeat_interval,
        node_ttl: d.node_ttl,
        max_restarts: config.max_restarts,
    };
    let client = RendezvousClient::connect(backend, &config.run_id, settings).await.map_err(rdzv_err)?;
    let node = NodeInfo {
        node_id: format!("{}-{}-{:08x}", ctx.host, std::process::id(), rand_u32()),
        local_world_size: config.nproc_per_node,
        store_addr,
    };
    info!(node_id = %node.node_id, store = %node.store_addr, endpoints = ?d.endpoints, min = d.min_nodes, max = d.max_nodes, "joining the rendezvous");
    let contact = Contact::new();
    contact.heard();
    let heartbeats = AbortOnDrop(tokio::spawn(heartbeat_loop(
        client.clone(),
        node.node_id.clone(),
        d.heartbeat_interval,
        contact.clone(),
    )));
    let outcome = agent_loop(config, d, ctx, &client, &node, &store, &contact, signals).await;
    drop(heartbeats);
    if hosted.is_some() {
        // The other agents learn that the job ended from this process: give their long-polls
        // time to see it before the server goes away with us.
        tokio::time::sleep(d.heartbeat_interval * 2 + Duration::from_secs(1)).await;
    }
    outcome
}

#[allow(clippy::too_many_arguments)]
async fn agent_loop(
    config: &AgentConfig,
    d: &DynamicRendezvous,
    ctx: &Ctx<'_>,
    client: &RendezvousClient,
    node: &NodeInfo,
    store: &rlaunch::store::StoreHandle,
    contact: &Contact,
    signals: &mut Signals,
) -> Result<RunOutcome, AgentError> {
    let mut last_failure: Option<RootCause> = None;

    loop {
        // No worker of this node runs now: a fresh store for whichever round comes next.
        store.clear();
        let joined = tokio::select! {
            r = client.join(node.clone()) => r,
            ev = next_stop(signals) => {
                let _ = client.leave(&node.node_id).await;
                return Ok(RunOutcome::Interrupted { signal: ev });
            }
        };
        let round = match joined {
            Ok(r) => {
                contact.heard();
                r
            }
            Err(RdzvError::JobFinished) => return Ok(RunOutcome::Succeeded { restarts: 0 }),
            Err(RdzvError::JobFailed { reason }) => return failed(client, reason, last_failure).await,
            Err(e) if transient(&e) => {
                // Keep trying as long as a join may wait: the rendezvous may come back, or this
                // node's link may heal (it then rejoins as a scale-up).
                // The client's join already waits through unavailability for a while: count from
                // the last time anything reached the rendezvous, not from this error.
                if contact.silent_for() >= d.join_timeout {
                    return Err(AgentError::Rendezvous(format!(
                        "the rendezvous has been unreachable for the whole join timeout ({:?}): {e}",
                        d.join_timeout
                    )));
                }
                warn!(error = %e, "cannot reach the rendezvous; retrying the join");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => return Err(rdzv_err(e)),
        };
        let span = info_span!("round", round = round.round);
        let step = run_round(config, d, ctx, client, node, &round, contact, signals).instrument(span).await?;
        match step {
            RoundEnd::Rejoin => continue,
            RoundEnd::LocalFailure(rc) => {
                last_failure = Some(*rc);
                continue;
            }
            RoundEnd::Done(outcome) => return Ok(outcome),
            RoundEnd::JobFailed(reason) => return failed(client, reason, last_failure).await,
        }
    }
}

enum RoundEnd {
    /// The job moved to a new round: join it.
    Rejoin,
    /// A worker of this node failed and was reported; join the next round.
    LocalFailure(Box<RootCause>),
    JobFailed(String),
    Done(RunOutcome),
}

#[allow(clippy::too_many_arguments)]
async fn run_round(
    config: &AgentConfig,
    d: &DynamicRendezvous,
    ctx: &Ctx<'_>,
    client: &RendezvousClient,
    node: &NodeInfo,
    round: &RoundInfo,
    contact: &Contact,
    signals: &mut Signals,
) -> Result<RoundEnd, AgentError> {
    let (master_addr, master_port) = split_host_port(&round.master_store_addr)
        .ok_or_else(|| AgentError::Rendezvous(format!("bad master store address {:?}", round.master_store_addr)))?;
    let placement = Placement {
        group_rank: round.group_rank,
        group_world_size: round.group_world_size,
        rank_offset: round.rank_offset,
        world_size: round.world_size,
        master_addr,
        master_port,
        use_agent_store: true,
    };
    info!(
        group_rank = round.group_rank,
        nodes = round.group_world_size,
        world_size = round.world_size,
        restart_count = round.restart_count,
        master = %round.master_store_addr,
        "round closed; starting workers"
    );
    let specs = worker_specs(config, &placement, round.restart_count, ctx.log_root, ctx.host);
    let mut group = WorkerGroup::start(&config.program, specs, ctx.agent_env, ctx.console, ctx.host)?;
    let mut succeeded = false;
    let mut unreachable_since: Option<tokio::time::Instant> = None;
    let mut fence_check = tokio::time::interval(d.heartbeat_interval);
    loop {
        tokio::select! {
            _ = fence_check.tick(), if !succeeded => {
                // Cut off for longer than the TTL: the rendezvous has declared this node lost
                // and given its ranks to others. Its workers must not go on (a second rank 0
                // writing checkpoints would be split brain).
                if contact.silent_for() > d.node_ttl + ELECTION_ALLOWANCE {
                    warn!(silent_ms = contact.silent_for().as_millis() as u64, "no contact with the rendezvous for longer than the node TTL; stopping workers");
                    group.stop(config.stop_grace).await;
                    return Ok(RoundEnd::Rejoin);
                }
            }
            outcome = group.wait(), if !succeeded => match outcome {
                GroupOutcome::Succeeded => {
                    group.reap_stragglers().await;
                    info!("this node's workers succeeded; waiting for the others");
                    if let Err(e) = client.report_success(&node.node_id, round.round).await {
                        warn!(error = %e, "could not report success");
                    }
                    succeeded = true;
                }
                GroupOutcome::Failed(rc) => {
                    group.stop(config.stop_grace).await;
                    ctx.console.flush();
                    warn!(rank = rc.rank, exit = %rc.exit.describe(), "worker failed; reporting to the rendezvous");
                    let json = serde_json::to_value(&*rc).expect("a root cause is plain data");
                    if let Err(e) = client.report_failure(&node.node_id, round.round, json).await {
                        warn!(error = %e, "could not report the failure");
                    }
                    return Ok(RoundEnd::LocalFailure(rc));
                }
            },
            ev = client.watch(round.round) => match ev {
                Ok(WatchEvent::NoChange) => {
                    contact.heard();
                    unreachable_since = None;
                }
                Ok(WatchEvent::NewRound(n)) => {
                    warn!(new_round = n, "the job is re-forming; stopping workers");
                    group.stop(config.stop_grace).await;
                    return Ok(RoundEnd::Rejoin);
                }
                Ok(WatchEvent::Finished) => {
                    group.stop(config.stop_grace).await;
                    return Ok(RoundEnd::Done(RunOutcome::Succeeded { restarts: round.restart_count }));
                }
                Ok(WatchEvent::Failed(reason)) => {
                    group.stop(config.stop_grace).await;
                    return Ok(RoundEnd::JobFailed(reason));
                }
                Err(RdzvError::UnknownNode { .. }) | Err(RdzvError::NotMember { .. }) => {
                    warn!("the rendezvous declared this node lost; stopping workers and rejoining");
                    group.stop(config.stop_grace).await;
                    return Ok(RoundEnd::Rejoin);
                }
                Err(e) => {
                    // A rendezvous that cannot be reached is not a reason to kill healthy
                    // workers; heartbeats decide whether this node is still a member. Once this
                    // node's workers are done, though, there is nothing left to wait for.
                    let since = *unreachable_since.get_or_insert_with(tokio::time::Instant::now);
                    if succeeded && since.elapsed() > UNREACHABLE_AFTER_SUCCESS {
                        warn!(error = %e, "the rendezvous is gone and this node's workers succeeded; exiting");
                        return Ok(RoundEnd::Done(RunOutcome::Succeeded { restarts: round.restart_count }));
                    }
                    warn!(error = %e, "watching the rendezvous failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            },
            ev = signals.next() => match ev {
                SignalEvent::Relay(sig) => {
                    info!(signal = %process::signal_name(sig), "relaying signal to workers");
                    group.signal_all(sig);
                }
                SignalEvent::Stop(sig) => {
                    warn!(signal = %process::signal_name(sig), "stopping workers and leaving the job");
                    group.stop(config.stop_grace).await;
                    let _ = client.leave(&node.node_id).await;
                    return Ok(RoundEnd::Done(RunOutcome::Interrupted { signal: sig }));
                }
            },
        }
    }
}

/// Waits for a stop signal, ignoring relays (there are no workers to relay to).
async fn next_stop(signals: &mut Signals) -> i32 {
    loop {
        if let SignalEvent::Stop(sig) = signals.next().await {
            return sig;
        }
    }
}

/// The job failed: report the root cause the rendezvous kept (it may come from another node).
async fn failed(client: &RendezvousClient, reason: String, local: Option<RootCause>) -> Result<RunOutcome, AgentError> {
    let remote = match client.status().await {
        Ok(s) => s.last_root_cause.and_then(|v| serde_json::from_value::<RootCause>(v).ok()),
        Err(_) => None,
    };
    match remote.or(local) {
        Some(rc) => {
            let restarts = rc.restart_count;
            Ok(RunOutcome::Failed { root_cause: Box::new(rc), restarts })
        }
        None => Err(AgentError::Rendezvous(reason)),
    }
}

async fn heartbeat_loop(client: RendezvousClient, node_id: String, every: Duration, contact: Contact) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match client.heartbeat(&node_id).await {
            Ok(()) => contact.heard(),
            Err(e) => tracing::debug!(error = %e, "heartbeat failed"),
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
    let deadline = tokio::time::Instant::now() + d.join_timeout;
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
            return Err(AgentError::Rendezvous(format!(
                "no rendezvous server answered at {} within the join timeout ({:?}), and it is not an address of this host to serve one on",
                d.endpoints.join(","),
                d.join_timeout
            )));
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

fn bind_any(advertise: &str) -> &'static str {
    if advertise.contains(':') {
        "[::]"
    } else {
        "0.0.0.0"
    }
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn split_host_port(s: &str) -> Option<(String, u16)> {
    let (h, p) = s.rsplit_once(':')?;
    let h = h.trim_start_matches('[').trim_end_matches(']');
    Some((h.to_string(), p.parse().ok()?))
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b)).is_err() {
        return std::process::id() ^ 0x9e37_79b9;
    }
    u32::from_le_bytes(b)
}

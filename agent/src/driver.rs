//! The one loop that runs the agent's [`Core`] in every mode: it turns worker exits, signals,
//! rendezvous answers and a clock tick into [`Event`]s, and carries out the [`Action`]s the core
//! returns — spawning workers, serving the workers' store, calling the rendezvous. No decision
//! is made here.

use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::task::{AbortHandle, JoinSet};
use tracing::{info, warn};

use rlaunch::contract::{Host, HostPort, NodeInfo};
use rlaunch::store::StoreHandle;
use rlaunch_rendezvous::{RdzvError, RendezvousClient, WatchEvent};

use crate::config::{AgentConfig, RendezvousConfig};
use crate::core::{
    Action, CallError, Core, Event, Features, Membership, Outcome, Placement, Report, ReportKind, RunOutcome,
    SnapshotRound, Watch, WorkersEnd,
};
use crate::elastic::{self, call_error, store_bind, ElasticSetup};
use crate::error::AgentError;
use crate::hangwatch;
use crate::node::{start_store, Ctx};
use crate::output::DupFilter;
use crate::process;
use crate::signals::Signals;
use crate::spec::{static_store_bind, warm_templates, worker_specs};
use crate::supervisor::{Action as SupAction, Event as SupEvent, HangPolicy, Supervisor};
use crate::workers::{GroupIo, WorkerGroup};

/// How often the core's clock ticks (fencing, retries).
const TICK: Duration = Duration::from_millis(100);
/// Bound on the status call that fetches a failed job's root cause.
const STATUS_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs this node's part of the job to the end.
pub(crate) async fn run(config: &AgentConfig, ctx: &Ctx<'_>, signals: &mut Signals) -> Result<RunOutcome, AgentError> {
    let (tx, rx) = unbounded_channel();
    let mut io = Io {
        config,
        ctx,
        tx,
        group: None,
        store: None,
        fixed_store: false,
        elastic: None,
        calls: JoinSet::new(),
        join: None,
        watching_hangs: false,
        control: None,
        starter: None,
        agent_vars: ctx.snapshot_env.clone(),
        reaped: None,
    };
    let membership = io.setup().await?;
    // Before the first rendezvous (a spare has its workers warm before any fault), once the
    // setup made what the workers' environment names (the control socket).
    io.fill_warm(None);
    let features = Features {
        snapshots: ctx.snapshots.is_some_and(|s| s.enabled()),
        warm_workers: ctx.warm.is_some(),
        local_world_size: config.nproc_per_node,
    };
    let core = Core::new(membership).with_handled_signals(&config.handled_signals).with_features(features);
    let result = drive(core, &mut io, rx, signals).await;
    io.calls.abort_all();
    if let Some(e) = io.elastic.take() {
        e.finish().await;
    }
    result
}

async fn drive(
    mut core: Core,
    io: &mut Io<'_>,
    mut rx: UnboundedReceiver<Event>,
    signals: &mut Signals,
) -> Result<RunOutcome, AgentError> {
    let start = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = Some(Event::Start);
    loop {
        let event = match next.take() {
            Some(e) => e,
            None => tokio::select! {
                Some(e) = rx.recv() => e,
                sig = signals.next() => Event::Signal(sig),
                _ = tick.tick() => Event::Tick,
            },
        };
        // Forget finished calls (a watch every few seconds for days adds up).
        while io.calls.try_join_next().is_some() {}
        let now = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        for action in core.step(event, now) {
            if let Some(outcome) = io.perform(action).await? {
                return outcome;
            }
        }
    }
}

/// Bound on taking the workers' stacks for the rendezvous before a stop (py-spy's own bound is
/// 10 s per rank, all ranks at once).
const STACKS_WITHIN: Duration = Duration::from_secs(12);

/// Hang detection for a group: the threshold, the stack reader, and the job's node count.
struct HangWatch {
    timeout: crate::hang::HangTimeout,
    py_spy: Option<std::path::PathBuf>,
    nodes: u32,
}

/// Supervises one worker group on a task of its own; commands go in, events come out.
enum GroupCmd {
    Signal(i32),
    Stop {
        first: i32,
    },
    /// Where the running ranks stand, as report lines (none without hang detection).
    Stacks(tokio::sync::oneshot::Sender<Vec<String>>),
    /// The workers were told their round ended (no hang is judged while they wait); what the
    /// failed ones at the indices in `reap` left running is killed, then `done` is answered.
    Park {
        reap: Vec<usize>,
        done: tokio::sync::oneshot::Sender<()>,
    },
    /// The workers kept their processes into a new round: their specification there, and the
    /// workers started anew in place of failed ones.
    Renumber {
        specs: Vec<crate::spec::WorkerSpec>,
        fresh: Vec<crate::workers::Fresh>,
    },
}

/// The effects of [`Supervisor`]'s decisions for one group, on a task of its own: exits, the
/// driver's commands, samples and stacks (read on tasks of their own, so a slow py-spy never
/// holds up an exit or a stop) go in as events; what the supervisor returns is carried out.
fn supervise(
    mut group: WorkerGroup,
    grace: Duration,
    events: UnboundedSender<Event>,
    hang: Option<HangWatch>,
    steps: Option<crate::elastic::StepsShared>,
) -> UnboundedSender<GroupCmd> {
    let (cmd_tx, mut cmds) = unbounded_channel();
    tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        let clock = move || u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let policy = hang.as_ref().map(|h| HangPolicy {
            timeout: h.timeout,
            nodes: h.nodes,
            ticks_per_s: hangwatch::ticks_per_s(),
        });
        let py_spy = hang.and_then(|h| h.py_spy);
        let mut sup = Supervisor::new(group.ranks(), policy, steps.is_some(), clock());
        // Samples and stacks read on tasks of their own come back here.
        let (done_tx, mut done) = unbounded_channel::<SupEvent>();
        let mut replies: Vec<tokio::sync::oneshot::Sender<Vec<String>>> = Vec::new();
        // Samples and stack reads under way: aborted when the group is stopped or let go (a
        // py-spy of a group that is gone must not pause or signal anything later).
        let mut reads: JoinSet<()> = JoinSet::new();
        let mut waiters_gone = false;
        loop {
            // Forget finished reads (one a second for days adds up).
            while reads.try_join_next().is_some() {}
            let wake = sup.next_wakeup().map(|at| start + Duration::from_millis(at));
            let event = tokio::select! {
                biased;
                exit = group.next_exit(), if group.any_running() && !waiters_gone => match exit {
                    Some((index, exit, seen_at)) => SupEvent::Exited { index, exit, seen_at },
                    None => {
                        // Every waiter is gone without reporting (cannot happen while each
                        // sends once): a failure of the group.
                        waiters_gone = true;
                        let index = group.first_running().unwrap_or(0);
                        SupEvent::Exited { index, exit: rlaunch::contract::Exit::Code(1), seen_at: crate::report::now_unix_ms() }
                    }
                },
                cmd = cmds.recv() => match cmd {
                    Some(GroupCmd::Signal(sig)) => SupEvent::Signal(sig),
                    Some(GroupCmd::Stop { first }) => SupEvent::Stop { first },
                    Some(GroupCmd::Stacks(reply)) => {
                        replies.push(reply);
                        SupEvent::StacksWanted
                    }
                    Some(GroupCmd::Park { reap, done }) => {
                        for index in reap {
                            group.reap_worker(index).await;
                        }
                        let _ = done.send(());
                        SupEvent::Park
                    }
                    Some(GroupCmd::Renumber { specs, fresh }) => {
                        let indices: Vec<usize> = fresh.iter().map(crate::workers::Fresh::index).collect();
                        for f in fresh {
                            group.adopt(f);
                        }
                        sup.renumber(specs.iter().map(|s| s.env.rank).collect(), &indices, clock());
                        group.renumber(specs);
                        continue;
                    }
                    // The driver let go of the group: `WorkerGroup`'s drop kills what is left.
                    None => return,
                },
                Some(e) = done.recv() => e,
                _ = sleep_until_or_never(wake) => SupEvent::Tick,
            };
            // Exits already noticed come first: one that happened while a sample was taken is
            // never judged a hang.
            let mut queue: std::collections::VecDeque<SupEvent> = std::collections::VecDeque::new();
            if !matches!(event, SupEvent::Exited { .. }) {
                while let Some((index, exit, seen_at)) = group.try_next_exit() {
                    queue.push_back(SupEvent::Exited { index, exit, seen_at });
                }
            }
            queue.push_back(event);
            while let Some(event) = queue.pop_front() {
                for action in sup.step(event, clock()) {
                    match action {
                        SupAction::Sample { stacks_of } => {
                            let watched = group.watched();
                            let (py_spy, tx) = (py_spy.clone(), done_tx.clone());
                            reads.spawn(async move {
                                let quiet: Vec<&hangwatch::Watched> =
                                    watched.iter().filter(|w| stacks_of.contains(&w.index)).collect();
                                let digests = if quiet.is_empty() {
                                    Default::default()
                                } else {
                                    hangwatch::stack_digests(py_spy.as_deref(), &quiet).await
                                };
                                let _ = tx.send(SupEvent::Sampled(hangwatch::samples(&watched, &digests)));
                            });
                        }
                        SupAction::PublishSteps => {
                            if let Some(shared) = &steps {
                                *shared.lock().unwrap_or_else(|p| p.into_inner()) =
                                    hangwatch::rank_waits(&group.watched());
                            }
                        }
                        SupAction::ForgetSteps => {
                            // Once the group is over its ranks' waits are the last round's.
                            if let Some(s) = &steps {
                                s.lock().unwrap_or_else(|p| p.into_inner()).clear();
                            }
                        }
                        SupAction::ReadStacks { id } => {
                            let watched = group.watched();
                            let (py_spy, tx) = (py_spy.clone(), done_tx.clone());
                            reads.spawn(async move {
                                let stacks = hangwatch::stacks(py_spy.as_deref(), &watched).await;
                                let _ = tx.send(SupEvent::StacksRead { id, stacks });
                            });
                        }
                        SupAction::ReplyStacks(lines) => {
                            for r in replies.drain(..) {
                                let _ = r.send(lines.clone());
                            }
                        }
                        SupAction::Signal(sig) => {
                            info!(signal = %process::signal_name(sig), "relaying signal to workers");
                            group.signal_all(sig);
                        }
                        SupAction::Stop { first } => {
                            reads.abort_all();
                            group.stop(grace, first).await;
                            queue.push_back(SupEvent::Stopped);
                        }
                        SupAction::Stopped => {
                            let _ = events.send(Event::WorkersStopped);
                        }
                        SupAction::Succeeded => {
                            group.reap_stragglers().await;
                            let _ = events.send(Event::WorkersEnded(WorkersEnd::Succeeded));
                        }
                        SupAction::Failed(failure) => {
                            let rc = group.failure_report(failure).await;
                            let _ = events.send(Event::WorkersEnded(WorkersEnd::Failed(Box::new(rc))));
                        }
                        SupAction::Hung(h) => {
                            let rc = group.hang_root_cause(h.culprit, h.message, h.stacks);
                            let _ = events.send(Event::WorkersEnded(WorkersEnd::Hung(Box::new(rc))));
                        }
                        SupAction::Info(m) => info!("{m}"),
                        SupAction::Warn(m) => warn!("{m}"),
                    }
                }
            }
        }
    });
    cmd_tx
}

/// Tells the rendezvous how far this node's round got whenever something new is known (workers
/// started, a step restored, saved, saved again), for its recovery accounting. A report that
/// fails is tried again every half second for as long as its round runs (at most 20 times).
async fn report_progress(client: RendezvousClient, node_id: String, tracker: std::sync::Arc<crate::progress::Tracker>) {
    let mut sent = None;
    loop {
        let (mut report, mut known) = tracker.next().await;
        for attempt in 0..20 {
            if sent == Some(known) {
                break;
            }
            let Some((round, progress)) = report.clone() else { break };
            match tokio::time::timeout(STATUS_TIMEOUT, client.report_progress(&node_id, round, progress)).await {
                Ok(Ok(())) => {
                    sent = Some(known);
                    break;
                }
                Ok(Err(e)) => tracing::debug!(error = %e, round, attempt, "progress not taken"),
                Err(_) => tracing::debug!(round, attempt, "progress report timed out"),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            (report, known) = tracker.current(); // a round over answers None: given up above
        }
    }
}

/// Says where a round's workers run, as they are started or resumed.
fn log_round(p: &Placement, master: &HostPort, logs: &std::path::Path, what: &str) {
    info!(
        round = p.round,
        group_rank = p.group_rank,
        nodes = p.group_world_size,
        world_size = p.world_size,
        restart_count = p.restart_count,
        master = %master,
        logs = %logs.display(),
        "{what}"
    );
}

/// Sleeps until `at`, or forever.
async fn sleep_until_or_never(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Everything the driver acts on.
struct Io<'a> {
    config: &'a AgentConfig,
    ctx: &'a Ctx<'a>,
    tx: UnboundedSender<Event>,
    group: Option<UnboundedSender<GroupCmd>>,
    /// The workers' store this agent serves now.
    store: Option<StoreHandle>,
    /// Static node 0: the store lives on `--master-port` for the whole run and is emptied
    /// between attempts; otherwise every round or attempt gets a fresh one.
    fixed_store: bool,
    elastic: Option<ElasticSetup>,
    /// Rendezvous calls in flight (watch, reports, status).
    calls: JoinSet<()>,
    join: Option<AbortHandle>,
    /// The running group reads stacks (`--hang-timeout`, the job's).
    watching_hangs: bool,
    /// Elastic: the socket of workers that keep their process across rounds.
    control: Option<crate::control::Control>,
    /// Starts workers in the running group in place of failed ones.
    starter: Option<crate::workers::Starter>,
    /// What the agent adds to every worker's environment: the snapshot store's socket, and
    /// (elastic) the control socket.
    agent_vars: Vec<(&'static str, String)>,
    /// Answered once what failed workers left running is killed (their replacements wait).
    reaped: Option<tokio::sync::oneshot::Receiver<()>>,
}

/// The core's view of a call's result.
fn seen<T>(result: Result<T, RdzvError>) -> Result<T, CallError> {
    result.map_err(call_error)
}

impl Io<'_> {
    /// Prepares the mode: the membership the core runs.
    async fn setup(&mut self) -> Result<Membership, AgentError> {
        let config = self.config;
        let (nproc, hang_timeout) = (config.nproc_per_node, config.job.hang_timeout);
        let placement = |group_rank, nnodes, master| Placement::fixed(group_rank, nnodes, nproc, master, hang_timeout);
        match &config.rendezvous {
            RendezvousConfig::Standalone => {
                Ok(Membership::Fixed { placement: placement(0, 1, None), max_restarts: config.job.max_restarts })
            }
            RendezvousConfig::Static { node_rank, nnodes, master } => {
                let mut master = master.clone();
                if *node_rank == 0 {
                    let store = start_store(&static_store_bind(&master, *nnodes), config.store_max_bytes).await?;
                    // Port 0: the one the OS picked.
                    master = Host::from(&master).with_port(store.local_addr().port());
                    self.store = Some(store);
                    self.fixed_store = true;
                }
                Ok(Membership::Fixed {
                    placement: placement(*node_rank, *nnodes, Some(master)),
                    max_restarts: config.job.max_restarts,
                })
            }
            RendezvousConfig::Dynamic(d) => {
                let setup = elastic::setup(
                    config,
                    d,
                    self.ctx.host,
                    self.ctx.snapshots.filter(|s| s.enabled()),
                    self.tx.clone(),
                )
                .await?;
                let (client, node_id, progress) =
                    (setup.client.clone(), setup.node.node_id.clone(), self.ctx.progress.clone());
                self.calls.spawn(report_progress(client, node_id, progress));
                self.elastic = Some(setup);
                // Without it workers cannot opt in to keeping their process; the job runs as
                // it would otherwise.
                self.control = crate::control::Control::start(self.tx.clone())
                    .map_err(
                        |e| warn!(error = %e, "cannot serve the workers' control socket: rlaunch.resilient is off"),
                    )
                    .ok();
                self.agent_vars.extend(self.control.iter().map(|c| c.worker_env()));
                Ok(Membership::Elastic { node_ttl: config.job.node_ttl, join_timeout: config.job.join_timeout })
            }
        }
    }

    fn client(&self) -> (RendezvousClient, NodeInfo) {
        let e = self.elastic.as_ref().expect("rendezvous actions come only from an elastic core");
        (e.client.clone(), e.node.clone())
    }

    /// Carries out one action; `Some` ends the run.
    async fn perform(&mut self, action: Action) -> Result<Option<Result<RunOutcome, AgentError>>, AgentError> {
        match action {
            Action::Join => self.join().await?,
            Action::StartWorkers(p) => self.start_workers(p).await?,
            Action::Park { round, hosts, failed } => {
                info!(round, "telling the workers that keep their process that the round ended");
                let (done, reaped) = tokio::sync::oneshot::channel();
                self.command(GroupCmd::Park { reap: failed.iter().map(|i| *i as usize).collect(), done });
                self.reaped = Some(reaped);
                if let Some(c) = &self.control {
                    c.end_round(round, &hosts, &failed);
                }
            }
            Action::Resume { placement, fresh } => self.resume_workers(placement, fresh).await?,
            Action::BeginSnapshots(round) => self.begin_snapshots(round),
            Action::EndRound { flush_console } => {
                if flush_console {
                    self.ctx.console.flush();
                }
                self.watch_peers(None);
                if let Some(snap) = self.ctx.snapshots {
                    snap.end_round();
                }
                self.ctx.progress.end();
            }
            Action::FillWarm(p) => {
                self.fill_warm(Some(&p));
            }
            Action::StopWorkers { first } => self.command(GroupCmd::Stop { first }),
            Action::ShareStacks { round } => self.share_stacks(round).await,
            Action::Relay(sig) => self.command(GroupCmd::Signal(sig)),
            Action::Watch { round } => {
                let (client, node) = self.client();
                let tx = self.tx.clone();
                self.calls.spawn(async move {
                    let answer = seen(client.watch(Some(&node.node_id), round).await);
                    let answer = answer.map(|w| match w {
                        WatchEvent::NoChange => Watch::NoChange,
                        WatchEvent::NewRound(n) => Watch::NewRound(n),
                        WatchEvent::Finished => Watch::Finished,
                        WatchEvent::Failed(reason) => Watch::Failed(reason),
                    });
                    let _ = tx.send(Event::Watched { round, answer });
                });
            }
            Action::Send(report) => self.send(report),
            Action::FetchRootCause => {
                let (client, _) = self.client();
                let tx = self.tx.clone();
                self.calls.spawn(async move {
                    let (rc, round) = match tokio::time::timeout(STATUS_TIMEOUT, client.status()).await {
                        Ok(Ok(status)) => (status.last_root_cause.map(Box::new), status.last_failure_round),
                        _ => (None, None),
                    };
                    let _ = tx.send(Event::RootCauseFetched(rc, round));
                });
            }
            Action::Note(message) => warn!("{message}"),
            Action::Exit(outcome) => {
                self.group = None;
                if let Some(j) = self.join.take() {
                    j.abort();
                }
                return Ok(Some(match outcome {
                    Outcome::Run(run) => {
                        if let RunOutcome::Succeeded { restarts } = run {
                            info!(restarts, "the job succeeded");
                        }
                        Ok(run)
                    }
                    Outcome::Rendezvous { message, source } => {
                        Err(AgentError::Rendezvous { message, source: source.map(|c| c.0) })
                    }
                }));
            }
        }
        Ok(None)
    }

    /// Tells the rendezvous where this node's ranks stand before they are stopped for
    /// something elsewhere, so that one report shows every node's. Awaited (within bounds), so
    /// a root cause fetched after the stop has them.
    async fn share_stacks(&mut self, round: u64) {
        if self.group.is_none() || !self.watching_hangs {
            return;
        }
        let (client, _) = self.client();
        let failed_round = match tokio::time::timeout(Duration::from_secs(1), client.status()).await {
            Ok(Ok(status)) => Some(status.last_failure_round),
            _ => None,
        };
        if !crate::core::stacks_worth_sharing(round, failed_round) {
            return;
        }
        let Some(g) = &self.group else { return };
        let (tx, rx) = tokio::sync::oneshot::channel();
        if g.send(GroupCmd::Stacks(tx)).is_err() {
            return;
        }
        let Ok(Ok(lines)) = tokio::time::timeout(STACKS_WITHIN, rx).await else {
            warn!("the workers' stacks were not read in time; stopping them without");
            return;
        };
        if lines.is_empty() {
            return;
        }
        warn!(round, "where this node's ranks stood when the round ended:");
        for l in &lines {
            warn!("  {l}");
        }
        let (client, node) = self.client();
        match tokio::time::timeout(STATUS_TIMEOUT, client.report_stacks(&node.node_id, round, lines)).await {
            Ok(Ok(())) => info!(round, "the rendezvous has this node's stacks"),
            Ok(Err(e)) => warn!(error = %e, "the rendezvous did not take this node's stacks"),
            Err(_) => warn!("the rendezvous did not answer in time; this node's stacks are only in its log"),
        }
    }

    fn command(&mut self, cmd: GroupCmd) {
        if let Some(g) = &self.group {
            let _ = g.send(cmd);
        }
    }

    /// Serves a fresh store for the next round — nothing a worker of an earlier round holds
    /// reaches it — and joins with its address.
    async fn join(&mut self) -> Result<(), AgentError> {
        if let Some(j) = self.join.take() {
            j.abort();
        }
        self.store = None; // closes the previous round's store and every connection to it
        let e = self.elastic.as_mut().expect("joins come only from an elastic core");
        let bind = store_bind(self.config, &e.advertise);
        let store = start_store(&bind, self.config.store_max_bytes).await?;
        e.node.store_addr = e.advertise.with_port(store.local_addr().port());
        // The parts held now decide, with every other member's, what the next round restores.
        e.node.snapshots = self.ctx.snapshots.filter(|s| s.enabled()).map(|s| s.inventory()).unwrap_or_default();
        self.store = Some(store);
        let (client, node) = (e.client.clone(), e.node.clone());
        info!(node_id = %node.node_id, store = %node.store_addr, "joining the rendezvous");
        let tx = self.tx.clone();
        let handle = self.calls.spawn(async move {
            let answer = seen(client.join(node).await);
            let _ = tx.send(Event::Joined(answer));
        });
        self.join = Some(handle);
        Ok(())
    }

    /// Starts (or, with `None`, stops) watching the members the round gave this node.
    fn watch_peers(&self, watch: Option<rlaunch::contract::PeerWatch>) {
        if let Some(e) = &self.elastic {
            e.watch.send_replace(watch);
        }
    }

    async fn start_workers(&mut self, p: Placement) -> Result<(), AgentError> {
        self.group = None;
        self.watch_peers(p.watch.clone());
        let master = match &p.master {
            Some(m) => {
                if self.fixed_store {
                    if let Some(store) = &self.store {
                        // torch's env:// keys carry no attempt prefix: the next attempt must
                        // not read the last one's.
                        let removed = store.clear();
                        info!(removed, "cleared the workers' store for the new attempt");
                    }
                }
                m.clone()
            }
            None => {
                // Standalone: a fresh store per attempt on loopback.
                self.store = None;
                let loopback = HostPort::new("127.0.0.1", 0).expect("a loopback address is a valid host");
                let store = start_store(&loopback, self.config.store_max_bytes).await?;
                let port = store.local_addr().port();
                self.store = Some(store);
                HostPort::new("127.0.0.1", port).expect("a loopback address is a valid host")
            }
        };
        log_round(&p, &master, self.ctx.log_root.path(), "starting workers");
        if !p.fingerprint_diff.is_empty() {
            warn!(
                round = p.round,
                "the nodes of this round differ in what must match (--fingerprint strict refuses such nodes):"
            );
            for l in &p.fingerprint_diff {
                warn!("  {l}");
            }
        }
        let specs = worker_specs(self.config, &p, &master, &self.view());
        // Before any worker runs: a warm one may ask for its state at once.
        self.ctx.progress.begin(p.round, p.rank_offset..p.rank_offset.saturating_add(self.config.nproc_per_node), 0);
        let io = self.group_io(p.restart_count)?;
        let group = WorkerGroup::start(
            &self.config.program,
            specs,
            self.ctx.agent_env,
            &io,
            self.ctx.host,
            self.ctx.containment.clone(),
            self.ctx.warm,
        )?;
        self.starter = Some(group.starter());
        // At once: a warm worker may say hello within milliseconds.
        if let Some(c) = &self.control {
            c.new_group(group.pids().into_iter().enumerate().map(|(i, pid)| (i as u32, pid)).collect());
        }
        self.watching_hangs = p.hang_timeout.is_some();
        let hang = p.hang_timeout.map(|timeout| {
            let (py_spy, refused) = hangwatch::find_py_spy(&self.config.program, self.ctx.agent_env);
            for why in refused {
                warn!(candidate = %why, "not running this py-spy");
            }
            match &py_spy {
                Some(path) => info!(%timeout, py_spy = %path.display(), "hang detection (--hang-timeout) reads Python stacks with py-spy"),
                None => warn!("py-spy not found (absolute RLAUNCH_PY_SPY, absolute PATH entries, beside the workers' Python): hang reports show kernel wait channels only"),
            }
            HangWatch { timeout, py_spy, nodes: p.group_world_size }
        });
        let steps = self.elastic.as_ref().map(|e| e.steps.clone());
        if let Some(s) = &steps {
            s.lock().unwrap_or_else(|p| p.into_inner()).clear(); // the last round's ranks
        }
        self.group = Some(supervise(group, self.config.job.stop_grace, self.tx.clone(), hang, steps));
        Ok(())
    }

    /// Hands the parked workers the placement's environment: the same processes run the
    /// program's function again, with exactly the environment a fresh worker would get; the
    /// workers at the local indices in `fresh` (their own rank failed) are started anew, warm
    /// where a warm interpreter waits.
    async fn resume_workers(&mut self, p: Placement, fresh: Vec<u32>) -> Result<(), AgentError> {
        self.watch_peers(p.watch.clone());
        let master = p.master.clone().expect("an elastic round names its workers' store");
        log_round(
            &p,
            &master,
            self.ctx.log_root.path(),
            "the workers keep their processes: resuming them in the new round",
        );
        let specs = worker_specs(self.config, &p, &master, &self.view());
        let (new, kept): (Vec<_>, Vec<_>) = specs.iter().partition(|s| fresh.contains(&s.env.local_rank));
        for spec in &kept {
            // Where the new round's error file and heartbeat go (the worker's output stays in
            // the files it was started with).
            if let Err(e) = self.ctx.log_root.create_dirs(&spec.dir) {
                warn!(path = %spec.dir.display(), error = %e, "cannot make a worker's directory for the new round");
            }
            if let Some(path) = &spec.heartbeat {
                if let Err(e) = hangwatch::create_heartbeat(self.ctx.log_root, path) {
                    warn!(path = %path.display(), error = %e, "cannot make a worker's heartbeat for the new round");
                }
            }
        }
        let nproc = self.config.nproc_per_node;
        let kept_count = u32::try_from(kept.len()).unwrap_or(u32::MAX);
        self.ctx.progress.begin(p.round, p.rank_offset..p.rank_offset.saturating_add(nproc), kept_count);
        let envs = kept.iter().map(|s| (s.env.local_rank, s.vars(self.ctx.agent_env))).collect();
        if let Some(control) = &self.control {
            control.resume(p.round, &envs);
        }
        let mut started = Vec::new();
        if !new.is_empty() {
            // What the failed workers left running (children in their cgroup or left over from
            // their process group) goes first: a new worker in the same cgroup would go with it.
            if let Some(reaped) = self.reaped.take() {
                let _ = tokio::time::timeout(Duration::from_secs(10), reaped).await;
            }
            let starter = self.starter.clone().expect("a resumed group was started");
            let io = self.group_io(p.restart_count)?;
            for spec in new {
                let index = spec.env.local_rank;
                info!(rank = spec.env.rank, local_rank = index, "starting a worker anew in place of the failed one");
                let worker = starter.start(
                    index as usize,
                    spec.clone(),
                    &self.config.program,
                    self.ctx.agent_env,
                    &io,
                    self.ctx.warm,
                );
                match worker {
                    Ok(worker) => {
                        if let Some(c) = &self.control {
                            c.add_worker(index, worker.pid());
                        }
                        started.push(worker);
                    }
                    Err(e) => {
                        // The run ends; those started for it never join the group.
                        for w in started {
                            w.kill();
                        }
                        return Err(e);
                    }
                }
            }
        }
        match &self.group {
            Some(_) => self.command(GroupCmd::Renumber { specs, fresh: started }),
            // No group to take them (cannot happen while workers are parked): not left running.
            None => started.into_iter().for_each(crate::workers::Fresh::kill),
        }
        Ok(())
    }

    /// What the pure worker specification reads of this node, with the agent's own variables.
    fn view(&self) -> crate::spec::NodeView<'_> {
        crate::spec::NodeView { agent_vars: &self.agent_vars, ..self.ctx.view() }
    }

    /// Warm workers for the round `p` gives (None: before any round), made as the round's
    /// workers are.
    fn fill_warm(&self, p: Option<&Placement>) {
        if let Some(pool) = self.ctx.warm {
            pool.fill(&warm_templates(self.config, p, &self.view()));
        }
    }

    /// Opens the round's snapshots as the core chose.
    fn begin_snapshots(&self, round: SnapshotRound) {
        let Some(snap) = self.ctx.snapshots.filter(|s| s.enabled()) else { return };
        match round {
            SnapshotRound::Peers { round, members } => {
                let e = self.elastic.as_ref().expect("a round with members comes only from an elastic core");
                snap.begin_peer_round(round, &e.node.node_id, &members)
            }
            SnapshotRound::Local { round, world_size, ranks } => snap.begin_local_round(round, world_size, ranks),
        }
    }

    /// The console, stdin and this attempt's duplicate filters (torchrun keeps one filtered log
    /// per attempt: `attempt_{n}/filtered_stdout.log`).
    fn group_io(&self, attempt: u32) -> Result<GroupIo, AgentError> {
        let root = self.ctx.log_root;
        let dir = root.path().join(format!("attempt_{attempt}"));
        let open = |needles: &[String], name: &str| {
            let path = dir.join(name);
            DupFilter::open(needles, root, path.clone()).map_err(|source| AgentError::LogDir { path, source })
        };
        let dup = [
            open(&self.config.duplicate_stdout_filters, "filtered_stdout.log")?,
            open(&self.config.duplicate_stderr_filters, "filtered_stderr.log")?,
        ];
        Ok(GroupIo {
            console: self.ctx.console.clone(),
            stdin: self.ctx.stdin.router().cloned(),
            dup,
            log_root: root.clone(),
        })
    }

    fn send(&mut self, report: Report) {
        let (client, node) = self.client();
        let tx = self.tx.clone();
        if report == Report::Leave {
            // A join still waiting would register this node again after it left.
            if let Some(j) = self.join.take() {
                j.abort();
            }
        }
        self.calls.spawn(async move {
            let (kind, result) = match report {
                Report::Success { round } => (ReportKind::Success, client.report_success(&node.node_id, round).await),
                Report::Failure { round, mut root_cause } => {
                    // Dated by how long ago, so the rendezvous needs no agreement of clocks.
                    root_cause.seen_ago_ms =
                        root_cause.seen_at_ms.map(|at| crate::report::now_unix_ms().saturating_sub(at));
                    (ReportKind::Failure, client.report_failure(&node.node_id, round, root_cause).await)
                }
                Report::Leave => (ReportKind::Leave, client.leave(&node.node_id).await),
            };
            if let Err(e) = &result {
                warn!(error = %e, ?kind, "report not acknowledged");
            }
            let _ = tx.send(Event::Reported { kind, result: seen(result) });
        });
    }
}

#[cfg(test)]
mod tests {
    use crate::config::AgentConfig;
    use crate::core::RunOutcome;
    use rlaunch::contract::Exit;

    /// A standalone job of `nproc` shell workers; its logs stay in `dir`.
    fn job(script: &str, nproc: u32, max_restarts: u32, dir: &std::path::Path) -> AgentConfig {
        let mut config = AgentConfig::standalone(vec!["/bin/sh".into(), "-c".into(), script.into()], nproc);
        config.job.max_restarts = max_restarts;
        config.log_dir = Some(dir.join("logs"));
        config.snapshot_memory = 0;
        config
    }

    #[tokio::test]
    async fn a_standalone_job_runs_every_attempt_the_budget_allows_then_fails_with_the_workers_exit() {
        let dir = tempfile::tempdir().unwrap();
        let count = dir.path().join("attempts");
        let script = format!("echo $TORCHELASTIC_RESTART_COUNT >> {}; exit 7", count.display());
        let outcome = crate::run(job(&script, 1, 2, dir.path())).await.unwrap();
        let RunOutcome::Failed { root_cause, restarts } = outcome else { panic!("{outcome:?}") };
        assert_eq!((restarts, root_cause.exit), (2, Exit::Code(7)));
        assert_eq!(std::fs::read_to_string(&count).unwrap(), "0\n1\n2\n", "three attempts, numbered");
    }

    #[tokio::test]
    async fn a_standalone_job_whose_workers_all_succeed_succeeds_once() {
        let dir = tempfile::tempdir().unwrap();
        let count = dir.path().join("ranks");
        let script = format!("echo $RANK/$WORLD_SIZE >> {}", count.display());
        let outcome = crate::run(job(&script, 2, 3, dir.path())).await.unwrap();
        assert_eq!(outcome, RunOutcome::Succeeded { restarts: 0 });
        let mut ranks: Vec<String> = std::fs::read_to_string(&count).unwrap().lines().map(str::to_owned).collect();
        ranks.sort();
        assert_eq!(ranks, ["0/2", "1/2"]);
    }
}

//! The agent's core driven with made-up clocks through every fault: answers lost, duplicated,
//! reordered, delayed past the TTL, refused; the rendezvous gone and back; a signal at every
//! step. A small simulated world checks the invariants after every step.

use super::*;
use rlaunch::contract::{Exit, HostPort, Member};

/// A stop as every non-SIGINT cause sends it.
const STOP: Action = Action::StopWorkers { first: libc::SIGTERM };
const TTL: Duration = Duration::from_secs(2);
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// A call error as the client gives it: a transient one (the service busy).
fn transient(message: &str) -> CallError {
    CallError::Transient(Cause::new(rlaunch_rendezvous::RdzvError::Busy { message: message.into() }))
}

/// A refusal (a 4xx).
fn refused(message: &str) -> CallError {
    CallError::Refused(Cause::new(rlaunch_rendezvous::RdzvError::BadRequest { message: message.into() }))
}

fn elastic() -> Core {
    Core::new(Membership::Elastic { node_ttl: TTL, join_timeout: JOIN_TIMEOUT })
}

fn fixed(max_restarts: u32) -> Core {
    let placement = Placement {
        round: 1,
        group_rank: 0,
        group_world_size: 1,
        rank_offset: 0,
        world_size: 4,
        master: None,
        restart_count: 0,
        hang_timeout: None,
        fingerprint_diff: Vec::new(),
        members: Vec::new(),
        watch: None,
    };
    Core::new(Membership::Fixed { placement, max_restarts })
}

fn round(n: u64, restart_count: u32) -> RoundInfo {
    let addr: HostPort = "node0:1".parse().unwrap();
    RoundInfo {
        round: n,
        group_rank: 0,
        group_world_size: 1,
        members: vec![Member {
            node_id: "a".into(),
            group_rank: 0,
            local_world_size: 4,
            rank_offset: 0,
            store_addr: addr.clone(),
            probe_addr: None,
            snapshot_addr: None,
            snapshot_key: None,
            snapshots: Vec::new(),
        }],
        members_digest: String::new(),
        master_store_addr: addr,
        restart_count,
        max_restarts: 3,
        world_size: 4,
        rank_offset: 0,
        local_world_size: 4,
        hang_timeout: None,
        fingerprint_diff: Vec::new(),
        watch: None,
    }
}

/// Rank 1 failed with `code`, and `others` (ranks) with it.
fn failed_with_others(code: i32, others: &[u32]) -> WorkersEnd {
    let WorkersEnd::Failed(mut rc) = failure(code) else { unreachable!() };
    rc.other_failures = others
        .iter()
        .map(|r| rlaunch::contract::OtherFailure {
            rank: *r,
            local_rank: *r,
            pid: 40 + r,
            exit: Exit::Code(code),
            message: String::new(),
        })
        .collect();
    WorkersEnd::Failed(rc)
}

fn failure(code: i32) -> WorkersEnd {
    WorkersEnd::Failed(Box::new(RootCause {
        rank: 1,
        local_rank: 1,
        role: "default".into(),
        host: "node0".into(),
        pid: 42,
        exit: Exit::Code(code),
        timestamp: 0,
        restart_count: 0,
        message: "x".repeat(70_000),
        traceback: None,
        error_file: None,
        stderr_tail: vec!["y".repeat(70_000); 5],
        other_failures: Vec::new(),
        stacks: Vec::new(),
        seen_at_ms: None,
        seen_ago_ms: None,
    }))
}

/// The core plus a model of the world around it: which workers run, what is in flight.
struct Sim {
    core: Core,
    now: Millis,
    workers_alive: bool,
    /// A `StopWorkers` not yet answered by `WorkersStopped`.
    stop_pending: bool,
    /// A `Send(Leave)` not yet answered.
    leave_pending: bool,
    starts: usize,
    exit: Option<Outcome>,
    log: Vec<Action>,
}

impl Sim {
    fn new(core: Core) -> Sim {
        Sim {
            core,
            now: 0,
            workers_alive: false,
            stop_pending: false,
            leave_pending: false,
            starts: 0,
            exit: None,
            log: Vec::new(),
        }
    }

    /// Applies an event and checks the invariants; returns the actions.
    fn ev(&mut self, e: Event) -> Vec<Action> {
        match &e {
            Event::WorkersStopped => {
                self.workers_alive = false;
                self.stop_pending = false;
            }
            Event::Reported { kind: ReportKind::Leave, .. } => self.leave_pending = false,
            Event::WorkersEnded(WorkersEnd::Succeeded) => self.workers_alive = false,
            _ => {}
        }
        let ends_round = matches!(e, Event::WorkersStopped | Event::WorkersEnded(_)) && !self.core.is_done();
        let mut actions = self.core.step(e, self.now);
        // A round's end (its snapshots, its progress) comes first, once, for exactly these
        // events; the rest is what the scenarios look at.
        let round_ends = actions.iter().filter(|a| matches!(a, Action::EndRound { .. })).count();
        // Some workers failed and the others keep their processes: their round stays open.
        let kept = actions.iter().any(|a| matches!(a, Action::Park { failed, .. } if !failed.is_empty()));
        let ends_round = ends_round && !kept;
        assert_eq!(round_ends, usize::from(ends_round), "{actions:?}");
        if ends_round {
            assert!(matches!(actions.remove(0), Action::EndRound { .. }), "the round ends first");
        }
        for a in &actions {
            assert!(self.exit.is_none(), "nothing may follow Exit, got {a:?}");
            match a {
                Action::StartWorkers(_) => {
                    assert!(!self.workers_alive, "workers started while the previous ones may run: {:?}", self.log);
                    self.workers_alive = true;
                    self.starts += 1;
                }
                Action::StopWorkers { .. } => {
                    assert!(self.workers_alive, "stop without workers");
                    self.stop_pending = true;
                }
                Action::ShareStacks { .. } => assert!(self.workers_alive && !self.stop_pending, "stacks of no workers"),
                Action::Park { .. } | Action::Resume { .. } => {
                    assert!(
                        self.workers_alive && !self.stop_pending,
                        "parked or resumed workers that are gone: {:?}",
                        self.log
                    )
                }
                Action::Send(Report::Leave) => self.leave_pending = true,
                Action::Exit(o) => self.exit = Some(o.clone()),
                _ => {}
            }
        }
        self.log.extend(actions.iter().cloned());
        actions
    }

    fn at(&mut self, t: Millis) -> &mut Sim {
        assert!(t >= self.now, "time goes forward");
        self.now = t;
        self
    }

    fn tick(&mut self, t: Millis) -> Vec<Action> {
        self.at(t).ev(Event::Tick)
    }

    fn joined_running(&mut self, r: RoundInfo) {
        assert_eq!(self.ev(Event::Start), vec![Action::Join]);
        let n = r.round;
        let a = self.ev(Event::Joined(Ok(r)));
        assert!(
            matches!(a.as_slice(), [Action::StartWorkers(p), Action::Watch { round }] if p.round == n && *round == n),
            "{a:?}"
        );
    }
}

fn sends(actions: &[Action], kind: ReportKind) -> bool {
    actions.iter().any(|a| matches!(a, Action::Send(r) if r.kind() == kind))
}

#[test]
fn fixed_membership_restarts_within_its_budget_then_fails_with_the_workers_exit() {
    let mut s = Sim::new(fixed(1));
    let a = s.ev(Event::Start);
    assert!(matches!(&a[..], [Action::StartWorkers(p)] if p.restart_count == 0), "{a:?}");
    assert_eq!(s.ev(Event::WorkersEnded(failure(3))), vec![STOP]);
    let a = s.ev(Event::WorkersStopped);
    assert!(
        matches!(&a[..], [Action::Note(_), Action::StartWorkers(p)] if p.restart_count == 1 && p.round == 2),
        "{a:?}"
    );
    assert_eq!(s.ev(Event::WorkersEnded(failure(7))), vec![STOP]);
    let a = s.ev(Event::WorkersStopped);
    match &a[..] {
        [Action::Exit(Outcome::Run(RunOutcome::Failed { root_cause, restarts: 1 }))] => {
            assert_eq!(root_cause.exit, Exit::Code(7))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.starts, 2);
}

/// A worker's failure by `exit`.
fn failure_by(exit: Exit) -> Box<RootCause> {
    match failure(1) {
        WorkersEnd::Failed(rc) => Box::new(RootCause { exit, ..*rc }),
        _ => unreachable!(),
    }
}

#[test]
fn a_worker_killed_by_a_stop_signal_holds_the_restart_for_the_agents_own_signal() {
    // Slurm under proctrack/cgroup, systemd's control-group kill: every process of the job gets
    // SIGTERM, the workers a moment before the agent. No restart may start in between.
    let mut s = Sim::new(fixed(3));
    s.ev(Event::Start);
    let a = s.at(1_000).ev(Event::WorkersEnded(WorkersEnd::Failed(failure_by(Exit::Signal(libc::SIGTERM)))));
    assert_eq!(a, vec![STOP]);
    let a = s.at(1_010).ev(Event::WorkersStopped);
    assert!(matches!(&a[..], [Action::Note(n)] if n.contains("SIGTERM")), "held, not restarted: {a:?}");
    assert!(s.tick(1_400).is_empty(), "still held");
    // The agent's own SIGTERM arrives: the run ends as stopped by it, nothing restarted.
    let a = s.at(1_450).ev(Event::Signal(libc::SIGTERM));
    assert_eq!(a, vec![Action::Exit(Outcome::Run(RunOutcome::Interrupted { signal: libc::SIGTERM }))]);
    assert_eq!(s.starts, 1);

    // No signal follows (a worker killed by hand): the restart goes on after the hold.
    let mut s = Sim::new(fixed(3));
    s.ev(Event::Start);
    s.at(1_000).ev(Event::WorkersEnded(WorkersEnd::Failed(failure_by(Exit::Signal(libc::SIGTERM)))));
    s.at(1_010).ev(Event::WorkersStopped);
    assert!(s.tick(1_010 + 499).is_empty());
    let a = s.tick(1_010 + ms(STOP_SIGNAL_HOLD));
    assert!(matches!(&a[..], [Action::Note(_), Action::StartWorkers(p)] if p.restart_count == 1), "{a:?}");
    assert_eq!(s.starts, 2);

    // Elastic: the failure report waits the same way; the signal makes the node leave instead.
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::WorkersEnded(WorkersEnd::Failed(failure_by(Exit::Signal(libc::SIGINT)))));
    let a = s.ev(Event::WorkersStopped);
    assert!(!sends(&a, ReportKind::Failure), "the failure report is held: {a:?}");
    let a = s.ev(Event::Signal(libc::SIGTERM));
    assert!(sends(&a, ReportKind::Leave) && !sends(&a, ReportKind::Failure), "{a:?}");
}

#[test]
fn other_failures_restart_at_once() {
    for end in [
        failure(1),
        WorkersEnd::Failed(failure_by(Exit::Signal(libc::SIGKILL))),
        WorkersEnd::Failed(failure_by(Exit::Signal(libc::SIGSEGV))),
        // A hang verdict's cause says SIGTERM (the agent's own stop): no hold.
        WorkersEnd::Hung(failure_by(Exit::Signal(libc::SIGTERM))),
    ] {
        let mut s = Sim::new(fixed(3));
        s.ev(Event::Start);
        s.ev(Event::WorkersEnded(end));
        let a = s.ev(Event::WorkersStopped);
        assert!(matches!(&a[..], [Action::Note(_), Action::StartWorkers(_)]), "{a:?}");
    }
}

#[test]
fn fixed_membership_succeeds_and_relays_and_stops_on_signals() {
    let mut s = Sim::new(fixed(0));
    s.ev(Event::Start);
    assert_eq!(s.ev(Event::Signal(libc::SIGUSR1)), vec![Action::Relay(libc::SIGUSR1)]);
    assert_eq!(
        s.ev(Event::WorkersEnded(WorkersEnd::Succeeded)),
        vec![Action::Exit(Outcome::Run(RunOutcome::Succeeded { restarts: 0 }))]
    );

    let mut s = Sim::new(fixed(3));
    s.ev(Event::Start);
    assert_eq!(
        s.ev(Event::Signal(libc::SIGINT)),
        vec![Action::StopWorkers { first: libc::SIGINT }],
        "Ctrl-C goes on as Ctrl-C"
    );
    // A worker failing while the stop is under way does not turn it into a restart.
    assert!(s.ev(Event::WorkersEnded(failure(1))).is_empty());
    assert_eq!(
        s.ev(Event::WorkersStopped),
        vec![Action::Exit(Outcome::Run(RunOutcome::Interrupted { signal: libc::SIGINT }))]
    );
    assert_eq!(s.starts, 1);
}

#[test]
fn handled_signals_reach_the_workers_first_and_unhandled_ones_still_stop_or_relay() {
    // torchrun's --signals-to-handle SIGTERM,SIGUSR1: SIGUSR1 now stops the job (Slurm's warning
    // before its time limit), forwarded to the workers as itself.
    let handled = [libc::SIGTERM, libc::SIGUSR1];
    let mut s = Sim::new(fixed(3).with_handled_signals(&handled));
    s.ev(Event::Start);
    assert_eq!(s.ev(Event::Signal(libc::SIGUSR1)), vec![Action::StopWorkers { first: libc::SIGUSR1 }]);
    // A second signal during the stop changes neither the stop nor its first signal.
    assert!(s.ev(Event::Signal(libc::SIGTERM)).is_empty());
    assert_eq!(
        s.ev(Event::WorkersStopped),
        vec![Action::Exit(Outcome::Run(RunOutcome::Interrupted { signal: libc::SIGTERM }))]
    );

    // SIGINT is not listed: it still stops the job (nothing is left running), with SIGTERM.
    let mut s = Sim::new(fixed(3).with_handled_signals(&handled));
    s.ev(Event::Start);
    assert_eq!(s.ev(Event::Signal(libc::SIGINT)), vec![STOP]);
    // SIGUSR2 is not listed: relayed, the job goes on.
    let mut s = Sim::new(fixed(3).with_handled_signals(&handled));
    s.ev(Event::Start);
    assert_eq!(s.ev(Event::Signal(libc::SIGUSR2)), vec![Action::Relay(libc::SIGUSR2)]);
    // By default SIGHUP reaches the workers as SIGHUP, as torchrun forwards it.
    let mut s = Sim::new(fixed(3));
    s.ev(Event::Start);
    assert_eq!(s.ev(Event::Signal(libc::SIGHUP)), vec![Action::StopWorkers { first: libc::SIGHUP }]);
}

#[test]
fn elastic_happy_path_reports_success_and_ends_when_the_job_finishes() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    assert_eq!(s.ev(Event::Watched { round: 1, answer: Ok(Watch::NoChange) }), vec![Action::Watch { round: 1 }]);
    let a = s.ev(Event::WorkersEnded(WorkersEnd::Succeeded));
    assert_eq!(a, vec![Action::Send(Report::Success { round: 1 })]);
    assert!(s.ev(Event::Reported { kind: ReportKind::Success, result: Ok(()) }).is_empty());
    assert_eq!(
        s.ev(Event::Watched { round: 1, answer: Ok(Watch::Finished) }),
        vec![Action::Exit(Outcome::Run(RunOutcome::Succeeded { restarts: 0 }))]
    );
}

/// Scenario 1 of the issue: a refused failure report (413) is never taken as sent.
#[test]
fn a_refused_failure_report_ends_the_run_with_the_workers_exit_and_one_start() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    assert_eq!(s.ev(Event::WorkersEnded(failure(3))), vec![STOP]);
    let a = s.ev(Event::WorkersStopped);
    let [Action::Send(Report::Failure { round: 1, root_cause })] = &a[..] else { panic!("{a:?}") };
    // What goes on the wire is bounded, whatever the worker wrote.
    assert!(serde_json::to_vec(root_cause).unwrap().len() <= rlaunch::contract::caps::WIRE_BYTES);
    // The round goes on without us meanwhile (our own report opened it): no restart yet.
    assert!(s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) }).is_empty());
    let a = s.at(100).ev(Event::Reported { kind: ReportKind::Failure, result: Err(refused("413 payload too large")) });
    assert!(
        matches!(a.last(), Some(Action::Exit(Outcome::Run(RunOutcome::Failed { root_cause, .. }))) if root_cause.exit == Exit::Code(3)),
        "{a:?}"
    );
    assert_eq!(s.starts, 1);
    assert!(s.tick(10_000).is_empty(), "nothing after the exit");
}

#[test]
fn an_acknowledged_failure_report_rejoins_and_the_next_round_restarts_the_workers() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::WorkersEnded(failure(3)));
    s.ev(Event::WorkersStopped);
    // The reply was lost: the report goes again after a backoff, and again...
    assert!(s.at(10).ev(Event::Reported { kind: ReportKind::Failure, result: Err(transient("reset")) }).is_empty());
    assert!(s.tick(100).is_empty(), "not before the backoff");
    assert!(sends(&s.tick(250), ReportKind::Failure));
    // ...and the repeat is acknowledged (the service takes it as the same report).
    assert_eq!(s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) }), vec![Action::Join]);
    // A duplicated acknowledgement changes nothing.
    assert!(s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) }).is_empty());
    let a = s.ev(Event::Joined(Ok(round(2, 1))));
    assert!(matches!(&a[..], [Action::StartWorkers(p), Action::Watch { round: 2 }] if p.restart_count == 1));
    assert_eq!(s.starts, 2);
}

#[test]
fn a_failure_report_answered_not_member_rejoins_without_spending_the_budget() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::WorkersEnded(failure(3)));
    s.ev(Event::WorkersStopped);
    assert_eq!(
        s.ev(Event::Reported { kind: ReportKind::Failure, result: Err(CallError::NotMember) }),
        vec![Action::Join]
    );
}

#[test]
fn a_failure_report_that_never_arrives_ends_with_the_local_failure_after_the_join_timeout() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::WorkersEnded(failure(9)));
    s.ev(Event::WorkersStopped);
    let mut t = 0;
    loop {
        t += 500;
        let a = s.at(t).ev(Event::Reported { kind: ReportKind::Failure, result: Err(transient("down")) });
        if let Some(Action::Exit(o)) = a.last() {
            assert!(
                matches!(o, Outcome::Run(RunOutcome::Failed { root_cause, .. }) if root_cause.exit == Exit::Code(9)),
                "{o:?}"
            );
            break;
        }
        assert!(sends(&s.tick(t + 2_000), ReportKind::Failure), "sent again after the backoff");
        t += 2_000;
        assert!(t < ms(JOIN_TIMEOUT) + 5_000, "gives up around the join timeout");
    }
    assert!(t >= ms(JOIN_TIMEOUT), "not before the join timeout: {t}");
    assert_eq!(s.starts, 1);
}

/// Scenario 2 of the issue: the success report fails once; it is sent again until taken.
#[test]
fn a_success_report_that_failed_once_is_sent_again_and_the_job_ends() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::WorkersEnded(WorkersEnd::Succeeded));
    assert!(s.at(5).ev(Event::Reported { kind: ReportKind::Success, result: Err(transient("refused")) }).is_empty());
    // The watch also fails while the replica restarts: retried, no exit.
    assert!(s.ev(Event::Watched { round: 1, answer: Err(transient("refused")) }).is_empty());
    let a = s.tick(400);
    assert!(sends(&a, ReportKind::Success) && a.contains(&Action::Watch { round: 1 }), "{a:?}");
    assert!(s.ev(Event::Reported { kind: ReportKind::Success, result: Ok(()) }).is_empty());
    let a = s.ev(Event::Watched { round: 1, answer: Ok(Watch::Finished) });
    assert_eq!(a, vec![Action::Exit(Outcome::Run(RunOutcome::Succeeded { restarts: 0 }))]);
}

#[test]
fn after_an_acknowledged_success_a_vanished_rendezvous_ends_the_run_successfully() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::WorkersEnded(WorkersEnd::Succeeded));
    s.ev(Event::Reported { kind: ReportKind::Success, result: Ok(()) });
    let gone = || Event::Watched { round: 1, answer: Err(transient("refused")) };
    let mut t = 1_000;
    while t < 10_900 {
        assert!(s.at(t).ev(gone()).is_empty(), "still waiting at {t}");
        s.tick(t + 300);
        t += 400;
    }
    let a = s.at(11_500).ev(gone());
    assert!(matches!(a.last(), Some(Action::Exit(Outcome::Run(RunOutcome::Succeeded { .. })))), "{a:?}");
}

#[test]
fn a_success_report_never_taken_is_the_agents_failure_not_a_hang() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::WorkersEnded(WorkersEnd::Succeeded));
    let a = s.at(5).ev(Event::Reported { kind: ReportKind::Success, result: Err(refused("400")) });
    assert!(matches!(a.last(), Some(Action::Exit(Outcome::Rendezvous { .. }))), "{a:?}");
}

#[test]
fn a_new_round_stops_the_workers_before_rejoining_and_stale_answers_are_ignored() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    // Where the workers stood is taken before they are stopped.
    assert_eq!(
        s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) })[1..],
        [Action::ShareStacks { round: 1 }, STOP]
    );
    // Reordered: an older watch answer, a worker exit while stopping, a duplicate new round.
    assert!(s.ev(Event::Watched { round: 1, answer: Ok(Watch::NoChange) }).is_empty());
    assert!(s.ev(Event::WorkersEnded(failure(143))).is_empty());
    assert!(s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) }).is_empty());
    assert_eq!(s.ev(Event::WorkersStopped), vec![Action::Join]);
    // A duplicated join answer starts nothing twice.
    let a = s.ev(Event::Joined(Ok(round(2, 0))));
    assert!(matches!(a[0], Action::StartWorkers(_)));
    assert!(s.ev(Event::Joined(Ok(round(2, 0)))).is_empty());
    assert_eq!(s.starts, 2);
}

#[test]
fn a_node_cut_off_past_the_ttl_fences_itself_and_rejoins() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    let down = || Event::Heartbeat(Err(transient("timeout")));
    s.at(500).ev(Event::Heartbeat(Ok(())));
    for t in (1_000..=4_500).step_by(500) {
        s.at(t).ev(down());
        assert!(s.tick(t).is_empty(), "not fenced at {t} (TTL 2 s + 2 s allowance)");
    }
    let a = s.tick(4_600);
    assert!(matches!(&a[..], [Action::Note(_), STOP]), "{a:?}");
    assert_eq!(s.ev(Event::WorkersStopped), vec![Action::Join]);
}

#[test]
fn a_node_declared_lost_stops_its_workers_and_rejoins() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    // An answer to a heartbeat sent before the join registered: the watch decides instead.
    assert!(s.at(300).ev(Event::Heartbeat(Err(CallError::NotMember))).is_empty());
    let a = s.at(2_500).ev(Event::Heartbeat(Err(CallError::NotMember)));
    assert_eq!(a.last(), Some(&STOP));
    assert_eq!(s.ev(Event::WorkersStopped), vec![Action::Join]);
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    let a = s.ev(Event::Watched { round: 1, answer: Err(CallError::NotMember) });
    assert_eq!(a.last(), Some(&STOP));
}

#[test]
fn a_rendezvous_gone_for_a_while_and_back_is_joined_and_gone_for_the_join_timeout_ends_the_run() {
    let mut s = Sim::new(elastic());
    s.ev(Event::Start);
    let down = || Event::Joined(Err(transient("connection refused")));
    let mut t = 0;
    while t < 20_000 {
        let a = s.at(t).ev(down());
        assert!(matches!(&a[..], [Action::Note(_)]), "{a:?}");
        assert!(s.tick(t + 100).is_empty(), "waits before joining again");
        assert_eq!(s.tick(t + 400), vec![Action::Join]);
        t += 1_000;
    }
    let a = s.at(t).ev(Event::Joined(Ok(round(1, 0))));
    assert!(matches!(a[0], Action::StartWorkers(_)));

    let mut s = Sim::new(elastic());
    s.ev(Event::Start);
    let mut t = 0;
    loop {
        let a = s.at(t).ev(down());
        if let Some(Action::Exit(o)) = a.last() {
            assert!(
                matches!(o, Outcome::Rendezvous { message, source: Some(c) } if message.contains("join timeout") && c.to_string().contains("connection refused")),
                "the last transient error is the outcome's cause: {o:?}"
            );
            break;
        }
        s.tick(t + 400);
        t += 1_000;
    }
    assert_eq!(t, ms(JOIN_TIMEOUT));
}

#[test]
fn a_job_that_failed_ends_with_the_rendezvous_root_cause_else_the_local_one() {
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 2));
    let a = s.ev(Event::Watched { round: 1, answer: Ok(Watch::Failed("budget spent".into())) });
    assert_eq!(a, vec![Action::ShareStacks { round: 1 }, STOP]);
    assert_eq!(s.ev(Event::WorkersStopped), vec![Action::FetchRootCause]);
    let WorkersEnd::Failed(remote) = failure(7) else { unreachable!() };
    let a = s.ev(Event::RootCauseFetched(Some(remote.clone()), Some(1)));
    assert_eq!(a, vec![Action::Exit(Outcome::Run(RunOutcome::Failed { root_cause: remote, restarts: 2 }))]);

    // The rendezvous lost it: this node's own failure is the report.
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::WorkersEnded(failure(5)));
    s.ev(Event::WorkersStopped);
    assert_eq!(
        s.ev(Event::Reported { kind: ReportKind::Failure, result: Err(CallError::JobFailed("spent".into())) }),
        vec![Action::FetchRootCause]
    );
    let a = s.ev(Event::RootCauseFetched(None, None));
    assert!(
        matches!(&a[..], [Action::Exit(Outcome::Run(RunOutcome::Failed { root_cause, .. }))] if root_cause.exit == Exit::Code(5))
    );
}

#[test]
fn a_join_refused_or_a_finished_job_ends_the_run() {
    let mut s = Sim::new(elastic());
    s.ev(Event::Start);
    let a = s.ev(Event::Joined(Err(refused("settings differ"))));
    assert!(
        matches!(&a[..], [Action::Exit(Outcome::Rendezvous { message, source: Some(c) })] if message.contains("settings differ") && *c == match refused("settings differ") { CallError::Refused(c) => c, _ => unreachable!() })
    );
    // A job over before this node ever ran in it is another run's: an error, never a success.
    for over in [CallError::JobFinished, CallError::JobFailed("spent".into())] {
        let mut s = Sim::new(elastic());
        s.ev(Event::Start);
        let a = s.ev(Event::Joined(Err(over)));
        assert!(
            matches!(&a[..], [Action::Exit(Outcome::Rendezvous { message, source: None })] if message.contains("its own --rdzv-id")),
            "{a:?}"
        );
    }
    // After it ran in the job, the job finishing is this node's success.
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    s.ev(Event::WorkersStopped);
    assert_eq!(
        s.ev(Event::Joined(Err(CallError::JobFinished))),
        vec![Action::Exit(Outcome::Run(RunOutcome::Succeeded { restarts: 0 }))]
    );
}

/// The normal life of an elastic node, as the events a driver would feed back.
fn elastic_script() -> Vec<(Millis, Event)> {
    vec![
        (0, Event::Start),
        (100, Event::Joined(Ok(round(1, 0)))),
        (200, Event::Heartbeat(Ok(()))),
        (300, Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) }),
        (400, Event::WorkersStopped),
        (500, Event::Joined(Ok(round(2, 0)))),
        (600, Event::WorkersEnded(failure(3))),
        (700, Event::WorkersStopped),
        (800, Event::Reported { kind: ReportKind::Failure, result: Ok(()) }),
        (900, Event::Joined(Ok(round(3, 1)))),
        (1_000, Event::WorkersEnded(WorkersEnd::Succeeded)),
        (1_100, Event::Reported { kind: ReportKind::Success, result: Ok(()) }),
        (1_200, Event::Watched { round: 3, answer: Ok(Watch::Finished) }),
    ]
}

#[test]
fn the_unsignalled_script_finishes() {
    let mut s = Sim::new(elastic());
    for (t, e) in elastic_script() {
        s.at(t).ev(e);
    }
    assert_eq!(s.exit, Some(Outcome::Run(RunOutcome::Succeeded { restarts: 1 })));
    assert_eq!(s.starts, 3);
}

/// SIGTERM after every prefix of the script: the node stops what runs, leaves, and ends
/// interrupted; no worker starts after the signal; answers still arriving change nothing.
#[test]
fn a_stop_signal_at_every_step_stops_leaves_and_ends_interrupted() {
    let script = elastic_script();
    for cut in 1..script.len() {
        let mut s = Sim::new(elastic());
        for (t, e) in script[..cut].iter().cloned() {
            s.at(t).ev(e);
        }
        if s.exit.is_some() {
            continue;
        }
        let starts = s.starts;
        s.at(5_000).ev(Event::Signal(libc::SIGTERM));
        // Late answers of the script still arrive (what they answer may never come back).
        for (_, late) in script[cut..].iter().cloned() {
            if !matches!(late, Event::WorkersStopped) {
                s.ev(late);
            }
        }
        // The world answers what is outstanding, the way a driver would.
        for _ in 0..4 {
            if s.stop_pending {
                s.ev(Event::WorkersStopped);
            }
            if s.leave_pending {
                s.ev(Event::Reported { kind: ReportKind::Leave, result: Ok(()) });
            }
        }
        assert_eq!(
            s.exit,
            Some(Outcome::Run(RunOutcome::Interrupted { signal: libc::SIGTERM })),
            "signal after step {cut}: {:?}",
            s.log
        );
        assert_eq!(s.starts, starts, "no start after the signal (step {cut})");
        assert!(!s.workers_alive, "nothing left running (step {cut})");
    }
}

/// A relay signal at every step never changes the course of the run.
#[test]
fn a_relay_signal_at_every_step_changes_nothing() {
    let script = elastic_script();
    for cut in 0..script.len() {
        let mut s = Sim::new(elastic());
        for (i, (t, e)) in script.iter().cloned().enumerate() {
            if i == cut {
                let a = s.at(t).ev(Event::Signal(libc::SIGUSR1));
                assert!(a.iter().all(|a| *a == Action::Relay(libc::SIGUSR1)), "{a:?}");
            }
            s.at(t).ev(e);
        }
        assert_eq!(s.exit, Some(Outcome::Run(RunOutcome::Succeeded { restarts: 1 })), "relay at step {cut}");
    }
}

#[test]
fn leaving_gives_up_after_the_ttl_and_still_ends_interrupted() {
    let mut s = Sim::new(elastic());
    s.ev(Event::Start);
    assert!(sends(&s.at(10).ev(Event::Signal(libc::SIGHUP)), ReportKind::Leave));
    // The join that was in flight answers: ignored, no workers start.
    assert!(s.ev(Event::Joined(Ok(round(1, 0)))).is_empty());
    let mut t = 10;
    loop {
        t += 300;
        let a = s.at(t).ev(Event::Reported { kind: ReportKind::Leave, result: Err(transient("x")) });
        if let Some(Action::Exit(o)) = a.last() {
            assert_eq!(*o, Outcome::Run(RunOutcome::Interrupted { signal: libc::SIGHUP }));
            break;
        }
        s.tick(t + 2_000);
        t += 2_000;
        assert!(t < 10_000, "bounded by the TTL");
    }
    assert_eq!(s.starts, 0);
}

// --- A hang in a job of several nodes: announced before anything is stopped ---

fn two_nodes(n: u64) -> RoundInfo {
    RoundInfo { group_world_size: 2, world_size: 8, ..round(n, 0) }
}

fn hung() -> WorkersEnd {
    let WorkersEnd::Failed(rc) = failure(143) else { unreachable!() };
    WorkersEnd::Hung(rc)
}

fn with_stack_lines(lines: &[&str]) -> Option<Box<RootCause>> {
    let WorkersEnd::Failed(mut rc) = failure(143) else { unreachable!() };
    rc.stacks = lines.iter().map(|s| s.to_string()).collect();
    Some(rc)
}

#[test]
fn a_hang_among_several_nodes_is_announced_first_and_stopped_once_every_rank_stack_is_in() {
    let mut s = Sim::new(elastic());
    s.joined_running(two_nodes(1));
    let a = s.at(1000).ev(Event::WorkersEnded(hung()));
    assert!(matches!(&a[..], [Action::Send(Report::Failure { round: 1, .. })]), "announced, nothing stopped: {a:?}");
    assert!(s.workers_alive);
    // The announcement's answer is not what decides (the report after the stop is).
    assert!(s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) }).is_empty());
    // The watch answering the round this node ended changes nothing while it lingers.
    assert!(s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) }).is_empty());
    assert!(s.tick(1400).is_empty());
    assert_eq!(s.tick(1500), vec![Action::FetchRootCause]);
    assert!(s.tick(1600).is_empty(), "one fetch at a time");
    // Half the ranks' stacks in: wait for the rest.
    assert!(s
        .ev(Event::RootCauseFetched(
            with_stack_lines(&["rank 5: f (a.py:1)", "ranks 4, 6-7: all_reduce (c.py:2)"]),
            Some(1)
        ))
        .is_empty());
    assert_eq!(s.tick(2100), vec![Action::FetchRootCause]);
    let all = with_stack_lines(&["rank 5: f (a.py:1)", "ranks 0-4, 6-7: all_reduce (c.py:2)"]);
    // An earlier round's report naming every rank is not this one's.
    assert!(s.ev(Event::RootCauseFetched(all.clone(), Some(0))).is_empty());
    assert_eq!(s.tick(2600), vec![Action::FetchRootCause]);
    assert_eq!(s.ev(Event::RootCauseFetched(all, Some(1))), vec![STOP]);
    // Then as any failure: reported (in the outbox) after the stop, rejoined once acknowledged.
    let a = s.ev(Event::WorkersStopped);
    assert!(sends(&a, ReportKind::Failure), "{a:?}");
    assert_eq!(s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) }), vec![Action::Join]);
}

#[test]
fn a_lingering_hang_stops_at_its_bound_or_at_a_signal() {
    let mut s = Sim::new(elastic());
    s.joined_running(two_nodes(1));
    s.at(0).ev(Event::WorkersEnded(hung()));
    let mut t = 0;
    let mut last = Vec::new();
    while t < ms(HANG_LINGER) {
        t += 100;
        last = s.tick(t);
        if last.contains(&Action::FetchRootCause) {
            s.ev(Event::RootCauseFetched(None, None));
        }
    }
    assert!(matches!(&last[..], [Action::Note(_), STOP]), "{last:?}");

    let mut s = Sim::new(elastic());
    s.joined_running(two_nodes(1));
    s.at(0).ev(Event::WorkersEnded(hung()));
    assert_eq!(s.at(200).ev(Event::Signal(libc::SIGTERM)), vec![STOP]);
    assert!(s.ev(Event::WorkersStopped).iter().any(|a| matches!(a, Action::Send(Report::Leave))));
}

#[test]
fn a_hang_alone_is_a_failure_like_any_other() {
    // One node of an elastic job, and a fixed membership: nobody else's stacks to wait for.
    let mut s = Sim::new(elastic());
    s.joined_running(round(1, 0));
    assert_eq!(s.ev(Event::WorkersEnded(hung())), vec![STOP]);
    let mut s = Sim::new(fixed(1));
    s.ev(Event::Start);
    assert_eq!(s.ev(Event::WorkersEnded(hung())), vec![STOP]);
}

#[test]
fn stacks_are_shared_only_for_a_round_that_ended_by_a_failure_or_when_the_rendezvous_cannot_say() {
    assert!(stacks_worth_sharing(4, Some(Some(4))), "round 4 failed");
    assert!(!stacks_worth_sharing(4, Some(Some(3))), "an earlier failure: round 4 ended otherwise");
    assert!(!stacks_worth_sharing(4, Some(None)), "no failure at all: a node lost or a scale-up");
    assert!(stacks_worth_sharing(4, None), "the rendezvous did not answer");
}

// --- What the driver once decided inline: snapshots, the round's end, warm refills ---

const FEATURES: Features = Features { snapshots: true, warm_workers: true, local_world_size: 4 };

#[test]
fn a_round_keeps_snapshots_with_its_members_only_when_elastic_with_several_nodes_and_a_member_list() {
    let p = Placement::from_round(&two_nodes(3));
    let (with_members, note) = snapshot_round(&p, true, 4);
    assert_eq!(with_members, SnapshotRound::Peers { round: 3, members: p.members.clone() });
    assert_eq!(note, None);
    // Static (not elastic), two nodes: local, and said.
    let (local, note) = snapshot_round(&p, false, 4);
    assert_eq!(local, SnapshotRound::Local { round: 3, world_size: 8, ranks: 0..4 });
    assert!(note.is_some_and(|n| n.contains("no snapshots in round 3 of 2 nodes")));
    // Elastic, two nodes, no member list (a round over the snapshot limit, an older service).
    let bare = Placement { members: Vec::new(), rank_offset: 4, ..p.clone() };
    let (local, note) = snapshot_round(&bare, true, 4);
    assert_eq!(local, SnapshotRound::Local { round: 3, world_size: 8, ranks: 4..8 });
    assert!(note.is_some());
    // One node: local, nothing to say.
    let alone = Placement::from_round(&round(1, 0));
    assert_eq!(snapshot_round(&alone, true, 4), (SnapshotRound::Local { round: 1, world_size: 4, ranks: 0..4 }, None));
}

#[test]
fn snapshots_are_opened_right_before_every_start_and_only_when_on() {
    let mut s = Sim::new(elastic().with_features(FEATURES));
    assert_eq!(s.ev(Event::Start), vec![Action::Join]);
    let a = s.ev(Event::Joined(Ok(two_nodes(1))));
    assert!(
        matches!(a.as_slice(), [Action::BeginSnapshots(SnapshotRound::Peers { round: 1, .. }), Action::StartWorkers(p), Action::Watch { round: 1 }] if p.round == 1),
        "{a:?}"
    );
    let mut fixed_on = Sim::new(fixed(1).with_features(FEATURES));
    let a = fixed_on.ev(Event::Start);
    assert!(
        matches!(
            a.as_slice(),
            [Action::BeginSnapshots(SnapshotRound::Local { round: 1, .. }), Action::StartWorkers(_)]
        ),
        "{a:?}"
    );
    let mut off = Sim::new(fixed(1).with_features(Features { snapshots: false, ..FEATURES }));
    assert!(matches!(off.ev(Event::Start).as_slice(), [Action::StartWorkers(_)]));
}

#[test]
fn a_rounds_end_comes_first_for_its_workers_end_and_flushes_the_console_only_after_a_stop() {
    let mut core = fixed(1).with_features(FEATURES);
    core.step(Event::Start, 0);
    let a = core.step(Event::WorkersEnded(failure(3)), 10);
    assert_eq!(a.first(), Some(&Action::EndRound { flush_console: false }), "{a:?}");
    let a = core.step(Event::WorkersStopped, 20);
    assert_eq!(a.first(), Some(&Action::EndRound { flush_console: true }), "{a:?}");
    assert!(a.iter().any(|x| matches!(x, Action::StartWorkers(_))), "restarted within the budget: {a:?}");
    // Nothing else ends a round.
    assert!(!core.step(Event::Tick, 30).iter().any(|x| matches!(x, Action::EndRound { .. })));
}

#[test]
fn warm_workers_are_refilled_once_at_the_deadline_the_core_set_at_each_start_and_never_after_the_end() {
    let after = ms(REFILL_AFTER);
    let fills = |a: &[Action]| a.iter().filter(|x| matches!(x, Action::FillWarm(_))).count();
    let mut s = Sim::new(fixed(1).with_features(FEATURES));
    s.ev(Event::Start);
    assert_eq!(fills(&s.tick(after - 1)), 0, "not before the deadline");
    let a = s.tick(after + 50);
    assert!(matches!(a.as_slice(), [Action::FillWarm(p)] if p.round == 1), "{a:?}");
    assert_eq!(fills(&s.tick(after + 150)), 0, "once");
    // A restart sets a new deadline, from its own start; any event past it fills, not only a tick.
    s.at(5_000).ev(Event::WorkersEnded(failure(1)));
    s.at(5_010).ev(Event::WorkersStopped);
    assert_eq!(fills(&s.tick(5_010 + after - 1)), 0);
    assert_eq!(fills(&s.at(5_010 + after).ev(Event::Signal(libc::SIGUSR1))), 1);
    // Warm workers off: never.
    let mut off = Sim::new(fixed(1).with_features(Features { warm_workers: false, ..FEATURES }));
    off.ev(Event::Start);
    assert_eq!(fills(&off.tick(10 * after)), 0);
    // A stop signal before the deadline: the agent is leaving, nothing is refilled.
    let mut leaving = Sim::new(fixed(3).with_features(FEATURES));
    leaving.ev(Event::Start);
    leaving.at(100).ev(Event::Signal(libc::SIGTERM));
    assert_eq!(fills(&leaving.tick(after + 10)), 0, "no refill on the way out");
    // A run that ends before the deadline fills nothing after its Exit (the Sim checks it).
    let mut ended = Sim::new(fixed(0).with_features(FEATURES));
    ended.ev(Event::Start);
    ended.at(after + 10).ev(Event::WorkersEnded(WorkersEnd::Succeeded));
    assert!(ended.exit.is_some());
}

/// An elastic core whose two local workers opted in to keeping their process.
fn resilient(opted_in: u32) -> Sim {
    let mut s = Sim::new(elastic().with_features(Features { local_world_size: 2, ..Features::default() }));
    s.joined_running(round(1, 0));
    assert!(s.ev(Event::OptedIn((0..opted_in).collect())).is_empty());
    s
}

#[test]
fn workers_that_all_opted_in_are_parked_at_a_new_round_and_resumed_in_it_never_stopped() {
    let mut s = resilient(2);
    let a = s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    // Where they stood goes first (a hang report elsewhere waits for every rank's stack).
    assert!(
        matches!(&a[..], [Action::Note(_), Action::ShareStacks { round: 1 }, Action::Park { round: 1, hosts, failed }]
            if hosts == &["node0".to_string()] && failed.is_empty()),
        "{a:?}"
    );
    // Nothing happens until they parked (a tick before the bound, stale answers).
    assert!(s.tick(5_000).is_empty());
    assert!(s.ev(Event::Watched { round: 1, answer: Ok(Watch::NoChange) }).is_empty());
    assert_eq!(s.ev(Event::WorkersParked), vec![Action::Join]);
    let a = s.ev(Event::Joined(Ok(round(2, 0))));
    assert!(
        matches!(&a[..], [Action::Resume { placement, fresh }, Action::Watch { round: 2 }]
            if placement.round == 2 && fresh.is_empty()),
        "{a:?}"
    );
    assert!(!s.log.contains(&STOP), "no stop: {:?}", s.log);
    assert_eq!(s.starts, 1);
    // They stay opted in: the next re-form parks them again; declared lost likewise.
    let a = s.ev(Event::Watched { round: 2, answer: Err(CallError::NotMember) });
    assert!(matches!(&a[..], [Action::Note(_), Action::Park { round: 2, .. }]), "{a:?}");
}

#[test]
fn a_node_whose_workers_did_not_all_opt_in_stops_them_as_before() {
    let mut s = resilient(1);
    let a = s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    assert_eq!(a[1..], [Action::ShareStacks { round: 1 }, STOP]);
    // Workers started anew opt in anew: a stale count from the last group does not carry over.
    // (Both failed: none is left to keep its process.)
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failed_with_others(1, &[0])));
    s.ev(Event::WorkersStopped);
    s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) });
    let a = s.ev(Event::Joined(Ok(round(2, 1))));
    assert!(matches!(a[0], Action::StartWorkers(_)), "{a:?}");
    let a = s.ev(Event::Watched { round: 2, answer: Ok(Watch::NewRound(3)) });
    assert!(a.contains(&STOP), "{a:?}");
}

#[test]
fn workers_that_do_not_park_in_time_are_stopped_and_the_node_rejoins() {
    let mut s = resilient(2);
    s.at(1_000).ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    assert!(s.tick(1_000 + ms(PARK_WITHIN) - 1).is_empty());
    let a = s.tick(1_000 + ms(PARK_WITHIN));
    assert!(matches!(&a[..], [Action::Note(_), STOP]), "{a:?}");
    assert_eq!(s.ev(Event::WorkersStopped), vec![Action::Join]);
    let a = s.ev(Event::Joined(Ok(round(2, 0))));
    assert!(matches!(a[0], Action::StartWorkers(_)), "{a:?}");
    // A worker failing while the others park: stopped, rejoined, started anew.
    let mut s = resilient(2);
    s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    let a = s.ev(Event::WorkersEnded(failure(1)));
    assert!(matches!(&a[..], [Action::Note(_), STOP]), "{a:?}");
}

#[test]
fn a_parked_worker_that_dies_while_the_node_joins_gets_the_group_started_anew_in_the_round() {
    let mut s = resilient(2);
    s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    s.ev(Event::WorkersParked);
    assert!(s.ev(Event::WorkersEnded(failure(9))).is_empty());
    let a = s.ev(Event::Joined(Ok(round(2, 0))));
    assert!(matches!(&a[..], [Action::Note(_), STOP]), "{a:?}");
    let a = s.ev(Event::WorkersStopped);
    assert!(matches!(&a[..], [Action::StartWorkers(p), Action::Watch { round: 2 }] if p.round == 2), "{a:?}");
}

#[test]
fn any_end_of_the_run_while_workers_are_parked_stops_them_first() {
    // The job finished while the node joined.
    let mut s = resilient(2);
    s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    s.ev(Event::WorkersParked);
    let a = s.ev(Event::Joined(Err(CallError::JobFinished)));
    assert_eq!(a, vec![STOP]);
    let a = s.ev(Event::WorkersStopped);
    assert!(matches!(&a[..], [Action::Exit(Outcome::Run(RunOutcome::Succeeded { .. }))]), "{a:?}");
    // A stop signal while parked: the parked workers stop first, then the node leaves.
    let mut s = resilient(2);
    s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    s.ev(Event::WorkersParked);
    let a = s.ev(Event::Signal(libc::SIGTERM));
    assert_eq!(a, vec![Action::StopWorkers { first: libc::SIGTERM }]);
    // The join answered meanwhile starts nothing.
    assert!(s.ev(Event::Joined(Ok(round(2, 0)))).is_empty());
    let a = s.ev(Event::WorkersStopped);
    assert_eq!(a, vec![Action::Send(Report::Leave)]);
    let a = s.ev(Event::Reported { kind: ReportKind::Leave, result: Ok(()) });
    assert!(matches!(&a[..], [Action::Exit(Outcome::Run(RunOutcome::Interrupted { signal: libc::SIGTERM }))]), "{a:?}");
    // A stop signal while parking stops them at once.
    let mut s = resilient(2);
    s.ev(Event::Watched { round: 1, answer: Ok(Watch::NewRound(2)) });
    let a = s.ev(Event::Signal(libc::SIGTERM));
    assert_eq!(a, vec![Action::StopWorkers { first: libc::SIGTERM }]);
}

/// Rank `rank` (local index `rank`) failed with exit code 7.
fn failure_of(rank: u32) -> WorkersEnd {
    let WorkersEnd::Failed(mut rc) = failure(7) else { unreachable!() };
    (rc.rank, rc.local_rank) = (rank, rank);
    WorkersEnd::Failed(rc)
}

fn is_failure_report(a: &Action, round: u64) -> bool {
    matches!(a, Action::Send(Report::Failure { round: r, .. }) if *r == round)
}

#[test]
fn a_worker_whose_own_rank_failed_starts_anew_while_the_node_s_other_workers_keep_their_processes() {
    let mut s = resilient(2);
    let a = s.ev(Event::WorkersEnded(failure_of(1)));
    // The others park, told which worker is gone; the failure goes out at once.
    assert!(
        matches!(&a[..], [Action::Note(_), Action::Park { round: 1, failed, .. }, r]
            if failed == &[1] && is_failure_report(r, 1)),
        "{a:?}"
    );
    // Parked before the failure is counted: the node joins once it is.
    assert!(s.ev(Event::WorkersParked).is_empty());
    assert_eq!(s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) }), vec![Action::Join]);
    let a = s.ev(Event::Joined(Ok(round(2, 1))));
    assert!(
        matches!(&a[..], [Action::Resume { placement, fresh }, Action::Watch { round: 2 }]
            if placement.round == 2 && fresh == &[1]),
        "{a:?}"
    );
    assert!(!s.log.contains(&STOP), "no stop: {:?}", s.log);
    assert_eq!(s.starts, 1, "no group started anew");
    // Until the new worker opts in, a re-form stops them all (it cannot be parked).
    let mut t = s.core.clone();
    let a = t.step(Event::Watched { round: 2, answer: Ok(Watch::NewRound(3)) }, s.now);
    assert!(a.contains(&STOP), "{a:?}");
    // Once it did, they park together again.
    s.ev(Event::OptedIn(vec![0, 1]));
    let a = s.ev(Event::Watched { round: 2, answer: Ok(Watch::NewRound(3)) });
    assert!(matches!(&a[..], [_, _, Action::Park { round: 2, failed, .. }] if failed.is_empty()), "{a:?}");

    // Counted before the others parked: the node joins as they do.
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failure_of(0)));
    assert!(s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) }).is_empty());
    assert_eq!(s.ev(Event::WorkersParked), vec![Action::Join]);
    let a = s.ev(Event::Joined(Ok(round(2, 1))));
    assert!(matches!(&a[..], [Action::Resume { fresh, .. }, _] if fresh == &[0]), "{a:?}");
    // The round it reported on was gone already: nothing counted, the node joins all the same.
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failure_of(1)));
    assert!(s.ev(Event::Reported { kind: ReportKind::Failure, result: Err(CallError::NotMember) }).is_empty());
    assert_eq!(s.ev(Event::WorkersParked), vec![Action::Join]);
}

#[test]
fn a_failure_that_leaves_no_worker_or_one_not_opted_in_or_comes_from_a_stop_signal_stops_the_node_s_group() {
    // Both failed: nothing to keep.
    let mut s = resilient(2);
    let a = s.ev(Event::WorkersEnded(failed_with_others(7, &[0])));
    assert_eq!(a, vec![STOP]);
    // The other worker did not opt in.
    let mut s = resilient(1);
    let a = s.ev(Event::WorkersEnded(failure_of(0)));
    assert_eq!(a, vec![STOP]);
    // Killed by a stop signal the agent did not send (a scheduler stopping the job): the
    // usual stop, held for the agent's own signal.
    let mut s = resilient(2);
    let WorkersEnd::Failed(mut rc) = failure_of(1) else { unreachable!() };
    rc.exit = Exit::Signal(libc::SIGTERM);
    assert_eq!(s.ev(Event::WorkersEnded(WorkersEnd::Failed(rc))), vec![STOP]);
    // A rank not of this node's placement (a report that cannot be told apart): the usual stop.
    let mut s = resilient(2);
    assert_eq!(s.ev(Event::WorkersEnded(failure_of(7))), vec![STOP]);
}

#[test]
fn when_the_node_s_other_workers_cannot_be_kept_after_its_failure_they_stop_and_the_failure_still_counts() {
    // They do not park in time: stopped, the failure reported again (counted once).
    let mut s = resilient(2);
    s.at(1_000).ev(Event::WorkersEnded(failure_of(1)));
    let a = s.tick(1_000 + ms(PARK_WITHIN));
    assert!(matches!(&a[..], [Action::Note(_), STOP]), "{a:?}");
    let a = s.ev(Event::WorkersStopped);
    assert!(matches!(&a[..], [r] if is_failure_report(r, 1)), "{a:?}");
    assert_eq!(s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) }), vec![Action::Join]);
    let a = s.ev(Event::Joined(Ok(round(2, 1))));
    assert!(matches!(a[0], Action::StartWorkers(_)), "{a:?}");
    // Another dies while they park: the same.
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failure_of(1)));
    let a = s.ev(Event::WorkersEnded(failure_of(0)));
    assert!(matches!(&a[..], [Action::Note(_), STOP]), "{a:?}");
    let a = s.ev(Event::WorkersStopped);
    assert!(matches!(&a[..], [r] if is_failure_report(r, 1)), "{a:?}");
    // One dies once parked: the group starts anew in the next round.
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failure_of(1)));
    s.ev(Event::WorkersParked);
    assert!(s.ev(Event::WorkersEnded(failure_of(0))).is_empty());
    s.ev(Event::Reported { kind: ReportKind::Failure, result: Ok(()) });
    let a = s.ev(Event::Joined(Ok(round(2, 1))));
    assert!(matches!(&a[..], [Action::Note(_), STOP]), "{a:?}");
    let a = s.ev(Event::WorkersStopped);
    assert!(matches!(&a[..], [Action::StartWorkers(p), _] if p.round == 2), "{a:?}");
}

#[test]
fn the_budget_spent_or_the_job_over_while_the_others_park_stops_them_before_the_run_ends() {
    // The failure spent the budget: the parking workers stop, then the root cause is fetched.
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failure_of(1)));
    let a = s.ev(Event::Reported { kind: ReportKind::Failure, result: Err(CallError::JobFailed("spent".into())) });
    assert_eq!(a, vec![STOP]);
    assert_eq!(s.ev(Event::WorkersStopped), vec![Action::FetchRootCause]);
    // Spent once they parked: fetched while they wait, stopped before the run ends.
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failure_of(1)));
    s.ev(Event::WorkersParked);
    let a = s.ev(Event::Reported { kind: ReportKind::Failure, result: Err(CallError::JobFailed("spent".into())) });
    assert_eq!(a, vec![Action::FetchRootCause]);
    let a = s.ev(Event::RootCauseFetched(None, None));
    assert_eq!(a, vec![STOP]);
    let a = s.ev(Event::WorkersStopped);
    assert!(matches!(&a[..], [Action::Exit(Outcome::Run(RunOutcome::Failed { .. }))]), "{a:?}");
    // The job finished meanwhile: stopped, then this node's failure ends its run.
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failure_of(1)));
    let a = s.ev(Event::Reported { kind: ReportKind::Failure, result: Err(CallError::JobFinished) });
    assert_eq!(a, vec![STOP]);
    let a = s.ev(Event::WorkersStopped);
    assert!(matches!(&a[..], [Action::Exit(Outcome::Run(RunOutcome::Failed { .. }))]), "{a:?}");
    // A stop signal while they park after the failure.
    let mut s = resilient(2);
    s.ev(Event::WorkersEnded(failure_of(1)));
    assert_eq!(s.ev(Event::Signal(libc::SIGTERM)), vec![STOP]);
    assert_eq!(s.ev(Event::WorkersStopped), vec![Action::Send(Report::Leave)]);
}

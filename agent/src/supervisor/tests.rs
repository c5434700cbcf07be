//! The supervisor driven with made-up clocks and workers: exits in every order, failures in the
//! same moment and later, hangs held and reported, stacks asked for at any point, stops racing
//! every report. A small simulated world checks the invariants after every step.

use super::*;
use crate::hang::Frame;

const T: Millis = 1000;

fn policy(timeout_s: u64, nodes: u32) -> HangPolicy {
    HangPolicy { timeout: HangTimeout::Fixed(Duration::from_secs(timeout_s)), nodes, ticks_per_s: 100 }
}

fn code(c: i32) -> Exit {
    Exit::Code(c)
}

fn exited(index: usize, exit: Exit) -> Event {
    Event::Exited { index, exit, seen_at: 1_700_000_000_000 + index as u64 }
}

fn frames(function: &str, file: &str) -> Stack {
    Stack::Frames(vec![Frame { function: function.into(), file: file.into(), line: Some(1) }])
}

fn waiting() -> Stack {
    frames("all_reduce", "distributed_c10d.py")
}

fn computing() -> Stack {
    frames("forward", "model.py")
}

/// What a step does, without its log lines (`worker failed`, a hang's text).
fn step(s: &mut Supervisor, event: Event, now: Millis) -> Vec<Action> {
    s.step(event, now).into_iter().filter(|a| !matches!(a, Action::Info(_) | Action::Warn(_))).collect()
}

fn reports(actions: &[Action]) -> Vec<&Action> {
    actions.iter().filter(|a| matches!(a, Action::Succeeded | Action::Failed(_) | Action::Hung(_))).collect()
}

fn read_id(actions: &[Action]) -> Option<u64> {
    actions.iter().find_map(|a| match a {
        Action::ReadStacks { id } => Some(*id),
        _ => None,
    })
}

/// The same sample every time: no CPU, no output, no beats - a worker that makes no progress.
fn still(indices: impl IntoIterator<Item = usize>) -> BTreeMap<usize, Sample> {
    indices.into_iter().map(|i| (i, Sample::default())).collect()
}

#[test]
fn every_worker_succeeding_reports_success_once_and_forgets_the_steps() {
    let mut s = Supervisor::new(vec![0, 1, 2], None, true, 0);
    assert!(step(&mut s, exited(1, code(0)), 5).is_empty());
    assert!(step(&mut s, exited(0, code(0)), 6).is_empty());
    let a = step(&mut s, exited(2, code(0)), 7);
    assert_eq!(a, vec![Action::ForgetSteps, Action::Succeeded]);
    assert!(!s.running());
}

#[test]
fn a_failure_is_reported_once_the_failing_moment_is_over_naming_those_that_failed_with_it() {
    let mut s = Supervisor::new(vec![4, 5, 6, 7], None, false, 0);
    assert!(step(&mut s, exited(1, code(3)), 100).is_empty(), "other failures may follow in the same moment");
    assert_eq!(s.next_wakeup(), Some(100 + ms(FAILING_ALONG)));
    assert!(step(&mut s, exited(3, code(9)), 104).is_empty());
    assert!(step(&mut s, exited(2, code(0)), 105).is_empty(), "a success is no failure");
    assert!(step(&mut s, Event::Tick, 109).is_empty(), "not before the moment is over");
    let a = step(&mut s, Event::Tick, 110);
    let [Action::ForgetSteps, Action::Failed(f)] = a.as_slice() else { panic!("{a:?}") };
    assert_eq!((f.index, f.exit), (1, code(3)));
    assert_eq!(f.others, vec![(3, code(9))]);
    // A worker failing after the report is no news: the driver stops the rest.
    assert!(step(&mut s, exited(0, code(1)), 111).is_empty());
    assert_eq!(s.next_wakeup(), None);
}

#[test]
fn the_failing_moment_ends_at_once_when_every_worker_has_exited() {
    let mut s = Supervisor::new(vec![0, 1], None, false, 0);
    assert!(step(&mut s, exited(0, code(1)), 50).is_empty());
    let a = step(&mut s, exited(1, Exit::Signal(libc::SIGSEGV)), 51);
    let [Action::ForgetSteps, Action::Failed(f)] = a.as_slice() else { panic!("{a:?}") };
    assert_eq!(f.others, vec![(1, Exit::Signal(libc::SIGSEGV))]);
    // A single worker's failure needs no wait at all.
    let mut s = Supervisor::new(vec![0], None, false, 0);
    assert!(matches!(step(&mut s, exited(0, code(2)), 10).as_slice(), [Action::ForgetSteps, Action::Failed(_)]));
}

#[test]
fn with_hang_detection_the_survivors_stacks_are_read_before_the_failure_is_reported() {
    let mut s = Supervisor::new(vec![0, 1, 2], Some(policy(60, 1)), false, 0);
    let _ = step(&mut s, Event::Tick, 0); // the first sample
    let _ = step(&mut s, Event::Sampled(still(0..3)), 1);
    assert!(step(&mut s, exited(2, code(1)), 100).is_empty());
    let a = step(&mut s, Event::Tick, 110);
    let id = read_id(&a).expect("the survivors' stacks are read");
    assert!(reports(&a).is_empty());
    let stacks = BTreeMap::from([(0, waiting()), (1, waiting())]);
    let a = step(&mut s, Event::StacksRead { id, stacks }, 300);
    let [Action::ForgetSteps, Action::Failed(f)] = a.as_slice() else { panic!("{a:?}") };
    assert_eq!(f.index, 2);
    assert_eq!(f.stacks.len(), 1, "{:?}", f.stacks);
    assert!(f.stacks[0].starts_with("rank 0-1") || f.stacks[0].contains("0-1"), "{:?}", f.stacks);
    // A request racing that end gets the same lines.
    assert_eq!(step(&mut s, Event::StacksWanted, 301), vec![Action::ReplyStacks(f.stacks.clone())]);
}

#[test]
fn a_stop_during_the_failing_moment_reports_nothing_but_the_stop() {
    let mut s = Supervisor::new(vec![0, 1], None, true, 0);
    let _ = step(&mut s, exited(0, code(1)), 10);
    let a = step(&mut s, Event::Stop { first: libc::SIGTERM }, 12);
    assert_eq!(a, vec![Action::ForgetSteps, Action::Stop { first: libc::SIGTERM }]);
    assert!(step(&mut s, Event::Tick, 100).is_empty());
    assert!(step(&mut s, exited(1, Exit::Signal(libc::SIGTERM)), 100).is_empty());
    assert_eq!(step(&mut s, Event::Stopped, 200), vec![Action::Stopped]);
    assert!(step(&mut s, Event::Stopped, 201).is_empty(), "stopped once");
    assert!(step(&mut s, Event::Signal(libc::SIGUSR1), 202).is_empty(), "nothing is relayed to a stopped group");
}

#[test]
fn stacks_asked_for_are_read_when_running_and_the_last_ones_after_the_end() {
    let mut s = Supervisor::new(vec![0, 1], None, false, 0);
    assert_eq!(step(&mut s, Event::StacksWanted, 0), vec![Action::ReplyStacks(Vec::new())], "no hang detection: none");
    let mut s = Supervisor::new(vec![0, 1], Some(policy(60, 1)), false, 0);
    let id = read_id(&step(&mut s, Event::StacksWanted, 0)).unwrap();
    assert!(read_id(&step(&mut s, Event::StacksWanted, 1)).is_none(), "a second request waits for the same read");
    let a = step(&mut s, Event::StacksRead { id, stacks: BTreeMap::from([(0, computing()), (1, waiting())]) }, 2);
    let [Action::ReplyStacks(lines)] = a.as_slice() else { panic!("{a:?}") };
    assert_eq!(lines.len(), 2);
    assert!(lines[0].contains("rank 0"), "the odd one out (not waiting) first: {lines:?}");
    assert!(s.running(), "a request decides nothing");
}

#[test]
fn a_rank_that_makes_no_progress_is_reported_hung_after_the_threshold_naming_the_odd_one_out() {
    let mut s = Supervisor::new(vec![10, 11, 12], Some(policy(5, 1)), true, 0);
    let mut now = 0;
    let mut hung = None;
    while now <= 20 * T && hung.is_none() {
        let a = step(&mut s, Event::Tick, now);
        if a.iter().any(|a| matches!(a, Action::Sample { .. })) {
            assert!(a.contains(&Action::PublishSteps));
            let a = step(&mut s, Event::Sampled(still(0..3)), now + 10);
            if let Some(id) = read_id(&a) {
                assert!(now >= 5 * T, "no verdict before the threshold ({now} ms)");
                let stacks = BTreeMap::from([(10, waiting()), (11, computing()), (12, waiting())]);
                let a = step(&mut s, Event::StacksRead { id, stacks }, now + 20);
                hung = a.into_iter().find_map(|a| match a {
                    Action::Hung(h) => Some(h),
                    _ => None,
                });
            }
        }
        now = s.next_wakeup().unwrap_or(now + T);
    }
    let h = hung.expect("a hang verdict within 20 s");
    assert_eq!(h.culprit, 1, "rank 11 computes while the others wait: it is the odd one out");
    assert!(h.message.contains("rank(s) 10-12"), "{}", h.message);
    assert_eq!(h.stacks.len(), 2);
    assert!(!s.running());
}

#[test]
fn a_node_whose_ranks_all_wait_holds_its_verdict_then_reports_if_no_one_else_did() {
    let mut s = Supervisor::new(vec![0, 1], Some(policy(20, 2)), false, 0);
    let stacks = || BTreeMap::from([(0, waiting()), (1, waiting())]);
    let mut now = 0;
    let mut held_at = None;
    let mut hung_at = None;
    while now <= 60 * T && hung_at.is_none() {
        let a = step(&mut s, Event::Tick, now);
        if a.iter().any(|a| matches!(a, Action::Sample { .. })) {
            if let Some(id) = read_id(&step(&mut s, Event::Sampled(still(0..2)), now)) {
                let a = s.step(Event::StacksRead { id, stacks: stacks() }, now);
                if a.iter().any(|a| matches!(a, Action::Info(m) if m.contains("holding"))) {
                    assert!(held_at.is_none(), "held once");
                    held_at = Some(now);
                }
                if !reports(&a).is_empty() {
                    hung_at = Some(now);
                }
            }
        }
        now = s.next_wakeup().unwrap_or(now + T);
    }
    let (held, hung) = (held_at.expect("held"), hung_at.expect("reported"));
    assert_eq!(held, 20 * T, "the verdict comes at the threshold");
    assert_eq!(hung - held, 5 * T, "a quarter of the threshold later");
}

#[test]
fn a_worker_that_exits_while_a_verdicts_stacks_are_read_is_a_failure_not_a_hang() {
    let mut s = Supervisor::new(vec![0, 1], Some(policy(5, 1)), false, 0);
    let mut now = 0;
    let id = loop {
        let _ = step(&mut s, Event::Tick, now);
        if let Some(id) = read_id(&step(&mut s, Event::Sampled(still(0..2)), now)) {
            break id;
        }
        now = s.next_wakeup().unwrap();
        assert!(now < 10 * T);
    };
    assert!(step(&mut s, exited(0, code(1)), now + 1).is_empty());
    let a = step(&mut s, Event::StacksRead { id, stacks: BTreeMap::from([(0, computing()), (1, waiting())]) }, now + 2);
    assert!(reports(&a).is_empty(), "the verdict's read is stale: {a:?}");
    let a = step(&mut s, Event::Tick, now + 1 + ms(FAILING_ALONG));
    let id = read_id(&a).expect("the survivor's stacks");
    let a = step(&mut s, Event::StacksRead { id, stacks: BTreeMap::from([(1, waiting())]) }, now + 20);
    assert!(matches!(reports(&a).as_slice(), [Action::Failed(f)] if f.index == 0), "{a:?}");
}

#[test]
fn an_exited_rank_is_never_hung_while_the_others_progress() {
    let mut s = Supervisor::new(vec![0, 1], Some(policy(2, 1)), false, 0);
    let _ = step(&mut s, exited(0, code(0)), 0);
    let mut now = 0;
    let mut cpu = 0;
    while now < 30 * T {
        if step(&mut s, Event::Tick, now).iter().any(|a| matches!(a, Action::Sample { .. })) {
            cpu += 100; // a whole core
            let a = step(
                &mut s,
                Event::Sampled(BTreeMap::from([(1, Sample { cpu_ticks: cpu, ..Sample::default() })])),
                now,
            );
            assert_eq!(read_id(&a), None, "no verdict at {now} ms");
        }
        now = s.next_wakeup().unwrap();
    }
    assert!(s.running());
}

#[test]
fn a_failure_during_a_verdicts_read_waits_for_it_then_reads_the_survivors_once() {
    // py-spy pauses a process: a second dump of it while the first runs fails (EPERM).
    let mut s = Supervisor::new(vec![0, 1, 2], Some(policy(5, 1)), false, 0);
    let mut now = 0;
    let first = loop {
        let _ = step(&mut s, Event::Tick, now);
        if let Some(id) = read_id(&step(&mut s, Event::Sampled(still(0..3)), now)) {
            break id;
        }
        now = s.next_wakeup().unwrap();
    };
    let _ = step(&mut s, exited(2, code(1)), now + 1);
    let a = step(&mut s, Event::Tick, now + 1 + ms(FAILING_ALONG));
    assert_eq!(read_id(&a), None, "no second read while the verdict's runs: {a:?}");
    let a = step(
        &mut s,
        Event::StacksRead { id: first, stacks: BTreeMap::from([(0, waiting()), (1, waiting())]) },
        now + 500,
    );
    let second = read_id(&a).expect("the survivors' own read once the first is back");
    assert!(reports(&a).is_empty());
    let a = step(
        &mut s,
        Event::StacksRead { id: second, stacks: BTreeMap::from([(0, waiting()), (1, waiting())]) },
        now + 900,
    );
    assert!(matches!(reports(&a).as_slice(), [Action::Failed(f)] if f.index == 2 && !f.stacks.is_empty()), "{a:?}");
}

#[test]
fn a_request_in_the_failing_moment_is_answered_and_the_failure_gets_a_read_of_its_own_after() {
    let mut s = Supervisor::new(vec![0, 1], Some(policy(60, 1)), false, 0);
    let _ = step(&mut s, exited(0, code(1)), 10);
    let asked = read_id(&step(&mut s, Event::StacksWanted, 12)).expect("a read for the request");
    assert_eq!(read_id(&step(&mut s, Event::Tick, 10 + ms(FAILING_ALONG))), None, "one read at a time");
    let a = step(&mut s, Event::StacksRead { id: asked, stacks: BTreeMap::from([(1, waiting())]) }, 30);
    assert!(matches!(a.first(), Some(Action::ReplyStacks(l)) if l.len() == 1), "{a:?}");
    let own = read_id(&a).expect("then the failure's own");
    let a = step(&mut s, Event::StacksRead { id: own, stacks: BTreeMap::from([(1, waiting())]) }, 40);
    assert!(matches!(reports(&a).as_slice(), [Action::Failed(f)] if f.index == 0), "{a:?}");
}

#[test]
fn with_every_rank_at_the_same_place_the_culprit_is_the_longest_quiet_not_the_first_rank() {
    // Rank 0 prints (progress), rank 1 sleeps: both stand in the same frames when read.
    let mut s = Supervisor::new(vec![0, 1], Some(policy(3, 1)), false, 0);
    let mut now = 0;
    let mut out = 0u64;
    let hung = loop {
        assert!(now < 20 * T, "a verdict within 20 s");
        if s.step(Event::Tick, now).iter().any(|a| matches!(a, Action::Sample { .. })) {
            out += 100;
            let samples =
                BTreeMap::from([(0, Sample { output_bytes: out, ..Sample::default() }), (1, Sample::default())]);
            if let Some(id) = read_id(&step(&mut s, Event::Sampled(samples), now)) {
                let a = step(
                    &mut s,
                    Event::StacksRead { id, stacks: BTreeMap::from([(0, computing()), (1, computing())]) },
                    now,
                );
                if let Some(Action::Hung(h)) = reports(&a).first() {
                    break (*h).clone();
                }
            }
        }
        now = s.next_wakeup().unwrap_or(now + T);
    };
    assert_eq!(hung.culprit, 1, "{hung:?}");
    assert!(hung.message.contains("rank(s) 1 "), "{}", hung.message);
}

// The simulated world: random events with invariants checked after every step.

use crate::random::XorShift as Rng;

#[derive(Default)]
struct Seen {
    reports: usize,
    stop_asked: bool,
    stopped: usize,
    reads: Vec<u64>,
    in_flight: Option<u64>,
    exits: Vec<Option<Exit>>,
    sampling: bool,
}

fn check(seen: &mut Seen, event: &Event, actions: &[Action], s: &Supervisor) {
    if let Event::StacksRead { id, .. } = event {
        if seen.in_flight == Some(*id) {
            seen.in_flight = None;
        }
    }
    for a in actions {
        match a {
            Action::Succeeded => {
                assert!(seen.exits.iter().all(|e| *e == Some(code(0))), "success with a worker not done: {a:?}");
            }
            Action::Failed(f) => {
                assert_eq!(seen.exits[f.index], Some(f.exit), "the first failure is a real exit");
                assert!(!f.exit.success());
                assert!(f.others.iter().all(|(i, e)| *i != f.index && !e.success() && seen.exits[*i] == Some(*e)));
                let mut idx: Vec<usize> = f.others.iter().map(|(i, _)| *i).collect();
                idx.dedup();
                assert_eq!(idx.len(), f.others.len(), "each other failure once");
            }
            Action::Hung(h) => assert!(seen.exits[h.culprit].is_none(), "the culprit is running: {h:?}"),
            Action::ReadStacks { id } => {
                assert!(!seen.reads.contains(id), "read ids are unique");
                assert_eq!(seen.in_flight, None, "one read at a time (py-spy pauses the process)");
                seen.reads.push(*id);
                seen.in_flight = Some(*id);
            }
            Action::Sample { stacks_of } => {
                assert!(!seen.sampling, "one sample at a time");
                seen.sampling = true;
                assert!(stacks_of.iter().all(|i| seen.exits[*i].is_none()), "only running workers' stacks");
            }
            Action::Stop { .. } => assert!(!seen.stop_asked || matches!(event, Event::Stop { .. })),
            Action::Stopped => seen.stopped += 1,
            Action::Signal(_) => assert!(!seen.stop_asked, "nothing is relayed once a stop is asked for"),
            _ => {}
        }
        if matches!(a, Action::Succeeded | Action::Failed(_) | Action::Hung(_)) {
            seen.reports += 1;
            assert!(!seen.stop_asked, "no report once a stop is asked for: {a:?} after {event:?}");
        }
    }
    if matches!(event, Event::Stop { .. }) {
        seen.stop_asked = true;
    }
    assert!(seen.reports <= 1, "one report per group");
    assert!(seen.stopped <= 1 && (seen.stopped == 0 || seen.stop_asked));
    if seen.reports == 1 || seen.stop_asked {
        assert!(!s.running());
    }
}

#[test]
fn random_worlds_keep_every_invariant() {
    for seed in 1..400u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let n = 1 + rng.below(4) as usize;
        let hang = (rng.below(2) == 0).then(|| policy(1 + rng.below(4), 1 + rng.below(2) as u32));
        let mut s = Supervisor::new((0..n as u32).collect(), hang, rng.below(2) == 0, 0);
        let mut seen = Seen { exits: vec![None; n], ..Seen::default() };
        let mut now: Millis = 0;
        let mut pending_reads: Vec<u64> = Vec::new();
        for _ in 0..300 {
            now += rng.below(700);
            let event = match rng.below(12) {
                0 | 1 => {
                    let i = rng.below(n as u64) as usize;
                    if seen.exits[i].is_some() {
                        continue;
                    }
                    let exit = if rng.below(3) == 0 { code(1 + rng.below(3) as i32) } else { code(0) };
                    seen.exits[i] = Some(exit);
                    Event::Exited { index: i, exit, seen_at: now }
                }
                2..=5 => Event::Tick,
                6 if seen.sampling => {
                    seen.sampling = false;
                    let running = (0..n).filter(|i| seen.exits[*i].is_none());
                    Event::Sampled(still(running))
                }
                7 if !pending_reads.is_empty() => {
                    let id = pending_reads.remove(rng.below(pending_reads.len() as u64) as usize);
                    let stacks = (0..n)
                        .filter(|i| seen.exits[*i].is_none())
                        .map(|i| (i as u32, if rng.below(2) == 0 { waiting() } else { computing() }))
                        .collect();
                    Event::StacksRead { id, stacks }
                }
                8 => Event::StacksWanted,
                9 => Event::Signal(libc::SIGUSR1),
                10 if rng.below(8) == 0 => Event::Stop { first: libc::SIGTERM },
                11 if seen.stop_asked => {
                    for e in seen.exits.iter_mut().filter(|e| e.is_none()) {
                        *e = Some(Exit::Signal(libc::SIGTERM));
                    }
                    Event::Stopped
                }
                _ => continue,
            };
            let actions = step(&mut s, event.clone(), now);
            for a in &actions {
                if let Action::ReadStacks { id } = a {
                    pending_reads.push(*id);
                }
            }
            check(&mut seen, &event, &actions, &s);
            if matches!(s.phase, Phase::Failing { .. }) {
                assert!(s.next_wakeup().is_some(), "a failing moment always ends");
            }
        }
    }
}

#[test]
fn after_a_failure_the_workers_kept_are_watched_again_and_one_started_anew_is_one_of_the_group() {
    let mut s = Supervisor::new(vec![0, 1, 2], None, false, 0);
    step(&mut s, exited(1, code(7)), T);
    let a = step(&mut s, Event::Tick, T + ms(FAILING_ALONG));
    assert!(matches!(reports(&a)[..], [Action::Failed(f)] if f.index == 1), "{a:?}");
    // Another one ending between the report and the park: reported as the group is watched
    // again.
    let mut late = s.clone();
    assert!(step(&mut late, exited(2, code(0)), T + 50).is_empty());
    let a = step(&mut late, Event::Park, T + 60);
    assert!(matches!(reports(&a)[..], [Action::Failed(f)] if f.index == 2), "{a:?}");
    // The others park: the group is watched again, and one of them ending is reported, even
    // with code 0 (a parked worker waits for its round: it cannot have finished).
    assert!(reports(&step(&mut s, Event::Park, T + 60)).is_empty());
    assert!(s.running());
    let mut kept = s.clone();
    kept.step(exited(0, code(0)), T + 100);
    let a = step(&mut kept, Event::Tick, T + 100 + ms(FAILING_ALONG));
    assert!(matches!(reports(&a)[..], [Action::Failed(f)] if f.index == 0), "{a:?}");
    // Worker 1 started anew in the next round, with new ranks: its exit counts again, and the
    // group succeeds once all three did.
    s.renumber(vec![3, 4, 5], &[1], T + 200);
    assert!(step(&mut s, exited(0, code(0)), T + 300).is_empty());
    assert!(step(&mut s, exited(2, code(0)), T + 300).is_empty());
    let a = step(&mut s, exited(1, code(0)), T + 400);
    assert_eq!(reports(&a), vec![&Action::Succeeded]);
}

#[test]
fn parked_workers_that_all_finish_succeed_and_an_exit_while_the_failure_settles_is_reported_later() {
    // A round ending elsewhere as every worker finished its function: the group succeeded.
    let mut s = Supervisor::new(vec![0, 1], None, false, 0);
    assert!(reports(&step(&mut s, Event::Park, T)).is_empty());
    assert!(step(&mut s, exited(0, code(0)), T + 1).is_empty());
    assert_eq!(reports(&step(&mut s, exited(1, code(0)), T + 2)), vec![&Action::Succeeded]);
    // Worker 1 fails; worker 0 ends with code 0 in the failure's moment: not one of the
    // failures, but reported once the group is watched again.
    let mut s = Supervisor::new(vec![0, 1, 2], None, false, 0);
    step(&mut s, exited(1, code(7)), T);
    assert!(step(&mut s, exited(0, code(0)), T + 1).is_empty());
    let a = step(&mut s, Event::Tick, T + ms(FAILING_ALONG));
    assert!(matches!(reports(&a)[..], [Action::Failed(f)] if f.index == 1 && f.others.is_empty()), "{a:?}");
    let a = step(&mut s, Event::Park, T + 50);
    assert!(matches!(reports(&a)[..], [Action::Failed(f)] if f.index == 0), "{a:?}");
}

//! Liveness on a store without heartbeat times, with made-up clocks: each rule on its own, then
//! a loss on etcd dated end to end.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::*;
use crate::detector::Health;
use crate::round::tests::node;
use crate::round::{apply, Action, Event, Phase, RoundCause};

fn settings() -> JobSettings {
    crate::round::tests::settings(3, 3)
}

/// Round 1 running with a, b and c (closed at t = 200), as etcd stores it: no heartbeat times.
fn running_as_stored() -> Job {
    let mut job = Job::new(settings(), 0);
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        job = apply(&job, Event::Join(node(id)), 100 * i as u64).0;
    }
    assert!(matches!(job.phase, Phase::Running { .. }), "{job:?}");
    job.last_seen.clear();
    for h in job.health.values_mut() {
        h.arrivals.clear();
    }
    job
}

fn suspicion(since: Millis) -> Suspicion {
    Suspicion {
        since,
        deadline: since + 1000,
        asked: vec!["c".to_owned()],
        reached_by: None,
        missed_by: Vec::new(),
        rounds: 1,
    }
}

/// A job in which `id` is suspected since `since`.
fn suspecting(id: &str, since: Millis) -> Job {
    let mut job = running_as_stored();
    job.health.insert(id.to_owned(), Health { suspicion: Some(suspicion(since)), ..Health::default() });
    job
}

fn ids(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|s| (*s).to_owned()).collect()
}

fn heard(at: &[(&str, Millis)]) -> HashMap<String, Millis> {
    at.iter().map(|(id, t)| ((*id).to_owned(), *t)).collect()
}

fn observed(job: Job, alive: &[&str], heard_at: &[(&str, Millis)], now: Millis) -> Job {
    let (alive, heard) = (ids(alive), heard(heard_at));
    observe(job, &Signs { alive: &alive, heard: &heard, lapsed: &[] }, now)
}

fn suspected(job: &Job, id: &str) -> bool {
    job.health.get(id).is_some_and(|h| h.suspicion.is_some())
}

#[test]
fn a_suspicion_is_refuted_by_a_beat_heard_after_it_began() {
    assert!(refuted(&suspicion(1000), 1001, 2000));
    let job = observed(suspecting("b", 1000), &["a", "b", "c"], &[("b", 1001)], 2000);
    assert!(!suspected(&job, "b"), "b beat after its suspicion began");
}

#[test]
fn a_beat_heard_before_or_as_a_suspicion_began_does_not_refute_it() {
    // The beat whose silence started the suspicion (or an older one) is no news.
    assert!(!refuted(&suspicion(1000), 999, 2000));
    assert!(!refuted(&suspicion(1000), 1000, 2000), "the same millisecond");
    for at in [999, 1000] {
        let job = observed(suspecting("b", 1000), &["a", "b", "c"], &[("b", at)], 2000);
        assert!(suspected(&job, "b"), "heard at {at}");
    }
}

#[test]
fn a_suspicion_that_began_after_now_is_cleared_as_from_a_clock_gone_back() {
    assert!(refuted(&suspicion(5000), 3000, 4000));
    assert!(!refuted(&suspicion(4000), 3000, 4000), "began at now: a clock that is where it was");
    let job = observed(suspecting("b", 5000), &["a", "b", "c"], &[("b", 3000)], 4000);
    assert!(!suspected(&job, "b"));
}

#[test]
fn a_node_another_process_holds_is_vouched_for_seen_now_and_its_suspicion_left_as_it_is() {
    // Even a suspicion from a clock gone back: only the process that hears the node judges it.
    let job = observed(suspecting("b", 5000), &["a", "b", "c"], &[("a", 3500), ("c", 3600)], 4000);
    assert_eq!(job.vouched.iter().map(String::as_str).collect::<Vec<_>>(), ["b"]);
    assert_eq!(job.last_seen, BTreeMap::from([("a".into(), 3500), ("b".into(), 4000), ("c".into(), 3600)]));
    assert!(suspected(&job, "b"));
    assert_eq!(vouched(&ids(&["a", "b"]), &heard(&[("a", 1)])).into_iter().collect::<Vec<_>>(), ["b"]);
}

#[test]
fn a_node_without_a_record_is_silent_even_when_this_process_heard_it_lately() {
    // Its key is gone (deleted for silence, or lost with a lease): what this process still
    // remembers of it neither counts as a sign of life nor clears its suspicion.
    let job = observed(suspecting("b", 1000), &["a", "c"], &[("a", 1900), ("b", 1500), ("c", 1900)], 2000);
    assert!(!job.last_seen.contains_key("b"), "{:?}", job.last_seen);
    assert!(!job.vouched.contains("b"));
    assert!(suspected(&job, "b"));
}

#[test]
fn a_beat_dated_after_now_counts_as_heard_now() {
    let seen = last_seen(&ids(&["a", "b"]), &heard(&[("a", 6000), ("b", 4500)]), 5000);
    assert_eq!(seen, BTreeMap::from([("a".into(), 5000), ("b".into(), 4500)]));
}

#[test]
fn an_observation_replaces_the_last_one() {
    let lapsed = [("b".to_owned(), 1200)];
    let heard = heard(&[("a", 1900)]);
    let first = observe(running_as_stored(), &Signs { alive: &ids(&["a", "b"]), heard: &heard, lapsed: &[] }, 2000);
    assert!(first.last_seen.contains_key("b") && first.vouched.contains("b"));
    let next = observe(first, &Signs { alive: &ids(&["a"]), heard: &heard, lapsed: &lapsed }, 2500);
    assert_eq!(next.last_seen, BTreeMap::from([("a".into(), 1900)]));
    assert!(next.vouched.is_empty());
    assert_eq!(next.lapsed_heard, BTreeMap::from([("b".into(), 1200)]));
}

#[test]
fn a_lapsed_node_is_dated_from_its_last_beat_not_from_when_its_silence_was_noticed() {
    // Heard 1.5 s before the sweep that found it silent.
    assert_eq!(heard_at(10_000, Duration::from_millis(1500)), 8_500);
    assert_eq!(heard_at(10_000, Duration::from_micros(1999)), 9_999, "whole milliseconds ago");
    assert_eq!(heard_at(1000, Duration::from_secs(5)), 0, "no date before the epoch");
    assert_eq!(heard_at(10_000, Duration::MAX), 0);
}

#[test]
fn a_loss_is_dated_at_the_earliest_last_sign_of_life_held_else_a_ttl_before_the_verdict() {
    let mut job = running_as_stored();
    job.last_seen.insert("a".into(), 500);
    job.lapsed_heard.insert("b".into(), 300);
    job.lapsed_heard.insert("a".into(), 100);
    assert_eq!(last_heard(&job, &ids(&["a"]), 9000), 500, "a heartbeat held wins over a note");
    assert_eq!(last_heard(&job, &ids(&["b"]), 9000), 300, "the note of the process that let it lapse");
    assert_eq!(last_heard(&job, &ids(&["a", "b"]), 9000), 300, "the earliest");
    assert_eq!(last_heard(&job, &ids(&["c"]), 9000), 7000, "nothing known: one TTL back");
    assert_eq!(last_heard(&job, &ids(&["c"]), 1500), 0);
}

#[test]
fn a_record_is_stale_only_once_silent_for_longer_than_its_ttl() {
    let ttl = Duration::from_secs(3);
    assert!(!stale(Duration::from_millis(2999), ttl));
    assert!(!stale(ttl, ttl), "heard exactly a TTL ago");
    assert!(stale(ttl + Duration::from_nanos(1), ttl));
    assert!(stale(Duration::from_secs(60), ttl));
}

/// Ticks the job on etcd's terms every 500 ms from `from`: a and c heard at each tick, b's key
/// gone (with `note`: when the process that let it lapse last heard from it); returns the job
/// and the decision that opened a round.
fn lose_b(note: Option<Millis>, from: Millis) -> (Job, Millis) {
    let mut job = running_as_stored();
    let lapsed: Vec<(String, Millis)> = note.map(|at| ("b".to_owned(), at)).into_iter().collect();
    for now in (from..from + 10_000).step_by(500) {
        let heard = heard(&[("a", now), ("c", now)]);
        job = observe(job, &Signs { alive: &ids(&["a", "c"]), heard: &heard, lapsed: &lapsed }, now);
        let (next, d) = apply(&job, Event::Tick, now);
        if let Action::RoundOpened { cause: RoundCause::NodeLost { nodes }, .. } = &d.action {
            assert_eq!(nodes, &["b"]);
            return (next, now);
        }
        job = next;
    }
    panic!("b was never declared lost");
}

#[test]
fn a_loss_on_etcd_is_dated_at_the_lapsed_nodes_last_beat() {
    // b was last heard at 1000; its key was swept, and the loss noticed, well after.
    let (job, lost_at) = lose_b(Some(1000), 3100);
    let fault_at = job.accounting.recoveries.back().expect("a recovery").fault_at;
    assert_eq!(fault_at, 1000, "lost at {lost_at}");
    // Without the note: one TTL before the verdict.
    let (job, lost_at) = lose_b(None, 3100);
    assert_eq!(job.accounting.recoveries.back().expect("a recovery").fault_at, lost_at - 2000);
}

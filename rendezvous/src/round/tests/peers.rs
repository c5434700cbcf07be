//! Peer watching in the machine: who watches whom, which reports count, and when they end a
//! round ([`crate::detector::peers`]), on made-up clocks.

use super::*;
use crate::detector::PeerReport;

fn report(job: &Job, watcher: &str, target: &str, silent_ms: u64, gone: bool, now: Millis) -> (Job, Decision) {
    let peers = vec![PeerReport { node_id: target.into(), silent_ms, gone }];
    step(job, Event::Heartbeat { node_id: watcher.into(), sent: None, probes: Vec::new(), peers }, now)
}

/// Round 1 running with `ids`; every node heartbeats every 500 ms up to `until`, except those
/// in `quiet`, which stop after `quiet_after`.
fn beating(ids: &[&str], until: Millis, quiet: &[&str], quiet_after: Millis) -> Job {
    let mut job = running(ids, settings(1, ids.len() as u32));
    for t in (500..=until).step_by(500) {
        for id in ids {
            if !quiet.contains(id) || t <= quiet_after {
                job = hb(&job, id, t);
            }
        }
    }
    job
}

fn lost(d: &Decision) -> bool {
    matches!(&d.action, Action::RoundOpened { cause: RoundCause::NodeLost { .. }, .. })
}

#[test]
fn each_member_watches_the_next_and_the_one_half_the_ring_away() {
    let job = running(&["a", "b", "c", "d"], settings(1, 4));
    let targets = |id: &str| {
        job.round_info(id).unwrap().watch.unwrap().targets.into_iter().map(|t| t.node_id).collect::<Vec<_>>()
    };
    assert_eq!(targets("a"), ["b", "c"]);
    assert_eq!(targets("d"), ["a", "b"]);
    assert_eq!(job.watchers_of("b"), ["a", "d"]);
    let w = job.round_info("a").unwrap().watch.unwrap();
    assert_eq!((w.interval_ms, w.stall_bound_ms), (100, 500));
    // The target's probe endpoint when it has one, else its store.
    assert_eq!(job.round_info("a").unwrap().watch.unwrap().targets[0].addr.to_string(), "b:29500");
    let two = running(&["a", "b"], settings(1, 2));
    assert_eq!(two.watchers_of("b"), ["a"]);
    assert_eq!(two.round_info("b").unwrap().watch.unwrap().targets.len(), 1);
    let one = running(&["a"], settings(1, 1));
    assert!(one.round_info("a").unwrap().watch.unwrap().targets.is_empty());
    assert!(one.watchers_of("a").is_empty());
    let off = running(&["a", "b"], JobSettings { peer_interval: Duration::ZERO, ..settings(1, 2) });
    assert!(off.round_info("a").unwrap().watch.is_none());
    assert!(off.watchers_of("b").is_empty());
}

#[test]
fn a_silent_member_is_lost_once_its_watcher_reports_it_and_its_heartbeats_are_overdue() {
    // b's last heartbeat at 2000; a last heard b at 2050.
    let job = beating(&["a", "b"], 2000, &["b"], 1500);
    let job = hb(&job, "b", 2000);
    // At 2650 a reports 600 ms of silence: b's heartbeat is only 650 ms old (overdue at 750).
    let (job, d) = report(&job, "a", "b", 600, false, 2650);
    assert_eq!(d.action, Action::HeartbeatRecorded, "{d:?}");
    // The next tick past the overdue mark ends the round, without waiting for the TTL.
    let (job2, d) = tick(&job, 2700);
    assert!(!lost(&d), "{d:?}");
    let (job2, d) = tick(&job2, 2760);
    assert!(lost(&d), "{d:?}");
    assert!(d.reason.contains("its watchers: a: silent"), "{}", d.reason);
    // Dated from the latest sign of life: a heard b at 2050, after b's last heartbeat.
    assert_eq!(job2.accounting.recoveries[0].fault_at, 2050);
    // Or at once, when the repeated report comes after the mark.
    let (_, d) = report(&job, "a", "b", 700, false, 2750);
    assert!(lost(&d), "{d:?}");
}

#[test]
fn a_report_of_silence_that_the_heartbeats_refute_loses_nobody() {
    // a says b is silent all along (a lossy path between them, or a lie); b's heartbeats come.
    let mut job = beating(&["a", "b"], 1000, &[], 0);
    for t in (1500..=20_000).step_by(500) {
        job = hb(&job, "b", t);
        let (next, d) = report(&job, "a", "b", t - 1000, false, t + 240);
        assert!(!lost(&d), "{d:?}");
        let (next, d) = tick(&next, t + 250);
        assert!(!lost(&d), "{d:?}");
        job = next;
    }
    // A heartbeat late by less than half the stall bound is no agreement either.
    let (job, _) = report(&job, "a", "b", 5000, false, 20_700);
    let (_, d) = tick(&job, 20_740);
    assert!(!lost(&d), "{d:?}");
}

#[test]
fn only_the_assigned_watchers_speak_of_a_node_and_all_of_them_must() {
    // a, b, c, d: b is watched by a and d; c is not its watcher.
    let job = beating(&["a", "b", "c", "d"], 2000, &["b"], 1000);
    let (job, d) = report(&job, "c", "b", 1000, true, 2100);
    assert!(!lost(&d), "{d:?}");
    assert!(job.health["b"].peers.is_empty(), "c's report is not even kept");
    let (job, d) = report(&job, "a", "b", 1000, false, 2100);
    assert!(!lost(&d), "one of two watchers: {d:?}");
    let (job, d) = report(&job, "d", "b", 1000, false, 2110);
    assert!(lost(&d), "{d:?}");
    assert_eq!(job.members.len(), 4, "members change when the next round closes");
    // A node is never its own watcher.
    let job = beating(&["a", "b"], 2000, &[], 0);
    let (_, d) = report(&job, "b", "b", 5000, true, 2100);
    assert!(!lost(&d), "{d:?}");
}

#[test]
fn a_watcher_the_service_no_longer_hears_is_not_waited_for() {
    // b and d are lost together (d was one of b's two watchers): a's report is enough.
    let job = beating(&["a", "b", "c", "d"], 3000, &["b", "d"], 1500);
    let (_, d) = report(&job, "a", "b", 1400, false, 3000);
    assert!(lost(&d), "{d:?}");
}

#[test]
fn a_gone_agent_is_lost_at_once_unless_it_was_heard_after_the_report() {
    let job = beating(&["a", "b"], 2000, &[], 0);
    // b died at 2010; a's ping at 2050 came back "port unreachable".
    let (_, d) = report(&job, "a", "b", 150, true, 2060);
    assert!(lost(&d), "{d:?}");
    assert!(d.reason.contains("its agent gone"), "{}", d.reason);
    // A report that a later heartbeat contradicts does not count.
    let mut stale = job.clone();
    stale.health.get_mut("b").unwrap().reported(
        "a",
        &PeerReport { node_id: "b".into(), silent_ms: 0, gone: true },
        None,
        1990,
    );
    let (_, d) = tick(&stale, 2100);
    assert!(!lost(&d), "b's heartbeat at 2000 came after the report at 1990: {d:?}");
}

#[test]
fn reports_go_stale_unless_repeated() {
    let job = beating(&["a", "b"], 2000, &["b"], 1500);
    let (job, d) = report(&job, "a", "b", 300, false, 2000);
    assert!(!lost(&d));
    let job = hb(&job, "a", 3000);
    // 1.1 s later the report is stale (fresh for two heartbeat intervals): the old detector
    // alone decides, which waits for the TTL and the probes.
    let (_, d) = tick(&job, 3100);
    assert!(!lost(&d), "{d:?}");
    // The same report repeated is fresh: b is lost at once.
    let (_, d) = report(&job, "a", "b", 1400, false, 3100);
    assert!(lost(&d), "{d:?}");
}

#[test]
fn a_watcher_that_hears_the_node_again_takes_its_report_back() {
    // b's link dropped everything for 0.7 s: a reported it silent, then heard it again; b's own
    // heartbeat is held up by a retransmission and comes late.
    let job = beating(&["a", "b"], 2000, &["b"], 1500);
    let job = hb(&job, "b", 2000);
    let beat = |job: &Job, seq: u64, silent_ms: u64, now: Millis| {
        let peers = vec![PeerReport { node_id: "b".into(), silent_ms, gone: false }];
        let sent = Some(Sent { seq, slow: 0 });
        step(job, Event::Heartbeat { node_id: "a".into(), sent, probes: Vec::new(), peers }, now)
    };
    let (job, d) = beat(&job, 10, 600, 2650);
    assert!(!lost(&d), "{d:?}");
    let (job, d) = beat(&job, 11, 0, 2700);
    assert!(!lost(&d), "{d:?}");
    // The heartbeat carrying the first report arrives again late (a retransmission): ignored.
    let (job, d) = beat(&job, 10, 650, 2710);
    assert!(!lost(&d), "{d:?}");
    // Past the overdue mark, b's heartbeat still late: a heard it at 2700, so b stays.
    let (_, d) = tick(&job, 2800);
    assert!(!lost(&d), "{d:?}");
    assert_eq!(job.health["b"].peers["a"].last_sign, 2700);
}

#[test]
fn a_new_round_starts_without_the_last_rounds_reports() {
    let job = beating(&["a", "b", "c"], 2000, &[], 0);
    let (job, _) = report(&job, "a", "c", 100, false, 2010);
    assert!(!job.health["c"].peers.is_empty());
    let (job, d) = step(&job, Event::Leave { node_id: "b".into() }, 2020);
    assert!(matches!(d.action, Action::RoundOpened { .. }), "{d:?}");
    assert!(job.health.values().all(|h| h.peers.is_empty()), "{:?}", job.health);
}

#[test]
fn with_peer_watching_off_reports_are_ignored() {
    let s = JobSettings { peer_interval: Duration::ZERO, ..settings(1, 2) };
    let mut job = running(&["a", "b"], s);
    for t in (500..=2000).step_by(500) {
        job = hb(&hb(&job, "a", t), "b", t.min(1000));
    }
    let (_, d) = report(&job, "a", "b", 1000, true, 2100);
    assert!(!lost(&d), "{d:?}");
}

#[test]
fn reports_while_no_round_runs_are_ignored() {
    let mut job = Job::new(settings(3, 3), 0);
    job = join(&job, "a", 0).0;
    job = join(&job, "b", 10).0;
    let (job, d) = report(&job, "a", "b", 1000, true, 100);
    assert!(!lost(&d), "{d:?}");
    assert!(job.health.get("b").is_none_or(|h| h.peers.is_empty()), "nothing kept while forming");
}

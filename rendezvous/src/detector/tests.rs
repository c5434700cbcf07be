//! The detector with made-up clocks and arrival times.

use super::*;

const T: Timing = Timing { interval: 500, ttl: 2000, probe_timeout: 1000, peer_interval: 100, stall_bound: 500 };

/// A node heartbeating every `every` ms (sequence numbers 0, 1, …) until `until`.
fn steady(every: Millis, until: Millis) -> (Health, Millis) {
    let mut h = Health::default();
    let mut t = 0;
    let mut seq = 0;
    while t <= until {
        h.arrived(Some(Sent { seq, slow: 0 }), t);
        seq += 1;
        t += every;
    }
    (h, t - every)
}

/// The first time (to 10 ms) after `last` at which the node becomes suspected.
fn suspected_after(h: &Health, last: Millis) -> Millis {
    (last..last + 10_000).step_by(10).find(|&now| h.suspect_due(Some(last), now, &T)).expect("suspected within 10 s")
        - last
}

#[test]
fn phi_grows_with_the_silence_and_is_zero_early() {
    assert!(phi(0.0, 500.0, 100.0) < 0.01);
    assert!(phi(500.0, 500.0, 100.0) < 0.5);
    let mut last = 0.0;
    for ms in (600..5000).step_by(100) {
        let p = phi(ms as f64, 500.0, 100.0);
        assert!(p > last || p == f64::MAX, "phi rises: {p} at {ms} ms");
        last = p;
    }
    assert_eq!(phi(1e9, 500.0, 100.0), f64::MAX, "an underflowing tail is infinitely surprising");
}

#[test]
fn a_clean_link_is_suspected_soon_after_its_heartbeats_stop() {
    let (h, last) = steady(500, 20_000);
    let after = suspected_after(&h, last);
    // mean 500, spread at its floor (150 ms): phi 8 at about 500 + 5.2 × 150.
    assert!((1200..=1400).contains(&after), "suspected {after} ms after the last heartbeat");
    assert_eq!(h.verdict(Some(last), last + 600, &T), Verdict::Alive, "one late heartbeat is nothing");
}

#[test]
fn a_jittery_link_waits_longer_but_never_past_the_ttl() {
    // Arrivals 200 ms to 1.4 s apart (a lossy link with several heartbeats in flight).
    let mut h = Health::default();
    let gaps = [200, 1400, 300, 900, 500, 1300, 250, 700, 1100, 400, 600, 1200, 350, 800];
    let mut t = 0;
    for (i, g) in gaps.iter().cycle().take(40).enumerate() {
        t += g;
        h.arrived(Some(Sent { seq: i as u64, slow: 0 }), t);
    }
    let (mean, std) = h.intervals(&T);
    assert!(mean > 700.0 && std > 300.0, "mean {mean}, std {std}");
    assert_eq!(suspected_after(&h, t), T.ttl, "the spread pushes phi past the TTL, where the TTL takes over");
}

#[test]
fn a_new_node_is_suspected_by_the_ttl_alone_until_it_has_a_history() {
    let mut h = Health::default();
    for seq in 0..(MIN_ARRIVALS as u64 - 1) {
        h.arrived(Some(Sent { seq, slow: 0 }), seq * 500);
    }
    let last = (MIN_ARRIVALS as u64 - 2) * 500;
    assert_eq!(suspected_after(&h, last), T.ttl);
    h.arrived(Some(Sent { seq: 99, slow: 0 }), last + 500);
    assert!(suspected_after(&h, last + 500) < T.ttl, "with a history, phi speaks first");
}

#[test]
fn a_node_never_heard_from_is_suspected_at_once() {
    let h = Health::default();
    assert!(h.suspect_due(None, 0, &T));
    assert_eq!(h.verdict(None, 0, &T), Verdict::Suspected);
}

#[test]
fn nobody_reaching_a_suspected_node_by_the_deadline_makes_it_lost() {
    let (mut h, last) = steady(500, 5_000);
    let at = last + 1300;
    assert!(h.suspect_due(Some(last), at, &T));
    h.suspect(vec!["b".into(), "c".into()], at, &T);
    assert!(h.asks("b") && h.asks("c") && !h.asks("d"));
    assert!(h.probed("b", false));
    assert!(!h.probed("b", false), "one answer per prober and round");
    assert!(!h.probed("d", true), "an unasked prober cannot vouch");
    assert_eq!(h.verdict(Some(last), at + 999, &T), Verdict::Suspected, "probes still have time");
    assert_eq!(h.verdict(Some(last), at + 1000, &T), Verdict::Lost);
    assert_eq!(h.probes_missed, 1);
}

#[test]
fn without_probers_the_deadline_alone_decides() {
    let (mut h, last) = steady(500, 5_000);
    h.suspect(Vec::new(), last + 2000, &T);
    assert_eq!(h.verdict(Some(last), last + 2999, &T), Verdict::Suspected);
    assert_eq!(h.verdict(Some(last), last + 3000, &T), Verdict::Lost);
}

#[test]
fn a_node_one_member_reaches_stays_until_the_silence_limit() {
    let (mut h, last) = steady(500, 5_000);
    let mut now = last + 2000;
    h.suspect(vec!["b".into()], now, &T);
    // Reached in every probe round: suspected, not lost, round after round.
    while now + T.probe_timeout < last + T.silence_limit() {
        assert!(h.probed("b", true));
        now += T.probe_timeout;
        assert_eq!(h.verdict(Some(last), now, &T), Verdict::Suspected, "at {now}");
        h.suspect(vec!["b".into()], now, &T);
    }
    assert!(h.probed("b", true));
    let s = h.suspicion.clone().expect("suspected");
    assert_eq!(s.since, last + 2000, "renewals keep when the suspicion began");
    assert!(s.rounds >= 4);
    assert_eq!(h.verdict(Some(last), last + T.silence_limit() + T.probe_timeout, &T), Verdict::Lost);
}

#[test]
fn a_heartbeat_clears_the_suspicion() {
    let (mut h, last) = steady(500, 5_000);
    h.suspect(vec!["b".into()], last + 1500, &T);
    h.arrived(Some(Sent { seq: 99, slow: 0 }), last + 1700);
    assert_eq!(h.suspicion, None);
    assert_eq!(h.verdict(Some(last + 1700), last + 1800, &T), Verdict::Alive);
    assert!(!h.probed("b", true), "a late probe answer for a cleared suspicion is ignored");
}

#[test]
fn late_answers_the_sender_counted_are_loss_too() {
    // Over TCP nothing goes missing: a lost packet is retransmitted and the answer comes late.
    let mut h = Health::default();
    for seq in 0..20u64 {
        h.arrived(Some(Sent { seq, slow: seq / 4 }), seq * 500);
    }
    let loss = h.loss_rate().expect("a rate");
    assert!((loss - 0.25).abs() < 0.05, "{loss}");
}

#[test]
fn the_loss_rate_comes_from_sequence_numbers() {
    let mut h = Health::default();
    assert_eq!(h.loss_rate(), None);
    // 0..40, every fourth lost; the window keeps the last 32 arrivals.
    for seq in (0..40u64).filter(|s| s % 4 != 3) {
        h.arrived(Some(Sent { seq, slow: 0 }), seq * 500);
    }
    let loss = h.loss_rate().expect("a rate");
    assert!((loss - 0.25).abs() < 0.03, "{loss}");
    let (clean, _) = steady(500, 10_000);
    assert_eq!(clean.loss_rate(), Some(0.0));
    let mut unnumbered = Health::default();
    for t in 0..10 {
        unnumbered.arrived(None, t * 500);
    }
    assert_eq!(unnumbered.loss_rate(), None, "no sequence numbers, no rate");
}

#[test]
fn heartbeats_in_a_burst_do_not_shrink_the_expected_interval() {
    let mut h = Health::default();
    // Pairs 10 ms apart every second: the mean gap is about 500 ms, never below the interval.
    for i in 0..20u64 {
        h.arrived(Some(Sent { seq: 2 * i, slow: 0 }), i * 1000);
        h.arrived(Some(Sent { seq: 2 * i + 1, slow: 0 }), i * 1000 + 10);
    }
    let (mean, std) = h.intervals(&T);
    assert!(mean >= 500.0 && std > 400.0, "mean {mean}, std {std}");
}

#[test]
fn a_node_without_arrivals_that_members_reach_is_kept_until_the_silence_limit() {
    // On etcd a lapsed lease leaves no last arrival: the silence is counted from a TTL before
    // the suspicion began.
    let mut h = Health::default();
    h.suspect(vec!["a".into()], 10_000, &T);
    let mut now = 10_000;
    while now + T.probe_timeout < 10_000 - T.ttl + T.silence_limit() {
        assert!(h.probed("a", true));
        now += T.probe_timeout;
        assert_eq!(h.verdict(None, now, &T), Verdict::Suspected, "at {now}");
        h.suspect(vec!["a".into()], now, &T);
    }
    assert!(h.probed("a", true));
    assert_eq!(h.verdict(None, 10_000 - T.ttl + T.silence_limit() + T.probe_timeout, &T), Verdict::Lost);
}

#[test]
fn phi_never_reaches_the_threshold_within_two_and_a_half_intervals() {
    // The shortcut in suspect_due skips phi below 2.5 intervals of silence; whatever the
    // history, phi there is under the threshold.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for interval in [10, 100, 500, 5000] {
        let t = Timing { interval, ttl: interval * 4, probe_timeout: 1000, ..T };
        for _ in 0..200 {
            let mut h = Health::default();
            let mut at = 0;
            for seq in 0..WINDOW as u64 {
                at += interval / 2 + next() % (interval * 2);
                h.arrived(Some(Sent { seq, slow: 0 }), at);
            }
            let p = h.phi(at, at + interval * 5 / 2, &t);
            assert!(p < PHI_THRESHOLD, "phi {p} at 2.5 intervals (interval {interval})");
        }
    }
}

#[test]
fn without_arrival_times_a_silent_node_is_suspected_a_probe_timeout_before_its_ttl() {
    // Where no arrival times are kept (etcd), the silence alone: probes start at 1.25 s (the TTL
    // less the probe timeout, never within 2.5 intervals) and a miss makes it lost at the TTL.
    let h = Health::default();
    assert!(!h.suspect_due(Some(0), 1249, &T));
    assert!(h.suspect_due(Some(0), 1250, &T));
    let mut h = h;
    h.suspect(vec!["a".into()], 1250, &T);
    assert!(h.probed("a", false));
    assert_eq!(h.verdict(Some(0), 1999, &T), Verdict::Suspected, "never lost before a TTL of silence");
    assert_eq!(h.verdict(Some(0), 2250, &T), Verdict::Lost);
    // A node with arrivals is judged by phi, as before.
    let mut seen = Health::default();
    for i in 0..10 {
        seen.arrived(None, i * 500);
    }
    assert!(!seen.suspect_due(Some(4500), 4500 + 1250, &T), "the early rule is for nodes without arrivals");
    // A TTL shorter than the probes' time: 2.5 intervals still.
    let short = Timing { interval: 500, ttl: 1500, probe_timeout: 1000, ..T };
    assert_eq!(short.early_suspicion(), 1250);
}

use super::*;
use rlaunch::contract::WatchTarget;

const PING: Millis = 100;
const STALL: Millis = 500;

fn watch(ids: &[&str]) -> Event {
    Event::Watch(Some(PeerWatch {
        interval_ms: PING,
        stall_bound_ms: STALL,
        targets: ids
            .iter()
            .enumerate()
            .map(|(i, id)| WatchTarget {
                node_id: (*id).to_owned(),
                addr: HostPort::new("10.0.0.1", 9000 + i as u16).unwrap(),
            })
            .collect(),
    }))
}

/// A made-up link: each ping's echo is lost with probability `loss` (both ways together).
struct Link {
    state: u64,
    loss: f64,
}

impl Link {
    fn new(seed: u64, loss: f64) -> Link {
        Link { state: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, loss }
    }

    fn answers(&mut self) -> bool {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        (self.state >> 11) as f64 / (1u64 << 53) as f64 >= self.loss
    }
}

/// Runs `peers` for `ms` from `start`: every tick pings `target`, answered 5 ms later when
/// `link` says so; returns the reports seen (time, report) and the end time.
fn run(
    peers: &mut Peers,
    target: &str,
    link: &mut Link,
    start: Millis,
    ms: Millis,
) -> (Vec<(Millis, PeerReport)>, Millis) {
    let mut seen = Vec::new();
    let mut now = start;
    while now < start + ms {
        now += PING;
        peers.step(Event::Tick, now);
        if link.answers() {
            peers.step(Event::Answered { node_id: target.into() }, now + 5);
        }
        for r in peers.reports(now + 5) {
            seen.push((now + 5, r));
        }
    }
    (seen, now)
}

#[test]
fn a_target_that_stops_answering_is_reported_silent_after_the_stall_bound_and_a_ping() {
    let mut p = Peers::default();
    p.step(watch(&["b"]), 0);
    let (seen, now) = run(&mut p, "b", &mut Link::new(1, 0.0), 0, 10_000);
    assert!(seen.is_empty(), "{seen:?}");
    assert_eq!(p.threshold_of("b"), Some(STALL + PING));
    // b answered last at now + 5; then nothing.
    let last = now + 5;
    let mut t = now;
    let mut reported = None;
    while reported.is_none() {
        t += PING;
        let actions = p.step(Event::Tick, t);
        if actions.contains(&Action::Urgent) {
            reported = Some(t);
        }
    }
    let at = reported.unwrap();
    assert!((STALL + PING..STALL + 2 * PING).contains(&(at - last)), "reported {} ms after its last answer", at - last);
    let r = p.reports(at);
    assert_eq!(r, vec![PeerReport { node_id: "b".into(), silent_ms: at - last, gone: false }]);
    // An answer takes it back, and that is news too: for a while every heartbeat says that b
    // answers again (a silence of 0 ms), so the rendezvous drops the earlier report whatever
    // order the heartbeats arrive in.
    assert!(p.step(Event::Answered { node_id: "b".into() }, at + 10).contains(&Action::Urgent));
    assert_eq!(p.reports(at + 10), vec![PeerReport { node_id: "b".into(), silent_ms: 0, gone: false }]);
    assert_eq!(p.reports(at + 10 + RETRACT_FOR - 1).len(), 1);
    assert!(p.reports(at + 10 + RETRACT_FOR).is_empty());
}

#[test]
fn a_refused_ping_reports_the_target_gone_at_once() {
    let mut p = Peers::default();
    p.step(watch(&["b", "c"]), 0);
    // A refusal from a target that never answered says nothing (a firewall rejecting UDP).
    assert!(!p.step(Event::Refused { node_id: "c".into() }, 10).contains(&Action::Urgent));
    for i in 0..3 {
        p.step(Event::Answered { node_id: "c".into() }, 20 + i);
    }
    run(&mut p, "b", &mut Link::new(2, 0.0), 0, 1_000);
    let actions = p.step(Event::Refused { node_id: "c".into() }, 1_020);
    assert!(actions.contains(&Action::Urgent), "{actions:?}");
    let r = p.reports(1_020);
    assert_eq!(r.len(), 1);
    assert!(r[0].gone && r[0].node_id == "c", "{r:?}");
    // An unknown node's refusal is nobody's business.
    assert!(p.step(Event::Refused { node_id: "zz".into() }, 1_030).is_empty());
}

#[test]
fn lossy_links_raise_the_threshold_and_a_minute_of_loss_reports_nothing() {
    for (loss, seed) in [(0.0975, 5), (0.2775, 6), (0.51, 7)] {
        // 5, 15 and 30 % each way: an echo comes back with (1 - l)^2.
        let mut p = Peers::default();
        p.step(watch(&["b"]), 0);
        let (seen, _) = run(&mut p, "b", &mut Link::new(seed, loss), 0, 60_000);
        assert!(seen.is_empty(), "{loss}: {:?}", &seen[..seen.len().min(3)]);
        let th = p.threshold_of("b").unwrap();
        let expect = (FALSE_SILENCE.ln() / loss.ln()).ceil() as Millis * PING;
        assert!(th >= (STALL + PING).max(expect.saturating_sub(3 * PING)), "loss {loss}: threshold {th} ms");
        assert!(th <= 4_000, "loss {loss}: threshold {th} ms");
    }
}

#[test]
fn many_minutes_under_heavy_loss_stay_within_the_promised_false_silence_rate() {
    // 51 % of echoes lost for an hour, over 20 seeds: a report is allowed (the rate is about
    // 6e-4 a minute), a flood is not.
    let mut reports = 0;
    for seed in 0..20 {
        let mut p = Peers::default();
        p.step(watch(&["b"]), 0);
        let mut link = Link::new(100 + seed, 0.51);
        for tick in 1..=1_800u64 {
            let now = tick * PING;
            let said = p.step(Event::Tick, now);
            reports += said.iter().filter(|a| matches!(a, Action::Info(m) if m.contains("silent; telling"))).count();
            if link.answers() {
                p.step(Event::Answered { node_id: "b".into() }, now + 5);
            }
        }
    }
    assert!(reports <= 1, "{reports} silences reported in an hour of 51 % loss");
}

#[test]
fn a_paused_watcher_forgives_the_silence_its_own_pause_made() {
    let mut p = Peers::default();
    p.step(watch(&["b"]), 0);
    let (_, now) = run(&mut p, "b", &mut Link::new(3, 0.0), 0, 2_000);
    // This agent was stopped for 5 s: its next tick comes late, before the queued echoes, or
    // after one of them (another target's) was taken first.
    let mut other = p.clone();
    let actions = p.step(Event::Tick, now + 5_000);
    assert!(!actions.contains(&Action::Urgent), "{actions:?}");
    assert!(p.reports(now + 5_000).is_empty());
    assert!(other.step(Event::Answered { node_id: "zz".into() }, now + 5_000).is_empty());
    assert!(other.reports(now + 5_000).is_empty());
    assert!(!other.step(Event::Tick, now + 5_001).contains(&Action::Urgent));
    // But a target that stays silent after it is reported in time.
    let mut t = now + 5_000;
    while p.reports(t).is_empty() {
        t += PING;
        p.step(Event::Tick, t);
        assert!(t < now + 5_000 + 1_000, "never reported");
    }
}

#[test]
fn a_target_paused_for_less_than_the_stall_bound_is_never_reported() {
    let mut p = Peers::default();
    p.step(watch(&["b"]), 0);
    let (_, mut now) = run(&mut p, "b", &mut Link::new(4, 0.0), 0, 2_000);
    for _ in 0..50 {
        // 400 ms without echoes (the target stopped), then the queued pings are all answered.
        for _ in 0..4 {
            now += PING;
            p.step(Event::Tick, now);
            assert!(p.reports(now).is_empty(), "reported at {now}");
        }
        now += PING;
        p.step(Event::Tick, now);
        p.step(Event::Answered { node_id: "b".into() }, now + 5);
        assert!(p.reports(now + 5).is_empty());
        let (_, n) = run(&mut p, "b", &mut Link::new(now, 0.0), now, 1_000);
        now = n;
    }
}

#[test]
fn a_target_that_never_answered_is_not_reported_but_said_once() {
    let mut p = Peers::default();
    p.step(watch(&["b"]), 0);
    let (seen, _) = run(&mut p, "b", &mut Link::new(8, 1.0), 0, 10_000);
    assert!(seen.is_empty());
    let mut p = Peers::default();
    p.step(watch(&["b"]), 0);
    let mut said = 0;
    for i in 1..100 {
        said += p.step(Event::Tick, i * PING).iter().filter(|a| matches!(a, Action::Info(_))).count();
    }
    assert_eq!(said, 1);
}

#[test]
fn a_new_round_keeps_the_history_of_a_link_it_keeps_and_drops_the_rest() {
    let mut p = Peers::default();
    p.step(watch(&["b", "c"]), 0);
    // b's link lost 28 % of the echoes: its threshold is well above the floor.
    run(&mut p, "b", &mut Link::new(9, 0.28), 0, 10_000);
    let lossy = p.threshold_of("b").unwrap();
    assert!(lossy >= 900, "{lossy}");
    p.step(watch(&["b", "d"]), 10_000);
    assert_eq!(p.targets().map(|(id, _)| id.to_owned()).collect::<Vec<_>>(), ["b", "d"]);
    assert_eq!(p.threshold_of("b"), Some(lossy), "b's link is measured as before");
    assert!(p.threshold_of("d").unwrap() >= 2_000, "d's is new: nothing measured, a high threshold");
    assert!(p.reports(10_000).is_empty());
    // Ended round: nothing watched, nothing reported, no news.
    assert_eq!(p.step(Event::Watch(None), 1_100), Vec::<Action>::new());
    assert_eq!(p.targets().count(), 0);
}

//! Hang detection, pure: when a worker's progress stopped, and a report of where every rank
//! stands. No I/O and no clock reads: the supervisor (`driver.rs`) samples the workers (CPU time
//! from `/proc`, bytes of output, the explicit heartbeat file's count, Python stacks) and feeds
//! the samples here with the time; tests use made-up clocks.
//!
//! Progress needs no change to the training script: any output, CPU use above a small share of
//! a core by the worker's process tree (a rank blocked in a collective or asleep uses next to
//! none; background threads tick a little), or - sampled only once the cheap signals have been
//! quiet for a while - a Python stack that differs from the last one. A worker that sends the
//! explicit heartbeat is judged by its heartbeats alone from its first one: a rank spinning in a
//! GPU synchronisation or a busy-polling collective uses CPU while hung, and periodic output
//! (a store barrier's "waiting" line, a logger thread) goes on too.

use std::collections::BTreeMap;
use std::time::Duration;

pub use rlaunch::stacks::ranges;
use rlaunch::stacks::SHOWN_FRAMES;

/// Milliseconds on the supervisor's monotonic clock.
pub type Millis = u64;

/// CPU use below this share of one core is no sign of progress (idle threads of a blocked
/// process: a watchdog, a gloo or NCCL helper).
pub const MIN_CPU_SHARE: f64 = 0.1;

pub use rlaunch::contract::{HangTimeout, AUTO_FACTOR, AUTO_FLOOR};

/// One sample of one worker: counters that only grow while it works.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sample {
    /// User + system CPU time of the process, in clock ticks.
    pub cpu_ticks: u64,
    /// Bytes the worker wrote to stdout and stderr.
    pub output_bytes: u64,
    /// Explicit heartbeats (the heartbeat file's modification time, in ms, or a count).
    pub beats: u64,
    /// A digest of the worker's main-thread stack, when one was sampled.
    pub stack: Option<u64>,
}

#[derive(Debug, Clone, Default)]
struct Rank {
    last: Option<(Sample, Millis)>,
    progressed: Millis,
    /// Times of explicit heartbeats (or, for a rank that never sent one, of output), for `auto`.
    events: Vec<Millis>,
    beats_seen: bool,
    /// The longest gap between two events, over the whole run (for `auto`).
    longest: Millis,
    /// Exited: never hung.
    gone: bool,
}

/// Ranks whose progress stopped for the threshold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Indices of the stalled workers (local), the longest stalled first.
    pub stalled: Vec<usize>,
    pub quiet_for: Duration,
    pub threshold: Duration,
}

#[derive(Debug, Clone)]
pub struct Detector {
    timeout: HangTimeout,
    ticks_per_s: u64,
    ranks: Vec<Rank>,
}

impl Detector {
    pub fn new(timeout: HangTimeout, workers: usize, ticks_per_s: u64, now: Millis) -> Detector {
        Detector {
            timeout,
            ticks_per_s: ticks_per_s.max(1),
            ranks: vec![
                Rank {
                    last: None,
                    progressed: now,
                    events: Vec::new(),
                    beats_seen: false,
                    longest: 0,
                    gone: false
                };
                workers
            ],
        }
    }

    /// Records a sample of worker `i`; returns whether it showed progress.
    pub fn observe(&mut self, i: usize, s: Sample, now: Millis) -> bool {
        let Some(r) = self.ranks.get_mut(i) else { return false };
        let Some((prev, at)) = r.last.replace((s, now)) else {
            r.progressed = now;
            return true;
        };
        let elapsed_s = now.saturating_sub(at) as f64 / 1000.0;
        let cpu_s = s.cpu_ticks.saturating_sub(prev.cpu_ticks) as f64 / self.ticks_per_s as f64;
        let busy = elapsed_s > 0.0 && cpu_s >= MIN_CPU_SHARE * elapsed_s;
        let beat = s.beats != prev.beats;
        let wrote = s.output_bytes != prev.output_bytes;
        let moved = matches!((prev.stack, s.stack), (Some(a), Some(b)) if a != b);
        if beat && !r.beats_seen {
            // Heartbeats from now on time the steps, not output.
            r.beats_seen = true;
            r.events.clear();
        }
        if beat || (wrote && !r.beats_seen) {
            if let Some(prev) = r.events.last() {
                r.longest = r.longest.max(now.saturating_sub(*prev));
            }
            r.events.push(now);
            if r.events.len() > 64 {
                r.events.remove(0);
            }
        }
        let progressed = if r.beats_seen { beat } else { busy || beat || wrote || moved };
        if progressed {
            r.progressed = now;
        }
        progressed
    }

    /// Worker `i` exited (a rank that finished early is not hung while the others go on).
    pub fn retire(&mut self, i: usize) {
        if let Some(r) = self.ranks.get_mut(i) {
            r.gone = true;
        }
    }

    /// The threshold now: fixed, or learned (`auto`).
    pub fn threshold(&self) -> Duration {
        match self.timeout {
            HangTimeout::Fixed(d) => d,
            HangTimeout::Auto { factor, floor } => {
                let learned: Vec<Duration> = self
                    .ranks
                    .iter()
                    .filter_map(|r| {
                        let median = median_period(&r.events)?;
                        Some((Duration::from_millis(median) * factor).max(Duration::from_millis(r.longest) * 2))
                    })
                    .collect();
                match learned.into_iter().max() {
                    Some(t) => t.max(floor),
                    None => floor * 5,
                }
            }
        }
    }

    /// Whether stacks are worth sampling for worker `i` now: its cheap signals have been quiet
    /// for half the threshold.
    pub fn wants_stack(&self, i: usize, now: Millis) -> bool {
        self.ranks
            .get(i)
            .is_some_and(|r| Duration::from_millis(now.saturating_sub(r.progressed)) >= self.threshold() / 2)
    }

    /// Ranks quiet for the threshold, if any.
    pub fn verdict(&self, now: Millis) -> Option<Verdict> {
        let threshold = self.threshold();
        let mut stalled: Vec<(usize, Millis)> = self
            .ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.gone)
            .map(|(i, r)| (i, now.saturating_sub(r.progressed)))
            .filter(|(_, quiet)| Duration::from_millis(*quiet) >= threshold)
            .collect();
        stalled.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let quiet_for = Duration::from_millis(stalled.first()?.1);
        Some(Verdict { stalled: stalled.into_iter().map(|(i, _)| i).collect(), quiet_for, threshold })
    }
}

fn median_period(events: &[Millis]) -> Option<Millis> {
    if events.len() < 4 {
        return None;
    }
    let mut gaps: Vec<Millis> = events.windows(2).map(|w| w[1].saturating_sub(w[0])).collect();
    gaps.sort_unstable();
    Some(gaps[gaps.len() / 2])
}

/// One frame: `function (file:line)`, the file as its last path component.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frame {
    pub function: String,
    pub file: String,
    pub line: Option<u32>,
}

impl std::fmt::Display for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(l) => write!(f, "{} ({}:{l})", self.function, self.file),
            None => write!(f, "{} ({})", self.function, self.file),
        }
    }
}

/// The main thread's frames, innermost first, from `py-spy dump` output (the first thread
/// listed when none is named `MainThread`).
pub fn parse_py_spy(dump: &str) -> Vec<Frame> {
    let mut threads: Vec<(bool, Vec<Frame>)> = Vec::new();
    for line in dump.lines() {
        if line.starts_with("Thread ") {
            threads.push((line.contains("\"MainThread\""), Vec::new()));
            continue;
        }
        let Some((_, frames)) = threads.last_mut() else { continue };
        let t = line.trim();
        if !line.starts_with(' ') || t.is_empty() {
            continue;
        }
        // `function (path/file.py:123)`; py-spy may add locals below a frame (indented more).
        let Some(open) = t.rfind(" (") else { continue };
        let Some(inner) = t[open + 2..].strip_suffix(')') else { continue };
        let (path, line_no) = match inner.rsplit_once(':') {
            Some((p, n)) if n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty() => (p, n.parse().ok()),
            _ => (inner, None),
        };
        let file = path.rsplit('/').next().unwrap_or(path).to_owned();
        if file == crate::warm::BOOTSTRAP_FILE {
            // Below the program in a warm worker: not the program's, not in a cold one.
            continue;
        }
        frames.push(Frame { function: t[..open].to_owned(), file, line: line_no });
    }
    let main = threads.iter().position(|(m, _)| *m).unwrap_or(0);
    threads.into_iter().nth(main).map(|(_, f)| f).unwrap_or_default()
}

/// A stable digest of a stack (for "the stack moved").
pub fn digest(frames: &[Frame]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    frames.hash(&mut h);
    h.finish()
}

/// Where one rank stood: its frames (innermost first), or why there are none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stack {
    Frames(Vec<Frame>),
    Unavailable(String),
}

impl Stack {
    /// The one-line form: `f (a.py:4) <- g (b.py:12)`, at most a few frames; frames of the
    /// launcher's and the standard library's plumbing are kept (they are where ranks wait).
    pub fn line(&self) -> String {
        match self {
            Stack::Frames(f) if f.is_empty() => "no Python frames (not in Python code)".to_owned(),
            Stack::Frames(f) => {
                let mut s: Vec<String> = f.iter().take(SHOWN_FRAMES).map(Frame::to_string).collect();
                if f.len() > SHOWN_FRAMES {
                    s.push(format!("… {} more", f.len() - SHOWN_FRAMES));
                }
                s.join(" <- ")
            }
            Stack::Unavailable(why) => format!("{}: {why}", rlaunch::stacks::UNAVAILABLE),
        }
    }
}

impl Stack {
    fn waiting(&self) -> bool {
        match self {
            Stack::Frames(f) => f.iter().take(SHOWN_FRAMES).any(|f| rlaunch::stacks::frame_waits(&f.function, &f.file)),
            Stack::Unavailable(_) => false,
        }
    }
}

/// Ranks grouped by where they stand (the same frames), the odd one out first: groups not
/// waiting in a collective first, then smaller groups, then by lowest rank; ranks whose stack
/// could not be read last. Each line: `rank 1: f (a.py:4) <- main (a.py:12)`.
pub fn group(stacks: &BTreeMap<u32, Stack>) -> Vec<(Vec<u32>, Stack)> {
    let mut groups: Vec<(Vec<u32>, Stack)> = Vec::new();
    for (rank, stack) in stacks {
        match groups.iter_mut().find(|(_, s)| s == stack) {
            Some((ranks, _)) => ranks.push(*rank),
            None => groups.push((vec![*rank], stack.clone())),
        }
    }
    let key = |(ranks, stack): &(Vec<u32>, Stack)| {
        rlaunch::stacks::order_key(matches!(stack, Stack::Unavailable(_)), stack.waiting(), ranks.len(), ranks[0])
    };
    groups.sort_by_key(key);
    groups
}

/// How long a node holds a hang verdict. One whose ranks all wait in a collective most likely
/// waits for a rank elsewhere: in a job of several nodes it holds its verdict a quarter of the
/// threshold (2 s to 60 s), so that the node where the odd one out stands reports first and
/// names the culprit; this node's stacks join that report through the rendezvous. If no other
/// node reports meanwhile, this one does.
pub fn hold_verdict(groups: &[(Vec<u32>, Stack)], nodes: u32, threshold: Duration) -> Duration {
    let all_waiting = !groups.is_empty() && groups.iter().all(|(_, s)| s.waiting());
    if nodes > 1 && all_waiting {
        (threshold / 4).clamp(Duration::from_secs(2), Duration::from_secs(60))
    } else {
        Duration::ZERO
    }
}

/// The report's lines, one per group.
pub fn report_lines(stacks: &BTreeMap<u32, Stack>) -> Vec<String> {
    group(stacks).into_iter().map(|(ranks, stack)| rlaunch::stacks::line(&ranks, &stack.line())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Millis = 1000;

    fn busy(cpu_s: u64) -> Sample {
        Sample { cpu_ticks: cpu_s * 100, ..Sample::default() }
    }

    #[test]
    fn a_rank_that_stops_everything_is_hung_after_the_threshold_and_not_before() {
        let mut d = Detector::new(HangTimeout::Fixed(Duration::from_secs(10)), 2, 100, 0);
        for t in 0..=30 {
            // Rank 0 computes throughout; rank 1 stops after 5 s (its CPU flat, no output).
            d.observe(0, busy(t), t * S);
            d.observe(1, busy(t.min(5)), t * S);
            if t < 15 {
                assert_eq!(d.verdict(t * S), None, "at {t} s");
            }
        }
        let v = d.verdict(15 * S).expect("hung");
        assert_eq!(v.stalled, vec![1]);
        assert_eq!(v.quiet_for, Duration::from_secs(10));
    }

    #[test]
    fn a_rank_that_exited_is_not_hung_while_the_others_go_on() {
        let mut d = Detector::new(HangTimeout::Fixed(Duration::from_secs(5)), 2, 100, 0);
        for t in 0..=20 {
            d.observe(0, busy(t), t * S);
            if t <= 2 {
                d.observe(1, busy(t), t * S);
            } else {
                d.retire(1);
            }
        }
        assert_eq!(d.verdict(20 * S), None);
    }

    #[test]
    fn silence_on_the_console_while_computing_is_not_a_hang() {
        let mut d = Detector::new(HangTimeout::Fixed(Duration::from_secs(5)), 1, 100, 0);
        for t in 0..=60 {
            assert!(d.observe(0, busy(t), t * S));
        }
        assert_eq!(d.verdict(60 * S), None);
    }

    #[test]
    fn idle_threads_ticking_are_not_progress_but_output_heartbeats_and_a_moving_stack_are() {
        let mut d = Detector::new(HangTimeout::Fixed(Duration::from_secs(5)), 1, 100, 0);
        // 2 ticks (20 ms) a second: a watchdog thread of a blocked process.
        let idle = |t: u64| Sample { cpu_ticks: 2 * t, ..Sample::default() };
        d.observe(0, idle(0), 0);
        assert!(!d.observe(0, idle(1), S));
        assert!(d.observe(0, Sample { output_bytes: 10, ..idle(2) }, 2 * S), "output");
        let at = |stack, t| Sample { output_bytes: 10, stack: Some(stack), ..idle(t) };
        d.observe(0, at(7, 3), 3 * S);
        assert!(d.observe(0, at(8, 4), 4 * S), "the stack moved");
        assert!(!d.observe(0, at(8, 5), 5 * S), "the same stack");
        assert!(d.verdict(10 * S).is_some());
        assert!(d.observe(0, Sample { output_bytes: 10, beats: 1, ..idle(11) }, 11 * S), "heartbeat");
    }

    #[test]
    fn once_a_worker_beats_only_its_beats_are_progress() {
        let mut d = Detector::new(HangTimeout::Fixed(Duration::from_secs(5)), 1, 100, 0);
        d.observe(0, Sample { beats: 1, ..Sample::default() }, 0);
        assert!(d.observe(0, Sample { beats: 2, ..Sample::default() }, S));
        // Hung in a GPU synchronisation: the CPU spins, a logger thread prints, no beat.
        for t in 2..=7 {
            let spinning = Sample { beats: 2, cpu_ticks: 100 * t, output_bytes: t, stack: Some(t) };
            assert!(!d.observe(0, spinning, t * S), "at {t} s");
        }
        assert!(d.verdict(6 * S).is_some());
    }

    #[test]
    fn stacks_are_sampled_only_once_the_cheap_signals_are_quiet() {
        let mut d = Detector::new(HangTimeout::Fixed(Duration::from_secs(10)), 1, 100, 0);
        d.observe(0, busy(1), 0);
        assert!(!d.wants_stack(0, 4 * S));
        assert!(d.wants_stack(0, 5 * S));
    }

    #[test]
    fn auto_learns_the_threshold_from_the_step_period() {
        let floor = Duration::from_secs(3);
        let mut d = Detector::new(HangTimeout::Auto { factor: 10, floor }, 1, 100, 0);
        assert_eq!(d.threshold(), floor * 5, "nothing learned yet");
        // A heartbeat every 2 s.
        for (i, t) in [0u64, 2, 4, 6, 8, 10, 12, 14].iter().enumerate() {
            d.observe(0, Sample { beats: i as u64 + 1, ..Sample::default() }, t * S);
        }
        assert_eq!(d.threshold(), Duration::from_secs(20));
        // A 15 s checkpoint once: twice that from now on.
        d.observe(0, Sample { beats: 100, ..Sample::default() }, 29 * S);
        assert_eq!(d.threshold(), Duration::from_secs(30));
        // Fast steps: the floor holds.
        let mut d = Detector::new(HangTimeout::Auto { factor: 10, floor }, 1, 100, 0);
        for i in 0..10u64 {
            d.observe(0, Sample { output_bytes: i + 1, ..Sample::default() }, i * 50);
        }
        assert_eq!(d.threshold(), floor);
        assert_eq!(HangTimeout::parse("auto"), Ok(HangTimeout::Auto { factor: AUTO_FACTOR, floor: AUTO_FLOOR }));
        assert_eq!(HangTimeout::parse("2.5"), Ok(HangTimeout::Fixed(Duration::from_millis(2500))));
        assert!(HangTimeout::parse("-1").is_err() && HangTimeout::parse("soon").is_err());
        assert!(HangTimeout::parse("0.5").is_err(), "below the sampling period");
        let short = HangTimeout::parse("AUTO:5").unwrap();
        assert_eq!(short, HangTimeout::Auto { factor: AUTO_FACTOR, floor: Duration::from_secs(5) });
        for h in [short, HangTimeout::parse("auto").unwrap(), HangTimeout::parse("2.5").unwrap()] {
            assert_eq!(HangTimeout::parse(&h.to_string()), Ok(h), "{h}");
        }
        assert!(HangTimeout::parse("auto:0.2").is_err() && HangTimeout::parse("auto:").is_err());
    }

    const DUMP: &str = "Process 4242: python3 -u train.py\nPython v3.11.2 (/usr/bin/python3.11)\n\n\
Thread 4242 (idle): \"MainThread\"\n    stuck_here (job/train.py:4)\n    main (job/train.py:12)\n    <module> (job/train.py:20)\n\
Thread 4250 (idle): \"Thread-1\"\n    wait (threading.py:320)\n";

    #[test]
    fn a_py_spy_dump_gives_the_main_threads_frames_innermost_first() {
        let frames = parse_py_spy(DUMP);
        let shown: Vec<String> = frames.iter().map(Frame::to_string).collect();
        assert_eq!(shown, ["stuck_here (train.py:4)", "main (train.py:12)", "<module> (train.py:20)"]);
        assert_ne!(digest(&frames), digest(&frames[1..]));
        // A warm worker's: the same, without the bootstrap's frames below the program.
        let warm = DUMP.replace(
            "    <module> (job/train.py:20)\n",
            "    <module> (job/train.py:20)\n    _become (/tmp/rlaunch-warm-1-2/rlaunch_warm.py:130)\n    <module> (/tmp/rlaunch-warm-1-2/rlaunch_warm.py:170)\n",
        );
        assert_eq!(parse_py_spy(&warm), frames);
    }

    #[test]
    fn the_report_groups_ranks_and_puts_the_odd_one_out_first() {
        let waiting = Stack::Frames(vec![
            Frame { function: "all_reduce".into(), file: "distributed_c10d.py".into(), line: Some(2501) },
            Frame { function: "main".into(), file: "train.py".into(), line: Some(13) },
        ]);
        let mut stacks: BTreeMap<u32, Stack> = (0..8).map(|r| (r, waiting.clone())).collect();
        stacks.insert(1, Stack::Frames(parse_py_spy(DUMP)));
        stacks.insert(9, Stack::Unavailable("py-spy not found".into()));
        let lines = report_lines(&stacks);
        assert_eq!(lines[0], "rank 1: stuck_here (train.py:4) <- main (train.py:12) <- <module> (train.py:20)");
        assert_eq!(lines[1], "ranks 0, 2-7: all_reduce (distributed_c10d.py:2501) <- main (train.py:13)");
        assert_eq!(lines[2], "rank 9: stack unavailable: py-spy not found");
        // One against one: the rank in a collective is the one waiting.
        let two: BTreeMap<u32, Stack> =
            [(0, waiting.clone()), (1, Stack::Frames(parse_py_spy(DUMP)))].into_iter().collect();
        assert!(report_lines(&two)[0].starts_with("rank 1: stuck_here"));
        assert_eq!(ranges(&[5, 1, 2, 3, 9]), "1-3, 5, 9");
    }

    #[test]
    fn a_node_whose_ranks_all_wait_holds_its_verdict_only_in_a_job_of_several_nodes() {
        let waiting =
            Stack::Frames(vec![Frame { function: "all_reduce".into(), file: "c10d.py".into(), line: Some(1) }]);
        let stuck = Stack::Frames(parse_py_spy(DUMP));
        let t = Duration::from_secs(20);
        let all_wait = group(&[(0, waiting.clone()), (1, waiting.clone())].into_iter().collect());
        assert_eq!(hold_verdict(&all_wait, 2, t), Duration::from_secs(5));
        assert_eq!(hold_verdict(&all_wait, 1, t), Duration::ZERO, "alone, nobody else can report");
        let culprit_here = group(&[(0, waiting), (1, stuck)].into_iter().collect());
        assert_eq!(hold_verdict(&culprit_here, 2, t), Duration::ZERO);
        assert_eq!(hold_verdict(&all_wait, 2, Duration::from_secs(1)), Duration::from_secs(2), "floor");
        assert_eq!(hold_verdict(&all_wait, 2, Duration::from_secs(3600)), Duration::from_secs(60), "ceiling");
    }
}

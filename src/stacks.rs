//! The where-each-rank-stood report as it travels: one line per group of ranks at the same
//! place, `rank 1: stuck_here (train.py:4) <- main (train.py:12)` or
//! `ranks 0, 2-7: all_reduce (distributed_c10d.py:2501) <- main (train.py:13)`, the odd one out
//! first. Each agent groups its own ranks; the rendezvous merges the reports of every node into
//! one with [`merge`], in the same order. Pure.

use std::collections::BTreeMap;

use crate::contract::caps;

/// Functions where a rank waits for the others, whatever the file: torch.distributed's
/// collectives. A group whose innermost frames are in one is where the others stand, rarely the
/// odd one out.
pub const WAITING: &[&str] = &[
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast_object_list",
    "monitored_barrier",
];

/// Generic names that wait for the others only in a file of torch.distributed or CUDA
/// (`threading.py`'s `wait` is a rank's own business: a data loader's queue).
pub const WAITING_IN_TORCH: &[&str] =
    &["broadcast", "barrier", "gather", "scatter", "reduce", "send", "recv", "wait", "synchronize"];

/// Frames of a line that decide whether its ranks wait (the innermost ones).
pub const SHOWN_FRAMES: usize = 4;

/// How a line that says no stack could be read begins.
pub const UNAVAILABLE: &str = "stack unavailable";

/// The order of groups in a report: readable stacks before unavailable ones, ranks not waiting
/// in a collective before waiting ones, smaller groups before larger, then by lowest rank.
pub fn order_key(unavailable: bool, waiting: bool, size: usize, lowest: u32) -> (bool, bool, usize, u32) {
    (unavailable, waiting, size, lowest)
}

/// `0, 2-7, 9`.
pub fn ranges(ranks: &[u32]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        out.push(if i == j { sorted[i].to_string() } else { format!("{}-{}", sorted[i], sorted[j]) });
        i = j + 1;
    }
    out.join(", ")
}

/// Most spans one line may name (`0, 2, 4, …` of a rank each).
const MAX_SPANS: usize = 4096;

/// The spans of `0, 2-7, 9` (`[(0, 0), (2, 7), (9, 9)]`), not expanded; `None` for anything else.
pub fn parse_spans(s: &str) -> Option<Vec<(u32, u32)>> {
    let mut out = Vec::new();
    for part in s.split(", ") {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let r = part.parse::<u32>().ok()?;
                (r, r)
            }
        };
        if hi < lo || out.len() == MAX_SPANS {
            return None;
        }
        out.push((lo, hi));
    }
    Some(out)
}

/// The ranks of `0, 2-7, 9`, at most `1 << 20` of them; `None` for anything else.
pub fn parse_ranges(s: &str) -> Option<Vec<u32>> {
    let spans = parse_spans(s)?;
    let count: u64 = spans.iter().map(|(lo, hi)| u64::from(hi - lo) + 1).sum();
    (count <= 1 << 20).then(|| spans.into_iter().flat_map(|(lo, hi)| lo..=hi).collect())
}

/// The rank spans and the stack of one report line; `None` when it is not of that form.
pub fn parse_line(line: &str) -> Option<(Vec<(u32, u32)>, &str)> {
    let (who, stack) = line.split_once(": ")?;
    let ranks = who.strip_prefix("ranks ").or_else(|| who.strip_prefix("rank "))?;
    Some((parse_spans(ranks)?, stack))
}

/// Ranks a report names (lines not of the report's form name none).
pub fn ranks_named(lines: &[String]) -> u64 {
    lines.iter().filter_map(|l| parse_line(l)).flat_map(|(spans, _)| spans).map(|(lo, hi)| u64::from(hi - lo) + 1).sum()
}

/// A report line for `ranks` standing at `stack`.
pub fn line(ranks: &[u32], stack: &str) -> String {
    let who = if ranks.len() == 1 { format!("rank {}", ranks[0]) } else { format!("ranks {}", ranges(ranks)) };
    format!("{who}: {stack}")
}

/// Whether the one-line stack `f (a.py:4) <- g (b.py:12)` waits in a collective: one of
/// torch.distributed's collectives by name, or a generic name (`wait`, `recv`, `barrier`, …)
/// in a file of torch.distributed or CUDA (`threading.py`'s `wait` is a rank's own business).
pub fn stack_waits(stack: &str) -> bool {
    stack.split(" <- ").take(SHOWN_FRAMES).any(|frame| {
        let (function, file) = match frame.split_once(" (") {
            Some((f, rest)) => (f, rest.split(':').next().unwrap_or(rest).trim_end_matches(')')),
            None => (frame, ""),
        };
        frame_waits(function, file)
    })
}

/// [`stack_waits`] for one frame.
pub fn frame_waits(function: &str, file: &str) -> bool {
    WAITING.contains(&function)
        || (WAITING_IN_TORCH.contains(&function)
            && ["distributed", "c10d", "cuda", "nccl"].iter().any(|t| file.contains(t)))
}

/// Most ranks one merged report places.
pub const MAX_MERGED_RANKS: usize = 1 << 20;

/// Control characters of a peer's text shown as `?` (a log line or `rlaunch status` must not
/// take a terminal's escape sequences from it).
fn printable(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// One report from several: ranks at the same place (the same stack text) from any node are
/// one group, ordered as each node orders its own ([`order_key`]); a rank named twice keeps the
/// later report's place. Only ranks in `allowed` are kept (a node's own ranks), at most
/// [`MAX_MERGED_RANKS`]; lines not of the report's form are dropped, and the result keeps to
/// [`caps::STACK_LINES`] lines of at most [`caps::STACK_LINE`] bytes (the last says how many
/// groups were left out).
pub fn merge(reports: &[&[String]], allowed: std::ops::Range<u32>) -> Vec<String> {
    let mut texts: Vec<String> = Vec::new();
    let mut place: BTreeMap<u32, usize> = BTreeMap::new();
    for report in reports {
        for l in report.iter().take(4 * caps::STACK_LINES) {
            let Some((spans, stack)) = parse_line(l) else { continue };
            let stack = printable(&crate::cut::cut_end(stack, caps::STACK_LINE));
            let i = texts.iter().position(|t| *t == stack).unwrap_or_else(|| {
                texts.push(stack);
                texts.len() - 1
            });
            for (lo, hi) in spans.into_iter().filter(|_| !allowed.is_empty()) {
                // Only the part of the span inside `allowed`: a peer's `0-4294967295` costs
                // no more than its own ranks.
                let (lo, hi) = (lo.max(allowed.start), hi.min(allowed.end.saturating_sub(1)));
                for r in (lo..=hi).take(MAX_MERGED_RANKS.saturating_sub(place.len())) {
                    place.insert(r, i);
                }
            }
        }
    }
    let mut groups: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    for (rank, i) in &place {
        groups.entry(*i).or_default().push(*rank);
    }
    let mut groups: Vec<(&str, Vec<u32>)> = groups.into_iter().map(|(i, ranks)| (texts[i].as_str(), ranks)).collect();
    groups.sort_by_key(|(stack, ranks)| {
        order_key(stack.starts_with(UNAVAILABLE), stack_waits(stack), ranks.len(), ranks[0])
    });
    let mut lines: Vec<String> = groups.iter().map(|(stack, ranks)| line(ranks, stack)).collect();
    if lines.len() > caps::STACK_LINES {
        let left = lines.len() - (caps::STACK_LINES - 1);
        lines.truncate(caps::STACK_LINES - 1);
        lines.push(format!("[… {left} more groups]"));
    }
    lines.into_iter().map(|l| crate::cut::cut_end(&l, caps::STACK_LINE + 64)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(lines: &[&str]) -> Vec<String> {
        lines.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn ranges_round_trip_and_refuse_anything_else() {
        for ranks in [vec![0], vec![0, 1, 2, 5, 7, 8], vec![3, 9, 10, 11]] {
            assert_eq!(parse_ranges(&ranges(&ranks)), Some(ranks));
        }
        assert_eq!(ranges(&[7, 2, 3, 2]), "2-3, 7");
        assert_eq!(parse_spans("0-4294967295"), Some(vec![(0, u32::MAX)]), "a span is never expanded");
        for bad in ["", "a", "3-1", "1,2", "0-4294967295", "-1", "1-"] {
            assert_eq!(parse_ranges(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn two_nodes_reports_become_one_with_the_odd_one_out_first() {
        let a = v(&["ranks 0-1: all_reduce (distributed_c10d.py:2501) <- main (train.py:13)"]);
        let b = v(&[
            "rank 3: stuck_here (train.py:4) <- main (train.py:12)",
            "rank 2: all_reduce (distributed_c10d.py:2501) <- main (train.py:13)",
        ]);
        assert_eq!(
            merge(&[&a, &b], 0..u32::MAX),
            v(&[
                "rank 3: stuck_here (train.py:4) <- main (train.py:12)",
                "ranks 0-2: all_reduce (distributed_c10d.py:2501) <- main (train.py:13)",
            ])
        );
        // Merging again what was merged changes nothing; unavailable stacks go last.
        let merged = merge(&[&a, &b], 0..u32::MAX);
        let c = v(&["rank 9: stack unavailable: py-spy timed out"]);
        let again = merge(&[&merged, &b, &c], 0..u32::MAX);
        assert_eq!(&again[..2], &merged[..]);
        assert_eq!(again[2], "rank 9: stack unavailable: py-spy timed out");
    }

    #[test]
    fn generic_names_wait_only_in_torch_distributed_or_cuda_files() {
        assert!(stack_waits("all_reduce (distributed_c10d.py:2501) <- main (train.py:13)"));
        assert!(stack_waits("wait (distributed_c10d.py:90) <- main (train.py:13)"));
        assert!(!stack_waits("wait (threading.py:320) <- get (queue.py:171) <- main (train.py:9)"));
        assert!(!stack_waits("recv (connection.py:250) <- main (train.py:9)"));
    }

    #[test]
    fn a_merged_report_keeps_its_bounds() {
        let many: Vec<String> = (0..40).map(|r| format!("rank {r}: f{r} (x.py:{r})")).collect();
        let merged = merge(&[&many], 0..u32::MAX);
        assert_eq!(merged.len(), caps::STACK_LINES);
        assert_eq!(merged.last().unwrap(), &format!("[… {} more groups]", 40 - (caps::STACK_LINES - 1)));
        let long = vec![format!("rank 0: {}", "f (x.py:1) <- ".repeat(100))];
        assert!(merge(&[&long], 0..u32::MAX)[0].len() <= caps::STACK_LINE + 64);
    }

    #[test]
    fn a_peer_names_only_its_own_ranks_and_no_escape_sequence_gets_through() {
        // Node b holds ranks 4-7: what it says of others is dropped; a span of four billion
        // ranks costs four.
        let liar = v(&[
            "ranks 0-4294967295: f (x.py:1)",
            "rank 2: g (y.py:2)",
            "rank 5: \u{1b}[2Jh (z.py:3)",
            "not a report line",
        ]);
        assert_eq!(merge(&[&liar], 4..8), ["rank 5: ?[2Jh (z.py:3)", "ranks 4, 6-7: f (x.py:1)"]);
        let huge: Vec<String> = vec![format!(
            "ranks {}: f (x.py:1)",
            (0..5000).map(|r| (2 * r).to_string()).collect::<Vec<_>>().join(", ")
        )];
        assert!(merge(&[&huge], 0..u32::MAX).is_empty(), "more spans than a line may name: dropped");
    }
}

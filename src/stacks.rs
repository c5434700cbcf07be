//! The where-each-rank-stood report as it travels: one line per group of ranks at the same
//! place, `rank 1: stuck_here (train.py:4) <- main (train.py:12)` or
//! `ranks 0, 2-7: all_reduce (distributed_c10d.py:2501) <- main (train.py:13)`, the odd one out
//! first. Each agent groups its own ranks; the rendezvous merges the reports of every node into
//! one with [`merge`], in the same order. Pure.

use std::collections::BTreeMap;

use crate::contract::caps;

/// Functions where a rank waits for the others (torch.distributed's collectives and waits): a
/// group whose innermost frames are in one is where the others stand, rarely the odd one out.
pub const WAITING: &[&str] = &[
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
    "reduce",
    "send",
    "recv",
    "wait",
    "synchronize",
];

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

/// Most ranks one parsed range may stand for: a line from a peer that claims `0-4294967295`
/// must not make the service allocate billions of entries.
const MAX_RANKS: u32 = 1 << 20;

/// The inverse of [`ranges`]; `None` for anything else.
pub fn parse_ranges(s: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in s.split(", ") {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let r = part.parse::<u32>().ok()?;
                (r, r)
            }
        };
        if hi < lo || hi - lo >= MAX_RANKS || out.len() as u64 + u64::from(hi - lo) >= u64::from(MAX_RANKS) {
            return None;
        }
        out.extend(lo..=hi);
    }
    Some(out)
}

/// The ranks and the stack of one report line; `None` when it is not of that form.
pub fn parse_line(line: &str) -> Option<(Vec<u32>, &str)> {
    let (who, stack) = line.split_once(": ")?;
    let ranks = who.strip_prefix("ranks ").or_else(|| who.strip_prefix("rank "))?;
    Some((parse_ranges(ranks)?, stack))
}

/// A report line for `ranks` standing at `stack`.
pub fn line(ranks: &[u32], stack: &str) -> String {
    let who = if ranks.len() == 1 { format!("rank {}", ranks[0]) } else { format!("ranks {}", ranges(ranks)) };
    format!("{who}: {stack}")
}

/// Whether the one-line stack `f (a.py:4) <- g (b.py:12)` waits in a collective.
pub fn stack_waits(stack: &str) -> bool {
    stack.split(" <- ").take(SHOWN_FRAMES).any(|frame| {
        let function = frame.split(" (").next().unwrap_or(frame);
        WAITING.contains(&function)
    })
}

/// One report from several: ranks at the same place (the same stack text) from any node are
/// one group, ordered as each node orders its own ([`order_key`]); a rank named twice keeps the
/// later report's place. At most [`caps::STACK_LINES`] lines of at most [`caps::STACK_LINE`]
/// bytes: the last says how many groups were left out. Lines not of the report's form are
/// kept after the groups.
pub fn merge(reports: &[&[String]]) -> Vec<String> {
    let mut place: BTreeMap<u32, String> = BTreeMap::new();
    let mut other: Vec<String> = Vec::new();
    for report in reports {
        for l in report.iter() {
            match parse_line(l) {
                Some((ranks, stack)) => {
                    for r in ranks {
                        place.insert(r, stack.to_owned());
                    }
                }
                None if !other.contains(l) => other.push(l.clone()),
                None => {}
            }
        }
    }
    let mut groups: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (rank, stack) in &place {
        groups.entry(stack.as_str()).or_default().push(*rank);
    }
    let mut groups: Vec<(&str, Vec<u32>)> = groups.into_iter().collect();
    groups.sort_by_key(|(stack, ranks)| {
        order_key(stack.starts_with(UNAVAILABLE), stack_waits(stack), ranks.len(), ranks[0])
    });
    let mut lines: Vec<String> = groups.iter().map(|(stack, ranks)| line(ranks, stack)).collect();
    lines.extend(other);
    if lines.len() > caps::STACK_LINES {
        let left = lines.len() - (caps::STACK_LINES - 1);
        lines.truncate(caps::STACK_LINES - 1);
        lines.push(format!("[… {left} more groups]"));
    }
    lines.into_iter().map(|l| crate::contract::cut_end(&l, caps::STACK_LINE)).collect()
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
            merge(&[&a, &b]),
            v(&[
                "rank 3: stuck_here (train.py:4) <- main (train.py:12)",
                "ranks 0-2: all_reduce (distributed_c10d.py:2501) <- main (train.py:13)",
            ])
        );
        // Merging again what was merged changes nothing; unavailable stacks go last.
        let merged = merge(&[&a, &b]);
        let c = v(&["rank 9: stack unavailable: py-spy timed out"]);
        let again = merge(&[&merged, &b, &c]);
        assert_eq!(&again[..2], &merged[..]);
        assert_eq!(again[2], "rank 9: stack unavailable: py-spy timed out");
    }

    #[test]
    fn a_merged_report_keeps_its_bounds() {
        let many: Vec<String> = (0..40).map(|r| format!("rank {r}: f{r} (x.py:{r})")).collect();
        let merged = merge(&[&many]);
        assert_eq!(merged.len(), caps::STACK_LINES);
        assert_eq!(merged.last().unwrap(), &format!("[… {} more groups]", 40 - (caps::STACK_LINES - 1)));
        let long = vec![format!("rank 0: {}", "f (x.py:1) <- ".repeat(100))];
        assert!(merge(&[&long])[0].len() <= caps::STACK_LINE + 40);
        let liar = v(&["ranks 0-4294967295: f (x.py:1)"]);
        assert_eq!(merge(&[&liar]), liar, "kept as text, never expanded");
    }
}

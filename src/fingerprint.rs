//! A node's fingerprint: what must match across the nodes of a job for its ranks to agree —
//! python, torch, CUDA and NCCL versions, GPU model and driver, the `NCCL_*`, `GLOO_*` and
//! `CUDA_*` variables, a hash of the program. Each agent sends its own at join; the rendezvous
//! keeps each distinct one once, says at the round's close how the nodes differ, and with
//! `--fingerprint strict` refuses a node that differs from the job's first. Pure.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cut::cut_end;

/// `key → value`: `python`, `torch`, `cuda`, `nccl`, `gpu`, `driver`, `program`, and
/// `env NAME` for each variable.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fingerprint(pub BTreeMap<String, String>);

/// Bounds on what a node may send (refused beyond, naming the bound).
pub const MAX_ENTRIES: usize = 128;
pub const MAX_KEY: usize = 128;
pub const MAX_VALUE: usize = 1024;
/// Lines of a diff report; the last says how many more there were.
pub const MAX_REPORT_LINES: usize = 16;
/// Differences named per line.
const MAX_PER_LINE: usize = 8;

/// `--fingerprint`: log the differences (the default), or refuse a node that differs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    #[default]
    Log,
    Strict,
}

impl std::str::FromStr for Policy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Policy, UnknownPolicy> {
        match s.trim().to_ascii_lowercase().as_str() {
            "log" => Ok(Policy::Log),
            "strict" => Ok(Policy::Strict),
            other => Err(UnknownPolicy(other.to_owned())),
        }
    }
}

/// A `--fingerprint` value that is no [`Policy`] (held trimmed and in lower case).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is neither `log` nor `strict`")]
pub struct UnknownPolicy(pub String);

/// Why a rendezvous refuses a fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutOfBounds {
    /// How many entries this one has.
    #[error("a fingerprint has at most {max} entries (this one {0})", max = MAX_ENTRIES)]
    TooManyEntries(usize),
    /// The offending key, its control characters shown as `?` and cut to 64 bytes.
    #[error("fingerprint keys are 1 to {max_key} bytes and values at most {max_value} (`{0}`)", max_key = MAX_KEY, max_value = MAX_VALUE)]
    TooLong(String),
    #[error("fingerprint keys and values hold no control characters")]
    ControlCharacters,
}

impl Fingerprint {
    /// Whether it is within the bounds a rendezvous keeps.
    pub fn within_bounds(&self) -> Result<(), OutOfBounds> {
        if self.0.len() > MAX_ENTRIES {
            return Err(OutOfBounds::TooManyEntries(self.0.len()));
        }
        for (k, v) in &self.0 {
            if k.is_empty() || k.len() > MAX_KEY || v.len() > MAX_VALUE {
                return Err(OutOfBounds::TooLong(cut_end(&k.replace(char::is_control, "?"), 64)));
            }
            if k.chars().chain(v.chars()).any(char::is_control) {
                return Err(OutOfBounds::ControlCharacters);
            }
        }
        Ok(())
    }

    /// What differs from `reference`: `env NCCL_ALGO=Ring (not set there)`,
    /// `torch=2.5.0 (2.4.1 there)`, in key order.
    pub fn differences(&self, reference: &Fingerprint) -> Vec<String> {
        let keys: std::collections::BTreeSet<&String> = self.0.keys().chain(reference.0.keys()).collect();
        keys.into_iter()
            .filter_map(|k| {
                let (mine, theirs) = (self.0.get(k), reference.0.get(k));
                if mine == theirs {
                    return None;
                }
                let show = |v: Option<&String>| v.map_or("not set".to_owned(), |v| cut_end(v, 80));
                Some(match mine {
                    Some(_) => format!("{k}={} ({} there)", show(mine), show(theirs)),
                    None => format!("{k} not set ({} there)", show(theirs)),
                })
            })
            .collect()
    }
}

/// How the nodes of a round differ: one line per group of nodes that share a fingerprint other
/// than the reference group's (the nodes holding `reference`), naming what differs. Empty when
/// every node has the reference's. `groups`: digest → nodes; `known`: digest → fingerprint
/// (a digest not kept there is reported without its entries).
pub fn report(
    reference: &str,
    groups: &BTreeMap<String, Vec<String>>,
    known: &BTreeMap<String, Fingerprint>,
) -> Vec<String> {
    let nodes = |ids: &[String]| {
        let shown: Vec<&str> = ids.iter().take(3).map(String::as_str).collect();
        let more = ids.len().saturating_sub(3);
        if more > 0 {
            format!("{} and {more} more", shown.join(", "))
        } else {
            shown.join(", ")
        }
    };
    let total: usize = groups.values().map(Vec::len).sum();
    let Some(base) = groups.get(reference) else { return Vec::new() };
    let mut lines = Vec::new();
    for (digest, ids) in groups {
        if digest == reference {
            continue;
        }
        let what = match (known.get(digest), known.get(reference)) {
            (Some(mine), Some(theirs)) => {
                let d = mine.differences(theirs);
                let more = d.len().saturating_sub(MAX_PER_LINE);
                let mut s = d.into_iter().take(MAX_PER_LINE).collect::<Vec<_>>().join("; ");
                if more > 0 {
                    s += &format!("; and {more} more");
                }
                s
            }
            _ => "a fingerprint not kept (too many distinct ones)".to_owned(),
        };
        lines.push(format!(
            "{} of {total} node(s) ({}) differ from {} ({}): {what}",
            ids.len(),
            nodes(ids),
            base.len(),
            nodes(base)
        ));
    }
    if lines.len() > MAX_REPORT_LINES {
        let more = lines.len() - (MAX_REPORT_LINES - 1);
        lines.truncate(MAX_REPORT_LINES - 1);
        lines.push(format!("[… {more} more groups of nodes]"));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(pairs: &[(&str, &str)]) -> Fingerprint {
        Fingerprint(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn differences_name_each_key_with_both_values() {
        let a = fp(&[("torch", "2.5.0"), ("env NCCL_ALGO", "Ring"), ("python", "3.11.2")]);
        let b = fp(&[("torch", "2.4.1"), ("python", "3.11.2"), ("env NCCL_IB_HCA", "mlx5_1")]);
        assert_eq!(
            a.differences(&b),
            [
                "env NCCL_ALGO=Ring (not set there)",
                "env NCCL_IB_HCA not set (mlx5_1 there)",
                "torch=2.5.0 (2.4.1 there)"
            ]
        );
        assert!(a.differences(&a).is_empty());
    }

    #[test]
    fn the_report_names_the_odd_nodes_against_the_reference_group() {
        let known: BTreeMap<String, Fingerprint> =
            [("r".to_string(), fp(&[("env NCCL_X", "1")])), ("o".to_string(), fp(&[("env NCCL_X", "2")]))]
                .into_iter()
                .collect();
        let groups: BTreeMap<String, Vec<String>> = [
            ("r".to_string(), vec!["a".to_string(), "b".into(), "c".into(), "d".into()]),
            ("o".to_string(), vec!["e".to_string()]),
            ("u".to_string(), vec!["f".to_string()]),
        ]
        .into_iter()
        .collect();
        let lines = report("r", &groups, &known);
        assert_eq!(
            lines,
            [
                "1 of 6 node(s) (e) differ from 4 (a, b, c and 1 more): env NCCL_X=2 (1 there)",
                "1 of 6 node(s) (f) differ from 4 (a, b, c and 1 more): a fingerprint not kept (too many distinct ones)",
            ]
        );
        let same: BTreeMap<String, Vec<String>> = [("r".to_string(), vec!["a".to_string()])].into_iter().collect();
        assert!(report("r", &same, &known).is_empty());
    }

    #[test]
    fn bounds_are_checked_and_policies_parse() {
        assert!(fp(&[("k", &"v".repeat(MAX_VALUE + 1))]).within_bounds().is_err());
        assert!(fp(&[("", "v")]).within_bounds().is_err());
        assert!(fp(&[("env X", "\u{1b}[2J")]).within_bounds().unwrap_err().to_string().contains("control characters"));
        let many = Fingerprint((0..=MAX_ENTRIES).map(|i| (format!("k{i}"), String::new())).collect());
        assert!(many.within_bounds().unwrap_err().to_string().contains("at most 128 entries"));
        assert_eq!("STRICT".parse::<Policy>(), Ok(Policy::Strict));
        assert!("lax".parse::<Policy>().is_err());
    }
}

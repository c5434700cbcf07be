//! The transitions: [`apply`] (or [`apply_in_place`]) runs one [`Event`] against a [`Job`]: a
//! join, a heartbeat, a tick, a failure or success report, stacks, progress, a leave; and the
//! rounds they open, form and close (noted in the job's [`Accounting`](super::Accounting)).

use std::collections::{BTreeMap, HashMap, HashSet};

use super::event::{decide, reject, Action, Decision, Event, Rejection, RoundCause};
use super::job::{FailureKind, Job, MemberIndex, Pending, Phase};
use super::node::{fingerprint_digest, fingerprint_summary, validate_node, MAX_FINGERPRINTS};
use super::recovery::{MarkKind, NAMED_NODES};
use super::settings::{JobSettings, Millis, SCALE_UP_TTLS};
use crate::detector::peers::MAX_REPORTS;
use crate::detector::{PeerReport, ProbeReport, Sent};
use rlaunch::contract::{Member, NodeInfo, NodeProgress, RootCause, SnapshotSet};

/// Applies one event to a job at time `now`. Pure: the same inputs give the same outputs.
/// A rejected event returns the job unchanged.
pub fn apply(job: &Job, ev: Event, now: Millis) -> (Job, Decision) {
    let mut next = job.clone();
    let decision = apply_in_place(&mut next, ev, now);
    if matches!(decision.action, Action::Rejected(_)) {
        return (job.clone(), decision);
    }
    (next, decision)
}

/// [`apply`] without the copy, for stores that hold the job themselves (a heartbeat should not
/// clone a thousand-node job). Every rejection is decided before anything is touched, so a
/// rejected event leaves `job` as it was (the unit tests check both forms agree on every step).
pub fn apply_in_place(job: &mut Job, ev: Event, now: Millis) -> Decision {
    let version = job.version;
    let next = job;
    let ticked = matches!(ev, Event::Tick);
    // Stacks arriving change no round and say nothing of the job's last transition.
    let keeps_reason = matches!(ev, Event::ReportStacks { .. } | Event::Progress { .. });
    let decision = match ev {
        Event::Join(node) => join(next, node, now),
        Event::Heartbeat { node_id, sent, probes, peers } => heartbeat(next, &node_id, sent, &probes, &peers, now),
        Event::Tick => tick(next, now),
        Event::ReportFailure { node_id, round, root_cause } => report_failure(next, &node_id, round, *root_cause, now),
        Event::NodeSucceeded { node_id, round } => node_succeeded(next, &node_id, round, now),
        Event::Leave { node_id } => leave(next, &node_id, now),
        Event::ReportStacks { node_id, round, stacks } => report_stacks(next, &node_id, round, &stacks),
        Event::Progress { node_id, round, progress: p } => progress(next, &node_id, round, &p, now),
    };
    if matches!(decision.action, Action::Finished | Action::Failed) {
        let state = next.phase.name().to_owned();
        next.accounting.mark(now, MarkKind::Ended { state });
    }
    if ticked && !next.phase.is_terminal() {
        next.prune_health();
        let t = next.settings.timing();
        for h in next.health.values_mut().filter(|h| !h.peers.is_empty()) {
            h.forget_stale_reports(now, &t);
        }
    }
    match decision.action {
        Action::Rejected(_) | Action::Nothing | Action::HeartbeatRecorded => {}
        Action::Updated if keeps_reason => {}
        Action::Updated => next.last_reason = decision.reason.clone(),
        Action::RoundOpened { .. } | Action::RoundClosed { .. } | Action::Finished | Action::Failed => {
            next.version = version + 1;
            next.last_reason = decision.reason.clone();
        }
    }
    decision
}

// Beside its callers below: the job's state module knows nothing of events and rejections.
impl Job {
    fn rejection_if_terminal(&self) -> Option<Rejection> {
        match &self.phase {
            Phase::Finished { .. } => Some(Rejection::JobFinished),
            Phase::Failed { kind, reason, .. } => Some(Rejection::JobFailed { kind: *kind, reason: reason.clone() }),
            _ => None,
        }
    }
}

fn join(job: &mut Job, mut node: NodeInfo, now: Millis) -> Decision {
    if let Err(r) = validate_node(&node) {
        return reject(r);
    }
    // A node of the job this one replaced learns that job's end.
    if let Some(earlier) = job.earlier.as_ref().filter(|e| e.nodes.contains(&node.node_id)) {
        return reject(match &earlier.end {
            Phase::Failed { kind, reason, .. } => Rejection::JobFailed { kind: *kind, reason: reason.clone() },
            _ => Rejection::JobFinished,
        });
    }
    if let Some(r) = job.rejection_if_terminal() {
        return reject(r);
    }
    // The job keeps each distinct fingerprint once, bounded; the node's pending entry keeps
    // the digest of the whole.
    let fingerprint = node.fingerprint.take().map(|fp| (fingerprint_digest(&fp), fingerprint_summary(&fp)));
    let strict = job.settings.fingerprint == Some(rlaunch::fingerprint::Policy::Strict);
    if strict && fingerprint.is_none() {
        return reject(Rejection::FingerprintMismatch {
            message: format!("--fingerprint strict: node {} sent no fingerprint (an older agent?)", node.node_id),
        });
    }
    if let (true, Some((digest, fp)), Some(reference)) = (strict, &fingerprint, &job.fingerprint_reference) {
        if digest != reference {
            let what = match job.fingerprints.get(reference) {
                Some(r) => fp.differences(r).join("; "),
                None => "its fingerprint is not the job's".to_owned(),
            };
            return reject(Rejection::FingerprintMismatch {
                message: format!(
                    "--fingerprint strict: node {} differs from the job's first node: {}",
                    node.node_id,
                    rlaunch::contract::cut_end(&what, 2048)
                ),
            });
        }
    }
    let fingerprint_digest = fingerprint.map(|(digest, fp)| {
        job.fingerprint_reference.get_or_insert_with(|| digest.clone());
        if !job.fingerprints.contains_key(&digest) && job.fingerprints.len() < MAX_FINGERPRINTS {
            job.fingerprints.insert(digest.clone(), fp);
        }
        digest
    });
    let id = node.node_id.clone();
    job.last_seen.insert(id.clone(), now);
    job.health.entry(id.clone()).or_default().arrived(None, now);
    if matches!(job.phase, Phase::Running { .. }) && job.is_member(&id) {
        let same = job
            .members
            .iter()
            .any(|m| m.node_id == id && m.store_addr == node.store_addr && m.local_world_size == node.local_world_size);
        if same {
            // Retried or failed-over join: idempotent.
            return decide(Action::Nothing, format!("node {id} is already a member of running round {}", job.round));
        }
        // The member stopped its workers by itself and comes back with a new store: the others'
        // workers point at its old one, so the round must re-form (it keeps its place).
        let round = job.round;
        job.pending.push(Pending { node, joined_at: now, fingerprint_digest });
        let reason = format!("member {id} of running round {round} joined again with new details");
        return open_round(job, now, RoundCause::MemberRejoined { node_id: id }, &[], reason);
    }
    let (newly, changed_info) = match job.pending.get_mut(&id) {
        Some(p) => {
            let changed = p.node != node || p.fingerprint_digest != fingerprint_digest;
            p.node = node;
            p.fingerprint_digest = fingerprint_digest;
            if !changed && !job.phase.is_forming() {
                return decide(Action::Nothing, format!("node {id} is already waiting"));
            }
            (false, changed)
        }
        None => {
            job.pending.push(Pending { node, joined_at: now, fingerprint_digest });
            // New nodes only: a survivor coming back for the next round is no news.
            let survivor = job.previous.contains(&id);
            if !survivor && (job.pending.len() <= NAMED_NODES || matches!(job.phase, Phase::Running { .. })) {
                job.accounting.mark(now, MarkKind::Joined { node: id.clone() });
            }
            (true, false)
        }
    };
    if matches!(job.phase, Phase::Running { .. }) {
        let max = job.settings.max_nodes as usize;
        if job.members.len() < max {
            // A join alone costs nothing to send: the running round is torn down only for a node
            // that keeps heartbeating ([`Job::scale_up_candidate`], at a tick).
            let reason = format!(
                "node {id} waits to join running round {} with {} of at most {max} nodes: scale-up once it \
                 has heartbeated for {:?}",
                job.round,
                job.members.len(),
                job.settings.node_ttl.saturating_mul(SCALE_UP_TTLS)
            );
            return decide(Action::Updated, reason);
        }
        return decide(
            Action::Updated,
            format!("node {id} waits as a standby: round {} runs at MAX ({max}) nodes", job.round),
        );
    }
    // A repeated join (long-poll retry) must not bump the version, or every waiter would wake
    // every other waiter forever.
    let base = if newly {
        format!("node {id} joined forming round {}", job.round)
    } else if changed_info {
        format!("node {id} rejoined forming round {} with new details", job.round)
    } else {
        String::new()
    };
    evaluate_forming(job, now, base)
}

fn heartbeat(
    job: &mut Job,
    node_id: &str,
    sent: Option<Sent>,
    probes: &[ProbeReport],
    peers: &[PeerReport],
    now: Millis,
) -> Decision {
    if let Some(r) = job.rejection_if_terminal() {
        return reject(r);
    }
    let Some(seen) = job.last_seen.get_mut(node_id) else {
        return reject(Rejection::UnknownNode { node_id: node_id.to_owned() });
    };
    *seen = (*seen).max(now);
    job.health.entry(node_id.to_owned()).or_default().arrived(sent, now);
    let mut notes = Vec::new();
    for p in probes {
        if p.node_id == node_id {
            continue;
        }
        if job.health.get_mut(&p.node_id).is_some_and(|h| h.probed(node_id, p.reached)) {
            let how = if p.reached { "reached" } else { "could not reach" };
            notes.push(format!("{node_id} {how} suspected node {}", p.node_id));
        }
    }
    if let Some(d) = peer_reports(job, node_id, peers, sent.map(|s| s.seq), now) {
        return d;
    }
    if notes.is_empty() {
        decide(Action::HeartbeatRecorded, format!("heartbeat from {node_id}"))
    } else {
        decide(Action::Updated, format!("probe: {}", notes.join("; ")))
    }
}

/// Takes `watcher`'s reports on the members it watches (any other report is ignored: no node
/// speaks of one it was not given), and ends the round at once for those its watchers now find
/// lost ([`crate::detector::peers`]), without waiting for the tick.
fn peer_reports(job: &mut Job, watcher: &str, peers: &[PeerReport], seq: Option<u64>, now: Millis) -> Option<Decision> {
    if peers.is_empty() || !matches!(job.phase, Phase::Running { .. }) {
        return None;
    }
    let mut reported: Vec<String> = Vec::new();
    for r in peers.iter().take(MAX_REPORTS) {
        if reported.contains(&r.node_id) || !job.watchers_of(&r.node_id).contains(&watcher) {
            continue;
        }
        // On etcd a member's health exists only while there is something to remember.
        job.health.entry(r.node_id.clone()).or_default().reported(watcher, r, seq, now);
        reported.push(r.node_id.clone());
    }
    let lost: Vec<String> =
        reported.into_iter().filter(|id| !job.succeeded.contains(id) && job.lapsed(id, now)).collect();
    if lost.is_empty() {
        return None;
    }
    let details: Vec<String> = lost.iter().map(|id| job.loss_detail(id, now)).collect();
    let reason = format!("node(s) {} of round {} lost: node loss", details.join(", "), job.round);
    Some(open_round(job, now, RoundCause::NodeLost { nodes: lost.clone() }, &lost, reason))
}

fn tick(job: &mut Job, now: Millis) -> Decision {
    if job.phase.is_terminal() {
        return decide(Action::Nothing, "job is over");
    }
    let suspects_before = job.suspects.clone();
    let mut suspicions = job.update_suspicions(now);
    let now_suspected: HashSet<&String> = job.suspects.iter().collect();
    let cleared: Vec<&str> = suspects_before
        .iter()
        .filter(|id| !now_suspected.contains(id) && job.health.contains_key(*id))
        .map(String::as_str)
        .collect();
    if !cleared.is_empty() {
        suspicions.push(format!("node(s) {} heard from again: no longer suspected", cleared.join(", ")));
    }
    let before = (job.pending.len(), job.previous.len());
    let mut dropped: Vec<String> = job
        .pending
        .iter()
        .map(|p| p.node.node_id.clone())
        .chain(job.previous.iter().cloned())
        .filter(|id| job.lapsed(id, now))
        .collect();
    dropped.sort();
    dropped.dedup();
    let mut notes = suspicions;
    if !dropped.is_empty() {
        let details: Vec<String> = dropped.iter().map(|id| job.loss_detail(id, now)).collect();
        notes.push(format!("node(s) {} lost and dropped", details.join(", ")));
    }
    job.pending.retain(|p| dropped.binary_search(&p.node.node_id).is_err());
    job.previous.retain(|id| dropped.binary_search(id).is_err());
    let note = notes.join("; ");

    match job.phase {
        Phase::Running { .. } => {
            let lost: Vec<String> = job
                .members
                .iter()
                .map(|m| m.node_id.clone())
                .filter(|id| !job.succeeded.contains(id) && job.lapsed(id, now))
                .collect();
            if !lost.is_empty() {
                let details: Vec<String> = lost.iter().map(|id| job.loss_detail(id, now)).collect();
                let prefix = if note.is_empty() { String::new() } else { format!("{note}; ") };
                let reason = format!("{prefix}node(s) {} of round {} lost: node loss", details.join(", "), job.round);
                return open_round(job, now, RoundCause::NodeLost { nodes: lost.clone() }, &lost, reason);
            }
            // Succeeded members may go quiet; forget them without disturbing the round.
            let quiet: Vec<String> = job.succeeded.iter().filter(|id| job.lapsed(id, now)).cloned().collect();
            for id in &quiet {
                job.last_seen.remove(id);
                job.health.remove(id);
            }
            job.prune_last_seen();
            if let Some(id) = job.scale_up_candidate(now) {
                let prefix = if note.is_empty() { String::new() } else { format!("{note}; ") };
                let reason = format!(
                    "{prefix}node {id} has waited and heartbeated for {:?} beside running round {} with {} of at \
                     most {} nodes: scale-up",
                    job.settings.node_ttl.saturating_mul(SCALE_UP_TTLS),
                    job.round,
                    job.members.len(),
                    job.settings.max_nodes
                );
                return open_round(job, now, RoundCause::ScaleUp { node_id: id }, &[], reason);
            }
            if !note.is_empty() {
                decide(Action::Updated, note)
            } else {
                decide(Action::Nothing, "nothing due")
            }
        }
        Phase::Waiting { .. } | Phase::LastCall { .. } => {
            job.prune_last_seen();
            let changed = before != (job.pending.len(), job.previous.len()) || !note.is_empty();
            let d = evaluate_forming(job, now, note);
            if d.action == Action::Nothing && changed {
                decide(Action::Updated, d.reason)
            } else {
                d
            }
        }
        Phase::Finished { .. } | Phase::Failed { .. } => decide(Action::Nothing, "job is over"),
    }
}

fn report_failure(job: &mut Job, node_id: &str, round: u64, root_cause: RootCause, now: Millis) -> Decision {
    if job.last_failure_round == Some(round) && !root_cause.stacks.is_empty() {
        // A second node that saw the same round fail (both saw a hang at once): the failure
        // counts once, its ranks' places join the report.
        return report_stacks(job, node_id, round, &root_cause.stacks);
    }
    if job.phase.is_terminal() {
        return decide(Action::Nothing, format!("failure report from {node_id} ignored: the job is over"));
    }
    if round != job.round || !matches!(job.phase, Phase::Running { .. }) {
        return decide(
            Action::Nothing,
            format!(
                "failure report from {node_id} for round {round} ignored: round {} is {} (a failure counts once per round)",
                job.round,
                job.phase.name()
            ),
        );
    }
    if !job.is_member(node_id) {
        return reject(Rejection::NotMember { node_id: node_id.to_owned(), round });
    }
    let summary = root_cause.summary();
    job.accounting.mark(now, MarkKind::Failure { node: node_id.to_owned(), rank: root_cause.rank });
    let mut root_cause = root_cause;
    // The reporting node speaks for its own ranks only.
    let own = job.member(node_id).map(Member::ranks).unwrap_or(0..0);
    root_cause.stacks = rlaunch::stacks::merge(&[&root_cause.stacks], own);
    job.last_root_cause = Some(root_cause);
    job.last_failure_round = Some(round);
    let budget = job.settings.max_restarts;
    if job.restart_count < budget {
        job.restart_count += 1;
        let reason = format!(
            "worker failure on node {node_id} in round {round}: restart {} of {budget}; root cause: {summary}",
            job.restart_count
        );
        open_round(job, now, RoundCause::Failure { node_id: node_id.to_owned() }, &[], reason)
    } else {
        let reason = format!(
            "restart budget exhausted ({budget} restarts used); last failure on node {node_id} in round {round}: {summary}"
        );
        job.phase = Phase::Failed { at: now, kind: FailureKind::RestartBudget, reason: reason.clone() };
        decide(Action::Failed, reason)
    }
}

/// Merges where `node_id`'s ranks stood into the root cause of the failure that ended `round`.
fn report_stacks(job: &mut Job, node_id: &str, round: u64, stacks: &[String]) -> Decision {
    // Only a member of the round, holding its key (a job run without node identity, as in the
    // machine's own tests, has none), and only of its own ranks.
    let keyed = job.keys.is_empty() || job.keys.contains_key(node_id);
    let Some(own) = job.member(node_id).filter(|_| keyed).map(Member::ranks) else {
        return reject(Rejection::UnknownNode { node_id: node_id.to_owned() });
    };
    let Some(rc) = job.last_root_cause.as_mut().filter(|_| job.last_failure_round == Some(round)) else {
        return decide(
            Action::Nothing,
            format!("stacks from {node_id} for round {round} ignored: no failure of that round to add them to"),
        );
    };
    let mine = rlaunch::stacks::merge(&[stacks], own);
    // What the report holds came in the same way, each node's within its own ranks.
    let merged = rlaunch::stacks::merge(&[&rc.stacks, &mine], 0..u32::MAX);
    if merged == rc.stacks {
        return decide(Action::Nothing, format!("stacks from {node_id} for round {round} already in the report"));
    }
    rc.stacks = merged;
    decide(Action::Updated, format!("where the ranks of {node_id} stood in round {round} added to the root cause"))
}

fn node_succeeded(job: &mut Job, node_id: &str, round: u64, now: Millis) -> Decision {
    if job.phase.is_terminal() {
        return decide(Action::Nothing, format!("success of {node_id} noted after the job ended"));
    }
    if round != job.round || !matches!(job.phase, Phase::Running { .. }) {
        return decide(
            Action::Nothing,
            format!(
                "success report from {node_id} for round {round} ignored: round {} is {}",
                job.round,
                job.phase.name()
            ),
        );
    }
    if !job.is_member(node_id) {
        return reject(Rejection::NotMember { node_id: node_id.to_owned(), round });
    }
    if job.succeeded.contains(node_id) {
        return decide(Action::Nothing, format!("success of {node_id} already noted"));
    }
    job.succeeded.push(node_id.to_owned());
    if let Some(h) = job.health.get_mut(node_id) {
        h.suspicion = None;
    }
    // Only members' successes are noted, each once: all succeeded when the counts agree.
    if job.succeeded.len() == job.members.len() {
        job.phase = Phase::Finished { at: now };
        job.pending.clear();
        return decide(Action::Finished, format!("every member of round {} succeeded: job finished", job.round));
    }
    decide(
        Action::Updated,
        format!(
            "node {node_id} succeeded in round {round} ({} of {} members done); the others carry on",
            job.succeeded.len(),
            job.members.len()
        ),
    )
}

fn leave(job: &mut Job, node_id: &str, now: Millis) -> Decision {
    if job.phase.is_terminal() {
        job.last_seen.remove(node_id);
        job.health.remove(node_id);
        return decide(Action::Nothing, format!("node {node_id} left after the job ended"));
    }
    let was_pending = job.is_pending(node_id);
    let was_previous = job.previous.contains(node_id);
    // The id is free again: an agent that joins with it later is a new node.
    job.keys.remove(node_id);
    job.pending.remove(node_id);
    job.previous.remove(node_id);
    if matches!(job.phase, Phase::Running { .. }) && job.is_member(node_id) {
        job.last_seen.remove(node_id);
        job.health.remove(node_id);
        if job.succeeded.contains(node_id) {
            return decide(Action::Updated, format!("node {node_id} left after succeeding"));
        }
        let reason = format!("node {node_id} left running round {}", job.round);
        let gone = [node_id.to_owned()];
        return open_round(job, now, RoundCause::MemberLeft { node_id: node_id.to_owned() }, &gone, reason);
    }
    if !was_pending && !was_previous && !job.last_seen.contains_key(node_id) {
        return decide(Action::Nothing, format!("node {node_id} left but was not known"));
    }
    job.last_seen.remove(node_id);
    job.health.remove(node_id);
    let base = format!("node {node_id} left");
    if job.phase.is_forming() {
        let d = evaluate_forming(job, now, base);
        if d.action == Action::Nothing {
            return decide(Action::Updated, d.reason);
        }
        return d;
    }
    decide(Action::Updated, base)
}

/// Tears the running (or forming) round down and opens the next: `gone` nodes are not
/// expected back; surviving members are, in their old rank order.
pub(super) fn open_round(job: &mut Job, now: Millis, cause: RoundCause, gone: &[String], reason: String) -> Decision {
    let (kind, fault, fault_at) = fault_of(job, &cause, now);
    if let RoundCause::NodeLost { nodes } = &cause {
        job.accounting.mark(now, MarkKind::Lost { nodes: nodes.iter().take(NAMED_NODES).cloned().collect() });
    }
    job.accounting.round_opened(now, job.round + 1, kind, fault, fault_at);
    job.round += 1;
    let survivors: Vec<String> =
        job.members.iter().map(|m| m.node_id.clone()).filter(|id| !gone.contains(id) && !job.lapsed(id, now)).collect();
    job.previous = survivors.into();
    job.succeeded.clear();
    for id in gone {
        job.last_seen.remove(id);
        job.health.remove(id);
    }
    // Reports are about a round's members as its watchers saw them: the next round's watchers
    // start afresh.
    for h in job.health.values_mut() {
        h.peers.clear();
    }
    job.phase = Phase::Waiting { since: now };
    job.prune_last_seen();
    let reason = format!("{reason}; round {} opened", job.round);
    let d = evaluate_forming(job, now, reason.clone());
    match d.action {
        Action::RoundClosed { .. } | Action::Failed => d,
        _ => decide(Action::RoundOpened { round: job.round, cause }, d.reason),
    }
}

/// What tore the running round down, in words, and when it happened as far as this service can
/// tell: a lost node at its last sign of life ([`last_heard`](super::liveness::last_heard): its
/// last heartbeat held here, with etcd as the replica that let its key lapse noted it, else one
/// TTL before the verdict), a failed worker when its agent saw it exit;
/// never before the round ran.
fn fault_of(job: &Job, cause: &RoundCause, now: Millis) -> (&'static str, String, Millis) {
    let since = match job.phase {
        Phase::Running { since } => since,
        _ => now,
    };
    let (kind, fault, at) = match cause {
        RoundCause::NodeLost { nodes } => (
            "node_lost",
            format!("node(s) {} lost", super::recovery::named(nodes)),
            super::liveness::last_heard(job, nodes, now),
        ),
        RoundCause::Failure { node_id } => {
            let rc = job.last_root_cause.as_ref();
            let what = rc.map(|rc| format!("rank {} on node {node_id}: {}", rc.rank, rc.exit.describe()));
            let ago = rc.and_then(|rc| rc.seen_ago_ms).unwrap_or(0);
            let at = super::recovery::failure_dated(now, ago, since, &job.settings);
            ("failure", what.unwrap_or_else(|| format!("worker failure on node {node_id}")), at)
        }
        RoundCause::ScaleUp { node_id } => ("scale_up", format!("node {node_id} joined (scale-up)"), now),
        RoundCause::MemberLeft { node_id } => ("member_left", format!("member {node_id} left"), now),
        RoundCause::MemberRejoined { node_id } => {
            ("member_rejoined", format!("member {node_id} came back with new details"), now)
        }
    };
    (kind, fault, at.clamp(since.min(now), now))
}

/// A member's progress in the running round, for the recovery accounting.
fn progress(job: &mut Job, node_id: &str, round: u64, p: &NodeProgress, now: Millis) -> Decision {
    if round != job.round || !matches!(job.phase, Phase::Running { .. }) {
        return decide(
            Action::Nothing,
            format!("progress of {node_id} in round {round} ignored: round {} is {}", job.round, job.phase.name()),
        );
    }
    if !job.is_member(node_id) {
        return reject(Rejection::NotMember { node_id: node_id.to_owned(), round });
    }
    let before = job.accounting.reported.get(node_id).copied();
    job.accounting.progress(now, round, node_id, p);
    if job.accounting.reported.get(node_id).copied() == before {
        return decide(Action::Nothing, format!("progress of {node_id} in round {round} already noted"));
    }
    decide(Action::Updated, format!("progress of {node_id} in round {round} noted"))
}

/// Decides whether a forming round closes now, enters or leaves its last call, or fails.
fn evaluate_forming(job: &mut Job, now: Millis, base: String) -> Decision {
    let with = |s: &str| if base.is_empty() { s.to_owned() } else { format!("{base}; {s}") };
    let n = job.pending.len();
    let min = job.settings.min_nodes as usize;
    let max = job.settings.max_nodes as usize;
    // Only a re-forming round has survivors to wait for (a first round of 10,000 joins must not
    // index every pending node on every join).
    let all_previous_back = job.previous.is_empty() || { job.previous.iter().all(|id| job.pending.contains(id)) };
    let previous_back = !job.previous.is_empty() && all_previous_back;
    let since = match job.phase {
        Phase::Waiting { since } | Phase::LastCall { since, .. } => since,
        _ => return decide(Action::Nothing, base),
    };
    // At MAX the round closes at once, unless survivors of the previous round are still on
    // their way back: they keep their places over standbys, so the last call waits for them.
    if n >= max && all_previous_back {
        return close_round(job, now, with(&format!("MAX ({max}) nodes are in: last call skipped")));
    }
    if n >= min && previous_back {
        return close_round(job, now, with("every surviving member of the previous round is back: last call skipped"));
    }
    if n >= min {
        match job.phase {
            Phase::LastCall { deadline, since } if now >= deadline => {
                // Survivors of the previous round still on their way back are alive (a lapsed
                // one is dropped from `previous` by the tick) but still stopping their workers:
                // wait for them up to the shutdown timeout rather than close without them.
                let missing = job.previous.iter().filter(|id| !job.pending.contains(id)).count();
                let survivors_due = since
                    .saturating_add(JobSettings::ms(job.settings.stop_grace))
                    .saturating_add(JobSettings::ms(job.settings.last_call_timeout));
                if missing > 0 && now < survivors_due {
                    let note = format!(
                        "last call over; waiting for {missing} surviving member(s) still stopping their workers"
                    );
                    if base.is_empty() {
                        decide(Action::Nothing, note)
                    } else {
                        decide(Action::Updated, with(&note))
                    }
                } else {
                    close_round(job, now, with("last call over"))
                }
            }
            Phase::LastCall { .. } => {
                if base.is_empty() {
                    decide(Action::Nothing, "last call runs")
                } else {
                    decide(Action::Updated, base)
                }
            }
            _ => {
                let survivors_missing = job.previous.iter().any(|id| !job.pending.contains(id));
                let wait_for_survivors = survivors_missing && !job.settings.stop_grace.is_zero();
                if job.settings.last_call_timeout.is_zero() && !wait_for_survivors {
                    return close_round(job, now, with("MIN reached and the last call is zero"));
                }
                let deadline = now.saturating_add(JobSettings::ms(job.settings.last_call_timeout));
                job.phase = Phase::LastCall { since, deadline };
                decide(
                    Action::Updated,
                    with(&format!("MIN ({min}) nodes are in: last call for {:?}", job.settings.last_call_timeout)),
                )
            }
        }
    } else {
        if matches!(job.phase, Phase::LastCall { .. }) {
            job.phase = Phase::Waiting { since };
        }
        let join_deadline = since.saturating_add(JobSettings::ms(job.settings.join_timeout));
        if now >= join_deadline {
            let reason = with(&format!(
                "only {n} of at least {min} nodes joined round {} within the join timeout ({:?}): job failed",
                job.round, job.settings.join_timeout
            ));
            job.pending.clear();
            job.previous.clear();
            job.prune_last_seen();
            job.phase = Phase::Failed { at: now, kind: FailureKind::JoinTimeout, reason: reason.clone() };
            return decide(Action::Failed, reason);
        }
        if base.is_empty() {
            decide(Action::Nothing, format!("waiting for {} more node(s)", min - n))
        } else {
            decide(Action::Updated, with(&format!("waiting for {} more node(s)", min - n)))
        }
    }
}

/// Closes the forming round: previous members first in their old rank order, then the other
/// joiners by join time; at most MAX; the rest stay pending.
fn close_round(job: &mut Job, now: Millis, reason: String) -> Decision {
    let max = job.settings.max_nodes as usize;
    let mut order: Vec<Pending> = Vec::with_capacity(job.pending.len());
    for id in job.previous.iter() {
        if let Some(p) = job.pending.get(id) {
            order.push(p.clone());
        }
    }
    let mut rest: Vec<Pending> =
        job.pending.iter().filter(|p| !job.previous.contains(&p.node.node_id)).cloned().collect();
    rest.sort_by(|a, b| a.joined_at.cmp(&b.joined_at).then_with(|| a.node.node_id.cmp(&b.node.node_id)));
    order.extend(rest);
    let standby = if order.len() > max { order.split_off(max) } else { Vec::new() };
    job.fingerprint_diff = fingerprint_diff(job, &order);
    // Only the reference and the standbys' fingerprints are needed from now on.
    let keep: HashSet<&str> = standby
        .iter()
        .filter_map(|p| p.fingerprint_digest.as_deref())
        .chain(job.fingerprint_reference.as_deref())
        .collect();
    job.fingerprints.retain(|d, _| keep.contains(d.as_str()));
    // What each node may be believed to hold, judged by the round that just ended, before its
    // members are replaced.
    let judge = Credibility::new(&job.members, job.members_round);
    let believed: Vec<Vec<SnapshotSet>> = order.iter().map(|p| judge.of(&p.node)).collect();
    let mut offset = 0u32;
    job.members = order
        .into_iter()
        .zip(believed)
        .enumerate()
        .map(|(rank, (p, snapshots))| {
            let m = Member {
                node_id: p.node.node_id,
                group_rank: u32::try_from(rank).unwrap_or(u32::MAX),
                local_world_size: p.node.local_world_size,
                rank_offset: offset,
                store_addr: p.node.store_addr,
                probe_addr: p.node.probe_addr,
                snapshot_addr: p.node.snapshot_addr,
                snapshot_key: p.node.snapshot_key,
                snapshots,
            };
            offset = offset.saturating_add(m.local_world_size);
            m
        })
        .collect();
    job.members_digest = members_digest(&job.members);
    job.members_round = job.round;
    let ids: Vec<&str> = job.members.iter().map(|m| m.node_id.as_str()).collect();
    let world = job.members.iter().map(|m| m.local_world_size).sum();
    job.accounting.round_closed(now, job.round, &ids, world);
    job.member_index = MemberIndex::default();
    job.pending = standby.into();
    job.previous.clear();
    job.succeeded.clear();
    job.phase = Phase::Running { since: now };
    job.prune_last_seen();
    let mut reason = format!(
        "{reason}; round {} closed with {} node(s), world size {}",
        job.round,
        job.members.len(),
        job.world_size()
    );
    if let Some(first) = job.fingerprint_diff.first() {
        reason += &format!("; nodes' fingerprints differ: {first}");
        if job.fingerprint_diff.len() > 1 {
            reason += &format!(" (and {} more lines in status)", job.fingerprint_diff.len() - 1);
        }
    }
    decide(Action::RoundClosed { round: job.round }, reason)
}

/// The snapshot parts of `node`'s join that the round closing believes it holds, judged by the
/// round that ended (`last`, closed as round `last_round`): a member restores what the others
/// say they hold, so a node must not make them restore (and free their own copies for) parts it
/// never had. Of parts saved in `last_round`, a node holds its own ranks' (it ran them) and
/// those of the member before it in the ring (it is that member's buddy, which sends it each
/// part), in that round's world; of parts saved earlier, only what the last round believed it
/// held. Nothing of a node that was not a member of the last round: its agent is new (a
/// restarted agent is a new node), so it holds nothing of this job. Parts a node fetched to
/// restore count only from the next round it saves in (its own and its buddy's, as above).
pub fn credible_snapshots(last: &[Member], last_round: u64, node: &NodeInfo) -> Vec<SnapshotSet> {
    Credibility::new(last, last_round).of(node)
}

/// [`credible_snapshots`] for every node of a closing round: the round that ended indexed once,
/// so judging 10,000 nodes is not 10,000 scans of it.
pub struct Credibility<'a> {
    last: &'a [Member],
    last_round: u64,
    index: HashMap<&'a str, usize>,
    world: u32,
}

impl<'a> Credibility<'a> {
    pub fn new(last: &'a [Member], last_round: u64) -> Credibility<'a> {
        Credibility {
            last,
            last_round,
            index: last.iter().enumerate().map(|(i, m)| (m.node_id.as_str(), i)).collect(),
            world: last.iter().fold(0u32, |w, m| w.saturating_add(m.local_world_size)),
        }
    }

    pub fn of(&self, node: &NodeInfo) -> Vec<SnapshotSet> {
        if node.snapshots.is_empty() {
            return Vec::new();
        }
        let last = self.last;
        let Some(&i) = self.index.get(node.node_id.as_str()) else { return Vec::new() };
        let me = &last[i];
        let before = &last[(i + last.len() - 1) % last.len()];
        let ring = [(me.ranks().start, me.ranks().end), (before.ranks().start, before.ranks().end)];
        node.snapshots
            .iter()
            .filter_map(|set| {
                let allowed: Vec<(u32, u32)> = if set.tag == self.last_round && set.world == self.world {
                    ring.to_vec()
                } else if set.tag < self.last_round {
                    me.snapshots
                        .iter()
                        .filter(|b| (b.tag, b.step, b.world) == (set.tag, set.step, set.world))
                        .flat_map(|b| b.ranks.iter().copied())
                        .collect()
                } else {
                    Vec::new()
                };
                let ranks = intersect(&set.ranks, &allowed);
                (!ranks.is_empty()).then(|| SnapshotSet { ranks, ..set.clone() })
            })
            .collect()
    }
}

/// The ranks in both lists of half-open ranges, as sorted, disjoint, non-adjacent ranges.
fn intersect(a: &[(u32, u32)], b: &[(u32, u32)]) -> Vec<(u32, u32)> {
    let mut pieces: Vec<(u32, u32)> =
        a.iter().flat_map(|&(s, e)| b.iter().map(move |&(t, f)| (s.max(t), e.min(f)))).filter(|(s, e)| s < e).collect();
    pieces.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(pieces.len());
    for (s, e) in pieces {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// How the nodes about to form a round differ, against the job's first fingerprint when one of
/// them holds it, else against the largest group.
fn fingerprint_diff(job: &Job, order: &[Pending]) -> Vec<String> {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in order {
        if let Some(d) = &p.fingerprint_digest {
            groups.entry(d.clone()).or_default().push(p.node.node_id.clone());
        }
    }
    if groups.len() < 2 {
        return Vec::new();
    }
    let reference = match &job.fingerprint_reference {
        Some(r) if groups.contains_key(r) => r.clone(),
        _ => groups.iter().max_by_key(|(_, ids)| ids.len()).map(|(d, _)| d.clone()).unwrap_or_default(),
    };
    rlaunch::fingerprint::report(&reference, &groups, &job.fingerprints)
        .into_iter()
        .map(|l| rlaunch::contract::cut_end(&l, 1024))
        .collect()
}

/// A digest of a member list: SHA-256 over each member's id, rank, offset, workers and store,
/// hex (the first 32 characters).
fn members_digest(members: &[Member]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for m in members {
        h.update(m.node_id.as_bytes());
        h.update([0]);
        h.update(m.group_rank.to_le_bytes());
        h.update(m.rank_offset.to_le_bytes());
        h.update(m.local_world_size.to_le_bytes());
        h.update(m.store_addr.to_string().as_bytes());
        h.update([0]);
    }
    h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
}

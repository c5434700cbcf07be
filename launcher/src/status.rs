//! `rlaunch status`: a job as the rendezvous sees it — round, members, ranks, heartbeats,
//! restarts and the last root cause.
//!
//! Everything shown came from the rendezvous and from other nodes, so it is printed through
//! `rlaunch::terminal`: an escape sequence in a root cause or a node id is shown, not obeyed.

use clap::Parser;

use rlaunch_rendezvous::endpoint::EndpointError;
use rlaunch_rendezvous::round::NodeStatus;
use rlaunch_rendezvous::{Backend, Endpoint, JobSettings, JobStatus, RendezvousClient};

use crate::token_file::{self, TokenFileError};

/// Which job, at which rendezvous: what `rlaunch status` and `rlaunch top` share.
#[derive(Debug, clap::Args)]
pub struct JobRef {
    /// Rendezvous endpoint(s), `host:port[,host:port…]`.
    #[arg(long = "rdzv-endpoint", alias = "rdzv_endpoint", env = "PET_RDZV_ENDPOINT")]
    pub rdzv_endpoint: String,
    /// The job's id.
    #[arg(long = "rdzv-id", alias = "rdzv_id", env = "PET_RDZV_ID")]
    pub rdzv_id: String,
    /// `rlaunch` (a rendezvous server) or `etcd`.
    #[arg(long = "rdzv-backend", alias = "rdzv_backend", env = "PET_RDZV_BACKEND", default_value = "rlaunch")]
    pub rdzv_backend: String,
    /// Bearer token of the rendezvous server (`ps` shows it: prefer `--rdzv-token-file`).
    #[arg(long, env = "RLAUNCH_RDZV_TOKEN")]
    pub token: Option<String>,
    /// A file holding the rendezvous server's bearer token, read as the launcher's
    /// `--rdzv-token-file` is (surrounding whitespace trimmed; an empty file: no token). Not
    /// taken from `PET_RDZV_TOKEN_FILE`: exported for the launcher, it would make `--token`
    /// conflict with it.
    #[arg(long = "rdzv-token-file", alias = "rdzv_token_file", conflicts_with = "token")]
    pub rdzv_token_file: Option<std::path::PathBuf>,
    /// A private CA bundle (PEM) that an `https://` endpoint's certificate is verified against
    /// (default: the system's roots).
    #[arg(long = "tls-ca", env = "RLAUNCH_RDZV_TLS_CA")]
    pub tls_ca: Option<std::path::PathBuf>,
}

/// Show a job's state as the rendezvous keeps it.
#[derive(Debug, Parser)]
#[command(name = "rlaunch status")]
pub struct StatusArgs {
    #[command(flatten)]
    pub job: JobRef,
    /// Print the status as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `rlaunch top`: the same view as `rlaunch status`, refreshed until the job ends.
#[derive(Debug, Parser)]
#[command(name = "rlaunch top")]
pub struct TopArgs {
    #[command(flatten)]
    pub job: JobRef,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0, value_parser = parse_interval)]
    pub interval: f64,
}

fn parse_interval(s: &str) -> Result<f64, BadInterval> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(BadInterval(s.to_owned())),
    }
}

/// A `--interval` that is no number of seconds in range.
#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not a number of seconds from 0.1 to 3600")]
pub struct BadInterval(String);

/// Why `rlaunch status` (or a frame of `rlaunch top`) has no status to show.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("--rdzv-endpoint is empty")]
    NoEndpoint,
    #[error("--rdzv-backend {0}: expected rlaunch or etcd")]
    UnknownBackend(String),
    #[error("--rdzv-endpoint: {0}")]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    TokenFile(#[from] TokenFileError),
    /// What the rendezvous answered, or why it could not be reached: its text may quote what
    /// the service sent, so it is held as the reader may see it ([`shown`]).
    #[error("{0}")]
    Rendezvous(String),
    #[error("{0}")]
    Json(#[from] serde_json::Error),
}

async fn client(job: JobRef) -> Result<RendezvousClient, StatusError> {
    let JobRef { rdzv_endpoint, rdzv_id, rdzv_backend, token, rdzv_token_file, tls_ca } = job;
    let endpoints = rdzv_endpoint
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::parse::<Endpoint>)
        .collect::<Result<Vec<_>, _>>()?;
    if endpoints.is_empty() {
        return Err(StatusError::NoEndpoint);
    }
    let http = match rdzv_backend.as_str() {
        "rlaunch" | "c10d" => true,
        "etcd" | "etcd-v3" => false,
        other => return Err(StatusError::UnknownBackend(other.to_owned())),
    };
    let token = match &rdzv_token_file {
        Some(path) => token_file::read(path)?,
        None => token,
    };
    let backend = if http { Backend::Http { endpoints, token } } else { Backend::Etcd { endpoints } };
    let tls = rlaunch_rendezvous::ClientTls { ca_file: tls_ca };
    RendezvousClient::connect_with(backend, &rdzv_id, JobSettings::default(), &tls).await.map_err(|e| shown(&e))
}

/// An error as the reader may see it: its text may quote what the service sent.
fn shown(e: &dyn std::fmt::Display) -> StatusError {
    StatusError::Rendezvous(rlaunch::terminal::sanitize(&e.to_string()).into_owned())
}

/// One frame of `rlaunch top`: a header line, then the status (or why there is none).
pub fn frame(id: &str, now: &str, interval: f64, status: &Result<JobStatus, StatusError>) -> String {
    let head = format!("rlaunch top — job {id} — {now} — every {interval} s, until the job ends (Ctrl-C quits)\n\n");
    match status {
        Ok(s) => head + &render(s),
        Err(e) => head + &format!("no status: {}\n(retrying)\n", rlaunch::terminal::sanitize(&e.to_string())),
    }
}

/// Refreshes the job's view every `interval` until the job has finished or failed: on a
/// terminal the screen is redrawn, elsewhere a frame is printed when it changes. `Ok(true)`
/// when it finished, `Ok(false)` when it failed.
pub async fn top(args: TopArgs, out: &mut dyn std::io::Write, terminal: bool) -> Result<bool, StatusError> {
    let id = args.job.rdzv_id.clone();
    let client = client(args.job).await?;
    let every = std::time::Duration::from_secs_f64(args.interval);
    let mut last_body = String::new();
    loop {
        let status = client.status().await.map_err(|e| shown(&e));
        let now = rlaunch::contract::format_time(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        );
        let body = match &status {
            Ok(s) => render(s),
            Err(e) => e.to_string(),
        };
        if terminal {
            // Home, clear, the frame: one write, so the screen never shows half of one.
            let text = format!("\x1b[H\x1b[2J{}", frame(&id, &now, args.interval, &status));
            let _ = out.write_all(text.as_bytes());
        } else if body != last_body {
            let _ = writeln!(out, "{}", frame(&id, &now, args.interval, &status));
        }
        let _ = out.flush();
        last_body = body;
        if let Ok(s) = &status {
            match s.state.as_str() {
                "finished" => return Ok(true),
                "failed" => return Ok(false),
                _ => {}
            }
        }
        tokio::time::sleep(every).await;
    }
}

pub async fn run(args: StatusArgs) -> Result<String, StatusError> {
    let client = client(args.job).await?;
    let status = client.status().await.map_err(|e| shown(&e))?;
    if args.json {
        let json = serde_json::to_string_pretty(&status)?;
        return Ok(rlaunch::terminal::sanitize_json(&json).into_owned());
    }
    Ok(render(&status))
}

/// The heartbeat loss and detector columns of one node: loss as a percentage, `ok` or
/// `SUSPECTED`.
fn health_columns(n: &NodeStatus) -> (String, String) {
    let loss = n.health.heartbeat_loss.map(|l| format!("{:.0}%", l * 100.0)).unwrap_or_else(|| "-".into());
    let state = if n.health.suspected_for_ms.is_some() { "SUSPECTED" } else { "ok" };
    (loss, state.to_owned())
}

/// The status as text, safe to print on a terminal.
pub fn render(s: &JobStatus) -> String {
    let mut out = format!(
        "job {}: {} — round {}, world size {}, restarts {}/{}\n",
        s.run_id, s.state, s.round, s.world_size, s.restart_count, s.max_restarts
    );
    out += &format!("  last event: {}\n", s.last_reason);
    if let Some(f) = &s.failure {
        out += &format!("  failure: {f}\n");
    }
    out += "  group_rank  workers  ranks      last heartbeat  hb loss  health     node\n";
    let mut offset = 0;
    for m in &s.members {
        let ranks = format!("{}-{}", offset, offset + m.local_world_size.saturating_sub(1));
        offset += m.local_world_size;
        let hb =
            m.last_heartbeat_ago_ms.map(|ms| format!("{:.1} s ago", ms as f64 / 1000.0)).unwrap_or_else(|| "-".into());
        let rank = m.group_rank.map(|r| r.to_string()).unwrap_or_else(|| "-".into());
        let done = if m.succeeded { " (succeeded)" } else { "" };
        let (loss, health) = health_columns(m);
        out += &format!(
            "  {rank:<10}  {:<7}  {ranks:<9}  {hb:<14}  {loss:<7}  {health:<9}  {}{done}\n",
            m.local_world_size, m.node_id
        );
    }
    for p in &s.pending {
        let (loss, health) = health_columns(p);
        out += &format!(
            "  waiting     {:<7}  -          -               {loss:<7}  {health:<9}  {}\n",
            p.local_world_size, p.node_id
        );
    }
    for n in s.members.iter().chain(&s.pending) {
        let h = &n.health;
        if let Some(ms) = h.suspected_for_ms {
            let probes = match (&h.reached_by, h.missed_by.is_empty()) {
                (Some(by), _) => format!("reached by {by}"),
                (None, false) => format!("not reached by {}", h.missed_by.join(", ")),
                (None, true) => "probes under way".to_owned(),
            };
            out += &format!("  suspected: {} for {:.1} s ({probes})\n", n.node_id, ms as f64 / 1000.0);
        }
    }
    if let Some(st) = &s.straggler {
        out += &format!(
            "  slowest rank: {} on {} — arrives {:.1} ms per step after the earliest at the all-reduces ({} ranks compared)\n",
            st.rank, st.node_id, st.late_ms, st.ranks
        );
    }
    if !s.fingerprint_diff.is_empty() {
        out += "  fingerprints differ:\n";
        for l in &s.fingerprint_diff {
            out += &format!("    {l}\n");
        }
    }
    out += &recoveries(&s.recovery);
    if let Some(rc) = &s.last_root_cause {
        out += &format!("  last root cause: {}\n", rc.summary());
        if !rc.stacks.is_empty() {
            out += "  where each rank stood (the odd one out first):\n";
            for l in &rc.stacks {
                out += &format!("    {l}\n");
            }
        }
    }
    rlaunch::terminal::sanitize(&out).into_owned()
}

/// Goodput and what each recovery cost, phase by phase (`-`: not known, `…`: under way).
fn recoveries(r: &rlaunch_rendezvous::round::RecoveryStatus) -> String {
    let Some(goodput) = r.goodput else { return String::new() };
    let secs = |ms: u64| format!("{:.2} s", ms as f64 / 1000.0);
    let mut out = format!(
        "  goodput: {:.1}% ({} lost of {}: start-up {}, {} recover{})\n",
        goodput * 100.0,
        secs(r.lost_ms),
        secs(r.wall_ms),
        r.startup_ms.map(secs).unwrap_or_else(|| "-".into()),
        r.count,
        if r.count == 1 { "y" } else { "ies" },
    );
    if r.recoveries.is_empty() {
        return out;
    }
    out += "  round  noticing  re-forming  starting  restoring  again     redone  kept  total     fault\n";
    for v in &r.recoveries {
        let p = &v.phases;
        let col = |ms: Option<u64>| ms.map(secs).unwrap_or_else(|| if v.ongoing { "…".into() } else { "-".into() });
        let total = if v.ongoing { format!("{}…", secs(v.lost_ms)) } else { secs(v.lost_ms) };
        let redone = p.steps_redone.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
        let kept = p.ranks_kept.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
        out += &format!(
            "  {:<5}  {:<8}  {:<10}  {:<8}  {:<9}  {:<8}  {redone:<6}  {kept:<4}  {total:<8}  {}\n",
            v.recovery.round,
            col(p.noticing_ms),
            col(p.reforming_ms),
            col(p.starting_ms),
            col(p.restoring_ms),
            col(p.computing_again_ms),
            v.recovery.fault
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rlaunch_rendezvous::round::{apply, Event, Job};
    use rlaunch_rendezvous::NodeInfo;

    use super::*;

    fn node(id: &str) -> NodeInfo {
        NodeInfo {
            node_id: id.into(),
            local_world_size: 2,
            store_addr: format!("{id}:29500").parse().unwrap(),
            probe_addr: None,
            snapshot_addr: None,
            snapshot_key: None,
            snapshots: Vec::new(),
            fingerprint: None,
        }
    }

    #[test]
    fn status_and_top_take_the_token_from_a_file_but_not_beside_token() {
        use clap::error::ErrorKind;
        let argv = |name: &'static str, more: &[&'static str]| {
            let mut v = vec![name, "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "j"];
            v.extend_from_slice(more);
            v
        };
        let file = |job: &JobRef| job.rdzv_token_file.clone().map(|p| p.display().to_string());
        for flag in ["--rdzv-token-file", "--rdzv_token_file"] {
            let s = StatusArgs::try_parse_from(argv("rlaunch status", &[flag, "/run/t"])).unwrap();
            assert_eq!((file(&s.job).as_deref(), s.job.token.as_deref()), (Some("/run/t"), None));
            let t = TopArgs::try_parse_from(argv("rlaunch top", &[flag, "/run/t"])).unwrap();
            assert_eq!((file(&t.job).as_deref(), t.job.token.as_deref()), (Some("/run/t"), None));
        }
        let s = StatusArgs::try_parse_from(argv("rlaunch status", &["--token", "s3cret"])).unwrap();
        assert_eq!((file(&s.job), s.job.token.as_deref()), (None, Some("s3cret")));
        let both = ["--token", "s3cret", "--rdzv-token-file", "/run/t"];
        let e = StatusArgs::try_parse_from(argv("rlaunch status", &both)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ArgumentConflict, "{e}");
        let e = TopArgs::try_parse_from(argv("rlaunch top", &both)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ArgumentConflict, "{e}");
    }

    #[tokio::test]
    async fn an_unreadable_token_file_is_named_before_the_service_is_asked() {
        let missing = std::env::temp_dir().join(format!("rlaunch-status-no-token-{}", std::process::id()));
        let args = StatusArgs::try_parse_from([
            "rlaunch status",
            "--rdzv-endpoint",
            "127.0.0.1:1",
            "--rdzv-id",
            "j",
            "--rdzv-token-file",
            &missing.display().to_string(),
        ])
        .unwrap();
        let e = run(args).await.unwrap_err();
        assert!(matches!(e, StatusError::TokenFile(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.starts_with(&format!("--rdzv-token-file {}: ", missing.display())), "{e}");
    }

    #[test]
    fn status_shows_heartbeat_loss_and_who_reached_a_suspected_node() {
        let settings = JobSettings { min_nodes: 2, max_nodes: 2, ..JobSettings::default() };
        let mut job = Job::new(settings, 0);
        for (id, t) in [("a", 0), ("b", 10)] {
            job = apply(&job, Event::Join(node(id)), t).0;
        }
        let ms = |d: Duration| d.as_millis() as u64;
        let now = 10 + ms(Duration::from_secs(2));
        job = apply(&job, Event::Heartbeat { node_id: "a".into(), sent: None, probes: vec![], peers: vec![] }, now).0;
        job = apply(&job, Event::Tick, now).0;
        let report = rlaunch_rendezvous::detector::ProbeReport { node_id: "b".into(), reached: true };
        job = apply(
            &job,
            Event::Heartbeat { node_id: "a".into(), sent: None, probes: vec![report], peers: vec![] },
            now + 100,
        )
        .0;
        let text = render(&job.status("j", now + 300));
        assert!(text.contains("hb loss  health"), "{text}");
        assert!(text.contains("SUSPECTED  b"), "{text}");
        assert!(text.contains("suspected: b for 0.3 s (reached by a)"), "{text}");
    }

    #[test]
    fn status_shows_goodput_and_each_recoverys_phases() {
        use rlaunch::contract::{NodeProgress, StepAgo};
        let settings = JobSettings { min_nodes: 1, max_nodes: 1, max_restarts: 3, ..JobSettings::default() };
        let mut job = apply(&Job::new(settings, 0), Event::Join(node("a")), 0).0;
        let up = NodeProgress {
            started_ago_ms: Some(0),
            first_step: Some(StepAgo { step: 0, ago_ms: 0 }),
            ..Default::default()
        };
        job = apply(&job, Event::Progress { node_id: "a".into(), round: 1, progress: up }, 1000).0;
        let mut rc = rlaunch::contract::RootCause::from_message("boom");
        rc.seen_ago_ms = Some(500);
        job = apply(&job, Event::ReportFailure { node_id: "a".into(), round: 1, root_cause: Box::new(rc) }, 10_000).0;
        job = apply(&job, Event::Join(node("a")), 10_200).0;
        let text = render(&job.status("j", 10_300));
        assert!(text.contains("  2      0.50 s    0.20 s      …"), "under way:\n{text}");
        let back = NodeProgress {
            started_ago_ms: Some(300),
            ready_ago_ms: Some(200),
            restored: Some(StepAgo { step: 4, ago_ms: 100 }),
            first_step: Some(StepAgo { step: 5, ago_ms: 0 }),
            step_before: Some(5),
            caught_up: Some(StepAgo { step: 5, ago_ms: 0 }),
            kept_ranks: Some(2),
        };
        job = apply(&job, Event::Progress { node_id: "a".into(), round: 2, progress: back }, 11_000).0;
        let text = render(&job.status("j", 20_000));
        // Wall 20 s; lost: start-up 1 s and the recovery (9.5 → 11 s) 1.5 s.
        assert!(text.contains("goodput: 87.5% (2.50 s lost of 20.00 s: start-up 1.00 s, 1 recovery)"), "{text}");
        assert!(
            text.contains("  2      0.50 s    0.20 s      0.60 s    0.10 s     0.10 s    1       2     1.50 s    rank 0 on node a: exit code 1"),
            "{text}"
        );
    }

    #[test]
    fn a_hostile_root_cause_is_shown_with_its_escapes_written_out() {
        let settings = JobSettings { min_nodes: 1, max_nodes: 1, ..JobSettings::default() };
        let mut job = apply(&Job::new(settings, 0), Event::Join(node("a")), 0).0;
        let osc52 = "\x1b]52;c;ZXZpbA==\x07";
        let mut rc = rlaunch::contract::RootCause::from_message(format!("boom{osc52}\x1b[2J\u{9b}31m"));
        rc.host = format!("evil{osc52}host");
        rc.stacks = vec!["rank 0: \x1b[2Jhere\x7f".into()];
        job = apply(&job, Event::ReportFailure { node_id: "a".into(), round: 1, root_cause: Box::new(rc) }, 20).0;
        let status = job.status("j", 40);
        let text = render(&status);
        assert!(text.contains("boom\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J\\x9b31m"), "{text}");
        assert!(text.contains("rank 0: ") && text.contains("here"), "{text}");
        assert!(!text.chars().any(rlaunch::terminal::is_unsafe), "{text:?}");
        let framed = frame("j", "now", 1.0, &Ok(status));
        assert!(!framed.chars().any(rlaunch::terminal::is_unsafe), "{framed:?}");
        let refused = frame("j", "now", 1.0, &Err(shown(&"service said \x1b[2J")));
        assert!(refused.contains("service said \\x1b[2J") && !refused.contains('\x1b'), "{refused:?}");
    }

    #[test]
    fn status_shows_where_each_rank_stood_and_how_fingerprints_differ() {
        let settings = JobSettings { min_nodes: 2, max_nodes: 2, ..JobSettings::default() };
        let mut job = Job::new(settings, 0);
        for (id, nccl, t) in [("a", "4", 0), ("b", "2", 10)] {
            let fp =
                rlaunch::fingerprint::Fingerprint([("env NCCL_X".to_owned(), nccl.to_owned())].into_iter().collect());
            job = apply(&job, Event::Join(NodeInfo { fingerprint: Some(fp), ..node(id) }), t).0;
        }
        let mut rc = rlaunch::contract::RootCause::from_message("hang");
        rc.stacks = vec!["rank 3: stuck_here (train.py:4)".into()];
        job = apply(&job, Event::ReportFailure { node_id: "b".into(), round: 1, root_cause: Box::new(rc) }, 20).0;
        let stacks = Event::ReportStacks {
            node_id: "a".into(),
            round: 1,
            stacks: vec!["ranks 0-1: all_reduce (c10d.py:9)".into()],
        };
        job = apply(&job, stacks, 30).0;
        let mut status = job.status("j", 40);
        status.straggler =
            Some(rlaunch_rendezvous::stragglers::Straggler { rank: 3, node_id: "b".into(), late_ms: 41.5, ranks: 4 });
        let text = render(&status);
        assert!(text.contains("slowest rank: 3 on b — arrives 41.5 ms per step after the earliest"), "{text}");
        assert!(
            text.contains("fingerprints differ:\n    1 of 2 node(s) (b) differ from 1 (a): env NCCL_X=2 (4 there)"),
            "{text}"
        );
        assert!(
            text.contains("where each rank stood (the odd one out first):\n    rank 3: stuck_here (train.py:4)\n    ranks 0-1: all_reduce"),
            "{text}"
        );
    }
}

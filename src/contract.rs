//! The types agents, the rendezvous and `rlaunch status` exchange, defined once: how a worker
//! ended ([`Exit`]), why a job failed ([`RootCause`]), who a node is ([`NodeInfo`]), its place
//! in a round ([`RoundInfo`], [`Member`]), and a checked `host:port` ([`HostPort`]).
//!
//! Everything here is plain data with serde, so it crosses HTTP and etcd typed on both sides.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Root causes are bounded with these; named here too, where the rendezvous has long found them.
pub use crate::cut::{cut_end, cut_start};

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    pub fn from_status(status: std::process::ExitStatus) -> Exit {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(c), _) => Exit::Code(c),
            (None, Some(s)) => Exit::Signal(s),
            (None, None) => Exit::Code(1),
        }
    }

    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    /// The launcher's exit code for this ending: the worker's own code, or 128+signal as a shell
    /// reports it.
    pub fn shell_code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
        }
    }

    pub fn describe(self) -> String {
        match self {
            Exit::Code(c) => format!("exit code {c}"),
            Exit::Signal(s) => format!("signal {s} ({})", signal_name(s)),
        }
    }
}

/// `SIGTERM` for 15, and so on; `signal N` for numbers without a name here.
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGPWR => "SIGPWR",
        libc::SIGVTALRM => "SIGVTALRM",
        libc::SIGPROF => "SIGPROF",
        libc::SIGWINCH => "SIGWINCH",
        libc::SIGCONT => "SIGCONT",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGURG => "SIGURG",
        libc::SIGIO => "SIGIO",
        libc::SIGCHLD => "SIGCHLD",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
}

/// The number of the signal `SIGTERM` (or `TERM`, in any case) names: the inverse of
/// [`signal_name`].
pub fn signal_by_name(name: &str) -> Option<i32> {
    let upper = name.trim().to_ascii_uppercase();
    let full = if upper.starts_with("SIG") { upper } else { format!("SIG{upper}") };
    (1..32).find(|&n| signal_name(n) == full)
}

/// The first failure of a worker group, with everything a person needs to start debugging.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootCause {
    pub rank: u32,
    pub local_rank: u32,
    pub role: String,
    pub host: String,
    pub pid: u32,
    pub exit: Exit,
    /// Seconds since the Unix epoch: the error file's timestamp, else when the agent saw it.
    pub timestamp: u64,
    pub restart_count: u32,
    /// The error file's message, else a description of the exit.
    pub message: String,
    /// The Python traceback from the error file, if there was one.
    pub traceback: Option<String>,
    pub error_file: Option<PathBuf>,
    /// The last lines of the worker's stderr, when it wrote no error file.
    pub stderr_tail: Vec<String>,
    /// Other workers of the group that failed by themselves along with it (torchrun's
    /// "Failures" section): seen within the same moment, before they were stopped.
    #[serde(default)]
    pub other_failures: Vec<OtherFailure>,
    /// Where each rank stood when the failure or hang was seen (`--hang-timeout`): one line per
    /// group of ranks at the same place, the odd one out first, e.g.
    /// `rank 1: stuck_here (train.py:4) <- main (train.py:12)`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stacks: Vec<String>,
    /// When the agent saw the worker exit (Unix ms, the agent's clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen_at_ms: Option<u64>,
    /// How long before this report was sent its agent saw the exit: the rendezvous dates the
    /// fault with it on its own clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen_ago_ms: Option<u64>,
}

/// Another worker that failed along with the root cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OtherFailure {
    pub rank: u32,
    pub local_rank: u32,
    pub pid: u32,
    pub exit: Exit,
    /// The error file's message, else a description of the exit.
    pub message: String,
}

/// Caps of [`RootCause::bounded`]: what one failure report may carry over the wire.
pub mod caps {
    /// Bytes of the message (its beginning is kept).
    pub const MESSAGE: usize = 2048;
    /// Bytes of the traceback (its end is kept: the raising frame and the exception).
    pub const TRACEBACK: usize = 8192;
    /// Lines of the stderr tail (the last ones are kept).
    pub const STDERR_LINES: usize = 40;
    /// Bytes of each stderr line (its beginning is kept).
    pub const STDERR_LINE: usize = 256;
    /// Bytes of each short field (role, host, error file path, another failure's message).
    pub const SHORT: usize = 256;
    /// Other failures listed.
    pub const OTHER_FAILURES: usize = 64;
    /// Lines of the where-each-rank-stood report, and bytes of each.
    pub const STACK_LINES: usize = 16;
    pub const STACK_LINE: usize = 320;
    /// The most a bounded root cause takes as JSON, even when every byte needs `\u00XX`
    /// escaping: well under the service's 256 KiB body limit.
    pub const WIRE_BYTES: usize = 192 * 1024;
}

impl RootCause {
    /// The same root cause cut to the [`caps`], each cut marked in the text (`[… N bytes cut]`),
    /// so a failure report is never refused for its size. The full text stays in the local
    /// report and the log files.
    pub fn bounded(&self) -> RootCause {
        let tail_start = self.stderr_tail.len().saturating_sub(caps::STDERR_LINES);
        let mut stderr_tail: Vec<String> =
            self.stderr_tail[tail_start..].iter().map(|l| cut_end(l, caps::STDERR_LINE)).collect();
        if tail_start > 0 {
            stderr_tail[0] = format!("[… {tail_start} earlier lines cut] {}", stderr_tail[0]);
        }
        RootCause {
            role: cut_end(&self.role, caps::SHORT),
            host: cut_end(&self.host, caps::SHORT),
            message: cut_end(&self.message, caps::MESSAGE),
            traceback: self.traceback.as_deref().map(|t| cut_start(t, caps::TRACEBACK)),
            error_file: self.error_file.as_ref().map(|p| PathBuf::from(cut_end(&p.to_string_lossy(), caps::SHORT))),
            stderr_tail,
            other_failures: self
                .other_failures
                .iter()
                .take(caps::OTHER_FAILURES)
                .map(|o| OtherFailure { message: cut_end(&o.message, caps::SHORT), ..o.clone() })
                .collect(),
            stacks: self.stacks.iter().take(caps::STACK_LINES).map(|l| cut_end(l, caps::STACK_LINE)).collect(),
            ..self.clone()
        }
    }

    /// A root cause that says only `message` (rank 0, exit code 1): for tools and tests that
    /// report a failure without a worker behind it.
    pub fn from_message(message: impl Into<String>) -> RootCause {
        RootCause {
            rank: 0,
            local_rank: 0,
            role: "default".into(),
            host: String::new(),
            pid: 0,
            exit: Exit::Code(1),
            timestamp: 0,
            restart_count: 0,
            message: message.into(),
            traceback: None,
            error_file: None,
            stderr_tail: Vec::new(),
            other_failures: Vec::new(),
            stacks: Vec::new(),
            seen_at_ms: None,
            seen_ago_ms: None,
        }
    }

    /// One line for logs and reasons: `rank 3 on node0, exit code 7: message`.
    pub fn summary(&self) -> String {
        let first = self.message.lines().next().unwrap_or("");
        format!("rank {} on {}, {}: {}", self.rank, self.host, self.exit.describe(), cut_end(first, 200))
    }

    /// The human summary printed by the agent, in the spirit of torchrun's `ChildFailedError`.
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let bar = "=".repeat(72);
        let mut s = format!("{bar}\n{} FAILED\n{}\nRoot Cause (first observed failure):\n", self.role, "-".repeat(72));
        let _ = writeln!(s, "  time        : {}", format_time(self.timestamp));
        let _ = writeln!(s, "  host        : {}", self.host);
        let _ = writeln!(s, "  rank        : {} (local_rank: {})", self.rank, self.local_rank);
        let _ = writeln!(s, "  pid         : {}", self.pid);
        let _ = writeln!(s, "  exit        : {}", self.exit.describe());
        let _ = writeln!(s, "  attempt     : {} (TORCHELASTIC_RESTART_COUNT)", self.restart_count);
        match &self.error_file {
            Some(p) => {
                let _ = writeln!(s, "  error_file  : {}", p.display());
            }
            None => s += "  error_file  : <N/A>\n",
        }
        let _ = writeln!(s, "  message     : {}", self.message);
        if let Some(tb) = &self.traceback {
            s += "  traceback   :\n";
            for l in tb.lines() {
                let _ = writeln!(s, "    {l}");
            }
        } else if !self.stderr_tail.is_empty() {
            let _ = writeln!(s, "  stderr (last {} lines):", self.stderr_tail.len());
            for l in &self.stderr_tail {
                let _ = writeln!(s, "    {l}");
            }
        }
        if !self.stacks.is_empty() {
            let _ = writeln!(s, "{}\nWhere each rank stood (the odd one out first):", "-".repeat(72));
            for l in &self.stacks {
                let _ = writeln!(s, "  {l}");
            }
        }
        if !self.other_failures.is_empty() {
            let _ = writeln!(s, "{}\nOther Failures:", "-".repeat(72));
            for o in &self.other_failures {
                let _ = writeln!(
                    s,
                    "  rank {} (local_rank: {}), pid {}, {}: {}",
                    o.rank,
                    o.local_rank,
                    o.pid,
                    o.exit.describe(),
                    o.message
                );
            }
        }
        s += &bar;
        s.push('\n');
        s
    }

    /// The root cause in torchrun's error-file schema, so tools that read torchrun's agent error
    /// file read ours.
    pub fn to_error_file_json(&self) -> serde_json::Value {
        serde_json::json!({
            "message": {
                "message": self.message,
                "extraInfo": {
                    "py_callstack": self.traceback.clone().unwrap_or_else(|| self.stderr_tail.join("\n")),
                    "timestamp": self.timestamp.to_string(),
                    "rank": self.rank,
                    "local_rank": self.local_rank,
                    "host": self.host,
                    "exit": self.exit.describe(),
                    "stacks": self.stacks,
                }
            }
        })
    }
}

/// UTC `YYYY-MM-DD_HH:MM:SS` without a date library (civil-from-days, Howard Hinnant).
pub fn format_time(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}_{:02}:{:02}:{:02} UTC", secs / 3600, secs / 60 % 60, secs % 60)
}

/// A checked `host:port` (`[v6]:port` for IPv6 literals). On the wire, the string.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct HostPort {
    host: String,
    port: u16,
}

/// Why a `host:port` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not host:port ({why})")]
pub struct HostPortError {
    pub input: String,
    pub why: &'static str,
}

impl HostPort {
    /// The longest host name DNS allows.
    pub const MAX_HOST: usize = 253;

    pub fn new(host: impl Into<String>, port: u16) -> Result<HostPort, HostPortError> {
        let host = host.into();
        let bad = |why| Err(HostPortError { input: format!("{host}:{port}"), why });
        if host.is_empty() {
            return bad("empty host");
        }
        if host.len() > Self::MAX_HOST {
            return bad("host longer than 253 characters");
        }
        if host.chars().any(|c| c.is_whitespace() || c.is_control() || matches!(c, '/' | '[' | ']' | '@')) {
            return bad("host has whitespace, control characters, '/', '@' or brackets");
        }
        Ok(HostPort { host, port })
    }

    pub fn host(&self) -> &str {
        &self.host
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl FromStr for HostPort {
    type Err = HostPortError;

    fn from_str(s: &str) -> Result<HostPort, HostPortError> {
        let bad = |why| HostPortError { input: s.chars().take(300).collect(), why };
        let (host, port) = s.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let host = match host.strip_prefix('[') {
            Some(v6) => v6.strip_suffix(']').ok_or_else(|| bad("unclosed bracket"))?,
            None if host.contains(':') => return Err(bad("an IPv6 address needs brackets")),
            None => host,
        };
        let port: u16 = port.parse().map_err(|_| bad("port is not a number from 0 to 65535"))?;
        HostPort::new(host, port).map_err(|e| bad(e.why))
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl TryFrom<String> for HostPort {
    type Error = HostPortError;
    fn try_from(s: String) -> Result<HostPort, HostPortError> {
        s.parse()
    }
}

impl From<HostPort> for String {
    fn from(h: HostPort) -> String {
        h.to_string()
    }
}

/// A host without a port: a name or an address literal (an IPv6 literal without brackets; given
/// with them, they are taken off once, here).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Host(String);

impl Host {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The address literal, if it is one.
    pub fn ip(&self) -> Option<std::net::IpAddr> {
        self.0.parse().ok()
    }

    pub fn with_port(&self, port: u16) -> HostPort {
        HostPort { host: self.0.clone(), port }
    }
}

impl FromStr for Host {
    type Err = HostPortError;

    fn from_str(s: &str) -> Result<Host, HostPortError> {
        let bare = s.strip_prefix('[').and_then(|v| v.strip_suffix(']')).unwrap_or(s);
        let checked =
            HostPort::new(bare, 0).map_err(|e| HostPortError { input: s.chars().take(300).collect(), why: e.why })?;
        Ok(Host(checked.host))
    }
}

impl From<&HostPort> for Host {
    fn from(h: &HostPort) -> Host {
        Host(h.host.clone())
    }
}

/// The host as `host:port` would show it (IPv6 literals bare: `::1`).
impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A rendezvous endpoint: `host:port`, `http://host:port` or `https://host:port`, parsed once
/// (nothing after the port).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub scheme: Scheme,
    pub addr: HostPort,
}

/// How an endpoint was written: without a scheme (plain HTTP), `http://` or `https://`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    None,
    Http,
    Https,
}

impl Endpoint {
    pub fn is_tls(&self) -> bool {
        self.scheme == Scheme::Https
    }
}

impl FromStr for Endpoint {
    type Err = HostPortError;

    fn from_str(s: &str) -> Result<Endpoint, HostPortError> {
        let (scheme, rest) = match (s.strip_prefix("http://"), s.strip_prefix("https://")) {
            (Some(r), _) => (Scheme::Http, r),
            (_, Some(r)) => (Scheme::Https, r),
            _ => (Scheme::None, s),
        };
        let addr = rest
            .parse()
            .map_err(|e: HostPortError| HostPortError { input: s.chars().take(300).collect(), why: e.why })?;
        Ok(Endpoint { scheme, addr })
    }
}

/// As given: the scheme kept, nothing added.
impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scheme {
            Scheme::None => write!(f, "{}", self.addr),
            Scheme::Http => write!(f, "http://{}", self.addr),
            Scheme::Https => write!(f, "https://{}", self.addr),
        }
    }
}

/// What an agent tells the rendezvous about its node when it joins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Unique per agent process (e.g. `host-pid-random`): a restarted agent is a new node.
    pub node_id: String,
    /// Workers this node runs (`--nproc-per-node`).
    pub local_world_size: u32,
    /// The TCPStore this node's agent hosts for the round it joins; group rank 0's is the
    /// master store.
    pub store_addr: HostPort,
    /// Where other members reach this node's agent for the failure detector's probes, for the
    /// agent's whole life (the store changes every round); the store when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_addr: Option<HostPort>,
    /// What must match across nodes (versions, `NCCL_*` variables, the program's hash); the
    /// rendezvous keeps each distinct one once and reports how nodes differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<crate::fingerprint::Fingerprint>,
    /// Where the other members reach this node's agent for snapshots (copies to keep, parts to
    /// fetch, steps committed), for the agent's whole life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_addr: Option<HostPort>,
    /// The public half of the X25519 key this node's agent proves itself with to the other
    /// members' snapshot stores (64 lowercase hex digits). Its private half never leaves the
    /// agent: whoever reads the job's state learns nothing to pass as a member with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_key: Option<String>,
    /// The whole snapshot parts this node's agent holds as it joins: what the round restores is
    /// decided from every member's, alike on every node ([`SnapshotSet`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<SnapshotSet>,
}

/// What an agent tells the rendezvous of its round's progress, for the recovery accounting:
/// each instant as milliseconds before the report was sent, so the service dates it on its own
/// clock. Sent when something new is known; each field counts once per node and round.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeProgress {
    /// Every local worker was started (a warm one ordered, a cold one executed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ago_ms: Option<u64>,
    /// Every local rank asked for its state (`rlaunch.snapshot.load`): the program is up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_ago_ms: Option<u64>,
    /// Every local rank loaded the step its snapshots restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<StepAgo>,
    /// Every local rank saved a step in this round (the first such step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_step: Option<StepAgo>,
    /// The newest step this node's ranks had saved before this round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_before: Option<u64>,
    /// Every local rank saved `step_before` (or a later step) again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caught_up: Option<StepAgo>,
    /// This node's ranks that kept their process into this round (`rlaunch.resilient`); with
    /// `started_ago_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_ranks: Option<u32>,
}

/// A step and how long before the report it was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepAgo {
    pub step: u64,
    pub ago_ms: u64,
}

/// Parts of one snapshot a node holds: saved in round `tag`, at `step`, by a world of `world`
/// ranks; the ranks as half-open ranges.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotSet {
    pub tag: u64,
    pub step: u64,
    pub world: u32,
    pub ranks: Vec<(u32, u32)>,
}

/// Most snapshot sets a node may list, and most rank ranges in one: a node holds the last
/// committed step and those in progress, of its own ranks, of its buddy's and of those it
/// fetched (a few contiguous ranges). A join listing the most is about 1.3 kB of JSON: every
/// pending node and member is kept in the job's state, which etcd rewrites at each change.
pub const MAX_SNAPSHOT_SETS: usize = 8;
pub const MAX_SNAPSHOT_RANGES: usize = 8;

/// Most nodes of a round whose members keep snapshots in each other's memory: each member talks
/// to every other (announcements of whole steps) and its agent serves at most this many of
/// them, and the member list every join would carry grows the round's cost with the square of
/// the job. Past this, the rendezvous answers no member list and the agents keep no snapshots
/// for the round (`save` returns `False`, saying why).
pub const MAX_SNAPSHOT_NODES: usize = 512;

/// A member of a closed round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub node_id: String,
    pub group_rank: u32,
    pub local_world_size: u32,
    /// Global rank of this node's local rank 0: the sum of local world sizes before it.
    pub rank_offset: u32,
    pub store_addr: HostPort,
    /// As in [`NodeInfo::probe_addr`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_addr: Option<HostPort>,
    /// As in [`NodeInfo::snapshot_addr`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_addr: Option<HostPort>,
    /// As in [`NodeInfo::snapshot_key`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_key: Option<String>,
    /// As in [`NodeInfo::snapshots`], as the node joined this round.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshots: Vec<SnapshotSet>,
}

impl Member {
    /// The global ranks of this node's workers.
    pub fn ranks(&self) -> std::ops::Range<u32> {
        self.rank_offset..self.rank_offset.saturating_add(self.local_world_size)
    }
}

/// `--hang-timeout`: a fixed threshold, or one learned from the step period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum HangTimeout {
    Fixed(Duration),
    /// The largest of `factor` × the median period between progress events, twice the longest
    /// gap seen between them (a checkpoint every so often), and `floor`; `floor` × 5 while no
    /// period is known yet.
    Auto {
        factor: u32,
        floor: Duration,
    },
}

impl HangTimeout {
    /// `SECONDS` (fractions allowed), `auto`, or `auto:FLOOR_SECONDS` (learned, never below
    /// that floor instead of the default 60 s).
    pub fn parse(s: &str) -> Result<HangTimeout, HangTimeoutError> {
        let s = s.trim();
        let seconds = |v: &str| -> Result<Duration, HangTimeoutError> {
            let secs: f64 = v.parse().map_err(|_| HangTimeoutError::NotSeconds { given: s.to_owned() })?;
            // Workers are sampled once a second: a shorter threshold would judge a single sample.
            if !secs.is_finite() || !(1.0..=7.0 * 24.0 * 3600.0).contains(&secs) {
                return Err(HangTimeoutError::OutOfRange { seconds: v.to_owned() });
            }
            Ok(Duration::from_secs_f64(secs))
        };
        let lower = s.to_ascii_lowercase();
        if lower == "auto" {
            return Ok(HangTimeout::Auto { factor: AUTO_FACTOR, floor: AUTO_FLOOR });
        }
        if let Some(floor) = lower.strip_prefix("auto:") {
            return Ok(HangTimeout::Auto { factor: AUTO_FACTOR, floor: seconds(floor)? });
        }
        Ok(HangTimeout::Fixed(seconds(s)?))
    }
}

/// Why a `--hang-timeout` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HangTimeoutError {
    /// `given`: the whole value, trimmed.
    #[error("`{given}` is neither a number of seconds nor `auto`")]
    NotSeconds { given: String },
    /// `seconds`: the number as written (after `auto:` for a floor).
    #[error("{seconds} s is outside [1 s, 1 week]")]
    OutOfRange { seconds: String },
}

/// NVIDIA's learned timeouts use a few times the observed period; a step that sometimes takes
/// twice as long (a checkpoint, an evaluation) must not be a hang.
pub const AUTO_FACTOR: u32 = 10;
pub const AUTO_FLOOR: Duration = Duration::from_secs(60);

impl std::fmt::Display for HangTimeout {
    /// What `--hang-timeout` was given: `auto` or seconds.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HangTimeout::Auto { floor, .. } if *floor == AUTO_FLOOR => f.write_str("auto"),
            HangTimeout::Auto { floor, .. } => write!(f, "auto:{}", floor.as_secs_f64()),
            HangTimeout::Fixed(d) => write!(f, "{}", d.as_secs_f64()),
        }
    }
}

impl TryFrom<String> for HangTimeout {
    type Error = HangTimeoutError;
    fn try_from(s: String) -> Result<HangTimeout, HangTimeoutError> {
        HangTimeout::parse(&s)
    }
}

impl From<HangTimeout> for String {
    fn from(h: HangTimeout) -> String {
        h.to_string()
    }
}

/// What one member learns when its round closes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundInfo {
    pub round: u64,
    pub group_rank: u32,
    pub group_world_size: u32,
    /// Every member in group-rank order, only when the join asked for it (else empty): at
    /// 10,000 nodes the list is about 1.5 MB, and an agent needs only its own placement (the
    /// fields below). Always present on the wire, which older agents require.
    #[serde(default)]
    pub members: Vec<Member>,
    /// Digest of the round's member list (ids, ranks, offsets, stores): nodes holding the same
    /// digest hold the same round.
    #[serde(default)]
    pub members_digest: String,
    /// Group rank 0's store.
    pub master_store_addr: HostPort,
    pub restart_count: u32,
    pub max_restarts: u32,
    /// Sum of every member's local world size.
    pub world_size: u32,
    /// Global rank of this node's local rank 0.
    pub rank_offset: u32,
    pub local_world_size: u32,
    /// The job's `--hang-timeout` (the first node's), which every node applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hang_timeout: Option<HangTimeout>,
    /// How the round's nodes differ in their fingerprints (empty when they do not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fingerprint_diff: Vec<String>,
    /// The members this node watches while the round runs, and how (absent: nobody watches
    /// peers, as with a rendezvous older than peer watching or `peer_interval=0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watch: Option<PeerWatch>,
}

/// What a node watches of its peers during a round: a few other members' agents, pinged over
/// UDP at their probe endpoints every `interval_ms`; silence or a refusal is reported to the
/// rendezvous with the next (immediate) heartbeat. See the rendezvous' `detector` module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerWatch {
    pub interval_ms: u64,
    /// A node silent for less than this is never reported silent (a paused agent, a long GC).
    pub stall_bound_ms: u64,
    pub targets: Vec<WatchTarget>,
}

/// One member a node watches: its id and its agent's probe endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchTarget {
    pub node_id: String,
    pub addr: HostPort,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cause(text: &str, lines: usize) -> RootCause {
        RootCause {
            rank: 1,
            local_rank: 1,
            role: "default".into(),
            host: "h".into(),
            pid: 7,
            exit: Exit::Code(3),
            timestamp: 0,
            restart_count: 0,
            message: text.into(),
            traceback: Some(text.into()),
            error_file: None,
            stderr_tail: vec![text.to_owned(); lines],
            other_failures: Vec::new(),
            stacks: vec![text.to_owned(); lines],
            seen_at_ms: None,
            seen_ago_ms: None,
        }
    }

    #[test]
    fn bounded_root_cause_fits_the_wire_even_when_every_byte_needs_escaping() {
        // Control characters cost six bytes each as JSON (`\u0001`).
        let hostile = cause(&"\u{1}".repeat(200_000), 1000);
        let wire = serde_json::to_vec(&hostile.bounded()).unwrap();
        assert!(wire.len() <= caps::WIRE_BYTES, "{} bytes", wire.len());
        let b = hostile.bounded();
        assert!(b.message.ends_with("bytes cut]"), "the cut is marked");
        assert!(b.traceback.unwrap().starts_with("[… "), "the traceback keeps its end");
        assert_eq!(b.stderr_tail.len(), caps::STDERR_LINES);
        assert!(b.stderr_tail[0].starts_with("[… 960 earlier lines cut]"));
    }

    #[test]
    fn bounded_keeps_small_root_causes_as_they_are() {
        let c = cause("ValueError: planted", 3);
        assert_eq!(c.bounded(), c);
    }

    #[test]
    fn hosts_and_endpoints_parse_once_and_print_as_given() {
        let h: Host = "[fe80::1]".parse().unwrap();
        assert_eq!((h.as_str(), h.with_port(7).to_string()), ("fe80::1", "[fe80::1]:7".to_owned()));
        assert!(h.ip().is_some());
        let n: Host = "node-a".parse().unwrap();
        assert_eq!((n.to_string(), n.ip()), ("node-a".to_owned(), None));
        for bad in ["", "a b", "x/y", "[::1", "a@b"] {
            assert!(bad.parse::<Host>().is_err(), "{bad:?} must be refused");
        }
        for (given, scheme, addr) in [
            ("node0:29400", Scheme::None, "node0:29400"),
            ("http://[::1]:2379", Scheme::Http, "[::1]:2379"),
            ("https://rdzv.example:443", Scheme::Https, "rdzv.example:443"),
        ] {
            let e: Endpoint = given.parse().unwrap();
            assert_eq!((e.scheme, e.addr.to_string(), e.to_string()), (scheme, addr.to_owned(), given.to_owned()));
            assert_eq!(e.is_tls(), scheme == Scheme::Https);
        }
        for bad in ["node0", "http://node0", "https://:1", "ftp://a:1", "a:1/path", "[::1]"] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn host_port_parses_checks_and_prints() {
        let h: HostPort = "node0:29400".parse().unwrap();
        assert_eq!((h.host(), h.port(), h.to_string().as_str()), ("node0", 29400, "node0:29400"));
        let v6: HostPort = "[::1]:5".parse().unwrap();
        assert_eq!((v6.host(), v6.to_string().as_str()), ("::1", "[::1]:5"));
        for bad in ["", "h", ":1", "h:x", "h:70000", "::1:5", "a b:1", "[::1:5"] {
            assert!(bad.parse::<HostPort>().is_err(), "{bad:?} must be refused");
        }
        assert!(format!("{}:1", "a".repeat(254)).parse::<HostPort>().is_err());
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(json, "\"node0:29400\"");
        assert!(serde_json::from_str::<HostPort>("\"nope\"").is_err());
    }

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        assert_eq!(Exit::Code(3).shell_code(), 3);
        assert_eq!(Exit::Signal(9).shell_code(), 137);
        assert_eq!(Exit::Signal(11).describe(), "signal 11 (SIGSEGV)");
    }

    #[test]
    fn formats_utc_time() {
        assert_eq!(format_time(0), "1970-01-01_00:00:00 UTC");
        assert_eq!(format_time(1_795_300_000), "2026-11-21_22:26:40 UTC");
    }
}

//! Failure reports: reading a worker's error file (torchrun's JSON schema, as written by
//! PyTorch's `@record`), choosing the root cause, printing it, and writing the agent's own file.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::process::signal_name;

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

/// The first failure of a worker group, with everything a person needs to start debugging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
}

/// What a worker's error file said.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorFileData {
    pub message: String,
    pub traceback: Option<String>,
    pub timestamp: Option<u64>,
}

/// Reads an error file in torchrun's schema:
/// `{"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "..."}}}`
/// or the older `{"message": "...", "timestamp": ...}`. `None` when absent or unreadable.
pub fn read_error_file(path: &Path) -> Option<ErrorFileData> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let message = v.get("message")?;
    let as_u64 = |x: &serde_json::Value| x.as_u64().or_else(|| x.as_str().and_then(|s| s.trim().parse().ok()));
    match message {
        serde_json::Value::String(s) => {
            Some(ErrorFileData { message: s.clone(), traceback: None, timestamp: v.get("timestamp").and_then(as_u64) })
        }
        serde_json::Value::Object(m) => {
            let extra = m.get("extraInfo");
            Some(ErrorFileData {
                message: m.get("message").and_then(|x| x.as_str()).unwrap_or("<no message>").to_string(),
                traceback: extra.and_then(|e| e.get("py_callstack")).and_then(|x| x.as_str()).map(str::to_string),
                timestamp: extra.and_then(|e| e.get("timestamp")).and_then(as_u64),
            })
        }
        _ => None,
    }
}

pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl RootCause {
    /// The human summary printed by the agent, in the spirit of torchrun's `ChildFailedError`.
    pub fn render(&self) -> String {
        let bar = "=".repeat(72);
        let mut s = format!("{bar}\n{} FAILED\n{}\nRoot Cause (first observed failure):\n", self.role, "-".repeat(72));
        s += &format!("  time        : {}\n", format_time(self.timestamp));
        s += &format!("  host        : {}\n", self.host);
        s += &format!("  rank        : {} (local_rank: {})\n", self.rank, self.local_rank);
        s += &format!("  pid         : {}\n", self.pid);
        s += &format!("  exit        : {}\n", self.exit.describe());
        s += &format!("  attempt     : {} (TORCHELASTIC_RESTART_COUNT)\n", self.restart_count);
        match &self.error_file {
            Some(p) => s += &format!("  error_file  : {}\n", p.display()),
            None => s += "  error_file  : <N/A>\n",
        }
        s += &format!("  message     : {}\n", self.message);
        if let Some(tb) = &self.traceback {
            s += "  traceback   :\n";
            for l in tb.lines() {
                s += &format!("    {l}\n");
            }
        } else if !self.stderr_tail.is_empty() {
            s += &format!("  stderr (last {} lines):\n", self.stderr_tail.len());
            for l in &self.stderr_tail {
                s += &format!("    {l}\n");
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
                }
            }
        })
    }
}

/// Writes `value` to `path` through a temporary file and a rename, so a reader never sees half.
pub fn write_json_atomically(path: &Path, value: &serde_json::Value) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, path)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_torch_record_schema_and_legacy_schema() {
        let dir = tempfile_dir();
        let p = dir.join("error.json");
        std::fs::write(
            &p,
            r#"{"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "Traceback...", "timestamp": "1700000000"}}}"#,
        )
        .unwrap();
        let d = read_error_file(&p).expect("valid file");
        assert_eq!(d.message, "RuntimeError: boom");
        assert_eq!(d.traceback.as_deref(), Some("Traceback..."));
        assert_eq!(d.timestamp, Some(1_700_000_000));
        std::fs::write(&p, r#"{"message": "plain", "timestamp": 5}"#).unwrap();
        let d = read_error_file(&p).expect("legacy file");
        assert_eq!((d.message.as_str(), d.timestamp), ("plain", Some(5)));
        std::fs::write(&p, "not json").unwrap();
        assert!(read_error_file(&p).is_none());
        std::fs::remove_dir_all(dir).ok();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("rlaunch-report-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
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

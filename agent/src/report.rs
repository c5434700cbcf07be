//! Failure reports: reading a worker's error file (torchrun's JSON schema, as written by
//! PyTorch's `@record`), choosing the root cause, printing it, and writing the agent's own file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use std::time::{SystemTime, UNIX_EPOCH};

pub use rlaunch::contract::{format_time, Exit, RootCause};

use tracing::warn;

use crate::logdir::LogRoot;

/// The most of a worker's error file the agent reads.
pub const ERROR_FILE_CAP: usize = 1 << 20;

/// What a worker's error file said.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorFileData {
    pub message: String,
    pub traceback: Option<String>,
    pub timestamp: Option<u64>,
}

/// Reads an error file in torchrun's schema:
/// `{"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "..."}}}`
/// or the older `{"message": "...", "timestamp": ...}`. `None` when absent or unreadable, or not
/// a regular file: `path` (under the run directory) is read through `root`, never following a
/// symlink (to a file the worker could not read itself) nor waiting on a FIFO it put there.
pub fn read_error_file(root: &LogRoot, path: &Path) -> Option<ErrorFileData> {
    // A worker may write anything there: read at most the cap, and treat a larger file as one
    // that says only that.
    let bytes = root.read(path, ERROR_FILE_CAP + 1).ok()?;
    let text = match String::from_utf8(bytes) {
        Ok(t) if t.len() <= ERROR_FILE_CAP => t,
        _ => {
            return Some(ErrorFileData {
                message: format!(
                    "the worker's error file is larger than {ERROR_FILE_CAP} bytes or not UTF-8; see it on the host"
                ),
                traceback: None,
                timestamp: None,
            })
        }
    };
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

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)).unwrap_or(0)
}

/// Writes `value` to `path` through a temporary file and a rename, so a reader never sees half.
/// The file's data is fsync'd before the rename, and the directory after it, so a crash leaves
/// either the old file or the whole new one. The temporary file is made new and never through a
/// symlink (see [`crate::logdir::write_atomically_at`]).
pub fn write_json_atomically(path: &Path, value: &serde_json::Value) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    let leaf = path.file_name().map(Path::new).ok_or_else(|| std::io::Error::other("no file name"))?;
    let parent = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // The caller named the directory: a link there is followed, none below it.
    let dir = crate::logdir::open_dir(libc::AT_FDCWD, parent, true)?;
    crate::logdir::write_atomically_at(&dir, leaf, &bytes)
}

/// The agent's own error file: `{log_root}/error.json`, and `$TORCHELASTIC_ERROR_FILE` when the
/// agent was given one (as torchrun's `@record`-decorated main writes it).
pub fn write_agent_error_file(log_root: &LogRoot, root_cause: &RootCause, agent_env: &BTreeMap<String, String>) {
    let json = root_cause.to_error_file_json();
    let ours = log_root.path().join("error.json");
    let bytes = match serde_json::to_vec_pretty(&json) {
        Ok(b) => b,
        Err(e) => return warn!(error = %e, "cannot render the agent's error file"),
    };
    if let Err(e) = log_root.write_atomically(&ours, &bytes) {
        warn!(path = %ours.display(), error = %e, "cannot write the agent's error file");
    }
    if let Some(f) = agent_env.get(rlaunch::env::ERROR_FILE).map(PathBuf::from) {
        if let Err(e) = write_json_atomically(&f, &json) {
            warn!(path = %f.display(), error = %e, "cannot write the agent's error file");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_torch_record_schema_and_legacy_schema() {
        let base = tempfile::tempdir().unwrap();
        let root = LogRoot::create_in_as(base.path(), "run", false).unwrap();
        let p = root.path().join("error.json");
        std::fs::write(
            &p,
            r#"{"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "Traceback...", "timestamp": "1700000000"}}}"#,
        )
        .unwrap();
        let d = read_error_file(&root, &p).expect("valid file");
        assert_eq!(d.message, "RuntimeError: boom");
        assert_eq!(d.traceback.as_deref(), Some("Traceback..."));
        assert_eq!(d.timestamp, Some(1_700_000_000));
        std::fs::write(&p, r#"{"message": "plain", "timestamp": 5}"#).unwrap();
        let d = read_error_file(&root, &p).expect("legacy file");
        assert_eq!((d.message.as_str(), d.timestamp), ("plain", Some(5)));
        std::fs::write(&p, "not json").unwrap();
        assert!(read_error_file(&root, &p).is_none());
    }

    #[test]
    fn a_huge_error_file_is_not_read_whole() {
        let base = tempfile::tempdir().unwrap();
        let root = LogRoot::create_in_as(base.path(), "run", false).unwrap();
        let p = root.path().join("error.json");
        let big = format!(r#"{{"message": "{}"}}"#, "x".repeat(ERROR_FILE_CAP + 10));
        std::fs::write(&p, big).unwrap();
        let d = read_error_file(&root, &p).expect("a message saying the file is too large");
        assert!(d.message.contains("larger than"), "{}", d.message);
    }

    /// What a worker leaves where its error file goes is its own: a FIFO is not waited on (the
    /// agent used to block there for good), a symlink to a file it could not read is not
    /// followed (its text would have become the root cause), a link in a directory above it
    /// neither.
    #[test]
    fn an_error_file_that_is_a_fifo_or_a_symlink_is_not_read() {
        let base = tempfile::tempdir().unwrap();
        let root = LogRoot::create_in_as(&base.path().join("logs"), "run", false).unwrap();
        let worker = root.path().join("attempt_0/0");
        root.create_dirs(&worker).unwrap();
        let secret = base.path().join("secret.json");
        std::fs::write(&secret, r#"{"message": "SECRET"}"#).unwrap();
        let p = worker.join("error.json");
        std::os::unix::fs::symlink(&secret, &p).unwrap();
        assert_eq!(read_error_file(&root, &p), None, "a symlink is not followed");
        std::fs::remove_file(&p).unwrap();
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) on a NUL-terminated path in a private temporary directory.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let path = p.clone();
        let root = std::sync::Arc::new(root);
        let r = root.clone();
        std::thread::spawn(move || tx.send(read_error_file(&r, &path)).unwrap());
        let got =
            rx.recv_timeout(std::time::Duration::from_secs(5)).expect("reading a FIFO does not wait for a writer");
        assert_eq!(got, None);
        // A directory above it swapped for a link to where the secret is.
        let elsewhere = base.path().join("elsewhere/0");
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::copy(&secret, elsewhere.join("error.json")).unwrap();
        std::fs::rename(root.path().join("attempt_0"), base.path().join("moved")).unwrap();
        std::os::unix::fs::symlink(base.path().join("elsewhere"), root.path().join("attempt_0")).unwrap();
        assert_eq!(read_error_file(&root, &p), None, "no link followed on the way");
    }

    #[test]
    fn the_temporary_file_is_never_written_through_a_symlink() {
        let dir = tempfile_dir("tmp-link");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let _ = std::fs::remove_file(dir.join("error.json.tmp"));
        std::os::unix::fs::symlink(&victim, dir.join("error.json.tmp")).unwrap();
        write_json_atomically(&dir.join("error.json"), &serde_json::json!({"message": "m"})).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert_eq!(std::fs::read_to_string(dir.join("error.json")).unwrap(), "{\n  \"message\": \"m\"\n}");
        std::fs::remove_dir_all(dir).ok();
    }

    fn tempfile_dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("rlaunch-report-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

//! A real headless Chromium, driven over the DevTools protocol on a pipe
//! (`--remote-debugging-pipe`: the browser reads commands from its fd 3 and writes answers and
//! events to its fd 4, each JSON message ended by a NUL byte). A test opens a page, evaluates
//! JavaScript in it to read its DOM while it lives, and takes screenshots; no WebDriver, no
//! WebSocket, no port. The browser and its helper processes are killed when [`Browser`] drops.
//!
//! Needs Debian's `chromium` (`scripts/install-deps.sh` installs it); panics loudly without it.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long one DevTools command may take.
const CALL_DEADLINE: Duration = Duration::from_secs(30);

pub struct Browser {
    child: Child,
    commands: File,
    answers: Receiver<Value>,
    next_id: u64,
    /// The page's DevTools session, once [`Browser::open`] attached to it.
    session: Option<String>,
    log: PathBuf,
    _profile: tempfile::TempDir,
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`, which we then own.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just created and are owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// How many times a browser that never answers is started again. On a loaded 2-core machine a
/// fresh headless Chromium has been seen to leave its first tab unanswered for 30 s (its log
/// empty); a second one then works. A browser that fails every try still fails the test.
const TRIES: usize = 3;

impl Browser {
    /// Starts headless Chromium with a fresh profile; its own output goes to `log`. It is known
    /// to answer DevTools commands when this returns.
    pub fn launch(log: &Path) -> Browser {
        let mut last = String::new();
        for attempt in 1..=TRIES {
            let mut browser = Browser::spawn(log);
            match browser.try_call("Browser.getVersion", json!({}), false) {
                Ok(_) => return browser,
                Err(e) => {
                    eprintln!("chromium try {attempt} of {TRIES}: {e}");
                    last = e;
                }
            }
        }
        panic!("chromium never answered in {TRIES} tries: {last}")
    }

    fn spawn(log: &Path) -> Browser {
        let chromium = crate::which("chromium").or_else(|| crate::which("chromium-browser")).unwrap_or_else(|| {
            panic!("chromium is not installed: scripts/install-deps.sh installs it (Debian's `chromium`)")
        });
        let profile = tempfile::Builder::new().prefix("rlaunch-it-chromium-").tempdir().expect("a profile dir");
        let (cmd_read, cmd_write) = pipe();
        let (ans_read, ans_write) = pipe();
        let (cr, aw) = (cmd_read.as_raw_fd(), ans_write.as_raw_fd());
        let out = File::create(log).expect("the browser's log file");
        let mut cmd = Command::new(chromium);
        cmd.args([
            "--headless=new",
            "--remote-debugging-pipe",
            // Root cannot use Chromium's sandbox; the page is our own, served by the test.
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1280,860",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log fd"))
        .stderr(out)
        // Its own process group, so the renderer and GPU helpers go with it.
        .process_group(0);
        // SAFETY: only async-signal-safe calls (fcntl, dup2, close) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Out of the way of 3 and 4 first, whatever numbers the pipes got.
                let c = libc::fcntl(cr, libc::F_DUPFD, 10);
                let a = libc::fcntl(aw, libc::F_DUPFD, 10);
                if c < 0 || a < 0 || libc::dup2(c, 3) < 0 || libc::dup2(a, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(c);
                libc::close(a);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("starting chromium");
        drop((cmd_read, ans_write));
        let (tx, answers) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(File::from(ans_read));
            let mut buf = Vec::new();
            while r.read_until(0, &mut buf).is_ok_and(|n| n > 0) {
                if buf.last() == Some(&0) {
                    buf.pop();
                }
                if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
                buf.clear();
            }
        });
        Browser {
            child,
            commands: File::from(cmd_write),
            answers,
            next_id: 1,
            session: None,
            log: log.to_owned(),
            _profile: profile,
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = (text.len().saturating_sub(3000)..).find(|i| text.is_char_boundary(*i)).unwrap_or(0);
        text[start..].to_owned()
    }

    /// Sends one command and waits for its answer (events meanwhile are dropped); panics when
    /// none comes or the command fails.
    fn call(&mut self, method: &str, params: Value, on_page: bool) -> Value {
        self.try_call(method, params, on_page).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Browser::call`], but no answer within [`CALL_DEADLINE`], or the browser gone, is an
    /// error (with the browser's log) rather than a panic. A command that fails still panics.
    fn try_call(&mut self, method: &str, params: Value, on_page: bool) -> Result<Value, String> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if on_page {
            msg["sessionId"] = json!(self.session.as_deref().expect("Browser::open first"));
        }
        let mut bytes = serde_json::to_vec(&msg).expect("json");
        bytes.push(0);
        if let Err(e) = self.commands.write_all(&bytes) {
            return Err(format!("chromium is gone ({e}); its log:\n{}", self.log_tail()));
        }
        let until = Instant::now() + CALL_DEADLINE;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.answers.recv_timeout(left) {
                Ok(v) if v["id"] == json!(id) => {
                    if let Some(e) = v.get("error") {
                        panic!("DevTools {method} failed: {e}");
                    }
                    return Ok(v["result"].clone());
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!(
                        "DevTools {method}: no answer within {CALL_DEADLINE:?}; chromium's log:\n{}",
                        self.log_tail()
                    ))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!("chromium closed its pipe during {method}; its log:\n{}", self.log_tail()))
                }
            }
        }
    }

    /// Opens `url` in a new tab and attaches to it; later calls act on that tab.
    /// A browser whose new tab never answers is replaced by a fresh one (up to [`TRIES`] in
    /// all), as [`Browser::launch`] does; tabs opened before are then gone.
    pub fn open(&mut self, url: &str) {
        let mut target = self.try_call("Target.createTarget", json!({"url": url}), false);
        for attempt in 2..=TRIES {
            let Err(e) = &target else { break };
            eprintln!("chromium's new tab, try {} of {TRIES}: {e}", attempt - 1);
            let log = self.log.clone();
            // The old one is killed as it drops.
            *self = Browser::launch(&log);
            target = self.try_call("Target.createTarget", json!({"url": url}), false);
        }
        let target = target.unwrap_or_else(|e| panic!("{e}"));
        let target_id = target["targetId"].as_str().expect("a target id").to_owned();
        let attached = self.call("Target.attachToTarget", json!({"targetId": target_id, "flatten": true}), false);
        self.session = Some(attached["sessionId"].as_str().expect("a session id").to_owned());
    }

    /// Evaluates `expression` in the page: its value (JSON-serialisable values only; a promise
    /// is awaited), or the description of what it threw.
    pub fn try_eval(&mut self, expression: &str) -> Result<Value, String> {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            true,
        );
        match r.get("exceptionDetails") {
            Some(ex) => {
                Err(ex["exception"]["description"].as_str().map(str::to_owned).unwrap_or_else(|| ex.to_string()))
            }
            None => Ok(r["result"]["value"].clone()),
        }
    }

    /// [`Browser::try_eval`] that panics when the script throws.
    pub fn eval(&mut self, expression: &str) -> Value {
        self.try_eval(expression).unwrap_or_else(|e| panic!("page script `{expression}` threw: {e}"))
    }

    /// Polls `expression` until it is truthy (a throw counts as not yet: the page may still be
    /// loading); panics after `deadline` with its last value.
    pub fn wait_for(&mut self, what: &str, expression: &str, deadline: Duration) -> Value {
        let until = Instant::now() + deadline;
        loop {
            let v = self.try_eval(expression);
            if let Ok(v) = &v {
                if !matches!(v, Value::Null | Value::Bool(false)) && *v != json!("") && *v != json!(0) {
                    return v.clone();
                }
            }
            assert!(Instant::now() < until, "waited {deadline:?} for the page to show {what}; last value {v:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A PNG of the page as it is now, written to `path`.
    pub fn screenshot(&mut self, path: &Path) {
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}), true);
        let png = base64_decode(r["data"].as_str().expect("screenshot data"));
        assert!(png.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
        std::fs::write(path, png).expect("writing the screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: killpg on the group chromium leads (it was spawned with process_group(0)).
        unsafe { libc::killpg(pid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// Standard base64 (with padding), as DevTools sends binary data.
fn base64_decode(s: &str) -> Vec<u8> {
    fn val(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes().filter(|c| !c.is_ascii_whitespace() && *c != b'=') {
        acc = (acc << 6) | val(c).expect("base64 data");
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_decodes_what_it_should() {
        assert_eq!(super::base64_decode("aGVsbG8="), b"hello");
        assert_eq!(super::base64_decode("iVBORw0KGgo="), b"\x89PNG\r\n\x1a\n");
        assert_eq!(super::base64_decode(""), b"");
    }
}

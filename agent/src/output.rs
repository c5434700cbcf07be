//! Worker output: pipes read line by line, each line prefixed (`[default0]:`) and written whole
//! to the console by one writer thread, so lines of different ranks never interleave; optional
//! per-attempt, per-rank log files; the tail of stderr kept for the failure report.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt};

/// Lines longer than this are cut into pieces, each printed with the prefix, so a worker that
/// never prints a newline cannot make the agent buffer without bound.
pub const MAX_LINE: usize = 64 * 1024;
/// How many lines of each worker's stderr are kept for the failure report.
pub const TAIL_LINES: usize = 40;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Which of a worker's streams go somewhere: torchrun's `Std` (0 none, 1 out, 2 err, 3 both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StdSet {
    pub stdout: bool,
    pub stderr: bool,
}

impl StdSet {
    pub const NONE: StdSet = StdSet { stdout: false, stderr: false };
    pub const ALL: StdSet = StdSet { stdout: true, stderr: true };

    pub fn from_code(code: u8) -> Option<StdSet> {
        match code {
            0 => Some(StdSet::NONE),
            1 => Some(StdSet { stdout: true, stderr: false }),
            2 => Some(StdSet { stdout: false, stderr: true }),
            3 => Some(StdSet::ALL),
            _ => None,
        }
    }

    pub fn has(self, s: Stream) -> bool {
        match s {
            Stream::Stdout => self.stdout,
            Stream::Stderr => self.stderr,
        }
    }
}

/// The agent's console: one thread owns stdout and stderr and writes whole lines.
#[derive(Clone)]
pub struct Console {
    tx: SyncSender<ConsoleMsg>,
}

enum ConsoleMsg {
    Line(Stream, Vec<u8>),
    Flush(SyncSender<()>),
}

impl Console {
    /// Starts the writer thread. Lines are queued with back-pressure (a slow terminal slows the
    /// workers down rather than growing memory).
    pub fn start() -> Console {
        let (tx, rx) = sync_channel::<ConsoleMsg>(4096);
        std::thread::Builder::new()
            .name("rlaunch-console".into())
            .spawn(move || console_thread(rx))
            .expect("spawning a thread at start-up cannot fail short of resource exhaustion");
        Console { tx }
    }

    /// Queues one complete line (with its trailing newline).
    pub fn line(&self, stream: Stream, line: Vec<u8>) {
        // The console closes only at exit; a line dropped then is fine.
        let _ = self.tx.send(ConsoleMsg::Line(stream, line));
    }

    /// Waits (at most a few seconds) until every line queued so far is written.
    pub fn flush(&self) {
        let (done_tx, done_rx) = sync_channel(1);
        if self.tx.send(ConsoleMsg::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv_timeout(std::time::Duration::from_secs(5));
        }
    }
}

fn console_thread(rx: Receiver<ConsoleMsg>) {
    let mut out = io::stdout();
    let mut err = io::stderr();
    while let Ok(msg) = rx.recv() {
        // Errors writing to our own console (a closed pipe) must not stop the job.
        match msg {
            ConsoleMsg::Line(Stream::Stdout, line) => {
                let _ = out.write_all(&line).and_then(|_| out.flush());
            }
            ConsoleMsg::Line(Stream::Stderr, line) => {
                let _ = err.write_all(&line);
            }
            ConsoleMsg::Flush(done) => {
                let _ = out.flush();
                let _ = err.flush();
                let _ = done.send(());
            }
        }
    }
}

/// Where one stream of one worker goes.
pub struct Sink {
    pub stream: Stream,
    /// `Some(prefix)` when the stream is shown on the console.
    pub console: Option<(Console, Vec<u8>)>,
    pub file: Option<PathBuf>,
    /// Keeps the last lines for the failure report.
    pub tail: Option<Arc<Mutex<VecDeque<String>>>>,
}

/// Copies `reader` to its sink until end of file. Returns when the worker closed the stream.
///
/// The log file is written as long as it can be; a file that cannot be opened or written (a full
/// disk) is reported once and the stream goes on to the console, so a worker is never stopped
/// by its logs.
pub async fn pump(mut reader: impl AsyncRead + Unpin, sink: Sink) -> io::Result<()> {
    let mut file = match &sink.file {
        Some(path) => match open_log(path) {
            Ok(f) => Some((io::BufWriter::new(f), path)),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot open the log file; this stream is not kept in a file (the console still gets it where it is shown)");
                None
            }
        },
        None => None,
    };
    let mut pending: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        if let Some((f, path)) = file.as_mut() {
            if let Err(e) = f.write_all(&chunk[..n]).and_then(|()| f.flush()) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the log file any more; the rest of this stream is not kept in a file (the console still gets it where it is shown)");
                file = None;
            }
        }
        pending.extend_from_slice(&chunk[..n]);
        let mut start = 0;
        while let Some(pos) = pending[start..].iter().position(|&b| b == b'\n') {
            let line = &pending[start..start + pos];
            if line.is_empty() {
                emit(&sink, line);
            }
            for piece in line.chunks(MAX_LINE) {
                emit(&sink, piece);
            }
            start += pos + 1;
        }
        pending.drain(..start);
        while pending.len() >= MAX_LINE {
            let rest = pending.split_off(MAX_LINE);
            emit(&sink, &pending);
            pending = rest;
        }
    }
    if !pending.is_empty() {
        emit(&sink, &pending);
    }
    Ok(())
}

/// Opens a log file without ever following a symlink: created new, or (a later round of the same
/// attempt) appended to when it is a regular file already.
fn open_log(path: &std::path::Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let new = std::fs::OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(path);
    match new {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            std::fs::OpenOptions::new().append(true).custom_flags(libc::O_NOFOLLOW).open(path)
        }
        other => other,
    }
}

fn emit(sink: &Sink, line: &[u8]) {
    if let Some((console, prefix)) = &sink.console {
        let mut buf = Vec::with_capacity(prefix.len() + line.len() + 1);
        buf.extend_from_slice(prefix);
        buf.extend_from_slice(line);
        buf.push(b'\n');
        console.line(sink.stream, buf);
    }
    if let Some(tail) = &sink.tail {
        let mut t = tail.lock().expect("tail lock is never poisoned");
        if t.len() == TAIL_LINES {
            t.pop_front();
        }
        t.push_back(String::from_utf8_lossy(line).into_owned());
    }
}

/// Expands torchrun's log-line prefix template (`${role_name}`, `${rank}`, `${local_rank}`,
/// `${hostname}`).
pub fn render_prefix(template: &str, role: &str, rank: u32, local_rank: u32, hostname: &str) -> String {
    template
        .replace("${role_name}", role)
        .replace("${local_rank}", &local_rank.to_string())
        .replace("${rank}", &rank.to_string())
        .replace("${hostname}", hostname)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_template_expands_every_macro() {
        assert_eq!(render_prefix("[${role_name}${rank}]:", "default", 12, 3, "h"), "[default12]:");
        assert_eq!(render_prefix("${hostname}:${local_rank}: ", "r", 12, 3, "node7"), "node7:3: ");
    }

    #[tokio::test]
    async fn pump_splits_lines_keeps_tail_and_cuts_overlong_lines() {
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let long = vec![b'x'; MAX_LINE + 10];
        let mut input = b"one\n\ntwo\n".to_vec();
        input.extend_from_slice(&long);
        input.extend_from_slice(b"\nlast-no-newline");
        let sink = Sink { stream: Stream::Stderr, console: None, file: None, tail: Some(tail.clone()) };
        pump(&input[..], sink).await.expect("reading a slice cannot fail");
        let t = tail.lock().unwrap();
        assert_eq!(t[0], "one");
        assert_eq!(t[1], "", "empty lines are kept");
        assert_eq!(t[2], "two");
        assert_eq!(t[3].len(), MAX_LINE);
        assert_eq!(t[4], "x".repeat(10));
        assert_eq!(t[5], "last-no-newline");
    }
}

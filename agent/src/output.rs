//! Worker output: pipes or pseudo-terminals read line by line, each line prefixed
//! (`[default0]:`) and written by one console thread through a line discipline, so that lines of
//! different ranks never interleave, long lines pass whole and a worker's unfinished line (a
//! progress bar) shows at once on a terminal; optional per-attempt, per-rank log files; the
//! tail of stderr kept for the failure report; torchrun's duplicate filters.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt};

/// A line longer than this reaches the console in pieces of this size that continue one line
/// (the agent never buffers more than this of a line); the failure report's tail and the
/// duplicate filters see a line's first this-many bytes.
pub const MAX_LINE: usize = 64 * 1024;
/// How many lines of each worker's stderr are kept for the failure report.
pub const TAIL_LINES: usize = 40;
/// How long other ranks' lines wait while a long line is still arriving, before the long line
/// is broken to let them through.
pub const HOLD: Duration = Duration::from_secs(1);
/// How many bytes of other ranks' lines may wait for a long line to end.
pub const HOLD_BYTES: usize = 16 << 20;

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

/// A piece of one worker stream's output on its way to the console.
#[derive(Debug, Clone)]
pub struct Piece {
    /// Which worker stream it comes from (unique in the agent).
    pub source: u64,
    pub stream: Stream,
    pub prefix: Arc<[u8]>,
    pub bytes: Vec<u8>,
    /// The line ends after these bytes.
    pub end: bool,
    /// Earlier pieces of this line went to the console already.
    pub cont: bool,
    /// The line is long and more of it follows at once: other ranks' lines wait (up to
    /// [`HOLD`]) so that it reaches the console whole. Progress output (`\r` updates on a
    /// terminal) does not hold anyone up.
    pub hold: bool,
}

/// The console's line discipline, decided purely: which bytes go to which stream so that every
/// worker line starts with its prefix, a line left open (a progress bar, the first pieces of a
/// long line) is closed before another rank's line starts, and two ranks' bytes are never glued
/// into one line.
pub struct Discipline {
    /// On a terminal: `\r` returns to just after the prefix, not over it.
    tty: bool,
    /// stdout and stderr are the same terminal: one open line between them.
    shared: bool,
    slots: [Slot; 2],
}

#[derive(Default)]
struct Slot {
    open: Option<OpenLine>,
    held: VecDeque<Piece>,
    held_bytes: usize,
}

struct OpenLine {
    source: u64,
    stream: Stream,
    hold_until: Option<Instant>,
}

/// What the console writes: bytes to one of its streams.
pub type Out = (Stream, Vec<u8>);

impl Discipline {
    pub fn new(tty: bool, shared: bool) -> Discipline {
        Discipline { tty, shared, slots: Default::default() }
    }

    fn slot(&self, stream: Stream) -> usize {
        if self.shared || stream == Stream::Stdout {
            0
        } else {
            1
        }
    }

    /// One piece arrives at `now`.
    pub fn push(&mut self, piece: Piece, now: Instant, out: &mut Vec<Out>) {
        // A hold that ran out is over before anything new is written.
        if self.deadline().is_some_and(|t| now >= t) {
            self.tick(now, out);
        }
        let slot = self.slot(piece.stream);
        let s = &mut self.slots[slot];
        let Some(open) = &s.open else { return self.write(slot, piece, now, out) };
        if open.source == piece.source {
            return self.write(slot, piece, now, out);
        }
        let holding = open.hold_until.is_some_and(|t| now < t);
        // A source with lines waiting already waits behind them, so its lines stay in order.
        let queued = s.held.iter().any(|p| p.source == piece.source);
        if holding || queued {
            if s.held_bytes + piece.bytes.len() <= HOLD_BYTES {
                s.held_bytes += piece.bytes.len();
                s.held.push_back(piece);
                return;
            }
            // Too much waiting: the long line is broken and everything held goes out first.
            if let Some(open) = s.open.take() {
                out.push((open.stream, b"\n".to_vec()));
            }
            self.release(slot, now, out);
            return self.push(piece, now, out);
        }
        self.write(slot, piece, now, out);
    }

    fn write(&mut self, slot: usize, piece: Piece, now: Instant, out: &mut Vec<Out>) {
        let tty = self.tty;
        let s = &mut self.slots[slot];
        let continues = s.open.as_ref().is_some_and(|o| o.source == piece.source);
        if piece.cont && !continues && piece.end && piece.bytes.is_empty() {
            // The end of a line that another rank's line already closed on the console.
            self.release(slot, now, out);
            return;
        }
        if !continues {
            if let Some(open) = s.open.take() {
                out.push((open.stream, b"\n".to_vec()));
            }
        }
        let mut bytes = Vec::with_capacity(piece.prefix.len() + piece.bytes.len() + 1);
        if !continues {
            bytes.extend_from_slice(&piece.prefix);
        }
        if tty {
            // A carriage return goes back to the start of the worker's text, after its prefix.
            for (i, &b) in piece.bytes.iter().enumerate() {
                bytes.push(b);
                if b == b'\r' && piece.bytes.get(i + 1) != Some(&b'\n') {
                    bytes.extend_from_slice(&piece.prefix);
                }
            }
        } else {
            bytes.extend_from_slice(&piece.bytes);
        }
        if piece.end {
            bytes.push(b'\n');
            s.open = None;
        } else {
            let hold_until = if !piece.hold {
                None
            } else if continues {
                s.open.as_ref().and_then(|o| o.hold_until).or(Some(now + HOLD))
            } else {
                Some(now + HOLD)
            };
            s.open = Some(OpenLine { source: piece.source, stream: piece.stream, hold_until });
        }
        out.push((piece.stream, bytes));
        if piece.end {
            self.release(slot, now, out);
        }
    }

    /// Lets held pieces through, each as if it arrived now: in order per source, and waiting
    /// again behind a line that opens a new hold.
    fn release(&mut self, slot: usize, now: Instant, out: &mut Vec<Out>) {
        let held = std::mem::take(&mut self.slots[slot].held);
        self.slots[slot].held_bytes = 0;
        for piece in held {
            self.push(piece, now, out);
        }
    }

    /// Time passes: a long line that kept others waiting past [`HOLD`] is broken.
    pub fn tick(&mut self, now: Instant, out: &mut Vec<Out>) {
        for slot in 0..2 {
            let expired = self.slots[slot].open.as_ref().and_then(|o| o.hold_until).is_some_and(|t| now >= t);
            if expired {
                if let Some(open) = self.slots[slot].open.take() {
                    out.push((open.stream, b"\n".to_vec()));
                }
                self.release(slot, now, out);
            }
        }
    }

    /// The user typed a line on the terminal (input for a worker): its echo moved the cursor to
    /// a new line, so an open line (a prompt) is over without another newline.
    pub fn typed(&mut self) {
        for slot in &mut self.slots {
            if slot.open.as_ref().is_some_and(|o| o.hold_until.is_none()) {
                slot.open = None;
            }
        }
    }

    /// When [`Discipline::tick`] has something to do next.
    pub fn deadline(&self) -> Option<Instant> {
        self.slots.iter().filter_map(|s| s.open.as_ref().and_then(|o| o.hold_until)).min()
    }

    /// Everything written now: held pieces go out and open lines are closed.
    pub fn close_all(&mut self, now: Instant, out: &mut Vec<Out>) {
        for slot in 0..2 {
            loop {
                if let Some(open) = self.slots[slot].open.take() {
                    out.push((open.stream, b"\n".to_vec()));
                }
                let Some(piece) = self.slots[slot].held.pop_front() else { break };
                self.slots[slot].held_bytes -= piece.bytes.len();
                self.write(slot, piece, now, out);
            }
        }
    }
}

/// The agent's console: one thread owns stdout and stderr and writes through the
/// [`Discipline`].
#[derive(Clone)]
pub struct Console {
    tx: SyncSender<ConsoleMsg>,
    /// stdout is a terminal: workers whose stdout is shown get pseudo-terminals.
    pub tty: bool,
    /// stderr is a terminal: likewise for the workers' stderr.
    pub stderr_tty: bool,
    next_source: Arc<AtomicU64>,
}

enum ConsoleMsg {
    Piece(Piece),
    /// The user typed a line for a worker: the terminal's echo ended the line on the screen.
    Typed,
    Flush(SyncSender<()>),
}

impl Console {
    /// Starts the writer thread. Pieces are queued with back-pressure (a slow terminal slows the
    /// workers down rather than growing memory).
    pub fn start() -> Console {
        use std::io::IsTerminal;
        let tty = io::stdout().is_terminal();
        let stderr_tty = io::stderr().is_terminal();
        let shared = tty && stderr_tty;
        let (tx, rx) = sync_channel::<ConsoleMsg>(4096);
        std::thread::Builder::new()
            .name("rlaunch-console".into())
            .spawn(move || console_thread(rx, Discipline::new(tty, shared)))
            .expect("spawning a thread at start-up cannot fail short of resource exhaustion");
        Console { tx, tty, stderr_tty, next_source: Arc::new(AtomicU64::new(1)) }
    }

    /// A number naming one worker stream for [`Piece::source`].
    pub fn new_source(&self) -> u64 {
        self.next_source.fetch_add(1, Ordering::Relaxed)
    }

    /// A line typed for a worker was echoed by the terminal.
    pub fn typed(&self) {
        let _ = self.tx.send(ConsoleMsg::Typed);
    }

    pub fn piece(&self, piece: Piece) {
        // The console closes only at exit; a piece dropped then is fine.
        let _ = self.tx.send(ConsoleMsg::Piece(piece));
    }

    /// Waits (at most a few seconds) until every piece queued so far is written, open lines
    /// closed.
    pub fn flush(&self) {
        let (done_tx, done_rx) = sync_channel(1);
        if self.tx.send(ConsoleMsg::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv_timeout(Duration::from_secs(5));
        }
    }
}

fn console_thread(rx: Receiver<ConsoleMsg>, mut discipline: Discipline) {
    let mut out = io::stdout();
    let mut err = io::stderr();
    let mut writes = Vec::new();
    loop {
        let msg = match discipline.deadline() {
            Some(t) => match rx.recv_timeout(t.saturating_duration_since(Instant::now())) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            },
            None => match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => return,
            },
        };
        let now = Instant::now();
        let mut flushed = None;
        match msg {
            Some(ConsoleMsg::Piece(p)) => discipline.push(p, now, &mut writes),
            Some(ConsoleMsg::Typed) => discipline.typed(),
            Some(ConsoleMsg::Flush(done)) => {
                discipline.close_all(now, &mut writes);
                flushed = Some(done);
            }
            None => discipline.tick(now, &mut writes),
        }
        // Errors writing to our own console (a closed pipe) must not stop the job.
        for (stream, bytes) in writes.drain(..) {
            match stream {
                Stream::Stdout => {
                    let _ = out.write_all(&bytes).and_then(|_| out.flush());
                }
                Stream::Stderr => {
                    let _ = err.write_all(&bytes);
                }
            }
        }
        if let Some(done) = flushed {
            let _ = out.flush();
            let _ = err.flush();
            let _ = done.send(());
        }
    }
}

/// torchrun's `--duplicate-stdout-filters`/`--duplicate-stderr-filters`: console lines that
/// contain any of the needles are also written, prefixed, to one file per attempt.
pub struct DupFilter {
    needles: Vec<String>,
    file: Mutex<Option<io::BufWriter<File>>>,
    path: PathBuf,
}

impl DupFilter {
    /// Opens (creates, with its directory, or appends to) `path`; `None`, and nothing created,
    /// for an empty list of needles.
    /// Made through the held run directory, never through a symlink.
    pub fn open(
        needles: &[String],
        root: &crate::logdir::LogRoot,
        path: PathBuf,
    ) -> io::Result<Option<Arc<DupFilter>>> {
        let needles: Vec<String> = needles.iter().filter(|n| !n.is_empty()).cloned().collect();
        if needles.is_empty() {
            return Ok(None);
        }
        if let Some(dir) = path.parent() {
            root.create_dirs(dir)?;
        }
        let file = root.open(&path, crate::logdir::Open::Append)?;
        Ok(Some(Arc::new(DupFilter { needles, file: Mutex::new(Some(io::BufWriter::new(file))), path })))
    }

    fn line(&self, prefix: &[u8], line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        if !self.needles.iter().any(|n| text.contains(n.as_str())) {
            return;
        }
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = file.as_mut() {
            let r = f.write_all(prefix).and_then(|()| f.write_all(line)).and_then(|()| f.write_all(b"\n"));
            if let Err(e) = r.and_then(|()| f.flush()) {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot write the filtered log any more");
                *file = None;
            }
        }
    }
}

/// The agent's stdin, forwarded to one worker's terminal (`--stdin-rank`) so that `input()` and
/// `breakpoint()` work there.
#[derive(Clone)]
pub struct StdinRouter {
    state: Arc<Mutex<RouterState>>,
}

#[derive(Default)]
struct RouterState {
    target: Option<(u64, File)>,
    /// The agent's stdin ended for good: a new target gets end-of-file at once.
    ended: bool,
}

/// Writes typed input to a worker's terminal, whose master is non-blocking: a full input queue
/// (a large paste while the worker is busy) is waited out, up to 10 s; a worker that exited
/// meanwhile gets nothing.
fn write_input(terminal: &mut File, mut bytes: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !bytes.is_empty() {
        match terminal.write(bytes) {
            Ok(0) => return,
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => return,
        }
    }
}

/// The terminal's end-of-file character (`VEOF`, Ctrl-D): what a worker reading its terminal
/// sees as the end of input.
const EOF_CHAR: u8 = 4;

impl StdinRouter {
    /// Starts the thread that reads the agent's stdin. In the background of a shell, reading the
    /// terminal fails (SIGTTIN is ignored, so it is EIO rather than a stopped agent) and is
    /// tried again until the job is brought to the foreground.
    pub fn start(console: Console) -> StdinRouter {
        use std::io::{IsTerminal, Read};
        let router = StdinRouter { state: Arc::new(Mutex::new(RouterState::default())) };
        // SAFETY: setting a signal's disposition to "ignore" has no preconditions; workers set it
        // back to the default before they run.
        unsafe { libc::signal(libc::SIGTTIN, libc::SIG_IGN) };
        let state = router.state.clone();
        let spawned = std::thread::Builder::new().name("rlaunch-stdin".into()).spawn(move || {
            let tty = io::stdin().is_terminal();
            let mut stdin = io::stdin().lock();
            let mut buf = [0u8; 4096];
            let mut last_was_eof = false;
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => {
                        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some((_, f)) = st.target.as_mut() {
                            write_input(f, &[EOF_CHAR]);
                        }
                        // A terminal gives end-of-file once per Ctrl-D; one that keeps giving it
                        // was hung up.
                        if !tty || last_was_eof {
                            st.ended = true;
                            return;
                        }
                        last_was_eof = true;
                    }
                    Ok(n) => {
                        last_was_eof = false;
                        if tty && buf[..n].contains(&b'\n') {
                            console.typed();
                        }
                        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some((_, f)) = st.target.as_mut() {
                            write_input(f, &buf[..n]);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) if e.raw_os_error() == Some(libc::EIO) => {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    Err(_) => return,
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot forward stdin to the workers");
        }
        router
    }

    /// From now on stdin goes to `terminal` (the worker's, named by `id`).
    pub fn set(&self, id: u64, mut terminal: File) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.ended {
            write_input(&mut terminal, &[EOF_CHAR]);
        }
        st.target = Some((id, terminal));
    }

    /// The worker `id` is gone: its terminal gets no more input.
    pub fn clear(&self, id: u64) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.target.as_ref().is_some_and(|(t, _)| *t == id) {
            st.target = None;
        }
    }
}

/// Where one stream of one worker goes.
pub struct Sink {
    pub stream: Stream,
    /// `Some(prefix)` when the stream is shown on the console.
    pub console: Option<(Console, Vec<u8>)>,
    /// The stream's log file, opened by the caller (through the held run directory), and its path.
    pub file: Option<(File, PathBuf)>,
    /// Keeps the last lines for the failure report.
    pub tail: Option<Arc<Mutex<VecDeque<String>>>>,
    /// A line not yet ended goes to the console at once (a worker on a terminal: progress bars,
    /// prompts); otherwise only whole lines, and long lines in [`MAX_LINE`] pieces.
    pub partial: bool,
    /// Console lines matching the duplicate filters also go there.
    pub dup: Option<Arc<DupFilter>>,
    /// Counts the bytes read (a sign of progress, for hang detection).
    pub written: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// Copies `reader` to its sink until end of file. Returns when the worker closed the stream.
///
/// The log file is written as long as it can be; a file that cannot be opened or written (a full
/// disk) is reported once and the stream goes on to the console, so a worker is never stopped
/// by its logs.
pub async fn pump(mut reader: impl AsyncRead + Unpin, mut sink: Sink) -> io::Result<()> {
    let mut file = sink.file.take().map(|(f, path)| (io::BufWriter::new(f), path));
    let mut lines = LineState::new(&sink);
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let n = match reader.read(&mut chunk).await {
            Ok(n) => n,
            // A pseudo-terminal's master reads EIO once every holder of the worker's side closed.
            Err(e) if e.raw_os_error() == Some(libc::EIO) => 0,
            Err(e) => {
                lines.finish(&sink);
                return Err(e);
            }
        };
        if n == 0 {
            break;
        }
        if let Some(w) = &sink.written {
            w.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some((f, path)) = file.as_mut() {
            if let Err(e) = f.write_all(&chunk[..n]).and_then(|()| f.flush()) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the log file any more; the rest of this stream is not kept in a file (the console still gets it where it is shown)");
                file = None;
            }
        }
        lines.feed(&sink, &chunk[..n]);
    }
    lines.finish(&sink);
    Ok(())
}

/// A stream cut into lines for the console, the tail and the filters.
struct LineState {
    source: u64,
    prefix: Arc<[u8]>,
    pending: Vec<u8>,
    /// The first [`MAX_LINE`] bytes of the current line already sent on as pieces.
    head: Vec<u8>,
    /// Part of the current line went to the console already.
    open: bool,
}

impl LineState {
    fn new(sink: &Sink) -> LineState {
        let (source, prefix) = match &sink.console {
            Some((c, p)) => (c.new_source(), Arc::from(p.as_slice())),
            None => (0, Arc::from(&b""[..])),
        };
        LineState { source, prefix, pending: Vec::with_capacity(4096), head: Vec::new(), open: false }
    }

    fn piece(&mut self, sink: &Sink, bytes: Vec<u8>, end: bool, hold: bool) {
        if let Some((console, _)) = &sink.console {
            let piece = Piece {
                source: self.source,
                stream: sink.stream,
                prefix: self.prefix.clone(),
                bytes,
                end,
                cont: self.open,
                hold,
            };
            console.piece(piece);
        }
        self.open = !end;
    }

    fn feed(&mut self, sink: &Sink, data: &[u8]) {
        self.pending.extend_from_slice(data);
        let mut start = 0;
        while let Some(pos) = self.pending[start..].iter().position(|&b| b == b'\n') {
            let line = self.pending[start..start + pos].to_vec();
            self.end_line(sink, line);
            start += pos + 1;
        }
        self.pending.drain(..start);
        if !self.pending.is_empty() && (sink.partial || self.pending.len() >= MAX_LINE) {
            let rest = std::mem::take(&mut self.pending);
            let room = MAX_LINE.saturating_sub(self.head.len());
            self.head.extend_from_slice(&rest[..rest.len().min(room)]);
            let hold = rest.len() >= MAX_LINE;
            self.piece(sink, rest, false, hold);
        }
    }

    fn end_line(&mut self, sink: &Sink, line: Vec<u8>) {
        let head = std::mem::take(&mut self.head);
        let dup = sink.dup.as_ref().filter(|_| sink.console.is_some());
        if dup.is_some() || sink.tail.is_some() {
            // The line's first MAX_LINE bytes, with what went ahead in pieces.
            let whole: std::borrow::Cow<[u8]> = if head.is_empty() {
                (&line[..line.len().min(MAX_LINE)]).into()
            } else {
                let mut w = head;
                let room = MAX_LINE.saturating_sub(w.len());
                w.extend_from_slice(&line[..line.len().min(room)]);
                w.into()
            };
            if let Some(dup) = dup {
                dup.line(&self.prefix, &whole);
            }
            if let Some(tail) = &sink.tail {
                let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(String::from_utf8_lossy(&whole).into_owned());
            }
        }
        self.piece(sink, line, true, false);
    }

    /// The stream ended: a last line without its newline is still a line.
    fn finish(&mut self, sink: &Sink) {
        if !self.pending.is_empty() || self.open {
            let rest = std::mem::take(&mut self.pending);
            self.end_line(sink, rest);
        }
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
    async fn pump_splits_lines_keeps_tail_and_keeps_long_lines_whole() {
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let long = vec![b'x'; MAX_LINE * 3 + 10];
        let mut input = b"one\n\ntwo\n".to_vec();
        input.extend_from_slice(&long);
        input.extend_from_slice(b"\nlast-no-newline");
        let sink = Sink {
            stream: Stream::Stderr,
            console: None,
            file: None,
            tail: Some(tail.clone()),
            partial: false,
            dup: None,
            written: None,
        };
        pump(&input[..], sink).await.expect("reading a slice cannot fail");
        let t = tail.lock().unwrap();
        assert_eq!(t[0], "one");
        assert_eq!(t[1], "", "empty lines are kept");
        assert_eq!(t[2], "two");
        assert_eq!(t[3].len(), MAX_LINE, "the tail keeps a long line's head, as one line");
        assert_eq!(t[4], "last-no-newline");
        assert_eq!(t.len(), 5);
    }

    fn piece(source: u64, bytes: &str, end: bool, cont: bool, hold: bool) -> Piece {
        let prefix: Arc<[u8]> = Arc::from(format!("[{source}]:").as_bytes());
        Piece { source, stream: Stream::Stdout, prefix, bytes: bytes.as_bytes().to_vec(), end, cont, hold }
    }

    fn text(out: &[Out]) -> String {
        out.iter().map(|(_, b)| String::from_utf8_lossy(b).into_owned()).collect()
    }

    #[test]
    fn two_ranks_partial_lines_are_never_glued_into_one_line() {
        let t0 = Instant::now();
        let mut d = Discipline::new(true, true);
        let mut out = Vec::new();
        d.push(piece(1, "a1", false, false, false), t0, &mut out);
        d.push(piece(2, "b1", false, false, false), t0, &mut out);
        d.push(piece(1, "a2", false, true, false), t0, &mut out);
        d.push(piece(1, " done", true, true, false), t0, &mut out);
        d.push(piece(2, "", true, true, false), t0, &mut out);
        assert_eq!(text(&out), "[1]:a1\n[2]:b1\n[1]:a2 done\n", "rank 2's end of a line already closed adds nothing");
    }

    #[test]
    fn a_ranks_lines_keep_their_order_when_a_hold_ends_or_overflows() {
        let t0 = Instant::now();
        let mut d = Discipline::new(false, false);
        let mut out = Vec::new();
        d.push(piece(1, "long", false, false, true), t0, &mut out);
        d.push(piece(2, "b1", true, false, false), t0, &mut out);
        // The hold ran out before the console thread ticked: b1 still goes before b2.
        d.push(piece(2, "b2", true, false, false), t0 + HOLD * 2, &mut out);
        assert_eq!(text(&out), "[1]:long\n[2]:b1\n[2]:b2\n");
        // Past the held-bytes cap: the long line breaks, held lines go first, in order.
        let mut d = Discipline::new(false, false);
        let mut out = Vec::new();
        d.push(piece(1, "long", false, false, true), t0, &mut out);
        d.push(piece(2, "b1", true, false, false), t0, &mut out);
        let big = "x".repeat(HOLD_BYTES);
        d.push(piece(2, &big, false, false, false), t0, &mut out);
        assert_eq!(text(&out), format!("[1]:long\n[2]:b1\n[2]:{big}"));
        assert_eq!(d.slots[0].held.len(), 0);
    }

    #[test]
    fn a_typed_line_ends_the_prompt_it_answered() {
        let t0 = Instant::now();
        let mut d = Discipline::new(true, true);
        let mut out = Vec::new();
        d.push(piece(1, "(Pdb) ", false, false, false), t0, &mut out);
        // The terminal echoed the user's line and its newline: the answer starts a line of its own.
        d.typed();
        d.push(piece(1, "42", true, true, false), t0, &mut out);
        assert_eq!(text(&out), "[1]:(Pdb) [1]:42\n");
    }

    #[test]
    fn on_a_terminal_carriage_returns_go_back_to_just_after_the_prefix() {
        let t0 = Instant::now();
        let mut d = Discipline::new(true, true);
        let mut out = Vec::new();
        d.push(piece(1, "\r 10%", false, false, false), t0, &mut out);
        d.push(piece(1, "\r 20%\r\n", true, true, false), t0, &mut out);
        assert_eq!(text(&out), "[1]:\r[1]: 10%\r[1]: 20%\r\n\n");
        // Not a terminal: bytes pass as written.
        let mut d = Discipline::new(false, false);
        let mut out = Vec::new();
        d.push(piece(1, "\r 10%", true, false, false), t0, &mut out);
        assert_eq!(text(&out), "[1]:\r 10%\n");
    }

    #[test]
    fn a_long_line_passes_whole_while_others_wait_up_to_the_hold() {
        let t0 = Instant::now();
        let mut d = Discipline::new(false, false);
        let mut out = Vec::new();
        d.push(piece(1, "xxxx", false, false, true), t0, &mut out);
        d.push(piece(2, "short", true, false, false), t0, &mut out);
        assert_eq!(d.deadline(), Some(t0 + HOLD));
        d.push(piece(1, "yyyy", false, true, true), t0 + HOLD / 2, &mut out);
        d.push(piece(1, "zz", true, true, false), t0 + HOLD / 2, &mut out);
        assert_eq!(text(&out), "[1]:xxxxyyyyzz\n[2]:short\n");
        assert_eq!(d.deadline(), None);

        // A line that never ends is broken after the hold, and the others go through.
        let mut out = Vec::new();
        d.push(piece(1, "xxxx", false, false, true), t0, &mut out);
        d.push(piece(2, "short", true, false, false), t0, &mut out);
        d.tick(t0 + HOLD / 2, &mut out);
        assert_eq!(text(&out), "[1]:xxxx");
        d.tick(t0 + HOLD, &mut out);
        d.push(piece(1, "rest", true, true, false), t0 + HOLD, &mut out);
        assert_eq!(text(&out), "[1]:xxxx\n[2]:short\n[1]:rest\n");

        // Released lines wait again behind a held line that is itself long.
        let mut out = Vec::new();
        d.push(piece(1, "aaaa", false, false, true), t0, &mut out);
        d.push(piece(2, "bbbb", false, false, true), t0, &mut out);
        d.push(piece(3, "c", true, false, false), t0, &mut out);
        d.push(piece(2, "bend", true, true, false), t0, &mut out);
        d.push(piece(1, "aend", true, true, false), t0, &mut out);
        assert_eq!(text(&out), "[1]:aaaaaend\n[2]:bbbbbend\n[3]:c\n");
    }

    #[test]
    fn stdout_and_stderr_hold_lines_apart_unless_they_are_one_terminal() {
        let t0 = Instant::now();
        let mut err = piece(2, "e", true, false, false);
        err.stream = Stream::Stderr;
        let mut d = Discipline::new(false, false);
        let mut out = Vec::new();
        d.push(piece(1, "o", false, false, true), t0, &mut out);
        d.push(err.clone(), t0, &mut out);
        assert_eq!(out, vec![(Stream::Stdout, b"[1]:o".to_vec()), (Stream::Stderr, b"[2]:e\n".to_vec())]);
        let mut d = Discipline::new(true, true);
        let mut out = Vec::new();
        d.push(piece(1, "o", false, false, false), t0, &mut out);
        d.push(err, t0, &mut out);
        assert_eq!(text(&out), "[1]:o\n[2]:e\n");
        // A flush closes what is open and lets everything held out.
        let mut out = Vec::new();
        d.push(piece(1, "x", false, false, true), t0, &mut out);
        d.push(piece(3, "y", true, false, false), t0, &mut out);
        d.close_all(t0, &mut out);
        assert_eq!(text(&out), "[1]:x\n[3]:y\n");
    }

    #[tokio::test]
    async fn duplicate_filters_copy_matching_console_lines_with_their_prefix() {
        let base = tempfile::tempdir().unwrap();
        let root = crate::logdir::LogRoot::create_in(base.path(), "run").unwrap();
        let dir = root.path();
        // The attempt's directory is made when a filter needs it.
        let path = dir.join("attempt_0/filtered_stdout.log");
        let dup = DupFilter::open(&["apple".into(), "or,ange".into()], &root, path.clone()).unwrap();
        let (tx, _rx) = sync_channel(64);
        let console = Console { tx, tty: false, stderr_tty: false, next_source: Arc::new(AtomicU64::new(1)) };
        let sink = Sink {
            stream: Stream::Stdout,
            console: Some((console, b"[default0]:".to_vec())),
            file: None,
            tail: None,
            partial: false,
            dup,
            written: None,
        };
        pump(&b"an apple\npear\nor,ange juice\norange\n"[..], sink).await.unwrap();
        let got = std::fs::read_to_string(&path).unwrap();
        assert_eq!(got, "[default0]:an apple\n[default0]:or,ange juice\n");
        assert!(DupFilter::open(&["".into()], &root, dir.join("attempt_1/none")).unwrap().is_none());
        assert!(!dir.join("attempt_1").exists(), "no filter, nothing made");
    }
}

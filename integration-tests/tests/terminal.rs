//! rlaunch run from a real terminal (a pseudo-terminal made here, rlaunch its session's
//! controlling process, as a shell would run it): workers see a terminal, tqdm's progress shows
//! before its line ends, pdb on rank 0 takes commands from stdin, Ctrl-C typed on the terminal
//! reaches `except KeyboardInterrupt`, two ranks' unfinished lines are never glued together.
//! And with pipes: long lines pass whole.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use integration_tests::{bin, run_deadline, stderr_of, stdout_of, tempdir, venv_python, wait_deadline, wait_until};

const DEADLINE: Duration = Duration::from_secs(60);

/// A terminal with rlaunch running on it: what it printed so far, and a keyboard.
struct Terminal {
    child: Child,
    master: std::fs::File,
    screen: Arc<Mutex<Vec<u8>>>,
}

impl Terminal {
    fn run(args: &[&str], dir: &Path) -> Terminal {
        // SAFETY: plain libc calls on descriptors created and owned here.
        let (master, slave) = unsafe {
            let m = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
            assert!(m >= 0, "posix_openpt: {}", std::io::Error::last_os_error());
            assert_eq!(libc::grantpt(m), 0);
            assert_eq!(libc::unlockpt(m), 0);
            let mut name = [0 as libc::c_char; 128];
            assert_eq!(libc::ptsname_r(m, name.as_mut_ptr(), name.len()), 0);
            let s = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
            assert!(s >= 0, "open the pty: {}", std::io::Error::last_os_error());
            let ws = libc::winsize { ws_row: 40, ws_col: 120, ws_xpixel: 0, ws_ypixel: 0 };
            libc::ioctl(m, libc::TIOCSWINSZ, &ws);
            (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s))
        };
        let mut cmd = Command::new(bin("rlaunch"));
        cmd.args(args)
            .current_dir(dir)
            .env("RLAUNCH_LOG", "warn")
            .env("PYTHON_EXEC", venv_python())
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: setsid and ioctl are async-signal-safe; they make rlaunch the session leader
        // with this terminal as its controlling one, so Ctrl-C typed here signals it.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn rlaunch");
        drop(cmd);
        let master = std::fs::File::from(master);
        let screen = Arc::new(Mutex::new(Vec::new()));
        let (mut reader, sink) = (master.try_clone().unwrap(), screen.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once rlaunch and its workers closed the terminal.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Terminal { child, master, screen }
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.screen.lock().unwrap()).into_owned()
    }

    /// Waits until the screen shows `what`; panics with the screen past the deadline.
    fn wait_for(&self, what: &str) {
        let end = Instant::now() + DEADLINE;
        while !self.screen().contains(what) {
            if Instant::now() > end {
                panic!("the terminal never showed {what:?}; it shows:\n{}", self.screen());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn type_keys(&mut self, keys: &str) {
        self.master.write_all(keys.as_bytes()).unwrap();
    }

    /// Waits for rlaunch to exit; its exit code, and everything the terminal showed.
    fn finish(mut self) -> (Option<i32>, String) {
        let end = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(200));
                return (status.code(), self.screen());
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                panic!("rlaunch did not exit; the terminal shows:\n{}", self.screen());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn script(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[test]
fn workers_see_a_terminal_and_tqdm_progress_shows_before_its_line_ends() {
    let dir = tempdir();
    let go = dir.path().join("go");
    let w = script(
        dir.path(),
        "w.py",
        &format!(
            "import os, sys, time\n\
             from tqdm import tqdm\n\
             print('tty', sys.stdin.isatty(), sys.stdout.isatty(), sys.stderr.isatty(), flush=True)\n\
             for i in tqdm(range(4), ncols=60):\n\
             \x20   if i == 2:\n\
             \x20       while not os.path.exists('{go}'):\n\
             \x20           time.sleep(0.05)\n\
             \x20   time.sleep(0.3)\n",
            go = go.display()
        ),
    );
    let t = Terminal::run(&["--standalone", "--nproc-per-node", "1", &w], dir.path());
    t.wait_for("[default0]:tty True True True");
    // The bar's line has not ended (the loop waits for `go`), yet its update is on the screen,
    // after the rank's prefix: a carriage return goes back to just after it.
    t.wait_for("[default0]: 50%");
    std::fs::write(&go, "").unwrap();
    let (code, screen) = t.finish();
    assert_eq!(code, Some(0), "{screen}");
    assert!(screen.contains("4/4"), "the bar finished: {screen}");
}

#[test]
fn pdb_on_rank_0_takes_commands_from_stdin() {
    let dir = tempdir();
    let w = script(
        dir.path(),
        "w.py",
        "import os\n\
         x = 41\n\
         if os.environ['RANK'] == '0':\n\
         \x20   breakpoint()\n\
         print('after', os.environ['RANK'], x, flush=True)\n",
    );
    let mut t = Terminal::run(&["--standalone", "--nproc-per-node", "2", &w], dir.path());
    t.wait_for("(Pdb)");
    t.type_keys("p x + 1\n");
    t.wait_for("42");
    t.type_keys("c\n");
    let (code, screen) = t.finish();
    assert_eq!(code, Some(0), "{screen}");
    assert!(screen.contains("[default0]:after 0 41"), "{screen}");
    assert!(screen.contains("[default1]:after 1 41"), "rank 1 read no stdin and went on: {screen}");
}

#[test]
fn stdin_goes_to_the_rank_stdin_rank_names() {
    let dir = tempdir();
    let w = script(
        dir.path(),
        "w.py",
        "import os, sys\n\
         if sys.stdin.isatty():\n\
         \x20   print('read', repr(input('? ')), flush=True)\n\
         else:\n\
         \x20   print('no terminal input; read ' + repr(sys.stdin.read()), flush=True)\n",
    );
    let mut t = Terminal::run(&["--standalone", "--nproc-per-node", "2", "--stdin-rank", "1", &w], dir.path());
    // One string, one write: print's separate writes of its arguments may each end up on their
    // own line when rank 1's prompt comes between them (an unfinished line is never shared).
    t.wait_for("[default0]:no terminal input; read ''");
    t.wait_for("?");
    t.type_keys("hello\n");
    let (code, screen) = t.finish();
    assert_eq!(code, Some(0), "{screen}");
    assert!(screen.contains("[default1]:read 'hello'"), "{screen}");
}

#[test]
fn ctrl_c_typed_on_the_terminal_reaches_except_keyboard_interrupt() {
    let dir = tempdir();
    let w = script(
        dir.path(),
        "w.py",
        "import sys, time\n\
         try:\n\
         \x20   print('up', flush=True)\n\
         \x20   time.sleep(60)\n\
         except KeyboardInterrupt:\n\
         \x20   print('caught KeyboardInterrupt', flush=True)\n\
         \x20   sys.exit(0)\n",
    );
    let mut t = Terminal::run(&["--standalone", "--nproc-per-node", "2", &w], dir.path());
    // 'up' is printed inside the try: a ^C typed right after it is seen (it reached CI once
    // while rank 1 was still returning from print, before the try, and its traceback won).
    t.wait_for("[default0]:up");
    t.wait_for("[default1]:up");
    t.type_keys("\x03");
    let (code, screen) = t.finish();
    assert_eq!(screen.matches("caught KeyboardInterrupt").count(), 2, "{screen}");
    assert_eq!(code, Some(130), "128 + SIGINT: {screen}");
}

#[test]
fn two_ranks_unfinished_lines_are_never_glued_into_one_line() {
    let dir = tempdir();
    // Each rank writes its letter in pieces, with pauses, before ending its line.
    let w = script(
        dir.path(),
        "w.py",
        "import os, sys, time\n\
         c = 'ab'[int(os.environ['RANK'])]\n\
         for line in range(3):\n\
         \x20   for i in range(5):\n\
         \x20       sys.stdout.write(c * 3); sys.stdout.flush(); time.sleep(0.03)\n\
         \x20   sys.stdout.write('\\n'); sys.stdout.flush()\n",
    );
    let t = Terminal::run(&["--standalone", "--nproc-per-node", "2", &w], dir.path());
    let (code, screen) = t.finish();
    assert_eq!(code, Some(0), "{screen}");
    let mut letters = 0;
    for line in screen.lines().map(|l| l.trim_end_matches('\r')).filter(|l| !l.is_empty()) {
        let (prefix, text) = if let Some(t) = line.strip_prefix("[default0]:") {
            ("a", t)
        } else if let Some(t) = line.strip_prefix("[default1]:") {
            ("b", t)
        } else {
            panic!("a line without a rank's prefix: {line:?} in\n{screen}");
        };
        assert!(text.chars().all(|c| c.to_string() == prefix), "one rank's text only: {line:?} in\n{screen}");
        letters += text.len();
    }
    assert_eq!(letters, 2 * 3 * 5 * 3, "nothing lost: {screen}");
}

#[test]
fn long_lines_pass_whole_through_pipes_while_another_rank_prints() {
    let dir = tempdir();
    let w = script(
        dir.path(),
        "w.py",
        "import os, sys\n\
         r = int(os.environ['RANK'])\n\
         if r == 0:\n\
         \x20   sys.stdout.write('L' * 300000 + '\\n')\n\
         else:\n\
         \x20   for i in range(200):\n\
         \x20       print('short', i)\n",
    );
    let o = run_deadline(
        Command::new(bin("rlaunch"))
            .env("PYTHON_EXEC", venv_python())
            .args(["--standalone", "--nproc-per-node", "2", &w])
            .current_dir(dir.path()),
        DEADLINE,
    );
    assert!(o.status.success(), "{}", stderr_of(&o));
    let out = stdout_of(&o);
    let long: Vec<&str> = out.lines().filter(|l| l.contains('L')).collect();
    assert_eq!(long.len(), 1, "one console line for the long line");
    assert_eq!(long[0], format!("[default0]:{}", "L".repeat(300000)));
    assert_eq!(out.lines().filter(|l| l.starts_with("[default1]:short ")).count(), 200);
}

#[test]
fn without_a_terminal_workers_get_pipes_and_the_launchers_stdin() {
    let dir = tempdir();
    let w = script(
        dir.path(),
        "w.py",
        "import sys\nprint('tty', sys.stdin.isatty(), sys.stdout.isatty(), sys.stderr.isatty(), repr(sys.stdin.read()))\n",
    );
    let child = Command::new(bin("rlaunch"))
        .env("PYTHON_EXEC", venv_python())
        .args(["--standalone", "--nproc-per-node", "1", &w])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // stdin is the launcher's pipe, as under torchrun (`echo cfg | torchrun ...`): the stdin rank
    // reads what was written, to its end.
    let mut child = child;
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"piped\n").unwrap();
    let o = wait_deadline(child, DEADLINE);
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(stdout_of(&o).contains("[default0]:tty False False False 'piped\\n'"), "{}", stdout_of(&o));
}

#[test]
fn rlaunch_top_redraws_a_jobs_view_on_the_terminal_until_the_job_ends() {
    let dir = tempdir();
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let addr = format!("127.0.0.1:{port}");
    let mut service = Command::new(bin("rlaunch-rendezvous"))
        .args(["--listen", &addr])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("rlaunch-rendezvous starts");
    wait_until("the service to listen", DEADLINE, || std::net::TcpStream::connect(&addr).is_ok());
    // top first: the job does not exist yet, and top waits for it.
    let t = Terminal::run(&["top", "--rdzv-endpoint", &addr, "--rdzv-id", "topjob", "--interval", "0.2"], dir.path());
    t.wait_for("no status: ");
    let go = dir.path().join("go");
    let job = Command::new(bin("rlaunch"))
        .args([
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            &addr,
            "--rdzv-id",
            "topjob",
            "--no-python",
        ])
        .args(["/bin/sh", "-c", &format!("while [ ! -e {} ]; do sleep 0.1; done", go.display())])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("rlaunch starts");
    t.wait_for("job topjob: running — round 1, world size 2");
    std::fs::write(&go, b"").unwrap();
    let (code, screen) = t.finish();
    let _ = wait_deadline(job, DEADLINE);
    let _ = service.kill();
    let _ = service.wait();
    assert_eq!(code, Some(0), "top ends with the job, 0 when it finished: {screen}");
    let frames = screen.matches("\x1b[H\x1b[2J").count();
    assert!(frames >= 3, "the screen is redrawn, not scrolled: {frames} frames");
    let last = screen.rsplit("\x1b[H\x1b[2J").next().unwrap_or("");
    assert!(last.contains("job topjob: finished"), "the last frame: {last}");
}

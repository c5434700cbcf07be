//! A misbehaving worker for rlaunch's integration tests. Behaviour is chosen by arguments:
//!
//! `test_worker [--out DIR] ACTION…` where each action runs in order (every file it writes
//! whole, for a test may read it the moment it appears: `integration_tests::write_atomically`):
//! - `dump-env`: write the environment to `DIR/env_rank{RANK}_attempt{RESTART}.json`
//! - `fail-until-attempt N CODE`: exit with CODE while TORCHELASTIC_RESTART_COUNT < N
//! - `fail-rank R CODE`: exit with CODE if RANK == R
//! - `exit CODE`, `sleep SECS`, `hang` (sleep forever), `ignore-term`, `segv`
//! - `error-file MSG`: write TORCHELASTIC_ERROR_FILE in torchrun's schema, then exit 1
//! - `spam LINES`: print LINES long lines on stdout and stderr as fast as possible
//! - `print TEXT`, `eprint TEXT`
//! - `record-signals`: on SIGUSR1/SIGUSR2/SIGTERM append the name to DIR/signals_rank{RANK}.txt
//! - `spawn-grandchild`: start a `sleep 1000` child, write its pid to DIR/grandchild_rank{RANK}.pid
//! - `touch NAME`: create DIR/NAME_rank{RANK}_attempt{RESTART} (a marker that this point was reached)
//! - `pidfile`: write own pid to DIR/pid_rank{RANK}_attempt{RESTART}
//! - `store-absent KEY`: exit 42 if KEY is in the workers' store (MASTER_ADDR:MASTER_PORT)
//! - `expect-world N`: exit 43 unless WORLD_SIZE is N
//! - `stale-writer-on-attempt0 KEY SECS`: on attempt 0 only, wait for SIGTERM, then keep
//!   setting KEY in this round's store for SECS seconds (a worker slow to stop), and exit 0

use std::io::Write;
use std::path::PathBuf;

use integration_tests::write_atomically;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    LAST_SIGNAL.store(sig, Ordering::SeqCst);
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut out = PathBuf::from(".");
    if args.first().map(String::as_str) == Some("--out") {
        out = PathBuf::from(args.get(1).expect("--out DIR"));
        args.drain(..2);
    }
    let rank = var("RANK");
    let attempt = var("TORCHELASTIC_RESTART_COUNT");
    let mut it = args.into_iter();
    let mut record_signals = false;
    while let Some(action) = it.next() {
        let mut next = || it.next().unwrap_or_else(|| panic!("{action} needs an argument"));
        match action.as_str() {
            "dump-env" => {
                let env: serde_json::Map<String, serde_json::Value> =
                    std::env::vars().map(|(k, v)| (k, serde_json::Value::String(v))).collect();
                let path = out.join(format!("env_rank{rank}_attempt{attempt}.json"));
                write_atomically(&path, serde_json::to_vec(&env).unwrap()).unwrap();
            }
            "fail-until-attempt" => {
                let n: u32 = next().parse().unwrap();
                let code: i32 = next().parse().unwrap();
                if attempt.parse::<u32>().unwrap_or(0) < n {
                    eprintln!("failing on attempt {attempt}");
                    std::process::exit(code);
                }
            }
            "fail-rank" => {
                let r = next();
                let code: i32 = next().parse().unwrap();
                if r == rank {
                    eprintln!("rank {rank} failing with {code}");
                    std::process::exit(code);
                }
            }
            "exit" => std::process::exit(next().parse().unwrap()),
            "sleep" => std::thread::sleep(Duration::from_secs_f64(next().parse().unwrap())),
            "hang" => loop {
                std::thread::sleep(Duration::from_millis(20));
                if record_signals {
                    flush_signal(&out, &rank);
                }
            },
            "store-absent" => {
                let key = next();
                let addr = format!("{}:{}", var("MASTER_ADDR"), var("MASTER_PORT"));
                let mut c = rlaunch::store::StoreClient::connect(&addr, Duration::from_secs(10)).expect("store");
                if c.check(&[key.as_str()]).expect("check") {
                    eprintln!("key {key} from an earlier round is in this round's store");
                    std::process::exit(42);
                }
            }
            "expect-world" => {
                let n = next();
                if var("WORLD_SIZE") != n {
                    eprintln!("WORLD_SIZE is {} and not {n}", var("WORLD_SIZE"));
                    std::process::exit(43);
                }
            }
            "stale-writer-on-attempt0" => {
                let (key, secs) = (next(), next().parse::<f64>().unwrap());
                if attempt == "0" {
                    // SAFETY: `on_signal` only stores to an atomic, which is async-signal-safe.
                    unsafe { libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t) };
                    while LAST_SIGNAL.load(Ordering::SeqCst) != libc::SIGTERM {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    let addr = format!("{}:{}", var("MASTER_ADDR"), var("MASTER_PORT"));
                    let until = std::time::Instant::now() + Duration::from_secs_f64(secs);
                    let mut written = 0;
                    while std::time::Instant::now() < until {
                        if let Ok(mut c) = rlaunch::store::StoreClient::connect(&addr, Duration::from_millis(200)) {
                            if c.set(&key, b"stale").is_ok() {
                                written += 1;
                            }
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    eprintln!("stale writer: {written} writes to {addr}");
                    std::process::exit(0);
                }
            }
            "ignore-term" => {
                // SAFETY: installing SIG_IGN has no preconditions.
                unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
            }
            "segv" => {
                // SAFETY: restoring the default action (Rust's runtime installs a SIGSEGV handler)
                // and raising the signal at ourselves is the point of this action.
                unsafe {
                    libc::signal(libc::SIGSEGV, libc::SIG_DFL);
                    libc::raise(libc::SIGSEGV);
                }
            }
            "error-file" => {
                let msg = next();
                let path = var("TORCHELASTIC_ERROR_FILE");
                let data = serde_json::json!({"message": {"message": msg, "extraInfo": {
                    "py_callstack": "Traceback (most recent call last):\n  File \"worker.py\", line 7, in <module>\nValueError: planted", "timestamp": "1700000000"}}});
                std::fs::write(path, data.to_string()).unwrap();
                std::process::exit(1);
            }
            "spam" => {
                let lines: usize = next().parse().unwrap();
                let body = format!("rank{rank}-").repeat(50);
                let mut o = std::io::stdout();
                let mut e = std::io::stderr();
                for i in 0..lines {
                    // Write each line in two pieces to tempt interleaving.
                    let _ = o.write_all(format!("OUT {i} {body}").as_bytes());
                    let _ = o.flush();
                    let _ = o.write_all(b" END\n");
                    let _ = o.flush();
                    let _ = e.write_all(format!("ERR {i} {body} END\n").as_bytes());
                }
            }
            "print" => println!("{}", next()),
            "eprint" => eprintln!("{}", next()),
            "record-signals" => {
                record_signals = true;
                for s in [libc::SIGUSR1, libc::SIGUSR2, libc::SIGTERM] {
                    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
                    unsafe { libc::signal(s, on_signal as *const () as libc::sighandler_t) };
                }
            }
            "spawn-grandchild" => {
                let child = std::process::Command::new("sleep").arg("1000").spawn().unwrap();
                write_atomically(&out.join(format!("grandchild_rank{rank}.pid")), child.id().to_string()).unwrap();
                std::mem::forget(child);
            }
            "touch" => {
                let name = next();
                write_atomically(&out.join(format!("{name}_rank{rank}_attempt{attempt}")), b"").unwrap();
            }
            "pidfile" => {
                write_atomically(&out.join(format!("pid_rank{rank}_attempt{attempt}")), std::process::id().to_string())
                    .unwrap();
            }
            other => panic!("unknown action {other}"),
        }
    }
}

fn flush_signal(out: &std::path::Path, rank: &str) {
    let s = LAST_SIGNAL.swap(0, Ordering::SeqCst);
    if s == 0 {
        return;
    }
    let name = match s {
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGTERM => "SIGTERM",
        _ => "other",
    };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out.join(format!("signals_rank{rank}.txt")))
        .unwrap();
    writeln!(f, "{name}").unwrap();
    if s == libc::SIGTERM {
        std::process::exit(0);
    }
}

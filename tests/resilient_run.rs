//! `rlaunch::resilient::run` against a scripted agent on a real control socket (its own
//! process: the abort it triggers is process-wide). The protocol is `agent/src/control.rs`'s.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

fn line(r: &mut impl BufRead) -> serde_json::Value {
    let mut s = String::new();
    r.read_line(&mut s).expect("a line from the worker");
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

/// A round ends while the function runs; the next round ends again right behind its resume:
/// the function is not run for that round, or its run finds its saves closed and its
/// collectives ended at once (never a round run on after its end); it then runs with the third
/// round's environment. A program's own error, with no word of
/// a round's end and no failed collective, is returned at once.
#[test]
fn an_end_heard_right_after_a_resume_parks_again_without_running_and_a_program_s_error_is_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("control.sock");
    let listener = UnixListener::bind(&path).unwrap();
    std::env::set_var("RLAUNCH_CONTROL", &path);
    std::env::set_var("LOCAL_RANK", "0");
    let (entered_tx, entered_rx) = mpsc::channel::<u32>();
    let agent = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut r = BufReader::new(conn.try_clone().unwrap());
        let mut w = conn;
        let mut send = |v: serde_json::Value| w.write_all(format!("{v}\n").as_bytes()).unwrap();
        assert_eq!(line(&mut r)["hello"]["local_rank"], 0);
        send(serde_json::json!({"welcome": {}}));
        assert_eq!(entered_rx.recv_timeout(Duration::from_secs(30)).unwrap(), 1);
        send(serde_json::json!({"end": {"round": 1, "hosts": ["127.0.0.1"]}}));
        assert_eq!(line(&mut r)["parked"]["round"], 1);
        // The resume and, at once, the next round's end.
        send(serde_json::json!({"resume": {"round": 2, "env": {"RLAUNCH_TEST_ROUND": "2"}}}));
        send(serde_json::json!({"end": {"round": 2, "hosts": ["127.0.0.1"]}}));
        assert_eq!(line(&mut r)["parked"]["round"], 2);
        send(serde_json::json!({"resume": {"round": 3, "env": {"RLAUNCH_TEST_ROUND": "3"}}}));
        r // kept open until the test ends
    });
    let runs = AtomicU32::new(0);
    let got = rlaunch::resilient::run(|| -> Result<u32, String> {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            assert!(!rlaunch::resilient::saves_closed());
            entered_tx.send(1).unwrap();
            // Working until the word comes (a collective would fail then).
            let t = std::time::Instant::now();
            while !(rlaunch::resilient::saves_closed() && rlaunch::comm::aborted()) {
                assert!(
                    t.elapsed() < Duration::from_secs(30),
                    "no word of the round's end (saves closed, collectives ended)"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            return Err("a collective failed".into());
        }
        let round: u32 = std::env::var("RLAUNCH_TEST_ROUND").unwrap().parse().unwrap();
        if round == 2 {
            // The end came right behind the resume: either it was heard before this run began
            // (no run), or this run finds its saves closed and its collectives ended at once.
            let t = std::time::Instant::now();
            while !(rlaunch::resilient::saves_closed() && rlaunch::comm::aborted()) {
                assert!(t.elapsed() < Duration::from_secs(5), "round 2 ran on after its end");
                std::thread::sleep(Duration::from_millis(1));
            }
            return Err("a collective failed".into());
        }
        assert!(!rlaunch::resilient::saves_closed(), "saves open again in a round that runs");
        assert!(!rlaunch::comm::aborted(), "collectives open again in a round that runs");
        Ok(round)
    });
    assert_eq!(got, Ok(3), "the function ran with the third round's environment");
    assert!(runs.load(Ordering::SeqCst) <= 3);
    let _kept = agent.join().unwrap();
    // The program's own error: returned at once.
    let t = std::time::Instant::now();
    let mine = rlaunch::resilient::run(|| -> Result<(), String> { Err("mine".into()) });
    assert_eq!(mine, Err("mine".to_string()));
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

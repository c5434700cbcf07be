//! Collectives across real processes (one per rank, bootstrapped through a file store):
//! results against a straightforward reference, mismatches, and dead or hung peers.

mod common;

use std::time::{Duration, Instant};

use common::reference::reference_worker;
use common::{fresh_seed, require_worker_env, self_args, self_exe, spawn, wait, wait_for, WORKER};
use rlaunch::comm::ReduceOp;

const SCENARIO: &str = "RLAUNCH_TEST_SCENARIO";
use common::reference::SEED;

/// The worker side: runs the scenario named in the environment (ignored in a normal test run).
#[test]
#[ignore = "worker entry point: this file's tests run it in child processes (--ignored --exact)"]
fn worker_entry() {
    require_worker_env();
    let scenario = std::env::var(SCENARIO).expect("scenario set by the parent");
    let mut pg = match rlaunch::worker::init_from_env() {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("init failed: {e:?}");
            std::process::exit(2);
        }
    };
    eprintln!("rank {} backend {}", pg.rank(), pg.backend_name());
    let me = pg.rank();
    let w = pg.world_size();
    let res: Result<(), String> = match scenario.as_str() {
        "reference" => {
            let seed = std::env::var(SEED).ok().and_then(|v| v.parse().ok()).expect("seed");
            reference_worker(&mut pg, seed)
        }
        "mismatch" => {
            let mut buf = vec![1f32; if me == 0 { 100 } else { 200 }];
            pg.all_reduce(&mut buf, ReduceOp::Sum).map_err(|e| e.to_string())
        }
        "dtype_mismatch" => {
            if me == 0 {
                let mut b = vec![1f64; 64];
                pg.all_reduce(&mut b, ReduceOp::Sum).map_err(|e| e.to_string())
            } else {
                let mut b = vec![1f32; 64];
                pg.all_reduce(&mut b, ReduceOp::Sum).map_err(|e| e.to_string())
            }
        }
        "die" | "hang" => {
            let mut buf = vec![1f32; 1 << 16];
            pg.all_reduce(&mut buf, ReduceOp::Sum).map_err(|e| e.to_string()).and_then(|_| {
                if me == w - 1 {
                    if scenario == "die" {
                        // SAFETY: not needed: abort is safe; the peer vanishes without cleanup.
                        std::process::abort();
                    }
                    std::thread::sleep(Duration::from_secs(600));
                }
                let t = Instant::now();
                let r = pg.all_reduce(&mut buf, ReduceOp::Sum).map_err(|e| e.to_string());
                eprintln!("second all_reduce returned after {:?}", t.elapsed());
                if r.is_err() {
                    // The group is now unusable: later calls fail at once, not after a timeout.
                    let t = Instant::now();
                    match pg.barrier() {
                        Err(e)
                            if t.elapsed() < Duration::from_millis(100) && e.to_string().contains("failed earlier") => {
                        }
                        other => {
                            return Err(format!(
                                "a failed group must refuse further collectives at once, got {other:?} after {:?}",
                                t.elapsed()
                            ))
                        }
                    }
                }
                r
            })
        }
        "quick" => {
            let mut v = vec![me as i64; 3];
            pg.all_reduce(&mut v, ReduceOp::Sum).map_err(|e| e.to_string()).and_then(|_| {
                let want = (w * (w - 1) / 2) as i64;
                if v != vec![want; 3] {
                    return Err(format!("sum of ranks {v:?} != {want}"));
                }
                pg.barrier().map_err(|e| e.to_string())
            })
        }
        "abort" => {
            // Every rank but the last waits in an all_reduce that the last never joins (a silent
            // peer); another thread of the process aborts its collectives 0.3 s in. Then every
            // rank makes a new group in the same process, and it works.
            let old = if me + 1 < w {
                let t = Instant::now();
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    rlaunch::comm::abort_all();
                });
                let mut buf = vec![1f32; 1 << 16];
                match pg.all_reduce(&mut buf, ReduceOp::Sum) {
                    Err(e @ rlaunch::comm::CommError::Aborted { .. }) if t.elapsed() < Duration::from_secs(5) => {
                        eprintln!("aborted after {:?}: {e}", t.elapsed());
                        match pg.barrier() {
                            Err(_) => Ok(()),
                            Ok(()) => Err("the aborted group still ran a barrier".to_string()),
                        }
                    }
                    other => Err(format!("the abort did not end the all_reduce: {other:?} after {:?}", t.elapsed())),
                }
            } else {
                std::thread::sleep(Duration::from_millis(1500));
                Ok(())
            };
            old.and_then(|()| {
                // As rlaunch::resilient does when the next round begins.
                rlaunch::comm::clear_abort();
                let mut pg = rlaunch::worker::init_from_env().map_err(|e| format!("a new group: {e}"))?;
                let mut v = vec![1i64; 3];
                pg.all_reduce(&mut v, ReduceOp::Sum).map_err(|e| e.to_string())?;
                if v != vec![w as i64; 3] {
                    return Err(format!("the new group summed {v:?}"));
                }
                eprintln!("new group ok");
                Ok(())
            })
        }
        other => Err(format!("unknown scenario {other}")),
    };
    match res {
        Ok(()) => {
            eprintln!("rank {me} OK");
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("rank {me} ERROR: {e}");
            std::process::exit(1)
        }
    }
}

fn run(hosts: &[usize], scenario: &str, extra: &[(&str, String)], timeout: Duration) -> common::Finished {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut env: Vec<(String, String)> = vec![(WORKER.into(), "1".into()), (SCENARIO.into(), scenario.into())];
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let s = spawn(&self_exe(), &self_args("worker_entry"), hosts, dir.path(), &env);
    wait(s, timeout)
}

fn assert_reference(hosts: &[usize], backend: &str, big: usize) {
    let seed = fresh_seed();
    let f = run(
        hosts,
        "reference",
        &[(SEED, seed.to_string()), ("RLAUNCH_BACKEND", backend.into()), ("RLAUNCH_TEST_BIG", big.to_string())],
        Duration::from_secs(240),
    );
    assert!(f.all_ok(), "backend {backend} hosts {hosts:?} seed {seed}:\n{}", f.dump());
    for l in &f.logs {
        assert!(l.contains(&format!("backend {}", backend_name(backend))), "{l}");
    }
}

fn backend_name(b: &str) -> &str {
    if b == "hier" {
        "hierarchical"
    } else {
        b
    }
}

#[test]
fn shm_collectives_match_reference_for_world_sizes_1_to_4() {
    for w in 1..=4 {
        assert_reference(&vec![0; w], "shm", if w == 2 { 6 << 20 } else { 0 });
    }
}

#[test]
fn tcp_ring_collectives_match_reference_for_world_sizes_2_to_4() {
    for w in 2..=4 {
        assert_reference(&vec![0; w], "tcp", if w == 3 { 6 << 20 } else { 0 });
    }
}

#[test]
fn hierarchical_collectives_match_reference_on_two_hosts_of_two_ranks() {
    assert_reference(&[0, 0, 1, 1], "hier", 0);
    assert_reference(&[0, 0, 0, 1], "hier", 0);
}

fn assert_all_fail_mentioning(f: &common::Finished, needle: &str) {
    assert!(f.codes.iter().all(|c| *c == Some(1)), "every rank must fail cleanly:\n{}", f.dump());
    assert!(f.logs.iter().any(|l| l.contains(needle)), "no rank reported {needle:?}:\n{}", f.dump());
}

#[test]
fn mismatched_sizes_are_reported_on_shm_and_tcp() {
    for backend in ["shm", "tcp"] {
        let f = run(
            &[0, 0, 0],
            "mismatch",
            &[("RLAUNCH_BACKEND", backend.into()), ("RLAUNCH_COLLECTIVE_TIMEOUT", "3".into())],
            Duration::from_secs(20),
        );
        assert_all_fail_mentioning(&f, "collective mismatch");
        assert!(f.logs.iter().any(|l| l.contains("all_reduce of 100 f32")), "{}", f.dump());
    }
}

#[test]
fn mismatched_dtypes_are_reported() {
    let f = run(&[0, 0], "dtype_mismatch", &[("RLAUNCH_COLLECTIVE_TIMEOUT", "3".into())], Duration::from_secs(20));
    assert_all_fail_mentioning(&f, "f64");
}

fn assert_peer_failure_detected(backend: &str, scenario: &str, timeout_s: u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let env: Vec<(String, String)> = vec![
        (WORKER.into(), "1".into()),
        (SCENARIO.into(), scenario.into()),
        ("RLAUNCH_BACKEND".into(), backend.into()),
        ("RLAUNCH_COLLECTIVE_TIMEOUT".into(), timeout_s.to_string()),
    ];
    let t = Instant::now();
    let s = spawn(&self_exe(), &self_args("worker_entry"), &[0, 0, 0], dir.path(), &env);
    let f = wait_for(s, &[0, 1], Duration::from_secs(timeout_s + 30));
    let took = t.elapsed();
    for r in 0..2 {
        assert_eq!(f.codes[r], Some(1), "survivor {r} must fail, not hang:\n{}", f.dump());
        let err = f.logs[r].lines().find(|l| l.contains("ERROR")).unwrap_or_default();
        assert!((0..3).any(|q| q != r && err.contains(&format!("rank {q} "))), "error must name a peer:\n{}", f.dump());
    }
    let errs: Vec<&str> = f.logs.iter().flat_map(|l| l.lines().filter(|l| l.contains("ERROR"))).collect();
    assert!(errs.iter().any(|l| l.contains("rank 2 ")), "the failed rank is named:\n{}", f.dump());
    assert!(took < Duration::from_secs(timeout_s + 15), "took {took:?}");
}

#[test]
fn peer_killed_in_collective_fails_survivors_quickly_on_shm() {
    assert_peer_failure_detected("shm", "die", 30);
}

#[test]
fn peer_killed_in_collective_fails_survivors_on_tcp() {
    assert_peer_failure_detected("tcp", "die", 30);
}

#[test]
fn hung_peer_times_out_naming_it_on_shm_and_tcp() {
    assert_peer_failure_detected("shm", "hang", 2);
    assert_peer_failure_detected("tcp", "hang", 2);
}

#[test]
fn bootstraps_through_the_agents_tcp_store() {
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let server = rt
        .block_on(rlaunch::store::StoreServer::start("127.0.0.1:0".parse().expect("literal")))
        .expect("start the TCPStore server");
    let port = server.local_addr().port();
    for backend in ["shm", "tcp"] {
        let f = run(
            &[0, 0, 0],
            "quick",
            &[
                ("RLAUNCH_FILE_STORE", String::new()),
                ("MASTER_PORT", port.to_string()),
                ("RLAUNCH_BACKEND", backend.into()),
                // One store, two jobs: keys are namespaced by run id (and restart count).
                ("TORCHELASTIC_RUN_ID", format!("tcpstore-{backend}")),
            ],
            Duration::from_secs(60),
        );
        assert!(f.all_ok(), "{backend}:\n{}", f.dump());
    }
    assert!(server.num_keys() > 0, "the workers' keys went to the TCPStore");
    rt.block_on(server.shutdown()).expect("store shutdown");
}

/// `rlaunch::comm::abort_all` (what a survivor does when its round ends elsewhere) ends a
/// collective waiting on a peer that never answers within milliseconds, not at its 60 s
/// timeout; the aborted group refuses further collectives; a new group made in the same process
/// works with the peer.
#[test]
fn an_abort_ends_a_collective_waiting_on_a_silent_peer_and_a_new_group_works_in_the_same_process() {
    for backend in ["shm", "tcp"] {
        let f = run(&[0, 0, 0], "abort", &[("RLAUNCH_BACKEND", backend.into())], Duration::from_secs(60));
        assert!(f.all_ok(), "backend {backend}:\n{}", f.dump());
        let aborted = f.logs.iter().filter(|l| l.contains("aborted after")).count();
        assert_eq!(aborted, 2, "backend {backend}: the two waiting ranks were aborted:\n{}", f.dump());
        assert!(f.logs.iter().all(|l| l.contains("new group ok")), "backend {backend}:\n{}", f.dump());
    }
}

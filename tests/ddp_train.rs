//! End-to-end data-parallel training with the `train` example, in real processes: equivalence
//! with single-process large-batch training, and resumption after a worker is killed (mid-run
//! or in the middle of a checkpoint write) ending at exactly the undisturbed model.
//!
//! The restart is done here the way the agent does it: when a worker dies the survivors fail
//! their collective (within the collective timeout), every worker of the attempt is stopped,
//! and all are started again with `TORCHELASTIC_RESTART_COUNT` incremented.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{example, spawn, wait, Finished, Spawned};

/// A small, quick configuration (the tests run the example in the test profile).
fn base_args(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--samples",
        "2048",
        "--dim",
        "16",
        "--hidden",
        "32",
        "--classes",
        "4",
        "--epochs",
        "3",
        "--log-every",
        "8",
        "--lr",
        "0.05",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn read_params(p: &Path) -> Vec<f32> {
    let b = std::fs::read(p).unwrap_or_else(|e| panic!("final params {}: {e}", p.display()));
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn run_train(world: usize, args: &[String], dir: &Path, restart: u32) -> Finished {
    let env = vec![
        ("TORCHELASTIC_RESTART_COUNT".to_string(), restart.to_string()),
        ("RLAUNCH_COLLECTIVE_TIMEOUT".to_string(), "10".to_string()),
    ];
    let s = spawn(&example("train"), args, &vec![0; world], dir, &env);
    wait(s, Duration::from_secs(300))
}

#[test]
fn data_parallel_matches_single_process_with_the_global_batch() {
    let dir = tempfile::tempdir().expect("tempdir");
    for w in [2usize, 4] {
        let b = 16;
        let out_w = dir.path().join(format!("w{w}.bin"));
        let out_1 = dir.path().join(format!("single{w}.bin"));
        let f = run_train(
            w,
            &base_args(&[
                "--batch-size",
                &b.to_string(),
                "--steps",
                "40",
                "--no-checkpoint",
                "--save-final",
                out_w.to_str().expect("utf8"),
            ]),
            &dir.path().join(format!("a{w}")),
            0,
        );
        assert!(f.all_ok(), "{}", f.dump());
        let f = run_train(
            1,
            &base_args(&[
                "--batch-size",
                &(b * w).to_string(),
                "--steps",
                "40",
                "--no-checkpoint",
                "--save-final",
                out_1.to_str().expect("utf8"),
            ]),
            &dir.path().join(format!("b{w}")),
            0,
        );
        assert!(f.all_ok(), "{}", f.dump());
        let (pw, p1) = (read_params(&out_w), read_params(&out_1));
        assert_eq!(pw.len(), p1.len());
        let max_diff = pw.iter().zip(&p1).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("world {w}: max |param difference| after 40 steps = {max_diff:e}");
        // Only the summation order differs (per-rank means averaged vs one mean): f32 rounding.
        assert!(max_diff < 1e-5, "world {w}: max difference {max_diff}");
    }
}

fn undisturbed(dir: &Path, args: &[String]) -> Vec<f32> {
    let out = dir.join("undisturbed.bin");
    let mut a = args.to_vec();
    a.extend([
        "--checkpoint-dir".into(),
        dir.join("ck-undisturbed").to_string_lossy().to_string(),
        "--save-final".into(),
        out.to_string_lossy().to_string(),
    ]);
    let f = run_train(4, &a, &dir.join("u"), 0);
    assert!(f.all_ok(), "{}", f.dump());
    read_params(&out)
}

/// Waits until a checkpoint of at least `step` exists in `ck`.
fn wait_for_checkpoint(ck: &Path, step: u64, s: &mut Spawned) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let newest = std::fs::read_dir(ck)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .strip_prefix("ckpt-")
                            .and_then(|s| s.strip_suffix(".bin"))
                            .and_then(|s| s.parse::<u64>().ok())
                    })
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0);
        if newest >= step {
            return;
        }
        if s.children.iter_mut().any(|c| matches!(c.try_wait(), Ok(Some(_)))) {
            panic!("a worker exited before checkpoint {step} appeared");
        }
        assert!(Instant::now() < deadline, "no checkpoint {step} within the deadline");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigkilled_worker_restart_resumes_from_checkpoint_and_ends_at_the_undisturbed_model() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = base_args(&["--batch-size", "16", "--checkpoint-every", "10"]);
    let want = undisturbed(dir.path(), &args);

    let ck = dir.path().join("ck");
    let out = dir.path().join("disturbed.bin");
    let mut a = args.clone();
    a.extend([
        "--checkpoint-dir".into(),
        ck.to_string_lossy().to_string(),
        "--save-final".into(),
        out.to_string_lossy().to_string(),
    ]);
    let env = vec![
        ("TORCHELASTIC_RESTART_COUNT".to_string(), "0".to_string()),
        ("RLAUNCH_COLLECTIVE_TIMEOUT".to_string(), "10".to_string()),
    ];
    let mut s = spawn(&example("train"), &a, &[0, 0, 0, 0], &dir.path().join("attempt0"), &env);
    wait_for_checkpoint(&ck, 20, &mut s);
    let killed_at = Instant::now();
    // SAFETY: not needed; Child::kill sends SIGKILL.
    s.children[2].kill().expect("SIGKILL rank 2");
    let f = wait(s, Duration::from_secs(30));
    let took = killed_at.elapsed();
    eprintln!("survivors stopped {took:?} after the kill");
    for r in [0, 1, 3] {
        if f.codes[r] == Some(0) {
            // A survivor may legitimately have finished if the kill came at the very end.
            continue;
        }
        assert_eq!(f.codes[r], Some(1), "survivor {r} must fail cleanly:\n{}", f.dump());
        assert!(f.logs[r].contains("rank"), "{}", f.dump());
    }
    assert!(took < Duration::from_secs(15), "survivors must fail within the collective timeout");

    // The agent's restart: everyone again, restart count 1.
    let f = run_train(4, &a, &dir.path().join("attempt1"), 1);
    assert!(f.all_ok(), "{}", f.dump());
    assert!(f.logs[0].contains("resumed at step"), "{}", f.logs[0]);
    assert_eq!(read_params(&out), want, "resumed run must end at the undisturbed model, bit for bit");
}

#[test]
fn kill_during_checkpoint_write_resumes_from_the_previous_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let args = base_args(&["--batch-size", "16", "--checkpoint-every", "10"]);
    let want = undisturbed(dir.path(), &args);

    let ck = dir.path().join("ck");
    let out = dir.path().join("disturbed.bin");
    let mut a = args.clone();
    a.extend([
        "--checkpoint-dir".into(),
        ck.to_string_lossy().to_string(),
        "--save-final".into(),
        out.to_string_lossy().to_string(),
        "--fault-checkpoint-step".into(),
        "30".into(),
    ]);
    let f = run_train(4, &a, &dir.path().join("attempt0"), 0);
    assert_ne!(f.codes[0], Some(0), "rank 0 dies writing checkpoint 30:\n{}", f.dump());
    assert!(f.codes.iter().all(|c| *c != Some(0)), "every rank of the attempt fails:\n{}", f.dump());
    let leftovers: Vec<String> = std::fs::read_dir(&ck)
        .expect("ck dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    assert!(
        leftovers.iter().any(|n| n.starts_with(".tmp-ckpt-30")),
        "the interrupted write left its temporary file: {leftovers:?}"
    );
    assert!(!leftovers.iter().any(|n| n == "ckpt-000000000030.bin"), "{leftovers:?}");

    let f = run_train(4, &a, &dir.path().join("attempt1"), 1);
    assert!(f.all_ok(), "{}", f.dump());
    assert!(f.logs[0].contains("resumed at step 20"), "{}", f.logs[0]);
    assert_eq!(read_params(&out), want, "resumed run must end at the undisturbed model, bit for bit");
}

//! The `train` example under the real launcher: `rlaunch --standalone --nproc-per-node 4
//! train` trains (loss goes down), and a worker SIGKILLed mid-run or dying in the middle of a
//! checkpoint write makes rlaunch restart the group, which resumes from the latest complete
//! checkpoint and ends at exactly the model of an undisturbed run.

use std::path::Path;
use std::time::Duration;

use integration_tests::{bin, rlaunch, run_deadline, tempdir};

fn train_args(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--samples",
        "4096",
        "--dim",
        "16",
        "--hidden",
        "64",
        "--classes",
        "4",
        "--epochs",
        "3",
        "--batch-size",
        "16",
        "--log-every",
        "8",
        "--checkpoint-every",
        "10",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn run(dir: &Path, name: &str, extra: &[&str], rlaunch_flags: &[&str]) -> (std::process::Output, Vec<u8>) {
    let ck = dir.join(format!("ck-{name}"));
    let out = dir.join(format!("{name}.bin"));
    let mut args = train_args(extra);
    args.extend([
        "--checkpoint-dir".into(),
        ck.display().to_string(),
        "--save-final".into(),
        out.display().to_string(),
    ]);
    let train = bin("examples/train");
    let mut cmd = rlaunch();
    cmd.args(["--standalone", "--nproc-per-node", "4"])
        .args(rlaunch_flags)
        .arg(&train)
        .args(&args)
        .env("RLAUNCH_COLLECTIVE_TIMEOUT", "10");
    let o = run_deadline(&mut cmd, Duration::from_secs(300));
    let params = std::fs::read(&out).unwrap_or_default();
    (o, params)
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn losses(s: &str) -> Vec<f64> {
    s.lines()
        .filter_map(|l| l.split(" loss ").nth(1))
        .filter_map(|r| r.split_whitespace().next())
        .filter_map(|v| v.parse().ok())
        .collect()
}

#[test]
fn train_under_rlaunch_with_four_workers_reduces_the_loss() {
    let d = tempdir();
    let (o, params) = run(d.path(), "plain", &[], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let l = losses(&t);
    assert!(l.len() >= 3, "{t}");
    assert!(l.last().expect("losses") < &(l[0] * 0.7), "loss must go down: {l:?}");
    assert!(!params.is_empty());
}

#[test]
fn sigkilled_worker_is_restarted_by_rlaunch_and_the_run_ends_at_the_undisturbed_model() {
    let d = tempdir();
    let (o, want) = run(d.path(), "undisturbed", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let (o, got) = run(d.path(), "killed", &["--fault-kill-step", "25", "--fault-rank", "2"], &["--max-restarts", "2"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("SIGKILLs itself at step 25"), "{t}");
    assert!(t.contains("resumed at step 20"), "{t}");
    assert_eq!(got, want, "final parameters differ from the undisturbed run");
}

#[test]
fn death_during_a_checkpoint_write_resumes_from_the_previous_checkpoint_under_rlaunch() {
    let d = tempdir();
    let (o, want) = run(d.path(), "undisturbed", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let (o, got) = run(d.path(), "ckptkill", &["--fault-checkpoint-step", "30"], &["--max-restarts", "2"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("dying while writing"), "{t}");
    assert!(t.contains("resumed at step 20"), "{t}");
    assert_eq!(got, want, "final parameters differ from the undisturbed run");
}

//! Survivors that keep their process (issue 37), the part that ends a collective: a gloo
//! all_reduce waiting on a frozen peer (stopped, its connections open, as after a link cut: no
//! reset ever comes) is ended from another thread of the same process by shutting down its
//! connections (`rlaunch.interrupt`), and the process then makes a new process group and
//! reduces again.

use std::process::Command;
use std::time::Duration;

use integration_tests::{repo_root, run_deadline, stderr_of, stdout_of, venv_python};

#[test]
fn a_gloo_collective_waiting_on_a_frozen_peer_ends_at_the_interrupt_and_a_new_group_works_in_the_same_process() {
    let script = repo_root().join("integration-tests/py/interrupt_gloo.py");
    let o = run_deadline(
        Command::new(venv_python()).arg(&script).env("PYTHONPATH", repo_root().join("python")),
        Duration::from_secs(120),
    );
    let out = stdout_of(&o);
    assert!(o.status.success(), "{out}\n{}", stderr_of(&o));
    let value = |key: &str| -> f64 {
        let line = out.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("no {key} in {out}"));
        line.trim().parse().unwrap()
    };
    assert!(value("shut_down=") >= 1.0, "{out}");
    // The collective's own timeout is 60 s: it ended because of the interrupt, not by itself.
    assert!(value("ended_after=") < 5.0, "{out}");
    assert!(out.contains("raised: ") && out.contains("new_group_ok"), "{out}");
}

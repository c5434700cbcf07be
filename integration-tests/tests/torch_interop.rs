//! Unmodified PyTorch scripts under `rlaunch --standalone --nproc-per-node 4`, exactly as under
//! torchrun: gloo collectives through env:// against the agent's store, DDP training, `@record`
//! error files in the root-cause report, restarts that re-initialise the process group, and the
//! same worker environment as torchrun's.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use integration_tests::*;

const DEADLINE: Duration = Duration::from_secs(180);

fn script(name: &str) -> PathBuf {
    repo_root().join("integration-tests/py").join(name)
}

fn rlaunch_py(args: &[&str], script_name: &str) -> std::process::Output {
    let python = venv_python();
    let mut cmd = rlaunch();
    cmd.env("RLAUNCH_PYTHON", &python).args(args).arg(script(script_name));
    run_deadline(&mut cmd, DEADLINE)
}

#[test]
fn gloo_collectives_through_env_init_against_the_agent_store() {
    let o = rlaunch_py(&["--standalone", "--nproc-per-node", "4"], "collectives.py");
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    let out = stdout_of(&o);
    for r in 0..4 {
        assert!(out.contains(&format!("[default{r}]:collectives ok rank={r} world=4")), "{out}");
    }
}

#[test]
fn ddp_training_converges_with_identical_parameters_on_every_rank() {
    let o = rlaunch_py(&["--standalone", "--nproc-per-node", "4"], "ddp_train.py");
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    assert_eq!(stdout_of(&o).matches("ddp ok rank=").count(), 4, "{}", stdout_of(&o));
}

#[test]
fn record_decorated_exception_shows_message_and_traceback_in_the_report() {
    let o = rlaunch_py(&["--standalone", "--nproc-per-node", "4", "--shutdown-timeout", "2"], "record_raise.py");
    assert_eq!(o.status.code(), Some(1), "{}", stderr_of(&o));
    let err = stderr_of(&o);
    assert!(err.contains("rank        : 1 (local_rank: 1)"), "{err}");
    assert!(err.contains("message     : ValueError: planted failure on rank 1"), "{err}");
    assert!(err.contains("in helper"), "traceback names the raising function: {err}");
    assert!(err.contains("error_file  : "), "{err}");
}

#[test]
fn a_crash_on_the_first_attempt_restarts_and_reinitialises_the_process_group() {
    let o = rlaunch_py(
        &["--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "--shutdown-timeout", "3"],
        "crash_first_attempt.py",
    );
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    let out = stdout_of(&o);
    assert!(out.contains("[default1]:crashing on purpose"), "{out}");
    for r in 0..4 {
        assert!(out.contains(&format!("[default{r}]:finished rank={r} attempt=1")), "{out}");
    }
}

fn dump_env(launcher: &mut std::process::Command, dir: &Path) -> Vec<BTreeMap<String, String>> {
    launcher.env_clear().env("PATH", "/usr/bin:/bin").env("HOME", "/tmp").env("ENV_DUMP_DIR", dir);
    let o = run_deadline(launcher, DEADLINE);
    assert!(o.status.success(), "{}", stderr_of(&o));
    (0..4)
        .map(|r| serde_json::from_str(&std::fs::read_to_string(dir.join(format!("rank{r}.json"))).unwrap()).unwrap())
        .collect()
}

#[test]
fn workers_see_the_same_environment_as_under_torchrun() {
    let python = venv_python();
    let torchrun = python.parent().unwrap().join("torchrun");
    let (td, rd) = (tempdir(), tempdir());
    let mut t = std::process::Command::new(&torchrun);
    t.args(["--standalone", "--nproc-per-node", "4", "--max-restarts", "2"]).arg(script("env_dump.py"));
    let torch_env = dump_env(&mut t, td.path());
    let mut r = std::process::Command::new(bin("rlaunch"));
    r.args(["--standalone", "--nproc-per-node", "4", "--max-restarts", "2"]).arg(script("env_dump.py"));
    r.env("RLAUNCH_PYTHON", &python);
    let ours = dump_env(&mut r, rd.path());
    // LC_CTYPE is set by the Python interpreter itself (C locale coercion), not by a launcher.
    // rlaunch adds two, documented in docs/src/worker-environment.md: its snapshot socket, and its Python package
    // after whatever PYTHONPATH held.
    let ours_only = ["LC_CTYPE", "RLAUNCH_PYTHON", "RLAUNCH_SNAPSHOT", "PYTHONPATH"];
    let keys = |e: &BTreeMap<String, String>| -> BTreeSet<String> {
        e.keys().filter(|k| !ours_only.contains(&k.as_str())).cloned().collect()
    };
    for rank in 0..4 {
        assert_eq!(keys(&ours[rank]), keys(&torch_env[rank]), "rank {rank}: the same variables");
        assert!(ours[rank]["RLAUNCH_SNAPSHOT"].ends_with("/agent.sock"), "{:?}", ours[rank].get("RLAUNCH_SNAPSHOT"));
        let path = &ours[rank]["PYTHONPATH"];
        let added = match torch_env[rank].get("PYTHONPATH") {
            Some(before) => path.strip_prefix(&format!("{before}:")),
            None => Some(path.as_str()),
        };
        assert!(added.is_some_and(|p| p.ends_with("/python") && !p.contains(':')), "PYTHONPATH {path}");
        for (k, v) in &torch_env[rank] {
            match k.as_str() {
                // Differ by design, same meaning: a fresh random run id, a free port, a loopback
                // name, the launcher's own log directory.
                "TORCHELASTIC_RUN_ID"
                | "MASTER_PORT"
                | "TORCHELASTIC_ERROR_FILE"
                | "LC_CTYPE"
                | "ENV_DUMP_DIR"
                | "PYTHONPATH" => {}
                "MASTER_ADDR" => assert!(["localhost", "127.0.0.1"].contains(&ours[rank][k].as_str())),
                _ => assert_eq!(&ours[rank][k], v, "rank {rank}: {k}"),
            }
        }
        assert!(ours[rank]["TORCHELASTIC_ERROR_FILE"].ends_with(&format!("attempt_0/{rank}/error.json")));
    }
}

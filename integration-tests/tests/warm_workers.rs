//! Warm workers (`--warm-workers`, on by default for Python programs): a worker that a waiting
//! interpreter became sees exactly what a cold one sees, and what torchrun's sees (compared
//! field by field: environment, argv, `sys.path`, working directory, `__main__`, signal
//! dispositions and mask, descriptors, process group); a program that moves `sys.path` and its
//! directory at import and imports its own modules runs as cold; a warm interpreter killed
//! before use leaves its rank to start cold; none is left when the job ends, or when the agent
//! is killed; a program that is not Python starts none; files beside the program named like the
//! bootstrap's own modules (`ast.py`, `json.py`) neither break it nor stop being the program's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use integration_tests::*;
use serde_json::Value;

const DEADLINE: Duration = Duration::from_secs(180);

fn py(name: &str) -> PathBuf {
    repo_root().join("integration-tests/py").join(name)
}

/// A launcher command with a small, fixed environment (so that nothing of the test's own leaks
/// into what is compared), writing its probes to `dir`.
fn clean(mut cmd: std::process::Command, dir: &Path) -> std::process::Command {
    // The interpreter for rlaunch: the one torchrun runs as (its sys.executable), set for all
    // alike.
    cmd.env_clear().env("PATH", "/usr/bin:/bin").env("HOME", "/tmp").env("PROBE_DIR", dir);
    cmd.env("RLAUNCH_PYTHON", venv_python().with_file_name("python3"));
    cmd
}

fn read_probes(dir: &Path, suffix: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|r| {
            let path = dir.join(format!("rank{r}{suffix}.json"));
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            serde_json::from_str(&text).expect("probe json")
        })
        .collect()
}

/// A probe with what differs by design between two runs made the same: the run id, the store's
/// port, the per-run paths of the error file and of the agent's snapshot directory.
fn normalised(p: &Value) -> Value {
    let mut p = p.clone();
    let snap = without_run_ids(p["env"]["PYTHONPATH"].as_str().unwrap_or_default());
    if let Some(env) = p["env"].as_object_mut() {
        for k in ["TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "RLAUNCH_SNAPSHOT", "PROBE_DIR"] {
            if env.contains_key(k) {
                env.insert(k.into(), Value::from("<differs by run>"));
            }
        }
        if env.contains_key("PYTHONPATH") {
            env.insert("PYTHONPATH".into(), Value::from(snap));
        }
    }
    if let Some(path) = p["path"].as_array_mut() {
        for entry in path.iter_mut() {
            *entry = Value::from(without_run_ids(entry.as_str().unwrap_or_default()));
        }
    }
    p
}

/// `/tmp/rlaunch-snap-123-89abcdef/python` -> `/tmp/rlaunch-snap-*/python`.
fn without_run_ids(s: &str) -> String {
    match s.find("rlaunch-snap-") {
        Some(i) => {
            let rest = &s[i + "rlaunch-snap-".len()..];
            let end = rest.find('/').unwrap_or(rest.len());
            format!("{}rlaunch-snap-*{}", &s[..i], &rest[end..])
        }
        None => s.to_owned(),
    }
}

#[test]
fn a_warm_worker_sees_what_a_cold_one_and_torchrun_s_see_field_by_field() {
    let python = venv_python();
    let n = 2;
    let run = |cmd: std::process::Command, dir: &Path, what: &str| {
        let mut cmd = clean(cmd, dir);
        let o = run_deadline(&mut cmd, DEADLINE);
        assert!(o.status.success(), "{what}: {}\n{}", stdout_of(&o), stderr_of(&o));
        read_probes(dir, "", n)
    };
    let (td, cd, wd) = (tempdir(), tempdir(), tempdir());
    let mut t = std::process::Command::new(python.parent().unwrap().join("torchrun"));
    t.args(["--standalone", "--nproc-per-node", "2"]).arg(py("warm_probe.py"));
    let torchrun = run(t, td.path(), "torchrun");
    let rlaunch_with = |warm: &str| {
        let mut r = std::process::Command::new(bin("rlaunch"));
        r.args(["--standalone", "--nproc-per-node", "2", "--warm-workers", warm]).arg(py("warm_probe.py"));
        r
    };
    let cold = run(rlaunch_with("off"), cd.path(), "rlaunch cold");
    let warm = run(rlaunch_with("on"), wd.path(), "rlaunch warm");
    for rank in 0..n {
        assert_eq!(warm[rank]["warm"], true, "rank {rank}: a warm interpreter became the worker");
        assert_eq!(cold[rank]["warm"], false);
        assert_eq!(torchrun[rank]["warm"], false);
        let (w, c) = (normalised(&warm[rank]), normalised(&cold[rank]));
        for field in w.as_object().unwrap().keys().filter(|k| *k != "warm") {
            assert_eq!(w[field], c[field], "rank {rank}: `{field}` differs between a warm and a cold worker");
        }
        // torchrun's: the same but for the two variables rlaunch adds (torch_interop checks
        // their values) and its own run's values.
        let t = normalised(&torchrun[rank]);
        for field in w.as_object().unwrap().keys().filter(|k| !["warm", "env", "path"].contains(&k.as_str())) {
            assert_eq!(w[field], t[field], "rank {rank}: `{field}` differs from torchrun's worker");
        }
        let mut env = w["env"].as_object().unwrap().clone();
        env.remove("RLAUNCH_SNAPSHOT");
        env.remove("PYTHONPATH");
        for (k, v) in t["env"].as_object().unwrap() {
            match k.as_str() {
                "MASTER_ADDR" => assert!(["localhost", "127.0.0.1"].contains(&env[k].as_str().unwrap())),
                _ => assert_eq!(env.get(k), Some(v), "rank {rank}: {k} differs from torchrun's worker"),
            }
        }
        assert_eq!(env.len(), t["env"].as_object().unwrap().len(), "rank {rank}: the same variables as torchrun's");
        let ours_path: Vec<&Value> =
            w["path"].as_array().unwrap().iter().filter(|p| !p.as_str().unwrap().contains("rlaunch-snap-")).collect();
        let theirs: Vec<&Value> = t["path"].as_array().unwrap().iter().collect();
        assert_eq!(ours_path, theirs, "rank {rank}: sys.path is torchrun's but for the snapshot package");
    }
}

#[test]
fn a_module_run_warm_is_a_module_run_cold() {
    let (cd, wd) = (tempdir(), tempdir());
    let run = |warm: &str, dir: &Path| {
        let mut r = std::process::Command::new(bin("rlaunch"));
        r.args(["--standalone", "--nproc-per-node", "2", "--warm-workers", warm, "-m", "warmpkg.probe", "--flag", "x"]);
        let mut r = clean(r, dir);
        r.env("PROBE_MODULE", "1").current_dir(repo_root().join("integration-tests/py"));
        let o = run_deadline(&mut r, DEADLINE);
        assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
        read_probes(dir, ".mod", 2)
    };
    let cold = run("off", cd.path());
    let warm = run("on", wd.path());
    for rank in 0..2 {
        assert_eq!((warm[rank]["warm"].clone(), cold[rank]["warm"].clone()), (Value::Bool(true), Value::Bool(false)));
        let (w, c) = (normalised(&warm[rank]), normalised(&cold[rank]));
        for field in w.as_object().unwrap().keys().filter(|k| *k != "warm") {
            assert_eq!(w[field], c[field], "rank {rank}: `{field}` differs between a warm and a cold module run");
        }
        assert!(w["argv"][0].as_str().unwrap().ends_with("warmpkg/probe.py"), "{}", w["argv"]);
        assert_eq!(w["main_spec"], "'warmpkg.probe'");
    }
}

#[test]
fn a_program_s_own_ast_json_and_select_beside_it_run_warm_as_they_run_cold() {
    // Files named like modules the bootstrap itself uses, beside the program, and an installed
    // module imported ahead that imports json: warm, the job runs (the bootstrap's own imports
    // come from the library), and the program and that module get the program's own files, as
    // a cold start's do (its directory first on sys.path).
    let dir = tempdir();
    let prog = dir.path().join("prog");
    let site = dir.path().join("site-packages");
    std::fs::create_dir(&prog).unwrap();
    std::fs::create_dir(&site).unwrap();
    for m in ["ast", "json", "select"] {
        std::fs::write(prog.join(format!("{m}.py")), format!("WHERE = 'own {m}'\n")).unwrap();
    }
    std::fs::write(site.join("uses_json.py"), "import json\nWHERE = getattr(json, 'WHERE', json.__file__)\n").unwrap();
    std::fs::write(
        prog.join("train.py"),
        "import uses_json\nimport ast, json, os, select\n\
         warm = b'rlaunch_warm.py' in open('/proc/self/cmdline', 'rb').read()\n\
         with open(os.path.join(os.environ['PROBE_DIR'], 'rank%s.txt' % os.environ['RANK']), 'w') as f:\n\
         \x20   f.write(f'warm={warm} imported_ahead={uses_json.WHERE} ast={ast.WHERE} json={json.WHERE} select={select.WHERE}')\n",
    )
    .unwrap();
    let run = |warm: &str| -> Vec<String> {
        let probes = tempdir();
        let mut r = std::process::Command::new(bin("rlaunch"));
        r.args(["--standalone", "--nproc-per-node", "2", "--warm-workers", warm]).arg(prog.join("train.py"));
        let mut r = clean(r, probes.path());
        r.env("PYTHONPATH", &site);
        let o = run_deadline(&mut r, DEADLINE);
        assert!(o.status.success(), "--warm-workers {warm}: {}\n{}", stdout_of(&o), stderr_of(&o));
        (0..2)
            .map(|rank| {
                let p = probes.path().join(format!("rank{rank}.txt"));
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            })
            .collect()
    };
    let own = "imported_ahead=own json ast=own ast json=own json select=own select";
    assert_eq!(run("off"), vec![format!("warm=False {own}"); 2], "cold");
    assert_eq!(run("on"), vec![format!("warm=True {own}"); 2], "warm, as cold");
}

/// Warm interpreters this agent started that wait (their bootstrap lies in
/// `rlaunch-warm-{agent pid}-…`, and they are in a `warm{r}` cgroup until a round takes them:
/// one that became a worker keeps its command line).
fn warm_pids_of(agent: u32) -> Vec<i32> {
    let needle = format!("rlaunch-warm-{agent}-");
    let waiting = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .is_ok_and(|c| c.lines().any(|l| l.rsplit('/').next().is_some_and(|last| last.starts_with("warm"))))
    };
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
                && waiting(*pid)
        })
        .collect()
}

#[test]
fn moving_at_import_own_modules_and_a_warm_interpreter_killed_before_use() {
    let python = venv_python();
    let dir = tempdir();
    // An installed module that reads RANK as it is imported.
    let site = tempdir();
    let site_packages = site.path().join("site-packages");
    std::fs::create_dir(&site_packages).unwrap();
    std::fs::write(site_packages.join("rank_at_import.py"), "import os\nRANK = os.environ.get('RANK')\n").unwrap();
    let mut r = rlaunch();
    r.env("RLAUNCH_PYTHON", &python).env("PROBE_DIR", dir.path()).env("PROBE_HOLD", "6");
    r.env("PYTHONPATH", &site_packages);
    r.args(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]).arg(py("warm_moves.py"));
    r.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let child = r.spawn().expect("rlaunch");
    let agent = child.id();
    // Attempt 0 runs; the next set is started 2 s in. Kill one of them before it is used.
    let first = dir.path().join("rank0.attempt0.json");
    wait_until("attempt 0 to run", DEADLINE, || first.exists());
    let mut next: Vec<i32> = Vec::new();
    wait_until("the next warm set to start", Duration::from_secs(30), || {
        next = warm_pids_of(agent);
        next.len() == 2
    });
    next.sort_unstable();
    // SAFETY: kill on a pid just read from /proc, the agent's child waiting for its order.
    assert_eq!(unsafe { libc::kill(next[0], libc::SIGKILL) }, 0);
    let o = wait_deadline(child, DEADLINE);
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    let seen = |rank: u32, attempt: u32| -> Value {
        let p = dir.path().join(format!("rank{rank}.attempt{attempt}.json"));
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
    };
    let mut warm_after: BTreeMap<i64, bool> = BTreeMap::new();
    for rank in 0..2 {
        for attempt in 0..2 {
            let s = seen(rank, attempt);
            let rank_text = rank.to_string();
            // What the program did at import happened as the worker, with its rank set.
            assert_eq!(s["moved_helper_rank"], rank_text.as_str(), "rank {rank} attempt {attempt}: {s}");
            assert_eq!(s["own_module_rank"], rank_text.as_str(), "rank {rank} attempt {attempt}: {s}");
            // An installed module imported ahead saw the rank it runs as.
            assert_eq!(s["installed_rank"], rank_text.as_str(), "rank {rank} attempt {attempt}: {s}");
            assert_eq!(s["cwd"], s["extra"], "the program's own chdir holds");
            assert!(s["own_module_file"].as_str().unwrap().ends_with("integration-tests/py/warm_own_module.py"));
            if attempt == 1 {
                warm_after.insert(s["pid"].as_i64().unwrap(), s["warm"].as_bool().unwrap());
            }
        }
        assert_eq!(seen(rank, 0)["warm"], true, "rank {rank}'s first worker was warm");
    }
    // The killed one's rank started cold, the other warm, and the job went on.
    let killed = i64::from(next[0]);
    assert!(!warm_after.contains_key(&killed), "the killed interpreter ran nothing");
    let mut kinds: Vec<bool> = warm_after.values().copied().collect();
    kinds.sort_unstable();
    assert_eq!(kinds, [false, true], "one rank cold (its warm one was killed), one warm: {warm_after:?}");
    assert!(warm_pids_of(agent).is_empty(), "no warm interpreter is left after the job");
}

#[test]
fn no_warm_interpreter_outlives_its_job_or_a_killed_agent_and_none_starts_for_a_binary() {
    let python = venv_python();
    // A job that ends while its next set waits.
    let mut r = rlaunch();
    r.env("RLAUNCH_PYTHON", &python)
        .args(["--standalone", "--nproc-per-node", "2", "--warm-workers", "on"])
        .arg(py("sleep_for.py"))
        .arg("6");
    r.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let child = r.spawn().expect("rlaunch");
    let agent = child.id();
    wait_until("the next warm set to start", Duration::from_secs(60), || warm_pids_of(agent).len() == 2);
    let waiting = warm_pids_of(agent);
    let o = wait_deadline(child, DEADLINE);
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    for pid in &waiting {
        assert!(!pid_alive(*pid), "warm interpreter {pid} outlived its job");
    }
    let tmp = std::env::temp_dir();
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&format!("rlaunch-warm-{agent}-")))
        .collect();
    assert!(left.is_empty(), "the bootstrap's directory is removed: {left:?}");

    // SIGKILL of the agent: its warm interpreters die with it (parent-death signal, cgroup).
    let mut r = rlaunch();
    r.env("RLAUNCH_PYTHON", &python).args(["--standalone", "--nproc-per-node", "2"]).arg(py("sleep_for.py"));
    r.arg("60").stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    let mut child = r.spawn().expect("rlaunch");
    let agent = child.id();
    wait_until("the next warm set to start", Duration::from_secs(60), || warm_pids_of(agent).len() == 2);
    let waiting = warm_pids_of(agent);
    child.kill().expect("SIGKILL the agent");
    let _ = child.wait();
    wait_until("the warm interpreters to die with their agent", Duration::from_secs(10), || {
        waiting.iter().all(|p| !pid_alive(*p))
    });

    // A program that is not Python: no warm interpreter, and it runs as ever.
    let mut r = rlaunch();
    r.args(["--standalone", "--nproc-per-node", "2", "/bin/sh", "-c"])
        .arg("ls -d \"${TMPDIR:-/tmp}\"/rlaunch-warm-$PPID-* 2>/dev/null && exit 9; echo plain rank $RANK");
    let o = run_deadline(&mut r, DEADLINE);
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    assert_eq!(stdout_of(&o).matches("plain rank").count(), 2, "{}", stdout_of(&o));
}

/// The bootstrap itself: a module imported ahead that looked RANK up makes a worker whose rank
/// moved start again cold (and that module then sees the right rank); one that only scanned the
/// environment (as tqdm does) leaves the worker warm.
#[test]
fn a_rank_looked_up_while_importing_ahead_makes_a_moved_worker_start_cold() {
    let bootstrap = repo_root().join("agent/src/warm/bootstrap.py");
    let dir = tempdir();
    let site = dir.path().join("site-packages");
    std::fs::create_dir(&site).unwrap();
    let run = |module: &str| -> Value {
        let mut cmd = std::process::Command::new(venv_python());
        cmd.arg(py("warm_bootstrap_check.py")).arg(&bootstrap).arg(&site).arg(module);
        let o = run_deadline(&mut cmd, DEADLINE);
        assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
        serde_json::from_str(stdout_of(&o).trim().lines().last().unwrap()).expect("json")
    };
    let looked = run("looks_rank_up");
    assert_eq!(looked["warm"], false, "started again cold: {looked}");
    assert_eq!(looked["at_import"], "1", "the module saw the worker's rank: {looked}");
    assert_eq!(looked["rank"], "1");
    let scanned = run("scans_env");
    assert_eq!(scanned["warm"], true, "a scan is no lookup: the worker stayed warm: {scanned}");
    assert_eq!(scanned["rank"], "1");
}

/// In an elastic job (a rendezvous endpoint) the workers start warm too: the warm interpreters
/// are made with what the round's workers get, the control socket of `rlaunch.resilient`
/// included. Without it every warm interpreter of an elastic job was discarded and its rank
/// started cold (2026-11-28: a node lost with a spare waiting cost 9.7 s instead of 2.6 s).
#[test]
fn the_workers_of_an_elastic_job_start_warm() {
    let dir = tempdir();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("127.0.0.1:{port}");
    let mut r = std::process::Command::new(bin("rlaunch"));
    r.args(["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "rlaunch", "--rdzv-endpoint", &endpoint])
        .args(["--rdzv-id", "warm-elastic", "--rdzv-conf", "last_call_timeout=0.5"])
        .arg(py("warm_probe.py"));
    let o = run_deadline(&mut clean(r, dir.path()), DEADLINE);
    assert!(o.status.success(), "{}\n{}", stdout_of(&o), stderr_of(&o));
    for (rank, p) in read_probes(dir.path(), "", 2).iter().enumerate() {
        assert!(p["env"]["RLAUNCH_CONTROL"].is_string(), "rank {rank}: an elastic job's worker: {p:#}");
        assert_eq!(p["warm"], true, "rank {rank}: a warm interpreter became the worker");
    }
}

/// A program that calls `torch.compile` gets what that call imports (inductor, 0.9 s here) imported
/// ahead by its warm worker, and inductor's hashes of torch's and Triton's sources (0.4 s of the
/// first compile) computed ahead, so a worker started anew does not pay them; one that does not
/// call it gets nothing more imported; one that names inductor's settings (which inductor reads
/// when imported, and which the program may set first) gets the import where a cold start makes
/// it.
#[test]
fn a_program_that_calls_torch_compile_gets_inductor_imported_ahead_unless_it_names_its_settings() {
    const PROBE: &str = r#"
import json
import os
import sys

import torch

WARM = b"rlaunch_warm.py" in open("/proc/self/cmdline", "rb").read()
# (Spelt in two pieces: a program naming inductor's module gets nothing of it imported ahead.)
AHEAD = "torch._ind" "uctor.compile_fx" in sys.modules
CACHE = sys.modules.get("torch._ind" "uctor.codecache")


def computed(key):
    # A cached function's closure holds its value once computed (bytes, str), else a sentinel.
    return any(isinstance(c.cell_contents, (bytes, str)) for c in getattr(CACHE, key).__closure__)


import importlib.util
KEYS = [computed("torch_key"), computed("triton_key")] if CACHE else [False, False]
TRITON = importlib.util.find_spec("triton") is not None
with open(os.path.join(os.environ["PROBE_DIR"], "rank0.json"), "w") as f:
    json.dump({"warm": WARM, "inductor_ahead": AHEAD, "keys_ahead": KEYS, "triton": TRITON}, f)
"#;
    // (name, the program's body, inductor imported ahead, its source hashes computed ahead, traced)
    let cases = [
        ("compiles", "model = torch.compile(torch.nn.Linear(2, 2))\n", true, true, false),
        ("plain", "model = torch.nn.Linear(2, 2)\n", false, false, false),
        (
            "configures",
            "os.environ[\"TORCHINDUCTOR_COMPILE_THREADS\"] = \"1\"\nmodel = torch.compile(torch.nn.Linear(2, 2))\n",
            false,
            false,
            false,
        ),
        // Under TORCH_TRACE the hashes' timing event would open the trace file before the rank is
        // known (named without it): inductor is imported ahead, the hashes are left.
        ("traced", "model = torch.compile(torch.nn.Linear(2, 2))\n", true, false, true),
    ];
    for (name, body, expected, keys, traced) in cases {
        let dir = tempdir();
        let program = dir.path().join(format!("{name}.py"));
        std::fs::write(&program, format!("{PROBE}{body}")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let endpoint = format!("127.0.0.1:{port}");
        let mut r = std::process::Command::new(bin("rlaunch"));
        // The round closes 30 s after the node joined: time for the warm worker's imports and
        // hashes (about 10 s here; a round that closes before they end starts the worker with
        // what was imported by then, as it should, and this test would see less than it asks).
        r.args(["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "rlaunch", "--rdzv-endpoint", &endpoint])
            .args(["--rdzv-id", "warm-compile", "--rdzv-conf", "last_call_timeout=30"])
            .arg(&program);
        let mut cmd = clean(r, dir.path());
        if traced {
            cmd.env("TORCH_TRACE", dir.path().join("trace"));
        }
        let o = run_deadline(&mut cmd, DEADLINE);
        assert!(o.status.success(), "{name}: {}\n{}", stdout_of(&o), stderr_of(&o));
        let p = &read_probes(dir.path(), "", 1)[0];
        let log = stderr_of(&o);
        assert_eq!(p["warm"], true, "{name}: a warm interpreter became the worker: {p}\n{log}");
        assert_eq!(p["inductor_ahead"], expected, "{name}: {p}\n{log}");
        // Triton's hash is a value only where Triton is installed (it is, with torch's CUDA wheels).
        let triton = keys && p["triton"] == true;
        assert_eq!(p["keys_ahead"], serde_json::json!([keys, triton]), "{name}: the source hashes: {p}\n{log}");
    }
}

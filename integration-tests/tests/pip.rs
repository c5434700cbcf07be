//! The Python wheel (`pyproject.toml`, maturin): built, installed into a fresh virtualenv with
//! pip, both commands on that environment's PATH, and its `rlaunch` called by full path —
//! not activated — running a PyTorch job with that environment's python.

use std::process::Command;
use std::time::Duration;

use integration_tests::*;

#[test]
fn the_wheel_installs_both_commands_and_its_rlaunch_runs_workers_with_its_own_python() {
    let maturin = repo_root().join(".venv/bin/maturin");
    assert!(maturin.exists(), "{} is missing: run scripts/install-deps.sh", maturin.display());
    let dir = tempdir();
    let wheels = dir.path().join("wheels");
    let o = run_deadline(
        Command::new(&maturin).current_dir(repo_root()).args(["build", "--out"]).arg(&wheels),
        Duration::from_secs(900),
    );
    assert!(o.status.success(), "maturin build: {}", stderr_of(&o));
    let wheel = std::fs::read_dir(&wheels)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"));
    let wheel = wheel.expect("a wheel");

    // A fresh virtualenv from the project's Python; pip installs the wheel offline.
    let env_dir = dir.path().join("env");
    let o = run_deadline(Command::new(venv_python()).args(["-m", "venv"]).arg(&env_dir), Duration::from_secs(120));
    assert!(o.status.success(), "venv: {}", stderr_of(&o));
    let pip = run_deadline(
        Command::new(env_dir.join("bin/pip")).args(["install", "-q", "--no-index"]).arg(&wheel),
        Duration::from_secs(300),
    );
    assert!(pip.status.success(), "pip install: {}", stderr_of(&pip));
    for cmd in ["rlaunch", "rlaunch-rendezvous"] {
        assert!(env_dir.join("bin").join(cmd).is_file(), "{cmd} is on the environment's PATH");
    }
    let check = run_deadline(
        Command::new(env_dir.join("bin/rlaunch-rendezvous")).arg("--check-config"),
        Duration::from_secs(30),
    );
    assert!(check.status.success(), "{}", stderr_of(&check));
    // The Python package is in the wheel: importable from the environment itself.
    let import = run_deadline(
        Command::new(env_dir.join("bin/python"))
            .args(["-c", "import rlaunch.snapshot as s; print(s.__file__); assert s.load() is None"])
            .env_remove("PYTHONPATH"),
        Duration::from_secs(30),
    );
    assert!(import.status.success(), "import rlaunch from the wheel: {}", stderr_of(&import));
    assert!(stdout_of(&import).trim().starts_with(env_dir.to_str().unwrap()), "{}", stdout_of(&import));

    // torch without a second download: the new environment sees the project's packages.
    let site = run_deadline(
        Command::new(env_dir.join("bin/python"))
            .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]),
        Duration::from_secs(30),
    );
    let project_site = run_deadline(
        Command::new(venv_python()).args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]),
        Duration::from_secs(30),
    );
    std::fs::write(
        std::path::Path::new(stdout_of(&site).trim()).join("project-packages.pth"),
        stdout_of(&project_site).trim(),
    )
    .unwrap();

    let script = dir.path().join("which_python.py");
    std::fs::write(
        &script,
        "import os, sys\nimport torch, torch.distributed as dist\n\
         dist.init_process_group('gloo')\n\
         t = torch.ones(1)\n\
         dist.all_reduce(t)\n\
         print(f'rank {dist.get_rank()} python {sys.executable} sum {t.item():.0f}', flush=True)\n\
         dist.destroy_process_group()\n",
    )
    .unwrap();
    // Called by full path, nothing activated, no interpreter named: the environment's python
    // runs the workers (the system's python3 on PATH has no torch).
    let o = run_deadline(
        Command::new(env_dir.join("bin/rlaunch"))
            .args(["--standalone", "--nproc-per-node", "2"])
            .arg(&script)
            .env_remove("VIRTUAL_ENV")
            .env_remove("CONDA_PREFIX")
            .env_remove("PYTHON_EXEC")
            .env_remove("RLAUNCH_PYTHON")
            .env("PATH", "/usr/local/bin:/usr/bin:/bin"),
        Duration::from_secs(180),
    );
    let out = stdout_of(&o);
    assert!(o.status.success(), "{out}{}", stderr_of(&o));
    let python = env_dir.join("bin/python");
    for rank in 0..2 {
        assert!(out.contains(&format!("rank {rank} python {} sum 2", python.display())), "{out}");
    }
}

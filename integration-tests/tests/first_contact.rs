//! A torchrun user's habits: Ctrl-C reaches the workers as SIGINT (`except KeyboardInterrupt`
//! runs), `PET_*` booleans read as torchrun reads them (`1`/`0`), the interpreter is
//! `PYTHON_EXEC`, else the active virtualenv's, and a Python file that is neither a `#!` script
//! nor an ELF executable runs under python.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use integration_tests::{bin, run_deadline, stderr_of, stdout_of, tempdir, wait_deadline, wait_until};

const DEADLINE: Duration = Duration::from_secs(30);

fn python3() -> String {
    for p in ["/usr/bin/python3", "/usr/local/bin/python3"] {
        if Path::new(p).exists() {
            return p.to_owned();
        }
    }
    panic!("python3 is needed (apt-get install python3)");
}

/// A wrapper interpreter: runs python3 with `MARK` set, so the worker can tell who ran it.
fn marked_python(dir: &Path, mark: &str) -> String {
    let p = dir.join(format!("python-{mark}"));
    std::fs::write(&p, format!("#!/bin/sh\nMARK={mark} exec {} \"$@\"\n", python3())).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p.display().to_string()
}

fn rlaunch(env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut c = Command::new(bin("rlaunch"));
    c.env_clear().env("PATH", "/usr/local/bin:/usr/bin:/bin").env("HOME", "/tmp").env("RLAUNCH_LOG", "info").args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

#[test]
fn ctrl_c_reaches_the_workers_as_keyboard_interrupt() {
    let dir = tempdir();
    let script = dir.path().join("w.py");
    std::fs::write(
        &script,
        format!(
            "import pathlib, sys, time\n\
             pathlib.Path('{d}/up').touch()\n\
             try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('caught KeyboardInterrupt', flush=True)\n    sys.exit(0)\n",
            d = dir.path().display()
        ),
    )
    .unwrap();
    let py = python3();
    let child = rlaunch(&[("PYTHON_EXEC", &py)], &["--standalone", "--nproc-per-node", "2", script.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("the workers to start", DEADLINE, || dir.path().join("up").exists());
    std::thread::sleep(Duration::from_millis(300));
    Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    let o = wait_deadline(child, DEADLINE);
    let out = stdout_of(&o);
    assert_eq!(
        out.matches("caught KeyboardInterrupt").count(),
        2,
        "every worker's handler ran: {out}\n{}",
        stderr_of(&o)
    );
    assert_eq!(o.status.code(), Some(130), "128 + SIGINT");
}

#[test]
fn pet_booleans_are_read_as_torchrun_reads_them() {
    let o = run_deadline(
        &mut rlaunch(
            &[("PET_STANDALONE", "1"), ("PET_NO_PYTHON", "1"), ("PET_NPROC_PER_NODE", "2")],
            &["/bin/echo", "hi"],
        ),
        DEADLINE,
    );
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert_eq!(stdout_of(&o).matches("]:hi").count(), 2, "{}", stdout_of(&o));
    let o = run_deadline(&mut rlaunch(&[("PET_STANDALONE", "0")], &["--nnodes", "2", "/bin/true"]), DEADLINE);
    assert_eq!(o.status.code(), Some(2), "0 means off: a static multi-node job without a master port");
    // `true` is taken too (`PET_MODULE=true`: python -m).
    let py = python3();
    let o = run_deadline(
        &mut rlaunch(&[("PET_STANDALONE", "1"), ("PET_MODULE", "true"), ("PYTHON_EXEC", &py)], &["this"]),
        DEADLINE,
    );
    assert!(stdout_of(&o).contains("Beautiful is better than ugly"), "{}", stderr_of(&o));
}

#[test]
fn the_interpreter_is_python_exec_else_the_active_virtualenvs() {
    let dir = tempdir();
    let script = dir.path().join("w.py");
    std::fs::write(&script, "import os\nprint('MARK=' + os.environ.get('MARK', 'none'))\n").unwrap();
    let s = script.to_str().unwrap();
    let exec = marked_python(dir.path(), "exec");
    let venv = dir.path().join("venv");
    std::fs::create_dir_all(venv.join("bin")).unwrap();
    std::fs::rename(marked_python(dir.path(), "venv"), venv.join("bin/python")).unwrap();
    let v = venv.to_str().unwrap();

    let o = run_deadline(&mut rlaunch(&[("PYTHON_EXEC", &exec), ("VIRTUAL_ENV", v)], &["--standalone", s]), DEADLINE);
    assert!(stdout_of(&o).contains("MARK=exec"), "PYTHON_EXEC first: {}", stdout_of(&o));
    let o = run_deadline(&mut rlaunch(&[("VIRTUAL_ENV", v)], &["--standalone", s]), DEADLINE);
    assert!(stdout_of(&o).contains("MARK=venv"), "then the virtualenv's: {}", stdout_of(&o));
    assert!(stderr_of(&o).contains("python interpreter"), "logged at start: {}", stderr_of(&o));
}

#[test]
fn a_python_file_without_py_and_without_the_execute_bit_runs_under_python() {
    let dir = tempdir();
    let script = dir.path().join("train");
    std::fs::write(&script, "print('ran under python')\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let py = python3();
    let o = run_deadline(&mut rlaunch(&[("PYTHON_EXEC", &py)], &["--standalone", script.to_str().unwrap()]), DEADLINE);
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(stdout_of(&o).contains("ran under python"));
    // An ELF program and a #! script still run as they are.
    let o = run_deadline(&mut rlaunch(&[], &["--standalone", "/bin/echo", "elf"]), DEADLINE);
    assert!(stdout_of(&o).contains("elf"));
}

#[test]
fn the_failure_report_lists_every_failed_rank_the_root_cause_first() {
    // Ranks 1 and 2 fail in the same moment: each waits, spinning, until both have started.
    let script = r#"case $RANK in
        1|2) touch "$1/up.$RANK"; until [ -e "$1/up.1" ] && [ -e "$1/up.2" ]; do :; done
             [ "$RANK" = 1 ] && exit 7; exit 9;;
        *) sleep 30;;
    esac"#;
    let dir = tempdir();
    let d = dir.path().to_str().unwrap();
    let o = run_deadline(
        &mut rlaunch(
            &[],
            &["--standalone", "--nproc-per-node", "3", "--shutdown-timeout", "2", "/bin/sh", "-c", script, "sh", d],
        ),
        DEADLINE,
    );
    let err = stderr_of(&o);
    let root = err.find("Root Cause (first observed failure)").expect("a root cause");
    let others = err.find("Other Failures:").unwrap_or_else(|| panic!("the other failed rank is listed: {err}"));
    assert!(root < others, "the root cause comes first");
    let (first, second) =
        if o.status.code() == Some(7) { ("exit code 7", "exit code 9") } else { ("exit code 9", "exit code 7") };
    assert!(matches!(o.status.code(), Some(7) | Some(9)), "the root cause's exit code: {:?}", o.status.code());
    assert!(err[root..others].contains(first), "{err}");
    assert!(err[others..].contains(second), "{err}");
    assert!(!err[others..].contains("rank 0 "), "rank 0 was stopped, it did not fail: {err}");
}

#[test]
fn virtual_local_rank_gives_every_worker_its_own_gpu_as_device_0() {
    let w = integration_tests::worker();
    let run = |visible: Option<&str>| {
        let dir = tempdir();
        let d = dir.path().to_str().unwrap().to_owned();
        let mut env = vec![];
        if let Some(v) = visible {
            env.push(("CUDA_VISIBLE_DEVICES", v));
        }
        let o = run_deadline(
            &mut rlaunch(
                &env,
                &[
                    "--standalone",
                    "--nproc-per-node",
                    "2",
                    "--virtual-local-rank",
                    w.to_str().unwrap(),
                    "--out",
                    &d,
                    "dump-env",
                ],
            ),
            DEADLINE,
        );
        let envs: Vec<serde_json::Value> = if o.status.success() {
            (0..2)
                .map(|r| {
                    serde_json::from_str(
                        &std::fs::read_to_string(dir.path().join(format!("env_rank{r}_attempt0.json"))).unwrap(),
                    )
                    .unwrap()
                })
                .collect()
        } else {
            Vec::new()
        };
        (o, envs)
    };
    let (_, envs) = run(Some("5,7"));
    for (r, gpu) in [(0, "5"), (1, "7")] {
        assert_eq!(envs[r]["LOCAL_RANK"], "0", "rank {r}");
        assert_eq!(envs[r]["CUDA_VISIBLE_DEVICES"], gpu, "rank {r}");
        assert_eq!(envs[r]["RANK"], r.to_string());
    }
    let (_, envs) = run(None);
    assert_eq!((envs[1]["LOCAL_RANK"].as_str(), envs[1]["CUDA_VISIBLE_DEVICES"].as_str()), (Some("0"), Some("1")));
    let (o, _) = run(Some("3"));
    assert_eq!(o.status.code(), Some(2), "too few visible devices, as torchrun refuses: {}", stderr_of(&o));
    assert!(stderr_of(&o).contains("--virtual-local-rank"));
}

#[test]
fn signals_to_handle_stops_the_job_with_the_listed_signal_forwarded_first() {
    let dir = tempdir();
    let script = dir.path().join("w.py");
    std::fs::write(
        &script,
        format!(
            "import os, pathlib, signal, sys, time\n\
             print('env', os.environ['TORCHELASTIC_SIGNALS_TO_HANDLE'], flush=True)\n\
             def on_usr1(sig, frame):\n    print('got SIGUSR1', flush=True)\n    sys.exit(0)\n\
             signal.signal(signal.SIGUSR1, on_usr1)\n\
             pathlib.Path('{d}/up' + os.environ['RANK']).touch()\n\
             time.sleep(60)\n",
            d = dir.path().display()
        ),
    )
    .unwrap();
    let py = python3();
    let child = rlaunch(
        &[("PYTHON_EXEC", &py)],
        &["--standalone", "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGUSR1", script.to_str().unwrap()],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_until("the workers to start", DEADLINE, || dir.path().join("up0").exists() && dir.path().join("up1").exists());
    Command::new("kill").args(["-USR1", &child.id().to_string()]).status().unwrap();
    let o = wait_deadline(child, DEADLINE);
    let out = stdout_of(&o);
    assert_eq!(out.matches("got SIGUSR1").count(), 2, "every worker got SIGUSR1 first: {out}\n{}", stderr_of(&o));
    assert_eq!(out.matches("env SIGTERM,SIGUSR1").count(), 2, "torchrun's variable, as torchrun leaves it: {out}");
    assert_eq!(o.status.code(), Some(128 + libc::SIGUSR1), "128 + SIGUSR1");
}

#[test]
fn duplicate_stdout_filters_copy_matching_lines_to_the_attempts_filtered_log() {
    let dir = tempdir();
    let logs = dir.path().join("logs");
    let o = run_deadline(
        &mut rlaunch(
            &[],
            &[
                "--standalone",
                "--nproc-per-node",
                "2",
                "--no-python",
                "--log-dir",
                logs.to_str().unwrap(),
                "--duplicate-stdout-filters",
                "apple,or,,ange",
                "sh",
                "-c",
                "echo an apple; echo pear; echo 'or,ange juice'; echo orange",
            ],
        ),
        DEADLINE,
    );
    assert!(o.status.success(), "{}", stderr_of(&o));
    let run = std::fs::read_dir(&logs).unwrap().next().unwrap().unwrap().path();
    let filtered = std::fs::read_to_string(run.join("attempt_0/filtered_stdout.log")).unwrap();
    let mut lines: Vec<&str> = filtered.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        ["[default0]:an apple", "[default0]:or,ange juice", "[default1]:an apple", "[default1]:or,ange juice"],
        "`,,` is a comma inside a filter"
    );
    assert!(!run.join("attempt_0/filtered_stderr.log").exists(), "no stderr filters, no file");
}

/// The first two CPUs this process may run on.
fn two_allowed_cpus() -> (u32, u32) {
    let cpus: Vec<u32> = rlaunch_agent::numa::allowed_cpus().expect("sched_getaffinity").into_iter().collect();
    assert!(cpus.len() >= 2, "the NUMA binding test needs two CPUs; this machine allows {cpus:?}");
    (cpus[0], cpus[1])
}

#[test]
fn numa_binding_pins_each_worker_to_its_gpus_cpus() {
    // A node as sysfs describes it: one NUMA node with two single-thread cores sharing an L3,
    // and two NVIDIA GPUs on it (so `exclusive` gives each worker one core of its own).
    let dir = tempdir();
    let sys = dir.path().join("sys");
    let (c0, c1) = two_allowed_cpus();
    let put = |path: &str, text: &str| {
        let p = sys.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    put("devices/system/node/possible", "0\n");
    put("devices/system/node/node0/cpulist", &format!("{c0},{c1}\n"));
    for c in [c0, c1] {
        put(&format!("devices/system/cpu/cpu{c}/topology/thread_siblings_list"), &format!("{c}\n"));
        put(&format!("devices/system/cpu/cpu{c}/topology/physical_package_id"), "0\n");
        put(&format!("devices/system/cpu/cpu{c}/cache/index3/type"), "Unified\n");
        put(&format!("devices/system/cpu/cpu{c}/cache/index3/level"), "3\n");
        put(&format!("devices/system/cpu/cpu{c}/cache/index3/shared_cpu_list"), &format!("{c0},{c1}\n"));
    }
    for gpu in ["0000:01:00.0", "0000:02:00.0"] {
        put(&format!("bus/pci/devices/{gpu}/vendor"), "0x10de\n");
        put(&format!("bus/pci/devices/{gpu}/class"), "0x030200\n");
        put(&format!("bus/pci/devices/{gpu}/numa_node"), "0\n");
    }
    let sysfs = sys.to_str().unwrap();
    let run = |mode: &str| {
        let o = run_deadline(
            &mut rlaunch(
                &[("RLAUNCH_SYSFS", sysfs)],
                &[
                    "--standalone",
                    "--nproc-per-node",
                    "2",
                    "--no-python",
                    "--numa-binding",
                    mode,
                    "sh",
                    "-c",
                    "grep Cpus_allowed_list /proc/self/status",
                ],
            ),
            DEADLINE,
        );
        assert!(o.status.success(), "{mode}: {}", stderr_of(&o));
        let mut lines: Vec<String> = stdout_of(&o).lines().map(|l| l.split_whitespace().collect()).collect();
        lines.sort();
        lines
    };
    assert_eq!(
        run("exclusive"),
        [format!("[default0]:Cpus_allowed_list:{c0}"), format!("[default1]:Cpus_allowed_list:{c1}")],
        "a core of its own for each GPU's worker"
    );
    let both = if c1 == c0 + 1 { format!("{c0}-{c1}") } else { format!("{c0},{c1}") };
    assert_eq!(
        run("node"),
        [format!("[default0]:Cpus_allowed_list:{both}"), format!("[default1]:Cpus_allowed_list:{both}")],
        "the whole NUMA node for each"
    );
    // More workers than GPUs: refused before anything starts, with the reason.
    let o = run_deadline(
        &mut rlaunch(
            &[("RLAUNCH_SYSFS", sysfs)],
            &["--standalone", "--nproc-per-node", "3", "--no-python", "--numa-binding", "node", "true"],
        ),
        DEADLINE,
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr_of(&o).contains("numa binding node"), "{}", stderr_of(&o));
}

#[test]
fn print_completion_gives_a_script_bash_loads() {
    let o = run_deadline(&mut rlaunch(&[], &["--print-completion", "bash"]), DEADLINE);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let dir = tempdir();
    let script = dir.path().join("rlaunch.bash");
    std::fs::write(&script, &o.stdout).unwrap();
    let check = format!("source {} && complete -p rlaunch", script.display());
    let b = run_deadline(Command::new("bash").args(["-c", &check]), DEADLINE);
    assert!(stdout_of(&b).contains("-F _rlaunch rlaunch"), "{}{}", stdout_of(&b), stderr_of(&b));
    assert!(stdout_of(&o).contains("--numa-binding"), "the flags are in it");
    // torchrun's `tcsh` is not among the shells: a usage error, as argparse gives for a bad choice.
    let o = run_deadline(&mut rlaunch(&[], &["--print-completion", "tcsh"]), DEADLINE);
    assert_eq!(o.status.code(), Some(2));
}

/// `echo cfg | torchrun ... prog` gives the program `cfg` on its stdin: torchrun's workers
/// inherit the launcher's. Under rlaunch the stdin rank (`--stdin-rank`, 0 by default) gets the
/// pipe or file as it is, warm (a Python program) or cold; every other rank reads /dev/null.
#[test]
fn piped_or_redirected_stdin_reaches_the_stdin_rank_warm_or_cold() {
    use std::io::Write;
    let dir = tempdir();
    let script = dir.path().join("read.py");
    std::fs::write(
        &script,
        "import os, sys\nprint(f\"rank {os.environ['RANK']} read {sys.stdin.read().strip()!r}\", flush=True)\n",
    )
    .unwrap();
    let py = python3();
    let run = |args: &[&str], stdin: Stdio, input: Option<&str>| {
        let mut child = rlaunch(&[("PYTHON_EXEC", &py)], args)
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if let Some(text) = input {
            let mut pipe = child.stdin.take().unwrap();
            pipe.write_all(text.as_bytes()).unwrap();
        }
        let out = wait_deadline(child, DEADLINE);
        assert!(out.status.success(), "{}", stderr_of(&out));
        stdout_of(&out)
    };
    let s = script.to_str().unwrap();
    // A pipe, a Python program (warm workers, on by default).
    let out = run(&["--standalone", "--nproc-per-node", "2", s], Stdio::piped(), Some("cfg from a pipe\n"));
    assert!(out.contains("rank 0 read 'cfg from a pipe'"), "{out}");
    assert!(out.contains("rank 1 read ''"), "{out}");
    // Cold, to another rank.
    let out = run(
        &["--standalone", "--nproc-per-node", "2", "--warm-workers", "off", "--stdin-rank", "1", s],
        Stdio::piped(),
        Some("to rank 1\n"),
    );
    assert!(out.contains("rank 1 read 'to rank 1'") && out.contains("rank 0 read ''"), "{out}");
    // A file, a program that is not Python.
    let file = dir.path().join("input.txt");
    std::fs::write(&file, "from a file\n").unwrap();
    let out = run(
        &[
            "--standalone",
            "--nproc-per-node",
            "2",
            "--no-python",
            "sh",
            "-c",
            "read line; echo \"rank $RANK read '$line'\"",
        ],
        Stdio::from(std::fs::File::open(&file).unwrap()),
        None,
    );
    assert!(out.contains("rank 0 read 'from a file'") && out.contains("rank 1 read ''"), "{out}");
}

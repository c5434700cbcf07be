//! The run's log directory cannot be swapped under a running agent: whoever renames it and puts
//! a symlink in its place (issue 26, item 1) gets nothing made or truncated where the link
//! points; the agent goes on writing into the directory it made.

use std::process::Command;
use std::time::Duration;

use integration_tests::{bin, rlaunch, run_deadline, stderr_of, stdout_of, tempdir};

const DEADLINE: Duration = Duration::from_secs(60);

/// The first attempt's worker swaps the run directory for a symlink to a victim directory and
/// fails; the second attempt's directories, logs and heartbeat must not appear in the victim.
#[test]
fn a_run_directory_swapped_for_a_symlink_between_attempts_is_never_followed() {
    let dir = tempdir();
    let logs = dir.path().join("logs");
    let victim = dir.path().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("precious"), "keep me\n").unwrap();
    let script = format!(
        r#"d=$(dirname "$(dirname "$(dirname "$TORCHELASTIC_ERROR_FILE")")")
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then mv "$d" "$d.moved" && ln -s {victim} "$d" && exit 3; exit 9; fi
echo second attempt ran"#,
        victim = victim.display()
    );
    let o = run_deadline(
        rlaunch()
            .args(["--rdzv-backend", "static", "--rdzv-id", "S", "--nproc-per-node", "1", "--max-restarts", "1"])
            .args(["--hang-timeout", "60", "--log-dir"])
            .arg(&logs)
            .args(["/bin/sh", "-c", &script]),
        DEADLINE,
    );
    assert!(o.status.success(), "the second attempt succeeds: {}", stderr_of(&o));
    assert!(stdout_of(&o).contains("second attempt ran"), "{}", stdout_of(&o));
    let mut in_victim: Vec<String> =
        std::fs::read_dir(&victim).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    in_victim.sort();
    assert_eq!(in_victim, ["precious"], "nothing was made through the symlink");
    assert_eq!(std::fs::read_to_string(victim.join("precious")).unwrap(), "keep me\n");
    let moved: Vec<_> = std::fs::read_dir(&logs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".moved"))
        .collect();
    assert_eq!(moved.len(), 1, "the moved run directory: {moved:?}");
    let second = moved[0].join("attempt_1/0");
    assert!(second.join("stdout.log").is_file(), "the agent kept writing where it made the run directory");
    assert!(second.join("heartbeat").is_file());
    assert!(std::fs::read_to_string(second.join("stdout.log")).unwrap().contains("second attempt ran"));
}

/// An existing `--log-dir` that others may rename entries of is refused before anything runs,
/// when the agent runs as root (it would be root's files they swap).
#[test]
fn a_log_dir_writable_by_others_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    assert_root();
    let dir = tempdir();
    let logs = dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(0o777)).unwrap();
    let o = run_deadline(
        rlaunch()
            .args(["--rdzv-backend", "static", "--rdzv-id", "S", "--nproc-per-node", "1", "--log-dir"])
            .arg(&logs)
            .args(["/bin/sh", "-c", "echo ran"]),
        DEADLINE,
    );
    assert!(!o.status.success());
    assert!(!stdout_of(&o).contains("ran"), "no worker ran");
    assert!(stderr_of(&o).contains("refusing log directory"), "{}", stderr_of(&o));
}

fn exit_code(o: &std::process::Output) -> Option<i32> {
    o.status.code()
}

/// A worker leaves a FIFO where its error file goes and fails: the agent reads it without
/// waiting for a writer (it used to block in `File::open` forever, ignoring SIGTERM) and ends
/// the job with the worker's exit code.
#[test]
fn a_fifo_planted_as_a_workers_error_file_does_not_hang_the_agent() {
    let dir = tempdir();
    let logs = dir.path().join("logs");
    let o = run_deadline(
        rlaunch()
            .args(["--rdzv-backend", "static", "--rdzv-id", "S", "--nproc-per-node", "1", "--log-dir"])
            .arg(&logs)
            .args(["/bin/sh", "-c", r#"mkfifo "$TORCHELASTIC_ERROR_FILE" && exit 7; exit 9"#]),
        Duration::from_secs(30),
    );
    assert_eq!(exit_code(&o), Some(7), "the worker's exit code: {}", stderr_of(&o));
    assert!(stderr_of(&o).contains("no error file written"), "{}", stderr_of(&o));
}

/// A worker's error file that is a symlink to a file the worker could not read is not followed:
/// its text never reaches the root cause (printed, written to the run's error.json, sent to the
/// rendezvous).
#[test]
fn a_symlink_as_a_workers_error_file_does_not_put_its_target_in_the_root_cause() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempdir();
    let logs = dir.path().join("logs");
    let secret = dir.path().join("secret.json");
    std::fs::write(&secret, r#"{"message": "ROOT-ONLY-SECRET-TEXT"}"#).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let script = format!(r#"ln -s {} "$TORCHELASTIC_ERROR_FILE" && exit 5; exit 9"#, secret.display());
    let o = run_deadline(
        rlaunch()
            .args(["--rdzv-backend", "static", "--rdzv-id", "S", "--nproc-per-node", "1", "--log-dir"])
            .arg(&logs)
            .args(["/bin/sh", "-c", &script]),
        DEADLINE,
    );
    assert_eq!(exit_code(&o), Some(5), "the worker's exit code: {}", stderr_of(&o));
    assert!(!stderr_of(&o).contains("ROOT-ONLY-SECRET-TEXT"), "{}", stderr_of(&o));
    let runs: Vec<_> = std::fs::read_dir(&logs).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let report = std::fs::read_to_string(runs[0].join("error.json")).unwrap();
    assert!(!report.contains("ROOT-ONLY-SECRET-TEXT"), "{report}");
    assert!(report.contains("no error file written"), "{report}");
}

fn assert_root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "this test checks what a root agent refuses: run it as root");
}

fn refused(log_dir: &std::path::Path) -> String {
    let o = run_deadline(
        rlaunch()
            .args(["--rdzv-backend", "static", "--rdzv-id", "S", "--nproc-per-node", "1", "--log-dir"])
            .arg(log_dir)
            .args(["/bin/sh", "-c", "echo ran"]),
        DEADLINE,
    );
    assert!(!o.status.success(), "refused: {}", stderr_of(&o));
    assert!(!stdout_of(&o).contains("ran"), "no worker ran");
    assert!(!log_dir.exists(), "nothing was made below the untrusted directory");
    stderr_of(&o)
}

/// As root, `--log-dir /scratch/alice/logs` with `logs` not made yet: the agent must not make
/// it below a directory alice (or a group) may rename entries of.
#[test]
fn an_untrusted_parent_of_a_log_dir_not_made_yet_is_refused_as_root() {
    use std::os::unix::fs::PermissionsExt;
    assert_root();
    let dir = tempdir();
    let alice = dir.path().join("alice");
    std::fs::create_dir(&alice).unwrap();
    std::os::unix::fs::chown(&alice, Some(65534), Some(65534)).unwrap();
    let err = refused(&alice.join("logs/deeper"));
    assert!(err.contains("refusing log directory"), "{err}");
    assert!(err.contains(&format!("{} belongs to uid 65534", alice.display())), "{err}");

    let team = dir.path().join("team");
    std::fs::create_dir(&team).unwrap();
    std::fs::set_permissions(&team, std::fs::Permissions::from_mode(0o2775)).unwrap();
    let err = refused(&team.join("logs"));
    assert!(err.contains("writable by its group"), "{err}");
    assert!(err.contains(&format!("chmod +t {}", team.display())), "{err}");

    // Through a symlink the invoker may not own: the directory it resolves to is judged too.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&alice, &link).unwrap();
    let err = refused(&link.join("logs"));
    assert!(err.contains("belongs to uid 65534"), "{err}");
}

/// A directory user 65534 may enter, holding a copy of rlaunch it can run: the checkout may sit
/// below a directory only root may enter (a clone in a `mktemp -d` folder, 0700).
fn rlaunch_for_nobody() -> (tempfile::TempDir, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    assert_root();
    let dir = tempdir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = dir.path().join("rlaunch");
    std::fs::copy(bin("rlaunch"), &exe).expect("copy rlaunch");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    (dir, exe)
}

/// A non-root agent takes the directories torchrun takes: a setgid team directory (2775) and a
/// Kubernetes emptyDir (0777). Only its own files are at stake there.
#[test]
fn a_non_root_agent_takes_a_group_or_world_writable_log_dir() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let (dir, exe) = rlaunch_for_nobody();
    // The team directory is root's, its group the agent's.
    for (name, mode) in [("team", 0o2775), ("emptydir", 0o777)] {
        let logs = dir.path().join(name);
        std::fs::create_dir(&logs).unwrap();
        std::os::unix::fs::chown(&logs, Some(0), Some(65534)).unwrap();
        std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(mode)).unwrap();
        let o = run_deadline(
            Command::new(&exe)
                .env("RLAUNCH_LOG", "info")
                .uid(65534)
                .gid(65534)
                .env("HOME", dir.path())
                .current_dir(dir.path())
                .args(["--rdzv-backend", "static", "--rdzv-id", "S", "--nproc-per-node", "1", "--log-dir"])
                .arg(&logs)
                .args(["/bin/sh", "-c", "echo ran as $(id -u)"]),
            DEADLINE,
        );
        assert!(o.status.success(), "{name} ({mode:o}) taken: {}", stderr_of(&o));
        assert!(stdout_of(&o).contains("ran as 65534"), "{}", stdout_of(&o));
    }
}

/// Issue 34 (Low): the agent's memory holds its snapshot key's private half and every rank's
/// parts; a worker runs as the agent's user. It could read the agent's memory (ptrace,
/// `/proc/<pid>/mem`) and what `/proc/<pid>/environ` and `maps` say of it. Now the agent is
/// not dumpable: none of that, for any process of its user.
#[test]
fn a_worker_of_the_agents_own_user_cannot_read_the_agents_memory() {
    use std::os::unix::process::CommandExt;
    let (dir, exe) = rlaunch_for_nobody();
    let logs = dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    std::os::unix::fs::chown(&logs, Some(65534), Some(65534)).unwrap();
    // The worker's parent is its agent; each read says "open" or "closed".
    let probe = r#"echo "agent uid $(stat -c %u /proc/$PPID/status) me $(id -u)";
for f in environ maps; do
  if head -c 1 /proc/$PPID/$f >/dev/null 2>&1; then echo "$f open"; else echo "$f closed"; fi
done"#;
    let o = run_deadline(
        Command::new(&exe)
            .uid(65534)
            .gid(65534)
            .env("HOME", dir.path())
            .current_dir(dir.path())
            .args(["--rdzv-backend", "static", "--rdzv-id", "S", "--nproc-per-node", "1", "--log-dir"])
            .arg(&logs)
            .args(["/bin/sh", "-c", probe]),
        DEADLINE,
    );
    let out = stdout_of(&o);
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(out.contains("me 65534"), "{out}");
    for f in ["environ", "maps"] {
        assert!(out.contains(&format!("{f} closed")), "the worker read the agent's {f}:\n{out}");
    }
}

/// A `$TMPDIR` another user may write (a per-user one kept by `sudo -E`, one a scheduler set):
/// a root agent makes none of its runtime directories there (the Python package put first on
/// the workers' `PYTHONPATH`, the snapshot socket, the warm bootstrap, the default logs), so
/// nothing planted or swapped there runs, and the job runs its own program.
#[test]
fn a_tmpdir_others_may_write_holds_nothing_a_root_agent_runs() {
    use std::os::unix::fs::PermissionsExt;
    assert_root();
    let dir = tempdir();
    let hostile = dir.path().join("tmp");
    std::fs::create_dir(&hostile).unwrap();
    std::fs::set_permissions(&hostile, std::fs::Permissions::from_mode(0o777)).unwrap();
    let program = "import os, rlaunch\nprint('program ran', os.path.dirname(rlaunch.__file__), flush=True)\n";
    let o = python_job(dir.path(), &hostile, program, "on");
    assert!(o.status.success(), "{}", stderr_of(&o));
    let out = stdout_of(&o);
    assert!(out.contains("program ran"), "the program itself ran: {out}");
    assert!(!out.contains(&hostile.display().to_string()), "rlaunch came from the hostile $TMPDIR: {out}");
    let made: Vec<String> = std::fs::read_dir(&hostile)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("rlaunch"))
        .collect();
    assert!(made.is_empty(), "runtime directories made in the hostile $TMPDIR: {made:?}");
    assert!(stderr_of(&o).contains("another user could swap them"), "the agent says why: {}", stderr_of(&o));
}

/// A `$TMPDIR` so long that the snapshot socket's path would pass the Unix limit: the store
/// starts in `/tmp` instead, and `import rlaunch` works in the workers.
#[test]
fn a_tmpdir_too_long_for_the_socket_still_gives_workers_snapshots() {
    let dir = tempdir();
    let long = dir.path().join("d".repeat(100));
    std::fs::create_dir(&long).unwrap();
    let program = "import os, rlaunch\nprint('socket', bool(os.environ.get('RLAUNCH_SNAPSHOT')), rlaunch.snapshot.save(1, {'x': 1}), flush=True)\n";
    let o = python_job(dir.path(), &long, program, "off");
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(stdout_of(&o).contains("socket True True"), "{}\n{}", stdout_of(&o), stderr_of(&o));
}

/// Runs `program` (Python source, written to `dir/train.py`) on one worker under `--standalone`
/// with `TMPDIR` set to `tmpdir` and `--warm-workers warm`.
fn python_job(dir: &std::path::Path, tmpdir: &std::path::Path, program: &str, warm: &str) -> std::process::Output {
    let path = dir.join("train.py");
    std::fs::write(&path, program).unwrap();
    run_deadline(
        rlaunch()
            .env("TMPDIR", tmpdir)
            .args(["--standalone", "--nproc-per-node", "1", "--warm-workers", warm, "--no-python"])
            .arg(integration_tests::venv_python())
            .arg(&path),
        DEADLINE,
    )
}

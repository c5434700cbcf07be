//! The run's log directory cannot be swapped under a running agent: whoever renames it and puts
//! a symlink in its place (issue 26, item 1) gets nothing made or truncated where the link
//! points; the agent goes on writing into the directory it made.

use std::time::Duration;

use integration_tests::{rlaunch, run_deadline, stderr_of, stdout_of, tempdir};

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

/// An existing `--log-dir` that others may rename entries of is refused before anything runs.
#[test]
fn a_log_dir_writable_by_others_is_refused() {
    use std::os::unix::fs::PermissionsExt;
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

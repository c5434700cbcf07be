//! What a job leaves on a host cannot be used against it: a symlink planted where the logs go is
//! never followed (default root and `--log-dir`), the default root is private and kept only
//! after a failure, a full log disk leaves the worker running with all its output on the
//! console, and the workers' store listens only where it is advertised.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use integration_tests::{rlaunch, run_deadline, stderr_of, stdout_of, tempdir, worker};

const DEADLINE: Duration = Duration::from_secs(60);

/// Plants, under `parent`, the directory `name` (with `$$` the pid rlaunch will have, since
/// `exec` keeps it) whose `attempt_0/0/stdout.log` is a symlink to `victim`, then runs rlaunch.
fn plant_and_run(parent: &Path, name: &str, victim: &Path, rlaunch_args: &str, tmpdir: &Path) -> std::process::Output {
    let script = format!(
        "d={parent}/{name}; mkdir -p $d/attempt_0/0 && ln -s {victim} $d/attempt_0/0/stdout.log && exec {rlaunch} {rlaunch_args}",
        parent = parent.display(),
        victim = victim.display(),
        rlaunch = integration_tests::bin("rlaunch").display(),
    );
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", &script]).env("TMPDIR", tmpdir).env("RLAUNCH_LOG", "info");
    run_deadline(&mut cmd, DEADLINE)
}

#[test]
fn a_symlink_planted_where_the_logs_go_is_never_followed() {
    let dir = tempdir();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    let w = worker();
    let args =
        format!("--rdzv-backend static --rdzv-id X --nproc-per-node 1 --tee 3 {} print overwritten", w.display());

    // The default root: the old predictable name `$TMPDIR/rlaunch_{run_id}_{pid}`.
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let o = plant_and_run(&tmp, "rlaunch_X_$$", &victim, &args, &tmp);
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert!(stdout_of(&o).contains("overwritten"), "the worker ran: {}", stdout_of(&o));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n", "the symlink was not followed");

    // An explicit --log-dir where `{run_id}_{pid}` was planted: never used; the run's logs go
    // to a new `{run_id}_{pid}_1` beside it.
    let logs = dir.path().join("logs");
    let o = plant_and_run(&logs, "X_$$", &victim, &format!("--log-dir {} {args}", logs.display()), &tmp);
    assert!(o.status.success(), "{}", stderr_of(&o));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    let kept: Vec<String> =
        std::fs::read_dir(&logs).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(kept.iter().any(|n| n.ends_with("_1")), "a new directory beside the planted one: {kept:?}");
}

#[test]
fn the_default_log_root_is_private_kept_after_a_failure_and_removed_after_success() {
    let dir = tempdir();
    let w = worker();
    let mut cmd = rlaunch();
    cmd.env("TMPDIR", dir.path()).args(["--standalone", "--nproc-per-node", "1"]).arg(&w).args(["exit", "5"]);
    let o = run_deadline(&mut cmd, DEADLINE);
    assert_eq!(o.status.code(), Some(5));
    let err = stderr_of(&o);
    let kept = err
        .lines()
        .find_map(|l| l.strip_prefix("rlaunch: the workers' logs are kept in "))
        .unwrap_or_else(|| panic!("the report names the log directory: {err}"));
    let meta = std::fs::symlink_metadata(kept).expect("kept after the failure");
    assert!(meta.is_dir());
    assert_eq!(meta.permissions().mode() & 0o777, 0o700, "private");
    let name = Path::new(kept).file_name().unwrap().to_string_lossy().into_owned();
    let random = name.rsplit('_').next().unwrap();
    assert_eq!(random.len(), 16, "64 unpredictable bits in {name}");

    let mut cmd = rlaunch();
    cmd.env("TMPDIR", dir.path()).args(["--standalone", "--nproc-per-node", "1"]).arg(&w).args(["exit", "0"]);
    let o = run_deadline(&mut cmd, DEADLINE);
    assert!(o.status.success());
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().filter_map(Result::ok).map(|e| e.file_name()).collect();
    assert_eq!(left.len(), 1, "only the failed run's directory is left: {left:?}");
}

/// A tmpfs of 64 KiB mounted for the test, unmounted when dropped.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(at: &Path) -> SmallDisk {
        std::fs::create_dir_all(at).unwrap();
        let o = run_deadline(Command::new("mount").args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"]).arg(at), DEADLINE);
        assert!(o.status.success(), "mounting a tmpfs needs root: {}", stderr_of(&o));
        SmallDisk(at.to_path_buf())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_log_disk_never_stops_a_worker_and_the_console_keeps_every_line() {
    let dir = tempdir();
    let disk = SmallDisk::mount(&dir.path().join("disk"));
    let w = worker();
    let mut cmd = rlaunch();
    // 2,000 lines of ~300 bytes: ten times the disk.
    cmd.args(["--standalone", "--nproc-per-node", "1", "--log-dir"]).arg(&disk.0).arg(&w).args(["spam", "2000"]);
    let o = run_deadline(&mut cmd, DEADLINE);
    let err = stderr_of(&o);
    assert!(o.status.success(), "the worker finished (no SIGPIPE): {}", &err[err.len().saturating_sub(2000)..]);
    let lines = stdout_of(&o).lines().filter(|l| l.starts_with("[default0]:")).count();
    assert_eq!(lines, 2000, "every stdout line reached the console");
    let warnings = err.matches("cannot write the log file any more").count();
    assert!((1..=2).contains(&warnings), "the write error is said once per stream: {warnings}");
}

#[test]
fn the_workers_store_listens_only_on_the_address_it_advertises() {
    let dir = tempdir();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cmd = rlaunch();
    cmd.args(["--rdzv-backend", "rlaunch", "--rdzv-endpoint", &format!("127.0.0.1:{port}"), "--rdzv-id", "bind"])
        .args(["--local-addr", "127.0.0.1", "--nproc-per-node", "1"])
        .arg(worker())
        .arg("--out")
        .arg(dir.path())
        .args(["dump-env", "sleep", "3"]);
    let child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read once it parses whole, not once it exists.
    let env: serde_json::Value = integration_tests::wait_for_file(
        "the worker's environment",
        &dir.path().join("env_rank0_attempt0.json"),
        DEADLINE,
        |s| serde_json::from_str(s).ok(),
    );
    let store_port: u16 = env["MASTER_PORT"].as_str().unwrap().parse().unwrap();
    // /proc/net/tcp: `sl local_address rem_address st …`, addresses as hex `IP:PORT`, 0A = LISTEN.
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap()
        + &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    let listening: Vec<String> = tcp
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (addr, port) = f.get(1)?.split_once(':')?;
            (f.get(3) == Some(&"0A") && u16::from_str_radix(port, 16).ok()? == store_port).then(|| addr.to_owned())
        })
        .collect();
    assert_eq!(listening, ["0100007F"], "the store on port {store_port} listens on 127.0.0.1 only");
    let o = integration_tests::wait_deadline(child, DEADLINE);
    assert!(o.status.success(), "{}", stderr_of(&o));
}

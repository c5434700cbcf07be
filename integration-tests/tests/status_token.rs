//! `rlaunch status` and `rlaunch top` against a rendezvous service that wants a token, given it
//! in a file (`--rdzv-token-file`, which `ps` does not show, unlike `--token`): with the right
//! token both read the finished job; with a wrong token, a missing file, or the file beside
//! `--token`, `rlaunch status` says which and exits non-zero.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{bin, rlaunch, run_deadline, stderr_of, stdout_of, tempdir, worker, KillOnDrop};

const DEADLINE: Duration = Duration::from_secs(60);

#[test]
fn status_and_top_read_the_token_from_a_file_and_a_wrong_one_is_refused() {
    let dir = tempdir();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "status+token/s3cret\n").expect("token file");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let endpoint = format!("127.0.0.1:{port}");
    let service = Command::new(bin("rlaunch-rendezvous"))
        .args(["--listen", &endpoint, "--store", "memory", "--token-file"])
        .arg(&token_file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start rlaunch-rendezvous");
    let _service = KillOnDrop(service);
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(started.elapsed() < Duration::from_secs(10), "the service did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut job = rlaunch();
    job.args(["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "rlaunch", "--rdzv-endpoint", &endpoint])
        .args(["--rdzv-id", "token-job", "--rdzv-conf", "join_timeout=20,last_call_timeout=0.1", "--rdzv-token-file"])
        .arg(&token_file)
        .arg(worker())
        .arg("--out")
        .arg(dir.path())
        .arg("dump-env");
    let o = run_deadline(&mut job, DEADLINE);
    assert_eq!(o.status.code(), Some(0), "{}", stderr_of(&o));

    let ask = |command: &str, file: &Path, more: &[&str]| -> Output {
        let mut cmd = rlaunch();
        cmd.env_remove("RLAUNCH_RDZV_TOKEN")
            .args([command, "--rdzv-endpoint", &endpoint, "--rdzv-id", "token-job"])
            .args(more)
            .arg("--rdzv-token-file")
            .arg(file);
        run_deadline(&mut cmd, DEADLINE)
    };
    let both = |o: &Output| format!("stdout:\n{}\nstderr:\n{}", stdout_of(o), stderr_of(o));

    let o = ask("status", &token_file, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", both(&o));
    assert!(stdout_of(&o).contains("job token-job: finished"), "{}", both(&o));
    let o = ask("top", &token_file, &["--interval", "0.2"]);
    assert_eq!(o.status.code(), Some(0), "a finished job ends top at once: {}", both(&o));
    assert!(stdout_of(&o).contains("job token-job: finished"), "{}", both(&o));

    let wrong = dir.path().join("wrong-token");
    std::fs::write(&wrong, "not-the-token\n").expect("wrong token file");
    // (`top` shows a refusal as `no status: …` and retries, whatever the token came from.)
    let o = ask("status", &wrong, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", both(&o));
    assert!(stderr_of(&o).contains("rlaunch status: missing or wrong bearer token"), "{}", both(&o));
    assert!(!stdout_of(&o).contains("token-job: finished"), "{}", both(&o));

    let missing = dir.path().join("no-such-token");
    let o = ask("status", &missing, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", both(&o));
    let named = format!("rlaunch status: --rdzv-token-file {}: ", missing.display());
    assert!(stderr_of(&o).contains(&named), "{}", both(&o));

    let o = ask("status", &token_file, &["--token", "status+token/s3cret"]);
    assert_eq!(o.status.code(), Some(2), "{}", both(&o));
    assert!(stderr_of(&o).contains("cannot be used with"), "{}", both(&o));
}

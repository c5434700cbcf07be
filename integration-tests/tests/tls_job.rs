//! A job over HTTPS end to end: `rlaunch-rendezvous --tls-cert/--tls-key` with a CA made here,
//! an `rlaunch` agent joining `https://` with `--rdzv-conf tls_ca=` and the token, its worker
//! finishing, `rlaunch status --tls-ca` reading the job; with another CA the agent stops at once,
//! saying the certificate does not verify.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use integration_tests::{bin, rlaunch, run_deadline, stderr_of, stdout_of, tempdir, worker, KillOnDrop};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};

const DEADLINE: Duration = Duration::from_secs(60);

/// A CA's certificate (`NAME-ca.pem`), and a certificate it signed for localhost and 127.0.0.1
/// with its key (`NAME-cert.pem`, `NAME-key.pem`).
fn make_pki(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("CA key")).expect("CA certificate");
    let key = KeyPair::generate().expect("server key");
    let cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .and_then(|p| p.signed_by(&key, &ca))
        .expect("server certificate");
    let paths =
        [dir.join(format!("{name}-ca.pem")), dir.join(format!("{name}-cert.pem")), dir.join(format!("{name}-key.pem"))];
    for (path, pem) in paths.iter().zip([ca.pem(), cert.pem(), key.serialize_pem()]) {
        std::fs::write(path, pem).expect("write PEM");
    }
    let [ca, cert, key] = paths;
    (ca, cert, key)
}

#[test]
fn a_job_runs_over_https_with_a_private_ca_and_another_ca_is_refused_at_once() {
    let dir = tempdir();
    let (ca, cert, key) = make_pki(dir.path(), "good");
    let (other_ca, _, _) = make_pki(dir.path(), "other");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret\n").expect("token file");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let service = Command::new(bin("rlaunch-rendezvous"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--token-file"])
        .arg(&token_file)
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
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
    let endpoint = format!("https://localhost:{port}");
    let job = |id: &str, ca: &Path| {
        let mut cmd = rlaunch();
        cmd.args(["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "rlaunch", "--rdzv-endpoint", &endpoint])
            .args(["--rdzv-id", id, "--rdzv-conf"])
            .arg(format!("join_timeout=20,last_call_timeout=0.1,tls_ca={}", ca.display()))
            .arg("--rdzv-token-file")
            .arg(&token_file)
            .arg(worker())
            .arg("--out")
            .arg(dir.path())
            .arg("dump-env");
        run_deadline(&mut cmd, DEADLINE)
    };

    let o = job("tls-job", &ca);
    assert_eq!(o.status.code(), Some(0), "{}", stderr_of(&o));
    let status = run_deadline(
        rlaunch()
            .args(["status", "--rdzv-endpoint", &endpoint, "--rdzv-id", "tls-job", "--token", "s3cret", "--tls-ca"])
            .arg(&ca),
        DEADLINE,
    );
    assert!(stdout_of(&status).contains("job tls-job: finished"), "{}{}", stdout_of(&status), stderr_of(&status));

    let t = Instant::now();
    let o = job("tls-refused", &other_ca);
    let err = stderr_of(&o);
    assert_ne!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("does not verify") && err.contains(&endpoint), "{err}");
    assert!(t.elapsed() < Duration::from_secs(15), "refused after {:?}: {err}", t.elapsed());
}

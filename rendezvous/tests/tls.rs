//! HTTPS end to end: a CA made here, the service serving TLS (in process and as the
//! `rlaunch-rendezvous` binary), the real client verifying it. The token is accepted over TLS;
//! a certificate from another CA is refused at once with an error that says so.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rlaunch_rendezvous::api::{self, AppState, ServeLimits};
use rlaunch_rendezvous::round::{JobSettings, NodeInfo};
use rlaunch_rendezvous::{Backend, ClientTls, RdzvError, Rendezvous, RendezvousClient};

/// Every await in these tests is bounded by this.
const DEADLINE: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {DEADLINE:?}"),
    }
}

/// A CA (its certificate in `ca.pem`) and a certificate it signed for `localhost` and
/// 127.0.0.1 (`cert.pem`, `key.pem`), all in `dir`.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn make_pki(dir: &Path, name: &str) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("CA key")).expect("CA certificate");
    let params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).expect("server params");
    let key = KeyPair::generate().expect("server key");
    let cert = params.signed_by(&key, &ca).expect("server certificate");
    let pki = Pki {
        ca: dir.join(format!("{name}-ca.pem")),
        cert: dir.join(format!("{name}-cert.pem")),
        key: dir.join(format!("{name}-key.pem")),
    };
    std::fs::write(&pki.ca, ca.pem()).expect("write CA");
    std::fs::write(&pki.cert, cert.pem()).expect("write certificate");
    std::fs::write(&pki.key, key.serialize_pem()).expect("write key");
    pki
}

/// The service over TLS on a loopback port, with token `tok`; stops when the sender drops.
async fn start_tls(pki: &Pki) -> (u16, tokio::sync::oneshot::Sender<()>) {
    let tls = rlaunch_rendezvous::tls::server_config(&pki.cert, &pki.key).expect("server TLS configuration");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("address").port();
    let state = AppState::new(Rendezvous::in_memory(), Some("tok".to_owned()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(api::serve_tls(listener, state, ServeLimits::default(), tls, async move {
        let _ = stopped.await;
    }));
    (port, stop)
}

fn one_node() -> JobSettings {
    JobSettings { min_nodes: 1, max_nodes: 1, join_timeout: Duration::from_secs(10), ..JobSettings::default() }
}

fn node(id: &str) -> NodeInfo {
    NodeInfo {
        node_id: id.into(),
        local_world_size: 1,
        store_addr: format!("{id}:29500").parse().expect("store address"),
        probe_addr: None,
        snapshot_addr: None,
        snapshot_key: None,
        snapshots: Vec::new(),
        fingerprint: None,
    }
}

async fn client(endpoint: String, token: &str, ca: Option<&Path>) -> RendezvousClient {
    let backend =
        Backend::Http { endpoints: vec![endpoint.parse().expect("an endpoint")], token: Some(token.to_owned()) };
    let tls = ClientTls { ca_file: ca.map(Path::to_path_buf) };
    RendezvousClient::connect_with(backend, "tls-job", one_node(), &tls).await.expect("client")
}

#[tokio::test]
async fn a_node_joins_over_https_with_the_token_and_a_private_ca() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = make_pki(dir.path(), "good");
    let (port, _stop) = start_tls(&pki).await;
    for host in ["localhost", "127.0.0.1"] {
        let c = client(format!("https://{host}:{port}"), "tok", Some(&pki.ca)).await;
        let round = within("join over TLS", c.join(node(&format!("n-{host}")))).await;
        let round = round.unwrap_or_else(|e| panic!("join over TLS to {host}: {e}"));
        assert_eq!(round.group_world_size, 1);
        assert_eq!(within("status", c.status()).await.expect("status").round, round.round);
        within("leave", c.leave(&format!("n-{host}"))).await.expect("leave");
    }
    // The token is still checked over TLS.
    let c = client(format!("https://localhost:{port}"), "wrong", Some(&pki.ca)).await;
    assert!(matches!(within("status", c.status()).await, Err(RdzvError::Unauthorized)));
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused_at_once_with_a_clear_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = make_pki(dir.path(), "good");
    let other = make_pki(dir.path(), "other");
    let (port, _stop) = start_tls(&pki).await;
    for ca in [Some(other.ca.as_path()), None] {
        let c = client(format!("https://localhost:{port}"), "tok", ca).await;
        let started = std::time::Instant::now();
        let e = within("a join to a server whose certificate does not verify", c.join(node("n"))).await.unwrap_err();
        assert!(matches!(e, RdzvError::Certificate { .. }), "{e:?}");
        assert!(!e.is_transient(), "a bad certificate is not retried");
        let text = e.to_string();
        assert!(text.contains(&format!("https://localhost:{port}")) && text.contains("does not verify"), "{text}");
        assert!(text.contains("tls_ca"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(5), "refused after {:?}", started.elapsed());
    }
}

#[tokio::test]
async fn a_ca_bundle_that_is_not_pem_is_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bad = dir.path().join("ca.pem");
    std::fs::write(&bad, "garbage").expect("write");
    let backend = Backend::Http { endpoints: vec!["https://localhost:1".parse().expect("an endpoint")], token: None };
    let tls = ClientTls { ca_file: Some(bad.clone()) };
    let e = match RendezvousClient::connect_with(backend, "j", one_node(), &tls).await {
        Err(e) => e,
        Ok(_) => panic!("a CA bundle without a certificate was taken"),
    };
    assert!(matches!(e, RdzvError::Tls(_)), "{e:?}");
    assert!(e.to_string().contains(&bad.display().to_string()), "{e}");
}

/// The binary: `--tls-cert`/`--tls-key` serve HTTPS that the client verifies.
#[tokio::test]
async fn the_service_binary_serves_https_with_tls_cert_and_key() {
    let exe = std::env::current_exe().expect("the test's own path");
    let bin = exe.parent().and_then(|d| d.parent()).expect("target/<profile>").join("rlaunch-rendezvous");
    assert!(bin.exists(), "{} is missing: cargo build -p rlaunch-launcher --bins", bin.display());
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = make_pki(dir.path(), "good");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    let mut child = tokio::process::Command::new(&bin)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--token", "tok", "--tls-cert"])
        .arg(&pki.cert)
        .arg("--tls-key")
        .arg(&pki.key)
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start rlaunch-rendezvous");
    let c = client(format!("https://localhost:{port}"), "tok", Some(&pki.ca)).await;
    let joined = within("join the binary over TLS", async {
        loop {
            match c.join(node("n")).await {
                Err(e) if e.is_transient() => tokio::time::sleep(Duration::from_millis(100)).await,
                other => return other,
            }
        }
    })
    .await;
    let _ = child.kill().await;
    assert_eq!(joined.expect("join over TLS").group_world_size, 1);
    // A key that does not parse: the service does not start, and names the file.
    std::fs::write(&pki.key, "not a key").expect("spoil the key");
    let out = within(
        "the service refusing a bad key",
        tokio::process::Command::new(&bin)
            .args(["--listen", "127.0.0.1:0", "--tls-cert"])
            .arg(&pki.cert)
            .arg("--tls-key")
            .arg(&pki.key)
            .output(),
    )
    .await
    .expect("run rlaunch-rendezvous");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&pki.key.display().to_string()), "{err}");
}

//! TLS for the service and its clients (rustls, aws-lc-rs): the service's certificate chain and
//! key from PEM files, a client's private CA bundle, and which endpoints would carry a token in
//! clear to another host.
//!
//! The token and the nodes' secrets are bearer credentials: over `http://` anyone on the path
//! reads them. `https://` endpoints are verified against the CA bundle given (`tls_ca`), else
//! the system's roots; a certificate that does not verify is an error, never a warning.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rlaunch::contract::Host;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::endpoint::{Endpoint, Scheme};

/// A TLS file that could not be used, naming it.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} {}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the {what} {} is not PEM: {reason}", path.display())]
    Pem { what: &'static str, path: PathBuf, reason: String },
    #[error("the {what} {} holds no {expected}", path.display())]
    Empty { what: &'static str, path: PathBuf, expected: &'static str },
    #[error("the certificate {} and key {} make no TLS server configuration", cert.display(), key.display())]
    Server {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the CA bundle {}: {reason}", path.display())]
    Ca { path: PathBuf, reason: String },
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { what, path: path.to_owned(), source })
}

/// Every certificate in a PEM file, in order.
fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem).collect::<Result<Vec<_>, _>>().map_err(|e| TlsError::Pem {
        what,
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    if certs.is_empty() {
        return Err(TlsError::Empty { what, path: path.to_owned(), expected: "CERTIFICATE block" });
    }
    Ok(certs)
}

/// The service's TLS configuration: the certificate chain in `cert` (PEM, the server's own
/// first) and its private key in `key` (PEM: PKCS#8, PKCS#1 or SEC1). HTTP/1.1 only.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain = certificates("certificate", cert)?;
    let key_pem = read("key", key)?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            TlsError::Empty { what: "key", path: key.to_owned(), expected: "PRIVATE KEY block" }
        }
        e => TlsError::Pem { what: "key", path: key.to_owned(), reason: e.to_string() },
    })?;
    let server_err = |source| TlsError::Server { cert: cert.to_owned(), key: key.to_owned(), source };
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(server_err)?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(server_err)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The roots a client trusts for `https://` endpoints: a private CA bundle (PEM), the only
/// roots then.
pub fn ca_bundle(path: &Path) -> Result<Vec<reqwest::Certificate>, TlsError> {
    let pem = read("CA bundle", path)?;
    // Checked as PEM here so that the error names the file; reqwest parses it again.
    certificates("CA bundle", path)?;
    reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| TlsError::Ca { path: path.to_owned(), reason: e.to_string() })
}

/// Whether `endpoint` is reached in clear at another host: plain HTTP to anything but loopback.
pub fn cleartext_to_another_host(endpoint: &Endpoint) -> bool {
    endpoint.scheme() == Scheme::Http && !loopback(endpoint.host())
}

/// `localhost`, a name under it, or a loopback address.
fn loopback(host: &Host) -> bool {
    let name = host.as_str().to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost") || host.ip().is_some_and(|ip| ip.is_loopback())
}

/// A certificate problem somewhere in `error`'s chain (an unknown issuer, a wrong name, an
/// expired certificate): the TLS peer is not who the endpoint names.
pub fn certificate_error(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    if let Some(tls) = error.downcast_ref::<rustls::Error>() {
        if matches!(tls, rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented) {
            return Some(tls.to_string());
        }
    }
    // tokio-rustls hands rustls's error up inside io::Errors, whose `source` skips what they
    // wrap: look inside.
    let wrapped = error.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref());
    if let Some(found) = wrapped.and_then(|inner| certificate_error(inner)) {
        return Some(found);
    }
    error.source().and_then(certificate_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_to_another_host_is_cleartext_and_loopback_or_https_is_not() {
        for e in ["svc:29400", "http://10.0.0.5:29400", "http://rdzv.cluster:1/", "[fe80::1]:5"] {
            assert!(cleartext_to_another_host(&e.parse().unwrap()), "{e}");
        }
        for e in ["127.0.0.1:29400", "http://localhost:1", "[::1]:29400", "https://svc:29400", "127.3.4.5:9"] {
            assert!(!cleartext_to_another_host(&e.parse().unwrap()), "{e}");
        }
    }

    #[test]
    fn unreadable_or_empty_pem_files_are_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not pem at all\n").expect("write");
        let e = server_config(&empty, &empty).unwrap_err().to_string();
        assert!(e.contains("holds no CERTIFICATE block") && e.contains("empty.pem"), "{e}");
        let e = server_config(&dir.path().join("missing.pem"), &empty).unwrap_err().to_string();
        assert!(e.contains("cannot read the certificate") && e.contains("missing.pem"), "{e}");
        let e = ca_bundle(&empty).unwrap_err().to_string();
        assert!(e.contains("CA bundle") && e.contains("empty.pem"), "{e}");
    }
}

//! The kubelet server's TLS: its serving certificate and the client
//! certificates it accepts, as the kubelet's `--tls-cert-file`,
//! `--tls-private-key-file` and `--client-ca-file`.
//!
//! Without a certificate, the kubelet makes a self-signed one at start for
//! its host name and addresses, written to `<cert-dir>/kubelet.crt` and
//! `kubelet.key` and reused while both files read back; so does this
//! ([`serving_identity`]). Differences: the kubelet signs its certificate
//! with a CA of its own made alongside; here the certificate is its own
//! issuer (the API server does not verify a kubelet's certificate unless
//! given `--kubelet-certificate-authority`, and then it needs a real one);
//! no certificate rotation (`--rotate-server-certificates`).
//!
//! A client certificate is optional at the kubelet server's handshake
//! (bearer tokens and anonymous requests come without one); one that is
//! presented must chain to the client CA, else the handshake fails. The
//! observer's and the proxy's endpoints, which have no other authentication,
//! require one when given a client CA ([`ClientCerts`]).

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// Errors of loading or making the certificates.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Pem { path: PathBuf, message: String },
    #[error("the self-signed serving certificate for {names:?}: {message}")]
    Generate { names: Vec<String>, message: String },
    #[error("tls configuration: {0}")]
    Config(String),
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TlsError {
    let path = path.to_owned();
    move |source| TlsError::Io {
        action,
        path,
        source,
    }
}

/// Where the serving certificate comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServingCert {
    /// `--tls-cert-file` and `--tls-private-key-file`.
    Files { cert: PathBuf, key: PathBuf },
    /// Made at start (or reused) under this directory for these names (host
    /// names and IP addresses).
    SelfSigned { dir: PathBuf, names: Vec<String> },
}

/// The certificate chain and key to serve with: the given files, or the
/// self-signed pair under `dir` (made when missing or unreadable).
pub fn serving_identity(
    source: &ServingCert,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    match source {
        ServingCert::Files { cert, key } => Ok((read_chain(cert)?, read_key(key)?)),
        ServingCert::SelfSigned { dir, names } => {
            let (cert, key) = (dir.join("kubelet.crt"), dir.join("kubelet.key"));
            if let (Ok(c), Ok(k)) = (read_chain(&cert), read_key(&key)) {
                tracing::info!(cert = %cert.display(), "kubelet server: the self-signed certificate reused");
                return Ok((c, k));
            }
            generate(dir, &cert, &key, names)?;
            tracing::info!(cert = %cert.display(), ?names, "kubelet server: a self-signed certificate made");
            Ok((read_chain(&cert)?, read_key(&key)?))
        }
    }
}

fn generate(dir: &Path, cert: &Path, key: &Path, names: &[String]) -> Result<(), TlsError> {
    let failed = |e: rcgen::Error| TlsError::Generate {
        names: names.to_vec(),
        message: e.to_string(),
    };
    let mut params = rcgen::CertificateParams::new(names.to_vec()).map_err(failed)?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    let host = names.first().cloned().unwrap_or_default();
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("{host}@{}", k8s_openapi::jiff::Timestamp::now().as_second()),
    );
    // The kubelet's self-signed certificate is valid for a year.
    let now = std::time::SystemTime::now();
    params.not_before = now.into();
    params.not_after = (now + std::time::Duration::from_secs(365 * 24 * 3600)).into();
    let pair = rcgen::KeyPair::generate().map_err(failed)?;
    let signed = params.self_signed(&pair).map_err(failed)?;
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(io("chmod", dir))?;
    write_file(key, pair.serialize_pem().as_bytes(), 0o600)?;
    write_file(cert, signed.pem().as_bytes(), 0o644)
}

/// Writes `bytes` to `path` through a temporary file renamed in.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io("create", &tmp))?;
    f.write_all(bytes).map_err(io("write", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("rename to", path))
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |message: String| TlsError::Pem {
        path: path.to_owned(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem("no certificate".into()));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// The client certificates a server asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientCerts<'a> {
    /// None asked for.
    Off,
    /// Optional at the handshake (the kubelet server: bearer tokens and
    /// anonymous requests come without one); one presented must chain to
    /// this CA.
    Optional(&'a Path),
    /// Required, chaining to this CA (the observer's and the proxy's
    /// `--http-client-ca-file`: no other authentication there).
    Required(&'a Path),
}

/// The server's TLS configuration: its identity, and the client certificates
/// it verifies.
pub fn server_config(
    source: &ServingCert,
    client: ClientCerts<'_>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let (chain, key) = serving_identity(source)?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client {
        ClientCerts::Optional(path) | ClientCerts::Required(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in read_chain(path)? {
                roots.add(cert).map_err(|e| TlsError::Pem {
                    path: path.to_owned(),
                    message: e.to_string(),
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = match client {
                ClientCerts::Optional(_) => verifier.allow_unauthenticated(),
                _ => verifier,
            };
            let verifier = verifier
                .build()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        ClientCerts::Off => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_self_signed_certificate_is_made_once_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let source = ServingCert::SelfSigned {
            dir: dir.path().join("pki"),
            names: vec!["node-a".into(), "127.0.0.1".into()],
        };
        let (first, _) = serving_identity(&source).unwrap();
        let key = dir.path().join("pki/kubelet.key");
        let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the key is the agent's only");
        let (again, _) = serving_identity(&source).unwrap();
        assert_eq!(first, again, "reused, not made again");
        let (cn, _) = super::super::x509::subject(&first[0]).unwrap();
        assert!(cn.starts_with("node-a@"), "{cn}");
        server_config(&source, ClientCerts::Off).unwrap();
    }

    #[test]
    fn a_missing_client_ca_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let source = ServingCert::SelfSigned {
            dir: dir.path().to_owned(),
            names: vec!["n".into()],
        };
        let missing = dir.path().join("nope.crt");
        let err = server_config(&source, ClientCerts::Required(&missing)).unwrap_err();
        assert!(err.to_string().contains("nope.crt"), "{err}");
    }
}

//! An HTTPS server for the probe and hook tests, in the test process: a
//! self-signed certificate made at start by Debian's `openssl` (installed by
//! `cargo xtask setup`; the key never leaves a temporary directory removed
//! at once), served by tokio-rustls; each request answered with the status
//! `answer` picks for its path, and kept to be read back.

use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A self-signed certificate (naming `probe.test`, never the address it is
/// served at) and its key, made now.
pub fn self_signed() -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    let dir = std::env::temp_dir().join(format!(
        "evpleg-tls-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    ));
    std::fs::create_dir_all(&dir).expect("a temporary directory for the certificate");
    let (key, cert) = (dir.join("key.pem"), dir.join("cert.pem"));
    let out = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=probe.test", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output();
    let read = |p: &std::path::Path| std::fs::read(p).unwrap_or_default();
    let (key_pem, cert_pem) = (read(&key), read(&cert));
    let _ = std::fs::remove_dir_all(&dir);
    let out = out.expect("run openssl (Debian's package, installed by cargo xtask setup)");
    assert!(
        out.status.success(),
        "openssl req: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let certs = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .expect("openssl's certificate");
    let key = PrivateKeyDer::from_pem_slice(&key_pem).expect("its key");
    (certs, key)
}

/// The running server; stopped when dropped.
#[derive(Debug)]
pub struct TlsServer {
    pub port: u16,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsServer {
    /// Serves HTTPS on `127.0.0.1:port` (0: any free port).
    pub async fn start(port: u16, answer: fn(&str) -> u16) -> Self {
        let (certs, key) = self_signed();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("rustls' default protocol versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("the server's certificate");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind the https server");
        let port = listener.local_addr().expect("its address").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, kept) = (acceptor.clone(), kept.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                        match tls.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let path = head.split(' ').nth(1).unwrap_or("/").to_owned();
                    let code = answer(&path);
                    kept.lock().unwrap_or_else(|e| e.into_inner()).push(head);
                    let response = format!(
                        "HTTP/1.1 {code} Answer\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    );
                    let _ = tls.write_all(response.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        TlsServer { port, seen, task }
    }

    /// The heads of the requests it answered, in order.
    pub fn requests(&self) -> Vec<String> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How many requests for `path` it answered.
    pub fn count(&self, path: &str) -> usize {
        let line = format!("GET {path} HTTP/1.1\r\n");
        self.requests()
            .iter()
            .filter(|r| r.starts_with(&line))
            .count()
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

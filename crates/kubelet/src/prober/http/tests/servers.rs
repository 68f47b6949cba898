//! The servers of `prober::http`'s tests, real and in the test: plain
//! (canned answers), TLS with a certificate made now by Debian's `openssl`
//! (canned answers, HTTP/1.1), and TLS choosing HTTP/2 (hyper's server).

use std::sync::Arc;

use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Reads one request's head (up to the blank line, or what came before the
/// peer stopped).
async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> String {
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Writes `answer`, closes the writing side and waits for the peer to close
/// (so no unread byte turns the close into a reset the client would see
/// before the answer).
async fn answer_and_close<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, answer: &str) {
    let _ = s.write_all(answer.as_bytes()).await;
    let _ = s.shutdown().await;
    let mut rest = [0u8; 1024];
    while let Ok(n) = s.read(&mut rest).await {
        if n == 0 {
            break;
        }
    }
}

/// A plain server answering each connection with the next canned response;
/// the requests it read (a TLS ClientHello too: it answers anything).
pub async fn serve(answers: Vec<String>) -> (u16, tokio::task::JoinHandle<Vec<String>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut seen = Vec::new();
        for answer in answers {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = vec![0u8; 4096];
            let n = s.read(&mut req).await.unwrap();
            seen.push(String::from_utf8_lossy(&req[..n]).into_owned());
            answer_and_close(&mut s, &answer).await;
        }
        seen
    });
    (port, task)
}

/// A self-signed certificate and its key, made now by Debian's `openssl`
/// (installed by `cargo xtask setup`).
fn self_signed() -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (key, cert) = (dir.path().join("key.pem"), dir.path().join("cert.pem"));
    let out = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=probe.test", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("run openssl (Debian's package, installed by cargo xtask setup)");
    assert!(
        out.status.success(),
        "openssl req: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let certs = CertificateDer::pem_slice_iter(&std::fs::read(&cert).unwrap())
        .collect::<Result<Vec<_>, _>>()
        .expect("openssl's certificate");
    let key = PrivateKeyDer::from_pem_slice(&std::fs::read(&key).unwrap()).expect("its key");
    (certs, key)
}

/// A TLS server configuration with a [`self_signed`] certificate, choosing
/// among `alpn`.
fn server_config(alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
    let (certs, key) = self_signed();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("the server's certificate");
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// A TLS server (tokio-rustls, a [`self_signed`] certificate, HTTP/1.1 by
/// ALPN if offered) answering each connection with the next canned response;
/// what it saw on each: the request then `alpn: ` and the protocol chosen,
/// or `handshake failed: …`.
pub async fn serve_tls(answers: Vec<String>) -> (u16, tokio::task::JoinHandle<Vec<String>>) {
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(&[b"http/1.1"]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let task = tokio::spawn(async move {
        let mut seen = Vec::new();
        for answer in answers {
            let (s, _) = listener.accept().await.unwrap();
            match acceptor.accept(s).await {
                Ok(mut tls) => {
                    let alpn = tls
                        .get_ref()
                        .1
                        .alpn_protocol()
                        .map(|p| String::from_utf8_lossy(p).into_owned());
                    seen.push(format!("{}alpn: {alpn:?}", read_head(&mut tls).await));
                    answer_and_close(&mut tls, &answer).await;
                }
                Err(e) => seen.push(format!("handshake failed: {e}")),
            }
        }
        seen
    });
    (port, task)
}

/// A TLS server choosing HTTP/2 by ALPN, served by hyper: 500 for `/fail`,
/// else 200; each request's version, URI and user agent.
pub async fn serve_h2_tls() -> (u16, Arc<std::sync::Mutex<Vec<String>>>) {
    let acceptor = tokio_rustls::TlsAcceptor::from(server_config(&[b"h2"]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let Ok(tls) = acceptor.accept(tcp).await else {
                continue;
            };
            let kept = kept.clone();
            let service = hyper::service::service_fn(move |req: hyper::Request<_>| {
                let agent = req
                    .headers()
                    .get(hyper::header::USER_AGENT)
                    .and_then(|a| a.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                kept.lock()
                    .unwrap()
                    .push(format!("{:?} {} {agent}", req.version(), req.uri()));
                let code = if req.uri().path() == "/fail" {
                    500
                } else {
                    200
                };
                async move {
                    hyper::Response::builder()
                        .status(code)
                        .body(http_body_util::Full::new(Bytes::from_static(b"ok")))
                }
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service),
            );
        }
    });
    (port, seen)
}

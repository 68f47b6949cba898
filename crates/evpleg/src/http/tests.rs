//! Attacks on loopback: many idle connections, a slowloris client, a client
//! idle after its response, an oversized head. Timeouts are injected short.

use std::net::SocketAddr;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;

fn router() -> Router {
    Router::new().route("/healthz", axum::routing::get(|| async { "ok\n" }))
}

async fn start(limits: HttpLimits) -> (SocketAddr, CancellationToken) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    tokio::spawn(serve(listener, None, router(), limits, shutdown.clone()));
    (addr, shutdown)
}

/// A GET /healthz on a fresh connection: the response, within 2 s.
async fn get(addr: SocketAddr) -> io::Result<String> {
    within_2s(async { healthz(TcpStream::connect(addr).await?).await }).await
}

/// GET /healthz on `s` (plain or TLS), read to its end.
async fn healthz<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
) -> io::Result<String> {
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

async fn within_2s(f: impl std::future::Future<Output = io::Result<String>>) -> io::Result<String> {
    tokio::time::timeout(Duration::from_secs(2), f)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer within 2 s"))?
}

/// When the server closed `s` (a read gives end of file or an error), at
/// most `bound` from now; `None` when it stayed open.
async fn closed_within(s: &mut TcpStream, bound: Duration) -> Option<Instant> {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(bound, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return Instant::now(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

/// Raises the soft RLIMIT_NOFILE to `want` (or the hard limit); returns it.
fn raise_nofile(want: u64) -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit to fill and then to set.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = want.min(r.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
    r.rlim_cur
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

// 5 000 idle connections (the number scales down only if RLIMIT_NOFILE's
// hard limit is too low, and says so) against a cap of 4 000: the 1 000
// beyond the cap are closed at once, a new client is refused while the cap
// is full, the 4 000 are closed at the header timeout, and then a client is
// served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_capped_and_closed_at_the_header_timeout() {
    let nofile = raise_nofile(12_000);
    let n = 5_000.min((nofile.saturating_sub(500) * 5 / 9) as usize);
    let cap = n * 4 / 5;
    eprintln!("RLIMIT_NOFILE {nofile}: {n} idle connections, cap {cap}");
    // Long enough that opening every connection (under 1 s on a quiet
    // machine, 4.5 s once with clippy and a fuzzer beside it) fits in half.
    let header = Duration::from_secs(10);
    let limits = HttpLimits {
        header_read_timeout: header,
        idle_timeout: Duration::from_secs(60),
        max_connections: cap,
        max_header_bytes: 16 << 10,
    };
    let (addr, _shutdown) = start(limits).await;
    assert_eq!(
        get(addr).await.unwrap().lines().next(),
        Some("HTTP/1.1 200 OK")
    );
    let rss_before = rss_kib();
    let opened = Instant::now();
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(TcpStream::connect(addr).await.unwrap());
    }
    let open_took = opened.elapsed();
    assert!(open_took < header / 2, "opening took {open_took:?}");
    // Each client waits for its close (bounded: header timeout + 2 s).
    let waits: Vec<_> = clients
        .into_iter()
        .map(|mut s| {
            tokio::spawn(
                async move { closed_within(&mut s, header + Duration::from_secs(2)).await },
            )
        })
        .collect();
    // While the cap is full, a new client gets no answer (the listener
    // accepts in order: the cap is full when it comes).
    let refused = get(addr).await.unwrap_or_else(|e| e.to_string());
    let rss_full = rss_kib();
    assert!(
        !refused.contains("200 OK"),
        "served beyond the cap: {refused:?}"
    );
    let mut early = 0;
    let mut at_timeout = 0;
    for w in waits {
        let closed = w.await.unwrap().expect("every connection is closed");
        let after = closed.duration_since(opened);
        if after < header - Duration::from_millis(500) {
            early += 1;
        } else {
            at_timeout += 1;
        }
    }
    assert_eq!((early, at_timeout), (n - cap, cap));
    // The idle ones gone, a client is served again at once.
    let t = Instant::now();
    assert_eq!(
        get(addr).await.unwrap().lines().next(),
        Some("HTTP/1.1 200 OK")
    );
    eprintln!(
        "opened {n} in {open_took:?}; server+clients RSS {rss_before} KiB -> {rss_full} KiB with {cap} held; served after in {:?}",
        t.elapsed()
    );
}

// A slowloris client (one header line every 100 ms, never the end) is closed
// at the header timeout although bytes keep coming; another client is served
// all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_client_is_closed_and_others_are_served() {
    let header = Duration::from_millis(500);
    let limits = HttpLimits {
        header_read_timeout: header,
        idle_timeout: Duration::from_secs(60),
        max_connections: 16,
        max_header_bytes: 16 << 10,
    };
    let (addr, _shutdown) = start(limits).await;
    let slow = tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let started = Instant::now();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        loop {
            tokio::select! {
                r = s.read(&mut buf) => {
                    assert!(matches!(r, Ok(0) | Err(_)), "no answer to an unfinished head: {r:?}");
                    return started.elapsed();
                }
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    if s.write_all(b"X-Slow: 1\r\n").await.is_err() {
                        return started.elapsed();
                    }
                    assert!(started.elapsed() < Duration::from_secs(5), "slowloris never closed");
                }
            }
        }
    });
    let mut served = 0;
    while !slow.is_finished() {
        let t = Instant::now();
        let answer = get(addr).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer:?}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        served += 1;
    }
    let closed_after = slow.await.unwrap();
    assert!(
        closed_after >= header && closed_after < header + Duration::from_secs(1),
        "slowloris closed after {closed_after:?}"
    );
    assert!(served > 0);
}

// A keep-alive client idle after its response is closed at the header
// timeout; a client that stops reading mid-request is closed at the idle
// timeout; an oversized head is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_and_oversized_heads_are_closed() {
    let header = Duration::from_millis(400);
    let limits = HttpLimits {
        header_read_timeout: header,
        idle_timeout: Duration::from_secs(60),
        max_connections: 16,
        max_header_bytes: 16 << 10,
    };
    let (addr, _shutdown) = start(limits).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200 OK"));
    let answered = Instant::now();
    let closed = closed_within(&mut s, Duration::from_secs(3))
        .await
        .expect("closed");
    let after = closed.duration_since(answered);
    assert!(
        after >= header - Duration::from_millis(50) && after < header + Duration::from_secs(1),
        "{after:?}"
    );
    // 100 KiB of headers against 16 KiB.
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n".to_vec();
    for i in 0..2_000 {
        head.extend_from_slice(format!("X-Pad-{i}: {}\r\n", "a".repeat(40)).as_bytes());
    }
    head.extend_from_slice(b"\r\n");
    let _ = s.write_all(&head).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await;
    let out = String::from_utf8_lossy(&out);
    assert!(
        !out.contains("200 OK"),
        "an oversized head was served: {out:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_io_with_no_progress_times_out() {
    let (a, _b) = tokio::io::duplex(64);
    let mut io = IdleIo::new(a, Duration::from_secs(5));
    let mut buf = [0u8; 8];
    let t = tokio::time::Instant::now();
    let err = io.read(&mut buf).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    assert_eq!(t.elapsed(), Duration::from_secs(5));
}

/// A CA of the test's: its certificate (PEM) and issuer.
fn ca(name: &str) -> (String, rcgen::Issuer<'static, rcgen::KeyPair>) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    let key = rcgen::KeyPair::generate().unwrap();
    let pem = params.self_signed(&key).unwrap().pem();
    (pem, rcgen::Issuer::new(params, key))
}

/// A leaf certificate for `names` signed by `issuer`: (certificate PEM, key PEM).
fn leaf(names: &[&str], issuer: &rcgen::Issuer<'_, rcgen::KeyPair>) -> (String, String) {
    let params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A GET /healthz over TLS trusting `ca`, with the client certificate
/// `client` (certificate and key PEM) if any: the response, or the error of
/// the handshake or of the exchange, within 2 s.
async fn get_tls(
    addr: SocketAddr,
    ca: &str,
    client: Option<&(String, String)>,
) -> io::Result<String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.as_bytes()).unwrap())
        .unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    within_2s(async {
        let tcp = TcpStream::connect(addr).await?;
        let name = ServerName::try_from("127.0.0.1").unwrap();
        healthz(connector.connect(name, tcp).await?).await
    })
    .await
}

/// The observer's and the proxy's endpoints beyond loopback (issue #24 item
/// 4): with a client CA, only a client holding a certificate it signed is
/// answered; plain HTTP, no certificate, or one of another CA get nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_its_certificates_are_answered() {
    use crate::config::HttpTlsArgs;
    let dir = tempfile::tempdir().unwrap();
    let (ca_pem, issuer) = ca("endpoints-ca");
    let (server_cert, server_key) = leaf(&["127.0.0.1"], &issuer);
    let client = leaf(&["scraper"], &issuer);
    let (_, stranger_issuer) = ca("another-ca");
    let stranger = leaf(&["scraper"], &stranger_issuer);
    let write = |name: &str, pem: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    let args = HttpTlsArgs {
        http_tls_cert_file: Some(write("server.crt", &server_cert)),
        http_tls_private_key_file: Some(write("server.key", &server_key)),
        http_client_ca_file: Some(write("ca.crt", &ca_pem)),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tls = args.server_config(addr).unwrap();
    assert!(tls.is_some(), "a certificate given: https");
    let shutdown = CancellationToken::new();
    tokio::spawn(serve(
        listener,
        tls,
        router(),
        HttpLimits::default(),
        shutdown.clone(),
    ));

    let answered = get_tls(addr, &ca_pem, Some(&client)).await.unwrap();
    assert!(
        answered.starts_with("HTTP/1.1 200") && answered.ends_with("ok\n"),
        "{answered}"
    );
    let plain = get(addr).await.unwrap_or_default();
    assert!(!plain.contains("ok\n"), "plain http answered: {plain}");
    for (what, cert) in [("no certificate", None), ("another CA's", Some(&stranger))] {
        let got = get_tls(addr, &ca_pem, cert).await;
        assert!(
            got.as_ref().is_err() || !got.as_ref().unwrap().contains("ok\n"),
            "{what}: {got:?}"
        );
    }
    // Still serving the right client after the refusals.
    let again = get_tls(addr, &ca_pem, Some(&client)).await.unwrap();
    assert!(again.ends_with("ok\n"), "{again}");
    shutdown.cancel();
}

/// A client CA without a serving certificate, or a key without its
/// certificate, is refused by the parser naming the missing flag; a
/// certificate file that is not one is an error naming it.
#[test]
fn tls_flags_come_together_and_bad_files_are_named() {
    use clap::Parser;
    let err = crate::config::Cli::try_parse_from([
        "evpleg",
        "observe",
        "--http-client-ca-file",
        "/ca.crt",
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("--http-tls-cert-file"), "{err}");
    let err = crate::config::Cli::try_parse_from([
        "evpleg",
        "cri-proxy",
        "--http-tls-private-key-file",
        "/k.pem",
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("--http-tls-cert-file"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.crt");
    std::fs::write(&junk, "not a certificate").unwrap();
    let args = crate::config::HttpTlsArgs {
        http_tls_cert_file: Some(junk.clone()),
        http_tls_private_key_file: Some(junk.clone()),
        http_client_ca_file: None,
    };
    let err = args
        .server_config("127.0.0.1:1".parse().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("junk.crt"), "{err}");
}

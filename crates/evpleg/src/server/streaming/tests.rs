use super::*;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[test]
fn stream_options_are_the_kubelet_s() {
    let o = |q: &str| stream_options(Some(q));
    assert_eq!(
        o("input=1&output=1&error=1").unwrap(),
        StreamOptions {
            stdin: true,
            stdout: true,
            stderr: true,
            tty: false
        }
    );
    // A TTY has no stderr.
    assert_eq!(
        o("output=1&error=1&tty=1").unwrap(),
        StreamOptions {
            stdin: false,
            stdout: true,
            stderr: false,
            tty: true
        }
    );
    // Only "1" is on; the first value counts.
    assert_eq!(
        o("output=true&error=1&input=0").unwrap(),
        StreamOptions {
            stderr: true,
            ..StreamOptions::default()
        }
    );
    assert!(o("output=1&output=0").unwrap().stdout);
    for q in [
        "",
        "output=true",
        "tty=1&error=1",
        "input=0&output=0",
        "stdout=1",
    ] {
        let e = o(q).unwrap_err();
        assert_eq!(
            (e.code(), e.to_string().as_str()),
            (
                StatusCode::BAD_REQUEST,
                "you must specify at least 1 of stdin, stdout, stderr"
            ),
            "{q}"
        );
    }
    assert!(stream_options(None).is_err());
}

#[test]
fn commands_are_read_as_the_kubelet_reads_them() {
    assert_eq!(
        exec_command(Some("command=sh&command=-c&command=echo%20a%20b&output=1")),
        ["sh", "-c", "echo a b"]
    );
    assert!(exec_command(Some("output=1")).is_empty());
    // /run splits its one cmd at every space.
    assert_eq!(run_command(Some("cmd=echo+a++b")), ["echo", "a", "", "b"]);
    assert_eq!(run_command(None), [""]);
}

#[test]
fn ports_are_read_only_for_websockets() {
    assert_eq!(
        forward_ports(Some("port=x"), false).unwrap(),
        Vec::<i32>::new()
    );
    assert_eq!(
        forward_ports(Some("port=80,8080&port=443"), true).unwrap(),
        [80, 8080, 443]
    );
    let err = |q| forward_ports(Some(q), true).unwrap_err();
    assert_eq!(err("").to_string(), r#"query parameter "port" is required"#);
    assert_eq!(
        err("port=").to_string(),
        r#"query parameter "port" cannot be empty"#
    );
    assert_eq!(
        err("port=80,x").to_string(),
        r#"unable to parse "80,x" as a port: invalid digit found in string"#
    );
    assert_eq!(
        err("port=65536").to_string(),
        r#"unable to parse "65536" as a port: number too large to fit in target type"#
    );
    assert_eq!(err("port=0").to_string(), r#"port "0" must be > 0"#);
    assert_eq!(err("port=0").code(), StatusCode::BAD_REQUEST);
}

#[test]
fn errors_answer_with_the_kubelet_s_codes() {
    let cri = |code| {
        StreamingError::Cri(CriError::from_status(
            "Exec",
            evpleg_cri::Target::Container("c1".into()),
            &tonic::Status::new(code, "m"),
        ))
    };
    assert_eq!(StreamingError::NoPod.code(), StatusCode::NOT_FOUND);
    assert_eq!(StreamingError::OtherUid.code(), StatusCode::NOT_FOUND);
    assert_eq!(
        StreamingError::NoContainer("x".into()).to_string(),
        r#"container not found ("x")"#
    );
    assert_eq!(
        StreamingError::NoContainer("x".into()).code(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(cri(tonic::Code::NotFound).code(), StatusCode::NOT_FOUND);
    let busy = cri(tonic::Code::ResourceExhausted).response();
    assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(busy.headers()[header::RETRY_AFTER], "60");
    assert_eq!(
        cri(tonic::Code::Internal).code(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        StreamingError::Exited {
            command: "sh -c exit 3".into(),
            code: 3,
            stderr: "no".into()
        }
        .to_string(),
        "command 'sh -c exit 3' exited with 3: no"
    );
}

#[test]
fn upgrades_are_recognised_by_their_connection_header() {
    let h = |pairs: &[(&'static str, &'static str)]| {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append(*k, header::HeaderValue::from_static(v));
        }
        m
    };
    assert!(is_upgrade(&h(&[("connection", "Upgrade")])));
    assert!(is_upgrade(&h(&[("connection", "keep-alive, upgrade")])));
    assert!(is_upgrade(&h(&[
        ("connection", "keep-alive"),
        ("connection", "UPGRADE")
    ])));
    assert!(!is_upgrade(&h(&[("connection", "keep-alive")])));
    assert!(!is_upgrade(&h(&[("upgrade", "SPDY/3.1")])));
    assert!(is_websocket(&h(&[
        ("connection", "Upgrade"),
        ("upgrade", "websocket")
    ])));
    assert!(!is_websocket(&h(&[
        ("connection", "Upgrade"),
        ("upgrade", "SPDY/3.1")
    ])));
}

/// A streaming server: `/up` switches protocols and then echoes every
/// byte in upper case; `/refuse` answers 404 with a body; anything else
/// 200. Each request's head goes to `heads`.
async fn fake_runtime(heads: tokio::sync::mpsc::UnboundedSender<String>) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let heads = heads.clone();
            tokio::spawn(async move {
                let head = read_head(&mut conn).await;
                let path = head.split(' ').nth(1).unwrap_or_default().to_owned();
                heads.send(head).unwrap();
                match path.as_str() {
                    "/up?token=1" => {
                        conn.write_all(
                            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n\
                              Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n",
                        )
                        .await
                        .unwrap();
                        let mut buf = [0u8; 1024];
                        loop {
                            match conn.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    let up = buf[..n].to_ascii_uppercase();
                                    if conn.write_all(&up).await.is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                    }
                    "/refuse" => {
                        conn.write_all(
                            b"HTTP/1.1 404 Not Found\r\nContent-Length: 7\r\n\r\nno such",
                        )
                        .await
                        .unwrap();
                    }
                    _ => {
                        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                            .await
                            .unwrap();
                    }
                }
            });
        }
    });
    addr
}

/// Reads an HTTP head (to the blank line), byte by byte.
async fn read_head(conn: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut b))
            .await
            .expect("a head within 10 s")
            .expect("read");
        assert_eq!(
            n,
            1,
            "closed within the head: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(b[0]);
    }
    String::from_utf8(head).unwrap()
}

/// The proxy alone, served on loopback: `/to/<path>` goes to the fake
/// runtime's `<path>`.
async fn proxy_server(
    runtime: std::net::SocketAddr,
    streams: Arc<Streams>,
) -> std::net::SocketAddr {
    proxy_server_within(runtime, streams, crate::http::HttpLimits::default()).await
}

/// [`proxy_server`] with the listener's bounds `limits`.
async fn proxy_server_within(
    runtime: std::net::SocketAddr,
    streams: Arc<Streams>,
    limits: crate::http::HttpLimits,
) -> std::net::SocketAddr {
    let app = Router::new().route(
        "/to/{target}",
        axum::routing::any(
            move |Path(target): Path<String>, RawQuery(q): RawQuery, req: Request| {
                let streams = streams.clone();
                async move {
                    let q = q.map(|q| format!("?{q}")).unwrap_or_default();
                    proxy(&streams, &format!("http://{runtime}/{target}{q}"), req).await
                }
            },
        ),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(crate::http::serve(
        listener,
        None,
        app,
        limits,
        CancellationToken::new(),
    ));
    addr
}

/// Sends `head` on a new connection to `addr`: the connection and the
/// answer's head.
async fn ask(addr: std::net::SocketAddr, head: &str) -> (TcpStream, String) {
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(head.as_bytes()).await.unwrap();
    let answer = read_head(&mut conn).await;
    (conn, answer)
}

async fn wait_closed(streams: &Streams) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while streams.open() != 0 {
        assert!(Instant::now() < deadline, "the session outlived its client");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

const UPGRADE: &str =
    "Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n";

#[tokio::test]
async fn an_upgrade_is_proxied_both_ways_and_uncounted_when_the_client_goes() {
    let (heads_tx, mut heads) = tokio::sync::mpsc::unbounded_channel();
    let runtime = fake_runtime(heads_tx).await;
    let streams = Arc::new(Streams::new(CancellationToken::new()));
    let addr = proxy_server(runtime, streams.clone()).await;
    let (mut conn, answer) = ask(
        addr,
        &format!(
            "POST /to/up?token=1 HTTP/1.1\r\nHost: node:10250\r\nAuthorization: Bearer secret\r\n{UPGRADE}\r\n"
        ),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 101 "), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("x-stream-protocol-version: v4.channel.k8s.io"),
        "{answer}"
    );
    // The runtime got the request line and headers, not the credentials.
    let head = heads.recv().await.unwrap();
    assert!(head.starts_with("POST /up?token=1 HTTP/1.1\r\n"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("host: node:10250\r\n"), "{head}");
    assert!(lower.contains("upgrade: spdy/3.1\r\n"), "{head}");
    assert!(!lower.contains("authorization"), "{head}");
    assert_eq!(streams.open(), 1);
    for word in ["hello", "again"] {
        conn.write_all(word.as_bytes()).await.unwrap();
        let mut back = [0u8; 5];
        tokio::time::timeout(Duration::from_secs(10), conn.read_exact(&mut back))
            .await
            .expect("the echo within 10 s")
            .unwrap();
        assert_eq!(&back, word.to_ascii_uppercase().as_bytes());
    }
    drop(conn);
    wait_closed(&streams).await;
}

/// An interactive session may sit idle far longer than the listener's idle
/// bound (a shell waiting for its user): once upgraded, the bound is lifted.
/// Here the bound is 200 ms and the session idles 1 s (without the lift
/// the copy's read fails at 200 ms and the session closes).
#[tokio::test]
async fn an_upgraded_session_outlives_the_listener_s_idle_bound() {
    let (heads_tx, _heads) = tokio::sync::mpsc::unbounded_channel();
    let runtime = fake_runtime(heads_tx).await;
    let streams = Arc::new(Streams::new(CancellationToken::new()));
    let limits = crate::http::HttpLimits {
        idle_timeout: Duration::from_millis(200),
        ..crate::http::HttpLimits::default()
    };
    let addr = proxy_server_within(runtime, streams.clone(), limits).await;
    let (mut conn, answer) = ask(
        addr,
        &format!("POST /to/up?token=1 HTTP/1.1\r\nHost: node:10250\r\n{UPGRADE}\r\n"),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 101 "), "{answer}");
    // Idle for five times the bound: this wait is what is tested.
    tokio::time::sleep(Duration::from_secs(1)).await;
    conn.write_all(b"still").await.unwrap();
    let mut back = [0u8; 5];
    tokio::time::timeout(Duration::from_secs(10), conn.read_exact(&mut back))
        .await
        .expect("the echo within 10 s")
        .expect("the session is still open after idling past the bound");
    assert_eq!(&back, b"STILL");
}

#[tokio::test]
async fn an_upgrade_ends_when_the_runtime_side_ends_or_the_agent_stops() {
    let (heads_tx, _heads) = tokio::sync::mpsc::unbounded_channel();
    let runtime = fake_runtime(heads_tx).await;
    let stop = CancellationToken::new();
    let streams = Arc::new(Streams::new(stop.clone()));
    let addr = proxy_server(runtime, streams.clone()).await;
    let head = format!("GET /to/up?token=1 HTTP/1.1\r\nHost: n\r\n{UPGRADE}\r\n");
    let (mut a, _) = ask(addr, &head).await;
    let (_b, _) = ask(addr, &head).await;
    assert_eq!(streams.open(), 2);
    stop.cancel();
    wait_closed(&streams).await;
    // The client sees its connection closed.
    let mut buf = [0u8; 8];
    let n = tokio::time::timeout(Duration::from_secs(10), a.read(&mut buf))
        .await
        .expect("closed within 10 s")
        .unwrap_or(0);
    assert_eq!(n, 0);
}

#[tokio::test]
async fn what_the_runtime_refuses_and_what_is_no_upgrade_are_answered() {
    let (heads_tx, _heads) = tokio::sync::mpsc::unbounded_channel();
    let runtime = fake_runtime(heads_tx).await;
    let streams = Arc::new(Streams::new(CancellationToken::new()));
    let addr = proxy_server(runtime, streams.clone()).await;
    // The runtime's refusal, as it is.
    let (mut conn, answer) = ask(
        addr,
        &format!("POST /to/refuse HTTP/1.1\r\nHost: n\r\n{UPGRADE}\r\n"),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 404 "), "{answer}");
    let mut body = [0u8; 7];
    conn.read_exact(&mut body).await.unwrap();
    assert_eq!(&body, b"no such");
    // A runtime that does not switch protocols.
    let (_, answer) = ask(
        addr,
        &format!("POST /to/other HTTP/1.1\r\nHost: n\r\n{UPGRADE}\r\n"),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 500 "), "{answer}");
    // No upgrade asked: the kubelet's 500, and the runtime is not called.
    let resp = proxy(
        &streams,
        "http://127.0.0.1:1/up",
        Request::post("/exec/a/b/c").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(&body[..], b"Upgrade request required\n");
    // A runtime that cannot be reached.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut req = Request::post("/exec/a/b/c").body(Body::empty()).unwrap();
    req.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("Upgrade"),
    );
    let resp = proxy(&streams, &format!("http://127.0.0.1:{port}/x"), req).await;
    assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(streams.open(), 0);
}

//! `prober::http`'s tests: the decisions table-style, then the requests
//! against real servers in the test (plain http, and TLS with a certificate
//! made now by Debian's `openssl`; [`servers`]).

mod servers;

use servers::{serve, serve_h2_tls, serve_tls};

use crate::prober::http::*;

fn at(host: &str, port: u16, path: &str) -> Target {
    Target {
        scheme: Scheme::Http,
        host: host.into(),
        port,
        path: path.into(),
    }
}

fn tls_at(host: &str, port: u16, path: &str) -> Target {
    Target {
        scheme: Scheme::Https,
        ..at(host, port, path)
    }
}

#[test]
fn verdicts_as_the_kubelet() {
    assert_eq!(verdict(200, "ok"), Outcome::Success);
    assert_eq!(verdict(204, ""), Outcome::Success);
    assert_eq!(
        verdict(302, "moved"),
        Outcome::Warning("Probe terminated redirects, Response body: moved".into())
    );
    assert_eq!(
        verdict(304, ""),
        Outcome::Warning("Probe terminated redirects, Response body: ".into())
    );
    assert_eq!(
        verdict(500, "secret"),
        Outcome::Failure("HTTP probe failed with statuscode: 500".into())
    );
    assert_eq!(
        verdict(199, ""),
        Outcome::Failure("HTTP probe failed with statuscode: 199".into())
    );
}

#[test]
fn schemes_and_urls() {
    assert_eq!(Scheme::parse(None), Scheme::Http);
    assert_eq!(Scheme::parse(Some("")), Scheme::Http);
    assert_eq!(Scheme::parse(Some("HTTP")), Scheme::Http);
    assert_eq!(Scheme::parse(Some("HTTPS")), Scheme::Https);
    assert_eq!(
        Scheme::parse(Some("Ftp")),
        Scheme::Unsupported("ftp".into())
    );
    assert_eq!(
        tls_at("10.0.0.1", 8443, "/h").url(),
        "https://10.0.0.1:8443/h"
    );
    assert_eq!(at("fd00::1", 80, "/").url(), "http://[fd00::1]:80/");
}

#[test]
fn redirects_are_followed_on_the_same_host_only() {
    let from = at("10.0.0.1", 8080, "/a/b?x=1");
    let from_tls = tls_at("10.0.0.1", 8443, "/a");
    type Case<'a> = (
        &'a Target,
        u16,
        Option<&'a str>,
        usize,
        Result<Option<Target>, String>,
    );
    let cases: &[Case] = &[
        (&from, 200, Some("/x"), 0, Ok(None)),
        // 300 and 304 are not redirects Go follows.
        (&from, 300, Some("/x"), 0, Ok(None)),
        (&from, 304, Some("/x"), 0, Ok(None)),
        (&from, 302, None, 0, Ok(None)),
        (
            &from,
            302,
            Some("/healthz"),
            0,
            Ok(Some(at("10.0.0.1", 8080, "/healthz"))),
        ),
        (
            &from,
            307,
            Some("c"),
            0,
            Ok(Some(at("10.0.0.1", 8080, "/a/c"))),
        ),
        (
            &from,
            301,
            Some("http://10.0.0.1:9090/y?z"),
            3,
            Ok(Some(at("10.0.0.1", 9090, "/y?z"))),
        ),
        (
            &from,
            308,
            Some("http://10.0.0.1"),
            0,
            Ok(Some(at("10.0.0.1", 80, "/"))),
        ),
        // To https on the same host: followed, on 443 unless named.
        (
            &from,
            302,
            Some("https://10.0.0.1/"),
            0,
            Ok(Some(tls_at("10.0.0.1", 443, "/"))),
        ),
        (
            &from,
            302,
            Some("HTTPS://10.0.0.1:8443/s"),
            0,
            Ok(Some(tls_at("10.0.0.1", 8443, "/s"))),
        ),
        // From https: a path stays on https, a scheme-relative one too; back
        // to http on the same host is followed.
        (
            &from_tls,
            302,
            Some("/b"),
            0,
            Ok(Some(tls_at("10.0.0.1", 8443, "/b"))),
        ),
        (
            &from_tls,
            302,
            Some("//10.0.0.1/c"),
            0,
            Ok(Some(tls_at("10.0.0.1", 443, "/c"))),
        ),
        (
            &from_tls,
            302,
            Some("http://10.0.0.1:8080/d"),
            0,
            Ok(Some(at("10.0.0.1", 8080, "/d"))),
        ),
        // Another scheme on the same host: followed, and the request fails.
        (
            &from,
            302,
            Some("ftp://10.0.0.1/f"),
            0,
            Ok(Some(Target {
                scheme: Scheme::Unsupported("ftp".into()),
                ..at("10.0.0.1", 80, "/f")
            })),
        ),
        // Another host: the 3xx is the probe's response.
        (&from, 302, Some("http://example.com/"), 0, Ok(None)),
        (&from, 302, Some("//example.com:8080/"), 0, Ok(None)),
        (&from, 303, Some("https://other/"), 0, Ok(None)),
        (
            &from,
            302,
            Some("/again"),
            10,
            Err("Get \"http://10.0.0.1:8080/again\": stopped after 10 redirects".into()),
        ),
    ];
    for (from, code, location, followed, want) in cases {
        assert_eq!(
            &next_hop(from, *code, *location, *followed),
            want,
            "{} {code} {location:?} after {followed}",
            from.url()
        );
    }
}

#[test]
fn a_hook_falls_back_to_http_only_on_a_plain_http_answer() {
    let start = tls_at("10.0.0.1", 8443, "/hook");
    let headers = vec![
        ("Authorization".to_owned(), "Bearer t".to_owned()),
        ("X-Hook".to_owned(), "yes".to_owned()),
        ("authorization".to_owned(), "again".to_owned()),
    ];
    let plain = GetError::PlainHttp { url: start.url() };
    let other = GetError::Failed("Get \"https://10.0.0.1:8443/hook\": dial tcp".into());
    type Case<'a> = (&'a GetError, Option<(Target, Vec<(String, String)>)>);
    let cases: &[Case] = &[
        (
            &plain,
            Some((
                at("10.0.0.1", 8443, "/hook"),
                vec![("X-Hook".to_owned(), "yes".to_owned())],
            )),
        ),
        (&other, None),
    ];
    for (error, want) in cases {
        assert_eq!(&hook_fallback(&start, &headers, error), want, "{error}");
    }
    assert_eq!(
        plain.to_string(),
        "Get \"https://10.0.0.1:8443/hook\": http: server gave HTTP response to HTTPS client"
    );
}

#[tokio::test]
async fn a_probe_follows_local_redirects_and_warns_on_a_foreign_one() {
    let big = "x".repeat(MAX_BODY + 100);
    let (port, server) = serve(vec![
        "HTTP/1.1 302 Found\r\nLocation: /next\r\nContent-Length: 0\r\n\r\n".into(),
        "HTTP/1.1 302 Found\r\nLocation: http://elsewhere.invalid/\r\nContent-Length: 5\r\n\r\nmoved"
            .into(),
        format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{big}", big.len()),
        "HTTP/1.1 503 Unavailable\r\nContent-Length: 6\r\n\r\nsecret".into(),
    ])
    .await;
    let headers = [("X-Probe".to_owned(), "yes".to_owned())];
    let start = at("127.0.0.1", port, "/healthz");
    assert_eq!(
        probe(start.clone(), &headers).await,
        Outcome::Warning("Probe terminated redirects, Response body: moved".into())
    );
    assert_eq!(probe(start.clone(), &headers).await, Outcome::Success);
    assert_eq!(
        probe(start, &headers).await,
        Outcome::Failure("HTTP probe failed with statuscode: 503".into())
    );
    let seen = server.await.unwrap();
    assert!(seen[0].starts_with("GET /healthz HTTP/1.1\r\n"), "{seen:?}");
    assert!(seen[1].starts_with("GET /next HTTP/1.1\r\n"), "{seen:?}");
    for req in &seen {
        let req = req.to_ascii_lowercase();
        assert!(req.contains("x-probe: yes\r\n"), "{req}");
        assert!(req.contains("user-agent: kube-probe/"), "{req}");
        assert!(req.contains("accept: */*\r\n"), "{req}");
    }
}

#[tokio::test]
async fn a_refused_connection_is_a_failure_naming_the_url() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    for target in [at("127.0.0.1", port, "/"), tls_at("127.0.0.1", port, "/")] {
        match probe(target.clone(), &[]).await {
            Outcome::Failure(m) => assert!(
                m.starts_with(&format!(
                    "Get \"{}\": dial tcp 127.0.0.1:{port}: ",
                    target.url()
                )),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        probe(
            Target {
                scheme: Scheme::Unsupported("ftp".into()),
                ..at("127.0.0.1", port, "/")
            },
            &[]
        )
        .await,
        Outcome::Failure(format!(
            "Get \"ftp://127.0.0.1:{port}/\": unsupported protocol scheme \"ftp\""
        ))
    );
}

// HTTPS as the kubelet's: any certificate (here self-signed, naming another
// host) is accepted; 200 succeeds, 500 fails with the kubelet's message; the
// request is the kubelet's (Host, User-Agent, Accept, the probe's headers,
// an empty Accept removed).
#[tokio::test]
async fn an_https_probe_speaks_tls_and_accepts_any_certificate() {
    let (port, server) = serve_tls(vec![
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".into(),
        "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 6\r\n\r\nsecret".into(),
    ])
    .await;
    let headers = [
        ("X-Probe".to_owned(), "tls".to_owned()),
        ("Accept".to_owned(), String::new()),
    ];
    let start = tls_at("127.0.0.1", port, "/healthz");
    assert_eq!(probe(start.clone(), &headers).await, Outcome::Success);
    assert_eq!(
        probe(start, &headers).await,
        Outcome::Failure("HTTP probe failed with statuscode: 500".into())
    );
    let seen = server.await.unwrap();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for req in &seen {
        assert!(req.starts_with("GET /healthz HTTP/1.1\r\n"), "{seen:?}");
        let req = req.to_ascii_lowercase();
        assert!(
            req.contains(&format!("host: 127.0.0.1:{port}\r\n")),
            "{req}"
        );
        assert!(req.contains("x-probe: tls\r\n"), "{req}");
        assert!(req.contains("user-agent: kube-probe/evpleg-"), "{req}");
        assert!(!req.contains("accept:"), "{req}");
        // A probe offers h2 then http/1.1; this server took http/1.1.
        assert!(req.ends_with("alpn: some(\"http/1.1\")"), "{req}");
    }
}

// A server that chooses HTTP/2 by ALPN gets the probe in HTTP/2, as the
// kubelet's probe transport sends it.
#[tokio::test]
async fn an_https_probe_speaks_http2_when_the_server_chooses_it() {
    let (port, seen) = serve_h2_tls().await;
    assert_eq!(
        probe(tls_at("127.0.0.1", port, "/healthz"), &[]).await,
        Outcome::Success
    );
    assert_eq!(
        probe(tls_at("127.0.0.1", port, "/fail"), &[]).await,
        Outcome::Failure("HTTP probe failed with statuscode: 500".into())
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen[0].starts_with(&format!(
            "HTTP/2.0 https://127.0.0.1:{port}/healthz kube-probe/evpleg-"
        )),
        "{seen:?}"
    );
    assert!(seen[1].starts_with("HTTP/2.0 "), "{seen:?}");
}

// The wrong scheme either way fails: plain http against the TLS port (the
// server refuses the handshake), https against a plain server (Go's "server
// gave HTTP response to HTTPS client").
#[tokio::test]
async fn the_wrong_scheme_fails_the_probe() {
    let (tls_port, tls_server) = serve_tls(vec!["HTTP/1.1 200 OK\r\n\r\n".into()]).await;
    let plain = at("127.0.0.1", tls_port, "/healthz");
    match probe(plain.clone(), &[]).await {
        Outcome::Failure(m) => assert!(m.starts_with(&format!("Get \"{}\": ", plain.url())), "{m}"),
        other => panic!("plain http against tls: {other:?}"),
    }
    let seen = tls_server.await.unwrap();
    assert!(seen[0].starts_with("handshake failed: "), "{seen:?}");

    let (port, server) = serve(vec![
        "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n".into(),
    ])
    .await;
    let tls = tls_at("127.0.0.1", port, "/healthz");
    assert_eq!(
        probe(tls.clone(), &[]).await,
        Outcome::Failure(format!(
            "Get \"{}\": http: server gave HTTP response to HTTPS client",
            tls.url()
        ))
    );
    let seen = server.await.unwrap();
    assert!(
        seen[0].as_bytes().first() == Some(&0x16),
        "the plain server got a TLS handshake record: {seen:?}"
    );
}

// A redirect from http to https on the same host is followed over TLS.
#[tokio::test]
async fn an_http_to_https_redirect_on_the_same_host_is_followed() {
    let (tls_port, tls_server) = serve_tls(vec![
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".into(),
    ])
    .await;
    let (port, server) = serve(vec![format!(
        "HTTP/1.1 301 Moved Permanently\r\nLocation: https://127.0.0.1:{tls_port}/secure?x=1\r\nContent-Length: 0\r\n\r\n"
    )])
    .await;
    assert_eq!(
        probe(at("127.0.0.1", port, "/healthz"), &[]).await,
        Outcome::Success
    );
    let (seen, seen_tls) = (server.await.unwrap(), tls_server.await.unwrap());
    assert!(seen[0].starts_with("GET /healthz HTTP/1.1\r\n"), "{seen:?}");
    assert!(
        seen_tls[0].starts_with("GET /secure?x=1 HTTP/1.1\r\n"),
        "{seen_tls:?}"
    );
}

// A hook, as the kubelet's `runHTTPHandler`: any response succeeds (a 500
// too) over TLS; an HTTPS hook answered in plain http is asked again over
// http without its Authorization header, and says it fell back.
#[tokio::test]
async fn a_hook_takes_any_response_and_falls_back_to_http() {
    let (tls_port, tls_server) = serve_tls(vec![
        "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n".into(),
    ])
    .await;
    let headers = [("Authorization".to_owned(), "Bearer t".to_owned())];
    assert_eq!(
        lifecycle(tls_at("127.0.0.1", tls_port, "/hook"), &headers).await,
        Ok(Hooked::Done)
    );
    let seen = tls_server.await.unwrap();
    assert!(
        seen[0].contains("authorization: Bearer t\r\n")
            && seen[0].contains("user-agent: kube-lifecycle/evpleg-")
            // A hook offers no ALPN (HTTP/1.1), as the kubelet's.
            && seen[0].ends_with("alpn: None"),
        "{seen:?}"
    );

    let (port, server) = serve(vec![
        "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n".into(),
        "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".into(),
    ])
    .await;
    assert_eq!(
        lifecycle(tls_at("127.0.0.1", port, "/hook"), &headers).await,
        Ok(Hooked::FellBack {
            authority: format!("127.0.0.1:{port}")
        })
    );
    let seen = server.await.unwrap();
    assert!(seen[1].starts_with("GET /hook HTTP/1.1\r\n"), "{seen:?}");
    assert!(
        !seen[1].to_ascii_lowercase().contains("authorization"),
        "{seen:?}"
    );

    // No response at all: the hook fails with the client's error.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closed = listener.local_addr().unwrap().port();
    drop(listener);
    match lifecycle(tls_at("127.0.0.1", closed, "/hook"), &headers).await {
        Err(GetError::Failed(m)) => assert!(
            m.starts_with(&format!(
                "Get \"https://127.0.0.1:{closed}/hook\": dial tcp"
            )),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
}

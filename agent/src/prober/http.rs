//! The http probe, as the kubelet's `pkg/probe/http`: `GET` with the probe's
//! headers (and the kubelet's `User-Agent: kube-probe/…`, `Accept: */*`),
//! redirects followed only while they stay on the same host (the kubelet's
//! `followNonLocalRedirects` is false for probes: a redirect to another host
//! ends the probe with that 3xx response), at most 10 of them; the body read up
//! to 10 KiB. The verdict ([`verdict`]): 200 to 299 is success, 300 to 399
//! is success with a warning ("Probe terminated redirects, Response body:
//! …", recorded by the worker as a `ProbeWarning` event), anything else a
//! failure ("HTTP probe failed with statuscode: N", without the body, as the
//! kubelet keeps it out of the message).
//!
//! Difference: plain http only (a redirect to https on the same host is a
//! failure naming it; the kubelet would follow it over TLS).

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// The most of a response body read (the kubelet's `maxRespBodyLength`).
pub const MAX_BODY: usize = 10 * 1024;
/// Redirects followed at most (Go's http client's default).
pub const MAX_REDIRECTS: usize = 10;

/// A probe's outcome before thresholds: the kubelet's `probe.Result` with
/// its output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// Success, with the warning the kubelet records as `ProbeWarning`.
    Warning(String),
    Failure(String),
}

/// Where a request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub host: String,
    pub port: u16,
    /// Path and query.
    pub path: String,
}

impl Target {
    fn url(&self) -> String {
        format!("http://{}:{}{}", self.host, self.port, self.path)
    }
}

/// What a response's status code means for the probe.
pub fn verdict(code: u16, body: &str) -> Outcome {
    match code {
        200..=299 => Outcome::Success,
        300..=399 => Outcome::Warning(format!("Probe terminated redirects, Response body: {body}")),
        _ => Outcome::Failure(format!("HTTP probe failed with statuscode: {code}")),
    }
}

/// The next hop after a response, as Go's client with the kubelet's
/// redirect checker: `Ok(None)` keeps this response (not a redirect, no
/// `Location`, or a redirect to another host), `Ok(Some)` follows it, `Err`
/// fails the probe with the message.
pub fn next_hop(
    from: &Target,
    code: u16,
    location: Option<&str>,
    followed: usize,
) -> Result<Option<Target>, String> {
    if !matches!(code, 301 | 302 | 303 | 307 | 308) {
        return Ok(None);
    }
    let Some(location) = location.filter(|l| !l.is_empty()) else {
        return Ok(None);
    };
    let bad = || format!("Get \"{}\": bad Location {location:?}", from.url());
    let (scheme, rest) = match location.split_once("://") {
        Some((s, rest)) if !s.contains('/') => (Some(s.to_ascii_lowercase()), rest),
        _ => match location.strip_prefix("//") {
            Some(rest) => (Some("http".into()), rest),
            None => (None, ""),
        },
    };
    let to = match scheme {
        None if location.starts_with('/') => Target {
            path: location.to_owned(),
            ..from.clone()
        },
        None => {
            // Relative to the current path's directory.
            let base = from.path.split('?').next().unwrap_or("/");
            let dir = &base[..base.rfind('/').map_or(0, |i| i + 1)];
            Target {
                path: format!("{}{location}", if dir.is_empty() { "/" } else { dir }),
                ..from.clone()
            }
        }
        Some(scheme) => {
            let (authority, path) = match rest.find(['/', '?']) {
                Some(i) => (&rest[..i], &rest[i..]),
                None => (rest, "/"),
            };
            let uri: hyper::Uri = format!("http://{authority}/").parse().map_err(|_| bad())?;
            let host = uri
                .host()
                .ok_or_else(bad)?
                .trim_matches(['[', ']'])
                .to_owned();
            if !host.eq_ignore_ascii_case(&from.host) {
                return Ok(None);
            }
            if scheme != "http" {
                return Err(format!(
                    "Get \"{location}\": a {scheme} redirect is not followed by evpleg's http probe"
                ));
            }
            Target {
                host,
                port: uri.port_u16().unwrap_or(80),
                path: if path.starts_with('?') {
                    format!("/{path}")
                } else {
                    path.to_owned()
                },
            }
        }
    };
    if followed >= MAX_REDIRECTS {
        return Err(format!("Get \"{}\": stopped after 10 redirects", to.url()));
    }
    Ok(Some(to))
}

/// One response: status, `Location`, the body's first [`MAX_BODY`] bytes.
struct Response {
    code: u16,
    location: Option<String>,
    body: String,
}

/// Runs the probe from `start`, following same-host redirects; unbounded in
/// time (the caller applies `timeoutSeconds` to the whole, as Go's client
/// timeout covers the redirects).
pub async fn probe(start: Target, headers: &[(String, String)]) -> Outcome {
    let mut at = start;
    let mut followed = 0;
    loop {
        let r = match get(&at, headers).await {
            Ok(r) => r,
            Err(e) => return Outcome::Failure(format!("Get \"{}\": {e}", at.url())),
        };
        match next_hop(&at, r.code, r.location.as_deref(), followed) {
            Ok(Some(next)) => {
                at = next;
                followed += 1;
            }
            Ok(None) => return verdict(r.code, &r.body),
            Err(e) => return Outcome::Failure(e),
        }
    }
}

/// One `GET` over HTTP/1.1 on a fresh connection.
async fn get(at: &Target, headers: &[(String, String)]) -> Result<Response, String> {
    let stream = tokio::net::TcpStream::connect((at.host.as_str(), at.port))
        .await
        .map_err(|e| format!("dial tcp {}:{}: {e}", at.host, at.port))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let mut req = hyper::Request::get(at.path.as_str());
    let has = |name: &str| headers.iter().any(|(n, _)| n.eq_ignore_ascii_case(name));
    if !has("host") {
        req = req.header("Host", format!("{}:{}", at.host, at.port));
    }
    if !has("user-agent") {
        req = req.header(
            "User-Agent",
            concat!("kube-probe/evpleg-", env!("CARGO_PKG_VERSION")),
        );
    }
    if !has("accept") {
        req = req.header("Accept", "*/*");
    }
    for (n, v) in headers {
        req = req.header(n.as_str(), v.as_str());
    }
    let req = req
        .header("Connection", "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let result = async {
        let mut resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let mut body = Vec::new();
        while body.len() < MAX_BODY {
            match resp.body_mut().frame().await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        body.extend_from_slice(data);
                    }
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => break,
            }
        }
        body.truncate(MAX_BODY);
        Ok(Response {
            code: resp.status().as_u16(),
            location: resp
                .headers()
                .get(hyper::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .map(str::to_owned),
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }
    .await;
    conn.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn at(host: &str, port: u16, path: &str) -> Target {
        Target {
            host: host.into(),
            port,
            path: path.into(),
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
    fn redirects_are_followed_on_the_same_host_only() {
        let from = at("10.0.0.1", 8080, "/a/b?x=1");
        type Case<'a> = (u16, Option<&'a str>, usize, Result<Option<Target>, String>);
        let cases: &[Case] = &[
            (200, Some("/x"), 0, Ok(None)),
            // 300 and 304 are not redirects Go follows.
            (300, Some("/x"), 0, Ok(None)),
            (304, Some("/x"), 0, Ok(None)),
            (302, None, 0, Ok(None)),
            (302, Some("/healthz"), 0, Ok(Some(at("10.0.0.1", 8080, "/healthz")))),
            (307, Some("c"), 0, Ok(Some(at("10.0.0.1", 8080, "/a/c")))),
            (
                301,
                Some("http://10.0.0.1:9090/y?z"),
                3,
                Ok(Some(at("10.0.0.1", 9090, "/y?z"))),
            ),
            (308, Some("http://10.0.0.1"), 0, Ok(Some(at("10.0.0.1", 80, "/")))),
            // Another host: the 3xx is the probe's response.
            (302, Some("http://example.com/"), 0, Ok(None)),
            (302, Some("//example.com:8080/"), 0, Ok(None)),
            (303, Some("https://other/"), 0, Ok(None)),
            (
                302,
                Some("/again"),
                10,
                Err("Get \"http://10.0.0.1:8080/again\": stopped after 10 redirects".into()),
            ),
            (
                302,
                Some("https://10.0.0.1/"),
                0,
                Err(
                    "Get \"https://10.0.0.1/\": a https redirect is not followed by evpleg's http probe"
                        .into(),
                ),
            ),
        ];
        for (code, location, followed, want) in cases {
            assert_eq!(
                &next_hop(&from, *code, *location, *followed),
                want,
                "{code} {location:?} after {followed}"
            );
        }
    }

    /// A server answering each connection with the next canned response;
    /// the requests it read.
    async fn serve(answers: Vec<String>) -> (u16, tokio::task::JoinHandle<Vec<String>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut seen = Vec::new();
            for answer in answers {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut req = vec![0u8; 2048];
                let n = s.read(&mut req).await.unwrap();
                seen.push(String::from_utf8_lossy(&req[..n]).into_owned());
                s.write_all(answer.as_bytes()).await.unwrap();
            }
            seen
        });
        (port, task)
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
        }
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_failure_naming_the_url() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        match probe(at("127.0.0.1", port, "/"), &[]).await {
            Outcome::Failure(m) => assert!(
                m.starts_with(&format!("Get \"http://127.0.0.1:{port}/\": dial tcp")),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }
}

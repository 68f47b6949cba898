//! The http probe, as the kubelet's `pkg/probe/http`: `GET` with the probe's
//! headers (and the kubelet's `User-Agent: kube-probe/…` or
//! `kube-lifecycle/…` for a hook, `Accept: */*` unless the probe sets one,
//! none if it sets it empty), over plain http or, for `scheme: HTTPS`, TLS
//! that accepts any certificate ([`super::tls`], the kubelet's
//! `InsecureSkipVerify`; a probe speaks HTTP/2 when the server chooses it by
//! ALPN); redirects followed only while they stay on the same
//! host, whatever their scheme (the kubelet's `followNonLocalRedirects` is
//! false for probes and hooks: a redirect to another host ends the request
//! with that 3xx response), at most 10 of them; the body read up to 10 KiB.
//! The probe's verdict ([`verdict`]): 200 to 299 is success, 300 to 399 is
//! success with a warning ("Probe terminated redirects, Response body: …",
//! recorded by the worker as a `ProbeWarning` event), anything else a failure
//! ("HTTP probe failed with statuscode: N", without the body, as the kubelet
//! keeps it out of the message). A hook ([`lifecycle`], the kubelet's
//! `runHTTPHandler`) succeeds on any response; an HTTPS hook answered by a
//! plain-http server is retried over http ([`hook_fallback`]).

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

use super::tls;

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

/// A request's scheme: the action's `scheme` (`HTTP` by default), or a
/// redirect's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
    /// Any other (lowercased): the request fails naming it, as Go's client.
    Unsupported(String),
}

impl Scheme {
    /// The scheme named `s` (any case); none is http.
    pub fn parse(s: Option<&str>) -> Scheme {
        match s.map(str::to_ascii_lowercase).as_deref() {
            None | Some("") | Some("http") => Scheme::Http,
            Some("https") => Scheme::Https,
            Some(other) => Scheme::Unsupported(other.to_owned()),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
            Scheme::Unsupported(s) => s,
        }
    }

    /// The port of a URL that names none.
    fn default_port(&self) -> u16 {
        match self {
            Scheme::Https => 443,
            _ => 80,
        }
    }
}

/// Where a request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub scheme: Scheme,
    pub host: String,
    pub port: u16,
    /// Path and query.
    pub path: String,
}

impl Target {
    /// The request's URL, as Go prints it in its errors.
    pub fn url(&self) -> String {
        format!(
            "{}://{}{}",
            self.scheme.as_str(),
            self.authority(),
            self.path
        )
    }

    /// `host:port`, an IPv6 address in brackets.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// Who asks: the kubelet's user agent names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    Probe,
    Lifecycle,
}

impl Purpose {
    fn user_agent(self) -> &'static str {
        match self {
            Purpose::Probe => concat!("kube-probe/evpleg-", env!("CARGO_PKG_VERSION")),
            Purpose::Lifecycle => concat!("kube-lifecycle/evpleg-", env!("CARGO_PKG_VERSION")),
        }
    }
}

/// Why a request got no response, as Go's client error.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum GetError {
    /// An HTTPS request answered in plain http (a hook falls back on it).
    #[error("Get \"{url}\": {}", tls::PLAIN_HTTP)]
    PlainHttp { url: String },
    #[error("{0}")]
    Failed(String),
}

/// The response a request ended with (after the redirects it followed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub code: u16,
    /// Its first [`MAX_BODY`] bytes.
    pub body: String,
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
        Some((s, rest)) if !s.contains('/') => (Some(Scheme::parse(Some(s))), rest),
        // Scheme-relative: the current request's scheme.
        _ => match location.strip_prefix("//") {
            Some(rest) => (Some(from.scheme.clone()), rest),
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
            // Same host, any scheme (http to https too), as the kubelet's
            // redirect checker compares host names only.
            Target {
                port: uri.port_u16().unwrap_or(scheme.default_port()),
                scheme,
                host,
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

/// Runs the request from `start`, following same-host redirects; unbounded
/// in time (the caller applies `timeoutSeconds` to the whole, as Go's client
/// timeout covers the redirects).
pub async fn fetch(
    start: Target,
    headers: &[(String, String)],
    purpose: Purpose,
) -> Result<Answer, GetError> {
    let mut at = start;
    let mut followed = 0;
    loop {
        let r = get(&at, headers, purpose).await?;
        match next_hop(&at, r.code, r.location.as_deref(), followed) {
            Ok(Some(next)) => {
                at = next;
                followed += 1;
            }
            Ok(None) => {
                return Ok(Answer {
                    code: r.code,
                    body: r.body,
                });
            }
            Err(e) => return Err(GetError::Failed(e)),
        }
    }
}

/// The probe: [`fetch`], then the [`verdict`]; no response is a failure.
pub async fn probe(start: Target, headers: &[(String, String)]) -> Outcome {
    match fetch(start, headers, Purpose::Probe).await {
        Ok(a) => verdict(a.code, &a.body),
        Err(e) => Outcome::Failure(e.to_string()),
    }
}

/// How an httpGet hook went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hooked {
    /// It got a response (any status: the kubelet does not look at it).
    Done,
    /// Its HTTPS request got a plain-http answer and the retry over http
    /// got a response: the kubelet's `LifecycleHTTPFallback` event names
    /// the `host:port`.
    FellBack { authority: String },
}

/// The retry after a hook's request failed with `error`, as the kubelet's
/// `runHTTPHandler`: on a plain-http answer to HTTPS, the first request again
/// over http, without its `Authorization` header; on any other error none.
pub fn hook_fallback(
    start: &Target,
    headers: &[(String, String)],
    error: &GetError,
) -> Option<(Target, Vec<(String, String)>)> {
    if !matches!(error, GetError::PlainHttp { .. }) {
        return None;
    }
    let target = Target {
        scheme: Scheme::Http,
        ..start.clone()
    };
    let headers = headers
        .iter()
        .filter(|(n, _)| !n.eq_ignore_ascii_case("authorization"))
        .cloned()
        .collect();
    Some((target, headers))
}

/// An httpGet lifecycle hook's request: any response succeeds; an error is
/// Go's client error (the fallback's own error is not reported: the first
/// one is, as the kubelet's).
pub async fn lifecycle(start: Target, headers: &[(String, String)]) -> Result<Hooked, GetError> {
    let error = match fetch(start.clone(), headers, Purpose::Lifecycle).await {
        Ok(_) => return Ok(Hooked::Done),
        Err(e) => e,
    };
    let Some((retry, retry_headers)) = hook_fallback(&start, headers, &error) else {
        return Err(error);
    };
    match fetch(retry.clone(), &retry_headers, Purpose::Lifecycle).await {
        Ok(_) => Ok(Hooked::FellBack {
            authority: retry.authority(),
        }),
        Err(_) => Err(error),
    }
}

/// One `GET` on a fresh connection, over TLS for https.
async fn get(
    at: &Target,
    headers: &[(String, String)],
    purpose: Purpose,
) -> Result<Response, GetError> {
    let failed = |e: String| GetError::Failed(format!("Get \"{}\": {e}", at.url()));
    if let Scheme::Unsupported(s) = &at.scheme {
        return Err(failed(format!("unsupported protocol scheme {s:?}")));
    }
    let tcp = tokio::net::TcpStream::connect((at.host.as_str(), at.port))
        .await
        .map_err(|e| failed(super::handlers::dial_error(&at.authority(), &e)))?;
    match at.scheme {
        Scheme::Https => match tls::connect(tcp, &at.host, purpose == Purpose::Probe).await {
            Ok(stream) => {
                let h2 = tls::is_h2(&stream);
                match request(at, headers, purpose, h2) {
                    Ok(req) => exchange(stream, req, h2).await,
                    Err(e) => Err(e),
                }
            }
            Err(tls::ConnectError::PlainHttp) => {
                return Err(GetError::PlainHttp { url: at.url() });
            }
            Err(tls::ConnectError::Failed(e)) => Err(e),
        },
        _ => match request(at, headers, purpose, false) {
            Ok(req) => exchange(tcp, req, false).await,
            Err(e) => Err(e),
        },
    }
    .map_err(failed)
}

/// The request, as the kubelet's `newProbeRequest`: the action's headers,
/// `User-Agent` and `Accept: */*` unless set (an `Accept` set empty is
/// removed), the host (or the action's own `Host`) as `Host`, or as
/// `:authority` over HTTP/2.
fn request(
    at: &Target,
    headers: &[(String, String)],
    purpose: Purpose,
    h2: bool,
) -> Result<hyper::Request<Empty<Bytes>>, String> {
    let named = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    };
    let mut req = if h2 {
        let authority = named("host").map_or_else(|| at.authority(), str::to_owned);
        hyper::Request::get(format!("https://{authority}{}", at.path))
            .version(hyper::Version::HTTP_2)
    } else {
        let req = hyper::Request::get(at.path.as_str());
        match named("host") {
            Some(_) => req,
            None => req.header("Host", at.authority()),
        }
    };
    if named("user-agent").is_none() {
        req = req.header("User-Agent", purpose.user_agent());
    }
    if named("accept").is_none() {
        req = req.header("Accept", "*/*");
    }
    for (n, v) in headers {
        let drop = (n.eq_ignore_ascii_case("accept") && v.is_empty())
            || (h2 && n.eq_ignore_ascii_case("host"));
        if !drop {
            req = req.header(n.as_str(), v.as_str());
        }
    }
    if !h2 {
        req = req.header("Connection", "close");
    }
    req.body(Empty::<Bytes>::new()).map_err(|e| e.to_string())
}

/// The request and its response over an open connection, in HTTP/2 if the
/// TLS handshake chose it, else HTTP/1.1.
async fn exchange<S>(
    stream: S,
    req: hyper::Request<Empty<Bytes>>,
    h2: bool,
) -> Result<Response, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let io = TokioIo::new(stream);
    // The connection is driven by a task of its own while the request is sent
    // and the response read, and dropped after.
    let (sent, conn) = if h2 {
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .map_err(|e| e.to_string())?;
        let conn = tokio::spawn(async move { drop(conn.await) });
        (sender.send_request(req).await, conn)
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| e.to_string())?;
        let conn = tokio::spawn(async move { drop(conn.await) });
        (sender.send_request(req).await, conn)
    };
    let result = match sent {
        Ok(resp) => read(resp).await,
        Err(e) => Err(e.to_string()),
    };
    conn.abort();
    result
}

/// A response's status, `Location` and first [`MAX_BODY`] bytes.
async fn read(mut resp: hyper::Response<hyper::body::Incoming>) -> Result<Response, String> {
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

#[cfg(test)]
mod tests;

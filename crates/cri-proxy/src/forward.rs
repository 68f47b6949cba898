//! Forwarding to the runtime at the HTTP/2 level: each call goes to the
//! runtime's socket as it came (headers, metadata, streamed body) and its
//! answer comes back as it went (status, headers, body, trailers), without
//! decoding. One HTTP/2 connection to the runtime is shared by every client
//! connection; once it breaks (the runtime restarted) the next call dials
//! again, and a call that cannot reach the runtime is answered UNAVAILABLE,
//! which the kubelet's CRI client retries.
//!
//! A dial is bounded by [`DIAL_TIMEOUT`]: the socket's connect, the
//! runtime's first bytes (a gRPC server sends its HTTP/2 SETTINGS as soon as
//! it accepts: a runtime that accepts and says nothing is wedged) and the
//! handshake. No lock is held across it: calls that find no connection each
//! dial (the first live one is kept), so a wedged runtime costs each call
//! at most [`DIAL_TIMEOUT`] and never queues one call behind another's dial.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper::header::HeaderMap;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::UnixStream;
use tokio::sync::Mutex;

use super::grpc::{self, Body, BoxError};

/// Errors of reaching the runtime.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Retryable: the runtime is down or restarting.
    #[error("cannot reach the runtime at {path}: {source} (retryable)")]
    Dial {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Retryable: the runtime accepted the connection but did not start
    /// HTTP/2 in time (wedged, or not a gRPC server).
    #[error(
        "the runtime at {path} accepted the connection but did not answer within {timeout:?} (retryable)"
    )]
    Silent { path: PathBuf, timeout: Duration },
    /// Retryable: the connection broke during the call.
    #[error("runtime at {path}: {source} (retryable)")]
    Http { path: PathBuf, source: hyper::Error },
    /// The client's request body broke off.
    #[error("reading the request: {0}")]
    Request(BoxError),
}

/// How long a dial of the runtime may take: connect, its first bytes, the
/// HTTP/2 handshake.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// The runtime's socket and the connection to it.
#[derive(Debug)]
pub struct Upstream {
    path: PathBuf,
    sender: Mutex<Option<SendRequest<Body>>>,
}

/// A unary answer read whole: its head, message bytes and trailers.
#[derive(Debug)]
pub struct Unary {
    pub head: hyper::http::response::Parts,
    pub data: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Unary {
    /// The gRPC status, from the trailers or the headers.
    pub fn status(&self) -> Option<u32> {
        grpc::status(&self.head.headers, self.trailers.as_ref())
    }

    /// Back into an answer, with `data` in place of the message bytes.
    pub fn into_response(mut self, data: Bytes) -> hyper::Response<Body> {
        self.head.headers.remove(hyper::header::CONTENT_LENGTH);
        let data = (!data.is_empty()).then_some(data);
        hyper::Response::from_parts(self.head, grpc::body(data, self.trailers))
    }
}

impl Upstream {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            sender: Mutex::new(None),
        }
    }

    /// The shared connection, dialled again when it broke. The lock is held
    /// only to read or install the connection, never across a dial.
    async fn sender(&self) -> Result<SendRequest<Body>, ForwardError> {
        if let Some(s) = self.live().await {
            return Ok(s);
        }
        let sender = match tokio::time::timeout(DIAL_TIMEOUT, self.dial()).await {
            Ok(dialled) => dialled?,
            Err(_) => {
                return Err(ForwardError::Silent {
                    path: self.path.clone(),
                    timeout: DIAL_TIMEOUT,
                });
            }
        };
        let mut slot = self.sender.lock().await;
        // Another call may have dialled meanwhile: keep the first live one.
        if let Some(s) = slot.as_ref().filter(|s| !s.is_closed()) {
            return Ok(s.clone());
        }
        *slot = Some(sender.clone());
        Ok(sender)
    }

    /// The shared connection, if it is still open.
    async fn live(&self) -> Option<SendRequest<Body>> {
        self.sender
            .lock()
            .await
            .as_ref()
            .filter(|s| !s.is_closed())
            .cloned()
    }

    /// Connects, waits for the runtime's first bytes, and starts HTTP/2.
    async fn dial(&self) -> Result<SendRequest<Body>, ForwardError> {
        let dial_error = |source| ForwardError::Dial {
            path: self.path.clone(),
            source,
        };
        let stream = UnixStream::connect(&self.path).await.map_err(dial_error)?;
        // Readable once the runtime's SETTINGS came (or it closed: then the
        // handshake or the call fails with the reason).
        stream.readable().await.map_err(dial_error)?;
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|source| self.http(source))?;
        let path = self.path.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(path = %path.display(), error = %e, "runtime connection ended");
            }
        });
        tracing::debug!(path = %self.path.display(), "connected to the runtime");
        Ok(sender)
    }

    fn http(&self, source: hyper::Error) -> ForwardError {
        ForwardError::Http {
            path: self.path.clone(),
            source,
        }
    }

    /// Sends `req` and returns the runtime's answer as it comes.
    pub async fn send(
        &self,
        req: hyper::Request<Body>,
    ) -> Result<hyper::Response<Incoming>, ForwardError> {
        let mut sender = self.sender().await?;
        let sent = match sender.ready().await {
            Ok(()) => sender.send_request(req).await,
            Err(e) => Err(e),
        };
        if sent.is_err() {
            // The next call dials again.
            *self.sender.lock().await = None;
        }
        sent.map_err(|e| self.http(e))
    }

    /// Forwards a call untouched, streaming both ways.
    pub async fn forward(
        &self,
        req: hyper::Request<Incoming>,
    ) -> Result<hyper::Response<Body>, ForwardError> {
        let resp = self
            .send(req.map(|b| b.map_err(BoxError::from).boxed()))
            .await?;
        Ok(resp.map(|b| b.map_err(BoxError::from).boxed()))
    }

    /// Forwards a unary call whose request was read whole (`body`) and reads
    /// the answer whole.
    pub async fn unary(
        &self,
        head: hyper::http::request::Parts,
        body: Bytes,
    ) -> Result<Unary, ForwardError> {
        let req = hyper::Request::from_parts(head, grpc::body(Some(body), None));
        let resp = self.send(req).await?;
        let (head, incoming) = resp.into_parts();
        let collected = incoming.collect().await.map_err(|e| self.http(e))?;
        let trailers = collected.trailers().cloned();
        Ok(Unary {
            head,
            data: collected.to_bytes(),
            trailers,
        })
    }
}

/// Reads a request body whole (unary requests are one small message).
pub async fn read_body(body: Incoming) -> Result<Bytes, ForwardError> {
    body.collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| ForwardError::Request(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    fn request() -> (hyper::http::request::Parts, Bytes) {
        let (head, ()) = hyper::Request::post("http://runtime/runtime.v1.RuntimeService/Version")
            .header("content-type", "application/grpc")
            .body(())
            .expect("a request")
            .into_parts();
        (head, Bytes::from_static(&[0, 0, 0, 0, 0]))
    }

    /// Issue #24 item 5: a runtime that accepts connections and never
    /// answers costs each call at most the dial's bound, clearly, and calls
    /// made together are not queued behind one another's dial. Before the
    /// fix the dial held the shared lock with no bound and no wait for the
    /// runtime: the handshake completed, every call waited for an answer
    /// forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_runtime_that_accepts_and_never_answers_fails_each_call_within_the_dial_bound() {
        let dir = std::env::temp_dir().join(format!(
            "evpleg-wedged-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("wedged.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        // Accepts and holds every connection, never reads or writes.
        let holder = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let upstream = Arc::new(Upstream::new(socket.clone()));
        let started = Instant::now();
        let calls: Vec<_> = (0..5)
            .map(|_| {
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let (head, body) = request();
                    let r = upstream.unary(head, body).await;
                    (r.map(|_| ()), started.elapsed())
                })
            })
            .collect();
        for call in calls {
            let (result, took) = tokio::time::timeout(DIAL_TIMEOUT * 4, call)
                .await
                .expect("the call ended within four dial bounds")
                .unwrap();
            let e = result.expect_err("a wedged runtime cannot answer");
            assert!(
                matches!(e, ForwardError::Silent { .. }),
                "{e}: the error says the runtime did not answer"
            );
            assert!(e.to_string().contains(&socket.display().to_string()), "{e}");
            // Together, not one dial after another (5 x 2 s).
            assert!(took < DIAL_TIMEOUT * 2, "{took:?}");
        }
        holder.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Forwarding to the runtime at the HTTP/2 level: each call goes to the
//! runtime's socket as it came (headers, metadata, streamed body) and its
//! answer comes back as it went (status, headers, body, trailers), without
//! decoding. One HTTP/2 connection to the runtime is shared by every client
//! connection; once it breaks (the runtime restarted) the next call dials
//! again, and a call that cannot reach the runtime is answered UNAVAILABLE,
//! which the kubelet's CRI client retries.

use std::path::PathBuf;

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
    /// Retryable: the connection broke during the call.
    #[error("runtime at {path}: {source} (retryable)")]
    Http { path: PathBuf, source: hyper::Error },
    /// The client's request body broke off.
    #[error("reading the request: {0}")]
    Request(BoxError),
}

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

    /// The shared connection, dialled again when it broke.
    async fn sender(&self) -> Result<SendRequest<Body>, ForwardError> {
        let mut slot = self.sender.lock().await;
        if let Some(s) = slot.as_ref().filter(|s| !s.is_closed()) {
            return Ok(s.clone());
        }
        let stream =
            UnixStream::connect(&self.path)
                .await
                .map_err(|source| ForwardError::Dial {
                    path: self.path.clone(),
                    source,
                })?;
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
        *slot = Some(sender.clone());
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

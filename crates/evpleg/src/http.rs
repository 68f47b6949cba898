//! The HTTP listener of every endpoint the binary serves (the agent's, the
//! observer's, the CRI proxy's): HTTP/1.1 with bounds a peer cannot lift,
//! where `axum::serve` has none. A request's headers must arrive within
//! [`HttpLimits::header_read_timeout`] of the connection's start or of the
//! previous response (the wait for the next request included), which closes
//! slowloris clients and idle keep-alive connections; a connection that
//! moves no byte either way for [`HttpLimits::idle_timeout`] is closed (a
//! client that stops reading its response); at most
//! [`HttpLimits::max_connections`] connections are served at once, those
//! beyond are closed as they are accepted; a request's head is at most
//! [`HttpLimits::max_header_bytes`] (no endpoint reads a body).
//!
//! The kubelet's servers are Go's `net/http` with `MaxHeaderBytes` and its
//! `ReadHeaderTimeout`/`IdleTimeout` knobs; these are the same ideas, with
//! the bounds as flags ([`crate::config::HttpArgs`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The bounds of one HTTP listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpLimits {
    /// The time a request's headers have to arrive.
    pub header_read_timeout: Duration,
    /// A connection moving no byte for this long is closed.
    pub idle_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// A request's head, at most (hyper's floor is 8 KiB).
    pub max_header_bytes: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 256,
            max_header_bytes: 64 << 10,
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown`, over TLS
/// when given `tls` (the observer's and the proxy's `--http-tls-*`); then
/// the connections finish the request they serve (for one header timeout at
/// most) and are closed.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    router: Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
) {
    match tls {
        Some(tls) => serve_tls(listener, tls, limits, shutdown, move |_| router.clone()).await,
        None => {
            serve_with(listener, limits, shutdown, move |stream, peer, stop| {
                let io = IdleIo::new(stream, limits.idle_timeout);
                let router = router.clone().layer(axum::Extension(io.lift()));
                serve_connection(io, router, limits, peer, stop)
            })
            .await
        }
    }
}

/// [`serve`] over TLS, each connection's router made by `route` from its
/// handshake (the kubelet server reads the client certificate there): the
/// handshake must end within `limits.header_read_timeout`, a failed one
/// closes the connection.
pub async fn serve_tls<F>(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    limits: HttpLimits,
    shutdown: CancellationToken,
    route: F,
) where
    F: Fn(&rustls::ServerConnection) -> Router + Clone + Send + Sync + 'static,
{
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    serve_with(listener, limits, shutdown, move |stream, peer, stop| {
        let (acceptor, route) = (acceptor.clone(), route.clone());
        async move {
            let io = IdleIo::new(stream, limits.idle_timeout);
            let lift = io.lift();
            let tls =
                match tokio::time::timeout(limits.header_read_timeout, acceptor.accept(io)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        debug!(%peer, error = %e, "https: tls handshake failed");
                        return;
                    }
                    Err(_) => {
                        debug!(%peer, "https: tls handshake timed out");
                        return;
                    }
                };
            let router = route(tls.get_ref().1).layer(axum::Extension(lift));
            serve_connection(tls, router, limits, peer, stop).await;
        }
    })
    .await
}

/// The accept loop of [`serve`] with each connection handed to `handle`
/// (a TLS handshake, then [`serve_connection`]): at most
/// `limits.max_connections` at once, until `shutdown`.
pub async fn serve_with<F, Fut>(
    listener: TcpListener,
    limits: HttpLimits,
    shutdown: CancellationToken,
    handle: F,
) where
    F: Fn(tokio::net::TcpStream, std::net::SocketAddr, CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut connections = JoinSet::new();
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, ?limits, "serving http");
    }
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: wait a little, go on.
                warn!(error = %e, "http: accept failed");
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                }
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            debug!(%peer, max = limits.max_connections, "http: connection refused, at the limit");
            drop(stream);
            continue;
        };
        let served = handle(stream, peer, shutdown.clone());
        connections.spawn(async move {
            served.await;
            drop(permit);
        });
    }
    let drained = tokio::time::timeout(limits.header_read_timeout, async {
        while connections.join_next().await.is_some() {}
    });
    if drained.await.is_err() {
        connections.abort_all();
    }
}

/// Serves HTTP/1.1 on one connection (`io`, already bounded by
/// [`IdleIo`]) within `limits`, until it closes or `stop`.
pub async fn serve_connection<I>(
    io: I,
    router: Router,
    limits: HttpLimits,
    peer: std::net::SocketAddr,
    stop: CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = TowerToHyperService::new(router);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(8 << 10));
    let conn = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        debug!(%peer, error = %e, "http: connection closed");
    }
}

/// A stream that fails with `TimedOut` once neither a read nor a write has
/// made progress for `timeout` while one was waiting, until its
/// [`IdleLift`] is pulled.
pub struct IdleIo<T> {
    inner: T,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
    lifted: IdleLift,
}

/// Lifts an [`IdleIo`]'s bound for the rest of its connection: a handler
/// that hands the connection over to a long-lived stream (the kubelet
/// server's exec, attach and port forwarding, which the kubelet proxies with
/// no idle bound of its own) pulls it, found among the request's extensions.
#[derive(Clone, Debug, Default)]
pub struct IdleLift(Arc<AtomicBool>);

impl IdleLift {
    pub fn lift(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_lifted(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl<T> std::fmt::Debug for IdleIo<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleIo")
            .field("timeout", &self.timeout)
            .field("lifted", &self.lifted.is_lifted())
            .finish_non_exhaustive()
    }
}

impl<T> IdleIo<T> {
    pub fn new(inner: T, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            lifted: IdleLift::default(),
        }
    }

    /// The handle that lifts this stream's idle bound.
    pub fn lift(&self) -> IdleLift {
        self.lifted.clone()
    }

    fn progress(&mut self) {
        let next = Instant::now() + self.timeout;
        self.deadline.as_mut().reset(next);
    }

    /// Whether the idle time is up (registering the waker when not).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        !self.lifted.is_lifted() && self.deadline.as_mut().poll(cx).is_ready()
    }
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "http connection idle too long")
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.progress();
                Poll::Ready(r)
            }
            Poll::Pending if this.expired(cx) => Poll::Ready(Err(timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_write(cx, buf) {
            Poll::Ready(r) => {
                this.progress();
                Poll::Ready(r)
            }
            Poll::Pending if this.expired(cx) => Poll::Ready(Err(timed_out())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Pending if this.expired(cx) => Poll::Ready(Err(timed_out())),
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;

//! `evpleg cri-proxy` under test: a proxy in front of the containerd
//! harness, a GetContainerEvents subscription read with a timeout, and a raw
//! subscriber that never reads (`tests/cri_proxy.rs`, `tests/operations.rs`).

use std::time::Instant;

use clap::Parser;
use evpleg::config::{Cli, Command};
use evpleg::cri_proxy::CriProxy;
use evpleg_cri::{CriClient, CriClientConfig};
use evpleg_cri_api::v1;
use v1::ContainerEventType as T;

use crate::containerd::Containerd;
use crate::cri_pod::WAIT;

/// A proxy in front of `containerd`, with `flags`.
pub async fn proxy(containerd: &Containerd, flags: &[&str]) -> (CriProxy, CriClient) {
    let socket = containerd.base().join("proxy.sock");
    let listen = format!("unix://{}", socket.display());
    let endpoint = containerd.endpoint();
    let argv = [
        "evpleg",
        "cri-proxy",
        "--listen",
        &listen,
        "--runtime-endpoint",
        &endpoint,
        "--http-listen",
        "127.0.0.1:0",
    ]
    .into_iter()
    .chain(flags.iter().copied());
    let Command::CriProxy(args) = Cli::try_parse_from(argv).expect("flags").command else {
        panic!("not cri-proxy")
    };
    let proxy = CriProxy::start(&args)
        .await
        .unwrap_or_else(|e| panic!("cri proxy: {e}"));
    let client = CriClient::connect(&listen, CriClientConfig::default())
        .await
        .unwrap_or_else(|e| panic!("connect through the proxy: {e}"));
    (proxy, client)
}

/// A GetContainerEvents subscription through the proxy.
#[derive(Debug)]
pub struct Subscription {
    stream: tonic::Streaming<v1::ContainerEventResponse>,
    pub seen: Vec<v1::ContainerEventResponse>,
    /// Indices in `seen` already returned by [`Self::wait`].
    taken: Vec<bool>,
    /// When each event of `seen` was read (Unix ns), for [`Self::lags_ms`].
    received: Vec<i64>,
}

impl Subscription {
    pub async fn new(client: &CriClient) -> Self {
        let stream = tokio::time::timeout(WAIT, client.get_container_events())
            .await
            .expect("the proxy answers GetContainerEvents at once")
            .unwrap_or_else(|e| panic!("GetContainerEvents: {e}"));
        Self {
            stream,
            seen: Vec::new(),
            taken: Vec::new(),
            received: Vec::new(),
        }
    }

    /// The first event of `t` for `id` not returned yet, whether it already
    /// arrived while waiting for another one or arrives within [`WAIT`].
    pub async fn wait(&mut self, id: &str, t: T) -> v1::ContainerEventResponse {
        let matches = |ev: &v1::ContainerEventResponse| {
            ev.container_id == id && ev.container_event_type() == t
        };
        if let Some(i) = (0..self.seen.len()).find(|&i| !self.taken[i] && matches(&self.seen[i])) {
            self.taken[i] = true;
            return self.seen[i].clone();
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = tokio::time::timeout(left, self.stream.message())
                .await
                .unwrap_or_else(|_| panic!("no {t:?} for {id} within {WAIT:?}: {:?}", self.types()))
                .unwrap_or_else(|e| panic!("the event stream failed: {e}"))
                .expect("the event stream ended");
            let found = matches(&ev);
            self.received.push(evpleg_core::clock::wall_clock_ns());
            self.seen.push(ev.clone());
            self.taken.push(found);
            if found {
                return ev;
            }
        }
    }

    /// Reads until the stream ends (bounded by [`WAIT`]): its final status,
    /// `None` when it ended without one.
    pub async fn ended(&mut self) -> Option<tonic::Status> {
        tokio::time::timeout(WAIT, async {
            loop {
                match self.stream.message().await {
                    Ok(Some(ev)) => {
                        self.received.push(evpleg_core::clock::wall_clock_ns());
                        self.seen.push(ev);
                        self.taken.push(false);
                    }
                    Ok(None) => return None,
                    Err(status) => return Some(status),
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the event stream did not end within {WAIT:?}"))
    }

    /// Every (container, type) served more than once so far.
    pub fn repeated(&self) -> Vec<(String, T)> {
        let mut seen = std::collections::BTreeMap::new();
        for e in &self.seen {
            *seen
                .entry((e.container_id.clone(), e.container_event_type() as i32))
                .or_insert(0) += 1;
        }
        seen.into_iter()
            .filter(|(_, n)| *n > 1)
            .map(|((id, t), _)| (id, T::try_from(t).expect("a known type")))
            .collect()
    }

    /// For each event of type `t` read so far: from its `created_at` (for
    /// STARTED and STOPPED the kernel's timestamp) to its receipt here, in ms
    /// (a log for comparing builds, not a bound).
    pub fn lags_ms(&self, t: T) -> Vec<f64> {
        self.seen
            .iter()
            .zip(&self.received)
            .filter(|(e, _)| e.container_event_type() == t)
            .map(|(e, at)| (at - e.created_at) as f64 / 1e6)
            .collect()
    }

    pub fn types(&self) -> Vec<(String, T)> {
        self.seen
            .iter()
            .map(|e| (e.container_id[..12].to_owned(), e.container_event_type()))
            .collect()
    }

    pub fn of(&self, id: &str) -> Vec<T> {
        self.seen
            .iter()
            .filter(|e| e.container_id == id)
            .map(|e| e.container_event_type())
            .collect()
    }
}

pub fn status_of<'a>(ev: &'a v1::ContainerEventResponse, id: &str) -> &'a v1::ContainerStatus {
    ev.containers_statuses
        .iter()
        .find(|s| s.id == id)
        .unwrap_or_else(|| panic!("{id} not in the event's payload: {ev:?}"))
}

pub async fn status(client: &CriClient, id: &str) -> v1::ContainerStatus {
    client
        .container_status(id, false)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .status
        .expect("checked by the client")
}

/// Waits (polling, bounded by [`WAIT`]) until `client`, the runtime itself,
/// reports `id` exited: the proxy serves a death before the runtime knows of
/// it, and a RemoveContainer of a container the runtime still thinks running
/// races its shim ("failed to kill container ...: ttrpc: closed").
pub async fn runtime_exited(client: &CriClient, id: &str) {
    let deadline = Instant::now() + WAIT;
    while !crate::cri_pod::exited(&status(client, id).await) {
        assert!(
            Instant::now() < deadline,
            "the runtime did not report {id} exited within {WAIT:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The value of a metric line `name` (with its labels) in a scrape.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// The sum of every line of metric `name` whose labels start with `labels`
/// (`evpleg_x_total`, `{type="A"`: every `origin` and `reason` of type A).
pub fn metric_sum(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix(labels))
        .filter_map(|rest| rest.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Scrapes `addr`'s `/metrics` until `done` holds (bounded by [`WAIT`]);
/// returns that scrape.
pub async fn wait_metrics(
    addr: std::net::SocketAddr,
    what: &str,
    done: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let scrape = crate::e2e::http_get(addr, "/metrics").await;
        if done(&scrape) {
            return scrape;
        }
        assert!(
            Instant::now() < deadline,
            "{what} within {WAIT:?}: {scrape}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A GetContainerEvents subscriber over raw HTTP/2 that reads nothing: its
/// receive window is 1 KiB, so the proxy's buffer for it (4 events) fills.
pub async fn never_reading_subscriber(
    socket: &std::path::Path,
) -> hyper::Response<hyper::body::Incoming> {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .expect("dial the proxy");
    let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(1024)
        .handshake(TokioIo::new(stream))
        .await
        .expect("http/2");
    tokio::spawn(conn);
    let req = hyper::Request::post("http://proxy/runtime.v1.RuntimeService/GetContainerEvents")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(&[
            0, 0, 0, 0, 0,
        ])))
        .expect("a request");
    sender.send_request(req).await.expect("the proxy answers")
}

/// A gRPC answer as the HTTP/2 frames brought it ([`raw_unary`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawAnswer {
    /// The response's HEADERS frame carried END_STREAM: a trailers-only
    /// answer, the only form in which grpc-go reads a status from headers.
    pub ended_by_headers: bool,
    /// `grpc-status` and `grpc-message` of the headers.
    pub header_status: Option<(String, String)>,
    /// DATA frames received (an empty one counts).
    pub data_frames: usize,
    /// `grpc-status` and `grpc-message` of the trailers, if any came.
    pub trailer_status: Option<(String, String)>,
}

impl RawAnswer {
    /// The status wherever it came, as grpc-go would read it: from a
    /// trailers-only answer's headers or from the trailers; `None`: grpc-go
    /// reports `Internal: server closed the stream without sending trailers`.
    pub fn go_status(&self) -> Option<(String, String)> {
        if self.ended_by_headers {
            self.header_status.clone()
        } else {
            self.trailer_status.clone()
        }
    }
}

fn grpc_status(h: &hyper::HeaderMap) -> Option<(String, String)> {
    let get = |k: &str| {
        h.get(k)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    Some((get("grpc-status")?, get("grpc-message").unwrap_or_default()))
}

/// A unary call `method` (`RuntimeService/ContainerStatus`) with `request`
/// (one framed message: `evpleg_cri_proxy::grpc::frame`) over raw HTTP/2 on
/// `socket`, read frame by frame (bounded by [`WAIT`]).
pub async fn raw_unary(socket: &std::path::Path, method: &str, request: bytes::Bytes) -> RawAnswer {
    tokio::time::timeout(WAIT, async {
        let stream = tokio::net::UnixStream::connect(socket)
            .await
            .unwrap_or_else(|e| panic!("dial {}: {e}", socket.display()));
        let (client, conn) = h2::client::handshake(stream).await.expect("http/2");
        tokio::spawn(conn);
        let mut client = client.ready().await.expect("a stream");
        let req = hyper::Request::post(format!("http://localhost/runtime.v1.{method}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("a request");
        let (resp, mut send) = client.send_request(req, false).expect("sent");
        // A server may answer, and end the stream, before it reads the
        // request (the proxy's own UNAVAILABLE when the runtime is gone): the
        // message then finds the stream closed (h2's InactiveStreamId). The
        // answer is what is checked, and a real failure shows there.
        let _ = send.send_data(request, true);
        let (head, mut body) = resp.await.expect("an answer").into_parts();
        let ended_by_headers = body.is_end_stream();
        let mut data_frames = 0;
        while let Some(d) = body.data().await {
            let d = d.expect("a data frame");
            let _ = body.flow_control().release_capacity(d.len());
            data_frames += 1;
        }
        let trailers = body.trailers().await.expect("the trailers");
        RawAnswer {
            ended_by_headers,
            header_status: grpc_status(&head.headers),
            data_frames,
            trailer_status: trailers.as_ref().and_then(grpc_status),
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{method} on {} within {WAIT:?}", socket.display()))
}

//! A CRI interceptor: an HTTP/2 proxy on its own unix socket in front of a
//! runtime's socket. Every gRPC call is counted by method (the last part of
//! `/runtime.v1.RuntimeService/StopContainer`; a `ContainerStatus` or
//! `PodSandboxStatus` asked `verbose` also as `ContainerStatus verbose`, its
//! request read whole to tell) and forwarded unchanged by
//! `evpleg cri-proxy`'s forwarder ([`evpleg_cri_proxy::forward::Upstream`]):
//! headers, streamed bodies and trailers pass through as they are. A test
//! points a client at [`CriInterceptor::endpoint`] and then reads which calls
//! it made ([`CriInterceptor::calls`], [`CriInterceptor::mutating_calls`]).
//! A method (or `<method> verbose`: its verbose calls only) can be held
//! ([`CriInterceptor::hold`]): its calls are counted on
//! arrival and then never reach the runtime (each waits until the hold is
//! lifted, at most [`HOLD_BOUND`], and fails `UNAVAILABLE`), as when the
//! client dies between two calls (`tests/faults.rs`); or paused
//! ([`CriInterceptor::pause`]): its calls wait as long, then go on; or made
//! to fail ([`CriInterceptor::fail_next`]): its next calls are answered as
//! containerd answers a call whose task's shim went away under it (`UNKNOWN`,
//! `ttrpc: closed`: a code no client retries), without reaching the runtime.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use evpleg_cri_api::v1;
use evpleg_cri_proxy::forward::Upstream;
use evpleg_cri_proxy::grpc;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;

/// The CRI methods that change the runtime or a container (everything but
/// listing, inspecting, versions, stats and events).
pub const MUTATING: [&str; 18] = [
    "RunPodSandbox",
    "StopPodSandbox",
    "RemovePodSandbox",
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "RemoveContainer",
    "UpdateContainerResources",
    "UpdatePodSandboxResources",
    "ReopenContainerLog",
    "ExecSync",
    "Exec",
    "Attach",
    "PortForward",
    "UpdateRuntimeConfig",
    "CheckpointContainer",
    "PullImage",
    "RemoveImage",
];

type Calls = Arc<Mutex<BTreeMap<String, u64>>>;
/// Held methods, each with whether its calls go on once lifted (paused).
type Held = Arc<Mutex<BTreeMap<String, bool>>>;
/// gRPC's `UNKNOWN`: containerd's code for an error its shim's ttrpc gave.
const UNKNOWN: u32 = 2;

/// Methods whose next calls fail, each with how many.
type Failing = Arc<Mutex<BTreeMap<String, u32>>>;

/// How long a held call waits at most for the hold to be lifted.
pub const HOLD_BOUND: std::time::Duration = std::time::Duration::from_secs(60);

/// The status calls whose `verbose` flag is counted.
const VERBOSE_COUNTED: [&str; 2] = ["ContainerStatus", "PodSandboxStatus"];

/// Waits while `key` (a method, or `<method> verbose`) is held or paused, at
/// most [`HOLD_BOUND`]: a held call's refusal, `None` to go on.
async fn wait_if_held(held: &Held, key: &str) -> Option<hyper::Response<grpc::Body>> {
    let is_held = || {
        held.lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .copied()
    };
    let paused = is_held()?;
    let deadline = tokio::time::Instant::now() + HOLD_BOUND;
    while tokio::time::Instant::now() < deadline && is_held().is_some() {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    (!paused)
        .then(|| grpc::error_response(grpc::UNAVAILABLE, &format!("cri interceptor: {key} held")))
}

/// Forwards a status call read whole, counting it as `<method> verbose` when
/// it asks `verbose` (both requests carry it as field 2); a hold or pause of
/// `<method> verbose` holds those calls only.
async fn forward_counting_verbose(
    upstream: &Upstream,
    req: hyper::Request<Incoming>,
    method: &str,
    calls: &Calls,
    held: &Held,
) -> Result<hyper::Response<grpc::Body>, evpleg_cri_proxy::forward::ForwardError> {
    use http_body_util::BodyExt;
    let (head, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let verbose = match method {
        "ContainerStatus" => grpc::unary::<v1::ContainerStatusRequest>(&body).map(|r| r.verbose),
        _ => grpc::unary::<v1::PodSandboxStatusRequest>(&body).map(|r| r.verbose),
    };
    if verbose == Some(true) {
        let key = format!("{method} verbose");
        *lock(calls).entry(key.clone()).or_default() += 1;
        if let Some(refused) = wait_if_held(held, &key).await {
            return Ok(refused);
        }
    }
    let resp = upstream
        .send(hyper::Request::from_parts(
            head,
            grpc::body(Some(body), None),
        ))
        .await?;
    Ok(resp.map(|b| b.map_err(grpc::BoxError::from).boxed()))
}

/// A running interceptor; stopped on drop.
#[derive(Debug)]
pub struct CriInterceptor {
    socket: PathBuf,
    calls: Calls,
    held: Held,
    failing: Failing,
    task: JoinHandle<()>,
}

fn lock(calls: &Calls) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
    calls.lock().unwrap_or_else(|e| e.into_inner())
}

impl CriInterceptor {
    /// Listens on `socket` and forwards to the runtime's socket `upstream`.
    pub fn start(upstream: &Path, socket: PathBuf) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)?;
        let calls = Calls::default();
        let held = Held::default();
        let failing = Failing::default();
        let task = tokio::spawn(serve(
            listener,
            upstream.to_owned(),
            calls.clone(),
            (held.clone(), failing.clone()),
        ));
        Ok(Self {
            socket,
            calls,
            held,
            failing,
            task,
        })
    }

    /// The endpoint a CRI client dials (`unix:///...`).
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Calls so far, by method.
    pub fn calls(&self) -> BTreeMap<String, u64> {
        lock(&self.calls).clone()
    }

    /// Holds `method`: its calls from now on are counted and never
    /// forwarded; each fails once [`Self::unhold`] lifts the hold.
    pub fn hold(&self, method: &str) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(method.to_owned(), false);
    }

    /// Pauses `method`: its calls from now on are counted and wait until
    /// [`Self::unhold`] (at most [`HOLD_BOUND`]), then are forwarded.
    pub fn pause(&self, method: &str) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(method.to_owned(), true);
    }

    /// Fails the next `count` calls of `method`: counted, not forwarded, and
    /// answered with containerd's error for a call that met a task's
    /// teardown (`UNKNOWN`, `ttrpc: closed`).
    pub fn fail_next(&self, method: &str, count: u32) {
        self.failing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(method.to_owned(), count);
    }

    /// Lifts [`Self::hold`] or [`Self::pause`]: held calls fail, paused
    /// ones go on, calls from now on are forwarded.
    pub fn unhold(&self, method: &str) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(method);
    }

    /// The calls so far that change the runtime ([`MUTATING`]).
    pub fn mutating_calls(&self) -> BTreeMap<String, u64> {
        self.calls()
            .into_iter()
            .filter(|(m, _)| MUTATING.contains(&m.as_str()))
            .collect()
    }
}

impl Drop for CriInterceptor {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

async fn serve(listener: UnixListener, upstream: PathBuf, calls: Calls, faults: (Held, Failing)) {
    let upstream = Arc::new(Upstream::new(upstream));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let (upstream, calls, faults) = (upstream.clone(), calls.clone(), faults.clone());
        tokio::spawn(async move {
            if let Err(e) = proxy(stream, upstream, calls, faults).await {
                tracing::debug!(error = %e, "cri interceptor: connection ended");
            }
        });
    }
}

/// One client connection, over the shared connection to the runtime.
async fn proxy(
    stream: UnixStream,
    upstream: Arc<Upstream>,
    calls: Calls,
    (held, failing): (Held, Failing),
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let service = service_fn(move |req: hyper::Request<Incoming>| {
        let method = req.uri().path().rsplit('/').next().unwrap_or("").to_owned();
        *lock(&calls).entry(method.clone()).or_default() += 1;
        let fails = failing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&method)
            .filter(|n| **n > 0)
            .map(|n| *n -= 1)
            .is_some();
        let (upstream, calls, held) = (upstream.clone(), calls.clone(), held.clone());
        async move {
            if fails {
                let message = format!("cri interceptor: {method} failed: ttrpc: closed");
                return Ok(grpc::error_response(UNKNOWN, &message));
            }
            if let Some(refused) = wait_if_held(&held, &method).await {
                return Ok(refused);
            }
            let forwarded = if VERBOSE_COUNTED.contains(&method.as_str()) {
                forward_counting_verbose(&upstream, req, &method, &calls, &held).await
            } else {
                upstream.forward(req).await
            };
            Ok::<_, std::convert::Infallible>(forwarded.unwrap_or_else(|e| {
                grpc::error_response(grpc::UNAVAILABLE, &format!("cri interceptor: {e}"))
            }))
        }
    });
    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(stream), service)
        .await?;
    Ok(())
}

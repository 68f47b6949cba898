//! The proxy's CRI socket: every call is forwarded ([`super::forward`])
//! except the few the proxy must answer or look at:
//!
//! | method | what the proxy does |
//! |---|---|
//! | GetContainerEvents | answers itself from the kernel PLEG ([`super::events`]) |
//! | ListContainers, ContainerStatus, PodSandboxStatus, ListPodSandbox | forwards, decodes the answer and lays pending kernel deaths on it ([`super::overlay`]); with `--overlay=false` forwarded untouched |
//! | CreateContainer, RunPodSandbox | forwards untouched, and on success makes the CREATED event |
//! | RemoveContainer, RemovePodSandbox | asks the runtime what it will remove (a sandbox's containers too), forwards untouched, and on success makes a DELETED event for each object that existed |
//! | everything else (streams included) | forwards untouched |
//!
//! While the kernel path does not run ([`super::kernel_path`]) every call is
//! forwarded untouched, GetContainerEvents included: the runtime's own
//! stream, or its error, worded as the proxy's when it is `Unimplemented`
//! (containerd 1.6 has no stream). With the runtime's stream merged and open
//! ([`super::merge::RuntimeStream`]) GetContainerEvents stays the proxy's.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use evpleg_cri::CriClient;
use evpleg_cri_api::v1;
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::events::{Call, RemovedSandbox};
use super::forward::{ForwardError, Unary, Upstream, read_body};
use super::grpc::{self, Body};
use super::hub::Hub;
use super::kernel_path::{KernelPath, PathState};
use super::merge::RuntimeStream;
use super::overlay::{Overlay, Seen};
use super::stats::{Method, ProxyStats};

/// Errors of opening the proxy's socket.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("cannot create {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} exists and is not a socket: refusing to replace it")]
    NotSocket { path: PathBuf },
    #[error("cannot listen on {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot set the mode or owner of {path}: {source}")]
    Permissions {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Binds `path` (a stale socket there is replaced), with `mode` and `owner`.
pub fn listen(
    path: &Path,
    mode: u32,
    owner: Option<(u32, u32)>,
) -> Result<UnixListener, ListenError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ListenError::Dir {
            path: dir.to_owned(),
            source,
        })?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(ListenError::NotSocket {
                path: path.to_owned(),
            });
        }
        let _ = std::fs::remove_file(path);
    }
    let listener = UnixListener::bind(path).map_err(|source| ListenError::Bind {
        path: path.to_owned(),
        source,
    })?;
    let perms = |source| ListenError::Permissions {
        path: path.to_owned(),
        source,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(perms)?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(perms)?;
    }
    Ok(listener)
}

/// What every connection's calls share.
#[derive(Debug)]
pub struct Service {
    pub upstream: Upstream,
    pub hub: Arc<Hub>,
    pub overlay: Arc<Overlay>,
    /// `--overlay`.
    pub overlay_on: bool,
    pub calls: mpsc::Sender<Call>,
    pub stats: Arc<ProxyStats>,
    /// The runtime as a CRI client: what a removal will remove is asked
    /// before it is forwarded.
    pub cri: CriClient,
    /// Whether the kernel path runs; else every call passes through.
    pub kernel: Arc<KernelPath>,
    /// Whether the runtime's own stream is merged and open: then
    /// GetContainerEvents is the proxy's own in pass-through too.
    pub runtime_stream: Arc<RuntimeStream>,
}

/// How long connections may take to finish at shutdown (an event stream's
/// trailers, a call in flight) before they are cut.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Accepts connections until `shutdown`; then each connection shuts down
/// gracefully (HTTP/2 GOAWAY: calls in flight finish, event streams end with
/// their UNAVAILABLE trailers, [`Hub::close`]) within [`SHUTDOWN_GRACE`].
pub async fn serve(listener: UnixListener, service: Arc<Service>, shutdown: CancellationToken) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors, say: back off a little.
                    warn!(error = %e, "accepting a cri connection");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let service = service.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let svc = service_fn(move |req| service.clone().handle(req));
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                debug!(error = %e, "cri client connection ended");
            }
        });
        while connections.try_join_next().is_some() {}
    }
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        debug!(
            left = connections.len(),
            "cri connections cut after the shutdown grace"
        );
    }
    connections.shutdown().await;
}

fn ok(u: &Unary) -> bool {
    u.status() == Some(grpc::OK)
}

impl Service {
    async fn handle(
        self: Arc<Self>,
        req: hyper::Request<Incoming>,
    ) -> Result<hyper::Response<Body>, Infallible> {
        let started = Instant::now();
        let path = req.uri().path().to_owned();
        let method = grpc::cri_method(&path).unwrap_or("other").to_owned();
        let answer = match method.as_str() {
            "RuntimeService/GetContainerEvents"
                if self.kernel.serving() || self.runtime_stream.is_open() =>
            {
                return Ok(self.subscribe());
            }
            _ if !self.kernel.serving() => self.passed_through(&method, req).await,
            "RuntimeService/ListContainers"
            | "RuntimeService/ContainerStatus"
            | "RuntimeService/PodSandboxStatus"
            | "RuntimeService/ListPodSandbox"
                if self.overlay_on =>
            {
                self.overlaid(&method, req).await
            }
            "RuntimeService/CreateContainer"
            | "RuntimeService/RunPodSandbox"
            | "RuntimeService/RemoveContainer"
            | "RuntimeService/RemovePodSandbox" => self.noticed(&method, req).await,
            _ => self.upstream.forward(req).await,
        };
        let label = Method { method };
        self.stats
            .forward_seconds
            .get_or_create(&label)
            .observe(started.elapsed().as_secs_f64());
        Ok(answer.unwrap_or_else(|e| {
            self.stats.forward_errors.inc();
            debug!(path, error = %e, "answering unavailable");
            grpc::error_response(grpc::UNAVAILABLE, &format!("evpleg cri-proxy: {e}"))
        }))
    }

    /// A call forwarded untouched in pass-through; a GetContainerEvents the
    /// runtime does not implement is answered with the reason.
    async fn passed_through(
        &self,
        method: &str,
        req: hyper::Request<Incoming>,
    ) -> Result<hyper::Response<Body>, ForwardError> {
        let answer = self.upstream.forward(req).await?;
        let unimplemented = answer
            .headers()
            .get("grpc-status")
            .is_some_and(|s| s.as_bytes() == grpc::UNIMPLEMENTED.to_string().as_bytes());
        if method != "RuntimeService/GetContainerEvents" || !unimplemented {
            return Ok(answer);
        }
        let why = match self.kernel.state() {
            PathState::PassThrough { reason, .. } => reason,
            PathState::Kernel => "it is starting again".to_owned(),
        };
        Ok(grpc::error_response(
            grpc::UNIMPLEMENTED,
            &format!(
                "evpleg cri-proxy: no container events: the kernel path does not run ({why}) and the runtime has no event stream"
            ),
        ))
    }

    fn subscribe(&self) -> hyper::Response<Body> {
        let mut resp = hyper::Response::new(self.hub.subscribe());
        resp.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/grpc"));
        resp
    }

    /// A status answer with pending kernel deaths laid on it.
    async fn overlaid(
        &self,
        method: &str,
        req: hyper::Request<Incoming>,
    ) -> Result<hyper::Response<Body>, ForwardError> {
        let (head, body) = req.into_parts();
        let body = read_body(body).await?;
        let filter_state = match method {
            "RuntimeService/ListContainers" => grpc::unary::<v1::ListContainersRequest>(&body)
                .and_then(|r| r.filter?.state)
                .map(|s| s.state),
            "RuntimeService/ListPodSandbox" => grpc::unary::<v1::ListPodSandboxRequest>(&body)
                .and_then(|r| r.filter?.state)
                .map(|s| s.state),
            _ => None,
        };
        // Read before forwarding: a settlement after it may make the answer
        // stale (`overlay::Overlay::settle`).
        let epoch = self.overlay.epoch();
        let answer = self.upstream.unary(head, body).await?;
        if !ok(&answer) || self.overlay.quiet_since(epoch) {
            let data = answer.data.clone();
            return Ok(answer.into_response(data));
        }
        let data = match overlay_answer(&self.overlay, method, &answer.data, filter_state) {
            Some(data) => {
                self.stats.overlaid.inc();
                data
            }
            None => answer.data.clone(),
        };
        Ok(answer.into_response(data))
    }

    /// A call that makes an event when it succeeds; forwarded untouched.
    async fn noticed(
        &self,
        method: &str,
        req: hyper::Request<Incoming>,
    ) -> Result<hyper::Response<Body>, ForwardError> {
        let (head, body) = req.into_parts();
        let body = read_body(body).await?;
        let removal = match method {
            "RuntimeService/RemoveContainer" | "RuntimeService/RemovePodSandbox" => {
                Some(self.before_removal(method, &body).await)
            }
            _ => None,
        };
        let request = body.clone();
        let answer = self.upstream.unary(head, body).await?;
        if ok(&answer) {
            let call = match method {
                "RuntimeService/CreateContainer" => {
                    let sandbox = grpc::unary::<v1::CreateContainerRequest>(&request)
                        .map(|r| r.pod_sandbox_id);
                    grpc::unary::<v1::CreateContainerResponse>(&answer.data).map(|r| {
                        Call::Created {
                            id: r.container_id,
                            sandbox,
                        }
                    })
                }
                "RuntimeService/RunPodSandbox" => {
                    grpc::unary::<v1::RunPodSandboxResponse>(&answer.data).map(|r| Call::Created {
                        id: r.pod_sandbox_id,
                        sandbox: None,
                    })
                }
                _ => removal.flatten(),
            };
            if let Some(call) = call
                && let Err(e) = self.calls.try_send(call)
            {
                warn!(error = %e, "event queue full: a CREATED or DELETED event is lost (the relist reports deletions)");
            }
        }
        let data = answer.data.clone();
        Ok(answer.into_response(data))
    }

    /// What a RemoveContainer or RemovePodSandbox will have removed, asked
    /// before it is forwarded: the object's full id (the CRI lets a client
    /// name it by a prefix), and for a sandbox its status and the containers
    /// removed with it. `None`: the runtime has no such object, so that the
    /// removal (idempotent, answered OK) makes no DELETED. When the runtime
    /// cannot tell (another error), the event names the id as the client
    /// gave it.
    async fn before_removal(&self, method: &str, request: &[u8]) -> Option<Call> {
        if method == "RuntimeService/RemoveContainer" {
            let id = grpc::unary::<v1::RemoveContainerRequest>(request)?.container_id;
            return match self.cri.container_status(&id, false).await {
                Ok(r) => Some(Call::Removed {
                    id: r
                        .status
                        .map(|s| s.id)
                        .filter(|s| !s.is_empty())
                        .unwrap_or(id),
                    sandbox: None,
                }),
                Err(e) if e.is_not_found() => {
                    debug!(id = %id, "removing a container the runtime does not have: no event");
                    None
                }
                Err(e) => {
                    debug!(id = %id, error = %e, "container status before its removal");
                    Some(Call::Removed { id, sandbox: None })
                }
            };
        }
        let id = grpc::unary::<v1::RemovePodSandboxRequest>(request)?.pod_sandbox_id;
        let status = match self.cri.pod_sandbox_status(&id, false).await {
            Ok(r) => r.status,
            Err(e) if e.is_not_found() => {
                debug!(id = %id, "removing a pod sandbox the runtime does not have: no event");
                return None;
            }
            Err(e) => {
                debug!(id = %id, error = %e, "pod sandbox status before its removal");
                None
            }
        };
        let full = status
            .as_ref()
            .map(|s| s.id.clone())
            .filter(|s| !s.is_empty())
            .unwrap_or(id);
        let filter = v1::ContainerFilter {
            pod_sandbox_id: full.clone(),
            ..Default::default()
        };
        let containers = match self.cri.list_containers(Some(filter)).await {
            Ok(c) => c.into_iter().map(|c| c.id).collect(),
            Err(e) => {
                debug!(id = %full, error = %e, "a pod sandbox's containers before its removal");
                Vec::new()
            }
        };
        Some(Call::Removed {
            id: full,
            sandbox: Some(Box::new(RemovedSandbox { status, containers })),
        })
    }
}

/// The answer `data` of `method` (ListContainers, ContainerStatus,
/// PodSandboxStatus: its own status and its `containers_statuses`,
/// ListPodSandbox) with pending kernel deaths laid on it; `None`: nothing overlaid, the runtime's bytes stand.
/// `filter_state`: a ListContainers or ListPodSandbox request's state filter.
fn overlay_answer(
    overlay: &Overlay,
    method: &str,
    data: &[u8],
    filter_state: Option<i32>,
) -> Option<Bytes> {
    match method {
        "RuntimeService/ListContainers" => {
            rewrite::<v1::ListContainersResponse>(data, |r| overlay.list(r, filter_state))
        }
        "RuntimeService/ContainerStatus" => rewrite::<v1::ContainerStatusResponse>(data, |r| {
            r.status
                .as_mut()
                .and_then(|s| overlay.status(s))
                .into_iter()
                .collect()
        }),
        "RuntimeService/PodSandboxStatus" => rewrite::<v1::PodSandboxStatusResponse>(data, |r| {
            let own = r.status.as_mut().and_then(|s| overlay.sandbox_status(s));
            r.containers_statuses
                .iter_mut()
                .filter_map(|s| overlay.status(s))
                .chain(own)
                .collect()
        }),
        "RuntimeService/ListPodSandbox" => {
            rewrite::<v1::ListPodSandboxResponse>(data, |r| overlay.list_sandboxes(r, filter_state))
        }
        _ => None,
    }
}

/// Decodes `data`, lets `lay` change it, re-encodes it if it overlaid
/// anything; `None`: leave the runtime's bytes as they are.
fn rewrite<M: prost::Message + Default>(
    data: &[u8],
    lay: impl FnOnce(&mut M) -> Vec<Seen>,
) -> Option<Bytes> {
    let mut msg = grpc::unary::<M>(data)?;
    let seen = lay(&mut msg);
    seen.contains(&Seen::Overlaid).then(|| grpc::frame(&msg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::ids::ContainerId;
    use evpleg_core::lifecycle::ExitStatus;
    use v1::ContainerState::{ContainerExited as Exited, ContainerRunning as Running};

    fn id(n: u8) -> String {
        format!("{n:064x}")
    }

    fn pending(o: &Overlay, n: u8, code: i32) {
        let death = crate::overlay::KernelDeath {
            exit: ExitStatus {
                code,
                signal: None,
                core_dumped: false,
                oom_killed: false,
            },
            at_ns: 1,
            finished_at: 1_700_000_000_000_000_000,
        };
        o.died(ContainerId::parse(&id(n)).unwrap(), death);
    }

    fn status(n: u8, state: v1::ContainerState) -> v1::ContainerStatus {
        v1::ContainerStatus {
            id: id(n),
            state: state as i32,
            ..Default::default()
        }
    }

    /// PodSandboxStatus: a pending death is laid on the answer's
    /// `containers_statuses` (the 1.27+ kubelet's Evented PLEG reads the pod
    /// from it); the pod's other containers and its own status are the
    /// runtime's; an answer with nothing pending keeps the runtime's bytes.
    #[test]
    fn a_pod_sandbox_status_shows_a_certain_death_exited() {
        let o = Overlay::default();
        let answer = v1::PodSandboxStatusResponse {
            status: Some(v1::PodSandboxStatus {
                id: "sandbox".into(),
                state: v1::PodSandboxState::SandboxReady as i32,
                ..Default::default()
            }),
            containers_statuses: vec![status(1, Running), status(2, Running)],
            timestamp: 42,
            ..Default::default()
        };
        let data = grpc::frame(&answer);
        let method = "RuntimeService/PodSandboxStatus";
        assert_eq!(
            overlay_answer(&o, method, &data, None),
            None,
            "nothing pending"
        );
        pending(&o, 1, 137);
        let out = overlay_answer(&o, method, &data, None).expect("rewritten");
        let out: v1::PodSandboxStatusResponse = grpc::unary(&out).expect("decodes");
        let dead = &out.containers_statuses[0];
        assert_eq!((dead.state(), dead.exit_code), (Exited, 137));
        assert_eq!(dead.reason, "Error");
        assert_eq!(out.containers_statuses[1], status(2, Running));
        assert_eq!((out.status, out.timestamp), (answer.status.clone(), 42));
        // The runtime caught up: its answer passes and the entry ends.
        let mut caught_up = answer.clone();
        caught_up.containers_statuses[0].state = Exited as i32;
        let data = grpc::frame(&caught_up);
        assert_eq!(overlay_answer(&o, method, &data, None), None);
        assert!(o.is_empty());
    }

    /// Issue #30: a ContainerStatus answer the runtime made before it
    /// caught up, arriving after (the kubelet's relist had listed the
    /// container exited, overlaid): stale RUNNING, shown exited with the
    /// runtime's own end, so that the kubelet, which keeps what its
    /// inspection read, does not keep RUNNING for good. A call forwarded
    /// after every settlement needs no look; a removal ends the settlement.
    #[test]
    fn an_answer_made_before_the_runtime_caught_up_is_shown_exited() {
        let o = Overlay::default();
        pending(&o, 1, 137);
        let method = "RuntimeService/ContainerStatus";
        let stale = grpc::frame(&v1::ContainerStatusResponse {
            status: Some(status(1, Running)),
            ..Default::default()
        });
        let forwarded_at = o.epoch();
        // The runtime catches up (the proxy's own check, or another answer).
        let mut runtime = status(1, Exited);
        runtime.exit_code = 143;
        runtime.finished_at = 7;
        assert!(matches!(o.status(&mut runtime), Some(Seen::CaughtUp(_))));
        assert!(o.is_empty(), "nothing pending");
        assert!(!o.quiet_since(forwarded_at), "settled since the call");
        assert!(o.quiet_since(o.epoch()), "a later call needs no look");
        let out = overlay_answer(&o, method, &stale, None).expect("the stale answer rewritten");
        let out: v1::ContainerStatusResponse = grpc::unary(&out).unwrap();
        assert_eq!(
            out.status.map(|s| (s.state(), s.exit_code, s.finished_at)),
            Some((Exited, 143, 7)),
            "the runtime's end"
        );
        let list = grpc::frame(&v1::ListContainersResponse {
            containers: vec![v1::Container {
                id: id(1),
                state: Running as i32,
                ..Default::default()
            }],
        });
        let method_list = "RuntimeService/ListContainers";
        assert!(overlay_answer(&o, method_list, &list, None).is_some());
        // The runtime's own EXITED passes as it is.
        let exited = grpc::frame(&v1::ContainerStatusResponse {
            status: Some(runtime),
            ..Default::default()
        });
        assert_eq!(overlay_answer(&o, method, &exited, None), None);
        // Removed: nothing is laid any more; a death confirmed by the
        // proxy's own check settles it the same way.
        o.forget(&ContainerId::parse(&id(1)).unwrap());
        assert_eq!(overlay_answer(&o, method, &stale, None), None);
        pending(&o, 1, 137);
        assert!(o.settle(&ContainerId::parse(&id(1)).unwrap()));
        assert!(overlay_answer(&o, method, &stale, None).is_some());
    }

    /// The same death through ContainerStatus and ListContainers; another
    /// method is never rewritten.
    #[test]
    fn container_status_and_list_show_it_too() {
        let o = Overlay::default();
        pending(&o, 1, 3);
        let answer = v1::ContainerStatusResponse {
            status: Some(status(1, Running)),
            ..Default::default()
        };
        let out = overlay_answer(
            &o,
            "RuntimeService/ContainerStatus",
            &grpc::frame(&answer),
            None,
        )
        .expect("rewritten");
        let out: v1::ContainerStatusResponse = grpc::unary(&out).unwrap();
        assert_eq!(
            out.status.map(|s| (s.state(), s.exit_code)),
            Some((Exited, 3))
        );
        let list = v1::ListContainersResponse {
            containers: vec![v1::Container {
                id: id(1),
                state: Running as i32,
                ..Default::default()
            }],
        };
        let out = overlay_answer(
            &o,
            "RuntimeService/ListContainers",
            &grpc::frame(&list),
            None,
        )
        .expect("rewritten");
        let out: v1::ListContainersResponse = grpc::unary(&out).unwrap();
        assert_eq!(out.containers[0].state(), Exited);
        assert_eq!(
            overlay_answer(&o, "RuntimeService/Version", &grpc::frame(&list), None),
            None
        );
    }
}

//! The CRI client: evpleg's counterpart of the kubelet's remote runtime and image
//! services (`pkg/kubelet/cri/remote`, now `k8s.io/cri-client`).
//!
//! [`CriClient`] wraps the generated `runtime.v1` clients of [`evpleg_cri_api`]
//! with the behaviour the kubelet adds around them, and returns the generated
//! types unchanged.
//!
//! # What it reproduces from the kubelet
//!
//! - The endpoint is a unix socket, `unix:///path` (a bare absolute path is
//!   accepted too, as the kubelet still does with a deprecation warning).
//! - At start, `Version` must report `runtime_api_version` `"v1"`; anything else
//!   is [`CriError::UnsupportedApiVersion`] (kubelets since 1.26 have no
//!   `v1alpha2` fallback either).
//! - Every call has a deadline, sent to the runtime as `grpc-timeout` and
//!   enforced locally: the runtime request timeout (2 min) for calls that change
//!   state; `StopContainer` gets the container's grace period on top.
//! - Messages up to 16 MiB; connection attempts time out after 5 s; the
//!   reconnection backoff is gRPC's with the kubelet's parameters (100 ms, x1.6,
//!   at most 3 s, +-20 % jitter).
//! - Responses missing what the CRI requires are errors: `RunPodSandbox` or
//!   `CreateContainer` without an id, `PullImage` without an image reference,
//!   `ContainerStatus` / `PodSandboxStatus` / `Status` without a status.
//! - `NotFound` from `StopContainer`, `RemoveContainer`, `StopPodSandbox` and
//!   `RemovePodSandbox` is success: the CRI requires these calls to be
//!   idempotent and the kubelet's callers ignore `NotFound` from them; the
//!   object is already gone, which is what the caller asked for.
//!
//! # Where it differs
//!
//! - grpc-go fails a call at once while the connection is down, and the kubelet
//!   tries again at its next sync. This client instead retries a call that failed
//!   with `Unavailable`, with the backoff above and within the call's deadline,
//!   so that a runtime restart is invisible to a caller that can wait: always for
//!   read-only and idempotent calls (`Version`, `Status`, `List*`, `*Status`,
//!   `Stop*`, `Remove*`, `PullImage`), and for `RunPodSandbox`,
//!   `CreateContainer` and `StartContainer` only when the request never left
//!   (the connection could not be made), so that nothing is created twice.
//!   containerd answers `Unknown` "server is not initialized yet" for a few
//!   tens of milliseconds after it restarts, before doing anything: that counts
//!   as `Unavailable` for every call, in retries and in the returned error.
//! - Read-only calls, which the PLEG makes on every relist, have their own
//!   shorter timeout (10 s); `PullImage` has one (10 min) where the kubelet has
//!   none.
//! - One socket serves both services (the kubelet allows a separate image
//!   endpoint). The streaming calls (`Exec`, `Attach`, `PortForward`) return
//!   the runtime's streaming URL, as the kubelet's; the stream itself is the
//!   kubelet server's (`evpleg::server::streaming`). No stats; no log
//!   reduction of repeated errors.
//! - `GetContainerEvents` ([`CriClient::get_container_events`]) has no deadline
//!   and no retry: the stream lasts as long as the connection, and its caller
//!   (`pleg::evented_cri`) reconnects with its own backoff.
//!
//! The connection is made lazily by tonic and made again after the runtime
//! restarts; a [`CriClient`] is cheap to clone and all clones share it.

mod config;
mod error;
pub mod metrics;
pub mod runtime;
mod stats;

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use evpleg_cri_api::{ImageServiceClient, RuntimeServiceClient, v1};
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

pub use config::{BackoffConfig, CriClientConfig};
pub use error::{CriError, Result, Target};

pub use config::Backoff;
use config::CallKind;

/// The CRI API version evpleg speaks.
pub const CRI_API_VERSION: &str = "v1";

/// The largest gRPC message sent or accepted, as in the kubelet.
pub const MAX_MESSAGE_SIZE: usize = 16 * 1024 * 1024;

/// A client of a CRI runtime's `RuntimeService` and `ImageService` over one unix
/// socket. Clones share the connection.
#[derive(Clone, Debug)]
pub struct CriClient {
    endpoint: Arc<str>,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    config: CriClientConfig,
    metrics: Arc<metrics::CriMetrics>,
}

/// Which failed attempts may be repeated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Retry {
    /// Any `Unavailable`: the call is read-only or idempotent.
    Unavailable,
    /// Only when the request never reached the runtime (no connection).
    NotSent,
}

impl CriClient {
    /// Connects to the runtime at `endpoint` (`unix:///path`) and checks that it
    /// speaks CRI `v1`, waiting up to `config.startup_timeout` for it to answer.
    pub async fn connect(endpoint: &str, config: CriClientConfig) -> Result<Self> {
        let client = Self::connect_unchecked(endpoint, config).await?;
        let version = client
            .version_within(config.startup_timeout, Retry::Unavailable)
            .await?;
        check_version(endpoint, &version)?;
        tracing::info!(
            endpoint,
            runtime = %version.runtime_name,
            runtime_version = %version.runtime_version,
            api = %version.runtime_api_version,
            "connected to the container runtime"
        );
        Ok(client)
    }

    /// A client of the runtime at `endpoint` without talking to it yet: the
    /// connection is made by the first call. No version check.
    pub async fn connect_unchecked(endpoint: &str, config: CriClientConfig) -> Result<Self> {
        let path = socket_path(endpoint)?;
        let channel = Endpoint::from_shared(format!("unix://{}", path.display()))
            .map_err(|_| CriError::InvalidEndpoint {
                endpoint: endpoint.to_owned(),
                reason: "not a valid uri",
            })?
            .connect_timeout(config.connect_timeout)
            .connect_lazy();
        let runtime = RuntimeServiceClient::new(channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE);
        let images = ImageServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE);
        Ok(Self {
            endpoint: Arc::from(endpoint),
            runtime,
            images,
            config,
            metrics: Arc::default(),
        })
    }

    /// The endpoint the client talks to, as given.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The client's timeouts and backoff.
    pub fn config(&self) -> &CriClientConfig {
        &self.config
    }

    fn runtime_target(&self) -> Target {
        Target::Runtime(self.endpoint.clone())
    }

    // ---- RuntimeService: the runtime ------------------------------------------

    /// `Version`: the runtime's name, version and CRI API version.
    pub async fn version(&self) -> Result<v1::VersionResponse> {
        self.version_within(self.config.timeout(CallKind::Query), Retry::Unavailable)
            .await
    }

    async fn version_within(&self, timeout: Duration, retry: Retry) -> Result<v1::VersionResponse> {
        let req = v1::VersionRequest {
            version: CRI_API_VERSION.to_owned(),
        };
        self.call("Version", self.runtime_target(), timeout, retry, |c, t| {
            let mut rt = c.runtime.clone();
            let req = request(req.clone(), t);
            async move { rt.version(req).await }
        })
        .await
    }

    /// `Status`: the runtime's conditions (`RuntimeReady`, `NetworkReady`), and
    /// extra information when `verbose`.
    pub async fn status(&self, verbose: bool) -> Result<v1::StatusResponse> {
        let req = v1::StatusRequest { verbose };
        let resp = self
            .call(
                "Status",
                self.runtime_target(),
                self.config.timeout(CallKind::Query),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req, t);
                    async move { rt.status(req).await }
                },
            )
            .await?;
        if resp.status.is_none() {
            return Err(self.invalid("Status", self.runtime_target(), "no runtime status"));
        }
        Ok(resp)
    }

    /// `RuntimeConfig`: the runtime's cgroup driver (CRI 1.28; older runtimes
    /// answer Unimplemented).
    pub async fn runtime_config(&self) -> Result<v1::RuntimeConfigResponse> {
        self.call(
            "RuntimeConfig",
            self.runtime_target(),
            self.config.timeout(CallKind::Query),
            Retry::Unavailable,
            |c, t| {
                let mut rt = c.runtime.clone();
                let req = request(v1::RuntimeConfigRequest {}, t);
                async move { rt.runtime_config(req).await }
            },
        )
        .await
    }

    // ---- RuntimeService: pod sandboxes ----------------------------------------

    /// `ListPodSandbox`, all sandboxes or those matching `filter`.
    pub async fn list_pod_sandboxes(
        &self,
        filter: Option<v1::PodSandboxFilter>,
    ) -> Result<Vec<v1::PodSandbox>> {
        let req = v1::ListPodSandboxRequest { filter };
        let resp = self
            .call(
                "ListPodSandbox",
                self.runtime_target(),
                self.config.timeout(CallKind::Query),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.list_pod_sandbox(req).await }
                },
            )
            .await?;
        Ok(resp.items)
    }

    /// `PodSandboxStatus` of sandbox `id`; `info` is filled when `verbose`.
    pub async fn pod_sandbox_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<v1::PodSandboxStatusResponse> {
        let req = v1::PodSandboxStatusRequest {
            pod_sandbox_id: id.to_owned(),
            verbose,
        };
        let target = Target::Sandbox(id.to_owned());
        let resp = self
            .call(
                "PodSandboxStatus",
                target.clone(),
                self.config.timeout(CallKind::Query),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.pod_sandbox_status(req).await }
                },
            )
            .await?;
        if resp.status.is_none() {
            return Err(self.invalid("PodSandboxStatus", target, "no pod sandbox status"));
        }
        Ok(resp)
    }

    /// `RunPodSandbox`: creates and starts a sandbox; returns its id.
    /// `runtime_handler` is the RuntimeClass handler, empty for the default.
    pub async fn run_pod_sandbox(
        &self,
        config: &v1::PodSandboxConfig,
        runtime_handler: &str,
    ) -> Result<String> {
        let req = v1::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: runtime_handler.to_owned(),
        };
        let target = pod_target(config);
        let resp = self
            .call(
                "RunPodSandbox",
                target.clone(),
                self.config.timeout(CallKind::Request),
                Retry::NotSent,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.run_pod_sandbox(req).await }
                },
            )
            .await?;
        if resp.pod_sandbox_id.is_empty() {
            return Err(self.invalid("RunPodSandbox", target, "no pod sandbox id"));
        }
        Ok(resp.pod_sandbox_id)
    }

    /// `StopPodSandbox`: stops the sandbox's containers and releases its network.
    /// An unknown sandbox counts as stopped.
    pub async fn stop_pod_sandbox(&self, id: &str) -> Result<()> {
        let req = v1::StopPodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        };
        let result = self
            .call(
                "StopPodSandbox",
                Target::Sandbox(id.to_owned()),
                self.config.timeout(CallKind::Request),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.stop_pod_sandbox(req).await }
                },
            )
            .await;
        not_found_is_success(result)
    }

    /// `RemovePodSandbox`: removes the sandbox and its containers. An unknown
    /// sandbox counts as removed.
    pub async fn remove_pod_sandbox(&self, id: &str) -> Result<()> {
        let req = v1::RemovePodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        };
        let result = self
            .call(
                "RemovePodSandbox",
                Target::Sandbox(id.to_owned()),
                self.config.timeout(CallKind::Request),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.remove_pod_sandbox(req).await }
                },
            )
            .await;
        not_found_is_success(result)
    }

    // ---- RuntimeService: containers -------------------------------------------

    /// `ListContainers`, all containers or those matching `filter`.
    pub async fn list_containers(
        &self,
        filter: Option<v1::ContainerFilter>,
    ) -> Result<Vec<v1::Container>> {
        let req = v1::ListContainersRequest { filter };
        let resp = self
            .call(
                "ListContainers",
                self.runtime_target(),
                self.config.timeout(CallKind::Query),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.list_containers(req).await }
                },
            )
            .await?;
        Ok(resp.containers)
    }

    /// `ContainerStatus` of container `id`; `info` is filled when `verbose`.
    pub async fn container_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<v1::ContainerStatusResponse> {
        let req = v1::ContainerStatusRequest {
            container_id: id.to_owned(),
            verbose,
        };
        let target = Target::Container(id.to_owned());
        let resp = self
            .call(
                "ContainerStatus",
                target.clone(),
                self.config.timeout(CallKind::Query),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.container_status(req).await }
                },
            )
            .await?;
        if resp.status.is_none() {
            return Err(self.invalid("ContainerStatus", target, "no container status"));
        }
        Ok(resp)
    }

    /// `CreateContainer` in sandbox `sandbox_id` (whose config is
    /// `sandbox_config`); returns the new container's id.
    pub async fn create_container(
        &self,
        sandbox_id: &str,
        config: &v1::ContainerConfig,
        sandbox_config: &v1::PodSandboxConfig,
    ) -> Result<String> {
        let req = v1::CreateContainerRequest {
            pod_sandbox_id: sandbox_id.to_owned(),
            config: Some(config.clone()),
            sandbox_config: Some(sandbox_config.clone()),
        };
        let target = Target::NewContainer {
            name: config
                .metadata
                .as_ref()
                .map(|m| m.name.clone())
                .unwrap_or_default(),
            sandbox_id: sandbox_id.to_owned(),
        };
        let resp = self
            .call(
                "CreateContainer",
                target.clone(),
                self.config.timeout(CallKind::Request),
                Retry::NotSent,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.create_container(req).await }
                },
            )
            .await?;
        if resp.container_id.is_empty() {
            return Err(self.invalid("CreateContainer", target, "no container id"));
        }
        Ok(resp.container_id)
    }

    /// `StartContainer` of a created container.
    pub async fn start_container(&self, id: &str) -> Result<()> {
        let req = v1::StartContainerRequest {
            container_id: id.to_owned(),
        };
        self.call(
            "StartContainer",
            Target::Container(id.to_owned()),
            self.config.timeout(CallKind::Request),
            Retry::NotSent,
            |c, t| {
                let mut rt = c.runtime.clone();
                let req = request(req.clone(), t);
                async move { rt.start_container(req).await }
            },
        )
        .await?;
        Ok(())
    }

    /// `ExecSync`: runs `cmd` in container `id` and waits for it, at most
    /// `timeout` (the command's own timeout, as an exec probe's, passed to the
    /// runtime in seconds; the call's deadline is that plus the request timeout).
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[&str],
        timeout: Duration,
    ) -> Result<v1::ExecSyncResponse> {
        let req = v1::ExecSyncRequest {
            container_id: id.to_owned(),
            cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
            timeout: i64::try_from(timeout.as_secs().max(1)).unwrap_or(i64::MAX),
        };
        self.call(
            "ExecSync",
            Target::Container(id.to_owned()),
            self.config.timeout(CallKind::Request) + timeout,
            Retry::NotSent,
            |c, t| {
                let mut rt = c.runtime.clone();
                let req = request(req.clone(), t);
                async move { rt.exec_sync(req).await }
            },
        )
        .await
    }

    /// `Exec`: the URL of the runtime's streaming server that runs `req`'s
    /// command in its container once a client connects to it (the
    /// kubelet's `GetExec`). The request timeout bounds the call, not the
    /// session.
    pub async fn exec(&self, req: v1::ExecRequest) -> Result<String> {
        let target = Target::Container(req.container_id.clone());
        let resp = self
            .call(
                "Exec",
                target.clone(),
                self.config.timeout(CallKind::Request),
                Retry::NotSent,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.exec(req).await }
                },
            )
            .await?;
        self.stream_url("Exec", target, resp.url)
    }

    /// `Attach`: the streaming URL that attaches to `req`'s container.
    pub async fn attach(&self, req: v1::AttachRequest) -> Result<String> {
        let target = Target::Container(req.container_id.clone());
        let resp = self
            .call(
                "Attach",
                target.clone(),
                self.config.timeout(CallKind::Request),
                Retry::NotSent,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.attach(req).await }
                },
            )
            .await?;
        self.stream_url("Attach", target, resp.url)
    }

    /// `PortForward`: the streaming URL that forwards to ports of `req`'s
    /// pod sandbox.
    pub async fn port_forward(&self, req: v1::PortForwardRequest) -> Result<String> {
        let target = Target::Sandbox(req.pod_sandbox_id.clone());
        let resp = self
            .call(
                "PortForward",
                target.clone(),
                self.config.timeout(CallKind::Request),
                Retry::NotSent,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.port_forward(req).await }
                },
            )
            .await?;
        self.stream_url("PortForward", target, resp.url)
    }

    /// A streaming call's URL; none is an error, as in the kubelet's client.
    fn stream_url(&self, call: &'static str, target: Target, url: String) -> Result<String> {
        if url.is_empty() {
            return Err(self.invalid(call, target, "no url"));
        }
        Ok(url)
    }

    /// `StopContainer` with a grace period of `timeout_s` seconds before the
    /// runtime kills it. An unknown container counts as stopped.
    pub async fn stop_container(&self, id: &str, timeout_s: i64) -> Result<()> {
        let req = v1::StopContainerRequest {
            container_id: id.to_owned(),
            timeout: timeout_s,
        };
        let result = self
            .call(
                "StopContainer",
                Target::Container(id.to_owned()),
                self.config.stop_container_timeout(timeout_s),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.stop_container(req).await }
                },
            )
            .await;
        not_found_is_success(result)
    }

    /// `RemoveContainer` (killing it first if it still runs). An unknown
    /// container counts as removed.
    pub async fn remove_container(&self, id: &str) -> Result<()> {
        let req = v1::RemoveContainerRequest {
            container_id: id.to_owned(),
        };
        let result = self
            .call(
                "RemoveContainer",
                Target::Container(id.to_owned()),
                self.config.timeout(CallKind::Request),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.remove_container(req).await }
                },
            )
            .await;
        not_found_is_success(result)
    }

    // ---- RuntimeService: events -----------------------------------------------

    /// `GetContainerEvents`: the runtime's stream of container events (CREATED,
    /// STARTED, STOPPED, DELETED, each with the pod sandbox's and containers'
    /// statuses).
    ///
    /// No deadline, no retry: the stream lasts as long as the connection; a
    /// runtime without it answers `Unimplemented` (containerd 1.6). The future
    /// resolves when the runtime sends the response headers, which containerd
    /// 1.7 does only with the first event: await it in a task of its own, never
    /// inline.
    pub async fn get_container_events(
        &self,
    ) -> Result<tonic::Streaming<v1::ContainerEventResponse>> {
        let mut rt = self.runtime.clone();
        match rt
            .get_container_events(tonic::Request::new(v1::GetEventsRequest {}))
            .await
        {
            Ok(response) => Ok(response.into_inner()),
            Err(status) => Err(CriError::from_status(
                "GetContainerEvents",
                self.runtime_target(),
                &status,
            )),
        }
    }

    // ---- ImageService ---------------------------------------------------------

    /// `ListImages`, all images or those matching `filter`.
    pub async fn list_images(&self, filter: Option<v1::ImageFilter>) -> Result<Vec<v1::Image>> {
        let req = v1::ListImagesRequest { filter };
        let resp = self
            .call(
                "ListImages",
                self.runtime_target(),
                self.config.timeout(CallKind::Query),
                Retry::Unavailable,
                |c, t| {
                    let mut images = c.images.clone();
                    let req = request(req.clone(), t);
                    async move { images.list_images(req).await }
                },
            )
            .await?;
        Ok(resp.images)
    }

    /// `ImageStatus` of `image`; the response's `image` is `None` when the
    /// runtime does not have it (that is not an error).
    pub async fn image_status(
        &self,
        image: &v1::ImageSpec,
        verbose: bool,
    ) -> Result<v1::ImageStatusResponse> {
        let req = v1::ImageStatusRequest {
            image: Some(image.clone()),
            verbose,
        };
        self.call(
            "ImageStatus",
            Target::Image(image.image.clone()),
            self.config.timeout(CallKind::Query),
            Retry::Unavailable,
            |c, t| {
                let mut images = c.images.clone();
                let req = request(req.clone(), t);
                async move { images.image_status(req).await }
            },
        )
        .await
    }

    /// `PullImage`; returns the image reference the runtime resolved it to.
    pub async fn pull_image(
        &self,
        image: &v1::ImageSpec,
        auth: Option<&v1::AuthConfig>,
        sandbox_config: Option<&v1::PodSandboxConfig>,
    ) -> Result<String> {
        let req = v1::PullImageRequest {
            image: Some(image.clone()),
            auth: auth.cloned(),
            sandbox_config: sandbox_config.cloned(),
        };
        let target = Target::Image(image.image.clone());
        let resp = self
            .call(
                "PullImage",
                target.clone(),
                self.config.timeout(CallKind::Pull),
                Retry::Unavailable,
                |c, t| {
                    let mut images = c.images.clone();
                    let req = request(req.clone(), t);
                    async move { images.pull_image(req).await }
                },
            )
            .await?;
        if resp.image_ref.is_empty() {
            return Err(self.invalid("PullImage", target, "no image reference"));
        }
        Ok(resp.image_ref)
    }

    // ---- the call itself ------------------------------------------------------

    /// Runs `attempt` until it succeeds, fails in a way `retry` does not
    /// repeat, or `timeout` has passed. `attempt` gets the time left, which it
    /// sends as the call's gRPC deadline.
    async fn call<T, F, Fut>(
        &self,
        call: &'static str,
        target: Target,
        timeout: Duration,
        retry: Retry,
        mut attempt: F,
    ) -> Result<T>
    where
        F: FnMut(&Self, Duration) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let started = Instant::now();
        let result = self
            .call_with_retries(call, target, timeout, retry, started, &mut attempt)
            .await;
        self.metrics
            .observe(call, started.elapsed().as_secs_f64(), result.is_err());
        result
    }

    async fn call_with_retries<T, F, Fut>(
        &self,
        call: &'static str,
        target: Target,
        timeout: Duration,
        retry: Retry,
        started: Instant,
        attempt: &mut F,
    ) -> Result<T>
    where
        F: FnMut(&Self, Duration) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = deadline_after(started, timeout);
        let mut backoff = Backoff::new(self.config.backoff);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let left = deadline.saturating_duration_since(Instant::now());
            let status = match tokio::time::timeout(left, attempt(self, left)).await {
                Ok(Ok(response)) => {
                    tracing::trace!(call, target = %target, attempts, elapsed = ?started.elapsed(), "CRI call done");
                    return Ok(response.into_inner());
                }
                Ok(Err(status)) => status,
                Err(_elapsed) => {
                    return Err(CriError::TimedOut {
                        call,
                        target: Box::new(target),
                        timeout,
                    });
                }
            };
            if should_retry(retry, &status) {
                let delay = backoff.next_delay();
                if Instant::now() + delay < deadline {
                    tracing::debug!(
                        call,
                        target = target.to_string().trim_start(),
                        attempts,
                        ?delay,
                        error = status.message(),
                        "container runtime unavailable; trying again"
                    );
                    tokio::time::sleep(delay).await;
                    continue;
                }
            }
            return Err(CriError::from_status(call, target, &status));
        }
    }

    /// The runtime operation counters, shared by every clone.
    pub fn metrics(&self) -> Arc<metrics::CriMetrics> {
        self.metrics.clone()
    }

    fn invalid(&self, call: &'static str, target: Target, reason: &'static str) -> CriError {
        CriError::InvalidResponse {
            call,
            target: Box::new(target),
            reason,
        }
    }
}

/// A request carrying `timeout` as its gRPC deadline.
fn request<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if !timeout.is_zero() {
        request.set_timeout(timeout);
    }
    request
}

/// `start + timeout`, or a day from `start` when that overflows.
fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    start
        .checked_add(timeout)
        .unwrap_or_else(|| start + Duration::from_secs(86_400))
}

/// Whether a failed attempt may be repeated under `retry`. A runtime that is
/// still starting refused the call before doing anything, so any call may be
/// repeated then.
fn should_retry(retry: Retry, status: &tonic::Status) -> bool {
    error::status_code(status) == Code::Unavailable
        && match retry {
            Retry::Unavailable => true,
            Retry::NotSent => never_sent(status) || error::runtime_starting(status),
        }
}

/// Whether the status comes from a failure to connect, so that the request
/// never reached the runtime.
fn never_sent(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if err.is::<tonic::ConnectError>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// `Ok` for a `NotFound` error: the object is already gone.
fn not_found_is_success<T>(result: Result<T>) -> Result<()> {
    match result {
        Ok(_) => Ok(()),
        Err(e) if e.is_not_found() => {
            tracing::debug!(error = %e, "already gone; counted as success");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The socket path of a CRI endpoint: `unix:///path` or `/path`.
fn socket_path(endpoint: &str) -> Result<&Path> {
    let invalid = |reason| CriError::InvalidEndpoint {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let path = if let Some(path) = endpoint.strip_prefix("unix://") {
        path
    } else if endpoint.starts_with('/') {
        endpoint
    } else if endpoint.contains("://") {
        return Err(invalid("only unix sockets are supported (unix:///path)"));
    } else {
        return Err(invalid("not unix:///path or an absolute path"));
    };
    if !path.starts_with('/') {
        return Err(invalid("the socket path must be absolute"));
    }
    Ok(Path::new(path))
}

/// The target of `RunPodSandbox`: the pod named in the config.
fn pod_target(config: &v1::PodSandboxConfig) -> Target {
    let meta = config.metadata.clone().unwrap_or_default();
    Target::Pod {
        namespace: meta.namespace,
        name: meta.name,
        uid: meta.uid,
    }
}

/// Checks the `Version` response of the runtime at `endpoint`.
fn check_version(endpoint: &str, version: &v1::VersionResponse) -> Result<()> {
    if version.runtime_api_version == CRI_API_VERSION {
        return Ok(());
    }
    Err(CriError::UnsupportedApiVersion {
        endpoint: endpoint.to_owned(),
        found: version.runtime_api_version.clone(),
        runtime_name: version.runtime_name.clone(),
        runtime_version: version.runtime_version.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            socket_path("unix:///run/containerd/containerd.sock").unwrap(),
            Path::new("/run/containerd/containerd.sock")
        );
        assert_eq!(
            socket_path("/run/crio/crio.sock").unwrap(),
            Path::new("/run/crio/crio.sock")
        );
        for (bad, reason) in [
            ("tcp://127.0.0.1:1234", "only unix sockets"),
            ("npipe:////./pipe/x", "only unix sockets"),
            ("unix://relative.sock", "must be absolute"),
            ("containerd.sock", "not unix:///path"),
            ("", "not unix:///path"),
        ] {
            let err = socket_path(bad).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(reason), "{bad}: {text}");
            assert!(
                text.contains(&format!("{bad:?}")),
                "names the input: {text}"
            );
        }
    }

    #[test]
    fn version_must_be_v1() {
        let mut v = v1::VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "containerd".into(),
            runtime_version: "1.6.20".into(),
            runtime_api_version: "v1".into(),
        };
        assert!(check_version("unix:///x.sock", &v).is_ok());
        v.runtime_api_version = "v1alpha2".into();
        let err = check_version("unix:///x.sock", &v).unwrap_err();
        assert_eq!(
            err.to_string(),
            "runtime containerd 1.6.20 at unix:///x.sock reports CRI API version \"v1alpha2\", evpleg needs \"v1\""
        );
    }

    #[test]
    fn not_found_from_stop_and_remove_is_success() {
        let not_found: Result<()> = Err(CriError::from_status(
            "RemoveContainer",
            Target::Container("c1".into()),
            &tonic::Status::not_found("no such container"),
        ));
        assert!(not_found_is_success(not_found).is_ok());
        let unavailable: Result<()> = Err(CriError::from_status(
            "RemoveContainer",
            Target::Container("c1".into()),
            &tonic::Status::unavailable("down"),
        ));
        assert!(not_found_is_success(unavailable).is_err());
    }

    #[test]
    fn only_connection_failures_count_as_not_sent() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let connect = tonic::Status::from_error(Box::new(tonic::ConnectError(Box::new(refused))));
        assert_eq!(connect.code(), Code::Unavailable);
        assert!(never_sent(&connect));
        assert!(should_retry(Retry::NotSent, &connect));
        assert!(should_retry(Retry::Unavailable, &connect));

        let reset = tonic::Status::unavailable("connection reset");
        assert!(!never_sent(&reset));
        assert!(!should_retry(Retry::NotSent, &reset));
        assert!(should_retry(Retry::Unavailable, &reset));

        let starting = tonic::Status::unknown("server is not initialized yet");
        assert!(should_retry(Retry::NotSent, &starting));
        assert!(should_retry(Retry::Unavailable, &starting));
        let unknown = tonic::Status::unknown("failed to create containerd task");
        assert!(!should_retry(Retry::Unavailable, &unknown));

        let not_found = tonic::Status::not_found("gone");
        assert!(!should_retry(Retry::Unavailable, &not_found));
        let slow = tonic::Status::deadline_exceeded("slow");
        assert!(
            !should_retry(Retry::Unavailable, &slow),
            "the deadline is the budget"
        );
    }

    #[test]
    fn requests_carry_the_deadline() {
        let r = request(v1::VersionRequest::default(), Duration::from_millis(1500));
        assert_eq!(
            r.metadata()
                .get("grpc-timeout")
                .map(|v| v.to_str().unwrap()),
            Some("1500000u")
        );
        let r = request(v1::VersionRequest::default(), Duration::ZERO);
        assert!(r.metadata().get("grpc-timeout").is_none());
        let now = Instant::now();
        assert_eq!(
            deadline_after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        assert!(deadline_after(now, Duration::MAX) > now);
    }

    #[test]
    fn pod_target_names_the_pod() {
        let config = v1::PodSandboxConfig {
            metadata: Some(v1::PodSandboxMetadata {
                name: "web".into(),
                uid: "u-1".into(),
                namespace: "default".into(),
                attempt: 0,
            }),
            ..Default::default()
        };
        assert_eq!(
            pod_target(&config).to_string(),
            " of pod default/web (uid u-1)"
        );
    }

    /// No runtime: a socket that does not exist.
    fn missing_socket() -> String {
        let dir = std::env::temp_dir().join(format!(
            "evpleg-cri-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        format!("unix://{}/nothing.sock", dir.display())
    }

    #[tokio::test]
    async fn query_to_a_missing_socket_is_unavailable_and_names_the_endpoint() {
        let config = CriClientConfig {
            query_timeout: Duration::from_millis(400),
            backoff: BackoffConfig {
                base: Duration::from_millis(20),
                ..BackoffConfig::default()
            },
            ..CriClientConfig::default()
        };
        let endpoint = missing_socket();
        let client = CriClient::connect_unchecked(&endpoint, config)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let err = client.list_containers(None).await.unwrap_err();
        let elapsed = started.elapsed();
        assert!(err.is_retryable(), "{err}");
        assert!(!err.is_not_found());
        assert_eq!(err.code(), Some(Code::Unavailable), "{err}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "ListContainers of runtime {endpoint}: unavailable"
            )),
            "{text}"
        );
        // It retried with backoff until the deadline, not longer.
        assert!(elapsed >= Duration::from_millis(100), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    }

    #[tokio::test]
    async fn connect_gives_up_after_the_startup_timeout() {
        let config = CriClientConfig {
            startup_timeout: Duration::from_millis(300),
            ..CriClientConfig::default()
        };
        let started = std::time::Instant::now();
        let err = CriClient::connect(&missing_socket(), config)
            .await
            .unwrap_err();
        assert!(err.is_retryable(), "{err}");
        assert!(
            err.to_string().starts_with("Version of runtime unix://"),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn bad_endpoints_fail_before_connecting() {
        let err = CriClient::connect("tcp://127.0.0.1:1", CriClientConfig::default())
            .await
            .unwrap_err();
        assert!(matches!(err, CriError::InvalidEndpoint { .. }), "{err}");
        assert!(!err.is_retryable());
    }
}

//! The kubelet's streaming endpoints (`pkg/kubelet/server/server.go`:
//! `getExec`, `getAttach`, `getPortForward`, `getRun`):
//! `/exec/{namespace}/{pod}[/{uid}]/{container}`, `/attach/...` (GET or
//! POST), `/portForward/{namespace}/{pod}[/{uid}]` (GET or POST) and
//! `/run/{namespace}/{pod}[/{uid}]/{container}` (POST).
//!
//! As the kubelet: the query is decoded (`input`, `output`, `error`, `tty`
//! are on when `1`, at least one of the three streams, no stderr with a
//! TTY; `command` repeated; `port` for WebSocket port forwarding), the pod
//! is looked up among the agent's pods (404 "pod does not exist"), its
//! running container (or, for port forwarding, its newest sandbox) is
//! found in the runtime, and CRI `Exec`/`Attach`/`PortForward` gives the
//! runtime's streaming URL. The client's upgrade request is then proxied
//! there, as the kubelet's `UpgradeAwareHandler` does (redirects are gone
//! from the kubelet): the request is sent on with its headers, the
//! runtime's `101` is given back with its headers, and bytes are copied
//! both ways until either side ends, so SPDY and WebSocket pass through
//! alike. A runtime's answer of 400 or more is handed back as it is; a
//! request that is no upgrade gets 500 "Upgrade request required". `/run`
//! is CRI `ExecSync` with the command split at spaces, its stdout then its
//! stderr as the answer, a non-zero exit 500. CRI errors answer 404 for
//! `NotFound`, 429 for `ResourceExhausted`, else 500, with the error's text.
//! The sessions being proxied are counted ([`Streams::open`]).
//!
//! Differences: no WebSocket-to-SPDY translation for the `v5` channel
//! protocols (the kubelet's `ExtendWebSocketsToKubelet` gate, off by
//! default): a WebSocket request reaches the runtime as it came; the
//! runtime's URL must be plain `http` (containerd's default); the client's
//! `Authorization` header is not sent on to the runtime and no
//! `X-Forwarded-For` is added; `/run`'s command is bounded by the runtime
//! request timeout (the kubelet gives it none); a mirror pod's UID is not
//! translated to its static pod's; sessions end when the agent stops.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use evpleg_core::labels;
use evpleg_cri::CriError;
use evpleg_cri_api::v1;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::secure::{KubeletApi, find_pod};

/// How long dialing the runtime's streaming server and its answer to the
/// upgrade may take.
pub const BACKEND_TIMEOUT: Duration = Duration::from_secs(30);

/// The streaming sessions being proxied now, and when they must end.
#[derive(Debug, Default)]
pub struct Streams {
    open: AtomicUsize,
    stop: CancellationToken,
}

impl Streams {
    /// Sessions end when `stop` is cancelled (the agent's shutdown).
    pub fn new(stop: CancellationToken) -> Self {
        Self {
            open: AtomicUsize::new(0),
            stop,
        }
    }

    /// Sessions (exec, attach, port forwarding) proxied now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    fn enter(self: &Arc<Self>) -> OpenStream {
        self.open.fetch_add(1, Ordering::Relaxed);
        OpenStream(self.clone())
    }
}

/// One counted session; uncounted when dropped, however it ends.
struct OpenStream(Arc<Streams>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A streaming request refused, with the kubelet's text.
#[derive(Debug, thiserror::Error)]
pub enum StreamingError {
    #[error("you must specify at least 1 of stdin, stdout, stderr")]
    NoStream,
    #[error("query parameter \"port\" is required")]
    NoPort,
    #[error("query parameter \"port\" cannot be empty")]
    EmptyPort,
    #[error("unable to parse {value:?} as a port: {reason}")]
    BadPort { value: String, reason: String },
    #[error("port {value:?} must be > 0")]
    ZeroPort { value: String },
    #[error("pod does not exist")]
    NoPod,
    /// `/portForward/{ns}/{pod}/{uid}` with another pod's UID.
    #[error("pod not found")]
    OtherUid,
    #[error("container not found ({0:?})")]
    NoContainer(String),
    /// No ready sandbox of the pod (`{name}_{namespace}`).
    #[error("pod not found ({0:?})")]
    NotRunning(String),
    #[error("failed to find sandboxID for pod {0}")]
    NoSandbox(String),
    #[error(transparent)]
    Cri(#[from] CriError),
    #[error("command '{command}' exited with {code}: {stderr}")]
    Exited {
        command: String,
        code: i32,
        stderr: String,
    },
    #[error("Upgrade request required")]
    NotUpgrade,
    #[error("invalid streaming url {url:?} from the runtime: {reason}")]
    BadUrl { url: String, reason: &'static str },
    #[error("error dialing backend {addr}: {reason}")]
    Dial { addr: String, reason: String },
    #[error("invalid upgrade response: status code {0}")]
    BadUpgrade(u16),
}

impl StreamingError {
    /// The kubelet's status code for it.
    pub fn code(&self) -> StatusCode {
        match self {
            Self::NoStream
            | Self::NoPort
            | Self::EmptyPort
            | Self::BadPort { .. }
            | Self::ZeroPort { .. } => StatusCode::BAD_REQUEST,
            Self::NoPod | Self::OtherUid => StatusCode::NOT_FOUND,
            Self::Cri(e) if e.is_not_found() => StatusCode::NOT_FOUND,
            Self::Cri(e) if e.code() == Some(tonic::Code::ResourceExhausted) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The answer: the kubelet's code and text (the proxy's own errors,
    /// Go's `http.Error`, end with a newline).
    fn response(&self) -> Response {
        let text = match self {
            Self::NotUpgrade | Self::BadUrl { .. } | Self::Dial { .. } | Self::BadUpgrade(_) => {
                format!("{self}\n")
            }
            _ => self.to_string(),
        };
        let mut resp = (self.code(), text).into_response();
        if self.code() == StatusCode::TOO_MANY_REQUESTS {
            // The streaming server's request cache TTL, as the kubelet says.
            resp.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("60"));
        }
        resp
    }
}

/// The streams of an exec or attach (the kubelet's `remotecommand.Options`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamOptions {
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

/// Every value of each key of `query`, in order.
fn query_values(query: Option<&str>) -> HashMap<String, Vec<String>> {
    let mut q: HashMap<String, Vec<String>> = HashMap::new();
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        q.entry(k.into_owned()).or_default().push(v.into_owned());
    }
    q
}

/// The query's streams (the API's parameter names: `input`, `output`,
/// `error`, `tty`): each is on when its first value is `1`; stderr is
/// dropped with a TTY; at least one stream.
pub fn stream_options(query: Option<&str>) -> Result<StreamOptions, StreamingError> {
    let q = query_values(query);
    let on = |k: &str| q.get(k).and_then(|v| v.first()).is_some_and(|v| v == "1");
    let tty = on("tty");
    let opts = StreamOptions {
        stdin: on("input"),
        stdout: on("output"),
        stderr: on("error") && !tty,
        tty,
    };
    if !opts.stdin && !opts.stdout && !opts.stderr {
        return Err(StreamingError::NoStream);
    }
    Ok(opts)
}

/// The exec's command: every `command` value, in order.
pub fn exec_command(query: Option<&str>) -> Vec<String> {
    query_values(query).remove("command").unwrap_or_default()
}

/// `/run`'s command: its `cmd` split at each space, as the kubelet does.
pub fn run_command(query: Option<&str>) -> Vec<String> {
    let cmd = query_values(query)
        .remove("cmd")
        .and_then(|v| v.into_iter().next())
        .unwrap_or_default();
    cmd.split(' ').map(str::to_owned).collect()
}

/// The ports of a port forwarding: only a WebSocket client names them, in
/// `port` values that may each hold several, comma-separated (SPDY clients
/// name a port per stream).
pub fn forward_ports(query: Option<&str>, websocket: bool) -> Result<Vec<i32>, StreamingError> {
    if !websocket {
        return Ok(Vec::new());
    }
    let values = query_values(query).remove("port").unwrap_or_default();
    if values.is_empty() {
        return Err(StreamingError::NoPort);
    }
    let mut ports = Vec::new();
    for value in values {
        if value.is_empty() {
            return Err(StreamingError::EmptyPort);
        }
        for p in value.split(',') {
            let port: u16 =
                p.parse()
                    .map_err(|e: std::num::ParseIntError| StreamingError::BadPort {
                        value: value.clone(),
                        reason: e.to_string(),
                    })?;
            if port == 0 {
                return Err(StreamingError::ZeroPort { value });
            }
            ports.push(i32::from(port));
        }
    }
    Ok(ports)
}

/// Whether `headers` ask for a connection upgrade (`Connection: upgrade`).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Whether `headers` ask for a WebSocket (`Upgrade: websocket`).
fn is_websocket(headers: &HeaderMap) -> bool {
    is_upgrade(headers)
        && headers
            .get(header::UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// The routes, for [`super::secure::router`].
pub fn routes() -> Router<Arc<KubeletApi>> {
    Router::new()
        .route("/exec/{namespace}/{pod}/{container}", get(exec).post(exec))
        .route(
            "/exec/{namespace}/{pod}/{uid}/{container}",
            get(exec_uid).post(exec_uid),
        )
        .route(
            "/attach/{namespace}/{pod}/{container}",
            get(attach).post(attach),
        )
        .route(
            "/attach/{namespace}/{pod}/{uid}/{container}",
            get(attach_uid).post(attach_uid),
        )
        .route(
            "/portForward/{namespace}/{pod}",
            get(port_forward).post(port_forward),
        )
        .route(
            "/portForward/{namespace}/{pod}/{uid}",
            get(port_forward_uid).post(port_forward_uid),
        )
        .route("/run/{namespace}/{pod}/{container}", post(run))
        .route("/run/{namespace}/{pod}/{uid}/{container}", post(run_uid))
}

/// What the path names.
#[derive(Debug)]
struct Target {
    namespace: String,
    pod: String,
    uid: Option<String>,
    container: String,
}

type Three = Path<(String, String, String)>;
type Four = Path<(String, String, String, String)>;

fn three(Path((namespace, pod, container)): Three) -> Target {
    Target {
        namespace,
        pod,
        uid: None,
        container,
    }
}

fn four(Path((namespace, pod, uid, container)): Four) -> Target {
    Target {
        namespace,
        pod,
        uid: Some(uid),
        container,
    }
}

/// What a session asks the runtime for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Exec,
    Attach,
}

async fn exec(s: State<Arc<KubeletApi>>, p: Three, q: RawQuery, r: Request) -> Response {
    session(s, Kind::Exec, three(p), q, r).await
}

async fn exec_uid(s: State<Arc<KubeletApi>>, p: Four, q: RawQuery, r: Request) -> Response {
    session(s, Kind::Exec, four(p), q, r).await
}

async fn attach(s: State<Arc<KubeletApi>>, p: Three, q: RawQuery, r: Request) -> Response {
    session(s, Kind::Attach, three(p), q, r).await
}

async fn attach_uid(s: State<Arc<KubeletApi>>, p: Four, q: RawQuery, r: Request) -> Response {
    session(s, Kind::Attach, four(p), q, r).await
}

async fn run(s: State<Arc<KubeletApi>>, p: Three, q: RawQuery) -> Response {
    run_in_container(s, three(p), q).await
}

async fn run_uid(s: State<Arc<KubeletApi>>, p: Four, q: RawQuery) -> Response {
    run_in_container(s, four(p), q).await
}

async fn port_forward(
    s: State<Arc<KubeletApi>>,
    Path((namespace, pod)): Path<(String, String)>,
    q: RawQuery,
    r: Request,
) -> Response {
    forward(s, namespace, pod, None, q, r).await
}

async fn port_forward_uid(
    s: State<Arc<KubeletApi>>,
    Path((namespace, pod, uid)): Path<(String, String, String)>,
    q: RawQuery,
    r: Request,
) -> Response {
    forward(s, namespace, pod, Some(uid), q, r).await
}

/// `getExec`/`getAttach`: the runtime's URL, then the proxy to it.
async fn session(
    State(api): State<Arc<KubeletApi>>,
    kind: Kind,
    target: Target,
    RawQuery(query): RawQuery,
    req: Request,
) -> Response {
    let url = async {
        let opts = stream_options(query.as_deref())?;
        let pod =
            find_pod(&api.pods, &target.namespace, &target.pod).ok_or(StreamingError::NoPod)?;
        let id = running_container(&api, &pod, &target).await?;
        let url = match kind {
            Kind::Exec => {
                api.cri
                    .exec(v1::ExecRequest {
                        container_id: id,
                        cmd: exec_command(query.as_deref()),
                        tty: opts.tty,
                        stdin: opts.stdin,
                        stdout: opts.stdout,
                        stderr: opts.stderr,
                    })
                    .await?
            }
            Kind::Attach => {
                api.cri
                    .attach(v1::AttachRequest {
                        container_id: id,
                        stdin: opts.stdin,
                        tty: opts.tty,
                        stdout: opts.stdout,
                        stderr: opts.stderr,
                    })
                    .await?
            }
        };
        Ok::<_, StreamingError>(url)
    };
    match url.await {
        Ok(url) => proxy(&api.streams, &url, req).await,
        Err(e) => {
            debug!(?kind, ?target, error = %e, "kubelet server: streaming request refused");
            e.response()
        }
    }
}

/// `getPortForward`.
async fn forward(
    State(api): State<Arc<KubeletApi>>,
    namespace: String,
    name: String,
    uid: Option<String>,
    RawQuery(query): RawQuery,
    req: Request,
) -> Response {
    let websocket = is_websocket(req.headers());
    let url = async {
        let ports = forward_ports(query.as_deref(), websocket)?;
        let pod = find_pod(&api.pods, &namespace, &name).ok_or(StreamingError::NoPod)?;
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        if uid.as_ref().is_some_and(|u| *u != pod_uid) {
            return Err(StreamingError::OtherUid);
        }
        let sandbox = pod_sandbox(&api, &name, &namespace, &pod_uid).await?;
        Ok(api
            .cri
            .port_forward(v1::PortForwardRequest {
                pod_sandbox_id: sandbox,
                port: ports,
            })
            .await?)
    };
    match url.await {
        Ok(url) => proxy(&api.streams, &url, req).await,
        Err(e) => {
            debug!(%namespace, %name, error = %e, "kubelet server: port forwarding refused");
            e.response()
        }
    }
}

/// `getRun`: `ExecSync`, its stdout then its stderr.
async fn run_in_container(
    State(api): State<Arc<KubeletApi>>,
    target: Target,
    RawQuery(query): RawQuery,
) -> Response {
    let output = async {
        let pod =
            find_pod(&api.pods, &target.namespace, &target.pod).ok_or(StreamingError::NoPod)?;
        let id = running_container(&api, &pod, &target).await?;
        let cmd = run_command(query.as_deref());
        let cmd_refs: Vec<&str> = cmd.iter().map(String::as_str).collect();
        let timeout = api.cri.config().request_timeout;
        let r = api.cri.exec_sync(&id, &cmd_refs, timeout).await?;
        if r.exit_code != 0 {
            return Err(StreamingError::Exited {
                command: cmd.join(" "),
                code: r.exit_code,
                stderr: String::from_utf8_lossy(&r.stderr).into_owned(),
            });
        }
        let mut out = r.stdout;
        out.extend_from_slice(&r.stderr);
        Ok(out)
    };
    match output.await {
        Ok(out) if out.is_empty() => StatusCode::OK.into_response(),
        Ok(out) => ([(header::CONTENT_TYPE, "application/json")], out).into_response(),
        Err(e) => {
            debug!(?target, error = %e, "kubelet server: run failed");
            e.response()
        }
    }
}

/// The runtime's id of the target's running container (the kubelet's
/// `findContainer` among the runtime's running pods: by UID when the path
/// has one, else by name and namespace).
async fn running_container(
    api: &KubeletApi,
    pod: &Pod,
    target: &Target,
) -> Result<String, StreamingError> {
    let mut selector =
        HashMap::from([(labels::CONTAINER_NAME.to_owned(), target.container.clone())]);
    match &target.uid {
        Some(uid) => {
            selector.insert(labels::POD_UID.to_owned(), uid.clone());
        }
        None => {
            let meta = &pod.metadata;
            selector.insert(
                labels::POD_NAME.to_owned(),
                meta.name.clone().unwrap_or_default(),
            );
            selector.insert(
                labels::POD_NAMESPACE.to_owned(),
                meta.namespace.clone().unwrap_or_default(),
            );
        }
    }
    let containers = api
        .cri
        .list_containers(Some(v1::ContainerFilter {
            state: Some(v1::ContainerStateValue {
                state: v1::ContainerState::ContainerRunning as i32,
            }),
            label_selector: selector,
            ..Default::default()
        }))
        .await?;
    containers
        .into_iter()
        .max_by_key(|c| c.created_at)
        .map(|c| c.id)
        .ok_or_else(|| StreamingError::NoContainer(target.container.clone()))
}

/// The newest sandbox of pod `uid`, which must have a ready one (the
/// kubelet's running pod, then `getSandboxIDByPodUID`).
async fn pod_sandbox(
    api: &KubeletApi,
    name: &str,
    namespace: &str,
    uid: &str,
) -> Result<String, StreamingError> {
    let mut sandboxes = api
        .cri
        .list_pod_sandboxes(Some(v1::PodSandboxFilter {
            label_selector: HashMap::from([(labels::POD_UID.to_owned(), uid.to_owned())]),
            ..Default::default()
        }))
        .await?;
    if !sandboxes
        .iter()
        .any(|s| s.state == v1::PodSandboxState::SandboxReady as i32)
    {
        return Err(StreamingError::NotRunning(format!("{name}_{namespace}")));
    }
    sandboxes.sort_by_key(|s| std::cmp::Reverse(s.created_at));
    sandboxes
        .into_iter()
        .next()
        .map(|s| s.id)
        .ok_or_else(|| StreamingError::NoSandbox(format!("{name}_{namespace}({uid})")))
}

/// Proxies the client's upgrade request `req` to the runtime's streaming
/// `url` (the kubelet's `UpgradeAwareHandler` with an upgrade required).
pub async fn proxy(streams: &Arc<Streams>, url: &str, mut req: Request) -> Response {
    if !is_upgrade(req.headers()) {
        return StreamingError::NotUpgrade.response();
    }
    let mut backend = match tokio::time::timeout(
        BACKEND_TIMEOUT,
        send_upgrade(url, req.method().clone(), req.headers().clone()),
    )
    .await
    {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => return e.response(),
        Err(_) => {
            return StreamingError::Dial {
                addr: url.to_owned(),
                reason: format!("no answer within {BACKEND_TIMEOUT:?}"),
            }
            .response();
        }
    };
    let status = backend.status();
    if status != StatusCode::SWITCHING_PROTOCOLS {
        if status.as_u16() < 400 {
            return StreamingError::BadUpgrade(status.as_u16()).response();
        }
        // The runtime's refusal, as it is.
        let (parts, body) = backend.into_parts();
        return Response::from_parts(parts, Body::new(body));
    }
    // The session may be idle for long (a shell waiting for its user): no
    // idle bound of the agent's from here on, as the kubelet's proxy has
    // none; the runtime's streaming server keeps its own (containerd's
    // `stream_idle_timeout`, 4 h).
    if let Some(lift) = req.extensions().get::<crate::http::IdleLift>() {
        lift.lift();
    }
    let session = streams.enter();
    let stop = streams.stop.clone();
    let to_backend = hyper::upgrade::on(&mut backend);
    let to_client = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let _session = session;
        let (client, runtime) = tokio::select! {
            () = stop.cancelled() => return,
            r = async { tokio::try_join!(to_client, to_backend) } => match r {
                Ok(both) => both,
                Err(e) => {
                    debug!(error = %e, "kubelet server: stream upgrade failed");
                    return;
                }
            },
        };
        let (mut client_rx, mut client_tx) = tokio::io::split(TokioIo::new(client));
        let (mut runtime_rx, mut runtime_tx) = tokio::io::split(TokioIo::new(runtime));
        // Either side ending ends the session, as in the kubelet.
        tokio::select! {
            () = stop.cancelled() => {}
            r = tokio::io::copy(&mut client_rx, &mut runtime_tx) => {
                debug!(result = ?r, "kubelet server: client side of the stream ended");
            }
            r = tokio::io::copy(&mut runtime_rx, &mut client_tx) => {
                debug!(result = ?r, "kubelet server: runtime side of the stream ended");
            }
        }
    });
    let (parts, _) = backend.into_parts();
    Response::from_parts(parts, Body::empty())
}

/// Dials the streaming server of `url` and sends it the client's `method`
/// and `headers` (not its `Authorization`); its answer.
async fn send_upgrade(
    url: &str,
    method: axum::http::Method,
    headers: HeaderMap,
) -> Result<hyper::Response<hyper::body::Incoming>, StreamingError> {
    let bad = |reason| StreamingError::BadUrl {
        url: url.to_owned(),
        reason,
    };
    let uri: Uri = url.parse().map_err(|_| bad("not a url"))?;
    if uri.scheme_str() != Some("http") {
        return Err(bad("only http streaming servers are supported"));
    }
    let host = uri.host().ok_or_else(|| bad("no host"))?;
    let addr = format!("{}:{}", host, uri.port_u16().unwrap_or(80));
    let dial = |reason: String| StreamingError::Dial {
        addr: addr.clone(),
        reason,
    };
    let tcp = tokio::net::TcpStream::connect(&addr)
        .await
        .map_err(|e| dial(e.to_string()))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| dial(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            debug!(error = %e, "kubelet server: streaming server connection ended");
        }
    });
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = hyper::Request::builder().method(method).uri(path);
    for (name, value) in &headers {
        let skip = [
            header::AUTHORIZATION,
            header::CONTENT_LENGTH,
            header::TRANSFER_ENCODING,
        ];
        if !skip.contains(name) {
            out = out.header(name, value);
        }
    }
    if !headers.contains_key(header::HOST) {
        out = out.header(header::HOST, addr.as_str());
    }
    let out = out
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| dial(e.to_string()))?;
    sender
        .send_request(out)
        .await
        .map_err(|e| dial(e.to_string()))
}

#[cfg(test)]
mod tests;

//! The kubelet's authenticated server (`--port`, 10250): HTTPS
//! ([`super::tls`]), every request authenticated and authorized
//! ([`super::auth`]) before its handler, as the kubelet's `InstallAuthFilter`;
//! then `/containerLogs/{namespace}/{pod}/{container}` (the kubelet's
//! `getContainerLogs`, [`container_logs`]), `/exec`, `/attach`,
//! `/portForward` and `/run` ([`super::streaming`]), `/stats/summary`
//! ([`super::stats`]), `/metrics/resource` ([`super::resource_metrics`]),
//! `/configz` ([`super::configz`]) and the read-only port's `/metrics`,
//! `/healthz`, `/readyz` and `/pods`.
//!
//! Differences: no `/logs`, `/checkpoint` yet (404).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::auth::{Auth, AuthError, KubeReviewer, User};
use super::logs::{LogOptions, read_logs};
use crate::http::{HttpLimits, serve_tls};
use evpleg_cri::CriClient;
use evpleg_kubelet::status::local::LocalStore;

/// The identity of a connection's verified client certificate.
#[derive(Clone, Debug)]
pub struct PeerCert(pub Option<User>);

/// What the handlers read.
#[derive(Debug)]
pub struct KubeletApi {
    pub auth: Auth<KubeReviewer>,
    pub pods: Arc<LocalStore>,
    pub cri: CriClient,
    /// Log streams being served now.
    pub log_streams: AtomicUsize,
    /// Exec, attach and port-forward sessions being proxied now.
    pub streams: Arc<super::streaming::Streams>,
    /// `/stats/summary` and `/metrics/resource`.
    pub stats: Option<Arc<super::stats::StatsProvider>>,
    /// `/configz`'s document ([`super::configz::document`]).
    pub configz: serde_json::Value,
}

/// The router: `base` (the read-only port's routes) and the kubelet's own,
/// all behind the authentication and authorization filter.
pub fn router(api: Arc<KubeletApi>, base: Router) -> Router {
    Router::new()
        .route(
            "/containerLogs/{namespace}/{pod}/{container}",
            get(container_logs),
        )
        .route("/stats/summary", get(stats_summary))
        .route("/metrics/resource", get(resource_metrics))
        .route("/configz", get(configz))
        .merge(super::streaming::routes())
        .with_state(api.clone())
        .merge(base)
        .layer(axum::middleware::from_fn_with_state(api, filter))
}

/// `/configz`: the running configuration as the kubelet's.
async fn configz(State(api): State<Arc<KubeletApi>>) -> Response {
    axum::Json(api.configz.clone()).into_response()
}

/// The kubelet's auth filter: 401 for no acceptable credentials, 403 for a
/// request its user may not make, 500 when a review failed.
async fn filter(State(api): State<Arc<KubeletApi>>, req: Request, next: Next) -> Response {
    let cert = req.extensions().get::<PeerCert>().and_then(|p| p.0.clone());
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let user = match api.auth.authenticate(cert.as_ref(), authorization).await {
        Ok(u) => u,
        Err(e) => {
            debug!(path = req.uri().path(), error = %e, "kubelet server: unauthenticated");
            return (StatusCode::UNAUTHORIZED, "Unauthorized").into_response();
        }
    };
    match api
        .auth
        .authorize(&user, req.method().as_str(), req.uri().path())
        .await
    {
        Ok(()) => next.run(req).await,
        Err(e @ AuthError::Forbidden { .. }) => {
            debug!(path = req.uri().path(), error = %e, "kubelet server: forbidden");
            (StatusCode::FORBIDDEN, format!("{e}\n")).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// Serves `router` over TLS on `listener` until `shutdown`, each
/// connection's client certificate (verified by `tls`) given to the filter.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    router: Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
) {
    serve_tls(listener, tls, limits, shutdown, move |conn| {
        let user = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|der| match super::x509::subject(der) {
                Ok((name, groups)) => Some(User {
                    name,
                    groups,
                    ..User::default()
                }),
                Err(e) => {
                    debug!(error = %e, "kubelet server: no identity in the certificate");
                    None
                }
            });
        router.clone().layer(axum::Extension(PeerCert(user)))
    })
    .await
}

/// An error answer with the kubelet's code and text.
fn answer(code: StatusCode, text: impl Into<String>) -> Response {
    (code, text.into()).into_response()
}

/// Go's `strconv.ParseBool`.
fn go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// A `/containerLogs` query refused, with the kubelet's text.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LogQueryError {
    /// A value that does not decode (400).
    #[error(r#"{{"message": "Unable to decode query."}}"#)]
    Undecodable,
    /// Options `ValidatePodLogOptions` refuses (422).
    #[error(r#"{{"message": "Invalid request."}}"#)]
    Invalid,
}

impl LogQueryError {
    /// The kubelet's status code for it.
    pub fn code(&self) -> StatusCode {
        match self {
            Self::Undecodable => StatusCode::BAD_REQUEST,
            Self::Invalid => StatusCode::UNPROCESSABLE_ENTITY,
        }
    }
}

/// The query's `PodLogOptions` (and `previous`), decoded and validated as
/// the kubelet does.
pub fn log_options(
    query: Option<&str>,
    now: Timestamp,
) -> Result<(LogOptions, bool), LogQueryError> {
    let mut q: HashMap<String, String> = HashMap::new();
    for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        q.entry(k.into_owned()).or_insert_with(|| v.into_owned());
    }
    // The legacy `tail`; `all` is no tail.
    if let Some(tail) = q.remove("tail") {
        if tail == "all" {
            q.remove("tailLines");
        } else {
            q.insert("tailLines".into(), tail);
        }
    }
    let undecodable = |_| LogQueryError::Undecodable;
    let flag = |k: &str| match q.get(k) {
        None => Ok(false),
        Some(v) => go_bool(v).ok_or(LogQueryError::Undecodable),
    };
    let int = |k: &str| match q.get(k) {
        None => Ok(None),
        Some(v) => v.parse::<i64>().map(Some).map_err(undecodable),
    };
    let follow = flag("follow")?;
    let previous = flag("previous")?;
    let timestamps = flag("timestamps")?;
    let tail = int("tailLines")?;
    let limit = int("limitBytes")?;
    let since_seconds = int("sinceSeconds")?;
    let since_time = match q.get("sinceTime") {
        None => None,
        Some(v) => Some(
            v.parse::<Timestamp>()
                .map_err(|_| LogQueryError::Undecodable)?,
        ),
    };
    let invalid = tail.is_some_and(|t| t < 0)
        || limit.is_some_and(|l| l < 1)
        || since_seconds.is_some_and(|s| s < 1)
        || (since_seconds.is_some() && since_time.is_some());
    if invalid {
        return Err(LogQueryError::Invalid);
    }
    let mut since = since_seconds.map(|s| now - SignedDuration::from_secs(s));
    if let Some(t) = since_time
        && since.is_none_or(|s| t > s)
    {
        since = Some(t);
    }
    Ok((
        LogOptions {
            since,
            tail: tail.map(|t| t as u64),
            limit_bytes: limit.map(|l| l as u64),
            follow,
            timestamps,
        },
        previous,
    ))
}

/// The pod `namespace/name` of the local store.
pub(super) fn find_pod(store: &LocalStore, namespace: &str, name: &str) -> Option<Pod> {
    let list = store.pod_list();
    list["items"].as_array()?.iter().find_map(|p| {
        (p["metadata"]["namespace"] == namespace && p["metadata"]["name"] == name)
            .then(|| serde_json::from_value(p.clone()).ok())
            .flatten()
    })
}

/// The runtime's id of the container whose logs to read, as the kubelet's
/// `validateContainerLogStatus`: `Err` is its message.
pub fn log_container_id(pod: &Pod, container: &str, previous: bool) -> Result<String, String> {
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let status = pod.status.as_ref();
    let all: Vec<&ContainerStatus> = status
        .into_iter()
        .flat_map(|s| {
            s.container_statuses
                .iter()
                .flatten()
                .chain(s.init_container_statuses.iter().flatten())
                .chain(s.ephemeral_container_statuses.iter().flatten())
        })
        .collect();
    let Some(s) = all.into_iter().find(|s| s.name == container) else {
        return Err(format!(
            "container {container:?} in pod {pod_name:?} is not available"
        ));
    };
    let last = s
        .last_state
        .as_ref()
        .and_then(|l| l.terminated.as_ref())
        .and_then(|t| t.container_id.clone())
        .filter(|id| !id.is_empty());
    let state = s.state.clone().unwrap_or_default();
    let terminated = |what| format!("container {container:?} in pod {pod_name:?} is {what}");
    let id = if previous {
        last.ok_or_else(|| {
            format!("previous terminated container {container:?} in pod {pod_name:?} not found")
        })?
    } else if state.running.is_some() {
        s.container_id.clone().unwrap_or_default()
    } else if let Some(t) = &state.terminated {
        match t.container_id.clone().filter(|id| !id.is_empty()) {
            Some(id) => id,
            None => last.ok_or_else(|| terminated("terminated"))?,
        }
    } else if let Some(id) = last {
        id
    } else if let Some(w) = &state.waiting {
        let reason = w.reason.clone().unwrap_or_default();
        let why = match reason.as_str() {
            "ErrImagePull" => "image can't be pulled".to_owned(),
            "ImagePullBackOff" => "trying and failing to pull image".to_owned(),
            _ => reason,
        };
        return Err(terminated(&format!("waiting to start: {why}")));
    } else {
        return Err(terminated("waiting to start - no logs yet"));
    };
    Ok(id
        .split_once("://")
        .map_or(id.clone(), |(_, i)| i.to_owned()))
}

/// `GET /containerLogs/{namespace}/{pod}/{container}`.
async fn container_logs(
    State(api): State<Arc<KubeletApi>>,
    Path((namespace, pod_name, container)): Path<(String, String, String)>,
    RawQuery(query): RawQuery,
) -> Response {
    let (opts, previous) = match log_options(query.as_deref(), Timestamp::now()) {
        Ok(o) => o,
        Err(e) => return answer(e.code(), e.to_string()),
    };
    let Some(pod) = find_pod(&api.pods, &namespace, &pod_name) else {
        return answer(
            StatusCode::NOT_FOUND,
            format!("pod {pod_name:?} does not exist"),
        );
    };
    let spec = pod.spec.clone().unwrap_or_default();
    let known = spec
        .containers
        .iter()
        .map(|c| &c.name)
        .chain(spec.init_containers.iter().flatten().map(|c| &c.name))
        .chain(spec.ephemeral_containers.iter().flatten().map(|c| &c.name))
        .any(|n| *n == container);
    if !known {
        return answer(
            StatusCode::NOT_FOUND,
            format!("container {container:?} not found in pod {pod_name:?}"),
        );
    }
    let id = match log_container_id(&pod, &container, previous) {
        Ok(id) => id,
        Err(message) => return answer(StatusCode::BAD_REQUEST, message),
    };
    let path = match api.cri.container_status(&id, false).await {
        Ok(r) => r.status.map(|s| s.log_path).unwrap_or_default(),
        Err(e) => {
            return answer(
                StatusCode::BAD_REQUEST,
                format!("failed to get container status {id:?}: {e}"),
            );
        }
    };
    let path = std::path::PathBuf::from(path);
    if let Err(e) = tokio::fs::metadata(&path).await {
        return answer(
            StatusCode::BAD_REQUEST,
            format!("failed to open log file {:?}: {e}", path.display()),
        );
    }
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    api.log_streams.fetch_add(1, Ordering::Relaxed);
    let stream_api = api.clone();
    tokio::spawn(async move {
        let cri = stream_api.cri.clone();
        let running = || {
            let (cri, id) = (cri.clone(), id.clone());
            async move {
                cri.container_status(&id, false).await.is_ok_and(|r| {
                    r.status.is_some_and(|s| {
                        s.state == evpleg_cri_api::v1::ContainerState::ContainerRunning as i32
                    })
                })
            }
        };
        if let Err(e) = read_logs(&path, &opts, tx, running).await {
            debug!(error = %e, "kubelet server: log stream ended");
        }
        stream_api.log_streams.fetch_sub(1, Ordering::Relaxed);
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| answer(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// `GET /stats/summary[?only_cpu_and_memory=true]`, as the kubelet's
/// `handleSummary`: 500 with its text when the stats cannot be read.
async fn stats_summary(State(api): State<Arc<KubeletApi>>, RawQuery(query): RawQuery) -> Response {
    let Some(stats) = &api.stats else {
        return answer(StatusCode::NOT_FOUND, "404 page not found");
    };
    let only = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .find(|(k, _)| k == "only_cpu_and_memory")
        .is_some_and(|(_, v)| go_bool(&v) == Some(true));
    match stats.summary(only).await {
        Ok(s) => axum::Json(s).into_response(),
        Err(e) => answer(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Internal Error: failed to get summary stats: {e}"),
        ),
    }
}

/// `GET /metrics/resource`: scrape errors are a metric, not a failure.
async fn resource_metrics(State(api): State<Arc<KubeletApi>>) -> Response {
    let Some(stats) = &api.stats else {
        return answer(StatusCode::NOT_FOUND, "404 page not found");
    };
    let summary = stats.summary(true).await;
    if let Err(e) = &summary {
        debug!(error = %e, "kubelet server: resource metrics");
    }
    let text = super::resource_metrics::render(summary.as_ref().ok());
    (
        [(header::CONTENT_TYPE, super::resource_metrics::CONTENT_TYPE)],
        text,
    )
        .into_response()
}

#[cfg(test)]
mod tests;

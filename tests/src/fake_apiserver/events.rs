//! `events.k8s.io/v1` Events in the fake API server: what the agent's event
//! writer does (create, merge-patch a series) and what tests read back.
//!
//! - `POST /apis/events.k8s.io/v1/namespaces/{ns}/events`: validated as the API
//!   server's `ValidateEventCreate` does for v1 (eventTime, reportingController,
//!   reportingInstance, action, reason, regarding, type Normal or Warning, a
//!   note of at most 1 kB, a series of count >= 2); 409 `AlreadyExists` for a
//!   name taken; 201 with uid, resourceVersion and creationTimestamp set.
//! - `PATCH .../events/{name}` (`application/merge-patch+json`): 404 when
//!   missing; the patched event validated again.
//! - `GET .../events` (an `EventList`) and `GET .../events/{name}`.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;
use axum::routing::get;
use k8s_openapi::api::events::v1::Event;
use serde_json::{Value, json};

use super::{ApiError, AppState, FakeApiServer, json_response};

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/apis/events.k8s.io/v1/namespaces/{ns}/events",
            get(list).post(create),
        )
        .route(
            "/apis/events.k8s.io/v1/namespaces/{ns}/events/{name}",
            get(get_one).patch(patch),
        )
}

impl FakeApiServer {
    /// Every stored `events.k8s.io/v1` Event, by namespace and name.
    pub fn events(&self) -> Vec<Event> {
        self.lock()
            .events
            .values()
            .map(|v| serde_json::from_value(v.clone()).expect("stored events are events"))
            .collect()
    }

    /// Waits until `done` holds for the stored events, re-checking on every
    /// change.
    pub async fn wait_for_events(
        &self,
        what: &str,
        timeout: std::time::Duration,
        done: impl Fn(&[Event]) -> bool,
    ) {
        self.wait_until(what, timeout, |i| {
            let events: Vec<Event> = i
                .events
                .values()
                .filter_map(|v| serde_json::from_value(v.clone()).ok())
                .collect();
            done(&events)
        })
        .await;
    }
}

fn invalid(name: &str, why: &str) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!("Event.events.k8s.io \"{name}\" is invalid: {why}"),
    )
}

/// The checks of the API server's `ValidateEventCreate` for v1 that the
/// writer can get wrong.
fn validate(name: &str, ns: &str, v: &Value) -> Result<Event, ApiError> {
    let e: Event = serde_json::from_value(v.clone())
        .map_err(|err| ApiError::bad_request(format!("not an events.k8s.io/v1 Event: {err}")))?;
    let missing = |field: &str| invalid(name, &format!("{field}: Required value"));
    if e.metadata.namespace.as_deref().is_some_and(|n| n != ns) {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    e.event_time.as_ref().ok_or_else(|| missing("eventTime"))?;
    for (field, value) in [
        ("reportingController", &e.reporting_controller),
        ("reportingInstance", &e.reporting_instance),
        ("action", &e.action),
        ("reason", &e.reason),
    ] {
        if value.as_deref().unwrap_or_default().is_empty() {
            return Err(missing(field));
        }
    }
    e.regarding.as_ref().ok_or_else(|| missing("regarding"))?;
    if !matches!(e.type_.as_deref(), Some("Normal" | "Warning")) {
        return Err(invalid(name, "type: Unsupported value"));
    }
    if e.note.as_deref().unwrap_or_default().len() > 1024 {
        return Err(invalid(name, "note: Too long: may not be longer than 1024"));
    }
    if e.series.as_ref().is_some_and(|s| s.count < 2) {
        return Err(invalid(
            name,
            "series.count: Invalid value: should be at least 2",
        ));
    }
    Ok(e)
}

async fn create(
    State(shared): State<AppState>,
    Path(ns): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding the event: {e}")))?;
    let name = v["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if name.is_empty() {
        return Err(invalid("", "metadata.name: Required value"));
    }
    validate(&name, &ns, &v)?;
    let mut inner = shared.lock();
    let key = (ns.clone(), name.clone());
    if inner.events.contains_key(&key) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("events.events.k8s.io \"{name}\" already exists"),
        )
        .details(&name, "events"));
    }
    inner.revision += 1;
    let uid = inner.next_uid();
    v["metadata"]["namespace"] = json!(ns);
    v["metadata"]["uid"] = json!(uid);
    v["metadata"]["resourceVersion"] = json!(inner.revision.to_string());
    v["metadata"]["creationTimestamp"] = json!(k8s_openapi::jiff::Timestamp::now().to_string());
    inner.events.insert(key, v.clone());
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::CREATED, &v))
}

async fn patch(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !content_type.starts_with("application/merge-patch+json") {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            format!(
                "the fake API server patches events with application/merge-patch+json, not {content_type}"
            ),
        ));
    }
    let patch: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    let mut inner = shared.lock();
    let key = (ns.clone(), name.clone());
    let mut doc = inner
        .events
        .get(&key)
        .cloned()
        .ok_or_else(|| ApiError::not_found("events.events.k8s.io", &name))?;
    json_patch::merge(&mut doc, &patch);
    validate(&name, &ns, &doc)?;
    inner.revision += 1;
    doc["metadata"]["resourceVersion"] = json!(inner.revision.to_string());
    inner.events.insert(key, doc.clone());
    drop(inner);
    shared.notify();
    Ok(json_response(StatusCode::OK, &doc))
}

async fn list(State(shared): State<AppState>, Path(ns): Path<String>) -> Response {
    let inner = shared.lock();
    let items: Vec<&Value> = inner
        .events
        .iter()
        .filter(|((n, _), _)| *n == ns)
        .map(|(_, v)| v)
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "kind": "EventList",
            "apiVersion": "events.k8s.io/v1",
            "metadata": {"resourceVersion": inner.revision.to_string()},
            "items": items,
        }),
    )
}

async fn get_one(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let inner = shared.lock();
    let v = inner
        .events
        .get(&(ns, name.clone()))
        .ok_or_else(|| ApiError::not_found("events.events.k8s.io", &name))?;
    Ok(json_response(StatusCode::OK, v))
}

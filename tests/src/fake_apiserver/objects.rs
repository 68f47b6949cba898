//! ConfigMaps, Secrets and ServiceAccounts in the fake API server, with the
//! `token` subresource (the TokenRequest API): what the agent's volume
//! plugins read, and what tests store and change.
//!
//! - `GET /api/v1/namespaces/{ns}/configmaps/{name}` and `.../secrets/{name}`:
//!   the stored object (a Secret's `data` base64 on the wire, as the real
//!   one), or 404 `NotFound` with the `metav1.Status` the API server sends.
//! - `GET /api/v1/namespaces/{ns}/services` and `/api/v1/services`: an
//!   empty `ServiceList` (the fake holds no Services; the agent's Service
//!   cache lists them all for the containers' service environment, as the
//!   kubelet's Service informer); with `watch=true` a watch that sends
//!   nothing and ends after its `timeoutSeconds` (default 290 s).
//! - `POST /api/v1/namespaces/{ns}/serviceaccounts/{name}/token`: a
//!   `TokenRequest` in, the same with `status.token` and
//!   `status.expirationTimestamp` out (201). As the API server: the account
//!   must exist (404), `expirationSeconds` must be at least 600 (422
//!   `Invalid`), a bound Pod must exist with the reference's UID (404, 409
//!   `Conflict`). The token is JWT-shaped (header, claims, signature in
//!   base64url) with the claims the API server puts there (`aud`, `exp`,
//!   `iat`, `iss`, `sub`, `kubernetes.io`); its signature is a digest, not
//!   a key's.

use std::collections::BTreeMap;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestStatus};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::json;

use super::{ApiError, AppState, FakeApiServer, json_response};

/// The token issuer the fake names.
pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

#[derive(Debug, Default)]
pub(super) struct Objects {
    config_maps: BTreeMap<(String, String), ConfigMap>,
    secrets: BTreeMap<(String, String), Secret>,
    service_accounts: BTreeMap<(String, String), ServiceAccount>,
    /// Every TokenRequest answered, with its namespace and account.
    tokens: Vec<(String, String, TokenRequest)>,
}

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/api/v1/namespaces/{ns}/configmaps/{name}",
            get(get_config_map),
        )
        .route("/api/v1/namespaces/{ns}/secrets/{name}", get(get_secret))
        .route("/api/v1/namespaces/{ns}/services", get(list_services))
        .route("/api/v1/services", get(list_or_watch_services))
        .route(
            "/api/v1/namespaces/{ns}/serviceaccounts/{name}/token",
            post(create_token),
        )
}

fn key(ns: Option<&String>, name: Option<&String>) -> (String, String) {
    (
        ns.cloned().unwrap_or_else(|| "default".into()),
        name.cloned().expect("an object needs a name"),
    )
}

impl FakeApiServer {
    /// Stores (creates or replaces) a ConfigMap, at a new resourceVersion.
    pub fn put_config_map(&self, mut cm: ConfigMap) -> ConfigMap {
        let mut inner = self.lock();
        inner.revision += 1;
        cm.metadata.resource_version = Some(inner.revision.to_string());
        if cm.metadata.uid.is_none() {
            cm.metadata.uid = Some(inner.next_uid());
        }
        let k = key(cm.metadata.namespace.as_ref(), cm.metadata.name.as_ref());
        cm.metadata.namespace = Some(k.0.clone());
        inner.objects.config_maps.insert(k, cm.clone());
        drop(inner);
        self.notify();
        cm
    }

    /// Stores (creates or replaces) a Secret.
    pub fn put_secret(&self, mut s: Secret) -> Secret {
        let mut inner = self.lock();
        inner.revision += 1;
        s.metadata.resource_version = Some(inner.revision.to_string());
        if s.metadata.uid.is_none() {
            s.metadata.uid = Some(inner.next_uid());
        }
        let k = key(s.metadata.namespace.as_ref(), s.metadata.name.as_ref());
        s.metadata.namespace = Some(k.0.clone());
        inner.objects.secrets.insert(k, s.clone());
        drop(inner);
        self.notify();
        s
    }

    /// Creates the ServiceAccount `ns/name`; returns its UID.
    pub fn add_service_account(&self, ns: &str, name: &str) -> String {
        let mut inner = self.lock();
        inner.revision += 1;
        let uid = inner.next_uid();
        let sa: ServiceAccount = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "uid": uid,
                         "resourceVersion": inner.revision.to_string()}
        }))
        .expect("a valid service account");
        inner
            .objects
            .service_accounts
            .insert((ns.to_owned(), name.to_owned()), sa);
        drop(inner);
        self.notify();
        uid
    }

    /// The TokenRequests answered: (namespace, account, request with status).
    pub fn token_requests(&self) -> Vec<(String, String, TokenRequest)> {
        self.lock().objects.tokens.clone()
    }
}

/// An empty list, or a watch on it that sends nothing until its timeout.
async fn list_or_watch_services(
    axum::extract::Query(query): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Response {
    if query.get("watch").map(String::as_str) != Some("true") {
        return list_services().await;
    }
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .unwrap_or(290);
    let body = futures::stream::once(async move {
        tokio::time::sleep(std::time::Duration::from_secs(timeout)).await;
        Ok::<_, std::convert::Infallible>(Bytes::new())
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(axum::body::Body::from_stream(body))
        .unwrap_or_else(|e| panic!("a watch response: {e}"))
}

async fn list_services() -> Response {
    json_response(
        StatusCode::OK,
        &json!({"kind": "ServiceList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": []}),
    )
}

async fn get_config_map(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let inner = shared.lock();
    let cm = inner
        .objects
        .config_maps
        .get(&(ns, name.clone()))
        .ok_or_else(|| ApiError::not_found("configmaps", &name))?;
    Ok(json_response(StatusCode::OK, &with_kind(cm, "ConfigMap")))
}

async fn get_secret(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let inner = shared.lock();
    let s = inner
        .objects
        .secrets
        .get(&(ns, name.clone()))
        .ok_or_else(|| ApiError::not_found("secrets", &name))?;
    Ok(json_response(StatusCode::OK, &with_kind(s, "Secret")))
}

fn with_kind(o: &impl serde::Serialize, kind: &str) -> serde_json::Value {
    let mut v = serde_json::to_value(o).expect("objects serialise");
    v["kind"] = json!(kind);
    v["apiVersion"] = json!("v1");
    v
}

async fn create_token(
    State(shared): State<AppState>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut request: TokenRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("error decoding the request body: {e}")))?;
    let mut inner = shared.lock();
    let sa = inner
        .objects
        .service_accounts
        .get(&(ns.clone(), name.clone()))
        .cloned()
        .ok_or_else(|| ApiError::not_found("serviceaccounts", &name))?;
    let expiration = request.spec.expiration_seconds.unwrap_or(3600);
    if expiration < 600 {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!(
                "TokenRequest.authentication.k8s.io \"{name}\" is invalid: spec.expirationSeconds: Invalid value: {expiration}: may not specify a duration less than 10 minutes"
            ),
        ));
    }
    let mut pod_claim = serde_json::Value::Null;
    if let Some(bound) = &request.spec.bound_object_ref {
        let pod_name = bound.name.clone().unwrap_or_default();
        let pod = inner
            .pods
            .get(&(ns.clone(), pod_name.clone()))
            .ok_or_else(|| ApiError::not_found("pods", &pod_name))?;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if bound.uid.as_deref() != Some(uid.as_str()) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on pods \"{pod_name}\": the UID in the bound object reference ({}) does not match the UID in record. The object might have been deleted and then recreated",
                    bound.uid.clone().unwrap_or_default()
                ),
            ));
        }
        pod_claim = json!({"name": pod_name, "uid": uid});
    }
    let now = k8s_openapi::jiff::Timestamp::now();
    let iat = now.as_second();
    let exp = iat + expiration;
    let audiences = if request.spec.audiences.is_empty() {
        vec![ISSUER.to_owned()]
    } else {
        request.spec.audiences.clone()
    };
    let claims = json!({
        "aud": audiences, "exp": exp, "iat": iat, "nbf": iat, "iss": ISSUER,
        "sub": format!("system:serviceaccount:{ns}:{name}"),
        "kubernetes.io": {"namespace": ns, "pod": pod_claim,
                          "serviceaccount": {"name": name, "uid": sa.metadata.uid}},
    });
    let header = json!({"alg": "RS256", "kid": "fake"});
    let unsigned = format!(
        "{}.{}",
        base64url(header.to_string().as_bytes()),
        base64url(claims.to_string().as_bytes())
    );
    let signature = base64url(&digest(unsigned.as_bytes()).to_le_bytes());
    request.status = Some(TokenRequestStatus {
        token: format!("{unsigned}.{signature}"),
        expiration_timestamp: Time(
            k8s_openapi::jiff::Timestamp::from_second(exp).expect("a valid expiry"),
        ),
    });
    request.metadata.name = Some(name.clone());
    request.metadata.namespace = Some(ns.clone());
    inner.objects.tokens.push((ns, name, request.clone()));
    drop(inner);
    shared.notify();
    let mut v = serde_json::to_value(&request).expect("token requests serialise");
    v["kind"] = json!("TokenRequest");
    v["apiVersion"] = json!("authentication.k8s.io/v1");
    Ok(json_response(StatusCode::CREATED, &v))
}

/// FNV-1a: the fake's "signature".
fn digest(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Base64url without padding (RFC 4648 §5), as JWTs use it.
pub fn base64url(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// Decodes [`base64url`] (for tests reading a token's claims).
pub fn base64url_decode(s: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::new();
    for chunk in s.as_bytes().chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= value(*c)? << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len().saturating_sub(1)]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_round_trips() {
        assert_eq!(base64url(b"hello"), "aGVsbG8");
        assert_eq!(base64url(b"\xfb\xff"), "-_8");
        for s in ["", "a", "ab", "abc", "abcd", "{\"aud\":[\"x\"]}"] {
            assert_eq!(
                base64url_decode(&base64url(s.as_bytes())).unwrap(),
                s.as_bytes()
            );
        }
    }
}

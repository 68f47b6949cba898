//! `evpleg describe pod NAME|UID`: a `kubectl describe pod`-like view of a pod
//! the agent runs, read from its local endpoint (`GET /pods`, then
//! `GET /pods/<namespace>/<name>/events`); the text is [`format`]'s.

pub mod format;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::{Event, Pod};

/// How long a request may take.
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a pod could not be described.
#[derive(Debug, thiserror::Error)]
pub enum DescribeError {
    #[error("server {server:?} is not an http:// URL")]
    BadServer { server: String },
    #[error("GET {url}: {message}")]
    Request { url: String, message: String },
    #[error("GET {url}: status {status}")]
    Status { url: String, status: u16 },
    #[error("GET {url}: not the expected JSON: {message}")]
    Decode { url: String, message: String },
    #[error("pod {pod:?} not found at {server}")]
    NotFound { pod: String, server: String },
    #[error("pod name {pod:?} is in several namespaces ({namespaces}): pass --namespace")]
    Ambiguous { pod: String, namespaces: String },
}

async fn get_json<T: serde::de::DeserializeOwned>(url: &str) -> Result<T, DescribeError> {
    let uri: hyper::Uri = url.parse().map_err(|e| DescribeError::Request {
        url: url.to_owned(),
        message: format!("{e}"),
    })?;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let err = |message: String| DescribeError::Request {
        url: url.to_owned(),
        message,
    };
    let response = tokio::time::timeout(TIMEOUT, client.get(uri))
        .await
        .map_err(|_| err(format!("no answer within {TIMEOUT:?}")))?
        .map_err(|e| err(e.to_string()))?;
    let status = response.status().as_u16();
    if status != 200 {
        return Err(DescribeError::Status {
            url: url.to_owned(),
            status,
        });
    }
    let body = tokio::time::timeout(TIMEOUT, response.into_body().collect())
        .await
        .map_err(|_| err(format!("no answer within {TIMEOUT:?}")))?
        .map_err(|e| err(e.to_string()))?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| DescribeError::Decode {
        url: url.to_owned(),
        message: e.to_string(),
    })
}

#[derive(serde::Deserialize)]
struct List<T> {
    items: Vec<T>,
}

/// The pod named `pod` (a name, in `namespace` when given, or a UID) among
/// `pods`.
pub fn find_pod<'a>(
    pods: &'a [Pod],
    pod: &str,
    namespace: Option<&str>,
    server: &str,
) -> Result<&'a Pod, DescribeError> {
    if let Some(p) = pods.iter().find(|p| p.metadata.uid.as_deref() == Some(pod)) {
        return Ok(p);
    }
    let named: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.metadata.name.as_deref() == Some(pod))
        .filter(|p| {
            namespace.is_none_or(|ns| p.metadata.namespace.as_deref().unwrap_or("default") == ns)
        })
        .collect();
    match named.as_slice() {
        [] => Err(DescribeError::NotFound {
            pod: pod.to_owned(),
            server: server.to_owned(),
        }),
        [one] => Ok(one),
        many => Err(DescribeError::Ambiguous {
            pod: pod.to_owned(),
            namespaces: many
                .iter()
                .map(|p| p.metadata.namespace.clone().unwrap_or_default())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// Describes pod `pod` (name or UID) as the agent at `server`
/// (`http://host:port`) knows it.
pub async fn describe_pod(
    server: &str,
    pod: &str,
    namespace: Option<&str>,
) -> Result<String, DescribeError> {
    let base = server.trim_end_matches('/');
    if !base.starts_with("http://") {
        return Err(DescribeError::BadServer {
            server: server.to_owned(),
        });
    }
    let pods: List<Pod> = get_json(&format!("{base}/pods")).await?;
    let found = find_pod(&pods.items, pod, namespace, base)?;
    let ns = found.metadata.namespace.as_deref().unwrap_or("default");
    let name = found.metadata.name.as_deref().unwrap_or_default();
    let events: List<Event> = get_json(&format!("{base}/pods/{ns}/{name}/events")).await?;
    let now = k8s_openapi::jiff::Timestamp::now();
    Ok(format::describe_pod(found, &events.items, now))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, uid: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": ns, "uid": uid}
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_is_found_by_uid_or_name_and_an_ambiguous_name_is_an_error() {
        let pods = [
            pod("a", "web", "u1"),
            pod("b", "web", "u2"),
            pod("a", "db", "u3"),
        ];
        let name = |p: &Pod| p.metadata.uid.clone().unwrap();
        assert_eq!(name(find_pod(&pods, "u2", None, "s").unwrap()), "u2");
        assert_eq!(name(find_pod(&pods, "db", None, "s").unwrap()), "u3");
        assert_eq!(name(find_pod(&pods, "web", Some("b"), "s").unwrap()), "u2");
        let e = find_pod(&pods, "web", None, "s").unwrap_err().to_string();
        assert_eq!(
            e,
            "pod name \"web\" is in several namespaces (a, b): pass --namespace"
        );
        let e = find_pod(&pods, "nope", None, "http://x")
            .unwrap_err()
            .to_string();
        assert_eq!(e, "pod \"nope\" not found at http://x");
    }

    #[tokio::test]
    async fn an_unreachable_or_bad_server_is_an_error_naming_it() {
        let e = describe_pod("https://x", "p", None).await.unwrap_err();
        assert_eq!(e.to_string(), "server \"https://x\" is not an http:// URL");
        // A port nothing listens on (bound, then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = describe_pod(&format!("http://127.0.0.1:{port}"), "p", None)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("GET http://127.0.0.1:{port}/pods: ")),
            "{e}"
        );
    }
}

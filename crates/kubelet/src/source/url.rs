//! Static pods from a manifest URL, polled (the kubelet's legacy HTTP source,
//! `pkg/kubelet/config/http.go`).
//!
//! Every period (20 s by default, the kubelet's `--http-check-frequency`) the source
//! GETs the URL, with the configured headers and a 10 s timeout. The body is one pod, a
//! `PodList`, or several YAML or JSON documents (see [`file`](super::file) for the
//! formats, the validation and the static pod defaults; the UID hashes `url:<url>`
//! where a file's hashes its path, and `config.source` is `http`). A changed body is
//! sent as an [`Op::Set`]; an unchanged one sends nothing, as in the kubelet.
//!
//! A failure (connection, timeout, a status other than 200, an empty or invalid body)
//! is logged at warn naming the URL (the first three in a row, then at debug, as the
//! kubelet does), kept in [`UrlSource::error`], and **the last good set stays**. The
//! kubelet sends an empty set for an empty body, which removes every pod of the URL;
//! evpleg treats it as a failure and keeps the pods, but still sends one empty set when
//! none was sent before, so that the source counts as seen. Other differences: redirects
//! are not followed, and bodies over 16 MiB are refused. `https` URLs are verified
//! against the system's root certificates.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Request, StatusCode, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Pod;
use tokio::sync::{mpsc, watch};
use tokio::time::MissedTickBehavior;
use tracing::{debug, info, warn};

use super::file::{DecodeError, Origin, load_static_pods};
use super::{Op, PodUpdate, SourceName};

/// The result of the URL source.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The kubelet's `--http-check-frequency` default.
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(20);
/// The kubelet's client timeout for the manifest URL.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest body read.
const MAX_BODY: usize = 16 << 20;
/// Failures in a row logged at warn before the rest go to debug.
const LOUD_FAILURES: u32 = 3;

/// Why the manifest URL gave no pods this time. All are retried at the next period;
/// the last good pods stay meanwhile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// invalid manifest url {url}: {reason}
    #[error("invalid manifest url {url}: {reason}")]
    InvalidUrl { url: String, reason: String },
    /// invalid header {name} for manifest url {url}
    #[error("invalid header {name} for manifest url {url}")]
    InvalidHeader { url: String, name: String },
    /// cannot set up tls for manifest url {url}: {source}
    #[error("cannot set up tls for manifest url {url}: {source}")]
    Tls { url: String, source: std::io::Error },
    /// cannot get manifest url {url}: {source}
    #[error("cannot get manifest url {url}: {source}")]
    Request {
        url: String,
        source: hyper_util::client::legacy::Error,
    },
    /// manifest url {url} did not answer within {timeout:?}
    #[error("manifest url {url} did not answer within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    /// manifest url {url} answered {status}
    #[error("manifest url {url} answered {status}")]
    Status { url: String, status: StatusCode },
    /// cannot read the body of manifest url {url}: {reason}
    #[error("cannot read the body of manifest url {url}: {reason}")]
    Body { url: String, reason: String },
    /// manifest url {url} sent an empty body
    #[error("manifest url {url} sent an empty body")]
    Empty { url: String },
    /// manifest url {url}, document {index}: {source}
    #[error("manifest url {url}, document {index}: {source}")]
    Document {
        url: String,
        /// The document, counted from 1.
        index: usize,
        source: DecodeError,
    },
}

/// How to poll a manifest URL.
#[derive(Clone, Debug)]
pub struct UrlSourceConfig {
    pub url: String,
    /// Headers sent with every request (the kubelet's `--manifest-url-header`).
    pub headers: Vec<(String, String)>,
    pub node_name: String,
    /// Between two GETs.
    pub period: Duration,
    /// For one GET, body included.
    pub timeout: Duration,
}

impl UrlSourceConfig {
    /// The kubelet's defaults: every 20 s, 10 s timeout, no headers.
    pub fn new(url: impl Into<String>, node_name: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            headers: Vec::new(),
            node_name: node_name.into(),
            period: DEFAULT_PERIOD,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

#[derive(Debug)]
enum HttpClient {
    Http(Client<HttpConnector, Empty<Bytes>>),
    Https(Client<HttpsConnector<HttpConnector>, Empty<Bytes>>),
}

/// The manifest URL source. Create it, keep [`UrlSource::subscribe_error`] if the
/// errors are wanted, then spawn [`UrlSource::run`] (or call [`UrlSource::poll`]).
#[derive(Debug)]
pub struct UrlSource {
    config: UrlSourceConfig,
    uri: Uri,
    headers: Vec<(HeaderName, HeaderValue)>,
    client: HttpClient,
    /// The last body received and its error if it was bad: an unchanged body is not
    /// parsed again.
    last_body: Option<(Bytes, Option<Arc<Error>>)>,
    /// The pods of the last good body.
    pods: Vec<Arc<Pod>>,
    /// Whether a set was sent (the source counts as seen).
    sent: bool,
    failures: u32,
    error: watch::Sender<Option<Arc<Error>>>,
}

impl UrlSource {
    pub fn new(config: UrlSourceConfig) -> Result<Self> {
        let url = config.url.clone();
        let uri: Uri = config
            .url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| Error::InvalidUrl {
                url: url.clone(),
                reason: e.to_string(),
            })?;
        let mut headers = Vec::new();
        for (name, value) in &config.headers {
            let invalid = || Error::InvalidHeader {
                url: url.clone(),
                name: name.clone(),
            };
            headers.push((
                HeaderName::try_from(name.as_str()).map_err(|_| invalid())?,
                HeaderValue::try_from(value.as_str()).map_err(|_| invalid())?,
            ));
        }
        let builder = Client::builder(TokioExecutor::new());
        let client = match uri.scheme_str() {
            Some("http") => HttpClient::Http(builder.build_http()),
            Some("https") => {
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let connector = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_provider_and_native_roots(provider)
                    .map_err(|source| Error::Tls {
                        url: url.clone(),
                        source,
                    })?
                    .https_only()
                    .enable_http1()
                    .build();
                HttpClient::Https(builder.build(connector))
            }
            _ => {
                return Err(Error::InvalidUrl {
                    url,
                    reason: "the scheme is not http or https".into(),
                });
            }
        };
        Ok(Self {
            config,
            uri,
            headers,
            client,
            last_body: None,
            pods: Vec::new(),
            sent: false,
            failures: 0,
            error: watch::Sender::new(None),
        })
    }

    pub fn url(&self) -> &str {
        &self.config.url
    }

    /// The last failure, until a GET succeeds again.
    pub fn error(&self) -> Option<Arc<Error>> {
        self.error.borrow().clone()
    }

    /// The last failure as it changes; usable after `run` took `self`.
    pub fn subscribe_error(&self) -> watch::Receiver<Option<Arc<Error>>> {
        self.error.subscribe()
    }

    /// The pods of the last good body.
    pub fn pods(&self) -> &[Arc<Pod>] {
        &self.pods
    }

    /// GETs the URL once. Returns the set to send: the new pods when the body changed
    /// and is good, an empty set when it failed and none was ever sent, else `None`.
    pub async fn poll(&mut self) -> Option<PodUpdate> {
        let changed = match self.fetch().await {
            Ok(changed) => {
                if self.failures > 0 {
                    info!(url = %self.config.url, "manifest url readable again");
                }
                self.failures = 0;
                self.error.send_replace(None);
                changed
            }
            Err(e) => {
                if self.failures < LOUD_FAILURES {
                    warn!(url = %self.config.url, "{e}");
                } else {
                    debug!(url = %self.config.url, "{e}");
                }
                self.failures = self.failures.saturating_add(1);
                self.error.send_replace(Some(e));
                false
            }
        };
        (changed || !self.sent).then(|| {
            self.sent = true;
            PodUpdate {
                op: Op::Set,
                source: SourceName::Http,
                pods: self.pods.clone(),
            }
        })
    }

    /// GETs and parses; Ok(true) when the pods are new.
    async fn fetch(&mut self) -> Result<bool, Arc<Error>> {
        let url = &self.config.url;
        let timeout = self.config.timeout;
        let get = get(&self.client, &self.uri, &self.headers, url);
        let body = tokio::time::timeout(timeout, get)
            .await
            .unwrap_or_else(|_| {
                Err(Error::Timeout {
                    url: url.clone(),
                    timeout,
                })
            })
            .map_err(Arc::new)?;
        if body.is_empty() {
            return Err(Arc::new(Error::Empty { url: url.clone() }));
        }
        if let Some((last, verdict)) = &self.last_body
            && *last == body
        {
            // Unchanged: the last verdict stands.
            return match verdict {
                Some(e) => Err(e.clone()),
                None => Ok(false),
            };
        }
        let origin = Origin {
            source: SourceName::Http,
            location: url,
            node_name: &self.config.node_name,
        };
        let result = load_static_pods(&body, origin, &self.pods).map_err(|(index, source)| {
            Arc::new(Error::Document {
                url: url.clone(),
                index,
                source,
            })
        });
        self.last_body = Some((body, result.as_ref().err().cloned()));
        let pods = result?;
        info!(url = %self.config.url, pods = pods.len(), "manifest url read");
        self.pods = pods;
        Ok(true)
    }

    /// Polls every period and sends sets to `out` until its receiver is gone. The
    /// first GET is at once.
    pub async fn run(mut self, out: mpsc::Sender<PodUpdate>) {
        info!(url = %self.config.url, period = ?self.config.period, "polling the manifest url");
        let mut ticks = tokio::time::interval(self.config.period);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = out.closed() => return,
            }
            if let Some(update) = self.poll().await
                && out.send(update).await.is_err()
            {
                return;
            }
        }
    }
}

async fn get(
    client: &HttpClient,
    uri: &Uri,
    headers: &[(HeaderName, HeaderValue)],
    url: &str,
) -> Result<Bytes> {
    let mut request = Request::get(uri.clone());
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let request = request.body(Empty::new()).map_err(|e| Error::InvalidUrl {
        url: url.to_owned(),
        reason: e.to_string(),
    })?;
    let response = match client {
        HttpClient::Http(c) => c.request(request).await,
        HttpClient::Https(c) => c.request(request).await,
    }
    .map_err(|source| Error::Request {
        url: url.to_owned(),
        source,
    })?;
    let status = response.status();
    if status != StatusCode::OK {
        return Err(Error::Status {
            url: url.to_owned(),
            status,
        });
    }
    let body = Limited::new(response.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| Error::Body {
            url: url.to_owned(),
            reason: e.to_string(),
        })?;
    Ok(body.to_bytes())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use axum::Router;
    use axum::extract::State;
    use axum::http::HeaderMap;
    use axum::routing::get;

    use super::*;

    const WAIT: Duration = Duration::from_secs(10);

    /// What the test server answers, and the headers it last received.
    #[derive(Clone, Default)]
    struct Served {
        answer: Arc<Mutex<(u16, String)>>,
        seen_header: Arc<Mutex<Option<String>>>,
    }

    impl Served {
        fn set(&self, status: u16, body: &str) {
            *self.answer.lock().unwrap() = (status, body.to_owned());
        }
    }

    async fn serve(state: Served) -> String {
        async fn handler(
            State(s): State<Served>,
            headers: HeaderMap,
        ) -> (axum::http::StatusCode, String) {
            *s.seen_header.lock().unwrap() = headers
                .get("x-token")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let (status, body) = s.answer.lock().unwrap().clone();
            (axum::http::StatusCode::from_u16(status).unwrap(), body)
        }
        let app = Router::new().route("/pods", get(handler)).with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        format!("http://{addr}/pods")
    }

    fn manifest(name: &str, image: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  containers:\n  - name: c\n    image: {image}\n"
        )
    }

    fn names(update: &PodUpdate) -> Vec<String> {
        update
            .pods
            .iter()
            .map(|p| p.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    async fn poll(source: &mut UrlSource) -> Option<PodUpdate> {
        tokio::time::timeout(WAIT, source.poll())
            .await
            .expect("a poll within the timeout")
    }

    #[tokio::test]
    async fn polls_a_pod_then_a_list_then_documents_and_keeps_the_last_good_set() {
        let served = Served::default();
        served.set(200, &manifest("web", "nginx"));
        let url = serve(served.clone()).await;
        let mut config = UrlSourceConfig::new(&url, "node-1");
        config.headers.push(("X-Token".into(), "secret".into()));
        let mut source = UrlSource::new(config).unwrap();

        let set = poll(&mut source).await.expect("the first body is a set");
        assert_eq!((set.op, set.source), (Op::Set, SourceName::Http));
        assert_eq!(names(&set), ["web-node-1"]);
        let pod = &set.pods[0];
        let annots = pod.metadata.annotations.as_ref().unwrap();
        assert_eq!(annots[super::super::annotations::CONFIG_SOURCE], "http");
        assert_eq!(
            annots[super::super::annotations::CONFIG_HASH],
            *pod.metadata.uid.as_ref().unwrap()
        );
        assert!(
            pod.spec.as_ref().unwrap().tolerations.is_none(),
            "the toleration is for files only"
        );
        assert_eq!(
            served.seen_header.lock().unwrap().as_deref(),
            Some("secret")
        );
        // Unchanged: nothing to send.
        assert!(poll(&mut source).await.is_none());

        // A PodList (JSON), then two YAML documents.
        served.set(
            200,
            r#"{"apiVersion":"v1","kind":"PodList","items":[{"apiVersion":"v1","kind":"Pod","metadata":{"name":"a"},"spec":{"containers":[{"name":"c","image":"i"}]}}]}"#,
        );
        assert_eq!(names(&poll(&mut source).await.unwrap()), ["a-node-1"]);
        served.set(
            200,
            &format!("{}---\n{}", manifest("b", "i"), manifest("c", "i")),
        );
        let good = poll(&mut source).await.unwrap();
        assert_eq!(names(&good), ["b-node-1", "c-node-1"]);

        // Garbage: an error naming the URL and the document, no set, the pods stay.
        served.set(200, &format!("{}---\n{{not: [yaml", manifest("d", "i")));
        assert!(poll(&mut source).await.is_none());
        let e = source.error().expect("an error").to_string();
        assert!(e.contains(&url) && e.contains("document 2"), "{e}");
        assert_eq!(source.pods(), good.pods.as_slice());
        // Still garbage: still an error.
        assert!(poll(&mut source).await.is_none());
        assert!(source.error().is_some());
        // A server error and an empty body too.
        served.set(500, "oops");
        assert!(poll(&mut source).await.is_none());
        assert!(source.error().unwrap().to_string().contains("500"));
        served.set(200, "");
        assert!(poll(&mut source).await.is_none());
        assert!(matches!(*source.error().unwrap(), Error::Empty { .. }));
        assert_eq!(source.pods(), good.pods.as_slice());

        // Back to good: the error clears and the new set goes out.
        served.set(200, &manifest("e", "i"));
        assert_eq!(names(&poll(&mut source).await.unwrap()), ["e-node-1"]);
        assert!(source.error().is_none());
    }

    #[tokio::test]
    async fn uid_depends_on_the_url_and_the_manifest() {
        let served = Served::default();
        served.set(200, &manifest("web", "nginx"));
        let url = serve(served.clone()).await;
        let uid = |u: &PodUpdate| u.pods[0].metadata.uid.clone().unwrap();
        let mut a = UrlSource::new(UrlSourceConfig::new(&url, "n")).unwrap();
        let first = uid(&poll(&mut a).await.unwrap());
        let mut b = UrlSource::new(UrlSourceConfig::new(format!("{url}?x=1"), "n")).unwrap();
        assert_ne!(uid(&poll(&mut b).await.unwrap()), first);
        let mut c = UrlSource::new(UrlSourceConfig::new(&url, "n")).unwrap();
        assert_eq!(
            uid(&poll(&mut c).await.unwrap()),
            first,
            "stable across restarts"
        );
        served.set(200, &manifest("web", "nginx:2"));
        assert_ne!(uid(&poll(&mut a).await.unwrap()), first);
    }

    #[tokio::test]
    async fn unreachable_url_sends_one_empty_set_and_reports_the_url() {
        // A port nothing listens on: bind, learn the port, close.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/pods", listener.local_addr().unwrap());
        drop(listener);
        let mut source = UrlSource::new(UrlSourceConfig::new(&url, "n")).unwrap();
        let set = poll(&mut source)
            .await
            .expect("an empty set marks the source seen");
        assert!(set.pods.is_empty());
        assert!(source.error().unwrap().to_string().contains(&url));
        assert!(poll(&mut source).await.is_none());
    }

    #[test]
    fn bad_urls_and_headers_are_refused() {
        for url in ["ftp://x/y", "not a url", "/relative"] {
            let e = UrlSource::new(UrlSourceConfig::new(url, "n")).unwrap_err();
            assert!(matches!(e, Error::InvalidUrl { .. }), "{url}: {e}");
            assert!(e.to_string().contains(url), "{e}");
        }
        let mut config = UrlSourceConfig::new("http://127.0.0.1/", "n");
        config.headers.push(("bad header".into(), "v".into()));
        assert!(matches!(
            UrlSource::new(config),
            Err(Error::InvalidHeader { .. })
        ));
    }

    #[tokio::test]
    async fn run_polls_every_period() {
        let served = Served::default();
        served.set(200, &manifest("web", "nginx"));
        let url = serve(served.clone()).await;
        let mut config = UrlSourceConfig::new(&url, "node-1");
        config.period = Duration::from_millis(50);
        let source = UrlSource::new(config).unwrap();
        let mut errors = source.subscribe_error();
        let (tx, mut rx) = mpsc::channel(8);
        let task = tokio::spawn(source.run(tx));
        let mut next = async || {
            tokio::time::timeout(WAIT, rx.recv())
                .await
                .expect("a set within the timeout")
                .expect("the source runs")
        };
        let first = next().await;
        assert_eq!(names(&first), ["web-node-1"]);
        // Garbage: an error, and no set.
        served.set(200, "kind: Service\napiVersion: v1\n");
        let e = tokio::time::timeout(WAIT, errors.wait_for(Option::is_some))
            .await
            .expect("an error within the timeout")
            .unwrap()
            .clone()
            .unwrap();
        assert!(e.to_string().contains("Service"), "{e}");
        // Changed: the new set.
        served.set(200, &manifest("api", "nginx"));
        let second = next().await;
        assert_eq!(names(&second), ["api-node-1"]);
        assert!(errors.borrow().is_none());
        task.abort();
    }
}

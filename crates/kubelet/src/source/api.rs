//! The API server source: the pods bound to this node (the kubelet's
//! `pkg/kubelet/config/apiserver.go`).
//!
//! # What it reproduces
//!
//! The kubelet's `NewSourceApiserver` runs a client-go reflector on `pods` in all
//! namespaces with the field selector `spec.nodeName=<node>`, into an
//! `UndeltaStore` that pushes the store's full contents as a `SET` from source
//! `api` after every change; its config mux then diffs each set against what it
//! has (new pods ADD, changed specs UPDATE, a new deletionTimestamp DELETE,
//! status-only changes RECONCILE, missing pods REMOVE). The reflector lists, then
//! watches from the list's resourceVersion; on a dropped watch it resumes from the
//! last resourceVersion, on 410 Expired it relists; errors back off exponentially
//! with jitter (800 ms doubling to 30 s, reset after 2 min of health) and it
//! retries forever.
//!
//! evpleg uses kube-runtime's [`watcher`], which is that reflector (same
//! list/watch/resume/relist logic, same default backoff), and keeps the `SET` for
//! what needs one: a watcher (re)list is bracketed by `Init` / `InitApply` /
//! `InitDone` and becomes one `SET` of exactly the re-listed pods, so a pod that was
//! deleted or moved while the watch was down disappears (the relist contract).
//! Between lists each watch event goes alone, which gives the mux the same result
//! as the kubelet's full set at O(1) per event instead of O(pods on the node):
//! `ADDED`/`MODIFIED` become an `UPDATE` of that pod (the mux turns it into ADD,
//! UPDATE, DELETE or RECONCILE as it would for a set), `DELETED` (including a pod
//! leaving the field selector, e.g. rebound to another node) becomes a `REMOVE`.
//! Every pod carries `kubernetes.io/config.source: api`.
//!
//! Errors are logged with the node name and never end the source: the watcher's
//! stream is wrapped in the reflector's backoff ([`SourceBackoff`]).
//!
//! The client should be built with `kube::Config::default_retry = false`: kube 5
//! otherwise retries 429/503/504 up to 15 times inside the client, under the
//! watcher's own backoff.

use std::fmt;
use std::future;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::ResetTimerBackoff;
use kube::runtime::watcher::{self, Event, ExponentialBackoff};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{Op, PodUpdate, SourceName, annotations};

/// The reconnect backoff: exponential with full jitter between `min` and `max`,
/// reset once the stream has been healthy for `reset_after`. The defaults are
/// client-go's reflector's (and kube-runtime's `default_backoff`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SourceBackoff {
    pub min: Duration,
    pub max: Duration,
    pub reset_after: Duration,
}

impl Default for SourceBackoff {
    fn default() -> Self {
        Self {
            min: Duration::from_millis(800),
            max: Duration::from_secs(30),
            reset_after: Duration::from_secs(120),
        }
    }
}

impl SourceBackoff {
    pub(crate) fn build(&self) -> ResetTimerBackoff<ExponentialBackoff> {
        let builder = backon::ExponentialBuilder::default()
            .with_min_delay(self.min)
            .with_max_delay(self.max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times();
        ResetTimerBackoff::new(ExponentialBackoff::from(builder), self.reset_after)
    }
}

/// The API server pod source for one node.
pub struct ApiSource {
    client: kube::Client,
    node_name: String,
    backoff: SourceBackoff,
    watch_timeout: Option<u32>,
}

impl fmt::Debug for ApiSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiSource")
            .field("node_name", &self.node_name)
            .field("backoff", &self.backoff)
            .field("watch_timeout", &self.watch_timeout)
            .finish_non_exhaustive()
    }
}

impl ApiSource {
    pub fn new(client: kube::Client, node_name: impl Into<String>) -> Self {
        Self {
            client,
            node_name: node_name.into(),
            backoff: SourceBackoff::default(),
            watch_timeout: None,
        }
    }

    /// Replaces the reconnect backoff (tests use a short one).
    #[must_use]
    pub fn with_backoff(mut self, backoff: SourceBackoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The server-side timeout of each watch request, in seconds (kube's default:
    /// 290). The watcher resumes from the last resourceVersion when it ends.
    #[must_use]
    pub fn with_watch_timeout(mut self, seconds: u32) -> Self {
        self.watch_timeout = Some(seconds);
        self
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The field selector of the list and the watch.
    pub fn field_selector(&self) -> String {
        format!("spec.nodeName={}", self.node_name)
    }

    /// The source's updates, forever: a `SET` after each (re)list, then one
    /// `UPDATE` or `REMOVE` per watch event. Errors are logged and retried with
    /// backoff; the stream never ends.
    pub fn updates(self) -> impl Stream<Item = PodUpdate> + Send + 'static {
        let mut config = watcher::Config::default().fields(&self.field_selector());
        let api: Api<Pod> = Api::all(self.client);
        if let Some(t) = self.watch_timeout {
            config = config.timeout(t);
        }
        let backoff = self.backoff.build();
        let node = self.node_name;
        let mut translator = Translator::default();
        watcher::watcher(api, config)
            .backoff(backoff)
            .filter_map(move |item| {
                let update = match item {
                    Ok(event) => translator.translate(event),
                    Err(e) => {
                        warn!(node = %node, error = %e, "api source: listing or watching this node's pods failed; retrying with backoff");
                        None
                    }
                };
                if let Some(u) = &update {
                    match u.op {
                        Op::Set => {
                            info!(node = %node, pods = u.pods.len(), "api source: listed this node's pods")
                        }
                        op => debug!(node = %node, ?op, pod = %full_name(&u.pods[0]), "api source: watch event"),
                    }
                }
                future::ready(update)
            })
    }

    /// Sends the source's updates to `out` until its receiver is gone.
    pub async fn run(self, out: mpsc::Sender<PodUpdate>) {
        info!(node = %self.node_name, selector = %self.field_selector(), "api source: watching pods bound to this node");
        let updates = self.updates();
        let mut updates = std::pin::pin!(updates);
        loop {
            tokio::select! {
                next = updates.next() => match next {
                    Some(update) => {
                        if out.send(update).await.is_err() {
                            return;
                        }
                    }
                    None => return,
                },
                () = out.closed() => return,
            }
        }
    }
}

/// Turns the watcher's events into pod updates, buffering a relist into one set.
#[derive(Debug, Default)]
pub(crate) struct Translator {
    /// The pods of the relist in progress (between `Init` and `InitDone`).
    relisting: Option<Vec<Arc<Pod>>>,
}

impl Translator {
    pub(crate) fn translate(&mut self, event: Event<Pod>) -> Option<PodUpdate> {
        match event {
            Event::Init => {
                self.relisting = Some(Vec::new());
                None
            }
            Event::InitApply(pod) => {
                self.relisting
                    .get_or_insert_with(Vec::new)
                    .push(annotated(pod));
                None
            }
            Event::InitDone => Some(update(Op::Set, self.relisting.take().unwrap_or_default())),
            Event::Apply(pod) => Some(update(Op::Update, vec![annotated(pod)])),
            Event::Delete(pod) => Some(update(Op::Remove, vec![annotated(pod)])),
        }
    }
}

fn update(op: Op, pods: Vec<Arc<Pod>>) -> PodUpdate {
    PodUpdate {
        op,
        source: SourceName::Api,
        pods,
    }
}

fn annotated(mut pod: Pod) -> Arc<Pod> {
    pod.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            annotations::CONFIG_SOURCE.to_string(),
            SourceName::Api.as_str().to_string(),
        );
    Arc::new(pod)
}

fn full_name(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn pod(name: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                uid: Some(format!("uid-{name}")),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    fn names(update: &PodUpdate) -> Vec<&str> {
        update
            .pods
            .iter()
            .map(|p| p.metadata.name.as_deref().unwrap_or_default())
            .collect()
    }

    #[test]
    fn api_relist_becomes_one_set_of_exactly_the_listed_pods() {
        let mut t = Translator::default();
        assert!(t.translate(Event::Init).is_none());
        assert!(t.translate(Event::InitApply(pod("a"))).is_none());
        assert!(t.translate(Event::InitApply(pod("b"))).is_none());
        let set = t.translate(Event::InitDone).expect("a set at InitDone");
        assert_eq!(set.op, Op::Set);
        assert_eq!(set.source, SourceName::Api);
        assert_eq!(names(&set), ["a", "b"]);

        // A relist that no longer has `a`: the set leaves it out, so the mux removes it.
        t.translate(Event::Init);
        t.translate(Event::InitApply(pod("b")));
        let set = t.translate(Event::InitDone).expect("a set at InitDone");
        assert_eq!(names(&set), ["b"]);
    }

    #[test]
    fn api_relist_of_nothing_is_an_empty_set() {
        let mut t = Translator::default();
        t.translate(Event::Init);
        let set = t.translate(Event::InitDone).expect("a set at InitDone");
        assert_eq!(set.op, Op::Set);
        assert!(set.pods.is_empty());
    }

    #[test]
    fn api_restarted_relist_drops_the_partial_one() {
        let mut t = Translator::default();
        t.translate(Event::Init);
        t.translate(Event::InitApply(pod("a")));
        // The list failed half-way; the watcher starts over.
        t.translate(Event::Init);
        t.translate(Event::InitApply(pod("b")));
        let set = t.translate(Event::InitDone).expect("a set at InitDone");
        assert_eq!(names(&set), ["b"]);
    }

    #[test]
    fn api_watch_events_become_update_and_remove() {
        let mut t = Translator::default();
        let u = t.translate(Event::Apply(pod("a"))).expect("an update");
        assert_eq!((u.op, names(&u)), (Op::Update, vec!["a"]));
        let r = t.translate(Event::Delete(pod("a"))).expect("a remove");
        assert_eq!((r.op, names(&r)), (Op::Remove, vec!["a"]));
    }

    #[test]
    fn api_pods_carry_the_source_annotation() {
        let mut t = Translator::default();
        let u = t.translate(Event::Apply(pod("a"))).expect("an update");
        let annotations = u.pods[0].metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations
                .get(annotations::CONFIG_SOURCE)
                .map(String::as_str),
            Some("api")
        );
    }

    #[test]
    fn api_default_backoff_is_the_reflectors() {
        let b = SourceBackoff::default();
        assert_eq!(b.min, Duration::from_millis(800));
        assert_eq!(b.max, Duration::from_secs(30));
        let delays: Vec<Duration> = b.build().take(10).collect();
        assert!(
            delays.iter().all(|d| *d <= Duration::from_secs(60)),
            "{delays:?}"
        );
    }
}

//! A watched copy of the cluster's Services, as the kubelet's Service
//! informer (`kubelet.go`: `kubeInformers.Core().V1().Services()`, all
//! namespaces, no selector) that `getServiceEnvVarMap` lists from: one list,
//! then a watch from its resourceVersion, resumed after a dropped watch,
//! re-listed after 410 Expired, errors retried forever with the reflector's
//! back-off ([`SourceBackoff`], as the pod source). Every container start
//! reads the copy; none asks the API server.
//!
//! Until the first list is in, a start fails as the kubelet's
//! (`makeEnvironmentVariables`: "services have not yet been read at least
//! once, cannot construct envvars"); a difference: it first waits up to
//! [`SYNC_WAIT`] for that list, where the kubelet fails at once and retries
//! at the next sync.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tracing::{info, warn};

use super::EnvError;
use crate::source::api::SourceBackoff;

/// How long a start waits for the first list before it fails.
pub const SYNC_WAIT: Duration = Duration::from_secs(2);

/// The watched Services; clones share one watch, which ends when the last
/// clone is dropped.
#[derive(Clone)]
pub struct ServiceCache {
    store: Store<Service>,
    _watch: Arc<AbortOnDrop>,
}

impl std::fmt::Debug for ServiceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceCache")
            .field("services", &self.store.len())
            .finish()
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl ServiceCache {
    /// Lists and watches every Service with `client` in a task of the current
    /// runtime.
    pub fn start(client: kube::Client, backoff: SourceBackoff) -> Self {
        let (store, writer) = reflector::store();
        let api: kube::Api<Service> = kube::Api::all(client);
        let events = watcher::watcher(api, watcher::Config::default())
            .backoff(backoff.build())
            .reflect(writer);
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => info!("service cache: listed the services"),
                    Ok(_) => {}
                    Err(e) => {
                        warn!(error = %e, "service cache: listing or watching services failed; retrying with backoff")
                    }
                }
            }
        });
        Self {
            store,
            _watch: Arc::new(AbortOnDrop(task)),
        }
    }

    /// The Services of `namespaces` as last seen, once the first list is in
    /// (waiting up to [`SYNC_WAIT`] for it).
    pub async fn services(&self, namespaces: &[&str]) -> Result<Vec<Service>, EnvError> {
        match tokio::time::timeout(SYNC_WAIT, self.store.wait_until_ready()).await {
            Ok(Ok(())) => {}
            _ => return Err(EnvError::ServicesNotSynced),
        }
        let mut out: Vec<Service> = self
            .store
            .state_filter(|s| {
                let ns = s.metadata.namespace.as_deref().unwrap_or_default();
                namespaces.contains(&ns)
            })
            .iter()
            .map(|s| Service::clone(s))
            .collect();
        // The store's order is a hash map's: sorted, so that the result
        // does not depend on it.
        out.sort_by(|a, b| {
            let key = |s: &Service| (s.metadata.namespace.clone(), s.metadata.name.clone());
            key(a).cmp(&key(b))
        });
        Ok(out)
    }
}

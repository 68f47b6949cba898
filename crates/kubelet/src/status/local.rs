//! The local status store: without an API server, statuses are served read-only
//! at `/pods` as a kubelet-like `PodList` (the kubelet's read-only `/pods`
//! endpoint). Every write is also sent to subscribers ([`LocalStore::subscribe`]),
//! so that a reader sees each status, the last one of a removed pod included.

use std::collections::BTreeMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::{Pod, PodStatus as ApiPodStatus};

use super::{StatusWriter, WriteError};

/// How many writes a slow subscriber may lag behind before it loses some.
const HISTORY: usize = 4096;

/// Pods with their last written status, by UID.
#[derive(Debug)]
pub struct LocalStore {
    pods: Mutex<BTreeMap<String, Pod>>,
    writes: tokio::sync::broadcast::Sender<Pod>,
}

impl Default for LocalStore {
    fn default() -> Self {
        Self {
            pods: Mutex::default(),
            writes: tokio::sync::broadcast::channel(HISTORY).0,
        }
    }
}

impl LocalStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every status written from now on, as the pod with its status.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<Pod> {
        self.writes.subscribe()
    }

    /// The pods as a `PodList` JSON document.
    pub fn pod_list(&self) -> serde_json::Value {
        let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
        serde_json::json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {},
            "items": pods.values().collect::<Vec<_>>(),
        })
    }

    pub fn len(&self) -> usize {
        self.pods.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn key(pod: &Pod) -> String {
    pod.metadata
        .uid
        .clone()
        .unwrap_or_else(|| pod.metadata.name.clone().unwrap_or_default())
}

impl StatusWriter for std::sync::Arc<LocalStore> {
    async fn write(&self, pod: &Pod, status: &ApiPodStatus) -> Result<(), WriteError> {
        let mut p = pod.clone();
        p.status = Some(status.clone());
        let _ = self.writes.send(p.clone());
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key(pod), p);
        Ok(())
    }

    async fn forget(&self, pod: &Pod) {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key(pod));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn serves_a_pod_list() {
        let store = Arc::new(LocalStore::new());
        let mut writes = store.subscribe();
        let pod: Pod =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p", "uid": "u1"}}))
                .unwrap();
        let status = ApiPodStatus {
            phase: Some("Running".into()),
            ..ApiPodStatus::default()
        };
        store.write(&pod, &status).await.unwrap();
        let list = store.pod_list();
        assert_eq!(list["kind"], "PodList");
        assert_eq!(list["items"][0]["status"]["phase"], "Running");
        store.forget(&pod).await;
        assert!(store.is_empty());
        let written = writes.try_recv().expect("the write was sent");
        assert_eq!(written.status.unwrap().phase.as_deref(), Some("Running"));
    }
}

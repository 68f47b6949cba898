//! The pod status cache: the meeting point of every PLEG and the pod workers.
//!
//! Reproduces the kubelet's `pkg/kubelet/container/cache.go`: one status per pod
//! with the time it was observed, `get_newer_than(uid, t)` that waits until the
//! cache holds an observation of that pod newer than `t`, and a global timestamp
//! that a full relist advances so that waiters of unchanged pods are released.
//!
//! Differences: observation times are CLOCK_MONOTONIC nanoseconds (the kernel's
//! clock), and an observation older than the cached one never replaces it (the
//! kubelet's evented PLEG broke on exactly that). Kernel exits are also kept per
//! container, so an exit code the kernel saw survives the runtime removing the
//! container.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use super::{ContainerId, ExitStatus, PodUid};
use crate::container::PodStatus;

/// A cached observation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheEntry {
    pub status: Arc<PodStatus>,
    /// When it was observed (CLOCK_MONOTONIC ns).
    pub observed_ns: u64,
    /// The inspection failed: the status is the last good one, or empty.
    pub error: Option<String>,
}

/// An exit the kernel saw, kept after the runtime forgets the container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelExit {
    pub status: ExitStatus,
    pub at_ns: u64,
}

#[derive(Debug, Default)]
struct Inner {
    pods: HashMap<PodUid, CacheEntry>,
    exits: HashMap<ContainerId, (PodUid, KernelExit)>,
    global_ns: u64,
}

/// The pod status cache; cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct PodStatusCache {
    inner: Mutex<Inner>,
    /// Bumped on every change; waiters re-check on each bump.
    version: watch::Sender<u64>,
}

impl Default for PodStatusCache {
    fn default() -> Self {
        Self::new()
    }
}

impl PodStatusCache {
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            version: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (each method
        // finishes its update before unlocking): keep going.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    pub fn get(&self, uid: &PodUid) -> Option<CacheEntry> {
        self.lock().pods.get(uid).cloned()
    }

    /// Stores a pod's status observed at `observed_ns`, unless the cache already
    /// holds a newer observation. Returns whether it was stored.
    pub fn set(&self, uid: &PodUid, status: PodStatus, observed_ns: u64) -> bool {
        self.store(uid, Arc::new(status), observed_ns, None)
    }

    /// Records a failed inspection, keeping the last good status.
    pub fn set_error(&self, uid: &PodUid, error: String, observed_ns: u64) -> bool {
        let status = self
            .get(uid)
            .map(|e| e.status)
            .unwrap_or_else(|| Arc::new(PodStatus::default()));
        self.store(uid, status, observed_ns, Some(error))
    }

    fn store(
        &self,
        uid: &PodUid,
        status: Arc<PodStatus>,
        observed_ns: u64,
        error: Option<String>,
    ) -> bool {
        let mut inner = self.lock();
        if inner
            .pods
            .get(uid)
            .is_some_and(|e| e.observed_ns > observed_ns)
        {
            return false;
        }
        inner.pods.insert(
            uid.clone(),
            CacheEntry {
                status,
                observed_ns,
                error,
            },
        );
        drop(inner);
        self.bump();
        true
    }

    /// Changes the cached status of a pod in place (a kernel observation of one
    /// container), marking it observed at `observed_ns` if that is newer. The
    /// closure sees an empty status when the pod is not cached yet.
    pub fn update(&self, uid: &PodUid, observed_ns: u64, f: impl FnOnce(&mut PodStatus)) {
        let mut inner = self.lock();
        let entry = inner.pods.entry(uid.clone()).or_insert_with(|| CacheEntry {
            status: Arc::new(PodStatus::default()),
            observed_ns: 0,
            error: None,
        });
        f(Arc::make_mut(&mut entry.status));
        entry.observed_ns = entry.observed_ns.max(observed_ns);
        drop(inner);
        self.bump();
    }

    /// Remembers an exit the kernel saw.
    pub fn record_exit(&self, uid: &PodUid, id: &ContainerId, exit: KernelExit) {
        self.lock().exits.insert(id.clone(), (uid.clone(), exit));
    }

    /// The exit the kernel saw for a container, if any.
    pub fn kernel_exit(&self, id: &ContainerId) -> Option<KernelExit> {
        self.lock().exits.get(id).map(|(_, e)| *e)
    }

    /// Exits the kernel saw for a pod's containers.
    pub fn kernel_exits(&self, uid: &PodUid) -> Vec<(ContainerId, KernelExit)> {
        self.lock()
            .exits
            .iter()
            .filter(|(_, (u, _))| u == uid)
            .map(|(id, (_, e))| (id.clone(), *e))
            .collect()
    }

    /// Forgets a pod (it was removed from the node).
    pub fn delete(&self, uid: &PodUid) {
        let mut inner = self.lock();
        inner.pods.remove(uid);
        inner.exits.retain(|_, (u, _)| u != uid);
        drop(inner);
        self.bump();
    }

    /// Advances the global timestamp (after a full relist): every pod is known
    /// up to `ns`. Never moves backwards.
    pub fn update_time(&self, ns: u64) {
        let mut inner = self.lock();
        if ns <= inner.global_ns {
            return;
        }
        inner.global_ns = ns;
        drop(inner);
        self.bump();
    }

    pub fn global_ns(&self) -> u64 {
        self.lock().global_ns
    }

    /// The pod's entry when it was observed after `min_ns`, or when a full relist
    /// after `min_ns` found nothing newer (then the cached entry, or an empty one).
    fn newer_than(&self, uid: &PodUid, min_ns: u64) -> Option<CacheEntry> {
        let inner = self.lock();
        match inner.pods.get(uid) {
            Some(e) if e.observed_ns > min_ns => Some(e.clone()),
            other if inner.global_ns > min_ns => {
                Some(other.cloned().unwrap_or_else(|| CacheEntry {
                    status: Arc::new(PodStatus::default()),
                    observed_ns: inner.global_ns,
                    error: None,
                }))
            }
            _ => None,
        }
    }

    /// Waits until the cache holds an observation of `uid` newer than `min_ns`
    /// (the kubelet's `GetNewerThan`). Callers bound the wait with a timeout.
    pub async fn get_newer_than(&self, uid: &PodUid, min_ns: u64) -> CacheEntry {
        let mut rx = self.version.subscribe();
        loop {
            rx.mark_unchanged();
            if let Some(e) = self.newer_than(uid, min_ns) {
                return e;
            }
            // The sender lives in self, so this cannot fail while we borrow self.
            let _ = rx.changed().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;
    use crate::container::{ContainerState, ContainerStatus};
    use crate::pleg::EventSource;

    fn uid(n: u8) -> PodUid {
        PodUid::parse(&format!("{n:02x}").repeat(16)).unwrap()
    }

    fn cid(c: char) -> ContainerId {
        ContainerId::parse(&c.to_string().repeat(64)).unwrap()
    }

    fn status(name: &str) -> PodStatus {
        PodStatus {
            name: name.into(),
            ..PodStatus::default()
        }
    }

    #[test]
    fn older_observation_never_wins() {
        let cache = PodStatusCache::new();
        assert!(cache.set(&uid(1), status("new"), 20));
        assert!(!cache.set(&uid(1), status("old"), 10));
        assert_eq!(cache.get(&uid(1)).unwrap().status.name, "new");
        assert!(cache.set(&uid(1), status("same-time"), 20));
        assert!(!cache.set_error(&uid(1), "boom".into(), 5));
        assert!(cache.set_error(&uid(1), "boom".into(), 30));
        let e = cache.get(&uid(1)).unwrap();
        assert_eq!(
            (e.status.name.as_str(), e.error.as_deref()),
            ("same-time", Some("boom"))
        );
    }

    #[test]
    fn kernel_update_in_place_and_exit_memory() {
        let cache = PodStatusCache::new();
        let mut s = status("p");
        s.containers.push(ContainerStatus::new(
            cid('a'),
            "app",
            ContainerState::Running,
            EventSource::Relist,
        ));
        cache.set(&uid(1), s, 10);
        let exit = ExitStatus::from_wait_status(0x700, false);
        cache.update(&uid(1), 15, |s| {
            s.container_mut(&cid('a')).unwrap().apply_exit(&exit, 99)
        });
        cache.record_exit(
            &uid(1),
            &cid('a'),
            KernelExit {
                status: exit,
                at_ns: 15,
            },
        );
        let e = cache.get(&uid(1)).unwrap();
        assert_eq!(e.observed_ns, 15);
        assert_eq!(e.status.container(&cid('a')).unwrap().exit_code, Some(7));
        // A relist that started before the exit does not undo it.
        assert!(!cache.set(&uid(1), status("stale"), 12));
        assert_eq!(cache.kernel_exit(&cid('a')).unwrap().status.code, 7);
        assert_eq!(cache.kernel_exits(&uid(1)).len(), 1);
        cache.delete(&uid(1));
        assert!(cache.get(&uid(1)).is_none());
        assert!(cache.kernel_exit(&cid('a')).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn get_newer_than_waits_for_a_newer_observation() {
        let cache = Arc::new(PodStatusCache::new());
        cache.set(&uid(1), status("v1"), 10);
        // Already newer: returns at once.
        assert_eq!(cache.get_newer_than(&uid(1), 5).await.status.name, "v1");
        let waiter = {
            let cache = cache.clone();
            tokio::spawn(async move { cache.get_newer_than(&uid(1), 10).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!waiter.is_finished());
        // Not newer: still waiting.
        cache.set(&uid(1), status("v1-again"), 10);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!waiter.is_finished());
        cache.set(&uid(1), status("v2"), 11);
        let e = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((e.status.name.as_str(), e.observed_ns), ("v2", 11));
    }

    #[tokio::test(start_paused = true)]
    async fn full_relist_releases_waiters_of_unchanged_pods() {
        let cache = Arc::new(PodStatusCache::new());
        let waiter = {
            let cache = cache.clone();
            tokio::spawn(async move { cache.get_newer_than(&uid(7), 100).await })
        };
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!waiter.is_finished());
        cache.update_time(100);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!waiter.is_finished(), "global time must be strictly newer");
        cache.update_time(101);
        let e = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(e.observed_ns, 101);
        assert_eq!(*e.status, PodStatus::default());
        cache.update_time(50);
        assert_eq!(cache.global_ns(), 101);
    }

    proptest! {
        /// Whatever order observations arrive in, the cache ends with the newest.
        #[test]
        fn cache_keeps_the_newest(times in proptest::collection::vec(0u64..1000, 1..50)) {
            let cache = PodStatusCache::new();
            for t in &times {
                cache.set(&uid(1), status(&t.to_string()), *t);
            }
            let max = *times.iter().max().unwrap();
            let e = cache.get(&uid(1)).unwrap();
            prop_assert_eq!(e.observed_ns, max);
            // Among equal times the last write wins, so the name is the max.
            prop_assert_eq!(e.status.name.parse::<u64>().unwrap(), max);
        }
    }
}

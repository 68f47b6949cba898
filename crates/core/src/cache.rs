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
//! container (and by pod, so that one pod's relist visits its own), so an exit
//! code the kernel saw survives the runtime removing the container. A kernel
//! death laid on a snapshot does not make the snapshot newer: its time is kept
//! apart (`CacheEntry::deaths_ns`), so that a worker waiting for a view newer
//! than its own runtime calls is never handed a snapshot taken before them
//! (issue #25); and a snapshot stored after a death was recorded gets that
//! death laid on it under the same lock, so no interleaving of a relist and the
//! kernel merge loses it. A pod relist whose listing shows the
//! snapshot's container states raises the snapshot's time
//! ([`PodStatusCache::touch`]): the kubelet's global timestamp, for one pod.
//!
//! The kubelet's cache is one map under one lock. This one is [`SHARDS`]
//! maps, a pod's entry and its kernel exits in the shard its uid hashes to,
//! each under its own lock: the kernel PLEG's real-time reader takes a
//! pod's shard only if it is free, and a relist storing another pod's
//! snapshot no longer holds it (issue #29: at 1 000 deaths a second, each
//! death's pod relist held the single lock often enough that half a percent
//! of the deaths went to the reader's normal-priority helper, and those were
//! the p99). The global timestamp is an atomic, raised after the full
//! relist's stores and read before a pod's entry, so an entry read after a
//! global time newer than a waiter's is at least that relist's.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use crate::clock::monotonic_to_unix_ns;
use crate::container::{ContainerState, PodStatus, SandboxState};
use crate::ids::{ContainerId, PodUid};
use crate::lifecycle::{EventSource, ExitStatus};

/// A cached observation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheEntry {
    pub status: Arc<PodStatus>,
    /// When the snapshot was taken (CLOCK_MONOTONIC ns): the runtime's view is
    /// at least this recent. Kernel deaths laid on it do not change it.
    pub observed_ns: u64,
    /// The latest kernel death laid on the snapshot (CLOCK_MONOTONIC ns; 0:
    /// none).
    pub deaths_ns: u64,
    /// The inspection failed: the status is the last good one, or empty.
    pub error: Option<String>,
}

/// An exit the kernel saw, kept after the runtime forgets the container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelExit {
    pub status: ExitStatus,
    pub at_ns: u64,
}

#[derive(Debug)]
struct ExitRecord {
    pod: PodUid,
    exit: KernelExit,
    /// The runtime reported the container exited too.
    confirmed: bool,
}

/// How many shards the cache has (see the module's documentation).
pub const SHARDS: usize = 16;

/// One shard: the entries of the pods whose uid hashes to it, and their
/// kernel exits.
#[derive(Debug, Default)]
struct Shard {
    pods: HashMap<PodUid, CacheEntry>,
    exits: Exits,
}

/// A shard's kernel exits, by container and by pod: what is done for one pod
/// (a relist storing its snapshot, confirming or pruning its exits) visits
/// that pod's exits only. Visiting them all, under the lock the kernel merge
/// needs, held it most of the time at 1 000 deaths a second and sent an
/// eighth of the deaths to the normal-priority helper (issue #29). A
/// container id belongs to one pod (a runtime's ids are unique): an exit is
/// looked up, confirmed and forgotten with its pod's uid.
#[derive(Debug, Default)]
struct Exits {
    records: HashMap<ContainerId, ExitRecord>,
    by_pod: HashMap<PodUid, HashSet<ContainerId>>,
}

impl Exits {
    fn insert(&mut self, uid: &PodUid, id: &ContainerId, exit: KernelExit) {
        let record = ExitRecord {
            pod: uid.clone(),
            exit,
            confirmed: false,
        };
        match self.records.insert(id.clone(), record) {
            Some(old) if old.pod == *uid => {}
            old => {
                if let Some(old) = old {
                    self.unlink(&old.pod, id);
                }
                // The pod's uid is cloned only for its first exit (this runs
                // on the real-time reader).
                match self.by_pod.get_mut(uid) {
                    Some(ids) => {
                        ids.insert(id.clone());
                    }
                    None => {
                        self.by_pod.insert(uid.clone(), HashSet::from([id.clone()]));
                    }
                }
            }
        }
    }

    fn remove(&mut self, id: &ContainerId) {
        if let Some(old) = self.records.remove(id) {
            self.unlink(&old.pod, id);
        }
    }

    fn unlink(&mut self, uid: &PodUid, id: &ContainerId) {
        if let Some(ids) = self.by_pod.get_mut(uid) {
            ids.remove(id);
            if ids.is_empty() {
                self.by_pod.remove(uid);
            }
        }
    }

    /// The exits of the pod's containers.
    fn of_pod<'a>(
        &'a self,
        uid: &PodUid,
    ) -> impl Iterator<Item = (&'a ContainerId, &'a ExitRecord)> + 'a {
        (self.by_pod.get(uid).into_iter().flatten()).filter_map(|id| self.records.get_key_value(id))
    }

    /// Keeps the exits of `pod` (of every pod: `None`) for which `keep` holds.
    fn retain(
        &mut self,
        pod: Option<&PodUid>,
        mut keep: impl FnMut(&ContainerId, &ExitRecord) -> bool,
    ) {
        let Some(uid) = pod else {
            self.records.retain(|id, r| keep(id, r));
            let records = &self.records;
            self.by_pod.retain(|_, ids| {
                ids.retain(|id| records.contains_key(id));
                !ids.is_empty()
            });
            return;
        };
        let Some(ids) = self.by_pod.get_mut(uid) else {
            return;
        };
        let records = &mut self.records;
        ids.retain(|id| {
            let kept = records.get(id).is_some_and(|r| keep(id, r));
            if !kept {
                records.remove(id);
            }
            kept
        });
        if ids.is_empty() {
            self.by_pod.remove(uid);
        }
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock leaves consistent data (each method
    // finishes its update before unlocking): keep going.
    shard.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lays kernel death `exit` of container (or sandbox) `id` on `entry`'s
/// snapshot and advances its `deaths_ns`; a container the runtime itself
/// reports exited keeps the runtime's status. Returns whether the snapshot
/// holds `id` (nothing changed when not).
fn lay_exit(entry: &mut CacheEntry, id: &ContainerId, exit: &KernelExit) -> bool {
    let (holds, runtime_exited) = match entry.status.container(id) {
        Some(c) => (
            true,
            c.state == ContainerState::Exited && c.source != EventSource::Kernel,
        ),
        None => (entry.status.sandboxes.iter().any(|s| s.id == *id), false),
    };
    if !holds {
        return false;
    }
    if !runtime_exited {
        let finished = monotonic_to_unix_ns(exit.at_ns);
        let status = Arc::make_mut(&mut entry.status);
        if let Some(c) = status.container_mut(id) {
            c.apply_exit(&exit.status, finished);
        } else if let Some(s) = status.sandboxes.iter_mut().find(|s| s.id == *id) {
            s.state = SandboxState::NotReady;
        }
    }
    entry.deaths_ns = entry.deaths_ns.max(exit.at_ns);
    true
}

/// The pod status cache; cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct PodStatusCache {
    shards: [Mutex<Shard>; SHARDS],
    /// The same for every cache (a pod's shard is reproducible).
    hasher: BuildHasherDefault<DefaultHasher>,
    /// The kubelet's global timestamp (CLOCK_MONOTONIC ns): raised after a
    /// full relist's stores (release), read before a pod's entry (acquire).
    global_ns: AtomicU64,
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
            shards: std::array::from_fn(|_| Mutex::default()),
            hasher: BuildHasherDefault::default(),
            global_ns: AtomicU64::new(0),
            version: watch::Sender::new(0),
        }
    }

    fn shard_index(&self, uid: &PodUid) -> usize {
        self.hasher.hash_one(uid) as usize % SHARDS
    }

    fn shard(&self, uid: &PodUid) -> &Mutex<Shard> {
        &self.shards[self.shard_index(uid)]
    }

    fn lock(&self, uid: &PodUid) -> MutexGuard<'_, Shard> {
        lock(self.shard(uid))
    }

    /// The pod's shard if its lock is free now (the kernel PLEG's real-time
    /// reader never waits for it: a busy lock hands its work to a
    /// normal-priority thread).
    fn try_lock(&self, uid: &PodUid) -> Option<MutexGuard<'_, Shard>> {
        match self.shard(uid).try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    pub fn get(&self, uid: &PodUid) -> Option<CacheEntry> {
        self.lock(uid).pods.get(uid).cloned()
    }

    /// Stores a pod's status observed at `observed_ns`, unless the cache already
    /// holds a newer observation. Returns whether it was stored.
    pub fn set(&self, uid: &PodUid, status: PodStatus, observed_ns: u64) -> bool {
        self.store(uid, Arc::new(status), observed_ns, None)
    }

    /// A listing of the pod that began at `observed_ns` showed every container
    /// in the state of the cached snapshot: the snapshot holds as of then (the
    /// kubelet's global timestamp, for one pod). Raises the entry's
    /// `observed_ns`, never lowers it; nothing for a pod not cached or cached
    /// with an error. Returns whether it moved.
    pub fn touch(&self, uid: &PodUid, observed_ns: u64) -> bool {
        let mut shard = self.lock(uid);
        let Some(entry) = shard.pods.get_mut(uid) else {
            return false;
        };
        if entry.error.is_some() || entry.observed_ns >= observed_ns {
            return false;
        }
        entry.observed_ns = observed_ns;
        drop(shard);
        self.bump();
        true
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
        let mut shard = self.lock(uid);
        let Shard { pods, exits } = &mut *shard;
        if pods.get(uid).is_some_and(|e| e.observed_ns > observed_ns) {
            return false;
        }
        let mut entry = CacheEntry {
            status,
            observed_ns,
            deaths_ns: 0,
            error,
        };
        if entry.error.is_none() {
            // Deaths recorded while this snapshot was being taken (or before,
            // the runtime lagging) that it does not show: laid on it here, under
            // the lock the merge records them under, so none is overwritten.
            for (id, r) in exits.of_pod(uid) {
                if !r.confirmed {
                    lay_exit(&mut entry, id, &r.exit);
                }
            }
        }
        // The uid is cloned for a new pod only, and the entry replaced is
        // freed once the lock is released (the reader finds the lock busy
        // for as long as it is held).
        let replaced = match pods.get_mut(uid) {
            Some(slot) => Some(std::mem::replace(slot, entry)),
            None => pods.insert(uid.clone(), entry),
        };
        drop(shard);
        drop(replaced);
        self.bump();
        true
    }

    /// Overlays a certain kernel death on the latest complete snapshot of the pod
    /// (contract clause 1): the container (or sandbox) `id` exited at `at_ns`.
    /// Applied only when the pod is cached without an error and its snapshot holds
    /// `id`; the entry's `deaths_ns` is then advanced to `at_ns` (its
    /// `observed_ns`, the snapshot's own time, is not: clause 8).
    /// Returns whether it was applied: when not, nothing changed and the caller
    /// relists the pod instead.
    pub fn overlay_exit(
        &self,
        uid: &PodUid,
        id: &ContainerId,
        exit: &ExitStatus,
        at_ns: u64,
    ) -> bool {
        let mut shard = self.lock(uid);
        let Some(entry) = shard.pods.get_mut(uid) else {
            return false;
        };
        if entry.error.is_some() {
            return false;
        }
        let exit = KernelExit {
            status: *exit,
            at_ns,
        };
        if !lay_exit(entry, id, &exit) {
            return false;
        }
        drop(shard);
        self.bump();
        true
    }

    /// [`PodStatusCache::record_exit`] then [`PodStatusCache::overlay_exit`]
    /// under one lock, only if the lock is free now: `None` when it is not
    /// (nothing changed; the caller does both later, they are idempotent).
    pub fn try_record_and_overlay_exit(
        &self,
        uid: &PodUid,
        id: &ContainerId,
        exit: KernelExit,
    ) -> Option<bool> {
        let mut shard = self.try_lock(uid)?;
        shard.exits.insert(uid, id, exit);
        let laid = match shard.pods.get_mut(uid) {
            Some(entry) if entry.error.is_none() => lay_exit(entry, id, &exit),
            _ => false,
        };
        drop(shard);
        if laid {
            self.bump();
        }
        Some(laid)
    }

    /// Whether the pod's snapshot (without an error) holds container or
    /// sandbox `id`, only if the lock is free now (`None` when it is not).
    pub fn try_holds(&self, uid: &PodUid, id: &ContainerId) -> Option<bool> {
        let shard = self.try_lock(uid)?;
        Some(shard.pods.get(uid).is_some_and(|e| {
            e.error.is_none()
                && (e.status.container(id).is_some()
                    || e.status.sandboxes.iter().any(|s| s.id == *id))
        }))
    }

    /// Remembers a certain exit the kernel saw (kept after the runtime forgets the
    /// container, for its exit code).
    pub fn record_exit(&self, uid: &PodUid, id: &ContainerId, exit: KernelExit) {
        self.lock(uid).exits.insert(uid, id, exit);
    }

    /// The exit the kernel saw for a container of the pod, if any.
    pub fn kernel_exit(&self, uid: &PodUid, id: &ContainerId) -> Option<KernelExit> {
        let shard = self.lock(uid);
        (shard.exits.records.get(id))
            .filter(|r| r.pod == *uid)
            .map(|r| r.exit)
    }

    /// Exits the kernel saw for a pod's containers, with whether the runtime has
    /// confirmed each.
    pub fn kernel_exits(&self, uid: &PodUid) -> Vec<(ContainerId, KernelExit, bool)> {
        (self.lock(uid).exits.of_pod(uid))
            .map(|(id, r)| (id.clone(), r.exit, r.confirmed))
            .collect()
    }

    /// Marks a kernel exit of the pod confirmed by the runtime. Returns true
    /// the first time.
    pub fn confirm_exit(&self, uid: &PodUid, id: &ContainerId) -> bool {
        (self.lock(uid).exits.records.get_mut(id))
            .filter(|r| r.pod == *uid)
            .is_some_and(|r| !std::mem::replace(&mut r.confirmed, true))
    }

    /// Forgets a kernel exit of the pod that the runtime contradicted
    /// (contract clause 3), so that it can neither suppress nor mislabel the
    /// container's real death later.
    pub fn forget_exit(&self, uid: &PodUid, id: &ContainerId) {
        let mut shard = self.lock(uid);
        if shard.exits.records.get(id).is_some_and(|r| r.pod == *uid) {
            shard.exits.remove(id);
        }
    }

    /// Forgets the kernel exits of `pod` (every pod: `None`) that the runtime did
    /// not list (`listed` is false) in a listing that began at `listed_at_ns`,
    /// unless seen after it: the runtime forgot the container, or never showed
    /// it, so its exit can serve nobody.
    pub fn prune_exits(
        &self,
        pod: Option<&PodUid>,
        listed_at_ns: u64,
        listed: impl Fn(&ContainerId) -> bool,
    ) {
        let keep = |id: &ContainerId, r: &ExitRecord| listed(id) || r.exit.at_ns >= listed_at_ns;
        match pod {
            Some(uid) => self.lock(uid).exits.retain(pod, keep),
            None => {
                for shard in &self.shards {
                    lock(shard).exits.retain(None, keep);
                }
            }
        }
    }

    /// How many kernel exits are remembered (for tests and metrics).
    pub fn kernel_exit_count(&self) -> usize {
        (self.shards.iter())
            .map(|s| lock(s).exits.records.len())
            .sum()
    }

    /// The pods the cache holds an entry for (one shard locked at a time).
    pub fn uids(&self) -> Vec<PodUid> {
        let mut uids = Vec::new();
        for shard in &self.shards {
            uids.extend(lock(shard).pods.keys().cloned());
        }
        uids
    }

    /// Forgets a pod (it was removed from the node).
    pub fn delete(&self, uid: &PodUid) {
        let mut shard = self.lock(uid);
        let removed = shard.pods.remove(uid);
        shard.exits.retain(Some(uid), |_, _| false);
        drop(shard);
        drop(removed);
        self.bump();
    }

    /// Advances the global timestamp (after a full relist, once it stored
    /// every pod's snapshot): every pod is known up to `ns`. Never moves
    /// backwards.
    pub fn update_time(&self, ns: u64) {
        if self.global_ns.fetch_max(ns, Ordering::AcqRel) < ns {
            self.bump();
        }
    }

    pub fn global_ns(&self) -> u64 {
        self.global_ns.load(Ordering::Acquire)
    }

    /// Waits until a first complete relist has filled the cache (the kubelet's
    /// workers block on the cache's global time before their first sync).
    pub async fn first_relist(&self) {
        let mut rx = self.version.subscribe();
        loop {
            rx.mark_unchanged();
            if self.global_ns() > 0 {
                return;
            }
            let _ = rx.changed().await;
        }
    }

    /// The pod's entry when it was observed after `min_ns`, or when a full relist
    /// after `min_ns` found nothing newer (then the cached entry, or an empty one).
    fn newer_than(&self, uid: &PodUid, min_ns: u64) -> Option<CacheEntry> {
        // The global time first: the entry read after it is at least the
        // one its relist stored.
        let global_ns = self.global_ns();
        let shard = self.lock(uid);
        match shard.pods.get(uid) {
            Some(e) if e.observed_ns > min_ns => Some(e.clone()),
            other if global_ns > min_ns => Some(other.cloned().unwrap_or_else(|| CacheEntry {
                status: Arc::new(PodStatus::default()),
                observed_ns: global_ns,
                deaths_ns: 0,
                error: None,
            })),
            _ => None,
        }
    }

    /// The pod's entry if the cache already holds one newer than `min_ns` (see
    /// [`PodStatusCache::get_newer_than`]), without waiting.
    pub fn newer_than_now(&self, uid: &PodUid, min_ns: u64) -> Option<CacheEntry> {
        self.newer_than(uid, min_ns)
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
    use crate::lifecycle::EventSource;

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

    /// Kernel exits are kept by pod: pruning one pod's leaves the others',
    /// and a container is looked up with its own pod only.
    #[test]
    fn kernel_exits_are_kept_by_pod() {
        let cache = PodStatusCache::new();
        let exit = |at_ns| KernelExit {
            status: ExitStatus::from_wait_status(0x100, false),
            at_ns,
        };
        let held = |cache: &PodStatusCache| {
            let ids = |u| {
                let mut ids: Vec<char> = (cache.kernel_exits(&uid(u)).into_iter())
                    .map(|(id, _, _)| id.as_str().chars().next().expect("an id"))
                    .collect();
                ids.sort();
                ids
            };
            (ids(1), ids(2), cache.kernel_exit_count())
        };
        cache.record_exit(&uid(1), &cid('a'), exit(10));
        cache.record_exit(&uid(1), &cid('b'), exit(20));
        cache.record_exit(&uid(2), &cid('c'), exit(30));
        assert_eq!(held(&cache), (vec!['a', 'b'], vec!['c'], 3));
        cache.record_exit(&uid(2), &cid('d'), exit(40));
        assert_eq!(held(&cache), (vec!['a', 'b'], vec!['c', 'd'], 4));
        // Pod 2 listed at 50 with c only: d goes, pod 1's (not listed) stay.
        cache.prune_exits(Some(&uid(2)), 50, |id| *id == cid('c'));
        assert_eq!(held(&cache), (vec!['a', 'b'], vec!['c'], 3));
        assert!(cache.kernel_exit(&uid(1), &cid('c')).is_none(), "pod 2's");
        assert!(!cache.confirm_exit(&uid(1), &cid('c')), "pod 2's");
        assert!(cache.confirm_exit(&uid(2), &cid('c')));
        assert!(!cache.confirm_exit(&uid(2), &cid('c')), "confirmed once");
        cache.forget_exit(&uid(1), &cid('c'));
        assert_eq!(held(&cache), (vec!['a', 'b'], vec!['c'], 3), "pod 2's");
        cache.forget_exit(&uid(2), &cid('c'));
        assert_eq!(held(&cache), (vec!['a', 'b'], vec![], 2));
        cache.record_exit(&uid(2), &cid('d'), exit(60));
        cache.delete(&uid(2));
        assert_eq!(held(&cache), (vec!['a', 'b'], vec![], 2));
        // Every pod, listed at 50: a (10) and b (20) go, e (seen at 70) stays.
        cache.record_exit(&uid(2), &cid('e'), exit(70));
        cache.prune_exits(None, 50, |_| false);
        assert_eq!(held(&cache), (vec![], vec!['e'], 1));
    }

    #[test]
    fn kernel_exit_overlays_a_complete_snapshot_only() {
        let cache = PodStatusCache::new();
        let exit = ExitStatus::from_wait_status(0x700, false);
        // Not cached yet: no partial entry is made (contract clause 1).
        assert!(!cache.overlay_exit(&uid(1), &cid('a'), &exit, 15));
        assert!(cache.get(&uid(1)).is_none());
        let mut s = status("p");
        s.containers.push(ContainerStatus::new(
            cid('a'),
            "app",
            ContainerState::Running,
            EventSource::Relist,
        ));
        cache.set(&uid(1), s, 10);
        // A container the snapshot does not hold: nothing, never a nameless one.
        assert!(!cache.overlay_exit(&uid(1), &cid('b'), &exit, 15));
        assert_eq!(cache.get(&uid(1)).unwrap().status.containers.len(), 1);
        assert_eq!(cache.get(&uid(1)).unwrap().observed_ns, 10);
        assert!(cache.overlay_exit(&uid(1), &cid('a'), &exit, 15));
        cache.record_exit(
            &uid(1),
            &cid('a'),
            KernelExit {
                status: exit,
                at_ns: 15,
            },
        );
        let e = cache.get(&uid(1)).unwrap();
        assert_eq!(
            (e.observed_ns, e.deaths_ns),
            (10, 15),
            "the snapshot's own time is kept"
        );
        let c = e.status.container(&cid('a')).unwrap();
        assert_eq!((c.exit_code, c.name.as_str()), (Some(7), "app"));
        // A relist that started before the exit does not undo it: the death is
        // laid on its snapshot.
        let mut stale = status("stale");
        stale.containers.push(ContainerStatus::new(
            cid('a'),
            "app",
            ContainerState::Running,
            EventSource::Relist,
        ));
        assert!(cache.set(&uid(1), stale, 12));
        let e = cache.get(&uid(1)).unwrap();
        let c = e.status.container(&cid('a')).unwrap();
        assert_eq!((c.state, c.exit_code), (ContainerState::Exited, Some(7)));
        assert_eq!((e.observed_ns, e.deaths_ns), (12, 15));
        assert_eq!(
            cache.kernel_exit(&uid(1), &cid('a')).unwrap().status.code,
            7
        );
        assert_eq!(cache.kernel_exits(&uid(1)).len(), 1);
        assert!(cache.confirm_exit(&uid(1), &cid('a')), "first confirmation");
        assert!(!cache.confirm_exit(&uid(1), &cid('a')), "counted once");
        cache.forget_exit(&uid(1), &cid('a'));
        assert!(cache.kernel_exit(&uid(1), &cid('a')).is_none());
        // A pod whose inspection failed gets no overlay either.
        cache.set_error(&uid(1), "boom".into(), 20);
        assert!(!cache.overlay_exit(&uid(1), &cid('a'), &exit, 25));
        cache.delete(&uid(1));
        assert!(cache.get(&uid(1)).is_none());
    }

    fn running(name: &str, ids: &[char]) -> PodStatus {
        let mut s = status(name);
        for &c in ids {
            s.containers.push(ContainerStatus::new(
                cid(c),
                "app",
                ContainerState::Running,
                EventSource::Relist,
            ));
        }
        s
    }

    /// Clause 8 under a kernel death (issue #25): a worker whose last sync ended
    /// at 20 (it created container 'b') is not handed the snapshot of 10
    /// (without 'b') because a death at 30 was laid on it; the post-sync relist
    /// (stamped 25, before the death) is stored, with the death on it.
    #[test]
    fn an_overlaid_death_does_not_make_an_old_snapshot_new() {
        let cache = PodStatusCache::new();
        cache.set(&uid(1), running("before the sync", &['a']), 10);
        let exit = ExitStatus::from_wait_status(0x300, false);
        cache.record_exit(
            &uid(1),
            &cid('a'),
            KernelExit {
                status: exit,
                at_ns: 30,
            },
        );
        assert!(cache.overlay_exit(&uid(1), &cid('a'), &exit, 30));
        assert_eq!(
            cache
                .newer_than_now(&uid(1), 20)
                .map(|e| e.status.name.clone()),
            None,
            "a snapshot taken before the worker's calls is not newer for a death on it"
        );
        assert!(cache.set(&uid(1), running("after the sync", &['a', 'b']), 25));
        let e = cache
            .newer_than_now(&uid(1), 20)
            .expect("the post-sync relist");
        assert_eq!(
            (e.status.name.as_str(), e.observed_ns),
            ("after the sync", 25)
        );
        assert!(e.status.container(&cid('b')).is_some());
        let a = e.status.container(&cid('a')).unwrap();
        assert_eq!((a.state, a.exit_code), (ContainerState::Exited, Some(3)));
    }

    /// Issue #25's lost wake-up: a death recorded between a relist's reading
    /// of the kernel exits and its store is laid on the stored snapshot, not
    /// overwritten by its "running". A runtime's own exit is kept as is.
    #[test]
    fn a_death_recorded_during_a_relist_survives_its_store() {
        let cache = PodStatusCache::new();
        cache.set(&uid(1), running("old", &['a', 'b']), 10);
        // The relist reads exits (none), the kernel records a death and lays it
        // on the old snapshot, the relist stores its snapshot (taken at 12).
        let exit = ExitStatus::from_wait_status(0x100, false);
        cache.record_exit(
            &uid(1),
            &cid('a'),
            KernelExit {
                status: exit,
                at_ns: 13,
            },
        );
        assert!(cache.overlay_exit(&uid(1), &cid('a'), &exit, 13));
        assert!(cache.set(&uid(1), running("relist", &['a', 'b']), 12));
        let e = cache.get(&uid(1)).unwrap();
        let a = e.status.container(&cid('a')).unwrap();
        assert_eq!(
            (a.state, a.exit_code, a.source),
            (ContainerState::Exited, Some(1), EventSource::Kernel)
        );
        assert_eq!(
            e.status.container(&cid('b')).unwrap().state,
            ContainerState::Running
        );
        // The runtime's own report wins over the kernel's code.
        let mut reported = running("runtime", &['a', 'b']);
        let c = reported.container_mut(&cid('a')).unwrap();
        c.state = ContainerState::Exited;
        c.exit_code = Some(2);
        assert!(cache.set(&uid(1), reported, 14));
        let a = cache
            .get(&uid(1))
            .unwrap()
            .status
            .container(&cid('a'))
            .unwrap()
            .clone();
        assert_eq!((a.exit_code, a.source), (Some(2), EventSource::Relist));
        // A confirmed exit is not laid again.
        assert!(cache.confirm_exit(&uid(1), &cid('a')));
        assert!(cache.set(&uid(1), running("restarted?", &['a']), 15));
        let a = cache
            .get(&uid(1))
            .unwrap()
            .status
            .container(&cid('a'))
            .unwrap()
            .clone();
        assert_eq!(a.state, ContainerState::Running);
    }

    /// The reader's lock-free-or-nothing calls wait only on their own pod's
    /// shard: a lock held for another pod (a relist storing its snapshot)
    /// does not make them busy, one held for the same shard does.
    #[test]
    fn a_held_shard_makes_busy_its_own_pods_only() {
        let cache = PodStatusCache::new();
        let held = uid(1);
        let (other, same): (Vec<PodUid>, Vec<PodUid>) = (2..=64)
            .map(uid)
            .partition(|u| cache.shard_index(u) != cache.shard_index(&held));
        let (other, same) = (&other[0], &same[0]);
        for pod in [other, same] {
            cache.set(pod, running("p", &['a']), 10);
        }
        let exit = KernelExit {
            status: ExitStatus::from_wait_status(0x100, false),
            at_ns: 20,
        };
        let guard = cache.lock(&held);
        assert_eq!(cache.try_holds(other, &cid('a')), Some(true));
        assert_eq!(
            cache.try_record_and_overlay_exit(other, &cid('a'), exit),
            Some(true)
        );
        assert_eq!(cache.try_holds(same, &cid('a')), None);
        assert_eq!(
            cache.try_record_and_overlay_exit(same, &cid('a'), exit),
            None
        );
        drop(guard);
        assert_eq!(
            cache.try_record_and_overlay_exit(same, &cid('a'), exit),
            Some(true)
        );
        let spread: HashSet<usize> = (0..=255).map(|n| cache.shard_index(&uid(n))).collect();
        assert_eq!(spread.len(), SHARDS, "pods spread over every shard");
    }

    #[test]
    fn sandbox_death_marks_the_sandbox_not_ready() {
        let cache = PodStatusCache::new();
        let mut s = status("p");
        s.sandboxes.push(crate::container::SandboxStatus {
            id: cid('e'),
            state: SandboxState::Ready,
            attempt: 0,
            created_at: None,
            ip: None,
            pid: None,
        });
        cache.set(&uid(1), s, 10);
        let exit = ExitStatus::from_wait_status(9, false);
        assert!(cache.overlay_exit(&uid(1), &cid('e'), &exit, 11));
        let e = cache.get(&uid(1)).unwrap();
        assert_eq!(e.status.sandboxes[0].state, SandboxState::NotReady);
        assert!(e.status.containers.is_empty(), "no phantom container");
    }

    #[tokio::test(start_paused = true)]
    async fn first_relist_gate() {
        let cache = Arc::new(PodStatusCache::new());
        let waiter = {
            let cache = cache.clone();
            tokio::spawn(async move { cache.first_relist().await })
        };
        cache.set(&uid(1), status("pod relist"), 5);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(
            !waiter.is_finished(),
            "a pod relist is not the first full relist"
        );
        cache.update_time(6);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
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

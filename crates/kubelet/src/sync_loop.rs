//! The sync loop: the kubelet's `syncLoop` / `syncLoopIteration` and
//! `HandlePod{Additions,Updates,Removes,Reconcile}`, plus housekeeping
//! (`HandlePodCleanups`).
//!
//! It selects on pod updates from the sources' mux, lifecycle events from the
//! PLEG, workers that finished, and a housekeeping tick. New pods are admitted
//! (resources against allocatable) or rejected with a Failed status; admitted
//! ones go to their worker. A PLEG event wakes the pod's worker at once (the
//! kubelet also waits for the next sync tick for some events; with kernel events
//! the point is not to wait). Housekeeping, once every source has sent its first
//! set, stops the sandboxes of pods that no longer exist (the kubelet's killing
//! of orphaned runtime pods in `HandlePodCleanups`) and removes their empty pod
//! cgroups (cgroupfs and systemd names; unlike the kubelet's
//! `cleanupOrphanedPodCgroups`, which reads every hierarchy at every round,
//! only while an orphan may exist: after the start, a pod's removal or its
//! worker's end, an unknown pod's sandbox stopped, or a cgroup left busy);
//! their sandboxes and dead containers
//! are the container GC's to remove ([`crate::kuberuntime::gc`]), which asks
//! this loop which pods' content may go (the kubelet's
//! `ShouldPodContentBeRemoved`).
//!
//! Admission counts the pods the sources still have and whose workers have
//! not finished (the kubelet's `filterOutInactivePods` over its pod manager):
//! a pod removed from its source releases its requests and host ports at
//! once, so that a static pod's new version is admitted against the node
//! without the old one; the pod workers start it once the old one has
//! terminated ([`crate::pod_workers::static_pods`]).
//!
//! Housekeeping also deletes orphaned mirror pods: a mirror pod the API
//! source lists whose static pod no source has (the kubelet's
//! `deleteOrphanedMirrorPods`; a manifest removed while the agent was down).
//!
//! Before admission, [`crate::pod_fate`] decides what a new pod becomes: mirror
//! pods never run, a pod terminal in the API server is never started, a UID
//! re-added after (or while) it terminated starts again. When a worker finished,
//! the status manager hears it ([`StatusManager::pod_finished`]), so that a
//! gracefully deleted API pod is deleted for good; a pod removed from its source
//! is forgotten (status and cache entry).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::Pod;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::admission::Admission;
use crate::kuberuntime::manager::pod_uid;
use crate::pod_fate::{OnAdd, on_add};
use crate::pod_workers::{PodSyncer, PodWorkers, UpdateType, WorkerState};
use crate::source::mux::SeenSources;
use crate::source::{Op, PodUpdate, SourceName};
use crate::status::generate::{Context, generate};
use crate::status::manager::StatusManager;
use evpleg_core::cache::PodStatusCache;
use evpleg_core::cgroup_path::{CgroupClass, classify};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::labels;
use evpleg_core::lifecycle::{EventKind, EventSource, PodLifecycleEvent};
use evpleg_cri::CriClient;
use evpleg_record::Recorder;

/// The kubelet's housekeeping period.
pub const HOUSEKEEPING_PERIOD: Duration = Duration::from_secs(2);

/// What the sync loop drives, handed to [`SyncLoop::new`].
pub struct SyncLoopParts<S> {
    pub workers: Arc<PodWorkers<S>>,
    pub status: Arc<StatusManager>,
    pub cache: Arc<PodStatusCache>,
    pub cri: CriClient,
    pub admission: Admission,
    pub seen: SeenSources,
    /// The sources configured (housekeeping waits for all of them).
    pub sources: Vec<SourceName>,
    pub host_ip: String,
    /// Cgroup mounts whose orphaned pod cgroups housekeeping removes.
    pub cgroup_mounts: Vec<std::path::PathBuf>,
    /// `--root-dir`, whose orphaned pod directories housekeeping removes.
    pub root_dir: Option<std::path::PathBuf>,
    /// `pleg_event_latency_seconds`, observed as events are taken.
    pub event_latency: Arc<evpleg_pleg::latency::EventLatency>,
    /// The prober manager and the pods whose probe results changed.
    pub prober: Option<(
        Arc<crate::prober::ProberManager>,
        mpsc::UnboundedReceiver<PodUid>,
    )>,
    /// Pod events: the kernel PLEG's container deaths are recorded here.
    pub events: Recorder,
    /// The container GC's questions: which pods' content may go.
    pub gc_queries: Option<mpsc::Receiver<crate::kuberuntime::gc::ContentRequest>>,
}

/// The sync loop and what it drives.
pub struct SyncLoop<S> {
    workers: Arc<PodWorkers<S>>,
    status: Arc<StatusManager>,
    cache: Arc<PodStatusCache>,
    cri: CriClient,
    admission: Admission,
    seen: SeenSources,
    sources: Vec<SourceName>,
    host_ip: String,
    cgroup_mounts: Vec<std::path::PathBuf>,
    /// A pod cgroup may be an orphan: set at the start, when a pod is
    /// removed or its worker finishes, when housekeeping stops an unknown
    /// pod's sandbox, and while a scan left one it could not remove.
    cgroup_orphans_possible: bool,
    root_dir: Option<std::path::PathBuf>,
    event_latency: Arc<evpleg_pleg::latency::EventLatency>,
    prober: Option<Arc<crate::prober::ProberManager>>,
    probe_results: Option<mpsc::UnboundedReceiver<PodUid>>,
    events: Recorder,
    gc_queries: Option<mpsc::Receiver<crate::kuberuntime::gc::ContentRequest>>,
    pods: HashMap<PodUid, Arc<Pod>>,
    rejected: HashMap<PodUid, Arc<Pod>>,
    /// Re-added while their worker was terminating: started again once it ends.
    restart_requested: HashSet<PodUid>,
    /// The mirror pods the API source has, by full name.
    mirrors: HashMap<String, Arc<Pod>>,
}

impl<S> std::fmt::Debug for SyncLoopParts<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncLoopParts")
            .field("sources", &self.sources)
            .field("host_ip", &self.host_ip)
            .finish_non_exhaustive()
    }
}

impl<S> std::fmt::Debug for SyncLoop<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncLoop")
            .field("pods", &self.pods.len())
            .finish_non_exhaustive()
    }
}

fn grace_override(pod: &Pod) -> Option<i64> {
    pod.metadata.deletion_grace_period_seconds
}

impl<S: PodSyncer> SyncLoop<S> {
    pub fn new(parts: SyncLoopParts<S>) -> Self {
        let SyncLoopParts {
            workers,
            status,
            cache,
            cri,
            admission,
            seen,
            sources,
            host_ip,
            cgroup_mounts,
            root_dir,
            event_latency,
            prober,
            events,
            gc_queries,
        } = parts;
        let (prober, probe_results) = prober.unzip();
        Self {
            workers,
            status,
            cache,
            cri,
            admission,
            seen,
            sources,
            host_ip,
            cgroup_mounts,
            cgroup_orphans_possible: true,
            root_dir,
            event_latency,
            prober,
            probe_results,
            events,
            gc_queries,
            pods: HashMap::new(),
            rejected: HashMap::new(),
            restart_requested: HashSet::new(),
            mirrors: HashMap::new(),
        }
    }

    /// Keeps the API source's mirror pods by full name (the kubelet's pod
    /// manager keeps them apart from the pods it runs).
    fn track_mirror(&mut self, op: Op, pod: Arc<Pod>) {
        let name = crate::status::api::full_name(&pod);
        if op == Op::Remove {
            if self
                .mirrors
                .get(&name)
                .is_some_and(|m| m.metadata.uid == pod.metadata.uid)
            {
                self.mirrors.remove(&name);
            }
            return;
        }
        self.mirrors.insert(name, pod);
    }

    /// The kubelet's `deleteOrphanedMirrorPods`: a mirror pod whose static
    /// pod no source has (its manifest removed while the agent was down) is
    /// deleted, unless a static pod of that name is still terminating.
    fn delete_orphaned_mirrors(&self) {
        // Pods rejected at admission are still the source's (their mirror
        // pods carry their Failed status).
        let statics: HashSet<String> = self
            .pods
            .values()
            .chain(self.rejected.values())
            .filter(|p| crate::status::api::is_static(p))
            .map(|p| crate::status::api::full_name(p))
            .collect();
        for (name, mirror) in &self.mirrors {
            if statics.contains(name) || self.workers.is_static_pod_terminating(name) {
                continue;
            }
            self.status.delete_orphaned_mirror(mirror);
        }
    }

    fn handle_update(&mut self, mut update: PodUpdate) {
        if matches!(update.op, Op::Add | Op::Set) {
            crate::admission::by_creation_time(&mut update.pods);
        }
        for pod in update.pods {
            if crate::status::finish::is_mirror_pod(&pod) {
                debug!(op = ?update.op, name = ?pod.metadata.name, namespace = ?pod.metadata.namespace,
                       "mirror pod: not run (its static pod runs from its own source)");
                self.track_mirror(update.op, pod);
                continue;
            }
            let uid = match pod_uid(&pod) {
                Ok(u) => u,
                Err(e) => {
                    warn!(error = %e, source = update.source.as_str(), "pod update without a valid uid ignored");
                    continue;
                }
            };
            match update.op {
                Op::Add | Op::Set => self.add(uid, pod),
                Op::Update => {
                    if self.rejected.contains_key(&uid) {
                        continue;
                    }
                    self.pods.insert(uid.clone(), pod.clone());
                    self.workers.update_pod(&uid, pod, UpdateType::Update);
                }
                Op::Delete => {
                    if self.rejected.contains_key(&uid) {
                        // Never ran: finished as it is.
                        self.rejected.insert(uid.clone(), pod.clone());
                        self.status.pod_finished(&uid, pod);
                        continue;
                    }
                    self.pods.insert(uid.clone(), pod.clone());
                    if self.workers.state(&uid) == Some(WorkerState::Done) {
                        // Finished before the deletion: nothing left to stop.
                        self.status.pod_finished(&uid, pod);
                        continue;
                    }
                    let grace = grace_override(&pod);
                    self.workers.update_pod(
                        &uid,
                        pod,
                        UpdateType::Kill {
                            grace_seconds: grace,
                        },
                    );
                }
                Op::Remove => {
                    info!(pod = %uid, name = ?pod.metadata.name, "pod removed from its source: terminating");
                    self.pods.remove(&uid);
                    self.cgroup_orphans_possible = true;
                    self.restart_requested.remove(&uid);
                    // Admission counts the pods the sources have (the
                    // kubelet's `GetActivePods` over its pod manager): a
                    // removed pod's requests and host ports are free for the
                    // next one now, while it terminates (a static pod's new
                    // version waits for it in its worker instead).
                    self.admission.release(&uid);
                    if self.rejected.remove(&uid).is_some() {
                        self.status.remove(&uid);
                        continue;
                    }
                    let state = self.workers.state(&uid);
                    if state.is_none()
                        || (state == Some(WorkerState::Done) && !self.workers.is_live(&uid))
                    {
                        // Terminated earlier (or never started): nothing to kill,
                        // forget it now.
                        self.workers.reap(&uid);
                        self.forget(&uid);
                        continue;
                    }
                    self.workers.update_pod(
                        &uid,
                        pod,
                        UpdateType::Kill {
                            grace_seconds: None,
                        },
                    );
                }
                Op::Reconcile => self.reconcile(uid, pod),
            }
        }
    }

    /// A status-only change from the source (the kubelet's
    /// `HandlePodReconcile`): the pod is updated where the sync loop keeps
    /// it, so that the next sync of any kind sees it, and its worker syncs
    /// now when its Ready condition no longer says what its readiness gates
    /// and ContainersReady say (`status.NeedToReconcilePodReadiness`): a
    /// controller set a gate's condition.
    fn reconcile(&mut self, uid: PodUid, pod: Arc<Pod>) {
        if self.rejected.contains_key(&uid) || !self.pods.contains_key(&uid) {
            return;
        }
        self.pods.insert(uid.clone(), pod.clone());
        if crate::status::generate::needs_readiness_reconcile(&pod) {
            debug!(pod = %uid, "a readiness gate's condition changed: syncing the pod");
            self.workers.update_pod(&uid, pod, UpdateType::Sync);
        }
    }

    fn add(&mut self, uid: PodUid, pod: Arc<Pod>) {
        if self.pods.contains_key(&uid) || self.rejected.contains_key(&uid) {
            return;
        }
        let state = self.workers.state(&uid);
        let mut fate = on_add(&pod, state, self.workers.is_live(&uid));
        if fate == OnAdd::Restart {
            info!(pod = %uid, name = ?pod.metadata.name, "pod added again after it terminated: starting it again");
            self.workers.forget_finished(&uid);
            self.status.reset(&uid);
            // Its cache entry stays: the runtime still has its stopped
            // sandboxes and dead containers until the container GC, and the
            // new worker acts on that view (a new sandbox's attempt follows
            // theirs, as the kubelet's, whose cache keeps them too).
            fate = on_add(&pod, None, false);
        }
        match fate {
            OnAdd::IgnoreMirror | OnAdd::Restart => return,
            OnAdd::RestartWhenFinished => {
                info!(pod = %uid, name = ?pod.metadata.name, ?state, "pod added again while terminating: it starts again once terminated");
                self.pods.insert(uid.clone(), pod);
                self.restart_requested.insert(uid);
                return;
            }
            OnAdd::Terminate => {
                info!(pod = %uid, name = ?pod.metadata.name,
                      phase = ?pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                      "pod already terminal in the API server: never started, only terminated");
                self.pods.insert(uid.clone(), pod.clone());
                self.workers.update_pod(
                    &uid,
                    pod,
                    UpdateType::Kill {
                        grace_seconds: None,
                    },
                );
                return;
            }
            OnAdd::Admit => {}
        }
        let preempted = match self.admission.admit(&uid, &pod) {
            Ok(preempted) => preempted,
            Err(r) => {
                self.reject(uid, pod, r);
                return;
            }
        };
        for victim in preempted {
            self.preempt(&victim, &pod);
        }
        info!(pod = %uid, name = ?pod.metadata.name, "pod added");
        self.pods.insert(uid.clone(), pod.clone());
        if let Some(p) = &self.prober {
            p.add_pod(&uid, &pod);
        }
        self.workers.update_pod(&uid, pod, UpdateType::Create);
    }

    /// Refuses `pod` at admission: its Failed status and event
    /// (`rejectPod`).
    fn reject(&mut self, uid: PodUid, pod: Arc<Pod>, r: crate::admission::Rejection) {
        warn!(pod = %uid, reason = %r.reason, message = %r.message, "pod rejected by admission");
        crate::admission::reject_event(&self.events, &pod, &r);
        let ctx = Context {
            host_ip: &self.host_ip,
            rejected: Some((&r.reason, &r.message)),
            ..Context::default()
        };
        self.status
            .set_pod_status(&uid, pod.clone(), generate(&pod, &Default::default(), &ctx));
        self.rejected.insert(uid, pod);
    }

    /// Stops `victim`, preempted to admit the critical pod `critical`, as
    /// the kubelet's `evictPodsToFreeRequests`: a Warning `Preempting` event
    /// on it, a kill with its grace period, and a status that says Failed,
    /// `Preempting`, with a `DisruptionTarget` condition. Admission has
    /// freed its requests already.
    fn preempt(&mut self, victim: &PodUid, critical: &Pod) {
        use crate::admission::preemption as p;
        let Some(pod) = self.pods.get(victim).cloned() else {
            return;
        };
        warn!(pod = %victim, name = ?pod.metadata.name, critical = ?critical.metadata.name,
              "preempting pod to admit a critical pod");
        self.events.record(
            &pod,
            None,
            evpleg_record::EventType::Warning,
            p::PREEMPTING_REASON,
            p::PREEMPTING_MESSAGE,
        );
        self.status.evict(
            victim,
            crate::status::manager::Eviction {
                reason: p::PREEMPTING_REASON,
                message: p::PREEMPTING_MESSAGE,
                disruption: (p::DISRUPTION_REASON, p::DISRUPTION_MESSAGE),
            },
        );
        self.workers.update_pod(
            victim,
            pod,
            UpdateType::Kill {
                grace_seconds: None,
            },
        );
    }

    fn handle_pleg(&mut self, event: PodLifecycleEvent) {
        if let Some(id) = event.died() {
            evpleg_pleg::stages::record_now(evpleg_pleg::stages::Stage::Taken, id);
        }
        self.event_latency.observe(&event, &self.cache);
        let Some(uid) = &event.pod_uid else { return };
        let latency_us =
            evpleg_core::clock::monotonic_ns().saturating_sub(event.at_ns) as f64 / 1000.0;
        info!(
            kind = ?event.kind,
            source = ?event.source,
            pod = %uid,
            name = self.pods.get(uid).and_then(|p| p.metadata.name.as_deref()).unwrap_or("-"),
            container = event.container_id.as_ref().map(|c| c.as_str()).unwrap_or("-"),
            pid = event.pid,
            exit_code = event.exit.map(|e| e.code),
            signal = event.exit.and_then(|e| e.signal),
            oom_killed = event.exit.is_some_and(|e| e.oom_killed),
            latency_us,
            "pod lifecycle event"
        );
        if let Some(pod) = self.pods.get(uid) {
            if event.source == EventSource::Kernel && event.kind == EventKind::ContainerDied {
                self.record_kernel_death(pod, uid, &event);
            }
            self.workers.update_pod(uid, pod.clone(), UpdateType::Sync);
        }
    }

    /// A death the kernel saw, as an event on the pod, recorded once the
    /// runtime reported it too (the relist's snapshot shows it exited), with
    /// how long after the kernel that was; without the lead if the runtime
    /// has not reported it within [`KERNEL_DEATH_WAIT`]. The container's name
    /// comes from the cache (a container that died before a relist listed it
    /// gets it from the relist that follows).
    fn record_kernel_death(&self, pod: &Arc<Pod>, uid: &PodUid, event: &PodLifecycleEvent) {
        let (Some(id), Some(exit)) = (event.container_id.clone(), event.exit) else {
            return;
        };
        let (cache, events, pod, uid, seen_ns) = (
            self.cache.clone(),
            self.events.clone(),
            pod.clone(),
            uid.clone(),
            event.at_ns,
        );
        tokio::spawn(async move {
            let confirmed = async {
                let mut after = 0;
                loop {
                    let entry = cache.get_newer_than(&uid, after).await;
                    // Wait for an observation newer than this moment next.
                    after = evpleg_core::clock::monotonic_ns();
                    if let Some(c) = entry.status.container(&id)
                        && c.state == evpleg_core::container::ContainerState::Exited
                        && c.source != evpleg_core::lifecycle::EventSource::Kernel
                    {
                        return (c.name.clone(), entry.observed_ns);
                    }
                }
            };
            let (name, lead) = match tokio::time::timeout(KERNEL_DEATH_WAIT, confirmed).await {
                Ok((name, at)) => (Some(name), Some(at.saturating_sub(seen_ns))),
                Err(_) => (container_name(&cache, &uid, &id), None),
            };
            crate::events::kernel_death(
                &events,
                &pod,
                name.as_deref(),
                id.as_str(),
                &exit,
                lead.map(Duration::from_nanos),
            );
        });
    }

    fn finished(&mut self, uid: PodUid) {
        self.cgroup_orphans_possible = true;
        if let Some(p) = &self.prober {
            p.remove_pod(&uid);
        }
        self.admission.release(&uid);
        self.workers.reap(&uid);
        if self.restart_requested.remove(&uid)
            && let Some(pod) = self.pods.remove(&uid)
        {
            self.add(uid, pod);
            return;
        }
        match self.pods.get(&uid) {
            // Removed from its source and terminated: forget it everywhere.
            None => self.forget(&uid),
            // Still in its source: a gracefully deleted pod can now be deleted.
            Some(pod) => self.status.pod_finished(&uid, pod.clone()),
        }
    }

    /// Forgets a pod that left its source and terminated: its status (once the
    /// last one is out). Its pod status cache entry goes with housekeeping
    /// once the runtime lists nothing of it.
    fn forget(&mut self, uid: &PodUid) {
        self.status.remove(uid);
    }

    /// Whether pod `uid` is known: its source has it or its worker still
    /// works (a worker that finished, Done, for a pod its source removed
    /// keeps nothing alive: it never syncs again).
    fn known(&self, uid: &PodUid) -> bool {
        self.pods.contains_key(uid)
            || self
                .workers
                .state(uid)
                .is_some_and(|s| s != WorkerState::Done)
    }

    /// The kubelet's `ShouldPodContentBeRemoved` for a pod that is not
    /// evicted: once every source has sent its pods, a pod no source has and
    /// whose worker has finished (the kubelet's deleted and terminated pod,
    /// or one its workers never knew).
    fn content_removable(&self, uid: &PodUid) -> bool {
        self.seen.seen_all(&self.sources) && !self.known(uid)
    }

    /// Answers the container GC: those of the UIDs asked about whose
    /// content may go.
    fn answer_gc(&self, request: crate::kuberuntime::gc::ContentRequest) {
        let removable = request
            .uids
            .into_iter()
            .filter(|u| PodUid::parse(u).is_some_and(|uid| self.content_removable(&uid)))
            .collect();
        let _ = request.reply.send(removable);
    }

    /// Forgets the cache entries of unknown pods, stops their sandboxes
    /// (the container GC removes them), and removes their empty pod cgroups
    /// and their directories.
    async fn housekeeping(&mut self) {
        if !self.seen.seen_all(&self.sources) {
            return;
        }
        self.delete_orphaned_mirrors();
        let mut scan_cgroups = std::mem::take(&mut self.cgroup_orphans_possible);
        let known = |uid: &PodUid| self.known(uid);
        // The entries of unknown pods the runtime lists nothing of (a relist
        // wrote them empty) go here, as the kubelet's relist deletes the
        // entry of a pod the runtime no longer lists; while their stopped
        // sandboxes and dead containers wait for the container GC they stay,
        // so that the cache holds what the runtime has.
        for uid in self.cache.uids() {
            if !known(&uid)
                && self.cache.get(&uid).is_none_or(|e| {
                    e.error.is_none()
                        && e.status.sandboxes.is_empty()
                        && e.status.containers.is_empty()
                })
            {
                self.cache.delete(&uid);
            }
        }
        // Pods whose sandbox could not be stopped keep their directory.
        let mut busy = HashSet::new();
        let mut listed = true;
        match self.cri.list_pod_sandboxes(None).await {
            Ok(sandboxes) => {
                for s in sandboxes {
                    let Some(uid) = s.labels.get(labels::POD_UID).and_then(|u| PodUid::parse(u))
                    else {
                        continue;
                    };
                    if known(&uid) || s.state != v1::PodSandboxState::SandboxReady as i32 {
                        continue;
                    }
                    info!(pod = %uid, sandbox = %s.id, "housekeeping: stopping the sandbox of a pod that no longer exists");
                    scan_cgroups = true;
                    if let Err(e) = self.cri.stop_pod_sandbox(&s.id).await {
                        warn!(sandbox = %s.id, error = %e, "housekeeping: stop failed");
                        busy.insert(uid);
                    }
                }
            }
            Err(e) => {
                warn!(error = %e, "housekeeping: listing sandboxes failed");
                listed = false;
            }
        }
        // The kubelet's cleanupOrphanedPodCgroups reads every hierarchy at
        // every round; here only while an orphan may exist (a dozen cgroup
        // v1 hierarchies of 100 pods read every 2 s were a quarter of an
        // idle agent's CPU).
        let mut cgroups_left = false;
        if scan_cgroups {
            for mount in &self.cgroup_mounts {
                cgroups_left |= remove_orphaned_pod_cgroups(mount, &known);
            }
        }
        // The kubelet's cleanupOrphanedPodDirs: directories of pods no
        // source lists and the runtime no longer runs (a pod deleted while
        // the agent was down), their mounts unmounted first.
        if let Some(root) = self.root_dir.as_deref().filter(|_| listed) {
            evpleg_volume::pod_dirs::remove_orphaned_pod_dirs(root, &|uid| {
                known(uid) || busy.contains(uid)
            });
        }
        self.cgroup_orphans_possible |= cgroups_left;
    }

    /// Runs until `shutdown`.
    pub async fn run(
        mut self,
        mut updates: mpsc::Receiver<PodUpdate>,
        mut pleg: mpsc::Receiver<PodLifecycleEvent>,
        mut done: mpsc::UnboundedReceiver<PodUid>,
        shutdown: CancellationToken,
    ) {
        // The first round one period after the start, not at once: the
        // sources' first sets have reached this loop by then (the mux marks a
        // source seen as it merges its set, a moment before forwarding it).
        let mut housekeeping = tokio::time::interval_at(
            tokio::time::Instant::now() + HOUSEKEEPING_PERIOD,
            HOUSEKEEPING_PERIOD,
        );
        housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut probes = self.probe_results.take();
        let mut gc_queries = self.gc_queries.take();
        loop {
            let probe = async {
                match probes.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            let gc_query = async {
                match gc_queries.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(u) = updates.recv() => self.handle_update(u),
                // A probe result changed: sync the pod, as a PLEG event does.
                Some(uid) = probe => {
                    if let Some(pod) = self.pods.get(&uid) {
                        self.workers.update_pod(&uid, pod.clone(), UpdateType::Sync);
                    }
                }
                Some(ev) = pleg.recv() => self.handle_pleg(ev),
                Some(uid) = done.recv() => self.finished(uid),
                Some(request) = gc_query => self.answer_gc(request),
                _ = housekeeping.tick() => {
                    // Updates already forwarded are handled first, so that a
                    // pod its source has is never taken for an orphan.
                    while let Ok(u) = updates.try_recv() {
                        self.handle_update(u);
                    }
                    self.housekeeping().await
                }
            }
        }
        self.workers.shutdown();
    }
}

/// The name of container `id` of pod `uid`, if the cache lists it.
fn container_name(cache: &PodStatusCache, uid: &PodUid, id: &ContainerId) -> Option<String> {
    cache.get(uid).and_then(|e| {
        e.status
            .containers
            .iter()
            .find(|c| c.id == *id)
            .map(|c| c.name.clone())
    })
}

/// How long a kernel-seen death waits for the runtime's report before its
/// event is recorded without it.
const KERNEL_DEATH_WAIT: Duration = Duration::from_secs(5);

/// Removes the pod cgroups under `mount` (both drivers' names, as the kernel
/// index classifies them) of pods `known` does not know, with their empty
/// container cgroups (the kubelet's `Destroy` removes the pod's subtree). A
/// cgroup that still holds a process cannot be removed: it is left for the
/// next round. An orphan left with an empty child kept this scan running
/// every 2 s for good (a fifth of an idle agent's CPU at 100 pods).
/// Only directories named as a pod's cgroup are classified (a cgroup v1
/// directory holds a dozen control files per pod). Returns whether an
/// orphan was left.
fn remove_orphaned_pod_cgroups(mount: &std::path::Path, known: &dyn Fn(&PodUid) -> bool) -> bool {
    let mut left = false;
    for parent in [
        "kubepods",
        "kubepods/burstable",
        "kubepods/besteffort",
        "kubepods.slice",
        "kubepods.slice/kubepods-burstable.slice",
        "kubepods.slice/kubepods-besteffort.slice",
    ] {
        let Ok(entries) = std::fs::read_dir(mount.join(parent)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            let pod_like = name.starts_with("pod") || name.ends_with(".slice");
            if !pod_like || !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Ok(CgroupClass::Pod { uid, .. }) = classify(&format!("/{parent}/{name}")) else {
                continue;
            };
            if known(&uid) {
                continue;
            }
            match remove_cgroup(&e.path()) {
                Ok(()) => {
                    info!(path = %e.path().display(), "housekeeping: removed an orphaned pod cgroup")
                }
                Err(_) => left = true,
            }
        }
    }
    left
}

/// Removes cgroup `path`, its child cgroups first. Only directories are
/// visited (a `DirEntry`'s type does not follow a symlink), and `rmdir` of a
/// cgroup fails while a process is in it: nothing else is removed.
fn remove_cgroup(path: &std::path::Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(path)?.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup(&e.path())?;
        }
    }
    std::fs::remove_dir(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orphaned_pod_cgroups_of_both_drivers_are_removed_with_their_children_known_and_busy_ones_kept()
     {
        let mount = tempfile::tempdir().unwrap();
        let known_uid = "11111111-2222-3333-4444-555555555555";
        let orphan = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
        let dirs = [
            format!("kubepods/burstable/pod{orphan}"),
            format!("kubepods/pod{known_uid}"),
            format!(
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice",
                orphan.replace('-', "_")
            ),
            format!(
                "kubepods.slice/kubepods-pod{}.slice",
                known_uid.replace('-', "_")
            ),
            // Not a pod cgroup: left alone.
            "kubepods.slice/kubepods-burstable.slice/other.slice".to_owned(),
        ];
        for d in &dirs {
            std::fs::create_dir_all(mount.path().join(d)).unwrap();
        }
        // An orphan's empty container cgroup goes with it.
        let nested = format!("kubepods/pod{}", orphan.replace('a', "b"));
        std::fs::create_dir_all(mount.path().join(&nested).join("container")).unwrap();
        // One whose container cgroup holds a process (here a file: a plain
        // directory with a file cannot be removed either) is kept.
        let busy = format!("kubepods/besteffort/pod{orphan}");
        std::fs::create_dir_all(mount.path().join(&busy).join("child")).unwrap();
        let process = mount.path().join(&busy).join("child/process");
        std::fs::write(&process, "").unwrap();
        // A control file named as a pod's cgroup is not one.
        let file = format!("kubepods/besteffort/pod{}", "f".repeat(32));
        std::fs::write(mount.path().join(&file), "").unwrap();
        let known = PodUid::parse(known_uid).unwrap();
        let left = remove_orphaned_pod_cgroups(mount.path(), &|uid: &PodUid| *uid == known);
        let exists = |d: &str| mount.path().join(d).exists();
        assert!(!exists(&dirs[0]), "the orphan's cgroupfs cgroup");
        assert!(exists(&dirs[1]), "a known pod's cgroup");
        assert!(!exists(&dirs[2]), "the orphan's systemd slice");
        assert!(exists(&dirs[3]), "a known pod's slice");
        assert!(exists(&dirs[4]), "not a pod cgroup");
        assert!(!exists(&nested), "an orphan with an empty child cgroup");
        assert!(exists(&busy), "a cgroup whose child holds a process");
        assert!(exists(&file), "a file");
        assert!(left, "the busy orphan is left for the next round");
        std::fs::remove_file(&process).unwrap();
        let left = remove_orphaned_pod_cgroups(mount.path(), &|uid: &PodUid| *uid == known);
        assert!(!exists(&busy) && !left, "removed once empty");
    }
}

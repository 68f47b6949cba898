//! The merge of kernel events with runtime truth, in `ebpf` mode (the kubelet has
//! no counterpart: its PLEG only polls). It enforces the kernel side of the
//! contract in docs/pleg.md:
//!
//! * a certain kernel death (Died, with its exit) is remembered and overlaid on
//!   the pod's latest complete snapshot in the cache, then forwarded to the pod
//!   workers, then the pod is relisted to confirm it. When the cache holds no
//!   snapshot of the pod, or the snapshot does not hold the container (it was
//!   created after the last relist), nothing is written or forwarded: the pod
//!   relist brings the snapshot, and the remembered exit is overlaid on it;
//! * a kernel start is forwarded (a wake-up; nothing is written) when the
//!   snapshot knows the container, and the pod relisted either way (re-checked
//!   until the confirmation bound when the snapshot did not know it);
//! * a hint (`PodSync` from the kernel: an uncertain main process, a cgroup gone
//!   before its main process was seen to exit) relists the pod and nothing else,
//!   re-checked for [`super::relist::DOUBT_WATCH`] (the runtime may report the
//!   death late);
//!   an event naming no pod relists everything;
//! * a transition is recorded in [`KernelReports`] only once the event was
//!   delivered, so a dropped one is sent by the relist instead; one the relist
//!   delivered first is not sent again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc::{self, error::TrySendError};
use tokio_util::sync::CancellationToken;

use super::on_demand::{PodRelistQueue, Watch};
use super::relist::{Delivery, KernelReports};
use super::stages::{self, Stage};
use evpleg_core::cache::{KernelExit, PodStatusCache};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::{EventKind, PodLifecycleEvent, RelistSignal};

/// Counters of the merge.
#[derive(Debug, Default)]
pub struct MergeStats {
    pub forwarded: AtomicU64,
    /// Events the workers' channel could not take (the relist sends them).
    pub discarded: AtomicU64,
    /// Events naming no pod: a full relist was requested.
    pub unattributed: AtomicU64,
    /// Hints: pod relists requested for something the kernel cannot vouch for.
    pub hints: AtomicU64,
    /// Certain deaths or starts of containers the pod's snapshot did not hold yet.
    pub deferred: AtomicU64,
}

/// Merges kernel events into the cache and forwards them.
#[derive(Debug)]
pub struct KernelMerge {
    pub cache: Arc<PodStatusCache>,
    pub reports: Arc<KernelReports>,
    /// The pod workers' event channel.
    pub out: mpsc::Sender<PodLifecycleEvent>,
    /// On-demand relists of one pod.
    pub pod_relist: Arc<PodRelistQueue>,
    pub relist: Arc<RelistSignal>,
    pub stats: Arc<MergeStats>,
}

/// A lock the merge needed was held by another thread, named: nothing that
/// needs it was done (what was done before is idempotent: the whole event can
/// be handled again with [`KernelMerge::handle`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Busy {
    /// The pod status cache's.
    Cache,
    /// The delivered transitions' ([`KernelReports`]).
    Reports,
    /// The on-demand relist queue's ([`PodRelistQueue`]).
    RelistQueue,
}

impl KernelMerge {
    /// Applies one kernel event, waiting for the locks it needs.
    pub fn handle(&self, event: PodLifecycleEvent) {
        // Blocking: never busy.
        let _ = self.apply(&event, true);
    }

    /// Applies one kernel event if every lock it needs is free now (the
    /// real-time reader's path: it never waits for a lock that a
    /// normal-priority thread may hold). On `Busy` the caller hands the event
    /// to [`KernelMerge::handle`] on another thread; the steps already done
    /// (an exit recorded and laid, a delivery, a relist request) are
    /// idempotent, so nothing is done twice that matters and nothing is lost.
    pub fn try_handle(&self, event: &PodLifecycleEvent) -> Result<(), Busy> {
        self.apply(event, false)
    }

    fn apply(&self, event: &PodLifecycleEvent, blocking: bool) -> Result<(), Busy> {
        let Some(uid) = &event.pod_uid else {
            self.stats.unattributed.fetch_add(1, Ordering::Relaxed);
            self.relist.request_silently();
            return Ok(());
        };
        let Some(id) = &event.container_id else {
            return self.hint(uid, blocking);
        };
        let known = match event.kind {
            EventKind::ContainerDied | EventKind::SandboxDied => {
                let Some(exit) = event.exit else {
                    // A death without its exit status is not certain.
                    return self.hint(uid, blocking);
                };
                let exit = KernelExit {
                    status: exit,
                    at_ns: event.at_ns,
                };
                let known = if blocking {
                    self.cache.record_exit(uid, id, exit);
                    self.cache.overlay_exit(uid, id, &exit.status, exit.at_ns)
                } else {
                    self.cache
                        .try_record_and_overlay_exit(uid, id, exit)
                        .ok_or(Busy::Cache)?
                };
                if known {
                    stages::record_now(Stage::Cached, id);
                }
                known
            }
            EventKind::ContainerStarted | EventKind::SandboxStarted => {
                if blocking {
                    self.cache.get(uid).is_some_and(|e| {
                        e.error.is_none()
                            && (e.status.container(id).is_some()
                                || e.status.sandboxes.iter().any(|s| s.id == *id))
                    })
                } else {
                    self.cache.try_holds(uid, id).ok_or(Busy::Cache)?
                }
            }
            // Not the kernel's to say (a cgroup's removal is not the runtime
            // forgetting the container): a hint, as is a PodSync.
            EventKind::PodSync | EventKind::ContainerRemoved | EventKind::SandboxRemoved => {
                return self.hint(uid, blocking);
            }
        };
        if known {
            self.forward(event, uid, id, blocking)?;
            self.relist_pod(uid, Watch::Once, false, blocking)
        } else {
            // The runtime may still say Created: re-checked until the bound, so
            // the relist sends the transition as soon as the runtime shows it.
            self.relist_pod(uid, Watch::Deferred, false, blocking)?;
            self.stats.deferred.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    fn relist_pod(
        &self,
        uid: &PodUid,
        watch: Watch,
        redeliver: bool,
        blocking: bool,
    ) -> Result<(), Busy> {
        if !blocking {
            return match self.pod_relist.try_push(uid, watch, redeliver) {
                true => Ok(()),
                false => Err(Busy::RelistQueue),
            };
        }
        let uid = uid.clone();
        match (watch, redeliver) {
            (_, true) => self.pod_relist.redeliver(uid),
            (Watch::Once, false) => self.pod_relist.request(uid),
            (Watch::Deferred, false) => self.pod_relist.deferred(uid),
            (Watch::Doubt, false) => self.pod_relist.doubt(uid),
        }
        Ok(())
    }

    /// Something the kernel cannot vouch for: the pod is relisted and
    /// re-checked for [`super::relist::DOUBT_WATCH`] (an uncertain death the
    /// runtime reports late is still reported).
    fn hint(&self, uid: &PodUid, blocking: bool) -> Result<(), Busy> {
        self.relist_pod(uid, Watch::Doubt, false, blocking)?;
        self.stats.hints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Offers the event to the workers' channel through [`KernelReports`].
    /// Never logs (it may run on the real-time reader): a full channel is
    /// counted in [`MergeStats::discarded`], which the kernel PLEG's
    /// normal-priority thread logs.
    fn forward(
        &self,
        event: &PodLifecycleEvent,
        uid: &PodUid,
        id: &ContainerId,
        blocking: bool,
    ) -> Result<(), Busy> {
        let kind = event.kind;
        let send = || match self.out.try_send(event.clone()) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => false,
            // Shutting down: nobody listens any more.
            Err(TrySendError::Closed(_)) => true,
        };
        let delivery = if blocking {
            self.reports.deliver(id, kind, event.at_ns, send)
        } else {
            self.reports
                .try_deliver(id, kind, event.at_ns, send)
                .ok_or(Busy::Reports)?
        };
        match delivery {
            Delivery::Sent => {
                if kind.is_died() {
                    stages::record_now(Stage::Delivered, id);
                }
                self.stats.forwarded.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Delivery::AlreadyDelivered => Ok(()),
            Delivery::Dropped => {
                // The relist sends it: a redelivery no full relist skips.
                self.relist_pod(uid, Watch::Once, true, blocking)?;
                self.stats.discarded.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// Runs until `kernel_events` closes or `shutdown`.
    pub async fn run(
        self,
        mut kernel_events: mpsc::Receiver<PodLifecycleEvent>,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                ev = kernel_events.recv() => match ev {
                    Some(ev) => self.handle(ev),
                    None => break,
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::clock::ManualClock;
    use evpleg_core::container::{ContainerState, ContainerStatus, PodStatus};
    use evpleg_core::ids::{ContainerId, PodUid};
    use evpleg_core::lifecycle::{EventSource, ExitStatus};

    fn fixture(capacity: usize) -> (KernelMerge, mpsc::Receiver<PodLifecycleEvent>) {
        let (out, rx) = mpsc::channel(capacity);
        let merge = KernelMerge {
            cache: Arc::new(PodStatusCache::new()),
            reports: Arc::new(KernelReports::default()),
            out,
            pod_relist: Arc::new(PodRelistQueue::new(Arc::new(ManualClock::new(1)))),
            relist: Arc::new(RelistSignal::new()),
            stats: Arc::new(MergeStats::default()),
        };
        (merge, rx)
    }

    fn uid() -> PodUid {
        PodUid::parse(&"a".repeat(32)).unwrap()
    }

    fn cid(c: char) -> ContainerId {
        ContainerId::parse(&c.to_string().repeat(64)).unwrap()
    }

    fn died(uid: Option<PodUid>, id: char, code: u32) -> PodLifecycleEvent {
        PodLifecycleEvent {
            pod_uid: uid,
            kind: EventKind::ContainerDied,
            container_id: Some(cid(id)),
            at_ns: 500,
            source: EventSource::Kernel,
            exit: Some(ExitStatus::from_wait_status(code << 8, false)),
            pid: Some(10),
        }
    }

    fn snapshot(merge: &KernelMerge) {
        let mut s = PodStatus {
            uid: Some(uid()),
            ..PodStatus::default()
        };
        s.containers.push(ContainerStatus::new(
            cid('c'),
            "app",
            ContainerState::Running,
            EventSource::Relist,
        ));
        merge.cache.set(&uid(), s, 100);
    }

    /// The exit code the cache keeps for container `c` of the test pod.
    fn kernel_code(merge: &KernelMerge, c: char) -> i32 {
        (merge.cache.kernel_exit(&uid(), &cid(c)))
            .expect("a kernel exit")
            .status
            .code
    }

    #[test]
    fn a_certain_death_is_overlaid_before_it_is_forwarded() {
        let (merge, mut rx) = fixture(10);
        snapshot(&merge);
        merge.handle(died(Some(uid()), 'c', 7));
        let entry = merge.cache.get(&uid()).unwrap();
        let c = entry.status.container(&cid('c')).unwrap();
        assert_eq!(
            (c.state, c.exit_code, c.reason.as_str(), c.name.as_str()),
            (ContainerState::Exited, Some(7), "Error", "app")
        );
        assert_eq!(
            (entry.observed_ns, entry.deaths_ns),
            (100, 500),
            "the snapshot's own time is kept apart from the death's"
        );
        assert_eq!(kernel_code(&merge, 'c'), 7);
        assert_eq!(rx.try_recv().unwrap().kind, EventKind::ContainerDied);
        assert_eq!(
            merge.reports.get(&cid('c')).unwrap().0,
            evpleg_core::runtime::PlegState::Exited
        );
        assert_eq!(
            merge
                .pod_relist
                .take()
                .into_iter()
                .map(|(u, _)| u)
                .collect::<Vec<_>>(),
            vec![uid()],
            "the pod is relisted to confirm"
        );
    }

    #[test]
    fn no_partial_entry_for_a_pod_or_container_not_in_a_snapshot() {
        let (merge, mut rx) = fixture(10);
        merge.handle(died(Some(uid()), 'c', 7));
        assert!(merge.cache.get(&uid()).is_none(), "no partial entry");
        assert!(rx.try_recv().is_err(), "nothing forwarded");
        assert_eq!(
            merge.pod_relist.take()[0].1.watch,
            crate::on_demand::Watch::Deferred,
            "the pod is relisted instead, until the bound"
        );
        assert_eq!(
            kernel_code(&merge, 'c'),
            7,
            "the certain exit waits for the snapshot"
        );
        snapshot(&merge);
        merge.handle(died(Some(uid()), 'd', 3));
        let entry = merge.cache.get(&uid()).unwrap();
        assert_eq!(entry.status.containers.len(), 1, "no nameless container");
        assert!(rx.try_recv().is_err());
        assert!(merge.reports.is_empty());
        assert_eq!(merge.stats.deferred.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_dropped_event_is_not_recorded_as_reported() {
        let (merge, mut rx) = fixture(1);
        snapshot(&merge);
        merge
            .out
            .try_send(died(None, 'f', 0))
            .expect("fill the channel");
        merge.handle(died(Some(uid()), 'c', 7));
        assert_eq!(merge.stats.discarded.load(Ordering::Relaxed), 1);
        assert!(
            merge.reports.get(&cid('c')).is_none(),
            "the relist must still send it"
        );
        let requests = merge.pod_relist.take();
        assert_eq!(requests.len(), 1);
        assert!(
            requests[0].1.redeliver,
            "a redelivery, which no full relist skips: {requests:?}"
        );
        rx.try_recv().unwrap();
    }

    #[test]
    fn hints_and_unattributed_events_only_relist() {
        let (merge, mut rx) = fixture(10);
        snapshot(&merge);
        let before = merge.cache.get(&uid()).unwrap();
        let mut hint = died(Some(uid()), 'c', 7);
        hint.kind = EventKind::PodSync;
        hint.exit = None;
        merge.handle(hint);
        let mut no_exit = died(Some(uid()), 'c', 0);
        no_exit.exit = None;
        merge.handle(no_exit);
        let mut removed = died(Some(uid()), 'c', 0);
        removed.kind = EventKind::ContainerRemoved;
        merge.handle(removed);
        assert_eq!(merge.cache.get(&uid()).unwrap(), before, "nothing written");
        assert!(merge.cache.kernel_exit(&uid(), &cid('c')).is_none());
        assert!(rx.try_recv().is_err());
        assert_eq!(merge.stats.hints.load(Ordering::Relaxed), 3);
        let taken = merge.pod_relist.take();
        assert_eq!(taken.len(), 1);
        assert_eq!(
            taken[0].1.watch,
            crate::on_demand::Watch::Doubt,
            "watched for the doubt's window"
        );
        merge.handle(died(None, 'c', 1));
        assert_eq!(merge.relist.count(), 1);
        assert_eq!(merge.stats.unattributed.load(Ordering::Relaxed), 1);
    }
}

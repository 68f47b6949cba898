//! The merge of kernel events with runtime truth, in `ebpf` mode.
//!
//! A kernel ContainerDied updates the pod status cache's view of that container at
//! once (exited, exit code, finished at the kernel's timestamp, reason) and the
//! exit is remembered, then the event goes to the pod workers and the pod alone is
//! relisted to confirm it with the runtime (see [`super::relist`] for what happens
//! when the runtime lags or disagrees). Every kernel transition is recorded in
//! [`KernelReports`] so that the relist does not send it a second time.
//!
//! An event whose pod the cgroup path does not name (`/k8s.io/<id>`) cannot be
//! attributed here: it raises a full relist, which sends the runtime's event.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc::{self, error::TrySendError};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::cache::{KernelExit, PodStatusCache};
use super::relist::{KernelReports, PlegState};
use super::{EventKind, EventSource, PodLifecycleEvent, RelistSignal};
use crate::container::{ContainerState, ContainerStatus, monotonic_to_unix_ns};

/// Counters of the merge.
#[derive(Debug, Default)]
pub struct MergeStats {
    pub forwarded: AtomicU64,
    pub discarded: AtomicU64,
    pub unattributed: AtomicU64,
}

/// Merges kernel events into the cache and forwards them.
#[derive(Debug)]
pub struct KernelMerge {
    pub cache: Arc<PodStatusCache>,
    pub reports: Arc<KernelReports>,
    /// The pod workers' event channel.
    pub out: mpsc::Sender<PodLifecycleEvent>,
    /// On-demand relists of one pod.
    pub pod_relist: mpsc::UnboundedSender<crate::pleg::PodUid>,
    pub relist: Arc<RelistSignal>,
    pub stats: Arc<MergeStats>,
}

impl KernelMerge {
    /// Applies one kernel event.
    pub fn handle(&self, event: PodLifecycleEvent) {
        let (Some(uid), Some(id)) = (event.pod_uid.clone(), event.container_id.clone()) else {
            self.stats.unattributed.fetch_add(1, Ordering::Relaxed);
            self.relist
                .request("kernel event for a container whose pod is unknown");
            return;
        };
        match event.kind {
            EventKind::ContainerDied | EventKind::SandboxDied => {
                self.reports.record(&id, PlegState::Exited, event.at_ns);
                if let Some(exit) = event.exit {
                    self.cache.record_exit(
                        &uid,
                        &id,
                        KernelExit {
                            status: exit,
                            at_ns: event.at_ns,
                        },
                    );
                    let finished = monotonic_to_unix_ns(event.at_ns);
                    self.cache.update(&uid, event.at_ns, |status| {
                        if let Some(c) = status.container_mut(&id) {
                            c.apply_exit(&exit, finished);
                        } else if event.kind == EventKind::ContainerDied {
                            let mut c = ContainerStatus::new(
                                id.clone(),
                                "",
                                ContainerState::Exited,
                                EventSource::Kernel,
                            );
                            c.apply_exit(&exit, finished);
                            status.containers.push(c);
                        }
                    });
                }
            }
            EventKind::ContainerStarted | EventKind::SandboxStarted => {
                self.reports.record(&id, PlegState::Running, event.at_ns);
            }
            EventKind::ContainerRemoved | EventKind::SandboxRemoved => {
                self.reports
                    .record(&id, PlegState::NonExistent, event.at_ns);
            }
            EventKind::PodSync => {}
        }
        match self.out.try_send(event) {
            Ok(()) => {
                self.stats.forwarded.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(e)) => {
                self.stats.discarded.fetch_add(1, Ordering::Relaxed);
                warn!(kind = ?e.kind, pod = %uid, "pod worker channel full: kernel event discarded, relist requested");
                self.relist.request("pod worker channel full");
            }
            Err(TrySendError::Closed(_)) => {}
        }
        let _ = self.pod_relist.send(uid);
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
    use crate::pleg::{ContainerId, ExitStatus, PodUid};

    fn fixture() -> (
        KernelMerge,
        mpsc::Receiver<PodLifecycleEvent>,
        mpsc::UnboundedReceiver<PodUid>,
    ) {
        let (out, rx) = mpsc::channel(10);
        let (pod_relist, pod_rx) = mpsc::unbounded_channel();
        let merge = KernelMerge {
            cache: Arc::new(PodStatusCache::new()),
            reports: Arc::new(KernelReports::default()),
            out,
            pod_relist,
            relist: Arc::new(RelistSignal::new()),
            stats: Arc::new(MergeStats::default()),
        };
        (merge, rx, pod_rx)
    }

    fn died(uid: Option<PodUid>, code: u32) -> PodLifecycleEvent {
        PodLifecycleEvent {
            pod_uid: uid,
            kind: EventKind::ContainerDied,
            container_id: ContainerId::parse(&"c".repeat(64)),
            at_ns: 500,
            source: EventSource::Kernel,
            exit: Some(ExitStatus::from_wait_status(code << 8, false)),
            pid: Some(10),
        }
    }

    #[test]
    fn a_kernel_death_is_in_the_cache_before_the_event_is_forwarded() {
        let (merge, mut rx, mut pods) = fixture();
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let id = ContainerId::parse(&"c".repeat(64)).unwrap();
        merge.handle(died(Some(uid.clone()), 7));
        let entry = merge.cache.get(&uid).unwrap();
        let c = entry.status.container(&id).unwrap();
        assert_eq!(
            (c.state, c.exit_code, c.reason.as_str()),
            (ContainerState::Exited, Some(7), "Error")
        );
        assert_eq!(entry.observed_ns, 500);
        assert_eq!(merge.cache.kernel_exit(&id).unwrap().status.code, 7);
        assert_eq!(rx.try_recv().unwrap().kind, EventKind::ContainerDied);
        assert_eq!(
            pods.try_recv().unwrap(),
            uid,
            "the pod is relisted to confirm"
        );
    }

    #[test]
    fn unattributed_events_ask_for_a_full_relist() {
        let (merge, mut rx, _pods) = fixture();
        merge.handle(died(None, 1));
        assert_eq!(merge.relist.count(), 1);
        assert!(rx.try_recv().is_err());
        assert_eq!(merge.stats.unattributed.load(Ordering::Relaxed), 1);
    }
}

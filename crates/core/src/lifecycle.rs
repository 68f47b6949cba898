//! The contract between every PLEG and the pod workers: the kubelet's
//! `PodLifecycleEvent` (`pkg/kubelet/pleg/pleg.go`), with the exit status the
//! kernel reports, and the request for a relist that anything lost raises.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

use crate::ids::{ContainerId, PodUid};

/// Requests for a relist of the runtime, raised whenever an event may have been
/// lost (a kernel ring-buffer drop, a full event channel, an exit never seen). The
/// relist PLEG waits on it; nothing that is lost goes unnoticed.
#[derive(Debug, Default)]
pub struct RelistSignal {
    requested: AtomicU64,
    notify: Notify,
}

impl RelistSignal {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks for a relist; cheap and non-blocking, callable from any thread.
    pub fn request(&self, reason: &str) {
        tracing::debug!(reason, "relist requested");
        self.request_silently();
    }

    /// [`RelistSignal::request`] without the debug log: for the kernel
    /// PLEG's real-time reader, which never logs (its requests are counted by
    /// reason and logged from the counts by a normal-priority thread).
    pub fn request_silently(&self) {
        self.requested.fetch_add(1, Ordering::Relaxed);
        self.notify.notify_one();
    }

    /// How many relists were requested so far.
    pub fn count(&self) -> u64 {
        self.requested.load(Ordering::Relaxed)
    }

    /// Waits until a relist is requested (a request made while nobody waited is
    /// kept for the next waiter).
    pub async fn requested(&self) {
        self.notify.notified().await;
    }
}

/// The kubelet's `PodLifecycleEventType`, with sandboxes told apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    ContainerStarted,
    ContainerDied,
    ContainerRemoved,
    SandboxStarted,
    SandboxDied,
    SandboxRemoved,
    /// Something about the pod changed; re-inspect it (the kubelet's PodSync).
    PodSync,
}

impl EventKind {
    /// A container or sandbox died (the kinds that carry an exit).
    pub fn is_died(self) -> bool {
        matches!(self, EventKind::ContainerDied | EventKind::SandboxDied)
    }
}

/// Who observed the event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventSource {
    Kernel,
    Relist,
    Cri,
}

/// How a process ended, from its wait status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExitStatus {
    /// The exit code, as the CRI reports it: the code passed to `exit`, or
    /// 128 + the signal number for a death by signal.
    pub code: i32,
    /// The terminating signal, if any.
    pub signal: Option<i32>,
    /// A core dump was written.
    pub core_dumped: bool,
    /// The OOM killer chose this process.
    pub oom_killed: bool,
}

impl ExitStatus {
    /// Decodes a wait status (`task_struct.exit_code`).
    pub fn from_wait_status(status: u32, oom_killed: bool) -> Self {
        let signal = (status & 0x7f) as i32;
        if signal == 0 {
            Self {
                code: ((status >> 8) & 0xff) as i32,
                signal: None,
                core_dumped: false,
                oom_killed,
            }
        } else {
            Self {
                code: 128 + signal,
                signal: Some(signal),
                core_dumped: status & 0x80 != 0,
                oom_killed,
            }
        }
    }
}

/// A lifecycle event for one pod: the contract between every PLEG and the pod
/// workers (`design.md`: "Contracts worth fixing early").
///
/// From the kernel (`source == Kernel`, docs/pleg.md "The contract"): Started and
/// Died kinds only for a main process whose identity is certain, Died always with
/// its `exit`; `PodSync` is a *hint* (something happened in this pod that the
/// kernel cannot vouch for: an uncertain main process, a cgroup removed before its
/// main process was seen to exit) that relists the pod and writes nothing to the
/// cache. The kernel never sends the Removed kinds: a cgroup's removal is not the
/// runtime forgetting the container; only the relist reports removal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodLifecycleEvent {
    /// `None` only when the cgroup layout does not name the pod (containerd without
    /// a cgroup parent: `/k8s.io/<id>`); the runtime side fills it in.
    pub pod_uid: Option<PodUid>,
    pub kind: EventKind,
    pub container_id: Option<ContainerId>,
    /// CLOCK_MONOTONIC nanoseconds (the clock of `bpf_ktime_get_ns`).
    pub at_ns: u64,
    pub source: EventSource,
    /// Set for the Died kinds.
    pub exit: Option<ExitStatus>,
    /// The container's main process, when known.
    pub pid: Option<u32>,
}

impl PodLifecycleEvent {
    /// The container this event reports dead, if it is a Died kind naming one.
    pub fn died(&self) -> Option<&ContainerId> {
        self.container_id.as_ref().filter(|_| self.kind.is_died())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_died_kind_naming_a_container_is_a_death() {
        let id = ContainerId::parse(&"c1".repeat(32)).expect("64 hex digits");
        let event = |kind, container_id| PodLifecycleEvent {
            pod_uid: None,
            kind,
            container_id,
            at_ns: 0,
            source: EventSource::Kernel,
            exit: None,
            pid: None,
        };
        use EventKind::*;
        let table = [
            (ContainerDied, Some(id.clone()), true),
            (SandboxDied, Some(id.clone()), true),
            (ContainerDied, None, false),
            (ContainerStarted, Some(id.clone()), false),
            (ContainerRemoved, Some(id.clone()), false),
            (SandboxStarted, Some(id.clone()), false),
            (SandboxRemoved, Some(id.clone()), false),
            (PodSync, Some(id.clone()), false),
        ];
        for (kind, container, dead) in table {
            let e = event(kind, container);
            assert_eq!(e.died().is_some(), dead, "{kind:?} {:?}", e.container_id);
        }
        assert_eq!(event(ContainerDied, Some(id.clone())).died(), Some(&id));
    }

    #[test]
    fn wait_status() {
        let exit7 = ExitStatus::from_wait_status(0x700, false);
        assert_eq!(
            (exit7.code, exit7.signal, exit7.core_dumped),
            (7, None, false)
        );
        let kill = ExitStatus::from_wait_status(9, true);
        assert_eq!(
            (kill.code, kill.signal, kill.oom_killed),
            (137, Some(9), true)
        );
        let segv_core = ExitStatus::from_wait_status(0x80 | 11, false);
        assert_eq!(
            (segv_core.code, segv_core.signal, segv_core.core_dumped),
            (139, Some(11), true)
        );
    }
}

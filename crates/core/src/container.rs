//! Runtime-agnostic pod and container status: the kubelet's
//! `pkg/kubelet/container` types (`PodStatus`, `Status`, `ContainerState`), which
//! the PLEG writes into the pod status cache and the pod workers read.
//!
//! Times of container transitions (`created_at`, `started_at`, `finished_at`) are
//! wall-clock Unix nanoseconds, as the CRI reports them; a kernel observation
//! (CLOCK_MONOTONIC) is converted with [`monotonic_to_unix_ns`]. Times of
//! *observations* (when the cache learned something) stay monotonic.

use std::collections::BTreeMap;

use crate::ids::{ContainerId, PodUid};
use crate::lifecycle::{EventSource, ExitStatus};

/// A container's state, as the kubelet's `ContainerState`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ContainerState {
    Created,
    Running,
    Exited,
    Unknown,
}

/// One container (or sandbox) of a pod as last observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerStatus {
    pub id: ContainerId,
    /// The container's name in the pod spec.
    pub name: String,
    /// CRI attempt number (restart count as the runtime numbers it).
    pub attempt: u32,
    pub state: ContainerState,
    pub created_at: Option<i64>,
    pub started_at: Option<i64>,
    pub finished_at: Option<i64>,
    pub exit_code: Option<i32>,
    /// Runtime reason: "Completed", "Error", "OOMKilled", ...
    pub reason: String,
    pub message: String,
    pub image: String,
    pub image_ref: String,
    /// Hash of the container's spec (label `io.evpleg.container.hash`), to detect
    /// spec changes.
    pub hash: Option<u64>,
    /// The terminating signal, when the kernel saw it.
    pub signal: Option<i32>,
    /// Who produced the current state.
    pub source: EventSource,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// The host pid of the main process as the runtime records it (`verbose`
    /// `ContainerStatus`); `None` when the runtime does not say or it is not running.
    pub pid: Option<u32>,
}

impl ContainerStatus {
    /// A status with only an id and a state; the rest empty.
    pub fn new(id: ContainerId, name: &str, state: ContainerState, source: EventSource) -> Self {
        Self {
            id,
            name: name.to_owned(),
            attempt: 0,
            state,
            created_at: None,
            started_at: None,
            finished_at: None,
            exit_code: None,
            reason: String::new(),
            message: String::new(),
            image: String::new(),
            image_ref: String::new(),
            hash: None,
            signal: None,
            source,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            pid: None,
        }
    }

    /// The runtime reports the container exited without knowing how:
    /// containerd's `unknownExitCode` 255 with reason `Unknown`, given to a
    /// container whose task it no longer finds (containerd 2 deletes the task
    /// of a container that exited while containerd was down, its exit status
    /// with it). The kubelet shows that as it is; a certain kernel exit is kept
    /// instead (docs/pleg.md).
    pub fn exit_unknown(&self) -> bool {
        self.state == ContainerState::Exited
            && self.exit_code == Some(UNKNOWN_EXIT_CODE)
            && self.reason == UNKNOWN_EXIT_REASON
    }

    /// Applies a kernel-observed exit: exited, exit code, finish time, reason.
    pub fn apply_exit(&mut self, exit: &ExitStatus, finished_at_unix_ns: i64) {
        self.state = ContainerState::Exited;
        self.exit_code = Some(exit.code);
        self.signal = exit.signal;
        self.finished_at = Some(finished_at_unix_ns);
        self.reason = exit_reason(exit).to_owned();
        self.source = EventSource::Kernel;
    }
}

/// containerd's exit code and reason for an exit it lost
/// ([`ContainerStatus::exit_unknown`]).
pub const UNKNOWN_EXIT_CODE: i32 = 255;
pub const UNKNOWN_EXIT_REASON: &str = "Unknown";

/// The kubelet's termination reasons: OOMKilled, Completed (code 0), Error.
pub fn exit_reason(exit: &ExitStatus) -> &'static str {
    if exit.oom_killed {
        "OOMKilled"
    } else if exit.code == 0 {
        "Completed"
    } else {
        "Error"
    }
}

/// A pod sandbox's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SandboxState {
    Ready,
    NotReady,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxStatus {
    pub id: ContainerId,
    pub state: SandboxState,
    pub attempt: u32,
    pub created_at: Option<i64>,
    pub ip: Option<String>,
    /// The host pid of the sandbox's (pause) process, as the runtime records it.
    pub pid: Option<u32>,
}

/// Everything the runtime (and the kernel) say about one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodStatus {
    pub uid: Option<PodUid>,
    pub name: String,
    pub namespace: String,
    pub ips: Vec<String>,
    pub sandboxes: Vec<SandboxStatus>,
    pub containers: Vec<ContainerStatus>,
}

impl PodStatus {
    pub fn container(&self, id: &ContainerId) -> Option<&ContainerStatus> {
        self.containers.iter().find(|c| c.id == *id)
    }

    pub fn container_mut(&mut self, id: &ContainerId) -> Option<&mut ContainerStatus> {
        self.containers.iter_mut().find(|c| c.id == *id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(c: char) -> ContainerId {
        ContainerId::parse(&c.to_string().repeat(64)).unwrap()
    }

    #[test]
    fn exit_reasons() {
        let oom = ExitStatus::from_wait_status(9, true);
        let ok = ExitStatus::from_wait_status(0, false);
        let err = ExitStatus::from_wait_status(0x300, false);
        assert_eq!(
            [exit_reason(&oom), exit_reason(&ok), exit_reason(&err)],
            ["OOMKilled", "Completed", "Error"]
        );
        let mut c =
            ContainerStatus::new(id('a'), "app", ContainerState::Running, EventSource::Relist);
        c.apply_exit(&err, 42);
        assert_eq!(
            (c.state, c.exit_code, c.finished_at, c.reason.as_str()),
            (ContainerState::Exited, Some(3), Some(42), "Error")
        );
        assert_eq!(c.source, EventSource::Kernel);
    }
}

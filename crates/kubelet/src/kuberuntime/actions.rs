//! What SyncPod must do: the kubelet's `computePodActions`
//! (`kuberuntime_manager.go`), as a pure function of the pod's spec, what the
//! runtime (and the kernel) last observed, and the restart back-off.
//!
//! * A pod without a ready sandbox gets a new one; everything in the old one is
//!   killed; init containers run again, app containers start again except those
//!   that succeeded under OnFailure. Attempt numbers continue from the newest
//!   container (by creation time), whatever its sandbox. A `restartPolicy: Never`
//!   pod whose containers already ran gets no new sandbox: it is killed and done
//!   (Failed unless every container exited 0; the kubelet leaves it to the
//!   status, evpleg says it at once).
//! * Init containers run one at a time, in order, each to completion before the
//!   next; app containers start once all succeeded. A sidecar (an init
//!   container with `restartPolicy: Always`, KEP-753) is started in its turn
//!   and the next init container starts once it has started (it runs and its
//!   startup probe, if any, succeeded: the caller's `started`, from
//!   [`crate::prober`]); it keeps running next to the app
//!   containers, is restarted whenever it exits (with its back-off), whatever
//!   the pod's policy, and does not count for the pod's end: once the app
//!   containers are done the pod is terminal and its sidecars are stopped,
//!   after the app containers, in reverse order ([`super::terminate`]). Once
//!   an app container is created or running, plain init containers are not
//!   run again (the kubelet's `isPreviouslyInitialized`); exited app
//!   containers do not count, and a new sandbox purges the init containers
//!   (SyncPod removes them, the kubelet's `purgeInitContainers`), so the init
//!   containers all run again, in order, before the app containers restart.
//! * A running container whose spec hash changed is killed and started again,
//!   a started sidecar too ("Init container <name> definition changed"; no
//!   later init container is looked at in that sync).
//! * A container in Created state (its start failed) is started again, as
//!   `ShouldContainerBeRestarted`; an Unknown one is killed and started
//!   again, a sidecar too (the app containers are still looked at).
//! * An exited container restarts per `restartPolicy` (Always; OnFailure when the
//!   exit code is not 0; Never), after its CrashLoopBackOff ([`super::backoff`]),
//!   measured as the kubelet's `doBackOff` from the runtime's `finishedAt`:
//!   a death only the kernel has reported (its earlier time) restarts once
//!   the runtime has reported it too, or once the back-off is over measured
//!   from the kernel's time plus [`REAP_SLACK`] (the runtime's `finishedAt`
//!   is its shim's reaping, milliseconds after the kernel's exit, where its
//!   report can come seconds later under load), if a back-off applies (a
//!   first restart does not wait).
//! * With Never (all containers exited) or OnFailure (all exited 0) the pod is
//!   terminal: Succeeded when every exit code is 0, else Failed.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod};
use sha2::{Digest, Sha256};

use super::backoff::{BackoffKey, CrashBackoff, go_duration};
use evpleg_core::container::{ContainerState, ContainerStatus, PodStatus, SandboxState};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::EventSource;

/// How soon a container whose back-off is over by the kernel's death time,
/// but whose death the runtime has not reported yet, is looked at again (at
/// most: sooner when [`REAP_SLACK`] ends sooner).
pub const KERNEL_DEATH_RECHECK: Duration = Duration::from_millis(50);
/// How much later than the kernel's death time the runtime's `finishedAt`
/// may be: its shim reaps the process after the kernel's exit (p50 2 ms,
/// max 36 ms in the benchmark's shim-reaped stage). A death only the kernel
/// has reported restarts once its back-off is over measured from the kernel's
/// time plus this, whether or not the runtime has reported it: containerd
/// reported exits up to 4.3 s late under the whole fidelity corpus, and a
/// restart waiting for that came 3 to 4 s after the back-off (issue #31).
pub const REAP_SLACK: Duration = Duration::from_millis(100);

/// A pod's restart policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartPolicy {
    Always,
    OnFailure,
    Never,
}

impl RestartPolicy {
    pub fn of(pod: &Pod) -> Self {
        match pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) {
            Some("Never") => Self::Never,
            Some("OnFailure") => Self::OnFailure,
            _ => Self::Always,
        }
    }

    fn restarts(&self, exit_code: i32) -> bool {
        match self {
            Self::Always => true,
            Self::OnFailure => exit_code != 0,
            Self::Never => false,
        }
    }
}

/// How a finished pod ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Terminal {
    Succeeded,
    Failed,
}

/// A container to kill, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kill {
    pub id: ContainerId,
    pub name: String,
    /// Why, as the kubelet says it ("Container app failed liveness probe,
    /// will be restarted").
    pub reason: String,
    /// The grace period, when not the pod's (a probe's own
    /// `terminationGracePeriodSeconds`).
    pub grace_seconds: Option<i64>,
}

/// A container that should run but waits: its waiting reason and message in
/// the status, and when a sync should try again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub name: String,
    pub reason: String,
    pub message: String,
    pub retry_in: Duration,
}

/// The actions of one SyncPod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodActions {
    /// Stop every container and the sandbox (before re-creating it).
    pub kill_pod: bool,
    pub create_sandbox: bool,
    /// The ready sandbox to use, when not creating one.
    pub sandbox: Option<ContainerId>,
    /// Attempt number of a new sandbox.
    pub sandbox_attempt: u32,
    /// Init containers (indices in `initContainers`) to start, in order: at
    /// most one plain init container, and sidecars.
    pub start_init: Vec<usize>,
    /// App containers (indices in `containers`) to start.
    pub start: Vec<usize>,
    pub kill: Vec<Kill>,
    /// Containers waiting in CrashLoopBackOff.
    pub backoff: Vec<Waiting>,
    /// A container whose back-off is over by the kernel's death time, whose
    /// death the runtime has not reported yet: look again in this long
    /// ([`KERNEL_DEATH_RECHECK`]). Not a back-off: nothing in the status or
    /// the events says so (the kubelet, seeing the runtime's `finishedAt`
    /// only, would restart it, or find it in back-off, a few ms later).
    pub recheck: Option<Duration>,
    pub terminal: Option<Terminal>,
}

impl PodActions {
    /// Whether this sync changes anything in the runtime.
    pub fn does_runtime_work(&self) -> bool {
        self.kill_pod
            || self.create_sandbox
            || !self.start_init.is_empty()
            || !self.start.is_empty()
            || !self.kill.is_empty()
    }
}

/// The hash of a container's spec, as the `io.kubernetes.container.hash`
/// annotation carries it: the first 8 bytes of the SHA-256 of its JSON form (the
/// kubelet hashes with FNV; any stable hash of the spec does).
pub fn container_hash(c: &Container) -> u64 {
    let json = serde_json::to_vec(c).unwrap_or_default();
    let digest = Sha256::digest(&json);
    u64::from_be_bytes([
        digest[0], digest[1], digest[2], digest[3], digest[4], digest[5], digest[6], digest[7],
    ])
}

/// Whether `c` is a sidecar: an init container with `restartPolicy: Always`.
pub fn is_sidecar(c: &Container) -> bool {
    c.restart_policy.as_deref() == Some("Always")
}

/// The newest status of the container named `name`: the last created, as the
/// kubelet's `FindContainerStatusByName` on its creation-sorted statuses.
pub fn latest<'a>(status: &'a PodStatus, name: &str) -> Option<&'a ContainerStatus> {
    status
        .containers
        .iter()
        .filter(|c| c.name == name)
        .max_by_key(|c| (c.created_at.unwrap_or(0), c.attempt))
}

/// The kubelet's `format.Pod`: `name_namespace(uid)`.
pub fn format_pod(pod: &Pod, uid: &PodUid) -> String {
    format!(
        "{}_{}({uid})",
        pod.metadata.name.as_deref().unwrap_or_default(),
        pod.metadata.namespace.as_deref().unwrap_or("default")
    )
}

/// The back-off key of container `c` of the pod.
pub fn backoff_key(uid: &PodUid, c: &Container) -> BackoffKey {
    BackoffKey {
        pod: uid.clone(),
        container: c.name.clone(),
        hash: container_hash(c),
    }
}

/// How many times the container named `name` ran before its newest instance.
pub fn restart_count(status: &PodStatus, name: &str) -> u32 {
    latest(status, name).map(|c| c.attempt).unwrap_or(0)
}

/// Computes the actions for `pod` given `status`, `backoff` and the time,
/// every running sidecar counted as started (no probes).
pub fn compute_pod_actions(
    pod: &Pod,
    uid: &PodUid,
    status: &PodStatus,
    backoff: &CrashBackoff,
    now_unix_ns: i64,
) -> PodActions {
    compute_pod_actions_probed(pod, uid, status, backoff, now_unix_ns, &|_, _| true)
}

/// [`compute_pod_actions`] with `started` saying whether a running sidecar
/// has started (its startup probe succeeded, or it has none): until then the
/// next init container waits, as the kubelet's `computeInitContainerActions`.
pub fn compute_pod_actions_probed(
    pod: &Pod,
    uid: &PodUid,
    status: &PodStatus,
    backoff: &CrashBackoff,
    now_unix_ns: i64,
    started: &dyn Fn(&Container, &ContainerId) -> bool,
) -> PodActions {
    let mut actions = PodActions::default();
    let spec = pod.spec.clone().unwrap_or_default();
    let policy = RestartPolicy::of(pod);
    let init = spec.init_containers.clone().unwrap_or_default();
    let apps = spec.containers.clone();

    // Terminal pods first: nothing more runs.
    let init_failed = init.iter().filter(|c| !is_sidecar(c)).any(|c| {
        latest(status, &c.name)
            .is_some_and(|s| s.state == ContainerState::Exited && s.exit_code != Some(0))
    });
    let all_apps_exited = !apps.is_empty()
        && apps
            .iter()
            .all(|c| latest(status, &c.name).is_some_and(|s| s.state == ContainerState::Exited));
    let all_apps_ok = apps.iter().all(|c| {
        latest(status, &c.name)
            .is_some_and(|s| s.state == ContainerState::Exited && s.exit_code == Some(0))
    });
    actions.terminal = match policy {
        RestartPolicy::Never if init_failed => Some(Terminal::Failed),
        RestartPolicy::Never if all_apps_exited => Some(if all_apps_ok {
            Terminal::Succeeded
        } else {
            Terminal::Failed
        }),
        RestartPolicy::OnFailure if all_apps_ok => Some(Terminal::Succeeded),
        _ => None,
    };
    if actions.terminal.is_some() {
        return actions;
    }

    // The sandbox.
    let ready = status
        .sandboxes
        .iter()
        .filter(|s| s.state == SandboxState::Ready)
        .max_by_key(|s| (s.attempt, s.created_at.unwrap_or(0)));
    match ready {
        Some(s) => actions.sandbox = Some(s.id.clone()),
        None => {
            actions.create_sandbox = true;
            actions.sandbox_attempt = status
                .sandboxes
                .iter()
                .map(|s| s.attempt + 1)
                .max()
                .unwrap_or(0);
            actions.kill_pod = !status.sandboxes.is_empty()
                || status
                    .containers
                    .iter()
                    .any(|c| c.state == ContainerState::Running);
            // The kubelet: a Never pod that already had a sandbox and containers
            // is not started again; it is killed and done.
            if policy == RestartPolicy::Never
                && actions.sandbox_attempt != 0
                && !status.containers.is_empty()
            {
                actions.create_sandbox = false;
                actions.terminal = Some(if all_apps_ok {
                    Terminal::Succeeded
                } else {
                    Terminal::Failed
                });
                return actions;
            }
        }
    }

    let wait_backoff = |actions: &mut PodActions, c: &Container, s: &ContainerStatus| -> bool {
        if s.state != ContainerState::Exited {
            return false;
        }
        let finished = s.finished_at.unwrap_or(0);
        let key = backoff_key(uid, c);
        // A death only the kernel has reported has the kernel's time, which
        // precedes the runtime's `finishedAt` (the kubelet's start point) by
        // the shim's reaping: once its back-off is over by that time, it is
        // re-checked until the runtime reports it (the pod is relisted at
        // once) or `REAP_SLACK` has passed as well.
        let unreaped = (s.source == EventSource::Kernel)
            .then(|| {
                let reaped = finished.saturating_add(REAP_SLACK.as_nanos() as i64);
                backoff.in_backoff(&key, reaped, now_unix_ns)
            })
            .flatten();
        match (backoff.in_backoff(&key, finished, now_unix_ns), unreaped) {
            (None, Some(b)) => {
                actions.recheck = Some(b.left.min(KERNEL_DEATH_RECHECK));
                true
            }
            (Some(b), _) => {
                actions.backoff.push(Waiting {
                    name: c.name.clone(),
                    reason: super::reasons::CRASH_LOOP_BACK_OFF.into(),
                    message: format!(
                        "back-off {} restarting failed container={} pod={}",
                        go_duration(b.period),
                        c.name,
                        format_pod(pod, uid)
                    ),
                    retry_in: b.left,
                });
                true
            }
            (None, None) => false,
        }
    };

    // Init containers, one at a time. A new sandbox runs them all again (after
    // the first one's back-off, if it crashed).
    if actions.create_sandbox {
        if let Some(c) = init.first() {
            if !latest(status, &c.name).is_some_and(|s| wait_backoff(&mut actions, c, s)) {
                actions.start_init.push(0);
            }
            return actions;
        }
    } else {
        // An app container created or running: the pod was initialized, plain
        // init containers are done; sidecars are kept running. Exited app
        // containers do not count (the kubelet's `computeInitContainerActions`:
        // they may be the previous sandbox's, whose init containers were
        // purged with it).
        let initialized = apps.iter().any(|c| {
            latest(status, &c.name).is_some_and(|s| {
                matches!(s.state, ContainerState::Created | ContainerState::Running)
            })
        });
        // The kubelet relies on the last init container with a record: one
        // before it whose record is gone (collected) ran.
        let last_seen = init
            .iter()
            .rposition(|c| !is_sidecar(c) && latest(status, &c.name).is_some());
        for (i, c) in init.iter().enumerate() {
            let newest = latest(status, &c.name);
            if is_sidecar(c) {
                match newest {
                    Some(s) if s.state == ContainerState::Running => {
                        if !(initialized || started(c, &s.id)) {
                            return actions;
                        }
                        // A started sidecar whose spec changed is restarted
                        // (`computeInitContainerActions`), and the kubelet
                        // looks at no later init container in this sync.
                        if s.hash.is_some_and(|h| h != container_hash(c)) {
                            actions.kill.push(Kill {
                                id: s.id.clone(),
                                name: c.name.clone(),
                                reason: format!("Init container {} definition changed", c.name),
                                grace_seconds: None,
                            });
                            actions.start_init.push(i);
                            if initialized {
                                break;
                            }
                            return actions;
                        }
                        continue;
                    }
                    Some(s) if s.state == ContainerState::Unknown => {
                        // Killed and started again; the others go on.
                        restart_stuck(&mut actions, c, s, true);
                        actions.start_init.push(i);
                        if initialized {
                            continue;
                        }
                        return actions;
                    }
                    Some(s) if s.state == ContainerState::Exited => {
                        if !wait_backoff(&mut actions, c, s) {
                            actions.start_init.push(i);
                        }
                        if initialized {
                            continue;
                        }
                        return actions;
                    }
                    // Never started, or Created (its start failed).
                    _ => {
                        actions.start_init.push(i);
                        if initialized {
                            continue;
                        }
                        return actions;
                    }
                }
            }
            if initialized {
                continue;
            }
            match newest {
                None if last_seen.is_some_and(|l| i < l) => continue,
                None => {
                    actions.start_init.push(i);
                    return actions;
                }
                Some(s) if s.state == ContainerState::Exited && s.exit_code == Some(0) => continue,
                Some(s) if s.state == ContainerState::Exited => {
                    // Failed: restarted (policy Never was terminal above).
                    if !wait_backoff(&mut actions, c, s) {
                        actions.start_init.push(i);
                    }
                    return actions;
                }
                Some(s) if s.state == ContainerState::Unknown && policy == RestartPolicy::Never => {
                    // The kubelet kills the pod: it cannot restart it.
                    actions.terminal = Some(Terminal::Failed);
                    return actions;
                }
                Some(s) if restart_stuck(&mut actions, c, s, true) => {
                    actions.start_init.push(i);
                    return actions;
                }
                Some(_) => return actions, // running: wait for it
            }
        }
    }

    // App containers.
    for (j, c) in apps.iter().enumerate() {
        let newest = latest(status, &c.name);
        if actions.create_sandbox {
            // Everything starts again, but what succeeded under OnFailure.
            let succeeded =
                newest.is_some_and(|s| s.state == ContainerState::Exited && s.exit_code == Some(0));
            let waits = newest.is_some_and(|s| wait_backoff(&mut actions, c, s));
            if !(waits || succeeded && policy == RestartPolicy::OnFailure) {
                actions.start.push(j);
            }
            continue;
        }
        let Some(s) = newest else {
            actions.start.push(j);
            continue;
        };
        match s.state {
            ContainerState::Running => {
                if s.hash.is_some_and(|h| h != container_hash(c)) {
                    actions.kill.push(Kill {
                        id: s.id.clone(),
                        name: c.name.clone(),
                        reason: format!(
                            "Container {} definition changed, will be restarted",
                            c.name
                        ),
                        grace_seconds: None,
                    });
                    actions.start.push(j);
                }
            }
            ContainerState::Created | ContainerState::Unknown => {
                if restart_stuck(&mut actions, c, s, false) {
                    actions.start.push(j);
                }
            }
            ContainerState::Exited => {
                if policy.restarts(s.exit_code.unwrap_or(0)) && !wait_backoff(&mut actions, c, s) {
                    actions.start.push(j);
                }
            }
        }
    }
    actions
}

/// A container left Created (its start failed) or in Unknown state is
/// started again whatever the policy, as the kubelet's
/// `ShouldContainerBeRestarted` says; an Unknown one is killed first ("try
/// killing it before restart", `computePodActions` and
/// `computeInitContainerActions`), so that two instances never run. True
/// when it must start.
fn restart_stuck(actions: &mut PodActions, c: &Container, s: &ContainerStatus, init: bool) -> bool {
    match s.state {
        ContainerState::Created => true,
        ContainerState::Unknown => {
            let what = if init { "Init container" } else { "Container" };
            actions.kill.push(Kill {
                id: s.id.clone(),
                name: c.name.clone(),
                reason: format!("{what} is in \"unknown\" state, try killing it before restart"),
                grace_seconds: None,
            });
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::container::SandboxStatus;
    use evpleg_core::lifecycle::EventSource;

    fn pod(policy: &str, init: &[&str], apps: &[&str]) -> Pod {
        let containers = |names: &[&str]| -> Vec<Container> {
            names
                .iter()
                .map(|n| Container {
                    name: (*n).into(),
                    image: Some("localhost/busybox:latest".into()),
                    // Test convention: init containers named side* are sidecars.
                    restart_policy: n.starts_with("side").then(|| "Always".into()),
                    ..Container::default()
                })
                .collect()
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "uid": "a".repeat(32)},
            "spec": {
                "restartPolicy": policy,
                "initContainers": containers(init),
                "containers": containers(apps),
            }
        }))
        .unwrap()
    }

    fn uid() -> PodUid {
        PodUid::parse(&"a".repeat(32)).unwrap()
    }

    fn id(n: u8) -> ContainerId {
        ContainerId::parse(&format!("{n:02x}").repeat(32)).unwrap()
    }

    fn sandbox() -> SandboxStatus {
        SandboxStatus {
            pid: None,
            id: id(0),
            state: SandboxState::Ready,
            attempt: 0,
            created_at: Some(1),
            ip: None,
        }
    }

    fn cs(
        n: u8,
        name: &str,
        state: ContainerState,
        exit: Option<i32>,
        attempt: u32,
    ) -> ContainerStatus {
        let mut c = ContainerStatus::new(id(n), name, state, EventSource::Relist);
        c.exit_code = exit;
        c.attempt = attempt;
        c.finished_at = exit.map(|_| 1_000);
        c
    }

    fn status(containers: Vec<ContainerStatus>) -> PodStatus {
        PodStatus {
            sandboxes: vec![sandbox()],
            containers,
            ..PodStatus::default()
        }
    }

    const NOW: i64 = 1_000_000_000_000;

    #[test]
    fn a_new_pod_gets_a_sandbox_then_its_first_init_container() {
        let p = pod("Always", &["init"], &["app"]);
        let a = compute_pod_actions(
            &p,
            &uid(),
            &PodStatus::default(),
            &CrashBackoff::default(),
            NOW,
        );
        assert!(a.create_sandbox && !a.kill_pod);
        assert_eq!((a.start_init, a.start.clone()), (vec![0], vec![]));
        let p = pod("Always", &[], &["a", "b"]);
        let a = compute_pod_actions(
            &p,
            &uid(),
            &PodStatus::default(),
            &CrashBackoff::default(),
            NOW,
        );
        assert_eq!(a.start, vec![0, 1]);
    }

    #[test]
    fn init_containers_run_in_order_to_completion() {
        let p = pod("Always", &["i1", "i2"], &["app"]);
        let b = CrashBackoff::default();
        let running = status(vec![cs(1, "i1", ContainerState::Running, None, 0)]);
        let a = compute_pod_actions(&p, &uid(), &running, &b, NOW);
        assert!(!a.does_runtime_work(), "wait for i1: {a:?}");
        let i1_done = status(vec![cs(1, "i1", ContainerState::Exited, Some(0), 0)]);
        assert_eq!(
            compute_pod_actions(&p, &uid(), &i1_done, &b, NOW).start_init,
            [1]
        );
        let both = status(vec![
            cs(1, "i1", ContainerState::Exited, Some(0), 0),
            cs(2, "i2", ContainerState::Exited, Some(0), 0),
        ]);
        let a = compute_pod_actions(&p, &uid(), &both, &b, NOW);
        assert_eq!((a.start_init, a.start), (vec![], vec![0]));
    }

    /// Issue #27 item 2: after a new sandbox (the old one's init containers
    /// purged), the first init container ran again; the app containers of
    /// the old sandbox, exited, do not make the pod initialized: the second
    /// init container runs next, the app waits (it restarted beside the
    /// first init container before, the second skipped). A running app does
    /// make it initialized, and an init container whose record was collected
    /// before the last one seen is taken as run (`computeInitContainerActions`).
    #[test]
    fn exited_app_containers_of_an_old_sandbox_do_not_count_as_initialized() {
        let p = pod("Always", &["i1", "i2"], &["app"]);
        let b = CrashBackoff::default();
        let mut old_app = cs(3, "app", ContainerState::Exited, Some(137), 0);
        old_app.created_at = Some(10);
        let mut i1 = cs(1, "i1", ContainerState::Exited, Some(0), 0);
        i1.created_at = Some(20);
        let a = compute_pod_actions(
            &p,
            &uid(),
            &status(vec![old_app.clone(), i1.clone()]),
            &b,
            NOW,
        );
        assert_eq!((a.start_init, a.start), (vec![1], vec![]));
        let running_app = cs(3, "app", ContainerState::Running, None, 0);
        let a = compute_pod_actions(&p, &uid(), &status(vec![running_app]), &b, NOW);
        assert!(!a.does_runtime_work(), "{a:?}");
        let i2 = cs(2, "i2", ContainerState::Exited, Some(0), 0);
        let a = compute_pod_actions(&p, &uid(), &status(vec![old_app, i2]), &b, NOW);
        assert_eq!((a.start_init, a.start), (vec![], vec![0]));
    }

    /// The actions table for every restart policy and exit.
    #[test]
    fn restart_policy_table() {
        let b = CrashBackoff::default();
        let cases = [
            ("Always", Some(0), vec![0], None),
            ("Always", Some(3), vec![0], None),
            ("OnFailure", Some(0), vec![], Some(Terminal::Succeeded)),
            ("OnFailure", Some(3), vec![0], None),
            ("Never", Some(0), vec![], Some(Terminal::Succeeded)),
            ("Never", Some(3), vec![], Some(Terminal::Failed)),
        ];
        for (policy, exit, start, terminal) in cases {
            let p = pod(policy, &[], &["app"]);
            let s = status(vec![cs(1, "app", ContainerState::Exited, exit, 0)]);
            let a = compute_pod_actions(&p, &uid(), &s, &b, NOW);
            assert_eq!(
                (a.start.clone(), a.terminal),
                (start, terminal),
                "{policy} exit {exit:?}"
            );
        }
        let p = pod("Never", &["init"], &["app"]);
        let s = status(vec![cs(1, "init", ContainerState::Exited, Some(1), 0)]);
        assert_eq!(
            compute_pod_actions(&p, &uid(), &s, &b, NOW).terminal,
            Some(Terminal::Failed)
        );
    }

    #[test]
    fn crash_loop_backoff_delays_the_restart() {
        let p = pod("Always", &[], &["app"]);
        let spec = &p.spec.as_ref().unwrap().containers[0];
        let mut b = CrashBackoff::default();
        b.restarting(
            backoff_key(&uid(), spec),
            NOW - 20_000_000_000,
            NOW - 20_000_000_000,
        );
        let mut c = cs(1, "app", ContainerState::Exited, Some(1), 1);
        c.finished_at = Some(NOW - 1_000_000_000);
        let a = compute_pod_actions(&p, &uid(), &status(vec![c.clone()]), &b, NOW);
        assert!(a.start.is_empty());
        // The message shows the period, not the time left: it does not change
        // from one sync to the next.
        let message = format!(
            "back-off 10s restarting failed container=app pod=p_default({})",
            uid()
        );
        assert_eq!(
            a.backoff,
            [Waiting {
                name: "app".into(),
                reason: "CrashLoopBackOff".into(),
                message: message.clone(),
                retry_in: Duration::from_secs(9),
            }]
        );
        let a2 = compute_pod_actions(
            &p,
            &uid(),
            &status(vec![c.clone()]),
            &b,
            NOW + 4_000_000_000,
        );
        assert_eq!(
            (a2.backoff[0].message.as_str(), a2.backoff[0].retry_in),
            (message.as_str(), Duration::from_secs(5))
        );
        let later = NOW + 10_000_000_000;
        assert_eq!(
            compute_pod_actions(&p, &uid(), &status(vec![c.clone()]), &b, later).start,
            vec![0]
        );
        // A changed spec has no back-off.
        let mut changed = p.clone();
        changed.spec.as_mut().unwrap().containers[0].args = Some(vec!["new".into()]);
        assert_eq!(
            compute_pod_actions(&changed, &uid(), &status(vec![c]), &b, NOW).start,
            vec![0]
        );
    }

    /// A restart never comes before the back-off is over measured from the
    /// runtime's `finishedAt` (the kubelet's `doBackOff`): an exit only the
    /// kernel has reported yet (its time precedes the runtime's by the
    /// shim's reaping) waits, once its back-off is over by the kernel's time,
    /// for the runtime's report or for `REAP_SLACK` more, whichever comes
    /// first; a first restart (no back-off yet) does not wait. That wait is
    /// a re-check, not a CrashLoopBackOff: the kubelet, seeing the runtime's
    /// time only, would not show one. (source, entry, ms after the finish)
    /// -> started, back-off left ms, re-check in ms.
    #[test]
    fn a_kernel_reported_death_restarts_once_the_runtime_could_have_reaped_it() {
        let p = pod("Always", &[], &["app"]);
        let spec = &p.spec.as_ref().unwrap().containers[0];
        let ms = 1_000_000i64;
        let cases = [
            (EventSource::Relist, true, 500, false, Some(500), None),
            (EventSource::Relist, true, 1_000, true, None, None),
            (EventSource::Kernel, true, 500, false, Some(500), None),
            (EventSource::Kernel, true, 1_000, false, None, Some(50)),
            (EventSource::Kernel, true, 1_070, false, None, Some(30)),
            (EventSource::Kernel, true, 1_100, true, None, None),
            (EventSource::Kernel, false, 10, true, None, None),
        ];
        for (source, entry, after, started, left, recheck) in cases {
            let mut b = CrashBackoff::crash_loop(Duration::from_secs(1), Duration::from_secs(1));
            if entry {
                b.restarting(
                    backoff_key(&uid(), spec),
                    NOW - 3_000 * ms,
                    NOW - 3_000 * ms,
                );
            }
            let mut c = cs(1, "app", ContainerState::Exited, Some(2), 1);
            c.finished_at = Some(NOW);
            c.source = source;
            let a = compute_pod_actions(&p, &uid(), &status(vec![c]), &b, NOW + after * ms);
            let got = (
                !a.start.is_empty(),
                a.backoff.first().map(|w| w.retry_in.as_millis() as i64),
                a.recheck.map(|r| r.as_millis() as i64),
            );
            assert_eq!(
                got,
                (started, left, recheck),
                "{source:?} entry={entry} +{after} ms"
            );
        }
    }

    #[test]
    fn a_changed_spec_kills_and_restarts() {
        let p = pod("Always", &[], &["app"]);
        let mut c = cs(1, "app", ContainerState::Running, None, 0);
        c.hash = Some(container_hash(&p.spec.as_ref().unwrap().containers[0]));
        let b = CrashBackoff::default();
        assert!(
            !compute_pod_actions(&p, &uid(), &status(vec![c.clone()]), &b, NOW).does_runtime_work()
        );
        c.hash = Some(1);
        let a = compute_pod_actions(&p, &uid(), &status(vec![c]), &b, NOW);
        assert_eq!((a.kill.len(), a.start.clone()), (1, vec![0]));
    }

    /// `computeInitContainerActions`: a started sidecar whose spec changed is
    /// killed and started again, with the kubelet's message; an unchanged
    /// one is left alone.
    #[test]
    fn a_sidecar_whose_spec_changed_is_restarted() {
        use ContainerState::*;
        let p = pod("Always", &["side"], &["app"]);
        let side = &p.spec.as_ref().unwrap().init_containers.as_ref().unwrap()[0];
        let app = &p.spec.as_ref().unwrap().containers[0];
        let b = CrashBackoff::default();
        let mut s = cs(1, "side", Running, None, 0);
        let mut a = cs(2, "app", Running, None, 0);
        a.hash = Some(container_hash(app));
        for (hash, kill, start_init) in [
            (container_hash(side), vec![], vec![]),
            (
                7,
                vec![(id(1), "Init container side definition changed".to_owned())],
                vec![0],
            ),
        ] {
            s.hash = Some(hash);
            let got = compute_pod_actions(&p, &uid(), &status(vec![s.clone(), a.clone()]), &b, NOW);
            let killed: Vec<(ContainerId, String)> = got
                .kill
                .iter()
                .map(|k| (k.id.clone(), k.reason.clone()))
                .collect();
            assert_eq!(
                (killed, got.start_init.clone(), got.start.clone()),
                (kill, start_init, vec![]),
                "hash {hash}"
            );
        }
    }

    #[test]
    fn a_dead_sandbox_is_recreated_and_everything_restarted() {
        let p = pod("Always", &[], &["app"]);
        let mut s = status(vec![cs(1, "app", ContainerState::Running, None, 0)]);
        s.sandboxes[0].state = SandboxState::NotReady;
        let a = compute_pod_actions(&p, &uid(), &s, &CrashBackoff::default(), NOW);
        assert!(a.kill_pod && a.create_sandbox);
        assert_eq!((a.sandbox_attempt, a.start), (1, vec![0]));
    }

    /// The table of what a new sandbox starts: attempt numbers are the
    /// caller's (from `latest`), what starts depends on the policy and on what
    /// already ran; a Never pod that ran gets no new sandbox.
    #[test]
    fn what_a_new_sandbox_starts() {
        let dead = |containers: Vec<ContainerStatus>| {
            let mut s = status(containers);
            s.sandboxes[0].state = SandboxState::NotReady;
            s
        };
        let b = CrashBackoff::default();
        let ok = |n| cs(n, "a", ContainerState::Exited, Some(0), 2);
        let failed = |n| cs(n, "b", ContainerState::Exited, Some(1), 3);
        let running = |n| cs(n, "b", ContainerState::Running, None, 3);
        // (policy, containers, creates a sandbox, starts, terminal)
        type Case = (
            &'static str,
            Vec<ContainerStatus>,
            bool,
            Vec<usize>,
            Option<Terminal>,
        );
        let cases: [Case; 6] = [
            ("Always", vec![ok(1), failed(2)], true, vec![0, 1], None),
            ("OnFailure", vec![ok(1), failed(2)], true, vec![1], None),
            ("OnFailure", vec![ok(1), running(2)], true, vec![1], None),
            (
                "Never",
                vec![ok(1), running(2)],
                false,
                vec![],
                Some(Terminal::Failed),
            ),
            ("Never", vec![ok(1)], false, vec![], Some(Terminal::Failed)),
            // Nothing ran yet: a Never pod gets its new sandbox.
            ("Never", vec![], true, vec![0, 1], None),
        ];
        for (policy, containers, create, start, terminal) in cases {
            let p = pod(policy, &[], &["a", "b"]);
            let what = format!("{policy} {containers:?}");
            let a = compute_pod_actions(&p, &uid(), &dead(containers), &b, NOW);
            assert_eq!(
                (a.create_sandbox, a.start, a.terminal, a.kill_pod),
                (create, start, terminal, true),
                "{what}"
            );
        }
    }

    /// Created (a failed start) containers start again whatever the policy;
    /// Unknown ones are killed first, then started again (issue #27 item 6:
    /// they were waited for); a plain init container in Unknown state under
    /// Never fails the pod, a sidecar's does not hold the app containers back.
    #[test]
    fn created_containers_are_restarted_unknown_ones_killed_first() {
        let b = CrashBackoff::default();
        let unknown_kill = |a: &PodActions, what: &str| {
            assert_eq!(
                a.kill
                    .iter()
                    .map(|k| (k.id.clone(), k.reason.as_str()))
                    .collect::<Vec<_>>(),
                [(
                    id(1),
                    format!("{what} is in \"unknown\" state, try killing it before restart")
                        .as_str()
                )]
            );
        };
        for policy in ["Always", "Never"] {
            let p = pod(policy, &[], &["app"]);
            let created = status(vec![cs(1, "app", ContainerState::Created, None, 0)]);
            let a = compute_pod_actions(&p, &uid(), &created, &b, NOW);
            assert_eq!((a.start.clone(), a.kill.len()), (vec![0], 0), "{policy}");
            let unknown = status(vec![cs(1, "app", ContainerState::Unknown, None, 0)]);
            let a = compute_pod_actions(&p, &uid(), &unknown, &b, NOW);
            assert_eq!(a.start, vec![0], "{policy}");
            unknown_kill(&a, "Container");
        }
        let p = pod("Always", &["init"], &["app"]);
        let created = status(vec![cs(1, "init", ContainerState::Created, None, 0)]);
        let a = compute_pod_actions(&p, &uid(), &created, &b, NOW);
        assert_eq!((a.start_init, a.kill.len()), (vec![0], 0));
        let unknown = status(vec![cs(1, "init", ContainerState::Unknown, None, 0)]);
        let a = compute_pod_actions(&p, &uid(), &unknown, &b, NOW);
        assert_eq!(a.start_init, vec![0]);
        unknown_kill(&a, "Init container");
        let never = pod("Never", &["init"], &["app"]);
        let a = compute_pod_actions(&never, &uid(), &unknown, &b, NOW);
        assert_eq!(a.terminal, Some(Terminal::Failed));
        // A sidecar in Unknown state once initialized: killed and started
        // again, and the app container's restart is still decided.
        let p = pod("Always", &["side"], &["app"]);
        let s = status(vec![
            cs(1, "side", ContainerState::Unknown, None, 0),
            cs(2, "app", ContainerState::Created, None, 0),
        ]);
        let a = compute_pod_actions(&p, &uid(), &s, &b, NOW);
        assert_eq!((a.start_init.clone(), a.start.clone()), (vec![0], vec![0]));
        unknown_kill(&a, "Init container");
    }

    /// The newest instance is the last created, even when a new sandbox once
    /// started attempts over.
    #[test]
    fn the_newest_container_is_the_last_created() {
        let mut old = cs(1, "app", ContainerState::Exited, Some(1), 4);
        old.created_at = Some(100);
        let mut new = cs(2, "app", ContainerState::Running, None, 0);
        new.created_at = Some(200);
        let s = status(vec![old, new]);
        assert_eq!(latest(&s, "app").unwrap().id, id(2));
    }

    #[test]
    fn latest_instance_and_restart_count() {
        let s = status(vec![
            cs(1, "app", ContainerState::Exited, Some(1), 0),
            cs(2, "app", ContainerState::Running, None, 1),
        ]);
        assert_eq!(latest(&s, "app").unwrap().id, id(2));
        assert_eq!(restart_count(&s, "app"), 1);
        assert_eq!(restart_count(&s, "other"), 0);
    }

    /// Sidecars, step by step: started in their turn, the next init container
    /// waits until the sidecar runs, restarted whatever the pod's policy,
    /// not counted for the pod's end.
    #[test]
    fn sidecar_table() {
        use ContainerState::*;
        let b = CrashBackoff::default();
        // (policy, observed (name, state, exit), init to start, apps to start, terminal)
        type Case<'a> = (
            &'a str,
            Vec<(&'a str, ContainerState, Option<i32>)>,
            Vec<usize>,
            Vec<usize>,
            Option<Terminal>,
        );
        let cases: Vec<Case> = vec![
            // Nothing yet: the sidecar first, nothing else.
            ("Always", vec![], vec![0], vec![], None),
            // The sidecar is in Unknown state: killed and started again.
            (
                "Always",
                vec![("side", Unknown, None)],
                vec![0],
                vec![],
                None,
            ),
            // It runs: the plain init container is next.
            (
                "Always",
                vec![("side", Running, None)],
                vec![1],
                vec![],
                None,
            ),
            // The init container runs: wait for it.
            (
                "Always",
                vec![("side", Running, None), ("init", Running, None)],
                vec![],
                vec![],
                None,
            ),
            // The init container is done: the app starts, the sidecar keeps running.
            (
                "Never",
                vec![("side", Running, None), ("init", Exited, Some(0))],
                vec![],
                vec![0],
                None,
            ),
            // The sidecar crashed before initialization finished: restarted
            // (whatever the pod's policy), and the next waits.
            (
                "Never",
                vec![("side", Exited, Some(1))],
                vec![0],
                vec![],
                None,
            ),
            // The sidecar crashed while the app runs: restarted, the app stays.
            (
                "Never",
                vec![
                    ("side", Exited, Some(1)),
                    ("init", Exited, Some(0)),
                    ("app", Running, None),
                ],
                vec![0],
                vec![],
                None,
            ),
            // Initialized: a plain init container whose record is gone is not run again.
            (
                "Always",
                vec![("side", Running, None), ("app", Running, None)],
                vec![],
                vec![],
                None,
            ),
            // The app is done under Never: terminal while the sidecar runs
            // (termination stops it); its exit code does not count.
            (
                "Never",
                vec![
                    ("side", Running, None),
                    ("init", Exited, Some(0)),
                    ("app", Exited, Some(0)),
                ],
                vec![],
                vec![],
                Some(Terminal::Succeeded),
            ),
            (
                "OnFailure",
                vec![
                    ("side", Exited, Some(137)),
                    ("init", Exited, Some(0)),
                    ("app", Exited, Some(0)),
                ],
                vec![],
                vec![],
                Some(Terminal::Succeeded),
            ),
            (
                "Never",
                vec![
                    ("side", Running, None),
                    ("init", Exited, Some(0)),
                    ("app", Exited, Some(2)),
                ],
                vec![],
                vec![],
                Some(Terminal::Failed),
            ),
        ];
        let p = |policy| pod(policy, &["side", "init"], &["app"]);
        for (n, (policy, observed, init, apps, terminal)) in cases.into_iter().enumerate() {
            let containers = observed
                .iter()
                .enumerate()
                .map(|(i, (name, state, exit))| cs(i as u8 + 1, name, *state, *exit, 0))
                .collect();
            let a = compute_pod_actions(&p(policy), &uid(), &status(containers), &b, NOW);
            assert_eq!(
                (a.start_init.clone(), a.start.clone(), a.terminal),
                (init, apps, terminal),
                "case {n}: {policy} {observed:?}"
            );
        }
        // A crashing sidecar waits out its back-off like any container.
        let mut b = CrashBackoff::default();
        let side = &p("Always").spec.unwrap().init_containers.unwrap()[0];
        b.restarting(
            backoff_key(&uid(), side),
            NOW - 1_000_000_000,
            NOW - 1_000_000_000,
        );
        let mut crashed = cs(1, "side", Exited, Some(1), 1);
        crashed.finished_at = Some(NOW - 1_000_000_000);
        let a = compute_pod_actions(&p("Always"), &uid(), &status(vec![crashed]), &b, NOW);
        assert_eq!(
            (a.start_init.clone(), a.backoff.len()),
            (vec![], 1),
            "{a:?}"
        );
    }

    /// A running sidecar whose startup probe has not succeeded holds the
    /// next init container back; once the pod was initialized it does not.
    #[test]
    fn a_sidecar_s_startup_gates_the_next_init_container() {
        use ContainerState::*;
        let b = CrashBackoff::default();
        let p = pod("Always", &["side", "init"], &["app"]);
        let cases = [
            (vec![cs(1, "side", Running, None, 0)], false, vec![]),
            (vec![cs(1, "side", Running, None, 0)], true, vec![1]),
            (
                vec![
                    cs(1, "side", Running, None, 0),
                    cs(3, "app", Running, None, 0),
                ],
                false,
                vec![],
            ),
        ];
        for (observed, started, want) in cases {
            let a = compute_pod_actions_probed(
                &p,
                &uid(),
                &status(observed.clone()),
                &b,
                NOW,
                &|c, s| {
                    assert_eq!((c.name.as_str(), s), ("side", &id(1)));
                    started
                },
            );
            assert_eq!(a.start_init, want, "{observed:?} started={started}");
            assert!(a.start.is_empty());
        }
    }
}

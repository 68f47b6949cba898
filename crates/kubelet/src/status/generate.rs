//! The API status of a pod from what the runtime and the kernel observed: the
//! kubelet's `generateAPIPodStatus`, `convertToAPIContainerStatuses` and
//! `getPhase`.
//!
//! Phase: Pending while init containers run or a container waits to be created;
//! Running while a container runs (or restarts, with restartPolicy Always);
//! Succeeded / Failed when every container terminated and none will restart.
//! Sidecars (init containers with `restartPolicy: Always`) always restart, are
//! part of Initialized once started (their startup probe succeeded) and of
//! ContainersReady while ready (their readiness probe), and
//! never decide the phase by their exit.
//! Conditions: PodReadyToStartContainers (a ready sandbox), PodScheduled,
//! Initialized, ContainersReady, Ready, with the kubelet's reasons and
//! messages ([`super::conditions`]; a running container is ready when its
//! readiness probe succeeded, or it has none, and its startup probe
//! succeeded: [`crate::prober`]; Ready also needs every readiness gate's
//! condition True, and conditions others set are kept).
//! lastTransitionTime is the status manager's. Container statuses carry the state, the last
//! termination, the exit code and reason (Completed, Error, OOMKilled), the
//! restart count and the times. An exit the kernel saw first is already in the
//! runtime status given here (the PLEG merged it).
//!
//! A container without a runtime record (collected, lost by the runtime) keeps
//! what the pod's last status said (`convertToAPIContainerStatuses`): a
//! terminated state as it was, else its restart count and last state, and one
//! that was running has ended with 137 `ContainerStatusUnknown`; at a
//! terminal phase an initialized pod's containers without an end get that end
//! (`TerminatePod`). A terminal phase is held while a container of the pod
//! still runs (`mergePodStatus`; `getPhase` counts running sidecars). An
//! evicted pod (`ShouldEvict`: its active deadline passed) is Failed with the
//! eviction's reason and message at once, and its Ready and ContainersReady
//! conditions False `PodFailed`, as the kubelet generates it: the node's
//! `/pods` serves that, and the API writer holds the phase while a
//! container runs ([`super::api::merge_status`]).

use k8s_openapi::api::core::v1::{
    ContainerState as ApiState, ContainerStateRunning, ContainerStateTerminated,
    ContainerStateWaiting, ContainerStatus as ApiContainerStatus, Pod, PodCondition, PodIP,
    PodStatus as ApiPodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::conditions;
use crate::kuberuntime::actions::{RestartPolicy, Terminal, Waiting, is_sidecar, latest};
use evpleg_core::container::{ContainerState, ContainerStatus, PodStatus};

/// Unix nanoseconds as an API time.
pub fn time(unix_ns: i64) -> Option<Time> {
    k8s_openapi::jiff::Timestamp::from_nanosecond(i128::from(unix_ns))
        .ok()
        .map(Time)
}

/// What generation needs besides the pod and its runtime status.
#[derive(Clone, Debug, Default)]
pub struct Context<'a> {
    /// The pod is done (SyncPod found it terminal).
    pub terminal: Option<Terminal>,
    /// Containers that should run but wait, and why (CrashLoopBackOff, the
    /// last start error).
    pub waiting: &'a [Waiting],
    pub host_ip: &'a str,
    /// The runtime's name from CRI `Version` (`containerd`): the scheme of
    /// container ids (`containerd://<id>`), as the kubelet's `ContainerID.Type`.
    pub runtime: &'a str,
    /// When the agent first admitted the pod (Unix ns).
    pub start_time: Option<i64>,
    /// Admission refused the pod: (reason, message).
    pub rejected: Option<(&'a str, &'a str)>,
    /// The probes' results (`ready`, `started`); without them a running
    /// container is ready.
    pub probes: Option<&'a crate::prober::Results>,
    /// The pod's last status (the status manager's, else the API server's):
    /// what a container without a runtime record keeps
    /// (`convertToAPIContainerStatuses`' old statuses).
    pub previous: Option<&'a ApiPodStatus>,
    /// The pod is evicted: (reason, message) (the kubelet's `ShouldEvict`,
    /// an active deadline that passed, or the status a kill of the kubelet's
    /// own sets: a pod preempted for a critical one).
    pub evicted: Option<(&'a str, &'a str)>,
    /// The kill that evicts it adds a `DisruptionTarget` condition, True:
    /// (reason, message) (the kubelet's preemption's status function).
    pub disruption: Option<(&'a str, &'a str)>,
}

fn terminated(runtime: &str, s: &ContainerStatus) -> ContainerStateTerminated {
    ContainerStateTerminated {
        exit_code: s.exit_code.unwrap_or(0),
        // The kubelet never sets `signal` (`convertContainerStatus` fills
        // the exit code, reason, message and times from the CRI status,
        // which has no signal): a death by signal shows as 128+n only.
        signal: None,
        reason: Some(if s.reason.is_empty() {
            match s.exit_code {
                Some(0) => "Completed".into(),
                _ => "Error".into(),
            }
        } else {
            s.reason.clone()
        }),
        message: (!s.message.is_empty()).then(|| s.message.clone()),
        started_at: s.started_at.and_then(time),
        finished_at: s.finished_at.and_then(time),
        container_id: Some(container_id(runtime, s)),
    }
}

fn container_id(runtime: &str, s: &ContainerStatus) -> String {
    format!("{runtime}://{}", s.id)
}

/// A waiting state; an empty `reason` is none (the kubelet's
/// `ContainerStateWaiting{}`).
fn waiting(reason: &str, message: Option<String>) -> ApiState {
    ApiState {
        waiting: Some(ContainerStateWaiting {
            reason: (!reason.is_empty()).then(|| reason.into()),
            message,
        }),
        ..ApiState::default()
    }
}

/// The kubelet's `ContainerReasonStatusUnknown`.
pub const STATUS_UNKNOWN: &str = "ContainerStatusUnknown";

/// A container without a runtime record (collected, or the runtime lost
/// it), from its last status (the kubelet's `convertToAPIContainerStatuses`):
/// a terminated one stays as it was; otherwise it waits with its restart
/// count and last state, and one that was running has terminated with 137
/// `ContainerStatusUnknown` (a restart more, unless the pod is being deleted).
fn without_record(
    mut out: ApiContainerStatus,
    old: Option<&ApiContainerStatus>,
    waiting: ApiState,
    is_default: bool,
    deleted: bool,
) -> ApiContainerStatus {
    let Some(old) = old else {
        out.state = Some(waiting);
        return out;
    };
    let old_state = old.state.clone().unwrap_or_default();
    if old_state.terminated.is_some() {
        if is_default {
            return old.clone();
        }
        // A restart is due: it waits, the old end its last state.
        out.restart_count = old.restart_count;
        out.last_state = Some(old_state);
        out.state = Some(waiting);
        return out;
    }
    out.restart_count = old.restart_count;
    out.last_state = old.last_state.clone();
    out.state = Some(waiting);
    let had_end = (out.last_state.as_ref()).is_some_and(|l| l.terminated.is_some());
    if old_state.running.is_some() && is_default && !had_end {
        out.last_state = Some(ApiState {
            terminated: Some(ContainerStateTerminated {
                exit_code: 137,
                reason: Some(STATUS_UNKNOWN.into()),
                message: Some("The container could not be located when the pod was deleted.  The container used to be Running".into()),
                ..ContainerStateTerminated::default()
            }),
            ..ApiState::default()
        });
        if !deleted {
            out.restart_count += 1;
        }
    }
    out
}

/// The status of one container of the spec.
fn container_status(
    spec: &k8s_openapi::api::core::v1::Container,
    status: &PodStatus,
    policy: RestartPolicy,
    ctx: &Context<'_>,
    pending_reason: &str,
    (old, deleted): (Option<&ApiContainerStatus>, bool),
) -> ApiContainerStatus {
    let name = spec.name.as_str();
    let image = spec.image.as_deref().unwrap_or_default();
    let newest = latest(status, name);
    let previous = newest.and_then(|n| {
        status
            .containers
            .iter()
            .filter(|c| {
                c.name == name && c.attempt < n.attempt && c.state == ContainerState::Exited
            })
            .max_by_key(|c| c.attempt)
    });
    let mut out = ApiContainerStatus {
        name: name.into(),
        image: image.into(),
        image_id: String::new(),
        restart_count: newest.map(|c| c.attempt as i32).unwrap_or(0),
        ready: false,
        started: Some(false),
        ..ApiContainerStatus::default()
    };
    if let Some(p) = previous {
        out.last_state = Some(ApiState {
            terminated: Some(terminated(ctx.runtime, p)),
            ..ApiState::default()
        });
    }
    let why = ctx.waiting.iter().find(|w| w.name == name);
    let waiting_why = |default: &str| match why {
        Some(w) => waiting(&w.reason, Some(w.message.clone())),
        None => waiting(default, None),
    };
    let Some(s) = newest else {
        return without_record(
            out,
            old,
            waiting_why(pending_reason),
            why.is_none(),
            deleted,
        );
    };
    out.container_id = Some(container_id(ctx.runtime, s));
    out.image_id = s.image_ref.clone();
    if !s.image.is_empty() {
        out.image = s.image.clone();
    }
    out.state = Some(match s.state {
        ContainerState::Running => {
            // Probes decide (a container without them is ready once running).
            out.ready = ctx.probes.is_none_or(|p| p.ready(spec, &s.id));
            out.started = Some(ctx.probes.is_none_or(|p| p.started(spec, &s.id)));
            ApiState {
                running: Some(ContainerStateRunning {
                    started_at: s.started_at.and_then(time),
                }),
                ..ApiState::default()
            }
        }
        // `convertContainerStatus`: created but not running, or in a state
        // it cannot tell, a container waits without a reason (unless a start
        // error is recorded for it).
        ContainerState::Created | ContainerState::Unknown => waiting_why(""),
        ContainerState::Exited => {
            let restarts = ctx.terminal.is_none()
                && match policy {
                    RestartPolicy::Always => true,
                    RestartPolicy::OnFailure => s.exit_code != Some(0),
                    RestartPolicy::Never => false,
                };
            if restarts && let Some(w) = why {
                // Waiting for the restart (CrashLoopBackOff, a start error);
                // the exit goes into the last state.
                out.last_state = Some(ApiState {
                    terminated: Some(terminated(ctx.runtime, s)),
                    ..ApiState::default()
                });
                waiting(&w.reason, Some(w.message.clone()))
            } else {
                // Terminated, also while its restart is due without a
                // reason to wait (`convertToAPIContainerStatuses` prefers
                // the original state: `kubectl get` shows Error/Completed).
                ApiState {
                    terminated: Some(terminated(ctx.runtime, s)),
                    ..ApiState::default()
                }
            }
        }
    });
    out
}

/// The conditions the kubelet owns; any other is someone else's (a readiness
/// gate's) and kept.
const KUBELET_CONDITIONS: [&str; 5] = [
    "PodScheduled",
    "Initialized",
    "ContainersReady",
    "Ready",
    "PodReadyToStartContainers",
];

fn condition(kind: &str, ok: bool, reason: Option<&str>) -> PodCondition {
    PodCondition {
        type_: kind.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.map(Into::into),
        ..PodCondition::default()
    }
}

/// A plain init container finished with exit code 0.
fn init_succeeded(c: &ApiContainerStatus) -> bool {
    c.state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .is_some_and(|t| t.exit_code == 0)
}

/// A sidecar started at least once (it runs and its startup probe, if any,
/// succeeded: `started`; or it ran and waits to restart), as the kubelet's
/// `isInitContainerInitialized`.
fn sidecar_started(c: &ApiContainerStatus) -> bool {
    let state = c.state.clone().unwrap_or_default();
    state.running.is_some() && c.started == Some(true)
        || state.terminated.is_some()
        || c.last_state
            .as_ref()
            .is_some_and(|l| l.terminated.is_some())
}

/// The kubelet's `getPhase` from container statuses; `init` holds the plain
/// init containers' statuses, `sidecars` the sidecars'.
fn phase(
    init: &[&ApiContainerStatus],
    sidecars: &[&ApiContainerStatus],
    apps: &[ApiContainerStatus],
    policy: RestartPolicy,
    terminal: Option<Terminal>,
) -> &'static str {
    if let Some(t) = terminal {
        return match t {
            Terminal::Succeeded => "Succeeded",
            Terminal::Failed => "Failed",
        };
    }
    if !init.iter().all(|c| init_succeeded(c)) || !sidecars.iter().all(|c| sidecar_started(c)) {
        return "Pending";
    }
    let (mut running, mut waiting, mut stopped, mut succeeded) = (0, 0, 0, 0);
    running += sidecars
        .iter()
        .filter(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
        .count();
    for c in apps {
        let state = c.state.clone().unwrap_or_default();
        if state.running.is_some() {
            running += 1;
        } else if let Some(t) = state.terminated {
            stopped += 1;
            if t.exit_code == 0 {
                succeeded += 1;
            }
        } else if c
            .last_state
            .as_ref()
            .is_some_and(|l| l.terminated.is_some())
        {
            stopped += 1;
        } else {
            waiting += 1;
        }
    }
    match () {
        _ if waiting > 0 => "Pending",
        _ if running > 0 => "Running",
        _ if stopped > 0 => match policy {
            RestartPolicy::Always => "Running",
            _ if stopped == succeeded => "Succeeded",
            RestartPolicy::Never => "Failed",
            RestartPolicy::OnFailure => "Running",
        },
        _ => "Pending",
    }
}

/// Generates the API status of `pod`.
pub fn generate(pod: &Pod, runtime: &PodStatus, ctx: &Context<'_>) -> ApiPodStatus {
    let spec = pod.spec.clone().unwrap_or_default();
    let policy = RestartPolicy::of(pod);
    let host_ip = (!ctx.host_ip.is_empty()).then(|| ctx.host_ip.to_owned());
    if let Some((reason, message)) = ctx.rejected {
        return ApiPodStatus {
            phase: Some("Failed".into()),
            reason: Some(reason.into()),
            message: Some(message.into()),
            host_ip,
            start_time: ctx.start_time.and_then(time),
            // The kubelet's `rejectPod` keeps the QoS class.
            qos_class: Some(evpleg_core::qos::qos_class(pod).as_api().into()),
            ..ApiPodStatus::default()
        };
    }
    let deleted = pod.metadata.deletion_timestamp.is_some();
    let old = |list: Option<&Vec<ApiContainerStatus>>, name: &str| {
        list.and_then(|l| l.iter().find(|c| c.name == name))
            .cloned()
    };
    let previous = ctx.previous;
    let init_specs = spec.init_containers.clone().unwrap_or_default();
    let init: Vec<ApiContainerStatus> = init_specs
        .iter()
        .map(|c| {
            let old = old(
                previous.and_then(|p| p.init_container_statuses.as_ref()),
                &c.name,
            );
            container_status(
                c,
                runtime,
                policy_for_init(policy, is_sidecar(c)),
                ctx,
                "PodInitializing",
                (old.as_ref(), deleted),
            )
        })
        .collect();
    // A plain init container is ready once it completed with exit code 0,
    // and not before: running, it is not (the prober manager's
    // `UpdatePodStatus` looks at its terminated state only, never at a
    // readiness result).
    let mut init = init;
    for (c, spec) in init.iter_mut().zip(&init_specs) {
        if !is_sidecar(spec) {
            c.ready = init_succeeded(c);
        }
    }
    let (sidecars, plain): (Vec<_>, Vec<_>) = init
        .iter()
        .zip(&init_specs)
        .partition(|(_, c)| is_sidecar(c));
    let sidecars: Vec<&ApiContainerStatus> = sidecars.into_iter().map(|(s, _)| s).collect();
    let plain: Vec<&ApiContainerStatus> = plain.into_iter().map(|(s, _)| s).collect();
    let init_done =
        plain.iter().all(|c| init_succeeded(c)) && sidecars.iter().all(|c| sidecar_started(c));
    let mut apps: Vec<ApiContainerStatus> = spec
        .containers
        .iter()
        .map(|c| {
            // The default waiting reason (`convertToAPIContainerStatuses`'
            // `hasInitContainers`): PodInitializing whenever the pod has init
            // containers, also once they are done.
            let reason = if init_specs.is_empty() {
                "ContainerCreating"
            } else {
                "PodInitializing"
            };
            let old = old(
                previous.and_then(|p| p.container_statuses.as_ref()),
                &c.name,
            );
            container_status(c, runtime, policy, ctx, reason, (old.as_ref(), deleted))
        })
        .collect();
    // A terminal phase is held while a container could still run (a sidecar
    // not stopped yet, a container left by a dead sandbox): the kubelet's
    // `mergePodStatus` keeps the old phase while the pod worker could have
    // running containers, and its `getPhase` counts running sidecars as
    // running. The termination's final status, read after the kill, says it.
    let could_run = runtime
        .containers
        .iter()
        .any(|c| matches!(c.state, ContainerState::Running | ContainerState::Unknown));
    let terminal = ctx.terminal.filter(|_| !could_run);
    let phase = phase(&plain, &sidecars, &apps, policy, terminal);
    if matches!(phase, "Succeeded" | "Failed") && init_done {
        // The kubelet's `TerminatePod`: once initialized, a container with no
        // terminated state at the end failed, as far as anyone can tell.
        for c in &mut apps {
            if c.state.as_ref().is_none_or(|s| s.terminated.is_none()) {
                c.state = Some(ApiState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 137,
                        reason: Some(STATUS_UNKNOWN.into()),
                        message: Some(
                            "The container could not be located when the pod was terminated".into(),
                        ),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ApiState::default()
                });
                c.ready = false;
            }
        }
    }
    // An evicted pod (`ShouldEvict` in `generateAPIPodStatus`) is Failed
    // with the eviction's reason and message at once, its conditions
    // generated from that phase, also while its containers still run: so
    // the node's `/pods` serves it, as the kubelet's; the API writer holds
    // the phase until no container runs (`super::api::merge_status`, the
    // kubelet's `mergePodStatus`).
    let phase = if ctx.evicted.is_some() {
        "Failed"
    } else {
        phase
    };
    let host_network = spec.host_network.unwrap_or(false);
    let pod_ips: Vec<String> = if host_network {
        host_ip.iter().cloned().collect()
    } else {
        runtime.ips.clone()
    };
    // Readiness gates: conditions others set on the pod, kept as they are.
    let others: Vec<PodCondition> = pod
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .filter(|c| !KUBELET_CONDITIONS.contains(&c.type_.as_str()))
        .cloned()
        .collect();
    let init_refs: Vec<&ApiContainerStatus> = init.iter().collect();
    let app_refs: Vec<&ApiContainerStatus> = apps.iter().collect();
    let every: Vec<&ApiContainerStatus> = init.iter().chain(&apps).collect();
    let containers_ready = conditions::containers_ready(&spec, &every, phase);
    let ready = conditions::pod_ready(&spec, &containers_ready, &others);
    let mut list = vec![
        conditions::ready_to_start_containers(&runtime.sandboxes),
        condition("PodScheduled", true, None),
        conditions::initialized(&spec, &init_refs, &app_refs, phase),
        containers_ready,
        ready,
    ];
    list.extend(others);
    if let Some((reason, message)) = ctx.disruption {
        list.retain(|c| c.type_ != "DisruptionTarget");
        list.push(PodCondition {
            message: Some(message.into()),
            ..condition("DisruptionTarget", true, Some(reason))
        });
    }
    ApiPodStatus {
        phase: Some(phase.into()),
        reason: ctx.evicted.map(|(reason, _)| reason.into()),
        message: ctx.evicted.map(|(_, message)| message.into()),
        conditions: Some(list),
        host_ip: host_ip.clone(),
        host_ips: host_ip.map(|ip| vec![k8s_openapi::api::core::v1::HostIP { ip }]),
        pod_ip: pod_ips.first().cloned(),
        pod_ips: (!pod_ips.is_empty())
            .then(|| pod_ips.into_iter().map(|ip| PodIP { ip }).collect()),
        start_time: ctx.start_time.and_then(time),
        init_container_statuses: (!init.is_empty()).then_some(init),
        container_statuses: Some(apps),
        qos_class: Some(evpleg_core::qos::qos_class(pod).as_api().into()),
        ..ApiPodStatus::default()
    }
}

/// Whether a pod's stored Ready condition disagrees with what its readiness
/// gates and its ContainersReady condition say now (the kubelet's
/// `status.NeedToReconcilePodReadiness`, with `GeneratePodReadyCondition`
/// over the pod's own status): a pod without gates, or without a Ready
/// condition yet, never needs it.
pub fn needs_readiness_reconcile(pod: &Pod) -> bool {
    let gates = pod
        .spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_deref())
        .unwrap_or_default();
    if gates.is_empty() {
        return false;
    }
    let conditions = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let is_true = |kind: &str| {
        conditions
            .iter()
            .any(|c| c.type_ == kind && c.status == "True")
    };
    let Some(ready) = conditions.iter().find(|c| c.type_ == "Ready") else {
        return false;
    };
    let terminal = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    let expected =
        !terminal && is_true("ContainersReady") && gates.iter().all(|g| is_true(&g.condition_type));
    (ready.status == "True") != expected
}

/// Init containers restart unless the pod's policy is Never; sidecars always.
fn policy_for_init(policy: RestartPolicy, sidecar: bool) -> RestartPolicy {
    match policy {
        _ if sidecar => RestartPolicy::Always,
        RestartPolicy::Never => RestartPolicy::Never,
        _ => RestartPolicy::OnFailure,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::container::{SandboxState, SandboxStatus};
    use evpleg_core::ids::ContainerId;
    use evpleg_core::lifecycle::EventSource;
    use std::time::Duration;

    fn pod(policy: &str, init: &[&str], apps: &[&str]) -> Pod {
        let c = |names: &[&str]| -> serde_json::Value {
            names
                .iter()
                .map(|n| {
                    // Test convention: init containers named side* are sidecars.
                    let policy = n.starts_with("side").then_some("Always");
                    serde_json::json!({"name": n, "image": "localhost/busybox:latest", "restartPolicy": policy})
                })
                .collect()
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "uid": "a".repeat(32)},
            "spec": {"restartPolicy": policy, "hostNetwork": true, "initContainers": c(init), "containers": c(apps)}
        }))
        .unwrap()
    }

    fn cs(
        n: u8,
        name: &str,
        state: ContainerState,
        exit: Option<i32>,
        attempt: u32,
    ) -> ContainerStatus {
        let mut c = ContainerStatus::new(
            ContainerId::parse(&format!("{n:02x}").repeat(32)).unwrap(),
            name,
            state,
            EventSource::Relist,
        );
        c.exit_code = exit;
        c.attempt = attempt;
        c.started_at = Some(1_700_000_000_000_000_000);
        if exit.is_some() {
            c.finished_at = Some(1_700_000_001_000_000_000);
        }
        c
    }

    fn runtime(containers: Vec<ContainerStatus>) -> PodStatus {
        PodStatus {
            sandboxes: vec![SandboxStatus {
                pid: None,
                id: ContainerId::parse(&"0".repeat(64)).unwrap(),
                state: SandboxState::Ready,
                attempt: 0,
                created_at: None,
                ip: None,
            }],
            containers,
            ..PodStatus::default()
        }
    }

    fn ctx() -> Context<'static> {
        Context {
            host_ip: "10.0.0.1",
            runtime: "containerd",
            ..Context::default()
        }
    }

    fn cond(s: &ApiPodStatus, kind: &str) -> String {
        s.conditions
            .as_ref()
            .unwrap()
            .iter()
            .find(|c| c.type_ == kind)
            .unwrap()
            .status
            .clone()
    }

    /// The kubelet's default waiting reasons (`convertToAPIContainerStatuses`,
    /// `convertContainerStatus`): an app container without a runtime record
    /// waits PodInitializing whenever the pod has init containers, also once
    /// they completed (fidelity run: evpleg served ContainerCreating in
    /// between), ContainerCreating without; a created container waits
    /// without a reason, unless a start error is recorded.
    #[test]
    fn default_waiting_reasons_are_the_kubelet_s() {
        let reason = |s: &ApiPodStatus| {
            let app = &s.container_statuses.as_ref().unwrap()[0];
            let waiting = app.state.as_ref().unwrap().waiting.clone().unwrap();
            waiting.reason
        };
        let with_init = pod("Always", &["init"], &["app"]);
        let init_done = runtime(vec![cs(1, "init", ContainerState::Exited, Some(0), 0)]);
        let s = generate(&with_init, &init_done, &ctx());
        assert_eq!(reason(&s).as_deref(), Some("PodInitializing"));
        assert_eq!(cond(&s, "Initialized"), "True");
        let without = pod("Always", &[], &["app"]);
        let s = generate(&without, &runtime(vec![]), &ctx());
        assert_eq!(reason(&s).as_deref(), Some("ContainerCreating"));
        let created = runtime(vec![cs(2, "app", ContainerState::Created, None, 0)]);
        let s = generate(&without, &created, &ctx());
        assert_eq!(reason(&s), None);
        let failed = [Waiting {
            name: "app".into(),
            reason: "RunContainerError".into(),
            message: "start failed".into(),
            retry_in: Duration::ZERO,
        }];
        let s = generate(
            &without,
            &created,
            &Context {
                waiting: &failed,
                ..ctx()
            },
        );
        assert_eq!(reason(&s).as_deref(), Some("RunContainerError"));
    }

    #[test]
    fn pending_then_running_with_conditions() {
        let p = pod("Always", &["init"], &["app"]);
        let s = generate(&p, &PodStatus::default(), &ctx());
        assert_eq!(s.phase.as_deref(), Some("Pending"));
        assert_eq!(cond(&s, "Initialized"), "False");
        let app = &s.container_statuses.as_ref().unwrap()[0];
        assert_eq!(
            app.state
                .as_ref()
                .unwrap()
                .waiting
                .as_ref()
                .unwrap()
                .reason
                .as_deref(),
            Some("PodInitializing")
        );

        let rt = runtime(vec![
            cs(1, "init", ContainerState::Exited, Some(0), 0),
            cs(2, "app", ContainerState::Running, None, 0),
        ]);
        let s = generate(&p, &rt, &ctx());
        assert_eq!(s.phase.as_deref(), Some("Running"));
        for c in [
            "PodReadyToStartContainers",
            "PodScheduled",
            "Initialized",
            "ContainersReady",
            "Ready",
        ] {
            assert_eq!(cond(&s, c), "True", "{c}");
        }
        assert_eq!(
            s.pod_ip.as_deref(),
            Some("10.0.0.1"),
            "host network: the pod IP is the host's"
        );
        let init = &s.init_container_statuses.as_ref().unwrap()[0];
        assert_eq!(
            init.state
                .as_ref()
                .unwrap()
                .terminated
                .as_ref()
                .unwrap()
                .reason
                .as_deref(),
            Some("Completed")
        );
    }

    #[test]
    fn exits_and_restarts() {
        // OnFailure, exited 3, restarted once and running: restart count 1, last state exit 3.
        let p = pod("OnFailure", &[], &["app"]);
        let rt = runtime(vec![
            cs(1, "app", ContainerState::Exited, Some(3), 0),
            cs(2, "app", ContainerState::Running, None, 1),
        ]);
        let s = generate(&p, &rt, &ctx());
        let c = &s.container_statuses.as_ref().unwrap()[0];
        assert_eq!(c.restart_count, 1);
        assert_eq!(
            c.last_state
                .as_ref()
                .unwrap()
                .terminated
                .as_ref()
                .unwrap()
                .exit_code,
            3
        );
        assert_eq!(s.phase.as_deref(), Some("Running"));

        // Never, exited 3: Failed with exit code 3 and reason Error.
        let p = pod("Never", &[], &["app"]);
        let rt = runtime(vec![cs(1, "app", ContainerState::Exited, Some(3), 0)]);
        let s = generate(
            &p,
            &rt,
            &Context {
                terminal: Some(Terminal::Failed),
                ..ctx()
            },
        );
        assert_eq!(s.phase.as_deref(), Some("Failed"));
        let t = s.container_statuses.as_ref().unwrap()[0]
            .state
            .clone()
            .unwrap()
            .terminated
            .unwrap();
        assert_eq!((t.exit_code, t.reason.as_deref()), (3, Some("Error")));
        assert_eq!(cond(&s, "Ready"), "False");

        // Always, OOM-killed, in back-off: waiting CrashLoopBackOff, last state OOMKilled.
        let p = pod("Always", &[], &["app"]);
        let mut oom = cs(1, "app", ContainerState::Exited, Some(137), 0);
        oom.reason = "OOMKilled".into();
        let backoff = [Waiting {
            name: "app".into(),
            reason: "CrashLoopBackOff".into(),
            message: "back-off 10s restarting failed container=app pod=p_default(x)".into(),
            retry_in: Duration::from_secs(4),
        }];
        let s = generate(
            &p,
            &runtime(vec![oom]),
            &Context {
                waiting: &backoff,
                ..ctx()
            },
        );
        let c = &s.container_statuses.as_ref().unwrap()[0];
        assert_eq!(
            c.state
                .as_ref()
                .unwrap()
                .waiting
                .as_ref()
                .unwrap()
                .reason
                .as_deref(),
            Some("CrashLoopBackOff")
        );
        assert_eq!(
            c.last_state
                .as_ref()
                .unwrap()
                .terminated
                .as_ref()
                .unwrap()
                .reason
                .as_deref(),
            Some("OOMKilled")
        );
        assert_eq!(s.phase.as_deref(), Some("Running"));
    }

    /// An evicted pod (its active deadline passed) is Failed with the
    /// eviction's reason at once, Ready and ContainersReady False PodFailed,
    /// its running container still running (the kubelet's
    /// `generateAPIPodStatus`; the API writer holds the phase:
    /// `api::tests::a_terminal_phase_waits_for_the_containers_in_the_api`);
    /// once the container ended, still Failed, even when it exited 0.
    /// Before, the conditions said Ready while the container ran its grace.
    #[test]
    fn an_evicted_pod_is_failed_and_unready_at_once() {
        let p = pod("Always", &[], &["app"]);
        let evicted = Context {
            terminal: Some(Terminal::Failed),
            evicted: Some(("DeadlineExceeded", "past its deadline")),
            ..ctx()
        };
        let check = |s: &ApiPodStatus, what: &str| {
            assert_eq!(
                (
                    s.phase.as_deref(),
                    s.reason.as_deref(),
                    s.message.as_deref()
                ),
                (
                    Some("Failed"),
                    Some("DeadlineExceeded"),
                    Some("past its deadline")
                ),
                "{what}"
            );
            for kind in ["Ready", "ContainersReady"] {
                let c = s
                    .conditions
                    .iter()
                    .flatten()
                    .find(|c| c.type_ == kind)
                    .unwrap();
                assert_eq!(
                    (c.status.as_str(), c.reason.as_deref()),
                    ("False", Some("PodFailed")),
                    "{what}: {kind}"
                );
            }
        };
        let running = runtime(vec![cs(1, "app", ContainerState::Running, None, 0)]);
        let s = generate(&p, &running, &evicted);
        check(&s, "running");
        let app = &s.container_statuses.as_ref().unwrap()[0];
        assert!(app.state.as_ref().unwrap().running.is_some(), "{app:?}");
        for code in [137, 0] {
            let ended = runtime(vec![cs(1, "app", ContainerState::Exited, Some(code), 0)]);
            let s = generate(
                &p,
                &ended,
                &Context {
                    terminal: Some(Terminal::Succeeded),
                    ..evicted
                },
            );
            check(&s, &format!("exit {code}"));
        }
        // Not evicted, the same running container: ready.
        let s = generate(&p, &running, &ctx());
        assert_eq!(cond(&s, "Ready"), "True");
    }

    #[test]
    fn rejected_pods_fail_with_the_reason() {
        let p = pod("Always", &[], &["app"]);
        let s = generate(
            &p,
            &PodStatus::default(),
            &Context {
                rejected: Some(("OutOfmemory", "needs 1Ti")),
                ..ctx()
            },
        );
        assert_eq!(
            (s.phase.as_deref(), s.reason.as_deref()),
            (Some("Failed"), Some("OutOfmemory"))
        );
        // `rejectPod` keeps the QoS class (no requests: BestEffort).
        assert_eq!(s.qos_class.as_deref(), Some("BestEffort"));
    }

    /// A plain init container is ready once it completed with 0 and not
    /// before (`UpdatePodStatus`), whatever the probes say; a sidecar is
    /// ready when running and its probes say so. A death by signal has no
    /// `signal` (`convertContainerStatus` never sets it).
    #[test]
    fn init_readiness_and_no_signal_as_the_kubelet() {
        use ContainerState::*;
        let p = pod("Never", &["init", "side"], &["app"]);
        let killed = |mut c: ContainerStatus| {
            c.signal = Some(9);
            c
        };
        // (runtime containers, the init container's ready, the sidecar's)
        let cases = [
            (vec![], false, false),
            (vec![cs(1, "init", Running, None, 0)], false, false),
            (vec![cs(1, "init", Exited, Some(1), 0)], false, false),
            (
                vec![killed(cs(1, "init", Exited, Some(137), 0))],
                false,
                false,
            ),
            (vec![cs(1, "init", Exited, Some(0), 0)], true, false),
            (
                vec![
                    cs(1, "init", Exited, Some(0), 0),
                    cs(2, "side", Running, None, 0),
                ],
                true,
                true,
            ),
        ];
        for (i, (containers, init_ready, side_ready)) in cases.into_iter().enumerate() {
            let s = generate(&p, &runtime(containers), &ctx());
            let ready: Vec<bool> = s
                .init_container_statuses
                .iter()
                .flatten()
                .map(|c| c.ready)
                .collect();
            assert_eq!(ready, [init_ready, side_ready], "case {i}");
            let signals: Vec<_> = s
                .init_container_statuses
                .iter()
                .flatten()
                .filter_map(|c| c.state.as_ref()?.terminated.as_ref())
                .map(|t| t.signal)
                .collect();
            assert!(signals.iter().all(Option::is_none), "case {i}: {signals:?}");
        }
    }

    #[test]
    fn times_convert() {
        assert_eq!(
            time(1_700_000_000_000_000_000).unwrap().0.as_second(),
            1_700_000_000
        );
    }

    #[test]
    fn sidecars_initialize_run_along_and_restart() {
        use ContainerState::*;
        let p = pod("Never", &["side", "init"], &["app"]);
        let state = |s: &ApiPodStatus, name: &str| -> &'static str {
            let c = s
                .init_container_statuses
                .iter()
                .flatten()
                .chain(s.container_statuses.iter().flatten())
                .find(|c| c.name == name)
                .unwrap();
            let st = c.state.clone().unwrap_or_default();
            match () {
                _ if st.running.is_some() => "running",
                _ if st.terminated.is_some() => "terminated",
                _ => "waiting",
            }
        };
        // (observed, phase, Initialized, ContainersReady, the sidecar's state)
        let cases = [
            (vec![], "Pending", "False", "False", "waiting"),
            (
                vec![cs(1, "side", Running, None, 0)],
                "Pending",
                "False",
                "False",
                "running",
            ),
            (
                vec![
                    cs(1, "side", Running, None, 0),
                    cs(2, "init", Exited, Some(0), 0),
                    cs(3, "app", Running, None, 0),
                ],
                "Running",
                "True",
                "True",
                "running",
            ),
            // The sidecar crashed: it restarts even under Never; not ready
            // meanwhile, terminated until its restart (no reason to wait).
            (
                vec![
                    cs(1, "side", Exited, Some(1), 0),
                    cs(2, "init", Exited, Some(0), 0),
                    cs(3, "app", Running, None, 0),
                ],
                "Running",
                "True",
                "False",
                "terminated",
            ),
        ];
        for (n, (observed, phase, initialized, ready, side)) in cases.into_iter().enumerate() {
            let s = generate(&p, &runtime(observed), &ctx());
            assert_eq!(
                (
                    s.phase.as_deref().unwrap(),
                    cond(&s, "Initialized").as_str(),
                    cond(&s, "ContainersReady").as_str(),
                    state(&s, "side")
                ),
                (phase, initialized, ready, side),
                "case {n}"
            );
        }
        // The app done, the sidecar stopped by termination (137): the pod
        // succeeded by its app container alone.
        let rt = runtime(vec![
            cs(1, "side", Exited, Some(137), 0),
            cs(2, "init", Exited, Some(0), 0),
            cs(3, "app", Exited, Some(0), 0),
        ]);
        let s = generate(
            &p,
            &rt,
            &Context {
                terminal: Some(Terminal::Succeeded),
                ..ctx()
            },
        );
        assert_eq!(s.phase.as_deref(), Some("Succeeded"));
        assert_eq!(state(&s, "side"), "terminated");
    }

    /// Issue #27 item 3: SyncPod finds a pod terminal while a container
    /// still runs (a sidecar not stopped yet, a container a dead sandbox
    /// left): the phase stays Running (it said Succeeded/Failed while the
    /// processes held their resources); once nothing runs it is terminal.
    #[test]
    fn a_terminal_phase_waits_for_running_containers() {
        use ContainerState::*;
        let with_sidecar = pod("Never", &["side"], &["app"]);
        let plain = pod("Never", &[], &["app"]);
        // (pod, observed, SyncPod's verdict, phase)
        let cases = [
            (
                &with_sidecar,
                vec![
                    cs(1, "side", Running, None, 0),
                    cs(2, "app", Exited, Some(0), 0),
                ],
                Terminal::Succeeded,
                "Running",
            ),
            (
                &with_sidecar,
                vec![
                    cs(1, "side", Exited, Some(137), 0),
                    cs(2, "app", Exited, Some(0), 0),
                ],
                Terminal::Succeeded,
                "Succeeded",
            ),
            (
                &plain,
                vec![cs(2, "app", Running, None, 0)],
                Terminal::Failed,
                "Running",
            ),
            (
                &plain,
                vec![cs(2, "app", Exited, Some(1), 0)],
                Terminal::Failed,
                "Failed",
            ),
        ];
        for (n, (p, observed, verdict, want)) in cases.into_iter().enumerate() {
            let s = generate(
                p,
                &runtime(observed),
                &Context {
                    terminal: Some(verdict),
                    ..ctx()
                },
            );
            assert_eq!(s.phase.as_deref(), Some(want), "case {n}");
        }
    }

    /// Issue #27 item 5: a container whose runtime record is gone keeps what
    /// the last status said: a running pod does not fall back to Pending and
    /// `Initialized=False`; a container that was running ended with 137
    /// ContainerStatusUnknown (a restart more); a terminated one stays as it
    /// was; a terminal pod's container without an end gets that end.
    #[test]
    fn a_container_without_a_runtime_record_keeps_its_last_status() {
        let p = pod("Always", &["init"], &["app"]);
        let rt = runtime(vec![
            cs(1, "init", ContainerState::Exited, Some(0), 0),
            cs(2, "app", ContainerState::Running, None, 2),
        ]);
        let before = generate(&p, &rt, &ctx());
        assert_eq!(before.phase.as_deref(), Some("Running"));
        // Every record gone (collected, or the runtime lost them).
        let s = generate(
            &p,
            &runtime(vec![]),
            &Context {
                previous: Some(&before),
                ..ctx()
            },
        );
        assert_eq!(
            (s.phase.as_deref(), cond(&s, "Initialized").as_str()),
            (Some("Running"), "True")
        );
        let app = &s.container_statuses.as_ref().unwrap()[0];
        let last = app.last_state.clone().unwrap().terminated.unwrap();
        assert_eq!(
            (app.restart_count, last.exit_code, last.reason.as_deref()),
            (3, 137, Some(STATUS_UNKNOWN))
        );
        assert!(app.state.as_ref().unwrap().waiting.is_some());
        let init = &s.init_container_statuses.as_ref().unwrap()[0];
        assert_eq!(init, &before.init_container_statuses.as_ref().unwrap()[0]);
        // A Never pod that failed with its records gone: its container ends.
        let p = pod("Never", &[], &["app"]);
        let s = generate(
            &p,
            &runtime(vec![]),
            &Context {
                terminal: Some(Terminal::Failed),
                ..ctx()
            },
        );
        let t = s.container_statuses.as_ref().unwrap()[0]
            .state
            .clone()
            .unwrap()
            .terminated
            .unwrap();
        assert_eq!(
            (s.phase.as_deref(), t.exit_code, t.reason.as_deref()),
            (Some("Failed"), 137, Some(STATUS_UNKNOWN))
        );
    }

    /// Issue #27 item 10: an exited container whose restart is due without
    /// a reason to wait stays Terminated (it showed Waiting
    /// ContainerCreating), one in CrashLoopBackOff waits with its exit as the
    /// last state; a completed init container is ready (it showed false).
    #[test]
    fn an_exit_stays_terminated_until_a_reason_to_wait_and_completed_inits_are_ready() {
        let p = pod("Always", &["init"], &["app"]);
        let rt = runtime(vec![
            cs(1, "init", ContainerState::Exited, Some(0), 0),
            cs(2, "app", ContainerState::Exited, Some(1), 0),
        ]);
        let s = generate(&p, &rt, &ctx());
        let app = &s.container_statuses.as_ref().unwrap()[0];
        let t = app.state.clone().unwrap().terminated.unwrap();
        assert_eq!((t.exit_code, t.reason.as_deref()), (1, Some("Error")));
        assert_eq!(s.phase.as_deref(), Some("Running"));
        assert!(s.init_container_statuses.as_ref().unwrap()[0].ready);
        let backoff = [Waiting {
            name: "app".into(),
            reason: "CrashLoopBackOff".into(),
            message: "back-off 10s".into(),
            retry_in: Duration::from_secs(4),
        }];
        let s = generate(
            &p,
            &rt,
            &Context {
                waiting: &backoff,
                ..ctx()
            },
        );
        let app = &s.container_statuses.as_ref().unwrap()[0];
        assert_eq!(
            app.state
                .clone()
                .unwrap()
                .waiting
                .unwrap()
                .reason
                .as_deref(),
            Some("CrashLoopBackOff")
        );
        assert_eq!(
            app.last_state
                .clone()
                .unwrap()
                .terminated
                .unwrap()
                .exit_code,
            1
        );
    }

    /// The kubelet's `NeedToReconcilePodReadiness`.
    #[test]
    fn readiness_reconcile_table() {
        let p = |gates: bool, conditions: &[(&str, &str)]| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p"},
                "spec": {"containers": [], "readinessGates": if gates {
                    serde_json::json!([{"conditionType": "lb"}]) } else { serde_json::json!([]) }},
                "status": {"conditions": conditions.iter().map(|(t, s)| serde_json::json!({"type": t, "status": s})).collect::<Vec<_>>()}
            }))
            .unwrap()
        };
        let cases = [
            (
                false,
                vec![
                    ("ContainersReady", "True"),
                    ("Ready", "False"),
                    ("lb", "True"),
                ],
                false,
            ),
            (
                true,
                vec![("ContainersReady", "True"), ("lb", "True")],
                false,
            ),
            (
                true,
                vec![
                    ("ContainersReady", "True"),
                    ("Ready", "False"),
                    ("lb", "True"),
                ],
                true,
            ),
            (
                true,
                vec![
                    ("ContainersReady", "True"),
                    ("Ready", "False"),
                    ("lb", "False"),
                ],
                false,
            ),
            (
                true,
                vec![
                    ("ContainersReady", "False"),
                    ("Ready", "False"),
                    ("lb", "True"),
                ],
                false,
            ),
            (
                true,
                vec![
                    ("ContainersReady", "True"),
                    ("Ready", "True"),
                    ("lb", "False"),
                ],
                true,
            ),
            (
                true,
                vec![
                    ("ContainersReady", "True"),
                    ("Ready", "True"),
                    ("lb", "True"),
                ],
                false,
            ),
        ];
        for (gates, conditions, want) in cases {
            assert_eq!(
                needs_readiness_reconcile(&p(gates, &conditions)),
                want,
                "{gates} {conditions:?}"
            );
        }
    }

    #[test]
    fn probes_decide_ready_and_started_and_readiness_gates_hold_ready() {
        use crate::prober::{ProbeKind, ProbeResult, Results};
        let mut p = pod("Always", &[], &["app"]);
        let spec = p.spec.as_mut().unwrap();
        spec.containers[0].readiness_probe = Some(Default::default());
        spec.containers[0].startup_probe = Some(Default::default());
        spec.readiness_gates = Some(vec![k8s_openapi::api::core::v1::PodReadinessGate {
            condition_type: "example.com/lb".into(),
        }]);
        let running = cs(1, "app", ContainerState::Running, None, 0);
        let id = running.id.clone();
        let rt = runtime(vec![running]);
        let uid = evpleg_core::ids::PodUid::parse(&"a".repeat(32)).unwrap();
        let (results, _changes) = Results::new();
        let gate = |status: &str| {
            Some(ApiPodStatus {
                conditions: Some(vec![PodCondition {
                    type_: "example.com/lb".into(),
                    status: status.into(),
                    ..PodCondition::default()
                }]),
                ..ApiPodStatus::default()
            })
        };
        // (startup, readiness, gate) -> (started, ready, Ready, Ready's reason)
        let cases = [
            (
                ProbeResult::Unknown,
                ProbeResult::Success,
                "True",
                (false, false, "False", "ContainersNotReady"),
            ),
            (
                ProbeResult::Success,
                ProbeResult::Failure,
                "True",
                (true, false, "False", "ContainersNotReady"),
            ),
            (
                ProbeResult::Success,
                ProbeResult::Success,
                "False",
                (true, true, "False", "ReadinessGatesNotReady"),
            ),
            (
                ProbeResult::Success,
                ProbeResult::Success,
                "True",
                (true, true, "True", ""),
            ),
        ];
        for (startup, readiness, gate_status, want) in cases {
            results.set(&uid, &id, ProbeKind::Startup, startup);
            results.set(&uid, &id, ProbeKind::Readiness, readiness);
            p.status = gate(gate_status);
            let s = generate(
                &p,
                &rt,
                &Context {
                    probes: Some(&results),
                    ..ctx()
                },
            );
            let c = &s.container_statuses.as_ref().unwrap()[0];
            let ready = s
                .conditions
                .as_ref()
                .unwrap()
                .iter()
                .find(|c| c.type_ == "Ready")
                .unwrap();
            assert_eq!(
                (
                    c.started.unwrap(),
                    c.ready,
                    ready.status.as_str(),
                    ready.reason.as_deref().unwrap_or("")
                ),
                want,
                "{startup:?} {readiness:?} gate {gate_status}"
            );
            // The gate's own condition is kept.
            assert_eq!(cond(&s, "example.com/lb"), gate_status);
        }
    }
}

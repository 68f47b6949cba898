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
//! Initialized, ContainersReady, Ready (a running
//! container is ready when its readiness probe succeeded, or it has none, and
//! its startup probe succeeded: [`crate::prober`]; Ready also needs every
//! readiness gate's condition True, and conditions others set are kept).
//! lastTransitionTime is the status manager's. Container statuses carry the state, the last
//! termination, the exit code and reason (Completed, Error, OOMKilled), the
//! restart count and the times. An exit the kernel saw first is already in the
//! runtime status given here (the PLEG merged it).

use k8s_openapi::api::core::v1::{
    ContainerState as ApiState, ContainerStateRunning, ContainerStateTerminated,
    ContainerStateWaiting, ContainerStatus as ApiContainerStatus, Pod, PodCondition, PodIP,
    PodStatus as ApiPodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

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
}

fn terminated(runtime: &str, s: &ContainerStatus) -> ContainerStateTerminated {
    ContainerStateTerminated {
        exit_code: s.exit_code.unwrap_or(0),
        signal: s.signal,
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

fn waiting(reason: &str, message: Option<String>) -> ApiState {
    ApiState {
        waiting: Some(ContainerStateWaiting {
            reason: Some(reason.into()),
            message,
        }),
        ..ApiState::default()
    }
}

/// The status of one container of the spec.
fn container_status(
    spec: &k8s_openapi::api::core::v1::Container,
    status: &PodStatus,
    policy: RestartPolicy,
    ctx: &Context<'_>,
    pending_reason: &str,
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
        out.state = Some(waiting_why(pending_reason));
        return out;
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
        ContainerState::Created | ContainerState::Unknown => waiting_why("ContainerCreating"),
        ContainerState::Exited => {
            let restarts = ctx.terminal.is_none()
                && match policy {
                    RestartPolicy::Always => true,
                    RestartPolicy::OnFailure => s.exit_code != Some(0),
                    RestartPolicy::Never => false,
                };
            if restarts {
                // Waiting for the restart; the exit goes into the last state.
                out.last_state = Some(ApiState {
                    terminated: Some(terminated(ctx.runtime, s)),
                    ..ApiState::default()
                });
                waiting_why("ContainerCreating")
            } else {
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
            ..ApiPodStatus::default()
        };
    }
    let init_specs = spec.init_containers.clone().unwrap_or_default();
    let init: Vec<ApiContainerStatus> = init_specs
        .iter()
        .map(|c| {
            container_status(
                c,
                runtime,
                policy_for_init(policy, is_sidecar(c)),
                ctx,
                "PodInitializing",
            )
        })
        .collect();
    let (sidecars, plain): (Vec<_>, Vec<_>) = init
        .iter()
        .zip(&init_specs)
        .partition(|(_, c)| is_sidecar(c));
    let sidecars: Vec<&ApiContainerStatus> = sidecars.into_iter().map(|(s, _)| s).collect();
    let plain: Vec<&ApiContainerStatus> = plain.into_iter().map(|(s, _)| s).collect();
    let init_done =
        plain.iter().all(|c| init_succeeded(c)) && sidecars.iter().all(|c| sidecar_started(c));
    let apps: Vec<ApiContainerStatus> = spec
        .containers
        .iter()
        .map(|c| {
            let reason = if init_done {
                "ContainerCreating"
            } else {
                "PodInitializing"
            };
            container_status(c, runtime, policy, ctx, reason)
        })
        .collect();
    let phase = phase(&plain, &sidecars, &apps, policy, ctx.terminal);
    let all_ready =
        !apps.is_empty() && apps.iter().all(|c| c.ready) && sidecars.iter().all(|c| c.ready);
    let completed = matches!(phase, "Succeeded" | "Failed").then_some("PodCompleted");
    let not_ready = if completed.is_some() {
        completed
    } else if all_ready {
        None
    } else {
        Some("ContainersNotReady")
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
    let gate_missing = spec.readiness_gates.iter().flatten().find(|g| {
        !others
            .iter()
            .any(|c| c.type_ == g.condition_type && c.status == "True")
    });
    let mut ready = condition(
        "Ready",
        all_ready && completed.is_none() && gate_missing.is_none(),
        not_ready,
    );
    if let (Some(g), None) = (gate_missing, not_ready) {
        ready.reason = Some("ReadinessGatesNotReady".into());
        ready.message = Some(format!(
            "corresponding condition of pod readiness gate {:?} does not exist or is not True.",
            g.condition_type
        ));
    }
    // The kubelet's PodReadyToStartContainers: a ready sandbox (its network
    // set up by the runtime).
    let sandbox_ready = runtime
        .sandboxes
        .iter()
        .any(|s| s.state == evpleg_core::container::SandboxState::Ready);
    let mut conditions = vec![
        condition("PodReadyToStartContainers", sandbox_ready, None),
        condition("PodScheduled", true, None),
        condition(
            "Initialized",
            init_done,
            (!init_done).then_some("ContainersNotInitialized"),
        ),
        condition(
            "ContainersReady",
            all_ready && completed.is_none(),
            not_ready,
        ),
        ready,
    ];
    conditions.extend(others);
    ApiPodStatus {
        phase: Some(phase.into()),
        conditions: Some(conditions),
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
            // The sidecar crashed: it restarts even under Never; not ready meanwhile.
            (
                vec![
                    cs(1, "side", Exited, Some(1), 0),
                    cs(2, "init", Exited, Some(0), 0),
                    cs(3, "app", Running, None, 0),
                ],
                "Running",
                "True",
                "False",
                "waiting",
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

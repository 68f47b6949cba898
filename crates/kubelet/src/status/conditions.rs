//! The pod conditions the kubelet owns, with its reasons and messages: the
//! kubelet's `status/generate.go` (`GenerateContainersReadyCondition`,
//! `GeneratePodReadyCondition`, `GeneratePodInitializedCondition`,
//! `GeneratePodReadyToStartContainersCondition`), over the container statuses
//! [`super::generate`] made.
//!
//! * ContainersReady: False `PodCompleted` once Succeeded, `PodFailed` once
//!   Failed; False `ContainersNotReady` with "containers with unready status:
//!   [a b]" (sidecars first, then app containers, in spec order); else True.
//! * Ready: ContainersReady's status, reason and message while it is not
//!   True; else False `ReadinessGatesNotReady` with a message per gate whose
//!   condition is missing or not True; else True.
//! * Initialized: True `PodCompleted` once Succeeded; True once an app
//!   container has run (`HasAnyRegularContainerStarted`); False
//!   `ContainersNotInitialized` with "containers with incomplete status: [i]"
//!   for init containers not done (a plain one not ready, a sidecar not
//!   started); else True.
//! * PodReadyToStartContainers: True when no new sandbox is needed (the
//!   newest sandbox is ready, and no other is); else False
//!   `PodSandboxNotReady` with the kubelet's message of why one is needed
//!   (`PodSandboxChanged`): "no pod sandbox exists", "multiple pod sandboxes
//!   are ready and need to be reconciled", "pod sandbox is not ready" (a
//!   finished pod's stopped sandbox).
//!
//! Differences: no `observedGeneration` on the conditions;
//! PodReadyToStartContainers does not look at the sandbox's network
//! namespace mode or IP address (`PodSandboxChanged`'s last two reasons).

use k8s_openapi::api::core::v1::{ContainerStatus as ApiContainerStatus, PodCondition, PodSpec};

use crate::kuberuntime::actions::is_sidecar;
use evpleg_core::container::{SandboxState, SandboxStatus};

/// The kubelet's `PodCompleted` reason.
pub const POD_COMPLETED: &str = "PodCompleted";
/// The kubelet's `PodFailed` reason.
pub const POD_FAILED: &str = "PodFailed";

fn condition(kind: &str, ok: bool, reason: Option<&str>, message: Option<String>) -> PodCondition {
    PodCondition {
        type_: kind.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.map(Into::into),
        message,
        ..PodCondition::default()
    }
}

/// Go's `%s` of a `[]string`: `[a b]`.
fn go_list(names: &[&str]) -> String {
    format!("[{}]", names.join(" "))
}

/// The status of container `name`, among `statuses`.
fn find<'a>(statuses: &[&'a ApiContainerStatus], name: &str) -> Option<&'a ApiContainerStatus> {
    statuses.iter().find(|s| s.name == name).copied()
}

/// "containers with unknown status: [..], containers with <what> status: [..]".
fn message(unknown: &[&str], what: &str, names: &[&str]) -> Option<String> {
    let mut parts = Vec::new();
    if !unknown.is_empty() {
        parts.push(format!(
            "containers with unknown status: {}",
            go_list(unknown)
        ));
    }
    if !names.is_empty() {
        parts.push(format!("containers with {what} status: {}", go_list(names)));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// `GenerateContainersReadyCondition`: `statuses` holds the init and app
/// containers' statuses, `phase` the pod's.
pub fn containers_ready(
    spec: &PodSpec,
    statuses: &[&ApiContainerStatus],
    phase: &str,
) -> PodCondition {
    let (mut unknown, mut unready) = (Vec::new(), Vec::new());
    let sidecars = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| is_sidecar(c));
    for c in sidecars.chain(&spec.containers) {
        match find(statuses, &c.name) {
            Some(s) if !s.ready => unready.push(c.name.as_str()),
            Some(_) => {}
            None => unknown.push(c.name.as_str()),
        }
    }
    const KIND: &str = "ContainersReady";
    match phase {
        "Succeeded" if unknown.is_empty() => {
            return condition(KIND, false, Some(POD_COMPLETED), None);
        }
        "Failed" => return condition(KIND, false, Some(POD_FAILED), None),
        _ => {}
    }
    match message(&unknown, "unready", &unready) {
        Some(m) => condition(KIND, false, Some("ContainersNotReady"), Some(m)),
        None => condition(KIND, true, None, None),
    }
}

/// `GeneratePodReadyCondition`: `containers_ready` from [`containers_ready`],
/// `conditions` the pod's conditions others set (the readiness gates').
pub fn pod_ready(
    spec: &PodSpec,
    containers_ready: &PodCondition,
    conditions: &[PodCondition],
) -> PodCondition {
    if containers_ready.status != "True" {
        return PodCondition {
            type_: "Ready".into(),
            ..containers_ready.clone()
        };
    }
    let unready: Vec<String> = spec
        .readiness_gates
        .iter()
        .flatten()
        .filter_map(|g| {
            let kind = &g.condition_type;
            match conditions.iter().find(|c| c.type_ == *kind) {
                None => Some(format!(
                    "corresponding condition of pod readiness gate {kind:?} does not exist."
                )),
                Some(c) if c.status != "True" => Some(format!(
                    "the status of pod readiness gate {kind:?} is not \"True\", but {}",
                    c.status
                )),
                Some(_) => None,
            }
        })
        .collect();
    if unready.is_empty() {
        condition("Ready", true, None, None)
    } else {
        condition(
            "Ready",
            false,
            Some("ReadinessGatesNotReady"),
            Some(unready.join(", ")),
        )
    }
}

/// `GeneratePodInitializedCondition`: `init` and `apps` the init and app
/// containers' statuses.
pub fn initialized(
    spec: &PodSpec,
    init: &[&ApiContainerStatus],
    apps: &[&ApiContainerStatus],
    phase: &str,
) -> PodCondition {
    let (mut unknown, mut incomplete) = (Vec::new(), Vec::new());
    for c in spec.init_containers.iter().flatten() {
        let Some(s) = find(init, &c.name) else {
            unknown.push(c.name.as_str());
            continue;
        };
        let done = if is_sidecar(c) {
            s.started == Some(true)
        } else {
            s.ready
        };
        if !done {
            incomplete.push(c.name.as_str());
        }
    }
    const KIND: &str = "Initialized";
    if phase == "Succeeded" && unknown.is_empty() {
        return condition(KIND, true, Some(POD_COMPLETED), None);
    }
    let app_started = apps.iter().any(|s| {
        s.state
            .as_ref()
            .is_some_and(|st| st.running.is_some() || st.terminated.is_some())
    });
    if app_started {
        return condition(KIND, true, None, None);
    }
    match message(&unknown, "incomplete", &incomplete) {
        Some(m) => condition(KIND, false, Some("ContainersNotInitialized"), Some(m)),
        None => condition(KIND, true, None, None),
    }
}

/// `GeneratePodReadyToStartContainersCondition` over the pod's `sandboxes`
/// (the runtime's, any order): True unless `PodSandboxChanged` would make a
/// new one, else False with its reason.
pub fn ready_to_start_containers(sandboxes: &[SandboxStatus]) -> PodCondition {
    const KIND: &str = "PodReadyToStartContainers";
    let ready = |s: &&SandboxStatus| s.state == SandboxState::Ready;
    let newest = sandboxes
        .iter()
        .max_by_key(|s| (s.attempt, s.created_at.unwrap_or(0)));
    let why = match newest {
        None => "no pod sandbox exists",
        Some(_) if sandboxes.iter().filter(ready).count() > 1 => {
            "multiple pod sandboxes are ready and need to be reconciled"
        }
        Some(s) if s.state != SandboxState::Ready => "pod sandbox is not ready",
        Some(_) => return condition(KIND, true, None, None),
    };
    condition(
        KIND,
        false,
        Some("PodSandboxNotReady"),
        Some(why.to_owned()),
    )
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning};

    use super::*;

    fn spec() -> PodSpec {
        serde_json::from_value(serde_json::json!({
            "initContainers": [
                {"name": "init"},
                {"name": "side", "restartPolicy": "Always"},
            ],
            "containers": [{"name": "a"}, {"name": "b"}],
        }))
        .unwrap()
    }

    fn cs(name: &str, ready: bool, started: bool, running: bool) -> ApiContainerStatus {
        ApiContainerStatus {
            name: name.into(),
            ready,
            started: Some(started),
            state: running.then(|| ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..ContainerState::default()
            }),
            ..ApiContainerStatus::default()
        }
    }

    /// Statuses of a case.
    type Statuses<'a> = Vec<&'a ApiContainerStatus>;
    /// A condition's (status, reason, message).
    type Want = (&'static str, Option<String>, Option<String>);

    fn short(c: &PodCondition) -> (String, Option<String>, Option<String>) {
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    fn s(v: &str) -> Option<String> {
        Some(v.to_owned())
    }

    #[test]
    fn containers_ready_and_ready_say_what_the_kubelet_says() {
        let spec = spec();
        let (init, side_up, side_down) = (
            cs("init", true, false, false),
            cs("side", true, true, true),
            cs("side", false, true, true),
        );
        let (a_up, a_down, b_down) = (
            cs("a", true, true, true),
            cs("a", false, true, true),
            cs("b", false, false, false),
        );
        let b_up = cs("b", true, true, true);
        // (statuses, phase, ContainersReady (status, reason, message))
        let cases: Vec<(Statuses, &str, Want)> = vec![
            (
                vec![&init, &side_down, &a_down, &b_down],
                "Running",
                (
                    "False",
                    s("ContainersNotReady"),
                    s("containers with unready status: [side a b]"),
                ),
            ),
            (
                vec![&init, &side_up, &a_up],
                "Running",
                (
                    "False",
                    s("ContainersNotReady"),
                    s("containers with unknown status: [b]"),
                ),
            ),
            (
                vec![&init, &side_up, &a_up, &b_up],
                "Running",
                ("True", None, None),
            ),
            (
                vec![&init, &side_down, &a_down, &b_down],
                "Succeeded",
                ("False", s("PodCompleted"), None),
            ),
            (
                vec![&init, &side_down, &a_down, &b_down],
                "Failed",
                ("False", s("PodFailed"), None),
            ),
        ];
        for (i, (statuses, phase, (status, reason, msg))) in cases.into_iter().enumerate() {
            let cr = containers_ready(&spec, &statuses, phase);
            assert_eq!(cr.type_, "ContainersReady");
            assert_eq!(
                short(&cr),
                (status.to_owned(), reason.clone(), msg.clone()),
                "case {i}"
            );
            // Ready copies it while it is not True.
            let ready = pod_ready(&spec, &cr, &[]);
            assert_eq!(ready.type_, "Ready");
            assert_eq!(short(&ready), (status.to_owned(), reason, msg), "case {i}");
        }
    }

    #[test]
    fn ready_names_each_readiness_gate_not_true() {
        let mut spec = spec();
        spec.readiness_gates = Some(
            ["lb", "neg", "ok"]
                .iter()
                .map(|g| k8s_openapi::api::core::v1::PodReadinessGate {
                    condition_type: format!("example.com/{g}"),
                })
                .collect(),
        );
        let cr = condition("ContainersReady", true, None, None);
        let others = [
            condition("example.com/neg", false, None, None),
            condition("example.com/ok", true, None, None),
        ];
        assert_eq!(
            short(&pod_ready(&spec, &cr, &others)),
            (
                "False".into(),
                s("ReadinessGatesNotReady"),
                s(
                    "corresponding condition of pod readiness gate \"example.com/lb\" does not exist., the status of pod readiness gate \"example.com/neg\" is not \"True\", but False"
                )
            )
        );
        spec.readiness_gates = None;
        assert_eq!(
            short(&pod_ready(&spec, &cr, &[])),
            ("True".into(), None, None)
        );
    }

    #[test]
    fn initialized_table() {
        let spec = spec();
        let init_done = cs("init", true, false, false);
        let init_running = cs("init", false, true, true);
        let side_started = cs("side", false, true, true);
        let side_waiting = cs("side", false, false, false);
        let app_running = cs("a", false, true, true);
        let app_waiting = cs("a", false, false, false);
        // (init, apps, phase, (status, reason, message))
        let cases: Vec<(Statuses, Statuses, &str, Want)> = vec![
            (
                vec![&init_running, &side_waiting],
                vec![&app_waiting],
                "Pending",
                (
                    "False",
                    s("ContainersNotInitialized"),
                    s("containers with incomplete status: [init side]"),
                ),
            ),
            (
                vec![&init_done],
                vec![&app_waiting],
                "Pending",
                (
                    "False",
                    s("ContainersNotInitialized"),
                    s("containers with unknown status: [side]"),
                ),
            ),
            (
                vec![&init_done, &side_started],
                vec![&app_waiting],
                "Pending",
                ("True", None, None),
            ),
            // An app container ran: initialized, whatever the init containers.
            (
                vec![&init_running, &side_waiting],
                vec![&app_running],
                "Running",
                ("True", None, None),
            ),
            (
                vec![&init_done, &side_waiting],
                vec![&app_waiting],
                "Succeeded",
                ("True", s("PodCompleted"), None),
            ),
        ];
        for (i, (init, apps, phase, (status, reason, msg))) in cases.into_iter().enumerate() {
            let c = initialized(&spec, &init, &apps, phase);
            assert_eq!(c.type_, "Initialized");
            assert_eq!(short(&c), (status.to_owned(), reason, msg), "case {i}");
        }
    }

    /// The whole status generation gives these conditions.
    #[test]
    fn generated_statuses_carry_the_kubelet_s_reasons_and_messages() {
        use crate::status::generate::{Context, generate};
        use evpleg_core::container::{ContainerState as Rt, ContainerStatus, PodStatus};
        use evpleg_core::ids::ContainerId;
        use evpleg_core::lifecycle::EventSource;
        use k8s_openapi::api::core::v1::Pod;
        let ctx = Context {
            host_ip: "10.0.0.1",
            runtime: "containerd",
            ..Context::default()
        };
        let pod = |init: bool| -> Pod {
            let inits = if init {
                serde_json::json!([{"name": "init", "image": "x"}])
            } else {
                serde_json::json!([])
            };
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "namespace": "default", "uid": "a".repeat(32)},
                "spec": {"restartPolicy": "Never", "initContainers": inits,
                         "containers": [{"name": "app", "image": "x"}]}
            }))
            .unwrap()
        };
        let of = |s: &k8s_openapi::api::core::v1::PodStatus, kind: &str| {
            short(
                s.conditions
                    .iter()
                    .flatten()
                    .find(|c| c.type_ == kind)
                    .unwrap(),
            )
        };
        // Pending: nothing ran yet.
        let st = generate(&pod(true), &PodStatus::default(), &ctx);
        assert_eq!(
            of(&st, "Initialized"),
            (
                "False".into(),
                s("ContainersNotInitialized"),
                s("containers with incomplete status: [init]")
            )
        );
        let not_ready = (
            "False".to_owned(),
            s("ContainersNotReady"),
            s("containers with unready status: [app]"),
        );
        assert_eq!(of(&st, "ContainersReady"), not_ready);
        assert_eq!(of(&st, "Ready"), not_ready);
        // Failed: the app exited 1 under Never.
        let mut app = ContainerStatus::new(
            ContainerId::parse(&format!("{:064x}", 1)).unwrap(),
            "app",
            Rt::Exited,
            EventSource::Relist,
        );
        app.exit_code = Some(1);
        app.started_at = Some(1_700_000_000_000_000_000);
        app.finished_at = Some(1_700_000_001_000_000_000);
        let runtime = PodStatus {
            containers: vec![app],
            ..PodStatus::default()
        };
        let st = generate(&pod(false), &runtime, &ctx);
        assert_eq!(st.phase.as_deref(), Some("Failed"));
        let failed = ("False".to_owned(), s("PodFailed"), None);
        assert_eq!(of(&st, "ContainersReady"), failed);
        assert_eq!(of(&st, "Ready"), failed);
    }

    /// `PodSandboxChanged`'s reasons as the condition's message.
    #[test]
    fn ready_to_start_containers_table() {
        use SandboxState::{NotReady, Ready};
        let sb = |attempt: u32, state: SandboxState| SandboxStatus {
            id: evpleg_core::ids::ContainerId::parse(&format!("{attempt:064x}")).unwrap(),
            state,
            attempt,
            created_at: Some(i64::from(attempt)),
            ip: None,
            pid: None,
        };
        let not_ready = |why: &str| ("False", s("PodSandboxNotReady"), s(why));
        let cases: Vec<(Vec<SandboxStatus>, Want)> = vec![
            (vec![sb(0, Ready)], ("True", None, None)),
            // The old one stopped, the new one ready.
            (vec![sb(1, Ready), sb(0, NotReady)], ("True", None, None)),
            // A finished pod's sandbox, stopped.
            (vec![sb(0, NotReady)], not_ready("pod sandbox is not ready")),
            (vec![], not_ready("no pod sandbox exists")),
            (
                vec![sb(0, Ready), sb(1, Ready)],
                not_ready("multiple pod sandboxes are ready and need to be reconciled"),
            ),
            // The newest is not ready: a new one is needed.
            (
                vec![sb(0, Ready), sb(1, NotReady)],
                not_ready("pod sandbox is not ready"),
            ),
        ];
        for (i, (sandboxes, (status, reason, msg))) in cases.into_iter().enumerate() {
            let c = ready_to_start_containers(&sandboxes);
            assert_eq!(c.type_, "PodReadyToStartContainers");
            assert_eq!(short(&c), (status.to_owned(), reason, msg), "case {i}");
        }
    }
}

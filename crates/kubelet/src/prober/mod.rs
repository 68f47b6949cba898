//! The prober manager, the kubelet's `pkg/kubelet/prober`: one worker per
//! (pod, container, probe kind) for the startup, liveness and readiness probes
//! of a pod's containers; the results each keeps ([`Results`], the kubelet's
//! `results.Manager`), read by SyncPod (a failed liveness or startup probe
//! kills the container: [`probe_kills`]) and by status generation (`ready`,
//! `started`); a changed result is a pod sync trigger, as a PLEG event is.
//!
//! As the kubelet: a new container starts with readiness Failure, liveness
//! Success and startup Unknown; a container that is not running is Failure;
//! startup gates liveness and readiness until it succeeded; a result only
//! changes after `successThreshold` / `failureThreshold` equal results in a
//! row; after a liveness or startup failure the worker holds until the
//! container is replaced; a running container not ready yet has its readiness
//! probe run at once when its status is generated
//! ([`Results::trigger_readiness`], the kubelet's `manualTriggerCh`), not a
//! period after its start; once the pod terminates, the liveness and startup
//! workers of its app containers stop ([`Results::stop_liveness_and_startup`]).
//! Difference: the worker reads the container from the PLEG's cache (the
//! runtime's view, with the kernel's deaths laid over it), not from the
//! status manager; so a container it saw not running gets a Failure that
//! kills nothing ([`Results::set_not_running`]: a kernel death the runtime
//! contradicts shows a running container exited for a moment), and the
//! worker puts its counter's result back once it sees it running again.

pub mod handlers;
pub mod http;
pub mod tls;
pub mod worker;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Pod, Probe};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::kuberuntime::actions::{Kill, PodActions, RestartPolicy, is_sidecar, latest};
use evpleg_core::cache::PodStatusCache;
use evpleg_core::container::{ContainerState, PodStatus};
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_cri::CriClient;

/// Which probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProbeKind {
    Startup,
    Liveness,
    Readiness,
}

impl ProbeKind {
    pub const ALL: [Self; 3] = [Self::Startup, Self::Liveness, Self::Readiness];

    /// The container's probe of this kind.
    pub fn of(self, c: &k8s_openapi::api::core::v1::Container) -> Option<&Probe> {
        match self {
            Self::Startup => c.startup_probe.as_ref(),
            Self::Liveness => c.liveness_probe.as_ref(),
            Self::Readiness => c.readiness_probe.as_ref(),
        }
    }

    /// A new container's result (the kubelet's `initialValue`).
    pub fn initial(self) -> ProbeResult {
        match self {
            Self::Startup => ProbeResult::Unknown,
            Self::Liveness => ProbeResult::Success,
            Self::Readiness => ProbeResult::Failure,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Startup => "startup",
            Self::Liveness => "liveness",
            Self::Readiness => "readiness",
        }
    }

    /// The kind as the kubelet's events print it (`probeType`'s `String`).
    pub fn title(self) -> &'static str {
        match self {
            Self::Startup => "Startup",
            Self::Liveness => "Liveness",
            Self::Readiness => "Readiness",
        }
    }
}

/// A probe's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProbeResult {
    Success,
    Failure,
    Unknown,
}

/// The results of every probe, by container id, and the pods whose results
/// changed (the sync loop syncs them).
#[derive(Debug)]
pub struct Results {
    results: Mutex<HashMap<(ContainerId, ProbeKind), ProbeResult>>,
    changed: mpsc::UnboundedSender<PodUid>,
    /// The readiness workers' manual triggers, by pod and container name.
    triggers: Mutex<HashMap<(PodUid, String), Arc<tokio::sync::Notify>>>,
    /// The workers told to stop, by pod, container name and kind.
    stopped: Mutex<std::collections::HashSet<(PodUid, String, ProbeKind)>>,
    /// The Failure results that say only that the worker saw the container
    /// not running ([`Results::set_not_running`]).
    not_running: Mutex<std::collections::HashSet<(ContainerId, ProbeKind)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Results {
    /// Results, and the receiver of the pods to sync when one changes.
    pub fn new() -> (Arc<Self>, mpsc::UnboundedReceiver<PodUid>) {
        let (changed, rx) = mpsc::unbounded_channel();
        (
            Arc::new(Self {
                results: Mutex::default(),
                changed,
                triggers: Mutex::default(),
                stopped: Mutex::default(),
                not_running: Mutex::default(),
            }),
            rx,
        )
    }

    /// The container's result of `kind`, if a worker set one.
    pub fn get(&self, id: &ContainerId, kind: ProbeKind) -> Option<ProbeResult> {
        lock(&self.results).get(&(id.clone(), kind)).copied()
    }

    /// Sets a result; a change asks for a sync of `uid`.
    pub fn set(&self, uid: &PodUid, id: &ContainerId, kind: ProbeKind, result: ProbeResult) {
        lock(&self.not_running).remove(&(id.clone(), kind));
        let old = lock(&self.results).insert((id.clone(), kind), result);
        if old != Some(result) {
            let _ = self.changed.send(uid.clone());
        }
    }

    /// The worker saw the container not running: Failure (the kubelet's
    /// worker on a non-running container), marked as such. Such a failure
    /// kills nothing ([`Results::failed_running`]): for the kubelet, whose
    /// worker reads the runtime's relisted state, a container seen not
    /// running never runs again; here the worker reads the PLEG's cache,
    /// where a kernel death the runtime then contradicts shows the container
    /// exited for a moment (up to `evpleg_pleg::relist::CONFIRM_BOUND`), and
    /// its liveness or startup Failure killed the running container
    /// (`startup-gating`, `startup-fails` in the differential oracle).
    pub fn set_not_running(&self, uid: &PodUid, id: &ContainerId, kind: ProbeKind) {
        self.set(uid, id, kind, ProbeResult::Failure);
        lock(&self.not_running).insert((id.clone(), kind));
    }

    /// Whether the container's `kind` probe failed while it ran (a Failure
    /// not set by [`Results::set_not_running`]): what kills it.
    pub fn failed_running(&self, id: &ContainerId, kind: ProbeKind) -> bool {
        self.get(id, kind) == Some(ProbeResult::Failure)
            && !lock(&self.not_running).contains(&(id.clone(), kind))
    }

    /// Forgets a container's results (its worker stopped).
    pub fn remove(&self, id: &ContainerId, kind: ProbeKind) {
        lock(&self.not_running).remove(&(id.clone(), kind));
        lock(&self.results).remove(&(id.clone(), kind));
    }

    /// The manual trigger of the readiness worker of container `name` of
    /// pod `uid` (the kubelet's `manualTriggerCh`).
    pub fn readiness_trigger(&self, uid: &PodUid, name: &str) -> Arc<tokio::sync::Notify> {
        lock(&self.triggers)
            .entry((uid.clone(), name.to_owned()))
            .or_default()
            .clone()
    }

    /// Asks for a readiness probe now of every running container of the pod
    /// that has a readiness probe and is not ready yet (the kubelet's
    /// `UpdatePodStatus`, at each status generation): a new container is
    /// ready as soon as its probe says so, not a period later. A trigger
    /// while the worker probes is kept for after it (a buffer of one).
    pub fn trigger_readiness(&self, uid: &PodUid, pod: &Pod, status: &PodStatus) {
        for c in probed(pod).filter(|c| c.readiness_probe.is_some()) {
            let waiting = latest(status, &c.name).is_some_and(|s| {
                s.state == ContainerState::Running
                    && self.get(&s.id, ProbeKind::Readiness) != Some(ProbeResult::Success)
            });
            if waiting && let Some(t) = lock(&self.triggers).get(&(uid.clone(), c.name.clone())) {
                t.notify_one();
            }
        }
    }

    /// Forgets a pod's triggers and stops (its workers stopped).
    fn forget_triggers(&self, uid: &PodUid) {
        lock(&self.triggers).retain(|(u, _), _| u != uid);
        lock(&self.stopped).retain(|(u, _, _)| u != uid);
    }

    /// The kubelet's `StopLivenessAndStartup`, at the start of the pod's
    /// termination (`SyncTerminatingPod`): the liveness and startup workers
    /// of its app containers stop, so that no probe kills a container or
    /// records `Unhealthy` while it is being stopped. Readiness goes on,
    /// and so do the sidecars' probes (the kubelet stops only the
    /// `spec.containers`' ones).
    pub fn stop_liveness_and_startup(&self, uid: &PodUid, pod: &Pod) {
        let mut stopped = lock(&self.stopped);
        for c in pod.spec.iter().flat_map(|s| s.containers.iter()) {
            for kind in [ProbeKind::Liveness, ProbeKind::Startup] {
                stopped.insert((uid.clone(), c.name.clone(), kind));
            }
        }
    }

    /// Whether the worker of `kind` of container `name` was told to stop.
    pub fn is_stopped(&self, uid: &PodUid, name: &str, kind: ProbeKind) -> bool {
        lock(&self.stopped).contains(&(uid.clone(), name.to_owned(), kind))
    }

    /// Whether a running container is ready: its readiness probe succeeded,
    /// or it has none (and has started).
    pub fn ready(&self, c: &k8s_openapi::api::core::v1::Container, id: &ContainerId) -> bool {
        self.started(c, id)
            && (c.readiness_probe.is_none()
                || self.get(id, ProbeKind::Readiness) == Some(ProbeResult::Success))
    }

    /// Whether a running container has started: its startup probe succeeded,
    /// or it has none.
    pub fn started(&self, c: &k8s_openapi::api::core::v1::Container, id: &ContainerId) -> bool {
        c.startup_probe.is_none() || self.get(id, ProbeKind::Startup) == Some(ProbeResult::Success)
    }
}

/// The kills a failed liveness or startup probe asks for, added to SyncPod's
/// actions (the kubelet's `computePodActions` and, for sidecars,
/// `computeInitContainerActions`): the container is killed with the
/// kubelet's message and started again if the restart policy says so
/// (through the usual back-off); a sidecar always restarts.
pub fn probe_kills(pod: &Pod, status: &PodStatus, results: &Results, actions: &mut PodActions) {
    if actions.kill_pod || actions.create_sandbox || actions.terminal.is_some() {
        return;
    }
    let Some(spec) = pod.spec.as_ref() else {
        return;
    };
    let restarts = RestartPolicy::of(pod) != RestartPolicy::Never;
    let sidecars = spec
        .init_containers
        .iter()
        .flatten()
        .enumerate()
        .filter(|(_, c)| is_sidecar(c))
        .map(|(i, c)| (c, Slot::Init(i)));
    let apps = spec
        .containers
        .iter()
        .enumerate()
        .map(|(j, c)| (c, Slot::App(j)));
    for (c, slot) in sidecars.chain(apps) {
        let Some(s) = latest(status, &c.name).filter(|s| s.state == ContainerState::Running) else {
            continue;
        };
        if actions.kill.iter().any(|k| k.id == s.id) {
            continue;
        }
        // As `computePodActions`: liveness first, then startup.
        let failed = [ProbeKind::Liveness, ProbeKind::Startup]
            .into_iter()
            .find(|k| k.of(c).is_some() && results.failed_running(&s.id, *k));
        let Some(kind) = failed else { continue };
        let reason = match slot {
            Slot::Init(_) => format!("Init container {} failed {} probe", c.name, kind.name()),
            // `computePodActions` adds ", will be restarted" only when the
            // pod's policy restarts it.
            Slot::App(_) if restarts => format!(
                "Container {} failed {} probe, will be restarted",
                c.name,
                kind.name()
            ),
            Slot::App(_) => format!("Container {} failed {} probe", c.name, kind.name()),
        };
        actions.kill.push(Kill {
            id: s.id.clone(),
            name: c.name.clone(),
            reason,
            grace_seconds: kind.of(c).and_then(|p| p.termination_grace_period_seconds),
        });
        match slot {
            Slot::Init(i) if !actions.start_init.contains(&i) => actions.start_init.push(i),
            Slot::App(j) if restarts && !actions.start.contains(&j) => actions.start.push(j),
            _ => {}
        }
    }
}

/// Where a probed container is in the spec.
#[derive(Clone, Copy)]
enum Slot {
    Init(usize),
    App(usize),
}

/// The containers of a pod whose probes run: the app containers and the
/// sidecars (restartable init containers), as the kubelet's `AddPod`.
fn probed(pod: &Pod) -> impl Iterator<Item = &k8s_openapi::api::core::v1::Container> {
    let spec = pod.spec.as_ref();
    let sidecars = spec
        .and_then(|s| s.init_containers.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| is_sidecar(c));
    sidecars.chain(spec.into_iter().flat_map(|s| s.containers.iter()))
}

/// Starts and stops the probe workers of the pods.
#[derive(Debug)]
pub struct ProberManager {
    results: Arc<Results>,
    cache: Arc<PodStatusCache>,
    cri: CriClient,
    /// The address probes reach a host-network pod at (the node's IP).
    host_ip: String,
    events: evpleg_record::Recorder,
    workers: Mutex<HashMap<PodUid, Vec<JoinHandle<()>>>>,
}

impl ProberManager {
    pub fn new(
        results: Arc<Results>,
        cache: Arc<PodStatusCache>,
        cri: CriClient,
        host_ip: String,
        events: evpleg_record::Recorder,
    ) -> Self {
        Self {
            results,
            cache,
            cri,
            host_ip,
            events,
            workers: Mutex::default(),
        }
    }

    /// Starts the workers of a pod's probes (the kubelet's `AddPod`); a pod
    /// already known keeps its workers.
    pub fn add_pod(&self, uid: &PodUid, pod: &Arc<Pod>) {
        let mut workers = lock(&self.workers);
        if workers.contains_key(uid) {
            return;
        }
        let mut tasks = Vec::new();
        for c in probed(pod) {
            for kind in ProbeKind::ALL {
                let Some(probe) = kind.of(c) else { continue };
                let w = worker::Worker {
                    uid: uid.clone(),
                    pod: pod.clone(),
                    container: c.clone(),
                    kind,
                    probe: probe.clone(),
                    results: self.results.clone(),
                    cache: self.cache.clone(),
                    handler: handlers::Handlers {
                        cri: self.cri.clone(),
                        host_ip: self.host_ip.clone(),
                    },
                    events: self.events.clone(),
                };
                tasks.push(tokio::spawn(w.run()));
            }
        }
        if !tasks.is_empty() {
            workers.insert(uid.clone(), tasks);
        }
    }

    /// Stops a pod's workers (the kubelet's `RemovePod`); their results go
    /// with the containers.
    pub fn remove_pod(&self, uid: &PodUid) {
        if let Some(tasks) = lock(&self.workers).remove(uid) {
            for t in tasks {
                t.abort();
            }
        }
        self.results.forget_triggers(uid);
    }
}

impl Drop for ProberManager {
    fn drop(&mut self) {
        for (_, tasks) in lock(&self.workers).drain() {
            for t in tasks {
                t.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::container::ContainerStatus;
    use evpleg_core::lifecycle::EventSource;

    fn pod(policy: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "uid": "a".repeat(32)},
            "spec": {
                "restartPolicy": policy,
                "containers": [
                    {"name": "live", "livenessProbe": {"exec": {"command": ["true"]}, "terminationGracePeriodSeconds": 4}},
                    {"name": "start", "startupProbe": {"exec": {"command": ["true"]}}},
                    {"name": "plain"},
                ]
            }
        }))
        .unwrap()
    }

    fn running(n: u8, name: &str) -> ContainerStatus {
        let id = ContainerId::parse(&format!("{n:064x}")).unwrap();
        ContainerStatus::new(id, name, ContainerState::Running, EventSource::Relist)
    }

    /// `StopLivenessAndStartup` (#27, item 10): a terminating pod's liveness
    /// and startup workers of its `spec.containers` stop; readiness goes on,
    /// and so do a sidecar's probes.
    #[test]
    fn termination_stops_liveness_and_startup_of_the_app_containers_only() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "uid": "a".repeat(32)},
            "spec": {"initContainers": [{"name": "side", "restartPolicy": "Always"}],
                     "containers": [{"name": "app"}]}
        }))
        .unwrap();
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let (results, _changed) = Results::new();
        results.stop_liveness_and_startup(&uid, &pod);
        let rows = [
            ("app", ProbeKind::Liveness, true),
            ("app", ProbeKind::Startup, true),
            ("app", ProbeKind::Readiness, false),
            ("side", ProbeKind::Liveness, false),
            ("side", ProbeKind::Startup, false),
        ];
        for (name, kind, stopped) in rows {
            assert_eq!(
                results.is_stopped(&uid, name, kind),
                stopped,
                "{name} {kind:?}"
            );
        }
    }
    #[test]
    fn failed_liveness_and_startup_probes_kill_and_restart_per_policy() {
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let status = PodStatus {
            containers: vec![running(1, "live"), running(2, "start"), running(3, "plain")],
            ..PodStatus::default()
        };
        let (results, mut changed) = Results::new();
        let id = |n: u8| ContainerId::parse(&format!("{n:064x}")).unwrap();
        // (liveness of `live`, startup of `start`, policy) -> (killed, started)
        let cases = [
            (
                ProbeResult::Success,
                ProbeResult::Unknown,
                "Always",
                vec![],
                vec![],
            ),
            (
                ProbeResult::Failure,
                ProbeResult::Unknown,
                "Always",
                vec!["live"],
                vec![0],
            ),
            (
                ProbeResult::Failure,
                ProbeResult::Failure,
                "OnFailure",
                vec!["live", "start"],
                vec![0, 1],
            ),
            (
                ProbeResult::Failure,
                ProbeResult::Success,
                "Never",
                vec!["live"],
                vec![],
            ),
        ];
        for (live, start, policy, killed, started) in cases {
            results.set(&uid, &id(1), ProbeKind::Liveness, live);
            results.set(&uid, &id(2), ProbeKind::Startup, start);
            // A result of a probe the container does not have is ignored.
            results.set(&uid, &id(3), ProbeKind::Liveness, ProbeResult::Failure);
            let mut actions = PodActions::default();
            probe_kills(&pod(policy), &status, &results, &mut actions);
            let names: Vec<_> = actions.kill.iter().map(|k| k.name.as_str()).collect();
            assert_eq!(
                (names, actions.start.clone()),
                (killed.clone(), started),
                "{policy}"
            );
            if let Some(k) = actions.kill.first() {
                // Under Never nothing restarts, and the event does not say so.
                let want = match policy {
                    "Never" => "Container live failed liveness probe",
                    _ => "Container live failed liveness probe, will be restarted",
                };
                assert_eq!(k.reason, want, "{policy}");
                assert_eq!(k.grace_seconds, Some(4), "the probe's own grace period");
            }
        }
        assert!(
            changed.try_recv().is_ok(),
            "a changed result asks for a sync"
        );
        // Unchanged results ask for nothing more.
        while changed.try_recv().is_ok() {}
        results.set(&uid, &id(1), ProbeKind::Liveness, ProbeResult::Failure);
        assert!(changed.try_recv().is_err());
    }

    /// A Failure that says only that the worker saw the container not
    /// running (a kernel death the runtime then contradicted) kills nothing;
    /// a probe's own Failure does, and replaces it.
    #[test]
    fn a_not_running_failure_kills_no_running_container() {
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let id = |n: u8| ContainerId::parse(&format!("{n:064x}")).unwrap();
        let status = PodStatus {
            containers: vec![running(1, "live"), running(2, "start")],
            ..PodStatus::default()
        };
        // (liveness of `live` seen not running, startup of `start` seen not
        // running, then a probe's own failure of `start`) -> killed
        let cases: [(bool, bool, bool, &[&str]); 4] = [
            (false, false, false, &[]),
            (true, false, false, &[]),
            (true, true, false, &[]),
            (true, true, true, &["start"]),
        ];
        for (live, start, probed, killed) in cases {
            let (results, _changed) = Results::new();
            if live {
                results.set_not_running(&uid, &id(1), ProbeKind::Liveness);
            }
            if start {
                results.set_not_running(&uid, &id(2), ProbeKind::Startup);
            }
            if probed {
                results.set(&uid, &id(2), ProbeKind::Startup, ProbeResult::Failure);
            }
            let mut actions = PodActions::default();
            probe_kills(&pod("Always"), &status, &results, &mut actions);
            let names: Vec<_> = actions.kill.iter().map(|k| k.name.as_str()).collect();
            assert_eq!(names, killed, "{live} {start} {probed}");
            // Either way the container is not ready while it is failed.
            if live {
                assert_eq!(
                    results.get(&id(1), ProbeKind::Liveness),
                    Some(ProbeResult::Failure)
                );
            }
        }
    }

    /// A sidecar's failed liveness or startup probe kills it with the
    /// kubelet's init-container message, and it starts again whatever the
    /// pod's policy; a plain init container is never probed.
    #[test]
    fn a_sidecar_s_failed_probe_kills_and_restarts_it_under_any_policy() {
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let id = |n: u8| ContainerId::parse(&format!("{n:064x}")).unwrap();
        for (kind, policy) in [
            (ProbeKind::Liveness, "Never"),
            (ProbeKind::Startup, "Always"),
        ] {
            let pod: Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "uid": "a".repeat(32)},
                "spec": {
                    "restartPolicy": policy,
                    "initContainers": [
                        {"name": "init"},
                        {"name": "side", "restartPolicy": "Always",
                         "livenessProbe": {"exec": {"command": ["true"]}},
                         "startupProbe": {"exec": {"command": ["true"]}, "terminationGracePeriodSeconds": 7}},
                    ],
                    "containers": [{"name": "app"}]
                }
            }))
            .unwrap();
            assert_eq!(
                probed(&pod).map(|c| c.name.as_str()).collect::<Vec<_>>(),
                ["side", "app"]
            );
            let status = PodStatus {
                containers: vec![running(2, "side"), running(3, "app")],
                ..PodStatus::default()
            };
            let (results, _changed) = Results::new();
            results.set(&uid, &id(2), kind, ProbeResult::Failure);
            let mut actions = PodActions::default();
            probe_kills(&pod, &status, &results, &mut actions);
            assert_eq!(actions.kill.len(), 1, "{kind:?}");
            assert_eq!(
                actions.kill[0].reason,
                format!("Init container side failed {} probe", kind.name())
            );
            assert_eq!(
                actions.kill[0].grace_seconds,
                (kind == ProbeKind::Startup).then_some(7)
            );
            assert_eq!(
                (actions.start_init.clone(), actions.start.clone()),
                (vec![1], vec![])
            );
        }
    }
}

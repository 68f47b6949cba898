//! One probe worker (the kubelet's `worker.go`): every `periodSeconds` (and,
//! for readiness, when triggered: `manualTriggerCh`) it finds
//! the container's newest instance in the PLEG's cache, decides whether to
//! probe it ([`Decision`]), runs the probe, and feeds the outcome to its
//! [`Counter`], which changes the published result only after
//! `successThreshold` / `failureThreshold` equal outcomes in a row.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Pod, Probe};
use tracing::{debug, info};

use super::handlers::{Handlers, Outcome};
use super::{ProbeKind, ProbeResult, Results};
use crate::kuberuntime::actions::latest;
use evpleg_core::cache::PodStatusCache;
use evpleg_core::container::ContainerState;
use evpleg_core::ids::{ContainerId, PodUid};

/// The thresholds, with the kubelet's defaults (1 and 3; liveness and
/// startup need `successThreshold` 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thresholds {
    pub success: u32,
    pub failure: u32,
}

impl Thresholds {
    pub fn of(probe: &Probe) -> Self {
        Self {
            success: probe.success_threshold.unwrap_or(1).max(1) as u32,
            failure: probe.failure_threshold.unwrap_or(3).max(1) as u32,
        }
    }
}

/// Consecutive outcomes of one container's probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counter {
    kind: ProbeKind,
    thresholds: Thresholds,
    /// The published result.
    pub result: ProbeResult,
    last: ProbeResult,
    run: u32,
    /// A liveness or startup failure was published: no more probing until
    /// the container is replaced.
    pub on_hold: bool,
}

impl Counter {
    /// A new container's counter, at the kind's initial result.
    pub fn new(kind: ProbeKind, thresholds: Thresholds) -> Self {
        Self {
            kind,
            thresholds,
            result: kind.initial(),
            last: ProbeResult::Unknown,
            run: 0,
            on_hold: false,
        }
    }

    /// One outcome; returns the new published result when it changed.
    pub fn observe(&mut self, outcome: ProbeResult) -> Option<ProbeResult> {
        if self.on_hold {
            return None;
        }
        if outcome == self.last {
            self.run = self.run.saturating_add(1);
        } else {
            self.last = outcome;
            self.run = 1;
        }
        let needed = match outcome {
            ProbeResult::Success => self.thresholds.success,
            ProbeResult::Failure => self.thresholds.failure,
            ProbeResult::Unknown => return None,
        };
        if self.run < needed || outcome == self.result {
            return None;
        }
        self.result = outcome;
        if outcome == ProbeResult::Failure
            && matches!(self.kind, ProbeKind::Liveness | ProbeKind::Startup)
        {
            self.on_hold = true;
            self.run = 0;
        }
        Some(outcome)
    }
}

/// What a worker does at a tick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No container yet (or the pod is not in the cache).
    Wait,
    /// The container has ended (or its state is unknown): its result is
    /// Failure.
    NotRunning(ContainerId),
    /// A startup probe has not succeeded yet (liveness, readiness), or has
    /// (startup), or the initial delay has not passed, or the container is
    /// created but not started yet: keep the result.
    Skip(ContainerId),
    Probe(ContainerId),
}

/// The decision for a container instance seen at `now_ns` (Unix).
pub fn decide(
    kind: ProbeKind,
    probe: &Probe,
    container: &Container,
    instance: Option<(ContainerId, ContainerState, Option<i64>)>,
    started: bool,
    now_ns: i64,
) -> Decision {
    let Some((id, state, started_at)) = instance else {
        return Decision::Wait;
    };
    // Created, not yet started: the runtime's view between CreateContainer
    // and StartContainer, which a relist can catch. The kubelet's worker
    // takes any non-running state as Failure, but its status manager
    // rarely shows a container in that window; here the cache does, and a
    // Failure laid on the instance then killed it as soon as it ran
    // (liveness, `tests/fidelity/liveness-http-passes.yaml`). It keeps its
    // initial result until it runs or ends.
    if state == ContainerState::Created {
        return Decision::Skip(id);
    }
    if state != ContainerState::Running {
        return Decision::NotRunning(id);
    }
    let gated = match kind {
        ProbeKind::Startup => started,
        _ => container.startup_probe.is_some() && !started,
    };
    let delay = i64::from(probe.initial_delay_seconds.unwrap_or(0).max(0)) * 1_000_000_000;
    let early = started_at.is_some_and(|t| now_ns < t.saturating_add(delay));
    if gated || early {
        Decision::Skip(id)
    } else {
        Decision::Probe(id)
    }
}

/// A running worker's parts.
#[derive(Debug)]
pub struct Worker {
    pub uid: PodUid,
    pub pod: Arc<Pod>,
    pub container: Container,
    pub kind: ProbeKind,
    pub probe: Probe,
    pub results: Arc<Results>,
    pub cache: Arc<PodStatusCache>,
    pub handler: Handlers,
    /// Failed probes are recorded as `Unhealthy` events, as the kubelet does.
    pub events: evpleg_record::Recorder,
}

impl Worker {
    /// Probes every period until aborted.
    pub async fn run(self) {
        let period = Duration::from_secs(self.probe.period_seconds.unwrap_or(10).max(1) as u64);
        let thresholds = Thresholds::of(&self.probe);
        let mut current: Option<(ContainerId, Counter)> = None;
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Readiness is also probed when asked for (the kubelet's
        // `manualTriggerCh`): at once after a start, not a period later.
        let trigger = (self.kind == ProbeKind::Readiness).then(|| {
            self.results
                .readiness_trigger(&self.uid, &self.container.name)
        });
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = async {
                    match &trigger {
                        Some(t) => t.notified().await,
                        None => std::future::pending().await,
                    }
                } => debug!(container = %self.container.name, "readiness probe triggered"),
            }
            if self.stopped() {
                return;
            }
            let entry = self.cache.get(&self.uid);
            let instance = entry.as_ref().and_then(|e| {
                latest(&e.status, &self.container.name)
                    .map(|c| (c.id.clone(), c.state, c.started_at))
            });
            // A new container instance starts from the initial result.
            if let Some((id, _, _)) = &instance
                && current.as_ref().is_none_or(|(c, _)| c != id)
            {
                if let Some((old, _)) = current.take() {
                    self.results.remove(&old, self.kind);
                }
                let counter = Counter::new(self.kind, thresholds);
                self.results.set(&self.uid, id, self.kind, counter.result);
                current = Some((id.clone(), counter));
            }
            let started = instance
                .as_ref()
                .is_some_and(|(id, _, _)| self.results.started(&self.container, id));
            let now = evpleg_core::clock::wall_clock_ns();
            match decide(
                self.kind,
                &self.probe,
                &self.container,
                instance,
                started,
                now,
            ) {
                Decision::Wait => {}
                Decision::NotRunning(id) => {
                    self.results.set_not_running(&self.uid, &id, self.kind);
                }
                Decision::Skip(id) => self.restore(current.as_ref(), &id),
                Decision::Probe(id) => {
                    self.restore(current.as_ref(), &id);
                    let Some((_, counter)) = current.as_mut().filter(|(c, _)| *c == id) else {
                        continue;
                    };
                    if counter.on_hold {
                        continue;
                    }
                    let ips = entry.as_ref().map(|e| e.status.ips.as_slice());
                    let handler = self.handler.at_pod(&self.pod, ips.unwrap_or_default());
                    let outcome = match self.run_with_retries(&handler, &id).await {
                        Ok(outcome) => outcome,
                        Err(e) => {
                            debug!(error = %e, "probe not run; its result is thrown away");
                            // The kubelet's `probe`: an event, no result.
                            if !self.stopped() {
                                self.record_error(&e);
                            }
                            continue;
                        }
                    };
                    // Told to stop while it probed: its outcome is dropped.
                    if self.stopped() {
                        return;
                    }
                    let outcome = self.record(outcome);
                    if let Some(result) = counter.observe(outcome) {
                        info!(
                            pod = %self.uid,
                            name = self.pod.metadata.name.as_deref().unwrap_or("-"),
                            container = %self.container.name,
                            probe = self.kind.name(),
                            ?result,
                            "probe result changed"
                        );
                        self.results.set(&self.uid, &id, self.kind, result);
                    }
                }
            }
        }
    }
}

impl Worker {
    /// The container `id` runs (again): a Failure laid while it was seen not
    /// running (a kernel death the runtime contradicted) gives way to the
    /// counter's published result, which the next outcomes change as usual.
    fn restore(&self, current: Option<&(ContainerId, Counter)>, id: &ContainerId) {
        let Some((_, counter)) = current.filter(|(c, _)| c == id) else {
            return;
        };
        if self.results.get(id, self.kind) != Some(counter.result) {
            debug!(container = %self.container.name, probe = self.kind.name(), "running again: the counter's result restored");
            self.results.set(&self.uid, id, self.kind, counter.result);
        }
    }

    /// The pod terminates: this liveness or startup worker stops
    /// (`StopLivenessAndStartup`).
    fn stopped(&self) -> bool {
        let stop = self
            .results
            .is_stopped(&self.uid, &self.container.name, self.kind);
        if stop {
            debug!(pod = %self.uid, container = %self.container.name, probe = self.kind.name(), "the pod terminates: probe worker stopped");
        }
        stop
    }

    /// The kubelet's `runProbeWithRetries`: a probe that could not run is
    /// tried again, [`MAX_PROBE_RETRIES`] times in all.
    async fn run_with_retries(
        &self,
        handler: &Handlers,
        id: &ContainerId,
    ) -> Result<Outcome, super::handlers::ProbeError> {
        let mut tries = 1;
        loop {
            match handler.run(&self.container, id, &self.probe).await {
                Err(e) if tries < MAX_PROBE_RETRIES => {
                    debug!(error = %e, tries, "probe not run; trying again");
                    tries += 1;
                }
                done => return done,
            }
        }
    }

    /// The kubelet's `prober.probe` for a probe that could not run: a
    /// Warning `Unhealthy` event, `<Kind> probe errored and resulted in
    /// unknown state: <error>`.
    fn record_error(&self, e: &super::handlers::ProbeError) {
        let (reason, message) = errored_event(self.kind, e);
        self.warn(reason, message);
    }

    /// The kubelet's `prober.probe`: a failure is an `Unhealthy` event, a
    /// success with a warning a `ProbeWarning` event (and a success).
    fn record(&self, outcome: Outcome) -> ProbeResult {
        let Some((reason, message, result)) = event_of(self.kind, &outcome) else {
            return ProbeResult::Success;
        };
        self.warn(reason, message);
        result
    }

    /// A Warning event about the probed container.
    fn warn(&self, reason: &'static str, message: String) {
        self.events.record(
            &self.pod,
            Some(&self.container.name),
            evpleg_record::EventType::Warning,
            reason,
            message,
        );
    }
}

/// How many times a probe that could not run is tried (the kubelet's
/// `maxProbeRetries`).
pub const MAX_PROBE_RETRIES: u32 = 3;

/// The event the kubelet records for a probe that could not run (reason,
/// message).
pub fn errored_event(kind: ProbeKind, e: &super::handlers::ProbeError) -> (&'static str, String) {
    (
        evpleg_record::UNHEALTHY,
        format!(
            "{} probe errored and resulted in unknown state: {e}",
            kind.title()
        ),
    )
}

/// The event the kubelet records for a probe's outcome (reason, message)
/// and the result it counts; `None` for a plain success (no event).
pub fn event_of(kind: ProbeKind, outcome: &Outcome) -> Option<(&'static str, String, ProbeResult)> {
    let title = kind.title();
    match outcome {
        Outcome::Success => None,
        Outcome::Warning(why) => Some((
            evpleg_record::PROBE_WARNING,
            format!("{title} probe warning: {why}"),
            ProbeResult::Success,
        )),
        Outcome::Failure(why) => Some((
            evpleg_record::UNHEALTHY,
            format!("{title} probe failed: {why}"),
            ProbeResult::Failure,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ProbeResult::{Failure as F, Success as S, Unknown as U};

    fn thresholds(success: u32, failure: u32) -> Thresholds {
        Thresholds { success, failure }
    }

    /// Outcomes in, published results out, per kind and thresholds.
    #[test]
    fn the_counter_publishes_after_the_thresholds_and_holds_after_a_kill() {
        type Case = (
            ProbeKind,
            Thresholds,
            &'static [ProbeResult],
            &'static [Option<ProbeResult>],
        );
        let cases: &[Case] = &[
            // Readiness starts Failure: one success (threshold 1) makes it ready;
            // three failures in a row make it unready again, not two.
            (
                ProbeKind::Readiness,
                thresholds(1, 3),
                &[S, F, F, S, F, F, F],
                &[Some(S), None, None, None, None, None, Some(F)],
            ),
            // successThreshold 2: two successes in a row.
            (
                ProbeKind::Readiness,
                thresholds(2, 1),
                &[S, F, S, S, S],
                &[None, None, None, Some(S), None],
            ),
            // Liveness starts Success; failureThreshold 2; then it holds.
            (
                ProbeKind::Liveness,
                thresholds(1, 2),
                &[F, S, F, F, S, F, F],
                &[None, None, None, Some(F), None, None, None],
            ),
            // Startup starts Unknown: one success publishes it; Unknown outcomes change nothing.
            (
                ProbeKind::Startup,
                thresholds(1, 3),
                &[U, S, S],
                &[None, Some(S), None],
            ),
            (
                ProbeKind::Startup,
                thresholds(1, 1),
                &[F, S],
                &[Some(F), None],
            ),
        ];
        for (kind, th, outcomes, want) in cases {
            let mut c = Counter::new(*kind, *th);
            let got: Vec<_> = outcomes.iter().map(|o| c.observe(*o)).collect();
            assert_eq!(&got, want, "{kind:?} {th:?} {outcomes:?}");
        }
    }

    #[test]
    fn outcomes_are_recorded_as_the_kubelet_records_them() {
        let cases = [
            (ProbeKind::Readiness, Outcome::Success, None),
            (
                ProbeKind::Readiness,
                Outcome::Warning("Probe terminated redirects, Response body: x".into()),
                Some((
                    "ProbeWarning",
                    "Readiness probe warning: Probe terminated redirects, Response body: x",
                    S,
                )),
            ),
            (
                ProbeKind::Liveness,
                Outcome::Failure("HTTP probe failed with statuscode: 500".into()),
                Some((
                    "Unhealthy",
                    "Liveness probe failed: HTTP probe failed with statuscode: 500",
                    F,
                )),
            ),
            (
                ProbeKind::Startup,
                Outcome::Warning("w".into()),
                Some(("ProbeWarning", "Startup probe warning: w", S)),
            ),
        ];
        for (kind, outcome, want) in cases {
            let got = event_of(kind, &outcome);
            let got = got.as_ref().map(|(r, m, res)| (*r, m.as_str(), *res));
            assert_eq!(got, want, "{kind:?} {outcome:?}");
        }
    }

    #[test]
    fn decisions() {
        let id = ContainerId::parse(&"c".repeat(64)).unwrap();
        let probe: Probe =
            serde_json::from_value(serde_json::json!({"initialDelaySeconds": 5})).unwrap();
        let plain = Container::default();
        let gated: Container =
            serde_json::from_value(serde_json::json!({"name": "c", "startupProbe": {}})).unwrap();
        let s = 1_000_000_000i64;
        let run = |state| Some((id.clone(), state, Some(10 * s)));
        use ContainerState::{Created, Exited, Running};
        let cases = [
            (
                ProbeKind::Liveness,
                &plain,
                run(Created),
                false,
                20,
                Decision::Skip(id.clone()),
            ),
            (
                ProbeKind::Readiness,
                &plain,
                None,
                false,
                20,
                Decision::Wait,
            ),
            (
                ProbeKind::Readiness,
                &plain,
                run(Exited),
                false,
                20,
                Decision::NotRunning(id.clone()),
            ),
            (
                ProbeKind::Readiness,
                &plain,
                run(Running),
                false,
                14,
                Decision::Skip(id.clone()),
            ),
            (
                ProbeKind::Readiness,
                &plain,
                run(Running),
                false,
                15,
                Decision::Probe(id.clone()),
            ),
            (
                ProbeKind::Liveness,
                &gated,
                run(Running),
                false,
                20,
                Decision::Skip(id.clone()),
            ),
            (
                ProbeKind::Liveness,
                &gated,
                run(Running),
                true,
                20,
                Decision::Probe(id.clone()),
            ),
            (
                ProbeKind::Startup,
                &gated,
                run(Running),
                false,
                20,
                Decision::Probe(id.clone()),
            ),
            (
                ProbeKind::Startup,
                &gated,
                run(Running),
                true,
                20,
                Decision::Skip(id.clone()),
            ),
        ];
        for (kind, c, instance, started, now, want) in cases {
            assert_eq!(
                decide(kind, &probe, c, instance.clone(), started, now * s),
                want,
                "{kind:?} {instance:?} started={started} now={now}"
            );
        }
    }
}

#[cfg(test)]
mod stop_tests {
    use std::time::Instant;

    use super::*;
    use evpleg_core::clock::ManualClock;
    use evpleg_core::container::{ContainerStatus, PodStatus};
    use evpleg_core::lifecycle::EventSource;

    /// `StopLivenessAndStartup`: once the pod terminates, a failing liveness
    /// probe records no more `Unhealthy` events and its worker ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_terminating_pod_s_liveness_worker_stops_and_stays_quiet() {
        // A port nothing listens on: every probe fails (connection refused).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pod: Arc<Pod> = Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "web", "namespace": "default", "uid": "a".repeat(32)},
                "spec": {"containers": [{"name": "app", "livenessProbe": {
                    "tcpSocket": {"host": "127.0.0.1", "port": port},
                    "periodSeconds": 1, "failureThreshold": 100}}]}
            }))
            .unwrap(),
        );
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let id = ContainerId::parse(&format!("{:064x}", 1)).unwrap();
        let cache = Arc::new(PodStatusCache::new());
        let status = PodStatus {
            containers: vec![ContainerStatus::new(
                id,
                "app",
                ContainerState::Running,
                EventSource::Relist,
            )],
            ..PodStatus::default()
        };
        cache.set(&uid, status, 1);
        let (results, _changed) = Results::new();
        let events = evpleg_record::Recorder::new(
            "n",
            Arc::new(ManualClock::new(1)),
            Default::default(),
            None,
        );
        let cri = evpleg_cri::CriClient::connect_unchecked(
            "unix:///nonexistent/evpleg-test.sock",
            evpleg_cri::CriClientConfig::default(),
        )
        .await
        .unwrap();
        let c = pod.spec.as_ref().unwrap().containers[0].clone();
        let worker = Worker {
            uid: uid.clone(),
            pod: pod.clone(),
            probe: c.liveness_probe.clone().unwrap(),
            container: c,
            kind: ProbeKind::Liveness,
            results: results.clone(),
            cache,
            handler: Handlers {
                cri,
                host_ip: "127.0.0.1".into(),
            },
            events: events.clone(),
        };
        let unhealthy = || {
            events
                .pod_events("default", "web")
                .iter()
                .filter(|e| e.reason == evpleg_record::UNHEALTHY)
                .map(|e| e.count)
                .sum::<u32>()
        };
        let task = tokio::spawn(worker.run());
        let deadline = Instant::now() + Duration::from_secs(10);
        while unhealthy() == 0 {
            assert!(Instant::now() < deadline, "no Unhealthy event within 10 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        results.stop_liveness_and_startup(&uid, &pod);
        let before = unhealthy();
        tokio::time::timeout(Duration::from_secs(3), task)
            .await
            .expect("the worker ends within a period of the stop")
            .unwrap();
        assert_eq!(unhealthy(), before, "no Unhealthy event after the stop");
    }
}

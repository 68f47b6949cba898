//! Pod start latency, as the kubelet measures it:
//!
//! * `pod_start_duration_seconds`: from the agent first seeing the pod (its
//!   `kubernetes.io/config.seen` annotation) to the status manager accepting
//!   the pod's first `Running` phase after `Pending` (the kubelet's `SyncPod`
//!   observes it there too);
//! * `pod_start_sli_duration_seconds{first_with_network}`: the kubelet's
//!   pod-startup SLI (`pod_startup_latency_tracker.go`), from the pod's
//!   creation (its `creationTimestamp`; a static pod, which has none, from
//!   `config.seen`) to the first status with every regular container
//!   running, minus the time spent pulling its images (first pull started to
//!   last pull finished). Each pod is observed once.
//!
//! Both use the kubelet's buckets (0.5 s to 1 h). Differences: the kubelet
//! observes the SLI when the API server's watch shows the pod running; here
//! it is when the status manager accepts that status (the local store, where
//! no API server is). `first_with_network` is always `false`: every pod runs
//! in the host network until the pod network exists. The time init
//! containers run is not subtracted.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::{Pod, PodStatus as ApiPodStatus};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;

use crate::source::annotations::CONFIG_SEEN;
use evpleg_core::ids::PodUid;

/// The kubelet's `podStartupDurationBuckets`.
pub const POD_START_BUCKETS: [f64; 25] = [
    0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0,
    300.0, 360.0, 480.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0,
];

fn histogram() -> Histogram {
    Histogram::new(POD_START_BUCKETS)
}

/// The `first_with_network` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NetworkLabel {
    pub first_with_network: &'static str,
}

/// Image pulls of one pod, Unix ns.
#[derive(Clone, Copy, Debug, Default)]
struct Pulls {
    first_started: i64,
    last_finished: i64,
}

/// The tracker and its histograms.
#[derive(Debug)]
pub struct StartLatency {
    pub duration: Histogram,
    pub sli: Family<NetworkLabel, Histogram, fn() -> Histogram>,
    pulls: Mutex<HashMap<PodUid, Pulls>>,
    /// Pods whose SLI was observed (never twice).
    observed: Mutex<HashSet<PodUid>>,
}

impl Default for StartLatency {
    fn default() -> Self {
        Self {
            duration: histogram(),
            sli: Family::new_with_constructor(histogram),
            pulls: Mutex::default(),
            observed: Mutex::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An RFC 3339 time in Unix ns.
fn parse_ns(text: &str) -> Option<i64> {
    let t: k8s_openapi::jiff::Timestamp = text.parse().ok()?;
    i64::try_from(t.as_nanosecond()).ok()
}

fn seen_ns(pod: &Pod) -> Option<i64> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(CONFIG_SEEN))
        .and_then(|s| parse_ns(s))
}

fn created_ns(pod: &Pod) -> Option<i64> {
    pod.metadata
        .creation_timestamp
        .as_ref()
        .and_then(|t| i64::try_from(t.0.as_nanosecond()).ok())
        .or_else(|| seen_ns(pod))
}

/// Every regular container running (the kubelet's `hasPodStartedSLO`).
fn all_running(pod: &Pod, status: &ApiPodStatus) -> bool {
    let want = pod.spec.as_ref().map_or(0, |s| s.containers.len());
    let running = status
        .container_statuses
        .iter()
        .flatten()
        .filter(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
        .count();
    want > 0 && running >= want
}

impl StartLatency {
    /// An image pull for the pod ran from `started_ns` to `finished_ns`.
    pub fn pulled(&self, uid: &PodUid, started_ns: i64, finished_ns: i64) {
        let mut pulls = lock(&self.pulls);
        let p = pulls.entry(uid.clone()).or_default();
        if p.first_started == 0 || started_ns < p.first_started {
            p.first_started = started_ns;
        }
        p.last_finished = p.last_finished.max(finished_ns);
    }

    /// The status manager accepted `status` for `pod`, whose last phase was
    /// `last_phase`, at `now_ns` (Unix).
    pub fn accepted(
        &self,
        uid: &PodUid,
        pod: &Pod,
        last_phase: Option<&str>,
        status: &ApiPodStatus,
        now_ns: i64,
    ) {
        let running = status.phase.as_deref() == Some("Running");
        if running
            && matches!(last_phase, None | Some("Pending"))
            && let Some(seen) = seen_ns(pod)
        {
            self.duration.observe(secs(now_ns - seen));
        }
        if all_running(pod, status)
            && let Some(created) = created_ns(pod)
            && lock(&self.observed).insert(uid.clone())
        {
            let pulling = lock(&self.pulls)
                .remove(uid)
                .map_or(0, |p| p.last_finished - p.first_started);
            self.sli
                .get_or_create(&NetworkLabel {
                    first_with_network: "false",
                })
                .observe(secs(now_ns - created - pulling));
        }
    }

    /// Forgets a pod that is gone.
    pub fn forget(&self, uid: &PodUid) {
        lock(&self.pulls).remove(uid);
        lock(&self.observed).remove(uid);
    }
}

fn secs(ns: i64) -> f64 {
    ns.max(0) as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, ContainerState, ContainerStateRunning, ContainerStatus, PodSpec,
    };

    const S: i64 = 1_000_000_000;
    /// 2026-01-01T00:00:00Z.
    const T0: i64 = 1_767_225_600 * S;

    fn pod(seen: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.annotations = Some([(CONFIG_SEEN.to_owned(), seen.to_owned())].into());
        p.spec = Some(PodSpec {
            containers: vec![Container::default(), Container::default()],
            ..Default::default()
        });
        p
    }

    fn status(phase: &str, running: usize) -> ApiPodStatus {
        let c = |run: bool| ContainerStatus {
            state: Some(ContainerState {
                running: run.then(ContainerStateRunning::default),
                ..Default::default()
            }),
            ..Default::default()
        };
        ApiPodStatus {
            phase: Some(phase.into()),
            container_statuses: Some((0..2).map(|i| c(i < running)).collect()),
            ..Default::default()
        }
    }

    fn render(t: &StartLatency) -> String {
        let mut r = prometheus_client::registry::Registry::default();
        r.register("start", "", t.duration.clone());
        r.register("sli", "", t.sli.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        text
    }

    #[test]
    fn observed_once_from_seen_and_creation_minus_pulls() {
        let t = StartLatency::default();
        let uid = PodUid::parse(&"a".repeat(32)).unwrap();
        let p = pod("2026-01-01T00:00:00Z");
        // An image pulled for 5 s.
        t.pulled(&uid, T0 + S, T0 + 4 * S);
        t.pulled(&uid, T0 + 2 * S, T0 + 6 * S);
        // Pending, then Running with one of two containers: the start only.
        t.accepted(&uid, &p, None, &status("Pending", 0), T0 + 3 * S);
        t.accepted(&uid, &p, Some("Pending"), &status("Running", 1), T0 + 7 * S);
        let text = render(&t);
        assert!(text.contains("start_sum 7.0\nstart_count 1\n"), "{text}");
        assert!(!text.contains("sli_count"), "{text}");
        // Both running: the SLI, 8 s less the 5 s of pulls; once.
        t.accepted(&uid, &p, Some("Running"), &status("Running", 2), T0 + 8 * S);
        t.accepted(&uid, &p, Some("Running"), &status("Running", 2), T0 + 9 * S);
        let text = render(&t);
        assert!(
            text.contains("sli_sum{first_with_network=\"false\"} 3.0\nsli_count{first_with_network=\"false\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("start_count 1\n"), "{text}");
    }
}

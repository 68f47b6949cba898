//! Critical pods at admission: the kubelet's `CriticalPodAdmissionHandler`
//! (`pkg/kubelet/preemption/preemption.go`).
//!
//! A critical pod (static, mirror, or of a priority of at least
//! `SystemCriticalPriority`: [`is_critical`]) is not refused for a lack of
//! resources. If it fails admission for other reasons as well, only those
//! are given (the resources are not a reason to refuse it). If resources
//! alone refuse it, the kubelet preempts admitted pods that free enough of
//! each missing resource ([`pods_to_preempt`]: `getPodsToPreempt`, the
//! fewest guaranteed pods, then the fewest burstable ones, then best-effort
//! ones, each round the pod closest to what is still missing), and admits the
//! critical pod. When even every preemptable pod together would not free
//! enough, the pod is refused with `UnexpectedAdmissionError` and the
//! kubelet's message, which names what would still be missing
//! ([`Requirements::describe`]).
//!
//! Where evpleg differs: the kubelet kills the preempted pods before it
//! admits the critical one (`killPodFunc` blocks until their containers are
//! gone); evpleg admits it at once and starts it while they terminate, their
//! requests freed from admission as they are asked to stop.

use k8s_openapi::api::core::v1::Pod;

use evpleg_core::qos::{QosClass, qos_class};

use super::{Requests, requests};
use crate::status::api::is_static;
use crate::status::finish::is_mirror_pod;

/// The kubelet's `SystemCriticalPriority`: a priority this high makes a pod
/// critical.
pub const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;

/// The reason of the preempted pods' status and event (`PreemptContainer`).
pub const PREEMPTING_REASON: &str = "Preempting";
/// The preempted pods' status message and event.
pub const PREEMPTING_MESSAGE: &str = "Preempted in order to admit critical pod";
/// The reason of the preempted pods' `DisruptionTarget` condition.
pub const DISRUPTION_REASON: &str = "TerminationByKubelet";
/// The message of the preempted pods' `DisruptionTarget` condition.
pub const DISRUPTION_MESSAGE: &str = "Pod was preempted by Kubelet to accommodate a critical pod.";
/// The reason a critical pod is refused with when preemption cannot help.
pub const UNEXPECTED_REASON: &str = "UnexpectedAdmissionError";

/// The kubelet's `IsCriticalPod`: static, mirror, or of a system-critical
/// priority.
pub fn is_critical(pod: &Pod) -> bool {
    let priority = pod
        .spec
        .as_ref()
        .and_then(|s| s.priority)
        .is_some_and(|p| p >= SYSTEM_CRITICAL_PRIORITY);
    is_static(pod) || is_mirror_pod(pod) || priority
}

/// The kubelet's `Preemptable`: a critical pod may preempt any pod that is
/// not; otherwise a pod may preempt one of a lower priority, both set.
pub fn preemptable(preemptor: &Pod, preemptee: &Pod) -> bool {
    if is_critical(preemptor) && !is_critical(preemptee) {
        return true;
    }
    let priority = |p: &Pod| p.spec.as_ref().and_then(|s| s.priority);
    matches!((priority(preemptor), priority(preemptee)), (Some(a), Some(b)) if a > b)
}

/// A resource admission lacks, and how much of it (CPU in millicores, the
/// others in bytes, pods in pods): the kubelet's `admissionRequirement`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requirement {
    pub resource: &'static str,
    pub quantity: i64,
}

/// What admission lacks (`admissionRequirementList`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Requirements(pub Vec<Requirement>);

/// What a pod frees of `resource` once preempted (`GetResourceRequest`: a
/// pod counts 1 of `pods`).
fn request(r: &Requests, resource: &str) -> i64 {
    match resource {
        "pods" => 1,
        "cpu" => r.cpu_milli,
        "memory" => r.memory_bytes,
        "ephemeral-storage" => r.ephemeral_storage_bytes,
        _ => 0,
    }
}

impl Requirements {
    /// What is still missing once `pods` are preempted (`subtract`).
    pub fn subtract<'a>(&self, pods: impl IntoIterator<Item = &'a Requests> + Clone) -> Self {
        Self(
            self.0
                .iter()
                .filter_map(|req| {
                    let mut left = req.quantity;
                    for p in pods.clone() {
                        left -= request(p, req.resource);
                        if left <= 0 {
                            break;
                        }
                    }
                    (left > 0).then_some(Requirement {
                        resource: req.resource,
                        quantity: left,
                    })
                })
                .collect(),
        )
    }

    /// How far a pod's requests are from these (`distance`): the sum over
    /// the requirements of the square of the fraction it leaves missing.
    fn distance(&self, pod: &Requests) -> f64 {
        self.0
            .iter()
            .map(|req| {
                let left = (req.quantity - request(pod, req.resource)) as f64;
                if left > 0.0 {
                    (left / req.quantity as f64).powi(2)
                } else {
                    0.0
                }
            })
            .sum()
    }

    /// The kubelet's `toString`: `[(res: cpu, q: 998000), ]`.
    pub fn describe(&self) -> String {
        let mut s = String::from("[");
        for req in &self.0 {
            s.push_str(&format!("(res: {}, q: {}), ", req.resource, req.quantity));
        }
        s.push(']');
        s
    }
}

/// `smallerResourceRequest`: memory first, then CPU; equal counts as
/// smaller.
fn smaller(a: &Requests, b: &Requests) -> bool {
    for (x, y) in [(a.memory_bytes, b.memory_bytes), (a.cpu_milli, b.cpu_milli)] {
        if x != y {
            return x < y;
        }
    }
    true
}

/// The error of a set that cannot be found, as the kubelet words it.
fn no_set(missing: &Requirements) -> String {
    format!(
        "no set of running pods found to reclaim resources: {}",
        missing.describe()
    )
}

/// `getPodsToPreemptByDistance`: from `pods`, repeatedly the one closest to
/// what is still missing (of two as close, the smaller), until nothing is.
fn by_distance<K: Clone>(
    mut pods: Vec<(K, Requests)>,
    mut missing: Requirements,
) -> Result<Vec<(K, Requests)>, String> {
    let mut chosen = Vec::new();
    while !missing.0.is_empty() {
        if pods.is_empty() {
            return Err(no_set(&missing));
        }
        let mut best = 0;
        let mut best_distance = (missing.0.len() + 1) as f64;
        for (i, (_, r)) in pods.iter().enumerate() {
            let d = missing.distance(r);
            if d < best_distance || (d == best_distance && smaller(r, &pods[best].1)) {
                best_distance = d;
                best = i;
            }
        }
        let pod = pods.swap_remove(best);
        missing = missing.subtract([&pod.1]);
        chosen.push(pod);
    }
    Ok(chosen)
}

/// The kubelet's `getPodsToPreempt`: the pods among `candidates` (admitted
/// pods and their requests) that `preemptor` would preempt to free
/// `missing`, best-effort ones first; the kubelet's error when every
/// preemptable pod together would not free it.
pub fn pods_to_preempt<K: Clone>(
    preemptor: &Pod,
    candidates: &[(K, &Pod)],
    missing: &Requirements,
) -> Result<Vec<K>, String> {
    let (mut best_effort, mut burstable, mut guaranteed) = (Vec::new(), Vec::new(), Vec::new());
    for (k, pod) in candidates {
        if !preemptable(preemptor, pod) {
            continue;
        }
        let entry = (k.clone(), requests(pod));
        match qos_class(pod) {
            QosClass::BestEffort => best_effort.push(entry),
            QosClass::Burstable => burstable.push(entry),
            QosClass::Guaranteed => guaranteed.push(entry),
        }
    }
    let reqs = |v: &[(K, Requests)]| v.iter().map(|(_, r)| *r).collect::<Vec<_>>();
    let all: Vec<Requests> = [&best_effort, &burstable, &guaranteed]
        .into_iter()
        .flat_map(|v| reqs(v))
        .collect();
    let unable = missing.subtract(&all);
    if !unable.0.is_empty() {
        return Err(no_set(&unable));
    }
    // The guaranteed pods needed were every burstable and best-effort pod
    // preempted, then the burstable ones needed besides them, then the
    // best-effort ones needed besides those.
    let lower: Vec<Requests> = reqs(&best_effort)
        .into_iter()
        .chain(reqs(&burstable))
        .collect();
    let guaranteed = by_distance(guaranteed, missing.subtract(&lower))?;
    let lower: Vec<Requests> = reqs(&best_effort)
        .into_iter()
        .chain(reqs(&guaranteed))
        .collect();
    let burstable = by_distance(burstable, missing.subtract(&lower))?;
    let higher: Vec<Requests> = reqs(&burstable)
        .into_iter()
        .chain(reqs(&guaranteed))
        .collect();
    let best_effort = by_distance(best_effort, missing.subtract(&higher))?;
    Ok(best_effort
        .into_iter()
        .chain(burstable)
        .chain(guaranteed)
        .map(|(k, _)| k)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::annotations::{CONFIG_MIRROR, CONFIG_SOURCE};

    fn pod(annotations: serde_json::Value, priority: Option<i32>, cpu: &str, mem: &str) -> Pod {
        let resources = match (cpu, mem) {
            ("", "") => serde_json::json!({}),
            _ => serde_json::json!({"requests": {"cpu": cpu, "memory": mem}}),
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "annotations": annotations},
            "spec": {"priority": priority,
                     "containers": [{"name": "a", "resources": resources}]}
        }))
        .unwrap()
    }

    fn api(cpu: &str, mem: &str) -> Pod {
        pod(serde_json::json!({CONFIG_SOURCE: "api"}), None, cpu, mem)
    }

    fn cpu(milli: i64) -> Requirements {
        Requirements(vec![Requirement {
            resource: "cpu",
            quantity: milli,
        }])
    }

    /// `IsCriticalPod` and `Preemptable`, as a table.
    #[test]
    fn critical_and_preemptable_as_the_kubelet_has_them() {
        let file = pod(serde_json::json!({CONFIG_SOURCE: "file"}), None, "", "");
        let mirror = pod(
            serde_json::json!({CONFIG_SOURCE: "api", CONFIG_MIRROR: "x"}),
            None,
            "",
            "",
        );
        let system = pod(
            serde_json::json!({CONFIG_SOURCE: "api"}),
            Some(SYSTEM_CRITICAL_PRIORITY),
            "",
            "",
        );
        let high = pod(
            serde_json::json!({CONFIG_SOURCE: "api"}),
            Some(1000),
            "",
            "",
        );
        let low = pod(serde_json::json!({CONFIG_SOURCE: "api"}), Some(10), "", "");
        let plain = api("", "");
        for (p, critical) in [
            (&file, true),
            (&mirror, true),
            (&system, true),
            (&high, false),
            (&plain, false),
        ] {
            assert_eq!(is_critical(p), critical, "{:?}", p.metadata.annotations);
        }
        for (preemptor, preemptee, expected, what) in [
            (&file, &plain, true, "critical over not critical"),
            (&file, &system, false, "critical over critical"),
            (&high, &low, true, "higher priority"),
            (&low, &high, false, "lower priority"),
            (&high, &plain, false, "a priority not set"),
        ] {
            assert_eq!(preemptable(preemptor, preemptee), expected, "{what}");
        }
    }

    /// `getPodsToPreempt`: nothing preemptable frees enough (the corpus's
    /// static pod asking 1000 CPUs of a 2-CPU node); best-effort pods go
    /// before burstable and guaranteed ones; the pod closest to what is
    /// missing is taken; of two as close, the smaller.
    #[test]
    fn the_pods_to_preempt_are_the_kubelet_s() {
        let critical = pod(serde_json::json!({CONFIG_SOURCE: "file"}), None, "1000", "");
        assert_eq!(
            pods_to_preempt::<u8>(&critical, &[], &cpu(998_000)),
            Err(
                "no set of running pods found to reclaim resources: [(res: cpu, q: 998000), ]"
                    .into()
            )
        );
        let be = api("", "");
        let small = api("100m", "10Mi");
        let large = api("800m", "10Mi");
        let mut guaranteed = api("", "");
        guaranteed.spec.as_mut().unwrap().containers[0].resources = Some(
            serde_json::from_value(serde_json::json!({
                "requests": {"cpu": "900m", "memory": "10Mi"},
                "limits": {"cpu": "900m", "memory": "10Mi"}}))
            .unwrap(),
        );
        let other_critical = pod(serde_json::json!({CONFIG_SOURCE: "file"}), None, "4", "");
        let pods = [
            (1u8, &be),
            (2, &small),
            (3, &large),
            (4, &guaranteed),
            (5, &other_critical),
        ];
        // 700m: the large burstable pod alone (closest); no guaranteed pod,
        // and the best-effort pod frees no CPU, so it is not needed.
        assert_eq!(pods_to_preempt(&critical, &pods, &cpu(700)), Ok(vec![3]));
        // 1800m: every burstable pod (900m) is not enough, so the
        // guaranteed one goes (900m), then burstable ones for the 900m
        // still missing: the closest (800m), then the small one.
        assert_eq!(
            pods_to_preempt(&critical, &pods, &cpu(1800)),
            Ok(vec![3, 2, 4])
        );
        // 100m: the small and the large free it alike (distance 0): the
        // smaller is taken.
        assert_eq!(pods_to_preempt(&critical, &pods, &cpu(100)), Ok(vec![2]));
        // One pod: the best-effort pod is closest (it frees a whole pod).
        let one_pod = Requirements(vec![Requirement {
            resource: "pods",
            quantity: 1,
        }]);
        assert_eq!(pods_to_preempt(&critical, &pods, &one_pod), Ok(vec![1]));
        // More than every preemptable pod frees (the other critical pod is
        // not preemptable): what would still be missing.
        assert_eq!(
            pods_to_preempt(&critical, &pods, &cpu(2000)),
            Err("no set of running pods found to reclaim resources: [(res: cpu, q: 200), ]".into())
        );
    }
}

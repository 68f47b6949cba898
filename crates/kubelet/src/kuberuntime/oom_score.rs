//! A container's `oom_score_adj`, as the kubelet's
//! `GetContainerOOMScoreAdjust` (`pkg/kubelet/qos/policy.go`), which the
//! kubelet puts in the CRI's `LinuxContainerResources.oom_score_adj`
//! (`generateLinuxContainerResources`): node-critical pods (static, mirror
//! or priority >= 2 000 000 000, with `priorityClassName:
//! system-node-critical`) and Guaranteed pods -997, BestEffort 1000,
//! Burstable `1000 - 1000 * memory request / memory capacity`, at least 3
//! (above any Guaranteed) and at most 999 (below BestEffort); a sidecar
//! gets no more than its pod's smallest regular container would, so it is
//! not killed before the apps it serves. The capacity is the machine's
//! memory (`MemTotal`, [`evpleg_core::machine::memory_bytes`]), the
//! kubelet's cAdvisor `MemoryCapacity`.

use k8s_openapi::api::core::v1::{Container, Pod};

use evpleg_core::qos::{QosClass, qos_class};
use evpleg_core::quantity::parse_units;

/// The adjustment of Guaranteed and node-critical pods.
pub const GUARANTEED_OOM_SCORE_ADJ: i64 = -997;
/// The adjustment of BestEffort pods.
pub const BEST_EFFORT_OOM_SCORE_ADJ: i64 = 1000;
/// The kubelet's `IsNodeCriticalPod`: critical (static, mirror, or of a
/// system-critical priority: `IsCriticalPod`) and of the
/// `system-node-critical` class.
fn is_node_critical(pod: &Pod) -> bool {
    crate::admission::preemption::is_critical(pod)
        && pod
            .spec
            .as_ref()
            .and_then(|s| s.priority_class_name.as_deref())
            == Some("system-node-critical")
}

fn memory_request(c: &Container) -> i64 {
    c.resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("memory"))
        .and_then(|q| parse_units(&q.0).ok())
        .unwrap_or(0)
}

/// The kubelet's `GetContainerOOMScoreAdjust` for `c` of `pod` on a machine
/// of `memory_capacity` bytes.
pub fn oom_score_adj(pod: &Pod, c: &Container, memory_capacity: i64) -> i64 {
    if is_node_critical(pod) {
        return GUARANTEED_OOM_SCORE_ADJ;
    }
    match qos_class(pod) {
        QosClass::Guaranteed => return GUARANTEED_OOM_SCORE_ADJ,
        QosClass::BestEffort => return BEST_EFFORT_OOM_SCORE_ADJ,
        QosClass::Burstable => {}
    }
    let capacity = memory_capacity.max(1);
    let score = |request: i64| 1000 - (1000 * request as i128 / capacity as i128) as i64;
    let mut adj = score(memory_request(c));
    let sidecar = pod.spec.as_ref().is_some_and(|s| {
        s.init_containers
            .iter()
            .flatten()
            .any(|i| i.name == c.name && super::actions::is_sidecar(i))
    });
    if sidecar {
        let smallest = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .map(memory_request)
            .min()
            .unwrap_or(0);
        adj = adj.min(score(smallest));
    }
    if adj < 1000 + GUARANTEED_OOM_SCORE_ADJ {
        return 1000 + GUARANTEED_OOM_SCORE_ADJ;
    }
    if adj == BEST_EFFORT_OOM_SCORE_ADJ {
        return adj - 1;
    }
    adj
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::annotations::CONFIG_SOURCE;

    const GI: i64 = 1 << 30;

    fn pod(spec: serde_json::Value, annotations: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "annotations": annotations}, "spec": spec
        }))
        .unwrap()
    }

    fn app(resources: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"name": "app", "image": "i", "resources": resources})
    }

    /// The kubelet's `TestGetContainerOOMScoreAdjust` cases, on a machine of
    /// 4 GiB (its `standardMemoryAmount` is 8 GB; the ratios are the same).
    #[test]
    fn the_kubelet_s_oom_score_table() {
        let none = serde_json::json!({});
        let cases = [
            ("best effort", app(none.clone()), none.clone(), 1000),
            (
                "guaranteed",
                app(
                    serde_json::json!({"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "1", "memory": "1Gi"}}),
                ),
                none.clone(),
                -997,
            ),
            (
                "burstable, a quarter of the memory",
                app(serde_json::json!({"requests": {"memory": "1Gi"}})),
                none.clone(),
                750,
            ),
            (
                "burstable, all of the memory: not below 3",
                app(serde_json::json!({"requests": {"memory": "4Gi"}})),
                none.clone(),
                3,
            ),
            (
                "burstable, more than the memory",
                app(serde_json::json!({"requests": {"memory": "8Gi"}})),
                none.clone(),
                3,
            ),
            (
                "burstable without a memory request: 999, below BestEffort",
                app(serde_json::json!({"requests": {"cpu": "100m"}})),
                none.clone(),
                999,
            ),
        ];
        for (name, container, annotations, want) in cases {
            let p = pod(serde_json::json!({"containers": [container]}), annotations);
            let c = &p.spec.as_ref().unwrap().containers[0];
            assert_eq!(oom_score_adj(&p, c, 4 * GI), want, "{name}");
        }
    }

    /// A static pod of class `system-node-critical` is -997 whatever its QoS;
    /// from the API it also needs a system-critical priority.
    #[test]
    fn node_critical_pods_are_kept_last() {
        let spec = serde_json::json!({"priorityClassName": "system-node-critical", "containers": [app(serde_json::json!({}))]});
        let static_pod = pod(spec.clone(), serde_json::json!({CONFIG_SOURCE: "file"}));
        let c = &static_pod.spec.as_ref().unwrap().containers[0];
        assert_eq!(oom_score_adj(&static_pod, c, 4 * GI), -997);
        let api = pod(spec.clone(), serde_json::json!({CONFIG_SOURCE: "api"}));
        assert_eq!(oom_score_adj(&api, c, 4 * GI), 1000);
        let mut critical = spec;
        critical["priority"] = serde_json::json!(2_000_001_000);
        let api = pod(critical, serde_json::json!({CONFIG_SOURCE: "api"}));
        assert_eq!(oom_score_adj(&api, c, 4 * GI), -997);
    }

    /// The kubelet's sidecar case: a sidecar's score is no higher than that of
    /// the regular container with the smallest request.
    #[test]
    fn a_sidecar_is_not_killed_before_its_apps() {
        let p = pod(
            serde_json::json!({
                "initContainers": [{"name": "side", "image": "i", "restartPolicy": "Always",
                                    "resources": {"requests": {"memory": "100Mi"}}}],
                "containers": [
                    {"name": "big", "image": "i", "resources": {"requests": {"memory": "2Gi"}}},
                    {"name": "small", "image": "i", "resources": {"requests": {"memory": "1Gi"}}}]
            }),
            serde_json::json!({}),
        );
        let spec = p.spec.as_ref().unwrap();
        let side = &spec.init_containers.as_ref().unwrap()[0];
        assert_eq!(oom_score_adj(&p, side, 4 * GI), 750);
        assert_eq!(oom_score_adj(&p, &spec.containers[0], 4 * GI), 500);
        assert_eq!(oom_score_adj(&p, &spec.containers[1], 4 * GI), 750);
    }
}

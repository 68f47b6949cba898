//! A pod's QoS class (`pkg/apis/core/v1/helper/qos`), which picks its cgroup
//! parent: BestEffort when no container requests or limits CPU or memory,
//! Guaranteed when every container's CPU and memory limits equal its requests,
//! Burstable otherwise.

use k8s_openapi::api::core::v1::{Container, Pod};

pub use crate::cgroup_path::QosClass;

impl QosClass {
    /// The API's spelling (`status.qosClass`).
    pub fn as_api(self) -> &'static str {
        match self {
            Self::Guaranteed => "Guaranteed",
            Self::Burstable => "Burstable",
            Self::BestEffort => "BestEffort",
        }
    }
}

const RESOURCES: [&str; 2] = ["cpu", "memory"];

fn quantity(c: &Container, limits: bool, name: &str) -> Option<String> {
    let r = c.resources.as_ref()?;
    let map = if limits {
        r.limits.as_ref()
    } else {
        r.requests.as_ref()
    };
    map?.get(name).map(|q| q.0.clone())
}

/// The QoS class of `pod`.
pub fn qos_class(pod: &Pod) -> QosClass {
    let Some(spec) = &pod.spec else {
        return QosClass::BestEffort;
    };
    let containers: Vec<&Container> = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .collect();
    let any = containers.iter().any(|c| {
        RESOURCES
            .iter()
            .any(|r| quantity(c, false, r).is_some() || quantity(c, true, r).is_some())
    });
    if !any {
        return QosClass::BestEffort;
    }
    let guaranteed = containers.iter().all(|c| {
        RESOURCES
            .iter()
            .all(|r| match (quantity(c, false, r), quantity(c, true, r)) {
                (Some(req), Some(lim)) => req == lim,
                // Requests default to limits.
                (None, Some(_)) => true,
                _ => false,
            })
    });
    if guaranteed {
        QosClass::Guaranteed
    } else {
        QosClass::Burstable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(resources: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "spec": {"containers": [{"name": "a", "resources": resources}]}
        }))
        .unwrap()
    }

    #[test]
    fn classes() {
        assert_eq!(qos_class(&pod(serde_json::json!({}))), QosClass::BestEffort);
        let g = pod(serde_json::json!({"limits": {"cpu": "1", "memory": "1Gi"}}));
        assert_eq!(qos_class(&g), QosClass::Guaranteed);
        let b =
            pod(serde_json::json!({"requests": {"memory": "10Mi"}, "limits": {"memory": "20Mi"}}));
        assert_eq!(qos_class(&b), QosClass::Burstable);
        assert_eq!(QosClass::Burstable.as_api(), "Burstable");
    }
}

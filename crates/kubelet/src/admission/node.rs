//! The node predicates the kubelet re-checks at admission (its
//! `generalFilter` in `lifecycle/predicate.go`, calling the scheduler's
//! `AdmissionCheck`): the pod's required node affinity and `nodeSelector`
//! against the node's labels (`NodeAffinity`), `spec.nodeName` against the
//! node's name (`NodeName`), and, for pods that are not static, the node's
//! `NoExecute` taints against the pod's tolerations (`TaintToleration`). As
//! the kubelet, `NoSchedule` and `PreferNoSchedule` taints are the
//! scheduler's business and not checked here; a pod bound to the node
//! directly passes them.
//!
//! A failure is the kubelet's `PredicateFailureError`: reason the predicate's
//! name, message "Predicate NAME failed: DESCRIPTION".

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration,
};

use super::Rejection;

pub const NODE_AFFINITY: &str = "NodeAffinity";
pub const NODE_AFFINITY_DESC: &str = "node(s) didn't match Pod's node affinity/selector";
pub const NODE_NAME: &str = "NodeName";
pub const NODE_NAME_DESC: &str = "node(s) didn't match the requested node name";
pub const TAINT_TOLERATION: &str = "TaintToleration";
pub const TAINT_TOLERATION_DESC: &str = "node(s) had taints that the pod didn't tolerate";

/// What admission knows of the node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeInfo {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
}

/// A `--node-labels` / `--register-with-taints` value that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NodeFlagError {
    #[error("node label {0:?} is not key=value")]
    Label(String),
    #[error("taint {0:?} is not key[=value]:NoSchedule|PreferNoSchedule|NoExecute")]
    Taint(String),
}

impl NodeInfo {
    /// The node as registered: the kubelet's default labels
    /// (`kubernetes.io/hostname`, `kubernetes.io/os`, `kubernetes.io/arch`),
    /// then `labels` (`--node-labels`, `a=b,c=d`), and `taints`
    /// (`--register-with-taints`, `key=value:Effect,key:Effect`).
    pub fn from_flags(name: &str, labels: &str, taints: &str) -> Result<Self, NodeFlagError> {
        let mut out = Self {
            name: name.into(),
            ..Self::default()
        };
        for (k, v) in [
            ("kubernetes.io/hostname", name),
            ("kubernetes.io/os", std::env::consts::OS),
            ("kubernetes.io/arch", go_arch()),
        ] {
            out.labels.insert(k.into(), v.into());
        }
        for item in labels.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| NodeFlagError::Label(item.into()))?;
            out.labels.insert(k.into(), v.into());
        }
        for item in taints.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let bad = || NodeFlagError::Taint(item.into());
            let (kv, effect) = item.rsplit_once(':').ok_or_else(bad)?;
            if !matches!(effect, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
                return Err(bad());
            }
            let (key, value) = match kv.split_once('=') {
                Some((k, v)) => (k, Some(v.to_owned())),
                None => (kv, None),
            };
            if key.is_empty() {
                return Err(bad());
            }
            out.taints.push(Taint {
                key: key.into(),
                value,
                effect: effect.into(),
                time_added: None,
            });
        }
        Ok(out)
    }
}

/// Go's name of this architecture (`GOARCH`), as the kubelet's label has it.
pub fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// The kubelet's `PredicateFailureError` as a rejection.
pub fn predicate_failure(name: &str, desc: &str) -> Rejection {
    Rejection {
        reason: name.into(),
        message: format!("Predicate {name} failed: {desc}"),
    }
}

/// The node predicates in the kubelet's order (the host ports, checked by
/// the caller, come between [`selection`] and [`taints`]).
pub fn check(pod: &Pod, node: &NodeInfo, is_static: bool) -> Result<(), Rejection> {
    selection(pod, node)?;
    taints(pod, node, is_static)
}

/// NodeAffinity (with `nodeSelector`), then NodeName.
pub fn selection(pod: &Pod, node: &NodeInfo) -> Result<(), Rejection> {
    if !affinity_matches(pod, node) {
        return Err(predicate_failure(NODE_AFFINITY, NODE_AFFINITY_DESC));
    }
    let wanted = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if wanted.is_some_and(|n| !n.is_empty() && n != node.name) {
        return Err(predicate_failure(NODE_NAME, NODE_NAME_DESC));
    }
    Ok(())
}

/// TaintToleration, `NoExecute` only, static pods exempt.
pub fn taints(pod: &Pod, node: &NodeInfo, is_static: bool) -> Result<(), Rejection> {
    if !is_static && untolerated_no_execute(pod, node).is_some() {
        return Err(predicate_failure(TAINT_TOLERATION, TAINT_TOLERATION_DESC));
    }
    Ok(())
}

/// The first `NoExecute` taint of the node no toleration of the pod
/// tolerates (the kubelet's `FindMatchingUntoleratedTaint`).
pub fn untolerated_no_execute<'a>(pod: &Pod, node: &'a NodeInfo) -> Option<&'a Taint> {
    let tolerations: &[Toleration] = pod
        .spec
        .as_ref()
        .and_then(|s| s.tolerations.as_deref())
        .unwrap_or_default();
    node.taints
        .iter()
        .filter(|t| t.effect == "NoExecute")
        .find(|t| !tolerations.iter().any(|tol| tolerates(tol, t)))
}

/// `Toleration.ToleratesTaint`.
pub fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if tol
        .effect
        .as_deref()
        .is_some_and(|e| !e.is_empty() && e != taint.effect)
    {
        return false;
    }
    if tol
        .key
        .as_deref()
        .is_some_and(|k| !k.is_empty() && k != taint.key)
    {
        return false;
    }
    match tol.operator.as_deref() {
        None | Some("") | Some("Equal") => {
            tol.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default()
        }
        Some("Exists") => true,
        Some(_) => false,
    }
}

/// `nodeSelector` and the required node affinity (`GetRequiredNodeAffinity`):
/// every selector label equal, and one of the terms matching.
pub fn affinity_matches(pod: &Pod, node: &NodeInfo) -> bool {
    let Some(spec) = &pod.spec else { return true };
    let selector_ok = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| node.labels.get(k) == Some(v));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    selector_ok
        && required.is_none_or(|r| r.node_selector_terms.iter().any(|t| term_matches(t, node)))
}

/// A term matches when it has a requirement and all of them hold; an empty
/// term matches nothing.
fn term_matches(term: &NodeSelectorTerm, node: &NodeInfo) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    exprs
        .iter()
        .all(|r| requirement_holds(r, node.labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            r.key == "metadata.name"
                && matches!(r.operator.as_str(), "In" | "NotIn")
                && requirement_holds(r, Some(&node.name))
        })
}

/// One requirement against the label's value (`None`: no such label).
fn requirement_holds(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|w| w == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|w| w == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(v), [bound]) = (value.and_then(number), values) else {
                return false;
            };
            let Some(bound) = number(bound) else {
                return false;
            };
            if r.operator == "Gt" {
                v > bound
            } else {
                v < bound
            }
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeInfo {
        NodeInfo {
            name: "n1".into(),
            labels: [
                ("kubernetes.io/hostname", "n1"),
                ("zone", "a"),
                ("gpus", "4"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
            taints: vec![
                serde_json::from_value(
                    serde_json::json!({"key": "dedicated", "value": "db", "effect": "NoExecute"}),
                )
                .unwrap(),
                serde_json::from_value(serde_json::json!({"key": "soft", "effect": "NoSchedule"}))
                    .unwrap(),
            ],
        }
    }

    fn pod(spec: serde_json::Value) -> Pod {
        let mut spec = spec;
        spec["containers"] = serde_json::json!([{"name": "a"}]);
        serde_json::from_value(serde_json::json!({"spec": spec})).unwrap()
    }

    #[test]
    fn flags_make_the_node() {
        let n = NodeInfo::from_flags(
            "n1",
            "zone=a, tier=",
            "dedicated=db:NoExecute,soft:NoSchedule",
        )
        .unwrap();
        assert_eq!(n.labels["kubernetes.io/hostname"], "n1");
        assert_eq!(n.labels["kubernetes.io/os"], "linux");
        assert_eq!(n.labels["kubernetes.io/arch"], go_arch());
        assert_eq!(
            (n.labels["zone"].as_str(), n.labels["tier"].as_str()),
            ("a", "")
        );
        assert_eq!(
            n.taints
                .iter()
                .map(|t| (t.key.as_str(), t.value.as_deref(), t.effect.as_str()))
                .collect::<Vec<_>>(),
            [
                ("dedicated", Some("db"), "NoExecute"),
                ("soft", None, "NoSchedule")
            ]
        );
        assert_eq!(
            NodeInfo::from_flags("n", "zone", "")
                .unwrap_err()
                .to_string(),
            "node label \"zone\" is not key=value"
        );
        for bad in ["k=v", "k=v:Sometimes", ":NoExecute"] {
            assert_eq!(
                NodeInfo::from_flags("n", "", bad).unwrap_err(),
                NodeFlagError::Taint(bad.into())
            );
        }
    }

    /// (spec, static, expected reason or None).
    #[test]
    fn predicates_as_the_kubelet() {
        let db = serde_json::json!([{"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoExecute"}]);
        let terms = |exprs: serde_json::Value| {
            serde_json::json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": exprs}}})
        };
        let cases: Vec<(serde_json::Value, bool, Option<&str>)> = vec![
            // Untolerated NoExecute taint; the NoSchedule one is the scheduler's.
            (serde_json::json!({}), false, Some(TAINT_TOLERATION)),
            (serde_json::json!({}), true, None),
            (serde_json::json!({"tolerations": db}), false, None),
            (
                serde_json::json!({"tolerations": [{"operator": "Exists"}]}),
                false,
                None,
            ),
            (
                serde_json::json!({"tolerations": [{"key": "dedicated", "operator": "Exists"}]}),
                false,
                None,
            ),
            (
                serde_json::json!({"tolerations": [{"key": "dedicated", "value": "web", "effect": "NoExecute"}]}),
                false,
                Some(TAINT_TOLERATION),
            ),
            (
                serde_json::json!({"tolerations": [{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]}),
                false,
                Some(TAINT_TOLERATION),
            ),
            // nodeSelector.
            (
                serde_json::json!({"tolerations": db, "nodeSelector": {"zone": "a"}}),
                false,
                None,
            ),
            (
                serde_json::json!({"tolerations": db, "nodeSelector": {"zone": "b"}}),
                false,
                Some(NODE_AFFINITY),
            ),
            (
                serde_json::json!({"tolerations": db, "nodeSelector": {"disk": "ssd"}}),
                false,
                Some(NODE_AFFINITY),
            ),
            // Required affinity: terms ORed, expressions ANDed.
            (
                serde_json::json!({"tolerations": db, "affinity": terms(serde_json::json!([
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "c"]},
                                          {"key": "gpus", "operator": "Gt", "values": ["2"]}]}]))}),
                false,
                None,
            ),
            (
                serde_json::json!({"tolerations": db, "affinity": terms(serde_json::json!([
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]},
                                          {"key": "gpus", "operator": "Lt", "values": ["2"]}]}]))}),
                false,
                Some(NODE_AFFINITY),
            ),
            (
                serde_json::json!({"tolerations": db, "affinity": terms(serde_json::json!([
                    {"matchExpressions": [{"key": "disk", "operator": "DoesNotExist"},
                                          {"key": "zone", "operator": "NotIn", "values": ["b"]},
                                          {"key": "gpus", "operator": "Exists"}]}]))}),
                false,
                None,
            ),
            (
                serde_json::json!({"tolerations": db, "affinity": terms(serde_json::json!([
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]))}),
                false,
                None,
            ),
            (
                serde_json::json!({"tolerations": db, "affinity": terms(serde_json::json!([
                    {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}]}]))}),
                false,
                Some(NODE_AFFINITY),
            ),
            // An empty term matches nothing; a non-number for Gt fails.
            (
                serde_json::json!({"tolerations": db, "affinity": terms(serde_json::json!([{}]))}),
                false,
                Some(NODE_AFFINITY),
            ),
            (
                serde_json::json!({"tolerations": db, "affinity": terms(serde_json::json!([
                    {"matchExpressions": [{"key": "zone", "operator": "Gt", "values": ["1"]}]}]))}),
                false,
                Some(NODE_AFFINITY),
            ),
            // nodeName.
            (
                serde_json::json!({"tolerations": db, "nodeName": "n1"}),
                false,
                None,
            ),
            (
                serde_json::json!({"tolerations": db, "nodeName": "n2"}),
                false,
                Some(NODE_NAME),
            ),
        ];
        for (spec, is_static, want) in cases {
            let got = check(&pod(spec.clone()), &node(), is_static).err();
            assert_eq!(
                got.as_ref().map(|r| r.reason.as_str()),
                want,
                "{spec} static={is_static}"
            );
        }
        assert_eq!(
            check(&pod(serde_json::json!({})), &node(), false).unwrap_err(),
            Rejection {
                reason: "TaintToleration".into(),
                message: "Predicate TaintToleration failed: node(s) had taints that the pod didn't tolerate"
                    .into()
            }
        );
        assert_eq!(
            check(
                &pod(serde_json::json!({"nodeSelector": {"zone": "b"}})),
                &node(),
                true
            )
            .unwrap_err()
            .message,
            "Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector"
        );
    }
}

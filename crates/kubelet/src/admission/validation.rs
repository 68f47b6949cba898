//! The API server's `ValidatePod` for the fields the agent turns into paths
//! and names: the pod's name (a DNS-1123 subdomain) and namespace (a label),
//! which name its log directory; its containers' names (labels, unique over
//! init, app and ephemeral containers), which name log files and subPath
//! mount points; its volumes' names (labels, unique), which name their
//! directories; every volume mount naming a volume of the pod, with a
//! relative `subPath` without `..`. Each error names the field as the API
//! server does (`spec.volumes[0].name: Invalid value: "/data": ...`).
//!
//! Every pod runs through it, whatever its source: the file and URL sources
//! refuse the manifest ([`crate::source`]), admission refuses the pod with
//! reason [`INVALID_REASON`] ([`super::Admission::admit`]), so an API pod
//! that a permissive or fake API server let through never reaches a path.
//! Difference: the rest of `ValidatePod` (resources, probes, ports, ...) is
//! not checked here; what the agent does not implement is refused by
//! [`super::fields`].

use std::collections::HashSet;
use std::path::{Component, Path};

use k8s_openapi::api::core::v1::{Pod, VolumeMount};

use evpleg_core::names::{is_dns_label, is_dns_subdomain};

/// The rejection reason of a pod that fails validation.
pub const INVALID_REASON: &str = "InvalidPodSpec";

const LABEL: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character";
const SUBDOMAIN: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character";

fn invalid(out: &mut Vec<String>, field: &str, value: &str, why: &str) {
    out.push(format!("{field}: Invalid value: {value:?}: {why}"));
}

/// A name that must be a unique DNS-1123 label.
fn label(out: &mut Vec<String>, seen: &mut HashSet<String>, field: &str, name: &str) {
    if name.is_empty() {
        out.push(format!("{field}: Required value"));
    } else if !is_dns_label(name) {
        invalid(out, field, name, LABEL);
    } else if !seen.insert(name.to_owned()) {
        out.push(format!("{field}: Duplicate value: {name:?}"));
    }
}

/// The API server's `validateLocalDescendingPath` for a subPath.
fn sub_path(out: &mut Vec<String>, field: &str, path: &str) {
    let p = Path::new(path);
    if p.is_absolute() {
        invalid(out, field, path, "must be a relative path");
    }
    if p.components().any(|c| c == Component::ParentDir) {
        invalid(out, field, path, "must not contain '..'");
    }
}

fn mounts(out: &mut Vec<String>, volumes: &HashSet<String>, field: &str, mounts: &[VolumeMount]) {
    for (i, m) in mounts.iter().enumerate() {
        let f = format!("{field}.volumeMounts[{i}]");
        if m.name.is_empty() {
            out.push(format!("{f}.name: Required value"));
        } else if !volumes.contains(&m.name) {
            out.push(format!("{f}.name: Not found: {:?}", m.name));
        }
        if m.mount_path.is_empty() {
            out.push(format!("{f}.mountPath: Required value"));
        }
        if let Some(s) = m.sub_path.as_deref() {
            sub_path(out, &format!("{f}.subPath"), s);
        }
    }
}

/// What is invalid in `pod`, each naming its field; empty when valid.
pub fn validate(pod: &Pod) -> Vec<String> {
    let mut out = Vec::new();
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    if name.is_empty() {
        out.push("metadata.name: Required value".to_owned());
    } else if !is_dns_subdomain(name) {
        invalid(&mut out, "metadata.name", name, SUBDOMAIN);
    }
    // An empty namespace is the default one.
    if let Some(ns) = pod.metadata.namespace.as_deref().filter(|n| !n.is_empty())
        && !is_dns_label(ns)
    {
        invalid(&mut out, "metadata.namespace", ns, LABEL);
    }
    let Some(spec) = &pod.spec else {
        out.push("spec: Required value".to_owned());
        return out;
    };
    let mut volumes = HashSet::new();
    for (i, v) in spec.volumes.iter().flatten().enumerate() {
        label(
            &mut out,
            &mut volumes,
            &format!("spec.volumes[{i}].name"),
            &v.name,
        );
    }
    let mut names = HashSet::new();
    let lists = [
        ("spec.initContainers", spec.init_containers.as_deref()),
        ("spec.containers", Some(spec.containers.as_slice())),
    ];
    for (list, containers) in lists {
        for (i, c) in containers.into_iter().flatten().enumerate() {
            let field = format!("{list}[{i}]");
            label(&mut out, &mut names, &format!("{field}.name"), &c.name);
            mounts(
                &mut out,
                &volumes,
                &field,
                c.volume_mounts.as_deref().unwrap_or_default(),
            );
        }
    }
    for (i, c) in spec.ephemeral_containers.iter().flatten().enumerate() {
        let field = format!("spec.ephemeralContainers[{i}]");
        label(&mut out, &mut names, &format!("{field}.name"), &c.name);
        mounts(
            &mut out,
            &volumes,
            &field,
            c.volume_mounts.as_deref().unwrap_or_default(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn names_that_would_become_paths_are_refused_naming_the_field() {
        let p = pod(serde_json::json!({
            "metadata": {"name": "web", "namespace": "../etc"},
            "spec": {
                "volumes": [{"name": "/data", "emptyDir": {}}, {"name": "ok", "emptyDir": {}}, {"name": "ok", "emptyDir": {}}],
                "initContainers": [{"name": "init"}],
                "containers": [
                    {"name": "../x", "volumeMounts": [
                        {"name": "/data", "mountPath": "/d"},
                        {"name": "ok", "mountPath": "/e", "subPath": "/abs"},
                        {"name": "ok", "mountPath": "", "subPath": "a/../../b"},
                        {"name": "gone", "mountPath": "/g"}
                    ]},
                    {"name": "init"},
                    {"name": ""}
                ]
            }
        }));
        let got = validate(&p);
        let want = [
            format!("metadata.namespace: Invalid value: \"../etc\": {LABEL}"),
            format!("spec.volumes[0].name: Invalid value: \"/data\": {LABEL}"),
            "spec.volumes[2].name: Duplicate value: \"ok\"".to_owned(),
            format!("spec.containers[0].name: Invalid value: \"../x\": {LABEL}"),
            // "/data" was never a volume of the pod.
            "spec.containers[0].volumeMounts[0].name: Not found: \"/data\"".to_owned(),
            "spec.containers[0].volumeMounts[1].subPath: Invalid value: \"/abs\": must be a relative path".to_owned(),
            "spec.containers[0].volumeMounts[2].mountPath: Required value".to_owned(),
            "spec.containers[0].volumeMounts[2].subPath: Invalid value: \"a/../../b\": must not contain '..'".to_owned(),
            "spec.containers[0].volumeMounts[3].name: Not found: \"gone\"".to_owned(),
            "spec.containers[1].name: Duplicate value: \"init\"".to_owned(),
            "spec.containers[2].name: Required value".to_owned(),
        ];
        assert_eq!(got, want);
        let names = [("Web", SUBDOMAIN), ("a/b", SUBDOMAIN), ("..", SUBDOMAIN)];
        for (name, why) in names {
            let p = pod(
                serde_json::json!({"metadata": {"name": name}, "spec": {"containers": [{"name": "c"}]}}),
            );
            assert_eq!(
                validate(&p),
                [format!("metadata.name: Invalid value: {name:?}: {why}")]
            );
        }
        let ok = pod(serde_json::json!({
            "metadata": {"name": "web.example", "namespace": "kube-system"},
            "spec": {"volumes": [{"name": "data"}], "containers": [
                {"name": "app", "volumeMounts": [{"name": "data", "mountPath": "/d", "subPath": "a/b"}]}
            ]}
        }));
        assert_eq!(validate(&ok), Vec::<String>::new());
    }
}

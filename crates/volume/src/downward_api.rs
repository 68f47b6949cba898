//! The downwardAPI plugin's files (the kubelet's `downwardapi.CollectData`,
//! `fieldpath.ExtractFieldPathAsString`, `FormatMap`,
//! `ExtractContainerResourceValue`), for downwardAPI volumes and projected
//! downwardAPI sources ([`super::projection`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{DownwardAPIVolumeFile, Pod};

use super::plugin::PluginError;
use super::projection::{Payload, file};
use evpleg_core::quantity::parse_milli;

/// The kubelet's `CollectData` of a downwardAPI volume.
pub fn downward_files(
    pod: &Pod,
    items: &[DownwardAPIVolumeFile],
    default_mode: i32,
    out: &mut Payload,
) -> Result<(), PluginError> {
    for item in items {
        let mode = item.mode.unwrap_or(default_mode);
        let value = if let Some(f) = &item.field_ref {
            field_value(pod, &f.field_path)?
        } else if let Some(r) = &item.resource_field_ref {
            resource_value(pod, r)?
        } else {
            continue;
        };
        out.insert(item.path.clone(), file(value.into_bytes(), mode));
    }
    Ok(())
}

/// `ExtractFieldPathAsString` for the fields a volume may use.
pub fn field_value(pod: &Pod, path: &str) -> Result<String, PluginError> {
    let m = &pod.metadata;
    let map = |v: &Option<BTreeMap<String, String>>| v.clone().unwrap_or_default();
    if let Some((field, key)) = path.strip_suffix("']").and_then(|p| p.split_once("['")) {
        return match field {
            "metadata.labels" => Ok(map(&m.labels).get(key).cloned().unwrap_or_default()),
            "metadata.annotations" => Ok(map(&m.annotations).get(key).cloned().unwrap_or_default()),
            _ => Err(unsupported_field(path)),
        };
    }
    Ok(match path {
        "metadata.name" => m.name.clone().unwrap_or_default(),
        "metadata.namespace" => m.namespace.clone().unwrap_or_else(|| "default".into()),
        "metadata.uid" => m.uid.clone().unwrap_or_default(),
        "metadata.labels" => format_map(&map(&m.labels)),
        "metadata.annotations" => format_map(&map(&m.annotations)),
        _ => return Err(unsupported_field(path)),
    })
}

fn unsupported_field(path: &str) -> PluginError {
    PluginError::Failed(format!("unsupported fieldPath: {path}"))
}

/// `FormatMap`: `key="value"` lines in key order, no final newline; values
/// quoted as Go's `%q`.
pub fn format_map(m: &BTreeMap<String, String>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k}={}", go_quote(v)))
        .collect::<Vec<_>>()
        .join("\n")
}

fn go_quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\x0b' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `ExtractContainerResourceValue` (downwardAPI volumes and, from the
/// kubelet crate, `resourceFieldRef` env): cpu rounded up to the divisor, memory
/// divided and rounded up; a limit unset is the node's allocatable.
pub fn resource_value(
    pod: &Pod,
    r: &k8s_openapi::api::core::v1::ResourceFieldSelector,
) -> Result<String, PluginError> {
    let containers = pod.spec.iter().flat_map(|s| s.containers.iter());
    let name = r.container_name.as_deref().unwrap_or_default();
    let c = containers
        .clone()
        .find(|c| c.name == name || name.is_empty())
        .ok_or_else(|| PluginError::Failed(format!("resourceFieldRef: no container {name:?}")))?;
    let (kind, resource) = r.resource.split_once('.').unwrap_or(("", &r.resource));
    let res = c.resources.clone().unwrap_or_default();
    let set = match kind {
        "limits" => res.limits.unwrap_or_default(),
        "requests" => res.requests.unwrap_or_default(),
        _ => {
            return Err(PluginError::Failed(format!(
                "unsupported container resource: {}",
                r.resource
            )));
        }
    };
    // Unset limits default to the machine's CPUs and memory (the kubelet's
    // node allocatable, as `Allocatable::of_host` measures them).
    let bad = |e: &dyn std::fmt::Display| {
        PluginError::Failed(format!("resourceFieldRef {}: {e}", r.resource))
    };
    let divisor_milli = match &r.divisor {
        Some(d) => parse_milli(&d.0).map_err(|e| bad(&e))?,
        None => 1000,
    }
    .max(1);
    let milli = match (resource, set.get(resource)) {
        (_, Some(q)) => parse_milli(&q.0).map_err(|e| bad(&e))?,
        ("cpu", None) if kind == "limits" => evpleg_core::machine::cpus() * 1000,
        ("memory", None) if kind == "limits" => evpleg_core::machine::memory_bytes() * 1000,
        ("cpu" | "memory", None) => 0,
        _ => {
            return Err(PluginError::Failed(format!(
                "unsupported container resource: {}",
                r.resource
            )));
        }
    };
    Ok(((milli + divisor_milli - 1) / divisor_milli).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "u-1",
                         "labels": {"b": "2", "a": "x\"y"}, "annotations": {"k": "v"}},
            "spec": {"containers": [{"name": "app", "resources": {
                "limits": {"cpu": "1500m", "memory": "64Mi"}, "requests": {"cpu": "250m"}}}]}
        }))
        .unwrap()
    }

    fn item(path: &str, v: serde_json::Value) -> DownwardAPIVolumeFile {
        let mut o = serde_json::json!({"path": path});
        o.as_object_mut()
            .unwrap()
            .extend(v.as_object().unwrap().clone());
        serde_json::from_value(o).unwrap()
    }

    #[test]
    fn downward_api_files_as_the_kubelet_writes_them() {
        let fr = |p: &str| serde_json::json!({"fieldRef": {"fieldPath": p}});
        let rr = |r: &str, d: Option<&str>| serde_json::json!({"resourceFieldRef": {"containerName": "app", "resource": r, "divisor": d}});
        let cases = [
            (fr("metadata.name"), "web"),
            (fr("metadata.namespace"), "ns"),
            (fr("metadata.uid"), "u-1"),
            (fr("metadata.labels"), "a=\"x\\\"y\"\nb=\"2\""),
            (fr("metadata.annotations['k']"), "v"),
            (fr("metadata.labels['missing']"), ""),
            (rr("limits.cpu", None), "2"),
            (rr("limits.cpu", Some("1m")), "1500"),
            (rr("requests.cpu", Some("1m")), "250"),
            (rr("limits.memory", Some("1Mi")), "64"),
            (rr("requests.memory", None), "0"),
        ];
        for (v, want) in cases {
            let mut out = Payload::new();
            downward_files(&pod(), &[item("f", v.clone())], 0o600, &mut out).unwrap();
            let f = &out["f"];
            assert_eq!(String::from_utf8_lossy(&f.data), want, "{v}");
            assert_eq!(f.mode, 0o600);
        }
        let mut out = Payload::new();
        let err =
            downward_files(&pod(), &[item("f", fr("spec.nodeName"))], 0o644, &mut out).unwrap_err();
        assert_eq!(err.to_string(), "unsupported fieldPath: spec.nodeName");
    }
}

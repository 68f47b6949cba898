//! The emptyDir plugin (`pkg/volume/emptydir`): a directory in the pod's
//! volumes, mode 0777, on the node's disk, or with `medium: Memory` a tmpfs
//! whose size is the volume's `sizeLimit` (else the sum of the pod's
//! container memory limits when each has one; else tmpfs's default), the
//! kubelet's `SizeMemoryBackedVolumes` sizing. Torn down by unmounting the
//! tmpfs and removing the directory (never across a mount).
//!
//! Differences: `sizeLimit` on disk is not enforced (the kubelet's eviction
//! manager evicts a pod that exceeds it; there is no eviction manager here);
//! the kubelet caps a Memory volume's size by the node's allocatable memory
//! too; `medium: HugePages*` is refused.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;

use super::plugin::{Attributes, PluginError, SetUpArgs, Spec, TearDownArgs, VolumePlugin};
use super::util::{is_mount_point, mount_tmpfs, remove_all_one_filesystem, unmount};
use evpleg_core::quantity::parse_units;

pub const PLUGIN_NAME: &str = "kubernetes.io/empty-dir";

#[derive(Debug)]
pub struct EmptyDirPlugin;

/// The tmpfs size of a Memory emptyDir (`calculateEmptyDirMemorySize`).
pub fn memory_size(size_limit: Option<&str>, pod: &Pod) -> Result<Option<i64>, PluginError> {
    if let Some(q) = size_limit {
        let bytes = parse_units(q)
            .map_err(|e| PluginError::Failed(format!("emptyDir sizeLimit {q:?}: {e}")))?;
        if bytes > 0 {
            return Ok(Some(bytes));
        }
    }
    let containers = pod.spec.iter().flat_map(|s| s.containers.iter());
    let mut sum = 0i64;
    for c in containers {
        let limit = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("memory"));
        match limit.map(|q| parse_units(&q.0)) {
            Some(Ok(b)) => sum += b,
            _ => return Ok(None),
        }
    }
    Ok((sum > 0).then_some(sum))
}

#[async_trait]
impl VolumePlugin for EmptyDirPlugin {
    fn name(&self) -> &'static str {
        PLUGIN_NAME
    }

    fn can_support(&self, spec: &Spec) -> bool {
        spec.inline().is_some_and(|v| v.empty_dir.is_some())
    }

    fn attributes(&self, _: &Spec) -> Attributes {
        Attributes {
            read_only: false,
            managed: true,
        }
    }

    async fn set_up(&self, args: SetUpArgs<'_>) -> Result<(), PluginError> {
        let source = args
            .spec
            .inline()
            .and_then(|v| v.empty_dir.clone())
            .unwrap_or_default();
        let dir = args.dir;
        std::fs::create_dir_all(dir).map_err(PluginError::io("create", dir))?;
        match source.medium.as_deref().unwrap_or_default() {
            "" => {}
            "Memory" => {
                if !is_mount_point(dir)? {
                    let limit = source.size_limit.as_ref().map(|q| q.0.as_str());
                    mount_tmpfs(dir, memory_size(limit, &args.pod.pod)?)?;
                }
            }
            other => {
                return Err(PluginError::Failed(format!(
                    "emptyDir medium {other:?} is not supported"
                )));
            }
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))
            .map_err(PluginError::io("chmod", dir))
    }

    async fn tear_down(&self, args: TearDownArgs<'_>) -> Result<(), PluginError> {
        tear_down_dir(args.dir)
    }
}

/// Unmounts what is mounted on `dir` (a tmpfs) and removes it.
pub fn tear_down_dir(dir: &Path) -> Result<(), PluginError> {
    if !dir.exists() {
        return Ok(());
    }
    if is_mount_point(dir)? {
        unmount(dir)?;
    }
    remove_all_one_filesystem(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_volume_sizes() {
        let pod = |limits: &[Option<&str>]| -> Pod {
            let containers: Vec<serde_json::Value> = limits
                .iter()
                .enumerate()
                .map(|(i, l)| match l {
                    Some(l) => serde_json::json!({"name": format!("c{i}"), "resources": {"limits": {"memory": l}}}),
                    None => serde_json::json!({"name": format!("c{i}")}),
                })
                .collect();
            serde_json::from_value(serde_json::json!({"spec": {"containers": containers}})).unwrap()
        };
        let cases = [
            (Some("64Mi"), vec![Some("1Gi")], Some(64 << 20)),
            (None, vec![Some("1Gi"), Some("1Gi")], Some(2 << 30)),
            (None, vec![Some("1Gi"), None], None),
            (None, vec![], None),
            (Some("0"), vec![Some("16Mi")], Some(16 << 20)),
        ];
        for (limit, containers, want) in cases {
            assert_eq!(
                memory_size(limit, &pod(&containers)).unwrap(),
                want,
                "{limit:?} {containers:?}"
            );
        }
        let err = memory_size(Some("lots"), &pod(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("emptyDir sizeLimit \"lots\""), "{err}");
    }
}

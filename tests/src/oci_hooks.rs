//! A runtime handler whose containers run an OCI `createContainer` hook: the
//! harness's containerd has, beside `runc` and `gated`, a runtime handler
//! [`HANDLER`] whose base runtime spec (`base_runtime_spec`, containerd's
//! default spec from `ctr oci spec` with a hook added) makes runc's init run
//! [`HOOK_SCRIPT`] in the container's cgroup before the entrypoint, as NVIDIA's
//! CDI hook or a node's own hooks do: the hook execs (`sh`, then `sleep`) and
//! exits 0 while the container is being created. The kernel PLEG must take
//! neither for the container's main process (issue #25).

use std::path::{Path, PathBuf};

/// The runtime handler (RunPodSandbox's `runtime_handler`) with the hook.
pub const HANDLER: &str = "hooked";

/// What the hook runs (`sh -c`): it reads the container's state from stdin,
/// as hooks do, then execs a short program.
pub const HOOK_SCRIPT: &str = "cat >/dev/null; exec sleep 0.05";

/// The base runtime spec's path under a containerd's base directory.
pub fn spec_path(base: &Path) -> PathBuf {
    base.join("hooked-spec.json")
}

/// Why the spec could not be written.
#[derive(Debug, thiserror::Error)]
pub enum HookSpecError {
    #[error("running `ctr oci spec` for {path}: {source}")]
    Ctr {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`ctr oci spec` for {path} failed: {stderr}")]
    CtrFailed { path: PathBuf, stderr: String },
    #[error("`ctr oci spec` for {path} printed no json object: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// `spec` (an OCI runtime spec) with [`HOOK_SCRIPT`] as its only
/// `createContainer` hook.
pub fn with_hook(mut spec: serde_json::Value) -> Option<serde_json::Value> {
    let hook = serde_json::json!({
        "path": "/bin/sh",
        "args": ["sh", "-c", HOOK_SCRIPT],
        "timeout": 10,
    });
    spec.as_object_mut()?.insert(
        "hooks".into(),
        serde_json::json!({ "createContainer": [hook] }),
    );
    Some(spec)
}

/// Writes the base runtime spec under `base` (containerd loads it at start).
pub fn install(base: &Path, ctr: &str) -> Result<(), HookSpecError> {
    let path = spec_path(base);
    let out = std::process::Command::new(ctr)
        .args(["oci", "spec"])
        .output()
        .map_err(|source| HookSpecError::Ctr {
            path: path.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(HookSpecError::CtrFailed {
            path,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let spec: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|source| HookSpecError::Json {
            path: path.clone(),
            source,
        })?;
    let spec = with_hook(spec).ok_or_else(|| HookSpecError::Json {
        path: path.clone(),
        source: serde::de::Error::custom("not an object"),
    })?;
    let text = serde_json::to_vec_pretty(&spec).expect("a json value serializes");
    std::fs::write(&path, text).map_err(|source| HookSpecError::Write { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hook_is_added_to_the_spec() {
        let spec = with_hook(serde_json::json!({"ociVersion": "1.0.2", "process": {}})).unwrap();
        assert_eq!(spec["hooks"]["createContainer"][0]["path"], "/bin/sh");
        assert_eq!(spec["hooks"]["createContainer"][0]["args"][2], HOOK_SCRIPT);
        assert_eq!(spec["ociVersion"], "1.0.2");
        assert!(with_hook(serde_json::json!([])).is_none());
    }
}

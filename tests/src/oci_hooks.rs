//! A runtime handler whose containers run an OCI `createContainer` hook: the
//! harness's containerd has, beside `runc` and `gated`, a runtime handler
//! [`HANDLER`] whose base runtime spec (`base_runtime_spec`, containerd's
//! default spec from `ctr oci spec` with a hook added) makes runc's init run
//! [`hook_script`] in the container's cgroup before the entrypoint, as NVIDIA's
//! CDI hook or a node's own hooks do: the hook execs (`sh`, then `sleep`) and
//! exits 0 while the container is being created. The kernel PLEG must take
//! neither for the container's main process (issue #25). While a [`Hold`]
//! exists the hook waits for its release: the container's creation (`runc
//! create`, and the shim's task Create around it) lasts until then.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The runtime handler (RunPodSandbox's `runtime_handler`) with the hook.
pub const HANDLER: &str = "hooked";

/// How long runc lets the hook run (the spec's `timeout`).
pub const HOOK_TIMEOUT: Duration = Duration::from_secs(10);

fn hold_path(base: &Path) -> PathBuf {
    base.join("hook-hold")
}

fn entered_path(base: &Path) -> PathBuf {
    base.join("hook-hold.entered")
}

/// What the hook runs (`sh -c`) for the containerd whose base is `base`: it
/// reads the container's state from stdin, as hooks do; while a [`Hold`]
/// exists it says so and waits for the release (the hook sees the host's
/// paths: runc runs it before `pivot_root`); then it execs a short program.
pub fn hook_script(base: &Path) -> String {
    let (hold, entered) = (hold_path(base), entered_path(base));
    let (hold, entered) = (hold.display(), entered.display());
    format!(
        "cat >/dev/null; if [ -e {hold} ]; then : >{entered}; \
         while [ -e {hold} ]; do sleep 0.01; done; fi; exec sleep 0.05"
    )
}

/// Holds the creation of the next hooked containers of a containerd: their
/// hook waits until [`Hold::release`] (or the drop, or runc's
/// [`HOOK_TIMEOUT`]).
#[derive(Debug)]
pub struct Hold {
    base: PathBuf,
}

impl Hold {
    pub fn new(base: &Path) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(entered_path(base));
        std::fs::write(hold_path(base), b"")?;
        Ok(Self {
            base: base.to_path_buf(),
        })
    }

    /// Whether a hook is waiting on the hold.
    pub fn entered(&self) -> bool {
        entered_path(&self.base).exists()
    }

    pub fn release(&self) {
        let _ = std::fs::remove_file(hold_path(&self.base));
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.release();
    }
}

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

/// `spec` (an OCI runtime spec) with `script` as its only `createContainer`
/// hook.
pub fn with_hook(mut spec: serde_json::Value, script: &str) -> Option<serde_json::Value> {
    let hook = serde_json::json!({
        "path": "/bin/sh",
        "args": ["sh", "-c", script],
        "timeout": HOOK_TIMEOUT.as_secs(),
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
    let spec = with_hook(spec, &hook_script(base)).ok_or_else(|| HookSpecError::Json {
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
        let script = hook_script(Path::new("/base"));
        let spec = with_hook(
            serde_json::json!({"ociVersion": "1.0.2", "process": {}}),
            &script,
        )
        .unwrap();
        assert_eq!(spec["hooks"]["createContainer"][0]["path"], "/bin/sh");
        assert_eq!(spec["hooks"]["createContainer"][0]["args"][2], script);
        assert_eq!(spec["ociVersion"], "1.0.2");
        assert!(with_hook(serde_json::json!([]), &script).is_none());
        assert!(script.contains("[ -e /base/hook-hold ]"), "{script}");
    }
}

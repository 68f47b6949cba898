//! Where the tests find the real Kubernetes parts that `cargo xtask setup` builds
//! from their Go modules (xtask/src/gotools.rs, docs/real-kubernetes.md):
//! kube-apiserver, etcd, the stock kubelet, crictl, critest, containerd 2.x and
//! its runc shim, linked as `<workspace>/.tools/go/bin/<name>`. This is no part
//! of the kubelet; it only locates the unmodified binaries the tests run beside
//! (or in front of) evpleg.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Variable naming another directory holding the binaries (e.g. a warm-up
/// build's output), used instead of `.tools/go/bin` when set.
pub const BIN_DIR_VAR: &str = "EVPLEG_GO_BIN_DIR";

/// The binaries the tests run, as setup names them.
pub const BINARIES: &[&str] = &[
    "kube-apiserver",
    "etcd",
    "kubelet",
    "crictl",
    "critest",
    "containerd",
    "containerd-shim-runc-v2",
];

/// Why a binary cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GoToolsError {
    #[error(
        "{path} is missing or not executable: `cargo xtask setup` builds {name} from its Go module"
    )]
    Missing { name: String, path: PathBuf },
}

/// The directory of the binaries: `$EVPLEG_GO_BIN_DIR`, or the workspace's
/// `.tools/go/bin`.
pub fn bin_dir() -> PathBuf {
    match std::env::var_os(BIN_DIR_VAR) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the tests crate lives in the workspace")
            .join(".tools/go/bin"),
    }
}

/// The path of the binary `name` (e.g. `kube-apiserver`), checked to be an
/// executable file.
pub fn binary(name: &str) -> Result<PathBuf, GoToolsError> {
    let path = bin_dir().join(name);
    let executable =
        std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if executable {
        Ok(path)
    } else {
        Err(GoToolsError::Missing {
            name: name.to_owned(),
            path,
        })
    }
}

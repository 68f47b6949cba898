//! A runtime handler that holds containerd's view of a start: the harness's
//! containerd has, beside `runc`, a runtime handler [`HANDLER`] whose runc is
//! a wrapper script: for `runc start <id>` it runs the real runc (the
//! container's entrypoint execs, the kernel sees it at once) and then, while
//! a hold file for `<id>` exists ([`Hold`]), does not return. The shim answers
//! containerd's task Start only then, and sends the task's exit event only
//! after it, so until the hold is released containerd's CRI says CREATED for
//! a container whose main process may already have run and exited: the
//! runtime's lag at a start (tens of milliseconds in normal runs, more under
//! load), made as long as a test needs. Every other runc call, and a start
//! without a hold, is the real runc's (`exec`).

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The runtime handler (RunPodSandbox's `runtime_handler`) with the gate.
pub const HANDLER: &str = "gated";

/// How long a held start waits at most (then it returns, as if released).
pub const HOLD_BOUND: Duration = Duration::from_secs(60);

/// The wrapper's path under a containerd's base directory.
pub fn wrapper_path(base: &Path) -> PathBuf {
    base.join("runc-gated")
}

fn holds_dir(base: &Path) -> PathBuf {
    base.join("start-holds")
}

/// The wrapper script for a containerd whose base is `base`, calling `runc`.
pub fn script(base: &Path, runc: &str) -> String {
    let holds = holds_dir(base);
    let holds = holds.display();
    let polls = HOLD_BOUND.as_millis() / 10;
    format!(
        r#"#!/bin/sh
# Written by evpleg's test harness (tests/src/start_gate.rs): runc, except
# that `start <id>` returns only once {holds}/<id> is gone.
for id; do :; done
case " $* " in
  *" start "*) ;;
  *) exec {runc} "$@" ;;
esac
{runc} "$@" || exit $?
n=0
while [ -e "{holds}/$id" ] && [ "$n" -lt {polls} ]; do
  sleep 0.01
  n=$((n + 1))
done
exit 0
"#
    )
}

/// Writes the wrapper and the holds directory under `base`.
pub fn install(base: &Path, runc: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(holds_dir(base))?;
    let path = wrapper_path(base);
    std::fs::write(&path, script(base, runc))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
}

/// A held start: while it lives, `runc start` of the container does not
/// return (at most [`HOLD_BOUND`]); released when dropped.
#[derive(Debug)]
pub struct Hold {
    path: PathBuf,
}

impl Hold {
    /// Holds the start of container `id` of the containerd based at `base`
    /// (call before StartContainer).
    pub fn new(base: &Path, id: &str) -> Self {
        let path = holds_dir(base).join(id);
        std::fs::write(&path, b"").unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self { path }
    }

    /// Lets the start return.
    pub fn release(self) {}
}

impl Drop for Hold {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

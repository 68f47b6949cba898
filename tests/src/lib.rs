//! Support for evpleg's privileged and end-to-end tests: capability checks that
//! skip with a reason (and fail under `CI=true`), cgroups that mimic the kubelet's
//! pod and container layouts and are removed even when a test fails, processes
//! started inside them, and a running kernel PLEG with a tap on its records.

pub mod api_fixtures;
pub mod cgroups;
pub mod cni;
pub mod containerd;
pub mod control_plane;
pub mod cri_interceptor;
pub mod cri_pod;
pub mod cri_proxy;
pub mod critest;
pub mod csi_driver;
pub mod differential;
pub mod e2e;
pub mod fake_apiserver;
pub mod go_tools;
pub mod kernel_checks;
pub mod killable;
pub mod oci_hooks;
pub mod pleg;
pub mod ports;
pub mod registry;
pub mod start_gate;
pub mod stock_kubelet;
pub mod threads;
pub mod tls;

use std::path::Path;

/// Whether privileged tests can run here. Prints why not and returns `false`, so
/// the test can return early; under `CI=true` a missing capability is a failure.
pub fn privileged(test: &str) -> bool {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root (euid 0)");
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        missing.push("kernel BTF (/sys/kernel/btf/vmlinux)");
    }
    if evpleg_pleg::kernel::index::cgroup2_mount()
        .ok()
        .flatten()
        .is_none()
    {
        missing.push("a cgroup2 hierarchy");
    }
    if !evpleg_pleg::kernel::loader::embedded_object_present() {
        missing.push("the eBPF object (run `cargo xtask build` or `cargo xtask test`)");
    }
    if missing.is_empty() {
        return true;
    }
    skip(test, &format!("needs {}", missing.join(", ")));
    false
}

/// Prints why `test` does not run here, and returns so that the test can return
/// early; under `CI=true` a skip is a failure instead.
pub fn skip(test: &str, why: &str) {
    let reason = format!("{test}: {why}");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{reason}; CI=true, so this is a failure, not a skip");
    }
    eprintln!("SKIPPED {reason}");
}

/// Whether the real container runtime can run here (root and cgroup2, for the
/// containerd harness), for tests of the CRI alone that need no eBPF. Prints why
/// not and returns `false`; under `CI=true` a missing capability is a failure.
pub fn runtime_available(test: &str) -> bool {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root (euid 0)");
    }
    if evpleg_pleg::kernel::index::cgroup2_mount()
        .ok()
        .flatten()
        .is_none()
    {
        missing.push("a cgroup2 hierarchy");
    }
    if missing.is_empty() {
        return true;
    }
    let reason = format!("{test}: needs {}", missing.join(", "));
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{reason}; CI=true, so this is a failure, not a skip");
    }
    eprintln!("SKIPPED {reason}");
    false
}

/// A fresh 64-bit value for unique names (no randomness crate needed).
pub fn unique_u64() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = t
        ^ (u64::from(std::process::id()) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    // splitmix64 finaliser
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A random pod UID in the UUID shape.
pub fn pod_uid() -> String {
    let (a, b) = (unique_u64(), unique_u64());
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        b >> 52,
        b & 0xffff_ffff_ffff
    )
}

/// A random 64-hex container id.
pub fn container_id() -> String {
    (0..4).map(|_| format!("{:016x}", unique_u64())).collect()
}

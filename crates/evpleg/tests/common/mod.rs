//! What the binary's privileged tests share.

/// Whether the test can run: root, kernel BTF and `extra` (name, present).
/// Without them it says why and returns false; under `CI=true` that is a
/// failure.
pub fn can_run(test: &str, extra: &[(&str, bool)]) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let btf = std::path::Path::new("/sys/kernel/btf/vmlinux").exists();
    let missing: Vec<&str> = [("root", root), ("kernel BTF", btf)]
        .iter()
        .chain(extra)
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| *name)
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = format!("{test}: needs {}", missing.join(", "));
    assert!(
        std::env::var("CI").map_or(true, |v| v != "true"),
        "{why}; CI=true, so this is a failure"
    );
    eprintln!("SKIPPED {why}");
    false
}

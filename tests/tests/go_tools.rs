//! The real Kubernetes parts that `cargo xtask setup` builds from their Go
//! modules: each is where the tests look for it (`.tools/go/bin/<name>`, a link
//! to `<name>-<version>/<name>`) and reports the version its directory names.

use std::process::Command;

use evpleg_tests::go_tools::{BIN_DIR_VAR, BINARIES, bin_dir, binary};

#[test]
fn each_go_built_binary_reports_the_version_its_directory_names() {
    if std::env::var_os(BIN_DIR_VAR).is_some() {
        evpleg_tests::skip(
            "go_tools",
            &format!("{BIN_DIR_VAR} is set: its binaries are not setup's versioned links"),
        );
        return;
    }
    for name in BINARIES {
        let path = match binary(name) {
            Ok(path) => path,
            Err(e) => {
                evpleg_tests::skip("go_tools", &e.to_string());
                return;
            }
        };
        let target = std::fs::read_link(bin_dir().join(name))
            .unwrap_or_else(|e| panic!("{} is not a link: {e}", path.display()));
        let dir = target
            .parent()
            .and_then(|d| d.file_name())
            .and_then(|d| d.to_str())
            .unwrap_or_else(|| panic!("{} links to {}", path.display(), target.display()));
        let version = dir
            .strip_prefix(&format!("{name}-v"))
            .unwrap_or_else(|| panic!("{} links to {dir}, not {name}-v<version>", path.display()));
        // The shim has no --version; -v prints its version.
        let flag = if *name == "containerd-shim-runc-v2" {
            "-v"
        } else {
            "--version"
        };
        let out = Command::new(&path)
            .arg(flag)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", path.display()));
        let shown = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{} {flag}: {}",
            path.display(),
            out.status
        );
        assert!(
            shown.contains(version),
            "{} {flag} printed {shown:?}, not version {version}",
            path.display()
        );
    }
}

//! `cargo xtask setup`: installs what is missing, idempotently, and says what it
//! does. Also run by `build`, `run` and `test`. A second run only checks (a few
//! `dpkg-query`/`rustc -vV` calls, the Go binaries' stamps) and takes well under 5 s.
//!
//! What is needed (see docs/development.md):
//! * the nightly toolchain with rust-src, whose LLVM major is [`LLVM_MAJOR`], for the
//!   BPF target;
//! * LLVM 22's development packages and bpf-linker [`BPF_LINKER_VERSION`] built
//!   against them, installed under `.tools/` (not committed);
//! * containerd, runc, umoci and busybox-static for the runtime tests;
//! * containernetworking-plugins (with iproute2 and iptables) for pods' own
//!   network namespaces: the harness's private CNI bridge (tests/src/cni.rs);
//! * docker-registry (distribution 2.8) and skopeo for the image pull tests: the
//!   harness starts its own registry on loopback (tests/src/registry.rs). The
//!   package's own service is not used (Debian's policy-rc.d on these machines
//!   keeps it from starting at install time; elsewhere it listens on :5000);
//! * qemu-system-x86 and cpio for the kernel matrix (busybox-static too);
//! * the real Kubernetes parts, built from their Go modules under `.tools/go/`
//!   (xtask/src/gotools.rs): kube-apiserver, etcd, the kubelet, crictl, critest,
//!   containerd 2.x and its runc shim. Once built, a second run only compares
//!   their stamps;
//! * a kernel with BTF and a cgroup2 hierarchy. No tracefs: the programs are BTF
//!   tracepoints.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::gotools;
use crate::util::{self, info, output, step};

/// LLVM major version of the nightly and of the LLVM bpf-linker is built against.
pub const LLVM_MAJOR: u32 = 22;
pub const BPF_LINKER_VERSION: &str = "0.13.0";

/// Debian packages the build and the tests need.
const APT_PACKAGES: &[&str] = &[
    // bpf-linker's build
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    // the container runtime and locally built images for the tests
    "containerd",
    "runc",
    "umoci",
    "busybox-static",
    // pods' own networks: the CNI plugins containerd's CRI plugin runs
    // (bridge, host-local, portmap, loopback), `ip` to remove the harness's
    // bridges, iptables for portmap's hostPort rules
    "containernetworking-plugins",
    "iproute2",
    "iptables",
    // the tests' private image registry (loopback only) and the push into it
    "docker-registry",
    "skopeo",
    // HTTPS probes' tests: self-signed certificates made at test time
    "openssl",
    // the kernel matrix: guests under QEMU, their initramfs
    "qemu-system-x86",
    "cpio",
];

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

pub fn run(root: &Path) -> Result<()> {
    let started = Instant::now();
    step("setup: checking the host and the toolchain");
    check_kernel()?;
    ensure_nightly()?;
    ensure_apt_packages()?;
    ensure_bpf_linker(root)?;
    gotools::ensure(root)?;
    info(&format!(
        "setup complete in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

fn check_kernel() -> Result<()> {
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        bail!(
            "this kernel has no BTF (/sys/kernel/btf/vmlinux is missing): evpleg needs \
             Linux >= 5.8 built with CONFIG_DEBUG_INFO_BTF=y"
        );
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    if !mountinfo.lines().any(|l| l.contains(" - cgroup2 ")) {
        bail!("no cgroup2 hierarchy is mounted: evpleg needs cgroup2 (or the hybrid layout)");
    }
    info("kernel: BTF and cgroup2 present");
    Ok(())
}

fn nightly_llvm_major() -> Option<u32> {
    let version = output(Command::new("rustc").args(["+nightly", "-vV"]))?;
    version
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.parse().ok())
}

fn ensure_nightly() -> Result<()> {
    if nightly_llvm_major().is_none() {
        info(
            "installing: the nightly toolchain (rustup toolchain install nightly --profile minimal --component rust-src)",
        );
        util::run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
    }
    match nightly_llvm_major() {
        Some(LLVM_MAJOR) => {}
        Some(other) => bail!(
            "the nightly toolchain uses LLVM {other}, but bpf-linker {BPF_LINKER_VERSION} is \
             built against LLVM {LLVM_MAJOR}: install a nightly with LLVM {LLVM_MAJOR} \
             (e.g. `rustup toolchain install nightly-2026-05-19` and make it `nightly`)"
        ),
        None => bail!("`rustc +nightly -vV` does not run after installing the nightly"),
    }
    let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))
        .context("`rustc +nightly --print sysroot` failed")?;
    let core_src = Path::new(sysroot.trim()).join("lib/rustlib/src/rust/library/core");
    if !core_src.exists() {
        info(
            "installing: rust-src for the nightly (rustup component add rust-src --toolchain nightly)",
        );
        util::run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    info(&format!("nightly: LLVM {LLVM_MAJOR}, rust-src present"));
    Ok(())
}

fn missing_packages() -> Vec<&'static str> {
    let mut cmd = Command::new("dpkg-query");
    cmd.args(["-W", "-f", "${Package} ${Status}\n"])
        .args(APT_PACKAGES);
    let installed = output(&mut cmd).unwrap_or_default();
    // dpkg-query fails when one package is unknown; parse what it printed anyway.
    let installed = if installed.is_empty() {
        Command::new("dpkg-query")
            .args(["-W", "-f", "${Package} ${Status}\n"])
            .args(APT_PACKAGES)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    } else {
        installed
    };
    APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            !installed
                .lines()
                .any(|l| l.starts_with(&format!("{p} ")) && l.ends_with("install ok installed"))
        })
        .collect()
}

fn ensure_apt_packages() -> Result<()> {
    let missing = missing_packages();
    if missing.is_empty() {
        info(&format!("packages: {} present", APT_PACKAGES.join(", ")));
        return Ok(());
    }
    let list = missing.join(" ");
    if !is_root() {
        bail!(
            "missing Debian packages: {list}. Run as root:\n    apt-get update && \
             DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {list}\n\
             then run this command again"
        );
    }
    info(&format!("installing: {list} (apt-get)"));
    util::run(Command::new("apt-get").args(["update", "-q"]))?;
    util::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing),
    )
}

fn ensure_bpf_linker(root: &Path) -> Result<()> {
    let tools = util::tools_dir(root);
    let linker = tools.join("bin/bpf-linker");
    let wanted = format!("bpf-linker {BPF_LINKER_VERSION}");
    if output(Command::new(&linker).arg("--version")).is_some_and(|v| v.trim() == wanted) {
        info(&format!("{wanted}: {}", linker.display()));
        return Ok(());
    }
    info(&format!(
        "installing: {wanted} against LLVM {LLVM_MAJOR} into {} (cargo install, a few minutes once)",
        tools.display()
    ));
    let llvm = format!("/usr/lib/llvm-{LLVM_MAJOR}");
    util::run(
        Command::new("cargo")
            .env("LLVM_PREFIX", &llvm)
            .env(format!("LLVM_SYS_{LLVM_MAJOR}1_PREFIX"), &llvm)
            .env_remove("RUSTUP_TOOLCHAIN")
            .env_remove("CARGO_TARGET_DIR")
            .args([
                "+stable",
                "install",
                "bpf-linker",
                "--locked",
                "--version",
                BPF_LINKER_VERSION,
            ])
            .args([
                "--no-default-features",
                "--features",
                &format!("llvm-{LLVM_MAJOR}"),
            ])
            .arg("--root")
            .arg(&tools),
    )
}

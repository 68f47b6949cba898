//! Process helpers shared by the tasks.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Prints a step with the time since xtask started, so a CI log shows where the
/// minutes went.
pub fn step(msg: &str) {
    let elapsed = started().elapsed().as_secs();
    eprintln!(
        "\x1b[1mxtask [{:>2}:{:02}]:\x1b[0m {msg}",
        elapsed / 60,
        elapsed % 60
    );
}

/// When xtask started (the first call fixes it; `main` calls it first).
pub fn started() -> std::time::Instant {
    static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *STARTED.get_or_init(std::time::Instant::now)
}

pub fn info(msg: &str) {
    eprintln!("xtask:   {msg}");
}

/// Runs `cmd`, failing with the command line when it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Runs `cmd` and returns its stdout, or `None` when it cannot run or fails.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The project's tool directory (bpf-linker, the Go-built binaries), not committed.
pub fn tools_dir(root: &Path) -> PathBuf {
    root.join(".tools")
}

/// `cargo` for the stable, user-space workspace.
pub fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root);
    // `cargo run` sets these for xtask; some build scripts (ring's) rerun when they
    // change, so a build from xtask would not reuse one made from a shell.
    for var in [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_PKG_NAME",
        "CARGO_PKG_VERSION",
        "CARGO_PKG_VERSION_MAJOR",
        "CARGO_PKG_VERSION_MINOR",
        "CARGO_PKG_VERSION_PATCH",
        "CARGO_PKG_VERSION_PRE",
        "CARGO_PKG_AUTHORS",
        "CARGO_PKG_DESCRIPTION",
        "CARGO_PKG_HOMEPAGE",
        "CARGO_PKG_REPOSITORY",
        "CARGO_PKG_LICENSE",
        "CARGO_PKG_LICENSE_FILE",
        "CARGO_PKG_RUST_VERSION",
        "CARGO_PKG_README",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
    ] {
        cmd.env_remove(var);
    }
    // CI builds once in a fresh clone: incremental data would only double the
    // target directory (about 5 GiB of a 2-core machine's disk).
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        cmd.env("CARGO_INCREMENTAL", "0");
    }
    cmd
}

/// `cargo +nightly` in `dir` for the BPF target: rustup's variables from the
/// parent (RUSTUP_TOOLCHAIN=stable in particular) are removed so that they do not
/// silently override the nightly, and bpf-linker is put on the PATH.
pub fn nightly_cargo(root: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.arg("+nightly").current_dir(dir);
    // Target, build-std and the BTF flags are in ebpf/programs/.cargo/config.toml.
    for var in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO",
    ] {
        cmd.env_remove(var);
    }
    let path = std::env::var("PATH").unwrap_or_default();
    cmd.env(
        "PATH",
        format!("{}:{path}", tools_dir(root).join("bin").display()),
    );
    cmd
}

/// Runs the agent while creating a container-like cgroup and running a few
/// processes in it, so that lifecycle events show without a container runtime.
pub fn demo(agent: &Path, args: &[String]) -> Result<()> {
    let cgroup2 = cgroup2_mount().context("no cgroup2 hierarchy mounted")?;
    let uid = format!(
        "{:08x}-0000-4000-8000-{:012x}",
        std::process::id(),
        now_ns() % (1 << 48)
    );
    let container = format!("{:064x}", now_ns() as u128 * 0x9e37_79b9_7f4a_7c15u128);
    let container = &container[container.len() - 64..];
    let pod_dir = cgroup2.join(format!("kubepods/besteffort/pod{uid}"));
    let dir = pod_dir.join(container);
    step(&format!("demo: pod {uid}, container {container}"));
    let mut child = Command::new(agent)
        .args(["observe", "--cri-endpoint", "none", "--run-for", "6s"])
        .args(args)
        .spawn()
        .with_context(|| format!("cannot start {}", agent.display()))?;
    // The agent reports the root's creation too; give it time to attach first.
    std::thread::sleep(Duration::from_secs(2));
    let created = created_dirs(&cgroup2, &dir)?;
    let procs = dir.join("cgroup.procs");
    let script = format!(
        "echo $$ > {p}; exec sh -c 'sh -c \"exit 0\"; sleep 0.2; exit 7'",
        p = procs.display()
    );
    run(Command::new("sh").args(["-c", &script])).or_else(|e| {
        if e.to_string().contains("exit status: 7") {
            Ok(())
        } else {
            Err(e)
        }
    })?;
    let sleep_script = format!("echo $$ > {p}; exec sleep 30", p = procs.display());
    let mut sleeper = Command::new("sh").args(["-c", &sleep_script]).spawn()?;
    std::thread::sleep(Duration::from_millis(300));
    sleeper.kill()?;
    sleeper.wait()?;
    for d in created.iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("the agent failed: {status}");
    }
    Ok(())
}

/// Creates `dir` and its missing ancestors below `base`, returning those created.
fn created_dirs(base: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let mut missing = Vec::new();
    let mut d = dir.to_path_buf();
    while d.starts_with(base) && d != base && !d.exists() {
        missing.push(d.clone());
        d = d.parent().expect("below base").to_path_buf();
    }
    missing.reverse();
    for m in &missing {
        std::fs::create_dir(m).with_context(|| format!("cannot create cgroup {}", m.display()))?;
    }
    Ok(missing)
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn cgroup2_mount() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mount_point = left.split_whitespace().nth(4)?;
        (right.split_whitespace().next()? == "cgroup2").then(|| PathBuf::from(mount_point))
    })
}

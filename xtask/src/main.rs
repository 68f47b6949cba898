//! evpleg's developer tasks. `cargo xtask <command>`:
//!
//! * `setup`: installs what is missing (idempotent, says what it does);
//! * `build`: builds the eBPF object (nightly, BPF target, with BTF) and the agent;
//! * `run`: builds, then runs the agent on this host;
//! * `test`: builds and runs every test tier, privileged ones included, and the
//!   format and lint checks, then the kernel matrix;
//! * `matrix`: only the kernel matrix (privileged checks in QEMU guests booting
//!   Debian's kernels, docs/kernels.md);
//! * `bench`: the PLEG latency and cost benchmark (`bench/`, docs/benchmarks.md);
//! * `fidelity`: the same pods under the stock kubelet and evpleg, compared
//!   (docs/fidelity.md).

mod fidelity;
mod fuzz;
mod gotools;
mod matrix;
mod setup;
mod util;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "evpleg developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what is missing: toolchain parts, LLVM 22, bpf-linker, containerd...,
    /// and build the real Kubernetes parts from their Go modules (cached)
    Setup,
    /// Build the eBPF object and the agent.
    Build {
        /// Build the agent with the release profile.
        #[arg(long)]
        release: bool,
    },
    /// Build and run the agent on this host (arguments after `--` go to the agent).
    Run {
        /// Also create a container-like cgroup and run a few processes in it, so
        /// that events show up without a container runtime.
        #[arg(long)]
        demo: bool,
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build and run every test tier, then the kernel matrix.
    Test {
        /// Kernels of the matrix run after the host tests: `all`, `none`, or a
        /// comma-separated list of series (6.1,6.12,6.16,6.18,7.3).
        #[arg(long, default_value = "all")]
        kernels: matrix::Selection,
        /// The containerd the suites run on: Debian's `1.6`, or `2` (the
        /// containerd 2.x setup builds; the runtime matrix of
        /// docs/stock-kubelet.md). Tests of 1.6's or 1.7's own behaviour keep
        /// their version.
        #[arg(long, value_enum, default_value_t = Runtime::Debian)]
        containerd: Runtime,
        /// Arguments passed to `cargo test` after `--`.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Run only the kernel matrix: the privileged checks in QEMU guests.
    Matrix {
        /// `all`, `none`, or a comma-separated list of series (6.1,6.12,...).
        #[arg(long, default_value = "all")]
        kernels: matrix::Selection,
        /// Load this eBPF object in the guests instead of the embedded one.
        #[arg(long)]
        bpf_object: Option<PathBuf>,
        /// Seconds before a guest is killed.
        #[arg(long, default_value_t = matrix::DEFAULT_TIMEOUT.as_secs())]
        timeout: u64,
    },
    /// Fuzz the decoders a hostile pod, peer or runtime reaches (cargo-fuzz on
    /// the nightly, installed under .tools/ if missing); the test tier replays
    /// the corpus this grows.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Targets to run (default: all of fuzz/fuzz_targets/).
        targets: Vec<String>,
    },
    /// The PLEG benchmark: every mode against the same containerd; writes
    /// docs/benchmarks.md and bench/results/ (needs root).
    Bench {
        /// A short run (fewer repetitions and pods); written under target/bench-quick unless
        /// `--out` says otherwise.
        #[arg(long)]
        quick: bool,
        /// Build the benchmark (and the agent's code in it) with the release
        /// profile, as a node runs it; the default is the dev profile the
        /// tests use (no second build).
        #[arg(long)]
        release: bool,
        /// Directory receiving docs/benchmarks.md and bench/results/ (default:
        /// the workspace, or target/bench-quick with `--quick`).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// The corpus of tests/fidelity/ under the stock kubelet and under evpleg,
    /// compared field by field; writes docs/fidelity.md (needs root).
    Fidelity {
        /// Only the quick subset (the one `cargo xtask test` runs), reported
        /// in target/fidelity-quick.md.
        #[arg(long)]
        quick: bool,
        /// Instead: the whole corpus under the stock kubelet directly and
        /// behind `evpleg cri-proxy` with its Evented PLEG, against the API
        /// server; fails on any difference that is not timing.
        #[arg(long, conflicts_with = "quick")]
        proxy: bool,
    },
}

fn main() -> Result<()> {
    util::started();
    let cli = Cli::parse();
    let root = util::workspace_root();
    match cli.command {
        Command::Setup => setup::run(&root),
        Command::Fuzz { seconds, targets } => fuzz::run_targets(&root, seconds, &targets),
        Command::Build { release } => {
            setup::run(&root)?;
            build(&root, release)
        }
        Command::Run { demo, args } => {
            setup::run(&root)?;
            build(&root, true)?;
            run(&root, demo, &args)
        }
        Command::Test {
            kernels,
            containerd,
            args,
        } => {
            setup::run(&root)?;
            test(&root, &args, kernels, containerd)
        }
        Command::Bench {
            quick,
            release,
            out,
        } => {
            setup::run(&root)?;
            bench(&root, quick, release, out)
        }
        Command::Fidelity { quick, proxy } => {
            setup::run(&root)?;
            fidelity::run(&root, quick, proxy)
        }
        Command::Matrix {
            kernels,
            bpf_object,
            timeout,
        } => {
            setup::run(&root)?;
            build_ebpf(&root)?;
            let bpf_object = bpf_object.map(std::path::absolute).transpose()?;
            matrix::run(
                &root,
                &matrix::Options {
                    kernels,
                    bpf_object,
                    timeout: std::time::Duration::from_secs(timeout),
                },
            )
        }
    }
}

/// Where `cargo xtask build` puts the eBPF object; `crates/pleg/build.rs` embeds it.
fn bpf_object(root: &std::path::Path) -> PathBuf {
    root.join("target/ebpf/evpleg.bpf.o")
}

/// Builds the kernel programs with nightly for bpfel-unknown-none.
fn build_ebpf(root: &std::path::Path) -> Result<()> {
    util::step("building the eBPF object (nightly, bpfel-unknown-none)");
    let dir = root.join("ebpf/programs");
    let mut cmd = util::nightly_cargo(root, &dir);
    cmd.args(["build", "--release"]);
    util::run(&mut cmd)?;
    let built = dir.join("target/bpfel-unknown-none/release/evpleg");
    let dest = bpf_object(root);
    std::fs::create_dir_all(dest.parent().expect("has a parent"))?;
    // Only replace the embedded object when it changed, so cargo does not rebuild
    // the agent for nothing.
    let new = std::fs::read(&built)?;
    if std::fs::read(&dest).ok().as_deref() != Some(new.as_slice()) {
        std::fs::write(&dest, &new)?;
    }
    util::info(&format!(
        "eBPF object: {} ({} bytes)",
        dest.display(),
        new.len()
    ));
    Ok(())
}

fn build(root: &std::path::Path, release: bool) -> Result<()> {
    build_ebpf(root)?;
    util::step("building the agent");
    let mut cmd = util::cargo(root);
    cmd.args(["build", "--package", "evpleg", "--bin", "evpleg"]);
    if release {
        cmd.arg("--release");
    }
    util::run(&mut cmd)
}

fn run(root: &std::path::Path, demo: bool, args: &[String]) -> Result<()> {
    let agent = root.join("target/release/evpleg");
    if demo {
        return util::demo(&agent, args);
    }
    if args.iter().any(|a| a.starts_with("--cri-endpoint"))
        || std::env::var_os("EVPLEG_CRI_ENDPOINT").is_some()
    {
        util::step("running the agent against the given runtime (Ctrl-C stops it)");
        return util::run(std::process::Command::new(&agent).arg("run").args(args));
    }
    // No runtime given: a private containerd, and the example pods.
    util::step("building the containerd harness");
    util::run(util::cargo(root).args([
        "build",
        "--release",
        "--package",
        "evpleg-tests",
        "--bin",
        "containerd-harness",
    ]))?;
    let mut harness = std::process::Command::new(root.join("target/release/containerd-harness"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let endpoint = {
        use std::io::BufRead;
        let out = harness.stdout.take().expect("piped");
        let mut lines = std::io::BufReader::new(out).lines();
        let endpoint = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|l| l.strip_prefix("endpoint=").map(str::to_owned));
        // Keep reading what it prints afterwards (its teardown): a closed pipe
        // would make its output fail and cut the teardown short.
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                println!("{line}");
            }
        });
        endpoint
    };
    let Some(endpoint) = endpoint else {
        let _ = harness.wait();
        anyhow::bail!("the containerd harness did not start (see its log above)");
    };
    let logs = std::env::temp_dir().join("evpleg-xtask-run-logs");
    // The agent's state (the pods' managed /etc/hosts), removed on exit.
    let state = std::env::temp_dir().join("evpleg-xtask-run-root");
    util::step(&format!(
        "running the agent with a private containerd ({endpoint}) and the pods of examples/; \
         statuses at http://127.0.0.1:10255/pods (Ctrl-C stops it)"
    ));
    let status = std::process::Command::new(&agent)
        .arg("run")
        .arg("--cri-endpoint")
        .arg(&endpoint)
        .arg("--manifest-dir")
        .arg(root.join("examples"))
        .arg("--pod-log-dir")
        .arg(&logs)
        .arg("--root-dir")
        .arg(&state)
        .args(args)
        .status();
    // Closing its stdin tears the harness down: pods (their network
    // namespaces and addresses), containerd, the CNI bridge, cgroups.
    drop(harness.stdin.take());
    let _ = harness.wait();
    let _ = std::fs::remove_dir_all(&state);
    let status = status?;
    if !status.success() && status.code() != Some(130) {
        anyhow::bail!("the agent failed: {status}");
    }
    Ok(())
}

/// The containerd of the test suites (`cargo xtask test --containerd`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Runtime {
    /// Debian's containerd 1.6 (the default).
    #[value(name = "1.6")]
    Debian,
    /// The containerd 2.x that setup builds from its Go module.
    #[value(name = "2")]
    Two,
}

fn test(
    root: &std::path::Path,
    args: &[String],
    kernels: matrix::Selection,
    containerd: Runtime,
) -> Result<()> {
    build_ebpf(root)?;
    util::step("checking formatting");
    util::run(util::cargo(root).args(["fmt", "--all", "--check"]))?;
    util::step("clippy on the user-space crates");
    util::run(util::cargo(root).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    util::step("clippy on the eBPF crate (its own target)");
    let dir = root.join("ebpf/programs");
    util::run(util::nightly_cargo(root, &dir).args([
        "clippy",
        "--release",
        "--",
        "-D",
        "warnings",
    ]))?;
    util::step("running every test tier (unit, privileged, end-to-end)");
    let mut cmd = util::cargo(root);
    cmd.args(["test", "--workspace"]);
    if containerd == Runtime::Two {
        let binary = gotools::go_dir(root).join("bin/containerd");
        util::step(&format!(
            "the suites run on containerd 2.x: EVPLEG_TEST_CONTAINERD={}",
            binary.display()
        ));
        cmd.env("EVPLEG_TEST_CONTAINERD", binary);
    }
    if !args.is_empty() {
        cmd.arg("--").args(args);
    }
    util::run(&mut cmd)?;
    matrix::run(
        root,
        &matrix::Options {
            kernels,
            bpf_object: None,
            timeout: matrix::DEFAULT_TIMEOUT,
        },
    )
}

/// Builds the eBPF object and the benchmark, then runs it (as the tests are
/// built: the dev profile, so that no second full build is needed).
fn bench(root: &std::path::Path, quick: bool, release: bool, out: Option<PathBuf>) -> Result<()> {
    build_ebpf(root)?;
    util::step("building the benchmark");
    let mut build = util::cargo(root);
    build.args(["build", "--package", "evpleg-bench"]);
    if release {
        build.arg("--release");
    }
    util::run(&mut build)?;
    let out = match out {
        Some(out) => std::path::absolute(out)?,
        None if quick => root.join("target/bench-quick"),
        None => root.to_path_buf(),
    };
    let mut command = String::from("cargo xtask bench");
    if quick {
        command.push_str(" --quick");
    }
    if release {
        command.push_str(" --release");
    }
    util::step(&format!(
        "running the benchmark (results under {})",
        out.display()
    ));
    let profile = if release { "release" } else { "debug" };
    let mut cmd =
        std::process::Command::new(root.join("target").join(profile).join("evpleg-bench"));
    cmd.arg("--out").arg(&out).arg("--command").arg(&command);
    if quick {
        cmd.arg("--quick");
    }
    util::run(&mut cmd)
}

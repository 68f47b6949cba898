//! `cargo xtask fuzz`: the decoders a hostile pod, peer or runtime reaches
//! (crates/fuzz-targets) under libFuzzer, with cargo-fuzz on the nightly the
//! eBPF build already uses. cargo-fuzz is installed under `.tools/` when it is
//! not on the PATH. Each target starts from, and adds what it finds to,
//! `fuzz/corpus/<target>/`, which the test tier replays; a crash stops the run
//! and libFuzzer names the input it wrote under `fuzz/artifacts/`.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{info, nightly_cargo, output, run, step, tools_dir};

/// The targets, as `fuzz/fuzz_targets/<name>.rs` holds them.
fn targets(root: &Path) -> Result<Vec<String>> {
    let dir = root.join("fuzz/fuzz_targets");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .with_context(|| format!("{}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".rs"))
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    Ok(names)
}

/// cargo-fuzz on the PATH (with `.tools/bin` first), installing it there if
/// it is not.
fn ensure_cargo_fuzz(root: &Path) -> Result<()> {
    if output(nightly_cargo(root, root).args(["fuzz", "--version"])).is_some() {
        return Ok(());
    }
    step("installing: cargo-fuzz (cargo install cargo-fuzz --locked --root .tools)");
    run(Command::new("cargo")
        .args(["install", "cargo-fuzz", "--locked", "--root"])
        .arg(tools_dir(root)))?;
    if output(nightly_cargo(root, root).args(["fuzz", "--version"])).is_none() {
        bail!("cargo fuzz does not run after installing it under .tools/bin");
    }
    Ok(())
}

/// Runs each of `wanted` (all targets when empty) for `seconds`.
pub fn run_targets(root: &Path, seconds: u64, wanted: &[String]) -> Result<()> {
    let all = targets(root)?;
    for w in wanted {
        if !all.contains(w) {
            bail!("no fuzz target {w:?}; the targets are {}", all.join(", "));
        }
    }
    let chosen: Vec<&String> = if wanted.is_empty() {
        all.iter().collect()
    } else {
        all.iter().filter(|t| wanted.contains(t)).collect()
    };
    ensure_cargo_fuzz(root)?;
    for target in chosen {
        step(&format!("fuzzing {target} for {seconds} s"));
        let corpus = root.join("fuzz/corpus").join(target);
        run(nightly_cargo(root, root)
            .args(["fuzz", "run", target.as_str()])
            .arg(&corpus)
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .args(["-timeout=10", "-rss_limit_mb=4096", "-print_final_stats=1"]))
        .with_context(|| format!("fuzz target {target} failed; see fuzz/artifacts/{target}/"))?;
        let inputs = std::fs::read_dir(&corpus).map(|d| d.count()).unwrap_or(0);
        info(&format!(
            "{target}: no failure in {seconds} s; corpus now {inputs} inputs"
        ));
    }
    Ok(())
}

//! `cargo xtask fidelity`: the differential fidelity run (issue #31). The
//! corpus of tests/fidelity/ under the stock kubelet 1.37 and under `evpleg
//! run`, compared field by field by tests/tests/fidelity_diff.rs, whose report
//! becomes docs/fidelity.md (the whole corpus) or target/fidelity-quick.md
//! (`--quick`, the subset `cargo xtask test` runs). Needs root, the stock
//! kubelet (`cargo xtask setup` builds it) and containerd 1.7 (fetched by the
//! tests' harness).

use std::path::Path;

use anyhow::Result;

use crate::util;

/// Builds the eBPF object, then runs the comparison and writes its report.
pub fn run(root: &Path, quick: bool) -> Result<()> {
    crate::build_ebpf(root)?;
    let (test, out) = if quick {
        (
            "the_quick_corpus_behaves_as_under_the_stock_kubelet",
            root.join("target/fidelity-quick.md"),
        )
    } else {
        ("whole_corpus", root.join("docs/fidelity.md"))
    };
    util::step(&format!(
        "the corpus under the stock kubelet and under evpleg (report: {})",
        out.display()
    ));
    let mut cmd = util::cargo(root);
    cmd.args([
        "test",
        "--workspace",
        "--test",
        "fidelity_diff",
        "--",
        "--exact",
        test,
        "--nocapture",
    ]);
    if !quick {
        cmd.arg("--ignored");
    }
    cmd.env("EVPLEG_FIDELITY_OUT", &out);
    util::run(&mut cmd)
}

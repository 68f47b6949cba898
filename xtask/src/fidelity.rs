//! `cargo xtask fidelity`: the differential fidelity run (issue #31). The
//! corpus of tests/fidelity/ under the stock kubelet 1.37 and under `evpleg
//! run`, standalone (static pods) and against the real API server (API
//! pods), compared field by field by tests/tests/fidelity_diff.rs, whose
//! report becomes docs/fidelity.md (the whole corpus, both modes) or
//! target/fidelity-quick.md and target/fidelity-quick-api.md (`--quick`, the
//! subsets `cargo xtask test` runs). The whole corpus is built with the
//! release profile (the agent as a node runs it, as `cargo xtask bench
//! --release` measures it), the quick subsets with the tests' profile. Needs root, the stock kubelet, etcd and
//! kube-apiserver (`cargo xtask setup` builds them) and containerd 1.7
//! (fetched by the tests' harness). `--proxy` instead runs the whole corpus
//! under the stock kubelet directly and behind `evpleg cri-proxy` (issue
//! #30), with the tests' profile (no agent runs in it), and fails on any
//! difference that is not timing.

use std::path::Path;

use anyhow::Result;

use crate::util;

/// Builds the eBPF object, then runs the comparison and writes its report.
pub fn run(root: &Path, quick: bool, proxy: bool) -> Result<()> {
    crate::build_ebpf(root)?;
    if proxy {
        util::step(
            "the corpus under the stock kubelet directly and behind evpleg cri-proxy, against the API server",
        );
        let mut cmd = util::cargo(root);
        cmd.args([
            "test",
            "-p",
            "evpleg-tests",
            "--test",
            "fidelity_diff",
            "--",
            "whole_corpus_behind_the_proxy",
            "--exact",
            "--ignored",
            "--nocapture",
        ]);
        return util::run(&mut cmd);
    }
    // `--quick`: both quick tests (static and API), by their common prefix.
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
    cmd.args(["test", "-p", "evpleg-tests", "--test", "fidelity_diff"]);
    if !quick {
        // The agent as a node runs it, beside the kubelet's optimised Go:
        // the test profile leaves the dependencies (tonic, prost, hyper,
        // serde) unoptimised, and with the whole corpus at once on two cores
        // the agent's own CPU made its pod relists queue.
        cmd.arg("--release");
    }
    cmd.args(["--", test, "--nocapture"]);
    if !quick {
        cmd.args(["--exact", "--ignored"]);
    }
    cmd.env("EVPLEG_FIDELITY_OUT", &out);
    util::run(&mut cmd)
}

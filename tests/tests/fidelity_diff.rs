//! Differential fidelity (issue #31): the corpus's pods (`tests/fidelity/`)
//! under the stock kubelet 1.37 and under `evpleg run`, each on its own
//! containerd 1.7, compared field by field (`evpleg_tests::differential`).
//! The quick subset runs here and fails on any difference the table of known
//! differences (`differential::known`) does not explain; the whole corpus is
//! `cargo xtask fidelity` (the ignored `whole_corpus`), which writes
//! docs/fidelity.md.
//!
//! Privileged and slow (two containerds and two nodes, one after the other):
//! one case at a time. Without the kubelet binary or containerd 1.7 the tests
//! say so and skip; under `CI=true` that is a failure.

use evpleg_tests::differential::{self, Case, Side, known, report};
use evpleg_tests::{privileged, stock_kubelet};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn runnable(test: &str) -> Option<std::path::PathBuf> {
    if !(privileged(test) && stock_kubelet::available(test)) {
        return None;
    }
    evpleg_tests::containerd::containerd_17_for(test)
}

/// Runs `cases` on both sides; returns the comparisons and the markdown.
async fn run(
    containerd: &std::path::Path,
    cases: &[Case],
    command: &str,
) -> (Vec<report::Comparison>, String) {
    let started = std::time::Instant::now();
    let kubelet = differential::run_side(Side::Kubelet, containerd, cases)
        .await
        .unwrap_or_else(|e| panic!("the stock kubelet's side: {e}"));
    let evpleg = differential::run_side(Side::Evpleg, containerd, cases)
        .await
        .unwrap_or_else(|e| panic!("evpleg's side: {e}"));
    let comparisons = report::compare(cases, &kubelet, &evpleg);
    let fields: usize = comparisons.iter().map(|c| c.fields.len()).sum();
    let differences: usize = comparisons.iter().map(|c| c.differences.len()).sum();
    let header = format!(
        "Written by `{command}` (tests/tests/fidelity_diff.rs, the harness tests/src/differential/) from a run on this machine: {} manifests of tests/fidelity/, each run once under the stock kubelet 1.37.2 (standalone, static pods, statuses from its read-only `/pods`) and once under `evpleg run` (static pods, its local `/pods`), each on its own containerd 1.7.24, CrashLoopBackOff 1 s on both; {fields} fields compared, {differences} different, in {:.0} s. Tolerances: timestamps, ids and IPs are not compared; a restart's wait (a container's end to its next creation, the runtime's times) within {} ms, a container's end after its manifest's removal within {} ms; restart counts exact for pods that end, else capped where the case stops waiting. Known differences are the table in tests/src/differential/known.rs.",
        cases.len(),
        started.elapsed().as_secs_f64(),
        differential::record::RESTART_WAIT_TOLERANCE_MS,
        differential::record::TERMINATION_TOLERANCE_MS,
    );
    let md = report::markdown(&comparisons, &header);
    (comparisons, md)
}

fn require_explained(comparisons: &[report::Comparison], md: &str) {
    let unexplained = report::unexplained(comparisons);
    assert!(
        unexplained.is_empty(),
        "{} differences between the stock kubelet and evpleg that tests/src/differential/known.rs does not explain:\n{unexplained:#?}\n\n{md}",
        unexplained.len()
    );
}

/// The corpus reads, every manifest names its pod as its file and says when it
/// is done, the quick subset is not empty, and every row of the known table
/// names a manifest of the corpus.
#[test]
fn the_corpus_and_the_known_table_agree() {
    let cases = differential::corpus(&differential::corpus_dir()).expect("the corpus");
    assert!(cases.len() >= 15, "{} manifests", cases.len());
    assert!(cases.iter().any(|c| c.quick));
    for k in known::KNOWN {
        assert!(
            k.case == "*" || cases.iter().any(|c| c.name == k.case),
            "known difference for a manifest not in the corpus: {k:?}"
        );
    }
}

/// The known table's patterns match what they say and nothing else, and the
/// durations' tolerances are the stated bounds.
#[test]
fn known_patterns_and_tolerances() {
    assert!(known::lookup("sidecar-job", "sidecar: state").is_some());
    assert!(known::lookup("sidecar-job", "job: state").is_none());
    assert!(known::lookup("never-exit-code", "phases").is_some());
    assert!(known::lookup("never-exit-code", "app: lastState").is_none());
    assert!(known::lookup("init-order", "init2: ready").is_some());
    assert!(known::lookup("init-order", "app1: ready").is_none());
    let bound = differential::record::RESTART_WAIT_TOLERANCE_MS;
    let (a, b) = (serde_json::json!(1_000), serde_json::json!(1_000 + bound));
    assert!(differential::record::same("app: restart wait ms", &a, &b));
    let c = serde_json::json!(1_001 + bound);
    assert!(!differential::record::same("app: restart wait ms", &a, &c));
    assert!(!differential::record::same("app: restartCount", &a, &b));
}

/// A manifest without its header is refused, naming the file.
#[test]
fn a_manifest_without_its_header_is_refused() {
    let dir = std::env::temp_dir().join(format!("evpleg-fidelity-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("bad.yaml"),
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: bad\n",
    )
    .expect("write");
    let err = differential::corpus(&dir)
        .expect_err("no header")
        .to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        err.contains("bad.yaml") && err.contains("first line"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_corpus_behaves_as_under_the_stock_kubelet() {
    let Some(containerd) = runnable("the_quick_corpus_behaves_as_under_the_stock_kubelet") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let cases: Vec<Case> = differential::corpus(&differential::corpus_dir())
        .expect("the corpus")
        .into_iter()
        .filter(|c| c.quick)
        .collect();
    let (comparisons, md) = run(&containerd, &cases, "cargo xtask fidelity --quick").await;
    if let Ok(out) = std::env::var("EVPLEG_FIDELITY_OUT") {
        std::fs::write(&out, &md).unwrap_or_else(|e| panic!("write {out}: {e}"));
    }
    eprintln!("{md}");
    require_explained(&comparisons, &md);
}

/// The whole corpus (`cargo xtask fidelity`): writes the report to
/// `EVPLEG_FIDELITY_OUT` (docs/fidelity.md), then fails on an unexplained
/// difference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the whole corpus: cargo xtask fidelity"]
async fn whole_corpus() {
    let Some(containerd) = runnable("whole_corpus") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let cases = differential::corpus(&differential::corpus_dir()).expect("the corpus");
    let (comparisons, md) = run(&containerd, &cases, "cargo xtask fidelity").await;
    if let Ok(out) = std::env::var("EVPLEG_FIDELITY_OUT") {
        std::fs::write(&out, &md).unwrap_or_else(|e| panic!("write {out}: {e}"));
    }
    eprintln!("{md}");
    require_explained(&comparisons, &md);
}

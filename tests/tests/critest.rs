//! Issue #26: critest, cri-tools' CRI validation suite (v1.37.0), run
//! directly on the harness's containerd 1.6 and through `evpleg cri-proxy`
//! in front of another one, its images served by the harness's registry
//! under the names critest pulls (tests/src/critest.rs). The set of tests
//! passing through the proxy must be the set passing directly. Privileged
//! (the proxy's kernel PLEG); critest is found with `go_tools::binary`
//! (skipped when absent, a failure under `CI=true`).

use evpleg_tests::cri_pod::start_containerd;
use evpleg_tests::critest::{self, Outcome};
use evpleg_tests::registry::Registry;

/// A lower bound of the tests passing directly: 87 of the 142 passed
/// directly and through the proxy in both runs measured (containerd 1.6, the
/// images of tests/src/critest.rs, a loaded 2-vCPU machine), 6 failed
/// both ways and 49 were skipped by critest itself (NRI, AppArmor,
/// benchmarks, features containerd 1.6 lacks) or here (a pull by digest).
const AT_LEAST_PASSING: usize = 85;

/// critest on a fresh containerd, directly or through a proxy in front of
/// it; its log and report in `dir`.
fn run(
    binary: &std::path::Path,
    registry: &Registry,
    through_proxy: bool,
    dir: &std::path::Path,
) -> Outcome {
    let containerd = start_containerd();
    // critest's pods have no cgroup parent: runc makes `/k8s.io/<id>`.
    containerd.track_root_cgroup(evpleg_tests::containerd::CRI_NAMESPACE);
    critest::mirror(registry, &containerd.registry_config_dir())
        .unwrap_or_else(|e| panic!("registry mirrors: {e}"));
    if !through_proxy {
        return critest::run_suite(binary, &containerd.endpoint(), dir)
            .unwrap_or_else(|e| panic!("critest directly: {e}"));
    }
    let rt = evpleg_tests::cri_pod::tokio_runtime();
    let (proxy, _client) = rt.block_on(evpleg_tests::cri_proxy::proxy(&containerd, &[]));
    let endpoint = format!("unix://{}", containerd.base().join("proxy.sock").display());
    let outcome = critest::run_suite(binary, &endpoint, dir)
        .unwrap_or_else(|e| panic!("critest through the proxy: {e}"));
    rt.block_on(proxy.stop());
    outcome
}

/// The tests the proxy may pass where the runtime alone fails, because the
/// proxy's overlay answers with what the kernel saw: containerd 1.6 on this
/// host's cgroup layout sometimes reports an OOM kill as `Error` (its OOM
/// event comes after the exit; once in three runs here), while the proxy shows the
/// kernel's `OOMKilled` from the death until the runtime reports the exit
/// (docs/cri-proxy.md). The other way (a test passing only directly) always
/// fails.
const THE_KERNEL_CORRECTS: &[&str] = &[
    "[k8s.io] Container OOM runtime should output OOMKilled reason should terminate with exitCode 137 and reason OOMKilled",
];

#[test]
fn critest_passes_the_same_tests_through_the_proxy_as_directly() {
    let test = "critest_passes_the_same_tests_through_the_proxy_as_directly";
    if !evpleg_tests::privileged(test) {
        return;
    }
    let binary = match evpleg_tests::go_tools::binary("critest") {
        Ok(path) => path,
        Err(e) => return evpleg_tests::skip(test, &e.to_string()),
    };
    evpleg_tests::containerd::init_test_logging();
    let registry_dir =
        std::env::temp_dir().join(format!("evpleg-critest-registry-{}", std::process::id()));
    let registry = Registry::start(&registry_dir).unwrap_or_else(|e| panic!("registry: {e}"));
    critest::serve(&registry).unwrap_or_else(|e| panic!("critest's images: {e}"));

    // critest's logs and reports, kept when the test fails.
    let logs = std::env::temp_dir().join(format!("evpleg-critest-{}", std::process::id()));
    let direct = run(&binary, &registry, false, &logs.join("direct"));
    let through = run(&binary, &registry, true, &logs.join("proxy"));
    let (want, got) = (direct.with_state("passed"), through.with_state("passed"));
    let count = |o: &Outcome, s: &str| o.with_state(s).len();
    eprintln!(
        "critest: directly {} passed, {} failed, {} skipped in {:?}; through the proxy {} passed, {} failed, {} skipped in {:?}",
        want.len(),
        count(&direct, "failed"),
        count(&direct, "skipped"),
        direct.took,
        got.len(),
        count(&through, "failed"),
        count(&through, "skipped"),
        through.took,
    );
    for (name, state) in &direct.states {
        if state != "passed" && state != "skipped" {
            eprintln!("directly {state}: {name}");
        }
    }
    let only_direct: Vec<_> = want.difference(&got).collect();
    let (corrected, only_through): (Vec<&str>, Vec<&str>) = got
        .difference(&want)
        .copied()
        .partition(|name| THE_KERNEL_CORRECTS.contains(name));
    for name in &corrected {
        eprintln!("passed only through the proxy, as the kernel's verdict allows: {name}");
    }
    assert!(
        only_direct.is_empty() && only_through.is_empty(),
        "passed only directly: {only_direct:#?}\npassed only through the proxy: {only_through:#?}\n(critest's logs: {})",
        logs.display()
    );
    assert!(
        want.len() >= AT_LEAST_PASSING,
        "only {} critest tests passed directly (at least {AT_LEAST_PASSING} expected): {want:#?}",
        want.len()
    );
    let _ = std::fs::remove_dir_all(&logs);
}

//! Operating evpleg (issue #12), against the real containerd: `evpleg observe`
//! next to a second agent that manages the pods (standing in for a real
//! kubelet), and the documented metrics against what `/metrics` serves.

use std::collections::BTreeSet;
use std::time::Duration;

use clap::Parser;
use evpleg::config::{Cli, Command, ObserveArgs};
use evpleg::observe::{ObservedEvent, Observer};
use evpleg_tests::cri_interceptor::CriInterceptor;
use evpleg_tests::e2e::{E2e, http_get, manifest};

const DEADLINE: Duration = Duration::from_secs(60);

fn observe_args(flags: &[&str]) -> ObserveArgs {
    let argv = ["evpleg", "observe"].iter().chain(flags);
    match Cli::try_parse_from(argv).expect("observe flags").command {
        Command::Observe(args) => *args,
        other => panic!("not observe: {other:?}"),
    }
}

/// An observer through a CRI interceptor in front of the harness's
/// containerd, comparing with a 1 s relist.
async fn observer(e: &E2e) -> (Observer, CriInterceptor) {
    let interceptor =
        CriInterceptor::start(e.cri().socket(), e.cri().base().join("observer-cri.sock"))
            .expect("interceptor");
    let args = observe_args(&[
        "--cri-endpoint",
        &interceptor.endpoint(),
        "--listen",
        "127.0.0.1:0",
        "--compare-period",
        "1s",
    ]);
    let observer = Observer::start(&args)
        .await
        .unwrap_or_else(|e| panic!("observer: {e}"));
    (observer, interceptor)
}

/// Reads the observer's events until one satisfies `check` (bounded).
async fn next_event(
    observer: &mut Observer,
    what: &str,
    check: impl Fn(&ObservedEvent) -> bool,
) -> ObservedEvent {
    let found = tokio::time::timeout(DEADLINE, async {
        loop {
            let ev = observer.events.recv().await.expect("the observer runs");
            if check(&ev) {
                return ev;
            }
        }
    })
    .await;
    found.unwrap_or_else(|_| panic!("{what}: no such event within {DEADLINE:?}"))
}

/// `evpleg observe` prints a JSON event for a container's exit with the pod
/// UID, the container id, the exit code and how much earlier the kernel saw it
/// than the relist; next to an agent managing the same containerd it makes no
/// call that changes the runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_reports_a_death_with_its_lead_over_the_relist_and_changes_nothing() {
    if !evpleg_tests::privileged("observe_reports_a_death") {
        return;
    }
    let _serial = evpleg_tests::e2e::SERIAL.lock().await;
    let e = E2e::start_with("observe", false, &["--pleg", "generic"]).await;
    let (mut observer, interceptor) = observer(&e).await;
    e.write(
        "dies.yaml",
        &manifest("dies", "Never", "sleep 1; exit 3", ""),
    );
    let pod = e
        .wait_for("dies", "Failed", |p| p["status"]["phase"] == "Failed")
        .await;
    let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
    let died = next_event(&mut observer, "the container's death", |ev| {
        ev.kind == "ContainerDied" && ev.pod_uid.as_deref() == Some(uid.as_str())
    })
    .await;
    eprintln!("observe printed: {}", died.json());
    let json: serde_json::Value = serde_json::from_str(&died.json()).expect("a JSON line");
    assert_eq!(json["source"], "kernel", "{json}");
    assert_eq!(json["pod_uid"], uid.as_str(), "{json}");
    assert_eq!(json["container"], "app", "{json}");
    let id = json["container_id"].as_str().expect("a container id");
    assert!(
        id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{json}"
    );
    assert_eq!(json["exit_code"], 3, "{json}");
    assert_eq!(json["relist_exit_code"], 3, "the runtime agrees: {json}");
    assert!(json["disagreement"].is_null(), "{json}");
    // The relist runs every second: it saw the death after the kernel, by at
    // most a period and the time that relist took (up to 0.7 s with the agent
    // beside it relisting the same runtime under CI load); a relist that
    // missed a round would be two periods late.
    let lead = json["relist_lead_ms"].as_f64().expect("a lead");
    assert!(lead > 0.0 && lead < 2_000.0, "lead {lead} ms: {json}");
    let metrics = http_get(observer.addr, "/metrics").await;
    assert!(
        metrics.lines().any(
            |l| l.starts_with("evpleg_observe_relist_lead_seconds_count ")
                && l != "evpleg_observe_relist_lead_seconds_count 0"
        ),
        "{metrics}"
    );
    // Every call went through the interceptor, and none changed anything.
    let calls = interceptor.calls();
    assert!(
        calls.get("ListContainers").copied().unwrap_or(0) > 0,
        "the observer listed through the interceptor: {calls:?}"
    );
    assert_eq!(
        interceptor.mutating_calls(),
        Default::default(),
        "calls: {calls:?}"
    );
    observer.stop().await;
    e.finish().await;
}

/// The metric names of the tables in docs/operations.md.
fn documented_metrics() -> BTreeSet<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operations.md");
    let text = std::fs::read_to_string(path).expect("docs/operations.md");
    text.lines()
        .filter_map(|l| l.strip_prefix("| `evpleg_"))
        .map(|rest| {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            format!("evpleg_{name}")
        })
        .collect()
}

/// The metric names `/metrics` serves: the family name, with `_total` for
/// counters (OpenMetrics), as they are queried.
fn served_metrics(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let (name, kind) = l.split_once(' ')?;
            Some(match kind {
                "counter" => format!("{name}_total"),
                _ => name.to_owned(),
            })
        })
        .collect()
}

/// Every metric docs/operations.md names is served, and every metric served
/// is documented: the agent (`run`, here in `evented-cri` mode) after a pod ran,
/// `observe` (the kernel PLEG) and `cri-proxy` beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_metric_is_served_and_every_served_one_documented() {
    if !evpleg_tests::privileged("every_documented_metric_is_served") {
        return;
    }
    let _serial = evpleg_tests::e2e::SERIAL.lock().await;
    let e = E2e::start_with("metrics", false, &["--pleg", "evented-cri"]).await;
    let (observer, _interceptor) = observer(&e).await;
    // With a volume: the volume manager's operation histogram has samples.
    let volume = "  volumes:\n    - name: scratch\n      emptyDir: {}\n";
    e.write("done.yaml", &manifest("done", "Never", "exit 0", volume));
    e.wait_for("done", "Succeeded", |p| p["status"]["phase"] == "Succeeded")
        .await;
    // A runtime call that fails (a pull from a registry that cannot exist):
    // the error counter has a sample. Before, the test leaned on containerd
    // 1.6 refusing the event stream, which containerd 2 serves.
    e.write(
        "absent.yaml",
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: absent\nspec:\n  hostNetwork: true\n  containers:\n    - name: app\n      image: evpleg.invalid/absent:none\n      imagePullPolicy: IfNotPresent\n",
    );
    e.wait_for("absent", "the pull failed", |p| {
        let reason = &p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"];
        reason == "ErrImagePull" || reason == "ImagePullBackOff"
    })
    .await;
    // A CSI driver registered: the plugin watcher's gauge and the CSI client's
    // histogram (its NodeGetInfo) have samples.
    let base = e.args.root_dir.parent().expect("the harness's base dir");
    let mut driver = evpleg_tests::csi_driver::CsiDriverProcess::start(
        env!("CARGO_BIN_EXE_evpleg-csi-driver"),
        evpleg_tests::csi_driver::DRIVER_NAME,
        base,
        &e.args.root_dir.join("plugins_registry"),
        &[],
    )
    .unwrap_or_else(|err| panic!("CSI driver: {err}"));
    e.wait_until("the CSI driver registered", || {
        !e.agent().csi_drivers.names().is_empty()
    })
    .await;
    // Its per-method histogram shows the Version call of the client's connect.
    let (proxy, _client) = evpleg_tests::cri_proxy::proxy(e.cri(), &[]).await;
    let mut served = served_metrics(&http_get(e.agent().addr, "/metrics").await);
    served.extend(served_metrics(&http_get(observer.addr, "/metrics").await));
    served.extend(served_metrics(&http_get(proxy.http_addr, "/metrics").await));
    let documented = documented_metrics();
    assert!(documented.len() > 30, "the tables parse: {documented:?}");
    let missing: Vec<_> = documented.difference(&served).collect();
    let undocumented: Vec<_> = served.difference(&documented).collect();
    assert!(
        missing.is_empty() && undocumented.is_empty(),
        "documented but not served: {missing:?}\nserved but not documented: {undocumented:?}"
    );
    observer.stop().await;
    proxy.stop().await;
    driver.stop();
    e.finish().await;
}

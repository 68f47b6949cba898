//! `evpleg cri-proxy` with its real client (issue #30): the stock kubelet
//! 1.37, built from its Go module, runs the same static pods on the harness's
//! containerd 1.7 directly (its generic PLEG, and its Evented PLEG on
//! containerd's own event stream) and with its CRI endpoint at `evpleg
//! cri-proxy` in front of that containerd, without and with the `EventedPLEG`
//! gate; every pod ends in the same status each way (phase, each container's
//! state, reason and exit code, restarts). And behind the proxy with the gate, a
//! container killed from outside reaches the kubelet's pod status sooner than
//! the kubelet's own 1 s relist would bring it.
//!
//! Privileged and slow (a containerd, a proxy and a kubelet per case): one
//! case at a time. Without the kubelet binary the tests say so and skip; under
//! `CI=true` that is a failure (`cargo xtask setup` builds it).

use std::time::{Duration, Instant};

use evpleg_tests::containerd::{BUSYBOX_IMAGE, Containerd};
use evpleg_tests::stock_kubelet::{self, KubeletCgroups, KubeletOptions, StockKubelet};
use evpleg_tests::{e2e, privileged};
use serde_json::{Value, json};

const NODE: &str = "stock";
/// How long a pod may take to reach a state in these tests.
const DEADLINE: Duration = Duration::from_secs(90);

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// The kubelet on containerd directly, its generic (relist) PLEG.
    Direct,
    /// The kubelet on containerd directly with `EventedPLEG=true`:
    /// containerd 1.7's own GetContainerEvents.
    DirectEvented,
    /// Behind `evpleg cri-proxy`, the generic PLEG (the proxy only forwards
    /// and overlays statuses).
    Proxy,
    /// Behind `evpleg cri-proxy` with `EventedPLEG=true`: the proxy's
    /// GetContainerEvents is the kubelet's event stream.
    ProxyEvented,
}

/// A containerd, optionally a proxy in front of it, and a stock kubelet;
/// torn down in that order's reverse.
struct Node {
    kubelet: Option<StockKubelet>,
    proxy: Option<evpleg::cri_proxy::CriProxy>,
    containerd: Option<Containerd>,
}

impl Node {
    /// A node of this mode on `containerd` (a binary: containerd 1.7), its
    /// kubelet's pods' cgroups as `cgroups` says.
    async fn start(mode: Mode, containerd: &std::path::Path, cgroups: KubeletCgroups) -> Self {
        evpleg_tests::containerd::init_test_logging();
        let containerd =
            Containerd::start_with(containerd).unwrap_or_else(|e| panic!("containerd: {e}"));
        if cgroups == KubeletCgroups::ContainerdNamespace {
            // Its containers' /k8s.io, removed at the teardown if made here.
            containerd.track_root_cgroup(evpleg_tests::containerd::CRI_NAMESPACE);
        }
        let (proxy, endpoint) = match mode {
            Mode::Direct | Mode::DirectEvented => (None, containerd.endpoint()),
            Mode::Proxy | Mode::ProxyEvented => {
                let (proxy, _) = evpleg_tests::cri_proxy::proxy(&containerd, &[]).await;
                let socket = containerd.base().join("proxy.sock");
                (Some(proxy), format!("unix://{}", socket.display()))
            }
        };
        let opts = KubeletOptions {
            endpoint,
            node: NODE.into(),
            evented_pleg: matches!(mode, Mode::DirectEvented | Mode::ProxyEvented),
            cgroups,
        };
        let kubelet = StockKubelet::start(containerd.base(), &opts)
            .await
            .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        Self {
            kubelet: Some(kubelet),
            proxy,
            containerd: Some(containerd),
        }
    }

    fn kubelet(&self) -> &StockKubelet {
        self.kubelet.as_ref().expect("running")
    }

    async fn wait(&self, name: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        let every = Duration::from_millis(50);
        self.kubelet()
            .wait_for(name, NODE, what, DEADLINE, every, check)
            .await
            .0
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let private = self
            .kubelet
            .as_ref()
            .and_then(|k| k.private_cgroup_root().map(str::to_owned));
        drop(self.kubelet.take());
        drop(self.proxy.take());
        drop(self.containerd.take());
        if let Some(root) = private {
            stock_kubelet::remove_cgroups(&root);
        }
    }
}

/// The containerd 1.7 binary when everything the test needs is here.
fn runnable(test: &str) -> Option<std::path::PathBuf> {
    if !(privileged(test) && stock_kubelet::available(test)) {
        return None;
    }
    evpleg_tests::containerd::containerd_17_for(test)
}

/// A static pod: host network, busybox, `containers` and `init` as
/// `(name, command)`, extra container fields for the first app container.
fn pod(name: &str, policy: &str, init: &[(&str, &str)], containers: &[(&str, &str)]) -> Value {
    let c = |(n, cmd): &(&str, &str)| json!({"name": n, "image": BUSYBOX_IMAGE, "command": ["sh", "-c", cmd]});
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "hostNetwork": true,
            "restartPolicy": policy,
            "terminationGracePeriodSeconds": 2,
            "initContainers": init.iter().map(c).collect::<Vec<_>>(),
            "containers": containers.iter().map(c).collect::<Vec<_>>(),
        }
    })
}

/// What a user compares in a pod's status: the phase, then per container
/// (init first) its name, state, reason and exit code and last state's, and
/// whether it restarted. Timestamps, ids and restart counts beyond "some"
/// vary between runs and are left out.
fn view(pod: &Value) -> Value {
    let state = |s: &Value| {
        let (kind, detail) = s
            .as_object()
            .and_then(|o| o.iter().next())
            .map(|(k, v)| (k.clone(), v.clone()))
            .unwrap_or_default();
        json!({"state": kind, "reason": detail["reason"], "exitCode": detail["exitCode"]})
    };
    let containers = |key: &str| -> Vec<Value> {
        pod["status"][key]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        json!({
                            "name": c["name"],
                            "state": state(&c["state"]),
                            "lastState": state(&c["lastState"]),
                            "restarted": c["restartCount"].as_u64().unwrap_or(0) > 0,
                        })
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    json!({
        "phase": pod["status"]["phase"],
        "init": containers("initContainerStatuses"),
        "containers": containers("containerStatuses"),
    })
}

/// A scenario: a pod, and when its status is final for the comparison.
struct Case {
    name: &'static str,
    pod: Value,
    done: fn(&Value) -> bool,
    /// Whether the containers' current state is final (not for a pod that
    /// keeps restarting: there only the last state is compared).
    settled: bool,
}

fn phase_is(p: &Value, phase: &str) -> bool {
    p["status"]["phase"] == phase
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "exit-code",
            pod: pod("exit-code", "Never", &[], &[("app", "sleep 0.5; exit 3")]),
            done: |p| phase_is(p, "Failed"),
            settled: true,
        },
        Case {
            name: "succeeds",
            pod: pod(
                "succeeds",
                "OnFailure",
                &[("init", "exit 0")],
                &[("app", "sleep 0.5")],
            ),
            done: |p| phase_is(p, "Succeeded"),
            settled: true,
        },
        Case {
            // A container cannot SIGKILL its own pid 1; the kernel's OOM
            // killer can.
            name: "oom",
            pod: {
                let mut p = pod(
                    "oom",
                    "Never",
                    &[],
                    &[("app", "sleep 0.5; exec tail /dev/zero")],
                );
                p["spec"]["containers"][0]["resources"] =
                    json!({"limits": {"memory": "24Mi"}, "requests": {"memory": "24Mi"}});
                p
            },
            done: |p| phase_is(p, "Failed"),
            settled: true,
        },
        Case {
            name: "restarts",
            pod: pod("restarts", "Always", &[], &[("app", "sleep 0.3; exit 2")]),
            done: |p| {
                let c = &p["status"]["containerStatuses"][0];
                c["restartCount"].as_u64().unwrap_or(0) >= 2
                    && c["lastState"]["terminated"]["exitCode"] == 2
            },
            settled: false,
        },
        Case {
            name: "init-fails",
            pod: pod(
                "init-fails",
                "Never",
                &[("init", "exit 4")],
                &[("app", "sleep 600")],
            ),
            done: |p| phase_is(p, "Failed"),
            settled: true,
        },
    ]
}

/// Runs every case on one node; returns each case's view.
async fn run_cases(mode: Mode, containerd: &std::path::Path) -> Vec<(String, Value)> {
    // Behind the proxy its kernel PLEG must see the pods' containers.
    let cgroups = match mode {
        Mode::Direct | Mode::DirectEvented => KubeletCgroups::PrivateRoot,
        Mode::Proxy | Mode::ProxyEvented => KubeletCgroups::ContainerdNamespace,
    };
    let node = Node::start(mode, containerd, cgroups).await;
    for case in cases() {
        let yaml = serde_json::to_string(&case.pod).expect("json");
        node.kubelet().write(&format!("{}.yaml", case.name), &yaml);
    }
    let mut views = Vec::new();
    for case in cases() {
        let pod = node.wait(case.name, "its final state", case.done).await;
        let mut v = view(&pod);
        if !case.settled {
            for c in v["containers"].as_array_mut().into_iter().flatten() {
                c["state"] = Value::Null;
            }
        }
        views.push((case.name.to_owned(), v));
    }
    views
}

/// Runs the cases each way on `containerd` and requires the same views; the
/// direct run is itself checked, so that "the same" means something.
async fn same_each_way(containerd: &std::path::Path, modes: &[Mode]) {
    let direct = run_cases(Mode::Direct, containerd).await;
    let exit = &direct[0].1;
    assert_eq!(exit["phase"], "Failed", "{exit:#}");
    assert_eq!(exit["containers"][0]["state"]["exitCode"], 3, "{exit:#}");
    assert_eq!(
        exit["containers"][0]["state"]["reason"], "Error",
        "{exit:#}"
    );
    let oom = &direct[2].1;
    assert_eq!(oom["containers"][0]["state"]["exitCode"], 137, "{oom:#}");
    assert_eq!(
        oom["containers"][0]["state"]["reason"], "OOMKilled",
        "{oom:#}"
    );
    let ok = &direct[1].1;
    assert_eq!(ok["phase"], "Succeeded", "{ok:#}");
    assert_eq!(ok["init"][0]["state"]["reason"], "Completed", "{ok:#}");
    for &mode in modes {
        let other = run_cases(mode, containerd).await;
        for ((name, want), (_, got)) in direct.iter().zip(&other) {
            assert_eq!(
                got, want,
                "{name}: {mode:?}: the kubelet's status differs from the direct generic run"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_end_the_same_behind_the_proxy_as_directly() {
    let Some(containerd) = runnable("pods_end_the_same_behind_the_proxy_as_directly") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    same_each_way(
        &containerd,
        &[Mode::DirectEvented, Mode::Proxy, Mode::ProxyEvented],
    )
    .await;
}

/// The runtime matrix's containerd 2.x row (docs/stock-kubelet.md): the same
/// pods on containerd 2.4 (built from its Go module by `cargo xtask setup`),
/// directly and behind the proxy with the Evented PLEG.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_end_the_same_behind_the_proxy_on_containerd_2() {
    let test = "pods_end_the_same_behind_the_proxy_on_containerd_2";
    if runnable(test).is_none() {
        return;
    }
    let containerd = match evpleg_tests::go_tools::binary("containerd") {
        Ok(path) => path,
        Err(e) => return evpleg_tests::skip(test, &e.to_string()),
    };
    let _serial = SERIAL.lock().await;
    same_each_way(&containerd, &[Mode::ProxyEvented]).await;
}

/// The host pid of the container behind a status's `containerID`.
fn container_pid(status: &Value) -> i32 {
    let id = status["containerID"]
        .as_str()
        .and_then(|s| s.strip_prefix("containerd://"))
        .unwrap_or_else(|| panic!("no containerd id in {status:#}"));
    e2e::find_container_pid(id).unwrap_or_else(|| panic!("no process for container {id}"))
}

/// Kills the running container of pod `name` `rounds` times; returns, for
/// each kill, how long after it the kubelet's `/pods` showed the death
/// (polled every 2 ms).
async fn death_to_status(node: &Node, name: &str, rounds: u32) -> Vec<Duration> {
    let mut lags = Vec::new();
    for round in 0..rounds {
        let running = node
            .wait(name, "running", |p| {
                let c = &p["status"]["containerStatuses"][0];
                c["state"]["running"].is_object()
                    && c["restartCount"].as_u64() == Some(u64::from(round))
            })
            .await;
        let pid = container_pid(&running["status"]["containerStatuses"][0]);
        let killed = Instant::now();
        // SAFETY: kill has no memory preconditions; the pid is the container's.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill {pid}");
        let (_, seen) = node
            .kubelet()
            .wait_for(
                name,
                NODE,
                "the death in the status",
                DEADLINE,
                Duration::from_millis(2),
                |p| {
                    let c = &p["status"]["containerStatuses"][0];
                    c["lastState"]["terminated"]["exitCode"] == 137
                        && c["restartCount"].as_u64() == Some(u64::from(round) + 1)
                        || c["state"]["terminated"]["exitCode"] == 137
                },
            )
            .await;
        lags.push(seen - killed);
    }
    lags
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_the_proxy_the_evented_kubelet_sees_a_death_before_its_relist() {
    let Some(containerd) =
        runnable("behind_the_proxy_the_evented_kubelet_sees_a_death_before_its_relist")
    else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let node = Node::start(
        Mode::ProxyEvented,
        &containerd,
        KubeletCgroups::ContainerdNamespace,
    )
    .await;
    let p = pod("victim", "Always", &[], &[("app", "sleep 600")]);
    node.kubelet()
        .write("victim.yaml", &serde_json::to_string(&p).expect("json"));
    let mut lags = death_to_status(&node, "victim", 5).await;
    lags.sort();
    let median = lags[lags.len() / 2];
    // The generic PLEG relists every 1 s, so its deaths arrive 0-1 s after
    // the fact (median about 0.5 s); an event from the proxy arrives in
    // milliseconds, then the kubelet's pod relist and status update.
    assert!(
        median < Duration::from_millis(250),
        "death to the kubelet's status behind the proxy: median {median:?} (all {lags:?})"
    );
}

/// A death as the kubelet's status first showed it.
#[derive(Debug, Clone)]
struct KubeletDeath {
    pod: String,
    exit_code: i64,
    reason: String,
    /// When `/pods` first showed it (wall clock, as observe's lines).
    seen: k8s_openapi::jiff::Timestamp,
}

/// Every terminated container (current or last state) in `/pods`, by
/// container id.
fn deaths_in(list: &Value) -> Vec<(String, String, i64, String)> {
    let mut out = Vec::new();
    for pod in list["items"].as_array().into_iter().flatten() {
        let name = pod["metadata"]["name"].as_str().unwrap_or("").to_owned();
        for key in ["initContainerStatuses", "containerStatuses"] {
            for c in pod["status"][key].as_array().into_iter().flatten() {
                for state in [&c["state"], &c["lastState"]] {
                    let t = &state["terminated"];
                    if let (Some(id), Some(code)) =
                        (t["containerID"].as_str(), t["exitCode"].as_i64())
                    {
                        let id = id.trim_start_matches("containerd://").to_owned();
                        let reason = t["reason"].as_str().unwrap_or("").to_owned();
                        out.push((id, name.clone(), code, reason));
                    }
                }
            }
        }
    }
    out
}

/// Shadow mode beside the real thing (issue #30): `evpleg observe` on the
/// node of a stock kubelet (generic PLEG, containerd 1.7). Every container
/// death the kubelet reports in a pod status (exit codes, a crash loop, an
/// OOM kill, kills from the host), observe saw first (the `time` of its line,
/// the kernel's timestamp, before the kubelet's status showed it) and printed,
/// with the same exit code and OOM verdict; its lead is measured against the
/// kubelet's own status (from the kernel's sighting, or from the relist a
/// hint triggered where the kernel could not vouch for the death). A line is
/// printed once observe's comparison relist
/// has seen the death too (its `relist_lead_ms`), so the printing itself can
/// come after the kubelet's status (docs/stock-kubelet.md). And observe
/// changed nothing in the runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_sees_every_death_before_the_stock_kubelet_and_agrees() {
    use evpleg::observe::Observer;
    use evpleg_tests::cri_interceptor::CriInterceptor;
    let Some(containerd) = runnable("observe_sees_every_death_before_the_stock_kubelet_and_agrees")
    else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let node = Node::start(
        Mode::Direct,
        &containerd,
        KubeletCgroups::ContainerdNamespace,
    )
    .await;
    let cri = node.containerd.as_ref().expect("containerd");
    let interceptor = CriInterceptor::start(cri.socket(), cri.base().join("observer-cri.sock"))
        .expect("interceptor");
    let argv = [
        "evpleg",
        "observe",
        "--cri-endpoint",
        &interceptor.endpoint(),
        "--listen",
        "127.0.0.1:0",
        "--compare-period",
        "1s",
    ];
    use clap::Parser;
    let evpleg::config::Command::Observe(args) = evpleg::config::Cli::try_parse_from(argv)
        .expect("observe flags")
        .command
    else {
        panic!("not observe")
    };
    let mut observer = Observer::start(&args)
        .await
        .unwrap_or_else(|e| panic!("observer: {e}"));
    // What observe printed, as it printed it.
    let (tx, mut printed) = tokio::sync::mpsc::unbounded_channel();
    let mut events = std::mem::replace(&mut observer.events, tokio::sync::mpsc::channel(1).1);
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            if tx.send(ev).is_err() {
                return;
            }
        }
    });

    let mut oom = pod(
        "oom",
        "Never",
        &[],
        &[("app", "sleep 1; exec tail /dev/zero")],
    );
    oom["spec"]["containers"][0]["resources"] =
        json!({"limits": {"memory": "24Mi"}, "requests": {"memory": "24Mi"}});
    for p in [
        pod("exits", "Never", &[], &[("app", "sleep 1; exit 3")]),
        pod(
            "loops",
            "Always",
            &[("init", "exit 0")],
            &[("app", "sleep 0.5; exit 2")],
        ),
        oom,
        pod("victim", "Always", &[], &[("app", "sleep 600")]),
    ] {
        let name = p["metadata"]["name"].as_str().expect("name").to_owned();
        node.kubelet().write(
            &format!("{name}.yaml"),
            &serde_json::to_string(&p).expect("json"),
        );
    }
    // The kubelet's deaths, first seen (polled every 5 ms), until each pod
    // has had its deaths: two kills of the victim from the host.
    let mut seen: std::collections::BTreeMap<String, KubeletDeath> = Default::default();
    let mut killed = 0u64;
    let end = Instant::now() + DEADLINE;
    loop {
        let list = node
            .kubelet()
            .pods()
            .await
            .expect("the kubelet serves /pods");
        let now = k8s_openapi::jiff::Timestamp::now();
        for (id, pod, exit_code, reason) in deaths_in(&list) {
            seen.entry(id).or_insert(KubeletDeath {
                pod,
                exit_code,
                reason,
                seen: now,
            });
        }
        let count = |p: &str| {
            seen.values()
                .filter(|d| d.pod == format!("{p}-{NODE}"))
                .count()
        };
        let victim = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["metadata"]["name"] == format!("victim-{NODE}"))
            .map(|p| p["status"]["containerStatuses"][0].clone())
            .unwrap_or(Value::Null);
        if killed < 2
            && victim["state"]["running"].is_object()
            && victim["restartCount"].as_u64() == Some(killed)
        {
            let pid = container_pid(&victim);
            // SAFETY: kill has no memory preconditions; the pid is the container's.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill {pid}");
            killed += 1;
        }
        if count("exits") == 1 && count("loops") >= 4 && count("oom") == 1 && count("victim") == 2 {
            break;
        }
        assert!(
            Instant::now() < end,
            "not every death within {DEADLINE:?}: {seen:#?}\n{}",
            node.kubelet().log_tail()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // What observe printed: every death is printed within its comparison
    // relist's patience (two periods and 0.5 s) of the kubelet's status.
    let mut observed: std::collections::BTreeMap<String, evpleg::observe::ObservedEvent> =
        Default::default();
    let patience = Instant::now() + Duration::from_millis(2_500);
    while seen.keys().any(|id| !observed.contains_key(id)) && Instant::now() < patience {
        match tokio::time::timeout_at(patience.into(), printed.recv()).await {
            Ok(Some(ev)) if ev.kind == "ContainerDied" => {
                observed.entry(ev.container_id.clone()).or_insert(ev);
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    let mut leads = Vec::new();
    let mut print_delays = Vec::new();
    // Deaths the kernel could not vouch for: its sighting was a hint, and
    // observe's PLEG relisted the pod (docs/stock-kubelet.md, "Found").
    let mut uncertain = Vec::new();
    for (id, death) in &seen {
        let ev = observed
            .get(id)
            .unwrap_or_else(|| panic!("observe never printed the death of {id} ({death:?})"));
        assert_eq!(
            ev.exit_code.map(i64::from),
            Some(death.exit_code),
            "exit code of {id}: observe {}, kubelet {death:?}",
            ev.json()
        );
        assert_eq!(
            ev.oom_killed,
            death.reason == "OOMKilled",
            "OOM verdict of {id}: observe {}, kubelet {death:?}",
            ev.json()
        );
        assert!(ev.disagreement.is_none(), "{}", ev.json());
        if ev.source != "kernel" {
            // A hint's relist is timed by observe's relist, which races the
            // kubelet's own 1 s relist: its time says nothing of the kernel
            // path, and it is counted below instead.
            uncertain.push(ev.json());
            continue;
        }
        let at: k8s_openapi::jiff::Timestamp = ev.time.parse().expect("an RFC 3339 time");
        assert!(
            at < death.seen,
            "observe saw {id} at {at}, after the kubelet's status showed it at {}: {}",
            death.seen,
            ev.json()
        );
        leads.push(death.seen.duration_since(at).as_secs_f64() * 1_000.0);
        print_delays.push(ev.age_ms);
    }
    leads.sort_by(f64::total_cmp);
    print_delays.sort_by(f64::total_cmp);
    eprintln!(
        "observe beside the stock kubelet, {} deaths: lead over the kubelet's status min {:.1} ms, median {:.1} ms, max {:.1} ms; printed after its sighting median {:.1} ms, max {:.1} ms",
        leads.len(),
        leads[0],
        leads[leads.len() / 2],
        leads[leads.len() - 1],
        print_delays[print_delays.len() / 2],
        print_delays[print_delays.len() - 1],
    );
    eprintln!(
        "{} of {} deaths seen by a hint's relist, not the kernel: {uncertain:#?}",
        uncertain.len(),
        seen.len()
    );
    // 1 to 3 of 8 in the runs so far (docs/stock-kubelet.md, "Found"; the
    // cause is open, issue #25): half or more would be the kernel path lost.
    assert!(
        uncertain.len() * 2 < seen.len(),
        "{} of {} deaths came from a hint's relist: {uncertain:#?}",
        uncertain.len(),
        seen.len()
    );
    assert_eq!(
        interceptor.mutating_calls(),
        Default::default(),
        "observe changed nothing: {:?}",
        interceptor.calls()
    );
    observer.stop().await;
}

//! `/stats/summary` and `/metrics/resource` against the cgroup files, the
//! network counters and the disk usage they describe.

use super::*;

/// Pod `name` of a `/stats/summary` document.
fn summary_pod<'a>(summary: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    summary["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .find(|p| p["podRef"]["name"] == name)
        .unwrap_or_else(|| panic!("{name} in {summary}"))
}

/// Container `name` of a pod of a `/stats/summary` document.
fn summary_container<'a>(pod: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    pod["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("{name} in {pod}"))
}

/// Where `controller`'s files of process `pid`'s cgroup are: the v1
/// hierarchy that has it, else the unified one (`true` when v1).
fn controller_dir(pid: i32, controller: &str) -> (PathBuf, bool) {
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("the pid's cgroups");
    let v1 = evpleg_pleg::kernel::index::v1_hierarchies().expect("the v1 hierarchies");
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (id, ctrls, path) = (parts.next(), parts.next(), parts.next());
        let (Some(id), Some(ctrls), Some(path)) = (id, ctrls, path) else {
            continue;
        };
        if ctrls.split(',').any(|c| c == controller) {
            let id: u32 = id.parse().expect("a hierarchy id");
            let mount = v1.iter().find(|h| h.0 == id).expect("its mount").2.clone();
            return (mount.join(path.trim_start_matches('/')), true);
        }
    }
    let path = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("a unified cgroup");
    (
        evpleg_tests::cgroups::cgroup2().join(path.trim_start_matches('/')),
        false,
    )
}

/// The root of `controller`'s hierarchy: its v1 mount, else the unified one
/// (`true` when v1).
fn controller_mount(controller: &str) -> (PathBuf, bool) {
    let v1 = evpleg_pleg::kernel::index::v1_hierarchies().expect("the v1 hierarchies");
    v1.into_iter()
        .find(|h| h.1.split(',').any(|c| c == controller))
        .map_or_else(
            || (evpleg_tests::cgroups::cgroup2(), false),
            |h| (h.2, true),
        )
}

/// A cgroup's (cpu ns, memory usage, working set, rss), read as the test's
/// own oracle (v1: cpuacct.usage, memory.usage_in_bytes, total_*; v2:
/// cpu.stat, memory.current, memory.stat).
fn cgroup_sample(cpu: &(PathBuf, bool), mem: &(PathBuf, bool)) -> (u64, u64, u64, u64) {
    let read = |p: PathBuf| std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
    let stat = |text: &str, k: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {text}"))
    };
    let cpu_ns = if cpu.1 {
        read(cpu.0.join("cpuacct.usage"))
            .trim()
            .parse()
            .expect("ns")
    } else {
        stat(&read(cpu.0.join("cpu.stat")), "usage_usec") * 1000
    };
    let memory_stat = read(mem.0.join("memory.stat"));
    let (usage, inactive, rss) = if mem.1 {
        (
            read(mem.0.join("memory.usage_in_bytes"))
                .trim()
                .parse()
                .expect("bytes"),
            stat(&memory_stat, "total_inactive_file"),
            stat(&memory_stat, "total_rss"),
        )
    } else {
        (
            read(mem.0.join("memory.current"))
                .trim()
                .parse()
                .expect("bytes"),
            stat(&memory_stat, "inactive_file"),
            stat(&memory_stat, "anon"),
        )
    };
    (cpu_ns, usage, usage - inactive, rss)
}

/// `(rx bytes, tx bytes)` of `eth0` in `/proc/<pid>/net/dev`.
fn eth0(pid: i32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).expect("net/dev");
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("eth0:"))
        .unwrap_or_else(|| panic!("no eth0 in {text}"));
    let f: Vec<u64> = line
        .split_whitespace()
        .map(|w| w.parse().expect("a number"))
        .collect();
    (f[0], f[8])
}

/// Bytes (blocks) and inodes under `path`, links not followed.
fn du(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).expect("metadata");
    let mut out = (meta.blocks() * 512, 1);
    if meta.is_dir() {
        for e in std::fs::read_dir(path).expect("a directory") {
            let (b, i) = du(&e.expect("an entry").path());
            out = (out.0 + b, out.1 + i);
        }
    }
    out
}

/// The value of the sample `name{labels}` (time stamp dropped) in a text
/// exposition.
fn sample(text: &str, series: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"));
    let mut words = line[series.len()..].split_whitespace();
    let value = words.next().expect("a value").parse().expect("a number");
    let ms: i64 = words.next().expect("a time stamp").parse().expect("ms");
    let now = k8s_openapi::jiff::Timestamp::now().as_millisecond();
    assert!(
        (now - 60_000..=now).contains(&ms),
        "{line}: stamped {ms}, now {now}"
    );
    value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_summary_and_resource_metrics_match_the_cgroup_files() {
    let name = "stats_summary_and_resource_metrics_match_the_cgroup_files";
    if !real(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = start("kubelet_api_stats").await;
    // burn: a core's loop; hold: 40 MB in a shell variable, 1 MiB in an
    // emptyDir, 2 MiB in its writable layer, and pings to its gateway.
    let mut pod = api_pod("busy", "Always", "while :; do :; done");
    let spec = pod.spec.as_mut().expect("spec");
    spec.host_network = Some(false);
    spec.containers[0].name = "burn".into();
    let mut hold = spec.containers[0].clone();
    hold.name = "hold".into();
    hold.command = Some(vec![
        "sh".into(),
        "-c".into(),
        "x=$(head -c 40000000 /dev/zero | tr '\\0' x); head -c 1048576 /dev/zero > /data/f; \
         head -c 2097152 /dev/zero > /rootfile; echo held ${#x}; \
         gw=$(ip route | awk '/default/ {print $3}'); while :; do ping -c 1 -W 1 $gw >/dev/null; sleep 0.2; done"
            .into(),
    ]);
    hold.volume_mounts = Some(vec![
        serde_json::from_value(serde_json::json!({"name": "data", "mountPath": "/data"}))
            .expect("a mount"),
    ]);
    spec.containers.push(hold);
    spec.volumes = Some(vec![
        serde_json::from_value(serde_json::json!({"name": "data", "emptyDir": {}}))
            .expect("a volume"),
    ]);
    e.create_pod(&pod).await;
    let pod = running(&e, "busy").await;
    let uid = pod.metadata.uid.clone().expect("a uid");
    let id = |c: &str| -> String {
        let s = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .expect("statuses");
        let id = s
            .iter()
            .find(|s| s.name == c)
            .and_then(|s| s.container_id.clone())
            .expect("an id");
        id.split_once("://").expect("runtime://id").1.to_owned()
    };
    let pid = |c: &str| find_container_pid(&id(c)).unwrap_or_else(|| panic!("{c}'s pid"));
    let (burn_pid, hold_pid) = (pid("burn"), pid("hold"));
    // The hold container has its memory and files once it said so.
    let deadline = Instant::now() + DEADLINE;
    while kubectl(&e, &["logs", "busy", "-c", "hold"]).1 != "held 40000000\n" {
        assert!(Instant::now() < deadline, "hold never held its memory");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let dirs = |pid: i32| {
        (
            controller_dir(pid, "cpuacct"),
            controller_dir(pid, "memory"),
        )
    };
    let (burn_cg, hold_cg) = (dirs(burn_pid), dirs(hold_pid));
    let parent = |d: &(PathBuf, bool)| (d.0.parent().expect("the pod's cgroup").to_owned(), d.1);
    let pod_cg = (parent(&burn_cg.0), parent(&burn_cg.1));
    assert_eq!(
        pod_cg.1.0,
        hold_cg.1.0.parent().expect("a parent"),
        "one pod cgroup"
    );
    let root_cg = (controller_mount("cpuacct"), controller_mount("memory"));
    let (cert, key) = admin_cert(&e);
    let summary = async |query: &str| -> serde_json::Value {
        let (code, body) = get(
            &e,
            &format!("/stats/summary{query}"),
            Cred::Cert(&cert, &key),
        )
        .await;
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).expect("JSON")
    };
    let samples = || [&burn_cg, &hold_cg, &pod_cg, &root_cg].map(|(c, m)| cgroup_sample(c, m));

    let before = (samples(), eth0(hold_pid));
    let first = summary("").await;
    let after = (samples(), eth0(hold_pid));
    let p = summary_pod(&first, "busy");
    assert_eq!(
        p["podRef"],
        serde_json::json!({"name": "busy", "namespace": "default", "uid": uid})
    );
    let c = |name: &str| summary_container(p, name);
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("a number: {v}"));
    // Field by field against the files: CPU is a counter, between the two
    // readings; memory may move by a page or so: 1 MiB of slack (the node's
    // root cgroup, under the machine's other work: 64 MiB).
    const MIB: u64 = 1 << 20;
    for (i, (what, stats, slack)) in [
        ("burn", c("burn"), MIB),
        ("hold", c("hold"), MIB),
        ("pod", p, MIB),
        ("node", &first["node"], 64 * MIB),
    ]
    .into_iter()
    .enumerate()
    {
        let (b, a) = (before.0[i], after.0[i]);
        between(
            &format!("{what} cpu"),
            n(&stats["cpu"]["usageCoreNanoSeconds"]),
            b.0,
            a.0,
            0,
        );
        between(
            &format!("{what} usage"),
            n(&stats["memory"]["usageBytes"]),
            b.1,
            a.1,
            slack,
        );
        between(
            &format!("{what} working set"),
            n(&stats["memory"]["workingSetBytes"]),
            b.2,
            a.2,
            slack,
        );
        between(
            &format!("{what} rss"),
            n(&stats["memory"]["rssBytes"]),
            b.3,
            a.3,
            slack,
        );
        assert!(
            stats["cpu"].get("usageNanoCores").is_none(),
            "no earlier sample yet: {stats}"
        );
    }
    assert!(
        n(&c("hold")["memory"]["rssBytes"]) >= 40_000_000,
        "the 40 MB held"
    );
    // The pod's network is its netns' eth0.
    let net = &p["network"];
    assert_eq!(net["name"], "eth0");
    between("rx", n(&net["rxBytes"]), before.1.0, after.1.0, 0);
    between("tx", n(&net["txBytes"]), before.1.1, after.1.1, 0);
    assert!(n(&net["rxBytes"]) > 0 && n(&net["txBytes"]) > 0, "{net}");
    // Files: the emptyDir, the logs, the writable layer.
    let volume = p["volume"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "data")
        .unwrap_or_else(|| panic!("the emptyDir in {p}"));
    let data = e
        .args
        .root_dir
        .join(format!("pods/{uid}/volumes/kubernetes.io~empty-dir/data"));
    let (bytes, inodes) = du(&data);
    assert_eq!(
        (n(&volume["usedBytes"]), n(&volume["inodesUsed"])),
        (bytes, inodes)
    );
    assert!(bytes >= MIB, "{bytes}");
    let logs = e.args.pod_log_dir.join(format!("default_busy_{uid}/hold"));
    let (log_bytes, log_inodes) = du(&logs);
    assert_eq!(
        (
            n(&c("hold")["logs"]["usedBytes"]),
            n(&c("hold")["logs"]["inodesUsed"])
        ),
        (log_bytes, log_inodes)
    );
    let rootfs = n(&c("hold")["rootfs"]["usedBytes"]);
    let burn_rootfs = n(&c("burn")["rootfs"]["usedBytes"]);
    let burn_logs = n(&c("burn")["logs"]["usedBytes"]);
    let hosts = std::fs::metadata(e.args.root_dir.join(format!("pods/{uid}/etc-hosts")))
        .map_or(0, |m| m.len());
    assert_eq!(
        n(&p["ephemeral-storage"]["usedBytes"]),
        bytes + log_bytes + rootfs + burn_rootfs + burn_logs + hosts,
        "the emptyDir, the logs, the writable layers and etc-hosts"
    );

    // The second full summary: usageNanoCores from the two samples.
    let second = summary("").await;
    let p2 = summary_pod(&second, "busy").clone();
    let burn2 = summary_container(&p2, "burn").clone();
    let t = |v: &serde_json::Value| -> i128 {
        v.as_str()
            .expect("a time")
            .parse::<k8s_openapi::jiff::Timestamp>()
            .expect("RFC 3339")
            .as_nanosecond()
    };
    let (u1, u2) = (
        n(&c("burn")["cpu"]["usageCoreNanoSeconds"]),
        n(&burn2["cpu"]["usageCoreNanoSeconds"]),
    );
    let span = t(&burn2["cpu"]["time"]) - t(&c("burn")["cpu"]["time"]);
    let expected = ((u2 - u1) as f64 / span as f64 * 1e9) as u64;
    let got = n(&burn2["cpu"]["usageNanoCores"]);
    assert!(
        got.abs_diff(expected) <= 1,
        "usageNanoCores {got}, from the samples {expected}"
    );
    assert!(
        got > 50_000_000,
        "the burning container used {got} nanocores"
    );
    assert!(
        n(&second["node"]["cpu"]["usageNanoCores"]) > 0,
        "{}",
        second["node"]
    );
    // metrics-server's query: CPU and memory only, the cached rate not moved.
    let only = summary("?only_cpu_and_memory=true").await;
    let p3 = summary_pod(&only, "busy").clone();
    assert!(
        p3.get("network").is_none() && p3.get("volume").is_none(),
        "{p3}"
    );
    let burn3 = summary_container(&p3, "burn").clone();
    assert!(
        burn3.get("rootfs").is_none() && burn3.get("logs").is_none(),
        "{burn3}"
    );
    assert_eq!(n(&burn3["cpu"]["usageNanoCores"]), got, "read, not updated");
    assert!(n(&burn3["cpu"]["usageCoreNanoSeconds"]) >= u2);
    // The writable layer's use is the runtime's (containerd measures its
    // snapshots every 10 s): /rootfile's 2 MiB show within the deadline.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let s = summary("").await;
        let p = summary_pod(&s, "busy").clone();
        let hold = summary_container(&p, "hold").clone();
        let rootfs = n(&hold["rootfs"]["usedBytes"]);
        if rootfs >= 2 * MIB {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the writable layer never held /rootfile: {rootfs}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // /metrics/resource, parsed.
    let before = samples();
    let (code, text) = get(&e, "/metrics/resource", Cred::Cert(&cert, &key)).await;
    let after = samples();
    assert_eq!(code, 200, "{text}");
    let secs = |series: &str| (sample(&text, series) * 1e9).round() as u64;
    // f64 seconds keep the nanoseconds of a counter below 10^6 s to ±1 µs.
    const FLOAT: u64 = 1_000;
    between(
        "container_cpu_usage_seconds_total",
        secs(
            r#"container_cpu_usage_seconds_total{container="burn",namespace="default",pod="busy"}"#,
        ),
        before[0].0,
        after[0].0,
        FLOAT,
    );
    between(
        "container_memory_working_set_bytes",
        sample(
            &text,
            r#"container_memory_working_set_bytes{container="hold",namespace="default",pod="busy"}"#,
        ) as u64,
        before[1].2,
        after[1].2,
        MIB,
    );
    between(
        "pod_cpu_usage_seconds_total",
        secs(r#"pod_cpu_usage_seconds_total{namespace="default",pod="busy"}"#),
        before[2].0,
        after[2].0,
        FLOAT,
    );
    between(
        "pod_memory_working_set_bytes",
        sample(
            &text,
            r#"pod_memory_working_set_bytes{namespace="default",pod="busy"}"#,
        ) as u64,
        before[2].2,
        after[2].2,
        MIB,
    );
    between(
        "node_cpu_usage_seconds_total",
        secs("node_cpu_usage_seconds_total"),
        before[3].0,
        after[3].0,
        FLOAT,
    );
    between(
        "node_memory_working_set_bytes",
        sample(&text, "node_memory_working_set_bytes") as u64,
        before[3].2,
        after[3].2,
        64 * MIB,
    );
    assert!(text.lines().any(|l| l == "scrape_error 0"), "{text}");
    // Without nodes/stats or nodes/metrics: 403.
    let admin = e.kube().await;
    let ns = e.cp().namespace("kstats").await;
    let denied = token(&admin, &ns, "nobody").await;
    assert_eq!(get(&e, "/stats/summary", Cred::Token(&denied)).await.0, 403);
    assert_eq!(
        get(&e, "/metrics/resource", Cred::Token(&denied)).await.0,
        403
    );
    e.finish().await;
}

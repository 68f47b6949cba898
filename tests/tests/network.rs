//! The pod network end to end (issue #14): the whole agent against the real
//! containerd, whose CRI plugin runs Debian's CNI plugins on the harness's
//! private bridge (tests/src/cni.rs). Pods without hostNetwork get their own
//! network namespace and an address of the bridge's subnet, reach each other
//! over TCP (only addresses of the namespaces this test created are dialled),
//! see the managed /etc/hosts and the resolv.conf of their DNS policy, and
//! lose their namespace and address when deleted. A CNI configuration the
//! plugin refuses is FailedCreatePodSandBox with the plugin's error.
//! Privileged: skipped with a reason without root/BTF/the eBPF object, a
//! failure under `CI=true`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use evpleg_cri_api::v1;
use evpleg_tests::cni::CniSetup;
use evpleg_tests::e2e::*;
use serde_json::Value;

const DNS_FLAGS: [&str; 4] = [
    "--cluster-dns",
    "10.96.0.10",
    "--cluster-domain",
    "cluster.local",
];

fn condition<'a>(pod: &'a Value, kind: &str) -> &'a Value {
    pod["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == kind))
        .unwrap_or(&Value::Null)
}

fn container_id(pod: &Value, name: &str) -> String {
    container(pod, name)["containerID"]
        .as_str()
        .and_then(|s| s.split("://").nth(1))
        .unwrap_or_else(|| panic!("{name} has an id: {pod:#}"))
        .to_owned()
}

/// The host path of `path` inside the running container `name` of `pod`.
fn in_container(pod: &Value, name: &str, path: &str) -> PathBuf {
    let id = container_id(pod, name);
    let pid = find_container_pid(&id).unwrap_or_else(|| panic!("{name}'s main process"));
    PathBuf::from(format!("/proc/{pid}/root{path}"))
}

async fn exec(e: &E2e, id: &str, cmd: &[&str]) -> (i32, String) {
    let r = e
        .cri()
        .client()
        .await
        .exec_sync(id, cmd, Duration::from_secs(5))
        .await
        .unwrap_or_else(|err| panic!("exec {cmd:?}: {err}"));
    (r.exit_code, String::from_utf8_lossy(&r.stdout).into_owned())
}

/// The network namespace path of the pod's (newest) sandbox, from its
/// verbose status.
async fn netns_path(e: &E2e, uid: &str) -> PathBuf {
    let sandboxes = e.sandboxes(uid).await;
    let s = sandboxes.first().expect("a sandbox");
    let status = e
        .cri()
        .client()
        .await
        .pod_sandbox_status(&s.id, true)
        .await
        .expect("PodSandboxStatus");
    let info: Value =
        serde_json::from_str(status.info.get("info").expect("verbose info")).expect("info is JSON");
    let path = info["runtimeSpec"]["linux"]["namespaces"]
        .as_array()
        .and_then(|a| a.iter().find(|n| n["type"] == "network"))
        .and_then(|n| n["path"].as_str())
        .unwrap_or_else(|| panic!("no network namespace path: {info:#}"));
    PathBuf::from(path)
}

fn server() -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: server\nspec:\n  hostname: srv\n  subdomain: grp\n  hostAliases:\n    - ip: 192.0.2.200\n      hostnames: [alias-one, alias-two]\n  terminationGracePeriodSeconds: 2\n  containers:\n    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'mkdir -p /www && echo hello-from-srv > /www/index.html && exec httpd -f -p 8080 -h /www']\n      ports:\n        - containerPort: 8080\n      readinessProbe:\n        httpGet:\n          path: /index.html\n          port: 8080\n        periodSeconds: 1\n"
    )
}

fn client() -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: client\nspec:\n  dnsPolicy: None\n  dnsConfig:\n    nameservers: [192.0.2.53]\n    searches: [example.test]\n    options:\n      - name: ndots\n        value: \"2\"\n  terminationGracePeriodSeconds: 2\n  containers:\n    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'exec sleep 1000']\n"
    )
}

// Two pods with their own network namespaces: distinct addresses of the
// bridge's subnet in their statuses, TCP from one to the other, the server's
// httpGet readiness probe answered at its pod IP, the managed /etc/hosts
// (hostname, subdomain FQDN, hostAliases), resolv.conf per DNS policy, the
// hostname; after deletion their namespaces and addresses are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_get_their_own_network_and_reach_each_other() {
    let name = "two_pods_get_their_own_network_and_reach_each_other";
    if !evpleg_tests::privileged(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_cni(name, &CniSetup::Bridge, &DNS_FLAGS).await;
    let net_prefix = {
        let n = e.cri().cni();
        n.subnet.trim_end_matches("0/24").to_owned()
    };
    e.write("server.yaml", &server());
    e.write("client.yaml", &client());
    let srv = e
        .wait_for(
            "server",
            "ready (its httpGet probe reached the pod IP)",
            |p| condition(p, "Ready")["status"] == "True",
        )
        .await;
    let cli = e
        .wait_for("client", "running", |p| {
            container(p, "app")["state"]["running"].is_object()
        })
        .await;
    let ip = |p: &Value| p["status"]["podIP"].as_str().unwrap_or_default().to_owned();
    let (srv_ip, cli_ip) = (ip(&srv), ip(&cli));
    for (p, addr) in [(&srv, &srv_ip), (&cli, &cli_ip)] {
        assert!(
            addr.starts_with(&net_prefix),
            "{addr} not in {net_prefix}0/24"
        );
        assert_eq!(p["status"]["podIPs"], serde_json::json!([{"ip": addr}]));
        assert_ne!(*addr, e.cri().cni().gateway);
    }
    assert_ne!(srv_ip, cli_ip);
    let mut allocated = vec![srv_ip.clone(), cli_ip.clone()];
    allocated.sort();
    assert_eq!(e.cri().cni().allocated(), allocated, "host-local's files");

    // TCP from the client's namespace to the server's, bounded.
    let cli_id = container_id(&cli, "app");
    // (busybox-static's wget crashes here; nc with a hand-written request.)
    let request = format!("printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {srv_ip} 8080");
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (code, out) = exec(&e, &cli_id, &["sh", "-c", &request]).await;
        if code == 0 && out.starts_with("HTTP/1.1 200") {
            assert!(out.ends_with("\r\n\r\nhello-from-srv\n"), "{out}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{srv_ip}:8080 not reached from the client: {code} {out}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The managed /etc/hosts, the hostname, resolv.conf.
    let hosts = std::fs::read_to_string(in_container(&srv, "app", "/etc/hosts")).unwrap();
    assert!(
        hosts.starts_with("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"),
        "{hosts}"
    );
    assert!(
        hosts.contains(&format!(
            "\n{srv_ip}\tsrv.grp.default.svc.cluster.local\tsrv\n"
        )),
        "{hosts}"
    );
    assert!(
        hosts.ends_with("\n# Entries added by HostAliases.\n192.0.2.200\talias-one\talias-two\n"),
        "{hosts}"
    );
    let cli_hosts = std::fs::read_to_string(in_container(&cli, "app", "/etc/hosts")).unwrap();
    assert!(
        cli_hosts.ends_with(&format!("\n{cli_ip}\tclient-{NODE}\n")),
        "{cli_hosts}"
    );
    let srv_id = container_id(&srv, "app");
    assert_eq!(exec(&e, &srv_id, &["hostname"]).await.1.trim(), "srv");
    assert_eq!(
        exec(&e, &cli_id, &["hostname"]).await.1.trim(),
        format!("client-{NODE}")
    );
    let resolv = std::fs::read_to_string(in_container(&srv, "app", "/etc/resolv.conf")).unwrap();
    let lines: Vec<&str> = resolv.lines().collect();
    assert!(lines.contains(&"nameserver 10.96.0.10"), "{resolv}");
    assert!(
        lines
            .iter()
            .any(|l| l
                .starts_with("search default.svc.cluster.local svc.cluster.local cluster.local")),
        "{resolv}"
    );
    assert!(lines.contains(&"options ndots:5"), "{resolv}");
    let resolv = std::fs::read_to_string(in_container(&cli, "app", "/etc/resolv.conf")).unwrap();
    let lines: Vec<&str> = resolv.lines().collect();
    assert_eq!(
        lines,
        [
            "search example.test",
            "nameserver 192.0.2.53",
            "options ndots:2"
        ],
        "{resolv}"
    );

    // Deleted: the namespaces, the addresses and the hosts files go.
    let mut gone = Vec::new();
    for (p, file) in [(&srv, "server.yaml"), (&cli, "client.yaml")] {
        let uid = p["metadata"]["uid"].as_str().unwrap().to_owned();
        let netns = netns_path(&e, &uid).await;
        assert!(
            netns.exists(),
            "{} exists while the pod runs",
            netns.display()
        );
        let hosts_dir = e.args.root_dir.join("pods").join(&uid);
        assert!(hosts_dir.join("etc-hosts").exists());
        e.remove(file);
        gone.push((netns, hosts_dir));
    }
    e.wait_gone("server").await;
    e.wait_gone("client").await;
    e.wait_until("the namespaces, addresses and pod dirs gone", || {
        e.cri().cni().allocated().is_empty() && gone.iter().all(|(n, d)| !n.exists() && !d.exists())
    })
    .await;
    e.finish().await;
}

// A CNI configuration the bridge plugin refuses: the pod's sandbox is never
// created, FailedCreatePodSandBox carries the plugin's error, the pod waits
// in ContainerCreating (the error its message) with PodReadyToStartContainers
// False, and the agent keeps trying (an event per attempt), about once a
// second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_network_is_failed_create_pod_sandbox_with_the_cni_error() {
    let name = "a_refused_network_is_failed_create_pod_sandbox_with_the_cni_error";
    if !evpleg_tests::privileged(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_cni(name, &CniSetup::Broken, &[]).await;
    e.write("client.yaml", &client());
    let path = format!("/pods/default/client-{NODE}/events");
    let deadline = Instant::now() + DEADLINE;
    // Each attempt's message names its own sandbox: one event per attempt.
    let events = loop {
        let response = http_get(e.agent().addr, &path).await;
        let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
        let list: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        let found: Vec<Value> = list["items"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|ev| ev["reason"] == "FailedCreatePodSandBox")
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if found.len() >= 2 {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "no repeated FailedCreatePodSandBox: {list:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let event = &events[0];
    assert_eq!(event["type"], "Warning");
    let message = event["message"].as_str().unwrap();
    assert!(
        message.starts_with("Failed to create pod sandbox: "),
        "{message}"
    );
    assert!(
        message.contains("not-a-subnet"),
        "the plugin's error: {message}"
    );
    let pod = e
        .wait_for("client", "the CNI error in the container's status", |p| {
            let w = &container(p, "app")["state"]["waiting"];
            w["reason"] == "ContainerCreating"
                && w["message"].as_str().is_some_and(|m| {
                    m.starts_with("Failed to create pod sandbox: ") && m.contains("not-a-subnet")
                })
        })
        .await;
    assert_eq!(
        condition(&pod, "PodReadyToStartContainers")["status"],
        "False"
    );
    let uid = pod["metadata"]["uid"].as_str().unwrap().to_owned();
    let ready = v1::PodSandboxState::SandboxReady as i32;
    assert!(
        e.sandboxes(&uid).await.iter().all(|s| s.state != ready),
        "no sandbox ever gets ready"
    );
    // On containerd 1.x each refused attempt leaves a sandbox the next pod
    // relist finds, a PLEG event: retries still come at most about once a
    // second (the kubelet's relist period), not at the events' rate (7 a
    // second before). containerd 2 removes the refused sandbox, so there is
    // no event and the retry waits for the pod worker's back-off (the
    // kubelet's 10 s, jittered up to 15 s).
    let before = e.run_pod_sandbox_calls(&uid);
    let window = Duration::from_secs(4);
    tokio::time::sleep(window).await;
    let attempts = e.run_pod_sandbox_calls(&uid) - before;
    assert!(
        attempts <= 6,
        "{attempts} RunPodSandbox attempts in {window:?}"
    );
    let retry_bound = std::time::Instant::now() + Duration::from_secs(16);
    while e.run_pod_sandbox_calls(&uid) == before {
        assert!(
            std::time::Instant::now() < retry_bound,
            "no RunPodSandbox retry within 20 s of the last"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    e.finish().await;
}

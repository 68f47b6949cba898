//! End-to-end: the whole agent (in process, the code the binary runs) with the
//! kernel PLEG, against the real containerd harness; pods from a static manifest
//! directory; statuses read from the local `/pods` store (and once over HTTP).
//! Privileged: skipped with a reason without root/BTF/the eBPF object, a failure
//! under `CI=true`. One test at a time (each runs a containerd and an agent).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Parser;
use evpleg::agent::Agent;
use evpleg::config::Args;
use evpleg_tests::containerd::Containerd;
use evpleg_tests::privileged;
use serde_json::Value;

const NODE: &str = "e2e";
const DEADLINE: Duration = Duration::from_secs(60);

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct E2e {
    args: Args,
    agent: Option<Agent>,
    containerd: Option<Containerd>,
    manifests: PathBuf,
    uids: Mutex<HashSet<String>>,
}

impl E2e {
    async fn start(name: &str) -> Self {
        evpleg_tests::containerd::init_test_logging();
        let containerd = Containerd::start().unwrap_or_else(|e| panic!("containerd: {e}"));
        let manifests = containerd.base().join(format!("manifests-{name}"));
        std::fs::create_dir_all(&manifests).expect("manifest dir");
        let logs = containerd.base().join("pod-logs");
        let args = Args::try_parse_from([
            "evpleg",
            "--cri-endpoint",
            &containerd.endpoint(),
            "--manifest-dir",
            manifests.to_str().expect("utf-8"),
            "--node-name",
            NODE,
            "--listen",
            "127.0.0.1:0",
            "--pod-log-dir",
            logs.to_str().expect("utf-8"),
            "--crashloop-initial-seconds",
            "0.2",
            "--crashloop-max-seconds",
            "1",
        ])
        .expect("args");
        let agent = Agent::start(&args)
            .await
            .unwrap_or_else(|e| panic!("agent: {e}"));
        Self {
            args,
            agent: Some(agent),
            containerd: Some(containerd),
            manifests,
            uids: Mutex::new(HashSet::new()),
        }
    }

    fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("running")
    }

    /// Stops the agent (its containers keep running) and starts a new one with
    /// the same flags, as after a crash or an upgrade.
    async fn restart_agent(&mut self) {
        if let Some(a) = self.agent.take() {
            a.stop().await;
        }
        let agent = Agent::start(&self.args)
            .await
            .unwrap_or_else(|e| panic!("agent restart: {e}"));
        self.agent = Some(agent);
    }

    /// containerd's own log: it records every failed CRI call.
    fn runtime_log(&self) -> String {
        std::fs::read_to_string(self.cri().log_path()).unwrap_or_default()
    }

    fn write(&self, file: &str, yaml: &str) {
        // Written elsewhere and renamed in: the source never sees half a file.
        let tmp = self.manifests.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, yaml).expect("write manifest");
        std::fs::rename(&tmp, self.manifests.join(file)).expect("rename manifest");
    }

    fn pod(&self, name: &str) -> Option<Value> {
        let list = self.agent().local.pod_list();
        let pod = list["items"]
            .as_array()?
            .iter()
            .find(|p| p["metadata"]["name"] == format!("{name}-{NODE}"))
            .cloned()?;
        if let Some(uid) = pod["metadata"]["uid"].as_str() {
            self.uids
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(uid.to_owned());
        }
        Some(pod)
    }

    /// Waits (polling the store every 20 ms, bounded) until `check` holds.
    async fn wait_for(&self, name: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(p) = self.pod(name)
                && check(&p)
            {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "pod {name}: {what} not seen within {DEADLINE:?}; last: {:#}",
                self.pod(name).unwrap_or(Value::Null)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_gone(&self, name: &str) {
        let deadline = Instant::now() + DEADLINE;
        while self.pod(name).is_some() {
            assert!(
                Instant::now() < deadline,
                "pod {name} still in /pods after {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn cri(&self) -> &Containerd {
        self.containerd.as_ref().expect("running")
    }

    async fn finish(mut self) {
        if let Some(a) = self.agent.take() {
            a.stop().await;
        }
    }
}

impl Drop for E2e {
    fn drop(&mut self) {
        // Pods, containerd and its files go first, then the pod cgroups the agent
        // made (RemovePodSandbox leaves them; the agent's removal may not have run).
        drop(self.agent.take());
        drop(self.containerd.take());
        let mounts: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
        roots.extend(mounts);
        for uid in self.uids.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            for root in &roots {
                for qos in ["kubepods", "kubepods/burstable", "kubepods/besteffort"] {
                    let _ = std::fs::remove_dir(root.join(qos).join(format!("pod{uid}")));
                }
            }
        }
        // The QoS levels runc created for them, when nothing else uses them now.
        for root in &roots {
            for qos in ["kubepods/burstable", "kubepods/besteffort", "kubepods"] {
                let _ = std::fs::remove_dir(root.join(qos));
            }
        }
    }
}

fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    for key in ["containerStatuses", "initContainerStatuses"] {
        if let Some(c) = pod["status"][key]
            .as_array()
            .and_then(|a| a.iter().find(|c| c["name"] == name))
        {
            return c;
        }
    }
    &Value::Null
}

fn manifest(name: &str, policy: &str, command: &str, extra: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  hostNetwork: true\n  restartPolicy: {policy}\n  terminationGracePeriodSeconds: 3\n{extra}  containers:\n    - name: app\n      image: localhost/busybox:latest\n      command: [\"sh\", \"-c\", \"{command}\"]\n"
    )
}

macro_rules! e2e_test {
    ($name:ident, $body:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if !privileged(stringify!($name)) {
                return;
            }
            let _serial = SERIAL.lock().await;
            let e = E2e::start(stringify!($name)).await;
            let f: fn(&E2e) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + '_>> =
                $body;
            f(&e).await;
            e.finish().await;
        }
    };
}

e2e_test!(a_manifest_runs_with_its_init_container_first, |e| Box::pin(
    async move {
        let extra = "  initContainers:\n    - name: init\n      image: localhost/busybox:latest\n      command: [\"sh\", \"-c\", \"sleep 0.3\"]\n";
        e.write("web.yaml", &manifest("web", "Always", "sleep 600", extra));
        let pod = e
            .wait_for("web", "phase Running", |p| {
                p["status"]["phase"] == "Running"
            })
            .await;
        let init = container(&pod, "init");
        assert_eq!(
            init["state"]["terminated"]["reason"], "Completed",
            "{init:#}"
        );
        let init_done = init["state"]["terminated"]["finishedAt"]
            .as_str()
            .expect("finishedAt")
            .to_owned();
        let app = container(&pod, "app");
        let app_started = app["state"]["running"]["startedAt"]
            .as_str()
            .expect("startedAt")
            .to_owned();
        assert!(
            init_done <= app_started,
            "init finished {init_done}, app started {app_started}"
        );
        for cond in ["Initialized", "ContainersReady", "Ready"] {
            let c = pod["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == cond)
                .unwrap();
            assert_eq!(c["status"], "True", "{cond}");
        }
        // The same over HTTP, as a user reads it.
        let body = http_get(e.agent().addr, "/pods").await;
        assert!(
            body.contains("\"kind\":\"PodList\"") && body.contains("web-e2e"),
            "{body}"
        );
    }
));

e2e_test!(on_failure_restarts_and_counts, |e| Box::pin(async move {
    e.write(
        "flaky.yaml",
        &manifest("flaky", "OnFailure", "sleep 0.2; exit 3", ""),
    );
    let pod = e
        .wait_for("flaky", "restartCount >= 2", |p| {
            container(p, "app")["restartCount"].as_i64().unwrap_or(0) >= 2
        })
        .await;
    let last = &container(&pod, "app")["lastState"]["terminated"];
    assert_eq!(
        (last["exitCode"].as_i64(), last["reason"].as_str()),
        (Some(3), Some("Error")),
        "{pod:#}"
    );
}));

e2e_test!(never_fails_with_the_exit_code, |e| Box::pin(async move {
    e.write("once.yaml", &manifest("once", "Never", "exit 3", ""));
    let pod = e
        .wait_for("once", "phase Failed", |p| p["status"]["phase"] == "Failed")
        .await;
    let t = &container(&pod, "app")["state"]["terminated"];
    assert_eq!(t["exitCode"], 3, "{pod:#}");
    assert_eq!(container(&pod, "app")["restartCount"], 0);
}));

e2e_test!(a_container_killed_from_outside_is_restarted, |e| Box::pin(
    async move {
        e.write(
            "victim.yaml",
            &manifest("victim", "Always", "sleep 600", ""),
        );
        let pod = e
            .wait_for("victim", "running", |p| {
                container(p, "app")["state"]["running"].is_object()
            })
            .await;
        let id = container(&pod, "app")["containerID"]
            .as_str()
            .expect("containerID")
            .trim_start_matches("containerd://")
            .to_owned();
        // The container's main process, found by its cgroup (the container id).
        let pid = find_container_pid(&id).expect("the container's process");
        // SAFETY: a plain signal to a process of our own test container.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        let pod = e
            .wait_for("victim", "restarted and running", |p| {
                let c = container(p, "app");
                c["restartCount"].as_i64().unwrap_or(0) >= 1 && c["state"]["running"].is_object()
            })
            .await;
        let last = &container(&pod, "app")["lastState"]["terminated"];
        assert_eq!(last["exitCode"], 137, "{pod:#}");
    }
));

e2e_test!(a_container_over_its_memory_limit_is_oom_killed, |e| {
    Box::pin(async move {
        let yaml = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: hog\nspec:\n  hostNetwork: true\n  restartPolicy: Never\n  containers:\n    - name: app\n      image: localhost/busybox:latest\n      command: [\"dd\", \"if=/dev/zero\", \"of=/dev/null\", \"bs=256M\", \"count=1\"]\n      resources:\n        limits: {memory: 32Mi}\n";
        e.write("hog.yaml", yaml);
        let pod = e
            .wait_for("hog", "phase Failed", |p| p["status"]["phase"] == "Failed")
            .await;
        let t = &container(&pod, "app")["state"]["terminated"];
        assert_eq!(t["reason"], "OOMKilled", "{pod:#}");
        assert_eq!(t["exitCode"], 137);
    })
});

e2e_test!(removing_the_manifest_stops_and_removes_the_pod, |e| {
    Box::pin(async move {
        e.write(
            "gone.yaml",
            &manifest(
                "gone",
                "Always",
                "trap 'exit 0' TERM; while true; do sleep 0.1; done",
                "",
            ),
        );
        let pod = e
            .wait_for("gone", "running", |p| {
                container(p, "app")["state"]["running"].is_object()
            })
            .await;
        let uid = pod["metadata"]["uid"].as_str().unwrap().to_owned();
        let removed = Instant::now();
        std::fs::remove_file(e.manifests.join("gone.yaml")).expect("remove manifest");
        e.wait_gone("gone").await;
        let took = removed.elapsed();
        assert!(
            took < Duration::from_secs(3 + 10),
            "termination took {took:?} with a 3 s grace period"
        );
        // The sandbox is gone from the runtime, and the pod cgroup from the host.
        let sandboxes = list_sandboxes(e.cri()).await;
        assert!(
            !sandboxes.iter().any(|s| s.contains(&uid)),
            "sandbox of {uid} left: {sandboxes:?}"
        );
        let cgroup =
            Path::new("/sys/fs/cgroup/unified/kubepods/besteffort").join(format!("pod{uid}"));
        let cgroup2 = Path::new("/sys/fs/cgroup/kubepods/besteffort").join(format!("pod{uid}"));
        assert!(!cgroup.exists() && !cgroup2.exists(), "pod cgroup left");
    })
});

e2e_test!(an_invalid_manifest_does_not_stop_a_valid_one, |e| Box::pin(
    async move {
        e.write(
            "broken.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: broken\nspec: [",
        );
        e.write("good.yaml", &manifest("good", "Always", "sleep 600", ""));
        e.wait_for("good", "running", |p| p["status"]["phase"] == "Running")
            .await;
        assert!(e.pod("broken").is_none());
    }
));

/// Contract clause 8 (docs/pleg.md), the first case the review found: after an
/// agent restart no worker acts before the first complete relist, so none
/// calls RunPodSandbox for a pod whose sandbox exists ("failed to reserve
/// sandbox name"); the running container is adopted, not restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_restart_adopts_running_pods_without_a_new_sandbox() {
    if !privileged("an_agent_restart_adopts_running_pods_without_a_new_sandbox") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut e = E2e::start("restart").await;
    e.write(
        "steady.yaml",
        &manifest("steady", "Always", "sleep 600", ""),
    );
    let running = |p: &Value| container(p, "app")["state"]["running"].is_object();
    let pod = e.wait_for("steady", "running", running).await;
    let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
    let id = container(&pod, "app")["containerID"].clone();
    // Sandbox ids of the pod (the labels' order varies from list to list).
    let sandboxes = |all: Vec<String>| {
        all.into_iter()
            .filter(|s| s.contains(&uid))
            .filter_map(|s| s.split_whitespace().next().map(str::to_owned))
            .collect::<Vec<_>>()
    };
    let before = sandboxes(list_sandboxes(e.cri()).await);
    assert_eq!(before.len(), 1, "{before:?}");
    e.restart_agent().await;
    let pod = e
        .wait_for("steady", "running in the new agent", running)
        .await;
    assert_eq!(
        container(&pod, "app")["containerID"],
        id,
        "the container was not restarted"
    );
    assert_eq!(container(&pod, "app")["restartCount"], 0);
    assert_eq!(sandboxes(list_sandboxes(e.cri()).await), before);
    let log = e.runtime_log();
    assert!(
        !log.contains("failed to reserve sandbox name"),
        "RunPodSandbox was called for an existing sandbox:\n{}",
        log.lines()
            .filter(|l| l.contains("reserve"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    e.finish().await;
}

/// Contract clause 8, the second case: a container that cannot be created
/// after its sandbox was (its image does not exist) is retried with back-off,
/// and every retry sees the sandbox: the pod relist after each sync refreshes
/// the cache in `ebpf` mode, where the periodic relist is 5 min away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_container_creation_is_retried_without_a_new_sandbox() {
    if !privileged("a_failed_container_creation_is_retried_without_a_new_sandbox") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start("noimage").await;
    let yaml = manifest("noimage", "Always", "sleep 600", "")
        .replace("localhost/busybox:latest", "localhost/evpleg-absent:1");
    e.write("noimage.yaml", &yaml);
    let deadline = Instant::now() + DEADLINE;
    loop {
        let log = e.runtime_log();
        let failures = log
            .lines()
            .filter(|l| {
                l.contains("level=error")
                    && (l.contains("CreateContainer") || l.contains("PullImage"))
                    && l.contains("evpleg-absent")
            })
            .count();
        assert!(
            !log.contains("failed to reserve sandbox name"),
            "RunPodSandbox was called again for an existing sandbox"
        );
        if failures >= 3 {
            eprintln!("{failures} failed attempts, no second RunPodSandbox");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "fewer than 3 attempts to create the container within {DEADLINE:?}:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pod = e.pod("noimage").expect("the pod has a status");
    let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
    let ours: Vec<String> = list_sandboxes(e.cri())
        .await
        .into_iter()
        .filter(|s| s.contains(&uid))
        .collect();
    assert_eq!(ours.len(), 1, "{ours:?}");
    e.finish().await;
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .expect("timely response")
        .expect("read");
    out
}

/// The host pid of the main process of container `id`: the process in its cgroup
/// whose parent is outside it.
fn find_container_pid(id: &str) -> Option<i32> {
    let procs = std::fs::read_dir("/proc").ok()?;
    let mut in_cgroup = Vec::new();
    for p in procs.flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cg) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        if cg.lines().any(|l| l.starts_with("0::") && l.ends_with(id)) {
            in_cgroup.push(pid);
        }
    }
    in_cgroup.iter().copied().find(|pid| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid: i32 = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        !in_cgroup.contains(&ppid)
    })
}

async fn list_sandboxes(containerd: &Containerd) -> Vec<String> {
    containerd
        .client()
        .await
        .list_pod_sandboxes(None)
        .await
        .expect("list")
        .into_iter()
        .map(|s| format!("{} {:?}", s.id, s.labels))
        .collect()
}

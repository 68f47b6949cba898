//! Faults on the real runtime (issue #24): `evpleg run` and `evpleg
//! cri-proxy` killed with SIGKILL (no graceful stop) at the worst moments,
//! and a full disk under the agent's root directory. After a restart with
//! the same flags nothing is lost (the pod runs again, its status is
//! written), nothing is run twice (each container's entrypoint appends to a
//! host file: one line), nothing is leaked (no container, sandbox, mount,
//! pod cgroup or pod directory once the pod is removed), and nothing
//! outside the agent's directories is touched. The kubelet is expected to
//! survive the same (it keeps no state it cannot rebuild from the runtime
//! and its directories); it has no such tests. Each agent runs as
//! `evpleg-killable` ([`evpleg_tests::killable`]). Privileged: skipped with
//! a reason without root/BTF/the eBPF object, a failure under `CI=true`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use evpleg_cri_api::v1;
use evpleg_tests::containerd::Containerd;
use evpleg_tests::cri_interceptor::CriInterceptor;
use evpleg_tests::e2e::{IMAGE, NODE, http_get, remove_pod_cgroups};
use evpleg_tests::fake_apiserver::FakeApiServer;
use evpleg_tests::killable::Killable;
use serde_json::Value;

const BOUND: Duration = Duration::from_secs(60);
/// How late the restarted agent's first view of the runtime comes.
const LATE_VIEW: Duration = Duration::from_secs(2);
const PROGRAM: &str = env!("CARGO_BIN_EXE_evpleg-killable");

/// One test's node: a private containerd, optionally a CRI interceptor in
/// front of it and the fake API server, and the agent's directories.
struct Node {
    containerd: Containerd,
    interceptor: Option<CriInterceptor>,
    api: Option<FakeApiServer>,
    manifests: PathBuf,
    root: PathBuf,
    /// The host directory the pods' entrypoints record their starts in.
    starts: PathBuf,
    uids: Vec<String>,
}

impl Node {
    fn new(intercept: bool) -> Self {
        evpleg_tests::containerd::init_test_logging();
        let containerd = Containerd::start().unwrap_or_else(|e| panic!("containerd: {e}"));
        let base = containerd.base().to_owned();
        let interceptor = intercept.then(|| {
            CriInterceptor::start(containerd.socket(), base.join("intercept.sock"))
                .expect("interceptor")
        });
        let (manifests, root, starts) = (
            base.join("manifests"),
            base.join("agent-root"),
            base.join("starts"),
        );
        for d in [&manifests, &root, &starts] {
            std::fs::create_dir_all(d).unwrap();
        }
        Self {
            containerd,
            interceptor,
            api: None,
            manifests,
            root,
            starts,
            uids: Vec::new(),
        }
    }

    fn base(&self) -> &Path {
        self.containerd.base()
    }

    fn agent_args(&self) -> Vec<String> {
        let endpoint = match &self.interceptor {
            Some(i) => i.endpoint(),
            None => self.containerd.endpoint(),
        };
        let mut args: Vec<String> = [
            "run",
            "--manifest-dir",
            self.manifests.to_str().unwrap(),
            "--node-name",
            NODE,
            "--listen",
            "127.0.0.1:0",
            "--pod-log-dir",
            self.base().join("pod-logs").to_str().unwrap(),
            "--root-dir",
            self.root.to_str().unwrap(),
            "--cri-endpoint",
            &endpoint,
            "--crashloop-backoff-initial",
            "200ms",
            "--crashloop-backoff-max",
            "1s",
            // A removed pod's containers and sandbox go at the container
            // GC's next period (a minute by default, as the kubelet's).
            "--container-gc-period",
            "1s",
        ]
        .map(String::from)
        .into();
        if let Some(api) = &self.api {
            let path = self.base().join("kubeconfig");
            std::fs::write(&path, kubeconfig(&api.url())).unwrap();
            args.extend(["--kubeconfig".into(), path.display().to_string()]);
            args.extend([
                "--port".into(),
                "0".into(),
                "--address".into(),
                "127.0.0.1".into(),
            ]);
        }
        args
    }

    fn start_agent(&self) -> Killable {
        Killable::spawn(
            Path::new(PROGRAM),
            &self.agent_args(),
            &self.base().join("agent.log"),
        )
    }

    fn write(&self, file: &str, yaml: &str) {
        let tmp = self.manifests.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, self.manifests.join(file)).unwrap();
    }

    /// A static pod whose container records each start of its entrypoint
    /// in `<starts>/<name>`, with `volumes` (YAML, under `volumes:`) and
    /// `mounts` (under the container's `volumeMounts:`).
    fn counting_pod(&self, name: &str, volumes: &str, mounts: &str) -> String {
        format!(
            r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 1
  volumes:
    - name: starts
      hostPath: {{path: {starts}, type: Directory}}
{volumes}  containers:
    - name: app
      image: {IMAGE}
      command: [sh, -c, 'echo started >> /starts/{name}; exec sleep 1000']
      volumeMounts:
        - name: starts
          mountPath: /starts
{mounts}"#,
            starts = self.starts.display()
        )
    }

    /// How many times the entrypoint of pod `name` started.
    fn starts_of(&self, name: &str) -> usize {
        std::fs::read_to_string(self.starts.join(name))
            .unwrap_or_default()
            .lines()
            .count()
    }

    async fn containers(&self, uid: &str) -> Vec<v1::Container> {
        self.containerd.pod_containers(uid).await
    }

    async fn sandboxes(&self, uid: &str) -> Vec<v1::PodSandbox> {
        self.containerd.pod_sandboxes(uid).await
    }

    /// What is left of pod `uid` on the node: its containers, sandboxes,
    /// mounts, pod cgroups and pod directory (empty: nothing).
    async fn leftovers(&self, uid: &str) -> Vec<String> {
        let mut left: Vec<String> = self
            .containers(uid)
            .await
            .iter()
            .map(|c| format!("container {} state {}", c.id, c.state))
            .collect();
        left.extend(
            self.sandboxes(uid)
                .await
                .iter()
                .map(|s| format!("sandbox {} state {}", s.id, s.state)),
        );
        left.extend(mounts_of(uid).into_iter().map(|m| format!("mount {m}")));
        left.extend(pod_cgroups(uid).into_iter().map(|c| format!("cgroup {c}")));
        let dir = self.root.join("pods").join(uid);
        if dir.exists() {
            left.push(format!("directory {}", dir.display()));
        }
        left
    }

    /// Waits (bounded) until nothing of pod `uid` is left.
    async fn wait_nothing_left(&self, uid: &str) {
        let deadline = Instant::now() + BOUND;
        loop {
            let left = self.leftovers(uid).await;
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pod {uid}: left after {BOUND:?}: {left:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        remove_pod_cgroups(&self.uids);
    }
}

fn kubeconfig(url: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\nusers:\n- name: agent\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: agent\ncurrent-context: fake\n"
    )
}

/// The mount points (this mount namespace's) whose path names pod `uid`.
fn mounts_of(uid: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.contains(uid))
        .map(String::from)
        .collect()
}

/// The pod cgroups (`pod<uid>`, any QoS level, any hierarchy) of pod `uid`.
fn pod_cgroups(uid: &str) -> Vec<String> {
    let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
    roots.extend(
        std::fs::read_dir("/sys/fs/cgroup")
            .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
            .unwrap_or_default(),
    );
    let mut found = Vec::new();
    for root in roots {
        for qos in ["kubepods", "kubepods/burstable", "kubepods/besteffort"] {
            let p = root.join(qos).join(format!("pod{uid}"));
            if p.is_dir() {
                found.push(p.display().to_string());
            }
        }
    }
    found
}

/// The agent's `/pods` entry for static pod `name`.
async fn pod(agent: &Killable, name: &str) -> Option<Value> {
    let raw = http_get(agent.addr, "/pods").await;
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    let list: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    list["items"]
        .as_array()?
        .iter()
        .find(|p| p["metadata"]["name"] == format!("{name}-{NODE}"))
        .cloned()
}

/// Waits (bounded, polling every 50 ms) until pod `name` in the agent's
/// `/pods` satisfies `check`.
async fn wait_pod(
    agent: &Killable,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + BOUND;
    loop {
        let p = pod(agent, name).await;
        if let Some(p) = p.as_ref().filter(|p| check(p)) {
            return p.clone();
        }
        assert!(
            Instant::now() < deadline,
            "pod {name}: {what} not seen within {BOUND:?}; last: {p:#?}\nagent log:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_gone(agent: &Killable, name: &str) {
    let deadline = Instant::now() + BOUND;
    while pod(agent, name).await.is_some() {
        assert!(
            Instant::now() < deadline,
            "pod {name} still in /pods after {BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded, polling every 10 ms) until `done` holds.
async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + BOUND;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {BOUND:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn app_running(p: &Value) -> bool {
    p["status"]["containerStatuses"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["name"] == "app"))
        .is_some_and(|c| c["state"]["running"].is_object())
}

fn uid_of(p: &Value) -> String {
    p["metadata"]["uid"].as_str().expect("a uid").to_owned()
}

/// Running containers of pod `uid`.
async fn running(node: &Node, uid: &str) -> usize {
    node.containers(uid)
        .await
        .iter()
        .filter(|c| c.state == v1::ContainerState::ContainerRunning as i32)
        .count()
}

/// After a restart: pod `name` runs once, in one sandbox; removed, it
/// leaves nothing.
async fn runs_once_then_leaves_nothing(node: &Node, agent: &Killable, name: &str, file: &str) {
    let p = wait_pod(agent, name, "app running", app_running).await;
    let uid = uid_of(&p);
    assert_eq!(running(node, &uid).await, 1, "one running container");
    let ready = node
        .sandboxes(&uid)
        .await
        .iter()
        .filter(|s| s.state == v1::PodSandboxState::SandboxReady as i32)
        .count();
    assert_eq!(ready, 1, "one ready sandbox");
    assert_eq!(node.starts_of(name), 1, "the entrypoint ran once");
    std::fs::remove_file(node.manifests.join(file)).unwrap();
    wait_gone(agent, name).await;
    node.wait_nothing_left(&uid).await;
    assert_eq!(node.starts_of(name), 1, "the entrypoint ran once");
}

macro_rules! privileged {
    ($name:literal) => {
        if !evpleg_tests::privileged($name) {
            return;
        }
    };
}

// (a) SIGKILL after CreateContainer returned and before StartContainer
// reached the runtime (the interceptor holds it): the runtime has a CREATED
// container nobody will start. The restarted agent runs the pod's container
// once (the CREATED one started or replaced, never both), in the same
// sandbox; removed, the pod leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_create_and_start_runs_the_container_once() {
    privileged!("sigkill_between_create_and_start_runs_the_container_once");
    let mut node = Node::new(true);
    let icpt = node.interceptor.as_ref().unwrap();
    icpt.hold("StartContainer");
    let agent = node.start_agent();
    node.write("gap.yaml", &node.counting_pod("gap", "", ""));
    wait_until("StartContainer sent", || {
        icpt.calls().get("StartContainer").copied().unwrap_or(0) >= 1
    })
    .await;
    let uid = uid_of(&wait_pod(&agent, "gap", "listed", |_| true).await);
    node.uids.push(uid.clone());
    agent.kill9();
    icpt.unhold("StartContainer");
    let states: Vec<i32> = node
        .containers(&uid)
        .await
        .iter()
        .map(|c| c.state)
        .collect();
    assert_eq!(
        states,
        [v1::ContainerState::ContainerCreated as i32],
        "killed between the two calls"
    );
    assert_eq!(node.starts_of("gap"), 0);
    let agent = node.start_agent();
    runs_once_then_leaves_nothing(&node, &agent, "gap", "gap.yaml").await;
}

// (b) SIGKILL while a pod's volumes are set up (as soon as its Memory
// emptyDir's directory exists, before or after its tmpfs is mounted): the
// restarted agent mounts the volume once (one tmpfs at its path, not two
// stacked), runs the container once; removed, the pod leaves no mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_volume_set_up_mounts_once() {
    privileged!("sigkill_during_volume_set_up_mounts_once");
    let mut node = Node::new(false);
    let agent = node.start_agent();
    let yaml = node.counting_pod(
        "vol",
        "    - name: mem\n      emptyDir: {medium: Memory, sizeLimit: 1Mi}\n",
        "        - name: mem\n          mountPath: /mem\n",
    );
    let pods = node.root.join("pods");
    node.write("vol.yaml", &yaml);
    let volume = |pods: &Path| -> Option<PathBuf> {
        let d = std::fs::read_dir(pods).ok()?.flatten().next()?.path();
        let v = d.join("volumes/kubernetes.io~empty-dir/mem");
        v.exists().then_some(v)
    };
    wait_until("the volume's directory made", || volume(&pods).is_some()).await;
    agent.kill9();
    let path = volume(&pods).unwrap();
    let uid = path
        .components()
        .nth(pods.components().count())
        .unwrap()
        .as_os_str()
        .to_string_lossy()
        .into_owned();
    node.uids.push(uid.clone());
    eprintln!("killed with the volume's mounts at {:?}", mounts_of(&uid));
    let agent = node.start_agent();
    wait_pod(&agent, "vol", "app running", app_running).await;
    let at_path: Vec<String> = mounts_of(&uid)
        .into_iter()
        .filter(|m| Path::new(m) == path)
        .collect();
    assert_eq!(
        at_path.len(),
        1,
        "one tmpfs at {}: {at_path:?}",
        path.display()
    );
    runs_once_then_leaves_nothing(&node, &agent, "vol", "vol.yaml").await;
}

// (c) SIGKILL while the pod's statuses are pending: the API server goes
// away while StartContainer is in the runtime (the interceptor pauses it
// until then), so "Running" is never written: the restarted agent writes
// the status (Running, ready, restartCount 0) from what the runtime has,
// without running the container again; deleted, the pod leaves nothing.
// The restarted agent's first view of the runtime comes late (its
// ListPodSandbox paused for LATE_VIEW after it has the pod from the API
// server): meanwhile it changes nothing in the runtime, as the kubelet's
// workers wait for the PLEG's first relist. A worker syncing on a view
// nobody observed calls RunPodSandbox again (containerd refuses the
// duplicate name, which alone hid it from the starts file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_statuses_pending_loses_nothing() {
    privileged!("sigkill_with_statuses_pending_loses_nothing");
    let mut node = Node::new(true);
    let api = FakeApiServer::start().await;
    api.add_node(NODE);
    node.api = Some(api);
    let icpt = node.interceptor.as_ref().unwrap();
    icpt.pause("StartContainer");
    let agent = node.start_agent();
    let mut pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "pend", "namespace": "default"},
        "spec": {
            "nodeName": NODE, "hostNetwork": true, "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "starts", "hostPath": {"path": node.starts.display().to_string(), "type": "Directory"}}],
            "containers": [{"name": "app", "image": IMAGE,
                "command": ["sh", "-c", "echo started >> /starts/pend; exec sleep 1000"],
                "volumeMounts": [{"name": "starts", "mountPath": "/starts"}]}]
        }
    }))
    .unwrap();
    pod.status = None;
    let api = node.api.as_ref().unwrap();
    let uid = api.add_pod(pod).metadata.uid.unwrap();
    node.uids.push(uid.clone());
    wait_until("StartContainer sent", || {
        icpt.calls().get("StartContainer").copied().unwrap_or(0) >= 1
    })
    .await;
    api.set_available(false);
    icpt.unhold("StartContainer");
    let deadline = Instant::now() + BOUND;
    while running(&node, &uid).await != 1 {
        assert!(Instant::now() < deadline, "not running within {BOUND:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let phase = |api: &FakeApiServer| {
        api.status_of("default", "pend")
            .and_then(|s| s.phase)
            .unwrap_or_default()
    };
    assert_ne!(phase(api), "Running", "the status is pending");
    agent.kill9();
    api.set_available(true);
    let changes = icpt.mutating_calls();
    let seen = api.requests().len();
    icpt.pause("ListPodSandbox");
    let agent = node.start_agent();
    wait_until("the restarted agent watches its pods", || {
        api.requests()[seen..]
            .iter()
            .any(|r| r.path() == "/api/v1/pods" && r.query("watch").as_deref() == Some("true"))
    })
    .await;
    // A window for a change that must not come (not a synchronisation: the
    // agent under test passes whatever its length).
    tokio::time::sleep(LATE_VIEW).await;
    assert_eq!(
        icpt.mutating_calls(),
        changes,
        "runtime changes before the agent's first view of the runtime\n{}",
        agent.log()
    );
    icpt.unhold("ListPodSandbox");
    api.wait_for_pods("Running and ready", BOUND, |pods| {
        pods.iter().any(|p| {
            let s = p.status.as_ref();
            let c = s
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c.first());
            s.and_then(|s| s.phase.as_deref()) == Some("Running")
                && c.is_some_and(|c| c.ready && c.restart_count == 0)
        })
    })
    .await;
    assert_eq!(running(&node, &uid).await, 1, "one running container");
    assert_eq!(node.starts_of("pend"), 1, "the entrypoint ran once");
    api.delete_pod("default", "pend");
    node.wait_nothing_left(&uid).await;
    assert_eq!(node.starts_of("pend"), 1);
    drop(agent);
}

// A pod deleted while the agent was down after a SIGKILL (its static
// manifest removed): at the next start its containers and sandbox are
// removed, its Memory emptyDir (a tmpfs) unmounted and its directory
// removed (the kubelet's cleanupOrphanedPodDirs). A symlink planted in the
// pod's directory to a host directory outside the agent's is not followed:
// that directory and its file stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_removed_while_the_agent_was_killed_is_cleaned_up_at_start() {
    privileged!("a_pod_removed_while_the_agent_was_killed_is_cleaned_up_at_start");
    let mut node = Node::new(false);
    let outside = node.base().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("keep"), "host").unwrap();
    let agent = node.start_agent();
    node.write(
        "orphan.yaml",
        &node.counting_pod(
            "orphan",
            "    - name: mem\n      emptyDir: {medium: Memory, sizeLimit: 1Mi}\n",
            "        - name: mem\n          mountPath: /mem\n",
        ),
    );
    let uid = uid_of(&wait_pod(&agent, "orphan", "app running", app_running).await);
    node.uids.push(uid.clone());
    let dir = node.root.join("pods").join(&uid);
    let tmpfs = dir.join("volumes/kubernetes.io~empty-dir/mem");
    assert_eq!(
        mounts_of(&uid),
        [tmpfs.display().to_string()],
        "the tmpfs is mounted"
    );
    agent.kill9();
    std::fs::remove_file(node.manifests.join("orphan.yaml")).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("planted")).unwrap();
    std::os::unix::fs::symlink(&outside, tmpfs.join("planted")).unwrap();
    let agent = node.start_agent();
    node.wait_nothing_left(&uid).await;
    assert_eq!(
        std::fs::read_to_string(outside.join("keep")).unwrap(),
        "host"
    );
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
    assert_eq!(node.starts_of("orphan"), 1);
    drop(agent);
}

// `evpleg cri-proxy` killed with SIGKILL while an ExecSync it forwards is
// in the runtime (the interceptor between the proxy and containerd saw it
// arrive): the client's call fails at once (no hang); the proxy started
// again on the same socket serves the same client (it reconnects) within
// a bound; containerd, its container and its sandbox are unharmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_cri_proxy_mid_call_leaves_the_runtime_unharmed() {
    privileged!("sigkill_of_the_cri_proxy_mid_call_leaves_the_runtime_unharmed");
    use evpleg_tests::cri_pod::{TestPod, run_container, run_sandbox};
    let node = Node::new(true);
    let direct = node.containerd.client().await;
    let test_pod = TestPod::new(&node.containerd, "proxied");
    let sandbox = run_sandbox(&direct, &test_pod).await;
    let id = run_container(
        &direct,
        &test_pod,
        &sandbox,
        &test_pod.container("app", &["sleep", "1000"]),
    )
    .await;
    let socket = node.base().join("proxy.sock");
    let args: Vec<String> = [
        "cri-proxy",
        "--listen",
        &format!("unix://{}", socket.display()),
        "--runtime-endpoint",
        &node.interceptor.as_ref().unwrap().endpoint(),
        "--http-listen",
        "127.0.0.1:0",
    ]
    .map(String::from)
    .into();
    let log = node.base().join("proxy.log");
    let proxy = Killable::spawn(Path::new(PROGRAM), &args, &log);
    let client = evpleg_cri::CriClient::connect(
        &format!("unix://{}", socket.display()),
        evpleg_cri::CriClientConfig::default(),
    )
    .await
    .expect("connect through the proxy");
    let call = {
        let (client, id) = (client.clone(), id.clone());
        tokio::spawn(async move {
            let t = Instant::now();
            let r = client
                .exec_sync(&id, &["sleep", "5"], Duration::from_secs(10))
                .await;
            (r.map(|r| r.exit_code), t.elapsed())
        })
    };
    let icpt = node.interceptor.as_ref().unwrap();
    wait_until("the ExecSync in the runtime", || {
        icpt.calls().get("ExecSync").copied().unwrap_or(0) >= 1
    })
    .await;
    let runtime_pid = node.containerd.pid();
    proxy.kill9();
    let (result, took) = tokio::time::timeout(BOUND, call)
        .await
        .expect("the call ends")
        .unwrap();
    assert!(
        result.is_err(),
        "the call through the killed proxy fails: {result:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "it failed at once, not after the exec: {took:?}"
    );
    let proxy = Killable::spawn(Path::new(PROGRAM), &args, &log);
    let t = Instant::now();
    loop {
        match tokio::time::timeout(Duration::from_secs(2), client.version()).await {
            Ok(Ok(_)) => break,
            other => assert!(
                t.elapsed() < Duration::from_secs(10),
                "the client did not get through the new proxy: {other:?}\n{}",
                proxy.log()
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "the client reconnected {:?} after the new proxy was ready",
        t.elapsed()
    );
    let status = client
        .container_status(&id, false)
        .await
        .expect("status through the proxy")
        .status
        .expect("a status");
    assert_eq!(status.state, v1::ContainerState::ContainerRunning as i32);
    assert_eq!(
        node.containerd.pid(),
        runtime_pid,
        "containerd was not restarted"
    );
    let sandboxes = direct.list_pod_sandboxes(None).await.unwrap();
    assert_eq!(
        sandboxes
            .iter()
            .map(|s| (s.id.as_str(), s.state))
            .collect::<Vec<_>>(),
        [(sandbox.as_str(), v1::PodSandboxState::SandboxReady as i32)]
    );
    direct.stop_pod_sandbox(&sandbox).await.unwrap();
    direct.remove_pod_sandbox(&sandbox).await.unwrap();
    drop(proxy);
}

/// Raises the soft RLIMIT_NOFILE to `want` (or the hard limit); returns it.
fn raise_nofile(want: u64) -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit to fill and then to set.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = want.min(r.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
    }
    r.rlim_cur
}

// Network attacks on `evpleg cri-proxy`'s HTTP listener (/metrics,
// /healthz) on loopback: 5 000 idle connections (against its default cap
// of 256) and a slowloris client (a header line every 100 ms, never the
// end), with the header timeout at 3 s. The proxy's memory stays bounded,
// the slowloris client and the idle ones are closed at the header timeout,
// a client is served after, and the CRI socket (gRPC through the proxy)
// answers a call every 100 ms within 1 s throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slowloris_clients_of_the_proxy_listener_leave_the_cri_served() {
    privileged!("idle_and_slowloris_clients_of_the_proxy_listener_leave_the_cri_served");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    const HEADER: Duration = Duration::from_secs(3);
    let nofile = raise_nofile(12_000);
    let n = 5_000.min(nofile.saturating_sub(500) as usize);
    let node = Node::new(false);
    let socket = node.base().join("proxy.sock");
    let endpoint = format!("unix://{}", socket.display());
    let args: Vec<String> = [
        "cri-proxy",
        "--listen",
        &endpoint,
        "--runtime-endpoint",
        &node.containerd.endpoint(),
        "--http-listen",
        "127.0.0.1:0",
        "--http-header-timeout",
        "3s",
    ]
    .map(String::from)
    .into();
    let proxy = Killable::spawn(Path::new(PROGRAM), &args, &node.base().join("proxy.log"));
    let addr = proxy.addr;
    let client = evpleg_cri::CriClient::connect(&endpoint, evpleg_cri::CriClientConfig::default())
        .await
        .expect("connect through the proxy");
    // The CRI through the proxy, every 100 ms: the slowest call and failures.
    let stop = tokio_util::sync::CancellationToken::new();
    let cri = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut calls, mut slowest, mut failed) = (0u32, Duration::ZERO, Vec::new());
            while !stop.is_cancelled() {
                let t = Instant::now();
                match tokio::time::timeout(Duration::from_secs(1), client.version()).await {
                    Ok(Ok(_)) => {}
                    other => failed.push(format!("{other:?}")),
                }
                slowest = slowest.max(t.elapsed());
                calls += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (calls, slowest, failed)
        })
    };
    let rss_before = proxy.rss_kib();
    let opened = Instant::now();
    let mut slowloris = TcpStream::connect(addr).await.unwrap();
    slowloris
        .write_all(b"GET /metrics HTTP/1.1\r\n")
        .await
        .unwrap();
    let mut idle = Vec::with_capacity(n);
    for _ in 0..n {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    let open_took = opened.elapsed();
    let rss_full = proxy.rss_kib();
    // The slowloris client: a header line every 100 ms until closed.
    let slow = tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        let deadline = Instant::now() + HEADER + Duration::from_secs(5);
        let mut i = 0;
        while Instant::now() < deadline {
            if slowloris
                .write_all(format!("X-Slow-{i}: a\r\n").as_bytes())
                .await
                .is_err()
            {
                return Some(opened.elapsed());
            }
            i += 1;
            if let Ok(r) =
                tokio::time::timeout(Duration::from_millis(100), slowloris.read(&mut buf)).await
                && matches!(r, Ok(0) | Err(_))
            {
                return Some(opened.elapsed());
            }
        }
        None
    });
    let waits: Vec<_> = idle
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                tokio::time::timeout(HEADER + Duration::from_secs(5), async {
                    loop {
                        if matches!(s.read(&mut buf).await, Ok(0) | Err(_)) {
                            return;
                        }
                    }
                })
                .await
                .is_ok()
            })
        })
        .collect();
    let mut closed = 0;
    for w in waits {
        closed += usize::from(w.await.unwrap());
    }
    let slow_closed = slow.await.unwrap();
    let served = http_get(addr, "/metrics").await;
    stop.cancel();
    let (calls, slowest, failed) = cri.await.unwrap();
    eprintln!(
        "{n} idle connections opened in {open_took:?}; proxy RSS {rss_before} KiB -> {rss_full} KiB; \
         slowloris closed after {slow_closed:?}; {calls} CRI calls, slowest {slowest:?}"
    );
    assert_eq!(closed, n, "every idle connection closed");
    let slow_closed = slow_closed.expect("the slowloris client is closed");
    assert!(
        slow_closed < HEADER + Duration::from_secs(2),
        "{slow_closed:?}"
    );
    assert!(served.starts_with("HTTP/1.1 200"), "{served}");
    assert_eq!(
        failed,
        Vec::<String>::new(),
        "every CRI call answered within 1 s"
    );
    assert!(calls >= 20, "{calls} CRI calls");
    assert!(
        rss_full < rss_before + 32 * 1024,
        "RSS {rss_before} KiB -> {rss_full} KiB"
    );
}

/// A tmpfs of `bytes` mounted on `dir`, unmounted (lazily) on drop.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, bytes: u64) -> Self {
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("mount");
        assert!(out.status.success(), "mount: {out:?}");
        Self(dir.to_owned())
    }

    /// Fills it: a file `filler` written until ENOSPC; returns its path.
    fn fill(&self) -> PathBuf {
        use std::io::Write;
        let path = self.0.join("filler");
        let mut f = std::fs::File::create(&path).unwrap();
        let chunk = vec![0u8; 4096];
        loop {
            match f.write_all(&chunk) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("{}: {e}", path.display()),
            }
        }
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// The agent's events of static pod `name` (`/pods/default/<name>/events`).
async fn events(agent: &Killable, name: &str) -> String {
    http_get(agent.addr, &format!("/pods/default/{name}-{NODE}/events")).await
}

// The agent's root directory on a full file system (a 1 MiB tmpfs, filled
// to the last block) while a pod's volumes and files are written: the pod
// does not start and the error names the path that could not be written;
// once space is freed the pod starts (once), and after a SIGKILL and a
// restart its hosts file reads whole: the write the full disk failed left
// it empty, and it was written again (an agent that never rewrites an
// existing file fails here: `left: ""`). Nothing is being written when
// the SIGKILL lands: writes cut by a kill are not what this tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_root_dir_gives_clear_errors_and_no_corruption() {
    privileged!("a_full_root_dir_gives_clear_errors_and_no_corruption");
    let mut node = Node::new(false);
    let disk = SmallDisk::mount(&node.root, 1 << 20);
    let filler = disk.fill();
    let agent = node.start_agent();
    node.write(
        "full.yaml",
        &node.counting_pod(
            "full",
            "    - name: scratch\n      emptyDir: {}\n",
            "        - name: scratch\n          mountPath: /scratch\n",
        ),
    );
    let p = wait_pod(&agent, "full", "listed", |_| true).await;
    let uid = uid_of(&p);
    node.uids.push(uid.clone());
    let root = node.root.display().to_string();
    let deadline = Instant::now() + BOUND;
    let said = loop {
        let ev = events(&agent, "full").await;
        if ev.contains("No space left on device") && ev.contains(&root) {
            break ev;
        }
        assert!(
            Instant::now() < deadline,
            "no error naming a path under {root} within {BOUND:?}: {ev}\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "with the disk full: {}",
        said.split_once("\r\n\r\n").map_or("", |(_, b)| b)
    );
    assert!(!app_running(&pod(&agent, "full").await.unwrap()));
    assert_eq!(node.starts_of("full"), 0);
    std::fs::remove_file(&filler).unwrap();
    wait_pod(
        &agent,
        "full",
        "app running once space is freed",
        app_running,
    )
    .await;
    agent.kill9();
    let agent = node.start_agent();
    wait_pod(&agent, "full", "app running after the restart", app_running).await;
    let hosts = node.root.join("pods").join(&uid).join("etc-hosts");
    assert_eq!(
        std::fs::read_to_string(&hosts).unwrap(),
        format!(
            "# Kubernetes-managed hosts file (host network).\n{}",
            std::fs::read_to_string("/etc/hosts").unwrap()
        ),
        "{} whole",
        hosts.display()
    );
    runs_once_then_leaves_nothing(&node, &agent, "full", "full.yaml").await;
    drop(agent);
    drop(disk);
}

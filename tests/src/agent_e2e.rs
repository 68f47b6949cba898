//! The whole agent (in process, the code the binary runs) against the containerd
//! harness, with a static manifest directory and, optionally, the fake API server
//! behind `--kubeconfig`: for the end-to-end tests of the kubelet behaviours that
//! involve both pod sources (mirror pods, deletion, terminal phases, restarts).
//!
//! Privileged (the kernel PLEG runs): callers check [`crate::privileged`] first.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Parser;
use evpleg::agent::Agent;
use evpleg::config::Args;
use evpleg::runtime::labels;
use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use crate::containerd::Containerd;
use crate::fake_apiserver::FakeApiServer;

/// The node the agent runs as (static pods are named `<name>-e2e`).
pub const NODE: &str = "e2e";
/// Bound of every wait.
pub const DEADLINE: Duration = Duration::from_secs(60);
/// The image every pod runs.
pub const IMAGE: &str = "localhost/busybox:latest";

/// containerd, maybe the fake API server, and the agent.
#[derive(Debug)]
pub struct AgentE2e {
    pub args: Args,
    agent: Option<Agent>,
    containerd: Option<Containerd>,
    pub api: Option<FakeApiServer>,
    pub manifests: PathBuf,
    uids: Mutex<HashSet<String>>,
}

/// A static pod manifest: host network, busybox running `command`.
pub fn manifest(name: &str, policy: &str, command: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  hostNetwork: true\n  restartPolicy: {policy}\n  terminationGracePeriodSeconds: 3\n  containers:\n    - name: app\n      image: {IMAGE}\n      command: [\"sh\", \"-c\", \"{command}\"]\n"
    )
}

/// An API pod bound to [`NODE`]: host network, busybox running `command`.
pub fn api_pod(name: &str, policy: &str, command: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "hostNetwork": true,
            "restartPolicy": policy,
            "terminationGracePeriodSeconds": 3,
            "containers": [{"name": "app", "image": IMAGE, "command": ["sh", "-c", command]}],
        },
    }))
    .expect("a valid pod")
}

/// A kubeconfig for the fake API server (plain HTTP, no credentials).
fn kubeconfig(api: &FakeApiServer) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\nusers:\n- name: agent\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: agent\ncurrent-context: fake\n",
        api.url()
    )
}

impl AgentE2e {
    /// Starts containerd, with `with_api` the fake API server (and this node's
    /// Node object), and the agent on both.
    pub async fn start(name: &str, with_api: bool) -> Self {
        crate::containerd::init_test_logging();
        let containerd = Containerd::start().unwrap_or_else(|e| panic!("containerd: {e}"));
        let manifests = containerd.base().join(format!("manifests-{name}"));
        std::fs::create_dir_all(&manifests).expect("manifest dir");
        let logs = containerd.base().join("pod-logs");
        let mut flags: Vec<String> = [
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
        ]
        .map(String::from)
        .to_vec();
        let api = if with_api {
            let api = FakeApiServer::start().await;
            api.add_node(NODE);
            let path = containerd.base().join("kubeconfig");
            std::fs::write(&path, kubeconfig(&api)).expect("write kubeconfig");
            flags.push("--kubeconfig".into());
            flags.push(path.display().to_string());
            Some(api)
        } else {
            None
        };
        let args = Args::try_parse_from(flags).expect("args");
        let agent = Agent::start(&args)
            .await
            .unwrap_or_else(|e| panic!("agent: {e}"));
        Self {
            args,
            agent: Some(agent),
            containerd: Some(containerd),
            api,
            manifests,
            uids: Mutex::new(HashSet::new()),
        }
    }

    pub fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("running")
    }

    pub fn api(&self) -> &FakeApiServer {
        self.api.as_ref().expect("started with the fake API server")
    }

    pub fn cri(&self) -> &Containerd {
        self.containerd.as_ref().expect("running")
    }

    /// Stops the agent (containers keep running) and starts a new one with the
    /// same flags.
    pub async fn restart_agent(&mut self) {
        if let Some(a) = self.agent.take() {
            a.stop().await;
        }
        let agent = Agent::start(&self.args)
            .await
            .unwrap_or_else(|e| panic!("agent restart: {e}"));
        self.agent = Some(agent);
    }

    /// Remembers a pod UID, for the cleanup of its cgroups.
    pub fn track(&self, uid: &str) {
        self.uids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uid.to_owned());
    }

    /// Writes a manifest (written elsewhere and renamed in: never half a file).
    pub fn write(&self, file: &str, yaml: &str) {
        let tmp = self.manifests.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, yaml).expect("write manifest");
        std::fs::rename(&tmp, self.manifests.join(file)).expect("rename manifest");
    }

    pub fn remove(&self, file: &str) {
        std::fs::remove_file(self.manifests.join(file)).expect("remove manifest");
    }

    /// A static pod as the local `/pods` has it.
    pub fn local_pod(&self, name: &str) -> Option<Value> {
        let list = self.agent().local.pod_list();
        let pod = list["items"]
            .as_array()?
            .iter()
            .find(|p| p["metadata"]["name"] == format!("{name}-{NODE}"))
            .cloned()?;
        if let Some(uid) = pod["metadata"]["uid"].as_str() {
            self.track(uid);
        }
        Some(pod)
    }

    /// Waits (polling every 20 ms, bounded) until the local pod satisfies `check`.
    pub async fn wait_local(
        &self,
        name: &str,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(p) = self.local_pod(name)
                && check(&p)
            {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "pod {name}: {what} not seen within {DEADLINE:?}; last: {:#}",
                self.local_pod(name).unwrap_or(Value::Null)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the local `/pods` no longer has the pod.
    pub async fn wait_local_gone(&self, name: &str) {
        let deadline = Instant::now() + DEADLINE;
        while self.local_pod(name).is_some() {
            assert!(
                Instant::now() < deadline,
                "pod {name} still in /pods after {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the fake API server's pod `default/name` satisfies `check`;
    /// returns it.
    pub async fn wait_api(&self, name: &str, what: &str, check: impl Fn(&Pod) -> bool) -> Pod {
        self.api()
            .wait_for_pods(&format!("{name}: {what}"), DEADLINE, |pods| {
                pods.iter()
                    .any(|p| p.metadata.name.as_deref() == Some(name) && check(p))
            })
            .await;
        let pod = self.api().pod("default", name).expect("the pod");
        if let Some(uid) = &pod.metadata.uid {
            self.track(uid);
        }
        pod
    }

    /// Waits (bounded) until `done` holds, polling every 20 ms.
    pub async fn wait_until(&self, what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + DEADLINE;
        while !done() {
            assert!(Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The sandboxes of the pod with this UID, as the runtime lists them now.
    pub async fn sandboxes(&self, uid: &str) -> Vec<v1::PodSandbox> {
        self.cri()
            .client()
            .await
            .list_pod_sandboxes(Some(v1::PodSandboxFilter {
                label_selector: [(labels::POD_UID.to_owned(), uid.to_owned())].into(),
                ..Default::default()
            }))
            .await
            .expect("ListPodSandbox")
    }

    /// How many times containerd was asked to run a sandbox for this pod UID
    /// (its log records every `RunPodSandbox`, also of sandboxes removed since).
    pub fn run_pod_sandbox_calls(&self, uid: &str) -> usize {
        std::fs::read_to_string(self.cri().log_path())
            .unwrap_or_default()
            .lines()
            // One line when the call starts, one when it returns an id or fails.
            .filter(|l| l.contains("RunPodSandbox for") && l.contains(uid))
            .filter(|l| l.contains("returns sandbox id") || l.contains("failed"))
            .count()
    }

    /// Stops the agent.
    pub async fn finish(mut self) {
        if let Some(a) = self.agent.take() {
            a.stop().await;
        }
    }
}

impl Drop for AgentE2e {
    fn drop(&mut self) {
        // Pods, containerd and its files go first, then the pod cgroups the agent
        // made (RemovePodSandbox leaves them; the agent's removal may not have run).
        drop(self.agent.take());
        drop(self.containerd.take());
        let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
        roots.extend(
            std::fs::read_dir("/sys/fs/cgroup")
                .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
                .unwrap_or_default(),
        );
        for uid in self.uids.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            for root in &roots {
                for qos in ["kubepods", "kubepods/burstable", "kubepods/besteffort"] {
                    let _ = std::fs::remove_dir(root.join(qos).join(format!("pod{uid}")));
                }
            }
        }
        for root in &roots {
            for qos in ["kubepods/burstable", "kubepods/besteffort", "kubepods"] {
                let _ = std::fs::remove_dir(Path::new(root).join(qos));
            }
        }
    }
}

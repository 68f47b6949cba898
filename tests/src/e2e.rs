//! The whole agent end to end (in process, the code the binary runs) with the
//! kernel PLEG, against the real containerd harness: pods from a static
//! manifest directory and, optionally, an API server behind `--kubeconfig`:
//! the real one ([`E2e::start_with_control_plane`], the agent as
//! `system:node:e2e`) or the fake (for a fault the real one cannot give);
//! statuses read from the local `/pods` store or the API server. Shared by the end-to-end test files; one test at a time per binary
//! ([`SERIAL`]). Privileged: callers check [`crate::privileged`] first.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use evpleg::agent::Agent;
use evpleg::config::RunArgs;
use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;
use tokio::sync::broadcast;

use crate::cni::CniSetup;
use crate::containerd::{Containerd, LOCAL_TAG, registry_busybox_archive};
use crate::control_plane::ControlPlane;
use crate::fake_apiserver::FakeApiServer;
use crate::registry::Registry;

pub const NODE: &str = "e2e";
pub const DEADLINE: Duration = Duration::from_secs(60);

pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub struct E2e {
    pub args: RunArgs,
    pub agent: Option<Agent>,
    pub containerd: Option<Containerd>,
    pub api: Option<FakeApiServer>,
    /// The real API server, when started with [`E2e::start_with_control_plane`].
    pub control_plane: Option<Arc<ControlPlane>>,
    /// The private image registry, when started with [`E2e::start_with_registry`].
    pub registry: Option<Registry>,
    /// The `evpleg cri-proxy` in front of containerd, when started with
    /// [`E2e::start_via_proxy`].
    pub proxy: Option<evpleg::cri_proxy::CriProxy>,
    pub manifests: PathBuf,
    pub uids: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for E2e {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2e")
            .field("manifests", &self.manifests)
            .finish_non_exhaustive()
    }
}

impl E2e {
    pub async fn start(name: &str) -> Self {
        Self::start_with(name, false, &[]).await
    }

    /// [`E2e::start`], with `with_api` the fake API server (and this node's Node
    /// object) behind `--kubeconfig` too, and more agent flags.
    pub async fn start_with(name: &str, with_api: bool, extra: &[&str]) -> Self {
        let containerd = Self::containerd();
        let api = if with_api {
            ApiKind::Fake
        } else {
            ApiKind::None
        };
        Self::start_on(containerd, None, name, api, extra).await
    }

    /// [`E2e::start`] with the real API server ([`ControlPlane::shared`])
    /// behind `--kubeconfig`, the agent as `system:node:`[`NODE`], and more
    /// agent flags. The namespace `default` has its ServiceAccount
    /// ([`ControlPlane::ensure_namespace`]). Callers check
    /// [`crate::control_plane::available`] first.
    pub async fn start_with_control_plane(name: &str, extra: &[&str]) -> Self {
        let containerd = Self::containerd();
        Self::start_on(containerd, None, name, ApiKind::Real, extra).await
    }

    /// [`E2e::start`] with a private image registry ([`Registry`]) that
    /// containerd pulls from over plain http, holding busybox with one more
    /// layer ([`registry_busybox_archive`]: the file
    /// [`crate::containerd::REGISTRY_MARKER`]) as
    /// [`REGISTRY_REPO`]`:`[`REGISTRY_TAGS`] (each tag pushed; none of them,
    /// nor that layer, is in containerd until pulled).
    pub async fn start_with_registry(name: &str, extra: &[&str]) -> Self {
        let containerd = Self::containerd();
        let registry = Self::registry_for(&containerd, None);
        Self::start_on(containerd, Some(registry), name, ApiKind::None, extra).await
    }

    /// [`E2e::start_with_registry`] with the registry's basic authentication
    /// on ([`crate::registry::TEST_USER`]) and the real API server
    /// ([`E2e::start_with_control_plane`]): images pull only with the
    /// credentials a pod's pull secrets give.
    pub async fn start_with_private_registry(name: &str, extra: &[&str]) -> Self {
        let containerd = Self::containerd();
        let auth = crate::registry::TEST_USER;
        let registry = Self::registry_for(&containerd, Some(auth));
        Self::start_on(containerd, Some(registry), name, ApiKind::Real, extra).await
    }

    /// A registry for `containerd` (with `auth` on), holding the images of
    /// [`E2e::start_with_registry`].
    fn registry_for(containerd: &Containerd, auth: Option<crate::registry::BasicAuth>) -> Registry {
        let dir = containerd.base().join("registry");
        let registry = match auth {
            Some(a) => Registry::start_with_auth(&dir, a),
            None => Registry::start(&dir),
        }
        .unwrap_or_else(|e| panic!("registry: {e}"));
        registry
            .configure_containerd(&containerd.registry_config_dir())
            .unwrap_or_else(|e| panic!("registry: {e}"));
        let archive = registry_busybox_archive().unwrap_or_else(|e| panic!("image: {e}"));
        for tag in REGISTRY_TAGS {
            registry
                .push(&archive, LOCAL_TAG, REGISTRY_REPO, tag)
                .unwrap_or_else(|e| panic!("registry: {e}"));
        }
        registry
    }

    /// [`E2e::start_with`] on a containerd whose CNI configuration is `cni`.
    pub async fn start_with_cni(name: &str, cni: &CniSetup, extra: &[&str]) -> Self {
        crate::containerd::init_test_logging();
        let containerd =
            Containerd::start_with_cni(cni).unwrap_or_else(|e| panic!("containerd: {e}"));
        Self::start_on(containerd, None, name, ApiKind::None, extra).await
    }

    /// [`E2e::start_with`] on `containerd`, started by the caller, with the
    /// agent's CRI endpoint `endpoint` (a proxy in front of it).
    pub async fn start_via(
        containerd: Containerd,
        endpoint: &str,
        name: &str,
        extra: &[&str],
    ) -> Self {
        let mut flags = extra.to_vec();
        flags.extend(["--cri-endpoint", endpoint]);
        Self::start_on(containerd, None, name, ApiKind::None, &flags).await
    }

    /// Dogfood (issue #15): the agent in `evented-cri` mode, as a stock
    /// kubelet with the EventedPLEG gate, its CRI endpoint an
    /// `evpleg cri-proxy` in front of the harness's containerd (1.6, which has
    /// no event stream of its own: every event is the proxy's) and its
    /// periodic relist 5 min away, as the kubelet's Evented PLEG keeps it, so
    /// that everything the agent learns in a test comes through the proxy's
    /// GetContainerEvents (and its overlay). A 20 s relist stood here as a
    /// stop-gap after `via_proxy_never_fails_with_the_exit_code` missed a
    /// death once under load: a container that exited before containerd had
    /// finished StartContainer was CREATED in containerd's answers, and the
    /// proxy took that for the runtime catching up (docs/cri-proxy.md,
    /// "Deaths during a start"; `cri_proxy::a_death_before_the_runtime_finished_the_start_is_shown_exited`).
    pub async fn start_via_proxy(name: &str, extra: &[&str]) -> Self {
        let containerd = Self::containerd();
        let (proxy, _) = crate::cri_proxy::proxy(&containerd, &[]).await;
        let endpoint = format!("unix://{}", containerd.base().join("proxy.sock").display());
        let mut flags = vec!["--pleg", "evented-cri", "--relist-period", "5m"];
        flags.extend(extra);
        let mut e = Self::start_via(containerd, &endpoint, name, &flags).await;
        e.proxy = Some(proxy);
        e
    }

    /// With [`E2e::start_via_proxy`]: the agent's event stream was the
    /// proxy's, and the proxy served the agent's containers' STARTED events.
    pub async fn assert_served_through_proxy(&self) {
        let Some(proxy) = &self.proxy else {
            return;
        };
        use crate::cri_proxy::metric;
        let agent = http_get(self.agent().addr, "/metrics").await;
        assert!(
            metric(&agent, "evpleg_evented_pleg_connection_success_count_total") >= 1.0,
            "the agent subscribed to the proxy: {agent}"
        );
        let served = http_get(proxy.http_addr, "/metrics").await;
        assert!(
            metric(
                &served,
                "evpleg_cri_proxy_events_total{type=\"CONTAINER_STARTED_EVENT\"}"
            ) >= 1.0,
            "the proxy served STARTED events: {served}"
        );
    }

    /// A containerd for [`E2e::start_via`].
    pub fn containerd() -> Containerd {
        crate::containerd::init_test_logging();
        Containerd::start().unwrap_or_else(|e| panic!("containerd: {e}"))
    }

    async fn start_on(
        containerd: Containerd,
        registry: Option<Registry>,
        name: &str,
        api: ApiKind,
        extra: &[&str],
    ) -> Self {
        let manifests = containerd.base().join(format!("manifests-{name}"));
        std::fs::create_dir_all(&manifests).expect("manifest dir");
        let logs = containerd.base().join("pod-logs");
        let root = containerd.base().join("agent-root");
        let endpoint = containerd.endpoint();
        // The harness's containerd, unless the caller names another endpoint.
        let own_endpoint =
            (!extra.contains(&"--cri-endpoint")).then_some(["--cri-endpoint", endpoint.as_str()]);
        // A deleted pod's containers and sandbox stay until the container
        // GC (every minute by default, as the kubelet's): every second here,
        // so that a test sees them go, unless the caller sets the period.
        let gc_period =
            (!extra.contains(&"--container-gc-period")).then_some(["--container-gc-period", "1s"]);
        let base = [
            "evpleg",
            "--manifest-dir",
            manifests.to_str().expect("utf-8"),
            "--node-name",
            NODE,
            "--listen",
            "127.0.0.1:0",
            // The kubelet server (with a kubeconfig) on a free loopback port.
            "--port",
            "0",
            "--address",
            "127.0.0.1",
            "--pod-log-dir",
            logs.to_str().expect("utf-8"),
            "--root-dir",
            root.to_str().expect("utf-8"),
            "--crashloop-backoff-initial",
            "200ms",
            "--crashloop-backoff-max",
            "1s",
            // Longer than the workers' first error back-off (0.5 s), so that a
            // retry meets ImagePullBackOff, as with the kubelet's 10 s.
            "--image-pull-backoff-initial",
            "2s",
            "--image-pull-backoff-max",
            "4s",
        ];
        let mut flags: Vec<String> = base
            .iter()
            .chain(own_endpoint.iter().flatten())
            .chain(gc_period.iter().flatten())
            .chain(extra)
            .map(|s| s.to_string())
            .collect();
        let (api, control_plane) = match api {
            ApiKind::None => (None, None),
            ApiKind::Fake => {
                let api = FakeApiServer::start().await;
                api.add_node(NODE);
                let path = containerd.base().join("kubeconfig");
                std::fs::write(&path, kubeconfig(&api)).expect("write kubeconfig");
                flags.push("--kubeconfig".into());
                flags.push(path.display().to_string());
                (Some(api), None)
            }
            ApiKind::Real => {
                let cp = ControlPlane::shared().await;
                cp.ensure_namespace("default").await;
                flags.push("--kubeconfig".into());
                flags.push(cp.node_kubeconfig(NODE).display().to_string());
                (None, Some(cp))
            }
        };
        let args = RunArgs::try_parse_from(flags).expect("args");
        let agent = Agent::start(&args)
            .await
            .unwrap_or_else(|e| panic!("agent: {e}"));
        Self {
            args,
            agent: Some(agent),
            containerd: Some(containerd),
            api,
            control_plane,
            registry,
            proxy: None,
            manifests,
            uids: Mutex::new(HashSet::new()),
        }
    }

    pub fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("running")
    }

    /// Stops the agent (its containers keep running) and starts a new one with
    /// the same flags, as after a crash or an upgrade.
    pub async fn restart_agent(&mut self) {
        self.stop_agent().await;
        self.start_agent().await;
    }

    /// Stops the agent; its containers keep running ([`Self::start_agent`]
    /// starts a new one).
    pub async fn stop_agent(&mut self) {
        if let Some(a) = self.agent.take() {
            a.stop().await;
        }
    }

    /// Starts an agent with the same flags after [`Self::stop_agent`].
    pub async fn start_agent(&mut self) {
        let agent = Agent::start(&self.args)
            .await
            .unwrap_or_else(|e| panic!("agent restart: {e}"));
        self.agent = Some(agent);
    }

    /// containerd's own log: it records every failed CRI call.
    pub fn runtime_log(&self) -> String {
        std::fs::read_to_string(self.cri().log_path()).unwrap_or_default()
    }

    pub fn write(&self, file: &str, yaml: &str) {
        // Written elsewhere and renamed in: the source never sees half a file.
        let tmp = self.manifests.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, yaml).expect("write manifest");
        std::fs::rename(&tmp, self.manifests.join(file)).expect("rename manifest");
    }

    /// (Unix seconds, text) of the CRI log lines of container `container`
    /// of `pod` (a `/pods` item), its first instance (`0.log`).
    pub fn log_lines(&self, pod: &Value, container: &str) -> Vec<(f64, String)> {
        let meta = &pod["metadata"];
        let dir = self.cri().base().join("pod-logs").join(format!(
            "{}_{}_{}",
            meta["namespace"].as_str().unwrap_or("default"),
            meta["name"].as_str().unwrap_or_default(),
            meta["uid"].as_str().unwrap_or_default()
        ));
        let text = std::fs::read_to_string(dir.join(container).join("0.log")).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let mut parts = l.splitn(4, ' ');
                let ts: k8s_openapi::jiff::Timestamp = parts.next()?.parse().ok()?;
                let text = parts.nth(2)?.to_owned();
                Some((ts.as_nanosecond() as f64 / 1e9, text))
            })
            .collect()
    }

    pub fn pod(&self, name: &str) -> Option<Value> {
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

    /// Remembers a pod UID, for the cleanup of its cgroups.
    pub fn track(&self, uid: &str) {
        self.uids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uid.to_owned());
    }

    pub fn api(&self) -> &FakeApiServer {
        self.api.as_ref().expect("started with the fake API server")
    }

    /// The real control plane of [`E2e::start_with_control_plane`].
    pub fn cp(&self) -> &ControlPlane {
        self.control_plane
            .as_deref()
            .expect("started with the real API server")
    }

    /// A client of the real API server as its admin.
    pub async fn kube(&self) -> kube::Client {
        self.cp().admin().await
    }

    /// Creates `pod` in the real API server (as the admin); returns it as
    /// stored, and remembers its UID for the cleanup.
    pub async fn create_pod(&self, pod: &Pod) -> Pod {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        let pods: kube::Api<Pod> = kube::Api::namespaced(self.kube().await, namespace);
        let created = pods
            .create(&kube::api::PostParams::default(), pod)
            .await
            .unwrap_or_else(|e| panic!("create pod {:?}: {e}", pod.metadata.name));
        if let Some(uid) = &created.metadata.uid {
            self.track(uid);
        }
        created
    }

    pub fn remove(&self, file: &str) {
        std::fs::remove_file(self.manifests.join(file)).expect("remove manifest");
    }

    /// Waits until the API server's pod `default/name` satisfies `check`;
    /// returns it.
    pub async fn wait_api(&self, name: &str, what: &str, check: impl Fn(&Pod) -> bool) -> Pod {
        if self.control_plane.is_some() {
            let pod = self
                .wait_real("default", name, what, |p| p.is_some_and(&check))
                .await
                .expect("the pod");
            if let Some(uid) = &pod.metadata.uid {
                self.track(uid);
            }
            return pod;
        }
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

    /// Waits until the real API server's pod `namespace/name` (`None`: there
    /// is none) satisfies `check`; returns it.
    pub async fn wait_real(
        &self,
        namespace: &str,
        name: &str,
        what: &str,
        check: impl Fn(Option<&Pod>) -> bool,
    ) -> Option<Pod> {
        let pods: kube::Api<Pod> = kube::Api::namespaced(self.kube().await, namespace);
        wait_object(&pods, name, what, check).await
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
        self.cri().pod_sandboxes(uid).await
    }

    /// Waits (bounded by `bound`, polling every 50 ms) until the runtime
    /// holds nothing of pod `uid`, neither sandbox nor container: a deleted
    /// pod's content goes at the container GC's next period.
    pub async fn wait_runtime_clean(&self, uid: &str, bound: Duration) {
        let deadline = Instant::now() + bound;
        loop {
            let sandboxes = self.sandboxes(uid).await;
            let containers = self.cri().pod_containers(uid).await;
            if sandboxes.is_empty() && containers.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pod {uid}: not collected within {bound:?}: sandboxes {:?}, containers {:?}",
                sandboxes.iter().map(|s| &s.id).collect::<Vec<_>>(),
                containers.iter().map(|c| &c.id).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// How many times containerd was asked to run a sandbox for this pod UID
    /// (its log records every `RunPodSandbox`, also of sandboxes removed since).
    pub fn run_pod_sandbox_calls(&self, uid: &str) -> usize {
        self.runtime_log()
            .lines()
            // One line when the call starts, one when it returns an id or fails.
            .filter(|l| l.contains("RunPodSandbox for") && l.contains(uid))
            .filter(|l| l.contains("returns sandbox id") || l.contains("failed"))
            .count()
    }

    /// Waits (polling the store every 20 ms, bounded by [`DEADLINE`]) until
    /// `check` holds.
    pub async fn wait_for(&self, name: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        self.wait_for_within(name, what, DEADLINE, check).await
    }

    /// [`Self::wait_for`] bounded by `bound`.
    pub async fn wait_for_within(
        &self,
        name: &str,
        what: &str,
        bound: Duration,
        check: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(p) = self.pod(name)
                && check(&p)
            {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "pod {name}: {what} not seen within {bound:?}; last: {:#}",
                self.pod(name).unwrap_or(Value::Null)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn wait_gone(&self, name: &str) {
        let deadline = Instant::now() + DEADLINE;
        while self.pod(name).is_some() {
            assert!(
                Instant::now() < deadline,
                "pod {name} still in /pods after {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn cri(&self) -> &Containerd {
        self.containerd.as_ref().expect("running")
    }

    pub fn registry(&self) -> &Registry {
        self.registry
            .as_ref()
            .expect("started with E2e::start_with_registry")
    }

    pub async fn finish(mut self) {
        if let Some(a) = self.agent.take() {
            a.stop().await;
        }
        if let Some(p) = self.proxy.take() {
            p.stop().await;
        }
    }
}

impl Drop for E2e {
    fn drop(&mut self) {
        // Pods, containerd and its files go first, then the pod cgroups the agent
        // made (RemovePodSandbox leaves them; the agent's removal may not have run).
        drop(self.agent.take());
        drop(self.control_plane.take());
        drop(self.proxy.take());
        drop(self.registry.take());
        drop(self.containerd.take());
        let uids: Vec<String> = self
            .uids
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        remove_pod_cgroups(&uids);
    }
}

/// Removes the pod cgroups (`/kubepods/<qos>/pod<uid>`, every hierarchy) of
/// these pods and everything below them (RemovePodSandbox leaves them),
/// killing what is still in them: after a failed test, the containers of a
/// shim the runtime's teardown had to kill. Then the QoS levels runc created
/// for them, when nothing else uses them now.
pub fn remove_pod_cgroups(uids: &[String]) {
    let mounts = crate::containerd::cgroup_mounts();
    for uid in uids {
        for qos in ["kubepods", "kubepods/burstable", "kubepods/besteffort"] {
            crate::containerd::remove_cgroup_tree(&mounts, &format!("{qos}/pod{uid}"));
        }
    }
    for mount in &mounts {
        for qos in ["kubepods/burstable", "kubepods/besteffort", "kubepods"] {
            let _ = std::fs::remove_dir(mount.join(qos));
        }
    }
}

/// Waits (bounded by [`DEADLINE`], polling every 50 ms) until the object
/// `name` of `api` (`None`: there is none) satisfies `check`; returns it.
pub async fn wait_object<K>(
    api: &kube::Api<K>,
    name: &str,
    what: &str,
    check: impl Fn(Option<&K>) -> bool,
) -> Option<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        let object = api
            .get_opt(name)
            .await
            .unwrap_or_else(|e| panic!("get {name}: {e}"));
        if check(object.as_ref()) {
            return object;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: {what} not seen within {DEADLINE:?}; last: {:#}",
            serde_json::to_value(&object).unwrap_or(Value::Null)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded by [`DEADLINE`], polling every 50 ms) until the objects of
/// `api` satisfy `check`; returns them.
pub async fn wait_list<K>(api: &kube::Api<K>, what: &str, check: impl Fn(&[K]) -> bool) -> Vec<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        let items = api
            .list(&kube::api::ListParams::default())
            .await
            .unwrap_or_else(|e| panic!("list for {what}: {e}"))
            .items;
        if check(&items) {
            return items;
        }
        assert!(
            Instant::now() < deadline,
            "{what} not seen within {DEADLINE:?}; last: {:#}",
            serde_json::to_value(&items).unwrap_or(Value::Null)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Which API server an [`E2e`] starts behind `--kubeconfig`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ApiKind {
    None,
    Fake,
    Real,
}

/// Statuses written for one pod, in order, as JSON.
#[derive(Debug)]
pub struct History {
    rx: broadcast::Receiver<k8s_openapi::api::core::v1::Pod>,
    name: String,
    pub seen: Vec<Value>,
}

impl History {
    pub fn new(e: &E2e, name: &str) -> Self {
        Self {
            rx: e.agent().local.subscribe(),
            name: format!("{name}-{NODE}"),
            seen: Vec::new(),
        }
    }

    /// Takes the statuses already written, without waiting.
    pub fn drain(&mut self) {
        while let Ok(pod) = self.rx.try_recv() {
            if pod.metadata.name.as_deref() == Some(self.name.as_str()) {
                self.seen
                    .push(serde_json::to_value(&pod).expect("pod as json"));
            }
        }
    }

    /// Waits until a written status satisfies `check`; returns it.
    pub async fn until(&mut self, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        if let Some(v) = self.seen.iter().find(|v| check(v)) {
            return v.clone();
        }
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Ok(pod)) if pod.metadata.name.as_deref() == Some(self.name.as_str()) => {
                    let v = serde_json::to_value(&pod).expect("pod as json");
                    self.seen.push(v.clone());
                    if check(&v) {
                        return v;
                    }
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("{}: the status subscription failed: {e}", self.name),
                Err(_) => panic!(
                    "{}: {what} never written within {DEADLINE:?}; written: {:#?}",
                    self.name,
                    self.seen.iter().map(|v| &v["status"]).collect::<Vec<_>>()
                ),
            }
        }
    }
}

/// When `text` was logged first, in [`E2e::log_lines`]' `lines`.
pub fn logged_at(lines: &[(f64, String)], text: &str) -> Option<f64> {
    lines.iter().find(|(_, t)| t == text).map(|(ts, _)| *ts)
}

pub fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
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

/// The image every pod runs.
pub const IMAGE: &str = crate::containerd::BUSYBOX_IMAGE;

/// The repository of the busybox image in the registry of
/// [`E2e::start_with_registry`].
pub const REGISTRY_REPO: &str = "evpleg/busybox";
/// Its tags there.
pub const REGISTRY_TAGS: [&str; 2] = ["v1", "latest"];

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

/// A static pod manifest: host network, busybox running `command`, `extra`
/// spec lines (two-space indented) before the containers.
pub fn manifest(name: &str, policy: &str, command: &str, extra: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  hostNetwork: true\n  restartPolicy: {policy}\n  terminationGracePeriodSeconds: 3\n{extra}  containers:\n    - name: app\n      image: {IMAGE}\n      command: [\"sh\", \"-c\", \"{command}\"]\n"
    )
}

pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
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
pub fn find_container_pid(id: &str) -> Option<i32> {
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

pub async fn list_sandboxes(containerd: &Containerd) -> Vec<String> {
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

/// An end-to-end test: skipped (with its reason) when not privileged, else run
/// alone with a fresh containerd and agent, finished (agent stopped) after.
/// `e2e_test!(name, registry, body)` starts the private image registry too
/// ([`E2e::start_with_registry`]).
#[macro_export]
macro_rules! e2e_test {
    // The test, and the same body once more as `$proxied` with the agent in
    // `evented-cri` mode behind an `evpleg cri-proxy` ([`E2e::start_via_proxy`]).
    ($name:ident, also_via_proxy $proxied:ident, $body:expr) => {
        $crate::e2e_test!($name, $body);

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $proxied() {
            if !$crate::privileged(stringify!($proxied)) {
                return;
            }
            let _serial = $crate::e2e::SERIAL.lock().await;
            let e = $crate::e2e::E2e::start_via_proxy(stringify!($proxied), &[]).await;
            let f: fn(
                &$crate::e2e::E2e,
            ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + '_>> = $body;
            f(&e).await;
            e.assert_served_through_proxy().await;
            e.finish().await;
        }
    };
    ($name:ident, registry, $body:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if !$crate::privileged(stringify!($name)) {
                return;
            }
            let _serial = $crate::e2e::SERIAL.lock().await;
            let e = $crate::e2e::E2e::start_with_registry(stringify!($name), &[]).await;
            let f: fn(
                &$crate::e2e::E2e,
            ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + '_>> = $body;
            f(&e).await;
            e.finish().await;
        }
    };
    ($name:ident, $body:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if !$crate::privileged(stringify!($name)) {
                return;
            }
            let _serial = $crate::e2e::SERIAL.lock().await;
            let e = $crate::e2e::E2e::start(stringify!($name)).await;
            let f: fn(
                &$crate::e2e::E2e,
            ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + '_>> = $body;
            f(&e).await;
            e.finish().await;
        }
    };
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    /// A failed test's leftover: a process in a container cgroup below its
    /// pod cgroup. The teardown kills it and removes both cgroups (before, the
    /// pod cgroup stayed, and the process ran on).
    #[test]
    fn a_pod_cgroup_with_a_process_left_in_it_is_emptied_and_removed() {
        use std::os::unix::process::ExitStatusExt;
        let test = "a_pod_cgroup_with_a_process_left_in_it_is_emptied_and_removed";
        if !crate::runtime_available(test) {
            return;
        }
        let v2 = evpleg_pleg::kernel::index::cgroup2_mount()
            .unwrap()
            .expect("a cgroup2 hierarchy");
        let uid = format!("e2e-teardown-{}", std::process::id());
        let container = v2.join(format!("kubepods/besteffort/pod{uid}/c1"));
        std::fs::create_dir_all(&container).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        std::fs::write(container.join("cgroup.procs"), child.id().to_string()).unwrap();

        super::remove_pod_cgroups(std::slice::from_ref(&uid));

        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the leftover process still runs");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(
            !container.parent().unwrap().exists(),
            "the pod cgroup is left"
        );
    }
}

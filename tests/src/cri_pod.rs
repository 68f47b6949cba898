//! Pods, sandboxes and containers made directly over CRI on the containerd
//! harness, labelled as the agent labels them, and the PLEG under test with its
//! event stream: shared by the PLEG tests against the real runtime
//! (`tests/pleg_runtime.rs`, `tests/pleg_contract.rs`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use evpleg_core::clock::MonotonicClock;
use evpleg_core::clock::monotonic_ns;
use evpleg_core::container::ContainerState;
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::labels;
use evpleg_core::lifecycle::{EventKind, PodLifecycleEvent, RelistSignal};
use evpleg_cri::CriClient;
use evpleg_cri::runtime::CriRuntime;
use evpleg_cri_api::v1;
use evpleg_pleg::kernel::{KernelPleg, KernelPlegConfig};
use evpleg_pleg::{Pleg, PlegMode};
use tokio::sync::mpsc;

use crate::containerd::{
    Containerd, container_config, containerd_17_for, init_test_logging, pod_cgroup_parent,
};

/// Bound of every wait for an event or a state.
pub const WAIT: Duration = Duration::from_secs(20);
/// Poll interval of CRI statuses where no event exists.
pub const POLL: Duration = Duration::from_millis(20);
/// Exits measured by the evented-cri test.
pub const SAMPLES: usize = 5;
/// Where a waiting container looks for its exit signal.
pub const SIGNAL_DIR: &str = "/evpleg-signal";

pub fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
}

pub fn start_containerd() -> Containerd {
    init_test_logging();
    Containerd::start().unwrap_or_else(|e| panic!("containerd harness: {e}"))
}

/// Debian's containerd 1.6 whatever `$EVPLEG_TEST_CONTAINERD` says, for the
/// tests of what 1.6 lacks (a `GetContainerEvents` stream).
pub fn start_containerd_16() -> Containerd {
    init_test_logging();
    Containerd::start_debian().unwrap_or_else(|e| panic!("containerd 1.6 harness: {e}"))
}

/// containerd 1.7, or `None` (skipped with the reason printed) when it cannot
/// be fetched outside CI.
pub fn start_containerd_17(test: &str) -> Option<Containerd> {
    init_test_logging();
    let binary = containerd_17_for(test)?;
    Some(Containerd::start_with(&binary).unwrap_or_else(|e| panic!("containerd 1.7 harness: {e}")))
}

pub fn runtime_of(client: &CriClient) -> CriRuntime {
    CriRuntime::new(client.clone())
}

/// A pod of the test: its UID, sandbox config (with the kubelet's labels) and
/// a host directory its waiting containers watch.
#[derive(Debug)]
pub struct TestPod {
    pub name: String,
    pub uid: String,
    pub config: v1::PodSandboxConfig,
    pub signal_dir: PathBuf,
}

impl TestPod {
    pub fn new(containerd: &Containerd, name: &str) -> Self {
        let uid = crate::pod_uid();
        let mut config = containerd.sandbox_config(name, &uid, &pod_cgroup_parent(&uid));
        let meta = config.metadata.clone().expect("the harness sets metadata");
        config.labels.insert(labels::POD_UID.into(), uid.clone());
        config.labels.insert(labels::POD_NAME.into(), meta.name);
        config
            .labels
            .insert(labels::POD_NAMESPACE.into(), meta.namespace);
        let signal_dir = containerd.base().join("signals").join(&uid);
        std::fs::create_dir_all(&signal_dir).expect("signal dir");
        Self {
            name: name.to_owned(),
            uid,
            config,
            signal_dir,
        }
    }

    pub fn pod_uid(&self) -> PodUid {
        PodUid::parse(&self.uid).expect("a valid uid")
    }

    /// A busybox container of this pod running `command`, labelled for CriRuntime.
    pub fn container(&self, name: &str, command: &[&str]) -> v1::ContainerConfig {
        let mut config = container_config(name, command);
        config
            .labels
            .insert(labels::POD_UID.into(), self.uid.clone());
        config
            .labels
            .insert(labels::POD_NAME.into(), self.name.clone());
        config
            .labels
            .insert(labels::CONTAINER_NAME.into(), name.to_owned());
        config
    }

    /// A container that runs until [`Self::release`]`(name)`, then exits with 7.
    pub fn waiting_container(&self, name: &str) -> v1::ContainerConfig {
        self.waiting_container_exiting(name, 7)
    }

    /// A container that runs until [`Self::release`]`(name)`, then exits with `code`.
    pub fn waiting_container_exiting(&self, name: &str, code: u8) -> v1::ContainerConfig {
        let script =
            format!("while [ ! -e {SIGNAL_DIR}/{name} ]; do sleep 0.01; done; exit {code}");
        let mut config = self.container(name, &["sh", "-c", &script]);
        config.mounts.push(self.signal_mount());
        config
    }

    /// A container whose main process is the multi-threaded `evpleg-thread-helper`
    /// (`program`, a host binary, with the host's C library bind-mounted read-only)
    /// in mode `args`; it goes on at [`Self::release`]`(name)` (see
    /// `evpleg_tests::threads`).
    pub fn thread_helper_container(
        &self,
        name: &str,
        program: &str,
        args: &[&str],
    ) -> v1::ContainerConfig {
        const HELPER: &str = "/evpleg-thread-helper";
        let mut command = vec![HELPER];
        command.extend_from_slice(args);
        let mut config = self.container(name, &command);
        config.envs.push(v1::KeyValue {
            key: crate::threads::GO_FILE_ENV.to_owned(),
            value: format!("{SIGNAL_DIR}/{name}"),
        });
        config.mounts.push(self.signal_mount());
        // The helper is linked against the host's glibc (see `ldd`): its loader
        // and libraries, at the paths the binary names.
        for (host, container) in [
            (program, HELPER),
            ("/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"),
            ("/lib64", "/lib64"),
        ] {
            config.mounts.push(v1::Mount {
                container_path: container.to_owned(),
                host_path: host.to_owned(),
                readonly: true,
                ..Default::default()
            });
        }
        config
    }

    fn signal_mount(&self) -> v1::Mount {
        v1::Mount {
            container_path: SIGNAL_DIR.to_owned(),
            host_path: self.signal_dir.display().to_string(),
            readonly: true,
            ..Default::default()
        }
    }

    /// Lets the waiting container `name` exit.
    pub fn release(&self, name: &str) {
        std::fs::write(self.signal_dir.join(name), b"").expect("signal file");
    }
}

/// Runs the pod's sandbox; returns its id.
pub async fn run_sandbox(client: &CriClient, pod: &TestPod) -> String {
    client
        .run_pod_sandbox(&pod.config, "")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Creates and starts a container; returns its id.
pub async fn run_container(
    client: &CriClient,
    pod: &TestPod,
    sandbox: &str,
    config: &v1::ContainerConfig,
) -> String {
    let id = client
        .create_container(sandbox, config, &pod.config)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    client
        .start_container(&id)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    id
}

pub fn exited(s: &v1::ContainerStatus) -> bool {
    s.state() == v1::ContainerState::ContainerExited
}

/// The `pid` of a verbose CRI status's `info` (containerd's JSON).
pub fn verbose_pid(info: &std::collections::HashMap<String, String>) -> Option<u32> {
    let json: serde_json::Value = serde_json::from_str(info.get("info")?).ok()?;
    json.get("pid")?
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
}

pub fn cid(id: &str) -> ContainerId {
    ContainerId::parse(id).unwrap_or_else(|| panic!("{id} is not a 64-hex id"))
}

/// The PLEG's event channel, with every event kept for later counting.
#[derive(Debug)]
pub struct Events {
    rx: mpsc::Receiver<PodLifecycleEvent>,
    pub all: Vec<PodLifecycleEvent>,
    taken: Vec<bool>,
}

impl Events {
    pub fn new(rx: mpsc::Receiver<PodLifecycleEvent>) -> Self {
        Self {
            rx,
            all: Vec::new(),
            taken: Vec::new(),
        }
    }

    pub fn push(&mut self, e: PodLifecycleEvent) {
        self.all.push(e);
        self.taken.push(false);
    }

    /// The first event not returned before with `kind` for container `id`,
    /// waiting at most `timeout`.
    pub async fn wait_for(
        &mut self,
        id: &str,
        kind: EventKind,
        timeout: Duration,
    ) -> PodLifecycleEvent {
        let matches = |e: &PodLifecycleEvent| {
            e.kind == kind && e.container_id.as_ref().is_some_and(|c| c.as_str() == id)
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let mut i = 0;
        loop {
            while i < self.all.len() {
                if !self.taken[i] && matches(&self.all[i]) {
                    self.taken[i] = true;
                    return self.all[i].clone();
                }
                i += 1;
            }
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(e)) => self.push(e),
                Ok(None) => panic!("the pleg's event channel closed"),
                Err(_) => panic!(
                    "no {kind:?} for {id} within {timeout:?}; events so far: {:#?}",
                    self.all
                ),
            }
        }
    }

    pub async fn wait(&mut self, id: &str, kind: EventKind) -> PodLifecycleEvent {
        self.wait_for(id, kind, WAIT).await
    }

    /// Collects what arrives during `period`.
    pub async fn collect(&mut self, period: Duration) {
        let deadline = tokio::time::Instant::now() + period;
        while let Ok(Some(e)) = tokio::time::timeout_at(deadline, self.rx.recv()).await {
            self.push(e);
        }
    }

    /// Takes the events already in the channel, without waiting.
    pub fn drain(&mut self) {
        while let Ok(e) = self.rx.try_recv() {
            self.push(e);
        }
    }

    pub fn count(&self, id: &str, kind: EventKind) -> usize {
        self.all
            .iter()
            .filter(|e| e.kind == kind && e.container_id.as_ref().is_some_and(|c| c.as_str() == id))
            .count()
    }
}

pub fn start_pleg(mode: PlegMode, client: &CriClient, period: Option<Duration>) -> (Pleg, Events) {
    start_pleg_with(mode, client, period, KernelPlegConfig::default())
}

/// [`start_pleg`] with a kernel configuration (a smaller ring buffer, a record tap).
pub fn start_pleg_with(
    mode: PlegMode,
    client: &CriClient,
    period: Option<Duration>,
    kernel: KernelPlegConfig,
) -> (Pleg, Events) {
    let (tx, rx) = mpsc::channel(1000);
    let pleg = Pleg::start(
        mode,
        runtime_of(client),
        kernel,
        tx,
        Arc::new(MonotonicClock),
        period,
    )
    .unwrap_or_else(|e| panic!("starting the {mode:?} pleg: {e}"));
    (pleg, Events::new(rx))
}

/// The cached status of container `id` of `pod`, if any.
pub fn cached(
    pleg: &Pleg,
    pod: &PodUid,
    id: &str,
) -> Option<evpleg_core::container::ContainerStatus> {
    pleg.cache.get(pod)?.status.container(&cid(id)).cloned()
}

/// Waits until the cache holds container `id` satisfying `done`.
pub async fn wait_cached(
    pleg: &Pleg,
    pod: &PodUid,
    id: &str,
    what: &str,
    done: impl Fn(&evpleg_core::container::ContainerStatus) -> bool,
) -> evpleg_core::container::ContainerStatus {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(c) = cached(pleg, pod, id)
            && done(&c)
        {
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "cache never had {id} {what}: {:?}",
            cached(pleg, pod, id)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn assert_exited_7(c: &evpleg_core::container::ContainerStatus) {
    assert_eq!(
        (c.state, c.exit_code),
        (ContainerState::Exited, Some(7)),
        "{c:?}"
    );
}

/// The kubelet's health rule with a threshold these tests can break: twice the
/// relist period (the current one: the fallback may have shortened it) plus 1 s.
pub fn healthy(pleg: &Pleg) {
    let period = Duration::from_nanos(
        pleg.relist_stats
            .period_ns
            .load(std::sync::atomic::Ordering::Relaxed),
    );
    let threshold = period * 2 + Duration::from_secs(1);
    if let Err(e) = pleg.relist_stats.healthy(monotonic_ns(), threshold) {
        panic!("relist pleg unhealthy: {e}");
    }
}

/// A kernel PLEG used only as a stopwatch: the moment (CLOCK_MONOTONIC ns) the
/// kernel saw a container's main process exit, to measure the other PLEGs'
/// latencies from.
#[derive(Debug)]
pub struct ExitClock {
    kernel: Option<KernelPleg>,
    rx: mpsc::Receiver<PodLifecycleEvent>,
    seen: Vec<PodLifecycleEvent>,
}

impl ExitClock {
    pub fn start() -> Self {
        let (tx, rx) = mpsc::channel(1000);
        let kernel = KernelPleg::start(
            KernelPlegConfig::default(),
            tx,
            Arc::new(RelistSignal::new()),
        )
        .unwrap_or_else(|e| panic!("kernel pleg: {e}"));
        Self {
            kernel: Some(kernel),
            rx,
            seen: Vec::new(),
        }
    }

    /// When the kernel saw container `id` die.
    pub async fn exit_ns(&mut self, id: &str) -> u64 {
        let matches = |e: &PodLifecycleEvent| {
            e.kind == EventKind::ContainerDied
                && e.container_id.as_ref().is_some_and(|c| c.as_str() == id)
        };
        if let Some(e) = self.seen.iter().find(|e| matches(e)) {
            return e.at_ns;
        }
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(e)) if matches(&e) => return e.at_ns,
                Ok(Some(e)) => self.seen.push(e),
                _ => panic!("the kernel did not see {id} exit within {WAIT:?}"),
            }
        }
    }
}

impl Drop for ExitClock {
    fn drop(&mut self) {
        if let Some(k) = self.kernel.take() {
            k.stop();
        }
    }
}

pub fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

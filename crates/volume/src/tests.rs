//! The volume manager's glue (populator, reconciler loop, waits, events)
//! with a recording plugin: no root needed.

use std::sync::Mutex;

use async_trait::async_trait;

use super::plugin::{Attributes, PluginError, SetUpArgs, Spec, TearDownArgs, VolumePlugin};
use super::*;

/// Records every call; volumes named `dev*` are device-mountable and
/// shared by name; `bad*` fail their first `failures` set-ups.
#[derive(Debug, Default)]
struct Recording {
    calls: Mutex<Vec<String>>,
    failures: Mutex<u32>,
}

impl Recording {
    fn log(&self, s: String) {
        self.calls.lock().unwrap().push(s);
    }
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

#[async_trait]
impl VolumePlugin for Recording {
    fn name(&self) -> &'static str {
        "test/recording"
    }
    fn can_support(&self, spec: &Spec) -> bool {
        spec.inline().is_some()
    }
    fn unique_name(&self, spec: &Spec, pod: &PodUid) -> Result<UniqueVolumeName, PluginError> {
        Ok(if spec.name.starts_with("dev") {
            UniqueVolumeName::global(self.name(), &spec.name)
        } else {
            UniqueVolumeName::per_pod(self.name(), pod, &spec.name)
        })
    }
    fn device_mountable(&self, spec: &Spec) -> bool {
        spec.name.starts_with("dev")
    }
    fn attributes(&self, _: &Spec) -> Attributes {
        Attributes::default()
    }
    async fn mount_device(&self, spec: &Spec, _: &Path) -> Result<(), PluginError> {
        self.log(format!("mount_device {}", spec.name));
        Ok(())
    }
    async fn unmount_device(&self, spec: &Spec, _: &Path) -> Result<(), PluginError> {
        self.log(format!("unmount_device {}", spec.name));
        Ok(())
    }
    async fn set_up(&self, args: SetUpArgs<'_>) -> Result<(), PluginError> {
        if args.spec.name.starts_with("bad") {
            let mut f = self.failures.lock().unwrap();
            if *f > 0 {
                *f -= 1;
                return Err(PluginError::Failed("injected failure".into()));
            }
        }
        assert_eq!(
            args.device_mount_path.is_some(),
            args.spec.name.starts_with("dev")
        );
        self.log(format!("set_up {} {}", args.spec.name, args.pod.uid));
        Ok(())
    }
    async fn tear_down(&self, args: TearDownArgs<'_>) -> Result<(), PluginError> {
        self.log(format!("tear_down {} {}", args.spec.name, args.pod_uid));
        Ok(())
    }
}

fn pod(uid: &str, volumes: serde_json::Value) -> (Arc<Pod>, PodUid) {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("p{uid}"), "namespace": "ns", "uid": uid},
        "spec": {"containers": [{"name": "c"}], "volumes": volumes}
    }))
    .unwrap();
    (Arc::new(pod), PodUid::parse(uid).unwrap())
}

fn manager(root: &Path, plugin: Arc<Recording>, events: Recorder) -> Arc<VolumeManager> {
    let host = VolumeHost {
        root_dir: root.to_path_buf(),
        node_name: "n".into(),
        kube: None,
    };
    let mut plugins = VolumePluginMgr::default();
    plugins.register(plugin).unwrap();
    Arc::new(VolumeManager::new(host, plugins, events))
}

const BOUND: Duration = Duration::from_secs(10);

#[tokio::test]
async fn volumes_are_mounted_before_the_wait_returns_and_torn_down_in_order() {
    let root = tempfile::tempdir().unwrap();
    let plugin = Arc::new(Recording::default());
    let vm = manager(root.path(), plugin.clone(), Recorder::default());
    let stop = CancellationToken::new();
    tokio::spawn(vm.clone().run(stop.clone()));
    let vols = serde_json::json!([{"name": "a", "emptyDir": {}}, {"name": "dev1", "emptyDir": {}}]);
    let (p1, u1) = pod("a1", vols.clone());
    let (p2, u2) = pod("b2", vols);
    vm.add_pod(&p1, &u1).await;
    vm.wait_for_attach_and_mount(&u1, BOUND).await.unwrap();
    let mounted = vm.pod_volumes(&u1);
    assert_eq!(mounted.keys().collect::<Vec<_>>(), ["a", "dev1"]);
    assert_eq!(
        mounted["a"].host_path,
        root.path().join("pods/a1/volumes/test~recording/a")
    );
    vm.add_pod(&p2, &u2).await;
    vm.wait_for_attach_and_mount(&u2, BOUND).await.unwrap();
    // The device is mounted once, before the first set-up on it.
    let calls = plugin.calls();
    let device = calls.iter().position(|c| c == "mount_device dev1").unwrap();
    let first = calls
        .iter()
        .position(|c| c.starts_with("set_up dev1"))
        .unwrap();
    assert!(device < first, "{calls:?}");
    assert_eq!(
        calls
            .iter()
            .filter(|c| c.starts_with("mount_device"))
            .count(),
        1
    );
    // The first pod leaves: its volumes go, the shared device stays.
    vm.remove_pod(&u1);
    vm.wait_for_unmount(&u1, BOUND).await.unwrap();
    assert!(vm.pod_volumes(&u1).is_empty());
    assert!(
        !plugin
            .calls()
            .iter()
            .any(|c| c.starts_with("unmount_device"))
    );
    // The last one: its tear-down, then the device's unmount.
    vm.remove_pod(&u2);
    vm.wait_for_unmount(&u2, BOUND).await.unwrap();
    let deadline = tokio::time::Instant::now() + BOUND;
    while !plugin.calls().iter().any(|c| c == "unmount_device dev1") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            plugin.calls()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let calls = plugin.calls();
    let last_tear_down = calls.iter().position(|c| c == "tear_down dev1 b2").unwrap();
    let unmount = calls
        .iter()
        .position(|c| c == "unmount_device dev1")
        .unwrap();
    assert!(last_tear_down < unmount, "{calls:?}");
    stop.cancel();
}

#[tokio::test]
async fn a_failed_set_up_is_failed_mount_then_retried() {
    let root = tempfile::tempdir().unwrap();
    let plugin = Arc::new(Recording::default());
    *plugin.failures.lock().unwrap() = 1;
    let events = Recorder::default();
    let vm = manager(root.path(), plugin.clone(), events.clone());
    let stop = CancellationToken::new();
    tokio::spawn(vm.clone().run(stop.clone()));
    let (p, u) = pod("c3", serde_json::json!([{"name": "bad", "emptyDir": {}}]));
    vm.add_pod(&p, &u).await;
    let err = vm
        .wait_for_attach_and_mount(&u, Duration::from_millis(200))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "unmounted volumes=[bad], unattached volumes=[], failed to process volumes=[]: timed out waiting for the condition"
    );
    let list = events.event_list("ns", "pc3");
    let messages: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["reason"] == "FailedMount")
        .filter_map(|e| e["message"].as_str())
        .collect();
    assert_eq!(
        messages,
        ["MountVolume.SetUp failed for volume \"bad\" : injected failure"]
    );
    assert_eq!(
        vm.errors(&u)["bad"],
        "MountVolume.SetUp failed for volume \"bad\" : injected failure"
    );
    // The reconciler's back-off (500 ms) passes; the retry mounts it.
    vm.wait_for_attach_and_mount(&u, BOUND).await.unwrap();
    assert!(vm.errors(&u).is_empty());
    stop.cancel();
}

#[tokio::test]
async fn a_claim_without_an_api_server_fails_at_once_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let vm = manager(root.path(), Arc::default(), Recorder::default());
    let stop = CancellationToken::new();
    tokio::spawn(vm.clone().run(stop.clone()));
    let (p, u) = pod(
        "d4",
        serde_json::json!([{"name": "data", "persistentVolumeClaim": {"claimName": "claim"}}]),
    );
    vm.add_pod(&p, &u).await;
    let started = tokio::time::Instant::now();
    let err = vm.wait_for_attach_and_mount(&u, BOUND).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(1), "no wait");
    assert_eq!(
        err.to_string(),
        "unmounted volumes=[data], unattached volumes=[], failed to process volumes=[data]: error processing PVC ns/claim: no API server to read it from (the agent runs without --kubeconfig)"
    );
    stop.cancel();
}

/// Whether a test may mount (root): without it the test says so and returns
/// (a failure under `CI=true`).
pub(crate) fn can_mount(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    let why = format!("{test}: needs root (mounts)");
    assert!(
        std::env::var("CI").map_or(true, |v| v != "true"),
        "{why}; CI=true, so this is a failure"
    );
    eprintln!("SKIPPED {why}");
    false
}

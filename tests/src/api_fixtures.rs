//! What the API path tests share, against the real API server
//! (`tests/api_server.rs`) and the fake (`tests/api_server_faults.rs`): the
//! pod source's updates read with a bound, and the pod statuses the status
//! writer is given.

use std::collections::BTreeMap;
use std::time::Duration;

use evpleg_kubelet::source::api::SourceBackoff;
use evpleg_kubelet::source::{Op, PodUpdate, SourceName, annotations};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, Pod,
    PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tokio::sync::mpsc;

use crate::fake_apiserver::test_pod;

/// Bound of every wait.
pub const WAIT: Duration = Duration::from_secs(20);

pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "evpleg=debug,kube_runtime=debug,evpleg_tests=info".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A short reconnect backoff, so that recovery takes milliseconds.
pub fn fast_backoff() -> SourceBackoff {
    SourceBackoff {
        min: Duration::from_millis(10),
        max: Duration::from_millis(200),
        reset_after: Duration::from_secs(120),
    }
}

/// The source's next update, within [`WAIT`].
pub async fn next(rx: &mut mpsc::Receiver<PodUpdate>, what: &str) -> PodUpdate {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .unwrap_or_else(|_| {
            panic!("no update from the API source within {WAIT:?}: expected {what}")
        })
        .expect("the API source stopped")
}

/// The names of an update's pods, sorted.
pub fn names(update: &PodUpdate) -> Vec<String> {
    let mut names: Vec<String> = update
        .pods
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    names.sort();
    names
}

pub fn assert_update(update: &PodUpdate, op: Op, expected: &[&str]) {
    assert_eq!(
        (update.op, names(update)),
        (
            op,
            expected.iter().map(|s| s.to_string()).collect::<Vec<_>>()
        ),
        "unexpected update {update:?}"
    );
    assert_eq!(update.source, SourceName::Api);
}

pub fn labelled(pod: Pod, key: &str, value: &str) -> Pod {
    let mut pod = pod;
    pod.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(key.into(), value.into());
    pod
}

pub fn time(secs: i64) -> Time {
    Time(k8s_openapi::jiff::Timestamp::from_second(secs).expect("a time"))
}

pub fn condition(type_: &str, status: &str) -> PodCondition {
    PodCondition {
        type_: type_.into(),
        status: status.into(),
        last_transition_time: Some(time(1_700_000_000)),
        ..PodCondition::default()
    }
}

/// The status of a pod whose one container exited 3 and will not restart.
pub fn failed_status() -> PodStatus {
    PodStatus {
        phase: Some("Failed".into()),
        conditions: Some(vec![
            condition("PodScheduled", "True"),
            condition("Initialized", "True"),
            condition("ContainersReady", "False"),
            condition("Ready", "False"),
        ]),
        container_statuses: Some(vec![ContainerStatus {
            name: "main".into(),
            image: "busybox:1.36".into(),
            image_id: String::new(),
            container_id: Some("containerd://0123".into()),
            ready: false,
            restart_count: 0,
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 3,
                    reason: Some("Error".into()),
                    started_at: Some(time(1_700_000_001)),
                    finished_at: Some(time(1_700_000_002)),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]),
        host_ip: Some("192.0.2.10".into()),
        pod_ip: Some("10.88.0.5".into()),
        pod_ips: Some(vec![PodIP {
            ip: "10.88.0.5".into(),
        }]),
        qos_class: Some("BestEffort".into()),
        start_time: Some(time(1_700_000_000)),
        ..PodStatus::default()
    }
}

pub fn running_status() -> PodStatus {
    PodStatus {
        phase: Some("Running".into()),
        conditions: Some(vec![
            condition("PodScheduled", "True"),
            condition("Ready", "True"),
        ]),
        container_statuses: Some(vec![ContainerStatus {
            name: "main".into(),
            image: "busybox:1.36".into(),
            ready: true,
            state: Some(ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(time(1_700_000_001)),
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]),
        qos_class: Some("BestEffort".into()),
        ..PodStatus::default()
    }
}

/// As the API source hands pods on: annotated with `config.source: api`.
pub fn from_api(pod: Pod) -> Pod {
    let mut pod = pod;
    pod.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(annotations::CONFIG_SOURCE.into(), "api".into());
    pod
}

/// A static pod `namespace/name` of `node` as the file source produces it.
pub fn static_pod(
    namespace: &str,
    name: &str,
    node: &str,
    uid: &str,
    hash: &str,
    image: &str,
) -> Pod {
    let mut pod = test_pod(namespace, name, node);
    pod.metadata.uid = Some(uid.into());
    pod.metadata.annotations = Some(BTreeMap::from([
        (annotations::CONFIG_SOURCE.to_string(), "file".to_string()),
        (annotations::CONFIG_HASH.to_string(), hash.to_string()),
        (
            annotations::CONFIG_SEEN.to_string(),
            "2026-01-01T00:00:00Z".to_string(),
        ),
    ]));
    pod.spec.as_mut().expect("a spec").containers[0].image = Some(image.into());
    pod
}

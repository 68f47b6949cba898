//! End-to-end: kubelet behaviours of the pod sources and the status manager,
//! with the whole agent on the containerd harness and, where the API is
//! involved, the real kube-apiserver behind `--kubeconfig`, the agent as
//! `system:node:e2e` (issue 10, API side; issue #30). Privileged: skipped with
//! a reason without root/BTF/the eBPF object (or the control plane's
//! binaries), a failure under `CI=true`. One test at a time (each runs a
//! containerd and an agent).

use std::time::{Duration, Instant};

use evpleg_core::ids::PodUid;
use evpleg_kubelet::pod_workers::WorkerState;
use evpleg_kubelet::source::annotations;
use evpleg_tests::control_plane::AuditRecord;
use evpleg_tests::e2e::{DEADLINE, E2e, NODE, api_pod, manifest};
use evpleg_tests::privileged;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};
use serde_json::Value;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn phase(p: &Pod) -> Option<&str> {
    p.status.as_ref().and_then(|s| s.phase.as_deref())
}

fn running(p: &Pod) -> bool {
    phase(p) == Some("Running")
}

/// Whether an end-to-end test against the real API server can run here.
fn real(test: &str) -> bool {
    privileged(test) && evpleg_tests::control_plane::available(test)
}

/// What the agent (`system:node:e2e`) sent about pod `name`, in order.
fn agent_requests(e: &E2e, name: &str) -> Vec<AuditRecord> {
    let user = format!("system:node:{NODE}");
    let pod = format!("/api/v1/namespaces/default/pods/{name}");
    e.cp()
        .audit()
        .into_iter()
        .filter(|r| r.user == user && r.path().starts_with(&pod))
        .collect()
}

/// The agent's requests about pod `name`, once the audit log holds its
/// final delete (or after a bound): the API server writes a request's audit
/// record as the request completes, so a watcher can see the pod gone a
/// moment before the record is in the log.
async fn agent_requests_after_final_delete(e: &E2e, name: &str) -> Vec<AuditRecord> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let requests = agent_requests(e, name);
        if requests.iter().any(is_final_delete) || Instant::now() > deadline {
            return requests;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A final delete: grace period 0.
fn is_final_delete(r: &AuditRecord) -> bool {
    r.verb == "delete"
        && (r
            .body
            .as_ref()
            .is_some_and(|b| b["gracePeriodSeconds"] == 0)
            || r.query("gracePeriodSeconds").as_deref() == Some("0"))
}

fn uid(p: &Pod) -> String {
    p.metadata.uid.clone().expect("a uid")
}

/// Item 1: with `--manifest-dir` and `--kubeconfig` together, a static pod runs
/// exactly once; its mirror pod, which the agent creates and then sees in its
/// own watch of the node's pods, is never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_pod_runs_once_next_to_its_mirror_pod() {
    if !real("a_static_pod_runs_once_next_to_its_mirror_pod") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_control_plane("mirror", &[]).await;
    let started = Instant::now();
    e.write("web.yaml", &manifest("web", "Always", "sleep 600", ""));
    let name = format!("web-{NODE}");
    let mirror = e
        .wait_api(&name, "mirror pod Running", |p| {
            running(p)
                && p.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key(annotations::CONFIG_MIRROR))
        })
        .await;
    let static_pod = e
        .wait_for("web", "Running", |p| p["status"]["phase"] == "Running")
        .await;
    let static_uid = static_pod["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_owned();
    let mirror_uid = uid(&mirror);
    assert_ne!(static_uid, mirror_uid);
    // An ordering barrier: an API pod added after the mirror pod runs only
    // after the sync loop handled the mirror pod's watch event.
    e.create_pod(&api_pod("barrier", "Always", "sleep 600"))
        .await;
    e.wait_api("barrier", "Running", running).await;
    eprintln!(
        "static pod, mirror pod and barrier running after {:?}",
        started.elapsed()
    );
    assert!(
        e.sandboxes(&mirror_uid).await.is_empty(),
        "the mirror pod got a sandbox"
    );
    assert_eq!(e.run_pod_sandbox_calls(&mirror_uid), 0);
    assert_eq!(e.sandboxes(&static_uid).await.len(), 1);
    assert_eq!(
        e.run_pod_sandbox_calls(&static_uid),
        1,
        "the static pod ran more than once"
    );
    assert_eq!(
        e.agent().worker_state(&PodUid::parse(&mirror_uid).unwrap()),
        None
    );
    let client = e.cri().client().await;
    let containers = client
        .list_containers(None)
        .await
        .expect("ListContainers")
        .into_iter()
        .filter(|c| c.labels.get(evpleg_core::labels::POD_NAME) == Some(&name))
        .count();
    assert_eq!(containers, 1, "containers of {name}");
    e.finish().await;
}

/// The kubelet's `deleteOrphanedMirrorPods`: a static pod's manifest removed
/// while the agent was down leaves its mirror pod in the API server; the
/// restarted agent's housekeeping deletes it (grace period 0, the mirror's UID
/// as precondition), and leaves the mirror pod of a static pod still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphaned_mirror_pod_is_deleted_after_an_agent_restart() {
    if !real("an_orphaned_mirror_pod_is_deleted_after_an_agent_restart") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut e = E2e::start_with_control_plane("orphan", &[]).await;
    let is_mirror = |p: &Pod| {
        p.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(annotations::CONFIG_MIRROR))
    };
    e.write("gone.yaml", &manifest("gone", "Always", "sleep 600", ""));
    e.write("kept.yaml", &manifest("kept", "Always", "sleep 600", ""));
    let (gone, kept) = (format!("gone-{NODE}"), format!("kept-{NODE}"));
    let mirror = e
        .wait_api(&gone, "mirror pod Running", |p| running(p) && is_mirror(p))
        .await;
    let kept_mirror = e
        .wait_api(&kept, "mirror pod Running", |p| running(p) && is_mirror(p))
        .await;
    e.stop_agent().await;
    e.remove("gone.yaml");
    let restarted = Instant::now();
    e.start_agent().await;
    e.wait_real("default", &gone, "the orphaned mirror pod deleted", |p| {
        p.is_none()
    })
    .await;
    eprintln!(
        "orphaned mirror pod deleted {:?} after the restart",
        restarted.elapsed()
    );
    let deletes: Vec<AuditRecord> = agent_requests_after_final_delete(&e, &gone)
        .await
        .into_iter()
        .filter(|r| r.verb == "delete")
        .collect();
    assert!(
        deletes.iter().any(is_final_delete),
        "deleted with grace period 0: {deletes:?}"
    );
    assert!(
        deletes.iter().all(|r| r
            .body
            .as_ref()
            .is_some_and(|b| b["preconditions"]["uid"] == uid(&mirror).as_str())),
        "with the mirror pod's UID as precondition: {deletes:?}"
    );
    // The other static pod's mirror pod stays (two housekeeping rounds).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let api: Api<Pod> = Api::namespaced(e.kube().await, "default");
    let still = api.get_opt(&kept).await.expect("get").expect("kept mirror");
    assert_eq!(still.metadata.uid, kept_mirror.metadata.uid);
    e.finish().await;
}

/// Item 2: a gracefully deleted API pod does not stay Terminating: once its
/// containers stopped, the agent deletes it with grace period 0 and its UID as
/// precondition, and forgets its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gracefully_deleted_api_pod_is_deleted_once_its_containers_stopped() {
    if !real("a_gracefully_deleted_api_pod_is_deleted_once_its_containers_stopped") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_control_plane("delete", &[]).await;
    let pod = e
        .create_pod(&api_pod(
            "doomed",
            "Always",
            "trap 'exit 0' TERM; while true; do sleep 0.1; done",
        ))
        .await;
    let pod_uid = uid(&pod);
    e.wait_api("doomed", "Running", running).await;
    let requested = Instant::now();
    let pods: Api<Pod> = Api::namespaced(e.kube().await, "default");
    pods.delete("doomed", &DeleteParams::default())
        .await
        .expect("graceful delete");
    e.wait_real("default", "doomed", "deleted for good", |p| p.is_none())
        .await;
    let took = requested.elapsed();
    eprintln!("deleted for good {took:?} after the graceful delete");
    let requests = agent_requests_after_final_delete(&e, "doomed").await;
    let final_deletes: Vec<usize> = requests
        .iter()
        .enumerate()
        .filter(|(_, r)| is_final_delete(r))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(final_deletes.len(), 1, "one final delete: {requests:#?}");
    let delete = &requests[final_deletes[0]];
    assert_eq!(delete.code, 200, "{delete:?}");
    let body = delete.body.clone().unwrap_or(Value::Null);
    assert_eq!(body["preconditions"]["uid"], pod_uid, "{body:#}");
    // Before it: a status patch saying the pod is terminal with every container
    // terminated.
    let last_status: Vec<Value> = requests[..final_deletes[0]]
        .iter()
        .filter(|r| r.verb == "patch" && r.path().ends_with("/pods/doomed/status"))
        .filter_map(|r| r.body.clone())
        .collect();
    let phase = last_status
        .iter()
        .rev()
        .find_map(|b| b["status"]["phase"].as_str().map(str::to_owned));
    assert!(
        matches!(phase.as_deref(), Some("Succeeded" | "Failed")),
        "last phase before the delete: {phase:?}; {last_status:#?}"
    );
    let terminated = last_status.iter().rev().find_map(|b| {
        b["status"]["containerStatuses"]
            .as_array()
            .map(|a| a.iter().all(|c| c["state"]["terminated"].is_object()))
    });
    assert_eq!(terminated, Some(true), "{last_status:#?}");
    let refused = e.cp().refused(&format!("system:node:{NODE}"));
    assert!(refused.is_empty(), "refused: {refused:#?}");
    // Forgotten: no status in the manager, no pod status cache entry.
    let puid = PodUid::parse(&pod_uid).unwrap();
    e.wait_until("status forgotten", || !e.agent().status.knows(&puid))
        .await;
    e.wait_until("cache entry dropped", || {
        e.agent().pleg().and_then(|p| p.cache.get(&puid)).is_none()
    })
    .await;
    assert_eq!(e.agent().status.stats().deleted, 1);
    e.finish().await;
}

/// The pitfall of issue #30: a gracefully deleted pod stays Terminating while
/// a finalizer that is not the agent's holds the API object. The agent stops
/// the containers and says so (a terminal status with every container
/// terminated, then its final delete, which the API server accepts and keeps
/// the object for the finalizer); the pod's containers are stopped while the
/// object stays; removing the finalizer completes the deletion and the agent
/// forgets the pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_held_by_a_finalizer_is_stopped_and_deleted_once_released() {
    if !real("a_pod_held_by_a_finalizer_is_stopped_and_deleted_once_released") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_control_plane("finalizer", &[]).await;
    let mut held = api_pod(
        "held",
        "Always",
        "trap 'exit 0' TERM; while true; do sleep 0.1; done",
    );
    held.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let pod = e.create_pod(&held).await;
    let pod_uid = uid(&pod);
    let puid = PodUid::parse(&pod_uid).unwrap();
    e.wait_api("held", "Running", running).await;
    let pods: Api<Pod> = Api::namespaced(e.kube().await, "default");
    pods.delete("held", &DeleteParams::default())
        .await
        .expect("graceful delete");

    // The agent's final delete was accepted: the object stays, Terminating,
    // its grace period now 0, with the agent's terminal status.
    let stuck = e
        .wait_real("default", "held", "terminal and finally deleted", |p| {
            p.is_some_and(|p| {
                p.metadata.deletion_grace_period_seconds == Some(0)
                    && matches!(phase(p), Some("Succeeded" | "Failed"))
            })
        })
        .await
        .expect("held by its finalizer");
    assert!(stuck.metadata.deletion_timestamp.is_some());
    assert_eq!(
        stuck.metadata.finalizers.as_deref(),
        Some(&["example.com/hold".to_owned()][..])
    );
    let statuses = stuck
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.clone())
        .unwrap_or_default();
    assert!(
        !statuses.is_empty()
            && statuses
                .iter()
                .all(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some())),
        "every container terminated: {statuses:#?}"
    );
    // Its containers are stopped in the runtime, and its sandbox too.
    let containers = e
        .cri()
        .client()
        .await
        .list_containers(None)
        .await
        .expect("ListContainers")
        .into_iter()
        .filter(|c| c.labels.get(evpleg_core::labels::POD_UID) == Some(&pod_uid))
        .collect::<Vec<_>>();
    assert!(
        containers
            .iter()
            .all(|c| c.state == evpleg_cri_api::v1::ContainerState::ContainerExited as i32),
        "{containers:#?}"
    );
    for sandbox in e.sandboxes(&pod_uid).await {
        assert_eq!(
            sandbox.state,
            evpleg_cri_api::v1::PodSandboxState::SandboxNotready as i32,
            "{sandbox:?}"
        );
    }
    let requests = agent_requests_after_final_delete(&e, "held").await;
    let deletes: Vec<&AuditRecord> = requests.iter().filter(|r| is_final_delete(r)).collect();
    assert!(
        deletes.first().is_some_and(|d| d.code == 200),
        "the final delete accepted: {requests:#?}"
    );
    let refused = e.cp().refused(&format!("system:node:{NODE}"));
    assert!(refused.is_empty(), "refused: {refused:#?}");

    // The finalizer's owner lets go: the deletion completes, the agent forgets.
    let release = serde_json::json!({"metadata": {"finalizers": null}});
    pods.patch("held", &PatchParams::default(), &Patch::Merge(&release))
        .await
        .expect("remove the finalizer");
    e.wait_real("default", "held", "gone", |p| p.is_none())
        .await;
    e.wait_until("status forgotten", || !e.agent().status.knows(&puid))
        .await;
    e.wait_until("cache entry dropped", || {
        e.agent().pleg().and_then(|p| p.cache.get(&puid)).is_none()
    })
    .await;
    e.finish().await;
}

/// Item 3: a pod whose phase in the API server is already terminal when the
/// agent starts is never started again (two restarts), and its status never
/// leaves the terminal phase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_api_pod_is_never_started_again_after_agent_restarts() {
    if !real("a_terminal_api_pod_is_never_started_again_after_agent_restarts") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut e = E2e::start_with_control_plane("terminal", &[]).await;
    let pod = e.create_pod(&api_pod("job", "Never", "exit 3")).await;
    let pod_uid = uid(&pod);
    let puid = PodUid::parse(&pod_uid).unwrap();
    e.wait_api("job", "Failed", |p| phase(p) == Some("Failed"))
        .await;
    e.wait_until("the first worker done", || {
        e.agent().worker_state(&puid) == Some(WorkerState::Done)
    })
    .await;
    assert_eq!(e.run_pod_sandbox_calls(&pod_uid), 1, "ran once");
    for restart in 1..=2 {
        e.restart_agent().await;
        // The new agent's worker terminated the pod without starting it.
        e.wait_until(&format!("worker done after restart {restart}"), || {
            e.agent().worker_state(&puid) == Some(WorkerState::Done)
        })
        .await;
        assert_eq!(
            e.run_pod_sandbox_calls(&pod_uid),
            1,
            "RunPodSandbox again after restart {restart}"
        );
        let now = e
            .wait_real("default", "job", "present", |p| p.is_some())
            .await
            .expect("the pod");
        assert_eq!(phase(&now), Some("Failed"), "after restart {restart}");
        let exit = now
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.state.as_ref())
            .and_then(|s| s.terminated.as_ref())
            .map(|t| t.exit_code);
        assert_eq!(
            exit,
            Some(3),
            "the first run's exit stays, after restart {restart}"
        );
    }
    e.finish().await;
}

/// Item 4: a static pod whose manifest is removed and restored (the same UID)
/// runs again, in a new sandbox (the kubelet's restart of a pod re-added after
/// it terminated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_pod_restored_with_the_same_uid_runs_again() {
    if !privileged("a_static_pod_restored_with_the_same_uid_runs_again") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with("restore", false, &[]).await;
    let yaml = manifest(
        "back",
        "Always",
        "trap 'exit 0' TERM; while true; do sleep 0.1; done",
        "",
    );
    e.write("back.yaml", &yaml);
    let first = e
        .wait_for("back", "Running", |p| p["status"]["phase"] == "Running")
        .await;
    let pod_uid = first["metadata"]["uid"].as_str().expect("uid").to_owned();
    let sandbox1 = e.sandboxes(&pod_uid).await;
    assert_eq!(sandbox1.len(), 1);
    e.remove("back.yaml");
    e.wait_gone("back").await;
    // Stopped, then removed by the container GC (every second here).
    e.wait_runtime_clean(&pod_uid, DEADLINE).await;
    let restored = Instant::now();
    e.write("back.yaml", &yaml);
    // Running again in a new container (its first status may show the
    // pod Running with the first container exited, as the kubelet's
    // getPhase does for restartPolicy Always while its cache still holds
    // what the runtime had).
    let first_container = first["status"]["containerStatuses"][0]["containerID"].clone();
    assert!(first_container.is_string(), "{first:#}");
    let second = e
        .wait_for("back", "Running again in a new container", |p| {
            p["status"]["phase"] == "Running"
                && p["status"]["containerStatuses"][0]["state"]["running"].is_object()
                && p["status"]["containerStatuses"][0]["containerID"] != first_container
        })
        .await;
    eprintln!(
        "running again {:?} after the manifest came back",
        restored.elapsed()
    );
    assert_eq!(second["metadata"]["uid"], pod_uid, "the same UID");
    let sandbox2 = e.sandboxes(&pod_uid).await;
    assert_eq!(sandbox2.len(), 1);
    assert_ne!(sandbox2[0].id, sandbox1[0].id, "a new sandbox");
    assert_eq!(e.run_pod_sandbox_calls(&pod_uid), 2);
    e.finish().await;
}

/// Item 6: the HTTP listener binds before anything starts: a port in use fails
/// the start at once with an error naming the address, before the runtime is
/// even asked for (the endpoint here does not exist).
#[tokio::test]
async fn a_port_clash_fails_the_start_at_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let addr = taken.local_addr().expect("its address").to_string();
    let args = <evpleg::config::RunArgs as clap::Parser>::try_parse_from([
        "evpleg",
        "--cri-endpoint",
        "unix:///nonexistent/evpleg-test.sock",
        "--listen",
        &addr,
        "--node-name",
        NODE,
    ])
    .expect("args");
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(5), evpleg::agent::Agent::start(&args))
        .await
        .expect("the start returns at once");
    let took = started.elapsed();
    match result {
        Err(e @ evpleg::agent::AgentError::Listen { .. }) => {
            assert!(e.to_string().contains(&addr), "{e}");
        }
        Err(e) => panic!("expected the listen error first, got: {e}"),
        Ok(_) => panic!("the agent started on a port in use"),
    }
    eprintln!("refused after {took:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

/// Item 4, the restart-requested path: the manifest comes back while the pod
/// is still terminating (its container ignores SIGTERM, so termination takes
/// the 3 s grace period); the pod runs again once it terminated, in a new
/// sandbox, with the same UID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_pod_restored_while_terminating_runs_again_once_terminated() {
    if !privileged("a_static_pod_restored_while_terminating_runs_again_once_terminated") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with("restore-early", false, &[]).await;
    let yaml = manifest(
        "stubborn",
        "Always",
        "trap '' TERM; while true; do sleep 0.1; done",
        "",
    );
    e.write("stubborn.yaml", &yaml);
    let first = e
        .wait_for("stubborn", "Running", |p| p["status"]["phase"] == "Running")
        .await;
    let pod_uid = first["metadata"]["uid"].as_str().expect("uid").to_owned();
    let puid = PodUid::parse(&pod_uid).unwrap();
    let sandbox1 = e.sandboxes(&pod_uid).await;
    assert_eq!(sandbox1.len(), 1);
    e.remove("stubborn.yaml");
    e.wait_until("terminating", || {
        e.agent().worker_state(&puid) == Some(WorkerState::Terminating)
    })
    .await;
    e.write("stubborn.yaml", &yaml);
    // Running again: a new container (the first one's status may still be
    // in /pods until the terminated pod's last status was handed in).
    let first_container = first["status"]["containerStatuses"][0]["containerID"].clone();
    assert!(first_container.is_string(), "{first:#}");
    let second = e
        .wait_for("stubborn", "Running in a new container", |p| {
            p["status"]["phase"] == "Running"
                && p["status"]["containerStatuses"][0]["state"]["running"].is_object()
                && p["status"]["containerStatuses"][0]["containerID"] != first_container
        })
        .await;
    assert_eq!(second["metadata"]["uid"], pod_uid);
    // One sandbox ready, a new one; the first stays stopped, holding the
    // first container (its last dead instance, which the container GC keeps
    // as the kubelet's does).
    let ready = evpleg_cri_api::v1::PodSandboxState::SandboxReady as i32;
    let sandbox2: Vec<_> = e
        .sandboxes(&pod_uid)
        .await
        .into_iter()
        .filter(|s| s.state == ready)
        .collect();
    assert_eq!(sandbox2.len(), 1, "{sandbox2:?}");
    assert_ne!(sandbox2[0].id, sandbox1[0].id, "a new sandbox");
    assert_eq!(e.run_pod_sandbox_calls(&pod_uid), 2);
    e.finish().await;
}

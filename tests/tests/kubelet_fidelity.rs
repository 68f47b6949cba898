//! Kubelet fidelity end to end (issue #10, docs/pod-lifecycle.md's table "kubelet
//! behaviour -> evpleg"): the whole agent against the real containerd, pods from
//! static manifests, every status the agent writes observed through the local
//! store's subscription (so a pod's last status before its removal is seen too).
//! Privileged: skipped with a reason without root/BTF/the eBPF object, a
//! failure under `CI=true`.

use std::collections::HashMap;
use std::time::Instant;

use evpleg_cri_api::v1;
use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::Value;

fn waiting_reason(pod: &Value) -> Option<&str> {
    container(pod, "app")["state"]["waiting"]["reason"].as_str()
}

/// The CRI containers of pod `uid` named `name`: (id, attempt, state).
async fn runtime_containers(e: &E2e, uid: &str, name: &str) -> Vec<(String, u32, i32)> {
    let filter = v1::ContainerFilter {
        label_selector: HashMap::from([
            (evpleg_core::labels::POD_UID.to_owned(), uid.to_owned()),
            (
                evpleg_core::labels::CONTAINER_NAME.to_owned(),
                name.to_owned(),
            ),
        ]),
        ..Default::default()
    };
    let mut out: Vec<_> = e
        .cri()
        .client()
        .await
        .list_containers(Some(filter))
        .await
        .expect("ListContainers")
        .into_iter()
        .map(|c| (c.id, c.metadata.map_or(0, |m| m.attempt), c.state))
        .collect();
    out.sort_by_key(|c| c.1);
    out
}

/// The ids of the pod's sandboxes.
async fn sandbox_ids(e: &E2e, uid: &str) -> Vec<String> {
    e.sandboxes(uid).await.into_iter().map(|s| s.id).collect()
}

/// Kills the pod's sandbox from outside: SIGKILL to its pause process.
async fn kill_sandbox(e: &E2e, uid: &str) -> String {
    let ids = sandbox_ids(e, uid).await;
    assert_eq!(ids.len(), 1, "one sandbox: {ids:?}");
    let pid = find_container_pid(&ids[0]).expect("the pause process");
    // SAFETY: a plain signal to the pause process of our own test pod.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    ids[0].clone()
}

fn uid_of(pod: &Value) -> String {
    pod["metadata"]["uid"].as_str().expect("uid").to_owned()
}

// The final status after a deletion is the runtime's: a container that exits
// 0 on SIGTERM is Completed and the pod Succeeded (it was invented as Error).
// Its grace period of 0 becomes the kubelet's minimum of 2 s, so it gets the
// SIGTERM (with 0, StopContainer sends SIGKILL at once: 137, Error).
e2e_test!(a_container_exiting_0_on_sigterm_ends_completed, |e| {
    Box::pin(async move {
        let mut history = History::new(e, "polite");
        e.write(
            "polite.yaml",
            &manifest(
                "polite",
                "Always",
                "trap 'exit 0' TERM; while true; do sleep 0.1; done",
                "",
            )
            .replace(
                "terminationGracePeriodSeconds: 3",
                "terminationGracePeriodSeconds: 0",
            ),
        );
        history
            .until("running", |p| {
                container(p, "app")["state"]["running"].is_object()
            })
            .await;
        std::fs::remove_file(e.manifests.join("polite.yaml")).expect("remove manifest");
        e.wait_gone("polite").await;
        // The store forgets a pod only after its last status was written.
        history.drain();
        let last = history.seen.last().expect("statuses").clone();
        let t = &container(&last, "app")["state"]["terminated"];
        assert_eq!(
            (
                last["status"]["phase"].as_str(),
                t["exitCode"].as_i64(),
                t["reason"].as_str()
            ),
            (Some("Succeeded"), Some(0), Some("Completed")),
            "{last:#}"
        );
        assert!(t["finishedAt"].is_string(), "{t:#}");
        // The id's scheme is the runtime's name from its Version answer.
        let name = e
            .cri()
            .client()
            .await
            .version()
            .await
            .expect("Version")
            .runtime_name;
        let id = t["containerID"].as_str().expect("containerID");
        assert!(id.starts_with(&format!("{name}://")), "{id} ({name})");
    })
});

// A sandbox re-created after its pause process died: the container's attempt
// number and restartCount continue (they started over at 0).
e2e_test!(a_new_sandbox_continues_the_restart_count, |e| Box::pin(
    async move {
        e.write(
            "phoenix.yaml",
            &manifest("phoenix", "Always", "sleep 600", ""),
        );
        let running = |p: &Value| container(p, "app")["state"]["running"].is_object();
        let pod = e.wait_for("phoenix", "running", running).await;
        let uid = uid_of(&pod);
        let first = container(&pod, "app")["containerID"].clone();
        let old_sandbox = kill_sandbox(e, &uid).await;
        let pod = e
            .wait_for("phoenix", "running again in a new sandbox", |p| {
                running(p) && container(p, "app")["containerID"] != first
            })
            .await;
        assert_eq!(container(&pod, "app")["restartCount"], 1, "{pod:#}");
        let attempts: Vec<u32> = runtime_containers(e, &uid, "app")
            .await
            .iter()
            .map(|c| c.1)
            .collect();
        assert_eq!(attempts, [0, 1], "CRI attempts");
        let sandboxes = sandbox_ids(e, &uid).await;
        assert!(
            sandboxes.len() == 2 && sandboxes.contains(&old_sandbox),
            "{sandboxes:?}"
        );
    }
));

// A new sandbox runs every init container again, from the first, before the
// app (issue #27, item 2: the kubelet's `purgeInitContainers` and
// `computeInitContainerActions`): the old sandbox's init containers are removed
// before it, and the app's exited instance does not count as initialised (the
// app ran beside init1 before the fix, init2 was skipped).
e2e_test!(a_new_sandbox_runs_the_init_containers_again_in_order, |e| {
    Box::pin(async move {
        let init = |name: &str| {
            format!("    - name: {name}\n      image: {IMAGE}\n      command: [\"true\"]\n")
        };
        let inits = format!("  initContainers:\n{}{}", init("init1"), init("init2"));
        e.write(
            "reinit.yaml",
            &manifest("reinit", "Always", "sleep 600", &inits),
        );
        let running = |p: &Value| container(p, "app")["state"]["running"].is_object();
        let pod = e.wait_for("reinit", "running", running).await;
        let uid = uid_of(&pod);
        let first = container(&pod, "app")["containerID"].clone();
        let old = kill_sandbox(e, &uid).await;
        e.wait_for("reinit", "running again in a new sandbox", |p| {
            running(p) && container(p, "app")["containerID"] != first
        })
        .await;
        let filter = v1::ContainerFilter {
            label_selector: HashMap::from([(evpleg_core::labels::POD_UID.to_owned(), uid.clone())]),
            ..Default::default()
        };
        let all = e
            .cri()
            .client()
            .await
            .list_containers(Some(filter))
            .await
            .expect("ListContainers");
        let name = |c: &v1::Container| {
            c.metadata
                .as_ref()
                .map_or("", |m| m.name.as_str())
                .to_owned()
        };
        let left: Vec<String> = all
            .iter()
            .filter(|c| c.pod_sandbox_id == old && name(c).starts_with("init"))
            .map(name)
            .collect();
        assert!(
            left.is_empty(),
            "the old sandbox's init containers purged: {left:?}"
        );
        let created = |n: &str| -> Vec<(i64, i32)> {
            all.iter()
                .filter(|c| c.pod_sandbox_id != old && name(c) == n)
                .map(|c| (c.created_at, c.state))
                .collect()
        };
        let (init1, init2, app) = (created("init1"), created("init2"), created("app"));
        let exited = v1::ContainerState::ContainerExited as i32;
        assert!(
            init1.len() == 1 && init2.len() == 1 && app.len() == 1,
            "one of each in the new sandbox: {init1:?} {init2:?} {app:?}"
        );
        assert_eq!((init1[0].1, init2[0].1), (exited, exited));
        assert!(
            init1[0].0 < init2[0].0 && init2[0].0 < app[0].0,
            "init1, init2, then the app: {init1:?} {init2:?} {app:?}"
        );
    })
});

// A restartPolicy: Never pod whose sandbox died after its container ran gets no
// new sandbox: it is done (Failed), its container never runs again.
e2e_test!(a_never_pod_whose_sandbox_died_is_not_started_again, |e| {
    Box::pin(async move {
        e.write("once.yaml", &manifest("once", "Never", "sleep 600", ""));
        let pod = e
            .wait_for("once", "running", |p| {
                container(p, "app")["state"]["running"].is_object()
            })
            .await;
        let uid = uid_of(&pod);
        kill_sandbox(e, &uid).await;
        let pod = e
            .wait_for("once", "phase Failed", |p| p["status"]["phase"] == "Failed")
            .await;
        assert_eq!(container(&pod, "app")["restartCount"], 0, "{pod:#}");
        let containers = runtime_containers(e, &uid, "app").await;
        assert_eq!(containers.len(), 1, "one container ever: {containers:?}");
        assert_eq!(sandbox_ids(e, &uid).await.len(), 1, "no new sandbox");
    })
});

// Start errors reach the status as the kubelet's waiting reasons, with the
// image named: ErrImagePull then ImagePullBackOff, InvalidImageName,
// ErrImageNeverPull, and RunContainerError for an entrypoint that is missing.
e2e_test!(start_errors_are_the_waiting_reason, |e| Box::pin(
    async move {
        let with_image = |name: &str, image: &str, extra: &str| {
            manifest(name, "Always", "sleep 600", "")
                .replace("localhost/busybox:local", image)
                .replace(
                    &format!("image: {image}\n"),
                    &format!("image: {image}\n{extra}"),
                )
        };
        let cases = [
            (
                "absent",
                with_image("absent", "localhost/evpleg-absent:1", ""),
                "ErrImagePull",
            ),
            (
                "badname",
                with_image("badname", "Bad/Name:1", ""),
                "InvalidImageName",
            ),
            (
                "neverpull",
                with_image(
                    "neverpull",
                    "localhost/evpleg-absent:2",
                    "      imagePullPolicy: Never\n",
                ),
                "ErrImageNeverPull",
            ),
            (
                "noentry",
                manifest("noentry", "Always", "", "").replace(
                    "command: [\"sh\", \"-c\", \"\"]",
                    "command: [\"/evpleg-no-such-binary\"]",
                ),
                "RunContainerError",
            ),
        ];
        let mut histories: Vec<History> =
            cases.iter().map(|(n, _, _)| History::new(e, n)).collect();
        for (name, yaml, _) in &cases {
            e.write(&format!("{name}.yaml"), yaml);
        }
        for ((name, _, reason), history) in cases.iter().zip(histories.iter_mut()) {
            let pod = history
                .until(reason, |p| waiting_reason(p) == Some(*reason))
                .await;
            let message = container(&pod, "app")["state"]["waiting"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(!message.is_empty(), "{name}: {pod:#}");
            eprintln!("{name}: {reason}: {message}");
            if *name == "absent" {
                assert!(message.contains("localhost/evpleg-absent:1"), "{message}");
                let backoff = history
                    .until("ImagePullBackOff", |p| {
                        waiting_reason(p) == Some("ImagePullBackOff")
                    })
                    .await;
                assert_eq!(
                    container(&backoff, "app")["state"]["waiting"]["message"],
                    format!(
                        "Back-off pulling image \"localhost/evpleg-absent:1\": ErrImagePull: {message}"
                    )
                );
            }
        }
        // The reasons are about the containers only: the pods stay Pending or
        // Running, none terminal.
        for (name, _, _) in &cases {
            let pod = e.pod(name).expect("status");
            assert!(
                matches!(pod["status"]["phase"].as_str(), Some("Pending" | "Running")),
                "{name}: {pod:#}"
            );
        }
    }
));

// CrashLoopBackOff: the waiting message shows the back-off period, so it is
// stable from one resync to the next (it showed a count-down).
e2e_test!(crash_loop_back_off_has_a_stable_message, |e| Box::pin(
    async move {
        let mut history = History::new(e, "crasher");
        e.write("crasher.yaml", &manifest("crasher", "Always", "exit 2", ""));
        let pod = history
            .until("CrashLoopBackOff", |p| {
                waiting_reason(p) == Some("CrashLoopBackOff")
            })
            .await;
        let message = container(&pod, "app")["state"]["waiting"]["message"]
            .as_str()
            .expect("message")
            .to_owned();
        let uid = uid_of(&pod);
        assert!(
            message.starts_with("back-off ")
                && message.ends_with(&format!(
                    "restarting failed container=app pod=crasher-{NODE}_default({uid})"
                )),
            "{message}"
        );
        // Every CrashLoopBackOff status written names a period of the back-off
        // (0.2 s doubling to 1 s here), never a count-down.
        let started = Instant::now();
        history
            .until("restartCount 4", |p| {
                container(p, "app")["restartCount"].as_i64().unwrap_or(0) >= 4
            })
            .await;
        let periods: Vec<String> = history
            .seen
            .iter()
            .filter(|p| waiting_reason(p) == Some("CrashLoopBackOff"))
            .filter_map(|p| container(p, "app")["state"]["waiting"]["message"].as_str())
            .map(|m| m.split_whitespace().nth(1).unwrap_or_default().to_owned())
            .collect();
        assert!(
            !periods.is_empty()
                && periods
                    .iter()
                    .all(|p| ["200ms", "400ms", "800ms", "1s"].contains(&p.as_str())),
            "{periods:?} after {:?}",
            started.elapsed()
        );
        // As the kubelet's reason cache: the status of the sync that finds a
        // crash shows the container terminated; CrashLoopBackOff (the exit
        // then in lastState) only from the next sync's (its status is
        // generated before SyncPod, which records the back-off). The status
        // manager writes the newest status only, so a sync soon after (the
        // relist's report of a death the kernel reported) can hide the
        // terminated one: some exit found in back-off must show it. (Before,
        // every exit after the first, each found in back-off, showed
        // CrashLoopBackOff first.)
        let terminated_id = |p: &Value, key: &str| {
            container(p, "app")[key]["terminated"]["containerID"]
                .as_str()
                .map(str::to_owned)
        };
        // Each exit (its container's id) and the state the app had in the
        // first status that showed it.
        let mut first_shown: Vec<(String, &str)> = Vec::new();
        for p in &history.seen {
            let shown = [
                (terminated_id(p, "state"), "terminated"),
                (
                    terminated_id(p, "lastState"),
                    waiting_reason(p).unwrap_or("running"),
                ),
            ];
            for (id, how) in shown {
                if let Some(id) = id.filter(|id| !first_shown.iter().any(|(s, _)| s == id)) {
                    first_shown.push((id, how));
                }
            }
        }
        assert!(
            first_shown.len() >= 4 && first_shown[1..].iter().any(|(_, how)| *how == "terminated"),
            "each exit as first shown: {first_shown:?}; statuses written: {:#?}",
            history
                .seen
                .iter()
                .map(|p| {
                    let app = container(p, "app");
                    let short = |v: &Value| v.as_str().map(|s| s[13..21].to_owned());
                    (
                        &app["restartCount"],
                        app["state"]
                            .as_object()
                            .and_then(|o| o.keys().next().cloned()),
                        waiting_reason(p),
                        short(&app["state"]["terminated"]["containerID"]),
                        short(&app["lastState"]["terminated"]["containerID"]),
                    )
                })
                .collect::<Vec<_>>()
        );
    }
));

/// Container garbage collection with the kubelet's policy (one dead instance
/// kept per container): a crash-looping container's old instances and their
/// log files are removed every period, its last termination and restart count
/// stay, its sandbox stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_containers_beyond_one_per_container_are_collected() {
    if !evpleg_tests::privileged("dead_containers_beyond_one_per_container_are_collected") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with("gc", false, &["--container-gc-period", "300ms"]).await;
    e.write("crasher.yaml", &manifest("crasher", "Always", "exit 1", ""));
    let pod = e
        .wait_for("crasher", "restartCount >= 4", |p| {
            container(p, "app")["restartCount"].as_i64().unwrap_or(0) >= 4
        })
        .await;
    let uid = uid_of(&pod);
    // At most the newest dead instance and the current one remain.
    let deadline = Instant::now() + DEADLINE;
    let mut kept = runtime_containers(&e, &uid, "app").await;
    while kept.len() > 2 {
        assert!(
            Instant::now() < deadline,
            "dead containers never collected: {kept:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        kept = runtime_containers(&e, &uid, "app").await;
    }
    let attempts: Vec<u32> = kept.iter().map(|c| c.1).collect();
    assert!(
        attempts.iter().all(|a| *a >= 3),
        "the newest instances stay: {attempts:?}"
    );
    // The removed instances' logs went with them: only the kept attempts' files.
    let logs = e.cri().base().join("pod-logs");
    let dir = std::fs::read_dir(&logs)
        .expect("pod log dir")
        .flatten()
        .find(|d| d.file_name().to_string_lossy().ends_with(&uid))
        .expect("the pod's log dir")
        .path()
        .join("app");
    let mut files: Vec<u32> = std::fs::read_dir(&dir)
        .expect("container log dir")
        .flatten()
        .filter_map(|f| {
            f.file_name()
                .to_string_lossy()
                .strip_suffix(".log")?
                .parse()
                .ok()
        })
        .collect();
    files.sort();
    assert!(
        files
            .iter()
            .all(|f| attempts.contains(f) || *f > *attempts.iter().max().unwrap_or(&0)),
        "log files {files:?} for containers {attempts:?}"
    );
    let pod = e.pod("crasher").expect("status");
    let c = container(&pod, "app");
    assert!(c["restartCount"].as_i64().unwrap_or(0) >= 4, "{pod:#}");
    assert_eq!(c["lastState"]["terminated"]["exitCode"], 1, "{pod:#}");
    assert_eq!(sandbox_ids(&e, &uid).await.len(), 1);
    e.finish().await;
}

/// A deleted pod's content waits for the container GC, as under the
/// kubelet (`SyncTerminatedPod` leaves it "to be reclaimed in the
/// background"): once its worker has finished, its exited container, exit
/// code included, and its stopped sandbox are still in the runtime; the
/// collector's next period removes both. (Termination removed the sandbox,
/// and the exit code with it, until the fidelity corpus showed the
/// difference.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pod_s_content_waits_for_the_container_gc() {
    if !evpleg_tests::privileged("a_deleted_pod_s_content_waits_for_the_container_gc") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut e = E2e::start_with("gcdel", false, &["--container-gc-period", "1h"]).await;
    e.write(
        "deleted.yaml",
        &manifest(
            "deleted",
            "Always",
            "trap 'exit 7' TERM; while true; do sleep 0.1; done",
            "",
        ),
    );
    let pod = e
        .wait_for("deleted", "running", |p| {
            !container(p, "app")["state"]["running"].is_null()
        })
        .await;
    let uid = uid_of(&pod);
    e.remove("deleted.yaml");
    e.wait_gone("deleted").await;
    let pod_uid = evpleg_core::ids::PodUid::parse(&uid).expect("uid");
    e.wait_until("the deleted pod's worker is done", || {
        e.agent()
            .worker_state(&pod_uid)
            .is_none_or(|s| s == evpleg_kubelet::pod_workers::WorkerState::Done)
    })
    .await;
    let left = runtime_containers(&e, &uid, "app").await;
    assert_eq!(left.len(), 1, "its container stays: {left:?}");
    assert_eq!(left[0].2, v1::ContainerState::ContainerExited as i32);
    let status = e
        .cri()
        .client()
        .await
        .container_status(&left[0].0, false)
        .await
        .expect("ContainerStatus")
        .status
        .expect("a status");
    assert_eq!(status.exit_code, 7, "its exit code stays: {status:?}");
    let sandboxes = e.sandboxes(&uid).await;
    assert_eq!(sandboxes.len(), 1, "its sandbox stays: {sandboxes:?}");
    assert_eq!(
        sandboxes[0].state,
        v1::PodSandboxState::SandboxNotready as i32
    );
    // An agent whose collector runs every 300 ms removes both.
    e.stop_agent().await;
    e.args.container_gc_period = std::time::Duration::from_millis(300);
    e.start_agent().await;
    e.wait_runtime_clean(&uid, DEADLINE).await;
    e.finish().await;
}

/// Finished static pods are not run again after agent restarts: `restartPolicy:
/// Never` pods that exited 42, 0 and 5 keep their dead containers (they ran
/// again after each restart when termination removed them), their phases stay
/// and no new container or sandbox is made, through two restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_static_pods_are_not_run_again_after_agent_restarts() {
    if !evpleg_tests::privileged("finished_static_pods_are_not_run_again_after_agent_restarts") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut e = E2e::start("finished").await;
    let pods = [
        ("job42", 42, "Failed"),
        ("job0", 0, "Succeeded"),
        ("job5", 5, "Failed"),
    ];
    for (name, code, _) in pods {
        e.write(
            &format!("{name}.yaml"),
            &manifest(name, "Never", &format!("exit {code}"), ""),
        );
    }
    let mut uids = Vec::new();
    for (name, code, phase) in pods {
        let pod = e
            .wait_for(name, phase, |p| p["status"]["phase"] == phase)
            .await;
        assert_eq!(
            container(&pod, "app")["state"]["terminated"]["exitCode"],
            code,
            "{pod:#}"
        );
        uids.push(uid_of(&pod));
    }
    // Termination is over once the pods finished: their containers stay.
    for uid in &uids {
        e.wait_until("the finished pod's worker is done", || {
            e.agent()
                .worker_state(&evpleg_core::ids::PodUid::parse(uid).expect("uid"))
                .is_none_or(|s| {
                    use evpleg_kubelet::pod_workers::WorkerState::{Done, Terminated};
                    matches!(s, Terminated | Done)
                })
        })
        .await;
        assert_eq!(runtime_containers(&e, uid, "app").await.len(), 1, "{uid}");
    }
    for round in 1..=2 {
        e.restart_agent().await;
        for ((name, code, phase), uid) in pods.iter().zip(&uids) {
            let pod = e
                .wait_for(name, phase, |p| p["status"]["phase"] == *phase)
                .await;
            assert_eq!(
                container(&pod, "app")["state"]["terminated"]["exitCode"],
                *code,
                "round {round}: {pod:#}"
            );
            let containers = runtime_containers(&e, uid, "app").await;
            assert_eq!(containers.len(), 1, "round {round}, {name}: {containers:?}");
            assert_eq!(e.run_pod_sandbox_calls(uid), 1, "round {round}, {name}");
        }
    }
    e.finish().await;
}

/// Whether an end-to-end test against the real API server can run here.
fn real(test: &str) -> bool {
    evpleg_tests::privileged(test) && evpleg_tests::control_plane::available(test)
}

/// The status of condition `kind` of an API pod.
fn condition_of(p: &k8s_openapi::api::core::v1::Pod, kind: &str) -> Option<(String, String)> {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == kind))
        .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
}

/// Issue #27 item 1, against the real kube-apiserver: a pod with a readiness
/// gate is `Ready=False ReadinessGatesNotReady` until another writer (a load
/// balancer controller) sets the gate's condition True; that status-only
/// change reaches the pod's worker (the kubelet's `HandlePodReconcile`), and
/// the pod turns Ready, the controller's condition kept. Before the fix the
/// sync loop dropped the reconcile and Ready stayed False.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_readiness_gate_set_true_by_a_controller_makes_the_pod_ready() {
    if !real("a_readiness_gate_set_true_by_a_controller_makes_the_pod_ready") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_control_plane("gates", &[]).await;
    let mut pod = api_pod("gated", "Always", "sleep 3600");
    pod.spec.as_mut().expect("a spec").readiness_gates =
        Some(vec![k8s_openapi::api::core::v1::PodReadinessGate {
            condition_type: "example.com/lb".into(),
        }]);
    e.create_pod(&pod).await;
    e.wait_api("gated", "containers ready, the gate not", |p| {
        condition_of(p, "ContainersReady").is_some_and(|c| c.0 == "True")
            && condition_of(p, "Ready") == Some(("False".into(), "ReadinessGatesNotReady".into()))
    })
    .await;
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(e.kube().await, "default");
    let gate = serde_json::json!({"status": {"conditions": [
        {"type": "example.com/lb", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    ]}});
    pods.patch_status(
        "gated",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Strategic(&gate),
    )
    .await
    .expect("the controller's condition");
    let set = Instant::now();
    let ready = e
        .wait_api("gated", "Ready once the gate is True", |p| {
            condition_of(p, "Ready").is_some_and(|c| c.0 == "True")
        })
        .await;
    eprintln!("Ready {:?} after the gate's condition", set.elapsed());
    assert_eq!(
        condition_of(&ready, "example.com/lb")
            .map(|c| c.0)
            .as_deref(),
        Some("True"),
        "the controller's condition is kept"
    );
    e.finish().await;
}

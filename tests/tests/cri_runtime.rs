//! evpleg's CRI client against a real containerd with runc (Debian's), started
//! privately by the harness (`evpleg_tests::containerd`). The tests need no eBPF:
//! they skip with a reason without root or cgroup2, and fail instead under
//! `CI=true`.
//! Everything they create is removed by the harness's Drop, also on failure.

use std::time::{Duration, Instant};

use evpleg_cri_api::v1;
use evpleg_tests::containerd::{
    BUSYBOX_IMAGE, Containerd, PAUSE_IMAGE, container_config, init_test_logging, pod_cgroup_parent,
    wait_container_status,
};
use evpleg_tests::runtime_available;

fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
}

fn start_containerd() -> Containerd {
    init_test_logging();
    let started = Instant::now();
    let containerd = Containerd::start().unwrap_or_else(|e| panic!("containerd harness: {e}"));
    eprintln!(
        "containerd ready with images in {:?} (base {})",
        started.elapsed(),
        containerd.base().display()
    );
    containerd
}

#[test]
fn version_status_and_images() {
    if !runtime_available("version_status_and_images") {
        return;
    }
    let containerd = start_containerd();
    let rt = tokio_runtime();
    rt.block_on(async {
        let client = containerd.client().await;
        let started = Instant::now();
        let version = client.version().await.expect("Version");
        eprintln!("Version in {:?}: {version:?}", started.elapsed());
        assert_eq!(version.runtime_api_version, "v1");
        assert_eq!(version.runtime_name, "containerd");
        // The version of the binary the harness started, whatever Debian ships.
        let binary = std::process::Command::new(containerd.binary())
            .arg("--version")
            .output()
            .expect("containerd --version");
        let binary = String::from_utf8_lossy(&binary.stdout);
        assert!(
            !version.runtime_version.is_empty() && binary.contains(&version.runtime_version),
            "CRI says {version:?}, the binary says {binary}"
        );

        let status = client.status(false).await.expect("Status");
        let conditions = status.status.expect("checked by the client").conditions;
        let runtime_ready = conditions
            .iter()
            .find(|c| c.r#type == "RuntimeReady")
            .expect("a RuntimeReady condition");
        assert!(runtime_ready.status, "{conditions:?}");
        // No CNI configuration: the network is not ready, host-network pods
        // still run.
        assert!(conditions.iter().any(|c| c.r#type == "NetworkReady"));

        let images = client.list_images(None).await.expect("ListImages");
        for want in [BUSYBOX_IMAGE, PAUSE_IMAGE] {
            assert!(
                images.iter().any(|i| i.repo_tags.iter().any(|t| t == want)),
                "{want} not in {images:?}"
            );
            let spec = v1::ImageSpec {
                image: want.to_owned(),
                ..Default::default()
            };
            let status = client
                .image_status(&spec, false)
                .await
                .expect("ImageStatus");
            assert!(status.image.is_some(), "{want}: {status:?}");
        }
        let missing = v1::ImageSpec {
            image: "localhost/no-such-image:latest".to_owned(),
            ..Default::default()
        };
        let status = client
            .image_status(&missing, false)
            .await
            .expect("ImageStatus");
        assert!(status.image.is_none());

        // NotFound is an error for status calls and success for Stop/Remove.
        let err = client
            .container_status(&evpleg_tests::container_id(), false)
            .await
            .expect_err("unknown container");
        assert!(err.is_not_found(), "{err}");
        assert!(
            err.to_string().starts_with("ContainerStatus of container "),
            "{err}"
        );
        let unknown = evpleg_tests::container_id();
        client
            .stop_container(&unknown, 0)
            .await
            .expect("NotFound counts as stopped");
        client
            .remove_container(&unknown)
            .await
            .expect("NotFound counts as removed");
        client
            .stop_pod_sandbox(&unknown)
            .await
            .expect("NotFound counts as stopped");
        client
            .remove_pod_sandbox(&unknown)
            .await
            .expect("NotFound counts as removed");
    });
}

#[test]
fn container_exits_with_code_7_and_is_removed() {
    if !runtime_available("container_exits_with_code_7_and_is_removed") {
        return;
    }
    let containerd = start_containerd();
    let uid = evpleg_tests::pod_uid();
    let parent = pod_cgroup_parent(&uid);
    let sandbox_config = containerd.sandbox_config("exit7", &uid, &parent);
    let rt = tokio_runtime();
    rt.block_on(async {
        let client = containerd.client().await;

        let t = Instant::now();
        let sandbox = client
            .run_pod_sandbox(&sandbox_config, "")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("RunPodSandbox in {:?}", t.elapsed());
        let sandbox_status = client
            .pod_sandbox_status(&sandbox, false)
            .await
            .expect("status");
        assert_eq!(
            sandbox_status.status.as_ref().map(|s| s.state()),
            Some(v1::PodSandboxState::SandboxReady)
        );

        let config = container_config("exit7", &["sh", "-c", "exit 7"]);
        let t = Instant::now();
        let id = client
            .create_container(&sandbox, &config, &sandbox_config)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("CreateContainer in {:?}", t.elapsed());
        let t = Instant::now();
        client
            .start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("StartContainer in {:?}", t.elapsed());

        let t = Instant::now();
        let status = wait_container_status(&client, &id, "exited", |s| {
            s.state() == v1::ContainerState::ContainerExited
        })
        .await;
        eprintln!(
            "EXITED seen {:?} after StartContainer returned",
            t.elapsed()
        );
        assert_eq!(status.exit_code, 7, "{status:?}");
        assert_eq!(status.reason, "Error", "{status:?}");

        let listed = client.list_containers(None).await.expect("ListContainers");
        let mine = listed
            .iter()
            .find(|c| c.id == id)
            .unwrap_or_else(|| panic!("{id} not listed: {listed:?}"));
        assert_eq!(mine.pod_sandbox_id, sandbox);
        assert_eq!(mine.state(), v1::ContainerState::ContainerExited);
        let filtered = client
            .list_containers(Some(v1::ContainerFilter {
                pod_sandbox_id: sandbox.clone(),
                ..Default::default()
            }))
            .await
            .expect("ListContainers by sandbox");
        assert_eq!(filtered.len(), 1, "{filtered:?}");

        client
            .remove_container(&id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let listed = client.list_containers(None).await.expect("ListContainers");
        assert!(listed.iter().all(|c| c.id != id), "{id} still listed");
        let err = client
            .container_status(&id, false)
            .await
            .expect_err("removed");
        assert!(err.is_not_found(), "{err}");

        client
            .stop_pod_sandbox(&sandbox)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        client
            .remove_pod_sandbox(&sandbox)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let sandboxes = client
            .list_pod_sandboxes(None)
            .await
            .expect("ListPodSandbox");
        assert!(sandboxes.iter().all(|s| s.id != sandbox));
    });
    drop(rt);
    let pod_dir = evpleg_tests::cgroups::cgroup2().join(parent.trim_start_matches('/'));
    drop(containerd);
    assert!(
        !pod_dir.exists(),
        "the harness removes {}",
        pod_dir.display()
    );
}

#[test]
fn the_client_reconnects_after_a_containerd_restart() {
    if !runtime_available("the_client_reconnects_after_a_containerd_restart") {
        return;
    }
    let mut containerd = start_containerd();
    let uid = evpleg_tests::pod_uid();
    let parent = pod_cgroup_parent(&uid);
    let sandbox_config = containerd.sandbox_config("sleeper", &uid, &parent);
    let rt = tokio_runtime();
    let client = rt.block_on(containerd.client());

    let (sandbox, id) = rt.block_on(async {
        let sandbox = client
            .run_pod_sandbox(&sandbox_config, "")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let config = container_config("sleeper", &["sleep", "600"]);
        let id = client
            .create_container(&sandbox, &config, &sandbox_config)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        client
            .start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        wait_container_status(&client, &id, "running", |s| {
            s.state() == v1::ContainerState::ContainerRunning
        })
        .await;
        (sandbox, id)
    });

    // The container's cgroup is where the notes say (cgroupfs driver).
    let cgroup = evpleg_tests::cgroups::cgroup2()
        .join(parent.trim_start_matches('/'))
        .join(&id);
    assert!(cgroup.is_dir(), "{} exists", cgroup.display());
    // The shim of the sandbox listens where the harness computes it.
    let shim_socket = containerd.shim_socket_path(&sandbox).expect("sha256sum");
    assert!(shim_socket.exists(), "{} exists", shim_socket.display());

    let old_pid = containerd.pid();
    let t = Instant::now();
    containerd.restart().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("containerd restarted in {:?}", t.elapsed());
    assert_ne!(containerd.pid(), old_pid);

    rt.block_on(async {
        // The same client: its connection broke with the restart.
        let t = Instant::now();
        let listed = client
            .list_containers(None)
            .await
            .unwrap_or_else(|e| panic!("first call after the restart: {e}"));
        eprintln!("first call after the restart took {:?}", t.elapsed());
        let mine = listed
            .iter()
            .find(|c| c.id == id)
            .unwrap_or_else(|| panic!("{id} not listed after the restart: {listed:?}"));
        assert_eq!(mine.state(), v1::ContainerState::ContainerRunning);
        let status = client.container_status(&id, false).await.expect("status");
        assert_eq!(
            status.status.map(|s| s.state()),
            Some(v1::ContainerState::ContainerRunning)
        );
    });

    // Calls made while containerd is down wait (with backoff, within their
    // timeout) until it is back: a read-only one, and a CreateContainer, which
    // is retried because its request could not be sent.
    containerd.stop();
    let down_since = Instant::now();
    let list = rt.spawn({
        let client = client.clone();
        async move { client.list_pod_sandboxes(None).await }
    });
    let create = rt.spawn({
        let client = client.clone();
        let (sandbox, sandbox_config) = (sandbox.clone(), sandbox_config.clone());
        async move {
            let config = container_config("second", &["sleep", "600"]);
            client
                .create_container(&sandbox, &config, &sandbox_config)
                .await
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(!list.is_finished() && !create.is_finished(), "they wait");
    containerd.restart().unwrap_or_else(|e| panic!("{e}"));
    let sandboxes = rt
        .block_on(list)
        .expect("join")
        .unwrap_or_else(|e| panic!("ListPodSandbox while down: {e}"));
    assert!(sandboxes.iter().any(|s| s.id == sandbox), "{sandboxes:?}");
    let second = rt
        .block_on(create)
        .expect("join")
        .unwrap_or_else(|e| panic!("CreateContainer while down: {e}"));
    eprintln!(
        "calls made while containerd was down returned {:?} after it went down",
        down_since.elapsed()
    );

    rt.block_on(async {
        let listed = client.list_containers(None).await.expect("ListContainers");
        assert!(
            listed.iter().any(|c| c.id == second),
            "created exactly once: {listed:?}"
        );
        assert_eq!(
            listed
                .iter()
                .filter(|c| c.metadata.as_ref().is_some_and(|m| m.name == "second"))
                .count(),
            1,
            "created exactly once: {listed:?}"
        );

        // And it can still change state: stop the container.
        client
            .stop_container(&id, 1)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let status = wait_container_status(&client, &id, "exited", |s| {
            s.state() == v1::ContainerState::ContainerExited
        })
        .await;
        // SIGTERM ends `sleep` as PID 1 only via the grace period's SIGKILL.
        assert!([137, 143].contains(&status.exit_code), "{status:?}");
    });
    // The sandbox and its pod cgroup are left to the harness's teardown.
    drop(client);
    drop(rt);
    drop(containerd);
    assert!(!cgroup.exists(), "the harness removes {}", cgroup.display());
    assert!(!shim_socket.exists(), "{} is gone", shim_socket.display());
}

#[test]
fn the_harness_cleans_up_after_a_panicking_test() {
    if !runtime_available("the_harness_cleans_up_after_a_panicking_test") {
        return;
    }
    let mut left = None;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let containerd = start_containerd();
        let uid = evpleg_tests::pod_uid();
        let parent = pod_cgroup_parent(&uid);
        let sandbox_config = containerd.sandbox_config("doomed", &uid, &parent);
        let rt = tokio_runtime();
        let id = rt.block_on(async {
            let client = containerd.client().await;
            let sandbox = client
                .run_pod_sandbox(&sandbox_config, "")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let config = container_config("doomed", &["sleep", "600"]);
            let id = client
                .create_container(&sandbox, &config, &sandbox_config)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            client
                .start_container(&id)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            wait_container_status(&client, &id, "running", |s| {
                s.state() == v1::ContainerState::ContainerRunning
            })
            .await;
            id
        });
        let pod_dir = evpleg_tests::cgroups::cgroup2().join(parent.trim_start_matches('/'));
        assert!(pod_dir.join(&id).is_dir());
        left = Some((containerd.base().to_owned(), containerd.endpoint(), pod_dir));
        panic!("a test failing with a running container");
    }));
    assert!(outcome.is_err(), "the closure panics");
    let (base, endpoint, pod_dir) = left.expect("set before the panic");
    assert!(!base.exists(), "{} removed", base.display());
    assert!(!pod_dir.exists(), "{} removed", pod_dir.display());
    let socket = endpoint.trim_start_matches("unix://");
    let leftovers = std::process::Command::new("pgrep")
        .args(["-af", socket])
        .output()
        .expect("pgrep");
    assert!(
        leftovers.stdout.is_empty(),
        "processes of the instance are left: {}",
        String::from_utf8_lossy(&leftovers.stdout)
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(
        !mounts.contains(base.to_str().expect("utf-8")),
        "nothing mounted under {}",
        base.display()
    );
}

/// A CRI interceptor in front of `containerd`, which counts the calls, and
/// a client through it.
async fn intercepted(
    containerd: &Containerd,
) -> (
    evpleg_tests::cri_interceptor::CriInterceptor,
    evpleg_cri::CriClient,
) {
    let icpt = evpleg_tests::cri_interceptor::CriInterceptor::start(
        containerd.socket(),
        containerd.base().join("icpt.sock"),
    )
    .expect("the CRI interceptor");
    let client =
        evpleg_cri::CriClient::connect(&icpt.endpoint(), evpleg_cri::CriClientConfig::default())
            .await
            .expect("connect through the interceptor");
    (icpt, client)
}

/// `test`'s containerd, a pod named `pod` on it and a runtime to drive them;
/// `None` (the test skips) without a runtime to run on.
fn pod_on_containerd(
    test: &str,
    pod: &str,
) -> Option<(
    Containerd,
    evpleg_tests::cri_pod::TestPod,
    tokio::runtime::Runtime,
)> {
    if !runtime_available(test) {
        return None;
    }
    let containerd = start_containerd();
    let pod = evpleg_tests::cri_pod::TestPod::new(&containerd, pod);
    Some((containerd, pod, tokio_runtime()))
}

/// ebpf mode's runtime (`CriRuntime::remembering_exited`) reads an exited
/// container's status once: a pod's next inspection asks only its live
/// containers (issue #29), serves the same status, and forgets a container
/// once it is removed. The kubelet's reading (every container, every time) is
/// the default.
#[test]
fn an_exited_container_s_status_is_read_once_when_remembered() {
    use evpleg_core::container::{ContainerState, PodStatus};
    use evpleg_core::runtime::PodRuntime;
    use evpleg_cri::runtime::CriRuntime;
    use evpleg_tests::cri_pod::{run_container, run_sandbox};
    let Some((containerd, pod, rt)) = pod_on_containerd(
        "an_exited_container_s_status_is_read_once_when_remembered",
        "remembered",
    ) else {
        return;
    };
    rt.block_on(async {
        let (icpt, client) = intercepted(&containerd).await;
        let sandbox = run_sandbox(&client, &pod).await;
        let done = run_container(
            &client,
            &pod,
            &sandbox,
            &pod.container("done", &["sh", "-c", "exit 7"]),
        )
        .await;
        wait_container_status(&client, &done, "exited", |s| {
            s.state() == v1::ContainerState::ContainerExited
        })
        .await;
        let live = run_container(&client, &pod, &sandbox, &pod.waiting_container("live")).await;
        let uid = pod.pod_uid();
        let statuses = || icpt.calls().get("ContainerStatus").copied().unwrap_or(0);
        let inspect = |runtime: CriRuntime| {
            let uid = uid.clone();
            async move {
                let before = statuses();
                let status = runtime.pod_status(&uid).await.expect("pod status");
                (status, statuses() - before)
            }
        };
        let states = |s: &PodStatus| {
            let mut v: Vec<_> = s
                .containers
                .iter()
                .map(|c| (c.id.to_string(), c.state, c.exit_code, c.pid.is_some()))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let expected = {
            let mut v = vec![
                (done.clone(), ContainerState::Exited, Some(7), false),
                (live.clone(), ContainerState::Running, None, true),
            ];
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };

        let plain = CriRuntime::new(client.clone());
        for _ in 0..2 {
            let (status, calls) = inspect(plain.clone()).await;
            assert_eq!(states(&status), expected);
            assert_eq!(calls, 2, "the kubelet's reading asks every container");
        }
        let remembering = CriRuntime::new(client.clone()).remembering_exited();
        let (first, calls) = inspect(remembering.clone()).await;
        assert_eq!(states(&first), expected);
        assert_eq!(calls, 2, "the first inspection reads every container");
        let (second, calls) = inspect(remembering.clone()).await;
        assert_eq!(second, first, "the remembered status is the one read");
        assert_eq!(calls, 1, "the next one reads only the live container");

        client
            .remove_container(&done)
            .await
            .expect("RemoveContainer");
        let (after, calls) = inspect(remembering.clone()).await;
        assert_eq!(
            states(&after),
            vec![(live.clone(), ContainerState::Running, None, true)],
            "a removed container is forgotten"
        );
        assert_eq!(calls, 1);
        pod.release("live");
        wait_container_status(&client, &live, "exited", |s| {
            s.state() == v1::ContainerState::ContainerExited
        })
        .await;
        let (ended, calls) = inspect(remembering.clone()).await;
        assert_eq!(
            states(&ended),
            vec![(live.clone(), ContainerState::Exited, Some(7), false)]
        );
        assert_eq!(calls, 1, "its death is read");
        let (_, calls) = inspect(remembering).await;
        assert_eq!(calls, 0, "then remembered");
    });
}

/// A live container's or sandbox's pid comes from a `verbose` status, which
/// costs containerd the spec and, for a sandbox, a call to its shim: it is
/// asked once, then remembered (a pid never changes) while the container or
/// sandbox lives, and a dead one is not asked verbose (issue #31: asked at
/// every inspection, the pod relists queued for seconds while containerd
/// started the fidelity corpus's shims).
#[test]
fn a_live_container_s_pid_is_asked_verbose_once() {
    use evpleg_core::runtime::PodRuntime;
    use evpleg_cri::runtime::CriRuntime;
    use evpleg_tests::cri_pod::{run_container, run_sandbox};
    let Some((containerd, pod, rt)) = pod_on_containerd(
        "a_live_container_s_pid_is_asked_verbose_once",
        "verbose-once",
    ) else {
        return;
    };
    rt.block_on(async {
        let (icpt, client) = intercepted(&containerd).await;
        let sandbox = run_sandbox(&client, &pod).await;
        let live = run_container(&client, &pod, &sandbox, &pod.waiting_container("live")).await;
        let uid = pod.pod_uid();
        let runtime = CriRuntime::new(client.clone());
        let verbose = || {
            let calls = icpt.calls();
            let n = |m: &str| calls.get(m).copied().unwrap_or(0);
            (
                n("ContainerStatus verbose"),
                n("PodSandboxStatus verbose"),
                n("ContainerStatus") + n("PodSandboxStatus"),
            )
        };
        let inspect = || async {
            let before = verbose();
            let status = runtime.pod_status(&uid).await.expect("pod status");
            let after = verbose();
            let pids = (
                status
                    .containers
                    .iter()
                    .map(|c| c.pid.is_some())
                    .collect::<Vec<_>>(),
                status
                    .sandboxes
                    .iter()
                    .map(|s| s.pid.is_some())
                    .collect::<Vec<_>>(),
            );
            let asked = (after.0 - before.0, after.1 - before.1, after.2 - before.2);
            (pids, asked)
        };
        // (container pids, sandbox pids), (verbose ContainerStatus, verbose
        // PodSandboxStatus, status calls).
        let live_pids = (vec![true], vec![true]);
        assert_eq!(inspect().await, (live_pids.clone(), (1, 1, 2)), "first");
        assert_eq!(
            inspect().await,
            (live_pids.clone(), (0, 0, 2)),
            "remembered"
        );
        assert_eq!(inspect().await, (live_pids, (0, 0, 2)), "still remembered");
        pod.release("live");
        wait_container_status(&client, &live, "exited", |s| {
            s.state() == v1::ContainerState::ContainerExited
        })
        .await;
        assert_eq!(
            inspect().await,
            ((vec![false], vec![true]), (0, 0, 2)),
            "an exited container has no pid and is not asked verbose"
        );
    });
}

/// A verbose `PodSandboxStatus` asks the pod's shim (`task.Status`), which
/// answers only once a task it is creating exists (the runc shim holds its
/// lock through `runc create`, hooks included): a sandbox is not asked
/// verbose while a container of its pod is listed Created. A fidelity run
/// saw a relist batch of 22 pods held 1.7 s, and the workers behind it, by
/// such a call (issue #31). Here a `createContainer` hook holds the creation.
#[test]
fn a_sandbox_is_not_asked_verbose_while_its_pod_creates_a_task() {
    use evpleg_core::container::ContainerState;
    use evpleg_core::runtime::PodRuntime;
    use evpleg_cri::runtime::CriRuntime;
    use evpleg_tests::oci_hooks;
    let Some((containerd, pod, rt)) = pod_on_containerd(
        "a_sandbox_is_not_asked_verbose_while_its_pod_creates_a_task",
        "creating",
    ) else {
        return;
    };
    rt.block_on(async {
        let (icpt, client) = intercepted(&containerd).await;
        let sandbox = client
            .run_pod_sandbox(&pod.config, oci_hooks::HANDLER)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let id = client
            .create_container(&sandbox, &pod.waiting_container("app"), &pod.config)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let hold = oci_hooks::Hold::new(containerd.base()).expect("the hook's hold file");
        let start = tokio::spawn({
            let (client, id) = (client.clone(), id.clone());
            async move { client.start_container(&id).await }
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while !hold.entered() {
            assert!(
                Instant::now() < deadline,
                "the hook never waited on its hold"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let verbose = || {
            icpt.calls()
                .get("PodSandboxStatus verbose")
                .copied()
                .unwrap_or(0)
        };
        let runtime = CriRuntime::new(client.clone());
        let uid = pod.pod_uid();
        let status = tokio::time::timeout(Duration::from_secs(3), runtime.pod_status(&uid))
            .await
            .expect("the inspection does not wait for the task's creation")
            .expect("pod status");
        assert_eq!(
            (
                status
                    .containers
                    .iter()
                    .map(|c| c.state)
                    .collect::<Vec<_>>(),
                status.sandboxes.iter().map(|s| s.pid).collect::<Vec<_>>(),
                verbose()
            ),
            (vec![ContainerState::Created], vec![None], 0),
            "while the task is created: {status:?}"
        );
        hold.release();
        tokio::time::timeout(Duration::from_secs(20), start)
            .await
            .expect("StartContainer returns once the hook is released")
            .expect("the task")
            .unwrap_or_else(|e| panic!("{e}"));
        let status = runtime.pod_status(&uid).await.expect("pod status");
        assert_eq!(
            (
                status
                    .sandboxes
                    .iter()
                    .map(|s| s.pid.is_some())
                    .collect::<Vec<_>>(),
                verbose()
            ),
            (vec![true], 1),
            "then the sandbox's pid is learned: {status:?}"
        );
        pod.release("app");
    });
}

/// A verbose `PodSandboxStatus` that takes longer than
/// `SANDBOX_VERBOSE_WAIT` (its shim busy for another reason) is given up:
/// the sandbox is asked again without `verbose` and its pid learned later.
#[test]
fn a_slow_verbose_sandbox_status_is_asked_again_without_verbose() {
    use evpleg_core::runtime::PodRuntime;
    use evpleg_cri::runtime::{CriRuntime, SANDBOX_VERBOSE_WAIT};
    use evpleg_tests::cri_pod::{run_container, run_sandbox};
    let Some((containerd, pod, rt)) = pod_on_containerd(
        "a_slow_verbose_sandbox_status_is_asked_again_without_verbose",
        "slow-verbose",
    ) else {
        return;
    };
    rt.block_on(async {
        let (icpt, client) = intercepted(&containerd).await;
        let sandbox = run_sandbox(&client, &pod).await;
        run_container(&client, &pod, &sandbox, &pod.waiting_container("app")).await;
        icpt.pause("PodSandboxStatus verbose");
        let runtime = CriRuntime::new(client.clone());
        let uid = pod.pod_uid();
        let asked = Instant::now();
        let status = tokio::time::timeout(Duration::from_secs(3), runtime.pod_status(&uid))
            .await
            .expect("the inspection does not wait for the verbose answer")
            .expect("pod status");
        let took = asked.elapsed();
        assert!(took >= SANDBOX_VERBOSE_WAIT, "{took:?}");
        assert_eq!(
            (
                status.sandboxes.iter().map(|s| s.pid).collect::<Vec<_>>(),
                status
                    .containers
                    .iter()
                    .map(|c| c.pid.is_some())
                    .collect::<Vec<_>>()
            ),
            (vec![None], vec![true]),
            "{status:?}"
        );
        icpt.unhold("PodSandboxStatus verbose");
        let status = runtime.pod_status(&uid).await.expect("pod status");
        assert_eq!(
            status
                .sandboxes
                .iter()
                .map(|s| s.pid.is_some())
                .collect::<Vec<_>>(),
            vec![true],
            "learned at the next inspection: {status:?}"
        );
        pod.release("app");
    });
}

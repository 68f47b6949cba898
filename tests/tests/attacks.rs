//! Attacks by a pod author on the host, end to end (issue #24): the whole
//! agent against the real containerd. A second container of the pod swaps
//! the subPath's directory for a symlink to a host directory in a loop while
//! the victims' subPaths are mounted (CVE-2017-1002101's race): no victim
//! ever sees the host directory; a subPath through a symlink to a host
//! directory creates nothing there. An API pod whose volume and container
//! names are host paths is refused naming the fields, the host directory
//! untouched. Privileged: skipped with a reason without root/BTF/the eBPF
//! object, a failure under `CI=true`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use evpleg_kubelet::pod_workers::retry;
use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::{Value, json};

/// Victim containers per pod, and pods: each victim's start is one attempt.
const VICTIMS: usize = 8;
const PODS: usize = 4;

/// A victim whose subPath the race broke is refused, and its pod's sync is
/// retried after the kubelet's error back-off (10 s plus up to 5 s of
/// jitter): the wait for every victim of a pod is bounded by this many
/// retries of its pod, not by the usual minute (which held 4).
const RETRIES: u32 = 10;

async fn exec(e: &E2e, pod: &Value, name: &str, script: &str) -> (i32, String) {
    let id = container(pod, name)["containerID"]
        .as_str()
        .and_then(|s| s.split("://").nth(1))
        .unwrap_or_else(|| panic!("{name} has an id: {pod:#}"))
        .to_owned();
    let r = e
        .cri()
        .client()
        .await
        .exec_sync(&id, &["sh", "-c", script], Duration::from_secs(10))
        .await
        .unwrap_or_else(|err| panic!("exec {script:?}: {err}"));
    let mut out = String::from_utf8_lossy(&r.stdout).into_owned();
    out.push_str(&String::from_utf8_lossy(&r.stderr));
    (r.exit_code, out)
}

fn race_pod(name: &str, host: &Path) -> String {
    let host = host.display();
    let mut victims = String::new();
    for i in 0..VICTIMS {
        victims.push_str(&format!(
            "    - name: victim-{i}
      image: {IMAGE}
      command: [sh, -c, 'exec sleep 1000']
      volumeMounts:
        - name: shared
          mountPath: /mnt
          subPath: d
"
        ));
    }
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 1
  volumes:
    - name: shared
      emptyDir: {{}}
  initContainers:
    - name: attacker
      image: {IMAGE}
      restartPolicy: Always
      command: [sh, -c, 'mkdir -p /v/d && ln -s {host} /v/link; while :; do mv /v/d /v/d2; ln -s {host} /v/d; rm /v/d; mv /v/d2 /v/d; done']
      volumeMounts:
        - name: shared
          mountPath: /v
  containers:
{victims}"#
    )
}

fn running(p: &Value, name: &str) -> bool {
    container(p, name)["state"]["running"].is_object()
}

// The subPath swap race, PODS x VICTIMS attempts: every victim runs with the
// volume's own directory at /mnt, never the host directory; nothing is
// created in the host directory.
e2e_test!(a_subpath_swap_race_never_mounts_the_host, |e| Box::pin(
    async move {
        let host = e.cri().base().join("host-only");
        std::fs::create_dir_all(&host).unwrap();
        std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(host.join("HOST"), "host").unwrap();
        let started = Instant::now();
        for p in 0..PODS {
            e.write(
                &format!("race{p}.yaml"),
                &race_pod(&format!("race{p}"), &host),
            );
        }
        let victims: Vec<String> = (0..VICTIMS).map(|i| format!("victim-{i}")).collect();
        let mut checked = 0;
        for p in 0..PODS {
            let pod = e
                .wait_for_within(
                    &format!("race{p}"),
                    "every victim running",
                    retry::go_jitter(retry::BACK_OFF_PERIOD, retry::BACK_OFF_JITTER, 1.0) * RETRIES,
                    |pod| victims.iter().all(|v| running(pod, v)),
                )
                .await;
            for v in &victims {
                let script =
                    "if [ -e /mnt/HOST ]; then echo ESCAPED; ls -a /mnt; else echo safe; fi";
                let (code, out) = exec(e, &pod, v, script).await;
                assert_eq!(
                    (code, out.as_str()),
                    (0, "safe\n"),
                    "race{p}/{v}: the host directory is mounted"
                );
                checked += 1;
            }
        }
        let names: Vec<_> = std::fs::read_dir(&host)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["HOST"], "nothing created in the host directory");
        assert_eq!(
            std::fs::metadata(&host).unwrap().permissions().mode() & 0o7777,
            0o700
        );
        eprintln!(
            "{checked} victims started through the race in {:?}, none saw the host",
            started.elapsed()
        );
        for p in 0..PODS {
            e.remove(&format!("race{p}.yaml"));
        }
        for p in 0..PODS {
            e.wait_gone(&format!("race{p}")).await;
        }
    }
));

// A subPath through a symlink to a host directory (`link/new`): the
// container is refused (CreateContainerConfigError naming the subPath) and
// nothing is created in the host directory.
e2e_test!(
    an_intermediate_symlink_subpath_creates_nothing_on_the_host,
    |e| {
        Box::pin(async move {
            let host = e.cri().base().join("host-only-2");
            std::fs::create_dir_all(&host).unwrap();
            std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o700)).unwrap();
            let yaml = format!(
                r#"apiVersion: v1
kind: Pod
metadata:
  name: linked
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 1
  volumes:
    - name: shared
      emptyDir: {{}}
  initContainers:
    - name: linker
      image: {IMAGE}
      command: [sh, -c, 'ln -s {} /v/link']
      volumeMounts:
        - name: shared
          mountPath: /v
  containers:
    - name: victim
      image: {IMAGE}
      command: [sh, -c, 'exec sleep 1000']
      volumeMounts:
        - name: shared
          mountPath: /mnt
          subPath: link/new
"#,
                host.display()
            );
            e.write("linked.yaml", &yaml);
            let pod = e
                .wait_for("linked", "the victim refused", |p| {
                    container(p, "victim")["state"]["waiting"]["reason"]
                        == "CreateContainerConfigError"
                })
                .await;
            let message = container(&pod, "victim")["state"]["waiting"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(message.contains("not within volume path"), "{message}");
            assert_eq!(
                std::fs::read_dir(&host).unwrap().count(),
                0,
                "nothing created"
            );
            assert_eq!(
                std::fs::metadata(&host).unwrap().permissions().mode() & 0o7777,
                0o700
            );
            e.remove("linked.yaml");
            e.wait_gone("linked").await;
        })
    }
);

// An API pod (validated by no API server here) whose volume is named as a
// host directory and whose container is `../x`: refused at admission with
// InvalidPodSpec naming both fields; the host directory keeps its mode and
// content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_names_are_host_paths_is_refused() {
    if !evpleg_tests::privileged("a_pod_whose_names_are_host_paths_is_refused") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with("a_pod_whose_names_are_host_paths_is_refused", true, &[]).await;
    let host = e.cri().base().join("host-data");
    std::fs::create_dir_all(&host).unwrap();
    std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(host.join("keep"), "host").unwrap();
    let mut pod = api_pod("evil", "Never", "sleep 1000");
    let value = json!({
        "nodeName": NODE,
        "hostNetwork": true,
        "volumes": [{"name": host.display().to_string(), "emptyDir": {}}],
        "containers": [{"name": "../x", "image": IMAGE, "command": ["sh", "-c", "sleep 1000"],
            "volumeMounts": [{"name": host.display().to_string(), "mountPath": "/d"}]}]
    });
    pod.spec = Some(serde_json::from_value(value).unwrap());
    e.api().add_pod(pod);
    let pod = e
        .wait_api("evil", "refused", |p| {
            p.status.as_ref().and_then(|s| s.reason.as_deref()) == Some("InvalidPodSpec")
        })
        .await;
    let message = pod.status.and_then(|s| s.message).unwrap_or_default();
    for field in [
        "spec.volumes[0].name: Invalid value",
        "spec.containers[0].name: Invalid value: \"../x\"",
    ] {
        assert!(message.contains(field), "{field} in {message}");
    }
    assert_eq!(std::fs::read_to_string(host.join("keep")).unwrap(), "host");
    assert_eq!(
        std::fs::metadata(&host).unwrap().permissions().mode() & 0o7777,
        0o700
    );
    e.finish().await;
}

// `--pods-endpoint=false` (the kubelet's read-only port off): on the plain
// `--listen` listener `/pods` and a pod's events answer 404 while
// `/healthz` and `/metrics` are served; what is served beyond loopback is
// the kubelet server's (TLS, authenticated: `kubelet_api.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pods_endpoint_can_be_turned_off() {
    if !evpleg_tests::privileged("the_pods_endpoint_can_be_turned_off") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with(
        "the_pods_endpoint_can_be_turned_off",
        false,
        &["--pods-endpoint=false"],
    )
    .await;
    let status = |raw: &str| raw.lines().next().unwrap_or_default().to_owned();
    let addr = e.agent().addr;
    for path in ["/pods", "/pods/default/x-e2e/events"] {
        assert_eq!(
            status(&http_get(addr, path).await),
            "HTTP/1.1 404 Not Found",
            "{path}"
        );
    }
    for path in ["/healthz", "/metrics"] {
        assert_eq!(
            status(&http_get(addr, path).await),
            "HTTP/1.1 200 OK",
            "{path}"
        );
    }
    e.finish().await;
}

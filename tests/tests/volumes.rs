//! Volumes end to end (issue #14): the whole agent against the real
//! containerd, pods' volumes mounted by the volume manager before their
//! containers start and torn down after they stop. Static pods (no API
//! server): an emptyDir shared by two containers, a Memory emptyDir that is
//! a tmpfs of its sizeLimit, hostPath with subPath and readOnly, downwardAPI;
//! a hostPath whose type does not match is FailedMount and the pod waits in
//! ContainerCreating until it does; a configMap without an API server fails
//! naming the object; HostToContainer propagation shows a node mount made
//! after the container started. From the real kube-apiserver (read as
//! `system:node:e2e`, which the Node authorizer lets read only what its pods
//! use): configMap, secret and a projected volume with a service-account
//! token (TokenRequest, bound to the pod as NodeRestriction requires), a
//! changed configMap swapped into the running container atomically
//! (`..data`). Privileged: skipped with a reason without root/BTF/the eBPF
//! object (or the control plane's binaries), a failure under `CI=true`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::{Value, json};

async fn exec(e: &E2e, pod: &Value, container: &str, script: &str) -> (i32, String) {
    let id = container_id(pod, container);
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

/// Runs `script` in the container until its output is `want` (bounded).
async fn exec_until(e: &E2e, pod: &Value, container: &str, script: &str, want: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (code, out) = exec(e, pod, container, script).await;
        if code == 0 && out == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{container}: {script:?} gave {code} {out:?}, not {want:?}, within {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn container_id(pod: &Value, name: &str) -> String {
    container(pod, name)["containerID"]
        .as_str()
        .and_then(|s| s.split("://").nth(1))
        .unwrap_or_else(|| panic!("{name} has an id: {pod:#}"))
        .to_owned()
}

fn running(p: &Value, names: &[&str]) -> bool {
    names
        .iter()
        .all(|n| container(p, n)["state"]["running"].is_object())
}

fn uid(p: &Value) -> String {
    p["metadata"]["uid"].as_str().expect("uid").to_owned()
}

/// The mount points (and their file system types) of this process's view.
fn mounts_under(dir: &Path) -> Vec<(String, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    info.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            Some((f[4].to_owned(), f[sep + 1].to_owned()))
        })
        .filter(|(p, _)| Path::new(p).starts_with(dir))
        .collect()
}

/// Polls the pod's events until one has `reason` and a message holding
/// `needle`; returns that message.
async fn wait_event(e: &E2e, pod: &str, reason: &str, needle: &str) -> String {
    let name = format!("{pod}-{NODE}");
    let deadline = Instant::now() + DEADLINE;
    loop {
        let list = e.agent().events.event_list("default", &name);
        let found = list["items"].as_array().into_iter().flatten().find(|ev| {
            ev["reason"] == reason && ev["message"].as_str().is_some_and(|m| m.contains(needle))
        });
        if let Some(ev) = found {
            return ev["message"].as_str().unwrap_or_default().to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "{name}: no {reason} event with {needle:?} within {DEADLINE:?}: {list:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn static_pod(host_dir: &Path) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: vols
  labels:
    app: vols
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 2
  volumes:
    - name: shared
      emptyDir: {{}}
    - name: mem
      emptyDir:
        medium: Memory
        sizeLimit: 8Mi
    - name: host
      hostPath:
        path: {host}
        type: Directory
    - name: info
      downwardAPI:
        items:
          - path: name
            fieldRef:
              fieldPath: metadata.name
          - path: labels
            fieldRef:
              fieldPath: metadata.labels
  containers:
    - name: writer
      image: {IMAGE}
      command: [sh, -c, 'echo from-writer > /shared/msg && exec sleep 1000']
      volumeMounts:
        - name: shared
          mountPath: /shared
        - name: mem
          mountPath: /mem
    - name: reader
      image: {IMAGE}
      command: [sh, -c, 'exec sleep 1000']
      volumeMounts:
        - name: shared
          mountPath: /data
          readOnly: true
        - name: host
          mountPath: /host-sub
          subPath: sub
        - name: host
          mountPath: /host-ro
          readOnly: true
        - name: info
          mountPath: /etc/podinfo
        - name: host
          mountPath: /etc/hosts
          subPath: hosts
"#,
        host = host_dir.display()
    )
}

// emptyDir shared by two containers (one writes, the other reads it through
// a read-only mount); a Memory emptyDir is a tmpfs of its sizeLimit, in the
// container and on the node; hostPath's subPath and readOnly; a volume at
// /etc/hosts instead of the managed file; downwardAPI files. Once the pod is removed its volumes are torn down (the tmpfs
// unmounted, the pod's directory gone) and the hostPath is left as it was.
e2e_test!(
    empty_dir_host_path_and_downward_api_from_a_static_pod,
    |e| Box::pin(async move {
        let host = e.cri().base().join("host-vol");
        std::fs::create_dir_all(host.join("sub")).unwrap();
        std::fs::write(host.join("sub/f"), "in-sub").unwrap();
        std::fs::write(host.join("top"), "at-top").unwrap();
        std::fs::write(host.join("hosts"), "# the pod's own\n").unwrap();
        e.write("vols.yaml", &static_pod(&host));
        let p = e
            .wait_for("vols", "both containers running", |p| {
                running(p, &["writer", "reader"])
            })
            .await;
        // Shared: the writer's file seen by the reader, whose mount is read-only.
        exec_until(e, &p, "reader", "cat /data/msg", "from-writer\n").await;
        let (code, out) = exec(e, &p, "reader", "touch /data/other").await;
        assert_ne!(code, 0, "a readOnly mount refuses writes: {out}");
        assert!(out.contains("Read-only file system"), "{out}");
        // hostPath: the subPath only, writable; the whole path read-only.
        exec_until(e, &p, "reader", "cat /host-sub/f", "in-sub").await;
        exec_until(
            e,
            &p,
            "reader",
            "echo new > /host-sub/new && ls /host-sub",
            "f\nnew\n",
        )
        .await;
        assert_eq!(
            std::fs::read_to_string(host.join("sub/new")).unwrap(),
            "new\n"
        );
        exec_until(e, &p, "reader", "cat /host-ro/top", "at-top").await;
        let (code, _) = exec(e, &p, "reader", "touch /host-ro/x").await;
        assert_ne!(code, 0, "the readOnly hostPath mount refuses writes");
        assert!(!host.join("x").exists());
        // A volume mounted at /etc/hosts replaces the managed file.
        exec_until(e, &p, "reader", "cat /etc/hosts", "# the pod's own\n").await;
        exec_until(
            e,
            &p,
            "writer",
            "head -1 /etc/hosts",
            "# Kubernetes-managed hosts file (host network).\n",
        )
        .await;
        // downwardAPI.
        exec_until(e, &p, "reader", "cat /etc/podinfo/name", "vols-e2e").await;
        exec_until(e, &p, "reader", "cat /etc/podinfo/labels", "app=\"vols\"").await;
        // Memory: a tmpfs of 8 MiB in the container...
        let (code, out) = exec(e, &p, "writer", "grep ' /mem ' /proc/mounts").await;
        assert_eq!(code, 0, "{out}");
        assert!(
            out.starts_with("tmpfs /mem tmpfs ") && out.contains("size=8192k"),
            "{out}"
        );
        // ... and on the node, under the pod's volumes; the reader's two
        // subPaths are bind mounts under volume-subpaths/ (issue #24).
        let pod_dir = e.args.root_dir.join("pods").join(uid(&p));
        let mem = pod_dir.join("volumes/kubernetes.io~empty-dir/mem");
        let mut mounts: Vec<String> = mounts_under(&pod_dir).into_iter().map(|(m, _)| m).collect();
        mounts.sort();
        let binds = pod_dir.join("volume-subpaths/host/reader");
        assert_eq!(
            mounts,
            [binds.join("1"), binds.join("4"), mem.clone()].map(|p| p.display().to_string())
        );
        assert!(mounts_under(&pod_dir).contains(&(mem.display().to_string(), "tmpfs".to_owned())));
        assert!(
            pod_dir
                .join("volumes/kubernetes.io~empty-dir/shared/msg")
                .is_file()
        );
        // The volume manager's metrics: both emptyDirs mounted; set-ups timed.
        let metrics = http_get(e.agent().addr, "/metrics").await;
        for line in [
            "evpleg_volume_manager_total_volumes{plugin_name=\"kubernetes.io/empty-dir\",state=\"actual_state_of_world\"} 2",
            "evpleg_volume_manager_total_volumes{plugin_name=\"kubernetes.io/empty-dir\",state=\"desired_state_of_world\"} 2",
            "evpleg_volume_manager_total_volumes{plugin_name=\"kubernetes.io/host-path\",state=\"actual_state_of_world\"} 1",
        ] {
            assert!(metrics.contains(line), "{line} not in {metrics}");
        }
        assert!(
        metrics.contains("evpleg_storage_operation_duration_seconds_count{volume_plugin=\"kubernetes.io/empty-dir\",operation_name=\"volume_mount\",status=\"success\",migrated=\"false\"} 2"),
        "{metrics}"
    );
        // Removed: torn down after the containers stopped, before it is forgotten.
        e.remove("vols.yaml");
        e.wait_gone("vols").await;
        e.wait_until("the pod's directory removed", || !pod_dir.exists())
            .await;
        assert_eq!(mounts_under(&pod_dir), vec![], "the tmpfs is unmounted");
        assert_eq!(
            std::fs::read_to_string(host.join("sub/f")).unwrap(),
            "in-sub"
        );
    })
);

// A hostPath whose type does not match: the kubelet's FailedMount events
// (the plugin's error, then the sync's "Unable to attach or mount
// volumes"), the container waiting in ContainerCreating, no sandbox made.
// Once the path is what the type says, the reconciler's retry mounts it and
// the pod starts.
e2e_test!(host_path_type_mismatch_is_failed_mount_until_fixed, |e| {
    Box::pin(async move {
        let path = e.cri().base().join("not-a-dir");
        std::fs::write(&path, "a file").unwrap();
        let extra = format!(
            "  volumes:\n    - name: h\n      hostPath:\n        path: {}\n        type: Directory\n",
            path.display()
        );
        let mut yaml = manifest("hp", "Always", "exec sleep 1000", &extra);
        yaml.push_str("      volumeMounts:\n        - name: h\n          mountPath: /h\n");
        e.write("hp.yaml", &yaml);
        let message = wait_event(e, "hp", "FailedMount", "MountVolume.SetUp failed").await;
        assert_eq!(
            message,
            format!(
                "MountVolume.SetUp failed for volume \"h\" : hostPath type check failed: {} is not a directory",
                path.display()
            )
        );
        let message = wait_event(e, "hp", "FailedMount", "Unable to attach").await;
        assert_eq!(
            message,
            "Unable to attach or mount volumes: unmounted volumes=[h], unattached volumes=[], failed to process volumes=[]: timed out waiting for the condition"
        );
        let p = e
            .wait_for("hp", "waiting in ContainerCreating", |p| {
                container(p, "app")["state"]["waiting"]["reason"] == "ContainerCreating"
            })
            .await;
        assert_eq!(p["status"]["phase"], "Pending");
        assert!(
            e.sandboxes(&uid(&p)).await.is_empty(),
            "no sandbox before the volumes"
        );
        // Fixed: a directory there now.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("ok"), "ok").unwrap();
        let p = e
            .wait_for("hp", "running once the path is a directory", |p| {
                running(p, &["app"])
            })
            .await;
        exec_until(e, &p, "app", "cat /h/ok", "ok").await;
    })
});

// Without --kubeconfig a configMap volume cannot be read: FailedMount
// naming the object and the pod.
e2e_test!(config_map_without_an_api_server_fails_naming_it, |e| {
    Box::pin(async move {
        let extra = "  volumes:\n    - name: c\n      configMap:\n        name: settings\n";
        let mut yaml = manifest("nocfg", "Always", "exec sleep 1000", extra);
        yaml.push_str("      volumeMounts:\n        - name: c\n          mountPath: /c\n");
        e.write("nocfg.yaml", &yaml);
        let message = wait_event(e, "nocfg", "FailedMount", "MountVolume.SetUp failed").await;
        assert_eq!(
            message,
            "MountVolume.SetUp failed for volume \"c\" : configmap \"settings\" of pod default/nocfg-e2e: no API server to read it from (the agent runs without --kubeconfig)"
        );
    })
});

/// A directory made a shared mount point (a bind mount of itself), as a
/// node's `/` is under systemd; unmounted (with what is under it) when
/// dropped.
struct SharedDir(PathBuf);

fn mount(src: &str, target: &Path, fstype: Option<&str>, flags: libc::c_ulong) {
    use std::ffi::CString;
    let c = |s: &str| CString::new(s).unwrap();
    let (src, dst) = (c(src), c(target.to_str().unwrap()));
    let fstype = fstype.map(c);
    // SAFETY: NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            fstype.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
            flags,
            std::ptr::null(),
        )
    };
    assert_eq!(
        r,
        0,
        "mount {}: {}",
        target.display(),
        std::io::Error::last_os_error()
    );
}

impl SharedDir {
    fn new(path: PathBuf) -> Self {
        std::fs::create_dir_all(&path).unwrap();
        let src = path.to_str().unwrap().to_owned();
        mount(&src, &path, None, libc::MS_BIND);
        let dir = Self(path);
        mount("none", &dir.0, None, libc::MS_SHARED);
        dir
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        let c = std::ffi::CString::new(self.0.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path. A lazy unmount takes the submounts.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

// Mount propagation: a hostPath on a shared mount, mounted HostToContainer
// (rslave) and with the default (None, rprivate). A file system mounted on
// the node under it after the container started appears in the first mount
// only.
e2e_test!(host_to_container_propagation_shows_later_node_mounts, |e| {
    Box::pin(async move {
        let shared = SharedDir::new(e.cri().base().join("shared-prop"));
        let dir = shared.0.clone();
        std::fs::create_dir(dir.join("inner")).unwrap();
        let extra = format!(
            "  volumes:\n    - name: p\n      hostPath:\n        path: {}\n        type: Directory\n",
            dir.display()
        );
        let mut yaml = manifest("prop", "Always", "exec sleep 1000", &extra);
        yaml.push_str("      volumeMounts:\n        - name: p\n          mountPath: /prop\n          mountPropagation: HostToContainer\n        - name: p\n          mountPath: /noprop\n");
        e.write("prop.yaml", &yaml);
        let p = e
            .wait_for("prop", "running", |p| running(p, &["app"]))
            .await;
        mount("tmpfs", &dir.join("inner"), Some("tmpfs"), 0);
        std::fs::write(dir.join("inner/f"), "propagated").unwrap();
        exec_until(e, &p, "app", "cat /prop/inner/f", "propagated").await;
        let (code, out) = exec(e, &p, "app", "ls -A /noprop/inner").await;
        assert_eq!((code, out.as_str()), (0, ""), "no propagation without it");
        e.remove("prop.yaml");
        e.wait_gone("prop").await;
    })
});

fn data_target(dir: &Path) -> PathBuf {
    std::fs::read_link(dir.join("..data")).expect("..data is a symlink")
}

// configMap, secret and projected (service-account token, a configMap key,
// downwardAPI) volumes of a pod from the real API server; a changed configMap
// reaches the running container through the `..data` swap (a new
// timestamped directory, the old one removed, the user-visible names links
// through ..data); a subPath mount of a key keeps the content it had (as
// under the kubelet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_map_secret_and_token_from_the_api_server() {
    let name = "config_map_secret_and_token_from_the_api_server";
    if !evpleg_tests::privileged(name) || !evpleg_tests::control_plane::available(name) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let e = E2e::start_with_control_plane(name, &["--sync-frequency", "1s"]).await;
    let kube = e.kube().await;
    let config_maps: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(kube.clone(), "default");
    let cm = |a: &str| -> k8s_openapi::api::core::v1::ConfigMap {
        serde_json::from_value(json!({"metadata": {"name": "cfg", "namespace": "default"},
            "data": {"a": a, "b": "two"}}))
        .unwrap()
    };
    let post = kube::api::PostParams::default();
    config_maps
        .create(&post, &cm("one"))
        .await
        .expect("create cfg");
    let secret: k8s_openapi::api::core::v1::Secret =
        serde_json::from_value(json!({"metadata": {"name": "sec", "namespace": "default"},
            "data": {"password": "czNjcmV0"}}))
        .unwrap();
    kube::Api::namespaced(kube.clone(), "default")
        .create(&post, &secret)
        .await
        .expect("create sec");
    // No token automount: that volume's configMap kube-root-ca.crt is
    // published by kube-controller-manager, which the harness does not run.
    let account: k8s_openapi::api::core::v1::ServiceAccount = serde_json::from_value(
        json!({"metadata": {"name": "runner", "namespace": "default"},
            "automountServiceAccountToken": false}),
    )
    .unwrap();
    kube::Api::namespaced(kube.clone(), "default")
        .create(&post, &account)
        .await
        .expect("create the service account");
    let mut pod = api_pod("cfg-pod", "Always", "exec sleep 1000");
    let spec = pod.spec.as_mut().unwrap();
    spec.service_account_name = Some("runner".into());
    spec.volumes = Some(
        serde_json::from_value(json!([
            {"name": "cfg", "configMap": {"name": "cfg"}},
            {"name": "sec", "secret": {"secretName": "sec", "defaultMode": 0o400}},
            {"name": "proj", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token", "audience": "vault", "expirationSeconds": 3600}},
                {"configMap": {"name": "cfg", "items": [{"key": "b", "path": "cfg/b"}]}},
                {"downwardAPI": {"items": [{"path": "uid", "fieldRef": {"fieldPath": "metadata.uid"}}]}}
            ]}}
        ]))
        .unwrap(),
    );
    spec.containers[0].volume_mounts = Some(
        serde_json::from_value(json!([
            {"name": "cfg", "mountPath": "/cfg"},
            {"name": "cfg", "mountPath": "/sub-a", "subPath": "a"},
            {"name": "sec", "mountPath": "/sec"},
            {"name": "proj", "mountPath": "/proj"}
        ]))
        .unwrap(),
    );
    let stored = e.create_pod(&pod).await;
    let pod_uid = stored.metadata.uid.clone().unwrap();
    e.wait_api("cfg-pod", "running", |p| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            })
    })
    .await;
    let p = serde_json::to_value(
        e.wait_real("default", "cfg-pod", "present", |p| p.is_some())
            .await
            .unwrap(),
    )
    .unwrap();
    exec_until(&e, &p, "app", "cat /cfg/a /cfg/b", "onetwo").await;
    exec_until(&e, &p, "app", "cat /sub-a", "one").await;
    exec_until(
        &e,
        &p,
        "app",
        "cat /sec/password; stat -L -c %a /sec/password",
        "s3cret400\n",
    )
    .await;
    let (code, out) = exec(&e, &p, "app", "touch /cfg/x").await;
    assert_ne!(code, 0, "configMap volumes are read-only: {out}");
    exec_until(&e, &p, "app", "cat /proj/cfg/b", "two").await;
    exec_until(&e, &p, "app", "cat /proj/uid", &pod_uid).await;
    // The token: requested once, as the node, bound to the pod, with the
    // audience.
    let (_, token) = exec(&e, &p, "app", "cat /proj/token").await;
    let requests: Vec<_> = e
        .cp()
        .audit()
        .into_iter()
        .filter(|r| r.verb == "create" && r.path().ends_with("/token"))
        .collect();
    assert_eq!(
        requests.len(),
        1,
        "one TokenRequest (then cached): {requests:#?}"
    );
    let request = &requests[0];
    assert_eq!(
        (request.user.as_str(), request.path(), request.code),
        (
            format!("system:node:{NODE}").as_str(),
            "/api/v1/namespaces/default/serviceaccounts/runner/token",
            201
        )
    );
    let spec = &request.body.as_ref().expect("the TokenRequest")["spec"];
    assert_eq!(spec["audiences"], json!(["vault"]));
    assert_eq!(spec["expirationSeconds"], 3600);
    let bound = &spec["boundObjectRef"];
    assert_eq!(
        (&bound["kind"], &bound["name"], &bound["uid"]),
        (&json!("Pod"), &json!("cfg-pod"), &json!(pod_uid))
    );
    let claims = token.split('.').nth(1).expect("a JWT");
    let claims: Value = serde_json::from_slice(
        &evpleg_tests::fake_apiserver::objects::base64url_decode(claims).unwrap(),
    )
    .unwrap();
    assert_eq!(claims["aud"], json!(["vault"]));
    assert_eq!(claims["sub"], "system:serviceaccount:default:runner");
    assert_eq!(claims["kubernetes.io"]["pod"]["uid"], pod_uid);

    // The update: swapped in atomically.
    let dir = e.args.root_dir.join(format!(
        "pods/{pod_uid}/volumes/kubernetes.io~configmap/cfg"
    ));
    let before = data_target(&dir);
    assert_eq!(
        std::fs::read_link(dir.join("a")).unwrap(),
        Path::new("..data/a")
    );
    config_maps
        .replace("cfg", &post, &{
            let mut next = cm("uno");
            next.metadata.resource_version = config_maps
                .get("cfg")
                .await
                .expect("cfg")
                .metadata
                .resource_version;
            next
        })
        .await
        .expect("update cfg");
    exec_until(&e, &p, "app", "cat /cfg/a /cfg/b", "unotwo").await;
    let after = data_target(&dir);
    assert_ne!(before, after, "a new payload directory behind ..data");
    assert!(
        !dir.join(&before).exists(),
        "the old payload directory is removed"
    );
    assert_eq!(
        std::fs::read_link(dir.join("a")).unwrap(),
        Path::new("..data/a")
    );
    // A subPath mount keeps what it had, as under the kubelet.
    exec_until(&e, &p, "app", "cat /sub-a", "one").await;
    e.finish().await;
}

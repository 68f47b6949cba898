//! Security contexts, ports and admission end to end (issue #10): the whole
//! agent against the real containerd, pods from static manifests. What a
//! security context asks for is read back from the container's main process
//! in `/proc` (user, groups, capabilities, no_new_privs, seccomp, the root
//! mount), so the test sees what runc really did. Privileged: skipped with a
//! reason without root/BTF/the eBPF object, a failure under `CI=true`.

use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::Value;

/// The fields of `/proc/<pid>/status` named `key`.
fn proc_status(pid: i32, key: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether the process's root filesystem is mounted read-only.
fn root_read_only(pid: i32) -> bool {
    let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    let root = info
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/"))
        .expect("a root mount");
    root.split_whitespace()
        .nth(5)
        .is_some_and(|opts| opts.split(',').any(|o| o == "ro"))
}

fn container_pid(pod: &Value, name: &str) -> i32 {
    let id = container(pod, name)["containerID"]
        .as_str()
        .and_then(|id| id.split("://").nth(1))
        .expect("a containerID")
        .to_owned();
    find_container_pid(&id).unwrap_or_else(|| panic!("no main process for container {name}"))
}

const SECURED: &str = "apiVersion: v1
kind: Pod
metadata:
  name: secured
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 2
  securityContext:
    runAsUser: 1000
    runAsGroup: 3000
    supplementalGroups: [4000]
    fsGroup: 5000
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: locked
      image: localhost/busybox:local
      command: [sleep, '600']
      securityContext:
        readOnlyRootFilesystem: true
        allowPrivilegeEscalation: false
        capabilities:
          drop: [ALL]
          add: [NET_BIND_SERVICE]
    - name: root
      image: localhost/busybox:local
      command: [sleep, '600']
      securityContext:
        runAsUser: 0
        privileged: true
        seccompProfile:
          type: Unconfined
";

// The pod's user, groups and seccomp profile, and each container's own
// settings, reach the container's process.
e2e_test!(security_contexts_reach_the_container_processes, |e| {
    Box::pin(async move {
        e.write("secured.yaml", SECURED);
        let running = |p: &Value, c: &str| container(p, c)["state"]["running"].is_object();
        let pod = e
            .wait_for("secured", "both containers running", |p| {
                running(p, "locked") && running(p, "root")
            })
            .await;
        let locked = container_pid(&pod, "locked");
        assert_eq!(proc_status(locked, "Uid"), "1000 1000 1000 1000");
        assert_eq!(proc_status(locked, "Gid"), "3000 3000 3000 3000");
        let groups = proc_status(locked, "Groups");
        assert!(
            groups.split(' ').any(|g| g == "4000") && groups.split(' ').any(|g| g == "5000"),
            "supplemental groups and fsGroup: {groups}"
        );
        // Only CAP_NET_BIND_SERVICE (10) is left in the bounding set; a
        // non-root user has no effective capabilities.
        assert_eq!(
            proc_status(locked, "CapBnd"),
            format!("{:016x}", 1u64 << 10)
        );
        assert_eq!(proc_status(locked, "NoNewPrivs"), "1");
        assert_eq!(proc_status(locked, "Seccomp"), "2", "RuntimeDefault filter");
        assert!(root_read_only(locked), "readOnlyRootFilesystem");

        let root = container_pid(&pod, "root");
        assert_eq!(proc_status(root, "Uid"), "0 0 0 0");
        assert_eq!(proc_status(root, "Seccomp"), "0", "Unconfined");
        assert_eq!(proc_status(root, "NoNewPrivs"), "0");
        assert!(!root_read_only(root));
        // Privileged: every capability this (root) test process has.
        let own = proc_status(std::process::id() as i32, "CapBnd");
        assert_eq!(proc_status(root, "CapEff"), own, "privileged");
        e.remove("secured.yaml");
        e.wait_gone("secured").await;
    })
});

// runAsNonRoot with an image that runs as root: the container is not
// created, its waiting reason says why (the kubelet's verifyRunAsNonRoot).
e2e_test!(run_as_non_root_refuses_an_image_running_as_root, |e| {
    Box::pin(async move {
        e.write(
            "nonroot.yaml",
            &manifest(
                "nonroot",
                "Always",
                "sleep 600",
                "  securityContext:\n    runAsNonRoot: true\n",
            ),
        );
        let pod = e
            .wait_for("nonroot", "CreateContainerConfigError", |p| {
                container(p, "app")["state"]["waiting"]["reason"] == "CreateContainerConfigError"
            })
            .await;
        let message = container(&pod, "app")["state"]["waiting"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            message.starts_with("container has runAsNonRoot and image will run as root")
                && message.contains("container: app"),
            "{message}"
        );
        let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
        let containers = e
            .cri()
            .client()
            .await
            .list_containers(None)
            .await
            .expect("ListContainers");
        assert!(
            !containers
                .iter()
                .any(|c| c.labels.get(evpleg_core::labels::POD_UID) == Some(&uid)),
            "no container was created: {containers:?}"
        );
    })
});

// A pod using a field the agent does not implement is refused at admission,
// the field named, nothing created in the runtime; a host port already held
// refuses the second pod asking for it (NodePorts); the port mappings reach
// the sandbox's config.
e2e_test!(
    admission_refuses_unimplemented_fields_and_taken_host_ports,
    |e| {
        Box::pin(async move {
            e.write(
            "probed.yaml",
            &manifest("probed", "Always", "sleep 600", "").replace(
                "command: [\"sh\", \"-c\", \"sleep 600\"]",
                "command: [\"sh\", \"-c\", \"sleep 600\"]\n      lifecycle:\n        stopSignal: SIGUSR1",
            ),
        );
            let pod = e
                .wait_for("probed", "rejected", |p| p["status"]["phase"] == "Failed")
                .await;
            assert_eq!(pod["status"]["reason"], "UnsupportedPodSpec", "{pod:#}");
            assert_eq!(
                pod["status"]["message"],
                "Pod was rejected: evpleg does not implement spec.containers[app].lifecycle.stopSignal yet"
            );
            let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
            assert_eq!(
                e.run_pod_sandbox_calls(&uid),
                0,
                "no sandbox for a rejected pod"
            );

            let ports = |name: &str| {
                manifest(name, "Always", "sleep 600", "").replace(
                "      image:",
                "      ports:\n        - containerPort: 18080\n        - containerPort: 18053\n          protocol: UDP\n      image:",
            )
            };
            e.write("web1.yaml", &ports("web1"));
            let web1 = e
                .wait_for("web1", "running", |p| {
                    container(p, "app")["state"]["running"].is_object()
                })
                .await;
            e.write("web2.yaml", &ports("web2"));
            let web2 = e
                .wait_for("web2", "rejected", |p| p["status"]["phase"] == "Failed")
                .await;
            assert_eq!(web2["status"]["reason"], "NodePorts", "{web2:#}");

            let uid1 = web1["metadata"]["uid"].as_str().expect("uid");
            let sandbox = e.sandboxes(uid1).await.remove(0);
            let status = e
                .cri()
                .client()
                .await
                .pod_sandbox_status(&sandbox.id, true)
                .await
                .expect("PodSandboxStatus");
            let info: Value =
                serde_json::from_str(status.info.get("info").expect("verbose info")).expect("json");
            let mappings = &info["config"]["port_mappings"];
            let pairs: Vec<_> = mappings
                .as_array()
                .expect("port mappings in the sandbox config")
                .iter()
                .map(|m| {
                    (
                        m["container_port"].as_i64(),
                        m["host_port"].as_i64(),
                        m["protocol"].as_i64().unwrap_or(0),
                    )
                })
                .collect();
            assert_eq!(
                pairs,
                [(Some(18080), Some(18080), 0), (Some(18053), Some(18053), 1)],
                "{mappings:#}"
            );
            // Once web1 is gone its port is free: web2 is refused for good (a
            // rejected pod is not admitted again), a new pod gets the port.
            e.remove("web1.yaml");
            e.wait_gone("web1").await;
            e.write("web3.yaml", &ports("web3"));
            e.wait_for("web3", "running", |p| {
                container(p, "app")["state"]["running"].is_object()
            })
            .await;
        })
    }
);

//! What workloads notice (issue #27), end to end against the real
//! containerd: a container's environment (`$(VAR)` expansion in env and
//! command, `fieldRef`, `resourceFieldRef`), its termination message
//! written to `/dev/termination-log` and shown in its terminated state, its
//! `oom_score_adj` as the kubelet's Burstable formula (read by the
//! container's own process from `/proc/self/oom_score_adj`), and
//! `activeDeadlineSeconds` failing the pod with `DeadlineExceeded` and
//! killing its container. Privileged: skipped with a reason without root.

use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;

fn env_pod() -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: envpod
spec:
  hostNetwork: true
  restartPolicy: Never
  containers:
    - name: app
      image: {IMAGE}
      env:
        - name: A
          value: a
        - name: B
          value: $(A)-b
        - name: NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: MEM
          valueFrom:
            resourceFieldRef:
              resource: requests.memory
              divisor: 1Mi
      resources:
        requests:
          memory: 64Mi
      command: ["sh", "-c", "echo \"$B $NAME $MEM $(A)-cmd\" > /dev/termination-log; cat /proc/self/oom_score_adj >> /dev/termination-log; exit 3"]
"#
    )
}

e2e_test!(
    environment_termination_message_and_oom_score_reach_the_container,
    |e| {
        Box::pin(async move {
            e.write("envpod.yaml", &env_pod());
            let pod = e
                .wait_for("envpod", "terminated", |p| {
                    container(p, "app")["state"]["terminated"].is_object()
                })
                .await;
            let terminated = &container(&pod, "app")["state"]["terminated"];
            assert_eq!(terminated["exitCode"], 3, "{pod:#}");
            let memory = evpleg_core::machine::memory_bytes();
            let oom = 1000 - 1000 * (64 << 20) / memory;
            assert_eq!(
                terminated["message"],
                format!("a-b envpod-{NODE} 64 a-cmd\n{oom}\n"),
                "{pod:#}"
            );
        })
    }
);

e2e_test!(active_deadline_fails_the_pod_and_kills_its_container, |e| {
    Box::pin(async move {
        e.write(
            "deadline.yaml",
            &manifest(
                "deadline",
                "Always",
                "sleep 600",
                "  activeDeadlineSeconds: 3\n",
            ),
        );
        let pod = e
            .wait_for("deadline", "failed", |p| {
                p["status"]["phase"] == "Failed"
                    && container(p, "app")["state"]["terminated"].is_object()
            })
            .await;
        assert_eq!(pod["status"]["reason"], "DeadlineExceeded", "{pod:#}");
        assert_eq!(
            pod["status"]["message"],
            "Pod was active on the node longer than the specified deadline"
        );
    })
});

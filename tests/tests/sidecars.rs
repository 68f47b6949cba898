//! Sidecar containers end to end (issue #10; the kubelet's restartable init
//! containers, KEP-753): the whole agent against the real containerd, pods
//! from static manifests, every status written observed through the local
//! store. Privileged: skipped with a reason without root/BTF/the eBPF object,
//! a failure under `CI=true`.

use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::Value;

/// A pod with a sidecar `side`, a plain init container `init` and an app
/// container `app` running `app_command`; the sidecar exits at once on
/// SIGTERM, so its finish time tells when it was stopped.
fn pod(name: &str, policy: &str, app_command: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  hostNetwork: true
  restartPolicy: {policy}
  terminationGracePeriodSeconds: 6
  initContainers:
    - name: side
      image: localhost/busybox:local
      restartPolicy: Always
      command: [sh, -c, \"trap 'exit 0' TERM; while true; do sleep 0.1; done\"]
    - name: init
      image: localhost/busybox:local
      command: [sh, -c, 'exit 0']
  containers:
    - name: app
      image: localhost/busybox:local
      command: [sh, -c, \"{app_command}\"]
"
    )
}

fn running(pod: &Value, name: &str) -> bool {
    container(pod, name)["state"]["running"].is_object()
}

fn condition(pod: &Value, kind: &str) -> String {
    pod["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == kind))
        .map(|c| c["status"].as_str().unwrap_or_default().to_owned())
        .unwrap_or_default()
}

fn finished_at(pod: &Value, name: &str) -> String {
    container(pod, name)["state"]["terminated"]["finishedAt"]
        .as_str()
        .unwrap_or_else(|| panic!("{name} terminated: {pod:#}"))
        .to_owned()
}

// The sidecar starts first and keeps running next to the app; the init
// container starts only once the sidecar runs; a sidecar that dies is
// restarted without touching the app; at deletion the sidecar is stopped
// after the app container has finished.
e2e_test!(a_sidecar_runs_beside_the_app_and_stops_after_it, |e| {
    Box::pin(async move {
        let mut history = History::new(e, "sidecar");
        // On SIGTERM the app takes 2.5 s to exit: stopped in parallel, the
        // sidecar would finish seconds before it.
        e.write(
            "sidecar.yaml",
            &pod(
                "sidecar",
                "Always",
                "trap 'sleep 2.5; exit 0' TERM; while true; do sleep 0.1; done",
            ),
        );
        let pod = history
            .until("the app and the sidecar running", |p| {
                running(p, "app") && running(p, "side")
            })
            .await;
        assert_eq!(pod["status"]["phase"], "Running", "{pod:#}");
        assert_eq!(condition(&pod, "Initialized"), "True");
        assert_eq!(condition(&pod, "ContainersReady"), "True");
        assert_eq!(
            container(&pod, "init")["state"]["terminated"]["exitCode"],
            0
        );
        // Every status written while the init container ran had the sidecar
        // running.
        for p in &history.seen {
            if container(p, "init")["containerID"].is_string() {
                assert!(
                    running(p, "side") || container(p, "side")["restartCount"] != 0,
                    "the init container started before the sidecar ran: {p:#}"
                );
            }
        }
        // The sidecar dies: it is restarted, the app is left alone.
        let app_id = container(&pod, "app")["containerID"].clone();
        let side_id = container(&pod, "side")["containerID"]
            .as_str()
            .and_then(|id| id.split("://").nth(1))
            .expect("sidecar id")
            .to_owned();
        let pid = find_container_pid(&side_id).expect("the sidecar's process");
        // SAFETY: a plain signal to our own test container's process.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        let pod = history
            .until("the sidecar restarted", |p| {
                running(p, "side") && container(p, "side")["restartCount"] == 1
            })
            .await;
        assert_eq!(container(&pod, "app")["containerID"], app_id);
        assert_eq!(container(&pod, "app")["restartCount"], 0);

        e.remove("sidecar.yaml");
        e.wait_gone("sidecar").await;
        history.drain();
        let last = history.seen.last().expect("statuses").clone();
        let (app, side) = (finished_at(&last, "app"), finished_at(&last, "side"));
        assert!(
            side >= app,
            "the sidecar finished at {side}, before the app at {app}: {last:#}"
        );
    })
});

// Under restartPolicy Never the pod ends when its app container ends: the
// still-running sidecar is stopped and its exit does not decide the phase;
// the phase is Succeeded only once it stopped.
e2e_test!(a_job_with_a_sidecar_succeeds_when_its_app_does, |e| {
    Box::pin(async move {
        let mut history = History::new(e, "job");
        e.write("job.yaml", &pod("job", "Never", "sleep 1; exit 0"));
        let pod = history
            .until("Succeeded", |p| p["status"]["phase"] == "Succeeded")
            .await;
        assert_eq!(container(&pod, "app")["state"]["terminated"]["exitCode"], 0);
        // Issue #27 item 3: the first Succeeded status comes once the sidecar
        // stopped (it was published while the sidecar still ran).
        assert!(
            container(&pod, "side")["state"]["terminated"].is_object(),
            "Succeeded while the sidecar still ran: {pod:#}"
        );
        // The sidecar was stopped by the agent, not left running.
        let pod = history
            .until("the sidecar terminated", |p| {
                container(p, "side")["state"]["terminated"].is_object()
            })
            .await;
        assert_eq!(pod["status"]["phase"], "Succeeded", "{pod:#}");
        let uid = pod["metadata"]["uid"].as_str().expect("uid").to_owned();
        e.wait_until("no container of the pod running", || {
            let running = std::fs::read_dir("/proc")
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|p| std::fs::read_to_string(p.path().join("cgroup")).ok())
                .any(|cg| cg.contains(&format!("pod{uid}")));
            !running
        })
        .await;
    })
});

// The kubelet's killContainer with its termination ordering: at the pod's
// termination a sidecar runs its preStop hook at once, beside the app
// containers' stop, and only then waits for its turn to be stopped.
e2e_test!(a_sidecar_s_pre_stop_runs_before_it_waits_for_the_app, |e| {
    Box::pin(async move {
        let yaml = "apiVersion: v1
kind: Pod
metadata:
  name: prestop
spec:
  hostNetwork: true
  terminationGracePeriodSeconds: 10
  initContainers:
    - name: side
      image: localhost/busybox:local
      restartPolicy: Always
      command: [sh, -c, \"trap 'exit 0' TERM; while true; do sleep 0.1; done\"]
      lifecycle:
        preStop:
          exec:
            command: [sh, -c, 'echo side-prestop > /proc/1/fd/1']
  containers:
    - name: app
      image: localhost/busybox:local
      command: [sh, -c, \"trap 'sleep 3; echo app-exit; exit 0' TERM; echo app-up; while true; do sleep 0.1; done\"]
";
        let mut history = History::new(e, "prestop");
        e.write("prestop.yaml", yaml);
        let pod = history
            .until("the app and the sidecar running", |p| {
                running(p, "app") && running(p, "side")
            })
            .await;
        e.wait_until("the app logged its start", || {
            logged_at(&e.log_lines(&pod, "app"), "app-up").is_some()
        })
        .await;
        e.remove("prestop.yaml");
        e.wait_until("the sidecar's preStop and the app's exit logged", || {
            logged_at(&e.log_lines(&pod, "side"), "side-prestop").is_some()
                && logged_at(&e.log_lines(&pod, "app"), "app-exit").is_some()
        })
        .await;
        let pre_stop = logged_at(&e.log_lines(&pod, "side"), "side-prestop").expect("logged");
        let app_exit = logged_at(&e.log_lines(&pod, "app"), "app-exit").expect("logged");
        eprintln!(
            "the sidecar's preStop ran {:.2} s before the app exited",
            app_exit - pre_stop
        );
        assert!(
            pre_stop < app_exit - 1.0,
            "the sidecar's preStop ran at {pre_stop:.2}, the app exited at {app_exit:.2} (3 s after its SIGTERM)"
        );
    })
});

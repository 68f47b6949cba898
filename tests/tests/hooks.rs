//! Lifecycle hooks end to end (issue #13; the kubelet's postStart and preStop):
//! the whole agent against the real containerd. preStop timing is read from
//! the container's own log: the hook and the SIGTERM trap write to the main
//! process's stdout, and the runtime stamps every log line. Privileged:
//! skipped with a reason without root/BTF/the eBPF object, a failure under
//! `CI=true`.

use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::Value;

fn pod(name: &str, grace: u32, lifecycle: &str, command: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  hostNetwork: true\n  terminationGracePeriodSeconds: {grace}\n  containers:\n    - name: app\n      image: {IMAGE}\n      command: [sh, -c, \"{command}\"]\n      lifecycle:\n{lifecycle}"
    )
}

/// The main process: says when it got SIGTERM, then exits.
const TRAPS_TERM: &str =
    "trap 'echo term; exit 0' TERM; echo started; while true; do sleep 0.1; done";

/// (Unix seconds, text) of the container's log lines.
fn log_lines(e: &E2e, pod: &Value) -> Vec<(f64, String)> {
    let meta = &pod["metadata"];
    let dir = e.cri().base().join("pod-logs").join(format!(
        "{}_{}_{}",
        meta["namespace"].as_str().unwrap_or("default"),
        meta["name"].as_str().unwrap_or_default(),
        meta["uid"].as_str().unwrap_or_default()
    ));
    let text = std::fs::read_to_string(dir.join("app/0.log")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut parts = l.splitn(4, ' ');
            let ts: k8s_openapi::jiff::Timestamp = parts.next()?.parse().ok()?;
            let text = parts.nth(2)?.to_owned();
            Some((ts.as_nanosecond() as f64 / 1e9, text))
        })
        .collect()
}

fn at(lines: &[(f64, String)], text: &str) -> Option<f64> {
    lines.iter().find(|(_, t)| t == text).map(|(ts, _)| *ts)
}

// A postStart hook runs after the start; one that fails kills the container,
// which restarts with PostStartHookError as its last start error.
e2e_test!(post_start_runs_and_its_failure_kills_and_restarts, |e| {
    Box::pin(async move {
        e.write(
            "poststart.yaml",
            &pod(
                "poststart",
                2,
                "        postStart:\n          exec:\n            command: [sh, -c, 'echo hooked > /tmp/hooked']\n",
                "exec sleep 1000",
            ),
        );
        let p = e
            .wait_for("poststart", "running", |p| {
                container(p, "app")["state"]["running"].is_object()
            })
            .await;
        let id = container(&p, "app")["containerID"]
            .as_str()
            .unwrap()
            .split("://")
            .nth(1)
            .unwrap()
            .to_owned();
        let pid = find_container_pid(&id).expect("main process");
        let hooked = std::fs::read_to_string(format!("/proc/{pid}/root/tmp/hooked"));
        assert_eq!(
            hooked.ok().as_deref(),
            Some("hooked\n"),
            "the hook ran in the container"
        );

        e.write(
            "failing.yaml",
            &pod(
                "failing",
                2,
                "        postStart:\n          exec:\n            command: [sh, -c, 'exit 3']\n",
                "exec sleep 1000",
            ),
        );
        let p = e
            .wait_for("failing", "killed and restarted", |p| {
                container(p, "app")["restartCount"].as_i64() >= Some(1)
            })
            .await;
        assert!(
            container(&p, "app")["lastState"]["terminated"].is_object(),
            "{p:#}"
        );
    })
});

/// Runs a pod whose preStop hook logs "prestop" and sleeps `hook_seconds`,
/// removes it once it runs, and returns how long after the hook began the
/// main process logged SIGTERM, with the log.
async fn sigterm_after_pre_stop(
    e: &E2e,
    name: &str,
    grace: u32,
    hook_seconds: u32,
) -> (f64, Vec<(f64, String)>) {
    let file = format!("{name}.yaml");
    let hook = format!(
        "        preStop:\n          exec:\n            command: [sh, -c, 'echo prestop > /proc/1/fd/1; sleep {hook_seconds}']\n"
    );
    e.write(&file, &pod(name, grace, &hook, TRAPS_TERM));
    let p = e
        .wait_for(name, "running", |p| {
            container(p, "app")["state"]["running"].is_object()
        })
        .await;
    e.wait_until("the container logged its start", || {
        at(&log_lines(e, &p), "started").is_some()
    })
    .await;
    e.remove(&file);
    e.wait_until("the container logged SIGTERM", || {
        at(&log_lines(e, &p), "term").is_some()
    })
    .await;
    let lines = log_lines(e, &p);
    let pre = at(&lines, "prestop").expect("prestop logged");
    let term = at(&lines, "term").expect("term logged");
    eprintln!(
        "{name}: a {hook_seconds} s preStop began, SIGTERM {:.2} s later (grace {grace} s)",
        term - pre
    );
    (term - pre, lines)
}

// preStop runs before SIGTERM and its time is taken from the grace period.
e2e_test!(pre_stop_runs_before_sigterm_within_the_grace_period, |e| {
    Box::pin(async move {
        let (after, lines) = sigterm_after_pre_stop(e, "prestop", 10, 2).await;
        assert!(
            (1.9..5.0).contains(&after),
            "SIGTERM {after:.2} s after the preStop hook began (it sleeps 2 s): {lines:?}"
        );
    })
});

// A preStop hook longer than the grace period is cut at the grace period;
// the container then gets SIGTERM with the 2 s minimum.
e2e_test!(a_pre_stop_longer_than_the_grace_period_is_cut, |e| {
    Box::pin(async move {
        let (after, lines) = sigterm_after_pre_stop(e, "longstop", 3, 60).await;
        assert!(
            (2.5..6.0).contains(&after),
            "SIGTERM {after:.2} s after a 60 s preStop began, with a 3 s grace period: {lines:?}"
        );
    })
});

//! Lifecycle hooks end to end (issue #13; the kubelet's postStart and preStop):
//! the whole agent against the real containerd. preStop timing is read from
//! the container's own log: the hook and the SIGTERM trap write to the main
//! process's stdout, and the runtime stamps every log line. Privileged:
//! skipped with a reason without root/BTF/the eBPF object, a failure under
//! `CI=true`.

use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;

fn pod(name: &str, grace: u32, lifecycle: &str, command: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  hostNetwork: true\n  terminationGracePeriodSeconds: {grace}\n  containers:\n    - name: app\n      image: {IMAGE}\n      command: [sh, -c, \"{command}\"]\n      lifecycle:\n{lifecycle}"
    )
}

/// The main process: says when it got SIGTERM, then exits.
const TRAPS_TERM: &str =
    "trap 'echo term; exit 0' TERM; echo started; while true; do sleep 0.1; done";

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
                "        postStart:\n          exec:\n            command: [sh, -c, 'echo s3cret-token; exit 3']\n",
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
        // The event says only "PostStartHook failed": the hook's output may
        // hold secrets (the kubelet's startContainer).
        let path = format!("/pods/default/failing-{NODE}/events");
        let deadline = std::time::Instant::now() + DEADLINE;
        let events = loop {
            let events = http_get(e.agent().addr, &path).await;
            if events.contains("FailedPostStartHook") {
                break events;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no FailedPostStartHook within {DEADLINE:?}: {events}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        assert!(events.contains("PostStartHook failed"), "{events}");
        assert!(!events.contains("s3cret-token"), "{events}");
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
        logged_at(&e.log_lines(&p, "app"), "started").is_some()
    })
    .await;
    e.remove(&file);
    e.wait_until("the container logged SIGTERM", || {
        logged_at(&e.log_lines(&p, "app"), "term").is_some()
    })
    .await;
    let lines = e.log_lines(&p, "app");
    let pre = logged_at(&lines, "prestop").expect("prestop logged");
    let term = logged_at(&lines, "term").expect("term logged");
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

// An HTTPS httpGet postStart hook answered in plain http, as the kubelet's
// `runHTTPHandler`: asked again over http without its Authorization header,
// a `LifecycleHTTPFallback` warning on the pod, and the hook succeeds though
// the answer is a 500 (a hook's status is not looked at). The plain server is
// in this test process, on the host network the pod shares.
e2e_test!(an_https_hook_answered_in_plain_http_falls_back, |e| {
    Box::pin(async move {
        use std::sync::{Arc, Mutex};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind the plain server");
        let web = listener.local_addr().expect("its address").port();
        let seen = Arc::new(Mutex::new(Vec::<Vec<u8>>::new()));
        let kept = seen.clone();
        let server = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut first = vec![0u8; 4096];
                let n = s.read(&mut first).await.unwrap_or(0);
                kept.lock().unwrap().push(first[..n].to_vec());
                let _ = s
                    .write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n")
                    .await;
                let _ = s.shutdown().await;
                // Until the client closes: no unread byte turns the close
                // into a reset.
                let mut rest = [0u8; 1024];
                while matches!(s.read(&mut rest).await, Ok(n) if n > 0) {}
            }
        });
        e.write(
            "fallback.yaml",
            &pod(
                "fallback",
                2,
                &format!(
                    "        postStart:\n          httpGet:\n            scheme: HTTPS\n            host: 127.0.0.1\n            port: {web}\n            path: /hook\n            httpHeaders:\n              - {{name: Authorization, value: Bearer secret}}\n"
                ),
                "exec sleep 1000",
            ),
        );
        let path = format!("/pods/default/fallback-{NODE}/events");
        let deadline = std::time::Instant::now() + DEADLINE;
        let events = loop {
            let events = http_get(e.agent().addr, &path).await;
            if events.contains("LifecycleHTTPFallback") {
                break events;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no LifecycleHTTPFallback within {DEADLINE:?}: {events}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        };
        assert!(
            events.contains(&format!(
                "request to HTTPS lifecycle hook 127.0.0.1:{web} got HTTP response, retry with HTTP succeeded"
            )),
            "{events}"
        );
        let p = e
            .wait_for("fallback", "running", |p| {
                container(p, "app")["state"]["running"].is_object()
            })
            .await;
        assert_eq!(container(&p, "app")["restartCount"], 0, "{p:#}");
        assert!(!events.contains("FailedPostStartHook"), "{events}");
        server.abort();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2, "a TLS hello, then the request over http");
        assert_eq!(seen[0].first(), Some(&0x16), "a TLS handshake record first");
        let retry = String::from_utf8_lossy(&seen[1]).to_ascii_lowercase();
        assert!(
            retry.starts_with("get /hook http/1.1\r\n")
                && retry.contains("user-agent: kube-lifecycle/")
                && !retry.contains("authorization"),
            "{retry}"
        );
    })
});

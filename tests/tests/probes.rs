//! Probes end to end (issue #13; the kubelet's `pkg/kubelet/prober`): the
//! whole agent against the real containerd, pods from static manifests, every
//! status observed through the local store. The test flips a probe's outcome
//! by creating or removing a file in the container's root
//! (`/proc/<pid>/root`), so no timing is assumed; HTTPS probes and hooks go
//! to a TLS server in the test (`evpleg_tests::tls`). Privileged: skipped with a
//! reason without root/BTF/the eBPF object, a failure under `CI=true`.

use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use serde_json::Value;

fn condition<'a>(pod: &'a Value, kind: &str) -> &'a Value {
    pod["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == kind))
        .unwrap_or(&Value::Null)
}

fn ready(pod: &Value, name: &str) -> bool {
    container(pod, name)["ready"] == true
}

fn restarts(pod: &Value, name: &str) -> i64 {
    container(pod, name)["restartCount"].as_i64().unwrap_or(-1)
}

/// The host path of `path` inside the running container `name` of `pod`.
fn in_container(pod: &Value, name: &str, path: &str) -> std::path::PathBuf {
    let id = container(pod, name)["containerID"]
        .as_str()
        .and_then(|s| s.split("://").nth(1))
        .unwrap_or_else(|| panic!("{name} has an id: {pod:#}"));
    let pid = find_container_pid(id).unwrap_or_else(|| panic!("{name}'s main process"));
    std::path::PathBuf::from(format!("/proc/{pid}/root{path}"))
}

/// Now, as the API's `Time` prints it (RFC 3339, whole seconds, UTC).
fn time_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// A port for this test run's servers (host network: unique per process).
fn port(offset: u16) -> u16 {
    20_000 + (std::process::id() % 20_000) as u16 + offset
}

fn pod(name: &str, containers: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  hostNetwork: true\n  terminationGracePeriodSeconds: 2\n  containers:\n{containers}"
    )
}

// Readiness follows an exec probe both ways, and Ready's lastTransitionTime
// moves with it; the exec probes' processes are never taken for the
// container's death.
e2e_test!(readiness_flips_ready_both_ways, |e| Box::pin(async move {
    e.write(
        "ready.yaml",
        &pod(
            "ready",
            &format!(
                "    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'exec sleep 1000']\n      readinessProbe:\n        exec:\n          command: [test, -f, /tmp/ready]\n        periodSeconds: 1\n        failureThreshold: 1\n"
            ),
        ),
    );
    let p = e
        .wait_for("ready", "running, not ready", |p| {
            container(p, "app")["state"]["running"].is_object()
                && !ready(p, "app")
                && condition(p, "Ready")["status"] == "False"
        })
        .await;
    let flag = in_container(&p, "app", "/tmp/ready");
    std::fs::write(&flag, "").expect("create the flag");
    let p = e
        .wait_for("ready", "ready", |p| {
            ready(p, "app") && condition(p, "Ready")["status"] == "True"
        })
        .await;
    let became_ready = condition(&p, "Ready")["lastTransitionTime"].clone();
    assert!(became_ready.is_string(), "{p:#}");
    // lastTransitionTime has a second's precision, and a triggered probe
    // (the kubelet's manualTriggerCh) may come off the period's ticks: the
    // flag goes once the clock is past that second, so that a moved time
    // can be told apart.
    let since = std::time::Instant::now();
    while time_now().as_str() <= became_ready.as_str().unwrap_or_default() {
        assert!(since.elapsed() < std::time::Duration::from_secs(3));
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    std::fs::remove_file(&flag).expect("remove the flag");
    let p = e
        .wait_for("ready", "not ready again", |p| {
            !ready(p, "app") && condition(p, "Ready")["status"] == "False"
        })
        .await;
    assert_eq!(condition(&p, "Ready")["reason"], "ContainersNotReady");
    assert_ne!(condition(&p, "Ready")["lastTransitionTime"], became_ready);
    // Many exec probes ran; the container never died nor restarted.
    assert_eq!(restarts(&p, "app"), 0, "{p:#}");
    assert!(
        container(&p, "app")["state"]["running"].is_object(),
        "{p:#}"
    );
    // Each failed probe is an Unhealthy event, aggregated with a count; the
    // probes' processes never showed as the container's death from the
    // kernel (that would be a `ContainerDied` event).
    let events = http_get(
        e.agent().addr,
        &format!("/pods/default/ready-{NODE}/events"),
    )
    .await;
    // An exec probe's message is its output only, as the 1.37 prober's
    // (`test -f` prints nothing).
    assert!(
        events.contains("\"reason\":\"Unhealthy\"")
            && events.contains("\"message\":\"Readiness probe failed: \""),
        "{events}"
    );
    assert!(!events.contains("ContainerDied"), "{events}");
    let metrics = http_get(e.agent().addr, "/metrics").await;
    assert!(
        metrics.contains("evpleg_pleg_kernel_contradictions_total 0\n"),
        "no kernel death was contradicted: {metrics}"
    );
}));

// A failed liveness probe kills the container, which restarts under the pod's
// policy with its restart count; the new one is probed afresh.
e2e_test!(
    a_failed_liveness_probe_restarts_the_container,
    |e| Box::pin(async move {
        e.write(
            "live.yaml",
            &pod(
                "live",
                &format!(
                    "    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'touch /tmp/alive; exec sleep 1000']\n      livenessProbe:\n        exec:\n          command: [test, -f, /tmp/alive]\n        periodSeconds: 1\n        failureThreshold: 2\n        terminationGracePeriodSeconds: 2\n"
                ),
            ),
        );
        let p = e
            .wait_for("live", "running", |p| {
                container(p, "app")["state"]["running"].is_object()
            })
            .await;
        let first = container(&p, "app")["containerID"].clone();
        std::fs::remove_file(in_container(&p, "app", "/tmp/alive")).expect("remove");
        let p = e
            .wait_for("live", "restarted and running", |p| {
                restarts(p, "app") == 1
                    && container(p, "app")["state"]["running"].is_object()
                    && container(p, "app")["containerID"] != first
            })
            .await;
        let last = &container(&p, "app")["lastState"]["terminated"];
        assert!(last.is_object(), "the killed container: {p:#}");
        // The new container has its file: it stays alive.
        assert_eq!(restarts(&p, "app"), 1);
        // The kill's reason, as the kubelet gives it.
        let events = http_get(e.agent().addr, &format!("/pods/default/live-{NODE}/events")).await;
        assert!(
            events.contains("Container app failed liveness probe, will be restarted"),
            "{events}"
        );
    })
);

// httpGet (200 ready, 404 not), tcpSocket (open ready, closed not) and an exec
// probe slower than its timeout (never ready).
e2e_test!(http_tcp_and_timed_out_probes, |e| Box::pin(async move {
    let (web, closed) = (port(0), port(1));
    let containers = format!(
        "    - name: web
      image: {IMAGE}
      command: [sh, -c, 'mkdir -p /www && echo ok > /www/index.html && exec httpd -f -p {web} -h /www']
      ports:
        - name: http
          containerPort: {web}
      readinessProbe:
        httpGet: {{path: /index.html, port: http}}
        periodSeconds: 1
      livenessProbe:
        tcpSocket: {{port: {web}}}
        periodSeconds: 1
        failureThreshold: 1
    - name: missing
      image: {IMAGE}
      command: [sh, -c, 'exec sleep 1000']
      readinessProbe:
        httpGet: {{path: /missing, port: {web}}}
        periodSeconds: 1
    - name: closed
      image: {IMAGE}
      command: [sh, -c, 'exec sleep 1000']
      readinessProbe:
        tcpSocket: {{port: {closed}}}
        periodSeconds: 1
    - name: slow
      image: {IMAGE}
      command: [sh, -c, 'exec sleep 1000']
      readinessProbe:
        exec:
          command: [sh, -c, 'sleep 3']
        timeoutSeconds: 1
        periodSeconds: 1
"
    );
    e.write("web.yaml", &pod("web", &containers));
    e.wait_for("web", "web ready", |p| ready(p, "web")).await;
    // Every other probe runs a few times meanwhile (the web one keeps
    // succeeding).
    let seen = std::time::Instant::now();
    let p = e
        .wait_for("web", "a few periods later", |q| {
            seen.elapsed() > std::time::Duration::from_secs(4) && ready(q, "web")
        })
        .await;
    for name in ["missing", "closed", "slow"] {
        assert!(
            container(&p, name)["state"]["running"].is_object() && !ready(&p, name),
            "{name} runs and is not ready: {p:#}"
        );
    }
    assert_eq!(
        restarts(&p, "web"),
        0,
        "the tcp liveness probe passed: {p:#}"
    );
    assert_eq!(condition(&p, "ContainersReady")["status"], "False");
}));

// A startup probe holds the liveness probe back until it succeeded.
e2e_test!(a_startup_probe_holds_liveness_back, |e| Box::pin(
    async move {
        e.write(
        "slowstart.yaml",
        &pod(
            "slowstart",
            &format!(
                "    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'exec sleep 1000']\n      startupProbe:\n        exec:\n          command: [test, -f, /tmp/started]\n        periodSeconds: 1\n        failureThreshold: 60\n      livenessProbe:\n        exec:\n          command: ['false']\n        periodSeconds: 1\n        failureThreshold: 1\n"
            ),
        ),
    );
        let p = e
            .wait_for("slowstart", "running, not started", |p| {
                container(p, "app")["state"]["running"].is_object()
                    && container(p, "app")["started"] == false
            })
            .await;
        // Several liveness periods pass: held back, no restart.
        let since = std::time::Instant::now();
        let held = e
            .wait_for("slowstart", "3 s without a restart", |_| {
                since.elapsed() > std::time::Duration::from_secs(3)
            })
            .await;
        assert_eq!(restarts(&held, "app"), 0, "liveness held back: {held:#}");
        assert_eq!(container(&held, "app")["started"], false);
        std::fs::write(in_container(&p, "app", "/tmp/started"), "").expect("flag");
        // Started; then the failing liveness probe runs and restarts it.
        let p = e
            .wait_for("slowstart", "restarted by liveness", |p| {
                restarts(p, "app") >= 1
            })
            .await;
        assert!(
            container(&p, "app")["lastState"]["terminated"].is_object(),
            "{p:#}"
        );
    }
));

// examples/probed.yaml, as `cargo xtask run` runs it, becomes Ready.
e2e_test!(the_example_with_probes_becomes_ready, |e| Box::pin(
    async move {
        let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/probed.yaml");
        let yaml = std::fs::read_to_string(example).expect("examples/probed.yaml");
        e.write("probed.yaml", &yaml);
        let p = e
            .wait_for("probed", "Ready", |p| {
                condition(p, "Ready")["status"] == "True"
            })
            .await;
        assert!(ready(&p, "server"), "{p:#}");
    }
));

// A gRPC readiness probe asks the health protocol's Check: SERVING is ready,
// NOT_SERVING is not. The server is tonic-health in this test process, on the
// host network the pod shares.
e2e_test!(a_grpc_probe_follows_the_health_service, |e| Box::pin(
    async move {
        let grpc = port(2);
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("app", tonic_health::ServingStatus::NotServing)
            .await;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_shutdown(([0, 0, 0, 0], grpc).into(), async {
                    let _ = stopped.await;
                }),
        );
        e.write(
        "grpc.yaml",
        &pod(
            "grpc",
            &format!(
                "    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'exec sleep 1000']\n      readinessProbe:\n        grpc: {{port: {grpc}, service: app}}\n        periodSeconds: 1\n        failureThreshold: 1\n"
            ),
        ),
    );
        e.wait_for("grpc", "running, not ready", |p| {
            container(p, "app")["state"]["running"].is_object() && !ready(p, "app")
        })
        .await;
        reporter
            .set_service_status("app", tonic_health::ServingStatus::Serving)
            .await;
        e.wait_for("grpc", "ready", |p| ready(p, "app")).await;
        reporter
            .set_service_status("app", tonic_health::ServingStatus::NotServing)
            .await;
        e.wait_for("grpc", "not ready again", |p| !ready(p, "app"))
            .await;
        let _ = stop.send(());
        server.await.expect("server task").expect("server");
    }
));

// An http probe answered with a redirect to another host is a success with a
// warning, as the kubelet's: the pod becomes Ready and each probe records a
// `ProbeWarning` event with the response's body. The server is in this test
// process, on the host network the pod shares.
e2e_test!(a_redirect_to_another_host_is_a_probe_warning, |e| Box::pin(
    async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port(3)))
            .await
            .expect("bind the redirecting server");
        let web = listener.local_addr().expect("its address").port();
        let server = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let mut req = [0u8; 1024];
                let _ = s.read(&mut req).await;
                let _ = s
                    .write_all(
                        b"HTTP/1.1 302 Found\r\nLocation: http://elsewhere.invalid/\r\nContent-Length: 5\r\n\r\nmoved",
                    )
                    .await;
            }
        });
        e.write(
            "redirect.yaml",
            &pod(
                "redirect",
                &format!(
                    "    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'exec sleep 1000']\n      readinessProbe:\n        httpGet: {{host: 127.0.0.1, port: {web}, path: /healthz}}\n        periodSeconds: 1\n"
                ),
            ),
        );
        e.wait_for("redirect", "ready", |p| {
            ready(p, "app") && condition(p, "Ready")["status"] == "True"
        })
        .await;
        let events = http_get(
            e.agent().addr,
            &format!("/pods/default/redirect-{NODE}/events"),
        )
        .await;
        server.abort();
        assert!(
            events.contains("\"reason\":\"ProbeWarning\"")
                && events.contains(
                    "Readiness probe warning: Probe terminated redirects, Response body: moved"
                ),
            "{events}"
        );
        assert!(!events.contains("Unhealthy"), "{events}");
    }
));

// HTTPS as the kubelet's, against a TLS server with a self-signed certificate
// naming another host (in this test process, on the host network the pod
// shares): a `scheme: HTTPS` readiness probe answered 200 makes its container
// ready, one answered 500 keeps its container not ready with the kubelet's
// message, and an HTTPS postStart hook reaches the server as
// `kube-lifecycle`.
e2e_test!(https_probes_and_hooks_speak_tls, |e| Box::pin(async move {
    let server =
        evpleg_tests::tls::TlsServer::start(
            port(4),
            |path| {
                if path == "/fail" { 500 } else { 200 }
            },
        )
        .await;
    let web = server.port;
    let https =
        |path: &str| format!("{{scheme: HTTPS, host: 127.0.0.1, port: {web}, path: {path}}}");
    let containers = format!(
        "    - name: app
      image: {IMAGE}
      command: [sh, -c, 'exec sleep 1000']
      lifecycle:
        postStart:
          httpGet: {hook}
      readinessProbe:
        httpGet: {healthz}
        periodSeconds: 1
    - name: bad
      image: {IMAGE}
      command: [sh, -c, 'exec sleep 1000']
      readinessProbe:
        httpGet: {fail}
        periodSeconds: 1
        failureThreshold: 1
",
        hook = https("/hook"),
        healthz = https("/healthz"),
        fail = https("/fail"),
    );
    e.write("tls.yaml", &pod("tls", &containers));
    e.wait_for("tls", "app ready over https", |p| ready(p, "app"))
        .await;
    // The second failed probe comes after the first one's event.
    e.wait_until("bad probed twice", || server.count("/fail") >= 2)
        .await;
    let p = e.pod("tls").expect("the pod");
    assert!(
        container(&p, "bad")["state"]["running"].is_object() && !ready(&p, "bad"),
        "bad runs and is not ready: {p:#}"
    );
    let events = http_get(e.agent().addr, &format!("/pods/default/tls-{NODE}/events")).await;
    assert!(
        events.contains("\"reason\":\"Unhealthy\"")
            && events.contains("Readiness probe failed: HTTP probe failed with statuscode: 500"),
        "{events}"
    );
    assert!(!events.contains("FailedPostStartHook"), "{events}");
    let requests = server.requests();
    let of = |path: &str| {
        requests
            .iter()
            .find(|r| r.starts_with(&format!("GET {path} HTTP/1.1\r\n")))
            .unwrap_or_else(|| panic!("a request for {path}: {requests:?}"))
            .to_ascii_lowercase()
    };
    assert!(
        of("/hook").contains("user-agent: kube-lifecycle/"),
        "{requests:?}"
    );
    assert!(
        of("/healthz").contains("user-agent: kube-probe/"),
        "{requests:?}"
    );
    assert!(
        of("/healthz").contains(&format!("host: 127.0.0.1:{web}\r\n")),
        "{requests:?}"
    );
}));

/// A pod with a probed sidecar `side` (`side_probes` indented under it), a
/// plain init container `init` and an app container.
fn sidecar_pod(name: &str, side_command: &str, side_probes: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  hostNetwork: true\n  terminationGracePeriodSeconds: 2\n  initContainers:\n    - name: side\n      image: {IMAGE}\n      restartPolicy: Always\n      command: [sh, -c, '{side_command}']\n{side_probes}    - name: init\n      image: {IMAGE}\n      command: [sh, -c, 'exit 0']\n  containers:\n    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'exec sleep 1000']\n"
    )
}

/// How many times the pod's events (the endpoint's response) counted `needle`.
fn event_count(response: &str, needle: &str) -> i64 {
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    let list: Value = serde_json::from_str(body).unwrap_or_else(|err| panic!("{response}: {err}"));
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["message"].as_str().is_some_and(|m| m.contains(needle)))
        .map(|e| e["count"].as_i64().unwrap_or(1))
        .sum()
}

// A sidecar's startup probe holds the next init container back until it
// succeeds (the kubelet's computeInitContainerActions); then its readiness
// probe decides its `ready` and the pod's ContainersReady and Ready.
e2e_test!(a_sidecar_s_probes_gate_init_and_readiness, |e| Box::pin(
    async move {
        e.write(
            "sideprobe.yaml",
            &sidecar_pod(
                "sideprobe",
                "exec sleep 1000",
                "      startupProbe:\n        exec:\n          command: [test, -f, /tmp/started]\n        periodSeconds: 1\n        failureThreshold: 1000\n      readinessProbe:\n        exec:\n          command: [test, -f, /tmp/ready]\n        periodSeconds: 1\n        failureThreshold: 1\n",
            ),
        );
        let p = e
            .wait_for("sideprobe", "the sidecar running, not started", |p| {
                container(p, "side")["state"]["running"].is_object()
                    && container(p, "side")["started"] == false
            })
            .await;
        // Three failed startup probes later the init container has still not
        // been created, the pod not initialized.
        let path = format!("/pods/default/sideprobe-{NODE}/events");
        let addr = e.agent().addr;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while event_count(&http_get(addr, &path).await, "Startup probe failed") < 3 {
            assert!(std::time::Instant::now() < deadline, "3 startup probes ran");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        let held = e
            .wait_for("sideprobe", "its status", |p| {
                container(p, "side")["started"] == false
            })
            .await;
        assert!(
            container(&held, "init")["containerID"].is_null()
                && container(&held, "app")["containerID"].is_null(),
            "init held back: {held:#}"
        );
        assert_eq!(condition(&held, "Initialized")["status"], "False");
        assert_eq!(held["status"]["phase"], "Pending");
        std::fs::write(in_container(&p, "side", "/tmp/started"), "").expect("started flag");
        let p = e
            .wait_for("sideprobe", "initialized, the app running", |p| {
                container(p, "side")["started"] == true
                    && container(p, "init")["state"]["terminated"]["exitCode"] == 0
                    && container(p, "app")["state"]["running"].is_object()
                    && condition(p, "Initialized")["status"] == "True"
            })
            .await;
        // The app is ready (no probe), the sidecar not: the pod is not Ready.
        assert!(ready(&p, "app") && !ready(&p, "side"), "{p:#}");
        assert_eq!(condition(&p, "ContainersReady")["status"], "False");
        assert_eq!(condition(&p, "Ready")["status"], "False");
        std::fs::write(in_container(&p, "side", "/tmp/ready"), "").expect("ready flag");
        e.wait_for("sideprobe", "Ready", |p| {
            ready(p, "side") && condition(p, "Ready")["status"] == "True"
        })
        .await;
    }
));

// A sidecar failing its liveness probe is killed with the kubelet's message
// and restarted (its restart count, a new container); the app is untouched.
e2e_test!(a_sidecar_failing_liveness_is_restarted, |e| Box::pin(
    async move {
        e.write(
            "sidelive.yaml",
            &sidecar_pod(
                "sidelive",
                "touch /tmp/alive; exec sleep 1000",
                "      livenessProbe:\n        exec:\n          command: [test, -f, /tmp/alive]\n        periodSeconds: 1\n        failureThreshold: 1\n",
            ),
        );
        let p = e
            .wait_for("sidelive", "the sidecar and the app running", |p| {
                container(p, "side")["state"]["running"].is_object()
                    && container(p, "app")["state"]["running"].is_object()
            })
            .await;
        let first = container(&p, "side")["containerID"].clone();
        let app = container(&p, "app")["containerID"].clone();
        std::fs::remove_file(in_container(&p, "side", "/tmp/alive")).expect("remove");
        let p = e
            .wait_for("sidelive", "the sidecar restarted and running", |p| {
                restarts(p, "side") == 1
                    && container(p, "side")["state"]["running"].is_object()
                    && container(p, "side")["containerID"] != first
            })
            .await;
        assert!(
            container(&p, "side")["lastState"]["terminated"].is_object(),
            "{p:#}"
        );
        assert_eq!(container(&p, "app")["containerID"], app, "{p:#}");
        assert_eq!(restarts(&p, "app"), 0);
        let events = http_get(
            e.agent().addr,
            &format!("/pods/default/sidelive-{NODE}/events"),
        )
        .await;
        assert!(
            events.contains("Init container side failed liveness probe"),
            "{events}"
        );
    }
));

// Issue #27 item 8: a new container's readiness probe runs as soon as the
// container runs (the kubelet's manualTriggerCh), not a period later: with
// periodSeconds 30 the container is ready within a few seconds of its start
// (before the fix, ~30 s: the worker's first tick came before the container
// ran, the next a period later).
e2e_test!(readiness_is_probed_at_once_after_a_start, |e| Box::pin(
    async move {
        e.write(
            "prompt.yaml",
            &pod(
                "prompt",
                &format!(
                    "    - name: app\n      image: {IMAGE}\n      command: [sh, -c, 'exec sleep 1000']\n      readinessProbe:\n        exec:\n          command: ['true']\n        periodSeconds: 30\n"
                ),
            ),
        );
        e.wait_for("prompt", "running", |p| {
            container(p, "app")["state"]["running"].is_object()
        })
        .await;
        let running = std::time::Instant::now();
        e.wait_for("prompt", "ready", |p| ready(p, "app")).await;
        let took = running.elapsed();
        eprintln!("ready {took:?} after the container was seen running");
        assert!(
            took < std::time::Duration::from_secs(10),
            "ready {took:?} after the start, the period is 30 s"
        );
    }
));

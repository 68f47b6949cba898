//! The PLEG contract (docs/pleg.md, "The contract") on the real kernel and the
//! real containerd: an exec into a container is never its death, and a stopped
//! ring-buffer reader is visible and the 1 s relist takes over. Privileged: skipped with a
//! reason without root, BTF or the eBPF object, a failure under `CI=true`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evpleg::clock::MonotonicClock;
use evpleg::container::ContainerState;
use evpleg::metrics::Metrics;
use evpleg::pleg::relist::GENERIC_PERIOD;
use evpleg::pleg::{EventKind, EventSource, PlegMode};
use evpleg::server::{ServerState, router};
use evpleg_tests::cri_pod::*;
use evpleg_tests::privileged;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The relist period of these tests: long enough that only the kernel, on-demand
/// relists and the fallback can be what they observe.
const PERIOD: Option<Duration> = Some(Duration::from_secs(3600));

/// Clause 2: `ExecSync` into a running container (commands that exit 0 and 3,
/// one that execs again, one that forks) never produces a ContainerDied, before
/// and after an agent restart (when the tracker learns the container by its
/// scan and the runtime's pid); the container's own death afterwards is
/// reported once, with its code, as the first ContainerDied for it.
#[test]
fn an_exec_into_a_container_is_never_its_death() {
    if !privileged("an_exec_into_a_container_is_never_its_death") {
        return;
    }
    let containerd = start_containerd();
    let rt = tokio_runtime();
    let pod = TestPod::new(&containerd, "exec7");
    rt.block_on(async {
        let client = containerd.client().await;
        let sandbox = run_sandbox(&client, &pod).await;
        let (first, mut events) = start_pleg(PlegMode::Ebpf, &client, PERIOD);
        let id = run_container(&client, &pod, &sandbox, &pod.waiting_container("app")).await;
        events.wait(&id, EventKind::ContainerStarted).await;
        wait_cached(&first, &pod.pod_uid(), &id, "running", |c| {
            c.state == ContainerState::Running
        })
        .await;
        let execs: [&[&str]; 4] = [
            &["true"],
            &["sh", "-c", "exit 3"],
            &["sh", "-c", "exec sleep 0.01"],
            &["sh", "-c", "sleep 0.01 & wait"],
        ];
        let exec_all = |round: &'static str| {
            let client = client.clone();
            let id = id.clone();
            async move {
                for _ in 0..5 {
                    for cmd in execs {
                        let r = client
                            .exec_sync(&id, cmd, Duration::from_secs(10))
                            .await
                            .unwrap_or_else(|e| panic!("{round}: exec {cmd:?}: {e}"));
                        assert!(r.exit_code == 0 || r.exit_code == 3, "{cmd:?}: {r:?}");
                    }
                }
            }
        };
        exec_all("first agent").await;
        first.stop().await;

        // A new agent: the container is learned, not seen starting.
        let (second, mut events2) = start_pleg(PlegMode::Ebpf, &client, PERIOD);
        wait_cached(&second, &pod.pod_uid(), &id, "running", |c| {
            c.state == ContainerState::Running
        })
        .await;
        exec_all("second agent").await;
        pod.release("app");
        // The kernel's records are ordered: a Died for any exec would come first.
        let died = events2.wait(&id, EventKind::ContainerDied).await;
        assert_eq!(died.exit.map(|e| e.code), Some(7), "{died:?}");
        let c = wait_cached(&second, &pod.pod_uid(), &id, "exited", |c| {
            c.state == ContainerState::Exited
        })
        .await;
        assert_exited_7(&c);
        eprintln!(
            "exec test: the death came from {:?}; first agent saw {} events, the second {}",
            died.source,
            events.all.len(),
            events2.all.len()
        );
        assert!(
            events
                .all
                .iter()
                .chain(events2.all.iter())
                .filter(|e| e.container_id.as_ref().is_some_and(|c| c.as_str() == id))
                .all(|e| e.kind != EventKind::ContainerDied || e.exit.map(|x| x.code) == Some(7)),
            "no other death for {id}: {:#?} {:#?}",
            events.all,
            events2.all
        );
        second.stop().await;
    });
}

/// Minimal HTTP/1.1 GET on loopback: (status code, body).
async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not HTTP: {out}"));
    let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (code, body)
}

/// Clause 5: the ring-buffer reader stopped (as if it had failed): `/healthz`
/// says so (200, which part), the degradation is counted, the relist moves to
/// 1 s by itself and a container's death still reaches the cache within it.
#[test]
fn a_stopped_reader_is_visible_and_the_generic_relist_takes_over() {
    if !privileged("a_stopped_reader_is_visible_and_the_generic_relist_takes_over") {
        return;
    }
    let containerd = start_containerd();
    let rt = tokio_runtime();
    let pod = TestPod::new(&containerd, "degraded7");
    rt.block_on(async {
        let client = containerd.client().await;
        let (pleg, mut events) = start_pleg(PlegMode::Ebpf, &client, PERIOD);
        let metrics = std::sync::Arc::new(Metrics::new(Some(&pleg), None));
        let state = ServerState::new(
            metrics,
            Some(pleg.relist_stats.clone()),
            std::sync::Arc::new(MonotonicClock),
            pleg.relist_period(),
        )
        .with_path_health(pleg.path_health.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shutdown = tokio_util::sync::CancellationToken::new();
        let stop = shutdown.clone();
        let server = tokio::spawn(async move {
            axum::serve(listener, router(state))
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
        });
        let sandbox = run_sandbox(&client, &pod).await;
        let id = run_container(&client, &pod, &sandbox, &pod.waiting_container("app")).await;
        events.wait(&id, EventKind::ContainerStarted).await;
        let (code, body) = get(addr, "/healthz").await;
        assert_eq!((code, body.as_str()), (200, "ok\n"));

        pleg.kernel
            .as_ref()
            .expect("ebpf mode")
            .fail_reader_for_test();
        let deadline = Instant::now() + WAIT;
        while pleg.degraded().is_none() {
            assert!(
                Instant::now() < deadline,
                "the stopped reader was not noticed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            pleg.degraded().expect("degraded").part,
            "ring-buffer reader"
        );
        let (code, body) = get(addr, "/healthz").await;
        assert_eq!(code, 200, "{body}");
        assert!(
            body.contains("kernel pleg degraded: ring-buffer reader stopped"),
            "{body}"
        );
        let (_, metrics) = get(addr, "/metrics").await;
        assert!(
            metrics.contains("evpleg_pleg_kernel_degradations_total 1"),
            "{metrics}"
        );
        let deadline = Instant::now() + WAIT;
        while pleg.relist_stats.period_ns.load(Ordering::Relaxed)
            != GENERIC_PERIOD.as_nanos() as u64
        {
            assert!(
                Instant::now() < deadline,
                "the relist did not fall back to 1 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // The death now comes from the relist, within its period plus the
        // runtime's own delay.
        pod.release("app");
        let died = events.wait(&id, EventKind::ContainerDied).await;
        assert_eq!(died.source, EventSource::Relist, "{died:?}");
        assert_exited_7(&cached(&pleg, &pod.pod_uid(), &id).expect("cached"));
        healthy(&pleg);
        shutdown.cancel();
        let _ = server.await;
        pleg.stop().await;
    });
}

//! The PLEG contract (docs/pleg.md, "The contract") on the real kernel and the
//! real containerd: an exec into a container is never its death, and a stopped
//! ring-buffer reader is visible and the 1 s relist takes over. Privileged: skipped with a
//! reason without root, BTF or the eBPF object, a failure under `CI=true`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evpleg::metrics::Metrics;
use evpleg::server::{ServerState, router};
use evpleg_core::clock::MonotonicClock;
use evpleg_core::container::ContainerState;
use evpleg_core::lifecycle::{EventKind, EventSource};
use evpleg_pleg::PlegMode;
use evpleg_pleg::relist::GENERIC_PERIOD;
use evpleg_tests::containerd::wait_container_status;
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

/// Clause 2 under an OCI hook (issue #25): a runtime handler whose runc runs a
/// `createContainer` hook in the container's cgroup before the entrypoint
/// (the hook execs `sh`, then `sleep`, and exits 0). The hook is neither the
/// container's start nor its death: no ContainerDied while the container
/// runs, and its one death, when the entrypoint exits, has the entrypoint's
/// code 7. Before the fix the hook was "the first exec in a fresh cgroup": its
/// exit was a certain ContainerDied with code 0 at the container's creation.
#[test]
fn an_oci_hook_is_never_the_main_process() {
    if !privileged("an_oci_hook_is_never_the_main_process") {
        return;
    }
    let containerd = start_containerd();
    let rt = tokio_runtime();
    let pod = TestPod::new(&containerd, "hook7");
    rt.block_on(async {
        let client = containerd.client().await;
        let (pleg, mut events) = start_pleg(PlegMode::Ebpf, &client, PERIOD);
        let sandbox = client
            .run_pod_sandbox(&pod.config, evpleg_tests::oci_hooks::HANDLER)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let id = run_container(&client, &pod, &sandbox, &pod.waiting_container("app")).await;
        let started = events.wait(&id, EventKind::ContainerStarted).await;
        let c = wait_cached(&pleg, &pod.pod_uid(), &id, "running", |c| {
            c.state == ContainerState::Running
        })
        .await;
        // The kernel's start is the entrypoint's: the runtime's own pid.
        let runtime_pid = main_pid(&client, &id).await;
        assert_eq!(started.pid, Some(runtime_pid), "{started:?} {c:?}");
        // The hook ran before the start: had it been taken for the main
        // process, its death (code 0) would be in the stream by now.
        settle(&pleg, &mut events, &pod).await;
        assert_eq!(
            events.count(&id, EventKind::ContainerDied),
            0,
            "no death while it runs: {:#?}",
            events.all
        );
        pod.release("app");
        let died = events.wait(&id, EventKind::ContainerDied).await;
        assert_eq!(
            (died.source, died.exit.map(|e| e.code), died.pid),
            (EventSource::Kernel, Some(7), Some(runtime_pid)),
            "{died:?}"
        );
        let c = wait_cached(&pleg, &pod.pod_uid(), &id, "exited", |c| {
            c.state == ContainerState::Exited
        })
        .await;
        assert_exited_7(&c);
        eprintln!("hook test: one death, the entrypoint's, code 7, pid {runtime_pid}");
        pleg.stop().await;
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

/// The runtime's own answer for container `id` once it reports it exited: its
/// exit code.
async fn runtime_exit_code(client: &evpleg_cri::CriClient, id: &str) -> i32 {
    let exited = evpleg_cri_api::v1::ContainerState::ContainerExited as i32;
    wait_container_status(client, id, "exited", |s| s.state == exited)
        .await
        .exit_code
}

/// The host pid of container `id`'s main process, from the runtime.
async fn main_pid(client: &evpleg_cri::CriClient, id: &str) -> u32 {
    let status = client
        .container_status(id, true)
        .await
        .unwrap_or_else(|e| panic!("ContainerStatus {id}: {e}"));
    verbose_pid(&status.info).unwrap_or_else(|| panic!("no pid for {id}: {:?}", status.info))
}

/// `/proc/<pid>/stat`'s state letter and `/proc/<pid>/task`'s thread count.
fn proc_state(pid: u32) -> (Option<char>, usize) {
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    (evpleg_tests::kernel_checks::proc_state(pid), threads)
}

/// Waits until `done` holds for `pid`'s `/proc` state.
async fn wait_proc(pid: u32, what: &str, done: impl Fn(Option<char>, usize) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let (state, threads) = proc_state(pid);
        if done(state, threads) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "pid {pid} never {what}: state {state:?}, {threads} threads"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Asks for a relist of `pod` and waits until the cache holds an observation
/// of it newer than the request, then takes the events sent so far: whatever a
/// relist had to add is in `events` afterwards.
async fn settle(pleg: &evpleg_pleg::Pleg, events: &mut Events, pod: &TestPod) {
    let now = evpleg_core::clock::monotonic_ns();
    pleg.pod_relist.request(pod.pod_uid());
    tokio::time::timeout(WAIT, pleg.cache.get_newer_than(&pod.pod_uid(), now))
        .await
        .expect("a pod relist after the deaths");
    events.drain();
}

/// Clause 7 under containerd: a container whose multi-threaded main process dies
/// by `exit_group` from a thread that is not the leader (eight threads die
/// together), and one whose leader thread exits first and its last thread later:
/// each gives exactly one ContainerDied, from the kernel, with the exit code the
/// runtime itself reports.
#[test]
fn a_multi_threaded_main_process_dies_once_with_the_runtimes_code() {
    if !privileged("a_multi_threaded_main_process_dies_once_with_the_runtimes_code") {
        return;
    }
    let containerd = start_containerd();
    let rt = tokio_runtime();
    let pod = TestPod::new(&containerd, "threads7");
    let helper = env!("CARGO_BIN_EXE_evpleg-thread-helper");
    rt.block_on(async {
        let client = containerd.client().await;
        let sandbox = run_sandbox(&client, &pod).await;
        let (pleg, mut events) = start_pleg(PlegMode::Ebpf, &client, PERIOD);
        let group =
            pod.thread_helper_container("group", helper, &["exit-group-from-thread", "9", "8"]);
        let group = run_container(&client, &pod, &sandbox, &group).await;
        let leader =
            pod.thread_helper_container("leader", helper, &["leader-exits-first", "3", "5"]);
        let leader = run_container(&client, &pod, &sandbox, &leader).await;
        for id in [&group, &leader] {
            events.wait(id, EventKind::ContainerStarted).await;
            wait_cached(&pleg, &pod.pod_uid(), id, "running", |c| {
                c.state == ContainerState::Running
            })
            .await;
        }
        let group_pid = main_pid(&client, &group).await;
        wait_proc(group_pid, "ran 8 threads", |_, threads| threads == 8).await;
        let leader_pid = main_pid(&client, &leader).await;
        wait_proc(leader_pid, "had its leader exit", |state, _| {
            state == Some('Z')
        })
        .await;

        pod.release("group");
        pod.release("leader");
        for (id, name, codes) in [
            (&group, "group", &[9][..]),
            (&leader, "leader", &[3, 5][..]),
        ] {
            let died = events.wait(id, EventKind::ContainerDied).await;
            let runtime = runtime_exit_code(&client, id).await;
            assert!(
                codes.contains(&runtime),
                "{name}: the runtime's code {runtime}"
            );
            assert_eq!(
                (died.source, died.exit.map(|e| e.code)),
                (EventSource::Kernel, Some(runtime)),
                "{name}: {died:?}"
            );
            eprintln!("threads test: {name} died once, code {runtime} (the runtime's)");
        }
        settle(&pleg, &mut events, &pod).await;
        for id in [&group, &leader] {
            assert_eq!(
                events.count(id, EventKind::ContainerDied),
                1,
                "one death for {id}: {:#?}",
                events.all
            );
        }
        pleg.stop().await;
    });
}

/// Clauses 4 and 7 under containerd: with a one-page ring buffer and its reader
/// held, a burst from an exec fills the ring, and four containers then die with
/// codes 11-14 while their records are dropped. Once the reader goes on, the
/// drops are counted and every death reaches the workers (from the relist the
/// loss triggered) and the cache, with the runtime's code, within the loss bound
/// of docs/pleg.md (1 s), without the periodic relist.
#[test]
fn deaths_lost_in_a_full_ring_buffer_reach_the_cache_within_the_bound() {
    if !privileged("deaths_lost_in_a_full_ring_buffer_reach_the_cache_within_the_bound") {
        return;
    }
    const LOSS_BOUND: Duration = Duration::from_secs(1);
    let containerd = start_containerd();
    let rt = tokio_runtime();
    let pod = TestPod::new(&containerd, "lost7");
    let gate = std::sync::Arc::new(evpleg_tests::pleg::ReaderGate::default());
    let tap_gate = gate.clone();
    let mut kernel = evpleg_pleg::kernel::KernelPlegConfig {
        ring_buffer_bytes: 4096,
        ..Default::default()
    };
    kernel.tap = Some(std::sync::Arc::new(
        move |ev: &evpleg_pleg::kernel::event::KernelEvent, _: u64| tap_gate.pass(ev),
    ));
    rt.block_on(async {
        let client = containerd.client().await;
        let sandbox = run_sandbox(&client, &pod).await;
        let (pleg, mut events) = start_pleg_with(PlegMode::Ebpf, &client, PERIOD, kernel);
        let mut ids = Vec::new();
        for code in 11..=14u8 {
            let name = format!("c{code}");
            let config = pod.waiting_container_exiting(&name, code);
            let id = run_container(&client, &pod, &sandbox, &config).await;
            events.wait(&id, EventKind::ContainerStarted).await;
            wait_cached(&pleg, &pod.pod_uid(), &id, "running", |c| {
                c.state == ContainerState::Running
            })
            .await;
            ids.push((name, id, i32::from(code)));
        }
        let stats = pleg.kernel.as_ref().expect("ebpf mode").stats().clone();
        let dropped_before = stats.kernel_dropped.load(Ordering::Relaxed);

        // The waiting loops' own forks reach the reader, which the gate holds.
        gate.close();
        assert!(gate.wait_held(WAIT), "the reader was never held");
        // 300 processes: at least 300 exit records, far more than a page holds,
        // and nothing reads the ring.
        let (exec_id, burst) = (&ids[0].1, "i=0; while [ $i -lt 300 ]; do /bin/true; i=$((i+1)); done");
        let r = client
            .exec_sync(exec_id, &["sh", "-c", burst], Duration::from_secs(30))
            .await
            .expect("the burst");
        assert_eq!(r.exit_code, 0, "{r:?}");
        for (name, id, code) in &ids {
            pod.release(name);
            assert_eq!(runtime_exit_code(&client, id).await, *code, "{name}");
        }
        // Nothing has told the PLEG yet: the reader is held and no relist is due.
        for (name, id, _) in &ids {
            assert_eq!(events.count(id, EventKind::ContainerDied), 0, "{name}");
        }

        let opened = Instant::now();
        gate.open();
        for (name, id, code) in &ids {
            // A relist's event carries no exit: the code is in the cache.
            let died = events.wait(id, EventKind::ContainerDied).await;
            assert_eq!(
                died.source,
                EventSource::Relist,
                "{name}: the kernel's record was to be lost: {died:?}"
            );
            let c = wait_cached(&pleg, &pod.pod_uid(), id, "exited", |c| {
                c.state == ContainerState::Exited
            })
            .await;
            assert_eq!(c.exit_code, Some(*code), "{name}: {c:?}");
        }
        let repaired = opened.elapsed();
        let dropped = stats.kernel_dropped.load(Ordering::Relaxed) - dropped_before;
        eprintln!("lost-death test: {dropped} records dropped; all four deaths cached {repaired:?} after the reader went on");
        assert!(dropped > 0, "the full ring dropped nothing");
        assert!(
            repaired < LOSS_BOUND,
            "the deaths reached the cache {repaired:?} after the reader went on (bound {LOSS_BOUND:?})"
        );
        settle(&pleg, &mut events, &pod).await;
        for (name, id, _) in &ids {
            assert_eq!(events.count(id, EventKind::ContainerDied), 1, "{name}: {:#?}", events.all);
        }
        healthy(&pleg);
        pleg.stop().await;
    });
}

//! Privileged tests of the kernel PLEG on the real kernel, with real cgroups and
//! processes and no container runtime. They skip with a reason without root, BTF
//! or the eBPF object, and fail instead under `CI=true`. The checks shared with
//! the kernel matrix's probe are in `evpleg_tests::kernel_checks`.

use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Stdio;
use std::time::{Duration, Instant};

use evpleg_core::clock::monotonic_ns;
use evpleg_core::ids::{ContainerId, PodUid};
use evpleg_core::lifecycle::{EventKind, EventSource};
use evpleg_pleg::kernel::event::KernelEvent;
use evpleg_pleg::kernel::reader::LAZY_BOUND;
use evpleg_pleg::kernel::relist_requests::RelistReason;
use evpleg_pleg::kernel::rescan::RESCAN_MIN_INTERVAL;
use evpleg_pleg::kernel::{KernelHealth, RuntimeContainer, RuntimeView};
use evpleg_tests::cgroups::{ContainerCgroup, Layout, join_cgroup, path_cstring};
use evpleg_tests::kernel_checks::{self, ThreadHelper};
use evpleg_tests::pleg::{PlegUnderTest, ReaderGate};
use evpleg_tests::privileged;

const RECORD_TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn exec_and_exit_records_checked_against_proc() {
    if !privileged("exec_and_exit_records_checked_against_proc") {
        return;
    }
    let pleg = PlegUnderTest::start(|_| {});
    eprintln!(
        "{}",
        kernel_checks::exec_exit_records(&pleg, RECORD_TIMEOUT)
    );
}

#[test]
fn started_died_with_exit_code_7_and_cgroup_removal_is_silent() {
    if !privileged("started_died_with_exit_code_7_and_cgroup_removal_is_silent") {
        return;
    }
    let mut cg = ContainerCgroup::new(Layout::Cgroupfs);
    let mut pleg = PlegUnderTest::start(|_| {});
    let mut child = cg
        .command("/bin/sh")
        .args(["-c", "exit 7"])
        .spawn()
        .expect("spawn sh");
    let pid = child.id();
    assert_eq!(child.wait().expect("wait").code(), Some(7));
    let started = pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    assert_eq!(
        started.pod_uid.as_ref().map(|u| u.as_str()),
        Some(cg.pod_uid.as_str())
    );
    assert_eq!(
        (started.pid, started.source),
        (Some(pid), EventSource::Kernel)
    );
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    let exit = died.exit.expect("an exit status");
    assert_eq!((exit.code, exit.signal, exit.oom_killed), (7, None, false));
    assert_eq!(died.pid, Some(pid));
    assert!(died.at_ns >= started.at_ns);
    cg.remove_container();
    // The kernel never reports removal (only the runtime can). A container's
    // events read after the rmdir (the ring buffer is ordered) are the barrier.
    let barrier = ContainerCgroup::new(Layout::Cgroupfs);
    assert!(
        barrier
            .command("/bin/true")
            .status()
            .expect("run true")
            .success()
    );
    pleg.expect(&barrier.container_id, EventKind::ContainerStarted);
    assert_eq!(pleg.drain_events(&cg.container_id), vec![]);
    assert_eq!(pleg.relist.count(), 0, "nothing was lost");
}

#[test]
fn systemd_and_containerd_layouts_are_attributed() {
    if !privileged("systemd_and_containerd_layouts_are_attributed") {
        return;
    }
    let systemd = ContainerCgroup::new(Layout::Systemd);
    let no_parent = ContainerCgroup::new(Layout::ContainerdNoParent);
    let mut pleg = PlegUnderTest::start(|_| {});
    for cg in [&systemd, &no_parent] {
        let status = cg
            .command("/bin/sh")
            .args(["-c", "exit 3"])
            .status()
            .expect("run sh");
        assert_eq!(status.code(), Some(3));
    }
    let started = pleg.expect(&systemd.container_id, EventKind::ContainerStarted);
    assert_eq!(
        started.pod_uid.map(|u| u.to_string()),
        Some(systemd.pod_uid.clone())
    );
    let died = pleg.expect(&systemd.container_id, EventKind::ContainerDied);
    assert_eq!(died.exit.map(|e| e.code), Some(3));
    let started = pleg.expect(&no_parent.container_id, EventKind::ContainerStarted);
    assert_eq!(started.pod_uid, None, "/k8s.io/<id> does not name the pod");
    let died = pleg.expect(&no_parent.container_id, EventKind::ContainerDied);
    assert_eq!(died.exit.map(|e| e.code), Some(3));
}

/// A root made after the programs were loaded reaches the kernel filter when
/// the reader reads its mkdir; tasks below it run unreported until then (CI
/// of stop 36: `/kubepods` made again while the reader lagged, a helper's
/// exec held back, its exit read as another process's, and nothing sent).
/// With the reader held at the gate, `/docker` (a root only this test's PLEG
/// watches, so that no other test makes it) is made with three containers
/// below it: one whose process ran and exited, one whose process still runs,
/// one empty. Then: a relist for the first (found empty after running, its
/// exit never read) and no start or death for it; a hint, not a death, for
/// the second's exit; the third's start and death as facts.
#[test]
fn containers_below_a_root_made_while_the_reader_lagged_lose_nothing() {
    if !privileged("containers_below_a_root_made_while_the_reader_lagged_lose_nothing") {
        return;
    }
    let root = evpleg_tests::cgroups::cgroup2().join("docker");
    assert!(
        !root.exists(),
        "{} exists: this test makes it after its PLEG starts",
        root.display()
    );
    let marker = ContainerCgroup::new(Layout::Cgroupfs);
    let gate = ReaderGate::closed();
    let mut pleg = PlegUnderTest::start_gated(1000, Some(gate.clone()), |c| {
        c.roots.push("/docker".into());
    });
    let status = marker.command("/bin/true").status().expect("run true");
    assert!(status.success());
    assert!(
        gate.wait_held(RECORD_TIMEOUT),
        "the reader never reached the gate"
    );
    let exited = ContainerCgroup::new(Layout::Docker);
    let status = exited
        .command("/bin/sh")
        .args(["-c", "exit 3"])
        .status()
        .expect("run sh");
    assert_eq!(status.code(), Some(3));
    let running = ContainerCgroup::new(Layout::Docker);
    let mut reader = running
        .command("/bin/sh")
        .args(["-c", "read line; exit 4"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("spawn sh");
    let empty = ContainerCgroup::new(Layout::Docker);
    gate.open();
    // The rescan after the root's mkdir finds the first empty after running.
    let stats = pleg.pleg.stats().clone();
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while stats.relist_requests.get(RelistReason::ExitedUnseen) == 0 {
        assert!(
            Instant::now() < deadline,
            "no relist for the container whose process exited unreported within {RECORD_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The filter holds /docker now: the empty one's process is seen whole.
    let mut child = empty
        .command("/bin/sh")
        .args(["-c", "exit 5"])
        .spawn()
        .expect("spawn sh");
    let pid = child.id();
    assert_eq!(child.wait().expect("wait sh").code(), Some(5));
    let started = pleg.expect(&empty.container_id, EventKind::ContainerStarted);
    assert_eq!(started.pid, Some(pid));
    let died = pleg.expect(&empty.container_id, EventKind::ContainerDied);
    assert_eq!((died.pid, died.exit.map(|e| e.code)), (Some(pid), Some(5)));
    // The running one's exec was held back: its exit is a hint.
    let reader_stdin = reader.stdin.as_mut().expect("stdin");
    reader_stdin.write_all(b"go\n").expect("write to sh");
    assert_eq!(reader.wait().expect("wait sh").code(), Some(4));
    pleg.expect(&running.container_id, EventKind::PodSync);
    // Nothing was taken as a fact for the first two.
    for cg in [&exited, &running] {
        let facts: Vec<_> = pleg
            .drain_events(&cg.container_id)
            .into_iter()
            .filter(|e| e.kind != EventKind::PodSync)
            .collect();
        assert_eq!(facts, vec![], "{}", cg.container_id);
    }
}

// The systemd cgroup driver's names (issue #10, "Cgroup driver"): runc's
// systemd driver needs systemd as PID 1, which these machines lack, so the
// slices are made by hand, as systemd would name them for a burstable and a
// guaranteed pod. The kernel PLEG attributes a process's start and exit in
// each to the right pod and container.
#[test]
fn hand_made_systemd_slices_of_burstable_and_guaranteed_pods_are_attributed() {
    if !privileged("hand_made_systemd_slices_of_burstable_and_guaranteed_pods_are_attributed") {
        return;
    }
    let burstable = ContainerCgroup::new(Layout::SystemdBurstable);
    let guaranteed = ContainerCgroup::new(Layout::SystemdGuaranteed);
    assert!(
        burstable
            .path
            .starts_with("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod")
            && burstable
                .path
                .ends_with(&format!("/cri-containerd-{}.scope", burstable.container_id)),
        "{}",
        burstable.path
    );
    let mut pleg = PlegUnderTest::start(|_| {});
    for (cg, code) in [(&burstable, "5"), (&guaranteed, "6")] {
        let status = cg
            .command("/bin/sh")
            .args(["-c", &format!("exit {code}")])
            .status()
            .expect("run sh");
        assert_eq!(status.code().map(|c| c.to_string()).as_deref(), Some(code));
    }
    for (cg, code) in [(&burstable, 5), (&guaranteed, 6)] {
        let started = pleg.expect(&cg.container_id, EventKind::ContainerStarted);
        assert_eq!(
            started.pod_uid.map(|u| u.to_string()),
            Some(cg.pod_uid.clone()),
            "{}",
            cg.path
        );
        let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
        assert_eq!(
            died.pod_uid.map(|u| u.to_string()),
            Some(cg.pod_uid.clone()),
            "{}",
            cg.path
        );
        assert_eq!(died.exit.map(|e| e.code), Some(code), "{}", cg.path);
    }
}

#[test]
fn died_by_sigkill() {
    if !privileged("died_by_sigkill") {
        return;
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let mut pleg = PlegUnderTest::start(|_| {});
    let mut child = cg
        .command("/bin/sleep")
        .arg("600")
        .spawn()
        .expect("spawn sleep");
    let started = pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    assert_eq!(started.pid, Some(child.id()));
    child.kill().expect("kill");
    assert_eq!(child.wait().expect("wait").signal(), Some(libc::SIGKILL));
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    let exit = died.exit.expect("an exit status");
    assert_eq!(
        (exit.code, exit.signal, exit.oom_killed),
        (137, Some(9), false)
    );
}

#[test]
fn oom_killed() {
    if !privileged("oom_killed") {
        return;
    }
    let cg = ContainerCgroup::with_v1_memory(Layout::Cgroupfs);
    cg.limit_memory(16 << 20);
    let mut pleg = PlegUnderTest::start(|_| {});
    // dd allocates a 256 MiB buffer and fills it from /dev/zero: far over the limit.
    let status = cg
        .command("/bin/dd")
        .args(["if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"])
        .stderr(Stdio::null())
        .status()
        .expect("run dd");
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "dd was not OOM-killed: {status:?}"
    );
    pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    let exit = died.exit.expect("an exit status");
    assert!(exit.oom_killed, "not reported as OOM-killed: {exit:?}");
    assert_eq!((exit.code, exit.signal), (137, Some(9)));
}

/// A static x86-64 program of 129 bytes whose whole life is `exit(3)`: an
/// ELF header, one loadable segment, and `mov eax, 60; mov edi, 3; syscall`.
/// It lives a few microseconds from its exec to its exit, where `/bin/true`
/// spends most of a millisecond in the dynamic loader (over one under load).
#[cfg(target_arch = "x86_64")]
fn exit_3_program() -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const HEADERS: u64 = 64 + 56;
    let code: [u8; 12] = [0xb8, 60, 0, 0, 0, 0xbf, 3, 0, 0, 0, 0x0f, 0x05];
    let size = HEADERS + code.len() as u64;
    let mut elf = Vec::with_capacity(size as usize);
    elf.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    elf.extend_from_slice(&1u32.to_le_bytes()); // EV_CURRENT
    elf.extend_from_slice(&(BASE + HEADERS).to_le_bytes()); // entry
    elf.extend_from_slice(&64u64.to_le_bytes()); // program headers' offset
    elf.extend_from_slice(&0u64.to_le_bytes()); // no section headers
    elf.extend_from_slice(&0u32.to_le_bytes()); // flags
    for half in [64u16, 56, 1, 0, 0, 0] {
        // header size, program header size and count, no sections
        elf.extend_from_slice(&half.to_le_bytes());
    }
    elf.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    elf.extend_from_slice(&5u32.to_le_bytes()); // R + X
    for word in [0, BASE, BASE, size, size, 0x1000] {
        // offset, addresses, sizes in the file and in memory, alignment
        elf.extend_from_slice(&word.to_le_bytes());
    }
    elf.extend_from_slice(&code);
    assert_eq!(elf.len() as u64, size);
    elf
}

#[cfg(target_arch = "x86_64")]
#[test]
fn process_shorter_than_a_millisecond_in_a_new_cgroup_is_reported() {
    use std::os::unix::fs::PermissionsExt;
    if !privileged("process_shorter_than_a_millisecond_in_a_new_cgroup_is_reported") {
        return;
    }
    let program = std::env::temp_dir().join(format!("evpleg-exit-3-{}", std::process::id()));
    std::fs::write(&program, exit_3_program()).expect("write the program");
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755))
        .expect("make it executable");
    // Removed at the end, whatever happens.
    struct Remove<'a>(&'a std::path::Path);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    let _remove = Remove(&program);
    let mut pleg = PlegUnderTest::start(|_| {});
    // Each attempt is a process in a cgroup created right before it, so user space
    // may not have read its mkdir yet when the process runs: the kernel filter goes
    // by ancestry. Every attempt must be reported with its exit code; a preempted
    // attempt (37 ms once on a loaded CI machine) only does not count as short.
    const ATTEMPTS: usize = 20;
    let mut lifetimes = Vec::with_capacity(ATTEMPTS);
    for _ in 0..ATTEMPTS {
        let cg = ContainerCgroup::new(Layout::Cgroupfs);
        let status = cg
            .command(&program.to_string_lossy())
            .status()
            .expect("run exit-3");
        assert_eq!(status.code(), Some(3));
        let started = pleg.expect(&cg.container_id, EventKind::ContainerStarted);
        let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
        assert_eq!(died.exit.map(|e| e.code), Some(3));
        let lifetime = died.at_ns - started.at_ns;
        lifetimes.push(lifetime);
        if lifetime < 1_000_000 {
            break;
        }
    }
    assert!(
        lifetimes.last().is_some_and(|&l| l < 1_000_000),
        "the 129-byte program never lived under 1 ms from its exec to its exit in \
         {ATTEMPTS} attempts (ns): {lifetimes:?}"
    );
}

/// A shell in `cg` that waits for a line on its stdin, then exits 5.
fn waiting_shell(cg: &ContainerCgroup) -> std::process::Child {
    cg.command("/bin/sh")
        .args(["-c", "read line; exit 5"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("spawn sh")
}

/// Writes the line `child` waits for; its exit code once it exited.
fn release(child: &mut std::process::Child) -> Option<i32> {
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("write");
    child.wait().expect("wait").code()
}

#[test]
fn process_started_before_the_agent_reports_its_exit_code() {
    if !privileged("process_started_before_the_agent_reports_its_exit_code") {
        return;
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let mut child = started_shell(&cg);
    let mut pleg = PlegUnderTest::start(|_| {});
    // Learned by the start-up scan with its process running, the main process is
    // uncertain (its exit would be a PodSync hint) until the runtime's pid
    // confirms it; the view is applied before any later record.
    pleg.pleg.reconcile(running_view(&cg, child.id()));
    assert_eq!(release(&mut child), Some(5));
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    assert_eq!(died.exit.map(|e| e.code), Some(5));
    assert_eq!(died.pid, Some(child.id()));
}

/// A waiting shell in `cg`, returned once it has exec'd (it is in the cgroup
/// and its /proc/<pid>/exe is sh).
fn started_shell(cg: &ContainerCgroup) -> std::process::Child {
    let child = waiting_shell(cg);
    let exe = std::path::Path::new("/proc")
        .join(child.id().to_string())
        .join("exe");
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while std::fs::read_link(&exe)
        .map(|p| {
            !p.ends_with("sh")
                && !p.to_string_lossy().contains("dash")
                && !p.to_string_lossy().contains("bash")
        })
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "the shell never started");
        std::thread::yield_now();
    }
    child
}

/// The runtime's view of `cg`'s container running as `pid`.
fn running_view(cg: &ContainerCgroup, pid: u32) -> RuntimeView {
    let pod = PodUid::parse(&cg.pod_uid).expect("pod uid");
    RuntimeView {
        listed_at_ns: monotonic_ns(),
        scope: Some(pod.clone()),
        containers: vec![RuntimeContainer {
            id: ContainerId::parse(&cg.container_id).expect("container id"),
            pod,
            sandbox: false,
            running: true,
            pid: Some(pid),
            contradicted: false,
        }],
    }
}

/// A view is a lazy command: the reader is not woken for it when it looks
/// at its commands within `LAZY_BOUND` anyway (records came recently). An
/// idle reader sleeps 5 s between passes: it must be woken, and the view
/// applied at once. Fails if lazy commands never wake the reader (the view
/// waits for the 5 s pass).
#[test]
fn a_view_sent_to_an_idle_reader_is_applied_at_once() {
    if !privileged("a_view_sent_to_an_idle_reader_is_applied_at_once") {
        return;
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let mut child = started_shell(&cg);
    let pleg = PlegUnderTest::start(|_| {});
    let stats = pleg.pleg.stats().clone();
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    // Idle: a pass of the reader's loop was made (its heartbeat is set), then
    // none for twice its busy poll (passes come at least that often while
    // records came recently), so it is in its 5 s wait, with more than
    // `LAZY_BOUND` of it left.
    let idle = 2 * LAZY_BOUND.as_nanos() as u64;
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while load(&stats.heartbeat_ns) == 0
        || monotonic_ns().saturating_sub(load(&stats.heartbeat_ns)) < idle
    {
        assert!(Instant::now() < deadline, "the reader never went idle");
        std::thread::sleep(Duration::from_millis(10));
    }
    let confirmed = load(&stats.confirmed);
    let sent = Instant::now();
    pleg.pleg.reconcile(running_view(&cg, child.id()));
    while load(&stats.confirmed) == confirmed {
        assert!(
            sent.elapsed() < Duration::from_secs(1),
            "the view sent to an idle reader was not applied within 1 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(release(&mut child), Some(5));
}

/// A view of one pod queued before another pod's death is read waits until
/// that death's event is delivered (it cannot change how the record is
/// handled, and at 1 000 deaths/s the relist's view of one death was applied
/// before the next death: issue #29). The probe reads, on the reader thread,
/// whether the view was applied when the death's record is handled. Fails if
/// every command queued is applied before the next record.
#[test]
fn another_pods_view_is_applied_after_the_record_it_came_before() {
    if !privileged("another_pods_view_is_applied_after_the_record_it_came_before") {
        return;
    }
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    // Pod A's shell runs before the PLEG: learned by the start-up scan, its
    // main process uncertain until a view confirms it (counted).
    let cg_a = ContainerCgroup::new(Layout::Cgroupfs);
    let mut shell_a = started_shell(&cg_a);
    let cg_b = ContainerCgroup::new(Layout::Cgroupfs);
    let gate = std::sync::Arc::new(ReaderGate::default());
    let mut pleg = PlegUnderTest::start_gated(1000, Some(gate.clone()), |_| {});
    let mut main_b = waiting_shell(&cg_b);
    pleg.expect(&cg_b.container_id, EventKind::ContainerStarted);
    // A second process in B's cgroup: its exit is the record the reader is
    // held at while the view is queued and B's main process dies.
    let mut other_b = started_shell(&cg_b);
    let other_pid = other_b.id();
    assert!(
        pleg.records_until(
            RECORD_TIMEOUT,
            |e| matches!(e, KernelEvent::Exec(x) if x.process.pid == other_pid)
        ),
        "the second process's exec was never read"
    );
    let stats = pleg.pleg.stats().clone();
    let confirmed_before = stats.confirmed.load(Relaxed);
    // What `confirmed` was when B's main exit was handled (u64::MAX: not yet).
    let at_death = std::sync::Arc::new(AtomicU64::new(u64::MAX));
    let (probe_stats, probe_at, main_pid) = (stats.clone(), at_death.clone(), main_b.id());
    gate.probe(move |e| {
        if matches!(e, KernelEvent::Exit(x) if x.process.pid == main_pid) {
            probe_at.store(probe_stats.confirmed.load(Relaxed), Relaxed);
        }
    });
    gate.close();
    assert_eq!(release(&mut other_b), Some(5));
    assert!(
        gate.wait_held(RECORD_TIMEOUT),
        "the reader never reached the gate"
    );
    pleg.pleg.reconcile(running_view(&cg_a, shell_a.id()));
    // B's main exits while the reader is held: its record is in the ring
    // (written before the exit is reported to its parent).
    assert_eq!(release(&mut main_b), Some(5));
    assert_eq!(stats.confirmed.load(Relaxed), confirmed_before);
    gate.open();
    let died = pleg.expect(&cg_b.container_id, EventKind::ContainerDied);
    assert_eq!(died.exit.map(|e| e.code), Some(5));
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while stats.confirmed.load(Relaxed) == confirmed_before {
        assert!(Instant::now() < deadline, "pod A's view was never applied");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        at_death.load(Relaxed),
        confirmed_before,
        "pod A's view was applied before pod B's death was handled"
    );
    assert_eq!(release(&mut shell_a), Some(5));
}

/// A pod's view listing one running sandbox, `id`, whose cgroup the tracker
/// does not know: it waits for a rescan.
fn unknown_sandbox_view(pod: PodUid, id: u64) -> RuntimeView {
    RuntimeView {
        listed_at_ns: monotonic_ns(),
        scope: Some(pod.clone()),
        containers: vec![RuntimeContainer {
            id: ContainerId::parse(&format!("{id:064x}")).expect("id"),
            pod,
            sandbox: true,
            running: true,
            pid: None,
            contradicted: false,
        }],
    }
}

/// A wave of pod relists each listing a running container whose cgroup the
/// tracker does not know (a runtime with no cgroup for the sandbox, as the
/// benchmark's fake): each view used to rescan the whole tree on the reader
/// thread at once, so at 1 000 pods the reader read no record for seconds. Now
/// the views wait for the next rescan the policy allows (at least
/// `RESCAN_MIN_INTERVAL` apart), one rescan serves them all, and a death behind
/// the wave is delivered with its exit code.
#[test]
fn a_wave_of_views_listing_unknown_containers_costs_few_rescans() {
    if !privileged("a_wave_of_views_listing_unknown_containers_costs_few_rescans") {
        return;
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let mut pleg = PlegUnderTest::start(|_| {});
    let mut child = waiting_shell(&cg);
    pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    let stats = pleg.pleg.stats().clone();
    let rescans = || stats.rescans.load(std::sync::atomic::Ordering::Relaxed);
    let unfound = || stats.unfound.load(std::sync::atomic::Ordering::Relaxed);
    let (before, unfound_before) = (rescans(), unfound());
    let wave = Instant::now();
    const PODS: u64 = 500;
    for i in 0..PODS {
        let pod = PodUid::parse(&format!("{i:08x}-0000-4000-8000-00000000feed")).expect("uid");
        pleg.pleg
            .reconcile(unknown_sandbox_view(pod, 0xfeed_0000 + i));
    }
    assert_eq!(release(&mut child), Some(5));
    // Commands are applied before any record written after they were sent: the
    // death is read after every view of the wave was applied once.
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    assert_eq!(died.exit.map(|e| e.code), Some(5));
    let took = wave.elapsed();
    let during = rescans() - before;
    let allowed = 1 + (took.as_nanos() / RESCAN_MIN_INTERVAL.as_nanos()) as u64;
    assert!(
        during <= allowed,
        "{during} rescans for {PODS} views in {took:?} (at most {allowed} allowed)"
    );
    // The views left waiting get their rescan: none waits forever, and each
    // view's container ends up remembered as not found.
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while unfound() - unfound_before < PODS {
        assert!(
            Instant::now() < deadline,
            "the waiting views never got their rescan: {} of {PODS} containers not found after {} rescans",
            unfound() - unfound_before,
            rescans() - before
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!("{PODS} views, death delivered {took:?} after the first: {during} rescans meanwhile");
}

/// The rescan a view asks for walks the tree on the walker thread, not on the
/// real-time reader (issue #29: at 21 000 cgroups the reader walked for about
/// a second and every death waited): with 10 000 cgroups below the roots, a
/// death right after such a view is delivered before the walk reports, and
/// the walk then tells the view its container is not found.
#[test]
fn a_rescan_for_a_view_does_not_hold_the_reader() {
    if !privileged("a_rescan_for_a_view_does_not_hold_the_reader") {
        return;
    }
    // The ballast exists before the PLEG starts: its start-up scan learns it.
    let ballast = ContainerCgroup::new(Layout::Cgroupfs);
    let ballast_dir = evpleg_tests::cgroups::cgroup2().join(ballast.path.trim_start_matches('/'));
    const BALLAST: usize = 10_000;
    /// Removed before the ballast's own cgroup, even when the test fails.
    struct Dirs(Vec<std::path::PathBuf>);
    impl Drop for Dirs {
        fn drop(&mut self) {
            for d in self.0.iter().rev() {
                let _ = std::fs::remove_dir(d);
            }
        }
    }
    let mut dirs = Dirs(Vec::with_capacity(BALLAST));
    for i in 0..BALLAST {
        let d = ballast_dir.join(format!("b{i}"));
        std::fs::create_dir(&d).unwrap_or_else(|e| panic!("mkdir {}: {e}", d.display()));
        dirs.0.push(d);
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let mut pleg = PlegUnderTest::start(|_| {});
    let mut child = waiting_shell(&cg);
    pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    let stats = pleg.pleg.stats().clone();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let (rescans, unfound) = (load(&stats.rescans), load(&stats.unfound));
    let pod = PodUid::parse("0000beef-0000-4000-8000-00000000feed").expect("uid");
    pleg.pleg.reconcile(unknown_sandbox_view(pod, 0xbeef));
    assert_eq!(release(&mut child), Some(5));
    // The view is applied before the death's record is read: a rescan on the
    // reader would end before the death is delivered.
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    assert_eq!(died.exit.map(|e| e.code), Some(5));
    assert_eq!(
        load(&stats.rescans),
        rescans,
        "the death waited for the walk of {BALLAST} cgroups"
    );
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while load(&stats.rescans) == rescans || load(&stats.unfound) == unfound {
        assert!(
            Instant::now() < deadline,
            "the walk never reported, or the view's container was not marked not found"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(pleg);
    for d in std::mem::take(&mut dirs.0).iter().rev() {
        std::fs::remove_dir(d).unwrap_or_else(|e| panic!("rmdir {}: {e}", d.display()));
    }
}

#[test]
fn process_outside_the_roots_is_not_reported() {
    if !privileged("process_outside_the_roots_is_not_reported") {
        return;
    }
    let pleg = PlegUnderTest::start(|_| {});
    eprintln!("{}", kernel_checks::kernel_filter(&pleg, RECORD_TIMEOUT));
}

fn thread_helper() -> ThreadHelper {
    ThreadHelper {
        program: env!("CARGO_BIN_EXE_evpleg-thread-helper").into(),
        prefix: Vec::new(),
    }
}

/// Contract clause 7: eight threads killed together by `exit_group` from a thread
/// that is not the leader make one exit record with the process's status.
#[test]
fn exit_group_from_a_non_leader_thread_is_reported_once() {
    if !privileged("exit_group_from_a_non_leader_thread_is_reported_once") {
        return;
    }
    let mut pleg = PlegUnderTest::start(|_| {});
    eprintln!(
        "{}",
        kernel_checks::exit_group_from_thread(&mut pleg, &thread_helper(), 20, RECORD_TIMEOUT)
    );
}

/// Contract clause 7: the leader thread exits first, the last thread later; one
/// record, with the status waitpid gives.
#[test]
fn leader_exiting_first_is_reported_once_with_the_waitpid_status() {
    if !privileged("leader_exiting_first_is_reported_once_with_the_waitpid_status") {
        return;
    }
    let mut pleg = PlegUnderTest::start(|_| {});
    eprintln!(
        "{}",
        kernel_checks::leader_exits_first(&mut pleg, &thread_helper(), RECORD_TIMEOUT)
    );
}

/// A ring buffer of one page, its reader held while 200 processes run: every
/// record is either read or counted as dropped by the kernel, and the drops
/// request a relist.
#[test]
fn one_page_ring_buffer_under_a_burst_counts_drops_and_requests_a_relist() {
    if !privileged("one_page_ring_buffer_under_a_burst_counts_drops_and_requests_a_relist") {
        return;
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let gate = ReaderGate::closed();
    let pleg = PlegUnderTest::start_gated(1000, Some(gate.clone()), |c| {
        c.ring_buffer_bytes = 4096;
    });
    // A first record holds the reader at the gate.
    let status = cg.command("/bin/true").status().expect("run true");
    assert!(status.success());
    assert!(
        gate.wait_held(RECORD_TIMEOUT),
        "the reader never reached the gate"
    );
    let processes = 200;
    let status = cg
        .command("/bin/sh")
        .args([
            "-c",
            &format!("i=0; while [ $i -lt {processes} ]; do /bin/true; i=$((i+1)); done"),
        ])
        .status()
        .expect("run the burst");
    assert!(status.success());
    // The shell's exec and exit, and an exec and an exit per /bin/true.
    let burst_records = 2 + 2 * processes;
    gate.open();
    let id = cg.id();
    let expected = burst_records + 2;
    let stats = pleg.pleg.stats().clone();
    let dropped = || {
        stats
            .kernel_dropped
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    // Every record of the cgroup is read or counted as dropped (the reader reads
    // the kernel's counters every 100 ms); an uncounted loss never gets there.
    let mut read = 0u64;
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while dropped() == 0 || read + dropped() < expected {
        assert!(
            Instant::now() < deadline,
            "{expected} records into a 4 KiB ring: {read} read, {} counted as dropped",
            dropped()
        );
        pleg.records_until(Duration::from_millis(20), |e| {
            match e {
                KernelEvent::Exec(x) if x.cgroup_id == id => read += 1,
                KernelEvent::Exit(x) if x.cgroup_id == id => read += 1,
                _ => {}
            }
            false
        });
    }
    assert!(
        pleg.wait_relist(RECORD_TIMEOUT),
        "kernel drops requested no relist"
    );
    eprintln!(
        "{expected} records into a 4 KiB ring, reader held: {read} read, {} dropped, {} relist requests",
        dropped(),
        pleg.relist.count()
    );
    assert!(pleg.relist.count() > 0);
}

/// Runs `sh -c 'read line; exit 7'` as the container's main process in a private
/// PID namespace, as runc does: the process that joins the cgroup unshares the
/// namespace, forks and exits; the child (pid 1 inside), reparented to the
/// shim outside the container, execs.
#[test]
fn main_process_in_a_private_pid_namespace() {
    if !privileged("main_process_in_a_private_pid_namespace") {
        return;
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let mut pleg = PlegUnderTest::start(|_| {});
    let procs = path_cstring(&cg.dir().join("cgroup.procs"));
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", "read line; exit 7"]).stdin(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            as_runc_would(|| {
                join_cgroup(&procs)?;
                if libc::unshare(libc::CLONE_NEWPID) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        });
    }
    let mut waiter = cmd.spawn().expect("spawn");
    let started = pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    let main_pid = started.pid.expect("a pid");
    assert_ne!(
        main_pid,
        waiter.id(),
        "the waiting parent never exec'd: not the main process"
    );
    assert_eq!(
        ns_pid(main_pid),
        Some(1),
        "the main process is pid 1 in its namespace"
    );
    assert_eq!(release(&mut waiter), Some(7));
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    assert_eq!(
        (died.pid, died.exit.map(|e| e.code)),
        (Some(main_pid), Some(7))
    );
    // The waiter's own exit is not a second death.
    assert!(pleg.drain_events(&cg.container_id).is_empty());
}

/// A pod-shared PID namespace: a sandbox (pid 1 of the namespace) in one cgroup, a
/// container joining its namespace in another; the container's main process is
/// not pid 1 there.
#[test]
fn main_process_in_a_pod_shared_pid_namespace() {
    if !privileged("main_process_in_a_pod_shared_pid_namespace") {
        return;
    }
    let sandbox = ContainerCgroup::new(Layout::Cgroupfs);
    let container = sandbox.sibling(Layout::Cgroupfs);
    let mut pleg = PlegUnderTest::start(|_| {});

    let procs = path_cstring(&sandbox.dir().join("cgroup.procs"));
    let mut cmd = std::process::Command::new("/bin/sleep");
    cmd.arg("600");
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            as_runc_would(|| {
                join_cgroup(&procs)?;
                if libc::unshare(libc::CLONE_NEWPID) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        });
    }
    let mut sandbox_waiter = cmd.spawn().expect("spawn sandbox");
    let pause = pleg
        .expect(&sandbox.container_id, EventKind::ContainerStarted)
        .pid
        .expect("pid");
    assert_eq!(ns_pid(pause), Some(1));

    let ns =
        std::fs::File::open(format!("/proc/{pause}/ns/pid")).expect("open the sandbox's pid ns");
    let ns_fd = std::os::fd::AsRawFd::as_raw_fd(&ns);
    let procs = path_cstring(&container.dir().join("cgroup.procs"));
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", "read line; exit 7"]).stdin(Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec; `ns` outlives spawn.
    unsafe {
        cmd.pre_exec(move || {
            as_runc_would(|| {
                join_cgroup(&procs)?;
                if libc::setns(ns_fd, libc::CLONE_NEWPID) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        });
    }
    let mut waiter = cmd.spawn().expect("spawn container");
    let started = pleg.expect(&container.container_id, EventKind::ContainerStarted);
    let main_pid = started.pid.expect("pid");
    let inner = ns_pid(main_pid).expect("NSpid of the main process");
    assert!(
        inner > 1,
        "the container shares the sandbox's namespace (pid {inner} there)"
    );
    assert_eq!(release(&mut waiter), Some(7));
    let died = pleg.expect(&container.container_id, EventKind::ContainerDied);
    assert_eq!(
        (died.pid, died.exit.map(|e| e.code)),
        (Some(main_pid), Some(7))
    );
    // The sandbox is untouched until killed.
    assert!(pleg.drain_events(&sandbox.container_id).is_empty());
    // SAFETY: plain signal.
    unsafe { libc::kill(pause as i32, libc::SIGKILL) };
    sandbox_waiter.wait().expect("wait sandbox");
    let died = pleg.expect(&sandbox.container_id, EventKind::ContainerDied);
    assert_eq!(died.exit.and_then(|e| e.signal), Some(9));
}

#[test]
fn full_event_channel_is_counted_and_requests_a_relist() {
    if !privileged("full_event_channel_is_counted_and_requests_a_relist") {
        return;
    }
    // A channel of one, never read: the second event cannot be delivered.
    let pleg = PlegUnderTest::start_with_channel(1, |_| {});
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let status = cg
        .command("/bin/sh")
        .args(["-c", "exit 1"])
        .status()
        .expect("run sh");
    assert_eq!(status.code(), Some(1));
    assert!(
        pleg.wait_relist(RECORD_TIMEOUT),
        "no relist requested for a discarded event"
    );
    assert!(
        pleg.pleg
            .stats()
            .discarded
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
}

/// Clause 5: a reader that stops without being asked (here by the test hook) is
/// reported degraded, counted, and relists.
#[test]
fn reader_stopped_by_the_test_hook_is_degraded_and_relists() {
    if !privileged("reader_stopped_by_the_test_hook_is_degraded_and_relists") {
        return;
    }
    let pleg = PlegUnderTest::start(|_| {});
    assert_eq!(pleg.pleg.health(), KernelHealth::Running);
    let before = monotonic_ns();
    pleg.pleg.fail_reader_for_test();
    let deadline = Instant::now() + RECORD_TIMEOUT;
    let health = loop {
        let h = pleg.pleg.health();
        if h != KernelHealth::Running {
            break h;
        }
        assert!(
            Instant::now() < deadline,
            "the reader's stop was not reported"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let KernelHealth::Degraded {
        part,
        since_ns,
        reason,
    } = health
    else {
        unreachable!()
    };
    assert_eq!(part, "ring-buffer reader");
    assert!(since_ns >= before && since_ns <= monotonic_ns());
    assert!(reason.contains("test hook"), "{reason}");
    let stats = pleg.pleg.stats();
    assert_eq!(
        stats
            .reader_failures
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert_eq!(stats.relist_requests.get(RelistReason::ReaderStopped), 1);
    assert!(pleg.relist.count() >= 1);
}

/// In a pre_exec, the process tree runc and its shim make: this process is the
/// shim (outside the container, a child subreaper); its child, the runtime,
/// runs `enter` (joins the container's cgroup, unshares or joins a PID
/// namespace), forks the init and exits; the init, reparented to the shim as
/// runc's is long before its start, returns and execs the entrypoint. Its
/// parent is then outside the container, as the kernel PLEG's main-process
/// rule expects of a runtime's init (a process whose parent is inside, such as
/// an OCI hook, is not the main process). The shim exits with the init's
/// status.
unsafe fn as_runc_would(enter: impl Fn() -> std::io::Result<()>) -> std::io::Result<()> {
    // SAFETY: fork in a single-threaded child of fork; async-signal-safe calls only.
    unsafe {
        if libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // The shim tells the init once the runtime is reaped (the init is its
        // child by then).
        let mut reparented = [0i32; 2];
        if libc::pipe(reparented.as_mut_ptr()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let [read_end, write_end] = reparented;
        let runtime = libc::fork();
        if runtime < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if runtime > 0 {
            // std's spawn waits for its exec-error pipe to close: the init closes
            // it by exec'ing, the shim must close its copy (and every other fd but
            // the write end of its own pipe, which is above the read end).
            libc::syscall(libc::SYS_close_range, 3u32, (write_end - 1) as u32, 0u32);
            libc::syscall(
                libc::SYS_close_range,
                (write_end + 1) as u32,
                u32::MAX,
                0u32,
            );
            loop {
                let mut status = 0;
                let pid = libc::waitpid(-1, &mut status, 0);
                if pid < 0 {
                    libc::_exit(127);
                }
                if pid == runtime {
                    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
                        libc::_exit(126);
                    }
                    libc::write(write_end, b"r".as_ptr().cast(), 1);
                    continue;
                }
                let code = if libc::WIFEXITED(status) {
                    libc::WEXITSTATUS(status)
                } else {
                    128 + libc::WTERMSIG(status)
                };
                libc::_exit(code);
            }
        }
        libc::close(write_end);
        enter()?;
        let init = libc::fork();
        if init < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if init > 0 {
            libc::_exit(0);
        }
        let mut byte = 0u8;
        if libc::read(read_end, (&raw mut byte).cast(), 1) != 1 {
            return Err(std::io::Error::last_os_error());
        }
        libc::close(read_end);
    }
    Ok(())
}

/// The pid of `pid` in its own (innermost) PID namespace, from NSpid.
fn ns_pid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Issue #24 item 7: the SCHED_FIFO reader drops to normal priority once its
/// budget is spent, counted once per window (here a budget of nothing in a
/// window of an hour: the first check past any CPU spends it).
#[test]
fn the_real_time_reader_drops_to_normal_priority_past_its_budget() {
    if !privileged("the_real_time_reader_drops_to_normal_priority_past_its_budget") {
        return;
    }
    let pleg = PlegUnderTest::start(|c| {
        c.realtime_budget = evpleg_pleg::kernel::rt_budget::RtBudgetConfig {
            window: Duration::from_secs(3600),
            budget: Duration::ZERO,
        };
    });
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let throttled = || {
        pleg.pleg
            .stats()
            .rt_throttled
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while throttled() == 0 {
        assert!(
            Instant::now() < deadline,
            "the reader never spent its budget within {RECORD_TIMEOUT:?}"
        );
        assert!(
            cg.command("/bin/true")
                .status()
                .expect("run true")
                .success()
        );
    }
    for _ in 0..20 {
        assert!(
            cg.command("/bin/true")
                .status()
                .expect("run true")
                .success()
        );
    }
    let barrier = ContainerCgroup::new(Layout::Cgroupfs);
    assert!(
        barrier
            .command("/bin/true")
            .status()
            .expect("run true")
            .success()
    );
    let mut pleg = pleg;
    pleg.expect(&barrier.container_id, EventKind::ContainerStarted);
    assert_eq!(
        pleg.pleg
            .stats()
            .rt_throttled
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "once per window, and the reader still reads at normal priority"
    );
}

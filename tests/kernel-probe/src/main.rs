//! `evpleg-kernel-probe`: the kernel PLEG's privileged checks as one binary, for the
//! kernel matrix (`cargo xtask test`, docs/kernels.md). A QEMU guest's
//! `/init` runs it as root on a freshly booted kernel, with cgroup2 mounted on
//! `/sys/fs/cgroup`; it prints one line per fact or check on stdout, which the init
//! sends to the results serial port:
//!
//! ```text
//! KERNEL <release>
//! FEATURE <name> PRESENT|ABSENT <detail>
//! RESULT <check> PASS|FAIL|ABSENT <detail>
//! LOG <check> <line>         every line of a failure's message (the verifier's log)
//! DONE <passed> <failed>
//! ```
//!
//! The assertions are those of `tests/tests/kernel_pleg.rs`, made with the same
//! support code (`evpleg-tests`; the checks both run are in
//! `evpleg_tests::kernel_checks`), plus checks of the raw records (wait status,
//! OOM victim, cgroup ids, ppid and start time against /proc) so that a field read
//! at a wrong offset cannot pass as a zero. The multi-threaded process of the
//! thread checks is the probe itself, run as `evpleg-kernel-probe --thread-helper
//! <mode> <args>` (`evpleg_tests::threads`). Timings are reported, never asserted: a guest under software emulation
//! is 10-20x slower than the host. A check whose kernel feature is truly absent
//! says `ABSENT` with the reason.
//!
//! Usage: `evpleg-kernel-probe [--object PATH]`: PATH is loaded instead of the
//! embedded eBPF object (e.g. a deliberately broken build, to see the verifier's
//! message on an old kernel). `--help` prints the usage and touches nothing.
//!
//! It is built as `cargo test --workspace` builds it (debug profile, dynamically
//! linked; `tests/probe_cli.rs` makes cargo build the binary), so it shares that build;
//! the initramfs carries the shared libraries it needs (docs/kernels.md).

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evpleg_core::lifecycle::{EventKind, EventSource};
use evpleg_pleg::kernel::btf;
use evpleg_pleg::kernel::btf::Btf;
use evpleg_pleg::kernel::event::KernelEvent;
use evpleg_pleg::kernel::index::cgroup2_mount;
use evpleg_pleg::kernel::loader::{PROGRAMS, embedded_object_present, exit_program};
use evpleg_tests::cgroups::{ContainerCgroup, Layout};
use evpleg_tests::kernel_checks::{self, ThreadHelper};
use evpleg_tests::pleg::PlegUnderTest;
use evpleg_tests::threads;

/// How long to wait for a record that should come at once (generous: emulated).
const RECORD_TIMEOUT: Duration = Duration::from_secs(30);

/// Processes of the exit_group check (each a fresh container, emulated: slow).
const THREAD_ROUNDS: u32 = 5;

/// The first argument that makes the probe the thread checks' helper process.
const THREAD_HELPER: &str = "--thread-helper";

/// The probe itself, re-executed as the multi-threaded helper.
fn thread_helper() -> ThreadHelper {
    ThreadHelper {
        program: std::env::current_exe().expect("the probe's own path"),
        prefix: vec![THREAD_HELPER.to_owned()],
    }
}

/// The message and location of the last panic, set by the panic hook.
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// How a check that did not fail ended.
enum Outcome {
    Pass(String),
    /// The kernel lacks what the check needs; the reason says what.
    Absent(String),
}

#[derive(Default)]
struct Report {
    passed: u32,
    failed: u32,
}

impl Report {
    /// Runs `check`, printing its RESULT line; a panic is a failure whose full
    /// message follows as LOG lines. Returns the check's value when it passed.
    fn run<T>(&mut self, name: &str, check: impl FnOnce() -> (T, Outcome)) -> Option<T> {
        let started = Instant::now();
        let result = panic::catch_unwind(AssertUnwindSafe(check));
        let took = format!("[{:.1} s]", started.elapsed().as_secs_f64());
        match result {
            Ok((value, Outcome::Pass(detail))) => {
                self.passed += 1;
                line(&format!("RESULT {name} PASS {detail} {took}"));
                Some(value)
            }
            Ok((_, Outcome::Absent(detail))) => {
                line(&format!("RESULT {name} ABSENT {detail} {took}"));
                None
            }
            Err(payload) => {
                self.failed += 1;
                let message = LAST_PANIC
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .unwrap_or_else(|| panic_text(payload.as_ref()));
                let first = message.lines().next().unwrap_or("(no message)");
                let verdict = verifier_verdict(&message)
                    .map(|v| format!(" | verifier: {v}"))
                    .unwrap_or_default();
                line(&format!("RESULT {name} FAIL {first}{verdict} {took}"));
                for l in message.lines() {
                    line(&format!("LOG {name} {l}"));
                }
                None
            }
        }
    }

    fn check(&mut self, name: &str, check: impl FnOnce() -> Outcome) {
        self.run(name, || ((), check()));
    }
}

/// Prints one line on stdout and flushes it (the serial port may be all that is
/// left of a guest that crashes next).
fn line(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

/// The verifier's own conclusion in a load error: the lines right before its
/// statistics ("verification time", "processed N insns"), after the instruction
/// trace. The log's first line is often an unrelated note.
fn verifier_verdict(message: &str) -> Option<String> {
    if !message.contains("Verifier output:") {
        return None;
    }
    let lines: Vec<&str> = message.lines().map(str::trim).collect();
    let end = lines
        .iter()
        .position(|l| l.starts_with("verification time") || l.starts_with("processed "))
        .unwrap_or(lines.len());
    let is_trace = |l: &str| {
        l.is_empty()
            || l.starts_with(';')
            || l.split_once(':')
                .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut verdict: Vec<&str> = lines[..end]
        .iter()
        .rev()
        .take_while(|l| !is_trace(l))
        .take(3)
        .copied()
        .collect();
    verdict.reverse();
    (!verdict.is_empty()).then(|| verdict.join(" / "))
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}

const USAGE: &str = "usage: evpleg-kernel-probe [--object PATH]";

fn main() {
    let all: Vec<String> = std::env::args().collect();
    if all.get(1).map(String::as_str) == Some(THREAD_HELPER) {
        // The probe re-executed as the thread checks' main process.
        threads::helper_main(&all[2..]);
    }
    let mut object = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--object" => object = args.next().map(PathBuf::from),
            "--help" | "-h" => {
                println!("{USAGE}");
                return;
            }
            other => {
                eprintln!("{USAGE} (unknown argument {other:?})");
                std::process::exit(2);
            }
        }
    }
    panic::set_hook(Box::new(|info| {
        let message = panic_text(info.payload());
        let at = info
            .location()
            .map(|l| format!(" (at {}:{})", l.file(), l.line()))
            .unwrap_or_default();
        // The first line carries the location; a multi-line message (the
        // verifier's log) follows unchanged.
        let full = match message.split_once('\n') {
            Some((first, rest)) => format!("{first}{at}\n{rest}"),
            None => format!("{message}{at}"),
        };
        eprintln!("probe: check failed: {full}");
        *LAST_PANIC.lock().unwrap_or_else(|e| e.into_inner()) = Some(full);
    }));

    let mut report = Report::default();
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    line(&format!("KERNEL {}", release.trim()));
    let memory_controller = features();
    let loaded = report.run("load", || load(object));
    if let Some((mut pleg, created)) = loaded {
        report.check("exec_exit_records", || {
            Outcome::Pass(kernel_checks::exec_exit_records(&pleg, RECORD_TIMEOUT))
        });
        report.check("exit_code_7_and_cgroup_records", || {
            exit_code_7_and_cgroup_records(&mut pleg)
        });
        report.check("sigkill", || sigkill(&mut pleg));
        report.check("oom_kill", || oom_kill(&mut pleg, memory_controller));
        report.check("kernel_filter", || {
            Outcome::Pass(kernel_checks::kernel_filter(&pleg, RECORD_TIMEOUT))
        });
        report.check("exit_group_from_thread", || {
            Outcome::Pass(kernel_checks::exit_group_from_thread(
                &mut pleg,
                &thread_helper(),
                THREAD_ROUNDS,
                RECORD_TIMEOUT,
            ))
        });
        report.check("leader_exits_first", || {
            Outcome::Pass(kernel_checks::leader_exits_first(
                &mut pleg,
                &thread_helper(),
                RECORD_TIMEOUT,
            ))
        });
        report.check("short_process", || short_process(&mut pleg));
        report.check("counters", || counters(&pleg));
        drop(pleg);
        // Run on a host, leave nothing behind.
        for dir in created.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
    line(&format!("DONE {} {}", report.passed, report.failed));
    std::process::exit(i32::from(report.failed > 0));
}

/// Prints what this kernel has and lacks of what the programs could use; returns
/// whether cgroup2 has the memory controller (for the OOM check).
fn features() -> bool {
    let feature = |name: &str, present: bool, detail: &str| {
        let state = if present { "PRESENT" } else { "ABSENT" };
        line(&format!("FEATURE {name} {state} {detail}"));
    };
    match Btf::from_sys_fs() {
        Ok(kernel) => {
            feature(
                "btf",
                true,
                &format!("{} ({} types)", btf::VMLINUX_BTF_PATH, kernel.type_count()),
            );
            match kernel.tracepoint_arg_count("sched_process_exit") {
                Ok(n) => feature(
                    "sched_process_exit.group_dead",
                    n >= 2,
                    &format!(
                        "sched_process_exit has {n} argument(s): {}",
                        if n >= 2 {
                            "sched_process_exit_group_dead attached (the kernel's last-thread decision)"
                        } else {
                            "sched_process_exit attached (signal_struct.live == 0, deduped by tgid and start time)"
                        }
                    ),
                ),
                Err(e) => feature("sched_process_exit.group_dead", false, &e.to_string()),
            }
            match kernel.tracepoint_arg_is_pointer("mark_victim", 0) {
                Ok(task) => feature(
                    "mark_victim.task_arg",
                    task,
                    if task {
                        "argument 0 is a struct task_struct *; the victim's pid is read from it"
                    } else {
                        "argument 0 is the victim's pid (the older form); used as is"
                    },
                ),
                Err(e) => feature("mark_victim.task_arg", false, &e.to_string()),
            }
        }
        Err(e) => feature("btf", false, &e.to_string()),
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    feature(
        "smp",
        cpus >= 2,
        &format!("{cpus} CPU(s) online: the threads of one process can exit on two at once"),
    );
    feature(
        "tracefs",
        Path::new("/sys/kernel/tracing/events").exists(),
        "not needed: the programs are BTF tracepoints",
    );
    feature(
        "embedded_object",
        embedded_object_present(),
        "the eBPF object built by `cargo xtask build`",
    );
    let controllers = cgroup2_mount()
        .ok()
        .flatten()
        .and_then(|m| std::fs::read_to_string(m.join("cgroup.controllers")).ok())
        .unwrap_or_default();
    let memory = controllers.split_whitespace().any(|c| c == "memory");
    feature(
        "cgroup2.memory",
        memory,
        &format!("cgroup.controllers: {}", controllers.trim()),
    );
    memory
}

/// Loads and attaches the programs. The Kubernetes root cgroups exist first, as
/// on a node where the kubelet runs (a root created later is only watched once its
/// mkdir is read); those created here are returned, to be removed at the end.
fn load(object: Option<PathBuf>) -> ((PlegUnderTest, Vec<PathBuf>), Outcome) {
    let mount = cgroup2_mount()
        .expect("read /proc/self/mountinfo")
        .expect("cgroup2 is mounted (the init mounts it on /sys/fs/cgroup)");
    let mut created = Vec::new();
    for dir in [mount.join("kubepods"), mount.join("kubepods/besteffort")] {
        if !dir.exists() {
            std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
            created.push(dir);
        }
    }
    let from = match &object {
        Some(path) => format!("object {}", path.display()),
        None => "embedded object".to_owned(),
    };
    let pleg = PlegUnderTest::start(|c| c.object = object);
    let o = *pleg.pleg.offsets();
    let detail = format!(
        "{from}: {} programs verified and attached (exit program {}); BTF offsets \
         task_struct.exit_code={} task_struct.signal={} signal_struct.live={} \
         signal_struct.oom_mm={} signal_struct.flags={} signal_struct.group_exit_code={} \
         task_struct.mm={} task_struct.start_boottime={} mark_victim arg {}",
        PROGRAMS.len(),
        exit_program(&o),
        o.task_exit_code,
        o.task_signal,
        o.signal_live,
        o.signal_oom_mm,
        o.signal_flags,
        o.signal_group_exit_code,
        o.task_mm,
        o.task_start_boottime,
        if o.oom_victim_arg_is_task != 0 {
            "task"
        } else {
            "pid"
        }
    );
    ((pleg, created), Outcome::Pass(detail))
}

/// A container whose main process exits with code 7: mkdir record with the
/// cgroup's id and level, ContainerStarted with the parsed pod UID and container
/// id, the raw wait status 0x700, ContainerDied (7), then the rmdir record and
/// a silent rmdir.
fn exit_code_7_and_cgroup_records(pleg: &mut PlegUnderTest) -> Outcome {
    let mut cg = ContainerCgroup::new(Layout::Cgroupfs);
    let id = cg.id();
    let (mkdir, _) = pleg.record(
        RECORD_TIMEOUT,
        |e| matches!(e, KernelEvent::CgroupMkdir(c) if c.path == cg.path),
    );
    let KernelEvent::CgroupMkdir(mkdir) = mkdir else {
        unreachable!()
    };
    assert_eq!(
        (
            mkdir.hierarchy_id,
            mkdir.cgroup_id,
            mkdir.level,
            mkdir.truncated
        ),
        (0, id, 4, false),
        "mkdir record of {}: (hierarchy, cgroup id, level, truncated)",
        cg.path
    );
    let mut child = cg
        .command("/bin/sh")
        .args(["-c", "exit 7"])
        .spawn()
        .expect("spawn sh");
    let pid = child.id();
    assert_eq!(child.wait().expect("wait").code(), Some(7));
    let (exit, _) = pleg.record(
        RECORD_TIMEOUT,
        |e| matches!(e, KernelEvent::Exit(x) if x.process.pid == pid),
    );
    let KernelEvent::Exit(exit) = exit else {
        unreachable!()
    };
    assert_eq!(exit.wait_status, 0x700, "raw wait status of `exit 7`");
    let started = pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    assert_eq!(
        started.pod_uid.as_ref().map(|u| u.as_str()),
        Some(cg.pod_uid.as_str()),
        "pod UID parsed from the cgroup path"
    );
    assert_eq!(
        (started.pid, started.source),
        (Some(pid), EventSource::Kernel)
    );
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    let status = died.exit.expect("an exit status");
    assert_eq!(
        (status.code, status.signal, status.oom_killed),
        (7, None, false)
    );
    assert_eq!(died.pid, Some(pid));
    assert!(died.at_ns >= started.at_ns);
    cg.remove_container();
    let (rmdir, _) = pleg.record(
        RECORD_TIMEOUT,
        |e| matches!(e, KernelEvent::CgroupRmdir(c) if c.path == cg.path),
    );
    let KernelEvent::CgroupRmdir(rmdir) = rmdir else {
        unreachable!()
    };
    assert_eq!(
        (rmdir.hierarchy_id, rmdir.cgroup_id),
        (0, id),
        "rmdir record"
    );
    // The rmdir of a container whose death was reported is silent (docs/pleg.md,
    // contract: the kernel never sends the Removed kinds) and loses nothing.
    assert_eq!(pleg.relist.count(), 0, "nothing was lost");
    Outcome::Pass(format!(
        "mkdir/rmdir of cgroup {id} (level 4), pod {}, container {}..., Started/Died(7), silent rmdir, pid {pid}",
        cg.pod_uid,
        &cg.container_id[..12]
    ))
}

/// A main process killed by SIGKILL: wait status 9, ContainerDied (137, signal 9).
fn sigkill(pleg: &mut PlegUnderTest) -> Outcome {
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let mut child = cg
        .command("/bin/sleep")
        .arg("600")
        .spawn()
        .expect("spawn sleep");
    let pid = child.id();
    let started = pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    assert_eq!(started.pid, Some(pid));
    child.kill().expect("kill");
    assert_eq!(child.wait().expect("wait").signal(), Some(libc::SIGKILL));
    let (exit, _) = pleg.record(
        RECORD_TIMEOUT,
        |e| matches!(e, KernelEvent::Exit(x) if x.process.pid == pid),
    );
    let KernelEvent::Exit(exit) = exit else {
        unreachable!()
    };
    assert_eq!(exit.wait_status, 9, "raw wait status of a SIGKILL");
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    let status = died.exit.expect("an exit status");
    assert_eq!(
        (status.code, status.signal, status.oom_killed),
        (137, Some(9), false)
    );
    Outcome::Pass(format!("pid {pid}, wait status 9, Died(137, signal 9)"))
}

/// `dd` with a 64 MiB buffer in a cgroup limited to 16 MiB (cgroup2, no swap): the
/// exit record flags the OOM kill (signal->oom_mm), mark_victim names the pid, and
/// ContainerDied says OOM-killed.
fn oom_kill(pleg: &mut PlegUnderTest, memory_controller: bool) -> Outcome {
    if !memory_controller {
        return Outcome::Absent(
            "cgroup2 has no memory controller here (on a hybrid host it is bound to v1): no limit, no OOM kill"
                .to_owned(),
        );
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    cg.limit_memory(16 << 20);
    // 64 MiB, not the host test's 256: the guest has 256 MiB in all, and a buffer
    // larger than that would be refused by malloc instead of OOM-killed.
    let mut child = cg
        .command("/bin/dd")
        .args(["if=/dev/zero", "of=/dev/null", "bs=64M", "count=1"])
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn dd");
    let pid = child.id();
    let status = child.wait().expect("wait");
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "dd was not OOM-killed: {status:?}"
    );
    let mut victim = false;
    let mut exit = None;
    let done = pleg.records_until(RECORD_TIMEOUT, |e| match e {
        KernelEvent::OomVictim { tgid, .. } if *tgid == pid => {
            victim = true;
            false
        }
        KernelEvent::Exit(x) if x.process.pid == pid => {
            exit = Some(x.clone());
            true
        }
        _ => false,
    });
    assert!(done, "no exit record of dd (pid {pid})");
    let exit = exit.expect("set with done");
    assert!(
        exit.status.oom_killed,
        "the exit record does not flag the OOM kill (signal_struct.oom_mm): {exit:?}"
    );
    assert!(
        victim,
        "no mark_victim record naming pid {pid} before its exit"
    );
    pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    let status = died.exit.expect("an exit status");
    assert!(status.oom_killed, "not reported as OOM-killed: {status:?}");
    assert_eq!((status.code, status.signal), (137, Some(9)));
    Outcome::Pass(format!(
        "dd pid {pid}: exit record flagged (oom_mm), mark_victim record, Died(137, OOM-killed)"
    ))
}

/// `/bin/true` in a cgroup created right before it: reported although its life is
/// (natively) far under a millisecond. The lifetime is shown, not asserted.
fn short_process(pleg: &mut PlegUnderTest) -> Outcome {
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let status = cg.command("/bin/true").status().expect("run true");
    assert!(status.success());
    let started = pleg.expect(&cg.container_id, EventKind::ContainerStarted);
    let died = pleg.expect(&cg.container_id, EventKind::ContainerDied);
    assert_eq!(died.exit.map(|e| e.code), Some(0));
    Outcome::Pass(format!(
        "Started and Died(0) reported; exec to exit {} us (not asserted: guests are emulated)",
        died.at_ns.saturating_sub(started.at_ns) / 1000
    ))
}

/// After everything: no failed kernel reads (a wrong offset), nothing dropped,
/// malformed, discarded or unattributed.
fn counters(pleg: &PlegUnderTest) -> Outcome {
    let s = pleg.pleg.stats();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    // The reader reads the kernel's counters every 100 ms: once the kernel's count
    // of submitted records has caught up with the records read, the counters were
    // read after every record of the checks above.
    let deadline = Instant::now() + RECORD_TIMEOUT;
    while get(&s.kernel_reported) < get(&s.records) {
        assert!(
            Instant::now() < deadline,
            "the kernel's counters were not read again within {RECORD_TIMEOUT:?}: reported {} < records {}",
            get(&s.kernel_reported),
            get(&s.records)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let bad = [
        ("kernel read errors", get(&s.kernel_read_errors)),
        ("kernel drops", get(&s.kernel_dropped)),
        ("malformed records", get(&s.malformed)),
        ("discarded events", get(&s.discarded)),
        ("unattributed records", get(&s.unattributed)),
    ];
    let nonzero: Vec<String> = bad
        .iter()
        .filter(|(_, v)| *v != 0)
        .map(|(n, v)| format!("{n}: {v}"))
        .collect();
    assert!(nonzero.is_empty(), "{}", nonzero.join(", "));
    assert!(get(&s.kernel_reported) > 0, "the kernel reported nothing");
    Outcome::Pass(format!(
        "kernel reported {}, filtered {}, thread exits {}, program runs skipped {}; records {}; no read errors, \
         drops or unattributed records",
        get(&s.kernel_reported),
        get(&s.kernel_filtered),
        get(&s.kernel_thread_exits),
        get(&s.kernel_missed),
        get(&s.records)
    ))
}

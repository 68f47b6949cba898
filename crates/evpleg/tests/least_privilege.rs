//! `evpleg observe` needs CAP_BPF, CAP_PERFMON and CAP_SYS_NICE and nothing
//! else, and no system call beyond the seccomp profile shipped in
//! `deploy/seccomp/evpleg-observe.json`, as deploy/daemonset.yaml grants: the
//! binary runs with a bounding set of those three (its effective set is
//! checked), once under `setpriv` and once under the profile's filter
//! installed as a runtime installs it (after the capabilities, just before
//! the exec), sees a process in a container-like cgroup die with its exit
//! code, serves `/healthz`, its reader runs SCHED_FIFO, and it stops cleanly
//! on SIGTERM. Needs root (to set the process up) and BTF; without them the
//! test says why and returns, and under `CI=true` that is a failure.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

const BOUND: Duration = Duration::from_secs(30);
/// CAP_SYS_NICE (23), CAP_PERFMON (38), CAP_BPF (39).
const CAPS: u64 = (1 << 23) | (1 << 38) | (1 << 39);

/// A pod and container cgroup under `/kubepods/besteffort`, removed on drop
/// (only the levels it created).
struct Cgroup {
    dir: PathBuf,
    created: Vec<PathBuf>,
    id: String,
}

impl Cgroup {
    fn new() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_nanos();
        let uid = format!(
            "{:08x}-0000-4000-8000-{:012x}",
            std::process::id(),
            nanos % (1 << 48)
        );
        let id = format!("{:064x}", nanos.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let id = id[id.len() - 64..].to_owned();
        // The cgroup2 hierarchy: /sys/fs/cgroup, or /sys/fs/cgroup/unified on
        // a hybrid host.
        let mounts = std::fs::read_to_string("/proc/mounts").expect("/proc/mounts");
        let root = mounts
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.get(2) == Some(&"cgroup2"))
            .map(|f| PathBuf::from(f[1]))
            .expect("a cgroup2 mount");
        let relative = format!("kubepods/besteffort/pod{uid}/{id}");
        let dir = root.join(&relative);
        let mut created = Vec::new();
        let mut path = root;
        for part in std::path::Path::new(&relative) {
            path.push(part);
            match std::fs::create_dir(&path) {
                Ok(()) => created.push(path.clone()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => panic!("{}: {e}", path.display()),
            }
        }
        Self { dir, created, id }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for d in self.created.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// The port of the address evpleg's log says it serves HTTP on
/// (`serving http addr=127.0.0.1:PORT`): it listens on port 0, the kernel's
/// pick, rather than on a port picked here and freed before it binds (which
/// another socket may take meanwhile).
fn served_port(logs: &str) -> Option<u16> {
    let line = logs.lines().find(|l| l.contains("serving http"))?;
    let addr = line.split("addr=").nth(1)?.split_whitespace().next()?;
    addr.parse::<std::net::SocketAddr>().ok().map(|a| a.port())
}

/// `GET path` on `127.0.0.1:port`, the whole answer (`Connection: close`).
fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("connect 127.0.0.1:{port}: {e}"));
    s.set_read_timeout(Some(BOUND)).expect("read timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .expect("write the request");
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    answer
}

/// The effective capabilities of `pid`.
fn cap_eff(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .expect("CapEff")
        .trim();
    u64::from_str_radix(hex, 16).expect("hex")
}

#[test]
fn observe_runs_with_cap_bpf_cap_perfmon_and_cap_sys_nice_only() {
    if !common::can_run(
        "least_privilege",
        &[("setpriv", std::path::Path::new("/usr/bin/setpriv").exists())],
    ) {
        return;
    }
    let mut cmd = Command::new("/usr/bin/setpriv");
    cmd.args(["--bounding-set=-all,+bpf,+perfmon,+sys_nice", "--"])
        .arg(env!("CARGO_BIN_EXE_evpleg"));
    observe_sees_a_death(cmd);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn observe_runs_under_the_shipped_seccomp_profile() {
    use std::os::unix::process::CommandExt;
    if !common::can_run("least_privilege", &[]) {
        return;
    }
    let filter = seccomp::Filter::from_profile(&seccomp::shipped_profile());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_evpleg"));
    // SAFETY: between fork and exec the closure only makes system calls
    // (prctl, seccomp) on memory prepared before the fork; it allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            seccomp::keep_only_capabilities(CAPS)?;
            filter.install()
        });
    }
    observe_sees_a_death(cmd);
}

/// Runs `cmd observe ...` (the binary, however it is wrapped), checks its
/// capabilities, kills a container's main process with code 7 and waits for
/// the kernel's ContainerDied, reads `/healthz`, and stops it with SIGTERM.
fn observe_sees_a_death(mut cmd: Command) {
    // The two tests share `kubepods/besteffort`: one at a time, so that one
    // does not remove a level the other is creating its pod under (CI saw
    // both create it at once).
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cgroup = Cgroup::new();
    let mut child = cmd
        .args([
            "observe",
            "--cri-endpoint",
            "none",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--run-for", "60s"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn setpriv evpleg");
    let logs = Arc::new(Mutex::new(String::new()));
    let (started_tx, started_rx) = mpsc::channel();
    let stderr = child.stderr.take().expect("stderr");
    let log_sink = logs.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("observing") {
                let _ = started_tx.send(());
            }
            let mut l = log_sink.lock().unwrap_or_else(|e| e.into_inner());
            l.push_str(&line);
            l.push('\n');
        }
    });
    let (events_tx, events_rx) = mpsc::channel::<String>();
    let stdout = child.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = events_tx.send(line);
        }
    });
    let logs_now = || logs.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match started_rx.recv_timeout(BOUND) {
        Ok(()) => {}
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            let status = child.wait().expect("wait");
            panic!(
                "evpleg observe exited ({status}) before it started:\n{}",
                logs_now()
            );
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            let _ = child.kill();
            panic!(
                "evpleg observe did not start within {BOUND:?}:\n{}",
                logs_now()
            );
        }
    }
    assert_eq!(
        cap_eff(child.id()),
        CAPS,
        "evpleg runs with exactly CAP_BPF, CAP_PERFMON, CAP_SYS_NICE"
    );
    // A container's main process that exits 7.
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec sh -c 'exit 7'",
        cgroup.dir.display()
    );
    let status = Command::new("sh")
        .args(["-c", &script])
        .status()
        .expect("sh");
    assert_eq!(status.code(), Some(7));
    let deadline = Instant::now() + BOUND;
    let died = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = events_rx.recv_timeout(left) else {
            let _ = child.kill();
            panic!(
                "no ContainerDied for {} within {BOUND:?}:\n{}",
                cgroup.id,
                logs_now()
            );
        };
        let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
        if v["kind"] == "ContainerDied" && v["container_id"] == cgroup.id.as_str() {
            break v;
        }
    };
    assert_eq!(died["exit_code"], 7, "{died}");
    assert_eq!(died["source"], "kernel", "{died}");
    let port = served_port(&logs_now())
        .unwrap_or_else(|| panic!("no `serving http addr=` in its log:\n{}", logs_now()));
    let healthz = http_get(port, "/healthz");
    assert!(
        healthz.starts_with("HTTP/1.1 200"),
        "/healthz answers 200:\n{healthz}\n{}",
        logs_now()
    );
    // SAFETY: a signal to the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let stop = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(stop.elapsed() < BOUND, "evpleg did not stop");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status}\n{}", logs_now());
    assert!(
        logs_now().contains("ring-buffer reader runs SCHED_FIFO"),
        "the reader got its real-time priority:\n{}",
        logs_now()
    );
}

/// The shipped seccomp profile as the kernel filter a runtime installs from
/// it (runc compiles it with libseccomp): the OCI format's subset the profile
/// uses (a default errno action, allow lists by name, no argument rules), on
/// x86_64 only, the one architecture the profile names.
#[cfg(target_arch = "x86_64")]
mod seccomp {
    use std::io;

    /// `AUDIT_ARCH_X86_64`: the architecture word of `struct seccomp_data`.
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

    /// `deploy/seccomp/evpleg-observe.json`, parsed.
    pub fn shipped_profile() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/seccomp/evpleg-observe.json"
        );
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// A classic BPF program: allow the listed system calls, fail every other
    /// one (and every other architecture's) with the profile's errno.
    pub struct Filter(Vec<libc::sock_filter>);

    impl Filter {
        /// Compiles `profile`; panics on anything the profile may not hold
        /// (another default action, an action other than allow, argument
        /// rules, a name this architecture does not have).
        pub fn from_profile(profile: &serde_json::Value) -> Self {
            assert_eq!(profile["defaultAction"], "SCMP_ACT_ERRNO", "{profile}");
            let errno = profile["defaultErrnoRet"]
                .as_u64()
                .expect("defaultErrnoRet");
            assert_eq!(
                profile["architectures"],
                serde_json::json!(["SCMP_ARCH_X86_64"])
            );
            let mut numbers = Vec::new();
            for rule in profile["syscalls"].as_array().expect("syscalls") {
                assert_eq!(rule["action"], "SCMP_ACT_ALLOW", "{rule}");
                assert!(rule.get("args").is_none(), "no argument rules: {rule}");
                for name in rule["names"].as_array().expect("names") {
                    let name = name.as_str().expect("a name");
                    let nr = number(name).unwrap_or_else(|| panic!("unknown system call {name}"));
                    numbers.push(u32::try_from(nr).expect("a small number"));
                }
            }
            assert!(numbers.len() < 250, "jump offsets fit a byte");
            let deny = libc::SECCOMP_RET_ERRNO | u32::try_from(errno).expect("an errno");
            let ld = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
            let jeq = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
            let ret = (libc::BPF_RET | libc::BPF_K) as u16;
            let op = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
            // [arch check] [load nr] [nr == n_i ? allow : next]... [deny] [allow]
            let mut prog = vec![
                op(ld, 0, 0, 4),
                op(jeq, 1, 0, AUDIT_ARCH_X86_64),
                op(ret, 0, 0, deny),
                op(ld, 0, 0, 0),
            ];
            let n = numbers.len();
            for (i, nr) in numbers.into_iter().enumerate() {
                prog.push(op(jeq, (n - i) as u8, 0, nr));
            }
            prog.push(op(ret, 0, 0, deny));
            prog.push(op(ret, 0, 0, libc::SECCOMP_RET_ALLOW));
            Self(prog)
        }

        /// Installs the filter on the calling thread (`no_new_privs` first,
        /// as a runtime does for `allowPrivilegeEscalation: false`). Makes
        /// no allocation: it runs between fork and exec.
        pub fn install(&self) -> io::Result<()> {
            let prog = libc::sock_fprog {
                len: self.0.len() as u16,
                filter: self.0.as_ptr().cast_mut(),
            };
            // SAFETY: prctl with integer arguments, then with a pointer to a
            // program that outlives the call.
            unsafe {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                    || libc::prctl(
                        libc::PR_SET_SECCOMP,
                        libc::SECCOMP_MODE_FILTER,
                        &prog as *const libc::sock_fprog,
                    ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        }
    }

    /// Drops every capability not in `keep` from the bounding set, as a
    /// runtime does for `capabilities: drop: [ALL], add: [...]`: after the
    /// exec, root's capabilities are `keep`.
    pub fn keep_only_capabilities(keep: u64) -> io::Result<()> {
        for cap in 0..64 {
            if keep & (1 << cap) != 0 {
                continue;
            }
            // SAFETY: prctl with integer arguments.
            if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } != 0 {
                let e = io::Error::last_os_error();
                // Past the kernel's last capability.
                if e.raw_os_error() == Some(libc::EINVAL) {
                    break;
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// The number of the system call `name` on x86_64.
    fn number(name: &str) -> Option<libc::c_long> {
        NUMBERS.iter().find(|(n, _)| *n == name).map(|(_, nr)| *nr)
    }

    /// Every name the profile may use, with its number.
    const NUMBERS: &[(&str, libc::c_long)] = &[
        ("accept4", libc::SYS_accept4),
        ("access", libc::SYS_access),
        ("arch_prctl", libc::SYS_arch_prctl),
        ("bind", libc::SYS_bind),
        ("bpf", libc::SYS_bpf),
        ("brk", libc::SYS_brk),
        ("clock_gettime", libc::SYS_clock_gettime),
        ("clock_nanosleep", libc::SYS_clock_nanosleep),
        ("clone", libc::SYS_clone),
        ("clone3", libc::SYS_clone3),
        ("close", libc::SYS_close),
        ("connect", libc::SYS_connect),
        ("dup3", libc::SYS_dup3),
        ("epoll_create1", libc::SYS_epoll_create1),
        ("epoll_ctl", libc::SYS_epoll_ctl),
        ("epoll_pwait", libc::SYS_epoll_pwait),
        ("epoll_wait", libc::SYS_epoll_wait),
        ("eventfd2", libc::SYS_eventfd2),
        ("execve", libc::SYS_execve),
        ("exit", libc::SYS_exit),
        ("exit_group", libc::SYS_exit_group),
        ("fcntl", libc::SYS_fcntl),
        ("fstat", libc::SYS_fstat),
        ("fstatfs", libc::SYS_fstatfs),
        ("futex", libc::SYS_futex),
        ("getdents64", libc::SYS_getdents64),
        ("getpeername", libc::SYS_getpeername),
        ("getpid", libc::SYS_getpid),
        ("getrandom", libc::SYS_getrandom),
        ("getsockname", libc::SYS_getsockname),
        ("getsockopt", libc::SYS_getsockopt),
        ("gettid", libc::SYS_gettid),
        ("ioctl", libc::SYS_ioctl),
        ("listen", libc::SYS_listen),
        ("lseek", libc::SYS_lseek),
        ("madvise", libc::SYS_madvise),
        ("mmap", libc::SYS_mmap),
        ("mprotect", libc::SYS_mprotect),
        ("mremap", libc::SYS_mremap),
        ("munmap", libc::SYS_munmap),
        ("nanosleep", libc::SYS_nanosleep),
        ("newfstatat", libc::SYS_newfstatat),
        ("openat", libc::SYS_openat),
        ("perf_event_open", libc::SYS_perf_event_open),
        ("pipe2", libc::SYS_pipe2),
        ("poll", libc::SYS_poll),
        ("prctl", libc::SYS_prctl),
        ("pread64", libc::SYS_pread64),
        ("prlimit64", libc::SYS_prlimit64),
        ("read", libc::SYS_read),
        ("readlinkat", libc::SYS_readlinkat),
        ("readv", libc::SYS_readv),
        ("recvfrom", libc::SYS_recvfrom),
        ("recvmsg", libc::SYS_recvmsg),
        ("rseq", libc::SYS_rseq),
        ("rt_sigaction", libc::SYS_rt_sigaction),
        ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
        ("rt_sigreturn", libc::SYS_rt_sigreturn),
        ("sched_getaffinity", libc::SYS_sched_getaffinity),
        ("sched_getparam", libc::SYS_sched_getparam),
        ("sched_getscheduler", libc::SYS_sched_getscheduler),
        ("sched_setparam", libc::SYS_sched_setparam),
        ("sched_setscheduler", libc::SYS_sched_setscheduler),
        ("sched_yield", libc::SYS_sched_yield),
        ("sendmsg", libc::SYS_sendmsg),
        ("sendto", libc::SYS_sendto),
        ("set_robust_list", libc::SYS_set_robust_list),
        ("set_tid_address", libc::SYS_set_tid_address),
        ("setsockopt", libc::SYS_setsockopt),
        ("shutdown", libc::SYS_shutdown),
        ("sigaltstack", libc::SYS_sigaltstack),
        ("socket", libc::SYS_socket),
        ("socketpair", libc::SYS_socketpair),
        ("statfs", libc::SYS_statfs),
        ("statx", libc::SYS_statx),
        ("tgkill", libc::SYS_tgkill),
        ("uname", libc::SYS_uname),
        ("write", libc::SYS_write),
        ("writev", libc::SYS_writev),
    ];
}

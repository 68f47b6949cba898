//! `evpleg observe` needs CAP_BPF, CAP_PERFMON and CAP_SYS_NICE and nothing
//! else, as deploy/daemonset.yaml grants: the binary runs under `setpriv` with
//! a bounding set of those three (its effective set is checked), sees a
//! process in a container-like cgroup die with its exit code, and its reader
//! runs SCHED_FIFO. Needs root (to set the process up) and BTF; without them
//! the test says why and returns, and under `CI=true` that is a failure.

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
            if !path.exists() {
                std::fs::create_dir(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                created.push(path.clone());
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
    let cgroup = Cgroup::new();
    let mut child = Command::new("/usr/bin/setpriv")
        .args(["--bounding-set=-all,+bpf,+perfmon,+sys_nice", "--"])
        .arg(env!("CARGO_BIN_EXE_evpleg"))
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

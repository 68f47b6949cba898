//! A private containerd for `cargo xtask run` and the benchmark: starts the test
//! harness's containerd (its own root, state and socket, locally built images),
//! prints `endpoint=unix:///...` on stdout, and runs until its stdin closes or it
//! gets SIGINT/SIGTERM; then removes every pod over CRI, stops containerd and
//! removes what it created, as the tests' harness does.

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use evpleg_tests::containerd::Containerd;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn main() {
    // Logs go to stderr: stdout carries the endpoint line to whoever started us.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .try_init();
    let containerd = match Containerd::start() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("containerd-harness: {e}");
            std::process::exit(1);
        }
    };
    println!("endpoint={}", containerd.endpoint());
    let _ = std::io::stdout().flush();
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let closed = Arc::new(AtomicBool::new(false));
    let flag = closed.clone();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for _ in stdin.lock().lines() {}
        flag.store(true, Ordering::SeqCst);
    });
    while !STOP.load(Ordering::SeqCst) && !closed.load(Ordering::SeqCst) {
        std::thread::park_timeout(std::time::Duration::from_millis(100));
    }
    eprintln!("containerd-harness: tearing down");
    drop(containerd);
    remove_empty_pod_cgroups();
}

/// The agent that ran against this containerd stopped without terminating its pods
/// (as the kubelet does); their sandboxes are gone now, and so go the empty pod
/// cgroups it made, and the QoS levels when nothing else uses them. Only empty
/// directories are removed (rmdir fails on a cgroup with processes or children).
fn remove_empty_pod_cgroups() {
    let mut mounts = vec![std::path::PathBuf::from("/sys/fs/cgroup")];
    if let Ok(d) = std::fs::read_dir("/sys/fs/cgroup") {
        mounts.extend(d.flatten().map(|e| e.path()));
    }
    for mount in mounts {
        for qos in ["kubepods/burstable", "kubepods/besteffort", "kubepods"] {
            let dir = mount.join(qos);
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    if e.file_name().to_string_lossy().starts_with("pod") {
                        let _ = std::fs::remove_dir(e.path());
                    }
                }
            }
            let _ = std::fs::remove_dir(&dir);
        }
    }
}

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
    evpleg_tests::containerd::init_test_logging();
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
}

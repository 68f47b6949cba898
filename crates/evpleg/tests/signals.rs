//! The `evpleg` binary stops gracefully on SIGTERM and SIGINT (`evpleg observe
//! --cri-endpoint none`: the kernel PLEG is loaded, so root and BTF are
//! needed; without them the test says why and returns, and under `CI=true`
//! that is a failure). Its logs go to stderr, apart from observe's events on
//! stdout.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Bound of the start and of the stop.
const BOUND: Duration = Duration::from_secs(20);

/// Starts the binary, waits until it runs, sends `signal`, and returns its exit
/// status, the time the stop took and its output.
fn run_and_signal(signal: libc::c_int) -> (std::process::ExitStatus, Duration, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_evpleg"))
        .args([
            "observe",
            "--cri-endpoint",
            "none",
            "--listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn evpleg");
    let stdout = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut output = String::new();
    let deadline = Instant::now() + BOUND;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                output.push_str(&line);
                output.push('\n');
                if line.contains("observing") {
                    break;
                }
            }
            Err(_) => {
                let _ = child.kill();
                panic!("evpleg did not start within {BOUND:?}:\n{output}");
            }
        }
    }
    let pid = i32::try_from(child.id()).expect("a pid");
    let sent = Instant::now();
    // SAFETY: a signal to the child we started.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if sent.elapsed() > BOUND {
            let _ = child.kill();
            panic!("evpleg did not stop within {BOUND:?} of signal {signal}:\n{output}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = sent.elapsed();
    reader.join().expect("reader");
    while let Ok(line) = rx.try_recv() {
        output.push_str(&line);
        output.push('\n');
    }
    (status, took, output)
}

#[test]
fn sigterm_and_sigint_stop_the_binary_gracefully() {
    if !common::can_run("signals", &[]) {
        return;
    }
    for (signal, said) in [
        (libc::SIGTERM, "SIGTERM: stopping"),
        (libc::SIGINT, "SIGINT: stopping"),
    ] {
        let (status, took, output) = run_and_signal(signal);
        eprintln!("{said}: exited {status} after {took:?}");
        assert!(status.success(), "{said}: {status}\n{output}");
        assert!(output.contains(said), "{said}:\n{output}");
        // The graceful path ran to its end (the PLEG's final counters).
        assert!(output.contains("stopped"), "{said}:\n{output}");
    }
}

//! A multi-threaded process for the kernel PLEG's "one record per process exit"
//! checks (docs/pleg.md, contract clause 7), run as a container's main process by
//! the host tests (the `evpleg-thread-helper` binary) and by the kernel matrix's
//! probe (the probe re-executed with `--thread-helper`). Each mode prints `ready`
//! on stdout once its threads run and waits for a line on stdin before the exit
//! under test, so the test decides when the threads die.
//!
//! * `exit-group-from-thread N THREADS`: THREADS threads (the leader among them)
//!   block; on `go` a thread that is not the leader calls `exit_group(N)`, which
//!   kills every thread at once: on two CPUs several of them are in `do_exit`
//!   together, the race that once gave one record per thread.
//! * `leader-exits-first N M`: the leader calls `exit(N)` (the thread only, the raw
//!   syscall) after starting one thread; the test waits until the leader is a
//!   zombie, then says `go` and that thread calls `exit(M)`. What `waitpid` gives
//!   depends on the kernel (from Linux 6.0 the last thread's `M`, before it the
//!   leader's `N`); the test compares the record with what it got.
//!
//! Run as a container under a runtime (no stdin to talk over), the helper waits
//! for the file named by `EVPLEG_GO_FILE` to exist instead of a line on stdin.

use std::io::{BufRead, Write};

/// Runs a helper mode (the arguments after the program and its marker); never
/// returns.
pub fn helper_main(args: &[String]) -> ! {
    let arg = |i: usize| -> i32 {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| usage(args))
    };
    match args.first().map(String::as_str) {
        Some("exit-group-from-thread") => exit_group_from_thread(arg(1), arg(2)),
        Some("leader-exits-first") => leader_exits_first(arg(1), arg(2)),
        _ => usage(args),
    }
}

fn usage(args: &[String]) -> ! {
    eprintln!(
        "thread helper: usage: exit-group-from-thread N THREADS | leader-exits-first N M (got {args:?})"
    );
    // SAFETY: exit_group has no preconditions.
    unsafe { libc::syscall(libc::SYS_exit_group, 64) };
    unreachable!("exit_group returned")
}

/// The environment variable naming the file whose existence means `go`.
pub const GO_FILE_ENV: &str = "EVPLEG_GO_FILE";

/// Prints `ready` and blocks until a line arrives on stdin (or stdin closes), or
/// until the file named by [`GO_FILE_ENV`] exists when it is set.
fn ready_then_wait_for_go() {
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").expect("stdout");
    out.flush().expect("stdout");
    drop(out);
    if let Some(go) = std::env::var_os(GO_FILE_ENV) {
        // The helper's own wait, not a test's: it has nothing else to wait on.
        while !std::path::Path::new(&go).exists() {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        return;
    }
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

/// Blocks the calling thread forever (until the process dies).
fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

fn exit_group_from_thread(code: i32, threads: i32) -> ! {
    // The leader, the thread that calls exit_group and the others: all running
    // before `ready`.
    let threads = threads.max(2) as usize;
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(threads));
    for _ in 0..threads - 2 {
        let barrier = barrier.clone();
        std::thread::spawn(move || {
            barrier.wait();
            park_forever()
        });
    }
    let all = barrier.clone();
    std::thread::spawn(move || {
        all.wait();
        ready_then_wait_for_go();
        // SAFETY: exit_group has no preconditions; it does not return.
        unsafe { libc::syscall(libc::SYS_exit_group, code) };
        unreachable!("exit_group returned")
    });
    barrier.wait();
    park_forever()
}

fn leader_exits_first(leader_code: i32, last_code: i32) -> ! {
    std::thread::spawn(move || {
        ready_then_wait_for_go();
        // SAFETY: the raw exit ends this thread only; it does not return.
        unsafe { libc::syscall(libc::SYS_exit, last_code) };
        unreachable!("exit returned")
    });
    // SAFETY: as above: the leader thread ends, the process lives on.
    unsafe { libc::syscall(libc::SYS_exit, leader_code) };
    unreachable!("exit returned")
}

//! Load test of the kernel PLEG: 1 000 process exits per second for 10 s in one
//! container cgroup. Every exit must reach user space, with no kernel drop: a loss
//! would be counted and relisted, but at this rate there must be none (the
//! failure names the numbers). Its own test binary, so the load does not run
//! beside the other privileged tests.
//!
//! The load comes from a spawner process inside the container cgroup (this test
//! binary re-executed): its children inherit the cgroup, so it can use the cheap
//! `posix_spawn` path instead of fork + a cgroup write per child.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evpleg_pleg::kernel::event::KernelEvent;
use evpleg_tests::cgroups::{ContainerCgroup, Layout};
use evpleg_tests::pleg::PlegUnderTest;
use evpleg_tests::privileged;

const RATE_PER_SECOND: u64 = 1_000;
const SECONDS: u64 = 10;
const SPAWNER_ENV: &str = "EVPLEG_STRESS_SPAWNER";

/// The spawner, when this binary is re-executed with SPAWNER_ENV set: spawns
/// `/bin/true` at RATE_PER_SECOND for SECONDS, reaps them, prints their pids and
/// then the achieved rate. Without the variable this test does nothing.
#[test]
fn spawner() {
    if std::env::var_os(SPAWNER_ENV).is_none() {
        return;
    }
    let total = RATE_PER_SECOND * SECONDS;
    let (tx, rx) = std::sync::mpsc::channel::<std::process::Child>();
    let reaper = std::thread::spawn(move || {
        let mut out = BufWriter::new(std::io::stdout().lock());
        for mut child in rx {
            // A marker: the test harness prints on the same stream, without newlines.
            writeln!(out, "spawned-pid:{}", child.id()).expect("stdout");
            child.wait().expect("wait");
        }
    });
    let started = Instant::now();
    for i in 0..total {
        // Pace: process i is due at i ms (load generation, not synchronisation).
        let due = started + Duration::from_micros(i * 1_000_000 / RATE_PER_SECOND);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        tx.send(Command::new("/bin/true").spawn().expect("spawn /bin/true"))
            .expect("reaper alive");
    }
    drop(tx);
    reaper.join().expect("reaper");
    eprintln!(
        "spawner: {total} in {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn thousand_exits_per_second_for_ten_seconds() {
    if std::env::var_os(SPAWNER_ENV).is_some()
        || !privileged("thousand_exits_per_second_for_ten_seconds")
    {
        return;
    }
    let cg = ContainerCgroup::new(Layout::Cgroupfs);
    let pleg = PlegUnderTest::start(|_| {});
    let started = Instant::now();
    let mut spawner = cg
        .command(
            &std::env::current_exe()
                .expect("test binary")
                .to_string_lossy(),
        )
        .args(["--exact", "spawner", "--nocapture", "--test-threads", "1"])
        .env(SPAWNER_ENV, "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the spawner");
    let mut pending: HashSet<u32> = BufReader::new(spawner.stdout.take().expect("stdout"))
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| {
            l.split("spawned-pid:")
                .nth(1)
                .and_then(|p| p.trim().parse().ok())
        })
        .collect();
    assert!(
        spawner.wait().expect("wait spawner").success(),
        "the spawner failed"
    );
    let elapsed = started.elapsed();
    let total = pending.len() as u64;
    assert_eq!(
        total,
        RATE_PER_SECOND * SECONDS,
        "the spawner reported every child"
    );
    let id = cg.id();
    let mut seen = 0u64;
    let all = pleg.records_until(Duration::from_secs(30), |e| {
        if let KernelEvent::Exit(x) = e
            && x.cgroup_id == id
            && pending.remove(&x.process.pid)
        {
            seen += 1;
        }
        pending.is_empty()
    });
    let stats = pleg.pleg.stats();
    let dropped = stats.kernel_dropped.load(Ordering::Relaxed);
    eprintln!(
        "{total} processes in {:.1} s ({:.0}/s); exits seen {seen}; kernel drops {dropped}; \
         relist requests {}",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64(),
        pleg.relist.count()
    );
    // At this rate nothing may be lost: a loss is counted and relisted, but it
    // means the default ring buffer or the reader is too slow for it.
    assert!(
        all,
        "{} of {total} exits never reached user space at {RATE_PER_SECOND}/s (kernel drops {dropped}, \
         relist requests {}): the kernel PLEG cannot keep up with this rate on this machine",
        pending.len(),
        pleg.relist.count()
    );
    assert_eq!(dropped, 0, "kernel drops at {RATE_PER_SECOND}/s");
    assert_eq!(stats.malformed.load(Ordering::Relaxed), 0);
}

//! `evpleg run` or `evpleg cri-proxy` as a process of its own
//! (`evpleg-killable`), so that a fault test can kill it with SIGKILL (no
//! graceful stop: no drop, no flush) and start it again with the same flags,
//! as after a crash or an OOM kill of the real binary. Its log goes to a
//! file; every wait is bounded.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The bound of a start (the kernel PLEG's load included).
pub const START_BOUND: Duration = Duration::from_secs(60);

/// A running `evpleg-killable`; killed (SIGKILL) on drop.
#[derive(Debug)]
pub struct Killable {
    child: Child,
    /// Its HTTP listener (`--listen` / `--http-listen`).
    pub addr: SocketAddr,
    log: PathBuf,
}

impl Killable {
    /// Starts `evpleg-killable` with `args` (`run ...` or `cri-proxy ...`),
    /// its stderr appended to `log`; returns once it said it is ready.
    pub fn spawn(program: &Path, args: &[String], log: &Path) -> Self {
        let err = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let mut child = Command::new(program)
            .args(args)
            // The harness's filter when set (a debug run), else info.
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", program.display()));
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let addr = match rx.recv_timeout(START_BOUND) {
            Ok(line) => line
                .strip_prefix("ready ")
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("unexpected first line {line:?}")),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{args:?} not ready within {START_BOUND:?}; log:\n{}",
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
        };
        Self {
            child,
            addr,
            log: log.to_owned(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and the process reaped.
    pub fn kill9(mut self) {
        self.kill_now();
    }

    /// SIGTERM (a graceful stop), and the process reaped; SIGKILL if it has
    /// not exited within `bound`. Whether it exited by itself.
    pub fn stop(mut self, bound: Duration) -> bool {
        // SAFETY: plain syscall on our child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + bound;
        while std::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill_now();
        false
    }

    fn kill_now(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its resident set size (VmRSS) now, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .unwrap_or_else(|e| panic!("pid {}: {e}", self.pid()));
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no VmRSS in {status}"))
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Killable {
    fn drop(&mut self) {
        self.kill_now();
    }
}

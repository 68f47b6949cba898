//! The floor: a bare ring-buffer reader. The same programs and tracepoint as the
//! kernel PLEG, a thread at the same SCHED_FIFO priority blocked in `epoll_wait`,
//! which reads only each record's kind, timestamp and pid into a preallocated
//! vector and hands the pid to a tokio task through a channel (`try_send`, as
//! the kernel PLEG hands its event to the pod workers' channel, the wake-up of
//! the parked task included): no decoding, no tracker, no cache. What the
//! kernel and this machine allow a PLEG that reads a death and hands it on; the
//! agent's overhead is stated against it.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use evpleg_core::clock::monotonic_ns;
use evpleg_events::EVENT_EXIT;
use evpleg_pleg::kernel::loader;
use evpleg_pleg::kernel::loader::LoaderConfig;
use evpleg_pleg::kernel::{DEFAULT_REALTIME_PRIORITY, DEFAULT_RING_BUFFER_BYTES, index};
use tokio::sync::mpsc;

/// The bare reader thread's name.
pub const THREAD: &str = "bench-floor";

/// One exit record, CLOCK_MONOTONIC ns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitRead {
    pub pid: u32,
    /// The kernel's exit timestamp.
    pub kernel_ns: u64,
    /// When the thread took the record from the ring.
    pub read_ns: u64,
    /// When the hand-off channel took the pid (`None`: it was full or closed).
    pub handed_ns: Option<u64>,
}

/// A running bare reader; [`stop`](Self::stop) returns what it read.
#[derive(Debug)]
pub struct BareReader {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<ExitRead>>>,
}

impl BareReader {
    /// Loads the programs with `/kubepods` (which must exist) as the only root;
    /// each exit's pid is handed to `handoff`.
    pub fn start(handoff: mpsc::Sender<u32>) -> Result<Self> {
        let mount = index::cgroup2_mount()?.context("no cgroup2 hierarchy")?;
        let kubepods = mount.join("kubepods");
        let id = std::fs::metadata(&kubepods)
            .with_context(|| format!("stat {}", kubepods.display()))?
            .ino();
        let mut loaded = loader::load(&LoaderConfig {
            object: None,
            ring_buffer_bytes: DEFAULT_RING_BUFFER_BYTES,
            roots: vec!["/kubepods".into()],
            hierarchies: vec![index::CGROUP2_HIERARCHY],
            cgroup2_mount: mount,
        })?;
        loaded.roots.add(id, 1)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(THREAD.into())
            .spawn(move || read(loaded, &flag, &handoff))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    pub fn stop(mut self) -> Vec<ExitRead> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for BareReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn read(
    mut loaded: loader::Loaded,
    stop: &AtomicBool,
    handoff: &mpsc::Sender<u32>,
) -> Vec<ExitRead> {
    let param = libc::sched_param {
        sched_priority: DEFAULT_REALTIME_PRIORITY,
    };
    // SAFETY: pid 0 is this thread; `param` is valid for the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        eprintln!(
            "bench: the floor reader cannot run SCHED_FIFO: {}",
            std::io::Error::last_os_error()
        );
    }
    let mut out = Vec::with_capacity(1 << 20);
    // SAFETY: plain syscalls on fds this thread owns for its lifetime.
    let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 0,
    };
    // SAFETY: both fds are open; `ev` is valid for the call.
    unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, loaded.ring.as_raw_fd(), &mut ev) };
    while !stop.load(Ordering::Relaxed) {
        let mut got = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: one valid event slot.
        unsafe { libc::epoll_wait(epfd, &mut got, 1, 100) };
        while let Some(item) = loaded.ring.next() {
            let now = monotonic_ns();
            if item.len() >= 20 {
                let word =
                    |at: usize| u32::from_ne_bytes(item[at..at + 4].try_into().unwrap_or([0; 4]));
                if word(0) == EVENT_EXIT {
                    let pid = word(16);
                    let handed = handoff.try_send(pid).is_ok().then(monotonic_ns);
                    if out.len() < out.capacity() {
                        out.push(ExitRead {
                            pid,
                            kernel_ns: u64::from_ne_bytes(item[8..16].try_into().unwrap_or([0; 8])),
                            read_ns: now,
                            handed_ns: handed,
                        });
                    }
                }
            }
        }
    }
    // SAFETY: we own the epoll fd.
    unsafe { libc::close(epfd) };
    out
}

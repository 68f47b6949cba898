//! A running kernel PLEG for tests: lifecycle events and a tap on raw records, both
//! waited for with a timeout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::cgroups::{Layout, SharedAncestors};
use evpleg_core::lifecycle::{EventKind, PodLifecycleEvent, RelistSignal};
use evpleg_pleg::kernel::event::KernelEvent;
use evpleg_pleg::kernel::relist_requests::RelistReason;
use evpleg_pleg::kernel::{KernelPleg, KernelPlegConfig};
use tokio::sync::mpsc;

/// How long a test waits for an event that should come at once.
pub const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct PlegUnderTest {
    pub pleg: KernelPleg,
    pub relist: Arc<RelistSignal>,
    events: mpsc::Receiver<PodLifecycleEvent>,
    records: std_mpsc::Receiver<(KernelEvent, u64)>,
    pending_events: Vec<PodLifecycleEvent>,
    runtime: tokio::runtime::Runtime,
    gate: Option<Arc<ReaderGate>>,
    /// The kubelet's cgroupfs root, held from before the PLEG started
    /// ([`SharedAncestors::of`]).
    _root: SharedAncestors,
}

impl Drop for PlegUnderTest {
    /// A held reader could not see the stop flag: the gate opens first.
    fn drop(&mut self) {
        if let Some(gate) = &self.gate {
            gate.open();
        }
    }
}

impl PlegUnderTest {
    /// Starts a kernel PLEG with the default roots, adjusted by `configure`.
    pub fn start(configure: impl FnOnce(&mut KernelPlegConfig)) -> Self {
        Self::start_with_channel(1000, configure)
    }

    pub fn start_with_channel(
        capacity: usize,
        configure: impl FnOnce(&mut KernelPlegConfig),
    ) -> Self {
        Self::start_gated(capacity, None, configure)
    }

    /// As [`start_with_channel`](Self::start_with_channel), with the reader thread
    /// held at `gate` (if given) after each record it decodes, while the gate is
    /// closed: a test hook that lets the ring buffer fill.
    pub fn start_gated(
        capacity: usize,
        gate: Option<Arc<ReaderGate>>,
        configure: impl FnOnce(&mut KernelPlegConfig),
    ) -> Self {
        let root = SharedAncestors::of(Layout::Cgroupfs);
        let mut config = KernelPlegConfig::default();
        configure(&mut config);
        let (tx, events) = mpsc::channel(capacity);
        let (record_tx, records) = std_mpsc::channel();
        let relist = Arc::new(RelistSignal::new());
        let kept_gate = gate.clone();
        config.tap = Some(Arc::new(move |ev: &KernelEvent, delay: u64| {
            let _ = record_tx.send((ev.clone(), delay));
            if let Some(gate) = &gate {
                gate.pass(ev);
            }
        }));
        let pleg = KernelPleg::start(config, tx, relist.clone())
            .unwrap_or_else(|e| panic!("starting the kernel pleg: {e}"));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a tokio runtime");
        Self {
            pleg,
            relist,
            events,
            records,
            pending_events: Vec::new(),
            runtime,
            gate: kept_gate,
            _root: root,
        }
    }

    /// The next event of `container_id` (events of other containers, from tests
    /// running alongside, are kept for later calls). Panics after the timeout.
    pub fn event(&mut self, container_id: &str) -> PodLifecycleEvent {
        self.event_within(container_id, EVENT_TIMEOUT).unwrap_or_else(|| {
            panic!(
                "no event for container {container_id} within {EVENT_TIMEOUT:?}; other events: {:?}; {}",
                self.pending_events,
                self.diagnosis()
            )
        })
    }

    /// The next event of `container_id`, or `None` after `timeout`.
    pub fn event_within(
        &mut self,
        container_id: &str,
        timeout: Duration,
    ) -> Option<PodLifecycleEvent> {
        let matches = |e: &PodLifecycleEvent| {
            e.container_id
                .as_ref()
                .is_some_and(|c| c.as_str() == container_id)
        };
        if let Some(i) = self.pending_events.iter().position(matches) {
            return Some(self.pending_events.remove(i));
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let events = &mut self.events;
            let next = self
                .runtime
                .block_on(async { tokio::time::timeout_at(deadline, events.recv()).await });
            match next {
                Ok(Some(e)) if matches(&e) => return Some(e),
                Ok(Some(e)) => self.pending_events.push(e),
                Ok(None) => panic!("the kernel pleg's event channel closed"),
                Err(_) => return None,
            }
        }
    }

    /// The next event of `container_id`, which must be of `kind`.
    pub fn expect(&mut self, container_id: &str, kind: EventKind) -> PodLifecycleEvent {
        let e = self.event(container_id);
        assert_eq!(
            e.kind,
            kind,
            "unexpected event for {container_id}: {e:?}; {}",
            self.diagnosis()
        );
        e
    }

    /// The PLEG's counters that say whether records were lost or left
    /// unattributed, and which relists it asked for: for a failure's message.
    pub fn diagnosis(&self) -> String {
        let s = self.pleg.stats();
        let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        let relists: Vec<String> = RelistReason::ALL
            .iter()
            .filter(|r| s.relist_requests.get(**r) > 0)
            .map(|r| format!("{}: {}", r.as_str(), s.relist_requests.get(*r)))
            .collect();
        format!(
            "pleg counters: records {}, kernel dropped {}, kernel missed {}, read errors {}, \
             unattributed {}, rescans {}, hints {}, demoted {}, discarded {}, relist requests [{}]",
            n(&s.records),
            n(&s.kernel_dropped),
            n(&s.kernel_missed),
            n(&s.kernel_read_errors),
            n(&s.unattributed),
            n(&s.rescans),
            n(&s.hints),
            n(&s.demoted),
            n(&s.discarded),
            relists.join(", ")
        )
    }

    /// Waits until a relist is requested; returns whether one was within `timeout`.
    pub fn wait_relist(&self, timeout: Duration) -> bool {
        let relist = self.relist.clone();
        self.runtime.block_on(async {
            tokio::time::timeout(timeout, relist.requested())
                .await
                .is_ok()
        })
    }

    /// Every event received so far without waiting, for `container_id`.
    pub fn drain_events(&mut self, container_id: &str) -> Vec<PodLifecycleEvent> {
        while let Ok(e) = self.events.try_recv() {
            self.pending_events.push(e);
        }
        let (mine, others) = self.pending_events.drain(..).partition(|e| {
            e.container_id
                .as_ref()
                .is_some_and(|c| c.as_str() == container_id)
        });
        self.pending_events = others;
        mine
    }

    /// The first raw record satisfying `pred`, with its kernel-to-reader delay;
    /// records before it are discarded. Panics after `timeout`.
    pub fn record(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&KernelEvent) -> bool,
    ) -> (KernelEvent, u64) {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.records.recv_timeout(left) {
                Ok((ev, delay)) if pred(&ev) => return (ev, delay),
                Ok(_) => {}
                Err(_) => panic!("no matching kernel record within {timeout:?}"),
            }
        }
    }

    /// Calls `f` on every raw record until it returns `true` or `timeout` passes;
    /// returns whether it finished.
    pub fn records_until(
        &self,
        timeout: Duration,
        mut f: impl FnMut(&KernelEvent) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.records.recv_timeout(left) {
                Ok((ev, _)) => {
                    if f(&ev) {
                        return true;
                    }
                }
                Err(_) => return false,
            }
        }
    }
}

/// What a [`ReaderGate`] runs on the reader thread at each record.
type Probe = Box<dyn FnMut(&KernelEvent) + Send>;

/// Holds the ring-buffer reader thread (through the record tap) while closed.
/// `ReaderGate::default()` is open.
#[derive(Default)]
pub struct ReaderGate {
    closed: Mutex<bool>,
    changed: Condvar,
    held: AtomicBool,
    probe: Mutex<Option<Probe>>,
}

impl std::fmt::Debug for ReaderGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReaderGate")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

impl ReaderGate {
    /// A closed gate.
    pub fn closed() -> Arc<Self> {
        let mut gate = Self::default();
        *gate.closed.get_mut().unwrap_or_else(|e| e.into_inner()) = true;
        Arc::new(gate)
    }

    /// Runs `probe` on the reader thread with each record from now on, where
    /// the record is handled (after the commands before it were looked at,
    /// before its events are delivered), before the gate may hold it.
    pub fn probe(&self, probe: impl FnMut(&KernelEvent) + Send + 'static) {
        *self.probe.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(probe));
    }

    /// On the reader thread (from a record tap): runs the probe, then waits
    /// while the gate is closed.
    pub fn pass(&self, record: &KernelEvent) {
        if let Some(probe) = self
            .probe
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            probe(record);
        }
        let mut closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        while *closed {
            self.held.store(true, Ordering::SeqCst);
            closed = self.changed.wait(closed).unwrap_or_else(|e| e.into_inner());
        }
        self.held.store(false, Ordering::SeqCst);
    }

    /// Waits until the reader is held at the gate; false after `timeout`.
    pub fn wait_held(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.held.load(Ordering::SeqCst) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Holds the reader again at the next record it decodes.
    pub fn close(&self) {
        *self.closed.lock().unwrap_or_else(|e| e.into_inner()) = true;
    }

    /// Lets the reader go on, until the next [`close`](Self::close).
    pub fn open(&self) {
        *self.closed.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.changed.notify_all();
    }
}

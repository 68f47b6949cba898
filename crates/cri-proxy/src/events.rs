//! GetContainerEvents served from the kernel PLEG, as containerd 1.7 serves
//! its own stream (`generateAndSendContainerEvent`): each event names the
//! container (or sandbox), its type, `created_at`, and the pod's state read
//! from the runtime right after it, which the 1.26-1.36 Evented PLEG writes
//! into its cache as the pod's status (`GeneratePodStatus`), and the 1.37
//! hint mode uses only to relist the pod.
//!
//! | event | when | `created_at` |
//! |---|---|---|
//! | CREATED | a CreateContainer or RunPodSandbox through the proxy succeeded | the answer's arrival |
//! | STARTED | the PLEG's ContainerStarted / SandboxStarted (the kernel saw the main process exec) | the kernel's timestamp |
//! | STOPPED | the PLEG's ContainerDied / SandboxDied: certain deaths only | the kernel's timestamp of the exit |
//! | DELETED | a RemoveContainer or RemovePodSandbox through the proxy succeeded, or the PLEG's relist found it gone | the answer's arrival, or the relist's |
//!
//! Where it differs from containerd: CREATED is not the cgroup's creation
//! (with containerd, runc creates the cgroup in StartContainer, not in
//! CreateContainer), so it comes from the call; a container created on the
//! runtime by another client has no CREATED. Relist-sourced reports of what
//! happened before the proxy started (its first relist lists everything) are
//! not events. A kernel death's exit code, reason and finish time are laid on
//! the payload read for its STOPPED when the runtime has not caught up
//! ([`super::overlay`]), whatever `--overlay` says, and a STARTED's container
//! still CREATED in the runtime's answer is shown running since the kernel's
//! exec: the event and its payload never disagree.
//!
//! With `--merge-runtime-events` a third input is the runtime's own stream
//! ([`super::merge`]): its events pass when the proxy has not served their
//! stage yet (a CREATED or DELETED of another client's call, a death the
//! kernel missed), and every event, whatever its source, is served at most
//! once per container and stage.
//!
//! Where it differs in order: containerd reads each event's payload before
//! the next event's; here each pod has its queue ([`pod_queue`]): a pod's
//! events in the order they came, different pods' payload reads at once, so
//! one pod's slow read does not hold another pod's death. Every input (PLEG
//! events, calls, the runtime's stream) goes through its pod's queue, so the
//! merge's "served once" holds as it did one event at a time.

mod payload;
pub mod pod_queue;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use evpleg_cri_api::v1;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::grpc;
use super::hub::Hub;
use super::merge::{Decision, Origin, Served, Stage};
use super::overlay::{CONFIRM_BOUND, KernelDeath, Overlay};
use super::stats::ProxyStats;
use evpleg_core::clock::SharedClock;
use evpleg_core::clock::{monotonic_to_unix_ns, wall_clock_ns};
use evpleg_core::ids::ContainerId;
use evpleg_core::lifecycle::{EventKind, EventSource, PodLifecycleEvent};
use evpleg_cri::CriClient;
pub use payload::{PayloadSource, Read};
use pod_queue::PodQueues;

use v1::ContainerEventType as T;

/// A call through the proxy that makes an event.
#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    /// CreateContainer (with its sandbox) or RunPodSandbox (sandbox: None).
    Created { id: String, sandbox: Option<String> },
    /// RemoveContainer (sandbox: None) or RemovePodSandbox of an object the
    /// runtime had (an idempotent removal of an unknown id makes no call).
    Removed {
        id: String,
        sandbox: Option<Box<RemovedSandbox>>,
    },
}

/// What a RemovePodSandbox removed besides the sandbox, asked before it was
/// forwarded.
#[derive(Clone, Debug, PartialEq)]
pub struct RemovedSandbox {
    /// Its status then (the DELETED events' payload; not ready by then).
    pub status: Option<v1::PodSandboxStatus>,
    /// Its containers, removed with it: each gets its DELETED first.
    pub containers: Vec<String>,
}

/// Ids remembered so that a DELETED still has its pod.
#[derive(Debug, Default)]
struct Known {
    /// container -> its sandbox.
    sandbox_of: HashMap<String, String>,
    /// sandbox -> its last status read.
    sandboxes: HashMap<String, v1::PodSandboxStatus>,
    /// Recently deleted (the relist's later report is not a second DELETED).
    deleted: VecDeque<String>,
    deleted_set: HashSet<String>,
}

const DELETED_MEMORY: usize = 4096;

impl Known {
    fn mark_deleted(&mut self, id: &str) -> bool {
        if !self.deleted_set.insert(id.to_owned()) {
            return false;
        }
        self.deleted.push_back(id.to_owned());
        if self.deleted.len() > DELETED_MEMORY
            && let Some(old) = self.deleted.pop_front()
        {
            self.deleted_set.remove(&old);
        }
        true
    }
}

/// Turns PLEG events and calls into served events.
#[derive(Debug)]
pub struct Events {
    pub cri: CriClient,
    pub hub: Arc<Hub>,
    pub overlay: Arc<Overlay>,
    pub stats: Arc<ProxyStats>,
    pub clock: SharedClock,
    /// Unix ns when the proxy started.
    pub start_wall_ns: i64,
    /// Where payloads are read (the runtime, `cri`, but in unit tests).
    source: Arc<dyn PayloadSource>,
    known: Known,
    /// `--merge-runtime-events`: what was served, per id ([`super::merge`]).
    served: Option<Served>,
    /// The kernel path, restarted after a death: a new PLEG's first relist
    /// reports every container again, which is no event.
    path: Option<Arc<super::kernel_path::KernelPath>>,
    /// Work per pod, in order ([`pod_queue`]).
    queues: PodQueues<Work>,
    /// The payload reads in flight, one per pod at most.
    reads: Reads,
}

/// One piece of the event task's work, queued on its pod.
#[derive(Debug)]
enum Work {
    /// A PLEG event (its overlay entry made on arrival).
    Pleg(PodLifecycleEvent),
    /// A CreateContainer or RunPodSandbox through the proxy.
    Created { id: String, sandbox: bool, at: i64 },
    /// A removal through the proxy (its DELETED).
    Removed { id: String, sandbox: bool, at: i64 },
    /// An event of the runtime's own stream.
    Runtime(Box<v1::ContainerEventResponse>),
}

/// An event whose payload is being read, and what is laid on it once read.
#[derive(Clone, Debug, PartialEq)]
struct Job {
    id: String,
    t: T,
    sandbox: bool,
    created_at: i64,
    /// A kernel start: the container shown running since the exec
    /// ([`started_on`]).
    started_on: bool,
    /// A sandbox's death: shown not ready ([`sandbox_stopped`]).
    sandbox_stopped: bool,
    /// A relist's report: not served if it happened before the proxy (or
    /// its PLEG) started ([`Events::before_start`]).
    check_before_start: bool,
}

/// A read done: its pod's key, its event and what was read.
type Done = (String, Job, Read);

/// The reads in flight.
#[derive(Default)]
struct Reads(FuturesUnordered<BoxFuture<'static, Done>>);

impl std::fmt::Debug for Reads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reads({} in flight)", self.0.len())
    }
}

/// What one PLEG event becomes: the type, the id, whether it is a sandbox.
fn event_type(kind: EventKind) -> Option<(T, bool)> {
    match kind {
        EventKind::ContainerStarted => Some((T::ContainerStartedEvent, false)),
        EventKind::ContainerDied => Some((T::ContainerStoppedEvent, false)),
        EventKind::ContainerRemoved => Some((T::ContainerDeletedEvent, false)),
        EventKind::SandboxStarted => Some((T::ContainerStartedEvent, true)),
        EventKind::SandboxDied => Some((T::ContainerStoppedEvent, true)),
        EventKind::SandboxRemoved => Some((T::ContainerDeletedEvent, true)),
        // A hint: the PLEG relists the pod and reports what it finds.
        EventKind::PodSync => None,
    }
}

impl Events {
    pub fn new(
        cri: CriClient,
        hub: Arc<Hub>,
        overlay: Arc<Overlay>,
        stats: Arc<ProxyStats>,
        clock: SharedClock,
    ) -> Self {
        Self {
            source: Arc::new(cri.clone()),
            cri,
            hub,
            overlay,
            stats,
            clock,
            start_wall_ns: wall_clock_ns(),
            known: Known::default(),
            served: None,
            path: None,
            queues: PodQueues::default(),
            reads: Reads::default(),
        }
    }

    /// Reports from before the running PLEG started are no events either.
    pub fn following(mut self, path: Arc<super::kernel_path::KernelPath>) -> Self {
        self.path = Some(path);
        self
    }

    /// Merges the runtime's own stream: every event is then checked against
    /// what was served ([`super::merge`]).
    pub fn merging(mut self) -> Self {
        self.served = Some(Served::default());
        self
    }

    /// Reads payloads from `source` instead of the runtime (tests).
    pub fn reading_from(mut self, source: Arc<dyn PayloadSource>) -> Self {
        self.source = source;
        self
    }

    /// Whether an event of `t` for `id` from `origin` is served (always,
    /// without the merge); a suppressed one is counted.
    fn admit(&self, id: &str, t: T, origin: Origin) -> bool {
        let Some(served) = &self.served else {
            return true;
        };
        let decision = served.decide(id, Stage::of(t), origin);
        if decision != Decision::Pass {
            debug!(
                id,
                event = t.as_str_name(),
                origin = origin.label(),
                why = decision.label(),
                "event suppressed"
            );
            self.stats
                .suppressed
                .get_or_create(&super::stats::Suppressed {
                    r#type: t.as_str_name().to_owned(),
                    origin: origin.label().to_owned(),
                    reason: decision.label().to_owned(),
                })
                .inc();
        }
        decision == Decision::Pass
    }

    /// Serves events until `shutdown` or until the PLEG ends (the work
    /// taken by then is finished); `runtime`: the runtime's own stream, with
    /// `--merge-runtime-events`.
    pub async fn run(
        mut self,
        mut pleg: mpsc::Receiver<PodLifecycleEvent>,
        mut calls: mpsc::Receiver<Call>,
        mut runtime: Option<mpsc::Receiver<v1::ContainerEventResponse>>,
        shutdown: CancellationToken,
    ) {
        loop {
            let from_runtime = async {
                match runtime.as_mut() {
                    Some(r) => r.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ev = pleg.recv() => match ev {
                    Some(ev) => self.pleg_event(ev),
                    None => break,
                },
                Some(call) = calls.recv() => self.call(call),
                ev = from_runtime => match ev {
                    Some(ev) => self.runtime_event(ev),
                    // The runtime has no stream (its follower ended).
                    None => runtime = None,
                },
                Some(done) = self.reads.0.next(), if !self.reads.0.is_empty() => self.read_done(done),
                () = shutdown.cancelled() => {
                    self.hub.close(super::hub::STOPPING);
                    return;
                }
            }
        }
        while let Some(done) = self.reads.0.next().await {
            self.read_done(done);
        }
        self.hub.close(super::hub::STOPPING);
    }

    /// The sandbox of `id` as far as the proxy knows: a sandbox is its own,
    /// a container's is remembered (or not yet known).
    fn known_sandbox(&self, id: &str, sandbox: bool) -> Option<String> {
        if sandbox {
            return Some(id.to_owned());
        }
        self.known.sandbox_of.get(id).cloned()
    }

    /// The pod `id` belongs to, as the queues key it: its known sandbox,
    /// else the container itself.
    fn key_of(&self, id: &str, sandbox: bool) -> String {
        self.known_sandbox(id, sandbox)
            .unwrap_or_else(|| id.to_owned())
    }

    /// Queues `work` on pod `key` and runs what of the pod may run.
    fn queue(&mut self, key: String, work: Work) {
        self.queues.push(&key, work);
        self.drain(&key);
    }

    /// Runs pod `key`'s queued work until a payload read is in flight.
    fn drain(&mut self, key: &str) {
        while let Some(work) = self.queues.next(key) {
            if let Some(job) = self.start(work) {
                let sandbox = self.known_sandbox(&job.id, job.sandbox);
                let read = self.source.read(job.id.clone(), sandbox);
                let owned = key.to_owned();
                self.reads
                    .0
                    .push(Box::pin(async move { (owned, job, read.await) }));
                self.queues.reading(key);
                break;
            }
        }
    }

    /// A read done: its event finished and sent, then the pod's next work.
    fn read_done(&mut self, (key, job, read): Done) {
        self.finish(job, read);
        self.queues.read_done(&key);
        self.drain(&key);
    }

    /// Begins one piece of work: done at once (`None`), or the event whose
    /// payload is to be read.
    fn start(&mut self, work: Work) -> Option<Job> {
        match work {
            Work::Runtime(ev) => {
                self.runtime_event_now(*ev);
                None
            }
            Work::Pleg(ev) => self.pleg_job(ev),
            Work::Created { id, sandbox, at } => self
                .admit(&id, T::ContainerCreatedEvent, Origin::Proxy)
                .then(|| Job::plain(id, T::ContainerCreatedEvent, sandbox, at)),
            Work::Removed { id, sandbox, at } => {
                (self.admit(&id, T::ContainerDeletedEvent, Origin::Proxy) && self.deleted(&id))
                    .then(|| Job::plain(id, T::ContainerDeletedEvent, sandbox, at))
            }
        }
    }

    /// The proxy's own DELETED of `id`, once: remembered as deleted and its
    /// overlay entries dropped; false when it was served already.
    fn deleted(&mut self, id: &str) -> bool {
        if !self.known.mark_deleted(id) {
            return false;
        }
        if let Some(c) = ContainerId::parse(id) {
            self.overlay.forget(&c);
            self.overlay.forget_sandbox(&c);
        }
        true
    }

    /// An event of the runtime's own stream, queued on its pod.
    fn runtime_event(&mut self, ev: v1::ContainerEventResponse) {
        let key = match &ev.pod_sandbox_status {
            Some(s) if !s.id.is_empty() => s.id.clone(),
            _ => self.key_of(&ev.container_id, false),
        };
        self.queue(key, Work::Runtime(Box::new(ev)));
    }

    /// An event of the runtime's own stream, at its turn: passed on when the
    /// proxy has not served its stage yet, with pending kernel deaths laid
    /// on its payload.
    fn runtime_event_now(&mut self, mut ev: v1::ContainerEventResponse) {
        let t = ev.container_event_type();
        let id = ev.container_id.clone();
        if !self.admit(&id, t, Origin::Runtime) {
            return;
        }
        if t == T::ContainerDeletedEvent {
            self.known.mark_deleted(&id);
            if let Some(c) = ContainerId::parse(&id) {
                self.overlay.forget(&c);
                self.overlay.forget_sandbox(&c);
            }
            self.known.sandbox_of.remove(&id);
            if self.known.sandboxes.remove(&id).is_some() {
                self.known.sandbox_of.retain(|_, s| *s != id);
            }
        } else if let Some(s) = &ev.pod_sandbox_status
            && s.id != id
            && !s.id.is_empty()
        {
            self.known.sandbox_of.insert(id.clone(), s.id.clone());
        }
        for s in &mut ev.containers_statuses {
            self.overlay.status(s);
        }
        self.stats
            .merged
            .get_or_create(&super::stats::EventType {
                r#type: t.as_str_name().to_owned(),
            })
            .inc();
        debug!(id = %id, event = t.as_str_name(), "the runtime's event passed on");
        self.send(ev);
    }

    /// A PLEG event: a kernel death is laid on the overlay at once (every
    /// answer from now on shows it, whatever waits), then the event is
    /// queued on its pod.
    fn pleg_event(&mut self, ev: PodLifecycleEvent) {
        let Some((_, sandbox)) = event_type(ev.kind) else {
            return;
        };
        let Some(id) = ev.container_id.clone() else {
            return;
        };
        if ev.kind == EventKind::ContainerDied
            && ev.source == EventSource::Kernel
            && let Some(exit) = ev.exit
        {
            let death = KernelDeath {
                exit,
                at_ns: ev.at_ns,
                finished_at: monotonic_to_unix_ns(ev.at_ns),
            };
            self.overlay.died(id.clone(), death);
            self.confirm(id.clone(), Pending::Container(death));
        }
        if ev.kind == EventKind::SandboxDied && ev.source == EventSource::Kernel {
            self.overlay.sandbox_died(id.clone());
            self.confirm(id.clone(), Pending::Sandbox { at_ns: ev.at_ns });
        }
        let key = self.key_of(id.as_str(), sandbox);
        self.queue(key, Work::Pleg(ev));
    }

    /// A PLEG event at its turn: the event to read a payload for, if served.
    fn pleg_job(&mut self, ev: PodLifecycleEvent) -> Option<Job> {
        let (t, sandbox) = event_type(ev.kind)?;
        let id = ev.container_id?;
        if !self.admit(id.as_str(), t, Origin::Proxy) {
            return None;
        }
        if t == T::ContainerDeletedEvent && !self.deleted(id.as_str()) {
            return None;
        }
        let kernel = ev.source == EventSource::Kernel;
        Some(Job {
            id: id.as_str().to_owned(),
            t,
            sandbox,
            created_at: monotonic_to_unix_ns(ev.at_ns),
            started_on: kernel && ev.kind == EventKind::ContainerStarted,
            sandbox_stopped: ev.kind == EventKind::SandboxDied,
            check_before_start: !kernel,
        })
    }

    /// A call through the proxy that makes events, queued on its pod.
    fn call(&mut self, call: Call) {
        let at = wall_clock_ns();
        match call {
            Call::Created { id, sandbox } => {
                if let Some(s) = &sandbox {
                    self.known.sandbox_of.insert(id.clone(), s.clone());
                }
                let key = self.key_of(&id, sandbox.is_none());
                let sandbox = sandbox.is_none();
                self.queue(key, Work::Created { id, sandbox, at });
            }
            Call::Removed { id, sandbox: None } => {
                let key = self.key_of(&id, false);
                self.queue(
                    key,
                    Work::Removed {
                        id,
                        sandbox: false,
                        at,
                    },
                );
            }
            Call::Removed {
                id,
                sandbox: Some(removed),
            } => {
                // As containerd removes them: the containers, then the sandbox.
                let RemovedSandbox { status, containers } = *removed;
                if let Some(s) = status {
                    self.known.sandboxes.insert(id.clone(), s);
                }
                for c in containers {
                    self.known.sandbox_of.insert(c.clone(), id.clone());
                    let work = Work::Removed {
                        id: c,
                        sandbox: false,
                        at,
                    };
                    self.queue(id.clone(), work);
                }
                let work = Work::Removed {
                    id: id.clone(),
                    sandbox: true,
                    at,
                };
                self.queue(id, work);
            }
        }
    }

    /// Checks a pending overlay entry until the runtime agrees ([`confirm`]).
    fn confirm(&self, id: ContainerId, pending: Pending) {
        tokio::spawn(confirm(
            self.cri.clone(),
            self.overlay.clone(),
            self.stats.clone(),
            self.clock.clone(),
            id,
            pending,
        ));
    }

    fn send(&mut self, resp: v1::ContainerEventResponse) {
        let t = resp.container_event_type();
        if let Some(served) = &mut self.served {
            served.served(&resp.container_id, Stage::of(t));
        }
        self.stats.event(t.as_str_name());
        self.hub.publish(&grpc::frame(&resp));
    }

    /// A relist-sourced report whose runtime timestamp is older than the
    /// proxy, or than the running PLEG (the first relist reports every
    /// existing container).
    fn before_start(&self, resp: &v1::ContainerEventResponse, t: T) -> bool {
        let at = match resp
            .containers_statuses
            .iter()
            .find(|c| c.id == resp.container_id)
        {
            Some(c) if t == T::ContainerStartedEvent => c.started_at,
            Some(c) if t == T::ContainerStoppedEvent => c.finished_at,
            Some(_) => return false,
            None => match &resp.pod_sandbox_status {
                Some(s) if s.id == resp.container_id && t == T::ContainerStartedEvent => {
                    s.created_at
                }
                _ => return false,
            },
        };
        let since = self.path.as_ref().map_or(self.start_wall_ns, |p| {
            p.started_wall_ns().max(self.start_wall_ns)
        });
        at > 0 && at < since
    }

    /// A read done: the event with the pod's state as read, kernel deaths
    /// laid on containers the runtime still reported running, then sent
    /// unless it is a relist's report of something from before the start.
    fn finish(&mut self, job: Job, read: Read) {
        let mut resp = self.payload(&job, read);
        if job.started_on {
            started_on(&mut resp, job.created_at);
        }
        if job.sandbox_stopped {
            sandbox_stopped(&mut resp);
        }
        if job.check_before_start && self.before_start(&resp, job.t) {
            debug!(id = %job.id, event = job.t.as_str_name(), "a transition from before the proxy started");
            return;
        }
        self.send(resp);
    }

    /// The event of `job` with the pod's state as `read`, the overlay's
    /// deaths laid on it; the ids read remembered.
    fn payload(&mut self, job: &Job, read: Read) -> v1::ContainerEventResponse {
        let mut resp = v1::ContainerEventResponse {
            container_id: job.id.clone(),
            container_event_type: job.t as i32,
            created_at: job.created_at,
            ..Default::default()
        };
        let Some(sandbox_id) = read.sandbox_id else {
            warn!(
                id = %job.id,
                "no pod sandbox found for the event's container: sent without its pod's state"
            );
            return resp;
        };
        if !job.sandbox {
            self.known
                .sandbox_of
                .insert(job.id.clone(), sandbox_id.clone());
        }
        resp.pod_sandbox_status = match read.sandbox_status {
            Ok(s) => {
                if let Some(s) = &s {
                    self.known.sandboxes.insert(sandbox_id.clone(), s.clone());
                }
                s
            }
            Err(e) => {
                debug!(sandbox = %sandbox_id, error = %e, "sandbox status for an event");
                // Removed: its last status, no longer ready.
                self.known.sandboxes.get(&sandbox_id).cloned().map(|mut s| {
                    s.state = v1::PodSandboxState::SandboxNotready as i32;
                    s
                })
            }
        };
        let containers = read.containers.unwrap_or_else(|e| {
            warn!(sandbox = %sandbox_id, error = %e, "listing a pod's containers for an event");
            Vec::new()
        });
        for (id, status) in containers {
            self.known.sandbox_of.insert(id.clone(), sandbox_id.clone());
            match status {
                Ok(mut s) => {
                    self.overlay.status(&mut s);
                    resp.containers_statuses.push(s);
                }
                Err(e) => debug!(id = %id, error = %e, "container status for an event"),
            }
        }
        if job.t == T::ContainerDeletedEvent {
            self.known.sandbox_of.remove(&job.id);
            if job.sandbox {
                self.known.sandboxes.remove(&job.id);
                self.known.sandbox_of.retain(|_, s| *s != job.id);
            }
        }
        resp
    }
}

impl Job {
    /// An event of a call: nothing laid on its payload.
    fn plain(id: String, t: T, sandbox: bool, created_at: i64) -> Self {
        Self {
            id,
            t,
            sandbox,
            created_at,
            started_on: false,
            sandbox_stopped: false,
            check_before_start: false,
        }
    }
}

/// The runtime also lags at a start: read right after the kernel saw the
/// main process exec, the container may still be CREATED (StartContainer has
/// not returned). The STARTED's payload then says running since the exec, so
/// that the event and its payload agree.
fn started_on(resp: &mut v1::ContainerEventResponse, started_at: i64) {
    let id = resp.container_id.clone();
    if let Some(s) = resp.containers_statuses.iter_mut().find(|s| s.id == id)
        && s.state() == v1::ContainerState::ContainerCreated
    {
        s.state = v1::ContainerState::ContainerRunning as i32;
        s.started_at = started_at;
    }
}

/// The runtime lags at a sandbox's death as at a container's: read right
/// after the kernel saw the pause process exit, the sandbox may still be
/// READY. The STOPPED's payload then says not ready, as the runtime will.
fn sandbox_stopped(resp: &mut v1::ContainerEventResponse) {
    if let Some(s) = resp.pod_sandbox_status.as_mut()
        && s.id == resp.container_id
    {
        s.state = v1::PodSandboxState::SandboxNotready as i32;
    }
}

/// First and last wait between two checks of a pending death.
const CHECK_FIRST: Duration = Duration::from_millis(5);
const CHECK_MAX: Duration = Duration::from_millis(50);

/// One answer of the runtime about a container with a pending death.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// ContainerStatus's state.
    State(v1::ContainerState),
    /// NotFound: removed.
    NotFound,
    /// Any other failure (the runtime is away).
    Failed,
}

/// What one check of a pending death decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Check {
    /// The runtime has not caught up, within the bound: ask again.
    Again,
    /// The runtime says exited: the lead is recorded, the entry ends.
    CaughtUp,
    /// Still not exited past the bound: the runtime wins (counted, logged).
    Contradicted,
    /// Removed, or unanswered at the bound: nothing to overlay any more.
    Gone,
}

/// The check's rule ([`super::overlay::caught_up`]: only EXITED is the
/// runtime catching up; RUNNING, CREATED and UNKNOWN are not).
///
/// | answer | within the bound | past it |
/// |---|---|---|
/// | EXITED | `CaughtUp` | `CaughtUp` |
/// | RUNNING, CREATED, UNKNOWN | `Again` | `Contradicted` |
/// | NotFound | `Gone` | `Gone` |
/// | another failure | `Again` | `Gone` |
fn check(answer: Answer, past_bound: bool) -> Check {
    match answer {
        Answer::State(s) if super::overlay::caught_up(s as i32) => Check::CaughtUp,
        Answer::State(_) if past_bound => Check::Contradicted,
        Answer::State(_) => Check::Again,
        Answer::NotFound => Check::Gone,
        Answer::Failed if past_bound => Check::Gone,
        Answer::Failed => Check::Again,
    }
}

/// An overlay entry being checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pending {
    /// A container's death.
    Container(KernelDeath),
    /// A sandbox's pause process exit (CLOCK_MONOTONIC ns).
    Sandbox { at_ns: u64 },
}

impl Pending {
    fn at_ns(self) -> u64 {
        match self {
            Self::Container(d) => d.at_ns,
            Self::Sandbox { at_ns } => at_ns,
        }
    }

    /// The runtime's answer about `id`; a sandbox's NOTREADY is read as its
    /// EXITED, READY as RUNNING.
    async fn ask(self, cri: &CriClient, id: &ContainerId) -> Answer {
        let asked =
            match self {
                Self::Container(_) => cri.container_status(id.as_str(), false).await.map(|r| {
                    r.status
                        .map(|s| s.state())
                        .unwrap_or(v1::ContainerState::ContainerUnknown)
                }),
                Self::Sandbox { .. } => cri.pod_sandbox_status(id.as_str(), false).await.map(|r| {
                    match r.status.map(|s| s.state()) {
                        Some(v1::PodSandboxState::SandboxReady) => {
                            v1::ContainerState::ContainerRunning
                        }
                        Some(_) => v1::ContainerState::ContainerExited,
                        None => v1::ContainerState::ContainerUnknown,
                    }
                }),
            };
        match asked {
            Ok(state) => Answer::State(state),
            Err(e) if e.is_not_found() => Answer::NotFound,
            Err(e) => {
                debug!(id = %id, error = %e, "checking a pending death");
                Answer::Failed
            }
        }
    }

    fn forget(self, overlay: &Overlay, id: &ContainerId) -> bool {
        match self {
            Self::Container(_) => overlay.forget(id).is_some(),
            Self::Sandbox { .. } => overlay.forget_sandbox(id),
        }
    }

    /// The runtime caught up: the entry is settled, not forgotten (answers
    /// it made before are stale: [`Overlay::settle`]).
    fn settle(self, overlay: &Overlay, id: &ContainerId) {
        match self {
            Self::Container(_) => overlay.settle(id),
            Self::Sandbox { .. } => overlay.settle_sandbox(id),
        };
    }
}

/// Asks the runtime about a pending death (5 ms doubling to 50 ms) until it
/// reports the container exited (the sandbox not ready): the lead is
/// recorded and the entry ends. Not exited past [`CONFIRM_BOUND`]: the
/// runtime wins, loudly (the kernel PLEG's contract clause 3). See [`check`].
async fn confirm(
    cri: CriClient,
    overlay: Arc<Overlay>,
    stats: Arc<ProxyStats>,
    clock: SharedClock,
    id: ContainerId,
    pending: Pending,
) {
    let deadline = pending.at_ns() + CONFIRM_BOUND.as_nanos() as u64;
    let mut wait = CHECK_FIRST;
    loop {
        let answer = pending.ask(&cri, &id).await;
        let now = clock.now_ns();
        match check(answer, now >= deadline) {
            Check::Again => {}
            Check::CaughtUp => {
                stats
                    .kernel_lead_seconds
                    .observe(now.saturating_sub(pending.at_ns()) as f64 / 1e9);
                pending.settle(&overlay, &id);
                return;
            }
            Check::Contradicted => {
                if pending.forget(&overlay, &id) {
                    stats.contradictions.inc();
                    warn!(id = %id, pending = ?pending, answer = ?answer,
                        "the runtime still does not report exited {}s after the kernel saw the main process exit: the runtime wins",
                        CONFIRM_BOUND.as_secs());
                }
                return;
            }
            Check::Gone => {
                pending.forget(&overlay, &id);
                return;
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(CHECK_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`check`]'s table, row by row.
    #[test]
    fn a_pending_death_is_checked_until_the_runtime_says_exited() {
        use v1::ContainerState as S;
        let rows = [
            (Answer::State(S::ContainerExited), false, Check::CaughtUp),
            (Answer::State(S::ContainerExited), true, Check::CaughtUp),
            (Answer::State(S::ContainerRunning), false, Check::Again),
            (
                Answer::State(S::ContainerRunning),
                true,
                Check::Contradicted,
            ),
            // The start not finished in the runtime: not caught up (a first
            // version took it for caught up and dropped the death).
            (Answer::State(S::ContainerCreated), false, Check::Again),
            (
                Answer::State(S::ContainerCreated),
                true,
                Check::Contradicted,
            ),
            (Answer::State(S::ContainerUnknown), false, Check::Again),
            (
                Answer::State(S::ContainerUnknown),
                true,
                Check::Contradicted,
            ),
            (Answer::NotFound, false, Check::Gone),
            (Answer::NotFound, true, Check::Gone),
            (Answer::Failed, false, Check::Again),
            (Answer::Failed, true, Check::Gone),
        ];
        for (answer, past, want) in rows {
            assert_eq!(
                check(answer, past),
                want,
                "{answer:?}, past the bound: {past}"
            );
        }
    }

    /// Issue #26: a sandbox's STOPPED read SANDBOX_READY when the runtime
    /// had not seen the pause process exit yet.
    #[test]
    fn a_sandbox_stopped_payload_says_not_ready() {
        let sandbox = |id: &str| v1::PodSandboxStatus {
            id: id.into(),
            state: v1::PodSandboxState::SandboxReady as i32,
            ..Default::default()
        };
        let mut resp = v1::ContainerEventResponse {
            container_id: "s".into(),
            container_event_type: T::ContainerStoppedEvent as i32,
            pod_sandbox_status: Some(sandbox("s")),
            ..Default::default()
        };
        sandbox_stopped(&mut resp);
        assert_eq!(
            resp.pod_sandbox_status.map(|s| s.state()),
            Some(v1::PodSandboxState::SandboxNotready)
        );
        // Another sandbox's status (never the case for a sandbox's event)
        // is left as the runtime said.
        let mut other = v1::ContainerEventResponse {
            container_id: "s".into(),
            pod_sandbox_status: Some(sandbox("t")),
            ..Default::default()
        };
        sandbox_stopped(&mut other);
        assert_eq!(
            other.pod_sandbox_status.map(|s| s.state()),
            Some(v1::PodSandboxState::SandboxReady)
        );
    }

    #[test]
    fn a_started_payload_shows_running_since_the_exec() {
        let status = |id: &str, state: v1::ContainerState| v1::ContainerStatus {
            id: id.into(),
            state: state as i32,
            ..Default::default()
        };
        let mut resp = v1::ContainerEventResponse {
            container_id: "a".into(),
            containers_statuses: vec![
                status("a", v1::ContainerState::ContainerCreated),
                status("b", v1::ContainerState::ContainerCreated),
            ],
            ..Default::default()
        };
        started_on(&mut resp, 42);
        let a = &resp.containers_statuses[0];
        assert_eq!(
            (a.state(), a.started_at),
            (v1::ContainerState::ContainerRunning, 42)
        );
        // Another container of the pod is the runtime's.
        assert_eq!(
            resp.containers_statuses[1].state(),
            v1::ContainerState::ContainerCreated
        );
        // An exited one (a very short run) is left as it is.
        let mut exited = resp.clone();
        exited.containers_statuses[0] = status("a", v1::ContainerState::ContainerExited);
        let before = exited.clone();
        started_on(&mut exited, 42);
        assert_eq!(exited, before);
    }
    /// Payloads read at once, except those of the sandboxes a test gates:
    /// each pod's sandbox ready, its listed containers exited.
    #[derive(Debug, Default)]
    struct Gated {
        /// sandbox -> its containers.
        pods: HashMap<String, Vec<String>>,
        /// sandbox -> its gate (reads wait for a permit).
        gates: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    }

    impl PayloadSource for Gated {
        fn read(&self, id: String, sandbox: Option<String>) -> BoxFuture<'static, Read> {
            let sandbox = sandbox.or_else(|| {
                self.pods
                    .iter()
                    .find(|(_, cs)| cs.contains(&id))
                    .map(|(s, _)| s.clone())
            });
            let gate = sandbox
                .as_ref()
                .and_then(|s| self.gates.lock().unwrap().get(s).cloned());
            let containers = sandbox
                .as_ref()
                .and_then(|s| self.pods.get(s))
                .cloned()
                .unwrap_or_default();
            Box::pin(async move {
                if let Some(gate) = gate {
                    gate.acquire().await.expect("gate open").forget();
                }
                let status = |c: &String| v1::ContainerStatus {
                    id: c.clone(),
                    state: v1::ContainerState::ContainerExited as i32,
                    ..Default::default()
                };
                Read {
                    sandbox_status: Ok(sandbox.clone().map(|id| v1::PodSandboxStatus {
                        id,
                        state: v1::PodSandboxState::SandboxReady as i32,
                        ..Default::default()
                    })),
                    containers: Ok(containers
                        .iter()
                        .map(|c| (c.clone(), Ok(status(c))))
                        .collect()),
                    sandbox_id: sandbox,
                }
            })
        }
    }

    fn event(kind: EventKind, id: &str) -> PodLifecycleEvent {
        PodLifecycleEvent {
            pod_uid: None,
            kind,
            container_id: ContainerId::parse(id),
            at_ns: 1,
            source: EventSource::Relist,
            exit: None,
            pid: None,
        }
    }

    /// The next event served to `sub`, as (type, id).
    async fn served(sub: &mut super::grpc::Body) -> (T, String) {
        use http_body_util::BodyExt;
        let frame = tokio::time::timeout(Duration::from_secs(5), sub.frame())
            .await
            .expect("an event within 5 s")
            .expect("the stream goes on")
            .expect("a frame");
        let data = frame.into_data().expect("a data frame");
        let ev: v1::ContainerEventResponse = super::grpc::unary(&data).expect("an event message");
        (ev.container_event_type(), ev.container_id)
    }

    /// Issue #30: one pod's slow payload read held every other pod's events
    /// (the benchmark behind the proxy: p99 56 ms queued). A read of pod A
    /// held at its gate: pod B's death is served meanwhile, A's second death
    /// waits for its first, and A's are then served in order.
    #[tokio::test]
    async fn a_slow_read_holds_only_its_own_pods_events() {
        let (a, a1, a2) = ("a".repeat(64), "1".repeat(64), "2".repeat(64));
        let (b, b1) = ("b".repeat(64), "3".repeat(64));
        let gated = Arc::new(Gated {
            pods: HashMap::from([
                (a.clone(), vec![a1.clone(), a2.clone()]),
                (b.clone(), vec![b1.clone()]),
            ]),
            gates: Default::default(),
        });
        let stats = Arc::new(ProxyStats::default());
        let hub = Hub::new(64, stats.clone());
        let mut sub = hub.subscribe();
        let cri = CriClient::connect_unchecked("unix:///nonexistent/cri.sock", Default::default())
            .await
            .expect("a lazy client");
        let mut events = Events::new(
            cri,
            hub,
            Arc::new(Overlay::default()),
            stats,
            Arc::new(evpleg_core::clock::MonotonicClock),
        )
        .reading_from(gated.clone());
        // The sandboxes' starts make their containers known.
        for s in [&a, &b] {
            events.pleg_event(event(EventKind::SandboxStarted, s));
            let done = events.reads.0.next().await.expect("a read");
            events.read_done(done);
            assert_eq!(
                served(&mut sub).await,
                (T::ContainerStartedEvent, s.clone())
            );
        }
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        gated.gates.lock().unwrap().insert(a.clone(), gate.clone());
        events.pleg_event(event(EventKind::ContainerDied, &a1));
        events.pleg_event(event(EventKind::ContainerDied, &a2));
        events.pleg_event(event(EventKind::ContainerDied, &b1));
        // A's first read and B's are in flight; A's second waits its turn.
        assert_eq!((events.reads.0.len(), events.queues.waiting()), (2, 1));
        let done = events.reads.0.next().await.expect("B's read, A's held");
        events.read_done(done);
        assert_eq!(served(&mut sub).await, (T::ContainerStoppedEvent, b1));
        gate.add_permits(2);
        for c in [a1, a2] {
            let done = events.reads.0.next().await.expect("A's reads, in turn");
            events.read_done(done);
            assert_eq!(served(&mut sub).await, (T::ContainerStoppedEvent, c));
        }
        assert_eq!((events.reads.0.len(), events.queues.waiting()), (0, 0));
    }
}

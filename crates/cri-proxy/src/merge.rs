//! The runtime's own event stream merged into the proxy's
//! (`--merge-runtime-events`): where the runtime serves `GetContainerEvents`
//! itself (containerd >= 1.7), the proxy subscribes to it ([`follow`]) and
//! passes on what the kernel and the proxy's calls did not see (a container
//! created or removed by another client directly on the runtime, whose
//! CREATED or DELETED the proxy would otherwise learn of only at its relist,
//! or a death whose record the kernel lost); what the proxy already served is
//! suppressed, so that no event reaches a subscriber twice.
//!
//! What it reproduces: the kubelet's Evented PLEG reads one stream and acts
//! on each event once (1.26-1.36 writes the payload into its cache; 1.37
//! relists the pod). Two sources of the same lifecycle must look like one.
//!
//! A container (or sandbox) id goes through each stage of its life once:
//! CREATED, STARTED, STOPPED, DELETED (a restart is a new container in the
//! CRI). The table keeps, per id, the set of stages served ([`Stages`]), and
//! [`decide`] rules on each arriving event from that alone:
//!
//! | stages served | event | origin | decision | stages served then |
//! |---|---|---|---|---|
//! | none | any stage | either | pass | that stage |
//! | some, all earlier than the event's | the event's stage | either | pass | with the event's |
//! | the event's among them | the event's stage | either | suppress: duplicate | unchanged |
//! | a later one among them, not the event's | the event's stage | runtime | suppress: stale (it would take the container back in its life) | unchanged |
//! | a later one among them, not the event's | the event's stage | proxy | pass (as without the merge: the kernel and the calls are the proxy's own sources) | with the event's |
//!
//! Where it differs from a plain union of the streams: the first source to
//! bring a stage wins, whichever it is (the kernel, nearly always: containerd
//! 1.7 sends its STOPPED tens to hundreds of milliseconds after the exit); a
//! runtime event passed on keeps the runtime's payload, with pending kernel
//! deaths laid on it ([`super::overlay`]), so that it never contradicts a
//! STOPPED already served.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use evpleg_cri_api::v1;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::hub::Hub;
use super::kernel_path::KernelPath;
use super::stats::ProxyStats;
use evpleg_cri::CriClient;

use v1::ContainerEventType as T;

/// A stage of a container's (or sandbox's) life, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    Created,
    Started,
    Stopped,
    Deleted,
}

impl Stage {
    pub fn of(t: T) -> Self {
        match t {
            T::ContainerCreatedEvent => Self::Created,
            T::ContainerStartedEvent => Self::Started,
            T::ContainerStoppedEvent => Self::Stopped,
            T::ContainerDeletedEvent => Self::Deleted,
        }
    }
}

/// Where an event comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Origin {
    /// The proxy's own sources: the kernel PLEG and the calls through it.
    Proxy,
    /// The runtime's own stream.
    Runtime,
}

impl Origin {
    pub fn label(self) -> &'static str {
        match self {
            Self::Proxy => "proxy",
            Self::Runtime => "runtime",
        }
    }
}

/// What becomes of an arriving event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Pass,
    /// The stage was served already.
    Duplicate,
    /// A later stage was served already (runtime events only).
    Stale,
}

impl Decision {
    pub fn label(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Duplicate => "duplicate",
            Self::Stale => "stale",
        }
    }
}

/// The stages served for one id (a set of four).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stages(u8);

impl Stages {
    fn bit(stage: Stage) -> u8 {
        1 << stage as u8
    }

    pub fn of(stages: &[Stage]) -> Self {
        stages.iter().fold(Self::default(), |s, &t| s.with(t))
    }

    pub fn with(self, stage: Stage) -> Self {
        Self(self.0 | Self::bit(stage))
    }

    pub fn contains(self, stage: Stage) -> bool {
        self.0 & Self::bit(stage) != 0
    }

    /// Whether a stage later than `stage` was served.
    pub fn past(self, stage: Stage) -> bool {
        self.0 >> (stage as u8 + 1) != 0
    }
}

/// The module's table: the decision for `event` from `origin` when `served`
/// are the stages served for its id.
pub fn decide(served: Stages, event: Stage, origin: Origin) -> Decision {
    if served.contains(event) {
        Decision::Duplicate
    } else if served.past(event) && origin == Origin::Runtime {
        Decision::Stale
    } else {
        Decision::Pass
    }
}

/// Ids remembered past their DELETED (a late duplicate is still caught).
const DELETED_MEMORY: usize = 4096;

/// The stages served per id.
#[derive(Debug, Default)]
pub struct Served {
    stages: HashMap<String, Stages>,
    /// Ids served DELETED, oldest first; forgotten past [`DELETED_MEMORY`].
    deleted: VecDeque<String>,
}

impl Served {
    pub fn decide(&self, id: &str, event: Stage, origin: Origin) -> Decision {
        decide(
            self.stages.get(id).copied().unwrap_or_default(),
            event,
            origin,
        )
    }

    /// `id`'s `stage` was served.
    pub fn served(&mut self, id: &str, stage: Stage) {
        let stages = self.stages.entry(id.to_owned()).or_default();
        *stages = stages.with(stage);
        if stage == Stage::Deleted {
            self.deleted.push_back(id.to_owned());
            if self.deleted.len() > DELETED_MEMORY
                && let Some(old) = self.deleted.pop_front()
            {
                self.stages.remove(&old);
            }
        }
    }

    /// Ids remembered.
    pub fn len(&self) -> usize {
        self.stages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }
}

/// Whether the runtime's own stream is open and merged. While it is, the
/// proxy's stream is complete without the kernel path: its subscribers keep
/// it when the kernel path dies ([`super::kernel_path::supervise`]) and a
/// subscriber in pass-through is served it ([`super::server`]). When it
/// breaks while the kernel path does not run, the subscribers' streams end
/// ([`follow`]), as at the kernel path's death without the merge.
#[derive(Debug, Default)]
pub struct RuntimeStream(AtomicBool);

impl RuntimeStream {
    pub fn is_open(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// SeqCst with the kernel path's `serving`: of a kernel path dying and
    /// this stream breaking at once, one side sees the other's.
    fn set(&self, open: bool) {
        self.0.store(open, Ordering::SeqCst);
    }
}

/// First and longest wait before subscribing again.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Subscribes to the runtime's own stream and hands each event to `tx` until
/// `shutdown`; a broken stream is subscribed again (100 ms doubling to 5 s).
/// A runtime without a stream (UNIMPLEMENTED: containerd 1.6) ends it, with
/// a warning: there is nothing to merge. `open` says whether the stream is
/// open; when it breaks while the kernel path does not run, the hub's
/// subscribers' streams end.
pub async fn follow(
    cri: CriClient,
    tx: mpsc::Sender<v1::ContainerEventResponse>,
    stats: Arc<ProxyStats>,
    open: Arc<RuntimeStream>,
    kernel: Arc<KernelPath>,
    hub: Arc<Hub>,
    shutdown: CancellationToken,
) {
    let mut wait = RETRY_FIRST;
    let mut outage_logged = false;
    loop {
        // containerd sends the answer's headers with its first event: the
        // call resolves then.
        let opened = tokio::select! {
            r = cri.get_container_events() => r,
            () = shutdown.cancelled() => return,
        };
        let error = match opened {
            Ok(mut stream) => {
                info!("merging the runtime's own event stream");
                open.set(true);
                outage_logged = false;
                wait = RETRY_FIRST;
                let broke = loop {
                    let next = tokio::select! {
                        m = stream.message() => m,
                        () = shutdown.cancelled() => return,
                    };
                    match next {
                        Ok(Some(ev)) => {
                            stats.runtime_events.inc();
                            if tx.send(ev).await.is_err() {
                                return;
                            }
                        }
                        Ok(None) => break "the runtime ended its stream".to_owned(),
                        Err(e) => break e.to_string(),
                    }
                };
                open.set(false);
                if !kernel.serving() {
                    warn!(
                        error = broke,
                        "the runtime's stream broke while the kernel path does not run: event subscribers' streams end"
                    );
                    hub.close("the runtime's stream broke while the kernel path does not run: subscribe again");
                }
                broke
            }
            Err(e) if e.code() == Some(tonic::Code::Unimplemented) => {
                warn!(error = %e,
                    "the runtime serves no GetContainerEvents of its own: --merge-runtime-events has nothing to merge");
                return;
            }
            Err(e) => e.to_string(),
        };
        stats.runtime_stream_failures.inc();
        if outage_logged {
            debug!(error, ?wait, "the runtime's event stream: still failing");
        } else {
            warn!(
                error,
                ?wait,
                "the runtime's event stream broke; subscribing again (its events meanwhile are not merged: the kernel's are served)"
            );
            outage_logged = true;
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shutdown.cancelled() => return,
        }
        wait = (wait * 2).min(RETRY_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Decision::{Duplicate, Pass, Stale};
    use Origin::{Proxy, Runtime};
    use Stage::{Created, Deleted, Started, Stopped};

    /// The module's table, row by row.
    #[test]
    fn the_decision_table() {
        let rows: &[(&[Stage], Stage, Origin, Decision)] = &[
            // Nothing served yet: anything passes.
            (&[], Created, Runtime, Pass),
            (&[], Stopped, Runtime, Pass),
            (&[], Deleted, Proxy, Pass),
            // A later stage passes, from either source.
            (&[Created], Started, Runtime, Pass),
            (&[Created, Started], Stopped, Proxy, Pass),
            (&[Started, Stopped], Deleted, Runtime, Pass),
            (&[Created], Deleted, Runtime, Pass),
            // A stage served already: a duplicate, from either source.
            (&[Created], Created, Proxy, Duplicate),
            (&[Created], Created, Runtime, Duplicate),
            (&[Started, Stopped], Stopped, Runtime, Duplicate),
            (&[Stopped], Stopped, Proxy, Duplicate),
            (&[Deleted], Deleted, Runtime, Duplicate),
            (&[Deleted], Deleted, Proxy, Duplicate),
            // ...even once a later one was served.
            (
                &[Created, Started, Stopped, Deleted],
                Stopped,
                Proxy,
                Duplicate,
            ),
            (&[Started, Deleted], Started, Runtime, Duplicate),
            // An earlier stage not served, from the runtime, would go back in
            // time.
            (&[Stopped], Started, Runtime, Stale),
            (&[Started], Created, Runtime, Stale),
            (&[Created, Deleted], Stopped, Runtime, Stale),
            // ...from the proxy it is served as without the merge.
            (&[Started], Created, Proxy, Pass),
            (&[Created, Deleted], Stopped, Proxy, Pass),
        ];
        for &(served, event, origin, want) in rows {
            assert_eq!(
                decide(Stages::of(served), event, origin),
                want,
                "{served:?} then {event:?} from {origin:?}"
            );
        }
    }

    /// The types map to the stages in the CRI's order.
    #[test]
    fn stages_follow_the_event_types() {
        let types = [
            T::ContainerCreatedEvent,
            T::ContainerStartedEvent,
            T::ContainerStoppedEvent,
            T::ContainerDeletedEvent,
        ];
        let stages: Vec<Stage> = types.into_iter().map(Stage::of).collect();
        assert_eq!(stages, [Created, Started, Stopped, Deleted]);
    }

    /// A small deterministic generator (no dependency for one test).
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    /// Model: each container's life is told by both sources, each in order,
    /// either source sometimes missing a stage, the two interleaved at
    /// random. Whatever the interleaving, every stage told by either source
    /// is served exactly once, and the runtime never takes a container back.
    #[test]
    fn two_interleaved_streams_serve_each_stage_once() {
        let all = [Created, Started, Stopped, Deleted];
        let mut rng = Lcg(7);
        for _ in 0..2000 {
            let mut served = Served::default();
            let containers = 1 + rng.next(3) as usize;
            // Per container, per source, the stages it tells, in order.
            let mut queues: Vec<[VecDeque<Stage>; 2]> = (0..containers)
                .map(|_| {
                    let mut told = || -> VecDeque<Stage> {
                        all.into_iter().filter(|_| rng.next(5) != 0).collect()
                    };
                    [told(), told()]
                })
                .collect();
            let told: Vec<[Vec<Stage>; 2]> = queues
                .iter()
                .map(|[a, b]| [a.iter().copied().collect(), b.iter().copied().collect()])
                .collect();
            let mut out: Vec<Vec<(Stage, Origin)>> = vec![Vec::new(); containers];
            loop {
                let open: Vec<(usize, usize)> = (0..containers)
                    .flat_map(|c| (0..2).map(move |s| (c, s)))
                    .filter(|&(c, s)| !queues[c][s].is_empty())
                    .collect();
                if open.is_empty() {
                    break;
                }
                let (c, s) = open[rng.next(open.len() as u64) as usize];
                let stage = queues[c][s].pop_front().expect("open");
                let origin = if s == 0 { Proxy } else { Runtime };
                let id = format!("c{c}");
                if served.decide(&id, stage, origin) == Pass {
                    served.served(&id, stage);
                    out[c].push((stage, origin));
                }
            }
            for (c, out) in out.iter().enumerate() {
                let stages: Vec<Stage> = out.iter().map(|(s, _)| *s).collect();
                let unique: std::collections::BTreeSet<Stage> = stages.iter().copied().collect();
                assert_eq!(unique.len(), stages.len(), "served twice: {out:?}");
                // The runtime passes only what moves the container forward.
                let mut latest = None;
                for &(stage, origin) in out {
                    if origin == Runtime {
                        assert!(Some(stage) > latest, "backwards: {out:?}");
                    }
                    latest = latest.max(Some(stage));
                }
                // Nothing told by the proxy is lost; a stage told by the
                // runtime alone is lost only when a later one was served.
                for stage in &told[c][0] {
                    assert!(unique.contains(stage), "{stage:?} lost: {out:?}");
                }
                for stage in &told[c][1] {
                    assert!(
                        unique.contains(stage) || unique.iter().any(|s| s > stage),
                        "{stage:?} lost: {out:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn deleted_ids_are_forgotten_past_the_memory() {
        let mut served = Served::default();
        for n in 0..DELETED_MEMORY + 10 {
            served.served(&format!("c{n}"), Deleted);
        }
        assert_eq!(served.len(), DELETED_MEMORY);
        assert_eq!(served.decide("c0", Deleted, Runtime), Pass);
        let last = format!("c{}", DELETED_MEMORY + 9);
        assert_eq!(served.decide(&last, Deleted, Runtime), Duplicate);
        // A living container is never forgotten.
        let mut served = Served::default();
        served.served("alive", Started);
        for n in 0..DELETED_MEMORY + 10 {
            served.served(&format!("c{n}"), Deleted);
        }
        assert_eq!(served.decide("alive", Started, Proxy), Duplicate);
    }
}

//! The scale workload (issue #11): container-like cgroups
//! (`/kubepods/besteffort/pod<uid>/<64-hex id>`) each holding one plain
//! process (`sleep`, joined to the cgroup before its exec, as a runtime's init
//! does), beside an empty cgroup for the pod's sandbox, no container runtime;
//! an in-process fake CRI server ([`crate::fake_cri`]) lists them as pods. The PLEG runs in `ebpf` mode over
//! that fake (reader, merge, relist); at each rate, a set of victims of their
//! own (as many cgroups as the rate held for the phase's seconds, up to
//! [`VICTIMS_MAX`]) is killed at that rate beside the idle cgroups, and each
//! death's stages come from the agent's stage log; the CPU figures cover the
//! loaded window only (the first kill to the last). Then the overflow
//! path (a one-page ring buffer, its reader held during a burst) and the
//! generic relist's cost at the same count. Every cgroup and process made here
//! is removed when [`Cgroups`] is dropped, also on error.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use evpleg_core::lifecycle::{EventKind, EventSource, PodLifecycleEvent};
use evpleg_cri::{CriClient, CriClientConfig};
use evpleg_pleg::kernel::KernelPlegConfig;
use evpleg_pleg::kernel::event::KernelEvent;
use evpleg_pleg::kernel::offload::HandoffCause;
use evpleg_pleg::kernel::relist_requests::RelistReason;
use evpleg_pleg::relist::FullRelistCause;
use evpleg_pleg::stages::Stage;
use evpleg_pleg::{Pleg, PlegMode};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::fake_cri::{FakeCri, FakePod};
use crate::stats::Percentiles;

/// One rate's measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScaleRate {
    pub cgroups: usize,
    /// The rate asked for, and the one the killer thread achieved.
    pub target_per_s: f64,
    pub achieved_per_s: f64,
    pub deaths: usize,
    /// How long the rate was held (the loaded window: first kill to last),
    /// s (`None`: a run before sustained phases).
    #[serde(default)]
    pub held_s: Option<f64>,
    /// Deaths with no ContainerDied within 35 s.
    pub lost: usize,
    /// Deaths whose ContainerDied came after 5 s (a relist's), within 35 s.
    #[serde(default)]
    pub late: usize,
    /// Records the kernel dropped (ring buffer full).
    pub dropped: u64,
    /// Per stage (`reader`, `attributed`, `cached`, `delivered`): percentiles
    /// in us of this phase's deaths.
    pub stages: ByStage<Percentiles>,
    /// Per stage, in the order of `stages`: every death's sample, us rounded
    /// to 0.1 us, from which `stages` was computed ([`stage_figures`]; the
    /// report recomputes the percentiles from them, [`ScaleRate::percentiles`]).
    /// Empty in results written before they were kept.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        serialize_with = "compact_samples"
    )]
    pub samples_us: ByStage<Vec<f64>>,
    /// The reader thread's CPU over the loaded window, % of a core.
    pub reader_cpu_pct: f64,
    /// The whole process's CPU except the fake runtime's thread, % of a core.
    pub process_cpu_pct: f64,
    /// Times the reader thread was put on a CPU over the phase, per death
    /// (schedstat's third field: each wake-up from `epoll_wait` counts one).
    #[serde(default)]
    pub reader_runs_per_death: Option<f64>,
    /// What kept the reader from its records over the phase (`None`: a run
    /// before they were kept).
    #[serde(default)]
    pub reader_sched: Option<ReaderSched>,
}

/// The reader's scheduling over a phase's loaded window: what explains a
/// stage `reader` far above its usual (issue #29: a phase's p99 of 45 ms).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReaderSched {
    /// Times it spent its real-time budget and went on at normal priority
    /// until its window ended (`evpleg_pleg_kernel_rt_throttled_total`).
    pub throttled: u64,
    /// How long it was runnable but not on a CPU, ms (schedstat's second
    /// field).
    pub waited_ms: f64,
    /// The time the host took from this machine's CPUs, all of them summed,
    /// ms (`/proc/stat`'s steal: a virtual CPU descheduled by the host).
    pub steal_ms: f64,
    /// The deaths by the CPUs of their exit and their read, with those read
    /// more than [`crate::report::STALL_US`] after their exit.
    #[serde(default)]
    pub by_cpu: Vec<crate::stages::CpuPair>,
}

impl ScaleRate {
    /// Each stage's percentiles: recomputed from the kept samples, or the
    /// stored ones for results that kept none.
    pub fn percentiles(&self) -> ByStage<Percentiles> {
        if self.samples_us.is_empty() {
            return self.stages.clone();
        }
        percentiles_of(&self.samples_us)
    }

    /// How many deaths were read more than `us` after their exit (`None`:
    /// results that kept no samples).
    pub fn read_later_than(&self, us: f64) -> Option<usize> {
        let (stage, v) = self.samples_us.first()?;
        (stage == "reader").then(|| v.iter().filter(|x| **x > us).count())
    }
}

/// Each stage's percentiles over its samples.
fn percentiles_of(samples: &ByStage<Vec<f64>>) -> ByStage<Percentiles> {
    samples
        .iter()
        .filter_map(|(stage, v)| Some((stage.clone(), Percentiles::of(v)?)))
        .collect()
}

/// Writes each stage's samples on one line of the pretty-printed results
/// (a `RawValue`), not one line a number: 20 000 numbers a stage.
fn compact_samples<S: serde::Serializer>(v: &ByStage<Vec<f64>>, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::{Error, SerializeSeq};
    let mut seq = s.serialize_seq(Some(v.len()))?;
    for (stage, samples) in v {
        let raw = serde_json::value::to_raw_value(samples).map_err(S::Error::custom)?;
        seq.serialize_element(&(stage, raw))?;
    }
    seq.end()
}

/// Per stage (by name): its percentiles, or its samples in us.
type ByStage<T> = Vec<(String, T)>;

/// The kept samples (us, rounded to 0.1 us: 20 000 deaths a phase) and the
/// percentiles computed from them, per stage.
pub fn stage_figures(stages: Vec<(Stage, Vec<f64>)>) -> (ByStage<Percentiles>, ByStage<Vec<f64>>) {
    let samples: ByStage<Vec<f64>> = stages
        .into_iter()
        .filter(|(s, v)| *s != Stage::WorkerSync && *s != Stage::StatusHeld && !v.is_empty())
        .map(|(s, v)| {
            let rounded = v.iter().map(|x| (x * 10.0).round() / 10.0).collect();
            (crate::stages::name(s).to_owned(), rounded)
        })
        .collect();
    (percentiles_of(&samples), samples)
}

/// The overflow path's proof.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Overflow {
    pub ring_bytes: u32,
    pub deaths: usize,
    pub dropped: u64,
    pub by_kernel: usize,
    pub by_relist: usize,
    pub lost: usize,
    /// From the reader's release to the last death delivered, ms.
    pub repaired_ms: f64,
}

/// The bare reader ([`crate::floor`]) at a count and rate: the reader CPU
/// that the kernel and this machine cost before any of the agent's work (its
/// wake-up in `epoll_wait`, the ring's read and the hand-off to a tokio task),
/// beside the kernel PLEG's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FloorRate {
    pub cgroups: usize,
    pub target_per_s: f64,
    pub achieved_per_s: f64,
    pub deaths: usize,
    /// The victims' exits the bare reader read.
    pub read: usize,
    /// Its thread's CPU over the loaded window, % of a core.
    pub reader_cpu_pct: f64,
    /// Times its thread was put on a CPU, per death.
    pub reader_runs_per_death: f64,
    /// The exits it handed on to a tokio task (results before the hand-off
    /// existed: 0).
    #[serde(default)]
    pub handed: usize,
    /// Its hand-off's mean time a death, us: from the read to the channel
    /// taking the pid (`try_send`, the wake-up of the parked task included),
    /// part of its CPU.
    #[serde(default)]
    pub handoff_us: Option<f64>,
}

/// The rate at which the bare reader runs beside the kernel PLEG (the
/// target's rate, issue #29).
pub const FLOOR_RATE: f64 = 1000.0;

/// The relist's cost at a count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RelistCost {
    pub cgroups: usize,
    /// The first relist (every pod inspected), ms (`None`: not run at this
    /// count).
    pub first_ms: Option<f64>,
    /// A steady relist (lists only), median ms.
    pub steady_ms: Option<f64>,
    /// Generic mode's process CPU at 1 relist/s, % of a core (the fake's
    /// thread excluded).
    pub generic_cpu_pct: Option<f64>,
    /// The ebpf reader thread's CPU with the same count idle, % of a core
    /// (`None` in a quick run).
    pub ebpf_idle_reader_cpu_pct: Option<f64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScaleResults {
    pub rates: Vec<ScaleRate>,
    pub overflow: Option<Overflow>,
    pub relist: Vec<RelistCost>,
    /// The bare reader at [`FLOOR_RATE`] for each count (empty in results
    /// written before it was measured).
    #[serde(default)]
    pub floor: Vec<FloorRate>,
}

/// Container-like cgroups with one process each.
#[derive(Debug)]
pub struct Cgroups {
    /// Parents this run created (removed last, when empty).
    parents: Vec<PathBuf>,
    pub pods: Vec<ScalePod>,
}

#[derive(Debug)]
pub struct ScalePod {
    pub uid: String,
    pub id: String,
    /// The fake runtime's sandbox of the pod: one id for the pod's whole
    /// life, so that listing the pods again changes none of them.
    sandbox_id: String,
    pod_dir: PathBuf,
    /// The sandbox's cgroup, empty (on a node the pause container runs
    /// there; a ready sandbox without a cgroup would be a container the
    /// kernel path looks for in the tree).
    sandbox_dir: PathBuf,
    dir: PathBuf,
    pub pid: i32,
    pub alive: bool,
}

/// Victims made (and listed by the fake) at a time.
const VICTIM_CHUNK: usize = 1000;

impl Cgroups {
    /// None yet ([`Cgroups::absorb`] adds).
    fn empty() -> Self {
        Self {
            parents: Vec::new(),
            pods: Vec::new(),
        }
    }

    /// Takes over `other`'s cgroups (removed with these).
    fn absorb(&mut self, mut other: Cgroups) {
        self.pods.append(&mut other.pods);
        self.parents.append(&mut other.parents);
    }

    /// Makes `n` pod, sandbox and container cgroups and starts a process in
    /// each container cgroup.
    pub fn create(n: usize) -> Result<Self> {
        let root = evpleg_tests::cgroups::cgroup2();
        let mut this = Self {
            parents: Vec::new(),
            pods: Vec::new(),
        };
        let mut dir = root.clone();
        for part in ["kubepods", "besteffort"] {
            dir.push(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
                this.parents.push(dir.clone());
            }
        }
        for _ in 0..n {
            let uid = evpleg_tests::pod_uid();
            let id = evpleg_tests::container_id();
            let sandbox_id = evpleg_tests::container_id();
            let pod_dir = dir.join(format!("pod{uid}"));
            let cdir = pod_dir.join(&id);
            let sandbox_dir = pod_dir.join(&sandbox_id);
            std::fs::create_dir(&pod_dir)
                .with_context(|| format!("mkdir {}", pod_dir.display()))?;
            this.pods.push(ScalePod {
                uid,
                id,
                sandbox_id,
                pod_dir,
                sandbox_dir: sandbox_dir.clone(),
                dir: cdir.clone(),
                pid: 0,
                alive: false,
            });
            for d in [&sandbox_dir, &cdir] {
                std::fs::create_dir(d).with_context(|| format!("mkdir {}", d.display()))?;
            }
        }
        this.spawn()?;
        Ok(this)
    }

    /// One `sleep` per cgroup, forked by one shell: each subshell joins its
    /// cgroup and execs `sleep` there (the first exec in the cgroup: its main
    /// process, as a runtime's init does). Forking from a small shell is much
    /// faster than from this process. The shell exits at once; its children
    /// are reparented to this process (a subreaper) and reaped on drop.
    fn spawn(&mut self) -> Result<()> {
        // SAFETY: prctl with an integer argument.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let list: String = self
            .pods
            .iter()
            .map(|p| format!("{}\n", p.dir.display()))
            .collect();
        let mut sh = Command::new("sh")
            .args([
                "-c",
                "while read -r d; do (echo 0 > \"$d/cgroup.procs\" && exec sleep 1000000) & done",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("spawning the process shell")?;
        {
            use std::io::Write;
            let mut stdin = sh.stdin.take().context("the shell's stdin")?;
            stdin.write_all(list.as_bytes())?;
        }
        sh.wait()?;
        // Each cgroup holds its sleep once the subshell has exec'd.
        let deadline = Instant::now() + Duration::from_secs(120);
        for p in &mut self.pods {
            loop {
                let procs = std::fs::read_to_string(p.dir.join("cgroup.procs")).unwrap_or_default();
                let pid = procs
                    .lines()
                    .next()
                    .and_then(|l| l.trim().parse::<i32>().ok());
                let comm = pid
                    .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).ok())
                    .unwrap_or_default();
                if let Some(pid) = pid
                    && comm.trim() == "sleep"
                {
                    p.pid = pid;
                    p.alive = true;
                    break;
                }
                anyhow::ensure!(Instant::now() < deadline, "no sleep in {}", p.dir.display());
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        Ok(())
    }

    pub fn fake_pods(&self) -> Vec<FakePod> {
        self.pods
            .iter()
            .map(|p| FakePod {
                uid: p.uid.clone(),
                sandbox_id: p.sandbox_id.clone(),
                container_id: p.id.clone(),
                running: p.alive,
                exit_code: 0,
                finished_at: 0,
                pid: p.pid,
            })
            .collect()
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for p in &self.pods {
            if p.pid > 0 {
                // SAFETY: kill and waitpid on a pid that is our child (this
                // process is their subreaper); no memory is shared.
                unsafe {
                    libc::kill(p.pid, libc::SIGKILL);
                    libc::waitpid(p.pid, std::ptr::null_mut(), 0);
                }
            }
        }
        for p in &self.pods {
            for d in [&p.dir, &p.sandbox_dir, &p.pod_dir] {
                let deadline = Instant::now() + Duration::from_secs(2);
                while std::fs::remove_dir(d).is_err() && d.exists() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        for d in self.parents.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// CPU seconds of this process's threads, split: (named `name`, all others
/// except `fake-cri`).
fn thread_cpu(name: &str) -> (f64, f64) {
    let s = thread_sched(name);
    (s.named_s, s.rest_s)
}

/// A reading of this process's threads' schedstat.
#[derive(Clone, Copy, Debug, Default)]
struct Sched {
    /// CPU seconds of the thread named `name`, and of all others except
    /// `fake-cri`.
    named_s: f64,
    rest_s: f64,
    /// The named thread's seconds runnable but not running, and the times it
    /// was put on a CPU.
    named_waited_s: f64,
    named_runs: u64,
}

/// [`thread_cpu`], and how the thread named `name` was scheduled.
fn thread_sched(name: &str) -> Sched {
    let (mut named, mut rest, mut waited, mut runs) = (0u64, 0u64, 0u64, 0u64);
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let sched = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        let mut fields = sched
            .split_whitespace()
            .map(|f| f.parse::<u64>().unwrap_or(0));
        let run = fields.next().unwrap_or(0);
        let delay = fields.next().unwrap_or(0);
        let timeslices = fields.next().unwrap_or(0);
        let comm = comm.trim();
        if comm == name {
            named += run;
            waited += delay;
            runs += timeslices;
        } else if !comm.starts_with("fake-cri") {
            rest += run;
        }
    }
    Sched {
        named_s: named as f64 / 1e9,
        rest_s: rest as f64 / 1e9,
        named_waited_s: waited as f64 / 1e9,
        named_runs: runs,
    }
}

/// The steal time of all CPUs so far, ms (`/proc/stat`'s first line, its
/// eighth field, in clock ticks); 0 when it cannot be read.
fn steal_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    // SAFETY: sysconf has no memory preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    stat.lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(8))
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0.0, |ticks| ticks * 1000.0 / hz)
}

const READER: &str = "evpleg-ringbuf";

/// The largest count run through the whole PLEG over the fake runtime: the
/// first relist of 10 000 pods takes minutes in the dev build (the tests'
/// profile), seconds in the release build.
pub const FULL_PIPELINE_MAX: usize = if cfg!(debug_assertions) { 2000 } else { 10_000 };

/// The most victims a phase makes: each is a live process until killed
/// (about 280 KiB each here), so 5 000 exits/s held 10 s (50 000 processes,
/// some 14 GiB) is bounded by memory, and the phase holds its rate for
/// `VICTIMS_MAX / rate` s; the report gives the time held.
pub const VICTIMS_MAX: usize = 20_000;

/// A phase's victims: the rate held for `secs`, at most [`VICTIMS_MAX`], at
/// least one.
pub fn victims_for(rate: f64, secs: f64) -> usize {
    ((rate * secs).round() as usize).clamp(1, VICTIMS_MAX)
}

/// CPU over a window as % of a core (`NaN` for an empty window).
pub fn cpu_pct(cpu_s: f64, window_s: f64) -> f64 {
    if window_s > 0.0 {
        100.0 * cpu_s / window_s
    } else {
        f64::NAN
    }
}

/// Counters of the PLEG (see [`Under::counters`]), for the progress line
/// of a phase whose deaths were not all delivered in time.
#[derive(Clone, Debug, Default)]
struct Counters {
    deferred: u64,
    hints: u64,
    merge_discarded: u64,
    unattributed: u64,
    rescans: u64,
    discarded: u64,
    relists: u64,
    /// Full relists by cause (`FullRelistCause`).
    relist_causes: [u64; FullRelistCause::ALL.len()],
    pod_relists: u64,
    /// The kernel path's: events sent, the tracker's hints (uncertain deaths,
    /// cgroups gone first), mains corrected, deaths contradicted, containers
    /// demoted, merges handed to the helper thread.
    kernel_events: u64,
    kernel_hints: u64,
    corrected: u64,
    contradicted: u64,
    demoted: u64,
    /// By cause (`HandoffCause::ALL`).
    handoffs: [u64; HandoffCause::ALL.len()],
    /// Times the reader spent its real-time budget.
    throttled: u64,
    /// Views the reader applied, by duration (the histogram's buckets).
    reconciles: Vec<(f64, u64)>,
    /// Relists the kernel path asked for, by reason (each is a full relist,
    /// whose view of every pod the reader applies).
    relist_asks: [u64; RelistReason::ALL.len()],
}

impl Counters {
    fn since(&self, before: &Counters) -> String {
        format!(
            "meanwhile: merge deferred {}, hints {}, discarded {}; kernel unattributed {}, \
             rescans {}, discarded {}, events {}, hints {}, corrected {}, contradicted {}, \
             demoted {}, handed off {}{}, reader throttled {}, views applied {}; full relists {}{}{}, pod relists {}",
            self.deferred - before.deferred,
            self.hints - before.hints,
            self.merge_discarded - before.merge_discarded,
            self.unattributed - before.unattributed,
            self.rescans - before.rescans,
            self.discarded - before.discarded,
            self.kernel_events - before.kernel_events,
            self.kernel_hints - before.kernel_hints,
            self.corrected - before.corrected,
            self.contradicted - before.contradicted,
            self.demoted - before.demoted,
            self.handoffs.iter().sum::<u64>() - before.handoffs.iter().sum::<u64>(),
            grown(
                &HandoffCause::ALL.map(HandoffCause::label),
                &self.handoffs,
                &before.handoffs,
                ""
            ),
            self.throttled - before.throttled,
            views_since(&self.reconciles, &before.reconciles),
            self.relists - before.relists,
            by_cause(&self.relist_causes, &before.relist_causes),
            asked(&self.relist_asks, &before.relist_asks),
            self.pod_relists - before.pod_relists
        )
    }
}

/// Counts that grew between two readings, by name (` (<prefix><name> n,
/// ...)`; empty for none).
fn grown(names: &[&str], now: &[u64], before: &[u64], prefix: &str) -> String {
    let grown: Vec<String> = names
        .iter()
        .zip(now.iter().zip(before))
        .filter(|(_, (n, b))| n > b)
        .map(|(name, (n, b))| format!("{name} {}", n - b))
        .collect();
    if grown.is_empty() {
        String::new()
    } else {
        format!(" ({prefix}{})", grown.join(", "))
    }
}

/// Views applied between two readings of the reconcile histogram: how many,
/// and the bound of the slowest one's bucket (`n (longest <= x ms)`).
fn views_since(now: &[(f64, u64)], before: &[(f64, u64)]) -> String {
    let grown: Vec<(f64, u64)> = now
        .iter()
        .enumerate()
        .map(|(i, (bound, n))| (*bound, n - before.get(i).map_or(0, |b| b.1)))
        .collect();
    let n: u64 = grown.iter().map(|(_, n)| n).sum();
    match grown.iter().rev().find(|(_, n)| *n > 0) {
        Some((bound, _)) if *bound < f64::MAX => {
            format!("{n} (longest <= {:.3} ms)", bound * 1e3)
        }
        Some(_) => format!("{n} (longest above the last bound)"),
        None => "0".into(),
    }
}

/// Full relists started between two readings, by cause.
fn by_cause(now: &[u64], before: &[u64]) -> String {
    grown(
        &FullRelistCause::ALL.map(FullRelistCause::as_str),
        now,
        before,
        "",
    )
}

/// The kernel path's relist requests between two readings, by reason.
fn asked(now: &[u64], before: &[u64]) -> String {
    grown(
        &RelistReason::ALL.map(RelistReason::as_str),
        now,
        before,
        "asked: ",
    )
}

/// What runs the deaths: the whole PLEG, or the kernel path alone.
enum Under {
    Pleg(Pleg),
    Kernel(evpleg_pleg::kernel::KernelPleg),
}

impl Under {
    fn dropped(&self) -> u64 {
        let stats = match self {
            Under::Pleg(p) => p.kernel.as_ref().map(|k| k.stats().clone()),
            Under::Kernel(k) => Some(k.stats().clone()),
        };
        stats.map_or(0, |s| s.kernel_dropped.load(Ordering::Relaxed))
    }

    /// The PLEG's counters that tell where a death went.
    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        let kernel = match self {
            Under::Pleg(p) => {
                if let Some(m) = &p.merge_stats {
                    c.deferred = m.deferred.load(Ordering::Relaxed);
                    c.hints = m.hints.load(Ordering::Relaxed);
                    c.merge_discarded = m.discarded.load(Ordering::Relaxed);
                }
                c.relists = p.relist_stats.relists.load(Ordering::Relaxed);
                for (n, a) in c.relist_causes.iter_mut().zip(&p.relist_stats.by_cause) {
                    *n = a.load(Ordering::Relaxed);
                }
                c.pod_relists = p.relist_stats.pod_relists.load(Ordering::Relaxed);
                p.kernel.as_ref().map(|k| k.stats().clone())
            }
            Under::Kernel(k) => Some(k.stats().clone()),
        };
        if let Some(k) = kernel {
            c.unattributed = k.unattributed.load(Ordering::Relaxed);
            c.rescans = k.rescans.load(Ordering::Relaxed);
            c.discarded = k.discarded.load(Ordering::Relaxed);
            c.kernel_events = k.events.load(Ordering::Relaxed);
            c.kernel_hints = k.hints.load(Ordering::Relaxed);
            c.corrected = k.corrected.load(Ordering::Relaxed);
            c.contradicted = k.contradicted.load(Ordering::Relaxed);
            c.demoted = k.demoted.load(Ordering::Relaxed);
            c.handoffs = HandoffCause::ALL.map(|cause| k.handoffs.get(cause));
            c.throttled = k.rt_throttled.load(Ordering::Relaxed);
            c.reconciles = k.reconcile_seconds.snapshot();
            for r in RelistReason::ALL {
                c.relist_asks[r as usize] = k.relist_requests.get(r);
            }
        }
        c
    }

    async fn stop(self) {
        match self {
            Under::Pleg(p) => p.stop().await,
            Under::Kernel(k) => k.stop(),
        }
    }
}

async fn start_pleg(
    mode: PlegMode,
    client: &CriClient,
    kernel: KernelPlegConfig,
) -> Result<(Pleg, mpsc::Receiver<PodLifecycleEvent>)> {
    let (tx, rx) = mpsc::channel(100_000);
    let pleg = crate::death::start_pleg(mode, client, kernel, tx)?;
    Ok((pleg, rx))
}

/// Asks for a relist and waits until it has listed every pod of `cg` (how
/// long that took is returned), then until the relist task is idle.
async fn wait_listed(pleg: &Pleg, cg: &Cgroups, bound: Duration) -> Result<Duration> {
    let full_relists = || pleg.relist_stats.relists.load(Ordering::Relaxed);
    let full_before = full_relists();
    pleg.relist_signal.request("scale: pods listed");
    let started = Instant::now();
    let deadline = started + bound;
    // Listed: a snapshot without an error that holds the container running
    // (an entry alone may be the empty status of a pod relisted before the
    // fake listed it, on which no death can be laid).
    for p in &cg.pods {
        let uid = evpleg_core::ids::PodUid::parse(&p.uid).context("uid")?;
        let id = evpleg_core::ids::ContainerId::parse(&p.id).context("id")?;
        let listed = || {
            pleg.cache.get(&uid).is_some_and(|e| {
                e.error.is_none()
                    && e.status
                        .container(&id)
                        .is_some_and(|c| c.state == evpleg_core::container::ContainerState::Running)
            })
        };
        while !listed() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the relist did not list every pod"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let listing = started.elapsed();
    // Then past the requested full relist and its loss follow-ups (the last
    // 5.5 s after the latest request: another request meanwhile, from the
    // kernel path or the merge, starts them again; a count of them let the
    // last ones into the kill window), and until no relist has run for a
    // second, so that the kill window starts on an idle relist task.
    let stats = &pleg.relist_stats;
    while full_relists() == full_before || stats.follow_ups_due.load(Ordering::Relaxed) > 0 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the relist's loss follow-ups did not all run"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let relists = || {
        pleg.relist_stats.relists.load(Ordering::Relaxed)
            + pleg.relist_stats.pod_relists.load(Ordering::Relaxed)
    };
    loop {
        let before = relists();
        tokio::time::sleep(Duration::from_secs(1)).await;
        if relists() == before {
            return Ok(listing);
        }
        anyhow::ensure!(Instant::now() < deadline, "the relist task never went idle");
    }
}

/// The bare reader alone (the PLEG stopped) over the same count, its victims
/// killed at [`FLOOR_RATE`] for `secs`: its thread's CPU over the loaded
/// window.
fn floor(fake: &FakeCri, n: usize, secs: f64) -> Result<FloorRate> {
    crate::interrupt::check()?;
    let count = victims_for(FLOOR_RATE, secs);
    let mut victims = Cgroups::empty();
    while victims.pods.len() < count {
        victims.absorb(Cgroups::create(
            VICTIM_CHUNK.min(count - victims.pods.len()),
        )?);
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel(1000);
    let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
    let reader = crate::floor::BareReader::start(tx)?;
    let which: Vec<usize> = (0..count).collect();
    let pids: HashSet<u32> = victims.pods.iter().map(|p| p.pid as u32).collect();
    crate::progress(&format!(
        "  the bare reader: killing {count} at {FLOOR_RATE:.0}/s"
    ));
    let s0 = thread_sched(crate::floor::THREAD);
    let t0 = Instant::now();
    // Past the fake's pods: it lists none of them (no PLEG runs).
    let (achieved, _) = kill_window(&mut victims, fake, &which, FLOOR_RATE, usize::MAX / 2);
    let elapsed = t0.elapsed().as_secs_f64();
    let s1 = thread_sched(crate::floor::THREAD);
    let reads: Vec<_> = (reader.stop().into_iter())
        .filter(|r| pids.contains(&r.pid))
        .collect();
    drain.abort();
    let read = reads.len();
    let handed: Vec<f64> = (reads.iter())
        .filter_map(|r| Some(r.handed_ns?.saturating_sub(r.read_ns) as f64 / 1000.0))
        .collect();
    let r = FloorRate {
        cgroups: n,
        target_per_s: FLOOR_RATE,
        achieved_per_s: achieved,
        deaths: count,
        read,
        reader_cpu_pct: cpu_pct(s1.named_s - s0.named_s, elapsed),
        reader_runs_per_death: (s1.named_runs - s0.named_runs) as f64 / count as f64,
        handed: handed.len(),
        handoff_us: (!handed.is_empty()).then(|| handed.iter().sum::<f64>() / handed.len() as f64),
    };
    crate::progress(&format!(
        "  the bare reader: {count} deaths at {FLOOR_RATE:.0}/s (achieved {achieved:.0}/s), {read} read, {} handed on ({:.1} us each), {:.2} % of a core, {:.2} wake-ups a death",
        r.handed,
        r.handoff_us.unwrap_or(f64::NAN),
        r.reader_cpu_pct,
        r.reader_runs_per_death
    ));
    Ok(r)
}

/// Kills `which` pods at `rate`/s from a thread of its own (pod `i` is the
/// fake's `offset + i`); returns the achieved rate.
fn kill_paced(cg: &mut Cgroups, fake: &FakeCri, which: &[usize], rate: f64, offset: usize) -> f64 {
    kill_window(cg, fake, which, rate, offset).0
}

/// [`kill_paced`], and the loaded window: from the first kill to the last.
fn kill_window(
    cg: &mut Cgroups,
    fake: &FakeCri,
    which: &[usize],
    rate: f64,
    offset: usize,
) -> (f64, Duration) {
    let pids: Vec<(usize, i32)> = which
        .iter()
        .map(|i| (offset + *i, cg.pods[*i].pid))
        .collect();
    let pods = fake.pods.clone();
    let started = Instant::now();
    let t = std::thread::spawn(move || {
        for (k, (i, pid)) in pids.iter().enumerate() {
            let at = started + Duration::from_secs_f64(k as f64 / rate);
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            // SAFETY: kill has no memory preconditions; the pid is our child.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
            pods.killed(*i);
        }
        started.elapsed()
    });
    let took = t.join().unwrap_or_default();
    for i in which {
        cg.pods[*i].alive = false;
    }
    (achieved_rate(which.len(), took), took)
}

/// Deaths per second over the window from the first kill to the last (`n`
/// kills span `n - 1` intervals).
pub fn achieved_rate(kills: usize, window: Duration) -> f64 {
    if kills < 2 || window.is_zero() {
        return f64::NAN;
    }
    (kills - 1) as f64 / window.as_secs_f64()
}

/// Receives events until every id in `ids` has a ContainerDied or `bound`
/// passes; returns each id's source.
async fn deaths(
    rx: &mut mpsc::Receiver<PodLifecycleEvent>,
    ids: &[&str],
    bound: Duration,
) -> HashMap<String, (EventSource, Instant)> {
    let mut seen = HashMap::new();
    // Hashed: a search of every id for each death is quadratic in them.
    let ids: HashSet<&str> = ids.iter().copied().collect();
    let deadline = tokio::time::Instant::now() + bound;
    while seen.len() < ids.len() {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(e)) if e.kind == EventKind::ContainerDied => {
                if let Some(c) = &e.container_id
                    && ids.contains(c.as_str())
                {
                    seen.entry(c.as_str().to_owned())
                        .or_insert((e.source, Instant::now()));
                }
            }
            Ok(Some(_)) => {}
            _ => break,
        }
    }
    seen
}

/// The whole scale workload.
pub async fn run(
    dir: &std::path::Path,
    counts: &[usize],
    rates: &[f64],
    secs: f64,
    idle: Option<Duration>,
) -> Result<ScaleResults> {
    // A quick run (no idle window) looks at fewer relists and deaths.
    let quick = idle.is_none();
    let relist_window = Duration::from_millis(if quick { 2500 } else { 4000 });
    let fake = FakeCri::start(dir)?;
    let client = CriClient::connect(&fake.endpoint(), CriClientConfig::default()).await?;
    let mut out = ScaleResults::default();
    for &n in counts {
        crate::interrupt::check()?;
        // Up to FULL_PIPELINE_MAX the whole PLEG over the fake runtime (its first
        // relist inspects every pod: minutes at 10 000 in the dev build); above,
        // the kernel path alone (reader, decoder, tracker).
        let full = n <= FULL_PIPELINE_MAX;
        crate::progress(&format!(
            "scale: {n} cgroups, {}",
            if full {
                "ebpf mode over the fake runtime"
            } else {
                "the kernel path alone (no runtime)"
            }
        ));
        let (under, mut rx) = if full {
            let (pleg, rx) =
                start_pleg(PlegMode::Ebpf, &client, KernelPlegConfig::default()).await?;
            (Under::Pleg(pleg), rx)
        } else {
            let (tx, rx) = mpsc::channel(100_000);
            let relist = Arc::new(evpleg_core::lifecycle::RelistSignal::new());
            let k =
                evpleg_pleg::kernel::KernelPleg::start(KernelPlegConfig::default(), tx, relist)?;
            (Under::Kernel(k), rx)
        };
        let made = Instant::now();
        let cg = Cgroups::create(n)?;
        crate::progress(&format!(
            "  {n} cgroups and processes made in {:.1} s",
            made.elapsed().as_secs_f64()
        ));
        if let Under::Pleg(pleg) = &under {
            fake.pods.set(cg.fake_pods());
            let listing = wait_listed(pleg, &cg, Duration::from_secs(300)).await?;
            crate::progress(&format!(
                "  the relist listed them in {:.1} s",
                listing.as_secs_f64()
            ));
        }
        // Idle reader cost at this count (not in a quick run): with the whole
        // PLEG, once its relist task is idle (`wait_listed`); the kernel path
        // alone, 3 s after the cgroups were made.
        let idle_reader = match idle {
            None => None,
            Some(window) => {
                if let Under::Kernel(_) = &under {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                }
                let (r0, _) = thread_cpu(READER);
                let idle_start = Instant::now();
                tokio::time::sleep(window).await;
                let (r1, _) = thread_cpu(READER);
                let pct = 100.0 * (r1 - r0) / idle_start.elapsed().as_secs_f64();
                crate::progress(&format!(
                    "  reader idle with {n} cgroups: {pct:.3} % of a core"
                ));
                Some(pct)
            }
        };
        for &rate in rates {
            crate::interrupt::check()?;
            // The phase's victims, beside the idle cgroups (which stay alive:
            // the kernel path keeps knowing all of them).
            let count = victims_for(rate, secs);
            let setup0 = under.counters();
            let made = Instant::now();
            // Made a chunk at a time, each listed by the fake as soon as it
            // exists, as a runtime lists a container from before its cgroup
            // is made: made all at once (20 000 took 20 s), the first were
            // more than the kernel path's prune grace (10 s) old when the
            // fake first listed them, and a full view listed meanwhile
            // forgot them.
            let mut victims = Cgroups::empty();
            while victims.pods.len() < count {
                let k = VICTIM_CHUNK.min(count - victims.pods.len());
                victims.absorb(Cgroups::create(k)?);
                if full {
                    let mut pods = cg.fake_pods();
                    pods.extend(victims.fake_pods());
                    fake.pods.set(pods);
                }
            }
            crate::progress(&format!(
                "  {count} victims for {rate:.0}/s made in {:.1} s",
                made.elapsed().as_secs_f64()
            ));
            let offset = cg.pods.len();
            if let Under::Pleg(pleg) = &under {
                wait_listed(pleg, &victims, Duration::from_secs(300)).await?;
            }
            crate::progress(&format!("    set-up {}", under.counters().since(&setup0)));
            let which: Vec<usize> = (0..count).collect();
            // Events of the set-up (the victims' starts) are not this
            // window's: a full channel would discard the window's deaths.
            while rx.try_recv().is_ok() {}
            crate::stages::start();
            let dropped0 = under.dropped();
            let ids: Vec<String> = victims.pods.iter().map(|p| p.id.clone()).collect();
            let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
            let counters0 = under.counters();
            // The CPU window is the loaded window: from just before the first
            // kill to just after the last.
            crate::progress(&format!("  killing {count} at {rate:.0}/s"));
            let s0 = thread_sched(READER);
            let steal0 = steal_ms();
            let t0 = Instant::now();
            let (achieved, held) = kill_window(&mut victims, &fake, &which, rate, offset);
            let elapsed = t0.elapsed().as_secs_f64();
            let s1 = thread_sched(READER);
            let steal = steal_ms() - steal0;
            let throttled = under.counters().throttled - counters0.throttled;
            let waited_ms = (s1.named_waited_s - s0.named_waited_s) * 1e3;
            let mut seen = deaths(&mut rx, &id_refs, Duration::from_secs(5)).await;
            // What is missing after 5 s: waited for 30 s more, to tell late
            // (delivered by a relist after the bound) from lost.
            let missing: Vec<&str> = id_refs
                .iter()
                .copied()
                .filter(|id| !seen.contains_key(*id))
                .collect();
            let late = if missing.is_empty() {
                0
            } else {
                let more = deaths(&mut rx, &missing, Duration::from_secs(30)).await;
                let late = more.len();
                seen.extend(more);
                crate::progress(&format!(
                    "  {} deaths not delivered within 5 s, {late} of them within 35 s; {}",
                    missing.len(),
                    under.counters().since(&counters0)
                ));
                late
            };
            let dropped = under.dropped() - dropped0;
            let log = crate::stages::snapshot();
            let by_cpu = crate::stages::cpu_pairs(&id_refs, &log, crate::report::STALL_US);
            let (stages, _) = crate::stages::samples(&id_refs, &log);
            let (stages, samples_us) = stage_figures(stages);
            let r = ScaleRate {
                cgroups: n,
                target_per_s: rate,
                achieved_per_s: achieved,
                deaths: count,
                held_s: Some(held.as_secs_f64()),
                lost: count - seen.len(),
                late,
                dropped,
                stages,
                samples_us,
                reader_cpu_pct: cpu_pct(s1.named_s - s0.named_s, elapsed),
                process_cpu_pct: cpu_pct(s1.rest_s - s0.rest_s + s1.named_s - s0.named_s, elapsed),
                reader_runs_per_death: Some((s1.named_runs - s0.named_runs) as f64 / count as f64),
                reader_sched: Some(ReaderSched {
                    throttled,
                    waited_ms,
                    steal_ms: steal,
                    by_cpu,
                }),
            };
            let last = r.stages.last();
            crate::progress(&format!(
                "  {count} deaths at {rate:.0}/s (achieved {achieved:.0}/s): lost {}, late {}, dropped {}, {} p50 {:.0} us p99 {:.0} us, reader {:.2} % of a core, {:.2} wake-ups a death, waited {waited_ms:.1} ms runnable, budget spent {throttled} times; host steal {steal:.0} ms",
                r.lost,
                r.late,
                r.dropped,
                last.map_or("-", |d| d.0.as_str()),
                last.map_or(f64::NAN, |d| d.1.p50),
                last.map_or(f64::NAN, |d| d.1.p99),
                r.reader_cpu_pct,
                r.reader_runs_per_death.unwrap_or(f64::NAN),
            ));
            crate::progress(&format!("    {}", under.counters().since(&counters0)));
            out.rates.push(r);
            if full {
                fake.pods.set(cg.fake_pods());
            }
            drop(victims);
        }
        under.stop().await;
        if rates.contains(&FLOOR_RATE) {
            out.floor.push(floor(&fake, n, secs)?);
        }
        if !full {
            out.relist.push(RelistCost {
                cgroups: n,
                first_ms: None,
                steady_ms: None,
                generic_cpu_pct: None,
                ebpf_idle_reader_cpu_pct: idle_reader,
            });
            drop(cg);
            continue;
        }
        // The generic relist at the same count.
        crate::progress(&format!(
            "scale: {n} pods, generic relist over the fake runtime"
        ));
        let (pleg, mut rx) =
            start_pleg(PlegMode::Generic, &client, KernelPlegConfig::default()).await?;
        let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let deadline = Instant::now() + Duration::from_secs(300);
        while pleg.relist_stats.relists.load(Ordering::Relaxed) < 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let first_ms = pleg.relist_stats.last_duration_ns.load(Ordering::Relaxed) as f64 / 1e6;
        let (_, p0) = thread_cpu(READER);
        let t0 = Instant::now();
        let mut steady = Vec::new();
        let mut last = pleg.relist_stats.relists.load(Ordering::Relaxed);
        while t0.elapsed() < relist_window {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = pleg.relist_stats.relists.load(Ordering::Relaxed);
            if now != last {
                last = now;
                steady
                    .push(pleg.relist_stats.last_duration_ns.load(Ordering::Relaxed) as f64 / 1e6);
            }
        }
        let (_, p1) = thread_cpu(READER);
        let cpu = 100.0 * (p1 - p0) / t0.elapsed().as_secs_f64();
        pleg.stop().await;
        drain.abort();
        let steady_ms = crate::stats::Spread::of(&steady).map(|s| s.median);
        crate::progress(&format!(
            "  first relist {first_ms:.0} ms, steady {:.1} ms, {cpu:.2} % of a core",
            steady_ms.unwrap_or(f64::NAN)
        ));
        out.relist.push(RelistCost {
            cgroups: n,
            first_ms: Some(first_ms),
            steady_ms,
            generic_cpu_pct: Some(cpu),
            ebpf_idle_reader_cpu_pct: idle_reader,
        });
        drop(cg);
    }
    out.overflow = Some(overflow(&fake, &client, if quick { 100 } else { 200 }).await?);
    Ok(out)
}

/// A reader held at a gate (the record tap) while a burst fills a one-page
/// ring buffer: drops are counted and the relist delivers every death.
async fn overflow(fake: &FakeCri, client: &CriClient, n: usize) -> Result<Overflow> {
    let ring_bytes = 4096;
    crate::progress(&format!(
        "scale: overflow, {n} deaths into a {ring_bytes}-byte ring buffer with its reader held"
    ));
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    let mut kernel = KernelPlegConfig {
        ring_buffer_bytes: ring_bytes,
        ..KernelPlegConfig::default()
    };
    let g = gate.clone();
    kernel.tap = Some(Arc::new(move |_: &KernelEvent, _| {
        let (held, cv) = &*g;
        let mut h = held.lock().unwrap_or_else(|e| e.into_inner());
        while *h {
            h = cv.wait(h).unwrap_or_else(|e| e.into_inner());
        }
    }));
    let (pleg, mut rx) = start_pleg(PlegMode::Ebpf, client, kernel).await?;
    let release = |held: bool| {
        let (h, cv) = &*gate;
        *h.lock().unwrap_or_else(|e| e.into_inner()) = held;
        cv.notify_all();
    };
    let result = async {
        let mut cg = Cgroups::create(n)?;
        fake.pods.set(cg.fake_pods());
        wait_listed(&pleg, &cg, Duration::from_secs(60)).await?;
        let ids: Vec<String> = cg.pods.iter().map(|p| p.id.clone()).collect();
        let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        release(true);
        let all: Vec<usize> = (0..n).collect();
        kill_paced(&mut cg, fake, &all, 1e9, 0);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = Instant::now();
        release(false);
        let seen = deaths(&mut rx, &id_refs, Duration::from_secs(10)).await;
        let dropped = pleg
            .kernel
            .as_ref()
            .map_or(0, |k| k.stats().kernel_dropped.load(Ordering::Relaxed));
        let last = seen.values().map(|(_, at)| *at).max().unwrap_or(released);
        let by_kernel = seen
            .values()
            .filter(|(s, _)| *s == EventSource::Kernel)
            .count();
        let o = Overflow {
            ring_bytes,
            deaths: n,
            dropped,
            by_kernel,
            by_relist: seen.len() - by_kernel,
            lost: n - seen.len(),
            repaired_ms: last.saturating_duration_since(released).as_secs_f64() * 1000.0,
        };
        crate::progress(&format!(
            "  dropped {}, delivered by the kernel {}, by the relist {}, lost {}, last {:.0} ms after the reader went on",
            o.dropped, o.by_kernel, o.by_relist, o.lost, o.repaired_ms
        ));
        anyhow::Ok(o)
    }
    .await;
    release(false);
    pleg.stop().await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_holds_its_rate_for_its_seconds_up_to_the_cap() {
        // (rate, secs, victims)
        let table = [
            (1000.0, 10.0, 10_000),
            (2000.0, 10.0, VICTIMS_MAX),
            (5000.0, 10.0, VICTIMS_MAX),
            (1000.0, 0.2, 200),
            (5000.0, 0.0001, 1),
        ];
        for (rate, secs, want) in table {
            assert_eq!(victims_for(rate, secs), want, "{rate}/s for {secs} s");
        }
    }

    /// The progress line's counts that grew, and the slowest view's bucket.
    #[test]
    fn progress_counts_name_what_grew() {
        let names = ["a", "b", "c"];
        assert_eq!(
            grown(&names, &[1, 5, 2], &[1, 3, 0], "asked: "),
            " (asked: b 2, c 2)"
        );
        assert_eq!(grown(&names, &[1, 5, 2], &[1, 5, 2], ""), "");
        let before = [(0.001, 4), (0.002, 1), (f64::MAX, 0)];
        let rows: [([(f64, u64); 3], &str); 3] = [
            (before, "0"),
            (
                [(0.001, 9), (0.002, 2), (f64::MAX, 0)],
                "6 (longest <= 2.000 ms)",
            ),
            (
                [(0.001, 4), (0.002, 1), (f64::MAX, 1)],
                "1 (longest above the last bound)",
            ),
        ];
        for (now, want) in rows {
            assert_eq!(views_since(&now, &before), want);
        }
    }

    #[test]
    fn stage_figures_keep_rounded_samples_and_the_report_recomputes_from_them() {
        let reader: Vec<f64> = (1..=200).map(|i| f64::from(i) + 0.04).collect();
        let (figures, samples) = stage_figures(vec![
            (Stage::Read, reader),
            (Stage::Delivered, vec![12.345, 99.96]),
            (Stage::WorkerSync, vec![1.0]),
            (Stage::Cached, Vec::new()),
        ]);
        let names: Vec<&str> = samples.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(names, ["reader", "delivered"]);
        assert_eq!(samples[1].1, [12.3, 100.0]);
        assert_eq!(samples[0].1[199], 200.0);
        let reader = &figures[0].1;
        assert_eq!(
            (reader.n, reader.p50, reader.p99, reader.max),
            (200, 100.0, 198.0, 200.0)
        );
        let mut rate = ScaleRate {
            cgroups: 1000,
            target_per_s: 1000.0,
            achieved_per_s: 1000.0,
            deaths: 200,
            held_s: Some(0.2),
            lost: 0,
            late: 0,
            dropped: 0,
            stages: figures.clone(),
            samples_us: samples,
            reader_cpu_pct: 1.0,
            process_cpu_pct: 2.0,
            reader_runs_per_death: None,
            reader_sched: None,
        };
        assert_eq!(rate.percentiles(), figures);
        // The samples win over stored figures that disagree with them...
        rate.stages[0].1.p99 = 1.0;
        assert_eq!(rate.percentiles(), figures);
        // ...and results without samples keep their stored figures.
        rate.samples_us.clear();
        assert_eq!(rate.percentiles()[0].1.p99, 1.0);
        let json = serde_json::to_string(&rate).unwrap();
        assert!(!json.contains("samples_us"), "{json}");
        // Kept samples read back as written, each stage's on one line.
        rate.samples_us = vec![("reader".into(), vec![1.5, 20.0])];
        let pretty = serde_json::to_string_pretty(&rate).unwrap();
        assert!(pretty.contains("[1.5,20.0]"), "{pretty}");
        let back: ScaleRate = serde_json::from_str(&pretty).unwrap();
        assert_eq!(back, rate);
    }

    #[test]
    fn the_achieved_rate_counts_intervals_between_kills() {
        // (kills, window ms, rate)
        let table = [
            (1001, 1000, Some(1000.0)),
            (11, 2, Some(5000.0)),
            (1, 0, None),
            (5, 0, None),
        ];
        for (kills, ms, want) in table {
            let got = achieved_rate(kills, Duration::from_millis(ms));
            match want {
                Some(w) => assert!((got - w).abs() < 1e-9, "{kills} kills in {ms} ms: {got}"),
                None => assert!(got.is_nan(), "{kills} kills in {ms} ms: {got}"),
            }
        }
    }

    #[test]
    fn cpu_is_a_share_of_the_window() {
        // (cpu s, window s, % of a core)
        let table = [
            (0.5, 10.0, Some(5.0)),
            (2.0, 1.0, Some(200.0)),
            (0.0, 3.0, Some(0.0)),
            (1.0, 0.0, None),
        ];
        for (cpu, window, want) in table {
            let got = cpu_pct(cpu, window);
            match want {
                Some(w) => assert!((got - w).abs() < 1e-9, "{cpu} s over {window} s: {got}"),
                None => assert!(got.is_nan(), "{cpu} s over {window} s"),
            }
        }
    }
}

//! evpleg's PLEG benchmark (issue #11), run by `cargo xtask bench`: each PLEG mode
//! in-process against the same private containerd and the same workloads, and a
//! bare ring-buffer reader as the floor. Writes raw results as JSON and
//! `docs/benchmarks.md`. A benchmark, not a test: it measures, it asserts nothing
//! about time.
//!
//! A crate of its own because it needs the agent's library, the test harness
//! (containerd, images, cgroups) and root, none of which `xtask` should carry.

mod agent;
mod api;
mod death;
mod fake_cri;
mod floor;
mod idle;
mod interrupt;
mod kubelet;
mod memory;
mod node_idle;
mod operator;
mod plots;
mod relist_cost;
mod report;
mod results;
mod runtime_load;
mod scale;
mod stages;
mod stats;
mod tax;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use evpleg_pleg::PlegMode;

use death::{Observer, Running, Workload};
use results::{Latency, Machine, Results};
use stats::{Percentiles, Summary};

#[derive(Parser, Debug)]
#[command(about = "evpleg's PLEG latency and cost benchmark")]
struct Cli {
    /// A short run: fewer repetitions and containers.
    #[arg(long)]
    quick: bool,
    /// Where `docs/benchmarks.md` and `bench/results/` are written.
    #[arg(long)]
    out: PathBuf,
    /// Render the report and plots from this results file instead of measuring.
    #[arg(long)]
    from_json: Option<PathBuf>,
    /// The command line to print in the report.
    #[arg(long, default_value = "cargo xtask bench")]
    command: String,
    /// Only these parts (death, agent, api, scale, churn, idle, node-idle,
    /// tax, runtime-load, relist-cost, memory); all by default. For checking a change quickly; the report then
    /// lacks the others.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Only these observers in the death workloads (floor, ebpf,
    /// evented-1.37, evented-1.26, generic) and modes of the full agent (ebpf,
    /// evented-1.37, evented-1.26, generic, cri-proxy-1.26 and cri-proxy-1.37:
    /// the agent in that Evented PLEG design behind `evpleg cri-proxy`; the
    /// stock kubelet's kubelet-1.37-generic, kubelet-1.37-evented and
    /// kubelet-1.37-cri-proxy); all by default.
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// The scale workload's cgroup counts (default 1000,10000; 300 with
    /// `--quick`). For checking a change quickly.
    #[arg(long, value_delimiter = ',')]
    scale_counts: Vec<usize>,
    /// The node-idle part's pod counts (default 10,50,100; 4 with `--quick`).
    #[arg(long, value_delimiter = ',')]
    node_idle_counts: Vec<usize>,
    /// The node-idle part's settling time in seconds once a count's pods run,
    /// before its windows (default 10; 2 with `--quick`).
    #[arg(long)]
    node_idle_settle: Option<u64>,
}

/// The PLEG modes compared in-process: evpleg's kernel PLEG, the kubelet's two
/// Evented PLEG designs (1.37, 1.26-1.36) and its generic PLEG.
const PLEG_MODES: [PlegMode; 4] = [
    PlegMode::Ebpf,
    PlegMode::EventedCri,
    PlegMode::EventedCriPayload,
    PlegMode::Generic,
];

/// Samples of one stage over repetitions.
#[derive(Debug, Default)]
struct Series {
    reps: Vec<Percentiles>,
    samples: Vec<f64>,
    lost: usize,
}

/// Series by stage, in the order first seen.
#[derive(Debug, Default)]
struct SeriesSet(Vec<(String, Series)>);

impl SeriesSet {
    fn add(&mut self, stage: &str, samples: Vec<f64>, lost: usize) {
        let i = match self.0.iter().position(|(s, _)| s == stage) {
            Some(i) => i,
            None => {
                self.0.push((stage.to_owned(), Series::default()));
                self.0.len() - 1
            }
        };
        let series = &mut self.0[i].1;
        series.reps.extend(Percentiles::of(&samples));
        series.samples.extend(samples);
        series.lost += lost;
    }

    fn into_latencies(self, mode: &str, workload: &str) -> Vec<Latency> {
        self.0
            .into_iter()
            .map(|(stage, s)| Latency {
                mode: mode.to_owned(),
                workload: workload.to_owned(),
                stage,
                summary: Summary::of(&s.reps),
                lost: s.lost,
                samples_us: s.samples,
            })
            .collect()
    }
}

/// `; stage p50 ...` for a progress line.
fn stage_line(stages: &[(evpleg_pleg::stages::Stage, Vec<f64>)]) -> String {
    let mut out = String::new();
    for (stage, samples) in stages {
        if let Some(p) = Percentiles::of(samples) {
            out.push_str(&format!("; {} p50 {:.0} us", stages::name(*stage), p.p50));
        }
    }
    out
}

fn progress(msg: &str) {
    eprintln!("[bench {}] {msg}", Machine::here().date);
}

fn main() -> Result<()> {
    if let Ok(spec) = std::env::var(memory::CHILD_ENV) {
        return Ok(memory::child(&spec)?);
    }
    let cli = Cli::parse();
    if let Some(json) = &cli.from_json {
        let mut results: Results = serde_json::from_str(&std::fs::read_to_string(json)?)?;
        results.migrate();
        return write(&cli.out, &results);
    }
    let started = Instant::now();
    // Counted repetitions (a warm-up one runs first): 10 of 20 deaths give
    // the 200 pooled samples a p99 needs (`stats::P99_MIN_SAMPLES`).
    let (reps, n, window) = if cli.quick {
        (2, 4, Duration::from_millis(500))
    } else {
        (10, 20, Duration::from_millis(1500))
    };
    let machine = Machine::here();
    progress(&format!(
        "machine: {} cores, {}, kernel {}",
        machine.cores, machine.cpu_model, machine.kernel
    ));
    // containerd 1.7 for every mode: the CRI event stream needs it, and every
    // mode must face the same runtime.
    let binary = evpleg_tests::containerd::fetch_containerd_17()
        .context("containerd 1.7 (for the CRI event stream)")?;
    let rt = evpleg_tests::cri_pod::tokio_runtime();
    interrupt::watch(&rt).context("watching SIGINT and SIGTERM")?;
    progress(&format!("starting containerd {}", binary.display()));
    let containerd = evpleg_tests::containerd::Containerd::start_with(&binary)?;
    let client = rt.block_on(containerd.client());
    let version = rt.block_on(client.version())?.runtime_version;
    let mut results = Results {
        machine,
        command: cli.command.clone(),
        quick: cli.quick,
        containerd: version,
        repetitions: reps,
        containers_per_repetition: n,
        warm_up: true,
        latency: Vec::new(),
        idle: Vec::new(),
        node_idle: Vec::new(),
        starts: Vec::new(),
        scale: None,
        operator: Default::default(),
        notes: Vec::new(),
    };
    let wanted = |part: &str| cli.only.is_empty() || cli.only.iter().any(|o| o == part);
    let mode_wanted = |name: &str| cli.modes.is_empty() || cli.modes.iter().any(|m| m == name);
    let observers: Vec<Observer> = [
        Observer::Floor,
        Observer::Pleg(PlegMode::Ebpf),
        Observer::Pleg(PlegMode::EventedCri),
        Observer::Pleg(PlegMode::EventedCriPayload),
        Observer::Pleg(PlegMode::Generic),
    ]
    .into_iter()
    .filter(|o| mode_wanted(o.name()))
    .collect();
    interrupt::check()?;
    if wanted("death") && !observers.is_empty() {
        death_latency(
            &rt,
            &containerd,
            &client,
            &observers,
            reps,
            n,
            window,
            &mut results,
        )?;
    }
    let mut agent_modes: Vec<agent::AgentMode> = agent::AgentMode::ALL
        .into_iter()
        .filter(|m| mode_wanted(m.name()))
        .collect();
    // The stock kubelet's rows need its binary (`cargo xtask setup` builds it).
    if agent_modes
        .iter()
        .any(|m| matches!(m, agent::AgentMode::Kubelet(_)))
        && let Err(e) = evpleg_tests::go_tools::binary("kubelet")
    {
        let note = format!("The stock kubelet's rows were left out: {e}.");
        progress(&note);
        results.notes.push(note);
        agent_modes.retain(|m| !matches!(m, agent::AgentMode::Kubelet(_)));
    }
    interrupt::check()?;
    if wanted("agent") && !agent_modes.is_empty() {
        full_agent(
            &rt,
            &containerd,
            &agent_modes,
            reps,
            n,
            window,
            &mut results,
        )?;
    }
    let api_modes: Vec<agent::AgentMode> = api::MODES
        .into_iter()
        .filter(|m| agent_modes.contains(m))
        .collect();
    interrupt::check()?;
    if wanted("api") && !api_modes.is_empty() {
        match evpleg_tests::control_plane::binary("kube-apiserver")
            .and(evpleg_tests::control_plane::binary("etcd"))
        {
            Ok(_) => {
                progress(&format!(
                    "api: {} modes, a warm-up and {reps} repetitions of {n} API pods, then \
                     killed; interleaved",
                    api_modes.len()
                ));
                let rows = rt.block_on(api::run(&containerd, &api_modes, reps, n, window))?;
                results.latency.extend(rows);
                results.notes.push(api::NOTE.to_owned());
            }
            Err(e) => {
                let note = format!("The API status rows were left out: {e}.");
                progress(&note);
                results.notes.push(note);
            }
        }
    }
    interrupt::check()?;
    if wanted("scale") {
        let (counts, secs): (&[usize], f64) = if cli.quick {
            (&[300], 0.2)
        } else {
            (&[1000, 10_000], 10.0)
        };
        let counts = if cli.scale_counts.is_empty() {
            counts
        } else {
            &cli.scale_counts[..]
        };
        let dir = containerd.base().join("bench-scale");
        let idle = (!cli.quick).then_some(Duration::from_secs(3));
        let s = rt.block_on(scale::run(
            &dir,
            counts,
            &[1000.0, 2000.0, 5000.0],
            secs,
            idle,
        ))?;
        results.scale = Some(s);
        results.notes.push(format!(
            "Scale: container-like cgroups (`/kubepods/besteffort/pod<uid>/<id>`) with one \
             `sleep` each (joined to its cgroup before its exec, as a runtime's init does), no \
             runtime: an in-process fake CRI server (its own thread, excluded from the CPU \
             figures) lists them as pods, so the relist figures measure evpleg's relist code, \
             not a runtime. The PLEG runs in `ebpf` mode over it (reader, merge on the reader \
             thread, relist); each rate is held for {secs} s (SIGKILL from a pacing thread) over \
             victims of its own beside the idle cgroups, at most {} a phase (each a live \
             process until killed: memory bounds the highest rate's time held, reported); \
             CPU over the loaded window only (first kill to last). After the PLEG's phases \
             at a count, the bare reader (`floor`) runs alone over the same cgroups, new \
             victims killed at 1 000/s: its CPU is the floor of the reader's. \
             The overflow run holds the reader at the record tap while 200 processes (100 in a \
             quick run) die into \
             a one-page ring buffer.",
            scale::VICTIMS_MAX
        ));
    }
    interrupt::check()?;
    if wanted("churn") {
        churn(&rt, &containerd, &client, cli.quick, &mut results)?;
    }
    interrupt::check()?;
    if wanted("idle") {
        idle_cost(&rt, &containerd, &client, cli.quick, &mut results)?;
    }
    let node_idle_modes: Vec<agent::AgentMode> = node_idle::MODES
        .into_iter()
        .filter(|m| agent_modes.contains(m))
        .collect();
    interrupt::check()?;
    if wanted("node-idle") && !node_idle_modes.is_empty() {
        let mut plan = if cli.quick {
            node_idle::Plan {
                counts: vec![4],
                settle: Duration::from_secs(2),
                windows: 2,
                each: Duration::from_secs(2),
            }
        } else {
            node_idle::Plan {
                counts: vec![10, 50, 100],
                settle: Duration::from_secs(10),
                // 30 s: each window holds one of the shims' memory rounds.
                windows: 2,
                each: Duration::from_secs(30),
            }
        };
        if !cli.node_idle_counts.is_empty() {
            plan.counts.clone_from(&cli.node_idle_counts);
            plan.counts.sort_unstable();
            plan.counts.dedup();
        }
        if let Some(secs) = cli.node_idle_settle {
            plan.settle = Duration::from_secs(secs);
        }
        let (rows, failures) = rt.block_on(node_idle::run(&containerd, &node_idle_modes, &plan));
        results.node_idle = rows;
        results.notes.push(format!(
            "{} Settling {:.0} s, then {} windows of {:.0} s at each count.",
            node_idle::NOTE,
            plan.settle.as_secs_f64(),
            plan.windows,
            plan.each.as_secs_f64()
        ));
        results.notes.extend(failures);
    }
    interrupt::check()?;
    operator_parts(&rt, &containerd, &client, cli.quick, &wanted, &mut results)?;
    drop(client);
    drop(rt);
    drop(containerd);
    let profile = if cfg!(debug_assertions) {
        "the workspace's dev profile (the agent crate at opt-level 1, dependencies \
         unoptimised), as the tests build it; `cargo xtask bench --release` measures the \
         release build a node runs"
    } else {
        "the release profile, as a node runs it"
    };
    results.notes.push(format!(
        "The run took {:.0} s. The PLEG code was built with {profile}.",
        started.elapsed().as_secs_f64()
    ));
    write(&cli.out, &results)?;
    progress(&format!("done in {:.0} s", started.elapsed().as_secs_f64()));
    Ok(())
}

/// The label of repetition `rep` in progress lines (0 is the warm-up).
fn rep_label(rep: usize) -> String {
    if rep == 0 {
        "warm-up (not counted)".to_owned()
    } else {
        format!("repetition {rep}")
    }
}

/// Death latency: a warm-up repetition, then `reps` counted ones; in each,
/// every observer and workload in turn (the observers' order rotated from one
/// repetition to the next), each observer started for its repetition and
/// stopped after it, so that no mode meets the machine in a state of its own.
#[allow(clippy::too_many_arguments)]
fn death_latency(
    rt: &tokio::runtime::Runtime,
    containerd: &evpleg_tests::containerd::Containerd,
    client: &evpleg_cri::CriClient,
    observers: &[Observer],
    reps: usize,
    n: usize,
    window: Duration,
    results: &mut Results,
) -> Result<()> {
    let workloads = [Workload::SelfExit, Workload::Killed];
    progress(&format!(
        "death latency: {} observers x {} workloads, a warm-up and {reps} repetitions of {n} \
         containers, interleaved",
        observers.len(),
        workloads.len()
    ));
    let mut sets: Vec<SeriesSet> = (0..observers.len() * workloads.len())
        .map(|_| SeriesSet::default())
        .collect();
    for rep in 0..=reps {
        for k in 0..observers.len() {
            interrupt::check()?;
            let o = (k + rep) % observers.len();
            let observer = observers[o];
            for (w, &workload) in workloads.iter().enumerate() {
                let s = rt.block_on(async {
                    let mut running = Running::start(observer, client)?;
                    let s = death::repetition(
                        containerd,
                        client,
                        &mut running,
                        workload,
                        n,
                        window,
                        rep,
                    )
                    .await;
                    running.stop().await;
                    anyhow::Ok(s)
                })?;
                progress(&format!(
                    "  {} / {}, {}: {} reader samples, {} event samples, lost {}/{}{}",
                    observer.name(),
                    workload.name(),
                    rep_label(rep),
                    s.reader_us.len(),
                    s.event_us.len(),
                    s.lost_reader,
                    s.lost_events,
                    stage_line(&s.stages)
                ));
                if rep == 0 {
                    continue;
                }
                let series = &mut sets[o * workloads.len() + w];
                if !s.reader_us.is_empty() || observer == Observer::Floor {
                    series.add("reader", s.reader_us, s.lost_reader);
                }
                for (stage, samples) in s.stages {
                    series.add(stages::name(stage), samples, 0);
                }
                series.add("event", s.event_us, s.lost_events);
                series.add(report::SHIM_REAPED, s.shim_reaped_us, 0);
            }
        }
    }
    for (i, set) in sets.into_iter().enumerate() {
        let (observer, workload) = (
            observers[i / workloads.len()],
            workloads[i % workloads.len()],
        );
        results
            .latency
            .extend(set.into_latencies(observer.name(), workload.name()));
    }
    Ok(())
}

/// The full agent in each mode: a warm-up repetition, then `reps` counted
/// ones, the modes in turn within each (rotated from one repetition to the
/// next), a fresh agent for each mode's repetition.
fn full_agent(
    rt: &tokio::runtime::Runtime,
    containerd: &evpleg_tests::containerd::Containerd,
    modes: &[agent::AgentMode],
    reps: usize,
    n: usize,
    window: Duration,
    results: &mut Results,
) -> Result<()> {
    progress(&format!(
        "full agent: {} modes, a warm-up and {reps} repetitions of {n} static pods started one \
         by one, then killed; interleaved",
        modes.len()
    ));
    let mut series: Vec<agent::AgentSeries> =
        modes.iter().map(|m| agent::AgentSeries::new(*m)).collect();
    for rep in 0..=reps {
        for k in 0..modes.len() {
            interrupt::check()?;
            let s = &mut series[(k + rep) % modes.len()];
            let line = rt.block_on(agent::repetition(containerd, s, rep, n, window))?;
            progress(&format!("  {}, {}: {line}", s.mode.name(), rep_label(rep)));
        }
    }
    for s in series {
        let a = s.finish();
        results.latency.extend(a.latencies);
        results.starts.extend(a.starts);
        for note in a.notes {
            if !results.notes.contains(&note) {
                results.notes.push(note);
            }
        }
    }
    Ok(())
}

/// Churn per mode: containers starting at a steady rate and dying by
/// themselves; one repetition per mode.
fn churn(
    rt: &tokio::runtime::Runtime,
    containerd: &evpleg_tests::containerd::Containerd,
    client: &evpleg_cri::CriClient,
    quick: bool,
    results: &mut Results,
) -> Result<()> {
    let rate = 2.0;
    // How long after the last start a death may still come.
    let (duration, tail) = if quick {
        (Duration::from_secs(3), Duration::from_secs(2))
    } else {
        (Duration::from_secs(60), Duration::from_secs(5))
    };
    let lifetime = Duration::from_millis(500);
    results.notes.push(format!(
        "Churn: one pod, a container started every {:.0} ms for {} s, each exiting by \
         itself {} ms after it starts (one repetition per mode: the spread is that of \
         one run).",
        1000.0 / rate,
        duration.as_secs(),
        lifetime.as_millis()
    ));
    for mode in PLEG_MODES {
        interrupt::check()?;
        let observer = Observer::Pleg(mode);
        progress(&format!(
            "churn: {} at {rate} containers/s for {} s",
            observer.name(),
            duration.as_secs()
        ));
        let s = rt.block_on(async {
            let mut running = Running::start(observer, client)?;
            let s = death::churn(
                containerd,
                client,
                &mut running,
                rate,
                duration,
                lifetime,
                tail,
            )
            .await;
            running.stop().await;
            anyhow::Ok(s)
        })?;
        progress(&format!(
            "  {} deaths seen, {} lost",
            s.event_us.len(),
            s.lost_events
        ));
        if !s.reader_us.is_empty() {
            results.latency.push(Latency {
                mode: observer.name().into(),
                workload: "churn".into(),
                stage: "reader".into(),
                summary: Summary::of(
                    &Percentiles::of(&s.reader_us)
                        .into_iter()
                        .collect::<Vec<_>>(),
                ),
                lost: 0,
                samples_us: s.reader_us,
            });
        }
        results.latency.push(Latency {
            mode: observer.name().into(),
            workload: "churn".into(),
            stage: "event".into(),
            summary: Summary::of(&Percentiles::of(&s.event_us).into_iter().collect::<Vec<_>>()),
            lost: s.lost_events,
            samples_us: s.event_us,
        });
    }
    Ok(())
}

/// Idle cost per mode at growing container counts (containers kept across
/// modes and counts).
fn idle_cost(
    rt: &tokio::runtime::Runtime,
    containerd: &evpleg_tests::containerd::Containerd,
    client: &evpleg_cri::CriClient,
    quick: bool,
    results: &mut Results,
) -> Result<()> {
    let (counts, windows, each): (&[usize], usize, Duration) = if quick {
        (&[10], 3, Duration::from_millis(1500))
    } else {
        (&[10, 50, 100, 200], 3, Duration::from_secs(8))
    };
    let containerd_pid = containerd.pid().context("containerd's pid")?;
    let mut pods = idle::IdlePods::new();
    for &n in counts {
        progress(&format!("idle cost: starting containers up to {n}"));
        rt.block_on(pods.grow_to(containerd, client, n));
        // The baseline (no PLEG: the benchmark's own process) at the highest count.
        let baseline = (n == *counts.last().expect("counts")).then_some(None);
        let modes = PLEG_MODES.map(Some).into_iter().chain(baseline);
        for mode in modes {
            interrupt::check()?;
            let name = mode.map_or("baseline", |m| Observer::Pleg(m).name());
            progress(&format!(
                "idle cost: {name} with {n} containers, {windows} windows of {:.1} s",
                each.as_secs_f64()
            ));
            let w = rt.block_on(idle::measure(mode, client, containerd_pid, windows, each))?;
            let spread = |f: fn(&idle::Window) -> f64| {
                stats::Spread::of(&w.iter().map(f).collect::<Vec<_>>()).context("no window")
            };
            let i = results::Idle {
                mode: name.into(),
                containers: n,
                seconds: (each * windows as u32).as_secs_f64(),
                agent_cpu_pct: spread(|w| w.agent_cpu_pct)?,
                containerd_cpu_pct: spread(|w| w.containerd_cpu_pct)?,
                agent_rss_mib: spread(|w| w.rss_mib)?,
                relists_per_s: spread(|w| w.relists_per_s)?,
            };
            progress(&format!(
                "  PLEG process {:.3} % of a core, containerd {:.3} %, RSS {:.1} MiB, {:.2} relists/s",
                i.agent_cpu_pct.median,
                i.containerd_cpu_pct.median,
                i.agent_rss_mib.median,
                i.relists_per_s.median
            ));
            results.idle.push(i);
        }
    }
    rt.block_on(pods.remove(client));
    Ok(())
}

/// What an operator asks first (issue #29): `tax`, `runtime-load`,
/// `relist-cost`, `memory`.
fn operator_parts(
    rt: &tokio::runtime::Runtime,
    containerd: &evpleg_tests::containerd::Containerd,
    client: &evpleg_cri::CriClient,
    quick: bool,
    wanted: &dyn Fn(&str) -> bool,
    results: &mut Results,
) -> Result<()> {
    interrupt::check()?;
    if wanted("tax") {
        let (counts, pairs, processes): (&[usize], usize, usize) = if quick {
            (&[0, 100], 2, 500)
        } else {
            (&[0, 1000, 10_000], 20, 2_500)
        };
        results.operator.tax = Some(tax::run(rt, counts, pairs, processes)?);
    }
    interrupt::check()?;
    if wanted("runtime-load") {
        let duration = Duration::from_secs(if quick { 4 } else { 60 });
        results.operator.runtime_load = Some(rt.block_on(runtime_load::run(
            containerd,
            client,
            2.0,
            duration,
            Duration::from_millis(500),
        ))?);
    }
    interrupt::check()?;
    if wanted("relist-cost") {
        let (counts, kills, window): (&[usize], usize, u64) = if quick {
            (&[10], 3, 3)
        } else {
            (&[100, 300, 900], 10, 10)
        };
        results.operator.relist_cost = Some(rt.block_on(relist_cost::run(
            containerd,
            counts,
            kills,
            Duration::from_secs(window),
        ))?);
    }
    interrupt::check()?;
    if wanted("memory") {
        let counts: &[usize] = if quick { &[10] } else { &[10, 50, 100] };
        results.operator.memory = Some(rt.block_on(memory::run(containerd, client, counts))?);
    }
    Ok(())
}

fn write(out: &std::path::Path, results: &Results) -> Result<()> {
    let dir = out.join("bench/results");
    std::fs::create_dir_all(&dir)?;
    let name = if results.quick {
        "quick.json"
    } else {
        "full.json"
    };
    let json = dir.join(name);
    std::fs::write(&json, serde_json::to_string_pretty(results)?)?;
    let docs = out.join("docs");
    std::fs::create_dir_all(&docs)?;
    let md = docs.join("benchmarks.md");
    let plots = plots::all(results, &dir)?;
    std::fs::write(&md, report::render(results, &plots))?;
    progress(&format!("wrote {} and {}", json.display(), md.display()));
    Ok(())
}

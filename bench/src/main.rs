//! evpleg's PLEG benchmark (issue #11), run by `cargo xtask bench`: each PLEG mode
//! in-process against the same private containerd and the same workloads, and a
//! bare ring-buffer reader as the floor. Writes raw results as JSON and
//! `docs/benchmarks.md`. A benchmark, not a test: it measures, it asserts nothing
//! about time.
//!
//! A crate of its own because it needs the agent's library, the test harness
//! (containerd, images, cgroups) and root, none of which `xtask` should carry.

mod death;
mod floor;
mod idle;
mod plots;
mod report;
mod results;
mod stats;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use evpleg::pleg::PlegMode;

use death::{Observer, Running, Workload};
use results::{Latency, Machine, Results};
use stats::{Percentiles, Summary};

#[derive(Parser, Debug)]
#[command(about = "evpleg's PLEG latency and cost benchmark")]
struct Cli {
    /// A short run (under 2 minutes): fewer repetitions and containers.
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
}

fn progress(msg: &str) {
    eprintln!("[bench {}] {msg}", Machine::here().date);
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(json) = &cli.from_json {
        let results: Results = serde_json::from_str(&std::fs::read_to_string(json)?)?;
        return write(&cli.out, &results);
    }
    let started = Instant::now();
    let (reps, n, window) = if cli.quick {
        (2, 4, Duration::from_millis(500))
    } else {
        (5, 10, Duration::from_millis(1500))
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
    progress(&format!("starting containerd {}", binary.display()));
    let containerd = evpleg_tests::containerd::Containerd::start_with(&binary)?;
    let rt = evpleg_tests::cri_pod::tokio_runtime();
    let client = rt.block_on(containerd.client());
    let version = rt.block_on(client.version())?.runtime_version;
    let mut results = Results {
        machine,
        command: cli.command.clone(),
        quick: cli.quick,
        containerd: version,
        repetitions: reps,
        containers_per_repetition: n,
        latency: Vec::new(),
        idle: Vec::new(),
        notes: Vec::new(),
    };
    let observers = [
        Observer::Floor,
        Observer::Pleg(PlegMode::Ebpf),
        Observer::Pleg(PlegMode::EventedCri),
        Observer::Pleg(PlegMode::Generic),
    ];
    for observer in observers {
        for workload in [Workload::SelfExit, Workload::Killed] {
            progress(&format!(
                "death latency: {} / {}: {reps} repetitions of {n} containers",
                observer.name(),
                workload.name()
            ));
            let mut reader = Vec::new();
            let mut event = Vec::new();
            let (mut lost_reader, mut lost_event) = (0, 0);
            let mut all_reader = Vec::new();
            let mut all_event = Vec::new();
            rt.block_on(async {
                let mut running = Running::start(observer, &client)?;
                for rep in 0..reps {
                    let s = death::repetition(
                        &containerd,
                        &client,
                        &mut running,
                        workload,
                        n,
                        window,
                        rep,
                    )
                    .await;
                    progress(&format!(
                        "  repetition {}: {} reader samples, {} event samples, lost {}/{}",
                        rep + 1,
                        s.reader_us.len(),
                        s.event_us.len(),
                        s.lost_reader,
                        s.lost_events
                    ));
                    reader.extend(Percentiles::of(&s.reader_us));
                    event.extend(Percentiles::of(&s.event_us));
                    lost_reader += s.lost_reader;
                    lost_event += s.lost_events;
                    all_reader.extend(s.reader_us);
                    all_event.extend(s.event_us);
                }
                running.stop().await;
                anyhow::Ok(())
            })?;
            let mode = observer.name().to_owned();
            if !all_reader.is_empty() || observer == Observer::Floor {
                results.latency.push(Latency {
                    mode: mode.clone(),
                    workload: workload.name().into(),
                    stage: "reader".into(),
                    summary: Summary::of(&reader),
                    lost: lost_reader,
                    samples_us: all_reader,
                });
            }
            if observer != Observer::Floor {
                results.latency.push(Latency {
                    mode,
                    workload: workload.name().into(),
                    stage: "event".into(),
                    summary: Summary::of(&event),
                    lost: lost_event,
                    samples_us: all_event,
                });
            }
        }
    }
    churn(&rt, &containerd, &client, cli.quick, &mut results)?;
    idle_cost(&rt, &containerd, &client, cli.quick, &mut results)?;
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

/// Churn per mode: containers starting at a steady rate and dying by
/// themselves; one repetition per mode.
fn churn(
    rt: &tokio::runtime::Runtime,
    containerd: &evpleg_tests::containerd::Containerd,
    client: &evpleg::cri::CriClient,
    quick: bool,
    results: &mut Results,
) -> Result<()> {
    let rate = 2.0;
    let duration = if quick {
        Duration::from_secs(5)
    } else {
        Duration::from_secs(20)
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
    for mode in [PlegMode::Ebpf, PlegMode::EventedCri, PlegMode::Generic] {
        let observer = Observer::Pleg(mode);
        progress(&format!(
            "churn: {} at {rate} containers/s for {} s",
            observer.name(),
            duration.as_secs()
        ));
        let s = rt.block_on(async {
            let mut running = Running::start(observer, client)?;
            let s = death::churn(containerd, client, &mut running, rate, duration, lifetime).await;
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
    client: &evpleg::cri::CriClient,
    quick: bool,
    results: &mut Results,
) -> Result<()> {
    let (counts, windows, each): (&[usize], usize, Duration) = if quick {
        (&[10], 3, Duration::from_secs(2))
    } else {
        (&[10, 50, 100], 3, Duration::from_secs(19))
    };
    let containerd_pid = containerd.pid().context("containerd's pid")?;
    let mut pods = idle::IdlePods::new();
    for &n in counts {
        progress(&format!("idle cost: starting containers up to {n}"));
        rt.block_on(pods.grow_to(containerd, client, n));
        // The baseline (no PLEG: the benchmark's own process) at the highest count.
        let baseline = (n == *counts.last().expect("counts")).then_some(None);
        let modes = [PlegMode::Ebpf, PlegMode::EventedCri, PlegMode::Generic]
            .map(Some)
            .into_iter()
            .chain(baseline);
        for mode in modes {
            let name = mode.map_or("baseline", |m| Observer::Pleg(m).name());
            progress(&format!(
                "idle cost: {name} with {n} containers, {windows} windows of {} s",
                each.as_secs()
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

//! `docs/benchmarks.md`, rendered from a run's [`Results`]: pure, so that it is
//! tested without a machine.

use std::fmt::Write;

use crate::results::{Latency, Results};
use crate::stats::Spread;

/// A latency in microseconds, in the unit that reads best.
pub fn human_us(us: f64) -> String {
    if us >= 10_000.0 {
        format!("{:.0} ms", us / 1000.0)
    } else if us >= 1000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{us:.0} us")
    }
}

/// `median (min-max)` of a latency spread.
fn spread_us(s: &Spread) -> String {
    if s.min == s.max {
        return human_us(s.median);
    }
    format!(
        "{} ({}-{})",
        human_us(s.median),
        human_us(s.min),
        human_us(s.max)
    )
}

fn latency_row(out: &mut String, l: &Latency) {
    match &l.summary {
        Some(s) => {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                l.mode,
                l.stage,
                s.samples,
                spread_us(&s.p50),
                spread_us(&s.p90),
                spread_us(&s.p99),
                spread_us(&s.max),
                l.lost
            );
        }
        None => {
            let _ = writeln!(
                out,
                "| {} | {} | 0 | - | - | - | - | {} |",
                l.mode, l.stage, l.lost
            );
        }
    }
}

fn p50(r: &Results, mode: &str, workload: &str) -> Option<f64> {
    r.latency(mode, workload, "event")
        .and_then(|l| l.summary.as_ref())
        .map(|s| s.p50.median)
}

/// The ebpf path stage by stage (p50 from the kernel's exit, and the step from
/// the stage before).
fn stage_by_stage(out: &mut String, r: &Results, workload: &str) {
    let stages: Vec<(&str, f64)> = r
        .latency
        .iter()
        .filter(|l| l.mode == "ebpf" && l.workload == workload && l.stage != SHIM_REAPED)
        .filter_map(|l| Some((l.stage.as_str(), l.summary.as_ref()?.p50.median)))
        .collect();
    if stages.len() < 2 {
        return;
    }
    let _ = write!(
        out,
        "\nWhere the ebpf path's time goes (p50 from the kernel's exit; the step from the stage before in brackets):"
    );
    let mut before = 0.0;
    for (i, (stage, p50)) in stages.iter().enumerate() {
        let sep = if i == 0 { " " } else { ", " };
        let _ = write!(
            out,
            "{sep}{stage} {} (+{})",
            human_us(*p50),
            human_us((p50 - before).max(0.0))
        );
        before = *p50;
    }
    let _ = writeln!(
        out,
        ". Medians of different stages come from different deaths, so the steps are \
         approximate."
    );
}

/// The stage holding the runtime's own exit time (containerd's `finished_at`).
pub const SHIM_REAPED: &str = "shim-reaped";

/// The runtime's own view of the deaths against the kernel path's: when the
/// shim reaped each process (its `finished_at`), and when the runtime told a
/// client (the CRI event stream, a relist).
fn runtime_view(out: &mut String, r: &Results, workload: &str) {
    let p50_of = |mode: &str, stage: &str| {
        r.latency(mode, workload, stage)
            .and_then(|l| l.summary.as_ref())
            .map(|s| s.p50.median)
    };
    let Some(reaped) = p50_of("ebpf", SHIM_REAPED) else {
        return;
    };
    let _ = write!(
        out,
        "
The runtime's own view (p50 from the kernel's exit): containerd's shim reaped the \
         process (its `finished_at`) after {}",
        human_us(reaped)
    );
    if let Some(read) = p50_of("ebpf", "reader") {
        let _ = write!(
            out,
            "; the ebpf reader had the record after {} ({})",
            human_us(read),
            if read < reaped {
                "before the container's own parent"
            } else {
                "after the container's own parent"
            }
        );
    }
    if let Some(delivered) = p50_of("ebpf", "delivered") {
        let _ = write!(out, ", the PLEG event after {}", human_us(delivered));
    }
    if let Some(stream) = p50_of("evented-cri", "event") {
        let _ = write!(
            out,
            "; containerd's event stream reported it after {}",
            human_us(stream)
        );
    }
    if let Some(relist) = p50_of("generic", "event") {
        let _ = write!(out, ", a 1 s relist after {}", human_us(relist));
    }
    let _ = writeln!(out, ".");
}

/// The scale workload's tables.
fn scale(out: &mut String, r: &Results) {
    let Some(sc) = &r.scale else { return };
    let _ = writeln!(out, "## Scale (cgroups and plain processes, no runtime)\n");
    // Counts run through the whole PLEG are those with a `delivered` stage.
    let full = |n: usize| {
        sc.rates
            .iter()
            .any(|x| x.cgroups == n && x.stages.iter().any(|(s, _)| s == "delivered"))
    };
    let counts: Vec<usize> = sc.rates.iter().map(|x| x.cgroups).collect();
    let (whole, alone): (Vec<usize>, Vec<usize>) = counts.iter().partition(|n| full(**n));
    let list = |v: &[usize]| {
        let mut v = v.to_vec();
        v.dedup();
        v.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        out,
        "At {} cgroups the whole PLEG in `ebpf` mode runs over an in-process fake CRI server \
         listing every cgroup as a pod (stages to `delivered`){}. The relist figures measure \
         evpleg's relist code against that fake, not a runtime. One run per count and rate \
         (no repetitions: the spread is within the run).\n",
        if whole.is_empty() {
            "no".to_owned()
        } else {
            list(&whole)
        },
        if alone.is_empty() {
            String::new()
        } else {
            format!(
                "; at {}, the kernel path alone (reader, decoder, tracker: stages to \
                 `attributed`), because the first relist of that many pods takes minutes in \
                 the dev build",
                list(&alone)
            )
        }
    );
    let _ = writeln!(
        out,
        "| cgroups | exits/s asked | achieved | deaths | lost | late | dropped | stage | p50 | p90 | p99 | max | reader CPU (% of a core) | reader wake-ups a death | process CPU |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for x in &sc.rates {
        for (stage, p) in &x.stages {
            let _ = writeln!(
                out,
                "| {} | {:.0} | {:.0} | {} | {} | {} | {} | {stage} | {} | {} | {} | {} | {:.1} | {} | {:.1} |",
                x.cgroups,
                x.target_per_s,
                x.achieved_per_s,
                x.deaths,
                x.lost,
                x.late,
                x.dropped,
                human_us(p.p50),
                human_us(p.p90),
                human_us(p.p99),
                human_us(p.max),
                x.reader_cpu_pct,
                x.reader_runs_per_death
                    .map_or_else(|| "-".to_owned(), |r| format!("{r:.2}")),
                x.process_cpu_pct
            );
        }
    }
    let _ = writeln!(out);
    if !sc.relist.is_empty() {
        let _ = writeln!(
            out,
            "| cgroups | generic: first relist (ms) | steady relist (ms) | generic CPU at 1 relist/s (% of a core) | ebpf reader idle (% of a core) |\n|---|---|---|---|---|"
        );
        let f = |v: Option<f64>, d: usize| match v {
            Some(v) if v.is_finite() => format!("{v:.d$}"),
            _ => "-".to_owned(),
        };
        for c in &sc.relist {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                c.cgroups,
                f(c.first_ms, 0),
                f(c.steady_ms, 1),
                f(c.generic_cpu_pct, 2),
                f(c.ebpf_idle_reader_cpu_pct, 3)
            );
        }
        let _ = writeln!(out);
    }
    if let Some(o) = &sc.overflow {
        let _ = writeln!(
            out,
            "Overflow: {} processes killed into a {}-byte ring buffer while its reader was held \
             at the record tap: {} records dropped and counted by the kernel, {} deaths \
             delivered by the kernel path and {} by the relist (the runtime's view), {} lost; \
             the last {:.0} ms after the reader went on.\n",
            o.deaths, o.ring_bytes, o.dropped, o.by_kernel, o.by_relist, o.lost, o.repaired_ms
        );
    }
}

/// Start latency through the full agent.
fn starts(out: &mut String, r: &Results) {
    if r.starts.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Start latency (full agent)\n");
    let _ = writeln!(
        out,
        "From the manifest written to the status manager holding the container Running \
         (ms; per pod, pods started one at a time).\n"
    );
    let _ = writeln!(
        out,
        "| mode | pods | part | p50 | p90 | max |\n|---|---|---|---|---|---|"
    );
    let ms = |s: &Spread| {
        if s.min == s.max {
            format!("{:.0}", s.median)
        } else {
            format!("{:.0} ({:.0}-{:.0})", s.median, s.min, s.max)
        }
    };
    for st in &r.starts {
        for (part, sum) in [
            ("total", &st.total_ms),
            ("runtime (start CRI calls)", &st.runtime_ms),
            ("agent (total - runtime)", &st.agent_ms),
            ("inspection CRI calls meanwhile", &st.inspection_ms),
        ] {
            if let Some(s) = sum {
                let _ = writeln!(
                    out,
                    "| {} | {} | {part} | {} | {} | {} |",
                    st.mode,
                    st.pods,
                    ms(&s.p50),
                    ms(&s.p90),
                    ms(&s.max)
                );
            }
        }
    }
    let _ = writeln!(out);
}

/// The targets against this run's numbers.
fn targets(out: &mut String, r: &Results) {
    let _ = writeln!(out, "## Targets (issue #11)\n");
    let _ = writeln!(out, "| target | measured | met |\n|---|---|---|");
    let mut row = |target: &str, measured: String, met: Option<bool>| {
        let met = match met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "not measured",
        };
        let _ = writeln!(out, "| {target} | {measured} | {met} |");
    };
    for workload in ["self-exit", "killed"] {
        for (stage, what) in [
            ("delivered", "PLEG event: taken by the pod workers' channel"),
            (
                "event",
                "event taken from that channel by a tokio task, its wake-up included",
            ),
        ] {
            let Some(l) = r.latency("ebpf", workload, stage) else {
                continue;
            };
            let s = l.summary.as_ref();
            row(
                &format!(
                    "ebpf p50 <= 30 us, p99 <= 150 us ({workload}, {what}; single deaths, not 1 000/s)"
                ),
                s.map_or("-".into(), |s| {
                    format!(
                        "p50 {}, p99 {}",
                        human_us(s.p50.median),
                        human_us(s.p99.median)
                    )
                }),
                s.map(|s| s.p50.median <= 30.0 && s.p99.median <= 150.0),
            );
        }
        let e = p50(r, "ebpf", workload);
        let g = p50(r, "generic", workload);
        let c = p50(r, "evented-cri", workload);
        row(
            &format!("p50 >= 100x lower than generic ({workload})"),
            match (e, g) {
                (Some(e), Some(g)) => format!("{:.0}x ({} vs {})", g / e, human_us(e), human_us(g)),
                _ => "-".into(),
            },
            e.zip(g).map(|(e, g)| g >= 100.0 * e),
        );
        row(
            &format!("p50 lower than the CRI event stream ({workload})"),
            match (e, c) {
                (Some(e), Some(c)) => format!("{:.0}x ({} vs {})", c / e, human_us(e), human_us(c)),
                _ => "-".into(),
            },
            e.zip(c).map(|(e, c)| e < c),
        );
        let stage_p50 = |stage: &str| {
            r.latency("ebpf", workload, stage)
                .and_then(|l| l.summary.as_ref())
                .map(|s| s.p50.median)
        };
        let (read, reaped) = (stage_p50("reader"), stage_p50(SHIM_REAPED));
        row(
            &format!(
                "the reader sees the exit before the container's parent, the shim's waitpid ({workload})"
            ),
            match (read, reaped) {
                (Some(a), Some(b)) => format!("reader p50 {} vs shim {}", human_us(a), human_us(b)),
                _ => "-".into(),
            },
            read.zip(reaped).map(|(a, b)| a < b),
        );
    }
    let idle = |mode: &str| {
        r.idle
            .iter()
            .filter(|i| i.mode == mode)
            .min_by_key(|i| i.containers.abs_diff(100))
    };
    match (idle("ebpf"), idle("generic")) {
        (Some(e), Some(g)) if e.containers == g.containers => row(
            &format!(
                "agent CPU, ebpf <= 1/10 of generic ({} idle containers; the issue asks 100)",
                e.containers
            ),
            {
                let mut m = format!(
                    "{:.3} % vs {:.3} % of a core",
                    e.agent_cpu_pct.median, g.agent_cpu_pct.median
                );
                if let Some(b) = r
                    .idle
                    .iter()
                    .find(|i| i.mode == "baseline" && i.containers == e.containers)
                {
                    let _ = write!(
                        m,
                        "; {:.3} % vs {:.3} % over the baseline without a PLEG ({:.3} %)",
                        e.agent_cpu_pct.median - b.agent_cpu_pct.median,
                        g.agent_cpu_pct.median - b.agent_cpu_pct.median,
                        b.agent_cpu_pct.median
                    );
                }
                m
            },
            Some(e.agent_cpu_pct.median * 10.0 <= g.agent_cpu_pct.median),
        ),
        _ => row(
            "agent CPU, ebpf <= 1/10 of generic (100 idle containers)",
            "-".into(),
            None,
        ),
    }
    match &r.scale {
        Some(sc) if !sc.rates.is_empty() => {
            let lost: usize = sc.rates.iter().map(|x| x.lost).sum();
            let late: usize = sc.rates.iter().map(|x| x.late).sum();
            let deaths: usize = sc.rates.iter().map(|x| x.deaths).sum();
            let most = sc.rates.iter().map(|x| x.cgroups).max().unwrap_or(0);
            let fastest = sc
                .rates
                .iter()
                .map(|x| x.achieved_per_s)
                .fold(0.0, f64::max);
            row(
                "no lost events at 1 000/2 000/5 000 exits/s over 10 000 cgroups",
                format!(
                    "{lost} lost of {deaths} deaths ({late} delivered after 5 s by a relist), up to \
                     {most} cgroups, up to {fastest:.0} exits/s achieved"
                ),
                Some(lost == 0 && most >= 10_000 && fastest >= 4_500.0),
            );
            for x in sc
                .rates
                .iter()
                .filter(|x| (x.target_per_s - 1000.0).abs() < 1.0)
            {
                if let Some((stage, p)) = x.stages.last() {
                    row(
                        &format!(
                            "at 1 000 exits/s over {} cgroups: p50 <= 30 us, p99 <= 150 us ({stage}), reader < 3 % of a core",
                            x.cgroups
                        ),
                        format!(
                            "p50 {}, p99 {}, reader {:.1} %",
                            human_us(p.p50),
                            human_us(p.p99),
                            x.reader_cpu_pct
                        ),
                        Some(p.p50 <= 30.0 && p.p99 <= 150.0 && x.reader_cpu_pct < 3.0),
                    );
                }
            }
            if let Some(o) = &sc.overflow {
                row(
                    "overflow: a small ring buffer drops, counts, and the relist repairs every death",
                    format!(
                        "{} deaths, {} records dropped and counted, {} delivered by the kernel, {} by the relist, {} lost",
                        o.deaths, o.dropped, o.by_kernel, o.by_relist, o.lost
                    ),
                    Some(o.dropped > 0 && o.lost == 0),
                );
            }
        }
        _ => row(
            "no lost events at 1 000/2 000/5 000 exits/s over 10 000 cgroups",
            "-".into(),
            None,
        ),
    }
    let _ = writeln!(out);
}

/// What issue #11 asks that this benchmark does not measure yet.
const NOT_YET: &str = "## Known gaps and what is not measured yet (issue #11)\n\n\
- The ebpf path to the PLEG event misses p50 <= 30 us by about ten microseconds. \
After the floor (the reader thread's wake-up), decoding and attribution, the overlay on \
the cache, and the hand-over to the workers' channel each take a few microseconds; the \
hand-over wakes a tokio worker on the other vCPU, measured once at 7-9 us in the release \
build by stamping before and after its `try_send`.\n\
- The reader's CPU at 1 000 exits/s over 1 000 cgroups: about two wake-ups a death, the \
record's and the pod relist's reconciliation (a command that wakes the reader). Applying \
reconciliations only before the next record halved the wake-ups and cut that CPU by about \
a quarter, but put each reconciliation on the next death's path (p50 10-20 us later), so \
it was not kept.\n\
- Deaths the kernel cannot vouch for (a container learned by a scan with its processes \
running, until the runtime's pid confirms its main process) relist their pod one by one. \
Over 10 000 pods a pod relist of the fake costs about a millisecond, so thousands of such \
hints a second queue for tens of seconds: delivered late, not lost (seen before the fake \
served its containers' pids, as containerd does; the `late` column counts such deaths).\n\
- Churn at higher rates than containerd starts containers here (2 a second).\n\
- Idle cost above 200 containers: the machine holds more (each costs a shim of a few \
MiB), the 15-minute budget does not.\n\
- `cri-proxy` in the death workloads without the agent (it is measured through the full \
agent, `agent-killed`).\n";

/// The whole report. `plots` are (title, relative path) of SVG files.
pub fn render(r: &Results, plots: &[(String, String)]) -> String {
    let mut out = String::new();
    let m = &r.machine;
    let _ = writeln!(out, "# PLEG benchmarks\n");
    let _ = writeln!(
        out,
        "Generated by `{}` on {} ({} cores, {}, kernel {}), containerd {}. \
         Raw results: `bench/results/`. {} repetitions of {} containers per mode and workload; \
         each figure is the median over repetitions with the lowest and highest in brackets.\n",
        r.command,
        m.date,
        m.cores,
        m.cpu_model,
        m.kernel,
        r.containerd,
        r.repetitions,
        r.containers_per_repetition
    );
    let _ = writeln!(
        out,
        "## How it measures\n\n\
         Each PLEG runs in-process (the `evpleg-pleg` crate, as `tests/` run it) against the \
         same private containerd, with the same workload; in the `agent-killed` workload the \
         whole agent runs in each mode (file source, sync loop, pod workers, status manager; \
         in `generic` and `evented-cri` mode a kernel PLEG beside it is the stopwatch, and \
         `delivered` is the relist's or the event stream's ContainerDied taken by the \
         workers' channel; in `cri-proxy` mode the agent runs in `evented-cri` mode behind \
         `evpleg cri-proxy` in front of the same containerd, the proxy's kernel PLEG the \
         stopwatch). \
         Latencies start at the kernel's exit \
         timestamp (`bpf_ktime_get_ns` in the `sched_process_exit` record, CLOCK_MONOTONIC): \
         in `ebpf` mode the PLEG's own record, in the other modes a kernel PLEG run alongside \
         as a stopwatch. Stages (from the agent's opt-in stage log, `evpleg_pleg::stages`, \
         and the record tap): `reader` the record read by the ring-buffer thread, \
         `attributed` decoded and attributed to a container by the tracker, `cached` the \
         death laid on the pod's snapshot in the cache, `delivered` the ContainerDied taken \
         by the pod workers' channel (the PLEG event), `event` that event taken from the \
         channel by a tokio task (it includes that task's wake-up), `worker-sync` a pod \
         worker starting a sync whose cache entry holds the death, `status-held` the status \
         manager holding the container terminated. `floor` is a bare reader: the same \
         tracepoint, a thread at the same SCHED_FIFO priority blocked in epoll, reading \
         only the header and pid, run alone on the same workload.\n\n\
         Workloads: `self-exit`, containers whose shell exits once a file appears, \
         released at random times over a window; `killed`, the main process killed with \
         SIGKILL from the host at random times; `churn`, containers started at a steady \
         rate that exit by themselves; `agent-killed`, static pods of the full agent killed \
         from the host at random times (see the notes).\n"
    );
    targets(&mut out, r);
    for workload in ["self-exit", "killed", "churn", "agent-killed"] {
        if !r.latency.iter().any(|l| l.workload == workload) {
            continue;
        }
        let _ = writeln!(out, "## Death latency: {workload}\n");
        let _ = writeln!(
            out,
            "| mode | stage | samples | p50 | p90 | p99 | max | lost |\n|---|---|---|---|---|---|---|---|"
        );
        for l in r.latency.iter().filter(|l| l.workload == workload) {
            latency_row(&mut out, l);
        }
        if let (Some(e), Some(f)) = (
            p50(r, "ebpf", workload),
            r.latency("floor", workload, "reader")
                .and_then(|l| l.summary.as_ref())
                .map(|s| s.p50.median),
        ) {
            let _ = writeln!(
                out,
                "\nebpf event / floor (p50): {:.1}x ({} vs {}).",
                e / f,
                human_us(e),
                human_us(f)
            );
        }
        stage_by_stage(&mut out, r, workload);
        runtime_view(&mut out, r, workload);
        let _ = writeln!(out);
    }
    starts(&mut out, r);
    scale(&mut out, r);
    if !r.idle.is_empty() {
        let _ = writeln!(out, "## Idle cost\n");
        let _ = writeln!(
            out,
            "| mode | containers | seconds | PLEG process CPU (% of a core) | containerd CPU (% of a core) | PLEG process RSS (MiB) | relists/s |\n|---|---|---|---|---|---|---|"
        );
        for i in &r.idle {
            let _ = writeln!(
                out,
                "| {} | {} | {:.0} | {:.3} ({:.3}-{:.3}) | {:.3} ({:.3}-{:.3}) | {:.1} | {:.2} |",
                i.mode,
                i.containers,
                i.seconds,
                i.agent_cpu_pct.median,
                i.agent_cpu_pct.min,
                i.agent_cpu_pct.max,
                i.containerd_cpu_pct.median,
                i.containerd_cpu_pct.min,
                i.containerd_cpu_pct.max,
                i.agent_rss_mib.median,
                i.relists_per_s.median
            );
        }
        let _ = writeln!(out);
    }
    if !plots.is_empty() {
        let _ = writeln!(out, "## Plots\n");
        for (title, path) in plots {
            let _ = writeln!(out, "![{title}]({path})\n");
        }
    }
    let _ = writeln!(out, "{NOT_YET}");
    if !r.notes.is_empty() {
        let _ = writeln!(out, "## Notes\n");
        for n in &r.notes {
            let _ = writeln!(out, "- {n}");
        }
        let _ = writeln!(out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::{Idle, Machine};
    use crate::stats::{Percentiles, Summary};

    fn latency(mode: &str, workload: &str, stage: &str, samples: &[f64]) -> Latency {
        Latency {
            mode: mode.into(),
            workload: workload.into(),
            stage: stage.into(),
            summary: Summary::of(&[Percentiles::of(samples).unwrap()]),
            lost: 0,
            samples_us: samples.to_vec(),
        }
    }

    fn results() -> Results {
        let spread = |v| Spread {
            median: v,
            min: v,
            max: v,
        };
        Results {
            machine: Machine {
                cores: 2,
                kernel: "6.18.0".into(),
                cpu_model: "Test CPU".into(),
                date: "2026-12-01T00:00:00Z".into(),
            },
            command: "cargo xtask bench".into(),
            quick: false,
            containerd: "1.7.24".into(),
            repetitions: 1,
            containers_per_repetition: 3,
            latency: vec![
                latency("ebpf", "self-exit", "reader", &[5.0, 10.0, 15.0]),
                latency("ebpf", "self-exit", "delivered", &[15.0, 20.0, 40.0]),
                latency("ebpf", "self-exit", "event", &[20.0, 25.0, 100.0]),
                latency(
                    "generic",
                    "self-exit",
                    "event",
                    &[400_000.0, 500_000.0, 900_000.0],
                ),
                latency(
                    "evented-cri",
                    "self-exit",
                    "event",
                    &[50_000.0, 60_000.0, 70_000.0],
                ),
                latency("floor", "self-exit", "reader", &[10.0, 12.5, 30.0]),
                latency("ebpf", "self-exit", SHIM_REAPED, &[100.0, 150.0, 400.0]),
            ],
            idle: vec![
                Idle {
                    mode: "ebpf".into(),
                    containers: 10,
                    seconds: 60.0,
                    agent_cpu_pct: spread(0.1),
                    containerd_cpu_pct: spread(1.0),
                    agent_rss_mib: spread(30.0),
                    relists_per_s: spread(1.0),
                },
                Idle {
                    mode: "generic".into(),
                    containers: 10,
                    seconds: 60.0,
                    agent_cpu_pct: spread(0.5),
                    containerd_cpu_pct: spread(2.0),
                    agent_rss_mib: spread(30.0),
                    relists_per_s: spread(1.0),
                },
            ],
            starts: vec![],
            scale: None,
            notes: vec!["a note".into()],
        }
    }

    #[test]
    fn units_read_well() {
        assert_eq!(human_us(25.4), "25 us");
        assert_eq!(human_us(1500.0), "1.50 ms");
        assert_eq!(human_us(54_000.0), "54 ms");
    }

    #[test]
    fn the_report_names_the_machine_tables_and_targets() {
        let md = render(&results(), &[("CDF".into(), "bench/cdf.svg".into())]);
        assert!(md.contains("Generated by `cargo xtask bench` on 2026-12-01T00:00:00Z (2 cores, Test CPU, kernel 6.18.0)"), "{md}");
        assert!(
            md.contains("| ebpf | event | 3 | 25 us | 100 us | 100 us | 100 us | 0 |"),
            "{md}"
        );
        assert!(md.contains("| floor | reader | 3 | 12 us |"), "{md}");
        // 500 ms / 25 us = 20 000x; 60 ms / 25 us = 2 400x.
        assert!(
            md.contains(
                "| p50 >= 100x lower than generic (self-exit) | 20000x (25 us vs 500 ms) | yes |"
            ),
            "{md}"
        );
        assert!(
            md.contains(
                "| p50 lower than the CRI event stream (self-exit) | 2400x (25 us vs 60 ms) | yes |"
            ),
            "{md}"
        );
        // p99 100 us <= 150, p50 25 <= 30.
        assert!(md.contains("| ebpf p50 <= 30 us, p99 <= 150 us (self-exit, PLEG event: taken by the pod workers' channel; single deaths, not 1 000/s) | p50 20 us, p99 40 us | yes |"), "{md}");
        assert!(md.contains("| ebpf p50 <= 30 us, p99 <= 150 us (self-exit, event taken from that channel by a tokio task, its wake-up included; single deaths, not 1 000/s) | p50 25 us, p99 100 us | yes |"), "{md}");
        // killed was not run: not measured, never "yes".
        assert!(
            md.contains("| p50 >= 100x lower than generic (killed) | - | not measured |"),
            "{md}"
        );
        // 0.1 * 10 = 1.0 > 0.5: missed, and said so.
        assert!(
            md.contains("| 0.100 % vs 0.500 % of a core | **no** |"),
            "{md}"
        );
        assert!(
            md.contains("ebpf event / floor (p50): 2.0x (25 us vs 12 us)"),
            "{md}"
        );
        assert!(md.contains("![CDF](bench/cdf.svg)"));
        assert!(md.contains("## Known gaps and what is not measured yet"));
        assert!(
            md.contains(
                "in brackets): reader 10 us (+10 us), delivered 20 us (+10 us), event 25 us (+5 us)."
            ),
            "{md}"
        );
        assert!(md.contains("- a note"));
        // The runtime's own view, out of the stage-by-stage line above.
        assert!(
            md.contains(
                "containerd's shim reaped the process (its `finished_at`) after 150 us; the ebpf \
                 reader had the record after 10 us (before the container's own parent), the PLEG \
                 event after 20 us; containerd's event stream reported it after 60 ms, a 1 s \
                 relist after 500 ms."
            ),
            "{md}"
        );
        assert!(
            md.contains("| the reader sees the exit before the container's parent, the shim's waitpid (self-exit) | reader p50 10 us vs shim 150 us | yes |"),
            "{md}"
        );
    }
}

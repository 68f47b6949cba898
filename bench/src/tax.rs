//! The node tax (issue #29): the kernel PLEG's programs run on every exec and
//! exit of the host, not only containers'. The kubelet has no such cost (its
//! PLEG only relists the runtime, `pkg/kubelet/pleg/generic.go`), so this is
//! a cost evpleg adds and must show.
//!
//! Two measurements, each with 0 container cgroups known and with the counts
//! asked for (1 000 and 10 000 in a full run: container-like cgroups with a
//! `sleep` each, scanned by the kernel PLEG at its start):
//! * a fork/exec/exit loop of short host processes (`/bin/true`, outside any
//!   container cgroup) in blocks, alternately with the programs detached and
//!   attached (the kernel PLEG stopped and started between blocks, outside the
//!   timed window): wall time per process, and the children's CPU
//!   (`RUSAGE_CHILDREN`: the programs run in the exec'ing and exiting task);
//! * one more attached block with `BPF_ENABLE_STATS` on (the kernel then
//!   times every program run, which costs time itself, so the loop's ratio is
//!   measured with the stats off): each program's `run_time_ns` and `run_cnt`
//!   from `/proc/self/fdinfo`, the ns per exec and per exit.
//!
//! On a 2-core VM a block of 2 500 processes (about 1.7 s) differs from the
//! next by up to 5-16 % with nothing changed, a hundred times what the
//! programs cost, so the loop's figure is the median of paired differences
//! with its 95 % interval ([`crate::stats::median_interval`]), and the
//! programs' own run time per process (the stats block) is shown beside it
//! as a share of the detached process: the direct figure the loop can only
//! bound. The loop itself is slower with 10 000 container cgroups, attached
//! or not (988 against 666 us a process in one run): a cost of the host's
//! cgroups and processes, not of the programs (a block run in a child process
//! of its own, which is not the parent of the cgroups' `sleep`s, was as slow).
//!
//! Every block's raw figures are kept; the ratio and the per-run costs are
//! computed by the report from them ([`overhead_pct`], [`ProgramRuns::ns_per_run`]).

use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use evpleg_pleg::kernel::{KernelPleg, KernelPlegConfig};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::stats::Spread;

/// The target: at most this much added to the loop.
pub const TARGET_PCT: f64 = 2.0;
/// The process the loop runs.
const TRUE: &str = "/bin/true";

/// Errors of the node-tax measurement.
#[derive(Debug, thiserror::Error)]
pub enum TaxError {
    #[error(transparent)]
    Interrupted(#[from] crate::interrupt::Interrupted),
    #[error("spawning {TRUE} (process {index} of a block): {source}")]
    Spawn {
        index: usize,
        source: std::io::Error,
    },
    #[error("{TRUE} exited with {status} (process {index} of a block)")]
    Failed {
        index: usize,
        status: std::process::ExitStatus,
    },
    #[error("starting the kernel pleg: {0}")]
    Kernel(String),
    #[error("bpf(BPF_ENABLE_STATS): {0}")]
    EnableStats(std::io::Error),
    #[error("making {count} container cgroups: {message}")]
    Cgroups { count: usize, message: String },
}

/// One timed block of the loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Block {
    /// Whether the programs were attached.
    pub attached: bool,
    pub processes: usize,
    /// Wall time of the whole block, ns.
    pub wall_ns: u64,
    /// The children's user and system CPU over the block, ns.
    pub children_cpu_ns: u64,
}

impl Block {
    pub fn wall_ns_per_process(&self) -> f64 {
        self.wall_ns as f64 / self.processes.max(1) as f64
    }

    pub fn cpu_ns_per_process(&self) -> f64 {
        self.children_cpu_ns as f64 / self.processes.max(1) as f64
    }
}

/// One program's counters over the stats block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgramRuns {
    /// The program's name as attached (the loader's, in load order).
    pub program: String,
    pub run_cnt: u64,
    pub run_time_ns: u64,
}

impl ProgramRuns {
    /// Mean run time, ns (`None`: never ran).
    pub fn ns_per_run(&self) -> Option<f64> {
        (self.run_cnt > 0).then(|| self.run_time_ns as f64 / self.run_cnt as f64)
    }

    /// Runs per process of the loop.
    pub fn runs_per_process(&self, processes: usize) -> f64 {
        self.run_cnt as f64 / processes.max(1) as f64
    }
}

/// The measurement with `cgroups` container cgroups known.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaxRun {
    pub cgroups: usize,
    /// In the order run (detached and attached alternate).
    pub blocks: Vec<Block>,
    /// Processes of the stats block.
    pub stats_processes: usize,
    /// Each program's counters over the stats block (empty when the kernel
    /// refused `BPF_ENABLE_STATS`).
    pub programs: Vec<ProgramRuns>,
}

/// The whole node-tax measurement.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TaxResults {
    pub runs: Vec<TaxRun>,
}

/// The loop's per-process cost: (detached, attached) medians over blocks of
/// `f`, ns.
fn medians(blocks: &[Block], f: fn(&Block) -> f64) -> Option<(f64, f64)> {
    let of = |attached: bool| {
        let v: Vec<f64> = blocks
            .iter()
            .filter(|b| b.attached == attached)
            .map(f)
            .collect();
        Spread::of(&v).map(|s| s.median)
    };
    Some((of(false)?, of(true)?))
}

/// What the programs added within each pair of blocks (one detached, one
/// attached, run one after the other in either order), in % of the pair's
/// detached block: a drift of the machine between pairs cancels out, where
/// the median attached block against the median detached block swung by
/// 60-180 us a process at 1 000 and 10 000 cgroups (issue #29). Blocks not
/// paired so are skipped.
pub fn paired_pcts(blocks: &[Block], f: fn(&Block) -> f64) -> Vec<f64> {
    blocks
        .chunks_exact(2)
        .filter_map(|pair| {
            let (off, on) = match (pair[0].attached, pair[1].attached) {
                (false, true) => (&pair[0], &pair[1]),
                (true, false) => (&pair[1], &pair[0]),
                _ => return None,
            };
            let off = f(off);
            (off > 0.0).then(|| 100.0 * (f(on) / off - 1.0))
        })
        .collect()
}

/// What the programs add to the loop, in % of the detached loop: the median
/// of [`paired_pcts`], with their least and greatest (`None`: no pair).
pub fn overhead(blocks: &[Block], f: fn(&Block) -> f64) -> Option<Spread> {
    Spread::of(&paired_pcts(blocks, f))
}

/// [`overhead`]'s median.
pub fn overhead_pct(blocks: &[Block], f: fn(&Block) -> f64) -> Option<f64> {
    overhead(blocks, f).map(|s| s.median)
}

impl TaxRun {
    fn program(&self, prefix: &str) -> Option<&ProgramRuns> {
        self.programs.iter().find(|p| p.program.starts_with(prefix))
    }

    /// ns per exec: the exec program's mean run.
    pub fn ns_per_exec(&self) -> Option<f64> {
        self.program("sched_process_exec")?.ns_per_run()
    }

    /// ns per exit: the exit program's mean run (either variant).
    pub fn ns_per_exit(&self) -> Option<f64> {
        self.program("sched_process_exit")?.ns_per_run()
    }
}

/// The programs' ids and names, from the `bpf-prog` descriptors this process
/// holds (so only programs loaded here).
fn own_programs() -> Vec<(i32, u64)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if target.to_string_lossy() != "anon_inode:bpf-prog" {
            continue;
        }
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(id) = fdinfo_field(fd, "prog_id") {
            out.push((fd, id));
        }
    }
    out
}

/// A numeric field of `/proc/self/fdinfo/<fd>`.
fn fdinfo_field(fd: i32, name: &str) -> Option<u64> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    parse_fdinfo(&info, name)
}

fn parse_fdinfo(info: &str, name: &str) -> Option<u64> {
    info.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == name).then(|| v.trim().parse().ok())?
    })
}

/// The loader's names of the programs held, by load order (ids ascend in
/// load order; the kernel's own name is cut to 15 bytes, so the exec and exit
/// programs' would be alike).
fn name_programs(mut held: Vec<(i32, u64)>) -> Vec<(i32, String)> {
    held.sort_by_key(|(_, id)| *id);
    held.dedup_by_key(|(_, id)| *id);
    held.into_iter()
        .enumerate()
        .map(|(i, (fd, _))| {
            let name = evpleg_pleg::kernel::loader::PROGRAMS
                .get(i)
                .map_or_else(|| format!("program {i}"), |n| (*n).to_owned());
            (fd, name)
        })
        .collect()
}

/// `BPF_ENABLE_STATS` for as long as the descriptor is held.
fn enable_stats() -> Result<OwnedFd, TaxError> {
    const BPF_ENABLE_STATS: libc::c_long = 32;
    // union bpf_attr's enable_stats: { __u32 type }, BPF_STATS_RUN_TIME = 0.
    let attr = [0u64; 2];
    // SAFETY: bpf(2) reads `size_of_val(&attr)` bytes of a live buffer.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_ENABLE_STATS,
            attr.as_ptr(),
            std::mem::size_of_val(&attr) as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(TaxError::EnableStats(std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel returned a new descriptor this process owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The children's CPU so far, ns.
fn children_cpu_ns() -> u64 {
    // SAFETY: rusage is plain data, valid all zero.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    ns(ru.ru_utime) + ns(ru.ru_stime)
}

/// Runs `processes` short host processes one after another.
fn block(attached: bool, processes: usize) -> Result<Block, TaxError> {
    let cpu0 = children_cpu_ns();
    let t0 = Instant::now();
    for index in 0..processes {
        let status = Command::new(TRUE)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|source| TaxError::Spawn { index, source })?;
        if !status.success() {
            return Err(TaxError::Failed { index, status });
        }
    }
    Ok(Block {
        attached,
        processes,
        wall_ns: t0.elapsed().as_nanos() as u64,
        children_cpu_ns: children_cpu_ns().saturating_sub(cpu0),
    })
}

/// The kernel PLEG alone (programs and reader), its events drained.
fn attach(
    rt: &tokio::runtime::Runtime,
) -> Result<(KernelPleg, tokio::task::JoinHandle<()>), TaxError> {
    let _in = rt.enter();
    let (tx, mut rx) = mpsc::channel(100_000);
    let relist = Arc::new(evpleg_core::lifecycle::RelistSignal::new());
    let k = KernelPleg::start(KernelPlegConfig::default(), tx, relist)
        .map_err(|e| TaxError::Kernel(e.to_string()))?;
    let drain = rt.spawn(async move { while rx.recv().await.is_some() {} });
    Ok((k, drain))
}

/// Measures the tax with each count of container cgroups known: `pairs`
/// detached/attached pairs of blocks of `processes`, then the stats block.
pub fn run(
    rt: &tokio::runtime::Runtime,
    counts: &[usize],
    pairs: usize,
    processes: usize,
) -> Result<TaxResults, TaxError> {
    let mut out = TaxResults::default();
    for &n in counts {
        crate::progress(&format!(
            "node tax: {n} container cgroups, {pairs} pairs of {processes}-process blocks"
        ));
        let _cgroups = if n > 0 {
            Some(
                crate::scale::Cgroups::create(n).map_err(|e| TaxError::Cgroups {
                    count: n,
                    message: format!("{e:#}"),
                })?,
            )
        } else {
            None
        };
        let mut blocks = Vec::new();
        for pair in 0..pairs {
            crate::interrupt::check()?;
            // Alternate which side goes first, so that a drift of the machine
            // does not favour one.
            let order = if pair % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for attached in order {
                let k = if attached { Some(attach(rt)?) } else { None };
                let b = block(attached, processes)?;
                if let Some((k, drain)) = k {
                    k.stop();
                    drain.abort();
                }
                blocks.push(b);
            }
        }
        let (k, drain) = attach(rt)?;
        let stats = enable_stats();
        let before = counters();
        let b = block(true, processes)?;
        let after = counters();
        let programs = match &stats {
            Ok(_) => diff(&before, &after),
            Err(e) => {
                crate::progress(&format!("  no program statistics: {e}"));
                Vec::new()
            }
        };
        drop(stats);
        k.stop();
        drain.abort();
        let run = TaxRun {
            cgroups: n,
            blocks,
            stats_processes: b.processes,
            programs,
        };
        crate::progress(&format!(
            "  loop {:+.2} % wall, {:+.2} % CPU; {:.0} ns per exec, {:.0} ns per exit",
            overhead_pct(&run.blocks, Block::wall_ns_per_process).unwrap_or(f64::NAN),
            overhead_pct(&run.blocks, Block::cpu_ns_per_process).unwrap_or(f64::NAN),
            run.ns_per_exec().unwrap_or(f64::NAN),
            run.ns_per_exit().unwrap_or(f64::NAN)
        ));
        out.runs.push(run);
    }
    Ok(out)
}

/// (name, run_cnt, run_time_ns) of every program held.
fn counters() -> Vec<(String, u64, u64)> {
    name_programs(own_programs())
        .into_iter()
        .map(|(fd, name)| {
            (
                name,
                fdinfo_field(fd, "run_cnt").unwrap_or(0),
                fdinfo_field(fd, "run_time_ns").unwrap_or(0),
            )
        })
        .collect()
}

/// The counters' growth between two readings, per program.
fn diff(before: &[(String, u64, u64)], after: &[(String, u64, u64)]) -> Vec<ProgramRuns> {
    after
        .iter()
        .map(|(name, cnt, ns)| {
            let (c0, n0) = before
                .iter()
                .find(|b| &b.0 == name)
                .map_or((0, 0), |b| (b.1, b.2));
            ProgramRuns {
                program: name.clone(),
                run_cnt: cnt.saturating_sub(c0),
                run_time_ns: ns.saturating_sub(n0),
            }
        })
        .collect()
}

/// The report's section.
pub fn render(t: &TaxResults) -> String {
    let mut s = String::from("## The node tax\n\n");
    s.push_str(&format!(
        "The kernel PLEG's programs run on every exec and exit of the host. A loop \
         of short host processes (`{TRUE}`, one after another) in blocks, the programs \
         detached and attached alternately, in pairs (one of each, one after the \
         other, which goes first alternating); what the programs add is the median \
         over pairs of the attached block against its pair's detached block, of wall \
         time and of the children's CPU, with the 95 % interval of that median \
         (order statistics) and the least and greatest pair (target: under \
         {TARGET_PCT} %). The us per process are the medians of each side's blocks. \
         Per program, one more attached block with `BPF_ENABLE_STATS` on \
         (`run_time_ns` / `run_cnt` from fdinfo); `programs' share` is their run \
         time per exec and exit against the detached process: what the loop, whose \
         blocks differ by several % with nothing changed, can only bound.\n\n"
    ));
    s.push_str(
        "| cgroups known | blocks | processes a block | detached us/process | attached us/process | wall added | its 95 % interval | pairs' range | CPU added | ns per exec | ns per exit | programs' share | target |\n\
         |---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|\n",
    );
    for r in &t.runs {
        let (off, on) =
            medians(&r.blocks, Block::wall_ns_per_process).unwrap_or((f64::NAN, f64::NAN));
        let spread = overhead(&r.blocks, Block::wall_ns_per_process);
        let wall = spread.map(|s| s.median);
        let range = spread.map_or_else(
            || "-".into(),
            |s| format!("{:+.2} to {:+.2} %", s.min, s.max),
        );
        let interval =
            crate::stats::median_interval(&paired_pcts(&r.blocks, Block::wall_ns_per_process))
                .map_or_else(|| "-".into(), |(lo, hi)| format!("{lo:+.2} to {hi:+.2} %"));
        let cpu = overhead_pct(&r.blocks, Block::cpu_ns_per_process);
        let share = r
            .ns_per_exec()
            .zip(r.ns_per_exit())
            .map(|(exec, exit)| format!("{:.3} %", 100.0 * (exec + exit) / off));
        let verdict = match wall {
            Some(w) if w <= TARGET_PCT => "met",
            Some(_) => "**missed**",
            None => "-",
        };
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {} | {interval} | {range} | {} | {} | {} | {} | {verdict} |\n",
            r.cgroups,
            r.blocks.len(),
            r.blocks.first().map_or(0, |b| b.processes),
            off / 1000.0,
            on / 1000.0,
            pct(wall),
            pct(cpu),
            ns(r.ns_per_exec()),
            ns(r.ns_per_exit()),
            share.unwrap_or_else(|| "-".into()),
        ));
    }
    s.push_str("\nPer program over the stats block:\n\n| cgroups known | program | runs | runs per process | ns per run |\n|---:|---|---:|---:|---:|\n");
    for r in &t.runs {
        for p in &r.programs {
            s.push_str(&format!(
                "| {} | `{}` | {} | {:.2} | {} |\n",
                r.cgroups,
                p.program,
                p.run_cnt,
                p.runs_per_process(r.stats_processes),
                ns(p.ns_per_run())
            ));
        }
    }
    s.push('\n');
    s
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:+.2} %"))
}

fn ns(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(attached: bool, processes: usize, wall_ns: u64, cpu_ns: u64) -> Block {
        Block {
            attached,
            processes,
            wall_ns,
            children_cpu_ns: cpu_ns,
        }
    }

    #[test]
    fn overhead_is_the_median_pair_difference() {
        // (blocks, wall %, cpu %)
        let table: [(Vec<Block>, Option<f64>, Option<f64>); 7] = [
            (
                vec![b(false, 10, 1000, 500), b(true, 10, 1010, 510)],
                Some(1.0),
                Some(2.0),
            ),
            // Each pair against itself, in either order, then the median of
            // three (the middle one: -8.3, +2, +10), not a mean; the medians
            // of each side (1 100 against 1 000) would say +10 %.
            (
                vec![
                    b(false, 10, 1000, 100),
                    b(true, 10, 1100, 100),
                    b(true, 10, 1100, 100),
                    b(false, 10, 1200, 100),
                    b(false, 10, 1000, 100),
                    b(true, 10, 1020, 100),
                ],
                Some(2.0),
                Some(0.0),
            ),
            // Two of a kind in a row are no pair.
            (
                vec![
                    b(false, 10, 1000, 100),
                    b(false, 10, 5000, 100),
                    b(true, 10, 1030, 100),
                    b(false, 10, 1000, 100),
                ],
                Some(3.0),
                Some(0.0),
            ),
            (
                vec![b(true, 10, 1000, 100), b(true, 10, 1000, 100)],
                None,
                None,
            ),
            // Per process: blocks of different sizes compare per process.
            (
                vec![b(false, 10, 1000, 100), b(true, 20, 1960, 200)],
                Some(-2.0),
                Some(0.0),
            ),
            (vec![b(false, 10, 1000, 100)], None, None),
            (vec![b(false, 10, 0, 0), b(true, 10, 10, 10)], None, None),
        ];
        for (i, (blocks, wall, cpu)) in table.into_iter().enumerate() {
            let got = overhead_pct(&blocks, Block::wall_ns_per_process);
            let close = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) => (a - b).abs() < 1e-9,
                (None, None) => true,
                _ => false,
            };
            assert!(close(got, wall), "case {i}: wall {got:?}, want {wall:?}");
            let got = overhead_pct(&blocks, Block::cpu_ns_per_process);
            assert!(close(got, cpu), "case {i}: cpu {got:?}, want {cpu:?}");
        }
    }

    #[test]
    fn per_run_and_per_process_costs() {
        // (run_cnt, run_time_ns, processes, ns per run, runs per process)
        let table = [
            (100_000u64, 25_000_000u64, 100_000usize, Some(250.0), 1.0),
            (200_000, 10_000_000, 100_000, Some(50.0), 2.0),
            (0, 0, 1000, None, 0.0),
            (5, 1000, 0, Some(200.0), 5.0),
        ];
        for (cnt, ns, processes, per_run, per_process) in table {
            let p = ProgramRuns {
                program: "x".into(),
                run_cnt: cnt,
                run_time_ns: ns,
            };
            assert_eq!(p.ns_per_run(), per_run, "{cnt} runs in {ns} ns");
            assert_eq!(p.runs_per_process(processes), per_process, "{cnt} runs");
        }
    }

    #[test]
    fn exec_and_exit_costs_come_from_their_programs() {
        let run = TaxRun {
            cgroups: 0,
            blocks: Vec::new(),
            stats_processes: 10,
            programs: diff(
                &[
                    ("sched_process_exec".into(), 5, 1000),
                    ("sched_process_exit".into(), 5, 500),
                ],
                &[
                    ("cgroup_mkdir".into(), 0, 0),
                    ("sched_process_exec".into(), 15, 4000),
                    ("sched_process_exit".into(), 25, 2500),
                ],
            ),
        };
        assert_eq!(run.ns_per_exec(), Some(300.0));
        assert_eq!(run.ns_per_exit(), Some(100.0));
        assert_eq!(run.programs[0].ns_per_run(), None);
    }

    #[test]
    fn programs_are_named_by_load_order() {
        let named = name_programs(vec![(9, 40), (7, 12), (8, 30), (3, 31), (4, 50)]);
        let want: Vec<(i32, String)> = [7, 8, 3, 9, 4]
            .into_iter()
            .zip(evpleg_pleg::kernel::loader::PROGRAMS)
            .map(|(fd, n)| (fd, n.to_owned()))
            .collect();
        assert_eq!(named, want);
    }

    #[test]
    fn fdinfo_fields_parse() {
        let info = "pos:\t0\nflags:\t02000002\nprog_type:\t26\nprog_id:\t4711\nrun_time_ns:\t123456\nrun_cnt:\t42\n";
        let table = [
            ("prog_id", Some(4711)),
            ("run_time_ns", Some(123_456)),
            ("run_cnt", Some(42)),
            ("verified_insns", None),
        ];
        for (name, want) in table {
            assert_eq!(parse_fdinfo(info, name), want, "{name}");
        }
    }
}

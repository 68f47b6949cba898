//! Per-stage latencies of deaths from the agent's stage log
//! (`evpleg_pleg::stages`, installed by this benchmark): for each container,
//! the first record of each stage at or after the kernel's exit, in
//! microseconds from it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use evpleg_pleg::stages;
use evpleg_pleg::stages::{Stage, StageRecord};

/// The stages after the kernel's exit, in the order a death passes them.
pub const AFTER_KERNEL: [Stage; 7] = [
    Stage::Read,
    Stage::Attributed,
    Stage::Cached,
    Stage::Delivered,
    Stage::Taken,
    Stage::WorkerSync,
    Stage::StatusHeld,
];

/// The report's name of a stage (`reader` is the ring-buffer read, as the
/// record tap measured it before the stage log existed).
pub fn name(stage: Stage) -> &'static str {
    match stage {
        Stage::Read => "reader",
        // As the death workloads name the event taken from the channel.
        Stage::Taken => "event",
        s => s.name(),
    }
}

/// Installs the stage log (once per process) and empties it.
pub fn start() {
    stages::install(1 << 20).clear();
}

/// The log's records so far.
pub fn snapshot() -> Vec<StageRecord> {
    stages::log().map(|l| l.snapshot()).unwrap_or_default()
}

/// Samples per stage (in [`AFTER_KERNEL`] order, empty stages left out) for
/// the containers `ids`, and how many of them have no kernel record.
pub fn samples(ids: &[&str], records: &[StageRecord]) -> (Vec<(Stage, Vec<f64>)>, usize) {
    let by_key = by_key(records);
    let mut out: Vec<(Stage, Vec<f64>)> = AFTER_KERNEL.iter().map(|s| (*s, Vec::new())).collect();
    let mut missing = 0;
    for id in ids {
        let Some(recs) = stages::key_of(id).and_then(|k| by_key.get(&k)) else {
            missing += 1;
            continue;
        };
        let Some(kernel) = first_kernel(recs.iter().copied()) else {
            missing += 1;
            continue;
        };
        for (stage, samples) in &mut out {
            if let Some(r) = first_after(recs.iter().copied(), *stage, kernel.at_ns) {
                samples.push((r.at_ns - kernel.at_ns) as f64 / 1000.0);
            }
        }
    }
    out.retain(|(_, s)| !s.is_empty());
    (out, missing)
}

/// Container `id`'s first kernel exit and the first ring-buffer read at or
/// after it (ns), if the log holds both.
pub fn exit_read(id: &str, records: &[StageRecord]) -> Option<(u64, u64)> {
    let key = stages::key_of(id)?;
    let mine = || records.iter().filter(move |r| r.key == key);
    let kernel = first_kernel(mine())?.at_ns;
    Some((kernel, first_after(mine(), Stage::Read, kernel)?.at_ns))
}

/// Deaths by the CPU whose program stamped the exit and the CPU the reader
/// read it on, and how many of them were read more than a bound after their
/// exit: each CPU stamps with its own clock, so late reads on one pair alone
/// would be the two clocks' disagreement, not a wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuPair {
    pub exit_cpu: u32,
    pub read_cpu: u32,
    pub deaths: usize,
    pub late: usize,
}

/// [`CpuPair`]s of the containers `ids` (those with an exit and a read on
/// known CPUs), a read later than `late_us` after its exit counted late;
/// ordered by CPUs.
pub fn cpu_pairs(ids: &[&str], records: &[StageRecord], late_us: f64) -> Vec<CpuPair> {
    let by_key = by_key(records);
    let mut pairs: std::collections::BTreeMap<(u32, u32), CpuPair> = Default::default();
    for id in ids {
        let Some(recs) = stages::key_of(id).and_then(|k| by_key.get(&k)) else {
            continue;
        };
        let Some(kernel) = first_kernel(recs.iter().copied()) else {
            continue;
        };
        let Some(read) = first_after(recs.iter().copied(), Stage::Read, kernel.at_ns) else {
            continue;
        };
        if kernel.cpu == stages::NO_CPU || read.cpu == stages::NO_CPU {
            continue;
        }
        let pair = pairs.entry((kernel.cpu, read.cpu)).or_insert(CpuPair {
            exit_cpu: kernel.cpu,
            read_cpu: read.cpu,
            deaths: 0,
            late: 0,
        });
        pair.deaths += 1;
        if (read.at_ns - kernel.at_ns) as f64 / 1000.0 > late_us {
            pair.late += 1;
        }
    }
    pairs.into_values().collect()
}

/// The records by container key.
fn by_key(records: &[StageRecord]) -> HashMap<u64, Vec<&StageRecord>> {
    let mut by_key: HashMap<u64, Vec<&StageRecord>> = HashMap::new();
    for r in records {
        by_key.entry(r.key).or_default().push(r);
    }
    by_key
}

/// The first kernel exit among one container's records.
fn first_kernel<'a>(mut recs: impl Iterator<Item = &'a StageRecord>) -> Option<&'a StageRecord> {
    recs.find(|r| r.stage == Stage::Kernel)
}

/// The earliest record of `stage` at or after `kernel` among one
/// container's records.
fn first_after<'a>(
    recs: impl Iterator<Item = &'a StageRecord>,
    stage: Stage,
    kernel: u64,
) -> Option<&'a StageRecord> {
    recs.filter(|r| r.stage == stage && r.at_ns >= kernel)
        .min_by_key(|r| r.at_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_record_of_each_stage_after_the_kernel_s() {
        let id = format!("00000000000000aa{}", "0".repeat(48));
        let other = format!("00000000000000bb{}", "0".repeat(48));
        let rec = |stage, at_ns| StageRecord {
            stage,
            key: 0xaa,
            at_ns,
            cpu: stages::NO_CPU,
        };
        let records = [
            // A worker sync before the death does not count.
            rec(Stage::WorkerSync, 500),
            rec(Stage::Kernel, 1_000),
            rec(Stage::Read, 21_000),
            rec(Stage::Attributed, 25_000),
            rec(Stage::WorkerSync, 400_000),
            rec(Stage::WorkerSync, 300_000),
        ];
        let (s, missing) = samples(&[&id, &other], &records);
        assert_eq!(missing, 1);
        assert_eq!(
            s,
            vec![
                (Stage::Read, vec![20.0]),
                (Stage::Attributed, vec![24.0]),
                (Stage::WorkerSync, vec![299.0]),
            ]
        );
    }

    #[test]
    fn exit_read_pairs_the_kernels_exit_with_the_first_read_after_it() {
        let id = format!("00000000000000aa{}", "0".repeat(48));
        let rec = |stage, key, at_ns| StageRecord {
            stage,
            key,
            at_ns,
            cpu: stages::NO_CPU,
        };
        let records = [
            rec(Stage::Read, 0xaa, 900),
            rec(Stage::Read, 0xbb, 1_100),
            rec(Stage::Kernel, 0xaa, 1_000),
            rec(Stage::Read, 0xaa, 1_300),
            rec(Stage::Read, 0xaa, 1_200),
        ];
        assert_eq!(exit_read(&id, &records), Some((1_000, 1_200)));
        assert_eq!(
            exit_read(&id, &records[..3]),
            None,
            "no read after the exit"
        );
        assert_eq!(exit_read("zz", &records), None, "not a container id");
    }

    #[test]
    fn deaths_are_paired_by_the_cpus_of_their_exit_and_read() {
        let id = |k: u64| format!("{k:016x}{}", "0".repeat(48));
        let (a, b, c, d) = (id(0xa), id(0xb), id(0xc), id(0xd));
        let rec = |stage, key, at_ns, cpu| StageRecord {
            stage,
            key,
            at_ns,
            cpu,
        };
        let records = [
            // a: stamped on 1, read on 0 within 20 us.
            rec(Stage::Kernel, 0xa, 1_000, 1),
            rec(Stage::Read, 0xa, 21_000, 0),
            // b: stamped on 1, read on 0 45 ms later (late); an earlier read
            // of the same key before its exit does not count.
            rec(Stage::Read, 0xb, 500, 1),
            rec(Stage::Kernel, 0xb, 1_000, 1),
            rec(Stage::Read, 0xb, 45_001_000, 0),
            // c: stamped and read on 0.
            rec(Stage::Kernel, 0xc, 1_000, 0),
            rec(Stage::Read, 0xc, 15_000, 0),
            // d: its read's CPU unknown: left out.
            rec(Stage::Kernel, 0xd, 1_000, 0),
            rec(Stage::Read, 0xd, 15_000, stages::NO_CPU),
        ];
        let ids = [a.as_str(), b.as_str(), c.as_str(), d.as_str()];
        assert_eq!(
            cpu_pairs(&ids, &records, 1000.0),
            vec![
                CpuPair {
                    exit_cpu: 0,
                    read_cpu: 0,
                    deaths: 1,
                    late: 0
                },
                CpuPair {
                    exit_cpu: 1,
                    read_cpu: 0,
                    deaths: 2,
                    late: 1
                },
            ]
        );
    }
}

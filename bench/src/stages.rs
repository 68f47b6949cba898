//! Per-stage latencies of deaths from the agent's stage log
//! (`evpleg_pleg::stages`, installed by this benchmark): for each container,
//! the first record of each stage at or after the kernel's exit, in
//! microseconds from it.

use std::collections::HashMap;

use evpleg_pleg::stages;
use evpleg_pleg::stages::{Stage, StageRecord};

/// The stages after the kernel's exit, in the order a death passes them.
pub const AFTER_KERNEL: [Stage; 6] = [
    Stage::Read,
    Stage::Attributed,
    Stage::Cached,
    Stage::Delivered,
    Stage::WorkerSync,
    Stage::StatusHeld,
];

/// The report's name of a stage (`reader` is the ring-buffer read, as the
/// record tap measured it before the stage log existed).
pub fn name(stage: Stage) -> &'static str {
    match stage {
        Stage::Read => "reader",
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
    let mut by_key: HashMap<u64, Vec<&StageRecord>> = HashMap::new();
    for r in records {
        by_key.entry(r.key).or_default().push(r);
    }
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
            if let Some(at) = first_after(recs.iter().copied(), *stage, kernel) {
                samples.push((at - kernel) as f64 / 1000.0);
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
    let kernel = first_kernel(mine())?;
    Some((kernel, first_after(mine(), Stage::Read, kernel)?))
}

/// The first kernel exit among one container's records.
fn first_kernel<'a>(mut recs: impl Iterator<Item = &'a StageRecord>) -> Option<u64> {
    recs.find(|r| r.stage == Stage::Kernel).map(|r| r.at_ns)
}

/// The earliest record of `stage` at or after `kernel` among one
/// container's records.
fn first_after<'a>(
    recs: impl Iterator<Item = &'a StageRecord>,
    stage: Stage,
    kernel: u64,
) -> Option<u64> {
    recs.filter(|r| r.stage == stage && r.at_ns >= kernel)
        .map(|r| r.at_ns)
        .min()
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
        let rec = |stage, key, at_ns| StageRecord { stage, key, at_ns };
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
}

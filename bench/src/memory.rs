//! The PLEG's own memory (issue #29): the resident memory of a process that
//! runs only the PLEG, in each mode, against the number of containers the
//! runtime holds, beside the same process without a PLEG (its runtime, CRI
//! client and binary: the baseline the PLEG's share is measured from). The
//! kubelet's PLEG lives in the kubelet's process (`pkg/kubelet/pleg`), whose
//! RSS is dominated by everything else; a process of its own tells the PLEG's
//! share, which the benchmark's process (holding every sample of the run)
//! cannot.
//!
//! The child is this benchmark's binary again, started with
//! [`CHILD_ENV`] set: it starts the PLEG against the endpoint given, drains
//! its events, says `ready` once the first full relist is done, and stops
//! when its standard input closes. Its `VmRSS` and `VmHWM` are read from
//! `/proc/<pid>/status` after a settling time.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use evpleg_pleg::PlegMode;
use evpleg_pleg::kernel::KernelPlegConfig;
use serde::{Deserialize, Serialize};

/// Set to `<mode>|<endpoint>` (`none` for no PLEG) in the child.
pub const CHILD_ENV: &str = "EVPLEG_BENCH_MEMORY_CHILD";
/// How long the child runs after its first relist before it is measured.
const SETTLE: Duration = Duration::from_secs(3);

/// Errors of the memory measurement.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error(transparent)]
    Interrupted(#[from] crate::interrupt::Interrupted),
    #[error("starting the measured child {exe}: {source}")]
    Spawn { exe: String, source: std::io::Error },
    #[error("the measured child (pid {pid}, {mode}) was not ready within {secs} s")]
    NotReady { pid: u32, mode: String, secs: u64 },
    #[error("reading /proc/{pid}/status: {source}")]
    Status { pid: u32, source: std::io::Error },
    #[error("/proc/{pid}/status has no {field}")]
    Field { pid: u32, field: &'static str },
    #[error("child spec {0:?}: want <mode>|<endpoint>")]
    Spec(String),
    #[error("the child's pleg: {0}")]
    Child(String),
}

/// One process measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryRow {
    /// A PLEG mode, or `none` (the baseline).
    pub mode: String,
    pub containers: usize,
    pub rss_kib: u64,
    pub hwm_kib: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryResults {
    pub rows: Vec<MemoryRow>,
}

impl MemoryResults {
    /// The PLEG's share: the mode's RSS less the baseline's at the same
    /// count, KiB (`None`: no baseline at that count).
    pub fn above_baseline_kib(&self, row: &MemoryRow) -> Option<i64> {
        let base = self
            .rows
            .iter()
            .find(|r| r.mode == "none" && r.containers == row.containers)?;
        Some(row.rss_kib as i64 - base.rss_kib as i64)
    }
}

/// A `kB` field of a `/proc/<pid>/status`.
fn status_kib(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

fn mode_name(mode: Option<PlegMode>) -> &'static str {
    mode.map_or("none", |m| crate::death::Observer::Pleg(m).name())
}

fn parse_mode(name: &str) -> Option<Option<PlegMode>> {
    [PlegMode::Ebpf, PlegMode::EventedCri, PlegMode::Generic]
        .into_iter()
        .map(Some)
        .chain([None])
        .find(|m| mode_name(*m) == name)
}

/// The child: runs until its standard input closes.
pub fn child(spec: &str) -> Result<(), MemoryError> {
    let (mode, endpoint) = spec
        .split_once('|')
        .ok_or_else(|| MemoryError::Spec(spec.to_owned()))?;
    let mode = parse_mode(mode).ok_or_else(|| MemoryError::Spec(spec.to_owned()))?;
    let rt = evpleg_tests::cri_pod::tokio_runtime();
    rt.block_on(async {
        let client = evpleg_cri::CriClient::connect(endpoint, Default::default())
            .await
            .map_err(|e| MemoryError::Child(e.to_string()))?;
        let (tx, mut rx) = tokio::sync::mpsc::channel(10_000);
        let pleg = match mode {
            Some(mode) => Some(
                crate::death::start_pleg(mode, &client, KernelPlegConfig::default(), tx)
                    .map_err(|e| MemoryError::Child(e.to_string()))?,
            ),
            None => None,
        };
        let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let deadline = Instant::now() + Duration::from_secs(120);
        while let Some(p) = &pleg
            && p.relist_stats.relists.load(Ordering::Relaxed) < 1
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!("ready");
        let _ = std::io::stdout().flush();
        // Until the parent closes our stdin.
        tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
        })
        .await
        .map_err(|e| MemoryError::Child(e.to_string()))?;
        if let Some(p) = pleg {
            p.stop().await;
        }
        drain.abort();
        Ok(())
    })
}

/// Starts the child for `mode` and measures it once settled.
fn measure(
    mode: Option<PlegMode>,
    endpoint: &str,
    containers: usize,
) -> Result<MemoryRow, MemoryError> {
    let exe = std::env::current_exe().map_err(|source| MemoryError::Spawn {
        exe: "the benchmark".into(),
        source,
    })?;
    let mut child: Child = Command::new(&exe)
        .env(CHILD_ENV, format!("{}|{endpoint}", mode_name(mode)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|source| MemoryError::Spawn {
            exe: exe.display().to_string(),
            source,
        })?;
    let pid = child.id();
    let result = (|| {
        let stdout = child.stdout.take().ok_or(MemoryError::NotReady {
            pid,
            mode: mode_name(mode).into(),
            secs: 0,
        })?;
        // The ready line, read on a thread so that the wait has a bound.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let bound = Duration::from_secs(150);
        match rx.recv_timeout(bound) {
            Ok(line) if line.trim() == "ready" => {}
            _ => {
                return Err(MemoryError::NotReady {
                    pid,
                    mode: mode_name(mode).into(),
                    secs: bound.as_secs(),
                });
            }
        }
        std::thread::sleep(SETTLE);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|source| MemoryError::Status { pid, source })?;
        Ok(MemoryRow {
            mode: mode_name(mode).into(),
            containers,
            rss_kib: status_kib(&status, "VmRSS").ok_or(MemoryError::Field {
                pid,
                field: "VmRSS",
            })?,
            hwm_kib: status_kib(&status, "VmHWM").ok_or(MemoryError::Field {
                pid,
                field: "VmHWM",
            })?,
        })
    })();
    // Closing stdin stops it; killed if it does not stop.
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(10);
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// Every mode and the baseline at each count (containers kept across modes
/// and counts).
pub async fn run(
    containerd: &evpleg_tests::containerd::Containerd,
    client: &evpleg_cri::CriClient,
    counts: &[usize],
) -> Result<MemoryResults, MemoryError> {
    let mut out = MemoryResults::default();
    let mut pods = crate::idle::IdlePods::new();
    let endpoint = containerd.endpoint();
    for &n in counts {
        crate::interrupt::check()?;
        crate::progress(&format!("memory: starting containers up to {n}"));
        pods.grow_to(containerd, client, n).await;
        for mode in [
            None,
            Some(PlegMode::Ebpf),
            Some(PlegMode::EventedCri),
            Some(PlegMode::Generic),
        ] {
            let endpoint = endpoint.clone();
            let row = tokio::task::spawn_blocking(move || measure(mode, &endpoint, n))
                .await
                .map_err(|e| MemoryError::Child(e.to_string()))?;
            let row = match row {
                Ok(r) => r,
                Err(e) => {
                    pods.remove(client).await;
                    return Err(e);
                }
            };
            crate::progress(&format!(
                "  {} with {n} containers: RSS {:.1} MiB (peak {:.1})",
                row.mode,
                row.rss_kib as f64 / 1024.0,
                row.hwm_kib as f64 / 1024.0
            ));
            out.rows.push(row);
        }
    }
    pods.remove(client).await;
    Ok(out)
}

/// The report's section.
pub fn render(m: &MemoryResults) -> String {
    let mut s = String::from("## The PLEG's memory\n\n");
    s.push_str(&format!(
        "A process running only the PLEG (this benchmark's binary as a child, its PLEG \
         against the same containerd), measured {} s after its first full relist; `none` is \
         the same process without a PLEG. The PLEG's share is the difference.\n\n\
         | mode | containers | RSS (MiB) | peak RSS (MiB) | above `none` (MiB) |\n|---|---:|---:|---:|---:|\n",
        SETTLE.as_secs()
    ));
    for r in &m.rows {
        s.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {} |\n",
            r.mode,
            r.containers,
            r.rss_kib as f64 / 1024.0,
            r.hwm_kib as f64 / 1024.0,
            m.above_baseline_kib(r)
                .map_or_else(|| "-".into(), |k| format!("{:.1}", k as f64 / 1024.0))
        ));
    }
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_parse() {
        let status = "Name:\tevpleg-bench\nVmHWM:\t   40960 kB\nVmRSS:\t   30720 kB\nThreads:\t7\n";
        let table = [
            ("VmRSS", Some(30_720)),
            ("VmHWM", Some(40_960)),
            ("VmSwap", None),
            ("Threads", Some(7)),
        ];
        for (field, want) in table {
            assert_eq!(status_kib(status, field), want, "{field}");
        }
    }

    #[test]
    fn the_pleg_share_is_against_the_baseline_at_the_same_count() {
        let row = |mode: &str, containers, rss_kib| MemoryRow {
            mode: mode.into(),
            containers,
            rss_kib,
            hwm_kib: rss_kib,
        };
        let m = MemoryResults {
            rows: vec![
                row("none", 10, 10_000),
                row("ebpf", 10, 14_096),
                row("none", 100, 10_100),
                row("generic", 100, 9_000),
                row("ebpf", 50, 20_000),
            ],
        };
        let table = [(1, Some(4_096)), (3, Some(-1_100)), (4, None), (0, Some(0))];
        for (i, want) in table {
            assert_eq!(m.above_baseline_kib(&m.rows[i]), want, "row {i}");
        }
    }

    #[test]
    fn modes_round_trip_through_the_child_spec() {
        for mode in [
            None,
            Some(PlegMode::Ebpf),
            Some(PlegMode::EventedCri),
            Some(PlegMode::Generic),
        ] {
            assert_eq!(parse_mode(mode_name(mode)), Some(mode));
        }
        assert_eq!(parse_mode("floor"), None);
    }
}

//! The kubelet's container log manager (`pkg/kubelet/logs/
//! container_log_manager.go`): every `--container-log-monitor-interval`
//! (10 s), each running container's CRI log file (its `log_path` in CRI
//! `ContainerStatus`) reaching `--container-log-max-size` (10Mi) is rotated:
//! 1. leftovers are removed: `.tmp` files of an interrupted compression, and
//!    rotated files that also exist compressed;
//! 2. the oldest rotated files are removed until `max-files - 2` remain
//!    (the live file and the one rotated now make `max-files`);
//! 3. the remaining rotated files are gzip-compressed (`<file>.gz`, written
//!    as `<file>.tmp` and renamed), so only the newest rotated file stays
//!    plain, as `kubectl logs` readers of the previous file may hold it;
//! 4. the live file is renamed to `<log>.<YYYYMMDD-hhmmss>` and the runtime
//!    asked to reopen it (CRI `ReopenContainerLog`); until it does, its
//!    writes land in the renamed file, so no line is lost. If the runtime
//!    refuses, the file is renamed back and tried again next round.
//!
//! A running container's missing log file is reopened, as the kubelet does.
//! Only the log paths are kept in memory: an agent restart continues from
//! the files.
//!
//! Differences: the time in rotated names is UTC (the kubelet: local time);
//! a rotation whose name exists already (two in one second) waits for the
//! next round rather than overwrite it; one worker. Each container's log
//! path is asked of the runtime once ([`LogPaths`]), not every round: it is
//! fixed when the container is created (CRI `ContainerConfig.log_path`), and
//! the kubelet's `ContainerStatus` per running container every 10 s (its
//! `TODO(#59998)`) was at 100 idle pods most of the agent's calls to the
//! runtime (10 of 13 a second).

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use evpleg_cri::CriClient;
use evpleg_cri_api::v1;
use k8s_openapi::jiff::Timestamp;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Compressed rotated files end with this.
pub const COMPRESS_SUFFIX: &str = ".gz";
/// A compression in progress writes this.
pub const TMP_SUFFIX: &str = ".tmp";
/// The rotated file's time stamp (Go's `20060102-150405`).
pub const TIMESTAMP_FORMAT: &str = "%Y%m%d-%H%M%S";

/// Errors of the log manager.
#[derive(Debug, thiserror::Error)]
pub enum LogRotateError {
    #[error("invalid container log policy: {0}")]
    Policy(String),
    #[error("failed to {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("failed to reopen the log of container {id}: {source}")]
    Reopen {
        id: String,
        source: evpleg_cri::CriError,
    },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> LogRotateError {
    let path = path.to_owned();
    move |source| LogRotateError::Io {
        action,
        path,
        source,
    }
}

/// `--container-log-max-size`, `--container-log-max-files`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogPolicy {
    pub max_size: u64,
    pub max_files: usize,
}

impl LogPolicy {
    /// The kubelet's validation: at least 2 files, a size above 0.
    pub fn new(max_size: u64, max_files: usize) -> Result<Self, LogRotateError> {
        if max_files < 2 {
            return Err(LogRotateError::Policy(format!(
                "--container-log-max-files must be at least 2, got {max_files}"
            )));
        }
        if max_size == 0 {
            return Err(LogRotateError::Policy(
                "--container-log-max-size must be above 0".into(),
            ));
        }
        Ok(Self {
            max_size,
            max_files,
        })
    }
}

/// The rotated files of `log` (`<log>.*`), oldest first.
pub fn rotated_files(log: &Path) -> Result<Vec<PathBuf>, LogRotateError> {
    let dir = log.parent().unwrap_or(Path::new("."));
    let prefix = format!("{}.", log.file_name().unwrap_or_default().to_string_lossy());
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io("read log directory", dir))?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    out.sort();
    Ok(out)
}

/// Steps 1-3 of a rotation of `log` (the module's list); the rotated files
/// left, oldest first.
pub fn prepare_rotation(log: &Path, policy: LogPolicy) -> Result<Vec<PathBuf>, LogRotateError> {
    let all = rotated_files(log)?;
    let name = |p: &PathBuf| p.to_string_lossy().into_owned();
    let mut kept = Vec::new();
    for p in &all {
        let n = name(p);
        let unused = n.ends_with(TMP_SUFFIX)
            || (!n.ends_with(COMPRESS_SUFFIX)
                && all.iter().any(|o| name(o) == n.clone() + COMPRESS_SUFFIX));
        if unused {
            std::fs::remove_file(p).map_err(io("remove unused log", p))?;
        } else {
            kept.push(p.clone());
        }
    }
    let excess = kept.len().saturating_sub(policy.max_files - 2);
    for p in kept.drain(..excess) {
        std::fs::remove_file(&p).map_err(io("remove excess log", &p))?;
    }
    for p in &mut kept {
        if !name(p).ends_with(COMPRESS_SUFFIX) {
            *p = compress(p)?;
        }
    }
    Ok(kept)
}

/// Gzips `log` into `<log>.gz` (through `<log>.tmp`) and removes it.
fn compress(log: &Path) -> Result<PathBuf, LogRotateError> {
    let tmp = PathBuf::from(format!("{}{TMP_SUFFIX}", log.display()));
    let out = PathBuf::from(format!("{}{COMPRESS_SUFFIX}", log.display()));
    let mut input = std::fs::File::open(log).map_err(io("open", log))?;
    let file = std::fs::File::create(&tmp).map_err(io("create", &tmp))?;
    let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
    std::io::copy(&mut input, &mut gz).map_err(io("compress", log))?;
    gz.finish()
        .and_then(|mut f| f.flush())
        .map_err(io("write", &tmp))?;
    std::fs::rename(&tmp, &out).map_err(io("rename", &tmp))?;
    std::fs::remove_file(log).map_err(io("remove", log))?;
    Ok(out)
}

/// Rotates `log` at `now`: [`prepare_rotation`], then the rename and
/// `reopen`; `Ok(None)` when the rotated name exists already.
pub async fn rotate_log<F, Fut>(
    log: &Path,
    policy: LogPolicy,
    now: Timestamp,
    reopen: F,
) -> Result<Option<PathBuf>, LogRotateError>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<(), LogRotateError>>,
{
    let stamp = now.strftime(TIMESTAMP_FORMAT).to_string();
    let rotated = PathBuf::from(format!("{}.{stamp}", log.display()));
    let gz = PathBuf::from(format!("{}{COMPRESS_SUFFIX}", rotated.display()));
    if rotated.exists() || gz.exists() {
        debug!(path = %rotated.display(), "rotated log name taken; next round");
        return Ok(None);
    }
    prepare_rotation(log, policy)?;
    std::fs::rename(log, &rotated).map_err(io("rename", log))?;
    if let Err(e) = reopen().await {
        if let Err(back) = std::fs::rename(&rotated, log) {
            warn!(path = %rotated.display(), error = %back, "cannot rename the rotated log back");
        }
        return Err(e);
    }
    Ok(Some(rotated))
}

/// The log path of each running container, learned once: a container's
/// `log_path` never changes, so only a container not seen before costs a
/// CRI `ContainerStatus`. `None`: the container has no log file.
#[derive(Debug, Default)]
pub struct LogPaths(HashMap<String, Option<PathBuf>>);

impl LogPaths {
    /// Forgets the containers not in `running` (the round's listing) and
    /// returns those of them whose path is not known yet.
    pub fn unknown<'a>(&mut self, running: &'a [String]) -> Vec<&'a str> {
        let live: HashSet<&str> = running.iter().map(String::as_str).collect();
        self.0.retain(|id, _| live.contains(id.as_str()));
        running
            .iter()
            .filter(|id| !self.0.contains_key(*id))
            .map(String::as_str)
            .collect()
    }

    /// Records container `id`'s log path as its status gave it (empty: none).
    pub fn learn(&mut self, id: &str, log_path: String) {
        let path = (!log_path.is_empty()).then(|| PathBuf::from(log_path));
        self.0.insert(id.to_owned(), path);
    }

    /// Container `id`'s log path, once learned and if it has one.
    pub fn get(&self, id: &str) -> Option<&Path> {
        self.0.get(id)?.as_deref()
    }
}

/// The manager.
#[derive(Clone, Debug)]
pub struct ContainerLogManager {
    pub cri: CriClient,
    pub policy: LogPolicy,
    pub interval: Duration,
}

impl ContainerLogManager {
    /// Rotates every `interval` until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut paths = LogPaths::default();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.rotate_logs(&mut paths).await {
                warn!(error = %e, "container log rotation");
            }
        }
    }

    /// One round over the running containers; `paths` carries their log
    /// paths from one round to the next.
    pub async fn rotate_logs(&self, paths: &mut LogPaths) -> Result<(), evpleg_cri::CriError> {
        let running = v1::ContainerFilter {
            state: Some(v1::ContainerStateValue {
                state: v1::ContainerState::ContainerRunning as i32,
            }),
            ..Default::default()
        };
        let ids: Vec<String> = (self.cri.list_containers(Some(running)).await?)
            .into_iter()
            .map(|c| c.id)
            .collect();
        for id in paths.unknown(&ids) {
            match self.cri.container_status(id, false).await {
                Ok(r) => paths.learn(id, r.status.map(|s| s.log_path).unwrap_or_default()),
                // Asked again next round.
                Err(e) => debug!(%id, error = %e, "no status for log rotation"),
            }
        }
        for id in &ids {
            let Some(path) = paths.get(id) else { continue };
            let reopen = || async {
                self.cri
                    .reopen_container_log(id)
                    .await
                    .map_err(|source| LogRotateError::Reopen {
                        id: id.clone(),
                        source,
                    })
            };
            let result = match std::fs::metadata(path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => reopen().await.map(|()| None),
                Err(e) => Err(io("stat", path)(e)),
                Ok(m) if m.len() < self.policy.max_size => Ok(None),
                Ok(_) => rotate_log(path, self.policy, Timestamp::now(), reopen).await,
            };
            match result {
                Ok(Some(rotated)) => {
                    debug!(%id, rotated = %rotated.display(), "log rotated")
                }
                Ok(None) => {}
                Err(e) => warn!(%id, error = %e, "container log rotation"),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;

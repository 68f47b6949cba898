//! Reading a container's CRI log file, as the kubelet's
//! `pkg/kubelet/kuberuntime/logs` (`ReadLogs`): each line of the file is
//! `<RFC 3339 time> <stdout|stderr> <P|F>[:tags] <content>`; a full line (`F`)
//! ends with a newline, partial ones (`P`) are written as they are. Options,
//! with the kubelet's meaning: `tail` (the last n lines of the file, partial
//! ones counted), `since` (lines older skipped), `limit_bytes` (the output
//! cut there, mid-line included), `timestamps` (each line prefixed with its
//! time in RFC 3339 with nanoseconds and trailing zeros cut), `follow` (at the
//! end of the file, wait for more while the container runs; a file replaced
//! at the same path, as rotation does, is read from its start). A line that
//! does not parse is skipped, as the kubelet does.
//!
//! Differences: the end of the file is polled every [`FOLLOW_POLL`] rather
//! than watched with inotify, and whether the container still runs is asked
//! every [`RUNNING_CHECK`] (the kubelet: on each file event, and every 5 s);
//! the docker JSON log format is not read.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use k8s_openapi::jiff::Timestamp;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncSeekExt, BufReader};
use tokio::sync::mpsc;

/// How often the end of a followed file is looked at again.
pub const FOLLOW_POLL: Duration = Duration::from_millis(100);
/// How often a followed container is asked whether it still runs.
pub const RUNNING_CHECK: Duration = Duration::from_secs(1);

/// Errors of reading a log file.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("failed to {action} log file {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What to read ([`read_logs`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub since: Option<Timestamp>,
    pub tail: Option<u64>,
    pub limit_bytes: Option<u64>,
    pub follow: bool,
    pub timestamps: bool,
}

/// One parsed line.
#[derive(Debug, PartialEq, Eq)]
pub struct LogLine<'a> {
    pub time: Timestamp,
    pub stream: &'a str,
    pub partial: bool,
    pub content: &'a [u8],
}

/// Parses one line of a CRI log file (without its newline).
pub fn parse_line(line: &[u8]) -> Option<LogLine<'_>> {
    let mut parts = line.splitn(4, |b| *b == b' ');
    let time = std::str::from_utf8(parts.next()?).ok()?.parse().ok()?;
    let stream = std::str::from_utf8(parts.next()?).ok()?;
    if stream != "stdout" && stream != "stderr" {
        return None;
    }
    let tags = parts.next()?;
    let partial = match tags.split(|b| *b == b':').next()? {
        b"P" => true,
        b"F" => false,
        _ => return None,
    };
    Some(LogLine {
        time,
        stream,
        partial,
        content: parts.next().unwrap_or_default(),
    })
}

/// The offset where the last `n` lines of `file` start, lines counted by
/// their newlines (a last line without one comes on top), as the kubelet's
/// `FindTailLineStartIndex`.
async fn tail_start(file: &mut tokio::fs::File, size: u64, n: u64) -> std::io::Result<u64> {
    const BLOCK: u64 = 64 << 10;
    let mut right = size;
    let mut count = 0u64;
    let mut buf = Vec::new();
    while right > 0 {
        let left = right.saturating_sub(BLOCK);
        let mut block = vec![0; (right - left) as usize];
        file.seek(std::io::SeekFrom::Start(left)).await?;
        file.read_exact(&mut block).await?;
        block.extend_from_slice(&buf);
        buf = block;
        count = buf.iter().filter(|b| **b == b'\n').count() as u64;
        right = left;
        if count > n {
            break;
        }
    }
    let mut start = right;
    let mut view = &buf[..];
    while count > n {
        let i = view
            .iter()
            .position(|b| *b == b'\n')
            .map_or(view.len(), |i| i + 1);
        view = &view[i..];
        start += i as u64;
        count -= 1;
    }
    Ok(start)
}

/// Writes the log lines of `path` chosen by `opts` to `out`, one message per
/// line, until the end (or, following, until `running` says the container
/// stopped and its file has no more), the byte limit, or `out` closing.
pub async fn read_logs<F, Fut>(
    path: &Path,
    opts: &LogOptions,
    out: mpsc::Sender<Bytes>,
    running: F,
) -> Result<(), LogError>
where
    F: Fn() -> Fut,
    Fut: Future<Output = bool>,
{
    let err = |action| {
        let path = path.to_owned();
        move |source| LogError::Io {
            action,
            path,
            source,
        }
    };
    let mut file = tokio::fs::File::open(path).await.map_err(err("open"))?;
    let meta = file.metadata().await.map_err(err("stat"))?;
    let mut inode = meta.ino();
    let start = match opts.tail {
        Some(n) => tail_start(&mut file, meta.len(), n)
            .await
            .map_err(err("seek in"))?,
        None => 0,
    };
    file.seek(std::io::SeekFrom::Start(start))
        .await
        .map_err(err("seek in"))?;
    let mut reader = BufReader::new(file);
    let mut left = opts.limit_bytes;
    let mut line = Vec::new();
    let mut last_check: Option<tokio::time::Instant> = None;
    let mut stopped = false;
    loop {
        reader
            .read_until(b'\n', &mut line)
            .await
            .map_err(err("read"))?;
        let complete = line.last() == Some(&b'\n');
        // The end of what is there: a trailing line without its newline is
        // written when nothing more is to come.
        let last = !complete && (!opts.follow || stopped);
        if complete || (last && !line.is_empty()) {
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            if let Some(mut message) = format_line(path, text, opts) {
                if let Some(l) = left.as_mut() {
                    let n = (*l).min(message.len() as u64);
                    message.truncate(n as usize);
                    *l -= n;
                }
                if !message.is_empty() && out.send(Bytes::from(message)).await.is_err() {
                    return Ok(());
                }
                if left == Some(0) {
                    return Ok(());
                }
            }
            line.clear();
        }
        if complete {
            continue;
        }
        if last || out.is_closed() {
            return Ok(());
        }
        // Following, at the end: the container stopped means one more read
        // (what it wrote before stopping), then the end.
        if last_check.is_none_or(|t| t.elapsed() >= RUNNING_CHECK) {
            last_check = Some(tokio::time::Instant::now());
            if !running().await {
                stopped = true;
                continue;
            }
        }
        tokio::time::sleep(FOLLOW_POLL).await;
        let replaced = tokio::fs::metadata(path)
            .await
            .is_ok_and(|m| m.ino() != inode);
        if replaced && line.is_empty() {
            let file = tokio::fs::File::open(path).await.map_err(err("reopen"))?;
            inode = file.metadata().await.map_err(err("stat"))?.ino();
            reader = BufReader::new(file);
        }
    }
}

/// The output of one line of the file: `None` for one that does not parse
/// or is older than `opts.since`.
fn format_line(path: &Path, text: &[u8], opts: &LogOptions) -> Option<Vec<u8>> {
    let Some(parsed) = parse_line(text) else {
        tracing::debug!(path = %path.display(), "skipped a log line that does not parse");
        return None;
    };
    if opts.since.is_some_and(|since| parsed.time < since) {
        return None;
    }
    let mut message = Vec::with_capacity(text.len() + 40);
    if opts.timestamps {
        message.extend_from_slice(parsed.time.to_string().as_bytes());
        message.push(b' ');
    }
    message.extend_from_slice(parsed.content);
    if !parsed.partial {
        message.push(b'\n');
    }
    Some(message)
}

#[cfg(test)]
mod tests;

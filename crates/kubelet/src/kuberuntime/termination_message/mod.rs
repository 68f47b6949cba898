//! Termination messages, as the kubelet's (`kuberuntime_container.go`):
//! before a container is created its `terminationMessagePath` gets an empty
//! file of its own on the node, mode 0666, bind-mounted there (`makeMounts`);
//! once the container exited the file is read, its last 4 KiB
//! (`getTerminationMessage`, `MaxContainerTerminationMessageLength`), and
//! with `terminationMessagePolicy: FallbackToLogsOnError` a failed
//! container's empty message is the tail of its log instead, the last 80
//! lines within 2 KiB (`readLastStringFromContainerLogs`). The message is
//! appended to the runtime's own (`toKubeContainerStatus`) and each is cut
//! to 12 KiB shared by the pod's containers (the status manager's
//! `normalizeStatus`). It shows as `state.terminated.message` (and
//! `lastState`'s).
//!
//! The file is `<root-dir>/pods/<uid>/containers/<name>/termination-log-<attempt>`
//! (the kubelet's pod container directory, with the attempt instead of a
//! random name: an attempt number is unique per container name in a pod),
//! removed with the pod's directory. The container carries the kubelet's
//! annotations for its path and policy, which are read back, so a changed
//! spec does not change how an old container's message is read.
//!
//! Differences: a cut falls on a character boundary, never inside a UTF-8
//! sequence (Go cuts bytes); a file that cannot be created is a warning and
//! no mount, as the kubelet's; the file and its directories are created
//! without following any symlink below the root directory (`openat2` with
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`), where the kubelet's
//! `os.MkdirAll` and `os.Create` follow them.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::{Container, Pod};
use tracing::warn;

use evpleg_core::container::{ContainerState, ContainerStatus, PodStatus};
use evpleg_core::ids::PodUid;

/// `MaxPodTerminationMessageLogLength`: all of a pod's messages.
pub const MAX_POD_MESSAGE: usize = 12 * 1024;
/// `MaxContainerTerminationMessageLength`: what is read of the file.
pub const MAX_CONTAINER_MESSAGE: u64 = 4 * 1024;
/// `MaxContainerTerminationMessageLogLength`: what is taken from the log.
pub const MAX_LOG_MESSAGE: usize = 2 * 1024;
/// `MaxContainerTerminationMessageLogLines`.
pub const MAX_LOG_LINES: usize = 80;
/// The API's default `terminationMessagePath`.
pub const DEFAULT_PATH: &str = "/dev/termination-log";
/// The policy that falls back to the log.
pub const FALLBACK_TO_LOGS_ON_ERROR: &str = "FallbackToLogsOnError";
/// The kubelet's container annotations.
pub const PATH_ANNOTATION: &str = "io.kubernetes.container.terminationMessagePath";
pub const POLICY_ANNOTATION: &str = "io.kubernetes.container.terminationMessagePolicy";

#[derive(Debug, thiserror::Error)]
pub enum TerminationMessageError {
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TerminationMessageError {
    let path = path.to_path_buf();
    move |source| TerminationMessageError::Io {
        action,
        path,
        source,
    }
}

/// The node's file of the `attempt`-th instance of container `name`.
pub fn host_path(root_dir: &Path, uid: &PodUid, name: &str, attempt: u32) -> PathBuf {
    crate::network::hosts::pod_dir(root_dir, uid.as_str())
        .join("containers")
        .join(name)
        .join(format!("termination-log-{attempt}"))
}

/// The container's path, unset being the API's default.
fn spec_path(c: &Container) -> &str {
    c.termination_message_path
        .as_deref()
        .unwrap_or(DEFAULT_PATH)
}

/// The annotations the container is created with.
pub fn annotations(c: &Container) -> [(String, String); 2] {
    [
        (PATH_ANNOTATION.to_owned(), spec_path(c).to_owned()),
        (
            POLICY_ANNOTATION.to_owned(),
            c.termination_message_policy
                .clone()
                .unwrap_or_else(|| "File".to_owned()),
        ),
    ]
}

/// Creates the (empty) file and returns its mount (the kubelet's
/// `makeMounts`); `None` with an empty path, or when the file cannot be made
/// (logged, as the kubelet's).
pub fn prepare(root_dir: &Path, uid: &PodUid, c: &Container, attempt: u32) -> Option<v1::Mount> {
    let path = spec_path(c);
    if path.is_empty() {
        return None;
    }
    let file = host_path(root_dir, uid, &c.name, attempt);
    match create(root_dir, &file) {
        Ok(()) => Some(v1::Mount {
            container_path: path.to_owned(),
            host_path: file.to_string_lossy().into_owned(),
            ..Default::default()
        }),
        Err(e) => {
            warn!(pod = %uid, container = %c.name, error = %e, "termination-log file not created");
            None
        }
    }
}

/// Creates the empty file `file` under `root_dir`, mode 0666 whatever the
/// umask (any user of the container may write it), its missing
/// directories 0750, following no symlink below `root_dir`: one planted in
/// the pod's directory fails the creation, nothing is made elsewhere.
fn create(root_dir: &Path, file: &Path) -> Result<(), TerminationMessageError> {
    let rel = file.strip_prefix(root_dir).unwrap_or(file);
    evpleg_volume::subpath::create_file_no_symlinks(root_dir, rel, 0o750, 0o666)
        .map_err(io("create", file))
}

/// Where a container's log is: its pod's log directory, then its file, as the
/// sandbox and container configs name them.
pub fn log_path(log_dir: &Path, pod: &Pod, uid: &PodUid, name: &str, attempt: u32) -> PathBuf {
    use super::cri_config::{container_log_file, pod_log_dir};
    pod_log_dir(log_dir, pod, uid).join(container_log_file(name, attempt))
}

/// The termination message of an exited container (the kubelet's
/// `getTerminationMessage`, then `readLastStringFromContainerLogs` when it
/// falls back to the log); empty when there is none.
pub fn read(s: &ContainerStatus, file: &Path, log: &Path) -> String {
    let policy = s.annotations.get(POLICY_ANNOTATION).map(String::as_str);
    let path = s.annotations.get(PATH_ANNOTATION).map(String::as_str);
    let fallback = policy == Some(FALLBACK_TO_LOGS_ON_ERROR)
        && s.exit_code != Some(0)
        && s.reason != "ContainerCannotRun";
    let (message, check_logs) = match path {
        None | Some("") => (String::new(), fallback),
        Some(_) => match tail(file, MAX_CONTAINER_MESSAGE) {
            Ok(data) => {
                let text = String::from_utf8_lossy(&data).into_owned();
                let empty = text.is_empty();
                (text, fallback && empty)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (String::new(), fallback),
            Err(e) => (
                format!("Error on reading termination log {}: {e}", file.display()),
                false,
            ),
        },
    };
    if check_logs {
        return match last_log_lines(log) {
            Ok(text) => text,
            Err(e) => format!("Error on reading termination message from logs: {e}"),
        };
    }
    message
}

/// The last `max` bytes of `path` (the kubelet's `tail.ReadAtMost`).
fn tail(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(max)))?;
    let mut out = Vec::new();
    f.take(max).read_to_end(&mut out)?;
    Ok(out)
}

/// The content of the log's last [`MAX_LOG_LINES`] lines (CRI format:
/// `<time> <stream> <P|F> <content>`, a full line ending in a newline),
/// its last [`MAX_LOG_MESSAGE`] bytes.
fn last_log_lines(path: &Path) -> std::io::Result<String> {
    // The last 2 KiB of content of at most 80 lines lie within this.
    const WINDOW: u64 = 16 * 1024;
    let data = tail(path, WINDOW)?;
    let whole = std::fs::metadata(path)?.len() <= WINDOW;
    let text = String::from_utf8_lossy(&data);
    let mut lines: Vec<&str> = text.lines().collect();
    if !whole && !lines.is_empty() {
        // The first line is cut.
        lines.remove(0);
    }
    let start = lines.len().saturating_sub(MAX_LOG_LINES);
    let mut out = String::new();
    for line in &lines[start..] {
        let mut parts = line.splitn(4, ' ');
        let (_time, _stream, tag) = (parts.next(), parts.next(), parts.next());
        out.push_str(parts.next().unwrap_or_default());
        if tag != Some("P") {
            out.push('\n');
        }
    }
    Ok(last_bytes(&out, MAX_LOG_MESSAGE).to_owned())
}

/// The end of `s`, at most `max` bytes, from a character boundary.
fn last_bytes(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// The start of `s`, at most `max` bytes, to a character boundary.
fn first_bytes(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Adds the termination messages of `status`'s exited containers to their
/// runtime messages, each cut to the pod's share of 12 KiB.
pub fn add_messages(
    pod: &Pod,
    uid: &PodUid,
    status: &mut PodStatus,
    root_dir: &Path,
    log_dir: &Path,
) {
    let spec = pod.spec.as_ref();
    let containers = spec
        .map(|s| s.containers.len() + s.init_containers.as_ref().map_or(0, Vec::len))
        .unwrap_or(0);
    let share = MAX_POD_MESSAGE / containers.max(1);
    for c in status.containers.iter_mut() {
        if c.state != ContainerState::Exited {
            continue;
        }
        let file = host_path(root_dir, uid, &c.name, c.attempt);
        let log = log_path(log_dir, pod, uid, &c.name, c.attempt);
        let message = read(c, &file, &log);
        if !message.is_empty() {
            if !c.message.is_empty() {
                c.message.push_str(": ");
            }
            c.message.push_str(&message);
        }
        if c.message.len() > share {
            c.message = first_bytes(&c.message, share).to_owned();
        }
    }
}

#[cfg(test)]
mod tests;

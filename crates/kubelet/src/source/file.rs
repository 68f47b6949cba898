//! Static pods from a manifest directory, watched with inotify (the kubelet's
//! `pkg/kubelet/config/file.go` and `file_linux.go`).
//!
//! Every regular file in the directory (not in subdirectories) holds one or more pod
//! manifests, YAML or JSON, separated by `---` (YAML) or concatenated (JSON); a
//! document may also be a `PodList`. A number with a leading zero is octal
//! (`defaultMode: 0644`), as the kubelet's `sigs.k8s.io/yaml` (YAML 1.1) reads
//! it ([`yaml_options`]). Dotfiles and editor leftovers (`foo~`, `#foo#`,
//! `*.swp`, `*.swo`, `*.swx`, `*.tmp`) are ignored, as the kubelet ignores files whose
//! name starts with `.`. A symlink to a file is followed, but only changes to the
//! link itself are watched.
//!
//! On start, on every change and after an inotify queue overflow the source sends a
//! [`Op::Set`] with every pod of every valid file, in file-name order (the kubelet's
//! file source also sends full snapshots); the [`mux`](super::mux) turns the sets into
//! adds and removes. A set is sent only when the pods changed, and always once after
//! the directory was (re)read, so that the source counts as seen.
//!
//! # Invalid manifests
//! A file that does not parse, or holds a document that is not a valid pod, gives an
//! [`Error`] naming the file and the document (counted from 1), logged at warn and
//! kept in [`FileSource::errors`] until the file parses again or goes away. **The last
//! good pods of such a file are kept** until it parses again or is removed: an editor's
//! half-written save, or a typo, must not kill a running static pod. All other files'
//! pods are untouched. A new empty file is ignored until it has content (creating a
//! file and writing it are separate events); an existing file emptied is an error.
//!
//! # Static pod defaults (the kubelet's `applyDefaults`)
//! - UID, when the manifest has none: SHA-256 over `host:<node>`, `file:<path>` (or
//!   `url:<url>`) and the decoded pod as JSON, truncated to 16 bytes, as 32 hex digits.
//!   A changed manifest is therefore a new pod. The kubelet uses MD5 over the same
//!   prefixes and its own deep hash of the object after API defaulting (and no host for
//!   URLs), so UIDs differ from the kubelet's; they are stable across evpleg restarts.
//! - name suffixed with `-<node name in lowercase>`, namespace `default` when empty,
//!   `spec.nodeName` the node;
//! - annotations `kubernetes.io/config.hash` (the UID), `config.source` (`file` or
//!   `http`), `config.seen` (first read, RFC 3339 in UTC, kept while the UID stays);
//! - `restartPolicy: Always`, `terminationGracePeriodSeconds: 30` and each
//!   container's `imagePullPolicy` (Always for `:latest` or no tag, IfNotPresent
//!   otherwise) when unset (the only API defaults applied), `status.phase:
//!   Pending`, and for files the toleration of every `NoExecute` taint;
//! - validated: a `metadata.uid` (when given) the agent can use
//!   as a pod UID (hex digits and `-`, as cgroup and label names need it), at least one
//!   container, the names that become paths as the API server validates them
//!   ([`crate::admission::validation`]: name, namespace, unique container and
//!   volume names, mounts of the pod's volumes, subPaths), every container with
//!   an image and a known `imagePullPolicy` when it has one; no two pods of one
//!   file with the same name (a subset of the kubelet's `ValidatePod`). A pod whose
//!   name an earlier file (in name order) already has is left out, with an error on
//!   the later file naming both files (the kubelet drops such a duplicate too).
//!
//! If the directory is missing (or removed), an empty set is sent and the source
//! retries every second, backing off to 20 s, as the kubelet does.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsStr;
use std::future::poll_fn;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use inotify::{EventMask, Inotify, Stream, StreamExt, WatchMask};
use k8s_openapi::api::core::v1::{Pod, PodStatus, Toleration};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::{Op, PodUpdate, SourceName, annotations};

/// The result of the file source.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The first retry after the directory could not be watched; doubled up to
/// [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(20);

/// What went wrong with the manifest directory or one manifest. None stops the
/// source: a bad manifest waits for its next change, a directory error is retried.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// cannot read manifest {path}: {source}
    #[error("cannot read manifest {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// manifest {path}, document {index}: {source}
    #[error("manifest {path}, document {index}: {source}")]
    Document {
        path: PathBuf,
        /// The document, counted from 1.
        index: usize,
        source: DecodeError,
    },
    /// manifest {path} holds no pod
    #[error("manifest {path} holds no pod")]
    Empty { path: PathBuf },
    /// cannot list manifest directory {dir}: {source}
    #[error("cannot list manifest directory {dir}: {source}")]
    ReadDir { dir: PathBuf, source: io::Error },
    /// cannot watch manifest directory {dir}: {source}
    #[error("cannot watch manifest directory {dir}: {source}")]
    Watch { dir: PathBuf, source: io::Error },
    /// manifest directory {dir} was removed or moved away
    #[error("manifest directory {dir} was removed or moved away")]
    DirectoryGone { dir: PathBuf },
    /// manifest {path}: pod {pod} is already defined by manifest {first}; ignored
    #[error("manifest {path}: pod {pod} is already defined by manifest {first}; ignored")]
    DuplicateName {
        path: PathBuf,
        pod: String,
        first: PathBuf,
    },
}

/// Why one manifest document (of a file or a URL) is not a pod evpleg can run.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// invalid yaml: {0}
    #[error("invalid yaml: {0}")]
    Yaml(String),
    /// invalid json: {0}
    #[error("invalid json: {0}")]
    Json(serde_json::Error),
    /// the manifest is not utf-8
    #[error("the manifest is not utf-8")]
    NotUtf8,
    /// not an object with a kind
    #[error("not an object with a kind")]
    NoKind,
    /// kind {0:?} is neither Pod nor PodList
    #[error("kind {0:?} is neither Pod nor PodList")]
    Kind(String),
    /// not a valid v1 pod: {0}
    #[error("not a valid v1 pod: {0}")]
    Pod(serde_json::Error),
    /// invalid pod: {0}
    #[error("invalid pod: {0}")]
    Invalid(String),
}

/// Where static pods come from, for their defaults and UID.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Origin<'a> {
    pub source: SourceName,
    /// The file's path or the URL.
    pub location: &'a str,
    pub node_name: &'a str,
}

/// How a manifest's YAML is read: as the kubelet's `sigs.k8s.io/yaml` (YAML
/// 1.1) reads it, where a number with a leading zero is octal (`defaultMode:
/// 0644` is 420). YAML 1.2, serde-saphyr's default, read it as 644 (as a
/// float), and the manifest was refused.
pub fn yaml_options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.legacy_octal_numbers = true;
    options
}

/// Decodes every document of a manifest into pods (a `PodList` gives several), with
/// the index of its document (from 1), or the first document that fails.
pub fn decode(data: &[u8]) -> Result<Vec<(usize, Pod)>, (usize, DecodeError)> {
    let text = std::str::from_utf8(data).map_err(|_| (1, DecodeError::NotUtf8))?;
    let mut values = Vec::new();
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        // JSON: one or more concatenated values.
        for (i, value) in serde_json::Deserializer::from_str(text)
            .into_iter::<serde_json::Value>()
            .enumerate()
        {
            values.push(value.map_err(|e| (i + 1, DecodeError::Json(e)))?);
        }
    } else {
        let mut reader = io::Cursor::new(data);
        let values_read =
            serde_saphyr::read_with_options::<_, serde_json::Value>(&mut reader, yaml_options());
        for (i, value) in values_read.enumerate() {
            values.push(
                value.map_err(|e| (i + 1, DecodeError::Yaml(e.without_snippet().to_string())))?,
            );
        }
    }
    let mut pods = Vec::new();
    for (i, value) in values.into_iter().enumerate() {
        let index = i + 1;
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .map(str::to_owned);
        match kind.as_deref() {
            Some("Pod") => pods.push((index, to_pod(value).map_err(|e| (index, e))?)),
            Some("PodList") | Some("List") => {
                let items = match value.get("items") {
                    None | Some(serde_json::Value::Null) => Vec::new(),
                    Some(serde_json::Value::Array(items)) => items.clone(),
                    Some(_) => {
                        return Err((index, DecodeError::Invalid("items is not a list".into())));
                    }
                };
                for mut item in items {
                    // Items of a list may leave out their kind and apiVersion.
                    if let Some(obj) = item.as_object_mut() {
                        obj.entry("kind").or_insert_with(|| "Pod".into());
                        obj.entry("apiVersion").or_insert_with(|| "v1".into());
                    }
                    pods.push((index, to_pod(item).map_err(|e| (index, e))?));
                }
            }
            Some(other) => return Err((index, DecodeError::Kind(other.to_owned()))),
            None => return Err((index, DecodeError::NoKind)),
        }
    }
    Ok(pods)
}

fn to_pod(value: serde_json::Value) -> Result<Pod, DecodeError> {
    if value.get("apiVersion").is_none() {
        return Err(DecodeError::Invalid("apiVersion is required".into()));
    }
    serde_json::from_value(value).map_err(DecodeError::Pod)
}

/// Checks what a static pod needs (a subset of the kubelet's `ValidatePod`), before
/// defaults.
fn validate(pod: &Pod) -> Result<(), DecodeError> {
    let invalid = |s: String| Err(DecodeError::Invalid(s));
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    if name.is_empty() {
        return invalid("metadata.name is required".into());
    }
    if !evpleg_core::names::is_dns_subdomain(name) {
        return invalid(format!(
            "metadata.name {name:?} is not a lowercase DNS subdomain"
        ));
    }
    if let Some(uid) = pod.metadata.uid.as_deref().filter(|u| !u.is_empty())
        && evpleg_core::ids::PodUid::parse(uid).is_none()
    {
        return invalid(format!(
            "metadata.uid {uid:?} is not usable: a pod UID is hex digits with '-' separators, at most 64 characters (leave it out to have one derived from the manifest)"
        ));
    }
    let Some(spec) = &pod.spec else {
        return invalid("spec is required".into());
    };
    if spec.containers.is_empty() {
        return invalid("spec.containers is required".into());
    }
    // The names that become paths (the API server's ValidatePod for them).
    let errors = crate::admission::validation::validate(pod);
    if !errors.is_empty() {
        return invalid(errors.join("; "));
    }
    let all = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers);
    for c in all {
        if c.image.as_deref().unwrap_or_default().is_empty() {
            return invalid(format!("container {:?} has no image", c.name));
        }
        if let Some(policy) = c.image_pull_policy.as_deref().filter(|p| !p.is_empty())
            && let Err(e) = crate::kuberuntime::images::PullPolicy::parse(policy)
        {
            return invalid(format!("container {:?}: {e}", c.name));
        }
    }
    Ok(())
}

/// The static pod UID: SHA-256 over the origin and the decoded pod, 32 hex digits.
pub(crate) fn static_uid(pod: &Pod, origin: Origin<'_>) -> String {
    let mut hasher = Sha256::new();
    hasher.update(format!("host:{}", origin.node_name));
    match origin.source {
        SourceName::Http => hasher.update(format!("url:{}", origin.location)),
        _ => hasher.update(format!("file:{}", origin.location)),
    }
    // Serialising a Pod cannot fail: it has only string keys.
    hasher.update(serde_json::to_vec(pod).unwrap_or_default());
    let digest = hasher.finalize();
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// Applies the kubelet's static pod defaults (see the module docs) to a validated pod;
/// `seen` is its `config.seen`.
fn apply_static_defaults(pod: &mut Pod, origin: Origin<'_>, seen: &str) {
    if pod.metadata.uid.as_deref().unwrap_or_default().is_empty() {
        pod.metadata.uid = Some(static_uid(pod, origin));
    }
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let meta = &mut pod.metadata;
    let name = meta.name.as_deref().unwrap_or_default();
    meta.name = Some(format!("{name}-{}", origin.node_name.to_lowercase()));
    if meta.namespace.as_deref().unwrap_or_default().is_empty() {
        meta.namespace = Some("default".into());
    }
    let annots = meta.annotations.get_or_insert_with(Default::default);
    annots.insert(annotations::CONFIG_HASH.into(), uid);
    annots.insert(
        annotations::CONFIG_SOURCE.into(),
        origin.source.as_str().into(),
    );
    annots.insert(annotations::CONFIG_SEEN.into(), seen.into());

    let spec = pod.spec.get_or_insert_with(Default::default);
    spec.node_name = Some(origin.node_name.into());
    spec.restart_policy.get_or_insert_with(|| "Always".into());
    spec.termination_grace_period_seconds.get_or_insert(30);
    crate::kuberuntime::images::apply_default_pull_policies(spec);
    if origin.source == SourceName::File {
        let tolerate_no_execute = Toleration {
            operator: Some("Exists".into()),
            effect: Some("NoExecute".into()),
            ..Default::default()
        };
        let tolerations = spec.tolerations.get_or_insert_with(Default::default);
        if !tolerations.contains(&tolerate_no_execute) {
            tolerations.push(tolerate_no_execute);
        }
    }
    pod.status.get_or_insert_with(PodStatus::default).phase = Some("Pending".into());
}

/// Decodes a manifest and applies static pod defaults to each pod. Pods whose UID is
/// in `previous` keep that pod's `config.seen`. Errors name the document (from 1).
pub(crate) fn load_static_pods(
    data: &[u8],
    origin: Origin<'_>,
    previous: &[Arc<Pod>],
) -> Result<Vec<Arc<Pod>>, (usize, DecodeError)> {
    let now = super::mux::now();
    let mut names = HashSet::new();
    let mut pods = Vec::new();
    for (index, mut pod) in decode(data)? {
        validate(&pod).map_err(|e| (index, e))?;
        if pod.metadata.uid.as_deref().unwrap_or_default().is_empty() {
            pod.metadata.uid = Some(static_uid(&pod, origin));
        }
        // A pod seen before keeps its first-seen time.
        let seen = previous
            .iter()
            .find(|p| p.metadata.uid == pod.metadata.uid)
            .and_then(|p| {
                p.metadata
                    .annotations
                    .as_ref()?
                    .get(annotations::CONFIG_SEEN)
            })
            .unwrap_or(&now);
        apply_static_defaults(&mut pod, origin, seen);
        let full = format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default()
        );
        if !names.insert(full.clone()) {
            return Err((
                index,
                DecodeError::Invalid(format!("pod {full} is defined twice")),
            ));
        }
        pods.push(Arc::new(pod));
    }
    Ok(pods)
}

/// Whether a directory entry may be a manifest: not a dotfile, not an editor's backup,
/// swap or temporary file.
pub fn is_manifest_name(name: &OsStr) -> bool {
    let name = name.to_string_lossy();
    !(name.is_empty()
        || name.starts_with('.')
        || name.ends_with('~')
        || (name.starts_with('#') && name.ends_with('#'))
        || [".swp", ".swo", ".swx", ".tmp"]
            .iter()
            .any(|s| name.ends_with(s)))
}

/// One manifest file: the bytes last read (valid or not) and its last good pods.
#[derive(Debug)]
struct FileState {
    data: Vec<u8>,
    pods: Vec<Arc<Pod>>,
}

/// The manifest directory source. Create it, keep [`FileSource::subscribe_errors`] if
/// the errors are wanted, then spawn [`FileSource::run`].
#[derive(Debug)]
pub struct FileSource {
    dir: PathBuf,
    node_name: String,
    files: BTreeMap<PathBuf, FileState>,
    errors: watch::Sender<BTreeMap<PathBuf, Arc<Error>>>,
    /// The pods of the last set sent, to send only changes.
    last_sent: Option<Vec<Arc<Pod>>>,
}

impl FileSource {
    pub fn new(dir: impl Into<PathBuf>, node_name: impl Into<String>) -> Self {
        Self {
            dir: dir.into(),
            node_name: node_name.into(),
            files: BTreeMap::new(),
            errors: watch::Sender::new(BTreeMap::new()),
            last_sent: None,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The current problems, by manifest path (or the directory's path).
    pub fn errors(&self) -> BTreeMap<PathBuf, Arc<Error>> {
        self.errors.borrow().clone()
    }

    /// The current problems, by path, as they change; usable after `run` took `self`.
    pub fn subscribe_errors(&self) -> watch::Receiver<BTreeMap<PathBuf, Arc<Error>>> {
        self.errors.subscribe()
    }

    /// Every pod of every file that parsed at least once, in file-name order.
    pub fn pods(&self) -> Vec<Arc<Pod>> {
        self.files
            .values()
            .flat_map(|f| f.pods.iter().cloned())
            .collect()
    }

    fn set_error(&self, path: &Path, error: Option<Error>) {
        self.errors.send_if_modified(|errors| match error {
            Some(e) => {
                warn!(path = %path.display(), "{e}");
                errors.insert(path.to_owned(), Arc::new(e));
                true
            }
            None => errors.remove(path).is_some(),
        });
    }

    fn forget(&mut self, path: &Path) {
        if self.files.remove(path).is_some() {
            info!(path = %path.display(), "static pod manifest removed");
        }
        self.set_error(path, None);
    }

    /// Re-reads the whole directory: new and changed files are loaded, vanished ones
    /// forgotten.
    pub async fn rescan(&mut self) -> Result<()> {
        let read_dir_err = |source| Error::ReadDir {
            dir: self.dir.clone(),
            source,
        };
        let mut entries = match tokio::fs::read_dir(&self.dir).await {
            Ok(entries) => entries,
            Err(e) => return Err(read_dir_err(e)),
        };
        let mut present = Vec::new();
        loop {
            match entries.next_entry().await {
                Ok(Some(entry)) if is_manifest_name(&entry.file_name()) => {
                    present.push(entry.path())
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => return Err(read_dir_err(e)),
            }
        }
        let gone: Vec<PathBuf> = self
            .files
            .keys()
            .chain(self.errors.borrow().keys())
            .filter(|p| **p != self.dir && !present.contains(p))
            .cloned()
            .collect();
        for path in gone {
            self.forget(&path);
        }
        present.sort();
        for path in present {
            self.refresh(&path).await;
        }
        Ok(())
    }

    /// Brings one path up to date: loads it if it is a regular file (or a link to one),
    /// forgets it if it is gone or something else.
    pub async fn refresh(&mut self, path: &Path) {
        let meta = match tokio::fs::metadata(path).await {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return self.forget(path),
            Err(source) => {
                let error = Error::Read {
                    path: path.to_owned(),
                    source,
                };
                return self.set_error(path, Some(error));
            }
        };
        if !meta.is_file() {
            if meta.is_dir() {
                debug!(path = %path.display(), "not recursing into a manifest subdirectory");
            }
            return self.forget(path);
        }
        if meta.len() == 0 && !self.files.contains_key(path) {
            // Created and not written yet: the write's close brings it back.
            return;
        }
        let data = match tokio::fs::read(path).await {
            Ok(data) => data,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return self.forget(path),
            Err(source) => {
                let error = Error::Read {
                    path: path.to_owned(),
                    source,
                };
                return self.set_error(path, Some(error));
            }
        };
        self.load(path, data);
    }

    /// Parses a file's new content; keeps the last good pods when it is invalid.
    fn load(&mut self, path: &Path, data: Vec<u8>) {
        if self.files.get(path).is_some_and(|f| f.data == data) {
            return;
        }
        let location = path.to_string_lossy();
        let origin = Origin {
            source: SourceName::File,
            location: &location,
            node_name: &self.node_name,
        };
        let previous = self
            .files
            .get(path)
            .map(|f| f.pods.as_slice())
            .unwrap_or_default();
        let result = match load_static_pods(&data, origin, previous) {
            Ok(pods) if pods.is_empty() => Err(Error::Empty {
                path: path.to_owned(),
            }),
            Ok(pods) => Ok(pods),
            Err((index, source)) => Err(Error::Document {
                path: path.to_owned(),
                index,
                source,
            }),
        };
        let state = self
            .files
            .entry(path.to_owned())
            .or_insert_with(|| FileState {
                data: Vec::new(),
                pods: Vec::new(),
            });
        state.data = data;
        match result {
            Ok(pods) => {
                info!(path = %path.display(), pods = pods.len(), "static pod manifest loaded");
                state.pods = pods;
                self.set_error(path, None);
            }
            Err(e) => {
                if !state.pods.is_empty() {
                    warn!(path = %path.display(), pods = state.pods.len(), "keeping the last good pods of the manifest");
                }
                self.set_error(path, Some(e));
            }
        }
    }

    /// The pods to send: every file's, in file-name order, without a pod whose
    /// name an earlier file already has; each such file gets an error naming
    /// both files (and loses it when the conflict is gone).
    fn unique_pods(&self) -> Vec<Arc<Pod>> {
        let mut first: BTreeMap<String, &Path> = BTreeMap::new();
        let mut duplicates: BTreeMap<PathBuf, Error> = BTreeMap::new();
        let mut pods = Vec::new();
        for (path, file) in &self.files {
            for pod in &file.pods {
                let name = format!(
                    "{}/{}",
                    pod.metadata.namespace.as_deref().unwrap_or_default(),
                    pod.metadata.name.as_deref().unwrap_or_default()
                );
                match first.get(&name) {
                    Some(earlier) if *earlier != path.as_path() => {
                        duplicates
                            .entry(path.clone())
                            .or_insert(Error::DuplicateName {
                                path: path.clone(),
                                pod: name,
                                first: earlier.to_path_buf(),
                            });
                    }
                    _ => {
                        first.insert(name, path);
                        pods.push(pod.clone());
                    }
                }
            }
        }
        let stale: Vec<PathBuf> = self
            .errors
            .borrow()
            .iter()
            .filter(|(p, e)| {
                matches!(***e, Error::DuplicateName { .. }) && !duplicates.contains_key(*p)
            })
            .map(|(p, _)| p.clone())
            .collect();
        for path in stale {
            self.set_error(&path, None);
        }
        for (path, error) in duplicates {
            let known = self
                .errors
                .borrow()
                .get(&path)
                .is_some_and(|e| e.to_string() == error.to_string());
            if !known {
                self.set_error(&path, Some(error));
            }
        }
        pods
    }

    /// Sends the current pods as a set if they changed since the last one sent (or
    /// none was sent). Returns false when the receiver is gone.
    async fn send_if_changed(&mut self, out: &mpsc::Sender<PodUpdate>) -> bool {
        let pods = self.unique_pods();
        let unchanged = self.last_sent.as_ref().is_some_and(|last| {
            last.len() == pods.len() && last.iter().zip(&pods).all(|(a, b)| Arc::ptr_eq(a, b))
        });
        if unchanged {
            return true;
        }
        self.last_sent = Some(pods.clone());
        let update = PodUpdate {
            op: Op::Set,
            source: SourceName::File,
            pods,
        };
        out.send(update).await.is_ok()
    }

    /// Watches the directory and sends sets to `out` until `out`'s receiver is gone.
    pub async fn run(mut self, out: mpsc::Sender<PodUpdate>) {
        let mut retry = RETRY_MIN;
        loop {
            match self.watch(&out, &mut retry).await {
                Ok(()) => return,
                Err(e) => {
                    let dir = self.dir.clone();
                    self.set_error(&dir, Some(e));
                }
            }
            if !tokio::fs::try_exists(&self.dir).await.unwrap_or(true) {
                // As the kubelet: no directory, no static pods (and the source is seen).
                for path in self.files.keys().cloned().collect::<Vec<_>>() {
                    self.forget(&path);
                }
                if !self.send_if_changed(&out).await {
                    return;
                }
            }
            tokio::select! {
                () = tokio::time::sleep(retry) => {}
                () = out.closed() => return,
            }
            retry = (retry * 2).min(RETRY_MAX);
        }
    }

    /// One inotify session: watch, read everything, then follow the events. Returns
    /// Ok when `out`'s receiver is gone, an error when the watch ended.
    async fn watch(&mut self, out: &mpsc::Sender<PodUpdate>, retry: &mut Duration) -> Result<()> {
        let watch_err = |dir: &Path, source| Error::Watch {
            dir: dir.to_owned(),
            source,
        };
        let inotify = Inotify::init().map_err(|e| watch_err(&self.dir, e))?;
        let mask = WatchMask::CREATE
            | WatchMask::CLOSE_WRITE
            | WatchMask::ATTRIB
            | WatchMask::MOVED_TO
            | WatchMask::MOVED_FROM
            | WatchMask::DELETE
            | WatchMask::DELETE_SELF
            | WatchMask::MOVE_SELF
            | WatchMask::ONLYDIR;
        inotify
            .watches()
            .add(&self.dir, mask)
            .map_err(|e| watch_err(&self.dir, e))?;
        let mut events = inotify
            .into_event_stream(vec![0u8; 16 * 1024])
            .map_err(|e| watch_err(&self.dir, e))?;
        // Watch first, then read: nothing changed in between is missed.
        self.rescan().await?;
        info!(dir = %self.dir.display(), pods = self.files.values().map(|f| f.pods.len()).sum::<usize>(), "watching static pod manifests");
        let dir = self.dir.clone();
        self.set_error(&dir, None);
        *retry = RETRY_MIN;
        // The first set after (re)reading the directory always goes out.
        self.last_sent = None;
        if !self.send_if_changed(out).await {
            return Ok(());
        }

        loop {
            let first = tokio::select! {
                event = events.next() => event,
                () = out.closed() => return Ok(()),
            };
            // Take every event already queued, then act once.
            let mut batch = vec![first];
            while let Some(event) = poll_fn(|cx| match Pin::new(&mut events).poll_next(cx) {
                Poll::Ready(event) => Poll::Ready(Some(event)),
                Poll::Pending => Poll::Ready(None),
            })
            .await
            {
                batch.push(event);
            }
            let mut rescan = false;
            let mut dirty = Vec::new();
            for event in batch {
                let event = match event {
                    Some(Ok(event)) => event,
                    Some(Err(e)) => return Err(watch_err(&self.dir, e)),
                    None => return Err(watch_err(&self.dir, io::ErrorKind::UnexpectedEof.into())),
                };
                if event.mask.contains(EventMask::Q_OVERFLOW) {
                    warn!(dir = %self.dir.display(), "inotify queue overflow: reading the whole manifest directory");
                    rescan = true;
                } else if event
                    .mask
                    .intersects(EventMask::DELETE_SELF | EventMask::MOVE_SELF | EventMask::IGNORED)
                {
                    return Err(Error::DirectoryGone {
                        dir: self.dir.clone(),
                    });
                } else if let Some(name) = event.name.filter(|n| is_manifest_name(n)) {
                    let path = self.dir.join(name);
                    if !dirty.contains(&path) {
                        dirty.push(path);
                    }
                }
            }
            if rescan {
                self.rescan().await?;
            } else {
                for path in dirty {
                    self.refresh(&path).await;
                }
            }
            if !self.send_if_changed(out).await {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    const WAIT: Duration = Duration::from_secs(10);

    /// A directory removed on drop.
    fn temp_dir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("evpleg-file-source-")
            .tempdir()
            .expect("create the temp dir")
    }

    fn manifest(name: &str, image: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\nspec:\n  containers:\n  - name: c\n    image: {image}\n"
        )
    }

    /// Writes like an editor that saves in place: the inotify events are
    /// CLOSE_WRITE (and CREATE for a new file).
    fn write(path: &Path, text: &str) {
        std::fs::write(path, text).expect("write the manifest");
    }

    struct Running {
        rx: mpsc::Receiver<PodUpdate>,
        errors: watch::Receiver<BTreeMap<PathBuf, Arc<Error>>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Running {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    fn start(dir: &Path) -> Running {
        let (tx, rx) = mpsc::channel(64);
        let source = FileSource::new(dir, "Node-1");
        let errors = source.subscribe_errors();
        let task = tokio::spawn(source.run(tx));
        Running { rx, errors, task }
    }

    fn names(update: &PodUpdate) -> Vec<String> {
        update
            .pods
            .iter()
            .map(|p| p.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    impl Running {
        async fn next(&mut self) -> PodUpdate {
            let update = tokio::time::timeout(WAIT, self.rx.recv())
                .await
                .expect("a set within the timeout")
                .expect("the source is running");
            assert_eq!((update.op, update.source), (Op::Set, SourceName::File));
            update
        }

        /// Waits for the set whose pods have exactly `want` as names.
        async fn until(&mut self, want: &[&str]) -> PodUpdate {
            loop {
                let update = self.next().await;
                if names(&update) == want {
                    return update;
                }
            }
        }

        async fn error_for(&mut self, path: &Path) -> Arc<Error> {
            let errors = tokio::time::timeout(WAIT, self.errors.wait_for(|e| e.contains_key(path)))
                .await
                .expect("an error within the timeout")
                .expect("the source is running");
            errors[path].clone()
        }
    }

    #[test]
    fn defaults_of_a_static_pod() {
        let data = manifest("web", "nginx");
        let origin = Origin {
            source: SourceName::File,
            location: "/etc/kubernetes/manifests/web.yaml",
            node_name: "Node-1",
        };
        let pods = load_static_pods(data.as_bytes(), origin, &[]).unwrap();
        let pod = &pods[0];
        let uid = pod.metadata.uid.clone().unwrap();
        assert_eq!(uid.len(), 32);
        assert!(uid.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(pod.metadata.name.as_deref(), Some("web-node-1"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("default"));
        let annots = pod.metadata.annotations.as_ref().unwrap();
        assert_eq!(annots[annotations::CONFIG_HASH], uid);
        assert_eq!(annots[annotations::CONFIG_SOURCE], "file");
        assert!(annots[annotations::CONFIG_SEEN].ends_with('Z'));
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("Node-1"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Always"));
        assert_eq!(spec.termination_grace_period_seconds, Some(30));
        // `nginx` has no tag: the runtime pulls `latest`, so Always.
        assert_eq!(
            spec.containers[0].image_pull_policy.as_deref(),
            Some("Always")
        );
        assert_eq!(spec.tolerations.as_ref().unwrap().len(), 1);
        assert_eq!(
            pod.status.as_ref().unwrap().phase.as_deref(),
            Some("Pending")
        );

        // Same manifest, same UID and first-seen time; another path, node or content,
        // another UID.
        let again = load_static_pods(data.as_bytes(), origin, &pods).unwrap();
        assert_eq!(again[0], pods[0]);
        let moved = Origin {
            location: "/etc/kubernetes/manifests/web2.yaml",
            ..origin
        };
        let other_node = Origin {
            node_name: "node-2",
            ..origin
        };
        let changed = manifest("web", "nginx:2");
        for (data, origin) in [(&data, moved), (&data, other_node), (&changed, origin)] {
            let p = load_static_pods(data.as_bytes(), origin, &[]).unwrap();
            assert_ne!(p[0].metadata.uid.as_deref(), Some(uid.as_str()));
        }

        // What the manifest sets is kept, and a given UID too.
        let set = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  namespace: kube-system\n  uid: 5eed-0001\nspec:\n  restartPolicy: Never\n  terminationGracePeriodSeconds: 5\n  containers:\n  - name: c\n    image: i\n";
        let p = &load_static_pods(set.as_bytes(), origin, &[]).unwrap()[0];
        assert_eq!(p.metadata.uid.as_deref(), Some("5eed-0001"));
        assert_eq!(p.metadata.namespace.as_deref(), Some("kube-system"));
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.termination_grace_period_seconds, Some(5));

        // Another tag defaults to IfNotPresent; a set policy is kept; an unknown
        // one is refused, naming the container and the value.
        let tagged = |policy: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\nspec:\n  containers:\n  - name: c\n    image: i:v1\n{policy}"
            )
        };
        let policy_of = |yaml: String| {
            load_static_pods(yaml.as_bytes(), origin, &[]).map(|p| {
                p[0].spec.as_ref().unwrap().containers[0]
                    .image_pull_policy
                    .clone()
            })
        };
        assert_eq!(
            policy_of(tagged("")).unwrap().as_deref(),
            Some("IfNotPresent")
        );
        assert_eq!(
            policy_of(tagged("    imagePullPolicy: Never\n"))
                .unwrap()
                .as_deref(),
            Some("Never")
        );
        let refused = policy_of(tagged("    imagePullPolicy: Sometimes\n")).unwrap_err();
        let message = refused.1.to_string();
        assert!(
            message.contains("container \"c\"") && message.contains("\"Sometimes\""),
            "{message}"
        );
    }

    #[test]
    fn decodes_yaml_json_and_lists_and_names_the_bad_document() {
        let two = format!("{}---\n{}", manifest("a", "i"), manifest("b", "i"));
        let pods = decode(two.as_bytes()).unwrap();
        assert_eq!(pods.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [1, 2]);

        let json = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"j"},"spec":{"containers":[{"name":"c","image":"i"}]}}
            {"apiVersion":"v1","kind":"PodList","items":[{"metadata":{"name":"k"},"spec":{"containers":[{"name":"c","image":"i"}]}}]}"#;
        let pods = decode(json.as_bytes()).unwrap();
        assert_eq!(
            pods.iter()
                .map(|(i, p)| (*i, p.metadata.name.clone().unwrap()))
                .collect::<Vec<_>>(),
            [(1, "j".to_owned()), (2, "k".to_owned())]
        );

        let bad_kind = format!("{}---\napiVersion: v1\nkind: Service\n", manifest("a", "i"));
        let (index, e) = decode(bad_kind.as_bytes()).unwrap_err();
        assert_eq!(index, 2);
        assert!(
            matches!(e, DecodeError::Kind(ref k) if k == "Service"),
            "{e}"
        );

        let bad_yaml = format!("{}---\nkind: Pod\n  metadata: [\n", manifest("a", "i"));
        let (index, e) = decode(bad_yaml.as_bytes()).unwrap_err();
        assert_eq!(index, 2, "{e}");
        assert!(matches!(e, DecodeError::Yaml(_)), "{e}");

        let bad_version = "apiVersion: v2\nkind: Pod\nmetadata:\n  name: a\n";
        let e = decode(bad_version.as_bytes()).unwrap_err().1;
        assert!(matches!(e, DecodeError::Pod(_)), "{e}");

        let origin = Origin {
            source: SourceName::File,
            location: "/m/x.yaml",
            node_name: "n",
        };
        for (text, why) in [
            (
                "apiVersion: v1\nkind: Pod\nmetadata: {}\nspec:\n  containers: [{name: c, image: i}]\n",
                "metadata.name",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: Web_1\nspec:\n  containers: [{name: c, image: i}]\n",
                "DNS",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\nspec:\n  containers: []\n",
                "spec.containers",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\nspec:\n  containers: [{name: c}]\n",
                "no image",
            ),
            (
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\nspec:\n  containers: [{name: c, image: i}, {name: c, image: i}]\n",
                "spec.containers[1].name: Duplicate value: \"c\"",
            ),
        ] {
            let e = load_static_pods(text.as_bytes(), origin, &[])
                .unwrap_err()
                .1;
            assert!(e.to_string().contains(why), "{e} should mention {why}");
        }
        let dup = format!("{}---\n{}", manifest("a", "i"), manifest("a", "j"));
        let (index, e) = load_static_pods(dup.as_bytes(), origin, &[]).unwrap_err();
        assert_eq!(index, 2);
        assert!(e.to_string().contains("defined twice"), "{e}");
    }

    /// A file mode written as the kubelet's users write it, with a leading
    /// zero, is octal (YAML 1.1, as `sigs.k8s.io/yaml`); `0o` and decimal
    /// too.
    #[test]
    fn modes_with_a_leading_zero_are_octal() {
        let yaml = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: m\nspec:\n  containers:\n    - name: app\n      image: busybox\n  volumes:\n    - name: a\n      configMap:\n        name: c\n        defaultMode: 0644\n        items:\n          - key: k\n            path: k\n            mode: 0600\n    - name: b\n      secret:\n        secretName: s\n        defaultMode: 0o400\n    - name: d\n      secret:\n        secretName: s\n        defaultMode: 256\n";
        let pods = decode(yaml.as_bytes()).expect("decodes");
        let volumes = pods[0].1.spec.as_ref().unwrap().volumes.as_ref().unwrap();
        let cm = volumes[0].config_map.as_ref().unwrap();
        assert_eq!(cm.default_mode, Some(0o644));
        assert_eq!(cm.items.as_ref().unwrap()[0].mode, Some(0o600));
        assert_eq!(
            volumes[1].secret.as_ref().unwrap().default_mode,
            Some(0o400)
        );
        assert_eq!(volumes[2].secret.as_ref().unwrap().default_mode, Some(256));
    }

    #[test]
    fn ignores_dotfiles_and_editor_files() {
        for name in [
            ".web.yaml",
            ".web.yaml.swp",
            "web.yaml~",
            "#web.yaml#",
            "web.yaml.swp",
            "x.tmp",
            "",
        ] {
            assert!(!is_manifest_name(OsStr::new(name)), "{name}");
        }
        for name in ["web.yaml", "web.json", "web", "4913"] {
            assert!(is_manifest_name(OsStr::new(name)), "{name}");
        }
    }

    #[test]
    fn error_messages_name_the_file_and_document() {
        let e = Error::Document {
            path: "/m/web.yaml".into(),
            index: 2,
            source: DecodeError::Kind("Service".into()),
        };
        assert_eq!(
            e.to_string(),
            "manifest /m/web.yaml, document 2: kind \"Service\" is neither Pod nor PodList"
        );
    }

    #[tokio::test]
    async fn added_file_gives_a_set_with_its_pod() {
        let dir = temp_dir();
        let mut src = start(dir.path());
        assert!(src.next().await.pods.is_empty(), "the first set is empty");
        write(&dir.path().join("web.yaml"), &manifest("web", "nginx"));
        let set = src.until(&["web-node-1"]).await;
        let annots = set.pods[0].metadata.annotations.as_ref().unwrap();
        assert_eq!(annots[annotations::CONFIG_SOURCE], "file");
        // Dotfiles and editor files are ignored.
        write(&dir.path().join(".hidden.yaml"), &manifest("hidden", "x"));
        write(&dir.path().join("web.yaml~"), &manifest("backup", "x"));
        write(&dir.path().join("z.yaml"), &manifest("z", "nginx"));
        src.until(&["web-node-1", "z-node-1"]).await;
    }

    #[tokio::test]
    async fn changed_file_is_a_new_pod() {
        let dir = temp_dir();
        let path = dir.path().join("web.yaml");
        write(&path, &manifest("web", "nginx:1"));
        let mut src = start(dir.path());
        let first = src.until(&["web-node-1"]).await;
        write(&path, &manifest("web", "nginx:2"));
        let second = src.next().await;
        assert_eq!(names(&second), ["web-node-1"]);
        assert_ne!(first.pods[0].metadata.uid, second.pods[0].metadata.uid);
        let image = &second.pods[0].spec.as_ref().unwrap().containers[0].image;
        assert_eq!(image.as_deref(), Some("nginx:2"));
    }

    #[tokio::test]
    async fn two_documents_in_one_file() {
        let dir = temp_dir();
        let mut src = start(dir.path());
        src.next().await;
        let text = format!("{}---\n{}", manifest("a", "i"), manifest("b", "i"));
        write(&dir.path().join("pods.yaml"), &text);
        src.until(&["a-node-1", "b-node-1"]).await;
        // JSON too.
        let json = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"j"},"spec":{"containers":[{"name":"c","image":"i"}]}}"#;
        write(&dir.path().join("q.json"), json);
        src.until(&["a-node-1", "b-node-1", "j-node-1"]).await;
    }

    #[tokio::test]
    async fn renames_in_and_out_of_the_directory() {
        let dir = temp_dir();
        let outside = temp_dir();
        let staged = outside.path().join("web.yaml");
        write(&staged, &manifest("web", "nginx"));
        let mut src = start(dir.path());
        src.next().await;
        std::fs::rename(&staged, dir.path().join("web.yaml")).unwrap();
        src.until(&["web-node-1"]).await;
        std::fs::rename(dir.path().join("web.yaml"), &staged).unwrap();
        assert!(src.next().await.pods.is_empty());
        // An editor's atomic save: write a dotfile, rename it over the manifest.
        std::fs::rename(&staged, dir.path().join("web.yaml")).unwrap();
        let before = src.until(&["web-node-1"]).await;
        let tmp = dir.path().join(".web.yaml.tmp");
        write(&tmp, &manifest("web", "nginx:2"));
        std::fs::rename(&tmp, dir.path().join("web.yaml")).unwrap();
        let after = src.until(&["web-node-1"]).await;
        assert_ne!(before.pods[0].metadata.uid, after.pods[0].metadata.uid);
    }

    #[tokio::test]
    async fn removed_file_removes_its_pod() {
        let dir = temp_dir();
        write(&dir.path().join("a.yaml"), &manifest("a", "i"));
        write(&dir.path().join("b.yaml"), &manifest("b", "i"));
        let mut src = start(dir.path());
        src.until(&["a-node-1", "b-node-1"]).await;
        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        assert_eq!(names(&src.next().await), ["b-node-1"]);
    }

    #[tokio::test]
    async fn invalid_file_next_to_a_valid_one() {
        let dir = temp_dir();
        let bad = dir.path().join("bad.yaml");
        write(
            &bad,
            &format!(
                "{}---\nkind: Pod\napiVersion: v1\nspec: 3\n",
                manifest("x", "i")
            ),
        );
        write(&dir.path().join("good.yaml"), &manifest("good", "i"));
        let mut src = start(dir.path());
        src.until(&["good-node-1"]).await;
        let e = src.error_for(&bad).await;
        let msg = e.to_string();
        assert!(
            msg.contains(&*bad.to_string_lossy()) && msg.contains("document 2"),
            "{msg}"
        );
        // Another invalid file while running: still only an error.
        let worse = dir.path().join("worse.json");
        write(&worse, "{\"kind\": ");
        let msg = src.error_for(&worse).await.to_string();
        assert!(
            msg.contains("worse.json") && msg.contains("invalid json"),
            "{msg}"
        );
        // Fixed: its pod comes, its error goes.
        write(&bad, &manifest("fixed", "i"));
        src.until(&["fixed-node-1", "good-node-1"]).await;
        assert!(!src.errors.borrow().contains_key(&bad));
        assert!(src.errors.borrow().contains_key(&worse));
    }

    // Issue #24: a volume named `/data` (its emptyDir would be the host's
    // /data) and a container named `../x` (its log path would leave the log
    // directory): the manifest is refused, the error naming both fields.
    #[tokio::test]
    async fn names_that_would_become_host_paths_are_refused() {
        let dir = temp_dir();
        let bad = dir.path().join("bad.yaml");
        write(
            &bad,
            "apiVersion: v1\nkind: Pod\nmetadata: {name: evil}\nspec:\n  volumes: [{name: /data, emptyDir: {}}]\n  containers: [{name: ../x, image: i, volumeMounts: [{name: /data, mountPath: /d}]}]\n",
        );
        write(&dir.path().join("good.yaml"), &manifest("good", "i"));
        let mut src = start(dir.path());
        let set = src.until(&["good-node-1"]).await;
        assert_eq!(names(&set), ["good-node-1"]);
        let msg = src.error_for(&bad).await.to_string();
        for field in [
            "spec.volumes[0].name: Invalid value: \"/data\"",
            "spec.containers[0].name: Invalid value: \"../x\"",
            "a lowercase RFC 1123 label",
        ] {
            assert!(msg.contains(field), "{field} in {msg}");
        }
    }

    #[tokio::test]
    async fn valid_file_made_invalid_keeps_its_last_pods() {
        let dir = temp_dir();
        let path = dir.path().join("web.yaml");
        write(&path, &manifest("web", "nginx"));
        let mut src = start(dir.path());
        let good = src.until(&["web-node-1"]).await;
        // A half-written save.
        write(
            &path,
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\nspec:\n  contai",
        );
        src.error_for(&path).await;
        // Emptied: also an error, the pod stays.
        write(&path, "");
        tokio::time::timeout(
            WAIT,
            src.errors.wait_for(|e| {
                e.get(&path)
                    .is_some_and(|e| matches!(**e, Error::Empty { .. }))
            }),
        )
        .await
        .expect("the empty file is reported")
        .unwrap();
        // No set was sent meanwhile: the next one is the new version.
        write(&path, &manifest("web", "nginx:2"));
        let fixed = src.next().await;
        assert_eq!(names(&fixed), ["web-node-1"]);
        assert_ne!(good.pods[0].metadata.uid, fixed.pods[0].metadata.uid);
        assert!(src.errors.borrow().is_empty());
    }

    #[tokio::test]
    async fn missing_directory_is_an_empty_set_then_retried() {
        let parent = temp_dir();
        let dir = parent.path().join("manifests");
        let mut src = start(&dir);
        assert!(src.next().await.pods.is_empty());
        src.error_for(&dir).await;
        std::fs::create_dir(&dir).unwrap();
        write(&dir.join("web.yaml"), &manifest("web", "nginx"));
        // The retry after one second finds it.
        src.until(&["web-node-1"]).await;
        // Removing the directory removes its pods.
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(src.until(&[]).await.pods.is_empty());
    }

    #[tokio::test]
    async fn rescan_reads_what_changed_and_forgets_what_went() {
        let dir = temp_dir();
        write(&dir.path().join("a.yaml"), &manifest("a", "i"));
        let mut source = FileSource::new(dir.path(), "n");
        source.rescan().await.unwrap();
        let a = source.pods();
        source.rescan().await.unwrap();
        assert!(
            Arc::ptr_eq(&a[0], &source.pods()[0]),
            "unchanged files are not re-parsed"
        );
        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        write(&dir.path().join("b.yaml"), &manifest("b", "i"));
        source.rescan().await.unwrap();
        let names: Vec<_> = source
            .pods()
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["b-n"]);
    }

    #[tokio::test]
    async fn an_unusable_uid_is_an_error_naming_the_file() {
        let dir = temp_dir();
        let mut src = start(dir.path());
        src.until(&[]).await;
        let bad = dir.path().join("bad.yaml");
        write(
            &bad,
            &manifest("bad", "i").replace("name: bad\n", "name: bad\n  uid: not/a-uid\n"),
        );
        let good = dir.path().join("good.yaml");
        write(&good, &manifest("good", "i"));
        src.until(&["good-node-1"]).await;
        let text = src.error_for(&bad).await.to_string();
        assert!(
            text.contains("bad.yaml")
                && text.contains("metadata.uid")
                && text.contains("not/a-uid"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_duplicate_name_across_files_names_both_files() {
        let dir = temp_dir();
        let mut src = start(dir.path());
        src.until(&[]).await;
        let a = dir.path().join("a.yaml");
        let b = dir.path().join("b.yaml");
        write(&a, &manifest("web", "one"));
        src.until(&["web-node-1"]).await;
        write(&b, &manifest("web", "two"));
        let text = src.error_for(&b).await.to_string();
        assert!(
            text.contains("a.yaml")
                && text.contains("b.yaml")
                && text.contains("default/web-node-1"),
            "{text}"
        );
        // The first file's pod stays the one that runs.
        assert!(!src.errors.borrow().contains_key(&a));
        // Once the first file is gone, the second file's pod runs, error cleared.
        std::fs::remove_file(&a).unwrap();
        let set = src.until(&["web-node-1"]).await;
        assert_eq!(
            set.pods[0].spec.as_ref().unwrap().containers[0]
                .image
                .as_deref(),
            Some("two")
        );
        tokio::time::timeout(WAIT, src.errors.wait_for(|e| !e.contains_key(&b)))
            .await
            .expect("the duplicate error cleared")
            .unwrap();
    }
}

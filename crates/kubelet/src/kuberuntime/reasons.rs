//! Why a container does not run: the kubelet's reason cache
//! (`pkg/kubelet/reason_cache.go`) and the start errors SyncPod records in it
//! (`kuberuntime_container.go`'s `startContainer`, `images/image_manager.go`).
//! The last start error of each container, keyed by pod UID and container name,
//! is the container's waiting reason and message until it starts: ErrImagePull,
//! ImagePullBackOff, ErrImageNeverPull, ImageInspectError, InvalidImageName,
//! CreateContainerConfigError, CreateContainerError, RunContainerError,
//! CrashLoopBackOff (`doBackOff`'s error); and ContainerCreating with the
//! error of a sandbox that could not be created.
//! As the kubelet's, the cache is filled by a sync and read by the status of
//! the next one (its status is generated before SyncPod): a container a sync
//! finds crashed and in back-off shows `terminated` in that sync's status and
//! `CrashLoopBackOff` from the next.
//! Differences: a map forgotten with the pod instead of the kubelet's LRU of
//! 1 000 entries.

use std::collections::HashMap;

use super::actions::Waiting;
use evpleg_core::ids::PodUid;

pub const ERR_IMAGE_PULL: &str = "ErrImagePull";
pub const IMAGE_INSPECT_ERROR: &str = "ImageInspectError";
pub const IMAGE_PULL_BACKOFF: &str = "ImagePullBackOff";
pub const ERR_IMAGE_NEVER_PULL: &str = "ErrImageNeverPull";
pub const INVALID_IMAGE_NAME: &str = "InvalidImageName";
pub const CREATE_CONTAINER_CONFIG_ERROR: &str = "CreateContainerConfigError";
pub const CREATE_CONTAINER_ERROR: &str = "CreateContainerError";
pub const RUN_CONTAINER_ERROR: &str = "RunContainerError";
/// A container waiting in its restart back-off ([`super::backoff`]).
pub const CRASH_LOOP_BACK_OFF: &str = "CrashLoopBackOff";
/// Not an error of the container: its pod's sandbox could not be created
/// ([`super::sync`]; the kubelet's reason, with the error as the message).
pub const CONTAINER_CREATING: &str = "ContainerCreating";

/// A failed container start: the kubelet's reason and the message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct StartError {
    pub reason: &'static str,
    /// The message, as the image manager's event has it.
    pub message: String,
    /// The container's waiting message when it is not [`Self::message`]
    /// (the image manager returns one message and records another: a
    /// failed pull's event says "Failed to pull image ...: <error>", its
    /// status the error alone; a back-off's status adds the last pull's
    /// error to its event's).
    pub waiting_message: Option<String>,
}

impl StartError {
    pub fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            waiting_message: None,
        }
    }

    /// With `message` as the container's waiting message.
    pub fn waiting_message(self, message: impl Into<String>) -> Self {
        Self {
            waiting_message: Some(message.into()),
            ..self
        }
    }
}

/// The last start error of each container.
#[derive(Debug, Default)]
pub struct ReasonCache {
    entries: HashMap<(PodUid, String), StartError>,
}

impl ReasonCache {
    pub fn update(&mut self, pod: &PodUid, container: &str, error: StartError) {
        self.entries
            .insert((pod.clone(), container.to_owned()), error);
    }

    /// The containers this sync found in CrashLoopBackOff (the kubelet's
    /// `doBackOff` fails their start with it).
    pub fn back_off(&mut self, pod: &PodUid, waiting: &[Waiting]) {
        for w in waiting {
            self.update(
                pod,
                &w.name,
                StartError::new(CRASH_LOOP_BACK_OFF, &w.message),
            );
        }
    }

    /// The container started: its error is over.
    pub fn remove(&mut self, pod: &PodUid, container: &str) {
        self.entries.remove(&(pod.clone(), container.to_owned()));
    }

    /// The pod's containers' errors, as waiting states.
    pub fn waiting(&self, pod: &PodUid) -> Vec<Waiting> {
        let mut out: Vec<Waiting> = self
            .entries
            .iter()
            .filter(|((p, _), _)| p == pod)
            .map(|((_, name), e)| Waiting {
                name: name.clone(),
                reason: e.reason.to_owned(),
                message: e.waiting_message.as_ref().unwrap_or(&e.message).clone(),
                retry_in: std::time::Duration::ZERO,
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Forgets a pod (it was removed).
    pub fn forget(&mut self, pod: &PodUid) {
        self.entries.retain(|(p, _), _| p != pod);
    }
}

/// Checks an image reference as the kubelet's `ParseImageName` does (the
/// distribution reference grammar): `[host[:port]/]path[:tag][@digest]` with
/// lowercase path components. The error names what is wrong.
pub fn check_image_reference(image: &str) -> Result<(), String> {
    if image.is_empty() {
        return Err("the image name is empty".into());
    }
    let (rest, digest) = match image.split_once('@') {
        Some((r, d)) => (r, Some(d)),
        None => (image, None),
    };
    if let Some(d) = digest {
        let ok = d.split_once(':').is_some_and(|(alg, hex)| {
            !alg.is_empty()
                && alg
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+._-".contains(c))
                && hex.len() >= 32
                && hex.chars().all(|c| c.is_ascii_hexdigit())
        });
        if !ok {
            return Err(format!("invalid digest {d:?}"));
        }
    }
    // A tag is after the last ':' that follows the last '/'.
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
        None => (rest, None),
    };
    if let Some(t) = tag {
        let ok = !t.is_empty()
            && t.len() <= 128
            && !t.starts_with(['.', '-'])
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
        if !ok {
            return Err(format!("invalid tag {t:?}"));
        }
    }
    let mut parts: Vec<&str> = name.split('/').collect();
    // The first component is a registry host when it looks like one.
    if parts.len() > 1 && (parts[0].contains(['.', ':']) || parts[0] == "localhost") {
        let host = parts.remove(0);
        let (h, port) = host
            .split_once(':')
            .map_or((host, None), |(h, p)| (h, Some(p)));
        let host_ok = !h.is_empty()
            && h.chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-".contains(c))
            && port.is_none_or(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()));
        if !host_ok {
            return Err(format!("invalid registry host {host:?}"));
        }
    }
    for p in &parts {
        let ok = !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c))
            && p.starts_with(|c: char| c.is_ascii_alphanumeric())
            && p.ends_with(|c: char| c.is_ascii_alphanumeric());
        if !ok {
            return Err(format!(
                "invalid repository component {p:?} (lowercase letters, digits and separators)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_references() {
        let good = [
            "busybox",
            "localhost/busybox:latest",
            "registry.k8s.io/pause:3.10",
            "127.0.0.1:5000/a/b-c_d.e:v1.2",
            "busybox@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ];
        for i in good {
            assert_eq!(check_image_reference(i), Ok(()), "{i}");
        }
        let bad = [
            ("", "empty"),
            ("BusyBox", "component"),
            ("busybox:", "tag"),
            ("busybox:-x", "tag"),
            ("a//b", "component"),
            ("bad host:5000/x", "host"),
            ("localhost:abc/x", "host"),
            ("busybox@sha256:zz", "digest"),
            ("with space", "component"),
        ];
        for (i, what) in bad {
            let e = check_image_reference(i).expect_err(i);
            assert!(e.contains(what), "{i}: {e}");
        }
    }

    #[test]
    fn a_start_error_is_the_waiting_reason_until_the_container_starts() {
        let pod = PodUid::parse(&"a".repeat(32)).unwrap();
        let other = PodUid::parse(&"b".repeat(32)).unwrap();
        let mut cache = ReasonCache::default();
        cache.update(
            &pod,
            "app",
            StartError::new(ERR_IMAGE_PULL, "failed to pull"),
        );
        cache.update(&pod, "app", StartError::new(IMAGE_PULL_BACKOFF, "Back-off"));
        cache.update(&other, "app", StartError::new(RUN_CONTAINER_ERROR, "x"));
        let w = cache.waiting(&pod);
        assert_eq!(
            w.iter()
                .map(|w| (w.name.as_str(), w.reason.as_str()))
                .collect::<Vec<_>>(),
            [("app", IMAGE_PULL_BACKOFF)]
        );
        cache.remove(&pod, "app");
        assert!(cache.waiting(&pod).is_empty());
        cache.forget(&other);
        assert!(cache.waiting(&other).is_empty());
    }
}

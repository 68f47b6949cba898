//! A container's image pull policy, as the kubelet's `imagePullPolicy`
//! (`images/image_manager.go`'s `EnsureImageExists`) and its defaulting
//! (`SetDefaults_Container` in `pkg/apis/core/v1/defaults.go`): unset means
//! Always for the tag `latest` (or no tag and no digest), IfNotPresent
//! otherwise. The API server applies that default to API pods and the kubelet
//! to static pods; here the file and URL sources apply it to static pods
//! ([`default_pull_policy`]) and SyncPod to a pod from anywhere that still
//! lacks it ([`PullPolicy::of`]). A value other than the three is refused with
//! a message naming it (the kubelet's `ValidatePod` refuses such a pod).
//!
//! A failed pull's error reads as the kubelet's CRI client gives it
//! ([`pull_error_text`]); it is the container's ErrImagePull message, and
//! during the back-off that follows the ImagePullBackOff message carries it
//! ([`PullErrors`], the image manager's `prevPullErrMsg`). Differences: the
//! runtime's `RegistryUnavailable` and `SignatureValidationFailed` errors
//! (`evalCRIPullErr`, not given by containerd 1.7) are ErrImagePull too.

use std::collections::HashMap;

use evpleg_core::ids::PodUid;
use evpleg_cri::CriError;
use k8s_openapi::api::core::v1::Container;

use super::reasons::ERR_IMAGE_PULL;

/// A failed CRI call's error as the kubelet's CRI client has it (cri-client's
/// `pullImageV1`): the runtime's message alone for gRPC code Unknown (what
/// containerd answers for a pull that failed), else gRPC-go's `rpc error:
/// code = <Code> desc = <message>`; no answer in time is gRPC's deadline.
pub fn pull_error_text(e: &CriError) -> String {
    let rpc = |code: tonic::Code, message: &str| match code {
        tonic::Code::Unknown => message.to_owned(),
        code => format!("rpc error: code = {} desc = {message}", go_code(code)),
    };
    match e {
        CriError::Rpc { code, message, .. } => rpc(*code, message),
        CriError::TimedOut { .. } => {
            rpc(tonic::Code::DeadlineExceeded, "context deadline exceeded")
        }
        other => other.to_string(),
    }
}

/// gRPC-go's `codes.Code.String()`.
fn go_code(code: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match code {
        C::Ok => "OK",
        C::Cancelled => "Canceled",
        C::Unknown => "Unknown",
        C::InvalidArgument => "InvalidArgument",
        C::DeadlineExceeded => "DeadlineExceeded",
        C::NotFound => "NotFound",
        C::AlreadyExists => "AlreadyExists",
        C::PermissionDenied => "PermissionDenied",
        C::ResourceExhausted => "ResourceExhausted",
        C::FailedPrecondition => "FailedPrecondition",
        C::Aborted => "Aborted",
        C::OutOfRange => "OutOfRange",
        C::Unimplemented => "Unimplemented",
        C::Internal => "Internal",
        C::Unavailable => "Unavailable",
        C::DataLoss => "DataLoss",
        C::Unauthenticated => "Unauthenticated",
    }
}

/// The last failed pull of each pod and image, as the kubelet's image
/// manager keeps it (`prevPullErrMsg`): stored at the failure as
/// `ErrImagePull: <error>`, forgotten when the next pull is tried, and
/// appended to the back-off's message in between.
#[derive(Debug, Default)]
pub struct PullErrors {
    last: HashMap<(PodUid, String), String>,
}

impl PullErrors {
    /// A pull of `image` for `pod` failed with `error` (ErrImagePull).
    pub fn failed(&mut self, pod: &PodUid, image: &str, error: &str) {
        self.last.insert(
            (pod.clone(), image.to_owned()),
            format!("{ERR_IMAGE_PULL}: {error}"),
        );
    }

    /// A pull of `image` for `pod` is tried: the last error is over.
    pub fn pulling(&mut self, pod: &PodUid, image: &str) {
        self.last.remove(&(pod.clone(), image.to_owned()));
    }

    /// The waiting message while the pull of `image` for `pod` backs off:
    /// `Back-off pulling image "<image>"`, then `: ` and the last error if
    /// one is known.
    pub fn back_off_message(&self, pod: &PodUid, image: &str) -> String {
        let message = back_off_event(image);
        match self.last.get(&(pod.clone(), image.to_owned())) {
            Some(error) => format!("{message}: {error}"),
            None => message,
        }
    }

    /// The pod is gone.
    pub fn forget(&mut self, pod: &PodUid) {
        self.last.retain(|(p, _), _| p != pod);
    }
}

/// The image manager's BackOff event for `image` (without the last error).
pub fn back_off_event(image: &str) -> String {
    format!("Back-off pulling image {image:?}")
}

/// `imagePullPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullPolicy {
    /// Pull at every container start.
    Always,
    /// Pull when the runtime does not have the image.
    IfNotPresent,
    /// Never pull; the container fails to start without the image.
    Never,
}

impl PullPolicy {
    /// The policy's name in a pod spec.
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }

    /// Parses a pod spec's value; the error names it.
    pub fn parse(value: &str) -> Result<Self, String> {
        match value {
            "Always" => Ok(PullPolicy::Always),
            "IfNotPresent" => Ok(PullPolicy::IfNotPresent),
            "Never" => Ok(PullPolicy::Never),
            other => Err(format!(
                "unsupported imagePullPolicy {other:?}: supported values are \"Always\", \"IfNotPresent\", \"Never\""
            )),
        }
    }

    /// The container's policy, defaulted from its image when unset (or empty).
    pub fn of(c: &Container) -> Result<Self, String> {
        match c.image_pull_policy.as_deref().filter(|p| !p.is_empty()) {
            Some(p) => Self::parse(p),
            None => Ok(default_pull_policy(c.image.as_deref().unwrap_or_default())),
        }
    }
}

/// The default policy for `image`: Always when its tag is `latest` or it has
/// neither tag nor digest (the runtime then pulls `latest`), IfNotPresent
/// otherwise (another tag, or a digest without a tag).
pub fn default_pull_policy(image: &str) -> PullPolicy {
    let latest = match image_tag(image) {
        Some(tag) => tag == "latest",
        None => !image.contains('@'),
    };
    if latest {
        PullPolicy::Always
    } else {
        PullPolicy::IfNotPresent
    }
}

/// The tag of an image reference: after the last ':' that follows the last
/// '/', before any digest (a registry port is not a tag).
pub fn image_tag(image: &str) -> Option<&str> {
    let name = image.split_once('@').map_or(image, |(n, _)| n);
    let last = &name[name.rfind('/').map_or(0, |i| i + 1)..];
    last.rsplit_once(':').map(|(_, tag)| tag)
}

/// Sets the default policy on every container (init and app) of `spec` that
/// has none, as the kubelet's defaulting of a static pod does.
pub fn apply_default_pull_policies(spec: &mut k8s_openapi::api::core::v1::PodSpec) {
    let containers = spec
        .init_containers
        .iter_mut()
        .flatten()
        .chain(spec.containers.iter_mut());
    for c in containers {
        if c.image_pull_policy
            .as_deref()
            .unwrap_or_default()
            .is_empty()
        {
            let policy = default_pull_policy(c.image.as_deref().unwrap_or_default());
            c.image_pull_policy = Some(policy.as_str().to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages of a failed pull and of the back-off after it, as the
    /// kubelet's (cri-client `pullImageV1`, the image manager's `pullImage`
    /// with `prevPullErrMsg`): the runtime's error alone for code Unknown,
    /// gRPC-go's text otherwise; the back-off's with `ErrImagePull: ` and
    /// that error until the next pull is tried.
    #[test]
    fn pull_errors_read_as_the_kubelet_s() {
        use evpleg_cri::Target;
        let rpc = |code, message: &str| CriError::Rpc {
            call: "PullImage",
            target: Box::new(Target::Image("x:1".into())),
            code,
            message: message.into(),
        };
        let unpack = "failed to pull and unpack image \"x:1\": not found";
        let cases = [
            (rpc(tonic::Code::Unknown, unpack), unpack.to_owned()),
            (
                rpc(tonic::Code::NotFound, "no such image"),
                "rpc error: code = NotFound desc = no such image".to_owned(),
            ),
            (
                rpc(tonic::Code::Cancelled, "gone"),
                "rpc error: code = Canceled desc = gone".to_owned(),
            ),
            (
                CriError::TimedOut {
                    call: "PullImage",
                    target: Box::new(Target::Image("x:1".into())),
                    timeout: std::time::Duration::from_secs(1),
                },
                "rpc error: code = DeadlineExceeded desc = context deadline exceeded".to_owned(),
            ),
        ];
        for (e, want) in cases {
            assert_eq!(pull_error_text(&e), want);
        }
        let (pod, other) = (
            PodUid::parse(&"a".repeat(32)).unwrap(),
            PodUid::parse(&"b".repeat(32)).unwrap(),
        );
        let mut errors = PullErrors::default();
        assert_eq!(
            errors.back_off_message(&pod, "x:1"),
            "Back-off pulling image \"x:1\""
        );
        errors.failed(&pod, "x:1", unpack);
        errors.failed(&other, "x:1", "other");
        let wrapped = format!("Back-off pulling image \"x:1\": ErrImagePull: {unpack}");
        assert_eq!(errors.back_off_message(&pod, "x:1"), wrapped);
        assert_eq!(
            errors.back_off_message(&pod, "y:1"),
            "Back-off pulling image \"y:1\""
        );
        errors.pulling(&pod, "x:1");
        assert_eq!(
            errors.back_off_message(&pod, "x:1"),
            "Back-off pulling image \"x:1\""
        );
        errors.forget(&other);
        assert_eq!(
            errors.back_off_message(&other, "x:1"),
            "Back-off pulling image \"x:1\""
        );
    }

    #[test]
    fn the_kubelet_s_default_table() {
        use PullPolicy::*;
        let cases = [
            ("busybox", Always),
            ("busybox:latest", Always),
            ("localhost/busybox:latest", Always),
            ("127.0.0.1:5000/evpleg/busybox", Always),
            ("127.0.0.1:5000/evpleg/busybox:latest", Always),
            ("127.0.0.1:5000/evpleg/busybox:v1", IfNotPresent),
            ("localhost/busybox:local", IfNotPresent),
            ("registry.k8s.io/pause:3.10", IfNotPresent),
            (
                "busybox@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                IfNotPresent,
            ),
            (
                "busybox:latest@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                Always,
            ),
            (
                "busybox:1.36@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                IfNotPresent,
            ),
        ];
        for (image, want) in cases {
            assert_eq!(default_pull_policy(image), want, "{image}");
        }
    }

    #[test]
    fn a_set_policy_wins_and_an_unknown_one_is_refused() {
        let c = |image: &str, policy: Option<&str>| Container {
            name: "app".into(),
            image: Some(image.into()),
            image_pull_policy: policy.map(Into::into),
            ..Default::default()
        };
        assert_eq!(
            PullPolicy::of(&c("busybox:latest", Some("Never"))),
            Ok(PullPolicy::Never)
        );
        assert_eq!(
            PullPolicy::of(&c("busybox:v1", Some("Always"))),
            Ok(PullPolicy::Always)
        );
        assert_eq!(
            PullPolicy::of(&c("busybox:v1", Some(""))),
            Ok(PullPolicy::IfNotPresent)
        );
        assert_eq!(PullPolicy::of(&c("busybox", None)), Ok(PullPolicy::Always));
        let e = PullPolicy::of(&c("busybox", Some("Sometimes"))).unwrap_err();
        assert!(e.contains("\"Sometimes\""), "{e}");
    }

    #[test]
    fn defaults_are_applied_to_every_container_without_a_policy() {
        let mut spec: k8s_openapi::api::core::v1::PodSpec =
            serde_json::from_value(serde_json::json!({
                "initContainers": [{"name": "init", "image": "busybox"}],
                "containers": [
                    {"name": "a", "image": "busybox:v1"},
                    {"name": "b", "image": "busybox:v1", "imagePullPolicy": "Never"},
                ],
            }))
            .expect("a pod spec");
        apply_default_pull_policies(&mut spec);
        let policies: Vec<_> = spec
            .init_containers
            .iter()
            .flatten()
            .chain(&spec.containers)
            .map(|c| c.image_pull_policy.as_deref().unwrap_or_default())
            .collect();
        assert_eq!(policies, ["Always", "IfNotPresent", "Never"]);
    }

    #[test]
    fn tags_are_not_ports() {
        assert_eq!(image_tag("127.0.0.1:5000/busybox"), None);
        assert_eq!(image_tag("127.0.0.1:5000/busybox:v1"), Some("v1"));
        assert_eq!(image_tag("busybox@sha256:abc"), None);
    }
}

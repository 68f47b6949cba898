//! Errors of CRI calls: which call failed, on which pod, sandbox, container or
//! image, and whether trying again later can help.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tonic::Code;

/// The result of a CRI call.
pub type Result<T, E = CriError> = std::result::Result<T, E>;

/// What a CRI call was about; error messages name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The runtime itself, by endpoint (`Version`, `Status`, the `List*` calls).
    Runtime(Arc<str>),
    /// An existing container, by id.
    Container(String),
    /// An existing pod sandbox, by id.
    Sandbox(String),
    /// A pod whose sandbox is being created (`RunPodSandbox`).
    Pod {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
        /// The pod's UID.
        uid: String,
    },
    /// A container being created in a sandbox (`CreateContainer`).
    NewContainer {
        /// The container's name in the pod spec.
        name: String,
        /// The sandbox it is created in.
        sandbox_id: String,
    },
    /// An image, by reference.
    Image(String),
}

impl fmt::Display for Target {
    /// Formats as a suffix of the call name: `"StopContainer" + " of container <id>"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Runtime(endpoint) => write!(f, " of runtime {endpoint}"),
            Self::Container(id) => write!(f, " of container {id}"),
            Self::Sandbox(id) => write!(f, " of pod sandbox {id}"),
            Self::Pod {
                namespace,
                name,
                uid,
            } => write!(f, " of pod {namespace}/{name} (uid {uid})"),
            Self::NewContainer { name, sandbox_id } => {
                write!(f, " of container {name:?} in pod sandbox {sandbox_id}")
            }
            Self::Image(image) => write!(f, " of image {image}"),
        }
    }
}

/// An error of the CRI client.
///
/// [`is_retryable`](Self::is_retryable) says whether the same call may succeed
/// later (the runtime is restarting, overloaded or slow); callers that retry must
/// back off. The client itself already retried calls that are safe to repeat
/// while the runtime was unreachable, within the call's timeout.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// The runtime endpoint is not a unix socket address.
    #[error("invalid runtime endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The runtime does not speak CRI `v1`.
    #[error(
        "runtime {runtime_name} {runtime_version} at {endpoint} reports CRI API version {found:?}, evpleg needs \"v1\""
    )]
    UnsupportedApiVersion {
        /// The runtime endpoint.
        endpoint: String,
        /// `runtime_api_version` from the `Version` response.
        found: String,
        /// `runtime_name` from the `Version` response.
        runtime_name: String,
        /// `runtime_version` from the `Version` response.
        runtime_version: String,
    },

    /// The runtime (or the transport to it) answered with a gRPC error.
    #[error("{call}{target}: {}", describe(*code, message))]
    Rpc {
        /// The CRI call, e.g. `StopContainer`.
        call: &'static str,
        /// What the call was about.
        target: Box<Target>,
        /// The gRPC status code.
        code: Code,
        /// The status message from the runtime or the transport.
        message: String,
    },

    /// No answer within the call's timeout (retries included).
    #[error("{call}{target}: deadline exceeded: no answer within {timeout:?}")]
    TimedOut {
        /// The CRI call.
        call: &'static str,
        /// What the call was about.
        target: Box<Target>,
        /// The call's timeout.
        timeout: Duration,
    },

    /// The runtime answered, but without a field the CRI requires.
    #[error("{call}{target}: invalid response: {reason}")]
    InvalidResponse {
        /// The CRI call.
        call: &'static str,
        /// What the call was about.
        target: Box<Target>,
        /// What is missing or wrong.
        reason: &'static str,
    },
}

impl CriError {
    /// An error from a gRPC status returned by `call` on `target`.
    ///
    /// containerd's "server is not initialized yet" (code `Unknown`, answered
    /// while its CRI plugin starts) becomes `Unavailable`: the call was refused
    /// before anything was done and may be repeated.
    pub fn from_status(call: &'static str, target: Target, status: &tonic::Status) -> Self {
        Self::Rpc {
            call,
            target: Box::new(target),
            code: status_code(status),
            message: status.message().to_owned(),
        }
    }

    /// The gRPC code of the error, if it has one (a local timeout counts as
    /// `DeadlineExceeded`).
    pub fn code(&self) -> Option<Code> {
        match self {
            Self::Rpc { code, .. } => Some(*code),
            Self::TimedOut { .. } => Some(Code::DeadlineExceeded),
            _ => None,
        }
    }

    /// The CRI call that failed, if the error comes from one.
    pub fn call(&self) -> Option<&'static str> {
        match self {
            Self::Rpc { call, .. } | Self::TimedOut { call, .. } => Some(call),
            Self::InvalidResponse { call, .. } => Some(call),
            _ => None,
        }
    }

    /// Whether the same call may succeed if tried again later, with backoff:
    /// the runtime is unreachable (`Unavailable`), slow (`DeadlineExceeded`, a
    /// local timeout) or overloaded (`ResourceExhausted`).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.code(),
            Some(Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted)
        )
    }

    /// Whether the runtime does not know the sandbox, container or image.
    pub fn is_not_found(&self) -> bool {
        self.code() == Some(Code::NotFound)
    }
}

/// The message of containerd's CRI plugin (1.6 to 2.x) for calls it gets
/// before it has finished starting, with code `Unknown`.
pub(crate) const CONTAINERD_NOT_INITIALIZED: &str = "server is not initialized yet";

/// Whether the runtime refused the call because it is still starting, before
/// doing anything: containerd answers [`CONTAINERD_NOT_INITIALIZED`] between
/// opening its socket and the end of the CRI plugin's start (after a restart,
/// tens of milliseconds).
pub(crate) fn runtime_starting(status: &tonic::Status) -> bool {
    status.code() == Code::Unknown && status.message() == CONTAINERD_NOT_INITIALIZED
}

/// The code a status counts as: its own, except `Unavailable` for a runtime
/// that is still starting ([`runtime_starting`]), which is what that is.
pub(crate) fn status_code(status: &tonic::Status) -> Code {
    if runtime_starting(status) {
        Code::Unavailable
    } else {
        status.code()
    }
}

/// `"<code>: <message>"` with the code in lowercase words.
fn describe(code: Code, message: &str) -> String {
    let code = code_text(code);
    if message.is_empty() {
        code.to_owned()
    } else {
        format!("{code}: {message}")
    }
}

/// The gRPC code in lowercase words.
pub(crate) fn code_text(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown error",
        Code::InvalidArgument => "invalid argument",
        Code::DeadlineExceeded => "deadline exceeded",
        Code::NotFound => "not found",
        Code::AlreadyExists => "already exists",
        Code::PermissionDenied => "permission denied",
        Code::ResourceExhausted => "resource exhausted",
        Code::FailedPrecondition => "failed precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out of range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal error",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn rpc(code: Code, message: &str) -> CriError {
        CriError::from_status(
            "StopContainer",
            Target::Container(CID.to_owned()),
            &tonic::Status::new(code, message),
        )
    }

    #[test]
    fn messages_name_the_call_and_the_target() {
        assert_eq!(
            rpc(Code::DeadlineExceeded, "").to_string(),
            format!("StopContainer of container {CID}: deadline exceeded")
        );
        assert_eq!(
            rpc(
                Code::NotFound,
                "an error occurred when try to find container"
            )
            .to_string(),
            format!(
                "StopContainer of container {CID}: not found: an error occurred when try to find container"
            )
        );
        let run = CriError::from_status(
            "RunPodSandbox",
            Target::Pod {
                namespace: "default".into(),
                name: "web".into(),
                uid: "u-1".into(),
            },
            &tonic::Status::unavailable("connection refused"),
        );
        assert_eq!(
            run.to_string(),
            "RunPodSandbox of pod default/web (uid u-1): unavailable: connection refused"
        );
        let create = CriError::InvalidResponse {
            call: "CreateContainer",
            target: Box::new(Target::NewContainer {
                name: "app".into(),
                sandbox_id: "s1".into(),
            }),
            reason: "no container id",
        };
        assert_eq!(
            create.to_string(),
            "CreateContainer of container \"app\" in pod sandbox s1: invalid response: no container id"
        );
        let version = CriError::TimedOut {
            call: "Version",
            target: Box::new(Target::Runtime(Arc::from("unix:///run/c.sock"))),
            timeout: Duration::from_secs(2),
        };
        assert_eq!(
            version.to_string(),
            "Version of runtime unix:///run/c.sock: deadline exceeded: no answer within 2s"
        );
        let image = CriError::from_status(
            "PullImage",
            Target::Image("localhost/busybox:latest".into()),
            &tonic::Status::internal("boom"),
        );
        assert_eq!(
            image.to_string(),
            "PullImage of image localhost/busybox:latest: internal error: boom"
        );
    }

    #[test]
    fn retryable_codes() {
        for code in [
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
        ] {
            assert!(rpc(code, "").is_retryable(), "{code:?}");
        }
        for code in [
            Code::NotFound,
            Code::InvalidArgument,
            Code::Unknown,
            Code::Internal,
            Code::Unimplemented,
            Code::FailedPrecondition,
            Code::AlreadyExists,
            Code::Cancelled,
        ] {
            assert!(!rpc(code, "").is_retryable(), "{code:?}");
        }
        let timed_out = CriError::TimedOut {
            call: "ListContainers",
            target: Box::new(Target::Runtime(Arc::from("unix:///run/c.sock"))),
            timeout: Duration::from_millis(1),
        };
        assert!(timed_out.is_retryable());
        assert_eq!(timed_out.code(), Some(Code::DeadlineExceeded));
        let version = CriError::UnsupportedApiVersion {
            endpoint: "unix:///run/x.sock".into(),
            found: "v1alpha2".into(),
            runtime_name: "containerd".into(),
            runtime_version: "1.4".into(),
        };
        assert!(!version.is_retryable());
        assert_eq!(version.code(), None);
    }

    #[test]
    fn a_starting_containerd_is_unavailable() {
        let starting = CriError::from_status(
            "ListContainers",
            Target::Runtime(Arc::from("unix:///run/c.sock")),
            &tonic::Status::unknown(CONTAINERD_NOT_INITIALIZED),
        );
        assert_eq!(starting.code(), Some(Code::Unavailable));
        assert!(starting.is_retryable());
        assert_eq!(
            starting.to_string(),
            "ListContainers of runtime unix:///run/c.sock: unavailable: server is not initialized yet"
        );
        let other = rpc(Code::Unknown, "something else");
        assert_eq!(other.code(), Some(Code::Unknown));
        assert!(!other.is_retryable());
    }

    #[test]
    fn not_found_is_distinguished() {
        assert!(rpc(Code::NotFound, "").is_not_found());
        assert!(!rpc(Code::NotFound, "").is_retryable());
        assert!(!rpc(Code::Unavailable, "").is_not_found());
        assert_eq!(rpc(Code::NotFound, "").call(), Some("StopContainer"));
    }

    #[test]
    fn the_error_stays_small() {
        // Returned by every call: keep `Result<T, CriError>` cheap to move, under
        // clippy's `result_large_err` threshold.
        assert!(std::mem::size_of::<CriError>() <= 128);
    }
}

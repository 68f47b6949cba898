//! The CSI module's errors. A failed CSI call says which driver, which method
//! and for which volume, and whether trying again can help.

use std::path::PathBuf;
use std::time::Duration;

use tonic::Code;

/// An error of the CSI client or volume plugin.
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    /// No driver of that name has registered (yet): retryable, the driver's
    /// registration may come. The kubelet's message, lowercased.
    #[error(
        "driver name {driver} not found in the list of registered CSI drivers (retryable: the driver may register later)"
    )]
    DriverNotRegistered { driver: String },
    /// The driver answered the call with a gRPC error.
    #[error("{method} of CSI driver {driver} for volume {volume}: rpc error: code = {code:?} desc = {message}{}", retry_note(.code))]
    Call {
        driver: String,
        method: &'static str,
        volume: String,
        code: Code,
        message: String,
    },
    /// No answer within the call's deadline: retryable; the operation may
    /// still be under way in the driver (the kubelet's "uncertain" state).
    #[error(
        "{method} of CSI driver {driver} for volume {volume}: no answer within {after:?} (retryable; the operation may still complete)"
    )]
    Timeout {
        driver: String,
        method: &'static str,
        volume: String,
        after: Duration,
    },
    /// The endpoint a driver registered is not a unix socket path.
    #[error("CSI driver {driver}: endpoint {endpoint:?} is not a unix socket path")]
    InvalidEndpoint { driver: String, endpoint: String },
    /// The driver's answer lacks what the spec requires.
    #[error("{method} of CSI driver {driver}: invalid response: {reason}")]
    InvalidResponse {
        driver: String,
        method: &'static str,
        reason: String,
    },
    /// A directory or file of the volume's paths.
    #[error("{what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The volume's spec cannot be served by the CSI plugin.
    #[error("volume {volume}: {reason}")]
    InvalidSpec { volume: String, reason: String },
}

fn retry_note(code: &Code) -> &'static str {
    if is_final(*code) {
        ""
    } else {
        " (retryable; the operation may still complete)"
    }
}

/// Whether a gRPC code means the driver finished the call and failed it (the
/// kubelet's `isFinalError`): anything but Canceled, DeadlineExceeded,
/// Unavailable, ResourceExhausted and Aborted, after which the operation may
/// still be in progress in the driver.
pub fn is_final(code: Code) -> bool {
    !matches!(
        code,
        Code::Cancelled
            | Code::DeadlineExceeded
            | Code::Unavailable
            | Code::ResourceExhausted
            | Code::Aborted
    )
}

impl CsiError {
    /// Whether trying again can succeed without anything else changing. Every
    /// CSI failure is retried by the volume manager (the kubelet retries
    /// final errors too, with back-off); this says whether the driver may
    /// still be doing the work, so that the state stays "uncertain" and the
    /// reverse call is made even if the retry never succeeds.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::DriverNotRegistered { .. } | Self::Timeout { .. } => true,
            Self::Call { code, .. } => !is_final(*code),
            Self::InvalidEndpoint { .. }
            | Self::InvalidResponse { .. }
            | Self::Io { .. }
            | Self::InvalidSpec { .. } => false,
        }
    }

    /// Whether the driver may have done (part of) the work although the call
    /// failed: the kubelet's uncertain outcome of a non-final error.
    pub fn is_uncertain(&self) -> bool {
        match self {
            Self::Timeout { .. } => true,
            Self::Call { code, .. } => !is_final(*code),
            _ => false,
        }
    }

    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            what,
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = CsiError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_and_uncertain_codes_are_the_kubelets() {
        let table = [
            (Code::Cancelled, false),
            (Code::DeadlineExceeded, false),
            (Code::Unavailable, false),
            (Code::ResourceExhausted, false),
            (Code::Aborted, false),
            (Code::Internal, true),
            (Code::InvalidArgument, true),
            (Code::NotFound, true),
            (Code::FailedPrecondition, true),
            (Code::Unknown, true),
        ];
        for (code, fin) in table {
            assert_eq!(is_final(code), fin, "{code:?}");
            let e = CsiError::Call {
                driver: "d".into(),
                method: "NodePublishVolume",
                volume: "v".into(),
                code,
                message: "m".into(),
            };
            assert_eq!(e.is_retryable(), !fin, "{code:?}");
            assert_eq!(e.is_uncertain(), !fin, "{code:?}");
        }
    }

    #[test]
    fn messages_name_driver_method_and_volume() {
        let e = CsiError::Call {
            driver: "csi.evpleg.test".into(),
            method: "NodeStageVolume",
            volume: "pv-1".into(),
            code: Code::Internal,
            message: "injected".into(),
        };
        assert_eq!(
            e.to_string(),
            "NodeStageVolume of CSI driver csi.evpleg.test for volume pv-1: rpc error: code = Internal desc = injected"
        );
        let e = CsiError::Call {
            driver: "d".into(),
            method: "NodePublishVolume",
            volume: "v".into(),
            code: Code::Unavailable,
            message: "gone".into(),
        };
        assert!(
            e.to_string()
                .ends_with("(retryable; the operation may still complete)")
        );
        let e = CsiError::DriverNotRegistered { driver: "x".into() };
        assert!(e.is_retryable() && !e.is_uncertain());
    }
}

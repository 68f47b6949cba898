//! The kubelet's CSI call metric, `csi_operations_seconds` (`pkg/volume/csi`
//! `csi_metrics.go`'s gRPC interceptor), as `evpleg_csi_operations_seconds`:
//! every CSI call's duration by `driver_name`, `method_name` (the full gRPC
//! method, `/csi.v1.Node/NodeStageVolume`), `grpc_status_code` (grpc-go's
//! names: `OK`, `Internal`, `DeadlineExceeded` also for a local timeout) and
//! `migrated` (always `false`: no in-tree migration here), with the
//! kubelet's buckets (0.1 s to 600 s). Also the plugin manager's
//! `plugin_manager_total_plugins` (`pluginmanager/metrics`), as
//! `evpleg_plugin_manager_total_plugins{socket_path, state}`: 1 for each
//! registration socket in the desired state of the world (seen in the
//! directory) and in the actual one (registered).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use tonic::Code;

/// The labels of one CSI call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CsiOperation {
    pub driver_name: String,
    pub method_name: String,
    pub grpc_status_code: String,
    pub migrated: String,
}

type HistogramFamily = Family<CsiOperation, Histogram, fn() -> Histogram>;

/// The labels of `plugin_manager_total_plugins`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginState {
    pub socket_path: String,
    /// `desired_state_of_world` or `actual_state_of_world`.
    pub state: String,
}

/// The histogram, shared by every driver's client, and the plugin gauge.
#[derive(Debug)]
pub struct CsiMetrics {
    pub operations: HistogramFamily,
    pub plugins: Family<PluginState, Gauge>,
}

fn histogram() -> Histogram {
    Histogram::new([
        0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
    ])
}

impl Default for CsiMetrics {
    fn default() -> Self {
        Self {
            operations: Family::new_with_constructor(histogram),
            plugins: Family::default(),
        }
    }
}

/// grpc-go's name of a status code.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// The full gRPC method of a CSI call.
pub fn full_method(method: &str) -> String {
    let service = if method.starts_with("Node") {
        "Node"
    } else {
        "Identity"
    };
    format!("/csi.v1.{service}/{method}")
}

impl CsiMetrics {
    /// Sets the plugin gauge of `socket`: in the desired state when seen,
    /// in the actual state when registered; a forgotten socket has neither.
    pub fn set_plugin(&self, socket: &str, desired: bool, actual: bool) {
        for (state, on) in [
            ("desired_state_of_world", desired),
            ("actual_state_of_world", actual),
        ] {
            let labels = PluginState {
                socket_path: socket.to_owned(),
                state: state.to_owned(),
            };
            if on {
                self.plugins.get_or_create(&labels).set(1);
            } else {
                self.plugins.remove(&labels);
            }
        }
    }

    pub fn observe(&self, driver: &str, method: &str, code: Code, seconds: f64) {
        self.operations
            .get_or_create(&CsiOperation {
                driver_name: driver.to_owned(),
                method_name: full_method(method),
                grpc_status_code: code_name(code).to_owned(),
                migrated: "false".to_owned(),
            })
            .observe(seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_kubelets() {
        assert_eq!(
            full_method("NodeStageVolume"),
            "/csi.v1.Node/NodeStageVolume"
        );
        assert_eq!(
            full_method("GetPluginInfo"),
            "/csi.v1.Identity/GetPluginInfo"
        );
        assert_eq!(code_name(Code::Ok), "OK");
        assert_eq!(code_name(Code::Cancelled), "Canceled");
        let m = CsiMetrics::default();
        m.observe("d", "NodePublishVolume", Code::Internal, 0.2);
        let mut registry = prometheus_client::registry::Registry::with_prefix("evpleg");
        registry.register("csi_operations_seconds", "CSI calls", m.operations.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        m.set_plugin("/r/a.sock", true, true);
        m.set_plugin("/r/b.sock", true, false);
        m.set_plugin("/r/c.sock", true, true);
        m.set_plugin("/r/c.sock", false, false);
        registry.register("plugin_manager_total_plugins", "plugins", m.plugins.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "evpleg_plugin_manager_total_plugins{socket_path=\"/r/a.sock\",state=\"desired_state_of_world\"} 1",
            "evpleg_plugin_manager_total_plugins{socket_path=\"/r/a.sock\",state=\"actual_state_of_world\"} 1",
            "evpleg_plugin_manager_total_plugins{socket_path=\"/r/b.sock\",state=\"desired_state_of_world\"} 1",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        assert!(!text.contains("b.sock\",state=\"actual"), "{text}");
        assert!(!text.contains("c.sock"), "{text}");
        assert!(
            text.contains(
                "evpleg_csi_operations_seconds_count{driver_name=\"d\",method_name=\"/csi.v1.Node/NodePublishVolume\",grpc_status_code=\"Internal\",migrated=\"false\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("_bucket{le=\"0.25\",driver_name=\"d\",method_name=\"/csi.v1.Node/NodePublishVolume\",grpc_status_code=\"Internal\",migrated=\"false\"} 1"),
            "{text}"
        );
    }
}

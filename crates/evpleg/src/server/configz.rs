//! `/configz`: the kubelet's `InstallDebuggingHandlers` serves its running
//! configuration as `{"kubeletconfig": {...}}` in `KubeletConfiguration`'s
//! field names (`kubelet.config.k8s.io/v1beta1`); tools such as `kubectl get
//! --raw /api/v1/nodes/<node>/proxy/configz` and node-problem detectors read
//! it. This answers the same document for the settings evpleg has, each under
//! the kubelet's name and in its format (durations as Go prints them,
//! quantities in bytes as `Mi` strings where the kubelet has a quantity).
//!
//! Differences: only the fields evpleg has a flag for; the kubelet's other
//! fields are absent rather than given a default evpleg does not apply.

use std::time::Duration;

use serde_json::{Value, json};

use crate::config::{AuthorizationModeFlag, RunArgs, duration};

/// The document `/configz` answers for an agent started with `args` on
/// `node_name`.
pub fn document(args: &RunArgs, node_name: &str) -> Value {
    let go = |d: Duration| duration::format(d);
    let s = &args.server;
    let pairs = |v: &str| -> serde_json::Map<String, Value> {
        list(v)
            .into_iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), Value::from(v)))
            .collect()
    };
    json!({ "kubeletconfig": {
        "enableServer": true,
        "nodeName": node_name,
        "staticPodPath": args.manifest_dir,
        "staticPodURL": args.manifest_url,
        "syncFrequency": go(args.sync_frequency),
        "address": s.address.to_string(),
        "port": s.port,
        "tlsCertFile": s.tls_cert_file,
        "tlsPrivateKeyFile": s.tls_private_key_file,
        "authentication": {
            "x509": { "clientCAFile": s.client_ca_file },
            "webhook": {
                "enabled": s.authentication_token_webhook,
                "cacheTTL": go(s.authentication_token_webhook_cache_ttl),
            },
            "anonymous": { "enabled": s.anonymous_auth },
        },
        "authorization": {
            "mode": match s.authorization_mode {
                AuthorizationModeFlag::AlwaysAllow => "AlwaysAllow",
                AuthorizationModeFlag::Webhook => "Webhook",
            },
            "webhook": {
                "cacheAuthorizedTTL": go(s.authorization_webhook_cache_authorized_ttl),
                "cacheUnauthorizedTTL": go(s.authorization_webhook_cache_unauthorized_ttl),
            },
        },
        "clusterDomain": args.cluster_domain,
        "clusterDNS": args.cluster_dns.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "resolvConf": args.resolv_conf,
        "podLogsDir": args.pod_log_dir,
        "containerLogMaxSize": binary_quantity(args.container_log_max_size),
        "containerLogMaxFiles": args.container_log_max_files,
        "containerLogMonitorInterval": go(args.container_log_monitor_interval),
        "maxPods": args.max_pods,
        "allowedUnsafeSysctls": list(&args.allowed_unsafe_sysctls),
        "registerWithTaints": list(&args.register_with_taints),
        "systemReserved": pairs(&args.system_reserved),
        "kubeReserved": pairs(&args.kube_reserved),
        "nodeStatusUpdateFrequency": go(args.node_status_update_frequency),
        "nodeLeaseDurationSeconds": args.node_lease_duration_seconds,
        "runtimeStatusPeriod": go(args.runtime_status_period),
        "containerRuntimeEndpoint": args.common.cri_endpoint,
    }})
}

/// A comma-separated flag's items.
fn list(v: &str) -> Vec<&str> {
    v.split(',').filter(|s| !s.is_empty()).collect()
}

/// `bytes` as the API prints a binary quantity: the largest unit that
/// divides it (`10Mi`, `500Ki`, `1000`).
fn binary_quantity(bytes: u64) -> String {
    for (unit, size) in [
        ("Ti", 1u64 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn the_document_names_each_setting_as_the_kubelet_s_configuration() {
        let args = RunArgs::try_parse_from([
            "evpleg",
            "--sync-frequency",
            "90s",
            "--port",
            "10250",
            "--cluster-dns",
            "10.0.0.10",
            "--container-log-max-size",
            "10Mi",
            "--allowed-unsafe-sysctls",
            "net.core.*,kernel.msg*",
            "--system-reserved",
            "cpu=100m,memory=1Gi",
        ])
        .expect("flags");
        let doc = document(&args, "node-a");
        let c = &doc["kubeletconfig"];
        assert_eq!(c["nodeName"], "node-a");
        assert_eq!(c["syncFrequency"], "1m30s");
        assert_eq!(c["port"], 10250);
        assert_eq!(c["clusterDNS"], json!(["10.0.0.10"]));
        assert_eq!(c["containerLogMaxSize"], "10Mi");
        assert_eq!(
            c["allowedUnsafeSysctls"],
            json!(["net.core.*", "kernel.msg*"])
        );
        assert_eq!(c["systemReserved"], json!({"cpu": "100m", "memory": "1Gi"}));
        assert_eq!(c["authentication"]["anonymous"]["enabled"], false);
        assert_eq!(c["authorization"]["mode"], "Webhook");
        assert_eq!(c["authentication"]["webhook"]["cacheTTL"], "2m0s");
        assert_eq!(
            [0, 1000, 1024, 1536, 3 << 20, 1 << 30].map(binary_quantity),
            ["0", "1000", "1Ki", "1536", "3Mi", "1Gi"]
        );
    }
}

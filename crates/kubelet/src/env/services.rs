//! The service environment: the kubelet's `getServiceEnvVarMap`
//! (`kubelet_pods.go`) and `envvars.FromServices` (`pkg/kubelet/envvars`).
//! The `kubernetes` Service of the `default` namespace is always given (so
//! `rest.InClusterConfig` finds `KUBERNETES_SERVICE_HOST`/`_PORT`); with
//! `enableServiceLinks` (unset is true, the API's default) every Service of
//! the pod's namespace is given too, a same-named one of the pod's namespace
//! winning over `default/kubernetes`. Services without a cluster IP
//! (headless, `None`) give nothing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;

/// The namespace of the API server's own Service.
pub const MASTER_NAMESPACE: &str = "default";
/// The API server's own Service (the kubelet's `masterServices`).
pub const MASTER_SERVICE: &str = "kubernetes";

/// The variables of the Services a pod of `namespace` sees (the kubelet's
/// `getServiceEnvVarMap`).
pub fn service_env(
    services: &[Service],
    namespace: &str,
    enable_service_links: bool,
) -> BTreeMap<String, String> {
    let mut chosen: BTreeMap<String, &Service> = BTreeMap::new();
    for s in services.iter().filter(|s| cluster_ip(s).is_some()) {
        let name = s.metadata.name.clone().unwrap_or_default();
        let ns = s.metadata.namespace.as_deref().unwrap_or(MASTER_NAMESPACE);
        if ns == MASTER_NAMESPACE && name == MASTER_SERVICE {
            chosen.entry(name).or_insert(s);
        } else if ns == namespace && enable_service_links {
            chosen.insert(name, s);
        }
    }
    let mut out = BTreeMap::new();
    for s in chosen.values() {
        from_service(s, &mut out);
    }
    out
}

fn cluster_ip(s: &Service) -> Option<&str> {
    let ip = s.spec.as_ref()?.cluster_ip.as_deref()?;
    (!ip.is_empty() && ip != "None").then_some(ip)
}

/// `makeEnvVariableName`: upper case, `-` as `_`.
fn env_name(s: &str) -> String {
    s.replace('-', "_").to_uppercase()
}

/// One Service's variables (`FromServices`, `makeLinkVariables`): Docker's
/// link variables and `<NAME>_SERVICE_HOST` / `_SERVICE_PORT[_<PORT>]`.
fn from_service(s: &Service, out: &mut BTreeMap<String, String>) {
    let Some(ip) = cluster_ip(s) else {
        return;
    };
    let name = env_name(s.metadata.name.as_deref().unwrap_or_default());
    out.insert(format!("{name}_SERVICE_HOST"), ip.to_owned());
    let ports = s
        .spec
        .as_ref()
        .and_then(|spec| spec.ports.as_deref())
        .unwrap_or_default();
    let Some(first) = ports.first() else {
        return;
    };
    out.insert(format!("{name}_SERVICE_PORT"), first.port.to_string());
    for p in ports {
        if let Some(port_name) = p.name.as_deref().filter(|n| !n.is_empty()) {
            out.insert(
                format!("{name}_SERVICE_PORT_{}", env_name(port_name)),
                p.port.to_string(),
            );
        }
    }
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_owned()
    };
    for (i, p) in ports.iter().enumerate() {
        let protocol = p.protocol.as_deref().unwrap_or("TCP");
        let url = format!("{}://{host}:{}", protocol.to_lowercase(), p.port);
        let prefix = format!("{name}_PORT_{}_{}", p.port, protocol.to_uppercase());
        if i == 0 {
            out.insert(format!("{name}_PORT"), url.clone());
        }
        out.insert(prefix.clone(), url);
        out.insert(format!("{prefix}_PROTO"), protocol.to_lowercase());
        out.insert(format!("{prefix}_PORT"), p.port.to_string());
        out.insert(format!("{prefix}_ADDR"), ip.to_owned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(ns: &str, name: &str, ip: &str, ports: serde_json::Value) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ip, "ports": ports}
        }))
        .unwrap()
    }

    fn services() -> Vec<Service> {
        vec![
            service(
                "default",
                "kubernetes",
                "10.0.0.1",
                serde_json::json!([{"name": "https", "port": 443, "protocol": "TCP"}]),
            ),
            service(
                "web",
                "my-db",
                "10.0.0.7",
                serde_json::json!([{"name": "pg", "port": 5432, "protocol": "TCP"},
                                   {"name": "dns-udp", "port": 53, "protocol": "UDP"}]),
            ),
            service("web", "headless", "None", serde_json::json!([{"port": 80}])),
            service(
                "other",
                "elsewhere",
                "10.0.0.9",
                serde_json::json!([{"port": 80}]),
            ),
            service("web", "v6", "fd00::5", serde_json::json!([{"port": 80}])),
        ]
    }

    /// The kubelet's `TestMakeEnvironmentVariables` service cases: the
    /// master service always, the pod's namespace's with service links,
    /// nothing for headless Services or other namespaces.
    #[test]
    fn the_kubelet_s_service_variables() {
        let env = service_env(&services(), "web", true);
        let want: BTreeMap<String, String> = [
            ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("KUBERNETES_SERVICE_PORT_HTTPS", "443"),
            ("KUBERNETES_PORT", "tcp://10.0.0.1:443"),
            ("KUBERNETES_PORT_443_TCP", "tcp://10.0.0.1:443"),
            ("KUBERNETES_PORT_443_TCP_PROTO", "tcp"),
            ("KUBERNETES_PORT_443_TCP_PORT", "443"),
            ("KUBERNETES_PORT_443_TCP_ADDR", "10.0.0.1"),
            ("MY_DB_SERVICE_HOST", "10.0.0.7"),
            ("MY_DB_SERVICE_PORT", "5432"),
            ("MY_DB_SERVICE_PORT_PG", "5432"),
            ("MY_DB_SERVICE_PORT_DNS_UDP", "53"),
            ("MY_DB_PORT", "tcp://10.0.0.7:5432"),
            ("MY_DB_PORT_5432_TCP", "tcp://10.0.0.7:5432"),
            ("MY_DB_PORT_5432_TCP_PROTO", "tcp"),
            ("MY_DB_PORT_5432_TCP_PORT", "5432"),
            ("MY_DB_PORT_5432_TCP_ADDR", "10.0.0.7"),
            ("MY_DB_PORT_53_UDP", "udp://10.0.0.7:53"),
            ("MY_DB_PORT_53_UDP_PROTO", "udp"),
            ("MY_DB_PORT_53_UDP_PORT", "53"),
            ("MY_DB_PORT_53_UDP_ADDR", "10.0.0.7"),
            ("V6_SERVICE_HOST", "fd00::5"),
            ("V6_SERVICE_PORT", "80"),
            ("V6_PORT", "tcp://[fd00::5]:80"),
            ("V6_PORT_80_TCP", "tcp://[fd00::5]:80"),
            ("V6_PORT_80_TCP_PROTO", "tcp"),
            ("V6_PORT_80_TCP_PORT", "80"),
            ("V6_PORT_80_TCP_ADDR", "fd00::5"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(env, want);
        // Without service links only the master service's.
        let env = service_env(&services(), "web", false);
        assert_eq!(env.len(), 8, "{env:#?}");
        assert!(env.keys().all(|k| k.starts_with("KUBERNETES_")), "{env:#?}");
        // A pod in `default` with its own links sees `kubernetes` once.
        let env = service_env(&services(), "default", true);
        assert_eq!(env["KUBERNETES_SERVICE_HOST"], "10.0.0.1");
        assert_eq!(env.len(), 8, "{env:#?}");
    }

    /// A Service of the pod's namespace named `kubernetes` wins over the
    /// master's, whatever the listing's order (the kubelet keeps the master's
    /// only while no other is chosen).
    #[test]
    fn a_kubernetes_service_of_the_pod_s_namespace_wins() {
        let mut list = services();
        list.push(service(
            "web",
            "kubernetes",
            "10.0.0.99",
            serde_json::json!([{"port": 8443}]),
        ));
        for list in [list.clone(), list.into_iter().rev().collect()] {
            let env = service_env(&list, "web", true);
            assert_eq!(env["KUBERNETES_SERVICE_HOST"], "10.0.0.99");
            assert_eq!(env["KUBERNETES_SERVICE_PORT"], "8443");
        }
    }
}

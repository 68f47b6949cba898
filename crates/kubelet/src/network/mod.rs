//! The pod's network identity, as the kubelet gives it to the runtime and
//! the containers: the hostname and domain (`GeneratePodHostNameAndDomain`
//! and `GetNodenameForKernel`, `kubelet_pods.go` and `pkg/kubelet/util`), the
//! resolver configuration ([`dns`], `pkg/kubelet/network/dns`) and the
//! managed `/etc/hosts` ([`hosts`], `makeHostsMount`). The network itself is
//! the runtime's: containerd's CRI plugin creates the pod's network namespace
//! and calls the CNI plugins in RunPodSandbox, and tears them down in
//! StopPodSandbox; the agent passes the hostname, DNS config and port
//! mappings in the sandbox config and reads the pod's IPs back from
//! PodSandboxStatus ([`crate::kuberuntime`]). See docs/network.md.

pub mod dns;
pub mod hosts;

use k8s_openapi::api::core::v1::Pod;

/// The kernel's limit of a hostname (64 bytes with its terminating NUL).
const HOSTNAME_MAX: usize = 63;
/// The kernel's limit of the FQDN set as the hostname (`setHostnameAsFQDN`).
const FQDN_MAX: usize = 64;

/// Why the pod's hostname cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NetworkError {
    #[error("pod {field} {value:?} is not a valid DNS label")]
    InvalidLabel { field: &'static str, value: String },
    #[error("hostname for pod {pod:?} was invalid: {hostname:?}")]
    InvalidHostname { pod: String, hostname: String },
    #[error(
        "failed to construct FQDN from pod hostname and cluster domain, FQDN {fqdn} is too long ({FQDN_MAX} characters is the max, {} characters requested)",
        fqdn.len()
    )]
    FqdnTooLong { fqdn: String },
}

pub use evpleg_core::names::is_dns_label;

/// The pod's hostname and domain (the kubelet's
/// `GeneratePodHostNameAndDomain`): `spec.hostname` or the pod's name, cut to
/// 63 characters without a trailing `-` or `.`; with `spec.subdomain` the
/// domain `<subdomain>.<namespace>.svc.<cluster domain>`, else empty.
pub fn hostname_and_domain(
    pod: &Pod,
    cluster_domain: &str,
) -> Result<(String, String), NetworkError> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let spec = pod.spec.clone().unwrap_or_default();
    let mut hostname = name.clone();
    if let Some(h) = spec.hostname.filter(|h| !h.is_empty()) {
        if !is_dns_label(&h) {
            return Err(NetworkError::InvalidLabel {
                field: "Hostname",
                value: h,
            });
        }
        hostname = h;
    }
    if hostname.len() > HOSTNAME_MAX {
        let cut = hostname[..HOSTNAME_MAX].trim_end_matches(['-', '.']);
        if cut.is_empty() {
            return Err(NetworkError::InvalidHostname {
                pod: name,
                hostname,
            });
        }
        hostname = cut.to_owned();
    }
    let mut domain = String::new();
    if let Some(sub) = spec.subdomain.filter(|s| !s.is_empty()) {
        if !is_dns_label(&sub) {
            return Err(NetworkError::InvalidLabel {
                field: "Subdomain",
                value: sub,
            });
        }
        let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
        domain = format!("{sub}.{namespace}.svc.{cluster_domain}");
    }
    Ok((hostname, domain))
}

/// The name the pod's UTS namespace gets (the kubelet's
/// `GetNodenameForKernel`): the hostname, or with `setHostnameAsFQDN` and a
/// domain the FQDN, which must fit the kernel's 64 characters.
pub fn kernel_hostname(
    hostname: &str,
    domain: &str,
    set_as_fqdn: bool,
) -> Result<String, NetworkError> {
    if !set_as_fqdn || domain.is_empty() {
        return Ok(hostname.to_owned());
    }
    let fqdn = format!("{hostname}.{domain}");
    if fqdn.len() > FQDN_MAX {
        return Err(NetworkError::FqdnTooLong { fqdn });
    }
    Ok(fqdn)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, spec: serde_json::Value) -> Pod {
        let mut spec = spec;
        spec["containers"] = serde_json::json!([]);
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn hostname_and_domain_as_the_kubelet_makes_them() {
        let long = format!("{}-{}", "a".repeat(62), "b".repeat(5));
        type Want<'a> = Result<(&'a str, &'a str), NetworkError>;
        let cases: Vec<(Pod, Want)> = vec![
            (pod("web", serde_json::json!({})), Ok(("web", ""))),
            (
                pod("web", serde_json::json!({"hostname": "h1"})),
                Ok(("h1", "")),
            ),
            (
                pod(
                    "web",
                    serde_json::json!({"hostname": "h1", "subdomain": "sub"}),
                ),
                Ok(("h1", "sub.ns.svc.cluster.local")),
            ),
            (
                pod("web", serde_json::json!({"subdomain": "sub"})),
                Ok(("web", "sub.ns.svc.cluster.local")),
            ),
            // Cut to 63 characters, the trailing '-' dropped.
            (pod(&long, serde_json::json!({})), Ok((&long[..62], ""))),
            (
                pod("web", serde_json::json!({"hostname": "Not_A_Label"})),
                Err(NetworkError::InvalidLabel {
                    field: "Hostname",
                    value: "Not_A_Label".into(),
                }),
            ),
            (
                pod("web", serde_json::json!({"subdomain": "a.b"})),
                Err(NetworkError::InvalidLabel {
                    field: "Subdomain",
                    value: "a.b".into(),
                }),
            ),
        ];
        for (p, want) in cases {
            let got = hostname_and_domain(&p, "cluster.local");
            let want = want.map(|(h, d)| (h.to_owned(), d.to_owned()));
            assert_eq!(got, want, "{:?}", p.spec);
        }
        let err = hostname_and_domain(&pod("web", serde_json::json!({"hostname": "-x"})), "c")
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "pod Hostname \"-x\" is not a valid DNS label"
        );
    }

    #[test]
    fn kernel_hostname_with_and_without_fqdn() {
        assert_eq!(kernel_hostname("h", "d.ns.svc.c", false).unwrap(), "h");
        assert_eq!(kernel_hostname("h", "", true).unwrap(), "h");
        assert_eq!(
            kernel_hostname("h", "d.ns.svc.c", true).unwrap(),
            "h.d.ns.svc.c"
        );
        let err = kernel_hostname(&"h".repeat(60), "d.ns.svc.c", true).unwrap_err();
        assert!(err.to_string().contains("71 characters requested"), "{err}");
    }
}

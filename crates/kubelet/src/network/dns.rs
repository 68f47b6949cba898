//! The pod's resolver configuration, as the kubelet's DNS configurer
//! (`pkg/kubelet/network/dns/dns.go`, `GetPodDNS`), handed to the runtime in
//! the sandbox config (containerd writes the pod's `resolv.conf` from it):
//!
//! - `ClusterFirst` (the default; for a host-network pod it means `Default`)
//!   and `ClusterFirstWithHostNet`: the `--cluster-dns` servers only, the
//!   searches `<namespace>.svc.<domain>`, `svc.<domain>`, `<domain>` before
//!   the host's, and `ndots:5`. Without `--cluster-dns` the kubelet falls back
//!   to `Default` with a `MissingClusterDNS` warning, and so does evpleg.
//! - `Default`: the servers, searches and options of `--resolv-conf`; with
//!   `--resolv-conf ""`, `127.0.0.1` and the search `.`.
//! - `None`: nothing but `dnsConfig`.
//!
//! `dnsConfig` is then appended (servers and searches without duplicates,
//! options merged by name, the pod's winning) and the result cut to the
//! kubelet's limits (3 servers; 32 searches, none over 253 characters, 2048
//! characters in all) with a `DNSConfigForming` warning. One difference: the
//! kubelet merges options through a Go map (their order varies); here the
//! existing options keep their order and new ones follow.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::Pod;

/// The kubelet's default option for cluster DNS.
const DEFAULT_OPTIONS: [&str; 1] = ["ndots:5"];
/// `validation.MaxDNSNameservers`.
const MAX_SERVERS: usize = 3;
/// `MaxDNSSearchPathsExpanded` (ExpandedDNSConfig, GA).
const MAX_SEARCHES: usize = 32;
/// `MaxDNSSearchListCharsExpanded`.
const MAX_SEARCH_CHARS: usize = 2048;
/// `DNS1123SubdomainMaxLength`.
const MAX_SEARCH_LEN: usize = 253;
/// The kubelet reads at most this much of a resolv.conf.
const MAX_RESOLV_CONF: u64 = 10 << 20;

/// The event reasons of DNS warnings.
pub const DNS_CONFIG_FORMING: &str = "DNSConfigForming";
pub const MISSING_CLUSTER_DNS: &str = "MissingClusterDNS";

/// Why the pod's DNS config cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("cannot read resolv.conf {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("resolv.conf {path}: {message}")]
    Parse { path: PathBuf, message: String },
}

/// A warning about the pod's DNS (an event's reason and message).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsWarning {
    pub reason: &'static str,
    pub message: String,
}

/// The node's DNS settings (`--cluster-dns`, `--cluster-domain`,
/// `--resolv-conf`).
#[derive(Clone, Debug, Default)]
pub struct Configurer {
    pub cluster_dns: Vec<IpAddr>,
    pub cluster_domain: String,
    /// Empty: no host resolver configuration (the kubelet's `--resolv-conf=""`).
    pub resolv_conf: Option<PathBuf>,
    /// The node's IP: its family decides the loopback server without a
    /// resolv.conf.
    pub node_ip: Option<IpAddr>,
}

/// Servers, searches and options of a resolv.conf (the kubelet's
/// `parseResolvConf`): `nameserver` lines accumulate, the last `search` and
/// `options` lines win, searches lose a trailing dot.
pub fn parse_resolv_conf(text: &str) -> Result<v1::DnsConfig, String> {
    let mut out = v1::DnsConfig::default();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let mut fields = line.split_whitespace();
        match fields.next() {
            Some("nameserver") => match fields.next() {
                Some(s) => out.servers.push(s.to_owned()),
                None => return Err("nameserver list is empty".into()),
            },
            Some("search") => {
                out.searches = fields.map(|s| s.trim_end_matches('.').to_owned()).collect()
            }
            Some("options") => out.options = fields.map(str::to_owned).collect(),
            _ => {}
        }
    }
    Ok(out)
}

fn push_unique(into: &mut Vec<String>, more: impl IntoIterator<Item = String>) {
    for s in more {
        if !into.contains(&s) {
            into.push(s);
        }
    }
}

/// Options merged by name (`name` or `name:value`); `more` wins.
fn merge_options(existing: &[String], more: &[(String, Option<String>)]) -> Vec<String> {
    let mut named: Vec<(String, Option<String>)> = Vec::new();
    let mut set = |name: &str, value: Option<String>| {
        let value = value.filter(|v| !v.is_empty());
        match named.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = value,
            None => named.push((name.to_owned(), value)),
        }
    };
    for o in existing {
        match o.split_once(':') {
            Some((n, v)) => set(n, Some(v.to_owned())),
            None => set(o, None),
        }
    }
    for (n, v) in more {
        set(n, v.clone());
    }
    named
        .into_iter()
        .map(|(n, v)| match v {
            Some(v) => format!("{n}:{v}"),
            None => n,
        })
        .collect()
}

/// The kubelet's limits: at most 3 servers; searches over 253 characters
/// dropped, at most 32, at most 2048 characters in all.
fn fit_limits(mut c: v1::DnsConfig, warnings: &mut Vec<DnsWarning>) -> v1::DnsConfig {
    if c.servers.len() > MAX_SERVERS {
        c.servers.truncate(MAX_SERVERS);
        warnings.push(DnsWarning {
            reason: DNS_CONFIG_FORMING,
            message: format!(
                "Nameserver limits were exceeded, some nameservers have been omitted, the applied nameserver line is: {}",
                c.servers.join(" ")
            ),
        });
    }
    let mut exceeded = c.searches.len() > MAX_SEARCHES;
    c.searches.truncate(MAX_SEARCHES);
    let before = c.searches.len();
    c.searches.retain(|s| s.len() <= MAX_SEARCH_LEN);
    exceeded |= c.searches.len() != before;
    while c.searches.join(" ").len() > MAX_SEARCH_CHARS {
        c.searches.pop();
        exceeded = true;
    }
    if exceeded {
        warnings.push(DnsWarning {
            reason: DNS_CONFIG_FORMING,
            message: format!(
                "Search Line limits were exceeded, some search paths have been omitted, the applied search line is: {}",
                c.searches.join(" ")
            ),
        });
    }
    c
}

/// The DNS policy of a pod, resolved as the kubelet's `getPodDNSType`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DnsType {
    Cluster,
    Host,
    None,
}

fn dns_type(pod: &Pod) -> DnsType {
    let spec = pod.spec.as_ref();
    let host_network = spec.and_then(|s| s.host_network).unwrap_or(false);
    match spec.and_then(|s| s.dns_policy.as_deref()) {
        Some("None") => DnsType::None,
        Some("ClusterFirstWithHostNet") => DnsType::Cluster,
        Some("Default") => DnsType::Host,
        // ClusterFirst, the default; on the host network it means Default.
        _ if host_network => DnsType::Host,
        _ => DnsType::Cluster,
    }
}

impl Configurer {
    fn host_config(&self) -> Result<v1::DnsConfig, DnsError> {
        let Some(path) = &self.resolv_conf else {
            return Ok(v1::DnsConfig::default());
        };
        read_resolv_conf(path)
    }

    /// The pod's DNS config, and the warnings to record as events.
    pub fn pod_dns(&self, pod: &Pod) -> Result<(v1::DnsConfig, Vec<DnsWarning>), DnsError> {
        let mut warnings = Vec::new();
        let host = self.host_config()?;
        let mut config = match dns_type(pod) {
            DnsType::None => v1::DnsConfig::default(),
            DnsType::Cluster if !self.cluster_dns.is_empty() => {
                let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
                let mut searches = Vec::new();
                if !self.cluster_domain.is_empty() {
                    let d = &self.cluster_domain;
                    searches = vec![
                        format!("{namespace}.svc.{d}"),
                        format!("svc.{d}"),
                        d.clone(),
                    ];
                }
                push_unique(&mut searches, host.searches);
                v1::DnsConfig {
                    servers: self.cluster_dns.iter().map(IpAddr::to_string).collect(),
                    searches,
                    options: DEFAULT_OPTIONS.iter().map(|s| s.to_string()).collect(),
                }
            }
            kind => {
                if kind == DnsType::Cluster {
                    warnings.push(DnsWarning {
                        reason: MISSING_CLUSTER_DNS,
                        message: "evpleg does not have ClusterDNS IP configured and cannot create Pod using \"ClusterFirst\" policy. Falling back to \"Default\" policy.".into(),
                    });
                }
                let mut host = host;
                if self.resolv_conf.is_none() {
                    let loopback = match self.node_ip {
                        Some(IpAddr::V6(_)) => "::1",
                        _ => "127.0.0.1",
                    };
                    host.servers = vec![loopback.into()];
                    host.searches = vec![".".into()];
                }
                host
            }
        };
        if let Some(extra) = pod.spec.as_ref().and_then(|s| s.dns_config.as_ref()) {
            push_unique(
                &mut config.servers,
                extra.nameservers.clone().unwrap_or_default(),
            );
            push_unique(
                &mut config.searches,
                extra.searches.clone().unwrap_or_default(),
            );
            let options: Vec<(String, Option<String>)> = extra
                .options
                .iter()
                .flatten()
                .map(|o| (o.name.clone().unwrap_or_default(), o.value.clone()))
                .collect();
            config.options = merge_options(&config.options, &options);
        }
        Ok((fit_limits(config, &mut warnings), warnings))
    }
}

fn read_resolv_conf(path: &Path) -> Result<v1::DnsConfig, DnsError> {
    use std::io::Read as _;
    let read = |source| DnsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(read)?
        .take(MAX_RESOLV_CONF)
        .read_to_string(&mut text)
        .map_err(read)?;
    parse_resolv_conf(&text).map_err(|message| DnsError::Parse {
        path: path.to_path_buf(),
        message,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        let mut spec = spec;
        spec["containers"] = serde_json::json!([]);
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"}, "spec": spec,
        }))
        .unwrap()
    }

    fn configurer(dir: &Path, cluster_dns: &[&str]) -> Configurer {
        let resolv = dir.join("resolv.conf");
        std::fs::write(
            &resolv,
            "# host\nnameserver 192.0.2.53\nnameserver 192.0.2.54\nsearch example.com. corp\noptions ndots:2 rotate\n",
        )
        .unwrap();
        Configurer {
            cluster_dns: cluster_dns.iter().map(|s| s.parse().unwrap()).collect(),
            cluster_domain: "cluster.local".into(),
            resolv_conf: Some(resolv),
            node_ip: None,
        }
    }

    fn dns(c: &Configurer, spec: serde_json::Value) -> (Vec<String>, Vec<String>, Vec<String>) {
        let (d, _) = c.pod_dns(&pod(spec)).unwrap();
        (d.servers, d.searches, d.options)
    }

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn policies_as_the_kubelet_resolves_them() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let c = configurer(dir, &["10.96.0.10"]);
        let cluster = (
            v(&["10.96.0.10"]),
            v(&[
                "ns.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local",
                "example.com",
                "corp",
            ]),
            v(&["ndots:5"]),
        );
        let host = (
            v(&["192.0.2.53", "192.0.2.54"]),
            v(&["example.com", "corp"]),
            v(&["ndots:2", "rotate"]),
        );
        let cases = [
            (serde_json::json!({}), &cluster),
            (serde_json::json!({"dnsPolicy": "ClusterFirst"}), &cluster),
            (serde_json::json!({"hostNetwork": true}), &host),
            (
                serde_json::json!({"hostNetwork": true, "dnsPolicy": "ClusterFirstWithHostNet"}),
                &cluster,
            ),
            (serde_json::json!({"dnsPolicy": "Default"}), &host),
        ];
        for (spec, want) in cases {
            assert_eq!(&dns(&c, spec.clone()), want, "{spec}");
        }
        // None: only dnsConfig.
        let none = serde_json::json!({"dnsPolicy": "None", "dnsConfig": {
            "nameservers": ["1.1.1.1"], "searches": ["a.example"],
            "options": [{"name": "ndots", "value": "1"}, {"name": "edns0"}]}});
        assert_eq!(
            dns(&c, none),
            (v(&["1.1.1.1"]), v(&["a.example"]), v(&["ndots:1", "edns0"]))
        );
        // dnsConfig appended to ClusterFirst: duplicates dropped, options merged.
        let merged = serde_json::json!({"dnsConfig": {
            "nameservers": ["10.96.0.10", "1.1.1.1"], "searches": ["corp", "extra"],
            "options": [{"name": "ndots", "value": "2"}, {"name": "trust-ad"}]}});
        let (servers, searches, options) = dns(&c, merged);
        assert_eq!(servers, v(&["10.96.0.10", "1.1.1.1"]));
        assert_eq!(searches.last().unwrap(), "extra");
        assert_eq!(searches.len(), 6);
        assert_eq!(options, v(&["ndots:2", "trust-ad"]));
    }

    #[test]
    fn missing_cluster_dns_falls_back_to_default_with_a_warning() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let c = configurer(dir, &[]);
        let (d, warnings) = c.pod_dns(&pod(serde_json::json!({}))).unwrap();
        assert_eq!(d.servers, v(&["192.0.2.53", "192.0.2.54"]));
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].reason, MISSING_CLUSTER_DNS);
        // No resolv.conf at all: the loopback resolver, search ".".
        let bare = Configurer {
            resolv_conf: None,
            ..c
        };
        let (d, _) = bare
            .pod_dns(&pod(serde_json::json!({"dnsPolicy": "Default"})))
            .unwrap();
        assert_eq!((d.servers, d.searches), (v(&["127.0.0.1"]), v(&["."])));
        // An unreadable resolv.conf names its path.
        let gone = Configurer {
            resolv_conf: Some(dir.join("missing")),
            ..Configurer::default()
        };
        let err = gone.pod_dns(&pod(serde_json::json!({}))).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn limits_cut_servers_and_searches_with_warnings() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let c = configurer(dir, &["10.96.0.10"]);
        let many: Vec<String> = (0..40).map(|i| format!("s{i}.example")).collect();
        let spec = serde_json::json!({"dnsConfig": {
            "nameservers": ["1.1.1.1", "1.0.0.1", "8.8.8.8"],
            "searches": many, }});
        let (d, warnings) = c.pod_dns(&pod(spec)).unwrap();
        assert_eq!(d.servers, v(&["10.96.0.10", "1.1.1.1", "1.0.0.1"]));
        assert_eq!(d.searches.len(), MAX_SEARCHES);
        let reasons: Vec<_> = warnings.iter().map(|w| w.reason).collect();
        assert_eq!(reasons, [DNS_CONFIG_FORMING, DNS_CONFIG_FORMING]);
        assert!(warnings[0].message.ends_with("10.96.0.10 1.1.1.1 1.0.0.1"));
    }

    #[test]
    fn resolv_conf_parsing() {
        let d = parse_resolv_conf(
            "nameserver 1.2.3.4\nsearch a b\nsearch c.\noptions x\n# nameserver 9.9.9.9\n",
        )
        .unwrap();
        assert_eq!(
            (d.servers, d.searches, d.options),
            (v(&["1.2.3.4"]), v(&["c"]), v(&["x"]))
        );
        assert_eq!(
            parse_resolv_conf("nameserver\n").unwrap_err(),
            "nameserver list is empty"
        );
    }
}

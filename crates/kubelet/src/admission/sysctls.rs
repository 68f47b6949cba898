//! Pod sysctls against the node's allowlist: the kubelet's sysctl admit
//! handler (`pkg/kubelet/sysctl/allowlist.go`, `patternAllowlist.Admit`),
//! built from its safe set (`safe_sysctls.go`, `SafeSysctlAllowlist`) and
//! `--allowed-unsafe-sysctls` (names, or prefixes ending in `*`), each known
//! to be namespaced (`component-helpers`' `NamespacedBy`: `kernel.sem`,
//! `kernel.shm*`, `kernel.msg*`, `fs.mqueue.*` in the IPC namespace, `net.*`
//! in the network namespace), or the flag is refused naming it.
//!
//! A pod whose `securityContext.sysctls` has a name not allowed is rejected
//! with [`FORBIDDEN_REASON`] and "forbidden sysctl: \"<name>\" not
//! allowlisted"; an allowed one of a namespace the pod shares with the host
//! (`hostNetwork`, `hostIPC`) with "\"<name>\" not allowed with host
//! <net|ipc> enabled". Names may be written with `/` as the separator
//! (`ConvertSysctlVariableToDotsSeparator`). Safe sysctls that need a newer
//! kernel than the node's are left out of the safe set, as the kubelet's.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

use super::Rejection;

/// The kubelet's `ForbiddenReason`.
pub const FORBIDDEN_REASON: &str = "SysctlForbidden";

/// The kubelet's safe sysctls and the kernel each needs to be namespaced
/// (`None`: any).
pub const SAFE_SYSCTLS: [(&str, Option<(u32, u32)>); 12] = [
    ("kernel.shm_rmid_forced", None),
    ("net.ipv4.ip_local_port_range", None),
    ("net.ipv4.tcp_syncookies", None),
    ("net.ipv4.ping_group_range", None),
    ("net.ipv4.ip_unprivileged_port_start", None),
    ("net.ipv4.ip_local_reserved_ports", Some((3, 16))),
    ("net.ipv4.tcp_keepalive_time", Some((4, 5))),
    ("net.ipv4.tcp_fin_timeout", Some((4, 6))),
    ("net.ipv4.tcp_keepalive_intvl", Some((4, 5))),
    ("net.ipv4.tcp_keepalive_probes", Some((4, 5))),
    ("net.ipv4.tcp_rmem", None),
    ("net.ipv4.tcp_wmem", None),
];

/// A kernel namespace a sysctl belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Namespace {
    Ipc,
    Net,
}

impl Namespace {
    fn as_str(self) -> &'static str {
        match self {
            Namespace::Ipc => "ipc",
            Namespace::Net => "net",
        }
    }
}

/// An `--allowed-unsafe-sysctls` entry that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SysctlError {
    #[error(
        "--allowed-unsafe-sysctls: sysctl {0:?} must have at most 253 characters and match [a-z0-9]([-_a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-_a-z0-9]*[a-z0-9])?)* with an optional trailing *"
    )]
    Pattern(String),
    #[error("--allowed-unsafe-sysctls: the sysctls {0:?} are not known to be namespaced")]
    NotNamespaced(String),
}

/// `NamespacedBy`.
pub fn namespaced_by(name: &str) -> Option<Namespace> {
    if name == "kernel.sem" {
        return Some(Namespace::Ipc);
    }
    let prefixes = [
        ("kernel.shm", Namespace::Ipc),
        ("kernel.msg", Namespace::Ipc),
        ("fs.mqueue.", Namespace::Ipc),
        ("net.", Namespace::Net),
    ];
    prefixes
        .iter()
        .find(|(p, _)| name.starts_with(p))
        .map(|(_, ns)| *ns)
}

/// `ConvertSysctlVariableToDotsSeparator`: `a/b.c/d` is `a.b/c.d`.
pub fn dotted(name: &str) -> String {
    let slash_first = name.find(['.', '/']).is_some_and(|i| &name[i..=i] == "/");
    if !slash_first {
        return name.to_owned();
    }
    name.chars()
        .map(|c| match c {
            '/' => '.',
            '.' => '/',
            c => c,
        })
        .collect()
}

/// `IsValidSysctlPattern`, for the flag: a dotted (or slashed) name, with
/// an optional trailing `*`.
fn valid_pattern(p: &str) -> bool {
    let name = p.strip_suffix('*').unwrap_or(p);
    let name = name.strip_suffix(['.', '/']).unwrap_or(name);
    !name.is_empty()
        && p.len() <= 253
        && name.split(['.', '/']).all(|seg| {
            let b = seg.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter().all(|c| {
                    c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'_'
                })
        })
}

/// Names and prefixes allowed, each with its namespace.
#[derive(Clone, Debug, Default)]
pub struct Allowlist {
    sysctls: BTreeMap<String, Namespace>,
    prefixes: BTreeMap<String, Namespace>,
}

impl Allowlist {
    /// The kubelet's safe set for a kernel `kernel` (`(major, minor)`;
    /// `None`: unknown, so only the sysctls that need none) plus `unsafe_`
    /// (`--allowed-unsafe-sysctls`, comma-separated).
    pub fn new(kernel: Option<(u32, u32)>, unsafe_: &str) -> Result<Self, SysctlError> {
        let flagged = unsafe_.split(',').map(str::trim).filter(|s| !s.is_empty());
        let mut w = Allowlist::safe(kernel);
        for p in flagged {
            if !valid_pattern(p) {
                return Err(SysctlError::Pattern(p.to_owned()));
            }
            let p = dotted(p);
            let (map, name) = match p.strip_suffix('*') {
                Some(prefix) => (&mut w.prefixes, prefix.to_owned()),
                None => (&mut w.sysctls, p.clone()),
            };
            let ns = namespaced_by(&name).ok_or(SysctlError::NotNamespaced(p.clone()))?;
            map.insert(name, ns);
        }
        Ok(w)
    }

    /// The safe set for `kernel`, nothing else.
    pub fn safe(kernel: Option<(u32, u32)>) -> Self {
        let mut w = Allowlist::default();
        for (name, need) in SAFE_SYSCTLS {
            if let (Some(ns), true) = (
                namespaced_by(name),
                need.is_none_or(|n| kernel.is_some_and(|k| k >= n)),
            ) {
                w.sysctls.insert(name.to_owned(), ns);
            }
        }
        w
    }

    /// This host's kernel (`/proc/sys/kernel/osrelease`; unknown if
    /// unreadable).
    pub fn host_kernel() -> Option<(u32, u32)> {
        kernel_version(&std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?)
    }

    /// The safe set for this host's kernel plus `unsafe_`.
    pub fn for_host(unsafe_: &str) -> Result<Self, SysctlError> {
        Self::new(Self::host_kernel(), unsafe_)
    }

    /// `validateSysctl`.
    fn validate(&self, name: &str, host_net: bool, host_ipc: bool) -> Result<(), String> {
        let name = dotted(name);
        let ns = self.sysctls.get(&name).copied().or_else(|| {
            self.prefixes
                .iter()
                .find(|(p, _)| name.starts_with(p.as_str()))
                .map(|(_, ns)| *ns)
        });
        match ns {
            None => Err(format!("{name:?} not allowlisted")),
            Some(ns @ Namespace::Ipc) if host_ipc => Err(host_error(&name, ns)),
            Some(ns @ Namespace::Net) if host_net => Err(host_error(&name, ns)),
            Some(_) => Ok(()),
        }
    }

    /// `patternAllowlist.Admit`: the first sysctl not allowed rejects.
    pub fn admit(&self, pod: &Pod) -> Result<(), Rejection> {
        let Some(spec) = &pod.spec else { return Ok(()) };
        let sysctls = spec
            .security_context
            .iter()
            .flat_map(|sc| sc.sysctls.iter().flatten());
        let host_net = spec.host_network == Some(true);
        let host_ipc = spec.host_ipc == Some(true);
        for s in sysctls {
            self.validate(&s.name, host_net, host_ipc)
                .map_err(|e| Rejection {
                    reason: FORBIDDEN_REASON.into(),
                    message: format!("Pod was rejected: forbidden sysctl: {e}"),
                })?;
        }
        Ok(())
    }
}

fn host_error(name: &str, ns: Namespace) -> String {
    format!("{name:?} not allowed with host {} enabled", ns.as_str())
}

/// `(major, minor)` of a kernel release such as `6.1.0-28-amd64`.
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(sysctls: &[&str], host_net: bool, host_ipc: bool) -> Pod {
        let sysctls: Vec<_> = sysctls
            .iter()
            .map(|n| serde_json::json!({"name": n, "value": "1"}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"hostNetwork": host_net, "hostIPC": host_ipc,
                     "securityContext": {"sysctls": sysctls},
                     "containers": [{"name": "a"}]}
        }))
        .unwrap()
    }

    /// The kubelet's `TestAllowlist` and `TestNewAllowlist` as one table:
    /// sysctl, hostNetwork, hostIPC, the allowlist's flag, the rejection
    /// message (`None`: admitted).
    #[test]
    fn sysctls_are_admitted_as_the_kubelet_s_allowlist() {
        let cases: [(&str, bool, bool, &str, Option<&str>); 14] = [
            ("kernel.shm_rmid_forced", false, false, "", None),
            ("net.ipv4.ip_local_port_range", false, false, "", None),
            ("net/ipv4/ip_local_port_range", false, false, "", None),
            ("net.ipv4.tcp_rmem", false, false, "", None),
            (
                "kernel.shm_rmid_forced",
                false,
                true,
                "",
                Some("\"kernel.shm_rmid_forced\" not allowed with host ipc enabled"),
            ),
            (
                "net.ipv4.tcp_syncookies",
                true,
                false,
                "",
                Some("\"net.ipv4.tcp_syncookies\" not allowed with host net enabled"),
            ),
            ("kernel.shm_rmid_forced", true, false, "", None),
            (
                "net.core.somaxconn",
                false,
                false,
                "",
                Some("\"net.core.somaxconn\" not allowlisted"),
            ),
            (
                "kernel.msgmax",
                false,
                false,
                "",
                Some("\"kernel.msgmax\" not allowlisted"),
            ),
            (
                "net.core.somaxconn",
                false,
                false,
                "net.core.somaxconn",
                None,
            ),
            ("kernel.msgmax", false, false, "kernel.msg*", None),
            (
                "kernel.msgmax",
                false,
                true,
                "kernel.msg*",
                Some("\"kernel.msgmax\" not allowed with host ipc enabled"),
            ),
            (
                "net.ipv4.conf.eth0/100.rp_filter",
                false,
                false,
                "net.ipv4.conf.*",
                None,
            ),
            (
                "net/ipv4/conf/eth0.100/rp_filter",
                false,
                false,
                "net.ipv4.conf.*",
                None,
            ),
        ];
        for (name, net, ipc, flag, want) in cases {
            let w = Allowlist::new(Some((6, 1)), flag).unwrap();
            let got = w.admit(&pod(&[name], net, ipc));
            let want = want.map(|m| Rejection {
                reason: FORBIDDEN_REASON.into(),
                message: format!("Pod was rejected: forbidden sysctl: {m}"),
            });
            assert_eq!(got.err(), want, "{name} net={net} ipc={ipc} flag={flag:?}");
        }
        // The first forbidden one is named.
        let w = Allowlist::new(Some((6, 1)), "").unwrap();
        let r = w.admit(&pod(
            &[
                "kernel.shm_rmid_forced",
                "vm.swappiness",
                "net.core.somaxconn",
            ],
            false,
            false,
        ));
        assert_eq!(
            r.unwrap_err().message,
            "Pod was rejected: forbidden sysctl: \"vm.swappiness\" not allowlisted"
        );
    }

    #[test]
    fn the_flag_takes_only_namespaced_valid_patterns() {
        assert_eq!(
            Allowlist::new(None, "vm.swappiness").unwrap_err(),
            SysctlError::NotNamespaced("vm.swappiness".into())
        );
        assert_eq!(
            Allowlist::new(None, "kernel.*").unwrap_err(),
            SysctlError::NotNamespaced("kernel.*".into())
        );
        assert_eq!(
            Allowlist::new(None, "net.Core.x").unwrap_err(),
            SysctlError::Pattern("net.Core.x".into())
        );
        assert!(Allowlist::new(None, " net.core.somaxconn , kernel.sem, fs.mqueue.*").is_ok());
    }

    /// Safe sysctls that need a newer kernel are left out on an older one.
    #[test]
    fn the_safe_set_follows_the_kernel() {
        let old = Allowlist::new(Some((4, 4)), "").unwrap();
        let new = Allowlist::new(kernel_version("6.1.0-28-amd64"), "").unwrap();
        let p = pod(&["net.ipv4.tcp_keepalive_time"], false, false);
        assert!(old.admit(&p).is_err());
        assert!(new.admit(&p).is_ok());
        assert!(Allowlist::new(None, "").unwrap().admit(&p).is_err());
        assert_eq!(kernel_version("5.15.0"), Some((5, 15)));
        assert_eq!(kernel_version("garbage"), None);
    }
}

//! The pod's managed `/etc/hosts`, as the kubelet's `makeHostsMount` and
//! `ensureHostsFile` (`kubelet_pods.go`): a file per pod,
//! `<root dir>/pods/<uid>/etc-hosts`, ensured before each container is created
//! and bind-mounted read-write on the container's `/etc/hosts` (unless the
//! container mounts a volume there itself), once the pod has IPs. A pod with its own network gets
//! localhost's lines, a line per pod IP (`<ip>\t<fqdn>\t<hostname>` with a
//! subdomain, else `<ip>\t<hostname>`) and the `hostAliases`; a host-network
//! pod gets the node's `/etc/hosts` and the `hostAliases`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::HostAlias;

/// Where the node's hosts file is, and the container path of the mount.
pub const ETC_HOSTS: &str = "/etc/hosts";

/// Why the pod's hosts file cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot remove the pod's directory: {0}")]
    Remove(String),
}

/// What the hosts file says.
#[derive(Clone, Debug, Default)]
pub struct HostsSpec<'a> {
    pub pod_ips: &'a [String],
    pub hostname: &'a str,
    /// The pod's domain (`<subdomain>.<ns>.svc.<cluster domain>`), or empty.
    pub domain: &'a str,
    pub aliases: &'a [HostAlias],
    pub host_network: bool,
}

fn aliases(out: &mut String, aliases: &[HostAlias]) {
    if aliases.is_empty() {
        return;
    }
    out.push_str("\n# Entries added by HostAliases.\n");
    for a in aliases {
        let names = a.hostnames.clone().unwrap_or_default().join("\t");
        let _ = writeln!(out, "{}\t{names}", a.ip);
    }
}

/// The managed file of a pod with its own network (`managedHostsFileContent`).
pub fn managed_content(spec: &HostsSpec) -> String {
    let mut out = String::from(
        "# Kubernetes-managed hosts file.\n\
         127.0.0.1\tlocalhost\n\
         ::1\tlocalhost ip6-localhost ip6-loopback\n\
         fe00::0\tip6-localnet\n\
         fe00::0\tip6-mcastprefix\n\
         fe00::1\tip6-allnodes\n\
         fe00::2\tip6-allrouters\n",
    );
    for ip in spec.pod_ips {
        if spec.domain.is_empty() {
            let _ = writeln!(out, "{ip}\t{}", spec.hostname);
        } else {
            let _ = writeln!(
                out,
                "{ip}\t{}.{}\t{}",
                spec.hostname, spec.domain, spec.hostname
            );
        }
    }
    aliases(&mut out, spec.aliases);
    out
}

/// The file of a host-network pod (`nodeHostsFileContent`).
pub fn node_content(node_hosts: &str, host_aliases: &[HostAlias]) -> String {
    let mut out = String::from("# Kubernetes-managed hosts file (host network).\n");
    out.push_str(node_hosts);
    aliases(&mut out, host_aliases);
    out
}

/// The pod's directory under the agent's root (`getPodDir`).
pub fn pod_dir(root_dir: &Path, uid: &str) -> PathBuf {
    root_dir.join("pods").join(uid)
}

/// Writes the pod's hosts file and returns its mount, or `None` while the pod
/// has no IP (the kubelet mounts it only then).
pub fn ensure_hosts_mount(
    root_dir: &Path,
    uid: &str,
    spec: &HostsSpec,
) -> Result<Option<v1::Mount>, HostsError> {
    if spec.pod_ips.is_empty() {
        return Ok(None);
    }
    let io = |action, path: &Path| {
        let path = path.to_path_buf();
        move |source| HostsError::Io {
            action,
            path,
            source,
        }
    };
    let content = if spec.host_network {
        let node = std::fs::read_to_string(ETC_HOSTS).map_err(io("read", Path::new(ETC_HOSTS)))?;
        node_content(&node, spec.aliases)
    } else {
        managed_content(spec)
    };
    let dir = pod_dir(root_dir, uid);
    std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
    let file = dir.join("etc-hosts");
    write_in_place(&file, content.as_bytes()).map_err(io("write", &file))?;
    Ok(Some(v1::Mount {
        container_path: ETC_HOSTS.into(),
        host_path: file.to_string_lossy().into_owned(),
        readonly: false,
        selinux_relabel: true,
        ..Default::default()
    }))
}

/// Writes `content` to `file` where it differs, in place: running containers
/// have the file's inode bind-mounted, so it is never replaced by a rename.
/// Unlike the kubelet's `os.WriteFile` (truncate, then write, at every
/// container start), unchanged content is not written at all, and changed
/// content is written over the old before the file is cut to its length, so
/// a failed write never leaves a running container an empty `/etc/hosts`.
/// A symlink at `file` is refused (`O_NOFOLLOW`).
fn write_in_place(file: &Path, content: &[u8]) -> std::io::Result<()> {
    use std::io::{Read as _, Seek as _, Write as _};
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(file)?;
    let mut old = Vec::new();
    f.read_to_end(&mut old)?;
    if old == content {
        return Ok(());
    }
    f.rewind()?;
    f.write_all(content)?;
    f.set_len(content.len() as u64)
}

/// Removes the pod's directory (its hosts file, its torn-down volumes' empty
/// directories, its subPath bind mounts unmounted) once the pod is gone,
/// refusing to cross into a mount left there.
pub fn remove_pod_dir(root_dir: &Path, uid: &str) -> Result<(), HostsError> {
    let dir = pod_dir(root_dir, uid);
    // SubPath bind mounts a previous run left (its volumes were not known
    // to this run's volume manager) go first.
    evpleg_volume::subpath::clean_pod_sub_paths(&dir)
        .map_err(|e| HostsError::Remove(e.to_string()))?;
    evpleg_volume::util::remove_all_one_filesystem(&dir)
        .map_err(|e| HostsError::Remove(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alias(ip: &str, names: &[&str]) -> HostAlias {
        HostAlias {
            ip: ip.into(),
            hostnames: Some(names.iter().map(|s| s.to_string()).collect()),
        }
    }

    const HEAD: &str = "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n";

    #[test]
    fn managed_file_as_the_kubelet_writes_it() {
        let ips = ["10.1.0.5".to_owned(), "fd00::5".to_owned()];
        let aliases = [
            alias("1.2.3.4", &["foo", "bar"]),
            alias("5.6.7.8", &["baz"]),
        ];
        let cases = [
            (
                HostsSpec {
                    pod_ips: &ips[..1],
                    hostname: "web",
                    ..Default::default()
                },
                format!("{HEAD}10.1.0.5\tweb\n"),
            ),
            (
                HostsSpec {
                    pod_ips: &ips,
                    hostname: "h",
                    domain: "sub.ns.svc.cluster.local",
                    ..Default::default()
                },
                format!(
                    "{HEAD}10.1.0.5\th.sub.ns.svc.cluster.local\th\nfd00::5\th.sub.ns.svc.cluster.local\th\n"
                ),
            ),
            (
                HostsSpec {
                    pod_ips: &ips[..1],
                    hostname: "web",
                    aliases: &aliases,
                    ..Default::default()
                },
                format!(
                    "{HEAD}10.1.0.5\tweb\n\n# Entries added by HostAliases.\n1.2.3.4\tfoo\tbar\n5.6.7.8\tbaz\n"
                ),
            ),
        ];
        for (spec, want) in cases {
            assert_eq!(managed_content(&spec), want);
        }
        assert_eq!(
            node_content("127.0.0.1 localhost\n", &aliases[1..]),
            "# Kubernetes-managed hosts file (host network).\n127.0.0.1 localhost\n\n# Entries added by HostAliases.\n5.6.7.8\tbaz\n"
        );
    }

    #[test]
    fn the_file_is_written_once_the_pod_has_an_ip_and_removed_with_the_pod() {
        let root = tempfile::tempdir().unwrap();
        let spec = HostsSpec {
            hostname: "web",
            ..Default::default()
        };
        assert!(
            ensure_hosts_mount(root.path(), "u1", &spec)
                .unwrap()
                .is_none()
        );
        let ips = ["10.1.0.5".to_owned()];
        let spec = HostsSpec {
            pod_ips: &ips,
            ..spec
        };
        let m = ensure_hosts_mount(root.path(), "u1", &spec)
            .unwrap()
            .unwrap();
        assert_eq!(m.container_path, "/etc/hosts");
        assert!(!m.readonly);
        let file = root.path().join("pods/u1/etc-hosts");
        assert_eq!(m.host_path, file.to_str().unwrap());
        assert!(
            std::fs::read_to_string(&file)
                .unwrap()
                .ends_with("10.1.0.5\tweb\n")
        );
        remove_pod_dir(root.path(), "u1").unwrap();
        assert!(!root.path().join("pods/u1").exists());
        remove_pod_dir(root.path(), "u1").unwrap();
    }

    /// At every container start the file is ensured again: unchanged content
    /// leaves it untouched (its mtime kept), changed content is written into
    /// the same inode (what running containers have mounted), shorter
    /// content leaves no tail, and a symlink in its place is refused.
    #[test]
    fn the_file_is_rewritten_in_place_only_when_it_changes() {
        use std::os::unix::fs::MetadataExt as _;
        let root = tempfile::tempdir().unwrap();
        let long = ["10.1.0.5".to_owned(), "fd00::5".to_owned()];
        let spec = HostsSpec {
            pod_ips: &long,
            hostname: "web",
            ..Default::default()
        };
        ensure_hosts_mount(root.path(), "u1", &spec).unwrap();
        let file = root.path().join("pods/u1/etc-hosts");
        let past = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000);
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(past)
            .unwrap();
        let inode = std::fs::metadata(&file).unwrap().ino();
        ensure_hosts_mount(root.path(), "u1", &spec).unwrap();
        assert_eq!(std::fs::metadata(&file).unwrap().modified().unwrap(), past);

        let short = ["10.1.0.6".to_owned()];
        let spec = HostsSpec {
            pod_ips: &short,
            ..spec
        };
        ensure_hosts_mount(root.path(), "u1", &spec).unwrap();
        let meta = std::fs::metadata(&file).unwrap();
        assert_eq!(meta.ino(), inode);
        assert_ne!(meta.modified().unwrap(), past);
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            managed_content(&spec)
        );

        std::fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink(root.path().join("elsewhere"), &file).unwrap();
        let err = ensure_hosts_mount(root.path(), "u1", &spec).unwrap_err();
        assert!(err.to_string().contains("etc-hosts"), "{err}");
        assert!(!root.path().join("elsewhere").exists());
    }
}

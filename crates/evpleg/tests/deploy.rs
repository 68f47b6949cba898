//! `deploy/daemonset.yaml` and docs/operations.md match the command line: the
//! DaemonSet runs `observe` with flags it has, with the least privilege
//! docs/operations.md describes; every flag is documented and every
//! documented flag exists.

use std::collections::BTreeSet;

use clap::{CommandFactory, Parser};
use evpleg::config::{Cli, Command};
use k8s_openapi::api::apps::v1::DaemonSet;

fn read(path: &str) -> String {
    let full = format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

fn daemonset() -> DaemonSet {
    daemonset_in("deploy/daemonset.yaml")
}

fn daemonset_in(path: &str) -> DaemonSet {
    let text = read(path);
    let docs: Vec<serde_json::Value> = serde_saphyr::read(&mut text.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{path} parses: {e}"));
    let ds = docs
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet")
        .expect("a DaemonSet");
    serde_json::from_value(ds).expect("a valid DaemonSet")
}

#[test]
fn the_daemonset_runs_observe_with_flags_it_has_and_least_privilege() {
    let ds = daemonset();
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(pod.host_pid, Some(true), "host pids");
    let [c] = pod.containers.as_slice() else {
        panic!("one container")
    };
    let args = c.args.clone().expect("args");
    let cli = Cli::try_parse_from(std::iter::once("evpleg".to_owned()).chain(args.clone()))
        .unwrap_or_else(|e| panic!("the DaemonSet's args {args:?}: {e}"));
    let Command::Observe(observe) = cli.command else {
        panic!("the DaemonSet runs observe: {args:?}")
    };
    // Least privilege: capabilities, not privileged.
    let sc = c.security_context.clone().expect("security context");
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let caps = sc.capabilities.expect("capabilities");
    assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));
    let added: BTreeSet<_> = caps.add.expect("added").into_iter().collect();
    assert_eq!(
        added,
        ["BPF", "PERFMON", "SYS_NICE"].map(String::from).into(),
        "CAP_BPF, CAP_PERFMON, CAP_SYS_NICE and nothing else"
    );
    // The shipped seccomp profile, which denies what it does not list
    // (least_privilege.rs runs the binary under it).
    let seccomp = sc.seccomp_profile.expect("a seccomp profile");
    assert_eq!(seccomp.type_, "Localhost");
    let file = seccomp.localhost_profile.expect("a localhost profile");
    let profile: serde_json::Value = serde_json::from_str(&read(&format!("deploy/seccomp/{file}")))
        .unwrap_or_else(|e| panic!("deploy/seccomp/{file}: {e}"));
    assert_eq!(
        profile["defaultAction"], "SCMP_ACT_ERRNO",
        "deny by default"
    );
    // Read-only cgroup tree and BTF; the CRI socket the flag names.
    let mounts = c.volume_mounts.clone().expect("mounts");
    for path in ["/sys/fs/cgroup", "/sys/kernel/btf"] {
        let m = mounts
            .iter()
            .find(|m| m.mount_path == path)
            .unwrap_or_else(|| panic!("{path} mounted"));
        assert_eq!(m.read_only, Some(true), "{path} read-only");
    }
    let endpoint = observe.common.cri_endpoint.expect("the endpoint is given");
    let socket = endpoint.strip_prefix("unix://").expect("a unix socket");
    assert!(
        mounts.iter().any(|m| m.mount_path == socket),
        "{socket} mounted"
    );
    // The probes ask the port evpleg listens on, on loopback only (issue
    // #24: nothing served to the network by default).
    let listen = observe.common.listen.expect("--listen");
    assert!(
        listen.ip().is_loopback(),
        "--listen={listen} is not loopback"
    );
    let port = listen.port();
    for (probe, path) in [
        (c.liveness_probe.clone(), "/healthz"),
        (c.readiness_probe.clone(), "/readyz"),
    ] {
        let get = probe.and_then(|p| p.http_get).expect("an HTTP probe");
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(
            get.host.as_deref(),
            Some("127.0.0.1"),
            "{path} probes loopback"
        );
        assert_eq!(
            get.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i32::from(port))
        );
    }
}

/// The long flags of a subcommand (`describe pod`: a nested one), and the
/// global ones.
fn flags(sub: &str) -> BTreeSet<String> {
    let mut root = Cli::command();
    let globals: Vec<String> = root
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    let mut cmd = &mut root;
    for name in sub.split(' ') {
        cmd = cmd
            .find_subcommand_mut(name)
            .unwrap_or_else(|| panic!("{sub}"));
    }
    cmd.get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .chain(globals)
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

#[test]
fn every_flag_is_in_docs_operations_md_and_every_flag_there_exists() {
    let doc = read("docs/operations.md");
    let mut all = flags("run");
    all.extend(flags("observe"));
    all.extend(flags("version"));
    all.extend(flags("describe pod"));
    all.extend(flags("cri-proxy"));
    for flag in &all {
        assert!(
            doc.contains(&format!("`{flag}`")),
            "{flag} is not in docs/operations.md"
        );
    }
    // Every `--flag` the document names in backticks exists (`--help` too).
    all.insert("--help".into());
    for quoted in doc.split('`').skip(1).step_by(2) {
        if let Some(rest) = quoted.strip_prefix("--") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            let flag = format!("--{name}");
            assert!(
                all.contains(&flag),
                "docs/operations.md names {flag}, which does not exist"
            );
        }
    }
}

/// deploy/cri-proxy/: the DaemonSet and the systemd unit run `cri-proxy`
/// with flags it has, serving the socket the docs tell the kubelet to use,
/// with the capabilities of `observe` (and CAP_CHOWN for the unit's
/// `--socket-owner`), nothing more.
#[test]
fn the_cri_proxy_deploy_files_run_it_with_flags_it_has_and_least_privilege() {
    let parse = |args: Vec<String>| {
        let cli = Cli::try_parse_from(std::iter::once("evpleg".to_owned()).chain(args.clone()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        match cli.command {
            Command::CriProxy(a) => a,
            other => panic!("not cri-proxy: {other:?}"),
        }
    };
    let docs = read("docs/cri-proxy.md");

    let ds = daemonset_in("deploy/cri-proxy/daemonset.yaml");
    let pod = ds.spec.expect("spec").template.spec.expect("pod spec");
    assert_eq!(pod.host_pid, Some(true));
    let [c] = pod.containers.as_slice() else {
        panic!("one container")
    };
    let args = parse(c.args.clone().expect("args"));
    let sc = c.security_context.clone().expect("security context");
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let caps = sc.capabilities.expect("capabilities");
    assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));
    let added: BTreeSet<_> = caps.add.expect("added").into_iter().collect();
    assert_eq!(
        added,
        ["BPF", "PERFMON", "SYS_NICE"].map(String::from).into()
    );
    let mounts = c.volume_mounts.clone().expect("mounts");
    let mounted = |p: &std::path::Path| {
        mounts
            .iter()
            .any(|m| std::path::Path::new(&m.mount_path) == p)
    };
    assert!(
        mounted(&args.runtime_endpoint),
        "{:?} mounted",
        args.runtime_endpoint
    );
    assert!(
        mounted(args.listen.parent().expect("a directory")),
        "the socket's directory mounted"
    );
    assert!(
        args.http_listen.ip().is_loopback(),
        "--http-listen={} is not loopback",
        args.http_listen
    );
    let port = args.http_listen.port();
    let probe = c
        .liveness_probe
        .clone()
        .and_then(|p| p.http_get)
        .expect("a probe");
    assert_eq!(
        probe.host.as_deref(),
        Some("127.0.0.1"),
        "the probe asks loopback"
    );
    assert_eq!(
        probe.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(i32::from(port))
    );

    let unit = read("deploy/cri-proxy/evpleg-cri-proxy.service");
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart");
    let args = parse(exec.split_whitespace().skip(1).map(String::from).collect());
    let listen = format!("unix://{}", args.listen.display());
    assert!(
        docs.contains(&format!("--container-runtime-endpoint={listen}")),
        "docs/cri-proxy.md points the kubelet at {listen}"
    );
    let caps: BTreeSet<&str> = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("a bounding set")
        .split_whitespace()
        .collect();
    assert_eq!(
        caps,
        ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_NICE", "CAP_CHOWN"].into()
    );
    assert!(unit.contains("NoNewPrivileges=yes"));
}

/// The `[Unit]` and `[Install]` keys of a systemd unit: each key's values
/// (space-separated, every line of the key).
fn unit_keys(unit: &str) -> std::collections::BTreeMap<String, BTreeSet<String>> {
    let mut keys = std::collections::BTreeMap::<String, BTreeSet<String>>::new();
    let mut section = "";
    for line in unit.lines().map(str::trim) {
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = if s == "Unit" || s == "Install" { s } else { "" };
        } else if let Some((k, v)) = line.split_once('=')
            && !section.is_empty()
            && !line.starts_with('#')
        {
            keys.entry(k.to_owned())
                .or_default()
                .extend(v.split_whitespace().map(String::from));
        }
    }
    keys
}

/// Issue #24 item 5: the proxy's unit keeps the node up. No hard dependency
/// on containerd (Requires=/BindsTo=/PartOf=: a containerd restart would
/// restart the proxy) nor from the kubelet (RequiredBy=: a proxy restart or
/// upgrade would restart the kubelet); pulled in with containerd and by the
/// kubelet (Wants=, WantedBy=), ordered between them (After=, Before=).
#[test]
fn the_cri_proxy_unit_keeps_the_node_up_across_restarts() {
    let keys = unit_keys(&read("deploy/cri-proxy/evpleg-cri-proxy.service"));
    let has = |k: &str, v: &str| keys.get(k).is_some_and(|s| s.contains(v));
    for hard in ["Requires", "BindsTo", "PartOf", "Requisite", "RequiredBy"] {
        assert!(
            !keys.contains_key(hard),
            "{hard}= {:?}: a restart of one would restart or stop the other",
            keys[hard]
        );
    }
    assert!(has("Wants", "containerd.service"), "{keys:?}");
    assert!(has("After", "containerd.service"), "{keys:?}");
    assert!(has("Before", "kubelet.service"), "{keys:?}");
    assert!(has("WantedBy", "kubelet.service"), "{keys:?}");
    let docs = read("docs/cri-proxy.md");
    assert!(
        docs.contains("Wants=containerd.service") && docs.contains("WantedBy=kubelet.service"),
        "docs/cri-proxy.md explains the ordering"
    );
}

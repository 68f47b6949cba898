//! The inputs a hostile pod author, network peer or runtime controls, each as
//! a fuzz target: a function of arbitrary bytes that must neither panic nor
//! hang, whatever the bytes. The kubelet has no such targets; its decoders are
//! Go's, whose errors are values. Here a panic in a decoder would take the
//! node agent down, so every decoder a peer can reach is a target:
//!
//! | target | input | who controls it |
//! |---|---|---|
//! | `manifest` | a static pod manifest (YAML or JSON, many documents), decoded then validated as the API server validates names | whoever writes the manifest directory or serves the manifest URL |
//! | `kernel_record` | one ring-buffer record | the kernel, after a layout change the loader did not catch |
//! | `cgroup_path` | a cgroup path relative to its hierarchy's root | any process that can make a cgroup |
//! | `grpc_frame` | a gRPC request body and path, as the CRI proxy reads them | the proxy's clients |
//! | `overlay` | a runtime's ListContainers and ContainerStatus answers, rewritten over kernel deaths | the runtime |
//! | `cri_response` | the ContainerStatus and PodSandboxStatus answers the relist converts | the runtime |
//!
//! `cargo xtask fuzz` runs them under libFuzzer (the `fuzz/` crate, with
//! cargo-fuzz on the nightly); the test tier replays `fuzz/corpus/` and a few
//! seconds of mutations of it (`tests/replay.rs`).

use std::time::{Duration, UNIX_EPOCH};

use evpleg_core::ids::ContainerId;
use evpleg_core::lifecycle::ExitStatus;
use evpleg_cri_api::v1;
use evpleg_cri_proxy::overlay::{KernelDeath, Overlay};
use prost::Message;

/// A fuzz target: bytes in, a panic on a bug.
pub type Target = fn(&[u8]);

/// Every target, by name (the name of its `fuzz/fuzz_targets/` file and of
/// its corpus directory).
pub const TARGETS: &[(&str, Target)] = &[
    ("manifest", manifest),
    ("kernel_record", kernel_record),
    ("cgroup_path", cgroup_path),
    ("grpc_frame", grpc_frame),
    ("overlay", overlay),
    ("cri_response", cri_response),
];

/// A static pod manifest: decoded (any number of documents), then each pod
/// validated as the API server's `ValidatePod` validates the fields the
/// agent turns into paths and names.
pub fn manifest(data: &[u8]) {
    if let Ok(pods) = evpleg_kubelet::source::file::decode(data) {
        for (_, pod) in pods {
            let _ = evpleg_kubelet::admission::validation::validate(&pod);
        }
    }
}

/// One ring-buffer record, as the reader decodes it.
pub fn kernel_record(data: &[u8]) {
    let _ = evpleg_pleg::kernel::event::decode(data);
}

/// A cgroup path, classified as the kernel PLEG classifies every new cgroup.
pub fn cgroup_path(data: &[u8]) {
    if let Ok(path) = std::str::from_utf8(data) {
        let _ = evpleg_core::cgroup_path::classify(path);
    }
}

/// A request as the CRI proxy reads it: the method from the path (the first
/// line of the input), the body (the rest) as each request type it decodes.
pub fn grpc_frame(data: &[u8]) {
    let (path, body) = split_line(data);
    if let Ok(path) = std::str::from_utf8(path) {
        let _ = evpleg_cri_proxy::grpc::cri_method(path);
    }
    use evpleg_cri_proxy::grpc::unary;
    let _ = unary::<v1::ContainerStatusRequest>(body);
    let _ = unary::<v1::PodSandboxStatusRequest>(body);
    let _ = unary::<v1::ListContainersRequest>(body);
    let _ = unary::<v1::ListPodSandboxRequest>(body);
    let _ = unary::<v1::RemoveContainerRequest>(body);
    let _ = unary::<v1::GetEventsRequest>(body);
}

/// A runtime's answers rewritten by the proxy's overlay: every container id
/// in the answer that parses has a pending kernel death (its code from the
/// first byte), and the answers pass through `list`, `status` and
/// `list_sandboxes`. What must hold besides no panic: an entry the overlay
/// kept pending reads EXITED.
pub fn overlay(data: &[u8]) {
    let code = i32::from(data.first().copied().unwrap_or(0));
    let filter = data.get(1).map(|b| i32::from(*b % 4));
    let body = data.get(2..).unwrap_or_default();
    let overlay = Overlay::default();
    let death = KernelDeath {
        exit: ExitStatus {
            code,
            signal: None,
            core_dumped: false,
            oom_killed: code == 137,
        },
        at_ns: 1,
        finished_at: 1,
    };
    if let Ok(mut list) = v1::ListContainersResponse::decode(body) {
        for c in &list.containers {
            if let Some(id) = ContainerId::parse(&c.id) {
                overlay.died(id, death);
            }
        }
        overlay.list(&mut list, filter);
        for c in &list.containers {
            if ContainerId::parse(&c.id).is_some_and(|id| overlay.get(&id).is_some()) {
                assert_eq!(
                    c.state,
                    v1::ContainerState::ContainerExited as i32,
                    "a pending death reads exited: {c:?}"
                );
            }
        }
    }
    if let Ok(resp) = v1::ContainerStatusResponse::decode(body)
        && let Some(mut status) = resp.status
    {
        if let Some(id) = ContainerId::parse(&status.id) {
            overlay.died(id, death);
        }
        overlay.status(&mut status);
    }
    if let Ok(mut sandboxes) = v1::ListPodSandboxResponse::decode(body) {
        for s in &sandboxes.items {
            if let Some(id) = ContainerId::parse(&s.id) {
                overlay.sandbox_died(id);
            }
        }
        overlay.list_sandboxes(&mut sandboxes, filter);
    }
}

/// The runtime's answers the relist converts into the pod status cache.
pub fn cri_response(data: &[u8]) {
    use evpleg_cri::runtime::{convert_container_status, pid_from_info, sandbox_ips};
    if let Ok(resp) = v1::ContainerStatusResponse::decode(data) {
        if let Some(status) = &resp.status {
            let _ = convert_container_status(status);
        }
        let _ = pid_from_info(&resp.info);
    }
    if let Ok(resp) = v1::PodSandboxStatusResponse::decode(data) {
        let _ = sandbox_ips(resp.status.as_ref());
    }
}

/// The first line of `data` and the rest.
fn split_line(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|b| *b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

/// A seed for the replay's mutations that differs per run but is printed, so
/// a failure can be replayed (`EVPLEG_FUZZ_SEED`).
pub fn seed() -> u64 {
    std::env::var("EVPLEG_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            UNIX_EPOCH
                .elapsed()
                .unwrap_or(Duration::ZERO)
                .subsec_nanos()
                .into()
        })
}

//! The test CSI driver (tests/src/csi_driver/) against the agent's CSI
//! client, without containerd: identity answers, the spec's idempotency of
//! stage/publish/unpublish/unstage, read-only publishing, the preconditions
//! it enforces, and injected failures with their codes (Internal final,
//! Unavailable uncertain as the agent classifies them). Bind mounts need
//! root: skipped with a reason without it, a failure under `CI=true`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use evpleg_csi_api::v1;
use evpleg_csi_api::v1::identity_client::IdentityClient;
use evpleg_csi_api::v1::volume_capability::{AccessMode, AccessType, MountVolume, access_mode};
use evpleg_tests::csi_driver::{DriverConfig, file_name, mounts, serve};
use evpleg_volume::csi::{CsiClient, CsiClientConfig, CsiError};
use tokio_util::sync::CancellationToken;

struct Running {
    dir: PathBuf,
    socket: PathBuf,
    client: CsiClient,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Running {
    async fn start(name: &str) -> Option<Self> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            evpleg_tests::skip(name, "needs root (bind mounts)");
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "evpleg-csi-driver-{:x}",
            evpleg_tests::unique_u64()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("csi.sock");
        let config = DriverConfig {
            name: "csi.evpleg.unit".into(),
            node_id: "n1".into(),
            csi_socket: socket.clone(),
            state_dir: dir.join("state"),
            stage_unstage: true,
            versions: vec!["1.0.0".into()],
        };
        let stop = CancellationToken::new();
        let reg = dir.join("reg.sock");
        let token = stop.clone();
        let task = tokio::spawn(async move { serve(config, &reg, token).await });
        let deadline = Instant::now() + Duration::from_secs(10);
        while !dir.join("reg.sock").exists() {
            assert!(Instant::now() < deadline, "the driver's sockets");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let client = CsiClient::new(
            "csi.evpleg.unit",
            &socket,
            CsiClientConfig::default(),
            Default::default(),
        )
        .unwrap();
        Some(Self {
            dir,
            socket,
            client,
            stop,
            task,
        })
    }

    async fn finish(self) {
        self.stop.cancel();
        let _ = self.task.await;
        assert!(!self.socket.exists(), "the driver removes its sockets");
        std::fs::remove_dir_all(&self.dir).unwrap();
    }
}

fn capability() -> Option<v1::VolumeCapability> {
    Some(v1::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode {
            mode: access_mode::Mode::SingleNodeWriter as i32,
        }),
    })
}

fn stage(id: &str, staging: &Path) -> v1::NodeStageVolumeRequest {
    v1::NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        volume_capability: capability(),
        ..Default::default()
    }
}

fn publish(id: &str, staging: &Path, target: &Path, ro: bool) -> v1::NodePublishVolumeRequest {
    v1::NodePublishVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: capability(),
        readonly: ro,
        ..Default::default()
    }
}

fn mount_count(path: &Path) -> usize {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = path.display().to_string();
    info.lines()
        .filter(|l| l.split(' ').nth(4) == Some(want.as_str()))
        .count()
}

fn code_of(e: &CsiError) -> tonic::Code {
    match e {
        CsiError::Call { code, .. } => *code,
        other => panic!("not a call error: {other}"),
    }
}

#[tokio::test]
async fn the_driver_answers_identity_and_node_calls_idempotently() {
    let Some(r) = Running::start("the_driver_answers_identity_and_node_calls_idempotently").await
    else {
        return;
    };
    let info = r.client.plugin_info().await.unwrap();
    assert_eq!(info.name, "csi.evpleg.unit");
    let mut identity = IdentityClient::connect(format!("unix://{}", r.socket.display()))
        .await
        .unwrap();
    let probe = identity
        .probe(v1::ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(probe.ready, Some(true));
    assert!(
        r.client
            .node_get_capabilities()
            .await
            .unwrap()
            .stage_unstage
    );
    assert_eq!(r.client.node_get_info().await.unwrap().node_id, "n1");

    let staging = r.dir.join("staging/globalmount");
    let target_parent = r.dir.join("pod/vol");
    let target = target_parent.join("mount");
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::create_dir_all(&target_parent).unwrap();

    // Publishing before staging is refused.
    let e = r
        .client
        .node_publish_volume(publish("v1", &staging, &target, false))
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), tonic::Code::FailedPrecondition, "{e}");

    for _ in 0..2 {
        r.client
            .node_stage_volume(stage("v1", &staging))
            .await
            .unwrap();
        assert_eq!(mount_count(&staging), 1, "staged once, however often asked");
    }
    for _ in 0..2 {
        r.client
            .node_publish_volume(publish("v1", &staging, &target, false))
            .await
            .unwrap();
        assert_eq!(mount_count(&target), 1);
    }
    std::fs::write(target.join("through-target"), "x").unwrap();
    let backing = r.dir.join("state/volumes").join(file_name("v1"));
    assert_eq!(
        std::fs::read_to_string(backing.join("through-target")).unwrap(),
        "x"
    );
    assert_eq!(
        std::fs::read_to_string(target.join("volume-id")).unwrap(),
        "v1"
    );

    // A read-only publication of the same volume elsewhere.
    let ro_target = target_parent.join("ro");
    r.client
        .node_publish_volume(publish("v1", &staging, &ro_target, true))
        .await
        .unwrap();
    assert!(mounts::is_read_only(&ro_target));
    assert!(std::fs::write(ro_target.join("x"), "x").is_err());

    for t in [&target, &ro_target] {
        for _ in 0..2 {
            r.client
                .node_unpublish_volume(v1::NodeUnpublishVolumeRequest {
                    volume_id: "v1".into(),
                    target_path: t.display().to_string(),
                })
                .await
                .unwrap();
            assert!(!t.exists(), "the target is removed");
        }
    }
    for _ in 0..2 {
        r.client
            .node_unstage_volume(v1::NodeUnstageVolumeRequest {
                volume_id: "v1".into(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .unwrap();
        assert_eq!(mount_count(&staging), 0);
    }
    assert!(
        backing.join("through-target").exists(),
        "persistent data stays"
    );
    r.finish().await;
}

#[tokio::test]
async fn injected_failures_carry_their_codes_until_cleared() {
    let Some(r) = Running::start("injected_failures_carry_their_codes_until_cleared").await else {
        return;
    };
    let staging = r.dir.join("staging/globalmount");
    std::fs::create_dir_all(&staging).unwrap();
    let fail = r
        .dir
        .join("state/fail")
        .join(format!("{}.NodeStageVolume", file_name("v/2")));
    std::fs::write(&fail, "disk on fire").unwrap();
    let e = r
        .client
        .node_stage_volume(stage("v/2", &staging))
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), tonic::Code::Internal);
    assert!(!e.is_uncertain(), "{e}");
    assert!(e.to_string().contains("disk on fire"), "{e}");
    assert_eq!(mount_count(&staging), 0, "nothing done");
    std::fs::write(&fail, "UNAVAILABLE: restarting").unwrap();
    let e = r
        .client
        .node_stage_volume(stage("v/2", &staging))
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), tonic::Code::Unavailable);
    assert!(e.is_uncertain(), "{e}");
    std::fs::remove_file(&fail).unwrap();
    r.client
        .node_stage_volume(stage("v/2", &staging))
        .await
        .unwrap();
    assert_eq!(mount_count(&staging), 1);
    r.client
        .node_unstage_volume(v1::NodeUnstageVolumeRequest {
            volume_id: "v/2".into(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap();
    let log = std::fs::read_to_string(r.dir.join("state/calls.jsonl")).unwrap();
    let methods: Vec<String> = log
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["method"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(
        methods,
        [
            "NodeStageVolume",
            "NodeStageVolume",
            "NodeStageVolume",
            "NodeUnstageVolume"
        ]
    );
    r.finish().await;
}

use super::*;

#[test]
fn usage_nano_cores_come_from_the_last_sample_as_the_kubelet_computes_them() {
    let last = CpuRecord {
        usage_ns: 1_000_000_000,
        at_ns: 10_000_000_000,
        nano_cores: None,
    };
    // 0.5 s of CPU in 2 s: a quarter of a core.
    assert_eq!(
        nano_cores(&last, 1_500_000_000, 12_000_000_000),
        Some(250_000_000)
    );
    // A counter that went back (a new cgroup under the same key), or no time.
    assert_eq!(nano_cores(&last, 999, 12_000_000_000), None);
    assert_eq!(nano_cores(&last, 2_000_000_000, 10_000_000_000), None);
}

#[test]
fn net_dev_is_read_as_cadvisor_reads_it() {
    let text = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    4242      42    0    0    0     0          0         0     4242      42    0    0    0     0       0          0
  eth0:  123456     100    3    0    0     0          0         0    65432      90    4    0    0     0       0          0
vethab12:  1     1    0    0    0     0          0         0    1      1    0    0    0     0       0          0
  bad0: 1 2 3
";
    assert_eq!(
        parse_net_dev(text),
        vec![InterfaceStats {
            name: "eth0".into(),
            rx_bytes: 123456,
            rx_errors: 3,
            tx_bytes: 65432,
            tx_errors: 4,
        }]
    );
}

#[test]
fn the_summary_has_the_kubelet_s_json_names() {
    let t: Timestamp = "2026-12-02T07:00:00Z".parse().unwrap();
    let fs = FsStats {
        time: t,
        available_bytes: Some(1),
        capacity_bytes: Some(2),
        used_bytes: 3,
        inodes_free: Some(4),
        inodes: Some(5),
        inodes_used: 6,
    };
    let summary = Summary {
        node: NodeStats {
            node_name: "n".into(),
            start_time: t,
            ..Default::default()
        },
        pods: vec![PodStats {
            pod_ref: PodReference {
                name: "p".into(),
                namespace: "ns".into(),
                uid: "u".into(),
            },
            start_time: t,
            containers: vec![ContainerStats {
                name: "c".into(),
                start_time: t,
                cpu: CpuStats {
                    time: t,
                    usage_nano_cores: Some(7),
                    usage_core_nano_seconds: 8,
                },
                logs: Some(fs.clone()),
                ..Default::default()
            }],
            network: Some(NetworkStats {
                time: t,
                default: InterfaceStats {
                    name: "eth0".into(),
                    rx_bytes: 9,
                    ..Default::default()
                },
                interfaces: vec![],
            }),
            volume: vec![VolumeStats {
                fs: fs.clone(),
                name: "v".into(),
            }],
            ephemeral_storage: Some(fs),
            ..Default::default()
        }],
    };
    let v = serde_json::to_value(&summary).unwrap();
    assert_eq!(v["node"]["nodeName"], "n");
    assert_eq!(v["node"]["startTime"], "2026-12-02T07:00:00Z");
    assert_eq!(v["node"]["memory"]["workingSetBytes"], 0);
    assert!(v["node"].get("network").is_none());
    let pod = &v["pods"][0];
    assert_eq!(
        pod["podRef"],
        serde_json::json!({"name": "p", "namespace": "ns", "uid": "u"})
    );
    let c = &pod["containers"][0];
    assert_eq!(c["cpu"]["usageNanoCores"], 7);
    assert_eq!(c["cpu"]["usageCoreNanoSeconds"], 8);
    assert_eq!(c["logs"]["inodesUsed"], 6);
    assert_eq!(c["logs"]["capacityBytes"], 2);
    assert!(c.get("rootfs").is_none());
    assert_eq!(pod["network"]["name"], "eth0");
    assert_eq!(pod["network"]["rxBytes"], 9);
    assert_eq!(pod["volume"][0]["name"], "v");
    assert_eq!(pod["volume"][0]["usedBytes"], 3);
    assert_eq!(pod["ephemeral-storage"]["availableBytes"], 1);
    assert_eq!(pod["memory"]["rssBytes"], 0);
}

#[test]
fn disk_usage_counts_blocks_and_inodes_without_following_links() {
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir(t.path().join("d")).unwrap();
    std::fs::write(t.path().join("d/f"), vec![1u8; 10_000]).unwrap();
    std::os::unix::fs::symlink("/usr", t.path().join("d/l")).unwrap();
    let (bytes, inodes) = disk_usage(t.path());
    assert_eq!(inodes, 4, "the root, d, f and the link");
    use std::os::unix::fs::MetadataExt;
    let blocks: u64 = ["", "d", "d/f", "d/l"]
        .iter()
        .map(|p| {
            std::fs::symlink_metadata(t.path().join(p))
                .unwrap()
                .blocks()
                * 512
        })
        .sum();
    assert_eq!(bytes, blocks);
    assert!(bytes >= 10_000, "{bytes}");
}

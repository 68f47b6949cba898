use std::os::unix::fs::symlink;

use super::*;
use crate::tests::can_mount;

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn the_pods_directory_is_mode_0750_even_when_it_was_not() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("pods")).unwrap();
    std::fs::set_permissions(
        root.path().join("pods"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    assert_eq!(
        ensure_pods_dir(root.path()).unwrap(),
        root.path().join("pods")
    );
    assert_eq!(mode(&root.path().join("pods")), 0o750);
    let fresh = tempfile::tempdir().unwrap();
    ensure_pods_dir(&fresh.path().join("agent")).unwrap();
    assert_eq!(mode(&fresh.path().join("agent/pods")), 0o750);
}

// The kubelet's cleanupOrphanedPodDirs after a kill -9: the directory of a
// pod no longer known goes, its tmpfs unmounted first; a known pod's stays;
// a symlink in pods/ is removed, not followed; a name that is no UID stays.
#[test]
fn orphaned_pod_directories_are_unmounted_and_removed() {
    if !can_mount("orphaned_pod_directories_are_unmounted_and_removed") {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let pods = ensure_pods_dir(root.path()).unwrap();
    let outside = root.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("keep"), "host").unwrap();
    let known = "11111111-2222-3333-4444-555555555555";
    let orphan = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
    let linked = "0123456789abcdef0123456789abcdef";
    std::fs::create_dir_all(pods.join(known).join("volumes")).unwrap();
    let secret = pods.join(orphan).join("volumes/kubernetes.io~secret/token");
    std::fs::create_dir_all(&secret).unwrap();
    crate::util::mount_tmpfs(&secret, Some(1 << 20)).unwrap();
    std::fs::write(secret.join("token"), "s3cret").unwrap();
    std::fs::write(pods.join(orphan).join("etc-hosts"), "x").unwrap();
    symlink(&outside, pods.join(linked)).unwrap();
    std::fs::create_dir(pods.join("lost+found")).unwrap();
    let known_uid = PodUid::parse(known).unwrap();
    let mut removed = remove_orphaned_pod_dirs(root.path(), &|u| *u == known_uid);
    removed.sort();
    assert_eq!(
        removed,
        [
            PodUid::parse(linked).unwrap(),
            PodUid::parse(orphan).unwrap()
        ]
    );
    assert!(!pods.join(orphan).exists());
    assert!(!crate::util::is_mounted(&secret).unwrap());
    assert!(pods.join(known).join("volumes").is_dir());
    assert!(pods.join("lost+found").is_dir());
    assert!(std::fs::symlink_metadata(pods.join(linked)).is_err());
    assert_eq!(
        std::fs::read_to_string(outside.join("keep")).unwrap(),
        "host"
    );
}

use super::*;
use evpleg_core::ids::ContainerId;
use evpleg_core::lifecycle::EventSource;

fn exited(name: &str, attempt: u32, code: i32, policy: &str) -> ContainerStatus {
    let id = ContainerId::parse(&"c".repeat(64)).unwrap();
    let mut s = ContainerStatus::new(id, name, ContainerState::Exited, EventSource::Relist);
    s.attempt = attempt;
    s.exit_code = Some(code);
    s.annotations
        .insert(PATH_ANNOTATION.into(), DEFAULT_PATH.into());
    s.annotations
        .insert(POLICY_ANNOTATION.into(), policy.into());
    s
}

fn pod(containers: usize) -> Pod {
    let cs: Vec<_> = (0..containers)
        .map(|i| serde_json::json!({"name": format!("c{i}"), "image": "i"}))
        .collect();
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "ns", "uid": "a".repeat(32)},
        "spec": {"containers": cs}
    }))
    .unwrap()
}

fn cri_log(lines: &[(&str, &str)]) -> String {
    lines
        .iter()
        .map(|(tag, content)| format!("2026-12-02T04:00:00.000000000Z stdout {tag} {content}\n"))
        .collect()
}

/// (name, file content or none, log lines, exit code, policy, reason,
/// expected message).
type Case<'a> = (
    &'a str,
    Option<&'a str>,
    Vec<(&'a str, &'a str)>,
    i32,
    &'a str,
    &'a str,
    String,
);

/// The kubelet's `getTerminationMessage` / `readLastStringFromContainerLogs`
/// cases: (file content or none, log lines, exit code, policy, reason,
/// expected message).
#[test]
fn what_the_kubelet_reads_as_the_message() {
    let many: Vec<(&str, String)> = (0..100).map(|i| ("F", format!("line {i}"))).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(t, l)| (*t, l.as_str())).collect();
    let last_80: String = (20..100).map(|i| format!("line {i}\n")).collect();
    let big = "x".repeat(5000) + "END";
    let cases: Vec<Case> = vec![
        (
            "the file",
            Some("bye\n"),
            vec![],
            1,
            "File",
            "",
            "bye\n".into(),
        ),
        (
            "an empty file under File",
            Some(""),
            vec![("F", "log")],
            1,
            "File",
            "",
            "".into(),
        ),
        (
            "no file",
            None,
            vec![("F", "log")],
            1,
            "File",
            "",
            "".into(),
        ),
        (
            "the file's last 4 KiB",
            Some(&big),
            vec![],
            0,
            "File",
            "",
            big[big.len() - 4096..].to_owned(),
        ),
        (
            "fallback: an empty file and a failure read the log",
            Some(""),
            vec![("F", "starting"), ("P", "fatal: "), ("F", "no config")],
            2,
            FALLBACK_TO_LOGS_ON_ERROR,
            "Error",
            "starting\nfatal: no config\n".into(),
        ),
        (
            "fallback without a file",
            None,
            vec![("F", "boom")],
            2,
            FALLBACK_TO_LOGS_ON_ERROR,
            "Error",
            "boom\n".into(),
        ),
        (
            "fallback: the file wins when it has something",
            Some("own"),
            vec![("F", "boom")],
            2,
            FALLBACK_TO_LOGS_ON_ERROR,
            "Error",
            "own".into(),
        ),
        (
            "fallback: a success does not read the log",
            Some(""),
            vec![("F", "fine")],
            0,
            FALLBACK_TO_LOGS_ON_ERROR,
            "Completed",
            "".into(),
        ),
        (
            "fallback: a container that could not run has no log",
            Some(""),
            vec![("F", "x")],
            128,
            FALLBACK_TO_LOGS_ON_ERROR,
            "ContainerCannotRun",
            "".into(),
        ),
        (
            "fallback: the last 80 lines",
            Some(""),
            many,
            1,
            FALLBACK_TO_LOGS_ON_ERROR,
            "Error",
            last_80,
        ),
        (
            "fallback: within 2 KiB",
            Some(""),
            vec![("F", &big)],
            1,
            FALLBACK_TO_LOGS_ON_ERROR,
            "Error",
            format!("{}\n", &big[big.len() - 2047..]),
        ),
    ];
    for (name, file, log, code, policy, reason, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("termination-log");
        if let Some(content) = file {
            std::fs::write(&path, content).unwrap();
        }
        let log_file = dir.path().join("0.log");
        std::fs::write(&log_file, cri_log(&log)).unwrap();
        let mut s = exited("app", 0, code, policy);
        s.reason = reason.into();
        assert_eq!(read(&s, &path, &log_file), want, "{name}");
    }
}

/// The file is made empty and writable by anyone before the container
/// starts, mounted at the container's path, and its message lands in the
/// exited container's status after the runtime's own, cut to the pod's share.
#[test]
fn prepared_files_are_read_back_into_the_status() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let p = pod(3);
    let uid = PodUid::parse(&"a".repeat(32)).unwrap();
    let c: Container =
        serde_json::from_value(serde_json::json!({"name": "c0", "image": "i"})).unwrap();
    let mount = prepare(root.path(), &uid, &c, 2).expect("a mount");
    assert_eq!(mount.container_path, DEFAULT_PATH);
    let file = host_path(root.path(), &uid, "c0", 2);
    assert_eq!(mount.host_path, file.to_string_lossy());
    let meta = std::fs::metadata(&file).unwrap();
    assert_eq!((meta.len(), meta.permissions().mode() & 0o777), (0, 0o666));
    std::fs::write(&file, "x".repeat(4096)).unwrap();
    let mut status = PodStatus {
        containers: vec![exited("c0", 2, 1, "File"), exited("c1", 0, 1, "File")],
        ..Default::default()
    };
    status.containers[0].message = "runtime says".into();
    add_messages(&p, &uid, &mut status, root.path(), logs.path());
    // 12 KiB over 3 containers: 4096 bytes each.
    let want = format!("runtime says: {}", "x".repeat(4096));
    assert_eq!(status.containers[0].message, want[..4096]);
    assert_eq!(status.containers[1].message, "");
    // An empty path: nothing mounted.
    let none: Container = serde_json::from_value(
        serde_json::json!({"name": "c1", "image": "i", "terminationMessagePath": ""}),
    )
    .unwrap();
    assert!(prepare(root.path(), &uid, &none, 0).is_none());
}

/// A symlink planted anywhere in the file's path below the root directory
/// (the pod's directory, its `containers`, the container's directory, the
/// file itself) pointing at a host directory or file: no mount, nothing
/// created or chmodded there. The old `create_dir_all` / `File::create` /
/// `set_permissions` followed each of them.
#[test]
fn a_symlink_planted_in_the_path_creates_nothing_outside() {
    use std::os::unix::fs::PermissionsExt;
    let uid = PodUid::parse(&"b".repeat(32)).unwrap();
    let c: Container =
        serde_json::from_value(serde_json::json!({"name": "c0", "image": "i"})).unwrap();
    let file = |root: &Path| host_path(root, &uid, "c0", 0);
    // (what is replaced by a symlink, to a directory or to a file)
    type Case = (&'static str, fn(&Path) -> PathBuf, bool);
    let cases: [Case; 4] = [
        (
            "the pod directory",
            |f| f.ancestors().nth(3).unwrap().into(),
            true,
        ),
        ("containers", |f| f.ancestors().nth(2).unwrap().into(), true),
        (
            "the container's directory",
            |f| f.parent().unwrap().into(),
            true,
        ),
        ("the file", |f| f.to_path_buf(), false),
    ];
    for (what, link, to_dir) in cases {
        let root = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        let host_file = host.path().join("passwd");
        std::fs::write(&host_file, "root:x:0:0").unwrap();
        std::fs::set_permissions(&host_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = link(&file(root.path()));
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let target = if to_dir {
            host.path()
        } else {
            host_file.as_path()
        };
        std::os::unix::fs::symlink(target, &link).unwrap();
        assert!(
            prepare(root.path(), &uid, &c, 0).is_none(),
            "{what}: refused"
        );
        let names: Vec<_> = std::fs::read_dir(host.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["passwd"], "{what}: nothing created on the host");
        let meta = std::fs::metadata(&host_file).unwrap();
        assert_eq!(
            (meta.len(), meta.permissions().mode() & 0o777),
            (10, 0o600),
            "{what}: the host file untouched"
        );
    }
}

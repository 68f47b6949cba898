use std::io::Read as _;

use super::*;

fn at(s: &str) -> Timestamp {
    s.parse().unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn gunzip(path: &Path) -> String {
    let mut out = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_string(&mut out)
        .unwrap();
    out
}

/// The runtime's reopen: a new, empty live file.
fn reopen_creates(log: &Path) -> impl FnOnce() -> std::future::Ready<Result<(), LogRotateError>> {
    let log = log.to_owned();
    move || {
        std::fs::write(&log, "").unwrap();
        std::future::ready(Ok(()))
    }
}

#[test]
fn the_policy_is_validated_as_the_kubelet_does() {
    assert!(LogPolicy::new(10, 2).is_ok());
    let e = LogPolicy::new(10, 1).unwrap_err().to_string();
    assert!(
        e.contains("--container-log-max-files") && e.contains('1'),
        "{e}"
    );
    assert!(LogPolicy::new(0, 5).is_err());
}

#[tokio::test]
async fn rotations_rename_compress_and_keep_max_files() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("0.log");
    let policy = LogPolicy::new(1, 3).unwrap();
    std::fs::write(&log, "first\n").unwrap();
    std::fs::write(t.path().join("1.log"), "another attempt\n").unwrap();
    let r1 = rotate_log(
        &log,
        policy,
        at("2026-12-02T07:00:01Z"),
        reopen_creates(&log),
    )
    .await
    .unwrap();
    assert_eq!(r1, Some(t.path().join("0.log.20261202-070001")));
    assert_eq!(names(t.path()), ["0.log", "0.log.20261202-070001", "1.log"]);
    std::fs::write(&log, "second\n").unwrap();
    rotate_log(
        &log,
        policy,
        at("2026-12-02T07:00:02Z"),
        reopen_creates(&log),
    )
    .await
    .unwrap();
    // The older one compressed, the newest plain.
    assert_eq!(
        names(t.path()),
        [
            "0.log",
            "0.log.20261202-070001.gz",
            "0.log.20261202-070002",
            "1.log"
        ]
    );
    assert_eq!(
        gunzip(&t.path().join("0.log.20261202-070001.gz")),
        "first\n"
    );
    std::fs::write(&log, "third\n").unwrap();
    rotate_log(
        &log,
        policy,
        at("2026-12-02T07:00:03Z"),
        reopen_creates(&log),
    )
    .await
    .unwrap();
    // max-files 3: the live file, the one just rotated, one compressed.
    assert_eq!(
        names(t.path()),
        [
            "0.log",
            "0.log.20261202-070002.gz",
            "0.log.20261202-070003",
            "1.log"
        ]
    );
    assert_eq!(
        gunzip(&t.path().join("0.log.20261202-070002.gz")),
        "second\n"
    );
    assert_eq!(
        std::fs::read_to_string(t.path().join("0.log.20261202-070003")).unwrap(),
        "third\n"
    );
    assert_eq!(
        std::fs::read_to_string(t.path().join("1.log")).unwrap(),
        "another attempt\n"
    );
}

#[tokio::test]
async fn leftovers_are_cleaned_and_a_taken_name_waits() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("0.log");
    let policy = LogPolicy::new(1, 5).unwrap();
    std::fs::write(&log, "live\n").unwrap();
    // An interrupted compression: its .tmp, and a plain file with its .gz.
    for f in [
        "0.log.20261202-060000.tmp",
        "0.log.20261202-060001",
        "0.log.20261202-060001.gz",
    ] {
        std::fs::write(t.path().join(f), "x").unwrap();
    }
    assert_eq!(
        prepare_rotation(&log, policy).unwrap(),
        [t.path().join("0.log.20261202-060001.gz")]
    );
    assert_eq!(names(t.path()), ["0.log", "0.log.20261202-060001.gz"]);
    // A second rotation in the same second: nothing moves.
    std::fs::write(t.path().join("0.log.20261202-070000"), "rotated\n").unwrap();
    let r = rotate_log(
        &log,
        policy,
        at("2026-12-02T07:00:00Z"),
        reopen_creates(&log),
    )
    .await
    .unwrap();
    assert_eq!(r, None);
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "live\n");
}

#[tokio::test]
async fn a_refused_reopen_renames_the_file_back() {
    let t = tempfile::tempdir().unwrap();
    let log = t.path().join("0.log");
    std::fs::write(&log, "live\n").unwrap();
    let e = rotate_log(
        &log,
        LogPolicy::new(1, 5).unwrap(),
        at("2026-12-02T07:00:00Z"),
        || std::future::ready(Err(LogRotateError::Policy("refused".into()))),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("refused"), "{e}");
    assert_eq!(names(t.path()), ["0.log"]);
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "live\n");
}

#[test]
fn each_running_container_is_asked_for_its_log_path_once() {
    let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let mut paths = LogPaths::default();
    // Round 1: both unknown; a's status fails, b has no log file.
    let round = ids(&["a", "b"]);
    assert_eq!(paths.unknown(&round), ["a", "b"]);
    paths.learn("b", String::new());
    assert_eq!(paths.get("b"), None);
    // Round 2: a again (its status failed), b known; c new.
    let round = ids(&["a", "b", "c"]);
    assert_eq!(paths.unknown(&round), ["a", "c"]);
    paths.learn("a", "/var/log/pods/p/a/0.log".into());
    paths.learn("c", "/var/log/pods/p/c/0.log".into());
    assert_eq!(paths.get("a"), Some(Path::new("/var/log/pods/p/a/0.log")));
    // Round 3: nothing to ask; a stopped and is forgotten.
    let round = ids(&["b", "c"]);
    assert!(paths.unknown(&round).is_empty());
    assert_eq!(paths.get("a"), None);
    // Round 4: a's id running again (a restarted runtime reusing it) is
    // asked again, not taken from memory.
    let round = ids(&["a", "c"]);
    assert_eq!(paths.unknown(&round), ["a"]);
}

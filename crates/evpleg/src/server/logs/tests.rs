use super::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const FILE: &str = "2026-01-01T00:00:01.5Z stdout F one
2026-01-01T00:00:02.000000001Z stderr F two
2026-01-01T00:00:03Z stdout P thr
not a log line
2026-01-01T00:00:03.25Z stdout F ee
2026-01-01T00:00:04Z stdout F four
";

fn write(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("0.log");
    std::fs::write(&path, text).unwrap();
    path
}

async fn read(path: &Path, opts: LogOptions) -> String {
    let (tx, mut rx) = mpsc::channel(16);
    let opts2 = opts.clone();
    let path = path.to_owned();
    let task = tokio::spawn(async move { read_logs(&path, &opts2, tx, || async { false }).await });
    let mut out = Vec::new();
    while let Some(b) = rx.recv().await {
        out.extend_from_slice(&b);
    }
    task.await.unwrap().unwrap();
    String::from_utf8(out).unwrap()
}

#[test]
fn lines_parse_as_the_cri_writes_them() {
    let l = parse_line(b"2026-01-01T00:00:01.5+02:00 stderr P:x some text ").unwrap();
    assert_eq!(l.stream, "stderr");
    assert!(l.partial);
    assert_eq!(l.content, b"some text ");
    assert_eq!(l.time.to_string(), "2025-12-31T22:00:01.5Z");
    assert_eq!(
        parse_line(b"2026-01-01T00:00:01Z stdout F")
            .unwrap()
            .content,
        b""
    );
    assert!(parse_line(b"2026-01-01T00:00:01Z stdin F x").is_none());
    assert!(parse_line(b"yesterday stdout F x").is_none());
    assert!(parse_line(b"2026-01-01T00:00:01Z stdout X x").is_none());
}

#[tokio::test]
async fn the_kubelet_s_options() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), FILE);
    assert_eq!(
        read(&path, LogOptions::default()).await,
        "one\ntwo\nthree\nfour\n"
    );
    let tail = |n| LogOptions {
        tail: Some(n),
        ..LogOptions::default()
    };
    assert_eq!(read(&path, tail(0)).await, "");
    assert_eq!(read(&path, tail(1)).await, "four\n");
    // Partial lines and unparsable ones count as lines of the file.
    assert_eq!(read(&path, tail(2)).await, "ee\nfour\n");
    assert_eq!(read(&path, tail(4)).await, "three\nfour\n");
    assert_eq!(read(&path, tail(100)).await, "one\ntwo\nthree\nfour\n");
    let since = LogOptions {
        since: Some("2026-01-01T00:00:02Z".parse().unwrap()),
        ..LogOptions::default()
    };
    assert_eq!(read(&path, since).await, "two\nthree\nfour\n");
    let limit = LogOptions {
        limit_bytes: Some(6),
        ..LogOptions::default()
    };
    assert_eq!(read(&path, limit).await, "one\ntw");
    let stamps = LogOptions {
        timestamps: true,
        tail: Some(5),
        ..LogOptions::default()
    };
    assert_eq!(
        read(&path, stamps).await,
        "2026-01-01T00:00:02.000000001Z two\n2026-01-01T00:00:03Z thr\
         2026-01-01T00:00:03.25Z ee\n2026-01-01T00:00:04Z four\n"
    );
    // A last line without its newline is still read.
    let path = write(
        dir.path(),
        "2026-01-01T00:00:01Z stdout F a\n2026-01-01T00:00:02Z stdout F b",
    );
    assert_eq!(read(&path, LogOptions::default()).await, "a\nb\n");
}

#[tokio::test]
async fn a_big_file_s_tail_spans_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::new();
    for i in 0..20_000 {
        text.push_str(&format!("2026-01-01T00:00:01Z stdout F line {i}\n"));
    }
    let path = write(dir.path(), &text);
    let out = read(
        &path,
        LogOptions {
            tail: Some(3),
            ..LogOptions::default()
        },
    )
    .await;
    assert_eq!(out, "line 19997\nline 19998\nline 19999\n");
}

#[tokio::test]
async fn following_reads_what_is_written_until_the_container_stops() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "2026-01-01T00:00:01Z stdout F first\n");
    let running = Arc::new(AtomicBool::new(true));
    let (tx, mut rx) = mpsc::channel(16);
    let opts = LogOptions {
        follow: true,
        ..LogOptions::default()
    };
    let (p, r) = (path.clone(), running.clone());
    let task = tokio::spawn(async move {
        read_logs(&p, &opts, tx, || {
            let r = r.clone();
            async move { r.load(Ordering::SeqCst) }
        })
        .await
    });
    async fn next(rx: &mut mpsc::Receiver<Bytes>) -> Option<Bytes> {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a line within 10 s")
    }
    assert_eq!(next(&mut rx).await.unwrap(), "first\n");
    let append = |s: &str| {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(s.as_bytes()).unwrap();
    };
    // Half a line, then the rest: one line out.
    append("2026-01-01T00:00:02Z stdout F sec");
    append("ond\n");
    assert_eq!(next(&mut rx).await.unwrap(), "second\n");
    // Rotation: a new file at the path is read from its start.
    std::fs::rename(&path, dir.path().join("0.log.1")).unwrap();
    std::fs::write(&path, "2026-01-01T00:00:03Z stdout F rotated\n").unwrap();
    assert_eq!(next(&mut rx).await.unwrap(), "rotated\n");
    // Written just before the container stopped: read, then the end.
    append("2026-01-01T00:00:04Z stdout F last\n");
    running.store(false, Ordering::SeqCst);
    assert_eq!(next(&mut rx).await.unwrap(), "last\n");
    assert!(next(&mut rx).await.is_none(), "the stream ends");
    task.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_client_gone_ends_a_follow() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "2026-01-01T00:00:01Z stdout F first\n");
    let (tx, rx) = mpsc::channel(16);
    drop(rx);
    let opts = LogOptions {
        follow: true,
        ..LogOptions::default()
    };
    tokio::time::timeout(
        Duration::from_secs(10),
        read_logs(&path, &opts, tx, || async { true }),
    )
    .await
    .expect("ended within 10 s")
    .unwrap();
}

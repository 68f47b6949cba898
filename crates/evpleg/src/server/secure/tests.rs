use super::*;

fn now() -> Timestamp {
    "2026-01-01T00:10:00Z".parse().unwrap()
}

fn code(q: &str) -> StatusCode {
    log_options(Some(q), now()).map(|_| ()).unwrap_err().code()
}

#[test]
fn log_options_decode_and_validate_as_the_kubelet_s() {
    assert_eq!(
        LogQueryError::Invalid.to_string(),
        r#"{"message": "Invalid request."}"#
    );
    let (o, previous) = log_options(
        Some("follow=true&previous=1&timestamps=T&tailLines=10&limitBytes=500&sinceSeconds=60"),
        now(),
    )
    .unwrap();
    assert!(previous && o.follow && o.timestamps);
    assert_eq!((o.tail, o.limit_bytes), (Some(10), Some(500)));
    assert_eq!(o.since, Some("2026-01-01T00:09:00Z".parse().unwrap()));
    let (o, previous) =
        log_options(Some("sinceTime=2026-01-01T00%3A05%3A00Z&tail=3"), now()).unwrap();
    assert!(!previous);
    assert_eq!(
        (o.since, o.tail),
        (Some("2026-01-01T00:05:00Z".parse().unwrap()), Some(3))
    );
    assert_eq!(
        log_options(Some("tail=all&tailLines=4"), now())
            .unwrap()
            .0
            .tail,
        None
    );
    assert_eq!(log_options(None, now()).unwrap().0, LogOptions::default());
    assert_eq!(code("tailLines=-1"), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(code("limitBytes=0"), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(code("sinceSeconds=0"), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        code("sinceSeconds=5&sinceTime=2026-01-01T00:05:00Z"),
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        code("limitBytes=99999999999999999999"),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(code("tailLines=ten"), StatusCode::BAD_REQUEST);
    assert_eq!(code("follow=yes"), StatusCode::BAD_REQUEST);
    assert_eq!(code("sinceTime=yesterday"), StatusCode::BAD_REQUEST);
}

fn pod(status: serde_json::Value) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"containers": [{"name": "c"}]},
        "status": {"containerStatuses": [status]},
    }))
    .unwrap()
}

#[test]
fn the_container_whose_logs_are_read_follows_its_state() {
    let running = pod(serde_json::json!({
        "name": "c", "image": "i", "imageID": "", "ready": true, "restartCount": 1,
        "containerID": "containerd://aaa",
        "state": {"running": {}},
        "lastState": {"terminated": {"exitCode": 1, "containerID": "containerd://bbb"}},
    }));
    assert_eq!(log_container_id(&running, "c", false).unwrap(), "aaa");
    assert_eq!(log_container_id(&running, "c", true).unwrap(), "bbb");
    assert_eq!(
        log_container_id(&running, "x", false).unwrap_err(),
        r#"container "x" in pod "p" is not available"#
    );
    let fresh = pod(serde_json::json!({
        "name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"waiting": {"reason": "ErrImagePull"}},
    }));
    assert_eq!(
        log_container_id(&fresh, "c", true).unwrap_err(),
        r#"previous terminated container "c" in pod "p" not found"#
    );
    assert_eq!(
        log_container_id(&fresh, "c", false).unwrap_err(),
        r#"container "c" in pod "p" is waiting to start: image can't be pulled"#
    );
    let backing_off = pod(serde_json::json!({
        "name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 2,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "containerID": "containerd://ccc"}},
    }));
    assert_eq!(log_container_id(&backing_off, "c", false).unwrap(), "ccc");
    let done = pod(serde_json::json!({
        "name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "containerID": "containerd://ddd"}},
    }));
    assert_eq!(log_container_id(&done, "c", false).unwrap(), "ddd");
}

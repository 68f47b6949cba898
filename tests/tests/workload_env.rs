//! What workloads notice (issue #27), end to end against the real
//! containerd: a container's environment (`$(VAR)` expansion in env and
//! command, `fieldRef`, `resourceFieldRef`), its termination message
//! written to `/dev/termination-log` and shown in its terminated state, its
//! `oom_score_adj` as the kubelet's Burstable formula (read by the
//! container's own process from `/proc/self/oom_score_adj`), and
//! `activeDeadlineSeconds` failing the pod with `DeadlineExceeded` and
//! killing its container (Failed and unready at once, as the kubelet's
//! `/pods` serves it, while the container runs its grace period).
//! Privileged: skipped with a reason without root.
//!
//! The environment's API lookups against the real kube-apiserver, as the
//! agent's Node identity (`system:node:<node>` under the Node authorizer,
//! which lets a node read only the ConfigMaps and Secrets its bound pods
//! reference): `configMapKeyRef`/`secretKeyRef` with optional and missing
//! objects and keys, `envFrom` with prefixes, service variables with
//! `enableServiceLinks` true and false, and the watched Service cache (one
//! list however many starts; a new Service in the next start's
//! environment). No root needed; skipped without the control plane's
//! binaries (a failure under `CI=true`).

use std::time::Instant;

use evpleg_kubelet::env::{self, ApiClient, ContainerEnv, EnvContext};
use evpleg_tests::api_fixtures::{WAIT, init_logging};
use evpleg_tests::control_plane::{self, ControlPlane};
use evpleg_tests::e2e::*;
use evpleg_tests::e2e_test;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use kube::Api;
use kube::api::PostParams;

fn env_pod() -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: envpod
spec:
  hostNetwork: true
  restartPolicy: Never
  containers:
    - name: app
      image: {IMAGE}
      env:
        - name: A
          value: a
        - name: B
          value: $(A)-b
        - name: NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: MEM
          valueFrom:
            resourceFieldRef:
              resource: requests.memory
              divisor: 1Mi
      resources:
        requests:
          memory: 64Mi
      command: ["sh", "-c", "echo \"$B $NAME $MEM $(A)-cmd\" > /dev/termination-log; cat /proc/self/oom_score_adj >> /dev/termination-log; exit 3"]
"#
    )
}

e2e_test!(
    environment_termination_message_and_oom_score_reach_the_container,
    |e| {
        Box::pin(async move {
            e.write("envpod.yaml", &env_pod());
            let pod = e
                .wait_for("envpod", "terminated", |p| {
                    container(p, "app")["state"]["terminated"].is_object()
                })
                .await;
            let terminated = &container(&pod, "app")["state"]["terminated"];
            assert_eq!(terminated["exitCode"], 3, "{pod:#}");
            let memory = evpleg_core::machine::memory_bytes();
            let oom = 1000 - 1000 * (64 << 20) / memory;
            assert_eq!(
                terminated["message"],
                format!("a-b envpod-{NODE} 64 a-cmd\n{oom}\n"),
                "{pod:#}"
            );
        })
    }
);

e2e_test!(active_deadline_fails_the_pod_and_kills_its_container, |e| {
    Box::pin(async move {
        e.write(
            "deadline.yaml",
            &manifest(
                "deadline",
                "Always",
                "sleep 600",
                "  activeDeadlineSeconds: 3\n",
            ),
        );
        // Every status served on the way: Failed at the deadline, its
        // container still running its 3 s grace, as the kubelet's `/pods`
        // serves it, and from then on never Ready (before: Ready and
        // ContainersReady True until the container ended).
        let seen = std::sync::Mutex::new((Vec::new(), false));
        let pod = e
            .wait_for("deadline", "failed", |p| {
                let failed = |kind: &str| {
                    p["status"]["conditions"].as_array().is_some_and(|l| {
                        l.iter().any(|c| {
                            c["type"] == kind
                                && c["status"] == "False"
                                && c["reason"] == "PodFailed"
                        })
                    })
                };
                let mut seen = seen.lock().unwrap();
                if p["status"]["phase"] == "Failed" {
                    if !(failed("Ready") && failed("ContainersReady")) {
                        seen.0.push(p.clone());
                    }
                    if container(p, "app")["state"]["running"].is_object() {
                        seen.1 = true;
                    }
                }
                p["status"]["phase"] == "Failed"
                    && container(p, "app")["state"]["terminated"].is_object()
            })
            .await;
        let (ready_when_failed, failed_while_running) = seen.into_inner().unwrap();
        assert!(
            ready_when_failed.is_empty(),
            "Failed but not unready: {:#}",
            ready_when_failed[0]
        );
        assert!(
            failed_while_running,
            "no status between the deadline and the kill: {pod:#}"
        );
        assert_eq!(pod["status"]["reason"], "DeadlineExceeded", "{pod:#}");
        assert_eq!(
            pod["status"]["message"],
            "Pod was active on the node longer than the specified deadline"
        );
    })
});

/// Creates `obj` in `ns` as the admin.
async fn create<K>(admin: &kube::Client, ns: &str, obj: serde_json::Value) -> K
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let obj: K = serde_json::from_value(obj).expect("a valid object");
    Api::<K>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("create {obj:?}: {e}"))
}

/// The environment of `pod`'s container `name`, read as the agent reads it.
async fn environment(api: &ApiClient, pod: &Pod, name: &str) -> Result<ContainerEnv, String> {
    let spec = pod.spec.as_ref().expect("a spec");
    let container = spec
        .containers
        .iter()
        .find(|c| c.name == name)
        .expect("the container");
    let ctx = EnvContext {
        pod,
        container,
        pod_ips: &[],
        host_ip: "10.1.0.1",
    };
    let objects = env::fetch(Some(api), &ctx)
        .await
        .map_err(|e| e.to_string())?;
    env::make_environment(&ctx, &objects).map_err(|e| e.to_string())
}

/// The service lists `user` sent (any namespace's, or all of them).
fn service_lists(cp: &ControlPlane, user: &str) -> usize {
    cp.audit()
        .iter()
        .filter(|r| r.user == user && r.verb == "list" && r.path().ends_with("/services"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_lookups_and_service_variables_through_the_real_api_server_as_the_node() {
    init_logging();
    let test = "env_lookups_and_service_variables_through_the_real_api_server_as_the_node";
    if !control_plane::available(test) {
        return;
    }
    let cp = ControlPlane::shared().await;
    let ns = cp.namespace("env").await;
    let node = format!("node-{}", &ns[4..]);
    let user = format!("system:node:{node}");
    let admin = cp.admin().await;
    let _: ConfigMap = create(
        &admin,
        &ns,
        serde_json::json!({
            "metadata": {"name": "settings"}, "data": {"a": "1", "b": "two"}
        }),
    )
    .await;
    let _: Secret = create(
        &admin,
        &ns,
        serde_json::json!({
            "metadata": {"name": "creds"}, "stringData": {"user": "alice"}
        }),
    )
    .await;
    let _: Service = create(
        &admin,
        &ns,
        serde_json::json!({
            "metadata": {"name": "my-db"},
            "spec": {"ports": [{"name": "pg", "port": 5432}]}
        }),
    )
    .await;
    let key_ref = |kind: &str, name: &str, key: &str, optional: bool| serde_json::json!({kind: {"name": name, "key": key, "optional": optional}});
    let pod = |name: &str, links: bool| {
        serde_json::json!({
            "metadata": {"name": name},
            "spec": {
                "nodeName": node, "enableServiceLinks": links,
                "containers": [
                    {"name": "app", "image": "busybox",
                     "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "S_"},
                                 {"secretRef": {"name": "creds"}, "prefix": "C_"},
                                 {"configMapRef": {"name": "absent", "optional": true}}],
                     "env": [
                        {"name": "CM_A", "valueFrom": key_ref("configMapKeyRef", "settings", "a", false)},
                        {"name": "USER", "valueFrom": key_ref("secretKeyRef", "creds", "user", false)},
                        {"name": "NO_KEY", "valueFrom": key_ref("configMapKeyRef", "settings", "zzz", true)},
                        {"name": "NO_MAP", "valueFrom": key_ref("configMapKeyRef", "absent", "a", true)},
                        {"name": "NO_SECRET", "valueFrom": key_ref("secretKeyRef", "gone", "k", true)},
                        {"name": "HOST", "value": "$(MY_DB_SERVICE_HOST):$(MY_DB_SERVICE_PORT)"}]},
                    {"name": "missing-key", "image": "busybox",
                     "env": [{"name": "X", "valueFrom": key_ref("configMapKeyRef", "settings", "zzz", false)}]},
                    {"name": "missing-secret", "image": "busybox",
                     "env": [{"name": "X", "valueFrom": key_ref("secretKeyRef", "gone", "k", false)}]}
                ]
            }
        })
    };
    let linked: Pod = create(&admin, &ns, pod("linked", true)).await;
    let unlinked: Pod = create(&admin, &ns, pod("unlinked", false)).await;
    let api = ApiClient::new(cp.node_client(&node).await);

    let got = environment(&api, &linked, "app")
        .await
        .expect("the environment");
    let db: Service = Api::namespaced(admin.clone(), &ns)
        .get("my-db")
        .await
        .expect("my-db");
    let db_ip = db.spec.and_then(|s| s.cluster_ip).expect("a cluster IP");
    let master: Service = Api::namespaced(admin.clone(), "default")
        .get("kubernetes")
        .await
        .expect("default/kubernetes");
    let master_ip = master
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("a cluster IP");
    let picked: Vec<(&str, &str)> = [
        "S_a",
        "S_b",
        "C_user",
        "CM_A",
        "USER",
        "HOST",
        "MY_DB_SERVICE_PORT_PG",
        "KUBERNETES_SERVICE_HOST",
        "KUBERNETES_SERVICE_PORT",
    ]
    .iter()
    .map(|k| (*k, got.env.get(*k).map_or("<unset>", String::as_str)))
    .collect();
    let host = format!("{db_ip}:5432");
    assert_eq!(
        picked,
        [
            ("S_a", "1"),
            ("S_b", "two"),
            ("C_user", "alice"),
            ("CM_A", "1"),
            ("USER", "alice"),
            ("HOST", host.as_str()),
            ("MY_DB_SERVICE_PORT_PG", "5432"),
            ("KUBERNETES_SERVICE_HOST", master_ip.as_str()),
            ("KUBERNETES_SERVICE_PORT", "443"),
        ]
    );
    for absent in ["NO_KEY", "NO_MAP", "NO_SECRET"] {
        assert!(!got.env.contains_key(absent), "{absent}: {:?}", got.env);
    }
    assert_eq!(
        environment(&api, &linked, "missing-key").await.unwrap_err(),
        format!("couldn't find key zzz in ConfigMap {ns}/settings")
    );
    assert_eq!(
        environment(&api, &linked, "missing-secret")
            .await
            .unwrap_err(),
        "secret \"gone\" not found"
    );
    // Without service links: the master's variables only, `$(...)` of the
    // others left as written.
    let got = environment(&api, &unlinked, "app")
        .await
        .expect("the environment");
    let services: Vec<&String> = got.env.keys().filter(|k| k.contains("_SERVICE_")).collect();
    assert!(
        services.iter().all(|k| k.starts_with("KUBERNETES_")) && !services.is_empty(),
        "{services:?}"
    );
    assert_eq!(
        got.env["HOST"],
        "$(MY_DB_SERVICE_HOST):$(MY_DB_SERVICE_PORT)"
    );
    assert_eq!(got.env["KUBERNETES_SERVICE_HOST"], master_ip);

    // Every start reads the watched copy: one list so far, whatever the starts.
    for _ in 0..5 {
        environment(&api, &linked, "app")
            .await
            .expect("the environment");
    }
    assert_eq!(service_lists(&cp, &user), 1, "service lists after 7 starts");
    // A new Service is in a later start's environment, through the watch.
    let _: Service = create(
        &admin,
        &ns,
        serde_json::json!({
            "metadata": {"name": "late"}, "spec": {"ports": [{"port": 80}]}
        }),
    )
    .await;
    let deadline = Instant::now() + WAIT;
    loop {
        let got = environment(&api, &linked, "app")
            .await
            .expect("the environment");
        if got.env.contains_key("LATE_SERVICE_HOST") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "LATE_SERVICE_HOST not within {WAIT:?}: {:?}",
            got.env
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        service_lists(&cp, &user),
        1,
        "service lists after the watch brought one"
    );
    let refused = cp.refused(&user);
    assert!(refused.is_empty(), "the node was refused: {refused:?}");
}

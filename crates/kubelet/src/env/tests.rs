use super::*;
use serde_json::json;

fn pod(container: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": "ns", "uid": "u-1",
                     "labels": {"app": "web"}, "annotations": {"a": "b"}},
        "spec": {"nodeName": "node-1", "serviceAccountName": "runner",
                 "containers": [container]}
    }))
    .unwrap()
}

fn objects() -> Objects {
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "cfg", "namespace": "ns"},
        "data": {"REPLACE_ME": "cfg", "B": "b-value", "key": "from-key"}
    }))
    .unwrap();
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "sec", "namespace": "ns"},
        "data": {"PASSWORD": "czNjcmV0", "user": "YWRtaW4="}
    }))
    .unwrap();
    let services: Vec<Service> = serde_json::from_value(json!([
        {"metadata": {"name": "kubernetes", "namespace": "default"},
         "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "https", "port": 443, "protocol": "TCP"}]}},
        {"metadata": {"name": "db", "namespace": "ns"},
         "spec": {"clusterIP": "10.96.0.7", "ports": [{"port": 5432, "protocol": "TCP"}]}}
    ]))
    .unwrap();
    Objects {
        api: true,
        config_maps: BTreeMap::from([("cfg".to_owned(), Some(cm)), ("gone".to_owned(), None)]),
        secrets: BTreeMap::from([("sec".to_owned(), Some(secret)), ("nope".to_owned(), None)]),
        services,
    }
}

fn make(container: serde_json::Value, objects: &Objects) -> Result<ContainerEnv, EnvError> {
    let p = pod(container);
    let c = p.spec.as_ref().unwrap().containers[0].clone();
    let ips = ["10.244.0.5".to_owned(), "fd00::5".to_owned()];
    let ctx = EnvContext {
        pod: &p,
        container: &c,
        pod_ips: &ips,
        host_ip: "192.168.1.2",
    };
    make_environment(&ctx, objects)
}

/// The variables expected (a subset of the result) or the error's message.
type Expected = Result<Vec<(&'static str, &'static str)>, &'static str>;

/// Each case: the container's env/envFrom/command, then the variables
/// expected (a subset of the result) or the error's message.
#[test]
fn the_kubelet_s_environment_table() {
    let cases: Vec<(&str, serde_json::Value, Expected)> = vec![
        (
            "values expand earlier variables and services, undefined kept",
            json!({"env": [{"name": "A", "value": "a"},
                            {"name": "B", "value": "$(A)-b $(KUBERNETES_SERVICE_HOST) $(NOPE) $$(A)"}]}),
            Ok(vec![("A", "a"), ("B", "a-b 10.96.0.1 $(NOPE) $(A)")]),
        ),
        (
            "a later variable is not seen by an earlier one",
            json!({"env": [{"name": "B", "value": "$(A)"}, {"name": "A", "value": "a"}]}),
            Ok(vec![("B", "$(A)"), ("A", "a")]),
        ),
        (
            "field references",
            json!({"env": [
                {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
                {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "POD_IPS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}},
                {"name": "REF", "value": "$(NAME).$(NS)"}]}),
            Ok(vec![
                ("NAME", "web"),
                ("NS", "ns"),
                ("UID", "u-1"),
                ("APP", "web"),
                ("NODE", "node-1"),
                ("SA", "runner"),
                ("HOST_IP", "192.168.1.2"),
                ("POD_IP", "10.244.0.5"),
                ("POD_IPS", "10.244.0.5,fd00::5"),
                ("REF", "web.ns"),
            ]),
        ),
        (
            "resource references of the container itself",
            json!({"resources": {"limits": {"cpu": "1500m", "memory": "64Mi"}, "requests": {"cpu": "250m"}},
                   "env": [
                {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                {"name": "MCPU", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
                {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}}]}),
            Ok(vec![("CPU", "2"), ("MCPU", "250"), ("MEM", "64")]),
        ),
        (
            "envFrom with a prefix, env overriding it",
            json!({"envFrom": [{"configMapRef": {"name": "cfg"}}, {"prefix": "S_", "secretRef": {"name": "sec"}}],
                   "env": [{"name": "REPLACE_ME", "value": "env"}]}),
            Ok(vec![
                ("REPLACE_ME", "env"),
                ("B", "b-value"),
                ("key", "from-key"),
                ("S_PASSWORD", "s3cret"),
                ("S_user", "admin"),
            ]),
        ),
        (
            "key references",
            json!({"env": [
                {"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "key"}}},
                {"name": "P", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "PASSWORD"}}}]}),
            Ok(vec![("K", "from-key"), ("P", "s3cret")]),
        ),
        (
            "service variables: the master's and the namespace's, a declared one wins",
            json!({"env": [{"name": "DB_SERVICE_HOST", "value": "mine"}]}),
            Ok(vec![
                ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
                ("KUBERNETES_SERVICE_PORT", "443"),
                ("DB_SERVICE_HOST", "mine"),
                ("DB_PORT", "tcp://10.96.0.7:5432"),
            ]),
        ),
        (
            "a missing configMap",
            json!({"envFrom": [{"configMapRef": {"name": "gone"}}]}),
            Err(r#"configmap "gone" not found"#),
        ),
        (
            "a missing secret key",
            json!({"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "nokey"}}}]}),
            Err("couldn't find key nokey in Secret ns/sec"),
        ),
        (
            "a missing configMap key",
            json!({"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "nokey"}}}]}),
            Err("couldn't find key nokey in ConfigMap ns/cfg"),
        ),
        (
            "a missing secret",
            json!({"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}]}),
            Err(r#"secret "nope" not found"#),
        ),
        (
            "an unsupported field path",
            json!({"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.hostname"}}}]}),
            Err("env X: unsupported fieldPath: spec.hostname"),
        ),
    ];
    for (name, container, want) in cases {
        let mut c = json!({"name": "app", "image": "i"});
        c.as_object_mut()
            .unwrap()
            .extend(container.as_object().unwrap().clone());
        let got = make(c, &objects());
        match (want, got) {
            (Ok(vars), Ok(got)) => {
                for (k, v) in vars {
                    assert_eq!(
                        got.env.get(k).map(String::as_str),
                        Some(v),
                        "{name}: {k} in {:#?}",
                        got.env
                    );
                }
            }
            (Err(message), Err(e)) => assert_eq!(e.to_string(), message, "{name}"),
            (want, got) => panic!("{name}: wanted {want:?}, got {got:?}"),
        }
    }
}

/// `optional` sources and keys that are missing leave their variables out.
#[test]
fn optional_sources_and_keys_that_are_missing_are_left_out() {
    let env = make(
        json!({"name": "app", "envFrom": [{"configMapRef": {"name": "gone", "optional": true}},
                                          {"secretRef": {"name": "nope", "optional": true}}],
               "env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "nokey", "optional": true}}},
                       {"name": "B", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": true}}},
                       {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k", "optional": true}}},
                       {"name": "D", "value": "d"}]}),
        &objects(),
    )
    .unwrap();
    let declared: Vec<&String> = env
        .env
        .keys()
        .filter(|k| !k.starts_with("KUBERNETES_") && !k.starts_with("DB_"))
        .collect();
    assert_eq!(declared, ["D"]);
}

/// Without an API server a reference fails as the kubelet's, optional or
/// not, and there are no service variables.
#[test]
fn without_an_api_server_references_fail_and_no_services_are_given() {
    let err = make(
        json!({"name": "app", "envFrom": [{"configMapRef": {"name": "cfg", "optional": true}}]}),
        &Objects::default(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "couldn't get configMap ns/cfg, no kubeClient defined"
    );
    let env = make(
        json!({"name": "app", "env": [{"name": "A", "value": "$(KUBERNETES_SERVICE_HOST)"}]}),
        &Objects::default(),
    )
    .unwrap();
    assert_eq!(
        env.env,
        BTreeMap::from([("A".to_owned(), "$(KUBERNETES_SERVICE_HOST)".to_owned())])
    );
}

/// `enableServiceLinks: false` keeps the master service's variables only.
#[test]
fn service_links_off_keeps_only_the_master_service() {
    let mut p = pod(json!({"name": "app"}));
    p.spec.as_mut().unwrap().enable_service_links = Some(false);
    let c = p.spec.as_ref().unwrap().containers[0].clone();
    let ctx = EnvContext {
        pod: &p,
        container: &c,
        pod_ips: &[],
        host_ip: "192.168.1.2",
    };
    let env = make_environment(&ctx, &objects()).unwrap();
    assert!(env.env.contains_key("KUBERNETES_SERVICE_HOST"));
    assert!(
        !env.env.keys().any(|k| k.starts_with("DB_")),
        "{:#?}",
        env.env
    );
}

/// The kubelet's `TestExpandCommandAndArgs`: command and args see the final
/// environment, services included; undefined references stay.
#[test]
fn command_and_args_are_expanded_against_the_final_environment() {
    let env = make(
        json!({"name": "app", "command": ["sh", "-c", "echo $(A) $(KUBERNETES_SERVICE_PORT)"],
               "args": ["$(B)", "$(UNDEFINED)", "$$(A)"],
               "env": [{"name": "A", "value": "a"}, {"name": "B", "value": "$(A)-b"}]}),
        &objects(),
    )
    .unwrap();
    assert_eq!(env.command, ["sh", "-c", "echo a 443"]);
    assert_eq!(env.args, ["a-b", "$(UNDEFINED)", "$(A)"]);
}

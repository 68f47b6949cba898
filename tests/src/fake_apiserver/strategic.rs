//! A strategic merge patch applied to a pod as the API server applies the
//! kubelet's status patches (apimachinery's `StrategicMergePatch` for the
//! fields of a pod status): objects merge key by key (`null` removes), the
//! lists `conditions` (by `type`), `podIPs` and `hostIPs` (by `ip`) merge by
//! their key (`$patch: delete` removes an element, elements the patch does
//! not name stay), `$setElementOrder/<list>` orders the elements it names
//! first; every other list is replaced. Enough for the status writer; not a
//! general implementation (no `$retainKeys`, `$deleteFromPrimitiveList`, or
//! per-type merge keys beyond these).

use serde_json::{Map, Value};

/// Lists merged by a key, by field name.
const MERGE_KEYS: [(&str, &str); 3] = [("conditions", "type"), ("podIPs", "ip"), ("hostIPs", "ip")];

/// Applies `patch` to `doc`.
pub fn apply(doc: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *doc = patch.clone();
        return;
    };
    if !doc.is_object() {
        *doc = Value::Object(Map::new());
    }
    let d = doc.as_object_mut().expect("an object");
    for (k, v) in p {
        if k.starts_with("$setElementOrder/") {
            continue;
        }
        if v.is_null() {
            d.remove(k);
            continue;
        }
        match (MERGE_KEYS.iter().find(|(f, _)| f == k), v) {
            (Some((_, key)), Value::Array(items)) => {
                let list = d
                    .entry(k.clone())
                    .or_insert_with(|| Value::Array(Vec::new()));
                if !list.is_array() {
                    *list = Value::Array(Vec::new());
                }
                merge_list(list.as_array_mut().expect("a list"), items, key);
                if let Some(Value::Array(order)) = p.get(&format!("$setElementOrder/{k}")) {
                    reorder(list.as_array_mut().expect("a list"), order, key);
                }
            }
            _ => apply(d.entry(k.clone()).or_insert(Value::Null), v),
        }
    }
}

fn merge_list(list: &mut Vec<Value>, items: &[Value], key: &str) {
    for item in items {
        let k = item.get(key).cloned().unwrap_or(Value::Null);
        let at = list.iter().position(|e| e.get(key) == Some(&k));
        if item.get("$patch").and_then(Value::as_str) == Some("delete") {
            if let Some(i) = at {
                list.remove(i);
            }
            continue;
        }
        match at {
            Some(i) => apply(&mut list[i], item),
            None => list.push(item.clone()),
        }
    }
}

/// The elements `order` names first, in its order, then the others as they were.
fn reorder(list: &mut Vec<Value>, order: &[Value], key: &str) {
    let keys: Vec<&Value> = order.iter().filter_map(|o| o.get(key)).collect();
    let (mut named, rest): (Vec<Value>, Vec<Value>) = std::mem::take(list)
        .into_iter()
        .partition(|e| e.get(key).is_some_and(|k| keys.contains(&k)));
    named.sort_by_key(|e| keys.iter().position(|k| Some(*k) == e.get(key)));
    named.extend(rest);
    *list = named;
}

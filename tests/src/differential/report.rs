//! The comparison of the two sides' records, field by field, and the
//! markdown of docs/fidelity.md: a table of manifest x compared field (same or
//! different), then every difference with both values and its verdict from
//! [`super::known`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use serde_json::Value;

use super::Case;
use super::known::{self, Known, Verdict};
use super::record::{self, Record};

/// One field that differs.
#[derive(Debug, Clone)]
pub struct Difference {
    pub case: String,
    pub field: String,
    pub kubelet: Value,
    pub evpleg: Value,
    /// Its row in [`known::KNOWN`], if any.
    pub known: Option<&'static Known>,
}

/// One case compared.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub case: String,
    pub about: String,
    /// Every compared field, and whether both sides agree on it.
    pub fields: BTreeMap<String, bool>,
    pub differences: Vec<Difference>,
}

/// Compares each case's records field by field (a field one side lacks is
/// `null` there).
pub fn compare(
    cases: &[Case],
    kubelet: &BTreeMap<String, Record>,
    evpleg: &BTreeMap<String, Record>,
) -> Vec<Comparison> {
    let empty = Record::default();
    cases
        .iter()
        .map(|case| {
            let k = kubelet.get(&case.name).unwrap_or(&empty).fields(case);
            let e = evpleg.get(&case.name).unwrap_or(&empty).fields(case);
            let names: BTreeSet<&String> = k.keys().chain(e.keys()).collect();
            let mut fields = BTreeMap::new();
            let mut differences = Vec::new();
            for name in names {
                let (kv, ev) = (
                    k.get(name).cloned().unwrap_or(Value::Null),
                    e.get(name).cloned().unwrap_or(Value::Null),
                );
                let same = record::same(name, &kv, &ev);
                fields.insert(name.clone(), same);
                if !same {
                    differences.push(Difference {
                        case: case.name.clone(),
                        field: name.clone(),
                        known: known::lookup(&case.name, name),
                        kubelet: kv,
                        evpleg: ev,
                    });
                }
            }
            Comparison {
                case: case.name.clone(),
                about: case.about.clone(),
                fields,
                differences,
            }
        })
        .collect()
}

/// The differences no row of the table explains.
pub fn unexplained(comparisons: &[Comparison]) -> Vec<&Difference> {
    comparisons
        .iter()
        .flat_map(|c| &c.differences)
        .filter(|d| d.known.is_none())
        .collect()
}

/// The compared fields grouped into the summary table's columns.
const GROUPS: [(&str, &[&str]); 9] = [
    ("outcome", &["outcome"]),
    ("phases", &["phases", "pod reason, message"]),
    ("conditions", &["condition ", "qosClass"]),
    ("state", &[": state", ": states seen"]),
    ("lastState", &[": lastState"]),
    ("restarts", &[": restartCount", ": restart wait ms"]),
    ("ready/started", &[": ready", ": started"]),
    ("order", &["start order"]),
    (
        "termination",
        &[": end after removal ms", ": exit code at removal"],
    ),
];

fn group_of(field: &str) -> usize {
    GROUPS
        .iter()
        .position(|(_, keys)| {
            keys.iter().any(|k| {
                field == *k
                    || (k.starts_with(": ") && field.ends_with(k))
                    || (k.ends_with(' ') && field.starts_with(k))
            })
        })
        .unwrap_or(0)
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    let s = s.replace('|', "\\|");
    if s.chars().count() > 160 {
        format!("{}...", s.chars().take(160).collect::<String>())
    } else {
        s
    }
}

/// docs/fidelity.md's text; `header` goes under the title (how it was run).
pub fn markdown(comparisons: &[Comparison], header: &str) -> String {
    let mut out = String::from("# Fidelity: the stock kubelet and evpleg on the same pods\n\n");
    out.push_str(header);
    out.push_str("\n\n## Manifest x compared field\n\n");
    out.push_str("`same`: every field of the group agrees (within the stated tolerances); `-`: the group has no field for this manifest; otherwise the fields that differ, each `D` (deliberate), `B` (a known open bug) or `?` (unexplained).\n\n");
    out.push_str("| manifest |");
    for (g, _) in GROUPS {
        let _ = write!(out, " {g} |");
    }
    out.push_str("\n|---|");
    out.push_str(&"---|".repeat(GROUPS.len()));
    out.push('\n');
    for c in comparisons {
        let _ = write!(out, "| `{}` |", c.case);
        for (i, _) in GROUPS.iter().enumerate() {
            let fields: Vec<_> = c.fields.keys().filter(|f| group_of(f) == i).collect();
            let cell = if fields.is_empty() {
                "-".to_owned()
            } else {
                let diffs: Vec<String> = c
                    .differences
                    .iter()
                    .filter(|d| group_of(&d.field) == i)
                    .map(|d| {
                        let mark = match d.known.map(|k| k.verdict) {
                            Some(Verdict::Deliberate(_)) => "D",
                            Some(Verdict::Bug { .. }) => "B",
                            None => "?",
                        };
                        format!("{} {mark}", d.field)
                    })
                    .collect();
                if diffs.is_empty() {
                    "same".to_owned()
                } else {
                    format!("**{}**", diffs.join("; "))
                }
            };
            let _ = write!(out, " {cell} |");
        }
        out.push('\n');
    }
    out.push_str("\n## The manifests\n\n| manifest | what it exercises | fields compared | different |\n|---|---|---|---|\n");
    for c in comparisons {
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} |",
            c.case,
            c.about,
            c.fields.len(),
            c.differences.len()
        );
    }
    out.push_str("\n## The known differences\n\nThe table of tests/src/differential/known.rs, which the test tier reads: a difference no row explains fails it. Each row with how many of this run's differences it explains (0: the two sides agreed this time; the bugs that depend on timing do not show in every run).\n\n| manifest | field | verdict | the stock kubelet | evpleg | differences |\n|---|---|---|---|---|---|\n");
    for k in known::KNOWN {
        let count = comparisons
            .iter()
            .flat_map(|c| &c.differences)
            .filter(|d| {
                d.known
                    .is_some_and(|r| r.case == k.case && r.field == k.field)
            })
            .count();
        let (verdict, kubelet, evpleg) = match k.verdict {
            Verdict::Deliberate(why) => (format!("deliberate: {why}"), "", ""),
            Verdict::Bug { kubelet, evpleg } => ("bug (open)".to_owned(), kubelet, evpleg),
        };
        let _ = writeln!(
            out,
            "| `{}` | `{}` | {verdict} | {} | {} | {count} |",
            k.case,
            k.field,
            kubelet.replace('|', "\\|"),
            evpleg.replace('|', "\\|")
        );
    }
    out.push_str("\n## Differences\n\n");
    let all: Vec<&Difference> = comparisons.iter().flat_map(|c| &c.differences).collect();
    if all.is_empty() {
        out.push_str("None.\n");
    } else {
        out.push_str("| manifest | field | stock kubelet 1.37.2 | evpleg | verdict |\n|---|---|---|---|---|\n");
        for d in all {
            let verdict = match d.known.map(|k| k.verdict) {
                Some(Verdict::Deliberate(why)) => format!("deliberate: {why}"),
                Some(Verdict::Bug { .. }) => "**bug** (open; see the known differences)".to_owned(),
                None => "**unexplained**".to_owned(),
            };
            let _ = writeln!(
                out,
                "| `{}` | {} | `{}` | `{}` | {verdict} |",
                d.case,
                d.field,
                short(&d.kubelet),
                short(&d.evpleg)
            );
        }
    }
    out
}

//! The comparison of the two sides' records, field by field, and the
//! markdown of docs/fidelity.md: a table of manifest x compared field (same or
//! different), then every difference with both values and its verdict from
//! [`super::known`], for each mode run; then the known table with how many
//! differences each row explained and the rows that explained none (stale).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use serde_json::Value;

use super::known::{self, Known, Verdict};
use super::record::{self, Record};
use super::{Case, Mode};

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
    pub mode: Mode,
    pub case: String,
    pub about: String,
    /// Every compared field, and whether both sides agree on it.
    pub fields: BTreeMap<String, bool>,
    pub differences: Vec<Difference>,
}

/// Compares each case's records field by field (a field one side lacks is
/// `null` there).
pub fn compare(
    mode: Mode,
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
                        known: known::lookup(mode, &case.name, name, &kv, &ev),
                        kubelet: kv,
                        evpleg: ev,
                    });
                }
            }
            Comparison {
                mode,
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

/// The rows of the known table that `comparisons` (one mode's, of cases
/// `cases`; `whole`: the whole corpus) should have matched and did not.
pub fn stale(
    mode: Mode,
    cases: &[Case],
    whole: bool,
    comparisons: &[Comparison],
) -> Vec<&'static Known> {
    let ran: Vec<&str> = cases.iter().map(|c| c.name.as_str()).collect();
    let matched: Vec<&'static Known> = comparisons
        .iter()
        .flat_map(|c| &c.differences)
        .filter_map(|d| d.known)
        .collect();
    known::stale(mode, &ran, whole, &matched)
}

/// The compared fields grouped into the summary table's columns.
const GROUPS: [(&str, &[&str]); 10] = [
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
    ("events", &["event "]),
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

fn mode_title(mode: Mode) -> &'static str {
    match mode {
        Mode::Static => "Standalone, static pods",
        Mode::Api => "Against the real API server, API pods",
    }
}

/// docs/fidelity.md's text; `header` goes under the title (how it was run);
/// `runs`: each mode's comparisons and its stale rows.
pub fn markdown(runs: &[(Mode, Vec<Comparison>, Vec<&'static Known>)], header: &str) -> String {
    let mut out = String::from("# Fidelity: the stock kubelet and evpleg on the same pods\n\n");
    out.push_str(header);
    for (mode, comparisons, _) in runs {
        let _ = write!(
            out,
            "\n\n## {}: manifest x compared field\n\n",
            mode_title(*mode)
        );
        summary(&mut out, comparisons);
    }
    out.push_str("\n## The manifests\n\n| manifest | what it exercises | mode | fields compared | different |\n|---|---|---|---|---|\n");
    for (mode, comparisons, _) in runs {
        for c in comparisons {
            let _ = writeln!(
                out,
                "| `{}` | {} | {mode:?} | {} | {} |",
                c.case,
                c.about,
                c.fields.len(),
                c.differences.len()
            );
        }
    }
    out.push_str("\n## The known differences\n\nThe table of tests/src/differential/known.rs, which the test tier reads: a difference no row explains fails it, and so does a row that explained no difference of a run that ran its manifest (stale), unless the row is marked intermittent (a difference of timing that shows in some runs only). Each row with how many of this run's differences it explained per mode.\n\n| manifest | field | modes | verdict | the stock kubelet | evpleg | differences |\n|---|---|---|---|---|---|---|\n");
    for k in known::KNOWN {
        let counts: Vec<String> = runs
            .iter()
            .filter(|(mode, _, _)| k.modes.has(*mode))
            .map(|(mode, comparisons, _)| {
                let n = comparisons
                    .iter()
                    .flat_map(|c| &c.differences)
                    .filter(|d| d.known.is_some_and(|r| known::same_row(r, k)))
                    .count();
                format!("{mode:?} {n}")
            })
            .collect();
        let (verdict, kubelet, evpleg) = match k.verdict {
            Verdict::Deliberate(why) => (format!("deliberate: {why}"), "", ""),
            Verdict::Harness(why) => (format!("harness: {why}"), "", ""),
            Verdict::Bug { kubelet, evpleg } => ("bug (open)".to_owned(), kubelet, evpleg),
        };
        let verdict = if k.intermittent {
            format!("{verdict}, intermittent")
        } else {
            verdict
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {:?} | {verdict} | {} | {} | {} |",
            k.case,
            k.field_shown(),
            k.modes,
            kubelet.replace('|', "\\|"),
            evpleg.replace('|', "\\|"),
            counts.join(", ")
        );
    }
    let stale: Vec<String> = runs
        .iter()
        .flat_map(|(mode, _, rows)| {
            rows.iter()
                .map(move |k| format!("`{}` `{}` ({mode:?})", k.case, k.field))
        })
        .collect();
    out.push_str("\nStale rows (no difference of this run for them): ");
    if stale.is_empty() {
        out.push_str("none.\n");
    } else {
        let _ = writeln!(out, "**{}**.", stale.join("; "));
    }
    for (mode, comparisons, _) in runs {
        let _ = write!(out, "\n## {}: differences\n\n", mode_title(*mode));
        differences(&mut out, comparisons);
    }
    out
}

/// The table of manifest x compared field.
fn summary(out: &mut String, comparisons: &[Comparison]) {
    out.push_str("`same`: every field of the group agrees (within the stated tolerances); `-`: the group has no field for this manifest; otherwise the fields that differ, each `D` (deliberate), `H` (the harness: the oracle cannot run it as a node would here), `B` (a known open bug) or `?` (unexplained).\n\n");
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
                            Some(Verdict::Harness(_)) => "H",
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
}

/// Every difference with both values and its verdict.
fn differences(out: &mut String, comparisons: &[Comparison]) {
    let all: Vec<&Difference> = comparisons.iter().flat_map(|c| &c.differences).collect();
    if all.is_empty() {
        out.push_str("None.\n");
        return;
    }
    out.push_str(
        "| manifest | field | stock kubelet 1.37.2 | evpleg | verdict |\n|---|---|---|---|---|\n",
    );
    for d in all {
        let verdict = match d.known.map(|k| k.verdict) {
            Some(Verdict::Deliberate(why)) => format!("deliberate: {why}"),
            Some(Verdict::Harness(why)) => format!("harness: {why}"),
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

//! What a node operator asks first (issue #29): the tax on every process of
//! the node, the load put on the runtime, the relist's cost by pod count, the
//! agent's own memory. One field of [`crate::results::Results`] holds them
//! all (each part optional: a run with `--only` fills only its own, and
//! results written before these parts still load), and one section of the
//! report renders them, each part by its own module.

use serde::{Deserialize, Serialize};

/// The operator's parts of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OperatorResults {
    /// `--only tax`.
    #[serde(default)]
    pub tax: Option<crate::tax::TaxResults>,
    /// `--only runtime-load`.
    #[serde(default)]
    pub runtime_load: Option<crate::runtime_load::RuntimeLoad>,
    /// `--only relist-cost`.
    #[serde(default)]
    pub relist_cost: Option<crate::relist_cost::RelistCostResults>,
    /// `--only memory`.
    #[serde(default)]
    pub memory: Option<crate::memory::MemoryResults>,
}

/// The report's sections of the parts that ran (`scale`: the scale part's
/// results, whose fake-runtime relists the relist section shows beside the
/// real pods').
pub fn render(o: &OperatorResults, scale: Option<&crate::scale::ScaleResults>) -> String {
    let mut s = String::new();
    if let Some(t) = &o.tax {
        s.push_str(&crate::tax::render(t));
    }
    if let Some(l) = &o.runtime_load {
        s.push_str(&crate::runtime_load::render(l));
    }
    if let Some(r) = &o.relist_cost {
        s.push_str(&crate::relist_cost::render(r, scale));
    }
    if let Some(m) = &o.memory {
        s.push_str(&crate::memory::render(m));
    }
    s
}

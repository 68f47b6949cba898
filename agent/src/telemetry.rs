//! Logging for the whole binary: `tracing` with an `EnvFilter` read from `RUST_LOG`.

use tracing_subscriber::{EnvFilter, fmt};

/// Installs the global subscriber; `default` is used when `RUST_LOG` is unset.
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // A second call (tests) keeps the first subscriber.
    let _ = fmt().with_env_filter(filter).with_target(true).try_init();
}

//! Logging for the whole binary: `tracing` with an `EnvFilter` read from
//! `RUST_LOG`, as text for people or as one JSON object per line for log
//! collectors (`--log-format`).

use tracing_subscriber::{EnvFilter, fmt};

use crate::config::LogFormat;

/// Installs the global subscriber; `default` is used when `RUST_LOG` is unset.
/// Logs go to stderr, so that `observe`'s events on stdout stay clean.
pub fn init(default: &str, format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = fmt()
        .with_env_filter(filter)
        .with_target(true)
        .with_writer(std::io::stderr);
    // A second call (tests) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

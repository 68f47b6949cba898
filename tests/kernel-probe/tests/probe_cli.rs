//! The probe's binary as the kernel matrix runs it, without root and without
//! touching the kernel.
//!
//! This test also has a second purpose: an integration test makes cargo build the
//! package's binary, so `cargo test --workspace` builds `evpleg-kernel-probe`, and
//! the kernel matrix takes it from that build (`cargo test --workspace --no-run`,
//! xtask/src/matrix.rs) instead of compiling it and its dependencies apart
//! (docs/kernels.md).

use std::process::Command;

const PROBE: &str = env!("CARGO_BIN_EXE_evpleg-kernel-probe");

#[test]
fn help_prints_the_usage_and_does_nothing_else() {
    let out = Command::new(PROBE).arg("--help").output().expect("runs");
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.trim(), "usage: evpleg-kernel-probe [--object PATH]");
}

#[test]
fn an_unknown_argument_is_rejected_before_any_check() {
    let out = Command::new(PROBE).arg("--bogus").output().expect("runs");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(out.stdout.is_empty(), "no KERNEL or RESULT line: {out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown argument \"--bogus\""));
}

//! `evpleg_fuzz_targets::cgroup_path` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| evpleg_fuzz_targets::cgroup_path(data));

//! `evpleg_fuzz_targets::cri_response` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| evpleg_fuzz_targets::cri_response(data));

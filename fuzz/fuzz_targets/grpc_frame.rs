//! `evpleg_fuzz_targets::grpc_frame` under libFuzzer.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| evpleg_fuzz_targets::grpc_frame(data));

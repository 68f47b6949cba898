//! Compiles the vendored CRI `api.proto` (package `runtime.v1`) into Rust.
//!
//! `protox` parses the proto in pure Rust, so no system `protoc` is needed;
//! `tonic-prost-build` then generates the prost messages plus both the tonic
//! clients and servers (the servers back fake runtimes in tests).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=api.proto");

    let fds = protox::compile(["api.proto"], ["."])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Unimplemented by default: a fake runtime (the benchmark's) implements
        // only the calls it serves.
        .generate_default_stubs(true)
        .compile_fds(fds)?;
    Ok(())
}

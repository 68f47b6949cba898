//! Compiles the vendored CSI `csi.proto` (package `csi.v1`) and the kubelet's
//! plugin registration `pluginregistration.proto` (package
//! `pluginregistration`) into Rust.
//!
//! As for the CRI (`proto/build.rs`): `protox` parses in pure Rust (its
//! bundled copies of the well-known types answer csi.proto's
//! `google/protobuf/*` imports), `tonic-prost-build` generates the prost
//! messages and both clients (the agent) and servers (the test CSI driver).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=csi.proto");
    println!("cargo:rerun-if-changed=pluginregistration.proto");

    let fds = protox::compile(["csi.proto", "pluginregistration.proto"], ["."])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Unimplemented by default: the test driver serves the Identity and
        // Node services only, and of them the calls a node plugin needs.
        .generate_default_stubs(true)
        .compile_fds(fds)?;
    Ok(())
}

//! The multi-threaded main process of the kernel PLEG's thread checks
//! (`evpleg_tests::threads`): `evpleg-thread-helper <mode> <args>`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    evpleg_tests::threads::helper_main(&args)
}

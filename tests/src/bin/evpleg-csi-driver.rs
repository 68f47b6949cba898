//! The test CSI node driver (`evpleg_tests::csi_driver`): serves CSI Identity
//! and Node on `--csi-socket` and the plugin registration API on
//! `--registration-socket`, until SIGTERM or SIGINT.

use std::path::PathBuf;

use clap::Parser;
use evpleg_tests::csi_driver::{DRIVER_NAME, DriverConfig, serve};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    about = "A CSI node driver whose volumes are bind-mounted directories, for evpleg's tests"
)]
struct Args {
    /// The driver's name.
    #[arg(long, env = "EVPLEG_CSI_DRIVER_NAME", default_value = DRIVER_NAME)]
    name: String,
    /// The node id NodeGetInfo reports.
    #[arg(long, env = "EVPLEG_CSI_NODE_ID", default_value = "e2e")]
    node_id: String,
    /// The CSI socket.
    #[arg(long, env = "EVPLEG_CSI_SOCKET")]
    csi_socket: PathBuf,
    /// The registration socket (in the agent's plugins_registry directory).
    #[arg(long, env = "EVPLEG_CSI_REGISTRATION_SOCKET")]
    registration_socket: PathBuf,
    /// Backing directories, the call log, the failure files.
    #[arg(long, env = "EVPLEG_CSI_STATE_DIR")]
    state_dir: PathBuf,
    /// Do not offer STAGE_UNSTAGE_VOLUME.
    #[arg(long, env = "EVPLEG_CSI_NO_STAGE")]
    no_stage: bool,
    /// The versions GetInfo reports.
    #[arg(long, value_delimiter = ',', default_value = "1.0.0")]
    versions: Vec<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        stop.cancel();
    });
    let config = DriverConfig {
        name: args.name,
        node_id: args.node_id,
        csi_socket: args.csi_socket,
        state_dir: args.state_dir,
        stage_unstage: !args.no_stage,
        versions: args.versions,
    };
    if let Err(e) = serve(config, &args.registration_socket, shutdown).await {
        eprintln!("evpleg-csi-driver: {e}");
        std::process::exit(1);
    }
}

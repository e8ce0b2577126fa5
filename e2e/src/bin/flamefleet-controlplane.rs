//! `flamefleet-controlplane up|down|status --dir DIR`: a detached local control plane for
//! scripts and the demo (tests use `ControlPlane::shared` instead).

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use flamefleet_e2e::{ControlPlane, Lifetime, binaries};

#[derive(Parser)]
#[command(about = "Run a local etcd + kube-apiserver (no kubelet) for Flamefleet")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start etcd and kube-apiserver in the background (fresh state) and write a kubeconfig.
    Up {
        /// State directory (certificates, etcd data, logs, kubeconfig).
        #[arg(long)]
        dir: PathBuf,
    },
    /// Stop a control plane started by `up`.
    Down {
        /// The directory given to `up`.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Say whether it runs.
    Status {
        /// The directory given to `up`.
        #[arg(long)]
        dir: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Up { dir } => {
            let dir = std::path::absolute(&dir).context("resolving --dir")?;
            if ControlPlane::detached_running(&dir) {
                println!(
                    "already running; kubeconfig: {}",
                    dir.join("kubeconfig").display()
                );
                return Ok(());
            }
            ControlPlane::stop_detached(&dir)?;
            let cp = ControlPlane::start(&dir, Lifetime::Detached)?;
            println!(
                "kube-apiserver {} + etcd {} ready at {} in {:.1}s",
                binaries::kubernetes_version(),
                binaries::etcd_version(),
                cp.server(),
                cp.startup_time().as_secs_f64()
            );
            println!("kubeconfig: {}", cp.kubeconfig().display());
            println!("logs: {}/{{etcd,kube-apiserver}}.log", dir.display());
        }
        Cmd::Down { dir } => {
            let stopped = ControlPlane::stop_detached(&dir)?;
            println!("stopped {stopped} process(es)");
        }
        Cmd::Status { dir } => {
            if ControlPlane::detached_running(&dir) {
                println!("running; kubeconfig: {}", dir.join("kubeconfig").display());
            } else {
                println!("not running");
                std::process::exit(1);
            }
        }
    }
    Ok(())
}

//! The `flamefleet-store` process: the built-in artifact store on its own, over a directory
//! (the chart's store Deployment and its volume). The operator reaches it with
//! `--store remote`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;

use crate::store::builtin::tls::TlsFiles;
use crate::store::builtin::{BuiltinConfig, server};
use crate::store::install_default_crypto_provider;

/// Flags of `flamefleet-store`.
#[derive(Debug, Parser)]
#[command(
    name = "flamefleet-store",
    version,
    about = "Flamefleet's built-in artifact store: signed uploads from agents, downloads for users"
)]
pub struct StoreOptions {
    /// Directory holding the artifacts (the store's volume).
    #[arg(long, default_value = "/var/lib/flamefleet/artifacts")]
    pub dir: PathBuf,
    /// File holding the URL-signing secret shared with the operator (at least 32 bytes).
    #[arg(long)]
    pub secret_file: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Base URL at which the store is reached (used in messages and the URLs it builds).
    #[arg(long)]
    pub public_url: Option<url::Url>,
    /// Largest artifact accepted, bytes.
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub max_bytes: u64,
    /// Serve HTTPS with this certificate chain (PEM; re-read when it changes). The chart
    /// mounts the certificate the operator issues and renews.
    #[arg(long, requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// The private key of `--tls-cert-file` (PEM).
    #[arg(long, requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
}

/// Runs the store until SIGTERM/Ctrl-C.
///
/// # Errors
/// Unusable flags, secret, directory or address.
pub async fn run(options: StoreOptions) -> anyhow::Result<()> {
    install_default_crypto_provider();
    let secret = std::fs::read(&options.secret_file).with_context(|| {
        format!(
            "reading the URL-signing secret {} (the operator creates it; is its Secret mounted?)",
            options.secret_file.display()
        )
    })?;
    let tls = match (&options.tls_cert_file, &options.tls_key_file) {
        (Some(cert), Some(key)) => Some(TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
        }),
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let public_url = match &options.public_url {
        Some(url) => url.clone(),
        None => format!("{scheme}://{}/", options.listen)
            .parse()
            .context("building the store URL from --listen; pass --public-url")?,
    };
    let (_store, bound) = server::spawn(
        BuiltinConfig {
            root: options.dir.clone(),
            public_url,
            secret,
            max_upload_bytes: options.max_bytes,
        },
        options.listen,
        tls,
    )
    .await
    .context("starting the artifact store")?;
    println!("listening on {bound} ({scheme})");
    crate::app::shutdown_signal().await;
    tracing::info!("shutting down");
    Ok(())
}

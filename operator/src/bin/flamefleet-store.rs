//! `flamefleet-store`: parse flags, set up logging, run the built-in artifact store.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    flamefleet_operator::store_app::run(flamefleet_operator::store_app::StoreOptions::parse()).await
}

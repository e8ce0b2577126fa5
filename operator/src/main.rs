//! `flamefleet-operator`: parse flags, set up logging, run.

use clap::Parser;

// jemalloc with its heap profiler on, for /debug/pprof/heap (docs/observability.md).
flamefleet_selfprof::jemalloc_heap_profiling!();

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube_lease_manager=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    flamefleet_operator::app::run(flamefleet_operator::app::Options::parse()).await
}

//! `flamefleet-agent`: parse the command line, run, map errors to exit codes.

use std::process::ExitCode;

use clap::Parser as _;
use flamefleet_agent::cli::{Cli, Command, run_capture, run_serve};

// jemalloc with its heap profiler on, for /debug/pprof/heap (docs/observability.md).
flamefleet_selfprof::jemalloc_heap_profiling!();

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    flamefleet_agent::capture::route_libbpf_logs();
    // Before any capture maps a workload's file (see the module's docs).
    flamefleet_agent::sigbus::install();
    let cli = Cli::parse();
    match cli.command {
        Command::Capture(args) => match run_capture(&args) {
            Ok(report) => {
                if args.text {
                    print!("{}", report.text);
                }
                eprintln!(
                    "wrote {} ({} samples)",
                    report.output.display(),
                    report.samples
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Serve(args) => match run_serve(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

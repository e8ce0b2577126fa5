//! `flamefleet-guest --kernel RELEASE 'COMMAND'`: boots one of the kernels unpacked by
//! `scripts/guest-kernels.sh` under QEMU and runs a shell command in it on this machine's
//! files (see `flamefleet_e2e::guest`); prints its output and exits with its status. For
//! trying something on an older kernel by hand; the tests use the library.

use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use flamefleet_e2e::guest::{self, GuestConfig, Kernel};

#[derive(Parser)]
#[command(about = "Run a shell command under another kernel (QEMU, this machine's files)")]
struct Cli {
    /// Kernel release, a directory name under $FLAMEFLEET_CACHE/guest-kernels
    /// (e.g. 5.10.0-32-amd64).
    #[arg(long)]
    kernel: String,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 3072)]
    memory: u32,
    /// Guest CPUs.
    #[arg(long, default_value_t = 2)]
    cpus: u32,
    /// Kill the guest after this long.
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Kill and boot again a guest that has not started the command after this long.
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    boot_timeout: Duration,
    /// Boots tried before giving up.
    #[arg(long, default_value_t = 3)]
    boot_attempts: u32,
    /// Print the guest's serial console after the output.
    #[arg(long)]
    console: bool,
    /// Environment variables for the command, NAME=VALUE (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// The shell command (run with /bin/sh as root, working directory /).
    command: String,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected NAME=VALUE, found {s}"))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let kernel = Kernel::find(&cli.kernel)?;
    let config = GuestConfig {
        memory_mib: cli.memory,
        cpus: cli.cpus,
        timeout: cli.timeout,
        env: cli.env,
        boot_timeout: cli.boot_timeout,
        boot_attempts: cli.boot_attempts,
    };
    let out = guest::run(&kernel, &config, &cli.command)
        .with_context(|| format!("running the command under {}", cli.kernel))?;
    for hung in &out.hung_boots {
        eprintln!(
            "flamefleet-guest: a boot hung before the command and was killed after {}s, then booted again",
            hung.seconds
        );
    }
    print!("{}", out.output);
    if cli.console {
        println!("--- console ---\n{}", out.console);
    }
    eprintln!(
        "flamefleet-guest: {} exited with {} after {:.1}s",
        cli.kernel,
        out.status,
        out.elapsed.as_secs_f64()
    );
    std::process::exit(out.status);
}

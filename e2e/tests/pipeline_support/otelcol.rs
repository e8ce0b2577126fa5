//! A real OpenTelemetry Collector (scripts/otelcol.sh: v0.165 with the OTLP receiver and
//! the contrib file exporter, built from its Go modules) that the export tests send to,
//! and what its file exporter wrote, read back as OTLP `ProfilesData`.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flamefleet_pprof::otlp::common::any_value;
use flamefleet_pprof::otlp::messages::{ProfilesData, ResourceProfiles};
use prost::Message;

use super::Proc;

/// What the Collector logs once its pipelines run.
const READY: &str = "Everything is ready";

/// The Collector binary: `$FLAMEFLEET_OTELCOL`, else where `scripts/otelcol.sh` builds it.
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("FLAMEFLEET_OTELCOL") {
        return PathBuf::from(path);
    }
    let script = flamefleet_e2e::cluster::repo_root().join("scripts/otelcol.sh");
    let out = Command::new(&script)
        .arg("path")
        .output()
        .unwrap_or_else(|e| panic!("running {} path: {e}", script.display()));
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        out.status.success() && path.is_file(),
        "no OpenTelemetry Collector at {}: build it with scripts/otelcol.sh build (scripts/setup.sh does)\n{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// A running Collector: OTLP/gRPC on `host`:`port` (127.0.0.1 unless started with
/// [`Collector::start_on`]), profiles written to `output` as length-prefixed protobuf
/// `ProfilesData` (the file exporter's `proto` format).
pub struct Collector {
    pub proc: Proc,
    pub port: u16,
    pub output: PathBuf,
}

impl Collector {
    /// Starts a Collector in `dir` listening on 127.0.0.1:`port`, and waits until it is
    /// ready.
    pub fn start(dir: &Path, port: u16) -> Self {
        Self::start_on(dir, "127.0.0.1", port)
    }

    /// Starts a Collector in `dir` listening on `host`:`port` (the real node's address, for
    /// an operator running in a pod), and waits until it is ready.
    pub fn start_on(dir: &Path, host: &str, port: u16) -> Self {
        let output = dir.join(format!("otelcol-{port}.pb"));
        let config = dir.join(format!("otelcol-{port}.yaml"));
        std::fs::write(
            &config,
            format!(
                r#"receivers:
  otlp:
    protocols:
      grpc:
        endpoint: {host}:{port}
exporters:
  file:
    path: {output}
    format: proto
    append: true
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    profiles:
      receivers: [otlp]
      exporters: [file]
"#,
                output = output.display()
            ),
        )
        .unwrap();
        let log = dir.join(format!("otelcol-{port}.log"));
        let err = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(binary());
        cmd.arg("--config")
            .arg(&config)
            .arg("--feature-gates=service.profilesSupport")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err);
        // Die with the test process.
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("starting the OpenTelemetry Collector");
        let mut proc = Proc {
            name: "otelcol".into(),
            child: Some(child),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !proc.log_text().contains(READY) {
            proc.assert_alive();
            assert!(
                Instant::now() < deadline,
                "the Collector did not log {READY:?} within 60 s:\n{}",
                proc.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self { proc, port, output }
    }

    /// Every `ProfilesData` written so far, with string-table references resolved (v0.165
    /// writes resource and scope attribute keys and string values as `key_strindex` and
    /// `string_value_strindex`). A message still being written is left for the next read.
    pub fn received(&self) -> Vec<ProfilesData> {
        let bytes = std::fs::read(&self.output).unwrap_or_default();
        let mut out = Vec::new();
        let mut rest = &bytes[..];
        while rest.len() >= 4 {
            let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            if rest.len() < 4 + len {
                break;
            }
            let mut data = ProfilesData::decode(&rest[4..4 + len])
                .expect("the file exporter writes ProfilesData messages");
            let dictionary = data.dictionary.clone().unwrap_or_default();
            flamefleet_pprof::otlp::resolve_references(&mut data.resource_profiles, &dictionary)
                .expect("references inside the string table");
            out.push(data);
            rest = &rest[4 + len..];
        }
        out
    }
}

/// A resource's attributes as strings (string values only).
pub fn resource_attributes(rp: &ResourceProfiles) -> BTreeMap<String, String> {
    rp.resource
        .iter()
        .flat_map(|r| &r.attributes)
        .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
            any_value::Value::StringValue(v) => Some((kv.key.clone(), v.clone())),
            _ => None,
        })
        .collect()
}

//! Compiles the pprof schema and the agent service (needs `protoc` on PATH or
//! in `PROTOC`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=pprof/profile.proto");
    println!("cargo:rerun-if-changed=agent/agent.proto");
    prost_build::Config::new().compile_protos(&["pprof/profile.proto"], &["pprof"])?;
    // Boxed, so that a progress message (and every enum holding one) stays small: the
    // typed summary is only set on DONE.
    tonic_prost_build::configure()
        .boxed(".flamefleet.agent.v1.CaptureProgress.capture_summary")
        .compile_protos(&["agent/agent.proto"], &["agent"])?;
    Ok(())
}

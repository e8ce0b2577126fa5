//! Compiles the pprof schema and the agent service (needs `protoc` on PATH or
//! in `PROTOC`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=pprof/profile.proto");
    println!("cargo:rerun-if-changed=agent/agent.proto");
    prost_build::Config::new().compile_protos(&["pprof/profile.proto"], &["pprof"])?;
    tonic_prost_build::configure().compile_protos(&["agent/agent.proto"], &["agent"])?;
    Ok(())
}

//! Compiles the pprof schema with prost-build (needs `protoc` on PATH or in
//! `PROTOC`). The gRPC agent service will be added here later.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=pprof/profile.proto");
    prost_build::Config::new().compile_protos(&["pprof/profile.proto"], &["pprof"])?;
    Ok(())
}

//! Flamefleet wire formats.

pub mod http_serve;
pub mod identity;
pub mod latency;
pub mod summary;
pub mod tls_accept;

/// The pprof `Profile` messages (package `perftools.profiles`), as read by
/// `go tool pprof` and every other pprof consumer.
pub mod pprof {
    #![allow(missing_docs, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/perftools.profiles.rs"));
}

/// The operator-to-agent gRPC service, `flamefleet.agent.v1.AgentService`.
pub mod agent {
    #![allow(missing_docs, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/flamefleet.agent.v1.rs"));

    /// The artifacts an agent on `node` uploads for a capture of type `ty`,
    /// one `UploadSlot` each (the operator-agent contract): `cpu-<node>.pb.gz`,
    /// `heap-<node>.pb.gz`, `offcpu-<node>.pb.gz`, or `runqlat-<node>.pb.gz` and
    /// `runqlat-<node>.txt`.
    pub fn artifact_names(ty: ProfileType, node: &str) -> Vec<String> {
        match ty {
            ProfileType::Cpu => vec![format!("cpu-{node}.pb.gz")],
            ProfileType::Heap => vec![format!("heap-{node}.pb.gz")],
            ProfileType::Runqlat => vec![
                format!("runqlat-{node}.pb.gz"),
                format!("runqlat-{node}.txt"),
            ],
            ProfileType::Offcpu => vec![format!("offcpu-{node}.pb.gz")],
            ProfileType::Unspecified => Vec::new(),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn names_follow_the_agent_contract() {
            assert_eq!(artifact_names(ProfileType::Cpu, "w1"), ["cpu-w1.pb.gz"]);
            assert_eq!(artifact_names(ProfileType::Heap, "w1"), ["heap-w1.pb.gz"]);
            assert_eq!(
                artifact_names(ProfileType::Runqlat, "w1"),
                ["runqlat-w1.pb.gz", "runqlat-w1.txt"]
            );
            assert_eq!(
                artifact_names(ProfileType::Offcpu, "w1"),
                ["offcpu-w1.pb.gz"]
            );
        }
    }
}

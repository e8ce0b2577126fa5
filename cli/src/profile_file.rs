//! Reading and writing pprof files with the pprof kit: what the CLI adds is naming the
//! source in errors and its own, larger, limits (it runs on the user's machine, not beside
//! the workloads).

use flamefleet_pprof::DecodeLimits;
use flamefleet_proto::pprof::Profile;

use crate::error::{Error, Result};

pub use flamefleet_pprof::{sample_types, string};

/// Limits on one profile read: 512 MiB inflated, 1 GiB kept in memory once decoded
/// (profiles of thousands of nodes merged on the store side are far smaller; a larger one
/// is hostile, or must be split with `go tool pprof`).
pub const LIMITS: DecodeLimits = DecodeLimits {
    max_decompressed_bytes: 512 << 20,
    max_kept_bytes: 1 << 30,
};

/// Decodes and validates a pprof profile, gzipped or not; `source_name` names it in errors.
///
/// # Errors
/// [`Error::BadProfile`] saying why.
pub fn decode(bytes: &[u8], source_name: &str) -> Result<Profile> {
    flamefleet_pprof::decode_with(bytes, &LIMITS).map_err(|e| Error::BadProfile {
        source_name: source_name.to_string(),
        reason: e.to_string(),
    })
}

/// Encodes a profile as gzipped protobuf, as `go tool pprof` expects.
///
/// # Errors
/// [`Error::Io`] if compressing fails.
pub fn encode_gzip(profile: &Profile) -> Result<Vec<u8>> {
    flamefleet_pprof::encode_gzip(profile).map_err(|e| Error::Io {
        action: "compressing the merged profile".into(),
        source: std::io::Error::other(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flamefleet_proto::pprof::ValueType;

    #[test]
    fn gzip_round_trip_and_garbage() {
        let profile = Profile {
            string_table: vec![String::new(), "cpu".into()],
            sample_type: vec![ValueType { r#type: 1, unit: 1 }],
            ..Default::default()
        };
        let bytes = encode_gzip(&profile).unwrap();
        assert_eq!(decode(&bytes, "x").unwrap(), profile);
        let err = decode(&[0x1f, 0x8b, 1, 2, 3], "junk.pb.gz").unwrap_err();
        assert!(err.to_string().contains("junk.pb.gz"), "{err}");
    }
}

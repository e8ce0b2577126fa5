//! Reading and writing pprof files: gzip detection, a decompression cap, prost decode/encode.

use std::io::Read;

use flamefleet_proto::pprof::Profile;
use prost::Message;

use crate::error::{Error, Result};

/// Largest decompressed profile we accept (a guard against gzip bombs).
pub const MAX_PROFILE_BYTES: u64 = 512 * 1024 * 1024;

/// Decodes a pprof profile, gzipped or not; `source_name` names it in errors.
pub fn decode(bytes: &[u8], source_name: &str) -> Result<Profile> {
    let bad = |reason: String| Error::BadProfile {
        source_name: source_name.to_string(),
        reason,
    };
    let raw;
    let body = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes)
            .take(MAX_PROFILE_BYTES + 1)
            .read_to_end(&mut out)
            .map_err(|e| bad(format!("gunzip failed: {e}")))?;
        if out.len() as u64 > MAX_PROFILE_BYTES {
            return Err(bad(format!(
                "more than {MAX_PROFILE_BYTES} bytes once decompressed"
            )));
        }
        raw = out;
        &raw[..]
    } else {
        bytes
    };
    Profile::decode(body).map_err(|e| bad(format!("protobuf decode failed: {e}")))
}

/// Encodes a profile as gzipped protobuf, as `go tool pprof` expects.
pub fn encode_gzip(profile: &Profile) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    // Writing into a Vec cannot fail.
    let _ = enc.write_all(&profile.encode_to_vec());
    enc.finish().unwrap_or_default()
}

/// The string at `index` of the profile's string table ("" when out of range).
pub fn string(profile: &Profile, index: i64) -> &str {
    usize::try_from(index)
        .ok()
        .and_then(|i| profile.string_table.get(i))
        .map_or("", String::as_str)
}

/// The sample types of a profile as `type/unit` strings.
pub fn sample_types(profile: &Profile) -> Vec<String> {
    profile
        .sample_type
        .iter()
        .map(|vt| {
            format!(
                "{}/{}",
                string(profile, vt.r#type),
                string(profile, vt.unit)
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_round_trip_and_garbage() {
        let profile = Profile {
            string_table: vec![String::new(), "cpu".into()],
            ..Default::default()
        };
        let bytes = encode_gzip(&profile);
        assert_eq!(decode(&bytes, "x").unwrap(), profile);
        let err = decode(&[0x1f, 0x8b, 1, 2, 3], "junk.pb.gz").unwrap_err();
        assert!(err.to_string().contains("junk.pb.gz"), "{err}");
    }
}

//! SHA-256 digests of artifacts, and the (size, digest) record kept for each upload.

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// A SHA-256 digest that was not 64 hexadecimal characters.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("invalid sha256 {found:?}: expected 64 hexadecimal characters")]
pub struct DigestParseError {
    /// The refused value.
    pub found: String,
}

/// A SHA-256 digest, shown and parsed as 64 lowercase hexadecimal characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Sha256Digest([u8; 32]);

impl Sha256Digest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        Self(Sha256::digest(data).into())
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Finishes a running hash.
    pub fn finish(hasher: Sha256) -> Self {
        Self(hasher.finalize().into())
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sha256Digest({self})")
    }
}

impl FromStr for Sha256Digest {
    type Err = DigestParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 32];
        match hex::decode_to_slice(s, &mut out) {
            Ok(()) => Ok(Self(out)),
            Err(_) => Err(DigestParseError {
                found: s.to_owned(),
            }),
        }
    }
}

impl TryFrom<String> for Sha256Digest {
    type Error = DigestParseError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Sha256Digest> for String {
    fn from(d: Sha256Digest) -> Self {
        d.to_string()
    }
}

/// What the store recorded about one stored artifact: its size and SHA-256.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactDigest {
    /// Size in bytes.
    pub size_bytes: u64,
    /// SHA-256 of the content.
    pub sha256: Sha256Digest,
}

/// The size and SHA-256 of a body read chunk by chunk, refused as soon as it exceeds a limit,
/// so that no backend ever reads more than the limit of an oversized artifact.
pub(crate) struct BoundedDigest<'k> {
    key: &'k super::ArtifactKey,
    max_bytes: u64,
    size_bytes: u64,
    hasher: Sha256,
}

impl<'k> BoundedDigest<'k> {
    /// Starts on the body of `key`, allowing at most `max_bytes`.
    pub(crate) fn new(key: &'k super::ArtifactKey, max_bytes: u64) -> Self {
        Self {
            key,
            max_bytes,
            size_bytes: 0,
            hasher: Sha256::new(),
        }
    }

    /// Adds the next chunk; fails with `TooLarge` once past the limit.
    pub(crate) fn update(&mut self, chunk: &[u8]) -> Result<(), super::StoreError> {
        self.size_bytes = self.size_bytes.saturating_add(chunk.len() as u64);
        if self.size_bytes > self.max_bytes {
            return Err(super::StoreError::TooLarge {
                key: self.key.to_string(),
                max: self.max_bytes,
                found: self.size_bytes,
            });
        }
        self.hasher.update(chunk);
        Ok(())
    }

    /// [`update`](Self::update), keeping the chunk in `body` too.
    pub(crate) fn keep(
        &mut self,
        body: &mut Vec<u8>,
        chunk: &[u8],
    ) -> Result<(), super::StoreError> {
        self.update(chunk)?;
        body.extend_from_slice(chunk);
        Ok(())
    }

    /// The size and digest of everything added.
    pub(crate) fn finish(self) -> ArtifactDigest {
        ArtifactDigest {
            size_bytes: self.size_bytes,
            sha256: Sha256Digest::finish(self.hasher),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_hex() {
        let d = Sha256Digest::of(b"abc");
        let s = d.to_string();
        assert_eq!(
            s,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(s.parse::<Sha256Digest>().unwrap(), d);
        assert_eq!(s.to_uppercase().parse::<Sha256Digest>().unwrap(), d);
        assert!("abc".parse::<Sha256Digest>().is_err());
        assert!(format!("{s}00").parse::<Sha256Digest>().is_err());
    }
}

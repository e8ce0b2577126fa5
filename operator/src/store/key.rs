//! Object keys of the artifact store: `<namespace>/<request-name>-<uid>/<artifact-name>`.
//!
//! Every component is validated before it reaches a file system or an object store, so a
//! key can never name anything outside its request's prefix (no `..`, no `/`, no hidden
//! files). The same parser serves the HTTP server, which receives keys from the outside.

use std::fmt;

use thiserror::Error;

/// Longest artifact name accepted: a file name (255 bytes on most file systems) that still
/// leaves room for the built-in store's `.json` metadata suffix. Artifact names embed node
/// names, which can be long.
pub const MAX_ARTIFACT_NAME_LEN: usize = 250;

/// Longest `<request-name>-<uid>` path component: most file systems cap a name at 255 bytes.
const MAX_REQUEST_DIR_LEN: usize = 255;

/// Length of a Kubernetes UID in its canonical UUID form (`8-4-4-4-12` hex digits).
const UID_LEN: usize = 36;

/// Why a key, or one of its parts, was refused.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// The namespace is not a DNS-1123 label.
    #[error(
        "invalid namespace {found:?}: expected a DNS-1123 label (1-63 characters of a-z, 0-9 and '-', starting and ending with a letter or digit)"
    )]
    Namespace {
        /// The refused value.
        found: String,
    },
    /// The request name is not a DNS-1123 subdomain, or is too long for a directory name.
    #[error(
        "invalid ProfileRequest name {found:?}: expected 1-{max} characters of a-z, 0-9, '-' and '.', starting and ending with a letter or digit"
    )]
    RequestName {
        /// The refused value.
        found: String,
        /// The longest name that fits.
        max: usize,
    },
    /// The UID is not a lowercase UUID as the API server assigns.
    #[error(
        "invalid ProfileRequest UID {found:?}: expected a lowercase UUID like 0f8fad5b-d9cb-469f-a165-70867728950e (metadata.uid)"
    )]
    Uid {
        /// The refused value.
        found: String,
    },
    /// The artifact name has a bad character, a bad length, or starts with a dot.
    #[error(
        "invalid artifact name {found:?}: expected 1-{MAX_ARTIFACT_NAME_LEN} characters of A-Z, a-z, 0-9, '.', '_' and '-', starting with a letter or digit (no '/', no '..')"
    )]
    ArtifactName {
        /// The refused value.
        found: String,
    },
    /// The key does not have the `<namespace>/<request-name>-<uid>[/<artifact>]` shape.
    #[error(
        "invalid artifact key {found:?}: expected <namespace>/<request-name>-<uid>/<artifact-name>"
    )]
    Shape {
        /// The refused value.
        found: String,
    },
}

fn is_dns_alnum(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

fn valid_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|&c| is_dns_alnum(c) || c == b'-')
        && is_dns_alnum(b[0])
        && is_dns_alnum(b[b.len() - 1])
}

fn valid_dns_subdomain(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b.iter().all(|&c| is_dns_alnum(c) || c == b'-' || c == b'.')
        && is_dns_alnum(b[0])
        && is_dns_alnum(b[b.len() - 1])
        && !s.contains("..")
}

fn valid_uid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == UID_LEN
        && b.iter().enumerate().all(|(i, &c)| match i {
            8 | 13 | 18 | 23 => c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(&c),
        })
}

/// Checks an artifact name: a single, non-hidden path component of a safe charset.
pub fn validate_artifact_name(name: &str) -> Result<(), KeyError> {
    let b = name.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= MAX_ARTIFACT_NAME_LEN
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
        && !name.contains("..");
    if ok {
        Ok(())
    } else {
        Err(KeyError::ArtifactName {
            found: name.to_owned(),
        })
    }
}

/// The ProfileRequest that artifacts belong to: namespace, name and UID.
///
/// The UID is part of the prefix so that a request deleted and re-created under the same
/// name never sees the artifacts of its predecessor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestRef {
    namespace: String,
    name: String,
    uid: String,
}

impl RequestRef {
    /// Validates and builds a request reference.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        uid: impl Into<String>,
    ) -> Result<Self, KeyError> {
        let (namespace, name, uid) = (namespace.into(), name.into(), uid.into());
        if !valid_dns_label(&namespace) {
            return Err(KeyError::Namespace { found: namespace });
        }
        let max = MAX_REQUEST_DIR_LEN - UID_LEN - 1;
        if !valid_dns_subdomain(&name, max) {
            return Err(KeyError::RequestName { found: name, max });
        }
        if !valid_uid(&uid) {
            return Err(KeyError::Uid { found: uid });
        }
        Ok(Self {
            namespace,
            name,
            uid,
        })
    }

    /// Parses `<namespace>/<request-name>-<uid>` (the request prefix, without a trailing slash).
    pub fn parse_prefix(prefix: &str) -> Result<Self, KeyError> {
        let shape = || KeyError::Shape {
            found: prefix.to_owned(),
        };
        let (namespace, dir) = prefix.split_once('/').ok_or_else(shape)?;
        Self::from_parts(namespace, dir).map_err(|e| match e {
            KeyError::Shape { .. } => shape(),
            other => other,
        })
    }

    /// Builds a reference from a namespace and a `<request-name>-<uid>` directory component.
    fn from_parts(namespace: &str, dir: &str) -> Result<Self, KeyError> {
        let shape = || KeyError::Shape {
            found: format!("{namespace}/{dir}"),
        };
        // The UID has a fixed length, so the split is unambiguous even though both the
        // name and the UID contain dashes.
        let split = dir.len().checked_sub(UID_LEN + 1).ok_or_else(shape)?;
        if !dir.is_char_boundary(split) || dir.as_bytes()[split] != b'-' {
            return Err(shape());
        }
        Self::new(namespace, &dir[..split], &dir[split + 1..])
    }

    /// The request's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The request's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The request's UID.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// The `<request-name>-<uid>` component of the prefix.
    pub fn dir_name(&self) -> String {
        format!("{}-{}", self.name, self.uid)
    }

    /// The prefix under which all of this request's artifacts live, without a trailing slash.
    pub fn prefix(&self) -> String {
        format!("{}/{}", self.namespace, self.dir_name())
    }

    /// The key of one artifact of this request.
    pub fn artifact(&self, artifact: impl Into<String>) -> Result<ArtifactKey, KeyError> {
        let artifact = artifact.into();
        validate_artifact_name(&artifact)?;
        Ok(ArtifactKey {
            request: self.clone(),
            artifact,
        })
    }
}

impl fmt::Display for RequestRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.prefix())
    }
}

/// A validated object key: `<namespace>/<request-name>-<uid>/<artifact-name>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ArtifactKey {
    request: RequestRef,
    artifact: String,
}

impl ArtifactKey {
    /// Validates and builds the key of one artifact of one request.
    pub fn new(request: RequestRef, artifact: impl Into<String>) -> Result<Self, KeyError> {
        request.artifact(artifact)
    }

    /// Parses a full key as produced by [`ArtifactKey::to_string`].
    pub fn parse(key: &str) -> Result<Self, KeyError> {
        let shape = || KeyError::Shape {
            found: key.to_owned(),
        };
        let mut parts = key.split('/');
        let (Some(namespace), Some(dir), Some(artifact), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(shape());
        };
        let request = RequestRef::from_parts(namespace, dir).map_err(|e| match e {
            KeyError::Shape { .. } => shape(),
            other => other,
        })?;
        request.artifact(artifact)
    }

    /// The request this artifact belongs to.
    pub fn request(&self) -> &RequestRef {
        &self.request
    }

    /// The artifact's name (the last key component).
    pub fn artifact(&self) -> &str {
        &self.artifact
    }
}

impl fmt::Display for ArtifactKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.request.prefix(), self.artifact)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f8fad5b-d9cb-469f-a165-70867728950e";

    #[test]
    fn key_round_trips_through_its_string_form() {
        let req = RequestRef::new("shop", "checkout-cpu", UID).unwrap();
        let key = req.artifact("cpu-worker-1.pb.gz").unwrap();
        let s = key.to_string();
        assert_eq!(s, format!("shop/checkout-cpu-{UID}/cpu-worker-1.pb.gz"));
        assert_eq!(ArtifactKey::parse(&s).unwrap(), key);
        assert_eq!(RequestRef::parse_prefix(&req.prefix()).unwrap(), req);
    }

    #[test]
    fn traversal_and_odd_artifact_names_are_refused() {
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            ".hidden",
            "a..b",
            "a b",
            "a\\b",
            "é.pb",
            "a\0b",
            &"x".repeat(MAX_ARTIFACT_NAME_LEN + 1),
        ] {
            assert!(
                matches!(
                    validate_artifact_name(bad),
                    Err(KeyError::ArtifactName { .. })
                ),
                "{bad:?} was accepted"
            );
        }
        for good in [
            "cpu-n1.pb.gz",
            "runqlat.txt",
            "A_b-9",
            &"x".repeat(MAX_ARTIFACT_NAME_LEN),
        ] {
            validate_artifact_name(good).unwrap();
        }
    }

    #[test]
    fn request_parts_are_validated() {
        assert!(matches!(
            RequestRef::new("Shop", "a", UID),
            Err(KeyError::Namespace { .. })
        ));
        assert!(matches!(
            RequestRef::new("shop", "..", UID),
            Err(KeyError::RequestName { .. })
        ));
        assert!(matches!(
            RequestRef::new("shop", "a".repeat(219), UID),
            Err(KeyError::RequestName { max: 218, .. })
        ));
        assert!(matches!(
            RequestRef::new("shop", "a", "not-a-uid"),
            Err(KeyError::Uid { .. })
        ));
        RequestRef::new("shop", "a".repeat(218), UID).unwrap();
    }

    #[test]
    fn malformed_keys_are_refused() {
        for bad in [
            "shop",
            "shop/x",
            &format!("shop/a-{UID}"),
            &format!("shop/a-{UID}/x/y"),
            &format!("shop/a{UID}/x"),
            &format!("../a-{UID}/x"),
            &format!("shop/a-{UID}/.."),
        ] {
            assert!(ArtifactKey::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }
}

//! Sealing a ProfileDownload's answer to the client that asked for it.
//!
//! The download URLs the operator signs are bearer credentials for a few minutes. A
//! ProfileDownload is an ordinary object: whoever may `list` or `watch` profiledownloads in
//! the namespace (the aggregated `view` and `edit` roles, a controller's cache, a backup of
//! etcd) reads its status. So the URLs are never written in clear: the client creates the
//! object with a fresh X25519 public key (`spec.recipientKey`, immutable like the whole
//! spec), keeps the private key in memory, and the operator seals the URLs to that key.
//! Only the process that created the object can open the answer; the API server's
//! admission policy already checked that its user may `get` every named request.
//!
//! The construction is ECIES over X25519, the shape of HPKE's base mode (RFC 9180): the
//! operator makes an ephemeral key pair per answer, derives a ChaCha20-Poly1305 key with
//! HKDF-SHA256 from the shared secret and both public keys, and encrypts with the
//! object's `namespace/name` as associated data (an answer copied into another object
//! does not open). The key is used once, so the nonce is fixed. Everything comes from
//! `ring`, which the TLS stack already builds.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use ring::{aead, agreement, hkdf, rand};

/// Length of an X25519 public key.
const KEY_LEN: usize = 32;
/// Domain separation of the key derivation: the API and this construction's version.
const INFO: &[u8] = b"flamefleet.dev/v1alpha1 ProfileDownload sealed answer";

/// Why an answer could not be sealed or opened.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// The recipient key is not a base64 X25519 public key.
    #[error(
        "spec.recipientKey is not a base64-encoded 32-byte X25519 public key ({found} bytes decoded); the client must generate one per ProfileDownload"
    )]
    BadKey {
        /// Bytes decoded (0 when it is not base64).
        found: usize,
    },
    /// The sealed answer is not one this key can open (another key, another object, or
    /// altered).
    #[error(
        "the sealed answer does not open with this client's key: it was sealed for another key or another ProfileDownload, or altered"
    )]
    Unopenable,
    /// The system's random source or the key agreement failed.
    #[error("cryptography failed: {0}")]
    Crypto(&'static str),
}

/// A client's one-use key pair: its public half goes into `spec.recipientKey`, its private
/// half never leaves the process and opens the answer once.
pub struct AnswerKey {
    private: agreement::EphemeralPrivateKey,
    public: [u8; KEY_LEN],
}

impl std::fmt::Debug for AnswerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnswerKey")
            .field("public", &self.public_key())
            .finish_non_exhaustive()
    }
}

impl AnswerKey {
    /// A fresh key pair.
    ///
    /// # Errors
    /// [`SealError::Crypto`] when the system's random source fails.
    pub fn generate() -> Result<Self, SealError> {
        let rng = rand::SystemRandom::new();
        let private = agreement::EphemeralPrivateKey::generate(&agreement::X25519, &rng)
            .map_err(|_| SealError::Crypto("generating an X25519 key"))?;
        let public = private
            .compute_public_key()
            .map_err(|_| SealError::Crypto("computing the X25519 public key"))?;
        let mut bytes = [0u8; KEY_LEN];
        bytes.copy_from_slice(public.as_ref());
        Ok(Self {
            private,
            public: bytes,
        })
    }

    /// The public key, base64, for `spec.recipientKey`.
    pub fn public_key(&self) -> String {
        BASE64.encode(self.public)
    }

    /// Opens `sealed` (from the status of the object named `object`, `namespace/name`).
    /// Consumes the key: an answer is opened once.
    ///
    /// # Errors
    /// [`SealError::Unopenable`] for an answer sealed to another key or object, or altered.
    pub fn open(self, sealed: &str, object: &str) -> Result<Vec<u8>, SealError> {
        let raw = BASE64
            .decode(sealed.trim())
            .map_err(|_| SealError::Unopenable)?;
        if raw.len() < KEY_LEN + aead::CHACHA20_POLY1305.tag_len() {
            return Err(SealError::Unopenable);
        }
        let (ephemeral, ciphertext) = raw.split_at(KEY_LEN);
        let peer = agreement::UnparsedPublicKey::new(&agreement::X25519, ephemeral);
        let key = agreement::agree_ephemeral(self.private, &peer, |shared| {
            derive(shared, ephemeral, &self.public)
        })
        .map_err(|_| SealError::Unopenable)??;
        let mut buffer = ciphertext.to_vec();
        let plain = key
            .open_in_place(
                aead::Nonce::assume_unique_for_key([0u8; aead::NONCE_LEN]),
                aead::Aad::from(object.as_bytes()),
                &mut buffer,
            )
            .map_err(|_| SealError::Unopenable)?;
        Ok(plain.to_vec())
    }
}

/// Seals `plaintext` to `recipient_key` (base64, from `spec.recipientKey`) for the object
/// named `object` (`namespace/name`): base64 of the ephemeral public key followed by the
/// ciphertext and its tag.
///
/// # Errors
/// [`SealError::BadKey`] for a key that is not a base64 X25519 public key.
pub fn seal(recipient_key: &str, object: &str, plaintext: &[u8]) -> Result<String, SealError> {
    let recipient = BASE64
        .decode(recipient_key.trim())
        .map_err(|_| SealError::BadKey { found: 0 })?;
    if recipient.len() != KEY_LEN {
        return Err(SealError::BadKey {
            found: recipient.len(),
        });
    }
    let rng = rand::SystemRandom::new();
    let ephemeral = agreement::EphemeralPrivateKey::generate(&agreement::X25519, &rng)
        .map_err(|_| SealError::Crypto("generating an X25519 key"))?;
    let ephemeral_public = ephemeral
        .compute_public_key()
        .map_err(|_| SealError::Crypto("computing the X25519 public key"))?;
    let peer = agreement::UnparsedPublicKey::new(&agreement::X25519, &recipient);
    let key = agreement::agree_ephemeral(ephemeral, &peer, |shared| {
        derive(shared, ephemeral_public.as_ref(), &recipient)
    })
    .map_err(|_| SealError::BadKey {
        found: recipient.len(),
    })??;
    let mut buffer = plaintext.to_vec();
    key.seal_in_place_append_tag(
        aead::Nonce::assume_unique_for_key([0u8; aead::NONCE_LEN]),
        aead::Aad::from(object.as_bytes()),
        &mut buffer,
    )
    .map_err(|_| SealError::Crypto("encrypting the answer"))?;
    let mut out = ephemeral_public.as_ref().to_vec();
    out.extend_from_slice(&buffer);
    Ok(BASE64.encode(out))
}

/// The one-use AEAD key of an answer: HKDF-SHA256 over the shared secret, salted with both
/// public keys (ephemeral first).
fn derive(
    shared: &[u8],
    ephemeral: &[u8],
    recipient: &[u8],
) -> Result<aead::LessSafeKey, SealError> {
    let mut salt = Vec::with_capacity(2 * KEY_LEN);
    salt.extend_from_slice(ephemeral);
    salt.extend_from_slice(recipient);
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(shared);
    let info = [INFO];
    let okm = prk
        .expand(&info, &aead::CHACHA20_POLY1305)
        .map_err(|_| SealError::Crypto("deriving the answer key"))?;
    Ok(aead::LessSafeKey::new(aead::UnboundKey::from(okm)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_key_that_asked_opens_the_answer_of_its_object() {
        let key = AnswerKey::generate().unwrap();
        let sealed = seal(&key.public_key(), "ns/dl-1", b"https://store/x?sig=abc").unwrap();
        assert!(!sealed.contains("sig"));
        assert_eq!(
            key.open(&sealed, "ns/dl-1").unwrap(),
            b"https://store/x?sig=abc"
        );

        let other = AnswerKey::generate().unwrap();
        let sealed = seal(
            &AnswerKey::generate().unwrap().public_key(),
            "ns/dl-1",
            b"x",
        )
        .unwrap();
        assert!(matches!(
            other.open(&sealed, "ns/dl-1"),
            Err(SealError::Unopenable)
        ));

        let key = AnswerKey::generate().unwrap();
        let sealed = seal(&key.public_key(), "ns/dl-1", b"x").unwrap();
        assert!(matches!(
            key.open(&sealed, "ns/dl-2"),
            Err(SealError::Unopenable)
        ));
    }

    #[test]
    fn bad_keys_and_garbage_are_refused() {
        assert!(matches!(
            seal("not base64!", "ns/a", b"x"),
            Err(SealError::BadKey { found: 0 })
        ));
        assert!(matches!(
            seal(&BASE64.encode([1u8; 16]), "ns/a", b"x"),
            Err(SealError::BadKey { found: 16 })
        ));
        let key = AnswerKey::generate().unwrap();
        assert!(matches!(
            key.open("AAAA", "ns/a"),
            Err(SealError::Unopenable)
        ));
    }
}

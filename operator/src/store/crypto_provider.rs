//! The process-wide rustls crypto provider.
//!
//! The S3 backend's `object_store` (through reqwest 0.13) enables rustls' `aws-lc-rs`
//! provider, while kube enables `ring`. With both compiled in, rustls cannot choose a default
//! on its own and panics the first time a TLS client is built without an explicit provider
//! (kube's client does exactly that). Every binary or test that links this crate and talks
//! TLS must therefore call [`install_default_crypto_provider`] before building any client.

/// Installs rustls' `ring` provider as the process default, unless one is installed already.
///
/// Idempotent and safe to call from several tests of one binary.
pub fn install_default_crypto_provider() {
    // Err means another provider is already the default: that one is kept.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

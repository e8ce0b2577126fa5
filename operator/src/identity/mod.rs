//! Operator ↔ agent identities: the operator's CA ([`ca`]) and the signer of agents'
//! per-node serving certificates ([`csr_signer`]), and the built-in store's serving
//! certificate ([`store_cert`]). The names both sides check are in
//! [`flamefleet_proto::identity`].

pub mod ca;
pub mod csr_signer;
pub mod store_cert;

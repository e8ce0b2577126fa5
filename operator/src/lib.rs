//! The Flamefleet operator: the ProfileRequest controller ([`controller`]), the sampling-policy
//! controllers ([`sampling`]), the artifact store
//! ([`store`]), operator ↔ agent identities ([`identity`]), leader election ([`leader`]), metrics ([`metrics`]) and the probe/metrics
//! HTTP server ([`probes`]). `app` wires them together for `main`.

pub mod app;
pub mod controller;
pub mod downloads;
pub mod error;
pub mod events;
pub mod identity;
pub mod leader;
pub mod metrics;
pub mod owned_secret;
pub mod probes;
pub mod sampling;
pub mod slim_pod;
pub mod store;
pub mod store_app;

pub use error::{Error, Result};

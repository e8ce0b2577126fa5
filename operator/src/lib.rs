//! The Flamefleet operator: the ProfileRequest controller ([`controller`]), the sampling-policy
//! controllers ([`sampling`]), the artifact store
//! ([`store`]), leader election ([`leader`]), metrics ([`metrics`]) and the probe/metrics
//! HTTP server ([`probes`]). `app` wires them together for `main`.

pub mod app;
pub mod controller;
pub mod error;
pub mod leader;
pub mod metrics;
pub mod probes;
pub mod sampling;
pub mod store;

pub use error::{Error, Result};

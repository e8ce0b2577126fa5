//! The Flamefleet operator: the ProfileRequest, sampling-policy and download controllers
//! ([`controllers`]), the captures on agents ([`dispatch`]), the pod views ([`pods`]), the
//! artifact store ([`store`]), the OTLP export sink ([`export`]), operator ↔ agent
//! identities ([`identity`]), the API server clients ([`api_clients`]), leader election ([`leader`]), metrics ([`metrics`]) and the
//! probe/metrics HTTP server ([`probes`]). `app` wires them together for `main`.

pub mod api_clients;
pub mod app;
pub mod controllers;
pub mod dispatch;
pub mod error;
pub mod events;
pub mod export;
pub mod identity;
pub mod leader;
pub mod metrics;
pub mod owned_secret;
pub mod pods;
pub mod probes;
pub mod store;
pub mod store_app;

pub use error::{Error, Result};

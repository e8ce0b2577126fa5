//! The Flamefleet operator.

pub mod store;

//! The Flamefleet operator.

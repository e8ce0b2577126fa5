//! Flamefleet wire formats.

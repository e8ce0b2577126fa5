//! Flamefleet API types, group `flamefleet.dev`, version `v1alpha1`.

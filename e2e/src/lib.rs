//! Test support: a real local control plane.

//! The Flamefleet node agent.

//! One module per subcommand.

pub mod capture;
pub mod fleet;
pub mod get;
pub mod list;
pub mod merge;

//! One module per subcommand.

pub mod capture;
pub mod get;
pub mod list;
pub mod merge;

//! The operator's controllers: [`profile_request`] (captures), [`sampling`] (the policies'
//! scheduled runs) and [`download`] (signed URLs for finished requests).

pub mod download;
pub mod profile_request;
pub mod sampling;

//! The OpenAI-compatible API: request bodies and their validation, response and stream
//! chunk shapes.

pub mod request;
pub mod response;

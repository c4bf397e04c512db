//! Harrier's shared crate: what front ends and the engine core agree on.
//!
//! Module map:
//! - [`protocol`]: the versioned message types (handshake, requests, aborts, outputs, utility calls).
//! - [`codec`]: MessagePack encoding of those messages (rmp-serde).
//! - [`endpoint`]: `ipc://` / `tcp://` addresses and the private socket directory.
//! - [`transport`]: the engine side of the ZeroMQ link (ROUTER), one task owning the socket.
//! - [`client`]: the front-end side (DEALER): handshake, send, receive, heartbeats.
//!
//! Dependency rule: this crate knows no engine and no HTTP. It depends on serde,
//! rmp-serde, zeromq and tokio only.

pub mod client;
pub mod codec;
pub mod endpoint;
pub mod protocol;
pub mod transport;

//! Harrier's shared crate: what front ends and the engine core agree on.
//!
//! Module map:
//! - [`protocol`]: the versioned message types (handshake, requests, aborts, outputs, utility calls).
//! - [`codec`]: MessagePack encoding of those messages (rmp-serde).
//! - [`endpoint`]: `ipc://` / `tcp://` addresses and the private socket directory.
//! - [`transport`]: the engine side of the ZeroMQ link (ROUTER), one task owning the socket.
//! - [`client`]: the front-end side (DEALER): handshake, send, receive, heartbeats.
//! - [`liveness`]: silence that counts only while this process runs (both sides' timeouts).
//! - `fuzz` (feature `fuzz`, tests only): case counts, watchdog and allocation tracking for
//!   the fuzz harnesses of every crate (docs/fuzzing.md).
//!
//! Dependency rule: this crate knows no engine and no HTTP. It depends on serde,
//! rmp-serde, zeromq and tokio only.

pub mod client;
pub mod codec;
pub mod endpoint;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod liveness;
pub mod protocol;
pub mod transport;

#[cfg(test)]
#[global_allocator]
static ALLOC: fuzz::TrackingAlloc = fuzz::TrackingAlloc;

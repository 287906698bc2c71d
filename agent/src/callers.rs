//! Who calls the agent's servers, and how many at once: what the status server and the TCP
//! gRPC server share.
//!
//! # Theory of operation
//!
//! Any process on the node reaches a loopback port (with hostNetwork, every pod's too), so a
//! server asks the kernel who a caller is ([`peer`]: the uid that owns the peer's socket, never
//! what the caller says), and bounds its open connections (`connections`: the oldest told to
//! close to make room). Both are per connection and hold nothing once it closes.

pub(crate) mod connections;
pub mod peer;

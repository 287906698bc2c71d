//! The `envoyagent.v1` gRPC API for controllers.
//!
//! Not built yet: it arrives with the gRPC issue. This crate holds nothing until then.

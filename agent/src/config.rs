//! What the agent is told to do, from the command line to the settings every part runs on.
//!
//! # Theory of operation
//!
//! [`cli`] is the clap definition; [`settings`] turns `run`'s arguments into typed
//! [`Settings`](settings::Settings) once, refusing flags that cannot work together (the
//! shutdown's [`timeline`] and its [`budget`], the sidecar's app hold, the hot-restart checks
//! the hot-restart crate owns). [`setup`] then checks what only the machine can say (the
//! bootstrap and its admin address, the Envoy binary, the node proxy's hot-restart channel
//! and its [`channel_link`], what the [`container`] allows) and builds the proxy's config, so
//! that bad input fails with one line and exit 64 before anything starts. [`defaults`] and
//! [`duration`] hold the values and the one duration syntax the flags share.
//!
//! Nothing here runs after the start: the settings are read, never changed, while the agent
//! serves (a log level set over gRPC lives in the running agent, not here).

pub mod budget;
pub mod channel_link;
pub mod cli;
pub mod container;
pub mod defaults;
pub mod duration;
pub mod settings;
pub mod setup;
pub mod timeline;

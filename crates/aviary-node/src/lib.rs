//! Aviary's node agent and its client.
//!
//! **What it owns.** `aviary node` runs one agent per host: [`start_node`]
//! serves that host's [`Pausable`](aviary_runtime::Pausable) runtime, its
//! template store and its sandboxes' envd sockets over an HTTP API under
//! `/node/v1` (see [`api`] for the routes and wire types).
//! [`RemoteRuntime`] is the control plane's side: it implements `Runtime` +
//! `Pausable` by calling an agent, and [`RemoteRuntime::envd`] gives an
//! [`EnvdClient`](aviary_envd_proto::EnvdClient) whose connections go
//! through the agent, so the control plane speaks the unchanged envd
//! protocol to a sandbox on another host.
//!
//! **Invariants.**
//! - Every route needs `Authorization: Bearer <node token>`; the token is
//!   compared in constant time (as SHA-256 digests) and never logged.
//! - The node never uses a host path chosen by the control plane: the
//!   template is named by digest (or name) and resolved in the node's own
//!   store, and binds are limited to the files the node provides.
//! - A sandbox created through the agent is in its table (memory and one file
//!   per sandbox under the state dir) for as long as the runtime has it; the
//!   table is what the envd route and the committed resources are computed from.
//! - Bad input is a 4xx JSON error; the runtime is not called.
//!
//! **Concurrency.** Requests run concurrently on tokio; like every runtime,
//! the agent expects the caller (the control plane's lease manager) to
//! serialise operations on one sandbox. Each envd connection is a spliced
//! TCP↔unix byte stream in its own task.
#![forbid(unsafe_code)]

mod agent;
pub mod api;
mod error;
pub mod layers;
mod remote;

pub use agent::{start_node, NodeConfig, RunningNode};
pub use api::{Capacity, NodeInfo, ProvidedBind};
pub use error::NodeError;
pub use remote::{LayerCallError, RemoteRuntime};

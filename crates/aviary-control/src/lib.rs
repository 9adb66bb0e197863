//! Aviary's control plane as a library (DESIGN §3, §8).
//!
//! It turns operations into registry transitions, runtime actions and envd
//! calls over the backends it is built with ([`Backends`]: registry,
//! coordination, runtimes, chunk store, tree archive, templates, node
//! agents), each a trait object chosen by the caller. It depends on no
//! database driver, HTTP server, OCI runtime or file system: the server
//! (`aviary-server`) is a thin HTTP adapter over it, and the unit tests
//! build it over in-memory fakes and run without root.
//!
//! Every client operation takes an [`OpContext`] (caller, request id,
//! lease token; [`context`]) and one request value: an API request type of
//! `aviary_core::api` or of its module, or one of [`requests`].
//!
//! One module per design component:
//! - `ops`: the [`ControlPlane`], start-up, sandboxes (get, list, delete),
//!   exec and files, leasing and fencing, events;
//! - [`planning`]: planner + policy guard (the create pipeline's first
//!   stages); [`scopes`]: isolation scopes and reuse; [`pools`]: warm pools;
//!   [`nodes`]: placement; [`lifecycle`]: pause, resume, recycling (reset
//!   levels), the sweep and the reconciler's loss handling; [`snapshots`]:
//!   snapshots, fork, hibernate/wake, restore branches; [`projection`]:
//!   workspace projection; [`keys`]: API keys; [`reconciler`]: the periodic
//!   observe → compare → reconcile pass (lost compute recovered from its
//!   snapshot, orphans destroyed after a grace, silent node agents);
//!   [`taint`]: what taints a sandbox (each cause an event) and the
//!   operator's mark; [`usage`]: a sandbox's live resource usage (its
//!   runtime's counters beside its class's limits).
//!
//! Concurrency: per-sandbox ordering comes from the registry's optimistic
//! versions and the lease store's fencing tokens. Work that must not overlap
//! across requests takes a named lock of the coordination backend
//! (`aviary_leases::Locks`), never an in-process `Mutex`: `bucket/<bucket>`
//! (a scope bucket's find-or-create, `scopes`), `lifecycle/<id>`
//! (hibernate/wake, `lifecycle`), `quota/<tenant>` (a create's quota check
//! until its new row exists, `planning`), `placement/nodes` (a placement until its
//! row exists, `nodes`), `pool/<node>/<class>/<template>/<runtime>` (one refill
//! pass of a pool, `pools`; claims are version-checked in the registry
//! instead) and `fence/<id>` (fence pushes to one envd, `ops`).
//!
//! In-process state that remains, none of it a record or a serialisation of
//! cross-request work:
//! - live handles: the attached sandboxes' envd clients and their per-process
//!   flags (paused, running execs, last activity; `ops::LiveSandbox`), and
//!   the connected node agents (`nodes`). They are rebuilt from the
//!   registry and the runtimes at start-up; a replica knows the sandboxes it
//!   attached.
//! - caches: resolved API keys (`keys`, emptied on every revocation), when
//!   `last_active_at` was last written per sandbox (to rate-limit that
//!   write).
//! - metrics and counters: request metrics, pool hits/misses and the last
//!   read hand-out count (`metrics`, `pools`), reconciler actions, per
//!   process like every metric.
//! - the reconciler's observations: since when each unclaimed runtime
//!   sandbox has been seen, and when each agent last answered
//!   (`reconciler`); a restart starts them over, which only waits longer.
//! - readiness, and the planner and policy built from the configuration.
#![forbid(unsafe_code)]

pub mod access;
pub mod backends;
pub mod config;
pub mod context;
pub mod error;
pub mod keys;
pub mod lifecycle;
pub mod metrics;
pub mod nodes;
pub mod ops;
pub mod planning;
pub mod pools;
pub mod ports;
pub mod procs;
pub mod projection;
pub mod reclaim;
pub mod reconciler;
pub mod requests;
pub mod scopes;
pub mod snapshots;
pub mod taint;
pub mod tty;
pub mod usage;
pub mod validate;

pub use backends::{
    Backends, DefaultTemplateSource, LayerArchive, NoNodes, NodeAgent, NodeConnector, NodeSummary,
    RuntimeLayers, RuntimeSet, TemplateCatalog, TreeArchive,
};
pub use config::ControlConfig;
pub use context::{Caller, OpContext};
pub use error::OpError;
pub use ops::{ControlPlane, Readiness};
pub use reconciler::{ReconcileReport, Reconciling};

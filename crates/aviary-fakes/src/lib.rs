//! Test doubles at the control plane's seams to sandboxes, so its logic is
//! unit-tested without root, crun or a real sandbox, in seconds.
//!
//! - [`FakeEnvd`] serves envd's real wire protocol (the frames, messages and
//!   error codes of `aviary-envd-proto`) on a unix socket inside the test
//!   process, so the real `EnvdClient` talks to it. Connections' peer pid is
//!   this process ([`FakeEnvd::peer_pid`]), which `expect_peer_pid` checks.
//!   *Models:* `health`; the lease fence with the real envd's rules
//!   (unleased takes no token, leased exactly the current fence, otherwise
//!   `lease_required` / `stale_token`; never set below the highest fence;
//!   checked again when a write or exec takes effect); `kill_all` and fence
//!   moves as counted sweeps; `exec` answered from a script ([`exec`]: rules
//!   the test adds, then built-ins such as `echo` and `sh -c "exit N"`),
//!   every accepted exec recorded with argv, env, cwd and stdin; files as an
//!   in-memory tree (`/`, `/workspace`, `/tmp` at start) with envd's error
//!   codes for missing, existing and non-empty entries; a log of every call
//!   with the fence it met; `busy` answers; freezing (a paused sandbox) and
//!   dying (listener and connections closed).
//!   *Does not model:* processes (nothing runs, so no streaming over time,
//!   timeouts, background processes or kills; `running_execs` is 0); exec
//!   side effects on the file tree (a rule may add them with
//!   [`FakeEnvd::put_file`]); symlinks, owners, special files, disk quota;
//!   the in-sandbox peer check of `set_fence` (every peer is trusted);
//!   connection limits (use [`FakeEnvd::set_busy`]); read timeouts.
//! - [`FakeRuntime`] implements [`aviary_runtime::Runtime`],
//!   [`aviary_runtime::Pausable`] and [`aviary_runtime::Snapshottable`]
//!   (offered only through [`FakeRuntime::snapshottable`]: its layers are
//!   the fake envd's files written out to disk, and a create adopts staged
//!   ones back into its envd's files). A sandbox is a map
//!   entry, two empty directories under the fake's own temporary directory
//!   and a [`FakeEnvd`] on its control dir's `envd.sock`; `init_pid` is this
//!   process. *Models:* spec validation (`validate_spec`), `AlreadyExists`,
//!   idempotent destroy, Running / Paused (envd frozen) / Stopped (after
//!   [`FakeRuntime::crash`]) / NotFound, settable usage counters, injected
//!   create failures and held creates, a host that loses a sandbox
//!   ([`FakeRuntime::vanish`]), a host that stops answering
//!   ([`FakeRuntime::set_unreachable`]: every runtime call fails, `list`
//!   included), call counters and the specs it was given.
//!   *Does not model:* templates (every well-formed digest exists), the init
//!   argv (never run), resource limits, networking, layers.
//!
//! Both fakes run on the tokio runtime of the test that starts them and
//! never need privileges.
#![forbid(unsafe_code)]

mod envd;
pub mod exec;
mod runtime;
mod tree;

pub use envd::{BusyMode, EnvdCall, FakeEnvd};
pub use exec::{ExecCall, ExecReply};
pub use runtime::{CreateHold, FakeRuntime, INITIAL_USAGE};

#[cfg(test)]
mod tests;

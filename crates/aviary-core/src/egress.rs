//! The egress vocabulary of the `allowlist` network profile: the policy a
//! node's egress proxy enforces for one sandbox ([`EgressPolicy`], built from
//! an `aviary.toml` `[[network_profile]]` and carried to the node in the
//! sandbox's spec) and what it reports when it refuses ([`EgressDenial`]).
//! Plain data: matching and address classification live in `aviary-egress`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// TCP port envd listens on inside an `allowlist` sandbox (its own `lo`);
/// the sandbox's `HTTP_PROXY` points at it.
pub const EGRESS_PROXY_PORT: u16 = 3128;
/// Directory bind-mounted (read-only) into an `allowlist` sandbox; it holds
/// the sandbox's own proxy socket and nothing else.
pub const EGRESS_DIR_IN_SANDBOX: &str = "/.aviary/egress";
/// File name of the proxy socket in [`EGRESS_DIR_IN_SANDBOX`].
pub const EGRESS_SOCKET_NAME: &str = "proxy.sock";
/// The sandbox environment entry naming its network profile (set by the
/// control plane at create, read back from the registry on new compute).
pub const NETWORK_PROFILE_ENV: &str = "AVIARY_NETWORK_PROFILE";

/// What the egress proxy enforces for one sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressPolicy {
    /// The `[[network_profile]]` name (for events).
    pub profile: String,
    /// Domains egress may reach; the first matching rule decides.
    pub allow: Vec<EgressRule>,
    /// Domains never reached, even when an allow rule matches.
    pub deny: Vec<String>,
    /// The operator's own name overrides (`"host"` → `"ip"` or `"ip:port"`),
    /// trusted as given: they may point at loopback, DNS answers never may.
    pub resolve: BTreeMap<String, String>,
    pub limits: EgressLimits,
}

/// One allow rule: a domain pattern (`example.org` exactly, `*.example.org`
/// any subdomain) and, optionally, the only methods it admits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressRule {
    pub domain: String,
    /// Upper-case methods (`GET`, `HEAD`, `CONNECT`, ...); `None`: any.
    /// A CONNECT tunnel is opaque, so a limited rule admits one only when
    /// it lists `CONNECT`.
    pub methods: Option<Vec<String>>,
}

/// Bounds of one sandbox's use of the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressLimits {
    /// Open connections at once; more are answered 429.
    pub max_connections: u32,
    /// A connection with no traffic either way this long is closed.
    pub idle_timeout_s: u32,
    /// Largest request head (request line + headers) read; more: 431.
    pub max_header_bytes: u32,
}

impl Default for EgressLimits {
    fn default() -> Self {
        EgressLimits {
            max_connections: 64,
            idle_timeout_s: 60,
            max_header_bytes: 16 * 1024,
        }
    }
}

/// A refusal, as the proxy reports it (the `egress_denied` event's fields).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressDenial {
    pub sandbox: crate::SandboxId,
    pub profile: String,
    /// The host as the sandbox named it (bounded, never trusted).
    pub host: String,
    pub port: u16,
    pub method: String,
    pub reason: String,
}

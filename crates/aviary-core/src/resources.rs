//! Resources, isolation scopes and network profiles.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Limits a sandbox runs under; enforced by cgroups (cpu, memory, pids) and
/// by the runtime (disk, where the backing store can bound it).
#[derive(Clone, Copy, PartialEq, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourceLimits {
    /// CPU cores (fractional allowed), enforced as a CFS quota.
    pub cpu: f64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub pids: u32,
}

impl Default for ResourceLimits {
    /// The embedded default class (`python-small`'s limits).
    fn default() -> Self {
        ResourceLimits {
            cpu: 1.0,
            memory_mb: 2048,
            disk_mb: 10 * 1024,
            pids: 512,
        }
    }
}

/// Who shares a sandbox (AgentScope's isolation scopes).
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, Debug, Default, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Session,
    #[default]
    User,
    Agent,
    Global,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Session => "session",
            Scope::User => "user",
            Scope::Agent => "agent",
            Scope::Global => "global",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "session" => Ok(Scope::Session),
            "user" => Ok(Scope::User),
            "agent" => Ok(Scope::Agent),
            "global" => Ok(Scope::Global),
            other => Err(format!(
                "unknown scope {other:?} (session|user|agent|global)"
            )),
        }
    }
}

/// Network profiles. `none` (loopback only) is the default and the only one
/// the local runtime grants today.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, Debug, Default, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum NetworkProfile {
    #[default]
    None,
    Allowlist,
    Open,
}

impl NetworkProfile {
    pub fn as_str(self) -> &'static str {
        match self {
            NetworkProfile::None => "none",
            NetworkProfile::Allowlist => "allowlist",
            NetworkProfile::Open => "open",
        }
    }
}

impl FromStr for NetworkProfile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(NetworkProfile::None),
            "allowlist" => Ok(NetworkProfile::Allowlist),
            "open" => Ok(NetworkProfile::Open),
            other => Err(format!(
                "unknown network profile {other:?} (none|allowlist|open)"
            )),
        }
    }
}

//! The names of the sandbox runtimes Aviary knows: the one list that
//! configuration, policy, placement, the node agent and the runtimes agree
//! on. A new runtime backend adds its name here (and its crate).

use std::fmt;
use std::str::FromStr;

/// A sandbox runtime, by the name it is configured, recorded and placed by.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, Debug, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeName {
    /// `crun` driving OCI containers (the default).
    #[default]
    Crun,
    /// `runc` driving OCI containers.
    Runc,
    /// gVisor's `runsc` (ptrace platform): a user-space kernel between the
    /// sandbox and the host's, with memory checkpoints.
    Runsc,
    /// Containers of a `dockerd` the operator runs, through the Docker
    /// Engine API (`aviary-runtime-docker`).
    Docker,
    /// An E2B-compatible service (`[remote_e2b]`, `aviary-runtime-remote`):
    /// sandboxes run by the provider, not on this host.
    E2b,
    /// A Pod per sandbox on a Kubernetes cluster (`aviary-runtime-kube`,
    /// configured by `[kubernetes]`).
    Kubernetes,
    /// An OpenSandbox-compatible service (`[remote_opensandbox]`,
    /// `aviary-runtime-remote`): sandboxes run by the provider, not on this
    /// host.
    Opensandbox,
}

impl RuntimeName {
    /// Every known runtime, the default first.
    pub const ALL: [RuntimeName; 7] = [
        RuntimeName::Crun,
        RuntimeName::Runc,
        RuntimeName::Runsc,
        RuntimeName::Docker,
        RuntimeName::E2b,
        RuntimeName::Kubernetes,
        RuntimeName::Opensandbox,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RuntimeName::Crun => "crun",
            RuntimeName::Runc => "runc",
            RuntimeName::Runsc => "runsc",
            RuntimeName::Docker => "docker",
            RuntimeName::E2b => "e2b",
            RuntimeName::Kubernetes => "kubernetes",
            RuntimeName::Opensandbox => "opensandbox",
        }
    }

    /// Whether the runtime's sandboxes run at a remote provider (not on
    /// this host: no OCI bundle, no local default runtime).
    pub fn is_remote(self) -> bool {
        matches!(self, RuntimeName::E2b | RuntimeName::Opensandbox)
    }

    /// The runtimes whose sandboxes run on this host (the OCI binaries and
    /// the operator's dockerd): what a class offers when it does not list
    /// its runtimes.
    pub const LOCAL: [RuntimeName; 4] = [
        RuntimeName::Crun,
        RuntimeName::Runc,
        RuntimeName::Runsc,
        RuntimeName::Docker,
    ];

    /// Whether this runtime runs sandboxes on this host with an OCI runtime
    /// binary (the others reach their compute through an API).
    pub fn is_local_oci(self) -> bool {
        matches!(
            self,
            RuntimeName::Crun | RuntimeName::Runc | RuntimeName::Runsc
        )
    }
}

impl fmt::Display for RuntimeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RuntimeName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RuntimeName::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = RuntimeName::ALL.iter().map(|r| r.as_str()).collect();
                format!("unknown runtime {s:?} ({})", known.join("|"))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_text_and_json() {
        for r in RuntimeName::ALL {
            assert_eq!(r.as_str().parse::<RuntimeName>().unwrap(), r);
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, format!("\"{r}\""));
            assert_eq!(serde_json::from_str::<RuntimeName>(&json).unwrap(), r);
        }
        assert_eq!(
            "kubernetes".parse::<RuntimeName>().unwrap(),
            RuntimeName::Kubernetes
        );
        assert!(!RuntimeName::Kubernetes.is_local_oci());
        assert!(RuntimeName::LOCAL.iter().all(|r| !r.is_remote()));
        assert_eq!(
            "opensandbox".parse::<RuntimeName>().unwrap(),
            RuntimeName::Opensandbox
        );
        assert!(RuntimeName::Opensandbox.is_remote() && RuntimeName::E2b.is_remote());
        assert!(!RuntimeName::Opensandbox.is_local_oci());
        assert_eq!(
            "kata".parse::<RuntimeName>().unwrap_err(),
            "unknown runtime \"kata\" (crun|runc|runsc|docker|e2b|kubernetes|opensandbox)"
        );
    }
}

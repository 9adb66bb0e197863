//! Workspace projection (seed 000): configured host roots are synced one-way
//! into every sandbox when it starts (create, wake, and each reuse hand-out).
//!
//! (Being implemented: see the projection engineer's commit.)

use crate::error::OpError;
use crate::ops::{ControlPlane, LiveSandbox};
use aviary_core::SandboxId;

impl ControlPlane {
    /// Syncs the configured projection roots into the sandbox.
    pub(crate) async fn sync_projection(
        &self,
        _id: &SandboxId,
        _live: &LiveSandbox,
    ) -> Result<(), OpError> {
        Ok(())
    }
}

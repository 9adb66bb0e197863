//! Who an operation runs for: the [`OpContext`] every client operation of
//! the [`ControlPlane`](crate::ControlPlane) takes first, beside its one
//! request value (`crate::requests`).
//!
//! An API surface builds one context per request from what it
//! authenticated and what the request carries besides its body: the caller
//! (resolved from the API key), the request id (recorded on every event the
//! operation writes) and the lease token the caller presents (checked by
//! the fenced operations; ignored by the others). Work the control plane
//! starts on its own (sweeps, pool refill, the reconciler, the envd probe)
//! has no caller and takes no context.

use crate::error::OpError;
use aviary_core::LeaseToken;

/// Who is calling, resolved from the API key.
#[derive(Clone, Debug)]
pub struct Caller {
    pub tenant: String,
    pub admin: bool,
}

/// The context of one client operation.
#[derive(Clone, Debug)]
pub struct OpContext {
    pub caller: Caller,
    /// Recorded on the events the operation writes.
    pub request_id: Option<String>,
    /// The lease token the caller presents: the only token a fenced
    /// operation checks (a token in a request body is the HTTP surface's
    /// spelling of it, which that surface moves here).
    pub token: Option<LeaseToken>,
}

impl OpContext {
    /// A context for `caller`, with no request id and no lease token.
    pub fn new(caller: Caller) -> Self {
        OpContext {
            caller,
            request_id: None,
            token: None,
        }
    }

    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Self {
        self.request_id = Some(request_id.into());
        self
    }

    /// The lease token presented (`None` clears it).
    pub fn with_token(mut self, token: impl Into<Option<LeaseToken>>) -> Self {
        self.token = token.into();
        self
    }

    pub fn request_id(&self) -> Option<&str> {
        self.request_id.as_deref()
    }

    /// `forbidden` unless the caller's key is an admin key (`what`: the
    /// refused action, as the message names it).
    pub(crate) fn require_admin(&self, what: &str) -> Result<(), OpError> {
        if self.caller.admin {
            Ok(())
        } else {
            Err(OpError::Forbidden(format!("{what} needs an admin key")))
        }
    }
}

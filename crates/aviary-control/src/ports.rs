//! Ports: reaching a server that listens inside a sandbox, without giving
//! the sandbox any network. The control plane opens a byte tunnel through
//! the sandbox's envd (`connect`) to `127.0.0.1:port` in the sandbox's own
//! network namespace; the API surface speaks HTTP over it.
//!
//! Invariants:
//! - A tunnel opens only for the caller's own sandbox (another tenant's id
//!   is `not_found`), only while it runs and is not paused, and it is
//!   fenced like exec: while the sandbox is leased the caller presents the
//!   current lease token, checked here and again by envd, and envd closes
//!   every tunnel when the fence moves.
//! - A *port token* is HMAC-SHA256 over (tenant, sandbox id, port) under the
//!   same registry-held server secret as the sandbox access tokens, with its
//!   own domain separation: it opens exactly one port of one sandbox, acts
//!   as the sandbox's tenant without admin rights, is compared in constant
//!   time, and dies with the sandbox.

use crate::context::{Caller, OpContext};
use crate::error::OpError;
use crate::ControlPlane;
use aviary_core::{SandboxId, SandboxState};
use aviary_envd_proto::PortStream;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Domain separation: port tokens are not sandbox access tokens.
const PORT_CONTEXT: &[u8] = b"aviary sandbox port token v1\0";

/// One port of one sandbox.
#[derive(Clone, Debug)]
pub struct PortRequest {
    pub id: String,
    pub port: u16,
}

impl PortRequest {
    /// Parses the port as the API spells it: 1-65535.
    pub fn parse(id: impl Into<String>, port: &str) -> Result<PortRequest, OpError> {
        match port.parse::<u16>() {
            Ok(p) if p != 0 => Ok(PortRequest {
                id: id.into(),
                port: p,
            }),
            _ => Err(OpError::InvalidRequest(format!(
                "port must be a number from 1 to 65535, not {:?}",
                port.chars().take(16).collect::<String>()
            ))),
        }
    }
}

impl ControlPlane {
    fn port_token_bytes(
        key: &[u8],
        tenant: &str,
        id: &SandboxId,
        port: u16,
    ) -> Result<Vec<u8>, OpError> {
        let mut mac = Hmac::<Sha256>::new_from_slice(key)
            .map_err(|_| OpError::Internal(anyhow::anyhow!("port token key")))?;
        mac.update(PORT_CONTEXT);
        mac.update(tenant.as_bytes());
        mac.update(b"\0");
        mac.update(id.as_str().as_bytes());
        mac.update(b"\0");
        mac.update(&port.to_be_bytes());
        Ok(mac.finalize().into_bytes().to_vec())
    }

    /// The port token of one port of one of the caller's sandboxes (64 hex
    /// digits): what a browser or an SDK without the API key presents.
    pub async fn port_token(&self, cx: &OpContext, req: &PortRequest) -> Result<String, OpError> {
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        let key = self.access_key().await?;
        Ok(hex::encode(Self::port_token_bytes(
            key,
            &rec.tenant,
            &rec.id,
            req.port,
        )?))
    }

    /// The context a request presenting port token `token` for `req` acts
    /// in: the sandbox's tenant, without admin rights. `not_found` for an
    /// unknown or ended sandbox, `unauthorized` for any other token.
    pub async fn authenticate_port_token(
        &self,
        req: &PortRequest,
        token: &str,
    ) -> Result<OpContext, OpError> {
        let not_found = || OpError::NotFound(format!("sandbox {}", req.id));
        let sid: SandboxId = req.id.parse().map_err(|_| not_found())?;
        let rec = match self.registry.get_sandbox(&sid).await {
            Ok(rec) => rec,
            Err(aviary_registry::RegistryError::NotFound) => return Err(not_found()),
            Err(e) => return Err(e.into()),
        };
        if matches!(rec.state, SandboxState::Terminated | SandboxState::Failed) {
            return Err(not_found());
        }
        let key = self.access_key().await?;
        let want = Self::port_token_bytes(key, &rec.tenant, &rec.id, req.port)?;
        let given = hex::decode(token.trim()).unwrap_or_default();
        if given.len() != want.len() || !bool::from(given.ct_eq(&want)) {
            return Err(OpError::Unauthorized);
        }
        Ok(OpContext::new(Caller {
            tenant: rec.tenant,
            admin: false,
        }))
    }

    /// Opens a byte tunnel to `req.port` inside one of the caller's
    /// sandboxes (fenced by the context's lease token). Nothing listening
    /// there is `port_unreachable`.
    pub async fn connect_port(
        &self,
        cx: &OpContext,
        req: &PortRequest,
    ) -> Result<PortStream, OpError> {
        if req.port == 0 {
            return Err(OpError::InvalidRequest("port must be 1-65535".into()));
        }
        let (rec, live) = self.writable(cx, &req.id).await?;
        let r = live
            .envd
            .connect_port(req.port, cx.token.map(|t| t.fence()))
            .await;
        let stream = self.via_envd(&rec, &live, r).await?;
        self.touch_lazily(&rec.id);
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_parse_within_range_only() {
        assert_eq!(PortRequest::parse("s", "8000").unwrap().port, 8000);
        assert_eq!(PortRequest::parse("s", "65535").unwrap().port, 65535);
        for bad in ["0", "65536", "-1", "", "80a", "99999999999999999999"] {
            let e = PortRequest::parse("s", bad).unwrap_err();
            assert_eq!(e.code(), aviary_core::ErrorCode::InvalidRequest, "{bad}");
        }
    }

    #[test]
    fn port_tokens_differ_per_port_sandbox_and_tenant() {
        let key = [7u8; 32];
        let a: SandboxId = aviary_core::new_id("sbx").parse().unwrap();
        let b: SandboxId = aviary_core::new_id("sbx").parse().unwrap();
        let t = |tenant: &str, id: &SandboxId, port| {
            ControlPlane::port_token_bytes(&key, tenant, id, port).unwrap()
        };
        assert_eq!(t("x", &a, 80), t("x", &a, 80));
        assert_ne!(t("x", &a, 80), t("x", &a, 81));
        assert_ne!(t("x", &a, 80), t("x", &b, 80));
        assert_ne!(t("x", &a, 80), t("y", &a, 80));
    }
}

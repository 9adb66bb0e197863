//! Isolation scopes (seed 000's `IsolationScope`) mapped to lease bucket keys.
//!
//! A bucket names the set of callers that share one sandbox and therefore
//! serialize through one execution guard (lease): `SESSION` one per session,
//! `USER` (the default) one per user, falling back to `SESSION` when the caller
//! gives no user id, `AGENT` one per agent name, `GLOBAL` one per tenant.
//!
//! Invariant: every bucket starts with the tenant, and every component is
//! percent-encoded so that `/` only ever separates components. The mapping from
//! `(effective scope, tenant, id)` to the key is therefore injective: two
//! tenants never share a bucket, whatever bytes their names contain.

use aviary_core::Scope;
use std::fmt::Write;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScopeError {
    #[error("a bucket needs a tenant")]
    MissingTenant,
    /// `SESSION` scope (or `USER` without a user id) needs a session id.
    #[error("{scope} scope needs a session id")]
    MissingSessionId { scope: Scope },
    #[error("agent scope needs an agent name")]
    MissingAgent,
}

impl ScopeError {
    /// The stable API error code of this error.
    pub fn code(&self) -> aviary_core::ErrorCode {
        use aviary_core::ErrorCode;
        match self {
            // the tenant is the caller's key's, never the client's input
            ScopeError::MissingTenant => ErrorCode::Internal,
            // the create named a scope without the id it needs
            ScopeError::MissingSessionId { .. } | ScopeError::MissingAgent => {
                ErrorCode::InvalidRequest
            }
        }
    }
}

fn present(id: Option<&str>) -> Option<&str> {
    id.filter(|s| !s.is_empty())
}

/// The scope that really applies: `USER` without a (non-empty) user id falls
/// back to `SESSION`, as in seed 000.
pub fn effective_scope(scope: Scope, user_id: Option<&str>) -> Scope {
    match (scope, present(user_id)) {
        (Scope::User, None) => Scope::Session,
        (s, _) => s,
    }
}

fn encode(out: &mut String, component: &str) {
    for b in component.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// The lease bucket key of a caller: `<tenant>/session/<id>`,
/// `<tenant>/user/<id>`, `<tenant>/agent/<name>` or `<tenant>/global`.
/// Empty ids count as absent.
pub fn scope_bucket(
    scope: Scope,
    tenant: &str,
    user_id: Option<&str>,
    session_id: Option<&str>,
    agent: Option<&str>,
) -> Result<String, ScopeError> {
    if tenant.is_empty() {
        return Err(ScopeError::MissingTenant);
    }
    let mut key = String::with_capacity(tenant.len() + 48);
    encode(&mut key, tenant);
    let effective = effective_scope(scope, user_id);
    let id = match effective {
        Scope::Session => Some(present(session_id).ok_or(ScopeError::MissingSessionId { scope })?),
        Scope::User => present(user_id),
        Scope::Agent => Some(present(agent).ok_or(ScopeError::MissingAgent)?),
        Scope::Global => None,
    };
    key.push('/');
    key.push_str(effective.as_str());
    if let Some(id) = id {
        key.push('/');
        encode(&mut key, id);
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn buckets_follow_seed_000() {
        let b = |scope, user, session, agent| scope_bucket(scope, "acme", user, session, agent);
        assert_eq!(
            b(Scope::User, Some("alice"), Some("s1"), Some("coder")).unwrap(),
            "acme/user/alice"
        );
        // Two sessions of one user share the USER bucket.
        assert_eq!(
            b(Scope::User, Some("alice"), Some("s2"), None).unwrap(),
            "acme/user/alice"
        );
        // USER without a user id falls back to SESSION.
        assert_eq!(
            b(Scope::User, None, Some("s1"), None).unwrap(),
            "acme/session/s1"
        );
        assert_eq!(
            b(Scope::User, Some(""), Some("s1"), None).unwrap(),
            "acme/session/s1"
        );
        assert_eq!(
            b(Scope::Session, Some("alice"), Some("s1"), None).unwrap(),
            "acme/session/s1"
        );
        assert_eq!(
            b(Scope::Agent, Some("alice"), Some("s1"), Some("coder")).unwrap(),
            "acme/agent/coder"
        );
        assert_eq!(
            b(Scope::Global, Some("alice"), Some("s1"), Some("coder")).unwrap(),
            "acme/global"
        );
    }

    #[test]
    fn missing_ids_are_errors() {
        assert_eq!(
            scope_bucket(Scope::User, "acme", None, None, None).unwrap_err(),
            ScopeError::MissingSessionId { scope: Scope::User }
        );
        assert_eq!(
            scope_bucket(Scope::Agent, "acme", Some("u"), Some("s"), None).unwrap_err(),
            ScopeError::MissingAgent
        );
        assert_eq!(
            scope_bucket(Scope::Global, "", None, None, None).unwrap_err(),
            ScopeError::MissingTenant
        );
    }

    #[test]
    fn scope_errors_have_their_codes() {
        use aviary_core::ErrorCode;
        for (e, code) in [
            (ScopeError::MissingTenant, ErrorCode::Internal),
            (
                ScopeError::MissingSessionId {
                    scope: Scope::Session,
                },
                ErrorCode::InvalidRequest,
            ),
            (ScopeError::MissingAgent, ErrorCode::InvalidRequest),
        ] {
            assert_eq!(e.code(), code, "{e:?}");
        }
    }

    #[test]
    fn separators_in_names_cannot_forge_a_bucket() {
        // A tenant named "a/user/b" must not collide with tenant "a", user "b".
        let forged = scope_bucket(Scope::Global, "a/user/b", None, None, None).unwrap();
        let real = scope_bucket(Scope::User, "a", Some("b"), None, None).unwrap();
        assert_ne!(forged, real);
        assert_eq!(forged, "a%2Fuser%2Fb/global");
    }

    fn scope() -> impl Strategy<Value = Scope> {
        prop_oneof![
            Just(Scope::Session),
            Just(Scope::User),
            Just(Scope::Agent),
            Just(Scope::Global)
        ]
    }

    fn id() -> impl Strategy<Value = Option<String>> {
        prop::option::of("[a-z/%:]{0,6}")
    }

    proptest! {
        #[test]
        fn different_tenants_never_share_a_bucket(
            s1 in scope(), s2 in scope(),
            t1 in ".{1,12}", t2 in ".{1,12}",
            u1 in id(), u2 in id(), x1 in id(), x2 in id(), a1 in id(), a2 in id(),
        ) {
            prop_assume!(t1 != t2);
            let b1 = scope_bucket(s1, &t1, u1.as_deref(), x1.as_deref(), a1.as_deref());
            let b2 = scope_bucket(s2, &t2, u2.as_deref(), x2.as_deref(), a2.as_deref());
            if let (Ok(b1), Ok(b2)) = (b1, b2) {
                prop_assert_ne!(b1, b2);
            }
        }

        #[test]
        fn different_users_never_share_a_user_bucket(
            t in "[a-z]{1,6}", u1 in ".{1,10}", u2 in ".{1,10}", s in id(),
        ) {
            prop_assume!(u1 != u2);
            let b1 = scope_bucket(Scope::User, &t, Some(&u1), s.as_deref(), None).unwrap();
            let b2 = scope_bucket(Scope::User, &t, Some(&u2), s.as_deref(), None).unwrap();
            prop_assert_ne!(b1, b2);
        }

        #[test]
        fn buckets_are_injective(
            s1 in scope(), s2 in scope(),
            t1 in "[a-z/%]{1,4}", t2 in "[a-z/%]{1,4}",
            u1 in id(), u2 in id(), x1 in id(), x2 in id(), a1 in id(), a2 in id(),
        ) {
            let e1 = effective_scope(s1, u1.as_deref());
            let e2 = effective_scope(s2, u2.as_deref());
            let b1 = scope_bucket(s1, &t1, u1.as_deref(), x1.as_deref(), a1.as_deref());
            let b2 = scope_bucket(s2, &t2, u2.as_deref(), x2.as_deref(), a2.as_deref());
            if let (Ok(b1), Ok(b2)) = (b1, b2) {
                if b1 == b2 {
                    // Same key ⇒ same tenant, same effective scope, same id.
                    prop_assert_eq!(&t1, &t2);
                    prop_assert_eq!(e1, e2);
                    let id = |e: Scope, u: &Option<String>, x: &Option<String>, a: &Option<String>| match e {
                        Scope::Session => x.clone(),
                        Scope::User => u.clone(),
                        Scope::Agent => a.clone(),
                        Scope::Global => None,
                    };
                    prop_assert_eq!(id(e1, &u1, &x1, &a1), id(e2, &u2, &x2, &a2));
                }
            }
        }
    }
}

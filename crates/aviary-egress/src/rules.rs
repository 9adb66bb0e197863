//! The domain matcher of one profile: deny rules first, then the first
//! allow rule that matches decides, with its method limit.
//!
//! Patterns are `example.org` (that name only) or `*.example.org` (any name
//! below it, not the apex). IP literals never match a rule: they are refused
//! before matching (private ranges) or for not being a name.

use aviary_core::egress::EgressPolicy;

/// What the rules say about one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Deny(String),
}

/// A name matches a pattern: exactly, or below a `*.` pattern's suffix.
pub fn matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => {
            name.len() > suffix.len() + 1
                && name.ends_with(suffix)
                && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
        }
        None => pattern == name,
    }
}

/// Judges `method` to the lower-case domain `name` under `policy`.
pub fn judge(policy: &EgressPolicy, name: &str, method: &str) -> Verdict {
    if let Some(d) = policy.deny.iter().find(|d| matches(d, name)) {
        return Verdict::Deny(format!("domain matches deny rule {d:?}"));
    }
    let Some(rule) = policy.allow.iter().find(|r| matches(&r.domain, name)) else {
        return Verdict::Deny(format!(
            "domain is not on the allow list of profile {:?}",
            policy.profile
        ));
    };
    match &rule.methods {
        Some(methods) if !methods.iter().any(|m| m == method) => Verdict::Deny(format!(
            "method {method} is not allowed for {:?} (allowed: {})",
            rule.domain,
            methods.join(", ")
        )),
        _ => Verdict::Allow,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_core::egress::{EgressLimits, EgressRule};

    fn policy() -> EgressPolicy {
        EgressPolicy {
            profile: "p".into(),
            allow: vec![
                EgressRule {
                    domain: "pypi.org".into(),
                    methods: Some(vec!["GET".into(), "HEAD".into()]),
                },
                EgressRule {
                    domain: "*.pythonhosted.org".into(),
                    methods: None,
                },
                EgressRule {
                    domain: "*.example.org".into(),
                    methods: None,
                },
            ],
            deny: vec!["evil.example.org".into(), "*.bad.example.org".into()],
            resolve: Default::default(),
            limits: EgressLimits::default(),
        }
    }

    #[test]
    fn wildcards_match_subdomains_only() {
        assert!(matches("*.pypi.org", "files.pypi.org"));
        assert!(matches("*.pypi.org", "a.b.pypi.org"));
        assert!(!matches("*.pypi.org", "pypi.org"));
        assert!(!matches("*.pypi.org", "evilpypi.org"));
        assert!(!matches("*.pypi.org", "pypi.org.evil.com"));
        assert!(!matches("*.pypi.org", ".pypi.org"));
        assert!(matches("pypi.org", "pypi.org"));
        assert!(!matches("pypi.org", "www.pypi.org"));
        assert!(!matches("pypi.org", "xpypi.org"));
    }

    #[test]
    fn deny_wins_then_first_allow_decides_with_its_methods() {
        let p = policy();
        assert_eq!(judge(&p, "pypi.org", "GET"), Verdict::Allow);
        assert_eq!(judge(&p, "pypi.org", "HEAD"), Verdict::Allow);
        let Verdict::Deny(r) = judge(&p, "pypi.org", "POST") else {
            panic!("POST allowed")
        };
        assert!(r.contains("method POST"), "{r}");
        // a tunnel is opaque: a limited rule admits one only when listed
        assert!(matches!(judge(&p, "pypi.org", "CONNECT"), Verdict::Deny(_)));
        assert_eq!(
            judge(&p, "files.pythonhosted.org", "CONNECT"),
            Verdict::Allow
        );
        assert_eq!(judge(&p, "www.example.org", "POST"), Verdict::Allow);
        let Verdict::Deny(r) = judge(&p, "evil.example.org", "GET") else {
            panic!("deny rule ignored")
        };
        assert!(r.contains("deny rule"), "{r}");
        assert!(matches!(
            judge(&p, "x.bad.example.org", "GET"),
            Verdict::Deny(_)
        ));
        let Verdict::Deny(r) = judge(&p, "example.org", "GET") else {
            panic!("apex matched a wildcard")
        };
        assert!(r.contains("not on the allow list"), "{r}");
        assert!(matches!(
            judge(&p, "pypi.org.evil.com", "GET"),
            Verdict::Deny(_)
        ));
    }
}

//! Distributed mode: `[distributed]` in `aviary.toml`, or `aviary serve
//! --registry postgres://… --coordination redis://… [--snapshots s3://…]`.
//!
//! A service URL is kept as written and resolved when the server starts:
//! `${NAME}` placeholders are replaced from the environment (so a password
//! never sits in the file or on a command line: `postgres://aviary:${PGPASS}@db/aviary`),
//! then the scheme is checked. [`ServiceUrl`]'s `Display` hides the password.

use crate::SnapshotStore;

/// Which backends a replica runs on. Both `None`: the embedded default
/// (SQLite registry with its lease table, in-process locks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistributedSettings {
    /// The PostgreSQL source of record.
    pub registry: Option<ServiceUrl>,
    /// The Redis coordination store (leases, locks, heartbeats, routes).
    pub coordination: Option<ServiceUrl>,
    /// The PostgreSQL schema of the registry's tables (`None`: the
    /// server's `search_path`, usually `public`). One schema per deployment.
    pub schema: Option<String>,
    /// The prefix of every Redis key (default `aviary`). One per deployment.
    pub key_prefix: String,
    /// The node name of this replica's own runtimes (default: the host
    /// name). Unique per replica and stable across its restarts.
    pub node_name: Option<String>,
}

impl Default for DistributedSettings {
    fn default() -> Self {
        DistributedSettings {
            registry: None,
            coordination: None,
            schema: None,
            key_prefix: "aviary".into(),
            node_name: None,
        }
    }
}

impl DistributedSettings {
    /// Whether a shared registry and coordination store are configured.
    pub fn is_distributed(&self) -> bool {
        self.registry.is_some() || self.coordination.is_some()
    }

    /// Both or neither: a shared registry with in-process leases (or the
    /// reverse) would let two replicas disagree about who holds a lease.
    pub fn check_complete(&self) -> Result<(), String> {
        match (&self.registry, &self.coordination) {
            (Some(_), None) => Err(
                "distributed mode: a PostgreSQL registry needs a Redis coordination store too \
                 (--coordination redis://… or `coordination` in [distributed])"
                    .into(),
            ),
            (None, Some(_)) => Err(
                "distributed mode: a Redis coordination store needs a PostgreSQL registry too \
                 (--registry postgres://… or `registry` in [distributed])"
                    .into(),
            ),
            _ => Ok(()),
        }
    }
}

/// What a service URL is for, with the schemes it accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceKind {
    Registry,
    Coordination,
}

impl ServiceKind {
    pub fn schemes(self) -> &'static [&'static str] {
        match self {
            ServiceKind::Registry => &["postgres", "postgresql"],
            ServiceKind::Coordination => &["redis"],
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ServiceKind::Registry => "registry",
            ServiceKind::Coordination => "coordination",
        }
    }
}

/// A service URL as written (placeholders unexpanded).
#[derive(Clone, PartialEq, Eq)]
pub struct ServiceUrl {
    kind: ServiceKind,
    written: String,
}

impl ServiceUrl {
    /// Checks what can be checked before the environment is read: not
    /// empty, and the scheme (unless the scheme itself is a placeholder).
    pub fn parse(kind: ServiceKind, written: &str) -> Result<ServiceUrl, String> {
        let written = written.trim();
        if written.is_empty() {
            return Err(format!("{}: the URL is empty", kind.name()));
        }
        if !written.starts_with("${") {
            check_scheme(kind, written)?;
        }
        Ok(ServiceUrl {
            kind,
            written: written.to_owned(),
        })
    }

    pub fn kind(&self) -> ServiceKind {
        self.kind
    }

    /// The URL with `${NAME}` replaced from `env`, its scheme checked.
    pub fn resolve(&self, env: impl Fn(&str) -> Option<String>) -> Result<String, String> {
        let url = expand(&self.written, env).map_err(|e| format!("{}: {e}", self.kind.name()))?;
        check_scheme(self.kind, &url)?;
        url::Url::parse(&url).map_err(|e| {
            format!(
                "{}: {} is not a valid URL: {e}",
                self.kind.name(),
                redact(&url)
            )
        })?;
        Ok(url)
    }

    /// [`ServiceUrl::resolve`] against the process environment.
    pub fn resolve_from_env(&self) -> Result<String, String> {
        self.resolve(|name| std::env::var(name).ok())
    }
}

impl std::fmt::Display for ServiceUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact(&self.written))
    }
}

impl std::fmt::Debug for ServiceUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServiceUrl({:?}, {})", self.kind, self)
    }
}

fn check_scheme(kind: ServiceKind, url: &str) -> Result<(), String> {
    let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
    if kind.schemes().contains(&scheme) {
        return Ok(());
    }
    let hint = if scheme == "rediss" {
        " (TLS to Redis is not built in; reach it over a trusted network or a TLS tunnel)"
    } else {
        ""
    };
    Err(format!(
        "{}: {} must start with {}{hint}",
        kind.name(),
        redact(url),
        kind.schemes()
            .iter()
            .map(|s| format!("{s}://"))
            .collect::<Vec<_>>()
            .join(" or ")
    ))
}

/// Replaces every `${NAME}` (NAME: letters, digits, `_`) from `env`.
pub fn expand(s: &str, env: impl Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| "an unclosed ${ placeholder".to_owned())?;
        let name = &after[..end];
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(format!(
                "${{{name}}} is not a valid placeholder (use ${{NAME}})"
            ));
        }
        let value = env(name).ok_or_else(|| {
            format!("environment variable {name} (used as ${{{name}}}) is not set")
        })?;
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The URL with any password replaced by `***` (for logs and errors).
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => format!("{scheme}://{userinfo}@{host}{tail}"),
        },
        None => url.to_owned(),
    }
}

/// `--snapshots`: `local`, or `s3://BUCKET[/PREFIX]?endpoint=URL[&region=R]`
/// with the keys in `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (or the
/// variables named by `access_key_env=` / `secret_key_env=`).
pub fn snapshot_store_from_url(s: &str) -> Result<SnapshotStore, String> {
    let s = s.trim();
    if s == "local" {
        return Ok(SnapshotStore::Local);
    }
    let url =
        url::Url::parse(s).map_err(|e| format!("snapshots: {} is not a URL: {e}", redact(s)))?;
    if url.scheme() != "s3" {
        return Err(format!(
            "snapshots: {} must be `local` or s3://BUCKET/PREFIX?endpoint=URL",
            redact(s)
        ));
    }
    let bucket = url
        .host_str()
        .filter(|b| !b.is_empty())
        .ok_or_else(|| "snapshots: s3:// needs a bucket (s3://BUCKET/PREFIX)".to_owned())?
        .to_owned();
    let mut endpoint = None;
    let mut region = "us-east-1".to_owned();
    let mut access_key_env = "AWS_ACCESS_KEY_ID".to_owned();
    let mut secret_key_env = "AWS_SECRET_ACCESS_KEY".to_owned();
    for (k, v) in url.query_pairs() {
        match k.as_ref() {
            "endpoint" => endpoint = Some(v.into_owned()),
            "region" => region = v.into_owned(),
            "access_key_env" => access_key_env = v.into_owned(),
            "secret_key_env" => secret_key_env = v.into_owned(),
            other => {
                return Err(format!(
                    "snapshots: unknown parameter {other:?} (known: endpoint, region, access_key_env, secret_key_env)"
                ))
            }
        }
    }
    let endpoint = endpoint.ok_or_else(|| {
        "snapshots: s3:// needs ?endpoint=http(s)://HOST:PORT of the S3-compatible server"
            .to_owned()
    })?;
    let mut prefix = url.path().trim_start_matches('/').to_owned();
    if prefix.is_empty() {
        prefix = "aviary/".into();
    } else if !prefix.ends_with('/') {
        prefix.push('/');
    }
    Ok(SnapshotStore::S3 {
        endpoint,
        region,
        bucket,
        prefix,
        access_key_env,
        secret_key_env,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |n| {
            pairs
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn placeholders_come_from_the_environment() {
        let u = ServiceUrl::parse(ServiceKind::Registry, "postgres://a:${PW}@db:5432/x").unwrap();
        assert_eq!(
            u.resolve(env(&[("PW", "s3cret")])).unwrap(),
            "postgres://a:s3cret@db:5432/x"
        );
        let e = u.resolve(env(&[])).unwrap_err();
        assert!(e.contains("PW") && e.contains("not set"), "{e}");
        let whole = ServiceUrl::parse(ServiceKind::Coordination, "${REDIS_URL}").unwrap();
        assert_eq!(
            whole
                .resolve(env(&[("REDIS_URL", "redis://r:6379/0")]))
                .unwrap(),
            "redis://r:6379/0"
        );
        let e = whole
            .resolve(env(&[("REDIS_URL", "http://r:6379")]))
            .unwrap_err();
        assert!(e.contains("redis://"), "{e}");
        assert!(expand("x${", env(&[])).unwrap_err().contains("unclosed"));
        assert!(expand("${a-b}", env(&[]))
            .unwrap_err()
            .contains("not a valid"));
    }

    #[test]
    fn schemes_are_checked_and_passwords_hidden() {
        let e = ServiceUrl::parse(ServiceKind::Registry, "mysql://u:pw@h/db").unwrap_err();
        assert!(e.contains("postgres://") && !e.contains("pw"), "{e}");
        let e = ServiceUrl::parse(ServiceKind::Coordination, "rediss://h:6380").unwrap_err();
        assert!(e.contains("TLS"), "{e}");
        ServiceUrl::parse(ServiceKind::Registry, "  ").unwrap_err();
        let u =
            ServiceUrl::parse(ServiceKind::Registry, "postgresql://u:pw@h:5432/db?x=1").unwrap();
        assert_eq!(u.to_string(), "postgresql://u:***@h:5432/db?x=1");
        assert_eq!(redact("redis://h:1/0"), "redis://h:1/0");
        assert_eq!(redact("redis://user@h/0"), "redis://user@h/0");
    }

    #[test]
    fn both_or_neither() {
        let r = ServiceUrl::parse(ServiceKind::Registry, "postgres://h/db").unwrap();
        let c = ServiceUrl::parse(ServiceKind::Coordination, "redis://h").unwrap();
        let mut d = DistributedSettings::default();
        d.check_complete().unwrap();
        assert!(!d.is_distributed());
        d.registry = Some(r);
        assert!(d.check_complete().unwrap_err().contains("Redis"));
        d.coordination = Some(c);
        d.check_complete().unwrap();
        assert!(d.is_distributed());
    }

    #[test]
    fn snapshot_urls() {
        assert_eq!(
            snapshot_store_from_url("local").unwrap(),
            SnapshotStore::Local
        );
        assert_eq!(
            snapshot_store_from_url("s3://snaps/team-a?endpoint=http://127.0.0.1:9000").unwrap(),
            SnapshotStore::S3 {
                endpoint: "http://127.0.0.1:9000".into(),
                region: "us-east-1".into(),
                bucket: "snaps".into(),
                prefix: "team-a/".into(),
                access_key_env: "AWS_ACCESS_KEY_ID".into(),
                secret_key_env: "AWS_SECRET_ACCESS_KEY".into(),
            }
        );
        assert!(snapshot_store_from_url("s3://snaps")
            .unwrap_err()
            .contains("endpoint"));
        snapshot_store_from_url("gs://x?endpoint=y").unwrap_err();
        assert!(snapshot_store_from_url("s3://b?endpoint=e&colour=red")
            .unwrap_err()
            .contains("colour"));
    }
}

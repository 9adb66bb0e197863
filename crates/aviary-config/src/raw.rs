//! The file as written (with byte spans on every validated value), and its
//! validation into a [`Config`]. Spans are byte ranges into the text; a span
//! of `0..0` marks a built-in default that the file left out.

use crate::{
    Allowed, Config, ConfigError, LlmSettings, NetworkProfileDef, Overcommit, PlannerSettings,
    PoolSettings, Projection, ResourceClass, Runtime, ServerSettings, Tenant,
};
use aviary_core::NetworkProfile;
use serde::de::{self, Deserializer, SeqAccess, Unexpected, Visitor};
use serde::Deserialize;
use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: Option<RawServer>,
    #[serde(rename = "class")]
    classes: Option<Vec<RawClass>>,
    #[serde(rename = "network_profile")]
    network_profiles: Option<Vec<RawNetworkProfile>>,
    #[serde(rename = "tenant")]
    tenants: Option<Vec<RawTenant>>,
    #[serde(rename = "pool")]
    pools: Option<Vec<RawPool>>,
    planner: Option<RawPlanner>,
    overcommit: Option<RawOvercommit>,
    reconciler: Option<RawReconciler>,
    snapshots: Option<RawSnapshots>,
    distributed: Option<RawDistributed>,
    #[serde(rename = "projection")]
    projections: Option<Vec<RawProjection>>,
    remote_e2b: Option<RawRemoteE2b>,
    remote_opensandbox: Option<RawRemoteOpenSandbox>,
    kubernetes: Option<RawKubernetes>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRemoteOpenSandbox {
    url: Spanned<String>,
    api_key_env: Option<Spanned<String>>,
    api_key_file: Option<Spanned<String>>,
    templates: Spanned<std::collections::BTreeMap<String, String>>,
    timeout_s: Option<Spanned<u64>>,
    request_timeout_s: Option<Spanned<u64>>,
    ready_timeout_s: Option<Spanned<u64>>,
    deny_egress: Option<bool>,
    pausable: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRemoteE2b {
    api_url: Spanned<String>,
    sandbox_url: Option<Spanned<String>>,
    domain: Option<Spanned<String>>,
    port_url: Option<Spanned<String>>,
    #[serde(default)]
    proxy_key: bool,
    api_key_env: Option<Spanned<String>>,
    api_key_file: Option<Spanned<String>>,
    templates: Spanned<std::collections::BTreeMap<String, String>>,
    timeout_s: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKubernetes {
    kubeconfig: Option<Spanned<String>>,
    context: Option<Spanned<String>>,
    in_cluster: Option<Spanned<bool>>,
    namespace: Spanned<String>,
    deployment: Option<Spanned<String>>,
    runtime_class: Option<Spanned<String>>,
    images: Spanned<std::collections::BTreeMap<String, Spanned<String>>>,
    run_as_user: Option<Spanned<i64>>,
    ready_timeout_s: Option<Spanned<u64>>,
    delete_timeout_s: Option<Spanned<u64>>,
    envd_from: Option<Spanned<Vec<String>>>,
    envd_port: Option<Spanned<u64>>,
    relay_dir: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    data_dir: Option<Spanned<String>>,
    listen: Option<Spanned<String>>,
    runtime: Option<Runtime>,
    runtimes: Option<Spanned<Vec<Runtime>>>,
    default_template: Option<Spanned<String>>,
    default_class: Option<Spanned<String>>,
    header_read_timeout_ms: Option<Spanned<u64>>,
    body_read_timeout_ms: Option<Spanned<u64>>,
    max_connections: Option<Spanned<u32>>,
    max_connections_per_ip: Option<Spanned<u32>>,
    rate_limit_per_s: Option<Spanned<f64>>,
    rate_limit_burst: Option<Spanned<u32>>,
    metrics_token_env: Option<Spanned<String>>,
    open_network: Option<bool>,
    docker_socket: Option<Spanned<String>>,
    disk_pool: Option<Spanned<usize>>,
    disk_fs: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClass {
    name: Spanned<String>,
    cpu: Spanned<f64>,
    memory_mb: Spanned<u64>,
    disk_mb: Spanned<u64>,
    pids: Spanned<u32>,
    #[serde(default)]
    gpu: bool,
    runtimes: Option<Spanned<Vec<Runtime>>>,
    network_profiles: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetworkProfile {
    name: Spanned<String>,
    kind: Spanned<NetworkProfile>,
    #[serde(default)]
    allow: Vec<Spanned<String>>,
    #[serde(default)]
    deny: Vec<Spanned<String>>,
    methods: Option<Spanned<std::collections::BTreeMap<String, Vec<String>>>>,
    resolve: Option<Spanned<std::collections::BTreeMap<String, String>>>,
    max_connections: Option<Spanned<u32>>,
    idle_timeout_s: Option<Spanned<u32>>,
    max_header_bytes: Option<Spanned<u32>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    name: Spanned<String>,
    max_sandboxes: u32,
    max_cpu: Spanned<f64>,
    max_memory_mb: Spanned<u64>,
    allowed_classes: RawAllowed,
    allowed_network_profiles: RawAllowed,
    allowed_runtimes: RawAllowed,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPool {
    class: Spanned<String>,
    template: Spanned<String>,
    runtime: Spanned<Runtime>,
    pool_min: Spanned<u32>,
    pool_max: Spanned<u32>,
    buffer_min: Spanned<u32>,
    buffer_max: Spanned<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlanner {
    history_window: Option<Spanned<u32>>,
    llm: Option<RawLlm>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLlm {
    base_url: Spanned<String>,
    model: Spanned<String>,
    api_key: Option<Spanned<String>>,
    api_key_env: Option<Spanned<String>>,
    timeout_ms: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOvercommit {
    cpu_ratio: Option<Spanned<f64>>,
    memory_ratio: Option<Spanned<f64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReconciler {
    interval_ms: Option<Spanned<u64>>,
    orphan_grace_s: Option<Spanned<u64>>,
    node_unhealthy_after_s: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSnapshots {
    store: Spanned<String>,
    endpoint: Option<Spanned<String>>,
    region: Option<Spanned<String>>,
    bucket: Option<Spanned<String>>,
    prefix: Option<Spanned<String>>,
    access_key_env: Option<Spanned<String>>,
    secret_key_env: Option<Spanned<String>>,
    url: Option<Spanned<String>>,
    url_env: Option<Spanned<String>>,
    namespace: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDistributed {
    registry: Option<Spanned<String>>,
    coordination: Option<Spanned<String>>,
    schema: Option<Spanned<String>>,
    key_prefix: Option<Spanned<String>>,
    node_name: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProjection {
    host: Spanned<String>,
    sandbox: Spanned<String>,
}

/// `"*"` or a list of names, each with its span.
enum RawAllowed {
    All,
    Only(Vec<Spanned<String>>),
}

impl<'de> Deserialize<'de> for RawAllowed {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct AllowedVisitor;
        impl<'de> Visitor<'de> for AllowedVisitor {
            type Value = RawAllowed;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#""*" or a list of names"#)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawAllowed, E> {
                if v == "*" {
                    Ok(RawAllowed::All)
                } else {
                    Err(E::invalid_value(Unexpected::Str(v), &self))
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawAllowed, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<Spanned<String>>()? {
                    items.push(item);
                }
                Ok(RawAllowed::Only(items))
            }
        }
        d.deserialize_any(AllowedVisitor)
    }
}

/// Span of a value the file left out.
const DEFAULTED: Range<usize> = 0..0;

struct Checker<'a> {
    text: &'a str,
    origin: &'a str,
}

impl Checker<'_> {
    fn fail(&self, span: &Range<usize>, key: String, message: String) -> ConfigError {
        ConfigError::invalid(self.text, self.origin, span, key, message)
    }

    fn check(
        &self,
        ok: bool,
        span: &Range<usize>,
        key: impl FnOnce() -> String,
        message: impl FnOnce() -> String,
    ) -> Result<(), ConfigError> {
        if ok {
            Ok(())
        } else {
            Err(self.fail(span, key(), message()))
        }
    }

    fn check_name(
        &self,
        what: &str,
        key: String,
        name: &Spanned<String>,
    ) -> Result<(), ConfigError> {
        // Template names follow the template store's rule (up to 128).
        let max = if what == "template" { 128 } else { 64 };
        let n = name.get_ref();
        self.check(
            valid_name(n, max),
            &name.span(),
            || key,
            || {
                format!(
                    "{what} name {n:?} is invalid: use 1-{max} characters a-z, A-Z, 0-9, '-', '_', '.', starting with a letter or digit"
                )
            },
        )
    }
}

fn valid_name(n: &str, max_len: usize) -> bool {
    !n.is_empty()
        && n.len() <= max_len
        && n.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// `[A-Za-z_][A-Za-z0-9_]*`, what a shell accepts as a variable name.
fn valid_env_name(n: &str) -> bool {
    n.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `example.org` or `*.example.org`: dot-separated labels of a-z, 0-9, '-'.
fn valid_domain(d: &str) -> bool {
    let host = d.strip_prefix("*.").unwrap_or(d);
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
}

pub(crate) fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let raw: RawConfig =
        toml::from_str(text).map_err(|e| ConfigError::from_toml(text, origin, &e))?;
    let ck = Checker { text, origin };

    let network_profiles = match raw.network_profiles {
        Some(list) => check_profiles(&ck, list)?,
        None => crate::default_network_profiles(),
    };
    let profile_names: HashSet<&str> = network_profiles.iter().map(|p| p.name.as_str()).collect();

    let classes = match raw.classes {
        Some(list) => check_classes(&ck, list, &profile_names)?,
        None => crate::default_classes(),
    };
    let class_names: HashSet<&str> = classes.iter().map(|c| c.name.as_str()).collect();

    let smallest_disk = classes
        .iter()
        .min_by_key(|c| c.disk_mb)
        .map(|c| (c.name.as_str(), c.disk_mb));
    let server = check_server(&ck, raw.server, &class_names, smallest_disk)?;

    let tenants = match raw.tenants {
        Some(list) => check_tenants(&ck, list, &class_names, &profile_names)?,
        None => crate::default_tenants(),
    };

    let pools = match raw.pools {
        Some(list) => check_pools(&ck, list, &classes)?,
        None => {
            let pools = crate::default_pools();
            for p in &pools {
                let usable = classes
                    .iter()
                    .any(|c| c.name == p.class && c.supports_runtime(p.runtime));
                ck.check(
                    usable,
                    &DEFAULTED,
                    || "pool".into(),
                    || {
                        format!(
                            "the built-in pool is for class {:?} on {}, which this file does not define; \
                             add [[pool]] tables, or `pool = []` for none",
                            p.class, p.runtime
                        )
                    },
                )?;
            }
            pools
        }
    };

    let planner = check_planner(&ck, raw.planner)?;
    let overcommit = check_overcommit(&ck, raw.overcommit)?;
    let reconciler = check_reconciler(&ck, raw.reconciler)?;
    let snapshots = check_snapshots(&ck, raw.snapshots)?;
    let distributed = check_distributed(&ck, raw.distributed)?;
    let projections = match raw.projections {
        Some(list) => check_projections(&ck, list)?,
        None => Vec::new(),
    };
    let remote_e2b = check_remote_e2b(&ck, raw.remote_e2b)?;
    let remote_opensandbox = check_remote_opensandbox(&ck, raw.remote_opensandbox)?;
    for rt in &server.runtimes {
        let configured = match rt {
            Runtime::E2b => remote_e2b.is_some(),
            Runtime::Opensandbox => remote_opensandbox.is_some(),
            _ => true,
        };
        ck.check(
            configured,
            &DEFAULTED,
            || "server.runtimes".into(),
            || format!("server: runtime {rt} needs a [remote_{rt}] table (its URL and key)"),
        )?;
    }
    let kubernetes = check_kubernetes(&ck, raw.kubernetes, &server)?;

    Ok(Config {
        server,
        classes,
        network_profiles,
        tenants,
        pools,
        planner,
        overcommit,
        reconciler,
        snapshots,
        distributed,
        projections,
        remote_e2b,
        remote_opensandbox,
        kubernetes,
    })
}

/// A URL the runtime calls: `http://` or `https://`, a host, no trailing
/// slash, no spaces.
fn valid_base_url(u: &str) -> bool {
    let rest = u
        .strip_prefix("https://")
        .or_else(|| u.strip_prefix("http://"));
    rest.is_some_and(|r| {
        !r.is_empty()
            && !r.starts_with('/')
            && !u.ends_with('/')
            && !u.chars().any(|c| c.is_whitespace() || c.is_control())
    })
}

fn check_remote_e2b(
    ck: &Checker<'_>,
    raw: Option<RawRemoteE2b>,
) -> Result<Option<crate::RemoteE2bSettings>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    for (field, v) in [
        ("api_url", Some(&raw.api_url)),
        ("sandbox_url", raw.sandbox_url.as_ref()),
        ("port_url", raw.port_url.as_ref()),
    ] {
        if let Some(v) = v {
            ck.check(
                valid_base_url(v.get_ref()),
                &v.span(),
                || format!("remote_e2b.{field}"),
                || {
                    format!(
                        "remote_e2b: {field} {:?} must be http(s)://host[:port][/path] without a trailing slash",
                        v.get_ref()
                    )
                },
            )?;
        }
    }
    let domain = match &raw.domain {
        Some(d) => {
            ck.check(
                valid_domain(d.get_ref()) && !d.get_ref().starts_with("*."),
                &d.span(),
                || "remote_e2b.domain".into(),
                || format!("remote_e2b: domain {:?} is not a domain name", d.get_ref()),
            )?;
            d.get_ref().clone()
        }
        None => "e2b.app".into(),
    };
    check_api_key(
        ck,
        "remote_e2b",
        &raw.api_url,
        raw.api_key_env.as_ref(),
        raw.api_key_file.as_ref(),
    )?;
    let templates = check_remote_templates(ck, "remote_e2b", &raw.templates)?;
    let timeout_s = check_seconds(
        ck,
        "remote_e2b.timeout_s",
        raw.timeout_s.as_ref(),
        60..=86_400 * 30,
        3600,
    )?;
    Ok(Some(crate::RemoteE2bSettings {
        api_url: raw.api_url.into_inner(),
        sandbox_url: raw.sandbox_url.map(Spanned::into_inner),
        domain,
        port_url: raw.port_url.map(Spanned::into_inner),
        proxy_key: raw.proxy_key,
        api_key_env: raw.api_key_env.map(Spanned::into_inner),
        api_key_file: raw.api_key_file.map(|f| PathBuf::from(f.into_inner())),
        templates,
        timeout_s,
    }))
}

/// A remote table's key: named by exactly one of `api_key_env` (a variable
/// name) and `api_key_file` (an absolute path).
fn check_api_key(
    ck: &Checker<'_>,
    table: &str,
    anchor: &Spanned<String>,
    key_env: Option<&Spanned<String>>,
    key_file: Option<&Spanned<String>>,
) -> Result<(), ConfigError> {
    ck.check(
        key_env.is_some() != key_file.is_some(),
        &anchor.span(),
        || format!("{table}.api_key_env"),
        || format!("{table}: name the API key by exactly one of api_key_env and api_key_file"),
    )?;
    if let Some(e) = key_env {
        ck.check(
            valid_env_name(e.get_ref()),
            &e.span(),
            || format!("{table}.api_key_env"),
            || {
                format!(
                    "{table}: {:?} is not an environment variable name",
                    e.get_ref()
                )
            },
        )?;
    }
    if let Some(f) = key_file {
        ck.check(
            f.get_ref().starts_with('/'),
            &f.span(),
            || format!("{table}.api_key_file"),
            || format!("{table}: api_key_file {:?} must be absolute", f.get_ref()),
        )?;
    }
    Ok(())
}

/// A remote table's template map: at least one entry, none empty, the
/// provider's side without spaces.
fn check_remote_templates(
    ck: &Checker<'_>,
    table: &str,
    raw: &Spanned<std::collections::BTreeMap<String, String>>,
) -> Result<std::collections::BTreeMap<String, String>, ConfigError> {
    let templates = raw.get_ref().clone();
    ck.check(
        !templates.is_empty()
            && templates.iter().all(|(k, v)| {
                !k.is_empty()
                    && k.len() <= 128
                    && !v.is_empty()
                    && v.len() <= 256
                    && !v.chars().any(|c| c.is_whitespace() || c.is_control())
            }),
        &raw.span(),
        || format!("{table}.templates"),
        || format!("{table}: templates maps Aviary templates (name or sha256 digest) to the provider's template ids; at least one, none empty"),
    )?;
    Ok(templates)
}

/// A number of seconds within `range`, `default` when absent.
fn check_seconds(
    ck: &Checker<'_>,
    key: &str,
    raw: Option<&Spanned<u64>>,
    range: std::ops::RangeInclusive<u64>,
    default: u64,
) -> Result<u64, ConfigError> {
    match raw {
        Some(t) => {
            let table = key.split('.').next().unwrap_or(key);
            let field = key.rsplit('.').next().unwrap_or(key);
            ck.check(
                range.contains(t.get_ref()),
                &t.span(),
                || key.into(),
                || {
                    format!(
                        "{table}: {field} must be between {} and {}",
                        range.start(),
                        range.end()
                    )
                },
            )?;
            Ok(*t.get_ref())
        }
        None => Ok(default),
    }
}

fn check_remote_opensandbox(
    ck: &Checker<'_>,
    raw: Option<RawRemoteOpenSandbox>,
) -> Result<Option<crate::RemoteOpenSandboxSettings>, ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    ck.check(
        valid_base_url(raw.url.get_ref()),
        &raw.url.span(),
        || "remote_opensandbox.url".into(),
        || {
            format!(
                "remote_opensandbox: url {:?} must be http(s)://host[:port][/path] without a trailing slash (the lifecycle API is {{url}}/v1)",
                raw.url.get_ref()
            )
        },
    )?;
    check_api_key(
        ck,
        "remote_opensandbox",
        &raw.url,
        raw.api_key_env.as_ref(),
        raw.api_key_file.as_ref(),
    )?;
    let templates = check_remote_templates(ck, "remote_opensandbox", &raw.templates)?;
    let timeout_s = check_seconds(
        ck,
        "remote_opensandbox.timeout_s",
        raw.timeout_s.as_ref(),
        60..=86_400 * 30,
        3600,
    )?;
    let request_timeout_s = check_seconds(
        ck,
        "remote_opensandbox.request_timeout_s",
        raw.request_timeout_s.as_ref(),
        1..=600,
        60,
    )?;
    let ready_timeout_s = check_seconds(
        ck,
        "remote_opensandbox.ready_timeout_s",
        raw.ready_timeout_s.as_ref(),
        1..=3600,
        180,
    )?;
    Ok(Some(crate::RemoteOpenSandboxSettings {
        url: raw.url.into_inner(),
        api_key_env: raw.api_key_env.map(Spanned::into_inner),
        api_key_file: raw.api_key_file.map(|f| PathBuf::from(f.into_inner())),
        templates,
        timeout_s,
        request_timeout_s,
        ready_timeout_s,
        deny_egress: raw.deny_egress.unwrap_or(true),
        pausable: raw.pausable.unwrap_or(true),
    }))
}

fn check_distributed(
    ck: &Checker<'_>,
    raw: Option<RawDistributed>,
) -> Result<crate::DistributedSettings, ConfigError> {
    use crate::distributed::{ServiceKind, ServiceUrl};
    let Some(raw) = raw else {
        return Ok(crate::DistributedSettings::default());
    };
    let url = |kind: ServiceKind,
               v: &Option<Spanned<String>>|
     -> Result<Option<ServiceUrl>, ConfigError> {
        let Some(v) = v else { return Ok(None) };
        ServiceUrl::parse(kind, v.get_ref())
            .map(Some)
            .map_err(|e| ck.fail(&v.span(), format!("distributed.{}", kind.name()), e))
    };
    let ident = |field: &str, v: &Option<Spanned<String>>| -> Result<Option<String>, ConfigError> {
        let Some(v) = v else { return Ok(None) };
        let ok = valid_env_name(v.get_ref()) && v.get_ref().len() <= 63;
        ck.check(
            ok,
            &v.span(),
            || format!("distributed.{field}"),
            || format!("distributed: {field} must be 1-63 letters, digits or _, not starting with a digit"),
        )?;
        Ok(Some(v.get_ref().clone()))
    };
    let d = crate::DistributedSettings {
        registry: url(ServiceKind::Registry, &raw.registry)?,
        coordination: url(ServiceKind::Coordination, &raw.coordination)?,
        schema: ident("schema", &raw.schema)?,
        key_prefix: ident("key_prefix", &raw.key_prefix)?.unwrap_or_else(|| "aviary".into()),
        node_name: match &raw.node_name {
            Some(n) => {
                ck.check_name("node", "distributed.node_name".into(), n)?;
                Some(n.get_ref().clone())
            }
            None => None,
        },
    };
    if let Err(e) = d.check_complete() {
        let span = raw
            .registry
            .as_ref()
            .or(raw.coordination.as_ref())
            .map(|v| v.span())
            .unwrap_or(0..0);
        return Err(ck.fail(&span, "distributed".to_owned(), e));
    }
    Ok(d)
}

fn check_server(
    ck: &Checker<'_>,
    raw: Option<RawServer>,
    classes: &HashSet<&str>,
    smallest_disk: Option<(&str, u64)>,
) -> Result<ServerSettings, ConfigError> {
    let mut s = crate::default_server();
    let mut class_span = DEFAULTED;
    if let Some(raw) = raw {
        if let Some(fs) = raw.disk_fs {
            let span = fs.span();
            s.disk_fs = match fs.get_ref().as_str() {
                "ext4" => crate::DiskFs::Ext4,
                "xfs" => crate::DiskFs::Xfs,
                other => {
                    return Err(ck.fail(
                        &span,
                        "server.disk_fs".into(),
                        format!("server: disk_fs must be \"ext4\" or \"xfs\", got {other:?}"),
                    ))
                }
            };
            if let (crate::DiskFs::Xfs, Some((class, mb))) = (s.disk_fs, smallest_disk) {
                ck.check(
                    mb >= crate::XFS_MIN_DISK_MB,
                    &span,
                    || "server.disk_fs".into(),
                    || {
                        format!(
                            "server: disk_fs = \"xfs\" needs every class's disk_mb >= {} \
                             (mkfs.xfs refuses smaller file systems), but class {class:?} has {mb}",
                            crate::XFS_MIN_DISK_MB
                        )
                    },
                )?;
            }
        }
        if let Some(open) = raw.open_network {
            s.open_network = open;
        }
        if let Some(n) = raw.disk_pool {
            ck.check(
                *n.get_ref() <= 16,
                &n.span(),
                || "server.disk_pool".into(),
                || {
                    format!(
                        "server: disk_pool must be between 0 and 16, got {}",
                        n.get_ref()
                    )
                },
            )?;
            s.disk_pool = n.into_inner();
        }
        if let Some(sock) = raw.docker_socket {
            ck.check(
                sock.get_ref().starts_with('/'),
                &sock.span(),
                || "server.docker_socket".into(),
                || "server: docker_socket must be an absolute path".into(),
            )?;
            s.docker_socket = PathBuf::from(sock.into_inner());
        }
        if let Some(dir) = raw.data_dir {
            ck.check(
                !dir.get_ref().trim().is_empty(),
                &dir.span(),
                || "server.data_dir".into(),
                || "server: data_dir must not be empty".into(),
            )?;
            s.data_dir = PathBuf::from(dir.into_inner());
        }
        if let Some(listen) = raw.listen {
            s.listen = listen.get_ref().parse::<SocketAddr>().map_err(|_| {
                ck.fail(
                    &listen.span(),
                    "server.listen".into(),
                    format!(
                        "server: listen {:?} is not an address (ip:port, e.g. 127.0.0.1:7400)",
                        listen.get_ref()
                    ),
                )
            })?;
        }
        if let Some(rt) = raw.runtime {
            ck.check(
                !rt.is_remote(),
                &DEFAULTED,
                || "server.runtime".into(),
                || format!("server: the default runtime must run on this host; list {rt} in runtimes instead"),
            )?;
            s.runtime = rt;
        }
        match raw.runtimes {
            Some(list) => {
                let span = list.span();
                let list = list.into_inner();
                ck.check(
                    !list.is_empty(),
                    &span,
                    || "server.runtimes".into(),
                    || "server: runtimes must not be empty".into(),
                )?;
                for (i, r) in list.iter().enumerate() {
                    ck.check(
                        !list[..i].contains(r),
                        &span,
                        || "server.runtimes".into(),
                        || format!("server: runtime {r} is listed twice in runtimes"),
                    )?;
                }
                let runtime = s.runtime;
                ck.check(
                    list.contains(&runtime),
                    &span,
                    || "server.runtimes".into(),
                    || format!("server: runtimes must include the default runtime {runtime}"),
                )?;
                s.runtimes = list;
            }
            None => s.runtimes = vec![s.runtime],
        }
        if let Some(t) = raw.default_template {
            ck.check_name("template", "server.default_template".into(), &t)?;
            s.default_template = t.into_inner();
        }
        if let Some(c) = raw.default_class {
            class_span = c.span();
            s.default_class = c.into_inner();
        }
        let e = &mut s.edge;
        for (name, raw, field) in [
            (
                "header_read_timeout_ms",
                raw.header_read_timeout_ms,
                &mut e.header_read_timeout_ms,
            ),
            (
                "body_read_timeout_ms",
                raw.body_read_timeout_ms,
                &mut e.body_read_timeout_ms,
            ),
        ] {
            if let Some(v) = raw {
                ck.check(
                    *v.get_ref() > 0,
                    &v.span(),
                    || format!("server.{name}"),
                    || format!("server: {name} must be > 0"),
                )?;
                *field = v.into_inner();
            }
        }
        for (name, raw, field) in [
            (
                "max_connections",
                raw.max_connections,
                &mut e.max_connections,
            ),
            (
                "max_connections_per_ip",
                raw.max_connections_per_ip,
                &mut e.max_connections_per_ip,
            ),
            (
                "rate_limit_burst",
                raw.rate_limit_burst,
                &mut e.rate_limit_burst,
            ),
        ] {
            if let Some(v) = raw {
                ck.check(
                    *v.get_ref() > 0,
                    &v.span(),
                    || format!("server.{name}"),
                    || format!("server: {name} must be > 0"),
                )?;
                *field = v.into_inner();
            }
        }
        if let Some(v) = raw.rate_limit_per_s {
            let r = *v.get_ref();
            ck.check(
                r.is_finite() && r > 0.0,
                &v.span(),
                || "server.rate_limit_per_s".into(),
                || "server: rate_limit_per_s must be a number > 0".into(),
            )?;
            e.rate_limit_per_s = r;
        }
        if let Some(v) = raw.metrics_token_env {
            ck.check(
                v.get_ref().is_empty() || valid_env_name(v.get_ref()),
                &v.span(),
                || "server.metrics_token_env".into(),
                || {
                    format!(
                        "server: metrics_token_env {:?} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*, or \"\" for none)",
                        v.get_ref()
                    )
                },
            )?;
            e.metrics_token_env = v.into_inner();
        }
    }
    ck.check(
        classes.contains(s.default_class.as_str()),
        &class_span,
        || "server.default_class".into(),
        || {
            format!(
                "server: default_class {:?} is not a configured class",
                s.default_class
            )
        },
    )?;
    Ok(s)
}

fn check_profiles(
    ck: &Checker<'_>,
    list: Vec<RawNetworkProfile>,
) -> Result<Vec<NetworkProfileDef>, ConfigError> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, p) in list.into_iter().enumerate() {
        let key = |field: &str| format!("network_profile[{i}].{field}");
        ck.check_name("network profile", key("name"), &p.name)?;
        let name = p.name.get_ref().clone();
        ck.check(
            seen.insert(name.clone()),
            &p.name.span(),
            || key("name"),
            || format!("network profile {name:?} is defined twice"),
        )?;
        let kind = *p.kind.get_ref();
        match kind {
            NetworkProfile::Allowlist => ck.check(
                !p.allow.is_empty(),
                &p.kind.span(),
                || key("allow"),
                || {
                    format!(
                        "network profile {name:?}: kind \"allowlist\" needs a non-empty allow list"
                    )
                },
            )?,
            NetworkProfile::None | NetworkProfile::Open => {
                if let Some(first) = p.allow.first() {
                    return Err(ck.fail(
                        &first.span(),
                        key("allow"),
                        format!(
                            "network profile {name:?}: allow is only for kind \"allowlist\", not {:?}",
                            kind.as_str()
                        ),
                    ));
                }
            }
        }
        for d in &p.allow {
            ck.check(
                valid_domain(d.get_ref()),
                &d.span(),
                || key("allow"),
                || {
                    format!(
                        "network profile {name:?}: {:?} is not a domain (lowercase example.org or *.example.org)",
                        d.get_ref()
                    )
                },
            )?;
        }
        let allow: Vec<String> = p.allow.into_iter().map(Spanned::into_inner).collect();
        let egress_only = |span: &Range<usize>, field: &str| {
            ck.check(
                kind == NetworkProfile::Allowlist,
                span,
                || key(field),
                || format!("network profile {name:?}: {field} is only for kind \"allowlist\""),
            )
        };
        for d in &p.deny {
            egress_only(&d.span(), "deny")?;
            ck.check(
                valid_domain(d.get_ref()),
                &d.span(),
                || key("deny"),
                || {
                    format!(
                        "network profile {name:?}: deny entry {:?} is not a domain (lowercase example.org or *.example.org)",
                        d.get_ref()
                    )
                },
            )?;
        }
        let methods = match p.methods {
            None => Default::default(),
            Some(m) => {
                egress_only(&m.span(), "methods")?;
                let span = m.span();
                let m = m.into_inner();
                for (domain, list) in &m {
                    ck.check(
                        allow.contains(domain),
                        &span,
                        || key("methods"),
                        || format!("network profile {name:?}: methods names {domain:?}, which is not in allow"),
                    )?;
                    ck.check(
                        !list.is_empty()
                            && list.iter().all(|x| {
                                !x.is_empty() && x.len() <= 16 && x.bytes().all(|b| b.is_ascii_uppercase())
                            }),
                        &span,
                        || key("methods"),
                        || format!("network profile {name:?}: methods for {domain:?} must be a non-empty list of upper-case methods (GET, HEAD, CONNECT, ...)"),
                    )?;
                }
                m
            }
        };
        let resolve = match p.resolve {
            None => Default::default(),
            Some(r) => {
                egress_only(&r.span(), "resolve")?;
                let span = r.span();
                let r = r.into_inner();
                for (host, to) in &r {
                    ck.check(
                        valid_domain(host) && !host.starts_with("*."),
                        &span,
                        || key("resolve"),
                        || format!("network profile {name:?}: resolve key {host:?} is not a domain name"),
                    )?;
                    ck.check(
                        to.parse::<std::net::SocketAddr>().is_ok()
                            || to.parse::<std::net::IpAddr>().is_ok(),
                        &span,
                        || key("resolve"),
                        || format!("network profile {name:?}: resolve {host:?} = {to:?} is not an IP address or ip:port"),
                    )?;
                }
                r
            }
        };
        let mut limits = aviary_core::egress::EgressLimits::default();
        for (field, value, slot, min) in [
            (
                "max_connections",
                &p.max_connections,
                &mut limits.max_connections,
                1,
            ),
            (
                "idle_timeout_s",
                &p.idle_timeout_s,
                &mut limits.idle_timeout_s,
                1,
            ),
            (
                "max_header_bytes",
                &p.max_header_bytes,
                &mut limits.max_header_bytes,
                1024,
            ),
        ] {
            if let Some(v) = value {
                egress_only(&v.span(), field)?;
                ck.check(
                    *v.get_ref() >= min && *v.get_ref() <= 1 << 20,
                    &v.span(),
                    || key(field),
                    || {
                        format!(
                            "network profile {name:?}: {field} must be between {min} and 1048576"
                        )
                    },
                )?;
                *slot = *v.get_ref();
            }
        }
        out.push(NetworkProfileDef {
            name,
            kind,
            allow,
            deny: p.deny.into_iter().map(Spanned::into_inner).collect(),
            methods,
            resolve,
            limits,
        });
    }
    Ok(out)
}

fn check_classes(
    ck: &Checker<'_>,
    list: Vec<RawClass>,
    profiles: &HashSet<&str>,
) -> Result<Vec<ResourceClass>, ConfigError> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, c) in list.into_iter().enumerate() {
        let key = |field: &str| format!("class[{i}].{field}");
        ck.check_name("class", key("name"), &c.name)?;
        let name = c.name.get_ref().clone();
        ck.check(
            seen.insert(name.clone()),
            &c.name.span(),
            || key("name"),
            || format!("class {name:?} is defined twice"),
        )?;
        let cpu = *c.cpu.get_ref();
        ck.check(
            cpu.is_finite() && cpu > 0.0 && cpu <= 1024.0,
            &c.cpu.span(),
            || key("cpu"),
            || format!("class {name:?}: cpu must be > 0 and <= 1024, got {cpu}"),
        )?;
        ck.check(
            *c.memory_mb.get_ref() > 0,
            &c.memory_mb.span(),
            || key("memory_mb"),
            || format!("class {name:?}: memory_mb must be > 0"),
        )?;
        ck.check(
            *c.disk_mb.get_ref() > 0,
            &c.disk_mb.span(),
            || key("disk_mb"),
            || format!("class {name:?}: disk_mb must be > 0"),
        )?;
        ck.check(
            *c.pids.get_ref() > 0,
            &c.pids.span(),
            || key("pids"),
            || format!("class {name:?}: pids must be > 0"),
        )?;
        let runtimes = match c.runtimes {
            Some(r) => {
                ck.check(
                    !r.get_ref().is_empty(),
                    &r.span(),
                    || key("runtimes"),
                    || format!("class {name:?}: runtimes must not be empty"),
                )?;
                let mut rts = r.into_inner();
                rts.dedup();
                rts
            }
            None => crate::local_runtimes(),
        };
        let network_profiles = match c.network_profiles {
            Some(list) => {
                ck.check(
                    !list.get_ref().is_empty(),
                    &list.span(),
                    || key("network_profiles"),
                    || format!("class {name:?}: network_profiles must not be empty"),
                )?;
                let mut names = Vec::new();
                for p in list.into_inner() {
                    ck.check(
                        profiles.contains(p.get_ref().as_str()),
                        &p.span(),
                        || key("network_profiles"),
                        || {
                            format!(
                                "class {name:?}: network profile {:?} is not defined",
                                p.get_ref()
                            )
                        },
                    )?;
                    names.push(p.into_inner());
                }
                names
            }
            None => vec!["none".to_owned()],
        };
        if !profiles.contains("none") && network_profiles == ["none"] {
            return Err(ck.fail(
                &c.name.span(),
                key("network_profiles"),
                format!(
                    "class {name:?}: no network_profiles given and the default \"none\" is not defined"
                ),
            ));
        }
        out.push(ResourceClass {
            name,
            cpu,
            memory_mb: c.memory_mb.into_inner(),
            disk_mb: c.disk_mb.into_inner(),
            pids: c.pids.into_inner(),
            gpu: c.gpu,
            runtimes,
            network_profiles,
        });
    }
    ck.check(
        !out.is_empty(),
        &DEFAULTED,
        || "class".into(),
        || "at least one [[class]] is needed".into(),
    )?;
    Ok(out)
}

fn check_allowed_names(
    ck: &Checker<'_>,
    raw: RawAllowed,
    key: String,
    tenant: &str,
    what: &str,
    known: &dyn Fn(&str) -> bool,
) -> Result<Allowed<String>, ConfigError> {
    match raw {
        RawAllowed::All => Ok(Allowed::All),
        RawAllowed::Only(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                ck.check(
                    known(item.get_ref()),
                    &item.span(),
                    || key.clone(),
                    || {
                        format!(
                            "tenant {tenant:?}: {what} {:?} is not defined",
                            item.get_ref()
                        )
                    },
                )?;
                out.push(item.into_inner());
            }
            Ok(Allowed::Only(out))
        }
    }
}

fn check_tenants(
    ck: &Checker<'_>,
    list: Vec<RawTenant>,
    classes: &HashSet<&str>,
    profiles: &HashSet<&str>,
) -> Result<Vec<Tenant>, ConfigError> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.into_iter().enumerate() {
        let key = |field: &str| format!("tenant[{i}].{field}");
        ck.check_name("tenant", key("name"), &t.name)?;
        let name = t.name.get_ref().clone();
        ck.check(
            seen.insert(name.clone()),
            &t.name.span(),
            || key("name"),
            || format!("tenant {name:?} is defined twice"),
        )?;
        let max_cpu = *t.max_cpu.get_ref();
        ck.check(
            max_cpu.is_finite() && max_cpu > 0.0,
            &t.max_cpu.span(),
            || key("max_cpu"),
            || format!("tenant {name:?}: max_cpu must be > 0, got {max_cpu}"),
        )?;
        ck.check(
            *t.max_memory_mb.get_ref() > 0,
            &t.max_memory_mb.span(),
            || key("max_memory_mb"),
            || format!("tenant {name:?}: max_memory_mb must be > 0"),
        )?;
        let allowed_classes = check_allowed_names(
            ck,
            t.allowed_classes,
            key("allowed_classes"),
            &name,
            "class",
            &|n| classes.contains(n),
        )?;
        let allowed_network_profiles = check_allowed_names(
            ck,
            t.allowed_network_profiles,
            key("allowed_network_profiles"),
            &name,
            "network profile",
            &|n| profiles.contains(n),
        )?;
        let allowed_runtimes = match t.allowed_runtimes {
            RawAllowed::All => Allowed::All,
            RawAllowed::Only(items) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    let rt = item.get_ref().parse::<Runtime>().map_err(|e| {
                        ck.fail(
                            &item.span(),
                            key("allowed_runtimes"),
                            format!("tenant {name:?}: {e}"),
                        )
                    })?;
                    out.push(rt);
                }
                Allowed::Only(out)
            }
        };
        out.push(Tenant {
            name,
            max_sandboxes: t.max_sandboxes,
            max_cpu,
            max_memory_mb: t.max_memory_mb.into_inner(),
            allowed_classes,
            allowed_network_profiles,
            allowed_runtimes,
        });
    }
    Ok(out)
}

fn check_pools(
    ck: &Checker<'_>,
    list: Vec<RawPool>,
    classes: &[ResourceClass],
) -> Result<Vec<PoolSettings>, ConfigError> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, p) in list.into_iter().enumerate() {
        let key = |field: &str| format!("pool[{i}].{field}");
        let class_name = p.class.get_ref().clone();
        let class = classes
            .iter()
            .find(|c| c.name == class_name)
            .ok_or_else(|| {
                ck.fail(
                    &p.class.span(),
                    key("class"),
                    format!("pool: class {class_name:?} is not defined"),
                )
            })?;
        ck.check_name("template", key("template"), &p.template)?;
        let runtime = *p.runtime.get_ref();
        ck.check(
            class.supports_runtime(runtime),
            &p.runtime.span(),
            || key("runtime"),
            || format!("pool for class {class_name:?}: the class does not allow runtime {runtime}"),
        )?;
        let template = p.template.get_ref().clone();
        ck.check(
            seen.insert((class_name.clone(), template.clone(), runtime)),
            &p.class.span(),
            || key("class"),
            || format!("pool ({class_name}, {template}, {runtime}) is defined twice"),
        )?;
        let (pool_min, pool_max) = (*p.pool_min.get_ref(), *p.pool_max.get_ref());
        let (buffer_min, buffer_max) = (*p.buffer_min.get_ref(), *p.buffer_max.get_ref());
        ck.check(
            pool_min <= pool_max,
            &p.pool_min.span(),
            || key("pool_min"),
            || {
                format!(
                    "pool for class {class_name:?}: pool_min ({pool_min}) > pool_max ({pool_max})"
                )
            },
        )?;
        ck.check(
            buffer_min <= buffer_max,
            &p.buffer_min.span(),
            || key("buffer_min"),
            || {
                format!(
                    "pool for class {class_name:?}: buffer_min ({buffer_min}) > buffer_max ({buffer_max})"
                )
            },
        )?;
        ck.check(
            buffer_max <= pool_max,
            &p.buffer_max.span(),
            || key("buffer_max"),
            || {
                format!(
                    "pool for class {class_name:?}: buffer_max ({buffer_max}) > pool_max ({pool_max})"
                )
            },
        )?;
        out.push(PoolSettings {
            class: class_name,
            template,
            runtime,
            pool_min,
            pool_max,
            buffer_min,
            buffer_max,
        });
    }
    Ok(out)
}

fn check_planner(
    ck: &Checker<'_>,
    raw: Option<RawPlanner>,
) -> Result<PlannerSettings, ConfigError> {
    let mut planner = PlannerSettings {
        history_window: crate::DEFAULT_HISTORY_WINDOW,
        llm: None,
    };
    let Some(raw) = raw else {
        return Ok(planner);
    };
    if let Some(w) = raw.history_window {
        let n = *w.get_ref();
        ck.check(
            (1..=10_000).contains(&n),
            &w.span(),
            || "planner.history_window".into(),
            || format!("planner: history_window must be 1..=10000, got {n}"),
        )?;
        planner.history_window = n;
    }
    if let Some(llm) = raw.llm {
        let url = llm.base_url.get_ref();
        ck.check(
            (url.starts_with("http://") || url.starts_with("https://"))
                && url.len() > "https://".len()
                && !url.contains(char::is_whitespace),
            &llm.base_url.span(),
            || "planner.llm.base_url".into(),
            || format!("planner.llm: base_url {url:?} must be an http:// or https:// URL"),
        )?;
        ck.check(
            !llm.model.get_ref().trim().is_empty(),
            &llm.model.span(),
            || "planner.llm.model".into(),
            || "planner.llm: model must not be empty".into(),
        )?;
        if let (Some(_), Some(env)) = (&llm.api_key, &llm.api_key_env) {
            return Err(ck.fail(
                &env.span(),
                "planner.llm.api_key_env".into(),
                "planner.llm: give api_key or api_key_env, not both".into(),
            ));
        }
        if let Some(env) = &llm.api_key_env {
            let v = env.get_ref();
            ck.check(
                !v.is_empty() && !v.contains('=') && !v.contains('\0'),
                &env.span(),
                || "planner.llm.api_key_env".into(),
                || format!("planner.llm: api_key_env {v:?} is not an environment variable name"),
            )?;
        }
        let timeout_ms = match llm.timeout_ms {
            Some(t) => {
                let ms = *t.get_ref();
                ck.check(
                    (1..=600_000).contains(&ms),
                    &t.span(),
                    || "planner.llm.timeout_ms".into(),
                    || format!("planner.llm: timeout_ms must be 1..=600000, got {ms}"),
                )?;
                ms
            }
            None => crate::DEFAULT_LLM_TIMEOUT_MS,
        };
        planner.llm = Some(LlmSettings {
            base_url: llm.base_url.into_inner().trim_end_matches('/').to_owned(),
            model: llm.model.into_inner(),
            api_key: llm.api_key.map(Spanned::into_inner),
            api_key_env: llm.api_key_env.map(Spanned::into_inner),
            timeout_ms,
        });
    }
    Ok(planner)
}

fn check_snapshots(
    ck: &Checker<'_>,
    raw: Option<RawSnapshots>,
) -> Result<crate::SnapshotSettings, ConfigError> {
    use crate::SnapshotStore;
    let Some(raw) = raw else {
        return Ok(crate::SnapshotSettings::default());
    };
    let kind = raw.store.get_ref().as_str();
    let need = |field: &str, v: &Option<Spanned<String>>| -> Result<String, ConfigError> {
        match v {
            Some(v) if !v.get_ref().trim().is_empty() => Ok(v.get_ref().clone()),
            _ => ck
                .check(
                    false,
                    &raw.store.span(),
                    || format!("snapshots.{field}"),
                    || format!("snapshots: store = {kind:?} needs `{field}`"),
                )
                .map(|_| String::new()),
        }
    };
    let opt = |v: &Option<Spanned<String>>, d: &str| {
        v.as_ref()
            .map(|s| s.get_ref().clone())
            .unwrap_or_else(|| d.to_owned())
    };
    let store = match kind {
        "local" => SnapshotStore::Local,
        "s3" => SnapshotStore::S3 {
            endpoint: need("endpoint", &raw.endpoint)?,
            region: opt(&raw.region, "us-east-1"),
            bucket: need("bucket", &raw.bucket)?,
            prefix: opt(&raw.prefix, "aviary/"),
            access_key_env: need("access_key_env", &raw.access_key_env)?,
            secret_key_env: need("secret_key_env", &raw.secret_key_env)?,
        },
        "redis" => SnapshotStore::Redis {
            url: need("url", &raw.url)?,
            prefix: opt(&raw.prefix, "aviary"),
        },
        "postgres" => SnapshotStore::Postgres {
            url_env: need("url_env", &raw.url_env)?,
            namespace: opt(&raw.namespace, "aviary"),
        },
        other => {
            ck.check(
                false,
                &raw.store.span(),
                || "snapshots.store".to_owned(),
                || format!("snapshots: store must be local, s3, redis or postgres, got {other:?}"),
            )?;
            SnapshotStore::Local
        }
    };
    Ok(crate::SnapshotSettings { store })
}

fn check_overcommit(
    ck: &Checker<'_>,
    raw: Option<RawOvercommit>,
) -> Result<Overcommit, ConfigError> {
    let mut o = crate::default_overcommit();
    let Some(raw) = raw else {
        return Ok(o);
    };
    for (field, value, slot) in [
        ("cpu_ratio", raw.cpu_ratio, &mut o.cpu_ratio),
        ("memory_ratio", raw.memory_ratio, &mut o.memory_ratio),
    ] {
        if let Some(v) = value {
            let r = *v.get_ref();
            ck.check(
                r.is_finite() && r > 0.0 && r <= 100.0,
                &v.span(),
                || format!("overcommit.{field}"),
                || format!("overcommit: {field} must be > 0 and <= 100, got {r}"),
            )?;
            *slot = r;
        }
    }
    Ok(o)
}

fn check_reconciler(
    ck: &Checker<'_>,
    raw: Option<RawReconciler>,
) -> Result<crate::ReconcilerSettings, ConfigError> {
    let mut r = crate::default_reconciler();
    let Some(raw) = raw else {
        return Ok(r);
    };
    // bounds: a pass at least every day, at most 20 a second; graces up to a day
    for (field, value, slot, lo, hi) in [
        (
            "interval_ms",
            raw.interval_ms,
            &mut r.interval_ms,
            50,
            86_400_000,
        ),
        (
            "orphan_grace_s",
            raw.orphan_grace_s,
            &mut r.orphan_grace_s,
            1,
            86_400,
        ),
        (
            "node_unhealthy_after_s",
            raw.node_unhealthy_after_s,
            &mut r.node_unhealthy_after_s,
            1,
            86_400,
        ),
    ] {
        if let Some(v) = value {
            let n = *v.get_ref();
            ck.check(
                (lo..=hi).contains(&n),
                &v.span(),
                || format!("reconciler.{field}"),
                || format!("reconciler: {field} must be between {lo} and {hi}, got {n}"),
            )?;
            *slot = n;
        }
    }
    Ok(r)
}

/// A DNS label (RFC 1123): what Kubernetes requires of a namespace and a
/// runtime class name.
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn check_kubernetes(
    ck: &Checker<'_>,
    raw: Option<RawKubernetes>,
    server: &ServerSettings,
) -> Result<Option<crate::KubernetesSettings>, ConfigError> {
    use aviary_core::RuntimeName;
    let listed = server.runtimes.contains(&RuntimeName::Kubernetes);
    ck.check(
        server.runtime != RuntimeName::Kubernetes,
        &DEFAULTED,
        || "server.runtime".into(),
        || {
            "server: the default runtime must run on this host (crun or runc); \
             list \"kubernetes\" in runtimes beside it"
                .into()
        },
    )?;
    let Some(raw) = raw else {
        ck.check(
            !listed,
            &DEFAULTED,
            || "kubernetes".into(),
            || "server.runtimes lists \"kubernetes\" but there is no [kubernetes] table".into(),
        )?;
        return Ok(None);
    };
    let ns_span = raw.namespace.span();
    ck.check(
        listed,
        &ns_span,
        || "kubernetes".into(),
        || "[kubernetes] is set but server.runtimes does not list \"kubernetes\"".into(),
    )?;
    let namespace = raw.namespace.into_inner();
    ck.check(
        dns_label(&namespace),
        &ns_span,
        || "kubernetes.namespace".into(),
        || format!("kubernetes: namespace {namespace:?} is not a DNS label (a-z, 0-9, '-', at most 63)"),
    )?;
    let in_cluster = raw.in_cluster.as_ref().is_some_and(|b| *b.get_ref());
    let kubeconfig = match (&raw.kubeconfig, in_cluster) {
        (Some(p), false) => {
            let path = PathBuf::from(p.get_ref());
            ck.check(
                path.is_absolute(),
                &p.span(),
                || "kubernetes.kubeconfig".into(),
                || {
                    format!(
                        "kubernetes: kubeconfig {:?} must be an absolute path",
                        p.get_ref()
                    )
                },
            )?;
            Some(path)
        }
        (None, true) => None,
        (Some(p), true) => {
            return Err(ck.fail(
                &p.span(),
                "kubernetes.kubeconfig".into(),
                "kubernetes: kubeconfig and in_cluster = true exclude each other".into(),
            ))
        }
        (None, false) => {
            return Err(ck.fail(
                &ns_span,
                "kubernetes".into(),
                "kubernetes: give kubeconfig = \"/path\" or in_cluster = true".into(),
            ))
        }
    };
    let context = match raw.context {
        Some(c) => {
            ck.check(
                kubeconfig.is_some() && !c.get_ref().is_empty(),
                &c.span(),
                || "kubernetes.context".into(),
                || "kubernetes: context names a non-empty context of the kubeconfig".into(),
            )?;
            Some(c.into_inner())
        }
        None => None,
    };
    let deployment = match raw.deployment {
        Some(d) => {
            ck.check_name("deployment", "kubernetes.deployment".into(), &d)?;
            ck.check(
                d.get_ref().len() <= 63 && d.get_ref().ends_with(|c: char| c.is_ascii_alphanumeric()),
                &d.span(),
                || "kubernetes.deployment".into(),
                || "kubernetes: deployment must be a label value (at most 63, ending in a letter or digit)".into(),
            )?;
            d.into_inner()
        }
        None => "aviary".into(),
    };
    let runtime_class = match raw.runtime_class {
        Some(rc) => {
            ck.check(
                dns_label(rc.get_ref()),
                &rc.span(),
                || "kubernetes.runtime_class".into(),
                || {
                    format!(
                        "kubernetes: runtime_class {:?} is not a DNS label",
                        rc.get_ref()
                    )
                },
            )?;
            Some(rc.into_inner())
        }
        None => None,
    };
    let images_span = raw.images.span();
    let raw_images = raw.images.into_inner();
    ck.check(
        !raw_images.is_empty(),
        &images_span,
        || "kubernetes.images".into(),
        || "kubernetes: images maps at least one template name to an image".into(),
    )?;
    let mut images = std::collections::BTreeMap::new();
    for (template, image) in raw_images {
        ck.check(
            valid_name(&template, 128),
            &images_span,
            || format!("kubernetes.images.{template}"),
            || format!("kubernetes: {template:?} is not a template name"),
        )?;
        let i = image.get_ref();
        ck.check(
            !i.is_empty() && !i.chars().any(|c| c.is_whitespace() || c.is_control()),
            &image.span(),
            || format!("kubernetes.images.{template}"),
            || format!("kubernetes: image {i:?} is not an image reference"),
        )?;
        images.insert(template, image.into_inner());
    }
    let run_as_user = match raw.run_as_user {
        Some(u) => {
            let n = *u.get_ref();
            ck.check(
                (0..=i64::from(i32::MAX)).contains(&n),
                &u.span(),
                || "kubernetes.run_as_user".into(),
                || {
                    format!(
                        "kubernetes: run_as_user must be between 0 and {}, got {n}",
                        i32::MAX
                    )
                },
            )?;
            n
        }
        None => 1000,
    };
    let mut timeouts = [120u64, 60];
    for (field, value, slot) in [
        ("ready_timeout_s", raw.ready_timeout_s, 0),
        ("delete_timeout_s", raw.delete_timeout_s, 1),
    ] {
        if let Some(v) = value {
            let n = *v.get_ref();
            ck.check(
                (1..=3600).contains(&n),
                &v.span(),
                || format!("kubernetes.{field}"),
                || format!("kubernetes: {field} must be between 1 and 3600, got {n}"),
            )?;
            timeouts[slot] = n;
        }
    }
    let Some(raw_from) = raw.envd_from else {
        return Err(ck.fail(
            &ns_span,
            "kubernetes.envd_from".into(),
            "kubernetes: envd_from lists the CIDRs the control plane reaches Pods from \
             (e.g. [\"10.0.0.0/8\"]): the only sources the sandbox's NetworkPolicy admits, \
             and only to envd's bridge port"
                .into(),
        ));
    };
    let from_span = raw_from.span();
    let envd_from = raw_from.into_inner();
    ck.check(
        !envd_from.is_empty(),
        &from_span,
        || "kubernetes.envd_from".into(),
        || "kubernetes: envd_from names at least one CIDR".into(),
    )?;
    for cidr in &envd_from {
        ck.check(
            is_cidr(cidr),
            &from_span,
            || "kubernetes.envd_from".into(),
            || {
                format!(
                    "kubernetes: envd_from entry {cidr:?} is not a CIDR \
                     (address/prefix, no host bits set, e.g. \"10.0.0.0/8\")"
                )
            },
        )?;
    }
    let envd_port = match raw.envd_port {
        Some(p) => {
            let n = *p.get_ref();
            ck.check(
                (1024..=65535).contains(&n),
                &p.span(),
                || "kubernetes.envd_port".into(),
                || format!("kubernetes: envd_port must be between 1024 and 65535, got {n}"),
            )?;
            u16::try_from(n).unwrap_or(KUBE_ENVD_PORT)
        }
        None => KUBE_ENVD_PORT,
    };
    let relay_dir = match raw.relay_dir {
        Some(d) => {
            let path = PathBuf::from(d.get_ref());
            ck.check(
                path.is_absolute(),
                &d.span(),
                || "kubernetes.relay_dir".into(),
                || {
                    format!(
                        "kubernetes: relay_dir {:?} must be an absolute path",
                        d.get_ref()
                    )
                },
            )?;
            Some(path)
        }
        None => None,
    };
    Ok(Some(crate::KubernetesSettings {
        kubeconfig,
        context,
        namespace,
        deployment,
        runtime_class,
        images,
        run_as_user,
        ready_timeout_s: timeouts[0],
        delete_timeout_s: timeouts[1],
        envd_from,
        envd_port,
        relay_dir,
    }))
}

/// envd's bridge port in a Pod unless `envd_port` says otherwise (the
/// bridge's usual port, `aviary-relay`'s `BRIDGE_PORT`).
const KUBE_ENVD_PORT: u16 = 49_877;

/// `10.0.0.0/8`, `fd00::/8`: an address, a prefix within its family, no
/// host bits set (the form a NetworkPolicy's ipBlock takes).
fn is_cidr(s: &str) -> bool {
    let Some((addr, len)) = s.split_once('/') else {
        return false;
    };
    let Ok(n) = len.parse::<u8>() else {
        return false;
    };
    if n.to_string() != len {
        return false;
    }
    match addr.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(a)) => {
            n <= 32 && u32::from(a).checked_shl(u32::from(n)).unwrap_or(0) == 0
        }
        Ok(std::net::IpAddr::V6(a)) => {
            n <= 128 && u128::from(a).checked_shl(u32::from(n)).unwrap_or(0) == 0
        }
        Err(_) => false,
    }
}

/// Sandbox paths the platform owns (envd and its socket); never projected into.
const PLATFORM_PATHS: [&str; 2] = ["/.aviary", "/run/aviary"];

fn check_projections(
    ck: &Checker<'_>,
    list: Vec<RawProjection>,
) -> Result<Vec<Projection>, ConfigError> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, p) in list.into_iter().enumerate() {
        let key = |field: &str| format!("projection[{i}].{field}");
        let host = PathBuf::from(p.host.get_ref());
        ck.check(
            host.is_absolute() && !p.host.get_ref().contains('\0'),
            &p.host.span(),
            || key("host"),
            || {
                format!(
                    "projection: host {:?} must be an absolute path",
                    p.host.get_ref()
                )
            },
        )?;
        let meta = std::fs::symlink_metadata(&host).map_err(|e| {
            ck.fail(
                &p.host.span(),
                key("host"),
                format!("projection: host {} cannot be read: {e}", host.display()),
            )
        })?;
        ck.check(
            !meta.file_type().is_symlink(),
            &p.host.span(),
            || key("host"),
            || {
                format!(
                    "projection: host {} is a symlink; name the real path instead",
                    host.display()
                )
            },
        )?;
        ck.check(
            meta.is_dir() || meta.is_file(),
            &p.host.span(),
            || key("host"),
            || {
                format!(
                    "projection: host {} is neither a regular file nor a directory",
                    host.display()
                )
            },
        )?;
        let raw_sandbox = p.sandbox.get_ref();
        let sandbox = aviary_core::paths::clean_absolute(raw_sandbox).ok_or_else(|| {
            ck.fail(
                &p.sandbox.span(),
                key("sandbox"),
                format!(
                    "projection: sandbox path {raw_sandbox:?} must be absolute, not `/`, without `.`, `..` or empty components"
                ),
            )
        })?;
        if let Some(owned) = PLATFORM_PATHS
            .iter()
            .find(|o| sandbox == **o || sandbox.starts_with(&format!("{o}/")))
        {
            return Err(ck.fail(
                &p.sandbox.span(),
                key("sandbox"),
                format!("projection: sandbox path {sandbox:?} is inside {owned}, which the platform owns"),
            ));
        }
        ck.check(
            seen.insert(sandbox.clone()),
            &p.sandbox.span(),
            || key("sandbox"),
            || format!("projection: sandbox path {sandbox:?} is a target twice"),
        )?;
        out.push(Projection { host, sandbox });
    }
    Ok(out)
}

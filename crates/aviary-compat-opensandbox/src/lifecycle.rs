//! The OpenSandbox lifecycle API (`/v1` under the surface's prefix), each
//! handler one control-plane operation: create (`ControlPlane::create`:
//! plan → policy → pools), get, list, delete, pause, resume (or wake for a
//! hibernated sandbox), renew-expiration (`set_ttl`), and the endpoints of
//! a sandbox's execd (44772) and egress sidecar (18080).
//!
//! Auth: `OPEN-SANDBOX-API-KEY` is the caller's Aviary API key; the
//! sandboxes are the key's tenant's, another tenant's are `404`.
//!
//! Mapping (README "OpenSandbox SDK"):
//! - `image.uri` names an Aviary template when one has that name; any
//!   other image (`python:3.11-slim`, `default`) gets the default template.
//! - `timeout` (s) is the TTL; `null` makes the sandbox user-managed (no
//!   expiry shown; the platform only ever stops it, never destroys it).
//! - `resourceLimits` `{cpu, memory}` picks the smallest configured class
//!   that holds both; the policy guard still approves it.
//! - `metadata` becomes the sandbox's labels; the keys `aviary.user_id`,
//!   `aviary.session_id` and `aviary.agent` also set Aviary's scope fields.
//! - `env` is the default environment of every command.
//! - States: being made → `Pending`; live → `Running`, or `Paused` when
//!   frozen by pause or hibernated; `Failed`/`Lost` → `Failed`. Terminated
//!   sandboxes are gone (`404`), as after an OpenSandbox delete.

use crate::error::OsbError;
use crate::OsbState;
use aviary_control::requests::{SandboxQuery, SandboxRef};
use aviary_control::{OpContext, OpError};
use aviary_core::api::{CreateSandboxRequest, Sandbox};
use aviary_core::SandboxState;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, RawQuery, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use time::OffsetDateTime;

/// The lifecycle API's key header.
pub const API_KEY_HEADER: &str = "open-sandbox-api-key";
/// The header the endpoints hand out for execd; execd checks it.
pub const EXECD_TOKEN_HEADER: &str = "x-execd-access-token";
/// The header the native port proxy takes a port token in.
pub const PORT_TOKEN_HEADER: &str = "x-aviary-port-token";
/// execd's port in OpenSandbox.
pub const EXECD_PORT: u16 = 44772;
/// The egress sidecar's port in OpenSandbox.
pub const EGRESS_PORT: u16 = 18080;
/// The entrypoint every Aviary sandbox has (it runs no user entrypoint:
/// envd waits for commands), as OpenSandbox spells an idle one.
pub const IDLE_ENTRYPOINT: [&str; 3] = ["tail", "-f", "/dev/null"];
/// Metadata keys that also set Aviary's scope fields.
pub const USER_KEY: &str = "aviary.user_id";
pub const SESSION_KEY: &str = "aviary.session_id";
pub const AGENT_KEY: &str = "aviary.agent";
/// Page size of a list that names none.
pub const DEFAULT_PAGE_SIZE: usize = 100;
pub const MAX_PAGE_SIZE: usize = 1000;

/// The caller of a lifecycle request, from its API key.
pub struct ApiCaller(pub OpContext);

impl FromRequestParts<OsbState> for ApiCaller {
    type Rejection = OsbError;
    async fn from_request_parts(parts: &mut Parts, st: &OsbState) -> Result<Self, OsbError> {
        let key = parts
            .headers
            .get(API_KEY_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim);
        let caller = st.cp.authenticate(key).await?;
        st.admit(&aviary_control::ops::hash_key(key.unwrap_or_default()))?;
        Ok(ApiCaller(
            OpContext::new(caller).with_request_id(crate::request_id(&parts.headers)),
        ))
    }
}

/// A JSON object body (`{}`; never an array), within the JSON limit.
pub(crate) fn json_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, OsbError> {
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(OsbError::invalid("the request body must be a JSON object"));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| OsbError::invalid(format!("invalid request body: {e}")))
}

fn rfc3339(t: OffsetDateTime) -> String {
    aviary_control::ops::rfc3339(t)
}

/// The OpenSandbox state of a sandbox.
pub fn osb_state(sb: &Sandbox) -> &'static str {
    use SandboxState::*;
    match sb.state {
        Requested | Planning | Allocating | Provisioning | Locking | Ready => "Pending",
        Hibernating => "Paused",
        Leased | Running | Idle | ReuseChecking | Recycling | Sanitizing => {
            if sb.paused {
                "Paused"
            } else {
                "Running"
            }
        }
        Terminated => "Terminated",
        Failed | Lost => "Failed",
    }
}

/// The states a list may filter on.
pub const STATES: [&str; 8] = [
    "Pending",
    "Running",
    "Pausing",
    "Paused",
    "Resuming",
    "Stopping",
    "Terminated",
    "Failed",
];

/// A sandbox as OpenSandbox shows it.
pub fn sandbox_json(sb: &Sandbox) -> Value {
    let expires = if sb.user_managed {
        Value::Null
    } else {
        sb.expires_at
            .map(rfc3339)
            .map_or(Value::Null, Value::String)
    };
    json!({
        "id": sb.id.to_string(),
        "image": {"uri": sb.template},
        "status": {"state": osb_state(sb), "reason": format!("aviary:{}", sb.state)},
        "entrypoint": IDLE_ENTRYPOINT,
        "metadata": sb.metadata,
        "createdAt": rfc3339(sb.created_at),
        "expiresAt": expires,
    })
}

/// `POST /v1/sandboxes`
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CreateBody {
    #[serde(default)]
    image: Option<ImageSpec>,
    /// Seconds; `null` (or absent): no expiry.
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    resource_limits: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    /// Everything else: accepted only when it asks for nothing Aviary
    /// would silently not do.
    #[serde(flatten)]
    rest: BTreeMap<String, Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ImageSpec {
    uri: String,
    #[serde(default)]
    auth: Option<Value>,
}

/// Fields with no Aviary meaning that a create may carry harmlessly.
const IGNORED_FIELDS: [&str; 3] = ["secureAccess", "platform", "extensions"];

/// A CPU quantity: `1`, `0.5`, `500m`.
pub fn parse_cpu(s: &str) -> Result<f64, OsbError> {
    let s = s.trim();
    let v = match s.strip_suffix('m') {
        Some(milli) => milli.parse::<f64>().map(|m| m / 1000.0),
        None => s.parse::<f64>(),
    }
    .ok()
    .filter(|v| v.is_finite() && *v > 0.0)
    .ok_or_else(|| OsbError::invalid(format!("cpu {s:?} is not a CPU quantity (1, 0.5, 500m)")))?;
    Ok(v)
}

/// A memory quantity in MiB: `2Gi`, `512Mi`, `1G`, `1000M`, or bytes.
pub fn parse_memory_mb(s: &str) -> Result<u64, OsbError> {
    let s = s.trim();
    let bad = || OsbError::invalid(format!("memory {s:?} is not a quantity (2Gi, 512Mi, 1G)"));
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| bad())?;
    let bytes_per: f64 = match unit {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0f64.powi(4),
        "K" | "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        _ => return Err(bad()),
    };
    let mb = (n * bytes_per / (1024.0 * 1024.0)).ceil();
    if !mb.is_finite() || mb <= 0.0 || mb > 1e12 {
        return Err(bad());
    }
    Ok(mb as u64)
}

/// The smallest configured class (not a GPU one) holding `limits`.
pub fn class_for(
    classes: &[ClassSize],
    limits: &BTreeMap<String, String>,
) -> Result<String, OsbError> {
    let mut cpu = 0.0;
    let mut memory_mb = 0;
    for (k, v) in limits {
        match k.as_str() {
            "cpu" => cpu = parse_cpu(v)?,
            "memory" => memory_mb = parse_memory_mb(v)?,
            other => {
                return Err(OsbError::invalid(format!(
                    "resourceLimits.{other} is not supported (cpu and memory are)"
                )))
            }
        }
    }
    classes
        .iter()
        .filter(|c| !c.gpu && c.cpu + 1e-9 >= cpu && c.memory_mb >= memory_mb)
        .min_by(|a, b| a.cpu.total_cmp(&b.cpu).then(a.memory_mb.cmp(&b.memory_mb)))
        .map(|c| c.name.clone())
        .ok_or_else(|| {
            OsbError::invalid(format!(
                "no resource class holds cpu {cpu} and memory {memory_mb} MiB"
            ))
        })
}

/// A configured class's size, as [`class_for`] compares it.
#[derive(Clone, Debug)]
pub struct ClassSize {
    pub name: String,
    pub cpu: f64,
    pub memory_mb: u64,
    pub gpu: bool,
}

fn classes(st: &OsbState) -> Vec<ClassSize> {
    st.cp
        .cfg
        .settings
        .classes
        .iter()
        .map(|c| ClassSize {
            name: c.name.clone(),
            cpu: c.cpu,
            memory_mb: c.memory_mb,
            gpu: c.gpu,
        })
        .collect()
}

pub(crate) async fn create(
    State(st): State<OsbState>,
    ApiCaller(cx): ApiCaller,
    body: Bytes,
) -> Result<Response, OsbError> {
    let body: CreateBody = json_body(&body)?;
    for (k, v) in &body.rest {
        let harmless = IGNORED_FIELDS.contains(&k.as_str())
            || v.is_null()
            || (k == "secureAccess" && v == &Value::Bool(false));
        if !harmless {
            return Err(OsbError::invalid(format!(
                "{k} is not supported by Aviary's OpenSandbox surface"
            )));
        }
    }
    if let Some(ep) = &body.entrypoint {
        let idle = ep.iter().map(String::as_str).eq(IDLE_ENTRYPOINT)
            || ep.iter().map(String::as_str).eq(["sleep", "infinity"]);
        if !idle {
            return Err(OsbError::invalid(
                "Aviary sandboxes run no entrypoint of their own; leave entrypoint unset and \
                 start the process with commands.run",
            ));
        }
    }
    let template = match &body.image {
        None => None,
        Some(img) => {
            if img.auth.as_ref().is_some_and(|a| !a.is_null()) {
                return Err(OsbError::invalid(
                    "image.auth is not supported: Aviary runs its own templates, it pulls no image",
                ));
            }
            let known = st.cp.templates(&cx).await?;
            known
                .iter()
                .find(|t| t.name == img.uri)
                .map(|t| t.name.clone())
        }
    };
    let class = match &body.resource_limits {
        Some(l) if !l.is_empty() => Some(class_for(&classes(&st), l)?),
        _ => None,
    };
    let metadata = body.metadata.unwrap_or_default();
    let label = |k: &str| metadata.get(k).cloned();
    let req = CreateSandboxRequest {
        template,
        class,
        user_id: label(USER_KEY),
        session_id: label(SESSION_KEY),
        agent: label(AGENT_KEY),
        ttl_s: body.timeout,
        user_managed: body.timeout.is_none(),
        ..Default::default()
    };
    let mut req = req;
    req.metadata = metadata;
    req.env = body.env.unwrap_or_default();
    aviary_control::validate::create_request(&req)?;
    let created = st.cp.create(&cx, req).await?;
    let sb = created.sandbox;
    let location = format!("{}/v1/sandboxes/{}", st.settings.prefix, sb.id);
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, location)],
        Json(sandbox_json(&sb)),
    )
        .into_response())
}

/// The sandbox, unless it has ended (an ended sandbox is gone for
/// OpenSandbox clients).
async fn live_sandbox(st: &OsbState, cx: &OpContext, id: &str) -> Result<Sandbox, OsbError> {
    let sb = st.cp.get(cx, SandboxRef::new(id)).await?;
    if sb.state == SandboxState::Terminated {
        return Err(OpError::NotFound(format!("sandbox {id}")).into());
    }
    Ok(sb)
}

pub(crate) async fn get(
    State(st): State<OsbState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
) -> Result<Json<Value>, OsbError> {
    Ok(Json(sandbox_json(&live_sandbox(&st, &cx, &id).await?)))
}

/// A list's filters and page, from its query string (`state` repeats).
#[derive(Debug, Default, PartialEq)]
pub struct ListFilter {
    pub states: Vec<String>,
    pub metadata: BTreeMap<String, String>,
    pub page: usize,
    pub page_size: usize,
}

impl ListFilter {
    pub fn parse(query: Option<&str>) -> Result<ListFilter, OsbError> {
        let mut f = ListFilter {
            page: 1,
            page_size: DEFAULT_PAGE_SIZE,
            ..Default::default()
        };
        let number = |k: &str, v: &str, max: usize| {
            v.parse::<usize>()
                .ok()
                .filter(|n| (1..=max).contains(n))
                .ok_or_else(|| OsbError::invalid(format!("{k} must be between 1 and {max}")))
        };
        for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match &*k {
                "state" => {
                    // one value or several comma-joined
                    for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                        if !STATES.contains(&s) {
                            return Err(OsbError::invalid(format!(
                                "unknown state {s:?} (one of {})",
                                STATES.join(", ")
                            )));
                        }
                        f.states.push(s.to_owned());
                    }
                }
                "metadata" => {
                    for (mk, mv) in form_urlencoded::parse(v.as_bytes()) {
                        if mk.is_empty() {
                            return Err(OsbError::invalid("a metadata filter key is empty"));
                        }
                        f.metadata.insert(mk.into_owned(), mv.into_owned());
                    }
                }
                "page" => f.page = number("page", &v, usize::MAX / MAX_PAGE_SIZE)?,
                "pageSize" => f.page_size = number("pageSize", &v, MAX_PAGE_SIZE)?,
                other => {
                    return Err(OsbError::invalid(format!(
                        "unknown query parameter {other:?}"
                    )))
                }
            }
        }
        Ok(f)
    }

    /// Whether the sandbox passes the state and metadata filters.
    pub fn admits(&self, sb: &Sandbox) -> bool {
        (self.states.is_empty() || self.states.iter().any(|s| s == osb_state(sb)))
            && self
                .metadata
                .iter()
                .all(|(k, v)| sb.metadata.get(k) == Some(v))
    }
}

/// One page of `sandboxes` (newest first) with the five pagination keys.
pub fn page_of(mut sandboxes: Vec<Sandbox>, f: &ListFilter) -> Value {
    sandboxes.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(b.id.cmp(&a.id)));
    let total = sandboxes.len();
    let pages = total.div_ceil(f.page_size);
    let items: Vec<Value> = sandboxes
        .iter()
        .skip((f.page - 1).saturating_mul(f.page_size))
        .take(f.page_size)
        .map(sandbox_json)
        .collect();
    json!({
        "items": items,
        "pagination": {
            "page": f.page,
            "pageSize": f.page_size,
            "totalItems": total,
            "totalPages": pages,
            "hasNextPage": f.page < pages,
        }
    })
}

pub(crate) async fn list(
    State(st): State<OsbState>,
    ApiCaller(cx): ApiCaller,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, OsbError> {
    let f = ListFilter::parse(query.as_deref())?;
    let query = SandboxQuery {
        metadata: f.metadata.clone(),
        ..Default::default()
    };
    let all = st.cp.list(&cx, query).await?;
    let admitted = all.into_iter().filter(|s| f.admits(s)).collect();
    Ok(Json(page_of(admitted, &f)))
}

pub(crate) async fn delete(
    State(st): State<OsbState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
) -> Result<StatusCode, OsbError> {
    live_sandbox(&st, &cx, &id).await?;
    st.cp.delete(&cx, SandboxRef::new(id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Pause freezes every process (Aviary's pause: memory and files kept);
/// it is done when the call returns, so the sandbox reads `Paused` at once.
pub(crate) async fn pause(
    State(st): State<OsbState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
) -> Result<StatusCode, OsbError> {
    let sb = live_sandbox(&st, &cx, &id).await?;
    if osb_state(&sb) != "Running" {
        return Err(OpError::InvalidState {
            state: sb.state,
            what: format!(
                "only a Running sandbox can be paused (it is {})",
                osb_state(&sb)
            ),
        }
        .into());
    }
    st.cp.pause(&cx, SandboxRef::new(id)).await?;
    Ok(StatusCode::ACCEPTED)
}

/// Resume thaws a paused sandbox, or wakes a hibernated one (from its
/// snapshot, same id).
pub(crate) async fn resume(
    State(st): State<OsbState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
) -> Result<StatusCode, OsbError> {
    let sb = live_sandbox(&st, &cx, &id).await?;
    if sb.state == SandboxState::Hibernating {
        st.cp.wake(&cx, SandboxRef::new(id)).await?;
    } else if sb.paused {
        st.cp.resume(&cx, SandboxRef::new(id)).await?;
    } else {
        return Err(OpError::InvalidState {
            state: sb.state,
            what: format!(
                "only a Paused sandbox can be resumed (it is {})",
                osb_state(&sb)
            ),
        }
        .into());
    }
    Ok(StatusCode::ACCEPTED)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RenewBody {
    expires_at: String,
}

/// Seconds from `now` until `expires_at` (RFC 3339), rounded up; the time
/// must be in the future.
pub fn ttl_until(expires_at: &str, now: OffsetDateTime) -> Result<u64, OsbError> {
    let at = OffsetDateTime::parse(expires_at, &time::format_description::well_known::Rfc3339)
        .map_err(|e| OsbError::invalid(format!("expiresAt {expires_at:?} is not RFC 3339: {e}")))?;
    let left = at - now;
    if left <= time::Duration::ZERO {
        return Err(OsbError::invalid(format!(
            "expiresAt {expires_at} is not in the future"
        )));
    }
    let secs = left.whole_seconds() + i64::from(left.subsec_nanoseconds() > 0);
    u64::try_from(secs).map_err(|_| OsbError::invalid("expiresAt is too far away"))
}

pub(crate) async fn renew(
    State(st): State<OsbState>,
    ApiCaller(cx): ApiCaller,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, OsbError> {
    let body: RenewBody = json_body(&body)?;
    let ttl_s = ttl_until(&body.expires_at, aviary_core::now())?;
    let sb = live_sandbox(&st, &cx, &id).await?;
    if sb.user_managed {
        return Err(OpError::InvalidState {
            state: sb.state,
            what: "it was created without a timeout (manual cleanup) and has no expiration".into(),
        }
        .into());
    }
    let sb = st
        .cp
        .set_ttl(
            &cx,
            aviary_control::requests::SetTtlRequest {
                id: id.clone(),
                ttl_s,
            },
        )
        .await?;
    let expires = sb.expires_at.map(rfc3339);
    Ok(Json(json!({ "expiresAt": expires })))
}

/// `GET /v1/sandboxes/{id}/endpoints/{port}`: where execd (44772) and
/// the egress sidecar (18080) of the sandbox answer, on this server under
/// the surface's prefix, with the header execd checks; any other port is
/// the native port proxy (`/v1/sandboxes/{id}/ports/{port}`, which reaches
/// `127.0.0.1:port` in the sandbox) with that port's token header.
pub(crate) async fn endpoint(
    State(st): State<OsbState>,
    ApiCaller(cx): ApiCaller,
    Path((id, port)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<Value>, OsbError> {
    let sb = live_sandbox(&st, &cx, &id).await?;
    let service = match port.parse::<u16>() {
        Ok(EXECD_PORT) => "execd",
        Ok(EGRESS_PORT) => "egress",
        _ => {
            let target = aviary_control::ports::PortRequest::parse(sb.id.as_str(), &port)?;
            let host = request_host(&headers)?;
            let token = st.cp.port_token(&cx, &target).await?;
            return Ok(Json(json!({
                "endpoint": format!("{host}/v1/sandboxes/{}/ports/{}", sb.id, target.port),
                "headers": { PORT_TOKEN_HEADER.to_ascii_uppercase(): token },
            })));
        }
    };
    let host = request_host(&headers)?;
    let token = st.cp.sandbox_access_token(&cx, sb.id.as_str()).await?;
    Ok(Json(json!({
        "endpoint": format!("{host}{}/sandboxes/{}/{service}", st.settings.prefix, sb.id),
        "headers": { EXECD_TOKEN_HEADER.to_ascii_uppercase(): token },
    })))
}

/// The authority the client reached this server at (its `Host`), checked
/// to be a plain `host[:port]`.
fn request_host(headers: &HeaderMap) -> Result<String, OsbError> {
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| OsbError::invalid("the request has no Host header"))?;
    let plain = !host.is_empty()
        && host.len() <= 255
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'));
    if plain {
        Ok(host.to_owned())
    } else {
        Err(OsbError::invalid("the Host header is not a host[:port]"))
    }
}

/// `POST /v1/metrics/events`: the SDK's fire-and-forget create metrics.
/// Accepted from an authenticated caller and dropped (Aviary records its
/// own create events).
pub(crate) async fn metrics_event(ApiCaller(_cx): ApiCaller) -> StatusCode {
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_filters_parse_repeated_states_metadata_and_pages() {
        let f = ListFilter::parse(Some(
            "state=Running&state=Paused&metadata=agentscope.workspace.id%3Dw1%26team%3Da%2520b&page=2&pageSize=50",
        ))
        .unwrap();
        assert_eq!(f.states, ["Running", "Paused"]);
        assert_eq!(f.metadata.get("agentscope.workspace.id").unwrap(), "w1");
        // the SDK quotes values once more; that layer is decoded
        assert_eq!(f.metadata.get("team").unwrap(), "a b");
        assert_eq!((f.page, f.page_size), (2, 50));
        let d = ListFilter::parse(None).unwrap();
        assert_eq!((d.page, d.page_size), (1, DEFAULT_PAGE_SIZE));
        assert!(d.states.is_empty() && d.metadata.is_empty());
        for bad in [
            "state=running",
            "state=Bogus",
            "page=0",
            "pageSize=0",
            "pageSize=100000",
            "page=x",
            "limit=3",
            "metadata=%3Dv",
        ] {
            assert_eq!(
                ListFilter::parse(Some(bad)).unwrap_err().status(),
                400,
                "{bad}"
            );
        }
    }

    #[test]
    fn quantities_and_classes() {
        assert_eq!(parse_cpu("1").unwrap(), 1.0);
        assert_eq!(parse_cpu("500m").unwrap(), 0.5);
        assert_eq!(parse_memory_mb("2Gi").unwrap(), 2048);
        assert_eq!(parse_memory_mb("512Mi").unwrap(), 512);
        assert_eq!(parse_memory_mb("1G").unwrap(), 954);
        for bad in ["", "x", "-1", "0", "1Qi"] {
            parse_memory_mb(bad).unwrap_err();
        }
        for bad in ["", "x", "-1", "0", "NaN"] {
            parse_cpu(bad).unwrap_err();
        }
        let c = |name: &str, cpu: f64, memory_mb: u64, gpu: bool| ClassSize {
            name: name.into(),
            cpu,
            memory_mb,
            gpu,
        };
        let classes = [
            c("big", 8.0, 16384, false),
            c("small", 1.0, 2048, false),
            c("gpu", 2.0, 4096, true),
            c("mid", 2.0, 4096, false),
        ];
        let limits = |cpu: &str, mem: &str| {
            BTreeMap::from([
                ("cpu".to_owned(), cpu.to_owned()),
                ("memory".to_owned(), mem.to_owned()),
            ])
        };
        assert_eq!(class_for(&classes, &limits("1", "2Gi")).unwrap(), "small");
        assert_eq!(
            class_for(&classes, &limits("500m", "512Mi")).unwrap(),
            "small"
        );
        assert_eq!(class_for(&classes, &limits("2", "1Gi")).unwrap(), "mid");
        assert_eq!(class_for(&classes, &limits("1", "8Gi")).unwrap(), "big");
        assert_eq!(
            class_for(&classes, &limits("64", "1Gi"))
                .unwrap_err()
                .status(),
            400
        );
        let gpu = BTreeMap::from([("nvidia.com/gpu".to_owned(), "1".to_owned())]);
        assert_eq!(class_for(&classes, &gpu).unwrap_err().status(), 400);
    }

    #[test]
    fn renew_times_must_be_future_rfc3339() {
        let now = time::macros::datetime!(2026-11-29 16:39:13 UTC);
        assert_eq!(
            ttl_until("2026-11-29T17:09:13.411528+00:00", now).unwrap(),
            1801
        );
        assert_eq!(ttl_until("2026-11-29T17:09:13Z", now).unwrap(), 1800);
        assert_eq!(
            ttl_until("2026-11-29T16:00:00+00:00", now)
                .unwrap_err()
                .status(),
            400
        );
        assert_eq!(ttl_until("tomorrow", now).unwrap_err().status(), 400);
    }
}

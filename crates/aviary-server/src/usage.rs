//! A sandbox's live resource usage over HTTP: `GET /v1/sandboxes/{id}/usage`
//! (`all_tenants=true`: an admin reading any tenant's sandbox, as `get`).
//! The handler is thin: extract, build the context, call one operation.

use crate::error::ApiError;
use crate::http::{op_context, ApiQuery, AppState, Auth, TokenFrom};
use aviary_control::requests::UsageRequest;
use aviary_core::api::SandboxUsage;
use aviary_core::ErrorBody;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/sandboxes/{id}/usage", get(usage))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct UsageQuery {
    /// Find the sandbox in any tenant (read only): admin keys only; any
    /// other key is refused with 403 `forbidden`.
    #[serde(default)]
    all_tenants: bool,
}

/// The sandbox's live resource usage: memory, CPU time, processes and
/// (when the runtime knows it) disk, beside its class's limits, read from
/// its runtime now. A sandbox that holds no compute (hibernated, ended) is
/// 409 `invalid_state`; a paused one answers with counters that stand still.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/usage",
    params(("id" = String, Path, description = "sandbox id", max_length = 64), UsageQuery),
    responses((status = 200, body = SandboxUsage),
              (status = 403, description = "`all_tenants` with a key that is not an admin key", body = ErrorBody),
              (status = 404, body = ErrorBody),
              (status = 409, description = "the sandbox holds no compute now (`invalid_state`, `sandbox_lost`)", body = ErrorBody)),
    security(("api_key" = [])))]
pub(crate) async fn usage(
    State(st): State<AppState>,
    auth: Auth,
    headers: HeaderMap,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<UsageQuery>,
) -> Result<Json<SandboxUsage>, ApiError> {
    let cx = op_context(auth, &headers, TokenFrom::Unfenced)?;
    let req = UsageRequest {
        id,
        all_tenants: q.all_tenants,
    };
    Ok(Json(st.sandbox_usage(&cx, req).await?))
}

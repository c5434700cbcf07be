//! The HTTP/JSON API of `rlaunch-rendezvous` (axum): routes, auth, body limits, error mapping.
//!
//! Routes (every body JSON; every `/v1` route behind the optional bearer token):
//!
//! | method, path | body | answer |
//! |---|---|---|
//! | `POST /v1/jobs/{run_id}/join` | `{settings, node, wait_ms?}` | `{"status":"round","data":RoundInfo}` or `{"status":"wait","data":{round,state}}` |
//! | `POST /v1/jobs/{run_id}/heartbeat` | `{node_id, sent?: {seq, slow}, probes?: [{node_id, reached}]}` | `{probe?: [{node_id, addr}]}`: probes owed |
//! | `POST /v1/jobs/{run_id}/watch` | `{after_round, wait_ms?}` | `{"event":"new_round","data":N}` / `finished` / `failed` / `no_change` |
//! | `POST /v1/jobs/{run_id}/failure` | `{node_id, round, root_cause}` | `{}` |
//! | `POST /v1/jobs/{run_id}/success` | `{node_id, round}` | `{}` |
//! | `POST /v1/jobs/{run_id}/leave` | `{node_id}` | `{}` |
//! | `GET /v1/jobs/{run_id}` | | `JobStatus` |
//! | `GET /v1/jobs` | | `[JobStatus]` |
//! | `GET /healthz` | | `ok` |
//! | `GET /metrics` | | Prometheus text |
//!
//! Errors: `{"error": code, "message": text}` with 400 (bad input), 401 (token), 404 (unknown job
//! or node), 409 (not a member, settings mismatch), 410 (job over), 413 (body too large); a 5xx
//! logs its cause and says only "internal error".

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tracing::error;

use crate::error::RdzvError;
use crate::round::{JobSettings, NodeInfo};
use crate::service::{Beat, HeartbeatAnswer, JoinAnswer, Rendezvous, WatchEvent};

/// Largest request body accepted (a root cause with a stderr tail fits easily).
pub const DEFAULT_BODY_LIMIT: usize = 256 * 1024;
/// How long join and watch long-polls wait when the client does not say.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(10);

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    pub rdzv: Arc<Rendezvous>,
    pub token: Option<Arc<str>>,
    pub body_limit: usize,
    /// `/metrics` needs the token too (it names every job and node).
    pub protect_metrics: bool,
}

impl AppState {
    pub fn new(rdzv: Arc<Rendezvous>, token: Option<String>) -> Self {
        Self { rdzv, token: token.map(Arc::from), body_limit: DEFAULT_BODY_LIMIT, protect_metrics: false }
    }
}

/// Body of a join request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinRequest {
    pub settings: JobSettings,
    pub node: NodeInfo,
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRequest {
    pub node_id: String,
}

/// Body of a heartbeat: the node, its counter and the outcomes of probes it was asked for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeartbeatRequest {
    pub node_id: String,
    #[serde(flatten)]
    pub beat: Beat,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WatchRequest {
    pub after_round: u64,
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailureRequest {
    pub node_id: String,
    pub round: u64,
    pub root_cause: Box<crate::round::RootCause>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SuccessRequest {
    pub node_id: String,
    pub round: u64,
}

/// Error body of every non-2xx answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    pub message: String,
}

/// An error on its way to becoming an HTTP answer.
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl From<RdzvError> for ApiError {
    fn from(e: RdzvError) -> Self {
        let status = match &e {
            RdzvError::InvalidSettings(_) | RdzvError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            RdzvError::Unauthorized => StatusCode::UNAUTHORIZED,
            RdzvError::UnknownJob { .. } | RdzvError::UnknownNode { .. } => StatusCode::NOT_FOUND,
            RdzvError::NotMember { .. } | RdzvError::SettingsMismatch { .. } => StatusCode::CONFLICT,
            RdzvError::JobFinished | RdzvError::JobFailed { .. } | RdzvError::JoinTimeout { .. } => StatusCode::GONE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status.is_server_error() {
            error!(error = %e, source = ?std::error::Error::source(&e), "request failed");
            return ApiError { status, code: "internal", message: "internal error".to_owned() };
        }
        // Messages of job failures carry the bare reason, so the client can rebuild the error.
        let message = match &e {
            RdzvError::JobFailed { reason } | RdzvError::JoinTimeout { reason } => reason.clone(),
            other => other.to_string(),
        };
        ApiError { status, code: e.code(), message }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: self.code.to_owned(), message: self.message };
        (self.status, Json(body)).into_response()
    }
}

/// `Json<T>` whose rejections (syntax, missing fields, wrong content type, too large) become
/// our JSON error bodies.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

fn json_rejection(r: JsonRejection) -> ApiError {
    let status = r.status();
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        _ => "bad_request",
    };
    // Some rejections (e.g. a body that failed to buffer) are 4xx too; never 5xx here.
    let status = if status.is_client_error() { status } else { StatusCode::BAD_REQUEST };
    ApiError { status, code, message: r.body_text() }
}

type ApiResult<T> = Result<Json<T>, ApiError>;

#[derive(Serialize)]
struct Empty {}

fn wait_of(ms: Option<u64>) -> Duration {
    ms.map(Duration::from_millis).unwrap_or(DEFAULT_WAIT)
}

async fn join(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<JoinRequest>,
) -> ApiResult<JoinAnswer> {
    Ok(Json(app.rdzv.join(&run_id, &req.settings, req.node, wait_of(req.wait_ms)).await?))
}

async fn heartbeat(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<HeartbeatRequest>,
) -> ApiResult<HeartbeatAnswer> {
    Ok(Json(app.rdzv.heartbeat(&run_id, &req.node_id, req.beat).await?))
}

async fn watch(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<WatchRequest>,
) -> ApiResult<WatchEvent> {
    Ok(Json(app.rdzv.watch(&run_id, req.after_round, wait_of(req.wait_ms)).await?))
}

async fn failure(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<FailureRequest>,
) -> ApiResult<Empty> {
    app.rdzv.report_failure(&run_id, &req.node_id, req.round, req.root_cause).await?;
    Ok(Json(Empty {}))
}

async fn success(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<SuccessRequest>,
) -> ApiResult<Empty> {
    app.rdzv.report_success(&run_id, &req.node_id, req.round).await?;
    Ok(Json(Empty {}))
}

async fn leave(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<NodeRequest>,
) -> ApiResult<Empty> {
    app.rdzv.leave(&run_id, &req.node_id).await?;
    Ok(Json(Empty {}))
}

async fn status(State(app): State<AppState>, Path(run_id): Path<String>) -> ApiResult<crate::round::JobStatus> {
    Ok(Json(app.rdzv.status(&run_id).await?))
}

async fn list(State(app): State<AppState>) -> ApiResult<Vec<crate::round::JobStatus>> {
    Ok(Json(app.rdzv.list().await?))
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn metrics(State(app): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.rdzv.metrics_text().await)
}

/// Constant-time comparison, so the token cannot be guessed byte by byte from timings.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn require_token(State(app): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(token) = &app.token {
        // The scheme is case-insensitive (RFC 9110 §11.1); the token is not.
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim_start())
        });
        if !given.is_some_and(|g| same(g.as_bytes(), token.as_bytes())) {
            return ApiError::from(RdzvError::Unauthorized).into_response();
        }
    }
    next.run(req).await
}

async fn not_found() -> ApiError {
    ApiError { status: StatusCode::NOT_FOUND, code: "not_found", message: "no such route".to_owned() }
}

/// The application: every route, the token check and the body limit.
pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/jobs", get(list))
        .route("/v1/jobs/{run_id}", get(status))
        .route("/v1/jobs/{run_id}/join", post(join))
        .route("/v1/jobs/{run_id}/heartbeat", post(heartbeat))
        .route("/v1/jobs/{run_id}/watch", post(watch))
        .route("/v1/jobs/{run_id}/failure", post(failure))
        .route("/v1/jobs/{run_id}/success", post(success))
        .route("/v1/jobs/{run_id}/leave", post(leave))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    let metrics_route = if state.protect_metrics {
        Router::new()
            .route("/metrics", get(metrics))
            .route_layer(middleware::from_fn_with_state(state.clone(), require_token))
    } else {
        Router::new().route("/metrics", get(metrics))
    };
    Router::new()
        .merge(v1)
        .merge(metrics_route)
        .route("/healthz", get(healthz))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state)
}

/// Serves the API on `listener` until `shutdown` resolves, then lets requests in flight finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}

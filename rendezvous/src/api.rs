//! The HTTP/JSON API of `rlaunch-rendezvous` (axum): routes, auth, body limits, error mapping.
//!
//! Routes (every body JSON; every `/v1` route behind the optional bearer token):
//!
//! | method, path | body | answer |
//! |---|---|---|
//! | `POST /v1/jobs/{run_id}/join` | `{settings, node, secret?, members?, wait_ms?}` | `{"status":"round","data":RoundInfo,"secret":S}` (the member list only with `members: true`) or `{"status":"wait","data":{round,state},"secret":S}` |
//! | `POST /v1/jobs/{run_id}/heartbeat` | `{node_id, secret, sent?: {seq, slow}, probes?: [{node_id, reached}]}` | `{probe?: [{node_id, addr}]}`: probes owed |
//! | `POST /v1/jobs/{run_id}/watch` | `{after_round, node_id?, secret?, wait_ms?}` | `{"event":"new_round","data":N}` / `finished` / `failed` / `no_change` |
//! | `POST /v1/jobs/{run_id}/failure` | `{node_id, secret, round, root_cause}` | `{}` |
//! | `POST /v1/jobs/{run_id}/stacks` | `{node_id, secret, round, stacks: [line]}` | `{}`: where the node's ranks stood when `round` failed, merged into the last root cause |
//! | `POST /v1/jobs/{run_id}/success` | `{node_id, secret, round}` | `{}` |
//! | `POST /v1/jobs/{run_id}/leave` | `{node_id, secret}` | `{}` |
//! | `GET /v1/jobs/{run_id}` | | `JobStatus` |
//! | `GET /v1/jobs` | | `[JobStatus]` |
//! | `GET /healthz` | | `ok` |
//! | `GET /metrics` | | Prometheus text |
//! | `GET /`, `/page.js`, `/page.css` | | the status page ([`crate::page`]): no data, it reads `/v1` with the token |
//!
//! Node identity: a node's first join answers a secret (256 random bits, hex); every later call
//! for the node carries it as `secret` (a re-join too), or is refused with 403 whatever else the
//! caller knows. A node the job forgot (lost, left) joins afresh and gets a new one.
//!
//! Errors: `{"error": code, "message": text}` with 400 (bad input, a setting out of bounds),
//! 401 (token), 403 (not the node's secret), 404 (unknown job or node), 409 (not a member,
//! settings mismatch), 410 (job over), 413 (body too large), 429 (a bound of the service: jobs,
//! nodes per job); a 5xx logs its cause and says only "internal error".

use std::collections::BTreeMap;
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
use tracing::{debug, error, warn};

use crate::error::RdzvError;
use crate::round::{JobSettings, NodeInfo};
use crate::service::{Beat, HeartbeatAnswer, Joined, Rendezvous, WatchEvent};

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
    /// Take the addresses a join advertises as given, whatever address the join came from
    /// (`--trust-advertised-addrs`: behind NAT or a proxy that is not on the service's host).
    /// Otherwise a node may advertise only the address its join came from
    /// ([`crate::round::check_advertised`]), known when the server records each request's
    /// peer as `ConnectInfo<SocketAddr>`.
    pub trust_advertised_addrs: bool,
}

impl AppState {
    pub fn new(rdzv: Arc<Rendezvous>, token: Option<String>) -> Self {
        Self {
            rdzv,
            token: token.map(Arc::from),
            body_limit: DEFAULT_BODY_LIMIT,
            protect_metrics: false,
            trust_advertised_addrs: false,
        }
    }
}

/// Body of a join request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinRequest {
    pub settings: JobSettings,
    pub node: NodeInfo,
    /// The secret an earlier join answered (none for a node's first join).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::identity::Secret>,
    /// For a node's first join: the secret it asks to be keyed with (64 lowercase hex digits,
    /// random), so that a first answer lost on the way (a timeout) costs nothing: the retry
    /// proposes the same and is its own retry, not a stranger using the node's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proposed_secret: Option<crate::identity::Secret>,
    /// Whether the answer should list every member (an agent needs only its own placement
    /// and the digest).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub members: bool,
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRequest {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::identity::Secret>,
}

/// Body of a heartbeat: the node, its counter and the outcomes of probes it was asked for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeartbeatRequest {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::identity::Secret>,
    #[serde(flatten)]
    pub beat: Beat,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WatchRequest {
    pub after_round: u64,
    /// The watching node and its secret (an anonymous watch only learns round numbers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::identity::Secret>,
    #[serde(default)]
    pub wait_ms: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailureRequest {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::identity::Secret>,
    pub round: u64,
    pub root_cause: Box<crate::round::RootCause>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StacksRequest {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::identity::Secret>,
    pub round: u64,
    pub stacks: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProgressRequest {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::identity::Secret>,
    pub round: u64,
    pub progress: rlaunch::contract::NodeProgress,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SuccessRequest {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<crate::identity::Secret>,
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
            RdzvError::Forbidden { .. } => StatusCode::FORBIDDEN,
            RdzvError::LimitReached { .. } => StatusCode::TOO_MANY_REQUESTS,
            RdzvError::UnknownJob { .. } | RdzvError::UnknownNode { .. } => StatusCode::NOT_FOUND,
            RdzvError::NotMember { .. }
            | RdzvError::SettingsMismatch { .. }
            | RdzvError::FingerprintMismatch { .. } => StatusCode::CONFLICT,
            RdzvError::JobFinished | RdzvError::JobFailed { .. } | RdzvError::JoinTimeout { .. } => StatusCode::GONE,
            RdzvError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if let RdzvError::Busy { message } = &e {
            // Said to the client as it is (nothing internal in it), and not logged per request.
            return ApiError { status, code: e.code(), message: message.clone() };
        }
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
    peer: Option<axum::Extension<axum::extract::ConnectInfo<std::net::SocketAddr>>>,
    ApiJson(mut req): ApiJson<JoinRequest>,
) -> ApiResult<Joined> {
    // Others connect to the addresses a node advertises: it may name only itself.
    if let Some(axum::Extension(axum::extract::ConnectInfo(peer))) = peer.filter(|_| !app.trust_advertised_addrs) {
        if !crate::round::canonical_ip(peer.ip()).is_loopback() {
            let resolved = resolve_names(&req.node).await?;
            crate::round::check_advertised(&req.node, peer.ip(), &resolved).map_err(RdzvError::from)?;
            // The others will reach the node at the address it joined from, not at whatever the
            // name resolves to later (a name with several addresses, or rebound).
            crate::round::pin_advertised_names(&mut req.node, peer.ip());
        }
    }
    let secret = req.secret.as_deref();
    let proposed = req.proposed_secret.as_deref();
    let wait = wait_of(req.wait_ms);
    Ok(Json(app.rdzv.join_proposing(&run_id, &req.settings, req.node, secret, proposed, req.members, wait).await?))
}

/// Bound on resolving the host names a joining node advertises: past it the join is answered
/// 503 and the agent tries again.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// Most host-name lookups at once (each holds a thread of the blocking pool until the resolver
/// answers, which the timeout does not cancel): joins past it are answered 503.
const MAX_RESOLVING: usize = 32;
static RESOLVING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_RESOLVING);

/// What this host's resolver answers for each host name `node` advertises (IP literals need
/// none); a name that does not resolve maps to nothing, and the join is refused. A resolver
/// that is slow, or busy with others' names, is the service's trouble: [`RdzvError::Busy`].
async fn resolve_names(node: &crate::round::NodeInfo) -> Result<BTreeMap<String, Vec<std::net::IpAddr>>, RdzvError> {
    let mut out = BTreeMap::new();
    for (_, addr) in crate::round::advertised(node) {
        let host = addr.host();
        if host.parse::<std::net::IpAddr>().is_ok() || out.contains_key(host) {
            continue;
        }
        let busy = |why: &str| RdzvError::Busy { message: format!("cannot resolve `{host}` now ({why}); try again") };
        let _permit = RESOLVING.try_acquire().map_err(|_| busy("too many lookups in progress"))?;
        let ips = match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, 0))).await {
            Ok(Ok(found)) => found.map(|a| a.ip()).collect(),
            Ok(Err(_)) => Vec::new(),
            Err(_) => return Err(busy("the resolver did not answer within 2 s")),
        };
        out.insert(host.to_owned(), ips);
    }
    Ok(out)
}

async fn heartbeat(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<HeartbeatRequest>,
) -> ApiResult<HeartbeatAnswer> {
    Ok(Json(app.rdzv.heartbeat(&run_id, &req.node_id, req.secret.as_deref(), req.beat).await?))
}

async fn watch(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<WatchRequest>,
) -> ApiResult<WatchEvent> {
    let node = req.node_id.as_deref().map(|id| (id, req.secret.as_deref()));
    Ok(Json(app.rdzv.watch(&run_id, req.after_round, node, wait_of(req.wait_ms)).await?))
}

async fn failure(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<FailureRequest>,
) -> ApiResult<Empty> {
    app.rdzv.report_failure(&run_id, &req.node_id, req.secret.as_deref(), req.round, req.root_cause).await?;
    Ok(Json(Empty {}))
}

async fn stacks(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<StacksRequest>,
) -> ApiResult<Empty> {
    app.rdzv.report_stacks(&run_id, &req.node_id, req.secret.as_deref(), req.round, req.stacks).await?;
    Ok(Json(Empty {}))
}

async fn progress(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<ProgressRequest>,
) -> ApiResult<Empty> {
    app.rdzv.report_progress(&run_id, &req.node_id, req.secret.as_deref(), req.round, req.progress).await?;
    Ok(Json(Empty {}))
}

async fn success(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<SuccessRequest>,
) -> ApiResult<Empty> {
    app.rdzv.report_success(&run_id, &req.node_id, req.secret.as_deref(), req.round).await?;
    Ok(Json(Empty {}))
}

async fn leave(
    State(app): State<AppState>,
    Path(run_id): Path<String>,
    ApiJson(req): ApiJson<NodeRequest>,
) -> ApiResult<Empty> {
    app.rdzv.leave(&run_id, &req.node_id, req.secret.as_deref()).await?;
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
        .route("/v1/jobs/{run_id}/stacks", post(stacks))
        .route("/v1/jobs/{run_id}/success", post(success))
        .route("/v1/jobs/{run_id}/progress", post(progress))
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
        .merge(crate::page::routes())
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state)
}

/// How the server holds against slow and numerous clients ([`crate::conn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Most connections open at once. At the bound, the oldest idle connection (no request
    /// in progress: a kept-alive one, or one still sending its headers) is closed to admit the
    /// new one, else the one whose request body has been arriving the longest, else the
    /// longest-waiting watch; when every connection is serving another request, the new one
    /// is closed. One peer address holds at most a sixteenth (loopback excepted).
    pub max_connections: usize,
    /// A request's headers must arrive within this, and a kept-alive connection may sit idle
    /// this long (a half-sent request holds nothing for longer).
    pub header_timeout: Duration,
    /// A request's body must arrive in full within this of its headers: a whole request takes
    /// at most `header_timeout + body_timeout`, however slowly it is sent.
    pub body_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self { max_connections: 65_536, header_timeout: Duration::from_secs(10), body_timeout: Duration::from_secs(10) }
    }
}

/// Serves the API on `listener` until `shutdown` resolves, then lets requests in flight finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, state, ServeLimits::default(), shutdown).await
}

/// [`serve`] with explicit limits: HTTP/1.1 connections with a header-read (and idle) timeout
/// and a body deadline, at most `limits.max_connections` of them.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: AppState,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(listener, state, limits, None, shutdown).await
}

/// [`serve_with`] over TLS (HTTPS): every connection's handshake must finish within the
/// header timeout, and a connection still in its handshake counts as idle at the bound.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    state: AppState,
    limits: ServeLimits,
    tls: Arc<tokio_rustls::rustls::ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_on(listener, state, limits, Some(tokio_rustls::TlsAcceptor::from(tls)), shutdown).await
}

async fn serve_on(
    listener: tokio::net::TcpListener,
    state: AppState,
    limits: ServeLimits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tower::ServiceExt as _;

    let app = router(state);
    let connections = Arc::new(crate::conn::Connections::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = &mut shutdown => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) if matches!(error.raw_os_error(), Some(libc_emfile) if libc_emfile == 24 || libc_emfile == 23) =>
            {
                // Out of file descriptors (EMFILE, ENFILE): free an idle connection and pause,
                // rather than spin.
                warn!(%error, "accept failed");
                connections.make_room(0, std::net::Ipv4Addr::LOCALHOST.into()); // any peer's
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            Err(error) => {
                // A client gone before its accept (ECONNABORTED and the like): the next one.
                debug!(%error, "accept failed");
                continue;
            }
        };
        if !connections.make_room(limits.max_connections.max(1), peer.ip()) {
            debug!("connection refused: every connection is busy");
            continue;
        }
        let _ = stream.set_nodelay(true);
        let (id, conn_state, close) = connections.add(peer.ip());
        let app = app.clone();
        let requests = connections.clone();
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let (mut parts, body) = req.into_parts();
            // Who sent it: a join may advertise only its own address (round::check_advertised).
            parts.extensions.insert(axum::extract::ConnectInfo(peer));
            // A watch only waits for news: closed first among handlers to admit a connection.
            let long_poll = parts.uri.path().ends_with("/watch");
            let (guard, body) = requests.request(&conn_state, body, limits.body_timeout, long_poll);
            let app = app.clone();
            async move {
                let _guard = guard;
                app.oneshot(Request::from_parts(parts, axum::body::Body::new(body))).await
            }
        });
        let (watcher, builder, tls) = (graceful.watcher(), builder.clone(), tls.clone());
        let served = async move {
            let result = match tls {
                None => watcher.watch(builder.serve_connection(TokioIo::new(stream), service)).await,
                Some(tls) => match tokio::time::timeout(limits.header_timeout, tls.accept(stream)).await {
                    Ok(Ok(stream)) => watcher.watch(builder.serve_connection(TokioIo::new(stream), service)).await,
                    Ok(Err(error)) => return debug!(%error, "TLS handshake failed"),
                    Err(_) => return debug!("TLS handshake timed out"),
                },
            };
            if let Err(error) = result {
                debug!(%error, "connection ended with an error");
            }
        };
        let connections = connections.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = served => {}
                () = close.notified() => debug!("idle or slow connection closed to admit a new one"),
            }
            connections.remove(id);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

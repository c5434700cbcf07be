//! The HTTP API through `router(..).oneshot(..)` and through a real bound server with the client.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::response::IntoResponse;
use rlaunch::contract::RootCause;
use rlaunch_rendezvous::api::{self, AppState};
use rlaunch_rendezvous::round::{Job, JobSettings, NodeInfo};
use rlaunch_rendezvous::{Backend, RdzvError, Rendezvous, RendezvousClient, WatchEvent};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::ServiceExt;

/// The `rlaunch-rendezvous` binary (built by the launcher package: `cargo build -p
/// rlaunch-launcher --bins`, which `scripts/test.sh` does before the tests).
fn service_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/<test> → target/<profile>/rlaunch-rendezvous
    let bin = exe.parent().and_then(|d| d.parent()).expect("target/<profile>").join("rlaunch-rendezvous");
    assert!(bin.exists(), "{} is missing: cargo build -p rlaunch-launcher --bins", bin.display());
    bin
}

fn rc(message: impl ToString) -> Box<RootCause> {
    Box::new(RootCause::from_message(message.to_string()))
}

/// Every await in these tests is bounded by this.
const DEADLINE: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(DEADLINE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {DEADLINE:?}"),
    }
}

/// Slow timers: nothing lapses while a test inspects state.
fn calm(min: u32, max: u32) -> JobSettings {
    JobSettings {
        min_nodes: min,
        max_nodes: max,
        join_timeout: Duration::from_secs(120),
        last_call_timeout: Duration::from_secs(60),
        heartbeat_interval: Duration::from_secs(10),
        node_ttl: Duration::from_secs(60),
        probe_timeout: Duration::from_secs(30),
        peer_interval: Duration::from_millis(100),
        stall_bound: Duration::from_millis(500),
        max_restarts: 1,
        stop_grace: Duration::ZERO,
        hang_timeout: None,
        fingerprint: None,
    }
}

/// Fast timers: node loss in well under a second.
fn fast(min: u32, max: u32) -> JobSettings {
    JobSettings {
        min_nodes: min,
        max_nodes: max,
        join_timeout: Duration::from_secs(10),
        last_call_timeout: Duration::from_millis(300),
        heartbeat_interval: Duration::from_millis(100),
        node_ttl: Duration::from_millis(500),
        probe_timeout: Duration::from_millis(300),
        peer_interval: Duration::from_millis(50),
        stall_bound: Duration::from_millis(200),
        max_restarts: 1,
        stop_grace: Duration::ZERO,
        hang_timeout: None,
        fingerprint: None,
    }
}

fn node(id: &str) -> NodeInfo {
    NodeInfo {
        node_id: id.to_owned(),
        local_world_size: 2,
        store_addr: format!("127.0.0.1:{}", 29500 + id.len()).parse().unwrap(),
        probe_addr: None,
        snapshot_addr: None,
        snapshot_key: None,
        snapshots: Vec::new(),
        fingerprint: None,
    }
}

async fn send(app: &axum::Router, req: Request<Body>) -> (StatusCode, Value) {
    let resp = within("request", app.clone().oneshot(req)).await.expect("router is infallible");
    let status = resp.status();
    let bytes = within("body", axum::body::to_bytes(resp.into_body(), 1 << 20)).await.expect("body reads");
    let v = serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path).header(header::CONTENT_TYPE, "application/json").body(body.into()).expect("valid request")
}

fn post_json(path: &str, v: &Value) -> Request<Body> {
    post(path, v.to_string())
}

async fn job(rdzv: &Rendezvous, run_id: &str) -> Option<Job> {
    rdzv.store().load(run_id, 0).await.expect("memory store loads")
}

/// A job with node `a` waiting (min 2), for tests that check state stays untouched.
async fn app_with_waiting_job(token: Option<&str>) -> (axum::Router, Arc<Rendezvous>) {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv.clone(), token.map(str::to_owned)));
    let mut req = post_json("/v1/jobs/j1/join", &json!({"settings": calm(2, 2), "node": node("a"), "wait_ms": 0}));
    if let Some(t) = token {
        req.headers_mut().insert(header::AUTHORIZATION, format!("Bearer {t}").parse().expect("header value"));
    }
    let (status, body) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "wait");
    (app, rdzv)
}

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(rdzv: Arc<Rendezvous>, token: Option<&str>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
        let addr = listener.local_addr().expect("bound address");
        let (tx, rx) = oneshot::channel::<()>();
        let state = AppState::new(rdzv, token.map(str::to_owned));
        let task = tokio::spawn(api::serve(listener, state, async move {
            let _ = rx.await;
        }));
        Server { addr, stop: Some(tx), task }
    }

    fn endpoint(&self) -> String {
        self.addr.to_string()
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        within("server shutdown", &mut self.task).await.expect("server task").expect("serve ok");
    }
}

/// `client` heartbeats for `node_id` every 100 ms until the task is aborted.
fn keep_beating(client: &RendezvousClient, node_id: &'static str) -> tokio::task::JoinHandle<()> {
    let client = client.clone();
    tokio::spawn(async move {
        loop {
            let _ = client.heartbeat(node_id, Default::default()).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// The first watch event after `round` that is not "no change" (within the test's deadline).
async fn next_event(client: &RendezvousClient, round: u64) -> WatchEvent {
    within("watch", async {
        loop {
            match client.watch(None, round).await.expect("watch") {
                WatchEvent::NoChange => continue,
                ev => return ev,
            }
        }
    })
    .await
}

async fn http_client(endpoints: Vec<String>, run_id: &str, s: JobSettings) -> RendezvousClient {
    RendezvousClient::connect(
        Backend::Http { endpoints: endpoints.iter().map(|e| e.parse().expect("an endpoint")).collect(), token: None },
        run_id,
        s,
    )
    .await
    .expect("client connects")
}

#[tokio::test]
async fn healthz_and_metrics_answer_without_a_token() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv, Some("s3cret".into())));
    let (status, body) = send(&app, Request::get("/healthz").body(Body::empty()).expect("req")).await;
    assert_eq!((status, body), (StatusCode::OK, Value::String("ok\n".into())));
    let (status, body) = send(&app, Request::get("/metrics").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::OK);
    let text = body.as_str().expect("metrics are text");
    assert!(text.contains("# TYPE rlaunch_rdzv_rounds_closed_total counter"), "{text}");
    assert!(text.contains("rlaunch_rdzv_jobs{state=\"running\"} 0"), "{text}");
}

#[tokio::test]
async fn the_status_page_is_served_without_the_token_and_holds_no_data() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv, Some("s3cret".into())));
    // A job exists, with a node id the page must never see without the token.
    let join = json!({"settings": calm(1, 1), "node": node("node-secret-name")});
    let mut req = post_json("/v1/jobs/jobzq7/join", &join);
    req.headers_mut().insert(header::AUTHORIZATION, "Bearer s3cret".parse().expect("header"));
    assert_eq!(send(&app, req).await.0, StatusCode::OK);
    for (path, kind) in [("/", "text/html"), ("/page.js", "text/javascript"), ("/page.css", "text/css")] {
        let resp = app.clone().oneshot(Request::get(path).body(Body::empty()).expect("req")).await.expect("answer");
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        let h = resp.headers();
        let ct = h.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
        assert!(ct.starts_with(kind), "{path}: {ct}");
        let csp = h.get(header::CONTENT_SECURITY_POLICY).and_then(|v| v.to_str().ok()).unwrap_or_default();
        assert!(csp.contains("script-src 'self'") && csp.contains("default-src 'none'"), "{path}: {csp}");
        assert_eq!(h.get(header::X_CONTENT_TYPE_OPTIONS).and_then(|v| v.to_str().ok()), Some("nosniff"));
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.expect("body");
        let text = String::from_utf8_lossy(&body);
        assert!(!text.contains("node-secret-name") && !text.contains("jobzq7"), "{path} leaks job data");
    }
    // What the page reads stays behind the token.
    let (status, _) = send(&app, Request::get("/v1/jobs").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn join_over_oneshot_closes_a_single_node_round() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv, None));
    let (status, body) =
        send(&app, post_json("/v1/jobs/solo/join", &json!({"settings": calm(1, 1), "node": node("a")}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "round");
    let secret = body["secret"].as_str().expect("a join answers the node's secret").to_owned();
    let info = &body["data"].clone();
    assert_eq!(info["round"], 1);
    assert_eq!(info["group_rank"], 0);
    assert_eq!(info["world_size"], 2);
    assert_eq!(info["master_store_addr"], "127.0.0.1:29501");
    let (status, body) = send(&app, Request::get("/v1/jobs/solo").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["state"], "running");
    assert_eq!(body["members"][0]["node_id"], "a");
    // The answer carries the node's own placement and a digest; the list only on request.
    assert_eq!(info["members"], json!([]), "{info}");
    let digest = info["members_digest"].as_str().expect("digest").to_owned();
    let (status, body) = send(
        &app,
        post_json(
            "/v1/jobs/solo/join",
            &json!({"settings": calm(1, 1), "node": node("a"), "secret": secret, "members": true}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["data"]["members"][0]["node_id"], "a");
    assert_eq!(body["data"]["members_digest"], digest.as_str());
}

#[tokio::test]
async fn malformed_json_is_400_and_leaves_the_job_untouched() {
    let (app, rdzv) = app_with_waiting_job(None).await;
    let before = job(&rdzv, "j1").await;
    for (path, body) in [
        ("/v1/jobs/j1/join", "{not json"),
        ("/v1/jobs/j1/heartbeat", "[]"),
        ("/v1/jobs/j1/failure", r#"{"node_id": "a"}"#),
        ("/v1/jobs/j1/leave", r#"{"node_id": 5}"#),
        ("/v1/jobs/j1/watch", ""),
    ] {
        let (status, v) = send(&app, post(path, body)).await;
        assert!(status.is_client_error(), "{path} {body}: {status} {v}");
        assert!(v["error"].is_string() && v["message"].is_string(), "{v}");
    }
    let (status, v) = send(
        &app,
        post_json(
            "/v1/jobs/j1/join",
            &json!({"settings": calm(1,1), "node": {"node_id": "z", "local_world_size": 1, "store_addr": "h:1"}}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "different settings: {v}");
    let (status, v) = send(
        &app,
        post_json(
            "/v1/jobs/j1/join",
            &json!({"settings": calm(2,2), "node": {"node_id": "", "local_world_size": 1, "store_addr": "h:1"}}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| m.contains("node_id")), "{v}");
    assert_eq!(job(&rdzv, "j1").await, before);
}

#[tokio::test]
async fn wrong_content_type_is_a_4xx() {
    let (app, _) = app_with_waiting_job(None).await;
    let req = Request::post("/v1/jobs/j1/heartbeat").body(Body::from(r#"{"node_id":"a"}"#)).expect("req");
    let (status, v) = send(&app, req).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{v}");
}

#[tokio::test]
async fn invalid_settings_are_400_with_a_clear_message() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv.clone(), None));
    let mut s = calm(1, 1);
    s.node_ttl = Duration::from_secs(1);
    let (status, v) = send(&app, post_json("/v1/jobs/x/join", &json!({"settings": s, "node": node("a")}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| m.contains("heartbeat_interval") && m.contains("node_ttl")), "{v}");
    assert!(job(&rdzv, "x").await.is_none(), "no job is created by a rejected join");
}

#[tokio::test]
async fn unknown_job_is_404() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv, None));
    let (status, v) = send(&app, Request::get("/v1/jobs/nope").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"], "unknown_job");
    for op in ["heartbeat", "leave"] {
        let (status, _) = send(&app, post_json(&format!("/v1/jobs/nope/{op}"), &json!({"node_id": "a"}))).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{op}");
    }
    let (status, _) = send(&app, post_json("/v1/jobs/nope/watch", &json!({"after_round": 0, "wait_ms": 0}))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, v) = send(&app, post_json("/v1/jobs/bad%2Fid/watch", &json!({"after_round": 0}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
}

#[tokio::test]
async fn unknown_node_heartbeat_is_404_and_leaves_the_job_untouched() {
    let (app, rdzv) = app_with_waiting_job(None).await;
    let before = job(&rdzv, "j1").await;
    let (status, v) = send(&app, post_json("/v1/jobs/j1/heartbeat", &json!({"node_id": "ghost"}))).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"], "unknown_node");
    assert_eq!(job(&rdzv, "j1").await, before);
}

#[tokio::test]
async fn oversized_body_is_413_and_leaves_the_job_untouched() {
    let (app, rdzv) = app_with_waiting_job(None).await;
    let before = job(&rdzv, "j1").await;
    let huge = "x".repeat(api::DEFAULT_BODY_LIMIT + 1);
    let body = json!({"node_id": "a", "round": 1, "root_cause": huge});
    let (status, v) = send(&app, post_json("/v1/jobs/j1/failure", &body)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert_eq!(v["error"], "payload_too_large");
    assert_eq!(job(&rdzv, "j1").await, before);
}

#[tokio::test]
async fn wrong_or_missing_token_is_401_and_leaves_the_job_untouched() {
    let (app, rdzv) = app_with_waiting_job(Some("s3cret")).await;
    let before = job(&rdzv, "j1").await;
    for auth in [None, Some("Bearer wrong"), Some("Basic s3cret"), Some("Bearer s3cret2")] {
        let mut req = post_json("/v1/jobs/j1/leave", &json!({"node_id": "a"}));
        if let Some(a) = auth {
            req.headers_mut().insert(header::AUTHORIZATION, a.parse().expect("header value"));
        }
        let (status, v) = send(&app, req).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{auth:?}: {v}");
        assert_eq!(v["error"], "unauthorized");
    }
    assert_eq!(job(&rdzv, "j1").await, before);
    let mut req = Request::get("/v1/jobs/j1").body(Body::empty()).expect("req");
    req.headers_mut().insert(header::AUTHORIZATION, "Bearer s3cret".parse().expect("header value"));
    let (status, _) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn unknown_route_is_a_json_404() {
    let app = api::router(AppState::new(Rendezvous::in_memory(), None));
    let (status, v) = send(&app, Request::get("/v2/whatever").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"], "not_found");
}

#[tokio::test]
async fn two_nodes_join_a_real_server_and_get_contiguous_ranks() {
    let server = Server::start(Rendezvous::in_memory(), None).await;
    let a = http_client(vec![server.endpoint()], "job2", fast(2, 2)).await;
    let b = http_client(vec![server.endpoint()], "job2", fast(2, 2)).await;
    let (ra, rb) = within("two joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let (ra, rb) = (ra.expect("a joins"), rb.expect("b joins"));
    assert_eq!(ra.round, 1);
    assert_eq!(ra.group_world_size, 2);
    assert_eq!(ra.world_size, 4);
    let mut ranks = [(ra.group_rank, ra.rank_offset), (rb.group_rank, rb.rank_offset)];
    ranks.sort();
    assert_eq!(ranks, [(0, 0), (1, 2)]);
    assert_eq!(ra.master_store_addr, rb.master_store_addr);
    assert!(!ra.members_digest.is_empty() && ra.members.is_empty(), "{ra:?}");
    assert_eq!(ra.members_digest, rb.members_digest);
    let st = within("status", a.status()).await.expect("status");
    assert_eq!(st.state, "running");
    server.stop().await;
}

#[tokio::test]
async fn failure_report_restarts_every_node_once_over_http() {
    let server = Server::start(Rendezvous::in_memory(), None).await;
    let a = http_client(vec![server.endpoint()], "jf", fast(2, 2)).await;
    let b = http_client(vec![server.endpoint()], "jf", fast(2, 2)).await;
    let (ra, _) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let round = ra.expect("a joins").round;
    a.report_failure("a", round, rc(json!({"exit_code": 3}))).await.expect("report");
    b.report_failure("bb", round, rc(json!({"exit_code": 9}))).await.expect("second report is accepted");
    assert_eq!(within("watch", b.watch(None, round)).await.expect("watch"), WatchEvent::NewRound(round + 1));
    let (ra, rb) = within("rejoin", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let (ra, rb) = (ra.expect("a rejoins"), rb.expect("b rejoins"));
    assert_eq!((ra.round, ra.restart_count, rb.restart_count), (round + 1, 1, 1));
    let st = a.status().await.expect("status");
    assert_eq!(st.last_root_cause, Some(*rc(json!({"exit_code": 3}))));
    // Budget is 1: the next failure fails the job for everyone.
    a.report_failure("a", ra.round, rc(json!("again"))).await.expect("report");
    match within("watch", b.watch(None, ra.round)).await.expect("watch") {
        WatchEvent::Failed(reason) => assert!(reason.contains("restart budget exhausted"), "{reason}"),
        other => panic!("{other:?}"),
    }
    match within("join after failure", b.join(node("bb"))).await {
        Err(RdzvError::JobFailed { reason }) => assert!(reason.contains("again"), "{reason}"),
        other => panic!("{other:?}"),
    }
    server.stop().await;
}

#[tokio::test]
async fn node_loss_is_seen_by_the_survivor_within_the_ttl() {
    let server = Server::start(Rendezvous::in_memory(), None).await;
    let s = fast(1, 2);
    let a = http_client(vec![server.endpoint()], "jl", s.clone()).await;
    let b = http_client(vec![server.endpoint()], "jl", s.clone()).await;
    let (ra, _) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let ra = ra.expect("a joins");
    // a keeps heartbeating; b goes silent (killed, or its link cut).
    let beats = keep_beating(&a, "a");
    let started = tokio::time::Instant::now();
    let ev = next_event(&a, ra.round).await;
    let took = started.elapsed();
    assert_eq!(ev, WatchEvent::NewRound(ra.round + 1));
    // TTL plus the probe timeout (nobody to probe b but a, which does not) plus a 0.1 s tick;
    // the margin is for a loaded machine.
    assert!(took < s.node_ttl + s.probe_timeout + Duration::from_millis(1200), "loss noticed after {took:?}");
    let again = within("rejoin", a.join(node("a"))).await.expect("survivor rejoins");
    assert_eq!((again.group_world_size, again.group_rank), (1, 0));
    assert_eq!(again.restart_count, 0);
    match within("heartbeat of the lost node", b.heartbeat("bb", Default::default())).await {
        Err(RdzvError::UnknownNode { node_id }) => assert_eq!(node_id, "bb"),
        other => panic!("{other:?}"),
    }
    beats.abort();
    server.stop().await;
}

#[tokio::test]
async fn a_node_joining_a_running_job_scales_it_up() {
    let server = Server::start(Rendezvous::in_memory(), None).await;
    let s = fast(1, 3);
    let a = http_client(vec![server.endpoint()], "ju", s.clone()).await;
    let r1 = within("a joins", a.join(node("a"))).await.expect("a joins");
    assert_eq!(r1.group_world_size, 1);
    let c = http_client(vec![server.endpoint()], "ju", s.clone()).await;
    let joiner = {
        let c = c.clone();
        tokio::spawn(async move { c.join(node("ccc")).await })
    };
    // Both heartbeat, as agents do; the scale-up comes once c has for two TTLs.
    let beats = keep_beating(&c, "ccc");
    let a_beat = keep_beating(&a, "a");
    let started = tokio::time::Instant::now();
    let ev = next_event(&a, r1.round).await;
    assert_eq!(ev, WatchEvent::NewRound(r1.round + 1));
    assert!(started.elapsed() >= s.node_ttl * 2 - Duration::from_millis(200), "{:?}", started.elapsed());
    let r2 = within("a rejoins", a.join(node("a"))).await.expect("a rejoins");
    let rc = within("c joins", joiner).await.expect("task").expect("c joins");
    assert_eq!((r2.round, r2.group_world_size, r2.group_rank), (2, 2, 0));
    assert_eq!((rc.group_rank, rc.rank_offset), (1, 2));
    beats.abort();
    a_beat.abort();
    server.stop().await;
}

#[tokio::test]
async fn one_node_succeeding_leaves_the_others_running_until_all_succeed() {
    let server = Server::start(Rendezvous::in_memory(), None).await;
    let a = http_client(vec![server.endpoint()], "js", fast(2, 2)).await;
    let b = http_client(vec![server.endpoint()], "js", fast(2, 2)).await;
    let (ra, _) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let round = ra.expect("a").round;
    a.report_success("a", round).await.expect("success");
    // a's agent goes away; b keeps running and heartbeating.
    for _ in 0..8 {
        b.heartbeat("bb", Default::default()).await.expect("b stays a member");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(b.status().await.expect("status").state, "running");
    b.report_success("bb", round).await.expect("success");
    assert_eq!(within("watch", a.watch(None, round)).await.expect("watch"), WatchEvent::Finished);
    server.stop().await;
}

#[tokio::test]
async fn too_few_nodes_fail_with_a_join_timeout() {
    let server = Server::start(Rendezvous::in_memory(), None).await;
    let mut s = fast(2, 2);
    s.join_timeout = Duration::from_millis(1500);
    let a = http_client(vec![server.endpoint()], "jt", s).await;
    match within("join", a.join(node("a"))).await {
        Err(RdzvError::JoinTimeout { reason }) => {
            assert!(reason.contains("only 1 of at least 2 nodes"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    server.stop().await;
}

#[tokio::test]
async fn client_fails_over_to_the_next_endpoint() {
    // Nothing listens on the first endpoint.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let dead_addr = dead.local_addr().expect("addr").to_string();
    drop(dead);
    let rdzv = Rendezvous::in_memory();
    let s1 = Server::start(rdzv.clone(), None).await;
    let s2 = Server::start(rdzv, None).await;
    let a = http_client(vec![dead_addr, s1.endpoint(), s2.endpoint()], "jo", fast(1, 1)).await;
    let r = within("join", a.join(node("a"))).await.expect("join through the live endpoint");
    s1.stop().await;
    a.heartbeat("a", Default::default()).await.expect("heartbeat fails over to s2");
    assert_eq!(within("watch", a.watch(None, r.round + 5)).await.expect("watch"), WatchEvent::NewRound(r.round));
    s2.stop().await;
}

#[tokio::test]
async fn token_is_sent_by_the_client() {
    let server = Server::start(Rendezvous::in_memory(), Some("tok")).await;
    let good = RendezvousClient::connect(
        Backend::Http { endpoints: vec![server.endpoint().parse().expect("an endpoint")], token: Some("tok".into()) },
        "jk",
        fast(1, 1),
    )
    .await
    .expect("connect");
    within("join", good.join(node("a"))).await.expect("join with the token");
    let bad = http_client(vec![server.endpoint()], "jk", fast(1, 1)).await;
    assert!(matches!(within("status", bad.status()).await, Err(RdzvError::Unauthorized)));
    server.stop().await;
}

#[tokio::test]
async fn in_process_backend_runs_a_standalone_job() {
    let rdzv = Rendezvous::in_memory();
    let c = RendezvousClient::connect(Backend::InProcess(rdzv), "standalone", fast(1, 1)).await.expect("connect");
    let r = within("join", c.join(node("local"))).await.expect("join");
    assert_eq!((r.round, r.group_rank, r.world_size), (1, 0, 2));
    c.report_success("local", r.round).await.expect("success");
    assert_eq!(within("watch", c.watch(None, r.round)).await.expect("watch"), WatchEvent::Finished);
    assert!(matches!(c.join(node("local")).await, Err(RdzvError::JobFinished)));
}

#[tokio::test]
async fn connect_rejects_timeouts_that_do_not_nest() {
    let mut s = fast(1, 1);
    s.heartbeat_interval = Duration::from_secs(1);
    let err =
        RendezvousClient::connect(Backend::InProcess(Rendezvous::in_memory()), "x", s).await.err().expect("rejected");
    assert!(matches!(err, RdzvError::InvalidSettings(_)), "{err}");
    assert_eq!(
        err.to_string(),
        "invalid rendezvous settings: timeouts must nest: heartbeat_interval (1s) must be less than node_ttl (500ms)"
    );
}

#[tokio::test]
async fn client_rebuilds_unknown_job_errors() {
    let server = Server::start(Rendezvous::in_memory(), None).await;
    let c = http_client(vec![server.endpoint()], "never-joined", fast(1, 1)).await;
    match within("status", c.status()).await {
        Err(RdzvError::UnknownJob { run_id }) => assert_eq!(run_id, "never-joined"),
        other => panic!("{other:?}"),
    }
    server.stop().await;
}

#[tokio::test]
async fn failure_report_from_a_non_member_is_409_and_leaves_the_job_untouched() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv.clone(), None));
    let (status, _) =
        send(&app, post_json("/v1/jobs/nm/join", &json!({"settings": calm(1, 2), "node": node("a"), "wait_ms": 0})))
            .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) =
        send(&app, post_json("/v1/jobs/nm/join", &json!({"settings": calm(1, 2), "node": node("bb"), "wait_ms": 0})))
            .await;
    assert_eq!(status, StatusCode::OK);
    let before = job(&rdzv, "nm").await.expect("job exists");
    assert_eq!(before.phase.name(), "running");
    let (status, v) =
        send(&app, post_json("/v1/jobs/nm/failure", &json!({"node_id": "zz", "round": 1, "root_cause": rc("x")})))
            .await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"], "not_member");
    assert_eq!(job(&rdzv, "nm").await, Some(before.clone()));
    // A root cause that is not one is refused as such, and changes nothing either.
    let (status, v) =
        send(&app, post_json("/v1/jobs/nm/failure", &json!({"node_id": "a", "round": 1, "root_cause": {}}))).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| m.contains("root_cause")), "{v}");
    assert_eq!(job(&rdzv, "nm").await, Some(before));
}

#[tokio::test]
async fn a_member_leaving_opens_a_new_round_and_metrics_count_it() {
    let server = Server::start(Rendezvous::in_memory(), None).await;
    let a = http_client(vec![server.endpoint()], "jleave", fast(1, 2)).await;
    let b = http_client(vec![server.endpoint()], "jleave", fast(1, 2)).await;
    let (ra, _) = within("joins", async { tokio::join!(a.join(node("a")), b.join(node("bb"))) }).await;
    let round = ra.expect("a joins").round;
    b.leave("bb").await.expect("leave");
    assert_eq!(within("watch", a.watch(None, round)).await.expect("watch"), WatchEvent::NewRound(round + 1));
    let again = within("rejoin", a.join(node("a"))).await.expect("rejoin");
    assert_eq!(again.group_world_size, 1);
    let http = reqwest::Client::builder().no_proxy().build().expect("http client");
    let text = within("metrics", async {
        http.get(format!("http://{}/metrics", server.endpoint()))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text")
    })
    .await;
    assert!(text.contains("rlaunch_rdzv_rounds_opened_total{cause=\"member_left\"} 1"), "{text}");
    assert!(text.contains("rlaunch_rdzv_rounds_closed_total 2"), "{text}");
    server.stop().await;
}

#[tokio::test]
async fn client_reports_a_settings_mismatch() {
    let rdzv = Rendezvous::in_memory();
    let server = Server::start(rdzv, None).await;
    let a = http_client(vec![server.endpoint()], "jmm", fast(1, 2)).await;
    let _ = within("a joins", a.join_once(&node("a"), Duration::ZERO)).await.expect("a joins");
    let b = http_client(vec![server.endpoint()], "jmm", fast(1, 3)).await;
    match within("b joins", b.join(node("bb"))).await {
        Err(RdzvError::SettingsMismatch { message, .. }) => assert!(message.contains("\"max_nodes\":2"), "{message}"),
        other => panic!("{other:?}"),
    }
    server.stop().await;
}

#[tokio::test]
async fn the_bearer_scheme_is_matched_whatever_its_case_and_metrics_can_require_the_token() {
    let (app, _) = app_with_waiting_job(Some("s3cret")).await;
    for auth in ["bearer s3cret", "BEARER s3cret", "Bearer  s3cret"] {
        let mut req = Request::get("/v1/jobs/j1").body(Body::empty()).expect("req");
        req.headers_mut().insert(header::AUTHORIZATION, auth.parse().expect("header value"));
        let (status, v) = send(&app, req).await;
        assert_eq!(status, StatusCode::OK, "{auth}: {v}");
    }
    let mut state = AppState::new(Rendezvous::in_memory(), Some("s3cret".into()));
    state.protect_metrics = true;
    let app = api::router(state);
    let (status, _) = send(&app, Request::get("/metrics").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "metrics name every job and node");
    let mut req = Request::get("/metrics").body(Body::empty()).expect("req");
    req.headers_mut().insert(header::AUTHORIZATION, "Bearer s3cret".parse().expect("header value"));
    assert_eq!(send(&app, req).await.0, StatusCode::OK);
    let (status, _) = send(&app, Request::get("/healthz").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::OK, "health probes need no token");
}

/// `GET path` with an optional bearer token over plain HTTP/1.1; the status code.
fn get_status(addr: &str, path: &str, token: Option<&str>) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_whitespace().nth(1)?.parse().ok()
}

#[test]
fn the_service_reads_its_token_from_a_file_and_refuses_an_empty_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("token");
    std::fs::write(&file, "s3cret\n").expect("token file");
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    let listen = format!("127.0.0.1:{port}");
    let bin = service_bin();
    let mut child = std::process::Command::new(&bin)
        .args(["--listen", &listen, "--token-file"])
        .arg(&file)
        .arg("--protect-metrics")
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start rlaunch-rendezvous");
    let started = std::time::Instant::now();
    while get_status(&listen, "/healthz", None).is_none() {
        assert!(started.elapsed() < Duration::from_secs(10), "the service did not answer");
        std::thread::sleep(Duration::from_millis(50));
    }
    let results = (
        get_status(&listen, "/v1/jobs", None),
        get_status(&listen, "/v1/jobs", Some("s3cret")),
        get_status(&listen, "/metrics", None),
        get_status(&listen, "/metrics", Some("s3cret")),
    );
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(results, (Some(401), Some(200), Some(401), Some(200)));
    std::fs::write(&file, "\n").expect("empty token file");
    let out = std::process::Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--token-file"])
        .arg(&file)
        .output()
        .expect("run rlaunch-rendezvous");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is empty"), "{}", String::from_utf8_lossy(&out.stderr));
}

// --- A service exposed to the whole cluster: identity, bounds, hostile connections ---

/// Joins `id` over the router with `wait_ms` 0; the answer's status and secret.
async fn raw_join(
    app: &axum::Router,
    run_id: &str,
    s: &JobSettings,
    n: &NodeInfo,
    secret: Option<&str>,
) -> (StatusCode, Value) {
    let mut body = json!({"settings": s, "node": n, "wait_ms": 0});
    if let Some(secret) = secret {
        body["secret"] = json!(secret);
    }
    send(app, post_json(&format!("/v1/jobs/{run_id}/join"), &body)).await
}

#[tokio::test]
async fn forged_calls_for_another_node_are_403_and_change_nothing() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv.clone(), None));
    let s = calm(2, 2);
    let (status, a) = raw_join(&app, "j", &s, &node("a"), None).await;
    assert_eq!(status, StatusCode::OK, "{a}");
    let secret_a = a["secret"].as_str().expect("a join answers a secret").to_owned();
    assert!(secret_a.len() >= 32, "at least 128 bits: {secret_a}");
    let (status, b) = raw_join(&app, "j", &s, &node("b"), None).await;
    assert_eq!((status, b["status"].as_str()), (StatusCode::OK, Some("round")), "{b}");
    let secret_b = b["secret"].as_str().expect("secret").to_owned();
    assert_ne!(secret_a, secret_b);
    let before = job(&rdzv, "j").await;

    // Everything a client can learn: every node id (GET /v1/jobs/j) and its own secret.
    let (_, listed) = send(&app, Request::get("/v1/jobs/j").body(Body::empty()).unwrap()).await;
    assert!(!listed.to_string().contains(&secret_a), "status never shows a secret");
    let mut hijack = node("a");
    hijack.store_addr = "6.6.6.6:6666".parse().unwrap();
    for secret in [None, Some(secret_b.as_str()), Some("0".repeat(64).as_str())] {
        let with = |mut v: Value| {
            if let Some(s) = secret {
                v["secret"] = json!(s);
            }
            v
        };
        let (status, v) = raw_join(&app, "j", &s, &hijack, secret).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "re-join as a with {secret:?}: {v}");
        assert_eq!(v["error"], "forbidden");
        for _ in 0..5 {
            let body = with(json!({"node_id": "a", "round": 1, "root_cause": rc("forged")}));
            let (status, v) = send(&app, post_json("/v1/jobs/j/failure", &body)).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "failure for a: {v}");
        }
        for (path, body) in [
            ("/v1/jobs/j/leave", json!({"node_id": "a"})),
            ("/v1/jobs/j/heartbeat", json!({"node_id": "a"})),
            ("/v1/jobs/j/success", json!({"node_id": "a", "round": 1})),
            ("/v1/jobs/j/watch", json!({"node_id": "a", "after_round": 1, "wait_ms": 0})),
        ] {
            let (status, v) = send(&app, post_json(path, &with(body))).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{path} with {secret:?}: {v}");
        }
    }
    let after = job(&rdzv, "j").await;
    assert_eq!(after, before, "no forged call changed the job");
    // The real a still speaks for itself.
    let (status, v) = raw_join(&app, "j", &s, &node("a"), Some(&secret_a)).await;
    assert_eq!(
        (status, v["status"].as_str(), v["secret"].as_str()),
        (StatusCode::OK, Some("round"), Some(secret_a.as_str())),
        "{v}"
    );
    let (status, v) = send(&app, post_json("/v1/jobs/j/heartbeat", &json!({"node_id": "a", "secret": secret_a}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn a_forged_heartbeat_does_not_keep_a_dead_node_alive() {
    let rdzv = Rendezvous::in_memory();
    let s = fast(1, 2);
    let a = rdzv.join("hb", &s, node("a"), None, false, Duration::ZERO).await.expect("a joins");
    let b = rdzv.join("hb", &s, node("b"), None, false, Duration::ZERO).await.expect("b joins");
    let started = tokio::time::Instant::now();
    let lost = loop {
        assert!(started.elapsed() < Duration::from_secs(10), "a was never declared lost");
        // b is alive; a is dead, and a forger beats for it without (or with b's) secret.
        rdzv.heartbeat("hb", "b", Some(&b.secret), Default::default()).await.expect("b beats");
        for forged in [None, Some(b.secret.as_str())] {
            match rdzv.heartbeat("hb", "a", forged, Default::default()).await {
                Err(RdzvError::Forbidden { node_id }) => assert_eq!(node_id, "a"),
                Err(RdzvError::UnknownNode { .. }) => {}
                other => panic!("forged heartbeat: {other:?}"),
            }
        }
        let st = rdzv.status("hb").await.expect("status");
        if st.round >= 2 {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(lost.last_reason.contains("node(s) a (") && lost.last_reason.contains("lost"), "{}", lost.last_reason);
    drop(a);
}

#[tokio::test]
async fn a_lost_join_answer_costs_a_wait_not_the_node_id() {
    let rdzv = Rendezvous::in_memory();
    let s = fast(1, 1);
    // The first join's answer (and secret) never reaches the agent.
    let lost = rdzv.join("la", &s, node("a"), None, false, Duration::ZERO).await.expect("join");
    assert!(matches!(lost.answer, rlaunch_rendezvous::JoinAnswer::Round(_)));
    let c = RendezvousClient::connect(Backend::InProcess(rdzv.clone()), "la", s).await.expect("client");
    // The agent joins again without a secret: refused until the entry it cannot speak for lapses
    // (TTL + probe timeout), then admitted as a new node with a new secret.
    let info = within("join after a lost answer", c.join(node("a"))).await.expect("joins once the id is free");
    assert_eq!(info.group_world_size, 1);
    let st = rdzv.status("la").await.expect("status");
    assert_eq!(st.members[0].node_id, "a");
    c.heartbeat("a", Default::default()).await.expect("the client holds the new secret");
}

/// A first join whose answer is lost (the client timed out while the service, under a join
/// storm, was slow) used to lock its node out for a TTL and a probe timeout: the job held a key
/// minted for a secret the agent never got. At 10,000 agents on two cores, some 600 of them,
/// silent that long, were taken for lost and the round failed. Now a first join proposes the
/// secret, and its retry proposes the same: taken as its own, at once.
#[tokio::test]
async fn a_first_join_answer_lost_costs_nothing_when_the_retry_proposes_the_same_secret() {
    let rdzv = Rendezvous::in_memory();
    let s = fast(2, 2);
    let mine = "ab".repeat(32);
    let lost = rdzv.join_proposing("lp", &s, node("a"), None, Some(&mine), false, Duration::ZERO).await.expect("join");
    assert_eq!(lost.secret, mine, "keyed with what it proposed");
    // The retry, as the agent never saw that answer: accepted at once, same secret.
    let again = rdzv.join_proposing("lp", &s, node("a"), None, Some(&mine), false, Duration::ZERO).await;
    assert_eq!(again.expect("its own retry").secret, mine);
    // Someone proposing another secret for that id is a stranger.
    let other = "cd".repeat(32);
    let e = rdzv.join_proposing("lp", &s, node("a"), None, Some(&other), false, Duration::ZERO).await.unwrap_err();
    assert!(matches!(e, RdzvError::Forbidden { .. }), "{e:?}");
    // A proposal that is not 64 lowercase hex digits is refused.
    for bad in ["", "abc", &"AB".repeat(32), &"zz".repeat(32)] {
        let e = rdzv.join_proposing("lp", &s, node("b"), None, Some(bad), false, Duration::ZERO).await.unwrap_err();
        assert!(matches!(e, RdzvError::BadRequest { .. }), "{bad:?}: {e:?}");
    }
}

#[tokio::test]
async fn the_service_bounds_jobs_and_nodes_per_job_and_names_the_flag() {
    use rlaunch_rendezvous::service::Limits;
    use rlaunch_rendezvous::Store;
    let rdzv = Rendezvous::with_limits(Store::memory(), Limits { max_jobs: 2, max_nodes: 3, ..Limits::default() });
    let app = api::router(AppState::new(rdzv.clone(), None));
    for run in ["j1", "j2"] {
        let (status, v) = raw_join(&app, run, &calm(1, 3), &node("a"), None).await;
        assert_eq!(status, StatusCode::OK, "{v}");
    }
    let (status, v) = raw_join(&app, "j3", &calm(1, 3), &node("a"), None).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(v["message"].as_str().unwrap().contains("--max-jobs 2"), "{v}");
    assert!(job(&rdzv, "j3").await.is_none(), "nothing kept for a refused job");
    // Existing jobs still take joins.
    let (status, v) = raw_join(&app, "j1", &calm(1, 3), &node("b"), None).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // A job larger than the bound is refused up front, naming the flag.
    let (status, v) = raw_join(&app, "j1", &calm(1, 4), &node("c"), None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains("--max-nodes"), "{v}");
    // Squatters: at most 3 nodes wait to join a job, however many ids a client makes up.
    let mut refused = 0;
    for i in 0..8 {
        let (status, _) = raw_join(&app, "j2", &calm(1, 3), &node(&format!("s{i}")), None).await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
        }
    }
    let j2 = job(&rdzv, "j2").await.expect("j2");
    assert!(j2.pending.len() <= 3 && refused >= 3, "pending {} refused {refused}", j2.pending.len());
}

/// A service at its job bound answers 429; an agent's join waits that out (like an unreachable
/// service) and gets in once a finished job is forgotten (`--terminal-retention-s`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_refused_at_the_job_bound_gets_in_once_a_finished_job_is_forgotten() {
    use rlaunch_rendezvous::service::Limits;
    use rlaunch_rendezvous::Store;
    let limits = Limits { max_jobs: 1, retention: Duration::from_secs(1), ..Limits::default() };
    let rdzv = Rendezvous::with_limits(Store::memory(), limits);
    let first = RendezvousClient::connect(Backend::InProcess(rdzv.clone()), "first", calm(1, 1)).await.expect("client");
    let info = within("first joins", first.join(node("a"))).await.expect("first job forms");
    let second =
        RendezvousClient::connect(Backend::InProcess(rdzv.clone()), "second", calm(1, 1)).await.expect("client");
    let refused = second.join_once(&node("b"), Duration::ZERO).await;
    assert!(matches!(refused, Err(RdzvError::LimitReached { .. })), "{refused:?}");
    let waiting = tokio::spawn(async move { second.join(node("b")).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "the join waits while the bound holds");
    first.report_success("a", info.round).await.expect("first finishes");
    let got = within("second joins", waiting).await.expect("join task").expect("second gets in");
    assert_eq!(got.round, 1);
    assert!(job(&rdzv, "first").await.is_none(), "the finished job was forgotten");
}

#[test]
fn half_sent_requests_and_a_connection_flood_do_not_stop_healthz() {
    use std::io::{Read, Write};
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    let listen = format!("127.0.0.1:{port}");
    let mut child = std::process::Command::new(service_bin())
        .args(["--listen", &listen, "--max-connections", "64", "--header-timeout-ms", "1000"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start rlaunch-rendezvous");
    let started = std::time::Instant::now();
    while get_status(&listen, "/healthz", None).is_none() {
        assert!(started.elapsed() < Duration::from_secs(10), "the service did not answer");
        std::thread::sleep(Duration::from_millis(50));
    }
    // 300 clients that start a request and never finish its headers: more than the bound.
    let mut flood = Vec::new();
    for _ in 0..300 {
        if let Ok(mut s) = std::net::TcpStream::connect(&listen) {
            let _ = s.write_all(b"POST /v1/jobs/x/join HTTP/1.1\r\nHost: x\r\nContent-Le");
            flood.push(s);
        }
    }
    let mut took = Vec::new();
    for _ in 0..10 {
        let t = std::time::Instant::now();
        let status = get_status(&listen, "/healthz", None);
        took.push(t.elapsed());
        assert_eq!(status, Some(200), "healthz under the flood");
    }
    took.sort();
    // Half-sent requests hold nothing past the header timeout.
    std::thread::sleep(Duration::from_millis(1600));
    let still_open = flood
        .iter_mut()
        .filter(|s| {
            let mut s: &std::net::TcpStream = s;
            let _ = s.set_read_timeout(Some(Duration::from_millis(20)));
            let mut buf = [0u8; 256];
            // EOF (0) or a reset: closed; a timeout: still held.
            matches!(s.read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut)
        })
        .count();
    let _ = child.kill();
    let _ = child.wait();
    assert!(took[took.len() / 2] < Duration::from_millis(100), "healthz took {took:?}");
    assert_eq!(still_open, 0, "half-sent requests still held after the header timeout");
}

#[tokio::test]
async fn nodes_may_differ_in_shutdown_timeout_and_the_first_hang_timeout_given_is_the_jobs() {
    use rlaunch::contract::HangTimeout;
    let rdzv = Rendezvous::in_memory();
    let server = Server::start(rdzv, None).await;
    let hang = Some(HangTimeout::Fixed(Duration::from_secs(300)));
    // a: no hang timeout, a shutdown timeout of its own; b gives 300 s; both join one job.
    let a_settings = JobSettings { stop_grace: Duration::from_secs(70), ..calm(3, 3) };
    let a = http_client(vec![server.endpoint()], "jh", a_settings).await;
    let b = http_client(vec![server.endpoint()], "jh", JobSettings { hang_timeout: hang, ..calm(3, 3) }).await;
    // c asks for another hang timeout: refused, naming it.
    let c_settings = JobSettings {
        hang_timeout: Some(HangTimeout::Auto { factor: 10, floor: Duration::from_secs(60) }),
        ..calm(3, 3)
    };
    let c = http_client(vec![server.endpoint()], "jh", c_settings).await;
    let _ = within("a joins", a.join_once(&node("a"), Duration::ZERO)).await.expect("a joins");
    let _ = within("b joins", b.join_once(&node("b"), Duration::ZERO)).await.expect("b joins");
    match within("c joins", c.join(node("c"))).await {
        Err(RdzvError::SettingsMismatch { message, .. }) => {
            assert!(message.contains("\"hang_timeout\":\"auto\""), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // d (without the flag) closes the round: every member's round carries the job's value.
    let d = http_client(vec![server.endpoint()], "jh", calm(3, 3)).await;
    let (ra, rd) = tokio::join!(within("a", a.join(node("a"))), within("d", d.join(node("d"))));
    assert_eq!(ra.expect("a's round").hang_timeout, hang);
    assert_eq!(rd.expect("d's round").hang_timeout, hang);
    server.stop().await;
}

#[tokio::test]
async fn metrics_escape_node_ids_so_distinct_nodes_keep_distinct_series() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv, None));
    for id in [r#"a"b"#, "a_b", r"a\b"] {
        let body = json!({"settings": calm(4, 4), "node": node(id), "wait_ms": 0});
        let (status, body) = send(&app, post_json("/v1/jobs/esc/join", &body)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let (status, body) = send(&app, Request::get("/metrics").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::OK);
    let text = body.as_str().expect("metrics are text");
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("rlaunch_rdzv_node_suspected{"))
        .map(|l| l.rsplit_once(' ').expect("name and value").0)
        .collect();
    let mut distinct = series.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "one series per node: {series:?}");
    for label in [r#"node_id="a\"b""#, r#"node_id="a_b""#, r#"node_id="a\\b""#] {
        assert!(series.iter().any(|s| s.contains(label)), "{label} missing from {series:?}");
    }
}

#[tokio::test]
async fn a_straggler_report_naming_another_nodes_ranks_is_not_taken() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv, None));
    let mut secrets = Vec::new();
    for id in ["a", "b"] {
        let body = json!({"settings": calm(2, 2), "node": node(id), "wait_ms": 0});
        let (status, body) = send(&app, post_json("/v1/jobs/st/join", &body)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        secrets.push(body["secret"].as_str().expect("a secret").to_owned());
    }
    // a runs ranks 0 and 1, b ranks 2 and 3; b claims rank 0 waits least of all.
    let steps = |ranks: &[(u32, u64)]| -> Value {
        ranks.iter().map(|(r, us)| json!({"rank": r, "mean_wait_us": us, "window": 20})).collect()
    };
    for (id, secret, ranks) in
        [("a", &secrets[0], vec![(0, 50_000), (1, 49_000)]), ("b", &secrets[1], vec![(0, 1), (2, 40_000), (3, 45_000)])]
    {
        let body = json!({"node_id": id, "secret": secret, "steps": steps(&ranks)});
        let (status, body) = send(&app, post_json("/v1/jobs/st/heartbeat", &body)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let (status, body) = send(&app, Request::get("/v1/jobs/st").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let straggler = &body["straggler"];
    assert_eq!((straggler["rank"].as_u64(), straggler["node_id"].as_str()), (Some(2), Some("b")), "{body}");
    assert_eq!(straggler["ranks"].as_u64(), Some(4), "b's claim on rank 0 dropped: {body}");
}

/// A join request as it reaches the router from `peer` (the server records each connection's
/// peer address).
fn join_from(peer: &str, run_id: &str, body: &Value) -> Request<Body> {
    let mut req = post_json(&format!("/v1/jobs/{run_id}/join"), body);
    let peer: SocketAddr = peer.parse().expect("a socket address");
    req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
    req
}

#[tokio::test]
async fn a_join_may_advertise_only_the_address_it_came_from_unless_the_service_trusts_them() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv.clone(), None));
    let own = |id: &str, probe: &str| NodeInfo {
        store_addr: "10.0.0.5:29500".parse().unwrap(),
        probe_addr: Some(probe.parse().unwrap()),
        snapshot_addr: None,
        snapshot_key: None,
        snapshots: Vec::new(),
        ..node(id)
    };
    // A node at 10.0.0.5 pointing others' probes at their own loopback: refused, nothing kept.
    let body = json!({"settings": calm(2, 2), "node": own("x", "127.0.0.1:39999"), "wait_ms": 0});
    let (status, body) = send(&app, join_from("10.0.0.5:41000", "adv", &body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["message"].as_str().unwrap_or_default().contains("not the address this join came from"), "{body}");
    assert!(job(&rdzv, "adv").await.is_none(), "a refused first join creates no job");
    // Its own address, from there: taken.
    let body = json!({"settings": calm(2, 2), "node": own("a", "10.0.0.5:29400"), "wait_ms": 0});
    let (status, body) = send(&app, join_from("10.0.0.5:41001", "adv", &body)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // Another host's address: refused.
    let body = json!({"settings": calm(2, 2), "node": own("b", "10.0.0.5:29400"), "wait_ms": 0});
    let (status, body) = send(&app, join_from("10.0.0.6:41002", "adv", &body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(job(&rdzv, "adv").await.expect("the job").pending.len(), 1, "only a waits");
    // A service told to trust advertised addresses (behind NAT) takes them.
    let mut trusting = AppState::new(rdzv.clone(), None);
    trusting.trust_advertised_addrs = true;
    let app = api::router(trusting);
    let (status, body) = send(&app, join_from("10.0.0.6:41003", "adv", &body_of("b"))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

fn body_of(id: &str) -> Value {
    let n = NodeInfo {
        store_addr: "10.0.0.5:29500".parse().unwrap(),
        probe_addr: Some("10.0.0.5:29400".parse().unwrap()),
        snapshot_addr: None,
        snapshot_key: None,
        snapshots: Vec::new(),
        ..node(id)
    };
    json!({"settings": calm(2, 2), "node": n, "wait_ms": 0})
}

#[tokio::test]
async fn a_run_id_whose_job_finished_takes_a_new_job_once_the_old_nodes_left_and_refuses_them() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv.clone(), None));
    let (status, body) =
        send(&app, post_json("/v1/jobs/k8s-train/join", &json!({"settings": fast(1, 1), "node": node("a")}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let secret = body["secret"].as_str().expect("a secret").to_owned();
    let done = json!({"node_id": "a", "secret": secret, "round": body["data"]["round"]});
    assert_eq!(send(&app, post_json("/v1/jobs/k8s-train/success", &done)).await.0, StatusCode::OK);
    // a is still about: the run id is still the old job's.
    let fresh = json!({"settings": fast(1, 1), "node": node("b2"), "wait_ms": 0});
    let (status, body) = send(&app, post_json("/v1/jobs/k8s-train/join", &fresh)).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::GONE, Some("job_finished")), "{body}");
    // a leaves (its agent exits): a new agent's join starts a new job at once.
    let leave = json!({"node_id": "a", "secret": secret});
    assert_eq!(send(&app, post_json("/v1/jobs/k8s-train/leave", &leave)).await.0, StatusCode::OK);
    let (status, body) = send(&app, post_json("/v1/jobs/k8s-train/join", &fresh)).await;
    assert_eq!((status, body["status"].as_str()), (StatusCode::OK, Some("round")), "{body}");
    let now = job(&rdzv, "k8s-train").await.expect("the new job");
    assert_eq!((now.generation, now.phase.name(), now.restart_count), (1, "running", 0));
    // a, late, is told its job finished and is not taken in.
    let late = json!({"settings": fast(1, 1), "node": node("a"), "wait_ms": 0});
    let (status, body) = send(&app, post_json("/v1/jobs/k8s-train/join", &late)).await;
    assert_eq!((status, body["error"].as_str()), (StatusCode::GONE, Some("job_finished")), "{body}");
    assert_eq!(job(&rdzv, "k8s-train").await.expect("the new job"), now, "untouched");
}

#[tokio::test]
async fn a_host_name_is_taken_only_when_it_resolves_to_where_the_join_came_from() {
    let rdzv = Rendezvous::in_memory();
    let app = api::router(AppState::new(rdzv.clone(), None));
    // `localhost` resolves here, to loopback: not to 10.0.0.5, where the join comes from.
    let named = NodeInfo { store_addr: "localhost:29500".parse().unwrap(), probe_addr: None, ..node("x") };
    let body = json!({"settings": calm(2, 2), "node": named, "wait_ms": 0});
    let (status, body) = send(&app, join_from("10.0.0.5:41000", "names", &body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["message"].as_str().unwrap_or_default().contains("`localhost:29500` is not the address"), "{body}");
    // A name that does not resolve at all is refused too.
    let named = NodeInfo { store_addr: "no-such-host.invalid:29500".parse().unwrap(), probe_addr: None, ..node("y") };
    let body = json!({"settings": calm(2, 2), "node": named, "wait_ms": 0});
    let (status, body) = send(&app, join_from("10.0.0.5:41001", "names", &body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(job(&rdzv, "names").await.is_none(), "nothing kept");
}

#[tokio::test]
async fn a_busy_resolver_is_a_503_the_agent_retries_not_a_refusal() {
    let e = RdzvError::Busy { message: "cannot resolve `n` now (too many lookups in progress); try again".into() };
    assert!(e.is_transient(), "agents try again");
    let resp = api::ApiError::from(e).into_response();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let bytes = within("body", axum::body::to_bytes(resp.into_body(), 1 << 16)).await.expect("body");
    let v: Value = serde_json::from_slice(&bytes).expect("json");
    assert!(v["message"].as_str().unwrap_or_default().contains("too many lookups"), "{v}");
}

#[tokio::test]
async fn the_client_does_not_follow_a_redirect_with_a_nodes_join() {
    // Whatever listens where the redirect points counts the connections it gets.
    let collector = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let target = format!("http://{}/v1/jobs/redir/join", collector.local_addr().expect("addr"));
    let reached = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = reached.clone();
    let collecting = tokio::spawn(async move {
        while let Ok((_conn, _)) = collector.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let redirecting = axum::Router::new().fallback(move || {
        let target = target.clone();
        async move { (StatusCode::PERMANENT_REDIRECT, [(header::LOCATION, target)]) }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let serving = tokio::spawn(async move { axum::serve(listener, redirecting).await });
    let client = http_client(vec![addr.to_string()], "redir", calm(1, 1)).await;
    let joined = within("join", client.join_once(&node("a"), Duration::ZERO)).await;
    assert!(joined.is_err(), "a redirect is not an answer: {joined:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(reached.load(std::sync::atomic::Ordering::SeqCst), 0, "the join (and its secret) went nowhere else");
    serving.abort();
    collecting.abort();
}

/// Issue 34: with snapshots on, every join answer carried the whole member list, so a round's
/// cost grew with the square of the job (3,000 nodes: 15 s to close). The agents' snapshot
/// protocol is all-to-all and takes at most `MAX_SNAPSHOT_NODES` members; past that, the list is
/// not sent (the agents say snapshots are off for the round) and the round costs what it costs
/// without snapshots.
#[tokio::test]
async fn past_the_nodes_snapshots_support_a_join_answers_no_member_list() {
    use rlaunch::contract::MAX_SNAPSHOT_NODES;
    use rlaunch_rendezvous::service::JoinAnswer;
    let rdzv = Rendezvous::in_memory();
    for (n, listed) in [(3usize, true), (MAX_SNAPSHOT_NODES, true), (MAX_SNAPSHOT_NODES + 1, false)] {
        let mut s = fast(n as u32, n as u32);
        s.node_ttl = Duration::from_secs(60);
        s.join_timeout = Duration::from_secs(120);
        let run = format!("big{n}");
        for i in 0..n - 1 {
            rdzv.join(&run, &s, node(&format!("n{i}")), None, true, Duration::ZERO).await.expect("joins");
        }
        let last = rdzv.join(&run, &s, node("last"), None, true, Duration::from_secs(5)).await.expect("joins");
        let JoinAnswer::Round(info) = last.answer else { panic!("the round closed: {:?}", last.answer) };
        assert_eq!(info.group_world_size as usize, n);
        assert_eq!(info.members.len(), if listed { n } else { 0 }, "{n} nodes");
    }
}

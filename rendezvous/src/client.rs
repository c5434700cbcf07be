//! The client agents use, whatever runs the rendezvous: a server over HTTP (several endpoints,
//! failing over), etcd directly (this process runs the machine), or a [`Rendezvous`] in this
//! process (`--standalone`, agent-hosted server).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::Method;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::api::{
    ErrorBody, FailureRequest, HeartbeatRequest, JoinRequest, NodeRequest, ProgressRequest, StacksRequest,
    SuccessRequest, WatchRequest,
};
use crate::endpoint::Endpoint;
use crate::error::RdzvError;
use crate::round::{JobSettings, JobStatus, NodeInfo, RoundInfo};
use crate::service::{Beat, HeartbeatAnswer, JoinAnswer, Joined, Rendezvous, WatchEvent};
use crate::store::etcd::EtcdStore;
use crate::store::Store;

/// How long one join or watch long-poll waits server-side before answering "wait"/"no change".
pub const POLL_WAIT: Duration = Duration::from_secs(5);
/// Extra time a long-poll request gets on top of its wait before the client gives up on it
/// (a round of a thousand nodes is a large answer for a busy server).
const POLL_SLACK: Duration = Duration::from_secs(10);
/// How long `join` keeps retrying a rendezvous that does not answer at all.
const UNAVAILABLE_PATIENCE: Duration = Duration::from_secs(60);
/// Bound on short requests other than heartbeats.
const SHORT_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Where the rendezvous runs.
#[derive(Clone)]
pub enum Backend {
    /// `rlaunch-rendezvous` servers (`host:port`, `http://host:port` or `https://host:port`,
    /// verified as [`ClientTls`] says); tried in order, the one that last answered first.
    Http { endpoints: Vec<Endpoint>, token: Option<String> },
    /// etcd v3 endpoints (`host:2379` or `http://host:2379`): this process runs the machine.
    Etcd { endpoints: Vec<Endpoint> },
    /// A rendezvous in this process (shared with a server this process may also host).
    InProcess(Arc<Rendezvous>),
}

/// How a client verifies `https://` endpoints ([`crate::tls`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// A private CA bundle (PEM), then the only roots trusted; none: the system's roots.
    pub ca_file: Option<std::path::PathBuf>,
}

/// One job's rendezvous, seen from an agent. Cheap to clone.
#[derive(Clone)]
pub struct RendezvousClient {
    run_id: Arc<str>,
    settings: JobSettings,
    /// Whether joins ask for the member list ([`RendezvousClient::asking_members`]).
    members: bool,
    inner: Arc<Inner>,
}

struct Inner {
    transport: Transport,
    /// Each node's secret, as its last join answered: in memory only, never written anywhere.
    secrets: Arc<Mutex<HashMap<String, String>>>,
    /// Secrets proposed for first joins, by node id ([`RendezvousClient::proposal`]).
    proposals: Arc<Mutex<HashMap<String, String>>>,
    /// etcd only: the lease keep-alive task of each node this process joined.
    keepers: Mutex<HashMap<String, JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for (_, task) in self.keepers.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            task.abort();
        }
    }
}

enum Transport {
    Http(HttpTransport),
    Local { rdzv: Arc<Rendezvous>, etcd: bool },
}

struct HttpTransport {
    http: reqwest::Client,
    endpoints: Vec<Endpoint>,
    token: Option<String>,
    current: AtomicUsize,
}

impl HttpTransport {
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Duration,
    ) -> Result<T, RdzvError> {
        let n = self.endpoints.len();
        let start = self.current.load(Ordering::Relaxed) % n;
        let mut last: Option<reqwest::Error> = None;
        let mut bad_certificate: Option<RdzvError> = None;
        let mut tried = Vec::new();
        for i in 0..n {
            let idx = (start + i) % n;
            let endpoint = &self.endpoints[idx];
            tried.push(endpoint.to_string());
            let mut req = self.http.request(method.clone(), endpoint.url(path)).timeout(timeout);
            if let Some(token) = &self.token {
                req = req.bearer_auth(token);
            }
            if let Some(body) = &body {
                req = req.json(body);
            }
            let resp = match req.send().await {
                Ok(resp) => resp,
                Err(error) => {
                    debug!(endpoint = %endpoint, error = %error, "rendezvous endpoint did not answer; failing over");
                    if let Some(reason) = crate::tls::certificate_error(&error) {
                        bad_certificate = Some(RdzvError::Certificate { endpoint: endpoint.to_string(), reason });
                    }
                    last = Some(error);
                    continue;
                }
            };
            let status = resp.status();
            if status.is_server_error() {
                warn!(endpoint = %endpoint, status = status.as_u16(), "rendezvous endpoint failed; failing over");
                continue;
            }
            self.current.store(idx, Ordering::Relaxed);
            if status.is_success() {
                return resp.json::<T>().await.map_err(|e| RdzvError::Server {
                    endpoint: endpoint.to_string(),
                    status: status.as_u16(),
                    message: format!("unreadable answer: {e}"),
                });
            }
            let body: Option<ErrorBody> = resp.json().await.ok();
            return Err(error_from(endpoint, status.as_u16(), body));
        }
        // An endpoint that is not who it says is a configuration error, not an outage.
        Err(bad_certificate.unwrap_or(RdzvError::Unavailable { tried: tried.join(", "), source: last }))
    }
}

/// Rebuilds the library error a server's 4xx answer stands for.
fn error_from(endpoint: &Endpoint, status: u16, body: Option<ErrorBody>) -> RdzvError {
    let Some(ErrorBody { error, message }) = body else {
        return RdzvError::Server { endpoint: endpoint.to_string(), status, message: "no error body".to_owned() };
    };
    // "unknown job `x`" → "x": the server names the job or node between backticks.
    let quoted = |m: &str| m.split('`').nth(1).map(str::to_owned).unwrap_or_else(|| m.to_owned());
    match error.as_str() {
        "unauthorized" => RdzvError::Unauthorized,
        "forbidden" => RdzvError::Forbidden { node_id: quoted(&message) },
        "limit_reached" => RdzvError::LimitReached { message },
        "unknown_job" => RdzvError::UnknownJob { run_id: quoted(&message) },
        "unknown_node" => RdzvError::UnknownNode { node_id: quoted(&message) },
        "job_finished" => RdzvError::JobFinished,
        "job_failed" => RdzvError::JobFailed { reason: message },
        "join_timeout" => RdzvError::JoinTimeout { reason: message },
        "settings_mismatch" => RdzvError::SettingsMismatch { run_id: String::new(), message },
        "fingerprint_mismatch" => RdzvError::FingerprintMismatch { message },
        "bad_request" | "invalid_settings" | "payload_too_large" | "unsupported_media_type" => {
            RdzvError::BadRequest { message }
        }
        _ => RdzvError::Server { endpoint: endpoint.to_string(), status, message },
    }
}

#[derive(serde::Deserialize)]
struct Empty {}

fn json(body: &impl Serialize) -> serde_json::Value {
    serde_json::to_value(body).expect("request bodies are plain data that always serialize")
}

impl RendezvousClient {
    /// Validates `settings` and connects to the backend (for HTTP nothing is sent yet);
    /// `https://` endpoints verified against the system's roots.
    pub async fn connect(backend: Backend, run_id: &str, settings: JobSettings) -> Result<Self, RdzvError> {
        Self::connect_with(backend, run_id, settings, &ClientTls::default()).await
    }

    /// [`RendezvousClient::connect`], `https://` endpoints verified as `tls` says. A token
    /// that would go in clear to another host (`http://`) is warned about.
    pub async fn connect_with(
        backend: Backend,
        run_id: &str,
        settings: JobSettings,
        tls: &ClientTls,
    ) -> Result<Self, RdzvError> {
        crate::service::validate_run_id(run_id)?;
        settings.validate()?;
        let transport = match backend {
            Backend::Http { endpoints, token } => {
                if endpoints.is_empty() {
                    return Err(RdzvError::BadRequest { message: "no rendezvous endpoint given".to_owned() });
                }
                if token.is_some() {
                    for e in endpoints.iter().filter(|e| crate::tls::cleartext_to_another_host(e)) {
                        warn!(
                            endpoint = %e,
                            "the rendezvous token goes to this endpoint in clear (http://): anyone on the path can \
                             read it and the nodes' secrets; serve the rendezvous over https (--tls-cert/--tls-key)"
                        );
                    }
                }
                // No redirects: a 307/308 would send the join's body, which carries the node's
                // secret, wherever the answer points.
                let mut builder = reqwest::Client::builder()
                    .no_proxy()
                    .redirect(reqwest::redirect::Policy::none())
                    .connect_timeout(CONNECT_TIMEOUT)
                    .tcp_nodelay(true);
                if let Some(ca) = &tls.ca_file {
                    builder = builder.tls_certs_only(crate::tls::ca_bundle(ca)?);
                }
                let http = builder.build().map_err(|e| RdzvError::Unavailable {
                    tried: "building the HTTP client".to_owned(),
                    source: Some(e),
                })?;
                Transport::Http(HttpTransport { http, endpoints, token, current: AtomicUsize::new(0) })
            }
            Backend::Etcd { endpoints } => {
                // The store parses them (`host:2379` is `http://host:2379`).
                let store = EtcdStore::connect(&endpoints).await?;
                Transport::Local { rdzv: Rendezvous::new(Store::Etcd(store)), etcd: true }
            }
            Backend::InProcess(rdzv) => Transport::Local { rdzv, etcd: false },
        };
        Ok(Self {
            run_id: Arc::from(run_id),
            settings,
            members: false,
            inner: Arc::new(Inner {
                transport,
                secrets: Arc::new(Mutex::new(HashMap::new())),
                proposals: Arc::new(Mutex::new(HashMap::new())),
                keepers: Mutex::new(HashMap::new()),
            }),
        })
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Joins answer the round's whole member list (an agent holding snapshots needs every
    /// member's ranks, address and parts).
    pub fn asking_members(mut self, members: bool) -> Self {
        self.members = members;
        self
    }

    pub fn settings(&self) -> &JobSettings {
        &self.settings
    }

    fn path(&self, op: &str) -> String {
        format!("/v1/jobs/{}/{op}", self.run_id)
    }

    /// The secret `node_id` holds, if a join answered one.
    fn secret(&self, node_id: &str) -> Option<crate::identity::Secret> {
        self.inner.secrets.lock().unwrap_or_else(|p| p.into_inner()).get(node_id).cloned().map(Into::into)
    }

    /// The secret this client proposes for `node_id`'s first join, the same on every retry
    /// until an answer keys the node (a lost first answer then costs nothing).
    fn proposal(&self, node_id: &str) -> String {
        self.inner
            .proposals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(node_id.to_owned())
            .or_insert_with(crate::identity::mint)
            .clone()
    }

    fn forget_secret(&self, node_id: &str) {
        self.inner.secrets.lock().unwrap_or_else(|p| p.into_inner()).remove(node_id);
    }

    /// One join call: a round, or "wait" after at most `wait`. Presents the node's secret when
    /// it has one and keeps the one answered.
    pub async fn join_once(&self, node: &NodeInfo, wait: Duration) -> Result<JoinAnswer, RdzvError> {
        let secret = self.secret(&node.node_id);
        let joined: Joined = match &self.inner.transport {
            Transport::Http(h) => {
                let proposed_secret = secret.is_none().then(|| self.proposal(&node.node_id).into());
                let body = JoinRequest {
                    settings: self.settings.clone(),
                    node: node.clone(),
                    secret,
                    proposed_secret,
                    members: self.members,
                    wait_ms: Some(wait.as_millis() as u64),
                };
                h.call(Method::POST, &self.path("join"), Some(json(&body)), wait + POLL_SLACK).await?
            }
            Transport::Local { rdzv, .. } => {
                let proposed = secret.is_none().then(|| self.proposal(&node.node_id));
                rdzv.join_proposing(
                    &self.run_id,
                    &self.settings,
                    node.clone(),
                    secret.as_deref(),
                    proposed.as_deref(),
                    self.members,
                    wait,
                )
                .await?
            }
        };
        if !joined.secret.is_empty() {
            self.inner.secrets.lock().unwrap_or_else(|p| p.into_inner()).insert(node.node_id.clone(), joined.secret);
        }
        if let Transport::Local { etcd: true, .. } = &self.inner.transport {
            self.ensure_keeper(&node.node_id);
        }
        Ok(joined.answer)
    }

    /// Joins and resolves when a round including this node closes; heartbeats for the node
    /// while it waits. Errors: `JobFailed`, `JoinTimeout`, `JobFinished`, or the backend's.
    pub async fn join(&self, node: NodeInfo) -> Result<RoundInfo, RdzvError> {
        let node_id = node.node_id.clone();
        let beat = async {
            let mut every = tokio::time::interval(self.settings.heartbeat_interval);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await;
            loop {
                every.tick().await;
                if let Err(error) = self.heartbeat(&node_id, Beat::default()).await {
                    debug!(node_id = %node_id, error = %error, "heartbeat while joining failed");
                }
            }
        };
        let join = async {
            // A rendezvous briefly unreachable (a replica restarting, an overloaded server) is
            // retried; unreachable for longer than this, the join fails.
            let patience = self.settings.join_timeout.min(UNAVAILABLE_PATIENCE);
            let mut unavailable_since: Option<tokio::time::Instant> = None;
            let mut backoff = Duration::from_millis(100);
            loop {
                // A node without a secret asks for one at once (its heartbeats need it), then
                // long-polls.
                let wait = if self.secret(&node.node_id).is_some() { POLL_WAIT } else { Duration::ZERO };
                match self.join_once(&node, wait).await {
                    Ok(JoinAnswer::Round(info)) => return Ok(info),
                    Ok(JoinAnswer::Wait { round, state }) => {
                        unavailable_since = None;
                        debug!(node_id = %node.node_id, round, state = %state, "still waiting for a round");
                    }
                    // Forbidden: the job holds a key for this id that is not ours. The answer to our
                    // first join was lost (the entry lapses within TTL + probe timeout, then the id
                    // is free), or another agent uses the same node id. Like an unreachable
                    // rendezvous, that is waited out within the patience.
                    // A service at one of its bounds (jobs, pending nodes: 429) has room again
                    // once finished jobs are forgotten or a round closes: waited out too.
                    Err(e)
                        if e.is_transient()
                            || matches!(e, RdzvError::Forbidden { .. } | RdzvError::LimitReached { .. }) =>
                    {
                        let held = matches!(e, RdzvError::Forbidden { .. });
                        if held {
                            self.forget_secret(&node.node_id);
                        }
                        let since = *unavailable_since.get_or_insert_with(tokio::time::Instant::now);
                        if since.elapsed() >= patience {
                            return Err(e);
                        }
                        let why = match e {
                            RdzvError::Forbidden { .. } => "node id held by another agent",
                            RdzvError::LimitReached { .. } => "rendezvous at a bound",
                            _ => "rendezvous unreachable",
                        };
                        warn!(node_id = %node.node_id, error = %e, "{why}; retrying the join");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        tokio::select! {
            r = join => r,
            () = beat => unreachable!("the heartbeat loop never ends"),
        }
    }

    /// Tells the rendezvous this node is alive, with its counter and the outcomes of probes it
    /// was asked for; answers the probes it owes now. Call every heartbeat interval without
    /// waiting for the previous answer (several may be in flight: one lost packet must not
    /// silence a node). `UnknownNode` means the node was declared lost: stop workers and rejoin.
    pub async fn heartbeat(&self, node_id: &str, beat: Beat) -> Result<HeartbeatAnswer, RdzvError> {
        match &self.inner.transport {
            Transport::Http(h) => {
                // A heartbeat that arrives late still counts (until the probes' verdict): give
                // it that long, retransmitting on its kept-alive connection, rather than give up
                // and reconnect (a lost SYN costs a second).
                let timeout = (self.settings.node_ttl + self.settings.probe_timeout).max(Duration::from_millis(250));
                let body = HeartbeatRequest { node_id: node_id.to_owned(), secret: self.secret(node_id), beat };
                h.call(Method::POST, &self.path("heartbeat"), Some(json(&body)), timeout).await
            }
            Transport::Local { rdzv, .. } => {
                rdzv.heartbeat(&self.run_id, node_id, self.secret(node_id).as_deref(), beat).await
            }
        }
    }

    /// Waits (bounded) for the job to leave round `after_round`; as `node_id` (with its
    /// secret) when given.
    pub async fn watch(&self, node_id: Option<&str>, after_round: u64) -> Result<WatchEvent, RdzvError> {
        let secret = node_id.and_then(|id| self.secret(id));
        match &self.inner.transport {
            Transport::Http(h) => {
                let body = WatchRequest {
                    after_round,
                    node_id: node_id.map(str::to_owned),
                    secret,
                    wait_ms: Some(POLL_WAIT.as_millis() as u64),
                };
                h.call(Method::POST, &self.path("watch"), Some(json(&body)), POLL_WAIT + POLL_SLACK).await
            }
            Transport::Local { rdzv, .. } => {
                let node = node_id.map(|id| (id, secret.as_deref()));
                rdzv.watch(&self.run_id, after_round, node, POLL_WAIT).await
            }
        }
    }

    /// Reports a worker failure in `round`; counted once per round in the global budget.
    pub async fn report_failure(
        &self,
        node_id: &str,
        round: u64,
        root_cause: Box<crate::round::RootCause>,
    ) -> Result<(), RdzvError> {
        match &self.inner.transport {
            Transport::Http(h) => {
                let body =
                    FailureRequest { node_id: node_id.to_owned(), secret: self.secret(node_id), round, root_cause };
                h.call::<Empty>(Method::POST, &self.path("failure"), Some(json(&body)), SHORT_TIMEOUT).await.map(|_| ())
            }
            Transport::Local { rdzv, .. } => {
                let secret = self.secret(node_id);
                rdzv.report_failure(&self.run_id, node_id, secret.as_deref(), round, root_cause).await
            }
        }
    }

    /// Says where this node's ranks stood when `round` ended by a failure elsewhere.
    pub async fn report_stacks(&self, node_id: &str, round: u64, stacks: Vec<String>) -> Result<(), RdzvError> {
        match &self.inner.transport {
            Transport::Http(h) => {
                let body = StacksRequest { node_id: node_id.to_owned(), secret: self.secret(node_id), round, stacks };
                h.call::<Empty>(Method::POST, &self.path("stacks"), Some(json(&body)), SHORT_TIMEOUT).await.map(|_| ())
            }
            Transport::Local { rdzv, .. } => {
                rdzv.report_stacks(&self.run_id, node_id, self.secret(node_id).as_deref(), round, stacks).await
            }
        }
    }

    /// Says how far this node got in `round`, for the recovery accounting.
    pub async fn report_progress(
        &self,
        node_id: &str,
        round: u64,
        progress: rlaunch::contract::NodeProgress,
    ) -> Result<(), RdzvError> {
        match &self.inner.transport {
            Transport::Http(h) => {
                let body =
                    ProgressRequest { node_id: node_id.to_owned(), secret: self.secret(node_id), round, progress };
                h.call::<Empty>(Method::POST, &self.path("progress"), Some(json(&body)), SHORT_TIMEOUT)
                    .await
                    .map(|_| ())
            }
            Transport::Local { rdzv, .. } => {
                rdzv.report_progress(&self.run_id, node_id, self.secret(node_id).as_deref(), round, progress).await
            }
        }
    }

    /// Reports that this node's workers all succeeded in `round`.
    pub async fn report_success(&self, node_id: &str, round: u64) -> Result<(), RdzvError> {
        match &self.inner.transport {
            Transport::Http(h) => {
                let body = SuccessRequest { node_id: node_id.to_owned(), secret: self.secret(node_id), round };
                h.call::<Empty>(Method::POST, &self.path("success"), Some(json(&body)), SHORT_TIMEOUT).await.map(|_| ())
            }
            Transport::Local { rdzv, .. } => {
                rdzv.report_success(&self.run_id, node_id, self.secret(node_id).as_deref(), round).await
            }
        }
    }

    /// Leaves the job (a running member leaving opens a new round for the others).
    pub async fn leave(&self, node_id: &str) -> Result<(), RdzvError> {
        if let Some(task) = self.inner.keepers.lock().unwrap_or_else(|p| p.into_inner()).remove(node_id) {
            task.abort();
        }
        let secret = self.secret(node_id);
        let left = match &self.inner.transport {
            Transport::Http(h) => {
                let body = NodeRequest { node_id: node_id.to_owned(), secret };
                h.call::<Empty>(Method::POST, &self.path("leave"), Some(json(&body)), SHORT_TIMEOUT).await.map(|_| ())
            }
            Transport::Local { rdzv, .. } => rdzv.leave(&self.run_id, node_id, secret.as_deref()).await,
        };
        if left.is_ok() {
            self.forget_secret(node_id);
        }
        left
    }

    pub async fn status(&self) -> Result<JobStatus, RdzvError> {
        match &self.inner.transport {
            Transport::Http(h) => h.call(Method::GET, &format!("/v1/jobs/{}", self.run_id), None, SHORT_TIMEOUT).await,
            Transport::Local { rdzv, .. } => rdzv.status(&self.run_id).await,
        }
    }

    /// etcd only: keeps the node's lease alive every TTL/3 on a task of its own, so a busy
    /// agent never lets it lapse.
    fn ensure_keeper(&self, node_id: &str) {
        let mut keepers = self.inner.keepers.lock().unwrap_or_else(|p| p.into_inner());
        if keepers.get(node_id).is_some_and(|t| !t.is_finished()) {
            return;
        }
        let Transport::Local { rdzv, .. } = &self.inner.transport else { return };
        let (rdzv, run_id, node) = (Arc::downgrade(rdzv), self.run_id.clone(), node_id.to_owned());
        let secrets = Arc::downgrade(&self.inner.secrets);
        let period = self.settings.node_ttl / 3;
        let task = tokio::spawn(async move {
            let mut every = tokio::time::interval(period);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let (Some(rdzv), Some(secrets)) = (rdzv.upgrade(), secrets.upgrade()) else { return };
                let secret = secrets.lock().unwrap_or_else(|p| p.into_inner()).get(&node).cloned();
                match rdzv.heartbeat(&run_id, &node, secret.as_deref(), Beat::default()).await {
                    Ok(_) => {}
                    // Lease gone: the node was declared lost; its next join registers anew.
                    Err(RdzvError::UnknownNode { .. }) => return,
                    Err(error) => warn!(node_id = %node, error = %error, "lease keep-alive failed"),
                }
            }
        });
        keepers.insert(node_id.to_owned(), task);
    }
}

//! The one error type of the rendezvous library, shared by the service, its stores and the client.

use crate::endpoint::EndpointError;
use crate::round::{FailureKind, Rejection, SettingsError};

/// Everything that can go wrong talking to (or running) a rendezvous.
#[derive(Debug, thiserror::Error)]
pub enum RdzvError {
    /// The detail is part of the message (not a `source`): agents often print only the top line.
    #[error("invalid rendezvous settings: {0}")]
    InvalidSettings(SettingsError),
    #[error("bad request: {message}")]
    BadRequest { message: String },
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("unknown job `{run_id}`")]
    UnknownJob { run_id: String },
    #[error("node `{node_id}` is unknown to the job (never joined, left, or declared lost): rejoin")]
    UnknownNode { node_id: String },
    #[error("node `{node_id}` is not a member of round {round}")]
    NotMember { node_id: String, round: u64 },
    #[error("node `{node_id}` is held by another agent: calls for it must carry the secret its join answered")]
    Forbidden { node_id: String },
    /// A bound of the service (jobs per service, nodes per job) is reached.
    #[error("{message}")]
    LimitReached { message: String },
    #[error("job `{run_id}` exists with other settings: {message}")]
    SettingsMismatch { run_id: String, message: String },
    /// `--fingerprint strict`: this node differs from the job's first.
    #[error("{message}")]
    FingerprintMismatch { message: String },
    #[error("the job has finished")]
    JobFinished,
    #[error("the job has failed: {reason}")]
    JobFailed { reason: String },
    #[error("rendezvous join timed out: {reason}")]
    JoinTimeout { reason: String },
    #[error("rendezvous server {endpoint} answered {status}: {message}")]
    Server { endpoint: String, status: u16, message: String },
    #[error("no rendezvous endpoint answered (tried {tried})")]
    Unavailable {
        tried: String,
        #[source]
        source: Option<reqwest::Error>,
    },
    /// A TLS file (the CA bundle) cannot be used: a configuration error.
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    /// An `https://` endpoint's certificate does not verify against the trusted roots: not
    /// retried, the token is not sent.
    #[error(
        "the rendezvous at {endpoint} presented a certificate that does not verify ({reason}); a private CA is given with --rdzv-conf tls_ca=PATH"
    )]
    Certificate { endpoint: String, reason: String },
    #[error("etcd request failed during {op}")]
    Etcd {
        op: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    #[error("stored state of job `{run_id}` is unreadable")]
    Corrupt {
        run_id: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("job `{run_id}`: gave up after {attempts} conflicting concurrent updates")]
    Contention { run_id: String, attempts: u32 },
    #[error("job state update failed: {message}")]
    Store { message: String },
    /// The service cannot take the request now (its resolver is slow or busy); 503, and
    /// clients try again.
    #[error("{message}")]
    Busy { message: String },
}

impl RdzvError {
    /// Short machine-readable code, used in HTTP error bodies and mapped back by the client.
    pub fn code(&self) -> &'static str {
        match self {
            RdzvError::InvalidSettings(_) => "invalid_settings",
            RdzvError::BadRequest { .. } => "bad_request",
            RdzvError::Unauthorized => "unauthorized",
            RdzvError::UnknownJob { .. } => "unknown_job",
            RdzvError::UnknownNode { .. } => "unknown_node",
            RdzvError::NotMember { .. } => "not_member",
            RdzvError::Forbidden { .. } => "forbidden",
            RdzvError::LimitReached { .. } => "limit_reached",
            RdzvError::SettingsMismatch { .. } => "settings_mismatch",
            RdzvError::FingerprintMismatch { .. } => "fingerprint_mismatch",
            RdzvError::JobFinished => "job_finished",
            RdzvError::JobFailed { .. } => "job_failed",
            RdzvError::JoinTimeout { .. } => "join_timeout",
            RdzvError::Server { .. } | RdzvError::Unavailable { .. } | RdzvError::Busy { .. } => "unavailable",
            RdzvError::Tls(_) | RdzvError::Certificate { .. } => "tls",
            RdzvError::Etcd { .. }
            | RdzvError::Corrupt { .. }
            | RdzvError::Contention { .. }
            | RdzvError::Store { .. } => "internal",
        }
    }

    /// Whether the error is the caller's fault (4xx) rather than the service's (5xx).
    pub fn is_client_error(&self) -> bool {
        self.code() != "internal" && self.code() != "unavailable"
    }

    /// Whether trying again later may succeed: the service was unreachable or failed, as
    /// opposed to refusing the request.
    pub fn is_transient(&self) -> bool {
        match self {
            RdzvError::Unavailable { .. }
            | RdzvError::Busy { .. }
            | RdzvError::Etcd { .. }
            | RdzvError::Contention { .. }
            | RdzvError::Store { .. } => true,
            RdzvError::Server { status, .. } => *status >= 500 || (200..300).contains(status),
            _ => false,
        }
    }

    pub(crate) fn etcd(op: &'static str) -> impl FnOnce(etcd_client::Error) -> RdzvError {
        move |source| RdzvError::Etcd { op, source }
    }
}

/// An endpoint given that is not one: the caller's to fix.
impl From<EndpointError> for RdzvError {
    fn from(e: EndpointError) -> Self {
        RdzvError::BadRequest { message: e.to_string() }
    }
}

impl From<SettingsError> for RdzvError {
    fn from(e: SettingsError) -> Self {
        RdzvError::InvalidSettings(e)
    }
}

impl From<Rejection> for RdzvError {
    fn from(r: Rejection) -> Self {
        match r {
            Rejection::InvalidNode { message } => RdzvError::BadRequest { message },
            Rejection::UnknownNode { node_id } => RdzvError::UnknownNode { node_id },
            Rejection::NotMember { node_id, round } => RdzvError::NotMember { node_id, round },
            Rejection::JobFinished => RdzvError::JobFinished,
            Rejection::Forbidden { node_id } => RdzvError::Forbidden { node_id },
            Rejection::LimitReached { message } => RdzvError::LimitReached { message },
            Rejection::FingerprintMismatch { message } => RdzvError::FingerprintMismatch { message },
            Rejection::JobFailed { kind: FailureKind::JoinTimeout, reason } => RdzvError::JoinTimeout { reason },
            Rejection::JobFailed { kind: FailureKind::RestartBudget, reason } => RdzvError::JobFailed { reason },
        }
    }
}

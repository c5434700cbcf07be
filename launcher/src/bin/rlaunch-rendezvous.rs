//! `rlaunch-rendezvous`: the rendezvous service binary (flags → store → axum server).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use rlaunch_rendezvous::api::{self, AppState, ServeLimits};
use rlaunch_rendezvous::service::Limits;
use rlaunch_rendezvous::store::etcd::EtcdStore;
use rlaunch_rendezvous::Endpoint;
use rlaunch_rendezvous::{Rendezvous, Store};
use tracing::{info, warn};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    /// Everything in this process (one replica).
    Memory,
    /// etcd v3: any number of replicas serve the same jobs.
    Etcd,
}

/// The rlaunch rendezvous service: agents join rounds, heartbeat and watch for restarts here.
#[derive(Debug, Parser)]
#[command(name = "rlaunch-rendezvous", version)]
#[command(group = clap::ArgGroup::new("token_or_file").args(["token", "token_file"]))]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "RLAUNCH_RDZV_LISTEN", default_value = "0.0.0.0:29400")]
    listen: SocketAddr,
    /// Where job state lives.
    #[arg(long, env = "RLAUNCH_RDZV_STORE", value_enum, default_value_t = StoreKind::Memory)]
    store: StoreKind,
    /// etcd endpoints, comma-separated (with `--store etcd`).
    #[arg(long, env = "RLAUNCH_RDZV_ETCD_ENDPOINTS", value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    etcd_endpoints: Vec<String>,
    /// Bearer token every `/v1` request must carry (none: open). Prefer `--token-file` or the
    /// environment variable: a flag's value is visible in `ps`.
    #[arg(long, env = "RLAUNCH_RDZV_TOKEN", hide_env_values = true, conflicts_with = "token_file")]
    token: Option<String>,
    /// A file holding the bearer token (its first line).
    #[arg(long, env = "RLAUNCH_RDZV_TOKEN_FILE")]
    token_file: Option<std::path::PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM, the service's own certificate first);
    /// with `--tls-key`. Agents then use `https://` endpoints.
    #[arg(long, env = "RLAUNCH_RDZV_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of `--tls-cert` (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "RLAUNCH_RDZV_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// `/metrics` needs the token too (it names every job and node).
    #[arg(long, env = "RLAUNCH_RDZV_PROTECT_METRICS", requires = "token_or_file")]
    protect_metrics: bool,
    /// Largest request body, in bytes.
    #[arg(long, env = "RLAUNCH_RDZV_BODY_LIMIT", default_value_t = api::DEFAULT_BODY_LIMIT)]
    body_limit: usize,
    /// How long to keep trying to reach etcd at start (it may come up after this service).
    #[arg(long, env = "RLAUNCH_RDZV_ETCD_WAIT_MS", default_value_t = 30_000)]
    etcd_wait_ms: u64,
    /// Seconds of etcd's history kept: older revisions are compacted every minute (every job's
    /// writes add revisions; uncompacted, etcd's database grows to its quota and refuses writes).
    /// 0 keeps everything (for an etcd compacted by its own `--auto-compaction-retention`).
    #[arg(long, env = "RLAUNCH_RDZV_ETCD_HISTORY_S", default_value_t = 300)]
    etcd_history_s: u64,
    /// Most jobs the service holds at once (finished and failed ones count for an hour); a join
    /// that would create one more is refused with 429.
    #[arg(long, env = "RLAUNCH_RDZV_MAX_JOBS", default_value_t = Limits::default().max_jobs)]
    max_jobs: usize,
    /// Most nodes per job: its `--nnodes` maximum and the nodes waiting to join it (at most
    /// 1048576).
    #[arg(long, env = "RLAUNCH_RDZV_MAX_NODES", default_value_t = Limits::default().max_nodes,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(rlaunch_rendezvous::round::MAX_NODES)))]
    max_nodes: u32,
    /// How long a finished or failed job stays readable (`rlaunch status`) before it is
    /// forgotten and its run id can be used again, in seconds.
    #[arg(long, env = "RLAUNCH_RDZV_TERMINAL_RETENTION_S", default_value_t = rlaunch_rendezvous::store::TERMINAL_RETENTION.as_secs(),
          value_parser = clap::value_parser!(u64).range(0..=30 * 86_400))]
    terminal_retention_s: u64,
    /// Most HTTP connections open at once (an agent holds one or two); at the bound, the
    /// oldest idle connection is closed to admit a new one, else the one whose request body has
    /// been arriving the longest, else the longest-waiting watch; one peer address holds at
    /// most a sixteenth of it (loopback excepted). Default: the open-file limit
    /// (raised to its hard limit at start) less 128.
    #[arg(long, env = "RLAUNCH_RDZV_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// How long a client may take to send a request's headers, and a kept-alive connection may
    /// sit idle, in milliseconds.
    #[arg(long, env = "RLAUNCH_RDZV_HEADER_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    header_timeout_ms: u64,
    /// How long a client may take to send a request's body once its headers are in, in
    /// milliseconds: however slowly it is sent, a request holds a connection at most the header
    /// and body timeouts together.
    #[arg(long, env = "RLAUNCH_RDZV_BODY_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    body_timeout_ms: u64,
    /// Take the store and probe addresses a joining node advertises as given. By default a node
    /// on another host may advertise only the address its join comes from (or a host name that
    /// resolves to it), so that no client can point the others' probes and connections
    /// elsewhere; behind NAT, or a proxy that is not on this host, the service sees other
    /// addresses than the nodes have, and needs this.
    #[arg(long, env = "RLAUNCH_RDZV_TRUST_ADVERTISED_ADDRS")]
    trust_advertised_addrs: bool,
    /// After a shutdown signal, how long requests in flight (long-polls) may take to finish.
    #[arg(long, env = "RLAUNCH_RDZV_SHUTDOWN_GRACE_MS", default_value_t = 3000)]
    shutdown_grace_ms: u64,
    /// Check the flags (and read the token file) without serving: exit 0 and a summary when the
    /// service would start with them, else the error and a non-zero exit. For deployment checks.
    #[arg(long)]
    check_config: bool,
}

/// An etcd endpoint: `http(s)://host:port`, scheme and port written out.
fn etcd_endpoint(e: &str) -> Result<Endpoint> {
    let parsed = e.parse::<Endpoint>().ok();
    let written_out = e.starts_with("http://") || e.starts_with("https://");
    // etcd's gRPC client has no use for a path: one given is a mistake, not ignored.
    match parsed.filter(|p| written_out && p.port().is_some() && p.path().is_empty()) {
        Some(p) => Ok(p),
        None => anyhow::bail!("--etcd-endpoints: `{e}` is not http://host:port"),
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        // Without signal handlers the process still stops on the default action.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => info!(signal = "SIGTERM", "shutting down"),
        _ = int.recv() => info!(signal = "SIGINT", "shutting down"),
    }
}

async fn connect_etcd(endpoints: &[Endpoint], patience: Duration) -> Result<EtcdStore> {
    let shown = endpoints.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
    let give_up = tokio::time::Instant::now() + patience;
    let mut backoff = Duration::from_millis(200);
    loop {
        match EtcdStore::connect(endpoints).await {
            Ok(store) => return Ok(store),
            Err(error) if tokio::time::Instant::now() + backoff < give_up => {
                warn!(error = %error, endpoints = %shown, "etcd not reachable yet; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err(error) => return Err(error).with_context(|| format!("connecting to etcd at {shown}")),
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();

    // The token first: a bad token file fails at once, not after waiting for etcd.
    let token = match &args.token_file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading the token file {}", path.display()))?;
            let token = text.lines().next().unwrap_or("").trim().to_owned();
            anyhow::ensure!(!token.is_empty(), "the token file {} is empty", path.display());
            Some(token)
        }
        None => args.token.clone(),
    };
    let etcd_endpoints = match args.store {
        StoreKind::Etcd => args.etcd_endpoints.iter().map(|e| etcd_endpoint(e)).collect::<Result<Vec<_>>>()?,
        StoreKind::Memory => Vec::new(),
    };
    // The certificate and key next: a bad file fails at once, naming it.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(rlaunch_rendezvous::tls::server_config(cert, key)?),
        _ => None,
    };
    if token.is_some() && tls.is_none() && !args.listen.ip().is_loopback() {
        warn!(
            listen = %args.listen,
            "a token over plain HTTP: anyone on the path reads it and the nodes' secrets; serve HTTPS with --tls-cert/--tls-key"
        );
    }
    if args.check_config {
        println!(
            "rlaunch-rendezvous: would listen on {} with the {:?} store{}, token {}",
            args.listen,
            args.store,
            if args.store == StoreKind::Etcd {
                format!(" at {}", args.etcd_endpoints.join(","))
            } else {
                String::new()
            },
            if token.is_some() { "set" } else { "none (open)" }
        );
        println!("rlaunch-rendezvous: {}", if tls.is_some() { "HTTPS" } else { "plain HTTP (no --tls-cert)" });
        return Ok(());
    }

    let store = match args.store {
        StoreKind::Memory => Store::memory(),
        StoreKind::Etcd => {
            let store = connect_etcd(&etcd_endpoints, Duration::from_millis(args.etcd_wait_ms)).await?;
            let keep = Duration::from_secs(args.etcd_history_s);
            let every = if keep.is_zero() { Duration::MAX } else { keep.min(Duration::from_secs(60)) };
            store.set_compaction(rlaunch_rendezvous::store::etcd::Compaction {
                keep: if keep.is_zero() { Duration::MAX } else { keep },
                every,
            });
            Store::Etcd(store)
        }
    };
    let rdzv = Rendezvous::with_limits(
        store,
        Limits {
            max_jobs: args.max_jobs,
            max_nodes: args.max_nodes,
            retention: Duration::from_secs(args.terminal_retention_s),
        },
    );
    // Connections stay below the open-file limit, so the listener (and etcd) always have room.
    let mut max_connections = args.max_connections.unwrap_or(ServeLimits::default().max_connections).max(1);
    if let Ok(files) = rlaunch::store::raise_open_files() {
        let room = usize::try_from(files.saturating_sub(128)).unwrap_or(usize::MAX).max(16);
        if max_connections > room {
            if args.max_connections.is_some() {
                warn!(max_connections, open_files = files, "--max-connections lowered to fit the open-file limit");
            }
            max_connections = room;
        }
    }
    let serve_limits = ServeLimits {
        max_connections,
        header_timeout: Duration::from_millis(args.header_timeout_ms),
        body_timeout: Duration::from_millis(args.body_timeout_ms),
    };
    let auth = token.is_some();
    let mut state = AppState::new(rdzv, token);
    state.body_limit = args.body_limit;
    state.protect_metrics = args.protect_metrics;
    state.trust_advertised_addrs = args.trust_advertised_addrs;

    // A backlog of 4096, not std's 128: every agent of a large job connects at once.
    let listener = rlaunch::store::bind(args.listen).with_context(|| format!("binding {}", args.listen))?;
    let local = listener.local_addr().context("reading the bound address")?;
    info!(
        listen = %local, store = ?args.store, auth, https = args.tls_cert.is_some(), protect_metrics = args.protect_metrics,
        max_jobs = args.max_jobs, max_nodes = args.max_nodes, max_connections,
        header_timeout_ms = args.header_timeout_ms, body_timeout_ms = args.body_timeout_ms, "rlaunch-rendezvous serving"
    );

    // Memory freed by forgotten jobs goes back to the system: after a burst of jobs the
    // allocator would otherwise keep its high-water mark for the life of the service.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    tokio::spawn(async {
        let mut every = tokio::time::interval(Duration::from_secs(30));
        loop {
            every.tick().await;
            // SAFETY: malloc_trim only releases free memory of glibc's arenas; it takes no pointer.
            unsafe { libc::malloc_trim(0) };
        }
    });

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stopped = async move {
        let _ = stop_rx.await;
    };
    let server = match tls {
        Some(tls) => tokio::spawn(api::serve_tls(listener, state, serve_limits, tls, stopped)),
        None => tokio::spawn(api::serve_with(listener, state, serve_limits, stopped)),
    };
    shutdown_signal().await;
    let _ = stop_tx.send(());
    let grace = Duration::from_millis(args.shutdown_grace_ms);
    match tokio::time::timeout(grace, server).await {
        Ok(joined) => joined.context("server task panicked")?.context("serving HTTP")?,
        Err(_) => info!(grace_ms = args.shutdown_grace_ms, "requests still in flight after the grace; exiting"),
    }
    Ok(())
}

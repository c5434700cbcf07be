//! rlaunch's per-node elastic agent: takes part in the rendezvous, hosts the workers' store on
//! group rank 0, starts one worker per local rank with torchrun's environment, supervises them,
//! restarts the group within the restart budget, relays signals, and reports the root cause of
//! a failure.
//!
//! `run(config)` returns a [`RunOutcome`]; [`RunOutcome::exit_code`] is the one place that maps
//! outcomes to the launcher's exit code.

pub mod beats;
pub mod config;
pub mod contain;
mod control;
pub mod core;
mod driver;
mod elastic;
pub mod error;
pub mod fingerprint;
pub mod hang;
mod hangwatch;
pub mod logdir;
pub mod node;
pub mod numa;
pub mod output;
pub mod peers;
pub mod process;
pub mod progress;
mod random;
pub mod report;
pub mod rundir;
pub mod signals;
pub mod snapshots;
pub mod snapstore;
pub mod spec;
pub mod supervisor;
pub mod warm;
pub mod workers;

use std::collections::BTreeMap;

use tracing::{info_span, warn, Instrument};

pub use config::{AgentConfig, DynamicBackend, DynamicRendezvous, PerRank, RendezvousConfig};
pub use core::RunOutcome;
pub use error::AgentError;
pub use node::hostname;
pub use report::{Exit, RootCause};
pub use spec::virtual_local_rank;

use node::{Ctx, WorkerStdin};
use output::Console;
use signals::Signals;

/// Runs this node's part of the job to the end.
pub async fn run(config: AgentConfig) -> Result<RunOutcome, AgentError> {
    let span = info_span!("run", run_id = %config.run_id);
    run_inner(config).instrument(span).await
}

async fn run_inner(config: AgentConfig) -> Result<RunOutcome, AgentError> {
    // No process of this user, the workers included, may read this agent's memory (its
    // snapshot key's private half, every rank's parts) through ptrace or /proc/<pid>/mem, and
    // no core dump of it is written. Workers exec their program, which makes them dumpable
    // again (py-spy still reads their stacks).
    // SAFETY: prctl(PR_SET_DUMPABLE) takes plain integers and touches no memory of ours.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        warn!(error = %std::io::Error::last_os_error(), "cannot make the agent undumpable");
    }
    // The stores and the probe endpoint hold a descriptor per client: the common soft limit of
    // 1024 would run out long before the connection caps do (issue 26, item 3).
    match rlaunch::store::raise_open_files() {
        Ok(files) => tracing::debug!(files, "open-file limit"),
        Err(e) => warn!(error = %e, "cannot raise the open-file limit"),
    }
    let host = node::hostname();
    let agent_env: BTreeMap<String, String> = std::env::vars().collect();
    let mut signals = Signals::install(&config.handled_signals).map_err(AgentError::Signals)?;
    let console = Console::start();
    // stdin goes to one worker (`--stdin-rank`): typed input through its terminal, a pipe or a
    // file as it is.
    let stdin = WorkerStdin::choose(&console);
    let (log_root, temp_logs) = rundir::log_root(config.log_dir.as_deref(), &config.run_id)?;
    let log_root = std::sync::Arc::new(log_root);
    let cpus = match config.numa_binding {
        Some(mode) => Some(
            numa::rank_cpus(mode, config.nproc_per_node, &agent_env)
                .map_err(|source| AgentError::NumaBinding { mode: mode.as_str(), source })?,
        ),
        None => None,
    };
    let choice = if config.process_groups_only { Some("process-group") } else { None };
    let containment = std::sync::Arc::new(contain::Containment::detect(config.nproc_per_node, choice));
    // Snapshots in this agent's memory (`--snapshot-memory 0`: none, but `import rlaunch` still
    // works). A store that cannot start leaves the job running without them, said once.
    let progress = std::sync::Arc::new(progress::Tracker::default());
    let snapshots = snapstore::SnapStore::start(config.snapshot_memory, progress.clone())
        .map_err(|e| warn!(error = %e, "cannot start the snapshot store: snapshots are off"))
        .ok();
    let snapshot_env = snapshots.as_ref().map(|s| s.worker_env(&agent_env)).unwrap_or_default();
    let warm = config.warm_workers.then(|| warm::WarmPool::new(&config.program, containment.clone())).flatten();
    let ctx = Ctx {
        warm: warm.as_ref(),
        snapshots: snapshots.as_ref(),
        progress: &progress,
        containment: &containment,
        host: &host,
        agent_env: &agent_env,
        console: &console,
        stdin,
        snapshot_env,
        log_root: &log_root,
        term_size: process::terminal_size(libc::STDOUT_FILENO),
        cpus,
    };
    let outcome = driver::run(&config, &ctx, &mut signals).await;
    // Warm workers never used end here, before the job's cgroups go.
    drop(warm);
    // Every worker is gone. The job's cgroups go with the last holder of this (a worker group
    // task may still hold it briefly); if the process ends first, the watchdog removes them.
    drop(containment);
    console.flush();
    if let Ok(RunOutcome::Failed { root_cause, .. }) = &outcome {
        // Its text may come from another node (through the rendezvous): no escapes on our terminal.
        eprint!("{}", rlaunch::terminal::sanitize(&root_cause.render()));
        eprintln!("rlaunch: the workers' logs are kept in {}", log_root.path().display());
        report::write_agent_error_file(&log_root, root_cause, &agent_env);
    }
    if temp_logs && matches!(outcome, Ok(RunOutcome::Succeeded { .. })) {
        let _ = std::fs::remove_dir_all(log_root.path());
    }
    outcome
}

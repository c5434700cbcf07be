//! The worker specification, pure: from the agent's configuration, this node (a [`NodeView`])
//! and the round's [`Placement`], what each local rank's worker gets — torchrun's environment,
//! its log directory, prefix, terminal, CPUs and the variables rlaunch adds — and the warm
//! workers' templates made from the same. No I/O: the driver hands the specs to
//! [`crate::workers`], which spawns them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rlaunch::contract::HostPort;
use rlaunch::env::WorkerEnv;

use crate::config::{AgentConfig, RendezvousConfig};
use crate::core::Placement;
use crate::output::{render_prefix, StdSet};
use crate::process::Terminal;
use crate::warm::Template;

/// What the agent needs to start one worker.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub env: WorkerEnv,
    /// Where the worker's stdout/stderr logs and error file go for this attempt.
    pub dir: PathBuf,
    /// Streams written to files.
    pub files: StdSet,
    /// Streams shown on the agent's console.
    pub console: StdSet,
    pub prefix: String,
    /// Variables set after the worker environment's (`--virtual-local-rank`).
    pub overrides: Vec<(&'static str, String)>,
    /// Pseudo-terminals for the streams shown on a terminal console, and stdin for one rank.
    pub terminal: Terminal,
    /// CPUs the worker is bound to (`--numa-binding`).
    pub cpus: Option<libc::cpu_set_t>,
    /// The heartbeat file, created before the worker starts beside its error file (where the
    /// Rust runtime finds it and writes its step statistics).
    pub heartbeat: Option<PathBuf>,
    /// Whether the worker is told its name in `RLAUNCH_HEARTBEAT_FILE` (`--hang-timeout`, for
    /// scripts that beat explicitly); otherwise the environment stays exactly torchrun's.
    pub heartbeat_env: bool,
}

impl WorkerSpec {
    /// Every variable the worker is given, in the order they apply: torchrun's environment,
    /// then the overrides, then the heartbeat file's name (when it is told).
    pub fn vars(&self, agent_env: &BTreeMap<String, String>) -> Vec<(String, String)> {
        let mut vars: Vec<(String, String)> =
            self.env.to_vars(agent_env).into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        vars.extend(self.overrides.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        if let (true, Some(path)) = (self.heartbeat_env, &self.heartbeat) {
            vars.push((rlaunch::heartbeat::HEARTBEAT_ENV.to_owned(), path.to_string_lossy().into_owned()));
        }
        vars
    }
}

/// Where the agent's stdin goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stdin {
    /// Nowhere: every worker reads /dev/null.
    None,
    /// Typed input, forwarded to the stdin rank's terminal.
    Terminal,
    /// A pipe or a file, inherited by the stdin rank's worker (torchrun's workers inherit it).
    Inherited,
}

/// What the worker specification reads of this node.
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    pub host: &'a str,
    /// The run's log directory.
    pub log_root: &'a Path,
    pub agent_env: &'a BTreeMap<String, String>,
    /// Whether the agent's stdout, and its stderr, are terminals.
    pub tty: bool,
    pub stderr_tty: bool,
    pub stdin: Stdin,
    /// The agent's terminal's size (rows, columns), when stdout is one.
    pub term_size: Option<(u16, u16)>,
    /// Each local rank's CPUs (`--numa-binding`).
    pub cpus: Option<&'a [libc::cpu_set_t]>,
    /// What the agent adds to every worker's environment: the snapshot store's socket, the
    /// control socket of workers that keep their process (elastic).
    pub agent_vars: &'a [(&'static str, String)],
}

/// `{root}/attempt_{n}/{local_rank}`: where one worker of one attempt keeps its files.
pub fn worker_dir(root: &Path, attempt: u32, local_rank: u32) -> PathBuf {
    root.join(format!("attempt_{attempt}")).join(local_rank.to_string())
}

/// Where a static job's node 0 serves the workers' store for the whole run: on the master
/// address itself when the job is this node alone, else on every address at the master port.
pub fn static_store_bind(master: &HostPort, nnodes: u32) -> HostPort {
    if nnodes == 1 {
        master.clone()
    } else {
        HostPort::new("0.0.0.0", master.port()).expect("an address literal is a valid host")
    }
}

pub fn worker_specs(config: &AgentConfig, p: &Placement, master: &HostPort, node: &NodeView<'_>) -> Vec<WorkerSpec> {
    let (log_root, host) = (node.log_root, node.host);
    let restart_count = p.restart_count;
    let signals: Vec<String> = config.handled_signals.iter().map(|s| rlaunch::contract::signal_name(*s)).collect();
    let signals_to_handle = signals.join(",");
    (0..config.nproc_per_node)
        .map(|local_rank| {
            // The rendezvous bounds nodes and workers per node, so this never saturates there.
            let rank = p.rank_offset.saturating_add(local_rank);
            let dir = worker_dir(log_root, restart_count, local_rank);
            let redirect = config.redirects.get(local_rank);
            let tee = config.tee.get(local_rank);
            let shown = config.local_ranks_filter.as_ref().is_none_or(|f| f.contains(&local_rank));
            // torchrun: a redirected stream goes to its file only, a teed one to both; with a
            // log directory every stream is also kept in a file.
            let files = if config.log_dir.is_some() {
                StdSet::ALL
            } else {
                StdSet { stdout: redirect.stdout || tee.stdout, stderr: redirect.stderr || tee.stderr }
            };
            let console = StdSet {
                stdout: shown && (!redirect.stdout || tee.stdout),
                stderr: shown && (!redirect.stderr || tee.stderr),
            };
            let prefix = render_prefix(&config.log_line_prefix_template, &config.role, rank, local_rank, host);
            let tty = node.tty;
            let stdin_rank = rank == config.stdin_rank;
            let terminal = Terminal {
                stdout: tty && console.stdout,
                stderr: node.stderr_tty && console.stderr,
                stdin: node.stdin == Stdin::Terminal && tty && console.stdout && stdin_rank,
                inherit_stdin: node.stdin == Stdin::Inherited && stdin_rank,
                // The worker's lines are this much narrower than the terminal: its prefix.
                size: node.term_size.map(|(rows, cols)| {
                    let width = prefix.chars().count().min(usize::from(u16::MAX)) as u16;
                    (rows, cols.saturating_sub(width).max(20))
                }),
            };
            WorkerSpec {
                env: WorkerEnv {
                    rank,
                    local_rank,
                    group_rank: p.group_rank,
                    role_rank: rank,
                    role_name: config.role.clone(),
                    local_world_size: config.nproc_per_node,
                    world_size: p.world_size,
                    group_world_size: p.group_world_size,
                    role_world_size: p.world_size,
                    master_addr: master.host().to_owned(),
                    master_port: master.port(),
                    restart_count,
                    max_restarts: config.job.max_restarts,
                    run_id: config.run_id.clone(),
                    use_agent_store: true,
                    error_file: Some(dir.join("error.json").to_string_lossy().into_owned()),
                    signals_to_handle: signals_to_handle.clone(),
                },
                prefix,
                terminal,
                cpus: node.cpus.map(|sets| sets[local_rank as usize]),
                // Hang detection reads it; an elastic job's heartbeats carry the Rust runtime's
                // step waits from it (stragglers). Otherwise the log directory is torchrun's.
                heartbeat: (p.hang_timeout.is_some() || matches!(config.rendezvous, RendezvousConfig::Dynamic(_)))
                    .then(|| dir.join("heartbeat")),
                heartbeat_env: p.hang_timeout.is_some(),
                overrides: {
                    let mut o = if config.virtual_local_rank {
                        virtual_local_rank(local_rank, node.agent_env)
                    } else {
                        Vec::new()
                    };
                    o.extend(node.agent_vars.iter().cloned());
                    o
                },
                dir,
                files,
                console,
            }
        })
        .collect()
}

/// What this node's warm workers are started with: each rank's terminal and CPUs as `p` (or,
/// before any round, a first round of this node alone) gives them, and of the environment the
/// part every round's worker of that rank gets (the agent's own variables included: a warm
/// worker started without one would not fit the round's worker, and that rank would start cold).
pub fn warm_templates(config: &AgentConfig, p: Option<&Placement>, node: &NodeView<'_>) -> Vec<Template> {
    let first = Placement::fixed(0, 1, config.nproc_per_node, None, None);
    let p = p.unwrap_or(&first);
    let master = HostPort::new("127.0.0.1", 0).expect("a loopback address is a valid host");
    worker_specs(config, p, &master, node).iter().map(|spec| warm_template(spec, node.agent_env)).collect()
}

/// The warm worker a worker of `spec` can be made from: `spec`'s environment but for what
/// changes every attempt, its terminal and CPUs.
pub fn warm_template(spec: &WorkerSpec, agent_env: &BTreeMap<String, String>) -> Template {
    use rlaunch::env::{ERROR_FILE, MASTER_ADDR, MASTER_PORT, RESTART_COUNT};
    let mut env: Vec<(String, String)> = spec
        .env
        .to_vars(agent_env)
        .into_iter()
        .filter(|(k, _)| ![MASTER_ADDR, MASTER_PORT, RESTART_COUNT, ERROR_FILE].contains(k))
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    env.extend(spec.overrides.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    Template { local_rank: spec.env.local_rank, env, terminal: spec.terminal, cpus: spec.cpus }
}

/// torchrun's `--virtual-local-rank`: every worker sees its one GPU as device 0 and
/// `LOCAL_RANK=0`; its GPU is the `local_rank`-th of the agent's `HIP_VISIBLE_DEVICES` or
/// `CUDA_VISIBLE_DEVICES` (the launcher checked there are enough), else `local_rank` itself.
pub fn virtual_local_rank(local_rank: u32, agent_env: &BTreeMap<String, String>) -> Vec<(&'static str, String)> {
    let hip = agent_env.get("HIP_VISIBLE_DEVICES").filter(|v| !v.is_empty());
    let parent = hip.or_else(|| agent_env.get("CUDA_VISIBLE_DEVICES"));
    let gpu = parent
        .and_then(|list| list.split(',').nth(local_rank as usize).map(|g| g.trim().to_owned()))
        .unwrap_or_else(|| local_rank.to_string());
    let mut vars = vec![(rlaunch::env::LOCAL_RANK, "0".to_owned()), ("CUDA_VISIBLE_DEVICES", gpu.clone())];
    if hip.is_some() {
        vars.push(("HIP_VISIBLE_DEVICES", gpu));
    }
    vars
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node<'a>(env: &'a BTreeMap<String, String>, stdin: Stdin, tty: bool) -> NodeView<'a> {
        NodeView {
            host: "node0",
            log_root: Path::new("/logs/run"),
            agent_env: env,
            tty,
            stderr_tty: tty,
            stdin,
            term_size: tty.then_some((50, 100)),
            cpus: None,
            agent_vars: &[],
        }
    }

    fn master() -> HostPort {
        HostPort::new("10.0.0.1", 29500).unwrap()
    }

    /// Node 1 of 2 with 2 workers each: global ranks 2 and 3.
    fn second_node() -> Placement {
        Placement::fixed(1, 2, 2, Some(master()), None)
    }

    #[test]
    fn a_fixed_placement_puts_each_nodes_ranks_after_the_earlier_nodes() {
        let p = second_node();
        assert_eq!((p.round, p.rank_offset, p.world_size, p.group_world_size), (1, 2, 4, 2));
        let env = BTreeMap::new();
        let config = AgentConfig::standalone(vec!["train".into()], 2);
        let specs = worker_specs(&config, &p, &master(), &node(&env, Stdin::None, false));
        let ranks: Vec<(u32, u32)> = specs.iter().map(|s| (s.env.rank, s.env.local_rank)).collect();
        assert_eq!(ranks, [(2, 0), (3, 1)]);
        assert_eq!(specs[1].dir, Path::new("/logs/run/attempt_0/1"));
        assert_eq!((specs[0].env.master_addr.as_str(), specs[0].env.master_port), ("10.0.0.1", 29500));
    }

    #[test]
    fn a_workers_variables_are_torchruns_then_the_overrides_then_the_heartbeat_when_told() {
        let (config, env) = (AgentConfig::standalone(vec!["train".into()], 2), BTreeMap::new());
        let agent_vars = [("RLAUNCH_SNAPSHOT", "/run/s".to_string())];
        let view = NodeView { agent_vars: &agent_vars, ..node(&env, Stdin::None, false) };
        let mut spec = worker_specs(&config, &second_node(), &master(), &view).remove(0);
        let names = |spec: &WorkerSpec| spec.vars(&env).into_iter().map(|(k, _)| k).collect::<Vec<_>>();
        let vars = names(&spec);
        let (rank, snap) = (vars.iter().position(|k| k == "RANK"), vars.iter().position(|k| k == "RLAUNCH_SNAPSHOT"));
        assert!(rank.is_some() && snap.is_some() && rank < snap, "{vars:?}");
        assert!(!vars.iter().any(|k| k == "RLAUNCH_HEARTBEAT_FILE"), "not told without --hang-timeout: {vars:?}");
        spec.heartbeat = Some("/logs/attempt_0/0/heartbeat".into());
        spec.heartbeat_env = true;
        assert_eq!(names(&spec).last().map(String::as_str), Some("RLAUNCH_HEARTBEAT_FILE"));
        assert_eq!(spec.vars(&env).len(), vars.len() + 1);
    }

    #[test]
    fn a_pipe_goes_to_the_stdin_rank_alone_and_typed_input_only_to_its_terminal() {
        let env = BTreeMap::new();
        let mut config = AgentConfig::standalone(vec!["train".into()], 2);
        config.stdin_rank = 3;
        let p = second_node();
        let spec = |stdin, tty| worker_specs(&config, &p, &master(), &node(&env, stdin, tty));
        let inherits = |specs: Vec<WorkerSpec>| specs.iter().map(|s| s.terminal.inherit_stdin).collect::<Vec<_>>();
        let typed = |specs: Vec<WorkerSpec>| specs.iter().map(|s| s.terminal.stdin).collect::<Vec<_>>();
        assert_eq!(inherits(spec(Stdin::Inherited, false)), [false, true], "rank 3 is local rank 1");
        assert_eq!(inherits(spec(Stdin::Inherited, true)), [false, true], "a pipe is inherited on a terminal too");
        assert_eq!(typed(spec(Stdin::Inherited, true)), [false, false]);
        assert_eq!(typed(spec(Stdin::Terminal, true)), [false, true]);
        assert_eq!(inherits(spec(Stdin::Terminal, true)), [false, false]);
        assert_eq!(typed(spec(Stdin::None, true)), [false, false]);
        assert_eq!(inherits(spec(Stdin::None, false)), [false, false]);
        // The stdin rank on another node: nothing here.
        config.stdin_rank = 0;
        assert_eq!(
            inherits(worker_specs(&config, &p, &master(), &node(&env, Stdin::Inherited, false))),
            [false, false]
        );
    }

    #[test]
    fn a_warm_template_leaves_out_what_changes_every_attempt_and_keeps_the_rest() {
        let env = BTreeMap::from([("PATH".to_string(), "/bin".to_string())]);
        let config = AgentConfig::standalone(vec!["train.py".into()], 2);
        let agent_vars = [("RLAUNCH_SNAPSHOT", "/run/s".to_string())];
        let view = NodeView { agent_vars: &agent_vars, ..node(&env, Stdin::Inherited, false) };
        let templates = warm_templates(&config, None, &view);
        assert_eq!(templates.len(), 2);
        let t = &templates[0];
        let has = |k: &str| t.env.iter().any(|(n, _)| n == k);
        for gone in ["MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"] {
            assert!(!has(gone), "{gone} changes every attempt");
        }
        for kept in ["RANK", "LOCAL_RANK", "WORLD_SIZE", "RLAUNCH_SNAPSHOT"] {
            assert!(has(kept), "{kept}");
        }
        // Before any round the node is taken to be the job alone: rank 0 is the stdin rank.
        assert!(t.terminal.inherit_stdin && !templates[1].terminal.inherit_stdin);
    }

    /// The round's workers carry the agent's own variables (the control socket of
    /// `rlaunch.resilient` in an elastic job): the warm templates carry them too, so that the
    /// round's worker fits its warm interpreter. Without them every warm interpreter of an
    /// elastic job was discarded and its rank started cold.
    #[test]
    fn a_warm_template_carries_the_agent_s_variables_so_the_round_s_worker_fits_it() {
        let env = BTreeMap::from([("PATH".to_string(), "/bin".to_string())]);
        let config = AgentConfig::standalone(vec!["train.py".into()], 2);
        let control = [("RLAUNCH_CONTROL", "/run/control.sock".to_string())];
        let view = NodeView { agent_vars: &control, ..node(&env, Stdin::Inherited, false) };
        let p = Placement::fixed(0, 1, 2, None, None);
        let templates = warm_templates(&config, Some(&p), &view);
        for (spec, t) in worker_specs(&config, &p, &master(), &view).into_iter().zip(&templates) {
            assert_eq!(warm_template(&spec, &env).env, t.env, "local rank {}", t.local_rank);
        }
        assert!(templates[0].env.contains(&("RLAUNCH_CONTROL".to_string(), "/run/control.sock".to_string())));
    }

    #[test]
    fn a_static_node_0_serves_its_store_on_the_master_address_alone_only_when_it_is_the_whole_job() {
        assert_eq!(static_store_bind(&master(), 1), master());
        assert_eq!(static_store_bind(&master(), 2), HostPort::new("0.0.0.0", 29500).unwrap());
    }
}

//! The worker environment contract: the variables an agent gives every worker (the same set,
//! names and meanings as PyTorch's torchrun), written by the agent and read by workers.
//!
//! This is the one file that spells these names.

use std::collections::BTreeMap;

pub const RANK: &str = "RANK";
pub const LOCAL_RANK: &str = "LOCAL_RANK";
pub const GROUP_RANK: &str = "GROUP_RANK";
pub const ROLE_RANK: &str = "ROLE_RANK";
pub const ROLE_NAME: &str = "ROLE_NAME";
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
pub const WORLD_SIZE: &str = "WORLD_SIZE";
pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
pub const MASTER_ADDR: &str = "MASTER_ADDR";
pub const MASTER_PORT: &str = "MASTER_PORT";
pub const RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
pub const MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
pub const RUN_ID: &str = "TORCHELASTIC_RUN_ID";
pub const USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
pub const ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
pub const NCCL_ASYNC_ERROR_HANDLING: &str = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";
pub const LC_CTYPE: &str = "LC_CTYPE";

/// torchrun is a Python program: in the C locale its interpreter sets `LC_CTYPE=C.UTF-8` in its
/// own environment as it starts (PEP 538, unless `PYTHONCOERCECLOCALE=0` or `LC_ALL` is set),
/// and every worker inherits it (so a Python worker's UTF-8 mode is off). The same for the
/// workers of a launcher that is no Python program.
pub fn coerced_locale(agent_env: &BTreeMap<String, String>) -> Option<&'static str> {
    let set = |k: &str| agent_env.get(k).filter(|v| !v.is_empty());
    if set("LC_ALL").is_some() || agent_env.get("PYTHONCOERCECLOCALE").is_some_and(|v| v == "0") {
        return None;
    }
    let ctype = set(LC_CTYPE).or_else(|| set("LANG"));
    ctype.is_none_or(|l| l == "C" || l == "POSIX").then_some("C.UTF-8")
}
pub const SIGNALS_TO_HANDLE: &str = "TORCHELASTIC_SIGNALS_TO_HANDLE";
/// The signals the agent stops the job on, as torchrun advertises them to workers.
pub const DEFAULT_SIGNALS_TO_HANDLE: &str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

/// What one worker is told about its place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEnv {
    pub rank: u32,
    pub local_rank: u32,
    pub group_rank: u32,
    pub role_rank: u32,
    pub role_name: String,
    pub local_world_size: u32,
    pub world_size: u32,
    pub group_world_size: u32,
    pub role_world_size: u32,
    pub master_addr: String,
    pub master_port: u16,
    pub restart_count: u32,
    pub max_restarts: u32,
    pub run_id: String,
    /// True when `MASTER_ADDR:MASTER_PORT` is a TCPStore the agent already serves.
    pub use_agent_store: bool,
    pub error_file: Option<String>,
    /// The signals the agent stops the job on (`--signals-to-handle`), as torchrun leaves them
    /// in the workers' environment: set always, whatever the agent's own environment says.
    pub signals_to_handle: String,
}

/// Why the worker environment could not be read.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("environment variable {name} is not set (is this process running under rlaunch or torchrun?)")]
    Missing { name: &'static str },
    #[error("environment variable {name}={value:?} is not a valid {expected}")]
    Invalid { name: &'static str, value: String, expected: &'static str },
}

impl WorkerEnv {
    /// The variables as the agent sets them, torchrun's spelling and formatting
    /// (booleans as Python's `True`/`False`).
    ///
    /// `agent_env` is the agent's own environment, which the worker inherits: it decides the
    /// defaults torchrun fills in only when the user has not set them.
    pub fn to_vars(&self, agent_env: &BTreeMap<String, String>) -> Vec<(&'static str, String)> {
        let mut vars = vec![
            (LOCAL_RANK, self.local_rank.to_string()),
            (RANK, self.rank.to_string()),
            (GROUP_RANK, self.group_rank.to_string()),
            (ROLE_RANK, self.role_rank.to_string()),
            (ROLE_NAME, self.role_name.clone()),
            (LOCAL_WORLD_SIZE, self.local_world_size.to_string()),
            (WORLD_SIZE, self.world_size.to_string()),
            (GROUP_WORLD_SIZE, self.group_world_size.to_string()),
            (ROLE_WORLD_SIZE, self.role_world_size.to_string()),
            (MASTER_ADDR, self.master_addr.clone()),
            (MASTER_PORT, self.master_port.to_string()),
            (RESTART_COUNT, self.restart_count.to_string()),
            (MAX_RESTARTS, self.max_restarts.to_string()),
            (RUN_ID, self.run_id.clone()),
            (USE_AGENT_STORE, if self.use_agent_store { "True" } else { "False" }.to_string()),
        ];
        if let Some(f) = &self.error_file {
            vars.push((ERROR_FILE, f.clone()));
        }
        if !agent_env.contains_key(NCCL_ASYNC_ERROR_HANDLING) {
            vars.push((NCCL_ASYNC_ERROR_HANDLING, "1".to_string()));
        }
        if !agent_env.contains_key(OMP_NUM_THREADS) && self.local_world_size > 1 {
            vars.push((OMP_NUM_THREADS, "1".to_string()));
        }
        vars.push((SIGNALS_TO_HANDLE, self.signals_to_handle.clone()));
        if let Some(coerced) = coerced_locale(agent_env) {
            vars.push((LC_CTYPE, coerced.to_owned()));
        }
        vars
    }

    /// Reads the environment of the current process (a worker).
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get`, so tests need not touch the process environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let text = |name: &'static str| get(name).ok_or(EnvError::Missing { name });
        let num = |name: &'static str| -> Result<u32, EnvError> {
            let v = text(name)?;
            v.trim().parse().map_err(|_| EnvError::Invalid { name, value: v, expected: "non-negative integer" })
        };
        let opt_num = |name: &'static str, default: u32| match get(name) {
            Some(_) => num(name),
            None => Ok(default),
        };
        let rank = num(RANK)?;
        let world_size = num(WORLD_SIZE)?;
        let local_rank = opt_num(LOCAL_RANK, rank)?;
        let local_world_size = opt_num(LOCAL_WORLD_SIZE, world_size)?;
        let port_text = text(MASTER_PORT)?;
        let master_port = port_text.trim().parse().map_err(|_| EnvError::Invalid {
            name: MASTER_PORT,
            value: port_text.clone(),
            expected: "TCP port",
        })?;
        if rank >= world_size {
            return Err(EnvError::Invalid { name: RANK, value: rank.to_string(), expected: "rank below WORLD_SIZE" });
        }
        Ok(Self {
            rank,
            local_rank,
            group_rank: opt_num(GROUP_RANK, 0)?,
            role_rank: opt_num(ROLE_RANK, rank)?,
            role_name: get(ROLE_NAME).unwrap_or_else(|| "default".into()),
            local_world_size,
            world_size,
            group_world_size: opt_num(GROUP_WORLD_SIZE, 1)?,
            role_world_size: opt_num(ROLE_WORLD_SIZE, world_size)?,
            master_addr: text(MASTER_ADDR)?,
            master_port,
            restart_count: opt_num(RESTART_COUNT, 0)?,
            max_restarts: opt_num(MAX_RESTARTS, 0)?,
            run_id: get(RUN_ID).unwrap_or_else(|| "none".into()),
            use_agent_store: get(USE_AGENT_STORE).is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1"),
            error_file: get(ERROR_FILE),
            signals_to_handle: get(SIGNALS_TO_HANDLE).unwrap_or_else(|| DEFAULT_SIGNALS_TO_HANDLE.into()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WorkerEnv {
        WorkerEnv {
            rank: 5,
            local_rank: 1,
            group_rank: 1,
            role_rank: 5,
            role_name: "default".into(),
            local_world_size: 4,
            world_size: 8,
            group_world_size: 2,
            role_world_size: 8,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            restart_count: 2,
            max_restarts: 3,
            run_id: "job42".into(),
            use_agent_store: true,
            error_file: Some("/tmp/e.json".into()),
            signals_to_handle: "SIGTERM,SIGUSR1".into(),
        }
    }

    #[test]
    fn vars_round_trip_through_the_reader() {
        let env = sample();
        let vars: BTreeMap<String, String> =
            env.to_vars(&BTreeMap::new()).into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(vars[USE_AGENT_STORE], "True");
        assert_eq!(vars[OMP_NUM_THREADS], "1");
        assert_eq!(vars[LC_CTYPE], "C.UTF-8", "no locale: torchrun's interpreter's own coercion, inherited");
        assert_eq!(vars[NCCL_ASYNC_ERROR_HANDLING], "1");
        let back = WorkerEnv::from_lookup(|k| vars.get(k).cloned()).expect("complete env");
        assert_eq!(back, env);
    }

    #[test]
    fn the_locale_is_coerced_only_where_torchrun_s_interpreter_would() {
        let env = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        assert_eq!(coerced_locale(&env(&[])), Some("C.UTF-8"));
        assert_eq!(coerced_locale(&env(&[("LANG", "C")])), Some("C.UTF-8"));
        assert_eq!(coerced_locale(&env(&[("LC_CTYPE", "POSIX"), ("LANG", "en_US.UTF-8")])), Some("C.UTF-8"));
        assert_eq!(coerced_locale(&env(&[("LANG", "en_US.UTF-8")])), None);
        assert_eq!(coerced_locale(&env(&[("LC_ALL", "C")])), None);
        assert_eq!(coerced_locale(&env(&[("PYTHONCOERCECLOCALE", "0")])), None);
    }

    #[test]
    fn user_settings_of_omp_and_nccl_are_not_overridden_but_the_handled_signals_are() {
        let agent: BTreeMap<String, String> =
            [(OMP_NUM_THREADS, "8"), (NCCL_ASYNC_ERROR_HANDLING, "0"), (SIGNALS_TO_HANDLE, "SIGHUP")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        let vars = sample().to_vars(&agent);
        assert!(!vars.iter().any(|(k, _)| *k == OMP_NUM_THREADS || *k == NCCL_ASYNC_ERROR_HANDLING));
        // torchrun sets the list it handles, whatever it inherited.
        assert!(vars.contains(&(SIGNALS_TO_HANDLE, "SIGTERM,SIGUSR1".to_string())));
    }

    #[test]
    fn missing_or_bad_variables_are_named() {
        let err = WorkerEnv::from_lookup(|_| None).unwrap_err();
        assert!(err.to_string().contains("RANK"), "{err}");
        let err = WorkerEnv::from_lookup(|k| match k {
            RANK => Some("x".into()),
            _ => Some("1".into()),
        })
        .unwrap_err();
        assert!(matches!(err, EnvError::Invalid { name: RANK, .. }), "{err}");
    }
}

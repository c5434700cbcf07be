//! Slurm's environment as launcher settings: under `srun` (SLURM_JOB_ID set), the `SLURM_*`
//! variables stand in for the flags nobody gave ([`apply`]), and the job and step ids make the
//! elastic run id ([`run_id`]).

use crate::cli::{Args, Sources};

/// The ports rlaunch's agents host the rendezvous on when Slurm names the first node: one per
/// job step, [`rdzv_port`], so that jobs sharing a node (and two `srun`s of one job) do not
/// meet on one port, as they would on torchrun's fixed 29400. Below Linux's ephemeral ports and
/// clear of 29400 and 29500 (torchrun's rendezvous and master ports).
pub const RDZV_PORTS: std::ops::Range<u16> = 20_000..29_000;

/// The rendezvous port of Slurm job step `job`.`step`: in [`RDZV_PORTS`], the same on every
/// node of the step (FNV-1a of `job.step`).
pub fn rdzv_port(job: &str, step: Option<&str>) -> u16 {
    let key = format!("{job}.{}", step.unwrap_or(""));
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    let span = u64::from(RDZV_PORTS.end - RDZV_PORTS.start);
    RDZV_PORTS.start + (hash % span) as u16
}

/// The first host of a Slurm host list: `node[01-04,07],gpu5` → `node01`,
/// `rack[1-2]-n[3-4]` → `rack1-n3`. `None` for an empty or malformed list.
pub fn first_host(list: &str) -> Option<String> {
    let mut out = String::new();
    let mut chars = list.trim().chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                // The first element of the group: up to the first `,` or `-` inside it.
                let inner: String = chars.by_ref().take_while(|c| *c != ']').collect();
                let first = inner.split([',', '-']).next().filter(|f| !f.is_empty())?;
                out.push_str(first);
            }
            ']' => return None,
            c => out.push(c),
        }
    }
    (!out.is_empty()).then_some(out)
}

/// Under `srun` (SLURM_JOB_ID set), what Slurm knows stands in for the flags nobody gave:
/// `--nnodes` from the step's node count (SLURM_STEP_NUM_NODES, else the job's SLURM_NNODES),
/// `--rdzv-endpoint` from the first host of the step's nodes (SLURM_STEP_NODELIST, else the
/// job's SLURM_JOB_NODELIST) on the step's port ([`rdzv_port`]; its agent hosts the
/// rendezvous), `--nproc-per-node` from the node's GPUs (SLURM_GPUS_ON_NODE, else the GPUs this
/// process sees). A flag, the environment or a config file always wins, and
/// nothing applies to `--standalone` or a static rendezvous (`--node-rank`, `--master-addr`).
/// The run id from SLURM_JOB_ID is [`run_id`]'s (through [`Args::elastic_run_id`]).
pub fn apply(args: &mut Args, sources: &mut Sources, env: &dyn Fn(&str) -> Option<String>, gpus: fn() -> u32) {
    let Some(job) = env("SLURM_JOB_ID").filter(|s| !s.is_empty()) else { return };
    if args.standalone || args.node_rank.is_some() || args.master_addr.is_some() || args.master_port.is_some() {
        return;
    }
    let unset = |sources: &Sources, name: &str| {
        sources.iter().any(|(n, _, src)| n == name && (src == "default" || src == "unset"))
    };
    let set = |sources: &mut Sources, name: &str, value: &str, from: &str| {
        if let Some(entry) = sources.iter_mut().find(|(n, _, _)| n == name) {
            *entry = (name.to_owned(), value.to_owned(), format!("Slurm ({from})"));
        }
    };
    if unset(sources, "nnodes") {
        // A step may run on part of the job's nodes (`srun -N1`): the step's count first.
        if let Some((n, var)) = ["SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"]
            .iter()
            .find_map(|v| env(v).and_then(|n| n.trim().parse::<u32>().ok()).filter(|n| *n >= 1).map(|n| (n, *v)))
        {
            args.nnodes = n.to_string();
            set(sources, "nnodes", &args.nnodes, var);
        }
    }
    if args.rdzv_endpoint.trim().is_empty() && unset(sources, "rdzv-endpoint") {
        if let Some((host, var)) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
            .iter()
            .find_map(|v| env(v).and_then(|l| first_host(&l)).map(|h| (h, *v)))
        {
            let step = env("SLURM_STEP_ID").filter(|s| !s.is_empty());
            args.rdzv_endpoint = format!("{host}:{}", rdzv_port(&job, step.as_deref()));
            set(sources, "rdzv-endpoint", &args.rdzv_endpoint, &format!("the first host of {var}, the step's port"));
        }
    }
    if unset(sources, "nproc-per-node") {
        let (n, from) = match env("SLURM_GPUS_ON_NODE").and_then(|g| g.trim().parse::<u32>().ok()) {
            Some(n) => (n, "SLURM_GPUS_ON_NODE"),
            None => (gpus(), "the node's GPUs"),
        };
        if (1..=4096).contains(&n) {
            args.nproc_per_node = n.to_string();
            set(sources, "nproc-per-node", &args.nproc_per_node, from);
        }
    }
}

/// Under Slurm, the elastic run id and where it came from: `slurm-{job}.{step}` with
/// SLURM_STEP_ID (every `srun` of one job is a step of its own: two launches in one job never
/// share), else `slurm-{job}`. `None` outside Slurm.
pub fn run_id(env: &dyn Fn(&str) -> Option<String>) -> Option<(String, String)> {
    let id = env("SLURM_JOB_ID").filter(|s| !s.is_empty())?;
    Some(match env("SLURM_STEP_ID").filter(|s| !s.is_empty()) {
        Some(step) => (format!("slurm-{id}.{step}"), "SLURM_JOB_ID and SLURM_STEP_ID".into()),
        None => (format!("slurm-{id}"), "SLURM_JOB_ID".into()),
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    use super::*;
    use crate::cli::parse;

    fn fake_env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    fn argv(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn slurm_host_lists_give_their_first_host() {
        assert_eq!(first_host("node[01-04,07],gpu5").as_deref(), Some("node01"));
        assert_eq!(first_host("gpu5,node[01-04]").as_deref(), Some("gpu5"));
        assert_eq!(first_host("rack[1-2]-n[3-4]").as_deref(), Some("rack1-n3"));
        assert_eq!(first_host("n[7,9]").as_deref(), Some("n7"));
        assert_eq!(first_host("10.0.0.5").as_deref(), Some("10.0.0.5"));
        for bad in ["", "n[]", "]x", "[,]"] {
            assert_eq!(first_host(bad), None, "{bad:?}");
        }
    }

    const SLURM: &[(&str, &str)] = &[
        ("SLURM_JOB_ID", "77"),
        ("SLURM_NNODES", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_JOB_NODELIST", "gpu[03-04]"),
        ("SLURM_GPUS_ON_NODE", "4"),
    ];

    #[test]
    fn under_srun_slurm_fills_in_the_flags_nobody_gave_and_flags_win() {
        let env = fake_env(SLURM);
        let (a, sources) = parse(argv(&["rlaunch", "train.py"]), &env).unwrap();
        let port = rdzv_port("77", None);
        assert_eq!(
            (a.nnodes.as_str(), a.rdzv_endpoint.as_str(), a.nproc_per_node.as_str()),
            ("2", format!("gpu03:{port}").as_str(), "4")
        );
        assert_eq!(a.backend().0, "rlaunch");
        assert_eq!(a.elastic_run_id(&env).unwrap().0, "slurm-77");
        let src = |name: &str| sources.iter().find(|(n, _, _)| n == name).map(|(_, _, s)| s.clone()).unwrap();
        assert_eq!(src("nnodes"), "Slurm (SLURM_NNODES)");
        assert_eq!(src("rdzv-endpoint"), "Slurm (the first host of SLURM_JOB_NODELIST, the step's port)");
        // Explicit flags always win.
        let (a, _) =
            parse(argv(&["rlaunch", "--nproc-per-node", "2", "--rdzv-endpoint", "svc:1", "train.py"]), &env).unwrap();
        assert_eq!((a.nnodes.as_str(), a.rdzv_endpoint.as_str(), a.nproc_per_node.as_str()), ("2", "svc:1", "2"));
        // Standalone and static rendezvous are left alone.
        let (a, _) = parse(argv(&["rlaunch", "--standalone", "train.py"]), &env).unwrap();
        assert_eq!((a.nnodes.as_str(), a.rdzv_endpoint.as_str()), ("1:1", ""));
        let (a, _) = parse(argv(&["rlaunch", "--node-rank", "0", "--master-addr", "h", "train.py"]), &env).unwrap();
        assert_eq!(a.rdzv_endpoint, "");
        // Not under Slurm: nothing changes.
        let (a, _) = parse(argv(&["rlaunch", "train.py"]), &fake_env(&[])).unwrap();
        assert_eq!((a.nnodes.as_str(), a.rdzv_endpoint.as_str(), a.nproc_per_node.as_str()), ("1:1", "", "1"));
    }

    #[test]
    fn a_step_on_part_of_the_job_takes_its_own_nodes_and_port() {
        // `srun -N1 -r1` inside a 2-node job: the step runs on gpu04 alone.
        let mut vars = SLURM.to_vec();
        vars.extend([("SLURM_STEP_ID", "3"), ("SLURM_STEP_NUM_NODES", "1"), ("SLURM_STEP_NODELIST", "gpu04")]);
        let env = fake_env(vars.leak());
        let (a, sources) = parse(argv(&["rlaunch", "train.py"]), &env).unwrap();
        assert_eq!(
            (a.nnodes.as_str(), a.rdzv_endpoint.as_str()),
            ("1", format!("gpu04:{}", rdzv_port("77", Some("3"))).as_str())
        );
        let src = |name: &str| sources.iter().find(|(n, _, _)| n == name).map(|(_, _, s)| s.clone()).unwrap();
        assert_eq!(src("nnodes"), "Slurm (SLURM_STEP_NUM_NODES)");
        assert_eq!(a.elastic_run_id(&env).unwrap().0, "slurm-77.3");
    }

    #[test]
    fn slurm_steps_get_distinct_ports_in_their_range() {
        let mut seen = std::collections::HashSet::new();
        for job in 1000..1100 {
            for step in ["0", "1", "2"] {
                let p = rdzv_port(&job.to_string(), Some(step));
                assert!(RDZV_PORTS.contains(&p), "{p}");
                assert_ne!(p, 29400);
                seen.insert(p);
            }
        }
        // 300 steps over 9,000 ports: almost all distinct (a hash, not an allocation).
        assert!(seen.len() > 290, "{} distinct of 300", seen.len());
        assert_eq!(rdzv_port("42", Some("0")), rdzv_port("42", Some("0")), "the same on every node");
    }

    #[test]
    fn under_srun_without_gpus_one_worker_per_node_stays() {
        let env = fake_env(&[("SLURM_JOB_ID", "5"), ("SLURM_JOB_NODELIST", "n1")]);
        let (mut a, mut sources) = parse(argv(&["rlaunch", "x"]), &fake_env(&[])).unwrap();
        apply(&mut a, &mut sources, &env, || 0);
        assert_eq!(
            (a.nproc_per_node.as_str(), a.rdzv_endpoint.as_str()),
            ("1", format!("n1:{}", rdzv_port("5", None)).as_str())
        );
        apply(&mut a, &mut sources, &env, || 8);
        assert_eq!(a.nproc_per_node, "8", "the GPUs this node sees");
    }
}

//! Slurm's environment as launcher settings: under `srun` (SLURM_JOB_ID set), the `SLURM_*`
//! variables stand in for the flags nobody gave ([`apply`]), and the job and step ids make the
//! elastic run id ([`run_id`]).

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

/// Which settings nobody gave, so Slurm's environment may fill them in.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unset {
    pub nnodes: bool,
    pub rdzv_endpoint: bool,
    pub nproc_per_node: bool,
}

/// A setting filled in from Slurm's environment: the flag's name, its value, where it came from
/// (as `--print-config` shows it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filled {
    pub name: &'static str,
    pub value: String,
    pub from: String,
}

/// Under `srun`, what Slurm's environment stands in for, of the settings `unset` names:
/// `--nnodes` from the step's node count (SLURM_STEP_NUM_NODES, else the job's SLURM_NNODES),
/// `--rdzv-endpoint` from the first host of the step's nodes (SLURM_STEP_NODELIST, else the
/// job's SLURM_JOB_NODELIST) on the step's port ([`rdzv_port`]; its agent hosts the
/// rendezvous), `--nproc-per-node` from the node's GPUs (SLURM_GPUS_ON_NODE, else the GPUs this
/// process sees). A flag, the environment or a config file always wins (the caller says what is
/// unset), and nothing applies to `--standalone` or a static rendezvous (`placed`: `--node-rank`,
/// `--master-addr`, `--master-port`). The run id from SLURM_JOB_ID is [`run_id`]'s.
pub fn fill(unset: Unset, placed: bool, env: &dyn Fn(&str) -> Option<String>, gpus: fn() -> u32) -> Vec<Filled> {
    let mut out = Vec::new();
    let Some(job) = env("SLURM_JOB_ID").filter(|s| !s.is_empty()) else { return out };
    if placed {
        return out;
    }
    let mut filled =
        |name, value: String, from: &str| out.push(Filled { name, value, from: format!("Slurm ({from})") });
    if unset.nnodes {
        // A step may run on part of the job's nodes (`srun -N1`): the step's count first.
        if let Some((n, var)) = ["SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"]
            .iter()
            .find_map(|v| env(v).and_then(|n| n.trim().parse::<u32>().ok()).filter(|n| *n >= 1).map(|n| (n, *v)))
        {
            filled("nnodes", n.to_string(), var);
        }
    }
    if unset.rdzv_endpoint {
        if let Some((host, var)) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
            .iter()
            .find_map(|v| env(v).and_then(|l| first_host(&l)).map(|h| (h, *v)))
        {
            let step = env("SLURM_STEP_ID").filter(|s| !s.is_empty());
            let value = format!("{host}:{}", rdzv_port(&job, step.as_deref()));
            filled("rdzv-endpoint", value, &format!("the first host of {var}, the step's port"));
        }
    }
    if unset.nproc_per_node {
        let (n, from) = match env("SLURM_GPUS_ON_NODE").and_then(|g| g.trim().parse::<u32>().ok()) {
            Some(n) => (n, "SLURM_GPUS_ON_NODE"),
            None => (gpus(), "the node's GPUs"),
        };
        if (1..=4096).contains(&n) {
            filled("nproc-per-node", n.to_string(), from);
        }
    }
    out
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
    use super::*;

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
        let env = |k: &str| {
            [("SLURM_JOB_ID", "5"), ("SLURM_JOB_NODELIST", "n1")]
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        let all = Unset { nnodes: true, rdzv_endpoint: true, nproc_per_node: true };
        let got = fill(all, false, &env, || 0);
        let value = |got: &[Filled], name: &str| got.iter().find(|f| f.name == name).map(|f| f.value.clone());
        assert_eq!(
            (value(&got, "nproc-per-node").unwrap_or_else(|| "1".into()), value(&got, "rdzv-endpoint").unwrap()),
            ("1".to_string(), format!("n1:{}", rdzv_port("5", None)))
        );
        let got = fill(Unset { nproc_per_node: true, ..Unset::default() }, false, &env, || 8);
        assert_eq!(value(&got, "nproc-per-node").as_deref(), Some("8"), "the GPUs this node sees");
        // A static rendezvous or --standalone: nothing is filled in.
        assert!(fill(all, true, &env, || 8).is_empty());
    }
}

//! Data-parallel training of an MLP classifier on a synthetic, deterministic dataset (Gaussian
//! blobs from a seeded generator), written against rlaunch's public API as a user would:
//!
//! ```text
//! rlaunch --standalone --nproc-per-node 4 target/release/examples/train --epochs 3
//! ```
//!
//! Every start, whatever the restart count, resumes from the latest complete checkpoint in
//! `--checkpoint-dir`, so a run disturbed by failures ends with the same model as an
//! undisturbed one. Rank 0 logs loss and throughput and writes checkpoints.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rlaunch::checkpoint::{Checkpoint, CheckpointDir};
use rlaunch::comm::ReduceOp;
use rlaunch::ddp::{Ddp, DdpConfig};
use rlaunch::model::{Mlp, Sgd, SplitMix};
use rlaunch::sampler::DistributedSampler;

#[derive(Debug, Clone)]
struct Args {
    epochs: u64,
    steps: Option<u64>,
    batch_size: usize,
    lr: f32,
    momentum: f32,
    /// Default: `$TMPDIR/rlaunch-train-<run id>`, so restarts within one launch resume.
    checkpoint_dir: Option<String>,
    no_checkpoint: bool,
    checkpoint_every: u64,
    /// Hand the state to the agent's memory every this many steps (0: never).
    snapshot_every: u64,
    seed: u64,
    samples: usize,
    dim: usize,
    hidden: usize,
    classes: usize,
    log_every: u64,
    save_final: Option<String>,
    /// Test hook: on the first attempt, rank 0 aborts in the middle of writing this step's checkpoint.
    fault_checkpoint_step: Option<u64>,
    /// Test hook: on the first attempt, rank `fault_rank` SIGKILLs itself when reaching this step.
    fault_kill_step: Option<u64>,
    fault_rank: usize,
    /// Test hook: rank `slow_rank` sleeps `slow_ms` before each step's backward pass (a straggler).
    slow_rank: Option<usize>,
    slow_ms: u64,
    /// `cpu`, `cuda` or `auto` (GPU when usable, else CPU with a notice).
    device: String,
    /// `fp32` or `bf16` (mixed precision on the GPU).
    precision: String,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        epochs: 3,
        steps: None,
        batch_size: 64,
        lr: 0.05,
        momentum: 0.9,
        checkpoint_dir: None,
        no_checkpoint: false,
        checkpoint_every: 50,
        snapshot_every: 1,
        seed: 0,
        samples: 16384,
        dim: 32,
        hidden: 256,
        classes: 8,
        log_every: 20,
        save_final: None,
        fault_checkpoint_step: None,
        fault_kill_step: None,
        fault_rank: 1,
        slow_rank: None,
        slow_ms: 20,
        device: "cpu".into(),
        precision: "fp32".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(v.to_string())),
            None => (flag.clone(), None),
        };
        let mut val = || inline.clone().or_else(|| it.next()).with_context(|| format!("{name} needs a value"));
        match name.replace('_', "-").as_str() {
            "--epochs" => a.epochs = val()?.parse()?,
            "--steps" => a.steps = Some(val()?.parse()?),
            "--batch-size" => a.batch_size = val()?.parse()?,
            "--lr" => a.lr = val()?.parse()?,
            "--momentum" => a.momentum = val()?.parse()?,
            "--checkpoint-dir" => a.checkpoint_dir = Some(val()?),
            "--no-checkpoint" => a.no_checkpoint = true,
            "--checkpoint-every" => a.checkpoint_every = val()?.parse()?,
            "--snapshot-every" => a.snapshot_every = val()?.parse()?,
            "--seed" => a.seed = val()?.parse()?,
            "--samples" => a.samples = val()?.parse()?,
            "--dim" => a.dim = val()?.parse()?,
            "--hidden" => a.hidden = val()?.parse()?,
            "--classes" => a.classes = val()?.parse()?,
            "--log-every" => a.log_every = val()?.parse()?,
            "--save-final" => a.save_final = Some(val()?),
            "--fault-checkpoint-step" => a.fault_checkpoint_step = Some(val()?.parse()?),
            "--fault-kill-step" => a.fault_kill_step = Some(val()?.parse()?),
            "--fault-rank" => a.fault_rank = val()?.parse()?,
            "--slow-rank" => a.slow_rank = Some(val()?.parse()?),
            "--slow-ms" => a.slow_ms = val()?.parse()?,
            "--device" => a.device = val()?,
            "--precision" => a.precision = val()?,
            "--help" | "-h" => {
                println!("train [--epochs 3] [--steps N] [--batch-size 64] [--lr 0.05] [--momentum 0.9] [--checkpoint-dir DIR | --no-checkpoint] [--checkpoint-every 50] [--snapshot-every 1] [--seed 0] [--samples 16384] [--dim 32] [--hidden 256] [--classes 8] [--log-every 20] [--save-final FILE]");
                std::process::exit(0);
            }
            other => bail!("unknown flag {other} (try --help)"),
        }
    }
    if a.batch_size == 0 || a.checkpoint_every == 0 {
        bail!("--batch-size and --checkpoint-every must be positive");
    }
    Ok(a)
}

/// Gaussian blobs: `classes` centres drawn once, samples = centre + unit noise.
struct Dataset {
    x: Vec<f32>,
    y: Vec<u32>,
    dim: usize,
}

fn make_dataset(a: &Args) -> Dataset {
    let mut rng = SplitMix(a.seed ^ 0x0da7_a5e7);
    let centres: Vec<f32> = (0..a.classes * a.dim).map(|_| rng.normal() * 0.6).collect();
    let mut x = Vec::with_capacity(a.samples * a.dim);
    let mut y = Vec::with_capacity(a.samples);
    for _ in 0..a.samples {
        let c = rng.below(a.classes as u64) as usize;
        y.push(c as u32);
        for d in 0..a.dim {
            x.push(centres[c * a.dim + d] + rng.normal());
        }
    }
    Dataset { x, y, dim: a.dim }
}

fn fnv(params: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in params {
        for b in p.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn main() -> Result<()> {
    let args = parse_args()?;
    // Once per process: the dataset. Each round (a fresh start, or again in the same process
    // when the job re-forms around this node: rlaunch::resilient) joins the round's group and
    // resumes from the newest checkpoint or snapshot.
    let data = make_dataset(&args);
    // On the GPU as on the CPU: a round's end ends the NCCL group's waits (rlaunch::gpu), and
    // the next round makes a new group on the context the first one made.
    let mut rounds = 0u32;
    rlaunch::resilient::run(|| {
        rounds += 1;
        train(&args, &data, rounds)
    })
}

/// One round of training: the group from the round's environment, the state from the newest
/// checkpoint or snapshot, then steps until the end. `round`: how many times this process
/// entered it.
fn train(args: &Args, data: &Dataset, round: u32) -> Result<()> {
    let worker = rlaunch::env::WorkerEnv::from_env().context("run me under rlaunch (or torchrun)")?;
    let pg = rlaunch::worker::init_from_env().context("joining the process group")?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let backend = pg.backend_name();
    let mut model = Mlp::new(&[args.dim, args.hidden, args.hidden, args.classes], args.seed);
    let sizes = model.param_sizes();
    let mut opt = Sgd::new(model.params.len(), args.lr, args.momentum, 0.0);
    let mut ddp = Ddp::new(pg, &sizes, DdpConfig::default());
    let ckpath = match (&args.checkpoint_dir, args.no_checkpoint) {
        (_, true) => None,
        (Some(d), false) => Some(std::path::PathBuf::from(d)),
        // Restarts of one launch share the run id, so they find each other's checkpoints.
        (None, false) => Some(std::env::temp_dir().join(format!("rlaunch-train-{}", worker.run_id))),
    };
    let ckdir = match (&ckpath, rank) {
        (Some(d), 0) => Some(CheckpointDir::new(d, 3)?),
        _ => None,
    };
    // What a checkpoint must have been written with to be resumed (not the world size: a job
    // that re-forms with fewer or more nodes resumes, as from a snapshot).
    let meta = serde_json::json!({
        "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
        "sizes": model.sizes, "samples": args.samples,
    });

    // Resume: rank 0 reads the latest complete checkpoint and everyone gets it by broadcast.
    let mut counters = [0i64; 4]; // found, step, epoch, sampler position
    if rank == 0 {
        if let Some(ck) = ckdir.as_ref().map(|c| c.latest()).transpose()?.flatten() {
            if ck.meta != meta {
                bail!("checkpoint at step {} was written with other settings: {} vs {}", ck.step, ck.meta, meta);
            }
            model.params.copy_from_slice(ck.tensor("params").context("checkpoint lacks params")?);
            opt.velocity.copy_from_slice(ck.tensor("momentum").context("checkpoint lacks momentum")?);
            counters = [1, ck.step as i64, ck.epoch as i64, ck.sampler_pos as i64];
        }
    }
    ddp.all_reduce(&mut counters, ReduceOp::Max)?;
    ddp.broadcast_params(&mut model.params)?;
    ddp.broadcast_params(&mut opt.velocity)?;
    // A snapshot in the agents' memory newer than the checkpoint wins: every rank gets the same
    // step (the agents agree on it), its own part.
    let mut resumed_from_snapshot = false;
    if args.snapshot_every > 0 {
        let snap = match rlaunch::snapshot::load() {
            // Saved by a smaller world (a scale-up): the state is data-parallel, the same in
            // every rank's part, so rank 0's serves.
            Err(rlaunch::snapshot::SnapshotError::NoPart { .. }) => rlaunch::snapshot::load_rank(0)?,
            other => other?,
        };
        if let Some(snap) = snap {
            let counters_of = snap.get("counters").context("snapshot lacks counters")?;
            let (params, momentum) = (snap.get("params"), snap.get("momentum"));
            if snap.step as i64 > counters[1] && counters_of.len() == 16 {
                rlaunch::snapshot::read_f32s(params.context("snapshot lacks params")?, &mut model.params)?;
                rlaunch::snapshot::read_f32s(momentum.context("snapshot lacks momentum")?, &mut opt.velocity)?;
                let word = |i: usize| u64::from_le_bytes(counters_of[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                counters = [1, snap.step as i64, word(0) as i64, word(1) as i64];
                resumed_from_snapshot = true;
            }
        }
    }
    // The sampler's position is kept as the samples of the epoch consumed by the whole world,
    // so that a world of another size resumes where the last one stopped (to within a batch).
    let (mut step, start_epoch) = (counters[1] as u64, counters[2] as u64);
    let start_pos = counters[3] as usize / (args.batch_size * world);
    let mut gpu = gpu_trainer(args, &worker, &model, &opt)?;
    if rank == 0 {
        println!(
            "train: world {world} backend {backend} restart {} | {} params | checkpoints {} | {} | pid {} round {round}",
            worker.restart_count,
            model.params.len(),
            ckpath.as_ref().map_or("off".to_string(), |p| p.display().to_string()),
            if resumed_from_snapshot {
                format!("resumed at step {step} (epoch {start_epoch}, batch {start_pos}) from the agents' snapshot")
            } else if counters[0] == 1 {
                format!("resumed at step {step} (epoch {start_epoch}, batch {start_pos})")
            } else {
                "fresh start".into()
            },
            std::process::id()
        );
    }

    let mut sampler = DistributedSampler::new(args.samples, world, rank).seed(args.seed);
    let per_epoch = sampler.num_samples() / args.batch_size;
    if per_epoch == 0 {
        bail!("batch size {} exceeds the {} samples per rank", args.batch_size, sampler.num_samples());
    }
    let max_steps = args.steps.unwrap_or(u64::MAX);
    let (mut xb, mut yb) = (vec![0f32; args.batch_size * data.dim], vec![0u32; args.batch_size]);
    let mut window = (Instant::now(), 0u64, 0f64);
    let t_start = Instant::now();
    let steps_at_start = step;
    const WARMUP_STEPS: u64 = 20;
    let mut steady_from: Option<Instant> = None;
    'outer: for epoch in start_epoch..args.epochs {
        sampler.set_epoch(epoch);
        let idx = sampler.indices();
        let first = if epoch == start_epoch { start_pos } else { 0 };
        for pos in first..per_epoch {
            if step >= max_steps {
                break 'outer;
            }
            if args.fault_kill_step == Some(step) && rank == args.fault_rank && worker.restart_count == 0 {
                eprintln!("fault injection: rank {rank} SIGKILLs itself at step {step}");
                // SAFETY: kill(2) on our own pid; the process ends here.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            for (j, &i) in idx[pos * args.batch_size..(pos + 1) * args.batch_size].iter().enumerate() {
                xb[j * data.dim..(j + 1) * data.dim].copy_from_slice(&data.x[i * data.dim..(i + 1) * data.dim]);
                yb[j] = data.y[i];
            }
            if args.slow_rank == Some(rank) {
                std::thread::sleep(Duration::from_millis(args.slow_ms));
            }
            let loss = if let Some(g) = gpu.as_mut() {
                g.step(&xb, &yb)?
            } else {
                ddp.zero_grad()?;
                let loss = model.loss_and_backward(&xb, &yb, &mut ddp);
                ddp.finish()?;
                for p in 0..sizes.len() {
                    let range = model.param_range(p);
                    opt.step_slice(&mut model.params, range, ddp.grad(p));
                }
                loss
            };
            step += 1;
            if step == steps_at_start + WARMUP_STEPS {
                steady_from = Some(Instant::now());
            }
            window.1 += 1;
            window.2 += loss as f64;
            if step % args.log_every == 0 {
                let mut l = [window.2 / window.1 as f64];
                ddp.all_reduce(&mut l, ReduceOp::Avg)?;
                if rank == 0 {
                    let secs = window.0.elapsed().as_secs_f64();
                    println!(
                        "step {step:>6} epoch {epoch} loss {:.4} | {:.1} steps/s {:.0} samples/s",
                        l[0],
                        window.1 as f64 / secs,
                        (window.1 as usize * args.batch_size * world) as f64 / secs
                    );
                }
                window = (Instant::now(), 0, 0.0);
            }
            if args.snapshot_every > 0 && step % args.snapshot_every == 0 {
                if let Some(g) = gpu.as_ref() {
                    g.download(&mut model, &mut opt)?;
                }
                let (e, p) = if pos + 1 == per_epoch { (epoch + 1, 0) } else { (epoch, pos + 1) };
                let mut next = [0u8; 16];
                next[..8].copy_from_slice(&e.to_le_bytes());
                next[8..].copy_from_slice(&((p * args.batch_size * world) as u64).to_le_bytes());
                rlaunch::snapshot::save(
                    step,
                    &[
                        ("params", rlaunch::snapshot::f32_bytes(&model.params)),
                        ("momentum", rlaunch::snapshot::f32_bytes(&opt.velocity)),
                        ("counters", &next),
                    ],
                )?;
            }
            if let (Some(dir), 0) = (&ckdir, rank) {
                if step % args.checkpoint_every == 0 {
                    if let Some(g) = gpu.as_ref() {
                        g.download(&mut model, &mut opt)?;
                    }
                    let (e, p) = if pos + 1 == per_epoch { (epoch + 1, 0) } else { (epoch, pos + 1) };
                    let ck = Checkpoint {
                        step,
                        epoch: e,
                        sampler_pos: (p * args.batch_size * world) as u64,
                        meta: meta.clone(),
                        tensors: vec![
                            ("params".into(), model.params.clone()),
                            ("momentum".into(), opt.velocity.clone()),
                        ],
                    };
                    let fault = args.fault_checkpoint_step == Some(step) && worker.restart_count == 0;
                    dir.save_with(&ck, |tmp| {
                        if fault {
                            eprintln!("fault injection: dying while writing {}", tmp.display());
                            std::process::abort();
                        }
                    })?;
                }
            }
        }
    }
    if let Some(g) = gpu.as_ref() {
        g.download(&mut model, &mut opt)?;
    }
    ddp.barrier()?;
    let secs = t_start.elapsed().as_secs_f64();
    let steady = steady_from.map(|t| (step - steps_at_start - WARMUP_STEPS) as f64 / t.elapsed().as_secs_f64());
    if rank == 0 {
        let n_eval = args.samples.min(4096);
        let logits = model.logits(&data.x[..n_eval * data.dim], n_eval);
        let correct = (0..n_eval)
            .filter(|&s| {
                let row = &logits[s * args.classes..(s + 1) * args.classes];
                let best = (0..args.classes).max_by(|&a, &b| row[a].total_cmp(&row[b])).expect("classes > 0");
                best as u32 == data.y[s]
            })
            .count();
        let done = step - steps_at_start;
        println!(
            "done: {step} steps, accuracy {:.3}, {:.1} steps/s this attempt, final params fnv {:016x}",
            correct as f64 / n_eval as f64,
            done as f64 / secs,
            fnv(&model.params)
        );
        if let Some(sps) = steady {
            println!(
                "steady: {sps:.1} steps/s ({:.0} samples/s, steps {}..{step}, batch {}/rank, world {world})",
                sps * (args.batch_size * world) as f64,
                steps_at_start + WARMUP_STEPS,
                args.batch_size
            );
        }
        if let Some(p) = &args.save_final {
            let bytes: Vec<u8> = model.params.iter().flat_map(|x| x.to_le_bytes()).collect();
            std::fs::write(p, bytes).with_context(|| format!("writing {p}"))?;
        }
    }
    Ok(())
}

/// The GPU trainer for `--device cuda|auto` (None: train on the CPU).
#[cfg(feature = "cuda")]
fn gpu_trainer(
    args: &Args,
    worker: &rlaunch::env::WorkerEnv,
    model: &Mlp,
    opt: &Sgd,
) -> Result<Option<rlaunch::gpu::GpuTrainer>> {
    use rlaunch::gpu::{select, Device, GpuTrainer, Precision, SearchPath, Selected};
    let device: Device = args.device.parse().map_err(anyhow::Error::msg)?;
    let precision: Precision = args.precision.parse().map_err(anyhow::Error::msg)?;
    let need_nccl = worker.world_size > 1;
    match select(device, worker.local_rank as usize, need_nccl, &SearchPath::conventional())? {
        Selected::Cpu { notice } => {
            if let Some(n) = notice {
                eprintln!("{n}");
            }
            Ok(None)
        }
        Selected::Cuda { ordinal, .. } => {
            let t = GpuTrainer::new(ordinal, worker, model, opt, precision).context("starting the GPU path")?;
            if worker.rank == 0 {
                println!("train: device cuda:{ordinal} ({}) precision {}", t.device_name(), args.precision);
            }
            Ok(Some(t))
        }
    }
}

/// Built without `--features cuda`: `--device cuda` is an error, `auto` means the CPU.
#[cfg(not(feature = "cuda"))]
fn gpu_trainer(args: &Args, _: &rlaunch::env::WorkerEnv, _: &Mlp, _: &Sgd) -> Result<Option<NoGpu>> {
    match args.device.as_str() {
        "cpu" => Ok(None),
        "auto" => {
            eprintln!(
                "--device auto: training on the CPU; this build has no GPU support (cargo build --features cuda)"
            );
            Ok(None)
        }
        other => bail!("--device {other}: this build has no GPU support (rebuild with `cargo build --features cuda`)"),
    }
}

/// Stands in for `rlaunch::gpu::GpuTrainer` in builds without `cuda` (never constructed).
#[cfg(not(feature = "cuda"))]
enum NoGpu {}

#[cfg(not(feature = "cuda"))]
impl NoGpu {
    fn step(&mut self, _: &[f32], _: &[u32]) -> Result<f32> {
        match *self {}
    }
    fn download(&self, _: &mut Mlp, _: &mut Sgd) -> Result<()> {
        match *self {}
    }
}

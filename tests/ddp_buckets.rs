//! DDP mechanics across real processes with deliberately tiny buckets (many buckets, launched
//! during the backward pass): averaged gradients equal the reference average of every rank's
//! local gradients, `no_sync` accumulates, and parameters start from rank 0's.

mod common;

use std::time::Duration;

use common::{fresh_seed, require_worker_env, self_args, self_exe, spawn, wait, Mix, WORKER};
use rlaunch::ddp::{Ddp, DdpConfig};
use rlaunch::model::{FlatGrads, Mlp};

const SEED: &str = "RLAUNCH_TEST_DATA_SEED";
const SIZES: [usize; 4] = [12, 40, 24, 5];
const BATCH: usize = 9;

fn batch(seed: u64, rank: usize, micro: usize) -> (Vec<f32>, Vec<u32>) {
    let mut m = Mix(seed ^ (rank as u64) << 20 ^ (micro as u64) << 40);
    let x = (0..BATCH * SIZES[0]).map(|_| m.f32() * 2.0).collect();
    let y = (0..BATCH).map(|_| (m.next() % SIZES[3] as u64) as u32).collect();
    (x, y)
}

fn check(ddp: &Ddp, model: &Mlp, want: &FlatGrads, what: &str) -> Result<(), String> {
    for p in 0..model.param_sizes().len() {
        let (got, exp) = (ddp.grad(p), want.grad(p));
        for i in 0..got.len() {
            if (got[i] - exp[i]).abs() > 1e-6 + 1e-5 * exp[i].abs() {
                return Err(format!("{what}: param {p} element {i}: {} vs {}", got[i], exp[i]));
            }
        }
    }
    Ok(())
}

fn worker(seed: u64) -> Result<(), String> {
    let pg = rlaunch::worker::init_from_env().map_err(|e| e.to_string())?;
    let (me, w) = (pg.rank(), pg.world_size());
    // Every rank starts from different parameters; broadcast must give rank 0's.
    let mut model = Mlp::new(&SIZES, seed + me as u64);
    let reference = Mlp::new(&SIZES, seed);
    let cfg = DdpConfig { bucket_cap_bytes: 1024, first_bucket_bytes: 256, average: true };
    let mut ddp = Ddp::new(pg, &model.param_sizes(), cfg);
    if ddp.layout().buckets.len() < 4 {
        return Err(format!("expected many buckets, got {:?}", ddp.layout().buckets));
    }
    ddp.broadcast_params(&mut model.params).map_err(|e| e.to_string())?;
    if model.params != reference.params {
        return Err("parameters differ from rank 0's after broadcast".into());
    }
    // One synchronised step: the average of every rank's local gradient.
    let mut want = FlatGrads::new(&model.param_sizes());
    let mut tmp = FlatGrads::new(&model.param_sizes());
    for r in 0..w {
        tmp.zero();
        let (x, y) = batch(seed, r, 0);
        model.loss_and_backward(&x, &y, &mut tmp);
        want.data.iter_mut().zip(&tmp.data).for_each(|(a, b)| *a += b / w as f32);
    }
    ddp.zero_grad().map_err(|e| e.to_string())?;
    let (x, y) = batch(seed, me, 0);
    model.loss_and_backward(&x, &y, &mut ddp);
    ddp.finish().map_err(|e| e.to_string())?;
    check(&ddp, &model, &want, "synchronised step")?;
    // Accumulation: micro-batch 1 under no_sync, micro-batch 2 synchronised.
    let mut want2 = FlatGrads::new(&model.param_sizes());
    for r in 0..w {
        for micro in 1..=2 {
            tmp.zero();
            let (x, y) = batch(seed, r, micro);
            model.loss_and_backward(&x, &y, &mut tmp);
            want2.data.iter_mut().zip(&tmp.data).for_each(|(a, b)| *a += b / w as f32);
        }
    }
    ddp.zero_grad().map_err(|e| e.to_string())?;
    let (x1, y1) = batch(seed, me, 1);
    ddp.no_sync(|d| {
        model.loss_and_backward(&x1, &y1, d);
    });
    let (x2, y2) = batch(seed, me, 2);
    model.loss_and_backward(&x2, &y2, &mut ddp);
    ddp.finish().map_err(|e| e.to_string())?;
    check(&ddp, &model, &want2, "accumulated step")?;
    Ok(())
}

#[test]
#[ignore = "worker entry point: this file's tests run it in child processes (--ignored --exact)"]
fn worker_entry() {
    require_worker_env();
    let seed: u64 = std::env::var(SEED).ok().and_then(|v| v.parse().ok()).expect("seed");
    match worker(seed) {
        Ok(()) => eprintln!("OK"),
        Err(e) => {
            eprintln!("ERROR: {e}");
            std::process::exit(1);
        }
    }
}

#[test]
fn bucketed_gradients_are_averaged_and_no_sync_accumulates() {
    for w in [1usize, 3] {
        let dir = tempfile::tempdir().expect("tempdir");
        let seed = fresh_seed();
        let env = vec![(WORKER.to_string(), "1".to_string()), (SEED.to_string(), seed.to_string())];
        let f = wait(
            spawn(&self_exe(), &self_args("worker_entry"), &vec![0; w], dir.path(), &env),
            Duration::from_secs(120),
        );
        assert!(f.all_ok() && f.logs.iter().all(|l| l.contains("OK")), "world {w} seed {seed}:\n{}", f.dump());
    }
}

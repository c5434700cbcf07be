//! The reference check run by every rank: collectives on fresh random data against a
//! straightforward computation of the expected result (every rank can regenerate every
//! rank's input from the shared seed).

use rlaunch::comm::{ProcessGroup, ReduceOp};

use super::Mix;

pub const SEED: &str = "RLAUNCH_TEST_DATA_SEED";

fn gen(seed: u64, case: usize, rank: usize, n: usize) -> Vec<f32> {
    let mut m = Mix(seed ^ (case as u64) << 32 ^ (rank as u64) << 16);
    (0..n).map(|_| m.f32()).collect()
}

fn close(got: &[f32], want: &[f32], scale: &[f32], what: &str) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    for i in 0..got.len() {
        let tol = 1e-5 * scale[i] + 1e-6;
        if (got[i] - want[i]).abs() > tol || got[i].is_nan() {
            return Err(format!("{what}: element {i}: got {} want {}", got[i], want[i]));
        }
    }
    Ok(())
}

pub fn reference_worker(pg: &mut ProcessGroup, seed: u64) -> Result<(), String> {
    let w = pg.world_size();
    let me = pg.rank();
    let big: usize = std::env::var("RLAUNCH_TEST_BIG").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut sizes = vec![1usize, 2, 7, 1000, 16 * 1024 + 5, 300_001, 1_048_577];
    if big > 0 {
        sizes.push(big);
    }
    for (case, &n) in sizes.iter().enumerate() {
        let all: Vec<Vec<f32>> = (0..w).map(|r| gen(seed, case, r, n)).collect();
        let scale: Vec<f32> = (0..n).map(|i| all.iter().map(|v| v[i].abs()).sum()).collect();
        let ops: &[ReduceOp] = if n > 1_100_000 {
            &[ReduceOp::Sum]
        } else {
            &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max]
        };
        for &op in ops {
            let want: Vec<f32> = (0..n)
                .map(|i| {
                    let xs = all.iter().map(|v| v[i]);
                    match op {
                        ReduceOp::Sum => xs.sum(),
                        ReduceOp::Avg => xs.sum::<f32>() / w as f32,
                        ReduceOp::Min => xs.fold(f32::INFINITY, f32::min),
                        ReduceOp::Max => xs.fold(f32::NEG_INFINITY, f32::max),
                    }
                })
                .collect();
            let mut buf = all[me].clone();
            pg.all_reduce(&mut buf, op).map_err(|e| e.to_string())?;
            close(&buf, &want, &scale, &format!("all_reduce {op:?} n={n}"))?;
        }
        if n > 1_100_000 {
            continue;
        }
        // i64 sum is exact.
        let ints: Vec<Vec<i64>> = all.iter().map(|v| v.iter().map(|x| (x * 1e6) as i64).collect()).collect();
        let mut ib = ints[me].clone();
        pg.all_reduce(&mut ib, ReduceOp::Sum).map_err(|e| e.to_string())?;
        for i in 0..n {
            let want: i64 = ints.iter().map(|v| v[i]).sum();
            if ib[i] != want {
                return Err(format!("i64 all_reduce n={n} element {i}: {} != {want}", ib[i]));
            }
        }
        // f64 max.
        let mut fb: Vec<f64> = all[me].iter().map(|&x| x as f64).collect();
        pg.all_reduce(&mut fb, ReduceOp::Max).map_err(|e| e.to_string())?;
        for i in 0..n {
            let want = all.iter().map(|v| v[i] as f64).fold(f64::NEG_INFINITY, f64::max);
            if fb[i] != want {
                return Err(format!("f64 max n={n} element {i}"));
            }
        }
        // broadcast from a rotating root.
        let root = case % w;
        let mut b = all[me].clone();
        pg.broadcast(&mut b, root).map_err(|e| e.to_string())?;
        if b != all[root] {
            return Err(format!("broadcast n={n} root {root} differs"));
        }
        // all_gather.
        let mut out = vec![0f32; n * w];
        pg.all_gather(&all[me], &mut out).map_err(|e| e.to_string())?;
        if out != all.concat() {
            return Err(format!("all_gather n={n} differs"));
        }
        // reduce_scatter: block `me` of the element-wise sum of every rank's (w*n) input.
        let inputs: Vec<Vec<f32>> = (0..w).map(|r| gen(seed, case + 1000, r, n * w)).collect();
        let mut rs = vec![0f32; n];
        pg.reduce_scatter(&inputs[me], &mut rs, ReduceOp::Sum).map_err(|e| e.to_string())?;
        let want: Vec<f32> = (0..n).map(|i| inputs.iter().map(|v| v[me * n + i]).sum()).collect();
        let sc: Vec<f32> = (0..n).map(|i| inputs.iter().map(|v| v[me * n + i].abs()).sum()).collect();
        close(&rs, &want, &sc, &format!("reduce_scatter n={n}"))?;
        pg.barrier().map_err(|e| e.to_string())?;
    }
    Ok(())
}

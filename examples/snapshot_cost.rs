//! What a snapshot costs the Rust runtime: `rlaunch::snapshot::save` against one memcpy of the
//! same state and against writing it to a tmpfs file; `load` against reading that file back.
//! Run under `rlaunch --standalone --nproc-per-node 1 --max-restarts 1` (bench/snapshot/cost.py
//! does): the first attempt saves and measures, then exits 1; the restarted one loads.
//!
//! `snapshot_cost OUT_DIR [MIB]`: writes `OUT_DIR/rust0.json` and `OUT_DIR/rust1.json`.

use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn timed(reps: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let out = std::path::PathBuf::from(args.get(1).ok_or("snapshot_cost OUT_DIR [MIB]")?);
    let mib: usize = args.get(2).map(|m| m.parse()).transpose()?.unwrap_or(256);
    let attempt: u32 = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default().parse().unwrap_or(0);
    let per = mib * (1 << 20) / 4 / 16;
    let state: Vec<Vec<f32>> = (0..16).map(|i| (0..per).map(|j| (i * per + j) as f32).collect()).collect();
    let names: Vec<String> = (0..16).map(|i| format!("layer{i}.weight")).collect();
    let file = std::path::Path::new("/dev/shm").join("rlaunch-bench-rust.bin");
    if attempt == 0 {
        let mut dst: Vec<Vec<f32>> = state.iter().map(|v| vec![0f32; v.len()]).collect();
        let memcpy = timed(5, || {
            for (d, s) in dst.iter_mut().zip(&state) {
                d.copy_from_slice(s);
            }
        });
        let refs: Vec<(&str, &[u8])> =
            names.iter().zip(&state).map(|(n, v)| (n.as_str(), rlaunch::snapshot::f32_bytes(v))).collect();
        let first = timed(1, || {
            rlaunch::snapshot::save(0, &refs).expect("save");
        });
        let mut step = 0;
        let save = timed(5, || {
            step += 1;
            rlaunch::snapshot::save(step, &refs).expect("save");
        });
        let write = timed(3, || {
            let mut bytes = Vec::with_capacity(mib << 20);
            for v in &state {
                bytes.extend_from_slice(rlaunch::snapshot::f32_bytes(v));
            }
            std::fs::write(&file, &bytes).expect("write");
        });
        rlaunch::snapshot::save(9999, &refs)?;
        let json = format!(r#"{{"memcpy": {memcpy}, "save_first": {first}, "save": {save}, "file_write": {write}}}"#);
        std::fs::write(out.join("rust0.json"), json)?;
        std::process::exit(1);
    }
    let mut dst: Vec<Vec<f32>> = state.iter().map(|v| vec![0f32; v.len()]).collect();
    let t = Instant::now();
    let got = rlaunch::snapshot::load()?.ok_or("nothing restored")?;
    let load = t.elapsed().as_secs_f64();
    assert_eq!(got.step, 9999);
    for (d, n) in dst.iter_mut().zip(&names) {
        rlaunch::snapshot::read_f32s(got.get(n).ok_or("an entry is missing")?, d)?;
    }
    let load_copy = t.elapsed().as_secs_f64();
    assert!(dst == state, "the restored state is the saved one");
    let t = Instant::now();
    let bytes = std::fs::read(&file)?;
    let read = t.elapsed().as_secs_f64();
    for (i, d) in dst.iter_mut().enumerate() {
        let at = i * per * 4;
        rlaunch::snapshot::read_f32s(&bytes[at..at + per * 4], d)?;
    }
    let read_copy = t.elapsed().as_secs_f64();
    std::fs::remove_file(&file)?;
    let json =
        format!(r#"{{"load": {load}, "load_copy": {load_copy}, "file_read": {read}, "file_read_copy": {read_copy}}}"#);
    std::fs::write(out.join("rust1.json"), json)?;
    Ok(())
}

//! Training checkpoints written atomically, so that a kill at any moment leaves the latest
//! complete checkpoint readable, and every (re)start can resume from it.
//!
//! A checkpoint is one file `ckpt-{step:012}.bin`: a magic line, a JSON header (step, epoch,
//! sampler position, user metadata, tensor names and lengths), the tensors as little-endian
//! f32, and a trailing FNV-1a 64 checksum of everything before it. It is written to a
//! temporary name in the same directory, fsynced, renamed into place, and the directory is
//! fsynced. Readers ignore temporary files and skip any file whose checksum or length is
//! wrong, so the latest *valid* file wins. Older checkpoints beyond `keep` are deleted.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"RLCKPT1\n";

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O on {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path} is invalid: {reason}")]
    Corrupt { path: PathBuf, reason: String },
}

/// What a checkpoint holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Optimizer steps taken so far.
    pub step: u64,
    pub epoch: u64,
    /// The sampler's position in `epoch`, as the program counts it (`examples/train`: the samples
    /// of the epoch the whole world consumed, so that another world size resumes there).
    pub sampler_pos: u64,
    /// Free-form metadata (hyper-parameters, to check a resume is compatible).
    pub meta: serde_json::Value,
    /// Named tensors, e.g. `("params", ..)`, `("momentum", ..)`.
    pub tensors: Vec<(String, Vec<f32>)>,
}

impl Checkpoint {
    pub fn tensor(&self, name: &str) -> Option<&[f32]> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t.as_slice())
    }
}

fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

/// Encodes a checkpoint into its file bytes.
pub fn encode(ck: &Checkpoint) -> Vec<u8> {
    let header = serde_json::json!({
        "step": ck.step,
        "epoch": ck.epoch,
        "sampler_pos": ck.sampler_pos,
        "meta": ck.meta,
        "tensors": ck.tensors.iter().map(|(n, t)| serde_json::json!({"name": n, "len": t.len()})).collect::<Vec<_>>(),
    })
    .to_string();
    let mut out = Vec::with_capacity(64 + header.len() + ck.tensors.iter().map(|t| t.1.len() * 4).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for (_, t) in &ck.tensors {
        for x in t {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    let sum = fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Decodes file bytes, checking magic, lengths and checksum.
pub fn decode(path: &Path, data: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let bad = |reason: &str| CheckpointError::Corrupt { path: path.to_path_buf(), reason: reason.to_string() };
    if data.len() < MAGIC.len() + 16 || &data[..8] != MAGIC {
        return Err(bad("not a checkpoint (magic)"));
    }
    let (body, tail) = data.split_at(data.len() - 8);
    if fnv1a(body) != u64::from_le_bytes(tail.try_into().expect("8 bytes")) {
        return Err(bad("checksum mismatch (incomplete or damaged)"));
    }
    let hlen = u64::from_le_bytes(body[8..16].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value =
        body.get(16..16 + hlen).and_then(|h| serde_json::from_slice(h).ok()).ok_or_else(|| bad("header"))?;
    let num = |k: &str| header[k].as_u64().ok_or_else(|| bad(&format!("header field {k}")));
    let mut at = 16 + hlen;
    let mut tensors = Vec::new();
    for t in header["tensors"].as_array().ok_or_else(|| bad("tensor list"))? {
        let name = t["name"].as_str().ok_or_else(|| bad("tensor name"))?.to_string();
        let len = t["len"].as_u64().ok_or_else(|| bad("tensor len"))? as usize;
        let bytes = body.get(at..at + len * 4).ok_or_else(|| bad("tensor data truncated"))?;
        tensors
            .push((name, bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()));
        at += len * 4;
    }
    if at != body.len() {
        return Err(bad("trailing bytes"));
    }
    Ok(Checkpoint {
        step: num("step")?,
        epoch: num("epoch")?,
        sampler_pos: num("sampler_pos")?,
        meta: header["meta"].clone(),
        tensors,
    })
}

/// Checkpoints of one run in one directory.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    dir: PathBuf,
    keep: usize,
}

impl CheckpointDir {
    /// Uses (and creates) `dir`, keeping the newest `keep` checkpoints (at least 1).
    pub fn new(dir: impl AsRef<Path>, keep: usize) -> Result<Self, CheckpointError> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        Ok(Self { dir, keep: keep.max(1) })
    }

    pub fn path_for(&self, step: u64) -> PathBuf {
        self.dir.join(format!("ckpt-{step:012}.bin"))
    }

    /// Writes `ck` atomically; returns its path. Crash-safe: before the rename only a
    /// temporary file exists, after it the complete file does.
    pub fn save(&self, ck: &Checkpoint) -> Result<PathBuf, CheckpointError> {
        self.save_with(ck, |_| {})
    }

    /// [`CheckpointDir::save`] with a hook called between writing the temporary file and
    /// renaming it (tests use it to die mid-write).
    pub fn save_with(&self, ck: &Checkpoint, before_rename: impl FnOnce(&Path)) -> Result<PathBuf, CheckpointError> {
        let data = encode(ck);
        let final_path = self.path_for(ck.step);
        let tmp = self.dir.join(format!(".tmp-ckpt-{}-{}", ck.step, std::process::id()));
        {
            let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
            // Written in pieces so that a kill mid-write leaves a partial temporary file.
            for piece in data.chunks(1 << 20) {
                f.write_all(piece).map_err(io(&tmp))?;
            }
            f.sync_all().map_err(io(&tmp))?;
        }
        before_rename(&tmp);
        fs::rename(&tmp, &final_path).map_err(io(&final_path))?;
        fs::File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io(&self.dir))?;
        self.prune()?;
        Ok(final_path)
    }

    /// Checkpoint files, newest (highest step) first.
    fn files(&self) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
        let mut v = Vec::new();
        for e in fs::read_dir(&self.dir).map_err(io(&self.dir))? {
            let e = e.map_err(io(&self.dir))?;
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(step) =
                name.strip_prefix("ckpt-").and_then(|s| s.strip_suffix(".bin")).and_then(|s| s.parse::<u64>().ok())
            {
                v.push((step, e.path()));
            }
        }
        v.sort_by_key(|f| std::cmp::Reverse(f.0));
        Ok(v)
    }

    fn prune(&self) -> Result<(), CheckpointError> {
        for (_, p) in self.files()?.into_iter().skip(self.keep) {
            let _ = fs::remove_file(p);
        }
        // Leftover temporary files of dead writers.
        for e in fs::read_dir(&self.dir).map_err(io(&self.dir))?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with(".tmp-ckpt-") && !name.ends_with(&format!("-{}", std::process::id())) {
                let _ = fs::remove_file(e.path());
            }
        }
        Ok(())
    }

    /// The newest checkpoint that reads back completely and passes its checksum.
    pub fn latest(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        for (_, p) in self.files()? {
            let data = match fs::read(&p) {
                Ok(d) => d,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(&p)(e)),
            };
            match decode(&p, &data) {
                Ok(ck) => return Ok(Some(ck)),
                Err(e) => tracing::warn!(path = %p.display(), error = %e, "skipping invalid checkpoint"),
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> Checkpoint {
        Checkpoint {
            step,
            epoch: 2,
            sampler_pos: 5,
            meta: serde_json::json!({"lr": 0.1}),
            tensors: vec![("params".into(), vec![1.0, -2.5, 3.25]), ("momentum".into(), vec![0.5; 4])],
        }
    }

    #[test]
    fn round_trips_and_latest_is_the_highest_valid_step() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = CheckpointDir::new(d.path(), 3).expect("dir");
        assert_eq!(c.latest().expect("read"), None);
        c.save(&sample(10)).expect("save");
        c.save(&sample(20)).expect("save");
        assert_eq!(c.latest().expect("read"), Some(sample(20)));
        // A damaged newest file is skipped.
        let p = c.path_for(30);
        let mut bytes = encode(&sample(30));
        let n = bytes.len();
        bytes[n / 2] ^= 0xff;
        fs::write(&p, &bytes).expect("write");
        assert_eq!(c.latest().expect("read").map(|c| c.step), Some(20));
        // So is a truncated one.
        fs::write(&p, &encode(&sample(30))[..n - 3]).expect("write");
        assert_eq!(c.latest().expect("read").map(|c| c.step), Some(20));
    }

    #[test]
    fn keeps_only_the_newest_checkpoints() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = CheckpointDir::new(d.path(), 2).expect("dir");
        for s in 1..=5 {
            c.save(&sample(s)).expect("save");
        }
        let steps: Vec<u64> = c.files().expect("list").into_iter().map(|f| f.0).collect();
        assert_eq!(steps, vec![5, 4]);
    }

    #[test]
    fn a_write_interrupted_before_rename_leaves_the_previous_latest() {
        let d = tempfile::tempdir().expect("tempdir");
        let c = CheckpointDir::new(d.path(), 2).expect("dir");
        c.save(&sample(1)).expect("save");
        // Simulate a writer that dies after writing its temporary file.
        let r = std::panic::catch_unwind(|| {
            let _ = c.save_with(&sample(2), |_| panic!("killed mid-write"));
        });
        assert!(r.is_err());
        assert_eq!(c.latest().expect("read").map(|c| c.step), Some(1));
    }
}

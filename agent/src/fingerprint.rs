//! Reads this node's fingerprint ([`rlaunch::fingerprint`]) when an elastic agent starts: the
//! `NCCL_*`, `GLOO_*` and `CUDA_*` variables the workers inherit, a hash of each file the
//! program names (the interpreter, the script), python, torch, CUDA and NCCL versions from the
//! workers' Python without importing torch (package metadata), GPU model and driver from
//! `/proc/driver/nvidia`. Bounded: a Python that does not answer within a few seconds, or a file
//! too large to hash, is noted as such.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::path::Path;
use std::time::Duration;

use rlaunch::fingerprint::Fingerprint;

/// Prefixes of the variables that must match across nodes.
pub const VARIABLES: &[&str] = &["NCCL_", "GLOO_", "CUDA_"];
/// Variables of those that are each node's own (a scheduler's partial allocation).
pub const PER_NODE: &[&str] = &["CUDA_VISIBLE_DEVICES"];
/// Files larger than this are not hashed (noted by size instead).
const MAX_HASHED: u64 = 512 << 20;
/// Files of the program hashed at most.
const MAX_FILES: usize = 4;
const PYTHON_WITHIN: Duration = Duration::from_secs(10);

/// Prints the versions as JSON without importing torch (importing it takes seconds).
const PYTHON_VERSIONS: &str = r#"
import json, os, sys
import importlib.metadata as md, importlib.util as iu
out = {"python": sys.version.split()[0]}
try:
    out["torch"] = md.version("torch")
except Exception:
    pass
try:
    spec = iu.find_spec("torch")
    if spec and spec.submodule_search_locations:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            for line in f:
                if line.startswith("cuda") and "=" in line:
                    out["cuda"] = line.split("=", 1)[1].strip().strip("'\"")
except Exception:
    pass
for d in md.distributions():
    name = (d.metadata["Name"] or "").lower()
    if name.startswith("nvidia-nccl"):
        out["nccl"] = d.version
print(json.dumps(out))
"#;

/// The fingerprint of this node for `program` (the workers' argv, wrapped in Python where it
/// is a script).
pub async fn collect(program: &[OsString]) -> Fingerprint {
    let mut fp = variables(std::env::vars_os());
    let files = program_files(program);
    let hashed = tokio::task::spawn_blocking(move || hash_files(&files)).await.unwrap_or_default();
    fp.extend(hashed);
    if let Some(python) = program.first().filter(|p| is_python(Path::new(p))) {
        fp.extend(python_versions(Path::new(python)).await);
    }
    fp.extend(gpus(Path::new("/proc/driver/nvidia")));
    // Nothing a peer would print raw to a terminal.
    for v in fp.values_mut() {
        if v.chars().any(char::is_control) {
            *v = v.chars().map(|c| if c.is_control() { '?' } else { c }).collect();
        }
    }
    Fingerprint(fp)
}

/// The files that are the program: the interpreter and its script (the first argument after
/// the interpreter's own options), else the executable alone. Other arguments may name a
/// node's own files (a hostfile, a data shard): they are not the program.
pub fn program_files(program: &[OsString]) -> Vec<OsString> {
    let Some(first) = program.first() else { return Vec::new() };
    let mut files = vec![first.clone()];
    if is_python(Path::new(first)) {
        if let Some(script) = program[1..].iter().find(|a| !a.to_string_lossy().starts_with('-')) {
            files.push(script.clone());
        }
    }
    files
}

fn is_python(p: &Path) -> bool {
    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("python"))
}

/// `env NAME → value` for each variable of [`VARIABLES`].
pub fn variables(vars: impl Iterator<Item = (OsString, OsString)>) -> BTreeMap<String, String> {
    vars.filter_map(|(k, v)| {
        let k = k.to_str()?.to_owned();
        (VARIABLES.iter().any(|p| k.starts_with(p)) && !PER_NODE.contains(&k.as_str()))
            .then(|| (format!("env {k}"), v.to_string_lossy().into_owned()))
    })
    .take(rlaunch::fingerprint::MAX_ENTRIES - 16)
    .collect()
}

/// `program NAME → sha256 (16 hex)` for each argument that is a regular file.
fn hash_files(args: &[OsString]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for a in args {
        let p = Path::new(a);
        let Ok(meta) = std::fs::metadata(p) else { continue };
        if !meta.is_file() {
            continue;
        }
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        // Too large to hash, or unreadable: left out (what is not known is no difference).
        if meta.len() > MAX_HASHED {
            continue;
        }
        if let Ok(h) = sha256_file(p) {
            out.insert(format!("program {name}"), h);
        }
        if out.len() == MAX_FILES {
            break;
        }
    }
    out
}

fn sha256_file(p: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    let mut f = std::fs::File::open(p)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect())
}

async fn python_versions(python: &Path) -> BTreeMap<String, String> {
    let mut cmd = tokio::process::Command::new(python);
    cmd.args(["-I", "-c", PYTHON_VERSIONS])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    // A Python that fails or does not answer tells nothing (left out: not a difference).
    let out = match tokio::time::timeout(PYTHON_WITHIN, cmd.output()).await {
        Ok(Ok(o)) if o.status.success() => o.stdout,
        _ => return BTreeMap::new(),
    };
    serde_json::from_slice::<BTreeMap<String, String>>(&out).unwrap_or_default()
}

/// `driver` and `gpu` (`8 × NVIDIA H100 80GB HBM3`) from the NVIDIA driver's proc files.
pub fn gpus(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Ok(v) = std::fs::read_to_string(root.join("version")) {
        // `NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 …`
        let driver =
            v.lines().next().and_then(|l| l.split("Kernel Module").nth(1)).and_then(|r| r.split_whitespace().next());
        if let Some(d) = driver {
            out.insert("driver".to_owned(), d.to_owned());
        }
    }
    let mut models: BTreeMap<String, usize> = BTreeMap::new();
    if let Ok(dir) = std::fs::read_dir(root.join("gpus")) {
        for e in dir.flatten() {
            let Ok(info) = std::fs::read_to_string(e.path().join("information")) else { continue };
            if let Some(model) = info.lines().find_map(|l| l.strip_prefix("Model:")) {
                *models.entry(model.trim().to_owned()).or_default() += 1;
            }
        }
    }
    if !models.is_empty() {
        let gpu: Vec<String> = models.into_iter().map(|(m, n)| format!("{n} × {m}")).collect();
        out.insert("gpu".to_owned(), gpu.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_variables_that_must_match_are_taken() {
        let vars = [
            ("NCCL_IB_HCA", "mlx5_0"),
            ("PATH", "/bin"),
            ("CUDA_VISIBLE_DEVICES", "0,1"),
            ("GLOO_SOCKET_IFNAME", "eth0"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let got = variables(vars.into_iter());
        let keys: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(keys, ["env GLOO_SOCKET_IFNAME", "env NCCL_IB_HCA"], "CUDA_VISIBLE_DEVICES is each node's own");
    }

    #[test]
    fn gpu_model_and_driver_come_from_the_drivers_proc_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("version"),
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\nGCC version: gcc 12\n",
        )
        .unwrap();
        for (bus, model) in [("0000:18:00.0", "NVIDIA H100 80GB HBM3"), ("0000:2a:00.0", "NVIDIA H100 80GB HBM3")] {
            let d = dir.path().join("gpus").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("information"), format!("Model: \t\t {model}\nIRQ:   \t\t 17\n")).unwrap();
        }
        let got = gpus(dir.path());
        assert_eq!(got.get("driver").map(String::as_str), Some("550.54.15"));
        assert_eq!(got.get("gpu").map(String::as_str), Some("2 × NVIDIA H100 80GB HBM3"));
        assert!(gpus(Path::new("/nonexistent")).is_empty());
    }

    #[test]
    fn the_program_is_the_interpreter_and_its_script_not_the_other_arguments() {
        let argv = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            program_files(&argv(&["/venv/bin/python3", "-u", "train.py", "--hosts", "hostfile"])),
            argv(&["/venv/bin/python3", "train.py"])
        );
        assert_eq!(program_files(&argv(&["./train", "--data", "shard0"])), argv(&["./train"]));
    }

    #[test]
    fn files_of_the_program_are_hashed_and_other_arguments_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("train.py");
        std::fs::write(&script, "print(1)\n").unwrap();
        let got = hash_files(&[OsString::from("-u"), script.clone().into_os_string(), OsString::from("--lr=0.1")]);
        assert_eq!(got.len(), 1);
        let first = got["program train.py"].clone();
        assert_eq!(first.len(), 16);
        std::fs::write(&script, "print(2)\n").unwrap();
        assert_ne!(hash_files(&[script.into_os_string()])["program train.py"], first);
    }
}

//! The GPU path's checks that need no GPU: every `.cu` source compiles to PTX through NVRTC
//! from PyPI's wheel in `.venv`, cuBLAS and NCCL from the venv load, and NCCL makes unique
//! ids (ncclGetUniqueId only picks a bootstrap address, it needs no driver).
//!
//! None of this is a GPU result: the PTX is never run here. `scripts/gpu-check.sh` runs the
//! kernels, training and NCCL on a real GPU.

use std::path::PathBuf;
use std::sync::Arc;

use rlaunch_kernels::probe::{self, Lib, LibState, SearchPath};
use rlaunch_kernels::{compile, nccl, sources, KernelError};

/// The repository's `.venv` with PyPI's NVIDIA wheels; its absence is a loud failure.
fn venv_search() -> SearchPath {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let venv = probe::find_venv_upwards(&root).unwrap_or_else(|| {
        panic!(
            "no .venv with PyPI's nvidia-* wheels (nvidia/*/lib) above {}: run scripts/install-deps.sh \
             (it installs torch, which brings NVRTC, cuBLAS and NCCL for CUDA 13)",
            root.display()
        )
    });
    SearchPath::system().venv(&venv)
}

#[test]
fn every_cu_source_compiles_to_ptx_through_the_venv_nvrtc() {
    let search = venv_search();
    probe::ensure(Lib::Nvrtc, &search).expect("NVRTC from the venv loads");
    for src in sources::ALL {
        let ptx = compile::ptx(src).unwrap_or_else(|e| panic!("{}: {e}", src.name));
        let text = ptx.to_src();
        assert!(text.contains(".version") && text.contains(".target"), "{}: not PTX", src.name);
        for k in src.kernels {
            assert!(text.contains(&format!(".entry {k}(")), "{}: PTX lacks kernel {k}", src.name);
        }
        // Cached per process by source text: the second request is the same object.
        let again = compile::ptx(src).expect("cached");
        assert!(Arc::ptr_eq(&ptx, &again), "{}: compiled twice", src.name);
    }
    assert!(compile::cached_sources() >= sources::ALL.len());
}

#[test]
fn every_cu_source_compiles_to_cubin_for_the_gpu_machines_architectures() {
    // H100/H200 are sm_90, A100 sm_80: the CUBIN path Kernels::load prefers on a GPU (it
    // needs no driver JIT, so it also runs where the driver is older than this NVRTC).
    probe::ensure(Lib::Nvrtc, &venv_search()).expect("NVRTC from the venv loads");
    for arch in [(9, 0), (8, 0)] {
        for src in sources::ALL {
            let bin = compile::cubin(src, arch).unwrap_or_else(|e| panic!("{} sm_{}{}: {e}", src.name, arch.0, arch.1));
            assert_eq!(&bin[..4], b"\x7fELF", "{}: a CUBIN is an ELF image", src.name);
            for k in src.kernels {
                let name = k.as_bytes();
                assert!(bin.windows(name.len()).any(|w| w == name), "{}: CUBIN lacks {k}", src.name);
            }
            assert!(Arc::ptr_eq(&bin, &compile::cubin(src, arch).expect("cached")), "compiled twice");
        }
    }
}

#[test]
fn a_broken_source_is_an_error_carrying_nvrtc_log() {
    probe::ensure(Lib::Nvrtc, &venv_search()).expect("NVRTC from the venv loads");
    let err = compile::ptx_of_text("broken.cu", "extern \"C\" __global__ void k() { undefined_thing(); }")
        .expect_err("does not compile");
    match err {
        KernelError::Compile { source_name, log, .. } => {
            assert_eq!(source_name, "broken.cu");
            assert!(log.contains("undefined_thing"), "log names the culprit: {log}");
        }
        other => panic!("expected a compile error, got {other}"),
    }
}

#[test]
fn cublas_and_nvrtc_from_the_venv_load_under_their_cuda13_sonames() {
    let search = venv_search();
    for (lib, file) in [(Lib::Nvrtc, "libnvrtc.so.13"), (Lib::Cublas, "libcublas.so.13")] {
        probe::ensure(lib, &search).unwrap_or_else(|e| panic!("{e}"));
        let from = probe::loaded_from(lib).expect("loaded");
        assert!(from.ends_with(file), "{lib:?} loaded from {from}");
    }
}

#[test]
fn nccl_from_the_venv_loads_as_libnccl_so_2_and_makes_distinct_unique_ids() {
    probe::ensure(Lib::Nccl, &venv_search()).unwrap_or_else(|e| panic!("{e}"));
    let from = probe::loaded_from(Lib::Nccl).expect("loaded");
    assert!(from.ends_with("libnccl.so.2") || from.ends_with("libnccl.so"), "NCCL loaded from {from}");
    let (major, minor, _) = nccl::version().expect("ncclGetVersion");
    assert!(major == 2 && minor >= 10, "NCCL {major}.{minor}: ncclAvg needs 2.10");
    let a = nccl::UniqueId::new().expect("ncclGetUniqueId works without a GPU");
    let b = nccl::UniqueId::new().expect("ncclGetUniqueId");
    assert_ne!(a.internal, [0u8; 128]);
    assert_ne!(a, b, "two ids must differ");
    assert_eq!(nccl::UniqueId::from_bytes(&a.internal), Some(a));
}

#[test]
fn probe_names_what_is_missing_instead_of_panicking() {
    let p = probe::probe(&venv_search());
    for lib in [Lib::Nvrtc, Lib::Cublas, Lib::Nccl] {
        assert!(p.state(lib).is_loaded(), "{lib:?}: {:?}", p.state(lib));
    }
    match p.state(Lib::Driver) {
        // A machine with the NVIDIA driver (a GPU machine): the device count is known.
        LibState::Loaded { .. } => assert!(p.devices.is_ok() || p.require(&[], true).is_err()),
        // This CPU-only machine: a clear message, not cudarc's panic.
        LibState::Missing { tried, .. } => {
            assert!(tried.iter().any(|t| t.contains("libcuda.so.1")));
            let msg = p.require(&Lib::ALL, true).expect_err("no driver").to_string();
            assert!(msg.contains("CUDA driver (libcuda)") && msg.contains("NVIDIA driver"), "{msg}");
            assert!(!msg.contains("NVRTC:"), "NVRTC is present: {msg}");
        }
    }
    println!("{}", p.summary());
}

#[test]
fn device_auto_falls_back_to_the_cpu_with_a_notice_and_cuda_fails_with_the_reason_here() {
    use rlaunch::gpu::{select, Device, GpuError, Selected};
    let search = venv_search();
    assert_eq!(select(Device::Cpu, 0, true, &search).expect("cpu"), Selected::Cpu { notice: None });
    let p = probe::probe(&search);
    match (p.state(Lib::Driver), p.devices.clone()) {
        // This CPU-only machine: no driver, so auto falls back and cuda names libcuda.
        (LibState::Missing { .. }, _) => {
            match select(Device::Auto, 0, true, &search).expect("auto never fails") {
                Selected::Cpu { notice: Some(n) } => {
                    assert!(n.contains("training on the CPU") && n.contains("CUDA driver (libcuda)"), "{n}")
                }
                other => panic!("expected the CPU with a notice, got {other:?}"),
            }
            let err = select(Device::Cuda, 0, true, &search).expect_err("no driver here");
            let chain = format!("{:#}", anyhow::Error::from(err));
            assert!(
                chain.starts_with("--device cuda: ")
                    && chain.contains("CUDA libraries missing")
                    && chain.contains("libcuda.so.1"),
                "{chain}"
            );
        }
        // A GPU machine with n GPUs: local rank 0 gets GPU 0; local rank n has no GPU of its
        // own, so auto falls back with the reason and cuda fails with it.
        (LibState::Loaded { .. }, Ok(n)) if n > 0 => {
            match select(Device::Cuda, 0, true, &search).expect("GPU 0 with the venv's libraries") {
                Selected::Cuda { ordinal, .. } => assert_eq!(ordinal, 0),
                other => panic!("--device cuda never falls back: {other:?}"),
            }
            match select(Device::Auto, n, true, &search).expect("auto never fails") {
                Selected::Cpu { notice: Some(msg) } => {
                    assert!(msg.contains("training on the CPU") && msg.contains(&format!("needs GPU {n}")), "{msg}")
                }
                other => panic!("local rank {n} of {n} GPUs: expected the CPU with a notice, got {other:?}"),
            }
            match select(Device::Cuda, n, true, &search) {
                Err(GpuError::NotEnoughGpus { local_rank, devices }) => assert_eq!((local_rank, devices), (n, n)),
                other => panic!("local rank {n} of {n} GPUs: expected NotEnoughGpus, got {other:?}"),
            }
        }
        // A driver but no usable GPU: auto falls back and cuda fails, both saying so.
        (LibState::Loaded { .. }, devices) => {
            match select(Device::Auto, 0, true, &search).expect("auto never fails") {
                Selected::Cpu { notice: Some(n) } => {
                    assert!(n.contains("training on the CPU") && n.contains("no GPU is usable"), "{n} ({devices:?})")
                }
                other => panic!("expected the CPU with a notice, got {other:?}"),
            }
            let err = select(Device::Cuda, 0, true, &search).expect_err("no usable GPU here");
            let chain = format!("{:#}", anyhow::Error::from(err));
            assert!(chain.starts_with("--device cuda: ") && chain.contains("no GPU is usable"), "{chain}");
        }
    }
}

/// The GPU checks and benchmarks; `scripts/gpu-check.sh` runs this on a GPU machine and
/// keeps the report in `bench/gpu/RESULTS.md`.
#[test]
#[ignore = "needs a GPU: run scripts/gpu-check.sh"]
fn gpu_check() -> anyhow::Result<()> {
    use anyhow::Context;
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out =
        std::env::var("RLAUNCH_GPU_CHECK_OUT").map(PathBuf::from).unwrap_or_else(|_| root.join("bench/gpu/RESULTS.md"));
    let date = std::env::var("RLAUNCH_GPU_CHECK_DATE").unwrap_or_else(|_| "(date not given)".into());
    // scripts/gpu-check.sh passes the toolkit and wheel directories it found.
    let mut search = SearchPath::system();
    for d in std::env::var("RLAUNCH_CUDA_LIB_DIRS").unwrap_or_default().split(':').filter(|d| !d.is_empty()) {
        search = search.dir(d);
    }
    for d in SearchPath::conventional().dirs() {
        search = search.dir(d.clone());
    }
    if let Some(v) = probe::find_venv_upwards(&root) {
        search = search.venv(&v);
    }
    let report = rlaunch::gpu::check::run(&search, &date).context("the GPU path could not start")?;
    println!("{}", report.markdown);
    std::fs::write(&out, &report.markdown).with_context(|| format!("writing {}", out.display()))?;
    anyhow::ensure!(
        report.failures.is_empty(),
        "{} GPU check(s) failed:\n{}",
        report.failures.len(),
        report.failures.join("\n")
    );
    Ok(())
}

#[test]
fn nccl_unique_id_reaches_every_rank_through_the_store_and_a_missing_rank_is_a_timeout() {
    use rlaunch::gpu::{exchange_unique_id, key_prefix, GpuError};
    use rlaunch::store::{StoreClient, StoreServer};
    use std::time::{Duration, Instant};
    probe::ensure(Lib::Nccl, &venv_search()).unwrap_or_else(|e| panic!("{e}"));
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let server = rt.block_on(StoreServer::start("127.0.0.1:0".parse().expect("address"))).expect("store server");
    let addr = server.local_addr().to_string();
    assert_eq!(key_prefix("job-a", 3), "rlaunch/nccl/job-a/3/");

    let run = |prefix: String, world: usize, ranks: std::ops::Range<usize>, timeout: Duration| {
        let handles: Vec<_> = ranks
            .map(|rank| {
                let (addr, prefix) = (addr.clone(), prefix.clone());
                std::thread::spawn(move || -> Result<[u8; 128], String> {
                    let mut c = StoreClient::connect(&addr, Duration::from_secs(10)).map_err(|e| e.to_string())?;
                    exchange_unique_id(&mut c, &prefix, rank, world, timeout).map(|id| id.internal).map_err(|e| match e
                    {
                        GpuError::Store { step, .. } => format!("store step {step}"),
                        GpuError::Timeout { op, .. } => format!("timeout at {op}"),
                        GpuError::Interrupted { op, .. } => format!("interrupted at {op}"),
                        other => other.to_string(),
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect::<Vec<_>>()
    };

    // Three ranks of attempt 0: one id, the same everywhere.
    let ids = run(key_prefix("job-a", 0), 3, 0..3, Duration::from_secs(10));
    let first = ids[0].clone().expect("rank 0");
    assert!(ids.iter().all(|r| r.as_ref() == Ok(&first)), "{ids:?}");
    // The next attempt (restart count 1) gets a fresh id, not the old one.
    let again = run(key_prefix("job-a", 1), 3, 0..3, Duration::from_secs(10));
    assert_ne!(again[0].clone().expect("rank 0"), first);
    // Rank 1 of 2 never comes: rank 0 fails at the store barrier within its deadline.
    let t = Instant::now();
    let lonely = run(key_prefix("job-b", 0), 2, 0..1, Duration::from_millis(800));
    assert_eq!(lonely[0], Err("timeout at wait for every rank".to_string()));
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    rt.block_on(server.shutdown()).expect("store shutdown");
}

/// A round's end (`rlaunch::comm::abort_all`, what `rlaunch::resilient::run` calls when the
/// agent says the round ended) ends an NCCL group's bootstrap waiting on a rank that will never
/// come, at once rather than at its timeout, and a new bootstrap in the same process works once
/// the abort is cleared. In a process of its own (the abort is process-wide): this test runs
/// `nccl_bootstrap_ended_by_the_round_s_end_in_its_own_process`.
#[test]
fn a_round_s_end_ends_an_nccl_bootstrap_waiting_on_a_lost_rank() {
    let exe = std::env::current_exe().expect("the test binary");
    let out = std::process::Command::new(exe)
        .args(["--exact", "kernels_nvrtc::nccl_bootstrap_ended_by_the_round_s_end_in_its_own_process"])
        .args(["--ignored", "--nocapture", "--test-threads", "1"])
        .env("RLAUNCH_TEST_OWN_PROCESS", "1")
        .output()
        .expect("running the test binary");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
}

#[test]
#[ignore = "run by a_round_s_end_ends_an_nccl_bootstrap_waiting_on_a_lost_rank, in a process of its own"]
fn nccl_bootstrap_ended_by_the_round_s_end_in_its_own_process() {
    use rlaunch::gpu::{exchange_unique_id, key_prefix, GpuError};
    use rlaunch::store::{StoreClient, StoreServer};
    use std::time::{Duration, Instant};
    assert!(std::env::var_os("RLAUNCH_TEST_OWN_PROCESS").is_some(), "run alone, in its own process");
    probe::ensure(Lib::Nccl, &venv_search()).unwrap_or_else(|e| panic!("{e}"));
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let server = rt.block_on(StoreServer::start("127.0.0.1:0".parse().expect("address"))).expect("store server");
    let addr = server.local_addr().to_string();
    // Rank 1 of 2 waits for rank 0's id, which never comes; the round ends 0.3 s in.
    let (a, p) = (addr.clone(), key_prefix("job-abort", 0));
    let waiting = std::thread::spawn(move || {
        let mut c = StoreClient::connect(&a, Duration::from_secs(10)).expect("store");
        let t = Instant::now();
        (exchange_unique_id(&mut c, &p, 1, 2, Duration::from_secs(60)).map(|_| ()), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    let failures = rlaunch::comm::failures();
    rlaunch::comm::abort_all();
    let (got, took) = waiting.join().expect("the waiting rank");
    assert!(matches!(got, Err(GpuError::Interrupted { rank: 1, op: "wait for id" })), "{got:?}");
    assert!(took < Duration::from_secs(3), "ended {took:?} after it began, not at the round's end");
    assert!(rlaunch::comm::failures() > failures, "counted as a failed collective (the survivor waits for the word)");
    // Started after the abort and before it is cleared: fails at once.
    let mut c = StoreClient::connect(&addr, Duration::from_secs(10)).expect("store");
    let got = exchange_unique_id(&mut c, &key_prefix("job-abort", 1), 0, 1, Duration::from_secs(60));
    assert!(matches!(got, Err(GpuError::Interrupted { .. })), "{got:?}");
    // The next round: a new bootstrap in the same process.
    rlaunch::comm::clear_abort();
    let got = exchange_unique_id(&mut c, &key_prefix("job-abort", 2), 0, 1, Duration::from_secs(10));
    assert!(got.is_ok(), "{got:?}");
    rt.block_on(server.shutdown()).expect("store shutdown");
}

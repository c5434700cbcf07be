//! Every integration test in one binary: each `tests/<file>.rs` is a module here (`autotests`
//! is off in Cargo.toml), so the workspace is linked once for all of them instead of once per
//! file. A test is named `<file>::<function>`: `cargo test -p integration-tests -- launcher::`
//! runs one file's tests, `--exact kernels_nvrtc::gpu_check` one test.
//!
//! Sharing one process is safe because no test changes process-wide state: none sets or removes
//! environment variables, changes signal dispositions, the umask, rlimits or the current
//! directory of the test process (children get theirs through `Command`), and the one static
//! (`netns::CLUSTERS`) only numbers clusters, whose subnets are locked by creating their bridge.
//! A test that needs such a change must go to a binary of its own (a `[[test]]` in Cargo.toml).
//! So do the two that run cargo (`docker.rs` through `docker/build.sh`, `pip.rs` through
//! maturin): a build that relinks `target/debug/rlaunch` while other tests start it fails them
//! (seen: a Slurm test found no rlaunch while `pip` built the wheel). Binaries run one after
//! another, so theirs run alone, as before.

mod agent_faults;
mod agent_idle_connections;
mod command_line;
mod containment;
mod ddp_train_rlaunch;
mod detector;
mod etcd_multinode;
mod first_contact;
mod hang;
mod kernels_nvrtc;
mod kubernetes;
mod launcher;
mod log_dir_swap;
mod logs;
mod multinode;
mod resilient;
mod slurm;
mod snapshots;
mod status_page;
mod status_token;
mod store_torch;
mod terminal;
mod tls_job;
mod torch_interop;
mod torchrun_diff;
mod warm_workers;

/// With `autotests` off, a file in `tests/` that is neither a module above nor a `[[test]]` of
/// its own would never be built.
#[test]
fn every_test_file_is_a_module_of_the_integration_binary_or_a_binary_of_its_own() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let main = include_str!("main.rs");
    let cargo_toml = include_str!("../Cargo.toml");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("integration-tests/tests") {
        let name = entry.expect("a directory entry").file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".rs").filter(|s| *s != "main") {
            let own_binary = cargo_toml.contains(&format!("path = \"tests/{name}\""));
            if !own_binary && !main.lines().any(|l| l == format!("mod {stem};")) {
                missing.push(name);
            }
        }
    }
    assert!(missing.is_empty(), "neither modules of tests/main.rs nor [[test]]s, so never built or run: {missing:?}");
}

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

mod agent_faults;
mod agent_idle_connections;
mod command_line;
mod containment;
mod ddp_train_rlaunch;
mod detector;
mod docker;
mod etcd_multinode;
mod first_contact;
mod hang;
mod kernels_nvrtc;
mod kubernetes;
mod launcher;
mod log_dir_swap;
mod logs;
mod multinode;
mod pip;
mod slurm;
mod status_page;
mod store_torch;
mod terminal;
mod tls_job;
mod torch_interop;
mod torchrun_diff;

/// With `autotests` off, a file in `tests/` that is not a module above would never be built.
#[test]
fn every_test_file_is_a_module_of_the_integration_binary() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let main = include_str!("main.rs");
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("integration-tests/tests") {
        let name = entry.expect("a directory entry").file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".rs").filter(|s| *s != "main") {
            if !main.lines().any(|l| l == format!("mod {stem};")) {
                missing.push(name);
            }
        }
    }
    assert!(missing.is_empty(), "not modules of tests/main.rs, so never built or run: {missing:?}");
}

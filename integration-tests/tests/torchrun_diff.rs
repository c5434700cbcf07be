//! rlaunch against torchrun, invocation by invocation: the same command line (only the command
//! name changes) through both, comparing the exit status, every worker's environment and argv,
//! the `--log-dir` layout, the console under `--tee`/`--local-ranks-filter`, and whether workers
//! outlive a signalled launcher. Every known difference is listed in `cases()` with its reason;
//! anything else fails with a per-case diff.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use integration_tests::{bin, pid_alive, stderr_of, stdout_of, tempdir, venv_python, wait_deadline};

/// torchrun takes seconds to start (it imports torch); more at once would only queue on the CPU.
const PARALLEL: usize = 4;
const DEADLINE: Duration = Duration::from_secs(120);

/// Worker environment variables whose values legitimately differ between two launches (even of
/// the same launcher): compared by shape, each normalized as its reason says.
const VARYING: &[(&str, &str)] = &[
    ("MASTER_PORT", "the store's port, chosen free at each start: compared as a port number"),
    ("MASTER_ADDR", "a name of this host (torchrun's c10d gives the endpoint's `localhost`, rlaunch 127.0.0.1)"),
    ("TORCHELASTIC_RUN_ID", "a generated id (torchrun: a uuid4) is random: compared as generated or not"),
    ("TORCHELASTIC_ERROR_FILE", "under a directory with random parts: compared as its base and last 3 components"),
];

/// The worker: records what it was given, prints marked lines on both streams, then behaves as
/// `DIFF_MODE` says. Each line is printed before the record is written, so once every record of
/// an attempt exists, every line of it has been written.
const WORKER: &str = r#"import json, os, signal, sys, time

out = os.environ["DIFF_OUT"]
rank = os.environ.get("RANK", "unset")
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "unset")
mode = os.environ.get("DIFF_MODE", "")

print(f"wkr:hello rank={rank} attempt={attempt}")
print(f"wkr:apple rank={rank}")
print(f"wkr:oops rank={rank} attempt={attempt}", file=sys.stderr)
print(f"wkr:kiwi rank={rank}", file=sys.stderr)
sys.stdout.flush()
sys.stderr.flush()

record = {
    "env": dict(os.environ),
    "argv": sys.argv,
    "executable": sys.executable,
    "cwd": os.getcwd(),
    "pid": os.getpid(),
}
tmp = os.path.join(out, f".rank{rank}.attempt{attempt}.tmp")
with open(tmp, "w") as f:
    json.dump(record, f)
os.rename(tmp, os.path.join(out, f"rank{rank}.attempt{attempt}.json"))


def all_started():
    n = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    deadline = time.time() + 20
    while time.time() < deadline:
        if sum(1 for f in os.listdir(out) if f.endswith(f".attempt{attempt}.json")) >= n:
            return
        time.sleep(0.02)


if mode == "exit3":
    all_started()
    sys.exit(3)
elif mode == "fail_first":
    all_started()
    if attempt == "0":
        sys.exit(5)
elif mode == "sigkill":
    all_started()
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "wait":
    # Let go of the launcher's pipes: a worker that outlives its launcher must not hold them.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    time.sleep(30)
"#;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Aspect {
    /// Exit code, or the signal that ended the launcher.
    Exit,
    /// Options the launcher did not recognise (from argparse's or clap's usage error).
    Flags,
    /// Per rank and attempt: the variables the launcher added or changed, argv, interpreter, cwd.
    Env,
    /// Files and directories under `--log-dir` and the worker lines in each file.
    Logs,
    /// Worker lines on the launcher's stdout and stderr, per rank, with their prefixes.
    Console,
    /// Workers still running after the launcher exited.
    Survivors,
}
use Aspect::*;

enum Expect {
    Same,
    /// These aspects differ (and the test fails if they stop differing, so the table stays true).
    Differs(&'static [Aspect], &'static str),
}
use Expect::*;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Record, print, exit 0.
    Ok,
    /// Every worker exits 3 once all have started.
    Exit3,
    /// Every worker exits 5 on attempt 0 once all have started, and succeeds afterwards.
    FailFirst,
    /// Every worker SIGKILLs itself once all have started.
    SigKill,
    /// Every worker sleeps 30 s (the launcher is signalled).
    Wait,
}

struct Case {
    name: &'static str,
    /// `{W}`: the worker script's absolute path; `{DIR}`: its directory (also the cwd, so
    /// `-m diffworker` finds it); `{LOGS}`: a fresh log directory; `{PORT}`: a free port.
    args: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
    mode: Mode,
    /// Sent to the launcher once this many workers have recorded themselves.
    signal: Option<(i32, usize)>,
    /// Compared besides Exit, Flags and Env, which always are.
    compare: &'static [Aspect],
    expect: Expect,
}

const BASE: Case = Case { name: "", args: &[], env: &[], mode: Mode::Ok, signal: None, compare: &[], expect: Same };

const FAILED_WORKER_EXIT: &str = "a failed worker: torchrun exits 1 (ChildFailedError through @record), rlaunch with \
    the worker's own exit code (128+N for a signal), so a script sees why";
const SIGNALLED_EXIT: &str = "stopped by a signal: torchrun exits 1 (SignalException through @record), rlaunch \
    128+N as a process killed by it would";
const VALIDATION_EXIT: &str = "a setting argparse accepts but torchrun rejects once it runs (config_from_args, \
    WorkerSpec, the agent): torchrun exits 1 with a Python traceback, rlaunch 2 (a usage error) with a one-line \
    message before anything starts";
const PREFIXED: &str = "rlaunch prefixes every worker line on the console with `[role rank]:` (whole lines, never \
    interleaved); torchrun prefixes only --tee'd streams and passes the others through untouched";
const PREFIXED_AND_KEPT: &str = "rlaunch prefixes every worker line on the console (torchrun only --tee'd streams) \
    and keeps both streams of every worker in --log-dir, for its failure report's stderr tail (torchrun writes only \
    the --redirects/--tee'd ones)";

fn cases() -> Vec<Case> {
    vec![
        // Single-node forms.
        Case { name: "default_one_worker", args: &["{W}"], ..BASE },
        Case { name: "nproc_2_with_script_args", args: &["--nproc-per-node", "2", "{W}", "a", "--b=1"], ..BASE },
        Case {
            name: "script_args_that_look_like_launcher_flags",
            args: &["--standalone", "{W}", "--nproc-per-node", "5", "-m", "--standalone"],
            ..BASE
        },
        Case { name: "standalone_2", args: &["--standalone", "--nproc-per-node", "2", "{W}"], ..BASE },
        Case {
            name: "standalone_ignores_rdzv_settings",
            args: &["--standalone", "--rdzv-id", "ignored", "--rdzv-backend", "static", "{W}"],
            ..BASE
        },
        Case {
            name: "c10d_localhost0_with_id",
            args: &[
                "--nnodes",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "localhost:0",
                "--rdzv-id",
                "job7",
                "--nproc-per-node",
                "2",
                "{W}",
            ],
            ..BASE
        },
        Case {
            name: "c10d_localhost0_underscore_spellings",
            args: &[
                "--nnodes",
                "1:1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                "localhost:0",
                "--rdzv_id",
                "job8",
                "{W}",
            ],
            ..BASE
        },
        Case {
            name: "c10d_localhost0_without_id",
            args: &["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "{W}"],
            expect: Differs(
                &[Exit, Env],
                "an elastic job without an id: torchrun runs it under the id `none` (shared by every such job), \
                 rlaunch refuses (exit 2) and says how to name it",
            ),
            ..BASE
        },
        Case {
            name: "static_master_addr_and_port",
            args: &[
                "--rdzv-backend",
                "static",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "{PORT}",
                "--nproc-per-node",
                "2",
                "{W}",
            ],
            ..BASE
        },
        Case {
            name: "static_by_master_port_and_node_rank",
            args: &["--node-rank", "0", "--master_port", "{PORT}", "--nproc-per-node", "2", "{W}"],
            ..BASE
        },
        Case { name: "run_id_is_not_a_torchrun_flag", args: &["--run-id", "job9", "{W}"], ..BASE },
        // Workers per node.
        Case { name: "nproc_cpu", args: &["--nproc-per-node", "cpu", "{W}"], ..BASE },
        Case { name: "nproc_auto", args: &["--nproc_per_node", "auto", "{W}"], ..BASE },
        Case {
            name: "nproc_gpu_without_gpu",
            args: &["--nproc-per-node", "gpu", "{W}"],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        // The program.
        Case { name: "module", args: &["--standalone", "-m", "diffworker", "x"], ..BASE },
        Case { name: "no_python", args: &["--standalone", "--no-python", "{W}", "y"], ..BASE },
        Case { name: "run_path", args: &["--standalone", "--run-path", "{W}", "z"], ..BASE },
        Case {
            name: "no_python_with_module",
            args: &["--no-python", "-m", "diffworker"],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        // Spellings and the environment.
        Case {
            name: "underscore_spellings",
            args: &["--standalone", "--nproc_per_node", "2", "--max_restarts", "0", "--monitor_interval", "0.2", "{W}"],
            ..BASE
        },
        Case { name: "pet_nproc_per_node", args: &["{W}"], env: &[("PET_NPROC_PER_NODE", "2")], ..BASE },
        Case {
            name: "pet_standalone_1",
            args: &["{W}"],
            env: &[("PET_STANDALONE", "1"), ("PET_NPROC_PER_NODE", "2")],
            ..BASE
        },
        Case {
            name: "pet_standalone_true",
            args: &["{W}"],
            env: &[("PET_STANDALONE", "true")],
            expect: Differs(
                &[Exit, Env],
                "torchrun reads boolean PET_* variables with int() and fails on `true` (exit 1, ValueError); \
                 rlaunch also takes true/false",
            ),
            ..BASE
        },
        Case {
            name: "flag_beats_pet",
            args: &["--standalone", "--nproc-per-node", "1", "--role", "flag", "{W}"],
            env: &[("PET_NPROC_PER_NODE", "2"), ("PET_ROLE", "env"), ("PET_MAX_RESTARTS", "2")],
            ..BASE
        },
        Case { name: "pet_module", args: &["--standalone", "diffworker"], env: &[("PET_MODULE", "1")], ..BASE },
        Case {
            name: "pet_rdzv_settings",
            args: &["{W}"],
            env: &[
                ("PET_NNODES", "1"),
                ("PET_RDZV_BACKEND", "c10d"),
                ("PET_RDZV_ENDPOINT", "localhost:0"),
                ("PET_RDZV_ID", "envjob"),
            ],
            ..BASE
        },
        Case {
            name: "preset_omp_and_nccl_variables_kept",
            args: &["--standalone", "--nproc-per-node", "2", "{W}"],
            env: &[("OMP_NUM_THREADS", "4"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")],
            ..BASE
        },
        // Restarts, roles, accepted settings.
        Case {
            name: "max_restarts_recovers_from_a_failed_first_attempt",
            args: &["--standalone", "--max-restarts", "1", "--nproc-per-node", "2", "{W}"],
            mode: Mode::FailFirst,
            ..BASE
        },
        Case {
            name: "restarts_exhausted",
            args: &["--standalone", "--max-restarts", "1", "{W}"],
            mode: Mode::Exit3,
            expect: Differs(&[Exit], FAILED_WORKER_EXIT),
            ..BASE
        },
        Case {
            name: "role_with_tee",
            args: &["--standalone", "--role", "trainer", "--nproc-per-node", "2", "--tee", "3", "{W}"],
            compare: &[Console],
            ..BASE
        },
        Case { name: "monitor_interval", args: &["--standalone", "--monitor-interval", "0.5", "{W}"], ..BASE },
        Case { name: "start_method_fork", args: &["--standalone", "--start_method", "fork", "{W}"], ..BASE },
        Case {
            name: "start_method_forkserver",
            args: &["--standalone", "--start-method", "forkserver", "{W}"],
            ..BASE
        },
        Case { name: "event_log_handler_null", args: &["--standalone", "--event-log-handler", "null", "{W}"], ..BASE },
        Case {
            name: "virtual_local_rank_with_visible_devices",
            args: &["--standalone", "--virtual-local-rank", "--nproc-per-node", "2", "{W}"],
            env: &[("CUDA_VISIBLE_DEVICES", "5,7")],
            ..BASE
        },
        Case {
            name: "virtual_local_rank_with_hip_devices",
            args: &["--standalone", "--virtual-local-rank", "--nproc-per-node", "2", "{W}"],
            env: &[("HIP_VISIBLE_DEVICES", "2,3"), ("CUDA_VISIBLE_DEVICES", "0,1")],
            ..BASE
        },
        Case {
            name: "virtual_local_rank_with_too_few_devices",
            args: &["--standalone", "--virtual-local-rank", "--nproc-per-node", "2", "{W}"],
            env: &[("CUDA_VISIBLE_DEVICES", "3")],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        Case {
            name: "signals_to_handle_reach_the_workers",
            args: &["--standalone", "--signals-to-handle", "SIGTERM,SIGUSR1", "{W}"],
            ..BASE
        },
        // Console.
        Case {
            name: "console_without_tee",
            args: &["--nproc-per-node", "2", "{W}"],
            compare: &[Console],
            expect: Differs(&[Console], PREFIXED),
            ..BASE
        },
        Case { name: "tee_3", args: &["--nproc-per-node", "2", "--tee", "3", "{W}"], compare: &[Console], ..BASE },
        Case {
            name: "tee_3_local_ranks_filter",
            args: &["--standalone", "--nproc-per-node", "2", "-t", "3", "--local-ranks-filter", "1", "{W}"],
            compare: &[Console],
            ..BASE
        },
        Case {
            name: "local_ranks_filter_without_tee",
            args: &["--standalone", "--nproc-per-node", "2", "--local_ranks_filter", "0", "{W}"],
            compare: &[Console],
            expect: Differs(&[Console], PREFIXED),
            ..BASE
        },
        Case {
            name: "log_line_prefix_template",
            args: &[
                "--standalone",
                "--nproc-per-node",
                "2",
                "--tee",
                "3",
                "--log-line-prefix-template",
                "${role_name}|${rank}|${local_rank}> ",
                "{W}",
            ],
            compare: &[Console],
            ..BASE
        },
        Case {
            name: "log_line_prefix_template_from_env",
            args: &["--standalone", "--tee", "3", "{W}"],
            env: &[("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "<${rank}> ")],
            compare: &[Console],
            ..BASE
        },
        // Log directory.
        Case {
            name: "log_dir_only",
            args: &["--nproc-per-node", "2", "--log-dir", "{LOGS}", "{W}"],
            compare: &[Logs, Console],
            expect: Differs(&[Logs, Console], PREFIXED_AND_KEPT),
            ..BASE
        },
        Case {
            name: "redirects_1",
            args: &["--standalone", "--nproc-per-node", "2", "--log-dir", "{LOGS}", "--redirects", "1", "{W}"],
            compare: &[Logs, Console],
            expect: Differs(&[Logs, Console], PREFIXED_AND_KEPT),
            ..BASE
        },
        Case {
            name: "redirects_3_short_flag",
            args: &["--standalone", "--nproc-per-node", "2", "--log-dir", "{LOGS}", "-r", "3", "{W}"],
            compare: &[Logs, Console],
            ..BASE
        },
        Case {
            name: "redirects_per_rank",
            args: &["--standalone", "--nproc-per-node", "2", "--log-dir", "{LOGS}", "--redirects", "0:1,1:2", "{W}"],
            compare: &[Logs, Console],
            expect: Differs(&[Logs, Console], PREFIXED_AND_KEPT),
            ..BASE
        },
        Case {
            name: "tee_per_rank_with_log_dir",
            args: &["--standalone", "--nproc-per-node", "2", "--log_dir", "{LOGS}", "--tee", "0:3,1:1", "{W}"],
            compare: &[Logs, Console],
            expect: Differs(&[Logs, Console], PREFIXED_AND_KEPT),
            ..BASE
        },
        Case {
            name: "tee_3_with_log_dir_and_filter",
            args: &[
                "--standalone",
                "--nproc-per-node",
                "2",
                "--log-dir",
                "{LOGS}",
                "--tee",
                "3",
                "--local-ranks-filter",
                "0",
                "{W}",
            ],
            compare: &[Logs, Console],
            ..BASE
        },
        Case {
            name: "restart_attempts_in_log_dir",
            args: &["--standalone", "--max-restarts", "1", "--log-dir", "{LOGS}", "--tee", "3", "{W}"],
            mode: Mode::FailFirst,
            compare: &[Logs, Console],
            ..BASE
        },
        Case {
            name: "pet_log_dir_and_redirects",
            args: &["{W}"],
            env: &[("PET_LOG_DIR", "{LOGS}"), ("PET_REDIRECTS", "3"), ("PET_STANDALONE", "1")],
            compare: &[Logs, Console],
            ..BASE
        },
        Case {
            name: "duplicate_stdout_filters",
            args: &[
                "--standalone",
                "--nproc-per-node",
                "2",
                "--log-dir",
                "{LOGS}",
                "--tee",
                "3",
                "--duplicate-stdout-filters",
                "apple,zzz",
                "{W}",
            ],
            compare: &[Logs, Console],
            ..BASE
        },
        Case {
            name: "duplicate_stderr_filters",
            args: &["--standalone", "--log-dir", "{LOGS}", "--tee", "3", "--duplicate_stderr_filters", "kiwi", "{W}"],
            compare: &[Logs, Console],
            ..BASE
        },
        // Plug-ins and hardware.
        Case {
            name: "logs_specs_unknown_plugin",
            args: &["--standalone", "--logs-specs", "nosuchspec", "{W}"],
            expect: Differs(
                &[Exit, Env],
                "--logs-specs names a Python entry point: torchrun fails (exit 1) when none is installed under that \
                 name; rlaunch accepts the flag and keeps its own layout",
            ),
            ..BASE
        },
        Case { name: "numa_binding_without_gpu", args: &["--numa-binding", "node", "{W}"], ..BASE },
        // Usage errors.
        Case { name: "unknown_flag", args: &["--bogus", "{W}"], ..BASE },
        Case {
            name: "nproc_0",
            args: &["--nproc-per-node", "0", "{W}"],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        Case {
            name: "nproc_negative",
            args: &["--nproc-per-node", "-1", "{W}"],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        Case {
            name: "nproc_abc",
            args: &["--nproc-per-node", "abc", "{W}"],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        Case { name: "start_method_bogus", args: &["--start-method", "bogus", "{W}"], ..BASE },
        Case {
            name: "redirects_9",
            args: &["--redirects", "9", "{W}"],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        Case {
            name: "nnodes_2_to_1",
            args: &["--nnodes", "2:1", "{W}"],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        Case {
            name: "local_ranks_filter_not_numbers",
            args: &["--local-ranks-filter", "a,b", "{W}"],
            expect: Differs(&[Exit], VALIDATION_EXIT),
            ..BASE
        },
        Case { name: "missing_program", args: &["--nproc-per-node", "2"], ..BASE },
        Case {
            name: "python_script_does_not_exist",
            args: &["{DIR}/missing.py"],
            expect: Differs(&[Exit], FAILED_WORKER_EXIT),
            ..BASE
        },
        Case {
            name: "no_python_program_does_not_exist",
            args: &["--no-python", "{DIR}/missing-program"],
            expect: Differs(
                &[Exit],
                "a program that cannot be found: torchrun fails with a FileNotFoundError traceback (exit 1), \
                 rlaunch exits 127 as a shell does",
            ),
            ..BASE
        },
        // Failures and signals.
        Case {
            name: "worker_exit_3",
            args: &["--standalone", "--nproc-per-node", "2", "{W}"],
            mode: Mode::Exit3,
            expect: Differs(&[Exit], FAILED_WORKER_EXIT),
            ..BASE
        },
        Case {
            name: "worker_sigkill",
            args: &["--standalone", "{W}"],
            mode: Mode::SigKill,
            expect: Differs(&[Exit], FAILED_WORKER_EXIT),
            ..BASE
        },
        Case {
            name: "sigterm_to_launcher",
            args: &["--standalone", "--nproc-per-node", "2", "{W}"],
            mode: Mode::Wait,
            signal: Some((libc::SIGTERM, 2)),
            compare: &[Survivors],
            expect: Differs(&[Exit], SIGNALLED_EXIT),
            ..BASE
        },
        Case {
            name: "sigusr1_handled_by_signals_to_handle",
            args: &["--standalone", "--signals-to-handle", "SIGTERM,SIGUSR1", "{W}"],
            mode: Mode::Wait,
            signal: Some((libc::SIGUSR1, 1)),
            compare: &[Survivors],
            expect: Differs(&[Exit], SIGNALLED_EXIT),
            ..BASE
        },
        Case {
            name: "sigusr1_not_in_signals_to_handle",
            args: &["--standalone", "{W}"],
            mode: Mode::Wait,
            signal: Some((libc::SIGUSR1, 1)),
            compare: &[Survivors],
            expect: Differs(
                &[Exit, Survivors],
                "a signal torchrun does not handle kills it (status: signal 10) and leaves its workers running; \
                 rlaunch passes it to the workers and exits 128+10 once they are gone",
            ),
            ..BASE
        },
    ]
}

const NO_WORKER: &str = "no worker ran";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Launcher {
    Torchrun,
    Rlaunch,
}

/// What one launch did, each aspect as lines ready to compare.
#[derive(Default)]
struct Observation {
    command: String,
    exit: Vec<String>,
    flags: Vec<String>,
    env: Vec<String>,
    logs: Vec<String>,
    console: Vec<String>,
    survivors: Vec<String>,
    stderr_tail: String,
    took: Duration,
}

impl Observation {
    fn aspect(&self, a: Aspect) -> &[String] {
        match a {
            Exit => &self.exit,
            Flags => &self.flags,
            Env => &self.env,
            Logs => &self.logs,
            Console => &self.console,
            Survivors => &self.survivors,
        }
    }
}

struct Paths {
    scripts: PathBuf,
    worker: PathBuf,
    venv: PathBuf,
    torchrun: PathBuf,
    rlaunch: PathBuf,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

fn exit_line(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => format!("{s}"),
    }
}

/// Replaces the run's own paths with names, longest first.
fn unpath(s: &str, subs: &[(String, &str)]) -> String {
    let mut s = s.to_string();
    for (from, to) in subs {
        s = s.replace(from.as_str(), to);
    }
    s
}

fn looks_generated(id: &str) -> bool {
    id.len() >= 16 && id.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

fn normalize_var(key: &str, value: &str, host: &str) -> String {
    if !VARYING.iter().any(|(k, _)| *k == key) {
        return value.to_string();
    }
    match key {
        "MASTER_PORT" if value.parse::<u16>().is_ok_and(|p| p > 0) => "<port>".into(),
        "MASTER_ADDR" if ["localhost", "127.0.0.1", "::1", host].contains(&value) => "<this host>".into(),
        "TORCHELASTIC_RUN_ID" if looks_generated(value) => "<generated>".into(),
        "TORCHELASTIC_ERROR_FILE" if !value.is_empty() => {
            let parts: Vec<&str> = value.split('/').collect();
            let base = parts.first().copied().unwrap_or("");
            let last3 = parts[parts.len().saturating_sub(3)..].join("/");
            format!("{base}/…/{last3}")
        }
        _ => value.to_string(),
    }
}

/// The options a usage error names as unknown: argparse's `unrecognized arguments: --a --b`,
/// clap's `unexpected argument '--a' found`.
fn unrecognized(stderr: &str) -> Vec<String> {
    let mut flags = Vec::new();
    for line in stderr.lines() {
        if let Some(rest) = line.split("unrecognized arguments: ").nth(1) {
            flags.extend(rest.split_whitespace().filter(|a| a.starts_with('-')).map(|a| format!("unrecognized {a}")));
        } else if let Some(rest) = line.split("unexpected argument '").nth(1) {
            let arg = rest.split('\'').next().unwrap_or_default();
            flags.push(format!("unrecognized {}", arg.split('=').next().unwrap_or_default()));
        }
    }
    flags
}

/// A line as torchrun prints it when its tail of a log file read half a line: the half, then
/// on the next read the rest (here only the newline) behind the rank's prefix again, so the
/// line ends in a bare `[default1]:`. That tear is torchrun's timing, not a difference: cut it.
fn untorn(line: &str) -> &str {
    let Some(at) = line.rfind("[default") else { return line };
    let tail = &line[at + "[default".len()..];
    let bare_prefix = tail.strip_suffix("]:").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if bare_prefix && line[..at].contains("wkr:") {
        &line[..at]
    } else {
        line
    }
}

/// Worker lines (`wkr:` marked) of one stream, grouped by rank, each with what precedes the mark.
fn console_lines(stream: &str, text: &str) -> Vec<String> {
    let mut by_rank: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines().filter(|l| l.contains("wkr:")).map(untorn) {
        let rank = line.split("rank=").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or("?");
        by_rank.entry(rank.to_string()).or_default().push(format!("{stream} rank {rank}: {}", line.trim_end()));
    }
    by_rank.into_values().flatten().collect()
}

fn walk(dir: &Path, rel: &str, out: &mut Vec<(String, PathBuf)>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = rd.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = format!("{rel}{}", e.file_name().to_string_lossy());
        if e.path().is_dir() {
            out.push((format!("{name}/"), e.path()));
            walk(&e.path(), &format!("{name}/"), out);
        } else {
            out.push((name, e.path()));
        }
    }
}

fn launch(case: &Case, who: Launcher, p: &Paths) -> Observation {
    let job = tempdir();
    let (out, tmp, logs, home) =
        (job.path().join("out"), job.path().join("tmp"), job.path().join("logs"), job.path().join("home"));
    for d in [&out, &tmp, &home] {
        std::fs::create_dir_all(d).expect("job dirs");
    }
    let port = free_port().to_string();
    let fill = |a: &str| {
        a.replace("{W}", &p.worker.display().to_string())
            .replace("{DIR}", &p.scripts.display().to_string())
            .replace("{LOGS}", &logs.display().to_string())
            .replace("{PORT}", &port)
    };
    let args: Vec<String> = case.args.iter().map(|a| fill(a)).collect();
    let mut base: BTreeMap<String, String> = BTreeMap::new();
    base.insert("PATH".into(), format!("{}/bin:/usr/local/bin:/usr/bin:/bin", p.venv.display()));
    base.insert("HOME".into(), home.display().to_string());
    base.insert("TMPDIR".into(), tmp.display().to_string());
    base.insert("DIFF_OUT".into(), out.display().to_string());
    let mode = match case.mode {
        Mode::Ok => "",
        Mode::Exit3 => "exit3",
        Mode::FailFirst => "fail_first",
        Mode::SigKill => "sigkill",
        Mode::Wait => "wait",
    };
    base.insert("DIFF_MODE".into(), mode.into());
    for (k, v) in case.env {
        base.insert(k.to_string(), fill(v));
    }
    let program = match who {
        Launcher::Torchrun => &p.torchrun,
        Launcher::Rlaunch => &p.rlaunch,
    };
    let mut cmd = Command::new(program);
    cmd.env_clear().envs(&base).args(&args).current_dir(&p.scripts);
    let started = Instant::now();
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    if let Some((sig, workers)) = case.signal {
        // Signalled only while unreaped, so the pid is still the launcher's. The pipes are not
        // drained meanwhile: a launcher writes far less than a pipe holds before its workers start.
        let t0 = Instant::now();
        while child.try_wait().expect("try_wait").is_none() && t0.elapsed() < DEADLINE {
            let n = std::fs::read_dir(&out)
                .map(|d| {
                    d.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().ends_with(".json")).count()
                })
                .unwrap_or(0);
            if n >= workers {
                // A moment later, a signal to a running job: torchrun starts further processes
                // right after its workers record themselves, and a signal that lands inside that
                // fork raises in Popen, past its handler, leaving its worker running (seen once,
                // on a loaded machine).
                std::thread::sleep(Duration::from_millis(500));
                if child.try_wait().expect("try_wait").is_none() {
                    unsafe { libc::kill(child.id() as i32, sig) };
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let output = wait_deadline(child, DEADLINE);
    let took = started.elapsed();

    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim().to_string();
    let mut subs: Vec<(String, &str)> = vec![
        (logs.display().to_string(), "{LOGS}"),
        (tmp.display().to_string(), "{TMP}"),
        (home.display().to_string(), "{HOME}"),
        (p.worker.display().to_string(), "{W}"),
        (p.scripts.display().to_string(), "{DIR}"),
        (p.venv.display().to_string(), "{VENV}"),
    ];
    subs.sort_by_key(|(from, _)| std::cmp::Reverse(from.len()));

    // Worker records, by rank then attempt.
    let mut records: BTreeMap<(u32, u32), serde_json::Value> = BTreeMap::new();
    for e in std::fs::read_dir(&out).expect("out dir").filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_prefix("rank").and_then(|s| s.strip_suffix(".json")) else { continue };
        let Some((r, a)) = stem.split_once(".attempt") else { continue };
        let text = std::fs::read_to_string(e.path()).expect("record");
        let v: serde_json::Value = serde_json::from_str(&text).expect("record json");
        records.insert((r.parse().unwrap_or(u32::MAX), a.parse().unwrap_or(u32::MAX)), v);
    }
    let mut env_lines = Vec::new();
    if records.is_empty() {
        env_lines.push(NO_WORKER.to_string());
    }
    for ((r, a), v) in &records {
        let tag = format!("rank {r} attempt {a}:");
        for key in ["argv", "executable", "cwd"] {
            env_lines.push(format!("{tag} {key} = {}", unpath(&v[key].to_string(), &subs)));
        }
        let env = v["env"].as_object().cloned().unwrap_or_default();
        for (k, val) in &env {
            let val = val.as_str().unwrap_or_default();
            // rlaunch's snapshots add two, documented in docs/src/worker-environment.md (the agent's socket and its
            // Python package on PYTHONPATH), both under the agent's `rlaunch-snap-*` directory; an elastic
            // job's workers also get the control socket of `rlaunch.resilient`.
            if ["RLAUNCH_SNAPSHOT", "PYTHONPATH"].contains(&k.as_str()) && val.contains("/rlaunch-snap-") {
                continue;
            }
            if k == "RLAUNCH_CONTROL" && val.contains("/rlaunch-control-") {
                continue;
            }
            if base.get(k).map(String::as_str) != Some(val) {
                env_lines.push(format!("{tag} {k}={}", normalize_var(k, &unpath(val, &subs), &host)));
            }
        }
        for k in base.keys().filter(|k| !env.contains_key(*k)) {
            env_lines.push(format!("{tag} {k} unset"));
        }
    }

    // The log directory: run directories named after the run id.
    let run_id = records.values().next().and_then(|v| v["env"]["TORCHELASTIC_RUN_ID"].as_str()).unwrap_or("");
    let mut entries = Vec::new();
    walk(&logs, "", &mut entries);
    let mut log_lines = Vec::new();
    for (rel, path) in entries {
        let rel = match rel.split_once('/') {
            Some((top, rest)) if !run_id.is_empty() && top.starts_with(&format!("{run_id}_")) => {
                format!("<run id>_<unique>/{rest}")
            }
            _ => rel,
        };
        if rel.ends_with(".log") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let mut lines: Vec<&str> = text.lines().filter(|l| l.contains("wkr:")).collect();
            lines.sort();
            log_lines.push(format!("{rel} ({} worker lines)", lines.len()));
            log_lines.extend(lines.iter().map(|l| format!("{rel}:   {l}")));
        } else {
            log_lines.push(rel);
        }
    }

    // Workers that outlived the launcher (given a moment to go); then they are stopped.
    let mut survivors = Vec::new();
    for ((r, a), v) in &records {
        let Some(wpid) = v["pid"].as_i64().map(|x| x as i32) else { continue };
        let mark = format!("DIFF_OUT={}\0", out.display());
        let ours = || {
            std::fs::read(format!("/proc/{wpid}/environ")).is_ok_and(|e| String::from_utf8_lossy(&e).contains(&mark))
        };
        let t0 = Instant::now();
        while pid_alive(wpid) && ours() && t0.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if pid_alive(wpid) && ours() {
            survivors.push(format!("rank {r} attempt {a} still running"));
            unsafe { libc::kill(wpid, libc::SIGKILL) };
        }
    }

    let stdout = unpath(&stdout_of(&output), &subs);
    let stderr = unpath(&stderr_of(&output), &subs);
    let mut console = console_lines("stdout", &stdout);
    console.extend(console_lines("stderr", &stderr));
    let tail: Vec<&str> = stderr.lines().filter(|l| !l.contains("wkr:")).collect();
    Observation {
        command: format!(
            "{}{} {}",
            case.env.iter().map(|(k, v)| format!("{k}={v} ")).collect::<String>(),
            if who == Launcher::Torchrun { "torchrun" } else { "rlaunch" },
            unpath(&args.join(" "), &subs)
        ),
        exit: vec![exit_line(output.status)],
        flags: unrecognized(&stderr),
        env: env_lines,
        logs: log_lines,
        console,
        survivors,
        stderr_tail: tail[tail.len().saturating_sub(8)..].join("\n"),
        took,
    }
}

/// Lines only in `a` and only in `b` (multiset), in their order.
fn line_diff(a: &[String], b: &[String]) -> (Vec<String>, Vec<String>) {
    let only = |x: &[String], y: &[String]| {
        let mut left: BTreeMap<&String, usize> = BTreeMap::new();
        for l in y {
            *left.entry(l).or_default() += 1;
        }
        x.iter()
            .filter(|l| match left.get_mut(l) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    false
                }
                _ => true,
            })
            .cloned()
            .collect::<Vec<_>>()
    };
    (only(a, b), only(b, a))
}

fn report(case: &Case, t: &Observation, r: &Observation) -> Option<String> {
    let mut aspects = vec![Exit, Flags, Env];
    aspects.extend(case.compare.iter().copied().filter(|a| !matches!(a, Exit | Flags | Env)));
    let (expected_to_differ, reason): (&[Aspect], &str) = match case.expect {
        Same => (&[], ""),
        Differs(a, why) => (a, why),
    };
    let mut msg = String::new();
    for a in aspects {
        let same = t.aspect(a) == r.aspect(a);
        let expected_same = !expected_to_differ.contains(&a);
        if same == expected_same {
            continue;
        }
        if same {
            msg += &format!("  {a:?}: expected to differ ({reason}) but now the same: update the table\n");
            continue;
        }
        msg += &format!("  {a:?} differs:\n");
        let (mut only_t, mut only_r) = line_diff(t.aspect(a), r.aspect(a));
        // Where one side started no worker, the other side's records are summarized.
        for (side, other) in [(&mut only_t, r.aspect(a)), (&mut only_r, t.aspect(a))] {
            if a == Env && other == [NO_WORKER] {
                let tags: BTreeSet<String> =
                    side.iter().filter_map(|l| l.split_once(": ").map(|(tag, _)| format!("{tag}: ran"))).collect();
                *side = tags.into_iter().collect();
            }
        }
        for l in only_t {
            msg += &format!("    - torchrun: {l}\n");
        }
        for l in only_r {
            msg += &format!("    + rlaunch:  {l}\n");
        }
    }
    if msg.is_empty() {
        return None;
    }
    Some(format!(
        "case {}\n  $ {}\n  $ {}\n{msg}  torchrun stderr (tail):\n{}\n  rlaunch stderr (tail):\n{}\n",
        case.name,
        t.command,
        r.command,
        indent(&t.stderr_tail),
        indent(&r.stderr_tail)
    ))
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    | {l}")).collect::<Vec<_>>().join("\n")
}

#[test]
fn rlaunch_behaves_as_torchrun_invocation_by_invocation() {
    let venv = std::fs::canonicalize(venv_python().parent().and_then(Path::parent).expect("venv dir")).expect("venv");
    let torchrun = venv.join("bin/torchrun");
    assert!(torchrun.exists(), "{} is missing", torchrun.display());
    let dir = tempdir();
    let scripts = dir.path().join("scripts");
    std::fs::create_dir_all(&scripts).expect("scripts dir");
    let worker = scripts.join("diffworker.py");
    std::fs::write(&worker, format!("#!{}/bin/python3\n{WORKER}", venv.display())).expect("worker");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&worker, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let paths = Paths { scripts, worker, venv, torchrun, rlaunch: bin("rlaunch") };

    let cases = cases();
    let names: BTreeSet<&str> = cases.iter().map(|c| c.name).collect();
    assert_eq!(names.len(), cases.len(), "case names are unique");
    // torchrun's launches first: they are the slow ones.
    let jobs: Vec<(usize, Launcher)> = [Launcher::Torchrun, Launcher::Rlaunch]
        .into_iter()
        .flat_map(|l| (0..cases.len()).map(move |i| (i, l)))
        .collect();
    let next = AtomicUsize::new(0);
    let results: Mutex<BTreeMap<(usize, Launcher), Result<Observation, String>>> = Mutex::new(BTreeMap::new());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..PARALLEL {
            s.spawn(|| loop {
                let Some(&(i, who)) = jobs.get(next.fetch_add(1, Ordering::SeqCst)) else { return };
                let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| launch(&cases[i], who, &paths)))
                    .map_err(|e| {
                        e.downcast_ref::<String>()
                            .cloned()
                            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default()
                    });
                results.lock().unwrap().insert((i, who), got);
            });
        }
    });
    let mut results = results.into_inner().unwrap();

    let mut failures = Vec::new();
    let mut summary = format!("{:<52} {:<22} {:<22} verdict\n", "case", "torchrun", "rlaunch");
    for (i, case) in cases.iter().enumerate() {
        let t = results.remove(&(i, Launcher::Torchrun)).expect("ran");
        let r = results.remove(&(i, Launcher::Rlaunch)).expect("ran");
        let (t, r) = match (t, r) {
            (Ok(t), Ok(r)) => (t, r),
            (t, r) => {
                let why = |x: &Result<Observation, String>| x.as_ref().err().cloned().unwrap_or_else(|| "ok".into());
                failures.push(format!(
                    "case {}: a launch did not finish\n  torchrun: {}\n  rlaunch: {}\n",
                    case.name,
                    why(&t),
                    why(&r)
                ));
                summary += &format!("{:<52} {:<22} {:<22} NO RESULT\n", case.name, "?", "?");
                continue;
            }
        };
        let verdict = report(case, &t, &r);
        summary += &format!(
            "{:<52} {:<22} {:<22} {}\n",
            case.name,
            format!("{} ({:.1}s)", t.exit[0], t.took.as_secs_f64()),
            format!("{} ({:.1}s)", r.exit[0], r.took.as_secs_f64()),
            match (&verdict, &case.expect) {
                (Some(_), _) => "UNEXPECTED",
                (None, Same) => "same",
                (None, Differs(..)) => "differs as listed",
            }
        );
        failures.extend(verdict);
    }
    eprintln!("{} cases in {:.0?}\n{summary}", cases.len(), t0.elapsed());
    assert!(
        failures.is_empty(),
        "{} of {} cases differ unexpectedly:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn a_line_torchrun_tore_in_its_tail_compares_as_the_whole_line() {
    let torn = "[default1]:wkr:hello rank=1 attempt=0[default1]:";
    assert_eq!(untorn(torn), "[default1]:wkr:hello rank=1 attempt=0");
    for whole in ["[default1]:wkr:hello rank=1 attempt=0", "[default0]:wkr:says [default]: rank=0", "[default1]:"] {
        assert_eq!(untorn(whole), whole);
    }
}

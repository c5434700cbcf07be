//! The mission's command line as written: `rlaunch --nnodes 2 --nproc-per-node 2 --rdzv-endpoint
//! A --rdzv-id demo train` is elastic without `--rdzv-backend`, and `rlaunch --nproc-per-node 2
//! --nnodes 2 train` finds the rendezvous in a config file or the environment and its id in the
//! scheduler's (two network-namespace hosts, ending in a trained `train`); precedence of flag
//! over environment over file, `--print-config`, and every error path.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use integration_tests::netns::{Cluster, Proc};
use integration_tests::{bin, run_deadline, stderr_of, stdout_of, target_dir, tempdir, wait_until};

const DEADLINE: Duration = Duration::from_secs(30);
const CONF: &str = "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=30";

/// rlaunch with an environment of only what is given (no user config, no PET_* of the caller).
fn rlaunch_clean(home: &Path, env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    let mut c = Command::new(bin("rlaunch"));
    c.env_clear().env("PATH", "/usr/bin:/bin").env("HOME", home).args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    run_deadline(&mut c, DEADLINE)
}

fn line_of<'a>(out: &'a str, setting: &str) -> &'a str {
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(setting))
        .unwrap_or_else(|| panic!("no {setting} in:\n{out}"))
}

#[test]
fn flags_beat_the_environment_which_beats_config_files_and_print_config_says_where_each_came_from() {
    let dir = tempdir();
    let home = dir.path();
    std::fs::create_dir_all(home.join(".config/rlaunch")).unwrap();
    std::fs::write(
        home.join(".config/rlaunch/config.toml"),
        "rdzv_endpoint = \"user:1\"\nmax-restarts = 1\nrole = \"from-user-file\"\nshutdown-timeout = 8\n",
    )
    .unwrap();
    let named = home.join("cluster.toml");
    std::fs::write(&named, "rdzv-endpoint = \"svc:29400\"\nmax-restarts = 2\nlog-dir = \"/var/log/x\"\n").unwrap();
    let named_s = named.display().to_string();
    let env = [("RLAUNCH_CONFIG", named_s.as_str()), ("PET_MAX_RESTARTS", "4"), ("SLURM_JOB_ID", "77")];
    let o = rlaunch_clean(home, &env, &["--max-restarts", "9", "--print-config"]);
    assert!(o.status.success(), "{}", stderr_of(&o));
    let out = stdout_of(&o);
    assert!(
        line_of(&out, "max-restarts").contains("9") && line_of(&out, "max-restarts").contains("(command line)"),
        "{out}"
    );
    assert!(line_of(&out, "rdzv-endpoint").contains("svc:29400"), "the named file beats the user's: {out}");
    assert!(line_of(&out, "rdzv-endpoint").contains(&format!("(config file {named_s})")), "{out}");
    assert!(line_of(&out, "role").contains("from-user-file"), "{out}");
    assert!(line_of(&out, "log-dir").contains("/var/log/x"), "{out}");
    assert!(line_of(&out, "nproc-per-node").contains("(default)"), "{out}");
    assert!(out.contains("effective rdzv-backend: rlaunch"), "an endpoint alone means elastic: {out}");
    assert!(out.contains("effective rdzv-id:      slurm-77 (from SLURM_JOB_ID)"), "{out}");

    // Without the flag the environment wins; without either, the file.
    let o = rlaunch_clean(home, &env, &["--print-config"]);
    assert!(line_of(&stdout_of(&o), "max-restarts").contains("4"));
    assert!(line_of(&stdout_of(&o), "max-restarts").contains("(environment (PET_MAX_RESTARTS))"));
    let o = rlaunch_clean(home, &[("RLAUNCH_CONFIG", &named_s)], &["--print-config"]);
    assert!(line_of(&stdout_of(&o), "max-restarts").contains("2"));

    // A Kubernetes Indexed Job: the pod's host name is `{job}-{index}`.
    let o = rlaunch_clean(
        home,
        &[("RLAUNCH_CONFIG", &named_s), ("JOB_COMPLETION_INDEX", "3"), ("HOSTNAME", "train-job-3")],
        &["--print-config"],
    );
    assert!(stdout_of(&o).contains("effective rdzv-id:      k8s-train-job"), "{}", stdout_of(&o));
    // Static flags keep the backend static.
    let o = rlaunch_clean(home, &[("RLAUNCH_CONFIG", &named_s)], &["--master-port", "1", "--print-config"]);
    assert!(stdout_of(&o).contains("effective rdzv-backend: static"), "{}", stdout_of(&o));
}

#[test]
fn every_error_path_of_the_command_line_says_what_would_fix_it() {
    let dir = tempdir();
    let home = dir.path();
    let write = |name: &str, body: &str| {
        let p = home.join(name);
        std::fs::write(&p, body).unwrap();
        p.display().to_string()
    };
    let unknown = write("unknown.toml", "rdzv_endpont = \"x:1\"\n");
    let bad = write("bad.toml", "rdzv-endpoint = \n");
    let table = write("table.toml", "[rdzv]\nendpoint = \"x:1\"\n");
    let missing = home.join("missing.toml").display().to_string();
    type Case<'a> = (Vec<(&'a str, &'a str)>, Vec<&'a str>, &'a str);
    let cases: Vec<Case> = vec![
        (vec![("RLAUNCH_CONFIG", unknown.as_str())], vec!["x"], "unknown setting `rdzv_endpont`"),
        (vec![("RLAUNCH_CONFIG", bad.as_str())], vec!["x"], "is not valid TOML"),
        (vec![("RLAUNCH_CONFIG", table.as_str())], vec!["x"], "unknown setting `rdzv`"),
        (vec![("RLAUNCH_CONFIG", missing.as_str())], vec!["x"], "cannot read the config file"),
        (vec![], vec!["--nnodes", "2", "--rdzv-endpoint", "h:1", "x"], "an elastic job needs an id"),
        (vec![], vec!["--nnodes", "2", "x"], "for an elastic job give --rdzv-endpoint"),
        (
            vec![],
            vec![
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-id",
                "j",
                "--rdzv-token-file",
                "/nonexistent/t",
                "x",
            ],
            "--rdzv-token-file /nonexistent/t",
        ),
        // Addresses are parsed once, at start: a bad one is a usage error, not a failure later.
        (vec![], vec!["--local-addr", "a b", "x"], "--local-addr a b: not a host name or address (host has whitespace"),
        (vec![], vec!["--store-bind", "[::1", "x"], "--store-bind [::1: not a host name or address"),
        (
            vec![],
            vec!["--master-addr", "x/y", "--master-port", "1", "x"],
            "--master-addr x/y: not a host name or address",
        ),
        (vec![], vec!["--nnodes", "2", "--rdzv-endpoint", "h:1/p", "--rdzv-id", "j", "x"], "--rdzv-endpoint h:1/p"),
    ];
    for (env, args, needle) in cases {
        let o = rlaunch_clean(home, &env, &args);
        assert_eq!(o.status.code(), Some(2), "{args:?} {env:?}: {}", stderr_of(&o));
        assert!(stderr_of(&o).contains(needle), "{args:?} {env:?}: expected {needle:?} in {}", stderr_of(&o));
    }
}

/// Both of the command lines on two hosts: (1) the endpoint and id as flags, no backend;
/// (2) nothing but `--nproc-per-node 2 --nnodes 2 train`, the endpoint from a config file on one
/// host and from the environment on the other, the id from Slurm's job id.
#[test]
fn the_missions_command_lines_train_on_two_hosts() {
    let train = target_dir().join("examples/train");
    assert!(train.exists(), "{} is not built: cargo build --workspace --examples", train.display());
    let t = train.display().to_string();
    let cluster = Cluster::new(2);
    let endpoint = format!("{}:29400", cluster.host(0).ip);
    let program = [t.as_str(), "--steps", "40", "--no-checkpoint", "--log-every", "20"];
    let dir = tempdir();

    let spawn = |i: usize, env: &[(&str, String)], args: &[&str], tag: &str| -> Proc {
        let h = cluster.host(i);
        let mut c = h.command(bin("rlaunch"));
        c.env("RLAUNCH_LOG", "info").args(args).args(["--rdzv-conf", CONF, "--shutdown-timeout", "3"]).args(program);
        for (k, v) in env {
            c.env(k, v);
        }
        Proc::spawn(c, &format!("{tag} on {}", h.name), &dir.path().join(format!("{tag}-{}.log", h.name)))
    };
    let finish = |mut agents: Vec<Proc>| {
        for a in &mut agents {
            let status = a.wait(Duration::from_secs(90));
            assert!(status.success(), "{} failed ({status}):\n{}", a.name, a.log_tail(3000));
        }
        let out = agents[0].output() + &agents[1].output();
        assert!(out.contains("[default0]:done: 40 steps"), "rank 0 trained:\n{}", agents[0].log_tail(3000));
        assert!(
            out.contains("train: world 4 "),
            "one job of four ranks across both hosts:\n{}",
            agents[0].log_tail(3000)
        );
    };

    let first = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint.as_str(), "--rdzv-id", "demo"];
    let a = spawn(0, &[], &first, "flags");
    wait_until("host a to host the rendezvous", Duration::from_secs(10), || {
        std::net::TcpStream::connect_timeout(&endpoint.parse().unwrap(), Duration::from_millis(200)).is_ok()
    });
    let b = spawn(1, &[], &first, "flags");
    finish(vec![a, b]);

    let config = dir.path().join("cluster.toml");
    std::fs::write(&config, format!("rdzv-endpoint = \"{endpoint}\"\n")).unwrap();
    let bare = ["--nproc-per-node", "2", "--nnodes", "2"];
    let job = ("SLURM_JOB_ID", "4242".to_string());
    let a = spawn(0, &[("RLAUNCH_CONFIG", config.display().to_string()), job.clone()], &bare, "bare");
    wait_until("host a to host the rendezvous", Duration::from_secs(10), || {
        std::net::TcpStream::connect_timeout(&endpoint.parse().unwrap(), Duration::from_millis(200)).is_ok()
    });
    let b = spawn(1, &[("PET_RDZV_ENDPOINT", endpoint.clone()), job], &bare, "bare");
    finish(vec![a, b]);
}

//! Collectives across two "hosts" on one machine: two network namespaces joined by a veth
//! pair, two ranks in each. The group runs hierarchically (shared memory inside each host, the
//! TCP ring between the hosts over the veth link) and must match the reference. Needs root
//! (`ip netns`); without it the test fails loudly rather than skipping.

mod common;

use std::process::Command;
use std::time::Duration;

use common::reference::{reference_worker, SEED};
use common::{fresh_seed, require_worker_env, self_args, self_exe, spawn_wrapped, wait, WORKER};

struct Netns {
    names: [String; 2],
}

fn ip(args: &[&str]) {
    let o = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running ip {args:?}: {e} (iproute2 is required)"));
    assert!(o.status.success(), "ip {args:?} failed (root is required): {}", String::from_utf8_lossy(&o.stderr));
}

impl Netns {
    /// Two namespaces `…a` (10.77.k.1) and `…b` (10.77.k.2) linked by a veth pair.
    fn pair() -> Self {
        let tag = std::process::id() % 10_000;
        let names = [format!("rlA{tag}"), format!("rlB{tag}")];
        let k = (tag % 250) as u8;
        let (va, vb) = (format!("rva{tag}"), format!("rvb{tag}"));
        for n in &names {
            ip(&["netns", "add", n]);
            ip(&["-n", n, "link", "set", "lo", "up"]);
        }
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        ip(&["link", "set", &va, "netns", &names[0]]);
        ip(&["link", "set", &vb, "netns", &names[1]]);
        ip(&["-n", &names[0], "addr", "add", &format!("10.77.{k}.1/24"), "dev", &va]);
        ip(&["-n", &names[1], "addr", "add", &format!("10.77.{k}.2/24"), "dev", &vb]);
        ip(&["-n", &names[0], "link", "set", &va, "up"]);
        ip(&["-n", &names[1], "link", "set", &vb, "up"]);
        Netns { names }
    }
    fn addr(&self, host: usize) -> String {
        let k = (std::process::id() % 10_000 % 250) as u8;
        format!("10.77.{k}.{}", host + 1)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

#[test]
#[ignore = "worker entry point: this file's tests run it in child processes (--ignored --exact)"]
fn worker_entry() {
    require_worker_env();
    let seed: u64 = std::env::var(SEED).ok().and_then(|v| v.parse().ok()).expect("seed");
    let mut pg = match rlaunch::worker::init_from_env() {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("init failed: {e:?}");
            std::process::exit(2);
        }
    };
    eprintln!("rank {} backend {}", pg.rank(), pg.backend_name());
    match reference_worker(&mut pg, seed) {
        Ok(()) => eprintln!("rank {} OK", pg.rank()),
        Err(e) => {
            eprintln!("rank {} ERROR: {e}", pg.rank());
            std::process::exit(1);
        }
    }
}

#[test]
fn hierarchical_collectives_across_two_namespace_hosts_match_reference() {
    let ns = Netns::pair();
    let dir = tempfile::tempdir().expect("tempdir");
    let seed = fresh_seed();
    let hosts = [0usize, 0, 1, 1];
    let env = vec![
        (WORKER.to_string(), "1".to_string()),
        (SEED.to_string(), seed.to_string()),
        ("RLAUNCH_COLLECTIVE_TIMEOUT".into(), "60".into()),
    ];
    let s = spawn_wrapped(&self_exe(), &self_args("worker_entry"), &hosts, dir.path(), &env, |r| {
        let h = hosts[r];
        (
            vec!["ip".into(), "netns".into(), "exec".into(), ns.names[h].clone()],
            vec![("RLAUNCH_IFADDR".to_string(), ns.addr(h)), ("MASTER_ADDR".to_string(), ns.addr(0))],
        )
    });
    let f = wait(s, Duration::from_secs(240));
    assert!(f.all_ok(), "seed {seed}:\n{}", f.dump());
    assert!(f.logs.iter().all(|l| l.contains("backend hierarchical")), "{}", f.dump());
}

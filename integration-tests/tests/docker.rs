//! The Dockerfile, built for real (FROM scratch, nothing pulled) and deployed as the service
//! without a single point of failure: an etcd container and two `rlaunch-rendezvous` replicas on
//! a Docker network; two agents on this host use both replicas; one replica is killed mid-job
//! and the job still finishes on every node.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use integration_tests::*;

struct Cleanup {
    containers: Vec<String>,
    network: String,
    images: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for c in &self.containers {
            let _ = Command::new("docker").args(["rm", "-f", c]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        let _ = Command::new("docker")
            .args(["network", "rm", &self.network])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        for i in &self.images {
            let _ = Command::new("docker").args(["rmi", "-f", i]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}

fn docker(args: &[&str]) -> String {
    let o = run_deadline(Command::new("docker").args(args), Duration::from_secs(180));
    assert!(o.status.success(), "docker {args:?} failed: {}", stderr_of(&o));
    stdout_of(&o).trim().to_string()
}

/// A throwaway etcd image from the host's etcd binary (Debian's etcd-server), FROM scratch.
fn etcd_image(tag: &str, dir: &Path) {
    let etcd = which("etcd");
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    std::fs::create_dir_all(root.join("data")).unwrap();
    std::fs::copy(&etcd, root.join("usr/bin/etcd")).unwrap();
    let ldd = run_deadline(Command::new("ldd").arg(&etcd), Duration::from_secs(10));
    for lib in stdout_of(&ldd).split_whitespace().filter(|w| w.starts_with('/')) {
        let dst = root.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(lib, dst).unwrap();
    }
    std::fs::write(dir.join("Dockerfile"), "FROM scratch\nCOPY rootfs/ /\nENTRYPOINT [\"/usr/bin/etcd\"]\n").unwrap();
    docker(&["build", "-q", "-t", tag, dir.to_str().unwrap()]);
}

fn which(name: &str) -> String {
    let o = run_deadline(Command::new("sh").args(["-c", &format!("command -v {name}")]), Duration::from_secs(5));
    assert!(o.status.success(), "`{name}` is not installed: run scripts/install-deps.sh");
    stdout_of(&o).trim().to_string()
}

fn host_port(container: &str) -> String {
    let p = docker(&["port", container, "29400/tcp"]);
    p.lines().find(|l| l.starts_with("127.0.0.1:")).unwrap_or_else(|| panic!("no published port: {p}")).to_string()
}

#[test]
fn replicated_rendezvous_in_containers_survives_losing_a_replica() {
    which("docker");
    let id = std::process::id();
    let tag = format!("it{id}-");
    let mut cleanup = Cleanup {
        containers: vec![],
        network: format!("rlaunch-it-{id}"),
        images: vec![format!("{tag}rlaunch-rendezvous"), format!("{tag}rlaunch"), format!("{tag}etcd")],
    };
    let o = run_deadline(
        Command::new(repo_root().join("docker/build.sh")).args(["--profile", "debug", "--tag-prefix", &tag]),
        Duration::from_secs(600),
    );
    assert!(o.status.success(), "docker/build.sh failed: {}", stderr_of(&o));
    let scratch = tempdir();
    etcd_image(&format!("{tag}etcd"), scratch.path());
    docker(&["network", "create", &cleanup.network]);

    let etcd_name = format!("rlaunch-it-{id}-etcd");
    cleanup.containers.push(etcd_name.clone());
    docker(&[
        "run",
        "-d",
        "--name",
        &etcd_name,
        "--network",
        &cleanup.network,
        &format!("{tag}etcd"),
        "--data-dir",
        "/data",
        "--listen-client-urls",
        "http://0.0.0.0:2379",
        "--advertise-client-urls",
        &format!("http://{etcd_name}:2379"),
    ]);
    let mut endpoints = Vec::new();
    let mut replicas = Vec::new();
    for r in 0..2 {
        let name = format!("rlaunch-it-{id}-rdzv{r}");
        cleanup.containers.push(name.clone());
        docker(&[
            "run",
            "-d",
            "--name",
            &name,
            "--network",
            &cleanup.network,
            "-p",
            "127.0.0.1::29400",
            &format!("{tag}rlaunch-rendezvous"),
            "--store",
            "etcd",
            "--etcd-endpoints",
            &format!("http://{etcd_name}:2379"),
            // The agents reach the replicas through Docker's published ports, whose NAT shows
            // the service the bridge's gateway instead of the agents' own address: the case
            // the flag is for (a node may otherwise advertise only the address it joins from).
            "--trust-advertised-addrs",
        ]);
        endpoints.push(host_port(&name));
        replicas.push(name);
    }
    let endpoint_list = endpoints.join(",");
    // Both replicas answer before agents start (the service came up in its container).
    wait_until("both replicas to answer", Duration::from_secs(30), || {
        endpoints.iter().all(|e| std::net::TcpStream::connect(e).is_ok())
    });

    let out = tempdir();
    let agents: Vec<_> = (0..2)
        .map(|_| {
            let mut cmd = rlaunch();
            cmd.args([
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "rlaunch",
                "--rdzv-endpoint",
                &endpoint_list,
            ]);
            cmd.args(["--rdzv-id", "docker-job", "--rdzv-conf", "heartbeat_interval=0.5,node_ttl=3"]);
            cmd.arg(worker()).arg("--out").arg(out.path()).args(["dump-env", "pidfile", "sleep", "6"]);
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn agent")
        })
        .collect();
    wait_until("all four workers to run", Duration::from_secs(60), || {
        (0..4).all(|r| out.path().join(format!("pid_rank{r}_attempt0")).exists())
    });
    // Kill the replica the agents most likely talk to; the other one carries the job on etcd.
    docker(&["kill", &replicas[0]]);
    for a in agents {
        let o = wait_deadline(a, Duration::from_secs(60));
        assert!(o.status.success(), "agent failed after a replica was killed:\n{}", stderr_of(&o));
    }
    let status = run_deadline(
        rlaunch().args(["status", "--rdzv-endpoint", &endpoints[1], "--rdzv-id", "docker-job", "--json"]),
        Duration::from_secs(20),
    );
    assert!(status.status.success(), "{}", stderr_of(&status));
    let s: serde_json::Value = serde_json::from_str(&stdout_of(&status)).unwrap();
    assert_eq!(s["state"], "finished", "{s}");
    assert_eq!(s["restart_count"], 0, "losing a replica is not a restart: {s}");
    drop(cleanup);
}

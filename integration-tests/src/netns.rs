//! Several "hosts" on one machine for multi-node tests: each host is a network namespace (and
//! a UTS namespace, so it has its own hostname) joined by a veth pair to a Linux bridge in the
//! root namespace, on a private /24 of 10.77.0.0/16 that this harness allocates. The root side
//! of the bridge has `.1` (services the tests start in the root namespace — etcd, a standalone
//! rendezvous server — listen there and every host reaches them); host `i` has `.(10 + i)`.
//!
//! Node loss is [`Host::kill_all`] (SIGKILL every process in the namespace); a partition is
//! [`Host::cut_link`] (the host's bridge port goes down: packets vanish, no TCP reset ever
//! arrives). Everything — processes, namespaces, veths, the bridge, the firewall rule — is removed
//! when the [`Cluster`] is dropped, also when the test panics; a cluster left behind by a test
//! process that was itself SIGKILLed is swept by the next one that lands on its subnet.
//!
//! Also here, because both multi-node test binaries use them: [`Proc`] (a child killed when
//! dropped, whose log is printed when the test fails), the looping worker script and its event
//! log ([`loop_worker`], [`starts`]).
//!
//! Needs root and `ip`, `unshare`, `iptables` (when bridged traffic goes through iptables).

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// Runs a setup command; panics with its output when it fails.
fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).stdin(Stdio::null()).output().unwrap_or_else(|e| {
        panic!("cannot run `{}`: {e} (the multi-node tests need root and iproute2)", args.join(" "))
    });
    assert!(out.status.success(), "`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
}

/// Runs a teardown command, ignoring failure (the thing may already be gone).
fn sh_quiet(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Pids of every process in network namespace `ns`.
fn ns_pids(ns: &str) -> Vec<i32> {
    let out = Command::new("ip").args(["netns", "pids", ns]).stdin(Stdio::null()).stderr(Stdio::null()).output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect(),
        Err(_) => Vec::new(),
    }
}

/// SIGKILLs every process of `ns` until none is left (bounded: a process in uninterruptible
/// sleep is left to the kernel).
fn kill_ns(ns: &str) {
    let start = Instant::now();
    loop {
        let pids = ns_pids(ns);
        if pids.is_empty() || start.elapsed() > Duration::from_secs(5) {
            return;
        }
        for pid in pids {
            // SAFETY: kill(2) with a pid read from /proc; at worst the pid is gone (ESRCH).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn bridge_nf_calls_iptables() -> bool {
    std::fs::read_to_string("/proc/sys/net/bridge/bridge-nf-call-iptables").is_ok_and(|s| s.trim() == "1")
}

/// Inserts (`-I`) or deletes (`-D`) the rule that lets `bridge`'s hosts talk to each other.
fn firewall(op: &str, bridge: &str, pid: impl std::fmt::Display) -> Vec<String> {
    let comment = format!("rlaunch-netns-test pid={pid}");
    [
        "iptables",
        "-w",
        op,
        "FORWARD",
        "-i",
        bridge,
        "-o",
        bridge,
        "-m",
        "comment",
        "--comment",
        &comment,
        "-j",
        "ACCEPT",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn argv(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A set of hosts on one bridge. Dropping it removes everything it created.
pub struct Cluster {
    /// Third octet of this cluster's 10.77.X.0/24.
    subnet: u8,
    bridge: String,
    firewall: bool,
    hosts: Vec<Host>,
}

/// One simulated host: a network namespace with its own address and hostname.
pub struct Host {
    /// Short name, also the hostname inside the host (`a`, `b`, …).
    pub name: String,
    /// The network namespace's name (unique per test process and cluster).
    pub ns: String,
    /// This host's address on the bridge.
    pub ip: String,
    /// The root-namespace end of the host's veth pair (its bridge port).
    veth: String,
}

impl Cluster {
    /// Creates `n` hosts named `a`, `b`, … Panics (loudly) without root or iproute2.
    pub fn new(n: usize) -> Cluster {
        assert!((1..=26).contains(&n), "1 to 26 hosts");
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "the multi-node tests create network namespaces: run them as root");
        let seq = CLUSTERS.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        if seq == 0 {
            // Whatever a test process that was killed (CI cancelled, `timeout`) left on any subnet:
            // its namespaces with their processes, bridge and firewall rule.
            sweep_all_stale();
        }
        let first = ((pid.wrapping_mul(7919).wrapping_add(seq.wrapping_mul(37))) % 240) as u8;
        // The bridge's name doubles as the lock on the subnet: creating it is atomic.
        let mut taken = None;
        for k in 0..240u32 {
            let subnet = 10 + ((u32::from(first) + k) % 240) as u8;
            let bridge = format!("rlnb{subnet}");
            if sh_quiet(&["ip", "link", "add", &bridge, "type", "bridge"]) {
                taken = Some((subnet, bridge));
                break;
            }
            sweep_if_stale(subnet, &bridge);
            if sh_quiet(&["ip", "link", "add", &bridge, "type", "bridge"]) {
                taken = Some((subnet, bridge));
                break;
            }
        }
        let (subnet, bridge) = taken.expect("a free 10.77.X.0/24 for a test bridge");
        let mut cluster = Cluster { subnet, bridge: bridge.clone(), firewall: false, hosts: Vec::new() };
        // From here on, Drop cleans up whatever was made, should a step below panic.
        sh(&["ip", "link", "set", "dev", &bridge, "alias", &format!("rlaunch-netns-test pid={pid}")]);
        sh(&["ip", "addr", "add", &format!("10.77.{subnet}.1/24"), "dev", &bridge]);
        sh(&["ip", "link", "set", &bridge, "up"]);
        if bridge_nf_calls_iptables() {
            // br_netfilter sends bridged frames through iptables' FORWARD chain, whose policy
            // may be DROP (Docker sets it so): let this bridge's hosts talk to each other.
            sh(&argv(&firewall("-I", &bridge, pid)));
            cluster.firewall = true;
        }
        for i in 0..n {
            cluster.add_host(i);
        }
        cluster
    }

    fn add_host(&mut self, i: usize) {
        let pid = std::process::id();
        let subnet = self.subnet;
        let name = ((b'a' + i as u8) as char).to_string();
        let ns = format!("rlnt-{pid}-{subnet}-{name}");
        let veth = format!("rlv{subnet}{name}");
        let peer = format!("rlp{subnet}{name}");
        let ip = format!("10.77.{subnet}.{}", 10 + i);
        sh(&["ip", "netns", "add", &ns]);
        self.hosts.push(Host { name, ns: ns.clone(), ip: ip.clone(), veth: veth.clone() });
        sh(&["ip", "link", "add", &veth, "type", "veth", "peer", "name", &peer]);
        sh(&["ip", "link", "set", &peer, "netns", &ns]);
        sh(&["ip", "-n", &ns, "link", "set", &peer, "name", "eth0"]);
        sh(&["ip", "-n", &ns, "addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
        sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
        sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        sh(&["ip", "link", "set", &veth, "master", &self.bridge]);
        sh(&["ip", "link", "set", &veth, "up"]);
    }

    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    /// The root namespace's address on the bridge: services started by the test in the root
    /// namespace listen here, and every host reaches it.
    pub fn root_ip(&self) -> String {
        format!("10.77.{}.1", self.subnet)
    }

    /// A port free on the root side's bridge address now (for a service the test starts there).
    pub fn free_root_port(&self) -> u16 {
        std::net::TcpListener::bind((self.root_ip().as_str(), 0))
            .and_then(|l| l.local_addr())
            .expect("a free port on the bridge address")
            .port()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for h in &self.hosts {
            kill_ns(&h.ns);
            sh_quiet(&["ip", "netns", "del", &h.ns]);
            // Deleting the namespace destroys the pair; this is for a namespace that was never
            // made or that still has processes.
            sh_quiet(&["ip", "link", "del", &h.veth]);
        }
        sh_quiet(&["ip", "link", "del", &self.bridge]);
        if self.firewall {
            sh_quiet(&argv(&firewall("-D", &self.bridge, std::process::id())));
        }
    }
}

/// [`sweep_if_stale`] for every test bridge there is.
fn sweep_all_stale() {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else { return };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(subnet) = name.strip_prefix("rlnb").and_then(|n| n.parse::<u8>().ok()) {
            sweep_if_stale(subnet, &name);
        }
    }
}

/// Removes a cluster on `subnet` left behind by a test process that no longer exists.
fn sweep_if_stale(subnet: u8, bridge: &str) {
    let Ok(alias) = std::fs::read_to_string(format!("/sys/class/net/{bridge}/ifalias")) else { return };
    let Some(pid) = alias.trim().strip_prefix("rlaunch-netns-test pid=").and_then(|p| p.parse::<i32>().ok()) else {
        return;
    };
    if std::path::Path::new(&format!("/proc/{pid}")).exists() {
        return;
    }
    let prefix = format!("rlnt-{pid}-{subnet}-");
    if let Ok(dir) = std::fs::read_dir("/run/netns") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(&prefix) {
                kill_ns(&name);
                sh_quiet(&["ip", "netns", "del", &name]);
            }
        }
    }
    sh_quiet(&["ip", "link", "del", bridge]);
    sh_quiet(&argv(&firewall("-D", bridge, pid)));
}

impl Host {
    /// `program` to be run inside this host (its network namespace, with its own hostname).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, "unshare", "--uts", "--", "sh", "-c", r#"hostname "$0" && exec "$@""#])
            .arg(&self.name)
            .arg(program);
        c
    }

    /// Runs `program args` in this host to completion under `deadline`.
    pub fn run(&self, program: impl AsRef<OsStr>, args: &[&str], deadline: Duration) -> std::process::Output {
        crate::run_deadline(self.command(program).args(args), deadline)
    }

    /// Starts `cmd` (from [`Host::command`]) with its output in `log`; killed when dropped.
    pub fn spawn(&self, cmd: Command, log: &Path) -> Proc {
        Proc::spawn(cmd, &format!("host {}", self.name), log)
    }

    /// Starts `rlaunch ARGS` on this host, output in `DIR/rlaunch-<host>.log`. The workers see
    /// `RL_HOST=<host name>`.
    pub fn rlaunch(&self, dir: &Path, args: &[String]) -> Proc {
        let mut c = self.command(crate::bin("rlaunch"));
        c.args(args).env("RLAUNCH_LOG", "info").env("RL_HOST", &self.name);
        Proc::spawn(c, &format!("rlaunch on host {}", self.name), &dir.join(format!("rlaunch-{}.log", self.name)))
    }

    /// Pids of every process in this host.
    pub fn pids(&self) -> Vec<i32> {
        ns_pids(&self.ns)
    }

    /// Node loss: SIGKILL every process in this host, at once.
    pub fn kill_all(&self) {
        kill_ns(&self.ns);
    }

    /// Partition: this host's bridge port goes down. Packets to and from it are dropped; no
    /// TCP reset is sent to anyone.
    pub fn cut_link(&self) {
        sh(&["ip", "link", "set", &self.veth, "down"]);
    }

    pub fn restore_link(&self) {
        sh(&["ip", "link", "set", &self.veth, "up"]);
    }

    /// A lossy link: each packet this host sends or receives (loopback excepted) is dropped
    /// with probability `percent`/100, by netfilter inside the host's namespace (so the rules
    /// go with it). With `peer`, only packets to and from that address.
    pub fn set_loss(&self, percent: u32, peer: Option<&str>) {
        let p = format!("{:.4}", f64::from(percent) / 100.0);
        for (chain, dev_flag, addr_flag) in [("INPUT", "-i", "-s"), ("OUTPUT", "-o", "-d")] {
            let mut rule = vec!["ip", "netns", "exec", &self.ns, "iptables", "-w", "-A", chain, "!", dev_flag, "lo"];
            if let Some(peer) = peer {
                rule.extend([addr_flag, peer]);
            }
            rule.extend(["-m", "statistic", "--mode", "random", "--probability", &p, "-j", "DROP"]);
            sh(&rule);
        }
    }

    /// Removes every loss rule [`Host::set_loss`] added.
    pub fn clear_loss(&self) {
        for chain in ["INPUT", "OUTPUT"] {
            sh(&["ip", "netns", "exec", &self.ns, "iptables", "-w", "-F", chain]);
        }
    }
}

/// A child process killed (SIGKILL) and reaped when dropped; when the test is failing, the tail
/// of its log is printed then, so a failed assertion comes with every process's story.
pub struct Proc {
    pub name: String,
    pub log: PathBuf,
    child: Option<Child>,
    status: Option<ExitStatus>,
}

impl Proc {
    pub fn spawn(mut cmd: Command, name: &str, log: &Path) -> Proc {
        let out = std::fs::File::create(log).unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let err = out.try_clone().expect("dup a log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Proc { name: name.to_string(), log: log.to_path_buf(), child: Some(child), status: None }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(-1)
    }

    /// The exit status if it has ended.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Some(c) = self.child.as_mut() {
                self.status = c.try_wait().expect("try_wait on a child");
            }
        }
        self.status
    }

    /// Waits for the process to end; panics (with its log) if it runs past `deadline`.
    pub fn wait(&mut self, deadline: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.try_status() {
                return s;
            }
            if start.elapsed() > deadline {
                panic!("{} still runs after {deadline:?}; its log ends:\n{}", self.name, self.log_tail(3000));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything it wrote so far.
    pub fn output(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let mut b = Vec::new();
            let _ = f.read_to_end(&mut b);
            s = String::from_utf8_lossy(&b).into_owned();
        }
        s
    }

    pub fn log_tail(&self, chars: usize) -> String {
        let s = self.output();
        let start = s.len().saturating_sub(chars);
        s[s.floor_char_boundary(start)..].to_string()
    }

    /// SIGKILL now (a server replica or an etcd member lost).
    pub fn kill(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            if let Ok(s) = c.wait() {
                self.status.get_or_insert(s);
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let running = self.try_status().is_none();
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "----- {} ({}) — log {} ends:\n{}",
                self.name,
                if running { "was still running".to_string() } else { format!("{:?}", self.status) },
                self.log.display(),
                self.log_tail(6000)
            );
        }
    }
}

/// The command line of an elastic job's agent on a `--rdzv-backend rlaunch` endpoint, as the
/// multi-node tests run it, then `rest` (more flags, the program and its arguments).
pub fn rdzv_args(
    nnodes: &str,
    nproc: u32,
    endpoint: &str,
    run_id: &str,
    conf: &str,
    shutdown_timeout: &str,
    rest: &[&str],
) -> Vec<String> {
    let nproc = nproc.to_string();
    let head = [
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        &nproc,
        "--rdzv-backend",
        "rlaunch",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        conf,
        "--shutdown-timeout",
        shutdown_timeout,
    ];
    head.iter().chain(rest).map(|s| s.to_string()).collect()
}

/// Writes `text` to `path` as an executable script.
pub fn write_script(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write the worker script");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod the worker script");
}

/// Writes the looping worker into `dir` and returns its path. `WORKER OUT` appends one `start`
/// line to `OUT/events.log` (time, host, ranks, world size, restart count, master, pid); exits 7
/// at once if `OUT/crash_all_<restart count>` exists; then loops until `OUT/stop` exists (exit
/// 0; `OUT/stop_<host>` stops one host's workers). If `OUT/crash_<host>_<local rank>_<restart
/// count>` appears it removes it and exits 7.
pub fn loop_worker(dir: &Path) -> PathBuf {
    let path = dir.join("loop_worker.sh");
    let script = r#"#!/bin/sh
out="$1"
echo "start t=$(date +%s.%N) host=$RL_HOST local_rank=$LOCAL_RANK rank=$RANK group_rank=$GROUP_RANK world_size=$WORLD_SIZE group_world_size=$GROUP_WORLD_SIZE restart=$TORCHELASTIC_RESTART_COUNT master=$MASTER_ADDR:$MASTER_PORT pid=$$" >> "$out/events.log"
if [ -e "$out/crash_all_$TORCHELASTIC_RESTART_COUNT" ]; then
  echo "worker $RANK on $RL_HOST crashing at start on purpose" >&2
  exit 7
fi
crash="$out/crash_${RL_HOST}_${LOCAL_RANK}_$TORCHELASTIC_RESTART_COUNT"
while :; do
  if [ -e "$out/stop" ] || [ -e "$out/stop_$RL_HOST" ]; then exit 0; fi
  if [ -e "$crash" ] && rm "$crash" 2>/dev/null; then
    echo "worker $RANK on $RL_HOST crashing on purpose" >&2
    exit 7
  fi
  sleep 0.1
done
"#;
    write_script(&path, script);
    path
}

/// One `start` line of the looping worker's event log.
#[derive(Debug, Clone, PartialEq)]
pub struct Start {
    /// Seconds since the Unix epoch.
    pub t: f64,
    pub host: String,
    pub local_rank: u32,
    pub rank: u32,
    pub group_rank: u32,
    pub world_size: u32,
    pub group_world_size: u32,
    pub restart: u32,
    pub master: String,
    pub pid: i32,
}

/// Every worker start logged in `dir/events.log` so far, in order: whole lines only (a start
/// being appended could otherwise parse with its pid cut short).
pub fn starts(dir: &Path) -> Vec<Start> {
    let text = crate::complete_text(&dir.join("events.log"));
    text.lines().filter_map(parse_start).collect()
}

fn parse_start(line: &str) -> Option<Start> {
    let mut fields = std::collections::HashMap::new();
    let mut it = line.split_whitespace();
    if it.next()? != "start" {
        return None;
    }
    for kv in it {
        let (k, v) = kv.split_once('=')?;
        fields.insert(k, v);
    }
    let num = |k: &str| fields.get(k).and_then(|v| v.parse::<u32>().ok());
    Some(Start {
        t: fields.get("t")?.parse().ok()?,
        host: fields.get("host")?.to_string(),
        local_rank: num("local_rank")?,
        rank: num("rank")?,
        group_rank: num("group_rank")?,
        world_size: num("world_size")?,
        group_world_size: num("group_world_size")?,
        restart: num("restart")?,
        master: fields.get("master")?.to_string(),
        pid: fields.get("pid")?.parse().ok()?,
    })
}

/// The latest start of each (host, local rank) among `starts`.
pub fn latest_per_worker(starts: &[Start]) -> Vec<Start> {
    let mut m: std::collections::BTreeMap<(String, u32), Start> = std::collections::BTreeMap::new();
    for s in starts {
        m.insert((s.host.clone(), s.local_rank), s.clone());
    }
    m.into_values().collect()
}

/// Whether the latest starts on exactly `hosts` (each with `nproc` workers) form one consistent
/// group of `world` ranks — world size and node count everywhere, ranks 0..world, one group rank
/// per host, contiguous ranks per host — and every one of those workers is alive.
pub fn formed(dir: &Path, hosts: &[&str], nproc: u32) -> Option<Vec<Start>> {
    let latest: Vec<Start> =
        latest_per_worker(&starts(dir)).into_iter().filter(|s| hosts.contains(&s.host.as_str())).collect();
    let world = hosts.len() as u32 * nproc;
    if latest.len() as u32 != world {
        return None;
    }
    if latest.iter().any(|s| s.world_size != world || s.group_world_size != hosts.len() as u32) {
        return None;
    }
    let mut ranks: Vec<u32> = latest.iter().map(|s| s.rank).collect();
    ranks.sort_unstable();
    if ranks != (0..world).collect::<Vec<_>>() {
        return None;
    }
    if latest.iter().any(|s| s.rank != s.group_rank * nproc + s.local_rank) {
        return None;
    }
    let mut group_ranks: Vec<u32> = latest.iter().filter(|s| s.local_rank == 0).map(|s| s.group_rank).collect();
    group_ranks.sort_unstable();
    if group_ranks != (0..hosts.len() as u32).collect::<Vec<_>>() {
        return None;
    }
    if latest.iter().any(|s| s.master != latest[0].master) {
        return None;
    }
    if latest.iter().any(|s| !crate::pid_alive(s.pid)) {
        return None;
    }
    Some(latest)
}

/// Seconds since the Unix epoch, as the worker script's `date +%s.%N`.
pub fn now_unix_f64() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_secs_f64()
}

/// `rlaunch status --json` of job `run_id` (run from the root namespace, which reaches every
/// host over the bridge).
pub fn rdzv_status(backend: &str, endpoint: &str, run_id: &str) -> serde_json::Value {
    let out = crate::run_deadline(
        Command::new(crate::bin("rlaunch")).args([
            "status",
            "--rdzv-backend",
            backend,
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--json",
        ]),
        Duration::from_secs(15),
    );
    assert!(out.status.success(), "rlaunch status failed ({}): {}", out.status, crate::stderr_of(&out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("rlaunch status --json printed no JSON ({e}): {}", crate::stdout_of(&out)))
}

/// The node ids of a status's members, sorted.
pub fn status_members(status: &serde_json::Value) -> Vec<String> {
    let mut m: Vec<String> = status["members"]
        .as_array()
        .map(|a| a.iter().filter_map(|n| n["node_id"].as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    m.sort();
    m
}

/// Waits until `hosts` run one consistent group of `nproc` workers each (see [`formed`]);
/// panics early if an agent exits meanwhile, and after `deadline` with the starts seen so far.
pub fn wait_formed(dir: &Path, hosts: &[&str], nproc: u32, agents: &mut [Proc], deadline: Duration) -> Vec<Start> {
    let start = std::time::Instant::now();
    loop {
        if let Some(group) = formed(dir, hosts, nproc) {
            return group;
        }
        for a in agents.iter_mut() {
            if let Some(s) = a.try_status() {
                panic!("{} exited ({s}) while waiting for {hosts:?} to form a group", a.name);
            }
        }
        assert!(
            start.elapsed() < deadline,
            "hosts {hosts:?} did not form one group within {deadline:?}; worker starts so far:\n{:#?}",
            starts(dir)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether something accepts TCP connections at `addr` (`ip:port`) now.
pub fn listening(addr: &str) -> bool {
    let addr: std::net::SocketAddr = addr.parse().expect("an ip:port");
    std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

/// Stops the looping workers (`DIR/stop`) and expects every agent in `agents` to exit 0.
pub fn finish(dir: &Path, agents: &mut [Proc]) {
    std::fs::write(dir.join("stop"), b"").expect("touch stop");
    for a in agents.iter_mut() {
        let status = a.wait(Duration::from_secs(20));
        assert!(status.success(), "{} did not succeed ({status}):\n{}", a.name, a.log_tail(3000));
    }
}

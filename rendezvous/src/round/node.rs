//! The checks on a node's details before a job records anything of it: its id and worker count
//! ([`validate_node`]), the addresses it advertises ([`check_advertised`]), and the bounded copy
//! of its fingerprint a job keeps ([`fingerprint_summary`]).

use std::collections::BTreeMap;

use super::event::Rejection;
use super::settings::MAX_LOCAL_WORLD_SIZE;
use rlaunch::contract::{HostPort, NodeInfo};

/// Checks a node's details (id, workers) before anything is recorded for it.
pub fn validate_node(node: &NodeInfo) -> Result<(), Rejection> {
    let invalid = |message: &str| Err(Rejection::InvalidNode { message: message.to_owned() });
    if node.node_id.is_empty() || node.node_id.len() > 256 {
        return invalid("node_id must be 1 to 256 characters");
    }
    if node.node_id.chars().any(|c| c.is_control() || c == '/') {
        return invalid("node_id must not contain '/' or control characters");
    }
    if node.local_world_size == 0 || node.local_world_size > MAX_LOCAL_WORLD_SIZE {
        return invalid(&format!("local_world_size must be 1 to {MAX_LOCAL_WORLD_SIZE}"));
    }
    if let Some(fp) = &node.fingerprint {
        fp.within_bounds().map_err(|e| Rejection::InvalidNode { message: e.to_string() })?;
    }
    if let Some(key) = &node.snapshot_key {
        if crate::identity::unhex(key).is_none_or(|k| k.len() != 32) {
            return invalid("snapshot_key must be 64 lowercase hex digits (an X25519 public key)");
        }
    }
    use rlaunch::contract::{MAX_SNAPSHOT_RANGES, MAX_SNAPSHOT_SETS};
    if node.snapshots.len() > MAX_SNAPSHOT_SETS {
        return invalid(&format!("at most {MAX_SNAPSHOT_SETS} snapshot sets"));
    }
    for set in &node.snapshots {
        if set.ranks.len() > MAX_SNAPSHOT_RANGES || set.ranks.iter().any(|(lo, hi)| lo >= hi || *hi > set.world) {
            return invalid(&format!(
                "a snapshot set holds at most {MAX_SNAPSHOT_RANGES} rank ranges, each non-empty and within its world"
            ));
        }
    }
    Ok(())
}

/// Whether a node joining from `peer` (the TCP peer address of its join) may advertise the
/// addresses it does: other members connect to its store and send probes to its probe address,
/// so a node may name only itself. Every advertised host must be `peer`'s IP address (an IPv4
/// address also in its IPv6-mapped form), or a host name that `resolved` (what the service's
/// resolver answered for each name, looked up by the caller) maps to it: the name the other
/// members will resolve. A join from loopback is not checked: an agent on the service's own
/// host (a single-host job, `--standalone`), or a proxy on that host, in front of the service,
/// which hides every peer. Behind NAT or a proxy elsewhere the service is started with
/// `--trust-advertised-addrs`, and this check is skipped.
pub fn check_advertised(
    node: &NodeInfo,
    peer: std::net::IpAddr,
    resolved: &BTreeMap<String, Vec<std::net::IpAddr>>,
) -> Result<(), Rejection> {
    let canonical = canonical_ip;
    let peer = canonical(peer);
    if peer.is_loopback() {
        return Ok(());
    }
    for (what, addr) in advertised(node) {
        let ok = match addr.host().parse::<std::net::IpAddr>() {
            Ok(ip) => canonical(ip) == peer,
            Err(_) => resolved.get(addr.host()).is_some_and(|ips| ips.iter().any(|&ip| canonical(ip) == peer)),
        };
        if !ok {
            return Err(Rejection::InvalidNode {
                message: format!(
                    "{what} `{addr}` is not the address this join came from ({peer}): a node may advertise only \
                     its own address (rlaunch --local-addr {peer}, or a host name that resolves to it); behind \
                     NAT or a proxy, start rlaunch-rendezvous with --trust-advertised-addrs"
                ),
            });
        }
    }
    Ok(())
}

/// An IPv4 address given in its IPv6-mapped form (`::ffff:a.b.c.d`) as the IPv4 address.
pub fn canonical_ip(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, std::net::IpAddr::V4),
        v4 => v4,
    }
}

/// Replaces each host name `node` advertises (checked by [`check_advertised`] to resolve to
/// `peer`) with `peer`'s address, so what the others reach is what was checked.
pub fn pin_advertised_names(node: &mut NodeInfo, peer: std::net::IpAddr) {
    let ip = canonical_ip(peer).to_string();
    let pin = |addr: &mut HostPort| {
        if addr.host().parse::<std::net::IpAddr>().is_err() {
            if let Ok(pinned) = HostPort::new(ip.clone(), addr.port()) {
                *addr = pinned;
            }
        }
    };
    pin(&mut node.store_addr);
    if let Some(probe) = node.probe_addr.as_mut() {
        pin(probe);
    }
    if let Some(snap) = node.snapshot_addr.as_mut() {
        pin(snap);
    }
}

/// The addresses a node asks others to reach it at, named by their field.
pub fn advertised(node: &NodeInfo) -> impl Iterator<Item = (&'static str, &HostPort)> {
    [
        ("store_addr", Some(&node.store_addr)),
        ("probe_addr", node.probe_addr.as_ref()),
        ("snapshot_addr", node.snapshot_addr.as_ref()),
    ]
    .into_iter()
    .filter_map(|(what, addr)| Some((what, addr?)))
}

/// Most distinct fingerprints a job keeps; a node with yet another is reported without its
/// entries. With [`MAX_FINGERPRINT_BYTES`], a job's fingerprints stay within 32 kB (a node may
/// send 128 entries of 1 kB: 147 kB, which 32 of, in every job, took the service's memory
/// and etcd's history to hundreds of megabytes).
pub const MAX_FINGERPRINTS: usize = 8;
/// Most bytes (keys and values) of the copy of a node's fingerprint a job keeps
/// ([`fingerprint_summary`]); the digest is of the whole.
pub const MAX_FINGERPRINT_BYTES: usize = 4096;
/// Longest value a kept fingerprint holds whole; a longer one keeps its start and a digest.
const FINGERPRINT_VALUE: usize = 96;
/// The key of the kept fingerprint's entry that stands for the entries past its bound.
pub const FINGERPRINT_MORE: &str = "…";

/// A fingerprint's digest: SHA-256 of its JSON (keys in order), hex, the first 16 characters.
pub fn fingerprint_digest(fp: &rlaunch::fingerprint::Fingerprint) -> String {
    let json = serde_json::to_string(fp).unwrap_or_default();
    crate::identity::digest(&json)[..16].to_owned()
}

/// The copy of `fp` a job keeps: at most [`MAX_FINGERPRINT_BYTES`], and different wherever `fp`
/// is. A long key or value keeps its first 64 characters and a digest of all of it; past the
/// bound, the remaining entries (in key order) become one [`FINGERPRINT_MORE`] entry with their
/// count and digest.
pub fn fingerprint_summary(fp: &rlaunch::fingerprint::Fingerprint) -> rlaunch::fingerprint::Fingerprint {
    let digest = |parts: &[&str]| crate::identity::digest(&parts.join("\0"))[..12].to_owned();
    let short = |s: &str, keep: usize| {
        if s.len() <= keep {
            s.to_owned()
        } else {
            let start: String = s.chars().take(64).collect();
            format!("{start}… (sha256 {})", digest(&[s]))
        }
    };
    // Room for the entry that says what was left out.
    let budget = MAX_FINGERPRINT_BYTES - 64;
    let entries: Vec<(&String, &String)> = fp.0.iter().collect();
    let mut out = BTreeMap::new();
    let mut used = 0usize;
    for (i, (k, v)) in entries.iter().enumerate() {
        let (k, v) = (short(k, 64), short(v, FINGERPRINT_VALUE));
        if used + k.len() + v.len() > budget {
            let rest = &entries[i..];
            let all: Vec<&str> = rest.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()]).collect();
            out.insert(FINGERPRINT_MORE.to_owned(), format!("{} more entries (sha256 {})", rest.len(), digest(&all)));
            break;
        }
        used += k.len() + v.len();
        out.insert(k, v);
    }
    rlaunch::fingerprint::Fingerprint(out)
}

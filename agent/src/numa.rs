//! CPU-affinity policies of torchrun's `--numa-binding` flag (torch 2.15, `torch/numa/binding.py`).
//!
//! With `--numa-binding=MODE`, every worker is pinned to a set of logical CPUs chosen for the GPU it
//! uses: torch assumes the worker with local rank `r` uses accelerator `r` and picks CPUs close to that
//! device's NUMA node. torch applies the set with `numactl --physcpubind=…` (or `sched_setaffinity` on
//! every thread of a function entrypoint); the launcher computes the same set here, from sysfs, and applies
//! it with `sched_setaffinity` in the child between `fork` and `exec` (see [`to_cpu_set`]).
//!
//! Everything below works on the CPUs this process may run on ("allowed" CPUs, `sched_getaffinity` of the
//! agent): a NUMA node's CPUs are always intersected with them first, so a launcher started under
//! `taskset`, a cgroup cpuset or Slurm's CPU binding only ever hands out CPUs it owns.
//!
//! The policies ([`NumaMode`]):
//!
//! * `node`: all allowed CPUs of the GPU's NUMA node.
//! * `socket`: all allowed CPUs of every NUMA node in the same socket as the GPU's node.
//! * `exclusive`: a private slice of the physical cores of the GPU's node, one slice per GPU on that node.
//! * `core-complex`: the CPUs sharing one last-level cache (an AMD CCX, for example) in the GPU's node,
//!   a different one for each GPU on the node while there are enough.
//!
//! The sysfs reading ([`Topology::read`]) is separate from the policies ([`cpus_for`]), which are pure, so the
//! policies can be tested against made-up sysfs trees.
//!
//! Failures are [`NumaError`]s (and [`CpuListError`]s for a malformed CPU list); each one's message is a
//! sentence naming the file, GPU or value at fault, which the agent shows as is.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

/// How many CPUs a `libc::cpu_set_t` holds (`CPU_SETSIZE`, 1024 with glibc).
const CPU_SET_CAPACITY: usize = 8 * std::mem::size_of::<libc::cpu_set_t>();

/// Largest number [`parse_cpu_list`] accepts. Linux has at most 8192 CPUs and 1024 NUMA nodes; the bound
/// keeps a corrupt range such as `0-4294967295` from building a set of billions of entries.
const MAX_LIST_VALUE: u32 = 65_535;

/// Why a `--numa-binding` policy cannot be applied on this node.
///
/// Cloneable (the I/O errors are shared), because a [`Topology`] keeps the errors of the per-CPU and per-node
/// files it could not read and hands them out only to the modes that need those files.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NumaError {
    /// A mode torch does not know (not one of [`NumaMode::ALL`]).
    #[error("invalid --numa-binding mode {given:?}; choose one of: {}", NumaMode::ALL.map(NumaMode::as_str).join(", "))]
    BadMode { given: String },
    /// `sched_getaffinity` failed: the CPUs this process may run on are unknown.
    #[error("cannot read this process's CPUs: {source}")]
    Affinity { source: Arc<io::Error> },
    /// A sysfs file or directory could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Unreadable { path: PathBuf, source: Arc<io::Error> },
    /// A sysfs file that holds a CPU list (`cpulist`, `possible`, `thread_siblings_list`, `shared_cpu_list`)
    /// holds something else.
    #[error("{}: {source}", path.display())]
    BadCpuList { path: PathBuf, source: CpuListError },
    /// A sysfs file that holds an integer (`physical_package_id`, `level`, `numa_node`) holds something else.
    #[error("{}: expected an integer, found {found:?}", path.display())]
    NotAnInteger { path: PathBuf, found: String },
    /// A GPU's `numa_node` beyond what a node number can be.
    #[error("{}: NUMA node {node} is too large", path.display())]
    NodeTooLarge { path: PathBuf, node: i64 },
    /// A CPU list that names at least one CPU on any real machine (`thread_siblings_list`, a cache's
    /// `shared_cpu_list`) is empty.
    #[error("{} is empty", path.display())]
    EmptyList { path: PathBuf },
    /// A CPU's `cache` directory has no Unified or Data cache, so its core complex is unknown.
    #[error("{} lists no Unified or Data cache", dir.display())]
    NoCache { dir: PathBuf },
    /// A CPU of a node that has no entry in the topology (the two are read together, so this is a bug).
    #[error("CPU {cpu} is missing from the topology read from sysfs")]
    CpuMissing { cpu: u32 },
    /// No NVIDIA or AMD GPU under `bus/pci/devices` (`devices`).
    #[error("--numa-binding needs a GPU: none found under {}", devices.display())]
    NoGpu { devices: PathBuf },
    /// A device index beyond the GPUs found.
    #[error("device index {index} but this machine has {gpus} GPUs under {}", devices.display())]
    NoSuchGpu { index: usize, gpus: usize, devices: PathBuf },
    /// `CUDA_VISIBLE_DEVICES` lists a device index beyond the GPUs found.
    #[error(
        "CUDA_VISIBLE_DEVICES={list:?} lists device {index} but this machine has {gpus} GPUs under {}",
        devices.display()
    )]
    NoSuchVisibleGpu { list: String, index: usize, gpus: usize, devices: PathBuf },
    /// The `cpulist` of the GPU's NUMA node could not be read (`source`).
    #[error("GPU {index} ({address}) is on NUMA node {node}, but {source}")]
    GpuNodeUnreadable { index: usize, address: String, node: u32, source: Box<NumaError> },
    /// The GPU's NUMA node is not among the `possible` nodes.
    #[error("GPU {index} ({address}) is on NUMA node {node}, which {} does not list", possible.display())]
    GpuNodeUnlisted { index: usize, address: String, node: u32, possible: PathBuf },
    /// The GPU's NUMA node has no CPU this process may run on.
    #[error("GPU {index} ({address}) is on NUMA node {node}, which has no CPU this process may run on")]
    NoCpusOnGpuNode { index: usize, address: String, node: u32 },
    /// `exclusive`: fewer allowed physical cores on the node than GPUs to share them.
    #[error(
        "--numa-binding=exclusive: NUMA node {node} has only {cores} physical cores this process may run on, \
         for its {gpus} GPUs"
    )]
    TooFewCores { node: u32, cores: usize, gpus: usize },
    /// The policy chose no CPU for the GPU.
    #[error("--numa-binding={mode} found no CPU for GPU {index} (NUMA node {node})")]
    NoCpuChosen { mode: NumaMode, index: usize, node: u32 },
    /// The policy chose a CPU that a `cpu_set_t` cannot hold.
    #[error(
        "--numa-binding={mode} chose CPU {cpu} for GPU {index}, but only CPUs below {} can be bound",
        CPU_SET_CAPACITY
    )]
    CpuBeyondSet { mode: NumaMode, cpu: u32, index: usize },
    /// `CUDA_VISIBLE_DEVICES` is set to nothing.
    #[error("CUDA_VISIBLE_DEVICES is set but empty, so no GPU is visible")]
    NoVisibleDevices,
    /// A `CUDA_VISIBLE_DEVICES` entry that is not a device index (a UUID, a MIG name, a negative number).
    #[error(
        "CUDA_VISIBLE_DEVICES entry {entry:?} is not a device index; --numa-binding needs a list of integers \
         (GPU UUIDs and MIG names are not supported)"
    )]
    NotADeviceIndex { entry: String },
    /// `CUDA_VISIBLE_DEVICES` lists a device twice.
    #[error("CUDA_VISIBLE_DEVICES={list:?} lists device {index} twice")]
    DuplicateDevice { list: String, index: usize },
    /// `CUDA_VISIBLE_DEVICES` lists fewer devices than the local rank needs.
    #[error("local rank {local_rank} has no GPU: CUDA_VISIBLE_DEVICES={list:?} lists {listed} devices")]
    RankWithoutGpu { local_rank: u32, list: String, listed: usize },
}

impl NumaError {
    fn unreadable(path: &Path, source: io::Error) -> NumaError {
        NumaError::Unreadable { path: path.to_path_buf(), source: Arc::new(source) }
    }
}

/// Why [`parse_cpu_list`] refused a CPU list (`list`, as given).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CpuListError {
    /// An item or range end that is not a plain decimal number.
    #[error("CPU list {list:?}: {item:?} is not a number")]
    NotANumber { list: String, item: String },
    /// A number above 65535.
    #[error("CPU list {list:?}: {item} is larger than {}", MAX_LIST_VALUE)]
    TooLarge { list: String, item: String },
    /// A range `a-b` with `a > b`.
    #[error("CPU list {list:?}: range {range:?} is descending")]
    Descending { list: String, range: String },
}

/// A `--numa-binding` policy: which CPUs the worker using a given GPU is pinned to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NumaMode {
    /// Every allowed CPU of the NUMA node the GPU is attached to. Workers whose GPUs share a node share
    /// all of its CPUs. torch recommends this one when in doubt.
    Node,
    /// Every allowed CPU of every NUMA node on the GPU's socket. The socket of a NUMA node is the
    /// `physical_package_id` of the lowest-numbered allowed CPU of that node; the GPU's own node decides the
    /// socket, and each node whose lowest allowed CPU is in the same package joins in. With one NUMA node per
    /// socket this is the same as [`NumaMode::Node`].
    Socket,
    /// A slice of the GPU's NUMA node that no other worker gets. The node's allowed CPUs are grouped into
    /// physical cores (hyperthreads of one core stay together; a core is identified by the lowest CPU of its
    /// `thread_siblings_list`), the cores are ordered by that identifier and dealt out as contiguous runs to
    /// the GPUs of the node in GPU-index order: each gets `cores / gpus` cores and the first `cores % gpus`
    /// GPUs one more. A node with fewer allowed cores than GPUs is an error.
    Exclusive,
    /// One "core complex" of the GPU's NUMA node: the allowed CPUs sharing a last-level cache. A CPU's
    /// last-level cache is the one of highest `level` among its `Unified` and `Data` caches (instruction
    /// caches don't count), identified by the lowest CPU of its `shared_cpu_list`. The node's caches are
    /// ordered largest first (by number of allowed CPUs), then by that identifier, and the k-th GPU of the
    /// node (in GPU-index order) gets cache `k % number_of_caches`: distinct complexes while there are enough,
    /// shared ones after that.
    CoreComplex,
}

impl NumaMode {
    /// All modes, in the order torch lists them.
    pub const ALL: [NumaMode; 4] = [NumaMode::Node, NumaMode::Socket, NumaMode::Exclusive, NumaMode::CoreComplex];

    /// The name used on the command line (`node`, `socket`, `exclusive`, `core-complex`).
    pub fn as_str(self) -> &'static str {
        match self {
            NumaMode::Node => "node",
            NumaMode::Socket => "socket",
            NumaMode::Exclusive => "exclusive",
            NumaMode::CoreComplex => "core-complex",
        }
    }
}

impl fmt::Display for NumaMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NumaMode {
    type Err = NumaError;

    /// Accepts exactly the names torch accepts: `node`, `socket`, `exclusive`, `core-complex`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NumaMode::ALL
            .into_iter()
            .find(|mode| mode.as_str() == s)
            .ok_or_else(|| NumaError::BadMode { given: s.to_string() })
    }
}

/// One GPU found on the PCI bus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// The PCI address, as named under `/sys/bus/pci/devices` (`0000:1b:00.0`).
    pub pci_address: String,
    /// The NUMA node the device is attached to; the kernel's `-1` ("no NUMA information", typical of
    /// single-node machines) is read as node 0, as torch does.
    pub numa_node: u32,
}

/// What sysfs says about one allowed CPU. Each field is read eagerly but only needed by some modes, so a
/// missing file is kept as its error and reported only by a mode that needs it.
#[derive(Clone, Debug)]
struct CpuInfo {
    /// The physical core: the lowest CPU of `topology/thread_siblings_list`.
    core: Result<u32, NumaError>,
    /// The socket: `topology/physical_package_id`.
    package: Result<i64, NumaError>,
    /// The last-level cache: the lowest CPU sharing the highest-level Unified/Data cache.
    cache: Result<u32, NumaError>,
}

/// The machine as the `--numa-binding` policies see it: NUMA nodes with their allowed CPUs, per-CPU core,
/// socket and cache identifiers, and the GPUs with their NUMA nodes.
#[derive(Clone, Debug)]
pub struct Topology {
    /// Where sysfs was read from, for error messages.
    sysfs_root: PathBuf,
    /// Each node of `devices/system/node/possible` with its CPUs intersected with the allowed CPUs, or the
    /// error reading its `cpulist` (a possible node need not exist).
    nodes: BTreeMap<u32, Result<BTreeSet<u32>, NumaError>>,
    /// Every allowed CPU that belongs to a node.
    cpus: BTreeMap<u32, CpuInfo>,
    /// NVIDIA and AMD GPUs, in device-index order.
    gpus: Vec<Gpu>,
}

impl Topology {
    /// Reads the topology from the sysfs tree mounted at `sysfs_root` (normally `/sys`), keeping only the
    /// CPUs in `allowed` (normally [`allowed_cpus`]).
    ///
    /// Reads `devices/system/node/possible` and each node's `cpulist`; for every allowed CPU of a node, its
    /// `topology/thread_siblings_list`, `topology/physical_package_id` and `cache/index*/{type,level,
    /// shared_cpu_list}`; and the GPUs: the entries of `bus/pci/devices` whose `vendor` is NVIDIA (`0x10de`)
    /// or AMD (`0x1002`) and whose `class` is a VGA (`0x0300..`), 3D (`0x0302..`), other display (`0x0380..`, AMD Instinct) or processing accelerator (`0x1200..`) controller, ordered by PCI
    /// address, which is the numbering CUDA uses with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, each with its
    /// `numa_node`.
    ///
    /// Fails when the node list or a GPU's NUMA node cannot be read, or a file is malformed. Per-CPU files
    /// that are missing only fail the modes needing them, in [`cpus_for`]. Finding no GPU is not an error
    /// here either.
    pub fn read(sysfs_root: &Path, allowed: &BTreeSet<u32>) -> Result<Topology, NumaError> {
        let node_dir = sysfs_root.join("devices/system/node");
        let mut nodes = BTreeMap::new();
        for node in read_list(&node_dir.join("possible"))? {
            let path = node_dir.join(format!("node{node}/cpulist"));
            let cpus = match fs::read_to_string(&path) {
                Ok(text) => {
                    let cpus =
                        parse_cpu_list(&text).map_err(|source| NumaError::BadCpuList { path: path.clone(), source })?;
                    Ok(&cpus & allowed)
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => Err(NumaError::unreadable(&path, e)),
                Err(e) => return Err(NumaError::unreadable(&path, e)),
            };
            nodes.insert(node, cpus);
        }

        let cpu_dir = sysfs_root.join("devices/system/cpu");
        let mut cpus = BTreeMap::new();
        for &cpu in nodes.values().flatten().flatten() {
            cpus.entry(cpu).or_insert_with(|| CpuInfo::read(&cpu_dir.join(format!("cpu{cpu}"))));
        }

        let gpus = read_gpus(&sysfs_root.join("bus/pci/devices"))?;
        Ok(Topology { sysfs_root: sysfs_root.to_path_buf(), nodes, cpus, gpus })
    }

    /// The GPUs, in device-index order.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// The allowed CPUs of a NUMA node, or `None` if the node is not listed or its `cpulist` is unreadable.
    pub fn node_cpus(&self, node: u32) -> Option<&BTreeSet<u32>> {
        self.nodes.get(&node).and_then(|cpus| cpus.as_ref().ok())
    }

    /// The same machine seen through a `CUDA_VISIBLE_DEVICES`-style list: the GPUs are the listed ones, in
    /// listed order, so device index `i` is the i-th listed GPU (`None` keeps every GPU).
    ///
    /// This is exactly what torch computes with: it runs in the agent, which has the workers'
    /// `CUDA_VISIBLE_DEVICES`, so its device indices, and the GPUs it counts on a NUMA node for `exclusive`
    /// and `core-complex`, are the visible ones. Pass the worker's local rank as the device index of
    /// [`cpus_for`] on the result. (Mapping the local rank with [`visible_device_index`] and using the full
    /// topology picks the same NUMA node, but `exclusive` and `core-complex` then also count the GPUs on the
    /// node that are not visible.)
    pub fn with_visible_devices(&self, visible: Option<&str>) -> Result<Topology, NumaError> {
        let Some(list) = visible else {
            return Ok(self.clone());
        };
        let gpus = parse_visible_devices(list)?
            .into_iter()
            .map(|index| {
                self.gpus.get(index).cloned().ok_or_else(|| NumaError::NoSuchVisibleGpu {
                    list: list.to_string(),
                    index,
                    gpus: self.gpus.len(),
                    devices: self.gpu_devices(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Topology { gpus, ..self.clone() })
    }

    /// Where the GPUs were looked for.
    fn gpu_devices(&self) -> PathBuf {
        self.sysfs_root.join("bus/pci/devices")
    }

    /// `cpus` grouped by what they share (a physical core, a last-level cache), each group named
    /// by its lowest CPU.
    fn group(
        &self,
        cpus: &BTreeSet<u32>,
        key: impl Fn(&CpuInfo) -> &Result<u32, NumaError>,
    ) -> Result<BTreeMap<u32, BTreeSet<u32>>, NumaError> {
        let mut groups: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for &cpu in cpus {
            let k = key(self.cpu(cpu)?).clone()?;
            groups.entry(k).or_default().insert(cpu);
        }
        Ok(groups)
    }

    fn cpu(&self, cpu: u32) -> Result<&CpuInfo, NumaError> {
        self.cpus.get(&cpu).ok_or(NumaError::CpuMissing { cpu })
    }

    fn package(&self, cpu: u32) -> Result<i64, NumaError> {
        self.cpu(cpu)?.package.clone()
    }

    /// The NUMA node of a GPU.
    fn gpu_node(&self, device_index: usize) -> Result<u32, NumaError> {
        match self.gpus.get(device_index) {
            Some(gpu) => Ok(gpu.numa_node),
            None if self.gpus.is_empty() => Err(NumaError::NoGpu { devices: self.gpu_devices() }),
            None => {
                Err(NumaError::NoSuchGpu { index: device_index, gpus: self.gpus.len(), devices: self.gpu_devices() })
            }
        }
    }

    /// The allowed CPUs of the GPU's NUMA node; an error if there are none.
    fn gpu_node_cpus(&self, device_index: usize, node: u32) -> Result<&BTreeSet<u32>, NumaError> {
        let address = self.gpus[device_index].pci_address.clone();
        let cpus = match self.nodes.get(&node) {
            Some(Ok(cpus)) => cpus,
            Some(Err(e)) => {
                let source = Box::new(e.clone());
                return Err(NumaError::GpuNodeUnreadable { index: device_index, address, node, source });
            }
            None => {
                let possible = self.sysfs_root.join("devices/system/node/possible");
                return Err(NumaError::GpuNodeUnlisted { index: device_index, address, node, possible });
            }
        };
        if cpus.is_empty() {
            return Err(NumaError::NoCpusOnGpuNode { index: device_index, address, node });
        }
        Ok(cpus)
    }

    /// Where the GPU stands among the GPUs of its NUMA node (in device-index order), and how many there are.
    fn position_on_node(&self, device_index: usize, node: u32) -> (usize, usize) {
        let on_node: Vec<usize> = (0..self.gpus.len()).filter(|&i| self.gpus[i].numa_node == node).collect();
        let position = on_node.iter().position(|&i| i == device_index).unwrap_or(0);
        (position, on_node.len())
    }

    fn socket_cpus(&self, node_cpus: &BTreeSet<u32>) -> Result<BTreeSet<u32>, NumaError> {
        let Some(&lowest) = node_cpus.first() else {
            return Ok(BTreeSet::new());
        };
        let socket = self.package(lowest)?;
        let mut cpus = BTreeSet::new();
        // Nodes without an allowed CPU (memory-only nodes, nodes outside the cpuset) have no socket and
        // nothing to add; torch fails on them (`min()` of an empty set), this skips them.
        for node_cpus in self.nodes.values().flatten() {
            if let Some(&lowest) = node_cpus.first() {
                if self.package(lowest)? == socket {
                    cpus.extend(node_cpus);
                }
            }
        }
        Ok(cpus)
    }

    fn exclusive_cpus(
        &self,
        device_index: usize,
        node: u32,
        node_cpus: &BTreeSet<u32>,
    ) -> Result<BTreeSet<u32>, NumaError> {
        let cores = self.group(node_cpus, |c| &c.core)?;
        let (position, gpus) = self.position_on_node(device_index, node);
        let per_gpu = cores.len() / gpus;
        let extra = cores.len() % gpus;
        if per_gpu == 0 {
            return Err(NumaError::TooFewCores { node, cores: cores.len(), gpus });
        }
        let start = position * per_gpu + position.min(extra);
        let count = per_gpu + usize::from(position < extra);
        Ok(cores.into_values().skip(start).take(count).flatten().collect())
    }

    fn core_complex_cpus(
        &self,
        device_index: usize,
        node: u32,
        node_cpus: &BTreeSet<u32>,
    ) -> Result<BTreeSet<u32>, NumaError> {
        let mut caches: Vec<(u32, BTreeSet<u32>)> = self.group(node_cpus, |c| &c.cache)?.into_iter().collect();
        caches.sort_by_key(|(cache, cpus)| (Reverse(cpus.len()), *cache));
        let (position, _) = self.position_on_node(device_index, node);
        let count = caches.len();
        Ok(caches.into_iter().nth(position % count.max(1)).map(|(_, cpus)| cpus).unwrap_or_default())
    }
}

/// The CPUs the worker using GPU `device_index` (an index into [`Topology::gpus`]) is pinned to under `mode`.
///
/// Fails with a sentence saying why when there is no such GPU, the GPU's NUMA node is unknown or has no
/// allowed CPU, a sysfs file the mode needs could not be read, `exclusive` has fewer cores than GPUs, or the
/// result would be empty or hold a CPU beyond what [`to_cpu_set`] can represent.
pub fn cpus_for(topology: &Topology, mode: NumaMode, device_index: usize) -> Result<BTreeSet<u32>, NumaError> {
    let node = topology.gpu_node(device_index)?;
    let node_cpus = topology.gpu_node_cpus(device_index, node)?;
    let cpus = match mode {
        NumaMode::Node => node_cpus.clone(),
        NumaMode::Socket => topology.socket_cpus(node_cpus)?,
        NumaMode::Exclusive => topology.exclusive_cpus(device_index, node, node_cpus)?,
        NumaMode::CoreComplex => topology.core_complex_cpus(device_index, node, node_cpus)?,
    };
    match cpus.last() {
        None => Err(NumaError::NoCpuChosen { mode, index: device_index, node }),
        Some(&last) if last as usize >= CPU_SET_CAPACITY => {
            Err(NumaError::CpuBeyondSet { mode, cpu: last, index: device_index })
        }
        Some(_) => Ok(cpus),
    }
}

/// The physical GPU index used by the worker with local rank `local_rank`, given the value of
/// `CUDA_VISIBLE_DEVICES` (`None` when it is unset).
///
/// Without a list, local rank `r` uses GPU `r`; with one, it uses the r-th listed GPU. Only lists of
/// integer indices can be mapped: a UUID (`GPU-…`) or MIG entry, a negative or duplicate index, an empty
/// list, or a list shorter than `local_rank + 1` is an error.
pub fn visible_device_index(local_rank: u32, visible: Option<&str>) -> Result<usize, NumaError> {
    let rank = local_rank as usize;
    let Some(list) = visible else {
        return Ok(rank);
    };
    let devices = parse_visible_devices(list)?;
    devices.get(rank).copied().ok_or_else(|| NumaError::RankWithoutGpu {
        local_rank,
        list: list.to_string(),
        listed: devices.len(),
    })
}

/// Parses a `CUDA_VISIBLE_DEVICES`-style list of device indices.
fn parse_visible_devices(list: &str) -> Result<Vec<usize>, NumaError> {
    if list.trim().is_empty() {
        return Err(NumaError::NoVisibleDevices);
    }
    let mut devices = Vec::new();
    for entry in list.split(',').map(str::trim) {
        let is_index = !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit());
        let index = entry
            .parse::<usize>()
            .ok()
            .filter(|_| is_index)
            .ok_or_else(|| NumaError::NotADeviceIndex { entry: entry.to_string() })?;
        if devices.contains(&index) {
            return Err(NumaError::DuplicateDevice { list: list.to_string(), index });
        }
        devices.push(index);
    }
    Ok(devices)
}

/// Parses a kernel CPU list such as `0-2,4,6-7\n` (the format of sysfs `cpulist` files and of
/// `numactl --physcpubind`). Whitespace around items and empty items are ignored, so an empty string is the
/// empty set. Fails on anything else that is not a number or an ascending `a-b` range, and on numbers above
/// 65535.
pub fn parse_cpu_list(s: &str) -> Result<BTreeSet<u32>, CpuListError> {
    let number = |text: &str| -> Result<u32, CpuListError> {
        let text = text.trim();
        let (list, item) = (s.to_string(), text.to_string());
        match text.parse::<u32>() {
            Ok(n) if text.bytes().all(|b| b.is_ascii_digit()) && n <= MAX_LIST_VALUE => Ok(n),
            Ok(_) if text.bytes().all(|b| b.is_ascii_digit()) => Err(CpuListError::TooLarge { list, item }),
            _ => Err(CpuListError::NotANumber { list, item }),
        }
    };
    let mut cpus = BTreeSet::new();
    for item in s.split(',').map(str::trim).filter(|item| !item.is_empty()) {
        match item.split_once('-') {
            Some((first, last)) => {
                let (first, last) = (number(first)?, number(last)?);
                if first > last {
                    return Err(CpuListError::Descending { list: s.to_string(), range: item.to_string() });
                }
                cpus.extend(first..=last);
            }
            None => {
                cpus.insert(number(item)?);
            }
        }
    }
    Ok(cpus)
}

/// Formats a CPU set as a compact kernel CPU list: `{0,1,2,4,6,7}` becomes `0-2,4,6-7`, the empty set `""`.
pub fn format_cpu_list(cpus: &BTreeSet<u32>) -> String {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for &cpu in cpus {
        match ranges.last_mut() {
            Some((_, last)) if last.checked_add(1) == Some(cpu) => *last = cpu,
            _ => ranges.push((cpu, cpu)),
        }
    }
    let items: Vec<String> = ranges
        .into_iter()
        .map(|(first, last)| if first == last { first.to_string() } else { format!("{first}-{last}") })
        .collect();
    items.join(",")
}

/// The CPUs the calling thread may run on (`sched_getaffinity(0, …)`).
///
/// Starts with a 1024-CPU mask and doubles it while the kernel answers `EINVAL` (machines configured for more
/// CPUs than the mask holds). Fails with [`NumaError::Affinity`].
pub fn allowed_cpus() -> Result<BTreeSet<u32>, NumaError> {
    let word_bytes = std::mem::size_of::<libc::c_ulong>();
    let word_bits = 8 * word_bytes;
    let mut words = CPU_SET_CAPACITY / word_bits;
    loop {
        let mut mask: Vec<libc::c_ulong> = vec![0; words];
        // SAFETY: `mask` owns `words * word_bytes` writable bytes, which is the size passed, so the kernel
        // writes only inside it; the buffer is as aligned as the `unsigned long` words the kernel mask is made
        // of, the layout of `cpu_set_t`. Pid 0 is the calling thread.
        let rc = unsafe { libc::sched_getaffinity(0, words * word_bytes, mask.as_mut_ptr().cast::<libc::cpu_set_t>()) };
        if rc == 0 {
            let mut cpus = BTreeSet::new();
            for (i, &word) in mask.iter().enumerate() {
                for bit in (0..word_bits).filter(|&bit| (word >> bit) & 1 == 1) {
                    cpus.insert((i * word_bits + bit) as u32);
                }
            }
            return Ok(cpus);
        }
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EINVAL) || words * word_bits >= 1 << 20 {
            return Err(NumaError::Affinity { source: Arc::new(error) });
        }
        words *= 2;
    }
}

/// Converts a CPU set for `sched_setaffinity`. Allocation-free, so it may be used after `fork`; CPUs at or
/// above `CPU_SETSIZE` (1024) cannot be represented and are left out ([`cpus_for`] never returns one).
pub fn to_cpu_set(cpus: &BTreeSet<u32>) -> libc::cpu_set_t {
    // SAFETY: `cpu_set_t` is a plain array of integers, for which all-zero bytes is a valid value (the
    // empty set, what `CPU_ZERO` produces).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus.range(..CPU_SET_CAPACITY as u32) {
        // SAFETY: `cpu < CPU_SETSIZE`, so the bit `CPU_SET` sets lies inside `set`.
        unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    }
    set
}

impl CpuInfo {
    /// Reads `{root}/devices/system/cpu/cpu{N}` (`dir`).
    fn read(dir: &Path) -> CpuInfo {
        let siblings = dir.join("topology/thread_siblings_list");
        CpuInfo {
            core: read_list(&siblings)
                .and_then(|cpus| cpus.first().copied().ok_or_else(|| NumaError::EmptyList { path: siblings.clone() })),
            package: read_int(&dir.join("topology/physical_package_id")),
            cache: read_max_level_cache(&dir.join("cache")),
        }
    }
}

/// The identifier (lowest sharing CPU) of a CPU's highest-level Unified or Data cache, from its `cache`
/// directory. Caches are visited in `index<N>` order and the first one of the highest level wins.
fn read_max_level_cache(dir: &Path) -> Result<u32, NumaError> {
    let entries = fs::read_dir(dir).map_err(|e| NumaError::unreadable(dir, e))?;
    let mut indices: Vec<(u64, PathBuf)> = entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let name = entry.file_name();
            let number = name.to_str()?.strip_prefix("index")?;
            if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some((number.parse().ok()?, entry.path()))
        })
        .collect();
    indices.sort();
    let mut best: Option<(i64, PathBuf, BTreeSet<u32>)> = None;
    for (_, path) in indices {
        let kind = read_file(&path.join("type"))?;
        if !matches!(kind.trim(), "Unified" | "Data") {
            continue;
        }
        let level = read_int(&path.join("level"))?;
        if best.as_ref().is_some_and(|(max, _, _)| level <= *max) {
            continue;
        }
        let shared = path.join("shared_cpu_list");
        let cpus = read_list(&shared)?;
        best = Some((level, shared, cpus));
    }
    match best {
        Some((_, path, cpus)) => cpus.first().copied().ok_or(NumaError::EmptyList { path }),
        None => Err(NumaError::NoCache { dir: dir.to_path_buf() }),
    }
}

/// The NVIDIA and AMD GPUs under `{root}/bus/pci/devices` (`dir`), ordered by PCI address. A missing
/// directory means no GPU.
fn read_gpus(dir: &Path) -> Result<Vec<Gpu>, NumaError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(NumaError::unreadable(dir, e)),
    };
    let mut gpus = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| NumaError::unreadable(dir, e))?;
        let path = entry.path();
        let (Ok(vendor), Ok(class)) = (fs::read_to_string(path.join("vendor")), fs::read_to_string(path.join("class")))
        else {
            continue;
        };
        let is_gpu_vendor = matches!(vendor.trim(), "0x10de" | "0x1002");
        let class = class.trim();
        if !is_gpu_vendor || !["0x0300", "0x0302", "0x0380", "0x1200"].iter().any(|c| class.starts_with(c)) {
            continue;
        }
        let numa_path = path.join("numa_node");
        let numa_node = read_int(&numa_path)?.max(0);
        let numa_node = u32::try_from(numa_node)
            .map_err(|_| NumaError::NodeTooLarge { path: numa_path.clone(), node: numa_node })?;
        gpus.push(Gpu { pci_address: entry.file_name().to_string_lossy().into_owned(), numa_node });
    }
    gpus.sort_by(|a, b| {
        pci_sort_key(&a.pci_address).cmp(&pci_sort_key(&b.pci_address)).then_with(|| a.pci_address.cmp(&b.pci_address))
    });
    Ok(gpus)
}

/// Orders PCI addresses `domain:bus:device.function` numerically (domains can have more than 4 hex
/// digits); names that are not addresses go last.
fn pci_sort_key(address: &str) -> (bool, [u64; 4]) {
    let parse = || -> Option<[u64; 4]> {
        let (domain, rest) = address.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (device, function) = rest.split_once('.')?;
        let hex = |s: &str| u64::from_str_radix(s, 16).ok();
        Some([hex(domain)?, hex(bus)?, hex(device)?, hex(function)?])
    };
    match parse() {
        Some(key) => (false, key),
        None => (true, [0; 4]),
    }
}

fn read_file(path: &Path) -> Result<String, NumaError> {
    fs::read_to_string(path).map_err(|e| NumaError::unreadable(path, e))
}

fn read_list(path: &Path) -> Result<BTreeSet<u32>, NumaError> {
    parse_cpu_list(&read_file(path)?).map_err(|source| NumaError::BadCpuList { path: path.to_path_buf(), source })
}

fn read_int(path: &Path) -> Result<i64, NumaError> {
    let text = read_file(path)?;
    let found = text.trim();
    found.parse().map_err(|_| NumaError::NotAnInteger { path: path.to_path_buf(), found: found.to_string() })
}

/// `--numa-binding`: every local rank's CPUs, from the node's topology in sysfs
/// (`RLAUNCH_SYSFS`, default `/sys`) and the GPUs the agent may use (`CUDA_VISIBLE_DEVICES`);
/// decided before any worker starts, so a node where the policy cannot apply fails at once.
pub fn rank_cpus(
    mode: NumaMode,
    nproc_per_node: u32,
    agent_env: &BTreeMap<String, String>,
) -> Result<Vec<libc::cpu_set_t>, NumaError> {
    let root = PathBuf::from(agent_env.get("RLAUNCH_SYSFS").map(String::as_str).unwrap_or("/sys"));
    let allowed = allowed_cpus()?;
    let topology = Topology::read(&root, &allowed)?;
    let visible = agent_env.get("CUDA_VISIBLE_DEVICES").map(String::as_str);
    let topology = topology.with_visible_devices(visible)?;
    let mut sets = Vec::new();
    for local_rank in 0..nproc_per_node {
        let cpus = cpus_for(&topology, mode, local_rank as usize)?;
        tracing::info!(local_rank, cpus = %format_cpu_list(&cpus), mode = mode.as_str(), "numa binding");
        sets.push(to_cpu_set(&cpus));
    }
    Ok(sets)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A made-up sysfs tree in a temporary directory.
    struct FakeSys {
        dir: tempfile::TempDir,
    }

    /// A machine with `sockets * nodes_per_socket` NUMA nodes of `cores_per_node` physical cores each,
    /// numbered like Linux does: first threads of all cores are CPUs `0..total_cores`, the second threads (with
    /// `smt`) are `total_cores..2 * total_cores`. Each node has `l3_per_node` L3 caches splitting its cores
    /// evenly and `gpus_per_node` GPUs.
    struct Machine {
        sockets: u32,
        nodes_per_socket: u32,
        cores_per_node: u32,
        smt: bool,
        l3_per_node: u32,
        gpus_per_node: u32,
    }

    /// The machine most tests use: 2 sockets, 4 NUMA nodes, 8 cores per node with 2 threads each
    /// (node n: CPUs 8n..8n+7 and 32+8n..32+8n+7), one L3 per node, 2 GPUs per node.
    const BIG: Machine =
        Machine { sockets: 2, nodes_per_socket: 2, cores_per_node: 8, smt: true, l3_per_node: 1, gpus_per_node: 2 };

    impl FakeSys {
        fn new() -> FakeSys {
            FakeSys { dir: tempfile::tempdir().unwrap() }
        }

        fn root(&self) -> &Path {
            self.dir.path()
        }

        fn write(&self, relative: &str, contents: &str) {
            let path = self.root().join(relative);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, contents).unwrap();
        }

        fn remove(&self, relative: &str) {
            fs::remove_file(self.root().join(relative)).unwrap();
        }

        /// `devices/system/node`: `possible` and one `cpulist` per node.
        fn nodes(&self, cpulists: &[&str]) {
            self.write("devices/system/node/possible", &format!("0-{}\n", cpulists.len() - 1));
            for (node, cpulist) in cpulists.iter().enumerate() {
                self.write(&format!("devices/system/node/node{node}/cpulist"), &format!("{cpulist}\n"));
            }
        }

        /// `devices/system/cpu/cpu{cpu}`: siblings, package and caches given as (type, level, shared list).
        fn cpu(&self, cpu: u32, siblings: &str, package: i64, caches: &[(&str, u32, &str)]) {
            let dir = format!("devices/system/cpu/cpu{cpu}");
            self.write(&format!("{dir}/topology/thread_siblings_list"), &format!("{siblings}\n"));
            self.write(&format!("{dir}/topology/physical_package_id"), &format!("{package}\n"));
            for (index, (kind, level, shared)) in caches.iter().enumerate() {
                self.write(&format!("{dir}/cache/index{index}/type"), &format!("{kind}\n"));
                self.write(&format!("{dir}/cache/index{index}/level"), &format!("{level}\n"));
                self.write(&format!("{dir}/cache/index{index}/shared_cpu_list"), &format!("{shared}\n"));
            }
        }

        fn pci(&self, address: &str, vendor: &str, class: &str, numa_node: i64) {
            let dir = format!("bus/pci/devices/{address}");
            self.write(&format!("{dir}/vendor"), &format!("{vendor}\n"));
            self.write(&format!("{dir}/class"), &format!("{class}\n"));
            self.write(&format!("{dir}/numa_node"), &format!("{numa_node}\n"));
        }

        fn gpu(&self, address: &str, numa_node: i64) {
            self.pci(address, "0x10de", "0x030200", numa_node);
        }

        fn machine(m: &Machine) -> FakeSys {
            let sys = FakeSys::new();
            let nodes = m.sockets * m.nodes_per_socket;
            let total_cores = nodes * m.cores_per_node;
            let threads = |cores: std::ops::Range<u32>| -> BTreeSet<u32> {
                let mut cpus: BTreeSet<u32> = cores.clone().collect();
                if m.smt {
                    cpus.extend(cores.map(|core| core + total_cores));
                }
                cpus
            };
            let cpulists: Vec<String> = (0..nodes)
                .map(|node| format_cpu_list(&threads(node * m.cores_per_node..(node + 1) * m.cores_per_node)))
                .collect();
            sys.nodes(&cpulists.iter().map(String::as_str).collect::<Vec<_>>());
            let cores_per_l3 = m.cores_per_node / m.l3_per_node;
            for core in 0..total_cores {
                let node = core / m.cores_per_node;
                let siblings = format_cpu_list(&threads(core..core + 1));
                let l3_first = node * m.cores_per_node + (core % m.cores_per_node) / cores_per_l3 * cores_per_l3;
                let l3 = format_cpu_list(&threads(l3_first..l3_first + cores_per_l3));
                let caches = [
                    ("Data", 1, &*siblings),
                    ("Instruction", 1, &*siblings),
                    ("Unified", 2, &*siblings),
                    ("Unified", 3, &*l3),
                ];
                for cpu in threads(core..core + 1) {
                    sys.cpu(cpu, &siblings, i64::from(node / m.nodes_per_socket), &caches);
                }
            }
            // Written in reverse, so that the order comes from the addresses, not the directory.
            for gpu in (0..nodes * m.gpus_per_node).rev() {
                sys.gpu(&format!("0000:{:02x}:00.0", 0x10 + 0x10 * gpu), i64::from(gpu / m.gpus_per_node));
            }
            sys
        }

        fn read(&self, allowed: &BTreeSet<u32>) -> Topology {
            Topology::read(self.root(), allowed).unwrap()
        }

        fn read_all(&self) -> Topology {
            self.read(&(0..1024).collect())
        }
    }

    fn cpus(list: &str) -> BTreeSet<u32> {
        parse_cpu_list(list).unwrap()
    }

    /// The CPU list each of a topology's GPUs gets under `mode`.
    fn lists(topology: &Topology, mode: NumaMode) -> Vec<String> {
        (0..topology.gpus().len()).map(|gpu| format_cpu_list(&cpus_for(topology, mode, gpu).unwrap())).collect()
    }

    #[test]
    fn mode_names_parse_exactly() {
        for mode in NumaMode::ALL {
            assert_eq!(mode.to_string().parse::<NumaMode>().unwrap(), mode);
        }
        assert_eq!("core-complex".parse::<NumaMode>().unwrap(), NumaMode::CoreComplex);
        for bad in ["Node", "core_complex", "numa", "", " node"] {
            let error = bad.parse::<NumaMode>().unwrap_err().to_string();
            assert!(error.contains("node, socket, exclusive, core-complex"), "{error}");
        }
    }

    #[test]
    fn node_mode_binds_the_whole_numa_node() {
        let topology = FakeSys::machine(&BIG).read_all();
        assert_eq!(
            lists(&topology, NumaMode::Node),
            [
                "0-7,32-39",
                "0-7,32-39",
                "8-15,40-47",
                "8-15,40-47",
                "16-23,48-55",
                "16-23,48-55",
                "24-31,56-63",
                "24-31,56-63"
            ]
        );
    }

    #[test]
    fn socket_mode_binds_every_node_of_the_socket() {
        let topology = FakeSys::machine(&BIG).read_all();
        let (socket0, socket1) = ("0-15,32-47", "16-31,48-63");
        assert_eq!(
            lists(&topology, NumaMode::Socket),
            [socket0, socket0, socket0, socket0, socket1, socket1, socket1, socket1]
        );
    }

    #[test]
    fn socket_mode_skips_nodes_without_cpus() {
        let sys = FakeSys::new();
        // Node 1 is memory-only (an empty cpulist, like a GPU or CXL memory node); node 2 is possible but absent.
        sys.nodes(&["0-1", "", "2-3"]);
        sys.remove("devices/system/node/node2/cpulist");
        sys.write("devices/system/node/possible", "0-3\n");
        sys.write("devices/system/node/node3/cpulist", "2-3\n");
        for cpu in 0..4 {
            sys.cpu(cpu, &cpu.to_string(), 0, &[("Unified", 2, "0-3")]);
        }
        sys.gpu("0000:01:00.0", 3);
        let topology = sys.read_all();
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Socket, 0).unwrap()), "0-3");
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Node, 0).unwrap()), "2-3");
    }

    #[test]
    fn exclusive_mode_splits_the_node_cores_between_its_gpus() {
        let topology = FakeSys::machine(&BIG).read_all();
        assert_eq!(
            lists(&topology, NumaMode::Exclusive),
            [
                "0-3,32-35",
                "4-7,36-39",
                "8-11,40-43",
                "12-15,44-47",
                "16-19,48-51",
                "20-23,52-55",
                "24-27,56-59",
                "28-31,60-63"
            ]
        );
    }

    #[test]
    fn exclusive_mode_gives_the_remainder_to_the_first_gpus() {
        let m = Machine {
            sockets: 1,
            nodes_per_socket: 1,
            cores_per_node: 8,
            smt: false,
            l3_per_node: 1,
            gpus_per_node: 3,
        };
        assert_eq!(lists(&FakeSys::machine(&m).read_all(), NumaMode::Exclusive), ["0-2", "3-5", "6-7"]);

        let m =
            Machine { sockets: 1, nodes_per_socket: 1, cores_per_node: 5, smt: true, l3_per_node: 1, gpus_per_node: 2 };
        assert_eq!(lists(&FakeSys::machine(&m).read_all(), NumaMode::Exclusive), ["0-2,5-7", "3-4,8-9"]);

        let m = Machine {
            sockets: 1,
            nodes_per_socket: 1,
            cores_per_node: 6,
            smt: false,
            l3_per_node: 1,
            gpus_per_node: 4,
        };
        assert_eq!(lists(&FakeSys::machine(&m).read_all(), NumaMode::Exclusive), ["0-1", "2-3", "4", "5"]);
    }

    #[test]
    fn exclusive_mode_needs_a_core_per_gpu() {
        let m =
            Machine { sockets: 1, nodes_per_socket: 2, cores_per_node: 2, smt: true, l3_per_node: 1, gpus_per_node: 4 };
        let topology = FakeSys::machine(&m).read_all();
        let error = cpus_for(&topology, NumaMode::Exclusive, 5).unwrap_err().to_string();
        assert!(error.contains("NUMA node 1 has only 2 physical cores"), "{error}");
        assert!(error.contains("for its 4 GPUs"), "{error}");
        // The other modes still work there.
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Node, 5).unwrap()), "2-3,6-7");
    }

    #[test]
    fn core_complex_mode_with_one_cache_per_node_gives_the_whole_node() {
        let topology = FakeSys::machine(&BIG).read_all();
        assert_eq!(lists(&topology, NumaMode::CoreComplex), lists(&topology, NumaMode::Node));
    }

    #[test]
    fn core_complex_mode_with_two_caches_per_node_gives_one_each() {
        let topology = FakeSys::machine(&Machine { l3_per_node: 2, ..BIG }).read_all();
        let expected = lists(&topology, NumaMode::Exclusive);
        assert_eq!(lists(&topology, NumaMode::CoreComplex), expected);
        assert_eq!(expected[3], "12-15,44-47");
    }

    #[test]
    fn core_complex_mode_wraps_around_when_gpus_outnumber_caches() {
        let m =
            Machine { sockets: 1, nodes_per_socket: 1, cores_per_node: 8, smt: true, l3_per_node: 2, gpus_per_node: 5 };
        let topology = FakeSys::machine(&m).read_all();
        let (first, second) = ("0-3,8-11", "4-7,12-15");
        assert_eq!(lists(&topology, NumaMode::CoreComplex), [first, second, first, second, first]);
    }

    #[test]
    fn core_complex_mode_prefers_caches_with_more_allowed_cpus() {
        let sys = FakeSys::machine(&Machine { l3_per_node: 2, ..BIG });
        // CPU 9 is not allowed, so node 1's first L3 (8-11,40-43) has 7 CPUs and its second (12-15,44-47) 8.
        let allowed: BTreeSet<u32> = (0..64).filter(|&cpu| cpu != 9).collect();
        let topology = sys.read(&allowed);
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::CoreComplex, 2).unwrap()), "12-15,44-47");
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::CoreComplex, 3).unwrap()), "8,10-11,40-43");
    }

    #[test]
    fn core_complex_mode_uses_the_highest_unified_or_data_cache() {
        let sys = FakeSys::new();
        sys.nodes(&["0-3"]);
        for cpu in 0..4 {
            let core = if cpu % 2 == 0 { "0,2" } else { "1,3" };
            // No L3; an L4 instruction cache (made up) must be ignored, so the L2 of each core decides.
            sys.cpu(cpu, core, 0, &[("Instruction", 4, "0-3"), ("Data", 1, core), ("Unified", 2, core)]);
        }
        sys.gpu("0000:01:00.0", 0);
        sys.gpu("0000:02:00.0", 0);
        assert_eq!(lists(&sys.read_all(), NumaMode::CoreComplex), ["0,2", "1,3"]);
    }

    #[test]
    fn allowed_cpus_restrict_every_mode() {
        let sys = FakeSys::machine(&BIG);
        let topology = sys.read(&cpus("0-3,8-9,40-41"));
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Node, 2).unwrap()), "8-9,40-41");
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Socket, 2).unwrap()), "0-3,8-9,40-41");
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Exclusive, 2).unwrap()), "8,40");
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Exclusive, 3).unwrap()), "9,41");
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Exclusive, 0).unwrap()), "0-1");
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::CoreComplex, 3).unwrap()), "8-9,40-41");
        // Node 2 has no allowed CPU at all.
        for mode in NumaMode::ALL {
            let error = cpus_for(&topology, mode, 4).unwrap_err().to_string();
            assert!(error.contains("NUMA node 2, which has no CPU this process may run on"), "{error}");
        }
    }

    #[test]
    fn numa_node_minus_one_means_node_zero() {
        let sys = FakeSys::new();
        sys.nodes(&["0-3"]);
        for cpu in 0..4 {
            sys.cpu(cpu, &cpu.to_string(), 0, &[("Unified", 3, "0-3")]);
        }
        sys.gpu("0000:3b:00.0", -1);
        let topology = sys.read_all();
        assert_eq!(topology.gpus()[0].numa_node, 0);
        for mode in NumaMode::ALL {
            assert_eq!(format_cpu_list(&cpus_for(&topology, mode, 0).unwrap()), "0-3");
        }
    }

    #[test]
    fn only_nvidia_and_amd_display_controllers_are_gpus() {
        let sys = FakeSys::machine(&BIG);
        sys.pci("0000:00:00.0", "0x8086", "0x060000", -1); // host bridge
        sys.pci("0000:02:00.0", "0x1a03", "0x030000", 0); // BMC VGA
        sys.pci("0000:03:00.0", "0x10de", "0x068000", 0); // NVSwitch
        sys.pci("0000:04:00.0", "0x15b3", "0x020700", 0); // InfiniBand NIC
        sys.pci("0000:05:00.0", "0x1002", "0x040300", 0); // AMD HD audio
        sys.pci("0001:00:00.0", "0x1002", "0x030000", 3); // AMD VGA, second PCI domain: last
        sys.pci("0000:0f:00.0", "0x10de", "0x030000", 1); // NVIDIA VGA: first
        let topology = sys.read_all();
        let addresses: Vec<&str> = topology.gpus().iter().map(|gpu| gpu.pci_address.as_str()).collect();
        assert_eq!(
            addresses,
            [
                "0000:0f:00.0",
                "0000:10:00.0",
                "0000:20:00.0",
                "0000:30:00.0",
                "0000:40:00.0",
                "0000:50:00.0",
                "0000:60:00.0",
                "0000:70:00.0",
                "0000:80:00.0",
                "0001:00:00.0"
            ]
        );
        let nodes: Vec<u32> = topology.gpus().iter().map(|gpu| gpu.numa_node).collect();
        assert_eq!(nodes, [1, 0, 0, 1, 1, 2, 2, 3, 3, 3]);
    }

    #[test]
    fn no_gpu_is_an_error() {
        let sys = FakeSys::machine(&Machine { gpus_per_node: 0, ..BIG });
        let error = cpus_for(&sys.read_all(), NumaMode::Node, 0).unwrap_err().to_string();
        assert!(error.starts_with("--numa-binding needs a GPU: none found under "), "{error}");
        assert!(error.ends_with("bus/pci/devices"), "{error}");

        sys.pci("0000:03:00.0", "0x10de", "0x068000", 0);
        assert!(cpus_for(&sys.read_all(), NumaMode::Node, 0).unwrap_err().to_string().contains("needs a GPU"));

        fs::remove_dir_all(sys.root().join("bus")).unwrap();
        assert!(cpus_for(&sys.read_all(), NumaMode::Node, 0).unwrap_err().to_string().contains("needs a GPU"));
    }

    #[test]
    fn device_index_beyond_the_gpus_is_an_error() {
        let topology = FakeSys::machine(&BIG).read_all();
        let error = cpus_for(&topology, NumaMode::Node, 8).unwrap_err().to_string();
        assert!(error.starts_with("device index 8 but this machine has 8 GPUs under "), "{error}");
    }

    #[test]
    fn gpu_on_an_unlisted_node_is_an_error() {
        let sys = FakeSys::machine(&BIG);
        sys.gpu("0000:f0:00.0", 7);
        let error = cpus_for(&sys.read_all(), NumaMode::Node, 8).unwrap_err().to_string();
        assert!(error.contains("is on NUMA node 7, which"), "{error}");
        assert!(error.ends_with("devices/system/node/possible does not list"), "{error}");

        sys.remove("devices/system/node/node3/cpulist");
        let error = cpus_for(&sys.read_all(), NumaMode::Node, 6).unwrap_err().to_string();
        assert!(error.contains("is on NUMA node 3, but cannot read "), "{error}");
        assert!(error.contains("node3/cpulist"), "{error}");
    }

    #[test]
    fn errors_name_the_sysfs_file() {
        let sys = FakeSys::machine(&BIG);
        sys.remove("devices/system/cpu/cpu8/topology/thread_siblings_list");
        sys.remove("devices/system/cpu/cpu9/topology/physical_package_id");
        sys.write("devices/system/cpu/cpu10/cache/index3/level", "three\n");
        let topology = sys.read_all();
        let error = cpus_for(&topology, NumaMode::Exclusive, 2).unwrap_err().to_string();
        assert!(error.contains("cpu8/topology/thread_siblings_list"), "{error}");
        let error = cpus_for(&topology, NumaMode::CoreComplex, 2).unwrap_err().to_string();
        assert!(error.contains("cpu10/cache/index3/level: expected an integer"), "{error}");
        // Socket mode only reads the package of each node's lowest CPU (8 here), so CPU 9's is not needed.
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Socket, 2).unwrap()), "0-15,32-47");
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Exclusive, 0).unwrap()), "0-3,32-35");

        sys.write("devices/system/node/node1/cpulist", "8-x\n");
        let error = Topology::read(sys.root(), &cpus("0-63")).unwrap_err().to_string();
        assert!(error.contains("node1/cpulist: CPU list"), "{error}");
        sys.write("bus/pci/devices/0000:10:00.0/numa_node", "\n");
        sys.write("devices/system/node/node1/cpulist", "8-15,40-47\n");
        let error = Topology::read(sys.root(), &cpus("0-63")).unwrap_err().to_string();
        assert!(error.contains("0000:10:00.0/numa_node: expected an integer"), "{error}");
        sys.remove("devices/system/node/possible");
        let error = Topology::read(sys.root(), &cpus("0-63")).unwrap_err().to_string();
        assert!(error.starts_with("cannot read ") && error.contains("node/possible"), "{error}");
    }

    #[test]
    fn errors_say_what_kind_of_failure_they_are() {
        let sys = FakeSys::machine(&Machine { gpus_per_node: 0, ..BIG });
        assert!(matches!(cpus_for(&sys.read_all(), NumaMode::Node, 0), Err(NumaError::NoGpu { .. })));
        assert!(matches!("numa".parse::<NumaMode>(), Err(NumaError::BadMode { given }) if given == "numa"));
        sys.remove("devices/system/node/node1/cpulist");
        sys.gpu("0000:10:00.0", 1);
        let error = cpus_for(&sys.read_all(), NumaMode::Node, 0).unwrap_err();
        let NumaError::GpuNodeUnreadable { node: 1, source, .. } = &error else { panic!("{error:?}") };
        assert!(matches!(**source, NumaError::Unreadable { .. }), "{source:?}");
        assert!(std::error::Error::source(&error).is_some());
        sys.write("devices/system/node/possible", "0-x\n");
        let error = Topology::read(sys.root(), &cpus("0-63")).unwrap_err();
        assert!(matches!(error, NumaError::BadCpuList { source: CpuListError::NotANumber { .. }, .. }), "{error:?}");
    }

    #[test]
    fn cpus_beyond_the_cpu_set_are_refused() {
        let sys = FakeSys::new();
        sys.nodes(&["1024-1025"]);
        for cpu in [1024, 1025] {
            sys.cpu(cpu, &cpu.to_string(), 0, &[("Unified", 3, "1024-1025")]);
        }
        sys.gpu("0000:01:00.0", 0);
        let topology = sys.read(&cpus("0-2047"));
        let error = cpus_for(&topology, NumaMode::Node, 0).unwrap_err().to_string();
        assert!(error.contains("CPU 1025"), "{error}");
    }

    #[test]
    fn visible_devices_reorder_and_limit_the_gpus_as_torch_sees_them() {
        let topology = FakeSys::machine(&BIG).read_all();
        let visible = topology.with_visible_devices(Some("3,6")).unwrap();
        assert_eq!(visible.gpus().len(), 2);
        assert_eq!(visible.gpus()[0].pci_address, "0000:40:00.0");
        // GPU 3 is the only visible GPU on node 1, so it gets all of the node's cores.
        assert_eq!(lists(&visible, NumaMode::Exclusive), ["8-15,40-47", "24-31,56-63"]);
        // Through the physical index it shares node 1 with GPU 2.
        let physical = visible_device_index(0, Some("3,6")).unwrap();
        assert_eq!(format_cpu_list(&cpus_for(&topology, NumaMode::Exclusive, physical).unwrap()), "12-15,44-47");

        assert_eq!(
            lists(&topology.with_visible_devices(None).unwrap(), NumaMode::Node),
            lists(&topology, NumaMode::Node)
        );
        let error = topology.with_visible_devices(Some("1,8")).unwrap_err().to_string();
        assert!(error.contains("lists device 8 but this machine has 8 GPUs"), "{error}");
        assert!(topology.with_visible_devices(Some("GPU-1234")).is_err());
    }

    #[test]
    fn visible_device_index_maps_local_ranks() {
        assert_eq!(visible_device_index(0, None).unwrap(), 0);
        assert_eq!(visible_device_index(5, None).unwrap(), 5);
        assert_eq!(visible_device_index(0, Some("4,5,6,7")).unwrap(), 4);
        assert_eq!(visible_device_index(3, Some("4,5,6,7")).unwrap(), 7);
        assert_eq!(visible_device_index(1, Some(" 2, 0 \n")).unwrap(), 0);
    }

    #[test]
    fn visible_device_index_rejects_what_it_cannot_map() {
        let error = visible_device_index(2, Some("0,1")).unwrap_err().to_string();
        assert!(error.contains("local rank 2 has no GPU") && error.contains("lists 2 devices"), "{error}");
        let error = visible_device_index(0, Some("GPU-8f1b2c3d-aaaa-bbbb-cccc-0123456789ab")).unwrap_err().to_string();
        assert!(error.contains("is not a device index"), "{error}");
        assert!(visible_device_index(0, Some("MIG-1234")).is_err());
        assert!(visible_device_index(0, Some("0,-1")).is_err());
        assert!(visible_device_index(0, Some("0,,1")).is_err());
        assert!(visible_device_index(0, Some("+1")).is_err());
        assert!(visible_device_index(0, Some("1,1")).unwrap_err().to_string().contains("twice"));
        assert!(visible_device_index(0, Some("")).unwrap_err().to_string().contains("empty"));
    }

    #[test]
    fn cpu_lists_round_trip() {
        let cases: [(&str, &[u32]); 6] = [
            ("0-2,4,6-7", &[0, 1, 2, 4, 6, 7]),
            ("", &[]),
            ("5", &[5]),
            ("0-1", &[0, 1]),
            ("0,2,4", &[0, 2, 4]),
            ("1-3,8-15,40-47,65535", &[1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 65535]),
        ];
        for (text, values) in cases {
            let set: BTreeSet<u32> = values.iter().copied().collect();
            assert_eq!(parse_cpu_list(text), Ok(set.clone()), "{text}");
            assert_eq!(format_cpu_list(&set), text);
        }
        assert_eq!(parse_cpu_list("0-2,4,6-7\n"), Ok(cpus("0-2,4,6-7")));
        assert_eq!(parse_cpu_list(" 4 , 0-1 ,\n"), Ok(cpus("0-1,4")));
        assert_eq!(parse_cpu_list("3,1-2,2"), Ok(cpus("1-3")));
        assert_eq!(parse_cpu_list("\n"), Ok(BTreeSet::new()));
    }

    #[test]
    fn malformed_cpu_lists_are_errors() {
        for bad in ["a", "1-", "-1", "3-1", "1-2-3", "1.5", "0x3", "+1", "1 2", "65536", "0-4294967295", "99999999999"]
        {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?} parsed");
        }
        assert_eq!(parse_cpu_list("3-1").unwrap_err().to_string(), "CPU list \"3-1\": range \"3-1\" is descending");
    }

    /// The members of a `cpu_set_t`, read from its `Debug` output (the words of its bit array), which keeps
    /// the tests free of `unsafe` (`CPU_ISSET` is an unsafe fn).
    fn cpu_set_members(set: &libc::cpu_set_t) -> BTreeSet<u32> {
        let text = format!("{set:?}");
        let words = text.split(|c: char| !c.is_ascii_digit()).filter(|word| !word.is_empty());
        let word_bits = 8 * std::mem::size_of::<libc::c_ulong>();
        let mut cpus = BTreeSet::new();
        for (i, word) in words.map(|word| word.parse::<u64>().unwrap()).enumerate() {
            cpus.extend((0..word_bits).filter(|&bit| (word >> bit) & 1 == 1).map(|bit| (i * word_bits + bit) as u32));
        }
        cpus
    }

    #[test]
    fn cpu_sets_convert_for_sched_setaffinity() {
        assert_eq!(cpu_set_members(&to_cpu_set(&BTreeSet::new())), BTreeSet::new());
        assert_eq!(cpu_set_members(&to_cpu_set(&cpus("0,3,63-64,1023,1024,5000"))), cpus("0,3,63-64,1023"));
        let allowed = allowed_cpus().unwrap();
        assert_eq!(cpu_set_members(&to_cpu_set(&allowed)), allowed);
    }

    #[test]
    fn allowed_cpus_match_proc_status() {
        let status = fs::read_to_string("/proc/thread-self/status").unwrap();
        let line = status.lines().find_map(|line| line.strip_prefix("Cpus_allowed_list:")).unwrap();
        assert_eq!(allowed_cpus().unwrap(), cpus(line));
    }

    #[test]
    fn real_sysfs_reads() {
        let allowed = allowed_cpus().unwrap();
        let topology = Topology::read(Path::new("/sys"), &allowed).unwrap();
        let node_cpus: BTreeSet<u32> = topology.nodes.values().flatten().flatten().copied().collect();
        assert_eq!(node_cpus, allowed);
        for cpu in topology.cpus.values() {
            assert!(cpu.core.is_ok() && cpu.package.is_ok(), "{cpu:?}");
        }
        if topology.gpus().is_empty() {
            let error = cpus_for(&topology, NumaMode::Node, 0).unwrap_err().to_string();
            assert_eq!(error, "--numa-binding needs a GPU: none found under /sys/bus/pci/devices");
        } else {
            for mode in NumaMode::ALL {
                assert!(cpus_for(&topology, mode, 0).unwrap().is_subset(&allowed));
            }
        }
    }
}

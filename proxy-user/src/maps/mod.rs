//! The BPF object, its pinned maps, and typed access to them. The agent
//! loads the object (adopting maps already pinned under `--bpffs-root`);
//! `dump` and `cleanup` open the pins directly, with the agent stopped or not.

use std::{
    ops::RangeInclusive,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, PerCpuArray, PerCpuHashMap, ProgramArray, lpm_trie::Key},
    programs::SchedClassifier,
};
use ipnet::IpNet;
use proxy_common::*;

mod batch;
mod writer;

pub use writer::{Contents, MapFull, MapWriter, full_map, in_order};

use crate::{
    capacity::{Entries, ServiceMap},
    map_sizes::MapSizes,
    kernel::Features,
    maglev::MaglevParams,
    snat_ports::SnatPorts,
    verifier,
};

/// The compiled datapath, built by aya-build from proxy-ebpf.
pub static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));

/// The TC programs' names in the object.
pub const TC_INGRESS: &str = "tc_ingress";
pub const TC_EGRESS: &str = "tc_egress";
/// The ingress logic in report mode, for `ebpf-proxy trace`; never attached.
pub const TC_TRACE: &str = "tc_trace";
/// Ingress's decisions in XDP, on `--xdp-devices` (see crate::xdp).
pub const XDP_INGRESS: &str = "xdp_ingress";
/// Sends out what xdp_ingress translated; tail-called (see crate::xdp).
pub const XDP_SEND_OUT: &str = "xdp_send_out";

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// A pinned map, and how its entries are counted.
pub struct PinnedMap {
    pub name: &'static str,
    pub fill: Fill,
}

#[derive(Clone, Copy)]
pub enum Fill {
    /// A hash, LRU or LPM map, which fills: counted key by key (a scrape of
    /// a full conntrack costs milliseconds, never the datapath).
    Counted(fn(&Path, &str) -> Result<u64>),
    /// An array (or a program array the loader fills): every slot exists
    /// from the start, and it never fills.
    Slots,
}

/// How the entries of a map of this type are counted.
pub trait Fills {
    const FILL: Fill;
}

impl<K: aya::Pod, V: aya::Pod> Fills for HashMap<MapData, K, V> {
    const FILL: Fill = Fill::Counted(hash_entries::<K, V>);
}

impl<K: aya::Pod, V: aya::Pod> Fills for PerCpuHashMap<MapData, K, V> {
    const FILL: Fill = Fill::Counted(per_cpu_hash_entries::<K, V>);
}

impl<K: aya::Pod, V: aya::Pod> Fills for LpmTrie<MapData, K, V> {
    const FILL: Fill = Fill::Counted(trie_entries::<K, V>);
}

impl<V: aya::Pod> Fills for Array<MapData, V> {
    const FILL: Fill = Fill::Slots;
}

impl<V: aya::Pod> Fills for PerCpuArray<MapData, V> {
    const FILL: Fill = Fill::Slots;
}

impl Fills for ProgramArray<MapData> {
    const FILL: Fill = Fill::Slots;
}

/// The one registry of pinned maps: each map's name and userspace type,
/// written once. It declares `Maps` (the maps the agent, `dump` and the
/// tests use, typed) and `PINNED` (every map the agent pins, which
/// `cleanup`, the metrics and the tests go by); the rest are pinned for the
/// programs' own use (program arrays, masquerade state, ...).
macro_rules! pinned_maps {
    (
        typed { $( $(#[$doc:meta])* $field:ident: $ty:ty = $name:ident, )* }
        programs_only { $( $other:ty = $other_name:ident, )* }
    ) => {
        pub struct Maps {
            $( $(#[$doc])* pub $field: $ty, )*
            /// Each service map's `max_entries`, as created (`ServiceMap` order).
            pub service_capacity: Entries,
        }

        impl Maps {
            /// The typed maps, each from `map(name)`.
            fn gather(mut map: impl FnMut(&str) -> Result<Map>, root: &Path) -> Result<Maps> {
                Ok(Maps {
                    $( $field: map($name)?.try_into().with_context(|| format!("map {}", $name))?, )*
                    service_capacity: service_capacity(root)?,
                })
            }
        }

        /// Every map the agent pins.
        pub const PINNED: &[PinnedMap] = &[
            $( PinnedMap { name: $name, fill: <$ty as Fills>::FILL }, )*
            $( PinnedMap { name: $other_name, fill: <$other as Fills>::FILL }, )*
        ];
    };
}

pinned_maps! {
    typed {
        frontends: HashMap<MapData, FrontendKey, ServiceEntry> = MAP_FRONTENDS,
        slots: HashMap<MapData, SlotKey, u32> = MAP_BACKEND_SLOTS,
        backends: HashMap<MapData, u32, Backend> = MAP_BACKENDS,
        /// Bumped after each backend removal: conntrack entries made before it
        /// check their backend again (see `del_backend`).
        backends_epoch: Array<MapData, u32> = MAP_BACKENDS_EPOCH,
        conntrack: HashMap<MapData, CtKey, CtEntry> = MAP_CONNTRACK,
        /// Flows without a reply yet (see proxy-ebpf's conntrack).
        ct_unconfirmed: HashMap<MapData, CtKey, CtEntry> = MAP_CT_UNCONFIRMED,
        names: HashMap<MapData, u32, ServiceName> = MAP_SERVICE_NAMES,
        counters: PerCpuArray<MapData, u64> = MAP_COUNTERS,
        snat_addrs: HashMap<MapData, u32, Addr> = MAP_SNAT_ADDRS,
        cluster_cidrs: LpmTrie<MapData, CidrData, u8> = MAP_CLUSTER_CIDRS,
        service_cidrs: LpmTrie<MapData, CidrData, u8> = MAP_SERVICE_CIDRS,
        source_ranges: LpmTrie<MapData, SourceRangeData, u8> = MAP_SOURCE_RANGES,
        /// sessionAffinity: the datapath writes it, the reconciler purges it.
        affinity: HashMap<MapData, AffinityKey, AffinityEntry> = MAP_AFFINITY,
        /// Maglev services' tables, each written whole (see `crate::maglev`).
        maglev: HashMap<MapData, u32, MaglevTable> = MAP_MAGLEV,
        /// The seed and table size the programs were loaded with, for `trace`.
        maglev_settings: Array<MapData, u32> = MAP_MAGLEV_SETTINGS,
    }
    programs_only {
        HashMap<MapData, CtKey, SnatEntry> = MAP_SNAT,
        HashMap<MapData, CtKey, SnatEntry> = MAP_SNAT_UNCONFIRMED,
        HashMap<MapData, SockRevKey, FrontendKey> = MAP_SOCK_REVNAT,
        Array<MapData, u32> = MAP_NODE_SNAT,
        Array<MapData, u64> = MAP_HOST_NETNS,
        ProgramArray<MapData> = MAP_IPV6_PROGRAMS,
        ProgramArray<MapData> = MAP_NODE_PROGRAMS,
        ProgramArray<MapData> = MAP_NODE6_PROGRAMS,
        ProgramArray<MapData> = MAP_REJECT_PROGRAMS,
        ProgramArray<MapData> = MAP_ICMP_PROGRAMS,
        ProgramArray<MapData> = MAP_FRAGMENT_PROGRAMS,
        ProgramArray<MapData> = MAP_XDP_PROGRAMS,
        // Written as XDP attaches (`crate::xdp::allow_sending`).
        PerCpuHashMap<MapData, u32, u64> = MAP_XDP_DEVICES,
    }
}

/// Every map the agent pins, by name.
pub const PINNED_MAPS: [&str; PINNED.len()] = {
    let mut names = [""; PINNED.len()];
    let mut i = 0;
    while i < PINNED.len() {
        names[i] = PINNED[i].name;
        i += 1;
    }
    names
};

fn hash_entries<K: aya::Pod, V: aya::Pod>(root: &Path, name: &str) -> Result<u64> {
    let map: HashMap<MapData, K, V> = open_pin(root, name)?.try_into()?;
    Ok(map.keys().filter(|k| k.is_ok()).count() as u64)
}

fn per_cpu_hash_entries<K: aya::Pod, V: aya::Pod>(root: &Path, name: &str) -> Result<u64> {
    let map: PerCpuHashMap<MapData, K, V> = open_pin(root, name)?.try_into()?;
    Ok(map.keys().filter(|k| k.is_ok()).count() as u64)
}

fn trie_entries<K: aya::Pod, V: aya::Pod>(root: &Path, name: &str) -> Result<u64> {
    let map: LpmTrie<MapData, K, V> = open_pin(root, name)?.try_into()?;
    Ok(map.keys().filter(|k| k.is_ok()).count() as u64)
}

/// The programs each TC program hands packets to by tail call, with the
/// program array and slot they go in: the IPv4 programs hand IPv6 frames to
/// their IPv6 counterparts (and egress's IPv6 program hands masqueraded
/// flows on to a third); egress hands node sockets' IPv4 packets to
/// `tc_egress_node` (and on to `tc_egress_node_flow`), ingress their
/// replies to `tc_ingress_node_reply`; the IPv6 programs the same to their
/// `6` counterparts. Either hands a packet to REJECT to `tc_reject(6)`
/// (loaded with ingress, which is always loaded), and ICMP packets to
/// `tc_icmp_error_in(6)` or `tc_icmp_error_out(6)`, and IP fragments to
/// `tc_ingress_fragment(6)` or `tc_egress_fragment(6)`.
const TAIL_CALLED: [(&str, &str, &str, u32); 20] = [
    (TC_INGRESS, "tc_ingress6", MAP_IPV6_PROGRAMS, IPV6_PROG_INGRESS),
    (TC_INGRESS, "tc_ingress_node_reply", MAP_NODE_PROGRAMS, NODE_PROG_INGRESS_REPLY),
    (TC_EGRESS, "tc_egress6", MAP_IPV6_PROGRAMS, IPV6_PROG_EGRESS),
    (TC_EGRESS, "tc_masquerade6", MAP_IPV6_PROGRAMS, IPV6_PROG_MASQUERADE),
    (TC_EGRESS, "tc_egress_node", MAP_NODE_PROGRAMS, NODE_PROG_EGRESS),
    (TC_EGRESS, "tc_egress_node_flow", MAP_NODE_PROGRAMS, NODE_PROG_FLOW),
    (TC_EGRESS, "tc_egress_node6", MAP_NODE6_PROGRAMS, NODE6_PROG_EGRESS),
    (TC_EGRESS, "tc_egress_node_flow6", MAP_NODE6_PROGRAMS, NODE6_PROG_FLOW),
    (TC_INGRESS, "tc_ingress_node_reply6", MAP_NODE6_PROGRAMS, NODE6_PROG_INGRESS_REPLY),
    (TC_INGRESS, "tc_reject", MAP_REJECT_PROGRAMS, REJECT_PROG_V4),
    (TC_INGRESS, "tc_reject6", MAP_REJECT_PROGRAMS, REJECT_PROG_V6),
    (TC_INGRESS, "tc_icmp_error_in", MAP_ICMP_PROGRAMS, ICMP_PROG_INGRESS),
    (TC_INGRESS, "tc_icmp_error_in6", MAP_ICMP_PROGRAMS, ICMP_PROG_INGRESS6),
    (TC_EGRESS, "tc_icmp_error_out", MAP_ICMP_PROGRAMS, ICMP_PROG_EGRESS),
    (TC_EGRESS, "tc_icmp_error_out6", MAP_ICMP_PROGRAMS, ICMP_PROG_EGRESS6),
    (TC_INGRESS, "tc_ingress_fragment", MAP_FRAGMENT_PROGRAMS, FRAGMENT_PROG_INGRESS),
    (TC_INGRESS, "tc_ingress_fragment6", MAP_FRAGMENT_PROGRAMS, FRAGMENT_PROG_INGRESS6),
    (TC_EGRESS, "tc_egress_fragment", MAP_FRAGMENT_PROGRAMS, FRAGMENT_PROG_EGRESS),
    (TC_EGRESS, "tc_egress_fragment6", MAP_FRAGMENT_PROGRAMS, FRAGMENT_PROG_EGRESS6),
    (TC_TRACE, "tc_trace6", MAP_IPV6_PROGRAMS, IPV6_PROG_TRACE),
];

/// The TC program `name` and the programs it tail-calls.
pub fn tc_programs(name: &str) -> impl Iterator<Item = &str> {
    std::iter::once(name).chain(TAIL_CALLED.iter().filter(move |(n, ..)| *n == name).map(|(_, called, ..)| *called))
}

/// Installs the programs `name` tail-calls (verified) in their program arrays.
pub fn install_tail_calls(ebpf: &mut Ebpf, name: &str) -> Result<()> {
    anyhow::ensure!(TAIL_CALLED.iter().any(|(n, ..)| *n == name), "{name}: not a TC program");
    for (_, called, map_name, slot) in TAIL_CALLED.iter().filter(|(n, ..)| *n == name) {
        let prog: &SchedClassifier =
            ebpf.program(called).with_context(|| format!("TC program {called} missing from the BPF object"))?.try_into()?;
        let program = prog.fd()?.try_clone()?;
        let map = ebpf.map_mut(map_name).with_context(|| format!("map {map_name} missing from the BPF object"))?;
        let mut programs: ProgramArray<&mut MapData> = map.try_into()?;
        programs.set(*slot, &program, 0).with_context(|| format!("installing {called} in {map_name}"))?;
    }
    Ok(())
}

/// Loads the TC program `name` (through the verifier) and the programs it
/// tail-calls, which it installs in their program arrays.
pub fn load_tc(ebpf: &mut Ebpf, name: &str) -> Result<()> {
    verifier::verify_all(ebpf, &tc_programs(name).collect::<Vec<_>>())?;
    install_tail_calls(ebpf, name)
}

/// The service maps' `max_entries` as the kernel holds them: this agent's
/// `--service-map-entries`, or the size an earlier agent pinned.
fn service_capacity(root: &Path) -> Result<Entries> {
    let mut capacity = [0; ServiceMap::ALL.len()];
    for map in ServiceMap::ALL {
        let path = root.join(map.name());
        let info = aya::maps::MapInfo::from_pin(&path).with_context(|| format!("{}", path.display()))?;
        capacity[map as usize] = u64::from(info.max_entries());
    }
    Ok(capacity)
}

/// Fails with what to do when `root` is not on a bpffs; creates it only when
/// it is, so a wrong path leaves nothing behind.
pub fn ensure_bpffs(root: &Path) -> Result<()> {
    let existing = root.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
    let st = nix::sys::statfs::statfs(existing).with_context(|| format!("--bpffs-root {}", root.display()))?;
    anyhow::ensure!(
        st.filesystem_type().0 as i64 == BPF_FS_MAGIC,
        "--bpffs-root {}: not on a bpf filesystem (mount one, e.g. `mount -t bpf bpf /sys/fs/bpf`, or point --bpffs-root into one)",
        root.display()
    );
    std::fs::create_dir_all(root).with_context(|| format!("--bpffs-root {}: cannot create", root.display()))
}

/// What went wrong in terms an operator can act on: pinned maps from a build
/// with another layout (an upgrade across a layout change), or permissions.
fn load_error(e: aya::EbpfError, root: &Path) -> anyhow::Error {
    if let aya::EbpfError::MapError(aya::maps::MapError::IncompatiblePinnedMap { name, property, expected, actual }) = &e {
        return anyhow::anyhow!(
            "the maps pinned under {root} come from an ebpf-proxy build with another map layout ({name}: {property} \
             {actual}, this build needs {expected}). Run the version that pinned them, or remove them with \
             `ebpf-proxy cleanup --bpffs-root {root}` and start this one (tracked connections are forgotten)",
            root = root.display()
        );
    }
    let denied = matches!(&e, aya::EbpfError::MapError(aya::maps::MapError::CreateError { io_error, .. })
        if io_error.raw_os_error() == Some(libc::EPERM));
    if let Some(memlock) = memlock_limit().filter(|soft| denied && *soft != libc::RLIM_INFINITY) {
        return anyhow::Error::new(e).context(format!(
            "creating the BPF maps failed: this kernel (before Linux 5.11) charges them to RLIMIT_MEMLOCK, which is \
             {} KiB here and only CAP_SYS_RESOURCE may raise (the DaemonSet grants it); or raise the memlock limit",
            memlock / 1024
        ));
    }
    anyhow::Error::new(e)
        .context("loading the BPF programs failed (is this process allowed to use BPF? CAP_BPF and CAP_NET_ADMIN are needed)")
}

/// The soft RLIMIT_MEMLOCK, in bytes.
fn memlock_limit() -> Option<libc::rlim_t> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    (unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0).then_some(limit.rlim_cur)
}

/// The link layer a copy of the TC programs reads packets for: the object
/// is loaded once for Ethernet devices (and loopback) and, if the node has
/// any, once more for L3 devices, whose packets start at the IP header
/// (see proxy-ebpf's l2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    Ethernet,
    L3,
}

impl LinkKind {
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::Ethernet => "ethernet",
            LinkKind::L3 => "l3",
        }
    }

    fn l2_header_len(self) -> u32 {
        match self {
            LinkKind::Ethernet => 14,
            LinkKind::L3 => 0,
        }
    }
}

/// The program arrays the TC programs tail-call through. Each copy of the
/// programs has its own, so that its tail calls reach programs of its own
/// link kind: the Ethernet copy's are pinned in `--bpffs-root`, the L3
/// copy's in `l3_programs_dir`. Every other map is shared.
pub const PROGRAM_ARRAYS: [&str; 6] = [
    MAP_IPV6_PROGRAMS, MAP_NODE_PROGRAMS, MAP_NODE6_PROGRAMS, MAP_REJECT_PROGRAMS, MAP_ICMP_PROGRAMS,
    MAP_FRAGMENT_PROGRAMS,
];

pub fn l3_programs_dir(root: &Path) -> PathBuf {
    root.join("l3")
}

/// Every map pin an agent may have made under `root`: `PINNED_MAPS`, and
/// the L3 copy's program arrays.
pub fn map_pins(root: &Path) -> impl Iterator<Item = PathBuf> {
    let l3 = l3_programs_dir(root);
    PINNED_MAPS.iter().map(move |name| root.join(name)).chain(PROGRAM_ARRAYS.iter().map(move |name| l3.join(name)))
}

/// What the object is loaded with, besides its link kind.
#[derive(Clone)]
pub struct LoadOptions {
    pub root: PathBuf,
    /// The source ports masquerade may use (see snat_ports).
    pub ports: SnatPorts,
    /// The sized maps' sizes (kept as pinned where they are).
    pub sizes: MapSizes,
    /// The kernel's optional features.
    pub features: Features,
    /// Maglev's seed and table size (globals of the programs).
    pub maglev: MaglevParams,
}

/// Loads the programs; maps already pinned under `root` are reused, so a
/// restart keeps services, backends and conntrack. Maglev's seed and table
/// size are the running agent's (`MAGLEV_SETTINGS`), so that a trace picks
/// the cells the agent's programs pick.
pub fn load(root: &Path) -> Result<(Ebpf, Maps)> {
    let options = LoadOptions {
        root: root.to_path_buf(),
        ports: SnatPorts::default(),
        sizes: MapSizes::default(),
        features: crate::kernel::probe()?,
        maglev: pinned_maglev_settings(root).unwrap_or_default(),
    };
    load_with(&options)
}

/// The seed and table size an agent loaded its programs with, if it
/// pinned them (an agent of a build before Maglev did not).
fn pinned_maglev_settings(root: &Path) -> Option<MaglevParams> {
    let settings: Array<MapData, u32> = open_pin(root, MAP_MAGLEV_SETTINGS).ok()?.try_into().ok()?;
    let seed = settings.get(&MAGLEV_SETTING_SEED, 0).ok()?;
    let size = settings.get(&MAGLEV_SETTING_TABLE_SIZE, 0).ok()?;
    MaglevParams::new(seed, size).ok()
}

/// As `load`, with the given options: the object for Ethernet devices,
/// whose maps the agent takes.
pub fn load_with(options: &LoadOptions) -> Result<(Ebpf, Maps)> {
    let root = options.root.as_path();
    ensure_bpffs(root)?;
    let mut ebpf = load_object(options, LinkKind::Ethernet)?;
    let take = |name: &str| ebpf.take_map(name).with_context(|| format!("map {name} missing from the BPF object"));
    let mut maps = Maps::gather(take, root)?;
    // An agent stopped between a removal and its bump leaves flows that
    // would skip their check: every flow checks its backend once more.
    maps.bump_backends_epoch()?;
    maps.maglev_settings.set(MAGLEV_SETTING_SEED, &options.maglev.seed, 0).context("map MAGLEV_SETTINGS")?;
    maps.maglev_settings.set(MAGLEV_SETTING_TABLE_SIZE, &options.maglev.size, 0).context("map MAGLEV_SETTINGS")?;
    Ok((ebpf, maps))
}

/// The copy of the TC programs for L3 devices, ingress and egress through
/// the verifier: the maps of `load_with`'s, but program arrays of its own.
pub fn load_for_l3_devices(options: &LoadOptions) -> Result<Ebpf> {
    let mut ebpf = load_object(options, LinkKind::L3)?;
    for program in [TC_INGRESS, TC_EGRESS] {
        load_tc(&mut ebpf, program)?;
    }
    Ok(ebpf)
}

fn load_object(options: &LoadOptions, kind: LinkKind) -> Result<Ebpf> {
    let root = options.root.as_path();
    let bounds = |r: &RangeInclusive<u16>| (u32::from(*r.start()), u32::from(*r.end()));
    let (min, max) = bounds(&options.ports.masquerade);
    let (eph_min, eph_max) = bounds(&options.ports.ephemeral);
    let coarse_clock = u32::from(options.features.coarse_clock);
    let set_retval = u32::from(options.features.sock_set_retval);
    let l2_header_len = kind.l2_header_len();
    let MaglevParams { seed: maglev_seed, size: maglev_size } = options.maglev;
    let mut loader = EbpfLoader::new();
    for (name, entries) in options.sizes.adopt_pinned(root) {
        loader.map_max_entries(name, entries);
    }
    if kind == LinkKind::L3 {
        let dir = l3_programs_dir(root);
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        for name in PROGRAM_ARRAYS {
            loader.map_pin_path(name, dir.join(name));
        }
    }
    loader
        .default_map_pin_directory(root)
        .override_global(GLOBAL_SNAT_PORT_MIN, &min, true)
        .override_global(GLOBAL_SNAT_PORT_MAX, &max, true)
        .override_global(GLOBAL_EPHEMERAL_PORT_MIN, &eph_min, true)
        .override_global(GLOBAL_EPHEMERAL_PORT_MAX, &eph_max, true)
        .override_global(GLOBAL_HAS_COARSE_CLOCK, &coarse_clock, true)
        .override_global(GLOBAL_HAS_SET_RETVAL, &set_retval, true)
        .override_global(GLOBAL_L2_HLEN, &l2_header_len, true)
        .override_global(GLOBAL_MAGLEV_SEED, &maglev_seed, true)
        .override_global(GLOBAL_MAGLEV_TABLE_SIZE, &maglev_size, true)
        .load(BPF_OBJECT)
        .map_err(|e| load_error(e, root))
}

/// A pinned map, opened (without holding it).
pub fn open_pin(root: &Path, name: &str) -> Result<Map> {
    let path = root.join(name);
    let data = MapData::from_pin(&path).with_context(|| {
        format!("no pinned map at {} (is --bpffs-root right, and has the agent run on this node?)", path.display())
    })?;
    Ok(Map::from_map_data(data)?)
}

impl Maps {
    /// The pinned maps of an agent, without loading any program.
    pub fn open_pinned(root: &Path) -> Result<Maps> {
        Maps::gather(|name| open_pin(root, name), root)
    }

    /// Everything the service maps hold.
    pub fn read_contents(&self) -> Result<Contents> {
        let mut c = Contents::default();
        for kv in self.frontends.iter() {
            let (k, v) = kv?;
            c.frontends.insert(k, v);
        }
        for kv in self.slots.iter() {
            let (k, v) = kv?;
            c.slots.insert(k, v);
        }
        for kv in self.backends.iter() {
            let (k, v) = kv?;
            c.backends.insert(k, v);
        }
        for kv in self.names.iter() {
            let (k, v) = kv?;
            c.names.insert(k, (v.as_str().to_string(), v.policy));
        }
        // Which services have a table, not the tables (64 KiB each).
        for id in self.maglev.keys() {
            c.maglev.insert(id?, Vec::new());
        }
        for k in self.source_ranges.keys() {
            let k = k?;
            let data = k.data();
            c.source_ranges.insert((data.service_id, prefix_of(&data.addr, k.prefix_len() - 32)));
        }
        for k in self.service_cidrs.keys() {
            let k = k?;
            c.service_cidrs.insert(prefix_of(&k.data().addr, k.prefix_len()));
        }
        Ok(c)
    }

    /// Replaces the node-level settings: SNAT source per interface (ifindex
    /// 0: the default) and the cluster CIDRs (none given: no packet's source
    /// is in-cluster, as kube-proxy without a local-traffic detector). The
    /// service CIDRs are part of the desired state (`MapWriter`).
    pub fn write_node_config(&mut self, snat: &std::collections::BTreeMap<u32, std::net::IpAddr>, cluster: &[IpNet]) -> Result<()> {
        let stale: Vec<u32> = self.snat_addrs.keys().filter_map(|k| k.ok()).filter(|k| !snat.contains_key(k)).collect();
        for (ifindex, ip) in snat {
            self.snat_addrs.insert(ifindex, &Addr::from(*ip), 0)?;
        }
        for k in stale {
            self.snat_addrs.remove(&k)?;
        }
        replace_cidrs(&mut self.cluster_cidrs, cluster)
    }

    /// The next backends epoch (wrapping): see `del_backend`.
    pub fn bump_backends_epoch(&mut self) -> Result<()> {
        let epoch = self.backends_epoch.get(&0, 0).context("reading the backends epoch")?;
        self.backends_epoch.set(0, &epoch.wrapping_add(1), 0).context("bumping the backends epoch")?;
        Ok(())
    }

    /// The conntrack entry under `key`, confirmed or not.
    pub fn conntrack_entry(&self, key: &CtKey) -> Result<CtEntry, MapError> {
        self.conntrack.get(key, 0).or_else(|_| self.ct_unconfirmed.get(key, 0))
    }

    /// Per-CPU counters summed, indexed like `Counter::ALL`.
    pub fn read_counters(&self) -> Result<Vec<u64>> {
        sum_counters(&self.counters)
    }
}

/// The pinned counters of the agent at `root`, summed over CPUs (for a
/// reader that holds no maps, as the metrics scrape).
pub fn pinned_counters(root: &Path) -> Result<Vec<u64>> {
    sum_counters(&open_pin(root, MAP_COUNTERS)?.try_into()?)
}

fn sum_counters(counters: &PerCpuArray<MapData, u64>) -> Result<Vec<u64>> {
    (0..Counter::ALL.len() as u32).map(|i| Ok(counters.get(&i, 0)?.iter().sum())).collect()
}

/// A prefix as the LPM maps hold it: IPv4 IPv4-mapped, so /n is /(96 + n).
fn lpm_prefix(net: &IpNet) -> (u32, Addr) {
    let len = match net {
        IpNet::V4(n) => v4_prefix_len(n.prefix_len() as u32),
        IpNet::V6(n) => n.prefix_len() as u32,
    };
    (len, Addr::from(net.network()))
}

fn prefix_of(addr: &Addr, len: u32) -> IpNet {
    let ip = addr.to_ip();
    let len = if ip.is_ipv4() { len.saturating_sub(96) } else { len };
    IpNet::new(ip, len as u8).unwrap_or_else(|_| IpNet::from(ip))
}

fn replace_cidrs(map: &mut LpmTrie<MapData, CidrData, u8>, want: &[IpNet]) -> Result<()> {
    let want: Vec<(u32, Addr)> = want.iter().map(lpm_prefix).collect();
    let held: Vec<(u32, Addr)> = map.keys().filter_map(|k| k.ok()).map(|k| (k.prefix_len(), k.data().addr)).collect();
    for (len, addr) in &want {
        map.insert(&Key::new(*len, CidrData { addr: *addr }), &1, 0)?;
    }
    for (len, addr) in held.iter().filter(|h| !want.contains(h)) {
        map.remove(&Key::new(*len, CidrData { addr: *addr }))?;
    }
    Ok(())
}

/// Where the agent pins its per-interface TC links.
pub fn links_dir(root: &Path) -> PathBuf {
    root.join("links")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registry is the object's own list: every map the programs pin
    /// by name is in it, and nothing else.
    #[test]
    fn the_registry_lists_every_map_the_object_pins() {
        let object = aya_obj::Object::parse(BPF_OBJECT).expect("the BPF object parses");
        let pinned: std::collections::BTreeSet<&str> = object
            .maps
            .iter()
            .filter(|(_, map)| map.pinning() == aya_obj::maps::PinningType::ByName)
            .map(|(name, _)| name.as_str())
            .collect();
        assert_eq!(pinned, PINNED_MAPS.into_iter().collect());
    }
}

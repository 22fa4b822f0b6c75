//! The BPF object, its pinned maps, and typed access to them. The agent
//! loads the object (adopting maps already pinned under `--bpffs-root`);
//! `dump` and `cleanup` open the pins directly, with the agent stopped or not.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, Map, MapData, PerCpuArray},
};
use proxy_common::*;

use crate::{
    reconciler::{Contents, MapWriter},
    skb_layout,
};

/// The compiled datapath, built by aya-build from proxy-ebpf.
pub static BPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"));

/// The TC program's name in the object.
pub const TC_PROGRAM: &str = "tc_ingress";

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// Every map the agent pins, by name.
pub const PINNED_MAPS: [&str; 6] =
    [MAP_FRONTENDS, MAP_BACKEND_SLOTS, MAP_BACKENDS, MAP_CONNTRACK, MAP_SERVICE_NAMES, MAP_COUNTERS];

pub struct Maps {
    pub frontends: HashMap<MapData, FrontendKey, ServiceEntry>,
    pub slots: HashMap<MapData, SlotKey, u32>,
    pub backends: HashMap<MapData, u32, Backend>,
    pub conntrack: HashMap<MapData, CtKey, CtEntry>,
    pub names: HashMap<MapData, u32, ServiceName>,
    pub counters: PerCpuArray<MapData, u64>,
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

/// Loads the programs; maps already pinned under `root` are reused, so a
/// restart keeps services, backends and conntrack.
pub fn load(root: &Path) -> Result<(Ebpf, Maps)> {
    ensure_bpffs(root)?;
    // Without the layout the SCTP CRC is always updated in software: right
    // for every packet except a locally sent one with CRC offload.
    let layout = skb_layout::ip_summed(Path::new(skb_layout::VMLINUX_BTF))
        .inspect_err(|e| tracing::warn!("SCTP checksum offload cannot be detected, CRCs will always be patched: {e:#}"))
        .ok();
    let mut loader = EbpfLoader::new();
    loader.default_map_pin_directory(root);
    if let Some(l) = &layout {
        loader.override_global(skb_layout::GLOBAL_OFF, &l.byte, true);
        loader.override_global(skb_layout::GLOBAL_SHIFT, &l.shift, true);
    }
    let mut ebpf = loader
        .load(BPF_OBJECT)
        .context("loading the BPF programs failed (is this process allowed to use BPF? CAP_BPF and CAP_NET_ADMIN are needed)")?;
    let mut take = |name: &str| ebpf.take_map(name).with_context(|| format!("map {name} missing from the BPF object"));
    let maps = Maps {
        frontends: take(MAP_FRONTENDS)?.try_into()?,
        slots: take(MAP_BACKEND_SLOTS)?.try_into()?,
        backends: take(MAP_BACKENDS)?.try_into()?,
        conntrack: take(MAP_CONNTRACK)?.try_into()?,
        names: take(MAP_SERVICE_NAMES)?.try_into()?,
        counters: take(MAP_COUNTERS)?.try_into()?,
    };
    Ok((ebpf, maps))
}

fn open_pin(root: &Path, name: &str) -> Result<Map> {
    let path = root.join(name);
    let data = MapData::from_pin(&path).with_context(|| {
        format!("no pinned map at {} (is --bpffs-root right, and has the agent run on this node?)", path.display())
    })?;
    Ok(Map::from_map_data(data)?)
}

impl Maps {
    /// The pinned maps of an agent, without loading any program.
    pub fn open_pinned(root: &Path) -> Result<Maps> {
        Ok(Maps {
            frontends: open_pin(root, MAP_FRONTENDS)?.try_into()?,
            slots: open_pin(root, MAP_BACKEND_SLOTS)?.try_into()?,
            backends: open_pin(root, MAP_BACKENDS)?.try_into()?,
            conntrack: open_pin(root, MAP_CONNTRACK)?.try_into()?,
            names: open_pin(root, MAP_SERVICE_NAMES)?.try_into()?,
            counters: open_pin(root, MAP_COUNTERS)?.try_into()?,
        })
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
            c.names.insert(k, (v.as_str().to_string(), v.scope));
        }
        Ok(c)
    }

    /// Per-CPU counters summed, indexed like `COUNTER_NAMES`.
    pub fn read_counters(&self) -> Result<Vec<u64>> {
        (0..MAX_COUNTERS).map(|i| Ok(self.counters.get(&i, 0)?.iter().sum())).collect()
    }
}

impl MapWriter for Maps {
    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<()> {
        Ok(self.backends.insert(&id, backend, 0)?)
    }
    fn del_backend(&mut self, id: u32) -> Result<()> {
        Ok(self.backends.remove(&id)?)
    }
    fn put_slot(&mut self, key: &SlotKey, backend_id: u32) -> Result<()> {
        Ok(self.slots.insert(key, &backend_id, 0)?)
    }
    fn del_slot(&mut self, key: &SlotKey) -> Result<()> {
        Ok(self.slots.remove(key)?)
    }
    fn put_frontend(&mut self, key: &FrontendKey, entry: &ServiceEntry) -> Result<()> {
        Ok(self.frontends.insert(key, entry, 0)?)
    }
    fn del_frontend(&mut self, key: &FrontendKey) -> Result<()> {
        Ok(self.frontends.remove(key)?)
    }
    fn put_name(&mut self, id: u32, name: &ServiceName) -> Result<()> {
        Ok(self.names.insert(&id, name, 0)?)
    }
    fn del_name(&mut self, id: u32) -> Result<()> {
        Ok(self.names.remove(&id)?)
    }
}

/// Where the agent pins its per-interface TC links.
pub fn links_dir(root: &Path) -> PathBuf {
    root.join("links")
}

//! The maps, pinned by name under the agent's `--bpffs-root` so they outlive
//! the agent and a restart adopts them.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray},
};
use proxy_common::*;

#[map]
pub static FRONTENDS: HashMap<FrontendKey, ServiceEntry> =
    HashMap::pinned(MAX_FRONTENDS, BPF_F_NO_PREALLOC);

#[map]
pub static BACKEND_SLOTS: HashMap<SlotKey, u32> =
    HashMap::pinned(MAX_BACKEND_SLOTS, BPF_F_NO_PREALLOC);

#[map]
pub static BACKENDS: HashMap<u32, Backend> = HashMap::pinned(MAX_BACKENDS, BPF_F_NO_PREALLOC);

#[map]
pub static CONNTRACK: LruHashMap<CtKey, CtEntry> = LruHashMap::pinned(MAX_CONNTRACK, 0);

/// Names for `dump`; the programs never read it.
#[map]
pub static SERVICE_NAMES: HashMap<u32, ServiceName> =
    HashMap::pinned(MAX_SERVICE_NAMES, BPF_F_NO_PREALLOC);

#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::pinned(MAX_COUNTERS, 0);

#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(c) = COUNTERS.get_ptr_mut(counter as u32) {
        // Per-CPU: no other writer, a plain add is enough.
        unsafe { *c += 1 };
    }
}

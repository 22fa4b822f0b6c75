//! Frontend lookup and backend choice: hash and LPM lookups only, so the cost
//! per packet does not grow with the number of services. Every policy was
//! decided by the agent; here the packet's source only picks the scope.

use aya_ebpf::{
    Global,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    maps::lpm_trie::Key,
};
use proxy_common::{
    Addr, AffinityEntry, AffinityKey, Backend, CidrData, CtEntry, CtKey, DEFAULT_MAGLEV_TABLE_SIZE, FrontendKey,
    MAGLEV_TABLE_MAX, SCOPE_EXTERNAL, SCOPE_INTERNAL, SVC_MAGLEV, ServiceEntry, SlotKey, SourceRangeData,
    TRACE_NO_MAGLEV_CELL, cluster_ip_marker, maglev,
};

use crate::maps::{
    AFFINITY, BACKEND_SLOTS, BACKENDS, BACKENDS_EPOCH, CLUSTER_CIDRS, FRONTENDS, MAGLEV, SERVICE_CIDRS, SOURCE_RANGES,
};

/// Set by the agent at load (`--maglev-seed`, `--maglev-table-size`): the
/// same on every node, so every node picks the same cell for a flow.
#[unsafe(no_mangle)]
static MAGLEV_SEED: Global<u32> = Global::new(0);
#[unsafe(no_mangle)]
static MAGLEV_TABLE_SIZE: Global<u32> = Global::new(DEFAULT_MAGLEV_TABLE_SIZE);

const FULL_PREFIX: u32 = 128;

/// What to do with a packet that opens no flow to a backend.
pub enum Miss {
    /// Not a service address: leave it to the kernel.
    NotOurs,
    /// A ClusterIP on a port it does not serve.
    Reject,
    /// An unallocated address in the service CIDR.
    DropUnallocated,
}

/// In-cluster sources (pods, per --cluster-cidr) and the rest see different
/// frontends when a traffic policy or masquerade rule tells them apart.
#[inline(always)]
pub fn scope_of(src: &Addr) -> u8 {
    let key = Key::new(FULL_PREFIX, CidrData { addr: *src });
    if CLUSTER_CIDRS.get(&key).is_some() { SCOPE_INTERNAL } else { SCOPE_EXTERNAL }
}

#[inline(always)]
pub fn lookup_frontend(tuple: &CtKey, scope: u8) -> Result<ServiceEntry, Miss> {
    let key = FrontendKey { addr: tuple.dst, port: tuple.dport, proto: tuple.proto, scope };
    if let Some(service) = unsafe { FRONTENDS.get(&key) } {
        return Ok(*service);
    }
    if is_cluster_ip(&tuple.dst) {
        return Err(Miss::Reject);
    }
    if in_service_cidrs(&tuple.dst) {
        return Err(Miss::DropUnallocated);
    }
    Err(Miss::NotOurs)
}

#[inline(always)]
fn is_cluster_ip(addr: &Addr) -> bool {
    unsafe { FRONTENDS.get(&cluster_ip_marker(*addr)) }.is_some()
}

#[inline(always)]
fn in_service_cidrs(addr: &Addr) -> bool {
    SERVICE_CIDRS.get(&Key::new(FULL_PREFIX, CidrData { addr: *addr })).is_some()
}

/// An address of the service CIDRs that no Service owns: whatever the
/// protocol, kube-proxy drops what is sent there.
#[inline(always)]
pub fn is_unallocated(addr: &Addr) -> bool {
    !is_cluster_ip(addr) && in_service_cidrs(addr)
}

/// loadBalancerSourceRanges, for the frontends the agent flagged.
#[inline(always)]
pub fn source_allowed(service: &ServiceEntry, src: &Addr) -> bool {
    let key = Key::new(32 + FULL_PREFIX, SourceRangeData { service_id: service.service_id, addr: *src });
    SOURCE_RANGES.get(&key).is_some()
}

/// A new flow's backend.
pub struct Choice {
    pub backend_id: u32,
    pub backend: Backend,
    /// It came from the client's affinity entry.
    pub sticky: bool,
    /// The Maglev cell it came from, or TRACE_NO_MAGLEV_CELL.
    pub maglev_cell: u32,
}

/// The client's sticky backend if it is recent and still exists, else the
/// flow's cell of the service's Maglev table (SVC_MAGLEV) or a random slot
/// of its backend set, remembered for affinity unless `remember_choice` is
/// false (a trace must not change state). Existing is enough: the agent
/// deletes every entry whose backend left its service's set, and reuses a
/// freed ID only after that (reconciler.rs, `purge_affinity`). `flow` is
/// the packet's tuple (its source is the affinity client); the socket
/// hooks pass one of their own (sock.rs).
#[inline(always)]
pub fn choose_backend(service: &ServiceEntry, flow: &CtKey, remember_choice: bool) -> Option<Choice> {
    if service.backend_count == 0 {
        return None;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let affinity = AffinityKey { service_id: service.service_id, client: flow.src };
    if service.affinity_timeout_s != 0 {
        if let Some(stuck) = unsafe { AFFINITY.get(&affinity) } {
            let fresh = now.saturating_sub(stuck.last_seen_ns) < service.affinity_timeout_s as u64 * 1_000_000_000;
            if fresh && let Some(backend) = unsafe { BACKENDS.get(&stuck.backend_id) } {
                let found = Choice { backend_id: stuck.backend_id, backend: *backend, sticky: true, maglev_cell: TRACE_NO_MAGLEV_CELL };
                if remember_choice {
                    remember(&affinity, found.backend_id, now);
                }
                return Some(found);
            }
        }
    }
    let (backend_id, maglev_cell) = if service.flags & SVC_MAGLEV != 0 {
        maglev_backend(service, flow)?
    } else {
        let slot = unsafe { bpf_get_prandom_u32() } % service.backend_count;
        (*unsafe { BACKEND_SLOTS.get(&SlotKey { service_id: service.service_id, slot }) }?, TRACE_NO_MAGLEV_CELL)
    };
    let backend = *unsafe { BACKENDS.get(&backend_id) }?;
    if service.affinity_timeout_s != 0 && remember_choice {
        remember(&affinity, backend_id, now);
    }
    Some(Choice { backend_id, backend, sticky: false, maglev_cell })
}

/// Maglev: cell `flow_hash % M` of the service's table, and the backend ID
/// it holds. With ClientIP affinity the source port leaves the hash (as
/// Cilium does), so all of a client's connections share a cell. No loop:
/// one hash, one map lookup, one bounded read.
#[inline(always)]
fn maglev_backend(service: &ServiceEntry, flow: &CtKey) -> Option<(u32, u32)> {
    let sport = if service.affinity_timeout_s != 0 { 0 } else { flow.sport };
    let hash = maglev::flow_hash(flow, sport, MAGLEV_SEED.load());
    let cell = maglev::cell_of(hash, MAGLEV_TABLE_SIZE.load())?;
    // The size is a global the verifier cannot bound: this check is what
    // keeps the read inside the 64 KiB value.
    if cell >= MAGLEV_TABLE_MAX {
        return None;
    }
    let table = MAGLEV.get_ptr(&service.service_id)?;
    let backend_id = *unsafe { (*table).cells.get(cell as usize) }?;
    Some((backend_id, cell))
}

#[inline(always)]
fn remember(key: &AffinityKey, backend_id: u32, now: u64) {
    let _ = AFFINITY.insert(key, &AffinityEntry { backend_id, _pad: 0, last_seen_ns: now }, 0);
}

/// The backends epoch: the agent bumps it after removing a backend, and an
/// ID is reused only after its removal. Read it before looking a backend up,
/// so a removal that races with the lookup leaves a stale epoch behind.
#[inline(always)]
pub fn backends_epoch() -> u32 {
    BACKENDS_EPOCH.get(0).copied().unwrap_or(0)
}

/// A conntrack entry is only as good as its backend: if the agent removed or
/// reused the backend ID, the flow must be balanced again. Checked by a
/// lookup only when a backend was removed since the entry's last check
/// (the epoch moved); `remember` records a passed check in the entry.
#[inline(always)]
pub fn backend_still_matches(ct: &mut CtEntry, remember: bool) -> bool {
    let epoch = backends_epoch();
    if ct.backends_epoch == epoch {
        return true;
    }
    let matches = match unsafe { BACKENDS.get(&ct.backend_id) } {
        Some(b) => b.addr == ct.nat_addr && b.port == ct.nat_port,
        None => false,
    };
    if matches && remember {
        ct.backends_epoch = epoch;
    }
    matches
}

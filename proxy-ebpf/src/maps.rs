//! The maps, pinned by name under the agent's `--bpffs-root` so they outlive
//! the agent and a restart adopts them. (The per-CPU scratch maps a module
//! builds in live with it: `conntrack`, `reject`.)

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray},
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

/// Maglev services' tables (service ID -> backend IDs, see lb::maglev_backend),
/// each written whole by the agent. Not preallocated: only Maglev services
/// take memory (64 KiB each).
#[map]
pub static MAGLEV: HashMap<u32, MaglevTable> = HashMap::pinned(MAX_MAGLEV_TABLES, BPF_F_NO_PREALLOC);

/// The seed and table size the agent loaded the programs with, for `trace`;
/// the programs never read it (they have them as globals, lb.rs).
#[map]
pub static MAGLEV_SETTINGS: Array<u32> = Array::pinned(2, 0);

/// Bumped by the agent after each backend removal (see lb::backend_still_matches).
#[map]
pub static BACKENDS_EPOCH: Array<u32> = Array::pinned(1, 0);

/// Slot 0: see MAP_NODE_SNAT. Pinned, as the node flows it lets egress
/// translate outlive an agent restart.
#[map]
pub static NODE_SNAT: Array<u32> = Array::pinned(1, 0);

/// See MAP_HOST_NETNS. Pinned: the hooks outlive the agent.
#[map]
pub static HOST_NETNS: Array<u64> = Array::pinned(2, 0);

/// Flows that have seen a reply (see `conntrack`). The agent sizes the four
/// conntrack maps at load.
#[map]
pub static CONNTRACK: LruHashMap<CtKey, CtEntry> = LruHashMap::pinned(MAX_CONNTRACK, 0);

/// Flows that have not, yet: a flood of them evicts only its own kind.
#[map]
pub static CT_UNCONFIRMED: LruHashMap<CtKey, CtEntry> = LruHashMap::pinned(MAX_CT_UNCONFIRMED, 0);

/// Masqueraded flows: their tuple after DNAT -> the source they leave with.
/// Confirmed flows' here, the others' in SNAT_UNCONFIRMED.
#[map]
pub static SNAT: LruHashMap<CtKey, SnatEntry> = LruHashMap::pinned(MAX_SNAT, 0);
#[map]
pub static SNAT_UNCONFIRMED: LruHashMap<CtKey, SnatEntry> = LruHashMap::pinned(MAX_CT_UNCONFIRMED, 0);

/// The address a masqueraded flow takes on leaving an interface (by ifindex);
/// ifindex 0 holds the node's primary address, for interfaces without one
/// (pod veths).
#[map]
pub static SNAT_ADDRS: HashMap<u32, Addr> = HashMap::pinned(MAX_SNAT_ADDRS, BPF_F_NO_PREALLOC);

/// --cluster-cidr: sources here are in-cluster (scope INTERNAL). Without the
/// flag the agent stores ::/0, so every source counts as in-cluster.
#[map]
pub static CLUSTER_CIDRS: LpmTrie<CidrData, u8> = LpmTrie::pinned(MAX_CIDRS, 0);

/// --service-cidr: an address here that no Service owns is dropped.
#[map]
pub static SERVICE_CIDRS: LpmTrie<CidrData, u8> = LpmTrie::pinned(MAX_CIDRS, 0);

#[map]
pub static SOURCE_RANGES: LpmTrie<SourceRangeData, u8> = LpmTrie::pinned(MAX_SOURCE_RANGES, 0);

#[map]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityEntry> = LruHashMap::pinned(MAX_AFFINITY, 0);

/// A FIB lookup's parameters, off the stack (see route.rs); per CPU.
#[map]
pub static FIB_SCRATCH: PerCpuArray<aya_ebpf::bindings::bpf_fib_lookup> = PerCpuArray::with_max_entries(1, 0);

/// Node sockets translated at connect()/sendmsg() -> the frontend dialled.
#[map]
pub static SOCK_REVNAT: LruHashMap<SockRevKey, FrontendKey> = LruHashMap::pinned(MAX_SOCK_REVNAT, 0);

/// `tc_trace`'s report; not pinned: each `ebpf-proxy trace` has its own.
#[map]
pub static TRACE_REPORT: Array<TraceReport> = Array::with_max_entries(1, 0);

/// Names for `dump`; the programs never read it.
#[map]
pub static SERVICE_NAMES: HashMap<u32, ServiceName> =
    HashMap::pinned(MAX_SERVICE_NAMES, BPF_F_NO_PREALLOC);

/// The IPv6 programs (`IPV6_PROG_*`), which the IPv4 ones tail-call for an
/// IPv6 frame. Pinned: an unpinned program array is emptied when the agent
/// that filled it exits, and the pinned TC links outlive the agent.
#[map]
pub static IPV6_PROGRAMS: ProgramArray = ProgramArray::pinned(IPV6_PROG_COUNT, 0);

/// `tc_egress_node` (slot NODE_PROG_EGRESS), pinned like IPV6_PROGRAMS.
#[map]
pub static NODE_PROGRAMS: ProgramArray = ProgramArray::pinned(NODE_PROG_COUNT, 0);

/// `tc_icmp_error_in(6)` and `tc_icmp_error_out(6)` (`ICMP_PROG_*`).
#[map]
pub static ICMP_PROGRAMS: ProgramArray = ProgramArray::pinned(ICMP_PROG_COUNT, 0);

/// `tc_ingress_fragment(6)` and `tc_egress_fragment(6)` (`FRAGMENT_PROG_*`).
#[map]
pub static FRAGMENT_PROGRAMS: ProgramArray = ProgramArray::pinned(FRAGMENT_PROG_COUNT, 0);

/// IP datagrams in flight -> the ports of their first fragment (see
/// `fragment`).
#[map]
pub static FRAGMENTS: LruHashMap<FragmentKey, FragmentPorts> = LruHashMap::with_max_entries(MAX_FRAGMENTS, 0);

/// Room to build a FRAGMENTS key off the stack; per CPU.
#[map]
pub static FRAGMENT_KEY: PerCpuArray<FragmentKey> = PerCpuArray::with_max_entries(1, 0);

/// `tc_reject` and `tc_reject6` (`REJECT_PROG_*`).
#[map]
pub static REJECT_PROGRAMS: ProgramArray = ProgramArray::pinned(REJECT_PROG_COUNT, 0);

/// Each source's REJECT budget. Not pinned: a restart gives every source a
/// full bucket, which is what a quiet source has anyway.
#[map]
pub static REJECT_BUDGETS: LruHashMap<Addr, proxy_common::reject_limit::RejectBudget> =
    LruHashMap::with_max_entries(proxy_common::reject_limit::MAX_REJECT_SOURCES, 0);

/// `tc_egress_node6` and `tc_ingress_node_reply6` (`NODE6_PROG_*`).
#[map]
pub static NODE6_PROGRAMS: ProgramArray = ProgramArray::pinned(NODE6_PROG_COUNT, 0);

/// `xdp_send_out` (`XDP_PROG_*`); only XDP programs name it (a program
/// array belongs to one program type).
#[map]
pub static XDP_PROGRAMS: ProgramArray = ProgramArray::pinned(XDP_PROG_COUNT, 0);

/// The interfaces xdp_ingress is on, written by the agent as it attaches:
/// XDP sends frames out of these only (any other, a pod's veth for one,
/// gets them through the stack). Each counts the frames XDP sent out of it.
#[map]
pub static XDP_DEVICES: PerCpuHashMap<u32, u64> = PerCpuHashMap::pinned(MAX_XDP_DEVICES, 0);

#[map]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::pinned(MAX_COUNTERS, 0);

#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(c) = COUNTERS.get_ptr_mut(counter as u32) {
        // Per-CPU: no other writer, a plain add is enough.
        unsafe { *c += 1 };
    }
}

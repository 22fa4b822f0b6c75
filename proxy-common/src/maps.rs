//! Map layouts. Names are the `#[map]` statics in proxy-ebpf; the agent finds
//! the pinned maps under `<bpffs-root>/<NAME>`. Ports are stored in network
//! byte order, as they sit in packets, so the datapath never swaps bytes.

use crate::Addr;

pub const MAP_FRONTENDS: &str = "FRONTENDS";
pub const MAP_BACKEND_SLOTS: &str = "BACKEND_SLOTS";
pub const MAP_BACKENDS: &str = "BACKENDS";
pub const MAP_CONNTRACK: &str = "CONNTRACK";
/// Conntrack entries of flows that have not seen a reply yet (and their
/// masquerade choices, below): a table of their own, so a flood of new
/// flows (spoofed SYNs) only evicts other unanswered flows, never an
/// established one. A flow's first reply moves its entries to CONNTRACK.
pub const MAP_CT_UNCONFIRMED: &str = "CT_UNCONFIRMED";
pub const MAP_SNAT_UNCONFIRMED: &str = "SNAT_UNCONFIRMED";
pub const MAP_SERVICE_NAMES: &str = "SERVICE_NAMES";
pub const MAP_COUNTERS: &str = "COUNTERS";
pub const MAP_SNAT: &str = "SNAT";
pub const MAP_SNAT_ADDRS: &str = "SNAT_ADDRS";
pub const MAP_CLUSTER_CIDRS: &str = "CLUSTER_CIDRS";
pub const MAP_SERVICE_CIDRS: &str = "SERVICE_CIDRS";
pub const MAP_SOURCE_RANGES: &str = "SOURCE_RANGES";
pub const MAP_AFFINITY: &str = "AFFINITY";
pub const MAP_SOCK_REVNAT: &str = "SOCK_REVNAT";
pub const MAP_IPV6_PROGRAMS: &str = "IPV6_PROGRAMS";
/// The ICMP error programs (`ICMP_PROG_*`).
pub const MAP_ICMP_PROGRAMS: &str = "ICMP_PROGRAMS";
/// The IP fragment programs (`FRAGMENT_PROG_*`).
pub const MAP_FRAGMENT_PROGRAMS: &str = "FRAGMENT_PROGRAMS";
/// `xdp_send_out` (`XDP_PROG_SEND_OUT`), which xdp_ingress tail-calls for
/// a frame it translated.
pub const MAP_XDP_PROGRAMS: &str = "XDP_PROGRAMS";
/// The interfaces XDP may send frames out of (those xdp_ingress is on):
/// ifindex -> frames sent out of it by XDP, per CPU.
pub const MAP_XDP_DEVICES: &str = "XDP_DEVICES";
/// One u32 the agent increments after it removes a backend: see
/// `CtEntry::backends_epoch`.
pub const MAP_BACKENDS_EPOCH: &str = "BACKENDS_EPOCH";
/// One u32, non-zero once a masqueraded TCP flow kept a client port inside
/// the node's ephemeral range: from then on a node socket may meet its
/// tuple, and egress looks at node sockets' packets (see `Counter::NodeSnat`).
pub const MAP_NODE_SNAT: &str = "NODE_SNAT";
/// Two u64: slot HOST_NETNS_COOKIE holds the cookie of the agent's network
/// namespace (the node's); the socket hooks translate only sockets there and
/// leave pods' to TC. Slot HOST_NETNS_PROBE holds the socket cookie of the
/// agent's probe socket on kernels without SO_NETNS_COOKIE (before 5.14):
/// connect4 stores that socket's netns cookie in the first slot.
pub const MAP_HOST_NETNS: &str = "HOST_NETNS";
pub const HOST_NETNS_COOKIE: u32 = 0;
pub const HOST_NETNS_PROBE: u32 = 1;

/// Loader-set globals of the BPF object: the source ports masqueraded UDP
/// and SCTP flows may take (host order, inclusive). The agent puts them
/// outside the node's ephemeral port range, so a masqueraded flow and a node
/// socket never share a port towards the same backend.
pub const GLOBAL_SNAT_PORT_MIN: &str = "SNAT_PORT_MIN";
pub const GLOBAL_SNAT_PORT_MAX: &str = "SNAT_PORT_MAX";
/// Loader-set globals, 1 where the running kernel has the helper (see the
/// agent's kernel probes): `bpf_ktime_get_coarse_ns` (Linux 5.11) and, in
/// the socket hooks, `bpf_set_retval` (5.18).
pub const GLOBAL_HAS_COARSE_CLOCK: &str = "HAS_COARSE_CLOCK";
pub const GLOBAL_HAS_SET_RETVAL: &str = "HAS_SET_RETVAL";
/// Loader-set global: the bytes of link-layer header before the IP header,
/// 14 (Ethernet, the default) or 0 in the copy of the TC programs for L3
/// devices (WireGuard, IPIP, GRE, tun).
pub const GLOBAL_L2_HLEN: &str = "L2_HLEN";
/// Above Linux's default ephemeral range (32768-60999).
pub const DEFAULT_SNAT_PORTS: (u16, u16) = (61000, 65535);
/// Loader-set globals: the node's ephemeral ports (`ip_local_port_range`,
/// host order, inclusive, within `TCP_SNAT_PORT_LOW..=65535`). A TCP flow
/// whose client port cannot be kept draws from `TCP_SNAT_PORT_LOW..=65535`
/// outside them.
pub const GLOBAL_EPHEMERAL_PORT_MIN: &str = "EPHEMERAL_PORT_MIN";
pub const GLOBAL_EPHEMERAL_PORT_MAX: &str = "EPHEMERAL_PORT_MAX";
/// Linux's default `ip_local_port_range`.
pub const DEFAULT_EPHEMERAL_PORTS: (u16, u16) = (32768, 60999);
/// The lowest port a masqueraded TCP flow draws (the privileged ports stay
/// out, as netfilter keeps them for sources that had one).
pub const TCP_SNAT_PORT_LOW: u16 = 1024;

/// The service maps' size this build's object declares; the agent sizes
/// them at load (`--service-map-entries`, see proxy-user's `map_sizes`):
/// FRONTENDS, BACKEND_SLOTS and BACKENDS get that many entries,
/// SERVICE_NAMES and SOURCE_RANGES a share of it.
pub const MAX_FRONTENDS: u32 = 1_048_576;
pub const MAX_BACKEND_SLOTS: u32 = MAX_FRONTENDS;
pub const MAX_BACKENDS: u32 = MAX_FRONTENDS;
pub const SERVICE_NAMES_SHARE: u32 = 2;
pub const SOURCE_RANGES_SHARE: u32 = 16;
/// The conntrack size this build's object declares: kube-proxy's
/// `--conntrack-min` default. The agent sizes the conntrack maps at load
/// (`--conntrack-max-per-core`, `--conntrack-min`); see proxy-user's `map_sizes`.
pub const MAX_CONNTRACK: u32 = 131_072;
/// The unconfirmed tables hold this fraction of the conntrack size.
pub const UNCONFIRMED_SHARE: u32 = 4;
pub const MAX_CT_UNCONFIRMED: u32 = MAX_CONNTRACK / UNCONFIRMED_SHARE;
pub const MAX_SERVICE_NAMES: u32 = MAX_FRONTENDS / SERVICE_NAMES_SHARE;
pub const MAX_SNAT: u32 = MAX_CONNTRACK;
pub const MAX_SNAT_ADDRS: u32 = 1024;
/// SNAT_ADDRS key bit for an IPv6 source: `ifindex | SNAT_ADDR_IPV6` holds
/// the interface's IPv6 address, `SNAT_ADDR_IPV6` alone the default.
pub const SNAT_ADDR_IPV6: u32 = 1 << 31;
pub const MAX_CIDRS: u32 = 256;
pub const MAX_SOURCE_RANGES: u32 = MAX_FRONTENDS / SOURCE_RANGES_SHARE;
pub const MAX_AFFINITY: u32 = 65_536;
pub const MAX_SOCK_REVNAT: u32 = 65_536;

/// Set on a packet at ingress when its flow must be masqueraded; the egress
/// program does the SNAT once routing has chosen the interface, and clears it.
/// Not kube-proxy's 0x4000, so leftover kube-proxy rules during a migration
/// cannot masquerade a packet twice.
pub const MASQUERADE_MARK: u32 = 0x0020_0000;
/// Set at ingress on a reply whose source must become the service frontend
/// again; the egress program rewrites it. Done after routing, as netfilter
/// does (POSTROUTING), because the frontend may be a node address (NodePort,
/// an ExternalIP on the node) and a packet arriving with a local source
/// address is dropped by the kernel as martian.
pub const REVERSE_NAT_MARK: u32 = 0x0040_0000;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;

/// Which clients a frontend entry answers. The model decides the backend set
/// per scope (traffic policies); the datapath only classifies the source.
pub const SCOPE_INTERNAL: u8 = 0;
pub const SCOPE_EXTERNAL: u8 = 1;

/// Which endpoints a backend set holds (kube-proxy's cluster and local
/// policy chains): every usable one, or only this node's.
pub const POLICY_CLUSTER: u8 = 0;
pub const POLICY_LOCAL: u8 = 1;

/// A service frontend: the destination a client dials.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct FrontendKey {
    pub addr: Addr,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
}

/// Frontend kinds, kept in `ServiceEntry::kind` for `dump`.
pub const KIND_CLUSTER_IP: u8 = 0;
pub const KIND_NODE_PORT: u8 = 1;
pub const KIND_EXTERNAL_IP: u8 = 2;
pub const KIND_LOAD_BALANCER: u8 = 3;

/// `ServiceEntry::flags`: decisions the model made for this frontend and scope.
/// New flows are masqueraded (externalTrafficPolicy=Cluster, a ClusterIP
/// reached from outside the cluster CIDR, --masquerade-all).
pub const SVC_MASQUERADE: u8 = 1 << 0;
/// Only sources in `SOURCE_RANGES` under this service ID may open flows.
pub const SVC_SOURCE_RANGES: u8 = 1 << 1;
/// No backend here but the service has endpoints elsewhere (a Local traffic
/// policy with no local endpoint): kube-proxy drops rather than rejects.
pub const SVC_DROP_IF_EMPTY: u8 = 1 << 2;
/// New flows pick their backend from the service's Maglev table (`MAGLEV`,
/// by a hash of the 5-tuple) rather than a random slot.
pub const SVC_MAGLEV: u8 = 1 << 3;

/// A frontend key with port 0 and protocol 0 marks an address as a ClusterIP
/// in use: packets to a port it does not serve are rejected.
pub const fn cluster_ip_marker(addr: Addr) -> FrontendKey {
    FrontendKey { addr, port: 0, proto: 0, scope: SCOPE_INTERNAL }
}

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct ServiceEntry {
    /// Identifies the backend set in `BACKEND_SLOTS` and the name in `SERVICE_NAMES`.
    pub service_id: u32,
    /// Slots 0..backend_count are filled; 0 means no usable endpoint.
    pub backend_count: u32,
    pub kind: u8,
    /// SVC_* flags.
    pub flags: u8,
    pub _pad: u16,
    /// sessionAffinity ClientIP: seconds a client sticks to its backend; 0 = none.
    pub affinity_timeout_s: u32,
}

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct SlotKey {
    pub service_id: u32,
    pub slot: u32,
}

pub const BACKEND_READY: u8 = 1 << 0;
pub const BACKEND_SERVING: u8 = 1 << 1;
pub const BACKEND_TERMINATING: u8 = 1 << 2;
pub const BACKEND_LOCAL: u8 = 1 << 3;
/// Every BACKEND_* flag is one of the low BACKEND_FLAG_BITS bits.
pub const BACKEND_FLAG_BITS: usize = 4;
const _: () = assert!((BACKEND_READY | BACKEND_SERVING | BACKEND_TERMINATING | BACKEND_LOCAL) >> BACKEND_FLAG_BITS == 0);

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct Backend {
    pub addr: Addr,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

/// A packet's tuple as it arrived. Conntrack holds two entries per flow: the
/// original direction (client -> frontend) and the reply direction
/// (backend -> client), so either packet finds its translation in one lookup.
/// Aligned to 4 (the size is unchanged) so Maglev's flow hash reads the
/// addresses a word at a time (`maglev::flow_hash`).
#[repr(C, align(4))]
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct CtKey {
    pub src: Addr,
    pub dst: Addr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// `CtEntry::direction`
pub const CT_ORIGINAL: u8 = 0;
pub const CT_REPLY: u8 = 1;

/// `CtEntry::flags`: the flow is masqueraded. On an ORIGINAL entry: mark each
/// packet for SNAT at egress. On a REPLY entry keyed by the SNAT address and
/// port: also send the reply back to `rev_addr:rev_port`, the real client.
pub const CT_MASQUERADE: u8 = 1 << 0;
/// A FIN or RST went through this direction (on a masqueraded flow's SNAT
/// reply entry: through either): once idle for `CT_CLOSING_TIMEOUT_NS` the
/// entry counts as gone, so a later flow that reuses the tuple starts afresh;
/// a masqueraded flow's SNAT tuple stays reserved longer, see
/// `CT_SNAT_TIME_WAIT_NS`.
pub const CT_CLOSING: u8 = 1 << 1;
/// The client is a socket of the node whose packet the socket hooks never
/// saw (a raw socket, a process outside `--cgroup-root`, SCTP), translated
/// at TC egress. Its replies are delivered locally, with no egress after
/// ingress: ingress rewrites their source back to the frontend too.
pub const CT_NODE: u8 = 1 << 2;
/// A `CT_NODE` flow met at loopback's egress: its frontend is one of the
/// node's own addresses (a NodePort on the node's IP). Its replies, whose
/// source becomes that address again, go back in through loopback: Linux
/// drops a packet from one of its own addresses arriving on any other
/// interface (a martian source).
pub const CT_LOOPBACK: u8 = 1 << 3;
/// Pending confirmation: the entry lives in CT_UNCONFIRMED.
/// Such an entry counts as gone once idle for `CT_UNCONFIRMED_TIMEOUT_NS`,
/// which also frees its masquerade port.
pub const CT_PENDING: u8 = 1 << 4;
/// The flow is confirmed by its first reply: UDP and SCTP flows, and the
/// node's own (whose opening no outside spoofer can send). Other TCP flows
/// are confirmed by the client's ACK of the backend's SYN-ACK, or by a
/// plain ACK from the backend (sent only once the handshake completed), as
/// netfilter marks a connection ASSURED only then: a backend answering a
/// flood of spoofed SYNs does not confirm them.
pub const CT_CONFIRM_ON_REPLY: u8 = 1 << 5;
/// As netfilter's UDP timeout for a flow without replies (30 s); a TCP
/// client's SYN retransmissions (1, 2, 4, ... s apart) keep theirs alive
/// until the 32 s gap, after which a SYN starts the flow afresh.
pub const CT_UNCONFIRMED_TIMEOUT_NS: u64 = 30_000_000_000;
/// Loopback's interface index, the same in every network namespace.
pub const LOOPBACK_IFINDEX: u32 = 1;
pub const CT_CLOSING_TIMEOUT_NS: u64 = 10_000_000_000;
/// A closed masqueraded TCP flow's SNAT tuple (node address and port,
/// backend) goes to no other client for this long after its last packet:
/// the backend, if it closed first, holds the tuple in TIME_WAIT (60 s on
/// Linux) and answers another client's SYN there with a bare ACK unless its
/// sequence number happens to be newer: a one-second connect stall. As
/// netfilter's TIME_WAIT timeout. The same client reopening the same
/// connection may take it (its sequence numbers and timestamps grow).
pub const CT_SNAT_TIME_WAIT_NS: u64 = 120_000_000_000;

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct CtEntry {
    /// ORIGINAL: rewrite the destination to `nat_addr:nat_port` (the backend).
    /// REPLY: rewrite the source to `nat_addr:nat_port` (the frontend).
    pub nat_addr: Addr,
    /// REPLY of a masqueraded flow: rewrite the destination to this (the client).
    /// ORIGINAL of a masqueraded flow: the source egress chose for it (also
    /// in SNAT_*, by the tuple after DNAT), so XDP, which finds this entry
    /// anyway, sends the flow out without looking the choice up; port 0:
    /// not chosen yet.
    pub rev_addr: Addr,
    pub nat_port: u16,
    pub rev_port: u16,
    pub direction: u8,
    pub flags: u8,
    pub _pad: u16,
    pub service_id: u32,
    /// The backend chosen; an ORIGINAL entry whose backend is gone is re-balanced.
    pub backend_id: u32,
    /// The backends epoch (MAP_BACKENDS_EPOCH) when `backend_id` was last
    /// seen to name `nat_addr:nat_port`. While the epoch is unchanged no
    /// backend was removed since, so a packet need not look the backend up.
    pub backends_epoch: u32,
    /// ORIGINAL of an unconfirmed TCP flow: the acknowledgement number
    /// (network order) that completes its handshake, the backend's SYN-ACK
    /// sequence number + 1; 0 before the SYN-ACK. A client that sends it
    /// has seen the SYN-ACK: no blind spoofer can confirm a flow.
    pub handshake_ack: u32,
    /// bpf_ktime_get_ns() at creation and at the last packet.
    pub created_ns: u64,
    pub last_seen_ns: u64,
}

/// The source a masqueraded flow leaves with, keyed by the flow's tuple after
/// DNAT (client -> backend), as the egress program sees it.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct SnatEntry {
    pub addr: Addr,
    /// Network byte order.
    pub port: u16,
    pub _pad: [u8; 6],
}

/// An address or prefix in an LPM trie (IPv4 as IPv4-mapped: /n is 96 + n).
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct CidrData {
    pub addr: Addr,
}

/// loadBalancerSourceRanges: service ID (always matched in full) then prefix.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct SourceRangeData {
    pub service_id: u32,
    pub addr: Addr,
}

/// LPM prefix length of an IPv4 /n stored IPv4-mapped.
pub const fn v4_prefix_len(n: u32) -> u32 {
    96 + n
}

/// A node socket translated at connect()/sendmsg(): which frontend the
/// backend it talks to stands for (for getpeername()/recvmsg()).
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct SockRevKey {
    pub cookie: u64,
    pub addr: Addr,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub _pad: [u8; 5],
}

/// sessionAffinity ClientIP: which backend a client of a service stuck to.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct AffinityKey {
    pub service_id: u32,
    pub client: Addr,
}

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct AffinityEntry {
    pub backend_id: u32,
    pub _pad: u32,
    pub last_seen_ns: u64,
}

pub const SERVICE_NAME_LEN: usize = 248;

/// `namespace/name:port-name`, for people: the datapath never reads it.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct ServiceName {
    pub len: u32,
    /// POLICY_CLUSTER or POLICY_LOCAL: which endpoints the set holds.
    pub policy: u8,
    pub _pad: [u8; 3],
    pub bytes: [u8; SERVICE_NAME_LEN],
}

impl ServiceName {
    /// Longer names are cut at a character boundary.
    pub fn new(name: &str, policy: u8) -> Self {
        let mut end = name.len().min(SERVICE_NAME_LEN);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let mut bytes = [0u8; SERVICE_NAME_LEN];
        bytes[..end].copy_from_slice(&name.as_bytes()[..end]);
        ServiceName { len: end as u32, policy, _pad: [0; 3], bytes }
    }

    pub fn as_str(&self) -> &str {
        let len = (self.len as usize).min(SERVICE_NAME_LEN);
        core::str::from_utf8(&self.bytes[..len]).unwrap_or("<invalid name>")
    }
}

/// What `tc_trace` reports (into its own, unpinned `TRACE_REPORT` map).
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct TraceReport {
    /// Every counter the packet would have moved: bit n = counter n.
    pub counters: u32,
    /// The service and backend it reached (0: none).
    pub service_id: u32,
    pub backend_id: u32,
    /// The source scope (SCOPE_*), or TRACE_FROM_CONNTRACK for a tracked flow.
    pub how: u32,
    /// The Maglev table cell the backend came from, or TRACE_NO_MAGLEV_CELL.
    pub maglev_cell: u32,
}

/// What xdp_ingress leaves in a frame's metadata for TC ingress: this
/// magic, then the skb marks TC is to set, with XDP_HANDOFF_TRANSLATED if
/// XDP translated the frame (two native-endian u32s); then, for
/// xdp_send_out, the masquerade source the flow's conntrack entry holds
/// (IPv4 address, port in network order, 2 bytes of padding; port 0: none).
pub const XDP_HANDOFF_MAGIC: u32 = 0xeb9f_0a0d;
pub const XDP_HANDOFF_TRANSLATED: u32 = 1 << 31;
pub const XDP_HANDOFF_LEN: usize = 16;

pub const XDP_PROG_SEND_OUT: u32 = 0;
pub const XDP_PROG_COUNT: u32 = 1;
/// Interfaces in XDP_DEVICES.
pub const MAX_XDP_DEVICES: u32 = 256;

pub const TRACE_FROM_CONNTRACK: u32 = 0x100;
pub const TRACE_NO_MAGLEV_CELL: u32 = u32::MAX;
pub const MAP_TRACE_REPORT: &str = "TRACE_REPORT";

/// Slots of the IPv6 program array: which IPv6 program each IPv4 program
/// hands IPv6 frames to (the loader fills it with `<name>6`).
pub const IPV6_PROG_INGRESS: u32 = 0;
pub const IPV6_PROG_EGRESS: u32 = 1;
pub const IPV6_PROG_TRACE: u32 = 2;
/// tc_egress6 hands masqueraded flows to tc_masquerade6.
pub const IPV6_PROG_MASQUERADE: u32 = 3;
pub const IPV6_PROG_COUNT: u32 = 4;

/// The programs that handle the node's own flows translated at egress, by
/// tail call, each with a stack of its own (inline, they would pass what
/// older verifiers allow): `tc_egress` hands a node socket's IPv4 packets
/// to `tc_egress_node`, which hands those to no frontend on to
/// `tc_egress_node_flow`; `tc_ingress` hands their replies to
/// `tc_ingress_node_reply`.
pub const MAP_NODE_PROGRAMS: &str = "NODE_PROGRAMS";
pub const NODE_PROG_EGRESS: u32 = 0;
pub const NODE_PROG_INGRESS_REPLY: u32 = 1;
pub const NODE_PROG_FLOW: u32 = 2;
pub const NODE_PROG_COUNT: u32 = 3;

/// The same for IPv6: `tc_egress6` hands a node socket's IPv6 packets to
/// `tc_egress_node6` (and on to `tc_egress_node_flow6`), `tc_ingress6`
/// their replies to `tc_ingress_node_reply6`. A map of its own, so the agent that pinned
/// NODE_PROGRAMS with three slots can be upgraded in place.
pub const MAP_NODE6_PROGRAMS: &str = "NODE6_PROGRAMS";
pub const NODE6_PROG_EGRESS: u32 = 0;
pub const NODE6_PROG_INGRESS_REPLY: u32 = 1;
pub const NODE6_PROG_FLOW: u32 = 2;
pub const NODE6_PROG_COUNT: u32 = 3;

/// The REJECT programs, tail-called with the packet to reject (each with a
/// stack of its own; `skb->cb[0]` says whether it is a node socket's packet
/// met at egress, which goes back into the node's own stack).
pub const MAP_REJECT_PROGRAMS: &str = "REJECT_PROGRAMS";
pub const REJECT_PROG_V4: u32 = 0;
pub const REJECT_PROG_V6: u32 = 1;
pub const REJECT_PROG_COUNT: u32 = 2;

/// The programs that translate ICMP errors about translated flows, tail-
/// called by ingress and egress for an ICMP packet (each with a stack of
/// its own: ingress is at the older verifiers' limit).
pub const ICMP_PROG_INGRESS: u32 = 0;
pub const ICMP_PROG_INGRESS6: u32 = 1;
pub const ICMP_PROG_EGRESS: u32 = 2;
pub const ICMP_PROG_EGRESS6: u32 = 3;
pub const ICMP_PROG_COUNT: u32 = 4;

/// The programs that follow a UDP datagram's later fragments by its first
/// fragment's ports, tail-called by ingress and egress (and IPv6
/// masquerade) when their parse meets one: small programs of their own, so
/// packets that are not fragments pay nothing.
pub const FRAGMENT_PROG_INGRESS: u32 = 0;
pub const FRAGMENT_PROG_INGRESS6: u32 = 1;
pub const FRAGMENT_PROG_EGRESS: u32 = 2;
pub const FRAGMENT_PROG_EGRESS6: u32 = 3;
pub const FRAGMENT_PROG_COUNT: u32 = 4;

/// An IP datagram as its fragments share it: addresses, protocol and IP ID
/// (IPv4's 16 bits, or the IPv6 Fragment header's 32).
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct FragmentKey {
    pub src: Addr,
    pub dst: Addr,
    pub id: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// The ports a datagram's first fragment carried (network order).
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct FragmentPorts {
    pub sport: u16,
    pub dport: u16,
}

/// Datagrams in flight whose first fragment was seen: an LRU, not pinned
/// (a datagram's fragments pass within milliseconds; after a restart only
/// those in flight are lost).
pub const MAX_FRAGMENTS: u32 = 8192;

/// Slots of the pinned `COUNTERS` array: room to add counters without
/// changing the map's layout (which an upgrade could not reuse). At most 32:
/// a trace reports the counters it noted as bits of a u32.
pub const MAX_COUNTERS: u32 = 32;

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all are #[repr(C)] plain data with explicit padding fields.
    unsafe impl aya::Pod for FrontendKey {}
    unsafe impl aya::Pod for ServiceEntry {}
    unsafe impl aya::Pod for SlotKey {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtEntry {}
    unsafe impl aya::Pod for ServiceName {}
    unsafe impl aya::Pod for Addr {}
    unsafe impl aya::Pod for TraceReport {}
    unsafe impl aya::Pod for crate::MaglevTable {}
    unsafe impl aya::Pod for SockRevKey {}
    unsafe impl aya::Pod for SnatEntry {}
    unsafe impl aya::Pod for CidrData {}
    unsafe impl aya::Pod for SourceRangeData {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityEntry {}
    unsafe impl aya::Pod for crate::unit::UnitSetup {}
    unsafe impl aya::Pod for crate::unit::UnitReport {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_hidden_padding() {
        // The kernel hashes keys byte for byte: implicit padding would make equal
        // keys differ. These sizes are the sum of the fields.
        assert_eq!(size_of::<FrontendKey>(), 20);
        assert_eq!(size_of::<ServiceEntry>(), 16);
        assert_eq!(size_of::<SlotKey>(), 8);
        assert_eq!(size_of::<Backend>(), 20);
        assert_eq!(size_of::<CtKey>(), 40);
        assert_eq!(size_of::<FragmentKey>(), 40);
        assert_eq!(size_of::<FragmentPorts>(), 4);
        assert_eq!(size_of::<CtEntry>(), 72);
        assert_eq!(size_of::<SnatEntry>(), 24);
        assert_eq!(size_of::<CidrData>(), 16);
        assert_eq!(size_of::<SourceRangeData>(), 20);
        assert_eq!(size_of::<AffinityKey>(), 20);
        assert_eq!(size_of::<AffinityEntry>(), 16);
        assert_eq!(size_of::<SockRevKey>(), 32);
        assert_eq!(size_of::<ServiceName>(), 8 + SERVICE_NAME_LEN);
    }

    #[test]
    fn service_name_cuts_at_char_boundary() {
        let long = "é".repeat(200);
        let n = ServiceName::new(&long, POLICY_CLUSTER);
        assert!(n.as_str().len() <= SERVICE_NAME_LEN);
        assert!(n.as_str().chars().all(|c| c == 'é'));
        assert_eq!(ServiceName::new("default/web:http", 0).as_str(), "default/web:http");
    }
}

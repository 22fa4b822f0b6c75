//! The datapath's packet counters: one table gives each its slot in the
//! pinned `COUNTERS` array, its metric name and the verdict it stands for,
//! so the programs, the metrics, `trace` and the tests cannot disagree.

/// What happened to a counted packet (`ebpf_proxy_packets_total{verdict}`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Passed,
    Translated,
    Dropped,
    Rejected,
}

impl Verdict {
    pub const fn name(self) -> &'static str {
        match self {
            Verdict::Passed => "passed",
            Verdict::Translated => "translated",
            Verdict::Dropped => "dropped",
            Verdict::Rejected => "rejected",
        }
    }
}

macro_rules! counters {
    ($($(#[$doc:meta])* $variant:ident = $index:literal, $name:literal, $verdict:expr;)*) => {
        /// Indexes into the per-CPU `COUNTERS` array.
        #[repr(u32)]
        #[derive(Copy, Clone, Debug, PartialEq, Eq)]
        pub enum Counter {
            $($(#[$doc])* $variant = $index,)*
        }

        impl Counter {
            /// Every counter, in slot order (`ALL[i] as usize == i`).
            pub const ALL: &'static [Counter] = &[$(Counter::$variant),*];

            /// The reason label of `ebpf_proxy_packets_total`, and the name
            /// `trace` and the tests print.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Counter::$variant => $name,)*
                }
            }

            /// The packet's verdict, or None for a counter that is not one
            /// (conntrack's and the fragments' bookkeeping, shown apart).
            pub const fn verdict(self) -> Option<Verdict> {
                #[allow(unused_imports)]
                use Verdict::*;
                match self {
                    $(Counter::$variant => $verdict,)*
                }
            }
        }
    };
}

counters! {
    /// Not for a service, passed untouched.
    Passed = 0, "passed", Some(Passed);
    /// First packet of a flow to a service: backend chosen, translated.
    NewFlow = 1, "new_flow", Some(Translated);
    /// Packet of a known flow, translated.
    Established = 2, "established", Some(Translated);
    /// Reply from a backend, reverse-translated.
    Reply = 3, "reply", Some(Translated);
    /// Service with no usable backend.
    NoBackend = 4, "no_backend", Some(Dropped);
    /// Conntrack insert failed (map full beyond LRU eviction).
    CtFull = 5, "ct_full", Some(Dropped);
    /// Truncated or malformed headers: passed untouched.
    Malformed = 6, "malformed", Some(Passed);
    /// An IP fragment that does not follow its datagram: a TCP or SCTP one
    /// (both size their packets to the path MTU), or a later one whose first
    /// was not seen (it came late, or went another way) or made no flow.
    /// Passed untouched.
    Fragment = 7, "fragment", Some(Passed);
    /// A known flow whose backend vanished, re-balanced.
    Rebalanced = 8, "rebalanced", Some(Translated);
    /// A checksum/store helper failed: dropped rather than sent corrupt.
    RewriteFailed = 9, "rewrite_failed", Some(Dropped);
    /// Rejected (ICMP port unreachable): no endpoint, or a ClusterIP port not served.
    Rejected = 10, "rejected", Some(Rejected);
    /// Dropped: an unallocated address in the service CIDR.
    DropUnallocated = 11, "drop_unallocated", Some(Dropped);
    /// Dropped: source outside loadBalancerSourceRanges.
    DropSourceRange = 12, "drop_source_range", Some(Dropped);
    /// Dropped: Local traffic policy with no local endpoint.
    DropNoLocal = 13, "drop_no_local", Some(Dropped);
    /// New flow masqueraded (SNAT to a node address at egress).
    Masqueraded = 14, "masqueraded", Some(Translated);
    /// Egress could not rewrite a marked packet's source (no SNAT address or
    /// port free, or the flow's conntrack entry vanished): sent as it was.
    SnatFailed = 15, "snat_failed", Some(Translated);
    /// New flow sent to the backend its client sticks to (sessionAffinity).
    AffinityHit = 16, "affinity_hit", Some(Translated);
    /// A reject could not be built: the packet was dropped instead.
    RejectFailed = 17, "reject_failed", Some(Dropped);
    /// IPv6 packet with extension headers before its L4 header: passed untouched.
    ExtensionHeader = 18, "extension_header", Some(Passed);
    /// Masquerade found no free port: it kept the client's port, for TCP a
    /// tuple still reserved for another client's closed flow (the backend
    /// may hold it in TIME_WAIT: that connect may stall a second), for UDP
    /// and SCTP one inside the node's ephemeral range (a node socket may
    /// take it too).
    SnatPortShared = 19, "snat_port_shared", Some(Translated);
    /// A node socket's new TCP connection met the tuple of a masqueraded
    /// flow (or of one closed less than CT_SNAT_TIME_WAIT_NS ago) towards
    /// the same backend: it leaves with a port of its own, as Linux NAT
    /// remaps a local connection whose tuple is taken.
    NodeSnat = 20, "node_snat", Some(Translated);
    /// A TCP RST that would have been REJECTed: dropped unanswered. A reset
    /// is never answered with a reset (netfilter's REJECT neither), or two
    /// nodes' unserved ports could bounce a spoofed one between them. Also
    /// a UDP datagram's first fragment that would have been: netfilter
    /// rejects the reassembled datagram, and a reject built from the
    /// fragment would quote only part of it.
    RejectSuppressed = 21, "reject_suppressed", Some(Dropped);
    /// A node packet to a frontend that no socket hook translated (a raw
    /// socket, a process outside `--cgroup-root`, SCTP): a new flow
    /// translated at TC egress, as kube-proxy's OUTPUT chain does.
    NodeEgress = 22, "node_egress", Some(Translated);
    /// A node packet translated at egress found no route to its backend
    /// (a backend on the node itself, or no forwarding): dropped.
    NodeRouteFailed = 23, "node_route_failed", Some(Dropped);
    /// A REJECT over its source's budget (`reject_limit`): dropped
    /// unanswered, as the kernel's ICMP rate limit drops its errors.
    RejectLimited = 24, "reject_limited", Some(Dropped);
    /// A TCP segment other than a SYN (an SCTP packet other than an INIT)
    /// to a frontend, with no conntrack entry: dropped, as netfilter drops
    /// INVALID packets, instead of giving a stray segment a backend. Its
    /// flow never existed, or its entry was evicted.
    CtOutOfState = 25, "ct_out_of_state", Some(Dropped);
    /// Not a packet verdict: conntrack entries a flow's first reply moved
    /// from CT_PENDING to CONNTRACK.
    CtPromoted = 26, "ct_promoted", None;
    /// Not a packet verdict: entries the datapath removed from CONNTRACK
    /// (a closed flow's, when a new flow takes its tuple). With
    /// `CtPromoted` and CONNTRACK's entry count the agent derives the
    /// evictions: promoted - released - entries.
    CtReleased = 27, "ct_released", None;
    /// An ICMP or ICMPv6 error about a translated flow, rewritten so that
    /// it names the flow as its client knows it (at ingress for a
    /// masqueraded flow, and again at egress).
    IcmpErrorTranslated = 28, "icmp_error_translated", Some(Translated);
    /// Not a packet verdict: first fragments of an IP datagram whose ports
    /// were remembered, so that its later fragments follow it (`fragment`).
    FragmentFirst = 29, "fragment_first", None;
    /// Not a packet verdict: later fragments that found their first's ports
    /// and went where it went (counted by their verdict too).
    FragmentFollowed = 30, "fragment_followed", None;
    /// Not a packet verdict: packets xdp_ingress decided itself, translated
    /// or dropped (counted by their verdict too); the rest went on to TC.
    XdpFinished = 31, "xdp_finished", None;
}

const _: () = {
    let mut i = 0;
    while i < Counter::ALL.len() {
        assert!(Counter::ALL[i] as usize == i, "counters are listed in slot order");
        i += 1;
    }
    assert!(Counter::ALL.len() as u32 <= crate::maps::MAX_COUNTERS);
};

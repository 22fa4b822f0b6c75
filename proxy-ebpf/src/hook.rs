//! What differs between the hooks that run ingress's decisions, TC and XDP:
//! their verdicts, what a translated packet does next, and what a hook does
//! with the packets it cannot finish. The decisions themselves (parse,
//! conntrack, frontend, backend, NAT) are written once, generic over this
//! trait, as Cilium's programs share their logic between skb and XDP.
//!
//! TC finishes every packet: it hands ICMP errors, fragments, rejects and
//! node sockets' replies to programs of its own by tail call. XDP runs
//! first, on the external devices, and leaves every such packet untouched
//! to TC, which then decides it as if XDP were not there.

use proxy_common::Addr;

use crate::{context::PacketContext, family::Family, packet::Packet};

pub trait Hook: PacketContext {
    /// Left untouched to whatever runs next (for XDP: TC).
    const NOT_OURS: i32;
    const DROP: i32;
    /// Whether the hook finishes every packet itself (TC), or leaves what
    /// needs another of TC's programs to TC, untouched (XDP).
    const FINISHES_ALL: bool;

    /// The interface the packet arrived on (at TC egress: leaves by).
    fn ifindex(&self) -> u32;
    /// Marks the packet for a source rewrite once routing chose where it
    /// goes (`MASQUERADE_MARK`, `REVERSE_NAT_MARK`: see TC egress).
    fn add_mark(&self, bits: u32);
    /// The masquerade source a flow's conntrack entry holds, for a hook
    /// that rewrites the source itself (XDP, sending a frame out). TC
    /// leaves that to TC egress.
    #[inline(always)]
    fn masquerade_source_known(&self, _addr: &Addr, _port: u16) {}
    /// The verdict for a packet translated in place (counted already).
    fn translated<F: Family>(&self) -> i32;
    /// REJECT: the packet becomes the reject and goes back (`NODE`: a node
    /// socket's packet met at egress, into the node's own stack).
    fn reject<const TRACE: bool, F: Family, const NODE: bool>(&self, pkt: &Packet) -> i32;
}

//! Masquerade (SNAT) at TC egress, where routing has chosen the interface and
//! so the node address the flow should leave with. Ingress marks the packets
//! of flows that need it (as kube-proxy's mark-for-masquerade); this side
//! rewrites their source and records where replies go.

use core::num::NonZeroU32;

use aya_ebpf::{Global, helpers::bpf_get_prandom_u32, programs::TcContext};
use proxy_common::{Addr, CT_REPLY, Counter, CtKey, DEFAULT_SNAT_PORTS, SNAT_ADDR_IPV6, SnatEntry};

use crate::{
    conntrack,
    maps::{SNAT, SNAT_ADDRS, count},
    parse::Packet,
};

/// Ports tried after the client's own one is taken.
const PORT_TRIES: u32 = 8;

/// The range random SNAT ports come from (host order, inclusive), set by the
/// agent at load to lie outside the node's ephemeral ports, so a port drawn
/// here is never one a node socket (sent straight to a backend by the socket
/// hooks) can take later. A kept client port can be: see docs/semantics.md.
#[unsafe(no_mangle)]
static SNAT_PORT_MIN: Global<u32> = Global::new(DEFAULT_SNAT_PORTS.0 as u32);
#[unsafe(no_mangle)]
static SNAT_PORT_MAX: Global<u32> = Global::new(DEFAULT_SNAT_PORTS.1 as u32);

/// The source (address, port in network order) this masqueraded flow leaves
/// with: the one chosen for its first packet, else a new one.
#[inline(always)]
pub fn source_for(ctx: &TcContext, pkt: &Packet) -> Option<(Addr, u16)> {
    if let Some(e) = unsafe { SNAT.get(&pkt.tuple) } {
        return Some((e.addr, e.port));
    }
    // The flow's plain reply entry, written at ingress, names the frontend.
    let t = &pkt.tuple;
    let plain_key = conntrack::reply_key(t, &t.dst, t.dport);
    let plain = *conntrack::lookup(&plain_key).filter(|e| e.direction == CT_REPLY)?;
    // Each family's addresses under their own keys (constant per program).
    let family = if pkt.v6 { SNAT_ADDR_IPV6 } else { 0 };
    let ifindex = crate::skb::ifindex(ctx) | family;
    let addr = unsafe { SNAT_ADDRS.get(&ifindex).or_else(|| SNAT_ADDRS.get(&family)) }.copied()?;

    // Keep the client's port when it is free (as Linux NAT does: under
    // connection churn each client tuple keeps its own port, so the table
    // does not run dry), else try random ones from the range; the reply
    // entry's key is the port table.
    let min = SNAT_PORT_MIN.load();
    // NonZero: a division the verifier can see has no panic path.
    let span = NonZeroU32::new(SNAT_PORT_MAX.load().wrapping_sub(min).wrapping_add(1))?;
    let mut port = t.sport;
    for i in 0..=PORT_TRIES {
        if i > 0 {
            port = ((min + unsafe { bpf_get_prandom_u32() } % span) as u16).to_be();
        }
        let snat_key = CtKey { src: t.dst, dst: addr, sport: t.dport, dport: port, proto: t.proto, _pad: [0; 3] };
        if conntrack::claim_snat_reply(&snat_key, &plain, &t.src, t.sport).is_ok() {
            let entry = SnatEntry { addr, port, _pad: [0; 6] };
            if SNAT.insert(&pkt.tuple, &entry, 0).is_err() {
                count(Counter::SnatFailed);
            }
            return Some((addr, port));
        }
    }
    None
}

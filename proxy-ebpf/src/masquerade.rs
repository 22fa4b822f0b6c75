//! Masquerade (SNAT) at TC egress, where routing has chosen the interface and
//! so the node address the flow should leave with. Ingress marks the packets
//! of flows that need it (as kube-proxy's mark-for-masquerade); this side
//! rewrites their source and records where replies go.

use aya_ebpf::{helpers::bpf_get_prandom_u32, programs::TcContext};
use proxy_common::{Addr, CT_REPLY, Counter, CtKey, SnatEntry};

use crate::{
    conntrack,
    maps::{SNAT, SNAT_ADDRS, count},
    parse::Packet,
};

/// Ports tried after the client's own one is taken.
const PORT_TRIES: u32 = 8;
/// The ephemeral range Linux uses by default.
const PORT_MIN: u32 = 32768;
const PORT_SPAN: u32 = 61000 - PORT_MIN;

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
    let ifindex = crate::skb::ifindex(ctx);
    let addr = unsafe { SNAT_ADDRS.get(&ifindex).or_else(|| SNAT_ADDRS.get(&0)) }.copied()?;

    // Keep the client's port when it is free (as Linux NAT does), else try
    // random ones; the reply entry's key is the port table.
    let mut port = t.sport;
    for i in 0..=PORT_TRIES {
        if i > 0 {
            port = ((PORT_MIN + unsafe { bpf_get_prandom_u32() } % PORT_SPAN) as u16).to_be();
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

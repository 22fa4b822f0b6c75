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

/// Random ports tried when the client's own one cannot be kept.
const PORT_TRIES: u32 = 8;

/// The range SNAT ports come from (host order, inclusive), set by the agent
/// at load to lie outside the node's ephemeral ports: the node's own sockets
/// (sent straight to backends by the socket hooks) take ephemeral ports the
/// kernel picks without seeing this table, so a masqueraded flow holding one
/// towards the same backend would take that socket's replies.
#[unsafe(no_mangle)]
static SNAT_PORT_MIN: Global<u32> = Global::new(DEFAULT_SNAT_PORTS.0 as u32);
#[unsafe(no_mangle)]
static SNAT_PORT_MAX: Global<u32> = Global::new(DEFAULT_SNAT_PORTS.1 as u32);

/// The source (address, port in network order) this masqueraded flow leaves
/// with: the one chosen for its first packet, else a new one.
#[inline(always)]
pub fn source_for(ctx: &TcContext, pkt: &Packet) -> Option<(Addr, u16)> {
    let t = &pkt.tuple;
    if let Some(e) = unsafe { SNAT.get(t) } {
        if pkt.closes_connection() {
            conntrack::close_snat_reply(&snat_key(t, &e.addr, e.port));
        }
        return Some((e.addr, e.port));
    }
    // The flow's plain reply entry, written at ingress, names the frontend.
    let plain_key = conntrack::reply_key(t, &t.dst, t.dport);
    let plain = *conntrack::lookup(&plain_key).filter(|e| e.direction == CT_REPLY)?;
    // Each family's addresses under their own keys (constant per program).
    let family = if pkt.v6 { SNAT_ADDR_IPV6 } else { 0 };
    let ifindex = crate::skb::ifindex(ctx) | family;
    let addr = unsafe { SNAT_ADDRS.get(&ifindex).or_else(|| SNAT_ADDRS.get(&family)) }.copied()?;

    // Keep the client's port if it lies in the range and is free (as Linux
    // NAT keeps it), else try random ones from the range; the reply entries
    // are the port table. If the range is full, the client's port even
    // inside the ephemeral range: a flow that may share a node socket's
    // replies rather than one surely dropped.
    let min = SNAT_PORT_MIN.load();
    // NonZero: a division the verifier can see has no panic path.
    let span = NonZeroU32::new(SNAT_PORT_MAX.load().wrapping_sub(min).wrapping_add(1))?;
    let client_port_in_range = (u16::from_be(t.sport) as u32).wrapping_sub(min) < span.get();
    let opens = pkt.opens_connection();
    let mut port = t.sport;
    for i in 0..=PORT_TRIES + 1 {
        let last_resort = i == PORT_TRIES + 1;
        if last_resort {
            port = t.sport;
        } else if i > 0 || !client_port_in_range {
            port = ((min + unsafe { bpf_get_prandom_u32() } % span) as u16).to_be();
        }
        if conntrack::claim_snat_reply(&snat_key(t, &addr, port), &plain, &t.src, t.sport, opens).is_ok() {
            if last_resort {
                count(Counter::SnatPortShared);
            }
            let entry = SnatEntry { addr, port, _pad: [0; 6] };
            if SNAT.insert(t, &entry, 0).is_err() {
                count(Counter::SnatFailed);
            }
            return Some((addr, port));
        }
    }
    None
}

/// The tuple the replies of flow `t` (after DNAT) carry once its source is
/// `addr:port`: the key of its SNAT reply entry.
#[inline(always)]
fn snat_key(t: &CtKey, addr: &Addr, port: u16) -> CtKey {
    CtKey { src: t.dst, dst: *addr, sport: t.dport, dport: port, proto: t.proto, _pad: [0; 3] }
}

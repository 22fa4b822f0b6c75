//! Masquerade (SNAT) at TC egress, where routing has chosen the interface and
//! so the node address the flow should leave with. Ingress marks the packets
//! of flows that need it (as kube-proxy's mark-for-masquerade); this side
//! rewrites their source and records where replies go.

use core::num::NonZeroU32;

use aya_ebpf::{Global, helpers::bpf_get_prandom_u32, programs::TcContext};
use proxy_common::{Addr, CT_REPLY, Counter, CtKey, DEFAULT_SNAT_PORTS, SnatEntry};

use crate::{
    conntrack,
    maps::{SNAT, SNAT_ADDRS, count},
    parse::Packet,
};

/// Ports tried after the client's own one is taken.
const PORT_TRIES: u32 = 8;

/// The SNAT port range (host order, inclusive), set by the agent at load to
/// lie outside the node's ephemeral ports: the node's own sockets (which the
/// socket hooks send straight to backends) then never take a port a
/// masqueraded flow holds towards the same backend, nor the reverse.
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
    let ifindex = crate::skb::ifindex(ctx);
    let addr = unsafe { SNAT_ADDRS.get(&ifindex).or_else(|| SNAT_ADDRS.get(&0)) }.copied()?;

    // Keep the client's port when it is in the range and free (as Linux NAT
    // keeps it when free), else try random ones; the reply entry's key is the
    // port table.
    let min = SNAT_PORT_MIN.load();
    // NonZero: a division the verifier can see has no panic path.
    let span = NonZeroU32::new(SNAT_PORT_MAX.load().wrapping_sub(min).wrapping_add(1))?;
    let client_port = u16::from_be(t.sport) as u32;
    let mut port = t.sport;
    for i in 0..=PORT_TRIES {
        if i > 0 || client_port.wrapping_sub(min) >= span.get() {
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

//! XDP sending a frame it translated out itself, as the stack would have
//! forwarded it: the FIB's route and neighbour, the masquerade TC egress
//! would have done for that interface, TTL - 1; then XDP_TX (the backend is
//! behind the interface the frame came in on) or a redirect to another of
//! the interfaces xdp_ingress is on (`XDP_DEVICES`).
//!
//! Anything else goes up the stack with its handoff, exactly as before this
//! step: a backend behind a pod's veth or on the node itself, a neighbour not
//! resolved yet, forwarding off, a frame over the MTU, TTL 1, a reply
//! (its source rewrite needs TC egress), SCTP (its port rewrite's CRC
//! subprograms would not fit beside this frame on older verifiers) or a
//! masquerade that found no port. `xdp_send_out` is a program of its own,
//! tail-called by xdp_ingress: beside ingress's stack, masquerade's would
//! pass the kernel's 512 bytes.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, xdp_action},
    helpers::bpf_redirect,
    programs::XdpContext,
};
use proxy_common::{Counter, IPPROTO_TCP, IPPROTO_UDP, MASQUERADE_MARK, REVERSE_NAT_MARK};

use crate::{
    context::{PacketContext, read},
    family::V4,
    fragment,
    headers::{ETH_ALEN, IPV4_CSUM_OFF},
    maps::{XDP_DEVICES, count},
    masquerade, nat,
    packet::Packet,
    parse, route, xdp,
};

/// IPv4's TTL and protocol: one 16-bit word of the header checksum.
const IPV4_TTL_OFF: usize = 8;
const IPV4_TOT_LEN_OFF: usize = 2;

/// The verdict for a frame xdp_ingress translated: sent out, or up the stack.
#[inline(always)]
pub fn send_out(ctx: &XdpContext) -> u32 {
    match forward(ctx) {
        Ok(verdict) => verdict,
        Err(Stack) => xdp_action::XDP_PASS,
    }
}

/// The frame goes up the stack (TC finishes it with the handoff's marks).
struct Stack;

#[inline(always)]
fn forward(ctx: &XdpContext) -> Result<u32, Stack> {
    let marks = xdp::handoff_marks(ctx).ok_or(Stack)?;
    if marks & REVERSE_NAT_MARK != 0 {
        return Err(Stack);
    }
    let pkt = parse::parse::<V4>(ctx).map_err(|_| Stack)?;
    // SCTP: see the module's comment. A fragment: `fragment` remembers its
    // ports at TC.
    if (pkt.proto != IPPROTO_TCP && pkt.proto != IPPROTO_UDP) || pkt.fragment != fragment::NOT_FRAGMENT {
        return Err(Stack);
    }
    let ttl_word: [u8; 2] = read(ctx, pkt.l3_off + IPV4_TTL_OFF).ok_or(Stack)?;
    if ttl_word[0] <= 1 {
        // The stack sends the ICMP time-exceeded.
        return Err(Stack);
    }
    let ingress = ctx.ingress_ifindex() as u32;
    let (out, macs) = route(ctx, &pkt, ingress)?;
    // Only out of an interface XDP runs on: counted there.
    let sent = XDP_DEVICES.get_ptr_mut(&out).ok_or(Stack)?;
    if marks & MASQUERADE_MARK != 0 {
        // The source xdp_ingress found in the flow's entry; else, and for a
        // FIN or RST (which closes the SNAT port too), masquerade's lookup.
        // (A rewrite in each arm: one (address, port) beside the other
        // would pass the stack's 512 bytes.)
        let rewritten = match xdp::masquerade_source(ctx) {
            Some((addr, port)) if !pkt.closes_connection() => nat::rewrite_src_tcp_udp::<V4>(ctx, &pkt, &addr, port),
            _ => {
                let (addr, port) = masquerade::source_for::<V4>(ctx, out, &pkt).ok_or(Stack)?;
                nat::rewrite_src_tcp_udp::<V4>(ctx, &pkt, &addr, port)
            }
        };
        if rewritten.is_err() {
            // Half rewritten: nothing can send it on.
            count(Counter::RewriteFailed);
            return Ok(xdp_action::XDP_DROP);
        }
    }
    if decrement_ttl(ctx, pkt.l3_off, ttl_word).is_err() || ctx.store(0, &macs.dmac, 0).is_err() || ctx.store(ETH_ALEN, &macs.smac, 0).is_err() {
        count(Counter::RewriteFailed);
        return Ok(xdp_action::XDP_DROP);
    }
    unsafe { *sent += 1 };
    if out == ingress {
        return Ok(xdp_action::XDP_TX);
    }
    Ok(unsafe { bpf_redirect(out, 0) } as u32)
}

/// The MAC addresses the FIB gives the next hop.
#[derive(Clone, Copy)]
struct Macs {
    smac: [u8; 6],
    dmac: [u8; 6],
}

/// The interface and next hop the FIB routes the (translated) frame by, as
/// for a frame arriving on `ingress` (so forwarding, the MTU and the route
/// are the stack's own). Only a full answer: an unresolved neighbour is the
/// stack's to resolve.
#[inline(always)]
fn route(ctx: &XdpContext, pkt: &Packet, ingress: u32) -> Result<(u32, Macs), Stack> {
    let tot_len = u16::from_be(read::<u16>(ctx, pkt.l3_off + IPV4_TOT_LEN_OFF).ok_or(Stack)?);
    let (rc, fib) = route::lookup::<V4>(ctx, pkt.l3_off, ingress, pkt.proto, tot_len).map_err(|_| Stack)?;
    if rc != BPF_FIB_LKUP_RET_SUCCESS {
        return Err(Stack);
    }
    // SAFETY: a successful lookup filled the MAC addresses.
    let m = unsafe { fib.__bindgen_anon_6.__bindgen_anon_2 };
    Ok((fib.ifindex, Macs { smac: m.smac, dmac: m.dmac }))
}

/// TTL - 1, and the header checksum's word with it.
#[inline(always)]
fn decrement_ttl(ctx: &XdpContext, l3_off: usize, old: [u8; 2]) -> Result<(), i64> {
    let new = [old[0] - 1, old[1]];
    let csum: [u8; 2] = read(ctx, l3_off + IPV4_CSUM_OFF).ok_or(-1i64)?;
    ctx.store(l3_off + IPV4_TTL_OFF, &new, 0)?;
    ctx.store(l3_off + IPV4_CSUM_OFF, &proxy_common::csum::replace2(csum, old, new), 0)
}

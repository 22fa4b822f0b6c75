//! ICMP and ICMPv6 errors about translated flows: what netfilter does for
//! RELATED packets. An error quotes the packet it is about as that packet
//! left the node: addressed to the backend, and from the masquerade address
//! if the flow was masqueraded. The client matches the error to its socket
//! by the quote, so the quote must name the flow as the client sent it, and
//! the error must reach the client:
//! - at ingress, an error about a masqueraded flow (addressed to the
//!   masquerade address) gets the client as its destination and as the
//!   quote's source;
//! - at egress, after routing, the quote's destination becomes the frontend,
//!   and so does the error's source when the backend itself sent it (a router
//!   on the path keeps its own), as a reply's source does.
//!
//! Errors the node itself sends (a forward too big for the next hop's MTU)
//! are only met at egress, which is why egress does its part on its own.
//!
//! Every checksum stays right, by incremental updates: the outer IPv4
//! header's, the ICMP checksum (over the whole message; ICMPv6's over the
//! outer addresses too), the quote's IPv4 header checksum, and its TCP or UDP
//! checksum when the quote holds it. SCTP's CRC32c is left alone: the kernel
//! matches an SCTP error by its verification tag, not its checksum. Only
//! incremental updates: the sum over the packet stays what it was, so a
//! receive checksum a driver computed stays valid.

use aya_ebpf::bindings::BPF_F_PSEUDO_HDR;
use proxy_common::{
    Addr, CT_MASQUERADE, CT_NODE, CT_REPLY, CtKey, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_SCTP, IPPROTO_TCP,
    IPPROTO_UDP, csum,
};

use crate::{
    context::PacketContext,
    conntrack,
    family::Family,
    headers::{ETH_P_IP, ETH_P_IPV6, IPV4_CSUM_OFF, IPV4_SRC_OFF, IPV4_DST_OFF, IPV6_HLEN, IPV6_SRC_OFF, IPV6_DST_OFF, TCP_CSUM_OFF, UDP_CSUM_OFF, ICMP_HLEN, ICMP_CSUM_OFF},
    l2,
};

/// The IP protocol (IPv6: next header) of an IP frame of the program's
/// family; None for anything else (ARP, say, whose bytes at the protocol's
/// place mean something else).
#[inline(always)]
pub fn ip_protocol<F: Family>(ctx: &impl PacketContext) -> Option<u8> {
    let ethertype = l2::ethertype(ctx)?;
    if F::V6 {
        if ethertype != ETH_P_IPV6 {
            return None;
        }
        crate::context::read::<u8>(ctx, l2::l3_off() + 6)
    } else {
        if ethertype != ETH_P_IP {
            return None;
        }
        crate::context::read::<u8>(ctx, l2::l3_off() + 9)
    }
}

/// Whether the frame carries ICMP (ICMPv6 for `V6`): the cheap test egress
/// makes before handing a packet to these programs.
#[inline(always)]
pub fn is_icmp<F: Family>(ctx: &impl PacketContext) -> bool {
    ip_protocol::<F>(ctx) == Some(if F::V6 { IPPROTO_ICMPV6 } else { IPPROTO_ICMP })
}

/// The destination of an IP packet that is no ICMP error about a flow (an
/// echo request, or another protocol than TCP, UDP and SCTP). Only for a
/// frame `ip_protocol` accepted.
#[inline(always)]
pub fn destination<F: Family>(ctx: &impl PacketContext) -> Option<Addr> {
    let l3 = l2::l3_off();
    if F::V6 {
        Some(Addr(ctx.load(l3 + IPV6_DST_OFF).ok()?))
    } else {
        Some(Addr::from_v4_octets(ctx.load(l3 + IPV4_DST_OFF).ok()?))
    }
}

/// The ICMP types that quote a packet: destination unreachable (with
/// fragmentation needed), time exceeded, parameter problem; for ICMPv6 also
/// packet too big.
#[inline(always)]
fn is_error<F: Family>(icmp_type: u8) -> bool {
    if F::V6 { matches!(icmp_type, 1..=4) } else { matches!(icmp_type, 3 | 11 | 12) }
}

/// An ICMP error and the packet it quotes.
struct Error {
    /// The quoted packet's tuple, as quoted (ports in network order).
    quoted: CtKey,
    outer_src: Addr,
    outer_dst: Addr,
    /// Offsets of the ICMP header, the quoted IP header and its L4 header.
    icmp: usize,
    inner_l3: usize,
    inner_l4: usize,
    /// The quote's TCP/UDP checksum field, when the quote reaches it.
    inner_csum: Option<usize>,
}

#[inline(always)]
fn parse<F: Family>(ctx: &impl PacketContext) -> Option<Error> {
    let ethertype = l2::ethertype(ctx)?;
    let l3 = l2::l3_off();
    let (icmp, outer_src, outer_dst) = if F::V6 {
        if ethertype != ETH_P_IPV6 || ctx.load::<u8>(l3 + 6).ok()? != IPPROTO_ICMPV6 {
            return None;
        }
        (l3 + IPV6_HLEN, Addr(ctx.load(l3 + IPV6_SRC_OFF).ok()?), Addr(ctx.load(l3 + IPV6_DST_OFF).ok()?))
    } else {
        let ver_ihl: u8 = ctx.load(l3).ok()?;
        let ihl = ((ver_ihl & 0x0f) as usize) * 4;
        if ethertype != ETH_P_IP || ver_ihl >> 4 != 4 || ihl < 20 || ctx.load::<u8>(l3 + 9).ok()? != IPPROTO_ICMP {
            return None;
        }
        // A fragment of an error may hold part of the quote: left alone.
        if u16::from_be(ctx.load::<u16>(l3 + 6).ok()?) & 0x3fff != 0 {
            return None;
        }
        (l3 + ihl, Addr::from_v4_octets(ctx.load(l3 + IPV4_SRC_OFF).ok()?), Addr::from_v4_octets(ctx.load(l3 + IPV4_DST_OFF).ok()?))
    };
    if !is_error::<F>(ctx.load(icmp).ok()?) {
        return None;
    }
    let inner_l3 = icmp + ICMP_HLEN;
    let (inner_l4, proto, src, dst) = if F::V6 {
        let proto: u8 = ctx.load(inner_l3 + 6).ok()?;
        (inner_l3 + IPV6_HLEN, proto, Addr(ctx.load(inner_l3 + IPV6_SRC_OFF).ok()?), Addr(ctx.load(inner_l3 + IPV6_DST_OFF).ok()?))
    } else {
        let ver_ihl: u8 = ctx.load(inner_l3).ok()?;
        let ihl = ((ver_ihl & 0x0f) as usize) * 4;
        if ver_ihl >> 4 != 4 || ihl < 20 {
            return None;
        }
        let proto: u8 = ctx.load(inner_l3 + 9).ok()?;
        (inner_l3 + ihl, proto, Addr::from_v4_octets(ctx.load(inner_l3 + IPV4_SRC_OFF).ok()?), Addr::from_v4_octets(ctx.load(inner_l3 + IPV4_DST_OFF).ok()?))
    };
    let csum_field = match proto {
        IPPROTO_TCP => Some(TCP_CSUM_OFF),
        IPPROTO_UDP => Some(UDP_CSUM_OFF),
        IPPROTO_SCTP => None,
        _ => return None,
    };
    // Every error quotes at least the first 8 bytes of the L4 header.
    let sport: u16 = ctx.load(inner_l4).ok()?;
    let dport: u16 = ctx.load(inner_l4 + 2).ok()?;
    let inner_csum = csum_field.map(|f| inner_l4 + f).filter(|off| ctx.holds(off + 2));
    Some(Error {
        quoted: CtKey { src, dst, sport, dport, proto, _pad: [0; 3] },
        outer_src,
        outer_dst,
        icmp,
        inner_l3,
        inner_l4,
        inner_csum,
    })
}

/// The conntrack key of a reply to the quoted packet.
#[inline(always)]
fn reply_to(quoted: &CtKey) -> CtKey {
    CtKey { src: quoted.dst, dst: quoted.src, sport: quoted.dport, dport: quoted.sport, ..*quoted }
}

/// Translates the error if it is about a translated flow: `Some(Ok)` when
/// rewritten, `Some(Err)` when a rewrite failed, `None` when it is none of
/// ours. `INGRESS`: undo masquerade; else undo DNAT (see the module doc).
#[inline(always)]
pub fn translate<F: Family, const INGRESS: bool>(ctx: &impl PacketContext) -> Option<Result<(), i64>> {
    let e = parse::<F>(ctx)?;
    let key = reply_to(&e.quoted);
    let ct = conntrack::lookup(&key)?;
    // A node socket's flow: its errors are delivered to the node, which
    // sent the quoted packet itself (not translated here).
    if ct.direction != CT_REPLY || ct.flags & CT_NODE != 0 {
        return None;
    }
    if INGRESS {
        if ct.flags & CT_MASQUERADE == 0 {
            return None;
        }
        let (client, client_port) = (ct.rev_addr, ct.rev_port);
        let to_masquerade_address = e.outer_dst == e.quoted.src;
        Some(rewrite_quoted::<F>(ctx, &e, true, &client, client_port).and_then(|()| {
            if to_masquerade_address { rewrite_outer::<F>(ctx, &e, false, &client) } else { Ok(()) }
        }))
    } else {
        let (frontend, frontend_port) = (ct.nat_addr, ct.nat_port);
        let from_backend = e.outer_src == e.quoted.dst;
        Some(rewrite_quoted::<F>(ctx, &e, false, &frontend, frontend_port).and_then(|()| {
            if from_backend { rewrite_outer::<F>(ctx, &e, true, &frontend) } else { Ok(()) }
        }))
    }
}

/// The `i`th 32-bit word of an address as it is on the wire (IPv4: the
/// address itself).
#[inline(always)]
fn word<F: Family>(addr: &Addr, i: usize) -> [u8; 4] {
    if F::V6 {
        let b = &addr.0[i * 4..i * 4 + 4];
        [b[0], b[1], b[2], b[3]]
    } else {
        addr.v4_octets()
    }
}

/// Folds a change of 2 (`size`) or 4 bytes inside the ICMP message into its
/// checksum (values as loaded from the packet).
#[inline(always)]
fn fold(ctx: &impl PacketContext, e: &Error, old: u32, new: u32, size: u64) -> Result<(), i64> {
    if old == new {
        return Ok(());
    }
    ctx.l4_csum_replace(e.icmp + ICMP_CSUM_OFF, old as u64, new as u64, size)
}

/// Rewrites the quote's source (`source`) or destination address and port,
/// with its checksums and the ICMP checksum.
#[inline(always)]
fn rewrite_quoted<F: Family>(ctx: &impl PacketContext, e: &Error, source: bool, addr: &Addr, port: u16) -> Result<(), i64> {
    let (old_addr, old_port) = if source { (e.quoted.src, e.quoted.sport) } else { (e.quoted.dst, e.quoted.dport) };
    let words = if F::V6 { 4 } else { 1 };
    // The quote's TCP/UDP checksum covers its addresses (pseudo-header) and
    // ports. IPv4 UDP without a checksum (0) keeps none.
    if let Some(off) = e.inner_csum {
        let old: [u8; 2] = ctx.load(off)?;
        if F::V6 || e.quoted.proto != IPPROTO_UDP || old != [0, 0] {
            let mut new = old;
            for i in 0..words {
                new = csum::replace4(new, word::<F>(&old_addr, i), word::<F>(addr, i));
            }
            new = csum::replace2(new, old_port.to_ne_bytes(), port.to_ne_bytes());
            if e.quoted.proto == IPPROTO_UDP && new == [0, 0] {
                // UDP sends a checksum that sums to zero as 0xffff.
                new = [0xff, 0xff];
            }
            fold(ctx, e, u16::from_ne_bytes(old) as u32, u16::from_ne_bytes(new) as u32, 2)?;
            ctx.store(off, &new, 0)?;
        }
    }
    if !F::V6 {
        let off = e.inner_l3 + IPV4_CSUM_OFF;
        let old: [u8; 2] = ctx.load(off)?;
        let new = csum::replace4(old, old_addr.v4_octets(), addr.v4_octets());
        fold(ctx, e, u16::from_ne_bytes(old) as u32, u16::from_ne_bytes(new) as u32, 2)?;
        ctx.store(off, &new, 0)?;
    }
    for i in 0..words {
        let (old, new) = (word::<F>(&old_addr, i), word::<F>(addr, i));
        fold(ctx, e, u32::from_ne_bytes(old), u32::from_ne_bytes(new), 4)?;
    }
    let addr_off = e.inner_l3 + match (F::V6, source) {
        (true, true) => 8,
        (true, false) => 24,
        (false, true) => 12,
        (false, false) => 16,
    };
    if F::V6 {
        ctx.store(addr_off, &addr.0, 0)?;
    } else {
        ctx.store(addr_off, &addr.v4_octets(), 0)?;
    }
    fold(ctx, e, old_port as u32, port as u32, 2)?;
    ctx.store(e.inner_l4 + if source { 0 } else { 2 }, &port, 0)?;
    Ok(())
}

/// Rewrites the error's own source (`source`) or destination address: with
/// the IPv4 header checksum, or ICMPv6's, which covers it.
#[inline(always)]
fn rewrite_outer<F: Family>(ctx: &impl PacketContext, e: &Error, source: bool, addr: &Addr) -> Result<(), i64> {
    let l3 = l2::l3_off();
    let old = if source { e.outer_src } else { e.outer_dst };
    if F::V6 {
        for i in 0..4 {
            let (o, n) = (u32::from_ne_bytes(word::<F>(&old, i)), u32::from_ne_bytes(word::<F>(addr, i)));
            if o != n {
                ctx.l4_csum_replace(e.icmp + ICMP_CSUM_OFF, o as u64, n as u64, BPF_F_PSEUDO_HDR as u64 | 4)?;
            }
        }
        ctx.store(l3 + if source { 8 } else { 24 }, &addr.0, 0)
    } else {
        let h: [u8; 2] = ctx.load(l3 + IPV4_CSUM_OFF)?;
        ctx.store(l3 + IPV4_CSUM_OFF, &csum::replace4(h, old.v4_octets(), addr.v4_octets()), 0)?;
        ctx.store(l3 + if source { 12 } else { 16 }, &addr.v4_octets(), 0)
    }
}

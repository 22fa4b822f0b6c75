//! IPv6 header parsing. Only a fixed 40-byte header followed directly by
//! TCP, UDP or SCTP is translated, or by a Fragment header and UDP (see
//! `fragment`): a packet with other extension headers is reported and left
//! to the kernel.

use proxy_common::{Addr, Counter, CtKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    context::{PacketContext, read},
    headers::{ETH_P_IPV6, IPV6_HLEN, IPV6_SRC_OFF, IPV6_DST_OFF, TCP_HLEN, TCP_FLAGS_OFF, TCP_CSUM_OFF, UDP_HLEN, UDP_CSUM_OFF},
    l2,
    packet::Packet,
};

/// Next-header values that announce an extension header (RFC 8200 4.1 and
/// the IANA list), the Fragment header apart.
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_ESP: u8 = 50;
const NEXTHDR_AUTH: u8 = 51;
const NEXTHDR_DEST: u8 = 60;
const NEXTHDR_MOBILITY: u8 = 135;
const NEXTHDR_HIP: u8 = 139;
const NEXTHDR_SHIM6: u8 = 140;
/// The Fragment header: next header, reserved, offset (13 bits) with M in
/// bit 0, then the 32-bit ID.
const FRAGMENT_HLEN: usize = 8;

/// The IPv6 program's parse; the IPv4 program hands IPv6 frames to it by a
/// tail call, so neither program's stack holds the other's packet.
#[inline(always)]
pub fn parse(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    parse_with::<false, false>(ctx)
}

/// As `parse`, for the fragment programs: a later fragment of a UDP
/// datagram, with its first's ports (see `fragment`).
#[inline(always)]
pub fn parse_fragment(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    parse_with::<false, true>(ctx)
}

/// As `parse`, the addresses loaded straight into the returned packet: 32
/// bytes less stack, for `tc_masquerade6`, which is at the limit.
#[inline(always)]
pub fn parse_in_place(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    parse_with::<true, false>(ctx)
}

#[inline(always)]
fn parse_with<const IN_PLACE: bool, const FRAGMENTS: bool>(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    // skb->protocol sent the frame here; the frame itself must agree (a
    // VLAN tag, say, would put other bytes where the header is read).
    if l2::ethertype(ctx).ok_or(Counter::Malformed)? != ETH_P_IPV6 {
        return Err(Counter::Passed);
    }
    let l3_off = l2::l3_off();
    let version: u8 = ctx.load(l3_off).map_err(|_| Counter::Malformed)?;
    if version >> 4 != 6 {
        return Err(Counter::Malformed);
    }
    let payload_len = u16::from_be(ctx.load::<u16>(l3_off + 4).map_err(|_| Counter::Malformed)?) as usize;
    let l4_off = l3_off + IPV6_HLEN;
    let l4_end = l4_off + payload_len;
    if l4_end > ctx.len() as usize {
        return Err(Counter::Malformed);
    }
    let proto: u8 = ctx.load(l3_off + 6).map_err(|_| Counter::Malformed)?;
    // A Fragment header right after this one: a UDP datagram's first
    // fragment is parsed (`first_fragment`) like a datagram (the caller
    // remembers its ports), a later one by the fragment programs
    // (`FRAGMENTS`, `later_fragment`), anything else left alone. Their own
    // paths, so that the common one keeps its constant offsets (and
    // tc_ingress6 its stack). See `fragment`.
    if proto == NEXTHDR_FRAGMENT {
        // Read straight from the packet (no stack).
        if read::<u8>(ctx, l4_off) != Some(IPPROTO_UDP) {
            return Err(Counter::Fragment);
        }
        let offset = u16::from_be(read::<u16>(ctx, l4_off + 2).ok_or(Counter::Fragment)?) & !0x7;
        return match (FRAGMENTS, offset == 0) {
            (false, true) => first_fragment::<IN_PLACE>(ctx, l4_end),
            (true, false) => later_fragment(ctx, l4_end),
            _ => Err(Counter::Fragment),
        };
    }
    if FRAGMENTS {
        return Err(Counter::Fragment);
    }
    let (l4_hlen, csum_field) = match proto {
        IPPROTO_TCP => (TCP_HLEN, TCP_CSUM_OFF),
        IPPROTO_UDP => (UDP_HLEN, UDP_CSUM_OFF),
        IPPROTO_SCTP => (crate::sctp::COMMON_HEADER_LEN, crate::sctp::CHECKSUM_OFF),
        // A Fragment header after another (or after a first one).
        NEXTHDR_FRAGMENT => return Err(Counter::Fragment),
        NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_ESP | NEXTHDR_AUTH | NEXTHDR_DEST | NEXTHDR_MOBILITY
        | NEXTHDR_HIP | NEXTHDR_SHIM6 => return Err(Counter::ExtensionHeader),
        _ => return Err(Counter::Passed),
    };
    if l4_off + l4_hlen > l4_end {
        return Err(Counter::Malformed);
    }
    let sport: u16 = ctx.load(l4_off).map_err(|_| Counter::Malformed)?;
    let dport: u16 = ctx.load(l4_off + 2).map_err(|_| Counter::Malformed)?;
    let tcp_flags: u8 = match proto {
        IPPROTO_TCP => ctx.load(l4_off + TCP_FLAGS_OFF).map_err(|_| Counter::Malformed)?,
        IPPROTO_SCTP => crate::sctp::opening_flags(ctx.load(l4_off + crate::sctp::COMMON_HEADER_LEN).ok()),
        _ => 0,
    };
    let mut pkt = Packet {
        tuple: CtKey { src: Addr::default(), dst: Addr::default(), sport, dport, proto, _pad: [0; 3] },
        l3_off,
        l4_off,
        l4_csum_off: l4_off + csum_field,
        l4_end,
        proto,
        tcp_flags,
        fragment: crate::fragment::NOT_FRAGMENT,
    };
    if IN_PLACE {
        load_addr(ctx, l3_off + IPV6_SRC_OFF, &mut pkt.tuple.src)?;
        load_addr(ctx, l3_off + IPV6_DST_OFF, &mut pkt.tuple.dst)?;
    } else {
        pkt.tuple.src = Addr(ctx.load(l3_off + IPV6_SRC_OFF).map_err(|_| Counter::Malformed)?);
        pkt.tuple.dst = Addr(ctx.load(l3_off + IPV6_DST_OFF).map_err(|_| Counter::Malformed)?);
    }
    Ok(pkt)
}

/// A UDP datagram's first fragment, after the Fragment header.
#[inline(always)]
fn first_fragment<const IN_PLACE: bool>(ctx: &impl PacketContext, l4_end: usize) -> Result<Packet, Counter> {
    let l3_off = l2::l3_off();
    let l4_off = l3_off + IPV6_HLEN + FRAGMENT_HLEN;
    if l4_off + 8 > l4_end {
        return Err(Counter::Malformed);
    }
    let sport: u16 = ctx.load(l4_off).map_err(|_| Counter::Malformed)?;
    let dport: u16 = ctx.load(l4_off + 2).map_err(|_| Counter::Malformed)?;
    let mut pkt = Packet {
        tuple: CtKey { src: Addr::default(), dst: Addr::default(), sport, dport, proto: IPPROTO_UDP, _pad: [0; 3] },
        l3_off,
        l4_off,
        l4_csum_off: l4_off + UDP_CSUM_OFF,
        l4_end,
        proto: IPPROTO_UDP,
        tcp_flags: 0,
        fragment: crate::fragment::FIRST,
    };
    if IN_PLACE {
        load_addr(ctx, l3_off + IPV6_SRC_OFF, &mut pkt.tuple.src)?;
        load_addr(ctx, l3_off + IPV6_DST_OFF, &mut pkt.tuple.dst)?;
    } else {
        pkt.tuple.src = Addr(ctx.load(l3_off + IPV6_SRC_OFF).map_err(|_| Counter::Malformed)?);
        pkt.tuple.dst = Addr(ctx.load(l3_off + IPV6_DST_OFF).map_err(|_| Counter::Malformed)?);
    }
    Ok(pkt)
}

/// A UDP datagram's later fragment, with its first's ports.
#[inline(always)]
fn later_fragment(ctx: &impl PacketContext, l4_end: usize) -> Result<Packet, Counter> {
    let l3_off = l2::l3_off();
    let id = u32::from_be(ctx.load(l3_off + IPV6_HLEN + 4).map_err(|_| Counter::Malformed)?);
    let key = crate::fragment::key_v6(ctx, l3_off, id, IPPROTO_UDP).ok_or(Counter::Fragment)?;
    let ports = crate::fragment::ports_of(key).ok_or(Counter::Fragment)?;
    Ok(Packet {
        tuple: CtKey { src: key.src, dst: key.dst, sport: ports.sport, dport: ports.dport, proto: IPPROTO_UDP, _pad: [0; 3] },
        l3_off,
        l4_off: l3_off + IPV6_HLEN + FRAGMENT_HLEN,
        l4_csum_off: 0,
        l4_end,
        proto: IPPROTO_UDP,
        tcp_flags: 0,
        fragment: crate::fragment::LATER,
    })
}

/// 16 bytes at `off` straight into `addr`, with no stack copy on the way.
#[inline(always)]
fn load_addr(ctx: &impl PacketContext, off: usize, addr: &mut Addr) -> Result<(), Counter> {
    ctx.load_bytes(off, &mut addr.0).map_err(|_| Counter::Malformed)
}


//! Header parsing with bounds checks. Anything we cannot fully read — short,
//! malformed, not IPv4 TCP/UDP/SCTP — is reported, never guessed at; so is
//! a fragment, but for a UDP datagram's (`fragment`).
//! IPv6 is parsed in `parse6`, by the IPv6 programs.
//!
//! The headers are read straight from the packet (direct packet access),
//! not with bpf_skb_load_bytes: a helper call per field was most of the
//! parse's cost. Headers the skb holds outside its linear part are pulled
//! in first.

use proxy_common::{Addr, Counter, CtKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    context::{PacketContext, read},
    fragment,
    headers::{ETH_HLEN, ETH_P_IP, IPV4_SRC_OFF, IPV4_DST_OFF, TCP_HLEN, TCP_FLAGS_OFF, TCP_CSUM_OFF, UDP_HLEN, UDP_CSUM_OFF},
    l2,
    packet::Packet,
};

const IP_MF_AND_OFFSET: u16 = 0x3fff;
const IP_OFFSET: u16 = 0x1fff;
/// The most `parse` reads: Ethernet (if any), IPv4 with the longest
/// options, TCP.
const MAX_HEADERS: usize = ETH_HLEN + 60 + 20;

// Inlined: as a subprogram its stack frame would add to tc_egress's, past
// the kernel's 512 bytes.
#[inline(always)]
pub fn parse(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    parse_with::<false>(ctx)
}

/// As `parse`, for the fragment programs: a later fragment of a UDP
/// datagram, with its first's ports (see `fragment`).
#[inline(always)]
pub fn parse_fragment(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    parse_with::<true>(ctx)
}

#[inline(always)]
fn parse_with<const FRAGMENTS: bool>(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    if l2::ethertype(ctx).ok_or(Counter::Malformed)? != ETH_P_IP {
        return Err(Counter::Passed);
    }
    // Make every header parse may read linear (or the whole packet, if shorter).
    let want = core::cmp::min(ctx.len() as usize, MAX_HEADERS);
    if ctx.data() + want > ctx.data_end() {
        ctx.pull_data(want as u32).map_err(|_| Counter::Malformed)?;
    }
    let l3_off = l2::l3_off();
    // Read with the next byte: for a one-byte read at an offset the
    // compiler does not know (the link layer's), it turns the bounds check
    // into `at >= end`, which the verifier does not take as one.
    let [ver_ihl, _] = read::<[u8; 2]>(ctx, l3_off).ok_or(Counter::Malformed)?;
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < 20 {
        return Err(Counter::Malformed);
    }
    let total_len = u16::from_be(read::<u16>(ctx, l3_off + 2).ok_or(Counter::Malformed)?) as usize;
    if total_len < ihl || l3_off + total_len > ctx.len() as usize {
        return Err(Counter::Malformed);
    }
    let frag = u16::from_be(read::<u16>(ctx, l3_off + 6).ok_or(Counter::Malformed)?);
    let proto: u8 = read(ctx, l3_off + 9).ok_or(Counter::Malformed)?;
    // A UDP datagram's first fragment is parsed here like a datagram (the
    // caller remembers its ports); any other fragment goes to the fragment
    // programs, whose parse (`FRAGMENTS`) takes a later UDP fragment only.
    // See `fragment`.
    let fragment = match frag & IP_MF_AND_OFFSET {
        0 => fragment::NOT_FRAGMENT,
        f if f & IP_OFFSET == 0 && proto == IPPROTO_UDP => fragment::FIRST,
        f if f & IP_OFFSET != 0 && proto == IPPROTO_UDP => fragment::LATER,
        _ => return Err(Counter::Fragment),
    };
    if FRAGMENTS != (fragment == fragment::LATER) {
        return Err(Counter::Fragment);
    }
    let (l4_hlen, csum_field) = match proto {
        IPPROTO_TCP => (TCP_HLEN, TCP_CSUM_OFF),
        IPPROTO_UDP => (UDP_HLEN, UDP_CSUM_OFF),
        IPPROTO_SCTP => (crate::sctp::COMMON_HEADER_LEN, crate::sctp::CHECKSUM_OFF),
        _ => return Err(Counter::Passed),
    };
    let l4_off = l3_off + ihl;
    if FRAGMENTS {
        let src: [u8; 4] = read(ctx, l3_off + IPV4_SRC_OFF).ok_or(Counter::Malformed)?;
        let dst: [u8; 4] = read(ctx, l3_off + IPV4_DST_OFF).ok_or(Counter::Malformed)?;
        let id = u16::from_be(read::<u16>(ctx, l3_off + 4).ok_or(Counter::Malformed)?);
        let key = fragment::key(&Addr::from_v4_octets(src), &Addr::from_v4_octets(dst), id as u32, proto).ok_or(Counter::Fragment)?;
        let ports = fragment::ports_of(key).ok_or(Counter::Fragment)?;
        return Ok(Packet {
            tuple: v4_tuple(src, dst, ports.sport, ports.dport, proto),
            l3_off,
            l4_off,
            l4_csum_off: 0,
            l4_end: l3_off + total_len,
            proto,
            tcp_flags: 0,
            fragment,
        });
    }
    if l4_off + l4_hlen > l3_off + total_len {
        return Err(Counter::Malformed);
    }
    let src: [u8; 4] = read(ctx, l3_off + IPV4_SRC_OFF).ok_or(Counter::Malformed)?;
    let dst: [u8; 4] = read(ctx, l3_off + IPV4_DST_OFF).ok_or(Counter::Malformed)?;
    let sport: u16 = read(ctx, l4_off).ok_or(Counter::Malformed)?;
    let dport: u16 = read(ctx, l4_off + 2).ok_or(Counter::Malformed)?;
    let tcp_flags: u8 = match proto {
        IPPROTO_TCP => read(ctx, l4_off + TCP_FLAGS_OFF).ok_or(Counter::Malformed)?,
        IPPROTO_SCTP => crate::sctp::opening_flags(read(ctx, l4_off + crate::sctp::COMMON_HEADER_LEN)),
        _ => 0,
    };
    Ok(Packet {
        tuple: v4_tuple(src, dst, sport, dport, proto),
        l3_off,
        l4_off,
        l4_csum_off: l4_off + csum_field,
        l4_end: l3_off + total_len,
        proto,
        tcp_flags,
        fragment,
    })
}

/// The conntrack key of an IPv4 packet, built as ten 32-bit words: built
/// field by field (byte-aligned `Addr`s) it took a call to a byte-wise
/// memset for the zeros, on every packet.
#[inline(always)]
fn v4_tuple(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, proto: u8) -> CtKey {
    // ::ffff:a.b.c.d, as Addr::from_v4_octets lays it out.
    let mapped = u32::from_ne_bytes([0, 0, 0xff, 0xff]);
    let [s0, s1] = sport.to_ne_bytes();
    let [d0, d1] = dport.to_ne_bytes();
    let words: [u32; 10] = [
        0,
        0,
        mapped,
        u32::from_ne_bytes(src),
        0,
        0,
        mapped,
        u32::from_ne_bytes(dst),
        u32::from_ne_bytes([s0, s1, d0, d1]),
        u32::from_ne_bytes([proto, 0, 0, 0]),
    ];
    // CtKey is repr(C): src, dst, sport, dport, proto, 3 bytes of padding.
    unsafe { core::mem::transmute::<[u32; 10], CtKey>(words) }
}

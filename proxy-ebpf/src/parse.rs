//! Header parsing with bounds checks, for the program's family (`Family`).
//! Anything we cannot fully read — short, malformed, not TCP/UDP/SCTP, an
//! IPv6 packet with extension headers — is reported, never guessed at; so
//! is a fragment, but for a UDP datagram's (`fragment`).
//!
//! What differs between the families is the IP header, read by
//! `ipv4_header` or `ipv6_header` (its checks, where the transport header
//! starts and ends, whether the packet is a fragment), and how bytes are
//! read (`load`). The transport header, a later fragment's ports and the
//! packet are done once for both (`transport`, `later_fragment`).
//!
//! IPv4 headers are read straight from the packet (direct packet access),
//! not with bpf_skb_load_bytes: a helper call per field was most of the
//! parse's cost. Headers the skb holds outside its linear part are pulled
//! in first. IPv6 headers are read with the load helper (and written with
//! the store helper, see `nat`).

use proxy_common::{Addr, Counter, CtKey, IPPROTO_SCTP, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    context::{PacketContext, read},
    family::{Family, V4, V6},
    fragment,
    headers::{
        ETH_HLEN, IPV4_DST_OFF, IPV4_SRC_OFF, IPV6_DST_OFF, IPV6_HLEN, IPV6_SRC_OFF, TCP_CSUM_OFF, TCP_FLAGS_OFF,
        TCP_HLEN, UDP_CSUM_OFF, UDP_HLEN,
    },
    l2,
    packet::Packet,
};

const IP_MF_AND_OFFSET: u16 = 0x3fff;
const IP_OFFSET: u16 = 0x1fff;
/// The most an IPv4 parse reads: Ethernet (if any), IPv4 with the longest
/// options, TCP.
const MAX_IPV4_HEADERS: usize = ETH_HLEN + 60 + 20;

/// IPv6 next-header values that announce an extension header (RFC 8200 4.1
/// and the IANA list), the Fragment header apart.
const NEXTHDR_FRAGMENT: u8 = 44;
const NEXTHDR_HOP: u8 = 0;
const NEXTHDR_ROUTING: u8 = 43;
const NEXTHDR_ESP: u8 = 50;
const NEXTHDR_AUTH: u8 = 51;
const NEXTHDR_DEST: u8 = 60;
const NEXTHDR_MOBILITY: u8 = 135;
const NEXTHDR_HIP: u8 = 139;
const NEXTHDR_SHIM6: u8 = 140;
/// The IPv6 Fragment header: next header, reserved, offset (13 bits) with M
/// in bit 0, then the 32-bit ID.
const FRAGMENT_HLEN: usize = 8;

// Inlined: as a subprogram its stack frame would add to tc_egress's, past
// the kernel's 512 bytes.
#[inline(always)]
pub fn parse<F: Family>(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    parse_with::<F, false, false>(ctx)
}

/// As `parse`, for the fragment programs: a later fragment of a UDP
/// datagram, with its first's ports (see `fragment`).
#[inline(always)]
pub fn parse_fragment<F: Family>(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    parse_with::<F, false, true>(ctx)
}

/// As `parse`, an IPv6 packet's addresses loaded straight into the returned
/// packet: 32 bytes less stack, for `tc_masquerade6`, which is at the limit.
#[inline(always)]
pub fn parse_in_place<F: Family>(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    parse_with::<F, true, false>(ctx)
}

/// What the IP header says: where the transport header starts, where the
/// datagram ends (Ethernet padding may follow), its protocol and where the
/// packet stands in its datagram (`fragment`).
struct Ip {
    l3_off: usize,
    l4_off: usize,
    l4_end: usize,
    proto: u8,
    fragment: u8,
}

#[inline(always)]
fn parse_with<F: Family, const IN_PLACE: bool, const FRAGMENTS: bool>(
    ctx: &impl PacketContext,
) -> Result<Packet, Counter> {
    // Not the family's: not ours (the IPv4 programs hand IPv6 frames on by
    // skb->protocol, and the IPv6 ones check the frame agrees: a VLAN tag,
    // say, would put other bytes where the header is read).
    if l2::ethertype(ctx).ok_or(Counter::Malformed)? != F::ETHERTYPE {
        return Err(Counter::Passed);
    }
    if F::V6 { ipv6_header::<IN_PLACE, FRAGMENTS>(ctx) } else { ipv4_header::<FRAGMENTS>(ctx) }
}

#[inline(always)]
fn ipv4_header<const FRAGMENTS: bool>(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    // Make every header parse may read linear (or the whole packet, if shorter).
    ctx.pull_upto(MAX_IPV4_HEADERS).map_err(|_| Counter::Malformed)?;
    let l3_off = l2::l3_off();
    // Read with the next byte: for a one-byte read at an offset the
    // compiler does not know (the link layer's), it turns the bounds check
    // into `at >= end`, which the verifier does not take as one.
    let [ver_ihl, _] = load::<V4, [u8; 2]>(ctx, l3_off)?;
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < 20 {
        return Err(Counter::Malformed);
    }
    let total_len = u16::from_be(load::<V4, u16>(ctx, l3_off + 2)?) as usize;
    if total_len < ihl || !ctx.holds(l3_off + total_len) {
        return Err(Counter::Malformed);
    }
    let frag = u16::from_be(load::<V4, u16>(ctx, l3_off + 6)?);
    let proto: u8 = load::<V4, u8>(ctx, l3_off + 9)?;
    // A UDP datagram's first fragment is parsed like a datagram (the caller
    // remembers its ports), a later one by the fragment programs' parse
    // (`FRAGMENTS`); any other fragment is left alone. See `fragment`.
    let fragment = match frag & IP_MF_AND_OFFSET {
        0 => fragment::NOT_FRAGMENT,
        f if f & IP_OFFSET == 0 && proto == IPPROTO_UDP => fragment::FIRST,
        f if f & IP_OFFSET != 0 && proto == IPPROTO_UDP => fragment::LATER,
        _ => return Err(Counter::Fragment),
    };
    let ip = Ip { l3_off, l4_off: l3_off + ihl, l4_end: l3_off + total_len, proto, fragment };
    transport::<V4, false, FRAGMENTS>(ctx, ip)
}

#[inline(always)]
fn ipv6_header<const IN_PLACE: bool, const FRAGMENTS: bool>(ctx: &impl PacketContext) -> Result<Packet, Counter> {
    let l3_off = l2::l3_off();
    let version: u8 = load::<V6, u8>(ctx, l3_off)?;
    if version >> 4 != 6 {
        return Err(Counter::Malformed);
    }
    let payload_len = u16::from_be(load::<V6, u16>(ctx, l3_off + 4)?) as usize;
    let l4_off = l3_off + IPV6_HLEN;
    let l4_end = l4_off + payload_len;
    if !ctx.holds(l4_end) {
        return Err(Counter::Malformed);
    }
    let proto: u8 = load::<V6, u8>(ctx, l3_off + 6)?;
    // A Fragment header right after this one: a UDP datagram's first or
    // later fragment, anything else left alone. A path of its own (the
    // transport header 8 bytes further), so that the common one keeps its
    // constant offsets (and tc_ingress6 its stack). See `fragment`.
    if proto == NEXTHDR_FRAGMENT {
        // Read straight from the packet (no stack).
        if read::<u8>(ctx, l4_off) != Some(IPPROTO_UDP) {
            return Err(Counter::Fragment);
        }
        let offset = u16::from_be(read::<u16>(ctx, l4_off + 2).ok_or(Counter::Fragment)?) & !0x7;
        let ip = |fragment| Ip { l3_off, l4_off: l4_off + FRAGMENT_HLEN, l4_end, proto: IPPROTO_UDP, fragment };
        // Each with its constant, which decides `transport`'s first branch.
        return if offset == 0 {
            transport::<V6, IN_PLACE, FRAGMENTS>(ctx, ip(fragment::FIRST))
        } else {
            transport::<V6, IN_PLACE, FRAGMENTS>(ctx, ip(fragment::LATER))
        };
    }
    let ip = Ip { l3_off, l4_off, l4_end, proto, fragment: fragment::NOT_FRAGMENT };
    transport::<V6, IN_PLACE, FRAGMENTS>(ctx, ip)
}

/// After the IP header, the same for both families: the transport header's
/// ports, TCP flags (SCTP: whether it opens with an INIT) and the tuple; a
/// later fragment's from its first (the fragment programs only, `FRAGMENTS`).
#[inline(always)]
fn transport<F: Family, const IN_PLACE: bool, const FRAGMENTS: bool>(
    ctx: &impl PacketContext,
    ip: Ip,
) -> Result<Packet, Counter> {
    if FRAGMENTS != (ip.fragment == fragment::LATER) {
        return Err(Counter::Fragment);
    }
    let (l4_hlen, csum_field) = match ip.proto {
        IPPROTO_TCP => (TCP_HLEN, TCP_CSUM_OFF),
        IPPROTO_UDP => (UDP_HLEN, UDP_CSUM_OFF),
        IPPROTO_SCTP => (crate::sctp::COMMON_HEADER_LEN, crate::sctp::CHECKSUM_OFF),
        NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_ESP | NEXTHDR_AUTH | NEXTHDR_DEST | NEXTHDR_MOBILITY | NEXTHDR_HIP
        | NEXTHDR_SHIM6 if F::V6 => return Err(Counter::ExtensionHeader),
        _ => return Err(Counter::Passed),
    };
    if FRAGMENTS {
        return later_fragment::<F>(ctx, ip);
    }
    if ip.l4_off + l4_hlen > ip.l4_end {
        return Err(Counter::Malformed);
    }
    let (src, dst) = v4_addresses::<F>(ctx, ip.l3_off)?;
    let sport: u16 = load::<F, u16>(ctx, ip.l4_off)?;
    let dport: u16 = load::<F, u16>(ctx, ip.l4_off + 2)?;
    let tcp_flags: u8 = match ip.proto {
        IPPROTO_TCP => load::<F, u8>(ctx, ip.l4_off + TCP_FLAGS_OFF)?,
        IPPROTO_SCTP => crate::sctp::opening_flags(load::<F, u8>(ctx, ip.l4_off + crate::sctp::COMMON_HEADER_LEN).ok()),
        _ => 0,
    };
    let tuple = if F::V6 {
        CtKey { src: Addr::default(), dst: Addr::default(), sport, dport, proto: ip.proto, _pad: [0; 3] }
    } else {
        v4_tuple(src, dst, sport, dport, ip.proto)
    };
    let mut pkt = Packet {
        tuple,
        l3_off: ip.l3_off,
        l4_off: ip.l4_off,
        l4_csum_off: ip.l4_off + csum_field,
        l4_end: ip.l4_end,
        proto: ip.proto,
        tcp_flags,
        fragment: ip.fragment,
    };
    // IPv6's addresses straight into the packet (`IN_PLACE`: 16 bytes at a
    // time into it, with no stack copy on the way).
    let l3_off = ip.l3_off;
    if F::V6 && IN_PLACE {
        ctx.load_bytes(l3_off + IPV6_SRC_OFF, &mut pkt.tuple.src.0).map_err(|_| Counter::Malformed)?;
        ctx.load_bytes(l3_off + IPV6_DST_OFF, &mut pkt.tuple.dst.0).map_err(|_| Counter::Malformed)?;
    } else if F::V6 {
        pkt.tuple.src = Addr(ctx.load(l3_off + IPV6_SRC_OFF).map_err(|_| Counter::Malformed)?);
        pkt.tuple.dst = Addr(ctx.load(l3_off + IPV6_DST_OFF).map_err(|_| Counter::Malformed)?);
    }
    Ok(pkt)
}

/// A UDP datagram's later fragment, which has no transport header: the
/// ports are its first's. The key is built in a per-CPU slot (`fragment`).
#[inline(always)]
fn later_fragment<F: Family>(ctx: &impl PacketContext, ip: Ip) -> Result<Packet, Counter> {
    let id = fragment::datagram_id::<F>(ctx, ip.l3_off).ok_or(Counter::Malformed)?;
    let (src, dst) = v4_addresses::<F>(ctx, ip.l3_off)?;
    let key = if F::V6 {
        fragment::key_v6(ctx, ip.l3_off, id, IPPROTO_UDP)
    } else {
        fragment::key(&Addr::from_v4_octets(src), &Addr::from_v4_octets(dst), id, IPPROTO_UDP)
    };
    let key = key.ok_or(Counter::Fragment)?;
    let ports = fragment::ports_of(key).ok_or(Counter::Fragment)?;
    let tuple = if F::V6 {
        CtKey { src: key.src, dst: key.dst, sport: ports.sport, dport: ports.dport, proto: IPPROTO_UDP, _pad: [0; 3] }
    } else {
        v4_tuple(src, dst, ports.sport, ports.dport, IPPROTO_UDP)
    };
    Ok(Packet {
        tuple,
        l3_off: ip.l3_off,
        l4_off: ip.l4_off,
        l4_csum_off: 0,
        l4_end: ip.l4_end,
        proto: IPPROTO_UDP,
        tcp_flags: 0,
        fragment: fragment::LATER,
    })
}

/// The `T` at `off`: IPv4's straight from the packet (the headers were
/// pulled in), IPv6's with the load helper.
#[inline(always)]
fn load<F: Family, T: Copy>(ctx: &impl PacketContext, off: usize) -> Result<T, Counter> {
    if F::V6 { ctx.load(off).map_err(|_| Counter::Malformed) } else { read(ctx, off).ok_or(Counter::Malformed) }
}

/// An IPv4 packet's addresses (IPv6's, 16 bytes each, are loaded into the
/// packet or the fragment key directly). Read before the transport header,
/// in header order: LLVM merges the bounds checks of reads in another order
/// into ones the verifier does not follow.
#[inline(always)]
fn v4_addresses<F: Family>(ctx: &impl PacketContext, l3_off: usize) -> Result<([u8; 4], [u8; 4]), Counter> {
    if F::V6 {
        return Ok(([0; 4], [0; 4]));
    }
    Ok((load::<F, [u8; 4]>(ctx, l3_off + IPV4_SRC_OFF)?, load::<F, [u8; 4]>(ctx, l3_off + IPV4_DST_OFF)?))
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

//! REJECT, built in BPF from the packet itself and sent back out the
//! interface it came in on, for either family (`Family`): a TCP RST for TCP
//! (connect() fails at once with ECONNREFUSED, as kube-proxy's ICMP reject
//! makes it fail), a port unreachable for anything else (ICMP type 3 code
//! 3; ICMPv6 type 1 code 4, RFC 4443), from the address the client dialled.
//! What is a family's own is its IP header's fixed fields (`ip_header`),
//! the ICMP type and code, and that ICMPv6's checksum covers a
//! pseudo-header, ICMP's not.
//!
//! A packet from a local socket may carry CHECKSUM_PARTIAL: whoever sends
//! it on (a NIC, or the kernel for a device without offload) will sum the
//! bytes from the original L4 header to the end and store the result at a
//! fixed offset (16 for TCP, 6 for UDP). The frames below are laid out so that
//! completion produces the right checksum: the RST keeps the TCP header where
//! it was (its checksum field holds the pseudo-header seed when partial). For
//! UDP the offset falls on the ICMP header's unused word: ICMP's is left
//! zero, which keeps a valid ICMP checksum valid; ICMPv6's gets the
//! pseudo-header seed, so completion makes the whole sum right (receivers
//! ignore the unused word).

use aya_ebpf::{macros::map, maps::PerCpuArray};
use proxy_common::{IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP};

use crate::{
    context::PacketContext,
    family::Family,
    headers::{ETH_ALEN, ETH_HLEN, ICMP_HLEN, IPV4_HLEN, IPV6_HLEN, TCP_CSUM_OFF, TCP_HLEN, UDP_CSUM_OFF},
    l2,
    packet::Packet,
};

/// Room to build a REJECT's frame off the stack; not pinned, per CPU.
#[map]
static SCRATCH: PerCpuArray<[u8; OUT_LEN]> = PerCpuArray::with_max_entries(1, 0);

/// What the port unreachable quotes: the original IP header and the first
/// 8 bytes of its payload (RFC 792; for IPv6 the ports, all a receiver
/// needs to find the socket, well within the minimum MTU).
const QUOTED_PAYLOAD: usize = 8;
/// The largest frame built here (the ICMPv6 one), with an Ethernet header
/// (left out on an L3 device, see `l2::store_frame`).
pub const OUT_LEN: usize = ETH_HLEN + IPV6_HLEN + ICMP_HLEN + IPV6_HLEN + QUOTED_PAYLOAD;
/// The IP header in the frame.
const IP: usize = ETH_HLEN;

/// Rewrites the packet into the reject; the caller redirects it. The IPv4
/// one is a subprogram of its own (older verifiers sum every frame of a
/// call chain, rounded up to 32 bytes, against 512, and the lookup path
/// uses most of it); everything is built in a per-CPU scratch frame, not on
/// the stack.
#[inline(always)]
pub fn reject<F: Family>(ctx: &impl PacketContext, pkt: &Packet) -> Result<(), i64> {
    if F::V6 { build::<F>(ctx, pkt) } else { reject_v4(ctx, pkt) }
}

#[inline(never)]
fn reject_v4(ctx: &impl PacketContext, pkt: &Packet) -> Result<(), i64> {
    build::<crate::family::V4>(ctx, pkt)
}

/// Only a packet with the fixed header gets here: IPv4 options (fixed sizes
/// keep the verifier simple; the caller drops those) and IPv6 extension
/// headers (`parse` leaves them alone) are not handled.
#[inline(always)]
fn build<F: Family>(ctx: &impl PacketContext, pkt: &Packet) -> Result<(), i64> {
    let l3 = l2::l3_off();
    let ip_hlen = if F::V6 { IPV6_HLEN } else { IPV4_HLEN };
    if pkt.l3_off != l3 || pkt.l4_off != l3 + ip_hlen {
        return Err(-1);
    }
    let l4 = IP + ip_hlen;
    let buf = unsafe { &mut *SCRATCH.get_ptr_mut(0).ok_or(-1i64)? };
    buf.fill(0);
    // Ethernet: back to the sender (loads of a constant length: the verifier
    // rejects a length it cannot bound below).
    if l2::has_ethernet() {
        ctx.load_bytes(ETH_ALEN, &mut buf[..ETH_ALEN])?;
        ctx.load_bytes(0, &mut buf[ETH_ALEN..2 * ETH_ALEN])?;
        buf[12..14].copy_from_slice(&F::ETHERTYPE.to_be_bytes());
    }
    // From the address the client dialled, back to the client: the
    // addresses swapped (source then destination in both headers).
    let addr_len = (F::DST_OFF - F::SRC_OFF) as usize;
    ctx.load_bytes(l3 + F::DST_OFF, &mut buf[IP + F::SRC_OFF..IP + F::DST_OFF])?;
    ctx.load_bytes(l3 + F::SRC_OFF, &mut buf[IP + F::DST_OFF..IP + F::DST_OFF + addr_len])?;
    let tcp = pkt.tuple.proto == IPPROTO_TCP;
    let icmp_len = ICMP_HLEN + ip_hlen + QUOTED_PAYLOAD;
    let payload = if tcp { TCP_HLEN } else { icmp_len };
    let proto = match (tcp, F::V6) {
        (true, _) => IPPROTO_TCP,
        (false, false) => IPPROTO_ICMP,
        (false, true) => IPPROTO_ICMPV6,
    };
    ip_header::<F>(buf, payload, proto);

    if tcp {
        // The segment's header, loaded where the reset's goes, then rewritten.
        let tcp: &mut [u8; TCP_HLEN] = (&mut buf[l4..l4 + TCP_HLEN]).try_into().map_err(|_| -1i64)?;
        ctx.load_bytes(l3 + ip_hlen, tcp)?;
        reset_in_place(tcp, (pkt.l4_end - pkt.l4_off) as u32);
    } else {
        // The original IP header and the 8 bytes after it.
        ctx.load_bytes(l3, &mut buf[l4 + ICMP_HLEN..l4 + icmp_len])?;
        let (icmp_type, code) = if F::V6 { (1, 4) } else { (3, 3) };
        buf[l4] = icmp_type;
        buf[l4 + 1] = code;
    }
    ctx.change_tail((l3 + ip_hlen + payload) as u32, 0)?;
    // Probe before the final write, on the offset completion would write
    // (ICMP's checksum is whole whatever completion does, see above).
    let pseudo_header = tcp || F::V6;
    let completed_at = l3 + ip_hlen + if tcp { TCP_CSUM_OFF } else { UDP_CSUM_OFF };
    let partial = pseudo_header && ctx.checksum_is_partial(completed_at, false)?;
    // Pseudo-header (RFC 793, RFC 8200 8.1): addresses, upper-layer length,
    // protocol. Summed after the helper calls: LLVM would otherwise load the
    // bytes before them and keep them on the stack across.
    let addresses = &buf[IP + F::SRC_OFF..IP + F::DST_OFF + addr_len];
    let pseudo = if pseudo_header { sum(addresses, payload as u32 + proto as u32) } else { 0 };
    if tcp {
        let csum = if partial { fold(pseudo) } else { !fold(sum(&buf[l4..l4 + TCP_HLEN], pseudo)) };
        buf[l4 + TCP_CSUM_OFF..l4 + TCP_CSUM_OFF + 2].copy_from_slice(&csum.to_be_bytes());
    } else if partial {
        buf[l4 + UDP_CSUM_OFF..l4 + UDP_CSUM_OFF + 2].copy_from_slice(&fold(pseudo).to_be_bytes());
    } else {
        let csum = !fold(sum(&buf[l4..l4 + icmp_len], pseudo));
        buf[l4 + 2..l4 + 4].copy_from_slice(&csum.to_be_bytes());
    }
    // A store of a fixed size, within the new length.
    match (tcp, F::V6) {
        (true, false) => l2::store_frame::<{ IPV4_HLEN + TCP_HLEN }>(ctx, buf),
        (false, false) => l2::store_frame::<{ IPV4_HLEN + ICMP_HLEN + IPV4_HLEN + QUOTED_PAYLOAD }>(ctx, buf),
        (true, true) => l2::store_frame::<{ IPV6_HLEN + TCP_HLEN }>(ctx, buf),
        (false, true) => l2::store_frame::<{ IPV6_HLEN + ICMP_HLEN + IPV6_HLEN + QUOTED_PAYLOAD }>(ctx, buf),
    }
}

/// The IP header's fields but the addresses: version, lengths, protocol, a
/// TTL (hop limit) of 64, and IPv4's header checksum.
#[inline(always)]
fn ip_header<F: Family>(buf: &mut [u8; OUT_LEN], payload: usize, proto: u8) {
    if F::V6 {
        let ip = &mut buf[IP..IP + IPV6_HLEN];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&(payload as u16).to_be_bytes());
        ip[6] = proto;
        ip[7] = 64;
    } else {
        let ip = &mut buf[IP..IP + IPV4_HLEN];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&((IPV4_HLEN + payload) as u16).to_be_bytes());
        ip[8] = 64;
        ip[9] = proto;
        let csum = fold(sum(ip, 0));
        ip[10..12].copy_from_slice(&(!csum).to_be_bytes());
    }
}

pub use proxy_common::{
    csum::{fold, sum},
    tcp::reset_in_place,
};

//! REJECT, built in BPF from the packet itself and sent back out the
//! interface it came in on: a TCP RST for TCP (connect() fails at once with
//! ECONNREFUSED, as kube-proxy's ICMP reject makes it fail), ICMP port
//! unreachable for anything else.
//!
//! A packet from a local socket may carry CHECKSUM_PARTIAL: whoever sends
//! it on (a NIC, or the kernel for a device without offload) will sum the
//! bytes from the original L4 header to the end and store the result at a
//! fixed offset (16 for TCP, 6 for UDP). The frames below are laid out so that
//! completion produces the right checksum: the RST keeps the TCP header where
//! it was (its checksum field holds the pseudo-header seed when partial), and
//! for UDP the offset falls on the ICMP header's unused word, left zero, which
//! keeps a valid ICMP checksum valid.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use proxy_common::IPPROTO_TCP;

use crate::{
    context::PacketContext,
    headers::{ETH_HLEN, ETH_ALEN, ETH_P_IP, IPV4_HLEN, ICMP_HLEN, TCP_CSUM_OFF, TCP_HLEN},
    l2,
    packet::Packet,
};

/// Room to build a REJECT's frame off the stack; not pinned, per CPU.
#[map]
static SCRATCH: PerCpuArray<[u8; OUT_LEN]> = PerCpuArray::with_max_entries(1, 0);

/// RFC 792: the original IP header and the first 8 bytes of its payload.
const QUOTE_LEN: usize = IPV4_HLEN + 8;
const ICMP_L3_LEN: usize = IPV4_HLEN + ICMP_HLEN + QUOTE_LEN;
const RST_L3_LEN: usize = IPV4_HLEN + TCP_HLEN;
/// The largest frame built here (the ICMP one), with an Ethernet header
/// (left out on an L3 device, see `l2::store_frame`).
pub const OUT_LEN: usize = ETH_HLEN + ICMP_L3_LEN;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const IPPROTO_ICMP: u8 = 1;

/// Rewrites the packet into the reject; the caller redirects it (and keeps
/// this subprogram's stack frame small: older verifiers sum every frame of
/// a call chain, rounded up to 32 bytes, against 512). Packets with IP options are not handled (fixed
/// sizes keep the verifier simple): the caller drops those. Not inlined, and
/// built in a per-CPU scratch buffer: the BPF stack (512 bytes for all
/// frames) is already used by the lookup path.
#[inline(never)]
pub fn reject(ctx: &impl PacketContext, pkt: &Packet) -> Result<(), i64> {
    let l3 = l2::l3_off();
    if pkt.l3_off != l3 || pkt.l4_off - pkt.l3_off != IPV4_HLEN {
        return Err(-1);
    }
    let buf = unsafe { &mut *SCRATCH.get_ptr_mut(0).ok_or(-1i64)? };
    buf.fill(0);
    // Ethernet: back to the sender (fixed-size loads: the verifier rejects a
    // length it cannot bound below).
    if l2::has_ethernet() {
        buf[..ETH_ALEN].copy_from_slice(&ctx.load::<[u8; ETH_ALEN]>(ETH_ALEN)?);
        buf[ETH_ALEN..2 * ETH_ALEN].copy_from_slice(&ctx.load::<[u8; ETH_ALEN]>(0)?);
        buf[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
    }
    let orig_ip: [u8; IPV4_HLEN] = ctx.load(l3)?;

    let len = if pkt.tuple.proto == IPPROTO_TCP { tcp_rst(ctx, buf, &orig_ip)? } else { icmp_unreachable(ctx, buf, &orig_ip)? };
    // IPv4 header: from the address the client dialled, back to the client.
    let ip = &mut buf[ETH_HLEN..ETH_HLEN + IPV4_HLEN];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((len - ETH_HLEN) as u16).to_be_bytes());
    ip[8] = 64;
    ip[12..16].copy_from_slice(&orig_ip[16..20]);
    ip[16..20].copy_from_slice(&orig_ip[12..16]);
    let ip_csum = fold(sum(ip, 0));
    ip[10..12].copy_from_slice(&(!ip_csum).to_be_bytes());

    // Probe before the final write, on the frame's own checksum field.
    let new_len = (l3 + len - ETH_HLEN) as u32;
    let partial = pkt.tuple.proto == IPPROTO_TCP && {
        ctx.change_tail(new_len, 0)?;
        ctx.checksum_is_partial(l3 + IPV4_HLEN + TCP_CSUM_OFF)?
    };
    // Stores of a fixed size, within the new length.
    if pkt.tuple.proto == IPPROTO_TCP {
        finish_tcp_checksum(buf, partial);
        l2::store_frame::<RST_L3_LEN>(ctx, buf)
    } else {
        ctx.change_tail(new_len, 0)?;
        l2::store_frame::<ICMP_L3_LEN>(ctx, buf)
    }
}

/// The reset, its TCP header loaded where the segment's was (map memory, not
/// the stack) and rewritten in place.
fn tcp_rst(ctx: &impl PacketContext, buf: &mut [u8; OUT_LEN], orig_ip: &[u8; IPV4_HLEN]) -> Result<usize, i64> {
    let total = u16::from_be_bytes([orig_ip[2], orig_ip[3]]) as u32;
    buf[ETH_HLEN + 9] = IPPROTO_TCP;
    let tcp: &mut [u8; TCP_HLEN] = (&mut buf[ETH_HLEN + IPV4_HLEN..ETH_HLEN + RST_L3_LEN]).try_into().map_err(|_| -1i64)?;
    ctx.load_bytes(l2::l3_off() + IPV4_HLEN, tcp)?;
    reset_in_place(tcp, total.saturating_sub(IPV4_HLEN as u32));
    Ok(ETH_HLEN + RST_L3_LEN)
}

/// The TCP checksum: the pseudo-header seed alone when the packet is
/// CHECKSUM_PARTIAL (completion adds the header), else the full sum.
fn finish_tcp_checksum(buf: &mut [u8; OUT_LEN], partial: bool) {
    let ip = ETH_HLEN;
    let tcp = ETH_HLEN + IPV4_HLEN;
    let mut pseudo = sum(&buf[ip + 12..ip + 20], 0);
    pseudo += IPPROTO_TCP as u32 + TCP_HLEN as u32;
    let csum = if partial { fold(pseudo) } else { !fold(sum(&buf[tcp..tcp + TCP_HLEN], pseudo)) };
    buf[tcp + 16..tcp + 18].copy_from_slice(&csum.to_be_bytes());
}

fn icmp_unreachable(ctx: &impl PacketContext, buf: &mut [u8; OUT_LEN], orig_ip: &[u8; IPV4_HLEN]) -> Result<usize, i64> {
    let icmp = ETH_HLEN + IPV4_HLEN;
    let quote = icmp + ICMP_HLEN;
    buf[quote..quote + IPV4_HLEN].copy_from_slice(orig_ip);
    buf[quote + IPV4_HLEN..quote + QUOTE_LEN].copy_from_slice(&ctx.load::<[u8; 8]>(l2::l3_off() + IPV4_HLEN)?);
    buf[ETH_HLEN + 9] = IPPROTO_ICMP;
    buf[icmp] = ICMP_DEST_UNREACH;
    buf[icmp + 1] = ICMP_PORT_UNREACH;
    let csum = !fold(sum(&buf[icmp..icmp + ICMP_HLEN + QUOTE_LEN], 0));
    buf[icmp + 2..icmp + 4].copy_from_slice(&csum.to_be_bytes());
    Ok(ETH_HLEN + ICMP_L3_LEN)
}

pub use proxy_common::{
    csum::{fold, sum},
    tcp::reset_in_place,
};
